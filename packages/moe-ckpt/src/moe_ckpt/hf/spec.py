"""Which stock transformers class a moe-train model maps onto, and the config.json both ways.

Our model config arrives as a plain dict (moe-train's `Config.to_dict()["model"]`). Every class
chosen here computes exactly our function (same norms, RoPE, routing, expert SwiGLU); a model
that uses a feature no stock class has is refused with the feature and the nearest config that
would export.

    num_experts == 0, qk_norm            -> Qwen3ForCausalLM
    num_experts == 0, no qk_norm         -> LlamaForCausalLM
    softmax, qk_norm, no shared expert   -> Qwen3MoeForCausalLM   (dense layers: mlp_only_layers)
    softmax, no qk_norm                  -> Qwen2MoeForCausalLM   (shared expert: shared_expert_gate learned,
                                                                   or without it the gate pinned open)
    sigmoid (+ expert bias, shared)      -> Glm4MoeForCausalLM    (dense layers must lead; routed scaling;
                                                                   partial rotary)
    custom_code=True (any valid model)   -> MoeTrainForCausalLM   (moe-train's own modeling code shipped in the
                                                                   folder, trust_remote_code=True: custom_code.py)

Sliding-window attention (sliding_window_pattern; one window size in every windowed layer) exports to the classes
whose config computes exactly those layers with every attention implementation: Qwen3 by layer_types +
sliding_window, Qwen3-MoE only with every layer windowed (use_sliding_window; it has no layer_types). Llama and
GLM-4-MoE have no sliding windows. transformers applies the window through the mask (eager, sdpa, flex) or the
sliding_window its attention passes to the kernel (flash attention); Qwen2MoeAttention (transformers 5.24) passes
none, so its flash attention attends to the whole prefix: a windowed Qwen2-MoE export is refused (custom code
exports it). Its import is taken: eager, sdpa (the default) and flex compute the windows it was trained with.

attention_bias (biases on q, k and v, none on o) is GLM-4-MoE's attention_bias and Qwen2-MoE's qkv_bias;
Llama's, Qwen3's and Qwen3-MoE's attention_bias also puts one on o_proj, which is exported as zeros (and
must be zeros to import). Only GLM-4-MoE rotates part of each head (partial_rotary_factor = rotary_fraction).

GLM-4-MoE folders may carry multi-token-prediction layers after the last decoder layer
(num_nextn_predict_layers, model.layers.{num_hidden_layers}.*): Glm4MoeForCausalLM has no module for
them and never loads them; import drops them too (`mtp_layers`), export writes none.
"""

from __future__ import annotations

import math
from typing import Any

from moe_ckpt.hf.refusals import ARCH, CUSTOM_CODE_REMEDY, HFConversionError, need, refuse
from moe_ckpt.hf.windows import check_windows, hf_layer_windows, layer_windows, pattern_of, window_keys

