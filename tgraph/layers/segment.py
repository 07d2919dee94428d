"""Merged neighbours: a stack of graphed calls captured as one forward and one backward graph.

When the record shows runners r0, r1, ..., rk called back to back (rj's forward right after
r(j-1)'s, every tensor input of rj being either an output of r(j-1) or the very tensor r0 also
took, such as an attention mask passed to every layer, and at least one being an output of
r(j-1)) and backed through in exactly the reverse order, with no random number drawn in between
from the generators the graphs draw from, no autograd node made in between, and no member that
draws any called in another autograd Function's forward than an earlier one (a reentrant
checkpoint per block reads the generators' state there), nothing eager can sit between them
that the graphs would need to see (or whose draws or gradient sums they would reorder). They are
then captured as one *segment*: one forward graph running all k+1 modules and one backward graph
(``autograd.grad`` of every module's outputs), bridged into autograd as one node. A step then
pays two replays and one autograd node for the whole stack instead of 2(k+1) of each.

At replay, r0's call replays the segment's forward and returns r0's outputs; the calls of
r1..rk return their outputs, already computed, after checking that each gets exactly the tensors
the previous call returned and the shared tensors r0 got, unmodified (same objects, same version
counters). Any other call
(out of order, a modified or different input) runs eagerly with a warning: the merged graph
never answers a call it did not compute. Like autograd's own saved-tensor check, the version
check cannot see writes that bypass version counters (``t.data.mul_()``, ``t.numpy()[:] = ...``):
do not modify a tensor that way between the calls of a merged stack. A stack whose replay draws
random numbers draws every member's at once: its head replays only if every later member's
``training`` flags and frozen parameters still match its key
(:class:`tgraph.layers.shortcut.MemberModes`; a member falling back would draw its numbers
again), and each later member's call checks that nothing drew since the replay (LayerDrop
switched on after capture: that step warns, the stack runs eagerly from then on). A later
member that falls back anyway after the replay (a hook or code between the members changing
the stream, a member skipped or called with other arguments), or a stack left midway, drew
that step's numbers in another order than eager too: the same warning (strict raises) and the
same eager stack from then on (:func:`tgraph.layers.replay.leave`). Every module's outputs
are outputs of the node, so a
caller may also use intermediate outputs (e.g. collect hidden states); their gradients are
added in the backward graph, before those from inside the stack, which is eager's order for code
that ran after the stack. Code between two members that uses an output (an auxiliary loss per
block) has its gradient added after them in eager, so its members stay apart (``BETWEEN``;
so do members with nodes between them that no backward reaches, such as logging outside
``torch.no_grad()``: the node counter cannot tell them apart). Code between the members
that makes nodes only after capture leaves the stack at that step (an exact eager fallback
with a warning; :data:`tgraph.layers.replay.NODES_BETWEEN`).

A segment is a :class:`tgraph.layers.capture.GraphedUnit` like a runner; only its forward differs. Its
capture result's ``slices`` and ``sources`` say which outputs each member returns and where each later
member's inputs come from; the calls themselves are answered by :func:`tgraph.layers.replay.call`
(the head replays, :func:`tgraph.layers.replay.take` serves the later members).
"""

from __future__ import annotations

import torch

from tgraph.layers.capture import GraphedUnit, run_warmup, warmup_passes
from tgraph.layers.runner import Runner, named
from tgraph.layers.shortcut import MemberModes

BETWEEN = (
    "eager code between their calls made autograd nodes: an auxiliary loss on the first one's "
    "output (merged, the stack's backward would add that code's gradient to the ones inside "
    "the stack in another order than eager, off in the last bits), or nodes no backward "
    "reaches, which tgraph cannot tell apart (h.norm().detach() outside torch.no_grad(), a "
    "custom autograd.Function even under no_grad: run such logging under torch.no_grad() "
    "with plain ops to merge them)"
)

HOOKED = (
    "the recorded iteration's backward found a hook or retain_grad() on the first one's "
    "output: merged, the stack's backward would add that output's gradient from the next one "
    "inside its graph, where the hook never sees it"
)


def mergeable_chains(
    events: list[tuple[Runner, str]], unmerged: list[str] | None = None
) -> list[list[Runner]]:
    """Chains of at least two runners that may be merged (see the module docstring).
    ``unmerged`` gets the neighbours left apart only because eager autograd code ran between
    their calls (:data:`BETWEEN`) or a hook watched the first one's output's gradient
    (:data:`HOOKED`), with the reason."""
    first: dict[tuple[int, str], int] = {}
    for i, (r, phase) in enumerate(events):
        first.setdefault((id(r), phase), i)
    order = sorted({id(r): r for r, _ in events}.values(), key=lambda r: first[(id(r), "fwd")])

    def follows(chain: list[Runner], nxt: Runner) -> bool:
        head, prev = chain[0], chain[-1]
        if not (nxt.merge and prev.merge and nxt.draft.call.links and nxt.device == prev.device):
            return False
        # Modules with buffers (e.g. BatchNorm statistics) stay apart: if a merged member
        # falls back to eager, the segment's replay would already have updated its buffers.
        if any(True for _ in nxt.module.buffers()) or any(True for _ in prev.module.buffers()):
            return False
        if nxt.grad_mode != prev.grad_mode or nxt.key.autocast != prev.key.autocast:
            return False
        if nxt.main_grad_fusion != prev.main_grad_fusion:  # one segment, one main_grad treatment
            return False
        if nxt.direct_grads != prev.direct_grads:  # ... and one way to .grad
            return False
        if first[(id(nxt), "fwd")] != first[(id(prev), "fwd")] + 1:
            return False
        # Random numbers drawn between the calls (LayerDrop's torch.rand between layers) come
        # from the generators the graphs draw from: the stack's replay would draw nxt's first.
        call = nxt.draft.call
        if call.rng_before != prev.draft.call.rng_after:
            return False
        # A reentrant checkpoint around each block reads the generators' state as its forward
        # starts, for its recompute: the stack's replay would have drawn nxt's numbers by then.
        if call.rng_after != call.rng_before and any(
            r.draft.call.region != call.region for r in chain
        ):
            return False
        if sources(head, prev, nxt) is None:
            return False
        bp, bn = first.get((id(prev), "bwd")), first.get((id(nxt), "bwd"))
        if bp is None and bn is None:
            return not prev.grad_mode
        if bp is None or bn is None or bp != bn + 1:
            return False
        if call.nodes_before != prev.draft.call.nodes_after:  # gradients summed otherwise
            if unmerged is not None:
                unmerged.append(f"{named(prev.module)} and {named(nxt.module)} ({BETWEEN})")
            return False
        if prev.draft.call.hooked:  # its output's whole gradient must reach autograd
            if unmerged is not None:
                unmerged.append(f"{named(prev.module)} and {named(nxt.module)} ({HOOKED})")
            return False
        return True

    chains: list[list[Runner]] = []
    for r in order:
        if chains and follows(chains[-1], r):
            chains[-1].append(r)
        else:
            chains.append([r])
    return [c for c in chains if len(c) > 1]


