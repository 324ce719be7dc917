"""The server's running sum of replies (fedcomp/flower/weighted_sum.py): the kernel path
(fedcomp/codecs/scatter_sum.py: one call checks a reply, one adds it) against the per-tensor path, on real SBC payloads parsed from wire
bytes, and the errors of hostile payloads, which both paths must word alike."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fedcomp.flower.weighted_sum as ws
from fedcomp.codecs import scatter_sum
from fedcomp.codecs.base import Codec
from fedcomp.codecs.dense import DenseFP32
from fedcomp.codecs.golomb import encode_positions
from fedcomp.codecs.sbc import SBC
from fedcomp.codecs.stc import STC
from fedcomp.codecs.topk import TopK
from fedcomp.errors import PayloadError
from fedcomp.methods.update import UpdateEncoder, specs_of
from fedcomp.wire import serde
from fedcomp.wire.payloads import DensePayload, EncodedUpdate, SBCPayload

needs_kernel = pytest.mark.skipif(
    not scatter_sum.available(), reason="fedcomp._native._sbc is not built or FEDCOMP_NATIVE=0"
)

CODEC = SBC(p=0.05)
ACCEPTED = {c.codec_id: c for c in (CODEC, DenseFP32())}


def _model() -> dict[str, torch.Tensor]:
    """Tensors of several sizes: three coded by SBC (one a conv kernel), three dense (< 1000)."""
    g = torch.Generator().manual_seed(0)
    shapes = {"conv.w": (32, 16, 3, 3), "conv.b": (32,), "fc.w": (64, 200), "fc.b": (64,), "out.w": (5000,), "s": (7,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _reply(seed: int, model: dict[str, torch.Tensor]) -> EncodedUpdate:
    """A client's update, SBC-coded as the client mod codes it, through wire bytes."""
    g = torch.Generator().manual_seed(seed)
    update = {k: torch.randn(t.shape, generator=g) * 10.0 ** (seed % 3 - 3) for k, t in model.items()}
    data = UpdateEncoder(CODEC, error_feedback=False).encode_to_bytes(update)
    return serde.update_from_bytes(data, expected=specs_of(model))


def _sums(model: dict[str, torch.Tensor], replies: list[EncodedUpdate], kernel: bool) -> tuple[dict, list[float]]:
    total = ws.WeightedSum(model)
    norms = []
    for i, reply in enumerate(replies):
        delta = ws.sparse_delta(reply, specs_of(model), ACCEPTED, kernel=kernel)
        assert (delta.kernel is not None) == kernel  # each path is the one asked for
        norms.append(delta.norm)
        total.add(ws.Contribution(delta=delta), weight=1.0 + 0.37 * i)
    return total.mean(), norms


@needs_kernel
def test_the_kernel_path_sums_what_the_per_tensor_path_sums():
    model = _model()
    replies = [_reply(seed, model) for seed in range(1, 7)]
    fast, fast_norms = _sums(model, replies, kernel=True)
    slow, slow_norms = _sums(model, replies, kernel=False)
    assert list(fast) == list(slow) == list(model)
    for name in ("conv.w", "fc.w", "out.w"):  # SBC: the same float64 adds, in the same order
        assert torch.equal(fast[name], slow[name]), name
    for name in ("conv.b", "fc.b", "s"):  # dense: up to float64 rounding (torch may fuse a*w + b)
        torch.testing.assert_close(fast[name], slow[name], rtol=1e-12, atol=0)
    np.testing.assert_allclose(fast_norms, slow_norms, rtol=1e-12)
    # and the sum is the weighted mean of W + delta (the reference decoded densely, in float64)
    weights = [1.0 + 0.37 * i for i in range(len(replies))]
    for name, w in model.items():
        spec = next(s for s in specs_of(model) if s.name == name)
        ref = sum(
            wt * (w.double() + ACCEPTED[r.tensors[list(model).index(name)].codec_id].decode(
                r.tensors[list(model).index(name)], spec).double())
            for wt, r in zip(weights, replies, strict=True)
        ) / sum(weights)  # fmt: skip
        torch.testing.assert_close(fast[name], ref.float(), rtol=0, atol=float(ref.abs().max()) * 2**-23)


