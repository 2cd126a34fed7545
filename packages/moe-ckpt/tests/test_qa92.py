"""QA 92: moe-ckpt's topology-agnostic checkpoints used as a library by another training stack.

Checked, every load against the global tensors saved: grids of boxes cut in several dims at once (uneven, with
pieces of size zero), flat ranges crossing rows, 0-d tensors and tensors with a zero-length dim, seven dtypes,
transposed and storage-offset sources, read back as boxes spanning four pieces, flat ranges spanning boxes, single
elements and whole tensors (with and without `out`); an async snapshot of such sources changed right after `save()`.

Found (each check below fails on moe-ckpt 0.16.1):
- index.json whose piece region was changed alone (one digit: `"flat": [0, 12]` -> `[5, 12]`) loaded without an
  error: the piece was read into the wrong place and the elements no piece covered any more came back as
  uninitialised memory (the count check saw 24 of 24). Flipping every bit of a small index.json one at a time gave
  40 such silent wrong loads; now a piece's region must match its key (a save writes name + region), 0 remain.
- a save whose pieces leave a gap named only the counts ("cover 18 of 24 elements"); it now names the first element
  no piece holds.
- an unsupported dtype (complex64, uint16) was refused without the tensor's name, at save and in a LoadRequest, and
  a global shape written `(10)` (the int 10) failed with "'int' object is not iterable".
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from ckpt_cases import bits_equal, run_ranks

from moe_ckpt import (
    AsyncCheckpointer,
    Box,
    CorruptMetadataError,
    FlatRange,
    LayoutError,
    LoadRequest,
    ShardSpec,
    even_split,
    load_checkpoint,
    open_checkpoint,
    save_checkpoint,
    step_dir,
)


def _grid(shape: tuple[int, ...], parts: tuple[int, ...]) -> list[Box]:
    """Every cell of `shape` cut into parts[d] uneven pieces along each dim d (some of size zero when parts > size)."""
    cells = [Box((), ())]
    for size, n in zip(shape, parts):
        cuts = [even_split(size, i, n) for i in range(n)]
        cells = [Box(c.offsets + (o,), c.lengths + (k,)) for c in cells for o, k in cuts]
    return cells


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(92)
    return {
        "grid.bf16": torch.randn(7, 9, generator=g).to(torch.bfloat16),
        "grid3.fp16": torch.randn(5, 4, 6, generator=g).to(torch.float16),
        "cols.fp64": torch.randn(6, 5, generator=g, dtype=torch.float64),
        "flat.i64": torch.randint(-2**40, 2**40, (3, 5), generator=g),
        "flat.bool": torch.randint(0, 2, (3, 5), generator=g).bool(),
        "rows.u8": torch.randint(0, 256, (4, 4), generator=g).to(torch.uint8),
        "scalar": torch.randn((), generator=g),
        "empty": torch.zeros(3, 0, 2),
    }


def _shards(state: dict[str, torch.Tensor], rank: int, world: int) -> list[ShardSpec]:
    out = []
    for name, t in state.items():
        shape = tuple(t.shape)
        if name.startswith("flat."):  # flat ranges crossing rows, one of them empty
            start, n = [(0, 4), (4, 0), (4, 9), (13, 2)][rank]
            src = torch.cat([t.new_zeros(3), t.reshape(-1)])[3 + start : 3 + start + n]  # a storage offset
            out.append(ShardSpec(name, shape, src, FlatRange(start, n)))
        elif name in ("scalar", "empty"):
            out.append(ShardSpec(name, shape, t, writer=rank == world - 1))
        else:
            parts = {"grid.bf16": (3, 4), "grid3.fp16": (2, 3, 2), "cols.fp64": (1, 6), "rows.u8": (5, 1)}[name]
            src = t.t().contiguous().t() if name == "cols.fp64" else t  # a transposed (non-contiguous) view
            out += [ShardSpec(name, shape, src[b.slices()], b) for i, b in enumerate(_grid(shape, parts))
                    if i % world == rank]
    return out


def _expected(t: torch.Tensor, region) -> torch.Tensor:
    if region is None:
        return t
    if isinstance(region, FlatRange):
        return t.reshape(-1)[region.start : region.start + region.length]
    return t[region.slices()]


def _regions(shape: tuple[int, ...]) -> list:
    numel = 1
    for s in shape:
        numel *= s
    out = [None, FlatRange(0, numel), FlatRange(numel // 3, max(0, numel - numel // 3 - 1)), FlatRange(numel // 2, 0)]
    if numel:
        out.append(FlatRange(numel - 1, 1))
    if len(shape) >= 2 and numel:  # a box across the middle of the grid (four pieces and more), a single element
        out += [Box(tuple(s // 4 for s in shape), tuple(s - s // 4 - s // 4 for s in shape)),
                Box(tuple(s - 1 for s in shape), (1,) * len(shape)),
                Box((shape[0] // 2,) + (0,) * (len(shape) - 1), (0,) + tuple(shape[1:]))]
    return out


def test_grids_of_boxes_flat_ranges_and_odd_sources_read_back_in_any_layout_bit_exact(tmp_path):
    state = _state()
    ck = step_dir(tmp_path, 1)
    run_ranks(4, lambda r, bar: save_checkpoint(ck, _shards(state, r, 4), {"step": 1}, r, 4, bar))
    assert all(bits_equal(load_checkpoint(ck)[n], t) for n, t in state.items())
    with open_checkpoint(ck) as ckpt:
        for name, t in state.items():
            for region in _regions(tuple(t.shape)):
                want = _expected(t, region)
                got = ckpt.read([LoadRequest(name, tuple(t.shape), t.dtype, region)])[name]
                assert bits_equal(got, want), (name, region)
                out = torch.full_like(want, 1) if want.dtype != torch.bool else torch.ones_like(want)
                ckpt.read([LoadRequest(name, tuple(t.shape), t.dtype, region, out=out)])
                assert bits_equal(out, want), (name, region, "out")


def test_an_async_snapshot_of_strided_sources_is_taken_before_save_returns(tmp_path):
    base, buffer = torch.randn(6, 8), torch.randn(40)
    rows, flat, step = base.t()[1:5], buffer[3:27], torch.tensor(7)
    want = {"rows": rows.clone(), "flat": flat.clone(), "step": step.clone()}
    with AsyncCheckpointer() as ck:
        ck.save(step_dir(tmp_path, 1), [ShardSpec("rows", (4, 6), rows), ShardSpec("flat", (24,), flat, FlatRange(0, 24)),
                                        ShardSpec("step", (), step)])
        base.add_(1), buffer.zero_(), step.fill_(0)  # the training step that follows
    got = load_checkpoint(tmp_path)
    assert all(bits_equal(got[n], t) for n, t in want.items())


def _two_rank_checkpoint(path):
    t = torch.arange(24.0).reshape(4, 6)

    def shards(r: int) -> list[ShardSpec]:
        return [ShardSpec("w", (4, 6), t[2 * r : 2 * r + 2], Box.dim0((4, 6), 2 * r, 2)),
                ShardSpec("m", (4, 6), t.reshape(-1)[12 * r : 12 * r + 12], FlatRange(12 * r, 12))]

    run_ranks(2, lambda r, bar: save_checkpoint(path, shards(r), None, r, 2, bar))
    return t


@pytest.mark.parametrize(("tensor", "region", "key"), [
    ("m", {"flat": [5, 12]}, "mflat[0:12]"),  # read as flat[5:17]: [0:5] uninitialised, [12:17] written twice
    ("w", {"box": [[1, 2], [0, 6]]}, "w[0:2,0:6]"),  # rows 0:2 read into rows 1:3, row 0 uninitialised
])
def test_a_piece_region_edited_alone_in_index_json_is_refused_not_read_into_the_wrong_place(tmp_path, tensor, region,
                                                                                              key):
    ck = step_dir(tmp_path, 1)
    _two_rank_checkpoint(ck)
    index = json.loads((ck / "index.json").read_text())
    piece = index["tensors"][tensor]["pieces"][0]
    piece.pop("box", None), piece.pop("flat", None), piece.update(region)
    (ck / "index.json").write_text(json.dumps(index))
    with pytest.raises(CorruptMetadataError, match=rf"index.json is damaged \(ValueError: tensor '{tensor}': piece "
                                                   rf"{re.escape(repr(key))} has region"):
        load_checkpoint(ck, [LoadRequest(tensor)])


def test_a_gap_in_a_grid_of_boxes_names_the_first_element_no_piece_holds(tmp_path):
    t = torch.randn(4, 6)
    cells = _grid((4, 6), (2, 2))  # rows [0:2] [2:4] x cols [0:3] [3:6]; rank 1 forgets the cell [2:4, 3:6]

    def shards(r: int) -> list[ShardSpec]:
        return [ShardSpec("w", (4, 6), t[b.slices()], b) for b in cells[r::2] if b != cells[3]]

    # rank 0 raises the LayoutError, rank 1 a CheckpointError quoting it: run_ranks raises whichever came first
    with pytest.raises(Exception, match=r"tensor 'w' of shape \(4, 6\): saved pieces cover 18 of 24 "
                                        r"elements \(none holds element \[2, 3\], the first left out\)"):
        run_ranks(2, lambda r, bar: save_checkpoint(step_dir(tmp_path, 1), shards(r), None, r, 2, bar))
    assert list(tmp_path.iterdir()) == []
    flat = [ShardSpec("f", (3, 4), t.reshape(-1)[:5], FlatRange(0, 5)), ShardSpec("f", (3, 4), t.reshape(-1)[7:12],
                                                                                  FlatRange(7, 5))]
    with pytest.raises(LayoutError, match=r"cover 10 of 12 elements \(none holds element \[1, 1\]"):
        save_checkpoint(step_dir(tmp_path, 1), flat)


@pytest.mark.parametrize(("make", "message"), [
    (lambda: ShardSpec("layers.3.w", (3,), torch.zeros(3, dtype=torch.complex64)),
     r"tensor 'layers.3.w': dtype torch.complex64 is not supported"),
    (lambda: ShardSpec("layers.3.w", (3,), torch.zeros(3, dtype=torch.uint16)),
     r"tensor 'layers.3.w': dtype torch.uint16 is not supported"),
    (lambda: ShardSpec("layers.3.b", (10), torch.zeros(10)),
     r"tensor 'layers.3.b': global shape 10 is a int, expected a tuple of integers such as \(10,\)"),
])
def test_an_unsupported_dtype_or_a_shape_that_is_an_int_is_refused_naming_the_tensor(make, message):
    with pytest.raises(TypeError, match=message):
        make()


def test_a_request_with_an_unsupported_dtype_names_the_tensor(tmp_path):
    ck = save_checkpoint(step_dir(tmp_path, 1), [ShardSpec("w", (2,), torch.zeros(2))])
    with pytest.raises(TypeError, match=r"request for tensor 'w': dtype torch.complex64 is not supported"):
        load_checkpoint(ck, [LoadRequest("w", dtype=torch.complex64)])
    with pytest.raises(TypeError, match=r"request for tensor 'w': global shape 2 is a int, expected a tuple"):
        load_checkpoint(ck, [LoadRequest("w", global_shape=2)])  # `(2)` is the int 2: it raised a bare TypeError


def test_a_shard_spec_changed_after_construction_is_refused_at_save_not_committed(tmp_path):
    """Follow-up of QA 92: ShardSpec checked its fields only when built; .tensor swapped for one of another shape
    afterwards was committed, and every load of the checkpoint then failed (CorruptShardError)."""
    spec = ShardSpec("w", (4, 6), torch.zeros(2, 6), Box((0, 0), (2, 6)), writer=True)
    rest = ShardSpec("w", (4, 6), torch.ones(2, 6), Box((2, 0), (2, 6)))
    spec.tensor = torch.zeros(4, 6)
    with pytest.raises(ValueError, match=r"tensor 'w': local data has shape \(4, 6\), its box"):
        save_checkpoint(step_dir(tmp_path, 1), [spec, rest])
    assert list(tmp_path.iterdir()) == []  # nothing committed, no tmp folder left


def test_one_ranks_own_overlapping_pieces_are_named_as_such(tmp_path):
    """Follow-up of QA 92: a rank whose box and flat range overlap was told 'a replicated tensor needs exactly one
    writer=True', which is no remedy for one rank's sharding mistake."""
    t = torch.randn(4, 6)
    specs = [ShardSpec("w", (4, 6), t[0:2], Box((0, 0), (2, 6))),
             ShardSpec("w", (4, 6), t.reshape(-1)[6:24], FlatRange(6, 18))]
    with pytest.raises(LayoutError, match=r"rank 0 piece .* and rank 0 piece .* overlap; expected one rank's pieces"):
        save_checkpoint(step_dir(tmp_path, 1), specs)
    assert list(tmp_path.iterdir()) == []  # refused at the commit: nothing committed, no tmp folder left
