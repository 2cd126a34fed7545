"""Expert-parallel token dispatch over torch.distributed.all_to_all_single.

Experts are split contiguously over the `ep` ranks of `group`: expert e lives on EP rank
e // (E / ep). Dispatch permutes (token, slot) rows into global expert order (so each
destination rank's rows are contiguous), exchanges per-expert counts with an all-to-all of a
small device tensor, sends the rows, and reorders what arrives into local-expert order.

Host synchronisation: all_to_all_single needs its split sizes as host ints, so the count matrix
makes exactly one device->host copy per dispatch (send counts and receive counts in one tensor).
Combine reuses those sizes; its one host read is the verdict of its input check (below). A row-wise
NVSHMEM transport removes the copy.

Failing together: a collective that one rank never enters waits for the process-group timeout
(30 minutes by default), and rows of another width or dtype than the receiver expects abort the
process inside gloo (SIGABRT) or corrupt memory under NCCL. So every rank checks its own inputs
*before* the first collective and sends, beside its counts, a small header (a status, the payload's
values per row and dtype, d, whether its rows need gradients); after that one exchange every EP rank
knows whether every other rank can go on, and all of them raise the same kind of ValueError, before
any row moves, when one cannot (its own rank the detailed message, the others one naming that rank
and quoting its message, gathered on that path only). Combine has no exchange before its rows to
carry such a header, so it gathers a few int64 per rank first (see combine).

Capacity (optional): with capacity_factor c > 0 a rank computes at most ceil(c * R) received rows,
R = the EP group's mean T * k (the rows a rank receives when routing is balanced; each rank's T * k
travels in the count exchange's header, so every rank has the same cap); rows past the cap in
local-expert order (higher local experts, then higher source ranks, then later tokens) are dropped -
their expert output is zero - and counted in `dropped`. Deterministic, and dropless by default (c = 0).
Before moe-kernels 0.10.0 R was the rank's own T * k: a rank with no tokens that step dropped every
row it received.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist

# Imported here, before any process group exists (moe_kernels is imported before init_process_group): the collectives
# of torch.distributed.nn.functional take `group=group.WORLD` as a default argument, evaluated on first import, and
# torch imports that module lazily (torch._dynamo does, e.g. at a meta-device model's first init). Imported after
# init_process_group, those defaults hold the world group past destroy_process_group, and gloo's worker threads with
# it; a worker still releasing a collective's tensors while the interpreter exits aborts the process (SIGABRT).
import torch.distributed.nn  # noqa: F401

from moe_kernels.collective_checks import (
    dtype_code,
    dtype_name,
    gather_or_raise,
    raise_refused,
    refused_device,
    require_agreement,
)
from moe_kernels.dispatch import (
    DispatchResult,
    PayloadCodec,
    check_decoded_rows,
    check_payload_rows,
    checked_codec,
    require_graph_kept,
)
from moe_kernels.permute import (
    check_expert_out_dtype,
    check_route_map_device,
    check_router_weights,
    check_rows,
    combine,
    permute,
)
from moe_kernels.route_map import RouteMap, positive_int, require_route_map
from moe_kernels.compile_marks import constant_under_compile

# Header columns sent to every EP peer after the [E_local] counts (int64).
_STATUS, _ROW_NUMEL, _DTYPE, _WIDTH, _GRAD, _ROWS = range(6)
_HEADER = 6
_BAD_INPUT, _BAD_COUNTS = 1, 2  # status bits


class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse all-to-all (splits swapped)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """x: [sum(in_splits), ...] -> [sum(out_splits), ...]. One-byte floats (fp8 payloads and their gradients) travel
    as their bytes: gloo refuses those dtypes ("Invalid scalar type"), and the exchange only moves bytes."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    if x.dtype.is_floating_point and x.dtype.itemsize == 1:
        dist.all_to_all_single(out.view(torch.uint8), x.contiguous().view(torch.uint8), out_splits, in_splits,
                               group=group)
    else:
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Differentiable row exchange: x [sum(in_splits), d] -> [sum(out_splits), d]."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


