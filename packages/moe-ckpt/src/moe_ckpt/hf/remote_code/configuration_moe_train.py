"""moe-train's model config for transformers (loaded with trust_remote_code=True).

Written by moe-ckpt's custom-code export (`export_hf_folder(..., custom_code=True)`, `moe-train export-hf
--custom-code`). The model is described by `moe_train_model`, moe-train's model config dict verbatim; the usual
keys (hidden_size, num_hidden_layers, ...) are derived from it for generic tooling. Imports only transformers.
"""

try:
    from transformers import PretrainedConfig
except ImportError as e:  # moe-ckpt ships this file as data (it never imports it); transformers loads it
    raise ImportError("configuration_moe_train.py is transformers custom code of a moe-train export: load the "
                      "folder with transformers (trust_remote_code=True)") from e

MODEL_KEY = "moe_train_model"


def usual_keys(m: dict) -> dict:
    """The standard transformers config keys of moe-train's model dict `m`."""
    head_dim = m.get("head_dim") or m["d_model"] // m["num_heads"]
    return {
        "vocab_size": m["vocab_size"], "hidden_size": m["d_model"], "num_hidden_layers": m["num_layers"],
        "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"], "head_dim": head_dim,
        "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"], "tie_word_embeddings": m["tie_embeddings"],
    }


class MoeTrainConfig(PretrainedConfig):
    model_type = "moe_train"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]

    def __init__(self, moe_train_model: dict | None = None, max_position_embeddings: int = 4096,
                 use_cache: bool = True, output_router_logits: bool = False, **kwargs):
        """output_router_logits: forward also gives each MoE layer's router logits and adds moe-train's router aux
        loss to the labels loss (Mixtral's config key)."""
        self.moe_train_model = dict(moe_train_model or {})
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        self.output_router_logits = output_router_logits
        if self.moe_train_model:
            for key, value in usual_keys(self.moe_train_model).items():
                kwargs.setdefault(key, value)
        super().__init__(**kwargs)
