"""A slow, obviously correct reference for STC (Sattler et al. 2019, Algorithm 1 "STC_k").

Written from the paper and FORMAT.md, not from ``fedcomp.codecs.stc``: plain Python loops, exact
rationals (``Fraction``) and '0'/'1' strings. The Golomb position code and the float32 rounding
come from :mod:`tests.codecs.reference_sbc` (equally independent of fedcomp's code).

Algorithm 1, for a tensor T of n entries and sparsity p::

    k  = max(n p, 1)
    v  = top_k(|T|)                     the k-th largest magnitude
    mask = |T| >= v                     (fedcomp: exactly k entries, ties to the lowest index)
    mu = mean |T_i| over the mask
    T* = mu * sign(T * mask)

sign(0) = 0, so a zero entry is never sent; fedcomp averages over the entries it does send.
"""

from __future__ import annotations

from fractions import Fraction

from tests.codecs.reference_sbc import decode_positions, encode_positions, golomb_b, round_to_float32


def stc(values: list[float], p: float) -> tuple[float, int, int, bytes, bytes]:
    """Encode float32 ``values``: returns (mu, golomb_b, nnz, position bits, sign bits)."""
    n = len(values)
    if n == 0:
        return 0.0, 0, 0, b"", b""
    k = min(n, max(1, round(p * n)))
    by_magnitude = sorted(range(n), key=lambda i: (-abs(values[i]), i))
    kept = sorted(i for i in by_magnitude[:k] if values[i] != 0)
    if not kept:
        return 0.0, 0, 0, b"", b""
    return _message(values, kept)


def stc_fast(values: list[float], p: float, sample: list[int]) -> tuple[float, int, int, bytes, bytes]:
    """Fast mode on finite float32 ``values`` with the sampled positions ``sample``.

    The threshold t is the r-th largest sampled magnitude (r = max(1, round(p * len(sample))));
    every entry with |v| >= t is kept. A threshold of zero, or a selection of none or more than
    2 k entries (k as in exact mode), means exact mode instead.
    """
    n = len(values)
    k = min(n, max(1, round(p * n)))
    picked = sorted((abs(values[i]) for i in sample), reverse=True)
    t = picked[max(1, round(p * len(sample))) - 1]
    kept = [i for i in range(n) if abs(values[i]) >= t] if t > 0 else []
    if not 0 < len(kept) <= 2 * k:
        return stc(values, p)
    return _message(values, kept)


def _message(values: list[float], kept: list[int]) -> tuple[float, int, int, bytes, bytes]:
    """(mu, golomb_b, nnz, position bits, sign bits) of the ascending non-zero positions ``kept``."""
    mu = round_to_float32(sum(Fraction(abs(values[i])) for i in kept) / len(kept))
    b = golomb_b(len(kept) / len(values))
    signs = "".join("1" if values[i] < 0 else "0" for i in kept)
    while len(signs) % 8:
        signs += "0"
    sign_bytes = bytes(int(signs[j : j + 8], 2) for j in range(0, len(signs), 8))
    return mu, b, len(kept), encode_positions(kept, b), sign_bytes


def decode(mu: float, b: int, nnz: int, bits: bytes, signs: bytes, n: int) -> list[float]:
    """Inverse for well-formed input: ``n`` values, ``+-mu`` at the coded positions."""
    out = [0.0] * n
    sign_string = "".join(format(byte, "08b") for byte in signs)
    for j, position in enumerate(decode_positions(bits, nnz, b)):
        out[position] = -mu if sign_string[j] == "1" else mu
    return out
