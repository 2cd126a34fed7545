"""The tensor plan: which HF tensors each of our tensors becomes, with exact inverse transforms.

Ours -> HF (per layer i; attention biases with model.attention_bias):
    blocks.i.attn.{q,k,v}_proj.bias              -> model.layers.i.self_attn.{q,k,v}_proj.bias
    (none)                                       -> model.layers.i.self_attn.o_proj.bias, zeros (Llama, Qwen3,
                                                    Qwen3-MoE: their attention_bias biases o_proj too)
Ours -> HF (per MoE layer i, E experts, hidden h):
    blocks.i.mlp.router.weight [E, d]            -> model.layers.i.mlp.gate.weight
    blocks.i.mlp.router.expert_bias [E]          -> model.layers.i.mlp.gate.e_score_correction_bias (GLM, fp32)
    blocks.i.mlp.experts.w_gate_up [E, d, 2h]    -> model.layers.i.mlp.experts.{j}.{gate,up}_proj.weight [h, d]
    blocks.i.mlp.experts.w_down [E, h, d]        -> model.layers.i.mlp.experts.{j}.down_proj.weight [d, h]
    blocks.i.mlp.shared_expert.{gate,up,down}    -> model.layers.i.mlp.shared_expert{,s}.{gate,up,down}_proj.weight
    blocks.i.mlp.shared_expert_gate.weight [1, d] -> model.layers.i.mlp.shared_expert_gate.weight (Qwen2-MoE; without
                                                    model.shared_expert_gate: zeros, and the shared down_proj x2)
The per-expert names are what transformers' own save_pretrained writes (it fuses them into
experts.gate_up_proj [E, 2h, d] / experts.down_proj [E, d, h] on load), so vLLM and older
transformers read the folder too. Every transform is a transpose, a split or an exact x2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_ckpt.hf.refusals import HFConversionError
from moe_ckpt.hf.spec import (
    CUSTOM_MODEL_TYPE, NO_SHARED_EXPERT_GATE_KEY, attention_bias, has_output_bias, head_dim, shared_expert_gate,
)

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Entry:
    """kind: copy | double (HF = 2 x ours) | gate_up | down | zeros (HF-only constant, ours is None)."""

    kind: str
    ours: str | None
    our_shape: Shape
    hf: tuple[tuple[str, Shape], ...]
    keep_fp32: bool = False


def _copy(ours: str, hf: str, shape: Shape, keep_fp32: bool = False) -> Entry:
    return Entry("copy", ours, shape, ((hf, shape),), keep_fp32)


def _swiglu(ours: str, hf: str, d: int, h: int, suffixes: tuple[str, str, str], kind: str = "copy") -> list[Entry]:
    g, u, dn = suffixes
    return [
        _copy(f"{ours}.{g}.weight", f"{hf}.gate_proj.weight", (h, d)),
        _copy(f"{ours}.{u}.weight", f"{hf}.up_proj.weight", (h, d)),
        Entry(kind, f"{ours}.{dn}.weight", (d, h), ((f"{hf}.down_proj.weight", (d, h)),)),
    ]


def build_plan(m: dict[str, Any], model_type: str) -> list[Entry]:
    """All tensors of our model dict `m` exported as `model_type`, in file order."""
    if model_type == CUSTOM_MODEL_TYPE:
        return custom_code_plan(m)
    d, hd, v = m["d_model"], head_dim(m), m["vocab_size"]
    nq, nkv = m["num_heads"] * hd, m["num_kv_heads"] * hd
    plan = [_copy("embed.weight", "model.embed_tokens.weight", (v, d))]
    for i in range(m["num_layers"]):
        b, L = f"blocks.{i}", f"model.layers.{i}"
        plan.append(_copy(f"{b}.attn_norm.weight", f"{L}.input_layernorm.weight", (d,)))
        for p, shape in (("q", (nq, d)), ("k", (nkv, d)), ("v", (nkv, d)), ("o", (d, nq))):
            plan.append(_copy(f"{b}.attn.{p}_proj.weight", f"{L}.self_attn.{p}_proj.weight", shape))
            if attention_bias(m) and p != "o":
                plan.append(_copy(f"{b}.attn.{p}_proj.bias", f"{L}.self_attn.{p}_proj.bias", shape[:1]))
            elif attention_bias(m) and has_output_bias(model_type):
                plan.append(Entry("zeros", None, (), ((f"{L}.self_attn.o_proj.bias", (d,)),)))
        if m["qk_norm"]:
            plan += [_copy(f"{b}.attn.{p}_norm.weight", f"{L}.self_attn.{p}_norm.weight", (hd,)) for p in "qk"]
        plan.append(_copy(f"{b}.mlp_norm.weight", f"{L}.post_attention_layernorm.weight", (d,)))
        is_moe = m["num_experts"] > 0 and i not in m["dense_layers"]
        if not is_moe:
            plan += _swiglu(f"{b}.mlp", f"{L}.mlp", d, m["dense_hidden"], ("gate", "up", "down"))
        else:
            plan += _moe_layer(m, model_type, b, L)
    plan.append(_copy("norm.weight", "model.norm.weight", (d,)))
    if not m["tie_embeddings"]:
        plan.append(_copy("lm_head.weight", "lm_head.weight", (v, d)))
    return plan


def custom_code_name(ours: str) -> str:
    """The folder's name for our tensor in a custom-code export: the modeling file's module path, which is ours
    under `model.` (the head is `lm_head` in both)."""
    return ours if ours == "lm_head.weight" else f"model.{ours}"


def custom_code_plan(m: dict[str, Any]) -> list[Entry]:
    """Every tensor of our state dict, copied under custom_code_name, shapes unchanged (expert_bias kept fp32)."""
    d, hd, v = m["d_model"], head_dim(m), m["vocab_size"]
    nq, nkv = m["num_heads"] * hd, m["num_kv_heads"] * hd
    shapes: list[tuple[str, Shape]] = [("embed.weight", (v, d))]

    def swiglu(prefix: str, h: int) -> None:
        shapes.extend([(f"{prefix}.gate.weight", (h, d)), (f"{prefix}.up.weight", (h, d)),
                       (f"{prefix}.down.weight", (d, h))])

    for i in range(m["num_layers"]):
        b = f"blocks.{i}"
        shapes.append((f"{b}.attn_norm.weight", (d,)))
        for p, shape in (("q", (nq, d)), ("k", (nkv, d)), ("v", (nkv, d)), ("o", (d, nq))):
            shapes.append((f"{b}.attn.{p}_proj.weight", shape))
            if attention_bias(m) and p != "o":
                shapes.append((f"{b}.attn.{p}_proj.bias", shape[:1]))
        if m["qk_norm"]:
            shapes += [(f"{b}.attn.{p}_norm.weight", (hd,)) for p in "qk"]
        shapes.append((f"{b}.mlp_norm.weight", (d,)))
        if m["num_experts"] == 0 or i in m["dense_layers"]:
            swiglu(f"{b}.mlp", m["dense_hidden"])
            continue
        e, h = m["num_experts"], m["expert_hidden"]
        shapes.append((f"{b}.mlp.router.weight", (e, d)))
        if m["router"]["expert_bias"]:
            shapes.append((f"{b}.mlp.router.expert_bias", (e,)))
        shapes += [(f"{b}.mlp.experts.w_gate_up", (e, d, 2 * h)), (f"{b}.mlp.experts.w_down", (e, h, d))]
        if m["shared_expert_hidden"] > 0:
            swiglu(f"{b}.mlp.shared_expert", m["shared_expert_hidden"])
            if shared_expert_gate(m):
                shapes.append((f"{b}.mlp.shared_expert_gate.weight", (1, d)))
    shapes.append(("norm.weight", (d,)))
    if not m["tie_embeddings"]:
        shapes.append(("lm_head.weight", (v, d)))
    return [_copy(ours, custom_code_name(ours), shape, keep_fp32=ours.endswith(".expert_bias"))
            for ours, shape in shapes]


def _moe_layer(m: dict[str, Any], model_type: str, b: str, L: str) -> list[Entry]:
    d, e, h, s = m["d_model"], m["num_experts"], m["expert_hidden"], m["shared_expert_hidden"]
    out = [_copy(f"{b}.mlp.router.weight", f"{L}.mlp.gate.weight", (e, d))]
    if model_type == "glm4_moe":
        bias = f"{L}.mlp.gate.e_score_correction_bias"
        out.append(_copy(f"{b}.mlp.router.expert_bias", bias, (e,), keep_fp32=True) if m["router"]["expert_bias"]
                   else Entry("zeros", None, (), ((bias, (e,)),), keep_fp32=True))
    experts = f"{L}.mlp.experts"
    gate_up = tuple((f"{experts}.{j}.{p}_proj.weight", (h, d)) for j in range(e) for p in ("gate", "up"))
    out.append(Entry("gate_up", f"{b}.mlp.experts.w_gate_up", (e, d, 2 * h), gate_up))
    down = tuple((f"{experts}.{j}.down_proj.weight", (d, h)) for j in range(e))
    out.append(Entry("down", f"{b}.mlp.experts.w_down", (e, h, d), down))
    if model_type == "qwen3_moe":
        return out
    shared = f"{L}.mlp.shared_expert" if model_type == "qwen2_moe" else f"{L}.mlp.shared_experts"
    # Qwen2-MoE scales its shared expert by sigmoid(gate . x). Our model's own gate maps onto it; without one, a
    # zero gate gives exactly 0.5, so the down projection is stored doubled (exact in binary floating point) and
    # the gate pinned to zero.
    pinned_open = model_type == "qwen2_moe" and not shared_expert_gate(m)
    if s > 0:
        out += _swiglu(f"{b}.mlp.shared_expert", shared, d, s, ("gate", "up", "down"),
                       kind="double" if pinned_open else "copy")
    else:
        out.append(Entry("zeros", None, (), tuple((f"{shared}.{p}_proj.weight", (0, d)) for p in ("gate", "up"))
                         + ((f"{shared}.down_proj.weight", (d, 0)),)))
    gate = f"{L}.mlp.shared_expert_gate.weight"
    if pinned_open:
        out.append(Entry("zeros", None, (), ((gate, (1, d)),)))
    elif model_type == "qwen2_moe":
        out.append(_copy(f"{b}.mlp.shared_expert_gate.weight", gate, (1, d)))
    return out


def to_hf(entry: Entry, t: torch.Tensor | None) -> list[torch.Tensor]:
    """Our tensor (None for constants) -> the entry's HF tensors, in entry.hf order (fp32 or source dtype)."""
    if entry.kind == "zeros":
        return [torch.zeros(shape) for _, shape in entry.hf]
    assert t is not None
    if entry.kind == "copy":
        return [t]
    if entry.kind == "double":
        return [t * 2]
    if entry.kind == "gate_up":
        h = t.shape[2] // 2
        return [w for j in range(t.shape[0]) for w in (t[j, :, :h].t(), t[j, :, h:].t())]
    if entry.kind == "down":
        return [t[j].t() for j in range(t.shape[0])]
    raise ValueError(f"entry kind {entry.kind!r}: expected copy, double, gate_up, down or zeros")


