"""What a whole update costs a device: operators, syncs and copies, by path and number of tensors.

    python -m fedcomp.bench device-work [--device cpu|cuda] [--codec sbc|3lc|both] [--p 0.01] [--copies 1,2,4]
                                        [--shrink N] [--repeat N] [--profile] [--json PATH]

Issue #13 measured one SBC encode of a ResNet-50 update on an H100 at 2,433 kernel launches,
1,035 host-device copies and 278 ``.item()`` syncs: a cost per tensor, not per value. This
command encodes (with error feedback, as a client does: :class:`UpdateEncoder`) and decodes an
update of ResNet-50's tensors (Student-t values, as ``bench codecs --values student-t``), repeated
``--copies`` times under new names (161, 322, 644 tensors), and counts inside one call
(:func:`fedcomp.codecs.flat.count_device_work`): ``ops``, torch operators that compute (each one
or more kernel launches on CUDA; views and bare allocations left out), ``syncs``, those the host
waits for (``.item()``, ``nonzero``, copies to the host), and ``to_host`` / ``to_device``, the
copies the engine makes; and ``host_s``, the median over ``--repeat`` uncounted calls of the time
spent in the engine's host work (:func:`fedcomp.codecs.flat.time_host_work`: per tensor the side,
mean and Golomb code, the zero runs, the envelopes; a decode's checks and stream reads), which a
GPU does not overlap and which does not depend on the device, so that ``--device cpu`` measures a
GPU host's share on this CPU (the protobuf serialisation and parse around the engine are not in
it). Paths:

- ``whole-update``: :mod:`fedcomp.methods.flat_update` (what :class:`UpdateEncoder` and
  :func:`decode_update` run on a GPU). On ``--device cpu`` it is run on the CPU on purpose (the
  library's CPU path is the C kernels, which launch nothing): the same operators as on CUDA, so
  the counts are CUDA's; the times are not.
- ``per-tensor`` (``--device cuda`` only): the path before it, a codec call per tensor, whose
  copies are counted as torch operators (``aten._to_copy``) rather than by the engine's helpers.

``--shrink N`` keeps each tensor's first ``1/N`` of its values, at least 1,000 (the engines' least:
``min_numel``; flat, so the 161 tensors stay and the values fall about ``N``-fold): what a call
costs whatever its values (launches, syncs, the host's Python and per-tensor work), apart from
what moving and coding the values costs; a row's ``numel`` says what was left. (SBC's fast mode
takes only tensors above its sample size: a tensor cut below it goes exact mode, another set of
operators, so an SBC row's ``ops`` can differ from the whole update's; 3LC's are the same.)

``seconds`` is the median wall time of ``--repeat`` calls after a warm-up (CUDA synchronized);
``same_bytes`` says whether the bytes equal the CPU path's. Counts are the second round's (the
residual buffer and the sample positions are kept from round to round).

``--profile`` (CUDA only) also counts, with ``torch.profiler``, what the CUDA runtime saw in one
more call: ``launches`` (kernel launches), ``memcpys`` (host-device and device-device copy calls),
``stream_syncs`` (calls that block the host: stream, event and device synchronisations) and the
time on the GPU (``gpu_s``, the sum of the kernels' and copies' times); ``profile_top`` is the
ten operators of most host time, and the table printed is sorted by GPU time. These are the units
issue #13's profile was read in.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedcomp.bench import float_in, int_at_least, int_list, write_rows
from fedcomp.bench.__main__ import _clock, make_update  # (the codecs bench's update and clock)
from fedcomp.codecs import SBC, Codec, DenseFP32, TensorSpec, ThreeLC
from fedcomp.codecs.flat import DeviceWork, count_device_work, time_host_work
from fedcomp.methods.flat_update import decode_on_device, encode_on_device
from fedcomp.methods.update import DEFAULT_MIN_NUMEL, UpdateEncoder, decode_update, specs_of
from fedcomp.wire.payloads import EncodedUpdate


def _update(copies: int, seed: int, shrink: int = 1) -> dict[str, torch.Tensor]:
    base = make_update("student-t", torch.device("cpu"), 1, seed)
    if shrink > 1:  # (tensors below the engines' least stay whole: they go dense either way)
        base = {
            name: t.reshape(-1)[: max(DEFAULT_MIN_NUMEL, t.numel() // shrink)] if t.numel() >= DEFAULT_MIN_NUMEL else t
            for name, t in base.items()
        }
    return {f"c{c}.{name}": t.clone() for c in range(copies) for name, t in base.items()}


def _row(work: DeviceWork, **fields: Any) -> dict[str, Any]:
    return {
        **fields,
        "ops": work.ops,
        "syncs": work.syncs,
        "to_host": work.to_host,
        "to_device": work.to_device,
        "top_ops": dict(sorted(work.by_op.items(), key=lambda kv: -kv[1])[:6]),
    }


def _encode(
    path: str, enc: UpdateEncoder, update: dict[str, torch.Tensor], device: torch.device, version: int
) -> EncodedUpdate | None:
    if path == "per-tensor":  # a per-tensor codec for each large tensor: the path before the engine
        large = {n: enc.codec for n, t in update.items() if t.numel() >= enc.min_numel}
        return enc.encode(update, version, codecs=large)
    found = encode_on_device(update, enc.codec, enc.small_codec, enc.min_numel, enc.feedback, version, device=device)
    return None if found is None else found[0]


def _decode(
    path: str, update: EncodedUpdate, specs: list[TensorSpec], codecs: list[Codec], device: torch.device
) -> dict[str, torch.Tensor] | None:
    if path == "per-tensor":
        by_id = {c.codec_id: c for c in codecs}
        return {s.name: by_id[e.codec_id].decode(e, s, device) for s, e in zip(specs, update.tensors, strict=True)}
    return decode_on_device(update, specs, codecs, device)


def _profile(fn: Callable[[], object], device: torch.device) -> dict[str, Any]:
    """The CUDA runtime's calls and the GPU's time in one call of ``fn`` (see the module doc)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    counts = {"launches": 0, "memcpys": 0, "stream_syncs": 0}
    gpu_us = 0.0
    for e in prof.events():
        name = e.name
        if name.startswith(("cuda", "cu")) and "LaunchKernel" in name:
            counts["launches"] += 1
        elif name.startswith(("cudaMemcpy", "cuMemcpy")):
            counts["memcpys"] += 1
        elif name.startswith(("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")):
            counts["stream_syncs"] += 1
        if e.device_type == torch.autograd.DeviceType.CUDA:
            gpu_us += e.device_time
    counts["stream_syncs"] -= 1  # (the synchronize above that closes the window)
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
    print(table, file=sys.stderr)
    top = sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[:10]
    return {
        **counts,
        "gpu_s": gpu_us * 1e-6,
        "profile_top": {a.key: round(a.self_cpu_time_total * 1e-6, 6) for a in top},
    }


