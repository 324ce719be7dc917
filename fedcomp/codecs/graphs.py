"""The device part of a whole-update encode replayed as one CUDA graph per layout.

On a GPU host every torch operator costs the host tens of microseconds, whatever its size (an
H200 host, measured: issue #13's profile). The whole-update engines
(:mod:`fedcomp.codecs.sbc_device`, :mod:`fedcomp.codecs.threelc_device`) keep their count
fixed (about thirty-five an SBC encode, fifty a 3LC one), and nothing an encode does on the
device before its one copy to the host has a shape that depends on the values; so that part is
captured once per layout as a CUDA graph (``torch.cuda.CUDAGraph``) and every later encode of the
layout is three launches: its input copied into the graph's own, the replay, the copy of what the
host needs (on an H200, a ResNet-50 update's SBC encode took 3.73 ms eager, 3.50-3.55 ms replayed,
turns about in one process).

- The first encode of a layout runs eagerly (it fills the per-layout tables the graph reads, and
  most layouts an encoder meets once are never worth a capture); the second captures, after one
  run on a side stream (torch's advice: lazy initialisations happen outside the capture), and
  replays; later ones replay.
- Where a capture fails (an operator this torch cannot capture, say), the layout runs eagerly
  from then on, with one warning: the bytes are the same either way.
- Inputs and outputs are the graph's own buffers: a caller that keeps an output past the next
  encode of the layout copies it (:meth:`GraphCache.run` holds a lock until the caller is done).
- Each graph keeps its intermediates in a private memory pool for as long as the layout is among
  the last :data:`KEEP` of its engine: at its peak a few copies of the update (the input alone is
  one: 102 MB for a ResNet-50 update), beside the cache the eager path would keep anyway.
  ``FEDCOMP_CUDA_GRAPHS=0`` turns the graphs off (every encode then runs as the first).

On any other device (the CPU) the functions run as they are: the operators are the same, which is
how the tests on a machine without a GPU check the bytes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

#: Graphs kept per engine (an encoder meets one or two layouts a round: its large tensors and,
#: for the server's downlink, the model's).
KEEP = 2

#: What a captured function gives: the device tensors the caller reads (its outputs), and values
#: of the capture the replays share (sizes, say).
Outputs = tuple[tuple[torch.Tensor, ...], Any]


def enabled(device: torch.device) -> bool:
    """Whether encodes on ``device`` are replayed as graphs: CUDA, unless ``FEDCOMP_CUDA_GRAPHS=0``."""
    return device.type == "cuda" and os.environ.get("FEDCOMP_CUDA_GRAPHS", "1") != "0"


@dataclass
class _Entry:
    """One layout's graph: its static inputs and outputs, the tables it reads (kept alive: a graph
    reads the memory it was captured with), and a lock for its buffers."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    inputs: tuple[torch.Tensor, ...] = ()
    outputs: Outputs | None = None
    keep: tuple[Any, ...] = ()
    failed: bool = False


@dataclass
class GraphStats:
    """What a :class:`GraphCache` did: graphs captured, replays, captures that failed."""

    captured: int = 0
    replayed: int = 0
    failed: int = 0


class GraphCache:
    """The last :data:`KEEP` layouts' graphs of one engine."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.stats = GraphStats()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Drop every graph (and the device memory they hold)."""
        with self._lock:
            self._entries.clear()

    @contextlib.contextmanager
    def run(
        self,
        key: Hashable,
        fn: Callable[..., Outputs],
        inputs: Sequence[torch.Tensor],
        keep: Callable[[], tuple[Any, ...]],
    ) -> Iterator[Outputs | None]:
        """``fn(*inputs)`` by a replay of its graph for ``key`` (captured on the layout's second
        call), or None where the caller runs ``fn`` itself: off a CUDA device, on a layout's first
        call, after a failed capture. The outputs are the graph's buffers, the caller's until the
        block ends. ``keep``: the per-layout tables ``fn`` reads, fetched just before the capture
        and kept with the graph (a cache may drop them; the graph would then read freed memory)."""
        device = inputs[0].device
        if not enabled(device):
            yield None
            return
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry()
                while len(self._entries) > KEEP:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
        if entry is None or entry.failed:
            yield None
            return
        with entry.lock, torch.cuda.device(device):  # (a graph replays on its own device's stream)
            if entry.graph is None and not self._capture(entry, fn, inputs, keep):
                yield None
                return
            for static, given in zip(entry.inputs, inputs, strict=True):
                static.copy_(given)
            entry.graph.replay()
            self.stats.replayed += 1
            yield entry.outputs

    def _capture(
        self,
        entry: _Entry,
        fn: Callable[..., Outputs],
        inputs: Sequence[torch.Tensor],
        keep: Callable[[], tuple[Any, ...]],
    ) -> bool:
        device = inputs[0].device
        try:
            entry.keep = keep()
            statics = tuple(torch.empty_like(t) for t in inputs)
            for static, given in zip(statics, inputs, strict=True):
                static.copy_(given)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                fn(*statics)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outputs = fn(*statics)
        except Exception as e:  # (any: the layout then runs eagerly, as before graphs)
            entry.failed, entry.keep = True, ()
            self.stats.failed += 1
            warnings.warn(
                f"{self.name}: no CUDA graph for this layout ({type(e).__name__}: {e}); it runs eagerly",
                RuntimeWarning,
                stacklevel=4,
            )
            return False
        entry.graph, entry.inputs, entry.outputs = graph, statics, outputs
        self.stats.captured += 1
        return True
