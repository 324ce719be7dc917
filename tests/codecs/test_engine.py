"""The whole-update path (UpdateEncoder.encode -> wire bytes -> decode_update) against per-tensor
plain-Python references: the bytes of a whole update must be exactly the bytes the reference
implementations give tensor by tensor, over shapes that stress the edges (empty, one value,
just below and at ``min_numel``, ties, all zeros, negative only, fast mode's sampled path), and
decoding must not allocate much beyond the model it rebuilds."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
import torch

import fedcomp.methods.update as update_module
from fedcomp.codecs import SBC, Codec, DenseFP16, DenseFP32, TensorSpec, ThreeLC
from fedcomp.codecs.sbc import _sample_positions
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire import serde
from fedcomp.wire.payloads import (
    DensePayload,
    EncodedTensor,
    EncodedUpdate,
    Payload,
    SBCPayload,
    ThreeLCPayload,
)
from tests.codecs import kit
from tests.codecs import reference_sbc as ref_sbc
from tests.codecs import reference_threelc as ref_3lc

MIN_NUMEL = 1000
SAMPLE = 1500  # fast SBC samples tensors above this many values


def varied_update(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors at every edge the engine has to get right, in a fixed order."""
    g = np.random.default_rng(seed)
    t = {
        "empty": np.zeros((0, 3)),
        "one": np.array([0.25]),
        "below_min": g.standard_t(3, 999) * 1e-2,
        "at_min": g.standard_t(3, (10, 100)) * 1e-2,
        "ties": g.integers(-2, 3, 2000) * 0.5,
        "all_zero": np.zeros(3000),
        "negative_only": -np.abs(g.standard_t(3, 2500)) - 1e-3,
        "positive_sparse": np.where(g.random(4000) < 0.01, np.abs(g.standard_normal(4000)), 0.0),
        "conv": g.standard_t(3, (8, 4, 5, 5)) * 1e-3,  # 800 values: dense
        "big_conv": g.standard_t(3, (16, 8, 3, 3, 3)) * 1e-3,  # 3456 values: sampled in fast mode
        "fc": g.standard_normal((60, 100)) * 1e-2,
        "huge_range": g.standard_normal(2048) * 10.0 ** g.integers(-30, 30, 2048),
    }
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in t.items()}


def _dense32(name: str, x: torch.Tensor) -> EncodedTensor:
    data = x.numpy().astype("<f4").tobytes()
    return EncodedTensor(name, tuple(x.shape), "float32", "dense-fp32", 1, DensePayload("float32", data))


def reference_update(codec: Codec, tensors: dict[str, torch.Tensor]) -> EncodedUpdate:
    """Each tensor through the plain-Python reference of ``codec`` (dense fp32 below MIN_NUMEL)."""
    out = []
    for name, x in tensors.items():
        values = x.reshape(-1).tolist()
        n = len(values)
        if n < MIN_NUMEL:
            out.append(_dense32(name, x))
            continue
        payload: Payload
        if isinstance(codec, SBC):
            if codec.mode == "fast" and n > codec.sample_size:
                sample = _sample_positions(n, codec.sample_size, "cpu").tolist()
                mean, b, nnz, bits = ref_sbc.sbc_fast(values, codec.p, sample)
            else:
                mean, b, nnz, bits = ref_sbc.sbc_exact(values, codec.p)
            payload = SBCPayload(mean=mean, golomb_b=b, nnz=nnz, bits=bits)
        elif isinstance(codec, ThreeLC):
            scale, data = ref_3lc.encode(values, codec.s, codec.zero_run)
            payload = ThreeLCPayload(scale=scale, numel=n, zero_run=codec.zero_run, data=data)
        else:  # dense fp16: NumPy's IEEE round-to-nearest-even cast (inf past its range), not torch's
            assert isinstance(codec, DenseFP16)
            with np.errstate(over="ignore"):
                payload = DensePayload("float16", x.numpy().astype("<f2").tobytes())
        out.append(EncodedTensor(name, tuple(x.shape), "float32", codec.codec_id, 1, payload))
    return EncodedUpdate(base_model_version=0, tensors=tuple(out))


