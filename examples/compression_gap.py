"""What compression costs the model: accuracy against total bytes, dense FedAvg vs compressed.

One command, cached, that runs the reference task (LeNet5-Caffe, MNIST, 10 local Adam steps of
batch 32 per round, a fresh Adam each round, the server model evaluated on the 10k test set)
under IID and label-skewed (Dirichlet) partitions, with every client training each round or a
sampled fraction of them, for dense FedAvg and each compressed setting:

    python examples/compression_gap.py                   # the full grid (about an hour on 2 cores)
    python examples/compression_gap.py --quick           # a smoke run: few rounds, two settings
    python examples/compression_gap.py --only sbc1-3lc,default --partition dirichlet

The compressed runs go through the library's real code path in one process -- the
``CompressionStrategy`` wrapper around Flower's ``FedAvg`` on the server and ``compression_mod``
on each client, exchanging real Flower messages with real protobuf payloads -- only the Flower
transport (SuperLink, SuperNodes) is skipped, which changes no byte. Bytes are counted both ways
as the wire carries them, the initial model included (round 1's downlink is each client's first
full replica) and every downlink counted once per receiving client; the dense baseline's are
``4 x parameters`` per message.

Emulated time at a link speed adds per round one client round's compute, the codec time (the
slowest client's encode plus the server's codec work, measured in the run) and the bytes of the
client that moved the most over its link (one link per client, no contention). The compute is
the same for every arm of a table -- each run calibrates it before its first round as the fastest
of 5 ``train_local`` calls of one round's steps in CPU seconds (one torch thread), and the table
charges the fastest of its runs' calibrations -- rather than each arm's measured training time:
all arms train the same model with the same steps and batch, and on a shared machine the wall
time mostly measures the other jobs (a departure from timing each round; a table none of whose
runs was calibrated falls back to the dense arm's median round). The codec time is wall time as
the library measures it, so it still grows with the machine's load.

``--inner fedavgm:server-lr=1,momentum=0.9`` (or ``fedadam:eta=0.01,tau=0.001``) puts Flower's
server optimiser under both the dense and the compressed arms, so each pair is comparable.

Stale residuals: every compressed run records, each time a client's residual is used, its age
(rounds since that client last sent) and its norm against the client's fresh update; the
``stale-residual-decay`` / ``stale-residual-clip`` keys (``fedcomp.methods.feedback``) are
applied here by giving the mod's encoder the policy and the age, as the mod would once it passes
them itself.

Results are cached per setting in ``examples/results/compression_gap/`` (delete a file to rerun
it); ``--write-docs`` rewrites the table and plots in ``docs/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM, Strategy

from fedcomp.app.config import APP_COMPRESSION_DEFAULTS
from fedcomp.app.data import DataError, load_dataset, load_partition
from fedcomp.app.models import LeNet5Caffe, evaluate, train_local
from fedcomp.bench import int_at_least
from fedcomp.flower import mod as mod_module
from fedcomp.flower import protocol
from fedcomp.flower.mod import make_compression_mod
from fedcomp.flower.records import tensors_from_record
from fedcomp.flower.settings import CompressionConfig
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.methods.feedback import StaleResidual
from fedcomp.methods.update import UpdateEncoder

HERE = Path(__file__).resolve().parent
CACHE = HERE / "results" / "compression_gap"

#: Named settings: run-config keys of CompressionConfig (None: dense FedAvg, no wrapper).
SETTINGS: dict[str, dict[str, Any] | None] = {
    "dense": None,
    "sbc1-3lc": {"sbc-p": 0.01, "3lc-s": 1.0},  # the defaults before this experiment
    "sbc5-3lc": {"sbc-p": 0.05, "3lc-s": 1.0},
    "sbc1-exact": {"sbc-p": 0.01, "downlink-codec": "dense-fp32"},  # the downlink's share of the gap
    "sbc5-3lc-warm": {"sbc-p": "list:0.5,0.2,0.1,0.05", "3lc-s": 1.0},  # DGC-style warm-up to 5 %
    # The named warm-up preset (fedcomp.methods.schedules): 0.25 -> 0.05 over 4 rounds, then 5 %.
    "default-warmup": {**APP_COMPRESSION_DEFAULTS, "downlink-codec": "3lc", "sbc-p": "warmup:0.05@4"},
    "stc5-3lc": {"uplink-codec": "stc", "sbc-p": 0.05, "3lc-s": 1.0},
    "sbc5-3lcx2": {"sbc-p": 0.05, "3lc-s": 1.0, "downlink-passes": 2},  # a second pass on what 3LC missed
    "sbc1-3lcx2": {"sbc-p": 0.01, "3lc-s": 1.0, "downlink-passes": 2},
    # The reference app's defaults (fedcomp.app.config: the library's plus the seeded initial model).
    "default": dict(APP_COMPRESSION_DEFAULTS),
    # Sparser 3LC deltas (s = 1.5): shorter catch-up chains for clients that were away.
    "default-s1.5": {**APP_COMPRESSION_DEFAULTS, "downlink-codec": "3lc", "3lc-s": 1.5},
    # The lattice grid step around the app's default (12): what chose it.
    "lat8": {**APP_COMPRESSION_DEFAULTS, "lattice-step": 8.0},
    "lat16": {**APP_COMPRESSION_DEFAULTS, "lattice-step": 16.0},
    # The app's defaults before the lattice downlink became one (3LC down, the papers' pairing).
    "default-3lc": {**APP_COMPRESSION_DEFAULTS, "downlink-codec": "3lc"},
    # Stale-residual remedies (10 of 100 clients: a residual waits ~10 rounds).
    "default-decay0.8": {**APP_COMPRESSION_DEFAULTS, "downlink-codec": "3lc", "stale-residual-decay": 0.8},
    "default-decay0.9": {**APP_COMPRESSION_DEFAULTS, "downlink-codec": "3lc", "stale-residual-decay": 0.9},
    "default-clip1": {**APP_COMPRESSION_DEFAULTS, "downlink-codec": "3lc", "stale-residual-clip": 1.0},
}

#: Run-config keys added after results were cached, with the value that changes nothing: left
#: out of a cache key at that value, so adding them does not rerun every cached setting.
KEYS_ADDED_OFF: dict[str, Any] = {
    "stale-residual-decay": 1.0,
    "stale-residual-clip": 0.0,
    "lattice-step": 8.0,  # the "lattice" downlink's (issue 12), read only by it
    "lattice-weight-step": 1024.0,  # its bound by the weights (2026-11-27): 1024 never binds on LeNet
    "downlink-candidates": "3lc,3lc*2,sparse-fp16,sparse-fp32,dense-fp32",  # the "auto" downlink's
    "max-update-norm-factor": 0.0,  # (2026-11-29)
    "max-empty-rounds": 3,  # (2026-11-28: it ends a run that aggregates nothing; none of these does)
    "deft-norms": "clients",  # (2026-11-29: read by DEFT alone, and no DEFT run was cached before it)
}

#: The stale-residual policy's keys (fedcomp.methods.feedback.StaleResidual), read here: the mod
#: does not read them yet (the library's CompressionConfig ignores keys it does not know).
STALE_KEYS = ("stale-residual-decay", "stale-residual-clip")

#: Server strategies under both arms: Flower's, with their keyword arguments (kebab-case in specs).
INNER: dict[str, tuple[Any, dict[str, float]]] = {  # (a Strategy class, its parameters)
    "fedavg": (FedAvg, {}),
    "fedavgm": (FedAvgM, {"server-lr": 1.0, "momentum": 0.9}),
    "fedadam": (FedAdam, {"eta": 0.01, "beta-1": 0.9, "beta-2": 0.99, "tau": 0.001}),
}
_INNER_KWARG = {
    "server-lr": "server_learning_rate",
    "momentum": "server_momentum",
    "beta-1": "beta_1",
    "beta-2": "beta_2",
}


def parse_inner(spec: str) -> tuple[str, dict[str, float]]:
    """``NAME[:key=value,...]`` -> (name, all its parameters); ValueError naming the bad part."""
    name, _, rest = spec.strip().partition(":")
    if name not in INNER:
        raise ValueError(f"--inner {spec!r}: unknown strategy {name!r} (known: {', '.join(INNER)})")
    params = dict(INNER[name][1])
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if key not in params or not eq:
            raise ValueError(f"--inner {spec!r}: {name} takes {', '.join(params) or 'no parameters'}, got {item!r}")
        try:
            params[key] = float(value)
        except ValueError:
            raise ValueError(f"--inner {spec!r}: {key} {value!r} is not a number") from None
        if not math.isfinite(params[key]):
            raise ValueError(f"--inner {spec!r}: {key} {value!r} is not finite")
    return name, params


def inner_label(spec: str) -> str:
    """The canonical spec (all parameters spelled out): names cache files and table titles."""
    name, params = parse_inner(spec)
    return name if not params else name + ":" + ",".join(f"{k}={v:g}" for k, v in params.items())


def make_inner(spec: str) -> Strategy:
    name, params = parse_inner(spec)
    cls, _ = INNER[name]
    kwargs = {_INNER_KWARG.get(k, k.replace("-", "_")): v for k, v in params.items()}
    return cls(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1, **kwargs)


@dataclass(frozen=True)
class Task:
    """Everything that makes a run; its hash names the cache file."""

    setting: str
    compression: dict[str, Any] | None
    partition: str = "dirichlet"
    alpha: float = 0.3
    clients: int = 10
    per_round: int = 10
    rounds: int = 60
    local_iters: int = 10
    batch_size: int = 32
    lr: float = 1e-3
    seed: int = 0
    dataset: str = "mnist"
    eval_every: int = 5
    inner: str = "fedavg"  # the server strategy under both arms (``inner_label`` form)

    def key(self) -> str:
        """Names the cache file: the resolved settings (so a changed library default reruns)."""
        blob = json.dumps(self.key_fields(), sort_keys=True, default=str).encode()
        return (
            f"{self.setting}-{self.partition}-{self.per_round}of{self.clients}-{hashlib.sha256(blob).hexdigest()[:10]}"
        )

    def key_fields(self) -> dict[str, Any]:
        """What :meth:`key` hashes."""
        fields = asdict(self)
        if self.inner == "fedavg":
            del fields["inner"]  # as before the axis existed: the cached FedAvg runs stay valid
        if self.compression is not None:
            resolved = CompressionConfig.from_run_config(self.compression).to_run_config()
            for k in STALE_KEYS:  # not (yet) keys of the library's config: as they would resolve
                resolved[k] = float(self.compression.get(k, KEYS_ADDED_OFF[k]))
            for k, off in KEYS_ADDED_OFF.items():
                if resolved.get(k) == off:
                    del resolved[k]
            if resolved.get("downlink-codec") != "lattice":
                resolved.pop("lattice-step", None)  # read by the lattice downlink only
                resolved.pop("lattice-weight-step", None)
            fields["compression"] = resolved
        return fields


@dataclass
class Record:
    """One round: test accuracy (when evaluated), bytes both ways, times."""

    round: int
    accuracy: float | None
    uplink_bytes: int
    downlink_bytes: int
    compute_s: float  # slowest sampled client's training time this round
    codec_s: float  # slowest client's encode + the server's codec time this round
    max_client_bytes: int  # the most bytes one client moved this round (down + up)
    diagnostics: dict[str, float] = field(default_factory=dict)


class _Grid(Grid):
    """The nodes sampled for this round; the driver below carries the messages itself."""

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:  # type: ignore[override]
        return list(self.nodes)

    def set_run(self, run_id: Any) -> None:
        raise NotImplementedError

    @property
    def run(self) -> Any:  # type: ignore[override]
        raise NotImplementedError

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        raise NotImplementedError

    def push_messages(self, messages: Any) -> Any:
        raise NotImplementedError

    def pull_messages(self, message_ids: Any) -> Any:
        raise NotImplementedError

    def send_and_receive(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


def _flower_identity() -> None:
    """Flower builds Messages only inside a run; give this process the identity a run has."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 1)):
        setattr(TaskIdentity, attr, value)


