"""Everything the strategy wrapper (server) and the client mod exchange, in one place.

Record names, field names, error codes and the typed views of the two records that cross the
wire with every message: :class:`DownlinkHeader` (server -> client, in ``DOWNLINK``) and
:class:`UplinkReport` (client -> server, in ``UPLINK``). No other module spells a key: they build
and read records only through these classes, whose ``from_record`` checks every field's type and
raises :class:`~fedcomp.errors.PayloadError` naming the field, so a malformed record is one typed
error, never an exception from deep inside the strategy.

Methods may add their own bytes to the downlink (a DEFT allocation, a GradiVeQ compressor), and
to the uplink small status values (the compressor version a client holds) and bytes of a train
reply (DEFT's norms, sent only when the allocation asks: a server that predates them would reject
a reply carrying them); those travel as ``extras`` / ``status`` under keys the method names,
prefixed with its id by :func:`extra_key`.

**Protocol versions.** Version 1 (no ``protocol`` field): the records as above. Version 2 adds
update outcomes, so that no update is lost silently: every downlink carries ``protocol = 2`` and
an :class:`UpdateOutcome` (the server's word on the node's last update), and a train reply to a
version-2 downlink echoes its round in ``update-round``. A client keeps what it sent
(:class:`~fedcomp.flower.pending.PendingUpdate`) until an outcome settles it, and adds it back to
its residual when it was not aggregated (:meth:`UpdateOutcome.verdict` has the rules). A version-2
client talking to a version-1 server keeps nothing (it cannot learn an outcome) and behaves as
before; a version-1 client rejects a version-2 downlink's new fields (a typed resync error every
round): upgrade clients with or before the server.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import Any

from flwr.app import ConfigRecord
from flwr.common.constant import ErrorCode as FlowerErrorCode

from fedcomp.errors import PayloadError, shown
from fedcomp.methods.base import extra_key

__all__ = [
    "CONFIG_RECORD",
    "DOWNLINK",
    "LINEAGE",
    "LOCAL_ITERS",
    "PROTOCOL_VERSION",
    "SERVER_ROUND",
    "STATE_BANDWIDTH",
    "STATE_CODEC_SECONDS",
    "STATE_LATTICE",
    "STATE_META",
    "STATE_NODE",
    "STATE_PENDING",
    "STATE_PENDING_NODE",
    "STATE_REPLICA",
    "STATE_RESIDUAL",
    "UNSETTLED_UPDATES",
    "UPLINK",
    "DownlinkHeader",
    "DownlinkMode",
    "ErrorCode",
    "ReplicaMeta",
    "UpdateOutcome",
    "UpdateStatus",
    "UplinkReport",
    "extra_key",
    "pack_unsettled",
    "state_key",
    "unsettled_record",
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
#: The update this client sent last, kept until the server says whether it was aggregated.
STATE_PENDING = "fedcomp.pending"
#: The lattice grid the client's replica is on (``downlink-codec = "lattice"``): tensor name ->
#: exponent ``e`` of its step ``2**e``, adopted from the first lattice payload after a full replica.
STATE_LATTICE = "fedcomp.lattice"
#: The last lattice payload the client applied (``base``, ``version``, ``payload``): a client
#: whose reply the server never got (it timed out) is counted at ``base`` while it holds
#: ``version``; it takes the payload back and applies the merge the server sends from ``base``.
STATE_LATTICE_LAST = "fedcomp.lattice-last"
#: The mod's own measurements for the bandwidth policy (seconds per local iteration).
STATE_BANDWIDTH = "fedcomp.bandwidth"
#: The node id a restored pending update was sent under (``node-id``, a string), when the state
#: was saved under another id than the client's now: the server's records of that id settle it,
#: from the downlink's :data:`UNSETTLED_UPDATES` table.
STATE_PENDING_NODE = "fedcomp.pending-node"
#: The Flower node id the state was saved under (``node-id``, a string: ids are unsigned 64-bit),
#: so that state restored under another id (a restarted SuperNode, a resumed simulation) knows
#: the server has no record of it under the new id (:data:`STATE_PENDING_NODE`).
STATE_NODE = "fedcomp.node"
#: context.state ConfigRecord: the client's fastest measured codec seconds (downlink apply, and
#: encode per uplink codec id), for the bandwidth policy (``fedcomp.flower.mod``).
STATE_CODEC_SECONDS = "fedcomp.codec-seconds"
#: Train/evaluate config key: the run's identity across server restarts (a hex token). Clients
#: key the state they persist on disk by it (``fedcomp.flower.persist``).
LINEAGE = "fedcomp.lineage"
_SECONDS_PER_ITER = "seconds-per-iter"


class ErrorCode(IntEnum):
    """Error codes of the mod's error replies (Flower's own codes where one fits)."""

    #: The client cannot rebuild the model (digest mismatch, missing replica or compressor):
    #: the server forgets what it knew of this client and sends a full replica next time.
    RESYNC = FlowerErrorCode.MOD_FAILED_PRECONDITION
    #: The client's own update is unusable (not finite: its training diverged). Its replica and
    #: residual are kept as they were; it takes part again next round.
    LOCAL_UPDATE_REJECTED = FlowerErrorCode.CLIENT_APP_RAISED_EXCEPTION


#: The strategy <-> mod protocol this package speaks (see the module docstring).
PROTOCOL_VERSION = 2
#: Longest rejection reason an outcome carries (the server cuts longer ones).
MAX_REASON_CHARS = 500


#: Downlink field (bytes) in a message to a node the server has no record of: the server's records
#: of the nodes whose last train round may hold an update that was not aggregated and that were not
#: told so since (a SuperNode that restarts comes back under a new node id, with the state it
#: saved under the old one: :func:`unsettled_record` finds that id's record). A method extra's
#: name (a dot, bytes), so that protocol-2 clients of earlier versions accept and ignore it.
UNSETTLED_UPDATES = "fedcomp.unsettled-updates"
#: One row: node id, the round of its last update that reached the server, its status code.
_UNSETTLED_ROW = struct.Struct("<QIB")
_STATUS_CODES = {"none": 0, "aggregated": 1, "rejected": 2}
#: Most rows one table carries (the most recently sent rounds first): 4,096 rows are 53 kB.
MAX_UNSETTLED_ROWS = 4096


class DownlinkMode(StrEnum):
    """How a client is brought to the server's replica."""

    NONE = "none"  # already up to date
    CHAIN = "chain"  # the deltas it missed, in order (lattice: one payload, their exact sum)
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


