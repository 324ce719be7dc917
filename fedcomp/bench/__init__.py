"""Benchmarks (commands, not tests): ``python -m fedcomp.bench codecs --help``."""

import json
from pathlib import Path
from typing import Any


def write_rows(path: Path | None, rows: Any) -> None:
    """Save a benchmark's rows as JSON when ``--json PATH`` was given."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")
