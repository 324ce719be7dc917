"""RoundTraffic and the ``fedcomp.*`` figures: every key, its exact value on known numbers, the
run totals across rounds, the ratios' zero cases, and the per-client notes the wrapper keeps."""

from __future__ import annotations

import pytest
import torch

from fedcomp.flower.protocol import UplinkReport
from fedcomp.flower.traffic import RoundTraffic, metric_record, totals


def _round(**kw: object) -> RoundTraffic:
    t = RoundTraffic()
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def test_metric_record_has_every_figure_with_its_exact_value() -> None:
    r1 = _round(
        uplink={1: 100, 2: 50},
        dense_uplink={1: 4000, 2: 4000},
        downlink={1: 300, 2: 200},
        dense_downlink={1: 4000, 2: 4000},
        rejected={3: "bad"},
        accepted=2,
        unanswered={4, 5},
        failed={6: "error 2: out of memory", 7: "error 2: fedcomp: the local update is not finite"},
        encode_seconds=0.5,
        decode_seconds=0.25,
        client_encode_seconds={1: 0.125, 2: 0.0625},
    )
    r2 = _round(uplink={1: 40}, dense_uplink={1: 4000}, downlink={1: 10}, dense_downlink={1: 4000}, accepted=1)
    run = {1: r1, 2: r2}
    got = metric_record(r2, run)
    assert got == {
        "fedcomp.uplink-bytes": 40,
        "fedcomp.uplink-dense-bytes": 4000,
        "fedcomp.uplink-ratio": 100.0,
        "fedcomp.downlink-bytes": 10,
        "fedcomp.downlink-dense-bytes": 4000,
        "fedcomp.downlink-ratio": 400.0,
        "fedcomp.total-bytes": 150 + 500 + 40 + 10,
        "fedcomp.total-dense-bytes": 8000 + 8000 + 4000 + 4000,
        "fedcomp.total-ratio": 24000 / 700,
        "fedcomp.replies-accepted": 1,
        "fedcomp.replies-rejected": 0,
        "fedcomp.replies-missing": 0,
        "fedcomp.replies-failed": 0,
        "fedcomp.server-codec-seconds": 0.0,
        "fedcomp.client-encode-seconds": 0.0,
        "fedcomp.downlink-passes": 0,
    }
    got1 = metric_record(r1, run)
    assert got1["fedcomp.uplink-bytes"] == 150 and got1["fedcomp.uplink-dense-bytes"] == 8000
    assert got1["fedcomp.uplink-ratio"] == 8000 / 150
    assert got1["fedcomp.downlink-bytes"] == 500 and got1["fedcomp.downlink-dense-bytes"] == 8000
    assert got1["fedcomp.downlink-ratio"] == 16.0
    assert got1["fedcomp.replies-accepted"] == 2 and got1["fedcomp.replies-rejected"] == 1
    assert got1["fedcomp.replies-missing"] == 2 and got1["fedcomp.replies-failed"] == 2
    assert got1["fedcomp.server-codec-seconds"] == 0.75
    assert got1["fedcomp.client-encode-seconds"] == 0.1875
    # The run totals are the same whichever round asks.
    assert {k: got1[k] for k in got1 if "total" in k} == {k: got[k] for k in got if "total" in k}


def test_figure_types_are_ints_for_bytes_and_floats_for_ratios_and_seconds() -> None:
    t = _round(uplink={1: 1}, dense_uplink={1: 4}, encode_seconds=0, decode_seconds=0)
    got = metric_record(t, {1: t})
    for k, v in got.items():
        want = float if ("ratio" in k or "seconds" in k) else int
        assert type(v) is want, (k, v)


def test_nothing_sent_gives_zero_ratios() -> None:
    t = RoundTraffic()
    got = metric_record(t, {1: t})
    assert got["fedcomp.uplink-ratio"] == 0.0 and got["fedcomp.downlink-ratio"] == 0.0
    assert got["fedcomp.total-ratio"] == 0.0
    assert got["fedcomp.total-bytes"] == 0 and got["fedcomp.total-dense-bytes"] == 0
    # Dense bytes with nothing on the wire (an empty "none" downlink) still give 0, not a division.
    t2 = _round(dense_downlink={1: 4000}, downlink={1: 0}, uplink={1: 1}, dense_uplink={1: 1})
    got2 = metric_record(t2, {1: t2})
    assert got2["fedcomp.downlink-ratio"] == 0.0
    assert got2["fedcomp.uplink-ratio"] == 1.0  # one byte sent: a ratio, not the zero case
    assert got2["fedcomp.total-ratio"] == 4001.0


