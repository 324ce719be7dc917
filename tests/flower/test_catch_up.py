"""Cheap catch-up for clients that were away: the delta log capped at one model's bytes, and the
seeded initial model (no model in round 1; a first participation gets the chain since version 0)."""

from __future__ import annotations

import torch

from fedcomp.codecs import get_codec
from fedcomp.flower import protocol
from fedcomp.flower.mod import make_compression_mod
from fedcomp.flower.replica import ServerReplica
from tests.flower.helpers import (  # noqa: F401  (server_identity: autouse fixture)
    Client,
    make_strategy,
    mode_of,
    payloads_of,
    server_identity,
    tiny_model,
    train_round,
)

MODEL = tiny_model()


class SeededClient(Client):
    """A client whose mod builds the run's initial model itself."""

    def __init__(self, node: int, initial: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__(node)
        own = {k: v.clone() for k, v in (initial or MODEL).items()}
        self.mod = make_compression_mod(initial_model=lambda ctx: own)

    def handle(self, msg):  # type: ignore[no-untyped-def]
        return self.mod(msg, self.ctx, self.app)


def test_the_log_never_holds_more_than_one_model_of_bytes() -> None:
    model = tiny_model()
    replica = ServerReplica(model, max_log=10_000, min_numel=0)
    dense = 4 * sum(t.numel() for t in model.values())
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # 3LC deltas of random moves: ~1.6 bits per value each
        model = {k: v + torch.randn(v.shape, generator=g) * 0.01 for k, v in model.items()}
        replica.advance(model, get_codec({"id": "3lc", "s": 1.0, "zero_run": False}))
    chain = replica.downlink_for(replica.version - 1, replica.digest_of(replica.version - 1))
    assert chain.mode == "chain"
    held = [v for v in range(replica.version + 1) if replica.digest_of(v) is not None]
    kept = replica.version - held[0]
    # Capped by bytes, far below the count cap, and never above one dense model.
    assert 3 <= kept < 200, kept
    oldest = replica.downlink_for(held[0], replica.digest_of(held[0]))
    assert oldest.mode == "chain" and oldest.nbytes <= dense
    older = replica.downlink_for(held[0] - 1, "any")
    assert older.mode == "full"


def test_seeded_clients_get_no_model_in_round_one_and_a_chain_on_first_participation() -> None:
    strategy = make_strategy(**{"seeded-initial-model": True})
    clients = {n: SeededClient(n) for n in (1, 2, 3)}
    model = {k: v.clone() for k, v in MODEL.items()}
    new, log = train_round(strategy, clients, 1, model, nodes=[1, 2])
    assert new is not None
    # Round 1: nothing but the header crosses the downlink; both clients trained from version 0.
    assert {n: mode_of(r) for n, r in log.downlinks.items()} == {1: "none", 2: "none"}
    assert all(payloads_of(r) == [] for r in log.downlinks.values())
    assert sum(strategy.traffic[1].downlink.values()) == 0
    assert not strategy.traffic[1].rejected and strategy.traffic[1].accepted == 2
    model = new
    new, _ = train_round(strategy, clients, 2, model, nodes=[1, 2])
    assert new is not None
    model = new
    # Round 3: node 3 takes part for the first time: the two deltas since version 0, not the model.
    new, log = train_round(strategy, clients, 3, model, nodes=[3])
    assert mode_of(log.downlinks[3]) == "chain" and len(payloads_of(log.downlinks[3])) == 2
    assert strategy.traffic[3].downlink[3] < 4 * sum(t.numel() for t in MODEL.values()) / 4
    assert strategy.traffic[3].accepted == 1
    # Its replica is the server's, bit for bit (the digest check passed; it is stored).
    assert log.uplinks[3]["replica-version"] == strategy.replica.version  # type: ignore[union-attr]


def test_a_client_with_another_initial_model_resyncs_once_then_gets_full_replicas() -> None:
    strategy = make_strategy(**{"seeded-initial-model": True})
    wrong = {k: v + 1.0 for k, v in MODEL.items()}
    clients = {1: SeededClient(1), 2: SeededClient(2, initial=wrong)}
    new, log = train_round(strategy, clients, 1, MODEL, nodes=[1, 2])
    assert new is not None
    reply = log.replies[2]
    assert reply.has_error() and reply.error.code == int(protocol.ErrorCode.RESYNC)
    assert strategy.traffic[1].accepted == 1
    new2, log = train_round(strategy, clients, 2, new, nodes=[1, 2])
    assert mode_of(log.downlinks[2]) == "full" and mode_of(log.downlinks[1]) == "chain"
    assert strategy.traffic[2].accepted == 2 and new2 is not None
    # From then on it is an ordinary client: a chain next time.
    _, log = train_round(strategy, clients, 3, new2, nodes=[1, 2])
    assert mode_of(log.downlinks[2]) == "chain"
    assert log.uplinks[2]["replica-version"] == strategy.replica.version  # type: ignore[union-attr]


def test_without_the_setting_a_new_client_gets_the_full_model() -> None:
    strategy = make_strategy()
    clients = {1: SeededClient(1)}
    _, log = train_round(strategy, clients, 1, MODEL, nodes=[1])
    assert mode_of(log.downlinks[1]) == "full"
    assert strategy.traffic[1].downlink[1] >= 4 * sum(t.numel() for t in MODEL.values())
