"""The update the envelope fixtures freeze: five tensors, one per codec family, a base version.

``tests/fixtures/envelope/v<format>/mixed.{input,json,bin}``: the tensors as raw little-endian
float32 (concatenated in order), their names/shapes/codec configs and the base model version,
and the serialized ``CompressedUpdate`` (FORMAT.md, Envelope). ``v2`` is the current format;
``v1/mixed.bin`` is the same update as format 1 wrote it (no ``crc32``), which a decoder rejects.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from fedcomp.codecs import SBC, STC, Codec, DenseFP32, TensorSpec, ThreeLC, TopK, get_codec

FOLDER = Path(__file__).resolve().parent.parent / "fixtures" / "envelope"
#: Set to 1 to write envelope fixtures that do not exist yet (never overwrites).
REGEN = os.environ.get("FEDCOMP_WRITE_FIXTURES") == "1"
BASE_VERSION = 7

#: name -> (shape, codec)
LAYOUT: dict[str, tuple[tuple[int, ...], Codec]] = {
    "conv": ((4, 3, 3, 3), DenseFP32()),
    "w_sbc": ((32, 40), SBC(p=0.05)),
    "w_3lc": ((1000,), ThreeLC()),
    "w_topk": ((20, 30), TopK(p=0.1)),
    "w_stc": ((700,), STC(p=0.05)),
}


def make_tensors() -> dict[str, torch.Tensor]:
    """The inputs as first written (seeded normal values); the fixture stores their bytes."""
    g = torch.Generator().manual_seed(14)
    return {name: torch.randn(shape, generator=g) for name, (shape, _) in LAYOUT.items()}


def specs() -> list[TensorSpec]:
    return [TensorSpec(name, shape) for name, (shape, _) in LAYOUT.items()]


def load(version: int = 2) -> tuple[dict[str, torch.Tensor], dict[str, Codec], int, bytes]:
    """``(tensors, codec per tensor, base version, golden bytes)`` of ``v<version>/mixed``."""
    folder = FOLDER / f"v{version}"
    meta = json.loads((folder / "mixed.json").read_text())
    raw = bytearray((folder / "mixed.input").read_bytes())
    flat = torch.frombuffer(raw, dtype=torch.float32)
    tensors, codecs, at = {}, {}, 0
    for t in meta["tensors"]:
        shape = tuple(t["shape"])
        n = 1
        for d in shape:
            n *= d
        tensors[t["name"]] = flat[at : at + n].reshape(shape).clone()
        codecs[t["name"]] = get_codec(t["codec"])
        at += n
    assert at == flat.numel(), "mixed.input holds more values than mixed.json describes"
    return tensors, codecs, int(meta["base_model_version"]), (folder / "mixed.bin").read_bytes()


def write_missing(version: int, data: bytes) -> None:
    """Write ``v<version>/mixed.*`` from :func:`make_tensors` when absent and REGEN is set."""
    folder = FOLDER / f"v{version}"
    if (folder / "mixed.bin").exists():
        return
    assert REGEN, f"golden fixture {folder / 'mixed.bin'} is missing; run with FEDCOMP_WRITE_FIXTURES=1 to create it"
    folder.mkdir(parents=True, exist_ok=True)
    tensors = make_tensors()
    (folder / "mixed.input").write_bytes(b"".join(t.contiguous().numpy().tobytes() for t in tensors.values()))
    meta = {
        "format_version": version,
        "base_model_version": BASE_VERSION,
        "tensors": [
            {"name": name, "shape": list(shape), "codec": codec.get_config()} for name, (shape, codec) in LAYOUT.items()
        ],
    }
    (folder / "mixed.json").write_text(json.dumps(meta, indent=1) + "\n")
    (folder / "mixed.bin").write_bytes(data)
