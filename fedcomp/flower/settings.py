"""Compression settings for a Flower run, validated once at the edge (pydantic).

Read from ``[tool.flwr.app.config]`` / ``--run-config`` (kebab-case keys); an invalid value stops
the run at start with a message naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FieldSerializationInfo,
    ValidationError,
    field_serializer,
    field_validator,
)

from fedcomp.codecs import Codec, get_codec
from fedcomp.errors import ConfigError
from fedcomp.schedules import Schedule

UplinkCodec = Literal["sbc", "dense-fp32", "dense-fp16", "identity"]
DownlinkCodec = Literal["3lc", "dense-fp32", "dense-fp16", "identity"]


class CompressionConfig(BaseModel):
    """What the strategy wrapper and the client mod need. Field aliases are the config keys."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    #: False: plain (uncompressed) Flower traffic, no wrapper; the baseline to compare against.
    compress: bool = Field(True, alias="compress")
    uplink_codec: UplinkCodec = Field("sbc", alias="uplink-codec")
    downlink_codec: DownlinkCodec = Field("3lc", alias="downlink-codec")
    sbc_p: Schedule = Field(Schedule.parse(0.01), alias="sbc-p")
    sbc_mode: Literal["fast", "exact"] = Field("fast", alias="sbc-mode")
    threelc_s: Schedule = Field(Schedule.parse(1.0), alias="3lc-s")
    threelc_zero_run: bool = Field(True, alias="3lc-zero-run")
    local_iters: Schedule = Field(Schedule.parse(10), alias="local-iters")
    error_feedback: bool = Field(True, alias="error-feedback")
    min_compress_numel: int = Field(1000, ge=0, alias="min-compress-numel")
    delta_log_size: int = Field(8, ge=0, le=1000, alias="delta-log-size")
    client_device: Literal["auto", "cpu", "cuda"] = Field("auto", alias="client-device")

    @field_validator("sbc_p", "threelc_s", "local_iters", mode="before")
    @classmethod
    def _parse_schedule(cls, v: Any) -> Schedule:
        return Schedule.parse(v)

    @field_validator("sbc_p")
    @classmethod
    def _p_range(cls, v: Schedule) -> Schedule:
        v.check_range(0.0, 0.5, lo_open=True)
        return v

    @field_validator("threelc_s")
    @classmethod
    def _s_range(cls, v: Schedule) -> Schedule:
        v.check_range(1.0, 2.0, hi_open=True)
        return v

    @field_validator("local_iters")
    @classmethod
    def _iters(cls, v: Schedule) -> Schedule:
        if any(x < 1 or x != int(x) for x in v.values):
            raise ValueError("local iterations must be whole numbers >= 1")
        return v

    @classmethod
    def keys(cls) -> set[str]:
        """The run-config keys this model reads."""
        return {f.alias or name for name, f in cls.model_fields.items()}

    def to_run_config(self) -> dict[str, Any]:
        """Flat kebab-case values (schedules in their string form)."""
        return self.model_dump(by_alias=True)

    @field_serializer("sbc_p", "threelc_s", "local_iters")
    def _schedule_out(self, v: Schedule, info: FieldSerializationInfo) -> float | int | str:
        """Constants as numbers (as written in pyproject.toml), other schedules as strings."""
        if v.kind != "constant":
            return str(v)
        return int(v.values[0]) if info.field_name == "local_iters" else v.values[0]

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> CompressionConfig:
        """Validate this model's keys of a Flower run config (others are ignored); raise
        :class:`ConfigError` naming the bad key(s)."""
        keys = cls.keys()
        try:
            return cls.model_validate({k: v for k, v in run_config.items() if k in keys})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc)) from None

    def uplink_codec_at(self, server_round: int) -> Codec:
        if self.uplink_codec == "sbc":
            return get_codec({"id": "sbc", "p": self.sbc_p.at(server_round), "mode": self.sbc_mode})
        return get_codec(self.uplink_codec)

    def downlink_codec_at(self, server_round: int) -> Codec:
        if self.downlink_codec == "3lc":
            return get_codec({"id": "3lc", "s": self.threelc_s.at(server_round), "zero_run": self.threelc_zero_run})
        return get_codec(self.downlink_codec)

    def local_iters_at(self, server_round: int) -> int:
        return int(self.local_iters.at(server_round))


def format_validation_error(exc: ValidationError) -> str:
    """One line per bad key: ``key: message (got value)``."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<config>"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{key}: {msg} (got {err.get('input')!r})")
    return "invalid configuration: " + "; ".join(lines)
