"""The server's fast read of a tensor (``serde._fast_tensor``, and the wire kernel's
``scan_tensors``, which reads every tensor of an update at once by the same rules): it may only
accept bytes the general path (protobuf, canonical check) accepts, and must make the same tensor of
them; on the tensors a server or client receives every round (SBC, 3LC, dense) it must accept.
Checked on valid tensors of every codec and on mutated ones (a byte changed, inserted, dropped; a
field's value moved to a non-canonical form), for both readers, which must also agree with each
other."""

from __future__ import annotations

import dataclasses
from array import array

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcomp.codecs import SBC, DenseFP16, DenseFP32, Identity, ThreeLC, TopK
from fedcomp.codecs.base import TensorSpec
from fedcomp.errors import PayloadError
from fedcomp.wire import serde
from fedcomp.wire.payloads import DensePayload, EncodedTensor, SBCPayload, ThreeLCPayload


def _kernel_read(data: bytes | memoryview, spec: TensorSpec) -> EncodedTensor | None:
    """``scan_tensors`` on an update of this one tensor (its span the whole of ``data``)."""
    view = memoryview(data)
    model = serde._model_of([spec])
    found = serde._scan_fast(view, array("I", [0, len(view)]), model)
    assert found is not None
    return serde._fast_built(found[0], view, spec.name, model.dims[0])


READERS = [
    pytest.param(serde._fast_tensor, id="python"),
    pytest.param(
        _kernel_read, id="kernel", marks=pytest.mark.skipif(serde._SCAN is None, reason="the wire kernel is not built")
    ),
]


#: Up to three edits of a byte string: a byte set, inserted or dropped.
EDITS = st.lists(
    st.tuples(st.sampled_from(["set", "insert", "drop"]), st.integers(0, 10**6), st.integers(0, 255)),
    min_size=0,
    max_size=3,
)


def _edited(data: bytes, edits: list[tuple[str, int, int]]) -> bytes:
    out = bytearray(data)
    for op, at, value in edits:
        at %= len(out) + (op == "insert")
        if op == "set" and out:
            out[at % len(out)] = value
        elif op == "insert":
            out.insert(at, value)
        elif out:
            del out[at % len(out)]
    return bytes(out)


def _general(data: bytes, spec: TensorSpec) -> EncodedTensor | str:
    try:
        msg, cut = serde._parse_tensor(memoryview(data), "tensor 0")
        if msg.name != spec.name or tuple(msg.shape) != tuple(spec.shape):
            return "other tensor"
        return serde.tensor_from_proto(msg, cut)
    except PayloadError as exc:
        return str(exc)


def _same(a: EncodedTensor, b: EncodedTensor) -> bool:
    def norm(t: EncodedTensor) -> tuple:
        p = t.payload
        fields = tuple((k, bytes(v) if isinstance(v, memoryview) else v) for k, v in vars(p).items())
        return (t.name, tuple(t.shape), t.dtype, t.codec_id, t.codec_version, type(p), fields)

    return norm(a) == norm(b)


def _tensors(seed: int) -> list[tuple[EncodedTensor, TensorSpec]]:
    g = np.random.default_rng(seed)
    out = []
    for i, (codec, shape) in enumerate(
        [
            (SBC(0.01), (64, 40)),
            (SBC(0.3, "exact"), (300,)),
            (DenseFP32(), (7,)),
            (DenseFP16(), (3, 5)),
            (Identity(), (12,)),
            (ThreeLC(), (40, 3)),
            (TopK(0.1), (500,)),
            (SBC(0.01), ()),
            (DenseFP32(), (2, 1, 1, 1, 1, 1, 1, 1, 2)),  # rank 9: the general path refuses it
            (ThreeLC(zero_run=False), (7, 9)),
        ]
    ):
        t = torch.from_numpy(np.asarray(g.standard_t(3, shape) * 1e-2, dtype=np.float32))
        name = f"layer{i}.weight" + "x" * (200 if i == 3 else 0)  # one name past 127 bytes
        if len(shape) > serde.MAX_RANK:  # (encoders refuse it: made as a hostile sender would)
            enc = dataclasses.replace(codec.encode(t.reshape(-1), name), shape=tuple(shape))
        else:
            enc = codec.encode(t, name)
        out.append((enc, TensorSpec(name, tuple(shape))))
    return out


