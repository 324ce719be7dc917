"""Benchmarks (commands, not tests): ``python -m fedcomp.bench codecs --help``.

Shared command-line helpers: argument types that reject bad numbers as usage errors (argparse
prints the option and the reason and exits 2), and the choice of dataset for benchmarks whose
data is optional (MNIST when a data folder is set, else the bundled scikit-learn digits, said
on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedcomp.app.config import DATA_DIR_ENV

DATASETS = ("digits", "mnist", "fashion-mnist")


def write_rows(path: Path | None, rows: Any) -> None:
    """Save a benchmark's rows as JSON when ``--json PATH`` was given."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``lo``."""

    def parse(value: str) -> int:
        try:
            out = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value!r}") from None
        if out < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value!r}")
        return out

    return parse


def float_in(
    lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False
) -> Callable[[str], float]:
    """An argparse ``type``: a finite float in the interval from ``lo`` to ``hi`` (open ends as given)."""
    text = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open or hi == math.inf else ']'}"

    def parse(value: str) -> float:
        try:
            out = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {text}, got {value!r}") from None
        low_ok = out > lo if lo_open else out >= lo
        high_ok = out < hi if hi_open else out <= hi
        if not (math.isfinite(out) and low_ok and high_ok):
            raise argparse.ArgumentTypeError(f"must be in {text}, got {value!r}")
        return out

    return parse


def int_list(lo: int = 1) -> Callable[[str], list[int]]:
    """An argparse ``type``: comma-separated integers, each >= ``lo`` (e.g. ``1,2,4``)."""
    one = int_at_least(lo)

    def parse(value: str) -> list[int]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {lo}, got {value!r}")
        return [one(v) for v in items]

    return parse


def float_list(lo: float, *, lo_open: bool = False) -> Callable[[str], list[float]]:
    """An argparse ``type``: comma-separated numbers, each >= ``lo`` (> with ``lo_open``)."""
    one = float_in(lo, lo_open=lo_open)

    def parse(value: str) -> list[float]:
        items = [v.strip() for v in value.split(",") if v.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {value!r}")
        return [one(v) for v in items]

    return parse


def choose_dataset(
    ap: argparse.ArgumentParser, dataset: str | None, data_dir: str | None, *, data_dir_option: str | None
) -> str:
    """The dataset a benchmark runs on, checked to load before any work starts.

    ``dataset`` None (the option not given): MNIST when a data folder is set (``data_dir_option``
    or ``$FEDCOMP_DATA_DIR``), else the bundled digits, with a note on stderr that says so. A
    dataset that needs a folder when none is set, or one that does not load, is a usage error
    (exit 2) naming the option and the environment variable.
    """
    from fedcomp.app.data import DataError, load_dataset

    where = f"{data_dir_option} or ${DATA_DIR_ENV}" if data_dir_option else f"${DATA_DIR_ENV}"
    folder = data_dir or os.environ.get(DATA_DIR_ENV, "")
    if dataset is None:
        if folder:
            dataset = "mnist"
        else:
            print(
                f"note: no data folder ({where} not set): using the bundled scikit-learn digits "
                "(1,500 training images) instead of MNIST",
                file=sys.stderr,
            )
            dataset = "digits"
    if dataset != "digits" and not folder:
        ap.error(f"--dataset {dataset} needs a data folder: set {where} to the folder holding {dataset}/")
    try:
        load_dataset(dataset, folder or None)
    except DataError as err:
        ap.error(f"--dataset {dataset}: {err} (the data folder comes from {where})")
    return dataset
