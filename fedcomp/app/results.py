"""Per-round results: a table printed as the run goes, and ``results/<run>/results.json``.

The recorder knows nothing about compression. Whoever moves bytes reports them with
:meth:`RunRecorder.add_traffic` (per client, per direction, actual and dense-equivalent sizes);
:meth:`RunRecorder.add_metrics` attaches extra numbers (``train_loss``); whoever evaluates the
global model closes the round with :meth:`RunRecorder.end_round`, which
sums the traffic, prints one table row and rewrites ``results.json`` (so a crashed run still
leaves every finished round on disk). :meth:`RunRecorder.finish` marks the run completed.

``results.json``::

    {
      "run_name": "...", "status": "running" | "completed" | "failed", "error": null,
      "started_at": "2025-...Z", "finished_at": ..., "config": {... run config ...},
      "summary": {...},
      "rounds": [
        {"round": 0, "accuracy": 0.1, "loss": 2.3,
         "uplink_bytes": 0, "downlink_bytes": 0, "dense_uplink_bytes": 0,
         "dense_downlink_bytes": 0, "uplink_compression": null, "downlink_compression": null,
         "num_clients": 0, "round_time_s": 0.4, "wall_time_s": 0.4,
         "clients": {"ids": [], "uplink_bytes": [], "downlink_bytes": [],
                     "dense_uplink_bytes": [], "dense_downlink_bytes": []},
         ... extra metrics passed to end_round ...},
        ...
      ]
    }

Round 0 is the evaluation of the initial model (no traffic). Compression factors are
dense / actual bytes (null when nothing was sent). The reference ServerApp adds to every train
round ``updates_aggregated`` (client updates the strategy aggregated; 0 = the model did not
move) and ``client_errors`` (node id -> why its reply carried no usable update).

A run that fails before its first round (a bad run config, data that cannot be loaded) still
leaves a results.json: :func:`record_failure` writes one with status "failed", the reason, and
no rounds. Files are written mode 0644 (readable by the group, as results are shared).

The table printed per round: ``acc``/``loss`` of the global model on the test set; ``up`` and
``down`` the payload bytes of the round summed over its clients, ``dense_up``/``dense_dn`` what
the same messages weigh as dense fp32 models, ``up_x``/``down_x`` the compression factors
(dense / actual; ``-`` when nothing was sent); ``time_s`` seconds since the run started
(cumulative, evaluation included).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from fedcomp.app.config import RESULTS_DIR_ENV

__all__ = ["RESULTS_FILE", "ClientTraffic", "RunRecorder", "new_run_name", "record_failure", "resolve_results_root"]

RESULTS_FILE = "results.json"
#: results.json's permissions: the owner writes, everyone may read.
RESULTS_MODE = 0o644
_DIRECTIONS = ("uplink_bytes", "downlink_bytes", "dense_uplink_bytes", "dense_downlink_bytes")


def resolve_results_root(results_dir: str | Path | None = None) -> Path:
    """``results_dir`` if non-empty, else ``$FEDCOMP_RESULTS_DIR``, else ``./results``."""
    value = str(results_dir) if results_dir else os.environ.get(RESULTS_DIR_ENV, "") or "results"
    return Path(value).expanduser().resolve()


@dataclass
class ClientTraffic:
    uplink_bytes: int = 0
    downlink_bytes: int = 0
    dense_uplink_bytes: int = 0
    dense_downlink_bytes: int = 0


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n}B"


def _ratio(dense: int, actual: int) -> float | None:
    """Compression factor dense / actual; None when either is 0 (nothing sent, or only what a
    dense run would not have sent at all: DEFT's round-1 allocation)."""
    return dense / actual if actual > 0 and dense > 0 else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN/inf are not JSON
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "item"):  # numpy / torch scalars
        return _jsonable(value.item())
    return str(value)