# --- update outcomes (protocol 2) -------------------------------------------------------------------


class UpdateStatus(StrEnum):
    """What became of a node's last update that reached the server."""

    #: Decoded, accepted and aggregated into the model the round produced.
    AGGREGATED = "aggregated"
    #: Reached the server but did not enter the model (the reason says why: corrupt payload,
    #: stale version, max-update-norm, or the inner strategy aggregated nothing that round).
    REJECTED = "rejected"
    #: No update from this node has reached the server yet.
    NONE = "none"


@dataclass(frozen=True)
class UpdateOutcome:
    """The server's word on a node's updates, in every protocol-2 downlink.

    The server keeps, per node, the round and fate of the last update it *received*; it keeps no
    record of replies that never came. ``settled_round`` says how far that record is final: every
    train round up to it has been aggregated, so an update a client made in such a round and that
    is not the recorded one never reached the server (it timed out, was dropped, or its message
    was lost). The server sets ``settled_round = r - 1`` when it configures round ``r`` and
    ``settled_round = r`` once round ``r`` is aggregated. ``records_from_round`` is the first
    round its records cover: 1 for a server that kept them from the start (or restored them from
    a checkpoint), the first round it ran for one that restarted without them.
    """

    #: The server round of the message this outcome travels in.
    round: int
    #: Every train round <= this one has been aggregated: outcomes up to it are final.
    settled_round: int
    #: The round of the last update from this node that reached the server (0: none yet).
    last_update_round: int
    last_update_status: UpdateStatus
    #: Why it was rejected (empty unless ``last_update_status`` is REJECTED).
    last_update_reason: str = ""
    #: The first round the server's records cover (outcomes of earlier rounds are unknown).
    records_from_round: int = 1

    _FIELDS = (
        "round",
        "settled-round",
        "last-update-round",
        "last-update-status",
        "last-update-reason",
        "records-from-round",
    )

    def fields(self) -> dict[str, Any]:
        """The record fields (wire names), as :class:`DownlinkHeader` writes them."""
        return {
            "round": self.round,
            "settled-round": self.settled_round,
            "last-update-round": self.last_update_round,
            "last-update-status": str(self.last_update_status),
            "last-update-reason": self.last_update_reason,
            "records-from-round": self.records_from_round,
        }

    @classmethod
    def from_record(cls, rec: Mapping[str, Any], where: str = "downlink") -> UpdateOutcome:
        """Parse and check; raise :class:`PayloadError` naming the bad field."""
        w = where
        values = {}
        for key in ("round", "settled-round", "last-update-round", "records-from-round"):
            values[key] = _get(rec, key, int, w)
            if values[key] < 0:
                raise PayloadError("", f"{w}: field {key!r} must be >= 0, got {values[key]}")
        status_text = _get(rec, "last-update-status", str, w)
        try:
            status = UpdateStatus(status_text)
        except ValueError:
            raise PayloadError("", f"{w}: field 'last-update-status' is {status_text!r}, not one of "
                               f"{[str(s) for s in UpdateStatus]}") from None  # fmt: skip
        reason = _get(rec, "last-update-reason", str, w)
        settled, last, start = values["settled-round"], values["last-update-round"], values["records-from-round"]
        if last > settled:
            raise PayloadError("", f"{w}: field 'last-update-round' = {last} is after 'settled-round' = {settled}")
        if start > settled + 1:
            raise PayloadError(
                "", f"{w}: field 'records-from-round' = {start} is after 'settled-round' + 1 = {settled + 1}"
            )
        if 0 < last < start:
            raise PayloadError("", f"{w}: field 'last-update-round' = {last} is before 'records-from-round' = {start}")
        if (status is UpdateStatus.NONE) != (last == 0):
            raise PayloadError(
                "", f"{w}: field 'last-update-status' is {str(status)!r} with 'last-update-round' = {last}"
            )
        if reason and status is not UpdateStatus.REJECTED:
            raise PayloadError("", f"{w}: field 'last-update-reason' is set for a {str(status)!r} update")
        if len(reason) > MAX_REASON_CHARS:
            raise PayloadError("", f"{w}: field 'last-update-reason' is longer than {MAX_REASON_CHARS} characters")
        return cls(values["round"], settled, last, status, reason, start)

    def verdict(self, update_round: int, train: bool) -> bool | None:
        """Whether the update a client made in ``update_round`` was aggregated: True (it is in
        the model), False (it is not, and never will be: re-send it), None (not known yet).

        * ``update_round <= settled_round``: final. Aggregated iff it is the recorded update and
          that one was aggregated; otherwise it was rejected, or it never reached the server.
        * ``update_round < records_from_round``: unknown (the server restarted without its
          records). Counted as aggregated: re-sending an update the restored model may already
          hold would apply it twice; dropping one it lacks costs what a dropout costs.
        * ``update_round > settled_round`` in a *train* message: the server asks for a new update
          without having aggregated that round, so it went back (restarted from a checkpoint
          taken before it, or lost its records): an unknown outcome counts as not aggregated.
          This is exact when the server's records are saved with its model (a checkpoint taken
          before round ``r`` holds no update of round ``r``); a server that restored a model
          containing the update but records older than it would get it twice.
        * otherwise (an evaluate message sent before that round was aggregated): None; wait.
        """
        if update_round < self.records_from_round:
            return True
        if update_round <= self.settled_round:
            return update_round == self.last_update_round and self.last_update_status is UpdateStatus.AGGREGATED
        return False if train else None


