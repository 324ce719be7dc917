"""Client side: a Flower mod that gives any ClientApp compressed traffic both ways.

On a message from :class:`~fedcomp.flower.strategy.CompressionStrategy` it rebuilds the model
from the compressed downlink into an ordinary ArrayRecord, calls the app's handler, and for a
train reply replaces the trained model with an SBC-compressed delta (plus the residual from
earlier rounds). Replica, version and residual persist in ``context.state``: in deployment a
fresh ClientApp process serves every message, so nothing may live in Python globals.

    app = ClientApp(mods=[compression_mod])
"""

from __future__ import annotations

import json
import logging
import time

import torch
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.app.message_type import MessageType  # type: ignore[import-not-found]
from flwr.clientapp.typing import ClientAppCallable  # type: ignore[import-not-found]

from fedcomp.codecs import Codec, DenseFP32, get_codec
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.flower import deft_link, gradiveq_link
from fedcomp.flower import protocol as keys
from fedcomp.flower.records import digest, record_from_tensors, tensors_from_record
from fedcomp.flower.replica import apply_delta
from fedcomp.methods.bandwidth import (
    BandwidthBudget,
    Choice,
    ClientSituation,
    get_policy,
)
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.net.links import LinkProfile, link_of, parse_link_profiles
from fedcomp.wire.serde import update_from_bytes, update_to_bytes

log = logging.getLogger("fedcomp")

#: Error code of a reply that asks the server for a full resync.
RESYNC_ERROR_CODE = 6  # flwr.common.constant.ErrorCode.MOD_FAILED_PRECONDITION


def pick_device(setting: str) -> torch.device:
    """``auto`` means CUDA when present; ``cuda`` without a GPU is a configuration error."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("client-device: 'cuda' was asked for but no CUDA device is available")
    if setting == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


class ClientState:
    """The mod's per-client state, loaded from and saved to ``context.state``."""

    def __init__(self, context: Context, device: torch.device) -> None:
        self.context, self.device = context, device
        state = context.state
        meta = state.config_records.get(keys.STATE_META)
        self.version: int | None = None
        self._digest: str | None = None
        self.replica: dict[str, torch.Tensor] | None = None
        if meta is not None and keys.STATE_REPLICA in state.array_records:
            replica = tensors_from_record(state.array_records[keys.STATE_REPLICA], device)
            if digest(replica) == meta["digest"]:
                self.version, self.replica = int(meta["version"]), replica  # type: ignore[arg-type]
            else:
                log.warning("fedcomp: stored replica fails its digest check; asking for a full resync")
        res = state.array_records.get(keys.STATE_RESIDUAL)
        self.residual = tensors_from_record(res, device) if res is not None else {}

    def digest(self) -> str:
        """The replica's digest, computed once per message: hashing the model costs milliseconds
        per call on a CPU, and the replica does not change after the downlink is applied."""
        assert self.replica is not None
        if self._digest is None:
            self._digest = digest(self.replica)
        return self._digest

    def save(self) -> None:
        state = self.context.state
        if self.replica is None or self.version is None:
            for k in (keys.STATE_REPLICA, keys.STATE_META):
                if k in state:
                    del state[k]
        else:
            state[keys.STATE_REPLICA] = record_from_tensors(self.replica)
            state[keys.STATE_META] = ConfigRecord({"version": self.version, "digest": self.digest()})
        state[keys.STATE_RESIDUAL] = record_from_tensors(self.residual)


def _apply_downlink(st: ClientState, dl: ConfigRecord) -> None:
    """Bring ``st.replica`` to the version the server sent; raise PayloadError when impossible."""
    mode, target, want = str(dl["mode"]), int(dl["version"]), str(dl["digest"])  # type: ignore[arg-type]
    payloads = list(dl.get("payloads", []))  # type: ignore[arg-type]
    if mode == "full":
        if len(payloads) != 1:
            raise PayloadError("", "a full resync carries exactly one payload")
        update = update_from_bytes(payloads[0])
        if update.base_model_version != target:
            raise PayloadError("", f"full replica is version {update.base_model_version}, expected {target}")
        if st.replica is None:
            specs = [_spec_from(t) for t in update.tensors]
        else:
            specs = specs_of(st.replica)
        st.replica = decode_update(update, specs, [DenseFP32()], st.device)
    elif mode == "chain":
        if st.replica is None or st.version is None:
            raise PayloadError("", "a delta chain was sent but this client holds no replica")
        codec = get_codec(str(dl["downlink-codec"]))
        specs, v = specs_of(st.replica), st.version
        for data in payloads:
            apply_delta(st.replica, data, specs, codec, v)
            v += 1
    elif mode != "none":
        raise PayloadError("", f"unknown downlink mode {mode!r}")
    if st.replica is None:
        raise PayloadError("", "no replica after the downlink")
    st._digest = None  # the downlink changed the replica
    got = st.digest()
    if got != want:
        raise PayloadError("", f"replica digest {got} after the downlink, the server has {want}")
    st.version = target


