"""Plots of a run's ``results.json``: accuracy against bytes sent, bytes per round, and overlays.

    python -m fedcomp plot RUN_DIR [RUN_DIR ...] [--out DIR]

:func:`write_run_plots` writes two PNGs beside a run's ``results.json`` (the ServerApp calls it
when a run ends):

* ``accuracy_vs_bytes.png``: test accuracy after each round against the cumulative bytes moved
  so far, uplink and downlink together, on a log axis. Every byte the run's meter recorded is
  counted, so the initial model is in round 1's downlink when the server sent it (with
  ``seeded-initial-model = true`` the clients build it and it is not sent). A dashed line of the
  same colour is the dense-fp32 equivalent: the same rounds had every message carried the model
  as fp32. Round 0 (the initial model's evaluation, no bytes yet) has no place on a log axis and
  is left out.
* ``bytes_per_round.png``: uplink and downlink bytes of each round (summed over clients), actual
  against the dense-fp32 equivalent, on a log axis (a round that moved nothing in a direction
  has no point there).

Rounds in which no client update was aggregated (``updates_aggregated`` = 0 in results.json)
are marked: a red cross on the accuracy curve, a red band in the bytes plot.

:func:`plot_runs` overlays several runs (e.g. dense FedAvg against a compressed run) in the same
two files, one colour per run, labelled with the run's name and its compression settings as
recorded in ``results.json``'s ``config``.

The numbers plotted come from :func:`run_series` (a pure function of the parsed file), so tests
can check the plot's data against ``results.json``. A file that cannot be plotted raises
:class:`ResultsFileError` naming the file and what is wrong; a run with no rounds, or a failed
run, still gives readable plots that say so.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # matplotlib is imported when plotting, not when the ServerApp imports this module
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "ACCURACY_PLOT",
    "BYTES_PLOT",
    "ResultsFileError",
    "RunSeries",
    "main",
    "plot_runs",
    "read_run",
    "run_series",
    "write_run_plots",
]

RESULTS_FILE = "results.json"  # the same name as fedcomp.app.results.RESULTS_FILE
ACCURACY_PLOT = "accuracy_vs_bytes.png"
BYTES_PLOT = "bytes_per_round.png"
_BYTE_KEYS = ("uplink_bytes", "downlink_bytes", "dense_uplink_bytes", "dense_downlink_bytes")
_FILE_MODE = 0o644  # readable by the group and others, like the rest of a run's folder
_DPI = 100


class ResultsFileError(ValueError):
    """A ``results.json`` cannot be plotted: missing, not JSON, or without a field the plots need.

    ``path`` is the file; ``reason`` says what is missing or wrong.
    """

    # Lives here rather than in fedcomp.errors because only the plots read results files back.

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


@dataclass(frozen=True)
class RunSeries:
    """What the plots draw for one run, one entry per recorded round (round 0 included)."""

    source: Path
    run_name: str
    status: str
    error: str | None
    settings: str
    rounds: tuple[int, ...]
    accuracy: tuple[float, ...]  # NaN where results.json has null (a non-finite accuracy)
    uplink_bytes: tuple[int, ...]
    downlink_bytes: tuple[int, ...]
    dense_uplink_bytes: tuple[int, ...]
    dense_downlink_bytes: tuple[int, ...]
    #: Training rounds in which no client update was aggregated (``updates_aggregated`` = 0, where
    #: results.json records it): the model did not move there.
    empty_rounds: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """Run name and compression settings, and the status when the run did not complete."""
        status = "" if self.status == "completed" else f" [{self.status}]"
        return f"{self.run_name}: {self.settings}{status}"

    @property
    def cumulative_bytes(self) -> tuple[int, ...]:
        """Bytes moved up to and including each round, both directions."""
        return tuple(itertools.accumulate(u + d for u, d in zip(self.uplink_bytes, self.downlink_bytes, strict=True)))

    @property
    def cumulative_dense_bytes(self) -> tuple[int, ...]:
        """The same as dense fp32, both directions."""
        pairs = zip(self.dense_uplink_bytes, self.dense_downlink_bytes, strict=True)
        return tuple(itertools.accumulate(u + d for u, d in pairs))

    @property
    def compression(self) -> float | None:
        """Dense-fp32 bytes over actual bytes for the whole run (None when nothing moved)."""
        actual = sum(self.uplink_bytes) + sum(self.downlink_bytes)
        dense = sum(self.dense_uplink_bytes) + sum(self.dense_downlink_bytes)
        return dense / actual if actual > 0 else None


# --- reading ------------------------------------------------------------------------------------


def _number(value: Any, path: Path, where: str, *, integer: bool) -> float:
    """``value`` as a number, or ResultsFileError naming ``where``; null = NaN for floats."""
    if value is None and not integer:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ResultsFileError(path, f"{where}: expected a number, got {value!r}")
    if integer and (not float(value).is_integer() or value < 0):
        raise ResultsFileError(path, f"{where}: expected a whole number >= 0, got {value!r}")
    return value


def _fmt_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def compression_settings(config: Mapping[str, Any]) -> str:
    """A short text of a run's compression settings, from its recorded run config."""
    if not config:
        return "settings not recorded"
    if config.get("compress") is False:
        return "dense FedAvg (fp32)"
    params = {"sbc": ("sbc-p",), "stc": ("sbc-p",), "topk": ("topk-density",), "deft": ("topk-density",),
              "gradiveq": ("gradiveq-eps",), "3lc": ("3lc-s",), "lattice": ("lattice-step",)}  # fmt: skip
    parts = []
    for key, default in (("uplink-codec", "sbc"), ("downlink-codec", "3lc")):
        codec = str(config.get(key, default))
        shown = [f"{p.rsplit('-', 1)[-1]}={_fmt_value(config[p])}" for p in params.get(codec, ()) if p in config]
        parts.append(codec + (f" {' '.join(shown)}" if shown else ""))
    text = f"{parts[0]} up, {parts[1]} down"
    if config.get("seeded-initial-model") is True:
        text += ", initial model not sent"
    return text


