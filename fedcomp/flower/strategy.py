"""Server side: a strategy wrapper that gives any Flower strategy compressed traffic both ways.

Downlink (3LC by default): every train/evaluate message the inner strategy builds has its model
replaced by what that client needs to rebuild the replica (see ``replica.py``). Uplink (SBC by
default): each client's reply carries a compressed delta against the replica it trained on; the
wrapper decodes it, rebuilds ``global model + delta`` as an ordinary ArrayRecord and hands the replies
to the inner strategy, which aggregates as usual. A reply whose payload is corrupt or hostile is
dropped with a logged reason and the round goes on with the others.

Streaming aggregation: when the inner strategy's aggregation is the weighted mean of the replies
followed by its own server step (FedAvg, FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad:
:func:`streams_weighted_mean`), the wrapper does not build one full model per reply. It decodes
each reply straight into a running float64 weighted sum (an SBC reply is a scatter-add of its kept
positions; nothing of the model's size is allocated for it) and drops the reply's payload; the
inner strategy then gets one reply carrying that mean and the total weight, so its own step
(momentum, adaptive moments) still runs, and its ``train_metrics_aggr_fn`` aggregates every
reply's MetricRecord as before. Server memory is O(model + one payload) instead of
O(clients x model). Strategies that need every reply (FedMedian, Krum, FedTrimmedAvg, Bulyan,
differential-privacy wrappers, any subclass with its own ``aggregate_train``) keep the
materialising path. :attr:`CompressionStrategy.streaming` says which one a wrapper uses.

No update is lost silently (protocol 2, :class:`~fedcomp.flower.protocol.UpdateOutcome`): the
wrapper remembers, per node, the round and fate of the last update it received (aggregated, or
rejected and why) and how far its rounds are settled, and every downlink tells the client. A
client whose update was not aggregated adds it back to its residual. These records are part of
the server's state: a checkpoint must save them with the model (:meth:`outcome_state`).

Pair it with :func:`fedcomp.flower.mod.compression_mod` on the clients.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedYogi,
    Strategy,
)

from fedcomp.codecs import Codec, DenseFP32, get_codec
from fedcomp.errors import ConfigError, NoProgressError, PayloadError, shown
from fedcomp.flower import protocol
from fedcomp.flower.downlink_policy import advance_by_policy, advance_passes, candidates_of, distance
from fedcomp.flower.grid_fit import REPLY_SLACK, GridFit
from fedcomp.flower.protocol import (
    UNSETTLED_UPDATES,
    DownlinkHeader,
    UpdateOutcome,
    UpdateStatus,
    UplinkReport,
    pack_unsettled,
)
from fedcomp.flower.records import (
    check_integer_arrays,
    fp32_bytes,
    not_finite_and_norm,
    record_from_tensors,
    tensors_from_record,
)
from fedcomp.flower.replica import ServerReplica, grid_exponents
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.traffic import RoundTraffic, by_reason, metric_record
from fedcomp.flower.weighted_sum import Contribution, WeightedSum, sparse_delta
from fedcomp.methods.base import SentTerm, UplinkMethod
from fedcomp.methods.registry import get_downlink, get_uplink
from fedcomp.wire.payloads import EncodedUpdate
from fedcomp.wire.serde import update_from_bytes

__all__ = [
    "CompressionConfig",
    "CompressionStrategy",
    "RoundTraffic",
    "aggregates_by_weighted_mean",
    "streams_weighted_mean",
]

# A child of Flower's logger: our lines go wherever Flower sends its own (the run log, the console).
log = logging.getLogger("flwr").getChild("fedcomp")

_T = TypeVar("_T")

#: Inner strategies whose ``aggregate_train`` is FedAvg's weighted mean of the replies' arrays,
#: then (for all but FedAvg) a server step on that mean that reads nothing else of the replies.
_MEAN_FIRST = (FedAvg, FedAvgM, FedAdam, FedYogi, FedAdagrad)


class CompressionStrategy(Strategy):
    """Wrap ``strategy`` (FedAvg, FedProx, FedAdam, ...) so its traffic is compressed.

    ``traffic[server_round]`` holds the measured bytes of each round. With ``compress = false``
    in the config the wrapper hands every call to ``strategy`` as it is (the dense baseline from
    the same app; ``compression_mod`` passes plain messages through) and measures nothing.
    """

    def __init__(self, strategy: Strategy, config: CompressionConfig | None = None) -> None:
        self.strategy = strategy
        self.config = config or CompressionConfig()
        self.replica: ServerReplica | None = None
        self.traffic: dict[int, RoundTraffic] = {}
        self._arrays_key: str = getattr(strategy, "arrayrecord_key", "arrays")
        self._config_key: str = getattr(strategy, "configrecord_key", protocol.CONFIG_RECORD)
        self._target: dict[str, torch.Tensor] | None = None  # the W the replica was last synced to
        self._nodes: dict[int, tuple[int, str]] = {}  # node -> (replica version, digest) it reported
        #: node -> the replica version its last message brought it to (what its reply must report;
        #: not state: set again by the next message).
        self._sent_version: dict[int, int] = {}
        self._full_before: set[int] = set()  # nodes whose last message carried the full replica
        self._warned_full: set[int] = set()  # (the warning of _with_downlink, once a node)
        # seeded-initial-model: nodes assumed to hold version 0 (never heard from), and nodes
        # that failed that assumption once (they get full replicas like any unknown client).
        self._assumed_seeded: set[int] = set()
        self._not_seeded: set[int] = set()
        self._bandwidth = self.config.bandwidth_budget().to_json()
        # Update outcomes (protocol 2): node -> (round, status, reason) of the last update that
        # reached the server, and the last train round whose outcomes are final.
        self._last_update: dict[int, tuple[int, UpdateStatus, str]] = {}
        self._settled = 0
        #: node -> the last train round it was sent, until it answers a message that told it that
        #: round's outcome (a node that restarts under a new id learns it from
        #: :meth:`_unsettled_table`), and the settled round its evaluate message told (not state).
        self._unsettled: dict[int, int] = {}
        self._told: dict[int, int] = {}
        self._records_from: int | None = None  # the first round these records cover
        #: This run's identity across restarts (kept in a checkpoint, sent in every config as
        #: ``fedcomp.lineage``): clients key the state they persist by it, so a resumed run finds
        #: its clients' state and a new run with the same name never picks up an old one's.
        self.lineage: str = secrets.token_hex(8)
        self.downlink_method = get_downlink(self.config.downlink_codec)
        #: The uplink method's server side (fedcomp.methods.registry). ``weighted_mean``: the inner
        #: strategy aggregates by FedAvg's weighted mean, which commutes with linear methods.
        self.uplink: UplinkMethod = get_uplink(self.config.uplink_codec)(
            self.config, weighted_mean=aggregates_by_weighted_mean(strategy)
        )
        #: Whether train replies are summed as they are decoded (memory O(model + one payload))
        #: rather than each materialised as a full model for the inner strategy; on by default
        #: exactly when the inner strategy's aggregation starts with the weighted mean of the
        #: replies (:func:`streams_weighted_mean`). Set False to force the materialising path.
        self.streaming: bool = streams_weighted_mean(strategy)
        self._hinted_mod = False  # (the hint of :meth:`_hint_if_no_mod`, once a run)
        #: Whether ``max-empty-rounds`` train rounds in a row without an aggregated update raise
        #: :class:`~fedcomp.errors.NoProgressError` (the run fails instead of completing with the
        #: model it started from). False where the app ends such runs itself: the reference app
        #: records the round first.
        self.ends_empty_runs: bool = True
        self._empty_rounds: list[int] = []  # the current streak of train rounds that aggregated nothing
        self._hinted_local_iters = False  # (the warning of configure_train, once a run)
        #: The round's check of replies against the lattice downlink's grid (set in
        #: aggregate_train once the grid exists; not state: rebuilt every round).
        self._fit: GridFit | None = None
        #: ``max-update-norm-factor``: the median norm of the last aggregated round's accepted
        #: updates (state), and the bound on each update's norm this train round's downlinks carry
        #: (0: none), with what it came from (for its rejections' reasons).
        self._norm_ref: tuple[int, float] | None = None
        self._bound: float = self.config.max_update_norm
        self._bound_why = "max-update-norm"
        #: The train round's local iterations as the train config says (a client that trained more
        #: has a bound that many times larger: :func:`~fedcomp.flower.protocol.work_scale`).
        self._round_iters: object = None

    # --- downlink ------------------------------------------------------------------------------

    def _sync_replica(self, arrays: ArrayRecord, server_round: int) -> None:
        """Bring the replica to the global model ``arrays`` (one compression per model change)."""
        check_integer_arrays(arrays, self.config.min_compress_numel)
        target = tensors_from_record(arrays)
        if self.replica is None:
            self.replica = ServerReplica(
                target, self.config.delta_log_size, self.config.min_compress_numel, self.config.delta_log_models
            )
        elif self._target is None or any(not torch.equal(target[k], self._target[k]) for k in target):
            t = self._traffic(server_round)
            before = after = distance(target, self.replica.tensors)
            moved = distance(target, self._target) if self._target is not None else 0.0
            t0 = time.perf_counter()
            candidates = candidates_of(self.config)
            if candidates is not None:
                # "auto": the smallest candidate that keeps the lag under replica-lag-max, tried on
                # a scratch copy; this round's downlinks name the chosen method's codec.
                chosen = advance_by_policy(self.replica, target, moved, self.config, server_round, candidates)
                self.downlink_method = chosen.method
                t.downlink_passes += chosen.passes
                after = chosen.after
            else:
                # One delta version per pass: every up-to-date client gets the passes as a chain.
                passes, _, after = advance_passes(
                    self.replica,
                    target,
                    self.downlink_method,
                    self.config.downlink_passes,
                    moved,
                    self.config.replica_lag_max,
                    self.config,
                    server_round,
                )
                t.downlink_passes += passes
            t.encode_seconds += time.perf_counter() - t0
            # Diagnostics: how far the clients' replica R trails the model W, relative to how far
            # W moved this round, and how much of the outstanding W - R this downlink closed.
            t.replica_lag = after / moved if moved > 0 else 0.0
            t.downlink_delivered = 1.0 - after / before if before > 0 else 1.0
        self._target = target

    def _traffic(self, server_round: int) -> RoundTraffic:
        return self.traffic.setdefault(server_round, RoundTraffic())

    def _with_downlink(
        self, messages: Iterable[Message], server_round: int, train: bool = False, listed: Iterable[int] = ()
    ) -> list[Message]:
        """``messages`` with their downlink records. A train round's uplink extras go to its nodes
        in the order of ``listed`` (the grid's node ids; others after them, by id)."""
        assert self.replica is not None
        messages = list(messages)
        dense = fp32_bytes(self.replica.tensors)
        uplink_codec = self.uplink.round_codec_config(server_round)
        downlink_codec = self.downlink_method.codec_config(self.config, server_round)
        extras: dict[int, dict[str, bytes]] = {}
        table: bytes | None = None  # (built for the first node the server has no record of)
        if train:
            rank = {n: i for i, n in enumerate(listed)}
            nodes = sorted((m.metadata.dst_node_id for m in messages), key=lambda n: (rank.get(n, len(rank)), n))
            extras = self.uplink.downlink_extras(server_round, nodes, self.replica.specs)
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            extra = extras.get(node, {})
            if node not in self._nodes and node not in self._last_update and node not in self._unsettled:
                table = self._unsettled_table() if table is None else table
                extra = {**extra, UNSETTLED_UPDATES: table} if table else extra
            if train:  # (a row of its last recorded update stays right for what it holds before)
                self._unsettled[node] = server_round
            else:  # settled once it answers (a message that never arrives settles nothing)
                self._told[node] = self._settled
            last_round, status, reason = self._last_update.get(node, (0, UpdateStatus.NONE, ""))
            outcome = UpdateOutcome(server_round, self._settled, last_round, status, reason, self._records_from or 1)
            version, digest = self._known_state(node)
            dl = self.replica.downlink_for(version, digest)
            self._sent_version[node] = dl.version
            self._note_full(node, dl.mode == "full" and version is None, server_round)  # (not: older than the log)
            header = DownlinkHeader(
                mode=protocol.DownlinkMode(dl.mode),
                payloads=dl.payloads,
                version=dl.version,
                digest=dl.digest,
                arrays_key=self._arrays_key,
                config_key=self._config_key,
                downlink_codec=downlink_codec,
                uplink_codec=uplink_codec,
                uplink_method=self.uplink.method_id,
                error_feedback=self.config.error_feedback,
                min_compress_numel=self.config.min_compress_numel,
                device=self.config.client_device,
                bandwidth=self._bandwidth,
                extras=extra,
                outcome=outcome,
                max_update_norm=self._bound,
            )
            # A fresh RecordDict per message: the inner strategy shares one between all messages.
            content = RecordDict({k: v for k, v in msg.content.items() if k != self._arrays_key})
            content[protocol.DOWNLINK] = header.to_record()
            msg.content = content
            self._traffic(server_round).add_downlink(node, header.nbytes, dense, dl.mode)
            out.append(msg)
            if train:
                self._traffic(server_round).unanswered.add(node)
        return out

    def _note_full(self, node: int, full: bool, server_round: int) -> None:
        """Say once a node when it needs the full replica in two messages running because the server
        knows nothing of it: what it reports never matched what it was sent (a client that loses its
        state, or misreports it: a hostile one gets the dense model every round this way, what dense
        FedAvg would send it). ``full`` is False for a known node older than the log (sampled
        rarely: not a fault)."""
        if full and node in self._full_before and node not in self._warned_full:
            self._warned_full.add(node)
            log.warning(
                "fedcomp: node %s gets the full model again in round %s: its replica never matches what it was "
                "sent (a client that loses its state, or misreports it); said once a node",
                node,
                server_round,
            )
        if full:
            self._full_before.add(node)
        else:
            self._full_before.discard(node)

    def _unsettled_table(self) -> bytes:
        """The :data:`~fedcomp.flower.protocol.UNSETTLED_UPDATES` table for a node the server has no
        record of: it may be one that restarted under a new id, holding an update it sent under
        its old one whose fate it never heard. One row per node whose last train round is settled,
        was not told, and was not aggregated (a client finding no row for its old id counts its
        update as aggregated, which then is right), the most recent rounds first."""
        rows = []
        for node, sent in self._unsettled.items():
            last_round, status, _ = self._last_update.get(node, (0, UpdateStatus.NONE, ""))
            if sent <= self._settled and not (last_round == sent and status is UpdateStatus.AGGREGATED):
                rows.append((sent, node, last_round, status))
        rows.sort(key=lambda r: (-r[0], r[1]))
        return pack_unsettled((node, last_round, status) for _, node, last_round, status in rows)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.config.compress:  # plain traffic (the client mod passes it through)
            return self.strategy.configure_train(server_round, arrays, config, grid)
        self._sync_replica(arrays, server_round)
        self._start_round(server_round)
        self._set_bound(server_round)
        config = ConfigRecord(dict(config))
        scheduled = self.config.local_iters_at(server_round)
        own = config.get(protocol.LOCAL_ITERS)
        if own is None:
            config[protocol.LOCAL_ITERS] = scheduled
        elif own != scheduled and not self._hinted_local_iters:
            # The app's own train config says how many local iterations: it is kept, never
            # overwritten by the schedule (a user's key of the same name did nothing before).
            self._hinted_local_iters = True
            log.warning(
                "fedcomp: the train config's own %r = %r is sent as it is; the run config's schedule (%r in "
                "round %s) is not applied",
                protocol.LOCAL_ITERS,
                own,
                scheduled,
                server_round,
            )
        config[protocol.LINEAGE] = self.lineage
        self._round_iters = config.get(protocol.LOCAL_ITERS)
        msgs = self.strategy.configure_train(server_round, arrays, config, grid)
        return self._with_downlink(msgs, server_round, train=True, listed=grid.get_node_ids())

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if not self.config.compress:
            return self.strategy.configure_evaluate(server_round, arrays, config, grid)
        config = ConfigRecord(dict(config))
        config[protocol.LINEAGE] = self.lineage
        msgs = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        if not msgs:
            return msgs
        self._sync_replica(arrays, server_round)
        self._start_round(server_round)
        return self._with_downlink(msgs, server_round)

    def _set_bound(self, server_round: int) -> None:
        """This train round's bound on each update's L2 norm: ``max-update-norm``, or
        ``max-update-norm-factor`` times the reference norm :meth:`_note_norms` keeps (before any
        update was aggregated, the model's float tensors' norm, which
        :meth:`_tighten_first_bound` then tightens), whichever is smaller. The downlinks carry it;
        honest clients send at most that, so only a client that ignores it is rejected."""
        self._bound, self._bound_why = self.config.max_update_norm, "max-update-norm"
        factor = self.config.max_update_norm_factor
        if factor > 0 and self._target is not None:
            if self._norm_ref is not None:
                ref_round, ref = self._norm_ref
                of = f"round {ref_round}'s reference norm {ref:.4g} (its updates' median, falling at most x{factor:g} a round)"
            else:
                ref = not_finite_and_norm({k: t for k, t in self._target.items() if t.is_floating_point()})[1]
                of = f"the model's norm {ref:.4g}, no update aggregated yet"
            # (a model of zeros and no update yet: no adaptive bound)
            if math.isfinite(factor * ref) and ref > 0 and (self._bound <= 0 or factor * ref < self._bound):
                self._bound, self._bound_why = factor * ref, f"max-update-norm-factor {factor:g} x {of}"
        self._traffic(server_round).update_norm_bound = self._bound

    def _note_norms(self, server_round: int, aggregated: Iterable[Message] | None) -> None:
        """Keep the median norm of the round's aggregated updates (the lower one of an even count:
        one of two clients may be the hostile one) for :meth:`_set_bound`. It falls by at most the
        factor a round, as it can rise by at most that (clients clip to the bound): one round in
        which a hostile client was half of the accepted replies, sending updates of about 0, froze
        the model for 30-70 rounds before (a red-team audit). A round that aggregated nothing
        (``aggregated`` None) loosens it by the factor: a bound no client could meet (GradiVeQ's
        decoded ``mu + U c`` cannot be scaled below ``mu``) would otherwise end the run."""
        factor = self.config.max_update_norm_factor
        if factor <= 0:
            return
        if aggregated is None:
            if self._norm_ref is not None:
                self._norm_ref = (self._norm_ref[0], self._norm_ref[1] * factor)
            return
        t = self._traffic(server_round)
        nodes = {m.metadata.src_node_id for m in aggregated if not m.has_error()}
        # (per the train config's local iterations: see protocol.work_scale)
        found = sorted(t.update_norm[n] / self._work(t.local_iters.get(n)) for n in nodes if n in t.update_norm)
        median = _lower_median(found) if found else 0.0
        if median > 0:
            floor = self._norm_ref[1] / factor if self._norm_ref is not None else 0.0
            self._norm_ref = (server_round, max(median, floor))

    def _tighten_first_bound(self, server_round: int, ordered: Sequence[Message]) -> None:
        """Before any update was aggregated, the bound sent (the factor times the model's norm) is
        loose: 85 times an honest update in one audit, so one client could replace the model. Until
        then the round's own updates set it: the factor times their (lower) median norm, read from
        each reply before any is aggregated (each round until one aggregates; a reply that cannot
        be read is left to the real pass, which rejects it). Clients clipped to the looser bound;
        an honest one over the tighter is rejected this once, its update goes back to its residual,
        and it clips from the next round on. Not in a round whose replies are not the update itself
        (GradiVeQ's coefficients; its first rounds, dense, are read): the model's bound holds.
        (Each reply is parsed and decoded twice in such a round.)"""
        factor = self.config.max_update_norm_factor
        if factor <= 0 or self._norm_ref is not None or self.replica is None:
            return
        norms = sorted(n for n in (self._peek_norm(m, server_round) for m in ordered) if n is not None and n > 0)
        if not norms:
            return
        bound = factor * _lower_median(norms)
        if self._bound <= 0 or bound < self._bound:
            self._bound = bound
            self._bound_why = (
                f"max-update-norm-factor {factor:g} x the median of this round's updates, {bound / factor:.4g}"
            )
            self._traffic(server_round).update_norm_bound = bound

    def _peek_norm(self, msg: Message, server_round: int) -> float | None:
        """The L2 norm of the update ``msg`` carries, as the streaming path decodes it, with no
        side effect; None for an error reply, a reply that does not parse or is stale (the real
        pass says why), or a round whose replies are not the update itself."""
        assert self.replica is not None
        if msg.has_error() or not msg.has_content() or not self.uplink.reply_is_update(server_round):
            return None
        try:
            rec = msg.content.config_records.get(protocol.UPLINK)
            report = UplinkReport.from_record(rec) if rec is not None else None
            if report is None or report.payload is None:
                return None
            update = update_from_bytes(report.payload, expected=self.replica.specs)
            if update.base_model_version != self.replica.version:
                return None
            norm = sparse_delta(update, self.replica.specs, self._round_codecs(server_round)).norm
        except Exception:  # (whatever it is, the real pass rejects it with its reason)
            return None
        return norm / self._work(report.local_iters) if math.isfinite(norm) else None

    def _start_round(self, server_round: int) -> None:
        """Every earlier train round is over: a reply of one that is not on record never arrived.
        A wrapper without records (a fresh one, not restored) covers rounds from this one on."""
        self._settled = max(self._settled, server_round - 1)
        start = min(server_round, self._settled + 1)
        self._records_from = start if self._records_from is None else min(self._records_from, start)

    # --- uplink --------------------------------------------------------------------------------

    def _report_of(self, msg: Message) -> UplinkReport | None:
        """The reply's uplink record, typed; None when it erred, has none, or it is malformed."""
        if msg.has_error() or not msg.has_content():
            return None
        rec = msg.content.config_records.get(protocol.UPLINK)
        if rec is None:
            return None
        try:
            return UplinkReport.from_record(rec)
        except PayloadError:
            return None

    def _known_state(self, node: int) -> tuple[int | None, str | None]:
        """The replica version and digest ``node`` holds, as far as the server knows."""
        assert self.replica is not None
        if node in self._nodes:
            return self._nodes[node]
        if self.config.seeded_initial_model and node not in self._not_seeded:
            self._assumed_seeded.add(node)
            return 0, self.replica.digest_of(0)
        return None, None

    def _note_node(self, node: int, report: UplinkReport | None) -> None:
        """Remember the replica version a client reports; forget it when it erred or lied. A client
        holds the version its last message brought it to, and reports that one: an older version
        (of the log, with its true digest) is a lie that made the server merge the whole delta
        log for it every round (a red-team audit: 17 s of CPU a round for a 10M-parameter model);
        it is forgotten, and gets the full replica, which costs no merge."""
        self.uplink.note_node(node, report.status if report is not None else None)
        assert self.replica is not None
        sent = self._sent_version.get(node)
        if (
            report is not None
            and (sent is None or report.replica_version == sent)
            and self.replica.digest_of(report.replica_version) == report.replica_digest
        ):
            self._nodes[node] = (report.replica_version, report.replica_digest)
        else:
            self._nodes.pop(node, None)
            if node in self._assumed_seeded:
                self._not_seeded.add(node)  # it could not build version 0: full replicas from now
        self._assumed_seeded.discard(node)

    def _open_reply(self, msg: Message, server_round: int) -> tuple[EncodedUpdate, int, float]:
        """The reply's update, parsed and checked against this round and the replica version (its
        traffic noted), with its node and the clock at which decoding started."""
        assert self.replica is not None
        rec = msg.content.config_records.get(protocol.UPLINK)
        if rec is None:
            raise PayloadError("", f"reply has no {protocol.UPLINK} record")
        report = UplinkReport.from_record(rec)
        if report.payload is None:
            raise PayloadError("", f"reply has no {protocol.UPLINK} payload")
        if report.update_round is not None and report.update_round != server_round:
            raise PayloadError(
                "", f"uplink: field 'update-round' is {report.update_round}, this is round {server_round}"
            )
        traffic = self._traffic(server_round)
        node = msg.metadata.src_node_id
        traffic.note_client(node, report)
        traffic.uplink[node] = len(report.payload) + sum(len(v) for v in report.extras.values())
        traffic.dense_uplink[node] = fp32_bytes(self.replica.tensors)
        self.uplink.note_extras(server_round, node, report.extras)
        t0 = time.perf_counter()
        update = update_from_bytes(report.payload, expected=self.replica.specs)  # bounded by the model
        if update.base_model_version != self.replica.version:
            raise PayloadError(
                "", f"update is against version {update.base_model_version}, expected {self.replica.version}"
            )
        return update, node, t0

    def _decode_reply(self, msg: Message, server_round: int) -> None:
        """Replace the compressed payload in ``msg`` by what the inner strategy aggregates
        (``W + delta`` for most methods); raise :class:`PayloadError` on a bad reply."""
        assert self.replica is not None and self._target is not None
        update, node, t0 = self._open_reply(msg, server_round)
        traffic = self._traffic(server_round)
        decoded = self.uplink.decode(update, self.replica.specs, self._target, server_round, node)
        work = self._work(traffic.local_iters.get(node))
        norm = self._check_values(decoded.delta if decoded.delta is not None else decoded.arrays, work)
        if self._fit is not None and decoded.delta is not None:
            self._fit.check_dense(decoded.delta)
        traffic.decode_seconds += time.perf_counter() - t0
        content = RecordDict({k: v for k, v in msg.content.items() if k != protocol.UPLINK})
        self._check_structure(content)
        # Accepted: what it selected and its norm count from here on (a rejected reply's did not).
        if self.uplink.reports_selection and decoded.delta is not None:
            traffic.note_selection(decoded.delta, self.config.min_compress_numel)
        self.uplink.accept(server_round, node)
        if decoded.delta is not None:  # (else GradiVeQ's coefficients: not the model's space)
            traffic.update_norm[node] = norm
        content[self._arrays_key] = record_from_tensors(decoded.arrays)
        msg.content = content

    def _work(self, local_iters: object) -> float:
        """The factor a reply's bound grows by for the local iterations it reports."""
        return protocol.work_scale(local_iters, self._round_iters, self.config.local_iters_max)

    def _round_codecs(self, server_round: int) -> dict[str, Codec]:
        """The codecs a reply of ``server_round`` may use, by id: the round's and dense fp32."""
        return {c.codec_id: c for c in (get_codec(self.uplink.round_codec_config(server_round)), DenseFP32())}

    def _stream_reply(self, msg: Message, server_round: int) -> Contribution:
        """The streaming path's :meth:`_decode_reply`: the same checks, but the reply is turned
        into what :class:`~fedcomp.flower.weighted_sum.WeightedSum` adds (its delta, sparse where the codec is SBC, or the
        arrays its method decodes to) and its payload is dropped from ``msg``."""
        assert self.replica is not None and self._target is not None
        update, node, t0 = self._open_reply(msg, server_round)
        traffic = self._traffic(server_round)
        if self.uplink.decodes_as_base():
            accepted = self._round_codecs(server_round)
            # (a method reporting its selection, top-k or DEFT, needs every tensor as a term: no kernel)
            selection = self.uplink.reports_selection
            delta = sparse_delta(update, self.replica.specs, accepted, kernel=not selection)
            if self.uplink.checks_sent:
                self.uplink.check_sent(node, delta.terms, self.replica.specs)
            self._check_norm(
                delta.norm, _client_clipping_norm(self.strategy), self._work(traffic.local_iters.get(node))
            )
            if self._fit is not None:
                self._fit.check(delta.parts())
            norm: float | None = delta.norm
            selected: Mapping[str, SentTerm] | None = delta.terms if selection else None
            contribution = Contribution(delta=delta)
        else:  # the method's own decode (DEFT's checks, GradiVeQ's coefficients): one dense reply
            decoded = self.uplink.decode(update, self.replica.specs, self._target, server_round, node)
            work = self._work(traffic.local_iters.get(node))
            checked = self._check_values(decoded.delta if decoded.delta is not None else decoded.arrays, work)
            if self._fit is not None and decoded.delta is not None:
                self._fit.check_dense(decoded.delta)
            norm = checked if decoded.delta is not None else None
            selected = decoded.delta if self.uplink.reports_selection else None
            contribution = Contribution(arrays=decoded.arrays)
        traffic.decode_seconds += time.perf_counter() - t0
        content = RecordDict({k: v for k, v in msg.content.items() if k != protocol.UPLINK})
        self._check_structure(content)
        # Accepted (after every check, as _decode_reply): its selection and norm count.
        if selected is not None:
            numels = {spec.name: spec.numel for spec in self.replica.specs}
            traffic.note_selection(selected, self.config.min_compress_numel, numels)
        if norm is not None:
            traffic.update_norm[node] = norm
        self.uplink.accept(server_round, node)
        msg.content = content  # the payload is not needed any more: let it go
        return contribution

    def _check_values(self, tensors: dict[str, torch.Tensor], work: float) -> float:
        """Every decoded value finite, and the update within ``max-update-norm`` and within the
        clipping norm of Flower's client-side DP wrapper, where the inner strategy is one; return
        the update's L2 norm."""
        bad, norm = not_finite_and_norm(tensors)  # (as the client measures what it sends)
        if bad:
            raise PayloadError(bad[0], "decoded values are not all finite")
        clip = _client_clipping_norm(self.strategy)
        if self._bound > 0 or clip is not None:
            self._check_norm(norm, clip, work)
        return norm

    def _check_norm(self, norm: float, clip: float | None, work: float = 1.0) -> None:
        """``norm`` within ``max-update-norm`` and within ``clip``, the client-side DP wrapper's
        clipping norm (:func:`_client_clipping_norm`, None without one)."""
        bound = self._bound * work  # (a client that trained more local iterations: more room)
        # (the slack, as for the DP norm below: honest clients send at most the bound, measured in
        # float64 by another order of summation; see compression_mod)
        if bound > 0 and norm > bound * (1 + 1e-9):
            what = (
                f"max-update-norm {self._bound:g}"
                if self._bound_why == "max-update-norm"
                else (f"{self._bound:.4g}, this round's bound ({self._bound_why})")
            )
            if work > 1:
                what += f" x {work:.4g} for the local iterations it reports"
            raise PayloadError("", f"update norm {norm:.4g} exceeds {what}")
        # The client measured what it sent in float64 as this does (fedcomp.flower.clipping); the
        # slack covers only a different order of summation.
        if clip is not None and norm > clip * (1 + 1e-9):
            raise PayloadError(
                "",
                f"update norm {norm:.9g} exceeds the DP wrapper's clipping_norm {clip:g} (the noise is "
                "calibrated to it): a client that does not clip what it sends (no compression_mod?)",
            )

    def _check_structure(self, content: RecordDict) -> None:
        """What the inner strategy will read: no ArrayRecord of the client's own (the wrapper puts
        the decoded model in), no record of any kind under the model's key (a MetricRecord there
        would be overwritten by the model, or overwrite it in the streaming path's one reply),
        exactly one MetricRecord, and a weight in (0, max-num-examples]."""
        if content.array_records:
            raise PayloadError("", f"reply carries ArrayRecord(s) {sorted(content.array_records)} beside its update")
        if self._arrays_key in content:
            raise PayloadError("", f"reply carries a record named {self._arrays_key!r}, the key the model goes under")
        self._check_metrics(content)

    def _check_metrics(self, content: RecordDict) -> None:
        """Exactly one MetricRecord, within ``max-metrics-bytes``, with a weight in
        (0, max-num-examples] (train and evaluate)."""
        if len(content.metric_records) != 1:
            raise PayloadError("", f"reply has {len(content.metric_records)} MetricRecords, expected 1")
        metrics = next(iter(content.metric_records.values()))
        size = _metrics_size(metrics, self.config.max_metrics_bytes)
        if size > self.config.max_metrics_bytes:
            raise PayloadError(
                "",
                f"reply's MetricRecord holds over {self.config.max_metrics_bytes} bytes of metrics "
                f"({len(metrics)} keys; keys' characters + 8 bytes a value), past max-metrics-bytes",
            )
        key = _through_wrappers(self.strategy, "weighted_by_key")
        if key is None:
            return
        weight = metrics.get(key)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise PayloadError("", f"reply's {key!r} is missing or not a number ({shown(weight)})")
        if not 0 < weight <= self.config.max_num_examples:
            raise PayloadError("", f"reply's {key!r} = {weight} is outside (0, {self.config.max_num_examples}]")

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if not self.config.compress:
            return self.strategy.aggregate_train(server_round, replies)
        self._traffic(server_round)  # (the round's figures, even when every reply failed)
        # The inner strategy sums the replies in the order it gets them, and float addition is
        # not associative: in arrival order, two runs with the same seed (or a resumed run) would
        # end with different models. Sorted by content, the aggregate is reproducible.
        ordered = sorted(replies, key=_reply_order)
        grid = self.replica.grid if self.replica is not None else None
        self._fit = GridFit(self._target, grid, REPLY_SLACK) if grid is not None and self._target is not None else None
        self._tighten_first_bound(server_round, ordered)

        if self.streaming:
            accepted, arrays, metrics = self._aggregate_streaming(server_round, ordered)
        else:
            accepted = []
            for msg in ordered:
                if self._admit(msg, server_round, self._decode_reply) is not None:
                    accepted.append(msg)
            self._conform(accepted, server_round, "train")
            arrays, metrics = self.strategy.aggregate_train(server_round, accepted)
        if arrays is not None and self._target is not None and _overrides(self.uplink, "finish"):
            t0 = time.perf_counter()
            model = self.uplink.finish(server_round, tensors_from_record(arrays), self._target)
            self._traffic(server_round).decode_seconds += time.perf_counter() - t0
            if model is not None:
                arrays = record_from_tensors(model)
        nothing = "the inner strategy aggregated nothing this round"
        refused = self._refused_aggregate(arrays)
        if refused is not None:
            # Flower keeps the model it had when it gets no arrays.
            nothing = f"{refused}; the model stays as it was"
            self._traffic(server_round).aggregate_refused = nothing
            log.error(
                "fedcomp: round %s: %s (an update far larger than the others? max-update-norm bounds them; "
                "under the lattice downlink, weights growing past its grid need a larger lattice-step)",
                server_round,
                nothing,
            )
            arrays = None
        for msg in accepted:
            if not msg.has_error():
                self._last_update[msg.metadata.src_node_id] = (
                    (server_round, UpdateStatus.AGGREGATED, "")
                    if arrays is not None
                    else (server_round, UpdateStatus.REJECTED, _reason(nothing))
                )
        self._note_norms(server_round, accepted if arrays is not None else None)
        self._settled = max(self._settled, server_round)
        self._traffic(server_round).close_selection()  # (the round's replies are all in)
        self._count_empty(server_round, arrays is None)
        return arrays, self._with_figures(server_round, metrics, "train")

    def _count_empty(self, server_round: int, empty: bool) -> None:
        """Keep the streak of train rounds that aggregated nothing; at ``max-empty-rounds`` raise
        :class:`NoProgressError` naming the rounds and why the last one's replies were left out
        (a run whose every client fails, e.g. ClientApps without the mod, completed before with
        the model it started from: Flower calls such a run completed)."""
        if not empty:
            self._empty_rounds.clear()
            return
        if self._empty_rounds and self._empty_rounds[-1] == server_round:
            return
        self._empty_rounds.append(server_round)
        if not self.ends_empty_runs or len(self._empty_rounds) < self.config.max_empty_rounds:
            return
        t = self._traffic(server_round)
        why = by_reason(dict(sorted({**t.failed, **t.rejected}.items())), most=3)
        if t.aggregate_refused:
            why = f"{why}; " if why else ""
            why += t.aggregate_refused
        if not why:
            why = f"no client replied ({len(t.unanswered)} train message(s) unanswered)"
        first, last = self._empty_rounds[0], self._empty_rounds[-1]
        raise NoProgressError(
            f"no client update was aggregated in {len(self._empty_rounds)} train rounds in a row "
            f"(rounds {first}-{last}; max-empty-rounds = {self.config.max_empty_rounds}): {why}"
        )

    def _refused_aggregate(self, arrays: ArrayRecord | None) -> str | None:
        """Why the round's aggregate must not become the model, or None. Every reply was finite,
        but their mean may overflow float32; every reply stayed on the lattice grid
        (:class:`GridFit`), so their mean does, but the inner strategy's own step (momentum,
        adaptive moments) may leave it, and the next downlink could not send that model."""
        if arrays is None:
            return None
        bad = _not_finite(arrays)
        if bad is not None:
            return f"the round's aggregate is not finite (tensor {bad!r})"
        first_grid = self._fit is None and self.replica is not None and self.config.downlink_codec == "lattice"
        if self._fit is None and not first_grid:
            return None
        model = tensors_from_record(arrays)
        fit = self._fit
        if fit is None:
            # No grid yet: the next downlink sets it from this aggregate's movement, and one client's
            # finite 1e30 made a grid the model did not fit (the run ended at the next downlink).
            assert self.replica is not None
            first = grid_exponents(
                model, self.replica.tensors, self.config.lattice_step, self.config.lattice_weight_step
            )
            fit = GridFit(model, first)
        off = fit.off_grid(model)
        if off is not None:
            return f"the round's aggregate leaves the lattice downlink's grid (tensor {off!r})"
        return None

    def _admit(self, msg: Message, server_round: int, decode: Callable[[Message, int], _T]) -> _T | Message | None:
        """One train reply's bookkeeping, then ``decode(msg, server_round)``: its result, ``msg``
        itself for an error reply (the inner strategy logs and skips it), or None when the
        update was rejected (the reason recorded for the client's next downlink)."""
        traffic = self._traffic(server_round)
        node = msg.metadata.src_node_id
        traffic.unanswered.discard(node)  # it replied (what is left never did)
        if _needs_resync_bookkeeping(msg):
            self._note_node(node, self._report_of(msg))
        if msg.has_error():
            self._hint_if_no_mod(msg)
            why = _reason(f"error {msg.error.code}: {msg.error.reason}")
            traffic.failed[node] = why
            log.warning("fedcomp: node %s replied an error in round %s (%s)", node, server_round, why)
            return msg
        try:
            out = decode(msg, server_round)
        except Exception as exc:  # one client's bytes must never stop the round
            if not isinstance(exc, PayloadError | ConfigError):
                log.exception("fedcomp: unexpected error decoding node %s's update", node)
                exc = PayloadError("", f"decoder failed: {type(exc).__name__}: {exc}")
            # The client's replica state (checked above) is still good; only this update is
            # not aggregated. The next downlink tells the client, which adds it back to its
            # residual (protocol 2).
            why = _reason(str(exc))  # (a reason may quote what the client sent: kept short)
            traffic.rejected[node] = why
            self._last_update[node] = (server_round, UpdateStatus.REJECTED, why)
            log.warning("fedcomp: rejected the update of node %s in round %s: %s", node, server_round, why)
            return None
        traffic.accepted += 1
        return msg if out is None else out

    def _aggregate_streaming(
        self, server_round: int, ordered: list[Message]
    ) -> tuple[list[Message], ArrayRecord | None, MetricRecord | None]:
        """The replies the inner strategy aggregated (content and error replies), its arrays and
        the metrics, with each reply summed as it is decoded (see the module docstring).

        Their MetricRecords are made alike afterwards (:meth:`_conform`), as the materialising
        path does."""
        key: str = self.strategy.weighted_by_key  # type: ignore[attr-defined]  # FedAvg's family
        assert self._target is not None
        total = WeightedSum(self._target)
        kept: list[Message] = []
        errors: list[Message] = []
        for msg in ordered:
            got = self._admit(msg, server_round, self._stream_reply)
            if got is None:
                continue
            if isinstance(got, Message):
                errors.append(msg)
                continue
            weight = float(next(iter(msg.content.metric_records.values()))[key])  # type: ignore[arg-type]
            total.add(got, weight)
            kept.append(msg)
        self._conform(kept, server_round, "train")
        contents = [msg.content for msg in kept]
        if not kept:  # nothing to aggregate: the inner strategy sees the errors, as it would
            arrays, metrics = self.strategy.aggregate_train(server_round, errors)
            return errors, arrays, metrics
        # One reply carries the weighted mean with the total weight: the inner strategy's mean of
        # it is itself (weight / total = 1), then its own server step runs on it.
        carrier = kept[0]
        name = next(iter(carrier.content.metric_records))
        carrier.content = RecordDict(
            {self._arrays_key: record_from_tensors(total.mean()), name: MetricRecord({key: total.weight})}
        )
        try:
            arrays, _ = self.strategy.aggregate_train(server_round, [carrier, *errors])
        finally:
            carrier.content = contents[0]
        metrics = self.strategy.train_metrics_aggr_fn(contents, key)  # type: ignore[attr-defined]
        return [*kept, *errors], arrays, metrics

    def _conform(self, replies: list[Message], server_round: int, what: str) -> None:
        """Make the content replies' MetricRecords alike, in place: Flower's strategies require one
        record name and one key set (with list lengths) of all replies and raise otherwise. A reply
        whose record differs keeps its update: its record is renamed to the name most replies use
        and holds the keys every reply has (the weight key always: each reply was checked for it),
        and a warning names the keys left out. Neither the order of the replies nor the name a
        sender picks decides what another reply keeps (rejecting the odd reply out did: a sender
        could grind its payload's hash to be seen first and win a tie)."""
        if _through_wrappers(self.strategy, "weighted_by_key") is None:
            return
        content = [m for m in replies if not m.has_error() and m.has_content()]
        shapes = [_metric_shape(m) for m in content]
        if len(set(shapes)) <= 1:
            return
        names = Counter(name for name, _ in shapes)
        name = min(names, key=lambda n: (-names[n], n))
        keys = set.intersection(*(set(k) for _, k in shapes))
        dropped: dict[int, list[str]] = {}
        for msg, (got_name, got_keys) in zip(content, shapes, strict=True):
            if (got_name, got_keys) == (name, tuple(sorted(keys))):
                continue
            rec = msg.content.metric_records[got_name]
            kept = {k: rec[k] for k, _ in sorted(keys)}
            msg.content = RecordDict(
                {**{k: v for k, v in msg.content.items() if k != got_name}, name: MetricRecord(kept)}
            )
            dropped[msg.metadata.src_node_id] = sorted(k for k, _ in set(got_keys) - keys)
        log.warning(
            "fedcomp: round %s (%s): the replies' MetricRecords differ; metrics aggregated over the keys all "
            "share, under the name %r (keys left out, by node: %s)",
            server_round,
            what,
            name,
            {n: ks[:8] for n, ks in sorted(dropped.items())},
        )

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        if not self.config.compress:
            return self.strategy.aggregate_evaluate(server_round, replies)
        replies = list(replies)
        checked = []
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_content() and self._unsettled.get(node, server_round + 1) <= self._told.pop(node, -1):
                del self._unsettled[node]  # it settled that update before replying
            if _needs_resync_bookkeeping(msg):
                self._note_node(msg.metadata.src_node_id, self._report_of(msg))
            self._hint_if_no_mod(msg)
            if not msg.has_error() and _through_wrappers(self.strategy, "weighted_by_key") is not None:
                try:
                    self._check_metrics(msg.content)
                except PayloadError as exc:
                    self._reject_evaluate(msg, str(exc), server_round)
                    continue
            checked.append(msg)
        self._conform(checked, server_round, "evaluate")
        metrics = self.strategy.aggregate_evaluate(server_round, checked)
        return None if metrics is None else self._with_figures(server_round, metrics, "evaluate")

    def _hint_if_no_mod(self, msg: Message) -> None:
        """Say once a run what a ClientApp that failed looking for the model's ArrayRecord most
        likely lacks: the wrapper sends the model in its downlink record, which only
        :func:`~fedcomp.flower.mod.compression_mod` turns back into that ArrayRecord (Flower's
        error reason alone says ``KeyError`` in the user's own code)."""
        if self._hinted_mod or not msg.has_error():
            return
        key = _through_wrappers(self.strategy, "arrayrecord_key") or "arrays"
        # Searched before it is cut: under Ray (a simulation) the reason opens with ~900 characters
        # of Ray's wrapping before the KeyError, past the 500 an outcome keeps. (A bounded search:
        # the reason is the client's text.)
        text = (msg.error.reason or "")[:_HINT_SEARCH_CHARS]
        at = text.find("KeyError")
        reason = _reason(text[at:])
        if at >= 0 and repr(key) in text[at:]:
            self._hinted_mod = True
            log.warning(
                "fedcomp: node %s's ClientApp failed looking for the ArrayRecord %r (%s): the strategy wrapper "
                "sends the model in fedcomp's downlink record instead, which compression_mod turns back into %r. "
                "Does the ClientApp run it? ClientApp(mods=[compression_mod])",
                msg.metadata.src_node_id,
                key,
                reason,
                key,
            )

    def _reject_evaluate(self, msg: Message, why: str, server_round: int) -> None:
        node = msg.metadata.src_node_id
        why = _reason(why)
        self._traffic(server_round).rejected_evaluate[node] = why
        log.warning("fedcomp: rejected the evaluate reply of node %s in round %s: %s", node, server_round, why)

    def _with_figures(self, server_round: int, metrics: MetricRecord | None, phase: str) -> MetricRecord:
        """The inner strategy's metrics plus this round's compression figures (``fedcomp.*``
        keys, see :mod:`fedcomp.flower.traffic`), so Flower's round log and the ``Result`` of
        ``strategy.start`` show them; one log line per train round."""
        t = self._traffic(server_round)
        figures = metric_record(t, self.traffic)
        if phase == "train":
            # A train round whose clients all hold the model already (it went out with the last
            # evaluate round) sends no downlink: say so rather than a ratio of "x0.0".
            down = (
                f"{figures['fedcomp.downlink-bytes']} B (x{figures['fedcomp.downlink-ratio']:.1f})"
                if figures["fedcomp.downlink-bytes"]
                else "0 B (clients up to date)"
            )
            log.info(
                "fedcomp: round %s: uplink %s B (x%.1f), downlink %s, %s replies accepted, %s rejected, %s failed",
                server_round,
                figures["fedcomp.uplink-bytes"],
                figures["fedcomp.uplink-ratio"],
                down,
                t.accepted,
                len(t.rejected),
                len(t.failed),
            )
        out = MetricRecord(dict(metrics) if metrics is not None else {})
        for k, v in figures.items():
            out[k] = v
        return out

    def outcome_state(self) -> dict[str, Any]:
        """The update-outcome records (JSON-able), for a checkpoint of the server's state: they
        must be saved and restored together with the model (see ``UpdateOutcome.verdict``)."""
        return {
            "records-from-round": self._records_from or 1,
            "settled-round": self._settled,
            "last-update": {str(n): [r, str(s), why] for n, (r, s, why) in sorted(self._last_update.items())},
            "unsettled": {str(n): r for n, r in sorted(self._unsettled.items())},
        }

    def load_outcome_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`outcome_state` saved; raise :class:`PayloadError` if malformed."""
        try:
            start = int(state["records-from-round"])
            settled = int(state["settled-round"])
            last = {
                int(n): (int(r), UpdateStatus(s), _reason(str(why))) for n, (r, s, why) in state["last-update"].items()
            }
            # (absent from checkpoints written before it was kept: no node is told of a restart then)
            unsettled = {int(n): int(r) for n, r in state.get("unsettled", {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PayloadError("", f"outcome state: {type(exc).__name__}: {exc}") from None
        for r, s, why in [*last.values(), (0, UpdateStatus.NONE, "")]:
            # What the clients will be sent must pass their checks.
            UpdateOutcome.from_record(UpdateOutcome(settled + 1, settled, r, s, why, start).fields(), "outcome state")
        if any(not 0 < r <= settled + 1 for r in unsettled.values()):
            raise PayloadError("", "outcome state: an 'unsettled' round is outside [1, settled-round + 1]")
        self._records_from, self._settled, self._last_update, self._unsettled = start, settled, last, unsettled

    def state_dict(self) -> dict[str, Any]:
        """Everything this wrapper knows that a resumed server needs (for a checkpoint, saved with
        ``torch.save`` and read with ``weights_only=True``: plain data, no object of fedcomp's):
        the replica's state (:meth:`ServerReplica.state_dict`), the model the
        replica was last synced to, what each node holds, the update outcomes, the lineage, and
        the uplink method's own state (GradiVeQ's compressor and samples, DEFT's last aggregate).

        Not included: the inner strategy's state (FedAvg has none; FedAdam's moments, FedProx's
        proximal term settings live in the inner strategy and are not saved) and ``traffic``
        (per-round figures already written to results.json)."""
        return {
            "lineage": self.lineage,
            "replica": None if self.replica is None else self.replica.state_dict(),
            "target": self._target,
            "nodes": dict(self._nodes),
            "assumed-seeded": set(self._assumed_seeded),
            "not-seeded": set(self._not_seeded),
            "outcomes": self.outcome_state(),
            "records-from": self._records_from,
            "empty-rounds": list(self._empty_rounds),
            "norm-ref": None if self._norm_ref is None else list(self._norm_ref),
            "uplink-method": type(self.uplink).__name__,
            "uplink": self.uplink.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved; raise :class:`PayloadError` when it is malformed
        or was saved with another uplink method than this run's config names."""
        try:
            lineage, replica, target = state["lineage"], state["replica"], state["target"]
            nodes = {int(n): (int(v), str(d)) for n, (v, d) in state["nodes"].items()}
            assumed, not_seeded = {int(n) for n in state["assumed-seeded"]}, {int(n) for n in state["not-seeded"]}
            method, uplink, records_from = state["uplink-method"], dict(state["uplink"]), state["records-from"]
            outcomes = state["outcomes"]
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PayloadError("", f"strategy state: {type(exc).__name__}: {exc}") from None
        if not isinstance(lineage, str) or not lineage:
            raise PayloadError("", f"strategy state: lineage {lineage!r} is not a token")
        if replica is not None and not isinstance(replica, dict):
            raise PayloadError("", f"strategy state: replica is a {type(replica).__name__}")
        if method != type(self.uplink).__name__:
            raise PayloadError("", f"strategy state: saved with uplink method {method}, this run uses "
                               f"{type(self.uplink).__name__}")  # fmt: skip
        if replica is not None:
            replica = ServerReplica.from_state_dict(replica)
            replica.log_models = self.config.delta_log_models
        self.load_outcome_state(outcomes)
        self._records_from = None if records_from is None else int(records_from)
        try:  # (a checkpoint from before the streak was kept: none)
            self._empty_rounds = [int(r) for r in state.get("empty-rounds", [])]
        except (TypeError, ValueError) as exc:
            raise PayloadError("", f"strategy state: empty-rounds: {type(exc).__name__}: {exc}") from None
        self._norm_ref = _norm_ref(state.get("norm-ref"))  # (a checkpoint from before it: None)
        self.lineage, self.replica, self._target = lineage, replica, target
        self._nodes, self._assumed_seeded, self._not_seeded = nodes, assumed, not_seeded
        if replica is not None:
            self.uplink.load_state_dict(uplink, replica.specs)

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        """The uplink method's own figures for ``server_round`` (for the results)."""
        return self.uplink.round_metrics(server_round)

    def summary(self) -> None:
        if self.config.compress:
            log.info("fedcomp: compressing both ways: %s", self.config.describe())
        else:
            log.info("fedcomp: compress = false: every message passes through uncompressed (plain Flower traffic)")
        self.strategy.summary()

    def __repr__(self) -> str:
        return f"CompressionStrategy({self.strategy!r})"


def _lower_median(values: Sequence[float]) -> float:
    """The median of sorted ``values``, the lower middle one of an even count: of two clients,
    one may be the hostile one, whose update is larger or smaller."""
    return values[(len(values) - 1) // 2]


def _norm_ref(saved: object) -> tuple[int, float] | None:
    """A checkpoint's ``norm-ref`` (round, median norm), checked; None when it has none."""
    if saved is None:
        return None
    if not isinstance(saved, list | tuple) or len(saved) != 2:
        raise PayloadError("", f"strategy state: norm-ref is not a (round, norm) pair: {shown(saved)}")
    try:
        ref_round, ref = int(saved[0]), float(saved[1])
    except (TypeError, ValueError) as exc:
        raise PayloadError("", f"strategy state: norm-ref: {type(exc).__name__}: {exc}") from None
    if not (math.isfinite(ref) and ref > 0):
        raise PayloadError("", f"strategy state: norm-ref {ref!r} is not a finite norm > 0")
    return ref_round, ref


def _not_finite(arrays: ArrayRecord) -> str | None:
    """The name of the first float array of ``arrays`` that holds a NaN or an infinity, or None."""
    for name, arr in arrays.items():
        a = arr.numpy()
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return name
    return None


def _reply_order(msg: Message) -> tuple[int, str, int]:
    """Sort key of a train reply: errors first, then by the SHA-256 of its uplink payload (the
    same bytes sort the same in every run, whatever the node ids or arrival order), then node."""
    payload = b""
    if not msg.has_error() and msg.has_content():
        rec = msg.content.config_records.get(protocol.UPLINK)
        value = rec.get("payload") if rec is not None else None
        payload = value if isinstance(value, bytes) else b""
    return (0 if msg.has_error() else 1, hashlib.sha256(payload).hexdigest(), int(msg.metadata.src_node_id))


def _metric_shape(msg: Message) -> tuple[str, tuple[tuple[str, int], ...]]:
    """A reply's MetricRecord name and its keys with their list lengths (-1: a number)."""
    name, rec = next(iter(msg.content.metric_records.items()))
    return name, tuple(sorted((k, len(v) if isinstance(v, list) else -1) for k, v in rec.items()))


#: How much of a failed reply's reason :meth:`CompressionStrategy._hint_if_no_mod` searches.
_HINT_SEARCH_CHARS = 65_536


def _metrics_size(metrics: MetricRecord, limit: int) -> int:
    """The size ``max-metrics-bytes`` bounds: each key's characters plus 8 bytes a value (a list's
    every element); counting stops once past ``limit``, so a huge record costs no more than that."""
    size = 0
    for k, v in metrics.items():
        size += len(k) + 8 * (len(v) if isinstance(v, list) else 1)
        if size > limit:
            break
    return size


def _reason(text: str) -> str:
    """A rejection reason as an outcome carries it (at most ``MAX_REASON_CHARS``)."""
    limit = protocol.MAX_REASON_CHARS
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _needs_resync_bookkeeping(msg: Message) -> bool:
    """Whether a reply tells the server something about the client's replica: any content reply,
    and an error that asks for a resync. Other errors (the app failed, its update diverged) leave
    the client's replica as it was, so the server keeps what it knew: no full model next time."""
    return not msg.has_error() or msg.error.code == int(protocol.ErrorCode.RESYNC)


def _overrides(method: UplinkMethod, hook: str) -> bool:
    """Whether ``method`` has its own ``hook`` (skips converting the aggregate when not)."""
    return getattr(type(method), hook) is not getattr(UplinkMethod, hook)


def _wrapped(strategy: Strategy | None) -> Iterator[Strategy]:
    """``strategy``, the strategy it wraps (Flower's DP wrappers keep it in ``.strategy``), and so
    on down (at most ``_WRAPPER_DEPTH``)."""
    for _ in range(_WRAPPER_DEPTH):
        if strategy is None:
            return
        yield strategy
        strategy = getattr(strategy, "strategy", None)


_WRAPPER_DEPTH = 8


def _through_wrappers(strategy: Strategy | None, name: str) -> Any:
    """The attribute ``name`` of the first of :func:`_wrapped` that has one, else None. The reply
    checks read FedAvg's ``weighted_by_key`` through a DP wrapper so: skipped there, one odd reply
    would end the run."""
    return next((getattr(s, name) for s in _wrapped(strategy) if hasattr(s, name)), None)


_CLIENT_CLIPPING = (DifferentialPrivacyClientSideFixedClipping, DifferentialPrivacyClientSideAdaptiveClipping)


def _client_clipping_norm(strategy: Strategy | None) -> float | None:
    """The clipping norm that Flower's client-side DP wrapper (fixed or adaptive clipping), as or
    inside ``strategy``, asks this round's clients to keep what they send to, else None."""
    return next((float(s.clipping_norm) for s in _wrapped(strategy) if isinstance(s, _CLIENT_CLIPPING)), None)


def streams_weighted_mean(strategy: Strategy) -> bool:
    """Whether the wrapper may sum ``strategy``'s train replies as they are decoded: its
    ``aggregate_train`` is FedAvg's (FedAvg, FedProx, FedOpt) or that of FedAvgM, FedAdam, FedYogi
    or FedAdagrad, which take FedAvg's weighted mean and then a server step on it alone. A
    subclass with its own ``aggregate_train``, and any other strategy (FedMedian, Krum,
    FedTrimmedAvg, Bulyan, the differential-privacy wrappers), gets every reply materialised."""
    agg = type(strategy).aggregate_train
    return any(agg is cls.aggregate_train for cls in _MEAN_FIRST) and hasattr(strategy, "train_metrics_aggr_fn")


def aggregates_by_weighted_mean(strategy: Strategy) -> bool:
    """Whether ``strategy`` aggregates train replies by FedAvg's weighted mean of their arrays
    (FedAvg itself and subclasses that keep its ``aggregate_train``, e.g. FedProx)."""
    return type(strategy).aggregate_train is FedAvg.aggregate_train
