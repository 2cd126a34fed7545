"""moe-ckpt: topology-agnostic checkpoints of global tensors.

Each rank hands `save_checkpoint` the pieces it owns (`ShardSpec`: global name,
global shape, and a `Box` or `FlatRange` of it); any later layout asks for the
regions it needs (`LoadRequest`) and gets exactly those bytes back.
"""

from moe_ckpt.async_save import AsyncCheckpointer, SaveStats
from moe_ckpt.collective import fail_together
from moe_ckpt.errors import (
    CheckpointError,
    ChecksumMismatchError,
    CorruptMetadataError,
    CorruptShardError,
    DtypeMismatchError,
    IncompleteCheckpointError,
    LayoutError,
    MissingShardFileError,
    NonFiniteTensorError,
    PeerCheckpointError,
    ShapeMismatchError,
    TensorNotFoundError,
    UncoveredRegionError,
    UnsupportedFormatVersionError,
)
from moe_ckpt.geometry import Box, FlatRange, Region, even_split, split_flat_buffer
from moe_ckpt.index import FORMAT_VERSION
from moe_ckpt.load import OpenCheckpoint, load_checkpoint, load_metadata, open_checkpoint, verify_checkpoint
from moe_ckpt.rng import capture_rng_state, check_rng_state, restore_rng_state
from moe_ckpt.run_dir import apply_retention, find_latest, list_checkpoints, step_dir, step_of
from moe_ckpt.save import save_checkpoint
from moe_ckpt.spec import LoadRequest, ShardSpec
from moe_ckpt.summary import format_checkpoint, inspect_checkpoint, reports_damage

__version__ = "0.22.3"

__all__ = [
    "AsyncCheckpointer",
    "Box",
    "CheckpointError",
    "ChecksumMismatchError",
    "CorruptMetadataError",
    "CorruptShardError",
    "DtypeMismatchError",
    "FORMAT_VERSION",
    "FlatRange",
    "IncompleteCheckpointError",
    "LayoutError",
    "LoadRequest",
    "MissingShardFileError",
    "NonFiniteTensorError",
    "OpenCheckpoint",
    "PeerCheckpointError",
    "Region",
    "SaveStats",
    "ShapeMismatchError",
    "ShardSpec",
    "TensorNotFoundError",
    "UncoveredRegionError",
    "UnsupportedFormatVersionError",
    "apply_retention",
    "capture_rng_state",
    "check_rng_state",
    "even_split",
    "fail_together",
    "find_latest",
    "format_checkpoint",
    "inspect_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_metadata",
    "open_checkpoint",
    "reports_damage",
    "restore_rng_state",
    "save_checkpoint",
    "split_flat_buffer",
    "step_dir",
    "step_of",
    "verify_checkpoint",
]
