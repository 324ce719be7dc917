"""fedcomp/codecs/scatter_sum.py and its two kernels (reply_check, reply_add in
fedcomp/_native/sbc.c): what they decode, check, add and refuse. The sums against the per-tensor
path, on real replies, are tests/flower/test_weighted_sum.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.codecs import scatter_sum
from fedcomp.codecs.golomb import encode_positions
from fedcomp.errors import PayloadError

needs_kernel = pytest.mark.skipif(
    not scatter_sum.available(), reason="fedcomp._native._sbc is not built or FEDCOMP_NATIVE=0"
)


@needs_kernel
def test_a_scatter_sum_checks_then_adds():
    s = scatter_sum.ScatterSum()
    s.positions("a", encode_positions(torch.tensor([0, 2, 7]), 1), 3, 1, 8, -0.5)
    s.values("b", np.array([1.0, 2.0], dtype=np.float32).tobytes(), 2)
    s.positions("c", encode_positions(torch.tensor([4]), 0), 1, 0, 5, 3.0)
    with pytest.raises(RuntimeError, match=r"^ScatterSum\.add_into before a successful check\(\)$"):
        s.add_into(1.0, [np.zeros(8), np.zeros(2), np.zeros(5)])
    with pytest.raises(RuntimeError, match=r"^ScatterSum\.decoded_positions before a successful check\(\)$"):
        s.decoded_positions()
    assert s.check() == 3 * 0.25 + 1 + 4 + 9
    outs = [np.zeros(8), np.ones(2), np.zeros(5)]
    s.add_into(2.0, outs)
    assert [o.tolist() for o in outs] == [[-1, 0, -1, 0, 0, 0, 0, -1], [3, 5], [0, 0, 0, 0, 6]]


@needs_kernel
def test_a_bad_tensor_is_named_and_nothing_can_be_added():
    s = scatter_sum.ScatterSum()
    s.positions("fine", encode_positions(torch.tensor([1]), 0), 1, 0, 4, 1.0)
    s.values("bad", np.array([1.0, np.inf], dtype=np.float32).tobytes(), 2)
    with pytest.raises(PayloadError, match="bad.*not all finite"):
        s.check()
    with pytest.raises(RuntimeError):
        s.add_into(1.0, [np.zeros(4), np.zeros(2)])
    s = scatter_sum.ScatterSum()
    bits = encode_positions(torch.tensor([1, 6]), 1)
    s.positions("past", bits, 2, 1, 5, 1.0)  # position 6 of a 5-element tensor
    with pytest.raises(PayloadError, match="past"):
        s.check()


@needs_kernel
def test_a_stream_only_the_kernel_refuses_is_still_refused_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel finds a position stream invalid, the per-tensor decoder is asked for its
    words; should it find nothing wrong (the two disagree), the stream is refused all the same,
    naming the tensor."""
    monkeypatch.setattr(scatter_sum, "decode_positions", lambda *args: None)
    s = scatter_sum.ScatterSum()
    s.positions("fine", encode_positions(torch.tensor([1]), 0), 1, 0, 4, 1.0)
    s.positions("past", encode_positions(torch.tensor([1, 6]), 1), 2, 1, 5, 1.0)
    with pytest.raises(PayloadError) as err:
        s.check()
    assert (err.value.tensor, err.value.reason) == ("past", "invalid position stream")


