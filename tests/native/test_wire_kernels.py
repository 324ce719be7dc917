"""The wire kernel (fedcomp/_native/wire.c) against zlib and torch: each CRC-32 variant (table,
128-bit and 256-bit carry-less folds) equals ``zlib.crc32`` on every length around the folds'
block sizes and the kernel's 8 KiB pieces, from any starting CRC and any alignment; ``crc32_combine``
equals the CRC of the joined bytes; the fused casts give torch's float16 bytes (round to nearest
even, overflow to inf, subnormals, -0.0, NaN payloads) and torch's float32 values back, on every
tail length; ``run2`` equals two ``run`` calls; malformed op lists are refused before anything runs."""

from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest
import torch

from fedcomp import _native
from tests.native.variants import available

KERNEL = _native.load("wire")
pytestmark = pytest.mark.skipif(KERNEL is None, reason="fedcomp._native._wire is not built or FEDCOMP_NATIVE=0")

OP_COPY, OP_F32_F16, OP_F16_F32, OP_CRC = 0, 1, 2, 3

#: Lengths around the folds' blocks (16, 32, 64, 128 bytes), the table's 8 and the 8 KiB pieces.
LENGTHS = sorted(
    {*range(0, 300), 511, 512, 513, 1023, 1024, 1025, 8191, 8192, 8193, 16383, 16384, 16385, 32768 + 77, 100_003}
)


def _variants() -> list[str]:
    assert KERNEL is not None
    return available(KERNEL.crc_variant, ("table", "pclmul", "vpclmul"))


@pytest.fixture(params=["table", "pclmul", "vpclmul"])
def variant(request):
    assert KERNEL is not None
    if request.param not in _variants():
        pytest.skip(f"this CPU has no {request.param} CRC")
    before = KERNEL.crc_variant()
    KERNEL.crc_variant(request.param)
    yield request.param
    KERNEL.crc_variant(before)


def test_the_widest_variant_is_chosen_at_import():
    assert KERNEL is not None
    assert KERNEL.crc_variant() == _variants()[-1]
    assert KERNEL.features()["crc"] == KERNEL.crc_variant()


def test_crc32_equals_zlib_on_every_length(variant):
    assert KERNEL is not None
    rng = random.Random(variant)
    blob = os.urandom(max(LENGTHS) + 64)
    for n in LENGTHS:
        offset = rng.randrange(0, 64)  # any alignment
        data = blob[offset : offset + n]
        start = rng.randrange(2**32)
        assert KERNEL.crc32(data, start) == zlib.crc32(data, start), (variant, n, offset)
        assert KERNEL.crc32(data) == zlib.crc32(data), (variant, n)


def test_crc32_of_constant_and_structured_bytes(variant):
    assert KERNEL is not None
    for data in (bytes(5000), b"\xff" * 5000, bytes(range(256)) * 40, np.arange(3000, dtype=np.float32).tobytes()):
        assert KERNEL.crc32(data) == zlib.crc32(data)


def test_crc32_combine():
    assert KERNEL is not None
    rng = random.Random(1)
    for _ in range(200):
        a, b = os.urandom(rng.randrange(0, 3000)), os.urandom(rng.randrange(0, 3000))
        assert KERNEL.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    big = 3 << 30  # a length past 32 bits' worth of bytes: still x^(8 len) modulo P
    assert KERNEL.crc32_combine(0x12345678, 0, 0) == 0x12345678
    assert KERNEL.crc32_combine(5, 7, big) == KERNEL.crc32_combine(
        KERNEL.crc32_combine(5, 0, 1 << 30), 7, big - (1 << 30)
    )


