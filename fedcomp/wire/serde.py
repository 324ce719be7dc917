"""Protobuf <-> fedcomp data classes. The only module that imports generated code.

Parsing never trusts the bytes (FORMAT.md, "Envelope"): :func:`update_from_bytes` checks, in this
order and before it allocates anything from the message, that the update ends with its CRC-32 and
that the CRC matches; then it walks the top-level fields without parsing them, so the tensor count
is bounded (by the receiver's model when it passes ``expected``, else by :data:`MAX_TENSORS`)
before a single tensor is built; then it parses one tensor at a time, checks it is the canonical
encoding, that its ``codec_id`` carries the payload type FORMAT.md allows, and (with ``expected``)
its name, shape and size against the model's, before moving to the next. Anything else raises
:class:`PayloadError` naming what was wrong. Codec-level checks (payload lengths against the
expected shape, finite values) happen in each codec's decoder.

**Memory.** A tensor's payload bytes are never copied by the parser: it walks the tensor's fields
by hand (canonical order, at most one of each), cuts the payload's ``bytes`` fields out as
``memoryview`` slices of the received update, and gives protobuf only the small rest (names,
shape, scalars) to parse and check for canonical encoding. A dense payload's ``data`` stays that
view of the received bytes (its decoder copies it once, into the output tensor); the other
payload types' bytes fields are copied once into ``bytes`` (their codecs take ``bytes``; these
fields are small for every codec but dense). So parsing a 1.7 MB dense update allocates a few kB,
where parsing it whole allocated the message (1x), its re-serialization for the canonical check
(1x) and the ``bytes`` of its data (1x).

**The common tensors, fast.** With ``expected``, a tensor that is exactly the canonical encoding
of an SBC, 3LC or dense payload (what senders write every round) is read by hand, without
protobuf (:func:`_fast_tensor`); with the wire kernel built, the top-level walk and every tensor's
reading are two C calls for the whole update (``scan_update``, ``scan_tensors``: the same rules
byte for byte, tested against the Python readers on mutated bytes). Anything either declines goes
the general way above, which says what is wrong.

**Writing.** :func:`update_to_bytes` and :func:`tensor_to_bytes` write protobuf's canonical bytes
without protobuf copying the payloads: the framing (keys, varint lengths, the small fields) is
built here, each payload ``bytes`` field is copied once into the output, and a deferred dense
payload is cast straight into its slot (:mod:`fedcomp.wire.fast_writer`). The ``*_protobuf``
variants serialize through protobuf; the tests hold the two to the same bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import numpy as np
import torch
from google.protobuf.descriptor import FieldDescriptor as _FieldDescriptor
from google.protobuf.message import DecodeError as _PbDecodeError

from fedcomp import _native
from fedcomp.errors import PayloadError, shown
from fedcomp.v1 import wire_pb2 as pb
from fedcomp.wire import fast_writer
from fedcomp.wire.payloads import (
    FORMAT_VERSION,
    MAX_RANK,
    TORCH_DTYPES,
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
    filled,
)

#: Most tensors an update may hold when the receiver does not pass its model's tensors.
MAX_TENSORS = 65_536
#: With the model known, a tensor of ``n`` elements may take at most ``16 n + TENSOR_SLACK`` bytes
#: on the wire (no codec needs more: FORMAT.md, "Envelope"); a longer one is rejected unparsed.
TENSOR_SLACK = 65_536

#: The one payload type each codec id may carry (FORMAT.md); any other codec id is rejected.
PAYLOAD_OF_CODEC: dict[str, str] = {
    "sbc": "sbc",
    "stc": "stc",
    "lattice": "stc",
    "3lc": "three_lc",
    "topk": "sparse",
    "sparse": "sparse",
    "gradiveq": "gradiveq",
    "dense-fp32": "dense",
    "dense-fp16": "dense",
    "identity": "dense",
}

#: The ``bytes`` fields of each payload message, by the payload's field number in
#: ``CompressedTensor`` (the ``oneof payload``): (payload name, {field number: field name}).
#: The parser cuts these out of the received bytes instead of letting protobuf copy them.
_BYTES_FIELDS: dict[int, tuple[str, dict[int, str]]] = {
    10: ("sbc", {4: "bits"}),
    11: ("three_lc", {4: "data"}),
    12: ("dense", {2: "data"}),
    13: ("sparse", {3: "bits", 5: "values"}),
    14: ("gradiveq", {4: "coefficients"}),
    15: ("stc", {4: "bits", 5: "signs"}),
}
#: Most fields a canonical ``CompressedTensor`` has (name, shape, dtype, codec_id, codec_version,
#: payload) and a payload message has (``SparsePayload``, ``STCPayload``: 5).
_TENSOR_FIELDS, _PAYLOAD_FIELDS = 6, 5

#: The key of ``CompressedUpdate.crc32`` (field 4, wire type 5 = fixed32): the 5th byte from the end.
_CRC_TAG = 0x25
_CRC_LEN = 5


class TensorShape(Protocol):
    """What a receiver knows of each tensor it expects (``fedcomp.codecs.TensorSpec`` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


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
        msg.dense.CopyFrom(pb.DensePayload(encoding=_DTYPE_TO_PB[p.encoding], data=bytes(p.data)))
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
                coefficients=bytes(p.coefficients),  # bytes(bytes) is the same object: no copy
            )
        )
    else:  # pragma: no cover - the Payload union is closed
        raise TypeError(f"unknown payload type {type(p).__name__}")
    return msg


def tensor_from_proto(msg: pb.CompressedTensor, blobs: Mapping[str, memoryview] | None = None) -> EncodedTensor:
    """The data class of a parsed tensor; raises :class:`PayloadError` on a rank above
    :data:`MAX_RANK`, an unknown dtype, an unknown ``codec_id`` or a payload type it may not carry.

    ``blobs``: the payload's ``bytes`` fields by name, cut out of the received bytes before
    ``msg`` was parsed (``_parse_tensor``); they replace the (then empty) fields of ``msg``. A
    dense payload keeps its view (no copy); the others are copied once into ``bytes``."""
    name = msg.name
    cut = blobs or {}

    def blob(field: str, parsed: bytes) -> bytes:
        # One copy: the codecs of these payloads take ``bytes`` only (their decoders check the type).
        view = cut.get(field)
        return parsed if view is None else bytes(view)

    if len(msg.shape) > MAX_RANK:
        raise PayloadError(name, f"rank {len(msg.shape)} exceeds {MAX_RANK}")
    kind = msg.WhichOneof("payload")
    if kind is None:
        raise PayloadError(name, "no payload")
    allowed = PAYLOAD_OF_CODEC.get(msg.codec_id)
    if allowed is None:
        raise PayloadError(name, f"codec {msg.codec_id!r} is not part of the format ({sorted(PAYLOAD_OF_CODEC)})")
    if kind != allowed:
        raise PayloadError(name, f"codec {msg.codec_id!r} carries a {allowed} payload, not {kind}")
    payload: Payload
    if kind == "sbc":
        s = msg.sbc
        payload = SBCPayload(mean=s.mean, golomb_b=s.golomb_b, nnz=s.nnz, bits=blob("bits", s.bits))
    elif kind == "stc":
        st = msg.stc
        payload = STCPayload(
            mu=st.mu, golomb_b=st.golomb_b, nnz=st.nnz, bits=blob("bits", st.bits), signs=blob("signs", st.signs)
        )
    elif kind == "three_lc":
        s3 = msg.three_lc
        payload = ThreeLCPayload(scale=s3.scale, numel=s3.numel, zero_run=s3.zero_run, data=blob("data", s3.data))
    elif kind == "dense":
        dense_data = cut.get("data")
        payload = DensePayload(
            _dtype_from_pb(msg.dense.encoding, name, "dense encoding"),
            msg.dense.data if dense_data is None else dense_data,
        )
    elif kind == "sparse":
        sp = msg.sparse
        payload = SparsePayload(
            golomb_b=sp.golomb_b,
            nnz=sp.nnz,
            bits=blob("bits", sp.bits),
            value_encoding=_dtype_from_pb(sp.value_encoding, name, "value encoding"),
            values=blob("values", sp.values),
        )
    else:
        g = msg.gradiveq
        payload = GradiVeQPayload(
            compressor_version=g.compressor_version,
            slice_size=g.slice_size,
            dim=g.dim,
            coefficients=cut.get("coefficients", g.coefficients),  # a view: the decoder copies once
        )
    return EncodedTensor(
        name=name,
        shape=tuple(int(d) for d in msg.shape),
        dtype=_dtype_from_pb(msg.dtype, name, "dtype"),
        codec_id=msg.codec_id,
        codec_version=msg.codec_version,
        payload=payload,
    )


