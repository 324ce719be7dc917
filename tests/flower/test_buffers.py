"""A model's non-float and 0-d arrays through the real mod and strategy: BatchNorm's
``num_batches_tracked`` (an int64 scalar), a bool mask, a learnable float scalar (a temperature).
Flower's own FedAvg averages them as it averages the rest; fedcomp carries them as float32 (exact
for integers up to 2**24) in every uplink and downlink method."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from flwr.app import ArrayRecord

from fedcomp.errors import ConfigError
from fedcomp.flower import protocol
from fedcomp.flower.records import tensors_from_record
from fedcomp.flower.replica import FINE_BITS
from tests.flower.helpers import (
    Client,
    make_strategy,
    num_examples,
    server_identity,  # noqa: F401 (autouse fixture)
    tiny_model,
    train_round,
)

STEP = 1000  # batches each client counts per round (the lattice's first-movement grid would be 2**13)


class _WithBuffers(Client):
    """Trains the float arrays as :class:`Client` does; counts ``STEP`` batches in the int64
    buffer it loaded as a model would (``load_state_dict`` casts the float32 it receives)."""

    def replied(self, received: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        counted = received["bn.num_batches_tracked"].to(torch.int64) + STEP
        return {**trained, "bn.num_batches_tracked": counted, "mask": received["mask"].to(torch.bool)}


def _model() -> dict[str, torch.Tensor]:
    return {
        **tiny_model(),
        "bn.running_var": torch.ones(1500),
        "bn.num_batches_tracked": torch.tensor(5, dtype=torch.int64),
        "mask": torch.ones(7, dtype=torch.bool),
        "temperature": torch.tensor(0.07),
    }


#: Every uplink and downlink method, in the settings these tests run them with.
METHODS: list[dict[str, Any]] = [
    {},
    {"downlink-codec": "lattice"},
    {"downlink-codec": "auto"},
    {"uplink-codec": "deft"},
    {"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 1},
    {"uplink-codec": "stc", "downlink-codec": "sparse-fp16"},
    {"uplink-codec": "topk"},
]


def _ids(config: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items()) or "defaults"


@pytest.mark.parametrize("config", METHODS, ids=_ids)
def test_integer_bool_and_scalar_arrays_travel_with_the_model(config: dict[str, Any]) -> None:
    strategy = make_strategy(**config)
    clients = {1: _WithBuffers(1), 2: _WithBuffers(2)}
    w = _model()
    for r in range(1, 4):
        w_next, _ = train_round(strategy, clients, r, w)
        assert w_next is not None and strategy.traffic[r].rejected == {}
        # every client counted STEP batches from the same count: the mean is exact, and so is the
        # count each client was handed this round (its replica), whatever the downlink
        assert float(w_next["bn.num_batches_tracked"]) == 5 + r * STEP
        for client in clients.values():
            held = tensors_from_record(client.ctx.state.array_records[protocol.STATE_REPLICA])
            assert float(held["bn.num_batches_tracked"]) == 5 + (r - 1) * STEP
        assert torch.equal(w_next["mask"], torch.ones(7))
        assert w_next["temperature"].shape == () and float(w_next["temperature"]) != float(w["temperature"])
        w = w_next


MOMENTUM = 0.65  # what ten batches at BatchNorm's momentum 0.1 leave of the start: 1 - 0.9**10


def _measured(node: int) -> torch.Tensor:
    """The variance client ``node`` measures on its own batches (small: a variance near 0.1 on a
    coarse grid rounds to 0 or a multiple of 0.5)."""
    return torch.rand(1500, generator=torch.Generator().manual_seed(node)) * 0.2 + 0.01


class _MeasuresStatistics(_WithBuffers):
    """As :class:`_WithBuffers`, and overwrites ``bn.running_var`` as BatchNorm does: an average
    that starts from the value it was handed and moves ``MOMENTUM`` of the way to its own batches'."""

    def replied(self, received: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        var = received["bn.running_var"] + MOMENTUM * (_measured(self.node) - received["bn.running_var"])
        return {**super().replied(received, trained), "bn.running_var": var}


@pytest.mark.parametrize("config", [*METHODS, {"downlink-codec": "lattice", "min-compress-numel": 2000}], ids=_ids)
def test_running_statistics_are_averaged_as_flower_averages_them(config: dict[str, Any]) -> None:
    """A running statistic of 1500 values (over ``min-compress-numel``) goes dense both ways, so the
    global one is the clients' weighted mean each round, as with plain FedAvg, whatever the
    methods. Before, SBC sent it sparse with error feedback and the lattice put it on a grid of
    0.5: a negative variance, then a NaN model, in the audit that found it."""
    strategy = make_strategy(**config)
    clients = {1: _MeasuresStatistics(1), 2: _MeasuresStatistics(2), 3: _MeasuresStatistics(3)}
    weights = {n: float(num_examples(n)) for n in clients}
    # the lattice's replica is the statistic on its fine grid (2**-13 here: the largest value is 1),
    # at most half a step off; W + update carries MOMENTUM of that each round, and the rounds'
    # shares decay by 1 - MOMENTUM: never more than half a step in all
    tolerance = 1e-6 + (2.0**-FINE_BITS if config.get("downlink-codec") == "lattice" else 0.0)
    w = _model()
    expected = w["bn.running_var"].double()
    for r in range(1, 5):
        w_next, _ = train_round(strategy, clients, r, w)
        assert w_next is not None and strategy.traffic[r].rejected == {}
        expected = sum(weights[n] * (expected + MOMENTUM * (_measured(n) - expected)) for n in clients)
        expected = expected / sum(weights.values())
        got = w_next["bn.running_var"].double()
        assert float((got - expected).abs().max()) <= tolerance, r
        assert bool((got > 0).all())
        w = w_next


@pytest.mark.parametrize("config", [{}, {"uplink-codec": "topk"}, {"uplink-codec": "deft"}], ids=str)
def test_a_lost_update_with_scalar_arrays_goes_back_into_the_residual(config: dict[str, Any]) -> None:
    """Client 1's round-1 update never reaches the server; it goes back into that client's
    residual, 0-d arrays (``num_batches_tracked``, a temperature) included, and the client trains
    on in later rounds (before, adding a 0-d residual failed every round after the loss)."""
    strategy = make_strategy(**config)
    clients = {1: _WithBuffers(1), 2: _WithBuffers(2)}
    n1, n2 = num_examples(1), num_examples(2)
    # the count: round 1 client 2's alone; round 2 client 1 sends its lost count too (sent dense);
    # round 3 both count on from the (integer) count they loaded
    expected = [5 + STEP, 5 + STEP + (n1 * 2 * STEP + n2 * STEP) / (n1 + n2)]
    expected.append(int(expected[-1]) + STEP)
    w = _model()
    for r in range(1, 4):
        w_next, log = train_round(strategy, clients, r, w, drop={1} if r == 1 else ())
        assert w_next is not None and strategy.traffic[r].rejected == {}
        assert not any(reply.has_error() for reply in log.replies.values()), r
        assert float(w_next["bn.num_batches_tracked"]) == pytest.approx(expected[r - 1], rel=1e-6)
        w = w_next
    # client 1's lost counts came back in its round-2 update: none left over
    residual = tensors_from_record(clients[1].ctx.state.array_records[protocol.STATE_RESIDUAL])
    assert float(residual.get("bn.num_batches_tracked", torch.tensor(0.0))) == 0.0


def test_arrays_that_float32_cannot_carry_are_config_errors_naming_them() -> None:
    too_big = ArrayRecord({"w": torch.zeros(3), "steps": torch.tensor([1, 2**24 + 1])})
    with pytest.raises(ConfigError, match=r"'steps' \(torch.int64\) holds 16777217: .*exact up to 2\*\*24"):
        tensors_from_record(too_big)
    lowest = ArrayRecord({"n": torch.tensor([-(2**63)])})  # (its abs() would overflow to itself)
    with pytest.raises(ConfigError, match="'n'.*holds -9223372036854775808"):
        tensors_from_record(lowest)
    exact = tensors_from_record(ArrayRecord({"n": torch.tensor([-(2**24), 2**24], dtype=torch.int32)}))
    assert exact["n"].tolist() == [-(2**24), 2**24] and exact["n"].dtype == torch.float32
    # an integer array large enough to be compressed would no longer be exact
    strategy = make_strategy()
    model = {**tiny_model(), "index": torch.arange(1000)}
    with pytest.raises(
        ConfigError, match=r"'index' \(int64, 1000 values\) would be compressed lossily.*min-compress-numel = 1000"
    ):
        train_round(strategy, {1: Client(1)}, 1, model)