CODECS = [
    SBC(0.01, "fast", sample_size=SAMPLE),
    SBC(0.05, "fast", sample_size=SAMPLE),
    SBC(0.01, "exact"),
    ThreeLC(1.0),
    ThreeLC(1.9),
    ThreeLC(1.0, zero_run=False),
    DenseFP16(),
]


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("seed", [0, 1])
def test_whole_update_bytes_equal_the_per_tensor_references(codec: Codec, seed: int) -> None:
    tensors = varied_update(seed)
    enc = UpdateEncoder(codec, min_numel=MIN_NUMEL, error_feedback=False)
    got = serde.update_to_bytes(enc.encode(tensors))
    assert got == serde.update_to_bytes(reference_update(codec, tensors))
    # the per-tensor public API gives the same tensors
    per_tensor = [(enc.small_codec if t.numel() < MIN_NUMEL else codec).encode(t, n) for n, t in tensors.items()]
    assert serde.update_to_bytes(EncodedUpdate(0, tuple(per_tensor))) == got


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_whole_update_decodes_to_the_reference_values(codec: Codec) -> None:
    tensors = varied_update(2)
    enc = UpdateEncoder(codec, min_numel=MIN_NUMEL, error_feedback=False)
    data = serde.update_to_bytes(enc.encode(tensors))
    specs = specs_of(tensors)
    out = decode_update(serde.update_from_bytes(data, specs), specs, [codec, DenseFP32()])
    assert list(out) == list(tensors)
    for spec, e in zip(specs, reference_update(codec, tensors).tensors, strict=True):
        p = e.payload
        if isinstance(p, SBCPayload):
            want = np.zeros(spec.numel, dtype=np.float32)
            want[ref_sbc.decode_positions(p.bits, p.nnz, p.golomb_b)] = p.mean
        elif isinstance(p, ThreeLCPayload):
            want = np.array(ref_3lc.decode(p.scale, p.data, spec.numel, p.zero_run), dtype=np.float32)
        else:
            assert isinstance(p, DensePayload)
            want = np.frombuffer(p.data, dtype="<f2" if p.encoding == "float16" else "<f4").astype(np.float32)
        got = out[spec.name]
        assert got.shape == spec.shape and got.dtype == torch.float32
        assert got.numpy().reshape(-1).tobytes() == want.tobytes(), spec.name  # bits, signed zeros included


# LeNet5-Caffe's shapes: a small model whose decode must stay within about its own size.
LENET = {"c1.w": (20, 1, 5, 5), "c1.b": (20,), "c2.w": (50, 20, 5, 5), "c2.b": (50,)}
LENET |= {"f1.w": (500, 800), "f1.b": (500,), "f2.w": (10, 500), "f2.b": (10,)}


@pytest.mark.parametrize(
    ("codec", "factor"),
    [
        (SBC(0.01), 1.0),
        (SBC(0.1), 1.0),
        (SBC(0.4), 2.0),  # 40 % kept: the int64 positions alone are 3.2 bytes per value
        (ThreeLC(1.0), 1.0),
        (ThreeLC(1.0, zero_run=False), 1.0),
        (DenseFP16(), 1.0),
    ],
    ids=repr,
)
def test_decoding_a_small_model_allocates_about_its_own_size(codec: Codec, factor: float) -> None:
    """Beyond the output tensors, decoding allocates at most about the model's own size: NumPy
    temporaries (traced by tracemalloc: the peak less what the outputs keep) at most ``factor``
    times the model's bytes, and torch tensors no bigger than the model's largest tensor."""
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(s, generator=g) * 1e-2 for k, s in LENET.items()}
    model_bytes = 4 * sum(t.numel() for t in tensors.values())
    specs = [TensorSpec(k, tuple(s)) for k, s in LENET.items()]
    data = serde.update_to_bytes(UpdateEncoder(codec, error_feedback=False).encode(tensors))
    update = serde.update_from_bytes(data, specs)
    decode_update(update, specs, [codec, DenseFP32()])  # warm: lazy imports and caches are not the decoder's
    with kit.LargestTensor() as made:
        decode_update(update, specs, [codec, DenseFP32()])
    tracemalloc.start()  # separately: the dispatch mode's own bookkeeping would be traced too
    try:
        out = decode_update(update, specs, [codec, DenseFP32()])
        kept, peak = tracemalloc.get_traced_memory()  # kept: outputs NumPy allocated (SBC's zeros)
    finally:
        tracemalloc.stop()
    assert sum(t.numel() for t in out.values()) == model_bytes // 4
    assert made.largest <= max(s.numel for s in specs)
    extra = peak - kept
    assert extra <= factor * model_bytes, f"{extra} bytes of temporaries decoding a {model_bytes}-byte model"


# --- tensors at once on the CPU threads (sbc.run_jobs) -----------------------------------------


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """Torch's thread count, as it was before the test (which changes it)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=[0, 3000], ids=["all-in-lanes", "small-ones-here"])
def lane_min(request, monkeypatch) -> int:
    """The size from which a ``tensor_parallel`` codec's tensors go to the lanes: 0 puts every
    one there; 3000 keeps the smaller ones on the calling thread meanwhile, as the default (64k)
    does with a real model's (the tensors here are small)."""
    monkeypatch.setattr(update_module, "_LANE_MIN", request.param)
    return request.param


