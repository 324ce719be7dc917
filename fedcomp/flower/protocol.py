"""Everything the strategy wrapper (server) and the client mod exchange, in one place.

Record names, field names, error codes and the typed views of the two records that cross the
wire with every message: :class:`DownlinkHeader` (server -> client, in ``DOWNLINK``) and
:class:`UplinkReport` (client -> server, in ``UPLINK``). No other module spells a key: they build
and read records only through these classes, whose ``from_record`` checks every field's type and
raises :class:`~fedcomp.errors.PayloadError` naming the field, so a malformed record is one typed
error, never an exception from deep inside the strategy.

Methods may add their own bytes to the downlink (a DEFT allocation, a GradiVeQ compressor) and
small status values to the uplink (the compressor version a client holds); those travel as
``extras`` / ``status`` under keys the method names, prefixed with its id by :func:`extra_key`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from flwr.app import ConfigRecord
from flwr.common.constant import ErrorCode as FlowerErrorCode

from fedcomp.errors import PayloadError
from fedcomp.methods.base import extra_key

__all__ = [
    "CONFIG_RECORD",
    "DOWNLINK",
    "LOCAL_ITERS",
    "SERVER_ROUND",
    "STATE_BANDWIDTH",
    "STATE_META",
    "STATE_REPLICA",
    "STATE_RESIDUAL",
    "UPLINK",
    "DownlinkHeader",
    "DownlinkMode",
    "ErrorCode",
    "ReplicaMeta",
    "UplinkReport",
    "extra_key",
    "state_key",
]

#: ConfigRecord the server adds to every train/evaluate message: how to rebuild the model.
DOWNLINK = "fedcomp.downlink"
#: ConfigRecord the client mod puts in every reply: the compressed update (train) and its status.
UPLINK = "fedcomp.uplink"
#: Name of the inner strategy's train/evaluate ConfigRecord when it does not say otherwise.
CONFIG_RECORD = "config"
#: Train-config key for this round's local iterations (temporal sparsity).
LOCAL_ITERS = "local-iters"
#: Train-config key Flower's strategies set to the round number.
SERVER_ROUND = "server-round"

# context.state records kept by the client mod across rounds (a fresh process serves every
# message in deployment, so nothing may live in Python globals).
STATE_REPLICA = "fedcomp.replica"
STATE_RESIDUAL = "fedcomp.residual"
STATE_META = "fedcomp.meta"
#: The mod's own measurements for the bandwidth policy (seconds per local iteration).
STATE_BANDWIDTH = "fedcomp.bandwidth"
_SECONDS_PER_ITER = "seconds-per-iter"


class ErrorCode(IntEnum):
    """Error codes of the mod's error replies (Flower's own codes where one fits)."""

    #: The client cannot rebuild the model (digest mismatch, missing replica or compressor):
    #: the server forgets what it knew of this client and sends a full replica next time.
    RESYNC = FlowerErrorCode.MOD_FAILED_PRECONDITION
    #: The client's own update is unusable (not finite: its training diverged). Its replica and
    #: residual are kept as they were; it takes part again next round.
    LOCAL_UPDATE_REJECTED = FlowerErrorCode.CLIENT_APP_RAISED_EXCEPTION


class DownlinkMode(StrEnum):
    """How a client is brought to the server's replica."""

    NONE = "none"  # already up to date
    CHAIN = "chain"  # the deltas it missed, in order
    FULL = "full"  # the whole replica, dense fp32


def state_key(method_id: str) -> str:
    """Name of the ``context.state`` ConfigRecord a method keeps on the client."""
    return f"fedcomp.method.{method_id}"


# --- typed field access -----------------------------------------------------------------------


