"""ClientApp of the fault-injection test app: the reference client plus a fault mod outside
fedcomp's compression mod (corrupts the stored replica before it runs, or the uplink after, or
replaces the uplink by a finite but huge update: what a hostile client can send; or skips the
compression mod, as a ClientApp built without it would)."""

from __future__ import annotations

import torch
from fault_server import EXTRA_KEYS
from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable

from fedcomp.app.apps import client_train
from fedcomp.codecs import DenseFP32
from fedcomp.flower import protocol as keys
from fedcomp.flower.mod import compression_mod
from fedcomp.methods.update import UpdateEncoder
from fedcomp.wire.serde import update_from_bytes, update_to_bytes


class InjectedFailure(RuntimeError):
    """What every ClientApp raises with ``fail-train = true``."""


def fault_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    if context.run_config.get("fail-train") is True:
        raise InjectedFailure("fail-train: this client fails every round (injected)")
    config = msg.content.config_records.get("config", {})
    if config.get("test-corrupt-replica") and keys.STATE_REPLICA in context.state.array_records:
        replica = context.state.array_records[keys.STATE_REPLICA]
        name = next(iter(replica))
        arr = replica[name].numpy().copy()
        arr.flat[0] += 1.0  # one silently flipped value: only the digest can tell
        replica[name] = type(replica[name]).from_numpy_ndarray(arr)
    if config.get("test-no-mod"):
        return train(msg, context)  # (the model is in fedcomp's downlink record: KeyError 'arrays')
    reply = call_next(msg, context)
    if config.get("test-corrupt-uplink") and reply.has_content() and keys.UPLINK in reply.content.config_records:
        up = reply.content.config_records[keys.UPLINK]
        up["payload"] = up["payload"][: len(up["payload"]) // 2]  # truncated in transit
    if config.get("test-huge-uplink") and reply.has_content() and keys.UPLINK in reply.content.config_records:
        up = reply.content.config_records[keys.UPLINK]
        update = update_from_bytes(up["payload"])
        huge = {t.name: torch.full(tuple(t.shape), 1e30) for t in update.tensors}  # finite, far off any grid
        enc = UpdateEncoder(DenseFP32(), min_numel=0, error_feedback=False).encode(huge, update.base_model_version)
        up["payload"] = update_to_bytes(enc)
    return reply


app = ClientApp(mods=[fault_mod, compression_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    return client_train(msg, context, extra_keys=EXTRA_KEYS)
