"""The real-link benchmark's pieces that need no privileges: the skip and the per-round summary."""

from __future__ import annotations

import pytest

from fedcomp.bench import netns as bench_netns


def test_skips_with_a_reason_without_root(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert bench_netns.netns_unavailable_reason() == "network namespaces need root (CAP_NET_ADMIN)"
    assert bench_netns.main(["--nodes", "2", "--rounds", "1"]) == bench_netns.EXIT_SKIPPED
    assert "SKIPPED: real shaped links need network namespaces: network namespaces need root" in capsys.readouterr().err


def test_bad_arguments_stop_before_anything_starts() -> None:
    with pytest.raises(SystemExit):
        bench_netns.main(["--mbps", "0"])
    with pytest.raises(SystemExit):
        bench_netns.main(["--nodes", "0"])


def test_summary_rows_per_round() -> None:
    data = {
        "rounds": [
            {"round": 0, "accuracy": 0.1, "round_time_s": 0.5, "clients": {}},
            {"round": 1, "accuracy": 0.5, "round_time_s": 9.0,
             "clients": {"downlink_bytes": [1_250_000, 1_250_000], "uplink_bytes": [250_000, 1_250_000]}},
        ]
    }  # fmt: skip
    (row,) = bench_netns.summarize(data, 10.0)
    assert row["round"] == 1 and row["round_time_s"] == 9.0
    assert row["down_bytes"] == 1_250_000 and row["up_bytes"] == 750_000
    assert row["payload_link_s"] == pytest.approx(2.0)  # the slowest client: 2.5 MB at 1.25 MB/s
