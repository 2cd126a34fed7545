"""QA 121: the next wave's seams reached through moe-train's model, as the docs describe them.

- transport: `apply_expert_parallel(model, groups, transport=...)` builds each MoE layer's dispatcher with the
  layer's codec; a loopback transport written from TokenDispatcher's docs gives the built-in block's outputs and
  gradients (fp32, and bf16 under autocast). At ep = 1 an explicit transport was silently not installed (fixed);
- codec: a codec on the layer's LocalDispatcher runs inside the model and carries over to the transport;
- precision: a recipe object passed as `Transformer(cfg, recipe=...)` builds every nn.Linear of the model and
  hands the expert GEMMs their weights, forward and backward; an unknown `model.precision` is refused by name.
  (The expert GEMMs themselves are moe-kernels' swiglu_experts / moe_ffn, called by the layer: a recipe chooses
  their dtype and weights only, not the GEMM — reported in QA 121, not a test here.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from moe_kernels import DispatchResult, IdentityCodec, LocalDispatcher, RouteMap
from moe_parallel import ParallelLayout, apply_expert_parallel, build_groups, moe_layers
from torch import nn

from moe_train.config import Config, ModelConfig
from moe_train.config_io import ConfigError, validate
from moe_precision import PrecisionRecipe
from moe_train.model import Transformer

CFG = ModelConfig(vocab_size=64, d_model=16, num_layers=3, num_heads=2, num_kv_heads=1, dense_hidden=32,
                  dense_layers=[0], num_experts=4, expert_hidden=8, shared_expert_hidden=8)


class Loopback:
    """Every expert here, rows moved by its own index_select / index_add (TokenDispatcher's docs, nothing else)."""

    def __init__(self, group, num_experts: int, capacity_factor: float = 0.0, codec=None):
        self.group, self.num_experts, self.capacity_factor = group, num_experts, capacity_factor
        self.codec = IdentityCodec() if codec is None else codec
        self.calls = 0

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        self.calls += 1
        rows = self.codec.decode(self.codec.encode(x.index_select(0, route_map.sort_order // route_map.top_k)))
        return DispatchResult(rows, route_map.offsets, route_map, torch.zeros((), dtype=torch.int64))

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        rm = result.context
        w = weights.reshape(-1).index_select(0, rm.sort_order).float()
        out = torch.zeros(rm.num_tokens, expert_out.shape[1], dtype=torch.float32)
        return out.index_add(0, rm.sort_order // rm.top_k, expert_out.float() * w[:, None]).to(expert_out.dtype)


@pytest.fixture
def world_of_one(tmp_path):
    """A one-rank gloo world, as a single-process user of moe-parallel has."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield build_groups(ParallelLayout().validate(world_size=1, num_experts=CFG.num_experts), CFG.num_experts)
    finally:
        dist.destroy_process_group()


def model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(CFG)


def loss_and_grads(m: Transformer, tokens: torch.Tensor, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, aux = m(tokens)
    loss = logits.float().square().mean() + aux
    grads = torch.autograd.grad(loss, [p for p in m.parameters()])
    return loss.detach(), grads


def test_explicit_transport_is_installed_at_ep1_with_the_layers_codec(world_of_one):
    m = model()
    layers = moe_layers(m)
    codecs = [IdentityCodec() for _ in layers]
    for (_, layer), codec in zip(layers, codecs):
        layer.dispatcher = LocalDispatcher(layer.num_experts, codec=codec)
    apply_expert_parallel(m, world_of_one, transport=Loopback)
    for (name, layer), codec in zip(layers, codecs):
        assert isinstance(layer.dispatcher, Loopback), f"{name}: {type(layer.dispatcher).__name__} kept"
        assert layer.dispatcher.codec is codec and layer.dispatcher.num_experts == CFG.num_experts


def test_default_transport_at_ep1_keeps_the_local_dispatcher(world_of_one):
    m = model()
    apply_expert_parallel(m, world_of_one)
    assert all(type(layer.dispatcher) is LocalDispatcher for _, layer in moe_layers(m))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_loopback_transport_in_the_model_matches_the_builtin_block(world_of_one, autocast):
    tokens = torch.randint(0, CFG.vocab_size, (3, 7))  # T = 21 per layer: odd
    want_loss, want = loss_and_grads(model(), tokens, autocast)
    m = model()
    apply_expert_parallel(m, world_of_one, transport=Loopback)
    got_loss, got = loss_and_grads(m, tokens, autocast)
    assert all(layer.dispatcher.calls == 1 for _, layer in moe_layers(m))
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_loss, want_loss, **tol)
    for (name, _), a, b in zip(m.named_parameters(), got, want):
        torch.testing.assert_close(a, b, **tol, msg=lambda s, n=name: f"{n}: {s}")


class Bf16RoundTrip:
    def __init__(self):
        self.shapes = []

    def encode(self, rows):
        self.shapes.append((tuple(rows.shape), rows.dtype))
        return rows.to(torch.bfloat16)

    def decode(self, payload):
        return payload.to(torch.float32)


def test_codec_on_the_layers_dispatcher_runs_in_the_model_and_x_gets_gradients():
    tokens = torch.randint(0, CFG.vocab_size, (2, 5))
    m = model()
    codecs = []
    for _, layer in moe_layers(m):
        codecs.append(Bf16RoundTrip())
        layer.dispatcher = LocalDispatcher(layer.num_experts, codec=codecs[-1])
    loss, grads = loss_and_grads(m, tokens, autocast=False)
    k = CFG.router.top_k
    assert all(c.shapes == [((10 * k, CFG.d_model), torch.float32)] for c in codecs)
    want_loss, _ = loss_and_grads(model(), tokens, autocast=False)
    torch.testing.assert_close(loss, want_loss, rtol=1e-2, atol=1e-3)  # rows rounded to bf16 once
    embed_grad = dict(zip([n for n, _ in m.named_parameters()], grads))
    assert all(g.abs().sum() > 0 for n, g in embed_grad.items() if "experts" in n or "embed" in n)


class Marked(nn.Linear):
    """What a stand-in recipe's linear returns (an nn.Linear, as PrecisionRecipe.linear's docstring requires)."""

    forwards = 0

    def forward(self, x):
        Marked.forwards += 1
        return super().forward(x)


@dataclasses.dataclass(frozen=True)
class StandInRecipe(PrecisionRecipe):
    """A precision recipe being built (Transformer's docstring: a PrecisionRecipe subclass plugs in there): fp32
    GEMMs, expert weights passed through a hook that counts the gradients coming back; the expert FFN is the
    inherited expert_ffn / fused_moe_ffn, which take the weights through gemm_weight."""

    weights: list = dataclasses.field(default_factory=list)
    grads: list = dataclasses.field(default_factory=list)

    def linear(self, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        return Marked(in_features, out_features, bias=bias)

    def expert_gemm_dtype(self, x: torch.Tensor) -> torch.dtype:
        return x.dtype

    def gemm_weight(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.weights.append(tuple(w.shape))
        out = w * 1.0
        out.register_hook(lambda grad: self.grads.append(1))
        return out


def test_a_recipe_object_builds_every_linear_and_feeds_the_expert_gemms_both_ways():
    torch.manual_seed(0)
    recipe = StandInRecipe()
    m = Transformer(CFG, recipe=recipe)
    plain = [n for n, mod in m.named_modules() if isinstance(mod, nn.Linear) and not isinstance(mod, Marked)]
    assert plain == [], f"linears not built by the recipe: {plain}"
    Marked.forwards = 0
    tokens = torch.randint(0, CFG.vocab_size, (2, 5))
    loss, _ = loss_and_grads(m, tokens, autocast=False)
    n_moe = len(moe_layers(m))
    assert Marked.forwards == sum(isinstance(mod, Marked) for mod in m.modules())
    assert recipe.weights == [(4, 16, 16), (4, 8, 16)] * n_moe
    assert len(recipe.grads) == 2 * n_moe  # both expert weights' gradients came back through the recipe's cast
    torch.testing.assert_close(loss, loss_and_grads(model(), tokens, autocast=False)[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["fp8", "mxfp4", "BF16"])
def test_an_unknown_precision_is_refused_naming_the_field(name):
    with pytest.raises(ConfigError, match=rf"model.precision='{name}': expected one of bf16"):
        validate(Config(model=dataclasses.replace(CFG, precision=name)))
    with pytest.raises(ConfigError, match=rf"model.precision='{name}'"):
        Transformer(dataclasses.replace(CFG, precision=name))
