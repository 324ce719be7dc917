import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import TensorSpec, TopK
from fedcomp.codecs.golomb import decode_positions
from fedcomp.errors import ConfigError, PayloadError
from fedcomp.methods import deft
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire import serde
from fedcomp.wire.payloads import DeftAllocation, DeftPartition

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])

#: LeNet5-Caffe's tensors: conv1 w/b, conv2 w/b, fc1 w/b, fc2 w/b.
LENET = [500, 20, 25_000, 50, 400_000, 500, 5_000, 10]


def covered_once(allocs, numels):
    """Every parameter of every tensor is in exactly one client's partitions."""
    for t, m in enumerate(numels):
        count = torch.zeros(m, dtype=torch.int32)
        for a in allocs:
            for p in a.partitions:
                if p.tensor == t:
                    count[p.start : p.stop] += 1
        assert bool((count == 1).all()), f"tensor {t}"


@st.composite
def plans(draw):
    numels = draw(st.lists(st.integers(0, 5000) | st.sampled_from([1, 2, 3]), min_size=1, max_size=12))
    n = draw(st.integers(1, 9))
    density = draw(st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]) | st.floats(0.0005, 1.0))
    norms = draw(st.none() | st.lists(st.floats(0, 10) | st.just(0.0), min_size=len(numels), max_size=len(numels)))
    return numels, norms, density, n, draw(st.integers(0, 50))


# --- the plan: coverage, k budget, balance ----------------------------------------------------


@given(plans())
@FAST
def test_plan_covers_every_parameter_once_and_hits_the_budget(case):
    numels, norms, density, n, rnd = case
    allocs = deft.plan_round(numels, norms, density, n, rnd)
    assert len(allocs) == n and all(a.round == rnd for a in allocs)
    covered_once(allocs, numels)
    parts = [p for a in allocs for p in a.partitions]
    for a in allocs:
        deft.check_allocation(a, numels, expected_round=rnd)  # the server's own plans pass
    # the stated budget: sum k == max(round(density * total), number of partitions), exactly
    total = sum(numels)
    assert sum(p.k for p in parts) == max(round(density * total), len(parts))
    assert all(1 <= p.k <= p.stop - p.start for p in parts)


@given(plans())
@FAST
def test_cost_balance_within_the_lpt_bound(case):
    numels, norms, density, n, rnd = case
    allocs = deft.plan_round(numels, norms, density, n, rnd)
    loads = deft.loads(allocs)
    costs = [deft.cost(deft.Partition(p.tensor, p.start, p.stop, p.k)) for a in allocs for p in a.partitions]
    biggest = max(costs, default=0.0)
    eps = 1e-9 * (1 + sum(costs))
    assert max(loads) - min(loads) <= biggest + eps
    assert max(loads) <= sum(costs) / n + biggest + eps


@given(st.lists(st.floats(0, 100), max_size=8), st.integers(1, 3))
@FAST
def test_pack_within_graham_bound_of_the_optimum(costs, n_bins):
    bins = deft.pack(costs, n_bins)
    assert sorted(i for b in bins for i in b) == list(range(len(costs)))
    lpt = max(sum(costs[i] for i in b) for b in bins)
    opt = min(  # brute force over every assignment
        (
            max(sum(c for c, b in zip(costs, assign) if b == j) for j in range(n_bins))
            for assign in itertools.product(range(n_bins), repeat=len(costs))
        ),
        default=0.0,
    )
    assert lpt <= (4 / 3 - 1 / (3 * n_bins)) * opt + 1e-9


def test_partition_layers_is_algorithm_2():
    # total 431,080 over 4 clients: only fc1 (400,000 > 107,770) is split, into 4 equal parts
    parts = deft.partition_layers(LENET, 4)
    assert [(p.tensor, p.start, p.stop) for p in parts if p.tensor == 4] == [
        (4, 0, 100_000),
        (4, 100_000, 200_000),
        (4, 200_000, 300_000),
        (4, 300_000, 400_000),
    ]
    assert len(parts) == len(LENET) + 3
    # 10 over 3: sizes 4, 3, 3 (the first numel % n parts one larger); a 0-element tensor: nothing
    assert [(p.start, p.stop) for p in deft.partition_layers([10, 0, 1], 3) if p.tensor == 0] == [
        (0, 4),
        (4, 7),
        (7, 10),
    ]
    assert [p.tensor for p in deft.partition_layers([0, 1], 3)] == [1]
    assert deft.partition_layers(LENET, 1) == [deft.Partition(t, 0, m) for t, m in enumerate(LENET)]


