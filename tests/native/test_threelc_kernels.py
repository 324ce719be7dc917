"""3LC's C kernels (fedcomp/_native/threelc.c) against the NumPy path they replace and the plain-Python
reference: the same scale, bytes, reconstruction bits, decoded bits and errors, on sizes around the
5-value groups, the kernels' 64-group blocks and 2048-value scan chunks and the thread-split ranges;
all zeros, one value, s = 1 and 1.9, values exactly at the threshold, long zero runs, non-finite
input; and hostile payloads (truncated, over-long runs, digits above 242)."""

from __future__ import annotations

import dataclasses
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedcomp.codecs.sbc as sbc
import fedcomp.codecs.threelc as threelc
from fedcomp import _native
from fedcomp.codecs.base import TensorSpec
from fedcomp.codecs.threelc import ThreeLC, groups
from fedcomp.errors import PayloadError
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire import serde
from fedcomp.wire.payloads import ThreeLCPayload
from tests.codecs import reference_threelc as ref
from tests.codecs.test_threelc import S_VALUES, sparse_tensors
from tests.codecs.test_threelc_cpu import packed_streams

KERNEL = _native.load("threelc")
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="fedcomp._native._threelc is not built or FEDCOMP_NATIVE=0")

FAST = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)

#: Sizes around groups of 5, the packer's 64-group blocks (320 values), the scan's 2048-value
#: chunks and the NumPy path's chunks.
SIZES = [0, 1, 2, 4, 5, 6, 9, 11, 319, 320, 321, 324, 326, 2047, 2048, 2049, 10_239, 10_240, 10_241, 65_537]
KINDS = ["t", "sparse", "zeros", "one", "levels", "tiny", "huge", "negative"]


def test_the_kernel_is_built_and_in_use():
    """A build that silently failed is noticed: the optional extension must be there and used."""
    if not _native.enabled():
        pytest.skip("FEDCOMP_NATIVE=0: the kernels are switched off on purpose")
    assert os.environ.get("FEDCOMP_NATIVE", "1").strip() != "0"
    assert KERNEL is not None, "fedcomp._native._threelc failed to build or import"
    assert threelc._KERNEL is KERNEL
    assert _native.status()["threelc"]


def values(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, n)
    if kind == "sparse":  # long runs of zero groups between a few values
        x = np.where(rng.random(n) < 0.003, x, 0.0)
    elif kind == "zeros":
        x = np.zeros(n)
        x[::5] = -0.0
    elif kind == "one":
        x = np.zeros(n)
        if n:
            x[int(rng.integers(n))] = -3.5
    elif kind == "levels":  # exact fractions of max|x|: ties for round() at +-m/2
        x = rng.integers(-4, 5, n) * 0.25
    elif kind == "tiny":  # subnormal scale and values
        x = x * 1e-42
    elif kind == "huge":  # m clamped to the float32 maximum with s = 1.9
        x = x / max(1.0, float(np.abs(x).max(initial=1.0))) * 3.0e38
    elif kind == "negative":
        x = -np.abs(x)
    return x.astype(np.float32)


def encode_both(monkeypatch, a: np.ndarray, s: float, zero_run: bool, recon: bool):
    """(payload, reconstruction bytes or None) by the kernel, then by the NumPy path."""
    out = []
    codec = ThreeLC(s=s, zero_run=zero_run)
    for kernel in (KERNEL, None):
        monkeypatch.setattr(threelc, "_KERNEL", kernel)
        x = torch.from_numpy(a.copy())
        if recon:
            enc, rec = codec.encode_with_reconstruction(x, "w")
            out.append((enc.payload, rec.numpy().tobytes()))
        else:
            out.append((codec.encode(x, "w").payload, None))
    return out


@needs_kernel
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("s", [1.0, 1.9])
def test_encode_equals_the_numpy_path(monkeypatch, kind, s):
    for n in SIZES:
        a = values(kind, n, n)
        for zero_run in (True, False):
            (k_pay, k_rec), (np_pay, np_rec) = encode_both(monkeypatch, a, s, zero_run, recon=True)
            assert k_pay == np_pay, (kind, n, zero_run)
            assert k_rec == np_rec, (kind, n, zero_run)  # bits: +0.0 and -0.0 differ
        m, data = ref.encode(a.tolist(), s, True)
        k_zr = encode_both(monkeypatch, a, s, True, recon=False)[0][0]
        assert (k_zr.scale, k_zr.data) == (m, data), (kind, n)


