"""DEFT vs per-client top-k: aggregate density (gradient build-up) and selection time.

    python -m fedcomp.bench deft [--model lenet|resnet50] [--density 0.01] [--clients 1,2,4,8,16]
                                 [--local-iters 10] [--repeat 5] [--json PATH] [--data-dir DIR]

For each number of clients ``n`` it makes ``n`` client updates, plans a DEFT round
(:func:`fedcomp.methods.deft.plan_round_from_aggregate`, norms from the previous round's aggregate) and
measures, on the same updates:

* the aggregate density of DEFT: the union of all clients' selections over the model size;
* the aggregate density of per-client whole-model top-k (top ``density * numel`` of the whole
  flattened update, the paper's Top-k) and of per-tensor top-k (``TopK(p=density)``): both grow
  with ``n``, the gradient build-up DEFT removes;
* each client's selection time: DEFT (top-k inside its ranges, all tensors) against whole-model
  top-k, timed alternately in the same process (median of ``--repeat``), and the speedup
  ``topk / slowest DEFT client`` (the paper's ``f(n)``, Eq. 6) and ``topk / mean DEFT client``.
  Clients run one after another on this machine, so the times are per-client CPU times.

``--model lenet`` (default) uses real updates: LeNet5-Caffe, round 0 trains every client from
the same start on its IID MNIST shard (``fedcomp.app.data.load_partition``, data folder from
``--data-dir`` or ``$FEDCOMP_DATA_DIR``; without either, the bundled scikit-learn digits, and
stderr says so; ``--dataset`` picks explicitly), the mean delta is the aggregate whose norms plan
round 1, and round 1's deltas from the updated model are measured. ``--model resnet50`` is for
timing: ResNet-50's 161 tensor shapes (25.6M values), each client's update a shared Student-t
(df 3) signal plus its own Gaussian noise of the same scale, the shared signal as aggregate.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fedcomp.app.data import load_dataset
from fedcomp.bench import DATA_DIR_ENV, DATASETS, choose_dataset, float_in, int_at_least, int_list, write_rows
from fedcomp.codecs.topk import TopK, topk_positions
from fedcomp.methods import deft

Rounds = tuple[list[torch.Tensor], Iterator[list[torch.Tensor]]]


def lenet_rounds(n: int, local_iters: int, seed: int, data_dir: str | None, dataset: str = "mnist") -> Rounds:
    """(aggregate of round 0, round 1's client updates) for LeNet5-Caffe on ``dataset`` shards."""
    from fedcomp.app.data import load_partition
    from fedcomp.app.models import LeNet5Caffe, train_local

    torch.manual_seed(seed)
    model = LeNet5Caffe()
    shards = [load_partition(dataset, i, n, data_dir=data_dir) for i in range(n)]

    def deltas(start: dict[str, torch.Tensor], i: int) -> list[torch.Tensor]:
        model.load_state_dict(start)
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        train_local(model, (shards[i].x, shards[i].y), local_iters, lr=0.05, optimizer="sgd", generator=gen)
        return [model.state_dict()[k] - start[k] for k in start]

    w0 = {k: v.clone() for k, v in model.state_dict().items()}
    agg = [torch.zeros_like(v) for v in w0.values()]
    for i in range(n):
        for a, d in zip(agg, deltas(w0, i), strict=True):
            a += d / n
    w1 = {k: v + a for (k, v), a in zip(w0.items(), agg, strict=True)}
    return agg, (deltas(w1, i) for i in range(n))


def resnet50_rounds(n: int, seed: int) -> Rounds:
    """(shared signal, client updates) with ResNet-50's tensor shapes."""
    from fedcomp.bench.resnet50 import ResNet50

    shapes = [p.shape for p in ResNet50().parameters()]
    gen = torch.Generator().manual_seed(seed)
    scales = [1e-3 / max(1, s[1:].numel() if len(s) > 1 else s.numel()) ** 0.5 for s in shapes]
    signal = []
    for s, c in zip(shapes, scales, strict=True):  # Student-t df 3: z / sqrt(chi2_3 / 3)
        z, chi = torch.randn(s, generator=gen), torch.randn((3, *s), generator=gen).square().sum(0)
        signal.append(z / (chi / 3).sqrt() * c)

    def client(i: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(seed * 1000 + i + 1)
        return [x + torch.randn(x.shape, generator=g) * c for x, c in zip(signal, scales, strict=True)]

    return signal, (client(i) for i in range(n))


def _select_each(codecs: list[TopK], flats: list[torch.Tensor]) -> list[torch.Tensor]:
    return [c.select(f) for c, f in zip(codecs, flats, strict=True)]


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    model: str,
    n: int,
    density: float,
    local_iters: int,
    repeat: int,
    seed: int,
    data_dir: str | None,
    dataset: str = "mnist",
) -> dict:
    if model == "lenet":
        aggregate, clients = lenet_rounds(n, local_iters, seed, data_dir, dataset)
    else:
        aggregate, clients = resnet50_rounds(n, seed)
    numels = [t.numel() for t in aggregate]
    total = sum(numels)
    t0 = time.perf_counter()
    allocs = deft.plan_round_from_aggregate(aggregate, density, n, round=1)
    plan_s = time.perf_counter() - t0
    k_total = deft.target_k(total, density)
    offsets = [0, *itertools.accumulate(numels)][:-1]  # where each tensor starts in the flat model
    union = {key: torch.zeros(total, dtype=torch.bool) for key in ("deft", "topk", "layer")}
    deft_s, topk_s, loads = [], [], deft.loads(allocs)
    for i, update in enumerate(clients):
        flats = [t.detach().reshape(-1).to(torch.float32).contiguous() for t in update]
        whole = torch.cat(flats)
        codecs = [TopK(ranges=r) for r in deft.ranges_for(allocs[i], len(flats))]
        layer = TopK(p=density)
        select_deft = functools.partial(_select_each, codecs, flats)
        select_topk = functools.partial(topk_positions, whole, k_total)
        select_deft(), select_topk()  # warm-up
        d, t = [], []
        for _ in range(repeat):  # alternate, so both see the same machine load
            d.append(_median_time(select_deft, 1))
            t.append(_median_time(select_topk, 1))
        deft_s.append(statistics.median(d))
        topk_s.append(statistics.median(t))
        for off, idx in zip(offsets, select_deft(), strict=True):
            assert not bool(union["deft"][idx + off].any()), "DEFT selections overlap"
            union["deft"][idx + off] = True
        union["topk"][select_topk()] = True
        for off, f in zip(offsets, flats, strict=True):
            union["layer"][layer.select(f) + off] = True
    topk_med = statistics.median(topk_s)
    return {
        "model": model,
        "dataset": dataset if model == "lenet" else None,
        "clients": n,
        "numel": total,
        "density": density,
        "partitions": sum(len(a.partitions) for a in allocs),
        "deft_density": int(union["deft"].sum()) / total,
        "topk_density": int(union["topk"].sum()) / total,
        "layer_topk_density": int(union["layer"].sum()) / total,
        "topk_ms": topk_med * 1e3,
        "deft_max_ms": max(deft_s) * 1e3,
        "deft_mean_ms": statistics.fmean(deft_s) * 1e3,
        "speedup_max": topk_med / max(deft_s),
        "speedup_mean": topk_med / statistics.fmean(deft_s),
        "cost_imbalance": (max(loads) - min(loads)) / max(max(loads), 1e-30),
        "plan_ms": plan_s * 1e3,
    }


HEADER = (
    f"{'n':>3}{'parts':>6}{'DEFT dens':>10}{'top-k dens':>11}{'build-up':>9}{'layer top-k':>12}"
    f"{'top-k ms':>10}{'DEFT max ms':>12}{'DEFT mean ms':>13}{'speedup max':>12}{'speedup mean':>13}{'plan ms':>8}"
)


def _print_row(r: dict) -> None:
    print(
        f"{r['clients']:>3}{r['partitions']:>6}{r['deft_density']:>10.4%}{r['topk_density']:>11.4%}"
        f"{r['topk_density'] / r['density']:>8.2f}x{r['layer_topk_density']:>12.4%}{r['topk_ms']:>10.2f}"
        f"{r['deft_max_ms']:>12.2f}{r['deft_mean_ms']:>13.2f}{r['speedup_max']:>11.2f}x{r['speedup_mean']:>12.2f}x"
        f"{r['plan_ms']:>8.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedcomp.bench deft", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["lenet", "resnet50"], default="lenet")
    ap.add_argument("--density", type=float_in(0.0, 0.5, lo_open=True), default=0.01)
    ap.add_argument("--clients", type=int_list(1), default=[1, 2, 4, 8, 16], help="comma-separated numbers of clients")
    ap.add_argument("--local-iters", type=int_at_least(1), default=10, help="local SGD steps per client (lenet)")
    ap.add_argument("--repeat", type=int_at_least(1), default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--dataset",
        choices=DATASETS,
        default=None,
        help="lenet's data (default: mnist when a data folder is set, else the bundled digits)",
    )
    ap.add_argument("--data-dir", default=None, help=f"folder holding mnist/ (default: ${DATA_DIR_ENV})")
    ap.add_argument("--json", type=Path, help="write the rows as a JSON list to this path")
    args = ap.parse_args(argv)
    dataset = "mnist"
    if args.model == "lenet":  # resnet50 makes synthetic updates: no data
        dataset = choose_dataset(ap, args.dataset, args.data_dir, data_dir_option="--data-dir")
        n_train = len(load_dataset(dataset, args.data_dir or None).train)
        if max(args.clients) > n_train:
            ap.error(f"--clients: {max(args.clients)} clients for {n_train} {dataset} training images")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, model {args.model}"
        + (f" on {dataset}" if args.model == "lenet" else "")
        + f", density {args.density}",
        file=sys.stderr,
    )
    print(HEADER)
    rows = []
    for n in args.clients:
        rows.append(
            measure(args.model, n, args.density, args.local_iters, args.repeat, args.seed, args.data_dir, dataset)
        )
        _print_row(rows[-1])
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
