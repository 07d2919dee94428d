"""The training loop: build the run, step, log, validate, checkpoint, stop safely.

Every rank runs :func:`train`. The step itself, in whichever graph mode, comes from
``step.make_step``; checkpoints and the run directory's rules from ``checkpointing``; the metrics
lines and ``config.json`` from ``metrics``; processes, devices and Ctrl-C from ``parallel``.

:func:`_train` is the loop's outline: :func:`_setup` resumes or starts the run and builds a
:class:`Run`; each step is :func:`_take_step`, then at its due steps :func:`_log_interval`,
:func:`_validate`, :func:`_checkpoint` and on Ctrl-C :func:`_interrupt`; :func:`_summary` ends it.

Non-finite losses are caught without a host sync per step: the loss sum is read at every logging
step (the read that logging does anyway), and before every checkpoint the losses since the last
read and the weights are checked, so no checkpoint ever holds nan or inf.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shlex
import time
from pathlib import Path
from typing import Any

import torch

import tgraph
from tgraph.toy.corpus import BatchSampler, fixed_batches, load_split

from .checkpointing import (
    RunDirectoryError,
    claim_run_directory,
    load_model_weights,
    prepare_run_directory,
    read_checkpoint,
    resolve_resume,
    save_checkpoint,
    set_rng_state,
)
from .config import TrainConfig
from .metrics import Metrics, StepTimes, describe_run, peak_memory_mb, plot_losses, write_config
from .parallel import DistEnv, StopOnSigint, all_finite, all_reduce_mean, setup, shutdown
from .spec import GPT_SPEC, ModelSpec
from .step import TrainStep

logger = logging.getLogger("train_gpt")  # the recipe's one logger name in every module

MAX_SKIPPED_IN_A_ROW = 10  # --on-nonfinite skip: this many skipped steps in a row stop the run
NONFINITE_FIX = (
    "Lower --lr, keep --grad-clip above 0, resume from an earlier checkpoint, or pass "
    "--on-nonfinite skip to skip such steps"
)


class NonFiniteLossError(RuntimeError):
    """The loss (or the weights) became nan or inf; the run stopped before checkpointing it."""


class DataError(ValueError):
    """The corpus cannot give the data the command line asks for: a split that
    ``--val-fraction`` leaves empty, windows longer than a shard (exit code 2, like a bad
    argument)."""


class TrainingInterrupted(Exception):
    """Ctrl-C (SIGINT): the run stopped at a step boundary after writing a checkpoint."""

    def __init__(self, message: str, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def _nonfinite(done: int, what: str, last_ckpt: Path | None, fix: str) -> NonFiniteLossError:
    return NonFiniteLossError(
        f"step {done}: {what} is not finite (nan or inf); stopped before writing a checkpoint, so "
        f"no checkpoint holds it (newest: {last_ckpt or 'none yet'}). {fix}"
    )


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches, env: DistEnv, spec: ModelSpec = GPT_SPEC) -> float:
    """Mean validation loss over ``batches`` and every rank's shard."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=env.device)
    for x, y in batches:
        total += spec.loss(model, x.to(env.device), y.to(env.device))
    model.train(was_training)
    return all_reduce_mean(total / len(batches), env).item()


def train(cfg: TrainConfig, spec: ModelSpec = GPT_SPEC) -> dict:
    """Run (or resume) training as configured. Every rank calls it.

    ``spec`` is the recipe's model (the toy GPT by default); ``cfg`` the recipe's config, which
    holds the fields ``spec.build`` reads.

    Returns:
        The run summary (also written to ``<out>/summary.json`` by rank 0).

    Raises:
        CheckpointError: ``cfg.resume`` names a missing, incomplete, damaged or mismatched
            checkpoint, or ``cfg.out`` holds another run (without ``cfg.overwrite``).
        NonFiniteLossError: the loss or the weights became nan/inf (no checkpoint of them is
            written).
        TrainingInterrupted: Ctrl-C; a checkpoint of the last finished step was written.
    """
    env = setup(cfg)
    agreed = False  # every rank ends here together: a barrier cannot hang
    try:
        summary = _train(cfg, env, spec)
        agreed = True
        return summary
    except (TrainingInterrupted, NonFiniteLossError):
        agreed = True  # decided from all-reduced values: every rank raises at the same step
        raise
    finally:
        tgraph.reset()  # drop the graphs and the record even when training failed
        shutdown(env, agreed)


