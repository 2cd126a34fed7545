"""What the trainer reports, recounted by hand: router health, throughput, FLOPs, MFU peaks, the LR schedule.

Each number in a metrics.jsonl record is recomputed here from what the run did (the router's inputs and
weights on every training forward, each micro-batch's loss, a fake clock), not from the trainer's own helpers.
Scopes: a record covers the steps since the previous record (every micro-batch) on every rank; loss, lr and
grad_norm are the logged step's own; eval loss is the token-weighted mean over the eval windows.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import metrics_qa_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from conftest import small_config  # noqa: E402

from moe_train.trainer import loop  # noqa: E402
from moe_train.trainer.loop import Trainer  # noqa: E402


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from moe_train.data import prepare_data, stdlib_documents

    return prepare_data(list(stdlib_documents(100_000)), tmp_path_factory.mktemp("qa") / "data", vocab_size=512,
                        source="stdlib-test")


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def step_records(run_dir: Path) -> list[dict]:
    return [r for r in read_records(run_dir) if "loss" in r]


def recount(forwards: list[list[dict]], num_experts: int, k: int, ep: int = 1, capacity_rows: int | None = None) -> dict:
    """Router health by hand. forwards: for each training forward of one layer in the window, every rank's
    recorded call. Rows past `capacity_rows` received by an EP rank (experts split contiguously) are dropped."""
    load, prob = torch.zeros(num_experts, dtype=torch.float64), torch.zeros(num_experts, dtype=torch.float64)
    tokens, margin, lb, z, dropped = 0, 0.0, [], [], 0
    for ranks in forwards:
        received = torch.zeros(ep, dtype=torch.int64)
        for call in ranks:
            logits = call["x"].float() @ call["weight"].float().T  # [T, E]
            p = logits.softmax(-1)
            scores = p + call["bias"]
            assert torch.equal(scores.topk(k, -1).indices.sort(-1).values, call["ids"].sort(-1).values)
            counts = torch.bincount(call["ids"].flatten(), minlength=num_experts)
            load += counts
            prob += p.double().sum(0)
            tokens += call["x"].shape[0]
            ranked = scores.double().sort(-1, descending=True).values
            margin += float((ranked[:, k - 1] - ranked[:, k]).sum())
            lb.append(num_experts * float((counts.double() / counts.sum() * p.double().mean(0)).sum()))
            z.append(float(torch.logsumexp(logits.double(), -1).pow(2).mean()))
            received += counts.view(ep, -1).sum(1)
        if capacity_rows is not None:
            dropped += int((received - capacity_rows).clamp_min(0).sum())
    return {"tokens": tokens, "f": (load / load.sum()).tolist(), "P": (prob / tokens).tolist(),
            "max_over_mean_load": float(load.max() / load.mean()), "dead_experts": int((load == 0).sum()),
            "topk_margin": margin / tokens, "lb_loss": sum(lb) / len(lb), "z_loss": sum(z) / len(z),
            "dropped_rows": dropped, "dropped_fraction": dropped / float(load.sum())}


def assert_health_matches(got: dict, want: dict, where: str) -> None:
    assert got["tokens"] == want["tokens"], (where, got["tokens"], want["tokens"])
    for key in ("f", "P"):  # logged rounded to 5 decimals
        assert max(abs(a - b) for a, b in zip(got[key], want[key])) < 2e-5, (where, key, got[key], want[key])
    for key in ("max_over_mean_load", "topk_margin", "lb_loss", "z_loss", "dropped_fraction"):
        assert math.isclose(got[key], want[key], rel_tol=1e-5, abs_tol=1e-7), (where, key, got[key], want[key])
    for key in ("dead_experts", "dropped_rows"):
        assert got[key] == want[key], (where, key, got[key], want[key])


def calls_of(calls: list[dict], layer: int) -> list[dict]:
    return [c for c in calls if c["layer"] == layer]


# -- one process -------------------------------------------------------------------------------------------------
class FakeClock:
    """loop's `time`: a training step takes 1 s, an eval 100 s, a save 50 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_a_record_matches_hand_counts_over_its_window_and_its_tokens_per_s_leaves_out_eval_and_saves(
        tmp_path, data, monkeypatch):
    """grad_accum 2, a record every 2 steps, an eval mid-window (step 3) and saves at steps 2 and 4.
    tokens/s used to count the eval's and the save's seconds of the window they fell in (a dip every
    eval_interval); it is training throughput: 4 x 32 x 2 tokens per 1-second step, in every record."""
    cfg = small_config(tmp_path, steps=4, grad_accum=2, log_interval=2, eval_interval=3, save_interval=2, eval_windows=6)
    cfg.data.path, cfg.train.device = str(data), "cpu"
    clock = FakeClock()
    monkeypatch.setattr(loop, "time", clock)
    trainer = Trainer(cfg)
    calls, losses = w.record_routing(trainer.model), w.record_losses(trainer.model)
    for name, seconds in (("_train_step", 1.0), ("evaluate", 100.0), ("save", 50.0)):
        def timed(real=getattr(trainer, name), seconds=seconds):  # noqa: ANN001, ANN202
            clock.now += seconds
            return real()
        setattr(trainer, name, timed)
    trainer.train()

    records = step_records(tmp_path / "run")
    assert [r["step"] for r in records] == [2, 4]
    tokens_per_step = 4 * 2 * 32  # micro-batch x grad_accum x seq_len
    base = cfg.train.lr
    for window, rec in enumerate(records):
        assert rec["tokens_per_s"] == tokens_per_step, rec["tokens_per_s"]
        assert math.isclose(rec["model_tflops_per_gpu"], 212_736 * tokens_per_step / 1e12, rel_tol=1e-12)
        assert "mfu" not in rec and "peak_mem_gib" not in rec  # the CPU has no bf16 peak and no CUDA allocator
        step = rec["step"]
        assert math.isclose(rec["loss"], (losses[2 * step - 2] + losses[2 * step - 1]) / 2, rel_tol=1e-6)
        for layer, got in rec["router"].items():
            forwards = [[c] for c in calls_of(calls, int(layer.removeprefix("layer")))[4 * window : 4 * window + 4]]
            assert_health_matches(got, recount(forwards, 4, 2), f"step {step} {layer}")
        assert rec["dropped_rows"] == 0  # one process: dropless
    # warmup 2, cosine to 0.1 x lr at step 4: step 2 (index 1) at the peak, step 4 (index 3) halfway down
    assert records[0]["lr"] == base and math.isclose(records[1]["lr"], base * (0.1 + 0.9 * 0.5), rel_tol=1e-12)

    # eval loss: the mean over the 6 windows of each one's mean token loss (batches of 4 and 2 weigh 4:2)
    tokens = np.fromfile(data / "eval.u32", dtype="<u4").astype(np.int64)
    n = (tokens.size - 1) // 32
    model = trainer.model.eval()
    with torch.no_grad():
        per_window = []
        for i in np.linspace(0, n - 1, 6).astype(np.int64):
            window = torch.from_numpy(tokens[i * 32 : i * 32 + 33])[None]
            per_window.append(float(model.loss(window[:, :-1], window[:, 1:])[0]))
    evals = {r["step"]: r["eval_loss"] for r in read_records(tmp_path / "run") if "eval_loss" in r}
    assert sorted(evals) == [0, 3, 4]
    assert math.isclose(evals[4], sum(per_window) / 6, rel_tol=1e-5), (evals[4], per_window)


