"""QA 96: does the Trainer train what the README says? Its runs against an independent reference loop.

The reference (`reference_run` below) redoes a run in one process from the README's and config.py's words only,
in float64 from the same initial weights and on the same micro-batches: the model's forward (its logits; router
losses off), then its own loss (cross-entropy summed over the step's tokens on every micro-batch and rank, divided
by their count; lb = E x sum(f x P) and z = mean(logsumexp^2) per forward, weighted, meaned over the micro-batches
and ranks; f over the data-parallel group for `global`), the global L2 norm clipped as clip / (norm + 1e-6),
torch.optim.AdamW (not fused) with decay on every matrix by name (norm gains and biases none; the expert bias is a
buffer), the warmup + cosine schedule of the README, and the expert bias moved once per optimizer step by
rate x sign(mean - load) from the step's load over every micro-batch and rank.

The Trainer runs in float64 too (its runtimes hold float64 weights, moments and masters; the logged losses are
rounded to fp32), so the two agree to round-off: on one process (LocalRuntime, grad_accum 3, with a resume halfway)
and on two gloo ranks at DP2 x EP2 (DistributedRuntime with ZeRO-1, experts split over the ranks) with both
balancing-loss scopes. Every clip is active (grad_clip far below the norm), weight decay is large (0.5) and the
bias rate 0.01, so a norm without the other rank's experts, decay on a gain, a schedule one step off, a bias
moved per micro-batch or from one rank's load, or an aux loss weighted per rank would each move the weights by
orders of magnitude more than the tolerance.

Found: no defect; these are guards. Measured (float64 both sides, 5 steps): logged loss and aux loss within 1e-7
relative (the fp32 rounding of the log), pre-clip grad norm within 3e-9 relative, weights within 6e-8 absolute
(1e-6 allowed), the expert bias equal. Each of these mutations of the source fails a test here: decay on vectors,
the lr of the next step, the aux loss not divided by grad_accum, the bias rate doubled, the bias from one rank's
load, the grad norm without the other rank's shards, the `global` balancing loss with one rank's f.
Training loss per micro-batch: the trainer means the micro-batch means (loop.py), which is the token-weighted mean
the reference takes only because every drawn window is whole (no -100 target), as the README says; the test asserts
that premise.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import test_parallel_harness as h  # noqa: E402
from conftest import small_config  # noqa: E402

from moe_train.config import Config  # noqa: E402
from moe_train.model import Transformer  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402
from moe_train.trainer.runtime import LocalRuntime  # noqa: E402

LOSS_TOL = 2e-6  # the trainer logs its losses in fp32
WEIGHT_TOL = 1e-6  # float64 on both sides: ~1e-8 seen; a wrong rule moves weights by >= lr x decay x |w| ~ 1e-4


def config(run_dir: Path, data_dir: str | Path) -> Config:
    t = dict(steps=5, grad_accum=3, micro_batch_size=2, warmup_steps=2, lr=1e-2, min_lr_ratio=0.1, weight_decay=0.5,
             grad_clip=0.05, eval_interval=0, save_interval=0, log_interval=1, device="cpu")
    cfg = small_config(run_dir.parent, **t)
    cfg.train.run_dir, cfg.data.path, cfg.data.seq_len = str(run_dir), str(data_dir), 16
    m = cfg.model
    m.attention_bias, m.shared_expert_gate = True, True  # biases and a (d, 1) gate: which of them decay
    r = m.router
    r.expert_bias_rate, r.lb_loss_weight, r.z_loss_weight = 0.01, 0.1, 0.01
    return cfg


class Float64Runtime(LocalRuntime):
    """LocalRuntime over float64 weights (its fused AdamW holds float64 moments). Its checkpoints store each master
    apart from its weight: a resume reads a master saved once as its weight only from an fp32 weight."""

    def setup(self, model):  # noqa: ANN001, ANN201
        return super().setup(model).double()

    def checkpoint_shards(self):  # noqa: ANN201
        return [s._replace(same_as=None) for s in super().checkpoint_shards()]


# -- the reference -------------------------------------------------------------------------------------------------
def lr_by_hand(i: int, t) -> float:  # noqa: ANN001
    """README: step 1 at lr / warmup_steps, lr at step warmup_steps, then a cosine reaching lr x min_lr_ratio one
    step past the last. i: 0-based."""
    if i < t.warmup_steps:
        return t.lr * (i + 1) / t.warmup_steps
    done = (i - t.warmup_steps) / (t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 + math.cos(math.pi * done)) / 2)


def decays(name: str) -> bool:
    """Which parameters AdamW decays, by name: every weight matrix (embeddings, lm head, router, experts, the shared
    expert and its gate); never a norm gain or a bias (README: the attention biases are never decayed)."""
    return not (name.endswith("norm.weight") or name.endswith(".bias"))


def reference_run(cfg: Config, init: dict[str, torch.Tensor], batches: list[list[tuple]],
                  steps: range) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Train `init` (a state dict) over `steps` in float64. batches[i * grad_accum + m][r]: rank r's micro-batch m of
    step i. Returns each step's {loss, aux_loss, lr, grad_norm} and the final state dict (weights and expert bias)."""
    t, rc = cfg.train, cfg.model.router
    silent = copy.deepcopy(cfg.model)
    silent.router.lb_loss_weight = silent.router.z_loss_weight = 0.0  # the balancing losses are computed here
    model = Transformer(silent).double()
    model.load_state_dict(init)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in params.items() if decays(n)], "weight_decay": t.weight_decay},
                             {"params": [p for n, p in params.items() if not decays(n)], "weight_decay": 0.0}],
                            lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, foreach=False)
    routers = {n: m for n, m in model.named_modules() if n.endswith(".router")}
    forwards: list[tuple] = []
    for name, router in routers.items():
        router.register_forward_hook(
            lambda mod, args, out, name=name: forwards.append((name, mod, args[0], out.expert_ids)))
    E, ranks = cfg.model.num_experts, len(batches[0])
    per_step: list[dict] = []
    for i in steps:
        micro = batches[i * t.grad_accum:(i + 1) * t.grad_accum]
        tokens = sum(int((y != -100).sum()) for m in micro for _, y in m)
        load = {n: torch.zeros(E, dtype=torch.float64) for n in routers}
        ce_total = aux_total = 0.0
        for m in micro:
            outs = []
            for x, y in m:
                forwards.clear()
                logits, _ = model(x)
                ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100,
                                     reduction="sum")
                outs.append((ce, list(forwards)))
            counts = {n: torch.zeros(E, dtype=torch.float64) for n in routers}  # this micro-batch, every rank
            for _, fw in outs:
                for name, _, _, ids in fw:
                    counts[name] += torch.bincount(ids.reshape(-1), minlength=E)
            for ce, fw in outs:
                aux = torch.zeros((), dtype=torch.float64)
                for name, router, x, ids in fw:
                    logits = x @ router.weight.T
                    mine = torch.bincount(ids.reshape(-1), minlength=E).double()
                    f = mine / ids.numel() if rc.lb_loss_scope == "micro_batch" else counts[name] / counts[name].sum()
                    lb = E * (f * logits.softmax(-1).mean(0)).sum()
                    z = torch.logsumexp(logits, -1).pow(2).mean()
                    aux = aux + rc.lb_loss_weight * lb + rc.z_loss_weight * z
                    load[name] += mine
                (ce / tokens + aux / (t.grad_accum * ranks)).backward()
                ce_total += float(ce.detach()) / tokens
                aux_total += float(aux.detach()) / (t.grad_accum * ranks)
        grads = [p.grad for p in params.values() if p.grad is not None]
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        coef = min(1.0, t.grad_clip / (norm + 1e-6))
        lr = lr_by_hand(i, t)
        for g in grads:
            g.mul_(coef)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, router in routers.items():
                router.expert_bias += rc.expert_bias_rate * torch.sign(load[name].mean() - load[name])
        per_step.append({"loss": ce_total, "aux_loss": aux_total, "lr": lr, "grad_norm": norm})
    return per_step, {n: v.detach().clone() for n, v in model.state_dict().items()}


