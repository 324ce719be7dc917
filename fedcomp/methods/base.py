"""The contract every uplink and downlink method fulfils, so the Flower layer never names one.

An **uplink method** (client -> server) says which codec clients encode with each round, may send
each client bytes of its own before training (a DEFT allocation, a GradiVeQ compressor), decodes
each reply into what the inner strategy aggregates, and may post-process the aggregate (GradiVeQ
decompresses the mean of coefficients once). Server-side hooks are instance methods: the wrapper
holds one instance per run, which may keep state across rounds. Client-side hooks are class
methods: on the client a fresh process may serve every message, so a method's client state lives
in the :class:`StateStore` the mod hands it (backed by Flower's ``context.state``).

A **downlink method** (server -> clients) only says which codec compresses each round's delta.

Adding a method is one file with a subclass and one line in :mod:`fedcomp.methods.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from fedcomp.codecs import Codec, DenseFP32, TensorSpec, get_codec
from fedcomp.methods.update import decode_update
from fedcomp.wire.payloads import EncodedUpdate

#: One tensor of a decoded delta as :meth:`UplinkMethod.check_sent` gets it and the server's
#: running sum adds it (``fedcomp.flower.weighted_sum``): dense, or (positions, the one value they
#: share) for an SBC tensor, or (positions, their values) for a top-k or STC one, never expanded
#: to the tensor's size.
SentTerm = torch.Tensor | tuple[torch.Tensor, float | torch.Tensor]


def sent_positions(term: SentTerm) -> torch.Tensor:
    """The ascending positions (into the flattened tensor) of a term's non-zero values: what a
    client selected, seen as the dense decode sees it (a value that is zero selects nothing)."""
    if not isinstance(term, tuple):
        return term.reshape(-1).nonzero().view(-1)
    idx, values = term
    if isinstance(values, torch.Tensor):
        return idx[values != 0]
    return idx if values != 0 else idx[:0]


if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig

__all__ = ["ClientRound", "Decoded", "DownlinkMethod", "StateStore", "UplinkMethod", "extra_key"]

Tensors = dict[str, torch.Tensor]


def extra_key(method_id: str, name: str) -> str:
    """Key of a method's own value in the downlink extras or the uplink status: namespaced by
    the method's id, so methods never collide with each other or with the protocol's fields."""
    return f"{method_id}.{name}"


class StateStore(Protocol):
    """A method's own persistent values on one client (bytes, ints, floats, strings)."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, values: Mapping[str, Any]) -> None: ...

    def clear(self) -> None: ...


@dataclass(frozen=True)
class ClientRound:
    """What a method sees on the client when a message arrives (before the app trains)."""

    #: The codec config the server chose for this round's uplink.
    codec_config: dict[str, Any]
    replica: Mapping[str, torch.Tensor]
    min_numel: int
    #: The round number from the train config (None when the message has none).
    server_round: int | None
    #: The method's bytes for this client in the downlink (keys from ``protocol.extra_key``).
    extras: Mapping[str, bytes]
    state: StateStore


@dataclass
class Decoded:
    """One reply, decoded: ``arrays`` for the inner strategy (normally ``W + delta``) and the
    update itself when the method has one in model space."""

    arrays: Tensors
    delta: Tensors | None = None


