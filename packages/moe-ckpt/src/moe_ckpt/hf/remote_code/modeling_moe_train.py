"""moe-train's decoder for transformers (loaded with trust_remote_code=True): exactly the function moe-train's
Transformer computes, in plain torch, with a KV cache for generate().

Written by moe-ckpt's custom-code export beside configuration_moe_train.py. Imports only torch and transformers:
the folder works where moe-train is not installed. Module names are moe-train's under `model.` (lm_head as it
is), so the folder's tensor names are moe-train's state dict names.

    pre-norm blocks: x + attn(rms(x)), then x + mlp(rms(x)); RMSNorm in fp32
    attention: q/k/v (+ biases: attention_bias), per-head QK-norm before RoPE, rotate-half RoPE on the leading
               rotary_fraction of each head, GQA, causal SDPA; layer i within its sliding window
               (sliding_window_pattern[i % len]: the query and the w - 1 tokens before it; 0 or []: full)
    mlp: dense SwiGLU (dense model, or model.dense_layers), else MoE: fp32 router logits, softmax or sigmoid,
         selection by probs + expert_bias (selection only), top-k weights (renormalised: normalize_top_k) x
         routed_scaling_factor, SwiGLU experts summed in fp32, + shared expert (x sigmoid gate: shared_expert_gate)
    output_router_logits: also each MoE layer's router logits, and moe-train's router aux loss, added to `loss`
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
try:
    from transformers import GenerationMixin, PreTrainedModel
    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import (BaseModelOutputWithPast, CausalLMOutputWithPast,
                                               MoeCausalLMOutputWithPast, MoeModelOutputWithPast)
except ImportError as e:  # moe-ckpt ships this file as data (it never imports it); transformers loads it
    raise ImportError("modeling_moe_train.py is transformers custom code of a moe-train export: load the folder "
                      "with transformers (trust_remote_code=True)") from e

from .configuration_moe_train import MoeTrainConfig


def _cache_field(output_class) -> str:
    """The name of an output's cache: `cache` in transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in {f.name for f in dataclasses.fields(output_class)} else "past_key_values"


def _wide(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16 / fp16 / fp32 data, float64 for float64: where moe-train computes norms, router and RoPE."""
    return torch.promote_types(dtype, torch.float32)


def _own_dtype(t: torch.Tensor):
    """A context in which ops on `t` compute in the dtype they are given, whatever torch.autocast says (Trainer's
    bf16=True / fp16=True run the forward under it): the router logits and the combine's sum stay fp32, as in
    moe-train (bf16 logits would select other experts for near-ties)."""
    if torch.amp.is_autocast_available(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()


def layer_window(m: dict, index: int) -> int:
    """Layer index's sliding window (sliding_window_pattern cycled; a dict without it: none); 0 = full causal."""
    pattern = m.get("sliding_window_pattern") or []
    return pattern[index % len(pattern)] if pattern else 0


def _model_fields(config: MoeTrainConfig) -> dict:
    m = dict(config.moe_train_model)
    if not m:
        raise ValueError("MoeTrainConfig.moe_train_model is empty: expected moe-train's model config dict")
    router = dict(m.get("router") or {})
    if m["num_experts"] > 0 and router.get("gating") not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_train_model.router.gating={router.get('gating')!r}: expected 'softmax' or 'sigmoid'")
    m["router"] = router
    return m


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = _wide(x.dtype)
        return F.rms_norm(x.to(wide), (x.shape[-1],), self.weight.to(wide), self.eps).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def rope_tables(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """positions: [B, S] -> cos, sin [B, S, rotary_dim] in `dtype` (rotate-half layout, frequencies over rotary_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=dtype) / rotary_dim))
    freqs = positions.to(dtype)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, S, hd]; cos/sin: [B, S, rd] -> x with its leading rd dims rotated (rotate-half), in x's dtype."""
    rd = cos.shape[-1]
    part, rest = x[..., :rd], x[..., rd:]
    wide = torch.promote_types(torch.promote_types(x.dtype, cos.dtype), torch.float32)
    x1, x2 = part.to(wide).chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    out = (part.to(wide) * cos[:, None] + rotated * sin[:, None]).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


class Attention(nn.Module):
    def __init__(self, m: dict, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = m["num_heads"], m["num_kv_heads"]
        self.head_dim = m.get("head_dim") or m["d_model"] // m["num_heads"]
        bias = bool(m.get("attention_bias", False))
        d = m["d_model"]
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, m["norm_eps"]) if m["qk_norm"] else None
        self.k_norm = RMSNorm(self.head_dim, m["norm_eps"]) if m["qk_norm"] else None

    def forward(self, x, cos, sin, mask, cache):
        """x: [B, S, d]; mask: [B, 1, S, L] bool (True: attend); cache: a transformers Cache or None."""
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
            # a static cache (generate(cache_implementation="static")) gives its whole length, the slots after the
            # tokens so far empty: masked out. One that gives fewer keys than tokens (a sliding window) we do not compute
            slots, tokens = k.shape[2], mask.shape[-1]
            if slots < tokens:
                raise ValueError(f"{type(cache).__name__} gave {slots} keys for {tokens} tokens: expected a cache that "
                                 "keeps every token (DynamicCache or StaticCache)")
            if slots > tokens:
                mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-1], slots - tokens)], dim=-1)
        if self.num_kv_heads != self.num_heads:
            rep = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class Router(nn.Module):
    def __init__(self, d_model: int, num_experts: int, expert_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        if expert_bias:  # aux-loss-free balancing bias: shifts selection, never the weights
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None


class RoutedExperts(nn.Module):
    """w_gate_up [E, d, 2h] (gate | up), w_down [E, h, d]: moe-train's layout."""

    def __init__(self, num_experts: int, d_model: int, hidden: int):
        super().__init__()
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, d_model, 2 * hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, d_model))