@needs_kernel
@FAST
@given(x=sparse_tensors(), s=S_VALUES, zero_run=st.booleans(), dense=st.booleans())
def test_encode_equals_the_reference_on_any_tensor(monkeypatch, x, s, zero_run, dense):
    """Hypothesis tensors (special values, zeroed stretches, ties), through the sparse packer
    (candidates) and the dense one (the candidate limit set to nothing)."""
    x = x.reshape(-1)
    if not bool(torch.isfinite(x).all()):
        return
    monkeypatch.setattr(threelc, "_SPARSE_ENCODE", 1 << 40 if dense else 1)
    (k_pay, k_rec), (np_pay, np_rec) = encode_both(monkeypatch, x.numpy(), s, zero_run, recon=True)
    assert (k_pay.scale, k_pay.data) == ref.encode(x.tolist(), s, zero_run)
    assert k_pay == np_pay and k_rec == np_rec


@needs_kernel
@pytest.mark.parametrize("s", [1.0, 1.9])
def test_values_at_the_threshold(monkeypatch, s):
    """+-t (the least that rounds to +-1) and the float32 just inside it, in every part."""
    m = threelc.scale_for(1.0, s)
    t = threelc.round_threshold(m)
    assert t is not None
    inside = np.nextafter(t, np.float32(0.0))
    row = [1.0, t, -t, inside, -inside, 0.0, -0.0, -1.0, t]
    for n in (9, 45, 331, 4099):
        a = np.resize(np.array(row, dtype=np.float32), n)
        a[0] = 1.0
        for zero_run in (True, False):
            (k_pay, k_rec), (np_pay, np_rec) = encode_both(monkeypatch, a, s, zero_run, recon=True)
            assert k_pay == np_pay and k_rec == np_rec
            assert (k_pay.scale, k_pay.data) == ref.encode(a.tolist(), s, zero_run)


@needs_kernel
def test_params_equal_scale_for_and_round_threshold():
    """The kernel's m and threshold against the Python ones, normal and subnormal maxima."""
    rng = np.random.default_rng(3)
    tops = [0.0, 1.0, 3.0e38, 3.4028235e38, 1e-38, 1.2e-38, 1e-40, 1e-45, 7e-46]
    tops += list(rng.standard_t(2, 200) * 10.0 ** rng.integers(-44, 38, 200))
    for top in tops:
        bits = int(np.abs(np.float32(top)).view(np.uint32))
        top32 = float(np.abs(np.float32(top)))
        for s in (1.0, 1.3, 1.9, 1.9999999):
            code, m, tbits = KERNEL.params(bits, s)
            assert m == threelc.scale_for(top32, s)
            t = threelc.round_threshold(m) if m > 0 else None
            if m == 0.0:
                assert (code, tbits) == (0, 0x7F800000)
            elif t is None:
                assert code == 3
            else:
                assert (code, tbits) == (0, int(np.float32(t).view(np.uint32))), (top, s)
    assert KERNEL.params(0x7F800000, 1.0)[0] == 2 and KERNEL.params(0x7FC00000, 1.0)[0] == 1


@needs_kernel
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_raises_as_the_numpy_path(monkeypatch, bad):
    for n, at in ((1, 0), (7, 6), (5000, 2047), (5000, 2048), (5000, 4999)):
        a = values("t", n, 1)
        a[at] = bad
        if n > 1 and bad != bad:  # a NaN after an infinity is still reported as NaN
            a[0] = np.inf
        msgs = []
        for kernel in (KERNEL, None):
            monkeypatch.setattr(threelc, "_KERNEL", kernel)
            with pytest.raises(ValueError, match="non-finite") as info:
                ThreeLC().encode(torch.from_numpy(a), "w")
            msgs.append(str(info.value))
        assert msgs[0] == msgs[1]


