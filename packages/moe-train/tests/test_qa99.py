"""QA 99: a stopped run resumes on another parallel layout as if it never stopped (README: checkpoints resume on
any layout; moe-ckpt: topology-agnostic), through the real Trainer on gloo ranks on the CPU.

Explored first with a seeded random sweep (46 pairs, 5 steps, stop after 1-4): world 1-4, dp = world, every ep
dividing gcd(dp, E) for E in 0 (dense), 2, 3, 4, 6, 8, 12, sharded or all-reduce optimizer, fp32 or bf16 resident
weights, fp32 or bf16 gradient accumulation, every micro-batch x grad_accum split of 12 sequences, dense + MoE
layers, top-1..3, softmax / sigmoid, shared expert (gated or not), expert bias, tied embeddings, q/k/v biases,
async saves, a leftover step-N.tmp, random routing on the same layout. Everything held: the state a layout restores
is the checkpoint bit for bit (masters, moments, step counts, expert bias, sampler, RNG; weights = masters rounded to
the layout's dtype); fp32 -> fp32 on another layout: losses, grad norms and eval losses within 1.6e-7 relative of
the unbroken run at the new layout (0 in most); with bf16 weights on either side within 1.4e-4 (the bf16 rounding
of other reduction orders); the same layout: bitwise. These tests keep the strongest of those pairs.

Defects found (fixed in moe_train/trainer/checkpoint.py and moe_ckpt/rng.py): a checkpoint whose metadata.json
lacks the run's model config resumed a changed network unchecked (top_k 2 -> 3 trained on); one whose sampler or
rng entry was damaged stopped after the start event, with its weights loaded, on `KeyError: 'seq_len'`,
`KeyError: 'torch_cpu'` or numpy's `IndexError: tuple index out of range`; one whose metadata step disagreed with
its folder resumed at the metadata's step while the start event named the folder's. Each is now refused before
the start event, naming the field, what was expected and the way back.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import qa99_worker as w  # noqa: E402

from moe_ckpt import ChecksumMismatchError, CorruptMetadataError, load_metadata  # noqa: E402
from moe_train.config import ConfigError, RouterConfig  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402
from metadata_edit import rewrite_metadata  # noqa: E402

pytestmark = pytest.mark.slow
AFTER = range(w.STOP + 1, w.STEPS + 1)  # the steps a resumed run takes


@pytest.fixture(scope="module")
def runs(tmp_path_factory, _prepared_data):
    root = tmp_path_factory.mktemp("qa99")
    threads = torch.get_num_threads()  # restored below: later tests in this worker keep theirs
    torch.set_num_threads(1)
    try:
        c = lambda name, **kw: w.run_config(root / name, _prepared_data, **kw)  # noqa: E731
        # one process (LocalRuntime, fp32), 4 x 3 sequences: stopped after step 2 with its log past the checkpoint
        Trainer(c("one", micro_batch_size=4)).train()
        w.stopped_copy(root / "one", root / "one_to_dp2")
        w.stopped_copy(root / "one", root / "one_restored")
        ep2_bf16 = dict(dp=2, ep=2, micro_batch_size=3, param_dtype="bf16")  # sharded optimizer, 3 x 2 per rank
        w.spawn(2, [
            ("train", c("dp2", dp=2, micro_batch_size=6, sharded=False), None),  # all-reduce optimizer, 6 x 1 per rank
            ("train", c("one_to_dp2", dp=2, micro_batch_size=6, sharded=False), None),
            ("restore", c("one_restored", **ep2_bf16), str(root / "one_as_ep2_bf16")),
            ("train", c("ep2_bf16", **ep2_bf16), None),
            ("stop", c("ep2_bf16_stopped", **ep2_bf16), None),
            ("train", c("ep2_bf16_stopped", **ep2_bf16), None),
        ], root / "spawn")
        # three ranks, dp=3 ep=3 (two of the six experts each), sharded, fp32, 2 x 2 per rank
        dp3ep3 = dict(dp=3, ep=3, micro_batch_size=2)
        w.stopped_copy(root / "one", root / "one_to_dp3ep3")
        w.stopped_copy(root / "ep2_bf16", root / "ep2_bf16_restored3")
        w.spawn(3, [
            ("train", c("dp3ep3", **dp3ep3), None),
            ("train", c("one_to_dp3ep3", **dp3ep3), None),
            ("restore", c("ep2_bf16_restored3", **dp3ep3), str(root / "ep2_bf16_as_dp3ep3")),
        ], root / "spawn3")
        # one process again, fp32, 2 x 6 sequences, from the bf16 ep=2 run's checkpoint
        w.stopped_copy(root / "ep2_bf16", root / "ep2_bf16_restored")
        w.restore_and_save(c("ep2_bf16_restored", micro_batch_size=2), root / "ep2_bf16_as_one")
        w.stopped_copy(root / "ep2_bf16", root / "ep2_bf16_to_one")
        Trainer(c("ep2_bf16_to_one", micro_batch_size=2)).train()
        return root
    finally:
        torch.set_num_threads(threads)


def master(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A parameter's fp32 master: optim.X.master, or X itself in a one-process checkpoint (stored once)."""
    return state.get(f"optim.{name}.master", state.get(name))


