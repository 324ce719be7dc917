"""The committed generated code must match proto/ (regenerate with scripts/gen_proto.sh)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_code_is_current(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the dev extra) regenerates the code")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2.py*"))
    assert generated, "the generator produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is not committed"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} is stale: run scripts/gen_proto.sh and commit the result"
        )