def tensor_to_bytes(t: EncodedTensor) -> bytes:
    """The canonical encoding of one ``CompressedTensor`` (what golden files hold), written by
    :mod:`fedcomp.wire.fast_writer` (each payload byte written once); the same bytes as
    :func:`tensor_to_bytes_protobuf`."""
    parts, _ = _tensor_parts(t)
    return fast_writer.write(parts)


def tensor_to_bytes_protobuf(t: EncodedTensor) -> bytes:
    """:func:`tensor_to_bytes` through protobuf's own serializer: the reference the fast writer
    is tested against (slower: protobuf copies the payload several times)."""
    return tensor_to_proto(t).SerializeToString(deterministic=True)


#: The ``oneof payload`` field number of each payload type.
_PAYLOAD_NUMBER: dict[type, int] = {
    SBCPayload: 10,
    ThreeLCPayload: 11,
    DensePayload: 12,
    fast_writer.DeferredDensePayload: 12,
    SparsePayload: 13,
    GradiVeQPayload: 14,
    STCPayload: 15,
}


#: ``DensePayload.encoding`` as its serialized field, the dense payload's key, its ``data`` key.
_DENSE_ENCODING = {name: fast_writer.key(1, 0) + fast_writer.varint(v) for name, v in _DTYPE_TO_PB.items()}
_DENSE_KEY, _DENSE_DATA_KEY = fast_writer.key(12, 2), fast_writer.key(2, 2)


def _string_field(number: int, value: str) -> bytes:
    if not value:
        return b""
    raw = value.encode("utf-8")
    return fast_writer.key(number, 2) + fast_writer.varint(len(raw)) + raw


def _varint_field(number: int, value: int) -> bytes:
    return fast_writer.key(number, 0) + fast_writer.varint(value) if value else b""


def _tensor_head(t: EncodedTensor) -> bytes:
    """Fields 1-5 of a ``CompressedTensor`` as a deterministic protobuf serializer writes them:
    in field order, proto3 defaults (empty string, no dims, 0) omitted, ``shape`` packed."""
    return _head(t.name, tuple(t.shape), t.dtype, t.codec_id, t.codec_version)


@functools.lru_cache(maxsize=4096)  # the same tensors every round: their heads are made once
def _head(name: str, dims: tuple[int, ...], dtype: str, codec_id: str, version: int) -> bytes:
    return (
        _name_and_shape(name, tuple(int(d) for d in dims))
        + _varint_field(3, _DTYPE_TO_PB[dtype])
        + _string_field(4, codec_id)
        + _varint_field(5, version)
    )


@functools.lru_cache(maxsize=4096)
def _name_and_shape(name: str, dims: tuple[int, ...]) -> bytes:
    """Fields 1 and 2 of a canonical ``CompressedTensor``: the start of :func:`_head`, and what
    :func:`_fast_tensor` compares a received tensor's first bytes with."""
    shape = b"".join(fast_writer.varint(d) for d in dims)
    return _string_field(1, name) + (fast_writer.key(2, 2) + fast_writer.varint(len(shape)) + shape if dims else b"")


def _payload_scalars(t: EncodedTensor, number: int) -> list[tuple[int, bytes]]:
    """The payload's fields other than its ``bytes`` fields, as (field number, serialized field),
    serialized by protobuf (floats, enums, bools exactly as it writes them); an SBC or 3LC
    payload's by hand where that is plainly the same (:data:`_BY_HAND`)."""
    p = t.payload
    hand = _BY_HAND.get(type(p))
    if hand is not None:
        fast = hand.scalars(p)
        if fast is not None:
            return fast
    kind, cuttable = _BYTES_FIELDS[_PAYLOAD_NUMBER[type(p)]]
    stripped = dataclasses.replace(p, **dict.fromkeys(cuttable.values(), b""))  # type: ignore[arg-type]
    raw = getattr(tensor_to_proto(dataclasses.replace(t, payload=stripped)), kind).SerializeToString(deterministic=True)
    view = memoryview(raw)
    return [(f[0], bytes(view[f[2] : f[4]])) for f in _walk(view, 0, len(view), _PAYLOAD_FIELDS, "payload")]


#: ``SBCPayload``'s scalar keys: ``mean`` a float (wire type 5, four little-endian bytes),
#: ``golomb_b`` and ``nnz`` varints.
_SBC_MEAN_KEY, _SBC_B_KEY, _SBC_NNZ_KEY = fast_writer.key(1, 5), fast_writer.key(2, 0), fast_writer.key(3, 0)
_F32 = struct.Struct("<f")
#: ``SBCPayload.bits``' key, and the key of ``CompressedTensor.sbc`` (the payload's field).
_SBC_BITS_KEY, _SBC_KEY = fast_writer.key(4, 2), fast_writer.key(_PAYLOAD_NUMBER[SBCPayload], 2)
#: ``ThreeLCPayload``'s keys: ``scale`` a float, ``numel`` a varint, ``zero_run`` a bool (one
#: varint byte, 1 when set), ``data`` bytes; and the key of ``CompressedTensor.three_lc``.
_TLC_SCALE_KEY, _TLC_NUMEL_KEY, _TLC_ZERO_RUN_KEY = fast_writer.key(1, 5), fast_writer.key(2, 0), fast_writer.key(3, 0)
_TLC_DATA_KEY, _TLC_KEY = fast_writer.key(4, 2), fast_writer.key(_PAYLOAD_NUMBER[ThreeLCPayload], 2)


def _float32_field(key: bytes, value: object) -> bytes | None:
    """A ``float`` field as protobuf writes it, or None where protobuf has a say: not a Python
    float, not exactly a float32 (protobuf rounds it; beyond its range it refuses), NaN, or a zero
    (+0.0 is omitted as proto3's default; -0.0 is left to protobuf too)."""
    if type(value) is not float:
        return None
    try:
        raw = _F32.pack(value)
    except OverflowError:  # beyond float32's range
        return None
    if _F32.unpack(raw)[0] != value or not value:  # not exactly a float32, NaN, or a zero
        return None
    return key + raw


def _sbc_scalars(p: SBCPayload) -> list[tuple[int, bytes]] | None:
    """``SBCPayload``'s ``mean``, ``golomb_b`` and ``nnz`` fields as protobuf writes them, or None
    where protobuf has a say (a mean of zero or not exactly a float32, an integer out of its
    field's range): then :func:`_payload_scalars` asks protobuf. The SBC encoder's payloads take
    this path (about 80 us a tensor less); tests compare it with protobuf's bytes."""
    b, nnz = p.golomb_b, p.nnz
    if type(b) is not int or type(nnz) is not int or not (0 <= b < 1 << 32 and 0 <= nnz < 1 << 64):
        return None
    mean = _float32_field(_SBC_MEAN_KEY, p.mean)
    if mean is None:
        return None
    out = [(1, mean)]
    if b:
        out.append((2, _SBC_B_KEY + fast_writer.varint(b)))
    if nnz:
        out.append((3, _SBC_NNZ_KEY + fast_writer.varint(nnz)))
    return out


