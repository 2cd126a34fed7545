"""load_checkpoint / open_checkpoint: assemble any region of any saved tensor from the pieces that overlap it.

Only safetensors (`safe_open` + `get_slice`, memory-mapped) and JSON are read; no
pickle. A piece is read only where it overlaps the request, so a rank that needs 1/8
of an expert stack reads 1/8 of it (plus, with verify=True, one checksum pass over
each file it touches). `open_checkpoint` keeps index.json and the opened files for many
reads; `load_checkpoint` is one read through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from moe_ckpt.errors import (
    ChecksumMismatchError,
    CorruptMetadataError,
    CorruptShardError,
    DtypeMismatchError,
    IncompleteCheckpointError,
    MissingShardFileError,
    NonFiniteTensorError,
    ShapeMismatchError,
    TensorNotFoundError,
    UncoveredRegionError,
)
from moe_ckpt.geometry import Box, FlatRange, Region, as_boxes, check_region, describe, intersect
from moe_ckpt.index import Index, Piece, read_index
from moe_ckpt.run_dir import INDEX, METADATA, find_latest
from moe_ckpt.shard_file import bytes_checksum, file_checksum, naming
from moe_ckpt.spec import LoadRequest, dtype_from_name, dtype_name, safetensors_code


def resolve(path: str | Path) -> Path:
    """A checkpoint directory as given, or a run directory's latest committed checkpoint."""
    path = Path(path)
    if not (path / INDEX).exists():  # a run directory, with or without its `latest` pointer
        latest = find_latest(path)
        if latest is not None:
            return latest
    return path


def load_metadata(path: str | Path) -> dict:
    """The JSON metadata blob of a committed checkpoint (step, schedules, RNG, config, layout), checked against the
    size and checksum index.json records for it (CorruptMetadataError if it changed since the save)."""
    path = resolve(path)
    return _read_metadata(path, read_index(path))  # read_index refuses partial checkpoints


def _read_metadata(path: Path, index: Index) -> dict:
    """metadata.json read once: those bytes are checked against index.json's record (a save before the record
    existed has none: not checked) and parsed."""
    mpath = path / METADATA
    try:
        with naming(mpath), open(mpath, "rb") as f:  # a failing read names no file of its own
            data = f.read()
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path} has no {METADATA}: the checkpoint is incomplete") from None
    except IsADirectoryError as e:
        raise CorruptMetadataError(f"{mpath} is damaged ({type(e).__name__}: {e})") from None
    changed = _metadata_changed(data, index)
    # a file that is not the object a save writes says so first (and that it changed since the save, when it did)
    try:
        meta = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptMetadataError(f"{mpath} is damaged ({type(e).__name__}: {e})"
                                   + (f"; it {changed}" if changed else "")) from None
    if not isinstance(meta, dict):
        raise CorruptMetadataError(f"{mpath} holds a JSON {type(meta).__name__}, expected an object "
                                   "(save writes the caller's metadata dict plus 'moe_ckpt')"
                                   + (f"; it {changed}" if changed else ""))
    if changed:  # valid JSON, other values: the step, the data position or the schedule it resumes from is wrong
        raise CorruptMetadataError(f"metadata file {mpath} {changed}")
    return meta


def _metadata_changed(data: bytes, index: Index) -> str:
    """How metadata.json's bytes differ from index.json's record of them, with what to do; "" if they do not (or
    no record: a checkpoint of an earlier moe-ckpt)."""
    want = index.metadata_file
    if want is None:
        return ""
    got, algorithm = bytes_checksum(data, index.checksum_algorithm), index.checksum_algorithm
    if (got.nbytes, got.checksum) == (want["bytes"], want["checksum"]):
        return ""
    return (f"has {got.nbytes} bytes, {algorithm} {got.checksum}; index.json says {want['bytes']} bytes, {algorithm} "
            f"{want['checksum']}: truncated, edited or corrupt since the save, so its step, data position and "
            "schedules cannot be trusted; resume from an earlier checkpoint, or put back a copy of this file")


