"""What a captured whole step's replay reads, frozen, and where a whole-step entry stands.

A whole-step capture (:class:`tgraph.step.capture.StepCapture`) ends in the step's capture
result, a :class:`CapturedStep`: the graph, the static batch and outputs, the hyper-parameters
whose tensors it reads, the optimizers' layout and Python numbers it baked in, the gradients it
reads or writes, what the step's modules baked in and the mode it was captured in
(:class:`StepMode`). :class:`tgraph.FullIterationGraph` (one capture result per batch signature
and mode) and :class:`tgraph.OptimizerGraph` replay from it alone, as
the per-layer wing replays from a unit's :class:`tgraph.layers.captured.Captured`. A capture
result is never changed; a change it cannot follow (:meth:`CapturedStep.change`) drops it and
the entry warms up anew.

Besides its capture result, an entry keeps its :class:`Phase` (warming up, captured, failed and
eager for good) instead of flags, its count of eager steps and the static tensors that outlive
one capture (an optimizer graph's loss and gradient norm).
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from tgraph.backend import GraphFactory
from tgraph.baked import Baked
from tgraph.signature import Template
from tgraph.step.grad_buffers import GradBuffers
from tgraph.step.host_state import BakedNumbers
from tgraph.step.hyperparams import BakedLayout, HyperParams
from tgraph.step.reach import Reach
from tgraph.step.step_hooks import OptimizerSteps


class Phase(enum.Enum):
    """Where a whole-step entry (or one batch signature of it) stands; a capture result exists
    exactly in :attr:`CAPTURED`."""

    WARMUP = "warmup"
    """Eager steps before the capture (more while a step creates optimizer state)."""
    CAPTURED = "captured"
    """Replays of the capture result."""
    FAILED = "failed"
    """The capture failed (its error was raised); the next step warns and runs eagerly."""
    EAGER = "eager"
    """Eager for good after a failed capture (warned once)."""


_TRAINING = operator.attrgetter("training")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


@dataclass(frozen=True, slots=True, eq=False)
class StepMode:
    """The mode a whole step was captured in: the ``training`` flag of each module that ran in
    it and the ``requires_grad`` of each parameter it reads. A graph replays the kernels of its
    mode (dropout drawing a mask or not, a gradient computed and stepped or not): a step in
    another mode needs another graph, as a per-layer call key holds the same flags
    (:class:`tgraph.signature.CallKey`)."""

    modules: tuple[nn.Module, ...]
    training: tuple[bool, ...]
    params: tuple[torch.Tensor, ...]
    requires_grad: tuple[bool, ...]

    @classmethod
    def now(cls, modules: tuple[nn.Module, ...], params: tuple[torch.Tensor, ...]) -> StepMode:
        """The mode of ``modules`` and ``params`` as they are now."""
        return cls(
            modules, tuple(map(_TRAINING, modules)), params, tuple(map(_REQUIRES_GRAD, params))
        )

    def same_grads(self) -> bool:
        """Whether every parameter's ``requires_grad`` is as at capture (one C-level pass)."""
        return tuple(map(_REQUIRES_GRAD, self.params)) == self.requires_grad

    def same_training(self) -> bool:
        """Whether every module's ``training`` is as at capture (one C-level pass)."""
        return tuple(map(_TRAINING, self.modules)) == self.training

    def differs_from(self, other: StepMode) -> bool:
        """Whether any flag differs from ``other``'s (of the same modules and parameters)."""
        return self.training != other.training or self.requires_grad != other.requires_grad

    def apply(self) -> None:
        """Set the flags that differ from this mode to it, as a step that set them itself
        (``model.train()`` inside ``fn``) leaves them; a training flag through
        ``nn.Module.__setattr__`` (it moves the module epoch, as ``train()`` does)."""
        for m, was in zip(self.modules, self.training):
            if m.training != was:
                m.training = was
        for p, was in zip(self.params, self.requires_grad):
            if p.requires_grad != was:
                p.requires_grad_(was)

    def difference(self) -> str:
        """The first flag that differs from the capture's, as a message names it."""
        for m, was in zip(self.modules, self.training):
            if m.training != was:
                mode = {True: "train", False: "eval"}
                return (
                    f"{type(m).__name__}.training changed from {was} to {m.training} "
                    f"({mode[was]} -> {mode[m.training]})"
                )
        for i, (p, was) in enumerate(zip(self.params, self.requires_grad)):
            if p.requires_grad != was:
                return (
                    f"requires_grad of parameter {i} {tuple(p.shape)} changed from {was} to "
                    f"{p.requires_grad} (frozen or unfrozen)"
                )
        return "no difference in mode"