@pytest.mark.parametrize(("source", "restored", "dtype"), [
    ("one", "one_as_ep2_bf16", torch.bfloat16),  # one process, fp32 -> dp=2 ep=2, sharded, bf16 weights
    ("ep2_bf16", "ep2_bf16_as_one", torch.float32),  # and back: masters of a sharded ep=2 run -> one process
    ("ep2_bf16", "ep2_bf16_as_dp3ep3", torch.float32),  # dp=2 ep=2 bf16 -> dp=3 ep=3 fp32: other expert slices
])
def test_another_layout_restores_the_checkpoint_bit_for_bit(runs, source, restored, dtype):
    src_path, got_path = w.checkpoint_of(runs / source, w.STOP), w.checkpoint_of(runs / restored, w.STOP)
    src, got = w.tensors(src_path), w.tensors(got_path)
    params = sorted(n[len("optim."):-len(".exp_avg")] for n in src if n.endswith(".exp_avg"))
    assert params == sorted(n[len("optim."):-len(".exp_avg")] for n in got if n.endswith(".exp_avg"))
    assert any("experts" in n for n in params) and any("shared_expert" in n for n in params)
    for name in params:
        assert torch.equal(master(got, name), master(src, name)), name
        assert got[name].dtype == dtype and torch.equal(got[name], master(src, name).to(dtype)), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[f"optim.{name}.{key}"], src[f"optim.{name}.{key}"]), (name, key)
    biases = [n for n in src if n.endswith("expert_bias")]
    assert len(biases) == 2 and all(src[n].abs().sum() > 0 for n in biases)  # two MoE layers' bias, moved
    for name in biases:
        assert torch.equal(got[name], src[name]), name
    meta_src, meta_got = load_metadata(src_path), load_metadata(got_path)
    for key in ("step", "skipped_steps", "sampler", "rng", "first_eval_loss", "last_eval_loss"):
        assert meta_got[key] == meta_src[key], key
    assert meta_got["layout"]["world_size"] != meta_src["layout"]["world_size"]