def test_totals_sum_both_directions_over_every_round() -> None:
    assert totals({}) == (0, 0)
    r1 = _round(uplink={1: 1, 2: 2}, downlink={1: 10}, dense_uplink={1: 100, 2: 100}, dense_downlink={1: 1000})
    r2 = _round(uplink={3: 4}, downlink={3: 20, 4: 40}, dense_uplink={3: 7}, dense_downlink={3: 30, 4: 50})
    assert totals({1: r1}) == (13, 1200)
    assert totals({1: r1, 2: r2}) == (13 + 64, 1200 + 87)


def test_add_downlink_accumulates_train_and_evaluate_downlinks() -> None:
    t = RoundTraffic()
    t.add_downlink(1, 100, 4000, "full")
    t.add_downlink(2, 0, 4000, "none")
    assert (t.downlink, t.dense_downlink, t.downlink_mode) == (
        {1: 100, 2: 0},
        {1: 4000, 2: 4000},
        {1: "full", 2: "none"},
    )
    t.add_downlink(1, 7, 4000, "chain")  # the evaluate downlink of the same round
    assert t.downlink == {1: 107, 2: 0}
    assert t.dense_downlink == {1: 8000, 2: 4000}
    assert t.downlink_mode == {1: "chain", 2: "none"}  # the last one sent


def test_note_client_copies_what_was_reported() -> None:
    t = RoundTraffic()
    t.note_client(
        5,
        UplinkReport(
            1,
            "d",
            encode_seconds=0.5,
            train_seconds=2.0,
            sbc_p=0.01,
            local_iters=3,
            budget_bytes=900,
            estimated_bytes=800,
            fits=False,
            link=(1.0, 2.0, 3.0),
        ),
    )
    assert t.sbc_p == {5: 0.01}
    assert t.local_iters == {5: 3}
    assert t.budget_bytes == {5: 900}
    assert t.estimated_bytes == {5: 800}
    assert t.fits == {5: False}
    assert t.train_seconds == {5: 2.0}
    assert t.client_encode_seconds == {5: 0.5}
    assert t.links == {5: [1.0, 2.0, 3.0]} and type(t.links[5]) is list
    # Falsy values are values: zero iterations, p = 0.
    t.note_client(6, UplinkReport(1, "d", sbc_p=0.0, local_iters=0, encode_seconds=0.0))
    assert t.sbc_p[6] == 0.0 and t.local_iters[6] == 0 and t.client_encode_seconds[6] == 0.0


def test_note_client_skips_what_was_not_reported() -> None:
    t = RoundTraffic()
    t.note_client(5, UplinkReport(1, "d"))
    for store in (
        t.sbc_p,
        t.local_iters,
        t.budget_bytes,
        t.estimated_bytes,
        t.fits,
        t.train_seconds,
        t.client_encode_seconds,
        t.links,
    ):
        assert store == {}
    t.note_client(5, UplinkReport(1, "d", budget_bytes=10))
    assert t.budget_bytes == {5: 10} and t.sbc_p == {} and t.links == {}


def test_note_selection_keeps_the_union_of_large_tensors() -> None:
    t = RoundTraffic()
    assert (t.union_nnz, t.sparse_numel) == (0, 0)
    a = {"w": torch.tensor([1.0, 0.0, 0.0, 2.0]), "small": torch.tensor([1.0, 1.0])}
    b = {"w": torch.tensor([0.0, 0.0, 3.0, 4.0]), "small": torch.tensor([1.0, 1.0])}
    t.note_selection(a, min_numel=4)  # "small" (2 < 4 entries) is dense, not a selection
    assert (t.union_nnz, t.sparse_numel) == (2, 4)
    t.note_selection(b, min_numel=4)
    assert (t.union_nnz, t.sparse_numel) == (3, 4)
    t.close_selection()  # counted, the masks released
    assert (t.union_nnz, t.sparse_numel) == (3, 4) and not t._union
    assert type(t.union_nnz) is int and type(t.sparse_numel) is int
    # Exactly min_numel entries is compressed (the encoder's own rule): counted.
    t2 = RoundTraffic()
    t2.note_selection({"w": torch.tensor([[0.0, 5.0], [0.0, 0.0]]), "v": torch.zeros(3)}, min_numel=3)
    assert (t2.union_nnz, t2.sparse_numel) == (1, 7)
    # A small tensor before a large one does not end the note.
    t3 = RoundTraffic()
    t3.note_selection({"bias": torch.ones(2), "w": torch.tensor([0.0, 1.0, 1.0, 0.0])}, min_numel=4)
    assert (t3.union_nnz, t3.sparse_numel) == (2, 4)
    # The note does not alias or change the caller's tensors.
    assert torch.equal(a["w"], torch.tensor([1.0, 0.0, 0.0, 2.0]))


