"""CompressionStrategy(FedAvg) end to end in process, paired with compression_mod: updates are
applied to the global model W (not the replica R), stale or hostile replies are rejected without
stopping the round, every byte is accounted, and clients that skip rounds or lose their state
are brought back (train and evaluate rounds)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from flwr.app import Message, MetricRecord, RecordDict

from fedcomp.codecs import SBC, DenseFP16, TopK
from fedcomp.flower import protocol
from fedcomp.flower.records import record_from_tensors
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.methods.deft_uplink import DeftUplink
from fedcomp.methods.update import UpdateEncoder
from fedcomp.wire.serde import update_from_bytes, update_to_bytes
from tests.flower.helpers import (
    ARRAYS,
    METRICS,
    MIN_NUMEL,
    Client,
    FixedGrid,
    RoundLog,
    context,
    decode_payload,
    evaluate_round,
    extras_bytes,
    make_strategy,
    max_abs_diff,
    mode_of,
    n_params,
    num_examples,
    payloads_of,
    record_bytes,
    server_identity,  # noqa: F401 (autouse fixture)
    tiny_model,
    train_round,
    uplink_of,
    weighted_mean,
    with_fields,
)

NODES = (1, 2, 3)


def _clients(nodes: tuple[int, ...] = NODES) -> dict[int, Client]:
    return {n: Client(n) for n in nodes}


def _payload(rec: Mapping[str, Any]) -> bytes:
    report = protocol.UplinkReport.from_record(rec)
    assert report.payload is not None
    return report.payload


def _decoded(
    strategy: CompressionStrategy, log: RoundLog, rnd: int, nodes: Any = None
) -> dict[int, dict[str, torch.Tensor]]:
    """Each (accepted) client's delta, decoded from the bytes it sent."""
    codec = strategy.config.uplink_codec_at(rnd)
    model = tiny_model()
    nodes = log.uplinks if nodes is None else nodes
    return {n: decode_payload(_payload(log.uplinks[n]), model, codec) for n in nodes}


def _assert_model(got: Mapping[str, torch.Tensor] | None, expected: Mapping[str, torch.Tensor]) -> None:
    assert got is not None
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-6, atol=1e-6)


# --- W + delta ----------------------------------------------------------------------------------


def test_deltas_are_applied_to_the_global_model_not_the_replica() -> None:
    strategy, clients = make_strategy(), _clients()
    w = tiny_model()
    for r in (1, 2, 3, 4):
        w_next, log = train_round(strategy, clients, r, w)
        assert strategy.traffic[r].rejected == {}
        assert strategy.replica is not None
        replica = {k: v.clone() for k, v in strategy.replica.tensors.items()}
        mean = weighted_mean(_decoded(strategy, log, r))
        _assert_model(w_next, {k: w[k] + mean[k] for k in w})
        if r == 1:
            # The first downlink is the full model: R == W, both rules agree.
            assert max_abs_diff(replica, w) == 0.0
        else:
            # 3LC is lossy: R != W, and the update must not be rebased on R.
            assert max_abs_diff(replica, w) > 1e-4
            assert w_next is not None
            assert max_abs_diff(w_next, {k: replica[k] + mean[k] for k in w}) > 1e-4
            # The clients trained from R (what they were sent), not from W.
            for c in clients.values():
                assert all(torch.equal(c.seen[r][0][k], replica[k]) for k in replica)
        assert w_next is not None
        w = w_next


# --- rejections ----------------------------------------------------------------------------------


def _reencode(rec: Mapping[str, Any], **change: Any) -> bytes:
    update = update_from_bytes(_payload(rec))
    return update_to_bytes(dataclasses.replace(update, **change))


def _encode(delta: Mapping[str, torch.Tensor], version: int, codec: Any = None) -> bytes:
    enc = UpdateEncoder(codec or SBC(p=0.01), min_numel=MIN_NUMEL, error_feedback=False)
    return update_to_bytes(enc.encode(dict(delta), base_model_version=version))