@pytest.mark.parametrize(("resumed", "unbroken"), [("one_to_dp2", "dp2"), ("one_to_dp3ep3", "dp3ep3")])
def test_a_run_stopped_on_one_process_goes_on_at_another_layout_as_the_unbroken_run_there(runs, resumed, unbroken):
    """fp32 on both sides: the resumed run is the unbroken run at its new layout, to the rounding of another
    reduction order (seen: 0 to 1.6e-7 relative in the sweep)."""
    resumed, unbroken, first = runs / resumed, runs / unbroken, runs / "one"
    log = w.records(resumed)
    assert [r["resumed_from_step"] for r in log if r.get("event") == "start"] == [None, w.STOP]
    steps = [r["step"] for r in log if "loss" in r]
    assert steps == list(range(1, w.STEPS + 1))  # the first run's records past its checkpoint were dropped
    got, want, before = (w.by_step(d, "loss") for d in (resumed, unbroken, first))
    assert all(got[s] == before[s] for s in range(1, w.STOP + 1))  # its own history, kept
    # the grad norm, summed over every weight, moves more: up to 1.0e-6 relative at dp3ep3 on the data of Python
    # 3.12's stdlib (1.2e-7 on 3.11's, loss 1.5e-7)
    for key, rel in (("loss", 1e-6), ("grad_norm", 4e-6)):
        g, u = w.by_step(resumed, key), w.by_step(unbroken, key)
        assert all(abs(g[s] - u[s]) <= rel * abs(u[s]) for s in AFTER), (key, g, u)
    evals, want_evals = w.by_step(resumed, "eval_loss"), w.by_step(unbroken, "eval_loss")
    assert sorted(evals) == [0, w.STOP, w.STEPS] and abs(evals[w.STEPS] - want_evals[w.STEPS]) <= 1e-6
    end, end_want = w.checkpoint_of(resumed, w.STEPS), w.checkpoint_of(unbroken, w.STEPS)
    assert load_metadata(end)["sampler"] == load_metadata(end_want)["sampler"]
    a, b = w.tensors(end), w.tensors(end_want)
    for name in b:
        if name.endswith(".step") or name.endswith("expert_bias"):  # counts; the bias moves by ±rate per step
            assert torch.equal(a[name], b[name]), name
        else:  # AdamW divides by sqrt(v): a gradient near zero magnifies a 1e-7 difference (sweep: up to 3.5e-5)
            assert (a[name] - b[name]).abs().max() <= 1e-4, name


def test_a_run_stopped_by_ctrl_c_resumes_bit_for_bit_on_its_own_layout(runs):
    """dp=2 ep=2, sharded optimizer, bf16 weights: stopped by Ctrl-C in step 3, resumed from step 2."""
    stopped, unbroken = runs / "ep2_bf16_stopped", runs / "ep2_bf16"
    ends = [r for r in w.records(stopped) if r.get("event") == "end"]
    assert [e["status"] for e in ends] == ["interrupted", "completed"] and ends[0]["step"] == w.STOP, ends
    for key in ("loss", "grad_norm", "eval_loss"):
        assert w.by_step(stopped, key) == w.by_step(unbroken, key), (key, w.by_step(stopped, key),
                                                                      w.by_step(unbroken, key))
    a, b = w.tensors(w.checkpoint_of(stopped, w.STEPS)), w.tensors(w.checkpoint_of(unbroken, w.STEPS))
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    assert all(torch.equal(a[n], b[n]) for n in b), [n for n in b if not torch.equal(a[n], b[n])]


def test_a_bf16_ep2_checkpoint_goes_on_in_one_fp32_process_near_the_unbroken_fp32_run(runs):
    """The exact part (masters, moments, counts) is the restore test above; the two steps before the stop trained
    bf16-rounded weights, so the losses after it are near the fp32 run's (sweep: within 1.4e-4; here 1.8e-5)."""
    got, want = w.by_step(runs / "ep2_bf16_to_one", "loss"), w.by_step(runs / "one", "loss")
    assert sorted(got) == list(range(1, w.STEPS + 1))
    assert all(abs(got[s] - want[s]) <= 2e-4 * abs(want[s]) for s in AFTER), (got, want)


# ---- what must be refused, before the run takes a step ------------------------------------------------------------

def _resume(runs: Path, data: Path, tmp_path: Path, source: str = "one", edit=None, **config):  # noqa: ANN001, ANN202
    """(run folder, its metrics.jsonl, a Config resuming it on one process with `config`): a copy of `source`
    stopped after step 2, its checkpoint changed by `edit`."""
    run = w.stopped_copy(runs / source, tmp_path / "run")
    if edit is not None:
        edit(w.checkpoint_of(run, w.STOP))
    return run, (run / "metrics.jsonl").read_text(), w.run_config(run, data, **config)


