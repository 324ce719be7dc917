"""ServerReplica: which downlink each client gets ("none", "chain", "full"), that a chain rebuilds
the server's replica bit for bit, the bounded delta log, and that a broken chain is caught."""

from __future__ import annotations

import pytest
import torch

from fedcomp.codecs import DenseFP32, ThreeLC
from fedcomp.errors import PayloadError
from fedcomp.flower.records import digest
from fedcomp.flower.replica import ServerReplica, apply_delta
from fedcomp.methods.update import decode_update, specs_of
from fedcomp.wire.serde import update_from_bytes
from tests.flower.helpers import MIN_NUMEL, local_delta, tiny_model

CODEC = ThreeLC(s=1.0)


def _server(max_log: int = 8, min_numel: int = MIN_NUMEL) -> tuple[ServerReplica, dict[str, torch.Tensor]]:
    w = tiny_model()
    return ServerReplica(w, max_log=max_log, min_numel=min_numel), w


def _advance(
    rep: ServerReplica, w: dict[str, torch.Tensor], rounds: int
) -> tuple[dict[str, torch.Tensor], list[bytes]]:
    """Move the global model ``rounds`` times and sync the replica; return W and the deltas sent."""
    sent = []
    for _ in range(rounds):
        d = local_delta(7, rep.version + 1, w, scale=0.05)
        w = {k: w[k] + d[k] for k in w}
        sent.append(rep.advance(w, CODEC))
    return w, sent


def _clone(t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in t.items()}


def _apply_chain(client: dict[str, torch.Tensor], version: int, payloads: tuple[bytes, ...] | list[bytes]) -> int:
    specs = specs_of(client)
    for data in payloads:
        apply_delta(client, data, specs, CODEC, version)
        version += 1
    return version


def _bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_an_up_to_date_client_gets_nothing() -> None:
    rep, w = _server()
    dl = rep.downlink_for(0, digest(w))
    assert (dl.mode, dl.payloads, dl.nbytes, dl.version, dl.digest) == ("none", (), 0, 0, rep.digest)
    _advance(rep, w, 2)
    dl = rep.downlink_for(2, rep.digest)
    assert dl.mode == "none" and dl.payloads == () and dl.version == 2


@pytest.mark.parametrize("behind", [1, 2, 3])
def test_a_chain_holds_exactly_the_missing_deltas_and_rebuilds_the_replica(behind: int) -> None:
    rep, w = _server()
    client = _clone(rep.tensors)
    w, sent = _advance(rep, w, 3)
    # The client kept up until version 3 - behind.
    start = 3 - behind
    _apply_chain(client, 0, sent[:start])
    assert digest(client) == rep.digest_of(start)
    dl = rep.downlink_for(start, digest(client))
    assert dl.mode == "chain"
    assert dl.payloads == tuple(sent[start:])
    assert dl.nbytes == sum(len(b) for b in sent[start:])
    assert (dl.version, dl.digest) == (3, rep.digest)
    assert _apply_chain(client, start, dl.payloads) == 3
    assert _bit_identical(client, rep.tensors)
    assert digest(client) == dl.digest
    # 3LC is lossy: the replica is not the global model (which is why W and R are kept apart).
    assert not _bit_identical(rep.tensors, w)


def test_unknown_or_wrong_digest_clients_get_the_full_replica() -> None:
    rep, w = _server()
    _advance(rep, w, 2)
    for version, dig in ((None, None), (1, "0" * 32), (2, "0" * 32), (1, rep.digest_of(0)), (7, rep.digest)):
        dl = rep.downlink_for(version, dig)
        assert dl.mode == "full", (version, dig)
        assert len(dl.payloads) == 1 and dl.nbytes == len(dl.payloads[0])
        assert (dl.version, dl.digest) == (rep.version, rep.digest)
        # The full payload is the replica itself, dense fp32, stamped with its version.
        update = update_from_bytes(dl.payloads[0])
        assert update.base_model_version == rep.version
        got = decode_update(update, rep.specs, [DenseFP32()])
        assert _bit_identical(got, rep.tensors)
        assert digest(got) == dl.digest


def test_full_when_the_replica_is_smaller_than_the_chain() -> None:
    # Every tensor below min_numel: the "deltas" are dense fp32, as large as the replica itself.
    rep, w = _server(min_numel=10**9)
    client = _clone(rep.tensors)
    _, sent = _advance(rep, w, 2)
    full = rep.downlink_for(None, None)
    assert sum(len(b) for b in sent) > full.nbytes
    dl = rep.downlink_for(0, digest(client))
    assert dl.mode == "full" and dl.payloads == full.payloads
    # The same client with compressed deltas gets a chain (the choice is by size).
    rep2, w2 = _server()
    _advance(rep2, w2, 2)
    assert rep2.downlink_for(0, rep2.digest_of(0)).mode == "chain"


def test_log_eviction_at_max_log() -> None:
    rep, w = _server(max_log=3)
    client = _clone(rep.tensors)
    _, sent = _advance(rep, w, 5)
    assert rep.version == 5
    # Exactly at the edge (version 5 - 3): the three logged deltas.
    _apply_chain(client, 0, sent[:2])
    edge = rep.downlink_for(2, digest(client))
    assert edge.mode == "chain" and edge.payloads == tuple(sent[2:])
    _apply_chain(client, 2, edge.payloads)
    assert _bit_identical(client, rep.tensors)
    # One version older: its first delta was evicted.
    older = rep.downlink_for(1, digest(_apply_prefix(rep, sent, 1)))
    assert older.mode == "full"
    # Digests of evicted versions are forgotten; those still reachable are kept.
    assert rep.digest_of(0) is None and rep.digest_of(1) is None
    assert rep.digest_of(2) is not None and rep.digest_of(5) == rep.digest
    assert rep.digest_of(6) is None


