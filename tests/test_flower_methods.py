"""DEFT and GradiVeQ uplinks through real Flower simulations of the reference app, selected by
run config alone (``uplink-codec``), on the bundled digits data."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcomp.testing.flower import run_simulation

pytestmark = pytest.mark.flower

REPO = Path(__file__).resolve().parents[1]
LENET5_FP32_BYTES = 431_080 * 4


def _run(tmp_path: Path, name: str, clients: int = 3, **config: object) -> dict:
    run_config = {"dataset": "digits", "results-dir": str(tmp_path / "results"), "run-name": name, **config}
    results = run_simulation(REPO, run_config, num_supernodes=clients, timeout_s=420, work_dir=tmp_path / name)
    assert results["status"] == "completed", results.get("error")
    return results


def test_deft_trains_with_disjoint_selections_at_the_set_density(tmp_path: Path) -> None:
    res = _run(tmp_path, "deft", **{"num-server-rounds": 4, "uplink-codec": "deft", "topk-density": 0.01})
    rounds = res["rounds"]
    acc = [r["accuracy"] for r in rounds]
    # Stated accuracy: digits, 3 clients x 10 local iterations, 4 rounds, 1 % in all -> > 0.6
    # (measured 0.79; dense FedAvg reaches ~0.93 there).
    assert acc[4] > 0.6 and acc[4] > acc[0] + 0.3, acc
    for r in rounds[1:]:
        assert r["rejected"] == {}
        # All clients together send 1 % of the compressed tensors' entries, never more: the
        # selections do not overlap (plain per-client top-k would give up to 3 %).
        assert r["uplink_union_density"] == pytest.approx(0.01, abs=2e-4)
        assert r["uplink_bytes"] == r["payload_uplink_bytes"]
        assert r["uplink_compression"] > 100, r["uplink_compression"]
        assert len(r["client_encode_seconds"]) == 3


def test_gradiveq_fits_broadcasts_and_aggregates_coefficients(tmp_path: Path) -> None:
    res = _run(
        tmp_path,
        "gradiveq",
        **{"num-server-rounds": 4, "uplink-codec": "gradiveq", "gradiveq-dense-rounds": 2, "gradiveq-refresh": 0},
    )
    rounds = {r["round"]: r for r in res["rounds"]}
    # Rounds 1-2 dense (the PCA samples), then coefficients under compressor version 1.
    assert [rounds[r]["gradiveq_compressed"] for r in (1, 2, 3, 4)] == [False, False, True, True]
    assert rounds[4]["gradiveq_version"] == 1
    for r in (1, 2):
        assert rounds[r]["uplink_compression"] == pytest.approx(1.0, rel=0.01)
    for r in (3, 4):
        assert rounds[r]["rejected"] == {}
        assert rounds[r]["uplink_compression"] > 5, rounds[r]["uplink_compression"]
    # The compressor goes down once, in round 3, to each client; round 4 carries only 3LC deltas.
    assert rounds[3]["downlink_bytes"] > rounds[4]["downlink_bytes"] + 3 * 10_000
    # Stated accuracy: > 0.85 after 4 rounds (measured 0.93).
    assert rounds[4]["accuracy"] > 0.85, rounds[4]["accuracy"]
