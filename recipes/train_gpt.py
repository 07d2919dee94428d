"""Train the toy GPT on the Python standard library's own sources, eagerly or with graphs.

    python recipes/train_gpt.py                                    # one process, defaults
    python recipes/train_gpt.py --graph full --steps 300 --out runs/full
    torchrun --standalone --nproc-per-node=2 recipes/train_gpt.py --graph layer
    python recipes/train_gpt.py --out runs/gpt --resume latest     # continue a stopped run
    python recipes/train_gpt.py --out runs/gpt --resume latest --steps 4000   # train it longer
    python recipes/generate.py --ckpt runs/gpt --prompt "def "   # decode from its latest checkpoint

``--graph none`` runs eagerly; ``layer`` graphs every transformer block (``tgraph.enable``: the
first iteration runs eagerly and is recorded, ``tgraph.create_graphs()`` captures, later
iterations replay); ``full`` captures forward, backward, all-reduce and AdamW as one graph
(``tgraph.FullIterationGraph``). All three compute the same numbers. The run directory gets
``config.json`` (resolved config), ``metrics.jsonl``, ``loss.png``, ``summary.json`` and
``checkpoints/step_NNNNNN`` (model safetensors + ``trainer.pt``: optimizer, step, RNG states,
config), each written to a temporary directory and renamed into place, so a killed run leaves
only complete checkpoints; ``checkpoints/latest`` links the newest checkpoint of the current run.

A run never loses a trained model: a fresh run into an ``--out`` that already holds checkpoints is
refused (continue it with ``--resume latest``, pick another ``--out``, or pass ``--overwrite``);
a non-finite loss stops the run before any checkpoint is written (``--on-nonfinite skip`` skips
such steps instead); every checkpoint records the sha256 of its tensors and of ``trainer.pt``,
verified on resume; Ctrl-C finishes the current step, writes a checkpoint and exits.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import hashlib
import inspect
import io
import json
import logging
import math
import os
import shutil
import signal
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tgraph
from tgraph import checkpoint
from tgraph.backend import resolve_backend
from tgraph.checkpoint import CheckpointError
from tgraph.data import BatchSampler, corpus_stats, fixed_batches, load_split
from tgraph.models.gpt import GPT, GPTConfig

logger = logging.getLogger("train_gpt")

GRAPH_MODES = ("none", "layer", "full")
NONFINITE_MODES = ("stop", "skip")
FULL_WARMUP = 3  # eager calls of the full-iteration step before its capture (DESIGN.md default)
CHECKPOINT_FORMAT = 1
MAX_SKIPPED_IN_A_ROW = 10  # --on-nonfinite skip: this many skipped steps in a row stop the run
EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT (128 + 2)


class RunDirectoryError(CheckpointError):
    """The command line does not fit what ``--out`` holds (exit code 2, like a bad argument)."""


class NonFiniteLossError(RuntimeError):
    """The loss (or the weights) became nan or inf; the run stopped before checkpointing it."""


class TrainingInterrupted(Exception):
    """Ctrl-C (SIGINT): the run stopped at a step boundary after writing a checkpoint."""

    def __init__(self, message: str, checkpoint: Path | None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


@dataclass(kw_only=True)
class TrainConfig:
    """Everything that defines a run; saved as ``<out>/config.json`` and in every checkpoint."""

    out: str = "runs/gpt"
    """Run directory (config, metrics, plot, summary, checkpoints)."""
    resume: str = ""
    """Continue from a checkpoint directory, or "latest" (<out>/checkpoints/latest); empty: fresh run."""
    overwrite: bool = False
    """Start a fresh run in an --out that already holds checkpoints, deleting them (refused otherwise)."""
    device: str = "auto"
    """"auto" (cuda if available), "cpu", "cuda" or "cuda:N" (torchrun uses cuda:LOCAL_RANK)."""
    graph: str = "layer"
    """Graph mode: "none" (eager), "layer" (per-block graphs) or "full" (whole training step)."""
    backend: str = "auto"
    """Graph backend: "auto" (cuda graphs on a GPU, emulated on CPU), "cuda" or "emulated"."""
    steps: int = 2000
    """Optimizer steps in total (a resumed run counts the steps already done; a larger value continues a finished run at min_lr)."""
    batch_size: int = 8
    """Sequences per step per rank."""
    block_size: int = 128
    """Bytes per sequence (the GPT's context length)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout probability."""
    lr: float = 2e-3
    """Peak learning rate (after warmup)."""
    min_lr: float = 2e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 30
    """Steps of linear learning-rate warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay of matrices (embeddings included); biases and norms get none."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    on_nonfinite: str = "stop"
    """A nan/inf loss or gradient: "stop" the run (checked at log and checkpoint steps, before any checkpoint is written) or "skip" the step's update (one host sync per step; not with --graph full)."""
    val_fraction: float = 0.05
    """Share of stdlib files held out for validation (split by a hash of the path)."""
    include_tests: bool = False
    """Also train on the stdlib's test directories (about 2.5x the bytes)."""
    eval_every: int = 100
    """Validation loss every this many steps (and at the end); 0: only at the end."""
    eval_batches: int = 8
    """Batches of batch_size sequences per validation (fixed, evenly spaced windows)."""
    ckpt_every: int = 250
    """Checkpoint every this many steps (and at the end); 0: only at the end."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept on disk; older ones are deleted."""
    log_every: int = 10
    """Metrics line (and progress-bar update) every this many steps."""
    seed: int = 1337
    """Seed of the initial weights; rank r draws dropout and batches from seeds derived from it."""
    deterministic: bool = False
    """Deterministic kernels where PyTorch has them (others warn); slower on a GPU."""
    progress: bool = True
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"TrainConfig.{name}={getattr(self, name)!r} is invalid: {fix}")

        if self.graph not in GRAPH_MODES:
            raise bad("graph", "use --graph none, layer or full")
        if self.backend not in ("auto", "cuda", "emulated"):
            raise bad("backend", "use --backend auto, cuda or emulated")
        if self.on_nonfinite not in NONFINITE_MODES:
            raise bad("on_nonfinite", "use --on-nonfinite stop or skip")
        if self.on_nonfinite == "skip" and self.graph == "full":
            # A captured step always applies its update: the host cannot skip part of a graph.
            raise bad(
                "on_nonfinite", "skip needs --graph none or layer; use stop with --graph full"
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise bad("device", "use --device auto, cpu, cuda or cuda:N")
        for name in (
            "steps",
            "batch_size",
            "block_size",
            "n_layer",
            "n_head",
            "n_embd",
            "eval_batches",
            "log_every",
            "keep_checkpoints",
        ):
            if getattr(self, name) <= 0:
                raise bad(name, f"--{name.replace('_', '-')} must be a positive integer")
        for name in ("warmup_steps", "eval_every", "ckpt_every"):
            if getattr(self, name) < 0:
                raise bad(name, f"--{name.replace('_', '-')} must be 0 or more")
        if self.n_embd % self.n_head:
            raise bad("n_head", f"it must divide n_embd={self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise bad("dropout", "use a probability in [0, 1)")
        if not 0.0 < self.min_lr <= self.lr:
            raise bad("min_lr", f"use 0 < min_lr <= lr={self.lr}")
        if not 0.0 < self.val_fraction < 1.0:
            raise bad("val_fraction", "use a fraction strictly between 0 and 1 (e.g. 0.05)")
        if self.grad_clip < 0 or self.weight_decay < 0:
            raise bad("grad_clip" if self.grad_clip < 0 else "weight_decay", "use 0 or more")

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
        )


# Fields that may differ between a checkpoint and the run resuming it: they change where output
# goes or how often things are reported, not the numbers (the three graph modes compute the same).
# ``steps`` only moves where the run stops: the learning-rate schedule keeps the horizon of the
# run's first start (see lr_at), so a resumed run computes the same numbers step for step.
RESUME_MAY_CHANGE = frozenset(
    {
        "out",
        "resume",
        "overwrite",
        "steps",
        "on_nonfinite",
        "device",
        "graph",
        "backend",
        "deterministic",
        "eval_every",
        "eval_batches",
        "ckpt_every",
        "keep_checkpoints",
        "log_every",
        "progress",
    }
)


# ---------------------------------------------------------------------------------------------
# Command line: one flag per TrainConfig field, help text from the field's docstring.


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (not kept by Python, so read from the source)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for prev, node in zip(body, body[1:]):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
        ):
            docs[prev.target.id] = " ".join(str(node.value.value).split())
    return docs


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit with code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """Build a :class:`TrainConfig` from command-line flags (``--batch-size 8`` or ``--batch_size 8``).

    Raises:
        SystemExit: unknown flag or invalid value (one line naming the flag; exit code 2).
    """
    parser = OneLineErrorParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    docs = _field_docs(TrainConfig)
    types = {"int": int, "float": float, "str": str, "bool": bool}
    for f in dataclasses.fields(TrainConfig):
        flags = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
        kind = types[str(f.type)]
        choices = {"graph": GRAPH_MODES, "on_nonfinite": NONFINITE_MODES}
        extra = {"choices": choices[f.name]} if f.name in choices else {}
        if kind is bool:
            parser.add_argument(
                *flags,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=docs.get(f.name),
            )
        else:
            parser.add_argument(
                *flags, dest=f.name, type=kind, default=f.default, help=docs.get(f.name), **extra
            )
    args = parser.parse_args(argv)
    try:
        return TrainConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))


