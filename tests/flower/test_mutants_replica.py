"""records.py and ServerReplica details the round tests leave loose (found by mutation testing,
``scripts/mutation.sh flower``): dtype checks and conversions, what the digest covers, the dense
size, that the replica owns its tensors, the full-replica cache across versions, and the log's
byte cap."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from flwr.app import ArrayRecord

from fedcomp.codecs import ThreeLC
from fedcomp.errors import ConfigError
from fedcomp.flower.records import digest, fp32_bytes, record_from_tensors, tensors_from_record
from fedcomp.flower.replica import Downlink, ServerReplica
from fedcomp.wire.serde import update_from_bytes
from tests.flower.helpers import MIN_NUMEL, local_delta, tiny_model

CODEC = ThreeLC(s=1.0)


# --- records ----------------------------------------------------------------------------------------


def test_tensors_from_record_are_float32_in_order() -> None:
    src = OrderedDict([("z", torch.ones(2, 3, dtype=torch.float64)), ("a", torch.zeros(4, dtype=torch.float16))])
    got = tensors_from_record(ArrayRecord(src))
    assert list(got) == ["z", "a"]
    assert all(t.dtype == torch.float32 for t in got.values())
    assert got["z"].shape == (2, 3) and torch.equal(got["z"], torch.ones(2, 3))
    assert got["a"].device == torch.device("cpu")


def test_integer_arrays_travel_as_float32_and_those_it_cannot_hold_are_refused_by_name() -> None:
    rec = ArrayRecord(OrderedDict([("w", torch.ones(3)), ("steps", torch.tensor([1, 2]))]))
    got = tensors_from_record(rec)
    assert got["steps"].dtype == torch.float32 and got["steps"].tolist() == [1.0, 2.0]
    rec = ArrayRecord(OrderedDict([("w", torch.ones(3)), ("steps", torch.tensor([1, -(2**24) - 1]))]))
    with pytest.raises(ConfigError) as info:
        tensors_from_record(rec)
    assert str(info.value) == (
        "array 'steps' (torch.int64) holds -16777217: fedcomp carries integer arrays as float32, exact up to "
        "2**24 = 16777216 in magnitude"
    )


def test_record_from_tensors_detaches_and_keeps_order() -> None:
    w = torch.ones(3, requires_grad=True) * 2
    rec = record_from_tensors({"b": w, "a": torch.zeros(2)})
    assert list(rec.keys()) == ["b", "a"]
    back = tensors_from_record(rec)
    assert torch.equal(back["b"], torch.full((3,), 2.0)) and not back["b"].requires_grad


def test_digest_covers_names_shapes_and_values() -> None:
    base = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    d = digest(base)
    assert len(d) == 32 and int(d, 16) >= 0
    assert digest({"w": base["w"].clone()}) == d
    assert digest({"v": base["w"]}) != d  # name
    assert digest({"w": base["w"].reshape(3, 2)}) != d  # shape, same bytes
    changed = base["w"].clone()
    changed[1, 2] += 1e-6
    assert digest({"w": changed}) != d  # one value
    assert digest({"w": base["w"].double()}) == d  # hashed as float32
    assert digest({"w": base["w"], "b": torch.zeros(1)}) != d
    # Order matters: names and bytes are hashed in sequence.
    two = {"a": torch.ones(2), "b": torch.zeros(2)}
    assert digest(two) != digest({"b": two["b"], "a": two["a"]})


def test_fp32_bytes() -> None:
    assert fp32_bytes({}) == 0
    assert fp32_bytes({"a": torch.zeros(2, 5, dtype=torch.float16), "b": torch.zeros(3)}) == 4 * 13


# --- ServerReplica ----------------------------------------------------------------------------------


def test_downlink_nbytes() -> None:
    assert Downlink("chain", (b"ab", b"cde"), 2, "d").nbytes == 5
    assert Downlink("none", (), 2, "d").nbytes == 0


def test_the_replica_owns_float32_copies() -> None:
    w = {k: v.double() for k, v in tiny_model().items()}
    rep = ServerReplica(w, max_log=4, min_numel=MIN_NUMEL)
    assert all(t.dtype == torch.float32 for t in rep.tensors.values())
    w["w1"] += 1.0  # the caller's model changes: the replica does not
    assert torch.equal(rep.tensors["w1"], tiny_model()["w1"])
    assert rep.version == 0 and rep.min_numel == MIN_NUMEL
    assert rep.digest == digest(tiny_model()) == rep.digest_of(0)
    assert rep.digest_of(1) is None
    assert [(s.name, tuple(s.shape)) for s in rep.specs] == [(k, tuple(v.shape)) for k, v in tiny_model().items()]


def test_advance_returns_the_logged_bytes_and_moves_the_version() -> None:
    w = tiny_model()
    rep = ServerReplica(w, max_log=4, min_numel=MIN_NUMEL)
    d = local_delta(3, 1, w, scale=0.05)
    w1 = {k: w[k] + d[k] for k in w}
    data = rep.advance(w1, CODEC)
    assert rep.version == 1
    assert update_from_bytes(data).base_model_version == 0
    assert rep.downlink_for(0, digest(w)).payloads == (data,)
    assert rep.digest == digest(rep.tensors) == rep.digest_of(1)
    assert rep.digest_of(0) == digest(w)
    # Small tensors go dense (exact); large ones through the lossy codec (not exact).
    assert torch.equal(rep.tensors["b"], w1["b"])
    assert not torch.equal(rep.tensors["w1"], w1["w1"])


def test_the_full_replica_follows_the_version() -> None:
    w = tiny_model()
    rep = ServerReplica(w, max_log=4, min_numel=MIN_NUMEL)
    full0 = rep.downlink_for(None, None)
    assert full0.mode == "full" and update_from_bytes(full0.payloads[0]).base_model_version == 0
    assert rep.downlink_for(None, None).payloads == full0.payloads  # cached, same bytes
    d = local_delta(3, 1, w, scale=0.05)
    rep.advance({k: w[k] + d[k] for k in w}, CODEC)
    full1 = rep.downlink_for(None, None)
    assert update_from_bytes(full1.payloads[0]).base_model_version == 1
    assert full1.payloads != full0.payloads
    assert (full1.version, full1.digest) == (1, rep.digest)


def test_the_log_keeps_at_most_one_dense_model_of_bytes() -> None:
    # Every tensor dense: each delta is as large as the model (plus its envelope), so the log
    # can never hold one: a client one version behind gets the full replica.
    w = tiny_model()
    rep = ServerReplica(w, max_log=8, min_numel=10**9)
    d = local_delta(3, 1, w, scale=0.05)
    rep.advance({k: w[k] + d[k] for k in w}, CODEC)
    assert rep.downlink_for(0, digest(w)).mode == "full"
    assert rep.digest_of(0) is None  # evicted with its delta
    # Compressed deltas fit: the log holds them up to max_log.
    rep2 = ServerReplica(w, max_log=8, min_numel=MIN_NUMEL)
    cur = w
    for r in range(1, 4):
        d = local_delta(3, r, w, scale=0.05)
        cur = {k: cur[k] + d[k] for k in w}
        rep2.advance(cur, CODEC)
    dl = rep2.downlink_for(0, digest(w))
    assert dl.mode == "chain" and len(dl.payloads) == 3


def test_tensors_from_record_move_to_the_device_asked_for() -> None:
    # The meta device stands in for a GPU on a CPU-only machine: only the placement is checked.
    rec = ArrayRecord(OrderedDict([("w", torch.ones(3, dtype=torch.float64))]))
    got = tensors_from_record(rec, "meta")
    assert got["w"].device.type == "meta" and got["w"].dtype == torch.float32
    assert tensors_from_record(rec)["w"].device.type == "cpu"


def test_apply_delta_to_an_empty_model() -> None:
    from fedcomp.flower.replica import apply_delta
    from fedcomp.methods.update import UpdateEncoder
    from fedcomp.wire.serde import update_to_bytes

    data = update_to_bytes(
        UpdateEncoder(CODEC, min_numel=MIN_NUMEL, error_feedback=False).encode({}, base_model_version=0)
    )
    tensors: dict[str, torch.Tensor] = {}
    apply_delta(tensors, data, [], CODEC, 0)
    assert tensors == {}
