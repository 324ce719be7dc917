"""All-dense updates from and onto a GPU (``fedcomp.methods.dense_device``): one copy per wire
dtype, cast on the device, framed by the same wire kernel as on the CPU. On the CPU the same
functions run the same operators (what the CPU tests below compare with the frames' and the
general path's bytes and tensors); the CUDA test drives them through ``encode_to_bytes`` and
``decode_update_bytes`` as a GPU client does, and checks that they were really used."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fedcomp.codecs import DenseFP16, DenseFP32, Identity
from fedcomp.errors import PayloadError
from fedcomp.methods import dense_device
from fedcomp.methods import update as update_mod
from fedcomp.methods.dense_device import read_on_device, write_on_device
from fedcomp.methods.update import UpdateEncoder, decode_update, decode_update_bytes, specs_of
from fedcomp.wire import fast_writer, serde
from fedcomp.wire.payloads import DensePayload
from fedcomp.wire.serde import DenseFrames

pytestmark = pytest.mark.skipif(fast_writer._KERNEL is None, reason="the wire kernel is not built")

CPU = torch.device("cpu")
CODECS = [DenseFP16(), DenseFP32(), Identity()]


def _tensors(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "conv.weight": torch.randn(64, 3, 7, 7, generator=gen) * scale,
        "bn.bias": torch.randn(64, generator=gen),  # small: dense-fp32 whatever the codec
        "fc.weight": torch.randn(1000, 517, generator=gen) * scale,
        "empty": torch.randn(0, 5, generator=gen),
        "fc.bias": torch.randn(1000, generator=gen),
        "odd": torch.randn(3, 1003, generator=gen),
    }


def _frames(codec) -> tuple[UpdateEncoder, DenseFrames]:
    enc = UpdateEncoder(codec, error_feedback=False)
    return enc, DenseFrames(enc.encode(_tensors(0)).tensors)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.codec_id)
def test_write_on_device_writes_the_general_paths_bytes(codec) -> None:
    enc, frames = _frames(codec)
    assert set(frames.encodings) == ({"float16", "float32"} if isinstance(codec, DenseFP16) else {"float32"})
    for rnd, base in enumerate([1, 300, 2**40]):
        tensors = _tensors(rnd + 1, scale=10.0**rnd)
        data = write_on_device(frames, base, list(tensors.values()))
        assert data == serde.update_to_bytes(enc.encode(tensors, base_model_version=base)), rnd
        assert data == frames.write(base, list(tensors.values()))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.codec_id)
@pytest.mark.parametrize("into", [False, True], ids=["new", "into"])
def test_read_on_device_reads_the_general_paths_tensors(codec, into: bool) -> None:
    enc, frames = _frames(codec)
    specs = specs_of(_tensors(0))
    out = {s.name: torch.full(s.shape, 7.0) for s in specs} if into else None
    for rnd in range(3):
        data = serde.update_to_bytes(enc.encode(_tensors(rnd + 1, scale=3.0**rnd), base_model_version=rnd))
        done = read_on_device(frames, data, specs, CPU, out)
        assert done is not None
        update, got = done
        parsed = serde.update_from_bytes(data, expected=specs)
        want = decode_update(parsed, specs, [codec, DenseFP32()])
        assert update == parsed and update.base_model_version == rnd
        assert list(got) == [s.name for s in specs]
        for s in specs:
            assert got[s.name].shape == s.shape and torch.equal(got[s.name], want[s.name]), (rnd, s.name)
            if out is not None:
                assert got[s.name] is out[s.name]


def test_a_checksum_mismatch_writes_nothing_into_the_receivers_buffers() -> None:
    enc, frames = _frames(DenseFP16())
    specs = specs_of(_tensors(0))
    data = bytearray(serde.update_to_bytes(enc.encode(_tensors(1), base_model_version=2)))
    data[len(data) // 2] ^= 0x04
    out = {s.name: torch.full(s.shape, 7.0) for s in specs}
    with pytest.raises(PayloadError, match="checksum mismatch"):
        read_on_device(frames, bytes(data), specs, CPU, out)
    assert all(bool((t == 7.0).all()) for t in out.values())


def test_other_bytes_or_buffers_are_left_to_the_general_path() -> None:
    enc, frames = _frames(DenseFP16())
    specs = specs_of(_tensors(0))
    data = serde.update_to_bytes(enc.encode(_tensors(1), base_model_version=2))
    out = {s.name: torch.full(s.shape, 7.0) for s in specs}
    other = serde.update_to_bytes(UpdateEncoder(DenseFP32(), error_feedback=False).encode(_tensors(1), 2))
    assert read_on_device(frames, other, specs, CPU, out) is None  # another codec's frames
    assert read_on_device(frames, data[:-1], specs, CPU, out) is None
    wrong = {**out, "odd": torch.zeros(1003, 3)}
    assert read_on_device(frames, data, specs, CPU, wrong) is None
    assert read_on_device(frames, data, specs, CPU, {**out, "odd": torch.zeros(3, 1003, dtype=torch.float64)}) is None
    half = [dataclasses.replace(s, dtype=torch.float16) if s.name == "odd" else s for s in specs]
    assert read_on_device(frames, data, half, CPU) is None
    assert all(bool((t == 7.0).all()) for t in out.values())


def test_what_the_device_paths_do_not_take() -> None:
    _, frames = _frames(DenseFP16())
    values = list(_tensors(1).values())
    assert write_on_device(frames, 0, [v.double() for v in values]) is None
    assert write_on_device(frames, 0, values[:-1]) is None
    bf16 = UpdateEncoder(DenseFP32(), error_feedback=False).encode(_tensors(0))
    bf16_frames = DenseFrames(
        [
            dataclasses.replace(t, payload=DensePayload("bfloat16", b"\0" * (len(t.payload.data) // 2)))
            for t in bf16.tensors
        ]
    )
    assert write_on_device(bf16_frames, 0, values) is None  # no NumPy dtype to cross the host in
    assert read_on_device(bf16_frames, b"", specs_of(_tensors(0)), CPU) is None


def test_a_float16_source_is_copied_by_the_kernel() -> None:
    """``cast_op`` of a tensor already in the wire dtype: a copy (the device cast it)."""
    src = torch.randn(1001).half()
    op = fast_writer.cast_op(src, "float16", 0, 2002)
    assert op is not None and op[0] == fast_writer.OP_COPY
    assert fast_writer.cast_op(src, "float16", 0, 2000) is None
    assert fast_writer.cast_op(src, "float32", 0, 4004) is None
    assert fast_writer.cast_op(src.double(), "float16", 0, 2002) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the tests above run the same operators)")
@pytest.mark.parametrize("codec", [DenseFP16(), DenseFP32()], ids=lambda c: c.codec_id)
def test_cuda_dense_updates_take_one_copy_per_wire_dtype(codec, monkeypatch) -> None:
    monkeypatch.setattr(update_mod, "_READ_FRAMES", {})
    monkeypatch.setattr(update_mod, "_WRITE_FRAMES", {})
    used = {"write": 0, "read": 0}

    def counted(name):
        real = getattr(dense_device, name)

        def call(*args, **kwargs):
            out = real(*args, **kwargs)
            used[name.split("_")[0]] += out is not None
            return out

        return call

    monkeypatch.setattr(update_mod, "write_on_device", counted("write_on_device"))
    monkeypatch.setattr(update_mod, "read_on_device", counted("read_on_device"))
    on_gpu, on_cpu = UpdateEncoder(codec, error_feedback=False), UpdateEncoder(codec, error_feedback=False)
    specs = specs_of(_tensors(0))
    codecs = [codec, DenseFP32()]
    out = {s.name: torch.full(s.shape, 7.0, device="cuda") for s in specs}
    for rnd in range(3):
        tensors = _tensors(rnd, scale=3.0**rnd)
        data = on_gpu.encode_to_bytes({k: v.cuda() for k, v in tensors.items()}, rnd)
        assert data == on_cpu.encode_to_bytes(tensors, rnd), rnd
        want = decode_update_bytes(data, specs, codecs)[1]
        for target in (None, out):
            update, got = decode_update_bytes(data, specs, codecs, "cuda", out=target)
            assert update.base_model_version == rnd
            for s in specs:
                assert got[s.name].device.type == "cuda" and torch.equal(got[s.name].cpu(), want[s.name]), (rnd, s.name)
                if target is not None:
                    assert got[s.name] is out[s.name]
    # Writes: every round but the first (the GPU encoder's first update made the frames). Reads:
    # both decodes of every round (the CPU decode of round 0 made the frames first).
    assert used == {"write": 2, "read": 6}