def assert_matches(records: list[dict], want: list[dict], got: dict[str, torch.Tensor],
                   final: dict[str, torch.Tensor], what: str, grad_clip: float) -> None:
    """The trainer's step records and weights (got) against the reference's (want, final)."""
    assert len(records) == len(want), (what, records)
    for rec, ref in zip(records, want):
        step = rec["step"]
        assert rec["skipped"] == 0, (what, rec)
        assert rec["lr"] == pytest.approx(ref["lr"], rel=1e-12), (what, step, rec["lr"], ref["lr"])
        assert rec["grad_norm"] > 10 * grad_clip, (what, step, "the clip must be active")
        assert rec["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-7), (what, step, rec["grad_norm"], ref)
        assert rec["loss"] == pytest.approx(ref["loss"], rel=LOSS_TOL), (what, step, rec["loss"], ref)
        assert rec["aux_loss"] == pytest.approx(ref["aux_loss"], rel=LOSS_TOL), (what, step, rec["aux_loss"], ref)
    assert set(got) == set(final), (what, set(got) ^ set(final))
    diffs = {n: float((got[n].double() - final[n]).abs().max()) for n in final}
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] < WEIGHT_TOL, f"{what}: {worst} differs from the reference by {diffs[worst]:.3g}"
    biases = [n for n in final if n.endswith("expert_bias")]
    assert biases and all(final[n].abs().max() > 0 for n in biases), "the expert bias moved"


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