@pytest.mark.parametrize("read", READERS)
def test_valid_tensors_are_read_as_the_general_path_reads_them(read) -> None:
    accepted = 0
    for enc, spec in _tensors(0):
        data = serde.tensor_to_bytes(enc)
        fast = read(memoryview(data), spec)
        general = _general(data, spec)
        if fast is not None:
            assert isinstance(general, EncodedTensor) and _same(fast, general), spec.name
            accepted += 1
        elif (
            enc.codec_id in ("sbc", "3lc", "dense-fp32", "dense-fp16", "identity") and len(spec.shape) <= serde.MAX_RANK
        ):
            pytest.fail(f"{spec.name}: a common tensor left to the general path")
    assert accepted == 8


@pytest.mark.parametrize("read", READERS)
def test_an_sbc_mean_or_3lc_scale_of_zero_and_an_empty_payload_go_the_general_way(read) -> None:
    spec = TensorSpec("w", (10,))
    for payload in (SBCPayload(0.0, 3, 0, b""), SBCPayload(-0.0, 1, 1, b"\x01"), SBCPayload(0.5, 0, 0, b"")):
        enc = EncodedTensor("w", (10,), "float32", "sbc", 1, payload)
        data = serde.tensor_to_bytes(enc)
        assert read(memoryview(data), spec) is None
        general = _general(data, spec)
        assert isinstance(general, EncodedTensor) and _same(general, enc)
    for p3 in (
        ThreeLCPayload(0.0, 10, True, b"\xf4"),
        ThreeLCPayload(-0.0, 10, False, b"yy"),
        ThreeLCPayload(0.5, 0, True, b""),
    ):
        enc = EncodedTensor("w", (10,), "float32", "3lc", 1, p3)
        data = serde.tensor_to_bytes(enc)
        assert read(memoryview(data), spec) is None
        general = _general(data, spec)
        assert isinstance(general, EncodedTensor) and _same(general, enc)
    dense = EncodedTensor("w", (0,), "float32", "dense-fp32", 1, DensePayload("float32", b""))
    assert read(memoryview(serde.tensor_to_bytes(dense)), TensorSpec("w", (0,))) is None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, 9),
    edits=EDITS.filter(bool),
)
@pytest.mark.parametrize("read", READERS)
def test_mutated_tensors_are_never_read_otherwise_than_by_the_general_path(read, which: int, edits) -> None:
    enc, spec = _tensors(1)[which]
    data = _edited(serde.tensor_to_bytes(enc), edits)
    fast = read(memoryview(data), spec)
    if fast is not None:
        general = _general(data, spec)
        assert isinstance(general, EncodedTensor), general
        assert _same(fast, general)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.replace(b"\x10\x06", b"\x10\x86\x00", 1),  # golomb_b as a non-minimal varint
        lambda d: d.replace(b"\x10\x06", b"\x10\x00", 1),  # golomb_b 0, encoded (not canonical)
        lambda d: d.replace(b"\x18\x29", b"\x18\x00", 1),  # nnz 0, encoded (not canonical)
        lambda d: d.replace(b"\x28\x01", b"\x28\x00", 1),  # codec_version 0, encoded (not canonical)
        lambda d: d.replace(b"\x18\x01", b"\x18\x09", 1),  # an unknown dtype
    ],
)
@pytest.mark.parametrize("read", READERS)
def test_non_canonical_fields_are_left_to_the_general_path_which_refuses_them(read, change) -> None:
    t = torch.from_numpy(np.random.default_rng(2).standard_t(3, 4096).astype(np.float32))
    enc = SBC(0.01).encode(t, "w")
    assert isinstance(enc.payload, SBCPayload) and enc.payload.golomb_b == 6
    original = serde.tensor_to_bytes(enc)
    assert enc.payload.nnz == 0x29 and b"\x18\x29" in original
    data = change(original)
    assert data != original
    spec = TensorSpec("w", (4096,))
    assert read(memoryview(data), spec) is None
    assert isinstance(_general(data, spec), str)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.replace(b"\x10\x80\x20", b"\x10\x80\xa0\x00", 1),  # numel as a non-minimal varint
        lambda d: d.replace(b"\x10\x80\x20", b"\x10\x00", 1),  # numel 0, encoded (not canonical)
        lambda d: d.replace(b"\x18\x01", b"\x18\x02", 1),  # zero_run 2: not a canonical bool
        lambda d: d.replace(b"\x18\x01", b"\x18\x00", 1),  # zero_run false, encoded (not canonical)
    ],
)
@pytest.mark.parametrize("read", READERS)
def test_non_canonical_3lc_fields_are_left_to_the_general_path_which_refuses_them(read, change) -> None:
    t = torch.from_numpy(np.random.default_rng(3).standard_t(3, 4096).astype(np.float32))
    enc = ThreeLC().encode(t, "w")
    head = serde._head("w", (4096,), "float32", "3lc", 1)
    original = serde.tensor_to_bytes(enc)
    key = original[len(head)]
    sub = original[serde._varint(memoryview(original), len(head) + 1, len(original))[1] :]
    assert key == serde._TLC_KEY[0] and _tensor_bytes(head, key, sub) == original
    spec = TensorSpec("w", (4096,))
    changed = change(sub)
    assert changed != sub
    data = _tensor_bytes(head, key, changed)
    assert read(memoryview(data), spec) is None
    assert isinstance(_general(data, spec), str)
    # zero_run dropped: a valid tensor (without zero runs), read alike by both paths
    dropped = _tensor_bytes(head, key, sub.replace(b"\x18\x01", b"", 1))
    fast = read(memoryview(dropped), spec)
    general = _general(dropped, spec)
    assert fast is not None and isinstance(general, EncodedTensor) and _same(fast, general)
    assert isinstance(fast.payload, ThreeLCPayload) and not fast.payload.zero_run


