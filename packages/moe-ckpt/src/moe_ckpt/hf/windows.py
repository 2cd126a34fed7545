"""Sliding-window attention across the Hugging Face conversion: each layer's window from moe-train's
sliding_window_pattern (layer_windows) and back (pattern_of), which stock classes compute those windows
(check_windows), the config.json keys that give them (window_keys), and the windows transformers' class computes
from a config.json (hf_layer_windows)."""

from __future__ import annotations

from typing import Any

from moe_ckpt.hf.refusals import ARCH, HFConversionError, need, refuse


def layer_windows(m: dict[str, Any]) -> list[int]:
    """Each layer's attention window (sliding_window_pattern cycled over the layers; a window w: the query and the
    w - 1 keys before it, Hugging Face's sliding_window; 0: full causal attention). A model dict without the key
    (written before it existed): 0 in every layer."""
    pattern = m.get("sliding_window_pattern") or []
    ok = isinstance(pattern, list) and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in pattern)
    if not ok:
        raise HFConversionError(f"model.sliding_window_pattern={pattern!r}: expected a list of integers >= 0 (a "
                                "layer's window in tokens, itself included; 0 = full causal attention)")
    return [pattern[i % len(pattern)] if pattern else 0 for i in range(m["num_layers"])]


def check_windows(m: dict[str, Any], model_type: str) -> None:
    """Refuse a sliding_window_pattern that model_type's class does not compute: Llama and GLM-4-MoE have no sliding
    windows, each class has one sliding_window for all its windowed layers, Qwen3-MoE windows every layer or none."""
    windows = layer_windows(m)
    sizes = sorted({w for w in windows if w})
    if not sizes:
        return
    value = f"sliding_window_pattern={m['sliding_window_pattern']!r}"
    if model_type in ("llama", "glm4_moe"):
        nearest = ("qk_norm=True (Qwen3ForCausalLM: windows per layer)" if model_type == "llama" else
                   "router.gating='softmax' with qk_norm=True and one window in every layer (Qwen3MoeForCausalLM)")
        raise refuse(f"{value} ({ARCH[model_type]} has no sliding-window attention)",
                     f"{nearest} or sliding_window_pattern=[]")
    if model_type == "qwen2_moe":  # its config and masks have windows, its flash-attention path drops them
        raise refuse(f"{value} (Qwen2MoeAttention passes no sliding_window to flash attention, so that path attends "
                     "to the whole prefix: the folder would compute another model there)",
                     "qk_norm=True and one window in every layer (Qwen3MoeForCausalLM) or sliding_window_pattern=[]")
    if model_type == "qwen3_moe" and (0 in windows or len(sizes) > 1):
        raise refuse(f"{value}: not one window in every layer (Qwen3MoeForCausalLM windows every layer with one "
                     "sliding_window, or none: use_sliding_window, no layer_types)",
                     f"sliding_window_pattern=[{sizes[0]}] (every layer) or []")
    if len(sizes) > 1:
        raise refuse(f"{value}: windows of {len(sizes)} sizes {sizes} ({ARCH[model_type]} has one sliding_window for "
                     "all its windowed layers)", f"one window size in every windowed layer, e.g. "
                     f"sliding_window_pattern={[w and sizes[0] for w in m['sliding_window_pattern']]}")


def _derived_layer_types(model_type: str, max_window_layers: Any, use_sliding_window: bool, num_layers: int,
                         window: Any) -> list[bool]:
    """Which layers slide in transformers' config class when config.json has no layer_types: Qwen3 from
    max_window_layers on (when it has a sliding_window), Qwen2-MoE the even layers below max_window_layers."""
    if model_type == "qwen3":
        return [window is not None and i >= max_window_layers for i in range(num_layers)]
    return [bool((i + 1) % 2) and i < max_window_layers and use_sliding_window for i in range(num_layers)]


def window_keys(windows: list[int], model_type: str) -> dict[str, Any]:
    """config.json keys giving `windows` (one size; 0 = full) in Qwen3 (layer_types) or Qwen3-MoE (every layer), as
    check_windows lets through; Qwen2-MoE exports without windows (use_sliding_window false)."""
    window = max(windows, default=0)
    if not window:
        return {"use_sliding_window": False}
    if model_type not in ("qwen3", "qwen3_moe"):  # check_windows refuses these before a config.json is written
        raise HFConversionError(f"per-layer windows {windows}: {ARCH[model_type]} is not exported with sliding windows")
    if model_type == "qwen3_moe":
        return {"use_sliding_window": True, "sliding_window": window}
    sliding = [w > 0 for w in windows]
    c: dict[str, Any] = {
        "use_sliding_window": True, "sliding_window": window,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }
    # transformers 5 reads layer_types; max_window_layers (Qwen3: the layers from it on slide) is written where it
    # derives the same layers (older readers), else left to the class default, unused.
    first = sliding.index(True)
    if all(sliding[first:]):
        c["max_window_layers"] = first
    return c


