"""The routed-expert SwiGLU FFN with its fusions, forward and backward, GEMM by GEMM.

forward   pre, act = SwiGLU(gather(x) @ W1)      fwd1
          y = act @ W2                           fwd2
          out[t] = sum_s w[t,s] y[dest[t,s]]     one gather-sum kernel (fp32 accumulation)
backward  dy = w * g[token], gw = <g, y>         one kernel per token
          d_pre = SwiGLU'(dy @ W2^T, pre)        dgrad2
          dW2 = act^T dy                         wgrad2
          dxs = d_pre @ W1^T                     dgrad1, then gx[t] = sum_s dxs[dest[t,s]]
          dW1 = gather(x)^T d_pre                wgrad1
A `BlockPlan` says how each GEMM runs: on our Triton kernels (fwd1 with SwiGLU in its
epilogue, reading x through the gather in its A-load or the permuted rows through tensor
descriptors; dgrad2 with SwiGLU' in its epilogue; or plain GEMMs
followed by one elementwise SwiGLU pass) or on torch grouped_mm (cuBLAS/CUTLASS), which
needs the rows permuted first. The routing weight is applied in the combine rather than in
fwd2's epilogue: the combine reads y anyway, and backward needs the unweighted y for the
router-weight gradient. Without routing (`dest_row is None`) the rows are already in expert order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from moe_kernels.triton import dense_rows
from moe_kernels.triton.grouped_gemm_kernels import grouped_gemm_launch, grouped_wgrad_launch
from moe_kernels.triton.autograd_support import refuse_dual_inputs, refuse_forward_ad, run_backward, vmap_by_loop
from moe_kernels.triton.permute_kernels import combine_backward, gather_sum, scatter_rows
from moe_kernels.triton.swiglu_kernels import swiglu_backward, swiglu_forward

PLAN_OPTIONS: dict[str, tuple[str, ...]] = {
    "fwd1": ("fused", "triton", "grouped_mm"), "fwd2": ("triton", "grouped_mm"),
    "dgrad2": ("fused", "triton", "grouped_mm"), "wgrad2": ("triton", "grouped_mm"),
    "dgrad1": ("triton", "grouped_mm"), "wgrad1": ("triton", "grouped_mm"),
}


@dataclass(frozen=True)
class BlockPlan:
    """How each GEMM of the block runs. "fused": Triton with the block's fusion (fwd1: gather +
    SwiGLU epilogue; dgrad2: SwiGLU' epilogue); "triton": our Triton grouped GEMM without the
    gather (fwd1: on the permuted rows, read through tensor descriptors, with the SwiGLU
    epilogue; elsewhere plus an elementwise SwiGLU pass where one is due); "grouped_mm": torch
    grouped_mm."""

    fwd1: Literal["fused", "triton", "grouped_mm"] = "fused"
    fwd2: Literal["triton", "grouped_mm"] = "triton"
    dgrad2: Literal["fused", "triton", "grouped_mm"] = "fused"
    wgrad2: Literal["triton", "grouped_mm"] = "triton"
    dgrad1: Literal["triton", "grouped_mm"] = "triton"
    wgrad1: Literal["triton", "grouped_mm"] = "triton"

    def __post_init__(self):
        for f in fields(self):
            ok = PLAN_OPTIONS[f.name]
            if getattr(self, f.name) not in ok:
                raise ValueError(f"BlockPlan.{f.name}={getattr(self, f.name)!r} is not one of {ok}")

    @property
    def needs_sorted_rows(self) -> bool:
        """Whether the permuted input rows are materialised (grouped_mm cannot gather; fwd1
        "triton" reads them through tensor descriptors, which cannot gather either)."""
        return self.fwd1 != "fused" or self.wgrad1 == "grouped_mm"


ALL_TRITON = BlockPlan()
ALL_GROUPED_MM = BlockPlan("grouped_mm", "grouped_mm", "grouped_mm", "grouped_mm", "grouped_mm", "grouped_mm")


def gemm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, impl: str) -> torch.Tensor:
    """a: [N, K] rows in expert order, b: [E, K, M] (any strides) -> [N, M]."""
    if impl == "grouped_mm":
        return torch._grouped_mm(a, b, offs=offsets)
    c = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    return grouped_gemm_launch(a, b, offsets, out_cols=b.shape[2], c=c)


def wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, num_experts: int, impl: str, out_dtype) -> torch.Tensor:
    """[E, K, N] = per expert a[rows]^T @ b[rows]; a: [N, K], b: [N, N'] rows in expert order."""
    if impl == "grouped_mm":
        return torch._grouped_mm(a.t(), b, offs=offsets).to(out_dtype)
    return grouped_wgrad_launch(a, b, offsets, num_experts, out_dtype=out_dtype)


class SwigluFFNFn(torch.autograd.Function):
    """The block as one autograd op. Forward returns (out, xs, pre, act, y): the intermediates the
    backward reads ride along as non-differentiable outputs (setup_context can only save what the
    forward returns), None where they are an input or `out` itself; the wrappers below keep `out`."""

    @staticmethod
    def forward(x, weights, w1, w2, offsets, sort_order, dest_row, top_k, plan):
        """x: [T, d] (routed) or [N, d] (sorted rows), row-major (`dense_rows`); w1: [E, d, 2h]; w2: [E, h, d]."""
        refuse_dual_inputs("SwigluFFNFn", (x, weights, w1, w2))
        return block_forward(x, weights, w1, w2, offsets, sort_order, dest_row, top_k, plan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        refuse_forward_ad("SwigluFFNFn")
        x, weights, w1, w2, offsets, sort_order, dest_row, top_k, plan = inputs
        out, xs, pre, act, y = output
        ctx.mark_non_differentiable(*[t for t in (xs, pre, act, y) if t is not None])
        ctx.set_materialize_grads(False)  # else backward would get zero tensors the size of the intermediates
        ctx.routed, ctx.top_k, ctx.plan = dest_row is not None, top_k, plan
        if not ctx.routed:
            xs, y = x, out
        ctx.save_for_backward(x, xs, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y)

    @staticmethod
    def backward(ctx, g, *intermediates):
        if g is None:
            return (None,) * 9
        grads = run_backward("SwigluFFNFn", block_backward, g, *ctx.saved_tensors, ctx.routed, ctx.top_k, ctx.plan,
                             tuple(ctx.needs_input_grad[:4]))
        return (*grads, None, None, None, None, None)

    @staticmethod
    def vmap(info, in_dims, *args):
        return vmap_by_loop(info, in_dims, lambda x, *rest: SwigluFFNFn.apply(dense_rows(x), *rest), *args)


def sorted_rows(x, dest_row, top_k, plan):
    """The input rows in expert order where `plan` reads them (grouped_mm or descriptor loads cannot gather),
    None where the gather is fused into the A-loads; x itself without routing (`dest_row is None`)."""
    if dest_row is None:
        return x
    return scatter_rows(x, dest_row, top_k) if plan.needs_sorted_rows else None


def block_forward(x, weights, w1, w2, offsets, sort_order, dest_row, top_k, plan):
    """The block's forward by `plan`: (out, xs, pre, act, y), the intermediates None where they are an input or
    `out` itself (see SwigluFFNFn)."""
    routed = dest_row is not None
    n_rows = sort_order.shape[0] if routed else x.shape[0]
    h = w2.shape[1]
    xs = sorted_rows(x, dest_row, top_k, plan)
    if plan.fwd1 != "grouped_mm":
        gathered = routed and plan.fwd1 == "fused"
        pre = torch.empty(n_rows, 2 * h, dtype=x.dtype, device=x.device)
        act = torch.empty(n_rows, h, dtype=x.dtype, device=x.device)
        grouped_gemm_launch(
            x if gathered else xs, w1, offsets, out_cols=h, c=act, gather=sort_order if gathered else None,
            top_k=top_k, epilogue=1, aux=pre, swiglu_h=h,
        )
    else:
        pre = gemm(xs, w1, offsets, "grouped_mm")
        act = swiglu_forward(pre)
    y = gemm(act, w2, offsets, plan.fwd2)
    if routed:
        return gather_sum(y, dest_row, top_k, weights), xs, pre, act, y
    return y, None, pre, act, None


def block_backward(g, x, xs, weights, w1, w2, offsets, sort_order, dest_row, pre, act, y, routed, k, plan, needs):
    """(gx, g_weights, g_w1, g_w2) of the block, the gradients `needs` asks for (g_weights when routed)."""
    g = dense_rows(g)  # an empty g from out.sum() has stride 0, which grouped_mm refuses
    gw = None
    if routed:
        dy, gw = combine_backward(g, y, dest_row, weights)
    else:
        dy = g
    h = w2.shape[1]
    if plan.dgrad2 == "fused":
        d_pre = torch.empty_like(pre)
        grouped_gemm_launch(dy, w2.transpose(1, 2), offsets, out_cols=h, c=d_pre, epilogue=2, aux=pre, swiglu_h=h)
    else:
        d_pre = swiglu_backward(gemm(dy, w2.transpose(1, 2), offsets, plan.dgrad2), pre)
    gw2 = wgrad(act, dy, offsets, w2.shape[0], plan.wgrad2, w2.dtype) if needs[3] else None
    gx = None
    if needs[0]:
        dxs = gemm(d_pre, w1.transpose(1, 2), offsets, plan.dgrad1)
        gx = gather_sum(dxs, dest_row, k) if routed else dxs
    gw1 = None
    if needs[2]:
        if xs is not None:
            gw1 = wgrad(xs, d_pre, offsets, w1.shape[0], plan.wgrad1, w1.dtype)
        else:  # the gather fused into the A-load
            gw1 = grouped_wgrad_launch(x, d_pre, offsets, w1.shape[0], gather=sort_order, top_k=k, out_dtype=w1.dtype)
    return gx, gw, gw1, gw2


def swiglu_ffn_sorted(x_sorted, w_gate_up, w_down, offsets, plan: BlockPlan | str = ALL_TRITON):
    """x_sorted: [N, d] in expert order -> [N, d]. `plan` "auto" (under torch.compile only): chosen when it runs."""
    if torch.compiler.is_compiling():
        from moe_kernels.triton.compile_ops import plan_name, swiglu_block

        return swiglu_block(dense_rows(x_sorted), None, w_gate_up, w_down, offsets, None, None, 1, plan_name(plan))[0]
    return SwigluFFNFn.apply(dense_rows(x_sorted), None, w_gate_up, w_down, offsets, None, None, 1, plan)[0]


def swiglu_ffn_routed(x, weights, w_gate_up, w_down, offsets, sort_order, dest_row, plan: BlockPlan | str = ALL_TRITON):
    """x: [T, d], weights: [T, k] -> [T, d]: gather, expert SwiGLU FFN and weighted combine."""
    if torch.compiler.is_compiling():
        from moe_kernels.triton.compile_ops import plan_name, swiglu_block

        return swiglu_block(dense_rows(x), weights, w_gate_up, w_down, offsets, sort_order, dest_row,
                            weights.shape[1], plan_name(plan))[0]
    return SwigluFFNFn.apply(dense_rows(x), weights, w_gate_up, w_down, offsets, sort_order, dest_row, weights.shape[1], plan)[0]


def tune_block_plan(x, w1, w2, offsets, sort_order, dest_row, top_k) -> BlockPlan:
    """Time every GEMM of the block both ways on these inputs (our Triton kernels, each already
    tuned, against torch grouped_mm with the elementwise passes and the row permutation it
    needs) and return the fastest plan. fwd1 and wgrad1 are chosen together: grouped_mm in
    either, or fwd1 on our kernel without the gather, needs the permuted rows materialised,
    which the fused gather avoids."""
    import triton.testing

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median")

    routed = dest_row is not None
    n, h, d = (sort_order.shape[0] if routed else x.shape[0]), w2.shape[1], x.shape[1]
    gen = torch.Generator(device=x.device).manual_seed(0)
    xs = scatter_rows(x, dest_row, top_k) if routed else x
    pre = torch.randn(n, 2 * h, device=x.device, generator=gen).to(x.dtype)
    act = swiglu_forward(pre)
    dy = torch.randn(n, d, device=x.device, generator=gen).to(x.dtype)
    d_pre = torch.randn(n, 2 * h, device=x.device, generator=gen).to(x.dtype)
    w1t, w2t = w1.transpose(1, 2), w2.transpose(1, 2)
    E = w1.shape[0]

    def fwd1_fused(rows_in_order: bool):
        grouped_gemm_launch(xs if rows_in_order else x, w1, offsets, out_cols=h, c=torch.empty_like(act),
                            gather=sort_order if routed and not rows_in_order else None,
                            top_k=top_k, epilogue=1, aux=torch.empty_like(pre), swiglu_h=h)

    def dgrad2_fused():
        grouped_gemm_launch(dy, w2t, offsets, out_cols=h, c=torch.empty_like(pre), epilogue=2, aux=pre, swiglu_h=h)

    t_scatter = bench(lambda: scatter_rows(x, dest_row, top_k)) if routed else 0.0
    t_fwd1 = {"fused": bench(lambda: fwd1_fused(False)), "grouped_mm": bench(lambda: swiglu_forward(gemm(xs, w1, offsets, "grouped_mm")))}
    if routed:  # without routing the rows are already in order: "triton" would time "fused" again
        t_fwd1["triton"] = bench(lambda: fwd1_fused(True))
    t_w1 = {impl: bench(lambda impl=impl: wgrad(xs, d_pre, offsets, E, impl, w1.dtype)) for impl in ("triton", "grouped_mm")}
    if routed:
        t_w1_gather = bench(lambda: grouped_wgrad_launch(x, d_pre, offsets, E, gather=sort_order, top_k=top_k, out_dtype=w1.dtype))
    else:
        t_w1_gather = t_w1["triton"]
    combos = {
        ("fused", "triton"): t_fwd1["fused"] + t_w1_gather,
        ("fused", "grouped_mm"): t_fwd1["fused"] + t_scatter + t_w1["grouped_mm"],
    }
    for impl in ("triton", "grouped_mm") if routed else ("grouped_mm",):
        for w1_impl in ("triton", "grouped_mm"):
            combos[(impl, w1_impl)] = t_scatter + t_fwd1[impl] + t_w1[w1_impl]
    fwd1, wgrad1 = min(combos, key=combos.get)
    both = ("triton", "grouped_mm")
    t_fwd2 = {impl: bench(lambda impl=impl: gemm(act, w2, offsets, impl)) for impl in both}
    t_dgrad1 = {impl: bench(lambda impl=impl: gemm(d_pre, w1t, offsets, impl)) for impl in both}
    t_wgrad2 = {impl: bench(lambda impl=impl: wgrad(act, dy, offsets, E, impl, w2.dtype)) for impl in both}
    t_dgrad2 = {impl: bench(lambda impl=impl: swiglu_backward(gemm(dy, w2t, offsets, impl), pre)) for impl in both}
    t_dgrad2["fused"] = bench(dgrad2_fused)
    return BlockPlan(
        fwd1=fwd1, fwd2=min(t_fwd2, key=t_fwd2.get), dgrad2=min(t_dgrad2, key=t_dgrad2.get),
        wgrad2=min(t_wgrad2, key=t_wgrad2.get), dgrad1=min(t_dgrad1, key=t_dgrad1.get), wgrad1=wgrad1,
    )
