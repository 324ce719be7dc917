"""Shared checks every codec's tests call, so each codec's test file stays short (after numcodecs)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fedcomp.codecs import Codec, TensorSpec, get_codec
from fedcomp.wire import serde

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
#: Set to 1 to write golden fixtures that do not exist yet (never overwrites).
REGEN = os.environ.get("FEDCOMP_WRITE_FIXTURES") == "1"


def round_trip(codec: Codec, tensor: torch.Tensor, name: str = "t") -> tuple[torch.Tensor, torch.Tensor]:
    """Encode, go through real protobuf bytes, decode; also return encode's own reconstruction.

    Checks that the reconstruction the encoder reports equals what the decoder rebuilds (error
    feedback relies on it) and that shape, dtype and device come back as expected.
    """
    enc, recon = codec.encode_with_reconstruction(tensor, name)
    data = serde.tensor_to_bytes(enc)
    dec = codec.decode(serde.tensor_from_bytes(data), TensorSpec.of(name, tensor), device=tensor.device)
    assert dec.shape == tensor.shape and dec.dtype == tensor.dtype and dec.device == tensor.device
    assert recon.shape == tensor.shape
    torch.testing.assert_close(recon.to(dec.dtype), dec, rtol=0, atol=0)
    return dec, recon


def check_config_round_trip(codec: Codec) -> None:
    cfg = codec.get_config()
    assert cfg["id"] == codec.codec_id
    cfg2 = json.loads(json.dumps(cfg))  # JSON-safe
    again = get_codec(cfg2)
    assert again == codec and again.get_config() == cfg
    assert type(codec).from_config(cfg2) == codec


def check_golden(codec: Codec, case: str, tensor: torch.Tensor) -> None:
    """Freeze the wire bytes: encoding the stored input must reproduce the stored bytes, and the
    stored bytes must decode to what encode's reconstruction says.

    Fixtures live in ``tests/fixtures/<codec_id>/v<version>/<case>.{input,bin,json}``: the input
    as raw little-endian float32, the serialized CompressedTensor, and the codec config + shape.
    """
    folder = FIXTURES / codec.codec_id / f"v{codec.version}"
    inp, out, meta = (folder / f"{case}.input", folder / f"{case}.bin", folder / f"{case}.json")
    if not out.exists():
        assert REGEN, f"golden fixture {out} is missing; run with FEDCOMP_WRITE_FIXTURES=1 to create it"
        folder.mkdir(parents=True, exist_ok=True)
        t = tensor.detach().to(torch.float32).contiguous().cpu()
        inp.write_bytes(t.numpy().tobytes())
        out.write_bytes(serde.tensor_to_bytes(codec.encode(t, case)))
        meta.write_text(json.dumps({"config": codec.get_config(), "shape": list(t.shape)}, indent=1) + "\n")
    info = json.loads(meta.read_text())
    stored = get_codec(info["config"])
    assert stored == codec, f"fixture {case} was made with {info['config']}"
    shape = tuple(info["shape"])
    x = torch.frombuffer(bytearray(inp.read_bytes()), dtype=torch.float32).reshape(shape)
    golden = out.read_bytes()
    enc, recon = codec.encode_with_reconstruction(x, case)
    assert serde.tensor_to_bytes(enc) == golden, f"wire bytes of {codec.codec_id}/{case} changed"
    dec = codec.decode(serde.tensor_from_bytes(golden), TensorSpec(case, shape))
    torch.testing.assert_close(dec, recon, rtol=0, atol=0)


def devices() -> list[str]:
    """CPU, plus CUDA when present: parametrize device tests with this."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def check_rejects(
    codec: Codec,
    spec: TensorSpec,
    cases: dict[str, object],
    not_on_wire: tuple[str, ...] = (),
    reasons: dict[str, str] | None = None,
) -> None:
    """Every bad encoding in ``cases`` raises :class:`PayloadError` naming ``spec``'s tensor,
    decoded directly and, except the cases protobuf cannot carry (``not_on_wire``), after a
    trip through real protobuf bytes. ``reasons`` gives, by case, the exact reason expected
    (what an operator reads in the server log)."""
    import pytest

    from fedcomp.errors import PayloadError

    for why, bad in cases.items():
        with pytest.raises(PayloadError, match=f"'{spec.name}'") as info:
            codec.decode(bad, spec)  # type: ignore[arg-type]
        assert info.value.tensor == spec.name, why
        if reasons and why in reasons:
            assert info.value.reason == reasons[why], why
        if why not in not_on_wire:
            with pytest.raises(PayloadError):
                codec.decode(serde.tensor_from_bytes(serde.tensor_to_bytes(bad)), spec)  # type: ignore[arg-type]


class LargestTensor(TorchDispatchMode):
    """While active, records the most elements of any tensor a torch operation makes.

    A deterministic stand-in for "decoding a hostile payload is cheap": instead of timing the
    decoder (a flaky assertion on a shared machine), bound what it allocates by what the payload
    can legitimately expand to. Tensors made outside torch's dispatcher (``frombuffer``) are the
    payload's own bytes and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out