def _tamper_uplink(fn: Callable[[Mapping[str, Any], int], dict[str, Any]]) -> Callable[[Message, int], Message]:
    """A reply whose uplink record fields are replaced by ``fn(record, replica_version)``."""

    def tamper(reply: Message, version: int) -> Message:
        rec = uplink_of(reply)
        reply.content[protocol.UPLINK] = with_fields(rec, **fn(rec, version))
        return reply

    return tamper


def _no_uplink(reply: Message, version: int) -> Message:
    """A client without the mod: a plain trained model and no uplink record."""
    model = {k: v + 0.5 for k, v in tiny_model().items()}
    reply.content = RecordDict(
        {ARRAYS: record_from_tensors(model), METRICS: MetricRecord({"num-examples": num_examples(2)})}
    )
    return reply


def _drop(*fields: str) -> Callable[[Message, int], Message]:
    def tamper(reply: Message, version: int) -> Message:
        reply.content[protocol.UPLINK] = with_fields(uplink_of(reply), drop=fields)
        return reply

    return tamper


def _delta(**shapes: tuple[int, ...]) -> dict[str, torch.Tensor]:
    base = {k: torch.full(v.shape, 0.01) for k, v in tiny_model().items()}
    for k, s in shapes.items():
        if s == ():
            base.pop(k)
        else:
            base[k] = torch.full(s, 0.01)
    return base


