"""Differential privacy with compression: docs/RESULTS.md's table in one command.

Each arm is a real Flower simulation of the reference app (``python -m fedcomp run``): LeNet5 on
MNIST, every client every round, 10 local Adam steps, seed 0, Flower's central DP with fixed
clipping (``dp-clipping-norm``, ``dp-noise-multiplier``, ``dp-clipping``) around FedAvg, dense or
SBC up and the lattice down, IID and Dirichlet(0.3) partitions:

    python examples/dp_table.py                      # the full table (about 25 min on 2 cores)
    python examples/dp_table.py --only "SBC + lattice, clients clip" --partition iid
    python examples/dp_table.py --smoke              # digits, 2 clients, 2 rounds, two arms

Runs are cached per arm in ``examples/results/dp_table/`` (a folder per configuration, named by a
hash of it; ``--force`` reruns); the tables go to stdout in Markdown. The table in
docs/RESULTS.md also has two rules the client's clipping no longer uses (measured at the time by
hand); they are not arms here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "examples" / "results" / "dp_table"
BASE = "dataset='mnist' local-iters=10"
DIRICHLET = "partitioning='dirichlet' dirichlet-alpha=0.3"


@dataclass(frozen=True)
class Arm:
    label: str
    config: str  # run-config overrides
    partitions: tuple[str, ...] = ("iid", "dirichlet")


ARMS = (
    Arm("dense FedAvg, no DP", "compress=false"),
    Arm("dense, clients clip to 1", "compress=false dp-clipping-norm=1.0"),
    Arm(
        "dense, clients clip to 1, noise multiplier 0.02",
        "compress=false dp-clipping-norm=1.0 dp-noise-multiplier=0.02",
        ("iid",),
    ),
    Arm("dense, the server clips to 1", "compress=false dp-clipping-norm=1.0 dp-clipping='server'", ("iid",)),
    Arm("SBC up, lattice down, no DP", ""),
    Arm("SBC + lattice, clients clip to 1", "dp-clipping-norm=1.0"),
    Arm(
        "SBC + lattice, clients clip to 1, noise multiplier 0.02",
        "dp-clipping-norm=1.0 dp-noise-multiplier=0.02",
        ("iid",),
    ),
    Arm("SBC + lattice, the server clips to 1", "dp-clipping-norm=1.0 dp-clipping='server'"),
)
SMOKE_ARMS = ("dense, clients clip to 1", "SBC + lattice, clients clip to 1")


def run_arm(arm: Arm, partition: str, nodes: int, rounds: int, base: str, out: Path, force: bool) -> dict[str, Any]:
    """The arm's results.json, from the cache or from a new run (which must complete)."""
    config = " ".join(x for x in (base, DIRICHLET if partition == "dirichlet" else "", arm.config) if x)
    key = hashlib.sha256(f"{nodes}|{rounds}|{config}".encode()).hexdigest()[:16]
    run_dir = out / key
    results = run_dir / "results.json"
    if not force and results.is_file():
        data = json.loads(results.read_text())
        if data.get("status") == "completed":
            return data
    cmd = [sys.executable, "-m", "fedcomp", "run", "--nodes", str(nodes), "--rounds", str(rounds)]
    cmd += ["--out", str(run_dir), "--run-config", config]
    print(f"[dp_table] {arm.label} ({partition}): {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{arm.label} ({partition}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return dict(json.loads(results.read_text()))


def table(rows: list[tuple[str, dict[str, Any]]], rounds: int, title: str) -> str:
    """Accuracy at rounds 5, 10 and the last (those the run has), and bytes both ways."""
    marks = sorted({r for r in (5, 10, rounds) if r <= rounds})
    head = f"| {title} | " + " | ".join(f"round {r}" for r in marks) + " | bytes |"
    lines = [head, "|" + "---|" * (len(marks) + 2)]
    for label, data in rows:
        acc = {r["round"]: r["accuracy"] for r in data["rounds"]}
        s = data["summary"]
        total = s["total_uplink_bytes"] + s["total_downlink_bytes"]
        cells = " | ".join(f"{acc[r]:.4f}" for r in marks)
        lines.append(f"| {label} | {cells} | {total / 1e6:.1f} MB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="cache folder of the runs")
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--partition", choices=("iid", "dirichlet", "both"), default="both")
    parser.add_argument("--only", action="append", default=[], help="an arm's label (repeatable)")
    parser.add_argument("--force", action="store_true", help="rerun cached arms")
    parser.add_argument("--smoke", action="store_true", help="digits, 2 clients, 2 rounds, two arms")
    args = parser.parse_args(argv)
    base, nodes, rounds, only = BASE, args.nodes, args.rounds, set(args.only)
    if args.smoke:
        base, nodes, rounds, only = "dataset='digits' local-iters=2", 2, 2, only or set(SMOKE_ARMS)
    unknown = only - {a.label for a in ARMS}
    if unknown:
        parser.error(f"--only: no arm {sorted(unknown)}; arms: {[a.label for a in ARMS]}")
    partitions = ("iid", "dirichlet") if args.partition == "both" else (args.partition,)
    for partition in partitions:
        rows = [
            (arm.label, run_arm(arm, partition, nodes, rounds, base, args.out, args.force))
            for arm in ARMS
            if partition in arm.partitions and (not only or arm.label in only)
        ]
        if rows:
            title = "IID" if partition == "iid" else "Dirichlet(0.3)"
            print(table(rows, rounds, title) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
