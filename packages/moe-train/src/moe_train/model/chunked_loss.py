"""The LM head and its cross-entropy a chunk of tokens at a time (train.loss_chunk_tokens).

The plain loss holds the logits of every token of a micro-batch, [tokens, vocab] in the GEMM dtype, their fp32 copy
and the gradient of both until backward: at vocab 100,352 and 16,384 tokens that is ~20 GB. Here the head's GEMM,
the softmax and the loss's gradients run on `chunk_tokens` rows at a time, inside forward (the loss is the last
thing the graph computes, so its gradient with respect to the logits is known there up to the scalar backward
hands in). What stays for backward is the gradient of the hidden states [tokens, d] and of the head's weight
[vocab, d] (fp32): the same GEMM work as the plain loss, no recompute, and one chunk's logits at the peak.

Rounding follows the plain path: logits in the GEMM dtype, softmax and loss in fp32 (float64 for a float64 model),
the logits' gradient rounded to the GEMM dtype before the two backward GEMMs. The head weight's gradient is summed
over the chunks in fp32 and rounded once, in backward.

The LM head's z-loss (train.lm_z_loss_weight: weight x the mean logsumexp² of the logits) rides along: its gradient,
2 weight lse softmax, is added to each chunk's logit gradient before the GEMMs, so it costs no GEMM of its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from moe_train.model.layers import fp32_or_wider

IGNORED_TARGET = -100  # F.cross_entropy's default ignore_index, as transformers' labels use it


def bad_targets(targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Where targets hold an id outside [0, vocab_size) other than IGNORED_TARGET (a bool mask)."""
    return (targets != IGNORED_TARGET) & ((targets < 0) | (targets >= vocab_size))