# -- two ranks -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory):
    root = tmp_path_factory.mktemp("two_ranks")
    ports = [h.free_port() for _ in range(2)]
    h.start_ranks(h.run_guarded, args=(w.train_two_ranks, str(root), ports, str(root), str(data)), nprocs=2)
    return h.load_results(root, 2), step_records(root / "run")


@pytest.mark.slow
def test_router_health_counts_every_rank_and_micro_batch_of_the_window(two_ranks):
    """DP2 x EP2, grad_accum 2, a record every 2 steps. From step 3 on rank 1 sends all its tokens to experts
    0 and 1 (they live on rank 0, whose capacity is T*k rows): rank 0 receives more than it may keep and
    drops rows. Router health used to be rank 0's tokens only (half the job: rank 1's collapse was
    invisible) and dropped_rows the last micro-batch's of rank 0 (a quarter of the window's forwards)."""
    results, records = two_ranks
    assert [r["step"] for r in records] == [2, 4]
    per_window = w.LOG_INTERVAL * w.GRAD_ACCUM
    rows = w.MICRO_BATCH * w.SEQ * w.TOP_K  # rows each rank routes per forward: its capacity
    for window, rec in enumerate(records):
        for layer in (1, 2):
            forwards = list(zip(*(calls_of(res["calls"], layer)[per_window * window : per_window * (window + 1)]
                                  for res in results)))
            want = recount([list(f) for f in forwards], w.E, w.TOP_K, ep=2, capacity_rows=rows)
            assert_health_matches(rec["router"][f"layer{layer}"], want, f"step {rec['step']} layer{layer}")
        assert rec["dropped_rows"] == sum(h["dropped_rows"] for h in rec["router"].values())
        # the step's loss: mean cross-entropy over its micro-batches on both ranks
        first = (rec["step"] - 1) * w.GRAD_ACCUM
        step_losses = [loss for res in results for loss in res["losses"][first : first + w.GRAD_ACCUM]]
        assert math.isclose(rec["loss"], sum(step_losses) / len(step_losses), rel_tol=1e-6)
        assert rec["peak_mem_gib"] == 2.0  # the largest rank's, not rank 0's
    # the collapse shows: the balancing loss stays at its floor of 1 (probabilities still near-uniform; on this
    # run layer 2's even falls) while the load, counted over both ranks, goes from near-balanced to about 3 of
    # every 4 rows on two experts, and rank 0 drops a quarter of the rows
    for layer in ("layer1", "layer2"):
        before, after = (rec["router"][layer] for rec in records)
        assert abs(before["lb_loss"] - 1) < 0.02 and abs(after["lb_loss"] - 1) < 0.02, (before, after)
        assert before["max_over_mean_load"] < 1.3 < 1.45 < after["max_over_mean_load"], (before, after)
        assert before["dropped_fraction"] < 0.1 < 0.2 < after["dropped_fraction"], (before, after)

