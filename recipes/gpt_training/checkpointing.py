"""Checkpoints: ``<out>/checkpoints/step_NNNNNN/{model files, trainer.pt}`` and the run directory's rules.

A checkpoint holds the weights (the model spec's files: safetensors with a manifest of a sha256 per
tensor, ``spec.ModelSpec.save_weights``) and ``trainer.pt`` (optimizer, step, every rank's RNG
states, config), its sha256 recorded in the weights' manifest. Each is written to a temporary directory and renamed into place, so a killed run leaves
only complete checkpoints; ``checkpoints/latest`` links the newest checkpoint of the current run.
A fresh run never writes into a directory holding another run's checkpoints without
``--overwrite``; a resume checks the checkpoint's config against the run's, except the run-only
fields (``TrainConfig.run_only_fields``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from tgraph.toy import checkpoint
from tgraph.toy.checkpoint import CheckpointError
from tgraph.toy.corpus import BatchSampler

from .config import TrainConfig
from .parallel import DistEnv
from .spec import GPT_SPEC, ModelSpec

logger = logging.getLogger("train_gpt")  # the recipe's one logger name in every module

CHECKPOINT_FORMAT = 1


class RunDirectoryError(CheckpointError):
    """The command line does not fit what ``--out`` holds (exit code 2, like a bad argument)."""


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


def prepare_run_directory(out: Path) -> None:
    """Create ``out`` if needed and make sure this process can write into it.

    Raises:
        RunDirectoryError: ``out`` is a file, lies under a file, or cannot be created or written
            (one line naming the path and the reason).
    """
    if out.exists() and not out.is_dir():
        raise RunDirectoryError(f"--out {out} is a file, not a directory; pass another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        raise RunDirectoryError(
            f"--out {out} cannot be used as a run directory ({e.strerror or e}{where}); pass "
            "an --out you can write"
        ) from e


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


RUN_FILES = frozenset({"config.json", "metrics.jsonl", "loss.png", "summary.json", "checkpoints"})
"""What a run writes into ``--out``; anything else there is the user's, never overwritten."""


def claim_run_directory(cfg: TrainConfig, resume_dir: Path | None, env: DistEnv) -> None:
    """Make sure this run may write its files and checkpoints into ``--out``.

    A run writes ``config.json``, ``metrics.jsonl``, ``loss.png``, ``summary.json`` and
    ``checkpoints/`` (:data:`RUN_FILES`). Only a run that continues the one in ``--out`` (its
    checkpoint lies under ``<out>/checkpoints``) may write into a directory that holds any of them;
    any other run needs an empty or new directory, or ``--overwrite``, which replaces that run's
    files (rank 0 deletes its checkpoints, summary and plot before any training). A directory
    holding anything else (a model, the user's files) is never written into: ``--overwrite``
    does not apply to files this recipe did not write.

    Raises:
        RunDirectoryError: the directory holds another run's files, without ``--overwrite``; files
            this recipe did not write; or ``--overwrite`` would delete the checkpoint resumed.
    """
    out = Path(cfg.out)
    root = out / "checkpoints"
    existing = _checkpoint_dirs(root) if root.is_dir() else []
    continues = resume_dir is not None and resume_dir.resolve().parent == root.resolve()
    if continues and cfg.overwrite and existing:
        raise RunDirectoryError(
            f"--overwrite would delete {resume_dir}, the checkpoint you resume from: drop "
            "--overwrite to continue the run, or drop --resume to start it afresh"
        )
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() and not continues else []
    foreign = [name for name in entries if name not in RUN_FILES]
    if foreign:
        shown = ", ".join(foreign[:4]) + (
            f" and {len(foreign) - 4} more" if len(foreign) > 4 else ""
        )
        raise RunDirectoryError(
            f"--out {out} is not empty and holds files this recipe did not write ({shown}); a "
            "run would overwrite its config.json and metrics there. Pass an empty or new --out"
        )
    newest = latest_checkpoint(root)
    if entries and not cfg.overwrite and resume_dir is not None:
        raise RunDirectoryError(
            f"--resume {cfg.resume} is not a checkpoint of the run in {cfg.out} (newest "
            f"checkpoint {newest or 'none'}), and a run resumed from it would mix its files with "
            f"that run's. Continue {cfg.out}'s own run with --resume latest, or resume "
            f"{cfg.resume} into an empty or new --out"
        )
    if entries and not cfg.overwrite and newest is None:
        raise RunDirectoryError(
            f"{cfg.out} already holds a run's files ({', '.join(entries)}) but no checkpoint to "
            "continue. Choose an empty or new --out, or pass --overwrite to replace them"
        )
    if entries and not cfg.overwrite:
        raise RunDirectoryError(
            f"{cfg.out} already holds a run (newest checkpoint {newest}). Continue it with "
            "--resume latest (add --steps N to train longer), choose an empty or new --out, or "
            "pass --overwrite to delete its checkpoints and start afresh"
        )
    if entries and env.is_main:
        logger.warning("--overwrite: deleting the run in %s (%d checkpoints)", out, len(existing))
        for d in existing:
            shutil.rmtree(d)
        for name in ("latest", ".latest-tmp"):
            with contextlib.suppress(FileNotFoundError):
                (root / name).unlink()
        for name in ("summary.json", "loss.png"):
            with contextlib.suppress(FileNotFoundError):
                (out / name).unlink()
    if env.world_size > 1:
        dist.barrier()  # every rank has looked at --out before any rank writes into it


