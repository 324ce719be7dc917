"""The GradiVeQ uplink method: compressors, phases, aggregation in the compressed domain.

Rounds alternate as in the paper's Fig. 6, with rounds for iterations: ``gradiveq-dense-rounds``
uncompressed rounds (clients send dense fp32 updates; the server keeps them as PCA samples), then
the server fits one compressor per tensor (:func:`fedcomp.methods.gradiveq.fit_compressor`) and
``gradiveq-refresh`` compressed rounds follow (0: compressed for good), then the cycle repeats
with a new compressor version. The compressor goes down, as protobuf bytes in the downlink record,
to every client whose last reply did not report holding its version; clients keep it in
``context.state``.

In compressed rounds clients send projection coefficients. When the inner strategy aggregates by
FedAvg's weighted mean, the server hands it the coefficients themselves and decompresses the mean
once (:meth:`GradiVeQUplink.finish`): the compressor is linear (affine with the whitening
vector, which a weighted mean with weights summing to one preserves), so this equals the mean of
the decompressed updates. Any other inner strategy gets each client's decompressed model.

Tensors under ``min-compress-numel``, and those the fit gives no dimension, go dense fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fedcomp.codecs import Codec, DenseFP32, TensorSpec
from fedcomp.codecs.gradiveq import GradiVeQ, coefficients_of
from fedcomp.errors import PayloadError, shown
from fedcomp.methods.base import ClientRound, Decoded, StateStore, UplinkMethod, extra_key
from fedcomp.methods.gradiveq import Compressor, decompress, fit_compressor
from fedcomp.methods.statistics import sent_dense
from fedcomp.methods.update import decode_update, specs_of
from fedcomp.wire.payloads import EncodedUpdate
from fedcomp.wire.serde import compressor_from_bytes, compressor_to_bytes

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from fedcomp.methods.config import CompressionConfig


class GradiVeQUplink(UplinkMethod):
    """GradiVeQ (Yu et al. 2018): PCA coefficients of each slice, aggregated without
    decompressing when the inner strategy's aggregation is FedAvg's weighted mean.

    Server side: phase of each round, PCA samples, the current compressor, aggregation. No error
    feedback: the paper sends projections without residuals, and what the basis cannot express
    would pile up in the residual until the next refit."""

    method_id = "gradiveq"
    error_feedback = False
    #: Key of the compressor bytes in the downlink extras, and of the version in the uplink status.
    COMPRESSOR_KEY = extra_key("gradiveq", "compressor")
    VERSION_KEY = extra_key("gradiveq", "version")

    def __init__(self, config: CompressionConfig, weighted_mean: bool = True) -> None:
        super().__init__(config, weighted_mean)
        self.compressor: Compressor | None = None
        self.version = 0
        self._wire: bytes = b""
        self._samples: dict[str, list[torch.Tensor]] = {}
        #: A dense round's decoded replies, (round, node) -> samples, until the server accepts them.
        self._pending: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._nodes: dict[int, int] = {}  # node -> compressor version it reported holding
        self._domain: dict[int, bool] = {}  # round -> aggregated in the compressed domain

    @classmethod
    def codec_config(cls, config: CompressionConfig, server_round: int) -> dict[str, Any]:
        """Before the server's first fit: dense (the updates are the PCA samples)."""
        return {"id": "dense-fp32"}

    @classmethod
    def summary(cls, config: CompressionConfig) -> str:
        c = config
        return (
            f"gradiveq (eps={c.gradiveq_eps}, dense rounds {c.gradiveq_dense_rounds}, "
            f"refresh {c.gradiveq_refresh}, slice {c.gradiveq_slice or 'fan-in'})"
        )

    def state_dict(self) -> dict[str, Any]:
        """As the base class, but the compressor as its broadcast bytes (``_wire``): the
        compressor object holds read-only mappings that do not pickle."""
        return {**super().state_dict(), "compressor": None}

    def load_state_dict(self, state: Mapping[str, Any], specs: Sequence[TensorSpec]) -> None:
        super().load_state_dict(state, specs)
        self.compressor = None
        if self._wire:
            # The server decompresses with exactly what the clients rebuilt from the same bytes.
            self.compressor = Compressor.from_wire(compressor_from_bytes(self._wire), specs)

    # --- phases ---------------------------------------------------------------------------------

    def _cycle_position(self, server_round: int) -> int:
        d, r = self.config.gradiveq_dense_rounds, self.config.gradiveq_refresh
        return server_round - 1 if r == 0 else (server_round - 1) % (d + r)

    def compressed(self, server_round: int) -> bool:
        """Whether clients send coefficients this round (never before the first fit)."""
        return self.compressor is not None and self._cycle_position(server_round) >= self.config.gradiveq_dense_rounds

    def reply_is_update(self, server_round: int) -> bool:
        """Dense rounds (the samples) carry the update; compressed ones carry coefficients."""
        return not self.compressed(server_round)

    def round_codec_config(self, server_round: int) -> dict[str, Any]:
        if self.compressed(server_round):
            return {"id": "gradiveq", "version": self.version}
        return {"id": "dense-fp32"}

    def downlink_extras(
        self, server_round: int, nodes: Sequence[int], specs: Sequence[TensorSpec]
    ) -> dict[int, dict[str, bytes]]:
        """The compressor, to the nodes that do not report holding its version."""
        if not self.compressed(server_round):
            return {}
        return {n: {self.COMPRESSOR_KEY: self._wire} for n in nodes if self._nodes.get(n) != self.version}

    def note_node(self, node: int, status: Mapping[str, int] | None) -> None:
        held = status.get(self.VERSION_KEY) if status is not None else None
        if held is None:
            self._nodes.pop(node, None)
        else:
            self._nodes[node] = int(held)

    def round_metrics(self, server_round: int) -> dict[str, Any]:
        return {"gradiveq_version": self.version, "gradiveq_compressed": self.compressed(server_round)}

    # --- uplink ---------------------------------------------------------------------------------

    def decode(
        self,
        update: EncodedUpdate,
        specs: Sequence[TensorSpec],
        model: Mapping[str, torch.Tensor],
        server_round: int,
        node: int,
    ) -> Decoded:
        """What the inner strategy gets for one reply (raises PayloadError on a bad update):
        ``W + delta``, or in compressed-domain rounds the coefficients (dense tensors: delta)."""
        if not self.compressed(server_round):
            delta = decode_update(update, specs, [DenseFP32()])
            # samples of the next fit once the server accepted the reply (accept): one it rejects
            # (NaN, over max-update-norm) would make every client's next basis NaN or useless
            self._pending[(server_round, node)] = {
                s.name: delta[s.name].reshape(-1)
                for s in specs
                if not sent_dense(s.name, s.numel, self.config.min_compress_numel)
            }
            for s in specs:
                if not sent_dense(s.name, s.numel, self.config.min_compress_numel):
                    self._shapes[s.name] = s.shape
            self._domain[server_round] = False
            return Decoded({k: model[k] + delta[k] for k in model}, delta)
        assert self.compressor is not None
        compressed_domain = self.weighted_mean
        if len(update.tensors) != len(specs):
            raise PayloadError("", f"update has {len(update.tensors)} tensors, expected {len(specs)}")
        out: dict[str, torch.Tensor] = {}
        # The update in model space, for the server's norm checks (max-update-norm, a DP clipping
        # norm): at hand outside the compressed domain; inside it, decompressed only when
        # max-update-norm (or its factor) asks (what the compressed domain saves is that decompression).
        model_delta: dict[str, torch.Tensor] | None = (
            {} if not compressed_domain or self.config.bounds_update_norm else None
        )
        dense = DenseFP32()
        for spec, enc in zip(specs, update.tensors, strict=True):
            if enc.name != spec.name:
                raise PayloadError(spec.name, f"found tensor {shown(enc.name)} in its place")
            if self.compressor.compresses(spec.name):
                if enc.codec_id != GradiVeQ.codec_id:
                    raise PayloadError(spec.name, f"codec {enc.codec_id!r} where 'gradiveq' was expected")
                coeffs = coefficients_of(enc, spec, self.compressor)
                if compressed_domain:
                    out[spec.name] = coeffs
                if model_delta is not None:
                    d = decompress(self.compressor, spec.name, coeffs, spec.numel).reshape(spec.shape)
                    model_delta[spec.name] = d
                    if not compressed_domain:
                        out[spec.name] = model[spec.name] + d
            else:
                dense_delta = dense.decode(enc, spec)
                if model_delta is not None:
                    model_delta[spec.name] = dense_delta
                out[spec.name] = dense_delta if compressed_domain else model[spec.name] + dense_delta
        self._domain[server_round] = compressed_domain
        return Decoded(out, model_delta)

    def accept(self, server_round: int, node: int) -> None:
        for name, sample in self._pending.pop((server_round, node), {}).items():
            self._samples.setdefault(name, []).append(sample)

    def finish(
        self, server_round: int, aggregated: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]
    ) -> dict[str, torch.Tensor] | None:
        """After the inner strategy aggregated: the new model when it aggregated coefficients
        (one decompression per tensor), else None; fits a new compressor at a cycle's end."""
        out = None
        if self._domain.pop(server_round, False):
            assert self.compressor is not None
            out = {}
            for name, w in model.items():
                agg = aggregated[name]
                if self.compressor.compresses(name):
                    agg = decompress(self.compressor, name, agg, w.numel(), weight_sum=1.0).reshape(w.shape)
                out[name] = w + agg
        self._pending = {k: v for k, v in self._pending.items() if k[0] > server_round}  # (rejected ones)
        if self._cycle_position(server_round) == self.config.gradiveq_dense_rounds - 1 and self._samples:
            self._fit(specs_of(model))
        return out

    def _slice_sizes(self) -> int | dict[str, int]:
        if self.config.gradiveq_slice:
            return self.config.gradiveq_slice
        return {name: fan_in(shape) for name, shape in self._shapes.items()}

    def _fit(self, specs: Sequence[TensorSpec]) -> None:
        """A new compressor from the cycle's samples, for the model ``specs`` describes; where it
        comes out unusable (a basis that is not finite: accepted samples so large that their
        covariance overflows, possible without ``max-update-norm``), the one before stays, with a
        warning, and the clients go on."""
        samples, self._samples = self._samples, {}
        c = self.config
        try:
            compressor = fit_compressor(
                samples,
                version=self.version + 1,
                slice_size=self._slice_sizes(),
                eps=c.gradiveq_eps,
                max_dim=c.gradiveq_max_dim or None,
                min_numel=c.min_compress_numel,
            )
            wire = compressor_to_bytes(compressor.to_wire())
            Compressor.from_wire(compressor_from_bytes(wire), specs)  # (the clients' check)
        except (PayloadError, ValueError, RuntimeError) as exc:  # (torch's linalg errors are RuntimeErrors)
            log.warning(
                "fedcomp: GradiVeQ: no new compressor from this cycle's samples (%s); keeping version %d",
                exc,
                self.version,
            )
            return
        self.version += 1
        self.compressor, self._wire = compressor, wire

    # --- client ----------------------------------------------------------------------------------

    @classmethod
    def client_receive(cls, rnd: ClientRound) -> None:
        """Validate a compressor the server sent against the replica's shapes and keep its bytes."""
        data = rnd.extras.get(cls.COMPRESSOR_KEY)
        if data is None:
            return
        comp = Compressor.from_wire(compressor_from_bytes(data), specs_of(rnd.replica))
        rnd.state.save({"compressor": data, "version": comp.version})

    @classmethod
    def client_status(cls, state: StateStore) -> dict[str, int]:
        held = state.load()
        return {} if held is None else {cls.VERSION_KEY: int(held["version"])}

    @classmethod
    def client_keeps_sent(cls, error_feedback: bool) -> bool:
        """No: GradiVeQ keeps no residual (the paper sends projections without one), so an update
        that was not aggregated is lost, as a dropped client's is in FedAvg. Re-sending it in the
        next update would project it onto a basis that may have been refit in between, and in a
        dense round it would skew the next fit's samples."""
        return False

    @classmethod
    def client_codecs(cls, rnd: ClientRound) -> tuple[Codec, dict[str, Codec] | None]:
        """GradiVeQ codecs for the tensors the held compressor covers (the rest go dense)."""
        if rnd.codec_config.get("id") != "gradiveq":
            return DenseFP32(), None  # a dense round: the updates are the next fit's samples
        held = rnd.state.load()
        want = int(rnd.codec_config.get("version", -1))
        if held is None or int(held["version"]) != want:
            raise PayloadError("", f"GradiVeQ compressor version {want} is needed and not held")
        comp = Compressor.from_wire(compressor_from_bytes(held["compressor"]), specs_of(rnd.replica))
        codecs: dict[str, Codec] = {
            name: GradiVeQ(comp)
            for name, t in rnd.replica.items()
            if not sent_dense(name, t.numel(), rnd.min_numel) and comp.compresses(name)
        }
        return DenseFP32(), codecs


def fan_in(shape: Sequence[int], cap: int = 4096) -> int:
    """Values feeding one output unit (``prod(shape[1:])``), capped; a vector's own length."""
    n = 1
    for d in shape[1:] if len(shape) > 1 else shape:
        n *= int(d)
    return max(2, min(n, cap))