def load_checkpoint(
    path: str | Path,
    requests: Sequence[LoadRequest] | None = None,
    *,
    verify: bool = True,
    device: str | torch.device = "cpu",
    require_finite: bool = False,
) -> dict[str, torch.Tensor]:
    """Read the requested regions; returns {name: tensor of shape request.region's local shape}.

    requests: None loads every tensor whole. verify: checksum every shard file touched
    (file sizes and each file's safetensors header against index.json are always checked).
    require_finite: raise NonFiniteTensorError if a floating-point value read is NaN or Inf
    (weights and optimizer state: never a valid resume point); the failing request's `out` is left
    untouched (its parts are held until all are checked), those of earlier requests are filled.
    Raises a CheckpointError subclass naming the tensor, file or region that is wrong.
    To read tensor by tensor, open the checkpoint once with `open_checkpoint` instead.
    """
    with open_checkpoint(path, verify=verify) as ckpt:
        return ckpt._read(requests, device, require_finite, lend_views=True)


def open_checkpoint(path: str | Path, *, verify: bool = True) -> OpenCheckpoint:
    """A committed checkpoint (or a run directory's latest) opened for many reads; use it in a `with` block.

        with open_checkpoint("run") as ckpt:
            for name in ckpt.names:
                w = ckpt.read([LoadRequest(name)])[name]

    index.json is read and checked here, once (its format version first: UnsupportedFormatVersionError for a
    checkpoint of a newer moe-ckpt); each shard file is checked (size, checksum when verify,
    safetensors header against index.json) and opened on its first read, once, and held until close.
    """
    return OpenCheckpoint(resolve(path), verify)


def verify_checkpoint(path: str | Path) -> Path:
    """Check every shard file's presence, size, checksum and header once, and metadata.json: a JSON object, and the
    bytes index.json records for it (a checkpoint of an earlier moe-ckpt records none); returns the resolved path.

    Lets a reader that loads tensor by tensor pass verify=False afterwards.
    """
    with open_checkpoint(path, verify=True) as ckpt:
        ckpt.check_all_files()
        _read_metadata(ckpt.path, ckpt._index)
        return ckpt.path


class OpenCheckpoint:
    """One checkpoint's parsed index.json and its shard files, opened on first use (see `open_checkpoint`)."""

    def __init__(self, path: Path, verify: bool) -> None:
        self.path = path
        self._index = read_index(path)
        self._files = _Files(path, self._index, verify)
        self._closed = False

    @property
    def names(self) -> list[str]:
        """Every tensor's global name, in index.json's order."""
        return list(self._index.tensors)

    def read(
        self,
        requests: Sequence[LoadRequest] | None = None,
        *,
        device: str | torch.device = "cpu",
        require_finite: bool = False,
    ) -> dict[str, torch.Tensor]:
        """load_checkpoint's reads (same requests, results and errors) without re-reading index.json.

        Results are the caller's own memory: a piece read whole is copied out of the file's memory map, which
        later reads through this checkpoint share (load_checkpoint, which closes it at once, hands out the map).
        """
        return self._read(requests, device, require_finite, lend_views=False)

    def _read(self, requests, device, require_finite: bool, lend_views: bool) -> dict[str, torch.Tensor]:
        self._check_open()
        if requests is None:
            requests = [LoadRequest(name) for name in self._index.tensors]
        if isinstance(requests, (str, LoadRequest)):  # list() split a name into letters, each "a str" to wrap
            name = requests if isinstance(requests, str) else requests.name
            raise TypeError(f"requests is a {type(requests).__name__} ({requests!r:.80}), expected a list of "
                            f"LoadRequests (e.g. [LoadRequest({name!r})])")
        requests = list(requests)  # read twice below: a generator returned {} without a word
        _validate(self.path, self._index, requests)
        return {req.name: _assemble(self._index, self._files, req, device, require_finite, lend_views)
                for req in requests}

    def check_all_files(self) -> None:
        """Open (and check) every shard file now rather than at its first read: a damaged file fails here."""
        self._check_open()
        for fname in self._index.files:
            self._files.get(fname)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"checkpoint {self.path} was closed; read it inside its `with open_checkpoint(...)` block")

    def close(self) -> None:
        self._closed = True
        self._files.close()

    def __enter__(self) -> OpenCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _validate(path: Path, index: Index, requests: Sequence[LoadRequest]) -> None:
    for i, r in enumerate(requests):  # a bare name failed on `.name`, an AttributeError naming nothing
        if not isinstance(r, LoadRequest):
            hint = f"LoadRequest({r!r}) for a tensor name" if isinstance(r, str) else "requests=None loads every tensor"
            raise TypeError(f"requests[{i}] is a {type(r).__name__} ({r!r:.80}), expected a LoadRequest ({hint})")
    names = [r.name for r in requests]
    dup = sorted(n for n, count in Counter(names).items() if count > 1)
    if dup:
        raise ValueError(f"tensors {dup} are requested more than once; request each name once")
    missing = [n for n in names if n not in index.tensors]
    if missing:
        known = list(index.tensors)
        raise TensorNotFoundError(f"tensors {missing} are not in the checkpoint {path}; it has {len(known)} "
                                  f"tensors, e.g. {known[:8]}")
    for r in requests:
        entry = index.tensors[r.name]
        if r.global_shape is not None and not isinstance(r.global_shape, (tuple, list)):  # `(10)` is the int 10
            raise TypeError(f"request for tensor {r.name!r}: global shape {r.global_shape!r} is a "
                            f"{type(r.global_shape).__name__}, expected a tuple of integers such as (10,)")
        if r.global_shape is not None and tuple(r.global_shape) != entry.shape:
            raise ShapeMismatchError(f"tensor {r.name!r}: requested global shape {tuple(r.global_shape)}, "
                                     f"checkpoint has {entry.shape} ({path})")
        if r.dtype is not None and dtype_name(r.dtype, f"request for tensor {r.name!r}: ") != entry.dtype:
            raise DtypeMismatchError(f"tensor {r.name!r}: requested dtype {dtype_name(r.dtype)}, "
                                     f"checkpoint has {entry.dtype} ({path})")
        if r.region is not None:
            check_region(entry.shape, r.region, f"request for tensor {r.name!r}")
        if r.out is not None:  # every request's buffer before any is filled
            _check_out(r.name, r.out, r.region if r.region is not None else Box.whole(entry.shape),
                       dtype_from_name(entry.dtype))


