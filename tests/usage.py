"""A command-line entry point's usage errors, as the bench and CLI tests check them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def usage_error(main: Callable[[list[str]], Any], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``main(argv)`` must stop with argparse's usage error (exit status 2); its message."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err
