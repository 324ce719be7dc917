import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs.golomb import (
    MAX_B,
    decode_positions,
    encode_positions,
    expected_bits_per_position,
    golomb_b,
)
from fedcomp.errors import PayloadError
from tests.codecs import kit
from tests.codecs import reference_sbc as ref

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_golomb_b_worked_values():
    assert golomb_b(0.01) == 6
    assert golomb_b(0.001) == 9
    assert round(expected_bits_per_position(0.01, 6), 2) == 8.11
    assert round(expected_bits_per_position(0.001, 9), 2) == 11.49


def test_golomb_b_edges():
    assert golomb_b(0.0) == MAX_B and golomb_b(-1.0) == MAX_B
    assert golomb_b(1e-300) == MAX_B  # log1p(-p) underflows to -0.0
    assert golomb_b(1.0) == 0 and golomb_b(2.0) == 0
    assert golomb_b(0.5) == 0 and golomb_b(0.9) == 0
    with pytest.raises(ValueError):
        golomb_b(math.nan)


@given(st.floats(min_value=1e-9, max_value=0.999))
@FAST
def test_golomb_b_matches_reference_and_is_monotone(p):
    assert golomb_b(p) == ref.golomb_b(p)
    assert golomb_b(p) >= golomb_b(min(0.999, p * 2))


#: Most unary bits a generated stream may have (a tiny b on big gaps: long, and no more telling).
MAX_UNARY = 200_000


@st.composite
def positions(draw, max_numel=5000):
    numel = draw(st.integers(1, max_numel))
    idx = sorted(draw(st.sets(st.integers(0, numel - 1), max_size=min(numel, 300))))
    b = draw(st.one_of(st.integers(0, 12), st.sampled_from([20, 31, 32, 40, 62])))
    while sum((d - 1) >> b for d in _gaps(idx)) > MAX_UNARY:
        b += 1  # the smallest b at or above the drawn one whose unary section stays short
    return idx, b, numel


@given(positions())
@FAST
def test_encode_matches_reference_and_decodes(case):
    idx, b, numel = case
    t = torch.tensor(idx, dtype=torch.int64)
    bits = encode_positions(t, b)
    assert bits == ref.encode_positions(idx, b)
    back = decode_positions(bits, len(idx), b, numel, "t")
    assert back.dtype == torch.int64 and back.tolist() == idx
    if idx:
        assert ref.decode_positions(bits, len(idx), b) == idx


def _gaps(idx):
    prev = -1
    for i in idx:
        yield i - prev
        prev = i


def test_known_stream():
    # positions 0, 3, 20 with b = 2: gaps 1, 3, 17 -> (q, r) = (0, 0), (0, 2), (4, 0)
    # remainders 00 10 00, unary 0 0 11110 -> 001000 0011110 + pad -> 00100000 11110000
    bits = encode_positions(torch.tensor([0, 3, 20]), 2)
    assert bits == bytes([0b00100000, 0b11110000])
    assert decode_positions(bits, 3, 2, 21, "t").tolist() == [0, 3, 20]


@pytest.mark.parametrize("device", kit.devices())
def test_devices_round_trip(device):
    g = torch.Generator().manual_seed(1)
    idx = (torch.rand(100_000, generator=g) < 0.02).nonzero().view(-1).to(device)
    b = golomb_b(0.02)
    bits = encode_positions(idx, b)
    assert bits == encode_positions(idx.cpu(), b)
    back = decode_positions(bits, idx.numel(), b, 100_000, "t", device)
    assert back.device.type == torch.device(device).type and torch.equal(back.cpu(), idx.cpu())


@pytest.mark.parametrize("p", [0.01, 0.001])
def test_bits_per_position_near_expectation(p):
    n = 4_000_000
    g = torch.Generator().manual_seed(7)
    idx = (torch.rand(n, generator=g) < p).nonzero().view(-1)
    b = golomb_b(p)
    bits = encode_positions(idx, b)
    per_position = len(bits) * 8 / idx.numel()
    expected = expected_bits_per_position(p, b)
    assert abs(per_position - expected) / expected < 0.01, (per_position, expected)


# --- hostile input -----------------------------------------------------------------------------

GOOD_IDX = [0, 3, 20, 21, 63]
GOOD_B = 2
NUMEL = 64


def good_bits():
    return encode_positions(torch.tensor(GOOD_IDX), GOOD_B)


