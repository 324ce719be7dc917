"""ClientApp of the lost-update test app: a deterministic "training" (the model plus an update
seeded by node and round) inside the real compression_mod, and a fault mod outside it that cuts
the payload in transit or fails the reply, then writes the client's residual after every message."""

from __future__ import annotations

from pathlib import Path

import torch
from flwr.app import Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from fedcomp.flower import protocol
from fedcomp.flower.mod import compression_mod
from fedcomp.flower.records import record_from_tensors, tensors_from_record


def _run_dir(context: Context) -> Path:
    return Path(str(context.run_config["results-dir"])) / str(context.run_config["run-name"])


def fault_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    reply = call_next(msg, context)
    fault = msg.content.config_records["config"].get("test-fault", "") if "config" in msg.content else ""
    if fault == "truncate" and reply.has_content() and protocol.UPLINK in reply.content.config_records:
        up = reply.content.config_records[protocol.UPLINK]
        up["payload"] = up["payload"][: len(up["payload"]) // 2]  # type: ignore[index]
    elif fault == "error":
        reply = Message(Error(code=1, reason="test: the reply failed on the way"), reply_to=msg)
    residual = context.state.array_records.get(protocol.STATE_RESIDUAL)
    torch.save(
        {
            "residual": tensors_from_record(residual) if residual is not None else {},
            "pending": protocol.STATE_PENDING in context.state.config_records,
        },
        _run_dir(context) / f"client-{context.node_id}.pt",
    )
    return reply


app = ClientApp(mods=[fault_mod, compression_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    received = tensors_from_record(msg.content.array_records["arrays"])
    rnd = int(msg.content.config_records["config"]["server-round"])  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1_000_003 * (context.node_id % 1_000_003) + rnd)
    delta = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in received.items()}
    torch.save(delta, _run_dir(context) / f"delta-{context.node_id}-{rnd}.pt")
    trained = {k: received[k] + delta[k] for k in received}
    content = RecordDict({"arrays": record_from_tensors(trained), "metrics": MetricRecord({"num-examples": 10})})
    return Message(content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return Message(RecordDict({"metrics": MetricRecord({"num-examples": 10, "loss": 0.0})}), reply_to=msg)
