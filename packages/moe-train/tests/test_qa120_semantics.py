"""QA 120: the trainer computes what its config says, at the edges.

Each expected value is computed here independently of the trainer (a plain torch loop, the README's formulas by
hand, the eval split read with numpy), on CPU in fp32 with a very small MoE (conftest's small_config).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from moe_train.config import ConfigError, validate
from moe_train.model import Transformer
from moe_train.trainer.loop import Trainer
from moe_train.trainer.runtime import LocalRuntime
from moe_train.trainer.schedule import lr_at
from test_parallel_harness import small_config

QUIET = dict(eval_interval=0, save_interval=0, log_interval=1)


def make(tmp_path, **train):
    """conftest's small_config on one thread: the tests share two cores, where torch's threads only wait."""
    return small_config(tmp_path, **{"threads": 1, **train})


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in records(run_dir) if "loss" in r}


def eval_records(run_dir) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in records(run_dir) if "eval_loss" in r}


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def saved_steps(run_dir) -> list[int]:
    root = Path(run_dir) / "checkpoints"
    return sorted(int(p.name.split("-")[1]) for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))


def readme_lr(s: int, lr: float, warmup: int, steps: int, min_ratio: float, schedule: str,
              decay_fraction: float = 0.2) -> float:
    """The lr of 1-based step s as the README words it: step s of the warmup at lr * s / warmup; after it each shape
    starts at lr and would reach lr * min_ratio at step steps + 1; wsd holds lr, then a line down over the last
    max(2, decay_fraction * steps) steps (never inside the warmup)."""
    if s <= warmup:
        return lr * s / warmup
    floor = lr * min_ratio
    if schedule == "constant":
        return lr
    if schedule == "wsd":
        decay_steps = max(2, round(decay_fraction * steps))
        first = max(warmup + 1, steps - decay_steps + 1)  # the first step of the decay runs at lr
        return lr if s < first else lr + (floor - lr) * (s - first) / (steps + 1 - first)
    x = (s - 1 - warmup) / (steps - warmup)
    if schedule == "linear":
        return lr + (floor - lr) * x
    return floor + (lr - floor) * (1 + math.cos(math.pi * x)) / 2


# -- 1. equivalences --------------------------------------------------------------------------------------------

def _final_weights(cfg) -> dict[str, torch.Tensor]:
    trainer = Trainer(cfg)
    trainer.train()
    return weights(trainer)


def test_grad_accum_times_micro_batch_gives_the_same_weights_without_the_balancing_loss(tmp_path, data_dir):
    """4x1, 1x4 and 2x2 see the same 4 windows a step in the same order: with the per-micro-batch balancing loss
    off (its f and P are micro-batch means: a nonlinear term, README "micro-batch scope") they train alike."""
    runs = {}
    for mbs, accum in ((4, 1), (1, 4), (2, 2)):
        cfg = make(tmp_path, steps=3, micro_batch_size=mbs, grad_accum=accum, **QUIET,
                   run_dir=str(tmp_path / f"run{mbs}x{accum}"))
        cfg.model.router.lb_loss_weight = 0.0
        runs[mbs, accum] = (_final_weights(cfg), step_records(cfg.train.run_dir))
    ref, ref_log = runs[4, 1]
    for key, (w, log) in runs.items():
        for name in ref:
            # atol: Adam turns the rounding of another summation order into up to 5.5e-6 on a weight (one element; the
            # data, the running Python's stdlib, is 3.12's; 8.5e-7 on 3.11's), far below a step's lr=3e-3
            torch.testing.assert_close(w[name], ref[name], rtol=1e-5, atol=1e-5, msg=f"{key} {name}")
        for s in ref_log:
            assert log[s]["loss"] == pytest.approx(ref_log[s]["loss"], rel=1e-5), (key, s)
            assert log[s]["grad_norm"] == pytest.approx(ref_log[s]["grad_norm"], rel=1e-4), (key, s)


def test_the_balancing_loss_is_a_per_micro_batch_term(tmp_path, data_dir):
    """With lb_loss_weight > 0 the aux loss of 1x4 (four one-window micro-batches) is not that of 4x1: the
    README's micro-batch scope, a legitimate difference."""
    aux = {}
    for mbs, accum in ((4, 1), (1, 4)):
        cfg = make(tmp_path, steps=1, micro_batch_size=mbs, grad_accum=accum, warmup_steps=0, **QUIET,
                   run_dir=str(tmp_path / f"run{mbs}x{accum}"))
        cfg.model.router.lb_loss_weight, cfg.model.router.z_loss_weight = 1.0, 0.0
        Trainer(cfg).train()
        aux[mbs, accum] = step_records(cfg.train.run_dir)[1]["aux_loss"]
    assert aux[4, 1] != pytest.approx(aux[1, 4], rel=1e-4)


