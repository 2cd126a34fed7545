"""Activation checkpointing: run part of a block so that backward recomputes its activations instead of keeping them.

Only the inputs of the recomputed part stay in memory between forward and backward; backward runs the
part again (torch.utils.checkpoint, non-reentrant) just before it needs what the part saved. Which part
is the training runtime's choice (`train.activation_checkpointing`, set by Transformer.set_activation_checkpointing);
it changes no parameter or buffer, so checkpoints and exports do not know about it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from moe_train.model.router import Router


class _Recomputing:
    """While entered, the routers under `owner` know that their forward is a rerun and record nothing
    (the forward it repeats counted their statistics and balancing signal). Re-enterable: autograd may
    rerun a part more than once (a second backward through a retained graph, or a torch.autograd.grad
    taken inside the part's forward)."""

    def __init__(self, owner: nn.Module):
        self.routers = [m for m in owner.modules() if isinstance(m, Router)]
        self.before: list[list[bool]] = []

    def __enter__(self) -> None:
        self.before.append([r.recomputing for r in self.routers])
        for r in self.routers:
            r.recomputing = True

    def __exit__(self, *exc: object) -> None:
        for r, flag in zip(self.routers, self.before.pop()):
            r.recomputing = flag


def recompute_in_backward(owner: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) (a part of `owner`'s forward), keeping only args for backward, which reruns fn.

    The rerun sees the forward's RNG state (CPU and the inputs' device: random routing picks the same
    experts) and autocast state, and marks owner's routers as recomputing (nothing counted twice). It
    goes to the end of fn (no early stop), so each rank re-issues every collective fn makes (the
    all-to-all dispatch, the global balancing-loss all-reduce) whatever its data; every rank reruns the
    same parts in the same order, so the collectives meet.
    """
    with set_checkpoint_early_stop(False):
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                          context_fn=lambda: (nullcontext(), _Recomputing(owner)))