def run(task: Task, data_dir: str | None) -> dict[str, Any]:
    """One run of ``task``; returns its result dict (also cached)."""
    _flower_identity()
    torch.manual_seed(task.seed)
    model = LeNet5Caffe()
    params = sum(p.numel() for p in model.state_dict().values())
    test = load_dataset(task.dataset, data_dir).test
    parts = {
        node: load_partition(
            task.dataset,
            node,
            task.clients,
            scheme=task.partition,
            alpha=task.alpha,
            seed=task.seed,
            data_dir=data_dir,
        )
        for node in range(task.clients)
    }
    inner = make_inner(task.inner)
    strategy: Strategy = inner
    wrapper: CompressionStrategy | None = None
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mod = make_compression_mod()
    if task.compression is not None:
        wrapper = CompressionStrategy(inner, CompressionConfig.from_run_config(task.compression))
        strategy = wrapper
        if wrapper.config.seeded_initial_model:
            mod = make_compression_mod(initial_model=lambda ctx: initial)  # clients build it too
    contexts = {
        n: Context(
            run_id=1,
            node_id=n,
            node_config={"partition-id": n, "num-partitions": task.clients},
            state=RecordDict(),
            run_config={},
        )
        for n in parts
    }
    timing: dict[int, float] = {}
    fresh_norm: dict[int, float] = {}  # this round's local update norm per client (stale-residual study)

    def client_app(msg: Message, ctx: Context) -> Message:
        net = LeNet5Caffe()
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        net.load_state_dict(received)
        cfg = msg.content.config_records["config"]
        rnd, node = int(cfg["server-round"]), ctx.node_id  # type: ignore[arg-type]
        data = parts[node]
        t0 = time.perf_counter()
        train_local(
            net,
            (data.x, data.y),
            iterations=int(cfg.get("local-iters", task.local_iters)),  # type: ignore[arg-type]
            lr=task.lr,
            batch_size=task.batch_size,
            generator=torch.Generator().manual_seed(task.seed * 1_000_003 + node * 1_009 + rnd),
        )
        timing[node] = time.perf_counter() - t0
        trained = net.state_dict()
        fresh_norm[node] = math.sqrt(sum(float((trained[k] - received[k]).double().pow(2).sum()) for k in received))
        content = RecordDict(
            {"arrays": ArrayRecord(net.state_dict()), "metrics": MetricRecord({"num-examples": len(data)})}
        )
        return Message(content, reply_to=msg)

    with torch.random.fork_rng(devices=[]):  # the calibration's models must not shift the run's RNG
        round_compute_s = calibrate_round_compute(task, parts[0])
    record_calibration(task, round_compute_s)
    stale = None
    if task.compression is not None:
        comp = task.compression
        stale = StaleResidual(
            decay=float(comp.get("stale-residual-decay", 1.0)), clip=float(comp.get("stale-residual-clip", 0.0))
        )
    encoder_age = {"age": 1}

    class _Encoder(UpdateEncoder):
        """The mod's encoder with the stale-residual policy and this client's age (what the mod
        would pass once it reads the keys itself)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if self.feedback is not None and stale is not None and stale.active:
                self.feedback.stale, self.feedback.age = stale, encoder_age["age"]

    last_sent: dict[int, int] = {}
    uses: list[list[float]] = []  # [round, node, age, ||residual before use||, ||fresh update||]
    sampler = random.Random(task.seed)
    arrays = ArrayRecord(model.state_dict())
    history: list[Record] = []
    acc0 = evaluate(model, test.x, test.y)[1]
    history.append(Record(0, acc0, 0, 0, 0.0, 0.0, 0))
    t_start = time.perf_counter()
    original_encoder = mod_module.UpdateEncoder
    mod_module.UpdateEncoder = _Encoder  # type: ignore[misc]
    try:
        for rnd in range(1, task.rounds + 1):
            nodes = sorted(sampler.sample(range(task.clients), task.per_round))
            # (the wrapper adds its own schedule's local-iters; an own value would be kept)
            config = ConfigRecord({"local-iters": task.local_iters} if wrapper is None else {})
            msgs = list(strategy.configure_train(rnd, arrays, config, _Grid(nodes)))
            replies, per_client = [], {}
            timing.clear()
            for m in msgs:
                node = m.metadata.dst_node_id
                if wrapper is None:
                    # Plain FedAvg: the client gets the model and returns one, both dense fp32.
                    reply = client_app(m, contexts[node])
                    per_client[node] = (4 * params, 4 * params, 0.0)
                else:
                    age = rnd - last_sent[node] if node in last_sent else 0
                    res = contexts[node].state.array_records.get(protocol.STATE_RESIDUAL)
                    before = _norm(tensors_from_record(res)) if res is not None else 0.0
                    encoder_age["age"] = max(age, 1)
                    reply = mod(m, contexts[node], client_app)
                    if not reply.has_error():
                        if age and node in fresh_norm:
                            uses.append([rnd, node, age, before, fresh_norm[node]])
                        last_sent[node] = rnd
                replies.append(reply)
            new, _ = strategy.aggregate_train(rnd, replies)
            if new is not None:
                arrays = new
            up = down = 0
            codec_s = 0.0
            diag: dict[str, float] = {}
            if wrapper is None:
                up = down = 4 * params * len(nodes)
                max_bytes = 8 * params
            else:
                t = wrapper.traffic[rnd]
                up, down = sum(t.uplink.values()), sum(t.downlink.values())
                max_bytes = max(t.uplink.get(n, 0) + t.downlink.get(n, 0) for n in nodes)
                codec_s = max(t.client_encode_seconds.values(), default=0.0) + t.encode_seconds + t.decode_seconds
                if t.replica_lag is not None:
                    diag["replica_lag"] = t.replica_lag
                if t.downlink_delivered is not None:
                    diag["downlink_delivered"] = t.downlink_delivered
                if t.residual_ratio:
                    diag["residual_ratio"] = sum(t.residual_ratio.values()) / len(t.residual_ratio)
                if t.rejected:
                    diag["rejected"] = float(len(t.rejected))
            acc = None
            if rnd % task.eval_every == 0 or rnd == task.rounds or rnd in (1, 10, 25, 30):
                net = LeNet5Caffe()
                net.load_state_dict(arrays.to_torch_state_dict())
                acc = evaluate(net, test.x, test.y)[1]
            history.append(Record(rnd, acc, up, down, max(timing.values(), default=0.0), codec_s, max_bytes, diag))
            if acc is not None:
                total = sum(h.uplink_bytes + h.downlink_bytes for h in history)
                print(
                    f"  {task.setting:>12} round {rnd:3d}: acc {acc:.4f}  total {total / 1e6:8.2f} MB"
                    f"  ({time.perf_counter() - t_start:.0f} s)",
                    flush=True,
                )
    finally:
        mod_module.UpdateEncoder = original_encoder  # type: ignore[misc]
    final = tensors_from_record(arrays)
    return {
        "task": asdict(task),
        "params": params,
        "history": [asdict(h) for h in history],
        "final_norm": float(sum(float(v.double().pow(2).sum()) for v in final.values())) ** 0.5,
        "round_compute_cpu_s": round_compute_s,
        "residual_uses": uses,
        "seconds": time.perf_counter() - t_start,
    }


def _norm(tensors: Mapping[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def calibrate_round_compute(task: Task, data: Any, repeats: int = 5) -> float:
    """Seconds one client's round of training takes here: the fastest of ``repeats``
    ``train_local`` calls with the task's steps and batch, timed in CPU seconds of this process
    (one torch thread), which other jobs on a shared machine barely change -- its wall time can
    be 20x longer under load."""
    best = math.inf
    for i in range(repeats):
        net = LeNet5Caffe()
        t0 = time.process_time()
        train_local(
            net,
            (data.x, data.y),
            iterations=task.local_iters,
            lr=task.lr,
            batch_size=task.batch_size,
            generator=torch.Generator().manual_seed(i),
        )
        best = min(best, time.process_time() - t0)
    return best


def _same_run_elsewhere(task: Task, path: Path) -> None:
    """Move a result cached under another file name for the very same run (an older key scheme)
    to ``path``. Only results that recorded the settings they ran with (``key_fields``) qualify:
    re-resolving a stored task under today's library defaults would take a run made with other
    defaults (e.g. the 3LC downlink before lattice became the app's default) for today's."""
    fields = _recorded_fields(task)
    for other in CACHE.glob(f"{task.setting}-*.json"):
        if _without_keys_off(json.loads(other.read_text()).get("key_fields")) == fields:
            other.rename(path)
            return


def _without_keys_off(fields: Any) -> Any:
    """Recorded ``key_fields`` as :meth:`Task.key_fields` would make them today: without the
    :data:`KEYS_ADDED_OFF` at their off values (a run recorded after a key was added, before it
    was listed there, is the same run)."""
    if not isinstance(fields, dict) or not isinstance(fields.get("compression"), dict):
        return fields
    compression = {
        k: v for k, v in fields["compression"].items() if not (k in KEYS_ADDED_OFF and v == KEYS_ADDED_OFF[k])
    }
    return {**fields, "compression": compression}


def _recorded_fields(task: Task) -> dict[str, Any]:
    """``task.key_fields()`` as a result file records it (through JSON)."""
    return json.loads(json.dumps(task.key_fields(), default=str))  # type: ignore[no-any-return]


def cached(task: Task) -> dict[str, Any] | None:
    """The cached result of ``task``, if any."""
    path = CACHE / f"{task.key()}.json"
    if not path.exists():
        _same_run_elsewhere(task, path)
    return json.loads(path.read_text()) if path.exists() else None


def cached_run(task: Task, data_dir: str | None, refresh: bool = False) -> dict[str, Any]:
    path = CACHE / f"{task.key()}.json"
    if not path.exists() and not refresh:
        _same_run_elsewhere(task, path)
    if path.exists() and not refresh:
        return json.loads(path.read_text())
    result = run(task, data_dir)
    result["key_fields"] = _recorded_fields(task)  # the settings it ran with
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return result


# --- reading results ---------------------------------------------------------------------------


def accuracy_at(result: Mapping[str, Any], rnd: int) -> float | None:
    for h in result["history"]:
        if h["round"] == rnd:
            return h["accuracy"]
    return None


def total_bytes(result: Mapping[str, Any], upto: int | None = None) -> int:
    return sum(h["uplink_bytes"] + h["downlink_bytes"] for h in result["history"] if upto is None or h["round"] <= upto)


def first_round_reaching(result: Mapping[str, Any], target: float) -> int | None:
    for h in result["history"]:
        if h["accuracy"] is not None and h["accuracy"] >= target:
            return int(h["round"])
    return None


def _calibration_key(task: Task) -> str:
    return f"{task.dataset}-{task.local_iters}x{task.batch_size}"


def stored_calibration(task: Task) -> float | None:
    """The fastest calibration any run of this experiment measured for ``task``'s compute."""
    path = CACHE / "calibration.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    value = stored.get(_calibration_key(task))
    return float(value) if value is not None else None


def record_calibration(task: Task, seconds: float) -> None:
    """Keep ``seconds`` as the calibration of ``task``'s compute when it is the fastest so far."""
    path = CACHE / "calibration.json"
    stored = json.loads(path.read_text()) if path.exists() else {}
    key = _calibration_key(task)
    if key not in stored or seconds < stored[key]:
        stored[key] = seconds
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(stored, indent=1, sort_keys=True))


