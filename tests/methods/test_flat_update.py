"""Whole updates on a device (``fedcomp.methods.flat_update``): the bytes, residuals and decoded
values of the per-tensor path, in a count of operators, syncs and copies that does not grow with
the number of tensors. Run here on the CPU (``device=cpu``), where the same torch operators run
as on CUDA; on a CUDA machine the last tests go through :class:`UpdateEncoder` and
:func:`decode_update` themselves."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fedcomp.codecs import SBC, DenseFP16, DenseFP32, Identity, ThreeLC, TopK, scatter_sum, threelc_device
from fedcomp.codecs import flat as flat_layout
from fedcomp.codecs.flat import Layout, count_device_work
from fedcomp.codecs.golomb import encode_positions
from fedcomp.errors import PayloadError
from fedcomp.methods.feedback import ErrorFeedback, StaleResidual
from fedcomp.methods.flat_update import decode_on_device, encode_on_device
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire import serde
from fedcomp.wire.fast_writer import DeferredDensePayload
from fedcomp.wire.payloads import EncodedUpdate, SBCPayload

CPU = torch.device("cpu")
SAMPLE = 1500


def _model(seed: int, layers: int = 6) -> dict[str, torch.Tensor]:
    """A model-shaped update: weights in fast mode, some in exact mode, small dense tensors."""
    g, shapes = np.random.default_rng(seed), np.random.default_rng(layers)  # one model, new values
    out: dict[str, torch.Tensor] = {}
    for i in range(layers):
        rows = int(shapes.integers(8, 60))
        out[f"l{i}.weight"] = torch.from_numpy((g.standard_t(3, (rows, 97)) * 1e-2).astype(np.float32))
        out[f"l{i}.bias"] = torch.from_numpy((g.standard_normal(rows) * 1e-3).astype(np.float32))
    out["head.weight"] = torch.from_numpy((g.standard_normal((10, 120)) * 1e-2).astype(np.float32))
    return out


def _encoder(codec: SBC | ThreeLC, feedback: bool = True) -> UpdateEncoder:
    return UpdateEncoder(codec, min_numel=200, error_feedback=feedback)


@pytest.mark.parametrize(
    "codec",
    [SBC(0.02, "fast", sample_size=SAMPLE), SBC(0.1, "exact"), ThreeLC(1.0), ThreeLC(1.5, False)]
    + [DenseFP16(), DenseFP32(), Identity()],  # (a GPU client whose bandwidth policy goes dense)
    ids=repr,
)
def test_rounds_with_error_feedback_give_the_per_tensor_bytes_and_residuals(codec: SBC | ThreeLC) -> None:
    flat, loop = _encoder(codec), _encoder(codec)
    works = []
    for rnd in range(4):
        update = _model(rnd)
        with count_device_work() as work:
            got = encode_on_device(update, codec, flat.small_codec, 200, flat.feedback, rnd, device=CPU)
        want = loop.encode(update, rnd)
        assert got == (want, None), rnd
        assert flat.feedback is not None and loop.feedback is not None
        for name in update:
            a, b = flat.feedback.residual(name), loop.feedback.residual(name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), (rnd, name)
        works.append((work.ops, work.syncs, work.to_host, work.to_device))
    # From the second round on the residual buffer is reused as it is: the same work every round.
    assert works[1] == works[2] == works[3], works
    assert works[1][1] <= 8 and works[1][2] <= 6 and works[1][3] <= 2, works[1]


def test_without_error_feedback_and_with_fp16_small_tensors() -> None:
    codec = SBC(0.02, "fast", sample_size=SAMPLE)
    update = _model(9)
    update["l0.bias"] = update["l0.bias"].half()
    got = encode_on_device(update, codec, DenseFP16(), 200, None, 3, device=CPU)
    want = UpdateEncoder(codec, min_numel=200, small_codec=DenseFP16(), error_feedback=False).encode(update, 3)
    assert got == (want, None)


@pytest.mark.parametrize("small_codec", [DenseFP32(), Identity(), DenseFP16()], ids=repr)
@pytest.mark.parametrize("half_bias", [False, True])
def test_small_tensors_give_the_per_tensor_bytes_by_either_path(small_codec, half_bias: bool) -> None:
    """Float32 small tensors through DenseFP32 or Identity take the referenced one-copy path;
    any other (float16 among them, another codec) the codec's own ``encode``: the same bytes."""
    codec = ThreeLC(1.0)
    update = _model(11)
    if half_bias:
        update["l2.bias"] = update["l2.bias"].half()
    got = encode_on_device(update, codec, small_codec, 200, None, 5, device=CPU)
    want = UpdateEncoder(codec, min_numel=200, small_codec=small_codec, error_feedback=False).encode(update, 5)
    assert got == (want, None)
    assert got is not None and serde.update_to_bytes(got[0]) == serde.update_to_bytes(want)
    small = [t for t in got[0].tensors if t.codec_id == small_codec.codec_id]
    assert len(small) == 6 and all(isinstance(t.payload, DeferredDensePayload) for t in small)  # (the biases)


