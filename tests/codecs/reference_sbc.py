"""A slow, obviously correct reference for SBC exact mode and its Golomb position coding.

Plain Python loops, exact rational arithmetic (``Fraction``) and bit strings of '0'/'1': nothing
here shares code with ``fedcomp.codecs.sbc`` or ``fedcomp.codecs.golomb``. Tests compare the fast
torch implementation against it byte for byte.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

PHI = (1.0 + math.sqrt(5.0)) / 2.0


def golomb_b(p: float) -> int:
    """b* = 1 + floor(log2(ln(phi - 1) / ln(1 - p))), clamped to [0, 62]."""
    if p <= 0.0:
        return 62
    if p >= 1.0:
        return 0
    b = 1 + math.floor(math.log2(math.log(PHI - 1.0) / math.log(1.0 - p)))
    return min(62, max(0, b))


def encode_positions(positions: list[int], b: int) -> bytes:
    """Remainders section (each r in b bits, MSB first), then the unary section (q ones, a zero),
    padded with zeros to whole bytes, MSB first."""
    remainders = ""
    unary = ""
    previous = -1
    for position in positions:
        gap = position - previous
        previous = position
        q, r = divmod(gap - 1, 2**b)
        if b > 0:
            remainders += format(r, "b").zfill(b)
        unary += "1" * q + "0"
    stream = remainders + unary
    while len(stream) % 8 != 0:
        stream += "0"
    return bytes(int(stream[i : i + 8], 2) for i in range(0, len(stream), 8))


def decode_positions(data: bytes, nnz: int, b: int) -> list[int]:
    """Inverse of :func:`encode_positions` for well-formed input."""
    stream = "".join(format(byte, "08b") for byte in data)
    remainders = [int(stream[k * b : (k + 1) * b], 2) if b > 0 else 0 for k in range(nnz)]
    cursor = nnz * b
    positions = []
    previous = -1
    for k in range(nnz):
        q = 0
        while stream[cursor] == "1":
            q += 1
            cursor += 1
        cursor += 1  # the terminating zero
        previous = previous + q * 2**b + remainders[k] + 1
        positions.append(previous)
    return positions


def round_to_float32(x: Fraction) -> float:
    """The float32 nearest to ``x``, ties to an even mantissa: try the candidates around a
    first guess and keep the closest."""
    with np.errstate(over="ignore", under="ignore"):
        guess = np.float32(float(x))
        candidates = [
            np.nextafter(guess, np.float32(-np.inf)),
            guess,
            np.nextafter(guess, np.float32(np.inf)),
        ]

    def key(c: np.float32) -> tuple[Fraction, int]:
        odd = int(np.array([c], dtype=np.float32).view(np.uint32)[0]) & 1
        return abs(Fraction(float(c)) - x), odd

    return float(min(candidates, key=key))


def sbc_exact(values: list[float], p: float) -> tuple[float, int, int, bytes]:
    """Algorithm 2 on float32 ``values``: returns (mean, golomb_b, nnz, bits).

    k = max(1, round(p * n)) per side; ties go to the lowest index; means are exact rationals
    rounded once to float32; the positive side wins when mu+ >= mu-.
    """
    n = len(values)
    if n == 0:
        return 0.0, 0, 0, b""
    k = max(1, round(p * n))
    largest = sorted(range(n), key=lambda i: (-values[i], i))[:k]
    smallest = sorted(range(n), key=lambda i: (values[i], i))[:k]
    mu_plus = sum(Fraction(values[i]) for i in largest) / k
    mu_minus = -sum(Fraction(values[i]) for i in smallest) / k
    if mu_plus >= mu_minus:
        chosen, mean = sorted(largest), round_to_float32(mu_plus)
    else:
        chosen, mean = sorted(smallest), -round_to_float32(mu_minus)
    return _coded(mean, chosen, n)


def sbc_fast(values: list[float], p: float, sample: list[int]) -> tuple[float, int, int, bytes]:
    """Fast mode on float32 ``values`` with the sampled positions ``sample``: (mean, b, nnz, bits).

    The thresholds are the sample's r-th smallest and r-th largest values (r = max(1, round(p *
    len(sample)))); each side keeps every value at or beyond its threshold. A side that keeps
    nothing or more than 2 k values (k = max(1, round(p * n))) means exact mode instead; else the
    side with the larger mean magnitude wins (the positive one on a tie), as in exact mode.
    """
    n = len(values)
    k = max(1, round(p * n))
    picked = sorted(values[i] for i in sample)
    r = max(1, round(p * len(sample)))
    thr_lo, thr_hi = picked[r - 1], picked[len(sample) - r]
    hi = [i for i in range(n) if values[i] >= thr_hi]
    lo = [i for i in range(n) if values[i] <= thr_lo]
    if not (0 < len(hi) <= 2 * k and 0 < len(lo) <= 2 * k):
        return sbc_exact(values, p)
    mu_plus = sum(Fraction(values[i]) for i in hi) / len(hi)
    mu_minus = -sum(Fraction(values[i]) for i in lo) / len(lo)
    if mu_plus >= mu_minus:
        chosen, mean = hi, round_to_float32(mu_plus)
    else:
        chosen, mean = lo, -round_to_float32(mu_minus)
    return _coded(mean, chosen, n)


def _coded(mean: float, chosen: list[int], n: int) -> tuple[float, int, int, bytes]:
    """(mean, b, nnz, bits) of the side kept; fedcomp's one departure from Algorithm 2 (FORMAT.md):
    a side of mean +0.0 is sent as no positions."""
    if mean == 0.0 and math.copysign(1.0, mean) > 0:
        return 0.0, 0, 0, b""
    b = golomb_b(len(chosen) / n)
    return mean, b, len(chosen), encode_positions(chosen, b)