def pack_unsettled(rows: Iterable[tuple[int, int, UpdateStatus]]) -> bytes:
    """The :data:`UNSETTLED_UPDATES` table: ``(node id, last update round, status)`` rows, at most
    :data:`MAX_UNSETTLED_ROWS` (the first ones)."""
    out = bytearray()
    for i, (node, last_round, status) in enumerate(rows):
        if i == MAX_UNSETTLED_ROWS:
            break
        out += _UNSETTLED_ROW.pack(node, last_round, _STATUS_CODES[str(status)])
    return bytes(out)


def unsettled_record(table: bytes, node: int) -> tuple[int, UpdateStatus] | None:
    """The record of ``node`` in an :data:`UNSETTLED_UPDATES` table (its last update's round and
    status), or None; raise :class:`PayloadError` for a malformed table."""
    size = _UNSETTLED_ROW.size
    if len(table) % size:
        raise PayloadError("", f"downlink: field {UNSETTLED_UPDATES!r} is {len(table)} bytes, not rows of {size}")
    if len(table) > MAX_UNSETTLED_ROWS * size:
        raise PayloadError("", f"downlink: field {UNSETTLED_UPDATES!r} has more than {MAX_UNSETTLED_ROWS} rows")
    statuses = {code: UpdateStatus(name) for name, code in _STATUS_CODES.items()}
    for row_node, last_round, code in _UNSETTLED_ROW.iter_unpack(table):
        if code not in statuses or (code == 0) != (last_round == 0):
            raise PayloadError("", f"downlink: field {UNSETTLED_UPDATES!r} has a malformed row for node {row_node}")
        if row_node == node:
            return last_round, statuses[code]
    return None