def _threelc_scalars(p: ThreeLCPayload) -> list[tuple[int, bytes]] | None:
    """``ThreeLCPayload``'s ``scale``, ``numel`` and ``zero_run`` fields as protobuf writes them,
    or None where protobuf has a say (a scale of zero, as an all-zero tensor has, or not exactly a
    float32; ``numel`` out of range; a ``zero_run`` that is not a bool). The 3LC encoders'
    payloads take this path; tests compare it with protobuf's bytes."""
    numel, zero_run = p.numel, p.zero_run
    if type(numel) is not int or type(zero_run) is not bool or not 0 <= numel < 1 << 64:
        return None
    scale = _float32_field(_TLC_SCALE_KEY, p.scale)
    if scale is None:
        return None
    out = [(1, scale)]
    if numel:
        out.append((2, _TLC_NUMEL_KEY + fast_writer.varint(numel)))
    if zero_run:
        out.append((3, _TLC_ZERO_RUN_KEY + b"\x01"))
    return out


@dataclasses.dataclass(frozen=True)
class _HandWritten:
    """A payload type whose scalars :func:`_tensor_parts` writes by hand, before its one ``bytes``
    field (the last field of the payload)."""

    scalars: Callable[[Any], list[tuple[int, bytes]] | None]
    blob: str  # the bytes field's attribute
    blob_key: bytes
    payload_key: bytes  # the key of the payload's field in ``CompressedTensor``


#: The payloads written by hand: what their encoders send every round.
_BY_HAND: dict[type, _HandWritten] = {
    SBCPayload: _HandWritten(_sbc_scalars, "bits", _SBC_BITS_KEY, _SBC_KEY),
    ThreeLCPayload: _HandWritten(_threelc_scalars, "data", _TLC_DATA_KEY, _TLC_KEY),
}


def _tensor_parts(t: EncodedTensor) -> tuple[list[fast_writer.Part], int]:
    """The parts of one canonical ``CompressedTensor`` and their total length: the same bytes as
    :func:`tensor_to_bytes_protobuf`, with the payload's ``bytes`` fields (a dense payload's
    values still a tensor, when deferred) referenced rather than copied."""
    p = t.payload
    if isinstance(p, DensePayload):  # the hot path (every value sent): one enum and the data
        n = p.nbytes if isinstance(p, fast_writer.DeferredDensePayload) else memoryview(p.data).nbytes
        enum = _DENSE_ENCODING[p.encoding]
        data_head = _DENSE_DATA_KEY + fast_writer.varint(n) if n else b""
        sub_len = len(enum) + len(data_head) + n
        head = _tensor_head(t) + _DENSE_KEY + fast_writer.varint(sub_len) + enum + data_head
        dense: fast_writer.Part = p if isinstance(p, fast_writer.DeferredDensePayload) else p.data
        return [head, dense], len(head) + n
    hand = _BY_HAND.get(type(p))
    if hand is not None:  # SBC's and 3LC's tensors, every round: fields 1-3 by hand, then the bytes
        scalars = hand.scalars(p)
        blob = getattr(p, hand.blob)
        n = memoryview(blob).nbytes
        if scalars is not None and n:
            pre = b"".join(raw for _, raw in scalars) + hand.blob_key + fast_writer.varint(n)
            head = _tensor_head(t) + hand.payload_key + fast_writer.varint(len(pre) + n) + pre
            return [head, blob], len(head) + n
    number = _PAYLOAD_NUMBER.get(type(p))
    if number is None:  # pragma: no cover - the Payload union is closed
        raise TypeError(f"unknown payload type {type(p).__name__}")
    fields: list[tuple[int, list[fast_writer.Part]]] = [(f, [raw]) for f, raw in _payload_scalars(t, number)]
    for field, attr in _BYTES_FIELDS[number][1].items():
        value: fast_writer.Part = p if isinstance(p, fast_writer.DeferredDensePayload) else getattr(p, attr)
        n = fast_writer._part_len(value)
        if n:  # proto3: an empty bytes field is its default, omitted
            fields.append((field, [fast_writer.key(field, 2) + fast_writer.varint(n), value]))
    fields.sort(key=lambda f: f[0])
    sub = [part for _, parts in fields for part in parts]
    sub_len = sum(fast_writer._part_len(part) for part in sub)
    head = _tensor_head(t) + fast_writer.key(number, 2) + fast_writer.varint(sub_len)
    return [head, *sub], len(head) + sub_len


def _parse_canonical(data: bytes | memoryview, what: str) -> pb.CompressedTensor:
    """Parse one ``CompressedTensor`` and require the canonical encoding (FORMAT.md): the bytes a
    deterministic serializer writes for the parsed value, with no unknown fields. Rejects
    duplicate or reordered fields, non-minimal varints, explicitly encoded defaults, bool
    values other than 0 and 1, and out-of-range integers, so each message has exactly one encoding
    (and its CRC exactly one meaning)."""
    msg = pb.CompressedTensor()
    try:
        msg.ParseFromString(data)
    except _PbDecodeError as exc:
        raise PayloadError("", f"{what} is not a CompressedTensor message ({exc})") from None
    msg.DiscardUnknownFields()
    if msg.SerializeToString(deterministic=True) != data:
        raise PayloadError(msg.name, f"{what} is not canonically encoded (FORMAT.md, Envelope)")
    return msg


_key = fast_writer.key
_encode_varint = fast_writer.varint


def _walk(data: memoryview, start: int, end: int, most: int, what: str) -> list[tuple[int, int, int, int, int]]:
    """The fields of the message ``data[start:end]`` as ``(field, wire type, key at, value at,
    stop)``, without parsing them. Requires what a canonical encoding has (FORMAT.md, Envelope):
    field numbers strictly increasing (so each field at most once, in order), at most ``most``
    fields, minimal varints; raises :class:`PayloadError` otherwise, and on a truncated field or a
    wire type protobuf does not write (3, 4: groups; 6, 7)."""
    fields: list[tuple[int, int, int, int, int]] = []
    pos, last = start, 0
    try:
        while pos < end:
            at = pos
            key, pos = _varint(data, pos, end)
            field, wire = key >> 3, key & 7
            if field <= last or len(fields) == most:
                raise PayloadError("", f"{what} is not canonically encoded (FORMAT.md, Envelope)")
            value_at = pos
            if wire == 0:
                _, pos = _varint(data, pos, end)
            elif wire == 2:
                n, value_at = _varint(data, pos, end)
                pos = value_at + n
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise PayloadError("", f"{what} is not a CompressedTensor message (wire type {wire} at byte {at})")
            if pos > end:
                raise PayloadError("", f"{what} is not a CompressedTensor message (field {field} is truncated)")
            fields.append((field, wire, at, value_at, pos))
            last = field
    except PayloadError as exc:
        if exc.reason.startswith(what):
            raise
        if "not minimally encoded" in exc.reason:
            raise PayloadError("", f"{what} is not canonically encoded (FORMAT.md, Envelope)") from None
        raise PayloadError("", f"{what} is not a CompressedTensor message ({exc.reason})") from None
    return fields


def _wire_type(field: _FieldDescriptor) -> int:
    """The wire type a canonical encoding gives ``field`` (repeated scalars are packed)."""
    if field.is_repeated or field.type in (field.TYPE_STRING, field.TYPE_BYTES, field.TYPE_MESSAGE):
        return 2
    if field.type in (field.TYPE_FLOAT, field.TYPE_FIXED32, field.TYPE_SFIXED32):
        return 5
    if field.type in (field.TYPE_DOUBLE, field.TYPE_FIXED64, field.TYPE_SFIXED64):
        return 1
    return 0


