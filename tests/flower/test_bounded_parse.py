"""The wire parser is bounded by the model (issue 14, item 1 measured 1.6M tiny tensors taking
8 s and 594 MB): the server's uplink decode, the replica's deltas and a client's full resync pass
the model's tensors to ``update_from_bytes``, so an update with more tensors than the model is
refused after scanning ``len(model) + 1`` of them, before any is built."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message

from fedcomp.codecs import DenseFP32
from fedcomp.errors import PayloadError
from fedcomp.flower import protocol
from fedcomp.flower.replica import apply_delta
from fedcomp.methods.update import UpdateEncoder, specs_of
from fedcomp.wire.serde import update_to_bytes
from tests.flower.helpers import Client, make_strategy, server_identity, tiny_model, train_round

__all__ = ["server_identity"]


def _with_extra_tensor(model: dict[str, torch.Tensor], version: int) -> bytes:
    """A well-formed update (valid checksum) of the model's tensors plus one more."""
    tensors = {**{k: torch.zeros_like(v) for k, v in model.items()}, "zz.extra": torch.zeros(2)}
    enc = UpdateEncoder(DenseFP32(), min_numel=0, error_feedback=False)
    return update_to_bytes(enc.encode(tensors, base_model_version=version))


def test_an_uplink_with_more_tensors_than_the_model_is_rejected_by_the_count() -> None:
    strategy, clients, model = make_strategy(), {1: Client(1), 2: Client(2)}, tiny_model()
    train_round(strategy, clients, 1, model)
    assert strategy.replica is not None
    version = strategy.replica.version

    def tamper(node: int, reply: Message) -> Message:
        if node == 2:
            rec = dict(reply.content.config_records[protocol.UPLINK])
            rec["payload"] = _with_extra_tensor(model, version)
            reply.content[protocol.UPLINK] = ConfigRecord(rec)
        return reply

    new, _ = train_round(strategy, clients, 2, model, tamper=tamper)
    assert new is not None  # the round went on with node 1
    assert "update has more than 3 tensors (the model's count)" in strategy.traffic[2].rejected[2]


def test_a_delta_with_more_tensors_than_the_replica_is_refused() -> None:
    replica = {k: v.clone() for k, v in tiny_model().items()}
    with pytest.raises(PayloadError, match=r"more than 3 tensors \(the model's count\)"):
        apply_delta(replica, _with_extra_tensor(replica, 0), specs_of(replica), DenseFP32(), 0)
