"""Plots for the example scripts (matplotlib, Agg backend: no display needed).

Every function takes result dicts from :func:`fedsim.simulate` and writes one PNG.
Install with ``pip install -e '.[examples]'`` (matplotlib).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

Result = dict[str, Any]


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _num_clients(r: Result) -> int:
    return int(r["config"]["num_clients"])


def accuracy_vs_iteration(results: Sequence[Result], path: Path, title: str = "", zoom: float = 0.98) -> Path:
    """Test accuracy of the global model against local iterations (forward-backward passes per
    client); the right panel zooms on the top of the curve."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        it = [h["iteration"] for h in r["history"]]
        acc = [h["test_acc"] for h in r["history"]]
        for ax in axes:
            ax.plot(it, acc, marker="." if len(it) < 30 else None, label=r["label"])
    axes[0].set_ylim(0.0, 1.0)
    axes[1].set_ylim(zoom, 1.0)
    last = max(h["iteration"] for r in results for h in r["history"])
    axes[1].set_xlim(last * 0.25, last * 1.02)
    for ax in axes:
        ax.set_xlabel("iteration (local steps per client)")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
    axes[1].set_title("zoom")
    axes[0].legend(fontsize=8, loc="lower right")
    if title:
        axes[0].set_title(title)
    return _save(fig, path)


def accuracy_vs_bits(
    results: Sequence[Result], path: Path, direction: str = "uplink", title: str = "", zoom: float = 0.9
) -> Path:
    """Test accuracy against cumulative bits one client sent (uplink) or received (downlink),
    log x: the right half of the paper's Fig. 5."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        hist = [h for h in r["history"] if h["round"] > 0]
        if direction == "uplink":
            bits = [8 * h["uplink_bytes"] / _num_clients(r) for h in hist]
        else:
            bits = [8 * h["downlink_bytes"] for h in hist]
        ax.plot(bits, [h["test_acc"] for h in hist], marker="." if len(hist) < 30 else None, label=r["label"])
    ax.set_xscale("log")
    ax.set_ylim(zoom, 1.0)
    ax.set_xlabel(f"cumulative {direction} bits per client (log)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(title or f"accuracy vs {direction} traffic")
    return _save(fig, path)


def bytes_per_round(results: Sequence[Result], path: Path, title: str = "") -> Path:
    """Left: uplink bytes per client per round (real wire bytes) against the iteration the round
    ends at. Right: cumulative uplink bits per client against iterations. Both log y."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        per = np.asarray(r["uplink"]["bytes_per_round_per_client"], dtype=float)
        delay = r["config"]["delay"]
        it = np.arange(1, len(per) + 1) * delay
        style = {"marker": "o" if len(per) < 30 else None, "markersize": 3, "label": r["label"]}
        axes[0].plot(it, per, **style)
        axes[1].plot(it, 8 * np.cumsum(per), **style)
    axes[0].set_ylabel("uplink bytes per client per round (log)")
    axes[0].set_title(title or "uplink message size per round")
    axes[1].set_ylabel("cumulative uplink bits per client (log)")
    axes[1].set_title("cumulative uplink traffic")
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3, which="both")
    axes[1].legend(fontsize=8)
    return _save(fig, path)


def downlink_bits_per_value(results: Sequence[tuple[str, list[int], int, int]], path: Path, title: str = "") -> Path:
    """3LC downlink bits per model value, per round: ``(label, bytes per round, delay, numel)``."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, per, delay, numel in results:
        it = np.arange(1, len(per) + 1) * delay
        bpv = 8 * np.asarray(per, dtype=float) / numel
        if len(bpv) > 200:  # smooth the one-iteration rounds for readability
            k = 20
            bpv = np.convolve(bpv, np.ones(k) / k, mode="valid")
            it = it[k - 1 :]
        ax.plot(it, bpv, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("downlink bits per value (wire, log)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title or "3LC downlink size per round")
    return _save(fig, path)


def heatmap(
    values: np.ndarray,
    rows: Sequence[str],
    cols: Sequence[str],
    path: Path,
    title: str,
    xlabel: str,
    ylabel: str,
    fmt: str = "{:.4f}",
    cmap: str = "viridis",
) -> Path:
    """A grid of values (e.g. final accuracy) with each cell labelled; brighter = higher."""
    fig, ax = plt.subplots(figsize=(1.6 * len(cols) + 2.5, 1.0 * len(rows) + 1.8))
    im = ax.imshow(values, cmap=cmap, aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rows)), rows)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    finite = values[np.isfinite(values)]
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
    for i in range(len(rows)):
        for j in range(len(cols)):
            v = values[i, j]
            if np.isfinite(v):
                ax.text(
                    j, i, fmt.format(v), ha="center", va="center", fontsize=9, color="black" if v > mid else "white"
                )
    fig.colorbar(im, ax=ax)
    ax.set_title(title)
    return _save(fig, path)


if __name__ == "__main__":  # (a module of the examples: run as a script it did nothing, silently)
    import sys as _sys

    _sys.exit(
        f"{__file__.rsplit('/', 1)[-1]} is a module of the example scripts, not a command: run "
        "examples/sbc_table2.py, examples/sparsity_grid.py or examples/threelc_table2.py (each takes --help)"
    )
