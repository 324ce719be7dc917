from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT64: DType

class SBCPayload(_message.Message):
    __slots__ = ("mean", "golomb_b", "nnz", "bits")
    MEAN_FIELD_NUMBER: _ClassVar[int]
    GOLOMB_B_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    mean: float
    golomb_b: int
    nnz: int
    bits: bytes
    def __init__(self, mean: _Optional[float] = ..., golomb_b: _Optional[int] = ..., nnz: _Optional[int] = ..., bits: _Optional[bytes] = ...) -> None: ...

class STCPayload(_message.Message):
    __slots__ = ("mu", "golomb_b", "nnz", "bits", "signs")
    MU_FIELD_NUMBER: _ClassVar[int]
    GOLOMB_B_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    SIGNS_FIELD_NUMBER: _ClassVar[int]
    mu: float
    golomb_b: int
    nnz: int
    bits: bytes
    signs: bytes
    def __init__(self, mu: _Optional[float] = ..., golomb_b: _Optional[int] = ..., nnz: _Optional[int] = ..., bits: _Optional[bytes] = ..., signs: _Optional[bytes] = ...) -> None: ...

class ThreeLCPayload(_message.Message):
    __slots__ = ("scale", "numel", "zero_run", "data")
    SCALE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    ZERO_RUN_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    scale: float
    numel: int
    zero_run: bool
    data: bytes
    def __init__(self, scale: _Optional[float] = ..., numel: _Optional[int] = ..., zero_run: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...

class DensePayload(_message.Message):
    __slots__ = ("encoding", "data")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    encoding: DType
    data: bytes
    def __init__(self, encoding: _Optional[_Union[DType, str]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SparsePayload(_message.Message):
    __slots__ = ("golomb_b", "nnz", "bits", "value_encoding", "values")
    GOLOMB_B_FIELD_NUMBER: _ClassVar[int]
    NNZ_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    VALUE_ENCODING_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    golomb_b: int
    nnz: int
    bits: bytes
    value_encoding: DType
    values: bytes
    def __init__(self, golomb_b: _Optional[int] = ..., nnz: _Optional[int] = ..., bits: _Optional[bytes] = ..., value_encoding: _Optional[_Union[DType, str]] = ..., values: _Optional[bytes] = ...) -> None: ...

class GradiVeQPayload(_message.Message):
    __slots__ = ("compressor_version", "slice_size", "dim", "coefficients")
    COMPRESSOR_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLICE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    COEFFICIENTS_FIELD_NUMBER: _ClassVar[int]
    compressor_version: int
    slice_size: int
    dim: int
    coefficients: bytes
    def __init__(self, compressor_version: _Optional[int] = ..., slice_size: _Optional[int] = ..., dim: _Optional[int] = ..., coefficients: _Optional[bytes] = ...) -> None: ...

class CompressedTensor(_message.Message):
    __slots__ = ("name", "shape", "dtype", "codec_id", "codec_version", "sbc", "three_lc", "dense", "sparse", "gradiveq", "stc")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_ID_FIELD_NUMBER: _ClassVar[int]
    CODEC_VERSION_FIELD_NUMBER: _ClassVar[int]
    SBC_FIELD_NUMBER: _ClassVar[int]
    THREE_LC_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    SPARSE_FIELD_NUMBER: _ClassVar[int]
    GRADIVEQ_FIELD_NUMBER: _ClassVar[int]
    STC_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    codec_id: str
    codec_version: int
    sbc: SBCPayload
    three_lc: ThreeLCPayload
    dense: DensePayload
    sparse: SparsePayload
    gradiveq: GradiVeQPayload
    stc: STCPayload
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec_id: _Optional[str] = ..., codec_version: _Optional[int] = ..., sbc: _Optional[_Union[SBCPayload, _Mapping]] = ..., three_lc: _Optional[_Union[ThreeLCPayload, _Mapping]] = ..., dense: _Optional[_Union[DensePayload, _Mapping]] = ..., sparse: _Optional[_Union[SparsePayload, _Mapping]] = ..., gradiveq: _Optional[_Union[GradiVeQPayload, _Mapping]] = ..., stc: _Optional[_Union[STCPayload, _Mapping]] = ...) -> None: ...

class CompressedUpdate(_message.Message):
    __slots__ = ("format_version", "base_model_version", "tensors", "crc32")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    base_model_version: int
    tensors: _containers.RepeatedCompositeFieldContainer[CompressedTensor]
    crc32: int
    def __init__(self, format_version: _Optional[int] = ..., base_model_version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[CompressedTensor, _Mapping]]] = ..., crc32: _Optional[int] = ...) -> None: ...

class GradiVeQBasis(_message.Message):
    __slots__ = ("name", "slice_size", "dim", "basis", "whitening")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SLICE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    WHITENING_FIELD_NUMBER: _ClassVar[int]
    name: str
    slice_size: int
    dim: int
    basis: bytes
    whitening: bytes
    def __init__(self, name: _Optional[str] = ..., slice_size: _Optional[int] = ..., dim: _Optional[int] = ..., basis: _Optional[bytes] = ..., whitening: _Optional[bytes] = ...) -> None: ...

class GradiVeQCompressor(_message.Message):
    __slots__ = ("version", "tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[GradiVeQBasis]
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[GradiVeQBasis, _Mapping]]] = ...) -> None: ...

class DeftPartition(_message.Message):
    __slots__ = ("tensor", "start", "stop", "k")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    tensor: int
    start: int
    stop: int
    k: int
    def __init__(self, tensor: _Optional[int] = ..., start: _Optional[int] = ..., stop: _Optional[int] = ..., k: _Optional[int] = ...) -> None: ...

class DeftAllocation(_message.Message):
    __slots__ = ("round", "partitions", "report_norms")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    REPORT_NORMS_FIELD_NUMBER: _ClassVar[int]
    round: int
    partitions: _containers.RepeatedCompositeFieldContainer[DeftPartition]
    report_norms: bool
    def __init__(self, round: _Optional[int] = ..., partitions: _Optional[_Iterable[_Union[DeftPartition, _Mapping]]] = ..., report_norms: _Optional[bool] = ...) -> None: ...