def _spec_from(enc):  # type: ignore[no-untyped-def]
    """A spec for a full replica a new client has never seen: taken from the payload itself,
    bounded by the dense payload's own length (the decoder checks it)."""
    from fedcomp.codecs.base import TensorSpec
    from fedcomp.wire.payloads import TORCH_DTYPES

    return TensorSpec(enc.name, tuple(enc.shape), TORCH_DTYPES[enc.dtype])


def compression_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Decompress the model going in, compress the update coming out (see the module docstring)."""
    if not msg.has_content() or keys.DOWNLINK not in msg.content.config_records:
        return call_next(msg, context)
    dl = msg.content.config_records[keys.DOWNLINK]
    device = pick_device(str(dl.get("device", "auto")))
    st = ClientState(context, device)
    try:
        _apply_downlink(st, dl)
    except PayloadError as exc:
        st.replica, st.version = None, None
        st.save()
        log.warning("fedcomp: %s; asking for a full resync", exc)
        return Message(Error(code=RESYNC_ERROR_CODE, reason=f"fedcomp resync needed: {exc}"), reply_to=msg)
    assert st.replica is not None and st.version is not None
    arrays_key = str(dl["arrays-key"])
    content = RecordDict({k: v for k, v in msg.content.items() if k != keys.DOWNLINK})
    content[arrays_key] = record_from_tensors(st.replica)
    msg.content = content

    is_train = msg.metadata.message_type == MessageType.TRAIN
    uplink_cfg = json.loads(str(dl["uplink-codec"]))
    error_feedback = bool(dl["error-feedback"])
    overrides: dict[str, Codec] | None = None
    try:
        # Before training: a bad allocation or compressor must not cost a round of compute.
        gradiveq_link.store_compressor(context, dl, st.replica)
        if is_train:
            overrides, error_feedback = _uplink_overrides(msg, context, dl, st, uplink_cfg, error_feedback)
    except PayloadError as exc:
        gradiveq_link.forget_compressor(context)
        st.save()
        log.warning("fedcomp: %s", exc)
        return Message(Error(code=RESYNC_ERROR_CODE, reason=f"fedcomp: {exc}"), reply_to=msg)
    plan = _plan_bandwidth(msg, context, dl, st, uplink_cfg) if is_train else None
    t_train = time.perf_counter()
    reply = call_next(msg, context)
    train_seconds = time.perf_counter() - t_train

    status = {
        "replica-version": st.version,
        "replica-digest": st.digest(),
        **gradiveq_link.client_status(context),
    }
    if reply.has_error():
        st.save()
        return reply
    if msg.metadata.message_type == MessageType.TRAIN:
        trained_rec = reply.content.array_records.get(arrays_key)
        if trained_rec is None:
            raise ConfigError(f"the ClientApp's train reply has no ArrayRecord {arrays_key!r}")
        trained = tensors_from_record(trained_rec, device)
        delta = {k: trained[k] - st.replica[k] for k in st.replica}
        encoder = UpdateEncoder(
            # p as the bandwidth policy chose it, if it did; GradiVeQ's codecs are all overrides
            DenseFP32() if uplink_cfg.get("id") == "gradiveq" else get_codec(uplink_cfg),
            min_numel=int(dl["min-compress-numel"]),  # type: ignore[arg-type]
            error_feedback=error_feedback,
        )
        encoder.load_state_dict(st.residual, device)
        t0 = time.perf_counter()
        data = update_to_bytes(encoder.encode(delta, base_model_version=st.version, codecs=overrides))
        seconds = time.perf_counter() - t0
        st.residual = encoder.state_dict()
        out = RecordDict({k: v for k, v in reply.content.items() if k != arrays_key})
        report = _bandwidth_report(context, plan, uplink_cfg, train_seconds)
        out[keys.UPLINK] = ConfigRecord(
            {"payload": data, "encode-seconds": seconds, "device": str(device), **status, **report}
        )
        reply.content = out
    else:
        reply.content[keys.UPLINK] = ConfigRecord(status)
    st.save()
    return reply


def _uplink_overrides(
    msg: Message, context: Context, dl: ConfigRecord, st: ClientState, uplink_cfg: dict, error_feedback: bool
) -> tuple[dict[str, Codec] | None, bool]:
    """Per-tensor codecs of the server-coordinated methods (DEFT partitions, GradiVeQ
    compressors), and whether error feedback applies; raise PayloadError on bad instructions."""
    assert st.replica is not None
    min_numel = int(dl["min-compress-numel"])  # type: ignore[arg-type]
    if deft_link.ALLOCATION_KEY in dl:
        data = dl[deft_link.ALLOCATION_KEY]
        if not isinstance(data, bytes):
            raise PayloadError("", f"{deft_link.ALLOCATION_KEY} is not bytes")
        config = msg.content.config_records.get(str(dl.get("config-key", "config")))
        rnd = config.get("server-round") if config is not None else None
        return (
            deft_link.client_codecs(data, st.replica, min_numel, None if rnd is None else int(rnd)),  # type: ignore[arg-type]
            error_feedback,
        )
    if uplink_cfg.get("id") == "gradiveq":
        # No error feedback: GradiVeQ's paper sends projections without residuals, and what the
        # basis cannot express would pile up in the residual until the next refit.
        return gradiveq_link.client_codecs(context, uplink_cfg, st.replica, min_numel), False
    return None, error_feedback


# --- bandwidth awareness (fedcomp.methods.bandwidth) ---------------------------------------------------


class _Plan:
    """What the mod decided before training: the link, the policy's choice, the iterations."""

    def __init__(self, link: LinkProfile | None, choice: Choice | None, local_iters: int | None) -> None:
        self.link, self.choice, self.local_iters = link, choice, local_iters


