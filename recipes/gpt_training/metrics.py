"""What a run reports: ``metrics.jsonl`` (rank 0), step times, peak memory, the plot, the final report.

A train line carries the loss, the learning rate, ms per step, tokens/s, peak memory and the
capture time; a val line the validation loss. Step times are measured per logging interval
(synchronized before the clock is read); the summary's speed is the median of the steady
intervals, those without first-call overheads, a capture, validation or a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tgraph.toy.corpus import corpus_stats

from .config import TrainConfig
from .parallel import DistEnv, synchronize

logger = logging.getLogger("train_gpt")  # the recipe's one logger name in every module


class Metrics:
    """Rank 0's metrics file ``metrics.jsonl`` (one JSON object per line, ``kind`` train/val)."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None) -> None:
        self.path = path
        self.enabled = enabled
        if enabled:
            keep = []
            if resume_step is not None and path.exists():  # drop lines past the checkpoint
                keep = [
                    ln
                    for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= resume_step
                ]
            path.write_text("".join(ln + "\n" for ln in keep))

    def write(self, **row) -> None:
        if self.enabled:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")


class StepTimes:
    """Milliseconds per step of each logging interval, and their steady median.

    The first interval is never steady (first-call overheads, recording, capture); the trainer
    marks any other interval that held a capture, validation or a checkpoint with
    :meth:`unsteady`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.intervals: list[tuple[float, bool]] = []  # (ms per step, held unsteady work)
        self.dirty = True
        self.start()

    def start(self) -> None:
        """Begin an interval once the device's queued work is done."""
        synchronize(self.device)
        self.t0 = time.perf_counter()

    def unsteady(self) -> None:
        self.dirty = True

    def close(self, steps: int) -> float:
        """End the interval at a logging step (the caller has synced the device by reading the
        loss). Returns its seconds; ``steps`` > 0 records its ms per step."""
        seconds = time.perf_counter() - self.t0
        if steps:
            self.intervals.append((1000 * seconds / steps, self.dirty))
        self.dirty = False
        return seconds

    def median_ms(self) -> float:
        """Median ms per step of the steady intervals (of all, when none was steady)."""
        steady = [ms for ms, d in self.intervals if not d] or [ms for ms, _ in self.intervals]
        return statistics.median(steady) if steady else float("nan")


def write_config(
    cfg: TrainConfig, env: DistEnv, run: Path, resume_dir: Path | None, model: dict | None = None
) -> None:
    """``<out>/config.json``: the config, and what it resolved to (rank 0); ``model`` is the
    model spec's part (``ModelSpec.resolved``), the toy GPT's config by default."""
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
        **(model if model is not None else {"gpt": cfg.gpt_config().to_dict()}),
    }
    (run / "config.json").write_text(
        json.dumps({"train": dataclasses.asdict(cfg), "resolved": resolved}, indent=2) + "\n"
    )


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors, or the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def plot_losses(metrics_path: Path, png_path: Path, title: str) -> None:
    """Training and validation loss against step, from ``metrics.jsonl``, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning('matplotlib is not installed, no plot; pip install "tgraph[plot]"')
        return
    rows = [json.loads(ln) for ln in metrics_path.read_text().splitlines() if ln.strip()]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, style in (("train", "-"), ("val", "o-")):
        pts = [(r["step"], r["loss"]) for r in rows if r["kind"] == kind]
        if pts:
            ax.plot(*zip(*pts), style, label=f"{kind} loss", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def describe_run(summary: dict, run: Path, backend: str | None) -> str:
    """The final report: what ran, the losses and speed in rounded units, where outputs are."""
    graphs = "no graphs" if backend is None else f"{backend} graphs"
    procs = f"{summary['world_size']} processes" if summary["world_size"] > 1 else "1 process"
    skipped = f", {summary['skipped_steps']} steps skipped" if summary["skipped_steps"] else ""
    resumed = f", resumed at step {summary['resumed_at']}" if summary["resumed_at"] else ""
    latest = run / "checkpoints" / "latest"
    target = os.readlink(latest) if latest.is_symlink() else "?"
    return (
        f"done: {summary['steps']} steps (--graph {summary['graph']}, {graphs} on "
        f"{summary['device']}, {procs}{resumed}) in {summary['wall_s']:.1f} s{skipped}\n"
        f"  train loss {summary['final_train_loss']:.4f}, val loss "
        f"{summary['final_val_loss']:.4f} (nats/byte)\n"
        f"  {summary['median_ms_per_step']:.1f} ms/step, {summary['tokens_per_s']:,.0f} tokens/s "
        f"(median of steady intervals), capture {summary['capture_s']:.2f} s, peak memory "
        f"{summary['peak_mem_mb']:,.0f} MB\n"
        f"  outputs in {run}/: config.json, metrics.jsonl, loss.png, summary.json, "
        f"checkpoints/latest -> {target}"
    )
