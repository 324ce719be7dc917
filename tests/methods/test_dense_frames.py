"""Whole dense updates in one kernel call (``fedcomp.wire.serde.DenseFrames``, used by
``UpdateEncoder.encode_to_bytes`` and ``decode_update_bytes``): the bytes are the general path's
(``update_to_bytes(encode(...))``) round after round, the decoded tensors and the parsed update are
the general path's, and anything but new values and a new base version (another header, envelope,
codec, length, buffer) goes the general way and gets its error. Each test asserts the frames were
really used (or really not), so a fast path that silently never runs fails here."""

from __future__ import annotations

import pytest
import torch

from fedcomp.codecs import SBC, DenseFP16, DenseFP32, Identity
from fedcomp.errors import PayloadError
from fedcomp.methods import update as update_mod
from fedcomp.methods.update import UpdateEncoder, decode_update, decode_update_bytes, specs_of
from fedcomp.wire import fast_writer, serde
from fedcomp.wire.serde import DenseFrames

pytestmark = pytest.mark.skipif(fast_writer._KERNEL is None, reason="the wire kernel is not built")


@pytest.fixture(autouse=True)
def fresh_frames(monkeypatch):
    """Each test starts with no decode frames, and counts how often each path ran."""
    monkeypatch.setattr(update_mod, "_READ_FRAMES", {})
    monkeypatch.setattr(update_mod, "_WRITE_FRAMES", {})
    calls = {"write": 0, "wrote": 0, "read": 0, "read_ok": 0}
    real_write, real_read = DenseFrames.write, DenseFrames.read

    def write(self, *args):
        calls["write"] += 1
        out = real_write(self, *args)
        calls["wrote"] += out is not None
        return out

    def read(self, *args):
        calls["read"] += 1
        out = real_read(self, *args)
        calls["read_ok"] += out is not None
        return out

    monkeypatch.setattr(DenseFrames, "write", write)
    monkeypatch.setattr(DenseFrames, "read", read)
    return calls


def _tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(64, 3, 7, 7, generator=gen) * scale,
        "bn.bias": torch.randn(64, generator=gen),
        "fc.weight": torch.randn(1000, 517, generator=gen) * scale,
        "empty": torch.randn(0, 5, generator=gen),
        "fc.bias": torch.randn(1000, generator=gen),
        "odd": torch.randn(3, 1003, generator=gen),
    }


@pytest.mark.parametrize("codec", [DenseFP16(), DenseFP32(), Identity()], ids=lambda c: c.codec_id)
def test_encode_to_bytes_writes_the_general_paths_bytes_every_round(codec, fresh_frames):
    enc = UpdateEncoder(codec, error_feedback=False)
    for rnd, base in enumerate([0, 1, 300, 2**40]):
        tensors = _tensors(rnd, scale=10.0**rnd)
        data = enc.encode_to_bytes(tensors, base_model_version=base)
        assert data == serde.update_to_bytes(enc.encode(tensors, base_model_version=base)), rnd
        assert data == serde.update_to_bytes_protobuf(enc.encode(tensors, base_model_version=base)), rnd
    assert fresh_frames["wrote"] == 3  # every round but the first


def test_new_tensors_or_a_strided_one_take_the_general_path(fresh_frames):
    enc = UpdateEncoder(DenseFP16(), error_feedback=False)
    enc.encode_to_bytes(_tensors(0))
    enc.encode_to_bytes(_tensors(1))
    assert fresh_frames["wrote"] == 1
    other = {**_tensors(2), "extra": torch.ones(5)}  # another set of tensors: frames of its own
    assert enc.encode_to_bytes(other, 4) == serde.update_to_bytes(enc.encode(other, 4))
    assert fresh_frames["write"] == 1
    assert enc.encode_to_bytes(_tensors(3), 5) == serde.update_to_bytes(enc.encode(_tensors(3), 5))
    assert fresh_frames["wrote"] == 2  # the first tensors' frames were kept
    strided = _tensors(4)
    strided["odd"] = torch.randn(1003, 3).t()  # same shape, not contiguous: the kernel declines
    assert enc.encode_to_bytes(strided, 6) == serde.update_to_bytes(enc.encode(strided, 6))
    assert fresh_frames["write"] == 3 and fresh_frames["wrote"] == 2