def round_compute_seconds(
    results: Mapping[str, Mapping[str, Any]], dense: Mapping[str, Any], stored: float | None = None
) -> tuple[float, str]:
    """One client round's compute, charged to every arm of a table, and where it comes from: the
    fastest CPU-time calibration among the table's runs and ``stored`` (the experiment's fastest
    for the same steps and batch; all arms do the same compute), or, when there is none, the
    median over the dense run's rounds of its slowest client's wall time."""
    calibrated = [float(r["round_compute_cpu_s"]) for r in results.values() if r.get("round_compute_cpu_s") is not None]
    if stored is not None:
        calibrated.append(stored)
    if calibrated:
        return min(calibrated), "calibrated: CPU seconds of one client round"
    return statistics.median(
        h["compute_s"] for h in dense["history"] if h["round"] >= 1
    ), "the dense run's median round"


def emulated_seconds(result: Mapping[str, Any], upto: int, mbps: float, compute_s: float) -> float:
    """Rounds 1..upto: ``compute_s`` + the measured codec time + the most bytes one client moved
    over a ``mbps`` link."""
    out = 0.0
    for h in result["history"]:
        if 1 <= h["round"] <= upto:
            out += compute_s + h["codec_s"] + h["max_client_bytes"] * 8 / (mbps * 1e6)
    return out


