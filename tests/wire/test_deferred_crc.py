"""The CRC of a large update computed beside its decode (``serde.update_from_bytes_deferred``,
``fedcomp.methods.update.decode_update_bytes``): the same tensors and the same errors as the
update's CRC checked first (``update_from_bytes`` then ``decode_update``), the checksum's error
first whenever the bytes were corrupted."""

from __future__ import annotations

import pytest
import torch

from fedcomp.codecs import SBC, DenseFP16, DenseFP32
from fedcomp.errors import PayloadError
from fedcomp.methods.update import UpdateEncoder, decode_update, decode_update_bytes, specs_of
from fedcomp.wire import serde


@pytest.fixture(autouse=True)
def one_thread():
    """The CRC is deferred beside single-threaded torch only (the reference app's setting)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _update(codec, seed: int = 0) -> tuple[dict[str, torch.Tensor], bytes]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {"a": torch.randn(600, 1000, generator=gen), "b": torch.randn(10, generator=gen),
               "c": torch.randn(400_001, generator=gen)}  # fmt: skip
    return tensors, serde.update_to_bytes(UpdateEncoder(codec, error_feedback=False).encode(tensors, 3))


@pytest.mark.parametrize("codec", [DenseFP16(), DenseFP32(), SBC(0.01)], ids=lambda c: c.codec_id)
def test_same_tensors_as_checking_first(codec):
    tensors, data = _update(codec)
    specs = specs_of(tensors)
    codecs = [codec, DenseFP32()]
    update, out = decode_update_bytes(data, specs, codecs)
    want = decode_update(serde.update_from_bytes(data, expected=specs), specs, codecs)
    assert update.base_model_version == 3
    assert out.keys() == want.keys()
    for name in want:
        assert torch.equal(out[name], want[name]), name


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x10
    return bytes(b)


@pytest.mark.parametrize("where", ["payload", "framing", "crc"])
def test_a_corrupted_large_update_reports_the_checksum(where):
    tensors, data = _update(DenseFP16())
    assert len(data) > serde._DEFER_CRC_MIN
    at = {"payload": len(data) // 2, "framing": 2, "crc": len(data) - 2}[where]
    bad = _flip(data, at)
    specs = specs_of(tensors)
    with pytest.raises(PayloadError, match="checksum mismatch") as first:
        serde.update_from_bytes(bad, expected=specs)
    with pytest.raises(PayloadError, match="checksum mismatch") as deferred:
        decode_update_bytes(bad, specs, [DenseFP16(), DenseFP32()])
    assert str(deferred.value) == str(first.value)


def test_other_errors_are_those_of_checking_first():
    # A valid CRC over a wrong update (what a hostile sender can always do): the parse's error.
    tensors, data = _update(DenseFP16())
    specs = specs_of(tensors)
    wrong = [s if s.name != "c" else type(s)("c", (400_002,), s.dtype) for s in specs]
    with pytest.raises(PayloadError) as first:
        decode_update(serde.update_from_bytes(data, expected=wrong), wrong, [DenseFP16(), DenseFP32()])
    with pytest.raises(PayloadError) as deferred:
        decode_update_bytes(data, wrong, [DenseFP16(), DenseFP32()])
    assert str(deferred.value) == str(first.value)
    # A codec the receiver does not accept: the decoder's error, after the CRC was found good.
    with pytest.raises(PayloadError, match="not accepted"):
        decode_update_bytes(data, specs, [DenseFP32()])


def test_small_updates_are_checked_first_and_not_bytes_are_refused():
    tensors = {"w": torch.ones(5)}
    data = serde.update_to_bytes(UpdateEncoder(DenseFP32(), error_feedback=False).encode(tensors))
    with pytest.raises(PayloadError, match="checksum mismatch"):
        serde.update_from_bytes_deferred(_flip(data, len(data) - 1))  # checked at once, not deferred
    with pytest.raises(PayloadError, match="an update is bytes"):
        serde.update_from_bytes_deferred("nope")  # type: ignore[arg-type]


def test_the_crc_of_a_large_update_is_checked_by_verify():
    # Deferred for real: the parse of a payload-corrupted update succeeds, verify() raises.
    _, data = _update(DenseFP16())
    bad = _flip(data, len(data) // 2)
    update, verify = serde.update_from_bytes_deferred(bad)
    assert len(update.tensors) == 3
    with pytest.raises(PayloadError, match="checksum mismatch"):
        verify()
    torch.set_num_threads(2)  # beside multi-threaded torch: checked at once
    with pytest.raises(PayloadError, match="checksum mismatch"):
        serde.update_from_bytes_deferred(bad)
