"""DEFT (Yoon and Oh, ICPP 2023): split the selection of the top-k entries over the round's clients.

The server cuts the model into partitions (Algorithm 2), gives each partition a share ``k_x`` of
the round's budget ``k = density * numel`` by gradient norm (Algorithm 3), and packs the
partitions into one bin per client by selection cost ``n_x * log k_x`` (Algorithm 4). Each client
then runs top-k only inside its own partitions (Algorithm 5, :class:`fedcomp.codecs.topk.TopK`
with ``ranges``). The clients' selections are disjoint, so the aggregate keeps the set density
however many clients there are (no gradient build-up), and each client searches about ``1/n`` of
the model.

    allocs = plan_round(numels, norms, density=0.01, n_clients=len(clients), round=r)  # server
    check_allocation(alloc, numels)                                                     # client
    codecs = {name: TopK(ranges=rs) for name, rs in zip(names, ranges_for(alloc, len(names)))}
    check_selection(positions, ranges)                                                  # server

Departures from the paper, all deliberate:

* **Norms come from the previous round**: in federated learning the server plans before the
  clients train, so a round's k follow norms of the round before. By default (``deft-norms =
  "clients"``) each client reports the L2 norm of every compressed tensor's accumulated update
  (its residual plus its update: what it selects from, the paper's local error) and the server
  takes the median over the accepted replies (:mod:`fedcomp.methods.deft_uplink`): the paper's
  norms, one round late and one per tensor rather than per partition. With no norms yet (round
  1) ``k`` is proportional to partition size. :func:`plan_round` takes one L2 norm per tensor and
  gives each part of a split tensor the norm ``N * sqrt(size_part / size_tensor)`` (the parts'
  squared norms add up to ``N**2``, as if the energy were spread evenly).
  ``deft-norms = "aggregate"`` plans from the server's previous aggregated update instead
  (:func:`plan_round_from_aggregate` measures each part's norm exactly), which costs no uplink
  bytes but drifts: the aggregate holds only what was selected, so a partition's norm follows
  its last ``k`` as much as its gradient. In a simulation of :func:`assign_k` alone (one client
  with error feedback, density 1 %, four partitions of 40,000/10,000/20,000/20,000 entries with
  standard deviations 1/3/0.3/1, 30 rounds), the paper's norms (of the accumulated gradient) gave
  ``k`` = 284/359/61/196 in round 5 and 318/295/77/210 in round 30; the previous aggregate's gave
  159/587/19/135 and 240/436/36/188: more to the high-norm partition, a third to a half as much
  to the low-norm one. With equal partitions both stay equal.
* **The server plans every allocation** (no rotating delegate, so no broadcast of bins between
  workers); client ``i`` of the round gets bin ``(round + i) % n``, Algorithm 4's rotation.
* **Algorithm 2 skips empty parts**: a tensor split into ``n`` parts with fewer than ``n``
  elements gives ``numel`` parts of one element; zero-element tensors give no partition.
* **Algorithm 3 in integers, with an exact total**: ``k_x = round(k_remain * norm / norm_remain)``
  capped at the partition size and at ``k_remain`` minus one for each partition still to come,
  so every partition keeps ``k_x >= 1`` (the paper's ``max(1, .)``) without overshooting; what
  the caps leave unassigned goes, in priority order, to partitions with room. Hence
  ``sum(k_x) == max(round(density * numel), number of partitions)`` exactly (the paper's version
  can miss the target by up to the number of partitions either way).
* **Cost ``n_x * log(k_x + 1)``** instead of ``n_x * log k_x``: a partition with ``k_x = 1`` is a
  full scan, not free. Bins are filled by LPT (largest cost first, into the lightest bin, ties to
  the lowest index), Algorithm 4's policy; see :func:`pack` for the bound.
* **One-shot aggregation**: the paper's workers all-gather the selected indices and then
  all-reduce every worker's values at all of them. A Flower round has no second exchange, so a
  client sends only its own selection and each aggregate coordinate comes from one client. The
  server keeps the inner strategy's weighted mean (it does not sum): each coordinate is that
  client's value times its FedAvg weight, and what the other clients hold at it stays in their
  residuals until the rotating allocation gives them that partition, so each client's update is
  applied in full with its weight, later (README, "Other uplink methods").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedcomp.codecs.topk import Range, check_positions
from fedcomp.errors import ConfigError, PayloadError, check_number
from fedcomp.wire.payloads import DeftAllocation, DeftPartition

#: Most partitions a client accepts in one allocation (a guard against floods; a real allocation
#: holds about ``(tensors + (n - 1)**2) / n`` of them).
MAX_PARTITIONS = 1 << 16


@dataclass(frozen=True)
class Partition:
    """Entries ``[start, stop)`` of flattened tensor ``tensor`` (model order), with its ``k``."""

    tensor: int
    start: int
    stop: int
    k: int = 0

    @property
    def size(self) -> int:
        return self.stop - self.start


# --- Algorithm 2: two-stage partitioning -------------------------------------------------------


def partition_layers(numels: Sequence[int], n: int) -> list[Partition]:
    """Algorithm 2: one partition per tensor, except that a tensor of more than ``total / n``
    elements is cut into ``n`` contiguous parts whose sizes differ by at most one (the first
    ``numel % n`` parts one larger). Partitions come in model order, ``k = 0``."""
    if n < 1:
        raise ConfigError(f"n_clients: must be >= 1, got {n}")
    total = sum(int(m) for m in numels)
    out: list[Partition] = []
    for t, m in enumerate(int(m) for m in numels):
        if m < 0:
            raise ValueError(f"numels: tensor {t} has {m} elements")
        pieces = min(n, m) if m * n > total else min(1, m)  # m > total / n, in integers
        q, r = divmod(m, pieces) if pieces else (0, 0)
        start = 0
        for i in range(pieces):
            stop = start + q + (1 if i < r else 0)
            out.append(Partition(t, start, stop))
            start = stop
    return out


# --- Algorithm 3: local k by gradient norm -------------------------------------------------------


def target_k(total: int, density: float) -> int:
    """The round's budget ``round(density * total)``."""
    density = check_number("density", density, low=0.0, high=1.0)
    return round(density * total)


