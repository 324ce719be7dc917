"""An in-process federated simulator that follows SBC's procedure step by step, with real bytes.

Flower runs cost seconds of messaging per round; the SBC paper's MNIST row needs up to 2,000
one-iteration rounds, which is hours through Flower on two cores. This module runs the same
protocol in one process, with the library's codecs and wire format doing all the compression:

per round, for each client i (papers/README.md, "SBC, restated"):

1. ``W_i <- W`` (the client's model parameters are overwritten with the global weights);
2. ``n`` local iterations (``n`` = communication delay) of Adam, lr 0.001, batch 128, on client
   i's IID shard;
3. ``dW_i = W_i - W`` per tensor;
4. residual accumulation and SBC per tensor: ``fedcomp.methods.update.UpdateEncoder`` with an
   ``SBC(p)`` codec and error feedback (``fedcomp.methods.feedback.ErrorFeedback``: A = R + dW,
   send SBC(A), R <- A - SBC(A));
5. the update goes to bytes with ``fedcomp.wire.serde.update_to_bytes`` -- those bytes are what the
   uplink counts -- and the server parses them back (``update_from_bytes``, ``decode_update``);

then the server averages the decoded updates and adds the mean to W.

Downlink. By default clients get the exact new W (``downlink="exact"``; counted as dense fp32).
``downlink="3lc"`` puts fedcomp's server replica in the loop instead
(``fedcomp.flower.replica.ServerReplica``, the object the Flower strategy uses): clients train from
the replica R, each round the server sends 3LC(W - R), and client updates are applied to W, as
``CompressionStrategy`` does. Independently of that, ``observers`` run one ``ServerReplica`` each
beside the training (3LC at a given s, zero-run on/off): they compress every model change the
server makes, with the server's error accumulation, and count the bytes, without feeding their
lossy replica back to the clients. That is how the 3LC table's bits per value are measured on the
model deltas of our runs.

Choices where the paper is silent (also in docs/RESULTS.md):

* Each client keeps its Adam state across rounds (``optimizer_state="persistent"``): SBC trains
  with local optimizers, and with delay 1 a fresh Adam per round would make every step
  ``lr * sign(g)`` (Adam's first bias-corrected step), not Adam. ``"fresh"`` (a new optimizer per
  round, what ``fedcomp.app.models.train_local`` and the Flower app do) is available.
* Every tensor is SBC-compressed, biases included (``min_numel=0``): the paper compresses "the
  weight-update", all of it; the library's default (tensors under 1,000 values go dense fp32) is
  a config field.
* SBC's exact selection (``sbc_mode="exact"``: Algorithm 2's true top-k), not the subsampled one.
* Momentum masking (zeroing the optimizer's first moment where an update was sent) is off by
  default (``momentum_masking``): the paper's main text says it is adopted, its supplement says
  momentum *correction* is; with Adam it is not defined by the paper.
* Temporal sparsity only ("Federated Averaging (delay only)") is ``uplink="dense-fp32"`` with a
  delay: uncompressed deltas every ``delay`` iterations, no residual.

Everything is deterministic for a config on one machine (seeded model init, partitions, batches).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fedcomp.app.data import load_dataset, load_partition
from fedcomp.app.models import LeNet5Caffe, evaluate
from fedcomp.bench import int_at_least
from fedcomp.codecs import SBC, DenseFP32, ThreeLC
from fedcomp.methods.update import UpdateEncoder, decode_update, specs_of
from fedcomp.wire import serde
from fedcomp.wire.payloads import (
    DensePayload,
    EncodedUpdate,
    SBCPayload,
    ThreeLCPayload,
)

#: Part of every config hash: bump it when a change to this file changes the results of existing
#: configs (recording something new, like the replica's accuracy in 3LC mode, does not).
SIM_VERSION = 1

#: Where runs go unless --out says otherwise (gitignored).
DEFAULT_RESULTS = Path("results") / "examples"


# --- configuration ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Observer:
    """A 3LC downlink measured beside the training (it does not change what clients receive)."""

    s: float = 1.0
    zero_run: bool = True
    min_numel: int = 0

    @property
    def key(self) -> str:
        zr = "" if self.zero_run else "-nozre"
        mn = "" if self.min_numel == 0 else f"-min{self.min_numel}"
        return f"3lc-s{self.s:g}{zr}{mn}"


#: The 3LC paper's Table 2 settings: s = 1.00, 1.50, 1.75, 1.90 with zero-run encoding, and
#: s = 1.00 without it; plus s = 1 with the library's default of dense small tensors.
TABLE2_OBSERVERS: tuple[Observer, ...] = (
    Observer(1.0, False),
    Observer(1.0),
    Observer(1.5),
    Observer(1.75),
    Observer(1.9),
    Observer(1.0, True, 1000),
)


@dataclass(frozen=True)
class SimConfig:
    """One simulated run. ``label`` names it in tables and plots and is not part of the hash."""

    label: str = "run"
    dataset: str = "mnist"
    num_clients: int = 4
    partitioning: str = "iid"
    iterations: int = 2000  # local iterations (forward-backward passes) per client, whole run
    delay: int = 1  # local iterations per round (temporal sparsity)
    uplink: str = "sbc"  # "sbc" | "dense-fp32"
    p: float = 0.01  # SBC: fraction kept per side (gradient sparsity)
    sbc_mode: str = "exact"
    min_numel: int = 0  # uplink tensors smaller than this go dense fp32
    error_feedback: bool = True
    lr: float = 0.001
    batch_size: int = 128
    optimizer_state: str = "persistent"  # "persistent" | "fresh"
    momentum_masking: bool = False
    downlink: str = "exact"  # "exact" (clients get W; counted dense fp32) | "3lc" (in the loop)
    downlink_s: float = 1.0
    downlink_min_numel: int = 0
    observers: tuple[Observer, ...] = ()
    eval_every: int = 100  # iterations (rounded up to whole rounds); the end is always evaluated
    test_limit: int = 0  # 0: the whole test set
    seed: int = 0

    def __post_init__(self) -> None:
        if self.iterations < 1 or self.delay < 1:
            raise ValueError("iterations and delay must be >= 1")
        if self.iterations % self.delay:
            raise ValueError(f"{self.label}: iterations {self.iterations} is not a multiple of delay {self.delay}")
        if self.uplink not in ("sbc", "dense-fp32"):
            raise ValueError(f"uplink: {self.uplink!r}")
        if self.downlink not in ("exact", "3lc"):
            raise ValueError(f"downlink: {self.downlink!r}")
        if self.optimizer_state not in ("persistent", "fresh"):
            raise ValueError(f"optimizer_state: {self.optimizer_state!r}")

    @property
    def rounds(self) -> int:
        return self.iterations // self.delay

    def key(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("label")
        d["observers"] = [asdict(o) for o in self.observers]
        d["sim_version"] = SIM_VERSION
        return d

    def hash(self) -> str:
        text = json.dumps(self.key(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]


def scaled(cfg: SimConfig, iterations: int, **changes: Any) -> SimConfig:
    """``cfg`` shortened to ``iterations`` (delays above it are cut to it, so every config still
    runs at least one round); for --quick and --smoke modes."""
    delay = min(cfg.delay, iterations)
    while iterations % delay:
        delay -= 1
    return replace(cfg, iterations=iterations, delay=delay, **changes)


# --- wire accounting ----------------------------------------------------------------------------


def payload_bits(update: EncodedUpdate) -> int:
    """The paper's accounting: position bits plus one 32-bit mean per SBC tensor, 3LC bytes plus
    one 32-bit scale, dense values; no names, shapes or protobuf framing."""
    bits = 0
    for t in update.tensors:
        p = t.payload
        if isinstance(p, SBCPayload):
            bits += 8 * len(p.bits) + 32
        elif isinstance(p, ThreeLCPayload):
            bits += 8 * len(p.data) + 32
        elif isinstance(p, DensePayload):
            bits += 8 * len(p.data)
        else:  # pragma: no cover
            raise TypeError(type(p).__name__)
    return bits


# --- clients ------------------------------------------------------------------------------------


def _batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, gen: torch.Generator) -> Iterator:
    """Endless shuffled minibatches; a new permutation each epoch, ragged last batch dropped.
    Persistent across rounds, so a client walks through its shard epoch after epoch."""
    n = len(y)
    bs = min(batch_size, n)
    while True:
        perm = torch.randperm(n, generator=gen)
        for start in range(0, n - bs + 1, bs):
            idx = perm[start : start + bs]
            yield x[idx], y[idx]


class Client:
    def __init__(self, idx: int, x: torch.Tensor, y: torch.Tensor, init: dict[str, torch.Tensor], cfg: SimConfig):
        self.cfg = cfg
        self.model = LeNet5Caffe()
        self.model.load_state_dict(init)
        self.params = dict(self.model.named_parameters())
        self.opt = self._new_opt()
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 7919 * (idx + 1))
        self.batches = _batches(x, y, cfg.batch_size, gen)
        codec = SBC(p=cfg.p, mode=cfg.sbc_mode) if cfg.uplink == "sbc" else DenseFP32()
        self.codec = codec
        self.encoder = UpdateEncoder(
            codec, min_numel=cfg.min_numel, error_feedback=cfg.error_feedback and cfg.uplink == "sbc"
        )

    def _new_opt(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.model.parameters(), lr=self.cfg.lr)

    def round(self, start: dict[str, torch.Tensor], version: int) -> tuple[bytes, int, float, float, float]:
        """Train ``delay`` steps from ``start``; return (wire bytes, payload bits, mean loss,
        train seconds, encode seconds)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(start[name])
        if self.cfg.optimizer_state == "fresh":
            self.opt = self._new_opt()
        self.model.train()
        total = 0.0
        for _ in range(self.cfg.delay):
            xb, yb = next(self.batches)
            self.opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(self.model(xb), yb)
            loss.backward()
            self.opt.step()
            total += float(loss.detach())
        t1 = time.perf_counter()
        with torch.no_grad():
            dw = {name: p.detach() - start[name] for name, p in self.params.items()}
        update = self.encoder.encode(dw, base_model_version=version)
        data = serde.update_to_bytes(update)
        bits = payload_bits(update)
        if self.cfg.momentum_masking:
            self._mask_momentum(update)
        return data, bits, total / self.cfg.delay, t1 - t0, time.perf_counter() - t1

    def _mask_momentum(self, update: EncodedUpdate) -> None:
        sent = decode_update(update, specs_of(self.params), [self.codec, DenseFP32()])
        for name, p in self.params.items():
            state = self.opt.state.get(p)
            if state and "exp_avg" in state:
                state["exp_avg"][sent[name] != 0] = 0.0