def _train(cfg: TrainConfig, env: DistEnv, spec: ModelSpec) -> dict:
    """Set up, run steps ``start + 1 .. cfg.steps`` (logging, validating, checkpointing when due),
    stop at Ctrl-C after a checkpoint, and return the summary."""
    run = _setup(cfg, env, spec)
    cfg = run.cfg
    with StopOnSigint(hard_second=env.world_size == 1, announce=env.is_main) as stop:
        for i in range(run.start, cfg.steps):
            lr = _take_step(run, i)
            done = i + 1
            stopping = env.world_size == 1 and stop.requested  # one process: every step
            if done % cfg.log_every == 0 or done == cfg.steps:
                stopping = _log_interval(run, done, lr, stop.requested) or stopping
            if _every(cfg.eval_every, done) or done == cfg.steps:
                _validate(run, done)
            if _every(cfg.ckpt_every, done) or done == cfg.steps or stopping:
                _checkpoint(run, done)
            if run.bar is not None:
                run.bar.update(1)
            if stopping and done < cfg.steps:
                _interrupt(run, done)
            if done % cfg.log_every == 0:
                run.times.start()  # the next interval starts after validation and checkpoint work
            elif _every(cfg.eval_every, done) or _every(cfg.ckpt_every, done):
                run.times.unsteady()  # validation or a checkpoint inside the interval
    return _summary(run)


@dataclasses.dataclass(eq=False)
class Run:
    """One run as the loop sees it: what :func:`_setup` built, and what the steps change."""

    cfg: TrainConfig  # with the run's --steps (a resume without --steps keeps the checkpoint's)
    env: DistEnv
    spec: ModelSpec
    start: int  # the first step to run: 0, or the resumed checkpoint's step
    decay_steps: int  # the cosine horizon of the learning rate (see optim.lr_at)
    last_ckpt: Path | None  # the newest checkpoint: the resumed one until a step writes one
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    sampler: BatchSampler
    val_batches: list
    step: TrainStep
    metrics: Metrics
    bar: Any  # tqdm's bar (rank 0 with --progress), else None
    capture_s: float = 0.0
    n_sum: int = 0  # finished steps whose loss is in loss_sum (skipped steps are not)
    last_train: float = math.nan
    last_val: float = math.nan
    skipped: int = 0
    skipped_in_a_row: int = 0
    loss_sum: torch.Tensor = dataclasses.field(init=False)  # on the device: no sync per step
    times: StepTimes = dataclasses.field(init=False)
    wall0: float = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.loss_sum = torch.zeros((), device=self.env.device)
        self.times = StepTimes(self.env.device)  # syncs the device, then starts the clock
        self.wall0 = self.times.t0

    @property
    def out(self) -> Path:
        return Path(self.cfg.out)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.block_size * self.env.world_size


def _every(n: int, done: int) -> bool:
    """Whether step ``done`` is a multiple of ``n`` (0: never)."""
    return bool(n) and done % n == 0


def _setup(cfg: TrainConfig, env: DistEnv, spec: ModelSpec) -> Run:
    """Everything before the first step: resume, build, the step, ``config.json``, metrics."""
    spec.check(cfg)  # a model that cannot be built is refused before --out is touched
    sampler, val_batches = _load_data(cfg, env)  # and so is data the corpus cannot give
    cfg, state, resume_dir = _resume(cfg, env, spec)
    start = state["step"] if state else 0
    # The cosine horizon of the run's first start, kept by every resume (see optim.lr_at).
    decay = state.get("lr_decay_steps", state["config"]["steps"]) if state else cfg.steps
    model, opt = _build(cfg, env, state, resume_dir, spec, sampler)
    out = Path(cfg.out)
    if env.is_main:
        logger.info(
            "training a %.2fM-parameter %s, steps %d to %d, --graph %s on %s; outputs in %s/",
            sum(p.numel() for p in model.parameters()) / 1e6,
            spec.title,
            start,
            cfg.steps,
            cfg.graph,
            env.device,
            out,
        )
    # Validation's graphs are recorded by a forward of the model itself (never DDP's wrapper).
    step = spec.make_step(cfg, model, opt, env, lambda: evaluate(model, val_batches[:1], env, spec))
    if env.is_main:
        write_config(cfg, env, out, resume_dir, spec.resolved(cfg, model))
    metrics = Metrics(out / "metrics.jsonl", env.is_main, start if state else None)
    bar = None
    if env.is_main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"train ({cfg.graph})", unit="step")
    return Run(
        cfg,
        env,
        spec,
        start,
        decay,
        resume_dir,
        model,
        opt,
        sampler,
        val_batches,
        step,
        metrics,
        bar,
    )