class UplinkMethod:
    """Base class: a stateless codec, every tensor the same way (override what differs)."""

    #: Registry id; also the value of the ``uplink-codec`` run-config key.
    method_id: ClassVar[str]
    #: Whether the client keeps residuals (error feedback) for this method.
    error_feedback: ClassVar[bool] = True
    #: Whether the bandwidth policy may pick this method's ``p`` per client and round.
    adapts_p: ClassVar[bool] = False
    #: Whether replies are sparse selections whose union the server reports (aggregate density).
    reports_selection: ClassVar[bool] = False
    #: Whether :meth:`decode` is the base class's followed by :meth:`check_sent` alone: a server
    #: summing replies then decodes them sparsely (never ``W + delta``) and calls
    #: :meth:`check_sent` on what it decoded.
    checks_sent: ClassVar[bool] = False

    def check_sent(self, node: int, delta: Mapping[str, SentTerm], specs: Sequence[TensorSpec]) -> None:
        """Raise :class:`~fedcomp.errors.PayloadError` when ``node``'s decoded ``delta`` breaks
        this method's rules (with :attr:`checks_sent`). Each tensor is dense, or (its strictly
        ascending positions, their float32 values or the one value they share): what the
        server's running sum adds. Default: nothing to check."""

    def __init__(self, config: CompressionConfig, weighted_mean: bool = True) -> None:
        """Server side. ``weighted_mean``: the inner strategy aggregates by FedAvg's weighted
        mean of the replies' arrays (what linear methods can exploit)."""
        self.config = config
        self.weighted_mean = weighted_mean

    #: Attributes rebuilt from the config, never part of :meth:`state_dict`.
    CONFIG_ATTRIBUTES: ClassVar[tuple[str, ...]] = ("config", "weighted_mean")

    def state_dict(self) -> dict[str, Any]:
        """The server side's state across rounds, for a checkpoint (``torch.save``-able): every
        attribute but the config ones. Override when an attribute cannot be pickled."""
        return {k: v for k, v in vars(self).items() if k not in self.CONFIG_ATTRIBUTES}

    def load_state_dict(self, state: Mapping[str, Any], specs: Sequence[TensorSpec]) -> None:
        """Restore :meth:`state_dict`'s values (``specs``: the model's tensors, for state that is
        rebuilt and checked against them)."""
        for k, v in state.items():
            setattr(self, k, v)

    # --- configuration (both sides) ------------------------------------------------------------

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        """The codec config clients encode with in ``server_round``."""
        raise NotImplementedError

    @classmethod
    def summary(cls, config: CompressionConfig) -> str:
        """One line for the run's log: the method and its settings."""
        return f"{cls.method_id} {cls.codec_config(config, 1)}"

    # --- server ----------------------------------------------------------------------------------

    def round_codec_config(self, server_round: int) -> dict[str, Any]:
        """The codec config the server sends in ``server_round`` (may depend on server state)."""
        return self.codec_config(self.config, server_round)

    def downlink_extras(
        self, server_round: int, nodes: Sequence[int], specs: Sequence[TensorSpec]
    ) -> dict[int, dict[str, bytes]]:
        """Bytes of its own for each node of a train round (counted as downlink traffic).
        ``nodes`` come in the order the server's grid lists them (by partition under
        :class:`~fedcomp.flower.sampling.SeededSampling`), the order a method that ranks its
        clients follows."""
        return {}

    def note_node(self, node: int, status: Mapping[str, int] | None) -> None:
        """What a client reported holding (``None``: it erred or sent nothing usable)."""

    def decode(
        self,
        update: EncodedUpdate,
        specs: Sequence[TensorSpec],
        model: Mapping[str, torch.Tensor],
        server_round: int,
        node: int,
    ) -> Decoded:
        """One reply for the inner strategy; raise ``PayloadError`` on a bad update.

        The client trained from the replica R, but its delta is applied to the exact global model
        W: the inner strategy then aggregates ``W + delta_i``, so ``W - R`` (what the lossy
        downlink has not yet delivered) survives into the next round's downlink. Rebasing on R
        would drop it every round and turn 3LC's error accumulation off.
        """
        codec = get_codec(self.round_codec_config(server_round))
        delta = decode_update(update, specs, [codec, DenseFP32()])
        return Decoded({k: model[k] + delta[k] for k in model}, delta)

    def decodes_as_base(self) -> bool:
        """Whether :meth:`decode` is the base class's (W + delta, the round's codec), possibly
        followed by :meth:`check_sent` (DEFT's allocation): the server can then read every reply
        sparse, never as W + delta. Not GradiVeQ, which decodes by itself."""
        return getattr(self.decode, "__func__", None) is UplinkMethod.decode or self.checks_sent

    def reply_is_update(self, server_round: int) -> bool:
        """Whether a reply of ``server_round`` is the client's update encoded by the round's codec
        (or dense fp32), so the server can read its norm without this method's decode: the first
        round's norm bound is set from the replies' median before any is decoded. Default:
        :meth:`decodes_as_base`."""
        return self.decodes_as_base()

    def note_extras(self, server_round: int, node: int, extras: Mapping[str, bytes]) -> None:
        """The bytes of its own a train reply of ``node`` carries (keys from :func:`extra_key`,
        what :meth:`client_extras` returned), before the reply is decoded; raise
        :class:`~fedcomp.errors.PayloadError` when they are unusable (the reply is rejected). A
        method keeps them only once :meth:`accept` says the reply passed every check."""

    def accept(self, server_round: int, node: int) -> None:
        """The reply of ``node`` that :meth:`decode` read in ``server_round`` passed every check of
        the server's (finite values, norm bound, structure): a method that learns from replies
        (GradiVeQ's samples) takes it only now, so a rejected reply teaches it nothing."""

    def finish(
        self, server_round: int, aggregated: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]
    ) -> Tensors | None:
        """After the inner strategy aggregated: a replacement for its result, or None."""
        return None

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        """Per-round figures of the method's own for the results (JSON-able)."""
        return {}

    # --- client ----------------------------------------------------------------------------------

    @classmethod
    def client_receive(cls, rnd: ClientRound) -> None:
        """Every message, before the app runs: validate and keep the method's downlink bytes.
        Raise ``PayloadError`` when they are unusable (the client then asks for a resync)."""

    @classmethod
    def client_codecs(cls, rnd: ClientRound) -> tuple[Codec, dict[str, Codec] | None]:
        """Train messages: the default codec and per-tensor overrides (None: no overrides)."""
        return get_codec(rnd.codec_config), None

    @classmethod
    def client_extras(
        cls, rnd: ClientRound, residual: Mapping[str, torch.Tensor], update: Mapping[str, torch.Tensor]
    ) -> dict[str, bytes]:
        """Train messages, after encoding: bytes of the method's own for the reply (keys from
        :func:`extra_key`; the server's :meth:`note_extras` reads them). ``residual`` is the one
        the update was encoded with (empty without error feedback), ``update`` this round's local
        update. Default: none."""
        return {}

    @classmethod
    def client_status(cls, state: StateStore) -> dict[str, int]:
        """Small values the client reports in every reply (keys from ``protocol.extra_key``)."""
        return {}

    @classmethod
    def client_keeps_sent(cls, error_feedback: bool) -> bool:
        """Whether the client keeps each update it sends until the server says whether it was
        aggregated (protocol 2), to recover it with :meth:`client_recover` when it was not.
        ``error_feedback``: residuals are on for this run and this method.

        Default: exactly when the client keeps residuals. A method without them has nowhere to
        put a lost update, so losing one is a no-op there (as a dropped client is in FedAvg)."""
        return error_feedback

    @classmethod
    def client_recover(
        cls, lost: Mapping[str, torch.Tensor], residual: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The residual to keep after an update of this client was not aggregated (rejected,
        timed out or dropped); ``lost`` is that update as the server would have decoded it.

        Default: add it to the residual, so the next update carries it and, per client,
        ``sum(aggregated updates) + residual == sum(local updates)`` holds (float32 rounding
        aside). Tensors the residual does not have yet (those sent dense) start from ``lost``."""
        out = dict(residual)
        for name, t in lost.items():
            out[name] = out[name] + t.to(out[name].device) if name in out else t.detach().clone()
        return out

    @classmethod
    def client_forget(cls, state: StateStore) -> None:
        """Drop the method's client state (after an error that needs a resync)."""
        state.clear()

    @classmethod
    def with_p(cls, codec_config: Mapping[str, Any], p: float) -> dict[str, Any]:
        """The codec config with the bandwidth policy's ``p`` (methods with ``adapts_p``)."""
        raise NotImplementedError(f"{cls.method_id} does not adapt p")

    @classmethod
    def p_of(cls, codec_config: Mapping[str, Any]) -> float:
        """The ``p`` in a codec config (methods with ``adapts_p``)."""
        raise NotImplementedError(f"{cls.method_id} does not adapt p")


class DownlinkMethod:
    """A downlink method: the codec of each round's replica delta, shared by all clients."""

    #: Registry id; also the value of the ``downlink-codec`` run-config key.
    method_id: ClassVar[str]

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def summary(cls, config: CompressionConfig) -> str:
        return f"{cls.method_id} {cls.codec_config(config, 1)}"
