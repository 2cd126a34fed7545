"""Free what a backward cut short leaves in the autograd engine, while the interpreter is alive.

A backward that raises part-way (Ctrl-C or SIGTERM landing in it, an error in a hook) leaves the rest of its graph's
ready tasks in the calling thread's CPU ready queue, a thread-local of torch's engine. Nothing frees them until the
thread ends: for the main thread, at process exit, after Python has shut down. A node that holds Python saved-tensor
hooks (activation checkpointing's) then takes the GIL in its destructor and the process dies with SIGSEGV (exit
status 139 where 130 or 143 was meant; review helper 174, 10 of 10 runs stopped mid-backward with checkpointing).
The engine pops the tasks of a graph that no longer exists before any other, and drops them: one tiny backward on
the same thread frees them all.
"""

from __future__ import annotations

import torch


def release_aborted_backward() -> None:
    """Run a one-node backward on this thread (microseconds): the tasks an aborted backward left queued are popped and
    freed first. Harmless when there are none."""
    with torch.enable_grad(), torch.inference_mode(False):
        leaf = torch.zeros((), requires_grad=True)
        torch.autograd.backward(leaf * 1.0)
