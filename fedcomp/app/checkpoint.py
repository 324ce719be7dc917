"""The ServerApp's checkpoint: the whole server state after a round, so a crashed run can resume.

After every round the reference ServerApp writes ``checkpoint.pt`` into its run folder (beside
results.json), atomically (temp file, fsync, ``os.replace``): a reader, or a resumed run, sees the
previous checkpoint or the new one, never half of one. With ``resume = true`` in the run config
(same ``results-dir`` and ``run-name``) the ServerApp loads it and continues from the next round.

What it holds (:class:`ServerCheckpoint`): the round, the global model W, the compression
wrapper's state (:meth:`fedcomp.flower.strategy.CompressionStrategy.state_dict`: replica, delta
log, version, per-node records, update outcomes, the uplink method's state, the lineage token the
clients key their own state by), the RNG states the server draws from (``random`` samples
clients in FedAvg, torch), the ``max-empty-rounds`` streak, and results.json's rounds. Not held:
an inner strategy's own state (FedAvg has none; FedAdam's moments would be lost) — say so if you
resume with another strategy.

The file is a ``torch.save`` pickle of plain data only (tensors, numbers, strings, bytes, lists,
tuples, sets and dicts; the replica as :meth:`fedcomp.flower.replica.ServerReplica.state_dict`),
read with ``weights_only=True``: a pickle can name any Python callable to run while it is read,
and a run folder may sit on shared storage or come from elsewhere, so a checkpoint that holds
anything else is refused unread (:class:`CheckpointError` naming the object), never executed.
:func:`save_checkpoint` checks the same before it writes, so a state that could not be read back
fails the run that writes it, not the one that resumes. (Format 1, before this, pickled the
replica object itself: it is refused with a message saying so.)
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fedcomp.flower.persist import write_atomically

__all__ = ["CHECKPOINT_FILE", "CheckpointError", "ServerCheckpoint", "load_checkpoint", "save_checkpoint"]

CHECKPOINT_FILE = "checkpoint.pt"
#: Bumped when the layout changes; a checkpoint of another format is refused, naming the file.
#: 2: plain data only (format 1 pickled the server's replica object).
FORMAT = 2


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, corrupt, or not one of this run (the message names the
    file and what is wrong)."""


@dataclass
class ServerCheckpoint:
    """The server's state after ``round`` (see the module docstring)."""

    round: int
    model: dict[str, torch.Tensor]
    strategy: dict[str, Any] | None
    rounds: list[dict[str, Any]]
    config: dict[str, Any]
    empty_rounds: list[int] = field(default_factory=list)
    python_rng: Any = None
    torch_rng: torch.Tensor | None = None
    started_at: str = ""
    #: The DP accountant's state (``PrivacyAccountant.state_dict``), when the run accounts privacy.
    privacy: dict[str, Any] | None = None

    @staticmethod
    def rng_now() -> tuple[Any, torch.Tensor]:
        """The server process's RNG states (``random``, torch's CPU generator)."""
        return random.getstate(), torch.get_rng_state()

    def restore_rng(self) -> None:
        """Put the saved RNG states back (what an uninterrupted run would draw next)."""
        if self.python_rng is not None:
            random.setstate(self.python_rng)
        if self.torch_rng is not None:
            torch.set_rng_state(self.torch_rng)


def save_checkpoint(run_dir: Path, ckpt: ServerCheckpoint) -> Path:
    """Write ``ckpt`` to ``run_dir/checkpoint.pt`` atomically; return the path."""
    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT_FILE
    data = {
        "format": FORMAT,
        "round": int(ckpt.round),
        "model": {k: v.detach().cpu().clone() for k, v in ckpt.model.items()},
        "strategy": ckpt.strategy,
        "rounds": ckpt.rounds,
        "config": ckpt.config,
        "empty-rounds": list(ckpt.empty_rounds),
        "python-rng": ckpt.python_rng,
        "torch-rng": ckpt.torch_rng,
        "started-at": ckpt.started_at,
        "privacy": ckpt.privacy,
    }
    where = _not_plain(data, "")
    if where is not None:
        raise CheckpointError(f"{path}: not written: {where} (a checkpoint holds plain data only, see the module doc)")
    stored = _empty_bytes_swapped(data, bytes, bytearray)
    write_atomically(path, lambda f: torch.save(stored, f))
    return path


