"""broadcast_module_state(bucket_bytes=...) on gloo ranks seeded differently: bounded buckets, every dtype bit-exact.

One spawn of 2 ranks (dp=2: dense over dp, experts over expert-dp, which is dp at ep=1) and one of 3 (dp=3, and dp=3
ep=3 where each expert-dp group is one rank, so each rank keeps its own experts). Each builds a model of many frozen
parameters and buffers of mixed dtypes (NaN payloads, -0.0, bool, int64, bf16, float8, complex, 0-dim, 0-element,
transposed, expanded, conjugate and negative views, a view of another buffer), some larger than the bucket, and calls
broadcast_module_state with bucket_bytes 1, 64 and 1024, recording every tensor dist.broadcast is given: each is at
most bucket_bytes, or the model's own tensor (same data_ptr) when it is larger than a bucket and contiguous, and their
number is what packing the tensors in order predicts. Last, bad bucket_bytes (0, -1, True, 1.5, None) on every rank,
on one rank, and a different one per rank: refused on every rank, promptly, naming it.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_kernels import LocalDispatcher
from moe_parallel import ParallelLayout, apply_expert_parallel, broadcast_module_state, build_groups

sys.path.insert(0, str(Path(__file__).parent))  # children unpickle run_rank by this module's plain name
outcome = importlib.import_module("outcome")

DEADLINE_S = 60
PROMPT_S = 4.0  # the groups' timeout is 8 s: a rank that waited for another takes at least that long
CHECK_TIMEOUT = timedelta(seconds=8)
ALIGN = 16  # module_state's alignment of each tensor in a bucket
BUCKETS = (1, 64, 1024)
BAD = (0, -1, True, 1.5, None)
E = 3  # experts
CASES = {2: {"dp2": ParallelLayout(dp=2)}, 3: {"dp3": ParallelLayout(dp=3), "dp3_ep3": ParallelLayout(dp=3, ep=3)}}
EXCLUDE = ["per_rank"]


# ---------------------------------------------------------------------------------------------------- the spawned ranks

class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, E))
        self.register_buffer("temperature", torch.rand(1))  # dense: over dp
        self.lb_group = None


class MoELayer(nn.Module):
    """What apply_expert_parallel recognises: num_experts, experts (stacked per expert), dispatcher, router."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.router = Router()
        self.experts = nn.Module()
        self.experts.w = nn.Parameter(torch.randn(E, 2, 2))  # trainable: left alone
        self.experts.frozen = nn.Parameter(torch.randn(E, 24), requires_grad=False)  # 288 B (96 B a slice at ep=3)
        self.experts.register_buffer("usage", torch.randn(E).double())
        self.experts.register_buffer("flags", torch.rand(E, 7) < 0.5)
        self.dispatcher = LocalDispatcher(E)


def nan_payloads(rank: int) -> torch.Tensor:
    """Quiet and signalling NaNs with payloads, -0.0, infinities: bits a float copy could change."""
    bits = [0x7FC00001 + rank, 0xFFC12345 - rank, 0x80000000, 0x7F800001 + 2 * rank, 0xFF800000, rank]
    return torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits], dtype=torch.int32).view(torch.float32)