#: Wire type of each field of ``CompressedTensor`` and of each payload message, by field number.
_TENSOR_WIRE = {f.number: _wire_type(f) for f in pb.CompressedTensor.DESCRIPTOR.fields}
_PAYLOAD_WIRE = {
    number: {
        f.number: _wire_type(f) for f in pb.CompressedTensor.DESCRIPTOR.fields_by_number[number].message_type.fields
    }
    for number in _BYTES_FIELDS
}


def _parse_tensor(data: bytes | memoryview, what: str) -> tuple[pb.CompressedTensor, dict[str, memoryview]]:
    """Parse one canonical ``CompressedTensor`` without copying its payload's bytes fields.

    The tensor's fields are walked by hand (:func:`_walk`): known field numbers, in order, each
    with the wire type a canonical encoding gives it (else "not canonically encoded", before
    anything is copied). When the last one is the payload (canonical order puts it last), its
    ``bytes`` fields (:data:`_BYTES_FIELDS`) are cut out as views of ``data``; protobuf parses the
    rest (the tensor with a payload message holding only its scalars: a few dozen bytes plus the
    name and codec id) and :func:`_parse_canonical` checks it is canonical. The cut fields are
    canonical too: in order, known, non-empty (an empty one is its default and must be omitted),
    minimal length varints. Returns the parsed rest and the cut fields by name."""
    view = memoryview(data).toreadonly()
    fields = _walk(view, 0, len(view), _TENSOR_FIELDS, what)
    payloads = [f for f in fields if f[0] in _BYTES_FIELDS]
    if any(_TENSOR_WIRE.get(f[0]) != f[1] for f in fields) or len(payloads) > 1:
        raise PayloadError("", f"{what} is not canonically encoded (FORMAT.md, Envelope)")
    if not payloads:
        return _parse_canonical(view, what), {}
    number, _, key_at, sub_at, stop = fields[-1]  # the payload: the highest field number, so last
    kind, cuttable = _BYTES_FIELDS[number]
    wires = _PAYLOAD_WIRE[number]
    rest = bytearray()
    cut: dict[str, memoryview] = {}
    for field, wire, at, value_at, end in _walk(view, sub_at, stop, _PAYLOAD_FIELDS, f"{what} ({kind} payload)"):
        if wires.get(field) != wire:
            raise PayloadError("", f"{what} ({kind} payload) is not canonically encoded (FORMAT.md, Envelope)")
        name = cuttable.get(field)
        if name is None:
            rest += view[at:end]
        elif end == value_at:
            raise PayloadError(
                "", f"{what} ({kind}.{name} present but empty) is not canonically encoded (FORMAT.md, Envelope)"
            )
        else:
            cut[name] = view[value_at:end]
    head = bytes(view[:key_at]) + _key(number, 2) + _encode_varint(len(rest)) + bytes(rest)
    return _parse_canonical(head, what), cut


def tensor_from_bytes(data: bytes) -> EncodedTensor:
    """One canonical ``CompressedTensor`` (no checksum: that lives in the update around it).
    A dense payload's ``data`` is a view of ``data`` (not a copy)."""
    msg, cut = _parse_tensor(data, "tensor")
    return tensor_from_proto(msg, cut)


def update_to_bytes(u: EncodedUpdate) -> bytes:
    """The canonical ``CompressedUpdate``, its ``crc32`` field last (FORMAT.md, Envelope).

    Written by :mod:`fedcomp.wire.fast_writer`: the framing by hand (every tensor in one call of
    the wire kernel where it is built, :data:`_FRAME`; else :func:`_hand_framed` a tensor), each
    payload byte once into the output (a deferred dense payload cast straight into its slot), the
    CRC on two threads. The same bytes as :func:`update_to_bytes_protobuf` (tested for every
    payload type, each way)."""
    return _update_layout(u).to_bytes(crc_tag=_CRC_TAG)


def update_size(u: EncodedUpdate) -> int:
    """``len(update_to_bytes(u))``, found without writing the bytes (nothing cast, copied or
    checksummed): what a sender compares payloads by before it sends one (the server's replica
    asked for its whole model's length every round, 102 MB written for a ResNet-50)."""
    return _update_layout(u).size + _CRC_LEN


def _update_layout(u: EncodedUpdate) -> fast_writer.Layout:
    """Where every byte of :func:`update_to_bytes` comes from, and how many there are."""
    layout = fast_writer.Layout()
    header = _varint_field(1, u.format_version) + _varint_field(2, u.base_model_version)
    if _FRAME is not None:
        tensors = u.tensors
        heads = [_head(t.name, tuple(t.shape), t.dtype, t.codec_id, t.codec_version) for t in tensors]
        layout.size, layout.parts = _FRAME(
            tensors, heads, header, _FRAME_TYPES, _FRAME_KEYS, _DENSE_ENCODING, _tensor_parts
        )
        return layout
    layout.add(header)
    for t in u.tensors:
        framed = _hand_framed(t)
        if framed is not None:
            layout.add_framed(*framed)
            continue
        parts, n = _tensor_parts(t)
        head = parts[0]  # always bytes: the envelope
        layout.add(_TENSORS_KEY + fast_writer.varint(n) + head)  # type: ignore[operator]
        for part in parts[1:]:
            layout.add(part)
    return layout


def _hand_framed(t: EncodedTensor) -> tuple[bytes, fast_writer.Part, int] | None:
    """An SBC, 3LC or dense tensor of :func:`update_to_bytes` as ``(frame, blob, len(blob))``:
    the tensor's field key and length, its envelope and every payload field before the ``bytes``
    one, which follows (a deferred dense payload itself, cast when written);
    :func:`_tensor_parts`' bytes in one function, with no list per tensor (what a whole-update
    encode sends every round: about a third of the writer's time a tensor). None where
    :func:`_tensor_parts` has a say (another payload, a scalar protobuf writes, no bytes)."""
    p = t.payload
    kind = type(p)
    varint = fast_writer.varint
    blob: fast_writer.Part
    if kind is fast_writer.DeferredDensePayload or kind is DensePayload:
        d = cast(DensePayload, p)
        if isinstance(d, fast_writer.DeferredDensePayload):
            blob, n = d, d.nbytes
        else:
            blob = d.data
            n = memoryview(blob).nbytes
        if not n:
            return None
        return _dense_frame(t.name, t.shape, t.dtype, t.codec_id, t.codec_version, d.encoding, n), blob, n
    else:
        hand = _BY_HAND.get(kind)
        if hand is None:
            return None
        blob = getattr(p, hand.blob)
        scalars = hand.scalars(p)
        if type(blob) is not bytes or not blob or scalars is None:
            return None
        n = len(blob)
        key, pre = hand.payload_key, b"".join([raw for _, raw in scalars]) + hand.blob_key + varint(n)
    inner = _head(t.name, tuple(t.shape), t.dtype, t.codec_id, t.codec_version) + key + varint(len(pre) + n) + pre
    return _TENSORS_KEY + varint(len(inner) + n) + inner, blob, n


_TENSORS_KEY = fast_writer.key(3, 2)


@functools.lru_cache(maxsize=4096)  # the same tensors every round, their dense values of one size
def _dense_frame(
    name: str, dims: tuple[int, ...], dtype: str, codec_id: str, version: int, encoding: str, n: int
) -> bytes:
    """:func:`_hand_framed`'s frame of a dense payload of ``n`` bytes: nothing in it depends on the
    values (a third of the writer's time a tensor, made once)."""
    varint = fast_writer.varint
    pre = _DENSE_ENCODING[encoding] + _DENSE_DATA_KEY + varint(n)
    inner = _head(name, tuple(dims), dtype, codec_id, version) + _DENSE_KEY + varint(len(pre) + n) + pre
    return _TENSORS_KEY + varint(len(inner) + n) + inner