# --- the simulation -----------------------------------------------------------------------------

Progress = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _fmt_s(s: float) -> str:
    s = round(s)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def simulate(cfg: SimConfig, progress: Progress | None = _stderr) -> dict[str, Any]:
    """Run ``cfg`` and return its results (JSON-safe)."""
    from fedcomp.flower.replica import (
        ServerReplica,  # the server's own replica and 3LC logic
    )

    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    ds = load_dataset(cfg.dataset)
    test_x, test_y = ds.test.x, ds.test.y
    if cfg.test_limit:
        test_x, test_y = test_x[: cfg.test_limit], test_y[: cfg.test_limit]
    global_model = LeNet5Caffe()
    W = {k: v.detach().clone() for k, v in global_model.state_dict().items()}
    names = list(W)
    specs = specs_of(W)
    numel = sum(t.numel() for t in W.values())
    clients = []
    for i in range(cfg.num_clients):
        part = load_partition(cfg.dataset, i, cfg.num_clients, scheme=cfg.partitioning, seed=cfg.seed)
        clients.append(Client(i, part.x, part.y, W, cfg))
    uplink_codecs = [clients[0].codec, DenseFP32()]

    # the downlink: exact W (dense fp32 deltas) or fedcomp's server replica with 3LC in the loop
    replica = None
    if cfg.downlink == "3lc":
        replica = ServerReplica(W, 1, cfg.downlink_min_numel)
        downlink_codec = ThreeLC(cfg.downlink_s)
    dense_enc = UpdateEncoder(DenseFP32(), min_numel=0, error_feedback=False)
    dense_delta_bytes = len(serde.update_to_bytes(dense_enc.encode(W)))
    observers = [(o, ServerReplica(W, 1, o.min_numel), ThreeLC(o.s, o.zero_run)) for o in cfg.observers]
    obs_stats: dict[str, dict[str, list[int]]] = {o.key: {"bytes": [], "payload_bits": []} for o, _, _ in observers}

    eval_rounds = max(1, math.ceil(cfg.eval_every / cfg.delay))
    history: list[dict[str, Any]] = []
    up_bytes_round: list[float] = []  # mean per client, per round
    down_bytes_round: list[int] = []  # per client, per round
    up_bytes = up_bits = down_bytes = 0
    t_train = t_encode = t_server = t_eval = 0.0
    losses: list[float] = []

    def record(rnd: int) -> None:
        nonlocal t_eval
        t0 = time.perf_counter()
        global_model.load_state_dict(W)
        loss, acc = evaluate(global_model, test_x, test_y)
        extra = {}
        if replica is not None:  # the model the clients hold and train from
            global_model.load_state_dict(replica.tensors)
            r_loss, r_acc = evaluate(global_model, test_x, test_y)
            extra = {
                "replica_acc": r_acc,
                "replica_loss": r_loss,
                "replica_gap_l2": math.sqrt(sum(float(((W[k] - replica.tensors[k]) ** 2).sum()) for k in names)),
            }
        t_eval += time.perf_counter() - t0
        history.append(
            {
                "round": rnd,
                "iteration": rnd * cfg.delay,
                "test_acc": acc,
                "test_loss": loss,
                **extra,
                "train_loss": sum(losses) / len(losses) if losses else None,
                "uplink_bytes": up_bytes,  # all clients together, cumulative
                "uplink_payload_bits": up_bits,
                "downlink_bytes": down_bytes,  # per client, cumulative
                "elapsed_s": time.perf_counter() - t_start,
            }
        )
        losses.clear()

    record(0)
    for rnd in range(1, cfg.rounds + 1):
        start = replica.tensors if replica is not None else W
        payloads = []
        for c in clients:
            data, bits, loss, tt, te = c.round(start, rnd - 1)
            payloads.append(data)
            up_bits += bits
            losses.append(loss)
            t_train += tt
            t_encode += te
        t0 = time.perf_counter()
        up_bytes += sum(len(b) for b in payloads)
        up_bytes_round.append(sum(len(b) for b in payloads) / len(payloads))
        # the server: parse and decode every update, average, apply to W
        decoded = [decode_update(serde.update_from_bytes(b), specs, uplink_codecs) for b in payloads]
        for name in names:
            W[name] = W[name] + torch.stack([d[name] for d in decoded]).mean(0)
        # what the clients receive
        sent = len(replica.advance(W, downlink_codec)) if replica is not None else dense_delta_bytes
        down_bytes += sent
        down_bytes_round.append(sent)
        for o, rep, codec in observers:
            data = rep.advance(W, codec)
            obs_stats[o.key]["bytes"].append(len(data))
            obs_stats[o.key]["payload_bits"].append(payload_bits(serde.update_from_bytes(data)))
        t_server += time.perf_counter() - t0
        if rnd % eval_rounds == 0 or rnd == cfg.rounds:
            record(rnd)
            if progress is not None:
                h = history[-1]
                done = rnd / cfg.rounds
                elapsed = time.perf_counter() - t_start
                dense = rnd * cfg.delay * cfg.num_clients * numel * 32
                replica_acc = f"replica acc {h['replica_acc']:.4f} " if "replica_acc" in h else ""
                progress(
                    f"[{cfg.label}] it {rnd * cfg.delay}/{cfg.iterations} (round {rnd}/{cfg.rounds}) "
                    f"acc {h['test_acc']:.4f} loss {h['test_loss']:.4f} {replica_acc}"
                    f"up x{dense / (8 * up_bytes):.0f} | {_fmt_s(elapsed)} elapsed, "
                    f"ETA {_fmt_s(elapsed * (1 - done) / done)}"
                )

    dense_bits = cfg.iterations * cfg.num_clients * numel * 32
    final = history[-1]
    result = {
        "label": cfg.label,
        "config": cfg.key(),
        "config_hash": cfg.hash(),
        "numel": numel,
        "final_acc": final["test_acc"],
        "final_loss": final["test_loss"],
        "rounds": cfg.rounds,
        "uplink": {
            "wire_bytes": up_bytes,
            "payload_bits": up_bits,
            "dense_fp32_bits": dense_bits,  # every client, every iteration, dense: the baseline
            "compression_wire": dense_bits / (8 * up_bytes),
            "compression_payload": dense_bits / up_bits,
            "bytes_per_round_per_client": up_bytes_round,
        },
        "downlink": {
            "mode": cfg.downlink,
            "wire_bytes_per_client": down_bytes,
            "bytes_per_round": down_bytes_round,
            "bits_per_value": 8 * down_bytes / (cfg.rounds * numel),
        },
        "observers": {
            key: {
                "wire_bytes": sum(v["bytes"]),
                "payload_bits": sum(v["payload_bits"]),
                "bits_per_value_wire": 8 * sum(v["bytes"]) / (cfg.rounds * numel),
                "bits_per_value_payload": sum(v["payload_bits"]) / (cfg.rounds * numel),
                "bytes_per_round": v["bytes"],
            }
            for key, v in obs_stats.items()
        },
        "history": history,
        "timing_s": {
            "total": time.perf_counter() - t_start,
            "train": t_train,
            "uplink_encode": t_encode,
            "server": t_server,
            "eval": t_eval,
        },
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
    }
    return result


