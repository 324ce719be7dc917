"""The update a client sent and has not yet heard the fate of (protocol 2, no lost updates).

After a train reply the client keeps, in ``context.state``, what the server will decode from it:
the reconstruction of every tensor as its codec produced it while encoding. When a later downlink
says the update was not aggregated (rejected, timed out, dropped), the client adds it back to its
residual (:meth:`fedcomp.methods.base.UplinkMethod.client_recover`), so the next update carries
it and, per client, ``sum(aggregated updates) + residual == sum(local updates)`` keeps holding.

**Memory bound.** At most one update is pending per client: each downlink settles the pending one
before the next train reply makes a new one (:meth:`fedcomp.flower.protocol.UpdateOutcome.verdict`).
Each tensor is stored the cheaper way: sparse (int32 or int64 positions and float32 values of its
non-zeros) when that is smaller, else dense float32. So the pending record costs at most the
model's float32 size plus a few bytes per tensor, and for sparse methods (SBC, STC, top-k, DEFT at
density ``p``) about ``8 p`` bytes per parameter. It is raw bytes in a ConfigRecord, never an
ArrayRecord: the client's own state, not traffic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord

from fedcomp.codecs import TensorSpec
from fedcomp.codecs.flat import tensors_on_host, tensors_to_device
from fedcomp.errors import PayloadError
from fedcomp.methods.sent import KeptValues, Sent, dense

__all__ = ["PendingUpdate"]

_ROUND, _NAMES = "round", "names"
_SHAPE, _DENSE, _POSITIONS, _VALUES = "shape:", "dense:", "positions:", "values:"


@dataclass
class PendingUpdate:
    """An update sent in ``round``: ``tensors`` as the server will decode them."""

    round: int
    #: Dense tensors (any float dtype, any device), or :class:`KeptValues` (SBC's, STC's or
    #: top-k's positions and values: the record is written from them without a dense tensor, the
    #: same record).
    tensors: Mapping[str, Sent]

    def to_record(self) -> ConfigRecord:
        """The ``STATE_PENDING`` record: each tensor dense or sparse, whichever is smaller."""
        out: dict[str, Any] = {_ROUND: int(self.round), _NAMES: list(self.tensors)}
        on_host = tensors_on_host(
            {k: v.detach().to(torch.float32) for k, v in self.tensors.items() if not isinstance(v, KeptValues)}
        )
        for name, sent in self.tensors.items():
            if isinstance(sent, KeptValues):
                shape, numel = sent.shape, sent.numel
                positions, values = sent.nonzero()
            else:
                t = on_host[name]
                flat = t.reshape(-1)
                shape, numel = tuple(t.shape), flat.numel()
                nz = flat.nonzero().view(-1)
                positions, values = nz.numpy(), flat[nz].numpy()
            out[_SHAPE + name] = [int(d) for d in shape]
            index_dtype = _INDEX_DTYPES[_index_dtype(numel)]
            if positions.shape[0] * (index_dtype.itemsize + 4) < numel * 4:
                out[_POSITIONS + name] = positions.astype(index_dtype, copy=False).tobytes()
                out[_VALUES + name] = values.tobytes()
            else:
                out[_DENSE + name] = _bytes(on_host[name] if name in on_host else dense(sent))
        return ConfigRecord(out)

    def dense_tensors(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """:attr:`tensors` as float32 tensors (:class:`KeptValues` made dense on ``device``, the
        CPU by default; dense ones where they are unless ``device`` is given)."""
        return {name: dense(sent, device) for name, sent in self.tensors.items()}

    @staticmethod
    def round_of(rec: Mapping[str, object]) -> int:
        """The round the update in a ``STATE_PENDING`` record was sent in, read alone (what a
        client needs to know whether it was aggregated); :class:`PayloadError` where it is not
        one."""
        rnd = rec.get(_ROUND)
        if isinstance(rnd, bool) or not isinstance(rnd, int) or rnd < 0:
            raise PayloadError("", f"pending update: field {_ROUND!r} is {rnd!r}, not a round number")
        return rnd

    @classmethod
    def from_record(
        cls,
        rec: Mapping[str, object],
        specs: Sequence[TensorSpec] | None = None,
        device: torch.device | str = "cpu",
    ) -> PendingUpdate:
        """Rebuild the tensors; raise :class:`PayloadError` (naming the tensor) when the record is
        malformed or, given ``specs``, does not hold exactly those tensors (a state written for
        another model)."""
        rnd = cls.round_of(rec)
        names = rec.get(_NAMES)
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise PayloadError("", f"pending update: field {_NAMES!r} is not a list of distinct names")
        shapes: dict[str, tuple[int, ...]] = {}
        for name in names:
            shape = rec.get(_SHAPE + name)
            if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape):  # fmt: skip
                raise PayloadError(name, "pending update: the tensor's shape is missing or malformed")
            shapes[name] = tuple(shape)
        if specs is not None and shapes != {s.name: tuple(s.shape) for s in specs}:
            raise PayloadError("", "pending update: its tensors are not the model's")
        expected = {_ROUND, _NAMES, *(_SHAPE + n for n in names)}
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            n = math.prod(shape)
            dense = rec.get(_DENSE + name)
            if dense is not None:
                expected.add(_DENSE + name)
                flat = _tensor(dense, torch.float32, n, name)
            else:
                positions, values = rec.get(_POSITIONS + name), rec.get(_VALUES + name)
                if positions is None or values is None:
                    raise PayloadError(name, "pending update: the tensor's data is missing")
                expected |= {_POSITIONS + name, _VALUES + name}
                vals = _tensor(values, torch.float32, None, name)
                if vals.numel() > n:
                    raise PayloadError(name, "pending update: more values than the tensor has elements")
                idx = _tensor(positions, _index_dtype(n), vals.numel(), name).to(torch.int64)
                if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
                    raise PayloadError(name, "pending update: a position is outside the tensor")
                flat = torch.zeros(n, dtype=torch.float32)
                flat[idx] = vals
            tensors[name] = flat.reshape(shape)
        unexpected = sorted(set(rec) - expected)
        if unexpected:
            raise PayloadError("", f"pending update: unexpected field(s) {unexpected[:3]}")
        return cls(rnd, tensors_to_device(tensors, device))


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


_INDEX_DTYPES: dict[torch.dtype, np.dtype] = {torch.int32: np.dtype(np.int32), torch.int64: np.dtype(np.int64)}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def _tensor(data: object, dtype: torch.dtype, count: int | None, name: str) -> torch.Tensor:
    """``data`` (native-order bytes, this client's own) as a 1-D ``dtype`` tensor, ``count`` long
    when given."""
    size = dtype.itemsize
    if not isinstance(data, bytes) or len(data) % size or (count is not None and len(data) != count * size):
        raise PayloadError(name, f"pending update: the stored {dtype} data has the wrong size")
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype)
