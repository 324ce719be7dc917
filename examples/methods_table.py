"""Uplink methods side by side on the reference task, through real Flower simulations.

    FEDCOMP_DATA_DIR=/work/shared/data python examples/methods_table.py [--rounds 30] [--clients 10]
        [--out DIR] [--only NAME ...] [--force]

Each row is one ``flwr run`` of the reference app (``fedcomp.testing.flower.run_simulation``):
LeNet5-Caffe on MNIST, IID over ``--clients`` SuperNodes, 10 local Adam iterations (lr 0.001,
batch 64) per round, every client every round, centralized test accuracy after each round. Rows:

* dense FedAvg: ``compress = false`` (fp32 models both ways, plain Flower);
* SBC: ``uplink-codec = "sbc"``, p = 1 %;
* top-k: every client's own top 1 % with fp32 values (what DEFT improves on);
* DEFT: 1 % selected by all clients together, in disjoint server-allocated partitions; and
  10 % in all (with 10 clients, the uplink bytes of per-client top-k at 1 %);
* GradiVeQ: PCA coefficients (eps 0.1 and 0.3), 2 dense rounds before each fit, refit every
  20 compressed rounds; and with plain SGD (lr 0.05) instead of Adam, beside dense FedAvg with
  the same SGD.

All compressed rows use the 3LC downlink at s = 1. The table gives final accuracy, the first
round reaching 97 %, the uplink bytes of the whole run (what crossed the wire, per the meter)
and their compression factor against dense FedAvg's fp32 uplink (over all rounds, and over the
compressed rounds only: GradiVeQ's sampling rounds are dense), the downlink factor, the
aggregate density of the sparse methods (entries of the compressed tensors any client sent, per
round), and the clients' encode time: the median per client and round, and as a fraction of
that client's training time in the same process (a ratio from one run, as this machine is
shared and noisy). Finished runs are cached under
``--out`` by configuration, so re-running only runs what is missing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from fedcomp.bench import float_in, int_at_least

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "results" / "examples" / "methods_table"

METHODS: dict[str, dict[str, Any]] = {
    "dense FedAvg": {"compress": False},
    "SBC (p = 1 %)": {"uplink-codec": "sbc", "sbc-p": 0.01},
    "top-k (1 % per client)": {"uplink-codec": "topk", "topk-density": 0.01},
    "DEFT (1 % in all)": {"uplink-codec": "deft", "topk-density": 0.01},
    # The same uplink bytes as per-client top-k at 1 %: 10 clients x 1 %, disjoint.
    "DEFT (10 % in all)": {"uplink-codec": "deft", "topk-density": 0.1},
    "GradiVeQ (eps 0.1)": {"uplink-codec": "gradiveq", "gradiveq-eps": 0.1},
    "GradiVeQ (eps 0.3)": {"uplink-codec": "gradiveq", "gradiveq-eps": 0.3},
    # GradiVeQ's PCA finds SGD updates far more compressible than Adam's (sign-like) ones.
    "dense FedAvg, SGD lr 0.05": {"compress": False, "optimizer": "sgd", "lr": 0.05},
    "GradiVeQ (eps 0.1), SGD lr 0.05": {
        "uplink-codec": "gradiveq",
        "gradiveq-eps": 0.1,
        "optimizer": "sgd",
        "lr": 0.05,
    },
}


def base_config(rounds: int) -> dict[str, Any]:
    return {
        "num-server-rounds": rounds,
        "dataset": "mnist",
        "local-iters": 10,
        "batch-size": 64,
        "lr": 0.001,
        # The reference app's downlink is "lattice" since issue #12; this table is the papers' 3LC.
        "downlink-codec": "3lc",
        "3lc-s": 1.0,
        "seed": 0,
    }


def summarize(label: str, res: dict[str, Any], dense_up: int | None) -> dict[str, Any]:
    rounds = [r for r in res["rounds"] if r["round"] > 0]
    up = sum(int(r["uplink_bytes"]) for r in rounds)
    down = sum(int(r["downlink_bytes"]) for r in rounds)
    dense_up_run = sum(int(r["dense_uplink_bytes"]) for r in rounds)
    dense_down_run = sum(int(r.get("dense_downlink_bytes", 0)) for r in rounds)
    reach = next((r["round"] for r in rounds if r["accuracy"] >= 0.97), None)
    ratios, encode_s = [], []
    for r in rounds:
        enc, train = r.get("client_encode_seconds") or {}, r.get("client_train_seconds") or {}
        ratios += [enc[k] / train[k] for k in enc if train.get(k)]
        encode_s += list(enc.values())
    dens = [r["uplink_union_density"] for r in rounds if r.get("uplink_union_density") is not None]
    # GradiVeQ's dense (sampling) rounds apart: what a compressed round costs.
    comp = [r for r in rounds if r.get("gradiveq_compressed", True)]
    comp_up = sum(int(r["uplink_bytes"]) for r in comp)
    comp_dense = sum(int(r["dense_uplink_bytes"]) for r in comp)
    return {
        "method": label,
        "final_accuracy": rounds[-1]["accuracy"],
        "round_97": reach,
        "uplink_bytes": up,
        "uplink_compression": (dense_up if dense_up else dense_up_run) / up if up else None,
        "downlink_compression": dense_down_run / down if down else None,
        "uplink_compression_compressed_rounds": comp_dense / comp_up if comp_up else None,
        "compressed_rounds": len(comp),
        "union_density": statistics.mean(dens) if dens else None,
        "encode_over_train": statistics.median(ratios) if ratios else None,
        "encode_ms": 1000 * statistics.median(encode_s) if encode_s else None,
        "rejected": sum(len(r.get("rejected") or {}) for r in rounds),
    }


def fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int_at_least(1), default=30)
    ap.add_argument("--clients", type=int_at_least(1), default=10)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="LABEL",
        help=f"method labels to run (default: all): {list(METHODS)}".replace("%", "%%"),
    )
    ap.add_argument("--force", action="store_true", help="rerun cached configurations")
    ap.add_argument("--timeout", type=float_in(0.0, lo_open=True), default=3600.0, help="seconds per run")
    args = ap.parse_args(argv)
    unknown = [label for label in args.only or () if label not in METHODS]
    if unknown:
        ap.error(f"--only: unknown method label(s) {unknown}; valid labels: {list(METHODS)}")
    if not os.environ.get("FEDCOMP_DATA_DIR"):
        ap.error("FEDCOMP_DATA_DIR is not set: set it to the folder holding mnist/ (e.g. /work/shared/data)")
    from fedcomp.testing.flower import run_simulation

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    for label, extra in METHODS.items():
        if args.only and label not in args.only:
            continue
        config = {**base_config(args.rounds), **extra}
        key = hashlib.sha256(json.dumps([config, args.clients], sort_keys=True).encode()).hexdigest()[:12]
        path = args.out / "runs" / f"{key}.json"
        if path.is_file() and not args.force:
            print(f"[{label}] cached: {path}", flush=True)
            results[label] = json.loads(path.read_text())
            continue
        print(f"[{label}] running {args.rounds} rounds, {args.clients} clients: {extra}", flush=True)
        t0 = time.perf_counter()
        res = run_simulation(
            REPO,
            {**config, "results-dir": str(args.out / "flower"), "run-name": key},
            num_supernodes=args.clients,
            timeout_s=args.timeout,
            work_dir=args.out / "work" / key,
        )
        res["_wall_s"] = time.perf_counter() - t0
        res.pop("_simulation", None)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res))
        print(
            f"[{label}] done in {res['_wall_s']:.0f} s: final accuracy {res['rounds'][-1]['accuracy']:.4f}", flush=True
        )
        results[label] = res

    dense = results.get("dense FedAvg")
    dense_up = sum(int(r["uplink_bytes"]) for r in dense["rounds"] if r["round"] > 0) if dense else None
    rows = [summarize(label, res, dense_up) for label, res in results.items()]
    header = (
        "| method | final accuracy | first round >= 97 % | uplink MB | uplink compression | "
        "uplink compression, compressed rounds | downlink compression | aggregate density | "
        "client encode, ms | encode / train time | rejected |"
    )
    lines = [header, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['final_accuracy']:.4f} | {fmt(r['round_97'])} | {r['uplink_bytes'] / 1e6:.2f} | "
            f"x{fmt(r['uplink_compression'], ',.1f')} | "
            f"x{fmt(r['uplink_compression_compressed_rounds'], ',.1f')} ({r['compressed_rounds']} rounds) | "
            f"x{fmt(r['downlink_compression'], ',.1f')} | "
            f"{fmt(r['union_density'] and 100 * r['union_density'], '.3f')}{' %' if r['union_density'] else ''} | "
            f"{fmt(r['encode_ms'], '.1f')} | {fmt(r['encode_over_train'], '.3f')} | {r['rejected']} |"
        )
    text = "\n".join(lines)
    print()
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    (args.out / "table.json").write_text(json.dumps(rows, indent=1))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
