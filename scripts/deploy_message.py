"""What one train message costs a deployment's ClientApp process, the mod's part and Flower's.

    python scripts/deploy_message.py prepare STATE.bin [--rounds 3]
    python scripts/deploy_message.py handle STATE.bin          # once per fresh process

On the Deployment Engine a fresh ClientApp process serves every message: the SuperNode hands it
the message and the client's ``context.state`` as protobuf, and takes the state back the same way.
``prepare`` runs ``--rounds`` rounds of ``CompressionStrategy(FedAvg)`` (the default SBC p = 0.05
up, 3LC down, error feedback) with one ResNet-50-sized client in this process, then writes the next
round's train message and the client's context, as Flower serializes them, to ``STATE.bin``.
``handle``, run in a new process each time, reads them as Flower does and times
``compression_mod`` around a ClientApp that adds a fixed update to its model (the ClientApp's own
time included: a fraction of the mod's), then Flower's ``context_to_proto`` and serialization of
the state it takes back, and the process's peak RSS. Fresh processes have fresh memory: the mod's record writes and reads
fault their pages in, as they do in a deployment (``python -m fedcomp.bench rounds`` measures
warm rounds in one process).

A diagnostic for issue #13's Flower-layer figures (BENCHMARKS.md); it needs the Flower version
the project pins (its serde functions).
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.common.serde import context_from_proto, context_to_proto, message_from_proto, message_to_proto
from flwr.proto.message_pb2 import Context as ProtoContext
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.supercore.task_identity import TaskIdentity

from fedcomp.bench.server import _grid, base_update, model_tensors
from fedcomp.flower.mod import compression_mod

MODEL, SEED = "resnet50", 0


def _app(delta: dict[str, Any]) -> Any:
    def app(msg: Message, context: Context) -> Message:
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        trained = {k: v + delta[k] for k, v in received.items()}
        content = RecordDict({"arrays": ArrayRecord(trained), "metrics": MetricRecord({"num-examples": 10})})
        return Message(content, reply_to=msg)

    return app


def prepare(path: str, rounds: int) -> None:
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.flower.settings import CompressionConfig
    from fedcomp.flower.strategy import CompressionStrategy

    model = model_tensors(MODEL, SEED)
    app = _app(base_update(model, SEED + 1))
    inner = FedAvg(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1)
    strategy = CompressionStrategy(inner, CompressionConfig.from_run_config({}))
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    arrays = ArrayRecord({k: v.clone() for k, v in model.items()})
    for rnd in range(1, rounds + 2):
        msg = next(iter(strategy.configure_train(rnd, arrays, ConfigRecord({"lr": 0.1}), _grid([1]))))
        if rnd > rounds:
            break
        new, _ = strategy.aggregate_train(rnd, [compression_mod(msg, context, app)])
        assert new is not None, f"round {rnd} aggregated nothing"
        arrays = new
    m, c = message_to_proto(msg).SerializeToString(), context_to_proto(context).SerializeToString()
    with open(path, "wb") as f:
        f.write(len(m).to_bytes(8, "little") + m + c)
    print(f"{path}: a train message of {len(m):,} B, a context of {len(c):,} B")


def handle(path: str) -> None:
    model = model_tensors(MODEL, SEED)
    app = _app(base_update(model, SEED + 1))
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    pm, pc = ProtoMessage(), ProtoContext()
    pm.ParseFromString(data[8 : 8 + n])
    pc.ParseFromString(data[8 + n :])
    msg, context = message_from_proto(pm), context_from_proto(pc)
    t0 = time.perf_counter()
    reply = compression_mod(msg, context, app)
    t1 = time.perf_counter()
    if reply.has_error():
        raise SystemExit(f"the mod replied with an error: {reply.error}")
    out = context_to_proto(context).SerializeToString()
    t2 = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (kilobytes on Linux)
    print(
        f"mod {(t1 - t0) * 1e3:.1f} ms  state out (Flower) {(t2 - t1) * 1e3:.1f} ms  {len(out):,} B  peak RSS {peak / 2**20:,.0f} MiB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("step", choices=["prepare", "handle"])
    parser.add_argument("path")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # Flower asks who builds a Message; a ClientApp process has this set by Flower.
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 0, 1
    if args.step == "prepare":
        prepare(args.path, args.rounds)
    else:
        handle(args.path)


if __name__ == "__main__":
    main()