def test_k_follows_the_norms():
    parts = deft.partition_layers([1000, 1000, 1000], 1)
    by_norm = deft.assign_k(parts, [4.0, 1.0, 0.0], 0.1)  # budget 300
    assert [p.k for p in by_norm] == [240, 59, 1]  # 300*4/5, then 60 capped to leave 1 for the last
    by_size = deft.assign_k(deft.partition_layers([100, 300], 1), None, 0.5)
    assert [p.k for p in by_size] == [50, 150]
    # a small partition with a large norm is capped at its size; the rest goes elsewhere
    capped = deft.assign_k(deft.partition_layers([5, 1000], 1), [100.0, 1.0], 0.2)  # budget 201
    assert [p.k for p in capped] == [5, 196]
    # the size cap of a later partition: its share goes back to those with room
    # (budget round(50.5) = 50: 45 and 5, the 5 capped to 1, the 4 left over go to the first)
    assert [p.k for p in deft.assign_k(deft.partition_layers([100, 1], 1), [10.0, 1.0], 0.5)] == [49, 1]


def test_plan_rotates_bins_with_the_round():
    a0 = deft.plan_round(LENET, None, 0.01, 4, 0)
    a1 = deft.plan_round(LENET, None, 0.01, 4, 1)
    assert [a.partitions for a in a1] == [a.partitions for a in a0[1:] + a0[:1]]


def test_plan_from_aggregate_uses_partition_norms():
    g = torch.Generator().manual_seed(0)
    agg = [torch.randn(40, generator=g), torch.zeros(1000)]
    agg[1][:500] = torch.randn(500, generator=g) * 10  # only the first half of tensor 1 is large
    allocs = deft.plan_round_from_aggregate(agg, 0.1, 2, 0)  # tensor 1 (1000 > 520) split in two
    ks = {(p.tensor, p.start): p.k for a in allocs for p in a.partitions}
    assert ks[(1, 0)] > 50 * ks[(1, 500)]
    covered_once(allocs, [40, 1000])


def test_bad_settings():
    with pytest.raises(ConfigError, match="density"):
        deft.plan_round(LENET, None, 0.0, 2, 0)
    with pytest.raises(ConfigError, match="n_clients"):
        deft.plan_round(LENET, None, 0.01, 0, 0)
    with pytest.raises(ValueError, match="norms"):
        deft.plan_round(LENET, [1.0], 0.01, 2, 0)
    with pytest.raises(ValueError, match="norms"):
        deft.plan_round([10, 10], [1.0, math.nan], 0.01, 2, 0)


# --- hostile allocations (client side) and selections (server side) ---------------------------


def test_hostile_allocations_are_rejected():
    numels = [100, 50]
    ok = DeftPartition(0, 0, 100, 3)
    deft.check_allocation(DeftAllocation(1, (ok, DeftPartition(1, 10, 20, 10))), numels, expected_round=1)
    bad = {
        "tensor index": (DeftPartition(2, 0, 10, 1),),
        "start >= stop": (DeftPartition(0, 10, 10, 1),),
        "stop > numel": (DeftPartition(1, 0, 51, 1),),
        "k > size": (DeftPartition(1, 0, 5, 6),),
        "k = 0": (DeftPartition(1, 0, 5, 0),),
        "overlap": (DeftPartition(0, 0, 50, 1), DeftPartition(1, 0, 5, 1), DeftPartition(0, 49, 60, 1)),
        "duplicate": (ok, ok),
        "too many": tuple(DeftPartition(0, i, i + 1, 1) for i in range(100)),
    }
    for why, partitions in bad.items():
        alloc = serde.allocation_from_bytes(serde.allocation_to_bytes(DeftAllocation(1, partitions)))
        with pytest.raises(PayloadError):
            deft.check_allocation(alloc, numels, max_partitions=99)
    with pytest.raises(PayloadError, match="round"):
        deft.check_allocation(DeftAllocation(2, (ok,)), numels, expected_round=1)
    with pytest.raises(PayloadError):
        deft.check_allocation(serde.allocation_from_bytes(b"\xff\xff"), numels)


