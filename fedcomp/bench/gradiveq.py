"""GradiVeQ on real LeNet5-Caffe federated updates: dimensions, ratio, held-out loss, timings.

    python -m fedcomp.bench gradiveq [--clients 4] [--local-steps 5] [--fit-rounds 3]
        [--eval-rounds 2] [--eps 0.3 0.1 0.03] [--slice-size row|N] [--lr 0.001]
        [--dataset mnist|digits|fashion-mnist] [--repeat 5] [--seed 0] [--json PATH]

Simulates FedAvg in process: every round each client copies the global LeNet5-Caffe, takes
``--local-steps`` Adam steps on its IID MNIST partition (``fedcomp.app.data.load_partition``, data
from ``$FEDCOMP_DATA_DIR``; without it the bundled scikit-learn digits, and stderr says so), and its update is weights after minus weights before; the global
model moves by the sample-weighted mean update. The updates of the first ``--fit-rounds`` rounds
are the PCA samples (the uncompressed rounds of the paper's schedule, all slices of all clients'
updates); the next ``--eval-rounds`` rounds are held out.

For each ``eps`` it reports, per tensor and overall: ``d`` and ``k`` ("dense" when the fit left
the tensor uncompressed), the compression ratio (serialized dense-fp32 ``CompressedTensor``
bytes / serialized GradiVeQ bytes; overall over the whole update, dense tensors included), the
eq.-6 loss on the samples, the held-out relative loss ``sum ||x~ - x||^2 / sum ||x||^2`` over the
held-out client updates (the paper's eq. 7), the same loss of the aggregate (one decompression
of the weighted mean of coefficients vs. the true mean update), and the PCA fit time. Encode
(update -> wire bytes) and decode (bytes -> tensors) times are medians of ``--repeat`` runs,
each as a ratio to a ``clone()`` of the same tensors timed right before it.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedcomp.bench import DATA_DIR_ENV, DATASETS, choose_dataset, float_in, int_at_least, write_rows
from fedcomp.codecs import DenseFP32, TensorSpec
from fedcomp.codecs.gradiveq import GradiVeQ, coefficients_of
from fedcomp.methods.gradiveq import Compressor, aggregate, fit_compressor
from fedcomp.wire import serde
from fedcomp.wire.payloads import EncodedUpdate

Update = dict[str, torch.Tensor]


def simulate(
    rounds: int, clients: int, local_steps: int, lr: float, batch_size: int, dataset: str, seed: int
) -> tuple[list[list[Update]], list[list[float]], dict[str, torch.Size]]:
    """Per round, the clients' updates and FedAvg weights; and the parameter shapes."""
    from fedcomp.app.data import load_partition
    from fedcomp.app.models import LeNet5Caffe, train_local

    torch.manual_seed(seed)
    model = LeNet5Caffe()
    parts = [load_partition(dataset, c, clients, seed=seed) for c in range(clients)]
    shapes = {n: p.shape for n, p in model.named_parameters()}
    all_updates, all_weights = [], []
    for r in range(rounds):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        updates, weights = [], []
        for c, part in enumerate(parts):
            local = copy.deepcopy(model)
            gen = torch.Generator().manual_seed(seed * 100_003 + r * 1009 + c)
            train_local(local, (part.x, part.y), local_steps, lr, "adam", batch_size=batch_size, generator=gen)
            updates.append({n: (p.detach() - before[n]) for n, p in local.named_parameters()})
            weights.append(float(len(part)))
        total = sum(weights)
        weights = [w / total for w in weights]
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.add_(sum(w * u[n] for w, u in zip(weights, updates, strict=True)))
        all_updates.append(updates)
        all_weights.append(weights)
    return all_updates, all_weights, shapes