def assign_k(parts: Sequence[Partition], norms: Sequence[float] | None, density: float) -> list[Partition]:
    """Algorithm 3 (see the module docstring for the integer version): ``norms`` has one weight
    per partition (L2 norms; None means "unknown": weights are the sizes). The result has
    ``sum(k) == max(round(density * total), len(parts))`` and ``1 <= k <= size`` each."""
    total = sum(p.size for p in parts)
    budget = max(target_k(total, density), len(parts))
    weights = [float(p.size) for p in parts] if norms is None else [float(w) for w in norms]
    if len(weights) != len(parts):
        raise ValueError(f"norms: {len(weights)} values for {len(parts)} partitions")
    if not all(math.isfinite(w) and w >= 0.0 for w in weights):
        raise ValueError("norms: must be finite and >= 0")
    order = sorted(range(len(parts)), key=lambda i: -weights[i])  # priority; stable on ties
    suffix = [0.0] * (len(order) + 1)  # weight still to come, summed exactly from the end
    for j in range(len(order) - 1, -1, -1):
        suffix[j] = suffix[j + 1] + weights[order[j]]
    ks = [0] * len(parts)
    k_remain = budget
    for j, i in enumerate(order):
        later = len(order) - j - 1
        k_temp = k_remain * weights[i] / suffix[j] if suffix[j] > 0 else 0.0
        ks[i] = max(1, min(round(k_temp), parts[i].size, k_remain - later))
        k_remain -= ks[i]
    for i in order:  # what the caps left over, to partitions with room, in priority order
        if k_remain <= 0:
            break
        extra = min(k_remain, parts[i].size - ks[i])
        ks[i] += extra
        k_remain -= extra
    return [Partition(p.tensor, p.start, p.stop, k) for p, k in zip(parts, ks, strict=True)]


# --- Algorithm 4: bin packing -----------------------------------------------------------------


def cost(p: Partition) -> float:
    """Selection cost ``n_x * log(k_x + 1)`` (Eq. 3, with ``k + 1``: see the module docstring)."""
    return p.size * math.log(p.k + 1)


def pack(costs: Sequence[float], n_bins: int) -> list[list[int]]:
    """Algorithm 4's policy (LPT): items by decreasing cost (ties: lower index first), each into
    the bin with the smallest load so far (ties: lower bin). Returns item indices per bin.

    Bound (checked by the tests): ``max(load) - min(load) <= max(costs)``. The last item put into
    the fullest bin went to the lightest bin at the time, and loads only grow. It follows that
    ``max(load) <= sum(costs) / n_bins + max(costs)``, and Graham's LPT bound gives
    ``max(load) <= (4/3 - 1/(3 n_bins)) * OPT``.
    """
    if n_bins < 1:
        raise ConfigError(f"n_clients: must be >= 1, got {n_bins}")
    loads = [0.0] * n_bins
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):
        b = min(range(n_bins), key=lambda j: loads[j])
        bins[b].append(i)
        loads[b] += costs[i]
    return bins


def loads(alloc: Sequence[DeftAllocation]) -> list[float]:
    """Each client's total selection cost: what :func:`pack` balanced."""
    return [sum(cost(Partition(p.tensor, p.start, p.stop, p.k)) for p in a.partitions) for a in alloc]


# --- the round's plan -------------------------------------------------------------------------