@pytest.mark.slow
def test_eval_splits_the_windows_over_data_parallel_ranks_and_every_rank_reports_one_mean(two_ranks, data):
    """6 eval windows in batches of 2 (3 batches) over DP2 x EP2: rank 0 evaluates batches 0 and 2, rank 1 batch 1
    and then repeats it uncounted (each forward exchanges rows between the EP ranks, so both run two). Every
    rank used to evaluate all 6 windows itself. The mean equals one process evaluating the saved weights."""
    results, _ = two_ranks
    assert [res["eval_forwards"] for res in results] == [[2, 2] * 2, [2, 2] * 2]  # step 0 and step 1 evals
    evals = [res["dropless_summary"]["last_eval_loss"] for res in results]
    assert evals[0] == evals[1] and math.isfinite(evals[0])
    root = Path(results[0]["dropless_root"])
    cfg = w.two_rank_config(root, str(data))
    cfg.parallel.dp = cfg.parallel.ep = 1
    cfg.parallel.expert_capacity_factor, cfg.train.steps, cfg.train.eval_interval = 0.0, 1, 1
    one = Trainer(cfg)
    one.restore(one.resume_point())
    assert math.isclose(one.evaluate(), evals[0], rel_tol=1e-5), (one.evaluate(), evals)
    one.runtime.close()
    one._release_run_dir()