def _with(reply: EncodedUpdate, name: str, **changes: object) -> EncodedUpdate:
    """``reply`` with tensor ``name``'s payload fields changed."""
    tensors = tuple(
        dataclasses.replace(t, payload=dataclasses.replace(t.payload, **changes)) if t.name == name else t
        for t in reply.tensors
    )
    return dataclasses.replace(reply, tensors=tensors)


def _hostile(reply: EncodedUpdate, kind: str) -> EncodedUpdate:
    sbc = next(t for t in reply.tensors if t.name == "out.w").payload
    assert isinstance(sbc, SBCPayload)
    bits = sbc.bits
    if kind == "padding":
        return _with(reply, "out.w", bits=bits[:-1] + bytes([bits[-1] | 1]))
    if kind == "truncated":
        return _with(reply, "out.w", bits=bits[:-1])
    if kind == "past the end":  # a well-formed stream whose last position is outside the tensor
        idx = torch.tensor([3, 4999, 5004], dtype=torch.int64)
        return _with(reply, "out.w", nnz=3, golomb_b=2, bits=encode_positions(idx, 2))
    if kind == "nnz doubled":
        return _with(reply, "out.w", nnz=2 * sbc.nnz)
    if kind == "bytes for nnz 0":
        return _with(reply, "out.w", nnz=0)
    if kind == "nan mean":
        return _with(reply, "out.w", mean=float("nan"))
    dense = next(t for t in reply.tensors if t.name == "fc.b").payload
    assert isinstance(dense, DensePayload)
    values = np.frombuffer(dense.data, dtype=np.float32).copy()
    values[3] = {"nan value": np.nan, "inf value": np.inf}[kind]
    return _with(reply, "fc.b", data=memoryview(values.tobytes()))


HOSTILE = [
    "padding",
    "truncated",
    "past the end",
    "nnz doubled",
    "bytes for nnz 0",
    "nan mean",
    "nan value",
    "inf value",
]


@needs_kernel
@pytest.mark.parametrize("kind", HOSTILE)
def test_a_hostile_tensor_is_refused_with_the_per_tensor_paths_words(kind: str):
    model = _model()
    bad = _hostile(_reply(3, model), kind)
    with pytest.raises(PayloadError) as slow:
        ws.sparse_delta(bad, specs_of(model), ACCEPTED, kernel=False)
    with pytest.raises(PayloadError) as fast:
        ws.sparse_delta(bad, specs_of(model), ACCEPTED, kernel=True)
    assert str(fast.value) == str(slow.value)
    assert ("out.w" if kind not in ("nan value", "inf value") else "fc.b") in str(fast.value)


@needs_kernel
def test_a_refused_reply_leaves_the_sum_as_it_was():
    model = _model()
    total = ws.WeightedSum(model)
    total.add(ws.Contribution(delta=ws.sparse_delta(_reply(1, model), specs_of(model), ACCEPTED)), 2.0)
    before = {k: v.clone() for k, v in total.sums.items()}
    with pytest.raises(PayloadError):  # the last tensor is bad: every other was decoded first
        total.add(ws.Contribution(delta=ws.sparse_delta(_hostile(_reply(2, model), "padding"), specs_of(model), ACCEPTED)), 1.0)  # fmt: skip
    assert total.weight == 2.0
    assert all(torch.equal(before[k], total.sums[k]) for k in before)


