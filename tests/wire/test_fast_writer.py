"""The one-copy writer (``fedcomp.wire.fast_writer``) writes exactly protobuf's bytes.

``serde.update_to_bytes`` / ``tensor_to_bytes`` frame messages by hand and write each payload
byte once; ``update_to_bytes_protobuf`` / ``tensor_to_bytes_protobuf`` are protobuf's own
``SerializeToString``. Every case here asserts the two agree byte for byte: every payload type,
real codec outputs, empty and 0-d tensors, defaults omitted, and lengths on both sides of each
varint boundary (127/128, 16383/16384) at all three nesting levels (payload field, payload
message, tensor message). Also: the parallel/accelerated CRC-32 equals zlib's, and a deferred
dense payload's bytes do not depend on the path (cast into the wire buffer or read as ``data``).

Every test runs on three writers (the ``writer`` fixture): the fused kernel
(``fedcomp/_native/wire.c``: every tensor framed in one call, ``frame_tensors``; casts and copies
with the CRC in the same pass, on two threads from 4 MiB), the kernel's framing with torch's casts
and the CRC as a second pass (what runs where the kernel's CRC would be its table: not x86-64),
and the framing's Python loop (what frames where no kernel is built) before the kernel's casts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedcomp.codecs import get_codec
from fedcomp.wire import fast_writer, serde
from fedcomp.wire.fast_writer import DeferredDensePayload
from fedcomp.wire.payloads import (
    DensePayload,
    EncodedTensor,
    EncodedUpdate,
    GradiVeQPayload,
    SBCPayload,
    SparsePayload,
    STCPayload,
    ThreeLCPayload,
)
from tests.forking import result_in_fork
from tests.wire.test_serde_bounds import varint as reference_varint


@pytest.fixture(autouse=True, params=["kernel", "torch", "python-framing"])
def writer(request, monkeypatch) -> str:
    if request.param != "torch" and (fast_writer._KERNEL is None or serde._FRAME is None):
        pytest.skip("the wire kernel is not built (pip install -e . compiles it)")
    if request.param == "torch":
        monkeypatch.setattr(fast_writer, "_KERNEL", None)
    if request.param == "python-framing":
        monkeypatch.setattr(serde, "_FRAME", None)
    return str(request.param)


def _tensor(payload, name: str = "w", shape: tuple[int, ...] = (3,), codec_id: str = "dense-fp32", version: int = 1):
    return EncodedTensor(name, shape, "float32", codec_id, version, payload)


def _same(*tensors: EncodedTensor, base: int = 7) -> bytes:
    """Assert both writers agree on each tensor and on the update of all of them; return it."""
    for t in tensors:
        assert serde.tensor_to_bytes(t) == serde.tensor_to_bytes_protobuf(t), t.name
    u = EncodedUpdate(base_model_version=base, tensors=tuple(tensors))
    fast = serde.update_to_bytes(u)
    assert type(fast) is bytes
    assert fast == serde.update_to_bytes_protobuf(u)
    assert serde.update_size(u) == len(fast)  # (the length, without writing)
    return fast


#: Lengths on both sides of the one- and two-byte varint limits.
BOUNDARIES = [0, 1, 2, 125, 126, 127, 128, 129, 130, 16377, 16380, 16381, 16382, 16383, 16384, 16385, 16386]


@pytest.mark.parametrize("n", BOUNDARIES)
def test_dense_lengths_at_varint_boundaries(n):
    # Raw bytes of odd and even lengths: the data field, the payload message and the tensor cross
    # each boundary at a different n (their headers differ by a few bytes).
    raw = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
    _same(_tensor(DensePayload("float32", raw)), _tensor(DensePayload("float16", memoryview(raw)), name="v"))


@pytest.mark.parametrize("n", [60, 61, 62, 63, 64, 65, 8188, 8189, 8190, 8191, 8192, 8193])
@pytest.mark.parametrize("name_len", [0, 1, 120, 200])
def test_tensor_message_lengths_at_varint_boundaries(n, name_len):
    # fp16 values: 2n bytes of data; the name shifts the tensor message across the boundaries.
    x = torch.linspace(-2, 2, n)
    t = get_codec("dense-fp16").encode(x, "n" * name_len)
    _same(t)


@pytest.mark.parametrize("codec_id", ["dense-fp16", "dense-fp32", "identity"])
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (7, 5), (2, 3, 4, 5)])
def test_deferred_dense_shapes(codec_id, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)) if shape else torch.tensor(1.5)
    enc = get_codec(codec_id).encode(x, "t")
    assert isinstance(enc.payload, DeferredDensePayload)
    data = _same(enc, base=0)
    back = serde.update_from_bytes(data).tensors[0]
    assert bytes(back.payload.data) == enc.payload.data  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("codec_id", ["dense-fp16", "dense-fp32", "identity"])
def test_deferred_bytes_do_not_depend_on_the_path(codec_id, dtype):
    # Values that round differently float64 -> float16 directly and through float32: the eager path
    # always went through float32 (``_flatten``), and so must the cast into the wire buffer.
    x = torch.tensor([1 + 2**-11 + 2**-40, -(1 + 2**-11 + 2**-40), 3.14159, 1e-6, 70000.0], dtype=torch.float64)
    x = x.to(dtype)
    codec = get_codec(codec_id)
    deferred = codec.encode(x, "t")
    eager, _ = codec._encode(codec._flatten(x), "t")  # the error-feedback path, cast eagerly
    assert isinstance(eager, DensePayload) and not isinstance(eager, DeferredDensePayload)
    assert deferred.payload == eager and eager == deferred.payload
    assert deferred.payload.data == eager.data  # type: ignore[union-attr]
    assert serde.tensor_to_bytes(deferred) == serde.tensor_to_bytes_protobuf(
        dataclasses.replace(deferred, payload=eager)
    )


def test_deferred_payload_equality_and_repr():
    x = torch.arange(6, dtype=torch.float32)
    p = DeferredDensePayload("float16", x)
    assert p == DensePayload("float16", x.half().numpy().tobytes())
    assert p != DensePayload("float32", x.numpy().tobytes())
    assert p != DensePayload("float16", bytes(12))
    assert hash(p) == hash(DensePayload("float16", x.half().numpy().tobytes()))
    assert repr(p) == "DeferredDensePayload(encoding='float16', numel=6)"
    with pytest.raises(ValueError, match="encoding"):
        DeferredDensePayload("int8", x)


def test_every_payload_type():
    bits = bytes(range(200))
    cases = [
        SBCPayload(mean=-0.25, golomb_b=3, nnz=17, bits=bits),
        SBCPayload(mean=0.0, golomb_b=0, nnz=0, bits=b""),
        STCPayload(mu=1.5, golomb_b=2, nnz=9, bits=bits[:130], signs=b"\x80\x01"),
        STCPayload(mu=0.0, golomb_b=0, nnz=0, bits=b"", signs=b""),
        ThreeLCPayload(scale=0.5, numel=1000, zero_run=True, data=bits * 90),
        ThreeLCPayload(scale=0.5, numel=5, zero_run=False, data=b"\x01"),
        SparsePayload(golomb_b=4, nnz=3, bits=bits[:127], value_encoding="float16", values=bytes(6)),
        SparsePayload(golomb_b=0, nnz=0, bits=b"", value_encoding="float32", values=b""),
        GradiVeQPayload(compressor_version=2**40, slice_size=64, dim=8, coefficients=bytes(16384)),
    ]
    ids = {
        SBCPayload: "sbc",
        STCPayload: "stc",
        ThreeLCPayload: "3lc",
        SparsePayload: "topk",
        GradiVeQPayload: "gradiveq",
    }
    _same(*(_tensor(p, name=f"t{i}", codec_id=ids[type(p)]) for i, p in enumerate(cases)))


@pytest.mark.parametrize(
    "config",
    [
        {"id": "sbc", "p": 0.05},
        {"id": "stc", "p": 0.05},
        {"id": "3lc", "s": 1.0},
        {"id": "topk", "p": 0.05},
        {"id": "lattice", "exponent": -8},
    ],
)
def test_real_codec_outputs(config):
    gen = torch.Generator().manual_seed(3)
    codec = get_codec(config)
    tensors = [
        codec.encode(torch.randn(shape, generator=gen), f"layer{i}") for i, shape in enumerate([(64, 33), (5000,)])
    ]
    _same(*tensors, get_codec("dense-fp32").encode(torch.randn(10, generator=gen), "bias"))


def test_envelope_defaults_and_large_versions():
    t = _tensor(DensePayload("float32", bytes(8)), name="", shape=(2,), codec_id="", version=0)
    for base in (0, 1, 127, 128, 2**63 - 1):
        _same(t, base=base)
    empty = EncodedUpdate(base_model_version=5, tensors=())
    assert serde.update_to_bytes(empty) == serde.update_to_bytes_protobuf(empty)
    unicode = _tensor(DensePayload("float32", bytes(4)), name="Gewicht.ä.ß.层")
    _same(unicode)


def test_a_large_update_is_one_bytes_object_equal_to_protobufs():
    # Above the 4 MiB threshold: the output is built in place (CPython) with huge pages advised.
    gen = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(n, generator=gen) for i, n in enumerate([1_500_000, 1000, 1_200_001])}
    encs = [get_codec("dense-fp16").encode(x, name) for name, x in tensors.items()]
    data = _same(*encs)
    assert len(data) > 4 << 20
    parsed = serde.update_from_bytes(data)
    for (name, x), t in zip(tensors.items(), parsed.tensors, strict=True):
        assert t.name == name
        assert bytes(t.payload.data) == x.half().numpy().tobytes()  # type: ignore[union-attr]


@pytest.mark.parametrize("n", [16_380, 16_381, 16_400, 300_000])  # the output about 64 KiB and up
def test_a_mid_sized_update_is_a_new_bytes_object_equal_to_protobufs(n):
    # From 64 KiB to 4 MiB the output is an uninitialized bytes object filled through a view (no
    # copy at the end), never reused: each one its own, right, and intact after the next.
    gen = torch.Generator().manual_seed(n)
    encs = [get_codec("dense-fp32").encode(torch.randn(n, generator=gen), "w")]
    first = _same(*encs)
    snapshot = bytes(first)
    assert fast_writer._SPARE is not first
    second = _same(get_codec("dense-fp32").encode(torch.randn(n, generator=gen), "w"))
    assert first == snapshot != second and hash(first) == hash(snapshot)


@given(
    dims=st.lists(st.integers(0, 300), max_size=3),
    name=st.text(max_size=20),
    codec_id=st.sampled_from(["dense-fp16", "dense-fp32", "identity"]),
    base=st.integers(0, 2**64 - 1),
)
def test_property_matches_protobuf(dims, name, codec_id, base):
    x = torch.linspace(-1, 1, 1 + 0 * len(dims)).expand(*dims).contiguous() if dims else torch.tensor(0.5)
    _same(get_codec(codec_id).encode(x, name), base=base)


_ODD_FLOATS = [0.0, -0.0, math.nan, math.inf, -math.inf, 0.1, 1e39, 1.401298464324817e-45, -2.5, 3.4028234663852886e38]


@st.composite
def _framed_tensor(draw, i: int) -> EncodedTensor:
    """An SBC, 3LC or dense tensor with any scalars protobuf takes (zeros, NaN, floats that are not
    float32, varints of every length), its blob empty, short, or past 4 KiB."""
    value = draw(st.one_of(st.sampled_from(_ODD_FLOATS), st.floats(width=32), st.floats()))
    blob = draw(st.sampled_from([b"", b"\x01", b"\x7f" * 127, b"\x80" * 4095, b"\x03" * 4096, b"\x05" * 20_000]))
    kind = draw(st.sampled_from(["sbc", "3lc", "dense", "deferred"]))
    if kind == "sbc":
        b, nnz = draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 2**64 - 1))
        return _tensor(SBCPayload(value, b, nnz, blob), name=f"s{i}", codec_id="sbc")
    if kind == "3lc":
        numel, zero_run = draw(st.integers(0, 2**64 - 1)), draw(st.booleans())
        return _tensor(ThreeLCPayload(value, numel, zero_run, blob), name=f"t{i}", codec_id="3lc")
    n = draw(st.sampled_from([0, 1, 1023, 1024, 5000]))
    if kind == "dense":
        return _tensor(DensePayload("float32", bytes(4 * n)), name=f"d{i}", shape=(n,))
    encoding = draw(st.sampled_from(["float16", "float32"]))
    return _tensor(DeferredDensePayload(encoding, torch.full((n,), 0.5)), name=f"f{i}", shape=(n,))


@given(st.integers(0, 6).flatmap(lambda n: st.tuples(*[_framed_tensor(i) for i in range(n)])))
def test_mixed_framing_matches_protobuf(tensors):
    # Every tensor the kernel frames (frame_tensors) or leaves to _tensor_parts, in any order and
    # next to each other: the update's bytes are protobuf's.
    _same(*tensors)


# --- the kernel's two halves --------------------------------------------------------------------


def _mixed_update(seed: int, sizes: tuple[int, ...]) -> EncodedUpdate:
    """Tensors the kernel casts (float32 sources to float16 and float32), raw bytes it copies,
    and deferred sources it leaves to torch (float64, strided, bfloat16 on the wire)."""
    gen = torch.Generator().manual_seed(seed)
    encs = []
    for i, n in enumerate(sizes):
        x = torch.randn(n, generator=gen)
        kind = i % 5
        if kind == 0:
            encs.append(get_codec("dense-fp16").encode(x, f"h{i}"))
        elif kind == 1:
            encs.append(get_codec("dense-fp32").encode(x, f"f{i}"))
        elif kind == 2:
            raw = x.numpy().tobytes()
            encs.append(_tensor(DensePayload("float32", raw), name=f"r{i}", shape=(n,)))
        elif kind == 3:
            strided = torch.randn(2 * n, generator=gen)[::2]
            encs.append(get_codec("dense-fp16").encode(strided, f"s{i}"))
        else:
            encs.append(get_codec("identity").encode(x.to(torch.bfloat16), f"b{i}"))
    return EncodedUpdate(base_model_version=seed, tensors=tuple(encs))


@pytest.mark.parametrize("seed", range(12))
def test_the_halves_meet_anywhere_in_the_parts(seed, monkeypatch, writer):
    # From _SPLIT_MIN bytes the kernel writes the two halves on two threads and combines their
    # CRCs: wherever the middle falls (framing, a cast, a copy, a part torch wrote, a boundary),
    # the bytes and the trailer must be protobuf's.
    if writer == "torch":
        pytest.skip("the two halves are the kernel's")
    monkeypatch.setattr(fast_writer, "_SPLIT_MIN", 0)
    gen = torch.Generator().manual_seed(seed)
    sizes = tuple(int(n) for n in torch.randint(0, 3000, (1 + seed % 6,), generator=gen))
    u = _mixed_update(seed, sizes)
    data = serde.update_to_bytes(u)
    assert data == serde.update_to_bytes_protobuf(u)
    assert int.from_bytes(data[-4:], "little") == zlib.crc32(data[:-5])


def test_a_large_mixed_update_on_two_threads(writer):
    u = _mixed_update(3, (1_300_001, 700_000, 400_003, 90_001, 250_000, 1_000_000))
    data = serde.update_to_bytes(u)
    assert len(data) > fast_writer._SPLIT_MIN
    assert data == serde.update_to_bytes_protobuf(u)


def test_split_ops_cover_the_same_bytes():
    base = 1 << 40
    for kind, src in (
        (fast_writer.OP_COPY, 7 << 30),
        (fast_writer.OP_COPY, b"0123456789"),
        (fast_writer.OP_F32_F16, 7 << 30),
        (fast_writer.OP_F16_F32, 7 << 30),
        (fast_writer.OP_CRC, 7 << 30),
    ):
        head, tail = fast_writer._split_op((kind, base, src, 10), 4)
        assert head == (kind, base, src, 4) and tail[3] == 6
        dst_step, src_step = {fast_writer.OP_F32_F16: (1, 2), fast_writer.OP_F16_F32: (2, 1)}.get(kind, (1, 1))
        if kind != fast_writer.OP_CRC:
            assert tail[1] == base + 4 * dst_step
        if isinstance(src, int):
            assert tail[2] == src + 4 * src_step
        else:
            assert bytes(tail[2]) == src[4:]


# --- CRC-32 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("accelerated", [True, False])
@pytest.mark.parametrize("n", [0, 1, 5, 8 << 20, (8 << 20) + 1, (9 << 20) + 3])
def test_crc32_equals_zlib(n, accelerated, monkeypatch, writer):
    if writer == "python-framing" or (writer == "kernel" and not accelerated):
        pytest.skip("the kernel's CRC comes first: the same case as accelerated (the framing plays no part)")
    if not accelerated:  # zlib on two threads, halves combined
        monkeypatch.setattr(fast_writer, "FAST_CRC32", None)
    elif fast_writer.FAST_CRC32 is None:
        pytest.skip("neither isal nor zlib-ng is installed")
    data = (bytes(range(251)) * (n // 251 + 1))[:n]
    assert fast_writer.crc32(data) == zlib.crc32(data)
    assert fast_writer.crc32(memoryview(data)) == zlib.crc32(data)


def test_crc32_combine():
    data = bytes((i * 7919) % 256 for i in range(5000))
    for cut in (0, 1, 2, 100, 2499, 4999, 5000):
        a, b = data[:cut], data[cut:]
        assert fast_writer.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data), cut


def test_varint():
    for value in (0, 1, 127, 128, 255, 16383, 16384, 2**32, 2**64 - 1):
        assert fast_writer.varint(value) == reference_varint(value)
        assert serde._varint(reference_varint(value) + b"\x00", 0, 11) == (value, len(reference_varint(value)))


# --- large outputs: the trailing CRC and memory reuse ----------------------------------------------


def _large_update(seed: int, sizes: tuple[int, ...] = (1_500_000, 1000, 2_200_001, 300_000)) -> EncodedUpdate:
    """Dense and byte-payload tensors, over the pipelined-CRC and reuse thresholds together."""
    gen = torch.Generator().manual_seed(seed)
    encs = [get_codec("dense-fp16").encode(torch.randn(n, generator=gen), f"w{i}") for i, n in enumerate(sizes)]
    raw = bytes(torch.randint(0, 256, (5 << 20,), generator=gen, dtype=torch.uint8).numpy())
    encs.insert(1, _tensor(DensePayload("float32", raw), name="raw", shape=(len(raw) // 4,)))
    return EncodedUpdate(base_model_version=seed, tensors=tuple(encs))


@pytest.mark.parametrize("accelerated", [True, False])
def test_trailing_crc_of_a_large_update_equals_protobufs(accelerated, monkeypatch, writer):
    # The CRC runs on a worker thread a piece behind the writer: the trailer must be zlib's CRC of
    # the whole body all the same, whichever CRC function runs and however the pieces fall.
    if writer != "torch":
        pytest.skip("the trailing CRC is the torch writer's (the kernel takes the CRC as it writes)")
    if not accelerated:
        monkeypatch.setattr(fast_writer, "FAST_CRC32", None)
    elif fast_writer.FAST_CRC32 is None:
        pytest.skip("neither isal nor zlib-ng is installed")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the trailing CRC runs beside single-threaded casts only
    try:
        _trailing_crc_cases(monkeypatch)
    finally:
        torch.set_num_threads(threads)


def _trailing_crc_cases(monkeypatch) -> None:
    made: list[int] = []
    real = fast_writer._TrailingCRC

    def counted(mem):
        made.append(len(mem))
        return real(mem)

    monkeypatch.setattr(fast_writer, "_TrailingCRC", counted)
    for step in (fast_writer._CRC_STEP, 1 << 16, 3):
        monkeypatch.setattr(fast_writer, "_CRC_STEP", step)
        u = _large_update(1)
        data = serde.update_to_bytes(u)
        assert len(data) >= fast_writer._CRC_PIPELINE
        assert data == serde.update_to_bytes_protobuf(u)
        assert int.from_bytes(data[-4:], "little") == zlib.crc32(data[:-5])
    assert len(made) == 3  # the trailing CRC did run


def _address(data: bytes) -> int:
    assert fast_writer._BYTES_API is not None
    return fast_writer._BYTES_API[1](data)  # type: ignore[operator, no-any-return]


@pytest.fixture
def reuse(monkeypatch):
    """Output reuse on, nothing kept yet; returns the list of sizes of new large outputs made."""
    if not fast_writer._REUSE_OUTPUT or fast_writer._BYTES_API is None:
        pytest.skip("output reuse needs CPython with its GIL")
    new, ptr = fast_writer._BYTES_API
    made: list[int] = []

    def counting_new(src, n):
        made.append(n)
        return new(src, n)  # type: ignore[operator]

    monkeypatch.setattr(fast_writer, "_BYTES_API", (counting_new, ptr))
    fast_writer.set_output_reuse(True)  # start from nothing kept
    yield made
    fast_writer.set_output_reuse(True)


def test_a_large_output_reuses_the_last_one_only_when_nobody_holds_it(reuse):
    first = serde.update_to_bytes(_large_update(1))
    first_hash = hash(first)
    kept = first  # another holder: the next output must be new memory, the first left untouched
    snapshot = bytes(first)
    second = serde.update_to_bytes(_large_update(2))
    assert len(reuse) == 2
    assert kept == snapshot and hash(kept) == first_hash
    del first, kept, snapshot
    # Nobody holds the second now: the third is written into its memory, and is right.
    where = _address(second)
    h2 = hash(second)
    del second
    u3 = _large_update(3)
    third = serde.update_to_bytes(u3)
    assert len(reuse) == 2 and _address(third) == where
    assert third == serde.update_to_bytes_protobuf(u3)
    # The hash cached while it was the second output must not be served for the third.
    assert hash(third) == hash(bytes(third)) != h2


def test_reuse_needs_the_same_size_and_can_be_turned_off(reuse):
    a = serde.update_to_bytes(_large_update(1))
    del a
    longer = _large_update(2, sizes=(1_500_001, 1000, 2_200_001, 300_000))  # two bytes longer
    b = serde.update_to_bytes(longer)
    assert len(reuse) == 2 and fast_writer._SPARE is b
    assert b == serde.update_to_bytes_protobuf(longer)
    del b
    fast_writer.set_output_reuse(False)
    assert fast_writer._SPARE is None
    c = serde.update_to_bytes(longer)
    assert len(reuse) == 3 and fast_writer._SPARE is None  # a new output, nothing kept while off
    assert c == serde.update_to_bytes_protobuf(longer)


def test_a_memoryview_or_array_over_the_output_blocks_reuse(reuse):
    a = serde.update_to_bytes(_large_update(1))
    view = memoryview(a)
    snapshot = bytes(view)
    del a
    b = serde.update_to_bytes(_large_update(2))
    assert len(reuse) == 2  # a new output: the view holds the first
    assert bytes(view) == snapshot  # the view still sees the first output's bytes
    assert b == serde.update_to_bytes_protobuf(_large_update(2))


def test_outputs_written_from_two_threads_at_once_are_each_right(reuse):
    import threading

    updates = [_large_update(s) for s in (1, 2)]
    expected = [serde.update_to_bytes_protobuf(u) for u in updates]
    wrong: list[int] = []

    def worker(i: int) -> None:
        for _ in range(6):
            data = serde.update_to_bytes(updates[i])
            if data != expected[i]:
                wrong.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []


def test_reuse_stays_off_where_the_hash_is_not_where_expected(monkeypatch):
    # A CPython whose bytes layout moved the cached hash: the sample check fails, reuse stays off.
    monkeypatch.setattr(fast_writer, "_HASH_OFFSET", 2 * fast_writer._HASH_OFFSET)
    assert not fast_writer._hash_slot_found()
    fast_writer.set_output_reuse(True)
    try:
        assert not fast_writer._REUSE_OUTPUT
        data = serde.update_to_bytes(_large_update(1))
        assert fast_writer._SPARE is None and data == serde.update_to_bytes_protobuf(_large_update(1))
    finally:
        monkeypatch.undo()
        fast_writer.set_output_reuse(True)
    assert (fast_writer._BYTES_API is not None) == fast_writer._REUSE_OUTPUT


def test_sbc_scalars_by_hand_are_protobufs():
    """An SBC payload's mean / golomb_b / nnz written by hand (serde._sbc_scalars) are protobuf's
    bytes, and the hand path is taken for what the encoder makes; where protobuf has a say (zeros,
    NaN, a mean that is not a float32, integers out of range or not ints) it is left to protobuf."""
    import math

    from fedcomp.wire.payloads import SBCPayload

    taken = 0
    means = [
        0.25,
        -0.25,
        1.401298464324817e-45,
        -1.401298464324817e-45,
        3.4028234663852886e38,
        -math.inf,
        math.inf,
        1.1754943508222875e-38,
    ]
    for mean in means:
        for b in (0, 1, 5, 62, 2**32 - 1):
            for nnz in (0, 1, 127, 128, 2**63, 2**64 - 1):
                p = SBCPayload(mean=mean, golomb_b=b, nnz=nnz, bits=b"\x01\x02")
                fast = serde._sbc_scalars(p)
                assert fast is not None, p
                taken += 1
                _same(_tensor(p, name="s", shape=(3,)))
    assert taken == len(means) * 5 * 6
    for odd in [
        SBCPayload(0.0, 3, 5, b"\x01"),
        SBCPayload(-0.0, 3, 5, b"\x01"),
        SBCPayload(math.nan, 3, 5, b"\x01"),
        SBCPayload(0.1, 3, 5, b"\x01"),  # not a float32: protobuf rounds it
        SBCPayload(1e39, 3, 5, b"\x01"),
    ]:
        assert serde._sbc_scalars(odd) is None, odd
        _same(_tensor(odd, name="s", shape=(3,)))
    for bad in [SBCPayload(0.5, -1, 5, b""), SBCPayload(0.5, 2**32, 5, b""), SBCPayload(0.5, 3, 2**64, b"")]:
        assert serde._sbc_scalars(bad) is None, bad  # protobuf refuses these: so does the writer
        with pytest.raises((ValueError, TypeError)):
            serde.update_to_bytes(EncodedUpdate(0, (_tensor(bad, name="s", shape=(3,)),)))
    enc = get_codec({"id": "sbc", "p": 0.01}).encode(torch.randn(10_000, generator=torch.Generator().manual_seed(1)))
    assert isinstance(enc.payload, SBCPayload) and serde._sbc_scalars(enc.payload) is not None
    _same(enc)
    # the bits empty (proto3 omits the field: the general path), short and past 4 KiB (a part of
    # their own): protobuf's bytes each time
    for bits in (b"", b"\x07" * 300, b"\x05" * 20_000):
        _same(_tensor(SBCPayload(0.5, 3, 5, bits), name="s", shape=(3,)))


def _write_in_child(queue) -> None:
    queue.put(zlib.crc32(serde.update_to_bytes(_large_update(2))))


def test_a_forked_child_writes_a_large_update(writer):
    # The parent's halves ran on its OpenMP team; a child forked from it writes on a thread of
    # its own (the team's threads did not survive the fork, and handing it work hangs), and gets
    # the same bytes.
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    if writer == "torch":
        pytest.skip("torch's own casts hang in such a child (its OpenMP team is gone): not ours to test")
    want = serde.update_to_bytes(_large_update(2))
    assert len(want) > fast_writer._SPLIT_MIN
    got, exitcode = result_in_fork(_write_in_child)
    assert got == zlib.crc32(want)
    assert exitcode == 0


def test_threelc_scalars_by_hand_are_protobufs():
    """A 3LC payload's scale / numel / zero_run written by hand (serde._threelc_scalars) are
    protobuf's bytes, and the hand path is taken for what both 3LC encoders make; where protobuf
    has a say (a zero or NaN scale, one that is not a float32, numel out of range, a zero_run that
    is not a bool) it is left to protobuf."""
    import math

    from fedcomp.codecs import threelc_device
    from fedcomp.wire.payloads import ThreeLCPayload

    taken = 0
    scales = [0.25, 1.401298464324817e-45, 3.4028234663852886e38, -0.5, math.inf]
    for scale in scales:
        for numel in (0, 1, 127, 128, 2**63, 2**64 - 1):
            for zero_run in (False, True):
                p = ThreeLCPayload(scale=scale, numel=numel, zero_run=zero_run, data=b"\x79\xf3")
                assert serde._threelc_scalars(p) is not None, p
                taken += 1
                _same(_tensor(p, name="s", shape=(3,), codec_id="3lc"))
    assert taken == len(scales) * 6 * 2
    for odd in [
        ThreeLCPayload(0.0, 3, True, b"\x01"),
        ThreeLCPayload(-0.0, 3, False, b"\x01"),
        ThreeLCPayload(math.nan, 3, True, b"\x01"),
        ThreeLCPayload(0.1, 3, True, b"\x01"),  # not a float32: protobuf rounds it
        ThreeLCPayload(1e39, 3, True, b"\x01"),
        ThreeLCPayload(0.5, 3, 1, b"\x01"),  # type: ignore[arg-type]  # an int, not a bool
    ]:
        assert serde._threelc_scalars(odd) is None, odd
        _same(_tensor(odd, name="s", shape=(3,), codec_id="3lc"))
    for bad in [ThreeLCPayload(0.5, -1, True, b""), ThreeLCPayload(0.5, 2**64, True, b"")]:
        assert serde._threelc_scalars(bad) is None, bad  # protobuf refuses these: so does the writer
        with pytest.raises((ValueError, TypeError)):
            serde.update_to_bytes(EncodedUpdate(0, (_tensor(bad, name="s", shape=(3,), codec_id="3lc"),)))
    g = torch.Generator().manual_seed(2)
    for codec in (get_codec({"id": "3lc"}), get_codec({"id": "3lc", "zero_run": False})):
        t = torch.randn(10_000, generator=g)
        encs = [codec.encode(t, "w")]
        encs += threelc_device.encode_update(codec, [("w", t)])[0]  # type: ignore[index]
        for enc in encs:
            assert isinstance(enc.payload, ThreeLCPayload) and serde._threelc_scalars(enc.payload) is not None
            _same(enc)
    for data in (b"", b"\x07" * 300, b"\x05" * 20_000):
        _same(_tensor(ThreeLCPayload(0.5, 3, True, data), name="s", shape=(3,), codec_id="3lc"))


def test_the_framed_path_takes_what_the_encoders_send_and_leaves_the_rest(monkeypatch):
    """``serde._hand_framed`` (one function a tensor) writes the SBC, 3LC and dense tensors the
    encoders make; what it leaves (an empty field, a scalar protobuf writes, another payload) the
    general path writes: protobuf's bytes either way."""
    gen = torch.Generator().manual_seed(5)
    sent = [
        get_codec({"id": "sbc", "p": 0.01}).encode(torch.randn(5_000, generator=gen), "s"),
        get_codec({"id": "3lc", "s": 1.0}).encode(torch.randn(5_000, generator=gen), "l"),
        get_codec("dense-fp16").encode(torch.randn(40, generator=gen), "h"),
        get_codec("dense-fp32").encode(torch.randn(3000, generator=gen), "f"),  # deferred, past 4 KiB
        _tensor(DensePayload("float32", memoryview(bytes(12))), name="m"),
    ]
    for t in sent:
        assert serde._hand_framed(t) is not None, t.name
    left = [
        _tensor(SBCPayload(0.5, 3, 0, b""), name="a", codec_id="sbc"),
        _tensor(ThreeLCPayload(0.5, 3, True, b""), name="b", codec_id="3lc"),
        _tensor(ThreeLCPayload(0.1, 3, True, b"\x01"), name="c", codec_id="3lc"),
        _tensor(DensePayload("float32", b""), name="d", shape=(0,)),
        _tensor(STCPayload(mu=1.5, golomb_b=2, nnz=9, bits=b"\x01", signs=b"\x80"), name="e", codec_id="stc"),
    ]
    for t in left:
        assert serde._hand_framed(t) is None, t.name
    _same(*sent, *left)
    if serde._FRAME is not None:  # the kernel frames the same ones: the rest go to _tensor_parts
        asked: list[str] = []
        real = serde._tensor_parts

        def counted(t: EncodedTensor):
            asked.append(t.name)
            return real(t)

        monkeypatch.setattr(serde, "_tensor_parts", counted)
        _same(*sent, *left)
        # (tensor_to_bytes in _same asks for every tensor once; the update's writer and its
        # update_size each for the left ones)
        assert sorted(asked) == sorted([t.name for t in sent + left] + 2 * [t.name for t in left])