def table(
    results: Mapping[str, Mapping[str, Any]],
    rounds: tuple[int, ...],
    mbps: float = 10.0,
    calibration: float | None = None,
) -> str:
    """Markdown: accuracy at ``rounds``, total bytes, ratio to dense, time to dense's target."""
    dense = results.get("dense")
    last = max(rounds)
    target_round = 30 if 30 in rounds else last
    target = None
    if dense is not None and accuracy_at(dense, target_round) is not None:
        target = float(accuracy_at(dense, target_round)) - 0.01  # type: ignore[arg-type]
    head = "| setting | " + " | ".join(f"acc r{r}" for r in rounds) + " | total MB | bytes vs dense |"
    head += f" round reaching {target:.4f} | emulated time to it at {mbps:g} Mbit/s vs dense |" if target else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    d_time = None
    compute_s, src = round_compute_seconds(results, dense, calibration) if dense is not None else (0.0, "")
    if dense is not None and target is not None:
        r = first_round_reaching(dense, target)
        d_time = emulated_seconds(dense, r, mbps, compute_s) if r is not None else None
    for name, res in results.items():
        accs = [accuracy_at(res, r) for r in rounds]
        cells = [f"{a:.4f}" if a is not None else "–" for a in accs]
        mb = total_bytes(res) / 1e6
        ratio = total_bytes(dense) / total_bytes(res) if dense is not None else math.nan
        row = f"| {name} | " + " | ".join(cells) + f" | {mb:.2f} | x{ratio:.1f} |"
        if target is not None:
            r = first_round_reaching(res, target)
            speed = "–"
            if r is not None and d_time:
                speed = f"x{d_time / emulated_seconds(res, r, mbps, compute_s):.1f}"
            row += f" {r if r is not None else 'not reached'} | {speed} |"
        lines.append(row)
    if dense is not None and target is not None:
        lines.append(f"\nEmulated time charges every arm {compute_s:.3f} s of compute per round ({src}).")
    return "\n".join(lines)


