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

A call reuses a free runner only where replaying that runner's graphs at this point of the
iteration is safe for the shared pool (:meth:`Record.reusable`): each graph is captured once,
at its runner's first call, and may reuse pool memory that was free at that moment
(:mod:`tgraph.pool`). So a runner first called before another runner now in flight was called,
or after that runner's backward was captured, may overwrite its saved activations, and the
call gets a runner of its own instead. Gradient accumulation (forward, backward, forward, ...)
reuses one runner per layer; a 1F1B pipeline schedule, whose forwards of a later microbatch
run while an earlier one awaits its backward, gets one runner per layer and microbatch, as
TransformerEngine graphs it. Reusing one runner per in-flight depth there cannot be safe in
one pool: stage 0 of ``F0 F1 B0 F2 B1 ...`` would replay the graph of ``F0`` (captured before
``F1``'s activations existed) while ``F1`` awaits its backward.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch

Runner = Any  # a tgraph.layers.runner.Runner; not imported (no import cycle)

Phase = Literal["fwd", "bwd"]


class Record:
    """Ordered forward/backward events plus which runner produced which tensor."""

    def __init__(self) -> None:
        self.events: list[tuple[Runner, Phase]] = []
        # id(runner) -> [runner, position of its first forward, of its first backward]: where
        # its graphs will be captured (create_graphs() captures at those events)
        self._first: dict[int, list] = {}
        self._producers: dict[int, tuple[weakref.ref, Runner, int]] = {}
        self._consumers: dict[int, tuple[weakref.ref, list[tuple[Runner, int]]]] = {}

    def add(self, runner: Runner, phase: Phase) -> None:
        first = self._first.get(id(runner))
        if first is None:
            first = self._first[id(runner)] = [runner, math.inf, math.inf]
        slot = 1 if phase == "fwd" else 2
        if first[slot] == math.inf:
            first[slot] = len(self.events)
        self.events.append((runner, phase))

    def reusable(self, runners: Iterable[Runner]) -> Runner | None:
        """The free runner of ``runners`` (one call key's) that this call may reuse, or None
        (the call gets a new runner).

        Replaying a runner's forward graph here is safe for a runner in flight only if its
        capture falls between that runner's forward and backward captures
        (:class:`tgraph.pool.PoolLedger`, which checks every replay, applies the same rule).
        Of the safe ones, the earliest recorded: a merged stack's later members then pair
        with the runner its head reused.
        """
        live = [
            (f[1], f[2])
            for f in self._first.values()
            if f[0].state.inflight.token is not None and not f[0].state.inflight.held
        ]
        for r in runners:
            if r.state.inflight.token is not None:
                continue
            at = self._first[id(r)][1] if id(r) in self._first else math.inf
            if all(low < at < high for low, high in live):
                return r
        return None

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
        self._first.clear()
        self._producers.clear()
        self._consumers.clear()


class Turns:
    """The order in which the recorded iteration's calls of one key took its runners, which
    the replayed iterations follow: each call tries first the runner the recorded call at its
    place took (:meth:`order`), so a call does not try, and have refused, runners whose
    replay the pool's order forbids there (under 1F1B, the earlier microbatches')."""

    __slots__ = ("_seq", "_orders", "_pos")

    def __init__(self, seq: list[Runner], runners: list[Runner]) -> None:
        self._seq = seq  # the runner of each recorded call, in order
        self._orders = [(r, *[x for x in runners if x is not r]) for r in seq]
        self._pos = 0

    def order(self) -> tuple[Runner, ...]:
        """Every runner of the key, the one expected at this call first."""
        return self._orders[self._pos]

    def took(self, runner: Runner) -> None:
        """This call was answered by ``runner``: the next call is expected where the recorded
        iteration's next call after ``runner``'s was (a call that ran eagerly moves nothing)."""
        n, pos = len(self._seq), self._pos
        for k in range(n):
            if self._seq[(pos + k) % n] is runner:
                self._pos = (pos + k + 1) % n
                return

    @staticmethod
    def of(events: list[tuple[Runner, Phase]], runners: list[Runner]) -> Turns | None:
        """The turns of ``runners`` (one key's) in the record ``events``; None when the key has
        one runner (nothing to choose)."""
        if len(runners) < 2:
            return None
        ids = {id(r) for r in runners}
        return Turns([r for r, phase in events if phase == "fwd" and id(r) in ids], runners)


#: why a runner whose recorded forward was backed through twice stays eager
BACKWARD_TWICE = (
    "its backward ran more than once for one forward in the recorded iteration (outputs kept "
    "with retain_graph=True and backed through again, e.g. one torch.autograd.grad per loss as "
    "in PCGrad or GradNorm), and a graph's backward replays once per forward"
)


class NoteBackward(torch.autograd.Function):
    """Identity on the outputs of a recorded call; its backward logs ``(runner, "bwd")``, then
    calls ``land`` (the runner's flight ends: :meth:`tgraph.layers.replay.Flight.land`). A
    second backward through the same call (``retain_graph=True``) marks the runner refused
    (:data:`BACKWARD_TWICE`): create_graphs() leaves it eager."""

    @staticmethod
    def forward(ctx, record: Record, runner: Runner, land: Callable[[], None], *outputs):
        ctx.record, ctx.runner, ctx.land = record, runner, land
        ctx.backed = False
        # An unused output's gradient stays None, as without tgraph: the parameters only it
        # reaches keep .grad None (a zero gradient would still move them through AdamW).
        ctx.set_materialize_grads(False)
        # clones, not views: the caller may modify a recorded output in place, as in eager mode
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.backed:
            ctx.runner.refused = BACKWARD_TWICE
        ctx.backed = True
        ctx.record.add(ctx.runner, "bwd")
        ctx.land()
        return (None, None, None, *grads)
