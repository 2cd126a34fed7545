"""QA 106: run folders written by older moe-train releases, under the current code.

What was tried (by hand, each version's own CLI and config names, code from `git archive <commit> packages` run with
this venv; a ~8K-parameter tiny model on a folder that 0.5.0's prepare-data wrote; 4 steps saved, then this code):
0.3.0 (cf41cf9), 0.4.0 (4568f17), 0.5.0 (9fbaecc), 0.9.0 (c489331), 0.12.0 (0587659), 0.15.0 (75b46f9), 0.17.0
(633125c), 0.19.0 (e1288cc), each on 1 process (0.3.0 with its train.eval_batches: 2 and 4 batches of 2); 0.5.0,
0.12.0 and 0.19.0 also on 2 gloo ranks with dp=2, ep=2; 0.5.0 / 0.12.0 / 0.19.0 with parallel.param_dtype=bf16;
0.5.0 with an expert bias and a shared expert, with top_k=1, with random routing, and tied embeddings (0.12.0 too);
0.12.0 with shared_expert_gate, attention_bias, rotary_fraction=0.5, routed_scaling_factor=2.5, grad_accum=2 and
async_save. With this code: every run resumed to step 8 and its step records, grad norms and eval losses equal this
code's own 4 + 4 run (0.5.0's own AdamW differs from today's in the last bit of some weights at step 4, 1e-8); the
dp2/ep2 runs resumed on dp2/ep2 and on 1 process, 1-process runs on dp2/ep2, bf16-resident runs on fp32; `inspect`
names the layout and step; `train.init_from` (1 process and dp2/ep2) loads every weight bit for bit (the fp32
masters of a bf16 run); `export-hf --dtype fp32` (stock Qwen3-MoE, and `--custom-code` for the 0.12.0 feature run)
loads in transformers 5 within 1.5e-8 of the checkpoint's weights in our model. Refusals seen are one line and name
the fix: another data.seq_len, top_k=1 with normalize_top_k=true (resumes with it false, as the README says),
--no-resume over the old checkpoints, a metrics.jsonl of a completed run without checkpoints, export of random
routing without --allow-benchmark-routing; 0.3.0's 8 eval windows resumed with 4 warn and name train.eval_windows=8,
which is the same set (0.4.0 with 8 logs 0.3.0's eval losses). The embedded corpus (tiny preset: 3 MB, vocab 2048)
tokenizes to the same bytes under 0.12.0 and this code.

Defects found: none. Noted, not defects: a run saved before 0.15.5 resumes with first_eval_loss None in its summary
(the code says so: those checkpoints do not record it); a checkpoint of 0.5.0 does not store the number of training
windows, so a resume on other data of that era is not warned about (resume_checks.train_data_change says so).

The tests below keep three of those runs (tests/data/old_runs, written by make_old_runs.py from git history, which
documents each commit and command): each was trained 6 steps by its own version and cut back to its step-4
checkpoint, so the records of steps 5 and 6 in its metrics.jsonl are the old code's own continuation.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moe_train.cli import main
from moe_train.config_io import config_from_dict
from moe_train.model import Transformer
from moe_train.trainer.init_from import check_init_source, load_initial_weights
from moe_train.trainer.loop import Trainer

OLD_RUNS = Path(__file__).parent / "data" / "old_runs"
# 0.9.0's run routes at random (its generators' saved state then decides the experts): the trainer says so each time
pytestmark = pytest.mark.filterwarnings("ignore:model.router.routing='random' is a benchmark mode:UserWarning")
STEP4 = "checkpoints/step-00000004"


@pytest.fixture
def old_run(tmp_path, monkeypatch):
    """old_run(version) -> a copy of that version's run folder, the cwd set so its relative data.path (`data`) and
    train.run_dir (`<version>`) name the copies."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(OLD_RUNS / "data", tmp_path / "data")

    def copy(version: str) -> Path:
        return Path(shutil.copytree(OLD_RUNS / version, tmp_path / version))

    return copy


def stored_config(run: Path):
    return config_from_dict(json.loads((run / STEP4 / "metadata.json").read_text())["config"])


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def continuation(recs: list[dict]) -> dict[str, float]:
    """The step-5/6 losses, grad norms and the step-6 eval loss of a metrics.jsonl."""
    out = {}
    for r in recs:
        if r.get("step") in (5, 6) and "loss" in r:
            out[f"loss{r['step']}"], out[f"grad_norm{r['step']}"] = r["loss"], r["grad_norm"]
        if r.get("step") == 6 and "eval_loss" in r:
            out["eval6"] = r["eval_loss"]
    return out


