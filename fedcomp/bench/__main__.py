"""Codec benchmark over a ResNet-50-shaped update.

    python -m fedcomp.bench codecs [--device cpu|cuda] [--json PATH] [--repeat N] [--values sgd|student-t]
                                   [--scope update|per-tensor|both] [--case CASE ...]

The update has ResNet-50's 161 real parameter tensors (25.6M float32 values). By default its
values are a real model delta: ResNet-50 takes ``--sgd-steps`` SGD steps (lr 0.1, momentum 0.9,
batch 16) on 64x64 images (MNIST digits tiled to 3 channels when ``FEDCOMP_DATA_DIR`` has MNIST,
else Gaussian images with random labels), and the update is weights after minus weights before.
``--values student-t`` instead draws each tensor from a Student-t (df 3) scaled by 1/sqrt(fan-in).

Each codec is timed two ways (``scope``): ``update``, the library's whole-update path
(``UpdateEncoder.encode_to_bytes`` / ``decode_update_bytes``), and ``per-tensor``, the codec's own ``encode`` /
``decode`` called once per tensor. For each codec, scope and op it reports the median wall time
over ``--repeat`` runs and, beside it, reference operations on the same tensors timed right before
each run: a warm ``copy_`` into preallocated buffers (``copy_median_s``, ``copy_ratio``: one
memory pass, what the targets are read against; ``copy_best_ratio``, ``best x`` in the table:
the least op time over the least ``copy_`` time, what an idle machine shows), ``clone()`` (``clone_median_s``, ``ratio``: the
older reference, whose time swings with the allocator's state) and, for dense-fp16, ``half()``
(``half_median_s``, ``half_ratio``). Each ratio is the median of the per-run ratios: ratios
travel between machines better than seconds. ``target_ratio`` is the ratio issue #13 sets for
that codec (CPU or GPU), read against the column ``target_vs`` names; it is printed for reading,
and the command exits 0 whatever the ratio (BENCHMARKS.md records which targets are met).
Each row also records which C kernels (``fedcomp._native``) ran: ``FEDCOMP_NATIVE=0`` times the
NumPy paths instead. The op is timed as a sender or receiver runs it round after round: the
previous output is released before the next is made (a large output then reuses its memory:
``fedcomp.wire.fast_writer``), and an all-dense update of tensors already seen is written and
read in one call of the wire kernel (``fedcomp.wire.serde.DenseFrames``; the untimed warm-up run
makes the frames, as a client's or server's first round does).
``encode`` is tensors -> wire bytes (protobuf serialized), ``decode`` is wire bytes -> tensors on
the device; tensors below 1000 elements go dense, as in 3LC. In the ``update`` scope ``decode``
writes into buffers the receiver keeps from round to round (``decode_update_bytes(..., out=)``:
warm memory, as ``copy_`` writes; the row the targets are read on) and ``decode-new`` into new
tensors (each call's first-touch page faults of about 100 MB included; no target).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

import fedcomp._native as native
from fedcomp.bench import int_at_least, write_rows
from fedcomp.codecs import Codec, get_codec
from fedcomp.codecs.base import TensorSpec
from fedcomp.codecs.flat import Layout
from fedcomp.methods.update import UpdateEncoder, decode_update_bytes, specs_of
from fedcomp.wire import serde
from fedcomp.wire.payloads import EncodedUpdate

#: The codecs benchmarked, and the ratio targets (CPU, GPU) issue #13 sets: SBC and 3LC against a
#: warm ``copy_`` of the whole update, dense-fp16 against ``tensor.half()`` of it (CPU only).
CASES: list[tuple[dict, tuple[float | None, float | None] | None]] = [
    ({"id": "sbc", "p": 0.01, "mode": "fast"}, (3.0, 3.0)),
    ({"id": "sbc", "p": 0.01, "mode": "exact"}, None),
    ({"id": "3lc", "s": 1.0}, (4.0, 3.0)),
    ({"id": "3lc", "s": 1.9}, None),
    ({"id": "dense-fp16"}, (1.5, None)),
    ({"id": "dense-fp32"}, None),
]

#: The two ways an update is coded: ``update`` is the library's whole-update path
#: (:meth:`UpdateEncoder.encode_to_bytes` / :func:`decode_update_bytes`), ``per-tensor`` calls the codec's own
#: ``encode``/``decode`` once per tensor (what a user of one codec does).
SCOPES = ("update", "per-tensor")

T = TypeVar("T")


def make_update(values: str, device: torch.device, sgd_steps: int, seed: int) -> dict[str, torch.Tensor]:
    from fedcomp.bench.resnet50 import ResNet50

    torch.manual_seed(seed)
    model = ResNet50()
    if values == "student-t":
        dist = torch.distributions.StudentT(3.0)  # seeded by torch.manual_seed above
        out = {}
        for name, p in model.named_parameters():
            fan_in = max(1, p[0].numel()) if p.dim() > 1 else p.numel()
            out[name] = (dist.sample(p.shape) * (1e-3 / fan_in**0.5)).to(device)
        return out
    x, y = _images(16 * sgd_steps, seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    for i in range(sgd_steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[i * 16 : (i + 1) * 16]), y[i * 16 : (i + 1) * 16])
        loss.backward()
        opt.step()
    return {n: (p.detach() - before[n]).to(device) for n, p in model.named_parameters()}


def _images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    from fedcomp.app.data import DataError, load_idx_dataset  # the reference app's loader

    try:
        train = load_idx_dataset("mnist").train
    except DataError:  # no data folder: Gaussian images, random labels
        print("note: no MNIST under $FEDCOMP_DATA_DIR: the SGD steps use Gaussian images", file=sys.stderr)
        return torch.randn(n, 3, 64, 64, generator=gen), torch.randint(0, 1000, (n,), generator=gen)
    x = torch.nn.functional.interpolate(train.x[:n], size=64).repeat(1, 3, 1, 1)
    return x, train.y[:n]


def _clock(fn: Callable[[], T], device: torch.device) -> tuple[float, T]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


class _Baselines:
    """The reference operations timed beside each codec run, on the same tensors.

    ``copy``: a warm ``copy_`` of every tensor into preallocated buffers (one memory pass; what
    the targets are read against). ``clone``: ``clone()`` of every tensor (the older reference,
    kept for comparison: its time swings with the allocator's state). ``half``: ``half()`` of
    every tensor (what a dense fp16 codec cannot beat).
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.buffers = [torch.empty_like(t) for t in tensors]

    def copy(self) -> None:
        for buf, t in zip(self.buffers, self.tensors, strict=True):
            buf.copy_(t)

    def clone(self) -> list[torch.Tensor]:
        return [t.clone() for t in self.tensors]

    def half(self) -> list[torch.Tensor]:
        return [t.half() for t in self.tensors]


class Paired(NamedTuple):
    """What :func:`_paired` measured: medians, per-reference medians and median pair ratios,
    and the best (least) times, which a shared machine inflates least."""

    median: float
    ref_median: dict[str, float]
    ref_ratio: dict[str, float]
    out: object
    best: float
    ref_best: dict[str, float]


def _paired(fn: Callable[[], T], refs: dict[str, Callable[[], object]], device: torch.device, repeat: int) -> Paired:
    """Median op time, and per reference its median time and the median of the per-pair ratios;
    and the least time of the op and of each reference.

    Each repetition times the references right before the op, so all see the same machine load;
    the median of those pairwise ratios is what the targets are read against (robust to a noisy,
    shared machine). On a busy machine torch's multi-threaded ``copy_`` can stall for a
    scheduler time slice per tensor (its OpenMP threads wait for a descheduled peer), so the
    least times are reported beside: ``best_s / copy_best_s`` is what an idle machine shows.
    """
    out = fn()  # warm-up (allocator, caches, lazy init)
    for ref in refs.values():
        ref()
    ops: list[float] = []
    times: dict[str, list[float]] = {k: [] for k in refs}
    ratios: dict[str, list[float]] = {k: [] for k in refs}
    for _ in range(repeat):
        for k, ref in refs.items():
            times[k].append(_clock(ref, device)[0])
        del out  # as a sender between rounds: the last output is gone before the next is made
        t, out = _clock(fn, device)
        ops.append(t)
        for k in refs:
            ratios[k].append(t / times[k][-1])
    med = statistics.median
    return Paired(
        med(ops),
        {k: med(v) for k, v in times.items()},
        {k: med(v) for k, v in ratios.items()},
        out,
        min(ops),
        {k: min(v) for k, v in times.items()},
    )


def _encode(enc: UpdateEncoder, update: dict[str, torch.Tensor]) -> bytes:
    return enc.encode_to_bytes(update)


def _decode(
    data: bytes,
    specs: list[TensorSpec],
    codecs: list[Codec],
    device: torch.device,
    out: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    return decode_update_bytes(data, specs, codecs, device, out=out)[1]


def _encode_per_tensor(enc: UpdateEncoder, update: dict[str, torch.Tensor]) -> bytes:
    """Each tensor through its codec's own ``encode`` (the per-tensor public API)."""
    tensors = tuple(
        (enc.small_codec if t.numel() < enc.min_numel else enc.codec).encode(t, name) for name, t in update.items()
    )
    return serde.update_to_bytes(EncodedUpdate(base_model_version=0, tensors=tensors))


def _decode_per_tensor(
    data: bytes, specs: list[TensorSpec], codecs: list[Codec], device: torch.device
) -> dict[str, torch.Tensor]:
    """Each tensor through its codec's own ``decode``."""
    by_id = {c.codec_id: c for c in codecs}
    update = serde.update_from_bytes(data)
    return {s.name: by_id[e.codec_id].decode(e, s, device) for s, e in zip(specs, update.tensors, strict=True)}


def bench_codecs(
    device: torch.device,
    repeat: int,
    values: str,
    sgd_steps: int,
    seed: int,
    scopes: tuple[str, ...] = SCOPES,
    cases: tuple[str, ...] | None = None,
) -> list[dict]:
    print(f"making a ResNet-50 update ({values}) on {device} ...", file=sys.stderr)
    update = make_update(values, device, sgd_steps, seed)
    numel = sum(t.numel() for t in update.values())
    specs = specs_of(update)
    base = _Baselines(list(update.values()))
    if device.type == "cpu":  # a receiver's own
        buffers = {s.name: torch.empty(s.shape, dtype=s.dtype, device=device) for s in specs}
    else:  # one buffer, as a GPU client keeps its replica (fedcomp.flower.records.tensors_to_device)
        buffers = Layout.of(update).views(torch.empty(numel, dtype=torch.float32, device=device))

    rows = []
    for cfg, target in CASES:
        if cases is not None and case_label(cfg) not in cases:
            continue
        codec: Codec = get_codec(cfg)
        enc = UpdateEncoder(codec, error_feedback=False)
        fp16 = codec.codec_id == "dense-fp16"
        refs: dict[str, Callable[[], object]] = {"copy": base.copy, "clone": base.clone}
        if fp16:
            refs["half"] = base.half
        for scope in scopes:
            encoder, decoder = (_encode, _decode) if scope == "update" else (_encode_per_tensor, _decode_per_tensor)
            enc_times = _paired(functools.partial(encoder, enc, update), refs, device, repeat)
            data = enc_times.out
            assert isinstance(data, bytes)
            decode = functools.partial(decoder, data, specs, [codec, enc.small_codec], device)
            timed = [("encode", enc_times)]
            if scope == "update":  # into the receiver's buffers (as copy_ writes), and into new tensors
                into = functools.partial(_decode, data, specs, [codec, enc.small_codec], device, buffers)
                timed += [
                    ("decode", _paired(into, refs, device, repeat)),
                    ("decode-new", _paired(decode, refs, device, repeat)),
                ]
            else:
                timed.append(("decode", _paired(decode, refs, device, repeat)))
            for op, (med, ref_med, ref_ratio, _, best, ref_best) in timed:
                tgt = None if target is None or op == "decode-new" else target[0 if device.type == "cpu" else 1]
                rows.append(
                    {
                        "codec": codec.codec_id,
                        "config": cfg,
                        "scope": scope,
                        "op": op,
                        "device": str(device),
                        "numel": numel,
                        "median_s": med,
                        "copy_median_s": ref_med["copy"],
                        "copy_ratio": ref_ratio["copy"],
                        "best_s": best,
                        "copy_best_s": ref_best["copy"],
                        "copy_best_ratio": best / ref_best["copy"],
                        "clone_median_s": ref_med["clone"],
                        "ratio": ref_ratio["clone"],
                        **({"half_median_s": ref_med["half"], "half_ratio": ref_ratio["half"]} if fp16 else {}),
                        "target_ratio": tgt,
                        "target_vs": None if tgt is None else "half_ratio" if fp16 else "copy_ratio",
                        "bytes": len(data),
                        "bits_per_value": 8 * len(data) / numel,
                        "kernels": native.status(),
                    }
                )
                _print_row(rows[-1])
    return rows


def case_label(cfg: dict) -> str:
    """A case's name for ``--case``: the codec id and its settings, e.g. ``sbc:p=0.01,mode=fast``."""
    settings = ",".join(f"{k}={v}" for k, v in cfg.items() if k != "id")
    return f"{cfg['id']}:{settings}" if settings else cfg["id"]


def _print_row(r: dict) -> None:
    # The target is part of the report (the ratio it is read against), not a verdict on this run:
    # one noisy shared machine's ratio is not a pass or a fail; BENCHMARKS.md says which are met.
    label = ",".join(f"{k}={v}" for k, v in r["config"].items() if k != "id")
    vs = r.get("target_vs") or "copy_ratio"
    tgt = "" if r["target_ratio"] is None else f"<= {r['target_ratio']:g}x {vs.split('_')[0]}"
    copy = r.get("copy_median_s")
    copy_cols = "" if copy is None else f"{copy * 1e3:9.1f} ms{r['copy_ratio']:7.2f}x"
    best = r.get("copy_best_ratio")
    copy_cols += "" if best is None else f"{best:7.2f}x"
    half = r.get("half_ratio")
    print(
        f"{r['codec']:<11}{label:<18}{r.get('scope', 'update'):<11}{r['op']:<11}{r['device']:<6}"
        f"{r['median_s'] * 1e3:9.1f} ms{copy_cols}"
        f"{r['clone_median_s'] * 1e3:9.1f} ms{r['ratio']:7.2f}x"
        f"{'' if half is None else f'{half:6.2f}x':>8} {r['bytes']:>11,d} B"
        f"{r['bits_per_value']:8.3f}  {tgt}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["links"]:  # its own options: fedcomp/bench/links.py
        from fedcomp.bench.links import main as links_main

        return links_main(argv[1:])
    if argv[:1] == ["netns"]:  # its own options: fedcomp/bench/netns.py
        from fedcomp.bench.netns import main as netns_main

        return netns_main(argv[1:])
    if argv[:1] == ["gradiveq"]:  # its own options: fedcomp/bench/gradiveq.py
        from fedcomp.bench.gradiveq import main as gradiveq_main

        return gradiveq_main(argv[1:])
    if argv[:1] == ["deft"]:  # its own options: fedcomp/bench/deft.py
        from fedcomp.bench.deft import main as deft_main

        return deft_main(argv[1:])
    if argv[:1] == ["device-work"]:  # its own options: fedcomp/bench/device_work.py
        from fedcomp.bench.device_work import main as device_work_main

        return device_work_main(argv[1:])
    if argv[:1] == ["server"]:  # its own options: fedcomp/bench/server.py
        from fedcomp.bench.server import main as server_main

        return server_main(argv[1:])
    if argv[:1] == ["rounds"]:  # its own options: fedcomp/bench/rounds.py
        from fedcomp.bench.rounds import main as rounds_main

        return rounds_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="python -m fedcomp.bench",
        description="fedcomp's benchmarks, one command each (`python -m fedcomp.bench COMMAND --help` says what "
        "it measures; README.md, Benchmarks, gives the figures).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("links", help="dense FedAvg vs SBC+3LC on emulated 10M/100M/1G links (see --help after it)")
    sub.add_parser("netns", help="dense FedAvg vs SBC+3LC over real tc-shaped links in network namespaces (root)")
    sub.add_parser("deft", help="DEFT vs per-client top-k: aggregate density and selection time (see --help after it)")
    sub.add_parser("server", help="N clients' SBC payloads through the wrapper's aggregation: time, peak RSS, error")
    sub.add_parser("rounds", help="the Flower layer's own time per round (wrapper, mod) beside plain FedAvg")
    sub.add_parser("device-work", help="a whole update's operators, syncs and copies on a device, by number of tensors")
    sub.add_parser("gradiveq", help="GradiVeQ on real LeNet5-Caffe updates: d, k, ratio, held-out loss, timings")
    c = sub.add_parser("codecs", help="encode/decode time vs a warm copy_ of a ResNet-50-shaped update")
    c.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    c.add_argument("--json", type=Path, help="write the rows as a JSON list to this path")
    c.add_argument("--repeat", type=int_at_least(1), default=5)
    c.add_argument("--values", choices=["sgd", "student-t"], default="sgd")
    c.add_argument("--sgd-steps", type=int_at_least(1), default=2)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--scope", choices=[*SCOPES, "both"], default="both", help="whole-update path, per-tensor codec calls, or both"
    )
    labels = [case_label(cfg) for cfg, _ in CASES]
    c.add_argument(
        "--case",
        action="append",
        choices=labels,
        metavar="CASE",
        help=f"run only this case (repeatable; default all): {', '.join(labels)}",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    kernels = ", ".join(f"{k} {'on' if v else 'off'}" for k, v in native.status().items())
    wire = native.load("wire")
    if wire is not None:  # which CRC and casts the wire kernel uses (the table CRC: not used)
        features = wire.features()
        kernels += f" (crc {features['crc']}, f16c {'on' if features['f16c'] else 'off'})"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; C kernels: {kernels}", file=sys.stderr)
    print(
        f"{'codec':<11}{'settings':<18}{'scope':<11}{'op':<11}{'dev':<6}{'median':>12}{'copy_':>12}{'x copy':>7}{'best x':>7}"
        f"{'clone':>12}{'x clone':>7}{'x half':>8}{'bytes':>14}{'bits/val':>8}  target"
    )
    scopes = SCOPES if args.scope == "both" else (args.scope,)
    cases = None if args.case is None else tuple(args.case)
    rows = bench_codecs(torch.device(args.device), args.repeat, args.values, args.sgd_steps, args.seed, scopes, cases)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
