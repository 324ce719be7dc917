"""Model tensors <-> Flower ArrayRecords, and the replica digest both sides compare."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping

import torch
from flwr.app import ArrayRecord

from fedcomp.codecs.flat import tensors_on_host, tensors_to_device
from fedcomp.errors import ConfigError


def tensors_from_record(record: ArrayRecord, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Float32 tensors of an ArrayRecord, in its order. Only floating-point arrays are supported.
    On a device other than the CPU the tensors are views of one buffer, copied there at once."""
    host: dict[str, torch.Tensor] = {}
    for name, t in record.to_torch_state_dict().items():
        if not t.is_floating_point():
            raise ConfigError(f"array {name!r} has dtype {t.dtype}: fedcomp compresses floating-point arrays only")
        host[name] = t.to(dtype=torch.float32)
    return tensors_to_device(host, device)


def record_from_tensors(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord(OrderedDict(tensors_on_host(tensors)))


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, shapes and float32 bytes, in order: equal iff bit-identical."""
    h = hashlib.sha256()
    for name, t in tensors_on_host({k: v.detach().to(torch.float32) for k, v in tensors.items()}).items():
        h.update(name.encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().data)  # in place, no copy
    return h.hexdigest()[:32]


def fp32_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """What the tensors would cost dense in float32: the baseline for compression factors."""
    return 4 * sum(t.numel() for t in tensors.values())