@dataclass
class AllToAllContext:
    """What combine needs to send rows back.

    route_map:  this rank's route map (global experts)
    send_splits / recv_splits: host ints per EP rank (rows sent / received in dispatch)
    local_to_recv: [N_recv] int64 local-expert-order row of each received row
    num_kept:   rows computed (N_recv, or the capacity when it binds)
    dispatcher, dispatch_index: who handed it out, and its how-manieth dispatch call (the same on every
                EP rank for the results of one collective dispatch)
    """

    route_map: RouteMap
    send_splits: list[int]
    recv_splits: list[int]
    local_to_recv: torch.Tensor
    num_recv: int
    num_kept: int
    dispatcher: AllToAllDispatcher
    dispatch_index: int


def _as_written(capacity_factor: numbers.Real) -> Fraction:
    """The factor as its shortest decimal reads: str() of a float, a numpy float32 (np.float32(0.3) is '0.3', where
    float() widens it to 0.30000001192092896 first) or a Decimal; a Fraction as it is."""
    try:
        return Fraction(str(capacity_factor))
    except ValueError:
        return Fraction(capacity_factor)


def capacity(factor: Fraction, rows_per_rank: list[int]) -> int:
    """The received rows an EP rank computes: ceil(factor * the group's mean T * k), rows_per_rank[r] being EP
    rank r's T * k. The same on every rank, whatever its own token count (zero included)."""
    return math.ceil(factor * Fraction(sum(rows_per_rank), len(rows_per_rank)))


def check_capacity_factor(capacity_factor: object) -> None:
    """A capacity factor is a finite real number >= 0 (0 = dropless): a bool is an int to Python (True would
    silently cap at 1.0), and None or a string would fail later with a bare TypeError."""
    if (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real)
            or not math.isfinite(capacity_factor) or capacity_factor < 0):
        raise ValueError(f"capacity_factor={capacity_factor!r} must be a finite number >= 0 (0 = dropless)")