def force_threads(monkeypatch, chunk: int = 128) -> None:
    """Split tensors of a few thousand values into several ranges on the pool's threads."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(threelc, "_CPU_CHUNK", 64)
    monkeypatch.setattr(threelc, "_SCAN_CHUNK", chunk)
    monkeypatch.setattr(threelc, "_PARALLEL_GROUPS", 100)
    monkeypatch.setattr(threelc, "_PARALLEL_VALUES", 500)
    monkeypatch.setattr(sbc, "_PARALLEL_MIN", 100)


def counted(fn, calls: list[int]):
    """``fn``, appending to ``calls`` each time it runs."""

    def wrapper(*args):
        calls.append(1)
        return fn(*args)

    return wrapper


@needs_kernel
@pytest.mark.parametrize("kind", ["t", "sparse", "zeros", "one", "levels"])
@pytest.mark.parametrize("dense", [False, True])
def test_ranges_on_threads_give_the_single_threaded_bytes(monkeypatch, kind, dense):
    """The split encoder (per-range scans, then the sparse packer or per-range packing with the
    zero runs joined across ranges) gives the NumPy path's bytes and reconstruction."""
    for n in (5 * 3000 + 3, 20_000, 6 * 2048):
        a = values(kind, n, n + 7)
        if kind == "sparse":
            a[1000:9000] = 0.0  # a run of 121s over several ranges
        want = {}
        monkeypatch.setattr(threelc, "_KERNEL", None)
        for zero_run in (True, False):
            want[zero_run] = encode_both(monkeypatch, a, 1.5, zero_run, recon=True)[1]
        with monkeypatch.context() as mp:
            force_threads(mp)
            mp.setattr(threelc, "_SPARSE_ENCODE", 1 << 40 if dense else 32)
            calls: list[int] = []
            mp.setattr(threelc, "_encode_split", counted(threelc._encode_split, calls))
            for zero_run in (True, False):
                got = encode_both(mp, a, 1.5, zero_run, recon=True)[0]
                assert got == want[zero_run], (kind, n, zero_run)
            assert calls, "the split path did not run"


@needs_kernel
def test_split_non_finite_and_maximum_in_any_range(monkeypatch):
    force_threads(monkeypatch)
    a = values("t", 20_000, 4)
    for i in (0, 127, 128, 10_000, 19_999):
        for big in (1e6, -1e6):
            b = a.copy()
            b[i] = big
            assert ThreeLC().encode(torch.from_numpy(b), "w").payload.scale == 1e6
    for bad, text in ((np.nan, "nan"), (np.inf, "inf"), (-np.inf, "inf")):
        b = a.copy()
        b[-2] = bad
        with pytest.raises(ValueError, match=f"max\\|T\\| = {text}"):
            ThreeLC().encode(torch.from_numpy(b), "w")


@needs_kernel
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # 0 * inf, on purpose
@FAST
@given(data=packed_streams(), pad=st.integers(0, 4), zero_run=st.booleans())
def test_decode_equals_the_numpy_path(monkeypatch, data, pad, zero_run):
    """Every padding length; scale 0 (-1 digits give -0.0), subnormal, near and past the float32
    maximum (0 * inf is NaN in every 121 group): the same float32 bits."""
    g = len(data)
    numel = max(0, 5 * g - pad)
    if groups(numel) != g:
        return
    coded = ref.zero_run_encode(data) if zero_run else data
    spec = TensorSpec("w", (numel,), torch.float32)
    for scale in (0.0, 2.5, 1e-41, 3.4e38, 3.4028235677973366e38, 1e300):
        enc = ThreeLC(zero_run=zero_run).encode(torch.zeros(numel), "w")
        enc = dataclasses.replace(enc, payload=ThreeLCPayload(scale, numel, zero_run, coded))
        got = []
        for kernel in (KERNEL, None):
            monkeypatch.setattr(threelc, "_KERNEL", kernel)
            got.append(ThreeLC(zero_run=zero_run).decode(enc, spec, "cpu").numpy().tobytes())
        assert got[0] == got[1], scale
        if scale < 1e38:
            ref_vals = np.array(ref.decode(scale, coded, numel, zero_run), dtype=np.float32)
            assert np.array_equal(np.frombuffer(got[0], dtype=np.float32), ref_vals)


