"""index.json: which file holds which piece of which global tensor; built by rank 0 from per-rank manifests."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from moe_ckpt.errors import CorruptMetadataError, IncompleteCheckpointError, LayoutError, UnsupportedFormatVersionError
from moe_ckpt.geometry import Box, Region, as_boxes, check_region, describe, intersect, region_from_json
from moe_ckpt.run_dir import INDEX, TMP_MARK, tmp_dir_for
from moe_ckpt.shard_file import Checksum, naming
from moe_ckpt.spec import DTYPE_NAMES

FORMAT = "moe-ckpt"
# The checkpoint format version: index.json's "version", the one place it is recorded. Bump it when a reader
# of the previous version would misread a new checkpoint; a field that older readers can ignore does not
# need a bump. moe-ckpt <= 0.5.0 wrote 1 (an index.json without the field is read as 1 too).
FORMAT_VERSION = 1
VERSION_KEY = "version"
# index.json's record of metadata.json's size and checksum (checksum_algorithm's): {"bytes", "checksum"}. An index.json
# without it (saved by an earlier moe-ckpt) leaves metadata.json unchecked; older readers ignore it: no version bump.
METADATA_RECORD_KEY = "metadata_file"


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.safetensors"


def manifest_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.manifest.json"


@dataclass
class Piece:
    file: str
    key: str
    region: Region


@dataclass
class TensorEntry:
    shape: tuple[int, ...]
    dtype: str
    pieces: list[Piece]


@dataclass
class Index:
    world_size: int
    checksum_algorithm: str
    files: dict[str, dict]  # file name -> {"rank", "bytes", "checksum"}
    tensors: dict[str, TensorEntry]
    format_version: int = FORMAT_VERSION
    metadata_file: dict | None = None  # metadata.json's {"bytes", "checksum"}; None: a save that recorded none

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            VERSION_KEY: self.format_version,
            "world_size": self.world_size,
            "checksum_algorithm": self.checksum_algorithm,
            "files": self.files,
            **({METADATA_RECORD_KEY: self.metadata_file} if self.metadata_file is not None else {}),
            "tensors": {
                name: {"shape": list(t.shape), "dtype": t.dtype,
                       "pieces": [{"file": p.file, "key": p.key, **p.region.to_json()} for p in t.pieces]}
                for name, t in self.tensors.items()
            },
        }

    @staticmethod
    def from_json(d: dict, format_version: int = FORMAT_VERSION) -> Index:
        """Parse and check the rest of index.json (after `check_format`): ValueError naming the entry that is
        not what a save writes."""
        world, algorithm, files, tensors = (d.get(k) for k in ("world_size", "checksum_algorithm", "files", "tensors"))
        _need(_is_int(world) and world >= 1, f"world_size={world!r}, expected an integer >= 1")
        _need(algorithm in Checksum.ALGORITHMS,
              f"checksum_algorithm={algorithm!r}, expected one of {Checksum.ALGORITHMS}")
        _need(isinstance(files, dict), f"'files' is {type(files).__name__}, expected an object")
        for fname, rec in files.items():
            _need(fname not in ("", ".", "..") and "/" not in fname and "\\" not in fname,
                  f"file name {fname!r} is not a plain file name inside the checkpoint folder")
            _need(isinstance(rec, dict) and _is_int(rec.get("rank")) and _is_int(rec.get("bytes"))
                  and rec["bytes"] >= 0 and isinstance(rec.get("checksum"), str),
                  f"file {fname!r}: record {rec!r}, expected {{'rank': int, 'bytes': int >= 0, 'checksum': str}}")
        ranks = sorted(rec["rank"] for rec in files.values())
        _need(ranks == list(range(world)), f"'files' holds shard files of ranks {ranks}, expected one per rank "
                                           f"0..{world - 1} (world_size={world})")
        _need(isinstance(tensors, dict), f"'tensors' is {type(tensors).__name__}, expected an object")
        meta = d.get(METADATA_RECORD_KEY)
        _need(METADATA_RECORD_KEY not in d or (isinstance(meta, dict) and _is_int(meta.get("bytes"))
                                               and meta["bytes"] >= 0 and isinstance(meta.get("checksum"), str)),
              f"{METADATA_RECORD_KEY!r} is {json.dumps(meta)}, expected {{'bytes': int >= 0, 'checksum': str}} "
              "(metadata.json's size and checksum)")
        return Index(world, algorithm, files, {name: _entry(name, t, files) for name, t in tensors.items()},
                     format_version, meta)


def check_format(d: object, where: Path) -> int:
    """index.json's format version, checked before anything else in it: a newer format may lay out the
    rest differently, so its reader is refused with the version rather than with a misreading."""
    if not isinstance(d, dict):
        raise CorruptMetadataError(f"{where} holds a JSON {type(d).__name__}, expected an object; "
                                   "the checkpoint cannot be read")
    if d.get("format") != FORMAT:
        raise CorruptMetadataError(f"{where}: field 'format' is {d.get('format')!r}, expected {FORMAT!r}; "
                                   "not a moe-ckpt index")
    if VERSION_KEY not in d:
        return 1  # moe-ckpt <= 0.5.0's layout
    version = d[VERSION_KEY]
    if not _is_int(version) or version < 1:
        raise CorruptMetadataError(f"{where}: field {VERSION_KEY!r} (the checkpoint format version) is "
                                   f"{json.dumps(version)}, expected an integer >= 1")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatVersionError(where.parent, version, FORMAT_VERSION)
    return version


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(what)


def _entry(name: str, t: object, files: dict[str, dict]) -> TensorEntry:
    _need(isinstance(t, dict) and isinstance(t.get("pieces"), list), f"tensor {name!r}: {t!r} has no list of pieces")
    shape, dtype = t.get("shape"), t.get("dtype")
    _need(isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape),
          f"tensor {name!r}: shape {shape!r}, expected a list of integers >= 0")
    _need(dtype in DTYPE_NAMES, f"tensor {name!r}: dtype {dtype!r}, expected one of {sorted(DTYPE_NAMES)}")
    pieces = []
    for p in t["pieces"]:
        _need(isinstance(p, dict) and p.get("file") in files and isinstance(p.get("key"), str),
              f"tensor {name!r}: piece {p!r} does not name a key and a file listed in 'files'")
        region = region_from_json(p)
        check_region(tuple(shape), region, f"tensor {name!r}: piece {p['key']!r}")
        # A save keys each piece by its tensor and region: a region edited alone (one changed digit) would pass the
        # shard header check (same key, same length) and read the piece into the wrong place of the tensor.
        _need(p["key"] == f"{name}{describe(region)}",
              f"tensor {name!r}: piece {p['key']!r} has region {describe(region)}; a save keys it "
              f"{name + describe(region)!r}")
        pieces.append(Piece(p["file"], p["key"], region))
    return TensorEntry(tuple(shape), dtype, pieces)


def read_index(path: Path) -> Index:
    """Read path/index.json; raise IncompleteCheckpointError for a partial or non-checkpoint directory."""
    if TMP_MARK in path.name:
        raise IncompleteCheckpointError(f"{path} is a partial checkpoint (name contains {TMP_MARK!r}); "
                                        f"it was never committed")
    try:
        with naming(path / INDEX), open(path / INDEX) as f:  # a failing read names no file of its own
            d = json.load(f)
        version = check_format(d, path / INDEX)
        return Index.from_json(d, version)
    except FileNotFoundError:
        raise IncompleteCheckpointError(_not_committed(path)) from None
    except (IsADirectoryError, NotADirectoryError) as e:
        raise CorruptMetadataError(f"{path / INDEX} is not a file ({type(e).__name__}); "
                                   "the checkpoint cannot be read") from None
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise CorruptMetadataError(f"{path / INDEX} is damaged ({type(e).__name__}: {e}); the checkpoint cannot be read") from None


def _not_committed(path: Path) -> str:
    """Why `path` (without index.json) is no checkpoint; a killed save leaves only `<path>.tmp`."""
    tmp = tmp_dir_for(path)
    if tmp.is_dir() and not tmp.is_symlink():
        return (f"{path} was never committed: {tmp.name} beside it is a save of it that is in progress or was "
                "interrupted (the next save removes it); read an earlier checkpoint, or the run folder (its newest "
                "committed one)")
    if not path.exists():
        return f"{path} does not exist: not a checkpoint"
    return f"{path} has no {INDEX}: not a committed checkpoint"


def build_index(manifests: list[dict], world_size: int, algorithm: str) -> Index:
    """Merge per-rank manifests and check that each tensor's pieces tile it exactly."""
    files: dict[str, dict] = {}
    tensors: dict[str, TensorEntry] = {}
    owners: dict[str, list[int]] = {}
    for m in manifests:
        files[m["file"]] = {"rank": m["rank"], "bytes": m["bytes"], "checksum": m["checksum"]}
        for p in m["pieces"]:
            name, shape, dtype = p["name"], tuple(p["shape"]), p["dtype"]
            entry = tensors.setdefault(name, TensorEntry(shape, dtype, []))
            if entry.shape != shape or entry.dtype != dtype:
                raise LayoutError(f"tensor {name!r}: rank {m['rank']} saved it as {shape} {dtype}, "
                                  f"rank {owners[name][0]} as {entry.shape} {entry.dtype}")
            entry.pieces.append(Piece(m["file"], p["key"], region_from_json(p)))
            owners.setdefault(name, []).append(m["rank"])
    for m in manifests:  # tensors a rank handed in with writer=False: some rank must have written them
        for d in m.get("declared", []):
            name, shape, dtype = d["name"], tuple(d["shape"]), d["dtype"]
            if name not in tensors:
                raise LayoutError(f"tensor {name!r} {shape} {dtype}: rank {m['rank']} passed it with writer=False "
                                  "and no rank wrote it; a replicated tensor needs exactly one writer=True")
            entry = tensors[name]
            if entry.shape != shape or entry.dtype != dtype:
                raise LayoutError(f"tensor {name!r}: rank {m['rank']} has it as {shape} {dtype} (writer=False), "
                                  f"rank {owners[name][0]} saved it as {entry.shape} {entry.dtype}")
    for name, entry in tensors.items():
        _check_tiling(name, entry, owners[name])
    return Index(world_size, algorithm, files, dict(sorted(tensors.items())))