def sources(head: Runner, prev: Runner, nxt: Runner) -> list[tuple[bool, int]] | None:
    """Where each tensor input of ``nxt`` comes from in a stack starting at ``head``.

    ``(True, k)``: output ``k`` of ``prev``; ``(False, j)``: the tensor ``head`` took as its
    input ``j``. None when some input is neither, or when no input comes from ``prev``.
    """
    found = []
    call = nxt.draft.call
    for link, shared in zip(call.links, call.shared_with):
        if link is not None and link[0] is prev:
            found.append((True, link[1]))
            continue
        j = next((j for r, j in shared if r is head), None)
        if j is None:
            return None
        found.append((False, j))
    return found if any(from_prev for from_prev, _ in found) else None


class Segment(GraphedUnit):
    """Runners ``runners[0..k]`` captured as one forward and one backward graph."""

    def __init__(self, runners: list[Runner]) -> None:
        self.runners = runners
        for j, r in enumerate(runners):
            r.segment, r.seg_index = self, j
        self.head, self.members = runners[0], runners
        self.key = self.head.key
        self._sources = [[]] + [
            sources(self.head, prev, r) for prev, r in zip(runners, runners[1:])
        ]
        head = self.head
        self._init_unit(head.device, head.grad_mode, head.main_grad_fusion, head.direct_grads)

    def __repr__(self) -> str:
        first, last = named(self.head.module), named(self.runners[-1].module)
        return f"Segment({len(self.runners)} modules, {first} to {last})"

    # ----------------------------------------------------------------- capture
    def _prepare_capture(self) -> None:
        self.head._prepare_capture()
        for r in self.runners[1:]:
            r.make_aliases()

    def _run_forward(self) -> list[torch.Tensor]:
        head_in = self.head.draft.static_inputs
        outs = self.head._run_forward()
        flat = list(outs)
        slices = self.draft.slices = [slice(0, len(outs))]
        for r, src in zip(self.runners[1:], self._sources[1:]):
            # rj reads r(j-1)'s outputs of this very run: one autograd graph for the stack
            r.draft.static_inputs = [outs[k] if from_prev else head_in[k] for from_prev, k in src]
            outs = r._run_forward()
            slices.append(slice(len(flat), len(flat) + len(outs)))
            flat += outs
        return flat

    def _warmup(self, inputs: list[torch.Tensor], warmup: int) -> None:
        """Warm the stack up one block at a time: each block's forward and backward run before
        the next block's, on a detached copy of the previous block's output, so the warmup
        holds one block's activations instead of the whole stack's (H200, 12 blocks d256: the
        warmup's rise 278 -> 101 MiB; docs/BENCHMARKS.md)."""
        head_in = self.head.draft.static_inputs
        for n in range(warmup_passes(warmup, self.compiled)):
            prev: list[torch.Tensor] = []
            for r, src in zip(self.runners, self._sources):
                if r is not self.head:  # the previous block's output of this pass, or shared
                    r.draft.static_inputs = [prev[k] if p else head_in[k] for p, k in src]
                leaves = [t for t in r.draft.static_inputs if t.requires_grad]
                # the host-sync check in the first pass only (warmup_passes says why)
                prev = run_warmup(
                    r._run_forward,
                    leaves,
                    1,
                    self.device,
                    check_first=n == 0,
                    host_scalars=self.draft.host_reads,
                )
        for r in self.runners[1:]:
            r.draft.static_inputs = []

    def capture_forward(self, factory, warmup: int) -> None:
        super().capture_forward(factory, warmup)
        for r, sl in zip(self.runners, self.draft.slices):
            r.draft.static_outputs = self.draft.static_outputs[sl]

    def _member_slices(self) -> list[slice]:
        return self.draft.slices

    def _member_sources(self) -> list[list[tuple[bool, int]]]:
        return self._sources

    def _member_modes(self) -> MemberModes | None:
        """The later members' modes, which the head checks when the stack draws random
        numbers (its replay draws every member's: one that fell back would draw again)."""
        if all(r.draft.call.rng_before == r.draft.call.rng_after for r in self.runners):
            return None
        return MemberModes([(r, r.module.__dict__["_tgraph"]) for r in self.runners[1:]])

    def drop_graphs(self) -> None:
        super().drop_graphs()
        for r in self.runners:
            r.segment = None
            r.drop_graphs()
