"""The host/device copy helpers and the layout of :mod:`fedcomp.codecs.flat` (the layout is also
tested through the engines that use it: tests/codecs/test_sbc_device.py, test_threelc_device.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcomp.codecs.flat import (
    Layout,
    concrete_device,
    count_device_work,
    tensors_on_host,
    tensors_to_device,
    to_device,
    to_device_many,
    to_host,
)


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
def test_to_host_of_cuda_tensors_is_their_values() -> None:
    for t in _cases():
        with count_device_work() as work:
            got = to_host(t.cuda())
        assert got.dtype == t.numpy().dtype and got.shape == tuple(t.shape)
        assert np.array_equal(got, t.numpy())
        assert (work.to_host, work.syncs) == (1, 1)


def _groups() -> list:
    g = np.random.default_rng(1)
    return [
        ([g.integers(0, 2**31 - 1, 5), g.integers(0, 2**31 - 1, 0), g.integers(0, 2**31 - 1, 3)], np.int32),
        ([g.standard_normal(7).astype(np.float32)], np.float32),
        ([], np.float32),  # empty: None
        ([g.integers(-(2**40), 2**40, 3)], np.int64),
        ([g.integers(0, 256, 13).astype(np.uint8), g.integers(0, 256, 2).astype(np.uint8)], np.uint8),
        ([g.standard_normal(1).astype(np.float32)], np.float32),
    ]


def _check_many(device: torch.device) -> None:
    groups = _groups()
    with count_device_work() as work:
        got = to_device_many(groups, device)
    assert work.to_device == 1  # every group in one copy
    for (arrays, dtype), t in zip(groups, got, strict=True):
        want = np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)
        if want.size == 0:
            assert t is None
            continue
        assert t is not None and t.device == device
        on_host = t.cpu().numpy()
        assert on_host.dtype == np.dtype(dtype) and np.array_equal(on_host, want)
    assert to_device_many([([], np.int32)], device) == [None]


def test_to_device_many_is_each_group_concatenated_in_one_copy() -> None:
    """Typed views of one copy (each part 8-byte aligned, so a view of any dtype is allowed), int64
    values cast to int32 where asked, an empty group None."""
    _check_many(torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_to_device_many_onto_cuda() -> None:
    _check_many(torch.device("cuda", torch.cuda.current_device()))


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g), "s": torch.tensor(2.5)}


def test_host_tensors_stay_where_they_are() -> None:
    """On the CPU neither helper copies: the same tensors come back (a copy per round of a whole
    model is what these helpers exist to avoid)."""
    model = _model()
    for got in (tensors_to_device(model, "cpu"), tensors_on_host(model)):
        assert list(got) == list(model)
        assert all(got[k].data_ptr() == model[k].data_ptr() and torch.equal(got[k], model[k]) for k in model)
    mixed = {**model, "n": torch.arange(3)}  # not all float32: copied tensor by tensor, as they are
    assert all(torch.equal(v, mixed[k]) and v.dtype == mixed[k].dtype for k, v in tensors_on_host(mixed).items())
    assert tensors_to_device({}, "meta") == {}


def test_tensors_go_to_another_device_as_views_of_one_buffer() -> None:
    """("meta" stands in for CUDA: the device is kept, each tensor a view of one allocation.)"""
    model = _model()
    got = tensors_to_device(model, torch.device("meta"))
    assert list(got) == list(model)
    assert all(
        v.device.type == "meta" and v.shape == model[k].shape and v.dtype == torch.float32 for k, v in got.items()
    )
    bases = [v._base for v in got.values()]
    assert bases[0] is not None and all(b is bases[0] for b in bases) and bases[0].numel() == 17
    one = to_device(np.arange(6, dtype=np.int32), torch.device("meta"))
    assert one.device.type == "meta" and one.shape == (6,) and one.dtype == torch.int32


def test_a_device_named_without_an_index_is_resolved() -> None:
    assert concrete_device("cpu") == torch.device("cpu")
    assert concrete_device(torch.device("meta")) == torch.empty(0, device="meta").device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_without_an_index_is_the_current_device() -> None:
    assert concrete_device("cuda") == torch.empty(0, device="cuda").device == torch.device("cuda", 0)


def test_host_side_time_is_counted_once_for_nested_blocks_and_only_while_timed() -> None:
    import time

    from fedcomp.codecs.flat import host_side, time_host_work

    with host_side():  # not timed: nothing to add to
        time.sleep(0.01)
    with time_host_work() as clock:
        torch.ones(3).add_(1)  # device work: not host time
        with host_side():
            time.sleep(0.02)
            with host_side():  # nested: inside the outer block's time, not added twice (0.22)
                time.sleep(0.1)
        time.sleep(0.2)  # outside the blocks (0.32 were it counted)
    assert 0.12 <= clock.seconds < 0.2, clock.seconds
    seconds = clock.seconds
    with host_side():
        time.sleep(0.01)
    assert clock.seconds == seconds  # (the clock is no longer running)


def test_a_layout_views_its_tensors_in_a_flat_buffer_of_at_least_its_size() -> None:
    layout = Layout.of_shapes(["a", "b", "c", "d"], [(2, 3), (), (0,), [4]])
    assert (layout.offsets, layout.numels, layout.total) == ((0, 6, 7, 7), (6, 1, 0, 4), 11)
    for extra in (0, 5):  # (a longer buffer: its first ``total`` values)
        flat = torch.arange(11 + extra, dtype=torch.float32)
        views = layout.views(flat)
        assert list(views) == ["a", "b", "c", "d"]
        assert [tuple(v.shape) for v in views.values()] == [(2, 3), (), (0,), (4,)]
        assert views["a"].flatten().tolist() == [0, 1, 2, 3, 4, 5] and views["b"].item() == 6
        assert views["d"].tolist() == [7, 8, 9, 10]
        views["d"][0] = -1  # a view: no copy
        assert flat[7] == -1
    with pytest.raises(RuntimeError):
        layout.views(torch.zeros(10))


def test_a_layout_is_found_again_by_value() -> None:
    names, shapes = ["w", "b"], [[3, 2], [2]]
    first = Layout.of_shapes(names, shapes)
    other = Layout.of_shapes(["x"], [(5,)])  # (an encode's two layouts, in turn: both kept)
    assert Layout.of_shapes(names, shapes) is first and Layout.of_shapes(["x"], [[5]]) is other
    assert Layout.of_shapes(("w", "b"), (torch.Size([3, 2]), (np.int64(2),))) is first  # equal values
    shapes[0][0] = 4  # the caller's lists changed in place: a new layout, not the kept one
    second = Layout.of_shapes(names, shapes)
    assert second is not first and second.numels == (8, 2) and first.numels == (6, 2)
    assert Layout.of_shapes(["w", "c"], [(4, 2), (2,)]).names == ("w", "c")
    assert Layout.of({"w": torch.zeros(4, 2), "b": torch.zeros(2)}) == second
