"""``python -m fedcomp.deploy``: the command-line entry of :mod:`fedcomp.net.deploy`.

It lives on top of the layers so that it can hand the app's own run-config validation
(:class:`fedcomp.app.config.AppConfig`) to the CLI: ``deploy local --run-config "sbc-p=2"`` stops
with exit code 2 and the key's message before any process starts, instead of starting a SuperLink
and SuperNodes for a ServerApp that refuses its config.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from fedcomp.errors import ConfigError
from fedcomp.net import deploy as _deploy

__all__ = ["check_app_run_config", "main"]


def check_app_run_config(app_dir: Path, overrides: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` (naming the key) for a run config the fedcomp app would refuse.

    The config is what Flower hands the ServerApp: the app's ``[tool.flwr.app.config]`` defaults
    updated with ``overrides``. Devices and the dataset's files are checked too (``device`` /
    ``client-device = 'cuda'`` on a machine without CUDA; ``dataset = 'mnist'`` without its
    files): in ``deploy local`` every process runs on this machine. An app whose
    defaults are not all fedcomp keys is another app: it is left to validate itself.
    """
    from fedcomp.app.config import AppConfig  # the app layer: torch-free, but only needed here

    path = Path(app_dir) / "pyproject.toml"
    try:
        defaults = tomllib.loads(path.read_text()).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    except OSError as err:
        raise ConfigError(f"--app: cannot read {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--app: {path} is not valid TOML: {err}") from None
    if not isinstance(defaults, dict) or not set(defaults) <= AppConfig.keys():
        return
    config = AppConfig.from_run_config({**defaults, **overrides})
    config.check_devices(("device", "client-device"))
    config.check_dataset()  # (else the ServerApp fails on it once the deployment is up, 17 s later)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedcomp.deploy``; returns the exit code (``--help`` lists them)."""
    return _deploy.main(argv, check_run_config=check_app_run_config)


if __name__ == "__main__":
    sys.exit(main())