@needs_kernel
def test_the_kernels_refuse_inconsistent_arguments():
    k = scatter_sum._KERNEL
    assert k is not None
    bits = encode_positions(torch.tensor([1, 5, 9]), 1)
    scratch = np.empty(3, dtype=np.int64)
    assert k.reply_check([(0, bits, 3, 1, 10, 0, 0.5)], scratch) == (-1, 0.75)
    assert scratch.tolist() == [1, 5, 9]
    for task in [
        (0, bits, 3, 1, 10, 1, 0.5),  # offset + nnz past the scratch
        (0, bits, 3, 63, 10, 0, 0.5),  # b past 62
        (0, bits, 11, 1, 10, 0, 0.5),  # nnz past numel
        (1, b"\0" * 8, 0, 0, 3, 0, 0.0),  # 8 bytes are not 3 float32
        (2, bits, 3, 1, 10, 0, 0.5),  # no such kind
    ]:
        with pytest.raises(ValueError, match="reply task 0"):
            k.reply_check([task], scratch)
    out = np.zeros(10)
    k.reply_add([(0, bits, 3, 1, 10, 0, 0.5)], scratch, 2.0, [out], 1, False)
    assert out.tolist() == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    with pytest.raises(ValueError, match="output 0"):
        k.reply_add([(0, bits, 3, 1, 10, 0, 0.5)], scratch, 2.0, [np.zeros(9)], 1, False)
    with pytest.raises(ValueError, match="one output per task"):
        k.reply_add([(0, bits, 3, 1, 10, 0, 0.5)], scratch, 2.0, [], 1, False)
    scratch[2] = 10  # a caller's scratch is not trusted: no write outside the tensor
    with pytest.raises(ValueError, match="outside its tensor"):
        k.reply_add([(0, bits, 3, 1, 10, 0, 0.5)], scratch, 2.0, [np.zeros(10)], 1, False)
    values = np.array([1.5, -2.0, 0.25], dtype=np.float32)
    # float32 values at an odd offset of a buffer (a dense payload inside the update's bytes)
    odd = memoryview(b"x" + values.tobytes())[1:]
    assert k.reply_check([(1, odd, 0, 0, 3, 0, 0.0)], scratch) == (-1, 1.5**2 + 4 + 0.25**2)
    out = np.ones(3)
    k.reply_add([(1, odd, 0, 0, 3, 0, 0.0)], scratch, 0.5, [out], 1, False)
    assert out.tolist() == [1.75, 0.0, 1.125]