# --- caching and running many configs -----------------------------------------------------------


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-").lower() or "run"


def cache_path(cfg: SimConfig, out: Path) -> Path:
    return out / "runs" / f"{_slug(cfg.label)}-{cfg.hash()}.json"


def find_cached(cfg: SimConfig, dirs: Iterable[Path]) -> Path | None:
    h = cfg.hash()
    for d in dirs:
        hits = sorted((Path(d) / "runs").glob(f"*-{h}.json")) if (Path(d) / "runs").is_dir() else []
        if hits:
            return hits[0]
    return None


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def run_cached(cfg: SimConfig, out: Path, also: Sequence[Path] = (), force: bool = False) -> dict[str, Any]:
    """``cfg``'s results from ``out/runs`` (or from another folder in ``also``, then copied), or a
    fresh run written there."""
    path = cache_path(cfg, out)
    if not force:
        hit = find_cached(cfg, [out, *also])
        if hit is not None:
            result = json.loads(hit.read_text())
            result["label"] = cfg.label
            if hit.parent != path.parent:
                _write_json(path, result)
            _stderr(f"[{cfg.label}] cached: {hit}")
            return result
    _stderr(
        f"[{cfg.label}] running: {cfg.iterations} iterations, delay {cfg.delay}, {cfg.rounds} rounds, "
        f"uplink {cfg.uplink}{f' p={cfg.p:g}' if cfg.uplink == 'sbc' else ''} (hash {cfg.hash()})"
    )
    result = simulate(cfg)
    _write_json(path, result)
    _stderr(f"[{cfg.label}] done in {_fmt_s(result['timing_s']['total'])}: acc {result['final_acc']:.4f} -> {path}")
    return result