class AllToAllDispatcher:
    """TokenDispatcher for expert parallelism over `group` (ep = group size)."""

    def __init__(self, group: Any, num_experts: int, capacity_factor: float = 0.0, codec: PayloadCodec | None = None):
        self.group = group
        self.ep_size = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        num_experts = positive_int("num_experts", num_experts)
        if num_experts % self.ep_size != 0:
            raise ValueError(f"num_experts={num_experts} is not divisible by ep={self.ep_size}")
        check_capacity_factor(capacity_factor)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size
        self.capacity_factor = capacity_factor
        self._capacity_fraction = _as_written(capacity_factor)
        self.codec = checked_codec(codec)
        self._dispatches = 0  # counted on entry, so every EP rank counts alike, refused calls included
        self._experts_agreed = False  # checked at the first dispatch, one small collective

    def dispatch(self, x: torch.Tensor, route_map: RouteMap) -> DispatchResult:
        """x: [T, d] -> rows [N_kept, d] for the local experts, offsets [E_local] int32.

        Call on every rank of the EP group. Bad input on any rank (shapes, counts that are not
        integers or do not sum to T*k, a payload of another width or dtype than the other ranks', or
        one that needs gradients where theirs does not: the backward exchange would run on some ranks only)
        raises on every rank after one small exchange, before any row moves: the rank at fault its
        own error, the others a ValueError naming that rank and quoting its error.
        """
        if torch.compiler.is_compiling() and _exchanges_run_eagerly():
            return _EAGERLY["dispatch"](self, x, route_map)
        ep, e_local = self.ep_size, self.num_local_experts
        self._dispatches += 1
        if not self._experts_agreed:
            self._require_same_num_experts()
        problem: Exception | None = None
        payload = None
        try:
            # The counts exchange is [ep, E_local + header] on every rank, so this rank's E cannot travel
            # in it; a route map over another E is refused through the status header instead (raised
            # here alone, it left the other EP ranks waiting in the count exchange until the timeout).
            require_route_map(route_map)  # expert ids in its place failed on `.num_experts` (LocalDispatcher's: not)
            if route_map.num_experts != self.num_experts:
                raise ValueError(f"route map has {route_map.num_experts} experts, dispatcher expects {self.num_experts}")
            dtype = route_map.counts.dtype
            if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
                raise ValueError(f"route map counts must be an integer tensor, got dtype={dtype}")
            rows = permute(x, route_map)
            payload = self.codec.encode(rows)  # [T*k, ...] in global expert order
            check_payload_rows(payload, route_map.num_rows)
            require_graph_kept(rows, payload, "codec.encode(rows)")
        except Exception as err:  # noqa: BLE001 - raised below, once every EP rank knows
            problem = err
        try:
            send = self._counts_and_header(x, route_map, payload, problem)  # [ep, E_local + header] int64
            recv = torch.empty_like(send)  # row r: from source rank r, its counts for my local experts, its header
            dist.all_to_all_single(recv, send, group=self.group)
            # The one device->host copy: split sizes must be host ints for all_to_all_single.
            host = torch.cat([send[:, :e_local].sum(1), recv.reshape(-1)]).tolist()
            send_splits = host[:ep]
            table = [host[ep + r * (e_local + _HEADER) : ep + (r + 1) * (e_local + _HEADER)] for r in range(ep)]
            self._refuse_together(problem, table, route_map, send.device)
        finally:
            del problem  # its traceback holds this frame: no cycle keeping the group alive (collective_checks)
        recv_counts = recv[:, :e_local]  # [ep, E_local]: from each source rank, per local expert
        recv_splits = [sum(row[:e_local]) for row in table]
        num_recv = sum(recv_splits)
        arrived = all_to_all_rows(payload, recv_splits, send_splits, self.group)
        received = self.codec.decode(arrived)
        # Checked as LocalDispatcher checks it. After the exchange, so raised on each rank alone: every EP rank
        # runs the same codec on rows of one width and dtype (agreed above), so a codec that is wrong is wrong on
        # all of them (one that fails on some ranks' rows only, as one raising inside decode, leaves the others
        # waiting in combine).
        check_decoded_rows(received, num_recv, x.shape[1], "N_recv")
        require_graph_kept(arrived, received, "codec.decode(received payload)")

        # Received rows come source-rank major; reorder to local-expert major (source rank within).
        local_to_recv = _source_major_to_expert_major(recv_counts, num_recv)
        rows = received.index_select(0, local_to_recv)
        per_expert = recv_counts.sum(0, dtype=torch.int32)
        offsets = torch.cumsum(per_expert, 0, dtype=torch.int32)
        num_kept = num_recv
        dropped = torch.zeros((), dtype=torch.int64, device=x.device)
        if self.capacity_factor > 0:
            # the factor as written: in binary 1.1 is 1.1000000000000000888, and ceil(1.1 * 100) would keep 111 rows
            cap = capacity(self._capacity_fraction, [row[e_local + _ROWS] for row in table])
            if num_recv > cap:
                num_kept = cap
                rows = rows[:cap]
                offsets = offsets.clamp(max=cap)
                dropped = torch.tensor(num_recv - cap, dtype=torch.int64, device=x.device)
        ctx = AllToAllContext(route_map, send_splits, recv_splits, local_to_recv, num_recv, num_kept, self,
                              self._dispatches)
        return DispatchResult(rows, offsets, ctx, dropped)

    def _require_same_num_experts(self) -> None:
        """Every EP rank's dispatcher must split the same experts: the count exchange is [ep, E/ep + header]
        int64, so a rank with another num_experts sends another size, and gloo aborts the process (NCCL
        reads past the buffer). One gather of one int64 per rank, at the first dispatch only."""
        table = gather_or_raise("dispatch", None, [self.num_experts], self.group, refused_device(self.group))
        require_agreement([f"num_experts={row[0]}" for row in table], "the experts they split",
                          "every EP rank's AllToAllDispatcher must be built with the same num_experts")
        self._experts_agreed = True

    def _counts_and_header(
        self, x: torch.Tensor, route_map: RouteMap, payload: torch.Tensor | None, problem: Exception | None
    ) -> torch.Tensor:
        """[ep, E_local + header] int64 on x's device: row r goes to EP rank r. Built without a host read.

        A refused rank's x may be no tensor, or on a device the group does not take (a header there would
        leave this rank out of the exchange its peers are in), so its header goes where the group wants it.
        """
        ep, e_local = self.ep_size, self.num_local_experts
        device = refused_device(self.group) if problem is not None else x.device
        send = torch.zeros(ep, e_local + _HEADER, dtype=torch.int64, device=device)
        if problem is not None:
            send[:, e_local + _STATUS] = _BAD_INPUT
            return send
        counts = route_map.counts.to(device=device, dtype=torch.int64)
        send[:, :e_local] = counts.view(ep, e_local)
        # Counts from a hand-built map that cannot be the split sizes of this rank's T*k rows.
        bad_counts = (counts < 0).any() | (counts.sum() != route_map.num_rows)
        send[:, e_local + _STATUS] = bad_counts.to(torch.int64) * _BAD_COUNTS
        send[:, e_local + _ROW_NUMEL] = math.prod(payload.shape[1:])
        send[:, e_local + _DTYPE] = dtype_code(payload.dtype)
        send[:, e_local + _WIDTH] = x.shape[1]
        send[:, e_local + _GRAD] = _needs_grad(payload)
        send[:, e_local + _ROWS] = route_map.num_rows  # T * k: the capacity is the group's mean of it
        return send

    def _refuse_together(
        self, problem: Exception | None, table: list[list[int]], route_map: RouteMap, device: torch.device
    ) -> None:
        """table[r]: source rank r's counts for my local experts + its header. Same verdict on every rank."""
        e_local, me = self.num_local_experts, self.ep_rank
        status = [row[e_local + _STATUS] for row in table]
        bad = [r for r in range(self.ep_size) if status[r]]
        if bad:  # the error texts travel on this path only: a good call pays for the count exchange alone
            if status[me] & _BAD_COUNTS:
                problem = ValueError(
                    f"route map counts {route_map.counts.tolist()} have a negative entry or do not sum to "
                    f"T*k={route_map.num_rows} rows"
                )
            try:
                raise_refused("dispatch", problem, bad, self.group, device)
            finally:
                del problem  # no cycle through this frame (collective_checks)
        sent = [(row[e_local + _ROW_NUMEL], row[e_local + _DTYPE], row[e_local + _WIDTH]) for row in table]
        if len(set(sent)) > 1:
            each = "; ".join(f"rank {r}: d={w} ({n} values per row, {dtype_name(c)})"
                             for r, (n, c, w) in enumerate(sent))
            raise ValueError(
                f"EP ranks disagree on the rows they dispatch ({each}); every EP rank must send rows of the "
                "same width and dtype (raised on every EP rank before any row moved)"
            )
        require_agreement([_grad_text(row[e_local + _GRAD]) for row in table], "whether the rows they dispatch need "
                          "gradients", _SAME_GRAD.format(op="dispatch", what="x"))

    def combine(self, expert_out: torch.Tensor, result: DispatchResult, weights: torch.Tensor) -> torch.Tensor:
        """expert_out: [N_kept, d] local-expert order; weights: [T, k] -> [T, d].

        Call on every rank of the EP group, each with the result of the same dispatch call. Bad input on
        any rank (a result this dispatcher's dispatch did not hand out, expert rows that are not
        [N_kept, d] floats on the rows' device, router weights that are not [T, k] floats there, rows
        of another width or dtype, or of another dispatch call, or needing gradients where the other ranks'
        do not) raises on every rank before any row moves: the rank at fault its own error, the others a
        ValueError naming that rank and quoting it. Values are not checked: NaN weights give NaN rows, as
        they do locally.
        """
        if torch.compiler.is_compiling() and _exchanges_run_eagerly():
            return _EAGERLY["combine"](self, expert_out, result, weights)
        problem: Exception | None = None
        try:
            ctx = self._context_of(result)
            _check_combine_inputs(expert_out, ctx, weights)
        except Exception as err:  # noqa: BLE001 - raised below, once every EP rank knows
            problem = err
        # What this check costs a good call: one all_gather of 5 int64 per EP rank and one host read of
        # the [ep, 5] result (a collective's latency; ep=1 skips both). On a GPU that read also waits for
        # the work queued before combine (the expert FFN), which the row exchange waits for anyway, but
        # the host stops running ahead there, as it does at dispatch's count read. No exchange that
        # already happens can carry the verdict: combine's only one is the row exchange, whose sizes
        # are what is being checked.
        mine = [0, 0, 0, 0] if problem else [expert_out.shape[1], dtype_code(expert_out.dtype), ctx.dispatch_index,
                                             _needs_grad(expert_out)]
        on = getattr(result, "offsets", expert_out)  # the header travels on dispatch's device
        try:
            table = gather_or_raise("combine", problem, mine, self.group, getattr(on, "device", torch.device("cpu")))
        finally:
            del problem  # its traceback holds this frame: no cycle keeping the group alive (collective_checks)
        require_agreement([f"dispatch #{i}" for _, _, i, _ in table], "the dispatch call they combine",
                          "every EP rank must pass the result of the same dispatch of this dispatcher")
        require_agreement([f"d={w} {dtype_name(c)}" for w, c, _, _ in table], "the expert rows they send back",
                          "every EP rank must send rows of the same width and dtype")
        require_agreement([_grad_text(g) for *_, g in table], "whether the expert rows they send back need gradients",
                          _SAME_GRAD.format(op="combine", what="expert_out"))

        if ctx.num_kept < ctx.num_recv:  # dropped rows come back as zeros
            pad = expert_out.new_zeros((ctx.num_recv - ctx.num_kept, *expert_out.shape[1:]))
            expert_out = torch.cat([expert_out, pad])
        recv_order = torch.empty_like(ctx.local_to_recv)
        recv_order.scatter_(0, ctx.local_to_recv, torch.arange(ctx.num_recv, device=recv_order.device))
        back = all_to_all_rows(expert_out.index_select(0, recv_order), ctx.send_splits, ctx.recv_splits, self.group)
        return combine(back, ctx.route_map, weights)

    def _context_of(self, result: DispatchResult) -> AllToAllContext:
        ctx = getattr(result, "context", None)
        if not isinstance(ctx, AllToAllContext):
            raise ValueError(
                f"result.context is a {type(ctx).__name__}: pass the DispatchResult of this dispatcher's dispatch"
            )
        if ctx.dispatcher is not self:
            other = ctx.dispatcher
            raise ValueError(
                f"the DispatchResult was handed out by another AllToAllDispatcher (num_experts={other.num_experts}, "
                f"ep={other.ep_size}): pass the DispatchResult of this dispatcher's dispatch"
            )
        return ctx


