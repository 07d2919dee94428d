"""The run's configuration: one ``@dataclass(kw_only=True)`` group per concern (torchtitan style).

:class:`TrainConfig` joins the groups into one flat config: one command-line flag per field
(``recipes/train_gpt.py``), saved flat as ``<out>/config.json`` and in every checkpoint.

The groups come in two kinds. :class:`ModelConfig`, :class:`DataConfig` and
:class:`OptimizerConfig` decide the numbers a run computes, so a resumed run must match its
checkpoint in every one of their fields. The groups marked :class:`RunOnly` (:class:`JobConfig`,
:class:`StepConfig`, :class:`CompileConfig`, :class:`ReportConfig`) decide where output goes, how a step executes (the
three graph modes compute the same numbers) and how often things are reported: they may change on
resume. A new field is covered by that rule through the group it is declared in, not by a list.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
from dataclasses import dataclass
from typing import ClassVar

from tgraph.toy.gpt import GPTConfig

GRAPH_MODES = ("none", "layer", "model", "full")
GRAPH_MODE_HELP = {  # --help's words for each mode; a recipe lists its own (RunConfig.graph_modes)
    "none": "eager",
    "layer": "per-layer graphs",
    "layer+opt": "per-layer graphs and the optimizer step as one graph",
    "model": "the whole model, embeddings to loss, as one graphed unit: a forward and a backward graph",
    "full": "the whole training step as one graph",
}
NONFINITE_MODES = ("stop", "skip")
CAPTURED_STEPS = ("full", "layer+opt")  # modes whose optimizer step is a graph: no skip
DEFAULT_STEPS = 2000  # a fresh run's --steps when none is given


class ConfigGroup:
    """Base of every group: ``__post_init__`` runs each group's checks in turn (via ``super()``)."""

    def __post_init__(self) -> None:
        pass  # end of the chain of group checks

    def _invalid(self, name: str, fix: str) -> ValueError:
        """The error for field ``name``: the config class, the field, its value and the fix."""
        return ValueError(f"{type(self).__name__}.{name}={getattr(self, name)!r} is invalid: {fix}")

    def _check_counts(self, positive: tuple[str, ...], non_negative: tuple[str, ...] = ()) -> None:
        for name in positive:
            if getattr(self, name) <= 0:
                raise self._invalid(name, f"--{name.replace('_', '-')} must be a positive integer")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise self._invalid(name, f"--{name.replace('_', '-')} must be 0 or more")


class RunOnly(ConfigGroup):
    """Marks a group whose fields may differ between a checkpoint and the run resuming it.

    They change where output goes, how a step executes or how often things are reported, never
    the numbers the run computes (:meth:`TrainConfig.run_only_fields`).
    """


# --- groups that decide the numbers: a resumed run must match its checkpoint in every field ---