@pytest.mark.parametrize(
    "codec", [SBC(0.02, "fast", sample_size=SAMPLE), ThreeLC(1.25), DenseFP16(), DenseFP32()], ids=repr
)
@pytest.mark.parametrize("small_codec", [DenseFP32(), DenseFP16()], ids=repr)
@pytest.mark.parametrize("feedback", [True, False])
def test_keep_sent_gives_what_the_receiver_decodes_as_the_per_tensor_path(codec, small_codec, feedback: bool) -> None:
    flat = UpdateEncoder(codec, min_numel=200, small_codec=small_codec, error_feedback=feedback)
    loop = UpdateEncoder(codec, min_numel=200, small_codec=small_codec, error_feedback=feedback)
    for rnd in range(3):
        update = _model(20 + rnd)
        found = encode_on_device(update, codec, small_codec, 200, flat.feedback, rnd, keep_sent=True, device=CPU)
        assert found is not None
        got, sent = found
        assert got == loop.encode(update, rnd, keep_sent=True)
        assert sent is not None and loop.sent is not None and list(sent) == list(loop.sent)
        for name, want in loop.sent.items():
            assert sent[name].dtype == want.dtype and torch.equal(sent[name], want), name
        assert flat.state_dict().keys() == loop.state_dict().keys()
        assert all(torch.equal(flat.state_dict()[k], v) for k, v in loop.state_dict().items())