@pytest.mark.parametrize(
    "case, bits, nnz, b, numel, reason",
    [
        ("nnz > numel", None, 65, GOOD_B, NUMEL, "nnz 65 exceeds the tensor's 64 elements"),
        ("negative nnz", None, -1, GOOD_B, NUMEL, "nnz -1 is negative"),
        ("b too big", None, 5, 63, NUMEL, "golomb_b 63 is outside [0, 62]"),
        ("negative b", None, 5, -1, NUMEL, "golomb_b -1 is outside [0, 62]"),
        (
            "truncated",
            b"\x00",
            5,
            GOOD_B,
            NUMEL,
            "position bits truncated: 1 bytes cannot hold 5 codewords of at least 3 bits",
        ),
        ("trailing byte", "good+\x00", 5, GOOD_B, NUMEL, "1 trailing bytes after the position bitstream"),
        ("bytes for nnz 0", b"\x00", 0, GOOD_B, NUMEL, "1 position bytes for nnz 0"),
        (
            "too long for numel",
            b"\x00" * 40,
            5,
            GOOD_B,
            NUMEL,
            "position bits are 40 bytes, more than the 10 that 64 elements can need",
        ),
        ("overflow", None, 5, GOOD_B, 63, "positions overflow the tensor's 63 elements"),
        (
            "no terminating zeros",
            b"\x00\xff\xff",
            5,
            GOOD_B,
            NUMEL,
            "position bitstream runs past its end: 0 of 5 codewords are terminated",
        ),
        ("padding bits set", "good|pad", 5, GOOD_B, NUMEL, "non-zero padding bits after the position bitstream"),
    ],
)
def test_bad_streams_raise_payload_error(case, bits, nnz, b, numel, reason):
    good = good_bits()
    if bits is None:
        bits = good
    elif bits == "good+\x00":
        bits = good + b"\x00"
    elif bits == "good|pad":
        bits = good[:-1] + bytes([good[-1] | 1])
    with pytest.raises(PayloadError) as info:
        decode_positions(bits, nnz, b, numel, "layer.weight")
    assert (info.value.tensor, info.value.reason) == ("layer.weight", reason)  # exactly what the log says


def test_good_stream_is_accepted_as_is():
    # the fixtures above are only meaningful if the unmodified stream decodes, and is canonical:
    # its codewords, padded to a whole byte with fewer than 8 bits
    assert 0 <= len(good_bits()) * 8 - (5 * GOOD_B + 5 + sum((d - 1) >> GOOD_B for d in _gaps(GOOD_IDX))) < 8
    assert decode_positions(good_bits(), 5, GOOD_B, NUMEL, "t").tolist() == GOOD_IDX


def _pack(stream: str) -> bytes:
    stream += "0" * (-len(stream) % 8)
    return bytes(int(stream[i : i + 8], 2) for i in range(0, len(stream), 8))


def test_overflow_with_huge_quotients_is_caught_before_shifting():
    # b = 62 with q = 3: q << 62 would overflow int64
    bits = _pack("0" * 62 + "1110")
    with pytest.raises(PayloadError, match="overflow"):
        decode_positions(bits, 1, 62, 2**40, "t")
    # q = 4: q << 62 is 2**64, which wraps int64 to exactly 0; decoded anyway it would be position 0
    with pytest.raises(PayloadError, match="overflow"):
        decode_positions(_pack("0" * 62 + "11110"), 1, 62, 2**40, "t")
    # the same stream with q = 0 is fine
    assert decode_positions(_pack("0" * 62 + "0"), 1, 62, 2**40, "t").tolist() == [0]


def test_cumulative_overflow_is_caught():
    # five gaps of 2**62 - 1 (b = 61, q = 1, r = 2**61 - 2) each fit numel = 2**62 - 1, but their
    # sum wraps int64 and lands back in range: the last position alone would look valid
    r = format(2**61 - 2, "061b")
    bits = _pack(r * 5 + "10" * 5)
    with pytest.raises(PayloadError, match="overflow"):
        decode_positions(bits, 5, 61, 2**62 - 1, "t")
    assert decode_positions(_pack(r + "10"), 1, 61, 2**62 - 1, "t").tolist() == [2**62 - 2]


def test_numel_out_of_range():
    for numel in (2**62, -1):
        with pytest.raises(PayloadError) as info:
            decode_positions(b"", 0, 0, numel, "t")
        assert info.value.reason == f"numel {numel} is out of range"
    assert decode_positions(b"", 0, 0, 2**62 - 1, "t").tolist() == []  # the largest numel allowed


