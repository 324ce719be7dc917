"""The lattice downlink through a real Flower simulation: 6 SuperNodes, 2 sampled per round.

Every downlink is "none" (round 1, or a client already up to date) or "chain" (one merged lattice
payload since the client's version, version 0 for a newcomer with the seeded initial model); no
full model crosses the wire, and no reply is rejected or asks for a resync, so every client's
replica passed the digest check against the server's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcomp.testing.flower import run_simulation

pytestmark = [pytest.mark.flower, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
LENET5_FP32_BYTES = 4 * 431_080


def test_lattice_catch_ups_in_a_sampled_flower_run(tmp_path: Path) -> None:
    rounds_n, per_round, nodes = 3, 2, 6
    config = {
        "dataset": "digits",
        "results-dir": str(tmp_path / "results"),
        "run-name": "lattice",
        "num-server-rounds": rounds_n,
        "clients-per-round": per_round,
        "local-iters": 3,
        "downlink-codec": "lattice",
        "lattice-step": 2.0,
    }
    res = run_simulation(REPO, config, num_supernodes=nodes, timeout_s=420, work_dir=tmp_path / "work")
    assert res["status"] == "completed", res.get("error")
    rounds = res["rounds"][1:]
    assert [r["round"] for r in rounds] == list(range(1, rounds_n + 1))
    for r in rounds:
        modes = r["downlink_modes"]
        assert len(modes) == per_round, modes
        assert r["rejected"] == {}, r["rejected"]
        # Every sampled client's update was aggregated: none asked for a resync (its replica's
        # digest after the merged payload matched the server's) and none erred.
        assert r["updates_aggregated"] == per_round and r["client_errors"] == {}, r
        assert r["replies_missing"] == [], r
        for node, mode in modes.items():
            assert mode == ("none" if r["round"] == 1 else "chain"), (r["round"], node, mode)
        assert r["downlink_bytes"] < per_round * LENET5_FP32_BYTES / 4, r["downlink_bytes"]