# Under torch.compile, dispatch and combine run eagerly, between graphs: their exchanges need split sizes and peer
# verdicts as host ints. Traced, the first host read made dynamo graph-break a dozen times per layer, recompile as
# the counts changed, and, with fullgraph=True, fail with an internal GuardOnDataDependentSymNode naming none of this.
_EAGERLY: dict = {}
_WHY_EAGER = (
    "AllToAllDispatcher.{name} runs eagerly under torch.compile: its all-to-all needs the split sizes as host ints "
    "and its EP ranks agree on their inputs before any row moves, so it cannot be part of a graph. With "
    "fullgraph=True, compile the parts around the dispatcher (router, expert FFN) instead of the module holding it, "
    "or compile that module with fullgraph=False (the graph breaks at dispatch and combine, which run between graphs)"
)


@constant_under_compile  # run for real while dynamo traces: it imports torch._dynamo, which import moe_kernels must not
def _exchanges_run_eagerly() -> bool:
    """Make _EAGERLY's dispatch and combine: the methods wrapped in torch.compiler.disable, which dynamo calls
    eagerly (a graph break) or, with fullgraph=True, refuses with the reason above."""
    for name in ("dispatch", "combine"):
        if name not in _EAGERLY:
            method = getattr(AllToAllDispatcher, name)
            _EAGERLY[name] = torch.compiler.disable(method, reason=_WHY_EAGER.format(name=name))
    return True


