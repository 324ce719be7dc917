"""A slow, obviously correct 3LC in plain Python (lists and loops), to check the vectorized codec.

Follows the paper step by step: m = s * max|T|, q = round(T / m), add 1, pad with zeros to a
multiple of 5, five contiguous parts, byte = 81 P0 + 27 P1 + 9 P2 + 3 P3 + P4; then zero-run
encoding of runs of the byte 121. Float32 arithmetic is emulated exactly: a float32 product or
quotient of float32 numbers, computed in double and rounded once to float32, is the correctly
rounded float32 result (double has more than 2 * 24 + 2 bits).
"""

from __future__ import annotations

import math
import struct

F32_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]
WEIGHTS = (81, 27, 9, 3, 1)


def f32(x: float) -> float:
    """Round a double to the nearest float32 (ties to even); inf when it overflows."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def quantize(values: list[float], s: float) -> tuple[list[int], float]:
    """(q, m): m = float32(float32(s) * max|v|), clamped to the float32 max; q = round(v / m)."""
    top = max((abs(v) for v in values), default=0.0)
    m = f32(f32(s) * top)
    if math.isinf(m):
        m = F32_MAX
    if m == 0.0:
        return [0] * len(values), m
    q = []
    for v in values:
        r = round(f32(v / m))  # Python's round: half to even, like torch.round
        assert r in (-1, 0, 1)
        q.append(r)
    return q, m


def pack(q: list[int]) -> bytes:
    digits = [v + 1 for v in q]
    while len(digits) % 5:
        digits.append(0)
    g = len(digits) // 5
    parts = [digits[k * g : (k + 1) * g] for k in range(5)]
    out = []
    for j in range(g):
        out.append(sum(w * parts[k][j] for k, w in enumerate(WEIGHTS)))
    return bytes(out)


def unpack(data: bytes, numel: int) -> list[int]:
    g = len(data)
    assert g == (numel + 4) // 5
    parts: list[list[int]] = [[], [], [], [], []]
    for b in data:
        for k, w in enumerate(WEIGHTS):
            parts[k].append(b // w % 3)
    digits = [d for part in parts for d in part]
    return [d - 1 for d in digits[:numel]]


def zero_run_encode(data: bytes) -> bytes:
    out = []
    i = 0
    while i < len(data):
        if data[i] != 121:
            out.append(data[i])
            i += 1
            continue
        run = 0
        while i < len(data) and data[i] == 121:
            run += 1
            i += 1
        while run >= 14:
            out.append(255)
            run -= 14
        if run >= 2:
            out.append(243 + (run - 2))
        elif run == 1:
            out.append(121)
    return bytes(out)


def zero_run_decode(data: bytes) -> bytes:
    out = []
    for b in data:
        if b >= 243:
            out.extend([121] * (b - 241))
        else:
            out.append(b)
    return bytes(out)


def encode(values: list[float], s: float = 1.0, zero_run: bool = True) -> tuple[float, bytes]:
    """(scale, data) of the 3LC payload for float32 ``values``."""
    q, m = quantize(values, s)
    data = pack(q)
    return m, zero_run_encode(data) if zero_run else data


def decode(scale: float, data: bytes, numel: int, zero_run: bool = True) -> list[float]:
    raw = zero_run_decode(data) if zero_run else data
    return [f32(scale * v) + 0.0 for v in unpack(raw, numel)]