class _Files(contextlib.ExitStack):
    """Opens each shard file once, after checking its size (and checksum when verify), and checks that
    its safetensors header holds every piece index.json places in it, with index.json's dtype and shape."""

    def __init__(self, path: Path, index: Index, verify: bool) -> None:
        super().__init__()
        self.path, self.index, self.verify = path, index, verify
        self.handles: dict[str, object] = {}
        self.pieces: dict[str, list[tuple[str, Piece]]] = {}
        for name, entry in index.tensors.items():
            for piece in entry.pieces:
                self.pieces.setdefault(piece.file, []).append((name, piece))

    def get(self, fname: str):
        if fname not in self.handles:
            fpath = self.path / fname
            rec = self.index.files[fname]
            if not fpath.is_file():
                raise MissingShardFileError(f"shard file {fpath} (rank {rec['rank']} of "
                                            f"{self.index.world_size}) is missing")
            size = fpath.stat().st_size
            if size != rec["bytes"]:
                raise ChecksumMismatchError(f"shard file {fpath} has {size} bytes, index.json says "
                                            f"{rec['bytes']}: truncated or corrupt")
            if self.verify:
                got = file_checksum(fpath, self.index.checksum_algorithm).checksum
                if got != rec["checksum"]:
                    raise ChecksumMismatchError(
                        f"shard file {fpath} has {self.index.checksum_algorithm} {got}, index.json says "
                        f"{rec['checksum']}: corrupt")
            try:
                handle = self.enter_context(safe_open(fpath, framework="pt"))
            except OSError as e:  # opening or mapping it failed (safetensors names no file): not a damaged file
                raise type(e)(f"shard file {fpath} could not be opened ({e})") from None
            except Exception as e:  # safetensors' own error type: an unreadable header
                raise CorruptShardError(f"shard file {fpath} is not a readable safetensors file "
                                        f"({type(e).__name__}: {e})") from None
            self._check_header(fpath, handle)
            self.handles[fname] = handle
        return self.handles[fname]

    def _check_header(self, fpath: Path, handle) -> None:
        keys = set(handle.keys())
        for name, piece in self.pieces.get(fpath.name, []):
            if piece.key not in keys:
                raise CorruptShardError(f"shard file {fpath} has no tensor {piece.key!r}, which index.json lists "
                                        f"as a piece of {name!r}")
            sl = handle.get_slice(piece.key)
            want_code = safetensors_code(dtype_from_name(self.index.tensors[name].dtype))
            got_shape, want_shape = tuple(sl.get_shape()), piece.region.local_shape
            shape_ok = (got_shape == want_shape if isinstance(piece.region, Box)
                        else math.prod(got_shape) == piece.region.length)  # flat pieces of older saves kept a shape
            if sl.get_dtype() != want_code or not shape_ok:
                raise CorruptShardError(f"shard file {fpath}: {piece.key!r} is stored as {sl.get_dtype()} "
                                        f"{list(got_shape)}; index.json says {want_code} {list(want_shape)}")


