"""Resume after a crash (issue 14, item 5): the server checkpoint, the clients' persisted state,
and a real local deployment whose ServerApp is SIGKILLed after round 2 and resumed."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fedcomp.app.checkpoint import CHECKPOINT_FILE, CheckpointError, ServerCheckpoint, load_checkpoint, save_checkpoint
from fedcomp.errors import PayloadError
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.net.deploy import DeployError, LocalDeployment, node_specs
from fedcomp.net.superlink import find_marked_pids
from tests.flower.helpers import server_identity  # noqa: F401  (an autouse fixture: Messages need it)

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(downlink: str = "3lc") -> ServerCheckpoint:
    """A checkpoint holding a real strategy state (a replica advanced twice, node records, an
    update outcome) and RNG states."""
    from flwr.app import ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.app.apps import initial_model_of
    from fedcomp.flower.protocol import UpdateStatus

    strategy = CompressionStrategy(FedAvg(), CompressionConfig(downlink_codec=downlink))
    w = {k: v.clone() for k, v in initial_model_of(1).state_dict().items()}
    strategy._sync_replica(ArrayRecord(w), 1)
    w2 = {k: v + 0.01 for k, v in w.items()}
    strategy._sync_replica(ArrayRecord(w2), 2)
    assert strategy.replica is not None
    strategy._nodes[7] = (strategy.replica.version, strategy.replica.digest)
    strategy._last_update[7] = (2, UpdateStatus.AGGREGATED, "")
    strategy._settled = 2
    py, tr = ServerCheckpoint.rng_now()
    rounds: list[dict[str, Any]] = [{"round": 0, "accuracy": 0.1}, {"round": 1}, {"round": 2, "wall_time_s": 3.5}]
    return ServerCheckpoint(2, w2, strategy.state_dict(), rounds, {"seed": 1}, [2], py, tr, "2026-01-01T00:00:00+00:00")


@pytest.mark.parametrize("downlink", ["3lc", "lattice"])  # lattice: the grid travels in the replica's state
def test_checkpoint_round_trip_restores_the_whole_state(tmp_path: Path, downlink: str) -> None:
    ckpt = _checkpoint(downlink)
    path = save_checkpoint(tmp_path, ckpt)
    assert path == tmp_path / CHECKPOINT_FILE and not list(tmp_path.glob(".checkpoint-*"))  # no temp file left
    back = load_checkpoint(tmp_path)
    assert back.round == 2 and back.rounds == ckpt.rounds and back.config == ckpt.config
    assert back.empty_rounds == [2] and back.started_at == ckpt.started_at
    assert all(torch.equal(back.model[k], ckpt.model[k]) for k in ckpt.model)
    # The strategy comes back as it was: same replica (tensors, version, digests, delta log),
    # node records, outcomes and lineage; it builds the same downlink for a node.
    from flwr.serverapp.strategy import FedAvg

    config = CompressionConfig(downlink_codec=downlink)
    fresh = CompressionStrategy(FedAvg(), config)
    assert back.strategy is not None
    fresh.load_state_dict(back.strategy)
    orig = CompressionStrategy(FedAvg(), config)
    assert ckpt.strategy is not None
    orig.load_state_dict(ckpt.strategy)
    assert fresh.lineage == orig.lineage and fresh.replica is not None and orig.replica is not None
    assert fresh.replica.version == orig.replica.version == 1
    assert fresh.replica.digest == orig.replica.digest
    assert fresh.replica.grid == orig.replica.grid and (fresh.replica.grid is not None) == (downlink == "lattice")
    assert all(torch.equal(fresh.replica.tensors[k], orig.replica.tensors[k]) for k in orig.replica.tensors)
    assert fresh.replica.downlink_for(0, orig.replica.digest_of(0)) == orig.replica.downlink_for(
        0, orig.replica.digest_of(0)
    )
    assert fresh.outcome_state() == orig.outcome_state() and fresh._nodes == orig._nodes
    # RNG: what the restored process draws next is what the saved one would have drawn.
    back.restore_rng()
    a = (torch.rand(3), __import__("random").random())
    ckpt.restore_rng()
    b = (torch.rand(3), __import__("random").random())
    assert torch.equal(a[0], b[0]) and a[1] == b[1]


@pytest.mark.parametrize(
    ("cfg", "rounds"),
    [
        ({"sbc-p": 0.1}, 2),
        ({"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 2}, 1),  # before its first fit
        ({"uplink-codec": "gradiveq", "gradiveq-dense-rounds": 2}, 3),  # after it
        ({"uplink-codec": "deft", "topk-density": 0.05}, 2),
        ({"uplink-codec": "topk", "topk-density": 0.05}, 2),
    ],
    ids=["sbc", "gradiveq-dense", "gradiveq-fitted", "deft", "topk"],
)
def test_every_uplink_methods_state_goes_through_a_checkpoint(tmp_path: Path, cfg: dict[str, Any], rounds: int) -> None:
    """What the app writes after every round, each method's server state in it, loads back (with
    torch's weights-only loader) and restores a strategy that goes on alike. GradiVeQ's did not:
    before its first fit the state held an empty ``bytes``, which torch writes and its
    weights-only loader refuses; for a while it also held TensorSpecs, which are not plain data."""
    from tests.flower.helpers import Client, make_strategy, tiny_model, train_round

    strategy, model = make_strategy(**cfg), tiny_model()
    clients = {n: Client(n) for n in (1, 2, 3)}
    for rnd in range(1, rounds + 1):
        new, _ = train_round(strategy, clients, rnd, model)
        model = new if new is not None else model
    ckpt = ServerCheckpoint(
        round=rounds, model=model, strategy=strategy.state_dict(), rounds=[{"round": r} for r in range(rounds + 1)],
        config=cfg,
    )  # fmt: skip
    save_checkpoint(tmp_path, ckpt)
    back = load_checkpoint(tmp_path)
    assert back.strategy is not None
    resumed = make_strategy(**cfg)
    resumed.load_state_dict(back.strategy)
    assert resumed.uplink.state_dict().keys() == strategy.uplink.state_dict().keys()
    assert type(getattr(resumed.uplink, "_wire", b"")) is bytes  # (an empty one comes back as bytes)
    # The ServerApp restarted, its SuperNodes (and their state) still up: the next round goes on.
    after, _ = train_round(resumed, clients, rounds + 1, model)
    t = resumed.traffic[rounds + 1]
    assert after is not None and t.accepted == 3 and not t.rejected and not t.failed, (t.rejected, t.failed)


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated (a crash mid-copy, a full disk)
        lambda b: b[:100] + bytes(x ^ 0xFF for x in b[100:200]) + b[200:],  # corrupt
        lambda b: b"",
        lambda b: b"not a checkpoint at all",
    ],
    ids=["truncated", "corrupt", "empty", "garbage"],
)
def test_a_damaged_checkpoint_is_a_typed_error_naming_the_file(tmp_path: Path, damage: Any) -> None:
    path = save_checkpoint(tmp_path, _checkpoint())
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=str(path)):
        load_checkpoint(tmp_path)


def test_missing_or_foreign_checkpoints_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path)
    torch.save({"format": 99}, tmp_path / CHECKPOINT_FILE)
    with pytest.raises(CheckpointError, match="format 99"):
        load_checkpoint(tmp_path)
    torch.save([1, 2], tmp_path / CHECKPOINT_FILE)
    with pytest.raises(CheckpointError, match="not a fedcomp checkpoint"):
        load_checkpoint(tmp_path)
    ckpt = _checkpoint()
    ckpt.rounds = ckpt.rounds[:-1]  # the checkpoint says round 2, its rounds end at 1
    save_checkpoint(tmp_path, ckpt)
    with pytest.raises(CheckpointError, match="does not match"):
        load_checkpoint(tmp_path)


class _RunsCode:
    """A pickle that creates ``marker`` when it is read: what a hostile checkpoint can do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_a_checkpoint_holding_objects_is_refused_unread(tmp_path: Path) -> None:
    """Loading reads plain data only: a pickle that would run code is refused, naming what it
    holds, and nothing runs (with ``weights_only=False`` the marker file would appear)."""
    ckpt = _checkpoint()
    path = save_checkpoint(tmp_path, ckpt)
    data = torch.load(path, weights_only=True)
    marker = tmp_path / "ran"
    data["rounds"][0]["accuracy"] = _RunsCode(marker)
    torch.save(data, path)
    with pytest.raises(CheckpointError, match=rf"{path}: holds a io\.open, .*could run code"):
        load_checkpoint(tmp_path)
    assert not marker.exists()
    # a checkpoint of the format before (the replica pickled as the object itself)
    from fedcomp.flower.replica import ServerReplica

    assert ckpt.strategy is not None
    data["rounds"][0]["accuracy"] = 0.1
    data["strategy"]["replica"] = ServerReplica.from_state_dict(ckpt.strategy["replica"])
    torch.save({**data, "format": 1}, path)
    with pytest.raises(
        CheckpointError, match="holds a fedcomp.flower.replica.ServerReplica.*before checkpoint format 2"
    ):
        load_checkpoint(tmp_path)