# A row exchange runs its reverse in backward only where its input needs gradients: a rank whose rows do not
# (x without requires_grad, e.g. a fresh empty batch) skips it, and its peers' backward exchange pairs with
# its next collective (wrong rows, or a gloo abort).
_SAME_GRAD = ("{op}'s backward is a row exchange that every EP rank must join, so {what} must require grad on every "
              "EP rank or on none, a rank with no rows too")


def _needs_grad(rows: torch.Tensor) -> int:
    """1 when a row exchange of `rows` records a backward (which then exchanges on every rank), else 0."""
    return int(torch.is_grad_enabled() and rows.requires_grad)


def _grad_text(flag: int) -> str:
    return "rows need gradients" if flag else "rows need no gradients"


def _check_combine_inputs(expert_out: torch.Tensor, ctx: AllToAllContext, weights: torch.Tensor) -> None:
    """What combine needs of this rank's inputs, checked before any row moves (the local combine after the
    exchange checks the same; failing there would leave the other EP ranks in their next collective)."""
    route_map = ctx.route_map
    if not isinstance(expert_out, torch.Tensor):
        raise TypeError(f"expert_out must be a tensor [N_kept={ctx.num_kept}, d], got {type(expert_out).__name__}")
    check_rows("expert_out", expert_out, "N_kept")
    if expert_out.shape[0] != ctx.num_kept:
        raise ValueError(f"expert_out has {expert_out.shape[0]} rows, dispatch handed out N_kept={ctx.num_kept}")
    check_expert_out_dtype(expert_out)
    check_route_map_device(route_map, expert_out, "expert_out")
    if not isinstance(weights, torch.Tensor):
        raise TypeError(
            f"router weights must be a tensor [T={route_map.num_tokens}, k={route_map.top_k}], "
            f"got {type(weights).__name__}"
        )
    check_router_weights(weights, expert_out, route_map)


def _source_major_to_expert_major(counts: torch.Tensor, total: int) -> torch.Tensor:
    """counts: [ep, E_local] rows per (source, local expert) -> [total] int64 gather index.

    Received rows are ordered (source, expert); entry i of the result is the received row that
    goes to position i of the (expert, source) order. Built on the device; `total` is a host int.
    """
    ep, e_local = counts.shape
    device = counts.device
    c = counts.to(torch.int64)
    # Start of each (source, expert) block in received order, and in expert-major order.
    recv_start = (torch.cumsum(c.reshape(-1), 0) - c.reshape(-1)).view(ep, e_local)
    ct = c.t().reshape(-1)
    local_start = (torch.cumsum(ct, 0) - ct).view(e_local, ep)
    # For every expert-major row: its (expert, source) block and position inside it.
    block = torch.repeat_interleave(torch.arange(e_local * ep, device=device), ct, output_size=total)
    pos = torch.arange(total, device=device) - local_start.reshape(-1)[block]
    expert, source = block // ep, block % ep
    return recv_start[source, expert] + pos
