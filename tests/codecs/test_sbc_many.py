"""``SBC.encode_many``: a list of tensors in one call of the C kernel must give exactly
:meth:`SBC.encode`'s bytes for every tensor it takes, leave to ``encode`` (None) exactly the cases
only the Python path handles, and do so on any number of threads, on torch's OpenMP team or on
threads of its own (a forked child)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fedcomp.codecs import SBC
from fedcomp.codecs import sbc as sbc_module
from tests.forking import result_in_fork

pytestmark = pytest.mark.skipif(
    sbc_module._KERNEL is None or not hasattr(sbc_module._KERNEL, "encode_many"),
    reason="the SBC kernel is not built (FEDCOMP_NATIVE=0 or no compiler): encode_many leaves all to encode",
)

SAMPLE = 1500  # fast mode samples tensors above this many values


@pytest.fixture(autouse=True)
def two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests below read what is left to ``encode`` on two threads (this project's CI machine);
    on more threads a smaller tensor is above an even share and left too (tested on its own below),
    which a 16-core machine showed. A test may set another count after this."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)


def _f32(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


def batched_kinds(seed: int) -> dict[str, torch.Tensor]:
    """Tensors the kernel must take (finite, float32, contiguous, within its sizes)."""
    g = np.random.default_rng(seed)
    n = int(g.integers(2_000, 20_000))  # (no tensor above an even share of three threads)
    return {
        "student": _f32(g.standard_t(3, n) * 1e-2),
        "gauss": _f32(g.standard_normal(20_000)),
        "levels": _f32(g.integers(-2, 3, 5_000) * 0.5),  # ties at both thresholds and in the means
        "zeros": _f32(np.zeros(4_000)),
        "positive": _f32(np.abs(g.standard_t(3, 6_000)) + 1e-3),
        "negative": _f32(-np.abs(g.standard_t(3, 6_000)) - 1e-3),
        "symmetric": _f32(np.concatenate([np.arange(1, 3001), -np.arange(1, 3001)])),  # equal means: + side
        "sparse": _f32(np.where(g.random(8_000) < 0.005, g.standard_normal(8_000), 0.0)),
        "subnormal": _f32(g.standard_normal(3_000) * 1e-40),
        "range": _f32(g.standard_normal(4_096) * 10.0 ** g.integers(-20, 20, 4_096)),  # see MAY_LEAVE
        "two": _f32(np.array([1.0, -2.0])),
        "at_sample": _f32(g.standard_t(3, SAMPLE)),
        "above_sample": _f32(g.standard_t(3, SAMPLE + 1)),
        "matrix": _f32(g.standard_t(3, (64, 50))),
    }


#: Taken or left depending on p: a side of "range" spans exponents too far for a float64 sum to be
#: exact when it holds more than its few largest values (the Python path then sums by exponent).
MAY_LEAVE = {"range"}


def left_kinds() -> dict[str, torch.Tensor]:
    """Tensors left to ``encode`` (None), whatever it then does with them (encode or raise)."""
    nan = np.ones(3_000)
    nan[17] = np.nan
    inf = np.ones(3_000)
    inf[5] = -np.inf
    return {
        "empty": _f32(np.zeros(0)),
        "one": _f32(np.array([0.5])),
        "nan": _f32(nan),
        "inf": _f32(inf),
        "float64": torch.ones(3_000, dtype=torch.float64),
        "strided": _f32(np.arange(6_000.0)).view(3_000, 2).t(),
        "exact_too_big": _f32(np.repeat(np.arange(-3.0, 4.0), 10_000)),  # ties: fast falls back to exact
    }


def _outcome(codec: SBC, name: str, t: torch.Tensor) -> object:
    try:
        return codec.encode(t, name)
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize(
    "codec",
    [
        SBC(0.01, "fast", sample_size=SAMPLE),
        SBC(0.1, "fast", sample_size=SAMPLE),
        SBC(0.02, "exact"),
        SBC(0.2, "exact"),
    ],
    ids=repr,
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_encode_many_gives_encodes_bytes(codec: SBC, threads: int, monkeypatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    for seed in range(3):
        tensors = batched_kinds(seed)
        if codec.mode == "exact":  # exact mode in the kernel stops at _KERNEL_ORDER_MAX values
            tensors = {k: v for k, v in tensors.items() if v.numel() <= sbc_module._KERNEL_ORDER_MAX}
        items = list(tensors.items())
        got = codec.encode_many(items)
        assert [n for (n, _), g in zip(items, got) if g is None and n not in MAY_LEAVE] == []
        want = [codec.encode(t, n) for n, t in items]
        assert [g == w for g, w in zip(got, want) if g is not None] == [True] * sum(g is not None for g in got)


@pytest.mark.parametrize("codec", [SBC(0.01, "fast", sample_size=SAMPLE), SBC(0.2, "exact")], ids=repr)
def test_encode_many_leaves_to_encode_what_only_it_handles(codec: SBC) -> None:
    left = left_kinds()
    items = list(batched_kinds(0).items())[:3] + list(left.items())
    got = codec.encode_many(items)
    for (name, t), g in zip(items, got):
        if name in left:
            assert g is None, name
        else:
            assert g == codec.encode(t, name), name
    # what encode then does with them is unchanged: the same bytes, or the same error
    assert isinstance(_outcome(codec, "nan", left["nan"]), str)


def test_sides_whose_float64_sum_is_not_exact_are_left_to_encode() -> None:
    # p = 0.5: the larger side holds 1e30 and 1e-30, 200 binary orders apart (encode sums those by
    # exponent); a side holding zeros beside its values still sums exactly in float64 and is taken.
    codec = SBC(0.5, "exact")
    wide = _f32(np.array([1e30] * 4 + [1e-30] * 3 + [-1.0] * 3))
    zeros = _f32(np.array([3.0, 2.0, 0.0, 0.0, 0.0, -1.0]))
    got = codec.encode_many([("wide", wide), ("zeros", zeros)])
    assert got[0] is None
    assert got[1] == codec.encode(zeros, "zeros")


def test_mean_ties_and_near_ties_choose_as_encode() -> None:
    # Few distinct levels: the two sides' means often tie exactly or differ in the last bits, where
    # only an exact comparison decides (the kernel's 128-bit one against Python's integers).
    g = np.random.default_rng(7)
    for trial in range(40):
        n = int(g.integers(1_000, 20_000))
        scale = float(2.0 ** g.integers(-30, 30))
        levels = g.choice([-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 1.0 + 2**-20, -(1.0 + 2**-20)], n)
        t = _f32(levels * scale)
        for codec in (SBC(float(g.uniform(0.001, 0.3)), "exact"), SBC(0.05, "fast", sample_size=SAMPLE)):
            (got,) = codec.encode_many([("t", t)])
            if got is not None:
                assert got == codec.encode(t, "t"), (trial, codec)


def test_a_tensor_above_an_even_share_is_left_to_encode(monkeypatch) -> None:
    # one thread's worth of work would keep the others waiting: encode splits its scan instead
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    codec = SBC(0.01, "fast", sample_size=SAMPLE)
    g = np.random.default_rng(3)
    big, small = _f32(g.standard_normal(100_000)), _f32(g.standard_normal(10_000))
    got = codec.encode_many([("big", big), ("small", small)])
    assert got[0] is None and got[1] == codec.encode(small, "small")


def _encode_in_child(queue) -> None:
    codec = SBC(0.01, "fast", sample_size=SAMPLE)
    queue.put([e.payload.bits if e is not None else None for e in codec.encode_many(list(batched_kinds(1).items()))])


def test_a_forked_child_encodes_on_threads_of_its_own(monkeypatch) -> None:
    # The parent's calls ran on its OpenMP team, which a forked child does not have (handing it
    # work there hangs): the child's kernel takes threads of its own and gives the same bytes.
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    codec = SBC(0.01, "fast", sample_size=SAMPLE)
    want = [e.payload.bits for e in codec.encode_many(list(batched_kinds(1).items()))]  # type: ignore[union-attr]
    torch.ones(1 << 20).add_(1.0)  # torch's team has run in the parent
    got, exitcode = result_in_fork(_encode_in_child)
    assert got == want
    assert exitcode == 0


def test_kernel_rejects_impossible_tasks() -> None:
    kernel = sbc_module._KERNEL
    a = np.zeros(10, dtype=np.float32)
    ln = sbc_module.LN_PHI_MINUS_1
    with pytest.raises(ValueError, match="task 0"):
        kernel.encode_many([(a, None, 11, 1)], 1 << 16, ln, 1, True)  # k above n
    with pytest.raises(ValueError, match="task 1"):
        kernel.encode_many([(a, None, 1, 1), (a, np.zeros(2, dtype=np.int64), 1, 3)], 1 << 16, ln, 1, True)
    with pytest.raises(TypeError):
        kernel.encode_many([(a, None, 1)], 1 << 16, ln, 1, True)
    # a sample position outside the tensor: left to the Python path, never read
    (res,) = kernel.encode_many([(a, np.array([0, 99], dtype=np.int64), 1, 1)], 1 << 16, ln, 2, True)
    assert res is None
