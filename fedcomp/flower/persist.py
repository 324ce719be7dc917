"""Client state on the node's disk, so a client survives a server restart (resume after a crash).

A resumed server run is a new Flower run (a new run id): every SuperNode gives its ClientApp an
empty ``context.state``, and the residual, replica and pending update of the run so far would be
gone. So the compression mod writes the whole ``context.state`` (Flower's own protobuf encoding)
after every message it handles, and loads it when ``context.state`` is empty and this run's state
is on disk.

**Where.** ``<state-dir>/<run-name>/<lineage>/partition-<partition-id>/round-<R>.state``.
``state-dir`` is a node-config key (``flower-supernode --node-config "state-dir='/var/lib/x'"``);
by default ``$FEDCOMP_STATE_DIR`` (what ``python -m fedcomp run`` sets for its simulation:
``<run folder>/client-state``), else ``$FLWR_HOME/fedcomp-state``, or ``fedcomp-state-<uid>`` in
the temp folder when FLWR_HOME is not set; ``state-dir = "off"`` turns persistence off. ``run-name`` is the run
config's (``unnamed`` when empty); the *lineage* is a token the server draws once per run and
keeps in its checkpoint (``fedcomp.lineage`` in every train/evaluate config): a resumed run finds
its clients' state, a new run with the same name starts clean. Nothing is keyed by the Flower
run id, which changes on resume.

**Which snapshot.** ``round-<R>`` holds the state after the messages of round R. A resumed server
continues at round K + 1 from its checkpoint of round K, but it may have sent round K + 1 to the
clients before it died: a client that already trained it holds state the resumed run must not
see (its pending update would be added back to the residual, and the redone round would count the
same local work twice). So the client loads the newest snapshot of a round *before* the message's
round: exactly the state an uninterrupted run would have, and the resumed run's model is
bit-identical to it (``tests/app/test_resume.py``). State saved under another node id (the
SuperNode restarted; a new simulation) keeps its residual, drops its replica (the server sends a
node it does not know what a new node needs), and settles its pending update by the server's record
of the old node id (``fedcomp.flower.mod._as_a_new_node``). The last :data:`KEEP` rounds are kept, and
per run name the last :data:`KEEP_RUNS` runs (lineages), and the last :data:`KEEP_RUN_NAMES` run
names: the folder stays bounded however many runs a node serves.

Writes are atomic (temp file + ``os.replace``). A snapshot that cannot be read is skipped with a
warning (the next older one is tried; with none, the client starts empty and the protocol's full
resync brings it back).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from flwr.app import RecordDict
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # type: ignore[attr-defined]

log = logging.getLogger("flwr").getChild("fedcomp")

__all__ = ["KEEP", "STATE_DIR_ENV", "STATE_DIR_KEY", "ClientStore", "default_state_dir", "store_for"]

#: Node-config key of the folder holding the clients' state ("off": no persistence).
STATE_DIR_KEY = "state-dir"
#: Environment variable of that folder where the node config names none (a simulation's nodes
#: cannot be given node-config keys of their own).
STATE_DIR_ENV = "FEDCOMP_STATE_DIR"
#: Snapshots kept per client: the server can be at most one round past its checkpoint.
KEEP = 3
#: Runs (lineages) of one run name whose client state is kept on a node.
KEEP_RUNS = 3
#: Run names whose client state is kept on a node (the most recently started): run names are often
#: unique (timestamps), so the per-name bound alone would let the folder grow with every run.
KEEP_RUN_NAMES = 8
_MAGIC = b"FCSTATE1"
_NAME = re.compile(r"round-(\d{1,9})\.state")
_TOKEN = re.compile(r"[0-9a-f]{1,64}")


def default_state_dir() -> Path:
    """``$FEDCOMP_STATE_DIR`` (``python -m fedcomp run`` sets it to the run's folder), else
    ``$FLWR_HOME/fedcomp-state``, else ``fedcomp-state-<uid>`` in the temp folder."""
    chosen = os.environ.get(STATE_DIR_ENV, "")
    if chosen:
        return Path(chosen).expanduser()
    home = os.environ.get("FLWR_HOME", "")
    if home:
        return Path(home) / "fedcomp-state"
    return Path(tempfile.gettempdir()) / f"fedcomp-state-{os.getuid()}"


def _plain(name: str) -> str:
    """``name`` as one safe folder name."""
    out = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]
    return "unnamed" if out in ("", ".", "..") else out


class ClientStore:
    """One client's snapshots: ``folder/round-<R>.state``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def rounds(self) -> list[int]:
        """The rounds with a snapshot on disk, oldest first."""
        if not self.folder.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.folder.iterdir() if (m := _NAME.fullmatch(p.name)))

    def path(self, server_round: int) -> Path:
        return self.folder / f"round-{server_round}.state"

    def save(self, state: RecordDict, server_round: int) -> Path:
        """Write ``state`` as round ``server_round``'s snapshot (atomically) and keep the newest
        :data:`KEEP` rounds. (A snapshot of a round a dead server sent is overwritten when the
        resumed server sends that round again.)"""
        if not self.folder.is_dir():
            self.folder.mkdir(parents=True, exist_ok=True)
            _prune_lineages(self.folder.parent)
        body = recorddict_to_proto(state).SerializeToString()
        data = _MAGIC + zlib.crc32(body).to_bytes(4, "little") + body
        target = self.path(server_round)
        write_atomically(target, lambda f: f.write(data))
        for r in self.rounds()[:-KEEP]:
            self.path(r).unlink(missing_ok=True)
        return target

    def load(self, server_round: int) -> RecordDict:
        """The snapshot of ``server_round``; raise ``ValueError`` naming the file when it is not
        one (truncated, corrupt)."""
        path = self.path(server_round)
        data = path.read_bytes()
        if len(data) < len(_MAGIC) + 4 or not data.startswith(_MAGIC):
            raise ValueError(f"{path}: not a fedcomp client state file")
        body = data[len(_MAGIC) + 4 :]
        if zlib.crc32(body) != int.from_bytes(data[len(_MAGIC) : len(_MAGIC) + 4], "little"):
            raise ValueError(f"{path}: checksum mismatch (truncated or corrupt)")
        proto = ProtoRecordDict()
        proto.ParseFromString(body)
        return recorddict_from_proto(proto)

    def load_before(self, server_round: int) -> tuple[int, RecordDict] | None:
        """The newest readable snapshot of a round before ``server_round`` (None: none)."""
        for r in reversed([r for r in self.rounds() if r < server_round]):
            try:
                return r, self.load(r)
            except (OSError, ValueError) as exc:  # protobuf's DecodeError is a ValueError too
                log.warning("fedcomp: skipping an unreadable client state: %s", exc)
        return None