# ---------------------------------------------------------------------------------------------
# Processes and devices.


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # this run initialized the process group and must destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(cfg: TrainConfig) -> DistEnv:
    """Read torchrun's environment, pick the device, start the process group when WORLD_SIZE > 1."""
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


def lr_at(step: int, cfg: TrainConfig, decay_steps: int | None = None) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup, then cosine decay to ``min_lr``.

    Args:
        step: the step.
        cfg: warmup, peak and final learning rates.
        decay_steps: where the cosine reaches ``min_lr``; None: ``cfg.steps``. A run keeps the
            horizon of its first start through every resume, so a finished run continued with a
            larger ``--steps`` trains on at ``min_lr``. Stretching the cosine to the new total
            instead would raise the learning rate again right after the resume (a jump from
            ``min_lr`` back towards ``lr`` that undoes part of the annealing and spikes the loss);
            holding it keeps the schedule continuous and never changes the learning rate of a
            step already taken, so an interrupted run resumes bit for bit whatever ``--steps``.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max((cfg.steps if decay_steps is None else decay_steps) - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    """AdamW, the same in every graph mode so the three modes compute the same numbers.

    Weight decay on matrices only (nanoGPT). A graph cannot contain AdamW's default step, which
    reads the step count on the host: on a GPU use ``capturable=True``, on the CPU ``fused=True``
    (``capturable`` is CUDA-only). The learning rate lives in a float32 device tensor per group
    that :func:`set_lr` refills in place, so a captured step reads each step's value.
    """
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kind = {"capturable": True} if device.type == "cuda" else {"fused": True}
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **kind)
    tensor_lrs(opt, device)
    return opt


