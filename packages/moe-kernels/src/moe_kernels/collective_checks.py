"""Input checks that end alike on every rank of a collective.

A rank that raises alone before a collective leaves its peers waiting in it until the process-group
timeout (30 minutes by default), and a caller that catches the error and retries pairs mismatched
exchanges; rows of another width or dtype than a peer expects abort the process inside gloo (SIGABRT)
or corrupt memory under NCCL. So a transport checks its inputs first, tells its peers in a small
collective whether it can go on, and then every rank goes on or every rank raises.

A frame that holds the error it raises (or hands to a call that raises it) drops it on the way out (`del` in a
`finally`): the error's traceback holds that frame, so the frame's reference is a cycle (error -> traceback ->
frame -> error) that keeps the frame's process group, and gloo's worker threads, alive after the caller dropped
the error, until the garbage collector runs; a gloo group still alive at interpreter exit can abort the process
(SIGABRT, pytorch#190489).
"""

from __future__ import annotations

import hashlib
from contextlib import nullcontext as _no_stream
from typing import Any, NoReturn

import torch
import torch.distributed as dist

# Row dtypes by a code every process computes alike (headers travel as int64).
_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "float64", "uint8", "int8", "int16", "int32", "int64",
                 "bool", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float4_e2m1fn_x2")
    if hasattr(torch, name)
)
_TEXT_BYTES = 1024  # an error message travels to the peers clipped to this many UTF-8 bytes


def dtype_code(dtype: torch.dtype) -> int:
    """An int naming `dtype` alike on every process: its index in the table, or past the table a 48-bit hash of its
    name (a single code for every other dtype let float8_e4m3fnuz rows meet float8_e5m2fnuz ones unrefused)."""
    if dtype in _DTYPES:
        return _DTYPES.index(dtype)
    return len(_DTYPES) + int.from_bytes(hashlib.blake2b(str(dtype).encode(), digest_size=6).digest(), "little")


def dtype_name(code: int) -> str:
    if 0 <= code < len(_DTYPES):
        return str(_DTYPES[code])
    named = {dtype_code(d): str(d) for d in vars(torch).values() if isinstance(d, torch.dtype)}
    return named.get(code, "another dtype")


def gather_or_raise(
    op: str, problem: Exception | None, values: list[int], group: Any, device: torch.device
) -> list[list[int]]:
    """Every rank's `values` (host ints, [ep][len(values)]), or raise on every rank when one had a problem.

    A good call costs one all_gather of 1 + len(values) int64 per rank and one host read of the result.
    When a rank had a problem, every rank also gathers the error texts (a second all_gather, on that path
    only) and raises (see raise_refused). A group of one rank needs neither.
    """
    try:
        ep = dist.get_world_size(group)
        if ep == 1:
            if problem is not None:
                raise problem
            return [values]
        if problem is not None:
            device = refused_device(group)
        # On a GPU the verdict travels on a side stream: it depends on no queued kernel, so the host read
        # below waits for the peers only, not for the work queued before the check (unmeasured: EP has not
        # run on several GPUs here; gloo groups take CPU tensors and have no streams).
        side = torch.cuda.Stream(device) if device.type == "cuda" else None
        with torch.cuda.stream(side) if side is not None else _no_stream():
            mine = torch.tensor([int(problem is not None), *values], dtype=torch.int64, device=device)
            table = torch.empty(ep * mine.numel(), dtype=torch.int64, device=device)
            dist.all_gather_into_tensor(table, mine, group=group)
            rows = table.view(ep, -1).tolist()
        bad = [r for r in range(ep) if rows[r][0]]
        if bad:
            raise_refused(op, problem, bad, group, device)
        return [row[1:] for row in rows]
    finally:
        del problem  # raised through this frame: no cycle through it (module docstring)


def raise_refused(op: str, problem: Exception | None, bad: list[int], group: Any, device: torch.device) -> NoReturn:
    """Raise on every rank once every rank knows that the ranks in `bad` had a problem (`problem` on those).

    The rank at fault raises its own error with a note, the others a ValueError naming each rank at fault
    and quoting its error. Costs one all_gather of _TEXT_BYTES per rank: call it on the failure path only.
    """
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    texts = _gather_texts(problem, ep, group, device)
    where = f"{op} stopped on every EP rank before any row moved"
    others = "; ".join(f"EP rank {r}: {texts[r]}" for r in bad if r != me)
    if problem is not None:
        problem.add_note(f"(EP rank {me} of {ep}; {where}" + (f"; also {others})" if others else ")"))
        try:
            raise problem
        finally:
            del problem  # no cycle through this frame (module docstring)
    raise ValueError(f"{where}: {others}")


def refused_device(group: Any) -> torch.device:
    """Where a rank whose inputs were refused joins the verdict exchange: its inputs may sit on a device the
    group's backend does not take (a meta tensor, or CPU rows in an NCCL group), and a tensor there leaves
    the rank out of the exchange its peers are in."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_texts(problem: Exception | None, ep: int, group: Any, device: torch.device) -> list[str]:
    """Each rank's error as text ("" where none)."""
    text = b"" if problem is None else f"{type(problem).__name__}: {problem}".encode()[:_TEXT_BYTES]
    mine = torch.tensor(list(text.ljust(_TEXT_BYTES, b"\0")), dtype=torch.uint8, device=device)
    everyone = torch.empty(ep * _TEXT_BYTES, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in everyone.view(ep, -1).tolist()]


def require_agreement(values: list[str], what: str, rule: str) -> None:
    """values[r]: what EP rank r holds (gathered, so alike on every rank). When they differ, every rank raises
    the same ValueError naming who holds what: the ranks outside a majority by name, else every rank."""
    if len(set(values)) == 1:
        return
    most = max(values, key=values.count)
    if 2 * values.count(most) > len(values):
        odd = "; ".join(f"EP rank {r}: {v}" for r, v in enumerate(values) if v != most)
        who = f"{odd}; the other EP ranks: {most}"
    else:
        who = "; ".join(f"EP rank {r}: {v}" for r, v in enumerate(values))
    raise ValueError(f"EP ranks disagree on {what} ({who}); {rule} (raised on every EP rank before any row moved)")