class MoELayer(nn.Module):
    def __init__(self, m: dict):
        super().__init__()
        r = m["router"]
        self.gating, self.top_k, self.normalize = r["gating"], r["top_k"], r["normalize_top_k"]
        self.scale = float(r.get("routed_scaling_factor", 1.0))
        self.num_experts = m["num_experts"]
        self.lb_loss_weight = float(r.get("lb_loss_weight", 0.01))  # defaults: moe-train's RouterConfig's
        self.z_loss_weight = float(r.get("z_loss_weight", 0.001))
        self.router = Router(m["d_model"], m["num_experts"], bool(r.get("expert_bias", False)))
        self.experts = RoutedExperts(m["num_experts"], m["d_model"], m["expert_hidden"])
        shared = m["shared_expert_hidden"]
        self.shared_expert = SwiGLU(m["d_model"], shared) if shared > 0 else None
        gated = shared > 0 and bool(m.get("shared_expert_gate", False))
        self.shared_expert_gate = nn.Linear(m["d_model"], 1, bias=False) if gated else None

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """router logits [T, E] -> probabilities [T, E], selected expert ids [T, k]."""
        probs = logits.softmax(-1) if self.gating == "softmax" else logits.sigmoid()
        bias = self.router.expert_bias
        scores = probs + bias.to(probs.dtype) if bias is not None else probs
        return probs, scores.topk(self.top_k, dim=-1).indices

    def router_logits(self, flat: torch.Tensor) -> torch.Tensor:
        """flat: [T, d] -> router logits [T, E] in fp32 (float64 for float64 rows), also under autocast."""
        wide = _wide(flat.dtype)
        with _own_dtype(flat):
            return F.linear(flat.to(wide), self.router.weight.to(wide))

    def route(self, flat: torch.Tensor, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """flat: [T, d] (logits: its router logits) -> expert ids [T, k], weights [T, k] (fp32 / float64 as logits)."""
        probs, ids = self.select(self.router_logits(flat) if logits is None else logits)
        weights = probs.gather(1, ids)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        if self.scale != 1.0:
            weights = weights * self.scale
        return ids, weights

    def aux_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [T, E] of the rows that count -> moe-train's Router aux loss, its ops: lb_loss_weight * E * sum(f *
        mean p) + z_loss_weight * mean(logsumexp^2), f the experts' shares of the T*k selections (no rows: 0)."""
        if logits.shape[0] == 0:
            return logits.sum()
        probs, ids = self.select(logits)
        counts = torch.zeros(self.num_experts, device=logits.device, dtype=logits.dtype)
        counts.scatter_add_(0, ids.reshape(-1), torch.ones(ids.numel(), device=logits.device, dtype=logits.dtype))
        p = probs if self.gating == "softmax" else probs / probs.sum(-1, keepdim=True).clamp_min(1e-20)
        lb = self.num_experts * (counts / ids.numel() * p.mean(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return self.lb_loss_weight * lb + self.z_loss_weight * z

    def forward(self, x: torch.Tensor, return_logits: bool = False):
        """x: [B, S, d] -> out [B, S, d]; with return_logits (out, router logits [B * S, E] fp32)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.router_logits(flat)
        ids, weights = self.route(flat, logits)
        wide = _wide(flat.dtype)
        rows = flat.new_zeros((flat.shape[0], self.top_k, flat.shape[1]), dtype=wide)  # each token's k expert outputs
        for e in range(self.num_experts):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate, up = (flat[token] @ self.experts.w_gate_up[e]).chunk(2, dim=-1)
            rows[token, slot] = ((F.silu(gate) * up) @ self.experts.w_down[e]).to(wide)
        with _own_dtype(rows):
            out = torch.einsum("tkd,tk->td", rows, weights.to(wide)).to(flat.dtype)  # summed in fp32, as moe-train
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return (out.reshape(shape), logits) if return_logits else out.reshape(shape)


class Block(nn.Module):
    def __init__(self, m: dict, index: int):
        super().__init__()
        self.attn_norm = RMSNorm(m["d_model"], m["norm_eps"])
        self.attn = Attention(m, index)
        self.mlp_norm = RMSNorm(m["d_model"], m["norm_eps"])
        is_moe = m["num_experts"] > 0 and index not in m["dense_layers"]
        self.mlp = MoELayer(m) if is_moe else SwiGLU(m["d_model"], m["dense_hidden"])
        self.window = layer_window(m, index)

    def forward(self, x, cos, sin, mask, cache):
        """-> (x, the MoE layer's router logits [B * S, E]; None in a dense block)."""
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache)
        h = self.mlp_norm(x)
        y, logits = self.mlp(h, return_logits=True) if isinstance(self.mlp, MoELayer) else (self.mlp(h), None)
        return x + y, logits


class MoeTrainPreTrainedModel(PreTrainedModel):
    config_class = MoeTrainConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True
    supports_gradient_checkpointing = True  # gradient_checkpointing_enable(): MoeTrainModel recomputes each block
    # the selection bias stays fp32 in a bf16 / fp16 model (the export writes it fp32), as GLM-4-MoE's
    _keep_in_fp32_modules_strict = ["expert_bias"]

    def _init_weights(self, module):
        """Random weights for a model made from its config (from_pretrained loads every tensor)."""
        super()._init_weights(module)
        std = self.config.moe_train_model.get("init_std", 0.02)
        params = []
        if isinstance(module, Router):
            params = [module.weight]
        elif isinstance(module, RoutedExperts):
            params = [module.w_gate_up, module.w_down]
        with torch.no_grad():
            for p in params:
                if not getattr(p, "_is_hf_initialized", False):
                    p.normal_(0.0, std)
            bias = getattr(module, "expert_bias", None)
            if isinstance(module, Router) and bias is not None and not getattr(bias, "_is_hf_initialized", False):
                bias.zero_()

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """transformers' resize, then moe_train_model's vocab_size set to the new config.vocab_size: the model dict is
        what a saved folder is built from (and what import reads), so it must describe the resized tensors."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        self.config.moe_train_model = {**self.config.moe_train_model, "vocab_size": self.config.vocab_size}
        return embeddings


def _positions_and_mask(attention_mask, batch: int, seq: int, past: int, device):
    """Position ids [B, S] and the attention mask [B, 1, S, past + S] (True: attend) of the new tokens.

    A 2-D padding mask [B, past + S] (1: token, 0: padding; left padding) counts positions over real tokens only,
    so a padded row computes what its unpadded tokens compute alone. A padding query attends to itself only (its
    output is not used; a row with nothing to attend to would be NaN)."""
    total = past + seq
    q_slot = torch.arange(past, total, device=device)
    k_slot = torch.arange(total, device=device)
    allowed = (k_slot[None, :] <= q_slot[:, None])[None].expand(batch, seq, total)
    if attention_mask is None:
        positions = q_slot[None].expand(batch, seq)
    else:
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, total):
            raise ValueError(f"attention_mask of shape {list(attention_mask.shape)}: expected a 2-D padding mask "
                             f"[batch, past + new tokens] = [{batch}, {total}]")
        real = attention_mask.to(device).bool()
        positions = (real.long().cumsum(-1) - 1).clamp_min(0)[:, past:]
        allowed = allowed & real[:, None, :]
        allowed = allowed | (k_slot[None, :] == q_slot[:, None])[None]
    return positions, allowed[:, None]


def _windowed(mask: torch.Tensor, past: int, window: int) -> torch.Tensor:
    """mask [B, 1, S, past + S] with each query's keys cut to its sliding window: slot k of query slot q stays when
    q - window < k <= q (itself and the window - 1 before it, Hugging Face's sliding_window); window 0: as it is.
    A padding query keeps itself."""
    if not window:
        return mask
    q_slot = torch.arange(past, past + mask.shape[-2], device=mask.device)
    k_slot = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (k_slot[None, :] > q_slot[:, None] - window)


class MoeTrainModel(MoeTrainPreTrainedModel):
    def __init__(self, config: MoeTrainConfig):
        super().__init__(config)
        m = _model_fields(config)
        head_dim = m.get("head_dim") or m["d_model"] // m["num_heads"]
        self.rotary_dim = int(float(m.get("rotary_fraction", 1.0)) * head_dim)
        self.rope_theta = m["rope_theta"]
        self.embed = nn.Embedding(m["vocab_size"], m["d_model"])
        self.blocks = nn.ModuleList(Block(m, i) for i in range(m["num_layers"]))
        self.norm = RMSNorm(m["d_model"], m["norm_eps"])
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable(), with _gradient_checkpointing_func
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def set_input_embeddings(self, value):
        self.embed = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, cache=None, output_hidden_states=None, output_attentions=None,
                output_router_logits=None, **kwargs) -> BaseModelOutputWithPast | MoeModelOutputWithPast:
        """input_ids: [B, S] -> last hidden state [B, S, d] (after the final norm) and the cache; with
        output_hidden_states also the embeddings and each block's output (the last one after the final norm, as
        transformers' models give them); output_router_logits: also each MoE layer's router logits [B * S, E]."""
        if output_attentions if output_attentions is not None else getattr(self.config, "output_attentions", False):
            raise ValueError("output_attentions=True: attention runs in torch's scaled_dot_product_attention, which "
                             "gives no attention weights; expected output_attentions=False")
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        cache = cache if cache is not None else past_key_values
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = use_cache if use_cache is not None else getattr(self.config, "use_cache", True)
        # a block recomputed in backward would write its keys and values into a cache a second time: none then
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        if not use_cache or checkpointing:
            cache = None
        elif cache is None:
            cache = DynamicCache()
        b, s = x.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        positions, mask = _positions_and_mask(attention_mask, b, s, past, x.device)
        if position_ids is not None:
            positions = position_ids.to(x.device).expand(b, s)
        cos, sin = rope_tables(positions, self.rotary_dim, self.rope_theta, _wide(x.dtype))
        masks = {w: _windowed(mask, past, w) for w in {block.window for block in self.blocks}}
        states, router_logits = [x], []
        for block in self.blocks:
            if checkpointing:
                x, logits = self._gradient_checkpointing_func(block.__call__, x, cos, sin, masks[block.window], None)
            else:
                x, logits = block(x, cos, sin, masks[block.window], cache)
            states.append(x)
            router_logits += [logits] if logits is not None else []
        x = states[-1] = self.norm(x)
        hidden_states = tuple(states) if output_hidden_states else None
        cls = MoeModelOutputWithPast if output_router_logits else BaseModelOutputWithPast
        more = {"router_logits": tuple(router_logits)} if output_router_logits else {}
        return cls(last_hidden_state=x, hidden_states=hidden_states, **more, **{_cache_field(cls): cache})


class MoeTrainForCausalLM(MoeTrainPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed.weight"}

    def __init__(self, config: MoeTrainConfig):
        super().__init__(config)
        m = _model_fields(config)
        self.model = MoeTrainModel(config)
        self.lm_head = nn.Linear(m["d_model"], m["vocab_size"], bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed

    def set_input_embeddings(self, value):
        self.model.embed = value

    def get_output_embeddings(self):
        return self.lm_head

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """generate() with a compileable cache (cache_implementation="static") asks the model for a 4-D mask: forward
        builds its own from the 2-D padding mask, which goes back as it came."""
        return attention_mask

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, cache=None,
                return_dict=None, output_router_logits=None,
                **kwargs) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
        """input_ids: [B, S] -> logits [B, S, V] (the last logits_to_keep positions when > 0) and the cache;
        labels [B, S]: also the mean next-token cross-entropy (-100 ignored), or its sum over num_items_in_batch
        when given (transformers' Trainer passes the count of the targets of all micro-batches of an optimizer step
        and then leaves the loss undivided by the gradient accumulation steps).

        output_router_logits (default config.output_router_logits; MoeCausalLMOutputWithPast): also router_logits
        (one [B * S, E] per MoE layer) and aux_loss, moe-train's router aux loss summed over MoE layers (0 if dense),
        added to the loss: CE + aux_loss, what moe-train's trainer backpropagates for a micro-batch. Only rows of
        attention_mask 1 enter the router statistics (all without a mask: moe-train's batches have no padding). With
        num_items_in_batch the aux is added weighted by this micro-batch's share of the step's targets (n / N), so the
        micro-batches of one optimizer step sum to one aux, as moe-train's (CE + aux) / G over G equal micro-batches
        does (Mixtral's modeling adds it unweighted: G times that under gradient accumulation)."""
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, use_cache=use_cache, output_router_logits=output_router_logits,
                         cache=cache if cache is not None else past_key_values, **kwargs)
        h = out.last_hidden_state
        logits = self.lm_head(h[:, -logits_to_keep:] if isinstance(logits_to_keep, int) and logits_to_keep > 0 else h)
        loss = None
        if labels is not None:
            shift = logits[:, :-1].reshape(-1, logits.shape[-1]).to(_wide(logits.dtype))
            targets = labels[:, 1:].reshape(-1).to(logits.device)
            aux_weight = 1.0
            if num_items_in_batch is None:
                loss = F.cross_entropy(shift, targets, ignore_index=-100)
            else:
                items = torch.as_tensor(num_items_in_batch, device=shift.device)
                loss = F.cross_entropy(shift, targets, ignore_index=-100, reduction="sum") / items
                aux_weight = (targets != -100).sum() / items
        cls = MoeCausalLMOutputWithPast if output_router_logits else CausalLMOutputWithPast
        fields = dict(loss=loss, logits=logits, hidden_states=out.hidden_states)
        if output_router_logits:
            real = None if attention_mask is None else attention_mask[:, -h.shape[1]:].reshape(-1).bool()
            aux = self.aux_loss(out.router_logits, real, logits.device)
            fields.update(loss=None if loss is None else loss + aux * aux_weight, aux_loss=aux,
                          router_logits=out.router_logits)
        result = cls(**fields, **{_cache_field(cls): getattr(out, _cache_field(type(out)))})
        return result if return_dict is not False else result.to_tuple()

    def aux_loss(self, router_logits: tuple, real: torch.Tensor | None, device) -> torch.Tensor:
        """The MoE layers' aux losses over the rows real [B * S] marks (all if None), summed as moe-train sums them."""
        aux = torch.zeros((), device=device, dtype=torch.float32)
        layers = [block.mlp for block in self.model.blocks if isinstance(block.mlp, MoELayer)]
        rows = real.nonzero().squeeze(1) if real is not None else None  # one host sync, not one per layer
        for layer, logits in zip(layers, router_logits):
            kept = logits if rows is None else logits.index_select(0, rows.to(logits.device))
            aux = aux + layer.aux_loss(kept).to(device)
        return aux
