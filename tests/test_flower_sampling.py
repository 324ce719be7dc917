"""Partial participation through a real Flower simulation: 8 SuperNodes, 3 sampled per round.

With the reference app's seeded initial model no client ever needs the full model: a client
sampled for the first time gets the chain of deltas since version 0 (round 1: nothing), a client
that sat out gets the deltas it missed, and the delta log (capped at one model's bytes) holds
them all.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcomp.testing.flower import run_simulation

pytestmark = [pytest.mark.flower, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
LENET5_FP32_BYTES = 4 * 431_080


def test_sampled_clients_catch_up_by_chains_never_full_models(tmp_path: Path) -> None:
    rounds_n, per_round, nodes = 4, 3, 8
    config = {
        "dataset": "digits",
        "results-dir": str(tmp_path / "results"),
        "run-name": "sampled",
        "num-server-rounds": rounds_n,
        "clients-per-round": per_round,
        "local-iters": 5,
    }
    res = run_simulation(REPO, config, num_supernodes=nodes, timeout_s=420, work_dir=tmp_path / "work")
    rounds = res["rounds"][1:]
    assert [r["round"] for r in rounds] == list(range(1, rounds_n + 1))
    seen: set[str] = set()
    for r in rounds:
        modes = r["downlink_modes"]
        assert len(modes) == per_round, r["downlink_modes"]  # exactly the sampled clients
        assert r["rejected"] == {}
        for node, mode in modes.items():
            # Round 1: every client builds version 0 itself; later a newcomer gets the chain since
            # version 0 and a returning client the deltas it missed. Never the full model.
            assert mode == ("none" if r["round"] == 1 else "chain"), (r["round"], node, mode)
            seen.add(node)
        # Far below one dense model per client (the default lattice delta is ~1/25 of it, and a
        # returning client's catch-up is one merged delta).
        assert r["downlink_bytes"] < per_round * LENET5_FP32_BYTES / 10, r["downlink_bytes"]
    assert len(seen) > per_round  # sampling reached clients beyond the first round's
    acc = [r["accuracy"] for r in res["rounds"]]
    # Learning goes on with 3 of 8 clients a round: well above the initial model (near chance, 0.1).
    assert acc[-1] > acc[0] + 0.3, acc
