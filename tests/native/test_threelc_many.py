"""3LC's kernels for whole updates (``zero_runs_many``, ``check_many`` in
fedcomp/_native/threelc.c) and their callers in ``fedcomp.codecs.threelc_device`` (the zero-run
coding of every tensor's packed bytes, :class:`StreamBatch`): against the NumPy path they
replace, tensor by tensor: the same bytes, decoded values and errors, on runs around the 14-group
cap, empty tensors, streams without a 121 and hostile streams; and their argument checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp.codecs.threelc_device as threelc_device
from fedcomp import _native
from fedcomp.codecs.base import TensorSpec
from fedcomp.codecs.threelc import ThreeLC, _zero_run_encode_np, groups
from fedcomp.errors import PayloadError
from fedcomp.wire.payloads import ThreeLCPayload
from tests.codecs import reference_threelc as ref
from tests.codecs.test_threelc_cpu import packed_streams
from tests.native.test_threelc_kernels import hostile_payloads

KERNEL = _native.load("threelc")
pytestmark = pytest.mark.skipif(KERNEL is None, reason="fedcomp._native._threelc is not built or FEDCOMP_NATIVE=0")

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _zero_runs_many(streams: list[bytes], threads: int = 1) -> list[bytes]:
    """Each stream's coding, read where the kernel writes it: where its bytes begin in the input."""
    assert KERNEL is not None
    data = np.frombuffer(b"".join(streams), dtype=np.uint8)
    out = np.full(data.shape[0], 7, dtype=np.uint8)
    lengths = np.full(len(streams), -1, dtype=np.int64)
    KERNEL.zero_runs_many(data, np.array([len(s) for s in streams], dtype=np.int64), out, lengths, threads, False)
    starts = np.cumsum([0, *(len(s) for s in streams)])[:-1]
    return [out[a : a + n].tobytes() for a, n in zip(starts, lengths, strict=True)]


FIXED = [b"", bytes([121]) * 14, bytes([121]) * 15, bytes([121]) * 29, bytes([121]) * 300, bytes(range(121)), b"\x00"]


@FAST
@given(streams=st.lists(packed_streams(), max_size=6))
def test_zero_runs_many_give_each_tensors_numpy_coding(streams: list[bytes]) -> None:
    streams = [*streams, *FIXED]
    want = [_zero_run_encode_np(np.frombuffer(s, dtype=np.uint8)).tobytes() for s in streams]
    assert _zero_runs_many(streams) == want
    assert want[-2:] == [bytes(range(121)), b"\x00"]  # (no 121: the bytes as they are)
    assert all(w == ref.zero_run_encode(s) for s, w in zip(streams, want, strict=True))