class RunRecorder:
    """Collects per-round metrics and traffic, prints a table, writes ``results.json``.

    Parameters
    ----------
    config : the run's config (recorded verbatim under ``"config"``).
    results_dir : root folder; empty/None = ``$FEDCOMP_RESULTS_DIR`` or ``./results``.
    run_name : the run's folder under the root; empty/None = a UTC timestamp (with a numeric
        suffix if that folder exists). An explicit name reuses (overwrites) its folder.
    stream : where the table goes (``None`` = no table). Default: stdout.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        results_dir: str | Path | None = None,
        run_name: str | None = None,
        stream: IO[str] | None = sys.stdout,
    ) -> None:
        root = resolve_results_root(results_dir)
        self.started_at = _dt.datetime.now(_dt.UTC)
        name = run_name or new_run_name(root, self.started_at)
        self.run_name = name
        self.run_dir = root / name
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / RESULTS_FILE
        self.stream = stream
        self._config = _jsonable(dict(config))
        self._t0 = time.monotonic()
        self._t_round = self._t0
        self._rounds: list[dict[str, Any]] = []
        #: Each round's entry as it stands in results.json (indented), written once: results.json
        #: is rewritten every round, and dumping every round again made that quadratic (51 ms a
        #: write at round 300, a 300-round run 12-20 % slower by its end: soak audit).
        self._round_texts: list[str] = []
        self._traffic: dict[str, ClientTraffic] = {}
        self._metrics: dict[str, Any] = {}
        self._status = "running"
        self._error: str | None = None
        self._summary: dict[str, Any] = {}
        self._header_printed = False
        self._write()

    # --- recording ----------------------------------------------------------------------------

    @property
    def rounds(self) -> list[dict[str, Any]]:
        return list(self._rounds)

    def restore(self, rounds: list[dict[str, Any]], started_at: str | None) -> None:
        """Continue a run from a checkpoint: its recorded rounds and start time, and the wall clock
        advanced by the time those rounds took, so the resumed run appends to the same results.json."""
        self._rounds = [dict(r) for r in rounds]
        self._round_texts = [_entry_text(r) for r in self._rounds]
        if started_at:
            self.started_at = _dt.datetime.fromisoformat(started_at)
        wall = rounds[-1].get("wall_time_s", 0.0) if rounds else 0.0
        self._t0 = time.monotonic() - float(wall or 0.0)
        self._write()

    def add_traffic(
        self,
        client: int | str,
        *,
        uplink_bytes: int = 0,
        downlink_bytes: int = 0,
        dense_uplink_bytes: int = 0,
        dense_downlink_bytes: int = 0,
    ) -> None:
        """Add bytes moved to/from ``client`` in the current round (accumulates per client)."""
        t = self._traffic.setdefault(str(client), ClientTraffic())
        t.uplink_bytes += int(uplink_bytes)
        t.downlink_bytes += int(downlink_bytes)
        t.dense_uplink_bytes += int(dense_uplink_bytes)
        t.dense_downlink_bytes += int(dense_downlink_bytes)

    def add_metrics(self, **metrics: Any) -> None:
        """Attach extra metrics (e.g. ``train_loss``) to the current round's entry."""
        self._metrics.update(_jsonable(metrics))

    def end_round(self, round: int, *, accuracy: float, loss: float, **metrics: Any) -> dict[str, Any]:
        """Close ``round``: sum its traffic, print a row, rewrite results.json; return the entry."""
        now = time.monotonic()
        ids = sorted(self._traffic, key=lambda c: (len(c), c))  # numeric order for node ids
        clients: dict[str, list[Any]] = {"ids": ids}
        for key in _DIRECTIONS:
            clients[key] = [getattr(self._traffic[c], key) for c in ids]
        totals = {key: sum(clients[key]) for key in _DIRECTIONS}
        entry: dict[str, Any] = {
            "round": int(round),
            "accuracy": float(accuracy),
            "loss": _jsonable(float(loss)),  # (a diverged model's NaN: null, not a crash of the run)
            **totals,
            "uplink_compression": _ratio(totals["dense_uplink_bytes"], totals["uplink_bytes"]),
            "downlink_compression": _ratio(totals["dense_downlink_bytes"], totals["downlink_bytes"]),
            "num_clients": len(ids),
            "round_time_s": round_s(now - self._t_round),
            "wall_time_s": round_s(now - self._t0),
            "clients": clients,
            **self._metrics,
            **_jsonable(metrics),
        }
        self._rounds.append(entry)
        self._round_texts.append(_entry_text(entry))
        self._traffic = {}
        self._metrics = {}
        self._t_round = now
        self._print_row(entry)
        self._write()
        return entry

    def finish(self, status: str = "completed", error: str | None = None, **summary: Any) -> Path:
        """Mark the run ``status`` ("completed" | "failed"), add a summary, write; return path."""
        self._status = status
        self._error = error
        self._summary.update(_jsonable(summary))
        if self._rounds:
            last = self._rounds[-1]
            self._summary.setdefault("final_accuracy", last["accuracy"])
            self._summary.setdefault("best_accuracy", max(r["accuracy"] for r in self._rounds))
            for key in _DIRECTIONS:
                self._summary.setdefault(f"total_{key}", sum(r[key] for r in self._rounds))
        self._summary.setdefault("wall_time_s", round_s(time.monotonic() - self._t0))
        self._write(finished=True)
        if self.stream is not None:
            if error:
                print(f"[fedcomp] error: {error}", file=self.stream)
            print(f"[fedcomp] run {status}: results in {self.path}", file=self.stream, flush=True)
        return self.path

    # --- output -------------------------------------------------------------------------------

    _COLUMNS = (
        ("round", 5), ("acc", 7), ("loss", 7), ("up", 9), ("down", 9),
        ("dense_up", 9), ("dense_dn", 9), ("up_x", 7), ("down_x", 7), ("time_s", 7),
    )  # fmt: skip

    def _print_row(self, e: dict[str, Any]) -> None:
        if self.stream is None:
            return
        if not self._header_printed:
            print(f"[fedcomp] run {self.run_name}: results in {self.path}", file=self.stream)
            print(" ".join(f"{n:>{w}}" for n, w in self._COLUMNS), file=self.stream)
            self._header_printed = True

        def factor(x: float | None) -> str:
            return "-" if x is None else f"{x:.1f}"

        cells = (
            str(e["round"]),
            f"{e['accuracy']:.4f}",
            "nan" if e["loss"] is None else f"{e['loss']:.4f}",
            _fmt_bytes(e["uplink_bytes"]),
            _fmt_bytes(e["downlink_bytes"]),
            _fmt_bytes(e["dense_uplink_bytes"]),
            _fmt_bytes(e["dense_downlink_bytes"]),
            factor(e["uplink_compression"]),
            factor(e["downlink_compression"]),
            f"{e['wall_time_s']:.1f}",
        )
        print(" ".join(f"{c:>{w}}" for c, (_, w) in zip(cells, self._COLUMNS, strict=True)), file=self.stream)
        self.stream.flush()

    def to_dict(self, finished: bool = False) -> dict[str, Any]:
        return {
            "run_name": self.run_name,
            "status": self._status,
            "error": self._error,
            "started_at": self.started_at.isoformat().replace("+00:00", "Z"),
            "finished_at": (_dt.datetime.now(_dt.UTC).isoformat().replace("+00:00", "Z") if finished else None),
            "config": self._config,
            "summary": self._summary,
            "rounds": self._rounds,
        }

    def _text(self, finished: bool = False) -> str:
        """``json.dumps(self.to_dict(finished), indent=2)``, the same text, with the rounds'
        entries dumped once each (:attr:`_round_texts`)."""
        head = self.to_dict(finished)
        del head["rounds"]
        text = json.dumps(head, indent=2, allow_nan=False)
        rounds = ",\n".join(self._round_texts)
        return text[:-2] + (',\n  "rounds": [\n' + rounds + "\n  ]\n}" if rounds else ',\n  "rounds": []\n}')

    def _write(self, finished: bool = False) -> None:
        """Atomically replace results.json (readers never see a half-written file)."""
        data = self._text(finished)
        fd, tmp = tempfile.mkstemp(dir=self.run_dir, prefix=".results-", suffix=".json")
        try:
            os.fchmod(fd, RESULTS_MODE)  # mkstemp makes it 0600; results are shared with the group
            with os.fdopen(fd, "w") as f:
                f.write(data + "\n")
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _entry_text(entry: Mapping[str, Any]) -> str:
    """One round's entry as ``json.dumps(..., indent=2)`` writes it inside the ``rounds`` list."""
    return "\n".join("    " + line for line in json.dumps(entry, indent=2, allow_nan=False).split("\n"))


