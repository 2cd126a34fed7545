"""QA 128's effect checks of the model fields (model.*, model.router.*): registered with qa128_effects.effect."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_train.config import Config, ConfigError
from moe_train.model import flops_per_token
from moe_train.model.layers import RMSNorm
from moe_train.model.rope import rope_tables
from moe_train.trainer.loop import Trainer
from moe_train.trainer.start_warnings import warn_about_settings
from qa128_effects import Ctx, TOKENS, effect, logits, model, shapes_of, warned


# ---- model ----------------------------------------------------------------------------------------------------

STRUCTURE = {  # field: (new value, {parameter: shape} the change gives, or None: the parameter is gone)
    "model.vocab_size": (256, {"embed.weight": (256, 32), "lm_head.weight": (256, 32)}),
    "model.d_model": (64, {"embed.weight": (512, 64), "blocks.1.mlp.router.weight": (4, 64)}),
    "model.num_layers": (3, {"blocks.2.attn.q_proj.weight": (32, 32)}),
    "model.num_heads": (8, {"blocks.0.attn.k_proj.weight": (8, 32), "blocks.0.attn.q_norm.weight": (4,)}),
    "model.num_kv_heads": (4, {"blocks.0.attn.k_proj.weight": (32, 32)}),
    "model.head_dim": (16, {"blocks.0.attn.q_proj.weight": (64, 32), "blocks.0.attn.o_proj.weight": (32, 64)}),
    "model.qk_norm": (False, {"blocks.0.attn.q_norm.weight": None, "blocks.0.attn.k_norm.weight": None}),
    "model.attention_bias": (True, {"blocks.0.attn.q_proj.bias": (32,), "blocks.0.attn.v_proj.bias": (16,),
                                    "blocks.0.attn.o_proj.bias": None}),
    "model.dense_hidden": (48, {"blocks.0.mlp.gate.weight": (48, 32)}),
    "model.dense_layers": ([1], {"blocks.0.mlp.router.weight": (4, 32), "blocks.1.mlp.gate.weight": (64, 32)}),
    "model.num_experts": (8, {"blocks.1.mlp.experts.w_gate_up": (8, 32, 32), "blocks.1.mlp.router.weight": (8, 32)}),
    "model.expert_hidden": (8, {"blocks.1.mlp.experts.w_gate_up": (4, 32, 16), "blocks.1.mlp.experts.w_down": (4, 8, 32)}),
    "model.shared_expert_hidden": (8, {"blocks.1.mlp.shared_expert.up.weight": (8, 32)}),
    "model.shared_expert_gate": (True, {"blocks.1.mlp.shared_expert_gate.weight": (1, 32)}),
    "model.tie_embeddings": (True, {"lm_head.weight": None}),  # one tensor: named once, as embed.weight
}


@effect(*STRUCTURE, what="the parameters' names and shapes, and the forward's logits")
def check_structure(ctx: Ctx, name: str) -> None:
    value, expected = STRUCTURE[name]
    base, changed = ctx.cfg(), ctx.cfg(**{name: value})
    shapes = shapes_of(model(changed))
    for pname, shape in expected.items():
        assert shapes.get(pname) == shape, (name, pname, shapes.get(pname))
    if name == "model.tie_embeddings":
        m = model(changed)
        assert m.lm_head.weight is m.embed.weight
    if name == "model.attention_bias":  # initialised to zero (README "Model"): the same forward at init
        m = model(changed)
        assert all(torch.all(p == 0) for n, p in m.named_parameters() if n.endswith(".bias"))
        m(TOKENS)[0].square().mean().backward()
        assert m.blocks[0].attn.q_proj.bias.grad.abs().sum() > 0
    elif name != "model.vocab_size":
        assert not torch.allclose(logits(base), logits(changed))


@effect("model.norm_eps", what="every RMSNorm's eps (blocks, QK-norm, final norm) and the logits")
def check_norm_eps(ctx: Ctx, name: str) -> None:
    base, changed = ctx.cfg(), ctx.cfg(**{name: 0.5})
    norms = [mod for mod in model(changed).modules() if isinstance(mod, RMSNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1 and all(n.eps == 0.5 for n in norms)
    assert not torch.allclose(logits(base), logits(changed))


@effect("model.init_std", what="the std of every weight drawn at init (not norms: 1, nor biases: 0)")
def check_init_std(ctx: Ctx, name: str) -> None:
    m = model(ctx.cfg(**{name: 0.05, "model.attention_bias": True, "model.shared_expert_gate": True}))
    for pname, p in m.named_parameters():
        if pname.endswith("norm.weight"):
            assert torch.all(p == 1), pname
        elif pname.endswith(".bias"):
            assert torch.all(p == 0), pname
        elif p.numel() >= 256:
            assert abs(p.std().item() - 0.05) < 0.1 * 0.05, (pname, p.std().item())
        else:  # the shared-expert gate's 32 values
            assert 0.02 < p.std().item() < 0.1, (pname, p.std().item())


@effect("model.rope_theta", "model.rotary_fraction", what="the rotary tables (theta, rotated dims) and the logits")
def check_rope(ctx: Ctx, name: str) -> None:
    value = 500.0 if name == "model.rope_theta" else 0.5
    base, changed = ctx.cfg(), ctx.cfg(**{name: value})
    m = model(changed)
    cos, sin = m._rope(16, torch.device("cpu"), torch.float32)
    want_cos, _ = rope_tables(16, changed.model.rotary_dim, changed.model.rope_theta, torch.device("cpu"),
                              torch.float32)
    assert cos.shape[-1] == (8 if name == "model.rope_theta" else 4)
    torch.testing.assert_close(cos, want_cos)
    assert not torch.allclose(logits(base), logits(changed))


@effect("model.sliding_window_pattern", what="each layer's attention window: its mask, the flops and the logits")
def check_sliding_window(ctx: Ctx, name: str) -> None:
    base, changed = ctx.cfg(), ctx.cfg(**{name: [3, 0]})
    m = model(changed)
    masks = m._attention_masks(TOKENS, torch.float32)
    assert masks[1] is None and masks[0] is not None and bool((masks[0][0, 0, 5, 1] < 0) & (masks[0][0, 0, 5, 3] == 0))
    assert flops_per_token(changed.model, TOKENS.shape[1]) < flops_per_token(base.model, TOKENS.shape[1])
    assert not torch.allclose(logits(base), logits(changed))


@effect("model.gemm_backend", what="the backend the expert block's kernels get (triton on the CPU: refused)")
def check_gemm_backend(ctx: Ctx, name: str, monkeypatch) -> None:
    from moe_precision import PrecisionRecipe

    seen = []
    real = PrecisionRecipe.fused_moe_ffn
    monkeypatch.setattr(PrecisionRecipe, "fused_moe_ffn", lambda self, *a: seen.append(a[-1]) or real(self, *a))
    logits(ctx.cfg(**{name: "reference"}))
    assert seen == ["reference"]
    with pytest.raises(ValueError, match="backend='triton' got a tensor on device=cpu"):
        logits(ctx.cfg(**{name: "triton"}))
    # the trainer refuses it by the field's name before the process group, the data or the run folder (it was
    # refused only at the first forward, after the run folder and its start event, naming moe-kernels' argument)
    cfg = ctx.cfg(**{name: "triton"})
    with pytest.raises(ConfigError, match=r"model\.gemm_backend='triton': expected 'auto', 'torch' or 'reference' "
                                          r"on the cpu"):
        Trainer(cfg)
    assert not Path(cfg.train.run_dir).exists()


@effect("model.precision", what="the recipe of every layer; its one value today, any other refused")
def check_precision(ctx: Ctx, name: str) -> None:
    m = model(ctx.cfg())
    assert m.moe_layers()[0].recipe.name == "bf16"
    with pytest.raises(ConfigError, match=r"model\.precision='mxfp8'"):
        ctx.cfg(**{name: "mxfp8"})


# ---- router -----------------------------------------------------------------------------------------------------

def route(cfg: Config):  # noqa: ANN201
    m = model(cfg)
    router = m.moe_layers()[0].router
    x = torch.randn(64, cfg.model.d_model, generator=torch.Generator().manual_seed(1))
    router.train()
    return router, x, router(x)


@effect("model.router.top_k", "model.router.normalize_top_k", "model.router.routed_scaling_factor",
        "model.router.gating", what="the router's selected experts and their weights")
def check_router_weights(ctx: Ctx, name: str) -> None:
    value = {"model.router.top_k": 3, "model.router.normalize_top_k": False, "model.router.routed_scaling_factor": 2.5,
             "model.router.gating": "sigmoid"}[name]
    router, x, out = route(ctx.cfg(**{name: value, "model.router.expert_bias": False}))
    logits_ = x @ router.weight.T
    probs = logits_.sigmoid() if name == "model.router.gating" else logits_.softmax(-1)
    k = 3 if name == "model.router.top_k" else 2
    ids = probs.topk(k, -1).indices
    assert torch.equal(out.expert_ids, ids)
    weights = probs.gather(1, ids)
    if name != "model.router.normalize_top_k":
        weights = weights / weights.sum(-1, keepdim=True)
    if name == "model.router.routed_scaling_factor":
        weights = weights * 2.5
    torch.testing.assert_close(out.weights, weights)


@effect("model.router.routing", what="who chooses the experts: random draws, uniform is arange % E")
def check_routing(ctx: Ctx, name: str) -> None:
    _, _, learned = route(ctx.cfg())
    _, _, uniform = route(ctx.cfg(**{name: "uniform"}))
    assert torch.equal(uniform.expert_ids.flatten(), torch.arange(128) % 4)
    _, _, rand = route(ctx.cfg(**{name: "random"}))
    assert not torch.equal(rand.expert_ids, learned.expert_ids)


@effect("model.router.lb_loss_weight", "model.router.z_loss_weight",
        what="the aux loss: lb_loss_weight x E.sum(f.P) + z_loss_weight x mean(logsumexp^2)")
def check_aux_weights(ctx: Ctx, name: str) -> None:
    router, x, out = route(ctx.cfg(**{"model.router.lb_loss_weight": 0.3, "model.router.z_loss_weight": 0.7,
                                      "model.router.expert_bias": False}))
    logits_ = x @ router.weight.T
    f = torch.bincount(out.expert_ids.flatten(), minlength=4).float() / out.expert_ids.numel()
    lb = 4 * (f * logits_.softmax(-1).mean(0)).sum()
    z = torch.logsumexp(logits_, -1).pow(2).mean()
    torch.testing.assert_close(out.aux_loss, 0.3 * lb + 0.7 * z)


@effect("model.router.lb_loss_scope", what="global: the expert counts are all-reduced over the router's lb_group")
def check_lb_scope(ctx: Ctx, name: str, monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None: calls.append(group))
    for scope in ("micro_batch", "global"):
        m = model(ctx.cfg(**{name: scope}))
        m.moe_layers()[0].router.lb_group = "dp-group"
        m(TOKENS)
    assert calls == ["dp-group"]  # the global scope's forward only


@effect("model.router.expert_bias", "model.router.expert_bias_rate",
        what="the bias moves by expert_bias_rate per step from the step's load; selection only; saved when on")
def check_expert_bias(ctx: Ctx, name: str) -> None:
    load = torch.tensor([10.0, 0.0, 5.0, 5.0])
    for on, rate in ((True, 0.25), (False, 0.25)):
        router, _, _ = route(ctx.cfg(**{"model.router.expert_bias": on, "model.router.expert_bias_rate": rate}))
        router.update_expert_bias(load)
        want = torch.tensor([-0.25, 0.25, 0.0, 0.0]) if on else torch.zeros(4)
        assert torch.equal(router.expert_bias, want)
        assert ("expert_bias" in router.state_dict()) == on
    # selection only: a bias changes the experts chosen, never the weights' source (the probabilities)
    router, x, plain = route(ctx.cfg())
    router.expert_bias[:] = torch.tensor([10.0, 10.0, 0.0, 0.0])
    biased = router(x)
    assert torch.all(biased.expert_ids < 2) and not torch.equal(biased.expert_ids, plain.expert_ids)
    # the rate without the bias: no effect, said so
    cfg = ctx.cfg(**{"model.router.expert_bias": False, "model.router.expert_bias_rate": 0.25})
    assert "model.router.expert_bias_rate=0.25" in warned(lambda: warn_about_settings(cfg, torch.device("cpu")))