def _check_tiling(name: str, entry: TensorEntry, ranks: list[int]) -> None:
    """Pieces must be pairwise disjoint and cover the whole tensor."""
    boxes: list[tuple[Box, int, Piece]] = []
    for piece, rank in zip(entry.pieces, ranks):
        boxes += [(b, rank, piece) for _, b in as_boxes(entry.shape, piece.region)]
    if entry.shape:  # sweep along dim 0: only boxes whose dim-0 spans overlap can collide
        boxes.sort(key=lambda x: x[0].offsets[0])
    active: list[tuple[Box, int, Piece]] = []
    for cur in boxes:
        if entry.shape:
            active = [a for a in active if a[0].offsets[0] + a[0].lengths[0] > cur[0].offsets[0]]
        for other in active:
            if cur[0].numel and other[0].numel and intersect(cur[0], other[0]) is not None:
                raise LayoutError(
                    f"tensor {name!r}: rank {other[1]} piece {describe(other[2].region)} and rank {cur[1]} "
                    f"piece {describe(cur[2].region)} overlap; "
                    + ("expected one rank's pieces of a tensor to be disjoint" if cur[1] == other[1] else
                       "a replicated tensor needs exactly one writer=True"))
        active.append(cur)
    covered, total = sum(p.region.numel for p in entry.pieces), math.prod(entry.shape)
    if covered != total:
        gap = _first_uncovered(entry.shape, [b for b, _, _ in boxes if b.numel])
        raise LayoutError(f"tensor {name!r} of shape {entry.shape}: saved pieces cover {covered} of "
                          f"{total} elements (none holds element {list(gap)}, the first left out); every element "
                          "needs exactly one writer")


def _first_uncovered(shape: tuple[int, ...], boxes: list[Box]) -> tuple[int, ...]:
    """The first element, in row-major order, of a tensor of `shape` that none of the disjoint `boxes` holds (they
    hold fewer elements than it has). Its index in each dim is 0 or where a box ends (the element before it in that
    dim is held, by a box that ends there), so only those are tried, dim by dim: the first whose cross-section the
    boxes through it do not fill. Only on a refused save: quadratic in the pieces of the one tensor."""
    point: list[int] = []
    for d, size in enumerate(shape):
        rest = math.prod(shape[d + 1 :])
        for c in sorted({0} | {b.offsets[d] + b.lengths[d] for b in boxes} - {size}):
            through = [b for b in boxes if b.offsets[d] <= c < b.offsets[d] + b.lengths[d]]
            if sum(math.prod(b.lengths[d + 1 :]) for b in through) < rest:
                boxes = through
                point.append(c)
                break
    return tuple(point)
