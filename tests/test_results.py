"""RunRecorder (fedcomp.app.results) and the traffic-metering Grid (fedcomp.app.fl)."""

from __future__ import annotations

import datetime as dt
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedcomp.app.apps import client_error_text, server_main
from fedcomp.app.fl import MeteredGrid, arrayrecord_nbytes, payload_nbytes
from fedcomp.app.models import LeNet5Caffe
from fedcomp.app.results import RunRecorder, record_failure
from fedcomp.errors import ConfigError
from tests.flower.helpers import server_identity  # noqa: F401  (a fixture)


def _timestamp(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_recorder_writes_rounds_and_prints_a_table(tmp_path: Path) -> None:
    out = io.StringIO()
    rec = RunRecorder({"lr": 0.1}, tmp_path, "run1", stream=out)
    assert json.loads(rec.path.read_text())["status"] == "running"
    rec.end_round(0, accuracy=0.1, loss=2.3)
    rec.add_traffic(7, downlink_bytes=100, dense_downlink_bytes=400)
    rec.add_traffic(7, uplink_bytes=10, dense_uplink_bytes=400)
    rec.add_traffic(12, downlink_bytes=100, dense_downlink_bytes=400, uplink_bytes=30,
                    dense_uplink_bytes=400)  # fmt: skip
    rec.add_metrics(train_loss=0.7)
    rec.end_round(1, accuracy=0.8, loss=0.5)
    path = rec.finish()

    data = json.loads(path.read_text())
    assert path == tmp_path / "run1" / "results.json"
    assert data["status"] == "completed" and data["config"] == {"lr": 0.1}
    r0, r1 = data["rounds"]
    assert r0["uplink_bytes"] == 0 and r0["uplink_compression"] is None
    assert r1["round"] == 1 and r1["accuracy"] == 0.8 and r1["train_loss"] == 0.7
    assert (r1["uplink_bytes"], r1["downlink_bytes"]) == (40, 200)
    assert (r1["dense_uplink_bytes"], r1["dense_downlink_bytes"]) == (800, 800)
    assert r1["uplink_compression"] == 20.0 and r1["downlink_compression"] == 4.0
    assert r1["clients"] == {
        "ids": ["7", "12"], "uplink_bytes": [10, 30], "downlink_bytes": [100, 100],
        "dense_uplink_bytes": [400, 400], "dense_downlink_bytes": [400, 400],
    }  # fmt: skip
    assert data["summary"]["final_accuracy"] == data["summary"]["best_accuracy"] == 0.8
    # Totals are sums over the rounds (round 0 moved nothing).
    assert data["summary"]["total_uplink_bytes"] == 40 and data["summary"]["total_downlink_bytes"] == 200
    assert data["summary"]["total_dense_uplink_bytes"] == data["summary"]["total_dense_downlink_bytes"] == 800
    assert data["error"] is None and _timestamp(data["finished_at"]) >= _timestamp(data["started_at"])
    table = out.getvalue().splitlines()
    assert "round" in table[1] and table[2].split()[0] == "0" and table[3].split()[0] == "1"


def test_a_diverged_models_nan_loss_is_recorded_not_a_crash(tmp_path: Path) -> None:
    """A NaN evaluation loss (a diverged or poisoned model) is null in results.json and 'nan' in
    the table; it raised 'Out of range float values are not JSON compliant' and left the run's
    results.json saying 'running'."""
    out = io.StringIO()
    rec = RunRecorder({}, tmp_path, "run1", stream=out)
    rec.end_round(0, accuracy=0.1, loss=float("nan"))
    rec.end_round(1, accuracy=0.1, loss=float("inf"))
    data = json.loads(rec.finish().read_text())
    assert data["status"] == "completed" and [r["loss"] for r in data["rounds"]] == [None, None]
    assert out.getvalue().splitlines()[2].split()[:3] == ["0", "0.1000", "nan"]


def test_results_json_is_the_whole_record_indented_with_each_round_dumped_once(tmp_path: Path) -> None:
    """results.json is rewritten every round; each round's entry is dumped once and joined (a full
    dump every round made a 300-round run 12-20 % slower by its end). The text is what
    ``json.dumps(indent=2)`` of the whole record gives, from the start, through rounds and a
    restore, to the finish."""
    rec = RunRecorder({"lr": 0.1, "name": 'é"'}, tmp_path, "run1", stream=None)

    def written() -> str:
        return rec.path.read_text()

    assert written() == json.dumps(rec.to_dict(), indent=2) + "\n"  # (no rounds: "rounds": [])
    for rnd in range(3):
        rec.add_traffic(rnd, uplink_bytes=10 * rnd, dense_uplink_bytes=400)
        rec.add_metrics(train_loss=0.7, nested={"a": [1, {"b": None}]}, text="x\ny")
        rec.end_round(rnd, accuracy=0.5, loss=float(rnd))
        assert written() == json.dumps(rec.to_dict(), indent=2) + "\n"
    other = RunRecorder({}, tmp_path, "run2", stream=None)
    other.restore(rec.rounds, rec.started_at.isoformat())
    other.end_round(3, accuracy=0.6, loss=0.1)
    assert other.path.read_text() == json.dumps(other.to_dict(), indent=2) + "\n"
    assert [r["round"] for r in json.loads(other.path.read_text())["rounds"]] == [0, 1, 2, 3]
    data = json.loads(rec.finish().read_text())
    assert data["status"] == "completed" and len(data["rounds"]) == 3


def test_timestamped_run_names_do_not_collide(tmp_path: Path) -> None:
    a = RunRecorder({}, tmp_path, stream=None)
    b = RunRecorder({}, tmp_path, stream=None)
    assert a.run_dir != b.run_dir and a.run_dir.parent == b.run_dir.parent == tmp_path


def test_payload_nbytes_counts_arrays_and_bytes_only() -> None:
    arrays = ArrayRecord(LeNet5Caffe().state_dict())
    assert arrayrecord_nbytes(arrays) == 431_080 * 4
    content = RecordDict(
        {
            "arrays": ArrayRecord([np.zeros(10, np.uint8)]),
            "config": ConfigRecord({"server-round": 3, "blob": b"12345", "blobs": [b"ab", b"c"]}),
            "metrics": MetricRecord({"num-examples": 10}),
        }
    )
    assert payload_nbytes(content) == 10 + 5 + 3


class _EchoGrid:
    """Just enough Grid: each node replies with the content it got; node 13 replies an error."""

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error, Message

        return [
            Message(Error(code=0, reason="boom"), reply_to=m)
            if m.metadata.dst_node_id == 13
            else Message(m.content, reply_to=m)
            for m in messages
        ]


@pytest.mark.usefixtures("server_identity")
def test_metered_grid_counts_whole_messages_both_ways(tmp_path: Path) -> None:
    """The meter counts what crosses the wire: each message whole, as Flower moves it (its
    objects deflated), headers, config and metadata included, error replies too; it counted the
    payload only, and overstated the factors by 8 % to 53 % (byte-accounting audit). The dense
    reference is the fp32 model each model-carrying message stands for."""
    from flwr.app import Message

    from fedcomp.app.fl import message_nbytes

    rec = RunRecorder({}, tmp_path, "g", stream=None)
    model_bytes = 431_080 * 4
    grid = MeteredGrid(_EchoGrid(), rec, dense_nbytes=model_bytes)  # type: ignore[arg-type]
    content = RecordDict({"arrays": ArrayRecord(LeNet5Caffe().state_dict()), "config": ConfigRecord({"lr": 0.1})})
    out = [Message(content, dst_node_id=n, message_type="train") for n in (5, 9, 13)]
    replies = list(grid.send_and_receive(out))
    entry = rec.end_round(1, accuracy=0.5, loss=1.0)
    assert entry["clients"]["ids"] == ["5", "9", "13"]
    down = entry["clients"]["downlink_bytes"]
    assert down == [message_nbytes(m) for m in out] and all(model_bytes < n < model_bytes + 4096 for n in down)
    up = entry["clients"]["uplink_bytes"]
    assert up[:2] == [message_nbytes(r) for r in replies[:2]] and 0 < up[2] < 1024  # 13's error reply
    assert entry["dense_uplink_bytes"] == 2 * model_bytes  # (an error reply carries no model)
    assert entry["dense_downlink_bytes"] == 3 * model_bytes


@pytest.mark.usefixtures("server_identity")
def test_message_nbytes_is_the_deflated_objects_and_counts_what_payload_bytes_left_out() -> None:
    from flwr.app import Message
    from flwr.common.serde import message_to_proto

    from fedcomp.app.fl import message_nbytes

    blob = ConfigRecord({"payload": b"x" * 1000, "codec": '{"id": "sbc", "p": 0.01}', "version": 7})
    m = Message(RecordDict({"fedcomp.downlink": blob}), dst_node_id=5, message_type="train")
    assert payload_nbytes(m.content) == 1000
    proto = message_to_proto(m).ByteSize()
    assert 1000 + 30 < proto <= message_nbytes(m) < proto + 1024


@pytest.mark.usefixtures("server_identity")
def test_the_downlink_of_a_seeded_initial_model_has_no_dense_counterpart(tmp_path: Path) -> None:
    """DEFT's round 1: the clients build the seeded initial model (mode ``none`` at version 0),
    and the message carries only their allocation. Dense FedAvg seeded alike sends nothing: its
    bytes count, but no dense model beside them (a whole one was charged: DEFT's downlink factor
    was 1/rounds too good). A client already up to date later on (an evaluate message) stands for
    a model: dense FedAvg sends it one."""
    from flwr.app import Message

    from fedcomp.flower import protocol

    rec = RunRecorder({}, tmp_path, "g", stream=None)
    grid = MeteredGrid(_EchoGrid(), rec, dense_nbytes=1000)  # type: ignore[arg-type]
    for mode, version, node in (("none", 0, 5), ("chain", 1, 9), ("none", 3, 11)):
        down = ConfigRecord({"mode": mode, "version": version, "a.allocation": b"x" * 40})
        list(
            grid.send_and_receive(
                [Message(RecordDict({protocol.DOWNLINK: down}), dst_node_id=node, message_type="train")]
            )
        )
    entry = rec.end_round(1, accuracy=0.5, loss=1.0)
    assert all(n > 40 for n in entry["clients"]["downlink_bytes"])
    assert entry["clients"]["dense_downlink_bytes"] == [0, 1000, 1000]


class _LostSuperLinkGrid(Grid):
    """Two SuperNodes are connected, but every message the ServerApp sends fails, as when the
    SuperLink goes away mid-run."""

    def get_node_ids(self):
        return [11, 12]

    def send_and_receive(self, messages, *, timeout=None):
        raise ConnectionError("SuperLink went away")

    def push_messages(self, messages):
        raise ConnectionError("SuperLink went away")

    def pull_messages(self, message_ids):
        raise ConnectionError("SuperLink went away")

    def create_message(self, *args, **kwargs):
        raise NotImplementedError

    @property
    def run(self):
        raise NotImplementedError

    def set_run(self, run_id):
        pass


def test_a_server_app_that_crashes_is_recorded_as_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real ServerApp body (fedcomp.app.apps.server_main, compression on) on a Grid whose
    sends fail: round 0 (the initial model's evaluation) is recorded, then round 1's send raises;
    results.json must say "failed", carry the error, keep round 0 and save no final model."""
    from flwr.supercore.task_identity import TaskIdentity

    # What Flower sets in a real ServerApp process; Messages cannot be built without it.
    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    run_config = {"dataset": "digits", "num-server-rounds": 2, "results-dir": str(tmp_path), "run-name": "crash"}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with pytest.raises(ConnectionError, match="SuperLink went away"):
        server_main(_LostSuperLinkGrid(), context)  # the error still reaches Flower
    data = json.loads((tmp_path / "crash" / "results.json").read_text())
    assert data["status"] == "failed"
    assert data["error"] == "ConnectionError: SuperLink went away"
    assert _timestamp(data["finished_at"]) >= _timestamp(data["started_at"])
    assert [r["round"] for r in data["rounds"]] == [0]
    assert data["summary"]["final_accuracy"] == data["rounds"][0]["accuracy"]
    assert data["summary"]["total_uplink_bytes"] == data["summary"]["total_downlink_bytes"] == 0
    assert not (tmp_path / "crash" / "final_model.pt").exists()


class _FailingClientsGrid(_LostSuperLinkGrid):
    """Two SuperNodes that answer every message with an error, as clients whose ClientApp raises
    (e.g. ``client-device = 'cuda'`` on a machine without CUDA)."""

    def send_and_receive(self, messages, *, timeout=None):
        from flwr.app import Error, Message

        reason = "<class 'fedcomp.errors.ConfigError'>:<'client-device: cuda asked for'>"  # as Flower packs it
        return [Message(Error(code=0, reason=reason), reply_to=m) for m in messages]

    def create_message(self, *args, **kwargs):
        from flwr.app import Message

        return Message(*args, **kwargs)


def _server_context(monkeypatch: pytest.MonkeyPatch, run_config: dict[str, Any]) -> Context:
    """The Context ``server_main`` gets under Flower, with its task identity set."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    return Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)


class _InterruptedGrid(_FailingClientsGrid):
    """A SIGTERM (Python raises KeyboardInterrupt for it under Flower) while round 1 runs."""

    def send_and_receive(self, messages, *, timeout=None):
        raise KeyboardInterrupt


def test_an_interrupted_run_says_so_in_results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt's text is empty: results.json said "KeyboardInterrupt: " and nothing more."""
    context = _server_context(monkeypatch, {"num-server-rounds": 2, "results-dir": str(tmp_path), "run-name": "int"})
    with pytest.raises(KeyboardInterrupt):
        server_main(_InterruptedGrid(), context)
    data = json.loads((tmp_path / "int" / "results.json").read_text())
    assert data["status"] == "failed"
    assert data["error"] == (
        "KeyboardInterrupt: interrupted (SIGINT or SIGTERM); resume=true continues from the last checkpoint"
    )


class _SeenConfigsGrid(_FailingClientsGrid):
    """As :class:`_FailingClientsGrid`, keeping the train configs each round sends."""

    def __init__(self) -> None:
        super().__init__()
        self.local_iters: list[set[object]] = []

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        train = [m for m in messages if m.metadata.message_type == "train"]
        if train:
            self.local_iters.append({m.content.config_records["config"].get("local-iters") for m in train})
        return super().send_and_receive(messages, timeout=timeout)


def test_the_reference_app_sends_each_rounds_scheduled_local_iters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapper fills in each round's local-iters from the schedule; the app's own train config
    holds none (it would be kept, the round-1 value every round)."""
    from fedcomp.app.apps import NoProgressError

    context = _server_context(monkeypatch, {
        "num-server-rounds": 3, "max-empty-rounds": 3, "local-iters": "list:3,5,7",
        "results-dir": str(tmp_path), "run-name": "sched",
    })  # fmt: skip
    grid = _SeenConfigsGrid()
    with pytest.raises(NoProgressError):  # (its clients all fail: what is checked is what went out)
        server_main(grid, context)
    assert grid.local_iters == [{3}, {5}, {7}]


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize(
    ("rounds", "limit", "why"),
    [(5, 2, "max-empty-rounds = 2"), (2, 3, "the whole run: no round aggregated an update")],
    ids=["max-empty-rounds", "a shorter run"],
)
def test_rounds_without_an_aggregated_update_fail_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, compress: bool, rounds: int, limit: int, why: str
) -> None:
    """Every client fails every round: each round records 0 updates and the clients' errors, and
    after max-empty-rounds such rounds, or at the end of a shorter run, the run ends "failed"
    naming them (not "completed" with the initial model's accuracy: a 2-round run said "OK")."""
    from fedcomp.app.apps import NoProgressError

    context = _server_context(monkeypatch, {
        "num-server-rounds": rounds, "max-empty-rounds": limit, "compress": compress,
        "results-dir": str(tmp_path), "run-name": "stuck",
    })  # fmt: skip
    with pytest.raises(NoProgressError, match=rf"no client update was aggregated in 2 rounds in a row .*{why}"):
        server_main(_FailingClientsGrid(), context)
    data = json.loads((tmp_path / "stuck" / "results.json").read_text())
    assert data["status"] == "failed"
    assert (
        "rounds 1-2" in data["error"]
        and "2 client(s): code 0: ConfigError: client-device: cuda asked for" in data["error"]
    )
    assert [r["round"] for r in data["rounds"]] == [0, 1, 2]
    for r in data["rounds"][1:]:
        assert r["updates_aggregated"] == 0
        assert r["client_errors"] == {n: "code 0: ConfigError: client-device: cuda asked for" for n in ("11", "12")}
    assert (tmp_path / "stuck" / "results.json").stat().st_mode & 0o777 == 0o644


class _OverflowingClientsGrid(_FailingClientsGrid):
    """Two SuperNodes running the real compression mod whose every update is finite but near
    float32's largest, with a huge example count: every round's aggregate overflows."""

    def __init__(self) -> None:
        self.clients: dict[int, Any] = {}

    def send_and_receive(self, messages, *, timeout=None):
        from fedcomp.flower.sampling import answer_partition_query
        from tests.flower.helpers import Client
        from tests.flower.test_hostile_replies import _huge_payload, _replace_content

        out = []
        for m in messages:
            client = self.clients.setdefault(m.metadata.dst_node_id, Client(m.metadata.dst_node_id))
            if m.metadata.message_type.startswith("query."):  # (the app's partition query: none here)
                out.append(answer_partition_query(m, client.ctx))
                continue
            reply = client.handle(m)
            if reply.has_content() and "fedcomp.uplink" in reply.content.config_records:
                reply = _replace_content(_huge_payload(reply, 3e38), metrics=MetricRecord({"num-examples": 10**9}))
            out.append(reply)
        return out


def test_rounds_whose_aggregate_is_refused_count_as_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reply is accepted, but every round's aggregate is refused (the model stays): those
    rounds aggregated nothing, and max-empty-rounds ends the run (they counted their accepted
    replies as aggregated, and such a run would have gone on to its last round; here, the first
    round's aggregate ended it at the next downlink)."""
    from fedcomp.app.apps import NoProgressError

    context = _server_context(
        monkeypatch,
        {
            "num-server-rounds": 6,
            "max-empty-rounds": 2,
            "results-dir": str(tmp_path),
            "run-name": "refused",
            "dataset": "digits",
            "seeded-initial-model": False,
            "max-update-norm-factor": 0.0,  # (its bound would reject these replies first)
        },
    )  # fmt: skip  (the fake clients cannot build the initial model)
    with pytest.raises(NoProgressError, match="no client update was aggregated in 2 rounds in a row"):
        server_main(_OverflowingClientsGrid(), context)
    rounds = json.loads((tmp_path / "refused" / "results.json").read_text())["rounds"][1:]
    assert [r["updates_aggregated"] for r in rounds] == [0, 0]
    # (their mean is finite, but no grid the lattice downlink could set holds it: the next downlink
    # ended the run before)
    assert all("leaves the lattice downlink's grid" in r["aggregate_refused"] for r in rounds), rounds


def test_errors_at_start_leave_a_failed_results_file(tmp_path: Path) -> None:
    """A bad run config under plain `flwr run .`: the ServerApp still writes results.json
    (status failed, the message naming the key) before the error reaches Flower."""
    run_config = {"sbc-p": 1.5, "results-dir": str(tmp_path), "run-name": "bad"}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with pytest.raises(ConfigError, match="sbc-p"):
        server_main(_LostSuperLinkGrid(), context)
    data = json.loads((tmp_path / "bad" / "results.json").read_text())
    assert data["status"] == "failed" and "sbc-p: value 1.5 is outside" in data["error"]
    assert data["rounds"] == [] and data["config"] == run_config


def test_device_cuda_without_cuda_is_a_config_error_at_start(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: asking for it is not an error here")
    run_config = {"device": "cuda", "results-dir": str(tmp_path), "run-name": "cuda"}
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with pytest.raises(ConfigError, match="^device: 'cuda' was asked for"):
        server_main(_LostSuperLinkGrid(), context)
    assert json.loads((tmp_path / "cuda" / "results.json").read_text())["status"] == "failed"


def test_results_file_is_group_readable_and_failure_lines_name_the_error(tmp_path: Path) -> None:
    out = io.StringIO()
    path = record_failure({"run-name": "../x", "lr": -1}, "ConfigError: lr: must be > 0", tmp_path, stream=out)
    assert path.parent.parent == tmp_path and path.parent.name != "x"  # a bad run-name is not used
    assert path.stat().st_mode & 0o777 == 0o644
    assert "[fedcomp] error: ConfigError: lr: must be > 0" in out.getvalue()


def test_client_error_text_is_the_exception_and_its_message() -> None:
    """What Flower's Ray backend puts in Error.reason (shortened from a real run): a class, Ray's
    colour-coded remote traceback, and Flower's wrapper around the app's own message."""
    ray_reason = (
        "<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
        '(pid=1747)\n  File "fault_client.py", line 22, in fault_mod\n    raise InjectedFailure(...)\n'
        "fault_client.InjectedFailure: fail-train: injected\n\nThe above exception was the direct cause\n"
        "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred. "
        "Message: fail-train: injected'>"
    )
    assert client_error_text(ray_reason) == "ClientAppException: fail-train: injected"
    assert client_error_text("<class 'fedcomp.errors.ConfigError'>:<'x: bad'>") == "ConfigError: x: bad"
    assert client_error_text("plain text") == "plain text"
    assert client_error_text("y" * 1000).endswith("...") and len(client_error_text("y" * 1000)) == 300
