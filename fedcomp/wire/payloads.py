"""Plain data classes for what a codec puts on the wire.

They mirror ``proto/fedcomp/v1/wire.proto`` one to one; ``fedcomp.wire.serde`` is the only module
that converts them to and from protobuf, so codecs never touch generated code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

#: Logical dtypes the wire format knows, by their schema name.
WIRE_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in WIRE_DTYPES.items()}
DTYPE_SIZES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
#: Upper bound on tensor rank the wire format carries (the decoders refuse more; the encoders too).
MAX_RANK = 8


@dataclass(frozen=True)
class SBCPayload:
    """Signed mean, Golomb parameter, count of non-zeros and the position bitstream."""

    mean: float
    golomb_b: int
    nnz: int
    bits: bytes


@dataclass(frozen=True)
class STCPayload:
    """Shared magnitude mu, Golomb parameter, count of kept positions, the position bitstream
    (``SBCPayload.bits`` layout) and one sign bit per position (1 = negative, MSB-first)."""

    mu: float
    golomb_b: int
    nnz: int
    bits: bytes
    signs: bytes


@dataclass(frozen=True)
class ThreeLCPayload:
    """3LC scale m, element count, zero-run flag and the base-3^5 bytes."""

    scale: float
    numel: int
    zero_run: bool
    data: bytes


@dataclass(frozen=True)
class DensePayload:
    """Raw little-endian values in ``encoding`` (a key of ``TORCH_DTYPES``).

    ``data`` is ``bytes`` when encoded, and a read-only ``memoryview`` of the received update when
    parsed (``fedcomp.wire.serde``): the values are not copied until the decoder writes them into
    the output tensor. The update's bytes must not change while the payload is in use."""

    encoding: str
    data: bytes | memoryview


@dataclass(frozen=True)
class SparsePayload:
    """Golomb-coded positions (``SBCPayload.bits`` layout) and their values in ``value_encoding``."""

    golomb_b: int
    nnz: int
    bits: bytes
    value_encoding: str
    values: bytes


@dataclass(frozen=True)
class GradiVeQPayload:
    """Slice-major float32 coefficients under compressor version ``compressor_version``."""

    compressor_version: int
    slice_size: int
    dim: int
    coefficients: bytes | memoryview  # a view of the received update when parsed (Dense: the same)


Payload = SBCPayload | ThreeLCPayload | DensePayload | SparsePayload | GradiVeQPayload | STCPayload


@dataclass(frozen=True)
class GradiVeQBasis:
    """One tensor's compressor: ``basis`` is U (d x k float32 LE, row-major), ``whitening`` mu
    (d float32 LE). ``dim == 0`` means the tensor is not compressed."""

    name: str
    slice_size: int
    dim: int
    basis: bytes
    whitening: bytes


@dataclass(frozen=True)
class GradiVeQCompressor:
    """What the server broadcasts on each refresh: a version and one basis per tensor."""

    version: int
    tensors: tuple[GradiVeQBasis, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class DeftPartition:
    """Entries ``[start, stop)`` of the flattened tensor number ``tensor`` (model order); the
    client selects ``k`` of them."""

    tensor: int
    start: int
    stop: int
    k: int


@dataclass(frozen=True)
class DeftAllocation:
    """One client's partitions for one round."""

    round: int
    partitions: tuple[DeftPartition, ...] = field(default_factory=tuple)
    #: Whether the server asks for the client's per-tensor norms in its reply (``deft.norms``).
    report_norms: bool = False


@dataclass(frozen=True)
class EncodedTensor:
    """One compressed tensor: what it is (name, shape, dtype), how it was coded, the payload."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    codec_id: str
    codec_version: int
    payload: Payload


FORMAT_VERSION = 2


@dataclass(frozen=True)
class EncodedUpdate:
    """A whole update: format version, the model version it refers to, its tensors in order."""

    base_model_version: int
    tensors: tuple[EncodedTensor, ...] = field(default_factory=tuple)
    format_version: int = FORMAT_VERSION


_T = TypeVar("_T")


def filled(cls: type[_T], fields: dict[str, Any]) -> _T:
    """An instance of the frozen dataclass ``cls`` holding ``fields`` (every field of it: none of
    these classes runs a ``__post_init__``): what ``cls(**fields)`` makes, without ``__init__``'s
    ``object.__setattr__`` a field. For the hot paths that make one per tensor from values already
    checked (the wire kernel's parse, a whole-update engine's payloads)."""
    made = object.__new__(cls)
    made.__dict__.update(fields)
    return made
