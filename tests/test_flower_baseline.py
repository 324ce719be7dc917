"""A real Flower simulation of the plain (uncompressed) baseline app, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcomp.testing.flower import alive_pids, find_marked_pids, run_simulation

# Real `flwr run` simulations (10 s to a minute each on 2 cores): out of the fast lane.
pytestmark = [pytest.mark.flower, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
ROUND_KEYS = {
    "round", "accuracy", "loss", "uplink_bytes", "downlink_bytes",
    "dense_uplink_bytes", "dense_downlink_bytes", "clients",
}  # fmt: skip
LENET5_FP32_BYTES = 431_080 * 4


def test_digits_simulation_learns_and_records(tmp_path: Path) -> None:
    clients = 3
    results = run_simulation(
        REPO,
        {"num-server-rounds": 3, "local-iters": 10, "dataset": "digits", "compress": False,
         "results-dir": str(tmp_path / "results"), "run-name": "baseline"},
        num_supernodes=clients,
        timeout_s=300,
        work_dir=tmp_path / "work",
    )  # fmt: skip

    assert results["status"] == "completed"
    assert results["config"]["dataset"] == "digits"
    assert results["config"]["num-server-rounds"] == 3
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3]
    for r in rounds:
        assert r.keys() >= ROUND_KEYS, ROUND_KEYS - r.keys()

    acc = [r["accuracy"] for r in rounds]
    # Measured 0.182, 0.832, 0.923, 0.943. A server that never applies the clients' models stays
    # at 0.18; one that keeps a single client's model instead of the mean (the same 3 x 10 Adam
    # steps on one third of the data) reaches 0.86 (measured in-process).
    assert acc[3] > 0.92, acc

    assert rounds[0]["uplink_bytes"] == rounds[0]["downlink_bytes"] == 0
    for r in rounds[1:]:
        # Plain FedAvg: every client gets and sends the whole fp32 model once per round, in a
        # message whose headers (Flower's metadata, its objects' ids and framing, the config) add
        # under 8 kB (measured: 4.2 kB down, LeNet5-Caffe's 8 arrays);
        # the dense reference is the model alone, so the factors are a hair under 1.
        for key in ("uplink_bytes", "downlink_bytes"):
            assert all(LENET5_FP32_BYTES < n < LENET5_FP32_BYTES + 8192 for n in r["clients"][key]), r["clients"]
        assert r["dense_uplink_bytes"] == r["dense_downlink_bytes"] == clients * LENET5_FP32_BYTES
        assert 0.997 < r["uplink_compression"] < 1.0 and 0.997 < r["downlink_compression"] < 1.0
        assert r["num_examples"] == 1500  # the digits training set, split over the clients
    # The clients' training loss (the mean over their local steps) falls round after round:
    # each round starts from the last round's aggregate. Measured 1.69, 0.58, 0.35.
    losses = [r["train_loss"] for r in rounds[1:]]
    assert losses[0] > losses[1] > losses[2], losses
    assert (tmp_path / "results" / "baseline" / "results.json").is_file()
    # Nothing of the run lives on: SuperLink, SuperExec, simulation, Ray.
    assert len(results["_simulation"]["pids"]) >= 3
    assert alive_pids(results["_simulation"]["pids"]) == []
    assert find_marked_pids(results["_simulation"]["token"]) == []


def test_invalid_config_fails_fast_naming_the_key(tmp_path: Path) -> None:
    from fedcomp.testing.flower import SimulationError

    with pytest.raises(SimulationError, match=r"lr: must be > 0"):
        run_simulation(
            REPO, {"lr": 0.0, "num-server-rounds": 1}, num_supernodes=2, timeout_s=180,
            work_dir=tmp_path / "work",
        )  # fmt: skip