def test_without_the_kernel_the_per_tensor_path_is_taken(monkeypatch: pytest.MonkeyPatch):
    model = _model()
    monkeypatch.setattr(scatter_sum, "_KERNEL", None)
    delta = ws.sparse_delta(_reply(1, model), specs_of(model), ACCEPTED)
    assert delta.kernel is None and set(delta.terms) == set(model)
    total = ws.WeightedSum(model)
    total.add(ws.Contribution(delta=delta), 1.0)
    assert set(total.mean()) == set(model)


SPARSE_CODECS = [TopK(p=0.05), TopK(p=0.05, values="float16"), STC(p=0.05)]


@pytest.mark.parametrize("codec", SPARSE_CODECS, ids=repr)
def test_top_k_and_stc_replies_are_added_as_positions_and_values(codec: Codec) -> None:
    """Never a dense tensor of their own: the same mean as adding each reply's dense decode (in
    float64, up to rounding), the same norms, and a hostile payload gets the decoder's own error."""
    model = _model()
    accepted = {c.codec_id: c for c in (codec, DenseFP32())}
    replies = []
    for seed in range(1, 5):
        g = torch.Generator().manual_seed(seed)
        update = {k: torch.randn(t.shape, generator=g) * 10.0 ** (seed % 3 - 3) for k, t in model.items()}
        data = UpdateEncoder(codec, error_feedback=False).encode_to_bytes(update)
        replies.append(serde.update_from_bytes(data, expected=specs_of(model)))
    total, dense_total = ws.WeightedSum(model), ws.WeightedSum(model)
    for i, reply in enumerate(replies):
        delta = ws.sparse_delta(reply, specs_of(model), accepted)
        assert all(isinstance(delta.terms[k], tuple) for k in ("conv.w", "fc.w", "out.w"))
        decoded = {
            s.name: accepted[t.codec_id].decode(t, s) for s, t in zip(specs_of(model), reply.tensors, strict=True)
        }
        np.testing.assert_allclose(delta.norm, float(torch.cat([t.double().reshape(-1) for t in decoded.values()]).norm()), rtol=1e-12)  # fmt: skip
        total.add(ws.Contribution(delta=delta), 1.0 + 0.37 * i)
        dense_total.add(ws.Contribution(delta=ws.ReplyDelta(terms=decoded)), 1.0 + 0.37 * i)
    got, want = total.mean(), dense_total.mean()
    assert list(got) == list(want)
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-12)
    # hostile: a position past the end, values of the wrong length or a NaN: the decoder's words
    out_w = next(t for t in replies[0].tensors if t.name == "out.w").payload
    changes: list[dict[str, object]] = [{"nnz": out_w.nnz + 1}, {"golomb_b": 99}]  # type: ignore[attr-defined]
    if isinstance(codec, TopK):
        changes.append({"values": out_w.values[:-1]})  # type: ignore[attr-defined]
    else:
        changes.append({"mu": float("nan")})
    spec = next(s for s in specs_of(model) if s.name == "out.w")

    def dense_outcome(bad: EncodedUpdate) -> object:
        try:
            return codec.decode(next(t for t in bad.tensors if t.name == "out.w"), spec).double()
        except PayloadError as e:
            return str(e)

    def summed_outcome(bad: EncodedUpdate) -> object:
        try:
            delta = ws.sparse_delta(bad, specs_of(model), accepted)
        except PayloadError as e:
            return str(e)
        idx, values = delta.terms["out.w"]
        out = torch.zeros(spec.numel, dtype=torch.float64)
        out[idx] = values.double() if isinstance(values, torch.Tensor) else values
        return out

    refused = 0
    for change in changes:
        bad = _with(replies[0], "out.w", **change)
        want_outcome, got_outcome = dense_outcome(bad), summed_outcome(bad)
        if isinstance(want_outcome, str):
            refused += 1
            assert got_outcome == want_outcome, change
        else:
            assert isinstance(got_outcome, torch.Tensor) and torch.equal(got_outcome, want_outcome), change
    assert refused >= 2  # (an extra position may still decode: then both paths take it)