# HF config keys we carry through unchanged (not part of the function the model computes).
EXTRA_KEYS = ("max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
DEFAULT_EXTRA: dict[str, Any] = {"max_position_embeddings": 4096}
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# GLM-4-MoE always has a selection bias (e_score_correction_bias); a sigmoid router trained without one is
# exported with a zero bias and this key set to false, so import gives back router.expert_bias=False (the bias
# stays zero and is not trained) rather than a live zero bias. transformers keeps the key as an attribute.
NO_EXPERT_BIAS_KEY = "moe_train_expert_bias"
# Qwen2-MoE always gates its shared expert, sigmoid(x . w) x shared(x). A model trained without the gate
# (model.shared_expert_gate=False) is exported with the gate pinned open (zero weights: sigmoid = 0.5, the shared
# down projection doubled) and this key set to false, so import gives back the ungated shared expert; without the
# key (transformers' own folders, Qwen1.5-MoE, Qwen2-57B-A14B) the gate imports learned.
NO_SHARED_EXPERT_GATE_KEY = "moe_train_shared_expert_gate"

# A model type of our own: the folder ships moe-train's model as transformers custom code (remote_code/), loaded
# with trust_remote_code=True. Chosen only when asked for (custom_code=True): it computes every valid model.
CUSTOM_MODEL_TYPE = "moe_train"
CUSTOM_ARCH = "MoeTrainForCausalLM"

# Every field of moe-train's model config, by what the export does with it. A field not listed (one added
# since) is refused: the export cannot tell whether the folder would have to compute it.
MAPPED_FIELDS = frozenset({
    "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "qk_norm", "attention_bias",
    "rope_theta", "rotary_fraction", "sliding_window_pattern", "norm_eps", "dense_hidden", "dense_layers",
    "num_experts", "expert_hidden", "shared_expert_hidden", "shared_expert_gate", "tie_embeddings", "router",
})
UNCOMPUTED_FIELDS = frozenset({"init_std", "gemm_backend", "precision"})  # initialisation, kernels, training recipe
ROUTER_FIELDS = frozenset({"gating", "top_k", "normalize_top_k", "routing", "expert_bias", "routed_scaling_factor"})
ROUTER_TRAINING_FIELDS = frozenset({"lb_loss_weight", "lb_loss_scope", "z_loss_weight", "expert_bias_rate"})


def check_known_fields(m: dict[str, Any]) -> None:
    router = m.get("router") or {}
    unknown = [(k, m[k]) for k in sorted(set(m) - MAPPED_FIELDS - UNCOMPUTED_FIELDS)]
    unknown += [(f"router.{k}", router[k]) for k in sorted(set(router) - ROUTER_FIELDS - ROUTER_TRAINING_FIELDS)]
    if unknown:
        (name, value), names = unknown[0], ", ".join(n for n, _ in unknown)
        raise HFConversionError(
            f"model.{name}={value!r} is a field the Hugging Face export does not know, so it cannot tell whether the "
            f"exported model would compute it ({len(unknown)} unknown in all: {names}); expected only the fields "
            "moe_ckpt.hf.spec maps or lists as training-only: teach it the new field")


def choose_model_type(m: dict[str, Any], allow_benchmark_routing: bool = False, custom_code: bool = False) -> str:
    """The HF model_type for our model config dict, or HFConversionError naming the feature.
    custom_code: CUSTOM_MODEL_TYPE for any valid model (moe-train's own modeling file, trust_remote_code)."""
    check_known_fields(m)
    if custom_code:
        check_custom_code_model(m)
        _check_routing(m, allow_benchmark_routing)
        return CUSTOM_MODEL_TYPE
    if m["num_experts"] == 0:
        if rotary_fraction(m) != 1.0:
            raise refuse(f"rotary_fraction={m['rotary_fraction']!r} in a dense model (LlamaForCausalLM and "
                         "Qwen3ForCausalLM rotate the whole head)", "rotary_fraction=1.0")
        if not m["qk_norm"] and m["d_model"] % m["num_heads"]:  # transformers 5's LlamaConfig refuses it on load
            raise HFConversionError(
                f"num_heads={m['num_heads']} does not divide d_model={m['d_model']} in a dense model without qk_norm: "
                "LlamaForCausalLM's config refuses a hidden_size that is not a multiple of num_attention_heads "
                "(head_dim notwithstanding), so transformers could not load the folder; nearest that exports: "
                f"qk_norm=True (Qwen3ForCausalLM) or num_heads dividing d_model; {CUSTOM_CODE_REMEDY}")
        model_type = "qwen3" if m["qk_norm"] else "llama"
        check_windows(m, model_type)
        return model_type
    model_type = _moe_model_type(m)
    check_windows(m, model_type)
    # After the architecture checks: allowing benchmark routing would not make a refused model export.
    _check_routing(m, allow_benchmark_routing)
    return model_type


def _check_routing(m: dict[str, Any], allow_benchmark_routing: bool) -> None:
    routing = m["router"]["routing"] if m["num_experts"] > 0 else "learned"
    if routing != "learned" and not allow_benchmark_routing:
        raise HFConversionError(
            f"router.routing={routing!r} is a benchmark mode (the router weights never chose the experts); "
            "expected 'learned', or pass allow_benchmark_routing=True (moe-train export-hf --allow-benchmark-routing) "
            "to export the router as a learned one"
        )


def check_custom_code_model(m: dict[str, Any]) -> None:
    """What the custom-code modeling file needs of a model moe-train itself would build (moe-train validates the
    rest): named gating, whole GQA groups, whole even rotary dims, a top-k within the experts."""
    hd = head_dim(m)
    layer_windows(m)  # a list of integers >= 0
    if m["num_heads"] % m["num_kv_heads"]:
        raise HFConversionError(f"num_kv_heads={m['num_kv_heads']} does not divide num_heads={m['num_heads']}: "
                                "expected whole query-head groups per key/value head")
    rotary = rotary_fraction(m) * hd
    if rotary != int(rotary) or int(rotary) % 2 or not 0 < rotary <= hd:
        raise HFConversionError(f"rotary_fraction={m.get('rotary_fraction')!r}: expected a fraction in (0, 1] of "
                                f"head_dim={hd} that rotates a whole even number of dims (this one gives {rotary:g})")
    if m["num_experts"] == 0:
        return
    r = m["router"]
    if r["gating"] not in ("softmax", "sigmoid"):
        raise HFConversionError(f"router.gating={r['gating']!r}: expected 'softmax' or 'sigmoid'")
    if not 1 <= r["top_k"] <= m["num_experts"]:
        raise HFConversionError(f"router.top_k={r['top_k']!r}: expected 1 <= top_k <= num_experts={m['num_experts']}")


def _moe_model_type(m: dict[str, Any]) -> str:
    r = m["router"]
    if r["gating"] == "sigmoid":
        dense = sorted(set(m["dense_layers"]))
        if dense != list(range(len(dense))):
            raise refuse(f"dense_layers={m['dense_layers']} with sigmoid gating (GLM-4-MoE only has leading dense "
                         "layers, first_k_dense_replace)", f"dense_layers={list(range(len(dense)))}")
        if m["shared_expert_hidden"] % m["expert_hidden"]:
            raise refuse(f"shared_expert_hidden={m['shared_expert_hidden']} with sigmoid gating (GLM-4-MoE's shared "
                         f"expert is n_shared_experts x expert_hidden={m['expert_hidden']})",
                         "a multiple of expert_hidden")
        if m["num_experts"] < 2:
            raise refuse(f"num_experts={m['num_experts']} with sigmoid gating", "num_experts >= 2")
        if shared_expert_gate(m):
            raise refuse("shared_expert_gate=True with sigmoid gating (GLM-4-MoE's shared experts are not gated)",
                         "router.gating='softmax' with qk_norm=False (Qwen2MoeForCausalLM) or "
                         "shared_expert_gate=False")
        return "glm4_moe"
    if r["gating"] != "softmax":
        raise HFConversionError(f"router.gating={r['gating']!r}: expected 'softmax' or 'sigmoid'")
    if routed_scaling_factor(r) != 1.0:
        raise refuse(f"router.routed_scaling_factor={r['routed_scaling_factor']!r} with softmax gating (Qwen2-MoE and "
                     "Qwen3-MoE do not scale the routing weights)",
                     "router.gating='sigmoid' (Glm4MoeForCausalLM) or router.routed_scaling_factor=1.0")
    if rotary_fraction(m) != 1.0:
        raise refuse(f"rotary_fraction={m['rotary_fraction']!r} with softmax gating (Qwen2-MoE and Qwen3-MoE rotate "
                     "the whole head)", "router.gating='sigmoid' (Glm4MoeForCausalLM) or rotary_fraction=1.0")
    if r["expert_bias"]:
        raise refuse("router.expert_bias=True with softmax gating (a selection-only bias over softmax probabilities)",
                     "router.gating='sigmoid' (Glm4MoeForCausalLM) or router.expert_bias=False")
    if m["qk_norm"] and m["shared_expert_hidden"] > 0:
        raise refuse("softmax gating + shared expert + per-head qk_norm (Qwen3-MoE has no shared expert, Qwen2-MoE "
                     "no qk-norm, HunYuan-MoE normalises after RoPE)",
                     "router.gating='sigmoid' (Glm4MoeForCausalLM) or qk_norm=False (Qwen2MoeForCausalLM)")
    return "qwen3_moe" if m["qk_norm"] else "qwen2_moe"


def head_dim(m: dict[str, Any]) -> int:
    return m["head_dim"] if m.get("head_dim") is not None else m["d_model"] // m["num_heads"]


def shared_expert_gate(m: dict[str, Any]) -> bool:
    """Whether the shared expert's output is gated (and there is a shared expert); a model dict without the key
    (written before it existed): no."""
    return bool(m.get("shared_expert_gate", False)) and m["shared_expert_hidden"] > 0


def routed_scaling_factor(router: dict[str, Any]) -> float:
    """The router's routing-weight multiplier; a router dict without the key (written before it existed): 1.0."""
    return float(router.get("routed_scaling_factor", 1.0))


def attention_bias(m: dict[str, Any]) -> bool:
    """Whether q, k and v have biases; a model dict without the key (written before it existed): no."""
    return bool(m.get("attention_bias", False))


def rotary_fraction(m: dict[str, Any]) -> float:
    """The fraction of each head's dims RoPE rotates; a model dict without the key (written before it existed): 1.0."""
    return float(m.get("rotary_fraction", 1.0))


def has_output_bias(model_type: str) -> bool:
    """Whether the class's attention_bias also puts a bias on o_proj (Llama, Qwen3, Qwen3-MoE; not GLM-4-MoE, and
    Qwen2-MoE's qkv_bias covers q/k/v only): moe-train has none there, so it is exported as zeros."""
    return model_type in ("llama", "qwen3", "qwen3_moe")


def _is_token_id(value: Any, vocab_size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def checked_extra(extra: dict[str, Any], vocab_size: int, source: str = "extra_config") -> dict[str, Any]:
    """`extra` (EXTRA_KEYS for config.json), each key and value checked: a key config.json would not get (a typo)
    and a token id transformers cannot embed (past the vocabulary, negative, not an integer) are refused by name.
    eos_token_id may be a list of ids (transformers stops at any of them); None is an unknown id.
    source: where the values came from, as the refusal names it (an export's extra_config, an import's config.json)."""
    for key, value in extra.items():
        if key not in EXTRA_KEYS:
            raise HFConversionError(f"{source} key {key!r}={value!r}: expected only {', '.join(EXTRA_KEYS)}")
        if key == "max_position_embeddings":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            expected = "an integer >= 1 (the context length)"
        else:
            ids = value if key == "eos_token_id" and isinstance(value, list) and value else [value]
            no_pad = key == "pad_token_id" and value == -1 and not isinstance(value, bool)  # older Llama configs
            ok = value is None or no_pad or all(_is_token_id(i, vocab_size) for i in ids)
            expected = (f"null or a token id: an integer in [0, {vocab_size}) (model.vocab_size={vocab_size})"
                        + (", or a non-empty list of them" if key == "eos_token_id" else "")
                        + (", or -1 (no padding token)" if key == "pad_token_id" else ""))
        if not ok:
            raise HFConversionError(f"{source} {key}={value!r}: expected {expected}")
    return dict(extra)


def to_hf_config(m: dict[str, Any], model_type: str, dtype: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json for our model dict `m` as `model_type`; `extra` supplies EXTRA_KEYS (token ids, max length)."""
    if dtype not in DTYPES:
        raise HFConversionError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    c: dict[str, Any] = {
        # transformers >= 4.56 reads dtype; older ones, and tools reading config.json themselves, torch_dtype.
        # Both name the export dtype (GLM's e_score_correction_bias is written fp32: transformers keeps it fp32).
        "architectures": [ARCH[model_type]], "model_type": model_type,
        "dtype": DTYPES[dtype], "torch_dtype": DTYPES[dtype],
        "vocab_size": m["vocab_size"], "hidden_size": m["d_model"], "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"], "head_dim": head_dim(m),
        "hidden_act": "silu", "rms_norm_eps": m["norm_eps"], "tie_word_embeddings": m["tie_embeddings"],
        "rope_parameters": {"rope_type": "default", "rope_theta": m["rope_theta"]}, "initializer_range": m["init_std"],
        # transformers < 5 reads only the top-level key (and defaults it to 10000 without a word); 5 prefers
        # rope_parameters: both are written, equal.
        "rope_theta": m["rope_theta"],
        "intermediate_size": m["dense_hidden"], "attention_dropout": 0.0, "use_cache": True,
    }
    # Token ids are written even when unknown (null): a missing key is the class default, which for Llama
    # is bos 1 / eos 2 (ordinary tokens of our vocabularies, where generation would stop).
    c.update({k: None for k in EXTRA_KEYS}, **DEFAULT_EXTRA)
    c.update(checked_extra(extra or {}, m["vocab_size"]))
    if model_type == "llama":
        c.update(attention_bias=attention_bias(m), mlp_bias=False)
    elif model_type == "qwen3":
        c.update(attention_bias=attention_bias(m), use_sliding_window=False, sliding_window=None)
        c.update(window_keys(layer_windows(m), model_type))
    if model_type in ("llama", "qwen3"):
        return c
    r = m["router"]
    c.update(num_experts_per_tok=r["top_k"], moe_intermediate_size=m["expert_hidden"],
             norm_topk_prob=r["normalize_top_k"])
    if "lb_loss_weight" in r:
        c["router_aux_loss_coef"] = r["lb_loss_weight"]
    dense = sorted(set(m["dense_layers"]))
    if model_type == "qwen3_moe":
        c.update(num_experts=m["num_experts"], mlp_only_layers=dense, decoder_sparse_step=1,
                 attention_bias=attention_bias(m), use_sliding_window=False, sliding_window=None)
        c.update(window_keys(layer_windows(m), model_type))
    elif model_type == "qwen2_moe":
        c.update(num_experts=m["num_experts"], mlp_only_layers=dense, decoder_sparse_step=1,
                 qkv_bias=attention_bias(m),
                 shared_expert_intermediate_size=m["shared_expert_hidden"], use_sliding_window=False)
        c.update(window_keys(layer_windows(m), model_type))
        if m["shared_expert_hidden"] > 0 and not shared_expert_gate(m):  # exported pinned open; import reads this
            c[NO_SHARED_EXPERT_GATE_KEY] = False
    elif model_type == "glm4_moe":
        # Written even at 1.0: GLM-4-MoE's default is 0.5. transformers < 5 reads the top-level key only.
        c["rope_parameters"]["partial_rotary_factor"] = c["partial_rotary_factor"] = rotary_fraction(m)
        c.update(n_routed_experts=m["num_experts"], n_shared_experts=m["shared_expert_hidden"] // m["expert_hidden"],
                 first_k_dense_replace=len(dense), n_group=1, topk_group=1,
                 routed_scaling_factor=routed_scaling_factor(r), use_qk_norm=m["qk_norm"],
                 attention_bias=attention_bias(m),
                 num_nextn_predict_layers=0)
        if not r["expert_bias"]:  # exported as a zero e_score_correction_bias; import reads this back
            c[NO_EXPERT_BIAS_KEY] = False
    return c


# transformers' class defaults for keys a config.json may leave out, where they are not moe-train's: a missing
# key means what transformers makes of it (GLM-4-MoE rotates half of each head; Qwen2-MoE has q/k/v biases).
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "glm4_moe": {"partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 1},
    "qwen2_moe": {"qkv_bias": True, "num_experts": 60},
    "qwen3_moe": {"num_experts": 128},
}


def mtp_layers(c: dict[str, Any]) -> range:
    """Indices of the multi-token-prediction layers a GLM-4-MoE folder may hold after its decoder layers
    (model.layers.{i}.*: GLM-4.5's nextn block, a decoder layer plus embed_tokens, enorm, hnorm, eh_proj and
    shared_head). transformers' Glm4MoeForCausalLM never loads them; neither does import. Empty for other models."""
    if c.get("model_type") != "glm4_moe":
        return range(0)
    n = c.get("num_nextn_predict_layers", CLASS_DEFAULTS["glm4_moe"]["num_nextn_predict_layers"])
    need(c, "num_nextn_predict_layers", isinstance(n, int) and not isinstance(n, bool) and n >= 0,
         "an integer >= 0 (multi-token-prediction layers, which import drops)", n)
    return range(c["num_hidden_layers"], c["num_hidden_layers"] + n)


def from_hf_config(c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.json -> (our model fields, EXTRA_KEYS found); HFConversionError on anything we cannot represent."""
    mt = c.get("model_type")
    need(c, "model_type", mt in ARCH, f"one of {', '.join(ARCH)}")
    default = {"partial_rotary_factor": 1.0, "rms_norm_eps": 1e-6, **CLASS_DEFAULTS.get(mt, {})}
    need(c, "hidden_act", c.get("hidden_act", "silu") == "silu", "'silu'")
    rope = dict(c.get("rope_parameters") or {})
    if "rope_theta" in rope and c.get("rope_theta") is not None:  # transformers 5 reads the first, 4 the second
        need(c, "rope_theta", c["rope_theta"] == rope["rope_theta"],
             f"the same as rope_parameters.rope_theta={rope['rope_theta']!r} (transformers 5 reads that, 4 this)")
    rope.setdefault("rope_theta", c.get("rope_theta", 10_000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = c.get("rope_scaling")
    need(c, "rope_scaling" if scaling else "rope_parameters.rope_type", rope_type == "default" and not scaling,
         "'default' (no scaling)", scaling or rope_type)
    d, heads = c["hidden_size"], c["num_attention_heads"]
    hd = c.get("head_dim") or d // heads
    prf = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", default["partial_rotary_factor"]))
    if mt == "glm4_moe":  # transformers rotates the first int(head_dim x factor) dims
        number = isinstance(prf, (int, float)) and not isinstance(prf, bool) and 0 < prf <= 1
        need(c, "partial_rotary_factor", number and prf * hd == int(prf * hd) and int(prf * hd) % 2 == 0,
             f"a fraction in (0, 1] of head_dim={hd} that rotates a whole even number of dims", prf)
    else:
        need(c, "partial_rotary_factor", prf == 1.0,
             f"1.0 ({ARCH[mt]} rotates the whole head; only Glm4MoeForCausalLM rotates part of it)", prf)
    # The q/k/v biases: Qwen2-MoE calls them qkv_bias, the others attention_bias (Llama's, Qwen3's and Qwen3-MoE's
    # also bias o_proj: build_plan expects that bias to be zeros).
    bias_key = "qkv_bias" if mt == "qwen2_moe" else "attention_bias"
    bias = c.get(bias_key, default.get(bias_key, False))
    need(c, bias_key, isinstance(bias, bool), "true or false", bias)
    for key in ("attention_bias", "mlp_bias", "qkv_bias"):
        if key != bias_key:
            need(c, key, not c.get(key, default.get(key, False)), "false", c.get(key, default.get(key)))
    windows = hf_layer_windows(c)
    need(c, "head_dim", hd % 2 == 0, "an even number (RoPE rotates pairs of dims)", hd)
    m: dict[str, Any] = {
        "vocab_size": c["vocab_size"], "d_model": d, "num_layers": c["num_hidden_layers"], "num_heads": heads,
        "num_kv_heads": c.get("num_key_value_heads") or heads, "head_dim": None if hd * heads == d else hd,
        "attention_bias": bias, "rope_theta": float(rope["rope_theta"]), "rotary_fraction": float(prf),
        "sliding_window_pattern": pattern_of(windows), "norm_eps": c.get("rms_norm_eps", default["rms_norm_eps"]),
        "dense_hidden": c["intermediate_size"], "tie_embeddings": bool(c.get("tie_word_embeddings", False)),
        "init_std": c.get("initializer_range", 0.02),
        "qk_norm": mt in ("qwen3", "qwen3_moe") or (mt == "glm4_moe" and bool(c.get("use_qk_norm", False))),
    }
    # checked here as an export checks them, so that an imported model exports again (a token id past the vocabulary
    # was taken, then refused by the export as "extra_config", a name the user never gave)
    vocab = c["vocab_size"]  # the token ids below are checked against it: checked first, by name
    need(c, "vocab_size", isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1, "an integer >= 1")
    extra = checked_extra({k: c[k] for k in EXTRA_KEYS if c.get(k) is not None}, vocab, "config.json")
    if mt in ("llama", "qwen3"):
        m.update(num_experts=0, dense_layers=[], shared_expert_hidden=0, shared_expert_gate=False)
        return m, extra
    router = {"top_k": c["num_experts_per_tok"], "normalize_top_k": bool(c.get("norm_topk_prob", mt == "glm4_moe")),
             "routing": "learned", "gating": "softmax", "expert_bias": False, "routed_scaling_factor": 1.0}
    if "router_aux_loss_coef" in c:
        router["lb_loss_weight"] = c["router_aux_loss_coef"]
    m.update(expert_hidden=c["moe_intermediate_size"], router=router)
    if mt in ("qwen3_moe", "qwen2_moe"):
        step = c.get("decoder_sparse_step", 1)
        need(c, "decoder_sparse_step", isinstance(step, int) and not isinstance(step, bool) and step >= 1,
             "an integer >= 1", step)
        shared = c.get("shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0
        # Qwen2-MoE's gate is learned, unless our export says the model had none (its gate is then zeros, which
        # the tensor check verifies); a folder without a shared expert has nothing to gate.
        gated = c.get(NO_SHARED_EXPERT_GATE_KEY, True)
        need(c, NO_SHARED_EXPERT_GATE_KEY, isinstance(gated, bool), "true or false", gated)
        experts = c.get("num_experts", c.get("num_local_experts", default["num_experts"]))
        # transformers makes layer i sparse when `i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`:
        # an index of mlp_only_layers outside the layers names no layer.
        layers = range(c["num_hidden_layers"])
        only_mlp = {i for i in c.get("mlp_only_layers") or [] if i in layers}
        dense = sorted(only_mlp | {i for i in layers if (i + 1) % step})
        m.update(num_experts=experts, dense_layers=dense, shared_expert_hidden=shared,
                 shared_expert_gate=mt == "qwen2_moe" and gated and shared > 0)
    else:  # glm4_moe
        need(c, "n_group", c.get("n_group", 1) == 1, "1 (no group-limited routing)")
        need(c, "topk_group", c.get("topk_group", 1) == 1, "1")
        scale = c.get("routed_scaling_factor", 1.0)
        need(c, "routed_scaling_factor", isinstance(scale, (int, float)) and not isinstance(scale, bool)
             and math.isfinite(scale) and scale > 0, "a finite number > 0", scale)
        mtp_layers(c)  # checked here; open_hf_folder drops their tensors
        # Sigmoid routers are trained with the selection bias (e_score_correction_bias); keep it live, unless
        # our own export says the model had none (its bias is then zeros, which the tensor check verifies).
        live = c.get(NO_EXPERT_BIAS_KEY, True)
        need(c, NO_EXPERT_BIAS_KEY, isinstance(live, bool), "true or false", live)
        router.update(gating="sigmoid", expert_bias=live, routed_scaling_factor=float(scale))
        first_dense = min(c.get("first_k_dense_replace", 1), c["num_hidden_layers"])  # more than all: all dense
        # Glm4MoeForCausalLM's group routing takes the top 2 scores of each group: one expert cannot run.
        need(c, "n_routed_experts", c["n_routed_experts"] >= 2 or first_dense == c["num_hidden_layers"],
             "an integer >= 2 (Glm4MoeForCausalLM fails on a single routed expert)")
        m.update(num_experts=c["n_routed_experts"], dense_layers=list(range(first_dense)),
                 shared_expert_hidden=c.get("n_shared_experts", 1) * c["moe_intermediate_size"],
                 shared_expert_gate=False)
    # named by the key the folder holds (review helper 171: a top_k past the experts was refused as moe-train's own
    # model.router.top_k, a field the user of import-hf never set)
    top_k, experts = router["top_k"], m["num_experts"]
    if isinstance(experts, int) and not isinstance(experts, bool) and experts >= 1:
        need(c, "num_experts_per_tok", isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= experts,
             f"an integer from 1 to the {experts} routed experts")
    return m, extra
