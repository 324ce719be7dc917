"""The app's run config (fedcomp.app.config.AppConfig) and its defaults in pyproject.toml."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from fedcomp.app.config import AppConfig
from fedcomp.errors import ConfigError

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _pyproject_run_config() -> dict:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)["tool"]["flwr"]["app"]["config"]


def test_pyproject_defaults_are_valid_and_match_the_model() -> None:
    cfg = AppConfig.from_run_config(_pyproject_run_config())
    assert cfg == AppConfig()  # the two places that define defaults agree
    assert cfg.to_run_config() == _pyproject_run_config()


@pytest.mark.parametrize(
    "override, message",
    [
        ({"lr": 0}, "lr: must be > 0"),
        ({"lr": -1e-3}, "lr: must be > 0"),
        ({"num-server-rounds": 0}, "num-server-rounds: must be >= 1"),
        ({"num-server-rounds": 2.5}, "num-server-rounds: must be an integer"),
        ({"local-iters": "ten"}, "local-iters: cannot parse schedule"),
        ({"local-iters": "list:10,0"}, "local-iters: local iterations must be whole numbers >= 1"),
        ({"sbc-p": 0.6}, "sbc-p: value 0.6 is outside"),
        ({"3lc-s": "steps:1.0@1,2.5@4"}, "3lc-s: value 2.5 is outside"),
        ({"uplink-codec": "zip"}, "uplink-codec: unknown uplink method"),
        ({"dataset": "cifar10"}, "dataset: must be one of"),
        ({"partitioning": "pathological"}, "partitioning: must be one of"),
        ({"dirichlet-alpha": 0.0}, "dirichlet-alpha: must be > 0"),
        ({"lattice-weight-step": 0.0}, "lattice-weight-step: Input should be greater than 0 (got 0.0)"),
        ({"run-name": "../x"}, "run-name: must be a plain folder name"),
        ({"lerning-rate": 0.1}, "unknown key 'lerning-rate' (not a key of this app"),
        ({"sbc-pp": 0.01}, "unknown key 'sbc-pp' (did you mean 'sbc-p'?)"),
        ({"compress": "yes"}, "compress: must be true or false (got 'yes')"),
        ({"error-feedback": 1}, "error-feedback: must be true or false (got 1)"),
        ({"max-empty-rounds": 0}, "max-empty-rounds: Input should be greater than or equal to 1 (got 0)"),
        ({"resume": "yes"}, "resume: must be true or false (got 'yes')"),
        ({"dp-clipping-norm": -0.1}, "dp-clipping-norm: must be >= 0"),
        ({"dp-noise-multiplier": "inf"}, "dp-noise-multiplier:"),
        ({"dp-clipping": "both"}, "dp-clipping: must be one of"),
    ],
)
def test_bad_values_name_the_key(override: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        AppConfig.from_run_config({**_pyproject_run_config(), **override})


def test_ints_are_accepted_for_floats_and_ignore_skips_foreign_keys() -> None:
    cfg = AppConfig.from_run_config({"lr": 1, "uplink-codec": "sbc"}, ignore={"uplink-codec"})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


def test_paths_fall_back_to_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FEDCOMP_DATA_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("FEDCOMP_RESULTS_DIR", str(tmp_path / "r"))
    cfg = AppConfig()
    assert cfg.resolved_data_dir() == tmp_path / "d"
    assert cfg.resolved_results_dir() == tmp_path / "r"
    cfg = AppConfig(data_dir="/x", results_dir="/y")
    assert cfg.resolved_data_dir() == Path("/x") and cfg.resolved_results_dir() == Path("/y")
    monkeypatch.delenv("FEDCOMP_DATA_DIR")
    monkeypatch.delenv("FEDCOMP_RESULTS_DIR")
    assert AppConfig().resolved_data_dir() is None
    assert AppConfig().resolved_results_dir() == Path("results")


@pytest.mark.parametrize("key", ["device", "client-device"])
def test_cuda_without_cuda_is_a_config_error_naming_the_key(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on this CPU-only machine
    cfg = AppConfig.from_run_config({key: "cuda"})
    with pytest.raises(ConfigError, match=f"^{key}: 'cuda' was asked for but"):
        cfg.check_devices()
    cfg.check_devices(keys=[k for k in ("device", "client-device") if k != key])  # the other key is fine
    AppConfig.from_run_config({key: "auto"}).check_devices()  # auto falls back to the CPU, by definition


def test_booleans_accept_true_and_false() -> None:
    cfg = AppConfig.from_run_config({"compress": False, "3lc-zero-run": False})
    assert cfg.compression.compress is False and cfg.compression.threelc_zero_run is False
