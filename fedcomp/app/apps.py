"""The reference app's server and client logic (LeNet5-Caffe on digits / MNIST / Fashion-MNIST).

``server_app/app.py`` and ``client_app/app.py`` are thin shells around :func:`server_main` and
:func:`client_train`; test apps reuse them with another inner strategy. With ``compress = true``
(the default) the inner FedAvg is wrapped in :class:`CompressionStrategy` and the ClientApp carries
:func:`compression_mod`; with ``compress = false`` the same app is plain FedAvg, the baseline.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.app.message_type import MessageType
from flwr.serverapp import Grid, RdpAccountant
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
    Strategy,
)
from flwr.supercore.privacy_accounting import NeighboringRelation, PrivacyConfig, SamplingMethod
from torch import nn

from fedcomp.app.checkpoint import CHECKPOINT_FILE, ServerCheckpoint, load_checkpoint, save_checkpoint
from fedcomp.app.config import AppConfig
from fedcomp.app.data import load_dataset, load_partition
from fedcomp.app.fl import (
    MeteredGrid,
    arrayrecord_nbytes,
    centralized_evaluate_fn,
    recording_train_metrics_aggr,
    wait_for_nodes,
)
from fedcomp.app.models import model_for, resolve_device, train_local
from fedcomp.app.results import RESULTS_FILE, RunRecorder, record_failure
from fedcomp.errors import ConfigError, NoProgressError
from fedcomp.flower import protocol
from fedcomp.flower.clipping import clipping_norm_of
from fedcomp.flower.records import digest, not_finite_and_norm, tensors_from_record
from fedcomp.flower.sampling import SeededSampling
from fedcomp.flower.strategy import CompressionStrategy
from fedcomp.flower.traffic import by_reason

log = logging.getLogger("flwr").getChild("fedcomp")

#: Builds the inner strategy from the validated config (FedAvg by default).
InnerFactory = Callable[[AppConfig, Callable], Strategy]


def default_inner(cfg: AppConfig, train_metrics_aggr_fn: Callable) -> Strategy:
    n = cfg.clients_per_round
    return FedAvg(
        fraction_train=1.0 if n == 0 else 1e-9,  # n > 0: exactly min_train_nodes = n
        fraction_evaluate=0.0,  # centralized evaluation only
        min_train_nodes=max(n, 1),
        min_available_nodes=max(n, 1),
        train_metrics_aggr_fn=train_metrics_aggr_fn,
    )


def with_central_dp(strategy: Strategy, cfg: AppConfig, sampled: int, population: int) -> Strategy:
    """``strategy`` inside Flower's central-DP wrapper with fixed clipping that ``dp-clipping``
    names, calibrated for ``sampled`` clients a round. With noise, Flower's RDP accountant counts
    each round's release over ``population`` clients (no amplification by sampling: a fixed number
    sampled, as Flower's fixed-clipping accounting requires) and the wrapper then refuses a round
    whose replies are not all there. The noise comes from NumPy's global generator, which the
    run's ``seed`` does not set: a noise anyone could replay would protect nothing."""
    accountant = None
    if cfg.dp_noise_multiplier > 0:
        accountant = RdpAccountant(
            PrivacyConfig(
                target_delta=cfg.dp_delta,
                population_size=population,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                sampling_method=SamplingMethod.NO_AMPLIFICATION,
            )
        )
    dp = (
        DifferentialPrivacyClientSideFixedClipping
        if cfg.dp_clipping == "client"
        else DifferentialPrivacyServerSideFixedClipping
    )
    return dp(
        strategy,
        noise_multiplier=cfg.dp_noise_multiplier,
        clipping_norm=cfg.dp_clipping_norm,
        num_sampled_clients=sampled,
        accountant=accountant,
    )


def privacy_spent(strategy: Strategy | None) -> dict[str, Any]:
    """``dp_epsilon`` and ``dp_delta`` spent so far by a DP wrapper with an accountant (else {})."""
    spent = strategy.privacy_spent() if isinstance(strategy, _DP_WRAPPERS) else None
    return {"dp_epsilon": spent.epsilon, "dp_delta": spent.delta} if spent is not None else {}


_DP_WRAPPERS = (DifferentialPrivacyClientSideFixedClipping, DifferentialPrivacyServerSideFixedClipping)


