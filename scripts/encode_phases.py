"""Where a whole-update encode's time goes, phase by phase (a diagnostic for a lent GPU; issue #13).

    python scripts/encode_phases.py [--device cuda] [--repeat 11] [--shrink N]

For SBC p = 0.01 and 3LC s = 1, without and with error feedback, on the benchmark's ResNet-50 update
(``fedcomp.bench codecs``' SGD steps), ``UpdateEncoder.encode_to_bytes`` is timed whole (the host
waits for the device after each) beside a warm per-tensor ``copy_`` of the update, and the time
spent inside its phases is added up by wrapping the library's own functions: the layout's copy,
the waits for the device, the SBC sides and Golomb codes (and their C kernel), the 3LC zero runs
on the host, the small tensors, the error feedback's copy back, the writer. Variants run in turns
in one process: SBC with and without CUDA graphs (``FEDCOMP_CUDA_GRAPHS``), 3LC with its zero runs
coded on the device and on the host (``threelc_device.ZERO_RUNS_ON_DEVICE``). Off a GPU the update
goes the CPU's per-tensor path and only the writer's phase shows; with ``--engine`` it goes the
whole-update engine on the CPU (what the tests compare with the per-tensor path): the device's
part then runs on the CPU, slowly, and the host's phases are those a GPU host runs.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from fedcomp.bench.__main__ import make_update
from fedcomp.codecs import SBC, ThreeLC, sbc_device, threelc_device
from fedcomp.codecs import flat as flat_mod
from fedcomp.codecs.flat import time_host_work
from fedcomp.methods import flat_update
from fedcomp.methods import update as update_mod

SPENT: collections.defaultdict[str, float] = collections.defaultdict(float)


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[label] += time.perf_counter() - start

    return wrapper


def _wrap_phases() -> None:
    for module, name, label in [
        (flat_update, "_laid_out", "laid_out"),
        (flat_update, "_encode_small", "small"),
        (flat_update, "to_device_many", "feedback_copy"),
        (update_mod, "update_to_bytes", "writer"),
        (sbc_device, "_finish", "sbc_sides"),
        (sbc_device, "choose_sides_flat", "sbc_sides_kernel"),
        (threelc_device, "_bodies", "3lc_zero_runs_host"),
    ]:
        setattr(module, name, _timed(label, getattr(module, name)))
    flat_mod.Pending.wait = _timed("wait", flat_mod.Pending.wait)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--shrink", type=int, default=1, help="each tensor's first 1/N of its values")
    parser.add_argument("--engine", action="store_true", help="the whole-update engine on any device (even the CPU)")
    args = parser.parse_args()
    dev = torch.device(args.device)
    if args.engine:
        update_mod.encode_on_device = functools.partial(flat_update.encode_on_device, device=dev)  # type: ignore[assignment]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    update = make_update("sgd", dev, 2, 0)
    if args.shrink > 1:
        update = {k: v.reshape(-1)[: max(1000, v.numel() // args.shrink)] for k, v in update.items()}
    _wrap_phases()
    buffers = {k: torch.empty_like(v) for k, v in update.items()}

    def floor() -> None:
        for k, v in update.items():
            buffers[k].copy_(v)

    cases = [("sbc", SBC(0.01, "fast")), ("3lc", ThreeLC(1.0))]
    for feedback in (False, True):
        for name, codec in cases:
            enc = update_mod.UpdateEncoder(codec, error_feedback=feedback)
            for _ in range(4):
                enc.encode_to_bytes(update)
            variants = ("graphs", "eager", "graphs") if name == "sbc" else ("device", "host", "device", "host")
            for variant in variants:
                os.environ["FEDCOMP_CUDA_GRAPHS"] = "0" if variant == "eager" else "1"
                threelc_device.ZERO_RUNS_ON_DEVICE = variant != "host"
                for _ in range(2):
                    enc.encode_to_bytes(update)
                SPENT.clear()
                totals, floors = [], []
                with time_host_work() as host:
                    for _ in range(args.repeat):
                        sync()
                        start = time.perf_counter()
                        enc.encode_to_bytes(update)
                        sync()
                        totals.append(time.perf_counter() - start)
                        start = time.perf_counter()
                        floor()
                        sync()
                        floors.append(time.perf_counter() - start)
                total, base = statistics.median(totals) * 1e3, statistics.median(floors) * 1e3
                phases = " ".join(f"{k} {v / args.repeat * 1e3:.2f}" for k, v in sorted(SPENT.items()))
                label = f"{name}{'+ef' if feedback else ''} {variant}"
                print(
                    f"{label:<16} {total:6.2f} ms  copy_ {base:5.2f} ms  {total / base:5.2f}x | "
                    f"host_side {host.seconds / args.repeat * 1e3:.2f} | {phases}"
                )
    threelc_device.ZERO_RUNS_ON_DEVICE = True
    print("graphs:", sbc_device.GRAPHS.stats, threelc_device.GRAPHS.stats)


if __name__ == "__main__":
    main()
