"""Processes and devices: torchrun's environment, the process group, cross-rank reductions,
Ctrl-C and a clean exit.

Data parallelism itself (DDP, or the full-iteration graph's own all-reduce) depends on the graph
mode, so it lives with the rest of the graph-mode code in ``gpt_training.step``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import TrainConfig

logger = logging.getLogger("train_gpt")  # the recipe's one logger name in every module


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the run."""

    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # this run initialized the process group and must destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(cfg: TrainConfig) -> DistEnv:
    """Read torchrun's environment, pick the device, start the process group when WORLD_SIZE > 1.

    Raises:
        ValueError: ``cfg.device`` is cuda but no GPU is visible, or ``cfg.backend`` is cuda
            on a CPU.
    """
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda", local) if name == "cuda" else torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("TrainConfig.device='cuda' but no GPU is visible; use --device cpu")
        torch.cuda.set_device(device)
    if cfg.backend == "cuda" and device.type != "cuda":
        raise ValueError(
            f"TrainConfig.backend='cuda' needs a GPU, but the run is on {device}; use "
            "--backend auto or emulated"
        )
    if cfg.deterministic:
        # cuBLAS reads this when it creates its workspace (PyTorch "Reproducibility" notes).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # warn_only: an op without a deterministic kernel warns (naming itself) instead of
        # stopping the run.
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False
    owns = False
    if world > 1 and not dist.is_initialized():
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", **kw)
        owns = True
    return DistEnv(rank, world, device, owns)


def shutdown(env: DistEnv, agreed: bool) -> None:
    """Destroy the process group this run started.

    Args:
        agreed: every rank is leaving at the same point (success, or an error decided from
            all-reduced values), so a barrier cannot hang: no rank tears down while another
            still talks to it.
    """
    if env.owns_group:
        if agreed:
            dist.barrier()
        dist.destroy_process_group()


def exit_now(code: int) -> None:
    """Flush and leave without the interpreter's teardown (used under torchrun).

    With gloo, a process sometimes aborted during teardown after a successful run ("terminate
    called without an active exception": a c10d thread still joinable when static objects are
    destroyed). By now the process group is destroyed and every file is written and
    closed, so nothing is lost by skipping the teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (before reading a clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """The mean of ``t`` over the ranks (``t`` itself in one process)."""
    if env.world_size > 1:
        dist.all_reduce(t)
        t = t / env.world_size
    return t


def all_finite(tensors: list[torch.Tensor], env: DistEnv) -> bool:
    """Whether every element of ``tensors`` is finite on every rank (one host sync)."""
    bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).any().float()
    if env.world_size > 1:
        dist.all_reduce(bad)
    return bad.item() == 0


class StopOnSigint:
    """While active, Ctrl-C (SIGINT) asks the training loop to stop at a step boundary.

    The handler only sets :attr:`requested`; the loop finishes the step in flight, writes a
    checkpoint and raises ``trainer.TrainingInterrupted``, so an optimizer step is never cut in
    half.
    One process stops after the current step. Several processes may see the signal at different
    steps, so they agree at the next logging step (the flag travels with the loss's all-reduce).
    In one process a second Ctrl-C stops at once (``KeyboardInterrupt``); under torchrun the agent
    forwards the terminal's SIGINT a second time, so there it only sets the flag again.
    """

    def __init__(self, *, hard_second: bool, announce: bool) -> None:
        self.requested = False
        self.hard_second = hard_second
        self.announce = announce
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested and self.hard_second:
            raise KeyboardInterrupt
        if not self.requested and self.announce:
            logger.warning(
                "Ctrl-C: stopping after this step and writing a checkpoint"
                + (" (Ctrl-C again to stop at once)" if self.hard_second else "")
            )
        self.requested = True

    def __enter__(self) -> StopOnSigint:
        if threading.current_thread() is threading.main_thread():  # signal() works only there
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
