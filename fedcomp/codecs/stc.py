"""Sparse Ternary Compression (Sattler, Wiedemann, Müller, Samek 2019, arXiv:1903.02891): an uplink codec.

Algorithm 1 of the paper ("STC_k"), per tensor: keep the ``k = max(1, round(p * n))`` entries
of largest magnitude (``min(k, n)``; ties at the boundary go to the lowest index), let ``mu`` be
the mean of their absolute values, and send ``sign(T_i) * mu`` for every kept ``i``: one
magnitude per tensor, one sign bit per kept entry, the positions Golomb-Rice coded exactly as
SBC's (:mod:`fedcomp.codecs.golomb`). Unlike SBC, which keeps only the side (positive or
negative) with the larger mean, STC keeps both signs.

Entries equal to zero are never kept: ``sign(0) = 0`` sends nothing, so a tensor with fewer
than ``k`` non-zero entries keeps all of them (``nnz < k``) and ``mu`` is the mean over those.
Wherever the tensor has at least ``k`` non-zero entries (every real update) this is the paper's
algorithm exactly; in the degenerate case it keeps ``sum |decoded| = sum |kept entries|``, the
invariant the paper's ``mu`` is chosen for (its ``1/k`` would shrink ``mu`` by ``nnz / k``).

Determinism: the bytes depend on the values only (never on the device, the thread count or the
reduction order). ``mu`` is the exact mean rounded once to the nearest float32 (ties to even),
with SBC's exact summation. ``mode="exact"`` (the default) selects exactly as
:func:`fedcomp.codecs.topk.topk_positions`; ``mode="fast"`` estimates the magnitude threshold
from SBC's deterministic sample (the paper's suggestion, as in :class:`~fedcomp.codecs.sbc.SBC`)
and keeps ``|x| >= threshold`` in one pass, falling back to exact mode on degenerate tensors.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec, TensorSpec, check_wire_dtype, expect_payload
from fedcomp.codecs.golomb import decode_positions, encode_positions, golomb_b
from fedcomp.codecs.sbc import (
    _exact_sum,
    _round_f32,
    _sample_positions,
    _threshold_select_cpu,
    _threshold_select_torch,
    check_selection_params,
)
from fedcomp.codecs.topk import topk_positions
from fedcomp.errors import PayloadError
from fedcomp.wire.payloads import EncodedTensor, Payload, STCPayload


class STC(Codec):
    """Sparse Ternary Compression of one tensor: the top fraction ``p`` by magnitude, as
    ``+-mu`` (Algorithm 1 of Sattler et al. 2019).

    ``p`` is in ``(0, 1]``; ``k = max(1, round(p * numel))`` (Python's ``round``: half to even),
    at most ``numel``. ``mode="exact"`` keeps exactly the ``k`` largest magnitudes, ties to the
    lowest index (compared with a plain Python reference in the tests). ``mode="fast"`` keeps
    ``|x| >= t`` for a threshold ``t`` estimated from a deterministic sample of ``sample_size``
    entries (default ``ceil(256 / p)``, SBC's sample positions): the kept count strays from
    ``k`` by a few percent (as SBC's fast mode per side); a tensor of at most ``sample_size``
    elements, a threshold of zero, or a selection of none or more than ``2 k`` entries falls
    back to exact mode. ``mu`` and the coding are those of exact mode.

    Inputs must be finite: exact mode raises :class:`ValueError` on any NaN or infinity; fast
    mode on infinities and on sampled or selected NaNs (a NaN neither sampled nor selected goes
    unnoticed, as in SBC's fast mode).

    :meth:`encode` skips the dense reconstruction; :meth:`encode_with_reconstruction` (what
    error feedback calls) builds it as zeros plus ``+-mu`` at the kept positions.
    """

    codec_id = "stc"
    version = 1

    def __init__(self, p: float = 0.01, mode: str = "exact", sample_size: int | None = None) -> None:
        self.p, self.mode, self.sample_size = check_selection_params(p, mode, sample_size, p_max=1.0)

    def _params(self) -> dict[str, Any]:
        return {"p": self.p, "mode": self.mode, "sample_size": self.sample_size}

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor, name: str = "") -> EncodedTensor:
        """Compress ``tensor`` without building the dense reconstruction (only error feedback
        needs it)."""
        check_wire_dtype(tensor, name)
        payload, _, _ = self._payload(self._flatten(tensor, name), name)
        return self._envelope(tensor, name, payload)

    def encode_sparse(
        self, tensor: torch.Tensor, name: str = ""
    ) -> tuple[EncodedTensor, np.ndarray, np.ndarray] | None:
        """:meth:`encode`, with what the receiver will decode said sparsely: the kept positions
        (ascending int64, into the flattened tensor) and their float32 values, ``+-mu`` (zeros
        elsewhere), for error feedback and a client's pending update
        (:class:`fedcomp.methods.sent.KeptValues`). None off CPU."""
        if tensor.device.type != "cpu":
            return None
        check_wire_dtype(tensor, name)
        payload, idx, negative = self._payload(self._flatten(tensor, name), name)
        mu = np.float32(payload.mu)
        values = np.where(negative, -mu, mu).astype(np.float32, copy=False)
        return self._envelope(tensor, name, payload), idx.numpy(), values

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        payload, idx, negative = self._payload(flat, name)
        recon = torch.zeros(flat.numel(), dtype=torch.float32, device=flat.device)
        if idx.numel():
            vals = torch.full((idx.numel(),), payload.mu, dtype=torch.float32, device=flat.device)
            vals[torch.from_numpy(negative).to(flat.device)] = -payload.mu
            recon.index_copy_(0, idx, vals)
        return payload, recon

    def _payload(self, flat: torch.Tensor, name: str) -> tuple[STCPayload, torch.Tensor, np.ndarray]:
        """The payload, the kept positions (ascending, on ``flat``'s device) and their signs
        (a NumPy bool array, True where negative)."""
        n = flat.numel()
        if n == 0:
            return _EMPTY, torch.zeros(0, dtype=torch.int64, device=flat.device), np.zeros(0, dtype=bool)
        k = min(n, max(1, round(self.p * n)))
        chosen = None
        if self.mode == "fast" and n > self.sample_size:
            chosen = self._fast_select(flat, k)
        if chosen is None:
            chosen = _exact_select(flat, k, name)
        idx, vals = chosen
        nnz = idx.numel()
        if nnz == 0:
            return _EMPTY, idx, np.zeros(0, dtype=bool)
        total = _exact_sum(np.abs(vals))
        assert total is not None  # every kept value is finite
        mu = _round_f32(total, nnz << 149)
        negative = np.signbit(vals)
        b = golomb_b(nnz / n)
        payload = STCPayload(
            mu=mu, golomb_b=b, nnz=nnz, bits=encode_positions(idx, b), signs=np.packbits(negative).tobytes()
        )
        return payload, idx, negative

    def _fast_select(self, flat: torch.Tensor, k: int) -> tuple[torch.Tensor, np.ndarray] | None:
        """Positions and values of ``|x| >= t`` for the sampled threshold ``t``, or None to fall
        back to exact mode."""
        n, s = flat.numel(), self.sample_size
        sample = np.abs(flat.index_select(0, _sample_positions(n, s, str(flat.device))).cpu().numpy())
        if not np.isfinite(sample).all():
            return None  # a NaN or infinity: exact mode reports it
        r = max(1, round(self.p * s))
        sample.partition(s - r)
        thr = sample[s - r]
        if not thr > 0:  # zeros among the largest sampled magnitudes: too few non-zeros
            return None
        found: tuple[Any, np.ndarray, Any, np.ndarray] | None
        if flat.device.type == "cpu":
            found = _threshold_select_cpu(flat.numpy(), thr, -thr, limit=4 * k)
        else:
            found = _threshold_select_torch(flat, thr, -thr, limit=4 * k)
        if found is None:
            return None
        hi, hi_vals, lo, lo_vals = found
        if not 0 < len(hi) + len(lo) <= 2 * k:
            return None
        if not (np.isfinite(hi_vals).all() and np.isfinite(lo_vals).all()):
            return None  # an infinity: exact mode reports it
        # x >= t and x <= -t are disjoint (t > 0) and each ascending: merge them
        if isinstance(hi, np.ndarray) and isinstance(lo, np.ndarray):
            pos = np.concatenate([hi, lo])
            order = np.argsort(pos, kind="stable")
            idx = torch.from_numpy(pos[order]).to(flat.device)
        else:
            assert isinstance(hi, torch.Tensor) and isinstance(lo, torch.Tensor)
            pos_t = torch.cat([hi, lo])
            order_t = torch.argsort(pos_t, stable=True)
            idx, order = pos_t[order_t], order_t.cpu().numpy()
        return idx, np.concatenate([hi_vals, lo_vals])[order]

    # --- decoding -----------------------------------------------------------------------------

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        idx, vals = self._decode_values(payload, spec, device)
        out = torch.zeros(spec.numel, dtype=torch.float32, device=device)
        if vals.numel():
            out.index_copy_(0, idx, vals)
        return out

    def decode_sparse(self, payload: Payload, spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder without its dense output (on the CPU): the kept positions (strictly
        ascending int64) and their float32 values ``+-mu``, after every payload check of
        :meth:`decode` but the envelope's (a server summing replies adds these instead of
        materialising)."""
        return self._decode_values(payload, spec, torch.device("cpu"))

    def _decode_values(
        self, payload: Payload, spec: TensorSpec, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        name, numel = spec.name, spec.numel
        expect_payload(payload, STCPayload, name)
        assert isinstance(payload, STCPayload)
        nnz, b, mu, bits, signs = payload.nnz, payload.golomb_b, payload.mu, payload.bits, payload.signs
        if not (
            isinstance(nnz, int)
            and not isinstance(nnz, bool)
            and isinstance(b, int)
            and isinstance(mu, (int, float))
            and isinstance(bits, (bytes, bytearray))
            and isinstance(signs, (bytes, bytearray))
        ):
            raise PayloadError(name, "STC payload fields have the wrong types")
        if nnz < 0:
            raise PayloadError(name, f"nnz {nnz} is negative")
        if nnz > numel:
            raise PayloadError(name, f"nnz {nnz} exceeds the tensor's {numel} elements")
        mu32 = _float32(mu)
        if not math.isfinite(mu32) or math.copysign(1.0, mu32) < 0:
            raise PayloadError(name, f"mu {mu!r} is not a finite float32 >= 0")
        if nnz == 0 and mu32 != 0:
            raise PayloadError(name, f"mu {mu!r} with no kept positions (must be 0)")
        want = (nnz + 7) // 8
        if len(signs) != want:
            raise PayloadError(name, f"sign bits are {len(signs)} bytes, expected {want} for nnz {nnz}")
        if nnz % 8 and signs[-1] & (0xFF >> (nnz % 8)):
            raise PayloadError(name, "non-zero padding bits after the sign bits")
        # decode_positions checks golomb_b's range and gives nnz strictly increasing positions in [0, numel)
        idx = decode_positions(bits, nnz, b, numel, name, device)
        vals = torch.full((nnz,), mu32, dtype=torch.float32, device=device)
        if nnz:
            negative = np.unpackbits(np.frombuffer(bytes(signs), dtype=np.uint8), count=nnz).astype(bool)
            vals[torch.from_numpy(negative).to(device)] = -mu32
        return idx, vals


_EMPTY = STCPayload(mu=0.0, golomb_b=0, nnz=0, bits=b"", signs=b"")


def _float32(value: float) -> float:
    """``value`` rounded to float32 (infinite past float32's range, NaN stays NaN)."""
    try:  # float() of a huge int and packing past float32's range raise OverflowError
        x = float(value)
        return float(struct.unpack("<f", struct.pack("<f", x))[0]) if math.isfinite(x) else x
    except OverflowError:
        return math.inf


def _exact_select(flat: torch.Tensor, k: int, name: str) -> tuple[torch.Tensor, np.ndarray]:
    """The non-zero entries among the ``k`` of largest magnitude (ties to the lowest index):
    ascending positions on ``flat``'s device and their float32 values on the host."""
    finite = np.isfinite(flat.numpy()).all() if flat.device.type == "cpu" else bool(torch.isfinite(flat).all())
    if not finite:
        raise ValueError(f"tensor {name!r}: STC cannot encode NaN or infinite values")
    idx = topk_positions(flat, k, name).to(flat.device)
    vals = flat.index_select(0, idx)
    keep = vals != 0  # sign(0) = 0: a zero among the top k is not sent
    if not bool(keep.all()):
        idx, vals = idx[keep], vals[keep]
    return idx, vals.cpu().numpy()