def test_a_selection_noted_from_positions_and_values_is_the_dense_ones() -> None:
    """The streaming sum's terms, (positions, values) of top-k or (positions, one value) of SBC,
    give the union their dense tensors give: a value that decoded to zero selects nothing."""
    w1, w2 = torch.tensor([1.0, 0.0, 0.0, 2.0, 0.0]), torch.tensor([0.0, 0.0, 3.0, 0.0, 0.0])
    dense, sparse = RoundTraffic(), RoundTraffic()
    dense.note_selection({"w": w1, "v": torch.zeros(6), "b": torch.ones(2)}, min_numel=4)
    dense.note_selection({"w": w2, "v": torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0, 0.0]), "b": torch.ones(2)}, min_numel=4)
    numels = {"w": 5, "v": 6, "b": 2}
    first = {
        "w": (torch.tensor([0, 3, 4]), torch.tensor([1.0, 2.0, 0.0])),
        "v": (torch.tensor([2]), 0.0),
        "b": torch.ones(2),
    }
    sparse.note_selection(first, min_numel=4, numels=numels)
    sparse.note_selection({"w": (torch.tensor([2]), torch.tensor([3.0])), "v": (torch.tensor([1, 2]), 0.5)}, 4, numels)
    assert (sparse.union_nnz, sparse.sparse_numel) == (dense.union_nnz, dense.sparse_numel) == (5, 11)
    with pytest.raises(ValueError, match="numels"):
        RoundTraffic().note_selection({"w": (torch.tensor([0]), 1.0)}, min_numel=1)


# --- diagnostics ------------------------------------------------------------------------------------


def test_note_client_keeps_the_residual_to_update_ratio() -> None:
    t = RoundTraffic()
    t.note_client(1, UplinkReport(1, "d", residual_norm=1.0, update_norm=4.0))
    t.note_client(2, UplinkReport(1, "d", residual_norm=0.0, update_norm=2.0))
    t.note_client(3, UplinkReport(1, "d", residual_norm=1.0, update_norm=0.0))  # no update: no ratio
    t.note_client(4, UplinkReport(1, "d", residual_norm=None, update_norm=2.0))
    t.note_client(5, UplinkReport(1, "d", residual_norm=3.0))
    assert t.residual_ratio == {1: 0.25, 2: 0.0}


def test_diagnostic_figures_appear_only_when_measured() -> None:
    t = RoundTraffic()
    got = metric_record(t, {1: t})
    diagnostics = {
        "fedcomp.replica-lag",
        "fedcomp.downlink-delivered",
        "fedcomp.residual-ratio-mean",
        "fedcomp.residual-ratio-median",
    }
    assert not diagnostics & set(got)
    t.replica_lag, t.downlink_delivered = 0.0, 0.0  # measured zeros are figures
    got = metric_record(t, {1: t})
    assert got["fedcomp.replica-lag"] == 0.0 and got["fedcomp.downlink-delivered"] == 0.0
    assert "fedcomp.residual-ratio-mean" not in got and "fedcomp.residual-ratio-median" not in got
    t.replica_lag, t.downlink_delivered = 1.5, 0.75
    t.residual_ratio = {1: 0.25, 2: 0.75, 3: 2.0}
    got = metric_record(t, {1: t})
    # One client whose update was about 0 makes the mean huge, not the median.
    assert (
        metric_record(RoundTraffic(residual_ratio={1: 0.5, 2: 0.7, 3: 1e5}), {})["fedcomp.residual-ratio-median"] == 0.7
    )
    assert got["fedcomp.replica-lag"] == 1.5
    assert got["fedcomp.downlink-delivered"] == 0.75
    assert got["fedcomp.residual-ratio-mean"] == 1.0
    assert got["fedcomp.residual-ratio-median"] == 0.75
    assert len(got) == 20
