"""Temporal x gradient sparsity grid (after SBC's Fig. 3 and 4), in one command.

    FEDCOMP_DATA_DIR=/work/shared/data python examples/sparsity_grid.py [--out DIR] [--iterations N]

Every cell is one run of LeNet5-Caffe on MNIST (4 clients, IID, Adam lr 0.001, batch 128) with a
communication delay (temporal sparsity 1/delay) and an SBC sparsity p (gradient sparsity; p = 100 %
means dense fp32 deltas, i.e. Federated Averaging). The paper's Fig. 3 is ResNet32 on CIFAR for
60,000 iterations; this grid is sized for about 15 minutes on one core: 200 iterations per cell by
default (``--iterations`` for more). SBC's observation to check: accuracy stays roughly constant
along the off-diagonals, where the total sparsity p / delay is the same.

``--long`` runs the 3 x 3 grid delay {1, 10, 100} x p {dense, 1 %, 0.1 %} at the paper's length
(2,000 iterations) with exactly the configurations of ``sbc_table2.py``, so the six cells Table II
already has come from its cache (``results/examples/sbc_table2``) and three runs are new.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

import fedsim
import numpy as np
from fedsim import SimConfig

from fedcomp.bench import float_in, int_at_least

DELAYS = (1, 10, 100)
PS = (1.0, 0.1, 0.01, 0.001)
ITERATIONS = 200


def cell(delay: int, p: float, iterations: int) -> SimConfig:
    dense = p >= 1.0
    label = f"delay {delay}, " + ("dense" if dense else f"p={100 * p:g}%")
    return SimConfig(
        label=label,
        iterations=iterations,
        delay=delay,
        uplink="dense-fp32" if dense else "sbc",
        p=0.01 if dense else p,
        eval_every=max(delay, iterations // 4),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    fedsim.common_args(ap, fedsim.DEFAULT_RESULTS / "sparsity_grid")
    ap.add_argument("--delays", type=int_at_least(1), nargs="+", default=list(DELAYS))
    ap.add_argument(
        "--ps", type=float_in(0.0, 1.0, lo_open=True), nargs="+", default=list(PS), help="SBC p per cell; 1 = dense"
    )
    ap.add_argument("--figures-to", type=Path, default=None, help="also copy the plots here (e.g. docs/figures)")
    ap.add_argument(
        "--long",
        action="store_true",
        help="delays 1, 10, 100 x p dense, 1 %%, 0.1 %% at 2,000 iterations, reusing sbc_table2.py's runs",
    )
    ap.add_argument(
        "--reuse",
        type=Path,
        action="append",
        default=None,
        help=f"run folders whose cached runs may be reused (--long default: {fedsim.DEFAULT_RESULTS / 'sbc_table2'})",
    )
    args = ap.parse_args(argv)
    fedsim.check_data("mnist")
    name = "sparsity_grid"
    reuse = args.reuse or []
    if args.long:
        import sbc_table2

        name = "sparsity_grid_long"
        if args.out == fedsim.DEFAULT_RESULTS / "sparsity_grid":
            args.out = fedsim.DEFAULT_RESULTS / name
        if args.reuse is None:
            reuse = [fedsim.DEFAULT_RESULTS / "sbc_table2"]
        args.delays, args.ps = [1, 10, 100], [1.0, 0.01, 0.001]

    iterations = args.iterations or (sbc_table2.BASE.iterations if args.long else ITERATIONS)
    delays = sorted(set(args.delays))
    if args.smoke:
        iterations = args.iterations or 2
        delays = sorted({min(d, iterations) for d in delays})
    bad = [d for d in delays if iterations % d]
    if bad:
        ap.error(f"--iterations: {iterations} is not a multiple of --delays {bad}")
    if args.long:  # the Table II configurations (same hashes), at any --iterations
        grid = [
            (
                d,
                p,
                replace(
                    cell(d, p, iterations), eval_every=sbc_table2.BASE.eval_every, observers=sbc_table2.BASE.observers
                ),
            )
            for d in delays
            for p in args.ps
        ]
    else:
        grid = [(d, p, cell(d, p, iterations)) for d in delays for p in args.ps]
    configs = [c for _, _, c in grid]
    if args.smoke:
        configs = [replace(c, batch_size=16, test_limit=200, eval_every=1) for c in configs]
    results = fedsim.run_all(configs, args.out, also=reuse, force=args.force, jobs=args.jobs)

    acc = np.full((len(delays), len(args.ps)), np.nan)
    comp = np.full_like(acc, np.nan)
    rows, table = [], []
    for (d, p, _), r in zip(grid, results, strict=True):
        i, j = delays.index(d), args.ps.index(p)
        acc[i, j] = r["final_acc"]
        comp[i, j] = r["uplink"]["compression_wire"]
        rows.append(
            {
                "delay": d,
                "p": p,
                "final_acc": r["final_acc"],
                "compression_wire": comp[i, j],
                "total_sparsity": p / d,
                "run_time_s": r["timing_s"]["total"],
                "config_hash": r["config_hash"],
            }
        )
    pcols = [("dense" if p >= 1 else f"p = {100 * p:g} %") for p in args.ps]
    header = ["delay \\ p", *pcols]
    for i, d in enumerate(delays):
        table.append([f"delay {d}", *[f"{acc[i, j]:.4f} (x{comp[i, j]:,.0f})" for j in range(len(args.ps))]])
    total_time = sum(r["timing_s"]["total"] for r in results)
    text = (
        f"Final test accuracy (uplink compression) after {iterations} iterations, LeNet5-Caffe / MNIST, "
        f"4 clients; {len(results)} cells, {fedsim._fmt_s(total_time)} of runs\n\n" + fedsim.md_table(header, table)
    )
    print()
    print(text)
    fedsim.write_summary(args.out, "grid", rows, text)

    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import simplots

        rlabels = [f"delay {d}" for d in delays]
        figs = [
            simplots.heatmap(
                acc,
                rlabels,
                pcols,
                args.out / f"{name}_accuracy.png",
                f"final test accuracy, {iterations} iterations",
                "gradient sparsity (SBC p)",
                "temporal sparsity (delay)",
            ),
            simplots.heatmap(
                np.log10(comp),
                rlabels,
                pcols,
                args.out / f"{name}_compression.png",
                "log10 uplink compression (wire bytes)",
                "gradient sparsity (SBC p)",
                "temporal sparsity (delay)",
                fmt="{:.2f}",
                cmap="magma",
            ),
        ]
        # accuracy against total sparsity (the paper's Fig. 4): colour = share of temporal sparsity
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for row in rows:
            logs = math.log10(row["delay"]) - math.log10(row["p"])
            # no sparsity at all (uncompressed): grey; else the share of the sparsity that is temporal,
            # 0 purple ... 1 yellow
            color = "grey" if logs == 0 else plt.cm.plasma(0.15 + 0.7 * math.log10(row["delay"]) / logs)
            ax.scatter(row["total_sparsity"], row["final_acc"], color=color, s=40)
            ax.annotate(
                f"d{row['delay']}/p{100 * row['p']:g}%",
                (row["total_sparsity"], row["final_acc"]),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
            )
        ax.set_xscale("log")
        ax.set_xlabel("total sparsity p / delay (log)")
        ax.set_ylabel("final test accuracy")
        ax.grid(alpha=0.3, which="both")
        ax.set_title(
            f"accuracy vs total sparsity, {iterations} iterations\n(purple: gradient only, yellow: temporal only, grey: none)"
        )
        fig.tight_layout()
        path = args.out / f"{name}_total_sparsity.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        figs.append(path)
        fedsim.publish_figures(figs, args.figures_to)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