def _get(rec: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in rec:
        raise PayloadError("", f"{where}: field {key!r} is missing")
    value = rec[key]
    # bool is an int subclass: never accept it where a number is meant, nor a number for a bool.
    if isinstance(value, bool) and kind is not bool:
        raise PayloadError("", f"{where}: field {key!r} must be {_names(kind)}, got bool")
    if not isinstance(value, kind):
        raise PayloadError("", f"{where}: field {key!r} must be {_names(kind)}, got {type(value).__name__}")
    return value


def _opt(rec: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    return _get(rec, key, kind, where) if key in rec else None


def _names(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _json(rec: Mapping[str, Any], key: str, where: str) -> dict[str, Any]:
    text = _get(rec, key, str, where)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise PayloadError("", f"{where}: field {key!r} is not JSON ({err.msg})") from None
    if not isinstance(value, dict) or not isinstance(value.get("id"), str):
        raise PayloadError("", f"{where}: field {key!r} must be a codec config with a string 'id'")
    return value


# --- server -> client ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DownlinkHeader:
    """The downlink record: the replica the client must hold after applying ``payloads``, and
    how to compress its reply."""

    mode: DownlinkMode
    payloads: tuple[bytes, ...]
    version: int
    digest: str
    #: Name of the inner strategy's ArrayRecord / ConfigRecord in the message.
    arrays_key: str
    config_key: str
    #: Codec configs (``{"id": ..., **params}``) of the downlink deltas and of the reply.
    downlink_codec: dict[str, Any]
    uplink_codec: dict[str, Any]
    #: The uplink method's registry id (``fedcomp.methods.registry``).
    uplink_method: str
    error_feedback: bool
    min_compress_numel: int
    device: str
    #: ``fedcomp.methods.bandwidth.BandwidthBudget`` as JSON.
    bandwidth: str
    #: A method's own bytes for this client (keys from :func:`extra_key`).
    extras: dict[str, bytes] = field(default_factory=dict)

    _FIELDS = (
        "mode",
        "payloads",
        "version",
        "digest",
        "arrays-key",
        "config-key",
        "downlink-codec",
        "uplink-codec",
        "uplink-method",
        "error-feedback",
        "min-compress-numel",
        "device",
        "bandwidth",
    )

    @property
    def nbytes(self) -> int:
        """Bytes this record carries for the model: deltas or replica, plus the method extras."""
        return sum(len(p) for p in self.payloads) + sum(len(b) for b in self.extras.values())

    def to_record(self) -> ConfigRecord:
        return ConfigRecord(
            {
                "mode": str(self.mode),
                "payloads": list(self.payloads),
                "version": self.version,
                "digest": self.digest,
                "arrays-key": self.arrays_key,
                "config-key": self.config_key,
                "downlink-codec": json.dumps(self.downlink_codec),
                "uplink-codec": json.dumps(self.uplink_codec),
                "uplink-method": self.uplink_method,
                "error-feedback": self.error_feedback,
                "min-compress-numel": self.min_compress_numel,
                "device": self.device,
                "bandwidth": self.bandwidth,
                **self.extras,
            }
        )

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> DownlinkHeader:
        """Parse and type-check; raise :class:`PayloadError` naming the bad field."""
        w = "downlink"
        mode = _get(rec, "mode", str, w)
        try:
            mode = DownlinkMode(mode)
        except ValueError:
            raise PayloadError("", f"{w}: unknown mode {mode!r}") from None
        payloads = _get(rec, "payloads", list, w)
        if not all(isinstance(p, bytes) for p in payloads):
            raise PayloadError("", f"{w}: field 'payloads' must be a list of bytes")
        extras = {}
        for k, v in rec.items():
            if k in cls._FIELDS:
                continue
            if "." not in k or not isinstance(v, bytes):
                raise PayloadError("", f"{w}: unexpected field {k!r}")
            extras[k] = v
        return cls(
            mode=mode,
            payloads=tuple(payloads),
            version=_get(rec, "version", int, w),
            digest=_get(rec, "digest", str, w),
            arrays_key=_get(rec, "arrays-key", str, w),
            config_key=_get(rec, "config-key", str, w),
            downlink_codec=_json(rec, "downlink-codec", w),
            uplink_codec=_json(rec, "uplink-codec", w),
            uplink_method=_get(rec, "uplink-method", str, w),
            error_feedback=_get(rec, "error-feedback", bool, w),
            min_compress_numel=_get(rec, "min-compress-numel", int, w),
            device=_get(rec, "device", str, w),
            bandwidth=_get(rec, "bandwidth", str, w),
            extras=extras,
        )


# --- client -> server ---------------------------------------------------------------------------


@dataclass(frozen=True)
class UplinkReport:
    """The uplink record: the client's replica state, its compressed update (train replies), and
    what it measured and decided (all optional but the replica state)."""

    replica_version: int
    replica_digest: str
    payload: bytes | None = None
    encode_seconds: float | None = None
    train_seconds: float | None = None
    device: str | None = None
    #: What the bandwidth policy chose (fedcomp.methods.bandwidth).
    sbc_p: float | None = None
    local_iters: int | None = None
    budget_bytes: int | None = None
    estimated_bytes: int | None = None
    fits: bool | None = None
    #: The client's link: uplink Mbit/s, downlink Mbit/s, latency ms.
    link: tuple[float, float, float] | None = None
    #: Diagnostics: L2 norms of the residual kept after encoding and of the local update.
    residual_norm: float | None = None
    update_norm: float | None = None
    #: A method's own status values (keys from :func:`extra_key`).
    status: dict[str, int] = field(default_factory=dict)

    _LINK = ("uplink-mbps", "downlink-mbps", "latency-ms")
    #: The optional fields: record key, attribute, type (``float`` accepts ints too).
    _OPTIONAL: tuple[tuple[str, str, type], ...] = (
        ("payload", "payload", bytes),
        ("encode-seconds", "encode_seconds", float),
        ("train-seconds", "train_seconds", float),
        ("device", "device", str),
        ("sbc-p", "sbc_p", float),
        ("local-iters", "local_iters", int),
        ("budget-bytes", "budget_bytes", int),
        ("estimated-bytes", "estimated_bytes", int),
        ("fits", "fits", bool),
        ("residual-norm", "residual_norm", float),
        ("update-norm", "update_norm", float),
    )

    def to_record(self) -> ConfigRecord:
        out: dict[str, Any] = {"replica-version": self.replica_version, "replica-digest": self.replica_digest}
        for key, attr, _ in self._OPTIONAL:
            value = getattr(self, attr)
            if value is not None:
                out[key] = value
        if self.link is not None:
            out.update(zip(self._LINK, (float(x) for x in self.link), strict=True))
        out.update(self.status)
        return ConfigRecord(out)

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> UplinkReport:
        """Parse and type-check; raise :class:`PayloadError` naming the bad field."""
        w = "uplink"
        numbers = (int, float)
        link = None
        if any(k in rec for k in cls._LINK):
            link = tuple(float(_get(rec, k, numbers, w)) for k in cls._LINK)
        known = {"replica-version", "replica-digest", *cls._LINK, *(key for key, _, _ in cls._OPTIONAL)}
        status = {}
        for k, v in rec.items():
            if k in known:
                continue
            if "." not in k or isinstance(v, bool) or not isinstance(v, int):
                raise PayloadError("", f"{w}: unexpected field {k!r}")
            status[k] = v
        replica_version = _get(rec, "replica-version", int, w)
        replica_digest = _get(rec, "replica-digest", str, w)
        optional: dict[str, Any] = {}
        for key, attr, kind in cls._OPTIONAL:
            value = _opt(rec, key, numbers if kind is float else kind, w)
            optional[attr] = float(value) if kind is float and value is not None else value
        return cls(replica_version, replica_digest, link=link, status=status, **optional)  # type: ignore[arg-type]


# --- client state ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaMeta:
    """The ``STATE_META`` record: which version the stored replica is, and its digest."""

    version: int
    digest: str

    def to_record(self) -> ConfigRecord:
        return ConfigRecord({"version": self.version, "digest": self.digest})

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> ReplicaMeta:
        return cls(_get(rec, "version", int, "state"), _get(rec, "digest", str, "state"))


def measured_seconds_per_iter(state_record: Mapping[str, Any] | None) -> float:
    """The fastest seconds per local iteration this client has measured (0: none yet)."""
    if state_record is None:
        return 0.0
    return float(_opt(state_record, _SECONDS_PER_ITER, (int, float), "state") or 0.0)


def seconds_per_iter_record(seconds: float) -> ConfigRecord:
    return ConfigRecord({_SECONDS_PER_ITER: float(seconds)})
