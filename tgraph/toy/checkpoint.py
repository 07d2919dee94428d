"""Checkpoint IO for the toy GPT: ``model.safetensors`` + ``config.json``, written atomically.

A checkpoint is a directory::

    ckpt/
      model.safetensors   # the model's state_dict (tgraph wrappers never change its keys)
      config.json         # {"format": "tgraph-gpt", "version": 1, "model": GPTConfig,
                          #  "sha256": {tensor name: digest}, "extra": ...}

``config.json`` records the sha256 of every tensor's bytes; :func:`load_state_dict` (hence
:func:`load` and :func:`load_into`) recomputes them and raises :class:`CheckpointError` naming
the file and the tensors that differ, so bytes damaged on disk never load silently. A missing or
unreadable ``config.json`` is refused too: without it the weights cannot be verified. Checkpoints
written before checksums existed (no ``"sha256"`` entry) still load, unverified, unless the caller
passes ``require_checksums=True``.

Every file is written atomically with :func:`atomic_write_bytes` / :func:`atomic_writer`: the
bytes go to a temporary file in the same directory, are flushed and fsynced, and the temporary
file is renamed over the target with :func:`os.replace`. A crash mid-write leaves the previous
file intact, never a truncated one. A training recipe adds its own files next to the model's
the same way, for example::

    checkpoint.save(model, "ckpt", extra={"step": step})
    with checkpoint.atomic_writer("ckpt/optimizer.pt") as f:
        torch.save({"optimizer": opt.state_dict(), "rng": torch.get_rng_state()}, f)

``save``/``load`` unwrap DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers, and a
model with ``tgraph.enable`` applied has the same keys as an eager one, so a checkpoint moves
freely between graphed and eager models.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn as nn

from tgraph.toy.gpt import GPT, GPTConfig

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FORMAT = "tgraph-gpt"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint exists but cannot be used: corrupt file or a mismatch with the model."""


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex sha256 of a tensor's dtype, shape and bytes (row-major): a header edited to another
    dtype of the same size (F32 read as I32, the same bytes) no longer matches."""
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(_bytes(t))
    return h.hexdigest()


def _bytes_sha256(t: torch.Tensor) -> str:
    """Hex sha256 of a tensor's bytes alone: the digest checkpoints saved before
    :func:`tensor_sha256` covered dtype and shape recorded (still verified, bytes only)."""
    return hashlib.sha256(_bytes(t)).hexdigest()


def _bytes(t: torch.Tensor):
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


# -- atomic writes ----------------------------------------------------------------------------


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file next to ``path``; on success fsync it and rename it onto ``path``.

    Args:
        path: the final file; its directory must exist.
        mode: ``"wb"`` (bytes) or ``"w"`` (text, UTF-8).

    Yields:
        The open temporary file. If the block raises, the temporary file is removed and
        ``path`` is left untouched.

    Raises:
        ValueError: ``mode`` is not ``"wb"`` or ``"w"``.
        FileNotFoundError: the directory of ``path`` does not exist.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_writer mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; keep the target's mode, or use the usual 0644.
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o644)
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file in the same directory, fsync, rename)."""
    with atomic_writer(path, "wb") as f:
        f.write(data)


def _fsync_dir(directory: Path) -> None:
    # Make the rename itself durable (POSIX); not possible on every platform, so best effort.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- save -------------------------------------------------------------------------------------


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DDP/FSDP-style (``.module``) and ``torch.compile`` wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def save(model: nn.Module, directory: str | os.PathLike, *, extra: dict | None = None) -> Path:
    """Save a GPT's weights and config to ``directory`` (created if needed), atomically.

    Args:
        model: a :class:`~tgraph.toy.gpt.GPT`, possibly wrapped (DDP, torch.compile) or with
            ``tgraph.enable`` applied.
        directory: checkpoint directory.
        extra: JSON-serializable metadata stored under ``"extra"`` in ``config.json`` (e.g.
            the training step); read it back with :func:`read_config`.

    Returns:
        The checkpoint directory.

    Raises:
        TypeError: ``model`` is not a GPT, or ``extra`` is not JSON-serializable.
    """
    from safetensors.torch import save as st_save

    model = unwrap(model)
    if not isinstance(model, GPT):
        raise TypeError(f"checkpoint.save expects a tgraph GPT, got {type(model).__name__}")
    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # safetensors refuses shared memory (tied weights): copy
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    # One id in both files: a save interrupted between the two renames (new weights, old
    # config) is detected at load instead of pairing weights with another save's metadata.
    save_id = uuid.uuid4().hex
    try:
        config = json.dumps(
            {
                "format": FORMAT,
                "version": VERSION,
                "save_id": save_id,
                "model": model.config.to_dict(),
                "sha256": {name: tensor_sha256(t) for name, t in tensors.items()},
                "extra": extra,
            },
            indent=2,
        )
    except TypeError as exc:
        raise TypeError(f"checkpoint extra= must be JSON-serializable: {exc}") from exc
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Weights first, config last: a directory with a config.json has complete weights.
    atomic_write_bytes(
        directory / WEIGHTS_NAME, st_save(tensors, metadata={"format": FORMAT, "save_id": save_id})
    )
    with atomic_writer(directory / CONFIG_NAME, "w") as f:
        f.write(config + "\n")
    return directory


