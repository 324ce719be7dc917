"""The "auto" downlink: each round, the smallest candidate downlink that keeps the replica close.

The aggregate of sparse uplinks is spiky, and how well a downlink codec delivers it varies from
round to round: in one round 3LC delivers most of ``W - R``, in the next its max-based scale rounds
most of it to zero and the replica ``R`` that clients train from falls behind (issue 12,
docs/compression_gap.md). So the server tries every candidate (``downlink-candidates``, e.g.
``3lc,3lc*2,sparse-fp16,sparse-fp32,dense-fp32``) on a scratch copy of the replica, measures the
bytes it would send and the replica lag it would leave, ``||W - R_after|| / ||W - W_prev||``, and
commits the smallest candidate whose lag is at most ``replica-lag-max`` through the replica's
normal :meth:`~fedcomp.flower.replica.ServerReplica.advance`; if none meets the bound, the one
with the least lag (ties: fewer bytes, then the earlier candidate). Trials never touch the replica
itself, so a client's replica is built only from what was sent.

The cost is one encode and decode per candidate pass per round on the server (measured in the
round's ``fedcomp.server-codec-seconds``) and, transiently, two copies of the replica: the best
trial's so far and the one being tried (each trial's copy used to be kept to the end: five
copies with the default candidates, 510 MB for a ResNet-50).
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass

import torch

from fedcomp.codecs import Codec, DenseFP16, DenseFP32, Sparse, ThreeLC, get_codec
from fedcomp.flower.records import sum_of_squares
from fedcomp.flower.replica import ServerReplica
from fedcomp.methods.base import DownlinkMethod
from fedcomp.methods.config import CompressionConfig
from fedcomp.methods.registry import get_downlink

__all__ = [
    "Trial",
    "advance_by_policy",
    "advance_passes",
    "candidates_of",
    "chain_decoders",
    "choose",
    "distance",
    "try_candidate",
]

log = logging.getLogger("flwr").getChild("fedcomp")

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Trial:
    """What one candidate would do this round: bytes every up-to-date client would get, the
    passes it made, the distance ``||W - R||`` it leaves and that as a lag."""

    method: type[DownlinkMethod]
    max_passes: int
    passes: int
    nbytes: int
    after: float
    lag: float

    @property
    def name(self) -> str:
        return self.method.method_id + (f"*{self.max_passes}" if self.max_passes > 1 else "")


def distance(a: Tensors, b: Tensors) -> float:
    """L2 norm of ``a - b`` over every tensor: each difference and its square in float64, summed
    in float64 (:func:`~fedcomp.flower.records.sum_of_squares`: the server takes three or more of
    these a round), with one wait for a device."""
    if not a:
        return 0.0
    return math.sqrt(float(torch.stack([sum_of_squares(a[k], b[k]) for k in a]).sum()))


def lag_of(after: float, moved: float) -> float:
    """``after / moved``; when the model did not move, 0 if the replica is exact, else infinite."""
    if moved > 0:
        return after / moved
    return 0.0 if after == 0.0 else math.inf


def advance_passes(
    replica: ServerReplica,
    target: Tensors,
    method: type[DownlinkMethod],
    max_passes: int,
    moved: float,
    lag_max: float,
    config: CompressionConfig,
    server_round: int,
) -> tuple[int, int, float]:
    """Advance ``replica`` by up to ``max_passes`` deltas of ``method``'s codec, stopping once the
    replica is exact or its lag is at most ``lag_max`` (the rule of ``downlink-passes``).
    Returns (passes, bytes, ||W - R|| after)."""
    codec = get_codec(method.codec_config(config, server_round))
    nbytes, passes, after = 0, 0, None
    for _ in range(max_passes):
        nbytes += len(replica.advance(target, codec))
        passes += 1
        after = distance(target, replica.tensors)
        if after == 0.0 or (moved > 0 and after / moved <= lag_max):
            break
    return passes, nbytes, distance(target, replica.tensors) if after is None else after


def try_candidate(
    replica: ServerReplica,
    target: Tensors,
    method: type[DownlinkMethod],
    max_passes: int,
    moved: float,
    config: CompressionConfig,
    server_round: int,
) -> Trial:
    """What ``method`` (up to ``max_passes`` passes) would send and leave, measured on a scratch
    copy of ``replica``; ``replica`` itself is not changed."""
    return _trial(replica, target, method, max_passes, moved, config, server_round)[0]


def _trial(
    replica: ServerReplica,
    target: Tensors,
    method: type[DownlinkMethod],
    max_passes: int,
    moved: float,
    config: CompressionConfig,
    server_round: int,
) -> tuple[Trial, ServerReplica]:
    """:func:`try_candidate`, also returning the scratch replica it advanced."""
    scratch = copy.deepcopy(replica)
    passes, nbytes, after = advance_passes(
        scratch, target, method, max_passes, moved, config.replica_lag_max, config, server_round
    )
    return Trial(method, max_passes, passes, nbytes, after, lag_of(after, moved)), scratch


def choose(trials: list[Trial], lag_max: float) -> Trial:
    """The smallest trial with lag at most ``lag_max`` (ties: the earlier); if there is none, the
    one with the least lag (ties: fewer bytes, then the earlier)."""
    if not trials:
        raise ValueError("choose: no candidates")
    meeting = [t for t in trials if t.lag <= lag_max]
    if meeting:
        return min(meeting, key=lambda t: t.nbytes)  # min keeps the first of equals
    return min(trials, key=lambda t: (t.lag, t.nbytes))


def candidates_of(config: CompressionConfig) -> list[tuple[type[DownlinkMethod], int]] | None:
    """The candidates when ``config``'s downlink method is a policy (it has ``candidates``), else None."""
    method = get_downlink(config.downlink_codec)
    candidates = getattr(method, "candidates", None)
    return None if candidates is None else list(candidates(config))


