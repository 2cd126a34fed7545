"""QA 74: torch.func and autograd through the triton backend, as a training stack embedding it uses them.

Regressions (each failed before its fix, with an error that named neither the op nor the backend):
- dual tensors of torch.autograd.forward_ad, and torch.func.linearize (which traces them with make_fx),
  are refused by name in the Function's forward; before, torch said "You must implement the jvp
  function" (eager dual) or Triton's launcher failed on a proxy tensor ("argument of type:
  UntypedStorage") under linearize;
- torch.autograd.grad(is_grads_batched=True) and torch.autograd.functional.jacobian(vectorize=True)
  run the backward under torch's legacy vmap: refused by name; before, the kernels were handed the
  batched tensors ("Cannot access storage of BatchedTensorImpl").
Guards for what held: vmap with in_dims / out_dims other than 0, nested, chunked; grad with has_aux
and every argnum; a vjp_fn called twice; the block called twice on shared weights; functional_call
per-sample gradients and model ensembling; jacrev on strided inputs; eager autograd (backward twice,
a subset of inputs, checkpointing either way, no_grad / inference_mode, vmap's forward with eager
backward); T=1, top_k=1, E=1. Every value against backend="reference".

Run under Triton's CPU interpreter in a subprocess (TRITON_INTERPRET must be set before any
@triton.jit function is defined), as tests/test_torch_func_triton.py does.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import interpreter_checks  # noqa: E402

try:
    import numpy  # noqa: F401  (Triton's interpreter runs on numpy)
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:
    HAVE_TRITON = False

T, D, H, E, K = 7, 16, 8, 3, 2
FORWARD_AD = r"forward-mode AD .* not supported with backend='triton'; use backend='reference' for that transform"
LEGACY_VMAP = r"backend='triton' cannot run its backward under torch.autograd.grad\(\.\.\., is_grads_batched=True\)"


def _problem(torch, moe, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    rm = moe.build_route_map(ids, E, backend="reference")
    x = torch.randn(T, D, generator=g)
    w = torch.rand(T, K, generator=g)
    w1 = torch.randn(E, D, 2 * H, generator=g) / D**0.5
    w2 = torch.randn(E, H, D, generator=g) / H**0.5
    return rm, x, w, w1, w2


def _close(torch, got, want, tol=1e-4):
    if isinstance(got, dict):
        assert got.keys() == want.keys()
        got, want = list(got.values()), [want[k] for k in got]
    if isinstance(got, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _close(torch, a, b, tol)
        return
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _both(fn):
    """fn(backend) on the triton and the reference backend."""
    return fn("triton"), fn("reference")


def check_eager_dual_tensors_and_linearize_are_refused_by_name(torch, moe):
    import torch.autograd.forward_ad as fwAD

    rm, x, w, w1, w2 = _problem(torch, moe, 1)
    rows = x[rm.source_token]
    calls = {
        "SwigluFFNFn": lambda d: moe.moe_ffn(x, rm, d, w1, w2, "triton"),
        "CombineFn": lambda d: moe.combine(rows, rm, d, "triton"),
        "PermuteFn": lambda d: moe.permute(x * d[:, :1], rm, backend="triton"),
        "GroupedGemmFn": lambda d: moe.grouped_gemm(rows * d.sum(), w1, rm.offsets, "triton"),
    }
    for name, call in calls.items():
        with fwAD.dual_level(), pytest.raises(RuntimeError, match=f"{name}: {FORWARD_AD}"):
            call(fwAD.make_dual(w, torch.ones_like(w)))
    with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {FORWARD_AD}"):
        torch.func.linearize(calls["SwigluFFNFn"], w)
    # an open dual level with plain inputs is no forward-mode AD: it runs, and so does torch.func.grad in it
    with fwAD.dual_level():
        _close(torch, *_both(lambda b: moe.moe_ffn(x, rm, w, w1, w2, b)))
        _close(torch, *_both(lambda b: torch.func.grad(lambda a: moe.moe_ffn(x, rm, w, a, w2, b).square().sum())(w1)))


def check_legacy_vmap_backward_is_refused_by_name(torch, moe):
    rm, x, w, w1, w2 = _problem(torch, moe, 2)
    cots = torch.randn(3, T, D)

    def batched_grads(backend):
        leaves = [t.clone().requires_grad_() for t in (x, w, w1, w2)]
        out = moe.moe_ffn(leaves[0], rm, leaves[1], leaves[2], leaves[3], backend)
        return torch.autograd.grad(out, leaves, cots, is_grads_batched=True)

    with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {LEGACY_VMAP}"):
        batched_grads("triton")
    batched_grads("reference")  # the alternative the message names
    rows = x[rm.source_token]
    with pytest.raises(RuntimeError, match=f"CombineFn: {LEGACY_VMAP}"):
        torch.autograd.functional.jacobian(lambda d: moe.combine(rows, rm, d, "triton")[:2], w, vectorize=True)
    # the non-vectorized jacobian (one eager backward per output) and torch.func.jacrev give the reference's
    _close(torch, *_both(lambda b: torch.autograd.functional.jacobian(lambda d: moe.moe_ffn(x, rm, d, w1, w2, b)[:2], w)))
    _close(torch, *_both(lambda b: torch.func.jacrev(lambda d: moe.moe_ffn(x, rm, d, w1, w2, b)[:2, :3])(w)))


def check_vmap_over_other_dims_nested_and_chunked(torch, moe):
    rm, x, w, w1, w2 = _problem(torch, moe, 3)
    x_dim1 = torch.randn(T, 2, D)
    _close(torch, *_both(lambda b: torch.func.vmap(lambda t: moe.moe_ffn(t, rm, w, w1, w2, b), in_dims=1, out_dims=1)(x_dim1)))
    w1_dim2 = torch.stack([w1, -w1], dim=2)  # only a weight batched, x not
    _close(torch, *_both(lambda b: torch.func.vmap(lambda a: moe.moe_ffn(x, rm, w, a, w2, b), in_dims=2)(w1_dim2)))
    x_batch = torch.randn(2, T, D)
    w1_batch = torch.stack([w1, 0.5 * w1, -w1])
    _close(torch, *_both(lambda b: torch.func.vmap(
        lambda t: torch.func.vmap(lambda a: moe.moe_ffn(t, rm, w, a, w2, b))(w1_batch))(x_batch)))
    _close(torch, *_both(lambda b: torch.func.vmap(lambda t: moe.moe_ffn(t, rm, w, w1, w2, b), chunk_size=1)(x_batch)))
    # permute and combine, and their gradients, with the batch on dim 1 of x
    _close(torch, *_both(lambda b: torch.func.vmap(torch.func.grad(
        lambda t, d: moe.combine(moe.permute(t, rm, backend=b).sin(), rm, d, b).square().sum(), argnums=(0, 1)),
        in_dims=(1, None))(x_dim1, w)))


def check_grad_has_aux_vjp_twice_and_shared_weights(torch, moe):
    rm, x, w, w1, w2 = _problem(torch, moe, 4)

    def with_aux(backend):
        def loss(*a):
            out = moe.moe_ffn(a[0], rm, a[1], a[2], a[3], backend)
            return out.square().sum(), out

        return torch.func.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, w1, w2)

    _close(torch, *_both(with_aux))
    cots = torch.randn(2, T, D)

    def vjp_twice(backend):
        _, vjp_fn = torch.func.vjp(lambda *a: moe.moe_ffn(a[0], rm, a[1], a[2], a[3], backend), x, w, w1, w2)
        return vjp_fn(cots[0]), vjp_fn(cots[1])

    _close(torch, *_both(vjp_twice))

    def twice(backend):  # the block applied twice with the same weights, other ops around it
        return lambda a, c: torch.tanh(moe.moe_ffn(torch.tanh(moe.moe_ffn(x, rm, w, a, c, backend)), rm, w, a, c, backend)).sum()

    _close(torch, *_both(lambda b: torch.func.grad(twice(b), argnums=(0, 1))(w1, w2)))


def check_functional_call_per_sample_grads_and_ensembling(torch, moe):
    rm, x, w, w1, w2 = _problem(torch, moe, 5)

    class Block(torch.nn.Module):
        def __init__(self, backend, scale=1.0):
            super().__init__()
            self.w_gate_up = torch.nn.Parameter(w1 * scale)
            self.w_down = torch.nn.Parameter(w2 * scale)
            self.proj = torch.nn.Linear(D, D)
            with torch.no_grad():
                self.proj.weight.copy_(torch.eye(D) * 0.5)
                self.proj.bias.fill_(0.1)
            self.backend = backend

        def forward(self, t):
            return self.proj(moe.moe_ffn(t, rm, w, self.w_gate_up, self.w_down, self.backend))

    x_batch = torch.randn(3, T, D)

    def per_sample(backend):
        model = Block(backend)
        params = {k: v.detach() for k, v in model.named_parameters()}
        loss = lambda p, t: torch.func.functional_call(model, p, (t,)).square().sum()  # noqa: E731
        return torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x_batch)

    _close(torch, *_both(per_sample))

    def ensemble(backend):
        params, buffers = torch.func.stack_module_state([Block(backend, s) for s in (1.0, -0.5)])
        base = Block(backend).to("meta")
        call = lambda p, bu: torch.func.functional_call(base, (p, bu), (x,))  # noqa: E731
        return torch.func.vmap(call)(params, buffers), torch.func.vmap(torch.func.grad(lambda p, bu: call(p, bu).sum()))(params, buffers)

    _close(torch, *_both(ensemble))


def check_jacrev_on_strided_inputs(torch, moe):
    rm, x, w, w1, w2 = _problem(torch, moe, 6)
    x_t, w_t = x.T.contiguous().T, w.T.contiguous().T  # column-major views
    cols = torch.linspace(-1, 1, D)
    _close(torch, *_both(lambda b: torch.func.jacrev(
        lambda t, d: (moe.moe_ffn(t, rm, d, w1, w2, b) @ cols)[:3], argnums=(0, 1), chunk_size=1)(x_t, w_t)))


def check_eager_autograd_unchanged(torch, moe):
    from torch.utils.checkpoint import checkpoint

    rm, x, w, w1, w2 = _problem(torch, moe, 7)

    def leaves():
        return [t.clone().requires_grad_() for t in (x, w, w1, w2)]

    def block(backend):
        return lambda *a: moe.moe_ffn(a[0], rm, a[1], a[2], a[3], backend)

    def backward_twice(backend):
        ls = leaves()
        loss = block(backend)(*ls).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [t.grad for t in ls]

    _close(torch, *_both(backward_twice))

    def subset(backend):
        ls = leaves()
        return torch.autograd.grad(block(backend)(*ls).square().sum(), [ls[2], ls[1]])

    _close(torch, *_both(subset))
    for reentrant in (False, True):
        def checkpointed(backend, reentrant=reentrant):
            ls = leaves()
            checkpoint(block(backend), *ls, use_reentrant=reentrant).square().sum().backward()
            return [t.grad for t in ls]

        _close(torch, *_both(checkpointed))
    want = moe.moe_ffn(x, rm, w, w1, w2, "reference")
    with torch.no_grad():
        _close(torch, block("triton")(*leaves()), want)
    with torch.inference_mode():
        _close(torch, block("triton")(x, w, w1, w2), want)

    def vmap_forward_eager_backward(backend):  # per-sample forward, parameters' gradients summed by autograd
        p1, p2 = w1.clone().requires_grad_(), w2.clone().requires_grad_()
        torch.func.vmap(lambda t: moe.moe_ffn(t, rm, w, p1, p2, backend))(torch.stack([x, -x])).square().sum().backward()
        return p1.grad, p2.grad

    _close(torch, *_both(vmap_forward_eager_backward))


def check_forward_over_reverse_is_refused_by_name(torch, moe):
    rm, x, w, w1, w2 = _problem(torch, moe, 8)
    loss = lambda d: moe.moe_ffn(x, rm, d, w1, w2, "triton").square().sum()  # noqa: E731
    with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {FORWARD_AD}"):
        torch.func.jvp(torch.func.grad(loss), (w,), (torch.ones_like(w),))  # a Hessian-vector product


def check_single_token_single_expert(torch, moe):
    rm = moe.build_route_map(torch.zeros(1, 1, dtype=torch.long), 1, backend="reference")
    g = torch.Generator().manual_seed(9)
    leaves = [torch.randn(1, D, generator=g), torch.rand(1, 1, generator=g),
              torch.randn(1, D, 2 * H, generator=g) / 4, torch.randn(1, H, D, generator=g) / 3]
    _close(torch, *_both(lambda b: torch.func.grad(
        lambda *a: moe.moe_ffn(a[0], rm, a[1], a[2], a[3], b).square().sum(), argnums=(0, 1, 2, 3))(*leaves)))
    x_batch = torch.randn(2, 1, D, generator=g)
    _close(torch, *_both(lambda b: torch.func.vmap(torch.func.grad(
        lambda a, t: moe.moe_ffn(t, rm, leaves[1], a, leaves[3], b).square().sum()), in_dims=(None, 0))(leaves[2], x_batch)))


def check_torch_backend_on_gpu_refuses_forward_ad_naming_reference(torch, moe):
    """On a GPU backend="torch" runs the block as SwigluFFNFn too (the all-grouped_mm plan), so forward-mode AD
    is refused there as for backend="triton". The refusal told a backend="torch" caller to use backend="torch";
    it now names backend="reference", which gives it on every device, and says that on a GPU 'torch' runs this
    op. Simulated on the CPU by letting `triton_runs_on` answer as it does for a CUDA tensor."""
    import moe_kernels.triton as mt

    rm, x, w, w1, w2 = _problem(torch, moe, 10)
    gpu_gate = mt.triton_runs_on
    mt.triton_runs_on = lambda t: mt.triton_available()
    try:
        with pytest.raises(RuntimeError, match=f"SwigluFFNFn: {FORWARD_AD}" + r" \(on a GPU, backend='torch' and 'auto'"):
            torch.func.jvp(lambda d: moe.moe_ffn(x, rm, d, w1, w2, "torch"), (w,), (torch.ones_like(w),))
    finally:
        mt.triton_runs_on = gpu_gate
    torch.func.jvp(lambda d: moe.moe_ffn(x, rm, d, w1, w2, "reference"), (w,), (torch.ones_like(w),))


CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items() if name.startswith("check_")}


@pytest.mark.skipif(not HAVE_TRITON, reason="triton or numpy (its interpreter needs it) is not installed")
@pytest.mark.parametrize("check", list(CHECKS))
def test_qa74_torch_func_and_autograd_through_triton_under_interpreter(interpreter_verdicts, check):
    assert interpreter_verdicts[check]["verdict"] == "ok", interpreter_verdicts[check]["verdict"]


if __name__ == "__main__":
    import torch

    import moe_kernels as moe

    interpreter_checks.run_checks(CHECKS, torch, moe)