def write_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a temporary file beside ``path``, flush it to disk, then rename it over
    ``path``: a reader (or a process restarted after a crash) sees the old file or the new one,
    never a half-written one. The temporary file is removed if anything fails."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _prune_lineages(lineage_dir: Path) -> None:
    """Keep the :data:`KEEP_RUNS` most recently written lineages of a run name (a new run with an
    old name makes the old one's state obsolete; a running run keeps its own in memory, so only
    its resumability is at stake). Bounds the disk a node spends on runs that never resume."""
    runs = [p for p in lineage_dir.parent.iterdir() if p.is_dir() and _TOKEN.fullmatch(p.name)]
    runs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in runs[KEEP_RUNS:]:
        if old != lineage_dir:
            shutil.rmtree(old, ignore_errors=True)
    run_dir = lineage_dir.parent
    names = [p for p in run_dir.parent.iterdir() if p.is_dir()]
    names.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in names[KEEP_RUN_NAMES:]:
        if old != run_dir:
            shutil.rmtree(old, ignore_errors=True)


def store_for(run_config: Mapping[str, Any], node_config: Mapping[str, Any], lineage: object) -> ClientStore | None:
    """This client's store, or None when there is no persistence: ``state-dir = "off"``, no
    ``partition-id`` in the node config, or no valid lineage token from the server."""
    where = node_config.get(STATE_DIR_KEY, "")
    if where == "off":
        return None
    pid = node_config.get("partition-id")
    if isinstance(pid, bool) or not isinstance(pid, int | str) or not isinstance(lineage, str):
        return None
    if not _TOKEN.fullmatch(lineage):
        return None
    root = Path(str(where)).expanduser() if isinstance(where, str) and where else default_state_dir()
    run_name = run_config.get("run-name", "")
    return ClientStore(root / _plain(str(run_name)) / lineage / f"partition-{_plain(str(pid))}")