# --- server -> client ---------------------------------------------------------------------------


#: The downlink field of the server's ``max-update-norm`` (absent when it sets none).
MAX_UPDATE_NORM = "max-update-norm"


def work_scale(local_iters: object, scheduled: object, most: int) -> float:
    """How many times the train config's local iterations (``scheduled``) a client trained
    (``local_iters``, at most ``most``), and at least 1: the factor its ``max-update-norm`` grows
    by. An update's norm grows with the local steps taken, and the bandwidth policy
    (``adapt-local-iters``) gives a client on a fast link ten times the steps of one on a slow link:
    one bound for both clipped or rejected the fast one. 1 when either count is not a positive
    int (a config without ``local-iters``)."""
    counts = (local_iters, scheduled)
    if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts):
        return 1.0
    return max(1.0, min(int(local_iters), most) / int(scheduled))  # type: ignore[call-overload]


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
    #: Protocol 2: the outcome of this node's last update (None: a protocol-1 downlink).
    outcome: UpdateOutcome | None = None
    #: The server's ``max-update-norm`` (0: none; the field is then absent): an honest client
    #: sends at most this, keeping the rest in its residual, rather than be rejected round after
    #: round while its residual grows.
    max_update_norm: float = 0.0

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
    def protocol(self) -> int:
        """The protocol version of this downlink: 2 when it carries an outcome, else 1."""
        return PROTOCOL_VERSION if self.outcome is not None else 1

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
                "downlink-codec": json.dumps(self.downlink_codec, separators=(",", ":")),
                "uplink-codec": json.dumps(self.uplink_codec, separators=(",", ":")),
                "uplink-method": self.uplink_method,
                "error-feedback": self.error_feedback,
                "min-compress-numel": self.min_compress_numel,
                "device": self.device,
                "bandwidth": self.bandwidth,
                **self.extras,
                **({"protocol": PROTOCOL_VERSION, **self.outcome.fields()} if self.outcome is not None else {}),
                **({MAX_UPDATE_NORM: self.max_update_norm} if self.max_update_norm > 0 else {}),
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
        version = _opt(rec, "protocol", int, w)
        if version is not None and version not in (1, PROTOCOL_VERSION):
            raise PayloadError("", f"{w}: field 'protocol' is {version}; this client speaks 1 and {PROTOCOL_VERSION}")
        # A protocol-1 downlink has no outcome fields: there they are unexpected, as any other.
        known = (
            *cls._FIELDS,
            "protocol",
            MAX_UPDATE_NORM,
            *(UpdateOutcome._FIELDS if version == PROTOCOL_VERSION else ()),
        )
        bound = _opt(rec, MAX_UPDATE_NORM, float, w)
        if bound is not None and not (math.isfinite(bound) and bound > 0):
            raise PayloadError("", f"{w}: field {MAX_UPDATE_NORM!r} must be a finite number > 0, got {bound!r}")
        outcome = UpdateOutcome.from_record(rec, w) if version == PROTOCOL_VERSION else None
        extras = {}
        for k, v in rec.items():
            if k in known:
                continue
            if "." not in k or not isinstance(v, bytes):
                raise PayloadError("", f"{w}: unexpected field {shown(k)}")
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
            outcome=outcome,
            max_update_norm=bound or 0.0,
        )


# --- client -> server ---------------------------------------------------------------------------