def pattern_of(windows: list[int]) -> list[int]:
    """The shortest sliding_window_pattern that cycles to these per-layer windows ([] for full attention in all)."""
    if not any(windows):
        return []
    period = next(p for p in range(1, len(windows) + 1) if all(w == windows[i % p] for i, w in enumerate(windows)))
    return windows[:period]


# layer_types entries that name attention: sliding or not ("attention": transformers' legacy name of full_attention).
SLIDING_LAYER_TYPES = {"full_attention": False, "attention": False, "sliding_attention": True}


def hf_layer_windows(c: dict[str, Any]) -> list[int]:
    """Each layer's attention window as transformers' class computes it from config.json (0: full causal attention),
    or HFConversionError naming the key where the class computes no window moe-train has (or fails).

    Qwen3: the layers of layer_types 'sliding_attention' (without layer_types: from max_window_layers on) attend
    within sliding_window, which is None unless use_sliding_window (transformers then fails on the first forward).
    Qwen2-MoE: likewise, sliding_window 0 unless use_sliding_window; without layer_types the even layers below
    max_window_layers slide. Qwen3-MoE: every layer within sliding_window when use_sliding_window (no layer_types).
    Llama, GLM-4-MoE: no sliding windows (use_sliding_window and sliding layer_types are refused)."""
    mt, n = c["model_type"], c["num_hidden_layers"]
    use = bool(c.get("use_sliding_window", False))
    types = c.get("layer_types")
    if types is not None:
        need(c, "layer_types", isinstance(types, list) and len(types) == n
             and all(isinstance(t, str) and t in SLIDING_LAYER_TYPES for t in types),
             f"a list of num_hidden_layers={n} entries 'full_attention' or 'sliding_attention'")
    if mt in ("llama", "glm4_moe"):
        need(c, "use_sliding_window", not use, f"false ({ARCH[mt]} has no sliding-window attention)")
        need(c, "layer_types", not any(SLIDING_LAYER_TYPES[t] for t in types or []),
             f"only 'full_attention' ({ARCH[mt]} has no sliding-window attention)")
        return [0] * n
    window = c.get("sliding_window", 4096) if use else (0 if mt == "qwen2_moe" else None)  # the class's own
    if mt == "qwen3_moe":
        sliding = [window is not None] * n
        if types is not None:
            need(c, "layer_types", [SLIDING_LAYER_TYPES[t] for t in types] == sliding,
                 f"only {'sliding_attention' if sliding[0] else 'full_attention'!r}, as use_sliding_window={use} "
                 "gives (Qwen3MoeForCausalLM reads no layer_types: use_sliding_window windows every layer or none)")
    elif types is not None:
        sliding = [SLIDING_LAYER_TYPES[t] for t in types]
    else:
        mwl = c.get("max_window_layers", 28)
        if window is not None and (mt == "qwen3" or use):
            need(c, "max_window_layers", isinstance(mwl, int) and not isinstance(mwl, bool),
                 "an integer (the layers that slide come from it when config.json has no layer_types)", mwl)
        sliding = _derived_layer_types(mt, mwl, use, n, window)
    if mt == "qwen2_moe" and use:  # Qwen2MoeModel builds the sliding-window mask whether a layer uses it or not
        need(c, "sliding_window", window is not None, "an integer >= 1 (Qwen2MoeForCausalLM builds its sliding-window "
             "mask whenever use_sliding_window is true)", window)
    if not any(sliding):
        return [0] * n
    if not use:  # a sliding layer without a window: None (Qwen3) fails, 0 (Qwen2-MoE) attends to nothing
        need(c, "layer_types", False, f"only 'full_attention' where use_sliding_window=false ({ARCH[mt]}'s "
             f"sliding_window is then {window}: transformers cannot run its 'sliding_attention' layers)")
    need(c, "sliding_window", isinstance(window, int) and not isinstance(window, bool) and window >= 1,
         "an integer >= 1 (the sliding layers' window: the query and the sliding_window - 1 keys before it)", window)
    return [window if s else 0 for s in sliding]
