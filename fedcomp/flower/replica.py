"""The server's copy of the model the clients hold, and the log of compressed deltas that built it.

Clients never receive the exact global model W: they receive 3LC-compressed deltas and hold the
replica R they add up to. The server keeps R too, and each round compresses ``W - R``. Because
``W - R`` still contains everything earlier rounds failed to send, this is 3LC's error
accumulation without a separate buffer. The same bytes go to every up-to-date client.

A client that missed rounds gets the chain of deltas it lacks from a bounded log, or the whole
replica (dense fp32) when that is smaller, when it is too far behind, or when its digest is
wrong.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from fedcomp.codecs import Codec, DenseFP32, TensorSpec
from fedcomp.errors import PayloadError
from fedcomp.flower.records import digest
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire.serde import update_from_bytes, update_to_bytes


@dataclass(frozen=True)
class Downlink:
    """What one client is sent: ``mode`` is "none" (up to date), "chain" or "full"."""

    mode: str
    payloads: tuple[bytes, ...]
    version: int
    digest: str

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.payloads)


class ServerReplica:
    """Replica R at ``version``, its digests, and the newest compressed deltas.

    The log keeps at most ``max_log`` deltas and, newest first, only as many as add up to the
    dense fp32 size of the model: a longer chain would never be sent (a full replica is cheaper),
    so the log's memory is bounded by one model's size whatever ``max_log`` is.
    """

    def __init__(self, initial: dict[str, torch.Tensor], max_log: int, min_numel: int) -> None:
        self.tensors = {k: v.detach().to(torch.float32).clone() for k, v in initial.items()}
        self.specs = specs_of(self.tensors)
        self.version = 0
        self.min_numel = min_numel
        self._log: deque[tuple[int, bytes]] = deque(maxlen=max_log)  # (version produced, bytes)
        self._digests: dict[int, str] = {0: digest(self.tensors)}
        self._full: tuple[int, bytes] | None = None
        self._log_bytes_cap = 4 * sum(t.numel() for t in self.tensors.values())

    @property
    def digest(self) -> str:
        return self._digests[self.version]

    def digest_of(self, version: int) -> str | None:
        return self._digests.get(version)

    def advance(self, target: dict[str, torch.Tensor], codec: Codec) -> bytes:
        """Compress ``target - R`` with ``codec``, apply the decoded delta to R exactly as a client
        will, and log the bytes. Returns the bytes every up-to-date client gets."""
        delta = {k: target[k].detach().to(torch.float32) - self.tensors[k] for k in self.tensors}
        enc = UpdateEncoder(codec, min_numel=self.min_numel, error_feedback=False)
        data = update_to_bytes(enc.encode(delta, base_model_version=self.version))
        apply_delta(self.tensors, data, self.specs, codec, self.version)
        self.version += 1
        self._log.append((self.version, data))
        while sum(len(b) for _, b in self._log) > self._log_bytes_cap:
            self._log.popleft()
        self._digests[self.version] = digest(self.tensors)
        oldest = self.version - len(self._log)
        self._digests = {v: d for v, d in self._digests.items() if v >= oldest}
        return data

    def downlink_for(self, version: int | None, client_digest: str | None) -> Downlink:
        """The cheapest correct way to bring a client at ``version`` to the current replica."""
        known = version is not None and self._digests.get(version) == client_digest
        if known and version == self.version:
            return Downlink("none", (), self.version, self.digest)
        full = self._full_bytes()
        if known and version is not None and version >= self.version - len(self._log):
            chain = tuple(b for v, b in self._log if v > version)
            if sum(len(b) for b in chain) < len(full):
                return Downlink("chain", chain, self.version, self.digest)
        return Downlink("full", (full,), self.version, self.digest)

    def _full_bytes(self) -> bytes:
        if self._full is None or self._full[0] != self.version:
            enc = UpdateEncoder(DenseFP32(), min_numel=0, error_feedback=False)
            self._full = (self.version, update_to_bytes(enc.encode(self.tensors, base_model_version=self.version)))
        return self._full[1]


def apply_delta(
    tensors: dict[str, torch.Tensor], data: bytes, specs: list[TensorSpec], codec: Codec, base_version: int
) -> None:
    """Add one decoded downlink delta (made against ``base_version``) to ``tensors`` in place.

    Server and client run this same code, so their replicas stay bit-identical. Raises
    :class:`PayloadError` on a malformed delta or one made against another version.
    """
    first = next(iter(tensors.values()), None)
    device = first.device if first is not None else torch.device("cpu")
    update = update_from_bytes(data, expected=specs)  # the tensor count bounded by the model
    if update.base_model_version != base_version:
        raise PayloadError("", f"delta is against version {update.base_model_version}, replica is at {base_version}")
    decoded = decode_update(update, specs, [codec, DenseFP32()], device)
    for k, d in decoded.items():
        tensors[k] += d
