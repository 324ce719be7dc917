"""3LC Table 2 (downlink bits per value against the sparsity multiplier s), in one command.

    FEDCOMP_DATA_DIR=/work/shared/data python examples/threelc_table2.py [--out DIR] [--quick]

Lim et al. 2019, Table 2, reports the average compressed size per state-change value of 3LC on
ResNet-110 / CIFAR-10: 1.6 bits without zero-run encoding, 0.812 / 0.451 / 0.298 / 0.200 bits at
s = 1.00 / 1.50 / 1.75 / 1.90. Here 3LC compresses the real model deltas ``W_{t+1} - W_t`` of our
LeNet5-Caffe / MNIST runs as fedcomp's server does (``fedcomp.flower.replica.ServerReplica``:
each round it compresses ``W - R``, R the replica the clients hold, which is 3LC's error
accumulation), measured beside two training runs of SBC Table II (the same configs, so
``examples/sbc_table2.py``'s cached runs are reused when present):

* "Uncompressed": dense uplink, one iteration per round -- the closest to 3LC's setting, where
  workers pull the model change after every step;
* "SBC (2)": delay 10, SBC p = 1 % uplink -- the federated setting of this project.

Then three runs put 3LC in the loop (clients train from the 3LC replica R, their updates are
applied to W, as ``fedcomp.flower.strategy.CompressionStrategy`` does; SBC (2) uplink) at
s = 1.00, 1.50 and 1.90, to show what the downlink compression costs in accuracy: both the
server's model W and the replica R the clients hold are evaluated.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import fedsim
import sbc_table2
from fedsim import TABLE2_OBSERVERS

#: The paper's Table 2 (bits per value, compression ratio), by observer key.
PAPER = {
    "3lc-s1-nozre": (1.60, 20.0),
    "3lc-s1": (0.812, 39.4),
    "3lc-s1.5": (0.451, 70.9),
    "3lc-s1.75": (0.298, 107.0),
    "3lc-s1.9": (0.200, 160.0),
}
ROW_NAMES = {
    "3lc-s1-nozre": "No ZRE (s = 1.00)",
    "3lc-s1": "s = 1.00",
    "3lc-s1.5": "s = 1.50",
    "3lc-s1.75": "s = 1.75",
    "3lc-s1.9": "s = 1.90",
    "3lc-s1-min1000": "s = 1.00, tensors < 1000 dense",
}

SOURCES = [c for c, _ in sbc_table2.CONFIGS if c.label in ("Uncompressed", "SBC (2)")]
SBC2 = next(c for c in SOURCES if c.label == "SBC (2)")
IN_LOOP = [
    replace(SBC2, label=f"SBC (2) + 3LC s={s:.2f} downlink", observers=(), downlink="3lc", downlink_s=s)
    for s in (1.0, 1.5, 1.9)
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    fedsim.common_args(ap, fedsim.DEFAULT_RESULTS / "threelc_table2")
    ap.add_argument("--no-in-loop", action="store_true", help="skip the runs with 3LC in the loop")
    ap.add_argument(
        "--reuse",
        type=Path,
        action="append",
        default=None,
        help=f"other run folders whose cached runs may be reused (default: {fedsim.DEFAULT_RESULTS / 'sbc_table2'})",
    )
    ap.add_argument("--figures-to", type=Path, default=None, help="also copy the plots here (e.g. docs/figures)")
    args = ap.parse_args(argv)
    fedsim.check_data("mnist")
    reuse = args.reuse if args.reuse is not None else [fedsim.DEFAULT_RESULTS / "sbc_table2"]

    in_loop = [] if args.no_in_loop else IN_LOOP
    configs = fedsim.apply_mode(SOURCES + in_loop, args)
    results = fedsim.run_all(configs, args.out, also=reuse, force=args.force, jobs=args.jobs)
    sources, loops = results[: len(SOURCES)], results[len(SOURCES) :]

    header = ["3LC setting"]
    for r in sources:
        header += [f"{r['label']}: bits/value (wire)", f"{r['label']}: bits/value (payload)", f"{r['label']}: ratio"]
    header += ["paper: bits/value", "paper: ratio"]
    rows, table = [], []
    for o in TABLE2_OBSERVERS:
        row: dict[str, Any] = {
            "setting": ROW_NAMES[o.key],
            "key": o.key,
            "paper_bits_per_value": PAPER.get(o.key, (None,))[0],
        }
        line = [ROW_NAMES[o.key]]
        for r in sources:
            ob = r["observers"][o.key]
            row[r["label"]] = {
                "bits_per_value_wire": ob["bits_per_value_wire"],
                "bits_per_value_payload": ob["bits_per_value_payload"],
                "ratio_wire": 32 / ob["bits_per_value_wire"],
            }
            line += [
                f"{ob['bits_per_value_wire']:.3f}",
                f"{ob['bits_per_value_payload']:.3f}",
                f"x{32 / ob['bits_per_value_wire']:.1f}",
            ]
        paper = PAPER.get(o.key)
        line += ["-", "-"] if paper is None else [f"{paper[0]:.3f}", f"x{paper[1]:g}"]
        rows.append(row)
        table.append(line)
    text = (
        "3LC Table 2 on our model deltas (LeNet5-Caffe / MNIST, 4 clients, "
        f"{sources[0]['config']['iterations']} iterations); bits per model value per round, averaged over "
        "the run\n\n" + fedsim.md_table(header, table)
    )
    if loops:
        exact = sources[[r["label"] for r in sources].index("SBC (2)")]
        lt = [
            [
                exact["label"] + " (exact model, dense fp32 downlink)",
                f"{exact['final_acc']:.4f}",
                "-",
                f"{max(h['test_loss'] for h in exact['history'][1:]):.3f}",
                f"{exact['downlink']['bits_per_value']:.3f}",
            ]
        ]
        for r in loops:
            last = r["history"][-1]
            rep = last.get("replica_acc")
            worst = max(h["test_loss"] for h in r["history"][1:])
            lt.append(
                [
                    r["label"],
                    f"{r['final_acc']:.4f}",
                    "-" if rep is None else f"{rep:.4f}",
                    f"{worst:.3f}",
                    f"{r['downlink']['bits_per_value']:.3f}",
                ]
            )
            rows.append(
                {
                    "setting": r["label"],
                    "final_acc": r["final_acc"],
                    "final_replica_acc": rep,
                    "max_test_loss": worst,
                    "downlink_bits_per_value": r["downlink"]["bits_per_value"],
                    "config_hash": r["config_hash"],
                }
            )
        text += (
            "\n\n3LC in the loop (clients train from the 3LC replica R; updates applied to W)\n\n"
            + fedsim.md_table(
                ["run", "final accuracy, W", "final accuracy, R", "worst test loss, W", "downlink bits/value (wire)"],
                lt,
            )
        )
    times = "\n".join(f"- {r['label']}: {fedsim._fmt_s(r['timing_s']['total'])}" for r in results)
    text += "\n\nrun times (when each run was made):\n" + times
    print()
    print(text)
    fedsim.write_summary(args.out, "table2", rows, text)

    if not args.no_plots:
        import simplots

        figs = []
        for r in sources:
            series = [
                (ROW_NAMES[k], ob["bytes_per_round"], r["config"]["delay"], r["numel"])
                for k, ob in r["observers"].items()
            ]
            slug = fedsim._slug(r["label"])
            figs.append(
                simplots.downlink_bits_per_value(
                    series,
                    args.out / f"threelc_bits_per_round_{slug}.png",
                    f"3LC on the server's model deltas: {r['label']}",
                )
            )
        if loops:
            exact = sources[[r["label"] for r in sources].index("SBC (2)")]
            relabeled = [dict(exact, label="SBC (2), dense fp32 downlink"), *loops]
            figs.append(
                simplots.accuracy_vs_bits(
                    relabeled,
                    args.out / "threelc_accuracy_vs_downlink_bits.png",
                    "downlink",
                    "SBC (2) uplink; downlink exact vs 3LC in the loop",
                )
            )
        fedsim.publish_figures(figs, args.figures_to)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
