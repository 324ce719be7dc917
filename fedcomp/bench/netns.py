"""Dense FedAvg vs SBC + 3LC over real rate-limited links: measured round times and bytes.

    python -m fedcomp.bench netns [--nodes 2] [--rounds 4] [--mbps 10] [--latency-ms 0]
        [--local-iters 1] [--sbc-p 0.1] [--3lc-s 1.0] [--dataset digits] [--timeout 600] [--json PATH]

Runs the app twice on the Deployment Engine (:func:`fedcomp.net.deploy.deploy_local` with
``netns=True``): one SuperLink and ``--nodes`` SuperNodes, each in a network namespace of its own
behind a veth pair shaped with ``tc tbf`` to ``--mbps`` both ways (:mod:`fedcomp.net.netns`). First
plain FedAvg (``compress = false``), then SBC uplink + 3LC downlink, same seed and data. Prints,
per round, each run's real round time (SuperLink side: end of the previous round to the end of
this one, evaluation included), the payload bytes per client, and what the shaped links carried
(``tc -s``: every byte on the wire, Flower's gRPC framing, heartbeats and the app bundle
included). It also prints the time the payloads alone need at that rate, so the link's share of a
real round can be told from the fixed cost of a round on this machine (ClientApp processes,
training, codecs, evaluation).

Needs root (CAP_NET_ADMIN) and iproute2: elsewhere it prints ``SKIPPED: <reason>`` and exits 4.
Every process it starts is stopped by PID and every namespace deleted, also on failure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fedcomp.bench import DATASETS, choose_dataset, float_in, int_at_least
from fedcomp.net.links import LinkProfile

#: Exit code when network namespaces cannot be used here (as ``fedcomp.net.deploy local --netns``).
EXIT_SKIPPED = 4


def netns_unavailable_reason() -> str | None:
    """None when namespaces + veth + tc work here; else why not (after cleaning up the probe)."""
    from fedcomp.net.netns import NetnsLab, NetnsUnavailable

    probe = NetnsLab([LinkProfile(1, 1)])
    try:
        probe.setup()
    except NetnsUnavailable as err:
        return str(err)
    finally:
        probe.teardown()
    return None


def summarize(data: dict[str, Any], mbps: float) -> list[dict[str, Any]]:
    """Per round: real round time, mean payload bytes per client, and the payload-only link time
    of the slowest client (down + up at ``mbps``)."""
    rows = []
    for r in data["rounds"]:
        if int(r["round"]) == 0:
            continue
        c = r.get("clients") or {}
        down, up = list(c.get("downlink_bytes") or [0]), list(c.get("uplink_bytes") or [0])
        link_s = max(d * 8 / (mbps * 1e6) + u * 8 / (mbps * 1e6) for d, u in zip(down, up, strict=True))
        rows.append(
            {
                "round": int(r["round"]),
                "accuracy": float(r["accuracy"]),
                "round_time_s": float(r["round_time_s"]),
                "down_bytes": int(statistics.mean(down)),
                "up_bytes": int(statistics.mean(up)),
                "payload_link_s": link_s,
            }
        )
    return rows


def _run(name: str, cfg: dict[str, Any], args: argparse.Namespace, app_dir: Path) -> dict[str, Any]:
    from fedcomp.net.deploy import deploy_local, node_specs

    nodes = node_specs(args.nodes, f"{args.mbps:g},{args.mbps:g},{args.latency_ms:g}")
    t0 = time.monotonic()
    print(
        f"[bench netns] {name}: {args.nodes} SuperNodes at {args.mbps:g} Mbit/s, {args.rounds} rounds ...",
        file=sys.stderr,
        flush=True,
    )
    data = deploy_local(
        app_dir, nodes, cfg, rounds=args.rounds, timeout_s=args.timeout,
        results_dir=args.results_dir.resolve(), netns=True,
    )  # fmt: skip
    print(f"[bench netns] {name}: {data['status']} in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    return data


def main(argv: list[str] | None = None) -> int:
    from fedcomp.bench.links import _app_dir

    ap = argparse.ArgumentParser(prog="python -m fedcomp.bench netns", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="SuperNodes (= partitions), 1..10")
    ap.add_argument("--rounds", type=int, default=4, help="1..100")
    ap.add_argument(
        "--mbps", type=float_in(0.0, lo_open=True), default=10.0, help="every node's uplink and downlink, Mbit/s"
    )
    ap.add_argument("--latency-ms", type=float_in(0.0), default=0.0, help="one way; needs sch_netem in the kernel")
    ap.add_argument("--local-iters", type=int_at_least(1), default=1)
    ap.add_argument("--sbc-p", type=float_in(0.0, 0.5, lo_open=True), default=0.1)
    ap.add_argument("--3lc-s", dest="threelc_s", type=float_in(1.0, 2.0, hi_open=True), default=1.0)
    ap.add_argument(
        "--dataset", choices=DATASETS, default="digits", help="mnist and fashion-mnist: from $FEDCOMP_DATA_DIR"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results-dir", type=Path, default=Path("results/bench-netns"))
    ap.add_argument("--timeout", type=float_in(0.0, lo_open=True), default=600.0, help="per deployment, seconds")
    ap.add_argument("--json", type=Path, default=None, help="write both runs' rows here")
    args = ap.parse_args(argv)
    if not 1 <= args.nodes <= 10 or not 1 <= args.rounds <= 100:
        ap.error("--nodes in 1..10, --rounds in 1..100")
    if args.dataset != "digits":  # the deployment would fail on its first round without the data
        choose_dataset(ap, args.dataset, None, data_dir_option=None)

    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"SKIPPED: real shaped links need network namespaces: {reason}", file=sys.stderr)
        return EXIT_SKIPPED

    from fedcomp.net.deploy import DeployError

    common = {"dataset": args.dataset, "local-iters": args.local_iters, "seed": args.seed}
    runs = {
        "dense": {**common, "compress": False, "run-name": "netns-dense"},
        "compressed": {**common, "sbc-p": args.sbc_p, "3lc-s": args.threelc_s, "run-name": "netns-compressed"},
    }
    out: dict[str, Any] = {}
    for name, cfg in runs.items():
        try:
            data = _run(name, cfg, args, _app_dir())
        except DeployError as err:
            print(f"FAILED ({name}): {err}", file=sys.stderr)
            return 1
        if data.get("status") != "completed":
            print(f"FAILED ({name}): run status {data.get('status')!r}", file=sys.stderr)
            return 1
        net = data["_deploy"].get("netns", {})
        out[name] = {
            "rows": summarize(data, args.mbps),
            "sent_bytes": net.get("sent_bytes", {}),
            "latency_emulated": net.get("latency_emulated", False),
            "results": str(data["_deploy"]["results"]),
        }

    print(f"{args.nodes} SuperNodes, each behind a real {args.mbps:g} Mbit/s veth link (tc tbf) both ways"
          + ("" if out["dense"]["latency_emulated"] or args.latency_ms == 0 else "; latency NOT emulated (no sch_netem)")
          + f"; {args.dataset}, {args.local_iters} local iteration(s), SBC p = {args.sbc_p}, 3LC s = {args.threelc_s}")  # fmt: skip
    print(
        f"{'round':>5} | {'dense s':>8} {'down B':>9} {'up B':>9} {'link s':>7} | {'SBC+3LC s':>9} {'down B':>9} {'up B':>9} {'link s':>7}"
    )
    for d, c in zip(out["dense"]["rows"], out["compressed"]["rows"], strict=False):
        print(f"{d['round']:>5} | {d['round_time_s']:>8.2f} {d['down_bytes']:>9} {d['up_bytes']:>9} {d['payload_link_s']:>7.3f} | "
              f"{c['round_time_s']:>9.2f} {c['down_bytes']:>9} {c['up_bytes']:>9} {c['payload_link_s']:>7.3f}")  # fmt: skip
    for name in ("dense", "compressed"):
        rows = out[name]["rows"]
        later = [r["round_time_s"] for r in rows if r["round"] >= 2] or [r["round_time_s"] for r in rows]
        out[name]["mean_round_s_from_2"] = statistics.mean(later)
        wire = out[name]["sent_bytes"]
        total = {k: sum(int(v.get(k, 0)) for v in wire.values()) for k in ("down", "up")}
        out[name]["wire_bytes"] = total
        print(f"{name}: mean real round time (rounds >= 2) {out[name]['mean_round_s_from_2']:.2f}s; "
              f"bytes on the shaped links, all nodes, whole run: {total['down']} down / {total['up']} up")  # fmt: skip
    d, c = out["dense"]["mean_round_s_from_2"], out["compressed"]["mean_round_s_from_2"]
    print(f"real round-time ratio dense / SBC+3LC (rounds >= 2): {d / c:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, **out}, indent=1
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