@dataclass(kw_only=True)
class ModelConfig(ConfigGroup):
    """The toy GPT's shape."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_counts(("block_size", "n_layer", "n_head", "n_embd"))
        if self.n_embd % self.n_head:
            raise self._invalid("n_head", f"it must divide n_embd={self.n_embd}")
        if not 0.0 <= self.dropout < 1.0:
            raise self._invalid("dropout", "use a probability in [0, 1)")

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
        )


@dataclass(kw_only=True)
class DataConfig(ConfigGroup):
    """What each step trains on, and the seeds of everything random."""

    batch_size: int = 8
    """Sequences per step per rank."""
    val_fraction: float = 0.05
    """Share of stdlib files held out for validation (split by a hash of the path)."""
    include_tests: bool = False
    """Also train on the stdlib's test directories (about 2.5x the bytes)."""
    seed: int = 1337
    """Seed of the initial weights; rank r draws dropout and batches from seeds derived from it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_counts(("batch_size",))
        if not -(2**63) <= self.seed < 2**63:  # torch's generators take 64-bit seeds
            raise self._invalid("seed", "use an integer from -2**63 to 2**63 - 1")
        if not 0.0 < self.val_fraction < 1.0:
            raise self._invalid(
                "val_fraction", "use a fraction strictly between 0 and 1 (e.g. 0.05)"
            )


@dataclass(kw_only=True)
class OptimizerConfig(ConfigGroup):
    """AdamW and its learning-rate schedule (``gpt_training.optim``)."""

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

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_counts((), non_negative=("warmup_steps",))
        if not (self.lr > 0.0 and math.isfinite(self.lr)):
            raise self._invalid("lr", "use a positive learning rate (e.g. 2e-3)")
        if not 0.0 < self.min_lr <= self.lr:
            raise self._invalid("min_lr", f"use 0 < min_lr <= lr={self.lr}")
        for name in ("grad_clip", "weight_decay"):  # NaN fails every comparison: ask for >= 0
            if not (getattr(self, name) >= 0.0 and math.isfinite(getattr(self, name))):
                raise self._invalid(name, "use a finite 0 or more")
        for name in ("beta1", "beta2"):  # AdamW's own range, checked before anything runs
            if not 0.0 <= getattr(self, name) < 1.0:
                raise self._invalid(name, f"use 0 <= {name} < 1 (AdamW's range)")


# --- run-only groups: may change when a run resumes ----------------------------------------------


@dataclass(kw_only=True)
class JobConfig(RunOnly):
    """Where the run writes and how far it goes."""

    out: str = "runs/gpt"
    """Run directory (config, metrics, plot, summary, checkpoints)."""
    resume: str = ""
    """Continue from a checkpoint directory, or "latest" (<out>/checkpoints/latest); empty: fresh run."""
    overwrite: bool = False
    """Start a fresh run in an --out that already holds checkpoints, deleting them (refused otherwise)."""
    steps: int | None = None
    """Optimizer steps in total (a resumed run counts the steps already done; a larger value continues a finished run at min_lr). Unset: 2000 for a fresh run, the checkpoint's own total on --resume."""

    def __post_init__(self) -> None:
        # ``steps`` only moves where the run stops: the learning-rate schedule keeps the horizon
        # of the run's first start (see optim.lr_at), so a resumed run computes the same numbers.
        super().__post_init__()
        if os.path.normpath(self.out.strip() or ".") == ".":  # ".", "./", "a/..": here
            raise self._invalid("out", "name a run directory of its own (e.g. runs/my_run)")
        if self.steps is not None:
            self._check_counts(("steps",))


@dataclass(kw_only=True)
class StepConfig(RunOnly):
    """How one training step executes: device, graph mode, non-finite handling."""

    device: str = "auto"
    """"auto" (cuda if available), "cpu", "cuda" or "cuda:N" (torchrun uses cuda:LOCAL_RANK)."""
    graph: str = "layer"
    """Graph mode, one of the recipe's ``graph_modes`` (--help words each: ``GRAPH_MODE_HELP``)."""
    backend: str = "auto"
    """Graph backend: "auto" (cuda graphs on a GPU, emulated on CPU), "cuda" or "emulated"."""
    on_nonfinite: str = "stop"
    """A nan/inf loss or gradient: "stop" the run (checked at log and checkpoint steps, before any checkpoint is written) or "skip" the step's update (one host sync per step; not with --graph full or layer+opt)."""
    deterministic: bool = False
    """Deterministic kernels where PyTorch has them (others warn); slower on a GPU."""

    def __post_init__(self) -> None:
        super().__post_init__()
        modes = getattr(self, "graph_modes", GRAPH_MODES)  # RunConfig's: a recipe may add modes
        if self.graph not in modes:
            raise self._invalid("graph", f"use --graph {', '.join(modes)}")
        if self.backend not in ("auto", "cuda", "emulated"):
            raise self._invalid("backend", "use --backend auto, cuda or emulated")
        if self.on_nonfinite not in NONFINITE_MODES:
            raise self._invalid("on_nonfinite", "use --on-nonfinite stop or skip")
        if self.on_nonfinite == "skip" and self.graph in CAPTURED_STEPS:
            # A captured step always applies its update: the host cannot skip part of a graph.
            modes = [
                m for m in getattr(self, "graph_modes", GRAPH_MODES) if m not in CAPTURED_STEPS
            ]
            raise self._invalid(
                "on_nonfinite",
                f"skip needs --graph {', '.join(modes[:-1])} or {modes[-1]} (an eager optimizer "
                f"step); use stop with --graph {self.graph}",
            )
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise self._invalid("device", "use --device auto, cpu, cuda or cuda:N")


