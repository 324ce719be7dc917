"""Model tensors <-> Flower ArrayRecords, and the replica digest both sides compare."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping

import torch
from flwr.app import ArrayRecord

from fedcomp.codecs.flat import Layout, to_device, to_host
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


def tensors_to_device(tensors: Mapping[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """Float32 CPU ``tensors`` on ``device``: as they are on the CPU, else views of one buffer
    copied there at once (a copy per tensor cost a GPU client hundreds per round)."""
    device = torch.device(device)
    if device.type == "cpu" or not tensors:
        return dict(tensors)
    layout = Layout.of(tensors)
    return layout.views(_to_device_tensor(torch.cat([t.reshape(-1) for t in tensors.values()]), device))


def _to_device_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU ``t`` on ``device``, its copy counted as :func:`fedcomp.codecs.flat.to_device` counts."""
    return to_device(t.numpy(), device)


def tensors_on_host(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors on the CPU: those on one other device in one copy (float32 ones: a copy per
    tensor, and a wait for each, would cost a GPU client hundreds per round)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1 or next(iter(devices)).type == "cpu":
        return {k: v.detach().cpu() for k, v in tensors.items()}
    if any(t.dtype != torch.float32 for t in tensors.values()):
        return {k: v.detach().cpu() for k, v in tensors.items()}
    layout = Layout.of(tensors)
    return layout.views(_to_host_tensor(torch.cat([t.detach().reshape(-1) for t in tensors.values()])))


def _to_host_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, its copy counted as :func:`fedcomp.codecs.flat.to_host` counts."""
    return torch.from_numpy(to_host(t))


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