def new_run_name(root: str | Path, now: _dt.datetime | None = None) -> str:
    """A UTC timestamp (``20250101-120000``) not yet taken under ``root`` (``-1``, ``-2``, ...
    appended if it is)."""
    base = (now or _dt.datetime.now(_dt.UTC)).strftime("%Y%m%d-%H%M%S")
    name, k = base, 1
    while (Path(root) / name).exists():
        name, k = f"{base}-{k}", k + 1
    return name


def record_failure(
    run_config: Mapping[str, Any],
    error: str,
    results_dir: str | Path | None = None,
    run_name: str | None = None,
    stream: IO[str] | None = sys.stdout,
) -> Path:
    """Write a results.json with status "failed" and ``error`` for a run that never started its
    rounds (e.g. its run config is invalid); return its path.

    ``results_dir``/``run_name`` default to the ``results-dir``/``run-name`` of ``run_config``
    when those are usable strings (the config itself may be what is wrong), else to
    ``$FEDCOMP_RESULTS_DIR`` or ``./results`` and a timestamp.
    """
    if results_dir is None:
        value = run_config.get("results-dir")
        results_dir = value if isinstance(value, str) else None
    if run_name is None:
        value = run_config.get("run-name")
        plain = isinstance(value, str) and value not in (".", "..") and "/" not in value and "\\" not in value
        run_name = value if plain else None
    recorder = RunRecorder(run_config, results_dir, run_name, stream=stream)
    return recorder.finish("failed", error=error)


def round_s(seconds: float) -> float:
    return round(seconds, 3)