def from_hf(entry: Entry, ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The entry's HF tensors (fp32) -> our tensor; constants are checked and give None."""
    if entry.kind == "zeros":
        for (name, _), t in zip(entry.hf, ts):
            if t.numel() and bool(t.ne(0).any()):
                why = ("config.json's moe_train_expert_bias=false says the router had no selection bias; remove "
                       "that key to import this bias live" if name.endswith(".e_score_correction_bias") else
                       "moe-train's attention_bias puts biases on q, k and v only (as GLM-4-MoE and Qwen2-MoE do); "
                       "a bias on o_proj has no counterpart in moe-train" if name.endswith(".o_proj.bias") else
                       f"config.json's {NO_SHARED_EXPERT_GATE_KEY}=false (or shared_expert_intermediate_size=0) says "
                       "the shared expert is not gated; remove that key to import the gate learned "
                       "(model.shared_expert_gate)")
                raise HFConversionError(f"tensor {name} is not all zeros (max |x| = {t.abs().max().item():.3g}): {why}")
        return None
    if entry.kind == "copy":
        return ts[0]
    if entry.kind == "double":
        return ts[0] / 2
    if entry.kind == "gate_up":
        pairs = zip(ts[0::2], ts[1::2])
        return torch.stack([torch.cat([g.t(), u.t()], dim=1) for g, u in pairs])
    if entry.kind == "down":
        return torch.stack([t.t() for t in ts])
    raise ValueError(f"entry kind {entry.kind!r}: expected copy, double, gate_up, down or zeros")
