"""The recipes' command line: one flag per config field, one-line errors, exit codes, torchrun.

``recipes/train_gpt.py`` and ``recipes/train_hf.py`` both call :func:`main` with their config class
and model spec; flags, help text (from the fields' docstrings), errors and exit codes are the same.
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

from tgraph import CaptureError
from tgraph.toy.checkpoint import CheckpointError

from .checkpointing import RunDirectoryError, latest_checkpoint
from .config import DEFAULT_STEPS, GRAPH_MODE_HELP, RunOnly, TrainConfig
from .parallel import exit_now
from .spec import GPT_SPEC, ModelError, ModelSpec
from .trainer import DataError, NonFiniteLossError, TrainingInterrupted, train

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


def parse_config(
    argv: list[str] | None = None, config_cls: type = TrainConfig, description: str = ""
) -> TrainConfig:
    """Build a ``config_cls`` (:class:`TrainConfig`, or a recipe's own config) from command-line
    flags (``--batch-size 8`` or ``--batch_size 8``, and the config's ``cli_aliases``).

    Raises:
        SystemExit: unknown flag or invalid value (one line naming the flag; exit code 2).
    """
    parser = OneLineErrorParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    docs = _field_docs(config_cls)
    types = {"int": int, "int | None": int, "float": float, "str": str, "bool": bool}
    choices = {**config_cls.cli_choices, "graph": config_cls.graph_modes}
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}  # a recipe's own
    modes = [f'"{m}" ({GRAPH_MODE_HELP[m]})' for m in config_cls.graph_modes]
    docs["graph"] = f"Graph mode: {', '.join(modes[:-1])} or {modes[-1]}."
    if "steps" in docs:  # a fresh run's total is the recipe's own
        docs["steps"] = docs["steps"].replace(str(DEFAULT_STEPS), str(config_cls.default_steps))
    for group in config_cls.groups():  # --help lists the flags by config group
        summary = (group.__doc__ or "").strip().split("\n")[0]
        if issubclass(group, RunOnly):
            summary += " May change when a run resumes."
        section = parser.add_argument_group(group.__name__, summary)
        for f in dataclasses.fields(group):
            flags = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
            flags += config_cls.cli_aliases.get(f.name, [])
            kind = types[str(f.type)]
            extra = {"choices": choices[f.name]} if f.name in choices else {}
            if kind is bool:
                extra["action"] = argparse.BooleanOptionalAction
            else:
                extra["type"] = kind
            section.add_argument(
                *flags, dest=f.name, default=defaults[f.name], help=docs.get(f.name), **extra
            )
    args = parser.parse_args(argv)
    try:
        cfg = config_cls(**vars(args))
    except ValueError as e:
        parser.error(str(e))
    _check_hardware(cfg, parser)
    return cfg


def _check_hardware(cfg: TrainConfig, parser: OneLineErrorParser) -> None:
    """Refuse a GPU that is not there before anything runs or any directory is created."""
    why = cfg.unavailable()
    if why:
        parser.error(why)
    if torch.cuda.is_available():
        return
    if cfg.device.startswith("cuda"):
        parser.error(f"--device {cfg.device}, but no GPU is visible; use --device cpu or auto")
    if cfg.backend == "cuda":
        parser.error(
            "--backend cuda needs a GPU, but none is visible; use --backend auto or emulated "
            "(tgraph's CPU stand-in for CUDA graphs)"
        )


def run_cli(cfg: TrainConfig, rank: int, spec: ModelSpec = GPT_SPEC) -> int:
    """Train; report the errors a user can act on in one line. Returns the exit code."""
    try:
        train(cfg, spec)
    except (RunDirectoryError, ModelError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except CaptureError as e:  # tgraph refuses to capture what the step does
        print(f"error: --graph {cfg.graph} cannot capture this step: {e}", file=sys.stderr)
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


def main(
    argv: list[str] | None = None,
    config_cls: type = TrainConfig,
    spec: ModelSpec = GPT_SPEC,
    description: str = "",
) -> None:
    """A recipe's ``main``: parse, train, exit with the code of what happened (0, 1: a bad
    checkpoint or non-finite loss, 2: a bad argument or run directory, or a step the graph mode
    cannot capture, 130: Ctrl-C)."""
    cfg = parse_config(argv, config_cls, description)
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    several = int(os.environ.get("WORLD_SIZE", 1)) > 1
    try:
        code = run_cli(cfg, rank, spec)
    except BaseException:
        if several:
            traceback.print_exc()
            exit_now(1)
        raise
    if several:
        exit_now(code)
    if code:
        raise SystemExit(code)
