"""Real Flower simulations of the compressed app: learning, byte accounting, equivalence with plain
FedAvg, stale clients (delta chain, full resync), corrupted replicas and corrupt uplinks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedcomp.testing.flower import run_simulation

pytestmark = pytest.mark.flower

REPO = Path(__file__).resolve().parents[1]
FAULT_APP = Path(__file__).resolve().parent / "flower_app"
LENET5_FP32_BYTES = 431_080 * 4


def _run(tmp_path: Path, name: str, app: Path = REPO, clients: int = 3, **config: object) -> dict:
    run_config = {"dataset": "digits", "results-dir": str(tmp_path / "results"), "run-name": name, **config}
    results = run_simulation(app, run_config, num_supernodes=clients, timeout_s=420, work_dir=tmp_path / name)
    assert results["status"] == "completed", results.get("error")
    return results


def test_compressed_run_learns_and_accounts_every_byte(tmp_path: Path) -> None:
    res = _run(tmp_path, "sbc3lc", **{"num-server-rounds": 3, "local-iters": 10, "sbc-p": 0.01, "3lc-s": 1.0})
    rounds = res["rounds"]
    acc = [r["accuracy"] for r in rounds]
    assert acc[3] > acc[0] + 0.3 and acc[3] > 0.6, acc
    for r in rounds[1:]:
        # What the wire meter saw equals the payloads the codecs produced, both ways.
        assert r["uplink_bytes"] == r["payload_uplink_bytes"] > 0
        assert r["downlink_bytes"] == r["payload_downlink_bytes"] > 0
        assert r["dense_uplink_bytes"] == 3 * LENET5_FP32_BYTES
        assert r["uplink_compression"] > 30, r["uplink_compression"]
        assert r["rejected"] == {}
    # Round 1 ships the initial model in full; later rounds ship 3LC deltas to every client.
    assert set(rounds[1]["downlink_modes"].values()) == {"full"}
    assert set(rounds[2]["downlink_modes"].values()) == {"chain"}
    assert rounds[2]["downlink_compression"] > 10, rounds[2]["downlink_compression"]
    assert (tmp_path / "results" / "sbc3lc" / "final_model.pt").is_file()


def test_identity_codecs_through_the_wrapper_match_plain_fedavg(tmp_path: Path) -> None:
    common = {"num-server-rounds": 2, "local-iters": 5, "seed": 3}
    plain = _run(tmp_path, "plain", compress=False, **common)
    wrapped = _run(tmp_path, "identity", **{"uplink-codec": "identity", "downlink-codec": "identity"}, **common)
    a = torch.load(tmp_path / "results" / "plain" / "final_model.pt")
    b = torch.load(tmp_path / "results" / "identity" / "final_model.pt")
    assert a.keys() == b.keys()
    # Not bit-exact: the replica is rebuilt as R + (W - R) and updates as R + (W_i - R), each a
    # float32 rounding. Stated tolerance: 1e-5 absolute on every parameter after 2 rounds.
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5)
    for ra, rb in zip(plain["rounds"], wrapped["rounds"], strict=True):
        assert abs(ra["accuracy"] - rb["accuracy"]) <= 1 / 297 + 1e-9  # at most one test image
        assert abs(ra["loss"] - rb["loss"]) < 1e-3


def test_stale_clients_resync_and_bad_payloads_are_rejected(tmp_path: Path) -> None:
    """Script (tests/flower_app/pyproject.toml): 4 clients, delta log of 2 versions.

    round 1: all (full models) | 2: client 3 sits out | 3: clients 2, 3 sit out
    round 4: client 2 is 2 versions behind -> delta chain; client 3 is 3 behind -> full;
             client 1's uplink is truncated in transit -> rejected, the round goes on
    round 5: client 0's stored replica is silently corrupted -> it detects it, asks to resync
    round 6: client 0 gets a full replica and trains again
    """
    res = _run(tmp_path, "faults", app=FAULT_APP, clients=4)
    rounds = {r["round"]: r for r in res["rounds"]}
    ids = rounds[1]["clients"]["ids"]
    assert len(ids) == 4
    modes = {r: {ids.index(k): v for k, v in rounds[r]["downlink_modes"].items()} for r in range(1, 7)}
    assert modes[1] == {0: "full", 1: "full", 2: "full", 3: "full"}
    assert modes[2] == {0: "chain", 1: "chain", 2: "chain"}
    assert modes[4] == {0: "chain", 1: "chain", 2: "chain", 3: "full"}
    assert modes[5] == {0: "chain", 1: "chain", 2: "chain", 3: "chain"}  # a lost upload is no resync
    assert modes[6] == {0: "full", 1: "chain", 2: "chain", 3: "chain"}  # resynced after the corruption
    rejected4 = {ids.index(k): v for k, v in rounds[4]["rejected"].items()}
    assert list(rejected4) == [1] and "CompressedUpdate" in rejected4[1], rejected4
    assert rounds[4]["num_examples"] == 3 * 375  # the three accepted clients' data
    assert rounds[5]["num_examples"] == 3 * 375  # client 0 asked for a resync instead
    assert rounds[6]["num_examples"] == 4 * 375
    assert rounds[6]["accuracy"] > rounds[0]["accuracy"] + 0.3
