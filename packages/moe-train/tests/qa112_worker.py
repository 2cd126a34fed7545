"""The ranks' side of test_qa112_readme_ranks.py: what each torchrun-like rank runs (the README blocks, the parts they
leave to the reader, and the checks of what their text claims). A module of its own so the forkserver's children
import it by name (a test module under --import-mode=importlib is not importable there)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

import test_parallel_harness as h


def run(code: str, ns: dict, where: str) -> None:
    exec(compile(code, f"<{where}>", "exec"), ns)


# ---- moe-parallel: ParallelLayout(dp=4, ep=2) on 4 ranks, then its optimizer's state pieces -------------------
WORLD_PARALLEL = 4
MICRO_BATCHES, SEQS, SEQ_LEN, VOCAB = 2, 2, 8, 64  # per rank; every rank's micro-batch i is one global batch


def readme_model():
    """The model the block leaves to the reader: moe-train's, 8 experts, seeded alike on every rank. Balancing
    and z-loss weights 0, so the loss is cross-entropy alone and one process can compute the global gradient."""
    from moe_train import Transformer
    from moe_train.config import ModelConfig, RouterConfig

    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=VOCAB, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                   dense_hidden=32, dense_layers=[0], num_experts=8, expert_hidden=8,
                                   router=RouterConfig(top_k=2, lb_loss_weight=0.0, z_loss_weight=0.0)))


def global_batches() -> torch.Tensor:
    """[MICRO_BATCHES, WORLD_PARALLEL * SEQS, SEQ_LEN + 1] tokens; rank r trains on rows [r*SEQS, (r+1)*SEQS)."""
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (MICRO_BATCHES, WORLD_PARALLEL * SEQS, SEQ_LEN + 1), generator=g)


def loss_fn(model, x, y):  # noqa: ANN001, ANN201
    ce, aux = model.loss(x, y)
    return ce + aux


def parallel_rank(rank: int, parallel_code: str, optimizer_code: str) -> dict:
    import torch.distributed as dist

    tokens = global_batches()[:, rank * SEQS:(rank + 1) * SEQS]
    ns = {"__name__": "__main__", "torch": torch, "model": readme_model(), "loss_fn": loss_fn, "lr": 3e-3,
          "micro_batches": [(t[:, :-1], t[:, 1:]) for t in tokens]}
    run(parallel_code, ns, "moe-parallel README, ParallelLayout block")
    model, layout, shards, result = ns["model"], ns["layout"], ns["shards"], ns["result"]

    # "keep 4 of 8 experts": this EP rank's block, rows [4 * ep_rank, 4 * ep_rank + 4)
    ep_rank = layout.coords(rank).ep_rank
    params = dict(model.named_parameters())
    assert shards and set(shards) == set(ns["experts"]), (sorted(shards), sorted(ns["experts"]))
    for name, shard in shards.items():
        assert shard.global_shape[0] == 8 and shard.row_offset == 4 * ep_rank, (name, shard)
        assert params[name].shape == (4, *shard.global_shape[1:]), (name, params[name].shape)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}

    # the optimizer block: save | (the state a fresh job would hold) | load
    pieces_dir = Path("optim-pieces")

    def write(key, global_shape, offset, tensor):  # noqa: ANN001, ANN202 - one file per piece
        folder = pieces_dir / key
        folder.mkdir(parents=True, exist_ok=True)
        torch.save((tuple(global_shape), offset, tensor.detach().clone()), folder / f"{offset}-rank{rank}.pt")

    def read(key):  # noqa: ANN001, ANN202 - the whole global tensor, every element written exactly once
        pieces = [torch.load(f, weights_only=False) for f in sorted((pieces_dir / key).iterdir())]
        shape = pieces[0][0]
        flat, written = torch.full((math.prod(shape),), float("nan")), torch.zeros(math.prod(shape), dtype=torch.int)
        for _, offset, t in pieces:
            flat[offset:offset + t.numel()] = t.reshape(-1)
            written[offset:offset + t.numel()] += 1
        assert bool((written == 1).all()), f"{key}: elements written {sorted(set(written.tolist()))} times"
        return flat.reshape(shape)

    save, load = optimizer_code.split("\n\n")
    ns.update(write=write, read=read)
    run(save, ns, "moe-parallel README, optimizer block (save)")
    opt = ns["opt"]
    saved = [(p.name, p.key, p.offset, p.tensor.clone()) for p in opt.state_pieces()]
    counts, steps = ns["counts"], ns["steps"]
    for p in opt.state_pieces():
        p.tensor.fill_(float("nan"))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    opt.step_count = 0
    dist.barrier()
    run(load, ns, "moe-parallel README, optimizer block (load)")
    restored = [(p.name, p.key, p.offset, p.tensor.clone()) for p in opt.state_pieces()]
    assert [r[:3] for r in restored] == [s[:3] for s in saved]
    differ = [s[:3] for s, r in zip(saved, restored) if not torch.equal(s[3], r[3])]
    assert not differ, f"optimizer state not restored: {differ}"
    differ = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), weights[n])]
    assert not differ, f"refresh_weights did not restore the weights: {differ}"
    assert opt.param_step_counts() == counts and opt.step_count == steps == 1, (opt.param_step_counts(), counts, steps)
    return {"grad_norm": result.grad_norm, "skipped": result.skipped, "type": type(result).__name__,
            "ep_rank": ep_rank, "weights": weights, "shards": shards}


# ---- moe-ckpt: Box.dim0 over 8 EP ranks --------------------------------------------------------------------
WORLD_CKPT = 8
STEP = 100

CKPT_PRELUDE = """
import torch
import torch.distributed as dist
from moe_ckpt import even_split
dist.init_process_group("gloo")                     # torchrun's environment; the block leaves it to the reader
rank, world = dist.get_rank(), dist.get_world_size()
ep_rank = new_rank = rank                           # saved at ep=8, read back at 4 experts a rank
step, idx, cfg_dict = {step}, 1234, {{"preset": "readme"}}
sched = torch.optim.lr_scheduler.LambdaLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0),
                                          lambda s: 1.0)
