"""The training loop: build the run, step, log, validate, checkpoint, stop safely.

Every rank runs :func:`train`. The step itself, in whichever graph mode, comes from
``step.make_step``; checkpoints and the run directory's rules from ``checkpointing``; the metrics
lines from ``metrics``; processes, devices and Ctrl-C from ``parallel``.

Non-finite losses are caught without a host sync per step: the loss sum is read at every logging
step (the read that logging does anyway), and before every checkpoint the losses since the last
read and the weights are checked, so no checkpoint ever holds nan or inf.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

import tgraph
from tgraph.toy.corpus import BatchSampler, corpus_stats, fixed_batches, load_split
from tgraph.toy.gpt import GPT

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
from .metrics import Metrics, StepTimes, describe_run, peak_memory_mb, plot_losses
from .optim import lr_at, make_optimizer, set_lr, tensor_lrs
from .parallel import DistEnv, StopOnSigint, all_finite, all_reduce_mean, setup, shutdown
from .step import make_step

logger = logging.getLogger("train_gpt")  # the recipe's one logger name in every module

MAX_SKIPPED_IN_A_ROW = 10  # --on-nonfinite skip: this many skipped steps in a row stop the run
NONFINITE_FIX = (
    "Lower --lr, keep --grad-clip above 0, resume from an earlier checkpoint, or pass "
    "--on-nonfinite skip to skip such steps"
)


class NonFiniteLossError(RuntimeError):
    """The loss (or the weights) became nan or inf; the run stopped before checkpointing it."""


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
def evaluate(model: torch.nn.Module, batches, env: DistEnv) -> float:
    """Mean validation loss over ``batches`` and every rank's shard."""
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=env.device)
    for x, y in batches:
        total += model(x.to(env.device), y.to(env.device))[1]
    model.train(was_training)
    return all_reduce_mean(total / len(batches), env).item()


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training as configured. Every rank calls it.

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
        summary = _train(cfg, env)
        agreed = True
        return summary
    except (TrainingInterrupted, NonFiniteLossError):
        agreed = True  # decided from all-reduced values: every rank raises at the same step
        raise
    finally:
        tgraph.reset()  # drop graphs and records even when training failed
        shutdown(env, agreed)


def _load_data(cfg: TrainConfig, env: DistEnv) -> tuple[BatchSampler, list]:
    """This rank's training sampler and its fixed validation batches."""
    data_kw = dict(
        val_fraction=cfg.val_fraction,
        rank=env.rank,
        world_size=env.world_size,
        include_tests=cfg.include_tests,
    )
    sampler = BatchSampler(
        load_split("train", **data_kw),
        cfg.batch_size,
        cfg.block_size,
        seed=cfg.seed + 100_003 * (env.rank + 1),
    )
    val_batches = fixed_batches(
        load_split("val", **data_kw), cfg.batch_size, cfg.block_size, cfg.eval_batches
    )
    return sampler, val_batches


def _write_config(cfg: TrainConfig, env: DistEnv, run: Path, resume_dir: Path | None) -> None:
    """``<out>/config.json``: the config, and what it resolved to (rank 0)."""
    run.mkdir(parents=True, exist_ok=True)
    resolved = {
        "world_size": env.world_size,
        "device": str(env.device),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "corpus": dataclasses.asdict(
            corpus_stats(val_fraction=cfg.val_fraction, include_tests=cfg.include_tests)
        ),
        "resumed_from": str(resume_dir) if resume_dir else None,
        "gpt": cfg.gpt_config().to_dict(),
    }
    (run / "config.json").write_text(
        json.dumps({"train": asdict(cfg), "resolved": resolved}, indent=2) + "\n"
    )


