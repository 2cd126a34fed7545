"""QA 101's model and its ranks: moe-kernels inside a stack built on plain PyTorch machinery (DDP, FSDP2, EP + DP).

`Net` is what a user writes around the library: a linear in, a MoE layer (router -> build_route_map -> moe_ffn) with a
residual, a linear out. `mask` [T, E] is added to the router logits, so that chosen experts get no tokens from chosen
rows. `reference_grads` is one process holding the whole global batch in float64. Every rank's loss is
sum(out^2) * world / T_global, so DDP's average of the ranks' gradients is the gradient of sum(out^2) / T_global.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import kernels_spawn
import moe_kernels as moe

D, H, K = 8, 8, 2
EXPERT_PARAMS = ("moe.w_gate_up", "moe.w_down")


class MoE(nn.Module):
    def __init__(self, num_experts: int, jitter: float = 0.0):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        E = num_experts
        self.router = nn.Parameter(torch.randn(D, E, generator=g) * D**-0.5)
        self.w_gate_up = nn.Parameter(torch.randn(E, D, 2 * H, generator=g) * D**-0.5)
        self.w_down = nn.Parameter(torch.randn(E, H, D, generator=g) * H**-0.5)
        self.jitter = jitter  # router noise: checkpoint's recompute must restore the RNG to route alike
        self.route_maps: list[moe.RouteMap] = []

    def route(self, x, mask):
        logits = x @ self.router.to(x.dtype) + mask.to(x.dtype)
        if self.jitter:
            logits = logits + self.jitter * torch.randn_like(logits)
        weights, ids = logits.float().softmax(-1).topk(K, dim=-1)
        route_map = moe.build_route_map(ids, self.router.shape[1])
        self.route_maps.append(route_map)
        return weights, route_map

    def forward(self, x, mask):
        weights, route_map = self.route(x, mask)
        # expert weights cast to the activations' dtype: under autocast the parameters stay fp32 (README)
        return moe.moe_ffn(x, route_map, weights, self.w_gate_up.to(x.dtype), self.w_down.to(x.dtype))


class EPMoE(MoE):
    """The same layer with its experts split over `group` by an AllToAllDispatcher (this rank's experts only)."""

    def __init__(self, num_experts: int, group):
        super().__init__(num_experts)
        self.dispatcher = moe.AllToAllDispatcher(group, num_experts)
        el, r = self.dispatcher.num_local_experts, self.dispatcher.ep_rank
        self.w_gate_up = nn.Parameter(self.w_gate_up.detach()[r * el:(r + 1) * el].clone())
        self.w_down = nn.Parameter(self.w_down.detach()[r * el:(r + 1) * el].clone())

    def forward(self, x, mask):
        weights, route_map = self.route(x, mask)
        result = self.dispatcher.dispatch(x, route_map)
        y = moe.swiglu_experts(result.rows, self.w_gate_up.to(x.dtype), self.w_down.to(x.dtype), result.offsets)
        return self.dispatcher.combine(y, result, weights)


class Net(nn.Module):
    def __init__(self, num_experts: int, ckpt: bool | None = None, jitter: float = 0.0, moe_layer=None):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.inp, self.out = nn.Linear(D, D), nn.Linear(D, D)
        with torch.no_grad():
            for lin in (self.inp, self.out):
                lin.weight.copy_(torch.randn(D, D, generator=g) * D**-0.5)
                lin.bias.copy_(torch.randn(D, generator=g) * 0.1)
        self.moe = moe_layer if moe_layer is not None else MoE(num_experts, jitter)
        self.ckpt = ckpt  # None: no checkpoint; else torch.utils.checkpoint's use_reentrant around the MoE layer

    def forward(self, x, mask):
        x = self.inp(x)
        if self.ckpt is None:
            y = self.moe(x, mask)
        else:
            y = checkpoint(self.moe, x, mask, use_reentrant=self.ckpt)
        return self.out(x + y)


def batch(num_tokens: int, num_experts: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Global float64 tokens and a router mask: tokens 0-5 never reach experts 2.. (so on a rank holding only them
    those experts get no rows), tokens from 6 on never reach expert 0."""
    x = torch.randn(num_tokens, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    mask = torch.zeros(num_tokens, num_experts, dtype=torch.float64)
    mask[:6, 2:] = -float("inf")
    mask[6:, 0] = -float("inf")
    return x, mask


def reference_grads(x: torch.Tensor, mask: torch.Tensor, num_experts: int) -> dict[str, torch.Tensor]:
    """One process, the whole global batch, float64."""
    net = Net(num_experts).double()
    (net(x, mask).square().sum() / x.shape[0]).backward()
    return {n: p.grad for n, p in net.named_parameters()}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _loss(out: torch.Tensor, world: int, total: int) -> torch.Tensor:
    return out.square().sum() * world / total  # in the run's dtype


SPLIT = (14, 10)  # tokens per rank: uneven; rank 0's first 6 tokens skip experts 2, 3


def _ddp_cases(rank: int) -> dict:
    res: dict = {}
    E, world = 4, dist.get_world_size()
    x, mask = batch(sum(SPLIT), E)
    ref = reference_grads(x, mask, E)
    lo, hi = sum(SPLIT[:rank]), sum(SPLIT[:rank + 1])
    for dtype in (torch.float64, torch.float32):  # float32: torch's grouped_mm on the CPU; float64: the loop
        for name, opts in (("plain", {}), ("find_unused", {"find_unused_parameters": True}),
                           ("static_graph", {"static_graph": True}), ("bucket_view", {"gradient_as_bucket_view": True})):
            model = DDP(Net(E).to(dtype), **opts)
            for _ in range(2):  # static_graph records the graph in the first iteration, reuses it in the second
                model.zero_grad(set_to_none=True)
                _loss(model(x[lo:hi].to(dtype), mask[lo:hi]), world, len(x)).backward()
            res[f"ddp {name} {dtype}"] = max(rel_err(p.grad, ref[n.removeprefix("module.")])
                                             for n, p in model.named_parameters())
        model = DDP(Net(E).to(dtype))  # 3 micro-batches per rank, the first two under no_sync
        parts = torch.arange(lo, hi).tensor_split(3)
        for i, idx in enumerate(parts):
            if i < len(parts) - 1:
                with model.no_sync():
                    _loss(model(x[idx].to(dtype), mask[idx]), world, len(x)).backward()
            else:
                _loss(model(x[idx].to(dtype), mask[idx]), world, len(x)).backward()
        res[f"ddp no_sync {dtype}"] = max(rel_err(p.grad, ref[n.removeprefix("module.")])
                                          for n, p in model.named_parameters())
    # a rank with no tokens at all (its batch ran out): every parameter still gets a gradient, DDP does not hang
    model = DDP(Net(E))
    n0 = SPLIT[0]
    _loss(model(x[:n0].float() if rank == 0 else x[:0].float(), mask[:n0] if rank == 0 else mask[:0]),
          world, n0).backward()
    ref0 = reference_grads(x[:n0], mask[:n0], E)
    res["ddp empty rank"] = max(rel_err(p.grad, ref0[n.removeprefix("module.")]) for n, p in model.named_parameters())
    return res


def _fsdp_cases(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    res: dict = {}
    E, world = 3, dist.get_world_size()  # 3 experts over 2 ranks: uneven shards (2 + 1), padded by FSDP
    x, mask = batch(sum(SPLIT), E)
    ref = reference_grads(x, mask, E)
    lo, hi = sum(SPLIT[:rank]), sum(SPLIT[:rank + 1])
    mesh = init_device_mesh("cpu", (world,))
    for ckpt in (None, False):
        net = Net(E, ckpt=ckpt)
        fully_shard(net.moe, mesh=mesh)
        fully_shard(net, mesh=mesh)
        res["fsdp expert weights are DTensors"] = isinstance(net.moe.w_gate_up, DTensor)
        for _ in range(2):
            net.zero_grad(set_to_none=True)
            _loss(net(x[lo:hi].float(), mask[lo:hi]), world, len(x)).backward()
        res[f"fsdp ckpt={ckpt}"] = max(rel_err(p.grad.full_tensor(), ref[n]) for n, p in net.named_parameters())
    # the sharded parameters reached outside the layer's forward (nothing gathered them): refused by name
    weights, ids = torch.rand(4, E).topk(K, dim=-1)
    try:
        moe.moe_ffn(x[:4].float(), moe.build_route_map(ids, E), weights, net.moe.w_gate_up, net.moe.w_down)
        res["dtensor refusal"] = "no error"
    except Exception as err:  # noqa: BLE001 - the test checks its kind and text
        res["dtensor refusal"] = f"{type(err).__name__}: {err}"
    return res


def _ep_dp_cases(rank: int) -> dict:
    """Experts split over 2 EP ranks by AllToAllDispatcher (on a group of their own), DDP over everything else
    (the expert parameters ignored by DDP). Each rank's expert gradient sums both ranks' losses (the tokens of
    both reach it), so with DDP's averaging loss it is world x the global-batch gradient."""
    res: dict = {}
    E, world = 4, dist.get_world_size()
    x, mask = batch(sum(SPLIT), E)
    ref = reference_grads(x, mask, E)
    lo, hi = sum(SPLIT[:rank]), sum(SPLIT[:rank + 1])
    ep_group = dist.new_group(list(range(world)))
    for ckpt, opts in ((None, {}), (False, {"static_graph": True}), (True, {})):
        net = Net(E, ckpt=ckpt, moe_layer=EPMoE(E, ep_group))
        DDP._set_params_and_buffers_to_ignore_for_model(net, list(EXPERT_PARAMS))
        model = DDP(net, **opts)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            _loss(model(x[lo:hi].float(), mask[lo:hi]), world, len(x)).backward()
        el = net.moe.dispatcher.num_local_experts
        errs = []
        for n, p in net.named_parameters():
            if n in EXPERT_PARAMS:
                errs.append(rel_err(p.grad / world, ref[n][rank * el:(rank + 1) * el]))
            else:
                errs.append(rel_err(p.grad, ref[n]))
        res[f"ep+dp ckpt={ckpt} {opts}"] = max(errs)
    return res


def _cases(rank: int) -> dict:
    return {**_ddp_cases(rank), **_fsdp_cases(rank), **_ep_dp_cases(rank)}


def _entry(world: int, timeout_s: float, rank: int, port: int, out_dir: str) -> None:
    kernels_spawn.run_gloo_rank(rank, port, out_dir, world, timeout_s, _cases)