def _worker(args: tuple[SimConfig, str, tuple[str, ...], bool]) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg, out, also, force = args
    return run_cached(cfg, Path(out), [Path(a) for a in also], force)


def run_all(
    configs: Sequence[SimConfig], out: Path, also: Sequence[Path] = (), force: bool = False, jobs: int = 1
) -> list[dict[str, Any]]:
    """Run (or load) every config; ``jobs > 1`` runs that many at once, one thread each."""
    torch.set_num_threads(1)
    args = [(c, str(out), tuple(str(a) for a in also), force) for c in configs]
    if jobs <= 1 or len(configs) <= 1:
        return [_worker(a) for a in args]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(_worker, args))


# --- command-line helpers shared by the example scripts ----------------------------------------


def common_args(parser: Any, default_out: Path) -> None:
    parser.add_argument("--out", type=Path, default=default_out, help=f"run folder (default: {default_out})")
    parser.add_argument("--quick", action="store_true", help="200 iterations per config (timing, smoke)")
    parser.add_argument("--smoke", action="store_true", help="a few iterations on a test subset (tests)")
    parser.add_argument("--iterations", type=int_at_least(1), default=None, help="override the iterations per config")
    parser.add_argument(
        "--jobs", type=int_at_least(1), default=1, help="configs run at once, one thread each (default 1)"
    )
    parser.add_argument("--force", action="store_true", help="rerun even when a cached result exists")
    parser.add_argument("--no-plots", action="store_true")