def check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    """On the CPU, a target outside [0, vocab_size) other than -100 raises IndexError as F.cross_entropy's does (on a
    GPU the gather's device-side assert stops the step: a host read per step would cost a sync)."""
    if targets.device.type != "cpu":
        return
    bad = bad_targets(targets, vocab_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise IndexError(f"Target {int(targets[i])} is out of bounds. (target {i} of {targets.numel()}; expected an "
                         f"id in [0, {vocab_size}) or {IGNORED_TARGET}, the ignored target)")


def _chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, kept: torch.Tensor, scale: torch.Tensor,
                         z_weight: float, want_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: (the summed loss of its kept rows, the summed logsumexp² of its kept rows, d (mean loss +
    z_weight x mean logsumexp²) / d logits in logits' dtype, or None).

    logits [C, V] in the GEMM dtype; targets [C] (an ignored row's any id in range); kept [C] bool; scale: 1 / the
    number of kept targets of the whole batch. Softmax and loss in fp32 (float64 for float64 logits). The z-loss's
    gradient, 2 z_weight lse softmax, folds into the cross-entropy's, softmax - onehot: one [C, V] gradient."""
    acc = fp32_or_wider(logits.dtype)
    x = logits.to(acc)
    lse = torch.logsumexp(x, dim=1)
    loss = torch.where(kept, lse - x.gather(1, targets.unsqueeze(1)).squeeze(1), 0).sum()
    z_sum = torch.where(kept, lse * lse, 0).sum()
    if not want_grad:
        return loss, z_sum, None
    grad = x.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place of the fp32 logits
    if z_weight:
        grad.mul_((1 + 2 * z_weight * lse).unsqueeze(1))
    grad.scatter_add_(1, targets.unsqueeze(1), -kept.to(acc).unsqueeze(1))
    grad.mul_((kept.to(acc) * scale).unsqueeze(1))
    return loss, z_sum, grad.to(logits.dtype)


@functools.cache
def _compiled_chunk_loss_and_grad() -> Callable:
    """_chunk_loss_and_grad as one inductor kernel per shape (on a GPU: the eager ops make ~11 passes over the fp32
    chunk, 4x the fused kernel's time on an H100 at vocab 100k). Built once, at the first use."""
    return torch.compile(_chunk_loss_and_grad)


def _accumulate_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b, with a and b in the GEMM dtype and out in fp32 (float64): the GEMM accumulates into out, so the
    head weight's gradient is rounded once at the end, as one GEMM over every token would round it. CUDA's GEMM
    reads bf16 and writes fp32 (addmm's out_dtype); elsewhere the inputs are upcast (exact)."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.device.type == "cuda":
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


def _chunked_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int, z_weight: float,
                  want_h: bool, want_w: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                       torch.Tensor | None]:
    """(mean cross-entropy, z_weight x mean logsumexp², d (their sum) / d h, d (their sum) / d weight in fp32) of
    logits = h @ weight.T, chunk by chunk.

    h [N, d] (any float dtype; cast to weight's, as autocast casts a linear's input), weight [V, d] in the GEMM
    dtype, targets [N]. The means are over the targets that are not -100 (none: NaN, as F.cross_entropy gives)."""
    acc = fp32_or_wider(weight.dtype)
    valid = targets != IGNORED_TARGET
    count = valid.sum().to(acc)
    # the gradients' scale: 1 / count, and 0 when every target is ignored (the loss is then 0 / 0 = NaN, as
    # F.cross_entropy gives, and its gradients 0 as F.cross_entropy's are, not 0 * inf = NaN)
    inverse_count = 1.0 / count.clamp(min=1)
    loss_sum = torch.zeros((), dtype=acc, device=h.device)
    z_sum = torch.zeros((), dtype=acc, device=h.device)
    grad_h = torch.empty_like(h) if want_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
    chunk_fn = _compiled_chunk_loss_and_grad() if h.device.type == "cuda" else _chunk_loss_and_grad
    for start in range(0, h.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, h.shape[0])
        hc = h[start:end].to(weight.dtype)
        kept = valid[start:end]
        loss, z, grad = chunk_fn(hc @ weight.T, torch.where(kept, targets[start:end], 0), kept, inverse_count,
                                 z_weight, want_h or want_w)
        loss_sum += loss
        z_sum += z
        if grad_h is not None:
            grad_h[start:end] = grad @ weight  # (cast to h's dtype, as autocast's input cast hands it back)
        if grad_w is not None:
            _accumulate_product(grad_w, grad.T, hc)
    z_term = z_weight * (z_sum / count) if z_weight else torch.zeros_like(z_sum)
    return loss_sum / count, z_term, grad_h, grad_w


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    """Forward computes the loss, the z-loss term and the gradient of their sum; backward scales that gradient by
    the cross-entropy's incoming gradient (the z-loss term is handed out detached: its gradient rides on the
    cross-entropy's, so the two must be summed with one coefficient, as an objective sums them)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                z_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
        loss, z_term, grad_h, grad_w = _chunked_loss(h, weight, targets, chunk_tokens, z_weight,
                                                     *ctx.needs_input_grad[:2])
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        ctx.mark_non_differentiable(z_term)
        return loss, z_term

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, _grad_z_term: torch.Tensor | None):
        # grad mode is on during a backward only when a graph of it is being built (create_graph=True: a gradient
        # penalty, a Hessian product). The gradients were computed in forward, outside any graph: once_differentiable
        # refuses only when the incoming gradient requires grad, so autograd.grad(loss, w, create_graph=True) handed
        # out a gradient with no second-order term (a penalty on it silently changed nothing). Refused here instead.
        if torch.is_grad_enabled():
            raise RuntimeError("chunked_head_cross_entropy (train.loss_chunk_tokens > 0) is differentiable once: its "
                               "gradients are computed in forward, so create_graph=True (a second derivative) cannot "
                               "be built; use loss_chunk_tokens=0 (the whole logits) for higher-order gradients")
        grad_h, grad_w = ctx.saved_tensors
        if grad_h is not None:
            grad_h = (grad_h.to(grad_loss.dtype) * grad_loss).to(grad_h.dtype)
        if grad_w is not None:
            grad_w = (grad_w * grad_loss.to(grad_w.dtype)).to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None


def chunked_head_losses(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int,
                        z_loss_weight: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean next-token cross-entropy, z_loss_weight x mean logsumexp² of the logits) of logits h @ weight.T, never
    holding more than chunk_tokens rows of logits.

    h: [..., d] final hidden states; weight: [V, d] the head's weight as its GEMM consumes it (the precision recipe's
    gemm_weight: bf16 under autocast); targets: [...] ids in [0, V) or -100 (left out of both means).
    The cross-entropy is differentiable in h and weight (once: no double backward) and carries the gradient of BOTH
    terms; the z-loss term comes back detached (its value, for the objective's sum and the metrics). Backpropagate
    their sum (or the cross-entropy alone: the same gradient); a z-loss term weighted differently from the
    cross-entropy in an objective is not supported."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: expected a positive number of tokens per chunk")
    if not (isinstance(z_loss_weight, (int, float)) and not isinstance(z_loss_weight, bool)
            and math.isfinite(z_loss_weight) and z_loss_weight >= 0):
        raise ValueError(f"z_loss_weight={z_loss_weight!r}: expected a finite number >= 0 (0 = no z-loss)")
    if h.shape[:-1] != targets.shape:
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match the hidden states' "
                         f"{tuple(h.shape[:-1])} (one target per position)")
    targets = targets.reshape(-1)
    check_targets(targets, weight.shape[0])
    h = h.reshape(-1, h.shape[-1])
    z_loss_weight = float(z_loss_weight)
    with torch.autocast(h.device.type, enabled=False):  # the dtypes are chosen here: weight's for the GEMMs
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            return _ChunkedHeadCrossEntropy.apply(h, weight, targets, chunk_tokens, z_loss_weight)
        return _chunked_loss(h, weight, targets, chunk_tokens, z_loss_weight, False, False)[:2]


def chunked_head_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               chunk_tokens: int) -> torch.Tensor:
    """Mean next-token cross-entropy of logits h @ weight.T, never holding more than chunk_tokens rows of logits
    (chunked_head_losses without a z-loss). Differentiable in h and weight (once: no double backward)."""
    return chunked_head_losses(h, weight, targets, chunk_tokens)[0]
