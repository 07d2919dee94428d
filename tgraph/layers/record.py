"""The process-wide record of graphed forwards and backwards, in true execution order.

During the first (eager) iteration every graphed call appends ``(runner, "fwd")``; a no-op
autograd node placed on its outputs appends ``(runner, "bwd")`` when the backward pass reaches
it. The record therefore holds the real interleaving of forwards and backwards (microbatches,
1F1B pipeline schedules), and ``create_graphs()`` captures in exactly that order: that is what
makes one shared memory pool safe (a graph only reuses memory that, in the real schedule, is dead
by the time it runs).

A runner is *in flight* from its forward until its backward has run (or its autograd graph has
been freed without one). :class:`tgraph.layers.replay.Flight` tokens implement that; a call never reuses a
runner in flight, because its buffers still hold the activations its backward needs.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch

Runner = Any  # a tgraph.layers.runner.Runner; not imported (no import cycle)

Phase = Literal["fwd", "bwd"]


class Record:
    """Ordered forward/backward events plus which runner produced which tensor."""

    def __init__(self) -> None:
        self.events: list[tuple[Runner, Phase]] = []
        self._producers: dict[int, tuple[weakref.ref, Runner, int]] = {}
        self._consumers: dict[int, tuple[weakref.ref, list[tuple[Runner, int]]]] = {}

    def add(self, runner: Runner, phase: Phase) -> None:
        self.events.append((runner, phase))

    def note_outputs(self, runner: Runner, outputs: list[torch.Tensor]) -> None:
        """Remember that ``outputs[j]`` came from ``runner`` (to share buffers later)."""
        for j, t in enumerate(outputs):
            self._producers[id(t)] = (weakref.ref(t), runner, j)

    def producer(self, t: torch.Tensor) -> tuple[Runner, int] | None:
        """``(runner, j)`` if ``t`` is output ``j`` of a recorded call, else None."""
        entry = self._producers.get(id(t))
        if entry is None or entry[0]() is not t:
            return None
        return entry[1], entry[2]

    def note_inputs(self, runner: Runner, inputs: list[torch.Tensor]) -> None:
        """Remember that ``runner`` took ``inputs[i]`` (to merge calls sharing an input)."""
        for i, t in enumerate(inputs):
            entry = self._consumers.get(id(t))
            if entry is None or entry[0]() is not t:
                entry = self._consumers[id(t)] = (weakref.ref(t), [])
            entry[1].append((runner, i))

    def consumers(self, t: torch.Tensor) -> list[tuple[Runner, int]]:
        """``(runner, i)`` for every recorded call so far that took ``t`` as its input ``i``."""
        entry = self._consumers.get(id(t))
        if entry is None or entry[0]() is not t:
            return []
        return list(entry[1])

    def clear(self) -> None:
        self.events.clear()
        self._producers.clear()
        self._consumers.clear()


class NoteBackward(torch.autograd.Function):
    """Identity on the outputs of a recorded call; its backward logs ``(runner, "bwd")``, then
    calls ``land`` (the runner's flight ends: :meth:`tgraph.layers.replay.Flight.land`)."""

    @staticmethod
    def forward(ctx, record: Record, runner: Runner, land: Callable[[], None], *outputs):
        ctx.record, ctx.runner, ctx.land = record, runner, land
        # An unused output's gradient stays None, as without tgraph: the parameters only it
        # reaches keep .grad None (a zero gradient would still move them through AdamW).
        ctx.set_materialize_grads(False)
        # clones, not views: the caller may modify a recorded output in place, as in eager mode
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.record.add(ctx.runner, "bwd")
        ctx.land()
        return (None, None, None, *grads)
