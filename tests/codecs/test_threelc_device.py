"""The whole-update 3LC engine (``fedcomp.codecs.threelc_device``): the bytes and reconstruction of
:meth:`ThreeLC.encode_with_reconstruction` and the values of :meth:`ThreeLC.decode`, tensor by
tensor, in a count of operators, syncs and copies that does not grow with the number of tensors.
The same torch operators run on any device, so the CPU checks what CUDA runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import TensorSpec, ThreeLC, threelc, threelc_device
from fedcomp.codecs.flat import Layout, count_device_work
from fedcomp.codecs.threelc_device import StreamBatch, decode_into, encode_update

F32_MAX = float(np.finfo(np.float32).max)
U = 2.0**-149


def _f32(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def _kinds(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = np.random.default_rng(seed)
    return [
        *[(f"tiny{n}", _f32(g.standard_normal(n))) for n in range(1, 8)],  # every padding of the parts
        ("student", _f32(g.standard_t(3, 70_001) * 1e-3)),
        ("sparse", _f32(np.where(g.random(9_999) < 0.01, g.standard_normal(9_999), 0.0))),
        ("zeros", _f32(np.zeros(1_234))),
        ("negative_zeros", _f32(np.full(55, -0.0))),
        ("huge", _f32([3e38, -3e38, 1.0, 2e38, -1.6e38])),  # m clamped to the float32 maximum
        ("subnormal", _f32([U, -2 * U, 3 * U, 0.0])),
        ("tie", _f32([U, -2 * U])),  # u / 2u is a tie: 0
        ("matrix", _f32(g.standard_normal((64, 33)))),
    ]


def _per_tensor(codec: ThreeLC, items):
    return [codec.encode_with_reconstruction(t, n) for n, t in items]


@pytest.mark.parametrize("codec", [ThreeLC(1.0), ThreeLC(1.5), ThreeLC(1.9, zero_run=False)], ids=repr)
def test_engine_gives_the_per_tensor_bytes_reconstruction_and_decoded_values(codec: ThreeLC) -> None:
    for seed in range(2):
        items = _kinds(seed)
        found = encode_update(codec, items, want_recon=True)
        assert found is not None
        encoded, recon = found
        want = _per_tensor(codec, items)
        assert encoded == [e for e, _ in want]
        assert recon is not None
        want_recon = torch.cat([r.reshape(-1) for _, r in want])
        assert torch.equal(recon, want_recon)
        assert recon.view(torch.int32).equal(want_recon.view(torch.int32))  # +0.0, never -0.0
        # decoding on the "device": into zeros of the tensors' size (padding digits land nowhere else)
        layout = Layout.of(items)
        flat = torch.zeros(layout.total)
        batch = StreamBatch()
        for (name, t), enc, off in zip(items, encoded, layout.offsets, strict=True):
            assert batch.add(codec, enc.payload, TensorSpec.of(name, t), off)
        decode_into(flat, batch.streams())
        want_dec = torch.cat([codec.decode(e, TensorSpec.of(n, t)).reshape(-1) for (n, t), e in zip(items, encoded)])
        assert flat.view(torch.int32).equal(want_dec.view(torch.int32))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    s=st.sampled_from([1.0, 1.25, 1.75]) | st.floats(1.0, 2.0, exclude_max=True),
    scale_exp=st.integers(-140, 120),
    seed=st.integers(0, 2**31),
)
def test_any_layout_and_scale_gives_the_per_tensor_bytes(sizes, s, scale_exp, seed) -> None:
    g = np.random.default_rng(seed)
    codec = ThreeLC(s)
    items = [(f"t{i}", _f32(g.standard_t(2, n) * 2.0**scale_exp)) for i, n in enumerate(sizes)]
    found = encode_update(codec, items, want_recon=True)
    assert found is not None
    want = _per_tensor(codec, items)
    assert found[0] == [e for e, _ in want]
    assert found[1] is not None and torch.equal(found[1], torch.cat([r.reshape(-1) for _, r in want]))


def test_work_does_not_grow_with_the_number_of_tensors() -> None:
    codec = ThreeLC(1.5)
    g = np.random.default_rng(3)
    pool = [(f"t{i}", _f32(g.standard_t(3, int(g.integers(10, 5_000))))) for i in range(96)]
    counts = []
    for many in (6, 24, 96):
        items = pool[:many]
        encode_update(codec, items, want_recon=True)  # (the layout's tables are kept)
        with count_device_work() as work:
            found = encode_update(codec, items, want_recon=True)
        assert found is not None
        layout = Layout.of(items)
        batch = StreamBatch()
        for (n, t), e, off in zip(items, found[0], layout.offsets, strict=True):
            assert batch.add(codec, e.payload, TensorSpec.of(n, t), off)
        streams = batch.streams()
        decode_into(torch.zeros(layout.total), streams)  # (the byte tables: made once per device)
        with count_device_work() as dec:
            decode_into(torch.zeros(layout.total), streams)
        counts.append((work.ops, work.syncs, work.to_host, work.to_device, dec.ops, dec.syncs, dec.to_device))
    assert counts[0] == counts[1] == counts[2], counts
    assert counts[0][1] <= 3 and counts[0][2] <= 2 and counts[0][3] <= 1 and counts[0][5] == 0, counts[0]
    # About twenty operators to pack and thirty more to code the zero runs, and twenty to decode
    # (each a launch, and on a GPU host tens of microseconds of its time: 71 and 56 before the
    # packing by one gather and product, and the decode by one scatter; on CUDA the encode's are
    # replayed as one graph from a layout's second encode on, fedcomp.codecs.graphs)
    assert counts[0][0] <= 52 and counts[0][4] <= 18, counts[0]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_value_that_is_not_finite_leaves_the_update_to_encode(value: float) -> None:
    items = _kinds(0)
    bad = items[7][1].clone()
    bad[123] = value
    items[7] = (items[7][0], bad)
    assert encode_update(ThreeLC(), items) is None
    with pytest.raises(ValueError, match="non-finite"):
        ThreeLC().encode(bad, items[7][0])


@pytest.mark.parametrize(
    "scale",
    [F32_MAX, 2.0**128 - 2.0**103 - 2.0**75, 2.0**128 - 2.0**103, 2.0**128, 1e39, 2.0**-150, 0.1],
    ids=lambda s: f"{s:.17g}",
)
def test_the_batch_takes_a_scale_as_the_decoder_does(scale: float) -> None:
    """A received scale rounds to float32 in :class:`StreamBatch` as in :meth:`ThreeLC.decode`,
    and one that rounds to infinity (from half an ulp past float32's maximum) is left to the dense
    path, which decodes it as :meth:`ThreeLC.decode` does."""
    codec, spec = ThreeLC(), TensorSpec("t", (12,))
    payload = dataclasses.replace(codec.encode(_f32(np.linspace(-1, 1, 12)), "t").payload, scale=scale)
    batch = StreamBatch()
    taken = batch.add(codec, payload, spec, 3)
    with np.errstate(over="ignore"):
        assert taken is bool(np.isfinite(np.float32(scale)))
    if taken:
        flat = torch.full((15,), 7.0)
        flat[3:].zero_()
        decode_into(flat, batch.streams())
        (enc,) = codec._float32_envelopes(["t"], [(12,)], [payload])
        want = codec.decode(enc, spec)
        assert flat[3:].view(torch.int32).equal(want.view(torch.int32)) and flat[:3].eq(7.0).all()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the CPU runs the same operators above)")
def test_cuda_gives_the_cpu_bytes_and_values() -> None:
    for codec in (ThreeLC(1.0), ThreeLC(1.5, zero_run=False)):
        items = _kinds(1)
        found = encode_update(codec, [(n, t.cuda()) for n, t in items], want_recon=True)
        assert found is not None and found[1] is not None
        want = _per_tensor(codec, items)
        assert found[0] == [e for e, _ in want]
        assert torch.equal(found[1].cpu(), torch.cat([r.reshape(-1) for _, r in want]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    numels=st.lists(st.integers(1, 400), min_size=1, max_size=5),
    zeros=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_zero_runs_on_the_device_give_each_tensors_coding(numels, zeros, seed) -> None:
    """The device's zero-run coding of packed bytes back to back: each tensor's stream is
    :func:`zero_run_encode`'s (runs of 1, 2-14, 15, 28, 29 and longer; runs at a tensor's start and
    end, which never run on into the next), written from where its bytes start."""
    g = np.random.default_rng(seed)
    numels = tuple(numels)
    counts = [threelc.groups(n) for n in numels]
    data = np.where(g.random(sum(counts)) < zeros, threelc.ZERO_GROUP, g.integers(0, 243, sum(counts))).astype(np.uint8)
    streams, lengths = threelc_device._zero_runs(torch.from_numpy(data), threelc_device._run_tables(numels, "cpu"))
    at = 0
    for i, c in enumerate(counts):
        want = threelc._zero_run_encode_np(data[at : at + c])
        assert int(lengths[i]) == want.shape[0]
        assert np.array_equal(streams[at : at + want.shape[0]].numpy(), want), (i, data[at : at + c])
        at += c


@pytest.mark.parametrize("how", ["device", "device-without-nonzero_static", "host"])
def test_the_zero_runs_coded_on_the_device_or_the_host_are_the_same_bytes(how: str, monkeypatch) -> None:
    """The encode codes the zero runs on the device (by ``nonzero_static``, or where torch lacks it
    on the device by ``nonzero``, with a wait) or, switched off, on the host after its copy (the C
    kernel): the per-tensor bytes every way."""
    if how == "host":
        monkeypatch.setattr(threelc_device, "ZERO_RUNS_ON_DEVICE", False)
    if how == "device-without-nonzero_static":
        monkeypatch.setattr(threelc_device, "has_nonzero_static", lambda device_type: False)
    g = np.random.default_rng(8)
    codec = ThreeLC(1.9)
    items = [(f"t{i}", _f32(g.standard_t(3, n) * (g.random(n) < 0.3))) for i, n in enumerate((4_000, 7, 12_345, 1_000))]
    with count_device_work() as work:
        found = encode_update(codec, items)
    assert found is not None and found[0] == [codec.encode(t, n) for n, t in items]
    assert work.by_op.get("aten.nonzero", 0) == (2 if how == "device-without-nonzero_static" else 0)
    assert work.by_op.get("aten.nonzero_static", 0) == (2 if how == "device" else 0)