def hostile_payloads(numel: int) -> list[tuple[bool, bytes]]:
    g = groups(numel)
    good = ref.zero_run_encode(bytes([121] * (g - 3) + [0, 242, 7]))
    return [
        (True, good[:-1]),  # truncated
        (True, good + bytes([255])),  # runs past the end
        (True, bytes([255]) * (g // 14 + 1)),  # runs only, too many
        (True, bytes([243]) * (g // 2) + bytes([250])),  # over-long by a run
        (True, bytes([121]) * (g - 1)),  # one group short
        (False, bytes([121]) * (g - 1) + bytes([243])),  # a run byte without zero runs
        (False, bytes([0]) * (g - 1) + bytes([255])),
        (False, bytes([121]) * g + bytes([121])),  # too long
        (False, bytes([121]) * (g - 1)),  # truncated
    ]


@needs_kernel
@pytest.mark.parametrize("numel", [11, 100, 1001])
def test_hostile_payloads_raise_the_numpy_paths_error(monkeypatch, numel):
    spec = TensorSpec("w", (numel,), torch.float32)
    enc = ThreeLC().encode(torch.zeros(numel), "w")
    for zero_run, data in hostile_payloads(numel):
        bad = dataclasses.replace(enc, payload=ThreeLCPayload(1.0, numel, zero_run, data))
        msgs = []
        for kernel in (KERNEL, None):
            monkeypatch.setattr(threelc, "_KERNEL", kernel)
            with pytest.raises(PayloadError) as info:
                ThreeLC(zero_run=zero_run).decode(bad, spec, "cpu")
            msgs.append(str(info.value))
        assert msgs[0] == msgs[1], (zero_run, data[:20])
        out = np.zeros(numel, dtype=np.float32)
        assert not KERNEL.decode(data, numel, 1.0, zero_run, out, True)  # the kernel itself says no


@needs_kernel
def test_kernels_check_their_buffers():
    a = np.ones(100, dtype=np.float32)
    with pytest.raises(ValueError):
        KERNEL.encode(a, 1.0, bytearray(19), None, True, np.empty(3, np.int64))  # 20 groups
    with pytest.raises(ValueError):
        KERNEL.encode(a, 1.0, bytearray(20), np.zeros(99, np.float32), True, np.empty(3, np.int64))
    with pytest.raises(ValueError):
        KERNEL.pack(a, 0x3F000000, 1.0, 0, 21, bytearray(21), None, True, False)  # past the groups
    with pytest.raises(ValueError):
        KERNEL.pack(a, 0x3F000000, 1.0, 0, 20, bytearray(10), None, True, False)
    with pytest.raises(ValueError):
        KERNEL.scan(a, 0, 101, 1.0, np.empty(4, np.int64), 0, 3)
    with pytest.raises(ValueError):
        KERNEL.scan(a, 0, 100, 1.0, np.empty(4, np.int64), 2, 3)
    with pytest.raises(ValueError):  # candidates outside the tensor or not ascending
        KERNEL.pack_sparse(a, np.array([5, 100], np.int64), 0x3F000000, 1.0, bytearray(20), None, True)
    with pytest.raises(ValueError):
        KERNEL.pack_sparse(a, np.array([5, 5], np.int64), 0x3F000000, 1.0, bytearray(20), None, True)
    with pytest.raises(ValueError):
        KERNEL.decode(b"\x79" * 20, 100, 1.0, False, np.zeros(99, np.float32), True)
    assert KERNEL.max_abs(np.array([1.0, -7.5, 2.0], np.float32), 0, 3) == int(np.float32(7.5).view(np.uint32))


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model's update: tiny tensors (sent dense), sparse and dense ones, a zero one and
    one large enough to be split among threads."""
    rng = np.random.default_rng(seed)
    shapes = {"conv": (64, 3, 7, 7), "bn": (64,), "fc": (1000, 512), "zero": (4096,), "odd": (1001, 3)}
    out = {}
    for name, shape in shapes.items():
        x = rng.standard_t(3, shape) * (rng.random(shape) < (0.02 if name == "fc" else 1.0))
        out[name] = torch.from_numpy((x * (name != "zero")).astype(np.float32))
    return out


@needs_kernel
@pytest.mark.parametrize("s", [1.0, 1.9])
@pytest.mark.parametrize("split", [False, True])
def test_whole_update_bytes_equal_with_the_kernel_on_and_off(monkeypatch, s, split):
    """UpdateEncoder -> wire bytes -> decode_update, with error feedback (the server's downlink
    path: the reconstruction feeds the residual) over two rounds: identical bytes, decoded
    tensors and residuals."""
    if split:
        force_threads(monkeypatch, chunk=4096)
    update = model()
    results = []
    for kernel in (KERNEL, None):
        monkeypatch.setattr(threelc, "_KERNEL", kernel)
        codec = ThreeLC(s=s)
        enc = UpdateEncoder(codec, error_feedback=True)
        rounds = []
        for r in range(2):
            data = serde.update_to_bytes(enc.encode({k: v * (r + 1) for k, v in update.items()}))
            dec = decode_update(serde.update_from_bytes(data), specs_of(update), [codec, enc.small_codec], "cpu")
            state = enc.state_dict()
            rounds.append(
                (data, [v.numpy().tobytes() for v in dec.values()], [v.numpy().tobytes() for v in state.values()])
            )
        results.append(rounds)
    assert results[0] == results[1]