def test_bad_arguments_of_the_helpers_are_value_errors():
    """Encoder-side misuse (a bug in the caller, not a hostile payload): ValueError, saying what."""
    for b in (-1, MAX_B + 1):
        with pytest.raises(ValueError, match=rf"^golomb b must be in \[0, 62\], got {b}$"):
            encode_positions(torch.tensor([1]), b)
    assert encode_positions(torch.tensor([1]), MAX_B) == encode_positions(torch.tensor([1]), 62)  # 62 is allowed
    for p in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=rf"^expected_bits_per_position: p must be in \(0, 1\], got {p}$"):
            expected_bits_per_position(p, 3)
    assert expected_bits_per_position(1.0, 0) == 1.0  # p = 1: every position set, one bit each
    with pytest.raises(ValueError, match="^golomb_b: p is NaN$"):
        golomb_b(math.nan)


def test_extreme_positions_code_as_the_reference_and_bad_ones_are_refused():
    """The C kernel's code (its buffer sized by the largest position: every word store inside it)
    of positions up to 2**63 - 1 and of long unary runs is the reference's; positions that do not
    ascend from 0 are a ValueError saying so."""
    cases = [
        ([2**63 - 1], 62),
        ([0, 2**62, 2**63 - 1], 62),
        ([7, 2**40 + 3], 40),
        ([0, 1, 2, 3], 0),
        ([31, 62, 63, 200], 0),  # unary runs of 31 and longer
        (list(range(0, 4000, 3)), 1),  # many four-byte stores, both sections
        ([], 5),
    ]
    for idx, b in cases:
        assert encode_positions(torch.tensor(idx, dtype=torch.int64), b) == ref.encode_positions(idx, b), (idx[:3], b)
    for idx in ([5, 3], [-1], [-5, 3], [2, 2]):
        with pytest.raises(ValueError, match="positions must be non-negative and ascending"):
            encode_positions(torch.tensor(idx, dtype=torch.int64), 2)


@given(
    st.binary(max_size=64),
    st.integers(0, 2**64 - 1) | st.integers(0, 100),
    st.integers(0, 2**32 - 1) | st.integers(0, 64),
    st.integers(0, 2**40) | st.integers(0, 600),
)
@settings(max_examples=400, deadline=None)
def test_fuzz_only_payload_errors(bits, nnz, b, numel):
    with kit.LargestTensor() as made:
        try:
            out = decode_positions(bits, nnz, b, numel, "fuzz")
        except PayloadError as exc:
            assert exc.tensor == "fuzz"
            out = None
    # the work is linear in the stream, whatever nnz and numel (up to 2**40) claim; 256 x 8 is the bit table
    assert made.largest <= max(8 * len(bits), 256 * 8)
    if out is not None:
        assert out.numel() == nnz
        if nnz:
            assert int(out[0]) >= 0 and int(out[-1]) < numel
            assert bool((out[1:] > out[:-1]).all())
            assert encode_positions(out, b) == bits  # only canonical streams are accepted


# --- the CPU (NumPy) path against the torch path (what CUDA runs) ------------------------------


@given(positions())
@FAST
def test_numpy_and_torch_paths_give_the_same_bytes_and_positions(case):
    from fedcomp.codecs import golomb

    idx, b, numel = case
    t = torch.tensor(idx, dtype=torch.int64)
    bits = golomb._encode_positions_torch(t, b)
    assert golomb._encode_positions_np(t.numpy(), b) == bits
    if idx:
        cpu = torch.device("cpu")
        assert golomb._decode_positions_np(bits, len(idx), b, numel, "t").tolist() == idx
        assert golomb._decode_positions_torch(bits, len(idx), b, numel, "t", cpu).tolist() == idx


@given(
    st.binary(max_size=64),
    st.integers(1, 100),
    st.integers(0, 12) | st.sampled_from([31, 62]),
    st.integers(1, 600) | st.integers(0, 2**40),
)
@settings(max_examples=300, deadline=None)
def test_numpy_and_torch_paths_reject_alike(bits, nnz, b, numel):
    """On any stream that passes the shared up-front checks, both paths return the same
    positions or raise the same PayloadError."""
    from fedcomp.codecs import golomb

    def outcome(fn):  # type: ignore[no-untyped-def]
        try:
            return fn().tolist()
        except PayloadError as exc:
            return exc.reason

    nnz = min(nnz, numel)
    if nnz == 0 or len(bits) * 8 < nnz * (b + 1) or len(bits) > (nnz * b + numel + 7) // 8:
        return  # rejected before either path runs
    cpu = torch.device("cpu")
    want = outcome(lambda: golomb._decode_positions_torch(bits, nnz, b, numel, "f", cpu))
    assert outcome(lambda: torch.from_numpy(golomb._decode_positions_np(bits, nnz, b, numel, "f"))) == want