def read_checkpoint(
    path: Path, cfg: TrainConfig, world_size: int, spec: ModelSpec = GPT_SPEC
) -> dict:
    """Load and check ``path/trainer.pt`` against the current run.

    Returns:
        The trainer state: ``step``, ``optimizer``, ``rng`` (one entry per rank), ``config``.

    Raises:
        CheckpointError: missing directory or file, unreadable file, or a configuration (or
            world size) that differs from the checkpoint's in a field that changes the numbers.
    """
    if not path.is_dir():
        raise CheckpointError(
            f"no checkpoint at {path}: expected a directory written by {spec.recipe}, "
            f"e.g. {cfg.out}/checkpoints/step_000200, or --resume latest"
        )
    file = path / "trainer.pt"
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: trainer.pt is missing. This recipe renames a "
            "checkpoint into place only once every file is written, so the directory was copied "
            "or edited partially; resume from another checkpoint in its parent directory."
        )
    recorded = _recorded_trainer_sha256(path, spec)
    data = file.read_bytes()
    if hashlib.sha256(data).hexdigest() != recorded:
        raise CheckpointError(
            f"checkpoint {path} is damaged: the sha256 of {file} differs from the one recorded "
            f"in {path / spec.manifest_name} when it was saved. {earlier_checkpoints_hint(path)}"
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
    may_change = cfg.run_only_fields()  # the RunOnly groups' fields (config.py)
    diffs = [
        f"{k}={state['config'].get(k)!r} in the checkpoint but {v!r} now"
        for k, v in asdict(cfg).items()
        if k not in may_change and state["config"].get(k) != v
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


def _recorded_trainer_sha256(path: Path, spec: ModelSpec) -> str:
    """The sha256 of ``trainer.pt`` recorded in the checkpoint's manifest (the toy's config.json).

    Nothing is resumed unverified: a missing or unreadable manifest, or one without the
    digest, refuses the checkpoint (training on would write a new checkpoint with fresh
    checksums of whatever was loaded, laundering the damage).

    Raises:
        CheckpointError: naming the file and an earlier checkpoint to resume from.
    """
    config = path / spec.manifest_name
    try:
        extra = spec.read_extra(path)
    except (FileNotFoundError, CheckpointError) as e:
        raise CheckpointError(
            f"cannot resume from {path}: {e}. Without {config} its checksums cannot be "
            f"verified. {earlier_checkpoints_hint(path)}"
        ) from e
    digest = extra.get("trainer_sha256") if isinstance(extra, dict) else None
    if not isinstance(digest, str):
        raise CheckpointError(
            f"cannot resume from {path}: {config} records no sha256 of trainer.pt, so it cannot "
            f"be verified. {earlier_checkpoints_hint(path)}"
        )
    return digest


def load_model_weights(model: torch.nn.Module, path: Path, spec: ModelSpec = GPT_SPEC) -> None:
    """Copy the weights of checkpoint ``path`` into ``model`` (strict: names and shapes).

    The weights' sha256 checksums are verified (``spec.load_weights``); a checkpoint without them
    is refused.

    Raises:
        CheckpointError: the model files are missing, damaged or of another shape.
    """
    try:
        spec.load_weights(model, path)
    except (FileNotFoundError, CheckpointError) as e:
        raise CheckpointError(
            f"cannot resume from {path}: {e}. {earlier_checkpoints_hint(path)}"
        ) from e


def rng_state(sampler: BatchSampler, device: torch.device) -> dict:
    """This rank's generators: torch's CPU (dropout on a CPU), the data sampler's, CUDA's."""
    state = {"cpu": torch.get_rng_state(), "data": sampler.state_dict()["generator"]}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, sampler: BatchSampler, device: torch.device) -> None:
    """Restore what :func:`rng_state` saved."""
    torch.set_rng_state(state["cpu"])
    sampler.load_state_dict({"generator": state["data"]})
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def save_checkpoint(
    root: Path,
    step: int,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sampler: BatchSampler,
    cfg: TrainConfig,
    env: DistEnv,
    extra_meta: dict,
    lr_decay_steps: int,
    spec: ModelSpec = GPT_SPEC,
) -> Path:
    """Write ``root/step_NNNNNN`` atomically (every rank calls this: RNG states are gathered).

    Files go to ``root/.tmp-step_NNNNNN``, are flushed to disk, and the directory is renamed into
    place; ``root/latest`` is then re-pointed with an atomic symlink swap. ``trainer.pt`` is
    written first and its sha256 recorded in the weights' manifest next to their checksums.

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
        spec.save_weights(model, tmp, meta)
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