def tensor_lrs(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Give every param_group its own float32 ``lr`` tensor on ``device`` (also after
    ``load_state_dict``, which brings back the checkpoint's CPU tensors)."""
    for g in opt.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=device)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into the groups' lr tensors in place (no host sync; graphs see it)."""
    for g in opt.param_groups:
        g["lr"].fill_(lr)


# ---------------------------------------------------------------------------------------------
# Checkpoints: <out>/checkpoints/step_NNNNNN/{model files from tgraph.checkpoint, trainer.pt}.


def _checkpoint_dirs(root: Path) -> list[Path]:
    dirs = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(dirs, key=_step_of)


def _step_of(path: Path) -> int:
    return int(path.name[5:])


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` links (the newest of the current run), or None.

    Without a usable link (a directory copied without it) the highest step stands in.
    """
    if not root.is_dir():
        return None
    try:
        return checkpoint.find_checkpoint(root)
    except FileNotFoundError:
        return None


def earlier_checkpoints_hint(path: Path) -> str:
    """``--resume`` advice naming the newest checkpoint of ``path``'s run that precedes it."""
    earlier = []
    if path.name.startswith("step_") and path.name[5:].isdigit():
        earlier = [d for d in _checkpoint_dirs(path.parent) if _step_of(d) < _step_of(path)]
    if not earlier:
        return "Resume from an earlier checkpoint (--resume DIR) or start a fresh run"
    return f"Resume from an earlier checkpoint: --resume {earlier[-1]}"


def resolve_resume(cfg: TrainConfig) -> Path | None:
    """The checkpoint directory ``cfg.resume`` names, or None for a fresh run.

    Raises:
        CheckpointError: "latest" with no complete checkpoint under ``<out>/checkpoints``.
    """
    if not cfg.resume:
        return None
    if cfg.resume != "latest":
        return Path(cfg.resume)
    root = Path(cfg.out) / "checkpoints"
    found = latest_checkpoint(root)
    if found is None:
        raise CheckpointError(
            f"--resume latest: no checkpoint under {root}; expected directories step_NNNNNN "
            "written by this recipe. Check --out, or start a fresh run without --resume."
        )
    return found


def claim_run_directory(cfg: TrainConfig, resume_dir: Path | None, env: DistEnv) -> None:
    """Make sure this run may write checkpoints under ``<out>/checkpoints``.

    A fresh run into a directory that holds another run's checkpoints would interleave its
    checkpoints with the old ones (pruning and ``latest`` would mix the two runs), so it is
    refused unless ``--overwrite`` is given, which deletes them (rank 0, before any training).

    Raises:
        RunDirectoryError: the directory holds checkpoints this run does not continue, without
            ``--overwrite``; or ``--overwrite`` would delete the checkpoint being resumed.
    """
    root = Path(cfg.out) / "checkpoints"
    existing = _checkpoint_dirs(root) if root.is_dir() else []
    if not existing:
        return
    continues = resume_dir is not None and resume_dir.resolve().parent == root.resolve()
    if continues and cfg.overwrite:
        raise RunDirectoryError(
            f"--overwrite would delete {resume_dir}, the checkpoint you resume from: drop "
            "--overwrite to continue the run, or drop --resume to start it afresh"
        )
    if continues:
        return
    newest = latest_checkpoint(root)
    if not cfg.overwrite:
        raise RunDirectoryError(
            f"{cfg.out} already holds a run (newest checkpoint {newest}). Continue it with "
            f"--resume latest (add --steps N to train longer), choose another --out, or pass "
            "--overwrite to delete its checkpoints and start afresh"
        )
    if env.is_main:
        logger.warning("--overwrite: deleting %d checkpoints under %s", len(existing), root)
        for d in existing:
            shutil.rmtree(d)
        for name in ("latest", ".latest-tmp"):
            with contextlib.suppress(FileNotFoundError):
                (root / name).unlink()
        with contextlib.suppress(FileNotFoundError):
            (Path(cfg.out) / "summary.json").unlink()
    if env.world_size > 1:
        dist.barrier()  # no rank starts before the old checkpoints are gone


def read_checkpoint(path: Path, cfg: TrainConfig, world_size: int) -> dict:
    """Load and check ``path/trainer.pt`` against the current run.

    Returns:
        The trainer state: ``step``, ``optimizer``, ``rng`` (one entry per rank), ``config``.

    Raises:
        CheckpointError: missing directory or file, unreadable file, or a configuration (or
            world size) that differs from the checkpoint's in a field that changes the numbers.
    """
    if not path.is_dir():
        raise CheckpointError(
            f"no checkpoint at {path}: expected a directory written by recipes/train_gpt.py, "
            f"e.g. {cfg.out}/checkpoints/step_000200, or --resume latest"
        )
    file = path / "trainer.pt"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: trainer.pt is missing. This recipe renames a "
            "checkpoint into place only once every file is written, so the directory was copied "
            "or edited partially; resume from another checkpoint in its parent directory."
        )
    recorded = _recorded_trainer_sha256(path)
    data = file.read_bytes()
    if recorded is not None and hashlib.sha256(data).hexdigest() != recorded:
        raise CheckpointError(
            f"checkpoint {path} is damaged: the sha256 of {file} differs from the one recorded "
            f"in {path / checkpoint.CONFIG_NAME} when it was saved. {earlier_checkpoints_hint(path)}"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} is damaged: {file} cannot be read ({type(e).__name__}: {e}). "
            f"{earlier_checkpoints_hint(path)}"
        ) from e
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {path}: trainer.pt has format {state.get('format') if isinstance(state, dict) else None!r},"
            f" expected {CHECKPOINT_FORMAT}; it was not written by this version of the recipe"
        )
    now = asdict(cfg)
    diffs = [
        f"{k}={state['config'].get(k)!r} in the checkpoint but {v!r} now"
        for k, v in now.items()
        if k not in RESUME_MAY_CHANGE and state["config"].get(k) != v
    ]
    if state["world_size"] != world_size:
        diffs.append(
            f"world size {state['world_size']} in the checkpoint but {world_size} now "
            "(each rank resumes its own data shard and RNG streams)"
        )
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} does not match this run: {'; '.join(diffs)}. Resume with the "
            f"checkpoint's settings (see {file.parent.parent.parent / 'config.json'}) or start a "
            "fresh run with another --out."
        )
    return state


def _recorded_trainer_sha256(path: Path) -> str | None:
    """The sha256 of ``trainer.pt`` recorded in the checkpoint's config.json (None: not recorded)."""
    with contextlib.suppress(FileNotFoundError, CheckpointError):
        _, extra = checkpoint.read_config(path)
        if isinstance(extra, dict) and isinstance(extra.get("trainer_sha256"), str):
            return extra["trainer_sha256"]
    return None  # a missing or corrupt config.json is reported when the weights load


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """Copy the weights of checkpoint ``path`` into ``model`` (strict: names and shapes).

    The weights' sha256 checksums are verified (``tgraph.checkpoint.load_state_dict``).

    Raises:
        CheckpointError: the model files are missing, damaged or of another shape.
    """
    try:
        checkpoint.load_into(model, path)
    except (FileNotFoundError, CheckpointError) as e:
        raise CheckpointError(
            f"cannot resume from {path}: {e}. {earlier_checkpoints_hint(path)}"
        ) from e


def rng_state(sampler: BatchSampler, device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state(), "data": sampler.state_dict()["generator"]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, sampler: BatchSampler, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    sampler.load_state_dict({"generator": state["data"]})
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    root: Path,
    step: int,
    model,
    opt,
    sampler,
    cfg: TrainConfig,
    env: DistEnv,
    extra_meta: dict,
    lr_decay_steps: int,
) -> Path:
    """Write ``root/step_NNNNNN`` atomically (every rank calls this: RNG states are gathered).

    Files go to ``root/.tmp-step_NNNNNN``, are flushed to disk, and the directory is renamed into
    place; ``root/latest`` is then re-pointed with an atomic symlink swap. ``trainer.pt`` is
    written first and its sha256 recorded in ``config.json`` next to the weights' checksums.

    Pruning keeps the ``keep_checkpoints`` newest checkpoints at or below ``step``: those of
    this run. Higher steps (left by a run resumed from an earlier checkpoint) are never pruned
    in their favour; this run replaces each of them when it writes that step.

    Returns:
        The checkpoint directory.
    """
    rngs = [rng_state(sampler, env.device)]
    if env.world_size > 1:
        rngs = [None] * env.world_size
        dist.all_gather_object(rngs, rng_state(sampler, env.device))
    final = root / f"step_{step:06d}"
    if env.is_main:
        tmp = root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        state = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "optimizer": opt.state_dict(),
            "rng": rngs,
            "config": asdict(cfg),
            "world_size": env.world_size,
            "lr_decay_steps": lr_decay_steps,
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        checkpoint.atomic_write_bytes(tmp / "trainer.pt", buf.getvalue())
        meta = {"train_config": asdict(cfg), "step": step, **extra_meta}
        meta["trainer_sha256"] = hashlib.sha256(buf.getvalue()).hexdigest()
        checkpoint.save(model, tmp, extra=meta)
        if final.exists():  # the same step written again (a resumed run): swap it out first
            old = root / f".old-{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        link = root / ".latest-tmp"
        with contextlib.suppress(FileNotFoundError):
            link.unlink()
        link.symlink_to(final.name)
        os.replace(link, root / "latest")
        this_run = [d for d in _checkpoint_dirs(root) if _step_of(d) <= step]
        for old in this_run[: -cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
    if env.world_size > 1:
        dist.barrier()  # nobody resumes from, or races ahead of, a half-written checkpoint
    return final


# ---------------------------------------------------------------------------------------------
# Metrics and the plot.


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


def peak_memory_mb(device: torch.device) -> float:
    """Peak CUDA memory allocated by tensors, or the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------------
# The training loop.


def all_reduce_mean(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    if env.world_size > 1:
        dist.all_reduce(t)
        t = t / env.world_size
    return t


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


class StopOnSigint:
    """While active, Ctrl-C (SIGINT) asks the training loop to stop at a step boundary.

    The handler only sets :attr:`requested`; the loop finishes the step in flight, writes a
    checkpoint and raises :class:`TrainingInterrupted`, so an optimizer step is never cut in half.
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
        if env.owns_group:
            if agreed:
                dist.barrier()  # no rank tears down while another still talks to it
            dist.destroy_process_group()


def _nonfinite(done: int, what: str, last_ckpt: Path | None, fix: str) -> NonFiniteLossError:
    return NonFiniteLossError(
        f"step {done}: {what} is not finite (nan or inf); stopped before writing a checkpoint, so "
        f"no checkpoint holds it (newest: {last_ckpt or 'none yet'}). {fix}"
    )


NONFINITE_FIX = (
    "Lower --lr, keep --grad-clip above 0, resume from an earlier checkpoint, or pass "
    "--on-nonfinite skip to skip such steps"
)


def _all_finite(tensors: list[torch.Tensor], env: DistEnv) -> bool:
    """Whether every element of ``tensors`` is finite on every rank (one host sync)."""
    bad = torch.stack([~torch.isfinite(t).all() for t in tensors]).any().float()
    if env.world_size > 1:
        dist.all_reduce(bad)
    return bad.item() == 0


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


def _train(cfg: TrainConfig, env: DistEnv) -> dict:
    run = Path(cfg.out)
    ckpt_root = run / "checkpoints"
    resume_dir = resolve_resume(cfg)
    claim_run_directory(cfg, resume_dir, env)
    state = read_checkpoint(resume_dir, cfg, env.world_size) if resume_dir else None
    start = state["step"] if state else 0
    if state and start >= cfg.steps:
        raise RunDirectoryError(
            f"checkpoint {resume_dir} is at step {start} and --steps is {cfg.steps}: nothing to "
            f"do. Pass --steps larger than {start} to train it longer (the learning rate stays "
            "at --min-lr after the run's original end)"
        )
    # The cosine horizon of the run's first start, kept by every resume (see lr_at).
    decay_steps = state.get("lr_decay_steps", state["config"]["steps"]) if state else cfg.steps

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg.gpt_config()).to(env.device)
    if resume_dir:
        load_model_weights(model, resume_dir)
    torch.manual_seed(cfg.seed + 1 + env.rank)  # per-rank dropout stream
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
    opt = make_optimizer(model, cfg, env.device)
    if state:
        opt.load_state_dict(state["optimizer"])
        tensor_lrs(opt, env.device)
        set_rng_state(state["rng"][env.rank], sampler, env.device)
        logger.info("resumed from %s at step %d", resume_dir, start)

    # Data parallelism. Eager and per-layer graphs use DDP: per-layer graphs return parameter
    # gradients through autograd, so DDP's hooks fire as usual. A full-iteration graph holds the
    # whole step, and DDP's reducer (Python-side bucketing, rebuilt after the first iterations)
    # does not belong in one: it all-reduces a flat gradient buffer itself, inside the graph.
    params = list(model.parameters())
    net: torch.nn.Module = model
    if env.world_size > 1 and cfg.graph != "full":
        net = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    elif env.world_size > 1:
        for p in params:
            dist.broadcast(p.data, src=0)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step; returns the loss, or None when --on-nonfinite skip skipped it."""
        opt.zero_grad(set_to_none=True)
        _, loss = net(x, y)
        loss.backward()
        if env.world_size > 1 and cfg.graph == "full":
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # one all-reduce in all
            dist.all_reduce(flat)
            flat /= env.world_size
            for p, chunk in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(chunk.view_as(p))
        if cfg.on_nonfinite == "skip":
            # The one host sync per step that skipping costs (never with --graph full). The
            # gradients are all-reduced already; the flag is too, so every rank skips together.
            grads = [p.grad for p in params if p.grad is not None]
            if not _all_finite([loss.detach(), *grads], env):
                return None
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        opt.step()
        return loss.detach()

    step_fn = train_step
    full_graph = None
    if cfg.graph == "layer":
        tgraph.enable(net, backend=cfg.backend)
    elif cfg.graph == "full":
        full_graph = tgraph.FullIterationGraph(
            lambda batch: train_step(*batch), warmup_steps=FULL_WARMUP, backend=cfg.backend
        )
        step_fn = lambda x, y: full_graph((x, y))  # noqa: E731
    graph_backend = None
    if cfg.graph != "none":
        with contextlib.suppress(ValueError):  # enable / FullIterationGraph report bad values
            graph_backend = resolve_backend(cfg.backend, env.device)

    if env.is_main:
        logger.info(
            "training a %.2fM-parameter GPT, steps %d to %d, --graph %s on %s; outputs in %s/",
            sum(p.numel() for p in params) / 1e6,
            start,
            cfg.steps,
            cfg.graph,
            env.device,
            run,
        )
        if graph_backend == "emulated":
            logger.info(
                "graphs are emulated (no GPU): tgraph's CPU stand-in for CUDA graphs runs the "
                "same record/capture/replay code and catches the same bugs, but is not faster "
                "than eager; the speed-up needs a GPU"
            )
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
    metrics = Metrics(run / "metrics.jsonl", env.is_main, start if state else None)
    tokens_per_step = cfg.batch_size * cfg.block_size * env.world_size
    bar = None
    if env.is_main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start, desc=f"train ({cfg.graph})", unit="step")

    def sync() -> None:
        if env.device.type == "cuda":
            torch.cuda.synchronize(env.device)

    capture_s = 0.0
    intervals: list[tuple[float, bool]] = []  # (ms per step, interval contained a capture)
    # The first interval is never steady state (first-call overheads, recording, capture).
    loss_sum, n_sum, dirty = torch.zeros((), device=env.device), 0, True
    last_train = last_val = float("nan")
    last_ckpt = resume_dir
    skipped = skipped_in_a_row = 0
    sync()
    wall0 = t0 = time.perf_counter()
    # Non-finite losses are caught without a host sync per step: the loss sum is read at every
    # logging step (the read that logging does anyway), and before every checkpoint the losses
    # since the last read and the weights are checked, so no checkpoint ever holds nan or inf.
    with StopOnSigint(hard_second=env.world_size == 1, announce=env.is_main) as stop:
        for step in range(start, cfg.steps):
            lr = lr_at(step, cfg, decay_steps)
            set_lr(opt, lr)
            x, y = sampler.next()
            x, y = x.to(env.device, non_blocking=True), y.to(env.device, non_blocking=True)
            tc = time.perf_counter()
            loss = step_fn(x, y)
            if full_graph is not None and step - start == FULL_WARMUP:
                sync()  # this call captured the graph (and replayed it once: this step's update)
                capture_s, dirty = time.perf_counter() - tc, True
            if cfg.graph == "layer" and step == start:
                # Record one validation forward too (eval mode, no grad, validation's batch
                # shape), so create_graphs() captures a graph for it and validation replays
                # instead of falling back to eager with a warning. Its loss is discarded; it
                # draws no RNG.
                evaluate(model, val_batches[:1], env)
                report = tgraph.create_graphs()
                capture_s, dirty = report.seconds, True  # create_graphs() logs the report
            done = step + 1
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
                dt = time.perf_counter() - t0
                if n_sum:
                    ms = 1000 * dt / n_sum
                    intervals.append((ms, dirty))
                    row = dict(
                        kind="train",
                        step=done,
                        loss=last_train,
                        lr=lr,
                        ms_per_step=ms,
                        tokens_per_s=tokens_per_step * n_sum / dt,
                        peak_mem_mb=peak_memory_mb(env.device),
                        graph=cfg.graph,
                        capture_s=capture_s,
                    )
                    metrics.write(**row)
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{last_train:.3f}", tok_s=f"{row['tokens_per_s']:.0f}"
                        )
                loss_sum, n_sum, dirty = torch.zeros((), device=env.device), 0, False
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                last_val = evaluate(model, val_batches, env)
                if not math.isfinite(last_val):
                    raise _nonfinite(done, "the validation loss", last_ckpt, NONFINITE_FIX)
                metrics.write(kind="val", step=done, loss=last_val, graph=cfg.graph)
                logger.info("step %d: val loss %.4f", done, last_val)
            if (cfg.ckpt_every and done % cfg.ckpt_every == 0) or done == cfg.steps or stopping:
                if not _all_finite([loss_sum, *params], env):
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
                    f"--out {cfg.out} --resume latest",
                    last_ckpt,
                )
            if done % cfg.log_every == 0:
                sync()  # the next interval starts after validation and checkpoint work
                t0 = time.perf_counter()
            elif done % cfg.log_every and (
                (cfg.eval_every and done % cfg.eval_every == 0)
                or (cfg.ckpt_every and done % cfg.ckpt_every == 0)
            ):
                dirty = True  # validation or a checkpoint inside the interval: not steady state
    wall = time.perf_counter() - wall0
    if bar is not None:
        bar.close()
    steady = [ms for ms, d in intervals if not d] or [ms for ms, _ in intervals]
    ms_med = statistics.median(steady) if steady else float("nan")
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
        logger.info("%s", describe_run(summary, run, graph_backend))
    if cfg.graph == "layer":
        tgraph.disable(net)
    return summary


def run_cli(cfg: TrainConfig, rank: int) -> int:
    """Train; report the errors a user can act on in one line. Returns the exit code."""
    try:
        train(cfg)
    except RunDirectoryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (CheckpointError, FileNotFoundError, NonFiniteLossError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except TrainingInterrupted as e:
        if rank == 0:
            print(str(e), file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # before the loop, or a second Ctrl-C: no checkpoint written now
        if rank == 0:
            newest = latest_checkpoint(Path(cfg.out) / "checkpoints")
            print(
                f"interrupted (Ctrl-C); no checkpoint written now, newest: {newest or 'none'}",
                file=sys.stderr,
            )
        return EXIT_INTERRUPTED
    return 0


def exit_now(code: int) -> None:
    """Flush and leave without the interpreter's teardown (used under torchrun).

    With gloo, a process sometimes aborted during teardown after a successful run ("terminate
    called without an active exception": a c10d thread still joinable when static objects are
    destroyed; issue 13). By now the process group is destroyed and every file is written and
    closed, so nothing is lost by skipping the teardown.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(argv)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    several = int(os.environ.get("WORLD_SIZE", 1)) > 1
    try:
        code = run_cli(cfg, rank)
    except BaseException:
        if several:
            traceback.print_exc()
            exit_now(1)
        raise
    if several:
        exit_now(code)
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
