"""The server's copy of the model the clients hold, and the log of compressed deltas that built it.

Clients never receive the exact global model W: they receive 3LC-compressed deltas and hold the
replica R they add up to. The server keeps R too, and each round compresses ``W - R``. Because
``W - R`` still contains everything earlier rounds failed to send, this is 3LC's error
accumulation without a separate buffer. The same bytes go to every up-to-date client.

A client that missed rounds gets the chain of deltas it lacks from a bounded log, or the whole
replica (dense fp32) when that is smaller, when it is too far behind, or when its digest is
wrong.

**Lattice replica** (downlink codec ``lattice``, :mod:`fedcomp.codecs.lattice`; a departure from
3LC, see docs/compression_gap.md): the replica is the model rounded to a per-tensor grid,
``R = h * K`` with ``h = 2**e`` fixed at the first lattice advance and ``K`` integer (``|K| < 2**24``).
Each round sends ``dK = round(W / h) - K``: no error accumulation is needed, as ``R`` is always the
lattice point of ``W`` (at most ``h / 2`` off per entry, never accumulating). Because sums of such
values are exact in float32, a client that missed rounds gets ONE payload, the integer sum of the
logged ``dK`` since its version, bit-identical to applying the chain (its digest still checks).
Applying a lattice delta first snaps the base to the grid (``h * round(R / h)``, the identity on
a replica already on it), so the seeded initial model, which is not on the grid, stays
digest-verifiable as version 0 on both sides.

Server memory: the replica (one fp32 model), the delta log (at most ``max_log`` entries and at
most one dense fp32 model of bytes), the cached full replica (one dense model) and the digests
of the logged versions; the lattice adds only its exponents (one int per tensor): ``K`` is
``R / h`` exactly and is never stored. Merged payloads are built on demand and not kept.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedcomp.codecs import Codec, DenseFP32, Lattice, TensorSpec
from fedcomp.codecs.lattice import E_MAX, E_MIN, K_LIMIT, lattice_exponent
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.flower.records import digest
from fedcomp.methods.statistics import is_statistic
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire.payloads import EncodedUpdate
from fedcomp.wire.serde import update_from_bytes, update_size, update_to_bytes


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
    so the log's memory is bounded by one model's size whatever ``max_log`` is. Lattice deltas
    are kept up to ``log_models`` models' bytes instead: a client that was away gets their exact
    integer sum, one merged payload whose size grows with the logarithm of the time away, not
    with the chain's bytes (a soak audit's 300-round LeNet5 run, 3 of 20 clients a round: the
    one-model cap held about 40 rounds of deltas, and clients away longer got the 1.7 MB model
    where a merge of 200-250 kB would have done).
    """

    # Class defaults, so that a replica pickled before the lattice existed still loads.
    grid: dict[str, int] | None = None
    _lattice_from: int | None = None
    #: This version's merged lattice catch-ups by the version they start from: clients at the same
    #: old version in one round share one merge (None: a sum too large to merge). Cleared when the
    #: replica advances; holds at most one dense model's bytes (the log: one, or ``log_models``).
    _merged: tuple[int, dict[int, bytes | None]] | None = None

    def __init__(self, initial: dict[str, torch.Tensor], max_log: int, min_numel: int, log_models: float = 1.0) -> None:
        self.tensors = {k: v.detach().to(torch.float32).clone() for k, v in initial.items()}
        self.specs = specs_of(self.tensors)
        self.version = 0
        self.min_numel = min_numel
        self._log: deque[tuple[int, bytes]] = deque(maxlen=max_log)  # (version produced, bytes)
        self._digests: dict[int, str] = {0: digest(self.tensors)}
        self._full: tuple[int, bytes] | None = None
        self._full_len: tuple[int, int] | None = None  # (version, len of its full bytes)
        self._log_bytes_cap = 4 * sum(t.numel() for t in self.tensors.values())
        #: The lattice deltas' cap, in models' bytes (``delta-log-models``; config, not state).
        self.log_models = log_models
        #: Lattice: each tensor's grid exponent (fixed at the first lattice advance; None before),
        #: and the first version lattice deltas start from (None while the last delta is not one).
        self.grid: dict[str, int] | None = None
        self._lattice_from: int | None = None

    def state_dict(self) -> dict[str, Any]:
        """What a resumed server needs of this replica, as plain data (tensors, numbers, strings,
        bytes, lists and dicts: what ``torch.load(weights_only=True)`` reads, no object of
        fedcomp's, so that loading a checkpoint runs no code from it): the tensors, the version,
        the delta log and its length cap, the digests, the lattice grid. The caches (the full
        replica's bytes, merged catch-ups) are not kept: they are rebuilt when asked for."""
        return {
            "tensors": dict(self.tensors),
            "version": self.version,
            "min-numel": self.min_numel,
            "max-log": self._log.maxlen,
            "log": [[v, data] for v, data in self._log],
            "digests": dict(self._digests_now()),
            "grid": None if self.grid is None else dict(self.grid),
            "lattice-from": self._lattice_from,
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> ServerReplica:
        """The replica :meth:`state_dict` saved. Raises :class:`PayloadError` naming the field that
        is missing or malformed, or when the tensors are not the ones the saved digest names."""
        try:
            tensors, version, min_numel = state["tensors"], state["version"], state["min-numel"]
            max_log, log, digests = state["max-log"], state["log"], state["digests"]
            grid, lattice_from = state["grid"], state["lattice-from"]
        except (KeyError, TypeError) as exc:
            raise PayloadError("", f"replica state: {type(exc).__name__}: {exc}") from None
        if not isinstance(tensors, dict) or not tensors:
            raise PayloadError("", "replica state: 'tensors' is not a dict of tensors")
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise PayloadError("", f"replica state: tensor {name!r} is not a float32 tensor")
        for key, value, least in (("version", version, 0), ("min-numel", min_numel, 0), ("max-log", max_log, 0)):
            if not _is_int(value) or value < least:
                raise PayloadError("", f"replica state: {key!r} is {value!r}, not an int >= {least}")
        if not isinstance(log, list) or len(log) > max_log:
            raise PayloadError("", f"replica state: 'log' is not a list of at most {max_log} deltas")
        first = version - len(log) + 1
        for i, entry in enumerate(log):
            if (
                not isinstance(entry, list | tuple)
                or len(entry) != 2
                or not _is_int(entry[0])
                or entry[0] != first + i
                or not isinstance(entry[1], bytes)
            ):
                raise PayloadError("", f"replica state: log entry {i} is not [version {first + i}, bytes]")
        if not isinstance(digests, dict) or not all(_is_int(v) and isinstance(d, str) for v, d in digests.items()):
            raise PayloadError("", "replica state: 'digests' is not a dict of version to digest")
        if grid is not None and (
            not isinstance(grid, dict)
            or set(grid) != set(tensors)
            or not all(_is_int(e) and E_MIN <= e <= E_MAX for e in grid.values())
        ):
            raise PayloadError("", f"replica state: 'grid' is not an exponent in [{E_MIN}, {E_MAX}] per tensor")
        if lattice_from is not None and (not _is_int(lattice_from) or not 0 <= lattice_from <= version):
            raise PayloadError("", f"replica state: 'lattice-from' is {lattice_from!r}, not an int in [0, {version}]")
        replica = cls(tensors, max_log, min_numel)
        if digests.get(version) != replica._digests[0]:
            raise PayloadError("", f"replica state: the tensors are not version {version}'s (their digest differs)")
        replica.version = version
        replica._log.extend((int(v), data) for v, data in log)
        replica._digests = dict(digests)
        replica.grid = None if grid is None else dict(grid)
        replica._lattice_from = lattice_from
        return replica

    @property
    def digest(self) -> str:
        return self._digests_now()[self.version]

    def digest_of(self, version: int) -> str | None:
        return self._digests_now().get(version)

    def _digests_now(self) -> dict[int, str]:
        """The digests of the versions a chain can reach, the current one's hashed when first
        asked for (:meth:`_logged`)."""
        if self.version not in self._digests:
            self._digests[self.version] = digest(self.tensors)
        return self._digests

    def advance(self, target: dict[str, torch.Tensor], codec: Codec) -> bytes:
        """Compress ``target - R`` with ``codec``, apply the decoded delta to R exactly as a client
        will, and log the bytes. Returns the bytes every up-to-date client gets."""
        self._digests_now()  # (before the tensors change: clients at this version need it)
        if isinstance(codec, Lattice):
            return self._advance_lattice(target, codec)
        self._lattice_from = None  # a non-lattice delta: merges may not reach across it
        delta = {k: target[k].detach().to(torch.float32) - self.tensors[k] for k in self.tensors}
        enc = UpdateEncoder(codec, min_numel=self.min_numel, error_feedback=False)
        data = enc.encode_to_bytes(delta, base_model_version=self.version)
        apply_delta(self.tensors, data, self.specs, codec, self.version)
        return self._logged(data)

    def _advance_lattice(self, target: dict[str, torch.Tensor], codec: Lattice) -> bytes:
        """The lattice step: ``dK = round(W / h) - round(R / h)`` per tensor, applied as clients do."""
        if self.grid is None:
            self.grid = grid_exponents(target, self.tensors, codec.step, codec.weight_step)
        if self._lattice_from is None:
            self._lattice_from = self.version
        delta: dict[str, torch.Tensor] = {}
        points: dict[str, torch.Tensor] = {}  # where the delta takes the replica, from the CPU step
        for k, e in self.grid.items():
            h = math.ldexp(1.0, e)
            w, r = target[k].detach().to(torch.float32), self.tensors[k]
            if w.device.type == "cpu" and r.device.type == "cpu" and w.is_contiguous() and r.is_contiguous():
                delta[k], points[k] = _lattice_step_cpu(w, r, h, k, e)  # the lines below, in NumPy
                continue
            goal = torch.round(w / h)
            if not bool(torch.isfinite(goal).all()) or (goal.numel() and float(goal.abs().max()) >= K_LIMIT):
                raise _off_grid(k, e)
            delta[k] = (goal - torch.round(r / h)) * h
        codecs = {k: codec.with_exponent(e) for k, e in self.grid.items()}
        enc = UpdateEncoder(codec, min_numel=0, error_feedback=False)
        data = update_to_bytes(enc.encode(delta, base_model_version=self.version, codecs=codecs))
        if len(points) == len(self.grid):  # apply_lattice's result, without parsing our own bytes
            self.tensors.update(points)
        else:
            apply_lattice(self.tensors, data, self.specs, self.grid, self.version)
        return self._logged(data)

    def _logged(self, data: bytes) -> bytes:
        """Count the new version, log its delta (within the caps) and keep the digests a chain can
        reach. The new version's digest is hashed when first asked for (:meth:`_digests_now`):
        the "auto" downlink advances a scratch copy per candidate and keeps one (hashing each cost
        a ResNet-50 server 90 ms a candidate on the 2-core build machine)."""
        self.version += 1
        self._log.append((self.version, data))
        cap = self._log_bytes_cap * (self.log_models if self._lattice_from is not None else 1)
        while sum(len(b) for _, b in self._log) > cap:
            self._log.popleft()
        oldest = self.version - len(self._log)
        self._digests = {v: d for v, d in self._digests.items() if v >= oldest}
        return data

    def downlink_for(self, version: int | None, client_digest: str | None) -> Downlink:
        """The cheapest correct way to bring a client at ``version`` to the current replica."""
        known = version is not None and self._digests_now().get(version) == client_digest
        if known and version == self.version:
            return Downlink("none", (), self.version, self.digest)
        if known and version is not None and version >= self.version - len(self._log):
            if self._lattice_from is not None and version >= self._lattice_from:
                merged = self._merged_from(version)
                if merged is not None and len(merged) < self._full_size():
                    return Downlink("chain", (merged,), self.version, self.digest)
                return Downlink("full", (self._full_bytes(),), self.version, self.digest)
            chain = tuple(b for v, b in self._log if v > version)
            if sum(len(b) for b in chain) < self._full_size():
                return Downlink("chain", chain, self.version, self.digest)
        return Downlink("full", (self._full_bytes(),), self.version, self.digest)

    def _merged_from(self, version: int) -> bytes | None:
        """One lattice payload from ``version`` to now (cached for this version, see ``_merged``)."""
        if self._merged is None or self._merged[0] != self.version:
            self._merged = (self.version, {})
        cache = self._merged[1]
        if version not in cache:
            merged = self._merge_from(version)
            if sum(len(b) for b in cache.values() if b is not None) + len(merged or b"") > self._log_bytes_cap:
                return merged  # over the cap: sent, not kept
            cache[version] = merged
        return cache[version]

    def _merge_from(self, version: int) -> bytes | None:
        """The exact integer sum of the logged ``dK`` from ``version`` to now, as one lattice
        payload (None when a sum reaches ``|dK| >= 2**24``: then the full replica goes)."""
        chain = [b for v, b in self._log if v > version]
        if len(chain) == 1:
            return chain[0]
        assert self.grid is not None
        total = {s.name: torch.zeros(s.shape, dtype=torch.int64) for s in self.specs}
        for data in chain:
            update = update_from_bytes(data, expected=self.specs)
            decoded = decode_update(update, self.specs, [Lattice()])
            for k, d in decoded.items():
                total[k] += (d / math.ldexp(1.0, self.grid[k])).to(torch.int64)  # exact: d is h * integer
        if any(t.numel() and int(t.abs().max()) >= K_LIMIT for t in total.values()):
            return None
        delta = {k: t.to(torch.float32) * math.ldexp(1.0, self.grid[k]) for k, t in total.items()}
        codecs = {k: Lattice(exponent=e) for k, e in self.grid.items()}
        enc = UpdateEncoder(Lattice(), min_numel=0, error_feedback=False)
        return update_to_bytes(enc.encode(delta, base_model_version=version, codecs=codecs))

    def _full_bytes(self) -> bytes:
        if self._full is None or self._full[0] != self.version:
            enc = UpdateEncoder(DenseFP32(), min_numel=0, error_feedback=False)
            self._full = (self.version, enc.encode_to_bytes(self.tensors, base_model_version=self.version))
        return self._full[1]

    def _full_size(self) -> int:
        """``len(self._full_bytes())``, without writing them where no client needs them (a round
        whose clients all take the chain: the whole model written every round only to be measured
        took a ResNet-50 server about 100 ms of its round on the 2-core build machine)."""
        if self._full is not None and self._full[0] == self.version:
            return len(self._full[1])
        if self._full_len is None or self._full_len[0] != self.version:
            enc = UpdateEncoder(DenseFP32(), min_numel=0, error_feedback=False)
            self._full_len = (self.version, update_size(enc.encode(self.tensors, base_model_version=self.version)))
        return self._full_len[1]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def apply_delta(
    tensors: dict[str, torch.Tensor],
    data: bytes,
    specs: list[TensorSpec],
    codec: Codec | Sequence[Codec],
    base_version: int,
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
    codecs = [codec] if isinstance(codec, Codec) else list(codec)
    decoded = decode_update(update, specs, [DenseFP32(), *codecs], device)
    for k, d in decoded.items():
        tensors[k] += d


#: A running statistic's lattice grid puts its largest value at ``|K| < 2**FINE_BITS``
#: (:func:`grid_exponents`).
FINE_BITS = 14


def grid_exponents(
    target: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor], step: float, weight_step: float
) -> dict[str, int]:
    """Each tensor's lattice exponent ``e = floor(log2(step * RMS(target - base)))`` (the first
    movement of the model sets the grid for the run), at most ``floor(log2(weight_step *
    RMS(target)))``.

    The second bound is fedcomp's (the lattice is no paper's): a grid coarser than the weights
    rounds most of them to zero or one step. It binds where the first movement is large against
    the weights: with Adam (every weight moves by about the learning rate a step) the Shakespeare
    CharLSTM's first movement put its LSTM weights on a grid 6x their RMS, and the replica its
    clients trained from lost 12 points of accuracy (docs/lattice.md). A zero-initialised tensor
    (a bias, a norm's shift) has a first movement equal to its values and takes the bound.

    Fallbacks, documented in FORMAT.md: a tensor that did not move takes the smallest exponent of
    those that moved (-24 when none did), within its own weight bound; a tensor whose values are
    all integers, in ``target`` and ``base`` (a counter such as BatchNorm's ``num_batches_tracked``,
    a mask: the grid of its first movement would round a counter that moves by thousands to a
    multiple of 2**13), takes at most 0, so that its grid holds every integer; a running statistic
    (BatchNorm's ``running_var``: :func:`~fedcomp.methods.statistics.is_statistic`) takes at most
    the grid that puts its largest value (now or before) at ``|K| < 2**FINE_BITS``: each value
    within ``2**-FINE_BITS`` of that largest one, with room for the values to grow ``2**(24 -
    FINE_BITS)``-fold. On the grid of its first movement, a ``running_var`` near 0.1 was rounded to
    0 or 0.5, and the model went NaN (:mod:`fedcomp.methods.statistics` says why). Every
    exponent is then raised as far as needed for the tensor's largest value to stay below
    ``2**22 * h`` (a 4x margin under ``|K| < 2**24`` for the model to grow), and clamped to
    ``[E_MIN, E_MAX]``.
    """
    moved: dict[str, int] = {}
    for k, t in target.items():
        diff = t.detach().to(torch.float64) - base[k].detach().to(torch.float64)
        rms = float(diff.pow(2).mean().sqrt()) if diff.numel() else 0.0
        if rms > 0 and math.isfinite(rms):
            moved[k] = math.floor(math.log2(step * rms))
    fallback = min(moved.values(), default=-24)
    out: dict[str, int] = {}
    for k, t in target.items():
        e = moved.get(k, fallback)
        values = float(t.detach().to(torch.float64).pow(2).mean().sqrt()) if t.numel() else 0.0
        if values > 0 and math.isfinite(values):
            e = min(e, math.floor(math.log2(weight_step * values)))
        biggest = max(
            float(t.detach().abs().max()) if t.numel() else 0.0, float(base[k].abs().max()) if t.numel() else 0.0
        )
        if _integer_valued(t) and _integer_valued(base[k]):
            e = min(e, 0)
        elif is_statistic(k) and biggest > 0 and math.isfinite(biggest):
            e = min(e, math.frexp(biggest)[1] - FINE_BITS)
        if biggest > 0 and math.isfinite(biggest):
            e = max(e, math.frexp(biggest)[1] - 22)
        out[k] = min(E_MAX, max(E_MIN, e))
    return out


def _integer_valued(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is an integer (NaN and infinities are not)."""
    t = t.detach()
    return bool(torch.equal(t, torch.round(t))) if t.numel() else False


def _off_grid(name: str, e: int) -> ConfigError:
    if is_statistic(name):  # (its grid is set by its own largest value, not by lattice-step)
        return ConfigError(
            f"lattice-step: running statistic {name!r} grew past its grid 2**{e} (over 2**{24 - FINE_BITS} "
            "times its largest value when the grid was set, or not finite); another downlink-codec "
            "(3lc, the default) sends it dense"
        )
    return ConfigError(
        f"lattice-step: tensor {name!r} does not fit its grid 2**{e} (|W / h| >= 2**24 or not finite); "
        "a larger lattice-step gives a coarser grid (a model that moved this far in one round may "
        "also be one client's doing: max-update-norm bounds each update)"
    )


def _lattice_step_cpu(
    w: torch.Tensor, r: torch.Tensor, h: float, name: str, e: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(round(w / h) - round(r / h)) * h`` in float32 after checking ``|round(w / h)| < 2**24``
    (and finite): the device-generic lines of :meth:`ServerReplica._advance_lattice` in NumPy, in
    place in one new array and one temporary; and ``round(w / h) * h``, where a receiver holding
    ``r`` lands when it applies the payload of that delta (:func:`apply_lattice`), bit for bit
    (tested): its merge ``round(r / h) + dK`` is exact (the encoder sends only ``|dK| < 2**24``)
    and gives ``+0.0`` wherever ``round(w / h)`` is a zero of either sign."""
    h32 = np.float32(h)
    goal = _grid_index(w.numpy(), h32)
    if not _within_grid(goal):
        raise _off_grid(name, e)
    point = np.multiply(goal, h32, out=np.empty_like(goal))
    point += np.float32(0.0)  # -0.0 + 0.0 is +0.0, as the receiver's merge gives
    goal -= _grid_index(r.numpy(), h32)
    goal *= h32
    return torch.from_numpy(goal).reshape(w.shape), torch.from_numpy(point).reshape(w.shape)


def _grid_index(x: np.ndarray, h32: np.float32) -> np.ndarray:
    """``round(x / h)`` in a new float32 array (``rint``: ties to even, as ``torch.round``); an
    array for a 0-d ``x`` too (a scalar parameter), where NumPy's quotient alone is a scalar."""
    q = np.divide(x, h32, out=np.empty(x.shape, np.float32))
    return np.rint(q, out=q)


def _within_grid(k: np.ndarray) -> bool:
    """Whether every ``|k| < 2**24`` (a NaN fails both comparisons)."""
    return not k.size or (float(k.max()) < K_LIMIT and -float(k.min()) < K_LIMIT)


def apply_lattice(
    tensors: dict[str, torch.Tensor],
    data: bytes | EncodedUpdate,
    specs: list[TensorSpec],
    grid: Mapping[str, int] | None,
    base_version: int,
    undo: bool = False,
) -> dict[str, int]:
    """Apply one lattice payload (made against ``base_version``) to ``tensors`` in place:
    ``R = h * (round(R / h) + dK)``, exact in float32. Returns the payload's grid exponents.
    ``undo``: take it back instead (``- dK``; ``tensors`` hold the version it made, and
    ``base_version`` is the one it was made against), exact as well. ``data``: the payload's
    bytes, or the update they parse to (checked against ``specs`` when parsed).

    ``grid``: the exponents the receiver holds (None: it holds none yet and adopts the payload's).
    Server and client run this same code. Raises :class:`PayloadError` on a malformed payload,
    one against another version, one on another grid, or a result outside ``|K| < 2**24``.
    """
    first = next(iter(tensors.values()), None)
    device = first.device if first is not None else torch.device("cpu")
    update = update_from_bytes(data, expected=specs) if isinstance(data, bytes) else data
    if update.base_model_version != base_version:
        raise PayloadError("", f"delta is against version {update.base_model_version}, replica is at {base_version}")
    per_tensor = {k: Lattice(exponent=e) for k, e in grid.items()} if grid is not None else None
    decoded = decode_update(update, specs, [Lattice()], device, per_tensor=per_tensor)
    if undo:
        decoded = {k: d.neg_() for k, d in decoded.items()}
    exponents = {enc.name: lattice_exponent(enc) for enc in update.tensors}
    on_device: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
    for k, d in decoded.items():
        current = tensors[k].to(torch.float32)
        if current.device.type == "cpu" and d.device.type == "cpu" and current.shape == d.shape:
            tensors[k] = _merge_cpu(current, d, math.ldexp(1.0, exponents[k]), k, exponents[k])
        else:
            on_device[k] = (current, d, exponents[k])
    tensors.update(_merge_torch(on_device))
    return exponents


def _merge_torch(items: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """``h * (round(current / h) + d / h)`` of each ``name: (current, d, e)`` (``h = 2**e``), on
    any device; the grid checked for all of them with one wait for the device (a wait per tensor
    cost a GPU client hundreds per round), none returned when one leaves it."""
    steps = {k: math.ldexp(1.0, e) for k, (_, _, e) in items.items()}
    merged = {k: torch.round(current / steps[k]) + d / steps[k] for k, (current, d, _) in items.items()}
    if not merged:
        return {}
    largest = torch.stack([m.abs().max() if m.numel() else m.new_zeros(()) for m in merged.values()]).tolist()
    for k, top in zip(merged, largest, strict=True):
        if not top < K_LIMIT:
            raise PayloadError(k, f"the replica leaves the grid 2**{items[k][2]} (|K| >= 2**24)")
    return {k: m * steps[k] for k, m in merged.items()}


def _merge_cpu(current: torch.Tensor, d: torch.Tensor, h: float, name: str, e: int) -> torch.Tensor:
    """``h * (round(current / h) + d / h)`` in float32, as the device-generic lines of
    :func:`apply_lattice` compute it, in NumPy in place: one new array, no temporaries (``d`` is
    the freshly decoded delta, consumed; ``current`` is left as it was)."""
    h32 = np.float32(h)
    q = _grid_index(current.detach().reshape(-1).numpy(), h32)  # (flat: a 0-d tensor's delta may come 1-D)
    step = np.ascontiguousarray(d.detach().reshape(-1).numpy())
    step = np.divide(step, h32, out=step) if step.flags.writeable else step / h32
    q += step
    if not _within_grid(q):
        raise PayloadError(name, f"the replica leaves the grid 2**{e} (|K| >= 2**24)")
    q *= h32
    return torch.from_numpy(q).reshape(current.shape)