class RecordingRuntime(LocalRuntime):
    """Records, per optimizer step, the lr its optimizer's groups hold after the update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.applied_lr: list[float] = []

    def step(self, lr):
        result = super().step(lr)
        self.applied_lr.append(self.optimizer.param_groups[0]["lr"])
        return result


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_trainer_matches_a_plain_torch_loop(tmp_path, data_dir, grad_clip):
    """Weights, loss, grad norm and lr of every step against a hand-written loop: the same windows, mean of the
    micro-batch losses, torch's clip_grad_norm_ (or none), non-fused AdamW whose decay skips norms and biases,
    the README's cosine with warmup."""
    cfg = make(tmp_path, steps=4, micro_batch_size=2, grad_accum=2, warmup_steps=1, grad_clip=grad_clip,
               min_lr_ratio=0.2, weight_decay=0.5, **QUIET)
    cfg.model.attention_bias = True
    cfg.model.router.expert_bias = False  # its sign update is the model's, not under test here
    t = cfg.train
    trainer = Trainer(cfg, runtime=RecordingRuntime(validate(cfg), torch.device("cpu")))
    start = weights(trainer)
    batches = []
    draw = trainer.sampler.next_batch
    trainer.sampler.next_batch = lambda *a: batches.append(draw(*a)) or batches[-1]
    trainer.train()
    got, log = weights(trainer), step_records(t.run_dir)

    model = Transformer(cfg.model)
    model.load_state_dict(start)
    named = list(model.named_parameters())
    no_decay = [p for n, p in named if "norm" in n or n.endswith(".bias")]
    decay = [p for n, p in named if not ("norm" in n or n.endswith(".bias"))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    for s in range(1, t.steps + 1):
        opt.zero_grad()
        ce_total = 0.0
        for x, y in batches[(s - 1) * t.grad_accum: s * t.grad_accum]:
            ce, aux = model.loss(x, y)
            ((ce + aux) / t.grad_accum).backward()
            ce_total += ce.item() / t.grad_accum
        params = [p for p in model.parameters() if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        lr = readme_lr(s, t.lr, t.warmup_steps, t.steps, t.min_lr_ratio, "cosine")
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        assert log[s]["loss"] == pytest.approx(ce_total, rel=1e-5), s
        assert log[s]["grad_norm"] == pytest.approx(norm, rel=1e-4), s
        assert log[s]["lr"] == pytest.approx(lr, rel=1e-12), s
        assert trainer.runtime.applied_lr[s - 1] == pytest.approx(lr, rel=1e-12), s
    if grad_clip > 0:
        assert min(r["grad_norm"] for r in log.values()) > grad_clip  # the clip was active on every step
    for name, p in model.state_dict().items():
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6, msg=name)


# -- 1. resume against a straight run ---------------------------------------------------------------------------

def test_a_resumed_run_is_bitwise_the_straight_run(tmp_path, data_dir):
    """steps=8, warmup 2, wsd decaying over the last 4 steps (5 to 8), eval every 3: resumed at step 3 (an eval
    step), 2 (warmup just over), 6 (inside the decay) and 8 (the last step), the weights, expert bias, step losses,
    grad norms, lrs and eval losses are the straight run's, bit for bit."""
    def config(run_dir):
        return make(tmp_path, steps=8, warmup_steps=2, lr_schedule="wsd", lr_decay_fraction=0.5,
                           eval_interval=3, save_interval=1, keep_last=8, log_interval=1, run_dir=str(run_dir))

    straight = Trainer(config(tmp_path / "straight"))
    straight.train()
    want, want_log, want_eval = weights(straight), step_records(straight.run_dir), eval_records(straight.run_dir)
    assert sorted(want_eval) == [0, 3, 6, 8]
    for resume_at in (3, 2, 6, 8):
        run = tmp_path / f"resume{resume_at}"
        shutil.copytree(tmp_path / "straight", run)
        for s in range(resume_at + 1, 9):
            shutil.rmtree(run / "checkpoints" / f"step-{s:08d}")
        resumed = Trainer(config(run))
        if resume_at == 8:
            with pytest.warns(UserWarning, match="nothing to train"):
                resumed.train()
        else:
            resumed.train()
        assert resumed.step == 8
        got = weights(resumed)
        for name in want:
            assert torch.equal(got[name], want[name]), (resume_at, name)
        drop = ("tokens_per_s", "model_tflops_per_gpu", "mfu", "peak_mem_gib")
        got_log = step_records(run)
        assert sorted(got_log) == list(range(1, 9))
        for s in range(1, 9):
            a = {k: v for k, v in got_log[s].items() if k not in drop}
            b = {k: v for k, v in want_log[s].items() if k not in drop}
            assert a == b, (resume_at, s)
        assert eval_records(run) == want_eval, resume_at


# -- 2. the lr schedules at their edges -------------------------------------------------------------------------

EDGES = [  # (warmup, steps, min_ratio, schedule, decay_fraction)
    *((w, n, m, sch, 0.2) for sch in ("cosine", "linear", "constant", "wsd") for w, n in
      ((0, 1), (0, 2), (1, 1), (3, 3), (0, 10), (4, 10), (9, 10), (10, 10)) for m in (0.0, 0.1, 1.0)),
    *((w, n, m, "wsd", f) for f in (1.0, 0.5, 0.3, 0.01) for w, n in ((0, 10), (3, 10), (8, 10), (0, 1), (0, 3))
      for m in (0.0, 0.1)),
]


@pytest.mark.parametrize("warmup,steps,min_ratio,schedule,fraction", EDGES)
def test_lr_at_follows_the_readme_formula_at_the_edges(warmup, steps, min_ratio, schedule, fraction):
    for s in range(1, steps + 1):
        want = readme_lr(s, 1.0, warmup, steps, min_ratio, schedule, fraction)
        assert lr_at(s - 1, 1.0, warmup, steps, min_ratio, schedule, fraction) == pytest.approx(want, abs=1e-12), s


def test_wsd_with_a_decay_fraction_of_one_is_the_linear_schedule():
    for warmup in (0, 3):
        for s in range(10):
            assert lr_at(s, 1.0, warmup, 10, 0.1, "wsd", 1.0) == pytest.approx(lr_at(s, 1.0, warmup, 10, 0.1, "linear"))


def test_a_decay_fraction_of_zero_is_refused_naming_the_field(tmp_path):
    cfg = make(tmp_path, lr_schedule="wsd", lr_decay_fraction=0.0)
    with pytest.raises(ConfigError, match=r"train\.lr_decay_fraction=0\.0"):
        validate(cfg)


@pytest.mark.parametrize("schedule,warmup,steps", [("cosine", 0, 1), ("wsd", 3, 3), ("linear", 0, 3)])
def test_the_lr_applied_each_step_is_the_formula(tmp_path, data_dir, schedule, warmup, steps):
    cfg = make(tmp_path, steps=steps, warmup_steps=warmup, lr_schedule=schedule, micro_batch_size=1,
               grad_accum=1, min_lr_ratio=0.0, **QUIET)
    trainer = Trainer(cfg, runtime=RecordingRuntime(validate(cfg), torch.device("cpu")))
    trainer.train()
    want = [readme_lr(s, cfg.train.lr, warmup, steps, 0.0, schedule) for s in range(1, steps + 1)]
    assert trainer.runtime.applied_lr == pytest.approx(want, rel=1e-12)
    assert [r["lr"] for r in step_records(cfg.train.run_dir).values()] == pytest.approx(want, rel=1e-12)


# -- 3. weight decay, non-finite gradients ----------------------------------------------------------------------

def test_weight_decay_groups_match_the_readme(tmp_path, data_dir):
    """README: q/k/v biases are never weight-decayed; the shared-expert gate is decayed like every matmul weight.
    Norm weights take none; the expert bias is a buffer, outside the optimizer."""
    cfg = make(tmp_path, steps=1, warmup_steps=0, **QUIET)
    cfg.model.attention_bias = True
    cfg.model.shared_expert_gate = True
    trainer = Trainer(cfg)
    trainer.train()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    groups = {g["weight_decay"]: {names[id(p)] for p in g["params"]} for g in trainer.runtime.optimizer.param_groups}
    decayed, kept = groups[cfg.train.weight_decay], groups[0.0]
    assert decayed | kept == set(names.values()) and not decayed & kept
    assert {n for n in names.values() if n.endswith((".q_proj.bias", ".k_proj.bias", ".v_proj.bias"))} <= kept
    assert {n for n in names.values() if "norm" in n} <= kept
    assert "blocks.1.mlp.shared_expert_gate.weight" in decayed
    assert "blocks.1.mlp.router.expert_bias" in dict(trainer.model.named_buffers())


class InfGradientAtStep2(LocalRuntime):
    """Makes one gradient infinite on the second optimizer step; records the weights around each step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.changed = 0, []

    def step(self, lr):
        self.calls += 1
        if self.calls == 2:
            next(p for p in self.model.parameters() if p.grad is not None).grad[0].fill_(float("inf"))
        before = [p.detach().clone() for p in self.model.parameters()]
        result = super().step(lr)
        self.changed.append(any(not torch.equal(b, p) for b, p in zip(before, self.model.parameters())))
        return result


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_a_non_finite_gradient_skips_the_step_and_counts_it(tmp_path, data_dir, grad_clip):
    cfg = make(tmp_path, steps=3, grad_clip=grad_clip, **QUIET)
    trainer = Trainer(cfg, runtime=InfGradientAtStep2(validate(cfg), torch.device("cpu")))
    summary = trainer.train()
    log = step_records(cfg.train.run_dir)
    assert trainer.runtime.changed == [True, False, True]
    assert [log[s]["skipped"] for s in (1, 2, 3)] == [0.0, 1.0, 0.0]
    assert log[2]["grad_norm"] is None  # metrics.jsonl writes a non-finite float as null (standard JSON)
    assert [log[s]["skipped_steps"] for s in (1, 2, 3)] == [0, 1, 1] and summary["skipped_steps"] == 1
    steps = {float(st["step"]) for st in trainer.runtime.optimizer.state.values()}
    assert steps == {2.0}  # AdamW took two updates: the skipped step advanced no moment nor bias correction


# -- 4. eval ----------------------------------------------------------------------------------------------------

def hand_eval_loss(model: torch.nn.Module, eval_file: Path, seq_len: int, windows: int) -> float:
    """The mean next-token cross-entropy over `windows` windows spread evenly over the eval split, all at once."""
    tokens = np.fromfile(eval_file, dtype="<u4").astype(np.int64)
    n = (tokens.size - 1) // seq_len
    want = min(n, windows)
    starts = [(i * (n - 1) // (want - 1) if want > 1 else 0) * seq_len for i in range(want)]
    rows = torch.from_numpy(np.stack([tokens[s: s + seq_len + 1] for s in starts]))
    with torch.no_grad():
        logits, _ = model.eval()(rows[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).double(), rows[:, 1:].flatten()).item()


def test_eval_loss_is_a_hand_evaluation_at_step_0_and_the_last_step(tmp_path, data_dir):
    """eval_interval past train.steps: evals at step 0 and at the last step only; each equals the mean loss of the
    same windows under the same weights, however the micro-batches (3 windows, so the last batch has 2) cut them."""
    cfg = make(tmp_path, steps=3, micro_batch_size=3, eval_interval=100, eval_windows=8, save_interval=0)
    trainer = Trainer(cfg)
    start = weights(trainer)
    trainer.train()
    evals = eval_records(cfg.train.run_dir)
    assert sorted(evals) == [0, 3]
    model = Transformer(cfg.model)
    eval_file = data_dir / "eval.u32"
    for step, state in ((0, start), (3, weights(trainer))):
        model.load_state_dict(state)
        want = hand_eval_loss(model, eval_file, cfg.data.seq_len, cfg.train.eval_windows)
        assert evals[step] == pytest.approx(want, rel=1e-5), step


def test_how_often_a_random_routing_run_evaluates_leaves_its_training_bitwise_alone(tmp_path, data_dir):
    """README: an eval draws random routing's numbers from a copy of the generators."""
    got = {}
    for every in (0, 1):
        cfg = make(tmp_path, steps=3, micro_batch_size=2, grad_accum=1, eval_interval=every,
                   save_interval=0, run_dir=str(tmp_path / f"run{every}"))
        cfg.model.router.routing = "random"
        with pytest.warns(UserWarning, match="benchmark mode"):
            trainer = Trainer(cfg)
        trainer.train()
        got[every] = weights(trainer)
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])


# -- 5. checkpoint intervals and retention ----------------------------------------------------------------------

@pytest.mark.parametrize("save_interval,keep_last,want", [(3, 2, [6, 7]), (3, 5, [3, 6, 7]), (10, 2, [7]),
                                                          (1, 1, [7])])
def test_saves_at_each_interval_and_at_the_end_keeping_the_last_n(tmp_path, data_dir, save_interval, keep_last,
                                                                 want):
    cfg = make(tmp_path, steps=7, micro_batch_size=1, grad_accum=1, eval_interval=0,
               save_interval=save_interval, keep_last=keep_last)
    Trainer(cfg).train()
    assert saved_steps(cfg.train.run_dir) == want
