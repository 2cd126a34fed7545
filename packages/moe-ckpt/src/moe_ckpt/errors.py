"""Errors raised on save and load; all are `CheckpointError`s and name the offending value."""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """Base class: the checkpoint (or the request against it) is not what was expected."""


class CorruptMetadataError(CheckpointError):
    """index.json or metadata.json is not the JSON the writer left (truncated, edited, damaged)."""


class UnsupportedFormatVersionError(CheckpointError):
    """The checkpoint's format version is newer than this moe-ckpt reads: it was written by a newer release."""

    def __init__(self, path: str | Path, version: int, supported: int) -> None:
        self.path, self.version, self.supported = Path(path), version, supported
        super().__init__(f"checkpoint {self.path} has format version {version}; this moe-ckpt reads format "
                         f"versions up to {supported}: it was written by a newer moe-ckpt, upgrade to read it")

    def __reduce__(self):  # picklable with its fields (the message alone is not the constructor's arguments)
        return type(self), (self.path, self.version, self.supported)


class IncompleteCheckpointError(CheckpointError):
    """The directory is not a committed checkpoint (no index.json, or a `.tmp` leftover)."""


class MissingShardFileError(CheckpointError):
    """A shard file named in index.json is absent."""


class ChecksumMismatchError(CheckpointError):
    """A shard file's size or checksum differs from index.json (corrupt or truncated)."""


class TensorNotFoundError(CheckpointError):
    """A requested tensor is not in the checkpoint."""


class ShapeMismatchError(CheckpointError):
    """A requested global shape differs from the saved one."""


class DtypeMismatchError(CheckpointError):
    """A requested dtype differs from the saved one."""


class UncoveredRegionError(CheckpointError):
    """Part of a requested region is held by no saved piece (a shard is missing)."""


class PeerCheckpointError(CheckpointError):
    """Another rank failed its part of a collective checkpoint step; its own error names the cause."""


class LayoutError(CheckpointError):
    """The pieces handed to save do not tile their tensors exactly (gaps, overlaps, disagreement)."""


class CorruptShardError(CheckpointError):
    """A shard file is not the safetensors file index.json describes (unreadable header, or a piece
    missing or stored with another dtype / shape) although its size and checksum may match."""


class NonFiniteTensorError(CheckpointError):
    """A tensor read with require_finite=True holds NaN or Inf (never a valid resume point for weights)."""
