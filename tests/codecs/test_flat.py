"""The host/device copy helpers of :mod:`fedcomp.codecs.flat` (the layout is tested through the
engines that use it: tests/codecs/test_sbc_device.py, test_threelc_device.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.codecs import flat
from fedcomp.codecs.flat import concrete_device, count_device_work, to_host


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(1000, generator=g),
        torch.randn(37, 29, generator=g).t(),  # not contiguous
        torch.randint(-(2**40), 2**40, (513,), generator=g),
        torch.randint(0, 2**31 - 1, (7, 3), generator=g, dtype=torch.int64).to(torch.int32),
        torch.rand(999, generator=g) > 0.5,  # bool
        torch.randint(0, 255, (1001,), generator=g).to(torch.uint8),
        torch.randn(5, generator=g).half(),
        torch.zeros(0),
        torch.tensor(3.5),  # no dimensions
    ]


def test_to_host_of_host_tensors_is_their_values_and_counts_a_copy() -> None:
    for t in _cases():
        with count_device_work() as work:
            got = to_host(t)
        assert got.dtype == t.numpy().dtype and got.shape == tuple(t.shape)
        assert np.array_equal(got, t.numpy())
        assert (work.to_host, work.syncs) == (1, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("staging", [1 << 20, 4096, 0])
def test_to_host_from_cuda_through_the_pinned_buffer(monkeypatch: pytest.MonkeyPatch, staging: int) -> None:
    # 4096 bytes: most of the cases go in several pieces; 0: plain .cpu()
    monkeypatch.setattr(flat, "STAGING_BYTES", staging)
    for t in _cases():
        with count_device_work() as work:
            got = to_host(t.cuda())
        assert got.dtype == t.numpy().dtype and got.shape == tuple(t.shape)
        assert np.array_equal(got, t.numpy())
        assert (work.ops, work.to_host, work.syncs) == (0 if staging else work.ops, 1, 1)
    first = to_host(torch.arange(10.0).cuda())
    to_host(torch.zeros(10).cuda())
    assert np.array_equal(first, np.arange(10.0, dtype=np.float32))  # not a view of the buffer


def test_a_device_named_without_an_index_is_resolved() -> None:
    assert concrete_device("cpu") == torch.device("cpu")
    assert concrete_device(torch.device("meta")) == torch.empty(0, device="meta").device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_without_an_index_is_the_current_device() -> None:
    assert concrete_device("cuda") == torch.empty(0, device="cuda").device == torch.device("cuda", 0)
