"""config.json of a custom-code export, both ways, and the modeling files it ships.

A custom-code folder holds moe-train's model as transformers custom code (remote_code/: a config class and a
modeling file importing only torch and transformers), loaded with `trust_remote_code=True`. It computes every
valid moe-train model, also those no stock class computes (softmax + shared expert + QK-norm: OLMo-core 3's shape).
config.json carries our model config dict verbatim under MODEL_KEY (what the modeling file and import read), and
the usual transformers keys derived from it for generic tooling; the tensors are ours under `model.`
(layout.custom_code_plan).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

from moe_ckpt.hf.refusals import HFConversionError
from moe_ckpt.hf.spec import (
    CUSTOM_ARCH, CUSTOM_MODEL_TYPE, DEFAULT_EXTRA, DTYPES, EXTRA_KEYS, MAPPED_FIELDS, ROUTER_FIELDS,
    check_custom_code_model, check_known_fields, checked_extra, head_dim,
)

MODEL_KEY = "moe_train_model"
REMOTE_CODE = Path(__file__).parent / "remote_code"
REMOTE_CODE_FILES = ("configuration_moe_train.py", "modeling_moe_train.py")
# Fields a model dict may leave out (written before they existed; spec reads them with their defaults), as the
# modeling file does; every other computed field is in every export, and a folder without one is refused.
OPTIONAL_FIELDS = frozenset({"head_dim", "attention_bias", "rotary_fraction", "shared_expert_gate",
                             "sliding_window_pattern"})
OPTIONAL_ROUTER_FIELDS = frozenset({"routed_scaling_factor"})
AUTO_MAP = {
    "AutoConfig": "configuration_moe_train.MoeTrainConfig",
    "AutoModel": "modeling_moe_train.MoeTrainModel",
    "AutoModelForCausalLM": "modeling_moe_train.MoeTrainForCausalLM",
}


def usual_keys(m: dict[str, Any]) -> dict[str, Any]:
    """The standard transformers keys of our model dict (as configuration_moe_train.usual_keys derives them)."""
    return {
        "vocab_size": m["vocab_size"], "hidden_size": m["d_model"], "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"], "head_dim": head_dim(m),
        "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"], "tie_word_embeddings": m["tie_embeddings"],
    }


def to_custom_config(m: dict[str, Any], dtype: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json of a custom-code export of our model dict `m` (choose_model_type(custom_code=True) checked it).
    A benchmark router (routing random / uniform, exported only with allow_benchmark_routing) is written as the
    learned one the folder computes."""
    if dtype not in DTYPES:
        raise HFConversionError(f"dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
    model = copy.deepcopy(m)
    if model.get("router") and model["num_experts"] > 0:
        model["router"]["routing"] = "learned"
    c: dict[str, Any] = {
        "architectures": [CUSTOM_ARCH], "model_type": CUSTOM_MODEL_TYPE, "auto_map": dict(AUTO_MAP),
        "dtype": DTYPES[dtype], "torch_dtype": DTYPES[dtype], MODEL_KEY: model, **usual_keys(m),
        "initializer_range": m.get("init_std", 0.02), "use_cache": True,
        "output_router_logits": False,  # True: the labels loss adds the router aux loss moe-train trains with
    }
    c.update({k: None for k in EXTRA_KEYS}, **DEFAULT_EXTRA)
    c.update(checked_extra(extra or {}, m["vocab_size"]))
    return c


def from_custom_config(c: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A custom-code config.json -> (our model dict, verbatim; EXTRA_KEYS found). The usual keys must agree with
    the model dict: transformers tooling reads those, the modeling file the dict."""
    m = c.get(MODEL_KEY)
    if not isinstance(m, dict):
        raise HFConversionError(f"config.json {MODEL_KEY}={m!r}: expected moe-train's model config as an object "
                                f"(model_type {CUSTOM_MODEL_TYPE!r} folders carry it)")
    m = copy.deepcopy(m)
    missing = sorted(MAPPED_FIELDS - OPTIONAL_FIELDS - set(m))
    router = m.get("router")
    routed = isinstance(router, dict) and isinstance(m.get("num_experts"), int) and m["num_experts"] > 0
    if routed:
        missing += [f"router.{k}" for k in sorted(ROUTER_FIELDS - OPTIONAL_ROUTER_FIELDS - set(router))]
    if missing:
        raise HFConversionError(f"config.json {MODEL_KEY} has no {', '.join(missing)}: expected moe-train's whole "
                                "model config, as the export writes it (a default could describe another model than "
                                "the one the tensors hold)")
    if routed and router["routing"] != "learned":
        raise HFConversionError(f"config.json {MODEL_KEY}.router.routing={router['routing']!r}: expected 'learned', "
                                "the routing the folder's modeling file computes (the export writes every router so)")
    try:
        check_known_fields(m)
        check_custom_code_model(m)
        usual = usual_keys(m)
    except KeyError as e:
        raise HFConversionError(f"config.json {MODEL_KEY} has no {e}: expected moe-train's whole model "
                                "config") from None
    for key, value in usual.items():
        if key in c and c[key] != value:
            raise HFConversionError(f"config.json {key}={c[key]!r} disagrees with {MODEL_KEY}, which gives {value!r} "
                                    "(the modeling file computes the latter): expected the two to agree")
    # import_hf lays the dict over a base config: a folder written before the field existed has full attention
    # (what its modeling file computes), never the base's windows.
    m.setdefault("sliding_window_pattern", [])
    extra = {k: c[k] for k in EXTRA_KEYS if c.get(k) is not None}
    return m, extra


def write_remote_code(out: Path) -> None:
    """Copy the configuration and modeling files into the folder being written."""
    for name in REMOTE_CODE_FILES:
        shutil.copyfile(REMOTE_CODE / name, out / name)
