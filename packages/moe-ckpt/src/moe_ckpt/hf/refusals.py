"""How the Hugging Face conversion says no: HFConversionError, the stock classes it names, and the two ways its
messages are worded (a model feature no stock class computes, a config.json key moe-train cannot represent)."""

from __future__ import annotations

from typing import Any

ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}


class HFConversionError(ValueError):
    """A model, config.json or tensor cannot be converted exactly; the message names it and what was expected."""


CUSTOM_CODE_REMEDY = ("or export it as custom code, which computes it exactly: custom_code=True (moe-train export-hf "
                      "--custom-code), loaded with transformers' trust_remote_code=True")


def refuse(feature: str, nearest: str) -> HFConversionError:
    return HFConversionError(f"{feature}: no stock transformers class computes this exactly; nearest that exports: "
                             f"{nearest}; {CUSTOM_CODE_REMEDY}")


def need(c: dict[str, Any], key: str, ok: Any, expected: Any, value: Any = None) -> None:
    if not ok:
        value = c.get(key) if value is None else value
        raise HFConversionError(f"config.json {key}={value!r}: expected {expected} (moe-train cannot represent this)")
