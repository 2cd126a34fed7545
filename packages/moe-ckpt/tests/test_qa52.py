"""QA pass 52: topology-agnostic checkpoints under random layouts; regions and shapes that are not integers refused
instead of truncated or committed unreadable; zero-size tensors of a ZeRO flat buffer saved; an async save whose
snapshot fails on one rank fails on every rank instead of leaving the others at a barrier."""

from __future__ import annotations

import itertools
import math
import os
import random
import re
import threading
import time

import numpy as np
import pytest
import torch
from ckpt_cases import run_ranks

from moe_ckpt import (
    AsyncCheckpointer, Box, FlatRange, LoadRequest, ShardSpec, even_split, find_latest,
    list_checkpoints, load_checkpoint, open_checkpoint, save_checkpoint, split_flat_buffer, step_dir,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.bool, torch.uint8]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t` in row-major order, whatever its strides (NaN == NaN, -0.0 != 0.0)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _random_tensor(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random bytes reinterpreted: NaNs, infinities, -0.0 and subnormals included."""
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return (raw % 2).bool().reshape(shape) if dtype == torch.bool else raw.view(dtype).reshape(shape)


def _cuts(rng: random.Random, n: int, parts: int) -> list[tuple[int, int]]:
    """`n` split into `parts` (offset, length) runs of random (possibly zero) lengths."""
    b = [0, *sorted(rng.randint(0, n) for _ in range(parts - 1)), n]
    return [(b[i], b[i + 1] - b[i]) for i in range(parts)]


def _save_layout(rng: random.Random, tensors: dict[str, torch.Tensor], world: int) -> list[list[ShardSpec]]:
    """Each rank's pieces: a ZeRO flat buffer over some tensors (ranges cutting through them, zero-size tensors
    included), the others replicated with one writer, split along a random dim, or cut into a grid of boxes."""
    per: list[list[ShardSpec]] = [[] for _ in range(world)]
    flat = [n for n in tensors if rng.random() < 0.35]
    numels = [tensors[n].numel() for n in flat]
    for r, (start, length) in enumerate(_cuts(rng, sum(numels), world)):
        for i, rng_i in split_flat_buffer(numels, start, length):
            t = tensors[flat[i]]
            local = t.reshape(-1)[rng_i.start : rng_i.start + rng_i.length]
            if local.numel() % 2 == 0 and local.numel() and rng.random() < 0.3:
                local = local.reshape(2, -1)  # any shape with the range's element count
            per[r].append(ShardSpec(flat[i], tuple(t.shape), local, rng_i))
    for name, t in tensors.items():
        if name in flat:
            continue
        shape = tuple(t.shape)
        mode = rng.choice(["replicated", "split", "grid"]) if shape else "replicated"
        if mode == "replicated":
            writer = rng.randrange(world)
            for r in range(world):
                per[r].append(ShardSpec(name, shape, t, writer=r == writer))
        else:
            dims = rng.sample(range(len(shape)), 1 if mode == "split" else min(2, len(shape)))
            cells = itertools.product(*[_cuts(rng, shape[d], world if mode == "split" else rng.randint(1, 3))
                                        for d in dims])
            for k, cell in enumerate(cells):
                offs, lens = [0] * len(shape), list(shape)
                for d, (o, n) in zip(dims, cell):
                    offs[d], lens[d] = o, n
                box = Box(tuple(offs), tuple(lens))
                local = t[box.slices()]
                if local.dim() >= 2 and rng.random() < 0.3:  # column-major local data
                    local = local.transpose(0, -1).contiguous().transpose(0, -1)
                r = k if mode == "split" else rng.randrange(world)
                if any(s.name == name and s.region == box for s in per[r]):
                    continue  # the same empty box twice on one rank
                per[r].append(ShardSpec(name, shape, local, box))
    for p in per:
        rng.shuffle(p)
    return per


def _random_request(rng: random.Random, name: str, t: torch.Tensor) -> tuple[LoadRequest, torch.Tensor]:
    shape = tuple(t.shape)
    mode = rng.choice(["none", "whole", "flat", "box", "dim0"]) if shape else rng.choice(["none", "whole"])
    if mode in ("none", "whole"):
        region, want = (None if mode == "none" else Box.whole(shape)), t
    elif mode == "flat":
        a = rng.randint(0, t.numel())
        b = rng.randint(a, t.numel())
        region, want = FlatRange(a, b - a), t.reshape(-1)[a:b]
    else:
        offs, lens = [], []
        for d, s in enumerate(shape):
            a, b = (0, s) if mode == "dim0" and d else sorted((rng.randint(0, s), rng.randint(0, s)))
            offs.append(a), lens.append(b - a)
        region = Box(tuple(offs), tuple(lens))
        want = t[region.slices()]
    out, local = None, tuple(want.shape)
    if rng.random() < 0.4:
        kind = rng.choice(["plain", "transposed", "every_other"])
        if kind == "transposed" and len(local) >= 2:
            out = torch.zeros(local[::-1], dtype=t.dtype).permute(*reversed(range(len(local))))
        elif kind == "every_other" and want.numel():
            out = torch.zeros(2 * want.numel(), dtype=t.dtype)[::2].reshape(local)
        else:
            out = torch.zeros(local, dtype=t.dtype)
    return LoadRequest(name, shape if rng.random() < 0.5 else None, t.dtype if rng.random() < 0.5 else None,
                       region, out), want


def _one_case(seed: int, root) -> None:
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(rng.randint(1, 6)):
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7]) if rng.random() < 0.2 else rng.randint(1, 7)
                      for _ in range(rng.randint(0, 4)))
        tensors[f"t{i}.{rng.choice(['w', 'b', 'x/y', 'ü'])}"] = _random_tensor(g, shape, rng.choice(DTYPES))
    world = rng.randint(1, 5)
    per = _save_layout(rng, tensors, world)
    path = step_dir(root, seed)
    run_ranks(world, lambda r, bar: save_checkpoint(path, per[r], {"seed": seed}, r, world, bar))
    for _ in range(3):  # three loads under other layouts
        wants = {n: _random_request(rng, n, t) for n, t in tensors.items() if rng.random() < 0.8}
        reqs = [req for req, _ in wants.values()]
        if rng.random() < 0.5:
            got = load_checkpoint(path, reqs, verify=rng.random() < 0.5)
        else:
            with open_checkpoint(path) as ckpt:
                got = ckpt.read(reqs)
        for name, (req, want) in wants.items():
            assert req.out is None or got[name] is req.out, (seed, name)
            assert _same(got[name], want), (seed, name, req.region, tuple(tensors[name].shape), want.dtype)


def test_random_layouts_save_and_load_every_element_bit_exact(tmp_path, monkeypatch):
    """120 seeded cases: 0-D to 4-D tensors (dims of 0 and 1, odd sizes, random bytes of 7 dtypes) saved by 1-5
    simulated ranks in mixed layouts (a ZeRO flat buffer cut anywhere through its tensors, replicated with one writer,
    split along any dim, grids of boxes) and read back three times under other layouts (flat ranges, boxes in any
    dims, whole, `out=` buffers with odd strides). Before, a zero-size tensor inside the flat buffer was left out of
    the checkpoint (split_flat_buffer gave no rank a piece of it), and reading it raised TensorNotFoundError."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability is not what this checks; the files are real
    monkeypatch.setattr(os, "fdatasync", lambda fd: None)
    for seed in range(120):
        _one_case(seed, tmp_path)


def test_a_zero_size_tensor_in_a_flat_buffer_is_saved_by_the_ranks_whose_range_reaches_it(tmp_path):
    """ZeRO over [w (2, 3), empty (0, 4), b (5,)] on 3 ranks, as the README shows: each rank saves what
    split_flat_buffer gives it. Before, `empty` was in no rank's list, the save committed without it, and a resume
    that reads every parameter failed with TensorNotFoundError."""
    state = {"w": torch.randn(2, 3), "empty": torch.zeros(0, 4), "b": torch.randn(5)}
    names, numels = list(state), [t.numel() for t in state.values()]
    assert split_flat_buffer(numels, 4, 4) == [(0, FlatRange(4, 2)), (1, FlatRange(0, 0)), (2, FlatRange(0, 2))]

    def shards(rank: int) -> list[ShardSpec]:
        start, length = even_split(sum(numels), rank, 3)
        return [ShardSpec(names[i], tuple(state[names[i]].shape),
                          state[names[i]].reshape(-1)[part.start : part.start + part.length], part)
                for i, part in split_flat_buffer(numels, start, length)]

    run_ranks(3, lambda r, bar: save_checkpoint(step_dir(tmp_path, 1), shards(r), None, r, 3, bar))
    got = load_checkpoint(tmp_path, [LoadRequest(n, tuple(t.shape), t.dtype) for n, t in state.items()])
    assert all(_same(got[n], t) for n, t in state.items())


@pytest.mark.parametrize(("call", "message"), [
    (lambda: split_flat_buffer([4, 4], -2, 4), r"start=-2, length=4: expected integers >= 0"),  # read as [0, 2)
    (lambda: split_flat_buffer([4, 4], 2, -1), r"start=2, length=-1: expected integers >= 0"),  # was []
    (lambda: split_flat_buffer([4, -2, 4], 0, 6), r"numels\[1\]=-2: expected a number of elements >= 0"),
    (lambda: split_flat_buffer([4, 4], 1.5, 2), r"start=1.5: expected an integer"),  # was FlatRange(1.5, 2.0)
    (lambda: even_split(-5, 0, 2), r"n=-5: expected a number of items >= 0"),  # was (0, -2)
    (lambda: even_split(5.0, 0, 2), r"n=5.0: expected an integer"),  # was (0.0, 3.0)
])
def test_split_helpers_refuse_negative_and_non_integer_values(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Box((1.5,), (2,)), r"Box offset=1.5: expected an integer"),  # was Box((1,), (2,)): other rows read
    (lambda: Box((0, 0), (2.7, 3)), r"Box length=2.7: expected an integer"),
    (lambda: Box((True,), (2,)), r"Box offset=True: expected an integer"),
    (lambda: FlatRange(1.5, 2), r"FlatRange start=1.5: expected an integer"),  # was kept: a raw TypeError on read
    (lambda: FlatRange(0.0, 4), r"FlatRange start=0.0: expected an integer"),  # written as 0.0: unreadable index
    (lambda: FlatRange(0, True), r"FlatRange length=True: expected an integer"),
    (lambda: FlatRange("1", 2), r"FlatRange start='1': expected an integer"),  # was a raw TypeError ('<')
])
def test_regions_refuse_values_that_are_not_integers(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_integer_regions_of_numpy_or_torch_ints_save_and_load(tmp_path):
    """Before, FlatRange kept a numpy / 0-dim tensor integer as it was: the save failed writing the manifest
    ("Object of type int64 is not JSON serializable") after every shard file was written."""
    t = torch.arange(12.0)
    half = np.int64(6)
    shards = [ShardSpec("m", (12,), t[:6], FlatRange(np.int64(0), half)),
              ShardSpec("m", (12,), t[6:], FlatRange(torch.tensor(6), torch.tensor(6)))]
    assert type(shards[0].region.start) is int and type(shards[1].region.length) is int
    save_checkpoint(step_dir(tmp_path, 1), shards)
    got = load_checkpoint(tmp_path, [LoadRequest("m", region=FlatRange(np.int32(3), np.int64(5)))])["m"]
    assert _same(got, t[3:8])


@pytest.mark.parametrize(("shape", "region", "message"), [
    ((-2, -2), FlatRange(0, 4), r"tensor 'w': global shape \(-2, -2\) has a negative dim"),  # committed unreadable
    ((2.5, 2), None, r"tensor 'w': global shape dim=2.5: expected an integer"),  # was truncated to (2, 2)
])
def test_a_global_shape_that_is_not_non_negative_integers_is_refused(tmp_path, shape, region, message):
    """Before, (-2, -2) with a flat range passed every check (its numel is 4): the save committed a checkpoint,
    became `latest`, and every read of it failed ("index.json is damaged ... shape [-2, -2]")."""
    data = torch.zeros(4) if region is not None else torch.zeros(2, 2)
    with pytest.raises(ValueError, match=message):
        ShardSpec("w", shape, data, region)


@pytest.mark.parametrize(("name", "error", "message"), [
    (5, TypeError, r"tensor name 5 is a int, expected a str"),  # "5" in index.json; with "a" beside it, a raw
    ("w\udc80", ValueError, r"tensor name 'w\\udc80' is not valid Unicode"),  # committed; safetensors can't read it
])
def test_a_tensor_name_that_is_not_a_utf8_string_is_refused(name, error, message):
    with pytest.raises(error, match=message):
        ShardSpec(name, (2,), torch.zeros(2))


def test_names_with_slashes_dots_unicode_and_length_round_trip(tmp_path):
    t = torch.randn(3, 2)
    names = ["a/../b.c", "/abs", "ü∑😀", "", "x" * 20_000, "with space\nnewline", "x[0:3,0:2]"]
    save_checkpoint(step_dir(tmp_path, 1), [ShardSpec(n, (3, 2), t + i) for i, n in enumerate(names)])
    got = load_checkpoint(tmp_path)
    assert sorted(got) == sorted(names) and all(_same(got[n], t + i) for i, n in enumerate(names))


def test_two_tensors_whose_pieces_would_share_a_key_are_named_not_called_a_duplicate(tmp_path):
    """Before: "piece 'xflat[0:2]' is listed twice", naming neither tensor."""
    t = torch.arange(4.0)
    with pytest.raises(ValueError, match=r"tensors 'xflat' and 'x' would both be stored under key 'xflat\[0:2\]'"):
        save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("xflat", (2,), t[:2]), ShardSpec("x", (2,), t[2:],
                                                                                              FlatRange(0, 2))])
    assert list(tmp_path.iterdir()) == []


def test_a_region_that_is_not_a_box_or_flat_range_is_refused_naming_it(tmp_path):
    """Before, a tuple of (offset, length) pairs raised a bare AttributeError ('tuple' object has no attribute
    'offsets'), at save and at load."""
    save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (4,), torch.ones(4))])
    with pytest.raises(TypeError, match=r"request for tensor 'w': region \(\(0, 2\),\) is a tuple, expected a Box"):
        load_checkpoint(tmp_path, [LoadRequest("w", region=((0, 2),))])
    with pytest.raises(TypeError, match=r"tensor 'w': region \(\(0, 2\),\) is a tuple, expected a Box"):
        ShardSpec("w", (4,), torch.ones(2), ((0, 2),))


@pytest.mark.parametrize(("metadata", "message"), [
    ([1, 2], r"metadata is a list, expected a dict"),  # was "cannot convert dictionary update sequence ..."
    ({"opt": object()}, r"metadata is not JSON-serialisable: Object of type object"),
])
def test_metadata_that_is_not_a_json_object_is_refused_on_every_rank_before_any_shard_is_written(tmp_path, metadata,
                                                                                                  message, monkeypatch):
    """Rank 0's metadata (the one written; the others pass None). Before, a list failed at the commit, after every
    shard file was written, with "cannot convert dictionary update sequence element #0 to a sequence"; and a dict
    that is not JSON made rank 0 fail before creating the save's folder, so rank 1 raised "step-00000001.tmp is not
    a folder; rank 0 failed to create it (or the ranks do not share a file system)", without the cause."""
    import moe_ckpt.save

    real, written = moe_ckpt.save.write_shard_file, []
    monkeypatch.setattr(moe_ckpt.save, "write_shard_file", lambda path, *a: written.append(path) or real(path, *a))

    def save(r, bar):
        try:
            save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (4,), torch.ones(2), Box.dim0((4,), 2 * r, 2))],
                            metadata if r == 0 else None, r, 2, bar)
        except Exception as e:  # noqa: BLE001 - compared across ranks
            return f"{type(e).__name__}: {e}"

    got = run_ranks(2, save)
    assert got[0].startswith("TypeError") and all(re.search(message, g) for g in got), got
    assert written == [] and list(tmp_path.iterdir()) == []


def _async_outcomes(tmp_path, shards_of, metadata_of, timeout: float = 6.0) -> tuple[list[str], float]:
    """Two ranks (threads) each save through an AsyncCheckpointer and wait; each one's 'ok' or error, and the
    seconds the slowest took. The barrier times out after `timeout` s (a process group's timeout, scaled down)."""
    bar = threading.Barrier(2, timeout=timeout)
    got: list[str] = ["", ""]
    t0 = time.perf_counter()

    def body(r: int) -> None:
        ck = AsyncCheckpointer()
        try:
            ck.save(step_dir(tmp_path, 2), shards_of(r), metadata_of(r), r, 2, bar.wait)
            ck.wait()
            got[r] = "ok"
        except Exception as e:  # noqa: BLE001 - compared across ranks
            got[r] = f"{type(e).__name__}: {e}"

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got, time.perf_counter() - t0


@pytest.mark.parametrize("what", ["tensor", "metadata"])
def test_an_async_snapshot_that_fails_on_one_rank_fails_the_save_on_every_rank_at_once(tmp_path, what):
    """Rank 1's snapshot fails (a tensor that cannot be copied: here a meta tensor; a host allocation that fails
    is the real-world case), or rank 0's metadata is not JSON while the other ranks pass None. Before, that rank
    raised from save() at once and never reached the save's barriers: the other rank's background save waited
    there for the barrier group's timeout (here 6 s, in training minutes) and failed with a bare timeout."""
    save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (4,), torch.zeros(4))])
    bad = 1 if what == "tensor" else 0

    def shards_of(r):
        data = torch.empty(2, device="meta") if (what == "tensor" and r == bad) else torch.ones(2)
        return [ShardSpec("w", (4,), data, Box.dim0((4,), 2 * r, 2))]

    def metadata_of(r):
        return {"step": 2, "sched": object()} if (what == "metadata" and r == bad) else None

    got, seconds = _async_outcomes(tmp_path, shards_of, metadata_of)
    cause = "meta tensor" if what == "tensor" else "not JSON serializable"
    assert seconds < 4 and all(cause in g for g in got), (seconds, got)
    assert got[1 - bad].startswith("CheckpointError") and f"rank-{bad:05d}" in got[1 - bad], got
    assert list_checkpoints(tmp_path) == [step_dir(tmp_path, 1)] == [find_latest(tmp_path)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]  # no tmp folder left


def test_an_async_save_whose_shard_write_fails_on_one_rank_is_never_listed(tmp_path, monkeypatch):
    """The write itself fails on rank 1 (a full disk half-way through its file): both ranks raise at wait(), the
    half-written folder is removed, `latest` and the listing keep the previous checkpoint throughout."""
    import moe_ckpt.save

    save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (4,), torch.zeros(4))])
    real, seen = moe_ckpt.save.write_shard_file, []

    def full_disk(path, entries, metadata, algorithm):
        if "shard-00001" not in path.name:
            return real(path, entries, metadata, algorithm)
        path.write_bytes(b"\0" * 10)
        seen.append((list_checkpoints(tmp_path), find_latest(tmp_path)))
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(moe_ckpt.save, "write_shard_file", full_disk)
    got, _ = _async_outcomes(tmp_path, lambda r: [ShardSpec("w", (4,), torch.ones(2), Box.dim0((4,), 2 * r, 2))],
                             lambda r: {"step": 2})
    assert all("No space left on device" in g for g in got), got
    assert seen == [([step_dir(tmp_path, 1)], step_dir(tmp_path, 1))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    assert (tmp_path / "latest").read_text() == "step-00000001\n"
    assert _same(load_checkpoint(tmp_path)["w"], torch.zeros(4))
