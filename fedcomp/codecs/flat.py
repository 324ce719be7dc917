"""One flat buffer for a whole update, and a count of what a device spends on it.

The per-tensor codec paths cost a CUDA device per tensor, not per value: issue #13 counted 2,433
kernel launches, 1,035 host-device copies and 278 ``.item()`` syncs for one SBC encode of a
161-tensor ResNet-50 update. The whole-update engines (:mod:`fedcomp.codecs.sbc_device`,
:mod:`fedcomp.codecs.threelc_device`, :mod:`fedcomp.methods.flat_update`) lay the update out in
one buffer (:class:`Layout`: each tensor's offset) and spend a number of launches, syncs and
copies that does not depend on how many tensors there are. Every copy between host and device
goes through :func:`to_host` and :func:`to_device`, so :func:`count_device_work` can count them on
any device, CPU included: that is how the tests and ``python -m fedcomp.bench device-work`` check
the claim on a machine without a GPU (the same torch operators run on CPU; each one is one or
more kernel launches on CUDA). The counter is a ``TorchDispatchMode`` (torch's documented hook
for seeing every operator, from a private module path).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Layout:
    """Where each tensor of an update lies in one flat buffer: in order, back to back."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]

    @classmethod
    def of(cls, tensors: Sequence[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> Layout:
        items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
        return cls.of_shapes([n for n, _ in items], [tuple(t.shape) for _, t in items])

    @classmethod
    def of_shapes(cls, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> Layout:
        """The layout of tensors of these names and shapes (a receiver's specs, say); the last
        few made are kept, found again by value (a sender or receiver meets the same tensors every
        round, an encode two layouts: its large tensors and its small ones; a tenth of the work of
        making one)."""
        key = (cls, tuple(names), tuple(map(tuple, shapes)))
        made = _LAYOUTS.get(key)
        if made is not None:
            return made
        dims = tuple(tuple(int(d) for d in shape) for shape in key[2])
        numels = tuple(math.prod(d) for d in dims)
        made = cls(key[1], dims, tuple(itertools.accumulate(numels[:-1], initial=0)) if numels else (), numels)
        if len(_LAYOUTS) >= _KEEP_LAYOUTS:
            _LAYOUTS.clear()  # (a process meeting many models: start again)
        _LAYOUTS[key] = made
        return made

    @property
    def total(self) -> int:
        return sum(self.numels)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each tensor as a view of ``flat`` (no copy, no kernel): of its first :attr:`total`
        values, by one ``split`` (a quarter faster than a slice each)."""
        parts = (flat if flat.shape[0] == self.total else flat[: self.total]).split(self.numels)
        return {name: part.view(shape) for name, shape, part in zip(self.names, self.shapes, parts, strict=True)}


#: The layouts :meth:`Layout.of_shapes` made, by class, names and shapes (at most
#: :data:`_KEEP_LAYOUTS`; a dict's single reads and writes are safe from several threads).
_LAYOUTS: dict[tuple[Any, ...], Layout] = {}
_KEEP_LAYOUTS = 16


@dataclass
class DeviceWork:
    """What :func:`count_device_work` saw: operators that compute (views and bare allocations
    left out), the ones among them that make the host wait for the device, and host-device
    copies in each direction."""

    ops: int = 0
    syncs: int = 0
    to_host: int = 0
    to_device: int = 0
    by_op: dict[str, int] = field(default_factory=dict)


@dataclass
class HostTime:
    """What :func:`time_host_work` saw: the wall time spent inside the outermost
    :func:`host_side` blocks, the engine's own work on the host (on a GPU, what the device does not
    overlap), in seconds."""

    seconds: float = 0.0


#: Operators whose result the host must wait for on CUDA (a data-dependent size or a scalar).
_SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense",
        "aten.nonzero",
        "aten.masked_select",
        "aten.equal",
        "aten.is_nonzero",
        "aten._unique2",
        "aten.unique_consecutive",
    }
)
#: Allocation without a kernel.
_NO_KERNEL = frozenset({"aten.empty", "aten.empty_strided", "aten.empty_like", "aten.lift_fresh"})

_COUNTING = threading.local()


class _Counter(TorchDispatchMode):
    def __init__(self, work: DeviceWork) -> None:
        super().__init__()
        self.work = work

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if not func.is_view and name not in _NO_KERNEL and not getattr(_COUNTING, "host", False):
            self.work.ops += 1
            self.work.by_op[name] = self.work.by_op.get(name, 0) + 1
            if name in _SYNC_OPS:
                self.work.syncs += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_device_work() -> Iterator[DeviceWork]:
    """Count the torch operators run inside (on this thread) and the copies made through
    :func:`to_host` and :func:`to_device`. A copy to the host is also a sync."""
    work = DeviceWork()
    _COUNTING.work = work
    try:
        with _Counter(work):
            yield work
    finally:
        _COUNTING.work = None


@contextlib.contextmanager
def host_side() -> Iterator[None]:
    """Mark work on host tensors (NumPy views, the CPU codecs) inside an engine: not counted,
    since it never reaches the device (what matters when the engine runs on the CPU to be
    counted). Inside :func:`time_host_work`, the outermost block's time is added to its
    :class:`HostTime`."""
    before = getattr(_COUNTING, "host", False)
    clock = None if before else getattr(_COUNTING, "clock", None)
    _COUNTING.host = True
    start = time.perf_counter() if clock is not None else 0.0
    try:
        yield
    finally:
        _COUNTING.host = before
        if clock is not None:
            clock.seconds += time.perf_counter() - start


@contextlib.contextmanager
def time_host_work() -> Iterator[HostTime]:
    """Add up the time spent in :func:`host_side` blocks inside (on this thread); without
    :func:`count_device_work`'s dispatch mode, whose hook on every torch operator would add to the
    blocks that still call a few."""
    clock = HostTime()
    _COUNTING.clock = clock
    try:
        yield clock
    finally:
        _COUNTING.clock = None


def _counted() -> DeviceWork | None:
    return getattr(_COUNTING, "work", None)


@functools.lru_cache(maxsize=8)
def has_nonzero_static(device_type: str) -> bool:
    """Whether this torch has ``nonzero_static`` on this kind of device (torch 2.4, which the
    project allows, has it on the CPU only): the engines' way to positions in a block of fixed size
    without a wait for the device (else ``nonzero``, and a wait)."""
    try:
        torch.nonzero_static(torch.ones(1, dtype=torch.bool, device=device_type), size=1)
    except (NotImplementedError, RuntimeError, AttributeError):
        return False
    return True


def concrete_device(device: torch.device | str) -> torch.device:
    """``device`` with its index where it names none (``cuda`` is the current one, ``cuda:0``), so
    that it compares equal to the ``.device`` of a tensor on it (``torch.device("cuda") !=
    torch.device("cuda:0")``: a GPU run compared them and left every update to the per-tensor path)."""
    device = torch.device(device)
    if device.type == "cpu" or device.index is not None:
        return device
    return torch.empty(0, device=device).device  # (allocates nothing, launches nothing)


#: Copies between a CUDA device and the host of up to this size go through page-locked memory
#: (torch's caching host allocator keeps it for the next one); larger ones (a whole dense model)
#: through ordinary memory, so that they do not pin as much host memory for good.
PINNED_MAX_BYTES = 16 << 20


def _pinned(nbytes: int, device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda" and nbytes <= PINNED_MAX_BYTES


def to_host(t: torch.Tensor) -> np.ndarray:
    """``t`` as a NumPy array on the host (a copy from the device, and the host waits for it). From
    a CUDA device into page-locked memory (:data:`PINNED_MAX_BYTES`): into pageable memory the
    driver stages the copy through a buffer of its own, piece by piece."""
    return to_host_later(t).wait()


def _count_to_device() -> None:
    work = _counted()
    if work is not None and not getattr(_COUNTING, "host", False):
        work.to_device += 1


def to_device(a: np.ndarray, device: torch.device, into: torch.Tensor | None = None) -> torch.Tensor:
    """NumPy ``a`` as a tensor on ``device`` (a copy unless ``device`` is the CPU); with ``into``
    (on ``device``, of ``a``'s size), copied there instead of into a new tensor."""
    _count_to_device()
    host = torch.from_numpy(np.ascontiguousarray(a))
    return host.to(device) if into is None else into.copy_(host.view(into.shape))


class Pending:
    """A copy to the host under way (:func:`to_host_later`): the host does other work, then
    :meth:`wait` s for the values."""

    def __init__(self, host: np.ndarray, event: Any = None) -> None:
        self._host, self._event = host, event

    def wait(self) -> np.ndarray:
        """The values (the host waits for the copy, if it is not done)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def to_host_later(t: torch.Tensor) -> Pending:
    """:func:`to_host` without waiting for it: from a CUDA device into page-locked memory
    (:data:`PINNED_MAX_BYTES`) behind the work the device has queued, the host free until
    :meth:`Pending.wait` (an encode's own host work then overlaps the device's). A copy past the
    page-locked size, or from the CPU, is made at once."""
    work = _counted()
    if work is not None and not getattr(_COUNTING, "host", False):
        work.to_host += 1
        work.syncs += 1
    t = t.detach()
    if not _pinned(t.numel() * t.element_size(), t.device):
        return Pending(t.cpu().numpy())
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return Pending(host.numpy(), event)


#: Positions into a flat buffer of at most this many values cross between host and device as
#: int32, four bytes each (else int64).
_INT32_POSITIONS = int(np.iinfo(np.int32).max)


def position_dtype(total: int) -> type[np.int32] | type[np.int64]:
    """The NumPy dtype in which positions into a flat buffer of ``total`` values cross between host
    and device: int32 where they fit (half the bytes), else int64."""
    return np.int32 if total <= _INT32_POSITIONS else np.int64


def to_device_many(
    groups: Sequence[tuple[Sequence[np.ndarray], np.dtype | type]], device: torch.device
) -> list[torch.Tensor | None]:
    """Each group's arrays concatenated (1-D, cast to the group's dtype: ``same_kind``, e.g.
    int64 positions to int32) as a tensor on ``device``, all groups in one copy from one host
    buffer (each copy from pageable memory to a GPU is a wait of its own); None for an empty
    group. The tensors are views of the one copy (each part 8-byte aligned)."""
    sizes = [sum(int(a.shape[0]) for a in arrays) * np.dtype(dtype).itemsize for arrays, dtype in groups]
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += (size + 7) // 8 * 8
    if not at:
        return [None] * len(groups)
    # Onto a GPU from page-locked memory (torch's caching host allocator keeps the block until the
    # copy is done), without the host waiting for it: the device reads the parts in stream order.
    staging = torch.empty(at, dtype=torch.uint8, pin_memory=True) if _pinned(at, device) else None
    host = np.empty(at, dtype=np.uint8) if staging is None else staging.numpy()
    for (arrays, dtype), start, size in zip(groups, starts, sizes, strict=True):
        if size:
            np.concatenate(list(arrays), out=host[start : start + size].view(dtype), casting="same_kind")
    if staging is None:
        on_device = to_device(host, device)
    else:
        _count_to_device()
        on_device = staging.to(device, non_blocking=True)
    return [
        on_device[start : start + size].view(_TORCH_OF[np.dtype(dtype)]) if size else None
        for (_, dtype), start, size in zip(groups, starts, sizes, strict=True)
    ]


_TORCH_OF = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.uint8): torch.uint8,
}


def tensors_on_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU: float32 ones on one other device in one copy, as views of one
    buffer (a copy per tensor, and a wait for each, would cost a GPU client hundreds per round)."""
    devices = {t.device for t in tensors.values()}
    if (
        len(devices) != 1
        or next(iter(devices)).type == "cpu"
        or any(t.dtype != torch.float32 for t in tensors.values())
    ):
        return {k: v.detach().cpu() for k, v in tensors.items()}
    host = to_host(torch.cat([t.detach().reshape(-1) for t in tensors.values()]))
    return Layout.of(tensors).views(torch.from_numpy(host))


def tensors_to_device(tensors: Mapping[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Float32 CPU ``tensors`` on ``device``: as they are on the CPU, else views of one buffer
    copied there at once."""
    device = torch.device(device)
    if device.type == "cpu" or not tensors:
        return dict(tensors)
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    return Layout.of(tensors).views(to_device(flat.numpy(), device))
