"""Adding received payloads into float64 sums without a dense tensor per payload: SBC's kept
positions (Golomb-coded, one value) and float32 values, checked for a whole update in one C call
and added in another. What a server summing replies needs (:mod:`fedcomp.flower.weighted_sum`);
CPU only. :func:`available` says whether the kernel is built: without it, callers sum per tensor
(``SBC.positions`` and a fancy add; a decoded tensor and ``add_``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from fedcomp import _native
from fedcomp.codecs.golomb import decode_positions
from fedcomp.codecs.sbc import team_threads
from fedcomp.errors import PayloadError

_KERNEL = _native.load("sbc")
#: The process that loaded the kernel: a forked child must not use torch's OpenMP team (team.h).
_KERNEL_PID = os.getpid()

#: One tensor for the kernel: (kind, buffer, nnz, golomb_b, numel, offset, value); kind 0 is
#: Golomb-coded positions decoded into the scratch at ``offset``, kind 1 float32 values.
Task = tuple[int, bytes | memoryview, int, int, int, int, float]


def available() -> bool:
    """Whether :class:`ScatterSum` can run (the C kernel is built and enabled)."""
    return _KERNEL is not None


class FlatPositions:
    """What :meth:`ScatterSum.check` also writes for a decode onto a device
    (:mod:`fedcomp.methods.flat_update`): every :meth:`ScatterSum.positions` tensor's positions
    into the update's flat buffer (its own plus ``bases[i]``, where its tensor starts there) in
    ``dtype`` (int32 where the update's positions fit, :func:`fedcomp.codecs.flat.position_dtype`),
    and its value at each (float32), back to back in the order given: what the host used to make
    of :meth:`ScatterSum.decoded_positions` by three NumPy passes, written by the thread that
    decoded them (about 0.3 ms of a ResNet-50 update's host share)."""

    def __init__(self, bases: Sequence[int], dtype: type[np.int32] | type[np.int64]) -> None:
        self.bases = np.array(bases, dtype=np.int64)
        self.dtype = np.dtype(dtype)
        self.kept: np.ndarray | None = None
        self.values: np.ndarray | None = None

    def arguments(self, tasks: int, nnz: int) -> tuple[np.ndarray, np.ndarray, bool, np.ndarray]:
        """The kernel's trailing arguments (its outputs allocated here); every task must be a
        :meth:`ScatterSum.positions` one, with a base each."""
        if self.bases.shape[0] != tasks:
            raise ValueError(f"FlatPositions: {self.bases.shape[0]} bases for {tasks} tensors")
        self.kept = np.empty(nnz, dtype=self.dtype)
        self.values = np.empty(nnz, dtype=np.float32)
        return self.bases, self.kept, self.dtype == np.int64, self.values


class ScatterSum:
    """A whole update's tensors, gathered by :meth:`positions` and :meth:`values`, then
    :meth:`check` ed once (every position stream decoded, every value finite, the squared norm)
    and :meth:`add_into` float64 sums. Each tensor's arguments must have passed the checks that
    need no decoding (``SBC.checked_positions``, ``checked_payload`` of the dense codecs)."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        #: The tensors' names, in the order they were given.
        self.names: list[str] = []
        self._nnz = 0
        self._scratch: np.ndarray | None = None
        self._order: list[int] = []  # the tasks largest first (the kernel's threads take them in turn)

    def positions(self, name: str, bits: bytes, nnz: int, b: int, numel: int, value: float) -> None:
        """SBC's kept positions of tensor ``name`` (``nnz`` >= 1 of ``numel``) and their value."""
        self.tasks.append((0, bits, nnz, b, numel, self._nnz, value))
        self.names.append(name)
        self._nnz += nnz

    def values(self, name: str, data: bytes | memoryview, numel: int) -> None:
        """Tensor ``name``'s ``numel`` float32 values, little-endian (at any alignment)."""
        self.tasks.append((1, data, 0, 0, numel, 0, 0.0))
        self.names.append(name)

    def check(self, threads: int | None = None, flat: FlatPositions | None = None) -> float:
        """Decode every position stream (into a scratch of the update's total ``nnz`` positions,
        the only allocation) and check every value is finite; the update's squared norm. Raise
        :class:`PayloadError` naming the first tensor that fails, worded as the per-tensor
        decoders word it. The tensors spread over ``threads`` threads (default: torch's, one
        inside a :func:`fedcomp.codecs.sbc.run_jobs` lane); the result is the same on any
        number. With ``flat``, its ``kept`` and ``values`` are written too, by the same call."""
        assert _KERNEL is not None, "check available() first"
        self._scratch = np.empty(self._nnz, dtype=np.int64)
        threads = team_threads()[0] if threads is None else threads
        extra = () if flat is None else flat.arguments(len(self.tasks), self._nnz)
        bad, squares = _KERNEL.reply_check(self.tasks, self._scratch, threads, os.getpid() == _KERNEL_PID, *extra)
        if bad >= 0:
            self._scratch = None
            kind, buf, nnz, b, numel = self.tasks[bad][:5]
            name = self.names[bad]
            if kind == 0:
                decode_positions(bytes(buf), nnz, b, numel, name)  # raises, naming what is wrong
                raise PayloadError(name, "invalid position stream")
            raise PayloadError(name, "decoded values are not all finite")
        cost = [t[2] if t[0] == 0 else t[4] // 4 for t in self.tasks]  # scattered adds cost ~4 dense ones
        self._order = sorted(range(len(self.tasks)), key=lambda i: -cost[i])
        return float(squares)

    def decoded_positions(self) -> np.ndarray:
        """After :meth:`check`: the kept positions of every :meth:`positions` tensor, in the
        order given, back to back (each tensor's ascending, within the tensor)."""
        if self._scratch is None:
            raise RuntimeError("ScatterSum.decoded_positions before a successful check()")
        return self._scratch

    def parts(self) -> Iterator[tuple[str, np.ndarray | None, np.ndarray | float]]:
        """After :meth:`check`: each tensor as ``(name, positions, values)``: an SBC tensor's kept
        positions (a view of the scratch) and its one value, a dense tensor's ``None`` (every
        position) and its float32 values (a view of its buffer)."""
        scratch = self.decoded_positions()
        for name, (kind, buf, nnz, _, numel, offset, value) in zip(self.names, self.tasks, strict=True):
            if kind == 0:
                yield name, scratch[offset : offset + nnz], value
            else:
                yield name, None, np.frombuffer(buf, dtype="<f4", count=numel)

    def add_into(self, weight: float, outs: Sequence[np.ndarray], threads: int | None = None) -> None:
        """``outs[i] += weight * tensor i`` (flat float64 arrays in the order of :attr:`names`,
        each a buffer of its own), after :meth:`check`; the tensors largest first on ``threads``
        threads (default ``torch.get_num_threads()``: the scattered adds wait on memory, and two
        threads keep twice as many of them in flight)."""
        if self._scratch is None:
            raise RuntimeError("ScatterSum.add_into before a successful check()")
        assert _KERNEL is not None
        if len(outs) != len(self.tasks):
            raise ValueError(f"add_into: {len(outs)} outputs for {len(self.tasks)} tensors")
        threads = torch.get_num_threads() if threads is None else threads
        tasks, ordered = [self.tasks[i] for i in self._order], [outs[i] for i in self._order]
        _KERNEL.reply_add(tasks, self._scratch, weight, ordered, threads, os.getpid() == _KERNEL_PID)