def plan_round(
    numels: Sequence[int], norms: Sequence[float] | None, density: float, n_clients: int, round: int
) -> list[DeftAllocation]:
    """Every client's allocation for this round, client ``i`` at index ``i``.

    ``norms`` is one L2 norm per tensor (model order), the clients' reported median, or None in
    the first round (k proportional to size). Parts of a split tensor share its norm as
    ``N * sqrt(part / tensor)``.
    """
    parts = partition_layers(numels, n_clients)
    part_norms = None
    if norms is not None:
        if len(norms) != len(numels):
            raise ValueError(f"norms: {len(norms)} values for {len(numels)} tensors")
        part_norms = [float(norms[p.tensor]) * math.sqrt(p.size / int(numels[p.tensor])) for p in parts]
    return _allocate(assign_k(parts, part_norms, density), n_clients, round)


def plan_round_from_aggregate(
    aggregate: Sequence[torch.Tensor], density: float, n_clients: int, round: int
) -> list[DeftAllocation]:
    """:func:`plan_round` with the exact L2 norm of every partition of the previous aggregated
    update ``aggregate`` (its tensors in model order), as Algorithm 3 has it."""
    flats = [t.detach().reshape(-1).to(torch.float32) for t in aggregate]
    parts = partition_layers([f.numel() for f in flats], n_clients)
    part_norms = [float(torch.linalg.vector_norm(flats[p.tensor][p.start : p.stop])) for p in parts]
    return _allocate(assign_k(parts, part_norms, density), n_clients, round)


def _allocate(parts: list[Partition], n_clients: int, round: int) -> list[DeftAllocation]:
    bins = pack([cost(p) for p in parts], n_clients)
    out = []
    for i in range(n_clients):
        mine = sorted((parts[j] for j in bins[(round + i) % n_clients]), key=lambda p: (p.tensor, p.start))
        out.append(DeftAllocation(round, tuple(DeftPartition(p.tensor, p.start, p.stop, p.k) for p in mine)))
    return out


def ranges_for(alloc: DeftAllocation, n_tensors: int) -> list[tuple[Range, ...]]:
    """Per tensor (model order), the sorted ``(start, stop, k)`` ranges for ``TopK(ranges=...)``;
    ``()`` for a tensor the client was given nothing of. Expects a checked allocation."""
    out: list[list[Range]] = [[] for _ in range(n_tensors)]
    for p in alloc.partitions:
        out[p.tensor].append((p.start, p.stop, p.k))
    return [tuple(sorted(r)) for r in out]


# --- untrusted input --------------------------------------------------------------------------


def check_allocation(
    alloc: DeftAllocation,
    numels: Sequence[int],
    *,
    expected_round: int | None = None,
    max_partitions: int = MAX_PARTITIONS,
) -> None:
    """What a client checks before using an allocation from the wire: raises
    :class:`PayloadError` on too many partitions, a tensor index out of range, ``start >= stop``,
    ``stop`` beyond the tensor, ``k`` outside ``[1, stop - start]``, overlapping partitions, or
    (when ``expected_round`` is given) another round."""
    if expected_round is not None and alloc.round != expected_round:
        raise PayloadError("", f"allocation is for round {alloc.round}, expected {expected_round}")
    if len(alloc.partitions) > max_partitions:
        raise PayloadError("", f"allocation has {len(alloc.partitions)} partitions, more than {max_partitions}")
    for j, p in enumerate(alloc.partitions):
        where = f"allocation partition {j}"
        if not 0 <= p.tensor < len(numels):
            raise PayloadError("", f"{where}: tensor index {p.tensor} is not in [0, {len(numels)})")
        if not 0 <= p.start < p.stop:
            raise PayloadError("", f"{where}: range [{p.start}, {p.stop}) is empty or negative")
        if p.stop > int(numels[p.tensor]):
            raise PayloadError("", f"{where}: stop {p.stop} exceeds tensor {p.tensor}'s {numels[p.tensor]} elements")
        if not 1 <= p.k <= p.stop - p.start:
            raise PayloadError("", f"{where}: k {p.k} is not in [1, {p.stop - p.start}]")
    ordered = sorted(alloc.partitions, key=lambda p: (p.tensor, p.start))
    for a, b in itertools.pairwise(ordered):
        if a.tensor == b.tensor and b.start < a.stop:
            raise PayloadError(
                "",
                f"allocation partitions [{a.start}, {a.stop}) and [{b.start}, {b.stop}) of tensor {a.tensor} overlap",
            )


def check_selection(positions_or_dense: torch.Tensor, ranges: Sequence[Range], name: str = "") -> None:
    """What the server checks on a client's decoded tensor: raises :class:`PayloadError` (naming
    ``name``) when a non-zero lies outside the client's ``ranges`` or a range holds more than its
    ``k``. Pass the decoded positions (an integer tensor) or the dense decoded tensor (a float
    tensor: its non-zeros are checked; a selected value that is exactly zero is not seen)."""
    t = positions_or_dense
    idx = t.reshape(-1).nonzero().view(-1) if t.is_floating_point() else t.reshape(-1)
    check_positions(idx, tuple(sorted((int(a), int(b), int(k)) for a, b, k in ranges)), name)
