"""What a round costs in the Flower layer, beside the codecs: the server's and the clients' steps of
real rounds, timed in one process through the real wrapper and mod.

    python -m fedcomp.bench rounds [--model resnet50|lenet] [--clients 2] [--rounds 5]
                                   [--run-config "KEY=VALUE ..."] [--seed S] [--no-baseline]
                                   [--json PATH]

Each round, the global model (the ArrayRecord the last round's ``aggregate_train`` returned, as a
ServerApp holds it) goes through ``CompressionStrategy(FedAvg).configure_train`` (the server's
replica brought to it, its 3LC delta, the downlink headers: ``configure``), every client's message
through ``compression_mod`` around a ClientApp that "trains" by adding a fixed update of its own to
the model it is given (``client_mod``: the mod's work on that message, the ClientApp's own time left
out; ``client_app`` is that, its record conversions included), and the replies through
``aggregate_train`` (``aggregate``: decoding, the streaming sum, the inner FedAvg's step). The
clients' steps run one after the other, as on one core each; their figure is the median client's.

With the baseline (on by default), plain FedAvg runs the same rounds with the same ClientApp and no
fedcomp: what Flower itself costs for the same model. Every figure is the median over the rounds
after the first (the first sends the whole model and builds the clients' replicas), in seconds and
as a multiple of a warm ``copy_`` of the model's values into a buffer of their size, measured in the
same run (the floor: touching the model once). ``uplink_bytes`` and ``downlink_bytes`` are one
client's in the last round (the dense ones: 4 bytes a value).

Not measured here: Flower's transport (gRPC, the SuperLink, a deployment's ClientApp process per
message), training, and anything a simulation adds (``python -m fedcomp run``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedcomp.bench import int_at_least, write_rows
from fedcomp.bench.links import _median_seconds
from fedcomp.bench.server import MODELS, base_update, model_tensors
from fedcomp.bench.server import _grid as nodes_grid

#: The ClientApp's records (FedAvg's defaults: the wrapper and the mod follow the inner strategy's).
ARRAYS, METRICS = "arrays", "metrics"


def run(
    model_name: str, clients: int, rounds: int, run_config: dict[str, Any], seed: int, baseline: bool
) -> dict[str, Any]:
    """The benchmark's figures (the module docstring): ``fedcomp`` and, with ``baseline``,
    ``flower`` (plain FedAvg), each a dict of medians; the floor, the model's size."""
    from flwr.supercore.task_identity import TaskIdentity

    # Flower asks who is building a Message; a ServerApp or ClientApp process has this set by
    # Flower. Set for the run, then put back (a caller's process, a test's, keeps its own).
    names = ("_run_id", "_node_id", "_task_id")
    before: list[Any] = [getattr(TaskIdentity, name, None) for name in names]
    for name, set_to in zip(names, (1, 0, 1), strict=True):
        setattr(TaskIdentity, name, set_to)
    try:
        return _run(model_name, clients, rounds, run_config, seed, baseline)
    finally:
        for name, old in zip(names, before, strict=True):
            setattr(TaskIdentity, name, old)


def _run(
    model_name: str, clients: int, rounds: int, run_config: dict[str, Any], seed: int, baseline: bool
) -> dict[str, Any]:
    model = model_tensors(model_name, seed)
    updates = {node: base_update(model, seed + node) for node in range(1, clients + 1)}
    out: dict[str, Any] = {
        "model": model_name,
        "tensors": len(model),
        "numel": sum(t.numel() for t in model.values()),
        "clients": clients,
        "rounds": rounds,
        "run_config": dict(run_config),
        "copy_median_s": _copy_floor(model),
        "fedcomp": _rounds(model, updates, rounds, run_config, compressed=True),
    }
    if baseline:
        out["flower"] = _rounds(model, updates, rounds, run_config, compressed=False)
    floor = out["copy_median_s"]
    for key in ("fedcomp", "flower"):
        if key in out:
            for step in ("configure", "client_mod", "client_app", "aggregate"):
                if out[key].get(f"{step}_s") is not None:
                    out[key][f"{step}_copy_ratio"] = out[key][f"{step}_s"] / floor
    return out


def _copy_floor(model: dict[str, torch.Tensor], repeat: int = 20) -> float:
    """The median of warm copies of the model's values into a preallocated buffer (one pass)."""
    flat = torch.cat([t.reshape(-1) for t in model.values()])
    buf = torch.empty_like(flat)
    return _median_seconds(lambda: buf.copy_(flat), repeat)


