"""Format 2's envelope (FORMAT.md, Envelope): golden bytes, the CRC-32 trailer, and what a
corrupted or old update gets. Fixtures: ``tests/fixtures/envelope/`` (see ``envelope.py``)."""

from __future__ import annotations

import zlib

import pytest
import torch

from fedcomp.errors import PayloadError
from fedcomp.methods.update import decode_update
from fedcomp.v1 import wire_pb2 as pb
from fedcomp.wire import serde
from fedcomp.wire.payloads import EncodedUpdate
from tests.wire import envelope


def _encode(tensors: dict[str, torch.Tensor], codecs: dict, version: int) -> tuple[EncodedUpdate, dict]:
    encs, recons = [], {}
    for name, t in tensors.items():
        enc, recon = codecs[name].encode_with_reconstruction(t, name)
        encs.append(enc)
        recons[name] = recon
    return EncodedUpdate(base_model_version=version, tensors=tuple(encs)), recons


def _v1_bytes(update: EncodedUpdate) -> bytes:
    """What format 1 wrote: the same fields, format_version 1, no crc32."""
    msg = pb.CompressedUpdate(
        format_version=1,
        base_model_version=update.base_model_version,
        tensors=[serde.tensor_to_proto(t) for t in update.tensors],
    )
    return msg.SerializeToString(deterministic=True)


@pytest.fixture(scope="module")
def golden() -> tuple[dict[str, torch.Tensor], dict, int, bytes]:
    tensors = envelope.make_tensors()
    codecs = {name: codec for name, (_, codec) in envelope.LAYOUT.items()}
    update, _ = _encode(tensors, codecs, envelope.BASE_VERSION)
    envelope.write_missing(2, serde.update_to_bytes(update))
    envelope.write_missing(1, _v1_bytes(update))
    return envelope.load(2)


def test_encoding_the_stored_tensors_gives_the_golden_bytes_and_they_decode_to_the_reconstruction(golden):
    tensors, codecs, version, data = golden
    update, recons = _encode(tensors, codecs, version)
    assert serde.update_to_bytes(update) == data, "the envelope bytes of format 2 changed"
    parsed = serde.update_from_bytes(data, expected=envelope.specs())
    assert parsed.format_version == 2 and parsed.base_model_version == envelope.BASE_VERSION
    decoded = decode_update(parsed, envelope.specs(), list(codecs.values()))
    assert list(decoded) == list(envelope.LAYOUT)
    for name, t in decoded.items():
        torch.testing.assert_close(t, recons[name], rtol=0, atol=0)


def test_the_trailer_is_protobufs_own_crc32_field_over_every_byte_before_it(golden):
    data = golden[3]
    assert data[-5] == 0x25
    assert int.from_bytes(data[-4:], "little") == zlib.crc32(data[:-5])
    msg = pb.CompressedUpdate()
    msg.ParseFromString(data)
    assert msg.HasField("crc32") and msg.crc32 == zlib.crc32(data[:-5])
    assert msg.SerializeToString(deterministic=True) == data


def test_format_1_is_rejected_and_its_tensors_are_byte_for_byte_those_of_format_2(golden):
    old = (envelope.FOLDER / "v1" / "mixed.bin").read_bytes()
    with pytest.raises(PayloadError) as info:
        serde.update_from_bytes(old)
    assert info.value.reason == "format version 1 (no checksum) is not supported (have 2: FORMAT.md, Envelope)"
    a, b = pb.CompressedUpdate(), pb.CompressedUpdate()
    a.ParseFromString(old)
    b.ParseFromString(golden[3])
    assert a.format_version == 1 and not a.HasField("crc32")
    assert [t.SerializeToString(deterministic=True) for t in a.tensors] == [
        t.SerializeToString(deterministic=True) for t in b.tensors
    ]


def test_every_single_bit_flip_is_a_typed_rejection_and_the_checksum_catches_those_in_the_body(golden):
    data = golden[3]
    reasons: dict[str, int] = {}
    for bit in range(8 * len(data)):
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(PayloadError) as info:
            serde.update_from_bytes(bytes(bad), expected=envelope.specs())
        if bit // 8 != len(data) - 5:  # not the tag byte: the CRC says it
            assert info.value.reason.startswith("checksum mismatch"), (bit, info.value.reason)
        reasons[info.value.reason.split(":")[0]] = reasons.get(info.value.reason.split(":")[0], 0) + 1
    assert reasons["checksum mismatch"] == 8 * (len(data) - 1)


def test_every_truncation_and_any_trailing_byte_is_rejected(golden):
    data = golden[3]
    for n in range(len(data)):
        with pytest.raises(PayloadError):
            serde.update_from_bytes(data[:n])
    for extra in (b"\x00", b"\x25\x00\x00\x00\x00", data[-5:]):
        with pytest.raises(PayloadError):
            serde.update_from_bytes(data + extra)