W1, M, WQ = ckpt_tensors()                          # the global tensors, alike on every rank
w1_local = W1[8 * ep_rank:8 * ep_rank + 8].clone()
start, n = even_split(M.numel(), rank, world)
m_local = M.reshape(-1)[start:start + n].clone()
wq = WQ.clone()
"""


def ckpt_tensors() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(64, 2, 3, generator=g), torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)


def ckpt_rank(rank: int, ckpt_code: str) -> dict:
    from moe_ckpt import LoadRequest, SaveStats, open_checkpoint, step_dir

    ns = {"__name__": "__main__", "ckpt_tensors": ckpt_tensors}
    run(CKPT_PRELUDE.format(step=STEP), ns, "moe-ckpt README prelude")
    run(ckpt_code, ns, "moe-ckpt README block")
    W1, M, WQ = ckpt_tensors()
    # the later, async save is the latest; read at 4 experts a rank, each rank gets exactly its bytes
    assert ns["latest"] == step_dir("run", STEP + 1), ns["latest"]
    assert isinstance(ns["stats"], SaveStats), ns["stats"]
    got = ns["got"]["layers.0.experts.w1"]
    assert torch.equal(got, W1[4 * rank:4 * rank + 4]), f"rank {rank} read other experts"
    meta = ns["meta"]
    assert (meta["step"], meta["layout"], meta["sampler"]) == (STEP + 1, {"dp": 8, "ep": 8}, {"index": 1234}), meta
    # every tensor, read whole: the expert slices, the ZeRO ranges and the one writer's replica put together
    want = {"layers.0.experts.w1": W1, "opt.exp_avg.layers.0.attn.wq": M, "layers.0.attn.wq": WQ}
    with open_checkpoint(ns["latest"]) as ckpt:
        assert sorted(ckpt.names) == sorted(want), ckpt.names
        assert torch.equal(ns["w"], want[ckpt.names[-1]])
    for step in (STEP, STEP + 1):
        with open_checkpoint(step_dir("run", step)) as ckpt:
            wrong = [n for n, t in ckpt.read([LoadRequest(n) for n in want]).items() if not torch.equal(t, want[n])]
            assert not wrong, (step, wrong)
    return {"files": sorted(p.name for p in step_dir("run", STEP).iterdir())}


# ---- every rank ---------------------------------------------------------------------------------------------
def rank_main(rank: int, world: int, port: int, work_dir: str, out_dir: str, body, *blocks) -> None:  # noqa: ANN001
    h.worker_env(rank, world, port)  # RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, as torchrun sets them
    os.chdir(work_dir)  # torchrun's ranks share the working folder the README's relative paths are in
    h.run_guarded(rank, body, out_dir, *blocks)