def advance_by_policy(
    replica: ServerReplica,
    target: Tensors,
    moved: float,
    config: CompressionConfig,
    server_round: int,
    candidates: list[tuple[type[DownlinkMethod], int]],
) -> Trial:
    """Try every candidate on a scratch copy, then advance ``replica`` with the chosen one (its
    deltas are what clients get). Returns the chosen trial, as committed.

    The chosen scratch copy is adopted as it is (codecs are deterministic, so encoding the chosen
    candidate again would give the same bytes and the same replica)."""
    replica.digest_of(replica.version)  # (the current version hashed here, once, not in each trial's copy)
    trials: list[Trial] = []
    best: tuple[Trial, ServerReplica] | None = None
    for method, max_passes in candidates:
        trial, scratch = _trial(replica, target, method, max_passes, moved, config, server_round)
        trials.append(trial)
        # choose() as the trials come (it keeps the first of equals, as min does), so that only
        # the best trial's scratch copy outlives the next trial.
        if best is None or choose([best[0], trial], config.replica_lag_max) is trial:
            best = (trial, scratch)
        del scratch
    if best is None:
        raise ValueError("advance_by_policy: no candidates")
    done = best[0]
    vars(replica).update(vars(best[1]))
    log.info(
        "fedcomp: round %s: downlink %s (%s B, lag %.3g); tried %s",
        server_round,
        done.name,
        done.nbytes,
        done.lag,
        ", ".join(f"{t.name} {t.nbytes} B lag {t.lag:.3g}" for t in trials),
    )
    return done


def chain_decoders() -> list[Codec]:
    """What a client needs to decode any delta of an "auto" chain: under "auto" the codec changes
    from round to round, so a client that was away gets a chain that mixes them, while its
    downlink header names only this round's. These decoders need no setting of their own (3LC
    reads its scale and zero-run flag from the payload, the sparse codec its value encoding, the
    dense ones check their fixed encoding); put the header's codec after them, so it wins."""
    return [ThreeLC(), Sparse(), DenseFP16(), DenseFP32()]