def update_to_bytes_protobuf(u: EncodedUpdate) -> bytes:
    """:func:`update_to_bytes` through protobuf's own serializer: the reference the fast writer
    is tested against."""
    msg = pb.CompressedUpdate(
        format_version=u.format_version,
        base_model_version=u.base_model_version,
        tensors=[tensor_to_proto(t) for t in u.tensors],
    )
    return seal(msg.SerializeToString(deterministic=True))


def seal(body: bytes) -> bytes:
    """``body`` (a canonical ``CompressedUpdate`` without ``crc32``) with its ``crc32`` field
    appended: the same bytes protobuf writes with the field set, since field 4 sorts last."""
    return body + bytes([_CRC_TAG]) + fast_writer.crc32(body).to_bytes(4, "little")


def _varint(data: bytes | memoryview, pos: int, end: int) -> tuple[int, int]:
    """The minimal (canonical) base-128 varint at ``data[pos:end]`` and the position after it."""
    if pos < end:  # one byte (keys, most lengths and values): the common case, checked first
        first = data[pos]
        if first < 0x80:
            return first, pos + 1
    value = shift = 0
    start = pos
    while True:
        if pos >= end:
            raise PayloadError("", f"truncated varint at byte {start}")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
        if shift > 63:
            raise PayloadError("", f"varint at byte {start} is longer than 10 bytes")
    if byte == 0 and pos - start > 1:
        raise PayloadError("", f"varint at byte {start} is not minimally encoded")
    if value >= 1 << 64:
        raise PayloadError("", f"varint at byte {start} exceeds 64 bits")
    return value, pos


def _scan_update(data: bytes | memoryview, end: int, most: int, bound: str) -> tuple[int, int, array[int]]:
    """:func:`_scan_update_py`, by the wire kernel where it is built (room for ``most`` spans is
    made first: call it with a model's count): Python then walks only an update the kernel
    refuses, to say what is wrong."""
    if _SCAN_UPDATE is not None:
        wide = end >= 1 << 32
        spans = array("q" if wide else "I", bytes(2 * most * (8 if wide else 4)))
        found = _SCAN_UPDATE(data, end, most, wide, spans)
        if found is not None:
            version, base, count = found
            del spans[2 * count :]
            return version, base, spans
    return _scan_update_py(data, end, most, bound)


def _scan_update_py(data: bytes | memoryview, end: int, most: int, bound: str) -> tuple[int, int, array[int]]:
    """Walk the top-level fields of ``data[:end]`` (a ``CompressedUpdate`` without its CRC)
    without parsing any tensor: ``(format_version, base_model_version, tensor bounds)``, the
    bounds flat as ``start0, stop0, start1, stop1, ...`` (8 bytes a tensor below 4 GiB, else 16:
    65,536 tensors without a model cost 0.5 MB).

    Fields must come in canonical order (1, 2, then 3 repeated), defaults omitted, nothing else;
    the walk stops at tensor number ``most + 1`` (``bound`` says where ``most`` comes from), so a
    message of a million tiny tensors costs ``most`` steps, not a million."""
    version = base = 0
    spans = array("I" if end < 1 << 32 else "q")
    pos, last = 0, 0
    while pos < end:
        at = pos
        key, pos = _varint(data, pos, end)
        field, wire = key >> 3, key & 7
        if field in (1, 2) and wire == 0 and field > last:
            value, pos = _varint(data, pos, end)
            if value == 0:
                raise PayloadError("", f"field {field} at byte {at} encodes its default 0 (not canonical)")
            if field == 1:
                version = value
            else:
                base = value
        elif field == 3 and wire == 2 and last <= 3:
            n, pos = _varint(data, pos, end)
            if n > end - pos:
                raise PayloadError(
                    "", f"tensor {len(spans) // 2} at byte {at} is truncated ({n} bytes, {end - pos} left)"
                )
            if len(spans) == 2 * most:
                raise PayloadError("", f"update has more than {most} tensors ({bound})")
            spans.append(pos)
            spans.append(pos + n)
            pos += n
        else:
            raise PayloadError("", f"unexpected field {field} (wire type {wire}) at byte {at}")
        last = field
    return version, base, spans


