"""The kernel loader (``fedcomp._native``): a bundled copy of fedcomp's sources (what a Flower app
bundle carries: ``*.py`` only) borrows the installed kernels exactly when its codec sources are the
installed ones, and ``FEDCOMP_NATIVE=0`` turns every kernel off."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fedcomp
import fedcomp._native as native

PACKAGE = Path(fedcomp.__file__).resolve().parent
PROBE = (
    "import json, sys; sys.path.insert(0, sys.argv[1]); import fedcomp, fedcomp._native as n; "
    "print(json.dumps({'file': fedcomp.__file__, 'status': n.status(), "
    "'origin': {k: n.origin(k) for k in ('sbc', 'threelc', 'wire')}}))"
)


def _bundle(tmp_path: Path) -> Path:
    """fedcomp's ``*.py`` files copied as an app bundle carries them (no compiled kernels)."""
    root = tmp_path / "bundle"
    for src in PACKAGE.rglob("*.py"):
        dst = root / "fedcomp" / src.relative_to(PACKAGE)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return root


def _probe(root: Path, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env={**os.environ, **env},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture
def built() -> None:
    if not native.enabled():
        pytest.skip("FEDCOMP_NATIVE=0: the kernels are switched off in this run")
    missing = [k for k, v in native.status().items() if not v]
    if missing:
        pytest.fail(f"kernels {missing} are not built in the installed package (pip install -e . compiles them)")


def test_the_installed_package_uses_its_own_kernels(built) -> None:
    assert native.origin("sbc") == native.origin("threelc") == native.origin("wire") == "package"


def test_a_bundled_copy_borrows_the_installed_kernels(built, tmp_path: Path) -> None:
    root = _bundle(tmp_path)
    got = _probe(root)
    assert Path(got["file"]).resolve().is_relative_to(root.resolve())  # the bundle's fedcomp runs
    assert got["status"] == {"sbc": True, "threelc": True, "wire": True}
    assert got["origin"] == {"sbc": str(PACKAGE), "threelc": str(PACKAGE), "wire": str(PACKAGE)}


def test_a_bundle_with_other_codec_sources_runs_numpy(built, tmp_path: Path) -> None:
    root = _bundle(tmp_path)
    with open(root / "fedcomp" / "codecs" / "sbc.py", "a") as f:
        f.write("\n# another version of the codec\n")
    got = _probe(root)
    assert got["status"] == {"sbc": False, "threelc": False, "wire": False}  # all: the sources differ as a set


def test_a_bundle_with_other_wire_sources_runs_without_kernels(built, tmp_path: Path) -> None:
    root = _bundle(tmp_path)
    with open(root / "fedcomp" / "wire" / "fast_writer.py", "a") as f:
        f.write("\n# another version of the writer\n")
    assert _probe(root)["status"] == {"sbc": False, "threelc": False, "wire": False}


def test_switched_off(tmp_path: Path) -> None:
    root = _bundle(tmp_path)
    assert _probe(root, FEDCOMP_NATIVE="0")["status"] == {"sbc": False, "threelc": False, "wire": False}
