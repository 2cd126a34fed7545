"""QA 75: the seams the next wave plugs into, used on moe-train's model from outside, through public API only.

Transport: a dispatcher written here (qa75_worker.GatherDispatcher: index_select / index_add, no permute or
combine) installed on every MoE layer (`model.moe_layers()`, `layer.dispatcher`) gives the stock model's logits and
every parameter's gradient (odd token counts, empty experts, top-k 2 and 3); a LocalDispatcher subclass or an
IdentityCodec subclass that overrides a call is run, not bypassed by the fused local block.
Payload: a bf16 codec on the layers' LocalDispatchers equals the same rounding done by hand in a transport.
Precision: a recipe written here (fp16-rounded GEMM inputs) reaches every dense linear layer and both expert GEMMs
of every MoE layer through `Transformer(cfg, recipe=...)`, forward and backward, fp32 master weights untouched.
Pipeline seam (2 gloo ranks, one spawn): build_groups with pp=2 leaves a codec model as it is; with ep=2,
apply_expert_parallel carries each layer's codec to its all-to-all dispatcher and matches one process.
"""

from __future__ import annotations

import copy
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import qa75_worker as w  # noqa: E402
import test_parallel_harness as h  # noqa: E402
from moe_kernels import DispatchResult, IdentityCodec, LocalDispatcher, RouteMap  # noqa: E402
from moe_precision import PrecisionRecipe  # noqa: E402
from moe_train.model import Transformer  # noqa: E402


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, seed: int):
    logits, aux = model(tokens)
    ((logits * w.cotangent(logits.shape, seed)).sum() + aux).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same_step(got: tuple, want: tuple, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        assert grad is not None and got[1][name] is not None, name
        torch.testing.assert_close(got[1][name], grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"grad {n}: {m}")


# ---- transport ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("top_k,batch,experts", [(2, 1, 6), (3, 3, 16), (2, 2, 16)])
def test_a_transport_written_outside_plugs_into_the_model_with_the_stock_outputs_and_every_gradient(
        top_k, batch, experts):
    torch.manual_seed(top_k * 10 + batch)
    stock = Transformer(w.model_config(top_k, experts))
    mine = copy.deepcopy(stock)
    transports = [w.GatherDispatcher(layer.num_experts) for layer in mine.moe_layers()]
    for layer, transport in zip(mine.moe_layers(), transports):
        layer.dispatcher = transport
    tokens = w.tokens(batch, seed=batch)  # 7, 21 or 14 tokens
    _assert_same_step(_loss_and_grads(mine, tokens, 1), _loss_and_grads(stock, tokens, 1))
    assert [t.calls for t in transports] == [1] * len(transports)
    assert any(t.saw_empty_expert for t in transports)


class CountingLocalDispatcher(LocalDispatcher):
    """A LocalDispatcher subclass that overrides dispatch (here: to count; a real one would change the transport)."""

    def __init__(self, num_experts: int):
        super().__init__(num_experts)
        self.calls = 0

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        self.calls += 1
        return super().dispatch(x, route_map)


class CountingIdentityCodec(IdentityCodec):
    def __init__(self):
        self.encoded = 0

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        self.encoded += 1
        return rows


def test_a_subclass_of_the_local_dispatcher_or_of_the_identity_codec_is_run_not_bypassed():
    torch.manual_seed(5)
    stock = Transformer(w.model_config())
    mine = copy.deepcopy(stock)
    dispatchers, codecs = [], []
    for i, layer in enumerate(mine.moe_layers()):
        if i % 2 == 0:
            dispatchers.append(CountingLocalDispatcher(layer.num_experts))
            layer.dispatcher = dispatchers[-1]
        else:
            codecs.append(CountingIdentityCodec())
            layer.dispatcher = LocalDispatcher(layer.num_experts, codec=codecs[-1])
    assert dispatchers and codecs
    tokens = w.tokens(2, seed=3)
    _assert_same_step(_loss_and_grads(mine, tokens, 2), _loss_and_grads(stock, tokens, 2))
    calls = {"LocalDispatcher subclass's dispatch": [d.calls for d in dispatchers],
             "IdentityCodec subclass's encode": [c.encoded for c in codecs]}
    assert calls == {name: [1] * len(n) for name, n in calls.items()}, f"calls per MoE layer (0: bypassed): {calls}"


# ---- payload codec -----------------------------------------------------------------------------------------

def test_a_payload_codec_on_the_layers_dispatchers_equals_the_same_rounding_done_by_hand():
    torch.manual_seed(7)
    coded = Transformer(w.model_config(top_k=3))
    by_hand = copy.deepcopy(coded)
    stock = copy.deepcopy(coded)
    codecs = w.with_codec(coded)
    for layer in by_hand.moe_layers():
        layer.dispatcher = w.GatherDispatcher(layer.num_experts, round_rows=True)
    tokens = w.tokens(3, seed=4)
    got = _loss_and_grads(coded, tokens, 3)
    _assert_same_step(got, _loss_and_grads(by_hand, tokens, 3))
    assert [(c.encoded, c.decoded) for c in codecs] == [(1, 1)] * len(codecs)
    assert not torch.equal(got[0], _loss_and_grads(stock, tokens, 3)[0]), "the bf16 payload was meant to be lossy"


# ---- precision recipe ----------------------------------------------------------------------------------------

class RoundToFp16(torch.autograd.Function):
    """Fake quantization: t rounded to fp16 and back to t's dtype; straight-through gradient. Counts both ways."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, counts: Counter, what: str) -> torch.Tensor:
        ctx.counts, ctx.what = counts, what
        counts[f"{what} forward"] += 1
        return t.to(torch.float16).to(t.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.counts[f"{ctx.what} backward"] += 1
        return grad, None, None


class CastForExperts(torch.autograd.Function):
    """The expert weight as the fp16 GEMM consumes it; its gradient back in the master weight's dtype. Counted."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, counts: Counter) -> torch.Tensor:
        ctx.counts, ctx.dtype = counts, t.dtype
        counts["expert weight forward"] += 1
        return t.to(torch.float16)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.counts["expert weight backward"] += 1
        assert grad.dtype == torch.float16
        return grad.to(ctx.dtype), None


class Fp16InputLinear(nn.Linear):
    """nn.Linear whose input and weight are rounded to fp16 for the GEMM (computed in the master dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, counts: Counter):
        super().__init__(in_features, out_features, bias=bias)
        self.counts = counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(RoundToFp16.apply(x, self.counts, "linear input"),
                        RoundToFp16.apply(self.weight, self.counts, "linear weight"), self.bias)


@dataclass(frozen=True)
class Fp16InputsRecipe(PrecisionRecipe):
    """Dense linear layers: fp16-rounded inputs and weights; expert GEMMs: fp16 (rows and weights)."""

    name: str = "fp16-inputs"
    counts: Counter = field(default_factory=Counter, compare=False, hash=False)

    def __post_init__(self) -> None:  # the base class refuses every name but its own ("bf16")
        pass

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        self.counts["linear built"] += 1
        return Fp16InputLinear(in_features, out_features, bias, self.counts)

    def expert_gemm_dtype(self, x: torch.Tensor) -> torch.dtype:
        self.counts["expert dtype asked"] += 1
        return torch.float16

    def gemm_weight(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return CastForExperts.apply(w, self.counts)


def _recipe_linears(model: Transformer) -> list[nn.Module]:
    """Every dense linear layer of the model (router logits are the router's own fp32 GEMM, not a recipe's)."""
    found = [model.lm_head]
    for block in model.blocks:
        found += [block.attn.q_proj, block.attn.k_proj, block.attn.v_proj, block.attn.o_proj]
        mlps = [block.mlp.shared_expert] if block.is_moe else [block.mlp]
        found += [m for mlp in mlps for m in (mlp.gate, mlp.up, mlp.down)]
        if block.is_moe:
            found.append(block.mlp.shared_expert_gate)
    return found


@pytest.mark.parametrize("gemm_backend,transport", [("auto", "stock"), ("reference", "stock"), ("auto", "own")])
def test_a_recipe_written_outside_reaches_every_dense_linear_and_both_expert_gemms_forward_and_backward(
        gemm_backend, transport):
    cfg = w.model_config()
    cfg.gemm_backend = gemm_backend
    recipe = Fp16InputsRecipe()
    torch.manual_seed(9)
    model = Transformer(cfg, recipe=recipe)
    if transport == "own":  # the expert GEMMs behind a transport instead of the fused local block
        for layer in model.moe_layers():
            layer.dispatcher = w.GatherDispatcher(layer.num_experts)
    torch.manual_seed(9)
    stock = Transformer(cfg)
    linears = _recipe_linears(model)
    assert all(isinstance(m, Fp16InputLinear) for m in linears), [type(m).__name__ for m in linears]
    assert recipe.counts["linear built"] == len(linears)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    stock.load_state_dict(model.state_dict())  # the recipe's layers hold nn.Linear's parameters, by the same names
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}

    tokens = w.tokens(2, seed=6)
    got = _loss_and_grads(model, tokens, 4)
    want = _loss_and_grads(stock, tokens, 4)
    moe = len(model.moe_layers())
    assert recipe.counts["linear input forward"] == recipe.counts["linear weight forward"] == len(linears)
    assert recipe.counts["linear input backward"] == recipe.counts["linear weight backward"] == len(linears)
    # asked twice per layer: MoELayer casts the rows for dispatch, the recipe's FFN (gemm_input) checks them again
    assert recipe.counts["expert dtype asked"] == 2 * moe
    assert recipe.counts["expert weight forward"] == recipe.counts["expert weight backward"] == 2 * moe
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), masters[name]), name
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    for layer in model.moe_layers():
        assert layer.experts.w_gate_up.grad.abs().sum() > 0 and layer.experts.w_down.grad.abs().sum() > 0
    # the rounding is in the numbers: close to the fp32 model, not equal to it
    assert not torch.equal(got[0], want[0])
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-3)


def test_the_default_recipe_is_still_the_configs():
    torch.manual_seed(2)
    a = Transformer(w.model_config())
    torch.manual_seed(2)
    b = Transformer(w.model_config(), recipe=PrecisionRecipe("bf16"))
    tokens = w.tokens(1, seed=1)
    assert torch.equal(a(tokens)[0], b(tokens)[0])


# ---- pipeline seam and expert parallelism with a codec (2 gloo ranks, one spawn) -------------------------------

@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("qa75")
    h.start_ranks(w.run_rank, args=(str(out), h.free_port()), nprocs=w.WORLD)
    return h.load_results(out, w.WORLD)


@pytest.mark.slow
def test_pipeline_stage_groups_leave_a_model_with_a_codec_as_it_is(ranks):
    for rank, res in enumerate(ranks):
        pp = res["pp"]
        assert (pp["pp_size"], pp["dp_size"], pp["coords"]) == (2, 1, (rank, 0)), (rank, pp)
        assert all(pp["dispatchers_kept"]) and pp["logits_equal"], (rank, pp)
        assert pp["calls"] == [(1, 1)] * len(pp["calls"]), (rank, pp)


@pytest.mark.slow
def test_expert_parallelism_carries_each_layers_codec_and_matches_one_process(ranks):
    for rank, res in enumerate(ranks):
        ep = res["ep"]
        assert all(ep["all_to_all_with_codec"]), (rank, ep)
        assert ep["calls"] == [(1, 1)] * len(ep["calls"]), (rank, ep)
        assert ep["logits_err"] < 1e-5 and max(ep["grad_errs"]) < 1e-5, (rank, ep)


@pytest.mark.slow
def test_an_expert_parallel_transport_written_outside_replaces_the_all_to_all_and_matches_one_process(ranks):
    for rank, res in enumerate(ranks):
        own = res["own_ep_transport"]
        assert own["logits_err"] < 1e-5 and max(own["grad_errs"]) < 1e-5, (rank, own)
