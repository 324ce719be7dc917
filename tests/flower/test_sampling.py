"""Reproducible client sampling (``fedcomp.flower.sampling``): nodes listed in partition order
(asked with a query that a real ClientApp answers through ``add_partition_query``, with the
compression mod in place) and each round's sampling seeded, whatever else draws from ``random``
in between and whatever the node ids."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from fedcomp.app.fl import MeteredGrid
from fedcomp.app.results import RunRecorder
from fedcomp.flower.mod import compression_mod
from fedcomp.flower.sampling import PARTITION_QUERY, SeededSampling, add_partition_query, query_partitions
from tests.flower.helpers import FixedGrid


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    # What Flower sets in a real ServerApp process; Messages cannot be built without it.
    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


def _client_app(answers: bool) -> ClientApp:
    """A ClientApp as a user builds one: the compression mod, a train handler, and (``answers``)
    the partition query registered."""
    app = ClientApp(mods=[compression_mod])

    @app.train()
    def train(msg: Message, ctx: Context) -> Message:  # pragma: no cover - never sent here
        raise AssertionError("no train message is sent in these tests")

    return add_partition_query(app) if answers else app


class _Nodes(FixedGrid):
    """Nodes running real ClientApps: ``configs`` maps each node id to its node config (None: a
    ClientApp without the partition query, which Flower answers with an error). ``get_node_ids``
    lists them in ``nodes`` order (a simulation's ids are random, and so is their order)."""

    def __init__(self, configs: dict[int, dict[str, Any] | None]) -> None:
        super().__init__(configs)
        self.configs = configs
        self.queries = 0
        self.apps = {True: _client_app(True), False: _client_app(False)}

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for m in messages:
            assert m.metadata.message_type == PARTITION_QUERY
            self.queries += 1
            config = self.configs[m.metadata.dst_node_id]
            ctx = Context(
                run_id=1, node_id=m.metadata.dst_node_id, node_config=config or {}, state=RecordDict(), run_config={}
            )
            try:
                replies.append(self.apps[config is not None](m, ctx))
            except ValueError as err:  # as Flower turns a ClientApp's exception into an error reply
                replies.append(Message(Error(code=0, reason=str(err)), reply_to=m))
        return replies


def test_nodes_answer_their_partition() -> None:
    grid = _Nodes(
        {
            40: {"partition-id": 2, "num-partitions": 4},
            7: {"partition-id": 0, "num-partitions": 4},
            99: None,  # its ClientApp does not answer the query
            3: {"num-partitions": 4},  # no partition-id in its node config
            12: {"partition-id": 1, "num-partitions": 4},
        }
    )
    assert query_partitions(grid, grid.get_node_ids()) == {40: 2, 7: 0, 12: 1}
    assert grid.queries == 5


def _sampled(seed: int, ids: list[int], tmp_path: Path, noise: random.Random, rounds: int = 5) -> list[list[int]]:
    """Partitions FedAvg samples (2 of 6 a round) through ``SeededSampling``, with the node ids
    ``ids`` (node ``ids[p]`` holds partition ``p``) listed in a shuffled order each round and
    ``random`` drawn from a varying number of times between rounds, as Flower's back-off and
    heartbeat jitter do; the grid meters traffic as the reference app's does."""
    grid = _Nodes({n: {"partition-id": p} for p, n in enumerate(ids)})
    recorder = RunRecorder({}, tmp_path, f"r{noise.random()}", stream=None)
    metered = MeteredGrid(grid, recorder, dense_nbytes=4)
    sampling = SeededSampling(FedAvg(fraction_train=1e-9, min_train_nodes=2, min_available_nodes=2), seed)
    out = []
    for rnd in range(1, rounds + 1):
        noise.shuffle(grid.nodes)
        for _ in range(noise.randrange(1, 50)):
            random.random()
        messages = list(sampling.configure_train(rnd, ArrayRecord(), ConfigRecord(), metered))
        out.append(sorted(sampling.partitions[m.metadata.dst_node_id] for m in messages))
        entry = recorder.end_round(rnd, accuracy=0.0, loss=0.0)
        assert entry["clients"]["ids"] == []  # the queries (round 1) are no round's traffic
    assert grid.queries == len(ids)  # each node asked once
    return out


def test_the_same_seed_samples_the_same_partitions_in_every_round(tmp_path: Path) -> None:
    first = _sampled(0, [901, 55, 3070, 18, 444, 7], tmp_path, random.Random(1))
    again = _sampled(0, [12, 8000, 5, 61, 300, 2], tmp_path, random.Random(2))  # another run's ids
    assert first == again
    assert len({tuple(s) for s in first}) > 1  # the rounds do sample differently
    assert _sampled(1, [901, 55, 3070, 18, 444, 7], tmp_path, random.Random(1)) != first


def test_a_node_that_joins_later_is_asked_then(tmp_path: Path) -> None:
    grid = _Nodes({5: {"partition-id": 0}, 6: {"partition-id": 1}})
    sampling = SeededSampling(FedAvg(fraction_train=1.0, min_train_nodes=2, min_available_nodes=2), 0)
    sampling.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
    grid.configs[9] = {"partition-id": 2}
    grid.nodes.append(9)
    messages = sampling.configure_train(2, ArrayRecord(), ConfigRecord(), grid)
    assert sampling.partitions == {5: 0, 6: 1, 9: 2} and grid.queries == 3
    assert sorted(m.metadata.dst_node_id for m in messages) == [5, 6, 9]