def test_a_state_that_could_not_be_read_back_is_not_written(tmp_path: Path) -> None:
    import numpy as np

    ckpt = _checkpoint()
    assert ckpt.strategy is not None
    ckpt.strategy["uplink"] = {"norms": np.zeros(3)}  # (an uplink method's state that is not plain)
    with pytest.raises(CheckpointError, match=r"not written: /strategy/uplink/norms is a numpy.ndarray"):
        save_checkpoint(tmp_path, ckpt)
    assert not list(tmp_path.iterdir())


def test_strategy_state_of_another_uplink_method_is_refused() -> None:
    from flwr.serverapp.strategy import FedAvg

    from fedcomp.flower.settings import CompressionConfig

    state = _checkpoint().strategy
    assert state is not None
    other = CompressionStrategy(FedAvg(), CompressionConfig(uplink_codec="dense-fp32"))
    with pytest.raises(PayloadError, match="uplink method"):
        other.load_state_dict(state)
    with pytest.raises(PayloadError, match="strategy state"):
        other.load_state_dict({"lineage": "ab"})


# --- the real thing: a local deployment, SIGKILL the ServerApp, resume ------------------------


def _serverapp_pids(token: str) -> list[int]:
    """The ServerApp processes of the deployment marked ``token`` (by PID, never by name
    alone: only processes carrying this deployment's marker are candidates)."""
    out = []
    for pid in find_marked_pids(token):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(Path(a.decode(errors="replace")).name == "flwr-serverapp" for a in argv[:2]):
            out.append(pid)
    return out