#: why -> (how node 2's reply is spoiled, a word its rejection reason must contain, if any)
REJECTIONS: dict[str, tuple[Callable[[Message, int], Message], str]] = {
    "no-uplink-record": (_no_uplink, protocol.UPLINK),
    "no-payload": (_drop("payload"), "payload"),
    "payload-not-bytes": (_tamper_uplink(lambda rec, v: {"payload": "not bytes"}), "payload"),
    "payload-empty": (_tamper_uplink(lambda rec, v: {"payload": b""}), ""),
    "payload-truncated": (_tamper_uplink(lambda rec, v: {"payload": _payload(rec)[: len(_payload(rec)) // 2]}), ""),
    "payload-garbage": (_tamper_uplink(lambda rec, v: {"payload": b"\xff\xfe garbage \x00" * 8}), ""),
    "stale-base-version": (
        _tamper_uplink(lambda rec, v: {"payload": _reencode(rec, base_model_version=v - 1)}),
        "version",
    ),
    "future-base-version": (
        _tamper_uplink(lambda rec, v: {"payload": _reencode(rec, base_model_version=v + 1)}),
        "version",
    ),
    "tensor-missing": (_tamper_uplink(lambda rec, v: {"payload": _encode(_delta(w2=()), v)}), "tensors"),
    "tensor-extra": (
        _tamper_uplink(lambda rec, v: {"payload": _encode({**_delta(), "w3": torch.zeros(5)}, v)}),
        "tensors",
    ),
    "tensor-renamed": (
        _tamper_uplink(
            lambda rec, v: {"payload": _encode({("w9" if k == "w2" else k): t for k, t in _delta().items()}, v)}
        ),
        "w9",
    ),
    "tensor-reordered": (
        _tamper_uplink(lambda rec, v: {"payload": _encode(dict(reversed(_delta().items())), v)}),
        "w1",
    ),
    "tensor-wrong-shape": (_tamper_uplink(lambda rec, v: {"payload": _encode(_delta(w1=(40, 49)), v)}), "shape"),
    "codec-not-accepted": (_tamper_uplink(lambda rec, v: {"payload": _encode(_delta(), v, DenseFP16())}), "dense-fp16"),
    # Uplink record fields that do not parse.
    "replica-version-not-int": (_tamper_uplink(lambda rec, v: {"replica_version": "one"}), "replica-version"),
    "replica-digest-not-str": (_tamper_uplink(lambda rec, v: {"replica_digest": 12345}), "replica-digest"),
    "replica-version-missing": (_drop("replica-version"), "replica-version"),
    "sbc-p-not-a-number": (_tamper_uplink(lambda rec, v: {"sbc_p": "fast"}), ""),
    "fits-not-bool": (_tamper_uplink(lambda rec, v: {"fits": 3}), "fits"),
    "unknown-field": (_tamper_uplink(lambda rec, v: {"bogus": 1}), "bogus"),
}


def _two_train_rounds(strategy: CompressionStrategy, clients: dict[int, Client], tamper: Any = None) -> tuple:
    """Round 1 clean; round 2 with ``tamper(reply, replica_version)`` on node 2's reply."""
    w1, _ = train_round(strategy, clients, 1, tiny_model())
    assert w1 is not None and strategy.traffic[1].rejected == {}

    def hook(node: int, reply: Message) -> Message:
        assert strategy.replica is not None
        return tamper(reply, strategy.replica.version) if (tamper is not None and node == 2) else reply

    w2, log = train_round(strategy, clients, 2, w1, tamper=hook)
    return w1, w2, log


@pytest.mark.parametrize("why", list(REJECTIONS))
def test_a_bad_reply_is_rejected_with_a_reason_and_the_round_goes_on(why: str) -> None:
    strategy, clients = make_strategy(), _clients()
    tamper, word = REJECTIONS[why]
    w1, w2, log = _two_train_rounds(strategy, clients, tamper)  # never raises
    rejected = strategy.traffic[2].rejected
    assert set(rejected) == {2}, rejected
    assert isinstance(rejected[2], str) and rejected[2].strip()
    assert word in rejected[2], rejected[2]
    # The others are aggregated as if node 2 had dropped out.
    mean = weighted_mean(_decoded(strategy, log, 2, nodes=(1, 3)))
    _assert_model(w2, {k: w1[k] + mean[k] for k in w1})


def test_a_stale_update_is_rejected_and_its_client_stays_in_sync() -> None:
    strategy, clients = make_strategy(), _clients()
    _w1, w2, log = _two_train_rounds(strategy, clients, REJECTIONS["stale-base-version"][0])
    assert strategy.replica is not None
    assert update_from_bytes(_payload(log.uplinks[2])).base_model_version == strategy.replica.version - 1
    assert "version" in strategy.traffic[2].rejected[2]
    assert w2 is not None
    # Only the update was lost: the client's replica is still good, so it gets a chain next.
    _, log3 = train_round(strategy, clients, 3, w2)
    assert mode_of(log3.downlinks[2]) == "chain"
    assert strategy.traffic[3].rejected == {}


def test_the_untampered_rounds_reject_nothing() -> None:
    # The baseline every rejection test relies on: without tampering, node 2 is accepted.
    strategy, clients = make_strategy(), _clients()
    w1, w2, log = _two_train_rounds(strategy, clients)
    assert strategy.traffic[2].rejected == {}
    mean = weighted_mean(_decoded(strategy, log, 2))
    _assert_model(w2, {k: w1[k] + mean[k] for k in w1})


def test_a_deft_reply_selecting_outside_its_allocation_is_rejected() -> None:
    strategy, clients = make_strategy(**{"uplink-codec": "deft", "topk-density": 0.05}), _clients()

    def outside(reply: Message, version: int) -> Message:
        # Top-k over the whole tensors: entries in the other clients' partitions too.
        delta = {k: torch.linspace(-1, 1, v.numel()).reshape(v.shape) for k, v in tiny_model().items()}
        data = _encode(delta, version, TopK(p=0.05))
        reply.content[protocol.UPLINK] = with_fields(uplink_of(reply), payload=data)
        return reply

    w1, w2, _log = _two_train_rounds(strategy, clients, outside)
    assert set(strategy.traffic[2].rejected) == {2}
    assert "outside" in strategy.traffic[2].rejected[2]
    assert w2 is not None and all(torch.isfinite(t).all() for t in w2.values())
    assert max_abs_diff(w2, w1) < 0.5  # node 2's linspace delta (up to 1.0) was not aggregated
    # Honest DEFT clients are accepted in both rounds.
    assert strategy.traffic[1].rejected == {}


def test_deft_gives_its_bins_in_the_order_the_grid_lists_the_nodes() -> None:
    """Two runs whose nodes have other ids (a simulation draws new ones each run) but are listed in
    the same order (partition order, under SeededSampling) give each client the same allocations
    and end on the same model. In node-id order they gave the partitions other bins."""
    runs = []
    for ids in ((30, 10, 20), (5, 900, 70)):
        strategy = make_strategy(**{"uplink-codec": "deft", "topk-density": 0.05})
        clients = {n: Client(p) for n, p in zip(ids, (101, 102, 103), strict=True)}  # p: the partition
        w, allocations = tiny_model(), []
        for r in (1, 2, 3):
            w_next, log = train_round(strategy, clients, r, w, nodes=ids)
            assert strategy.traffic[r].rejected == {}
            allocations.append([log.downlinks[n][DeftUplink.ALLOCATION_KEY] for n in ids])
            assert w_next is not None
            w = w_next
        runs.append((allocations, w))
    (first, w_first), (again, w_again) = runs
    assert first == again
    assert all(len(set(per_round)) == 3 for per_round in first)  # three clients, three bins
    assert max_abs_diff(w_first, w_again) == 0.0


# --- accounting ----------------------------------------------------------------------------------


def _uplink_payload_len(rec: Mapping[str, Any]) -> int:
    """The payload and a method's own bytes (DEFT's norms): what the wrapper counts as uplink."""
    extras = sum(len(v) for k, v in rec.items() if "." in k and isinstance(v, bytes))
    try:
        return len(_payload(rec)) + extras
    except Exception:  # pre-refactor records with method status keys UplinkReport does not parse
        return len(rec["payload"]) + extras


@pytest.mark.parametrize(
    ("uplink", "extra_config"),
    [
        ("sbc", {}),
        ("deft", {"topk-density": 0.05}),
        ("gradiveq", {"gradiveq-dense-rounds": 1, "gradiveq-refresh": 2, "gradiveq-eps": 0.05, "gradiveq-slice": 50}),
    ],
    ids=["sbc", "deft", "gradiveq"],
)
def test_every_byte_is_accounted(uplink: str, extra_config: dict) -> None:
    strategy, clients = make_strategy(**{"uplink-codec": uplink, **extra_config}), _clients()
    w = tiny_model()
    dense = 4 * n_params(w)
    extras_seen = {}
    for r in (1, 2, 3):
        w_next, log = train_round(strategy, clients, r, w)
        t = strategy.traffic[r]
        assert t.rejected == {}
        assert set(t.downlink) == set(log.downlinks) == set(NODES)
        for n in NODES:
            dl = log.downlinks[n]
            assert t.downlink[n] == record_bytes(dl), (r, n)
            assert t.downlink_mode[n] == mode_of(dl)
            assert t.dense_downlink[n] == dense
            assert t.uplink[n] == _uplink_payload_len(log.uplinks[n])
            assert t.dense_uplink[n] == dense
        extras_seen[r] = {n: extras_bytes(log.downlinks[n]) for n in NODES}
        assert w_next is not None
        w = w_next
    if uplink == "deft":
        # Each client's allocation goes down with every train round.
        assert all(b > 0 for per_round in extras_seen.values() for b in per_round.values()), extras_seen
    elif uplink == "gradiveq":
        # Round 1 is dense; the compressor fitted after it goes down in round 2, once per client.
        assert all(b == 0 for b in extras_seen[1].values()), extras_seen
        assert all(b > 0 for b in extras_seen[2].values()), extras_seen
        assert all(b == 0 for b in extras_seen[3].values()), extras_seen
    else:
        assert all(b == 0 for per_round in extras_seen.values() for b in per_round.values()), extras_seen


def test_a_full_downlink_costs_the_dense_model() -> None:
    strategy, clients = make_strategy(), _clients()
    w = tiny_model()
    _, log1 = train_round(strategy, clients, 1, w)
    assert strategy.replica is not None
    full = strategy.traffic[1]
    for n in NODES:
        assert full.downlink_mode[n] == "full"
        # The full replica is dense fp32: the model's bytes plus a small envelope.
        assert dense_plus_envelope(full.downlink[n], 4 * n_params(w))
        assert full.downlink[n] == record_bytes(log1.downlinks[n])


def dense_plus_envelope(nbytes: int, dense: int) -> bool:
    return dense <= nbytes <= dense + 256


# --- who gets what --------------------------------------------------------------------------------


def test_downlink_modes_for_clients_that_skip_rounds() -> None:
    nodes = (1, 2, 3, 4)
    strategy, clients = make_strategy(**{"delta-log-size": 2}), _clients(nodes)
    w0 = tiny_model()
    w1, _ = train_round(strategy, clients, 1, w0)
    assert strategy.traffic[1].downlink_mode == dict.fromkeys(nodes, "full")
    assert w1 is not None
    # Round 2 samples nodes 1 and 2 (replica version 1); 3 and 4 sit it out.
    w2, _ = train_round(strategy, clients, 2, w1, nodes=[1, 2])
    t2 = strategy.traffic[2]
    assert t2.downlink_mode == {1: "chain", 2: "chain"} and set(t2.downlink) == {1, 2}
    assert w2 is not None
    # Round 3 (version 2): node 1 missed one delta, node 3 two; both within the log of two.
    w3, log3 = train_round(strategy, clients, 3, w2, nodes=[1, 3])
    t3 = strategy.traffic[3]
    assert t3.downlink_mode == {1: "chain", 3: "chain"}
    assert len(payloads_of(log3.downlinks[1])) == 1 and len(payloads_of(log3.downlinks[3])) == 2
    assert t3.rejected == {}
    assert w3 is not None
    # Evaluate with the new model (version 3): 1 and 3 follow the chain; training on the same
    # model then sends them nothing. Node 2 (version 1) gets the two deltas it lacks; node 4
    # (version 0) is beyond the log and gets the full replica.
    evaluate_round(strategy, clients, 3, w3, nodes=[1, 3])
    assert strategy.traffic[3].downlink_mode == {1: "chain", 3: "chain"}
    _, log4 = train_round(strategy, clients, 4, w3)
    t4 = strategy.traffic[4]
    assert t4.downlink_mode == {1: "none", 2: "chain", 3: "none", 4: "full"}
    assert t4.downlink[1] == t4.downlink[3] == 0
    assert len(payloads_of(log4.downlinks[2])) == 2
    assert t4.downlink[4] > 10 * t4.downlink[2]
    assert t4.rejected == {}
    assert strategy.replica is not None
    for n in nodes:
        assert protocol.UplinkReport.from_record(log4.uplinks[n]).replica_digest == strategy.replica.digest


def test_evaluate_rounds_also_resync() -> None:
    strategy, clients = make_strategy(), _clients((1, 2))
    w1, _ = train_round(strategy, clients, 1, tiny_model())
    assert w1 is not None
    # Node 1 lost its state; node 4 is new and has never been sent anything.
    clients[1].ctx = context(1)
    clients[4] = Client(4)
    calls = clients[1].calls
    _, log = evaluate_round(strategy, clients, 1, w1, nodes=[1, 2, 4])
    modes = strategy.traffic[1].downlink_mode
    assert (modes[1], modes[2], modes[4]) == ("chain", "chain", "full")
    err = log.replies[1]
    assert err.has_error() and err.error.code == protocol.ErrorCode.RESYNC and clients[1].calls == calls
    assert not log.replies[2].has_error() and not log.replies[4].has_error()
    # The next train round on the same model: node 1 gets the full replica, 2 and 4 are in sync.
    w2, log2 = train_round(strategy, clients, 2, w1, nodes=[1, 2, 4])
    assert strategy.traffic[2].downlink_mode == {1: "full", 2: "none", 4: "none"}
    assert strategy.traffic[2].rejected == {}
    assert all(not r.has_error() for r in log2.replies.values())
    assert w2 is not None


def test_a_client_app_without_the_mod_gets_a_hint_in_the_server_log(caplog: pytest.LogCaptureFixture) -> None:
    """A ClientApp without ``compression_mod`` finds no ``arrays`` record (the model travels in
    fedcomp's downlink record) and fails with a KeyError in the user's own code: the wrapper says
    once what is missing, on train and on evaluate replies alike; other failures get no hint."""
    from flwr.app import ConfigRecord, Error

    strategy, w = make_strategy(), tiny_model()
    msgs = list(strategy.configure_train(1, record_from_tensors(w), ConfigRecord({}), FixedGrid([1, 2, 3])))
    assert all("arrays" not in m.content.array_records for m in msgs)  # (what the app without the mod meets)
    other = Message(Error(code=0, reason="<class 'ZeroDivisionError'>:<'division by zero'>"), reply_to=msgs[0])
    missing = [Message(Error(code=0, reason="<class 'KeyError'>:<''arrays''>"), reply_to=m) for m in msgs[1:]]
    with caplog.at_level("WARNING", logger="flwr"):
        strategy.aggregate_train(1, [other])
        assert "compression_mod" not in caplog.text
        strategy.aggregate_train(1, missing)
        strategy.aggregate_evaluate(1, missing)
    hints = [
        r for r in caplog.records if "Does the ClientApp run it? ClientApp(mods=[compression_mod])" in r.getMessage()
    ]
    assert len(hints) == 1 and "looking for the ArrayRecord 'arrays'" in hints[0].getMessage()


def test_max_empty_rounds_train_rounds_without_an_update_end_the_run() -> None:
    """Every client failing (here: ClientApps without the mod) completed the run with the model it
    started from; now ``max-empty-rounds`` such train rounds in a row raise NoProgressError, naming
    the rounds and the clients' errors. A round that aggregates resets the streak, which a
    checkpoint keeps."""
    from flwr.app import ConfigRecord, Error

    from fedcomp.errors import NoProgressError

    strategy, w = make_strategy(**{"max-empty-rounds": 2}), tiny_model()
    clients = {n: Client(n) for n in (1, 2)}

    def failing_round(rnd: int) -> None:
        msgs = list(strategy.configure_train(rnd, record_from_tensors(w), ConfigRecord({}), FixedGrid([1, 2])))
        replies = [Message(Error(code=0, reason="<class 'KeyError'>:<''arrays''>"), reply_to=m) for m in msgs]
        assert strategy.aggregate_train(rnd, replies)[0] is None

    failing_round(1)
    new, _ = train_round(strategy, clients, 2, w)  # aggregates: the streak starts again
    assert new is not None
    failing_round(3)
    saved = strategy.state_dict()
    with pytest.raises(NoProgressError, match=r"in 2 train rounds in a row \(rounds 3-4; max-empty-rounds = 2\): "
                       r"2 client\(s\): error 0: <class 'KeyError'>"):  # fmt: skip
        failing_round(4)
    resumed = make_strategy(**{"max-empty-rounds": 2})
    resumed.load_state_dict(saved)
    strategy = resumed
    with pytest.raises(NoProgressError, match=r"rounds 3-4"):
        failing_round(4)
    # An app that ends such runs itself (the reference app, after recording the round) turns it off.
    quiet = make_strategy(**{"max-empty-rounds": 1})
    quiet.ends_empty_runs = False
    strategy = quiet
    failing_round(1)
    failing_round(2)
