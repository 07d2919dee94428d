"""What a captured whole step's replay reads, frozen, and where a whole-step entry stands.

A whole-step capture (:class:`tgraph.step.capture.StepCapture`) ends in the step's capture
result, a :class:`CapturedStep`: the graph, the static batch and outputs, the hyper-parameters
whose tensors it reads, the optimizers' layout and Python numbers it baked in, the gradients it
reads or writes and what the step's modules baked in. :class:`tgraph.FullIterationGraph` (one
capture result per batch signature) and :class:`tgraph.OptimizerGraph` replay from it alone, as
the per-layer wing replays from a unit's :class:`tgraph.layers.captured.Captured`. A capture
result is never changed; a change it cannot follow (:meth:`CapturedStep.change`) drops it and
the entry warms up anew.

Besides its capture result, an entry keeps its :class:`Phase` (warming up, captured, failed and
eager for good) instead of flags, its count of eager steps and the static tensors that outlive
one capture (an optimizer graph's loss and gradient norm).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch

from tgraph.backend import GraphFactory
from tgraph.baked import Baked
from tgraph.signature import Template
from tgraph.step.grad_buffers import GradBuffers
from tgraph.step.host_state import BakedNumbers
from tgraph.step.hyperparams import BakedLayout, HyperParams
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


@dataclass(frozen=True, slots=True, eq=False)
class CapturedStep:
    """One captured whole step: what its replay reads and checks (module docstring)."""

    graph: Any
    factory: GraphFactory  # the backend and device it was captured on (side stream, sync)
    hparams: tuple[HyperParams, ...]  # refreshed before every replay (their lr tensors)
    layout: BakedLayout  # the optimizers' groups and state tensors at capture
    numbers: BakedNumbers  # the optimizers' Python-number attributes at capture
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

    def change(self) -> str | None:
        """Why the graph no longer fits what it baked in (the optimizers' layout or numbers,
        their param_groups' numbers and step pre-hooks, the modules' attributes and hooks), or None: replay."""
        why = self.layout.change() or self.numbers.change()
        for hp in self.hparams:
            why = why or hp.change()
        if why is None and self.steps is not None:
            why = self.steps.change()
        if why is None and self.baked is not None:
            why = self.baked.changed()
        return why


__all__ = ["Phase", "CapturedStep"]
