"""QA 81: training with bf16 resident weights (`parallel.param_dtype=bf16`) as a user who trusts the fp32 masters
sees it, through the real Trainer (one process: DistributedRuntime at world size 1; and two gloo ranks, dp=2).

Defects found (both fixed):
- A checkpoint resumed by a DistributedRuntime (dp=2 say) took the resident weights from the checkpoint's stored
  weight copies, and the fp32 masters from the masters. A bf16 run's weight copies are its masters rounded to bf16,
  so a bf16 run resumed with fp32 weights (`parallel.param_dtype=fp32`, dp=2) trained its first step, and evaluated,
  with bf16-rounded weights while the optimizer held the fp32 masters (every weight off its master after the resume:
  28 of 28 on a one-process DistributedRuntime, checked by hand). One process (LocalRuntime) already read the
  masters. Now the weights are refreshed from the loaded masters (moe-parallel DistributedAdamW.refresh_weights):
  fp32 weights are the masters, bf16 weights the masters rounded, as after every step; a resume on the same layout
  stays bitwise.
- `parallel.param_dtype=bf16` with `parallel.strategy=fsdp` ran: the FSDP2 baseline cast the model to bf16 and
  torch AdamW updated the bf16 weights with bf16 moments, no fp32 master anywhere (config.py promises them in the
  optimizer). Now refused by validate, naming parallel.param_dtype and its value, before any work.

Guards that held: the resident bf16 weights equal the masters rounded to bf16 after every step, a skipped step
(an infinite loss) included, and after a resume; a skipped step leaves weights and masters as they were; a Ctrl-C +
resume equals the unbroken run bitwise on dp=2 (losses, grad norms, evals, every checkpoint tensor); the
checkpoint holds fp32 masters (the weight copies in bf16 next to them); a bf16 checkpoint resumed on one process
with fp32 weights gives the masters exactly; an fp32 checkpoint resumed with bf16 weights gives its fp32 weights
rounded (and the masters rounded); export-hf of a bf16 run writes the fp32 masters (fp32 export: bitwise),
and transformers loads it and computes our model's logits; an fp32 run with the same seed (and the same skipped
step) stays within 5e-3 of the bf16 run's losses and eval losses, 1% of its grad norms; activation checkpointing
(full, mlp), train.compile, distributed_optimizer=false, fp32_grad_accum=false and a capacity factor with bf16
weights train (checked by hand, 3 steps each; test_qa77 compiles a bf16 dp=2 ep=2 run).

On the code before the fixes, test_a_bf16_dp2_run_resumes_bitwise_and_on_fp32_weights_from_its_masters and
test_bf16_with_the_fsdp_baseline_is_refused_naming_the_field fail; the one-process test passes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
import nonfinite_loss_worker  # noqa: E402
import qa81_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from test_parallel_harness import small_config  # noqa: E402

from moe_ckpt import LoadRequest, open_checkpoint  # noqa: E402
from moe_train.config import Config, ConfigError, validate  # noqa: E402
from moe_train.hf_bridge import export_hf, import_hf, open_checkpoint_source  # noqa: E402
from moe_train.model import Transformer  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402

N = 2  # a save (and an eval) every N steps; a run is 2N steps


def _config(root: Path, name: str, data: Path, param_dtype: str = "bf16", exportable: bool = True,
            **train) -> Config:
    """small_config with `param_dtype` weights; exportable: no expert bias and no qk-norm (Qwen2-MoE: small_config's
    network has no transformers class to export to)."""
    cfg = small_config(root, **{"steps": 2 * N, "eval_interval": N, "log_interval": 1, "save_interval": N,
                                "keep_last": 3, "eval_windows": 4, "device": "cpu", **train})
    cfg.data.path, cfg.train.run_dir, cfg.parallel.param_dtype = str(data), str(root / name), param_dtype
    if exportable:
        cfg.model.router.expert_bias, cfg.model.qk_norm = False, False
    return cfg


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _steps(run: Path) -> list[tuple]:
    """(step, loss, aux_loss, grad_norm) of each step record, the numbers as str (a skipped step's null compares)."""
    return [(r["step"], *(str(r[k]) for k in ("loss", "aux_loss", "grad_norm"))) for r in _records(run) if "loss" in r]


def _evals(run: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in _records(run) if "eval_loss" in r}


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _tensors(run: Path, step: int = 2 * N) -> dict[str, torch.Tensor]:
    files = sorted(_checkpoint(run, step).glob("*.safetensors"))
    return {f"{f.name}/{k}": t for f in files for k, t in load_file(f).items()}


def _assert_same_run(run: Path, want: Path) -> None:
    """Bitwise: every step's loss, aux loss and grad norm, every eval, and every tensor of the last checkpoint."""
    assert _steps(run) == _steps(want) and len(_steps(want)) == 2 * N
    assert _evals(run) == _evals(want)
    got, expected = _tensors(run), _tensors(want)
    assert sorted(got) == sorted(expected)
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"{len(differ)} of {len(expected)} tensors differ, e.g. {differ[:3]}"


def _masters(checkpoint: Path) -> dict[str, torch.Tensor]:
    """{weight name: its global fp32 master} read from the checkpoint (any layout wrote it)."""
    ckpt = open_checkpoint(checkpoint)
    try:
        names = [n[len("optim."):-len(".master")] for n in ckpt.names if n.endswith(".master")]
        return {n: ckpt.read([LoadRequest(f"optim.{n}.master")])[f"optim.{n}.master"] for n in names}
    finally:
        ckpt.close()


def _resumed_weights(root: Path, name: str, data: Path, checkpoint: Path, param_dtype: str,
                     exportable: bool = True) -> dict[str, torch.Tensor]:
    """The weights a Trainer with `param_dtype` weights resumes from `checkpoint` (one process; restored only)."""
    (root / name / "checkpoints").mkdir(parents=True)
    shutil.copytree(checkpoint, root / name / "checkpoints" / checkpoint.name)
    trainer = Trainer(_config(root, name, data, param_dtype, exportable, eval_interval=0))
    trainer.restore(trainer.resume_point())
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    if param_dtype == "bf16":
        assert w.weights_off_masters(trainer.runtime) == []
    trainer.runtime.close()
    return weights


def _watch_steps(trainer: Trainer, into: list[dict]) -> None:
    """After each step of `trainer` (a skipped one too): {"skipped", "off" (weights not the masters rounded),
    "weights"}."""
    train_step = trainer._train_step

    def watched() -> dict:
        skipped = trainer.skipped_steps
        out = train_step()
        into.append({"skipped": trainer.skipped_steps > skipped, "off": w.weights_off_masters(trainer.runtime),
                     "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}})
        return out

    trainer._train_step = watched


def test_one_process_bf16_run_keeps_its_fp32_masters_through_a_skip_a_resume_and_an_export(tmp_path, data_dir):
    """One process, bf16 weights (DistributedRuntime, world size 1), step 2's loss +inf. Each step: the weights are
    the masters rounded to bf16; the skipped step changes nothing. An fp32 run of the same seed stays close. The
    checkpoint's masters are fp32; opened
    with fp32 weights they are the weights exactly; an fp32 checkpoint opened with bf16 weights gives them rounded.
    export-hf writes the masters, and transformers computes our fp32 model's logits from it."""
    watched: list[dict] = []
    trainer = Trainer(_config(tmp_path, "straight", data_dir, max_skipped_steps=2))
    assert type(trainer.runtime).__name__ == "DistributedRuntime"
    nonfinite_loss_worker.poison_loss(trainer)  # the loss of step 2 (trainer.step 1) is +inf
    _watch_steps(trainer, watched)
    assert trainer.train()["skipped_steps"] == 1
    assert [s["skipped"] for s in watched] == [False, True, False, False]
    assert all(s["off"] == [] for s in watched)
    assert all(torch.equal(watched[0]["weights"][n], t) for n, t in watched[1]["weights"].items())
    assert all(t.dtype == torch.bfloat16 for t in watched[0]["weights"].values())

    straight = tmp_path / "straight"

    # fp32 weights, same seed, the same poisoned step: the bf16 run's numbers, to bf16 rounding
    trainer = Trainer(_config(tmp_path, "fp32", data_dir, "fp32", max_skipped_steps=2))
    nonfinite_loss_worker.poison_loss(trainer)
    trainer.train()
    bf16_steps, fp32_steps = _steps(straight), _steps(tmp_path / "fp32")
    assert [s for s, *_ in bf16_steps] == [s for s, *_ in fp32_steps] == list(range(1, 2 * N + 1))
    for (_, a, _, ga), (_, b, _, gb) in zip(bf16_steps, fp32_steps):
        if a == b == "None":  # the skipped step: no loss, no grad norm
            assert ga == gb == "None"
            continue
        a, b, ga, gb = float(a), float(b), float(ga), float(gb)
        assert abs(a - b) < 5e-3 and abs(ga - gb) < 1e-2 * gb
    evals_bf16, evals_fp32 = _evals(straight), _evals(tmp_path / "fp32")
    assert sorted(evals_bf16) == [0, N, 2 * N]
    assert all(abs(evals_bf16[s] - evals_fp32[s]) < 5e-3 for s in evals_bf16)

    # the checkpoint: fp32 masters, bf16 weight copies that are them rounded
    saved = _tensors(straight, N)
    masters = _masters(_checkpoint(straight, N))
    assert masters and all(t.dtype == torch.float32 for t in masters.values())
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in masters.values())  # fp32 precision in use
    for n, t in masters.items():
        (copy,) = [v for k, v in saved.items() if k.split("/", 1)[1].startswith(f"{n}[")]
        assert copy.dtype == torch.bfloat16 and torch.equal(copy, t.to(torch.bfloat16)), n
    # resumed with fp32 weights: the masters; an fp32 run's checkpoint resumed with bf16 weights: those rounded
    weights = _resumed_weights(tmp_path, "as_fp32", data_dir, _checkpoint(straight, N), "fp32")
    assert all(torch.equal(weights[n], t) for n, t in masters.items())
    fp32_weights = _masters(_checkpoint(tmp_path / "fp32", N))
    weights = _resumed_weights(tmp_path, "as_bf16", data_dir, _checkpoint(tmp_path / "fp32", N), "bf16")
    assert all(torch.equal(weights[n], t.to(torch.bfloat16)) for n, t in fp32_weights.items())

    # export-hf of the bf16 run: its fp32 masters, loaded by transformers
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    export_hf(straight, out, dtype="fp32")
    last = _masters(_checkpoint(straight, 2 * N))
    _, state = import_hf(out)
    assert all(torch.equal(state[n], t) for n, t in last.items())
    with open_checkpoint_source(straight) as (cfg, source):
        ours = Transformer(cfg.model)
        ours.load_state_dict({n: source(n) for n in ours.state_dict()}, strict=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - ours.eval()(ids)[0]).abs().max().item() < 2e-5


def test_a_bf16_dp2_run_resumes_bitwise_and_on_fp32_weights_from_its_masters(tmp_path, data_dir):
    """dp=2 (gloo), bf16 weights: 2N steps straight against stopped by Ctrl-C in step N+1 and resumed from N, bitwise,
    the weights the masters rounded on every rank at each end. The straight run's last checkpoint opened by a dp=2 run
    with fp32 weights: its weights are the masters (before, the bf16 weight copies widened: every weight off), and
    one process (bf16 or fp32) reads the same masters."""
    out = tmp_path / "ranks"
    out.mkdir()
    ports = [h.free_port() for _ in range(4)]
    h.start_ranks(h.run_guarded, args=(w.bf16_runs, str(out), ports, str(tmp_path), str(data_dir), N), nprocs=2)
    results = h.load_results(out, 2)
    for r, result in enumerate(results):
        assert "error" not in result, f"rank {r}: {result.get('error')}"
        assert "SIGINT" in result["stopped"], result["stopped"]
        assert result["off"] == {"straight": [], "stopped": [], "resumed": [], "fp32": []}, f"rank {r}"
        assert result["dtype"] == ["torch.float32"]
    straight = tmp_path / "straight"
    _assert_same_run(tmp_path / "split", straight)
    assert len(list(_checkpoint(straight, 2 * N).glob("*.safetensors"))) == 2
    masters = _masters(_checkpoint(straight, 2 * N))
    weights = _resumed_weights(tmp_path, "one", data_dir, _checkpoint(straight, 2 * N), "bf16", exportable=False)
    assert all(torch.equal(weights[n], t.to(torch.bfloat16)) for n, t in masters.items())


def test_bf16_with_the_fsdp_baseline_is_refused_naming_the_field(tmp_path, data_dir):
    """The FSDP2 baseline's torch AdamW keeps no fp32 masters: bf16 weights there are refused by validate, naming
    parallel.param_dtype and its value, before a run folder or a process group exists (it trained with bf16 AdamW
    moments and weights, no master). fp32 weights and the ddp strategy's bf16 stay allowed."""
    cfg = _config(tmp_path, "fsdp", data_dir, save_interval=0)
    cfg.parallel.strategy = "fsdp"
    with pytest.raises(ConfigError, match=r"parallel\.param_dtype='bf16'.*strategy='fsdp'"):
        Trainer(cfg)
    assert not (tmp_path / "fsdp").exists()
    cfg.parallel.param_dtype = "fp32"
    validate(cfg)
    validate(_config(tmp_path, "ddp", data_dir))
