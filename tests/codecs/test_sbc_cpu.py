"""SBC's CPU selection for large tensors: exact mode picks its candidates in one threaded scan
and the finiteness check is one chunked reduction; both must give exactly what the whole-array
rule gives (a stable sort), ties and masses of zeros included."""

import numpy as np
import pytest
import torch

import fedcomp.codecs.sbc as sbc
from fedcomp.codecs.sbc import SBC, _extreme_positions_cpu, all_finite


def stable_extremes(a: np.ndarray, k: int) -> tuple[list[int], list[int]]:
    """The rule by a stable sort: the k largest / smallest, ties to the lowest index, ascending."""
    hi = np.sort(np.argsort(-a, kind="stable")[:k])
    lo = np.sort(np.argsort(a, kind="stable")[:k])
    return hi.tolist(), lo.tolist()


def values(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, n)
    if kind == "levels":  # few distinct values: long ties across the selection boundary
        x = np.round(x * 2) / 2
    elif kind == "zeros":  # mostly zeros: the candidates overflow, the whole-array path runs
        x = np.where(rng.random(n) < 0.005, x, 0.0)
    elif kind == "skewed":  # one side far heavier than the other
        x = np.abs(x) * np.where(rng.random(n) < 0.9, 1.0, -0.01)
    return x.astype(np.float32)


@pytest.mark.parametrize("kind", ["student", "levels", "zeros", "skewed"])
@pytest.mark.parametrize("n,p", [(8192, 0.01), (100_003, 0.01), (300_000, 0.001), (70_000, 0.05)])
def test_extreme_positions_equal_a_stable_sort(kind, n, p):
    a = values(kind, n, seed=n)
    k = max(1, round(p * n))
    hi, lo = _extreme_positions_cpu(a, k)
    assert (hi.tolist(), lo.tolist()) == stable_extremes(a, k)


def test_candidate_scan_runs_split_among_threads(monkeypatch):
    """Several threads' parts joined in order: the same positions as one thread."""
    a = values("levels", 200_000, seed=3)
    k = 2000
    want = stable_extremes(a, k)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    monkeypatch.setattr(sbc, "_PARALLEL_MIN", 1000)
    monkeypatch.setattr(sbc, "_CPU_CHUNK", 512)
    hi, lo = _extreme_positions_cpu(a, k)
    assert (hi.tolist(), lo.tolist()) == want


def test_all_finite_finds_every_nan_and_infinity(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(sbc, "_PARALLEL_MIN", 1000)
    monkeypatch.setattr(sbc, "_CPU_CHUNK", 256)
    a = values("student", 10_000, seed=4)
    assert all_finite(a) and all_finite(a[:0])
    for i in (0, 255, 256, 3333, 3334, 6666, 9999):  # chunk and part edges
        for bad in (np.nan, np.inf, -np.inf):
            b = a.copy()
            b[i] = bad
            assert not all_finite(b)
    big = np.full(10_000, 3e38, dtype=np.float32)  # finite, but every chunk's sum overflows
    assert all_finite(big) and all_finite(-big)
    with pytest.raises(ValueError, match="NaN or infinite"):
        SBC(mode="exact").encode(torch.from_numpy(np.where(np.arange(10_000) == 9999, np.nan, a).astype(np.float32)))
