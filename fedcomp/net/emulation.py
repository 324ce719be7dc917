"""Emulated wall time of a recorded run on given links: no network needed, the bytes are real.

A synchronous round lasts as long as its slowest client::

    round time = max over the round's clients of
                 compute + downlink bytes / downlink rate + uplink bytes / uplink rate + 2 x latency
                 (+ overhead: fixed per-round work outside the clients' training, e.g. codecs)

(latency one-way, paid once down and once up). Bytes are the ones ``results.json`` recorded per
client (``clients.downlink_bytes`` / ``clients.uplink_bytes``: what crossed the wire, payloads
only). Links: one :class:`~fedcomp.net.links.LinkProfile` for every client, or each client's own as
its bandwidth report recorded (``client_links``). Compute: ``seconds_per_iter`` x the client's
local iterations (``client_local_iters``, else the run config's ``local-iters``), or the client's
recorded ``client_train_seconds``. ``overhead_s`` is added to every round that had clients (the
server's and a client's compression and decompression, measured by the caller). A client that was sent work but never replied (dead, or
rejected) holds the round for ``round-timeout``.

:func:`time_to_accuracy` then gives the emulated time at which a run first reaches an accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedcomp.net.links import LinkProfile

__all__ = ["EmulatedRound", "emulate_run", "time_to_accuracy"]


@dataclass(frozen=True)
class EmulatedRound:
    round: int
    accuracy: float
    round_s: float  # this round's emulated duration
    time_s: float  # emulated time since the start, this round included
    slowest: str | None  # the client that set the round's duration
    compute_s: float  # the slowest client's compute part
    transfer_s: float  # the slowest client's transfer + latency part
    overhead_s: float = 0.0  # fixed per-round work outside training (codecs), in round_s


def _client_links(entry: Mapping[str, Any]) -> dict[str, LinkProfile]:
    return {str(k): LinkProfile(*v) for k, v in (entry.get("client_links") or {}).items()}


def emulate_run(
    results: Mapping[str, Any],
    link: LinkProfile | None = None,
    *,
    seconds_per_iter: float | None = None,
    initial_model_free: bool = False,
    overhead_s: float = 0.0,
) -> list[EmulatedRound]:
    """Emulated round durations of a parsed ``results.json`` (round 0 takes no time).

    ``link``: every client's link; None = each client's recorded ``client_links`` (a client
    without one is an error). ``seconds_per_iter``: the compute model; None = the recorded
    ``client_train_seconds`` (0 for a client without one). ``initial_model_free``: round 1's
    downlink costs nothing (the initial model is pre-distributed, as when every worker builds
    it from the same seed); otherwise it is the full fp32 model, for both the dense and the
    compressed run. ``overhead_s``: seconds added to each round with clients (codec time).
    """
    if not overhead_s >= 0:
        raise ValueError(f"overhead_s: must be >= 0 (got {overhead_s})")
    config = results.get("config", {})
    default_iters = int(config.get("local-iters", 1)) if str(config.get("local-iters", "1")).isdigit() else 1
    timeout = float(config.get("round-timeout", 3600.0))
    out: list[EmulatedRound] = []
    now = 0.0
    for entry in results["rounds"]:
        r = int(entry["round"])
        clients = entry.get("clients") or {}
        ids = [str(i) for i in clients.get("ids", [])]
        if r == 0 or not ids:
            out.append(EmulatedRound(r, float(entry["accuracy"]), 0.0, now, None, 0.0, 0.0))
            continue
        links = _client_links(entry)
        iters = {str(k): int(v) for k, v in (entry.get("client_local_iters") or {}).items()}
        trained = {str(k): float(v) for k, v in (entry.get("client_train_seconds") or {}).items()}
        worst: tuple[float, str | None, float, float] = (0.0, None, 0.0, 0.0)
        for i, node in enumerate(ids):
            down, up = int(clients["downlink_bytes"][i]), int(clients["uplink_bytes"][i])
            if initial_model_free and r == 1:
                down = 0
            if int(clients["downlink_bytes"][i]) > 0 and up == 0:  # sent work, never answered
                cand = (timeout, node, 0.0, timeout)
            else:
                lk = link if link is not None else links.get(node)
                if lk is None:
                    raise ValueError(f"round {r}: client {node} has no recorded link; pass link=")
                if seconds_per_iter is not None:
                    compute = seconds_per_iter * iters.get(node, default_iters)
                else:
                    compute = trained.get(node, 0.0)
                transfer = lk.downlink_seconds(down) + lk.uplink_seconds(up) + 2 * lk.latency_ms / 1000.0
                cand = (compute + transfer, node, compute, transfer)
            if cand[0] > worst[0]:
                worst = cand
        round_s = worst[0] + overhead_s
        now += round_s
        out.append(EmulatedRound(r, float(entry["accuracy"]), round_s, now, worst[1], worst[2], worst[3], overhead_s))
    return out


def time_to_accuracy(rounds: Sequence[EmulatedRound], target: float) -> tuple[float, int] | None:
    """``(emulated seconds, round)`` when the run first reaches ``target``; None if it never does."""
    for r in rounds:
        if r.accuracy >= target:
            return r.time_s, r.round
    return None
