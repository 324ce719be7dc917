"""``python -m fedcomp.bench server``: its argument errors, and a tiny real run of both paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedcomp.bench.server import main
from tests.usage import usage_error

KEYS = {"clients", "numel", "seconds", "peak_rss_bytes", "max_abs_diff"}


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        ([], "--clients"),  # required
        (["--clients", "0"], "--clients"),
        (["--clients", "many"], "--clients"),
        (["--clients", "3", "--p", "0"], "--p"),
        (["--clients", "3", "--p", "0.9"], "--p"),
        (["--clients", "3", "--model", "vgg"], "--model"),
        (["--clients", "3", "--path", "both"], "--path"),
        (["--clients", "3", "--inner", "krum"], "--inner"),
    ],
)
def test_bad_arguments_are_usage_errors_naming_the_option(
    argv: list[str], names: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert names in usage_error(main, argv, capsys)


@pytest.mark.parametrize("path", ["streaming", "materialise"])
def test_a_tiny_run_aggregates_every_client_to_the_reference_mean(path: str, tmp_path: Path) -> None:
    out = tmp_path / "server.json"
    assert main(["--clients", "3", "--model", "lenet", "--path", path, "--json", str(out)]) == 0
    row = json.loads(out.read_text())
    assert row.keys() >= KEYS
    assert row["clients"] == 3 and row["accepted"] == 3 and row["rejected"] == 0
    assert row["numel"] == 431_080  # LeNet5-Caffe
    assert row["path"] == path
    assert row["seconds"] > 0 and row["cpu_seconds"] > 0
    assert row["peak_rss_bytes"] >= row["rss_before_bytes"] > 0
    if path == "streaming":  # the float64 sum, rounded once: the correctly rounded float32 model
        assert row["max_ulps"] <= 0.5
    # FedAvg's float32 sum of three replies is a few roundings off at most (relative to the
    # model's largest values: near zero, ulps of the value itself say little).
    assert row["max_abs_diff"] <= 8 * row["fp32_half_ulp"]