def _final_digest(data: dict[str, Any]) -> str:
    return str(data["rounds"][-1]["model_digest"])


@pytest.mark.flower
@pytest.mark.slow  # real SuperLink + 2 SuperNodes, three runs of 3 rounds: ~1-3 min on 2 cores
def test_a_serverapp_killed_after_round_2_resumes_to_the_same_model(tmp_path: Path) -> None:
    results = tmp_path / "results"
    base = {"dataset": "digits", "seed": 3, "num-server-rounds": 3, "results-dir": str(results), "local-iters": 5}
    killed: list[int] = []
    with LocalDeployment(REPO, node_specs(2), tmp_path / "work") as dep:
        dep.start(timeout_s=90)
        full = dep.run({**base, "run-name": "full"}, timeout_s=300)
        assert full["status"] == "completed" and [r["round"] for r in full["rounds"]] == list(range(4))

        def kill_after_round_2(entry: dict[str, Any]) -> None:
            if entry["round"] != 2 or killed:
                return
            # The checkpoint follows results.json by a few milliseconds: kill after both.
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with contextlib.suppress(CheckpointError):
                    if load_checkpoint(results / "crash").round >= 2:
                        break
                time.sleep(0.05)
            pids = _serverapp_pids(dep.token)
            assert len(pids) == 1, pids
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
            dep.stop_session(dep.procs[-1])  # the `flwr run --stream` CLI of the dead run

        with pytest.raises(DeployError):
            dep.run({**base, "run-name": "crash"}, timeout_s=300, on_round=kill_after_round_2)
        assert killed
        deadline = time.monotonic() + 10
        while killed[0] in _serverapp_pids(dep.token) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert killed[0] not in _serverapp_pids(dep.token)
        ckpt = load_checkpoint(results / "crash")
        assert ckpt.round == 2  # killed after round 2 was recorded, before the run ended
        resumed = dep.run({**base, "run-name": "crash", "resume": True}, timeout_s=300)
    assert resumed["status"] == "completed"
    assert [r["round"] for r in resumed["rounds"]] == list(range(4))  # appended to the same results
    # Every round's model, before and after the crash, is the uninterrupted run's.
    assert [r["model_digest"] for r in resumed["rounds"]] == [r["model_digest"] for r in full["rounds"]]
    assert _final_digest(resumed) == _final_digest(full)
    a = torch.load(results / "full" / "final_model.pt")
    b = torch.load(results / "crash" / "final_model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    print(f"resume: killed ServerApp {killed[0]} after round 2 (checkpoint {ckpt.round}); digest {_final_digest(full)}")


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    """``resume = true`` needs a run name, the checkpointed run's config, and rounds left."""
    from fedcomp.app.apps import _checkpoint_to_resume
    from fedcomp.app.config import AppConfig
    from fedcomp.errors import ConfigError

    base = {"results-dir": str(tmp_path), "resume": True, "num-server-rounds": 4}
    with pytest.raises(ConfigError, match="resume: needs run-name"):
        _checkpoint_to_resume(AppConfig.from_run_config(base))
    cfg = AppConfig.from_run_config({**base, "run-name": "r"})
    with pytest.raises(CheckpointError, match="no checkpoint"):
        _checkpoint_to_resume(cfg)
    ckpt = _checkpoint()
    ckpt.config = cfg.to_run_config()
    (tmp_path / "r").mkdir()
    save_checkpoint(tmp_path / "r", ckpt)
    assert _checkpoint_to_resume(cfg).round == 2
    with pytest.raises(ConfigError, match=r"differs from the checkpointed run's: sbc-p = 0\.05 -> 0\.1"):
        _checkpoint_to_resume(AppConfig.from_run_config({**base, "run-name": "r", "sbc-p": 0.1}))
    with pytest.raises(ConfigError, match="nothing left to run"):
        _checkpoint_to_resume(AppConfig.from_run_config({**base, "run-name": "r", "num-server-rounds": 2}))