def _train(cfg: TrainConfig, env: DistEnv) -> dict:
    run = Path(cfg.out)
    ckpt_root = run / "checkpoints"
    resume_dir = resolve_resume(cfg)
    state = read_checkpoint(resume_dir, cfg, env.world_size) if resume_dir else None
    claim_run_directory(cfg, resume_dir, env)
    prepare_run_directory(run)  # every rank: each raises the same error, none waits for another
    cfg = cfg.with_steps(state["config"].get("steps") if state else None)
    start = state["step"] if state else 0
    if state and start >= cfg.steps:
        raise RunDirectoryError(
            f"checkpoint {resume_dir} is at step {start} and --steps is {cfg.steps}: nothing to "
            f"do. Pass --steps larger than {start} to train it longer (the learning rate stays "
            "at --min-lr after the run's original end)"
        )
    # The cosine horizon of the run's first start, kept by every resume (see optim.lr_at).
    decay_steps = state.get("lr_decay_steps", state["config"]["steps"]) if state else cfg.steps

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg.gpt_config()).to(env.device)
    if resume_dir:
        load_model_weights(model, resume_dir)
    torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank dropout stream
    sampler, val_batches = _load_data(cfg, env)
    opt = make_optimizer(model, cfg, env.device)
    if state:
        opt.load_state_dict(state["optimizer"])
        tensor_lrs(opt, env.device)
        set_rng_state(state["rng"][env.rank], sampler, env.device)
        logger.info("resumed from %s at step %d", resume_dir, start)
    if env.is_main:
        logger.info(
            "training a %.2fM-parameter GPT, steps %d to %d, --graph %s on %s; outputs in %s/",
            sum(p.numel() for p in model.parameters()) / 1e6,
            start,
            cfg.steps,
            cfg.graph,
            env.device,
            run,
        )
    # Validation's graphs are recorded by a forward of the model itself (never DDP's wrapper).
    step = make_step(cfg, model, opt, env, lambda: evaluate(model, val_batches[:1], env))
    if env.is_main:
        _write_config(cfg, env, run, resume_dir)
    metrics = Metrics(run / "metrics.jsonl", env.is_main, start if state else None)
    tokens_per_step = cfg.batch_size * cfg.block_size * env.world_size
    bar = None
    if env.is_main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"train ({cfg.graph})", unit="step")

    capture_s = 0.0
    loss_sum, n_sum = torch.zeros((), device=env.device), 0
    last_train = last_val = float("nan")
    last_ckpt = resume_dir
    skipped = skipped_in_a_row = 0
    times = StepTimes(env.device)
    wall0 = times.t0
    with StopOnSigint(hard_second=env.world_size == 1, announce=env.is_main) as stop:
        for i in range(start, cfg.steps):
            lr = lr_at(i, cfg, decay_steps)
            set_lr(opt, lr)
            x, y = sampler.next()
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            loss, captured_s = step(x, y)
            if captured_s is not None:
                capture_s = captured_s
                times.unsteady()
            done = i + 1
            if loss is None:  # --on-nonfinite skip skipped this step's update
                skipped, skipped_in_a_row = skipped + 1, skipped_in_a_row + 1
                if env.is_main:
                    logger.warning(
                        "step %d: non-finite loss or gradient, update skipped (%d so far)",
                        done,
                        skipped,
                    )
                if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    raise _nonfinite(
                        done,
                        f"the loss or gradient of {skipped_in_a_row} steps in a row",
                        last_ckpt,
                        "Lower --lr, keep --grad-clip above 0, or resume from an earlier "
                        "checkpoint",
                    )
            else:
                skipped_in_a_row = 0
                loss_sum += loss
                n_sum += 1
            stopping = env.world_size == 1 and stop.requested  # one process: every step
            if done % cfg.log_every == 0 or done == cfg.steps:
                # One all-reduce and one host read: the mean loss and whether a rank saw Ctrl-C.
                packed = torch.stack(
                    [
                        loss_sum / max(n_sum, 1),
                        torch.tensor(float(stop.requested), device=env.device),
                    ]
                )
                last_train, stop_votes = all_reduce_mean(packed, env).tolist()  # syncs the device
                stopping = stopping or stop_votes > 0
                if n_sum and not math.isfinite(last_train):
                    raise _nonfinite(done, "the training loss", last_ckpt, NONFINITE_FIX)
                seconds = times.close(n_sum)
                if n_sum:
                    row = dict(
                        kind="train",
                        step=done,
                        loss=last_train,
                        lr=lr,
                        ms_per_step=1000 * seconds / n_sum,
                        tokens_per_s=tokens_per_step * n_sum / seconds,
                        peak_mem_mb=peak_memory_mb(env.device),
                        graph=cfg.graph,
                        capture_s=capture_s,
                    )
                    metrics.write(**row)
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{last_train:.3f}", tok_s=f"{row['tokens_per_s']:.0f}"
                        )
                loss_sum, n_sum = torch.zeros((), device=env.device), 0
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                last_val = evaluate(model, val_batches, env)
                if not math.isfinite(last_val):
                    raise _nonfinite(done, "the validation loss", last_ckpt, NONFINITE_FIX)
                metrics.write(kind="val", step=done, loss=last_val, graph=cfg.graph)
                logger.info("step %d: val loss %.4f", done, last_val)
            if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps or stopping:
                if not all_finite([loss_sum, *model.parameters()], env):
                    raise _nonfinite(
                        done, "the training loss or the weights", last_ckpt, NONFINITE_FIX
                    )
                last_ckpt = save_checkpoint(
                    ckpt_root,
                    done,
                    model,
                    opt,
                    sampler,
                    cfg,
                    env,
                    {"val_loss": last_val},
                    decay_steps,
                )
            if bar is not None:
                bar.update(1)
            if stopping and done < cfg.steps:
                if bar is not None:
                    bar.close()
                raise TrainingInterrupted(
                    f"interrupted (Ctrl-C) after step {done}: saved {last_ckpt}. Continue with "
                    f"--out {cfg.out} --resume latest --steps {cfg.steps}",
                    last_ckpt,
                )
            if done % cfg.log_every == 0:
                times.start()  # the next interval starts after validation and checkpoint work
            elif (cfg.eval_every and done % cfg.eval_every == 0) or (
                cfg.ckpt_every and done % cfg.ckpt_every == 0
            ):
                times.unsteady()  # validation or a checkpoint inside the interval
    wall = time.perf_counter() - wall0
    if bar is not None:
        bar.close()
    ms_med = times.median_ms()
    summary = {
        "graph": cfg.graph,
        "device": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "cpu",
        "world_size": env.world_size,
        "steps": cfg.steps,
        "resumed_at": start,
        "lr_decay_steps": decay_steps,
        "skipped_steps": skipped,
        "tokens_per_step": tokens_per_step,
        "median_ms_per_step": ms_med,
        "tokens_per_s": 1000 * tokens_per_step / ms_med,
        "final_train_loss": last_train,
        "final_val_loss": last_val,
        "capture_s": capture_s,
        "peak_mem_mb": peak_memory_mb(env.device),
        "wall_s": wall,
        "torch": torch.__version__,
    }
    if env.is_main:
        (run / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_losses(
            run / "metrics.jsonl",
            run / "loss.png",
            f"toy GPT on stdlib bytes, --graph {cfg.graph} ({summary['device']})",
        )
        logger.info("%s", describe_run(summary, run, step.backend))
    step.close()
    return summary