def _empty_bytes_swapped(value: Any, old: type, new: type) -> Any:
    """``value`` with every empty ``old`` (bytes or bytearray) as an empty ``new``, in plain
    containers. torch pickles ``b""`` as a call of ``bytes``, which its weights-only loader refuses:
    a checkpoint holding one (GradiVeQ's compressor before its first fit) was written and then
    refused on resume. An empty bytearray loads; :func:`load_checkpoint` turns it back."""
    if type(value) is old and not value:
        return new()
    if type(value) is dict:
        return {k: _empty_bytes_swapped(v, old, new) for k, v in value.items()}
    if type(value) in _CONTAINERS:
        return type(value)(_empty_bytes_swapped(v, old, new) for v in value)
    return value


#: What a checkpoint may hold: leaves and containers ``torch.load(weights_only=True)`` reads by
#: default (exact types: a subclass, an enum say, is pickled by its class's name).
_LEAVES = (type(None), bool, int, float, str, bytes, torch.Tensor, torch.nn.Parameter)
_CONTAINERS = (list, tuple, set, frozenset)


def _not_plain(value: Any, at: str) -> str | None:
    """Where ``value`` holds something other than plain data (a path and the type), else None."""
    if type(value) in _LEAVES:
        return None
    if type(value) is dict:
        for k, v in value.items():
            found = _not_plain(k, f"{at}/<key>") or _not_plain(v, f"{at}/{k}")
            if found is not None:
                return found
        return None
    if type(value) in _CONTAINERS:
        for i, v in enumerate(value):
            found = _not_plain(v, f"{at}[{i}]")
            if found is not None:
                return found
        return None
    return f"{at or '/'} is a {type(value).__module__}.{type(value).__qualname__}"


_FIELDS: dict[str, type | tuple[type, ...]] = {
    "round": int,
    "model": dict,
    "strategy": (dict, type(None)),
    "rounds": list,
    "config": dict,
    "empty-rounds": list,
    "started-at": str,
}


def load_checkpoint(run_dir: Path) -> ServerCheckpoint:
    """Read ``run_dir/checkpoint.pt``; raise :class:`CheckpointError` naming the file when it is
    missing, truncated or corrupt, of another format, or malformed."""
    path = Path(run_dir) / CHECKPOINT_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: no checkpoint to resume from (did the run finish a round?)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # zip errors, unpickling errors, EOF: all mean "not a good file"
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if found is not None:  # (torch's weights-only unpickler refused a callable the file names)
            raise CheckpointError(
                f"{path}: holds a {found.group(1)}, which a checkpoint of this fedcomp never does (one "
                f"written before checkpoint format {FORMAT}, or not a fedcomp checkpoint): not loaded, "
                "as reading it could run code from the file"
            ) from None
        raise CheckpointError(f"{path}: cannot be read (truncated or corrupt?): {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a fedcomp checkpoint (a {type(data).__name__})")
    data = _empty_bytes_swapped(data, bytearray, bytes)
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {data.get('format')!r}, this fedcomp reads {FORMAT}")
    for key, kind in _FIELDS.items():
        if not isinstance(data.get(key), kind) or isinstance(data.get(key), bool):
            raise CheckpointError(f"{path}: field {key!r} is missing or malformed")
    model = data["model"]
    if not model or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in model.items()):
        raise CheckpointError(f"{path}: field 'model' is not a dict of tensors")
    last = data["rounds"][-1].get("round") if data["rounds"] and isinstance(data["rounds"][-1], dict) else None
    if data["round"] < 1 or last != data["round"]:
        raise CheckpointError(f"{path}: round {data['round']} does not match the last recorded round {last!r}")
    torch_rng = data.get("torch-rng")
    if torch_rng is not None and not isinstance(torch_rng, torch.Tensor):
        raise CheckpointError(f"{path}: field 'torch-rng' is malformed")
    privacy = data.get("privacy")
    if privacy is not None and not isinstance(privacy, dict):
        raise CheckpointError(f"{path}: field 'privacy' is malformed")
    return ServerCheckpoint(
        round=data["round"],
        model=model,
        strategy=data["strategy"],
        rounds=data["rounds"],
        config=data["config"],
        empty_rounds=[int(r) for r in data["empty-rounds"]],
        python_rng=data.get("python-rng"),
        torch_rng=torch_rng,
        started_at=data["started-at"],
        privacy=privacy,
    )
