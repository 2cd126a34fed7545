"""What a rank saves (`ShardSpec`) and what it asks back (`LoadRequest`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_ckpt.geometry import Box, FlatRange, Region, as_index, check_region

# Names used in index.json (torch's, without the "torch." prefix) and the
# safetensors dtype codes of the same types.
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
}
_BY_DTYPE = {dt: name for name, (dt, _) in _DTYPES.items()}
DTYPE_NAMES = frozenset(_DTYPES)


def dtype_name(dtype: torch.dtype, what: str = "") -> str:
    """index.json's name of `dtype`; TypeError naming `what` (e.g. "tensor 'w': ") when it has none."""
    if dtype not in _BY_DTYPE:
        raise TypeError(f"{what}dtype {dtype} is not supported; expected one of {sorted(_DTYPES)}")
    return _BY_DTYPE[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise TypeError(f"dtype name {name!r} is not supported; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name][0]


def safetensors_code(dtype: torch.dtype) -> str:
    return _DTYPES[dtype_name(dtype)][1]


def check_name(name: object) -> None:
    """A tensor name goes into index.json and the shard file's safetensors header: a str that UTF-8 encodes."""
    if not isinstance(name, str):
        raise TypeError(f"tensor name {name!r} is a {type(name).__name__}, expected a str")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: safetensors could not read the file back
        raise ValueError(f"tensor name {name!r} is not valid Unicode ({e.reason} at position {e.start}); "
                         "the shard file's header could not be read back") from None


@dataclass
class ShardSpec:
    """One piece of one global tensor that this rank holds.

    tensor: the local data, shape `region.lengths` for a Box, [region.length] for a
        FlatRange (any shape with that many elements is accepted and flattened).
    region: the part of the global tensor it is; None means the whole tensor.
    writer: False when another rank writes the same data (replicated tensors: exactly
        one rank passes writer=True).
    """

    name: str
    global_shape: tuple[int, ...]
    tensor: torch.Tensor
    region: Region | None = None
    writer: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise naming the tensor unless the fields describe a piece a save can write (run on construction, and
        again by the save: a field changed in between would otherwise commit a checkpoint no load can read)."""
        check_name(self.name)
        if not isinstance(self.tensor, torch.Tensor):
            raise TypeError(f"tensor {self.name!r}: data is a {type(self.tensor).__name__}, expected a torch.Tensor")
        if not isinstance(self.global_shape, (tuple, list)):  # `(10)` is the int 10; torch.Size is a tuple
            raise TypeError(f"tensor {self.name!r}: global shape {self.global_shape!r} is a "
                            f"{type(self.global_shape).__name__}, expected a tuple of integers such as (10,)")
        self.global_shape = tuple(as_index(s, f"tensor {self.name!r}: global shape dim") for s in self.global_shape)
        if any(s < 0 for s in self.global_shape):  # index.json refuses it: the checkpoint could not be read
            raise ValueError(f"tensor {self.name!r}: global shape {self.global_shape} has a negative dim")
        if self.region is None:
            self.region = Box.whole(self.global_shape)
        check_region(self.global_shape, self.region, f"tensor {self.name!r}")
        dtype_name(self.tensor.dtype, f"tensor {self.name!r}: ")
        if isinstance(self.region, FlatRange):
            if self.tensor.numel() != self.region.length:
                raise ValueError(f"tensor {self.name!r}: local data has {self.tensor.numel()} elements, "
                                 f"its flat range has {self.region.length}")
        elif tuple(self.tensor.shape) != self.region.lengths:
            raise ValueError(f"tensor {self.name!r}: local data has shape {tuple(self.tensor.shape)}, "
                             f"its box {self.region.offsets}+{self.region.lengths} needs {self.region.lengths}")

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


def require_shard_spec(value: object, index: int) -> None:
    """shards[index] is a ShardSpec: a bare tensor (or a dict's key) failed later on a missing attribute."""
    if not isinstance(value, ShardSpec):
        hint = f" (a dict's key {value!r}? pass a list of ShardSpecs)" if isinstance(value, str) else ""
        raise TypeError(f"shards[{index}] is a {type(value).__name__}, expected a ShardSpec(name, global_shape, "
                        f"tensor, region){hint}")


@dataclass
class LoadRequest:
    """The part of one global tensor this rank wants back, in any layout.

    global_shape / dtype: what the caller expects; a mismatch with the checkpoint
        raises (None skips the check).
    region: None means the whole tensor.
    out: optional destination, shape `region.local_shape` (or that many elements for
        a FlatRange); filled in place and returned.
    """

    name: str
    global_shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    region: Region | None = None
    out: torch.Tensor | None = field(default=None, repr=False)