def _specials(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(torch.randn(n, generator=gen) * 5)
    # zeros, infinities, the float16 maximum and the values that round to it or overflow, the
    # smallest subnormal and values rounding to it or to zero, the smallest normal, ties to even
    special = [0.0, -0.0, float("inf"), -float("inf"), 65504.0, 65519.99, 65520.0, -65520.0]
    special += [6e-8, 2.98e-8, 3e-8, 1e-40, 6.1e-5, 6.09e-5, 1.0 + 2**-11, 1.0 + 3 * 2**-11]
    specials = torch.tensor(special)
    x[: min(n, len(specials))] = specials[: min(n, len(specials))]
    bits = x.view(torch.int32)
    bits[len(specials) :: 37] = 0x7FC00000  # quiet NaN
    bits[len(specials) + 5 :: 41] = 0x7FA01234  # a signalling NaN with payload bits
    bits[len(specials) + 9 :: 43] = -0x00600001  # negative NaN (0xFF9FFFFF)
    return x


@pytest.mark.parametrize("n", [*range(0, 40), 1000, 4097, 70_001, 1 << 19, (1 << 19) + 3, 600_001])
def test_the_casts_give_torchs_values(n):
    """(From 2**19 values, 1 MiB of wire, a float32 output is written by non-temporal stores.)"""
    assert KERNEL is not None
    x = _specials(n, n)
    want = x.half().numpy().tobytes()
    out = np.full(2 * n + 8, 0xAB, np.uint8)  # a guard past the end
    crc = KERNEL.run([(OP_F32_F16, out.ctypes.data, x.data_ptr(), 2 * n)], 9)
    assert out[: 2 * n].tobytes() == want
    assert (out[2 * n :] == 0xAB).all()  # nothing written past the slot
    assert crc == zlib.crc32(want, 9)
    back = torch.full((n + 2,), 7.0)
    crc_back = KERNEL.run([(OP_F16_F32, back.data_ptr(), out.ctypes.data, 2 * n)], 0)
    # float16 -> float32 is exact: every value's bits are torch's. A NaN stays a NaN with its sign
    # and payload (F16C's conversion, which torch's vectorized loop uses too; torch's scalar loop
    # for a tensor's last few values writes 0x7fffffff for every NaN instead, so only NaN-ness is
    # compared there).
    ref = x.half().float()
    nan = torch.isnan(ref)
    assert torch.equal(back[:n][~nan].view(torch.int32), ref[~nan].view(torch.int32))
    assert torch.isnan(back[:n][nan]).all()
    h = x.half().view(torch.int16)[nan].to(torch.int64) & 0xFFFF
    want_nan = ((h & 0x8000) << 16) | 0x7F800000 | ((h & 0x3FF) << 13) | 0x400000  # quieted, payload kept
    assert torch.equal(back[:n][nan].view(torch.int32).to(torch.int64) & 0xFFFFFFFF, want_nan)
    assert (back[n:] == 7.0).all()
    assert crc_back == zlib.crc32(want)


def test_unaligned_sources_and_destinations():
    assert KERNEL is not None
    x = _specials(5000, 3)
    raw = np.frombuffer(x.numpy().tobytes(), np.uint8)
    for shift in (1, 2, 3, 5):
        src = np.zeros(len(raw) + 8, np.uint8)
        src[shift : shift + len(raw)] = raw
        dst = np.zeros(2 * 5000 + 8, np.uint8)
        KERNEL.run([(OP_F32_F16, dst.ctypes.data + shift, src.ctypes.data + shift, 10000)], 0)
        assert dst[shift : shift + 10000].tobytes() == x.half().numpy().tobytes()


@pytest.mark.parametrize("shift", [0, 1, 4, 12, 28, 30])
def test_a_large_cast_to_float32_at_any_alignment(shift: int) -> None:
    """The non-temporal stores' peel to a 32-byte boundary (and a destination not 4-byte aligned,
    written the ordinary way): every value, nothing before or after the slot."""
    assert KERNEL is not None
    n = (1 << 19) + 5
    half = _specials(n, 7).half()
    base = np.full(4 * n + 64, 0xAB, np.uint8)
    start = (-base.ctypes.data) % 32 + shift  # shift bytes past a 32-byte boundary
    crc = KERNEL.run([(OP_F16_F32, base.ctypes.data + start, half.data_ptr(), 2 * n)], 0)
    got = torch.from_numpy(base[start : start + 4 * n].copy().view(np.float32))
    ref = half.float()
    nan = torch.isnan(ref)
    assert torch.equal(got[~nan].view(torch.int32), ref[~nan].view(torch.int32)) and torch.isnan(got[nan]).all()
    assert (base[:start] == 0xAB).all() and (base[start + 4 * n :] == 0xAB).all()
    assert crc == zlib.crc32(half.numpy().tobytes())


def test_an_op_list_is_one_crc_over_the_wire_side():
    assert KERNEL is not None
    x = _specials(3001, 4)
    half = x.half().numpy().tobytes()
    framing = b"\x1a\x05hello"
    raw = x.numpy().tobytes()
    out = np.zeros(len(framing) + len(half) + len(raw), np.uint8)
    base = out.ctypes.data
    ops = [
        (OP_COPY, base, framing, len(framing)),
        (OP_F32_F16, base + len(framing), x.data_ptr(), len(half)),
        (OP_COPY, base + len(framing) + len(half), x.data_ptr(), len(raw)),
    ]
    crc = KERNEL.run(ops, 0)
    assert out.tobytes() == framing + half + raw
    assert crc == zlib.crc32(framing + half + raw)
    assert KERNEL.run([(OP_CRC, 0, base, len(out))], 0) == crc
    a = KERNEL.run(ops[:2], 0)
    b = KERNEL.run(ops[2:], 0)
    pair = KERNEL.run2(ops[:2], ops[2:])
    assert pair is None or pair == (a, b)  # None: a process without an OpenMP runtime
    assert KERNEL.crc32_combine(a, b, len(raw)) == crc


@pytest.mark.parametrize(
    ("op", "message"),
    [
        ((7, 0, 0, 4), "out of range"),
        ((OP_COPY, 0, 0, -1), "out of range"),
        ((OP_F32_F16, 0, 0, 3), "odd size"),
        ((OP_COPY, 0, b"abc", 4), "fewer than 4 bytes"),
        ((OP_COPY, 0), "an op is"),
    ],
)
def test_malformed_ops_are_refused(op, message):
    assert KERNEL is not None
    with pytest.raises((ValueError, TypeError), match=message):
        KERNEL.run([op], 0)
    with pytest.raises((ValueError, TypeError), match=message):
        KERNEL.run2([], [op])
