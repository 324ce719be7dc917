"""Lattice codec: a tensor rounded to the grid ``h * K`` (``h = 2**e``), sent as its non-zero ``K``.

This is fedcomp's own downlink codec, not a paper's: it is what the ``lattice`` downlink method
(:mod:`fedcomp.methods.lattice`) sends instead of 3LC, a departure from 3LC (Hyesoo Lim et al.
2019) taken so that deltas can be **merged exactly**. Every value a lattice payload decodes to is
an integer multiple of a power of two ``h``; in float32 ``h * K`` is exact for ``|K| < 2**24``, and
so is the sum of two such values whose integer sum stays below ``2**24``. A client that missed
ten rounds can therefore get one payload carrying the integer sum of the ten deltas, and end bit
for bit where applying the ten would have left it (3LC deltas, scaled by a per-delta float, cannot
be merged in float arithmetic).

Encoding (stateless, numcodecs style): ``K = round(x / h)`` (half to even) per entry; the
positions of the non-zero ``K`` are Golomb-Rice coded exactly as SBC's
(:mod:`fedcomp.codecs.golomb`), their values as a sign bit and a Rice code of ``|K| - 1``.
Encoding needs the grid exponent ``e`` (the server replica chooses it per tensor); decoding reads
it from the payload and, when the codec was built with an ``exponent``, checks that it is that one
(a client holding a replica on another grid must resync, not add deltas of a different step).

Wire format (``STCPayload``, FORMAT.md "lattice"): ``mu = h`` (a power of two, ``2**-126 ..
2**103``, also when nothing moved), ``golomb_b``/``nnz``/``bits`` the positions as in SBC, and
``signs`` the value section (empty when ``nnz = 0``), MSB-first, zero-padded to a byte, with
exactly these bits:

1. the Rice parameter ``k`` in 5 bits (0..23; the encoder picks the one giving the fewest bits);
2. ``nnz`` sign bits (1 = negative), in position order;
3. the unary section: for each value, ``q = (|K| - 1) >> k`` one-bits then one zero-bit;
4. the remainder section: for each value, the low ``k`` bits of ``|K| - 1``, MSB first.

(The Rice codewords laid out in two sections, as the Golomb positions are, so decoding is a prefix
sum rather than a serial parse.) A value of +-1 costs two bits at ``k = 0``. ``|K| < 2**24``; with
the best ``k`` no value costs more on average than at ``k = 23`` (25 bits), so a value section of
more than ``ceil((5 + 26 nnz) / 8)`` bytes is rejected before it is unpacked.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fedcomp.codecs.base import Codec, TensorSpec, check_wire_dtype, expect_payload
from fedcomp.codecs.golomb import decode_positions, encode_positions, golomb_b
from fedcomp.codecs.sbc import all_finite
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.wire.payloads import EncodedTensor, Payload, STCPayload

__all__ = ["E_MAX", "E_MIN", "K_LIMIT", "Lattice", "lattice_exponent"]

#: Grid exponents a payload may carry: ``2**e * K`` is a finite float32 for every ``|K| < K_LIMIT``.
E_MIN, E_MAX = -126, 103
#: ``|K|`` must stay below this (float32 holds every integer up to it exactly).
K_LIMIT = 1 << 24
_K_BITS, _K_MAX = 5, 23  # the Rice parameter's width and its largest value


class Lattice(Codec):
    """Round to the grid ``2**exponent`` and send the non-zero multiples (see the module docstring).

    ``step`` and ``weight_step`` are the run's relative grid steps (the ``lattice-step`` and
    ``lattice-weight-step`` keys): the server replica sets each tensor's exponent to
    ``floor(log2(min(step * RMS(first movement), weight_step * RMS(values))))``
    (:func:`fedcomp.flower.replica.grid_exponents`). The codec itself uses only ``exponent``:
    required to encode; when set, decoding also requires the payload's grid to be ``2**exponent``.
    """

    codec_id = "lattice"
    version = 1

    def __init__(self, step: float = 8.0, exponent: int | None = None, weight_step: float = 2.0) -> None:
        for key, value in (("step", step), ("weight_step", weight_step)):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ConfigError(f"lattice: {key} must be a finite number > 0, got {value!r}")
        if exponent is not None and (
            isinstance(exponent, bool) or not isinstance(exponent, int) or not E_MIN <= exponent <= E_MAX
        ):
            raise ConfigError(f"lattice: exponent must be an int in [{E_MIN}, {E_MAX}], got {exponent!r}")
        self.step = float(step)
        self.exponent = exponent
        self.weight_step = float(weight_step)

    def _params(self) -> dict[str, Any]:
        return {"step": self.step, "exponent": self.exponent, "weight_step": self.weight_step}

    def with_exponent(self, exponent: int) -> Lattice:
        """The same codec on the grid ``2**exponent``."""
        return Lattice(self.step, exponent, self.weight_step)

    # --- encoding -----------------------------------------------------------------------------

    def encode(self, tensor: torch.Tensor, name: str = "") -> EncodedTensor:
        """Compress ``tensor``: :meth:`Codec.encode` without building the reconstruction (the
        server replica applies the payload itself, as its clients do)."""
        check_wire_dtype(tensor, name)
        payload, _ = self._payload(self._flatten(tensor, name), name, want_recon=False)
        return self._envelope(tensor, name, payload)

    def _encode(self, flat: torch.Tensor, name: str) -> tuple[Payload, torch.Tensor | None]:
        return self._payload(flat, name, want_recon=True)

    def _payload(self, flat: torch.Tensor, name: str, want_recon: bool) -> tuple[Payload, torch.Tensor | None]:
        if self.exponent is None:
            raise ValueError(f"tensor {name!r}: lattice encoding needs a grid exponent (the replica chooses it)")
        h = math.ldexp(1.0, self.exponent)
        if flat.device.type == "cpu":
            return self._payload_cpu(flat.numpy(), name, h, want_recon)
        return self._payload_torch(flat, name, h)

    def _payload_torch(self, flat: torch.Tensor, name: str, h: float) -> tuple[Payload, torch.Tensor]:
        """The payload on any device (the CPU runs :meth:`_payload_cpu`, same bytes: tested)."""
        if not bool(torch.isfinite(flat).all()):
            raise ValueError(f"tensor {name!r}: lattice cannot encode NaN or infinite values")
        q = torch.round(flat / h)  # exact division by a power of two; half to even
        if flat.numel() and float(q.abs().max()) >= K_LIMIT:
            raise ValueError(f"tensor {name!r}: a value needs |K| >= 2**24 on the grid 2**{self.exponent}")
        recon = q * h
        idx = torch.nonzero(q).reshape(-1)
        nnz = idx.numel()
        if nnz == 0:
            return STCPayload(mu=h, golomb_b=0, nnz=0, bits=b"", signs=b""), recon
        vals = q.index_select(0, idx).cpu().numpy().astype(np.int64)
        b = golomb_b(nnz / flat.numel())
        payload = STCPayload(mu=h, golomb_b=b, nnz=nnz, bits=encode_positions(idx, b), signs=_pack_values(vals))
        return payload, recon

    def _payload_cpu(self, a: np.ndarray, name: str, h: float, want_recon: bool) -> tuple[Payload, torch.Tensor | None]:
        """The torch path's payload in NumPy (its rint rounds half to even, as ``torch.round``;
        dividing float32 by a power of two is exact in either, so the grid points are the same)."""
        if not all_finite(a):
            raise ValueError(f"tensor {name!r}: lattice cannot encode NaN or infinite values")
        q = np.rint(a / np.float32(h))
        if a.shape[0] and float(np.abs(q).max()) >= K_LIMIT:
            raise ValueError(f"tensor {name!r}: a value needs |K| >= 2**24 on the grid 2**{self.exponent}")
        recon = torch.from_numpy(q * np.float32(h)) if want_recon else None
        idx = np.flatnonzero(q != 0)  # a mask first: 4-10x faster than nonzero of a float array
        nnz = idx.shape[0]
        if nnz == 0:
            return STCPayload(mu=h, golomb_b=0, nnz=0, bits=b"", signs=b""), recon
        b = golomb_b(nnz / a.shape[0])
        bits = encode_positions(torch.from_numpy(idx), b)
        return STCPayload(mu=h, golomb_b=b, nnz=nnz, bits=bits, signs=_pack_values(q[idx].astype(np.int64))), recon

    # --- decoding -----------------------------------------------------------------------------

    def _decode(self, payload: Payload, spec: TensorSpec, device: torch.device) -> torch.Tensor:
        name, numel = spec.name, spec.numel
        expect_payload(payload, STCPayload, name)
        assert isinstance(payload, STCPayload)
        nnz, b, bits, signs = payload.nnz, payload.golomb_b, payload.bits, payload.signs
        if not (
            isinstance(nnz, int)
            and not isinstance(nnz, bool)
            and isinstance(b, int)
            and isinstance(bits, (bytes, bytearray))
            and isinstance(signs, (bytes, bytearray))
        ):
            raise PayloadError(name, "lattice payload fields have the wrong types")
        e = _exponent_of(payload.mu, name)
        if self.exponent is not None and e != self.exponent:
            raise PayloadError(name, f"grid step 2**{e} where this replica's grid is 2**{self.exponent}")
        if nnz < 0:
            raise PayloadError(name, f"nnz {nnz} is negative")
        if nnz > numel:
            raise PayloadError(name, f"nnz {nnz} exceeds the tensor's {numel} elements")
        most = -(-(_K_BITS + nnz * (2 + _K_MAX + 1)) // 8) if nnz else 0
        if len(signs) > most:
            raise PayloadError(name, f"value section is {len(signs)} bytes, more than {most} for nnz {nnz}")
        idx = decode_positions(bits, nnz, b, numel, name, device)
        vals = _unpack_values(bytes(signs), nnz, name)
        out = torch.zeros(numel, dtype=torch.float32, device=device)
        if nnz:
            k = torch.from_numpy(vals.astype(np.float32)).to(device)
            out.index_copy_(0, idx, k * math.ldexp(1.0, e))
        return out


def lattice_exponent(enc: EncodedTensor) -> int:
    """The grid exponent ``e`` of a lattice-coded tensor (``h = 2**e``); PayloadError otherwise."""
    if enc.codec_id != Lattice.codec_id or not isinstance(enc.payload, STCPayload):
        raise PayloadError(enc.name, f"codec {enc.codec_id!r} where a lattice payload was expected")
    return _exponent_of(enc.payload.mu, enc.name)


def _exponent_of(mu: object, name: str) -> int:
    """``e`` for ``mu == 2**e`` within [E_MIN, E_MAX]; PayloadError for anything else."""
    if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not math.isfinite(mu) or mu <= 0:
        raise PayloadError(name, f"grid step {mu!r} is not a finite number > 0")
    m, e = math.frexp(float(mu))
    if m != 0.5 or not E_MIN <= e - 1 <= E_MAX:
        raise PayloadError(name, f"grid step {mu!r} is not a power of two in [2**{E_MIN}, 2**{E_MAX}]")
    return e - 1


def _rice_k(m1: np.ndarray) -> int:
    """The Rice parameter giving the fewest bits for the values ``m1 = |K| - 1`` (the first such).

    From ``k = bit_length(max m1)`` on every quotient is 0 and the cost ``len * (k + 1)`` only
    grows, so the search stops there: the same choice as trying all of ``0 .. 23``, in a few
    passes over the values instead of 24."""
    top = min(_K_MAX, int(m1.max()).bit_length()) if len(m1) else 0
    costs = [int((m1 >> k).sum()) + len(m1) * (k + 1) for k in range(top + 1)]
    return int(np.argmin(costs))


def _pack_values(vals: np.ndarray) -> bytes:
    """The value section (module docstring) for non-zero int64 ``vals``."""
    m1 = np.abs(vals) - 1
    k = _rice_k(m1)
    q = m1 >> k
    nnz = len(vals)
    unary = np.ones(int(q.sum()) + nnz, dtype=np.uint8)
    unary[np.cumsum(q + 1) - 1] = 0
    rem = ((m1[:, None] >> np.arange(k - 1, -1, -1)) & 1).astype(np.uint8).reshape(-1)
    head = ((k >> np.arange(_K_BITS - 1, -1, -1)) & 1).astype(np.uint8)
    stream = np.concatenate([head, (vals < 0).astype(np.uint8), unary, rem])
    return np.packbits(stream).tobytes()


def _unpack_values(data: bytes, nnz: int, name: str) -> np.ndarray:
    """Parse the value section of ``nnz`` values; PayloadError on any inconsistency."""
    if nnz == 0:  # the caller checked: no value bytes
        return np.zeros(0, dtype=np.int64)
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    if len(bits) < _K_BITS + 2 * nnz:
        raise PayloadError(name, f"value section of {len(data)} bytes is too short for {nnz} values")
    k = int(np.dot(bits[:_K_BITS].astype(np.int64), 1 << np.arange(_K_BITS - 1, -1, -1)))
    if k > _K_MAX:
        raise PayloadError(name, f"Rice parameter {k} exceeds {_K_MAX}")
    negative = bits[_K_BITS : _K_BITS + nnz].astype(bool)
    start = _K_BITS + nnz
    zeros = np.flatnonzero(bits[start:] == 0)[:nnz]
    if len(zeros) < nnz:
        raise PayloadError(name, "value section ends inside its unary part")
    q = (np.diff(zeros, prepend=-1) - 1).astype(np.int64)
    rem_start = start + int(zeros[-1]) + 1
    used = rem_start + nnz * k
    if -(-used // 8) != len(data):
        raise PayloadError(name, f"value section is {len(data)} bytes, its codes need {-(-used // 8)}")
    if bits[used:].any():
        raise PayloadError(name, "non-zero padding bits after the values")
    r = np.zeros(nnz, dtype=np.int64)
    if k:
        r = bits[rem_start:used].reshape(nnz, k).astype(np.int64) @ (1 << np.arange(k - 1, -1, -1))
    mag = (q << k | r) + 1
    if int(mag.max()) >= K_LIMIT:
        raise PayloadError(name, "a value exceeds |K| < 2**24")
    return np.where(negative, -mag, mag)
