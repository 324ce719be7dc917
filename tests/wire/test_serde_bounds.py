"""``update_from_bytes`` never trusts a payload: the tensor count and every tensor's name, shape
and size are checked against the model before anything is built from them, every message must be
the canonical encoding, and each codec id carries only its own payload type (FORMAT.md)."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from fedcomp.codecs import DenseFP32, TensorSpec, TopK
from fedcomp.errors import PayloadError
from fedcomp.v1 import wire_pb2 as pb
from fedcomp.wire import serde
from fedcomp.wire.payloads import EncodedTensor, SparsePayload
from tests.codecs.kit import LargestTensor

#: The issue's repro: format 1 header, then 1.6 M tiny tensors (12.8 MB).
TINY = b"\x1a\x06\x18\x01\x62\x02\x08\x01"
MODEL = [TensorSpec("w1", (40, 50)), TensorSpec("w2", (1200,)), TensorSpec("b", (10,))]


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def envelope(*tensors: bytes, head: bytes = b"\x08\x02\x10\x03") -> bytes:
    """A sealed format-2 update holding these raw ``CompressedTensor`` bytes."""
    return serde.seal(head + b"".join(b"\x1a" + varint(len(t)) + t for t in tensors))


def reason(data: bytes, **kw) -> str:
    with pytest.raises(PayloadError) as info:
        serde.update_from_bytes(data, **kw)
    return info.value.reason


@pytest.mark.parametrize("expected", [MODEL, None], ids=["with-model", "without-model"])
def test_a_million_tiny_tensors_are_refused_before_any_is_built(expected):
    data = serde.seal(b"\x08\x02" + TINY * 1_600_000)
    tracemalloc.start()
    try:
        why = reason(data, expected=expected)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if expected is None:
        assert why == f"update has more than {serde.MAX_TENSORS} tensors (the limit without a model)"
    else:
        assert why == "update has more than 3 tensors (the model's count)"
    # Building them allocated ~600 MB; refusing them needs 16 bytes per tensor found so far.
    assert peak < 2_000_000, peak


def test_the_repro_as_format_1_is_refused_at_its_first_bytes():
    assert reason(b"\x08\x01" + TINY * 1_600_000).startswith("format version 1 (no checksum) is not supported")


def _tensor(name: str, shape: tuple[int, ...]) -> bytes:
    return serde.tensor_to_bytes(DenseFP32().encode(torch.ones(shape), name))


def test_count_name_shape_and_size_against_the_model():
    w1, w2, b = _tensor("w1", (40, 50)), _tensor("w2", (1200,)), _tensor("b", (10,))
    assert [t.name for t in serde.update_from_bytes(envelope(w1, w2, b), expected=MODEL).tensors] == ["w1", "w2", "b"]
    assert reason(envelope(w1, w2), expected=MODEL) == "update has 2 tensors, expected 3"
    assert reason(envelope(w1, b, w2), expected=MODEL) == "found tensor 'b' in its place (tensor 1)"
    assert reason(envelope(w1, _tensor("w2", (1199,)), b), expected=MODEL) == "shape [1199] where [1200] was expected"
    big = _tensor("b", (30_000,))  # 120 kB on the wire for a 10-element tensor
    assert (
        reason(envelope(w1, w2, big), expected=MODEL) == f"{len(big)} bytes on the wire for 10 elements (at most 65696)"
    )
    # Without a model, the shapes are the codecs' business: this parses.
    assert len(serde.update_from_bytes(envelope(w1, w2, big)).tensors) == 3


# --- canonical encodings only --------------------------------------------------------------------

NAME, SHAPE, DTYPE, CODEC, VERSION = b"\x0a\x01w", b"\x12\x02\x02\x03", b"\x18\x01", b"\x22\x0adense-fp32", b"\x28\x01"
DENSE = b"\x08\x01\x12\x18" + bytes(24)
PAYLOAD = b"\x62" + varint(len(DENSE)) + DENSE
CANONICAL = NAME + SHAPE + DTYPE + CODEC + VERSION + PAYLOAD
THREE_LC = serde.tensor_to_bytes(
    serde.tensor_from_proto(
        pb.CompressedTensor(
            name="t",
            shape=[5],
            dtype=pb.DTYPE_FLOAT32,
            codec_id="3lc",
            codec_version=1,
            three_lc=pb.ThreeLCPayload(scale=1.0, numel=5, zero_run=True, data=b"\x79"),
        )
    )
)

NON_CANONICAL = {
    "fields reordered": SHAPE + NAME + DTYPE + CODEC + VERSION + PAYLOAD,
    "a field repeated": NAME + NAME + SHAPE + DTYPE + CODEC + VERSION + PAYLOAD,
    "non-minimal varint": NAME + SHAPE + b"\x18\x81\x00" + CODEC + VERSION + PAYLOAD,
    "explicit default": NAME + SHAPE + DTYPE + CODEC + VERSION + b"\x30\x00" + PAYLOAD,
    "unpacked shape": NAME + b"\x10\x02\x10\x03" + DTYPE + CODEC + VERSION + PAYLOAD,
    "unknown field": CANONICAL + b"\xf8\x01\x01",
    "bool encoded as 2": THREE_LC.replace(b"\x18\x01\x22", b"\x18\x02\x22"),
    "uint32 past 32 bits": NAME + SHAPE + DTYPE + CODEC + b"\x28\x81\x80\x80\x80\x10" + PAYLOAD,
}


def test_the_hand_built_tensor_is_what_the_encoder_writes():
    assert serde.tensor_to_bytes(DenseFP32().encode(torch.zeros(2, 3), "w")) == CANONICAL
    assert serde.update_from_bytes(envelope(CANONICAL)).tensors[0].name == "w"
    assert serde.update_from_bytes(envelope(THREE_LC)).tensors[0].codec_id == "3lc"


@pytest.mark.parametrize("case", sorted(NON_CANONICAL))
def test_non_canonical_tensors_are_rejected(case):
    data = NON_CANONICAL[case]
    assert data != CANONICAL and data != THREE_LC
    assert reason(envelope(data)).endswith("is not canonically encoded (FORMAT.md, Envelope)")
    with pytest.raises(PayloadError, match="not canonically encoded"):
        serde.tensor_from_bytes(data)


NON_CANONICAL_ENVELOPES = {
    "fields reordered": (b"\x10\x03\x08\x02", "unexpected field 1 (wire type 0) at byte 2"),
    "explicit default base version": (b"\x08\x02\x10\x00", "field 2 at byte 2 encodes its default 0 (not canonical)"),
    "format version twice": (b"\x08\x02\x08\x02", "unexpected field 1 (wire type 0) at byte 2"),
    "non-minimal key": (b"\x88\x00\x02", "varint at byte 0 is not minimally encoded"),
    "unknown field": (b"\x08\x02\x28\x01", "unexpected field 5 (wire type 0) at byte 2"),
    "no format version": (b"\x10\x03", "format version 0 is not supported (have 2)"),
    "format version 3": (b"\x08\x03", "format version 3 is not supported (have 2)"),
}


@pytest.mark.parametrize("case", sorted(NON_CANONICAL_ENVELOPES))
def test_non_canonical_or_foreign_envelopes_are_rejected(case):
    head, why = NON_CANONICAL_ENVELOPES[case]
    assert reason(envelope(CANONICAL, head=head)) == why


def test_a_tensor_field_after_the_tensors_and_a_missing_trailer_are_rejected():
    assert reason(serde.seal(b"\x08\x02\x1a" + varint(len(CANONICAL)) + CANONICAL + b"\x10\x03")) == (
        "unexpected field 2 (wire type 0) at byte " + str(4 + len(CANONICAL))
    )
    assert reason(b"\x08\x02") == "no crc32 field at the end of the update (FORMAT.md, Envelope)"
    assert reason("not bytes") == "an update is bytes, not str"  # type: ignore[arg-type]


# --- codec ids and payload types -------------------------------------------------------------


def _with(**fields) -> bytes:
    msg = pb.CompressedTensor(name="w", shape=[2, 3], dtype=pb.DTYPE_FLOAT32, codec_version=1, **fields)
    return msg.SerializeToString(deterministic=True)


def test_each_codec_id_carries_only_its_payload_type_and_unknown_ids_are_refused():
    dense = pb.DensePayload(encoding=pb.DTYPE_FLOAT32, data=bytes(24))
    assert reason(envelope(_with(codec_id="sbc", dense=dense))) == "codec 'sbc' carries a sbc payload, not dense"
    assert reason(envelope(_with(codec_id="zstd", dense=dense))).startswith("codec 'zstd' is not part of the format")
    assert reason(envelope(_with(codec_id="dense-fp32"))) == "no payload"
    for cid in ("dense-fp32", "dense-fp16", "identity"):
        assert serde.update_from_bytes(envelope(_with(codec_id=cid, dense=dense))).tensors[0].codec_id == cid


def test_rank_above_the_bound_is_refused():
    msg = pb.CompressedTensor(name="w", shape=[1] * 9, dtype=pb.DTYPE_FLOAT32, codec_id="dense-fp32", codec_version=1)
    msg.dense.CopyFrom(pb.DensePayload(encoding=pb.DTYPE_FLOAT32, data=bytes(4)))
    assert reason(envelope(msg.SerializeToString(deterministic=True))) == "rank 9 exceeds 8"


# --- topk checks its values before it allocates the tensor -------------------------------------


def test_topk_rejects_non_finite_values_before_allocating_the_output():
    numel = 5_000_000
    for bad in (float("nan"), float("inf")):
        payload = SparsePayload(
            golomb_b=0, nnz=1, bits=b"\x00", value_encoding="float32", values=torch.tensor([bad]).numpy().tobytes()
        )
        enc = EncodedTensor("t", (numel,), "float32", "topk", 1, payload)
        with LargestTensor() as seen, pytest.raises(PayloadError, match="a value is NaN or infinite"):
            TopK(p=0.5).decode(enc, TensorSpec("t", (numel,)))
        assert seen.largest < 1000, seen.largest