@pytest.mark.parametrize(("config", "message"), [
    pytest.param(dict(model=w.model_config(num_experts=4)), "model.num_experts: checkpoint 6, this run 4", id="E"),
    pytest.param(dict(model=w.model_config(shared_expert_hidden=0)),
                 "model.shared_expert_hidden: checkpoint 16, this run 0", id="shared-expert"),
    pytest.param(dict(model=w.model_config(dense_layers=[1])), r"model.dense_layers: checkpoint \[0\], this run \[1\]",
                 id="dense-layers"),
    pytest.param(dict(dp=4, ep=4, micro_batch_size=3), "parallel.ep=4: expected a divisor of model.num_experts=6",
                 id="ep-not-dividing-E"),
])
def test_another_network_or_an_ep_that_does_not_divide_the_experts_is_refused_before_a_step(
        runs, _prepared_data, tmp_path, config, message):
    run, before, cfg = _resume(runs, _prepared_data, tmp_path, **config)
    with pytest.raises(ConfigError, match=message):
        Trainer(cfg).train()
    assert (run / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-00000002"]


def _edit_metadata(change):  # noqa: ANN001, ANN202
    def edit(checkpoint: Path) -> None:
        meta = json.loads((checkpoint / "metadata.json").read_text())
        change(meta)
        rewrite_metadata(checkpoint / "metadata.json", meta)
    return edit


TOP_3 = w.model_config(router=RouterConfig(top_k=3, expert_bias=True, lb_loss_weight=0.0))


@pytest.mark.parametrize(("change", "model", "message"), [
    # no model config to compare: this top-3 run used to train on from the top-2 checkpoint
    pytest.param(lambda m: m.pop("config"), TOP_3,
                 r"config.model=None, expected the model config of the run that wrote it", id="no-config"),
    pytest.param(lambda m: m["config"].pop("model"), TOP_3, r"config.model=None", id="no-model-config"),
    # these stopped after the start event, the weights loaded, on KeyError: 'seq_len' / 'torch_cpu' / IndexError
    pytest.param(lambda m: m.update(sampler={}), None, r"sampler.samples_seen=None, expected an integer >= 0",
                 id="empty-sampler"),
    pytest.param(lambda m: m["rng"].pop("torch_cpu"), None, r"rng state has no 'torch_cpu'", id="rng-key-missing"),
    pytest.param(lambda m: m["rng"].update(numpy=m["rng"]["numpy"][:2]), None,
                 r"rng state 'numpy' is not a generator state", id="rng-numpy-cut"),
    # resumed at the metadata's step 3 from step 2's state, the start event saying 2
    pytest.param(lambda m: m.update(step=3), None, r"step=3, expected 2 \(the step of its folder, step-00000002",
                 id="step-not-the-folders"),
])
def test_a_damaged_metadata_entry_is_refused_naming_it_before_the_start(runs, _prepared_data, tmp_path, change,
                                                                        model, message):
    run, before, cfg = _resume(runs, _prepared_data, tmp_path, edit=_edit_metadata(change), model=model)
    with pytest.raises(CorruptMetadataError, match=message) as err:
        Trainer(cfg).train()
    assert "metadata.json" in str(err.value) and "cannot be resumed from" in str(err.value)  # and the way back
    assert (run / "metrics.jsonl").read_text() == before  # not even a start event


def test_a_truncated_shard_of_a_two_rank_checkpoint_fails_the_one_process_resume_before_a_step(
        runs, _prepared_data, tmp_path):
    def truncate(checkpoint: Path) -> None:
        shard = checkpoint / "shard-00001-of-00002.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])

    run, before, cfg = _resume(runs, _prepared_data, tmp_path, source="ep2_bf16", edit=truncate, micro_batch_size=2)
    with pytest.raises(ChecksumMismatchError, match=r"shard-00001-of-00002.safetensors has \d+ bytes, index.json "
                                                    r"says \d+: truncated .* cannot be resumed from"):
        Trainer(cfg).train()
    after = (run / "metrics.jsonl").read_text()
    added = [json.loads(line) for line in after[len(before):].splitlines()]
    assert after.startswith(before) and [r.get("event") for r in added] == ["start", "end"]
    assert added[1]["status"] == "failed" and added[1]["step"] == 0