def update_from_bytes(
    data: bytes,
    expected: Sequence[TensorShape] | None = None,
    *,
    max_tensors: int = MAX_TENSORS,
) -> EncodedUpdate:
    """Parse an untrusted ``CompressedUpdate`` (FORMAT.md, Envelope), checking before it
    allocates: the ``crc32`` trailer and its CRC first, then the tensor count, then each tensor
    in turn (canonical encoding, codec and payload type, and with ``expected``, the receiver's
    tensors in order, name, shape and size) before the next is parsed.

    ``expected``: the tensors the receiver's model has (e.g. ``fedcomp.methods.update.specs_of``);
    without it the count is bounded by ``max_tensors`` only and the shapes are left to the
    codecs' decoders. Raises :class:`PayloadError` naming what was wrong.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError("", f"an update is bytes, not {type(data).__name__}")
    view = memoryview(data)
    end = len(view) - _CRC_LEN
    if end < 0 or view[end] != _CRC_TAG:
        if bytes(view[:2]) == b"\x08\x01":
            raise PayloadError(
                "", f"format version 1 (no checksum) is not supported (have {FORMAT_VERSION}: FORMAT.md, Envelope)"
            )
        raise PayloadError("", "no crc32 field at the end of the update (FORMAT.md, Envelope)")
    sent = int.from_bytes(view[end + 1 :], "little")
    actual = fast_writer.crc32(view[:end])  # two threads on a large update
    _check_crc(sent, actual)
    return _parse_update(view, end, expected, max_tensors)


def _check_crc(sent: int, actual: int) -> None:
    if sent != actual:
        raise PayloadError("", f"checksum mismatch: crc32 says {sent:#010x}, the bytes give {actual:#010x}")


def update_from_bytes_deferred(
    data: bytes,
    expected: Sequence[TensorShape] | None = None,
    *,
    max_tensors: int = MAX_TENSORS,
) -> tuple[EncodedUpdate, Callable[[], None]]:
    """:func:`update_from_bytes` with the CRC still running: the update parsed (every check but
    the CRC's) and a ``verify()`` that waits for the CRC-32, computed on a worker thread, and
    raises the same :class:`PayloadError` on a mismatch.

    For a receiver that decodes the update at once (:func:`fedcomp.methods.update.decode_update_bytes`):
    the CRC of a large update overlaps the decode instead of preceding it, where torch decodes on
    one thread (else it is checked at once, as by :func:`update_from_bytes`). Safe because the CRC
    guards against corruption, not against a hostile sender (who can always send a valid one):
    the parse and the decoders check everything else and bound every allocation by the model's
    shapes either way. Call ``verify()`` before using anything decoded."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise PayloadError("", f"an update is bytes, not {type(data).__name__}")
    view = memoryview(data)
    end = len(view) - _CRC_LEN
    # Deferred only beside single-threaded torch decoding (the reference app's torch-threads = 1):
    # beside torch's own two threads the CRC thread slows the casts as much as it saves.
    if end < _DEFER_CRC_MIN or view[end] != _CRC_TAG or torch.get_num_threads() != 1:
        update = update_from_bytes(data, expected, max_tensors=max_tensors)
        return update, lambda: None
    sent = int.from_bytes(view[end + 1 :], "little")
    pending = fast_writer.crc32_async(view[:end])

    def verify() -> None:
        _check_crc(sent, pending.result())

    try:
        update = _parse_update(view, end, expected, max_tensors)
    except PayloadError:
        verify()  # a corrupted update: report the checksum rather than what the corruption broke
        raise
    return update, verify


#: Updates at least this large have their CRC deferred by :func:`update_from_bytes_deferred`.
_DEFER_CRC_MIN = 1 << 20


def _parse_update(
    view: memoryview, end: int, expected: Sequence[TensorShape] | None, max_tensors: int
) -> EncodedUpdate:
    """The update in ``view[:end]`` (its CRC checked or deferred by the caller)."""
    if expected is None:
        most, bound = max_tensors, "the limit without a model"
    else:
        most, bound = len(expected), "the model's count"
    scan = _scan_update_py if expected is None else _scan_update  # (the kernel makes room for most)
    version, base, spans = scan(view, end, most, bound)
    if version != FORMAT_VERSION:
        raise PayloadError("", f"format version {version} is not supported (have {FORMAT_VERSION})")
    count = len(spans) // 2
    if expected is not None and count != len(expected):
        raise PayloadError("", f"update has {count} tensors, expected {len(expected)}")
    tensors = []
    model = _model_of(expected) if expected is not None else None
    scanned = _scan_fast(view, spans, model) if model is not None else None
    for i in range(count):
        start, stop = spans[2 * i], spans[2 * i + 1]
        if expected is not None and model is not None:
            want, numel = expected[i], model.numels[i]
            if stop - start > 16 * numel + TENSOR_SLACK:
                raise PayloadError(
                    want.name,
                    f"{stop - start} bytes on the wire for {numel} elements (at most {16 * numel + TENSOR_SLACK})",
                )
            if scanned is not None:
                fast = _fast_built(scanned[i], view, want.name, model.dims[i])
            else:
                fast = _fast_tensor(view[start:stop], want)
            if fast is not None:
                tensors.append(fast)
                continue
        msg, cut = _parse_tensor(view[start:stop], f"tensor {i}")
        if expected is not None:
            if msg.name != want.name:
                raise PayloadError(want.name, f"found tensor {shown(msg.name)} in its place (tensor {i})")
            if tuple(int(d) for d in msg.shape) != tuple(int(d) for d in want.shape):
                raise PayloadError(want.name, f"shape {list(msg.shape)} where {list(want.shape)} was expected")
        tensors.append(tensor_from_proto(msg, cut))
    return EncodedUpdate(base_model_version=base, tensors=tuple(tensors), format_version=version)


#: Codec ids as they stand on the wire, for :func:`_fast_tensor`.
_CODEC_ID_BYTES = {cid.encode(): cid for cid in PAYLOAD_OF_CODEC}
#: The keys :func:`_fast_tensor` reads: ``dtype``, ``codec_id``, ``codec_version``, the ``sbc``,
#: ``three_lc`` and ``dense`` payloads, and their fields.
_DTYPE_KEY, _CODEC_ID_KEY, _VERSION_KEY = fast_writer.key(3, 0)[0], fast_writer.key(4, 2)[0], fast_writer.key(5, 0)[0]
_FAST_PAYLOAD_KEYS = {"sbc": _SBC_KEY[0], "three_lc": _TLC_KEY[0], "dense": _DENSE_KEY[0]}
_DENSE_ENCODING_KEY = fast_writer.key(1, 0)[0]


def _fast_tensor(data: memoryview, want: TensorShape) -> EncodedTensor | None:
    """The tensor the general path (:func:`_parse_tensor`, :func:`tensor_from_proto`) makes of
    ``data``, or None: read by hand, without protobuf, for the tensors a server receives every
    round (an SBC, 3LC or dense payload, every field present and of its common size) when ``data``
    is exactly the canonical encoding of a tensor named and shaped as ``want``. It accepts only
    bytes the general path accepts, and makes the same tensor of them (tested on mutated
    tensors); anything else, valid or not, is left to the general path (None), which reports
    what is wrong. About a fifth of its time per tensor."""
    dims = tuple(int(d) for d in want.shape)
    if len(dims) > MAX_RANK:
        return None
    prefix = _name_and_shape(want.name, dims)
    pos, stop = len(prefix), len(data)
    if stop < pos + 8 or data[:pos] != prefix or data[pos] != _DTYPE_KEY:
        return None
    dtype = _PB_TO_DTYPE.get(data[pos + 1])
    if dtype is None or data[pos + 2] != _CODEC_ID_KEY:
        return None
    n = data[pos + 3]
    codec_id = _CODEC_ID_BYTES.get(bytes(data[pos + 4 : pos + 4 + n])) if n < 0x80 else None
    pos += 4 + n
    if codec_id is None or stop < pos + 3 or data[pos] != _VERSION_KEY:
        return None
    version = data[pos + 1]
    kind = PAYLOAD_OF_CODEC[codec_id]
    if not 0 < version < 0x80 or data[pos + 2] != _FAST_PAYLOAD_KEYS.get(kind):
        return None
    try:
        length, sub = _varint(data, pos + 3, stop)
        if sub + length != stop:
            return None
        payload = _FAST_PAYLOADS[kind](data, sub, stop)
    except PayloadError:  # a varint the general path reports
        return None
    if payload is None:
        return None
    return EncodedTensor(
        name=want.name, shape=dims, dtype=dtype, codec_id=codec_id, codec_version=version, payload=payload
    )


def _fast_sbc(data: memoryview, pos: int, stop: int) -> SBCPayload | None:
    """:func:`_fast_tensor`'s SBC payload in ``data[pos:stop]``: its scalars must be what the
    writer makes of their values (:func:`_sbc_scalars`: so canonical), its bits present."""
    start = pos
    if stop < pos + 5 or data[pos] != _SBC_MEAN_KEY[0]:
        return None
    mean = _F32.unpack(data[pos + 1 : pos + 5])[0]
    pos += 5
    b = nnz = 0
    if pos < stop and data[pos] == _SBC_B_KEY[0]:
        b, pos = _varint(data, pos + 1, stop)
    if pos < stop and data[pos] == _SBC_NNZ_KEY[0]:
        nnz, pos = _varint(data, pos + 1, stop)
    at = _last_blob(data, pos, stop, _SBC_BITS_KEY[0])
    if at is None:
        return None
    payload = SBCPayload(mean=mean, golomb_b=b, nnz=nnz, bits=bytes(data[at:stop]))
    return payload if _written_as(_sbc_scalars(payload), data[start:pos]) else None


def _fast_threelc(data: memoryview, pos: int, stop: int) -> ThreeLCPayload | None:
    """:func:`_fast_tensor`'s 3LC payload in ``data[pos:stop]``: its scalars must be what the
    writer makes of their values (:func:`_threelc_scalars`: so canonical), its data present."""
    start = pos
    if stop < pos + 5 or data[pos] != _TLC_SCALE_KEY[0]:
        return None
    scale = _F32.unpack(data[pos + 1 : pos + 5])[0]
    pos += 5
    numel = 0
    if pos < stop and data[pos] == _TLC_NUMEL_KEY[0]:
        numel, pos = _varint(data, pos + 1, stop)
    zero_run = pos + 1 < stop and data[pos] == _TLC_ZERO_RUN_KEY[0] and data[pos + 1] == 1
    pos += 2 * zero_run
    at = _last_blob(data, pos, stop, _TLC_DATA_KEY[0])
    if at is None:
        return None
    payload = ThreeLCPayload(scale=scale, numel=numel, zero_run=zero_run, data=bytes(data[at:stop]))
    return payload if _written_as(_threelc_scalars(payload), data[start:pos]) else None


def _last_blob(data: memoryview, pos: int, stop: int, key: int) -> int | None:
    """Where the data of the field at ``data[pos]`` starts when it is a non-empty ``bytes`` field
    with key ``key`` that runs to ``stop`` (a payload's last field), else None."""
    if pos >= stop or data[pos] != key:
        return None
    length, at = _varint(data, pos + 1, stop)
    return at if length and at + length == stop else None


def _written_as(scalars: list[tuple[int, bytes]] | None, found: memoryview) -> bool:
    """Whether the writer (:data:`_BY_HAND`) writes a payload's scalars as ``found``: so they are
    canonical, and read as it wrote them."""
    return scalars is not None and b"".join(raw for _, raw in scalars) == found


def _fast_dense(data: memoryview, pos: int, stop: int) -> DensePayload | None:
    """:func:`_fast_tensor`'s dense payload in ``data[pos:stop]``: a known encoding, then data
    (a view, as the general path keeps it)."""
    if stop < pos + 4 or data[pos] != _DENSE_ENCODING_KEY or data[pos + 2] != _DENSE_DATA_KEY[0]:
        return None
    encoding = _PB_TO_DTYPE.get(data[pos + 1])
    length, at = _varint(data, pos + 3, stop)
    if encoding is None or length == 0 or at + length != stop:
        return None
    return DensePayload(encoding, data[at:stop].toreadonly())


#: :func:`_fast_tensor`'s reader of each payload kind it reads.
_FAST_PAYLOADS: dict[str, Callable[[memoryview, int, int], Payload | None]] = {
    "sbc": _fast_sbc,
    "three_lc": _fast_threelc,
    "dense": _fast_dense,
}


# --- the same reading of every tensor of an update in one call of the wire kernel ------------------

#: The wire kernel's ``scan_tensors`` (whatever its CRC), else None (then :func:`_fast_tensor`),
#: and its ``scan_update`` (where a model bounds the tensor count).
_WIRE_KERNEL = _native.load("wire")
_SCAN = getattr(_WIRE_KERNEL, "scan_tensors", None)
_SCAN_UPDATE = getattr(_WIRE_KERNEL, "scan_update", None)
#: The tables ``scan_tensors`` reads: each dtype enum byte's index + 1 in :data:`_DTYPES`, the
#: codec ids and their payload kinds (0 SBC, 1 3LC, 2 dense, 3 any other), and the keys.
_DTYPES = tuple(_DTYPE_TO_PB)
_DTYPE_OF = bytes((_DTYPES.index(_PB_TO_DTYPE[b]) + 1) if b in _PB_TO_DTYPE else 0 for b in range(256))
_CODEC_IDS = tuple(PAYLOAD_OF_CODEC)
_KINDS = bytes({"sbc": 0, "three_lc": 1, "dense": 2}.get(PAYLOAD_OF_CODEC[c], 3) for c in _CODEC_IDS)
_SCAN_KEYS = bytes(
    [
        _DTYPE_KEY,
        _CODEC_ID_KEY,
        _VERSION_KEY,
        _SBC_KEY[0],
        _TLC_KEY[0],
        _DENSE_KEY[0],
        _SBC_MEAN_KEY[0],
        _SBC_B_KEY[0],
        _SBC_NNZ_KEY[0],
        _SBC_BITS_KEY[0],
        _TLC_SCALE_KEY[0],
        _TLC_NUMEL_KEY[0],
        _TLC_ZERO_RUN_KEY[0],
        _TLC_DATA_KEY[0],
        _DENSE_ENCODING_KEY,
        _DENSE_DATA_KEY[0],
    ]
)
#: The wire kernel's ``frame_tensors`` (whatever its CRC), else None: :func:`update_to_bytes`'
#: framing of every tensor in one call (the same bytes as its Python loop, tested on every payload
#: type and edge: on a ResNet-50 SBC update about a fifth of the loop's time), and what it reads:
#: the payload types it frames, and the keys (one byte each).
_FRAME = getattr(_WIRE_KERNEL, "frame_tensors", None)
_FRAME_TYPES = (SBCPayload, ThreeLCPayload, DensePayload, fast_writer.DeferredDensePayload)
_FRAME_KEYS = b"".join(
    [
        _TENSORS_KEY,
        _SBC_KEY,
        _TLC_KEY,
        _DENSE_KEY,
        _SBC_MEAN_KEY,
        _SBC_B_KEY,
        _SBC_NNZ_KEY,
        _SBC_BITS_KEY,
        _TLC_SCALE_KEY,
        _TLC_NUMEL_KEY,
        _TLC_ZERO_RUN_KEY,
        _TLC_DATA_KEY,
        _DENSE_DATA_KEY,
    ]
)
assert len(_FRAME_KEYS) == 13  # (each key one byte: the kernel's assumption)
#: Scanned tensors as ``scan_tensors`` gives them: None, or (codec, dtype, version, float, a, b,
#: blob start, blob stop).
_Scanned = tuple[int, int, int, float, int, int, int, int] | None


def _scan_fast(view: memoryview, spans: array[int], model: _Model) -> list[_Scanned] | None:
    """:func:`_fast_tensor`'s reading of every tensor in ``spans`` by one call of the wire kernel
    (the same rules in C, tested on mutated tensors against it), or None without the kernel."""
    if _SCAN is None:
        return None
    return _SCAN(view, spans, spans.itemsize == 8, model.prefixes, _DTYPE_OF, _CODEC_ID_BYTES_TUPLE, _KINDS, _SCAN_KEYS)


@dataclasses.dataclass(frozen=True)
class _Model:
    """What :func:`_parse_update` reads off the receiver's tensors: each one's shape as ints, its
    number of values, and its name and shape fields as a canonical tensor starts with them (None
    past :data:`MAX_RANK`: never read fast)."""

    dims: tuple[tuple[int, ...], ...]
    numels: tuple[int, ...]
    prefixes: tuple[bytes | None, ...]


def _model_of(expected: Sequence[TensorShape]) -> _Model:
    """:class:`_Model` of ``expected``, kept for the last names and shapes seen (a receiver passes
    the same ones every round; compared by value, so a spec changed in place is not missed)."""
    global _LAST_MODEL
    key = tuple((w.name, tuple(w.shape)) for w in expected)
    last = _LAST_MODEL  # (one read: a server may parse on several threads)
    if last is not None and last[0] == key:
        return last[1]
    dims = tuple(tuple(int(d) for d in w.shape) for w in expected)
    numels = tuple(math.prod(d) for d in dims)
    prefixes = tuple(
        None if len(d) > MAX_RANK else _name_and_shape(w.name, d) for w, d in zip(expected, dims, strict=True)
    )
    model = _Model(dims, numels, prefixes)
    _LAST_MODEL = (key, model)
    return model


_LAST_MODEL: tuple[tuple[Any, ...], _Model] | None = None
_CODEC_ID_BYTES_TUPLE = tuple(c.encode() for c in _CODEC_IDS)


def _fast_built(found: _Scanned, view: memoryview, name: str, dims: tuple[int, ...]) -> EncodedTensor | None:
    """The tensor :func:`_fast_tensor` makes, from what ``scan_tensors`` read of it. The objects are
    filled as their dataclass ``__init__`` fills them, without its call a field (the parse of a
    ResNet-50 update with its specs 0.39-0.43 -> 0.26-0.29 ms): their fields are the kernel's
    checked values."""
    if found is None:
        return None
    ci, di, version, value, a, b, at, stop = found
    kind = _KINDS[ci]  # (the kernel reads only these three kinds)
    payload: Payload
    if kind == 0:
        payload = filled(SBCPayload, {"mean": value, "golomb_b": a, "nnz": b, "bits": bytes(view[at:stop])})
    elif kind == 1:
        payload = filled(
            ThreeLCPayload, {"scale": value, "numel": a, "zero_run": bool(b), "data": bytes(view[at:stop])}
        )
    else:
        payload = filled(DensePayload, {"encoding": _DTYPES[a], "data": view[at:stop].toreadonly()})
    return filled(
        EncodedTensor,
        {
            "name": name,
            "shape": dims,
            "dtype": _DTYPES[di],
            "codec_id": _CODEC_IDS[ci],
            "codec_version": version,
            "payload": payload,
        },
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
        report_norms=a.report_norms,
    )
    return msg.SerializeToString(deterministic=True)


def allocation_from_bytes(data: bytes) -> DeftAllocation:
    """Parse only; the receiver checks the partitions against its model (``fedcomp.methods.deft``)."""
    msg = _parse(pb.DeftAllocation(), data, "DeftAllocation")
    return DeftAllocation(
        round=msg.round,
        partitions=tuple(DeftPartition(p.tensor, p.start, p.stop, p.k) for p in msg.partitions),
        report_norms=msg.report_norms,
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


# --- whole dense updates in one kernel call ---------------------------------------------------------


class DenseFrames:
    """The framing of an update whose every tensor has a dense payload, kept to write and read
    further updates of the same tensors in one call of the wire kernel each
    (``fedcomp/_native/wire.c``: every value cast or copied once, the CRC-32 taken in the same
    pass, on two threads), without building or parsing a message per tensor.

    A client sends, and a server receives, an update of the same tensors every round: only the
    values and the base model version change. The frames hold each tensor's bytes before its
    values (the tensor's field key and length, its envelope, the dense payload's header), made by
    :func:`_tensor_parts` from envelopes the general path produced (when encoding) or accepted
    (when decoding), so :meth:`write` gives :func:`update_to_bytes`'s bytes, and :meth:`read`
    accepts exactly the updates :func:`update_from_bytes` parses to those envelopes: the header
    canonical, every frame byte for byte, the values anything, the CRC right.

    Built only with the kernel (:attr:`fast_writer._KERNEL`); :meth:`write` and :meth:`read`
    return None where the kernel cannot take a tensor or the bytes differ, and the caller then
    takes the general path (which also words every error).
    """

    def __init__(self, tensors: Sequence[EncodedTensor]) -> None:
        self.heads: list[bytes] = []
        self.encodings: list[str] = []
        self.nbytes: list[int] = []
        #: The envelopes without their values (a frame must not keep an update's bytes alive).
        self._envelopes: list[EncodedTensor] = []
        for t in tensors:
            p = t.payload
            if not isinstance(p, DensePayload):
                raise TypeError(f"DenseFrames: tensor {t.name!r} has a {type(p).__name__}")
            parts, n = _tensor_parts(t)
            head = parts[0]
            assert isinstance(head, bytes) and len(parts) == 2
            self.heads.append(_TENSORS_KEY + fast_writer.varint(n) + head)
            self.encodings.append(p.encoding)
            self.nbytes.append(n - len(head))
            self._envelopes.append(dataclasses.replace(t, payload=DensePayload(p.encoding, b"")))
        #: Bytes after the update's header and before its CRC trailer.
        self.size = sum(len(h) for h in self.heads) + sum(self.nbytes)

    def write(self, base_model_version: int, sources: Sequence[torch.Tensor]) -> bytes | None:
        """The update of ``sources`` (one per frame, in order) at ``base_model_version``: the bytes
        :func:`update_to_bytes` writes for the dense payloads of these values. None when the
        kernel cannot cast one of them (not a contiguous float32 CPU tensor of the frame's size,
        float16 without F16C, bfloat16): then nothing was written."""
        if fast_writer._KERNEL is None or len(sources) != len(self.heads):
            return None
        header = _varint_field(1, FORMAT_VERSION) + _varint_field(2, base_model_version)
        placed: list[fast_writer.Op] = [(fast_writer.OP_COPY, 0, header, len(header))]  # at offsets
        pos = len(header)
        for head, src, enc, n in zip(self.heads, sources, self.encodings, self.nbytes, strict=True):
            placed.append((fast_writer.OP_COPY, pos, head, len(head)))
            pos += len(head)
            if n:
                op = fast_writer.cast_op(src, enc, pos, n)
                if op is None:
                    return None  # before anything is allocated or written
                placed.append(op)
                pos += n

        def ops_of(view: np.ndarray) -> list[fast_writer.Op]:
            base = view.ctypes.data
            return [(kind, base + at, src, n) for kind, at, src, n in placed]

        return fast_writer.write_fused(len(header) + self.size, _CRC_TAG, ops_of)

    def read(self, data: bytes | bytearray | memoryview, outs: Sequence[torch.Tensor]) -> int | None:
        """Cast the values of the update ``data`` into ``outs`` (one per frame, in order; each a
        contiguous CPU tensor of its frame's values, float32, or the wire's own dtype) and return
        its base model version; None, with nothing written, when ``data`` is not an update these
        frames describe (another length, header, envelope or payload type). Raises
        :class:`PayloadError` when the CRC-32 does not match; ``outs`` are then written.

        The values are the general path's bit for bit, except a float16 NaN's: F16C keeps its
        sign and payload, as torch's vectorized cast does, where torch's scalar loop for the last
        few values of a tensor writes 0x7fffffff (a NaN either way)."""
        kernel = fast_writer._KERNEL
        view = memoryview(data)
        if kernel is None or len(outs) != len(self.heads) or view.ndim != 1 or view.itemsize != 1:
            return None
        end = len(view) - _CRC_LEN
        start = end - self.size
        if start < 2 or view[end] != _CRC_TAG:
            return None
        base_model_version = _canonical_header(view, start)
        if base_model_version is None:
            return None
        addr = _address(view)
        ops: list[fast_writer.Op] = [(fast_writer.OP_CRC, 0, addr, start)]
        pos = start
        for head, out, enc, n in zip(self.heads, outs, self.encodings, self.nbytes, strict=True):
            stop = pos + len(head)
            if view[pos:stop] != head:
                return None
            ops.append((fast_writer.OP_CRC, 0, addr + pos, len(head)))
            pos = stop
            if not n:
                continue
            if out.device.type != "cpu" or not out.is_contiguous():
                return None
            if out.dtype == TORCH_DTYPES[enc] and out.numel() * out.element_size() == n:
                ops.append((fast_writer.OP_COPY, out.data_ptr(), addr + pos, n))
            elif out.dtype == torch.float32 and enc == "float16" and fast_writer._F16C and 2 * out.numel() == n:
                ops.append((fast_writer.OP_F16_F32, out.data_ptr(), addr + pos, n))
            else:
                return None
            pos += n
        actual = fast_writer.run_split(kernel, ops, end)
        _check_crc(int.from_bytes(view[end + 1 :], "little"), actual)
        return base_model_version

    def update(self, data: bytes | bytearray | memoryview, base_model_version: int) -> EncodedUpdate:
        """The update :meth:`read` accepted, as :func:`update_from_bytes` parses it: each dense
        payload's ``data`` a view of ``data``."""
        view = memoryview(data).toreadonly()
        pos = len(view) - _CRC_LEN - self.size
        tensors = []
        for env, head, n in zip(self._envelopes, self.heads, self.nbytes, strict=True):
            pos += len(head)
            payload = DensePayload(env.payload.encoding, view[pos : pos + n])  # type: ignore[union-attr]
            tensors.append(EncodedTensor(env.name, env.shape, env.dtype, env.codec_id, env.codec_version, payload))
            pos += n
        return EncodedUpdate(base_model_version=base_model_version, tensors=tuple(tensors))


def _canonical_header(view: memoryview, start: int) -> int | None:
    """The base model version when ``view[:start]`` is exactly the canonical header of an update
    of this format (``format_version`` then ``base_model_version``, 0 omitted), else None."""
    try:
        field, pos = _varint(view, 0, start)
        version, pos = _varint(view, pos, start) if field == 8 else (-1, pos)
        base = 0
        if pos < start and view[pos] == 0x10:
            base, pos = _varint(view, pos + 1, start)
    except PayloadError:
        return None
    if version != FORMAT_VERSION or pos != start:
        return None
    if bytes(view[:start]) != _varint_field(1, FORMAT_VERSION) + _varint_field(2, base):
        return None  # a non-minimal varint, or a base of 0 written out
    return base


def _address(view: memoryview) -> int:
    """The address of a contiguous byte buffer's first byte (read only by the wire kernel)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