def test_feedback_overrides_and_keep_sent_take_the_general_path(fresh_frames):
    tensors = _tensors(0)
    with_feedback = UpdateEncoder(DenseFP16())
    twin = UpdateEncoder(DenseFP16())
    for _ in range(2):
        assert with_feedback.encode_to_bytes(tensors) == serde.update_to_bytes(twin.encode(tensors))
    plain = UpdateEncoder(DenseFP16(), error_feedback=False)
    for _ in range(2):
        plain.encode_to_bytes(tensors, keep_sent=True)
        assert plain.sent is not None and set(plain.sent) == set(tensors)
        plain.encode_to_bytes(tensors, codecs={"fc.weight": DenseFP32()})
    sbc = UpdateEncoder(SBC(0.01), error_feedback=False)
    for _ in range(2):
        sbc.encode_to_bytes(tensors)
    assert fresh_frames["write"] == 0


def test_without_f16c_the_general_path_writes_and_reads(monkeypatch, fresh_frames):
    enc = UpdateEncoder(DenseFP16(), error_feedback=False)
    specs = specs_of(_tensors(0))
    first = enc.encode_to_bytes(_tensors(0))
    decode_update_bytes(first, specs, [DenseFP16(), DenseFP32()])
    monkeypatch.setattr(fast_writer, "_F16C", False)
    data = enc.encode_to_bytes(_tensors(1), 2)
    assert data == serde.update_to_bytes(enc.encode(_tensors(1), 2))
    _, got = decode_update_bytes(data, specs, [DenseFP16(), DenseFP32()])
    want = decode_update(serde.update_from_bytes(data), specs, [DenseFP16(), DenseFP32()])
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert fresh_frames["write"] == fresh_frames["read"] == 1
    assert fresh_frames["wrote"] == fresh_frames["read_ok"] == 0


def _round_trip(codec, rounds: int, out: dict[str, torch.Tensor] | None = None):
    enc = UpdateEncoder(codec, error_feedback=False)
    codecs = [codec, DenseFP32()]
    for rnd in range(rounds):
        tensors = _tensors(rnd, scale=3.0**rnd)
        specs = specs_of(tensors)
        data = enc.encode_to_bytes(tensors, base_model_version=rnd)
        update, got = decode_update_bytes(data, specs, codecs, out=out)
        parsed = serde.update_from_bytes(data, expected=specs)
        want = decode_update(parsed, specs, codecs)
        assert update == parsed and update.base_model_version == rnd
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (rnd, name)
            if out is not None:
                assert got[name] is out[name]


@pytest.mark.parametrize("codec", [DenseFP16(), DenseFP32(), Identity()], ids=lambda c: c.codec_id)
def test_decode_update_bytes_reads_the_general_paths_tensors(codec, fresh_frames):
    _round_trip(codec, 4)
    assert fresh_frames["read_ok"] == 3


def test_decoding_into_buffers(fresh_frames):
    out = {name: torch.full(t.shape, 9.0) for name, t in _tensors(0).items()}
    _round_trip(DenseFP16(), 3, out=out)
    assert fresh_frames["read_ok"] == 2


def _accepted(codec=None) -> tuple[list[torch.Tensor], bytes, list]:
    """Frames cached by one accepted update; the next update's bytes."""
    codec = codec or DenseFP16()
    enc = UpdateEncoder(codec, error_feedback=False)
    specs = specs_of(_tensors(0))
    decode_update_bytes(enc.encode_to_bytes(_tensors(0), 1), specs, [codec, DenseFP32()])
    return specs, enc.encode_to_bytes(_tensors(1), 2), [codec, DenseFP32()]


def _flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x04
    return bytes(b)