def run_series(data: Any, source: Path) -> RunSeries:
    """The plotted numbers of one parsed ``results.json`` (``source`` names it in errors)."""
    if not isinstance(data, Mapping):
        raise ResultsFileError(source, f"expected a JSON object, got {type(data).__name__}")
    if "rounds" not in data:
        raise ResultsFileError(source, "no 'rounds' list (not a fedcomp results.json?)")
    rounds = data["rounds"]
    if not isinstance(rounds, list):
        raise ResultsFileError(source, f"'rounds': expected a list, got {type(rounds).__name__}")
    config = data.get("config") or {}
    if not isinstance(config, Mapping):
        raise ResultsFileError(source, f"'config': expected an object, got {type(config).__name__}")
    cols: dict[str, list[Any]] = {key: [] for key in ("round", "accuracy", *_BYTE_KEYS)}
    empty: list[int] = []
    for i, entry in enumerate(rounds):
        if not isinstance(entry, Mapping):
            raise ResultsFileError(source, f"rounds[{i}]: expected an object, got {type(entry).__name__}")
        for key in cols:
            if key not in entry:
                raise ResultsFileError(source, f"rounds[{i}] has no {key!r}")
            where = f"rounds[{i}].{key}"
            if key == "accuracy":
                cols[key].append(float(_number(entry[key], source, where, integer=False)))
            else:
                cols[key].append(int(_number(entry[key], source, where, integer=True)))
        aggregated = entry.get("updates_aggregated")
        if aggregated is not None and _number(aggregated, source, f"rounds[{i}].updates_aggregated", integer=True) == 0:
            empty.append(cols["round"][-1])
    error = data.get("error")
    return RunSeries(
        source=source,
        run_name=str(data.get("run_name") or source.parent.name),
        status=str(data.get("status") or "unknown"),
        error=None if error is None else str(error),
        settings=compression_settings(config),
        rounds=tuple(cols["round"]),
        accuracy=tuple(cols["accuracy"]),
        uplink_bytes=tuple(cols["uplink_bytes"]),
        downlink_bytes=tuple(cols["downlink_bytes"]),
        dense_uplink_bytes=tuple(cols["dense_uplink_bytes"]),
        dense_downlink_bytes=tuple(cols["dense_downlink_bytes"]),
        empty_rounds=tuple(empty),
    )


def results_path(run_dir: Path) -> Path:
    """``run_dir/results.json``; a path to the file itself is accepted too."""
    run_dir = Path(run_dir)
    return run_dir if run_dir.name == RESULTS_FILE and not run_dir.is_dir() else run_dir / RESULTS_FILE