@dataclass(kw_only=True)
class CompileConfig(RunOnly):
    """Whether the step runs inductor's fused kernels (recipes whose models torch.compile takes)."""

    compile: bool = False
    """Compile with torch.compile (inductor, default mode) before any capture: --graph layer, layer+opt and model graph each unit's compiled code (tgraph.enable(compile=True)); none and full run the step through torch.compile(model). The first step takes longer (it compiles); the numbers are eager's up to float32 reordering."""


@dataclass(kw_only=True)
class ReportConfig(RunOnly):
    """How often the run validates, logs and checkpoints."""

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
    progress: bool = True
    """Show a progress bar on rank 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_counts(
            ("eval_batches", "log_every", "keep_checkpoints"),
            non_negative=("eval_every", "ckpt_every"),
        )


class RunConfig:
    """The methods every recipe's joined config shares (the toy's :class:`TrainConfig`, the
    transformers recipe's config): its groups, the run-only fields, the run's ``--steps``."""

    default_steps: ClassVar[int] = DEFAULT_STEPS
    graph_modes: ClassVar[tuple[str, ...]] = GRAPH_MODES
    cli_choices: ClassVar[dict] = {"graph": GRAPH_MODES, "on_nonfinite": NONFINITE_MODES}
    cli_aliases: ClassVar[dict] = {}  # field -> extra flags (a recipe's own older spellings)

    def unavailable(self) -> str | None:
        """Why this machine cannot run the recipe at all (a missing GPU or library), or None;
        the command line refuses the run with it in one line (exit code 2)."""
        return None

    @classmethod
    def groups(cls) -> list[type[ConfigGroup]]:
        """The config groups, in field order."""
        return [g for g in reversed(cls.__mro__[1:]) if "__dataclass_fields__" in vars(g)]

    @classmethod
    def run_only_fields(cls) -> frozenset[str]:
        """Fields that may differ between a checkpoint and the run resuming it: those of the
        :class:`RunOnly` groups."""
        return frozenset(
            f.name for g in cls.groups() if issubclass(g, RunOnly) for f in dataclasses.fields(g)
        )

    def model_flags(self) -> str:
        """The command-line flags that give a resume this run's numbers: every field outside the
        run-only groups whose value is not the recipe's default (``--n-layer 2 --lr 0.01``)."""
        flags = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in self.run_only_fields() or value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            else:
                flags.append(f"{flag} {shlex.quote(str(value))}")
        return " ".join(flags)

    def with_steps(self, checkpoint_steps: int | None):
        """This config with ``steps`` set: as given, else the resumed checkpoint's total
        (``checkpoint_steps``), else :attr:`default_steps`."""
        if self.steps is not None:
            return self
        return dataclasses.replace(self, steps=checkpoint_steps or self.default_steps)


# Bases in reverse order: dataclasses list the last base's fields first, so --help and
# config.json read job, step, model, data, optimizer, report.
@dataclass(kw_only=True)
class TrainConfig(
    ReportConfig,
    OptimizerConfig,
    DataConfig,
    ModelConfig,
    CompileConfig,
    StepConfig,
    JobConfig,
    RunConfig,
):
    """Everything that defines a run; saved as ``<out>/config.json`` and in every checkpoint.

    Built from flat keyword arguments (``TrainConfig(steps=100, n_layer=2)``); each group checks
    its own fields and raises ``ValueError`` naming the field and the fix.
    """
