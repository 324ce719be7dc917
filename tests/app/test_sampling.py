"""Reproducible client sampling in the reference app: the nodes listed in partition order
(``query_partitions`` answered by the real ``client_query``) and each round's sampling seeded
(``SeededRounds``), whatever else draws from ``random`` in between and whatever the node ids."""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedcomp.app.apps import SeededRounds, client_query
from fedcomp.app.fl import MeteredGrid, query_partitions
from fedcomp.app.results import RunRecorder


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    # What Flower sets in a real ServerApp process; Messages cannot be built without it.
    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


class _Nodes(Grid):
    """Nodes answering queries with the reference ClientApp's ``client_query``: ``configs`` maps
    each node id to its node config (None: its ClientApp fails). ``get_node_ids`` lists them in
    ``listing`` order (a simulation's ids are random, and so is their order)."""

    def __init__(self, configs: dict[int, dict[str, Any] | None]) -> None:
        self.configs = configs
        self.listing = list(configs)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.listing)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for m in messages:
            config = self.configs[m.metadata.dst_node_id]
            if config is None:
                replies.append(Message(Error(code=0, reason="no query handler"), reply_to=m))
                continue
            ctx = Context(
                run_id=1, node_id=m.metadata.dst_node_id, node_config=config, state=RecordDict(), run_config={}
            )
            reply = client_query(m, ctx)
            replies.append(reply)
        return replies

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError

    @property
    def run(self) -> Any:
        raise NotImplementedError

    def set_run(self, run_id: Any) -> None:
        raise NotImplementedError


def test_nodes_answer_their_partition_and_are_listed_in_its_order(tmp_path: Path) -> None:
    grid = _Nodes(
        {
            40: {"partition-id": 2, "num-partitions": 4},
            7: {"partition-id": 0, "num-partitions": 4},
            99: None,  # its ClientApp fails on the query
            3: {"num-partitions": 4},  # no partition-id in its node config
            12: {"partition-id": 1, "num-partitions": 4},
        }
    )
    order = query_partitions(grid, grid.get_node_ids())
    assert order == {40: 2, 7: 0, 12: 1}
    metered = MeteredGrid(grid, RunRecorder({}, tmp_path, "r", stream=None), dense_nbytes=4, node_order=order)
    assert list(metered.get_node_ids()) == [7, 12, 40, 3, 99]  # then the unknown ones, by id
    grid.listing.reverse()
    assert list(metered.get_node_ids()) == [7, 12, 40, 3, 99]
    assert list(MeteredGrid(grid, RunRecorder({}, tmp_path, "s", stream=None), 4).get_node_ids()) == grid.listing


def _sampled_partitions(seed: int, ids: list[int], tmp_path: Path, noise: random.Random) -> list[list[int]]:
    """Partitions FedAvg samples (2 of 6 a round, rounds 1-5) through ``SeededRounds``, with the
    node ids ``ids`` (node ``ids[p]`` holds partition ``p``) listed in a shuffled order each round
    and ``random`` drawn from a varying number of times between rounds, as Flower's back-off and
    heartbeat jitter do."""
    grid = _Nodes({n: {"partition-id": p} for p, n in enumerate(ids)})
    order = query_partitions(grid, grid.get_node_ids())
    metered = MeteredGrid(grid, RunRecorder({}, tmp_path, f"r{noise.random()}", stream=None), 4, node_order=order)
    rounds = SeededRounds(FedAvg(fraction_train=1e-9, min_train_nodes=2, min_available_nodes=2), 0, seed)
    out = []
    for rnd in range(1, 6):
        noise.shuffle(grid.listing)
        for _ in range(noise.randrange(1, 50)):
            random.random()
        messages = rounds.configure_train(rnd, ArrayRecord(), ConfigRecord(), metered)
        out.append(sorted(order[m.metadata.dst_node_id] for m in messages))
    return out


def test_the_same_seed_samples_the_same_partitions_in_every_round(tmp_path: Path) -> None:
    first = _sampled_partitions(0, [901, 55, 3070, 18, 444, 7], tmp_path, random.Random(1))
    again = _sampled_partitions(0, [12, 8000, 5, 61, 300, 2], tmp_path, random.Random(2))  # another run's ids
    assert first == again
    assert len({tuple(s) for s in first}) > 1  # the rounds do sample differently
    assert _sampled_partitions(1, [901, 55, 3070, 18, 444, 7], tmp_path, random.Random(1)) != first
    # A resumed run (3 rounds done) samples rounds 4 and 5 as the uninterrupted one did.
    grid = _Nodes({n: {"partition-id": p} for p, n in enumerate([5, 6, 7, 8, 9, 10])})
    metered = MeteredGrid(
        grid,
        RunRecorder({}, tmp_path, "resumed", stream=None),
        4,
        node_order=query_partitions(grid, grid.get_node_ids()),
    )
    resumed = SeededRounds(FedAvg(fraction_train=1e-9, min_train_nodes=2, min_available_nodes=2), 3, 0)
    got = [
        sorted(m.metadata.dst_node_id - 5 for m in resumed.configure_train(r, ArrayRecord(), ConfigRecord(), metered))
        for r in (1, 2)
    ]
    assert got == first[3:]