def apply_mode(configs: Sequence[SimConfig], args: Any) -> list[SimConfig]:
    """--smoke / --quick / --iterations applied to the full-size configs."""
    if args.smoke:
        return [scaled(c, args.iterations or 2, batch_size=16, test_limit=200, eval_every=1) for c in configs]
    if args.quick or args.iterations:
        its = args.iterations or 200
        return [scaled(c, its, eval_every=max(1, min(c.eval_every, its // 4))) for c in configs]
    return list(configs)


def check_data(dataset: str = "mnist") -> None:
    """Exit 2 (a usage error, as for a bad option) with a clear message when the dataset cannot
    be found."""
    from fedcomp.app.data import DataError

    folder = os.environ.get("FEDCOMP_DATA_DIR", "")
    if not folder:
        print(
            f"error: FEDCOMP_DATA_DIR is not set: set it to the folder holding {dataset}/ (e.g. /work/shared/data)",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        load_dataset(dataset, folder)
    except DataError as err:
        print(f"error: {err} (FEDCOMP_DATA_DIR={folder})", file=sys.stderr)
        sys.exit(2)


def write_summary(out: Path, name: str, rows: list[dict[str, Any]], text: str) -> None:
    """``out/<name>.json`` (the table's rows) and ``out/<name>.md`` (the printed table)."""
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / f"{name}.json", rows)
    (out / f"{name}.md").write_text(text + "\n")


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *[line(r) for r in cells[1:]]])


__all__ = [
    "SIM_VERSION",
    "TABLE2_OBSERVERS",
    "Observer",
    "SimConfig",
    "md_table",
    "payload_bits",
    "run_all",
    "run_cached",
    "scaled",
    "simulate",
]


def publish_figures(figs: Sequence[Path], figures_to: Path | None) -> None:
    """Copy the plots to ``figures_to`` (``--figures-to``, e.g. docs/figures) and list them."""
    if figures_to:
        figures_to.mkdir(parents=True, exist_ok=True)
        for f in figs:
            shutil.copy(f, figures_to / f.name)
    print("\nplots: " + ", ".join(str(f) for f in figs))


if __name__ == "__main__":  # (a module of the examples: run as a script it did nothing, silently)
    import sys as _sys

    _sys.exit(
        f"{__file__.rsplit('/', 1)[-1]} is a module of the example scripts, not a command: run "
        "examples/sbc_table2.py, examples/sparsity_grid.py or examples/threelc_table2.py (each takes --help)"
    )