def checkpoint_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model's weights read straight from the shards' `name[a:b,...]` pieces, not through moe-ckpt: a bf16-resident
    run's fp32 masters (`optim.<name>.masterflat`) in place of its bf16 copies; a tied head as the embedding."""
    pieces: dict[str, list] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for key in h.keys():
                name, box = re.fullmatch(r"(.*)\[(.*)\]", key).groups()
                if name.startswith("optim.") and not name.endswith(".masterflat"):
                    continue
                ranges = [tuple(map(int, s.split(":"))) for s in box.split(",")] if box else []
                pieces.setdefault(name, []).append((ranges, h.get_tensor(key)))
    state = {}
    for name, parts in pieces.items():
        if not parts[0][0]:
            state[name] = parts[0][1]
            continue
        whole = torch.full([max(r[i][1] for r, _ in parts) for i in range(len(parts[0][0]))], float("nan"))
        for r, t in parts:
            whole[tuple(slice(a, b) for a, b in r)] = t.float()
        state[name] = whole
    for name in [n for n in state if n.endswith(".masterflat")]:
        weight = name[len("optim."):-len(".masterflat")]
        state[weight] = state.pop(name).reshape(state[weight].shape)
    state.setdefault("lm_head.weight", state["embed.weight"])
    assert not any(t.isnan().any() for t in state.values())
    return state


def model_from_checkpoint(run: Path) -> Transformer:
    """Our model with the checkpoint's weights, routing as export-hf does (a random-routing run's router as learned)."""
    cfg = stored_config(run).model
    cfg.router.routing = "learned"
    model = Transformer(cfg)
    model.load_state_dict(checkpoint_weights(run / STEP4), strict=True)
    return model.eval()


# -- resume -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version, layout", [
    ("0.5.0", {}),                                                      # LocalRuntime, as it was written
    ("0.9.0", {}),                                                      # bf16 weights, fp32 masters; random routing
    # dp2 x ep2 -> 1 process; 2 micro-batches of 1 sequence, as each rank's: the same balancing loss per micro-batch
    ("0.12.0", {"parallel.dp": 1, "parallel.ep": 1, "train.grad_accum": 2}),
])
def test_old_run_resumes_as_its_own_version_continued(old_run, version, layout):
    run = old_run(version)
    expected = continuation(records(run))
    assert set(expected) == {"loss5", "grad_norm5", "loss6", "grad_norm6", "eval6"}
    cfg = stored_config(run)
    cfg.parallel.backend = "auto"
    for dotted, value in layout.items():
        section, field = dotted.split(".")
        setattr(getattr(cfg, section), field, value)
    summary = Trainer(cfg).train()
    assert summary["step"] == 6
    recs = records(run)
    steps = [r["step"] for r in recs if "loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6]  # the old run's records past step 4 rewound, each step logged once
    got = continuation(recs)
    for key, value in expected.items():  # same data order, RNG, optimizer state and eval set as the old run
        assert math.isfinite(got[key]) and got[key] == pytest.approx(value, abs=2e-5), key
    meta = json.loads((run / "checkpoints/step-00000006/metadata.json").read_text())
    assert meta["step"] == 6 and meta["sampler"]["samples_seen"] == 12


def test_old_bf16_resident_run_resumes_with_fp32_weights(old_run):
    run = old_run("0.9.0")
    expected = continuation(records(run))
    cfg = stored_config(run)
    cfg.parallel.param_dtype = "fp32"  # LocalRuntime now: its weights are the old run's fp32 masters
    assert Trainer(cfg).train()["step"] == 6
    got = continuation(records(run))
    for key in ("loss5", "loss6", "eval6"):  # the bf16 rounding of the weights is gone: close, not equal
        assert math.isfinite(got[key]) and abs(got[key] - expected[key]) < 1e-3, key


# -- inspect, init_from, export-hf --------------------------------------------------------------------------------
@pytest.mark.parametrize("version, ranks", [("0.5.0", 1), ("0.12.0", 2)])
def test_inspect_of_an_old_run_names_its_layout_and_step(old_run, capsys, version, ranks):
    run = old_run(version)
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"written by {ranks} rank{'s' if ranks > 1 else ''}" in out and "step: 4" in out
    assert f"'dp': {ranks}, 'ep': {ranks}" in out
    assert "blocks.1.mlp.experts.w_gate_up" in out


@pytest.mark.parametrize("version", ["0.5.0", "0.9.0", "0.12.0"])
def test_init_from_an_old_run_loads_every_weight_bit_for_bit(old_run, version):
    run = old_run(version)
    cfg = stored_config(run)
    cfg.parallel.dp = cfg.parallel.ep = 1
    cfg.parallel.param_dtype = "fp32"
    cfg.train.run_dir, cfg.train.init_from = "fresh", str(run)
    trainer = Trainer(cfg)
    load_initial_weights(check_init_source(cfg), trainer.runtime, trainer.model)  # what train() does at step 0
    want = checkpoint_weights(run / STEP4)
    got = trainer.model.state_dict()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.to(got[name].dtype)), name


@pytest.mark.parametrize("version, flags", [("0.5.0", []), ("0.9.0", ["--allow-benchmark-routing"]), ("0.12.0", [])])
def test_export_hf_of_an_old_run_matches_its_checkpoint_in_transformers(old_run, version, flags):
    transformers = pytest.importorskip("transformers")
    run = old_run(version)
    out = run.parent / "hf"
    assert main(["export-hf", str(run), str(out), "--dtype", "fp32", *flags]) == 0
    assert (out / "tokenizer.json").is_file()  # found through the old run's data.path
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ours = model_from_checkpoint(run)
    ids = torch.randint(0, stored_config(run).model.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)[0]).abs().max() < 1e-6
