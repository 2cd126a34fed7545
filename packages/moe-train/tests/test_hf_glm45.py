"""GLM-4.5-shaped folders (routed_scaling_factor 2.5, one multi-token-prediction layer) import to our model
computing transformers' logits, and our models with a routed scaling factor export to folders that do too.

Before: import refused both keys (`routed_scaling_factor=2.5: expected 1.0`, `num_nextn_predict_layers=1:
expected 0`), and moe-train had no routed scaling factor to export.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_ckpt.hf import HFConversionError, export_hf_folder, from_hf_config, open_hf_folder
from moe_train.config import Config, ConfigError, ModelConfig, RouterConfig, validate
from moe_train.hf_bridge import export_hf, import_hf
from moe_train.model import Transformer

sys.path.insert(0, str(Path(__file__).parent))
from hf_logits_helpers import hf_logits, our_logits, one_thread  # noqa: E402,F401 - one_thread: autouse

transformers = pytest.importorskip("transformers")

VOCAB, D, LAYERS, EXPERTS = 96, 32, 3, 4
HF_SIZES = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=48, moe_intermediate_size=16,
                num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                n_routed_experts=EXPERTS, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                use_qk_norm=True, norm_topk_prob=True, initializer_range=0.1,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0})




def mtp_tensors(state: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """GLM-4.5's multi-token-prediction block as its checkpoints store it, at model.layers.{layer}: a whole MoE
    decoder layer (here a copy of the last one) plus embed_tokens, enorm, hnorm, eh_proj and shared_head."""
    last = f"model.layers.{LAYERS - 1}."
    out = {f"model.layers.{layer}." + k[len(last):]: v.clone() + 0.01 for k, v in state.items() if k.startswith(last)}
    g = torch.Generator().manual_seed(7)
    extra = {"embed_tokens.weight": (VOCAB, D), "enorm.weight": (D,), "hnorm.weight": (D,),
             "eh_proj.weight": (D, 2 * D), "shared_head.norm.weight": (D,), "shared_head.head.weight": (VOCAB, D)}
    out.update({f"model.layers.{layer}.{k}": torch.randn(shape, generator=g) for k, shape in extra.items()})
    return out


def glm45_folder(folder, routed_scaling_factor: float = 2.5, **config) -> list[str]:
    """A tiny GLM-4-MoE written by transformers' own save_pretrained, with GLM-4.5's routed_scaling_factor and
    num_nextn_predict_layers=1 (config: more Glm4MoeConfig keys); transformers saves no MTP weights, so they are
    added to model.safetensors by hand. Returns the MTP tensor names."""
    cfg = transformers.Glm4MoeConfig(**{**HF_SIZES, **config}, routed_scaling_factor=routed_scaling_factor,
                                     num_nextn_predict_layers=1)
    torch.manual_seed(0)
    model = transformers.Glm4MoeForCausalLM(cfg)
    with torch.no_grad():  # non-trivial norms, biases and selection biases, so a wrong mapping shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.2 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(EXPERTS))
    model.save_pretrained(folder)
    written = json.loads((folder / "config.json").read_text())
    assert written["routed_scaling_factor"] == routed_scaling_factor and written["num_nextn_predict_layers"] == 1
    state = load_file(str(folder / "model.safetensors"))
    mtp = mtp_tensors(state, LAYERS)
    save_file({**state, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return sorted(mtp)






def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def test_a_glm45_folder_imports_dropping_its_mtp_layer_and_computes_transformers_logits(tmp_path):
    folder = tmp_path / "glm45"
    mtp = glm45_folder(folder)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:  # the folder holds the MTP block, as GLM-4.5's do
        assert set(mtp) <= set(f.keys()) and f"model.layers.{LAYERS}.eh_proj.weight" in mtp
    said = rf"dropped {len(mtp)} tensors of the multi-token-prediction layer model\.layers\.{LAYERS}\.\*"
    with pytest.warns(UserWarning, match=said):
        cfg, state = import_hf(folder, tmp_path / "ours")
    with pytest.warns(UserWarning, match=said):
        assert list(open_hf_folder(folder).dropped) == mtp  # what was left out, by name
    assert cfg.model.router.routed_scaling_factor == 2.5 and cfg.model.router.gating == "sigmoid"
    assert cfg.model.num_layers == LAYERS and cfg.model.dense_layers == [0] and cfg.model.shared_expert_hidden == 16
    assert not any(name.startswith(f"blocks.{LAYERS}.") for name in state)
    ids = tokens()
    want = hf_logits(folder, ids)
    diff = (our_logits(cfg.model, state, ids) - want).abs().max().item()
    assert diff < 1e-4, diff
    # the factor is what makes them agree: the same weights routed without it are far off
    unscaled = dataclasses.replace(cfg.model, router=dataclasses.replace(cfg.model.router, routed_scaling_factor=1.0))
    assert (our_logits(unscaled, state, ids) - want).abs().max().item() > 1e-2
    # the import's own checkpoint exports again (without the MTP layer) to a folder transformers computes the same
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        export_hf(tmp_path / "ours", tmp_path / "again", dtype="fp32")
    assert not [w for w in caught if "multi-token" in str(w.message)]
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["routed_scaling_factor"] == 2.5 and again["num_nextn_predict_layers"] == 0
    assert (hf_logits(tmp_path / "again", ids) - want).abs().max().item() < 1e-4


def make_model(gating: str = "sigmoid", factor: float = 2.5, normalize_top_k: bool = True, **overrides) -> Transformer:
    kw = {**dict(vocab_size=VOCAB, d_model=D, num_layers=LAYERS, num_heads=4, num_kv_heads=2, dense_hidden=48,
                 num_experts=EXPERTS, expert_hidden=16, shared_expert_hidden=16, dense_layers=[0], qk_norm=True,
                 init_std=0.1, rope_theta=500.0), **overrides}
    router = RouterConfig(gating=gating, top_k=2, normalize_top_k=normalize_top_k, expert_bias=gating == "sigmoid",
                          routed_scaling_factor=factor)
    cfg = validate(Config(model=ModelConfig(router=router, **kw))).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        for _, r in model.routers():
            r.expert_bias.copy_(0.1 * torch.randn_like(r.expert_bias))
    return model.eval()


@pytest.mark.parametrize("normalize_top_k", [True, False])
def test_a_model_with_a_routed_scaling_factor_exports_to_a_folder_transformers_computes_exactly(normalize_top_k,
                                                                                                 tmp_path):
    model = make_model(normalize_top_k=normalize_top_k)
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    hf_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_cfg["routed_scaling_factor"] == 2.5 and hf_cfg["num_nextn_predict_layers"] == 0
    ids = tokens()
    with torch.no_grad():
        ours = model(ids)[0]
    diff = (hf_logits(tmp_path / "hf", ids) - ours).abs().max().item()
    assert diff < 1e-4, diff
    cfg, state = import_hf(tmp_path / "hf")  # and back: the factor and every tensor
    assert cfg.model.router.routed_scaling_factor == 2.5
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_the_routed_scaling_factor_scales_the_routed_experts_only_and_exactly():
    """A factor of 2 doubles the routing weights and the routed output bit for bit (a power of two scales exactly)
    and leaves the routing decisions and the shared expert alone."""
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3))
    out = {}
    for factor in (1.0, 2.0):
        for shared in (0, 16):
            layer = make_model(factor=factor, shared_expert_hidden=shared).blocks[1].mlp
            with torch.no_grad():
                out[factor, shared] = layer(x)[0], layer.router(x.reshape(-1, D)), layer.shared_expert
    (routed1, route1, _), (routed2, route2, _) = out[1.0, 0], out[2.0, 0]
    assert torch.equal(route1.expert_ids, route2.expert_ids) and torch.equal(route2.weights, 2 * route1.weights)
    assert torch.equal(routed2, 2 * routed1)
    (with_shared1, _, shared1), (with_shared2, _, shared2) = out[1.0, 16], out[2.0, 16]
    with torch.no_grad():  # the same routed experts (same seed), plus the shared expert unscaled
        torch.testing.assert_close(with_shared2 - shared2(x), 2 * (with_shared1 - shared1(x)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [0.0, -2.5, float("inf"), float("nan")])
def test_a_routed_scaling_factor_that_is_not_positive_and_finite_is_refused_by_name(value):
    cfg = Config(model=ModelConfig(router=RouterConfig(routed_scaling_factor=value)))
    with pytest.raises(ConfigError, match=rf"model\.router\.routed_scaling_factor={value!r}: expected a"):
        validate(cfg)


def test_a_softmax_model_with_a_routed_scaling_factor_is_refused_by_the_export(tmp_path):
    """Qwen2-MoE and Qwen3-MoE have no routed scaling: exporting as them would drop the factor silently."""
    model = make_model(gating="softmax", qk_norm=False)
    with pytest.raises(HFConversionError, match=r"router\.routed_scaling_factor=2\.5 with softmax gating"):
        export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "hf", dtype="fp32")
    assert not (tmp_path / "hf").exists()


GLM_CONFIG = {"model_type": "glm4_moe", **HF_SIZES}


@pytest.mark.parametrize(("change", "message"), [
    (dict(routed_scaling_factor=0), r"routed_scaling_factor=0: expected a finite number > 0"),
    (dict(routed_scaling_factor="2.5"), r"routed_scaling_factor='2.5': expected a finite number > 0"),
    (dict(num_nextn_predict_layers=-1), r"num_nextn_predict_layers=-1: expected an integer >= 0"),
    (dict(num_nextn_predict_layers=1.5), r"num_nextn_predict_layers=1.5: expected an integer >= 0"),
])
def test_glm_routing_keys_we_cannot_read_are_refused_by_name(change, message):
    with pytest.raises(HFConversionError, match=message):
        from_hf_config({**GLM_CONFIG, **change})


def test_a_tensor_past_the_mtp_layers_is_still_refused(tmp_path):
    """Only the layers num_nextn_predict_layers names are dropped; a tensor of a layer after them is unexpected."""
    folder = tmp_path / "glm45"
    glm45_folder(folder)
    state = load_file(str(folder / "model.safetensors"))
    stray = f"model.layers.{LAYERS + 1}.enorm.weight"
    save_file({**state, stray: torch.ones(D)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(HFConversionError, match=rf"tensor {stray} \(shape \[{D}\]\) has no counterpart in moe-train"):
        open_hf_folder(folder)


def test_an_import_over_a_base_config_takes_the_folders_routed_scaling(tmp_path):
    """import_hf keeps the base Config's training fields; the factor is the folder's (1.0 for Qwen, which has none)."""
    base = Config(model=ModelConfig(router=RouterConfig(routed_scaling_factor=2.5)))
    model = make_model(gating="softmax", factor=1.0, qk_norm=False)
    export_hf_folder(dataclasses.asdict(model.cfg), model.state_dict(), tmp_path / "qwen", dtype="fp32")
    cfg, _ = import_hf(tmp_path / "qwen", base=base)
    assert cfg.model.router.routed_scaling_factor == 1.0


def test_a_glm45_folder_with_every_feature_at_once_imports_trains_and_exports(tmp_path):
    """GLM-4.5's whole attention and routing at once (q/k/v biases, half rotary, QK-norm, routed scaling 2.5,
    an MTP layer): the features were added one at a time, so here they meet. The import computes transformers'
    logits, a training step moves the biases, and the trained model exports to a folder transformers computes
    as ours does."""
    folder = tmp_path / "glm45"
    rope = {**HF_SIZES["rope_parameters"], "partial_rotary_factor": 0.5}
    glm45_folder(folder, attention_bias=True, rope_parameters=rope)
    assert json.loads((folder / "config.json").read_text())["attention_bias"] is True
    with pytest.warns(UserWarning, match="multi-token-prediction"):
        cfg, state = import_hf(folder, tmp_path / "ours")
    m = cfg.model
    assert (m.attention_bias, m.rotary_fraction, m.qk_norm, m.router.routed_scaling_factor) == (True, 0.5, True, 2.5)
    ids = tokens()
    assert (our_logits(m, state, ids) - hf_logits(folder, ids)).abs().max().item() < 1e-4

    model = Transformer(m)
    model.load_state_dict(state, strict=True)
    logits, aux = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + aux
    loss.backward()
    biases = {n: p for n, p in model.named_parameters() if n.endswith(".bias")}
    assert biases and all(p.grad is not None and p.grad.abs().sum() > 0 for p in biases.values())
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.05 * p.grad
    trained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert not torch.equal(trained[next(iter(biases))], state[next(iter(biases))])

    export_hf_folder(dataclasses.asdict(m), trained, tmp_path / "trained", dtype="fp32")
    again = json.loads((tmp_path / "trained" / "config.json").read_text())
    assert (again["attention_bias"], again["routed_scaling_factor"], again["num_nextn_predict_layers"]) == (True, 2.5, 0)
    assert (hf_logits(tmp_path / "trained", ids) - our_logits(m, trained, ids)).abs().max().item() < 1e-4