def test_selection_stays_inside_the_ranges():
    g = torch.Generator().manual_seed(1)
    tensors = {
        "a": torch.randn(20, 50, generator=g),
        "b": torch.randn(10, generator=g),
        "c": torch.randn(3000, generator=g),
    }
    numels = [t.numel() for t in tensors.values()]
    allocs = deft.plan_round(numels, None, 0.05, 3, 0)
    union = {name: torch.zeros(t.numel(), dtype=torch.bool) for name, t in tensors.items()}
    for alloc in allocs:
        deft.check_allocation(alloc, numels)
        for (name, t), ranges in zip(tensors.items(), deft.ranges_for(alloc, len(tensors))):
            enc = TopK(ranges=ranges).encode(t, name)
            idx = decode_positions(enc.payload.bits, enc.payload.nnz, enc.payload.golomb_b, t.numel(), name)
            deft.check_selection(idx, ranges, name)
            dense = TopK(ranges=ranges).decode(enc, TensorSpec.of(name, t))
            deft.check_selection(dense, ranges, name)
            assert not bool(union[name][idx].any())  # disjoint between clients
            union[name][idx] = True
    # the aggregate keeps the set density: no build-up
    assert sum(int(u.sum()) for u in union.values()) == round(0.05 * sum(numels))  # 5 partitions < 200


def test_hostile_selections_are_rejected():
    ranges = ((10, 20, 2), (50, 60, 1))
    deft.check_selection(torch.tensor([10, 19, 55]), ranges, "w")
    deft.check_selection(torch.tensor([], dtype=torch.int64), (), "w")
    for idx in ([9], [20], [60], [11, 12, 13], [51, 52], [0], [100]):
        with pytest.raises(PayloadError, match="'w'"):
            deft.check_selection(torch.tensor(idx), ranges, "w")
    dense = torch.zeros(100)
    dense[[12, 70]] = 1.0
    with pytest.raises(PayloadError, match="outside"):
        deft.check_selection(dense, ranges, "w")
    with pytest.raises(PayloadError):
        deft.check_selection(torch.tensor([3]), (), "w")


# --- error feedback with per-tensor overrides -------------------------------------------------


def test_error_feedback_keeps_unsent_entries_in_the_residual():
    g = torch.Generator().manual_seed(2)
    tensors = {"w": torch.randn(4000, generator=g), "bias": torch.randn(20, generator=g)}
    numels = [4000, 20]
    enc = UpdateEncoder(TopK(0.01), min_numel=100)
    alloc = deft.plan_round(numels, None, 0.01, 2, 0)[0]
    ranges = deft.ranges_for(alloc, 2)
    codecs = {name: TopK(ranges=r) for name, r in zip(tensors, ranges)}
    upd = serde.update_from_bytes(serde.update_to_bytes(enc.encode(tensors, 7, codecs=codecs)))
    assert [t.codec_id for t in upd.tensors] == ["topk", "topk"]  # the override wins over min_numel
    out = decode_update(upd, specs_of(tensors), [], per_tensor=codecs)
    for name, t in tensors.items():
        residual = enc.feedback.residual(name)
        torch.testing.assert_close(out[name] + residual, t, rtol=0, atol=0)  # nothing is lost
        mine = torch.zeros(t.numel(), dtype=torch.bool)
        for s, e, _ in codecs[name].ranges:
            mine[s:e] = True
        assert torch.equal(residual[~mine], t[~mine])  # outside the ranges: all kept for later
    # the next round, with a default codec, sends from the same residual
    before = enc.feedback.residual("w").clone()
    enc.encode({"w": torch.zeros(4000), "bias": torch.zeros(20)})
    sent = 4000 - int((enc.feedback.residual("w") == before).sum())
    assert sent == 40


def test_override_without_feedback_and_unknown_names():
    t = {"w": torch.arange(10.0)}
    enc = UpdateEncoder(TopK(0.5), min_numel=0, error_feedback=False)
    upd = enc.encode(t, codecs={"w": TopK(ranges=((0, 5, 1),))})
    assert upd.tensors[0].payload.nnz == 1
    assert enc.encode(t).tensors[0].payload.nnz == 5  # the default again
    with pytest.raises(ValueError, match="codecs"):
        enc.encode(t, codecs={"v": TopK(0.1)})