def _general_error(data: bytes, specs, codecs) -> str:
    with pytest.raises(PayloadError) as info:
        decode_update(serde.update_from_bytes(data, expected=specs), specs, codecs)
    return str(info.value)


def test_a_flipped_value_is_a_checksum_mismatch(fresh_frames):
    specs, data, codecs = _accepted()
    bad = _flip(data, len(data) // 2)
    with pytest.raises(PayloadError, match="checksum mismatch") as info:
        decode_update_bytes(bad, specs, codecs)
    assert str(info.value) == _general_error(bad, specs, codecs)
    assert fresh_frames["read"] == 1  # the frames matched; the kernel's CRC caught it


@pytest.mark.parametrize("where", ["header", "first frame", "a later frame", "tag", "crc"])
def test_changed_framing_goes_the_general_way_and_gets_its_error(where, fresh_frames):
    specs, data, codecs = _accepted()
    at = {"header": 1, "first frame": 4, "a later frame": data.index(b"fc.bias") + 1, "tag": len(data) - 5,
          "crc": len(data) - 1}[where]  # fmt: skip
    bad = _flip(data, at)
    with pytest.raises(PayloadError) as info:
        decode_update_bytes(bad, specs, codecs)
    assert str(info.value) == _general_error(bad, specs, codecs)


def test_a_resealed_envelope_change_is_the_parsers_error(fresh_frames):
    # A valid CRC over changed framing (what a hostile sender can always send): the frames do not
    # match, and the general path words what is wrong.
    specs, data, codecs = _accepted()
    body = bytearray(data[:-5])
    at = body.index(b"fc.bias")
    body[at : at + 7] = b"fc.bia$"
    bad = serde.seal(bytes(body))
    with pytest.raises(PayloadError, match="fc.bia") as info:
        decode_update_bytes(bad, specs, codecs)
    assert str(info.value) == _general_error(bad, specs, codecs)
    assert fresh_frames["read"] == 1 and fresh_frames["read_ok"] == 0


@pytest.mark.parametrize(
    "header", [b"\x08\x02\x10\x00", b"\x08\x82\x00\x10\x02", b"\x08\x03\x10\x02", b"\x08\x02\x10\x82\x00"]
)
def test_a_non_canonical_header_is_the_parsers_error(header, fresh_frames):
    specs, data, codecs = _accepted()
    assert data[:4] == b"\x08\x02\x10\x02"
    body = header + data[4:-5]
    bad = serde.seal(body)
    with pytest.raises(PayloadError) as info:
        decode_update_bytes(bad, specs, codecs)
    assert str(info.value) == _general_error(bad, specs, codecs)
    assert fresh_frames["read_ok"] == 0


@pytest.mark.parametrize("cut", [1, 5, 6, 1000])
def test_truncated_or_extended_updates(cut, fresh_frames):
    specs, data, codecs = _accepted()
    for bad in (data[:-cut], data + bytes(cut)):
        with pytest.raises(PayloadError) as info:
            decode_update_bytes(bad, specs, codecs)
        with pytest.raises(PayloadError) as general:
            decode_update(serde.update_from_bytes(bad, expected=specs), specs, codecs)
        assert str(info.value) == str(general.value)
    assert fresh_frames["read_ok"] == 0


def test_a_wrong_buffer_is_decode_intos_error(fresh_frames):
    specs, data, codecs = _accepted()
    out = {"fc.weight": torch.empty(1000, 516)}
    with pytest.raises(ValueError, match="fc.weight"):
        decode_update_bytes(data, specs, codecs, out=out)
    strided = {"odd": torch.empty(1003, 3).t()}
    with pytest.raises(ValueError, match="not contiguous"):
        decode_update_bytes(data, specs, codecs, out=strided)
    assert fresh_frames["read_ok"] == 0


def test_another_codecs_update_for_the_same_tensors(fresh_frames):
    specs, _, _ = _accepted()
    codecs = [DenseFP16(), DenseFP32(), SBC(0.05)]
    sbc = UpdateEncoder(SBC(0.05), error_feedback=False)
    decode_update_bytes(UpdateEncoder(DenseFP16(), error_feedback=False).encode_to_bytes(_tensors(0)), specs, codecs)
    data = sbc.encode_to_bytes(_tensors(1), 7)
    update, got = decode_update_bytes(data, specs, codecs)
    want = decode_update(serde.update_from_bytes(data), specs, codecs)
    assert update.base_model_version == 7
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert fresh_frames["read"] == 1 and fresh_frames["read_ok"] == 0


def test_a_fresh_encoder_reuses_the_frames(fresh_frames):
    # The library makes an encoder per update (the client mod, the server replica): the frames
    # outlive it.
    for rnd in range(3):
        tensors = _tensors(rnd)
        data = UpdateEncoder(DenseFP16(), error_feedback=False).encode_to_bytes(tensors, rnd)
        assert data == serde.update_to_bytes(UpdateEncoder(DenseFP16(), error_feedback=False).encode(tensors, rnd))
    assert fresh_frames["wrote"] == 2


def test_a_few_frames_are_kept(fresh_frames):
    for n in range(update_mod._FRAMES_KEPT + 3):
        UpdateEncoder(DenseFP16(), error_feedback=False).encode_to_bytes({"w": torch.ones(n + 1)})
    assert len(update_mod._WRITE_FRAMES) == update_mod._FRAMES_KEPT
    assert fresh_frames["write"] == 0


def test_frames_keep_no_values_alive():
    enc = UpdateEncoder(DenseFP16(), error_feedback=False)
    data = enc.encode_to_bytes(_tensors(0))
    frames = DenseFrames(serde.update_from_bytes(data).tensors)
    for env in frames._envelopes:
        assert env.payload.data == b""  # type: ignore[union-attr]
    assert frames.size == len(data) - 2 - 5  # all but the header (b"\x08\x02": base 0 omitted) and the trailer


def _outcome(fn):
    try:
        return "ok", fn()
    except (PayloadError, ValueError) as exc:
        return "error", f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("seed", range(4))
def test_hostile_bytes_get_the_general_paths_outcome(seed, fresh_frames):
    # Random damage to an update the frames describe (bytes flipped anywhere, cut, inserted,
    # some re-sealed with a valid CRC, as a hostile sender would): decode_update_bytes must end
    # exactly as the general path does, the same tensors or the same error.
    import random

    rng = random.Random(seed)
    specs, data, codecs = _accepted(DenseFP16() if seed % 2 else DenseFP32())
    for case in range(60):
        b = bytearray(data[:-5] if case % 3 == 0 else data)
        for _ in range(rng.randint(1, 3)):
            action, at = rng.random(), rng.randrange(len(b))
            if action < 0.6:
                b[at] ^= 1 << rng.randrange(8)
            elif action < 0.8:
                del b[at : at + rng.randint(1, 9)]
            else:
                b[at:at] = bytes(rng.randint(1, 9))
        bad = serde.seal(bytes(b)) if case % 3 == 0 else bytes(b)
        got = _outcome(lambda bad=bad: decode_update_bytes(bad, specs, codecs)[1])
        want = _outcome(lambda bad=bad: decode_update(serde.update_from_bytes(bad, expected=specs), specs, codecs))
        assert got[0] == want[0], (case, got, want)
        if got[0] == "error":
            assert got[1] == want[1], case
        else:
            assert all(_same_values(got[1][k], want[1][k]) for k in want[1]), case
    assert fresh_frames["read"] > 0


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, but any NaN for any NaN (a flipped exponent bit makes NaNs; torch's scalar
    float16 -> float32 loop writes every NaN as 0x7fffffff, the kernel keeps its payload)."""
    nan = torch.isnan(a)
    if not torch.equal(nan, torch.isnan(b)):
        return False
    return torch.equal(a[~nan].view(torch.int32), b[~nan].view(torch.int32))