# -- one process ---------------------------------------------------------------------------------------------------
def test_one_process_run_and_its_resume_match_the_reference_loop(tmp_path, data_dir):
    """LocalRuntime, grad_accum 3, 5 steps (warmup 2, cosine), clip active on every step: each step's loss, aux
    loss, lr and pre-clip norm, the weights and the expert bias at the end equal the reference's; so do those of a
    run stopped after step 3 and resumed (the schedule, AdamW's moments and step counts and the bias go on)."""
    cfg = config(tmp_path / "run", data_dir)
    cfg.train.save_interval = 3
    trainer = Trainer(cfg, runtime=Float64Runtime(cfg, torch.device("cpu")))
    init = {n: v.detach().clone() for n, v in trainer.model.state_dict().items()}
    batches: list[list[tuple]] = []
    next_batch = trainer.sampler.next_batch

    def recorded(*args):  # noqa: ANN002, ANN202
        x, y = next_batch(*args)
        batches.append([(x.clone(), y.clone())])
        return x, y

    trainer.sampler.next_batch = recorded
    model = trainer.model
    trainer.train()
    # README: "every token weighs the same, as the windows the trainer draws hold no -100 target": the mean of the
    # micro-batch means the trainer logs and trains is the token-weighted mean only while this holds
    assert len(batches) == 15 and all(b[0][1].shape == (2, 16) and (b[0][1] >= 0).all() for b in batches)
    want, final = reference_run(cfg, init, batches, range(5))
    got = {n: v.detach().clone() for n, v in model.state_dict().items()}
    assert_matches(step_records(tmp_path / "run"), want, got, final, "one process", cfg.train.grad_clip)

    # stopped after step 3 (its step-5 checkpoint lost), resumed by a new Trainer: steps 4 and 5 again
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step-00000005")
    trainer = Trainer(cfg, runtime=Float64Runtime(cfg, torch.device("cpu")))
    model = trainer.model
    trainer.train()
    got = {n: v.detach().clone() for n, v in model.state_dict().items()}
    assert_matches(step_records(tmp_path / "run"), want, got, final, "resumed", cfg.train.grad_clip)


# -- two ranks, DP2 x EP2 ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    root = tmp_path_factory.mktemp("qa96")
    data = prepare_data(list(stdlib_documents(20_000)), root / "data", vocab_size=512, source="qa96",
                        eval_fraction=0.25)
    import qa96_worker as w

    out = root / "ranks"
    out.mkdir()
    ports = [h.free_port() for _ in range(2)]
    h.start_ranks(h.run_guarded, args=(w.train_dp2_ep2, str(out), ports, str(root), str(data)), nprocs=2)
    return h.load_results(out, 2), root, data


@pytest.mark.parametrize("scope", ["micro_batch", "global"])
def test_dp2_ep2_run_matches_the_reference_loop(two_ranks, scope):
    """DistributedRuntime on two gloo ranks (dp=2, ep=2: each rank holds two of the four experts, ZeRO-1 masters):
    the same as one process, with each rank's micro-batches its own forward and balancing loss (f over both ranks
    for `global`). The clipped norm counts both ranks' experts once, the bias moves from both ranks' load, and
    metrics.jsonl counts the tokens both ranks trained (tokens_per_s at one fake second a step)."""
    import qa96_worker as w

    results, root, data = two_ranks
    cfg = w.config(root / scope, data, scope)
    runs = [r[scope] for r in results]
    init = h.assemble([r["init"] for r in runs])
    init.update({n: torch.zeros(cfg.model.num_experts, dtype=torch.float64) for n in runs[0]["bias"]})
    batches = [list(pair) for pair in zip(runs[0]["batches"], runs[1]["batches"])]  # [micro-batch][rank]
    assert len(batches) == cfg.train.steps * cfg.train.grad_accum
    want, final = reference_run(cfg, init, batches, range(cfg.train.steps))
    got = h.assemble([r["final"] for r in runs])
    for n, b in runs[0]["bias"].items():  # a buffer of every rank: the same on both
        assert torch.equal(b, runs[1]["bias"][n]), n
    got.update(runs[0]["bias"])
    records = runs[0]["records"]
    assert_matches(records, want, got, final, f"dp2 x ep2, {scope} balancing loss",
                   cfg.train.grad_clip)
    for i, rec in enumerate(records):
        trained = sum(x.numel() for pair in batches[i * cfg.train.grad_accum:(i + 1) * cfg.train.grad_accum]
                      for x, _ in pair)
        assert trained == 2 * 3 * 2 * 16 and rec["tokens_per_s"] == trained, (rec["step"], rec["tokens_per_s"])