def _many(seed: int) -> tuple[scatter_sum.ScatterSum, list[int]]:
    """A reply of 40 tensors (position streams of many sizes, and values) with their sizes."""
    rng = np.random.default_rng(seed)
    s, sizes = scatter_sum.ScatterSum(), []
    for i in range(40):
        n = int(rng.integers(1, 50_000))
        if i % 3 == 0:
            s.values(f"v{i}", rng.standard_normal(n).astype(np.float32).tobytes(), n)
        else:
            idx = np.sort(rng.choice(n, size=max(1, n // 50), replace=False))
            s.positions(
                f"p{i}", encode_positions(torch.from_numpy(idx), 3), len(idx), 3, n, float(rng.standard_normal())
            )
        sizes.append(n)
    s.check()
    return s, sizes


@needs_kernel
def test_the_adds_are_the_same_on_any_number_of_threads():
    s, sizes = _many(7)
    want = [np.full(n, 0.5) for n in sizes]
    s.add_into(1.25, want, threads=1)
    for threads in (2, 3, 8):
        got = [np.full(n, 0.5) for n in sizes]
        s.add_into(1.25, got, threads=threads)
        assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True)), threads
    # and each output is its own tensor's: two tasks may not share one (they would race)
    two = scatter_sum.ScatterSum()
    two.values("a", np.ones(4, dtype=np.float32).tobytes(), 4)
    two.values("b", np.ones(4, dtype=np.float32).tobytes(), 4)
    two.check()
    same = np.zeros(4)
    with pytest.raises(ValueError, match="outputs 0 and 1 are the same buffer"):
        two.add_into(1.0, [same, same], threads=2)


@needs_kernel
@pytest.mark.parametrize("broken", [None, 0, 1, 17, 38, 39], ids=lambda b: f"broken={b}")
def test_the_check_is_the_same_on_any_number_of_threads(broken: int | None):
    """``check(threads=)``: the squared norm (summed in the tensors' order), the positions and the
    first tensor that fails, whichever thread ran it; a failing tensor is a position stream cut
    short or a value made infinite."""
    s, _ = _many(9)
    for i in [] if broken is None else sorted({broken, 39}):  # a later tensor fails too
        kind, buf, *rest = s.tasks[i]
        if kind == 0:
            s.tasks[i] = (kind, bytes(buf)[:1], *rest)
        else:
            raw = bytearray(buf)
            raw[-4:] = np.array([np.inf], np.float32).tobytes()
            s.tasks[i] = (kind, bytes(raw), *rest)
    outcomes = []
    for threads in (1, 2, 3, 8):
        try:
            squares = s.check(threads=threads)
            outcomes.append((squares, s.decoded_positions().tolist()))
        except PayloadError as exc:
            outcomes.append((str(exc), None))
    assert all(o == outcomes[0] for o in outcomes), [o[0] for o in outcomes]
    if broken is not None:
        assert s.names[broken] in outcomes[0][0]


def _outputs(n: int, wide: bool) -> tuple[np.ndarray, bool, np.ndarray]:
    return np.empty(n, np.int64 if wide else np.int32), wide, np.empty(n, np.float32)


def _positions_only(seed: int) -> tuple[scatter_sum.ScatterSum, list[int], list[float]]:
    """A reply of 30 position streams of many sizes, with their sizes and values."""
    rng = np.random.default_rng(seed)
    s, sizes, values = scatter_sum.ScatterSum(), [], []
    for i in range(30):
        n = int(rng.integers(1, 50_000))
        idx = np.sort(rng.choice(n, size=max(1, n // 40), replace=False))
        value = float(np.float32(rng.standard_normal()))
        s.positions(f"p{i}", encode_positions(torch.from_numpy(idx), 3), len(idx), 3, n, value)
        sizes.append(n)
        values.append(value)
    return s, sizes, values


@needs_kernel
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_check_writes_flat_positions_and_values(dtype: type, threads: int):
    """``check(flat=)``: each tensor's positions plus its base, in the dtype asked for, and its
    value at each: what the NumPy passes over ``decoded_positions`` made, on any number of threads."""
    s, sizes, values = _positions_only(3)
    bases = np.concatenate(([0], np.cumsum(sizes)[:-1])) + 5  # (not from 0: the add is seen)
    flat = scatter_sum.FlatPositions(bases.tolist(), dtype)
    squares = s.check(threads=threads, flat=flat)
    counts = [t[2] for t in s.tasks]
    assert flat.kept is not None and flat.values is not None
    assert flat.kept.dtype == dtype and flat.values.dtype == np.float32
    want = s.decoded_positions() + np.repeat(bases, counts)
    assert np.array_equal(flat.kept, want)
    assert np.array_equal(flat.values, np.repeat(np.array(values, np.float32), counts))
    assert squares == s.check(threads=threads)  # the same check with or without the outputs


@needs_kernel
def test_the_flat_outputs_must_fit():
    k = scatter_sum._KERNEL
    assert k is not None
    bits = encode_positions(torch.tensor([1, 5, 9]), 1)
    task = [(0, bits, 3, 1, 10, 0, 0.5)]
    scratch, bases = np.empty(3, np.int64), np.array([7], np.int64)
    kept, values = np.empty(3, np.int32), np.empty(3, np.float32)
    assert k.reply_check(task, scratch, 1, False, bases, kept, False, values) == (-1, 0.75)
    assert kept.tolist() == [8, 12, 16] and values.tolist() == [0.5] * 3
    for args in [
        (np.array([7, 8], np.int64), kept, False, values),  # two bases for one task
        (bases, kept, True, values),  # int32 outputs called wide
        (bases, np.empty(2, np.int32), False, values),  # too short
        (bases, kept, False, np.empty(4, np.float32)),  # too long
    ]:
        with pytest.raises(ValueError, match="as long as scratch"):
            k.reply_check(task, scratch, 1, False, *args)
    for base, wide in [(-1, False), (2**31 - 10, False), (-1, True), (2**63 - 10, True)]:  # base + numel 10 too far
        with pytest.raises(ValueError, match="base plus its numel"):
            k.reply_check(task, scratch, 1, False, np.array([base], np.int64), *_outputs(3, wide))
    assert k.reply_check(task, scratch, 1, False, np.array([2**31 - 11], np.int64), kept, False, values) == (-1, 0.75)
    assert kept.tolist() == [2**31 - 10, 2**31 - 6, 2**31 - 2]  # (the last position that fits int32 is 2**31 - 1)
    with pytest.raises(ValueError, match="2 bases for 1 tensors"):
        s = scatter_sum.ScatterSum()
        s.positions("a", bits, 3, 1, 10, 0.5)
        s.check(flat=scatter_sum.FlatPositions([0, 1], np.int32))


def _add_in_child(queue) -> None:  # type: ignore[no-untyped-def]
    s, sizes = _many(8)
    outs = [np.zeros(n) for n in sizes]
    s.add_into(2.0, outs, threads=2)  # torch's team is gone in a forked child: threads of our own
    queue.put([float(o.sum()) for o in outs])


@needs_kernel
def test_a_forked_child_adds_on_threads_of_its_own():
    from tests.forking import result_in_fork

    torch.ones(1 << 16).add_(1)  # torch's OpenMP team has run in this process
    got, code = result_in_fork(_add_in_child)
    s, sizes = _many(8)
    outs = [np.zeros(n) for n in sizes]
    s.add_into(2.0, outs, threads=1)
    assert code == 0 and got == [float(o.sum()) for o in outs]