# -- load -------------------------------------------------------------------------------------


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The checkpoint directory that ``path`` means.

    ``path`` may be a checkpoint directory (``model.safetensors`` + ``config.json``), a
    directory of checkpoints named ``step_NNNNNN`` (its ``latest`` link, else the highest step),
    or a training run's directory holding such a ``checkpoints/`` directory
    (``recipes/train_gpt.py --out``).

    Raises:
        FileNotFoundError: ``path`` is a file, does not exist, or holds no checkpoint; the
            message says what was found and what to pass instead.
    """
    path = Path(path)
    if path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is a file; pass the checkpoint directory that holds it "
            f"({str(path.parent)!r}) or the training run's directory"
        )
    if not path.is_dir():
        raise FileNotFoundError(
            f"{str(path)!r} does not exist; pass a training run's directory (e.g. "
            "runs/quickstart, meaning its latest checkpoint) or one checkpoint directory"
        )
    if (path / WEIGHTS_NAME).is_file():
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    link = root / "latest"
    if link.is_dir():
        return root / os.readlink(link) if link.is_symlink() else link
    steps = [p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    if steps:
        return max(steps, key=lambda p: int(p.name[5:]))
    raise FileNotFoundError(
        f"{str(path)!r} holds no checkpoint: expected {WEIGHTS_NAME} + {CONFIG_NAME}, or "
        "checkpoints/step_NNNNNN directories of a training run (was the run stopped before its "
        "first checkpoint?)"
    )


def _require(directory: Path, name: str) -> Path:
    if not directory.is_dir():
        raise FileNotFoundError(
            f"checkpoint directory {str(directory)!r} does not exist; pass the directory "
            "written by tgraph.toy.checkpoint.save (e.g. the training recipe's --out)"
        )
    path = directory / name
    if not path.is_file():
        raise FileNotFoundError(
            f"checkpoint {str(directory)!r} has no {name}; expected {WEIGHTS_NAME} and "
            f"{CONFIG_NAME} written by tgraph.toy.checkpoint.save (was the save interrupted?)"
        )
    return path


def read_config(directory: str | os.PathLike) -> tuple[GPTConfig, dict | None]:
    """Read ``config.json``: the model config and the ``extra`` metadata.

    Raises:
        FileNotFoundError: missing directory or file.
        CheckpointError: invalid JSON, another format, or fields GPTConfig does not accept.
    """
    path = _require(Path(directory), CONFIG_NAME)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); the file is corrupt") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT or "model" not in data:
        raise CheckpointError(
            f"{path} is not a tgraph GPT config (expected a JSON object with format "
            f"{FORMAT!r} and a 'model' entry)"
        )
    known = set(GPTConfig.__dataclass_fields__)
    unknown = sorted(set(data["model"]) - known)
    if unknown:
        raise CheckpointError(
            f"{path}: unknown GPTConfig fields {unknown}; expected a subset of {sorted(known)} "
            "(written by a newer tgraph?)"
        )
    try:
        cfg = GPTConfig(**data["model"])
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: invalid model config: {exc}") from exc
    return cfg, data.get("extra")


def load_state_dict(
    directory: str | os.PathLike, *, require_checksums: bool = False
) -> dict[str, torch.Tensor]:
    """Read ``model.safetensors`` into CPU tensors and verify them against ``config.json``.

    Args:
        directory: checkpoint directory.
        require_checksums: also refuse a ``config.json`` without checksums (written before
            they existed), so nothing loads unverified.

    Raises:
        FileNotFoundError: missing directory, ``model.safetensors`` or ``config.json``.
        CheckpointError: the file is not a readable safetensors file, ``config.json`` is not
            valid JSON (the checksums cannot be read), the two come from different saves, or a
            tensor's sha256 differs from the one recorded at save time (damaged on disk).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = _require(Path(directory), WEIGHTS_NAME)
    try:
        state = load_file(str(path), device="cpu")
        with safe_open(str(path), framework="pt") as f:
            weights_id = (f.metadata() or {}).get("save_id")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({type(exc).__name__}: {exc}); the "
            "checkpoint is corrupt or truncated: save it again"
        ) from exc
    config_path = _require(Path(directory), CONFIG_NAME)  # it holds the checksums
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(
            f"{config_path} is not valid JSON ({exc}), so the sha256 checksums of {path} cannot "
            "be verified; restore config.json from a copy or use an earlier checkpoint"
        ) from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path} is not a JSON object; the file is corrupt")
    if require_checksums and config.get("sha256") is None:  # absent, or null
        raise CheckpointError(
            f"{config_path} records no sha256 checksums, so {path} cannot be verified; use a "
            "checkpoint written by tgraph.toy.checkpoint.save"
        )
    config_id = config.get("save_id")
    if weights_id is not None and config_id is not None and config_id != weights_id:
        raise CheckpointError(
            f"{path} and {config_path} come from different saves (a save interrupted between "
            "writing the two files?); save the checkpoint again, or write each checkpoint to "
            "a fresh directory and rename it into place"
        )
    _verify_sha256(state, config.get("sha256"), path)
    return state