# -- FLOPs, MFU peaks --------------------------------------------------------------------------------------------
def test_flops_per_token_matches_a_hand_count_of_the_matmuls(tmp_path):
    """conftest's small model: d=32, 4 heads of 8 (2 KV heads), layer 0 dense (hidden 64), layer 1 MoE (4 experts
    of hidden 16, top-2, a shared expert of 16), vocab 512, seq 32, QK-norm. The norm weights (RMSNorm x2 per
    layer, per-head q/k norms, the final norm) are elementwise, not matmuls: they used to be counted as such."""
    from moe_train.model import flops_per_token

    d, seq = 32, 32
    attention_proj = d * 32 + d * 16 + d * 16 + 32 * d  # q, k, v (GQA: 2 x 8), o
    dense_mlp = 3 * d * 64
    router, routed, shared = 4 * d, 2 * 3 * d * 16, 3 * d * 16
    lm_head = d * 512
    macs = 2 * attention_proj + dense_mlp + router + routed + shared + lm_head
    causal_attention = 2 * (2 * 2 * 4 * 8 * seq // 2)  # 2 layers x (QK^T + AV) x 2 flops x H*hd x seq/2 keys
    want = 6 * macs + 3 * causal_attention  # forward + backward = 3 x forward
    cfg = small_config(tmp_path).model
    assert want == 212_736
    assert flops_per_token(cfg, seq) == want
    cfg.tie_embeddings = True  # the lm head is still a matmul; the input embedding is still a lookup
    assert flops_per_token(cfg, seq) == want
    cfg.num_experts = 8  # more experts at the same top-k: only the router grows
    assert flops_per_token(cfg, seq) == want + 6 * 4 * d


PEAKS = {  # device name (torch.cuda.get_device_name) -> dense bf16 TFLOP/s, None: no MFU
    "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0,
    "NVIDIA H200": 989.0, "NVIDIA H200 NVL": 835.0, "NVIDIA GH200 480GB": 989.0,
    "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA A100 80GB PCIe": 312.0, "NVIDIA RTX A1000": None,
    "NVIDIA B200": 2250.0, "NVIDIA GB200": 2500.0, "NVIDIA B300 SXM6 AC": 2250.0, "NVIDIA GB300": 2500.0,
    "NVIDIA GeForce RTX 4090": None,
}


def test_the_mfu_peak_is_the_devices_own(monkeypatch):
    """Dense bf16 datasheet peaks: NVL parts run lower clocks than SXM (835 vs 989), the HGX B300's bf16 equals
    the B200's, Grace-Blackwell parts run at 1.2-1.4 kW (2500); an unknown GPU gets no MFU rather than a wrong
    one. Substring matching gave H100/H200 NVL the SXM peak, B300 2500, GB200 the B200's, RTX A1000 the A100's."""
    from moe_train.trainer.mfu import peak_tflops

    got = {}
    for name in PEAKS:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        got[name] = peak_tflops(torch.device("cuda"))
    assert got == PEAKS
    assert peak_tflops(torch.device("cpu")) is None


# -- the learning-rate schedule ----------------------------------------------------------------------------------
def test_the_lr_schedule_at_its_edges_and_across_a_resume(tmp_path, data):
    """A resume with the same config continues the same schedule (each step logged once, the same lr); one that
    changes it (train.steps raised to train longer: the cosine jumps back up) says so, with both lrs."""
    from moe_train.trainer.schedule import lr_at

    assert lr_at(0, 1.0, 0, 1, 0.1) == 1.0  # steps=1, no warmup: the one step at the peak
    assert [lr_at(s, 1.0, 10, 4, 0.1) for s in range(4)] == [0.1, 0.2, 0.3, 0.4]  # warmup >= steps: no decay
    assert [lr_at(s, 1.0, 4, 4, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    decay = [lr_at(s, 1.0, 2, 10, 0.1) for s in range(2, 11)]
    assert decay[0] == 1.0 and all(a > b for a, b in zip(decay, decay[1:])) and decay[-1] == pytest.approx(0.1)
    assert lr_at(9, 1.0, 2, 10, 0.1) > 0.1  # the floor is reached one past the last step

    cfg = small_config(tmp_path, steps=4, grad_accum=1, log_interval=1, eval_interval=0, save_interval=2)
    cfg.data.path, cfg.train.device = str(data), "cpu"
    run = tmp_path / "run"
    Trainer(cfg).train()
    first = {r["step"]: r["lr"] for r in step_records(run)}
    base = cfg.train.lr
    # warmup 2 (step 1 at half the peak), then the cosine from the peak at step 3 towards 0.1 x lr at step 5
    assert first == pytest.approx({1: base / 2, 2: base, 3: base, 4: base * 0.55}, rel=1e-12)
    shutil.rmtree(run / "checkpoints" / "step-00000004")  # the run died before its last save committed,
    (run / "checkpoints" / "latest").write_text("step-00000002\n")  # so `latest` still names the one before
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same schedule: nothing to say
        Trainer(cfg).train()
    assert [(r["step"], r["lr"]) for r in step_records(run)] == sorted(first.items())

    cfg.train.steps = 6  # train longer from the step-4 checkpoint
    with pytest.warns(UserWarning, match=r"learning-rate schedule differs from the checkpoint's run") as got:
        Trainer(cfg).train()
    [message] = [str(m.message) for m in got if "learning-rate" in str(m.message)]
    # step 5 (index 4): the 4-step schedule had reached its floor 0.1 x lr; the 6-step one is halfway down
    assert "train.steps: 4 -> 6" in message and f"lr={base * 0.55:.4g}" in message and f"{base * 0.1:.4g}" in message
    lrs = {r["step"]: r["lr"] for r in step_records(run)}
    assert sorted(lrs) == [1, 2, 3, 4, 5, 6]
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 4))  # step 6: three quarters of the 4 decay steps
    assert lrs[5] == pytest.approx(base * 0.55, rel=1e-12) and lrs[6] == pytest.approx(base * cosine, rel=1e-12)

    from moe_train.config import TrainConfig
    from moe_train.trainer.schedule import schedule_change

    saved = {"lr": 1.0, "warmup_steps": 2, "steps": 1, "min_lr_ratio": 0.1}  # stopped inside its warmup
    assert schedule_change(saved, TrainConfig(lr=1.0, warmup_steps=2, steps=2, min_lr_ratio=0.1), 1) is None
    assert "train.lr: 1.0 -> 2.0" in schedule_change(saved, TrainConfig(lr=2.0, warmup_steps=2, steps=1), 1)