#: The longest device or codec name an uplink report may carry.
MAX_NAME_CHARS = 64
#: The most bytes of a method's own an uplink report may carry, all keys together (DEFT's norms
#: take 4 bytes a compressed tensor).
MAX_UPLINK_EXTRA_BYTES = 1 << 20
#: The most fields of a method's own (status values and bytes) an uplink report may carry.
MAX_UPLINK_METHOD_FIELDS = 256


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
    #: The codec id of the update's compressed tensors (``dense-fp32`` when the bandwidth policy
    #: sent the whole update dense); informational: the server decodes by each tensor's own id.
    codec: str | None = None
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
    #: A method's own bytes in a train reply (keys from :func:`extra_key`; DEFT's tensor norms).
    extras: dict[str, bytes] = field(default_factory=dict)
    #: Protocol 2: the ``round`` of the downlink this train reply answers (its update's round).
    update_round: int | None = None

    _LINK = ("uplink-mbps", "downlink-mbps", "latency-ms")
    #: The optional fields: record key, attribute, type (``float`` accepts ints too).
    _OPTIONAL: tuple[tuple[str, str, type], ...] = (
        ("payload", "payload", bytes),
        ("encode-seconds", "encode_seconds", float),
        ("train-seconds", "train_seconds", float),
        ("device", "device", str),
        ("codec", "codec", str),
        ("sbc-p", "sbc_p", float),
        ("local-iters", "local_iters", int),
        ("budget-bytes", "budget_bytes", int),
        ("estimated-bytes", "estimated_bytes", int),
        ("fits", "fits", bool),
        ("residual-norm", "residual_norm", float),
        ("update-norm", "update_norm", float),
        ("update-round", "update_round", int),
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
        out.update(self.extras)
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
        status: dict[str, int] = {}
        extras: dict[str, bytes] = {}
        for k, v in rec.items():
            if k in known:
                continue
            if "." in k and isinstance(v, bytes):
                extras[k] = v
            elif "." not in k or isinstance(v, bool) or not isinstance(v, int):
                raise PayloadError("", f"{w}: unexpected field {shown(k)}")
            else:
                status[k] = v
        if len(status) + len(extras) > MAX_UPLINK_METHOD_FIELDS:
            raise PayloadError("", f"{w}: more than {MAX_UPLINK_METHOD_FIELDS} fields of a method's own")
        if sum(len(v) for v in extras.values()) > MAX_UPLINK_EXTRA_BYTES:
            raise PayloadError("", f"{w}: a method's fields hold more than {MAX_UPLINK_EXTRA_BYTES} bytes")
        replica_version = _get(rec, "replica-version", int, w)
        replica_digest = _get(rec, "replica-digest", str, w)
        optional: dict[str, Any] = {}
        for key, attr, kind in cls._OPTIONAL:
            value = _opt(rec, key, numbers if kind is float else kind, w)
            optional[attr] = float(value) if kind is float and value is not None else value
        # Ranges: every number is a count, a size, a time, a rate or a norm (finite, >= 0).
        counted = [k for k, _, kind in cls._OPTIONAL if kind in (int, float)] + (list(cls._LINK) if link else [])
        for key in ("replica-version", *(k for k in counted if k in rec)):
            value = rec[key]
            if not math.isfinite(value) or value < 0:
                raise PayloadError("", f"{w}: field {key!r} must be finite and >= 0, got {value!r}")
        for key, attr, kind in cls._OPTIONAL:  # names only (device, codec): they end up in results.json
            if kind is str and optional[attr] is not None and len(optional[attr]) > MAX_NAME_CHARS:
                raise PayloadError("", f"{w}: field {key!r} is longer than {MAX_NAME_CHARS} characters")
        if optional["sbc_p"] is not None and optional["sbc_p"] > 1:
            raise PayloadError("", f"{w}: field 'sbc-p' must be <= 1, got {optional['sbc_p']!r}")
        return cls(replica_version, replica_digest, link=link, status=status, extras=extras, **optional)  # type: ignore[arg-type]


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


def lattice_grid_from(rec: Mapping[str, Any] | None) -> dict[str, int] | None:
    """The ``STATE_LATTICE`` record as tensor name -> exponent (None: absent or unreadable)."""
    if rec is None:
        return None
    out = {k: v for k, v in rec.items() if isinstance(v, int) and not isinstance(v, bool)}
    return out if len(out) == len(rec) else None


def lattice_grid_record(grid: Mapping[str, int]) -> ConfigRecord:
    return ConfigRecord(dict(grid))


def lattice_last_from(rec: Mapping[str, Any] | None) -> tuple[int, int, bytes] | None:
    """The ``STATE_LATTICE_LAST`` record as (base, version, payload) (None: absent or unreadable)."""
    if rec is None:
        return None
    base, version, payload = rec.get("base"), rec.get("version"), rec.get("payload")
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (base, version))
    if not ints or not isinstance(payload, bytes):
        return None
    assert isinstance(base, int) and isinstance(version, int)
    return base, version, payload


def lattice_last_record(base: int, version: int, payload: bytes) -> ConfigRecord:
    return ConfigRecord({"base": base, "version": version, "payload": payload})


def measured_seconds_per_iter(state_record: Mapping[str, Any] | None) -> float:
    """The fastest seconds per local iteration this client has measured (0: none yet)."""
    if state_record is None:
        return 0.0
    return float(_opt(state_record, _SECONDS_PER_ITER, (int, float), "state") or 0.0)


def seconds_per_iter_record(seconds: float) -> ConfigRecord:
    return ConfigRecord({_SECONDS_PER_ITER: float(seconds)})
