"""The Flower app's run config, validated once at start.

``[tool.flwr.app.config]`` in ``pyproject.toml`` holds the defaults (kebab-case keys); ``flwr run
--run-config "key=value ..."`` overrides them. :class:`AppConfig` is the one place that says which
keys exist, their types and their ranges: the ServerApp and the ClientApp both call
:meth:`AppConfig.from_run_config`, so a bad value stops the run before the first round with a
:class:`~fedcomp.errors.ConfigError` that names the key (``lr: must be > 0``).

To add a setting: add a field with ``alias="the-kebab-key"`` here and the same key with its default
in ``pyproject.toml``. Unknown keys are rejected, so the two cannot silently drift apart.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fedcomp.errors import ConfigError
from fedcomp.flower.settings import CompressionConfig

#: Environment variables read when the matching config value is empty.
DATA_DIR_ENV = "FEDCOMP_DATA_DIR"
RESULTS_DIR_ENV = "FEDCOMP_RESULTS_DIR"

Dataset = Literal["digits", "mnist", "fashion-mnist", "shakespeare"]

#: Where the reference app's compression defaults differ from the library's:
#:
#: - its ClientApp builds the seeded initial model itself (``fedcomp.app.apps.client_initial_model``),
#:   so no initial model needs to cross the wire; an arbitrary user's app cannot, so the library
#:   keeps it off;
#: - its downlink is ``lattice`` (fedcomp's own, docs/lattice.md), not the papers' 3LC: chosen by
#:   measurement (docs/lattice.md, "The default"; docs/RESULTS.md). With 10 of 100 clients per
#:   round 3LC saves 13x in total while lattice saves 38x at the same accuracy, because a client
#:   that was away gets one merged catch-up instead of a chain or the full model; with every
#:   client in every round both meet the accuracy targets, lattice five rounds sooner on
#:   label-skewed data.
APP_COMPRESSION_DEFAULTS: dict[str, Any] = {
    "seeded-initial-model": True,
    "downlink-codec": "lattice",
    # Bounds every update without the user picking a number; on LeNet5/MNIST (IID and Dirichlet
    # 0.3, every client or 10 of 100 a round) no honest update came near it: the same accuracy
    # and bytes to the digit as without it (docs/RESULTS.md, 2026-11-29).
    "max-update-norm-factor": 4.0,
}


class AppConfig(BaseModel):
    """Run config of the fedcomp Flower app. Field aliases are the kebab-case run-config keys."""

    model_config = ConfigDict(
        populate_by_name=True,  # AppConfig(num_server_rounds=3) works as well as the alias
        extra="forbid",
        strict=True,  # no "3" -> 3 or True -> 1; an int is still accepted for a float field
        frozen=True,
    )

    num_server_rounds: int = Field(5, alias="num-server-rounds", ge=1)
    #: Clients sampled per round; 0 = every connected SuperNode.
    clients_per_round: int = Field(0, alias="clients-per-round", ge=0)
    lr: float = Field(1e-3, alias="lr", gt=0)
    batch_size: int = Field(32, alias="batch-size", ge=1)
    optimizer: Literal["adam", "sgd"] = Field("adam", alias="optimizer")
    device: Literal["auto", "cpu", "cuda"] = Field("cpu", alias="device")
    #: torch.set_num_threads in every ClientApp/ServerApp process; 0 = leave torch's default.
    #: 1 by default: simulated clients run side by side, and oversubscribed torch threads are
    #: many times slower on a small machine.
    torch_threads: int = Field(1, alias="torch-threads", ge=0)
    dataset: Dataset = Field("digits", alias="dataset")
    #: Folder holding ``mnist/`` and ``fashion-mnist/``; "" = the FEDCOMP_DATA_DIR variable.
    data_dir: str = Field("", alias="data-dir")
    partitioning: Literal["iid", "dirichlet"] = Field("iid", alias="partitioning")
    dirichlet_alpha: float = Field(0.5, alias="dirichlet-alpha", gt=0)
    seed: int = Field(0, alias="seed", ge=0)
    #: Root of the results folders; "" = FEDCOMP_RESULTS_DIR, else ``results`` in the cwd.
    results_dir: str = Field("", alias="results-dir")
    #: Name of this run's results folder; "" = a timestamp.
    run_name: str = Field("", alias="run-name")
    #: Seconds the server waits for a round's replies (``Strategy.start(timeout=...)``); a round
    #: goes on with the replies it has when it runs out, e.g. after a SuperNode died mid-round.
    #: Flower's own default is 3600.
    round_timeout: float = Field(3600.0, alias="round-timeout", gt=0)
    #: Continue the run in ``results-dir/run-name`` from its ``checkpoint.pt`` (written after every
    #: round) instead of starting over; the rest of the run config must be the checkpointed run's.
    resume: bool = Field(False, alias="resume")
    #: Flower's central differential privacy with fixed clipping around the inner strategy, on when
    #: > 0: every client's update (as sent, residual included) is clipped to this L2 norm, by the
    #: client (``dp-clipping = "client"``) or by the server on the decoded update ("server"), and
    #: Gaussian noise of std ``dp-noise-multiplier x dp-clipping-norm / sampled clients`` is added
    #: to the mean. Clients then weigh the same in the mean (the noise's calibration assumes it).
    dp_clipping_norm: float = Field(0.0, alias="dp-clipping-norm", ge=0, allow_inf_nan=False)
    dp_noise_multiplier: float = Field(0.0, alias="dp-noise-multiplier", ge=0, allow_inf_nan=False)
    dp_clipping: Literal["client", "server"] = Field("client", alias="dp-clipping")
    #: With noise (``dp-noise-multiplier`` > 0) the run accounts privacy with Flower's RDP accountant
    #: and reports the epsilon spent at this delta, per round (no amplification by sampling claimed).
    dp_delta: float = Field(1e-5, alias="dp-delta", gt=0, lt=1)
    #: Codecs, schedules (local iterations, p, s) and the other compression keys; validated by
    #: :class:`fedcomp.flower.settings.CompressionConfig`, from the same flat run config.
    compression: CompressionConfig = Field(default_factory=lambda: CompressionConfig(**APP_COMPRESSION_DEFAULTS))

    @field_validator("run_name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if v in (".", "..") or "/" in v or "\\" in v:
            raise ValueError("must be a plain folder name (no '/', not '.' or '..')")
        return v

    # --- construction -----------------------------------------------------------------------

    @classmethod
    def keys(cls) -> set[str]:
        """Every run-config key the app reads: its own and the compression keys."""
        own = {f.alias or name for name, f in cls.model_fields.items() if name != "compression"}
        return own | CompressionConfig.keys()

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], ignore: Iterable[str] = ()) -> AppConfig:
        """Validate ``context.run_config``; raise :class:`ConfigError` naming the bad key.

        ``ignore``: keys validated elsewhere (e.g. another settings model's aliases), skipped here
        instead of being rejected as unknown.
        """
        skip = set(ignore)
        check_known_keys(run_config, cls.keys() | skip)
        comp_keys = CompressionConfig.keys()
        _check_booleans(run_config)  # CompressionConfig is lax: "yes" would become True
        compression = CompressionConfig.from_run_config(
            {**APP_COMPRESSION_DEFAULTS, **{k: v for k, v in run_config.items() if k in comp_keys}}
        )
        data = {k: v for k, v in run_config.items() if k not in skip and k not in comp_keys}
        try:
            return cls.model_validate({**data, "compression": compression})
        except ValidationError as err:
            raise ConfigError(_format_errors(err)) from None

    def check_devices(self, keys: Iterable[str] = ("device", "client-device")) -> None:
        """Raise :class:`ConfigError` naming the key when one of ``keys`` asks for CUDA and this
        machine has none (no silent fallback to the CPU).

        The ServerApp checks only ``device`` (it evaluates there); ``client-device`` is the
        clients' business (in a deployment their machines are not the server's), and the client
        mod raises the same error there. A local simulation, where everything runs on this
        machine, checks both before it starts.
        """
        wanted = {"device": self.device, "client-device": self.compression.client_device}
        asked = [k for k in keys if wanted.get(k) == "cuda"]
        if not asked:
            return
        import torch  # only here: reading a config should not need torch

        if not torch.cuda.is_available():
            why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError(f"{asked[0]}: 'cuda' was asked for but {why} (use 'cpu' or 'auto')")

    def check_dataset(self) -> None:
        """Raise :class:`ConfigError` naming ``dataset`` when its files are not where the config
        says (a command that starts processes on this machine checks it first: else each of them
        fails on it once it is up)."""
        from fedcomp.app.data import DataError, check_dataset_files  # (torch: only when asked)

        try:
            check_dataset_files(self.dataset, self.resolved_data_dir())
        except DataError as exc:
            raise ConfigError(f"dataset: {exc}") from None

    def to_run_config(self) -> dict[str, Any]:
        """The kebab-case dict this config came from (what results.json records)."""
        return {**self.model_dump(by_alias=True, exclude={"compression"}), **self.compression.to_run_config()}

    # --- resolved paths ----------------------------------------------------------------------

    def resolved_data_dir(self) -> Path | None:
        """``data-dir``, else ``$FEDCOMP_DATA_DIR``, else None (only "digits" needs no folder)."""
        value = self.data_dir or os.environ.get(DATA_DIR_ENV, "")
        return Path(value).expanduser() if value else None

    def resolved_results_dir(self) -> Path:
        """``results-dir``, else ``$FEDCOMP_RESULTS_DIR``, else ``results`` in the cwd."""
        value = self.results_dir or os.environ.get(RESULTS_DIR_ENV, "") or "results"
        return Path(value).expanduser()


def check_known_keys(run_config: Mapping[str, Any], known: Iterable[str]) -> None:
    """Raise :class:`ConfigError` for the first key of ``run_config`` not in ``known``, with the
    closest known key as a suggestion: ``unknown key 'sbc-pp' (did you mean 'sbc-p'?)``."""
    known = sorted(set(known))
    for key in run_config:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
            hint = (
                f" (did you mean {close[0]!r}?)"
                if close
                else " (not a key of this app; [tool.flwr.app.config] in its pyproject.toml lists them)"
            )
            raise ConfigError(f"unknown key {key!r}{hint}")


def _check_booleans(run_config: Mapping[str, Any]) -> None:
    """Boolean compression keys accept only true/false (not "yes", 1, "true")."""
    for name, field in CompressionConfig.model_fields.items():
        key = field.alias or name
        if field.annotation is bool and key in run_config and not isinstance(run_config[key], bool):
            raise ConfigError(f"{key}: must be true or false (got {run_config[key]!r})")


# Turn pydantic's messages into "key: what is wrong", with the kebab-case key.
_MESSAGES = {
    "greater_than": "must be > {gt}",
    "greater_than_equal": "must be >= {ge}",
    "less_than": "must be < {lt}",
    "less_than_equal": "must be <= {le}",
    "literal_error": "must be one of {expected}",
    "extra_forbidden": "unknown key (not a field of fedcomp.app.config.AppConfig)",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
}


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        template = _MESSAGES.get(e["type"])
        if template is not None:
            msg = template.format(**(e.get("ctx") or {}))
        else:
            msg = e["msg"].removeprefix("Value error, ")
        if "input" in e and e["type"] != "extra_forbidden":
            msg += f" (got {e['input']!r})"
        lines.append(f"{key}: {msg}" if key else msg)
    return "invalid run config: " + "; ".join(lines)