def _resume(
    cfg: TrainConfig, env: DistEnv, spec: ModelSpec
) -> tuple[TrainConfig, dict | None, Path | None]:
    """Resolve ``--resume`` and read its checkpoint, claim ``--out``; returns the config with the
    run's ``--steps``, the checkpoint's state and its directory (None, None on a fresh start)."""
    resume_dir = resolve_resume(cfg)
    state = read_checkpoint(resume_dir, cfg, env.world_size, spec) if resume_dir else None
    if resume_dir:
        spec.check_resume(cfg, resume_dir)
    claim_run_directory(cfg, resume_dir, env)
    prepare_run_directory(Path(cfg.out))  # every rank: each raises the same error, none waits
    cfg = cfg.with_steps(state["config"].get("steps") if state else None)
    if state and state["step"] >= cfg.steps:
        start = state["step"]
        raise RunDirectoryError(
            f"checkpoint {resume_dir} is at step {start} and --steps is {cfg.steps}: nothing to "
            f"do. Pass --steps larger than {start} to train it longer (the learning rate stays "
            "at --min-lr after the run's original end)"
        )
    return cfg, state, resume_dir


def _build(
    cfg: TrainConfig,
    env: DistEnv,
    state: dict | None,
    resume_dir: Path | None,
    spec: ModelSpec,
    sampler: BatchSampler,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model and its optimizer; they and ``sampler`` restored from ``state`` when resuming."""
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = spec.build(cfg, env.device)
    if resume_dir:
        load_model_weights(model, resume_dir, spec)
    torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank dropout stream
    opt = spec.make_optimizer(model, cfg, env.device)
    if state:
        spec.load_optimizer(opt, state["optimizer"], env.device)
        set_rng_state(state["rng"][env.rank], sampler, env.device)
        logger.info("resumed from %s at step %d", resume_dir, state["step"])
    return model, opt


def _load_data(cfg: TrainConfig, env: DistEnv) -> tuple[BatchSampler, list]:
    """This rank's training sampler and its fixed validation batches.

    Raises:
        DataError: a split ``--val-fraction`` leaves empty, or a ``--block-size`` window longer
            than this rank's shard of a split.
    """
    data_kw = dict(
        val_fraction=cfg.val_fraction,
        rank=env.rank,
        world_size=env.world_size,
        include_tests=cfg.include_tests,
    )
    try:
        sampler = BatchSampler(
            load_split("train", **data_kw),
            cfg.batch_size,
            cfg.block_size,
            seed=cfg.seed + 100_003 * (env.rank + 1),
        )
        val_batches = fixed_batches(
            load_split("val", **data_kw), cfg.batch_size, cfg.block_size, cfg.eval_batches
        )
    except ValueError as e:  # tgraph.toy.corpus's refusals: an empty split, a shard too short
        raise DataError(f"the corpus cannot serve this run: {e}") from e
    return sampler, val_batches


def _take_step(run: Run, i: int) -> float:
    """Run step ``i`` (0-based), count its loss or its skipped update; returns its learning rate."""
    env = run.env
    lr = run.spec.set_lr(run.opt, i, run.cfg, run.decay_steps)
    x, y = run.sampler.next()
    x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
    loss, captured_s = run.step(x, y)
    if captured_s is not None:
        run.capture_s = captured_s
        run.times.unsteady()
    done = i + 1
    if loss is None:  # --on-nonfinite skip skipped this step's update
        run.skipped, run.skipped_in_a_row = run.skipped + 1, run.skipped_in_a_row + 1
        if env.is_main:
            logger.warning(
                "step %d: non-finite loss or gradient, update skipped (%d so far)",
                done,
                run.skipped,
            )
        if run.skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
            raise _nonfinite(
                done,
                f"the loss or gradient of {run.skipped_in_a_row} steps in a row",
                run.last_ckpt,
                "Lower --lr, keep --grad-clip above 0, or resume from an earlier checkpoint",
            )
    else:
        run.skipped_in_a_row = 0
        run.loss_sum += loss
        run.n_sum += 1
    return lr


def _log_interval(run: Run, done: int, lr: float, stop_requested: bool) -> bool:
    """Close the logging interval that ends at step ``done``: its mean loss (checked finite), its
    train line, the progress bar. Returns whether any rank saw Ctrl-C."""
    env, cfg = run.env, run.cfg
    # One all-reduce and one host read: the mean loss and whether a rank saw Ctrl-C.
    mean = run.loss_sum / max(run.n_sum, 1)
    packed = torch.stack([mean, torch.tensor(float(stop_requested), device=env.device)])
    run.last_train, stop_votes = all_reduce_mean(packed, env).tolist()  # syncs the device
    if run.n_sum and not math.isfinite(run.last_train):
        raise _nonfinite(done, "the training loss", run.last_ckpt, NONFINITE_FIX)
    seconds = run.times.close(run.n_sum)
    if run.n_sum:
        row = dict(
            kind="train",
            step=done,
            loss=run.last_train,
            lr=lr,
            ms_per_step=1000 * seconds / run.n_sum,
            tokens_per_s=run.tokens_per_step * run.n_sum / seconds,
            peak_mem_mb=peak_memory_mb(env.device),
            graph=cfg.graph,
            capture_s=run.capture_s,
            **run.step.report(),
        )
        run.metrics.write(**row)
        if run.bar is not None:
            run.bar.set_postfix(loss=f"{run.last_train:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
    run.loss_sum, run.n_sum = torch.zeros((), device=env.device), 0
    return stop_votes > 0


def _validate(run: Run, done: int) -> None:
    """The validation loss after step ``done`` (checked finite): a val line and a log line."""
    run.last_val = evaluate(run.model, run.val_batches, run.env, run.spec)
    if not math.isfinite(run.last_val):
        raise _nonfinite(done, "the validation loss", run.last_ckpt, NONFINITE_FIX)
    run.metrics.write(kind="val", step=done, loss=run.last_val, graph=run.cfg.graph)
    logger.info("step %d: val loss %.4f", done, run.last_val)


def _checkpoint(run: Run, done: int) -> None:
    """Step ``done``'s checkpoint, once the unread losses and the weights are finite on all ranks."""
    if not all_finite([run.loss_sum, *run.model.parameters()], run.env):
        raise _nonfinite(done, "the training loss or the weights", run.last_ckpt, NONFINITE_FIX)
    run.last_ckpt = save_checkpoint(
        run.out / "checkpoints",
        done,
        run.model,
        run.opt,
        run.sampler,
        run.cfg,
        run.env,
        {"val_loss": run.last_val},
        run.decay_steps,
        run.spec,
    )


def _interrupt(run: Run, done: int) -> None:
    """Ctrl-C: step ``done``'s checkpoint is written; stop with how to continue."""
    if run.bar is not None:
        run.bar.close()
    cfg = run.cfg
    flags = f"--out {shlex.quote(cfg.out)} --resume latest --steps {cfg.steps} {cfg.model_flags()}"
    raise TrainingInterrupted(
        f"interrupted (Ctrl-C) after step {done}: saved {run.last_ckpt}. Continue with "
        + flags.rstrip(),
        run.last_ckpt,
    )


def _summary(run: Run) -> dict:
    """The finished run's summary; rank 0 writes ``summary.json`` and the plot, and reports."""
    cfg, env, out = run.cfg, run.env, run.out
    wall = time.perf_counter() - run.wall0
    if run.bar is not None:
        run.bar.close()
    ms_med = run.times.median_ms()
    summary = {
        "graph": cfg.graph,
        "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        "world_size": env.world_size,
        "steps": cfg.steps,
        "resumed_at": run.start,
        "lr_decay_steps": run.decay_steps,
        "skipped_steps": run.skipped,
        "tokens_per_step": run.tokens_per_step,
        "median_ms_per_step": ms_med,
        "tokens_per_s": 1000 * run.tokens_per_step / ms_med,
        "final_train_loss": run.last_train,
        "final_val_loss": run.last_val,
        "capture_s": run.capture_s,
        "peak_mem_mb": peak_memory_mb(env.device),
        "wall_s": wall,
        "torch": torch.__version__,
        **run.step.report(),
    }
    if env.is_main:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_losses(
            out / "metrics.jsonl",
            out / "loss.png",
            f"{run.spec.plot_name} on stdlib bytes, --graph {cfg.graph} ({summary['device']})",
        )
        logger.info("%s", describe_run(summary, out, run.step.backend))
    run.step.close()
    return summary