def _check_out(name: str, dest: torch.Tensor, region: Region, dtype: torch.dtype) -> None:
    """`out` takes the region's elements: its dtype, and its shape (any shape of that many elements for a flat
    range), with no two elements sharing memory (an expanded tensor)."""
    shape_ok = dest.numel() == region.numel if isinstance(region, FlatRange) else tuple(dest.shape) == region.local_shape
    if dest.dtype != dtype or not shape_ok:
        raise ValueError(f"tensor {name!r}: out has {tuple(dest.shape)} {dest.dtype}, needs {region.local_shape} {dtype}"
                         + ("" if isinstance(region, FlatRange) else " (a box's shape, not only its element count)"))
    if any(n > 1 and step == 0 for n, step in zip(dest.shape, dest.stride())):
        raise ValueError(f"tensor {name!r}: out {tuple(dest.shape)} has strides {dest.stride()}: elements share memory "
                         "(an expanded tensor); expected a buffer with one place per element")


@torch.no_grad()  # `out` may be a parameter (a leaf that requires grad), filled in place as load_state_dict does
def _assemble(index: Index, files: _Files, req: LoadRequest, device, require_finite: bool,
              lend_views: bool) -> torch.Tensor:
    entry = index.tensors[req.name]
    dtype = dtype_from_name(entry.dtype)
    region = req.region if req.region is not None else Box.whole(entry.shape)
    dest = req.out  # checked by _validate
    if dest is not None and isinstance(region, FlatRange) and not _flattens_as_view(dest):  # e.g. a transposed one
        got = _assemble(index, files, dataclasses.replace(req, out=None), dest.device, require_finite, True)
        return dest.copy_(got.reshape(dest.shape))
    whole = _contained_read(files, entry.pieces, region, entry.shape)
    if whole is not None and require_finite:
        _check_finite(files.path, req.name, region, whole)
    if whole is not None:  # one stored piece holds all of it: no assembly buffer, no second copy
        if dest is None:
            got = whole.reshape(region.local_shape).to(device)
            # on the CPU a view of the map: changed in place, it would change every later read of the piece
            return got if lend_views or got.device != whole.device else got.clone()
        return dest.copy_(whole.reshape(dest.shape))
    if dest is None:
        dest = torch.empty(region.local_shape, dtype=dtype, device=device)
    # Targets: boxes of the global tensor, each with a view into dest shaped like it.
    if isinstance(region, Box):
        targets = [(region, dest.view(region.lengths))]
    else:
        flat = dest.view(-1)
        targets = [(b, flat[pos : pos + b.numel].view(b.lengths)) for pos, b in as_boxes(entry.shape, region)]
    covered, checked = 0, []
    for piece in entry.pieces:
        for spos, sbox in as_boxes(entry.shape, piece.region):
            for tbox, view in targets:
                hit = intersect(tbox, sbox)
                if hit is None:
                    continue
                data = _read(files.get(piece.file), piece, spos, sbox, hit)
                if require_finite:  # written only once every part is checked: `out` stays as it was
                    _check_finite(files.path, req.name, hit, data)
                    checked.append((view, hit.slices(tbox.offsets), data))
                else:
                    view[hit.slices(tbox.offsets)] = data
                covered += hit.numel
    if covered > region.numel:
        raise CorruptMetadataError(
            f"tensor {req.name!r} {entry.shape}: index.json of {files.path} lists pieces that overlap "
            f"({covered} elements read for the {region.numel} of {describe(region)}); each element has one writer")
    if covered != region.numel:
        raise UncoveredRegionError(
            f"tensor {req.name!r} {entry.shape}: the saved pieces cover {covered} of the {region.numel} "
            f"elements of {describe(region)}; a shard is missing from index.json of {files.path}")
    for view, where, data in checked:
        view[where] = data
    return dest


