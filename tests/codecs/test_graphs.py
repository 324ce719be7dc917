"""The whole-update encodes' device part replayed as CUDA graphs (``fedcomp.codecs.graphs``): the
same bytes, residuals and reconstructions round after round as the CPU's, one capture per
layout, an encode that keeps working where a capture fails. Without a GPU only the plumbing
runs (the CPU never captures); the CUDA tests run on a lent GPU machine
(``scripts/device_check.sh``)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from fedcomp.codecs import SBC, ThreeLC, graphs, sbc_device, threelc_device
from fedcomp.codecs.flat import Layout
from fedcomp.codecs.graphs import GraphCache
from fedcomp.methods.update import UpdateEncoder, specs_of
from tests.codecs.test_sbc_device import _kinds
from tests.codecs.test_sbc_many import SAMPLE, _f32
from tests.methods.test_flat_update import _model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the CPU never captures)")


def test_off_a_gpu_nothing_is_captured_and_the_caller_runs_the_function(monkeypatch) -> None:
    cache = GraphCache("test")
    calls: list[torch.Tensor] = []

    def fn(x: torch.Tensor) -> graphs.Outputs:
        calls.append(x)
        return (x,), None

    for _ in range(3):
        with cache.run("k", fn, (torch.ones(3),), lambda: ()) as got:
            assert got is None
    assert calls == [] and cache.stats == graphs.GraphStats()
    monkeypatch.setenv("FEDCOMP_CUDA_GRAPHS", "0")
    assert not graphs.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("FEDCOMP_CUDA_GRAPHS", "1")
    assert graphs.enabled(torch.device("cuda", 0)) and not graphs.enabled(torch.device("cpu"))


def _one_layout(seed: int) -> list[tuple[str, torch.Tensor]]:
    """The engine's test tensors (ties, frozen signs, a fall back to exact mode), new values each
    seed in one layout."""
    items = _kinds(seed)
    assert items[0][0] == "student"  # (the one whose size depends on the seed)
    items[0] = ("student", _f32(np.random.default_rng(seed).standard_t(3, 9_000) * 1e-2))
    return items


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("with_meanwhile", [False, True])
def test_cuda_sbc_rounds_replay_one_graph_with_the_cpu_bytes(with_meanwhile: bool) -> None:
    codec = SBC(0.01, "fast", sample_size=SAMPLE)
    sbc_device.GRAPHS.clear()
    before = sbc_device.GRAPHS.stats.captured, sbc_device.GRAPHS.stats.replayed
    calls: list[int] = []
    for rnd in range(5):
        items = _one_layout(rnd)
        if rnd == 3:  # a value that is not finite: the update is left to the per-tensor path
            name, t = items[1]
            bad = t.clone().reshape(-1)
            bad[3] = float("nan")
            items[1] = (name, bad.view(t.shape))
        on_gpu = [(n, t.cuda()) for n, t in items]
        flat = torch.cat([t.reshape(-1) for _, t in on_gpu])
        meanwhile = (lambda r=rnd: calls.append(r)) if with_meanwhile else None
        found = sbc_device.encode_update(codec, on_gpu, flat=flat, layout=Layout.of(on_gpu), meanwhile=meanwhile)
        if rnd == 3:
            assert found is None
            continue
        assert found is not None
        assert found.encoded == [codec.encode(t, n) for n, t in items], rnd
    assert calls == (list(range(5)) if with_meanwhile else [])  # once a round
    assert sbc_device.GRAPHS.stats.captured == before[0] + 1  # on the second round
    assert sbc_device.GRAPHS.stats.replayed == before[1] + 4


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("codec", [ThreeLC(1.0), ThreeLC(1.9, False)], ids=repr)
def test_cuda_3lc_reconstructions_outlive_the_next_replay(codec: ThreeLC) -> None:
    threelc_device.GRAPHS.clear()
    before = threelc_device.GRAPHS.stats.captured
    g = np.random.default_rng(5)
    recons, wants = [], []
    for rnd in range(4):
        items = [(f"t{i}", _f32(g.standard_t(3, n) * 10.0**-rnd)) for i, n in enumerate((3_000, 1_234, 777))]
        items.append(("zeros", torch.zeros(500)))
        coded = threelc_device.encode_update(codec, [(n, t.cuda()) for n, t in items], want_recon=True)
        assert coded is not None
        encoded, recon = coded
        assert encoded == [codec.encode(t, n) for n, t in items], rnd
        assert recon is not None
        recons.append(recon)
        wants.append(
            torch.cat(
                [codec.decode(e, spec).reshape(-1) for e, spec in zip(encoded, specs_of(dict(items)), strict=True)]
            )
        )
    assert threelc_device.GRAPHS.stats.captured == before + 1
    for recon, want in zip(recons, wants, strict=True):  # (each its own, not the graph's buffer)
        assert torch.equal(recon.cpu(), want)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("codec", [SBC(0.02, "fast", sample_size=SAMPLE), ThreeLC(1.0)], ids=repr)
def test_cuda_rounds_with_error_feedback_keep_the_cpu_residuals_and_what_was_sent(codec) -> None:
    on_gpu = UpdateEncoder(codec, min_numel=200, error_feedback=True)
    on_cpu = UpdateEncoder(codec, min_numel=200, error_feedback=True)
    sent = []
    for rnd in range(5):
        update = _model(rnd)
        got = on_gpu.encode({k: v.cuda() for k, v in update.items()}, rnd, keep_sent=True)
        assert got == on_cpu.encode(update, rnd, keep_sent=True), rnd
        assert on_gpu.sent is not None and on_cpu.sent is not None
        sent.append(({k: v.clone() for k, v in on_cpu.sent.items()}, on_gpu.sent))
        assert on_gpu.feedback is not None and on_cpu.feedback is not None
        for name, residual in on_cpu.feedback.state_dict().items():
            assert torch.equal(on_gpu.feedback.state_dict()[name].cpu(), residual), (rnd, name)
    for want, kept in sent:  # what each round sent is still what it was
        assert all(torch.equal(kept[k].cpu(), want[k]) for k in want)
    engine = sbc_device if isinstance(codec, SBC) else threelc_device
    assert engine.GRAPHS.stats.replayed >= 3


@pytest.mark.cuda
@cuda
def test_cuda_a_capture_that_fails_leaves_the_layout_eager_with_one_warning() -> None:
    cache = GraphCache("test")
    x = torch.arange(6, dtype=torch.float32, device="cuda")

    def syncs(t: torch.Tensor) -> graphs.Outputs:
        n = int(t.sum().item())  # a wait for the device: not capturable
        return (t * n,), n

    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with cache.run("k", syncs, (x,), lambda: ()) as got:
                outs.append(got)
    assert outs == [None] * 4
    assert cache.stats.failed == 1 and cache.stats.captured == 0
    assert sum("no CUDA graph" in str(w.message) for w in caught) == 1
    assert float((x * 2).sum().item()) == 30.0  # the device still works


@pytest.mark.cuda
@cuda
def test_cuda_graphs_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("FEDCOMP_CUDA_GRAPHS", "0")
    codec = SBC(0.01, "fast", sample_size=SAMPLE)
    sbc_device.GRAPHS.clear()
    before = sbc_device.GRAPHS.stats.captured
    for rnd in range(3):
        items = _one_layout(rnd)
        found = sbc_device.encode_update(codec, [(n, t.cuda()) for n, t in items])
        assert found is not None and found.encoded == [codec.encode(t, n) for n, t in items]
    assert sbc_device.GRAPHS.stats.captured == before