def slice_sizes(shapes: dict[str, torch.Size], choice: str, max_slice: int = 4096) -> dict[str, int]:
    """``row``: the row length (``numel / shape[0]``: one filter / one neuron's weights), capped
    at ``max_slice``; an integer: that ``d`` everywhere."""
    if choice == "row":
        return {n: min(max(1, s.numel() // s[0]) if len(s) > 1 else s.numel(), max_slice) for n, s in shapes.items()}
    return {n: int(choice) for n in shapes}


def encode(update: Update, comp: Compressor) -> bytes:
    codec, dense = GradiVeQ(comp), DenseFP32()
    tensors = tuple(codec.encode(t, n) if comp.compresses(n) else dense.encode(t, n) for n, t in update.items())
    return serde.update_to_bytes(EncodedUpdate(base_model_version=0, tensors=tensors))


def decode(data: bytes, specs: list[TensorSpec], comp: Compressor) -> Update:
    codec, dense = GradiVeQ(comp), DenseFP32()
    enc = serde.update_from_bytes(data)
    return {
        s.name: (codec if comp.compresses(s.name) else dense).decode(e, s)
        for s, e in zip(specs, enc.tensors, strict=True)
    }


def _clone_all(update: Update) -> list[torch.Tensor]:
    return [t.clone() for t in update.values()]


def _paired(fn: Callable[[], object], clone: Callable[[], object], repeat: int) -> tuple[float, float, float]:
    """Median op time, median clone time, median per-pair ratio (clone timed right before)."""
    fn(), clone()
    ops, clones, ratios = [], [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        clone()
        t1 = time.perf_counter()
        fn()
        t2 = time.perf_counter()
        ops.append(t2 - t1)
        clones.append(t1 - t0)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(ops), statistics.median(clones), statistics.median(ratios)


def bench(args: argparse.Namespace) -> list[dict]:
    rounds = args.fit_rounds + args.eval_rounds
    t0 = time.perf_counter()
    updates, weights, shapes = simulate(
        rounds, args.clients, args.local_steps, args.lr, args.batch_size, args.dataset, args.seed
    )
    print(f"simulated {rounds} rounds x {args.clients} clients in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    fit_ups = [u for rnd in updates[: args.fit_rounds] for u in rnd]
    samples = {n: [u[n].reshape(-1) for u in fit_ups] for n in shapes}
    sizes = slice_sizes(shapes, args.slice_size)
    specs = [TensorSpec(n, tuple(s)) for n, s in shapes.items()]
    dense = DenseFP32()
    rows = []
    for eps in args.eps:
        t0 = time.perf_counter()
        comp = fit_compressor(
            samples,
            version=1,
            slice_size=sizes,
            eps=eps,
            min_numel=args.min_numel,
            max_samples=args.max_samples,
            seed=args.seed,
        )
        fit_s = time.perf_counter() - t0
        held = updates[args.fit_rounds :]
        per: dict[str, dict] = {}
        for n, shape in shapes.items():
            spec = TensorSpec(n, tuple(shape))
            numel = spec.numel
            dense_bytes = len(serde.tensor_to_bytes(dense.encode(held[0][0][n], n)))
            row: dict[str, Any] = {
                "tensor": n,
                "numel": numel,
                "d": None,
                "k": None,
                "dense_bytes": dense_bytes,
                "bytes": dense_bytes,
                "fit_loss": None,
                "heldout_loss": 0.0,
                "aggregate_loss": 0.0,
            }
            if comp.compresses(n):
                b = comp.basis(n)
                codec = GradiVeQ(comp)
                res = ref = agg_res = agg_ref = 0.0
                for rnd, ws in zip(held, weights[args.fit_rounds :], strict=True):
                    encs = [serde.tensor_from_bytes(serde.tensor_to_bytes(codec.encode(u[n], n))) for u in rnd]
                    for u, e in zip(rnd, encs, strict=True):
                        x = u[n].reshape(-1)
                        res += float((codec.decode(e, spec).reshape(-1) - x).pow(2).sum())
                        ref += float(x.pow(2).sum())
                    coeffs = [coefficients_of(e, spec, comp) for e in encs]
                    mean = sum((w * u[n].reshape(-1) for w, u in zip(ws, rnd, strict=True)), torch.zeros(numel))
                    agg_res += float((aggregate(comp, n, coeffs, ws, numel) - mean).pow(2).sum())
                    agg_ref += float(mean.pow(2).sum())
                row.update(
                    d=b.slice_size,
                    k=b.dim,
                    bytes=len(serde.tensor_to_bytes(encs[0])),
                    fit_loss=b.fit_loss,
                    heldout_loss=res / ref,
                    aggregate_loss=agg_res / agg_ref,
                )
            row["ratio"] = row["dense_bytes"] / row["bytes"]
            per[n] = row
        update = held[0][0]
        data = encode(update, comp)
        dense_all = serde.update_to_bytes(EncodedUpdate(0, tuple(dense.encode(t, n) for n, t in update.items())))
        clone = functools.partial(_clone_all, update)
        enc_med, enc_clone, enc_ratio = _paired(functools.partial(encode, update, comp), clone, args.repeat)
        dec_med, dec_clone, dec_ratio = _paired(functools.partial(decode, data, specs, comp), clone, args.repeat)
        summary = {
            "eps": eps,
            "slice_size": args.slice_size,
            "tensors": list(per.values()),
            "update_bytes": len(data),
            "dense_update_bytes": len(dense_all),
            "ratio": len(dense_all) / len(data),
            "compressor_bytes": comp.wire_bytes(),
            "fit_seconds": fit_s,
            "fit_samples": {n: comp.basis(n).samples for n in comp.bases},
            "encode_s": enc_med,
            "encode_clone_s": enc_clone,
            "encode_ratio": enc_ratio,
            "decode_s": dec_med,
            "decode_clone_s": dec_clone,
            "decode_ratio": dec_ratio,
            "clients": args.clients,
            "local_steps": args.local_steps,
            "fit_rounds": args.fit_rounds,
            "eval_rounds": args.eval_rounds,
            "lr": args.lr,
            "threads": torch.get_num_threads(),
        }
        _print(summary)
        rows.append(summary)
    return rows


def _print(s: dict) -> None:
    print(
        f"\neps {s['eps']}  slice-size {s['slice_size']}  PCA fit {s['fit_seconds']:.2f} s  "
        f"compressor broadcast {s['compressor_bytes']:,d} B"
    )
    print(f"{'tensor':<12}{'numel':>8}{'d':>6}{'k':>6}{'ratio':>8}{'fit loss':>10}{'held-out':>10}{'aggregate':>11}")
    for r in s["tensors"]:
        d, k = ("dense", "") if r["d"] is None else (r["d"], r["k"])
        fl = "" if r["fit_loss"] is None else f"{r['fit_loss']:.4f}"
        print(
            f"{r['tensor']:<12}{r['numel']:>8}{d!s:>6}{k!s:>6}{r['ratio']:>7.2f}x{fl:>10}"
            f"{r['heldout_loss']:>10.4f}{r['aggregate_loss']:>11.4f}"
        )
    print(f"{'overall':<12}{'':>20}{s['ratio']:>7.2f}x   ({s['dense_update_bytes']:,d} B -> {s['update_bytes']:,d} B)")
    print(
        f"encode {s['encode_s'] * 1e3:.2f} ms = {s['encode_ratio']:.2f}x clone ({s['encode_clone_s'] * 1e3:.3f} ms); "
        f"decode {s['decode_s'] * 1e3:.2f} ms = {s['decode_ratio']:.2f}x clone"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedcomp.bench gradiveq", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int_at_least(1), default=4)
    ap.add_argument("--local-steps", type=int_at_least(1), default=5)
    ap.add_argument("--fit-rounds", type=int_at_least(1), default=3)
    ap.add_argument("--eval-rounds", type=int_at_least(1), default=2)
    ap.add_argument("--eps", type=float_in(0.0, 1.0, lo_open=True, hi_open=True), nargs="+", default=[0.3, 0.1, 0.03])
    ap.add_argument("--slice-size", default="row", help="'row' (row length per tensor) or an integer d >= 1")
    ap.add_argument("--min-numel", type=int_at_least(0), default=1000)
    ap.add_argument("--max-samples", type=int_at_least(1), default=16384)
    ap.add_argument("--lr", type=float_in(0.0, lo_open=True), default=1e-3)
    ap.add_argument("--batch-size", type=int_at_least(1), default=32)
    ap.add_argument(
        "--dataset",
        choices=DATASETS,
        default=None,
        help=f"default: mnist when ${DATA_DIR_ENV} is set, else the bundled digits",
    )
    ap.add_argument("--repeat", type=int_at_least(1), default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the results as JSON to this path")
    args = ap.parse_args(argv)
    if args.slice_size != "row" and not (args.slice_size.isdigit() and int(args.slice_size) >= 1):
        ap.error(f"--slice-size: 'row' or an integer >= 1, got {args.slice_size!r}")
    args.dataset = choose_dataset(ap, args.dataset, None, data_dir_option=None)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.dataset}", file=sys.stderr)
    rows = bench(args)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
