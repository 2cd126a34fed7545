"""Regions of a global tensor: N-D boxes and flat 1-D ranges, and how they overlap.

A rank owns a `Box` (a (offset, length) per dim, e.g. a dim-0 slice of an expert
stack) or a `FlatRange` of the row-major flattened tensor (what a ZeRO-style
optimizer owns). Every overlap question is answered on boxes: a flat range is cut
into at most 2*ndim - 1 boxes, each contiguous in row-major order, so a piece of a
flat range can be viewed as a box of the global tensor without copying.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Union


def as_index(value: object, what: str) -> int:
    """`value` as a Python int: any integer (numpy's, a 0-dim integer tensor's) but a bool; ValueError naming `what`
    otherwise (a float such as 2.5 is never truncated, which would read or write other elements without a word)."""
    try:
        number = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        number = None
    if number is None:
        raise ValueError(f"{what}={value!r}: expected an integer")
    return number


@dataclass(frozen=True)
class Box:
    """An N-D hyper-rectangle of a global tensor: dim i covers [offsets[i], offsets[i] + lengths[i])."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "offsets", tuple(as_index(o, "Box offset") for o in self.offsets))
        object.__setattr__(self, "lengths", tuple(as_index(n, "Box length") for n in self.lengths))
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"Box offsets {self.offsets} and lengths {self.lengths} differ in rank")
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.lengths):
            raise ValueError(f"Box offsets {self.offsets} / lengths {self.lengths} must be >= 0")

    @staticmethod
    def whole(shape: tuple[int, ...]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @staticmethod
    def dim0(shape: tuple[int, ...], offset: int, length: int) -> Box:
        """Rows [offset, offset + length) of dim 0, all of the other dims."""
        if len(shape) == 0:
            raise ValueError("Box.dim0 needs a tensor of rank >= 1, got a scalar shape ()")
        return Box((offset,) + (0,) * (len(shape) - 1), (length,) + tuple(shape[1:]))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.lengths

    def slices(self, origin: tuple[int, ...] | None = None) -> tuple[slice, ...]:
        """Index this box relative to `origin` (the offsets of an enclosing box)."""
        origin = origin or (0,) * len(self.offsets)
        return tuple(slice(o - g, o - g + n) for o, g, n in zip(self.offsets, origin, self.lengths))

    def to_json(self) -> dict:
        return {"box": [[o, n] for o, n in zip(self.offsets, self.lengths)]}


@dataclass(frozen=True)
class FlatRange:
    """Elements [start, start + length) of the row-major flattened global tensor."""

    start: int
    length: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", as_index(self.start, "FlatRange start"))
        object.__setattr__(self, "length", as_index(self.length, "FlatRange length"))
        if self.start < 0 or self.length < 0:
            raise ValueError(f"FlatRange(start={self.start}, length={self.length}) must be >= 0")

    @property
    def numel(self) -> int:
        return self.length

    @property
    def local_shape(self) -> tuple[int, ...]:
        return (self.length,)

    def to_json(self) -> dict:
        return {"flat": [self.start, self.length]}


Region = Union[Box, FlatRange]


def region_from_json(d: dict) -> Region:
    """A region as index.json stores it: "box": [[offset, length], ...] or "flat": [start, length], integers;
    ValueError naming it otherwise (a float or a short list is a damaged index, never rounded or guessed)."""
    def pair(x: object) -> bool:
        return isinstance(x, list) and len(x) == 2 and all(isinstance(n, int) and not isinstance(n, bool) for n in x)
    if "box" in d:
        if not (isinstance(d["box"], list) and all(pair(p) for p in d["box"])):
            raise ValueError(f"region {d!r}: 'box' is not a list of [offset, length] integer pairs")
        return Box(tuple(o for o, _ in d["box"]), tuple(n for _, n in d["box"]))
    if "flat" in d:
        if not pair(d["flat"]):
            raise ValueError(f"region {d!r}: 'flat' is not an integer pair [start, length]")
        return FlatRange(*d["flat"])
    raise ValueError(f"region {d!r} has neither 'box' nor 'flat'")


def describe(region: Region) -> str:
    if isinstance(region, FlatRange):
        return f"flat[{region.start}:{region.start + region.length}]"
    return "[" + ",".join(f"{o}:{o + n}" for o, n in zip(region.offsets, region.lengths)) + "]"


def check_region(shape: tuple[int, ...], region: Region, what: str) -> None:
    """Raise if `region` does not lie inside a tensor of global `shape`."""
    if not isinstance(region, (Box, FlatRange)):
        raise TypeError(f"{what}: region {region!r} is a {type(region).__name__}, expected a Box or a FlatRange")
    if isinstance(region, FlatRange):
        total = math.prod(shape)
        if region.start + region.length > total:
            raise ValueError(
                f"{what}: {describe(region)} exceeds numel {total} of global shape {tuple(shape)}"
            )
        return
    if len(region.offsets) != len(shape):
        raise ValueError(f"{what}: box {describe(region)} has rank {len(region.offsets)}, "
                         f"global shape {tuple(shape)} has rank {len(shape)}")
    for dim, (o, n, s) in enumerate(zip(region.offsets, region.lengths, shape)):
        if o + n > s:
            raise ValueError(f"{what}: box {describe(region)} exceeds dim {dim} of global shape {tuple(shape)}")


def intersect(a: Box, b: Box) -> Box | None:
    """The common box of `a` and `b`, or None when they share no element."""
    offs, lens = [], []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offs.append(lo)
        lens.append(hi - lo)
    return Box(tuple(offs), tuple(lens))


def contiguous_boxes(shape: tuple[int, ...], rng: FlatRange) -> list[tuple[int, Box]]:
    """Cut a flat range into boxes that are each contiguous in row-major order.

    Returns (position of the box's first element inside `rng`, box) pairs, in order;
    their numels sum to rng.length.
    """
    out: list[tuple[int, Box]] = []
    for box in _decompose(tuple(shape), rng.start, rng.start + rng.length):
        out.append((_flat_index(shape, box.offsets) - rng.start, box))
    return out


def _decompose(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    if start >= stop:
        return []
    if not shape:
        return [Box((), ())]
    inner = math.prod(shape[1:])
    out: list[Box] = []
    if start % inner:  # a partial first row
        row = start // inner
        row_stop = min(stop, (row + 1) * inner)
        out += [_prefix(row, b) for b in _decompose(shape[1:], start - row * inner, row_stop - row * inner)]
        start = row_stop
    first_row, end_row = start // inner, stop // inner
    if end_row > first_row:  # whole rows
        out.append(Box((first_row,) + (0,) * (len(shape) - 1), (end_row - first_row,) + shape[1:]))
        start = end_row * inner
    if start < stop:  # a partial last row
        row = start // inner
        out += [_prefix(row, b) for b in _decompose(shape[1:], 0, stop - row * inner)]
    return out


def _prefix(row: int, box: Box) -> Box:
    return Box((row,) + box.offsets, (1,) + box.lengths)


def _flat_index(shape: tuple[int, ...], index: tuple[int, ...]) -> int:
    flat = 0
    for i, s in zip(index, shape):
        flat = flat * s + i
    return flat


def as_boxes(shape: tuple[int, ...], region: Region) -> list[tuple[int, Box]]:
    """A region as boxes; for a flat range also the position of each inside the range."""
    if isinstance(region, Box):
        return [(0, region)]
    return contiguous_boxes(shape, region)


def even_split(n: int, rank: int, world: int) -> tuple[int, int]:
    """(offset, length) of part `rank` of `n` items split over `world` parts, the first n % world one longer."""
    n, rank, world = as_index(n, "n"), as_index(rank, "rank"), as_index(world, "world")
    if n < 0:
        raise ValueError(f"n={n}: expected a number of items >= 0")
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside [0, world={world})")
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def split_flat_buffer(numels: list[int], start: int, length: int) -> list[tuple[int, FlatRange]]:
    """Map a range of a buffer that concatenates flattened tensors onto the tensors.

    ZeRO shards one flat buffer of all parameters; this says, for the range
    [start, start + length) of that buffer, which (tensor index, FlatRange of that
    tensor) pieces it holds, in buffer order. A tensor of no elements is held (as
    FlatRange(0, 0)) by every range that reaches its position, so that one that
    saves its pieces saves every tensor.
    """
    start, length = as_index(start, "start"), as_index(length, "length")
    if start < 0 or length < 0:
        raise ValueError(f"range start={start}, length={length}: expected integers >= 0")
    out: list[tuple[int, FlatRange]] = []
    base, stop = 0, start + length
    for i, n in enumerate(numels):
        n = as_index(n, f"numels[{i}]")
        if n < 0:
            raise ValueError(f"numels[{i}]={n}: expected a number of elements >= 0")
        lo, hi = max(start, base), min(stop, base + n)
        if hi > lo or (n == 0 and start <= base <= stop):
            out.append((i, FlatRange(lo - base, max(0, hi - lo))))
        base += n
    if stop > base:
        raise ValueError(f"range [{start}, {stop}) exceeds the buffer of {base} elements")
    return out