def _verify_sha256(state: dict[str, torch.Tensor], recorded: object, path: Path) -> None:
    """Compare each tensor's sha256 with the digest ``config.json`` recorded at save time."""
    if recorded is None:
        return  # a checkpoint written before checksums existed
    if not isinstance(recorded, dict):
        raise CheckpointError(
            f"{path.parent / CONFIG_NAME}: 'sha256' must map tensor names to digests, got "
            f"{type(recorded).__name__}; the file is corrupt"
        )
    check_digests(
        state,
        recorded,
        path,
        CONFIG_NAME,
        ". Restore the file from a copy or use an earlier checkpoint",
    )


def check_digests(
    state: dict[str, torch.Tensor], recorded: dict, path: Path, manifest: str, advice: str = ""
) -> None:
    """Raise :class:`CheckpointError` naming the tensors of ``state`` (read from ``path``)
    whose sha256 is not the one ``recorded`` in ``manifest`` at save time, or that either
    side lacks."""
    # a digest of the bytes alone is an older save's (no digest of dtype, shape and bytes
    # equals one of bytes alone, so a newer save's record keeps its dtype checked)
    bad = sorted(
        k
        for k, t in state.items()
        if recorded.get(k) != tensor_sha256(t) and recorded.get(k) != _bytes_sha256(t)
    )
    bad += sorted(recorded.keys() - state.keys())
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(
            f"{path} is corrupt: the data of {len(bad)} tensor(s) ({shown}) no longer matches "
            f"the sha256 recorded in {manifest} when it was saved (damaged on disk or edited "
            f"after saving){advice}"
        )


def load_into(
    model: nn.Module, directory: str | os.PathLike, *, require_checksums: bool = False
) -> nn.Module:
    """Load a checkpoint's weights into an existing model (graphed or eager), strictly.

    Args:
        model: a GPT (possibly wrapped) with the checkpoint's architecture.
        directory: checkpoint directory.
        require_checksums: refuse a checkpoint without checksums (see :func:`load_state_dict`).

    Returns:
        ``model``.

    Raises:
        FileNotFoundError: missing directory or file.
        CheckpointError: corrupt file, or missing/unexpected keys or shape mismatches (all listed).
    """
    state = load_state_dict(directory, require_checksums=require_checksums)
    _load_checked(unwrap(model), state, directory)
    return model


def _load_checked(target: nn.Module, state: dict, directory: str | os.PathLike) -> None:
    own = target.state_dict()
    missing = sorted(own.keys() - state.keys())
    unexpected = sorted(state.keys() - own.keys())
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in sorted(own.keys() & state.keys())
        if state[k].shape != own[k].shape
    ]
    # load_state_dict would cast an integer tensor into a float parameter, silently (a header
    # edited from F32 to I32 in a checkpoint whose digests cover bytes only)
    kinds = [
        f"{k}: checkpoint {state[k].dtype} vs model {own[k].dtype}"
        for k in sorted(own.keys() & state.keys())
        if state[k].is_floating_point() != own[k].is_floating_point()
    ]
    if missing or unexpected or shapes or kinds:
        parts = [f"missing keys {missing}"] * bool(missing)
        parts += [f"unexpected keys {unexpected}"] * bool(unexpected)
        parts += [f"shape mismatch {shapes}"] * bool(shapes)
        parts += [f"dtype mismatch {kinds}"] * bool(kinds)
        raise CheckpointError(
            f"checkpoint {str(directory)!r} does not match {type(target).__name__}: "
            f"{'; '.join(parts)}. Build the model from the checkpoint's config.json "
            "(tgraph.toy.checkpoint.load) instead"
        )
    target.load_state_dict(state, strict=True)


def load(
    directory: str | os.PathLike,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    require_checksums: bool = False,
) -> GPT:
    """Build a GPT from a checkpoint's config and load its weights.

    Args:
        directory: checkpoint directory written by :func:`save`.
        device: where the model goes.
        dtype: convert the weights to this dtype; None keeps the saved dtype.
        require_checksums: refuse a checkpoint without checksums (see :func:`load_state_dict`).

    Returns:
        An eager GPT in eval mode.

    Raises:
        FileNotFoundError: missing directory or file.
        CheckpointError: corrupt files or weights that do not match the config.
    """
    cfg, _ = read_config(directory)
    state = load_state_dict(directory, require_checksums=require_checksums)
    model = GPT(cfg)
    saved = state.get("wte.weight")
    if saved is not None and saved.is_floating_point():
        model.to(saved.dtype)  # load the weights at their saved precision
    _load_checked(model, state, directory)
    return model.to(device=device, dtype=dtype).eval()
