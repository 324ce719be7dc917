"""The flat buffer's per-tensor tables against the torch operators they replace."""

from __future__ import annotations

import pytest
import torch

from fedcomp.codecs.segments import PIECE, segment_ids, segment_max

LAYOUTS = [
    (1,),
    (7, 1, 3),
    (0, 5, 0, 0, 2, 0),  # empty tensors first, between, last: they begin where the next does
    (PIECE - 1, PIECE, PIECE + 1, 1, 2 * PIECE, 3),  # the pieces' edges
    (3 * PIECE + 17, 0, 11),
]


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("numels", LAYOUTS)
def test_segment_ids_are_repeat_interleave(numels: tuple[int, ...]) -> None:
    ids = segment_ids(numels, torch.device("cpu"))
    expected = torch.arange(len(numels)).repeat_interleave(torch.tensor(numels))
    assert ids.dtype == torch.int32
    assert torch.equal(ids.long(), expected)


@pytest.mark.parametrize("numels", [n for n in LAYOUTS if 0 not in n])
def test_segment_max_is_segment_reduce(numels: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(numels))
    values = torch.randn(sum(numels), generator=g).abs()
    expected = torch.segment_reduce(values, "max", lengths=torch.tensor(numels))
    assert torch.equal(segment_max(values, numels), expected)


def test_segment_max_keeps_a_nan_in_its_tensor() -> None:
    numels = (PIECE + 5, 3, 2 * PIECE)
    values = torch.ones(sum(numels))
    values[PIECE + 2] = float("nan")  # the first tensor's second piece
    top = segment_max(values, numels)
    assert torch.isnan(top[0]) and top[1] == 1.0 and top[2] == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the CPU runs the same operators above)")
@pytest.mark.parametrize("numels", LAYOUTS)
def test_cuda_tables_equal_the_cpu_ones(numels: tuple[int, ...]) -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    assert torch.equal(segment_ids(numels, dev).cpu(), segment_ids(numels, torch.device("cpu")))
    if 0 not in numels:
        values = torch.randn(sum(numels)).abs()
        assert torch.equal(segment_max(values.to(dev), numels).cpu(), segment_max(values, numels))
