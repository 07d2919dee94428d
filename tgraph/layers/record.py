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

The record also notes which autograd nodes each recorded call made (a :class:`Span` of
autograd's node counter) and, at each recorded backward, which calls' nodes (or eager code's)
hand a gradient to each leaf (:meth:`Record.note_backward`): a parameter that a unit and
something else both reach keeps autograd's path under direct gradients
(:meth:`Record.reached_elsewhere`).
"""

from __future__ import annotations

import math
import weakref
from bisect import bisect_right
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
        self._spans: list[Span] = []  # every recorded call's autograd nodes
        self._open: list[Span] = []  # ... the calls in progress, innermost last
        # per leaf that one recorded backward reached from several places: the leaf, and the
        # innermost span of each place (None: eager code outside every recorded call)
        self._shared: list[tuple[weakref.ref, set[Span | None]]] = []

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

    def open_call(self, runner: Runner, nodes: int) -> Span:
        """A recorded call of ``runner`` starts; ``nodes``: autograd's node counter now."""
        span = Span(runner, nodes, self._open[-1] if self._open else None)
        self._spans.append(span)
        self._open.append(span)
        return span

    def close_call(self, span: Span, nodes: int) -> None:
        """The call of ``span`` ended (returned or raised); ``nodes``: the counter now."""
        span.hi = nodes
        self._open.remove(span)

    def note_backward(self, roots: Iterable[torch.Tensor]) -> None:
        """A backward (or ``autograd.grad``) of the recorded iteration starts from ``roots``:
        note each leaf that it reaches from more than one place, a place being the innermost
        recorded call whose nodes hand the leaf a gradient, or eager code. Autograd adds up a
        leaf's gradients before accumulating them into ``.grad``; a unit writing ``.grad`` itself
        must leave such a leaf to autograd (:meth:`reached_elsewhere`). Recording only: one walk
        of the graph per backward."""
        if not self._spans:
            return
        spans = sorted(self._spans, key=_outer_first)
        starts = [s.lo for s in spans]
        places: dict[int, tuple[torch.Tensor, set[Span | None]]] = {}
        seen: dict[int, object] = {}  # wrappers kept alive: their ids stay unique (reached_leaves)
        stack = [t.grad_fn for t in roots if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if id(fn) in seen:
                continue
            seen[id(fn)] = fn
            for nxt, _ in fn.next_functions:
                if nxt is None:
                    continue
                leaf = getattr(nxt, "variable", None)  # an AccumulateGrad node
                if leaf is None:
                    stack.append(nxt)
                    continue
                place = _innermost(spans, starts, fn._sequence_nr())
                places.setdefault(id(leaf), (leaf, set()))[1].add(place)
        for leaf, where in places.values():
            if len(where) > 1:
                self._shared.append((weakref.ref(leaf), where))

    def reached_elsewhere(self, members: Iterable[Runner]) -> set[int]:
        """Ids of the leaves that a recorded backward reached both through calls of
        ``members`` (a unit's runners, or runners recorded inside theirs) and from elsewhere
        (eager code, another unit, another call in flight)."""
        ids = {id(r) for r in members}

        def ours(place: Span | None) -> bool:
            while place is not None:
                if id(place.runner) in ids:
                    return True
                place = place.outer
            return False

        found = set()
        for ref, where in self._shared:
            leaf = ref()
            mine = [ours(p) for p in where]
            if leaf is not None and any(mine) and not all(mine):
                found.add(id(leaf))
        return found

    def clear(self) -> None:
        self.events.clear()
        self._first.clear()
        self._producers.clear()
        self._consumers.clear()
        self._spans.clear()
        self._open.clear()
        self._shared.clear()


class Span:
    """The autograd nodes one recorded call made: sequence numbers ``lo`` to ``hi`` (autograd's
    node counter, this thread's, before and after the call; ``hi`` unknown while it runs), and
    the recorded call it ran inside (``outer``: a whole model's, whose parts record too)."""

    __slots__ = ("runner", "lo", "hi", "outer")

    def __init__(self, runner: Runner, lo: int, outer: Span | None) -> None:
        self.runner, self.lo, self.hi, self.outer = runner, lo, math.inf, outer


def _outer_first(span: Span) -> tuple:
    return span.lo, -span.hi


def _innermost(spans: list[Span], starts: list[int], seq: int) -> Span | None:
    """The innermost span holding node ``seq`` (``spans`` sorted by :func:`_outer_first`,
    ``starts`` their ``lo``), or None. Calls nest or follow each other, so the spans holding
    it are the last one starting at or before it and its outer ones."""
    i = bisect_right(starts, seq) - 1
    span = spans[i] if i >= 0 else None
    while span is not None and seq >= span.hi:
        span = span.outer
    return span


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
    (:data:`BACKWARD_TWICE`): create_graphs() leaves it eager. A hook or ``retain_grad()`` on
    an output, found in its backward, keeps the runner apart from the next one
    (:data:`tgraph.layers.segment.HOOKED`)."""

    @staticmethod
    def forward(ctx, record: Record, runner: Runner, land: Callable[[], None], *outputs):
        ctx.record, ctx.runner, ctx.land = record, runner, land
        ctx.backed = False
        # An unused output's gradient stays None, as without tgraph: the parameters only it
        # reaches keep .grad None (a zero gradient would still move them through AdamW).
        ctx.set_materialize_grads(False)
        # clones, not views: the caller may modify a recorded output in place, as in eager mode
        outs = tuple(o.clone() for o in outputs)
        ctx.outs = [weakref.ref(o) for o in outs]  # weak: no cycle through this node
        return outs

    @staticmethod
    def backward(ctx, *grads):
        if ctx.backed:
            ctx.runner.refused = BACKWARD_TWICE
        ctx.backed = True
        draft = ctx.runner.draft  # (None once captured)
        if draft is not None and any(map(_hooked, ctx.outs)):
            draft.call.hooked = True
        ctx.record.add(ctx.runner, "bwd")
        ctx.land()
        return (None, None, None, *grads)


def _hooked(ref: weakref.ref) -> bool:
    """Whether the tensor ``ref`` points at has a hook (``register_hook``) or retains its
    gradient: a merged stack's backward sums an inner output's gradient out of autograd's
    sight (:data:`tgraph.layers.segment.HOOKED`)."""
    t = ref()
    return t is not None and (bool(t._backward_hooks) or t.retains_grad)