@pytest.mark.parametrize("wide", [False, True], ids=["int32", "int64"])
@pytest.mark.parametrize(
    ("codec", "copies", "waits"),
    [
        (SBC(0.02, "fast", sample_size=SAMPLE), 2, 0),
        (SBC(0.1, "exact"), 2, 0),
        (ThreeLC(1.0), 2, 0),
        (DenseFP16(), 2, 0),
    ],
    ids=repr,
)
def test_the_small_tensors_come_in_one_copy_beside_the_engines(
    codec, copies: int, waits: int, wide: bool, monkeypatch
) -> None:
    """The small tensors' values come to the host in one copy of their own, the large ones' work
    in one more (fast mode's hits are found without a wait, in a block of fixed size; SBC's int64
    positions and their values come in two copies), int32 or int64 positions alike; a dense codec
    copies its wire values apart. The bytes and residuals are the per-tensor path's either way."""
    if wide:
        monkeypatch.setattr(flat_layout, "_INT32_POSITIONS", 0)  # as an update of over 2**31 values
        copies += isinstance(codec, SBC)
    flat, loop = _encoder(codec), _encoder(codec)
    for rnd in range(2):
        update = _model(30 + rnd)
        with count_device_work() as work:
            got = encode_on_device(update, codec, flat.small_codec, 200, flat.feedback, rnd, device=CPU)
        assert got == (loop.encode(update, rnd), None), rnd
        assert (work.to_host, work.syncs) == (copies, copies + waits), rnd
        assert flat.feedback is not None and loop.feedback is not None
        for name in update:
            a, b = flat.feedback.residual(name), loop.feedback.residual(name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (rnd, name)


def test_work_does_not_grow_with_the_number_of_tensors() -> None:
    codec = SBC(0.02, "fast", sample_size=SAMPLE)
    counts = []
    for layers in (3, 12, 48):
        update = _model(1, layers)
        enc = _encoder(codec)
        for _ in range(2):  # the second round: the residual buffer and the plan are kept
            with count_device_work() as work:
                got = encode_on_device(update, codec, enc.small_codec, 200, enc.feedback, 0, device=CPU)
        assert got is not None
        counts.append((work.ops, work.syncs, work.to_host, work.to_device))
    assert counts[0] == counts[1] == counts[2], counts


def test_residuals_loaded_from_a_state_dict_are_assembled_once_then_kept() -> None:
    codec = SBC(0.02, "fast", sample_size=SAMPLE)
    first = _encoder(codec)
    encode_on_device(_model(0), codec, first.small_codec, 200, first.feedback, 0, device=CPU)
    saved = {k: v.clone() for k, v in first.state_dict().items()}
    resumed, loop = _encoder(codec), _encoder(codec)
    resumed.load_state_dict(saved)
    loop.load_state_dict(saved)
    for rnd in (1, 2):
        got = encode_on_device(_model(rnd), codec, resumed.small_codec, 200, resumed.feedback, rnd, device=CPU)
        assert got == (loop.encode(_model(rnd), rnd), None)
    assert resumed.feedback is not None
    kept = resumed.feedback._flat
    assert kept is not None and all(resumed.feedback.residual(n) is v for n, v in kept[2].items())


def test_a_residual_of_another_shape_is_refused_as_the_per_tensor_path_does() -> None:
    codec = SBC(0.02, "fast", sample_size=SAMPLE)
    enc = _encoder(codec)
    enc.load_state_dict({"l0.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match="residual for 'l0.weight' has shape"):
        encode_on_device(_model(0), codec, enc.small_codec, 200, enc.feedback, 0, device=CPU)


def test_cases_left_to_the_per_tensor_path_change_nothing() -> None:
    codec = SBC(0.02, "fast", sample_size=SAMPLE)
    update = _model(2)
    enc = _encoder(codec)
    assert encode_on_device(update, codec, enc.small_codec, 200, enc.feedback, 0) is None  # CPU tensors
    assert encode_on_device(update, TopK(0.1), enc.small_codec, 200, enc.feedback, 0, device=CPU) is None
    stale = ErrorFeedback(codec, StaleResidual(decay=0.5))
    assert encode_on_device(update, codec, enc.small_codec, 200, stale, 0, device=CPU) is None
    bad = dict(update)
    bad["l1.weight"] = bad["l1.weight"].clone()
    bad["l1.weight"][0, 3] = float("inf")
    assert encode_on_device(bad, codec, enc.small_codec, 200, enc.feedback, 0, device=CPU) is None
    assert enc.feedback is not None and enc.feedback.state_dict() == {}  # no residual was written
    with pytest.raises(ValueError, match="l1.weight"):
        enc.encode(bad)


def _sbc_update(seed: int) -> tuple[dict[str, torch.Tensor], EncodedUpdate]:
    update = _model(seed)
    return update, UpdateEncoder(SBC(0.02, "fast", sample_size=SAMPLE), min_numel=200).encode(update, 1)


@pytest.mark.parametrize("wide", [False, True], ids=["int32-positions", "int64-positions"])
def test_decode_gives_the_per_tensor_values_as_views_of_one_buffer(wide: bool, monkeypatch) -> None:
    """The SBC positions and values and the dense tensors' values in one copy to the device, the
    positions as int32 where the update's fit, else (as past 2**31 values) int64."""
    if wide:
        monkeypatch.setattr(flat_layout, "_INT32_POSITIONS", 0)
    update, encoded = _sbc_update(4)
    specs = specs_of(update)
    codecs = [SBC(0.02, "fast", sample_size=SAMPLE), DenseFP32()]
    decode_on_device(encoded, specs, codecs, CPU)  # (the dense tensors' positions are kept by layout)
    with count_device_work() as work:
        got = decode_on_device(encoded, specs, codecs, CPU)
    want = decode_update(encoded, specs, codecs, CPU)
    assert got is not None and list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) and got[k].shape == want[k].shape for k in want)
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    assert work.to_device == 1 and work.syncs == 0, work
    dense = EncodedUpdate(1, tuple(DenseFP32().encode(t, n) for n, t in update.items()))
    got = decode_on_device(dense, specs, codecs, CPU)
    assert got is not None and all(torch.equal(got[k], update[k]) for k in update)


def test_decode_refuses_what_the_per_tensor_path_refuses_with_its_words() -> None:
    update, encoded = _sbc_update(5)
    specs = specs_of(update)
    codecs = [SBC(0.02, "fast", sample_size=SAMPLE), DenseFP32()]
    first = encoded.tensors[0]
    assert isinstance(first.payload, SBCPayload)
    wrong = [
        EncodedUpdate(1, encoded.tensors[:-1]),
        EncodedUpdate(1, (encoded.tensors[1], *encoded.tensors[1:])),
        EncodedUpdate(1, (first.__class__(**{**first.__dict__, "codec_id": "3lc"}), *encoded.tensors[1:])),
        EncodedUpdate(1, (first.__class__(**{**first.__dict__, "shape": (1, 2)}), *encoded.tensors[1:])),
        EncodedUpdate(
            1,
            (
                first.__class__(**{**first.__dict__, "payload": SBCPayload(first.payload.mean, 3, 7, b"\xff")}),
                *encoded.tensors[1:],
            ),
        ),
    ]
    for bad in wrong:
        with pytest.raises(PayloadError) as per_tensor:
            decode_update(bad, specs, codecs, CPU)
        with pytest.raises(PayloadError) as whole:
            decode_on_device(bad, specs, codecs, CPU)
        assert str(whole.value) == str(per_tensor.value)


def _kernels(on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernels the decode batches its streams with: on (skip where not built), or off."""
    if not on:
        monkeypatch.setattr(scatter_sum, "_KERNEL", None)
        monkeypatch.setattr(threelc_device, "_KERNEL", None)
    elif not (scatter_sum.available() and threelc_device.available()):
        pytest.skip("fedcomp._native is not built or FEDCOMP_NATIVE=0")


def _refused_alike(cases: dict[str, tuple[EncodedUpdate, str]], specs, codecs) -> None:
    """Each update of ``cases`` refused by the whole-update decode in the per-tensor decode's
    words, naming the tensor given."""
    for case, (bad, name) in cases.items():
        with pytest.raises(PayloadError) as per_tensor:
            decode_update(bad, specs, codecs, CPU)
        with pytest.raises(PayloadError) as whole:
            decode_on_device(bad, specs, codecs, CPU)
        assert str(whole.value) == str(per_tensor.value), case
        assert whole.value.tensor == name, case


def _replace_payload(update: EncodedUpdate, row: int, **change: object) -> EncodedUpdate:
    t = update.tensors[row]
    bad = dataclasses.replace(t, payload=dataclasses.replace(t.payload, **change))  # type: ignore[type-var]
    return EncodedUpdate(update.base_model_version, (*update.tensors[:row], bad, *update.tensors[row + 1 :]))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "no-kernel"])
def test_3lc_stream_errors_come_in_tensor_order_in_a_mixed_update(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3LC stream found wrong only when read (its runs expand past the tensor) is reported
    before a later SBC or 3LC tensor's error and after an earlier one's, in the per-tensor words;
    the values do not depend on the kernels."""
    _kernels(kernel, monkeypatch)
    update = _model(14)
    specs = specs_of(update)
    codecs = [ThreeLC(1.5), SBC(0.02, "fast", sample_size=SAMPLE), DenseFP32()]
    large = [n for n in update if update[n].numel() >= 200]
    encoded = EncodedUpdate(
        1,
        tuple((codecs[large.index(n) % 2] if n in large else DenseFP32()).encode(t, n) for n, t in update.items()),
    )
    rows = {type(t.payload).__name__: [] for t in encoded.tensors}
    for i, t in enumerate(encoded.tensors):
        rows[type(t.payload).__name__].append(i)
    t3, sb = rows["ThreeLCPayload"], rows["SBCPayload"]
    assert len(t3) >= 2 and sb and t3[0] < sb[-1]
    runs_past = {"data": encoded.tensors[t3[0]].payload.data + b"\xff"}  # type: ignore[union-attr]

    def past_end(row: int) -> dict[str, object]:  # a well-formed stream, its last position past the end
        numel = specs[row].numel
        return {"nnz": 2, "golomb_b": 2, "bits": encode_positions(torch.tensor([1, numel + 2]), 2)}

    bad_3lc_early = _replace_payload(encoded, t3[0], **runs_past)
    cases = {
        "3lc stream, then an SBC mean": (_replace_payload(bad_3lc_early, sb[-1], mean=float("nan")), t3[0]),
        "3lc stream, then a 3lc stream": (_replace_payload(bad_3lc_early, t3[-1], data=b"\xff"), t3[0]),
        "a 3lc stream, then an SBC stream": (_replace_payload(bad_3lc_early, sb[-1], **past_end(sb[-1])), t3[0]),
    }
    bad_3lc_late = _replace_payload(encoded, t3[-1], data=b"\xff")
    cases |= {
        "a 3lc stream alone": (bad_3lc_late, t3[-1]),
        "an SBC mean, then a 3lc stream": (_replace_payload(bad_3lc_late, sb[0], mean=float("inf")), sb[0]),
        "an SBC stream, then a 3lc stream": (_replace_payload(bad_3lc_late, sb[0], **past_end(sb[0])), sb[0]),
    }
    assert sb[0] < t3[-1] and t3[0] < sb[-1]  # (so both orders are met)
    _refused_alike({case: (bad, specs[row].name) for case, (bad, row) in cases.items()}, specs, codecs)
    got = decode_on_device(encoded, specs, codecs, CPU)
    want = decode_update(encoded, specs, codecs, CPU)
    assert got is not None and all(got[k].view(torch.int32).equal(want[k].view(torch.int32)) for k in want)


def _replace_sbc(update: EncodedUpdate, row: int, **change: object) -> EncodedUpdate:
    t = update.tensors[row]
    assert isinstance(t.payload, SBCPayload)
    bad = dataclasses.replace(t, payload=dataclasses.replace(t.payload, **change))
    return EncodedUpdate(update.base_model_version, (*update.tensors[:row], bad, *update.tensors[row + 1 :]))


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "no-kernel"])
def test_decode_errors_come_in_tensor_order_whichever_check_finds_them(
    kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SBC position streams are decoded together after the per-tensor checks (with the
    kernel): a stream that only its decoding finds wrong (every position sent, the last past the
    tensor's end) must still be reported before a later tensor's error, and after an earlier one's,
    in the per-tensor path's words; and the values must not depend on the kernel."""
    _kernels(kernel, monkeypatch)
    update, encoded = _sbc_update(13)
    specs = specs_of(update)
    codecs = [SBC(0.02, "fast", sample_size=SAMPLE), DenseFP32(), DenseFP16()]
    sbc_rows = [i for i, t in enumerate(encoded.tensors) if isinstance(t.payload, SBCPayload)]
    first, second = sbc_rows[0], sbc_rows[1]

    def past_end(row: int) -> dict[str, object]:
        numel = specs[row].numel
        idx = torch.tensor([3, numel - 1, numel + 4], dtype=torch.int64)
        return {"nnz": 3, "golomb_b": 2, "bits": encode_positions(idx, 2)}

    late = _replace_sbc(encoded, second, mean=float("nan"))  # found without decoding
    dense_row = next(i for i, t in enumerate(encoded.tensors) if i > second and not isinstance(t.payload, SBCPayload))
    wrong_dense = dataclasses.replace(encoded.tensors[dense_row], codec_id="dense-fp16")
    late_dense = EncodedUpdate(1, (*encoded.tensors[:dense_row], wrong_dense, *encoded.tensors[dense_row + 1 :]))
    cases = {
        "stream, then a mean": (_replace_sbc(late, first, **past_end(first)), specs[first].name),
        "stream, then a dense tensor": (_replace_sbc(late_dense, first, **past_end(first)), specs[first].name),
        "a mean, then a stream": (
            _replace_sbc(_replace_sbc(encoded, first, mean=float("inf")), second, **past_end(second)),
            specs[first].name,
        ),
        "a stream alone": (_replace_sbc(encoded, second, **past_end(second)), specs[second].name),
        "a dense tensor alone": (late_dense, specs[dense_row].name),
    }
    _refused_alike(cases, specs, codecs)
    got = decode_on_device(encoded, specs, codecs, CPU)
    want = decode_update(encoded, specs, codecs, CPU)
    assert got is not None and all(got[k].view(torch.int32).equal(want[k].view(torch.int32)) for k in want)
    fp16 = EncodedUpdate(1, tuple(DenseFP16().encode(t, n) for n, t in update.items()))
    got = decode_on_device(fp16, specs, codecs, CPU)
    want = decode_update(fp16, specs, codecs, CPU)
    assert got is not None and all(got[k].view(torch.int32).equal(want[k].view(torch.int32)) for k in want)


@pytest.mark.parametrize("wide", [False, True], ids=["int32-positions", "int64-positions"])
def test_decode_of_3lc_and_mixed_updates_gives_the_per_tensor_values(wide: bool, monkeypatch) -> None:
    if wide:
        monkeypatch.setattr(flat_layout, "_INT32_POSITIONS", 0)
    update = _model(6)
    codecs = [ThreeLC(1.5), ThreeLC(1.0, False), SBC(0.02, "fast", sample_size=SAMPLE), DenseFP32(), DenseFP16()]
    specs = specs_of(update)
    three = UpdateEncoder(ThreeLC(1.5), min_numel=200).encode(update, 1)
    names = list(update)
    mixed = EncodedUpdate(
        1,
        tuple(
            (codecs[i % len(codecs)] if update[n].numel() >= 200 else DenseFP16()).encode(update[n], n)
            for i, n in enumerate(names)
        ),
    )
    for encoded in (three, mixed):
        decode_on_device(encoded, specs, codecs, CPU)  # (the dense tensors' positions are kept by layout)
        with count_device_work() as work:
            got = decode_on_device(encoded, specs, codecs, CPU)
        want = decode_update(encoded, specs, codecs, CPU)
        assert got is not None
        assert all(got[k].view(torch.int32).equal(want[k].view(torch.int32)) for k in want)
        assert work.syncs == 0 and work.to_device == 1, work  # SBC, 3LC and dense parts in one copy


def test_hostile_3lc_payloads_are_refused_with_the_per_tensor_words() -> None:
    update = _model(7)
    specs = specs_of(update)
    codecs = [ThreeLC(1.5), DenseFP32()]
    encoded = UpdateEncoder(ThreeLC(1.5), min_numel=200).encode(update, 1)
    first = encoded.tensors[0]
    payload = first.payload
    changes = [
        {"data": payload.data + b"\x79"},  # expands past the groups
        {"data": payload.data[:-1]},  # too short
        {"data": b"\xff" * len(payload.data)},  # runs past the end
        {"scale": float("nan")},
        {"scale": -1.0},
        {"numel": 3},
        {"zero_run": False},  # the stream's run bytes are not codes
    ]
    for change in changes:
        bad_payload = payload.__class__(**{**payload.__dict__, **change})
        bad = EncodedUpdate(1, (first.__class__(**{**first.__dict__, "payload": bad_payload}), *encoded.tensors[1:]))
        with pytest.raises(PayloadError) as per_tensor:
            decode_update(bad, specs, codecs, CPU)
        with pytest.raises(PayloadError) as whole:
            decode_on_device(bad, specs, codecs, CPU)
        assert str(whole.value) == str(per_tensor.value), change


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the tests above run the same operators)")
@pytest.mark.parametrize("codec", [SBC(0.02, "fast", sample_size=SAMPLE), ThreeLC(1.0), DenseFP16()], ids=repr)
def test_cuda_update_encoder_and_decoder_take_the_whole_update_path(codec) -> None:
    on_gpu, on_cpu = _encoder(codec), _encoder(codec)
    for rnd in range(3):
        update = _model(rnd)
        with count_device_work() as work:
            got = on_gpu.encode({k: v.cuda() for k, v in update.items()}, rnd)
        assert got == on_cpu.encode(update, rnd)
        assert work.to_host <= 3, work  # the engine's one copy (SBC: and its nonzero) and the small tensors'
        assert on_gpu.feedback is not None and on_cpu.feedback is not None
        for name, residual in on_cpu.feedback.state_dict().items():
            assert torch.equal(on_gpu.feedback.state_dict()[name].cpu(), residual), (rnd, name)
        decoded = decode_update(got, specs_of(update), [codec, DenseFP32()], "cuda")
        want = decode_update(got, specs_of(update), [codec, DenseFP32()], "cpu")
        assert all(torch.equal(decoded[k].cpu(), want[k]) for k in want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_cuda_spelled_without_an_index_is_the_device_of_the_tensors(name: str) -> None:
    # (the first GPU run: ``torch.device("cuda") != torch.device("cuda:0")`` left both to the
    # per-tensor path, which gave the same bytes, only slower)
    codec = SBC(0.02, "fast", sample_size=SAMPLE)
    update = {k: v.cuda() for k, v in _model(3).items()}
    enc = _encoder(codec)
    found = encode_on_device(update, codec, enc.small_codec, enc.min_numel, enc.feedback, 1, device=torch.device(name))
    assert found is not None
    specs = specs_of(update)
    out = Layout.of(update).views(torch.empty(sum(s.numel for s in specs), device="cuda"))
    got = decode_on_device(found[0], specs, [codec, DenseFP32()], torch.device(name), out=out)
    assert got is not None and all(got[k] is out[k] for k in out)


@pytest.mark.parametrize("one_buffer", [True, False])
def test_decode_into_the_receivers_buffers(one_buffer: bool) -> None:
    update = _model(8)
    specs = specs_of(update)
    codecs = [ThreeLC(1.5), SBC(0.02, "fast", sample_size=SAMPLE), DenseFP32()]
    encoded = UpdateEncoder(ThreeLC(1.5), min_numel=200).encode(update, 1)
    if one_buffer:  # as a GPU client keeps its replica: views of one buffer, in order
        total = sum(s.numel for s in specs)
        backing = torch.full((total,), 7.0)
        out = Layout.of(update).views(backing)
    else:
        out = {s.name: torch.full(s.shape, 7.0) for s in specs}
    got = decode_on_device(encoded, specs, codecs, CPU, out=out)
    want = decode_update(encoded, specs, codecs, CPU)
    assert got is not None and all(got[k] is out[k] for k in want)
    assert all(torch.equal(out[k], want[k]) for k in want)
    # a payload refused: the receiver's buffers keep what they held (the writes come after every check)
    for t in out.values():
        t.fill_(7.0)
    last = encoded.tensors[-1]
    bad = dataclasses.replace(last, payload=dataclasses.replace(last.payload, numel=last.payload.numel + 1))  # type: ignore[type-var]
    with pytest.raises(PayloadError):
        decode_on_device(
            dataclasses.replace(encoded, tensors=(*encoded.tensors[:-1], bad)), specs, codecs, CPU, out=out
        )
    assert all(bool((t == 7.0).all()) for t in out.values())
    # a buffer missing, of another shape, or elsewhere: the per-tensor path decodes instead
    partial = dict(out)
    partial.pop(specs[0].name)
    assert decode_on_device(encoded, specs, codecs, CPU, out=partial) is None
    assert decode_on_device(encoded, specs, codecs, CPU, out={**out, specs[0].name: torch.zeros(3)}) is None


def test_an_all_dense_update_is_copied_straight_into_the_receivers_buffer() -> None:
    update = _model(5)
    specs = specs_of(update)
    encoded = UpdateEncoder(DenseFP32(), error_feedback=False).encode(update, 1)
    out = Layout.of(update).views(torch.full((sum(s.numel for s in specs),), 7.0))
    with count_device_work() as work:
        got = decode_on_device(encoded, specs, [DenseFP32()], CPU, out=out)
    want = decode_update(encoded, specs, [DenseFP32()], CPU)
    assert got is not None and all(got[k] is out[k] and torch.equal(out[k], want[k]) for k in want)
    assert work.to_device == 1


def test_decode_with_per_tensor_codecs_gives_the_per_tensor_values_and_errors() -> None:
    from fedcomp.codecs import Lattice

    update = _model(11)
    specs = specs_of(update)
    exponents = {name: -12 + i % 3 for i, name in enumerate(update)}
    encoded = EncodedUpdate(1, tuple(Lattice(exponent=exponents[n]).encode(t, n) for n, t in update.items()))
    per_tensor = {n: Lattice(exponent=e) for n, e in exponents.items()}
    got = decode_on_device(encoded, specs, [Lattice()], CPU, per_tensor=per_tensor)
    want = decode_update(encoded, specs, [Lattice()], CPU, per_tensor=per_tensor)
    assert got is not None and all(got[k].view(torch.int32).equal(want[k].view(torch.int32)) for k in want)
    wrong_grid = {**per_tensor, specs[2].name: Lattice(exponent=exponents[specs[2].name] + 1)}
    with pytest.raises(PayloadError) as per_tensor_error:
        decode_update(encoded, specs, [Lattice()], CPU, per_tensor=wrong_grid)
    with pytest.raises(PayloadError) as whole_error:
        decode_on_device(encoded, specs, [Lattice()], CPU, per_tensor=wrong_grid)
    assert str(whole_error.value) == str(per_tensor_error.value)


def test_a_small_tensor_float32_cannot_hold_is_left_to_the_per_tensor_path() -> None:
    from fedcomp.codecs import Identity

    codec = SBC(0.02, "fast", sample_size=SAMPLE)
    update = _model(12)
    update["l2.bias"] = update["l2.bias"].double() + 1e-12  # identity sends float64 as it is
    assert encode_on_device(update, codec, Identity(), 200, None, 0, device=CPU) is None
    update["l2.bias"] = update["l2.bias"].to(torch.bfloat16)
    got = encode_on_device(update, codec, Identity(), 200, None, 0, device=CPU)
    want = UpdateEncoder(codec, min_numel=200, small_codec=Identity(), error_feedback=False).encode(update, 0)
    assert got == (want, None)


def test_fuzzed_updates_are_decoded_or_refused_as_the_per_tensor_path_does() -> None:
    """The fuzzer's mutated updates (``fedcomp.fuzz``: bit flips, overwrites, field values,
    structure) of SBC, 3LC, top-k and the dense codecs, parsed as a receiver parses them: the
    whole-update decode refuses each that the per-tensor decode refuses, in its words, and decodes
    the others to the same float32 bits (NaNs included: a float16 NaN's bits depend on the cast)."""
    import random

    from fedcomp import fuzz
    from fedcomp.wire import serde

    corpus = fuzz.build_corpus(
        fuzz.small_model(0), 0, only=["sbc", "3lc", "topk", "dense-fp32", "dense-fp16", "identity"]
    )
    inputs = fuzz.mutations(corpus, random.Random(5))
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(1500):
        codec, kind, data = next(inputs)
        if kind == "many-tiny-tensors":
            continue
        try:
            update = serde.update_from_bytes(data, expected=corpus.specs)
        except PayloadError:
            continue
        receivers = corpus.receivers.get(codec) or [c for cs in corpus.receivers.values() for c in cs[:1]]
        try:
            want = decode_update(update, corpus.specs, receivers, CPU)
        except PayloadError as per_tensor:
            with pytest.raises(PayloadError) as whole:
                decode_on_device(update, corpus.specs, receivers, CPU)
            assert str(whole.value) == str(per_tensor), kind
            outcomes["refused"] += 1
            continue
        got = decode_on_device(update, corpus.specs, receivers, CPU)
        assert got is not None, kind
        assert all(got[k].view(torch.int32).equal(want[k].view(torch.int32)) for k in want), kind
        outcomes["decoded"] += 1
    assert outcomes["decoded"] >= 200 and outcomes["refused"] >= 100, outcomes