@pytest.mark.parametrize(
    "codec", [SBC(0.01, "fast", sample_size=SAMPLE), SBC(0.02, "exact"), ThreeLC(1.0), DenseFP16()], ids=repr
)
def test_tensors_encoded_at_once_give_the_bytes_and_residuals_of_one_thread(
    codec: Codec, lane_min: int, restore_threads: None
) -> None:
    """Three rounds with error feedback and ``keep_sent``, on 1 thread and on 4: the same bytes,
    the same reconstructions and the same residuals, bit for bit (the threaded encoder only
    changes which thread encodes which tensor)."""
    runs = []
    for threads in (1, 4):
        torch.set_num_threads(threads)
        enc = UpdateEncoder(codec, min_numel=MIN_NUMEL)
        got = []
        for rnd in range(3):
            tensors = {k: v for k, v in varied_update(rnd).items() if k != "huge_range"}  # fp16: inf
            data = serde.update_to_bytes(enc.encode(tensors, keep_sent=True))
            assert enc.sent is not None
            sent = {k: v.numpy().tobytes() for k, v in enc.sent.items()}
            got.append((data, sent, {k: v.numpy().tobytes() for k, v in enc.state_dict().items()}))
        runs.append(got)
    assert runs[0] == runs[1]
    assert runs[0][0][2]  # residuals exist (so the comparison saw them)


def test_run_jobs_runs_jobs_at_once_in_order_and_raises_the_earliest_error(restore_threads: None) -> None:
    import threading

    from fedcomp.codecs import sbc

    torch.set_num_threads(2)
    meet = threading.Barrier(2, timeout=10)  # passes only when two jobs run at the same time
    seen: list[int] = []

    def job(i: int) -> int:
        if i < 2:
            meet.wait()
        seen.append(sbc.split_run(lambda b, e: (b, e), 1 << 22, 64, 1).__len__())
        return i * i

    assert sbc.run_jobs([lambda i=i: job(i) for i in range(6)], [100, 90, 1, 2, 3, 4]) == [0, 1, 4, 9, 16, 25]
    assert seen == [1] * 6  # inside a job split_run runs in one part: every thread has a job
    assert len(sbc.split_run(lambda b, e: (b, e), 1 << 22, 64, 1)) == 2  # outside: two parts again

    ran: list[int] = []

    def failing(i: int) -> int:
        ran.append(i)
        if i in (3, 1):
            raise ValueError(f"job {i}")
        return i

    with pytest.raises(ValueError, match="job 1"):  # the earliest in order, as a loop raises
        sbc.run_jobs([lambda i=i: failing(i) for i in range(5)], [1, 2, 3, 4, 5])
    assert sorted(ran) == [0, 1, 2, 3, 4]  # and every job ran
    here = threading.get_ident()
    threads = sbc.run_jobs([lambda: threading.get_ident()] * 4, [1, 1, 1, 1], [True, False, True, False])
    assert threads[0] == threads[2] == here  # local jobs: on the calling thread
    both = threading.Barrier(2, timeout=10)  # a local job and a lane job at the same time

    def meets() -> int:
        both.wait()
        return len(sbc.split_run(lambda b, e: (b, e), 1 << 22, 64, 1))

    # the local job runs while the other lane starts (and split_run is serial in it too)
    assert sbc.run_jobs([meets, meets, lambda: 0], [1, 5, 1], [True, False, False]) == [1, 1, 0]
    torch.set_num_threads(1)
    assert sbc.run_jobs([lambda: threading.get_ident()] * 3, [1, 1, 1]) == [here] * 3


@pytest.mark.parametrize("codec", [SBC(0.01, "fast", sample_size=SAMPLE), ThreeLC(1.0)], ids=repr)
def test_tensors_decoded_at_once_give_a_loops_values_and_first_error(
    codec: Codec, lane_min: int, restore_threads: None
) -> None:
    """Decoding on 1 thread and on 4 (tensors at once): the same values bit for bit, into new
    tensors and into kept buffers; and for an update broken in two tensors, the same error: the
    first broken tensor's, as a loop raises it."""
    import dataclasses

    from fedcomp.errors import PayloadError

    tensors = varied_update(4)
    specs = specs_of(tensors)
    update = UpdateEncoder(codec, min_numel=MIN_NUMEL, error_feedback=False).encode(tensors)
    by_name = {e.name: e for e in update.tensors}
    field = "bits" if isinstance(codec, SBC) else "data"
    bad_bits = dataclasses.replace(by_name["fc"].payload, **{field: b"\xff" * 3})  # type: ignore[type-var]
    broken = tuple(
        dataclasses.replace(e, payload=bad_bits)
        if e.name == "fc"
        else dataclasses.replace(e, codec_id="nope")
        if e.name == "big_conv"
        else e
        for e in update.tensors
    )
    got = []
    for threads in (1, 4):
        torch.set_num_threads(threads)
        fresh = decode_update(update, specs, [codec, DenseFP32()])
        bufs = {s.name: torch.full(s.shape, 7.0) for s in specs}
        into = decode_update(update, specs, [codec, DenseFP32()], out=bufs)
        assert all(into[k] is bufs[k] for k in bufs)
        with pytest.raises(PayloadError) as err:
            decode_update(EncodedUpdate(0, broken), specs, [codec, DenseFP32()])
        got.append(
            (
                [t.numpy().tobytes() for t in fresh.values()],
                [t.numpy().tobytes() for t in into.values()],
                str(err.value),
            )
        )
    assert got[0] == got[1]
    assert got[0][0] == got[0][1]
    assert "big_conv" in got[0][2]  # the earlier of the two broken tensors
