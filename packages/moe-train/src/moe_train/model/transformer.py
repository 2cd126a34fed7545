"""Decoder-only transformer with dense and MoE layers mixed by config."""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from moe_precision import PrecisionRecipe
from moe_train.config import (ACTIVATION_CHECKPOINTING, DOCUMENT_MASKING_KERNELS, ConfigError, ModelConfig,
                              validate_model)
from moe_train.model.attention import Attention
from moe_train.model.chunked_loss import IGNORED_TARGET, bad_targets, check_targets, chunked_head_losses
from moe_train.model.document_mask import (attention_bias, attention_block_mask, attention_mask,  # noqa: F401
                                           document_attention_mask,  # the mask's old home: still importable here
                                           flex_document_attention_runs)
from moe_train.model.layers import RMSNorm, SwiGLU, fp32_or_wider
from moe_train.model.rope import rope_tables
from moe_train.model.moe import MoELayer, RoutedExperts
from moe_train.model.recompute import recompute_in_backward
from moe_train.model.router import Router


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, recipe: PrecisionRecipe):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, recipe)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.is_moe = cfg.is_moe_layer(index)
        self.mlp: nn.Module = MoELayer(cfg, recipe) if self.is_moe else SwiGLU(cfg.d_model, cfg.dense_hidden, recipe)
        self.recompute = "none"  # what backward recomputes: none | full | mlp (set_activation_checkpointing)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [B, S, d] -> ([B, S, d], router aux loss); mask: the attention's (None: causal). Recomputes only in
        training forwards that record a graph."""
        mode = self.recompute if self.training and torch.is_grad_enabled() else "none"
        if mode == "full":
            return recompute_in_backward(self, self._forward, x, cos, sin, mask)
        return self._forward(x, cos, sin, mask, recompute_feed_forward=mode == "mlp")

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
                 recompute_feed_forward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        y, aux = recompute_in_backward(self, self._feed_forward, x) if recompute_feed_forward else self._feed_forward(x)
        return x + y, aux

    def _feed_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """mlp_norm, then the MoE layer or the dense SwiGLU: x: [B, S, d] -> ([B, S, d], aux loss)."""
        h = self.mlp_norm(x)
        if self.is_moe:
            return self.mlp(h)
        return self.mlp(h), x.new_zeros((), dtype=torch.float32)


def _generator(seed: int, name: str, device: torch.device, expert: int | None = None) -> torch.Generator:
    """The generator of one parameter (or one expert's slice of it): a function of the seed and
    the name alone, so every layout draws the same values."""
    key = zlib.crc32(name.encode() if expert is None else f"{name}#{expert}".encode())
    return torch.Generator(device=device).manual_seed((seed * 0x9E3779B1 + key) % 2**63)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [..., V] in fp32 (float64 for float64 logits), -100 targets left out."""
    return F.cross_entropy(logits.to(fp32_or_wider(logits.dtype)).reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=IGNORED_TARGET)


def head_losses(logits: torch.Tensor, targets: torch.Tensor, z_loss_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross_entropy, z_loss_weight x the mean logsumexp² of the logits): the LM head's z-loss (PaLM; OLMo 2's
    z_loss_multiplier) over the same targets as the cross-entropy, in the same dtype. Without a weight this is
    cross_entropy and a 0. With one, both terms come from one logsumexp of one fp32 copy of the logits (what autograd
    keeps for backward is that copy, as F.cross_entropy keeps its log-softmax)."""
    if not z_loss_weight:
        ce = cross_entropy(logits, targets)
        return ce, ce.new_zeros(())
    targets = targets.reshape(-1)
    # a target outside [0, V): IndexError naming it, as F.cross_entropy raises (the gather below would say
    # RuntimeError). Not in a compiled graph (a host read): loss_terms hands such a CPU batch to this eager path
    if not torch.compiler.is_compiling():
        check_targets(targets, logits.shape[-1])
    x = logits.to(fp32_or_wider(logits.dtype)).reshape(-1, logits.shape[-1])
    kept = targets != IGNORED_TARGET
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, torch.where(kept, targets, 0).unsqueeze(1)).squeeze(1)
    count = kept.sum()  # 0 (every target ignored): both terms 0 / 0 = NaN, as F.cross_entropy gives
    ce = torch.where(kept, lse - picked, 0).sum() / count
    return ce, z_loss_weight * (torch.where(kept, lse * lse, 0).sum() / count)


@functools.cache
def compiled_head_losses() -> Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]:
    """head_losses under torch.compile (train.compile): the fp32 upcast of the logits fused into the loss and its
    gradient instead of a [tokens, V] fp32 copy. Built once, at the first use."""
    return torch.compile(head_losses)


class LossTerms(NamedTuple):
    """What Transformer.loss_terms returns; the training objective is their sum.

    ce: the mean next-token cross-entropy (what evals and metrics report as the loss); router_aux: the routers'
    load-balancing and z losses, summed over the MoE layers; lm_z: the LM head's z-loss term (lm_z_loss_weight x the
    mean logsumexp² of the logits; 0 without a weight). With loss_chunk_tokens > 0, lm_z comes back detached and ce
    carries the gradient of both (the chunked head computes one gradient for the two): backpropagate the sum."""
    ce: torch.Tensor
    router_aux: torch.Tensor
    lm_z: torch.Tensor


def _check_tokens(tokens: torch.Tensor, vocab_size: int) -> None:
    """tokens is [B, S] and, on the CPU, every id in [0, vocab_size): the embedding's own error, "index out of range
    in self", named neither the id nor the vocabulary (a [S] tensor failed on `tuple index out of range`). On a GPU
    the check would cost a host read each forward: an id out of range there is the embedding's device-side assert."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor [B, S] of token ids, got {type(tokens).__name__}")
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [B, S] (batch, sequence), got shape {tuple(tokens.shape)}")
    if tokens.device.type != "cpu" or torch.compiler.is_compiling() or tokens.dtype.is_floating_point:
        return  # (float ids: the embedding's own error names the dtypes it takes)
    if type(tokens) is not torch.Tensor or torch._C._functorch.is_functorch_wrapped_tensor(tokens):
        return  # no values to read: a FakeTensor, or ids batched by torch.func.vmap (bool() of them raised)
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bool(bad.any()):
        b, s = (int(i) for i in bad.nonzero()[0])
        raise IndexError(f"tokens[{b}, {s}]={int(tokens[b, s])} is outside [0, model.vocab_size={vocab_size}) "
                         f"({int(bad.sum())} ids out of range in all)")


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, device: torch.device | str | None = None,
                 recipe: PrecisionRecipe | None = None):
        """device="meta": shapes only, no memory and no initialisation; a runtime slices it for
        its rank, materialises it on its device and calls reset_parameters(seed, ...).
        recipe: the precision recipe of every dense linear layer and expert GEMM; PrecisionRecipe(cfg.precision)
        when None (a PrecisionRecipe subclass, e.g. one being built, plugs in here: its linear, expert_gemm_dtype,
        gemm_weight, expert_ffn and fused_moe_ffn are what the model calls)."""
        super().__init__()
        # Checked before anything is allocated: a bad field otherwise ran silently (an odd rotary dim, more kv heads
        # than heads) or failed deep inside a forward with a shape error.
        validate_model(cfg)
        self.cfg = cfg
        self.compiled = False  # set_compile
        self.loss_chunk_tokens = 0  # set_loss_chunk_tokens: 0 = the whole micro-batch's logits at once
        self.lm_z_loss_weight = 0.0  # set_lm_z_loss_weight: 0 = no LM head z-loss
        self.document_eos_id: int | None = None  # set_document_masking: None = causal over the whole window
        self.document_mask_kernel = "auto"  # ... and how the mask is applied
        recipe = PrecisionRecipe(cfg.precision) if recipe is None else recipe
        with torch.device(device) if device is not None else nullcontext():
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.blocks = nn.ModuleList(Block(cfg, i, recipe) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
            self.lm_head = recipe.linear(cfg.d_model, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self._rope_cache: tuple[int, torch.device, torch.Tensor, torch.Tensor] | None = None
        if torch.device(device if device is not None else "cpu").type != "meta":
            self.reset_parameters(torch.initial_seed())

    @torch.no_grad()
    def reset_parameters(self, seed: int, expert_row_offsets: Mapping[str, int] | None = None) -> None:
        """Norm weights 1, biases 0, every other weight N(0, init_std) from its own generator (seed, name),
        routed-expert weights one generator per global expert (seed, name, expert): a rank that
        holds experts [offset, offset + rows) of a parameter (expert_row_offsets[name] = offset)
        draws exactly those experts' values of the whole model. Buffers are zeroed; tied
        embeddings are tied again."""
        if self.cfg.tie_embeddings:  # materialising a meta model (to_empty) unties them
            self.lm_head.weight = self.embed.weight
        offsets = expert_row_offsets or {}
        std = self.cfg.init_std
        expert_params = {
            f"{mname}.{pname}" for mname, m in self.named_modules() if isinstance(m, RoutedExperts)
            for pname, _ in m.named_parameters(recurse=False)
        }
        for buf in self.buffers():
            buf.zero_()
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):  # the attention's q/k/v biases (model.attention_bias)
                p.zero_()
            elif name in expert_params:
                first = offsets.get(name, 0)
                for i in range(p.shape[0]):
                    p[i].normal_(0.0, std, generator=_generator(seed, name, p.device, first + i))
            else:
                p.normal_(0.0, std, generator=_generator(seed, name, p.device))

    def _rope(self, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [seq_len, rotary_dim] in fp32 (float64 for a float64 model: its angles to fp64 round-off)."""
        c = self._rope_cache
        if c is None or c[0] < seq_len or c[1] != device or c[2].dtype != dtype:
            with torch.inference_mode(False):  # made under inference_mode, they still serve training forwards
                cos, sin = rope_tables(seq_len, self.cfg.rotary_dim, self.cfg.rope_theta, device, dtype)
            self._rope_cache = c = (seq_len, device, cos, sin)
        return c[2][:seq_len], c[3][:seq_len]

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [B, S] int64 -> (logits [B, S, V], summed router aux loss)."""
        h, aux = self.hidden(tokens)
        return self.lm_head(h), aux

    def hidden(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [B, S] int64 -> (the final norm's output [B, S, d], the LM head's input; summed router aux loss)."""
        _check_tokens(tokens, self.cfg.vocab_size)
        x = self.embed(tokens)
        cos, sin = self._rope(tokens.shape[1], tokens.device, fp32_or_wider(x.dtype))
        aux = torch.zeros((), device=tokens.device, dtype=torch.float32)
        for block, mask in zip(self.blocks, self._attention_masks(tokens, x.dtype), strict=True):
            x, a = block(x, cos, sin, mask)
            aux = aux + a
        return self.norm(x), aux

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean next-token cross-entropy, everything the objective adds to it): loss_terms' ce and its router_aux +
        lm_z. Backpropagating their sum trains on the whole objective; an eval reads the first."""
        terms = self.loss_terms(tokens, targets)
        return terms.ce, terms.router_aux + terms.lm_z

    def loss_terms(self, tokens: torch.Tensor, targets: torch.Tensor) -> LossTerms:
        """The cross-entropy (fp32; float64 for a float64 model), the router aux losses and the LM head's z-loss
        (lm_z_loss_weight, train.lm_z_loss_weight: 0 = none) of a batch, as a LossTerms.

        A target of -100 (F.cross_entropy's ignore_index, as in transformers' labels) is left out of the mean:
        padding or a prompt not to be trained on (all of a batch's: NaN, as torch gives, and the trainer skips the
        step). Any other target outside [0, vocab_size) is an error.

        With loss_chunk_tokens > 0 (train.loss_chunk_tokens) the LM head and the loss run that many tokens at a time
        and never hold the whole [B, S, V] logits (model/chunked_loss.py); train.compile then leaves the loss eager.
        That path calls the model's parts (hidden, the head's weight), not forward: a forward hook on the model does
        not see it, and under FSDP2 the runtime registers this method as a forward method."""
        if self.loss_chunk_tokens:
            h, aux = self.hidden(tokens)
            ce, lm_z = chunked_head_losses(h, self._head_gemm_weight(h), targets, self.loss_chunk_tokens,
                                           self.lm_z_loss_weight)
            return LossTerms(ce, aux, lm_z)
        logits, aux = self(tokens)
        # inductor's CPU kernel aborts the whole process on a target outside [0, V) (C++ terminate, nothing to catch):
        # such a batch takes the eager loss, which raises IndexError naming it (on a GPU eager asserts as well)
        # With a z-loss weight on a GPU the two terms are compiled whatever train.compile says (as the chunked head's
        # chunk function is): eager, they keep a [tokens, V] fp32 copy for backward and cost ~25% more head time
        # than the cross-entropy alone (bench/results/h100_chunked_loss_z.json)
        compile_terms = self.compiled or (self.lm_z_loss_weight > 0 and logits.device.type == "cuda")
        compiled = compile_terms and not (targets.device.type == "cpu"
                                          and bool(bad_targets(targets, logits.shape[-1]).any()))
        ce, lm_z = (compiled_head_losses() if compiled else head_losses)(logits, targets, self.lm_z_loss_weight)
        return LossTerms(ce, aux, lm_z)

    def _head_gemm_weight(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's weight as its GEMM consumes it for input h (the recipe's linear casts it once per call)."""
        head = self.lm_head
        if getattr(head, "bias", None) is not None or not callable(getattr(head, "gemm_weight", None)):
            raise TypeError(f"train.loss_chunk_tokens={self.loss_chunk_tokens} needs an LM head without a bias that "
                            f"hands out its GEMM weight (gemm_weight(x), as the precision recipe's linear does); "
                            f"this model's is a {type(head).__name__}")
        return head.gemm_weight(h)

    def set_loss_chunk_tokens(self, tokens: int) -> None:
        """How many tokens the LM head and loss take at a time (train.loss_chunk_tokens, set by the runtime): 0 = the
        whole micro-batch's logits at once. Changes no parameter or buffer, and not forward (which returns logits)."""
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"loss_chunk_tokens={tokens!r}: expected an integer >= 0 (0 = no chunks)")
        self.loss_chunk_tokens = tokens

    def set_lm_z_loss_weight(self, weight: float) -> None:
        """The LM head's z-loss weight (train.lm_z_loss_weight, set by the runtime): loss_terms adds weight x the
        mean logsumexp² of the logits to the objective (PaLM; OLMo 2's z_loss_multiplier, 1e-5), keeping the
        softmax's normaliser near 1. 0 = none. Changes no parameter or buffer."""
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"lm_z_loss_weight={weight!r}: expected a finite number >= 0 (0 = no z-loss)")
        self.lm_z_loss_weight = float(weight)

    def set_document_masking(self, eos_id: int | None, kernel: str = "auto") -> None:
        """Attention within documents only (train.document_masking, set by the trainer with its data's eos_id): a
        token attends to the earlier tokens of its own document, eos_id ending each (document_attention_mask), in
        forward and in every loss; None = causal over the whole window. RoPE positions stay the window's (rotary
        attention depends on offsets only, so a document reads the same wherever the window put it).

        kernel (train.document_masking_kernel): "flex" (FlexAttention with a block mask: blocks of other documents
        skipped; a GPU, bf16 / fp16 / fp32, head dims 16-128 that are powers of two), "sdpa" (one additive
        [B, 1, S, S] mask, everywhere) or "auto" (flex where it runs, sdpa elsewhere); model/document_mask.py.
        Changes no parameter or buffer."""
        if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                                   or not 0 <= eos_id < self.cfg.vocab_size):
            raise ValueError(f"document masking eos_id={eos_id!r}: expected a token id in [0, model.vocab_size="
                             f"{self.cfg.vocab_size}) or None (no document mask)")
        if kernel not in DOCUMENT_MASKING_KERNELS:
            raise ValueError(f"document masking kernel={kernel!r}: expected one of "
                             f"{', '.join(DOCUMENT_MASKING_KERNELS)}")
        self.document_eos_id = eos_id
        self.document_mask_kernel = kernel

    def document_masking_path(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """How a forward on device, computing attention in dtype (autocast's when it is on), applies its attention
        masks (the document mask, set_document_masking, and model.sliding_window_pattern's windows): "flex" or
        "sdpa" (set_document_masking's kernel, "auto" resolved); None when every layer is plainly causal. Raises
        ConfigError (the CLI's one-line error, not a traceback) for kernel "flex" where FlexAttention does not
        run."""
        if self.document_eos_id is None and not any(self.cfg.sliding_window_pattern):
            return None
        head_dim = self.cfg.resolved_head_dim
        flex = flex_document_attention_runs(device, dtype, head_dim)
        if self.document_mask_kernel == "flex" and not flex:
            raise ConfigError(f"train.document_masking_kernel='flex' cannot run attention in {dtype} on {device} with "
                              f"head_dim={head_dim}: FlexAttention here needs a CUDA device, bf16 / fp16 / fp32 "
                              f"and a head dim in 16-128 that is a power of two; use 'auto' or 'sdpa'")
        return "flex" if flex and self.document_mask_kernel != "sdpa" else "sdpa"

    def _attention_masks(self, tokens: torch.Tensor, dtype: torch.dtype) -> list:
        """Each layer's attention mask for this forward: None (causal: no document mask, and no window or one that
        covers the whole sequence), a BlockMask for FlexAttention or an additive mask in the dtype attention computes
        in (SDPA made a float copy of a boolean one in each layer, which backward kept). Layers with the same window
        share one mask."""
        s = tokens.shape[1]
        windows = [w if w < s else 0 for w in map(self.cfg.attention_window, range(len(self.blocks)))]
        if self.document_eos_id is None and not any(windows):
            return [None] * len(windows)
        dev = tokens.device
        if torch.is_autocast_enabled(dev.type):
            dtype = torch.get_autocast_dtype(dev.type)
        flex = self.document_masking_path(dev, dtype) == "flex"
        masks: dict[int, object] = {}
        for w in windows:
            if w in masks:
                continue
            if self.document_eos_id is None and not w:
                masks[w] = None
            elif flex:
                masks[w] = attention_block_mask(tokens, self.document_eos_id, w)
            else:
                masks[w] = attention_bias(attention_mask(tokens, self.document_eos_id, w), dtype)
        return [masks[w] for w in windows]

    def set_compile(self, enabled: bool) -> None:
        """train.compile (set by the runtime): torch.compile each block's attention, its two norms and a dense
        layer's SwiGLU, the final norm, and the loss's cross-entropy; the MoE layers and the residual adds stay
        eager (the expert kernels are fused already, and routing runs custom kernels). Compiled at the first
        forward; one graph per kind of module serves every layer (the parameters are graph inputs). Changes no
        parameter, buffer or state_dict key; False undoes it."""
        modules = [self.norm]
        for block in self.blocks:
            modules += [block.attn_norm, block.attn, block.mlp_norm] + ([] if block.is_moe else [block.mlp])
        for module in modules:
            if enabled:
                module.compile()
            else:
                module._compiled_call_impl = None  # what nn.Module.compile sets; None is eager again
        self.compiled = enabled

    def __setstate__(self, state: dict) -> None:
        """A copy (copy.deepcopy, pickle, torch.save of the module) is compiled as its original was: nn.Module drops
        what compile() set when it is copied, which left a copy saying compiled=True and running its modules eager."""
        super().__setstate__(state)
        self.__dict__.setdefault("loss_chunk_tokens", 0)  # a module pickled before set_loss_chunk_tokens existed
        self.__dict__.setdefault("lm_z_loss_weight", 0.0)  # ... or before set_lm_z_loss_weight
        self.__dict__.setdefault("document_eos_id", None)  # ... or before set_document_masking
        self.__dict__.setdefault("document_mask_kernel", "sdpa")  # ... or before its kernel choice: what it ran
        if self.__dict__.setdefault("compiled", False):  # a module pickled before train.compile: eager
            self.set_compile(True)

    def set_activation_checkpointing(self, mode: str) -> None:
        """What each block recomputes in backward instead of keeping for it (train.activation_checkpointing,
        set by the runtime): "none", "full" (the whole block; its input is kept) or "mlp" (mlp_norm and the
        MoE / dense SwiGLU; the block's residual after attention is kept). Changes no parameter or buffer."""
        if mode not in ACTIVATION_CHECKPOINTING:
            choices = ", ".join(ACTIVATION_CHECKPOINTING)
            raise ValueError(f"activation checkpointing {mode!r}: expected one of {choices}")
        for block in self.blocks:
            block.recompute = mode

    def routers(self) -> list[tuple[int, Router]]:
        return [(i, b.mlp.router) for i, b in enumerate(self.blocks) if b.is_moe]

    def moe_layers(self) -> list[MoELayer]:
        return [b.mlp for b in self.blocks if b.is_moe]
