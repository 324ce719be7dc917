"""DEFT and GradiVeQ uplinks through real Flower simulations of the reference app, selected by
run config alone (``uplink-codec``), on the bundled digits data."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcomp.testing.flower import run_simulation

# Real `flwr run` simulations (10 s to a minute each on 2 cores): out of the fast lane.
pytestmark = [pytest.mark.flower, pytest.mark.slow]

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
    # Digits, 3 clients x 10 local iterations, 4 rounds, 1 % in all: measured 0.273, 0.465,
    # 0.677, 0.788 (k by the clients' norms; by the last aggregate's, 0.259, 0.458, 0.687,
    # 0.791). The same run without the clients' residuals (error-feedback = false) reaches
    # 0.566: what a client leaves unsent must come back in later rounds.
    assert acc[4] > 0.76, acc
    # Round 1 sizes k by partition size; later rounds by the norms the clients reported (the
    # field crossed real Flower messages both ways: asked for in the allocation, sent as bytes).
    assert [r["deft_k_from"] for r in rounds[1:]] == ["sizes", "clients", "clients", "clients"]
    for r in rounds[1:]:
        assert r["rejected"] == {}
        # All clients together send 1 % of the compressed tensors' entries, never more: the
        # selections do not overlap (plain per-client top-k would give up to 3 %).
        assert r["uplink_union_density"] == pytest.approx(0.01, abs=2e-4)
        # the wire: the payloads and each reply's headers (under 2 kB a message)
        assert r["payload_uplink_bytes"] < r["uplink_bytes"] < r["payload_uplink_bytes"] + r["num_clients"] * 2048
        # Measured 142.7x to 144.6x (payload bytes; whole messages, since the twenty-first session: lower). Plain per-client top-k at 1 % each (the clients not splitting
        # the budget) measured 65.6x in the same run.
        assert r["uplink_compression"] > 120, r["uplink_compression"]
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
        # Measured 12.4x: per slice of d values, k coefficients (k chosen by gradiveq-eps) in
        # place of d. A dense fallback would be 1x, an fp16 one 2x.
        assert rounds[r]["uplink_compression"] > 10, rounds[r]["uplink_compression"]
    # The compressor goes down once, in round 3, to each client; round 4 carries only 3LC deltas
    # (measured 1.14 MB then 0.12 MB for the 3 clients: ~340 kB of compressor each).
    assert rounds[3]["downlink_bytes"] > rounds[4]["downlink_bytes"] + 3 * 300_000
    # Measured 0.832, 0.919 (the dense rounds), 0.933, 0.923 (compressed). Dense FedAvg reaches
    # 0.94 in 3 rounds; a wrong basis or a wrongly decompressed mean would fall well below.
    assert rounds[4]["accuracy"] > 0.90, [r["accuracy"] for r in res["rounds"]]
