"""The server's fast read of a tensor (``serde._fast_tensor``): it may only accept bytes the general
path (protobuf, canonical check) accepts, and must make the same tensor of them; on the tensors
a server or client receives every round (SBC, 3LC, dense) it must accept. Checked on valid tensors of every
codec and on mutated ones (a byte changed, inserted, dropped; a field's value moved to a non-
canonical form)."""

from __future__ import annotations

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
        out.append((codec.encode(t, name), TensorSpec(name, tuple(shape))))
    return out


def test_valid_tensors_are_read_as_the_general_path_reads_them() -> None:
    accepted = 0
    for enc, spec in _tensors(0):
        data = serde.tensor_to_bytes(enc)
        fast = serde._fast_tensor(memoryview(data), spec)
        general = _general(data, spec)
        if fast is not None:
            assert isinstance(general, EncodedTensor) and _same(fast, general), spec.name
            accepted += 1
        elif (
            enc.codec_id in ("sbc", "3lc", "dense-fp32", "dense-fp16", "identity") and len(spec.shape) <= serde.MAX_RANK
        ):
            pytest.fail(f"{spec.name}: a common tensor left to the general path")
    assert accepted == 8


def test_an_sbc_mean_or_3lc_scale_of_zero_and_an_empty_payload_go_the_general_way() -> None:
    spec = TensorSpec("w", (10,))
    for payload in (SBCPayload(0.0, 3, 0, b""), SBCPayload(-0.0, 1, 1, b"\x01"), SBCPayload(0.5, 0, 0, b"")):
        enc = EncodedTensor("w", (10,), "float32", "sbc", 1, payload)
        data = serde.tensor_to_bytes(enc)
        assert serde._fast_tensor(memoryview(data), spec) is None
        general = _general(data, spec)
        assert isinstance(general, EncodedTensor) and _same(general, enc)
    for p3 in (
        ThreeLCPayload(0.0, 10, True, b"\xf4"),
        ThreeLCPayload(-0.0, 10, False, b"yy"),
        ThreeLCPayload(0.5, 0, True, b""),
    ):
        enc = EncodedTensor("w", (10,), "float32", "3lc", 1, p3)
        data = serde.tensor_to_bytes(enc)
        assert serde._fast_tensor(memoryview(data), spec) is None
        general = _general(data, spec)
        assert isinstance(general, EncodedTensor) and _same(general, enc)
    dense = EncodedTensor("w", (0,), "float32", "dense-fp32", 1, DensePayload("float32", b""))
    assert serde._fast_tensor(memoryview(serde.tensor_to_bytes(dense)), TensorSpec("w", (0,))) is None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    which=st.integers(0, 9),
    edits=st.lists(
        st.tuples(st.sampled_from(["set", "insert", "drop"]), st.integers(0, 10**6), st.integers(0, 255)),
        min_size=1,
        max_size=3,
    ),
)
def test_mutated_tensors_are_never_read_otherwise_than_by_the_general_path(which: int, edits) -> None:
    enc, spec = _tensors(1)[which]
    data = bytearray(serde.tensor_to_bytes(enc))
    for op, at, value in edits:
        at %= len(data) + (op == "insert")
        if op == "set" and data:
            data[at % len(data)] = value
        elif op == "insert":
            data.insert(at, value)
        elif data:
            del data[at % len(data)]
    fast = serde._fast_tensor(memoryview(bytes(data)), spec)
    if fast is not None:
        general = _general(bytes(data), spec)
        assert isinstance(general, EncodedTensor), general
        assert _same(fast, general)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.replace(b"\x10\x06", b"\x10\x86\x00", 1),  # golomb_b as a non-minimal varint
        lambda d: d.replace(b"\x28\x01", b"\x28\x00", 1),  # codec_version 0, encoded (not canonical)
        lambda d: d.replace(b"\x18\x01", b"\x18\x09", 1),  # an unknown dtype
    ],
)
def test_non_canonical_fields_are_left_to_the_general_path_which_refuses_them(change) -> None:
    t = torch.from_numpy(np.random.default_rng(2).standard_t(3, 4096).astype(np.float32))
    enc = SBC(0.01).encode(t, "w")
    assert isinstance(enc.payload, SBCPayload) and enc.payload.golomb_b == 6
    data = change(serde.tensor_to_bytes(enc))
    spec = TensorSpec("w", (4096,))
    assert serde._fast_tensor(memoryview(data), spec) is None
    assert isinstance(_general(data, spec), str)


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d.replace(b"\x10\x80\x20", b"\x10\x80\xa0\x00", 1),  # numel as a non-minimal varint
        lambda d: d.replace(b"\x18\x01", b"\x18\x02", 1),  # zero_run 2: not a canonical bool
        lambda d: d.replace(b"\x18\x01", b"\x18\x00", 1),  # zero_run false, encoded (not canonical)
    ],
)
def test_non_canonical_3lc_fields_are_left_to_the_general_path_which_refuses_them(change) -> None:
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
    assert serde._fast_tensor(memoryview(data), spec) is None
    assert isinstance(_general(data, spec), str)
    # zero_run dropped: a valid tensor (without zero runs), read alike by both paths
    dropped = _tensor_bytes(head, key, sub.replace(b"\x18\x01", b"", 1))
    fast = serde._fast_tensor(memoryview(dropped), spec)
    general = _general(dropped, spec)
    assert fast is not None and isinstance(general, EncodedTensor) and _same(fast, general)
    assert isinstance(fast.payload, ThreeLCPayload) and not fast.payload.zero_run


def _tensor_bytes(head: bytes, payload_key: int, sub: bytes) -> bytes:
    return head + bytes([payload_key]) + serde.fast_writer.varint(len(sub)) + sub


@pytest.mark.parametrize("kind", ["sbc", "dense"])
def test_an_empty_bytes_field_written_out_is_left_to_the_general_path_which_refuses_it(kind: str) -> None:
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
    assert serde._fast_tensor(memoryview(data), spec) is None
    assert "present but empty" in str(_general(data, spec))
    # the same with one byte of data: both paths read it, and alike
    one = _tensor_bytes(head, key, sub[:-1] + b"\x01\x07")
    fast = serde._fast_tensor(memoryview(one), spec)
    general = _general(one, spec)
    assert fast is not None and isinstance(general, EncodedTensor) and _same(fast, general)
