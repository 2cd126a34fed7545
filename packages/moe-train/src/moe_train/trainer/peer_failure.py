"""Which rank's failure stopped a multi-rank run, said on the ranks that only saw its consequence.

A rank that raises in the middle of a step (its forward, its backward, its batch) leaves the others inside a
collective the failed rank will never join. They stop when its process group is closed, with the backend's error
(gloo: "Connection closed by peer"), which names neither the rank nor the cause; and rank 0's error is the one
metrics.jsonl records. So a rank whose run ends by an exception first writes that exception to the process
group's key-value store (the launcher's rendezvous), then closes its groups; a rank whose collective then fails
reads the store and raises a TrainingError naming the rank and its error, the backend's error as its cause.
Under torchrun the store is its agent's and outlives every rank; launched without it, rank 0 hosts the store, and
a record rank 0 wrote goes with its process (a peer that reads after rank 0 has exited finds nothing). Best
effort: with no store (a group of the caller's without one), a store that is gone, or no record (a rank killed
outright, one that stopped answering), the TrainingError says that no other rank's error could be read, and why that
may be, with the backend's error (before moe-train 0.27.15, the backend's bare error).
"""

from __future__ import annotations

import itertools

import torch.distributed as dist

from moe_train.trainer.errors import TrainingError

# every rank makes its multi-rank runs in the same order: the same number names the same run. Only those are counted:
# a one-process run on one rank alone (rank 0 evaluating with a LocalRuntime, say) has no records, and numbering it
# too shifted that rank's numbers off the others' for every later run (no failure named, or a stale one)
_runs = itertools.count()


class PeerFailures:
    """The failure records of one run (its own keys in the store: a caller's world may carry several runs)."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.prefix = f"moe_train/run{next(_runs) if world_size > 1 else 'local'}/failed"
        self.store = None
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            try:
                self.store = dist.distributed_c10d._get_default_store()
            except Exception:  # noqa: BLE001 - no store: the errors stay as they are
                self.store = None

    def publish(self, e: BaseException, consequence: bool) -> None:
        """Record this rank's error `e` (consequence: it only passes on another rank's failure)."""
        if self.store is None:
            return
        from moe_train.trainer.ctrl_c import stop_description

        text = stop_description(e) if isinstance(e, KeyboardInterrupt) else str(e)
        try:
            self.store.set(f"{self.prefix}/{self.rank}", f"{int(consequence)}{type(e).__name__}: {text}"[:2000])
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0
            pass

    def first_cause(self) -> tuple[int, str] | None:
        """(rank, its error) of the lowest other rank whose own failure was recorded, or None."""
        if self.store is None:
            return None
        found = None
        try:
            for r in range(self.world_size):
                key = f"{self.prefix}/{r}"
                if r == self.rank or not self.store.check([key]):
                    continue
                value = self.store.get(key).decode(errors="replace")
                if value[:1] == "0":
                    return r, value[1:]
                found = found or (r, value[1:])
        except Exception:  # noqa: BLE001 - the store is gone with rank 0: nothing to read, or to write (publish)
            self.store = None
            return found
        return found


def failed_collective(e: BaseException) -> bool:
    """Whether `e` is a collective's failure: NCCL raises a DistError (DistBackendError); gloo a plain RuntimeError
    whose text names gloo (its source file: "[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer", a
    timeout's "[.../gloo/...] Timed out waiting"). Any other RuntimeError is this rank's own error (a rank that failed
    at about the same step as another one: its own error, not "stopped with it")."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    return type(e) is RuntimeError and "gloo" in str(e).lower()


# what a collective's error says when its peer went away or stopped answering (gloo: "Connection closed by peer",
# "Connection reset by peer", "Timed out waiting ...", "Broken pipe"; NCCL: a watchdog timeout, an aborted
# communicator, "remote process exited or there was a network error"), as opposed to this rank's own misuse of a
# collective ("ProcessGroupGloo::reduce: invalid root rank: 5"), which names no peer
_PEER_GONE = ("peer", "timed out", "timeout", "broken pipe", "connection", "aborted", "remote process", "network")


def peer_gone(e: BaseException) -> bool:
    """Whether failed collective `e` says its peer went away or stopped answering."""
    text = str(e).lower()
    return failed_collective(e) and any(word in text for word in _PEER_GONE)


def explain(e: BaseException, failures: PeerFailures) -> BaseException:
    """`e`, or a TrainingError naming the other rank whose failure `e` (a failed collective) passed on; with no
    record to read, when `e` says its peer went away (a rank killed outright, one that stopped answering), a
    TrainingError saying what that leaves. This rank's own error (its misuse of a collective included) stays as is."""
    if not failed_collective(e) or failures.world_size == 1:
        return e
    backend = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
    cause = failures.first_cause()
    if cause is None:
        if not peer_gone(e):
            return e
        stopped = TrainingError(
            f"rank {failures.rank} of {failures.world_size} stopped: a collective failed and no other rank's error "
            "could be read (a rank killed outright, e.g. by SIGKILL or the out-of-memory killer; one that stopped "
            "answering for parallel.collective_timeout_s; or rank 0 gone with the store it hosts when not launched by "
            f"torchrun): see the other ranks' output (its collective failed: {backend})")
    else:
        rank, error = cause
        stopped = TrainingError(f"rank {rank} of {failures.world_size} failed ({error}); rank {failures.rank} stopped "
                                f"with it (its collective failed: {backend})")
    stopped.peer_failure = True
    return stopped