def _tensor_bytes(head: bytes, payload_key: int, sub: bytes) -> bytes:
    return head + bytes([payload_key]) + serde.fast_writer.varint(len(sub)) + sub


@pytest.mark.parametrize("kind", ["sbc", "dense"])
@pytest.mark.parametrize("read", READERS)
def test_an_empty_bytes_field_written_out_is_left_to_the_general_path_which_refuses_it(read, kind: str) -> None:
    spec = TensorSpec("w", (4,))
    if kind == "sbc":
        head = serde._head("w", (4,), "float32", "sbc", 1)
        sub = serde._SBC_MEAN_KEY + serde._F32.pack(0.5) + b"\x10\x01\x18\x01" + serde._SBC_BITS_KEY + b"\x00"
        key = serde._SBC_KEY[0]
    else:
        head = serde._head("w", (4,), "float32", "dense-fp32", 1)
        sub = serde._DENSE_ENCODING["float32"] + serde._DENSE_DATA_KEY + b"\x00"
        key = serde._DENSE_KEY[0]
    data = _tensor_bytes(head, key, sub)
    assert read(memoryview(data), spec) is None
    assert "present but empty" in str(_general(data, spec))
    # the same with one byte of data: both paths read it, and alike
    one = _tensor_bytes(head, key, sub[:-1] + b"\x01\x07")
    fast = read(memoryview(one), spec)
    general = _general(one, spec)
    assert fast is not None and isinstance(general, EncodedTensor) and _same(fast, general)


@pytest.mark.skipif(serde._SCAN is None, reason="the wire kernel is not built")
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, 9),
    edits=EDITS,
)
def test_the_kernel_reads_exactly_what_the_python_reader_reads(which: int, edits) -> None:
    """Not only bytes the general path accepts: the same tensors as ``_fast_tensor``, None where it
    says None (the server's choice of path does not depend on whether the kernel is built)."""
    enc, spec = _tensors(2)[which]
    data = _edited(serde.tensor_to_bytes(enc), edits)
    python, kernel = serde._fast_tensor(memoryview(data), spec), _kernel_read(data, spec)
    assert (python is None) == (kernel is None)
    if python is not None and kernel is not None:
        assert _same(python, kernel)


def test_an_update_is_scanned_tensor_by_tensor_with_its_own_prefixes(monkeypatch) -> None:
    """Through ``update_from_bytes``: every tensor of a mixed update read (by the kernel where it
    is built, never then by ``_fast_tensor``) as the general path reads it; a tensor under another
    tensor's name is not read fast (the general path reports it)."""
    if serde._SCAN is not None:

        def python_reader(*args: object) -> None:
            raise AssertionError("the Python reader ran beside the kernel")

        monkeypatch.setattr(serde, "_fast_tensor", python_reader)
    pairs = _tensors(3)[:8]
    specs = [spec for _, spec in pairs]
    data = serde.update_to_bytes(serde.EncodedUpdate(1, tuple(enc for enc, _ in pairs)))
    got = serde.update_from_bytes(data, expected=specs)
    general = serde.update_from_bytes(data)  # (no model: every tensor by the general path)
    assert all(_same(a, b) for a, b in zip(got.tensors, general.tensors, strict=True))
    if serde._SCAN is not None:
        assert serde._scan_fast(memoryview(data), array("I", [0, 0]), serde._model_of(specs[:1])) == [None]  # (empty)
    swapped = [specs[1], specs[0], *specs[2:]]
    with pytest.raises(PayloadError, match="found tensor"):
        serde.update_from_bytes(data, expected=swapped)


