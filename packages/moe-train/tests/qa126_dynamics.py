"""Helpers of test_qa126_training_dynamics.py: a learnable synthetic data folder, a tiny MoE config, and a
Trainer run that returns its metrics.jsonl records (optionally with a router pushed off balance at init)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from moe_train.config import Config, DataConfig, ModelConfig, RouterConfig, TrainConfig
from moe_train.data.token_file import FORMAT, SplitWriter
from moe_train.trainer.loop import Trainer
from moe_train.trainer.runtime import LocalRuntime

VOCAB = 64
PERIOD = 37  # a repeating pattern: each token's successor is fixed but for the noise


def pattern_tokens(n: int, seed: int = 0, noise: float = 0.05) -> np.ndarray:
    """A deterministic repeating pattern of PERIOD distinct ids in [1, VOCAB), `noise` of the positions replaced by a
    uniform id: unigram entropy ~ln(PERIOD), conditional entropy far below it. Id 0 (EOS) never occurs."""
    rng = np.random.default_rng(seed)
    base = rng.permutation(np.arange(1, VOCAB))[:PERIOD]
    stream = np.tile(base, n // PERIOD + 1)[:n]
    hit = rng.random(n) < noise
    return np.where(hit, rng.integers(1, VOCAB, n), stream).astype(np.uint32)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy of the token frequencies, in nats (the loss of the best model that ignores context)."""
    p = np.bincount(tokens.astype(np.int64)) / tokens.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def write_folder(folder: Path, train: np.ndarray, eval_: np.ndarray) -> Path:
    """A data folder as token_file.py defines it (no tokenizer.json: ids only)."""
    folder.mkdir(parents=True)
    splits = {}
    for name, tokens in (("train", train), ("eval", eval_)):
        with SplitWriter(folder, name, eos_id=0) as w:
            w.write(tokens)
            n, docs = w.finish()
            splits[name] = {"num_tokens": n, "num_docs": docs, "max_token_id": w.max_token_id, "digest": w.digest}
    (folder / "meta.json").write_text(json.dumps({"format": FORMAT, "vocab_size": VOCAB, "eos_id": 0,
                                                  "splits": splits}))
    return folder


def pattern_folder(folder: Path, seed: int = 0) -> Path:
    tokens = pattern_tokens(24_000, seed)
    return write_folder(folder, tokens[:20_000], tokens[20_000:])


def config(data: Path, run_dir: Path, steps: int = 120, seed: int = 0, **router) -> Config:
    """A 2-layer MoE (4 experts, top-2, 35K parameters): 120 steps of 256 tokens in about a second on one CPU thread."""
    return Config(
        model=ModelConfig(vocab_size=VOCAB, d_model=32, num_layers=2, num_heads=2, num_kv_heads=1, dense_hidden=64,
                          num_experts=4, expert_hidden=32, router=RouterConfig(**{"top_k": 2, **router}),
                          gemm_backend="torch"),  # "auto" times GEMM plans at the first forward: seconds on a CPU
        data=DataConfig(path=str(data), seq_len=32),
        train=TrainConfig(steps=steps, micro_batch_size=8, lr=1e-2, warmup_steps=10, eval_interval=steps,
                          eval_windows=16, log_interval=10, save_interval=0, run_dir=str(run_dir), progress=False,
                          device="cpu", seed=seed, threads=1),  # one thread: 2 contend on a shared 2-core machine
        preset="test",
    )


SKEW = 3.0  # every token's first window routes to expert 0: max/mean load ~1.9 of the 2.0 top-2 of 4 allows


@torch.no_grad()
def skew_towards_expert_0(model: torch.nn.Module) -> None:
    """Push a freshly initialised model's routers towards expert 0: every embedding row gets a shared direction u (so
    every token's normalised hidden state leans along it) and each router's row 0 gets SKEW x u. Training then starts
    from an imbalanced router; only the balancing terms have a reason to undo it. The same on every rank."""
    u = torch.randn(model.cfg.d_model, generator=torch.Generator().manual_seed(1234))
    u /= u.norm()
    model.embed.weight += 0.1 * u
    for _, router in model.routers():
        router.weight[0] += SKEW * u


class SkewedRouterRuntime(LocalRuntime):
    """LocalRuntime whose model starts skewed (skew_towards_expert_0)."""

    def setup(self, model):  # noqa: ANN001, ANN201
        model = super().setup(model)
        skew_towards_expert_0(model)
        return model


def train(cfg: Config, skewed: bool = False) -> tuple[list[dict], torch.nn.Module]:
    """Train with the real Trainer; returns metrics.jsonl's records and the trained model."""
    runtime = SkewedRouterRuntime(cfg, torch.device("cpu")) if skewed else None
    threads = torch.get_num_threads()
    try:
        trainer = Trainer(cfg, runtime)
        trainer.train()
    finally:
        torch.set_num_threads(threads)  # train.threads sets it for the process: the other tests keep theirs
    return read_records(Path(cfg.train.run_dir)), trainer.model


def read_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if "loss" in r]


def evals_of(records: list[dict]) -> list[float]:
    return [r["eval_loss"] for r in records if "eval_loss" in r]


def layer_mean(record: dict, key: str) -> float:
    """The mean over MoE layers of one router-health number of a metrics record (its window of steps)."""
    layers = record["router"].values()
    return sum(h[key] for h in layers) / len(layers)


def tail_mean(records: list[dict], key: str, windows: int = 4) -> float:
    """layer_mean of `key` over the last `windows` logged windows (40 steps at log_interval 10)."""
    last = steps_of(records)[-windows:]
    return sum(layer_mean(r, key) for r in last) / len(last)


def is_finite(records: list[dict]) -> bool:
    return all(r.get("loss") is not None and math.isfinite(r["loss"]) and not r["skipped"] for r in steps_of(records))


def train_two_ranks(rank: int, ports: list[int], data: str, root: str, seed: int) -> dict:
    """A spawned rank (test_parallel_harness.start_ranks): DP2 over gloo, the real Trainer, the skewed start, global
    balancing-loss scope, once without (lb 0) and once with (lb 0.05) the loss. Rank 0 writes the metrics."""
    import test_parallel_harness as h
    from moe_train.model import Transformer

    reset = Transformer.reset_parameters

    def skewed_reset(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - this process only
        reset(self, *args, **kwargs)
        skew_towards_expert_0(self)

    Transformer.reset_parameters = skewed_reset
    for port, weight in zip(ports, (0.0, 0.05)):
        h.worker_env(rank, 2, port)
        cfg = config(Path(data), Path(root) / f"lb{weight}", seed=seed, lb_loss_weight=weight, lb_loss_scope="global",
                     z_loss_weight=0.0)
        cfg.parallel.dp, cfg.train.micro_batch_size = 2, 4  # the single-process runs' 8 sequences a step
        Trainer(cfg).train()
    return {}