@pytest.mark.parametrize("encoding", ["float32", "float16", "bfloat16"])
def test_deferred_payloads_of_parts_equal_one_made_for_each(encoding):
    """``DeferredDensePayload.of_parts`` (one ``split``, the encoding checked once) gives the
    payloads ``DeferredDensePayload`` gives each part: equal, the same bytes, the same writes."""
    flat = torch.randn(3 + 0 + 7 + 1, generator=torch.Generator().manual_seed(2))
    numels = [3, 0, 7, 1]
    got = DeferredDensePayload.of_parts(encoding, flat, numels)
    starts = [0, 3, 3, 10]
    want = [DeferredDensePayload(encoding, flat[a : a + n]) for a, n in zip(starts, numels, strict=True)]
    assert got == want and [p.nbytes for p in got] == [p.nbytes for p in want]
    assert [p.data for p in got] == [p.data for p in want]
    _same(*(_tensor(p, name=f"t{i}", shape=(n,)) for i, (p, n) in enumerate(zip(got, numels, strict=True))))
    with pytest.raises(ValueError, match="encoding"):
        DeferredDensePayload.of_parts("int8", flat, numels)
    with pytest.raises(RuntimeError):
        DeferredDensePayload.of_parts(encoding, flat, [3, 7])  # (not all of it)