def read_run(run_dir: Path) -> RunSeries:
    """Read and check ``run_dir/results.json``; :class:`ResultsFileError` if it cannot be plotted."""
    path = results_path(run_dir)
    if not path.parent.is_dir():
        raise ResultsFileError(path, "no such run folder")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ResultsFileError(path, "no results.json in this folder (not a run folder?)") from None
    except OSError as err:
        raise ResultsFileError(path, f"cannot read it ({err.strerror or err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ResultsFileError(path, f"not valid JSON ({err})") from None
    return run_series(data, path)


# --- drawing ------------------------------------------------------------------------------------


def _new_figure(rows: int = 1, height: float = 4.2) -> tuple[Figure, list[Axes]]:
    # The object API with an Agg canvas: no pyplot, no display, no global backend switch, so a
    # ServerApp (or a user's notebook) that imports this keeps its own matplotlib state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, height * rows), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    return fig, axes


def _save(fig: Figure, path: Path) -> Path:
    """Write atomically (a reader never sees half a PNG), mode 0644 whatever the umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".png")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _positive(xs: Sequence[int], ys: Sequence[float]) -> tuple[list[int], list[float]]:
    """The points a log x axis can show (x > 0)."""
    pairs = [(x, y) for x, y in zip(xs, ys, strict=True) if x > 0]
    return [x for x, _ in pairs], [y for _, y in pairs]


def _masked(values: Sequence[int]) -> list[float]:
    """Bytes for a log axis: 0 (nothing moved) becomes NaN, a gap instead of an error."""
    return [float(v) if v > 0 else math.nan for v in values]


def _note(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", wrap=True, fontsize=10)


def _status_note(run: RunSeries) -> str:
    if run.status == "completed":
        return ""
    note = f"run {run.status}"
    if run.error:
        note += f": {run.error[:160]}"
    return note


def _draw_accuracy(ax: Axes, runs: Sequence[RunSeries], dense_equivalent: bool) -> None:
    drawn = False
    for i, run in enumerate(runs):
        color = f"C{i}"
        x, y = _positive(run.cumulative_bytes, run.accuracy)
        if x:
            ax.plot(x, y, "o-", color=color, markersize=3, label=run.label)
            drawn = True
        xe, ye = _positive(*_at_rounds(run, run.cumulative_bytes, run.empty_rounds))
        if xe:
            ax.plot(xe, ye, "x", color="red", markersize=8, mew=2, label=f"no update aggregated ({len(xe)} rounds)")
        if dense_equivalent:
            xd, yd = _positive(run.cumulative_dense_bytes, run.accuracy)
            if xd and xd != x:
                ratio = run.compression
                extra = "" if ratio is None else f", {ratio:.1f}x the bytes"
                ax.plot(xd, yd, "--", color=color, alpha=0.6, label=f"same rounds as dense fp32{extra}")
    if drawn:
        ax.set_xscale("log")
        # Below the axes: accuracy curves rise from the lower left, where "best" would cover them.
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=1, frameon=False)
    else:
        _note(ax, "no round moved any bytes yet: nothing to plot")
    ax.set_xlabel("cumulative bytes, uplink + downlink, all clients (log)")
    ax.set_ylabel("test accuracy")
    ax.grid(True, which="both", alpha=0.3)


def _round_axis(ax: Axes, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def _at_rounds(run: RunSeries, xs: Sequence[int], rounds: Sequence[int]) -> tuple[list[int], list[float]]:
    """(x, accuracy) of the given rounds."""
    pick = [i for i, r in enumerate(run.rounds) if r in set(rounds)]
    return [xs[i] for i in pick], [run.accuracy[i] for i in pick]


def _draw_bytes_one(ax: Axes, run: RunSeries) -> None:
    """Both directions of one run: actual (solid) and dense fp32 (dashed / dotted), per round;
    rounds that aggregated no update shaded."""
    for k, r in enumerate(run.empty_rounds):
        ax.axvspan(r - 0.4, r + 0.4, color="red", alpha=0.12, lw=0, label="no update aggregated" if k == 0 else None)
    for j, direction in enumerate(("uplink", "downlink")):
        color = f"C{j}"
        actual, dense = getattr(run, f"{direction}_bytes"), getattr(run, f"dense_{direction}_bytes")
        if any(v > 0 for v in actual):
            ax.plot(run.rounds, _masked(actual), "o-", color=color, markersize=3, label=f"{direction}, actual")
        if any(v > 0 for v in dense):  # uplink and downlink dense are often equal: two dash styles
            style = "--" if direction == "uplink" else ":"
            ax.plot(run.rounds, _masked(dense), style, color=color, lw=2, alpha=0.7, label=f"{direction}, dense fp32")
    if ax.lines:
        ax.set_yscale("log")
        ax.legend(fontsize=8, loc="best")
    else:
        _note(ax, "no bytes recorded in any round")
        if run.empty_rounds:
            ax.legend(fontsize=8, loc="best")
    _round_axis(ax, "bytes per round, all clients (log)")


def _draw_bytes_many(ax: Axes, runs: Sequence[RunSeries], direction: str) -> None:
    """One direction of several runs, actual bytes, one colour per run."""
    for i, run in enumerate(runs):
        actual = getattr(run, f"{direction}_bytes")
        if any(v > 0 for v in actual):
            ax.plot(run.rounds, _masked(actual), "o-", color=f"C{i}", markersize=3, label=run.label)
    if ax.lines:
        ax.set_yscale("log")
        ax.legend(fontsize=7, loc="best")
    else:
        _note(ax, f"no {direction} bytes recorded")
    _round_axis(ax, f"{direction} bytes per round (log)")


def _title(runs: Sequence[RunSeries]) -> str:
    if len(runs) == 1:
        run = runs[0]
        note = _status_note(run)
        return run.label + (f"\n{note}" if note else "")
    return f"{len(runs)} runs: " + ", ".join(run.run_name for run in runs)


def _write_pair(runs: Sequence[RunSeries], out: Path, single: bool) -> list[Path]:
    if not any(run.rounds for run in runs):
        fig, (ax,) = _new_figure()
        _note(ax, "no rounds recorded" + "".join(f"\n{_status_note(r)}" for r in runs if _status_note(r)))
        ax.set_axis_off()
        fig.suptitle(_title(runs), fontsize=10)
        first = _save(fig, out / ACCURACY_PLOT)
        fig2, (ax2,) = _new_figure()
        _note(ax2, "no rounds recorded")
        ax2.set_axis_off()
        fig2.suptitle(_title(runs), fontsize=10)
        return [first, _save(fig2, out / BYTES_PLOT)]

    fig, (ax,) = _new_figure()
    _draw_accuracy(ax, runs, dense_equivalent=single)
    fig.suptitle(_title(runs), fontsize=10)
    acc = _save(fig, out / ACCURACY_PLOT)

    if single:
        fig, (ax,) = _new_figure()
        _draw_bytes_one(ax, runs[0])
    else:
        fig, axes = _new_figure(rows=2, height=3.4)
        for ax, direction in zip(axes, ("uplink", "downlink"), strict=True):
            _draw_bytes_many(ax, runs, direction)
    fig.suptitle(_title(runs), fontsize=10)
    return [acc, _save(fig, out / BYTES_PLOT)]


def write_run_plots(run_dir: Path) -> list[Path]:
    """Write ``accuracy_vs_bytes.png`` and ``bytes_per_round.png`` beside ``run_dir/results.json``.

    Returns the two paths. Raises :class:`ResultsFileError` when results.json is missing or
    lacks what the plots need.
    """
    run = read_run(run_dir)
    return _write_pair([run], run.source.parent, single=True)


def plot_runs(run_dirs: Sequence[Path], out: Path) -> list[Path]:
    """Overlay the runs in ``run_dirs`` (one colour each) in ``out``/the same two file names.

    One run gives the same plots as :func:`write_run_plots`, written to ``out``.
    """
    if not run_dirs:
        raise ValueError("plot_runs: no run folders given")
    runs = [read_run(Path(d)) for d in run_dirs]
    return _write_pair(runs, Path(out), single=len(runs) == 1)


# --- command ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedcomp plot RUN_DIR [RUN_DIR ...] [--out DIR]``; exit 2 on a bad run folder."""
    ap = argparse.ArgumentParser(
        prog="python -m fedcomp plot",
        description="Plot accuracy against bytes and bytes per round from runs' results.json. "
        "One RUN_DIR: its plots are (re)written beside its results.json. Several: one overlay of "
        "them all, written to --out.",
    )
    ap.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="a run's folder (holds results.json)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default: the run's folder for one run, ./plots for several)")  # fmt: skip
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if len(args.run_dirs) == 1 and args.out is None:
            paths = write_run_plots(args.run_dirs[0])
        else:
            paths = plot_runs(args.run_dirs, args.out or Path("plots"))
    except ResultsFileError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. --out not writable
        print(f"error: cannot write the plots: {err}", file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
