"""Server side: a strategy wrapper that gives any Flower strategy compressed traffic both ways.

Downlink (3LC by default): every train/evaluate message the inner strategy builds has its model
replaced by what that client needs to rebuild the replica (see ``replica.py``). Uplink (SBC by
default): each client's reply carries a compressed delta against the replica it trained on; the
wrapper decodes it, rebuilds ``global model + delta`` as an ordinary ArrayRecord and hands the replies
to the inner strategy, which aggregates as usual. A reply whose payload is corrupt or hostile is
dropped with a logged reason and the round goes on with the others.

Pair it with :func:`fedcomp.flower.mod.compression_mod` on the clients.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from fedcomp.codecs import DenseFP32
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.flower import protocol as keys
from fedcomp.flower.deft_link import ALLOCATION_KEY, DeftPlanner
from fedcomp.flower.gradiveq_link import GradiVeQCoordinator
from fedcomp.flower.records import fp32_bytes, record_from_tensors, tensors_from_record
from fedcomp.flower.replica import ServerReplica
from fedcomp.flower.settings import CompressionConfig
from fedcomp.methods.update import decode_update
from fedcomp.wire.serde import update_from_bytes

log = logging.getLogger("fedcomp")


@dataclass
class RoundTraffic:
    """Bytes per client (node id) and direction for one round, as they crossed the wire."""

    uplink: dict[int, int] = field(default_factory=dict)
    downlink: dict[int, int] = field(default_factory=dict)
    dense_uplink: dict[int, int] = field(default_factory=dict)
    dense_downlink: dict[int, int] = field(default_factory=dict)
    downlink_mode: dict[int, str] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    encode_seconds: float = 0.0  # server-side downlink compression time
    client_encode_seconds: dict[int, float] = field(default_factory=dict)  # each client's uplink encode
    # "topk"/"deft" uplinks: entries of the compressed tensors that any client sent (the union of
    # the selections) and how many entries those tensors have: the aggregate density.
    _union: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def note_selection(self, delta: dict[str, torch.Tensor], min_numel: int) -> None:
        for name, t in delta.items():
            if t.numel() < min_numel:
                continue
            mask = t.reshape(-1) != 0
            if name in self._union:
                self._union[name] |= mask
            else:
                self._union[name] = mask

    @property
    def union_nnz(self) -> int:
        return int(sum(int(m.sum()) for m in self._union.values()))

    @property
    def sparse_numel(self) -> int:
        return int(sum(m.numel() for m in self._union.values()))

    decode_seconds: float = 0.0  # server-side uplink decompression time
    # What each client reported doing (fedcomp.methods.bandwidth): the SBC p and local iterations it used,
    # its byte budget (absent: none), the policy's estimate, whether it fit, its training time
    # and its link (uplink Mbit/s, downlink Mbit/s, latency ms).
    sbc_p: dict[int, float] = field(default_factory=dict)
    local_iters: dict[int, int] = field(default_factory=dict)
    budget_bytes: dict[int, int] = field(default_factory=dict)
    estimated_bytes: dict[int, int] = field(default_factory=dict)
    fits: dict[int, bool] = field(default_factory=dict)
    train_seconds: dict[int, float] = field(default_factory=dict)
    links: dict[int, list[float]] = field(default_factory=dict)

    def note_client(self, node: int, rec: ConfigRecord) -> None:
        """Copy what the client mod reported in its uplink record (keys it did not send: skipped)."""
        for key, store, cast in (
            ("sbc-p", self.sbc_p, float),
            ("local-iters", self.local_iters, int),
            ("budget-bytes", self.budget_bytes, int),
            ("estimated-bytes", self.estimated_bytes, int),
            ("fits", self.fits, bool),
            ("train-seconds", self.train_seconds, float),
            ("encode-seconds", self.client_encode_seconds, float),
        ):
            if key in rec:
                store[node] = cast(rec[key])  # type: ignore[call-overload]
        if "uplink-mbps" in rec:
            self.links[node] = [float(rec[k]) for k in ("uplink-mbps", "downlink-mbps", "latency-ms")]  # type: ignore[arg-type]

    def add_downlink(self, node: int, nbytes: int, dense: int, mode: str) -> None:
        self.downlink[node] = self.downlink.get(node, 0) + nbytes
        self.dense_downlink[node] = self.dense_downlink.get(node, 0) + dense
        self.downlink_mode[node] = mode


class CompressionStrategy(Strategy):
    """Wrap ``strategy`` (FedAvg, FedProx, FedAdam, ...) so its traffic is compressed.

    ``traffic[server_round]`` holds the measured bytes of each round.
    """

    def __init__(self, strategy: Strategy, config: CompressionConfig | None = None) -> None:
        self.strategy = strategy
        self.config = config or CompressionConfig()
        self.replica: ServerReplica | None = None
        self.traffic: dict[int, RoundTraffic] = {}
        self._arrays_key: str = getattr(strategy, "arrayrecord_key", "arrays")
        self._target: dict[str, torch.Tensor] | None = None  # the W the replica was last synced to
        self._nodes: dict[int, tuple[int, str]] = {}  # node -> (replica version, digest) it reported
        self._round = 0
        self._bandwidth = self.config.bandwidth_budget().to_json()
        self._config_key: str = getattr(strategy, "configrecord_key", "config")
        # Uplink methods the server coordinates (fedcomp.flower.deft_link / gradiveq_link).
        self.deft = DeftPlanner(self.config.min_compress_numel) if self.config.uplink_codec == "deft" else None
        self.gradiveq = GradiVeQCoordinator(self.config) if self.config.uplink_codec == "gradiveq" else None
        # GradiVeQ: aggregate coefficients (not models) when the inner strategy's aggregation is
        # FedAvg's weighted mean, which commutes with the linear decompression.
        self.compressed_domain = type(strategy).aggregate_train is FedAvg.aggregate_train

    # --- downlink ------------------------------------------------------------------------------

    def _sync_replica(self, arrays: ArrayRecord, server_round: int) -> None:
        """Bring the replica to the global model ``arrays`` (one compression per model change)."""
        target = tensors_from_record(arrays)
        if self.replica is None:
            self.replica = ServerReplica(target, self.config.delta_log_size, self.config.min_compress_numel)
        elif self._target is None or any(not torch.equal(target[k], self._target[k]) for k in target):
            t0 = time.perf_counter()
            self.replica.advance(target, self.config.downlink_codec_at(server_round))
            self._traffic(server_round).encode_seconds += time.perf_counter() - t0
        self._target = target

    def _traffic(self, server_round: int) -> RoundTraffic:
        return self.traffic.setdefault(server_round, RoundTraffic())

    def _uplink_codec_config(self, server_round: int) -> dict:
        if self.gradiveq is not None:
            return self.gradiveq.uplink_codec_config(server_round)
        return self.config.uplink_codec_at(server_round).get_config()

    def _with_downlink(self, messages: Iterable[Message], server_round: int, train: bool = False) -> list[Message]:
        assert self.replica is not None
        messages = list(messages)
        out = []
        dense = fp32_bytes(self.replica.tensors)
        uplink_codec = json.dumps(self._uplink_codec_config(server_round))
        extras: dict[int, dict[str, bytes]] = {}
        if train and self.deft is not None:
            density = self.config.topk_density.at(server_round)
            nodes = [m.metadata.dst_node_id for m in messages]
            for node, data in self.deft.plan(server_round, nodes, self.replica.specs, density).items():
                extras.setdefault(node, {})[ALLOCATION_KEY] = data
        if train and self.gradiveq is not None:
            for m in messages:
                node = m.metadata.dst_node_id
                extras.setdefault(node, {}).update(self.gradiveq.downlink_extras(node, server_round))
        for msg in messages:
            node = msg.metadata.dst_node_id
            version, digest = self._nodes.get(node, (None, None))
            dl = self.replica.downlink_for(version, digest)
            extra = extras.get(node, {})
            record = ConfigRecord(
                {
                    "mode": dl.mode,
                    "payloads": list(dl.payloads),
                    "version": dl.version,
                    "digest": dl.digest,
                    "arrays-key": self._arrays_key,
                    "downlink-codec": self.config.downlink_codec,
                    "uplink-codec": uplink_codec,
                    "error-feedback": self.config.error_feedback,
                    "min-compress-numel": self.config.min_compress_numel,
                    "device": self.config.client_device,
                    "bandwidth": self._bandwidth,
                    "config-key": self._config_key,
                    **extra,
                }
            )
            # A fresh RecordDict per message: the inner strategy shares one between all messages.
            content = RecordDict({k: v for k, v in msg.content.items() if k != self._arrays_key})
            content[keys.DOWNLINK] = record
            msg.content = content
            self._traffic(server_round).add_downlink(
                node, dl.nbytes + sum(len(b) for b in extra.values()), dense, dl.mode
            )
            out.append(msg)
        return out

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._sync_replica(arrays, server_round)
        config = ConfigRecord(dict(config))
        config[keys.LOCAL_ITERS] = self.config.local_iters_at(server_round)
        msgs = self.strategy.configure_train(server_round, arrays, config, grid)
        return self._with_downlink(msgs, server_round, train=True)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        msgs = list(self.strategy.configure_evaluate(server_round, arrays, config, grid))
        if not msgs:
            return msgs
        self._sync_replica(arrays, server_round)
        return self._with_downlink(msgs, server_round)

    # --- uplink --------------------------------------------------------------------------------

    def _note_node(self, msg: Message) -> None:
        """Remember the replica version a client reports; forget it when it erred or lied."""
        node = msg.metadata.src_node_id
        rec = msg.content.config_records.get(keys.UPLINK) if msg.has_content() else None
        if self.gradiveq is not None:
            self.gradiveq.note_node(node, rec)
        if rec is None:
            self._nodes.pop(node, None)
            return
        version, digest = int(rec.get("replica-version", -1)), str(rec.get("replica-digest", ""))
        assert self.replica is not None
        if self.replica.digest_of(version) == digest:
            self._nodes[node] = (version, digest)
        else:
            self._nodes.pop(node, None)

    def _decode_reply(self, msg: Message, server_round: int) -> None:
        """Replace the compressed payload in ``msg`` by ``W + delta`` (raises PayloadError)."""
        assert self.replica is not None
        rec = msg.content.config_records.get(keys.UPLINK)
        if rec is None or not isinstance(rec.get("payload"), bytes):
            raise PayloadError("", f"reply has no {keys.UPLINK} payload")
        data: bytes = rec["payload"]  # type: ignore[assignment]
        traffic = self._traffic(server_round)
        node = msg.metadata.src_node_id
        traffic.note_client(node, rec)
        traffic.uplink[node] = len(data)
        traffic.dense_uplink[node] = fp32_bytes(self.replica.tensors)
        t0 = time.perf_counter()
        update = update_from_bytes(data)
        if update.base_model_version != self.replica.version:
            raise PayloadError(
                "", f"update is against version {update.base_model_version}, expected {self.replica.version}"
            )
        assert self._target is not None
        if self.gradiveq is not None:
            # Coefficients (or, in uncompressed rounds, W + delta) for the inner strategy.
            model = self.gradiveq.decode(update, self.replica.specs, self._target, server_round, self.compressed_domain)
        else:
            uplink_codec = self.config.uplink_codec_at(server_round)
            delta = decode_update(update, self.replica.specs, [uplink_codec, DenseFP32()])
            if self.deft is not None:
                self.deft.check(node, delta, self.replica.specs)
            if self.config.uplink_codec in ("topk", "deft"):
                traffic.note_selection(delta, self.config.min_compress_numel)
            # The client trained from the replica R, but its delta is applied to the exact global
            # model W: the inner strategy then aggregates W + delta_i, so W - R (what 3LC has not
            # yet delivered) survives into the next round's downlink. Rebasing on R would drop it
            # every round and turn 3LC's error accumulation off.
            model = {k: self._target[k] + delta[k] for k in self._target}
        traffic.decode_seconds += time.perf_counter() - t0
        content = RecordDict({k: v for k, v in msg.content.items() if k != keys.UPLINK})
        content[self._arrays_key] = record_from_tensors(model)
        msg.content = content

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        accepted = []
        for msg in replies:
            self._note_node(msg)
            if msg.has_error():
                accepted.append(msg)  # the inner strategy logs and skips it
                continue
            try:
                self._decode_reply(msg, server_round)
            except Exception as exc:
                node = msg.metadata.src_node_id
                if not isinstance(exc, PayloadError | ConfigError):
                    log.exception("fedcomp: unexpected error decoding node %s's update", node)
                    exc = PayloadError("", f"decoder failed: {type(exc).__name__}: {exc}")
                # The client's replica state (checked above) is still good; only this update is
                # lost, like a dropout. Its residual already counted it as sent.
                self._traffic(server_round).rejected[node] = str(exc)
                log.warning("fedcomp: rejected the update of node %s in round %s: %s", node, server_round, exc)
                continue
            accepted.append(msg)
        arrays, metrics = self.strategy.aggregate_train(server_round, accepted)
        if arrays is not None and self._target is not None and (self.gradiveq or self.deft):
            aggregated = tensors_from_record(arrays)
            if self.gradiveq is not None:
                # Compressed-domain rounds: ``aggregated`` holds mean coefficients; one decompression.
                t0 = time.perf_counter()
                model = self.gradiveq.finish(server_round, aggregated, self._target)
                self._traffic(server_round).decode_seconds += time.perf_counter() - t0
                if model is not None:
                    aggregated = model
                    arrays = record_from_tensors(model)
            if self.deft is not None:
                self.deft.observe({k: aggregated[k] - self._target[k] for k in self._target})
        return arrays, metrics

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        replies = list(replies)
        for msg in replies:
            self._note_node(msg)
        return self.strategy.aggregate_evaluate(server_round, replies)

    def summary(self) -> None:
        c = self.config
        log.info(
            "fedcomp: uplink %s (p=%s, %s), downlink %s (s=%s), local iterations %s",
            c.uplink_codec,
            c.sbc_p,
            c.sbc_mode,
            c.downlink_codec,
            c.threelc_s,
            c.local_iters,
        )
        self.strategy.summary()

    def __repr__(self) -> str:
        return f"CompressionStrategy({self.strategy!r})"
