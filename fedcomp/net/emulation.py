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
server's and a client's compression and decompression, measured by the caller). A client that was
sent work but never replied (dead, or rejected) holds the round for ``round-timeout``.

Codec time per part (:class:`CodecTimes`, instead of one ``overhead_s``): each client's own codec
time (applying the downlink, encoding its update) joins its compute and transfer, and the server's
(the round's downlink, decoding every reply) is added once per round. The client then uplinks as
the bandwidth policy would run it (:func:`fedcomp.methods.bandwidth.dense_if_faster`): a client
whose link makes a dense fp32 upload sooner than its recorded compressed one, codec time counted,
goes dense that round: dense bytes, dense encode on the client, dense decode on the server. The
recorded accuracy is kept: a round that went dense sent the whole update (no residual left), so
the run it stands for converges at least as fast as the recorded one; the replay is conservative.

:func:`time_to_accuracy` then gives the emulated time at which a run first reaches an accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedcomp.net.links import LinkProfile

__all__ = ["CodecTimes", "EmulatedRound", "emulate_run", "time_to_accuracy"]


@dataclass(frozen=True)
class EmulatedRound:
    round: int
    accuracy: float
    round_s: float  # this round's emulated duration
    time_s: float  # emulated time since the start, this round included
    slowest: str | None  # the client that set the round's duration
    compute_s: float  # the slowest client's compute part
    transfer_s: float  # the slowest client's transfer + latency part
    overhead_s: float = 0.0  # codec time in round_s: the server's plus the slowest client's
    dense_clients: int = 0  # clients that uplinked dense fp32 this round (``codec`` given)


@dataclass(frozen=True)
class CodecTimes:
    """A compressed run's codec seconds by part (measured by the caller, e.g. ``bench links``).

    Client: ``client_downlink_s`` applies one round's downlink (and checks its digest),
    ``encode_s`` / ``dense_encode_s`` encode its update compressed / as dense fp32. Server:
    ``server_round_s`` makes the round's downlink, ``decode_s`` / ``dense_decode_s`` decode one
    compressed / dense fp32 reply. ``dense_bytes``: the size of a dense fp32 update.
    """

    client_downlink_s: float
    encode_s: float
    dense_encode_s: float
    server_round_s: float
    decode_s: float
    dense_decode_s: float
    dense_bytes: int

    def __post_init__(self) -> None:
        for name in ("client_downlink_s", "encode_s", "dense_encode_s", "server_round_s", "decode_s", "dense_decode_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0 (got {getattr(self, name)})")
        if self.dense_bytes <= 0:
            raise ValueError(f"dense_bytes: must be > 0 (got {self.dense_bytes})")

    def goes_dense(self, link: LinkProfile, uplink_bytes: int) -> bool:
        """The policy's rule (``dense_if_faster``): dense when its codec time plus upload beats
        the compressed update's. The downlink's codec time is the same either way: it cancels."""
        sparse = self.encode_s + link.uplink_seconds(uplink_bytes)
        return self.dense_encode_s + link.uplink_seconds(self.dense_bytes) < sparse


def _client_links(entry: Mapping[str, Any]) -> dict[str, LinkProfile]:
    return {str(k): LinkProfile(*v) for k, v in (entry.get("client_links") or {}).items()}


def emulate_run(
    results: Mapping[str, Any],
    link: LinkProfile | None = None,
    *,
    seconds_per_iter: float | None = None,
    initial_model_free: bool = False,
    overhead_s: float = 0.0,
    codec: CodecTimes | None = None,
) -> list[EmulatedRound]:
    """Emulated round durations of a parsed ``results.json`` (round 0 takes no time).

    ``link``: every client's link; None = each client's recorded ``client_links`` (a client
    without one is an error). ``seconds_per_iter``: the compute model; None = the recorded
    ``client_train_seconds`` (0 for a client without one). ``initial_model_free``: round 1's
    downlink costs nothing, whatever was recorded (the old setting of ``bench links``);
    otherwise round 1 is charged what it recorded: the full fp32 model in a dense run, only a
    digest when the clients built the seeded initial model themselves. ``overhead_s``: seconds added to each round with clients (codec time).
    ``codec``: codec time by part, and each client's uplink as the bandwidth policy would pick it
    (see the module docstring); added to ``overhead_s``.
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
        # (client time, node, compute, transfer, client codec time)
        worst: tuple[float, str | None, float, float, float] = (0.0, None, 0.0, 0.0, 0.0)
        server_s, dense_n = (codec.server_round_s if codec is not None else 0.0), 0
        for i, node in enumerate(ids):
            down, up = int(clients["downlink_bytes"][i]), int(clients["uplink_bytes"][i])
            if initial_model_free and r == 1:
                down = 0
            if int(clients["downlink_bytes"][i]) > 0 and up == 0:  # sent work, never answered
                cand = (timeout, node, 0.0, timeout, 0.0)
            else:
                lk = link if link is not None else links.get(node)
                if lk is None:
                    raise ValueError(f"round {r}: client {node} has no recorded link; pass link=")
                if seconds_per_iter is not None:
                    compute = seconds_per_iter * iters.get(node, default_iters)
                else:
                    compute = trained.get(node, 0.0)
                mine = 0.0
                if codec is not None:
                    dense = codec.goes_dense(lk, up)
                    dense_n += dense
                    up = codec.dense_bytes if dense else up
                    mine = codec.client_downlink_s + (codec.dense_encode_s if dense else codec.encode_s)
                    server_s += codec.dense_decode_s if dense else codec.decode_s
                transfer = lk.downlink_seconds(down) + lk.uplink_seconds(up) + 2 * lk.latency_ms / 1000.0
                cand = (compute + transfer + mine, node, compute, transfer, mine)
            if cand[0] > worst[0]:
                worst = cand
        codec_s = overhead_s + server_s + worst[4]
        round_s = worst[0] + overhead_s + server_s
        now += round_s
        out.append(EmulatedRound(r, float(entry["accuracy"]), round_s, now, worst[1], worst[2], worst[3], codec_s,
                                 dense_n))  # fmt: skip
    return out


def time_to_accuracy(rounds: Sequence[EmulatedRound], target: float) -> tuple[float, int] | None:
    """``(emulated seconds, round)`` when the run first reaches ``target``; None if it never does."""
    for r in rounds:
        if r.accuracy >= target:
            return r.time_s, r.round
    return None