def _median_seconds(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    return statistics.median(_clock(fn, device)[0] for _ in range(repeat))


def _host_seconds(fn: Callable[[], object], path: str, repeat: int) -> float | None:
    """The median time of ``fn``'s host work (:func:`time_host_work`) over ``repeat`` calls; None
    on the per-tensor path, which marks none."""
    if path != "whole-update":
        return None
    times = []
    for _ in range(repeat):
        with time_host_work() as clock:
            fn()
        times.append(clock.seconds)
    return statistics.median(times)


def bench_device_work(
    device: torch.device,
    p: float,
    copies: list[int],
    repeat: int,
    seed: int,
    codec_ids: list[str],
    profile: bool = False,
    shrink: int = 1,
) -> list[dict]:
    rows = []
    for codec_id in codec_ids:
        codec: Codec = SBC(p) if codec_id == "sbc" else ThreeLC(1.0)
        rows += _bench_codec(device, codec, copies, repeat, seed, profile, shrink)
    return rows


def _bench_codec(
    device: torch.device, codec: Codec, copies: list[int], repeat: int, seed: int, profile: bool, shrink: int
) -> list[dict]:
    codecs: list[Codec] = [codec, DenseFP32()]
    rows = []
    for c in copies:
        host = _update(c, seed, shrink)
        update = {k: v.to(device) for k, v in host.items()}
        specs = specs_of(host)
        reference = UpdateEncoder(codec)  # the CPU path, for the bytes
        ref = [reference.encode(host, 0), reference.encode(host, 1)]
        shape = {
            "codec": codec.get_config(),
            "device": str(device),
            "tensors": len(update),
            "numel": sum(t.numel() for t in host.values()),
            "shrink": shrink,
        }
        for path in ["whole-update"] + (["per-tensor"] if device.type == "cuda" else []):
            enc = UpdateEncoder(codec)
            first = _encode(path, enc, update, device, 0)
            with count_device_work() as work:
                second = _encode(path, enc, update, device, 1)
            assert second is not None
            # (later rounds: the residuals move on; the work is the same)
            later = functools.partial(_encode, path, enc, update, device, 2)
            seconds = _median_seconds(later, device, repeat)
            host_s = _host_seconds(later, path, repeat)
            rows.append(
                _row(
                    work,
                    op="encode",
                    path=path,
                    **shape,
                    seconds=seconds,
                    host_s=host_s,
                    same_bytes=[first, second] == ref,
                )
            )
            if profile:
                rows[-1].update(_profile(later, device))
            print(_line(rows[-1]), file=sys.stderr)

            decode = functools.partial(_decode, path, second, specs, codecs, device)
            decode()
            with count_device_work() as work:
                got = decode()
            assert got is not None
            want = decode_update(second, specs, codecs, "cpu")
            equal = all(torch.equal(got[k].cpu(), want[k]) for k in want)
            seconds = _median_seconds(decode, device, repeat)
            host_s = _host_seconds(decode, path, repeat)
            rows.append(_row(work, op="decode", path=path, **shape, seconds=seconds, host_s=host_s, same_bytes=equal))
            if profile:
                rows[-1].update(_profile(decode, device))
            print(_line(rows[-1]), file=sys.stderr)
    return rows


def _line(r: dict[str, Any]) -> str:
    runtime = (
        ""
        if "launches" not in r
        else f"  launches {r['launches']:>5}  memcpys {r['memcpys']:>5}  stream syncs {r['stream_syncs']:>4}"
        f"  gpu {r['gpu_s'] * 1e3:7.2f} ms"
    )
    return (
        f"{r['codec']['id']:<5}{r['op']:<7}{r['path']:<13}{r['device']:<6}{r['tensors']:>6} tensors {r['numel']:>11,} values"
        f"  ops {r['ops']:>5}  syncs "
        f"{r['syncs']:>4}  to host {r['to_host']:>4}  to device {r['to_device']:>4}  {r['seconds'] * 1e3:9.1f} ms  "
        f"host {'-' if r['host_s'] is None else format(r['host_s'] * 1e3, '6.2f')} ms  "
        f"same as CPU: {r['same_bytes']}{runtime}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedcomp.bench device-work", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--codec", choices=["sbc", "3lc", "both"], default="both", help="SBC (--p), 3LC (s = 1), or both")
    ap.add_argument("--p", type=float_in(0.0, 0.5, lo_open=True), default=0.01, help="SBC's p, in (0, 0.5]")
    ap.add_argument("--copies", type=int_list(1), default=[1, 2, 4], help="the update this many times (1,2,4)")
    ap.add_argument(
        "--shrink", type=int_at_least(1), default=1, help="each tensor's first 1/N of its values (at least 1,000)"
    )
    ap.add_argument("--repeat", type=int_at_least(1), default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="CUDA only: count the runtime's launches, copies and syncs")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    if args.profile and args.device != "cuda":
        ap.error("--profile: counts the CUDA runtime's calls, so it needs --device cuda")
    codec_ids = ["sbc", "3lc"] if args.codec == "both" else [args.codec]
    rows = bench_device_work(
        torch.device(args.device), args.p, args.copies, args.repeat, args.seed, codec_ids, args.profile, args.shrink
    )
    write_rows(args.json, rows)
    return 0
