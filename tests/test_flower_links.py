"""The server-coordinated uplinks without a Flower run: DEFT allocations and checks, GradiVeQ
phases, compressor broadcast and compressed-domain aggregation, on real protobuf bytes.

(``tests/test_flower_methods.py`` runs both through real Flower simulations.)
"""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context, RecordDict

from fedcomp.app.models import LeNet5Caffe
from fedcomp.codecs import SBC, DenseFP32, TopK
from fedcomp.errors import PayloadError
from fedcomp.flower.mod import MethodState
from fedcomp.flower.settings import CompressionConfig
from fedcomp.methods.base import ClientRound
from fedcomp.methods.deft_uplink import DeftUplink, client_codecs
from fedcomp.methods.gradiveq_uplink import GradiVeQUplink
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire.payloads import DeftAllocation, DeftPartition
from fedcomp.wire.serde import allocation_to_bytes, update_from_bytes, update_to_bytes

MIN_NUMEL = 1000


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in LeNet5Caffe().state_dict().items()}


def _deltas(n: int, seed: int = 1, rank: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Client updates; with ``rank``, every row of every matrix lies in one shared rank-``rank``
    subspace (the structure GradiVeQ's PCA finds)."""
    g = torch.Generator().manual_seed(seed)
    model = _model()
    out = []
    gb = torch.Generator().manual_seed(12345)  # the same subspace whatever ``seed``
    bases = {k: torch.randn(rank, v[0].numel(), generator=gb) for k, v in model.items() if v.dim() > 1} if rank else {}
    for _ in range(n):
        d = {}
        for k, v in model.items():
            if k in bases:
                d[k] = (torch.randn(v.shape[0], rank, generator=g) @ bases[k]).reshape(v.shape) * 1e-3
            else:
                d[k] = torch.randn(v.shape, generator=g) * 1e-3
        out.append(d)
    return out


# --- DEFT ------------------------------------------------------------------------------------


def _deft() -> DeftUplink:
    return DeftUplink(CompressionConfig.from_run_config({"uplink-codec": "deft", "min-compress-numel": MIN_NUMEL}))


def _encode_deft(alloc: bytes, delta: dict[str, torch.Tensor], rnd: int) -> bytes:
    codecs = client_codecs(alloc, delta, MIN_NUMEL, rnd)
    enc = UpdateEncoder(TopK(p=0.01), min_numel=MIN_NUMEL)
    return update_to_bytes(enc.encode(delta, base_model_version=0, codecs=codecs))


def test_deft_selections_are_disjoint_and_sum_to_the_density() -> None:
    model, deltas = _model(), _deltas(3)
    specs = specs_of(model)
    planner = _deft()
    allocs = planner.plan(1, [30, 10, 20], specs, density=0.01)
    assert sorted(allocs) == [10, 20, 30]
    union: dict[str, torch.Tensor] = {}
    for node, delta in zip(sorted(allocs), deltas, strict=True):
        decoded = decode_update(
            update_from_bytes(_encode_deft(allocs[node], delta, 1)), specs, [TopK(p=0.01), DenseFP32()]
        )
        planner.check(node, decoded, specs)  # honest clients pass
        for name, t in decoded.items():
            if t.numel() < MIN_NUMEL:
                continue
            nz = t.reshape(-1) != 0
            assert not (union.get(name, torch.zeros_like(nz)) & nz).any(), "two clients sent the same entry"
            union[name] = union.get(name, torch.zeros_like(nz)) | nz
    sent = sum(int(m.sum()) for m in union.values())
    total = sum(s.numel for s in specs if s.numel >= MIN_NUMEL)
    assert abs(sent / total - 0.01) < 1e-4, sent / total


def test_deft_rejects_a_client_selecting_outside_its_partitions() -> None:
    model, (delta,) = _model(), _deltas(1)
    specs = specs_of(model)
    planner = _deft()
    allocs = planner.plan(1, [1, 2], specs, density=0.01)
    # A greedy client sends its own top 1 % of every tensor, ignoring the allocation.
    greedy = UpdateEncoder(TopK(p=0.01), min_numel=MIN_NUMEL).encode(delta)
    decoded = decode_update(update_from_bytes(update_to_bytes(greedy)), specs, [TopK(p=0.01), DenseFP32()])
    with pytest.raises(PayloadError, match="outside|more than|no range"):
        planner.check(1, decoded, specs)
    with pytest.raises(PayloadError, match="no DEFT allocation"):
        planner.check(99, decoded, specs)
    # node 2's allocation is untouched by node 1's rejection
    planner.check(
        2,
        decode_update(update_from_bytes(_encode_deft(allocs[2], delta, 1)), specs, [TopK(p=0.01), DenseFP32()]),
        specs,
    )


def test_deft_checks_positions_and_values_as_it_checks_dense_tensors() -> None:
    """What the server's running sum gives it (positions and values, never a dense tensor): the
    same verdict and words as the dense decode's, and a value that is zero is not a selection."""
    model, (delta,) = _model(), _deltas(1)
    specs = specs_of(model)
    planner = _deft()
    allocs = planner.plan(1, [1, 2], specs, density=0.01)

    def as_terms(dense: dict[str, torch.Tensor]) -> dict[str, object]:
        out: dict[str, object] = {}
        for name, t in dense.items():
            flat = t.reshape(-1)
            idx = flat.nonzero().view(-1)
            out[name] = (idx, flat[idx])
        return out

    greedy = UpdateEncoder(TopK(p=0.01), min_numel=MIN_NUMEL).encode(delta)
    decoded = decode_update(update_from_bytes(update_to_bytes(greedy)), specs, [TopK(p=0.01), DenseFP32()])
    with pytest.raises(PayloadError) as dense_error:
        planner.check(1, decoded, specs)
    with pytest.raises(PayloadError) as terms_error:
        planner.check(1, as_terms(decoded), specs)  # type: ignore[arg-type]
    assert str(terms_error.value) == str(dense_error.value)
    honest = decode_update(update_from_bytes(_encode_deft(allocs[2], delta, 1)), specs, [TopK(p=0.01), DenseFP32()])
    terms = as_terms(honest)
    planner.check(2, terms, specs)  # type: ignore[arg-type]
    # a zero value anywhere (outside the allocation, even) selects nothing
    name = next(s.name for s in specs if s.numel >= MIN_NUMEL)
    idx, values = terms[name]  # type: ignore[misc]
    terms[name] = (torch.cat([idx, torch.tensor([int(idx.max()) + 1])]), torch.cat([values, torch.zeros(1)]))
    planner.check(2, terms, specs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "partitions, why",
    [
        ((DeftPartition(99, 0, 10, 1),), "tensor index"),
        ((DeftPartition(2, 0, 10**9, 1),), "exceeds"),
        ((DeftPartition(2, 0, 100, 1), DeftPartition(2, 50, 150, 1)), "overlap"),
        ((DeftPartition(2, 0, 10, 11),), "k 11"),
    ],
)
def test_deft_client_rejects_hostile_allocations(partitions: tuple, why: str) -> None:
    data = allocation_to_bytes(DeftAllocation(1, partitions))
    with pytest.raises(PayloadError, match=why):
        client_codecs(data, _model(), MIN_NUMEL, 1)
    with pytest.raises(PayloadError, match="round"):
        client_codecs(allocation_to_bytes(DeftAllocation(5, ())), _model(), MIN_NUMEL, 1)
    with pytest.raises(PayloadError):
        client_codecs(b"\xff\xff\xff", _model(), MIN_NUMEL, 1)


def test_deft_norms_follow_the_aggregate() -> None:
    specs = specs_of(_model())
    planner = _deft()
    agg = {s.name: torch.zeros(s.shape) for s in specs}
    agg["fc2.weight"] += 1.0  # all the change in one layer: it should get (nearly) all of k
    planner.observe(agg)
    allocs = planner.plan(2, [1, 2], specs, density=0.01)
    from fedcomp.wire.serde import allocation_from_bytes

    k = {}
    for data in allocs.values():
        for p in allocation_from_bytes(data).partitions:
            k[specs[p.tensor].name] = k.get(specs[p.tensor].name, 0) + p.k
    assert k["fc2.weight"] > 0.9 * sum(k.values()), k


# --- GradiVeQ --------------------------------------------------------------------------------


def _context(node: int) -> Context:
    return Context(run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={})


def _gvq_config(**kw: object) -> CompressionConfig:
    base = {"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 1, "gradiveq-refresh": 2, "gradiveq-eps": 0.05}
    return CompressionConfig.from_run_config({**base, **kw})


def _round(ctx: Context, cfg: dict, model: dict[str, torch.Tensor], extras: dict[str, bytes], rnd: int) -> ClientRound:
    return ClientRound(cfg, model, MIN_NUMEL, rnd, extras, MethodState(ctx, GradiVeQUplink.method_id))


def _client_encode(
    coord: GradiVeQUplink,
    ctx: Context,
    node: int,
    rnd: int,
    model: dict[str, torch.Tensor],
    delta: dict[str, torch.Tensor],
) -> bytes:
    """What the client mod does: keep a broadcast compressor, encode with the round's codecs."""
    extras = coord.downlink_extras(rnd, [node], specs_of(model)).get(node, {})
    client = _round(ctx, coord.round_codec_config(rnd), model, extras, rnd)
    GradiVeQUplink.client_receive(client)
    base, codecs = GradiVeQUplink.client_codecs(client)
    enc = UpdateEncoder(base, min_numel=MIN_NUMEL, error_feedback=False).encode(delta, 0, codecs)
    coord.note_node(node, GradiVeQUplink.client_status(client.state))
    return update_to_bytes(enc)


def _decode(coord: GradiVeQUplink, data: bytes, model: dict, rnd: int, compressed_domain: bool, node: int = 1) -> dict:
    coord.weighted_mean = compressed_domain  # as the strategy sets it from its inner strategy
    decoded = coord.decode(update_from_bytes(data), specs_of(model), model, rnd, node=node)
    coord.accept(rnd, node)  # (the strategy's, once the reply passed its checks: the samples count)
    return decoded.arrays


def test_gradiveq_phases_broadcast_and_compressed_domain_mean() -> None:
    coord = GradiVeQUplink(_gvq_config())
    model = _model()
    nodes = [1, 2, 3]
    ctxs = {n: _context(n) for n in nodes}
    # Round 1: dense; the updates become PCA samples and a compressor is fitted at its end.
    assert coord.round_codec_config(1) == {"id": "dense-fp32"}
    for n, d in zip(nodes, _deltas(3, seed=1, rank=4), strict=True):
        got = _decode(coord, _client_encode(coord, ctxs[n], n, 1, model, d), model, 1, True, node=n)
        torch.testing.assert_close(got["fc1.weight"], model["fc1.weight"] + d["fc1.weight"])
    assert coord.finish(1, {}, model) is None and coord.version == 1
    # Round 2: compressed; the compressor goes down once per node.
    assert coord.round_codec_config(2) == {"id": "gradiveq", "version": 1}
    assert GradiVeQUplink.COMPRESSOR_KEY in coord.downlink_extras(2, [1], specs_of(model))[1]
    deltas = _deltas(3, seed=7, rank=4)
    weights = [0.5, 0.3, 0.2]
    coeffs, full = [], []
    for n, d in zip(nodes, deltas, strict=True):
        data = _client_encode(coord, ctxs[n], n, 2, model, d)
        assert coord.downlink_extras(2, [n], specs_of(model)) == {}  # it reported holding version 1
        full.append(_decode(coord, data, model, 2, compressed_domain=False))
        coeffs.append(_decode(coord, data, model, 2, compressed_domain=True))  # as the strategy does
    assert coeffs[0]["fc1.weight"].shape[0] == 500  # one coefficient row per slice (fan-in 800)
    # What FedAvg does with the coefficient arrays: a weighted mean; then one decompression.
    mean = {k: sum(w * c[k] for w, c in zip(weights, coeffs, strict=True)) for k in coeffs[0]}
    model_once = coord.finish(2, mean, model)
    assert model_once is not None
    expected = {k: sum(w * f[k] for w, f in zip(weights, full, strict=True)) for k in full[0]}
    for k in model:
        torch.testing.assert_close(model_once[k], expected[k], rtol=1e-4, atol=1e-6)
    # The subspace holds the updates: the mean is close to the true mean update.
    true = sum(w * d["fc1.weight"] for w, d in zip(weights, deltas, strict=True))
    err = (model_once["fc1.weight"] - model["fc1.weight"] - true).norm() / true.norm()
    assert err < 0.3, err
    assert coord.round_metrics(2) == {"gradiveq_version": 1, "gradiveq_compressed": True}


def test_gradiveq_rejects_stale_or_wrong_codec_updates() -> None:
    coord = GradiVeQUplink(_gvq_config())  # cycle: 1 dense round, 2 compressed rounds
    model = _model()
    ctx = _context(1)
    for d in _deltas(2, seed=1, rank=4):
        _decode(coord, _client_encode(coord, ctx, 1, 1, model, d), model, 1, True)
    coord.finish(1, {}, model)
    (d,) = _deltas(1, seed=3, rank=4)
    # A client that sends SBC where GradiVeQ coefficients are due is rejected.
    sbc = update_to_bytes(UpdateEncoder(SBC(p=0.01), min_numel=MIN_NUMEL).encode(d))
    with pytest.raises(PayloadError, match="gradiveq"):
        _decode(coord, sbc, model, 2, True)
    # Coefficients made with an old compressor are rejected after a refit (round 4 is the next
    # cycle's dense round; the fit happens at its end).
    good = _client_encode(coord, ctx, 1, 2, model, d)
    for e in _deltas(2, seed=5, rank=4):
        _decode(coord, _client_encode(coord, ctx, 1, 4, model, e), model, 4, True)
    coord.finish(4, {}, model)
    assert coord.version == 2
    with pytest.raises(PayloadError, match="version"):
        _decode(coord, good, model, 5, True)
    # A client asked for a version it does not hold says so (the mod turns it into a resync).
    with pytest.raises(PayloadError, match="not held"):
        GradiVeQUplink.client_codecs(_round(_context(2), {"id": "gradiveq", "version": 2}, model, {}, 5))


def test_gradiveq_client_rejects_a_corrupt_compressor() -> None:
    client = _round(
        _context(1), {"id": "gradiveq", "version": 1}, _model(), {GradiVeQUplink.COMPRESSOR_KEY: b"\x12\x34garbage"}, 2
    )
    with pytest.raises(PayloadError):
        GradiVeQUplink.client_receive(client)
    assert GradiVeQUplink.client_status(client.state) == {}


def test_gradiveq_phase_schedule() -> None:
    coord = GradiVeQUplink(_gvq_config(**{"gradiveq-dense-rounds": 2, "gradiveq-refresh": 3}))
    assert not any(coord.compressed(r) for r in range(1, 10))  # nothing fitted yet: dense
    coord.compressor = object()  # type: ignore[assignment]
    assert [coord.compressed(r) for r in range(1, 11)] == [False, False, True, True, True] * 2
    once = GradiVeQUplink(_gvq_config(**{"gradiveq-dense-rounds": 2, "gradiveq-refresh": 0}))
    once.compressor = object()  # type: ignore[assignment]
    assert [once.compressed(r) for r in range(1, 7)] == [False, False, True, True, True, True]