def test_zero_runs_many_around_the_kernels_32_byte_blocks() -> None:
    """Runs of 121 skipped 32 bytes at a time: literals at every place in and around a block, in
    long sparse streams and at their ends."""
    rng = np.random.default_rng(4)
    streams = []
    for lead in (0, 1, 31, 32, 33, 63, 64, 65, 95, 96):
        for tail in (0, 1, 31, 32, 33):
            streams.append(bytes([121]) * lead + bytes([int(rng.integers(0, 121))]) + bytes([121]) * tail)
    for n in (1000, 4099, 65_537):
        x = np.full(n, 121, dtype=np.uint8)
        at = rng.choice(n, size=n // 200, replace=False)
        x[at] = rng.integers(0, 243, size=at.shape[0]).astype(np.uint8)
        streams.append(x.tobytes())
    streams.append(bytes([121]) * 70_000)
    want = [_zero_run_encode_np(np.frombuffer(s, dtype=np.uint8)).tobytes() for s in streams]
    assert _zero_runs_many(streams) == want


def test_zero_runs_many_in_blocks_of_mixed_density() -> None:
    """The kernel walks a block with both 121 and other bytes eight bytes at a time: runs ending
    and starting at every place of a word, runs over 14 (split) across words, densities from an
    update after some rounds of error feedback (a few other bytes a block) to none of 121."""
    rng = np.random.default_rng(9)
    streams = []
    for density in (0.005, 0.03, 0.3, 0.9, 1.0):
        x = np.full(4096 + int(rng.integers(0, 64)), 121, dtype=np.uint8)
        other = rng.random(x.shape[0]) < density
        x[other] = rng.choice([v for v in range(243) if v != 121], size=int(other.sum())).astype(np.uint8)
        streams.append(x.tobytes())
    for gap in (0, 1, 2, 7, 8, 9, 13, 14, 15, 16, 27, 28, 29, 40):
        streams.append((bytes([5]) + bytes([121]) * gap) * 12 + bytes([242]))
    want = [_zero_run_encode_np(np.frombuffer(s, dtype=np.uint8)).tobytes() for s in streams]
    assert _zero_runs_many(streams) == want
    assert _zero_runs_many(streams, threads=4) == want  # tensors taken by whichever thread is free


def test_zero_runs_many_check_their_buffers() -> None:
    assert KERNEL is not None
    data = np.full(30, 121, dtype=np.uint8)
    lengths = np.empty(2, dtype=np.int64)
    out = np.empty(30, dtype=np.uint8)
    for groups_, out_, lengths_ in [
        (np.array([10, 10], np.int64), out, lengths),  # fewer groups than bytes
        (np.array([20, 20], np.int64), out, lengths),  # more
        (np.array([40, -10], np.int64), out, lengths),  # a negative count
        (np.array([10, 20], np.int64), out[:29], lengths),  # no room
        (np.array([10, 20], np.int64), out, lengths[:1]),
        (np.array([10, 20], np.int32), out, lengths),  # (8 bytes of int32: one int64 of 85899345930)
    ]:
        with pytest.raises(ValueError):
            KERNEL.zero_runs_many(data, groups_, out_, lengths_, 2, False)
    KERNEL.zero_runs_many(data, np.array([10, 20], np.int64), out, lengths, 2, False)
    assert lengths.tolist() == [1, 2]  # 10 = a run of 10; 20 = 14 + 6


def _tensor(seed: int, n: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    return torch.from_numpy(np.where(g.random(n) < 0.05, g.standard_t(3, n), 0.0).astype(np.float32))


def _numpy_literals(data: bytes, zero_run: bool, numel: int) -> tuple[list[int], bytes] | str:
    payload = ThreeLCPayload(1.0, numel, zero_run, data)
    try:
        pos, vals, _ = ThreeLC(zero_run=zero_run).literals(payload, TensorSpec("w", (numel,)))
    except PayloadError as exc:
        return str(exc)
    return pos.tolist(), vals.tobytes()


@FAST
@given(
    streams=st.lists(st.tuples(packed_streams(), st.integers(0, 4), st.booleans()), max_size=6),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=2),
)
def test_check_many_finds_the_first_stream_numpy_refuses(streams, edits) -> None:
    tasks, want = [], []
    for packed, pad, zero_run in streams:
        numel = max(0, 5 * len(packed) - pad)  # (its groups: len(packed))
        data = bytearray(ref.zero_run_encode(packed) if zero_run else packed)
        for at, value in edits:  # hostile bytes: runs past the end, codes above 242, ...
            if data:
                data[at % len(data)] = value
        tasks.append((bytes(data), zero_run, groups(numel)))
        want.append(_numpy_literals(bytes(data), zero_run, numel))
    assert KERNEL is not None
    assert KERNEL.check_many(tasks) == next((i for i, w in enumerate(want) if isinstance(w, str)), -1)


@pytest.mark.parametrize("numel", [11, 100, 1001])
def test_check_many_refuses_every_hostile_stream(numel: int) -> None:
    assert KERNEL is not None
    good = ref.zero_run_encode(bytes([121] * (groups(numel) - 2) + [0, 7]))
    for zero_run, data in hostile_payloads(numel):
        assert KERNEL.check_many([(good, True, groups(numel)), (data, zero_run, groups(numel))]) == 1, data[:20]


def test_check_many_checks_its_arguments() -> None:
    assert KERNEL is not None
    for tasks in ([(bytes(3), False, -1)], [(bytes(3), False)], [(3, False, 3)], (bytes(3), False, 3)):
        with pytest.raises((ValueError, TypeError)):
            KERNEL.check_many(tasks)
    assert KERNEL.check_many([(bytes([121, 0, 3]), False, 3), (bytes([243, 2]), True, 3)]) == -1
    assert KERNEL.check_many([]) == -1


def _decoded(batch: threelc_device.StreamBatch, total: int) -> torch.Tensor:
    flat = torch.zeros(total)
    threelc_device.decode_into(flat, batch.streams())
    return flat


@pytest.mark.parametrize("zero_run", [True, False])
def test_the_stream_batch_decodes_each_tensor_as_its_decoder(zero_run: bool) -> None:
    codec = ThreeLC(1.5, zero_run=zero_run)
    sizes = [1, 5, 6, 999, 4096, 70_001, 2]
    batch, want, offset = threelc_device.StreamBatch(), [], 0
    for i, n in enumerate(sizes):
        enc = codec.encode(_tensor(i, n), f"t{i}")
        spec = TensorSpec(f"t{i}", (n,))
        assert batch.add(codec, enc.payload, spec, offset)
        want.append(codec.decode(enc, spec).reshape(-1))
        offset += n
    assert _decoded(batch, offset).view(torch.int32).equal(torch.cat(want).view(torch.int32))


def test_the_stream_batch_raises_the_per_tensor_words_and_leaves_scales_past_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codec = ThreeLC()
    good = codec.encode(_tensor(1, 1000), "a")
    spec = TensorSpec("a", (1000,))
    batch = threelc_device.StreamBatch()
    assert not batch.add(codec, dataclasses.replace(good.payload, scale=1e300), spec, 0)  # (the dense path's)
    assert len(batch) == 0
    with pytest.raises(PayloadError, match="scale"):
        batch.add(codec, dataclasses.replace(good.payload, scale=-1.0), spec, 0)
    assert isinstance(good.payload, ThreeLCPayload)
    for kernel in (KERNEL, None):  # (without the kernel, each stream by ThreeLC.literals)
        monkeypatch.setattr(threelc_device, "_KERNEL", kernel)
        for zero_run, data in hostile_payloads(1000):
            bad = dataclasses.replace(good.payload, zero_run=zero_run, data=data)
            batch = threelc_device.StreamBatch()
            for name in ("a", "b"):
                payload = good.payload if name == "a" else bad
                try:
                    batch.add(codec, payload, TensorSpec(name, (1000,)), 0)
                except PayloadError:  # (a length the checks refuse before any decoding)
                    break
            else:
                with pytest.raises(PayloadError) as whole:
                    batch.streams()
                with pytest.raises(PayloadError) as per_tensor:
                    codec.literals(bad, TensorSpec("b", (1000,)))
                assert str(whole.value) == str(per_tensor.value)


def test_the_engines_zero_runs_on_the_device_equal_numpys() -> None:
    numels = (1, 5, 999, 4096, 70_001, 3)
    payloads = [ThreeLC(zero_run=False).encode(_tensor(i, n), "t").payload for i, n in enumerate(numels)]
    assert all(isinstance(p, ThreeLCPayload) for p in payloads)
    data = np.concatenate([np.frombuffer(p.data, dtype=np.uint8) for p in payloads])  # type: ignore[union-attr]
    streams, lengths = threelc_device._zero_runs(torch.from_numpy(data), threelc_device._run_tables(numels, "cpu"))
    at = 0
    for p, n in zip(payloads, lengths.tolist(), strict=True):
        assert streams[at : at + n].numpy().tobytes() == _zero_run_encode_np(np.frombuffer(p.data, np.uint8)).tobytes()  # type: ignore[union-attr]
        at += len(p.data)  # type: ignore[union-attr]


def test_the_engines_zero_runs_on_the_host_equal_numpys_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's host path (``ZERO_RUNS_ON_DEVICE`` off): the C kernel's codings, and NumPy's
    where the kernel is not built, are each tensor's own."""
    numels = (1, 5, 999, 4096, 70_001, 3)
    payloads = [ThreeLC(zero_run=False).encode(_tensor(i, n), "t").payload for i, n in enumerate(numels)]
    data = np.concatenate([np.frombuffer(p.data, dtype=np.uint8) for p in payloads])  # type: ignore[union-attr]
    want = [_zero_run_encode_np(np.frombuffer(p.data, np.uint8)).tobytes() for p in payloads]  # type: ignore[union-attr]
    assert threelc_device._bodies(data, numels) == want
    monkeypatch.setattr(threelc_device, "_KERNEL", None)
    assert threelc_device._bodies(data, numels) == want