@dataclass(frozen=True, slots=True, eq=False)
class CapturedStep:
    """One captured whole step: what its replay reads and checks (module docstring)."""

    graph: Any
    factory: GraphFactory  # the backend and device it was captured on (side stream, sync)
    hparams: tuple[HyperParams, ...]  # refreshed before every replay (their lr tensors)
    layout: BakedLayout  # the optimizers' groups and state tensors at capture
    numbers: BakedNumbers  # the Python numbers it read on the host (optimizers', a GradScaler's)
    seconds: float  # wall time of the capture
    pool_bytes: int  # device memory the capture allocated (0 on the emulated backend)
    steps: OptimizerSteps | None = None  # its optimizer steps: their post-hooks, after replays
    params: tuple[torch.Tensor, ...] = ()  # every parameter of the step, as at capture
    static_inputs: tuple[torch.Tensor, ...] = ()  # the static batch (or loss) replays copy into
    outputs: tuple[torch.Tensor, ...] = ()  # the graph's static outputs
    template: Template | None = None  # the structure of the outputs
    grad_modes: tuple[tuple[torch.Tensor, torch.Tensor, str], ...] = ()  # the .grad it writes
    grad_buffers: GradBuffers | None = None  # the gradient buffers it reads
    baked: Baked | None = None  # what the step's modules baked in
    mode: StepMode | None = None  # the modules' training and parameters' requires_grad flags
    end_mode: StepMode | None = None  # the flags fn left, where fn changed them: set after replays
    mutated_inputs: tuple[int, ...] = ()  # static inputs the step writes: copied back
    reach: Reach | None = None  # the objects fn reached at capture (a replaced one: recapture)
    param_hooks: ParamHooks | None = None  # the parameters' gradient hooks the backward ran

    def change(self) -> str | None:
        """Why the graph no longer fits what it baked in (the optimizers' layout or numbers,
        the host numbers of the entry and a GradScaler, the param_groups' numbers and step
        pre-hooks, the modules' attributes and hooks, an object the step reaches replaced), or
        None: replay."""
        why = self.layout.change() or self.numbers.change()
        for hp in self.hparams:
            why = why or hp.change()
        if why is None and self.steps is not None:
            why = self.steps.change()
        if why is None and self.baked is not None:
            why = self.baked.changed()
        if why is None and self.reach is not None:
            why = self.reach.change()
        if why is None and self.param_hooks is not None:
            why = self.param_hooks.change()
        return why


def _hook_counts(params: tuple[torch.Tensor, ...]) -> tuple[tuple[int, int], ...]:
    return tuple(
        (len(p._backward_hooks or ()), len(p._post_accumulate_grad_hooks or ())) for p in params
    )


class ParamHooks:
    """The parameters' own gradient hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``) when a whole step was captured: its backward ran
    them, so the graph replays their effect, and a hook added or removed since would be ignored
    or kept. Read only when torch's hook counter moved (a hook registered anywhere), or at every
    check where a parameter had hooks at capture (a removal moves no counter)."""

    __slots__ = ("params", "counts", "epoch", "hooked")

    def __init__(self, params: tuple[torch.Tensor, ...]) -> None:
        self.params = params
        self.counts = _hook_counts(params)
        self.epoch = RemovableHandle.next_id
        self.hooked = any(map(any, self.counts))

    def change(self) -> str | None:
        epoch = RemovableHandle.next_id
        if epoch == self.epoch and not self.hooked:
            return None
        now = _hook_counts(self.params)
        if now == self.counts:
            self.epoch = epoch
            return None
        i = next(i for i, (a, b) in enumerate(zip(now, self.counts)) if a != b)
        return (
            f"the gradient hooks of parameter {i} (shape {tuple(self.params[i].shape)}) changed "
            "after capture (tensor or post-accumulate hooks now: "
            f"{now[i][0]} and {now[i][1]}, at capture {self.counts[i][0]} and "
            f"{self.counts[i][1]}); the step's graph replays the hooks present at capture only"
        )


__all__ = ["CapturedStep", "ParamHooks", "Phase", "StepMode"]