def stale_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Markdown: per setting, the residuals' age at use and their norm against the fresh update."""
    head = (
        "| setting | uses | age median (max) | ‖residual‖ / ‖fresh update‖: median | p90 "
        "| age 1-5 | age 6-15 | age > 15 |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, res in results.items():
        uses = res.get("residual_uses") or []
        uses = [u for u in uses if u[4] > 0]
        if not uses:
            continue
        ages = [int(u[2]) for u in uses]
        ratios = sorted(u[3] / u[4] for u in uses)

        def bucket(lo: int, hi: float, uses: list[list[float]] = uses) -> str:
            sel = [u[3] / u[4] for u in uses if lo <= u[2] <= hi]
            return f"{statistics.median(sel):.2f} (n={len(sel)})" if sel else "–"

        lines.append(
            f"| {name} | {len(uses)} | {statistics.median(ages):g} ({max(ages)}) | {statistics.median(ratios):.2f} "
            f"| {ratios[int(0.9 * (len(ratios) - 1))]:.2f} | {bucket(1, 5)} | {bucket(6, 15)} | {bucket(16, math.inf)} |"
        )
    return "\n".join(lines) if len(lines) > 2 else ""


def plot(groups: Mapping[str, Mapping[str, Mapping[str, Any]]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (title, results) in zip(axes[0], groups.items(), strict=True):
        for name, res in results.items():
            pts = []
            total = 0
            for h in res["history"]:
                total += h["uplink_bytes"] + h["downlink_bytes"]
                if h["accuracy"] is not None and h["round"] > 0:
                    pts.append((total / 1e6, h["accuracy"]))
            ax.plot(*zip(*pts, strict=True), marker=".", label=name)
        ax.set_xscale("log")
        ax.set_ylim(0.8, 1.0)
        ax.set_xlabel("total bytes, both directions, initial model included (MB)")
        ax.set_ylabel("test accuracy")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def extra_setting(keys: Mapping[str, Any]) -> dict[str, Any]:
    """An ``--extra`` setting's run config: ``keys`` over the reference app's defaults, so that
    ``{"sbc-p": 0.1}`` differs from ``default`` in that key alone (it was taken alone before, and
    ran the library's defaults: 3LC down, the initial model sent in round 1)."""
    return {**APP_COMPRESSION_DEFAULTS, **keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="6 rounds, dense and the default setting only")
    ap.add_argument("--only", default="", help=f"comma-separated settings (known: {', '.join(SETTINGS)})")
    ap.add_argument("--partition", choices=["iid", "dirichlet", "both"], default="both")
    ap.add_argument("--participation", choices=["full", "sampled", "both"], default="full",
                    help="full: 10 clients, all train; sampled: 100 clients, 10 per round")  # fmt: skip
    ap.add_argument(
        "--rounds", type=int_at_least(0), default=0, help="0 = the default: 60 (Dirichlet), 25 (IID), 30 (sampled)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--inner",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"server strategy under both arms: {', '.join(INNER)}, with parameters e.g. "
        "'fedavgm:server-lr=1,momentum=0.9' or 'fedadam:eta=0.01' (repeatable; default fedavg)",
    )
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="an ad-hoc setting: a name and a JSON object of run-config keys over the reference app's "
        "defaults (the 'default' setting), e.g. 's2={\"sbc-p\": 0.02}' (repeatable; run it with "
        "--only NAME or alone)",
    )
    ap.add_argument("--data-dir", default=None, help="folder holding mnist/ (default: $FEDCOMP_DATA_DIR)")
    ap.add_argument("--refresh", action="store_true", help="rerun even when cached")
    ap.add_argument("--cached-only", action="store_true", help="report only settings already run; run nothing")
    ap.add_argument("--write-docs", action="store_true", help="write the tables and plot into docs/")
    args = ap.parse_args(argv)
    settings = dict(SETTINGS)
    extra_names = []
    for item in args.extra:
        name, sep, blob = item.partition("=")
        try:
            value = json.loads(blob) if sep else None
        except json.JSONDecodeError as err:
            value, blob = None, f"{blob!r} ({err.msg})"
        if not name or name in SETTINGS or not isinstance(value, dict):
            print(
                f"error: --extra {item!r}: expected NEW_NAME=JSON_OBJECT, e.g. 's2={{\"sbc-p\": 0.02}}'",
                file=sys.stderr,
            )
            return 2
        settings[name] = extra_setting(value)
        extra_names.append(name)
    names = [n for n in args.only.split(",") if n] or (
        ["dense", "default"] if args.quick else (["dense", *extra_names] if extra_names else list(SETTINGS))
    )
    try:
        inners = [inner_label(spec) for spec in args.inner] or ["fedavg"]
    except ValueError as err:
        ap.error(str(err))  # exits 2, as argparse does for its own checks
    unknown = [n for n in names if n not in settings]
    if unknown:
        print(f"error: --only: unknown setting(s) {unknown}; known: {list(settings)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # Flower's per-round INFO lines
    if not args.cached_only and stored_calibration(Task("", None, seed=args.seed)) is None:
        try:  # one round's compute for the emulated time, measured before any run (seconds of CPU)
            data = load_partition("mnist", 0, 10, scheme="iid", seed=args.seed, data_dir=args.data_dir)
            task0 = Task("", None, seed=args.seed)
            with torch.random.fork_rng(devices=[]):
                record_calibration(task0, calibrate_round_compute(task0, data))
        except DataError:
            pass  # reported below when a run needs the data; tables then use the dense run's times
    partitions = ["iid", "dirichlet"] if args.partition == "both" else [args.partition]
    modes = ["full", "sampled"] if args.participation == "both" else [args.participation]
    groups: dict[str, dict[str, dict[str, Any]]] = {}
    out = []
    for mode, part, inner in ((m, p, i) for m in modes for p in partitions for i in inners):
        clients, per_round = (10, 10) if mode == "full" else (100, 10)
        rounds = args.rounds or (
            6 if args.quick else (30 if mode == "sampled" else (60 if part == "dirichlet" else 25))
        )
        title = f"MNIST {part}{' (Dirichlet 0.3)' if part == 'dirichlet' else ''}, {per_round} of {clients} clients per round"
        if inner != "fedavg":
            title += f", server {inner}"
        results = {}
        for name in names:
            task = Task(name, settings[name], part, 0.3, clients, per_round, rounds, seed=args.seed, inner=inner)
            if args.cached_only:
                hit = cached(task)
                if hit is not None:
                    results[name] = hit
                continue
            print(f"{title}: {name}", flush=True)
            try:
                results[name] = cached_run(task, args.data_dir, args.refresh)
            except DataError as err:
                reason = str(err)
                if not (args.data_dir or os.environ.get("FEDCOMP_DATA_DIR")):  # err names the app's key
                    reason = "no data folder: set FEDCOMP_DATA_DIR or pass --data-dir (the folder holding mnist/)"
                print(f"error: {reason}", file=sys.stderr)
                return 2
        if not results:
            continue
        groups[title] = results
        shown = tuple(r for r in (1, 5, 10, 25, 30, 45, 60) if r <= rounds)
        calibration = stored_calibration(Task("", None, seed=args.seed))
        out.append(f"### {title}, {rounds} rounds\n\n{table(results, shown, calibration=calibration)}\n")
        if mode == "sampled" and (stale := stale_table(results)):
            out.append(f"Residuals at use (rounds since the client last sent; norms before use):\n\n{stale}\n")
    if not groups:  # (--cached-only, nothing cached yet: no table, no plot, docs left alone)
        print(f"error: nothing cached for {', '.join(names)} here: run without --cached-only", file=sys.stderr)
        return 1
    text = "\n".join(out)
    print("\n" + text)
    fig = plot(groups, CACHE / "accuracy_vs_bytes.png")
    print(f"plot: {fig}")
    if args.write_docs:
        figures = HERE.parent / "docs" / "figures"
        figures.mkdir(parents=True, exist_ok=True)
        (figures / "compression_gap.png").write_bytes(fig.read_bytes())
        (HERE.parent / "docs" / "compression_gap.md").write_text(
            "# What compression costs the model\n\n`python examples/compression_gap.py"
            + (f" --participation {args.participation}" if args.participation != "full" else "")
            + "".join(f" --inner {i}" for i in inners if len(inners) > 1 or i != "fedavg")
            + "` (see its docstring for the setup).\n\n"
            + text
            + "\n![accuracy vs bytes](figures/compression_gap.png)\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
