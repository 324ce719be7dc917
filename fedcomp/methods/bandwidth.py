"""Bandwidth-aware uplink: each client picks its SBC ``p`` (and, where allowed, its local
iterations) so that its upload fits the round's budget.

The server states the budget (run config, sent in the downlink record as JSON): a per-round
deadline ``round-deadline-s`` and/or a byte budget ``uplink-budget-bytes`` per client, bounds
``sbc-p-min``/``sbc-p-max`` and ``local-iters-min``/``local-iters-max``, and whether local
iterations may change (``adapt-local-iters``). Each client knows its link
(:mod:`fedcomp.net.links`: node config, or the run's ``link-profiles`` cycled over partitions) and,
from its own last round, its seconds per local iteration. A :class:`BandwidthPolicy` turns both
into a :class:`Choice`; the client mod applies it (``local-iters`` before training, ``p`` when it
compresses) and reports it in the uplink record, so ``results.json`` shows it per client per
round.

The default, :class:`ConstantTotalSparsity`, follows SBC's finding that temporal sparsity
(local iterations n: one upload per n steps) and gradient sparsity (fraction p kept) trade at
constant *total* sparsity ``p / n``: the scheduled ``(p0, n0)`` fix the target ``tau = p0 / n0``;
the client takes the largest ``p`` in ``[sbc-p-min, sbc-p-max]`` whose upload fits, and with
``adapt-local-iters`` trains ``n = round(p / tau)`` steps (clamped to the bounds), so a slow link
uploads fewer entries after fewer steps and a fast one more entries after more steps, all at the
same entries-per-step. Its time budget for a deadline ``D``::

    upload time  <=  D - 2 * latency - downlink bytes / downlink rate - n * seconds per iteration

(seconds per iteration: ``seconds-per-iter`` when set, for reproducible emulation; else the
fastest the client has measured itself, wall time of its train handler over its iterations)
and a byte budget ``B`` caps the upload at ``B`` directly (both: the smaller). Bytes for a ``p``
come from :func:`estimate_sbc_bytes` (Golomb's expected code length per kept position, one float
per tensor, protobuf framing), which is within a few percent of the real payload for LeNet5.
When even ``sbc-p-min`` does not fit, the client sends at ``sbc-p-min`` and reports
``fits = false``.

Codec time counts (issue #13): compression pays only when it costs less time than the bytes it
saves. When the client knows its link and what one whole update costs it in codec time per codec
(``ClientSituation.codec_seconds``: the client's own measurements, its fastest so far, of
applying a round's downlink plus encoding its update with that codec; the client mod times its
real encode every round and, in its first such round, a few dense fp32 encodes of the same
update), the deadline's upload time also pays the chosen codec's seconds, and the policy compares
the upload it chose (codec seconds + bytes over the uplink) with a dense fp32 upload of the same
update: when dense is faster (a fast link), the choice names ``{"id": "dense-fp32"}`` as its
``codec``, so a fast link never makes a round slower than dense. The server's decode of the
reply is not counted: the client cannot measure it (``bench links`` charges it). Every uplink
method whose ``p`` the policy picks decodes dense fp32 tensors (the base method's decode, and the
streaming sum, accept them), and dense fp32 is lossless, so the residual is sent in full and
error feedback is not disturbed. Without codec seconds (a client's first round) the policy
decides on bytes alone, as before. The client mod runs the policy whenever it knows its link or
a budget applies: a link without a budget keeps the scheduled ``p``, but may still go dense.

Other policies: implement the protocol and :func:`register_policy` it under a name, then set
``bandwidth-policy`` to that name (the ClientApp must import the module that registers it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

from fedcomp.codecs.golomb import expected_bits_per_position, golomb_b
from fedcomp.errors import ConfigError
from fedcomp.methods.statistics import sent_dense
from fedcomp.net.links import LinkProfile

__all__ = [
    "DENSE_CODEC",
    "BandwidthBudget",
    "BandwidthPolicy",
    "Choice",
    "ClientSituation",
    "ConstantTotalSparsity",
    "estimate_dense_bytes",
    "estimate_sbc_bytes",
    "get_policy",
    "register_policy",
]

#: Protobuf framing per tensor beyond its name (shape, dtype, codec id, field tags), in bytes;
#: measured on LeNet5's tensors (34 to 44 bytes in all with the name).
TENSOR_OVERHEAD_BYTES = 24
#: Framing of the update message itself (format version, base model version).
UPDATE_OVERHEAD_BYTES = 8
#: What crosses the wire around an update: Flower's message (metadata, object ids and framing),
#: fedcomp's uplink fields and the metrics; measured about 870 bytes a reply of the reference
#: app (deflated, as Flower 1.41 sends it), rounded up. A byte budget or deadline pays for it too.
MESSAGE_OVERHEAD_BYTES = 1024


#: The codec a policy falls back to when compressing costs more time than it saves.
DENSE_CODEC: dict[str, Any] = {"id": "dense-fp32"}


def estimate_dense_bytes(tensors: Sequence[tuple[str, int]]) -> int:
    """Bytes of a dense fp32 update of tensors ``(name, numel)``: 4 per value plus framing."""
    return UPDATE_OVERHEAD_BYTES + sum(4 * n + TENSOR_OVERHEAD_BYTES + len(name.encode()) for name, n in tensors)


def estimate_sbc_bytes(tensors: Sequence[tuple[str, int]], p: float, min_numel: int) -> int:
    """Expected bytes of an SBC update of tensors ``(name, numel)`` at fraction ``p``.

    Tensors with fewer than ``min_numel`` elements, and running statistics, go dense fp32 (4
    bytes each: :func:`~fedcomp.methods.statistics.sent_dense`). Each SBC tensor
    keeps ``k = max(1, round(p n))`` positions coded at Golomb's expected bits per position for
    density ``k / n`` (with the paper's optimal ``b``), plus 32 bits for its mean.
    """
    total = UPDATE_OVERHEAD_BYTES
    for name, n in tensors:
        framing = TENSOR_OVERHEAD_BYTES + len(name.encode())
        if sent_dense(name, n, min_numel):
            total += 4 * n + framing
            continue
        if n == 0:
            total += framing
            continue
        k = max(1, round(p * n))
        q = min(1.0, k / n)
        bits = k * expected_bits_per_position(q, golomb_b(q)) + 32
        total += math.ceil(bits / 8) + framing
    return total


@dataclass(frozen=True)
class BandwidthBudget:
    """What the server allows this round (the downlink record's ``bandwidth`` JSON)."""

    round_deadline_s: float = 0.0  # 0 = no deadline
    uplink_budget_bytes: int = 0  # 0 = no byte budget
    p_min: float = 0.001
    p_max: float = 0.1
    local_iters_min: int = 1
    local_iters_max: int = 100
    adapt_local_iters: bool = False
    policy: str = "constant-total-sparsity"
    #: The run's link profiles ("UP,DOWN,LAT;...") for clients whose node config names none.
    link_profiles: str = ""
    #: Compute seconds per local iteration the deadline assumes; 0 = each client's own
    #: measurement (the fastest seconds per iteration it has seen, 0 before its first round).
    seconds_per_iter: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.p_min <= self.p_max <= 0.5:
            raise ConfigError(f"sbc-p-min/sbc-p-max: need 0 < min <= max <= 0.5 (got {self.p_min}, {self.p_max})")
        if not 1 <= self.local_iters_min <= self.local_iters_max:
            raise ConfigError(
                f"local-iters-min/local-iters-max: need 1 <= min <= max (got {self.local_iters_min}, {self.local_iters_max})"
            )
        if self.round_deadline_s < 0 or self.uplink_budget_bytes < 0 or self.seconds_per_iter < 0:
            raise ConfigError("round-deadline-s/uplink-budget-bytes/seconds-per-iter: must be >= 0 (0 = off)")

    @property
    def active(self) -> bool:
        return self.round_deadline_s > 0 or self.uplink_budget_bytes > 0

    def to_json(self) -> str:
        """The fields that differ from the defaults, compact (it crosses the wire in every
        downlink: the whole record took 255 bytes of each, ``{}`` when the policy is off)."""
        defaults = BandwidthBudget()
        changed = {k: v for k, v in asdict(self).items() if v != getattr(defaults, k)}
        return json.dumps(changed, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> BandwidthBudget:
        try:
            data = json.loads(text)
            return cls(**data)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"bandwidth: not a valid budget record ({err})") from None


@dataclass(frozen=True)
class ClientSituation:
    """What the client knows when it decides."""

    link: LinkProfile | None
    tensors: tuple[tuple[str, int], ...]  # (name, numel) of the model
    min_numel: int
    p: float  # this round's scheduled p
    local_iters: int  # this round's scheduled local iterations
    downlink_bytes: int = 0  # the downlink payload it received this round
    seconds_per_iter: float = 0.0  # its compute per local iteration (last round); 0 = unknown
    #: Codec time of one whole update per codec id (encode on the client plus decode), measured;
    #: ``codec_id`` names the method's codec among them. Empty: unknown (bytes alone decide).
    codec_seconds: tuple[tuple[str, float], ...] = ()
    codec_id: str = "sbc"

    def codec_time(self, codec_id: str) -> float | None:
        """The measured codec seconds of ``codec_id`` (None: not measured)."""
        return dict(self.codec_seconds).get(codec_id)


@dataclass(frozen=True)
class Choice:
    p: float
    local_iters: int
    budget_bytes: int | None  # None: no budget applied
    estimated_bytes: int
    fits: bool
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    #: A codec config that replaces the method's for this update (None: the method's, at ``p``).
    codec: dict[str, Any] | None = None


@runtime_checkable
class BandwidthPolicy(Protocol):
    """Picks this client's ``p`` and local iterations for one round."""

    def choose(self, budget: BandwidthBudget, situation: ClientSituation) -> Choice: ...


class ConstantTotalSparsity:
    """The default policy (see the module docstring).

    ``margin``: the estimate must fit within ``(1 - margin)`` of the budget (the fast SBC mode
    keeps a few percent more or fewer entries than ``k``).
    """

    def __init__(self, margin: float = 0.05, search_steps: int = 48) -> None:
        self.margin = margin
        self.search_steps = search_steps

    def _iters(self, p: float, tau: float, b: BandwidthBudget, s: ClientSituation) -> int:
        if not b.adapt_local_iters:
            return s.local_iters
        return int(min(b.local_iters_max, max(b.local_iters_min, round(p / tau))))

    def _byte_budget(self, iters: int, b: BandwidthBudget, s: ClientSituation) -> float | None:
        """Bytes the upload may take with ``iters`` local iterations; None = unbounded."""
        limits = []
        if b.uplink_budget_bytes > 0:
            limits.append(float(b.uplink_budget_bytes))
        if b.round_deadline_s > 0 and s.link is not None:
            spare = (
                b.round_deadline_s
                - 2 * s.link.latency_ms / 1000.0
                - s.link.downlink_seconds(s.downlink_bytes)
                - iters * s.seconds_per_iter
                - (s.codec_time(s.codec_id) or 0.0)  # compressing takes its time out of the round too
            )
            limits.append(s.link.uplink_bytes_in(spare))
        return min(limits) if limits else None

    def choose(self, budget: BandwidthBudget, situation: ClientSituation) -> Choice:
        return dense_if_faster(self._choose(budget, situation), budget, situation)

    def _choose(self, budget: BandwidthBudget, situation: ClientSituation) -> Choice:
        s, b = situation, budget
        tau = s.p / max(1, s.local_iters)

        def est(p: float) -> int:
            return estimate_sbc_bytes(s.tensors, p, s.min_numel)

        no_budget = not b.active or (b.uplink_budget_bytes <= 0 and s.link is None)
        if no_budget:
            reason = "no budget" if not b.active else "deadline but no link profile for this client"
            return Choice(s.p, s.local_iters, None, est(s.p), True, reason)

        def fits(p: float) -> tuple[bool, int, float]:
            n = self._iters(p, tau, b, s)
            cap = self._byte_budget(n, b, s)
            cap = float("inf") if cap is None else cap  # not reached: a budget applies here
            return est(p) + MESSAGE_OVERHEAD_BYTES <= (1.0 - self.margin) * cap, n, cap

        ok, n, cap = fits(b.p_max)
        if ok:
            return Choice(b.p_max, n, int(cap), est(b.p_max), True, "p-max fits")
        ok, n, cap = fits(b.p_min)
        if not ok:
            return Choice(b.p_min, n, max(0, int(cap)), est(b.p_min), False, "even p-min exceeds the budget")
        lo, hi = math.log(b.p_min), math.log(b.p_max)  # fits(lo), not fits(hi)
        for _ in range(self.search_steps):
            mid = (lo + hi) / 2
            if fits(math.exp(mid))[0]:
                lo = mid
            else:
                hi = mid
        p = math.exp(lo)
        ok, n, cap = fits(p)
        return Choice(p, n, int(cap), est(p), ok, "largest p that fits")


def dense_if_faster(choice: Choice, budget: BandwidthBudget, situation: ClientSituation) -> Choice:
    """``choice``, or dense fp32 instead when that uploads the update sooner with codec time
    counted (both codecs' seconds measured, a link known, dense within any byte budget)."""
    s = situation
    sparse_s, dense_s = s.codec_time(s.codec_id), s.codec_time(str(DENSE_CODEC["id"]))
    if choice.codec is not None or s.link is None or sparse_s is None or dense_s is None:
        return choice
    dense_bytes = estimate_dense_bytes(s.tensors)
    if budget.uplink_budget_bytes > 0 and dense_bytes + MESSAGE_OVERHEAD_BYTES > budget.uplink_budget_bytes:
        return choice
    t_sparse = sparse_s + s.link.uplink_seconds(choice.estimated_bytes)
    t_dense = dense_s + s.link.uplink_seconds(dense_bytes)
    times = {"upload-seconds-" + s.codec_id: t_sparse, "upload-seconds-dense-fp32": t_dense}
    if t_dense >= t_sparse:
        return replace(choice, extra={**choice.extra, **times})
    return replace(
        choice,
        codec=dict(DENSE_CODEC),
        estimated_bytes=dense_bytes,
        fits=choice.fits,  # dense uploads sooner than what fitted (or did not) by the deadline
        reason=f"dense fp32 uploads sooner ({t_dense:.3g} s vs {t_sparse:.3g} s, codec time counted)",
        extra={**choice.extra, **times},
    )


_POLICIES: dict[str, Callable[[], BandwidthPolicy]] = {"constant-total-sparsity": ConstantTotalSparsity}


def register_policy(name: str, factory: Callable[[], BandwidthPolicy]) -> None:
    """Make ``bandwidth-policy = name`` build ``factory()`` on the clients."""
    _POLICIES[name] = factory


def get_policy(name: str) -> BandwidthPolicy:
    try:
        return _POLICIES[name]()
    except KeyError:
        raise ConfigError(f"bandwidth-policy: unknown policy {name!r} (known: {sorted(_POLICIES)})") from None


def policy_names() -> list[str]:
    return sorted(_POLICIES)
