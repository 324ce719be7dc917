"""Compression settings for a Flower run, validated once at the edge (pydantic).

Read from ``[tool.flwr.app.config]`` / ``--run-config`` (kebab-case keys); an invalid value stops
the run at start with a message naming the key.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FieldSerializationInfo,
    ValidationError,
    ValidationInfo,
    field_serializer,
    field_validator,
)

from fedcomp.codecs import Codec, get_codec
from fedcomp.errors import ConfigError
from fedcomp.methods.schedules import Schedule

if TYPE_CHECKING:
    from fedcomp.methods.bandwidth import BandwidthBudget


# A child of Flower's logger: our lines go wherever Flower sends its own (the run log, the console).
log = logging.getLogger("flwr").getChild("fedcomp")


class CompressionConfig(BaseModel):
    """What the strategy wrapper and the client mod need. Field aliases are the config keys."""

    model_config = ConfigDict(frozen=True, populate_by_name=True, extra="forbid")

    #: False: plain (uncompressed) Flower traffic, no wrapper; the baseline to compare against.
    compress: bool = Field(True, alias="compress")
    #: An uplink method's registry id (``fedcomp.methods.registry.UPLINKS``).
    uplink_codec: str = Field("sbc", alias="uplink-codec")
    #: A downlink method's registry id (``fedcomp.methods.registry.DOWNLINKS``).
    downlink_codec: str = Field("3lc", alias="downlink-codec")
    #: 5 % by measurement: at 1 % the label-skewed reference task loses 6 pp at round 30 (docs/compression_gap.md).
    sbc_p: Schedule = Field(Schedule.parse(0.05), alias="sbc-p")
    sbc_mode: Literal["fast", "exact"] = Field("fast", alias="sbc-mode")
    threelc_s: Schedule = Field(Schedule.parse(1.0), alias="3lc-s")
    threelc_zero_run: bool = Field(True, alias="3lc-zero-run")
    #: "lattice" downlink: grid step relative to the RMS of the first model movement (rounded down to a power
    #: of two per tensor). 12 by measurement (docs/lattice.md): the accuracy of 0.5 to 8 at 10 of 100 clients
    #: and 40 % fewer bytes than 8 on label-skewed data with every client in every round; 16 costs accuracy.
    lattice_step: float = Field(12.0, gt=0, le=1024, alias="lattice-step")
    #: "lattice" downlink: the grid step is also at most this times the RMS of the tensor's values (after
    #: the first movement), so that a large first movement (Adam's) cannot put the replica on a grid as coarse
    #: as the weights themselves. 2 by measurement (docs/lattice.md): the CharLSTM's LSTM grids went from 6x their
    #: weights' RMS to under 2x (accuracy 0.2719 -> 0.3608); no LeNet tensor's grid of lattice-step 12 changes.
    lattice_weight_step: float = Field(2.0, gt=0, le=1024, alias="lattice-weight-step")
    local_iters: Schedule = Field(Schedule.parse(10), alias="local-iters")
    error_feedback: bool = Field(True, alias="error-feedback")
    min_compress_numel: int = Field(1000, ge=0, alias="min-compress-numel")
    #: Most downlink deltas kept for clients that missed rounds; the log is also capped at one
    #: dense model's bytes (a longer chain would cost more than the full model).
    delta_log_size: int = Field(256, ge=0, le=100_000, alias="delta-log-size")
    #: The lattice downlink's delta log is capped at this many dense models' bytes instead: its
    #: catch-up is one merged payload, far smaller than the chain's bytes (docs/lattice.md).
    delta_log_models: float = Field(4.0, ge=1, le=64, alias="delta-log-models")
    #: Most downlink passes per round: after the first delta, the server compresses what is still
    #: missing of ``W - R`` again (each pass is one more delta version, so clients apply a chain
    #: of them), until ``replica-lag-max`` is met. 3LC's max-based scale rounds most of a spiky
    #: aggregate to zero; a second pass recovers much of it (docs/compression_gap.md).
    downlink_passes: int = Field(1, ge=1, le=8, alias="downlink-passes")
    #: Stop the passes once ||W - R|| / ||W - W_prev|| is at most this; 0 = always all passes.
    replica_lag_max: float = Field(0.0, ge=0, alias="replica-lag-max")
    #: "auto" downlink: the downlinks it chooses among each round (METHOD or METHOD*PASSES).
    downlink_candidates: str = Field("3lc,3lc*2,sparse-fp16,sparse-fp32,dense-fp32", alias="downlink-candidates")
    #: A train reply's example count (the inner strategy's weight) must lie in (0, this]; one
    #: client claiming 1e15 examples would otherwise own the average.
    max_num_examples: int = Field(1_000_000_000, ge=1, alias="max-num-examples")
    #: Reject an update whose L2 norm exceeds this (0: no bound).
    max_update_norm: float = Field(0.0, ge=0, alias="max-update-norm")
    #: An adaptive bound on each update's L2 norm (0: none): this many times the median norm of
    #: the last aggregated round's accepted updates (before any, of the round's own; see
    #: ``CompressionStrategy._set_bound``). Sent in the downlink as ``max-update-norm`` is, so
    #: honest clients keep within it and a client that ignores it is rejected; with
    #: ``max-update-norm`` also set, the smaller bound holds.
    max_update_norm_factor: float = Field(0.0, ge=0, le=1e6, allow_inf_nan=False, alias="max-update-norm-factor")
    #: Reject a reply (train or evaluate) whose MetricRecord is larger than this: its keys'
    #: characters plus 8 bytes a value (a list counts each element). The round's metrics are
    #: aggregated over the replies and end in the server's records: a client alone in its round
    #: with 200,000 keys cost the aggregation 1.7 s, and its keys reached them all.
    max_metrics_bytes: int = Field(65_536, ge=64, alias="max-metrics-bytes")
    #: A run whose train rounds aggregate no client update this many times in a row fails
    #: (:class:`~fedcomp.errors.NoProgressError`, naming the clients' errors) instead of going on
    #: and completing with the model it started from (ClientApps without the mod, a bug in the
    #: user's training code, every update rejected).
    max_empty_rounds: int = Field(3, ge=1, alias="max-empty-rounds")
    #: Clients build the initial model (version 0) themselves, as the server did, from the run's
    #: seed (``make_compression_mod(initial_model=...)``): a client's first downlink is then the
    #: chain of deltas since version 0 (nothing in round 1) instead of the full model. A client
    #: whose own initial model differs asks for a resync once and gets the full model.
    seeded_initial_model: bool = Field(False, alias="seeded-initial-model")
    client_device: Literal["auto", "cpu", "cuda"] = Field("auto", alias="client-device")
    # --- "topk" and "deft" uplinks (fedcomp.methods.deft) ---
    #: Fraction of the (compressed) model's entries selected per round: per client for "topk";
    #: over all clients together for "deft" (the allocation splits it among them).
    topk_density: Schedule = Field(Schedule.parse(0.01), alias="topk-density")
    #: Where DEFT's per-partition k come from (Algorithm 3's norms): "clients", the median over the
    #: last round's accepted clients of the norms each reports of its accumulated update (the
    #: paper's, 4 bytes a compressed tensor in each reply); "aggregate", the server's last
    #: aggregated update (no bytes; it holds only what was selected, so k drifts toward the
    #: partitions that had large ones).
    deft_norms: Literal["clients", "aggregate"] = Field("clients", alias="deft-norms")
    # --- "gradiveq" uplink (fedcomp.methods.gradiveq) ---
    #: Values per slice (d); 0 = each tensor's fan-in (the product of its shape after the first
    #: dimension: one output unit's weights, the paper's "multiple of the filter size").
    gradiveq_slice: int = Field(0, ge=0, le=4096, alias="gradiveq-slice")
    #: Compression loss threshold epsilon that picks each tensor's dimension k.
    gradiveq_eps: float = Field(0.1, gt=0, lt=1, alias="gradiveq-eps")
    #: Largest k; 0 = d - 1. A tensor whose k (from the eps criterion) exceeds it is sent dense.
    gradiveq_max_dim: int = Field(0, ge=0, alias="gradiveq-max-dim")
    #: Uncompressed (dense fp32) rounds whose client updates the compressor is fitted on.
    gradiveq_dense_rounds: int = Field(2, ge=1, le=100, alias="gradiveq-dense-rounds")
    #: Compressed rounds between refits (each refit is preceded by its dense rounds); 0 = never.
    gradiveq_refresh: int = Field(20, ge=0, alias="gradiveq-refresh")
    # --- bandwidth awareness (fedcomp.methods.bandwidth; off while both budgets are 0) ---
    #: Clients' links in a simulation: "UP,DOWN,LATENCY;..." (Mbit/s, Mbit/s, ms) cycled over
    #: partition ids; a node config naming uplink-mbps/downlink-mbps wins (fedcomp.net.links).
    link_profiles: str = Field("", alias="link-profiles")
    #: Per-round deadline in seconds each client's round (downlink, compute, upload, latency)
    #: should fit; 0 = none.
    round_deadline_s: float = Field(0.0, ge=0, alias="round-deadline-s")
    #: Per-client per-round cap on the upload, bytes; 0 = none.
    uplink_budget_bytes: int = Field(0, ge=0, alias="uplink-budget-bytes")
    sbc_p_min: float = Field(0.001, gt=0, le=0.5, alias="sbc-p-min")
    sbc_p_max: float = Field(0.1, gt=0, le=0.5, alias="sbc-p-max")
    #: Let the policy change local iterations (constant total sparsity p / local-iters).
    adapt_local_iters: bool = Field(False, alias="adapt-local-iters")
    local_iters_min: int = Field(1, ge=1, alias="local-iters-min")
    local_iters_max: int = Field(100, ge=1, alias="local-iters-max")
    bandwidth_policy: str = Field("constant-total-sparsity", alias="bandwidth-policy")
    #: Compute seconds per local iteration the deadline assumes; 0 = measured by each client.
    seconds_per_iter: float = Field(0.0, ge=0, alias="seconds-per-iter")

    @field_validator("uplink_codec")
    @classmethod
    def _uplink_known(cls, v: str) -> str:
        from fedcomp.methods.registry import UPLINKS

        if v not in UPLINKS:
            raise ValueError(f"unknown uplink method (known: {sorted(UPLINKS)})")
        return v

    @field_validator("max_update_norm_factor")
    @classmethod
    def _factor_not_ratcheting(cls, v: float) -> float:
        # Clients clip to factor x the last median, so the next median is at most that: under 2
        # the bound could only shrink round after round, wherever the honest norms went.
        if 0 < v < 2:
            raise ValueError("must be 0 (no adaptive bound) or at least 2")
        return v

    @field_validator("downlink_codec")
    @classmethod
    def _downlink_known(cls, v: str) -> str:
        from fedcomp.methods.registry import DOWNLINKS

        if v not in DOWNLINKS:
            raise ValueError(f"unknown downlink method (known: {sorted(DOWNLINKS)})")
        return v

    @field_validator("downlink_candidates")
    @classmethod
    def _candidates(cls, v: str) -> str:
        from fedcomp.methods.sparse_downlinks import parse_candidates

        try:
            parse_candidates(v)
        except ConfigError as err:
            raise ValueError(str(err).removeprefix("downlink-candidates: ")) from None
        return v

    @field_validator("sbc_p", "threelc_s", "local_iters", "topk_density", mode="before")
    @classmethod
    def _parse_schedule(cls, v: Any) -> Schedule:
        return Schedule.parse(v)

    @field_validator("sbc_p", "topk_density")
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

    @field_validator("link_profiles")
    @classmethod
    def _links(cls, v: str) -> str:
        from fedcomp.net.links import parse_link_profiles

        try:
            parse_link_profiles(v)
        except ConfigError as err:
            raise ValueError(str(err).removeprefix("link-profiles: ")) from None
        return v

    @field_validator("sbc_p_max", "local_iters_max")
    @classmethod
    def _not_below_min(cls, v: float, info: ValidationInfo) -> float:
        """A ``*_max`` bound is checked against its ``*_min`` (validated before it)."""
        low = str(info.field_name).removesuffix("_max") + "_min"
        lo = info.data.get(low)
        if lo is not None and lo > v:
            raise ValueError(f"must be >= {cls.model_fields[low].alias} ({lo})")
        return v

    @field_validator("bandwidth_policy")
    @classmethod
    def _policy(cls, v: str) -> str:
        from fedcomp.methods.bandwidth import policy_names

        if v not in policy_names():
            raise ValueError(f"unknown policy (known: {policy_names()})")
        return v

    def bandwidth_budget(self) -> BandwidthBudget:
        """What the clients' bandwidth policy works with (inactive while both budgets are 0)."""
        from fedcomp.methods.bandwidth import BandwidthBudget

        return BandwidthBudget(
            round_deadline_s=self.round_deadline_s,
            uplink_budget_bytes=self.uplink_budget_bytes,
            p_min=self.sbc_p_min,
            p_max=self.sbc_p_max,
            local_iters_min=self.local_iters_min,
            local_iters_max=self.local_iters_max,
            adapt_local_iters=self.adapt_local_iters,
            policy=self.bandwidth_policy,
            link_profiles=self.link_profiles,
            seconds_per_iter=self.seconds_per_iter,
        )

    @classmethod
    def keys(cls) -> set[str]:
        """The run-config keys this model reads."""
        return {f.alias or name for name, f in cls.model_fields.items()}

    def to_run_config(self) -> dict[str, Any]:
        """Flat kebab-case values (schedules in their string form)."""
        return self.model_dump(by_alias=True)

    @field_serializer("sbc_p", "threelc_s", "local_iters", "topk_density")
    def _schedule_out(self, v: Schedule, info: FieldSerializationInfo) -> float | int | str:
        """Constants as numbers (as written in pyproject.toml), other schedules as strings."""
        if v.kind != "constant":
            return str(v)
        return int(v.values[0]) if info.field_name == "local_iters" else v.values[0]

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> CompressionConfig:
        """Validate this model's keys of a Flower run config (others are ignored, the app's own;
        one that looks like a misspelt compression key gets a warning naming the key it resembles);
        raise :class:`ConfigError` naming the bad key(s)."""
        keys = cls.keys()
        for key in run_config:
            close = [] if key in keys else difflib.get_close_matches(key, sorted(keys), n=1, cutoff=0.8)
            if close:
                log.warning(
                    "fedcomp: run config key %r is not a compression key and is ignored here; did you mean %r?",
                    key,
                    close[0],
                )
        try:
            config = cls.model_validate({k: v for k, v in run_config.items() if k in keys})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc)) from None
        if not keys & set(run_config):
            # (the settings themselves are the wrapper's start-up line)
            log.info(
                "fedcomp: the run config sets no compression keys: fedcomp's defaults apply (a key your "
                "app's [tool.flwr.app.config] declares can be set with --run-config)"
            )
        return config

    def describe(self) -> str:
        """One line: the methods and the settings that matter for them."""
        from fedcomp.methods.registry import DOWNLINKS, UPLINKS

        up, down = UPLINKS[self.uplink_codec], DOWNLINKS[self.downlink_codec]
        # (the codecs' configs above are round 1's: a schedule says what follows)
        schedules = [
            f"{key} {schedule}"
            for key, schedule in (("sbc-p", self.sbc_p), ("3lc-s", self.threelc_s), ("topk-density", self.topk_density))
            if schedule.kind != "constant"
        ]
        return (
            f"uplink {up.summary(self)}, downlink {down.summary(self)}, local iterations {self.local_iters}, "
            f"error feedback {self.error_feedback}, tensors under {self.min_compress_numel} values dense"
            + (f"; schedules (round 1's values above): {', '.join(schedules)}" if schedules else "")
            + (f"; {self._bounds()}" if self.bounds_update_norm else "")
        )

    def _bounds(self) -> str:
        """What bounds each update's norm (``describe``)."""
        bounds = [f"max-update-norm {self.max_update_norm:g}"] if self.max_update_norm > 0 else []
        if self.max_update_norm_factor > 0:
            bounds.append(f"{self.max_update_norm_factor:g} x the last round's median (before any, the round's own)")
        return "update norms at most " + " and ".join(bounds)

    def uplink_codec_at(self, server_round: int) -> Codec:
        """The codec clients encode with this round (the uplink method decides;
        server-coordinated methods add per-tensor codecs of their own)."""
        from fedcomp.methods.registry import UPLINKS

        return get_codec(UPLINKS[self.uplink_codec].codec_config(self, server_round))

    def downlink_codec_at(self, server_round: int) -> Codec:
        """The codec of this round's downlink deltas."""
        from fedcomp.methods.registry import DOWNLINKS

        return get_codec(DOWNLINKS[self.downlink_codec].codec_config(self, server_round))

    def local_iters_at(self, server_round: int) -> int:
        return int(self.local_iters.at(server_round))

    @property
    def bounds_update_norm(self) -> bool:
        """Whether the server bounds each update's norm (``max-update-norm`` or its factor)."""
        return self.max_update_norm > 0 or self.max_update_norm_factor > 0


def format_validation_error(exc: ValidationError) -> str:
    """One line per bad key: ``key: message (got value)``."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<config>"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{key}: {msg} (got {err.get('input')!r})")
    return "invalid configuration: " + "; ".join(lines)