class _WatchedGrid(MeteredGrid):
    """A :class:`MeteredGrid` that also keeps, per round, how many train replies came back
    without an error and why the others failed (``Message.error``: the ClientApp's exception)."""

    def __init__(self, grid: Grid, recorder: RunRecorder, dense_nbytes: int) -> None:
        super().__init__(grid, recorder, dense_nbytes=dense_nbytes)
        self.ok_replies = 0
        self.errors: dict[str, str] = {}

    def _in(self, replies: Iterable[Message]) -> list[Message]:
        replies = super()._in(replies)
        for m in replies:
            if m.metadata.message_type != MessageType.TRAIN:  # evaluate replies carry no update
                continue
            if m.has_error():
                self.errors[str(m.metadata.src_node_id)] = (
                    f"code {m.error.code}: {client_error_text(m.error.reason or '')}"
                )
            else:
                self.ok_replies += 1
        return replies

    def take_round(self) -> tuple[int, dict[str, str]]:
        """This round's (replies without error, errors by node id); resets both."""
        out = (self.ok_replies, self.errors)
        self.ok_replies, self.errors = 0, {}
        return out


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CLASS = re.compile(r"<class '([^']+)'>")


def client_error_text(reason: str, limit: int = 300) -> str:
    """A failed reply's ``Error.reason`` as one readable line: ``ExceptionName: message``.

    Flower packs the ClientApp's exception as ``<class '...'>:<'...'>``, in a simulation with
    Ray's whole remote traceback (colour codes included) inside; the run log keeps all of that,
    results.json and the closing error get the exception's name and its message."""
    text = _ANSI.sub("", reason)
    name = ""
    if (m := _CLASS.search(text)) is not None:
        inner = re.search(r"\(([^()]+)\)$", m.group(1))  # RayTaskError(ClientAppException)
        name = (inner.group(1) if inner else m.group(1)).rsplit(".", 1)[-1]
        text = text[m.end() :].removeprefix(":<'").removesuffix("'>")
    if "Message: " in text:  # Flower's ClientAppException wraps the app's own message
        text = text.rsplit("Message: ", 1)[1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    message = lines[-1] if lines else ""
    out = f"{name}: {message}" if name and message else (name or message or reason.strip())
    return out if len(out) <= limit else out[: limit - 3] + "..."


def server_main(
    grid: Grid, context: Context, make_inner: InnerFactory = default_inner, extra_keys: Iterable[str] = ()
) -> None:
    """Run the whole federation: rounds, centralized evaluation, results.json, plots, final model.

    ``extra_keys``: run-config keys the caller's own code reads (not rejected as unknown).

    Whatever goes wrong, results.json ends with status "failed" and the reason: errors raised
    before the first round (a bad run config, missing data, too few SuperNodes) as well as during
    the rounds, and a run whose clients all fail (``max-empty-rounds`` train rounds in a row
    without an aggregated update). The error is then re-raised, so Flower marks the run failed.
    """
    ckpt: ServerCheckpoint | None = None
    try:
        cfg = AppConfig.from_run_config(context.run_config, ignore=extra_keys)  # a bad key stops the run here
        if cfg.resume:
            ckpt = _checkpoint_to_resume(cfg)
        comp = cfg.compression
        if not comp.compress and comp.local_iters.kind != "constant":
            raise ConfigError("local-iters: a per-round schedule needs compress = true (the wrapper applies it)")
        cfg.check_devices(("device",))  # the server evaluates on `device`; clients check their own
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        model = initial_model_of(cfg.seed, cfg.dataset)
        test = load_dataset(cfg.dataset, cfg.resolved_data_dir()).test  # fail before round 1
        nodes = wait_for_nodes(grid, max(cfg.clients_per_round, 1))
    except Exception as err:
        if not _resumed_run_dir_exists(context.run_config):  # never overwrite the results of the run to resume
            record_failure(dict(context.run_config), f"{type(err).__name__}: {err}")
        raise
    if ckpt is not None:
        model.load_state_dict(ckpt.model)  # W after the checkpoint's round
    arrays = ArrayRecord(model.state_dict())
    random.seed(cfg.seed)
    recorder = RunRecorder(cfg.to_run_config(), cfg.resolved_results_dir(), cfg.run_name)
    strategy = make_inner(cfg, recording_train_metrics_aggr(recorder))
    privacy: Strategy | None = None
    if cfg.dp_clipping_norm > 0:
        strategy = privacy = with_central_dp(strategy, cfg, cfg.clients_per_round or len(nodes), len(nodes))
    wrapper: CompressionStrategy | None = None
    if comp.compress:
        strategy = wrapper = CompressionStrategy(strategy, comp)
        wrapper.ends_empty_runs = False  # (this app ends such runs itself, after recording the round)
    # One seed, the same partitions every round, compressed or not, and the nodes listed in
    # partition order, which is how DEFT ranks its clients: every run, not only sampled ones.
    strategy = sampling = SeededSampling(strategy, cfg.seed)
    done = 0  # rounds finished before this process started (resume)
    if ckpt is not None:
        done = ckpt.round
        recorder.restore(ckpt.rounds, ckpt.started_at)
        if wrapper is not None and ckpt.strategy is not None:
            wrapper.load_state_dict(ckpt.strategy)
        ckpt.restore_rng()
        accountant = getattr(privacy, "accountant", None)
        if accountant is not None and ckpt.privacy is not None:
            accountant.load_state_dict(ckpt.privacy)
        log.info("fedcomp: resuming run %s after round %s of %s", cfg.run_name, done, cfg.num_server_rounds)
    latest = {"arrays": arrays}
    evaluate = centralized_evaluate_fn(model, test.x, test.y, recorder, resolve_device(cfg.device))
    watched = _WatchedGrid(grid, recorder, dense_nbytes=arrayrecord_nbytes(arrays))
    empty_rounds: list[int] = []  # the current streak of train rounds without an aggregated update

    def evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        recorder.add_metrics(model_digest=digest(tensors_from_record(arrays)))
        if server_round > 0:
            _record_progress(server_round)
        if wrapper is not None and server_round in wrapper.traffic:
            t = wrapper.traffic[server_round]
            recorder.add_metrics(
                downlink_modes={str(k): v for k, v in sorted(t.downlink_mode.items())},
                rejected={str(k): v for k, v in sorted(t.rejected.items())},
                # Train messages that got no reply at all; evaluate replies left out (and why).
                replies_missing=sorted(str(n) for n in t.unanswered),
                # Train replies that were errors (the app failed, a diverged update), and why.
                replies_failed={str(k): v for k, v in sorted(t.failed.items())},
                rejected_evaluate={str(k): v for k, v in sorted(t.rejected_evaluate.items())},
                payload_uplink_bytes=sum(t.uplink.values()),
                payload_downlink_bytes=sum(t.downlink.values()),
                replica_version=wrapper.replica.version if wrapper.replica else 0,
                # Per client (node id): what its bandwidth policy chose and what it measured.
                client_sbc_p=_by_node(t.sbc_p),
                client_local_iters=_by_node(t.local_iters),
                client_budget_bytes=_by_node(t.budget_bytes),
                client_estimated_bytes=_by_node(t.estimated_bytes),
                client_fits=_by_node(t.fits),
                client_codec=_by_node(t.codec),
                client_train_seconds=_by_node(t.train_seconds),
                client_links=_by_node(t.links),
                client_encode_seconds=_by_node(t.client_encode_seconds),
                # Diagnostics (fedcomp.flower.traffic.RoundTraffic).
                replica_lag=t.replica_lag,
                downlink_delivered=t.downlink_delivered,
                client_residual_ratio=_by_node(t.residual_ratio),
                # What max-update-norm bounds, per accepted update (where to set it).
                client_update_norm=_by_node(t.update_norm),
                update_norm_bound=t.update_norm_bound or None,
            )
            if t.sparse_numel:
                recorder.add_metrics(uplink_union_density=t.union_nnz / t.sparse_numel)
            recorder.add_metrics(**wrapper.round_metrics(server_round))
        if server_round > 0:
            recorder.add_metrics(**privacy_spent(privacy))
        metrics = evaluate(server_round, arrays)
        latest["arrays"] = arrays
        # (a run shorter than max-empty-rounds that aggregated nothing at all fails too)
        all_empty = server_round == cfg.num_server_rounds and 0 < server_round <= len(empty_rounds)
        if len(empty_rounds) >= cfg.compression.max_empty_rounds or all_empty:
            raise NoProgressError(_no_progress_message(empty_rounds, recorder.rounds, cfg.compression.max_empty_rounds))
        if server_round > 0:
            _save_state(server_round, arrays)
        return metrics

    def _save_state(server_round: int, arrays: ArrayRecord) -> None:
        """The checkpoint of ``server_round`` (after results.json has the round: a resumed run
        rewrites results.json from the checkpoint's rounds, so a crash between the two is fine)."""
        python_rng, torch_rng = ServerCheckpoint.rng_now()
        ckpt = ServerCheckpoint(
            round=server_round,
            model=tensors_from_record(arrays),
            strategy=wrapper.state_dict() if wrapper is not None else None,
            rounds=recorder.rounds,
            config=cfg.to_run_config(),
            empty_rounds=list(empty_rounds),
            python_rng=python_rng,
            torch_rng=torch_rng,
            privacy=accountant.state_dict() if (accountant := getattr(privacy, "accountant", None)) else None,
            started_at=recorder.started_at.isoformat(),
        )
        try:
            save_checkpoint(recorder.run_dir, ckpt)
        except Exception as err:  # a full disk must not end the training; the run log says it
            log.error("fedcomp: no checkpoint of round %s (the run goes on): %s: %s", server_round,
                      type(err).__name__, err)  # fmt: skip

    if ckpt is not None:
        empty_rounds.extend(ckpt.empty_rounds)

    def _record_progress(server_round: int) -> None:
        """Count this round's aggregated updates (the wrapper's accepted replies, or the replies
        without error when there is no wrapper) and keep the clients' errors."""
        ok, errors = watched.take_round()
        if wrapper is not None:
            t = wrapper.traffic.get(server_round)
            # (a refused aggregate, not finite or off the lattice grid, aggregated nothing after all)
            aggregated = 0 if t is None or t.aggregate_refused else t.accepted
            if t is not None:
                errors.update({str(k): f"update rejected: {v}" for k, v in t.rejected.items()})
                if t.aggregate_refused:
                    recorder.add_metrics(aggregate_refused=t.aggregate_refused)
        else:
            aggregated = ok
        recorder.add_metrics(updates_aggregated=aggregated, client_errors=dict(sorted(errors.items())))
        if aggregated == 0:
            empty_rounds.append(server_round)
        else:
            empty_rounds.clear()

    def shifted_evaluate_fn(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if done and server_round == 0:
            return None  # round `done` was evaluated and recorded before the crash
        return evaluate_fn(server_round + done, arrays)

    # The wrapper sends each round's local-iters from the schedule (an own value would be kept as
    # it is); without it, the dense baseline's clients read the round-1 value from here.
    train_config = ConfigRecord({"lr": cfg.lr})
    if wrapper is None:
        train_config[protocol.LOCAL_ITERS] = comp.local_iters_at(done + 1)
    try:
        runner = _FromRound(strategy, done) if done else strategy
        runner.start(
            grid=watched,
            initial_arrays=arrays,
            num_rounds=cfg.num_server_rounds - done,
            timeout=cfg.round_timeout,
            train_config=train_config,
            evaluate_fn=shifted_evaluate_fn,
        )
    except BaseException as err:
        recorder.finish("failed", error=_error_text(err), **_partitions_of(sampling), **privacy_spent(privacy))
        write_plots(recorder.run_dir)
        raise
    # The model after the last round (the one evaluate_fn saw last: Result.arrays stays unset
    # when no round aggregated anything, and a resumed run may have no round left to run).
    torch.save(latest["arrays"].to_torch_state_dict(), Path(recorder.run_dir) / "final_model.pt")
    recorder.finish(**_partitions_of(sampling), **privacy_spent(privacy))
    write_plots(recorder.run_dir)


class _FromRound(Strategy):
    """``strategy`` continued after round ``done``: Flower's ``Strategy.start`` counts rounds from
    1, so a resumed run passes every round on shifted by ``done`` (the inner strategy, the
    wrapper, the clients' ``server-round`` all see the true round; only Flower's own
    ``[ROUND i/n]`` log line counts from the resume)."""

    def __init__(self, strategy: Strategy, done: int) -> None:
        self.strategy, self.done = strategy, done

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_train(server_round + self.done, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        return self.strategy.aggregate_train(server_round + self.done, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round + self.done, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round + self.done, replies)

    def summary(self) -> None:
        log.info("fedcomp: resumed after round %s", self.done)
        self.strategy.summary()


#: Run-config keys a resumed run may set differently from the checkpointed one.
RESUME_MAY_CHANGE = ("resume", "num-server-rounds", "round-timeout", "max-empty-rounds", "torch-threads")


def _checkpoint_to_resume(cfg: AppConfig) -> ServerCheckpoint:
    """The checkpoint of ``results-dir/run-name``; a :class:`ConfigError` when ``run-name`` is
    empty, the run config differs from the checkpointed run's (other than
    :data:`RESUME_MAY_CHANGE`), or the run already did every round."""
    if not cfg.run_name:
        raise ConfigError("resume: needs run-name (the folder of the run to resume, under results-dir)")
    ckpt = load_checkpoint(cfg.resolved_results_dir() / cfg.run_name)
    now = cfg.to_run_config()
    changed = sorted(
        k for k in set(now) | set(ckpt.config) if k not in RESUME_MAY_CHANGE and now.get(k) != ckpt.config.get(k)
    )
    if changed:
        diffs = ", ".join(f"{k} = {ckpt.config.get(k)!r} -> {now.get(k)!r}" for k in changed[:5])
        raise ConfigError(f"resume: the run config differs from the checkpointed run's: {diffs}")
    if ckpt.round >= cfg.num_server_rounds:
        raise ConfigError(
            f"resume: the checkpoint is of round {ckpt.round}, num-server-rounds is {cfg.num_server_rounds}: "
            "nothing left to run (raise num-server-rounds to go on)"
        )
    return ckpt


def _resumed_run_dir_exists(run_config: dict[str, Any] | Any) -> bool:
    """Whether this is a resume of a run whose folder holds results (not to be overwritten by a
    results.json of a run that never started: the checkpoint's rounds are what matters)."""
    if run_config.get("resume") is not True:
        return False
    name, root = run_config.get("run-name"), run_config.get("results-dir", "")
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        return False
    from fedcomp.app.results import resolve_results_root

    folder = resolve_results_root(root if isinstance(root, str) else None) / name
    return (folder / RESULTS_FILE).is_file() or (folder / CHECKPOINT_FILE).is_file()


def _error_text(err: BaseException) -> str:
    """What results.json says of the error that ended a run (a KeyboardInterrupt, which SIGINT or
    the SIGTERM of a stopping deployment raises, has no text of its own: it said "KeyboardInterrupt: ")."""
    if isinstance(err, KeyboardInterrupt) and not str(err):
        return "KeyboardInterrupt: interrupted (SIGINT or SIGTERM); resume=true continues from the last checkpoint"
    return f"{type(err).__name__}: {err}"


def _no_progress_message(empty_rounds: list[int], rounds: list[dict[str, Any]], limit: int) -> str:
    """Which rounds aggregated nothing, and the clients' distinct errors (most recent round's).
    ``limit``: max-empty-rounds (a run that ended sooner, every round empty, names its rounds)."""
    last: dict[str, Any] = next((r for r in reversed(rounds) if r["round"] == empty_rounds[-1]), {})
    errors = last.get("client_errors") or {}
    why = by_reason(errors)
    which = (
        f"max-empty-rounds = {limit}"
        if len(empty_rounds) >= limit
        else "the whole run: no round aggregated an update, its model is the initial one"
    )
    return (
        f"no client update was aggregated in {len(empty_rounds)} rounds in a row "
        f"(rounds {empty_rounds[0]}-{empty_rounds[-1]}; {which}): " + (why or "no client replied")
    )


def write_plots(run_dir: Path) -> list[Path]:
    """The run's plots beside results.json (``fedcomp.app.plots.write_run_plots``). A plotting
    failure is logged, never fails the run: the results are what matter."""
    try:
        from fedcomp.app.plots import write_run_plots
    except ImportError as err:
        log.warning("fedcomp: no plots for %s (%s)", run_dir, err)
        return []
    try:
        return write_run_plots(Path(run_dir))
    except Exception as err:  # plotting must never turn a finished run into a failed one
        log.warning("fedcomp: could not write the plots of %s: %s: %s", run_dir, type(err).__name__, err)
        return []


def _partitions_of(sampling: SeededSampling) -> dict[str, Any]:
    """The summary entry ``node_partitions``: which partition each node id trains on."""
    return {"node_partitions": _by_node(sampling.partitions)}


def _by_node(values: dict) -> dict[str, object]:
    return {str(k): v for k, v in sorted(values.items())}


def initial_model_of(seed: int, dataset: str = "digits") -> nn.Module:
    """The run's initial model for ``dataset`` (:func:`~fedcomp.app.models.model_for`), the same
    on the server and every client (seeded; the global RNG of the caller is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_for(dataset)


def client_initial_model(context: Context) -> dict[str, torch.Tensor]:
    """For ``make_compression_mod(initial_model=...)``: this run's version-0 model, built on the
    client (with ``seeded-initial-model = true`` the server then sends no initial model)."""
    seed, dataset = context.run_config.get("seed", 0), context.run_config.get("dataset", "digits")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed: must be an integer (got {seed!r})")
    if not isinstance(dataset, str):
        raise ConfigError(f"dataset: must be a string (got {dataset!r})")
    return dict(initial_model_of(seed, dataset).state_dict())


def client_train(msg: Message, context: Context, extra_keys: Iterable[str] = ()) -> Message:
    """Train the dataset's model (LeNet5, or CharLSTM on Shakespeare) on this SuperNode's partition
    for ``local-iters`` steps and reply the model."""
    cfg = AppConfig.from_run_config(context.run_config, ignore=extra_keys)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    pid = int(context.node_config["partition-id"])
    data = load_partition(
        cfg.dataset,
        pid,
        int(context.node_config["num-partitions"]),
        scheme=cfg.partitioning,
        alpha=cfg.dirichlet_alpha,
        seed=cfg.seed,
        data_dir=cfg.resolved_data_dir(),
    )
    model = model_for(cfg.dataset)
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    config = msg.content.config_records[protocol.CONFIG_RECORD]
    server_round = _int(config.get(protocol.SERVER_ROUND, 0))
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + pid * 1_009 + server_round)
    loss = train_local(
        model,
        (data.x, data.y),
        iterations=_int(config.get(protocol.LOCAL_ITERS, cfg.compression.local_iters_at(max(server_round, 1)))),
        lr=_float(config.get("lr", cfg.lr)),
        optimizer=cfg.optimizer,
        device=cfg.device,
        batch_size=cfg.batch_size,
        generator=gen,
    )
    trained = model.cpu().state_dict()
    bound = clipping_norm_of(config)
    if bound is not None and not cfg.compression.compress:
        # Client-side DP, dense baseline: the update clipped as Flower's fixedclipping_mod clips
        # it. Compressed, the mod clips what it sends, residual included (fedcomp.flower.clipping).
        received = msg.content.array_records["arrays"].to_torch_state_dict()
        trained = clip_update(trained, received, bound)
    # Under DP every client weighs the same: the noise is calibrated to a mean of equal shares.
    weight = 1 if cfg.dp_clipping_norm > 0 else len(data)
    content = RecordDict(
        {
            "arrays": ArrayRecord(trained),
            "metrics": MetricRecord({"num-examples": weight, "train-loss": loss}),
        }
    )
    return Message(content=content, reply_to=msg)


def clip_update(
    trained: dict[str, torch.Tensor], received: dict[str, torch.Tensor], bound: float
) -> dict[str, torch.Tensor]:
    """``trained`` moved back towards ``received`` so that their difference has an L2 norm of at
    most ``bound`` (unchanged when it has already). Floating-point tensors only: an integer buffer
    (a batch-norm counter) is not a parameter and is left as trained."""
    delta = {k: t.float() - received[k].float() for k, t in trained.items() if t.is_floating_point()}
    norm = not_finite_and_norm(delta)[1]
    if norm <= bound:
        return trained
    scale = bound / norm
    return {k: (received[k].float() + delta[k] * scale).to(t.dtype) if k in delta else t for k, t in trained.items()}


def _float(value: object) -> float:
    """A train-config number (bools and non-numbers are a configuration error)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"train config: expected a number, got {value!r}")
    return float(value)


def _int(value: object) -> int:
    return int(_float(value))