def _plan_bandwidth(
    msg: Message, context: Context, dl: ConfigRecord, st: ClientState, uplink_cfg: dict
) -> _Plan | None:
    """Pick this round's p (into ``uplink_cfg``) and local iterations (into the train config)."""
    if "bandwidth" not in dl:
        return None  # a server without bandwidth awareness
    budget = BandwidthBudget.from_json(str(dl["bandwidth"]))
    link = link_of(context.node_config, parse_link_profiles(budget.link_profiles), where="node config")
    config_key = str(dl.get("config-key", "config"))
    config = msg.content.config_records.get(config_key)
    iters = int(config[keys.LOCAL_ITERS]) if config is not None and keys.LOCAL_ITERS in config else None  # type: ignore[arg-type]
    if uplink_cfg.get("id") != "sbc" or not budget.active or st.replica is None:
        return _Plan(link, None, iters)
    seconds_per_iter = budget.seconds_per_iter or _measured_seconds_per_iter(context)
    situation = ClientSituation(
        link=link,
        tensors=tuple((name, t.numel()) for name, t in st.replica.items()),
        min_numel=int(dl["min-compress-numel"]),  # type: ignore[arg-type]
        p=float(uplink_cfg["p"]),
        local_iters=iters if iters is not None else 1,
        downlink_bytes=sum(len(b) for b in dl.get("payloads", [])),  # type: ignore[arg-type]
        seconds_per_iter=seconds_per_iter,
    )
    choice = get_policy(budget.policy).choose(budget, situation)
    uplink_cfg["p"] = float(min(0.5, max(choice.p, 1e-12)))
    if config is not None and iters is not None and choice.local_iters != iters:
        # A copy: the config record may be shared with other messages.
        msg.content[config_key] = ConfigRecord({**config, keys.LOCAL_ITERS: int(choice.local_iters)})
        iters = int(choice.local_iters)
    return _Plan(link, choice, iters)


def _bandwidth_report(context: Context, plan: _Plan | None, uplink_cfg: dict, train_seconds: float) -> dict:
    """The uplink record's report of this round; remembers seconds per iteration for the next."""
    out: dict = {"train-seconds": float(train_seconds)}
    if uplink_cfg.get("id") == "sbc":
        out["sbc-p"] = float(uplink_cfg["p"])
    if plan is None:
        return out
    if plan.local_iters is not None:
        out["local-iters"] = int(plan.local_iters)
        # The fastest seen: a first call's warm-up (imports, data loading) must not stick.
        measured = train_seconds / max(1, plan.local_iters)
        best = _measured_seconds_per_iter(context)
        context.state[keys.STATE_BANDWIDTH] = ConfigRecord(
            {"seconds-per-iter": min(measured, best) if best else measured}
        )
    if plan.link is not None:
        out.update(plan.link.to_node_config())
    if plan.choice is not None:
        c = plan.choice
        out.update({"estimated-bytes": int(c.estimated_bytes), "fits": bool(c.fits)})
        if c.budget_bytes is not None:
            out["budget-bytes"] = int(c.budget_bytes)
    return out


def _measured_seconds_per_iter(context: Context) -> float:
    rec = context.state.config_records.get(keys.STATE_BANDWIDTH)
    return float(rec.get("seconds-per-iter", 0.0)) if rec is not None else 0.0  # type: ignore[arg-type]
