"""The payload bytes of each round, and the figures the wrapper reports through Flower.

:class:`RoundTraffic` holds one round's payload bytes per client and direction (fedcomp's
compressed payloads and extras; not the headers around them, which the reference app's meter,
:class:`fedcomp.app.fl.MeteredGrid`, counts with them),
plus what each client reported. :func:`metric_record` turns it into the ``fedcomp.*`` entries the
wrapper adds to the MetricRecords it returns, so any Flower app sees them in Flower's round log
and in the ``Result`` that ``strategy.start`` returns. The keys are stable:

======================================  ==========================================================
``fedcomp.uplink-bytes``                this round's train replies: compressed payload bytes
``fedcomp.uplink-dense-bytes``          what they would be as dense fp32 models
``fedcomp.uplink-ratio``                dense / compressed (0 when nothing was sent)
``fedcomp.downlink-bytes``              this round's downlinks so far (train, and evaluate in the
                                        evaluate record), extras such as a DEFT allocation included
``fedcomp.downlink-dense-bytes``        what they would be as dense fp32 models
``fedcomp.downlink-ratio``              dense / compressed (0 when nothing was sent: every client
                                        held the model already, e.g. from the last evaluate round)
``fedcomp.total-bytes``                 both directions over the whole run so far
``fedcomp.total-dense-bytes``           the same as dense fp32
``fedcomp.total-ratio``                 dense / compressed over the whole run so far
``fedcomp.replies-accepted``            train replies decoded and handed to the inner strategy
``fedcomp.replies-rejected``            train replies rejected (corrupt, stale, hostile)
``fedcomp.replies-missing``             train messages that got no reply (timed out, lost)
``fedcomp.replies-failed``              train replies that were errors (the ClientApp failed, the
                                        client refused its own update as not finite, a resync)
``fedcomp.server-codec-seconds``        server time compressing the downlink and decoding replies
``fedcomp.client-encode-seconds``       the clients' uplink encode time, summed
``fedcomp.downlink-passes``             downlink deltas made this round (``downlink-passes``)
``fedcomp.update-norm-bound``           the bound on each update's norm the round's train messages
                                        carried (``max-update-norm`` or its factor; absent: none)
``fedcomp.replica-lag``                 ||W - R|| / ||W - W_prev|| after the downlink (when it moved)
``fedcomp.downlink-delivered``          share of the outstanding W - R this round's downlink closed
``fedcomp.residual-ratio-mean``         mean over clients of ||residual|| / ||update|| after encoding
``fedcomp.residual-ratio-median``       their median: a client whose update is about 0 (late in a
                                        run) makes the mean huge (221,420 seen in a 300-round run),
                                        not the median
======================================  ==========================================================
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedcomp.flower.protocol import UplinkReport
from fedcomp.methods.base import SentTerm, sent_positions
from fedcomp.methods.statistics import sent_dense

__all__ = ["RoundTraffic", "metric_record", "totals"]


@dataclass
class RoundTraffic:
    """Payload bytes per client (node id) and direction for one round (headers not counted)."""

    uplink: dict[int, int] = field(default_factory=dict)
    downlink: dict[int, int] = field(default_factory=dict)
    dense_uplink: dict[int, int] = field(default_factory=dict)
    dense_downlink: dict[int, int] = field(default_factory=dict)
    downlink_mode: dict[int, str] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    #: Evaluate replies left out of the inner strategy's aggregation, and why.
    rejected_evaluate: dict[int, str] = field(default_factory=dict)
    accepted: int = 0  # train replies decoded and handed to the inner strategy
    #: Why the round's aggregate did not become the model (not finite, off the lattice grid; its
    #: accepted updates were then not aggregated after all), or empty.
    aggregate_refused: str = ""
    #: Nodes sent a train message that have not replied (once aggregated: those that never did).
    unanswered: set[int] = field(default_factory=set)
    #: Train replies that were errors, and the error's reason.
    failed: dict[int, str] = field(default_factory=dict)
    #: Diagnostics. ``replica_lag``: ||W - R|| / ||W - W_prev|| after this round's downlink (how
    #: far the model clients train from trails the server's model, in rounds of movement);
    #: ``downlink_delivered``: 1 - ||W - R_after|| / ||W - R_before||, the share of the outstanding
    #: difference the downlink closed (negative when the replica moved away from W: the lattice
    #: downlink's first advance, from the exact initial model onto its grid, whose step is several
    #: rounds of movement); ``residual_ratio``: each client's ||residual|| / ||update|| after
    #: encoding (what error feedback holds back, relative to what it trained).
    replica_lag: float | None = None
    downlink_passes: int = 0  # delta versions made this round (``downlink-passes``)
    downlink_delivered: float | None = None
    residual_ratio: dict[int, float] = field(default_factory=dict)
    encode_seconds: float = 0.0  # server-side downlink compression time
    client_encode_seconds: dict[int, float] = field(default_factory=dict)  # each client's uplink encode
    # "topk"/"deft" uplinks: entries of the compressed tensors that any client sent (the union of
    # the selections) and how many entries those tensors have: the aggregate density.
    _union: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    #: (union entries, entries) of the selections already counted and released (:meth:`close_selection`).
    _union_counted: tuple[int, int] = (0, 0)

    def note_selection(
        self, delta: Mapping[str, SentTerm], min_numel: int, numels: Mapping[str, int] | None = None
    ) -> None:
        """Add a reply's selection to the union: the non-zero entries of each tensor of at least
        ``min_numel`` entries, given dense or as (ascending positions, their values) without a
        dense tensor (the streaming sum's terms; ``numels`` then gives the tensors' sizes)."""
        for name, t in delta.items():
            numel = numels[name] if numels is not None else t.numel() if isinstance(t, torch.Tensor) else -1
            if numel < 0:
                raise ValueError(f"note_selection: the size of {name!r} is needed (numels)")
            if sent_dense(name, numel, min_numel):
                continue
            mask = self._union.get(name)
            if mask is None:
                mask = self._union[name] = torch.zeros(numel, dtype=torch.bool)
            mask[sent_positions(t)] = True

    def close_selection(self) -> None:
        """Count the union and release its masks, once the round's replies are all in: one bool
        per entry of the compressed tensors, kept with every round's figures, grew the server's
        memory by about an eighth of the model every round (a 300-round top-k run: 0.43 MB a
        round for LeNet5-Caffe; a ResNet-50 would keep ~25 MB a round)."""
        self._union_counted = (self.union_nnz, self.sparse_numel)
        self._union.clear()

    @property
    def union_nnz(self) -> int:
        return self._union_counted[0] + int(sum(int(m.sum()) for m in self._union.values()))

    @property
    def sparse_numel(self) -> int:
        return self._union_counted[1] + int(sum(m.numel() for m in self._union.values()))

    decode_seconds: float = 0.0  # server-side uplink decompression time
    # What each client reported doing (fedcomp.methods.bandwidth): the SBC p and local iterations it used,
    # its byte budget (absent: none), the policy's estimate, whether it fit, its training time
    # and its link (uplink Mbit/s, downlink Mbit/s, latency ms).
    sbc_p: dict[int, float] = field(default_factory=dict)
    local_iters: dict[int, int] = field(default_factory=dict)
    budget_bytes: dict[int, int] = field(default_factory=dict)
    estimated_bytes: dict[int, int] = field(default_factory=dict)
    fits: dict[int, bool] = field(default_factory=dict)
    codec: dict[int, str] = field(default_factory=dict)  # the uplink codec each client used
    train_seconds: dict[int, float] = field(default_factory=dict)
    links: dict[int, list[float]] = field(default_factory=dict)
    #: The L2 norm of each accepted update in model space, as the server decoded it (what
    #: ``max-update-norm`` bounds: honest clients' figures say where to set it).
    update_norm: dict[int, float] = field(default_factory=dict)
    #: The bound on each update's norm this round's train messages carried (0: none).
    update_norm_bound: float = 0.0

    def note_client(self, node: int, report: UplinkReport) -> None:
        """Copy what the client mod reported in its uplink record (values it did not send: skipped)."""
        for value, store in (
            (report.sbc_p, self.sbc_p),
            (report.local_iters, self.local_iters),
            (report.budget_bytes, self.budget_bytes),
            (report.estimated_bytes, self.estimated_bytes),
            (report.fits, self.fits),
            (report.codec, self.codec),
            (report.train_seconds, self.train_seconds),
            (report.encode_seconds, self.client_encode_seconds),
        ):
            if value is not None:
                store[node] = value  # type: ignore[index,assignment]
        if report.residual_norm is not None and report.update_norm:
            self.residual_ratio[node] = report.residual_norm / report.update_norm
        if report.link is not None:
            self.links[node] = list(report.link)

    def add_downlink(self, node: int, nbytes: int, dense: int, mode: str) -> None:
        self.downlink[node] = self.downlink.get(node, 0) + nbytes
        self.dense_downlink[node] = self.dense_downlink.get(node, 0) + dense
        self.downlink_mode[node] = mode


def totals(traffic: Mapping[int, RoundTraffic]) -> tuple[int, int]:
    """Payload bytes and their dense-fp32 equivalent over every round so far, both ways."""
    sent = dense = 0
    for t in traffic.values():
        sent += sum(t.uplink.values()) + sum(t.downlink.values())
        dense += sum(t.dense_uplink.values()) + sum(t.dense_downlink.values())
    return sent, dense


def _ratio(dense: int, sent: int) -> float:
    return float(dense) / sent if sent > 0 else 0.0


def by_reason(reasons: Mapping[Any, str], most: int | None = None) -> str:
    """``"2 client(s): <reason>; 1 client(s): <other>"``: clients grouped by their reason, in the
    order the reasons first come; at most ``most`` reasons, then how many more there were."""
    groups = Counter(reasons.values())  # (in the order the reasons first come)
    shown = list(groups.items())[:most]
    out = "; ".join(f"{n} client(s): {text}" for text, n in shown)
    return out + (f"; and {len(groups) - len(shown)} other reason(s)" if len(groups) > len(shown) else "")


def metric_record(t: RoundTraffic, run: Mapping[int, RoundTraffic]) -> dict[str, int | float]:
    """This round's figures as ``fedcomp.*`` metrics (see the module docstring)."""
    up, up_dense = sum(t.uplink.values()), sum(t.dense_uplink.values())
    down, down_dense = sum(t.downlink.values()), sum(t.dense_downlink.values())
    total, total_dense = totals(run)
    return {
        "fedcomp.uplink-bytes": up,
        "fedcomp.uplink-dense-bytes": up_dense,
        "fedcomp.uplink-ratio": _ratio(up_dense, up),
        "fedcomp.downlink-bytes": down,
        "fedcomp.downlink-dense-bytes": down_dense,
        "fedcomp.downlink-ratio": _ratio(down_dense, down),
        "fedcomp.total-bytes": total,
        "fedcomp.total-dense-bytes": total_dense,
        "fedcomp.total-ratio": _ratio(total_dense, total),
        "fedcomp.replies-accepted": t.accepted,
        "fedcomp.replies-rejected": len(t.rejected),
        "fedcomp.replies-missing": len(t.unanswered),
        "fedcomp.replies-failed": len(t.failed),
        "fedcomp.server-codec-seconds": float(t.encode_seconds + t.decode_seconds),
        "fedcomp.client-encode-seconds": float(sum(t.client_encode_seconds.values())),
        "fedcomp.downlink-passes": t.downlink_passes,
        **({"fedcomp.update-norm-bound": t.update_norm_bound} if t.update_norm_bound > 0 else {}),
        **({"fedcomp.replica-lag": t.replica_lag} if t.replica_lag is not None else {}),
        **({"fedcomp.downlink-delivered": t.downlink_delivered} if t.downlink_delivered is not None else {}),
        **(
            {
                "fedcomp.residual-ratio-mean": sum(t.residual_ratio.values()) / len(t.residual_ratio),
                "fedcomp.residual-ratio-median": statistics.median(t.residual_ratio.values()),
            }
            if t.residual_ratio
            else {}
        ),
    }
