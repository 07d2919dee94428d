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

This file maps the command line onto the config and runs it; the recipe lives in
``gpt_training/`` beside it, one concept per module: ``config.py`` (config groups; the run-only
groups are what may change on resume), ``step.py`` (``make_step``: every line of graph-mode code),
``trainer.py`` (the loop), ``checkpointing.py``, ``metrics.py``, ``optim.py``, ``parallel.py``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import os
import sys
import textwrap
import traceback
from pathlib import Path

import torch
from gpt_training.checkpointing import RunDirectoryError, latest_checkpoint
from gpt_training.config import GRAPH_MODES, NONFINITE_MODES, RunOnly, TrainConfig
from gpt_training.parallel import exit_now
from gpt_training.trainer import NonFiniteLossError, TrainingInterrupted, train

from tgraph.toy.checkpoint import CheckpointError

EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by SIGINT (128 + 2)


# ---------------------------------------------------------------------------------------------
# Command line: one flag per TrainConfig field, help text from the field's docstring.


def _field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under dataclass fields (not kept by Python, so read from the source),
    those of ``cls`` and of the config groups it joins."""
    docs = {}
    for klass in [*getattr(cls, "groups", list)(), cls]:
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
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
    types = {"int": int, "int | None": int, "float": float, "str": str, "bool": bool}
    choices = {"graph": GRAPH_MODES, "on_nonfinite": NONFINITE_MODES}
    for group in TrainConfig.groups():  # --help lists the flags by config group
        summary = (group.__doc__ or "").strip().split("\n")[0]
        if issubclass(group, RunOnly):
            summary += " May change when a run resumes."
        section = parser.add_argument_group(group.__name__, summary)
        for f in dataclasses.fields(group):
            flags = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
            kind = types[str(f.type)]
            extra = {"choices": choices[f.name]} if f.name in choices else {}
            if kind is bool:
                extra["action"] = argparse.BooleanOptionalAction
            else:
                extra["type"] = kind
            section.add_argument(
                *flags, dest=f.name, default=f.default, help=docs.get(f.name), **extra
            )
    args = parser.parse_args(argv)
    try:
        cfg = TrainConfig(**vars(args))
    except ValueError as e:
        parser.error(str(e))
    _check_hardware(cfg, parser)
    return cfg


def _check_hardware(cfg: TrainConfig, parser: OneLineErrorParser) -> None:
    """Refuse a GPU that is not there before anything runs or any directory is created."""
    if torch.cuda.is_available():
        return
    if cfg.device.startswith("cuda"):
        parser.error(f"--device {cfg.device}, but no GPU is visible; use --device cpu or auto")
    if cfg.backend == "cuda":
        parser.error(
            "--backend cuda needs a GPU, but none is visible; use --backend auto or emulated "
            "(tgraph's CPU stand-in for CUDA graphs)"
        )


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
