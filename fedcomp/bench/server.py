"""Server aggregation benchmark: N clients' real SBC payloads through the real wrapper.

    python -m fedcomp.bench server --clients N [--model resnet50|lenet] [--p 0.01]
                                   [--path streaming|materialise] [--inner fedavg|fedavgm|fedadam]
                                   [--seed S] [--json PATH]

Each client's update is derived cheaply from one base update (a Student-t draw, df 3, scaled by
``1e-3 / sqrt(fan-in)`` per tensor): every tensor is rolled by a seeded per-client shift and
scaled by a per-client factor, so every client keeps different positions; each update is then
encoded for real (``UpdateEncoder`` with SBC at ``--p``, tensors under 1000 values dense fp32, as a
client does) and serialized to wire bytes. Weights (``num-examples``) differ per client.

The aggregation runs in a child process, so that its memory is its own: the child rebuilds the
global model, sets the wrapper up with ``configure_train`` (one node), builds one real Flower reply
``Message`` per client (the uplink record as ``compression_mod`` writes it) and times one call of
``CompressionStrategy.aggregate_train`` over all of them. ``seconds`` is that call alone (wall
time), ``cpu_seconds`` its CPU time (all threads; with ``--threads 1`` on a loaded machine, the
better estimate of the wall time on an idle core).
``peak_rss_bytes`` is the child's peak resident set during that call (Linux ``VmHWM``, reset
through ``/proc/self/clear_refs`` right before it, so it is the peak of the aggregation, not of the
setup): the whole process at its peak, with the interpreter, torch, the global model, the replica
and every reply's payload in it, not only what the aggregation adds (``rss_before_bytes`` is the
resident set right before the call, ``payload_bytes`` the payloads' total). Where ``clear_refs``
cannot be written, the process's lifetime peak (``ru_maxrss``) is reported and
``peak_rss_source`` says so.

``max_abs_diff`` compares the model the wrapper returns with a float64 reference computed here,
independently of the server's decoding: ``W + sum_i w_i sent_i / sum_i w_i`` with ``sent_i`` the
encoder's own reconstruction of client i's update. The model is float32, so no result can be
closer than half a float32 ulp of the reference: ``fp32_half_ulp`` is that bound (at the entry of
the largest one), ``max_ulps`` the largest difference in units of the reference's float32 ulp
(<= 0.5: correctly rounded), and ``update_scale`` the largest magnitude of the mean update, which
``max_abs_diff_vs_update`` divides by.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from fedcomp.bench import float_in, int_at_least, write_rows

MODELS = ("resnet50", "lenet")
PATHS = ("streaming", "materialise")
INNER = ("fedavg", "fedavgm", "fedadam")
#: Tensors under this many values go dense (the library's default ``min-compress-numel``).
MIN_NUMEL = 1000


# --- the model and the clients' updates ----------------------------------------------------------


def model_tensors(name: str, seed: int) -> dict[str, torch.Tensor]:
    """The global model W: ``name``'s freshly initialised parameters (deterministic in ``seed``)."""
    torch.manual_seed(seed)
    if name == "resnet50":
        from fedcomp.bench.resnet50 import ResNet50

        module: torch.nn.Module = ResNet50()
    elif name == "lenet":
        from fedcomp.app.models import LeNet5Caffe

        module = LeNet5Caffe()
    else:
        raise ValueError(f"model: {name!r} is not one of {MODELS}")
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def base_update(model: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """One update of the model's shapes: Student-t (df 3) values scaled by ``1e-3 / sqrt(fan-in)``
    (heavy tails, as real gradients have; the codecs benchmark's ``--values student-t``)."""
    gen = torch.Generator().manual_seed(seed + 1)
    out = {}
    for name, w in model.items():
        fan_in = max(1, w[0].numel()) if w.dim() > 1 else w.numel()
        # Student-t df 3 as normal / sqrt(chi2_3 / 3), drawn from the seeded generator.
        z = torch.randn(w.shape, generator=gen)
        chi2 = torch.randn((3, *w.shape), generator=gen).pow(2).sum(0)
        out[name] = z / (chi2 / 3).sqrt() * (1e-3 / fan_in**0.5)
    return out


def weight_of(client: int) -> int:
    """Client ``client``'s ``num-examples`` (unequal, so the weighted mean is exercised)."""
    return 50 + (37 * client) % 101


def client_update(
    base: dict[str, torch.Tensor], client: int, seed: int, out: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Client ``client``'s update: each tensor of ``base`` rolled by a seeded shift and scaled by a
    seeded factor in [0.5, 1.5) (one pass over the model instead of a fresh random draw), written
    into ``out`` when given (buffers of ``base``'s shapes)."""
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + client)
    out = out if out is not None else {k: torch.empty_like(v) for k, v in base.items()}
    for name, t in base.items():
        n = t.numel()
        shift = int(torch.randint(0, n, (1,), generator=gen))
        scale = 0.5 + float(torch.rand((), generator=gen))
        src, dst = t.reshape(-1), out[name].view(-1)
        torch.mul(src[: n - shift], scale, out=dst[shift:])  # dst = roll(src, shift) * scale
        torch.mul(src[n - shift :], scale, out=dst[:shift])
    return out


# --- payload file: length-prefixed wire bytes ----------------------------------------------------


def _write_payload(f: Any, data: bytes) -> None:
    f.write(struct.pack("<Q", len(data)))
    f.write(data)


def _read_payloads(path: Path) -> Iterator[bytes]:
    with path.open("rb") as f:
        while head := f.read(8):
            (n,) = struct.unpack("<Q", head)
            yield f.read(n)


def make_payloads(
    model: dict[str, torch.Tensor], clients: int, p: float, seed: int, path: Path
) -> tuple[dict[str, torch.Tensor], int]:
    """Encode every client's update into ``path``; return the float64 reference mean of what the
    server should decode (the encoder's reconstructions, weighted) and the payloads' total bytes."""
    from fedcomp.codecs import SBC
    from fedcomp.methods.sent import dense
    from fedcomp.methods.update import UpdateEncoder
    from fedcomp.wire import serde

    base = base_update(model, seed)
    encoder = UpdateEncoder(SBC(p=p, mode="fast"), min_numel=MIN_NUMEL, error_feedback=False)
    ref = {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in model.items()}
    buffers = {k: torch.empty_like(v) for k, v in base.items()}
    total_weight, nbytes = 0, 0
    with path.open("wb") as f:
        for client in range(1, clients + 1):
            update = client_update(base, client, seed, buffers)
            enc = encoder.encode(update, base_model_version=0, keep_sent=True)
            data = serde.update_to_bytes(enc)
            _write_payload(f, data)
            nbytes += len(data)
            w = weight_of(client)
            total_weight += w
            assert encoder.sent is not None
            for name, kept in encoder.sent.items():
                sent = dense(kept)  # (dense already: no sparse_sent asked)
                flat = sent.reshape(-1)
                if flat.numel() < MIN_NUMEL:
                    ref[name].add_(sent, alpha=w)
                else:  # SBC: a few kept values; add those (a dense float64 add would dominate)
                    idx = flat.nonzero().squeeze(1)
                    ref[name].view(-1).index_add_(0, idx, flat[idx].double().mul_(w))
            if client % 100 == 0:
                print(f"  encoded {client}/{clients} updates", file=sys.stderr)
    for t in ref.values():
        t.div_(total_weight)
    return ref, nbytes


# --- the aggregation (child process) -------------------------------------------------------------


def _vm_kib(field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(m.group(1)) if m else 0


def _reset_peak() -> bool:
    """Reset this process's peak resident set (``VmHWM``); False where the kernel refuses."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _inner(name: str) -> Any:
    from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM

    if name == "fedavgm":
        return FedAvgM(fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1, server_momentum=0.9)
    if name == "fedadam":
        return FedAdam(fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1, eta=0.01, tau=1e-3)
    return FedAvg(fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1)


def _grid(nodes: Iterable[int]) -> Any:
    """The smallest Grid ``configure_train`` can sample from: it lists node ids, nothing else."""
    from flwr.serverapp import Grid

    ids = list(nodes)

    def unused(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the server benchmark's grid only lists node ids")

    class _Nodes(Grid):
        def get_node_ids(self) -> Iterable[int]:
            return list(ids)

        set_run = create_message = push_messages = pull_messages = send_and_receive = unused

        @property
        def run(self) -> Any:
            raise NotImplementedError("the server benchmark's grid only lists node ids")

    return _Nodes()


def aggregate_in_child(spec: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The child's side: replies from the payload file through ``aggregate_train``; the model it
    returns is saved to ``workdir/aggregate.pt``; the figures are returned."""
    from flwr.app import ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedcomp.flower import protocol
    from fedcomp.flower.protocol import UplinkReport
    from fedcomp.flower.records import record_from_tensors, tensors_from_record
    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    # Flower asks who is building a Message; a ServerApp process has this set by Flower.
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1  # type: ignore[attr-defined]
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    model = model_tensors(spec["model"], spec["seed"])
    config = CompressionConfig.from_run_config({"sbc-p": spec["p"], "min-compress-numel": MIN_NUMEL})
    strategy = CompressionStrategy(_inner(spec["inner"]), config)
    strategy.streaming = spec["path"] == "streaming"
    list(strategy.configure_train(1, record_from_tensors(model), ConfigRecord({}), _grid([1])))
    assert strategy.replica is not None
    digest = strategy.replica.digest_of(0)
    assert digest is not None  # version 0: the model configure_train was just given
    replies = []
    for client, data in enumerate(_read_payloads(workdir / "payloads.bin"), start=1):
        ask = Message(RecordDict(), dst_node_id=client, message_type=MessageType.TRAIN)
        report = UplinkReport(replica_version=0, replica_digest=digest, payload=data, update_round=1)
        content = RecordDict(
            {"metrics": MetricRecord({"num-examples": weight_of(client)}), protocol.UPLINK: report.to_record()}
        )
        replies.append(Message(content, reply_to=ask))
    del data
    gc.collect()
    rss_before = _vm_kib("VmRSS") * 1024
    exact_peak = _reset_peak()
    t0, cpu0 = time.perf_counter(), time.process_time()
    arrays, _ = strategy.aggregate_train(1, replies)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - cpu0
    peak = _vm_kib("VmHWM") * 1024 if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if arrays is None:
        raise RuntimeError(f"the wrapper aggregated nothing: rejected {strategy.traffic[1].rejected}")
    torch.save(tensors_from_record(arrays), workdir / "aggregate.pt")
    return {
        "seconds": seconds,
        # CPU time of the call, all threads: on a loaded shared machine, with --threads 1, the
        # better estimate of the wall time the same call takes on an idle core.
        "cpu_seconds": cpu_seconds,
        "peak_rss_bytes": peak,
        "peak_rss_source": "VmHWM of the aggregation" if exact_peak else "ru_maxrss of the child process",
        "rss_before_bytes": rss_before,
        "accepted": strategy.traffic[1].accepted,
        "rejected": len(strategy.traffic[1].rejected),
        "threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0],  # a shared machine's load stretches every timing
    }


# --- the benchmark -------------------------------------------------------------------------------


def _half_ulp(x: torch.Tensor) -> torch.Tensor:
    """Half a float32 ulp at each value of ``x`` (float64)."""
    f = x.to(torch.float32).abs()
    return (torch.nextafter(f, torch.tensor(math.inf)) - f).double() / 2


def _payloads(model: dict[str, torch.Tensor], clients: int, model_name: str, p: float, seed: int, work: Path,
              cache: Path | None) -> tuple[dict[str, torch.Tensor], int, float]:  # fmt: skip
    """The payload file in ``work`` and the reference; from ``cache`` when it has this setting's.

    Encoding runs on one thread: on a shared, loaded machine torch's threads wait on each other
    (encoding 1000 ResNet-50 updates is minutes either way; it is not what is measured)."""
    key = f"{model_name}-p{p:g}-seed{seed}-clients{clients}"
    hit = cache / key if cache is not None else None
    if hit is not None and (hit / "done").exists():
        print(f"payloads and reference from the cache {hit}", file=sys.stderr)
        (work / "payloads.bin").symlink_to((hit / "payloads.bin").resolve())
        meta = json.loads((hit / "done").read_text())
        return torch.load(hit / "ref.pt", weights_only=True), int(meta["payload_bytes"]), float(meta["encode_seconds"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        print(f"encoding {clients} {model_name} updates (SBC p={p}) ...", file=sys.stderr)
        ref, nbytes = make_payloads(model, clients, p, seed, work / "payloads.bin")
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    if hit is not None:
        hit.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / "payloads.bin", hit / "payloads.bin")
        torch.save(ref, hit / "ref.pt")
        (hit / "done").write_text(json.dumps({"payload_bytes": nbytes, "encode_seconds": seconds}))
    return ref, nbytes, seconds


def bench_server(
    clients: int,
    model_name: str,
    p: float,
    path: str,
    inner: str,
    seed: int,
    threads: int | None = None,
    cache: Path | None = None,
) -> dict[str, Any]:
    """One run: payloads, the child's aggregation, and its accuracy against the reference."""
    model = model_tensors(model_name, seed)
    numel = sum(t.numel() for t in model.values())
    with tempfile.TemporaryDirectory(prefix="fedcomp-bench-server-") as tmp:
        work = Path(tmp)
        ref_delta, nbytes, encode_seconds = _payloads(model, clients, model_name, p, seed, work, cache)
        spec = {"model": model_name, "seed": seed, "p": p, "path": path, "inner": inner, "threads": threads}
        (work / "spec.json").write_text(json.dumps(spec))
        print(f"aggregating ({path}, {inner}) in a child process ...", file=sys.stderr)
        proc = subprocess.run(
            [sys.executable, "-m", "fedcomp.bench.server", "--child", str(work)],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the aggregation process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        child = json.loads((work / "child.json").read_text())
        got = torch.load(work / "aggregate.pt", weights_only=True)
    row: dict[str, Any] = {
        "clients": clients,
        "model": model_name,
        "numel": numel,
        "p": p,
        "path": path,
        "inner": inner,
        **child,
        "payload_bytes": nbytes,
        "encode_seconds": encode_seconds,
    }
    if inner == "fedavg":  # the reference is FedAvg's mean; a server optimizer moves elsewhere
        diff = ulps = half = scale = 0.0
        for name, w in model.items():
            ref = w.double() + ref_delta[name]
            d = (got[name].double() - ref).abs()
            h = _half_ulp(ref)
            diff, ulps = max(diff, float(d.max())), max(ulps, float((d / (2 * h)).max()))
            half, scale = max(half, float(h.max())), max(scale, float(ref_delta[name].abs().max()))
        row.update(
            max_abs_diff=diff,
            max_ulps=ulps,
            fp32_half_ulp=half,
            update_scale=scale,
            max_abs_diff_vs_update=diff / scale if scale else None,
        )
    return row


def _print_row(r: dict[str, Any]) -> None:
    acc = "" if "max_abs_diff" not in r else (
        f"  max_abs_diff {r['max_abs_diff']:.3g} ({r['max_ulps']:.2f} ulp, {r['max_abs_diff_vs_update']:.3g} of the "
        f"update scale {r['update_scale']:.3g})"
    )  # fmt: skip
    print(
        f"{r['path']:<12} {r['inner']:<8} {r['model']} x {r['clients']} clients ({r['numel']:,} values, p={r['p']:g}): "
        f"{r['seconds']:.2f} s, peak RSS {r['peak_rss_bytes'] / 2**20:,.0f} MiB "
        f"(before {r['rss_before_bytes'] / 2**20:,.0f} MiB, payloads {r['payload_bytes'] / 2**20:,.1f} MiB){acc}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"] and len(argv) == 2:  # the aggregation process (see the module docstring)
        work = Path(argv[1])
        out = aggregate_in_child(json.loads((work / "spec.json").read_text()), work)
        (work / "child.json").write_text(json.dumps(out))
        return 0
    ap = argparse.ArgumentParser(prog="python -m fedcomp.bench server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int_at_least(1), required=True, help="replies aggregated in the round")
    ap.add_argument("--model", choices=MODELS, default="resnet50")
    ap.add_argument("--p", type=float_in(0, 0.5, lo_open=True), default=0.01, help="SBC fraction kept per side")
    ap.add_argument("--path", choices=PATHS, default="streaming", help="the wrapper's aggregation path")
    ap.add_argument("--inner", choices=INNER, default="fedavg", help="the inner strategy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int_at_least(1), help="torch threads of the aggregation (default: torch's)")
    ap.add_argument("--cache", type=Path, help="keep the encoded payloads here and reuse them (same setting)")
    ap.add_argument("--json", type=Path, help="write the row as JSON to this path")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}", file=sys.stderr)
    row = bench_server(args.clients, args.model, args.p, args.path, args.inner, args.seed, args.threads, args.cache)
    _print_row(row)
    write_rows(args.json, row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