class Model(nn.Module):
    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(rank)
        self.lin = nn.Linear(4, 3)  # trainable: left alone
        self.emb = nn.Embedding(20, 8).requires_grad_(False)  # 640 B
        self.proj = nn.Linear(6, 5).requires_grad_(False)  # 120 B and 20 B
        whole = torch.randn(70)  # 280 B
        buffers = {
            "counter": torch.tensor(10 + rank),  # 0-dim int64
            "c128_scalar": torch.tensor(complex(rank, -rank - 0.5), dtype=torch.complex128),  # 0-dim, 16 B
            "f16_scalar": torch.tensor(rank + 0.25, dtype=torch.float16),  # 0-dim, 2 B
            "nan": nan_payloads(rank),
            "mask": torch.rand(37) < 0.5,  # an odd size: the next tensor starts aligned after it
            "big_mask": torch.rand(300) < 0.5,
            "bf16": torch.randn(9).bfloat16(),
            "big_bf16": torch.randn(200).bfloat16(),
            "f16": torch.randn(7).half(),
            "f64": torch.randn(5, dtype=torch.float64),
            "u8": torch.randint(0, 256, (5,), dtype=torch.uint8),
            "i8": torch.randint(-128, 128, (6,), dtype=torch.int8),
            "i16": torch.randint(-(2**15), 2**15, (3,), dtype=torch.int16),
            "i32": torch.randint(-(2**31), 2**31, (4,), dtype=torch.int32),
            "i64": torch.randint(-(2**62), 2**62, (7,)),
            "c64": torch.randn(4, dtype=torch.complex64),
            "conj_small": torch.randn(2, dtype=torch.complex64).conj(),
            "conj_big": torch.randn(40, dtype=torch.complex64).conj(),  # contiguous, but a lazy conjugate
            "neg_big": torch._neg_view(torch.randn(90)),  # contiguous, but a lazy negation
            "transposed_small": torch.randn(3, 2).t(),
            "transposed_big": torch.randn(20, 10).t(),
            "strided_big": torch.randn(200)[::2],
            "expanded_small": (torch.arange(3.0) + rank).expand(4, 3),
            "expanded_big": (torch.arange(30) + rank).expand(8, 30),  # 1920 B read from 240
            "empty": torch.zeros(0, 3),
            "empty_wide": torch.zeros(1000, 0, dtype=torch.float64),
            "big": torch.randn(100),
            "whole": whole,
            "part": whole[1:3],  # a view of another buffer
            "per_rank": torch.full((2,), float(rank)),  # excluded
        }
        if hasattr(torch, "float8_e4m3fn"):
            buffers["f8"] = torch.randn(11).to(torch.float8_e4m3fn)
            buffers["big_f8"] = torch.randn(130).to(torch.float8_e5m2)
        for name, t in buffers.items():
            self.register_buffer(name, t, persistent=name != "part")
        self.moe = MoELayer()


def values(t: torch.Tensor) -> torch.Tensor:
    return t.detach().resolve_conj().resolve_neg().clone()


def snapshot(model: nn.Module) -> dict:
    return {"state": {n: values(t) for n, t in [*model.named_parameters(), *model.named_buffers()]
                      if not t.requires_grad},
            "trainable": {n: values(p) for n, p in model.named_parameters() if p.requires_grad},
            "ptr": {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]},
            "stride": {n: t.stride() for n, t in model.named_buffers()}}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def in_place_ok(t: torch.Tensor) -> bool:
    """What may travel as its own bytes: contiguous (so not expanded), no lazy conjugate or negative bit."""
    expanded = any(t.stride(d) == 0 and t.shape[d] > 1 for d in range(t.dim()))
    return t.is_contiguous() and not expanded and not t.is_conj() and not t.is_neg()


def layout_of(model: nn.Module) -> list[dict]:
    """The tensors broadcast_module_state sends, in its order (frozen parameters, then buffers), with their group."""
    state = [(n, p) for n, p in model.named_parameters() if not p.requires_grad] + list(model.named_buffers())
    return [{"name": n, "nbytes": t.numel() * t.element_size(), "ptr": t.data_ptr(), "in_place_ok": in_place_ok(t),
             "group": "edp" if n.startswith("moe.experts.") else "dp"} for n, t in state if n not in EXCLUDE]


