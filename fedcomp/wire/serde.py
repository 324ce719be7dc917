"""Protobuf <-> fedcomp data classes. The only module that imports generated code.

Parsing never trusts the bytes: a payload that protobuf cannot parse, or whose fields are out of
range, raises :class:`PayloadError`. Codec-level checks (lengths against the expected shape) happen
in each codec's decoder.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError as _PbDecodeError

from fedcomp.errors import PayloadError
from fedcomp.v1 import wire_pb2 as pb
from fedcomp.wire.payloads import (
    FORMAT_VERSION,
    DeftAllocation,
    DeftPartition,
    DensePayload,
    EncodedTensor,
    EncodedUpdate,
    GradiVeQBasis,
    GradiVeQCompressor,
    GradiVeQPayload,
    Payload,
    SBCPayload,
    SparsePayload,
    STCPayload,
    ThreeLCPayload,
)

#: Upper bound on tensor rank accepted from the wire.
MAX_RANK = 8

_DTYPE_TO_PB = {
    "float32": pb.DTYPE_FLOAT32,
    "float16": pb.DTYPE_FLOAT16,
    "bfloat16": pb.DTYPE_BFLOAT16,
    "float64": pb.DTYPE_FLOAT64,
}
_PB_TO_DTYPE: dict[int, str] = {v: k for k, v in _DTYPE_TO_PB.items()}


def _dtype_from_pb(value: int, name: str, what: str) -> str:
    try:
        return _PB_TO_DTYPE[value]
    except KeyError:
        raise PayloadError(name, f"unknown {what} {value}") from None


def tensor_to_proto(t: EncodedTensor) -> pb.CompressedTensor:
    msg = pb.CompressedTensor(
        name=t.name,
        shape=list(t.shape),
        dtype=_DTYPE_TO_PB[t.dtype],
        codec_id=t.codec_id,
        codec_version=t.codec_version,
    )
    p = t.payload
    if isinstance(p, SBCPayload):
        msg.sbc.CopyFrom(pb.SBCPayload(mean=p.mean, golomb_b=p.golomb_b, nnz=p.nnz, bits=p.bits))
    elif isinstance(p, STCPayload):
        msg.stc.CopyFrom(pb.STCPayload(mu=p.mu, golomb_b=p.golomb_b, nnz=p.nnz, bits=p.bits, signs=p.signs))
    elif isinstance(p, ThreeLCPayload):
        msg.three_lc.CopyFrom(pb.ThreeLCPayload(scale=p.scale, numel=p.numel, zero_run=p.zero_run, data=p.data))
    elif isinstance(p, DensePayload):
        msg.dense.CopyFrom(pb.DensePayload(encoding=_DTYPE_TO_PB[p.encoding], data=p.data))
    elif isinstance(p, SparsePayload):
        msg.sparse.CopyFrom(
            pb.SparsePayload(
                golomb_b=p.golomb_b,
                nnz=p.nnz,
                bits=p.bits,
                value_encoding=_DTYPE_TO_PB[p.value_encoding],
                values=p.values,
            )
        )
    elif isinstance(p, GradiVeQPayload):
        msg.gradiveq.CopyFrom(
            pb.GradiVeQPayload(
                compressor_version=p.compressor_version,
                slice_size=p.slice_size,
                dim=p.dim,
                coefficients=p.coefficients,
            )
        )
    else:  # pragma: no cover - the Payload union is closed
        raise TypeError(f"unknown payload type {type(p).__name__}")
    return msg


def tensor_from_proto(msg: pb.CompressedTensor) -> EncodedTensor:
    name = msg.name
    if len(msg.shape) > MAX_RANK:
        raise PayloadError(name, f"rank {len(msg.shape)} exceeds {MAX_RANK}")
    kind = msg.WhichOneof("payload")
    payload: Payload
    if kind == "sbc":
        s = msg.sbc
        payload = SBCPayload(mean=s.mean, golomb_b=s.golomb_b, nnz=s.nnz, bits=s.bits)
    elif kind == "stc":
        st = msg.stc
        payload = STCPayload(mu=st.mu, golomb_b=st.golomb_b, nnz=st.nnz, bits=st.bits, signs=st.signs)
    elif kind == "three_lc":
        s3 = msg.three_lc
        payload = ThreeLCPayload(scale=s3.scale, numel=s3.numel, zero_run=s3.zero_run, data=s3.data)
    elif kind == "dense":
        payload = DensePayload(_dtype_from_pb(msg.dense.encoding, name, "dense encoding"), msg.dense.data)
    elif kind == "sparse":
        sp = msg.sparse
        payload = SparsePayload(
            golomb_b=sp.golomb_b,
            nnz=sp.nnz,
            bits=sp.bits,
            value_encoding=_dtype_from_pb(sp.value_encoding, name, "value encoding"),
            values=sp.values,
        )
    elif kind == "gradiveq":
        g = msg.gradiveq
        payload = GradiVeQPayload(
            compressor_version=g.compressor_version, slice_size=g.slice_size, dim=g.dim, coefficients=g.coefficients
        )
    else:
        raise PayloadError(name, "no payload")
    return EncodedTensor(
        name=name,
        shape=tuple(int(d) for d in msg.shape),
        dtype=_dtype_from_pb(msg.dtype, name, "dtype"),
        codec_id=msg.codec_id,
        codec_version=msg.codec_version,
        payload=payload,
    )


def tensor_to_bytes(t: EncodedTensor) -> bytes:
    return tensor_to_proto(t).SerializeToString(deterministic=True)


def tensor_from_bytes(data: bytes) -> EncodedTensor:
    msg = pb.CompressedTensor()
    try:
        msg.ParseFromString(data)
    except _PbDecodeError as exc:
        raise PayloadError("", f"not a CompressedTensor message ({exc})") from None
    return tensor_from_proto(msg)


def update_to_bytes(u: EncodedUpdate) -> bytes:
    msg = pb.CompressedUpdate(
        format_version=u.format_version,
        base_model_version=u.base_model_version,
        tensors=[tensor_to_proto(t) for t in u.tensors],
    )
    return msg.SerializeToString(deterministic=True)


def update_from_bytes(data: bytes) -> EncodedUpdate:
    msg = pb.CompressedUpdate()
    try:
        msg.ParseFromString(data)
    except _PbDecodeError as exc:
        raise PayloadError("", f"not a CompressedUpdate message ({exc})") from None
    if msg.format_version != FORMAT_VERSION:
        raise PayloadError("", f"format version {msg.format_version} is not supported (have {FORMAT_VERSION})")
    return EncodedUpdate(
        base_model_version=msg.base_model_version,
        tensors=tuple(tensor_from_proto(t) for t in msg.tensors),
        format_version=msg.format_version,
    )


# --- messages that are not updates: DEFT allocations, GradiVeQ compressors -------------------


def _parse(msg, data: bytes, what: str):  # type: ignore[no-untyped-def]
    try:
        msg.ParseFromString(data)
    except _PbDecodeError as exc:
        raise PayloadError("", f"not a {what} message ({exc})") from None
    return msg


def allocation_to_bytes(a: DeftAllocation) -> bytes:
    msg = pb.DeftAllocation(
        round=a.round,
        partitions=[pb.DeftPartition(tensor=p.tensor, start=p.start, stop=p.stop, k=p.k) for p in a.partitions],
    )
    return msg.SerializeToString(deterministic=True)


def allocation_from_bytes(data: bytes) -> DeftAllocation:
    """Parse only; the receiver checks the partitions against its model (``fedcomp.methods.deft``)."""
    msg = _parse(pb.DeftAllocation(), data, "DeftAllocation")
    return DeftAllocation(
        round=msg.round,
        partitions=tuple(DeftPartition(p.tensor, p.start, p.stop, p.k) for p in msg.partitions),
    )


def compressor_to_bytes(c: GradiVeQCompressor) -> bytes:
    msg = pb.GradiVeQCompressor(
        version=c.version,
        tensors=[
            pb.GradiVeQBasis(name=b.name, slice_size=b.slice_size, dim=b.dim, basis=b.basis, whitening=b.whitening)
            for b in c.tensors
        ],
    )
    return msg.SerializeToString(deterministic=True)


def compressor_from_bytes(data: bytes) -> GradiVeQCompressor:
    """Parse only; the receiver checks sizes against its model (``fedcomp.methods.gradiveq``)."""
    msg = _parse(pb.GradiVeQCompressor(), data, "GradiVeQCompressor")
    return GradiVeQCompressor(
        version=msg.version,
        tensors=tuple(GradiVeQBasis(b.name, b.slice_size, b.dim, b.basis, b.whitening) for b in msg.tensors),
    )