def _flattens_as_view(dest: torch.Tensor) -> bool:
    """Whether a flat range's assembly can write through `out` flattened (a view, not a copy). A box's `out` has the
    box's shape (_check_out), and a view to a tensor's own shape always exists, whatever its strides."""
    try:
        dest.view(-1)
    except RuntimeError:
        return False
    return True


def _contained_read(files: _Files, pieces: list[Piece], region: Region, shape: tuple[int, ...]):
    """The request read from the one stored piece that contains all of it, else None.

    safetensors slices are views of the memory-mapped file, so this costs no copy
    until the data is touched (or a copy for a strided box, by .contiguous()).
    """
    if region.numel == 0:
        return None
    if isinstance(region, Box) and region == Box.whole(shape):
        as_flat = FlatRange(0, region.numel)
    else:
        as_flat = region if isinstance(region, FlatRange) else None
    for piece in pieces:
        stored = piece.region
        if isinstance(region, Box) and isinstance(stored, Box) and intersect(stored, region) == region:
            return _read(files.get(piece.file), piece, 0, stored, region).contiguous()
        if (as_flat is not None and isinstance(stored, FlatRange) and stored.start <= as_flat.start
                and as_flat.start + as_flat.length <= stored.start + stored.length):
            off = as_flat.start - stored.start
            return _flat(files.get(piece.file), piece)[off : off + as_flat.length]
    return None


def _flat(handle, piece: Piece):
    """A stored flat-range piece, sliceable along its one dim. moe-ckpt <= 0.4.1 stored a flat piece with
    the shape the caller's tensor had; such a piece is read whole and flattened."""
    sl = handle.get_slice(piece.key)
    return sl if len(sl.get_shape()) == 1 else handle.get_tensor(piece.key).reshape(-1)


def _read(handle, piece: Piece, spos: int, sbox: Box, want: Box) -> torch.Tensor:
    """The part `want` (global coordinates) of stored box `sbox` of `piece`, as a [*want.lengths] tensor."""
    rel = want.slices(sbox.offsets)
    nd = len(sbox.lengths)
    if isinstance(piece.region, Box):
        return handle.get_tensor(piece.key) if nd == 0 else handle.get_slice(piece.key)[rel]
    sl = _flat(handle, piece)
    if nd == 0:  # a scalar saved as a flat range of length 1
        return sl[spos : spos + 1].reshape(())
    # sbox is contiguous: length 1 in dims < k, a run in dim k, whole in dims > k.
    k = next((d for d, n in enumerate(sbox.lengths) if n != 1), nd - 1)
    inner = math.prod(sbox.lengths[k + 1 :])
    a, b = rel[k].start, rel[k].stop
    slab = sl[spos + a * inner : spos + b * inner].reshape((1,) * k + (b - a,) + sbox.lengths[k + 1 :])
    return slab[(slice(None),) * (k + 1) + rel[k + 1 :]]


def _check_finite(path: Path, name: str, region: Region, data: torch.Tensor) -> None:
    if not data.is_floating_point():
        return
    bad = ~torch.isfinite(data)
    if bool(bad.any()):
        nan, total = int(torch.isnan(data).sum()), int(bad.sum())
        raise NonFiniteTensorError(
            f"tensor {name!r} in {path}: {describe(region)} holds {nan} NaN and {total - nan} Inf of "
            f"{data.numel()} values (first at flat index {int(bad.reshape(-1).nonzero()[0])} of that region); "
            "expected finite values: nothing can start from this checkpoint's weights; use an earlier checkpoint")