def _apply_prefix(rep: ServerReplica, sent: list[bytes], n: int) -> dict[str, torch.Tensor]:
    client = tiny_model()
    _apply_chain(client, 0, sent[:n])
    return client


def test_a_zero_length_log_always_sends_the_full_replica() -> None:
    rep, w = _server(max_log=0)
    _advance(rep, w, 1)
    assert rep.downlink_for(1, rep.digest).mode == "none"
    assert rep.downlink_for(0, digest(tiny_model())).mode == "full"


def _caught(client: dict[str, torch.Tensor], payloads: list[bytes], want: str) -> bool:
    """True when applying ``payloads`` raises PayloadError or ends on another digest."""
    try:
        _apply_chain(client, 0, payloads)
    except PayloadError:
        return True
    return digest(client) != want


@pytest.mark.parametrize(
    "breakage",
    [
        pytest.param(lambda p: [p[0], p[2]], id="dropped-middle"),
        pytest.param(lambda p: [p[1], p[2]], id="dropped-first"),
        pytest.param(lambda p: [p[0], p[1]], id="dropped-last"),
        pytest.param(lambda p: [p[1], p[0], p[2]], id="swapped"),
        pytest.param(lambda p: [p[0], p[0], p[1], p[2]], id="repeated"),
    ],
)
def test_a_broken_chain_is_caught(breakage) -> None:  # type: ignore[no-untyped-def]
    rep, w = _server()
    _advance(rep, w, 3)
    dl = rep.downlink_for(0, rep.digest_of(0))
    assert dl.mode == "chain" and len(dl.payloads) == 3
    assert _caught(tiny_model(), breakage(list(dl.payloads)), dl.digest)
    # The intact chain is not "caught" (the check above can fail).
    assert not _caught(tiny_model(), list(dl.payloads), dl.digest)


def test_apply_delta_rejects_a_delta_made_against_another_version() -> None:
    rep, w = _server()
    _, sent = _advance(rep, w, 2)
    client = tiny_model()
    with pytest.raises(PayloadError):
        apply_delta(client, sent[1], specs_of(client), CODEC, 0)
    assert _bit_identical(client, tiny_model())  # nothing half-applied


# --- state for a checkpoint ------------------------------------------------------------------


def _saved_and_read(state: dict) -> dict:  # type: ignore[type-arg]
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``: what a checkpoint does."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize("codec", ["3lc", "lattice"])
def test_a_replica_comes_back_from_its_state_and_serves_the_same_downlinks(codec: str) -> None:
    from fedcomp.codecs import Lattice

    rep, w = _server(max_log=3)
    for r in range(5):  # past the log's length: the oldest deltas have been evicted
        d = local_delta(3, r + 1, w, scale=0.05)
        w = {k: w[k] + d[k] for k in w}
        rep.advance(w, Lattice(step=8.0) if codec == "lattice" else CODEC)
    back = ServerReplica.from_state_dict(_saved_and_read(rep.state_dict()))
    assert back.version == rep.version == 5 and back.digest == rep.digest and back.grid == rep.grid
    assert (back.grid is not None) == (codec == "lattice") and back._lattice_from == rep._lattice_from
    assert _bit_identical(back.tensors, rep.tensors) and list(back._log) == list(rep._log)
    for version in range(6):  # evicted, in the log, up to date; an unknown digest
        for known in (rep.digest_of(version), "0" * 32):
            assert back.downlink_for(version, known) == rep.downlink_for(version, known)
    # and both advance alike
    d = local_delta(3, 9, w, scale=0.05)
    w = {k: w[k] + d[k] for k in w}
    step = Lattice(step=8.0) if codec == "lattice" else CODEC
    assert back.advance(w, step) == rep.advance(w, step) and back.digest == rep.digest


def _tampered(**change: object) -> dict:  # type: ignore[type-arg]
    rep, w = _server()
    _advance(rep, w, 2)
    state = rep.state_dict()
    for key, value in change.items():
        if value is KeyError:
            del state[key.replace("_", "-")]
        else:
            state[key.replace("_", "-")] = value
    return state


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"version": KeyError}, "KeyError: 'version'"),
        ({"version": True}, "'version' is True"),
        ({"version": 1}, "log entry 0 is not \\[version 0"),  # (its log ends at 2)
        ({"max_log": -1}, "'max-log' is -1"),
        ({"log": [[1, b"x"], [3, b"y"]]}, "log entry 1 is not \\[version 2"),
        ({"log": [[2, "not bytes"]]}, "log entry 0"),
        ({"digests": {"2": "abc"}}, "'digests'"),
        ({"grid": {"w": 500}}, "'grid'"),
        ({"lattice_from": 7}, "'lattice-from' is 7"),
        ({"tensors": {}}, "'tensors' is not a dict of tensors"),
        ({"tensors": {"w": torch.zeros(3, dtype=torch.float64)}}, "tensor 'w' is not a float32 tensor"),
    ],
)
def test_a_malformed_replica_state_is_a_payload_error_naming_the_field(change: dict, named: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(PayloadError, match=named):
        ServerReplica.from_state_dict(_tampered(**change))


def test_a_replica_state_whose_tensors_changed_is_refused() -> None:
    state = _tampered()
    name = next(iter(state["tensors"]))
    state["tensors"] = {**state["tensors"], name: state["tensors"][name] + 1e-3}
    with pytest.raises(PayloadError, match="their digest differs"):
        ServerReplica.from_state_dict(state)
