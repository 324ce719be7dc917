"""The README's commands, read from the README itself: the cheap ones run, the test commands are
what CI runs, and what the README must never say (stop processes by name, several data paths).

"Cheap": ``python -m ...`` commands ending in ``--help``, and the short run
(``python -m fedcomp run`` with at most 2 nodes and 2 rounds and no ``--out``), which is slow
(a real Flower run) and marked so. The fast-lane command is not run (it would run this test
again); it must be CI's test command plus ``-m "not slow"``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CI = REPO / ".ci" / "run"


def fenced_commands(text: str) -> list[str]:
    """Every command line in the ```bash blocks (comments dropped, continuation lines joined)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = block.replace("\\\n", " ")
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(shlex.join(words))
    return commands


def _commands() -> list[str]:
    return fenced_commands(README.read_text())


def _short_runs() -> list[str]:
    out = []
    for cmd in _commands():
        words = shlex.split(cmd)
        if words[:4] != ["python", "-m", "fedcomp", "run"] or "--out" in words:
            continue
        opts = dict(zip(words[4::2], words[5::2]))
        if int(opts.get("--nodes", 10)) <= 2 and int(opts.get("--rounds", 5)) <= 2:
            out.append(cmd)
    return out


def test_fenced_commands_are_read_as_written() -> None:
    text = '```bash\npython -m x --a "b c"   # a comment\nflwr run . \\\n  --stream\n```\n```text\nnot me\n```\n'
    assert fenced_commands(text) == ["python -m x --a 'b c'", "flwr run . --stream"]


def test_test_commands_are_what_ci_runs() -> None:
    ci_line = [line.strip() for line in CI.read_text().splitlines() if line.strip().startswith("python3 -m pytest")]
    assert len(ci_line) == 1, ci_line
    readme = [c for c in _commands() if c.startswith("python3 -m pytest")]
    assert readme[0] == ci_line[0], "the README's test command must be the one .ci/run runs"
    assert readme[1] == shlex.join([*shlex.split(ci_line[0]), "-m", "not slow"]), "the fast lane"


@pytest.mark.parametrize("cmd", [c for c in _commands() if c.startswith("python -m") and c.endswith("--help")])
def test_help_commands_work(cmd: str) -> None:
    words = shlex.split(cmd)
    done = subprocess.run([sys.executable, *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_the_readme_has_a_short_run_and_keeps_flwr_run_documented() -> None:
    assert _short_runs(), "no `python -m fedcomp run` with <= 2 nodes and <= 2 rounds in the README"
    assert any(c.startswith("flwr run . --stream") for c in _commands()), "`flwr run .` stays documented"


#: The two commands that stop processes by name (spelled in parts, so that this file does not
#: itself name them): the docs must stop processes by PID only.
BY_NAME = re.compile(r"\b(" + "p" + "kill|kill" + "all" + r")\b")


def test_the_readme_and_moved_docs_never_stop_processes_by_name_and_use_one_data_path() -> None:
    for path in (README, REPO / "docs" / "LINKS.md"):
        text = path.read_text()
        assert not BY_NAME.search(text), path
        assert "shared/data" not in text and "data-dir='/" not in text, f"{path}: use FEDCOMP_DATA_DIR"


@pytest.mark.slow
@pytest.mark.flower
@pytest.mark.parametrize("cmd", _short_runs())
def test_the_short_run_completes(cmd: str, tmp_path: Path) -> None:
    env = {**os.environ, "FEDCOMP_RESULTS_DIR": str(tmp_path / "results")}
    words = shlex.split(cmd)
    done = subprocess.run([sys.executable, *words[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: 2 rounds" in done.stdout and str(tmp_path / "results") in done.stdout


def test_the_library_example_runs_as_written() -> None:
    """The "Codecs as a library" block, copied and pasted: it used a `tensor` it never made."""
    section = README.read_text().split("## Codecs as a library", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    names: dict[str, object] = {}
    exec(compile(block, "README.md (Codecs as a library)", "exec"), names)
    import torch

    back, update, decoded = names["back"], names["update"], names["decoded"]
    assert isinstance(back, torch.Tensor) and back.shape == (64, 3, 7, 7)
    assert isinstance(decoded, dict) and decoded.keys() == update.keys()  # type: ignore[attr-defined]
    assert 0 < int((decoded["weight"] != 0).sum()) <= 2 * 78  # SBC kept about 1 % of 7,840 (one side)
    assert torch.equal(decoded["bias"], update["bias"])  # type: ignore[index]


def test_the_own_app_example_runs_as_written() -> None:
    """The first block of "Library use", copied and pasted: it used a `context` it never had."""
    section = README.read_text().split("## Library use: compression in your own Flower app", 1)[1]
    block = re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]
    names: dict[str, object] = {}
    exec(compile(block, "README.md (Library use)", "exec"), names)
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    assert isinstance(names["app"], ClientApp) and isinstance(names["server"], ServerApp)
    assert "context" not in names and callable(names["main"])
