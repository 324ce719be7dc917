"""A bounded, seeded run of ``python -m fedcomp.fuzz``: mutated payloads of every codec decoded as
a server does, and mutated Flower replies fed to the real ``CompressionStrategy``. Every input must
be decoded or rejected with a typed error, and no reply may end the run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedcomp import fuzz


@pytest.mark.slow  # ~30-60 s on a shared 2-core machine
def test_mutated_payloads_of_every_codec_give_only_typed_outcomes() -> None:
    out = fuzz.fuzz_payloads(800, seed=14, model_name="lenet", detail_by_codec=True)
    assert out["inputs"] == 800
    assert out["outcomes"].get("other_exception", 0) == 0, out["unexpected"][:3]
    # the run reached every codec, decoded some inputs and rejected others for many reasons
    codecs = {k.rsplit("[", 1)[1].rstrip("]") for k in out["by_kind"]}
    assert codecs >= {"sbc", "stc", "3lc", "topk", "topk-fp16", "gradiveq", "dense-fp32", "dense-fp16", "identity"}
    assert out["outcomes"]["decoded"] > 0 and out["outcomes"]["rejected"] > 0
    assert len(out["top_rejection_reasons"]) >= 10


@pytest.mark.slow
def test_mutated_replies_never_end_the_run(tmp_path: Path) -> None:
    assert fuzz.main(
        ["--n", "0", "--replies", "150", "--seed", "14", "--json", str(tmp_path / "f.json"), "--quiet"]
    ) in (0, 1)
    out = json.loads((tmp_path / "f.json").read_text())["replies_fuzz"]
    assert out["inputs"] == 150
    assert out["outcomes"].get("other_exception", 0) == 0, out["unexpected"][:1]
    assert out["runs_ended"] == 0, [u["kind"] + ": " + u["error"][:200] for u in out["unexpected"]]
    kinds = {k.split(":")[1] for k in out["by_kind"]}
    assert {"num-examples", "uplink", "record-dropped", "record-added", "error-reply"} <= kinds


def test_an_input_the_report_lists_replays_alone_by_its_index() -> None:
    """The report names inputs by index (slowest, over memory, unexpected); ``--input I``
    (:func:`fuzz.replay_input`) rebuilds input I of the same seed and model and decodes it alone:
    same mutation, same size, same outcome."""
    out = fuzz.fuzz_payloads(120, seed=5, model_name="small")
    listed = [e for e in out["slowest"] if e["index"] is not None]
    assert len(listed) == fuzz.SLOWEST
    assert len({e["index"] for e in listed}) == len(listed)
    for e in listed:
        again = fuzz.replay_input(5, "small", e["index"])
        assert (again["kind"], again["bytes"], again["outcome"]) == (e["kind"], e["bytes"], e["outcome"]), e
        assert again["detail"][:160] == e["detail"]
