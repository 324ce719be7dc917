"""Client state on disk (``fedcomp.flower.persist``) and the wrapper's ``state_dict``: a server
that dies after round 3 (having sent round 4) and resumes from its round-3 state, with clients
that come back with an empty ``context.state``, ends with the uninterrupted run's model, bit for
bit. In process (the real mod and strategy, a fake training); the real deployment is
``tests/app/test_resume.py``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, Context, RecordDict

from fedcomp.flower import protocol
from fedcomp.flower.persist import KEEP, ClientStore, store_for
from fedcomp.flower.records import record_from_tensors
from fedcomp.flower.strategy import CompressionStrategy
from tests.flower.helpers import Client, FixedGrid, make_strategy, server_identity, tiny_model, train_round

__all__ = ["server_identity"]  # the autouse fixture, imported so it applies here

NODES = (1, 2, 3)


def _clients(state_dir: Path, ids: tuple[int, ...] = NODES) -> dict[int, Client]:
    """Clients with node ids ``ids`` on partitions 0, 1, ... (new ids: restarted SuperNodes)."""
    out = {}
    for partition, n in enumerate(ids):
        c = Client(n)
        c.ctx = Context(
            run_id=n, node_id=n, node_config={"partition-id": partition, "state-dir": str(state_dir)},
            state=RecordDict(), run_config={"run-name": "r"},
        )  # fmt: skip
        out[n] = c
    return out


def _copy_state(strategy: CompressionStrategy) -> dict[str, Any]:
    """The wrapper's state through torch.save/torch.load, as a checkpoint holds it."""
    buf = io.BytesIO()
    torch.save(strategy.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _run(strategy: CompressionStrategy, clients: dict[int, Client], rounds: range, model: dict) -> dict:
    for rnd in rounds:
        new, _ = train_round(strategy, clients, rnd, model)
        model = new if new is not None else model  # None: no update aggregated, W stays
    return model


@pytest.mark.parametrize(
    "cfg",
    [
        {"sbc-p": 0.1},
        {"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 2, "gradiveq-refresh": 2},
        {"uplink-codec": "deft", "topk-density": 0.05},
        {"uplink-codec": "topk", "topk-density": 0.05},
    ],
    ids=["sbc", "gradiveq", "deft", "topk"],
)
def test_a_resumed_server_and_restored_clients_give_the_uninterrupted_model(tmp_path: Path, cfg: dict) -> None:
    full = _run(make_strategy(**cfg), _clients(tmp_path / "a"), range(1, 6), tiny_model())

    strategy = make_strategy(**cfg)
    clients = _clients(tmp_path / "b")
    model = _run(strategy, clients, range(1, 4), tiny_model())
    saved, saved_model = _copy_state(strategy), {k: v.clone() for k, v in model.items()}
    _run(strategy, clients, range(4, 5), model)  # round 4 reaches the clients; then the server dies

    resumed = make_strategy(**cfg)
    resumed.load_state_dict(saved)
    fresh = _clients(tmp_path / "b")  # a new Flower run: every context.state is empty
    final = _run(resumed, fresh, range(4, 6), saved_model)
    assert all(torch.equal(final[k], full[k]) for k in full)
    # The clients came back from disk: each took round 3's state, not the dead server's round 4.
    assert all(len(c.ctx.state) > 0 for c in fresh.values())


def test_without_the_clients_state_the_resumed_model_differs(tmp_path: Path) -> None:
    """The guard on the test above: clients that lose their state (residuals, replica) do change
    the model, so the equality there is the persistence's doing."""
    cfg = {"sbc-p": 0.1}
    full = _run(make_strategy(**cfg), _clients(tmp_path / "a"), range(1, 6), tiny_model())
    strategy = make_strategy(**cfg)
    model = _run(strategy, _clients(tmp_path / "b"), range(1, 4), tiny_model())
    resumed = make_strategy(**cfg)
    resumed.load_state_dict(_copy_state(strategy))
    final = _run(resumed, _clients(tmp_path / "elsewhere"), range(4, 6), model)
    assert not all(torch.equal(final[k], full[k]) for k in full)


def test_state_restored_under_new_node_ids_does_not_resend_an_aggregated_update(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SuperNodes that restart (or a resumed simulation) come back under new node ids, with their
    state on disk: the server has no record of them. Their pending updates (those of round 3, in
    the model it resumes from) count as aggregated, as they were, instead of going back into the
    residual to be applied twice; their replicas are rebuilt as a new node's, from what the server
    sends a node it does not know (a stale one would make it ask for a resync and lose the round)."""
    strategy = make_strategy(**{"sbc-p": 0.1})
    model = _run(strategy, _clients(tmp_path), range(1, 4), tiny_model())
    resumed = make_strategy(**{"sbc-p": 0.1})
    resumed.load_state_dict(_copy_state(strategy))
    fresh = _clients(tmp_path, ids=(11, 12, 13))
    with caplog.at_level("INFO", logger="flwr.fedcomp"):
        new, log = train_round(resumed, fresh, 4, model)
    assert new is not None and resumed.traffic[4].accepted == 3  # no client lost the round to a resync
    messages = [r.getMessage() for r in caplog.records]
    assert sum("resumed the client state of round 3" in m for m in messages) == 3
    assert sum("its pending update is settled by the server's record of that node" in m for m in messages) == 3
    assert sum("dropped fedcomp.replica, fedcomp.meta" in m for m in messages) == 3
    assert not any("goes back into the residual" in m for m in messages), messages
    # Every update of round 3 was aggregated: the server lists no node, and sends no table.
    assert all(protocol.UNSETTLED_UPDATES not in log.downlinks[n] for n in (11, 12, 13))
    assert all(protocol.STATE_PENDING_NODE not in c.ctx.state for c in fresh.values())  # (settled)


def _partitioned(state_dir: Path, ids: tuple[int, ...]) -> dict[int, Client]:
    """:func:`_clients` whose training and example counts follow the partition, not the node id."""
    out = _clients(state_dir, ids)
    for partition, c in enumerate(out.values()):
        c.node = 100 + partition
    return out


@pytest.mark.parametrize("fate", ["never-arrived", "rejected", "aggregated"])
def test_a_supernode_restarted_mid_run_settles_its_pending_update_by_its_old_id(tmp_path: Path, fate: str) -> None:
    """Node 2's update of round 3 never reaches the server (its reply was in flight when the
    SuperNode went down), or is rejected, or is aggregated; it comes back as node 12 with the state
    it saved. The server's first message to the unknown node 12 lists its records of the nodes
    whose last round was not aggregated; the client finds its old id there and adds the update back
    to its residual, as node 2 would have had it stayed up (it counted as aggregated, and was lost):
    the run ends on the model of a run where node 2 never restarted."""
    from flwr.app import MetricRecord

    def tamper(node: int, reply: Any) -> Any:  # a reply the server rejects (a weight out of range)
        if fate == "rejected" and node == 2 and reply.has_content():
            name = next(iter(reply.content.metric_records))
            reply.content[name] = MetricRecord({"num-examples": -1})
        return reply

    def run(restart: bool, state_dir: Path) -> tuple[dict, list[str]]:
        strategy = make_strategy(**{"sbc-p": 0.1})
        clients, model = _partitioned(state_dir, NODES), tiny_model()
        for rnd in (1, 2, 3):
            drop = [2] if rnd == 3 and fate == "never-arrived" else []
            new, _ = train_round(strategy, clients, rnd, model, drop=drop, tamper=tamper if rnd == 3 else None)
            model = new if new is not None else model
        if restart:  # node 2's SuperNode restarts: a new node id, an empty context.state, its disk
            clients = {1: clients[1], 12: _partitioned(state_dir, (1, 12, 3))[12], 3: clients[3]}
            clients[12].node = 101
        logs = []
        for rnd in (4, 5):
            new, log = train_round(strategy, clients, rnd, model, nodes=list(clients))
            logs.append(log)
            assert new is not None and strategy.traffic[rnd].accepted == 3, strategy.traffic[rnd].rejected
            model = new
        table = logs[0].downlinks[12 if restart else 2].get(protocol.UNSETTLED_UPDATES)
        rows = [] if table is None else [n for n in (1, 2, 3) if protocol.unsettled_record(table, n) is not None]
        return model, [str(r) for r in rows]

    uninterrupted, _ = run(False, tmp_path / "a")
    restarted, rows = run(True, tmp_path / "b")
    assert rows == ([] if fate == "aggregated" else ["2"])  # only the node whose update was not aggregated
    assert all(torch.equal(restarted[k], uninterrupted[k]) for k in uninterrupted)


def test_deft_resumed_under_new_node_ids_in_partition_order_gives_the_uninterrupted_model(tmp_path: Path) -> None:
    """Restarted SuperNodes (or a resumed simulation) come back under new ids. Listed in partition
    order (SeededSampling's grid), they get the bins their partitions had: the resumed DEFT run
    ends on the uninterrupted model. (By node id, the new ids 30, 10, 20 gave other bins.)"""
    cfg = {"uplink-codec": "deft", "topk-density": 0.05}

    def clients(state_dir: Path, ids: tuple[int, ...]) -> dict[int, Client]:
        out = _clients(state_dir, ids)
        for partition, c in enumerate(out.values()):
            c.node = 100 + partition  # what it trains on follows its partition, not its id
        return out

    def run(strategy: CompressionStrategy, cs: dict[int, Client], rounds: range, model: dict) -> dict:
        for rnd in rounds:
            new, _ = train_round(strategy, cs, rnd, model, nodes=list(cs))  # (listed in partition order)
            assert new is not None
            model = new
        return model

    full = run(make_strategy(**cfg), clients(tmp_path / "a", NODES), range(1, 6), tiny_model())
    strategy = make_strategy(**cfg)
    model = run(strategy, clients(tmp_path / "b", NODES), range(1, 4), tiny_model())
    resumed = make_strategy(**cfg)
    resumed.load_state_dict(_copy_state(strategy))
    final = run(resumed, clients(tmp_path / "b", (30, 10, 20)), range(4, 6), model)
    assert all(torch.equal(final[k], full[k]) for k in full)


def test_a_new_run_with_the_same_name_starts_clean(tmp_path: Path) -> None:
    strategy = make_strategy()
    _run(strategy, _clients(tmp_path), range(1, 3), tiny_model())
    other = make_strategy()  # another run: another lineage, whatever its name
    assert other.lineage != strategy.lineage
    clients = _clients(tmp_path)
    msgs = list(other.configure_train(3, __import__("flwr").app.ArrayRecord(tiny_model()), ConfigRecord({}),
                                      FixedGrid(NODES)))  # fmt: skip
    clients[1].handle(msgs[0])
    store = store_for({"run-name": "r"}, {"partition-id": 0, "state-dir": str(tmp_path)}, other.lineage)
    assert store is not None and store.rounds() == [3]  # nothing of the old run was loaded or kept


def test_snapshots_are_atomic_bounded_and_a_damaged_one_is_skipped(tmp_path: Path) -> None:
    store = ClientStore(tmp_path / "c")
    for rnd in range(1, 7):
        store.save(RecordDict({"x": ConfigRecord({"round": rnd})}), rnd)
    assert store.rounds() == list(range(7 - KEEP, 7))
    assert not [p for p in store.folder.iterdir() if p.name.startswith(".")]  # no temp file left
    found = store.load_before(6)
    assert found is not None and found[0] == 5 and found[1]["x"]["round"] == 5  # type: ignore[index]
    path = store.path(5)
    path.write_bytes(path.read_bytes()[:-3])  # truncated
    found = store.load_before(6)
    assert found is not None and found[0] == 4  # the damaged one skipped, the next older taken
    store.path(4).write_bytes(b"garbage")
    store.path(3).write_bytes(b"")
    assert store.load_before(6) is None


def test_no_persistence_without_a_partition_a_lineage_or_when_off(tmp_path: Path) -> None:
    assert store_for({}, {"partition-id": 0, "state-dir": "off"}, "ab12") is None
    assert store_for({}, {"state-dir": str(tmp_path)}, "ab12") is None
    assert store_for({}, {"partition-id": 0, "state-dir": str(tmp_path)}, None) is None
    assert store_for({}, {"partition-id": 0, "state-dir": str(tmp_path)}, "../../etc") is None
    s = store_for({"run-name": "../x"}, {"partition-id": 0, "state-dir": str(tmp_path)}, "ab12")
    assert s is not None and s.folder.resolve().is_relative_to(tmp_path.resolve())


def _run_ordered(reverse: bool, state_dir: Path) -> dict:
    """Three rounds with the replies handed to the wrapper in node order or reversed."""
    from fedcomp.flower.records import record_from_tensors, tensors_from_record

    strategy, clients, model = make_strategy(**{"sbc-p": 0.1}), _clients(state_dir), tiny_model()
    for rnd in range(1, 4):
        msgs = list(strategy.configure_train(rnd, record_from_tensors(model), ConfigRecord({}), FixedGrid(NODES)))
        replies = [clients[m.metadata.dst_node_id].handle(m) for m in msgs]
        arrays, _ = strategy.aggregate_train(rnd, replies[::-1] if reverse else replies)
        assert arrays is not None
        model = tensors_from_record(arrays)
    return model


def test_the_aggregate_does_not_depend_on_the_order_replies_arrive_in(tmp_path: Path) -> None:
    """Float sums depend on their order; replies arrive in any order: the wrapper sorts them, so
    two runs with the same seed (or a resumed one) end with the same bits."""
    a, b = _run_ordered(False, tmp_path / "a"), _run_ordered(True, tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_node_keeps_the_state_of_the_last_few_runs_of_a_name(tmp_path: Path) -> None:
    import os

    from fedcomp.flower.persist import KEEP_RUNS

    tokens = [f"{i:04x}" for i in range(KEEP_RUNS + 2)]
    for i, token in enumerate(tokens):
        store = store_for({"run-name": "same"}, {"partition-id": 0, "state-dir": str(tmp_path)}, token)
        assert store is not None
        store.save(RecordDict({"x": ConfigRecord({"i": i})}), 1)
        os.utime(store.folder.parent, (1000 + i, 1000 + i))  # distinct ages, oldest first
    kept = sorted(p.name for p in (tmp_path / "same").iterdir())
    assert kept == tokens[-KEEP_RUNS:]


def test_a_node_keeps_the_state_of_the_last_few_run_names(tmp_path: Path) -> None:
    """Run names are often unique (timestamps): the folder stays bounded across names too."""
    import os

    from fedcomp.flower.persist import KEEP_RUN_NAMES

    names = [f"run-{i:02d}" for i in range(KEEP_RUN_NAMES + 3)]
    for i, name in enumerate(names):
        store = store_for({"run-name": name}, {"partition-id": 0, "state-dir": str(tmp_path)}, "ab12")
        assert store is not None
        store.save(RecordDict({"x": ConfigRecord({"i": i})}), 1)
        os.utime(tmp_path / name, (1000 + i, 1000 + i))  # distinct ages, oldest first
    assert sorted(p.name for p in tmp_path.iterdir()) == names[-KEEP_RUN_NAMES:]


def test_a_client_whose_state_cannot_be_written_still_replies(tmp_path: Path) -> None:
    """Persistence buys resumability; a full or unwritable disk must not cost the round."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_bytes(b"")
    strategy, clients, model = make_strategy(**{"sbc-p": 0.1}), _clients(blocker / "state"), tiny_model()
    from fedcomp.flower.records import record_from_tensors

    msgs = list(strategy.configure_train(1, record_from_tensors(model), ConfigRecord({}), FixedGrid(NODES)))
    replies = [clients[m.metadata.dst_node_id].handle(m) for m in msgs]
    assert all(not r.has_error() for r in replies)
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None and not blocker.is_dir()


def _node_2_rejected_in_round_3(tmp_path: Path) -> tuple[CompressionStrategy, dict[int, Client], dict]:
    """Three rounds of three partitioned clients; node 2's round-3 reply is rejected (a negative
    example count)."""
    from flwr.app import MetricRecord

    def reject(node: int, reply: Any) -> Any:
        if node == 2 and reply.has_content():
            reply.content[next(iter(reply.content.metric_records))] = MetricRecord({"num-examples": -1})
        return reply

    strategy = make_strategy(**{"sbc-p": 0.1})
    clients, model = _partitioned(tmp_path, NODES), tiny_model()
    for rnd in (1, 2, 3):
        model, _ = train_round(strategy, clients, rnd, model, tamper=reject if rnd == 3 else None)
    return strategy, clients, model


def test_an_outcome_sent_in_an_evaluate_message_that_never_arrived_still_settles_by_the_old_id(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 2's update of round 3 is rejected; the evaluate message of round 3, which would tell
    it so, never reaches it (its SuperNode went down first), and it comes back as node 12. The
    server keeps listing node 2 until node 2 answers a message that told it: node 12 finds its
    row and adds the update back (dropping the row when the message was sent lost it)."""
    from tests.flower.helpers import FixedGrid

    strategy, clients, model = _node_2_rejected_in_round_3(tmp_path)
    msgs = list(strategy.configure_evaluate(3, record_from_tensors(model), ConfigRecord({}), FixedGrid([1, 2, 3])))
    replies = [clients[m.metadata.dst_node_id].handle(m) for m in msgs if m.metadata.dst_node_id != 2]
    strategy.aggregate_evaluate(3, replies)  # (node 2 never got its message)
    restarted = {1: clients[1], 12: _partitioned(tmp_path, (1, 12, 3))[12], 3: clients[3]}
    restarted[12].node = 101
    with caplog.at_level("WARNING", logger="flwr.fedcomp"):
        _, log = train_round(strategy, restarted, 4, model, nodes=list(restarted))
    table = log.downlinks[12][protocol.UNSETTLED_UPDATES]
    assert protocol.unsettled_record(table, 2) == (3, protocol.UpdateStatus.REJECTED)
    assert protocol.unsettled_record(table, 1) is None and protocol.unsettled_record(table, 3) is None
    assert "the update of round 3 was not aggregated (rejected: as node 2)" in caplog.text


def test_a_restored_update_older_than_the_old_ids_record_is_not_added_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 2's update of round 2 is aggregated, its round-3 update rejected; it comes back as node
    12 and its first message is round 3's evaluate, so it restores its round-2 snapshot (the state
    before that round's messages), pending the round-2 update. The server's row for node 2 is of
    round 3: the round-2 update was settled before the client made that one, and it counts as
    aggregated (it was added back, and applied twice)."""
    from tests.flower.helpers import FixedGrid

    strategy, clients, model = _node_2_rejected_in_round_3(tmp_path)
    restarted = _partitioned(tmp_path, (1, 12, 3))[12]
    restarted.node = 101
    msgs = list(strategy.configure_evaluate(3, record_from_tensors(model), ConfigRecord({}), FixedGrid([12])))
    table = msgs[0].content.config_records[protocol.DOWNLINK][protocol.UNSETTLED_UPDATES]
    assert protocol.unsettled_record(table, 2) == (3, protocol.UpdateStatus.REJECTED)  # type: ignore[arg-type]
    with caplog.at_level("INFO", logger="flwr.fedcomp"):
        reply = restarted.handle(msgs[0])
    assert not reply.has_error()
    assert "resumed the client state of round 2" in caplog.text
    assert "goes back into the residual" not in caplog.text
    assert protocol.STATE_PENDING not in restarted.ctx.state and protocol.STATE_PENDING_NODE not in restarted.ctx.state