def recorded_call(model: nn.Module, groups, bucket_bytes: int) -> list[dict]:
    """broadcast_module_state with dist.broadcast wrapped: what each broadcast was given (bytes, data_ptr, group)."""
    calls: list[dict] = []
    real = dist.broadcast

    def broadcast(tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        calls.append({"nbytes": tensor.numel() * tensor.element_size(), "ptr": tensor.data_ptr(),
                      "dtype": str(tensor.dtype), "ranks": dist.get_process_group_ranks(group)})
        return real(tensor, *args, **kwargs)

    dist.broadcast = broadcast
    try:
        broadcast_module_state(model, groups, exclude=EXCLUDE, bucket_bytes=bucket_bytes)
    finally:
        dist.broadcast = real
    return calls


def buckets_case(rank: int, layout: ParallelLayout) -> dict:
    groups = build_groups(layout, E, timeout=CHECK_TIMEOUT)
    out = {"dp": dist.get_process_group_ranks(groups.dp), "edp": dist.get_process_group_ranks(groups.edp)}
    for bucket_bytes in BUCKETS:
        model = Model(rank)
        if layout.ep > 1:
            apply_expert_parallel(model, groups)  # each ep rank keeps its expert's slice
        before, tensors = snapshot(model), layout_of(model)
        calls = recorded_call(model, groups, bucket_bytes)
        out[bucket_bytes] = {"before": before, "after": snapshot(model), "tensors": tensors, "calls": calls}
    return out


def refusals(rank: int, world: int) -> dict:
    groups = build_groups(ParallelLayout(dp=world), E, timeout=CHECK_TIMEOUT)
    res: dict = {}
    for bad in BAD:
        model = Model(rank)
        before = snapshot(model)["state"]
        res[repr(bad)] = outcome.timed_outcome(lambda: broadcast_module_state(model, groups, bucket_bytes=bad))
        after = snapshot(model)["state"]
        res[repr(bad)]["kept"] = all(torch.equal(_bits(before[n]), _bits(after[n])) for n in before)
        dist.barrier()
    # last: on code where one rank raises alone, the others wait in a collective until it times out (CHECK_TIMEOUT)
    for key, mine in (("one_rank", 0 if rank == 1 else 1024), ("differ", 1024 * (rank + 1))):
        res[key] = outcome.timed_outcome(lambda: broadcast_module_state(Model(rank), groups, bucket_bytes=mine))
        dist.barrier()
    return res


def run_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    res: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        for case, layout in CASES[world].items():
            res[case] = buckets_case(rank, layout)
        try:
            res["refusals"] = refusals(rank, world)
        except Exception:  # noqa: BLE001 - the test names it
            res["refusals"] = {"error": traceback.format_exc()}
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        res["error"] = traceback.format_exc()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


# ------------------------------------------------------------------------------------------------------------ the tests

@pytest.fixture(scope="module", params=[2, 3])
def ranks(request, tmp_path_factory) -> list[dict]:
    parallel_spawn = importlib.import_module("parallel_spawn")
    entry = importlib.import_module(Path(__file__).stem).run_rank
    start = time.monotonic()
    results = parallel_spawn.run_ranks(entry, request.param, tmp_path_factory.mktemp(f"buckets{request.param}"),
                                       DEADLINE_S)
    print(f"{request.param} ranks: {time.monotonic() - start:.1f} s")
    return results


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [n for n in a if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(_bits(a[n]),
                                                                                                     _bits(b[n]))]


def _cases(ranks: list[dict]):
    for case in CASES[len(ranks)]:
        for bucket_bytes in BUCKETS:
            yield case, bucket_bytes, [r[case][bucket_bytes] for r in ranks], [r[case] for r in ranks]


def _predicted_broadcasts(tensors: list[dict], bucket_bytes: int) -> list[tuple]:
    """Tensors in order: consecutive ones share a bucket while it holds them (each start 16-byte aligned) within
    bucket_bytes, ("bucket", bytes it holds); one larger than bucket_bytes goes alone, ("alone", its entry); 0-element
    ones send nothing."""
    sent, end = [], None  # end: bytes the open bucket holds, None when none is open
    for t in tensors:
        size = t["nbytes"]
        if size == 0:
            continue
        start = None if end is None else -(-end // ALIGN) * ALIGN
        if start is not None and start + size > bucket_bytes:
            sent.append(("bucket", end))
            start, end = None, None
        if size > bucket_bytes:
            sent.append(("alone", t))
            continue
        end = (start or 0) + size
    return sent + ([("bucket", end)] if end is not None else [])


def test_mixed_dtypes_and_layouts_arrive_bit_exact_with_small_buckets(ranks):
    for case, bucket_bytes, results, cases in _cases(ranks):
        where = (len(ranks), case, bucket_bytes)
        for r, res in enumerate(results):
            before, after = res["before"], res["after"]
            dense_src, edp_src = results[cases[r]["dp"][0]]["before"], results[cases[r]["edp"][0]]["before"]
            names = set(before["state"])
            expert = {n for n in names if n.startswith("moe.experts.")}
            dense = names - expert - set(EXCLUDE)
            assert len(dense) >= 30 and expert == {"moe.experts.frozen", "moe.experts.usage", "moe.experts.flags"}
            for names, src in ((dense, dense_src), (expert, edp_src)):
                assert _differ({n: after["state"][n] for n in names}, {n: src["state"][n] for n in names}) == [], where
            assert _differ(after["trainable"], before["trainable"]) == [], where  # left alone
            assert torch.equal(after["state"]["per_rank"], torch.full((2,), float(r))), where  # excluded
            assert after["ptr"] == before["ptr"] and after["stride"] == before["stride"], where  # written in place
            assert torch.equal(after["state"]["part"], after["state"]["whole"][1:3]), where
        # the ranks really started different (but for 0-element ones), so equal ends mean something
        empty = {n for n, t in results[0]["before"]["state"].items() if t.numel() == 0}
        for r in range(1, len(results)):
            differ = set(_differ(results[r]["before"]["state"], results[0]["before"]["state"]))
            assert differ == set(results[0]["before"]["state"]) - empty, (where, r)
        if case == "dp3_ep3":  # each rank's experts stayed its own
            kept = set(_differ(results[1]["after"]["state"], results[0]["after"]["state"]))
            assert kept == expert | {"per_rank"}, where


def test_each_broadcast_is_at_most_a_bucket_or_a_larger_tensor_in_place_and_as_many_as_packing_predicts(ranks):
    for case, bucket_bytes, results, cases in _cases(ranks):
        where = (len(ranks), case, bucket_bytes)
        for r, res in enumerate(results):
            calls, tensors = res["calls"], res["tensors"]
            assert all(c["dtype"] == "torch.uint8" and c["ranks"] in (cases[r]["dp"], cases[r]["edp"]) for c in calls)
            for c in calls:  # the bound: a bucket, or one larger tensor (its own bytes in place, or a copy of them)
                assert c["nbytes"] <= bucket_bytes or any(t["nbytes"] == c["nbytes"] > bucket_bytes for t in tensors), \
                    (where, r, c)
            # dense over dp, then experts over expert-dp (none where that group is one rank), as packing predicts
            expected = [(kind, item, g) for g in ("dp", "edp") if len(cases[r][g]) > 1
                        for kind, item in _predicted_broadcasts([t for t in tensors if t["group"] == g], bucket_bytes)]
            assert len(calls) == len(expected), (where, r, len(calls), len(expected))
            for c, (kind, item, g) in zip(calls, expected):
                assert c["ranks"] == cases[r][g], (where, r, c, g)
                if kind == "bucket":
                    assert item <= c["nbytes"] <= bucket_bytes, (where, r, c, item)
                elif item["in_place_ok"]:  # contiguous, larger than a bucket: its own bytes, no copy at all
                    assert (c["ptr"], c["nbytes"]) == (item["ptr"], item["nbytes"]), (where, r, c, item)
                else:  # transposed, expanded, a conjugate / negative view: a copy of its own
                    assert c["ptr"] != item["ptr"] and c["nbytes"] == item["nbytes"], (where, r, c, item)
        # the bound is met by packing, not by sending each tensor alone: with 1 KiB, buckets hold several tensors
        if bucket_bytes == 1024:
            dense = [t for t in results[0]["tensors"] if t["group"] == "dp" and t["nbytes"]]
            sent = [c for c in results[0]["calls"] if c["ranks"] == cases[0]["dp"]]
            assert len(sent) < len(dense) // 3, (where, len(sent), len(dense))
        if bucket_bytes == 1:  # every tensor alone, in place where it can be (0-dim and bool ones too)
            assert {"counter", "c128_scalar", "f16_scalar", "big_mask", "mask", "emb.weight"} <= {
                t["name"] for t in results[0]["tensors"] if t["in_place_ok"]}


def test_a_bad_bucket_bytes_is_refused_on_every_rank_naming_it_with_nothing_copied(ranks):
    for r, res in enumerate(ranks):
        refused = res["refusals"]
        assert "error" not in refused, refused.get("error")
        for bad in BAD:
            got = refused[repr(bad)]
            assert got["outcome"].startswith(f"ValueError: broadcast_module_state: bucket_bytes={bad!r} is not a "
                                             "positive int; expected"), (r, got)
            assert 0 <= got["seconds"] < PROMPT_S and got["kept"], (r, bad, got)


def test_a_bad_bucket_bytes_on_one_rank_or_a_different_one_per_rank_is_refused_on_every_rank_at_once(ranks):
    for r, res in enumerate(ranks):
        one, differ = res["refusals"]["one_rank"], res["refusals"]["differ"]
        if r == 1:
            assert one["outcome"].startswith("ValueError: broadcast_module_state: bucket_bytes=0 is not a positive "
                                             "int"), one
        else:
            assert one["outcome"].startswith("ValueError: broadcast_module_state: the frozen parameters and buffers: "
                                             "rank 1 refused them (ValueError: broadcast_module_state: "
                                             "bucket_bytes=0"), one
        text = differ["outcome"]
        assert "differ across ranks" in text and "bucket_bytes=1024 where rank" in text, differ
        assert "the same bucket_bytes" in differ["outcome"], differ
        assert 0 <= one["seconds"] < PROMPT_S and 0 <= differ["seconds"] < PROMPT_S, (r, one, differ)