def _rounds(
    model: dict[str, torch.Tensor],
    updates: dict[int, dict[str, torch.Tensor]],
    rounds: int,
    run_config: dict[str, Any],
    compressed: bool,
) -> dict[str, Any]:
    """``rounds`` rounds of every client, with fedcomp (``compressed``) or plain FedAvg."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.flower.mod import compression_mod
    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    inner = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)  # (evaluation: not run here)
    strategy: Any = CompressionStrategy(inner, CompressionConfig.from_run_config(run_config)) if compressed else inner
    contexts = {
        node: Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={}) for node in updates
    }
    app_seconds = 0.0

    def app(msg: Message, context: Context) -> Message:
        """A user's ClientApp: the model from its record, "trained", back as a record."""
        nonlocal app_seconds
        start = time.perf_counter()
        received = msg.content.array_records[ARRAYS].to_torch_state_dict()
        delta = updates[context.node_id]
        trained = {k: v + delta[k] for k, v in received.items()}
        content = RecordDict(
            {ARRAYS: ArrayRecord(trained), METRICS: MetricRecord({"num-examples": 10 + context.node_id})}
        )
        app_seconds += time.perf_counter() - start
        return Message(content, reply_to=msg)

    arrays = ArrayRecord({k: v.clone() for k, v in model.items()})
    steps: dict[str, list[float]] = {"configure": [], "client_mod": [], "client_app": [], "aggregate": []}
    last_bytes: tuple[int | None, int | None] = (None, None)
    for rnd in range(1, rounds + 1):
        start = time.perf_counter()
        messages = list(strategy.configure_train(rnd, arrays, ConfigRecord({"lr": 0.1}), nodes_grid(updates)))
        steps["configure"].append(time.perf_counter() - start)
        replies, mod_times, app_times = [], [], []
        for msg in messages:
            context = contexts[msg.metadata.dst_node_id]
            app_seconds = 0.0
            start = time.perf_counter()
            reply = compression_mod(msg, context, app) if compressed else app(msg, context)
            total = time.perf_counter() - start
            mod_times.append(total - app_seconds)
            app_times.append(app_seconds)
            if reply.has_error():
                raise RuntimeError(f"round {rnd}: client {context.node_id} replied an error: {reply.error.reason}")
            replies.append(reply)
        steps["client_mod"].append(statistics.median(mod_times))
        steps["client_app"].append(statistics.median(app_times))
        start = time.perf_counter()
        new_arrays, _ = strategy.aggregate_train(rnd, replies)
        steps["aggregate"].append(time.perf_counter() - start)
        if new_arrays is None:
            raise RuntimeError(f"round {rnd}: the strategy aggregated nothing")
        arrays = new_arrays
        if compressed:
            traffic = strategy.traffic[rnd]
            node = min(traffic.uplink)
            last_bytes = (traffic.uplink[node], traffic.downlink[node])
    later = slice(1, None) if rounds > 1 else slice(None)
    result: dict[str, Any] = {f"{k}_s": statistics.median(v[later]) for k, v in steps.items()}
    if not compressed:
        result["client_mod_s"] = None  # (no mod: the ClientApp is the client's whole step)
        numel = sum(t.numel() for t in model.values())
        last_bytes = (4 * numel, 4 * numel)
    result["uplink_bytes"], result["downlink_bytes"] = last_bytes
    result["per_round_s"] = [sum(v[i] for v in steps.values()) for i in range(rounds)]
    return result


def _table(out: dict[str, Any]) -> str:
    floor = out["copy_median_s"]
    lines = [
        f"{out['model']}: {out['tensors']} tensors, {out['numel']:,} values; {out['clients']} clients, "
        f"{out['rounds']} rounds (medians after the first); copy_ of the model {floor * 1e3:.3f} ms",
        f"{'':10} {'configure':>18} {'client mod':>18} {'client app':>18} {'aggregate':>18} {'uplink B':>12} "
        f"{'downlink B':>12}",
    ]

    def cell(value: float | None) -> str:
        return f"{'-':>18}" if value is None else f"{value * 1e3:8.1f} ms {value / floor:6.1f}x"

    for key in ("fedcomp", "flower"):
        if key in out:
            r = out[key]
            lines.append(
                f"{key:10} {cell(r['configure_s'])} {cell(r['client_mod_s'])} {cell(r['client_app_s'])} "
                f"{cell(r['aggregate_s'])} {r['uplink_bytes']:>12,} {r['downlink_bytes']:>12,}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None, out: Callable[[str], None] = print) -> int:
    from fedcomp.cli import parse_run_config

    ap = argparse.ArgumentParser(
        prog="python -m fedcomp.bench rounds", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    ap.add_argument("--model", choices=MODELS, default="resnet50")
    ap.add_argument("--clients", type=int_at_least(1), default=2)
    ap.add_argument("--rounds", type=int_at_least(2), default=5)
    ap.add_argument(
        "--run-config", "-c", action="append", default=[], metavar='"KEY=VALUE ..."',
        help="the wrapper's run-config keys, as for `python -m fedcomp run` (repeatable)",
    )  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip plain FedAvg")
    ap.add_argument("--json", type=Path, help="write the figures as JSON to this path")
    args = ap.parse_args(argv)
    run_config: dict[str, Any] = {}
    for text in args.run_config:
        run_config.update(parse_run_config(text))
    from fedcomp.methods.config import CompressionConfig

    unknown = sorted(set(run_config) - set(CompressionConfig.keys()))
    if unknown:  # (a Flower run config holds the app's keys too; here only the wrapper's mean anything)
        ap.error(f"--run-config: {', '.join(map(repr, unknown))} is not a key of the wrapper's run config")
    import flwr.common.logger  # noqa: F401  (Flower sets its logger's level on import: before ours)

    flwr_log = logging.getLogger("flwr")
    level = flwr_log.level
    flwr_log.setLevel(logging.WARNING)  # (Flower's and the wrapper's lines for every round)
    try:
        result = run(args.model, args.clients, args.rounds, run_config, args.seed, not args.no_baseline)
    finally:
        flwr_log.setLevel(level)
    out(_table(result))
    write_rows(args.json, result)
    return 0