def test_a_spec_changed_in_place_is_read_afresh() -> None:
    """The receiver's names and shapes are kept from update to update by value: a spec object
    changed in place (a user's own mutable spec type) is not read with its old name."""

    class Spec:
        def __init__(self, name: str, shape: tuple[int, ...]) -> None:
            self.name, self.shape = name, shape

    pairs = _tensors(4)[:3]
    specs = [Spec(spec.name, spec.shape) for _, spec in pairs]
    data = serde.update_to_bytes(serde.EncodedUpdate(1, tuple(enc for enc, _ in pairs)))
    assert [t.name for t in serde.update_from_bytes(data, expected=specs).tensors] == [s.name for s in specs]
    specs[1].name = "renamed"
    with pytest.raises(PayloadError, match="renamed"):
        serde.update_from_bytes(data, expected=specs)


@pytest.mark.skipif(serde._SCAN_UPDATE is None, reason="the wire kernel is not built")
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=EDITS,
    most=st.integers(0, 10),
)
def test_the_kernels_walk_of_an_update_is_the_python_walk(edits, most: int) -> None:
    """``scan_update`` against ``_scan_update_py`` on mutated updates: the same fields and spans,
    or (the kernel saying None) the Python walk raises."""
    pairs = _tensors(5)[:6]
    data = _edited(serde.update_to_bytes(serde.EncodedUpdate(3, tuple(enc for enc, _ in pairs)))[:-5], edits)
    view = memoryview(data)
    try:
        want = serde._scan_update_py(view, len(view), most, "a test's")
    except PayloadError:
        want = None
    spans = array("I", bytes(8 * most))
    got = serde._SCAN_UPDATE(view, len(view), most, False, spans)
    if want is None:
        assert got is None
    else:
        assert got is not None and got[:2] == want[:2] and list(spans[: 2 * got[2]]) == list(want[2])


@pytest.mark.skipif(serde._SCAN_UPDATE is None, reason="the wire kernel is not built")
@pytest.mark.parametrize(
    "data",
    [
        b"\x08\x02\x10\x05\x1a\x01\x00\x1a\x00",  # valid: version, base, two tensors
        b"\x08\x00\x1a\x01\x00",  # version 0, encoded
        b"\x08\x02\x10\x00",  # base 0, encoded
        b"\x10\x05\x08\x02",  # base before version
        b"\x08\x02\x08\x02",  # version twice
        b"\x1a\x01\x00\x08\x02",  # a tensor before the version
        b"\x08\x02\x22\x01\x00",  # field 4
        b"\x08\x02\x1a\x05\x00",  # a tensor past the end
        b"\x08\x02\x1a\x00\x1a\x00\x1a\x00",  # three tensors where the model has two
        b"\x08\x82\x00",  # a non-minimal varint
        b"\x0a\x00",  # field 1 as bytes
    ],
)
def test_the_kernels_walk_refuses_what_the_python_walk_refuses(data: bytes) -> None:
    view = memoryview(data)
    try:
        want = serde._scan_update_py(view, len(view), 2, "a test's")
    except PayloadError:
        want = None
    spans = array("I", bytes(16))
    got = serde._SCAN_UPDATE(view, len(view), 2, False, spans)
    assert (got is None) == (want is None)
    if want is not None:
        assert got is not None and got[:2] == want[:2] and list(spans[: 2 * got[2]]) == list(want[2])


def test_the_kernels_tensors_are_whole_dataclasses() -> None:
    """``payloads.filled`` (the kernel reader's objects, made without ``__init__``'s calls) sets every
    field of each class it fills, so that a field added to one with a default would fail here
    rather than be missing from the kernel's objects."""
    import dataclasses

    from fedcomp.wire.payloads import DensePayload, EncodedTensor, SBCPayload, ThreeLCPayload

    for cls in (EncodedTensor, SBCPayload, ThreeLCPayload, DensePayload):
        assert not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__"), cls
    made = serde._fast_built((0, 0, 1, 0.5, 3, 7, 0, 2), memoryview(b"\x01\x02"), "w", (7,))
    assert made is not None and made.codec_id == serde._CODEC_IDS[0]
    for obj in (made, made.payload):
        assert set(vars(obj)) == {f.name for f in dataclasses.fields(obj)}, type(obj)
        assert obj == dataclasses.replace(obj)  # (what __init__ makes of the same fields)
