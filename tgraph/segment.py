"""Merged neighbours: a stack of graphed calls captured as one forward and one backward graph.

When the record shows runners r0, r1, ..., rk called back to back (rj's forward right after
r(j-1)'s, every tensor input of rj being either an output of r(j-1) or the very tensor r0 also
took, such as an attention mask passed to every layer, and at least one being an output of
r(j-1)) and backed through in exactly the reverse order, nothing eager can sit between them that
the graphs would need to see. They are
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
do not modify a tensor that way between the calls of a merged stack. Every module's outputs are outputs of the node, so a
caller may also use intermediate outputs (e.g. collect hidden states); their gradients are
added in the backward graph.

A segment quacks like a :class:`tgraph.runner.Runner` for :mod:`tgraph.bridge`.
"""

from __future__ import annotations

import torch

from tgraph.backend import GraphFactory
from tgraph.grads import MainGradFlags, MainGradFusion, ParamGradPacking
from tgraph.runner import (
    Runner,
    UnusedOutputs,
    autograd_params,
    capture_backward_graph,
    capture_forward_graph,
    kept_positions,
    reached_leaves,
    split_grads,
)


def mergeable_chains(events: list[tuple[Runner, str]]) -> list[list[Runner]]:
    """Chains of at least two runners that may be merged (see the module docstring)."""
    first: dict[tuple[int, str], int] = {}
    for i, (r, phase) in enumerate(events):
        first.setdefault((id(r), phase), i)
    order = sorted({id(r): r for r, _ in events}.values(), key=lambda r: first[(id(r), "fwd")])

    def follows(head: Runner, prev: Runner, nxt: Runner) -> bool:
        if not (nxt.merge and prev.merge and nxt.links and nxt.device == prev.device):
            return False
        # Modules with buffers (e.g. BatchNorm statistics) stay apart: if a merged member
        # falls back to eager, the segment's replay would already have updated its buffers.
        if any(True for _ in nxt.module.buffers()) or any(True for _ in prev.module.buffers()):
            return False
        if nxt.grad_mode != prev.grad_mode or nxt.key.autocast != prev.key.autocast:
            return False
        if nxt.fusion.enabled != prev.fusion.enabled:  # one segment, one main_grad treatment
            return False
        if first[(id(nxt), "fwd")] != first[(id(prev), "fwd")] + 1:
            return False
        if sources(head, prev, nxt) is None:
            return False
        bp, bn = first.get((id(prev), "bwd")), first.get((id(nxt), "bwd"))
        if bp is None and bn is None:
            return not prev.grad_mode
        return bp is not None and bn is not None and bp == bn + 1

    chains: list[list[Runner]] = []
    for r in order:
        if chains and follows(chains[-1][0], chains[-1][-1], r):
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
    for link, shared in zip(nxt.links, nxt.shared_with):
        if link is not None and link[0] is prev:
            found.append((True, link[1]))
            continue
        j = next((j for r, j in shared if r is head), None)
        if j is None:
            return None
        found.append((False, j))
    return found if any(from_prev for from_prev, _ in found) else None


class Segment:
    """Runners ``runners[0..k]`` captured as one forward and one backward graph."""

    def __init__(self, runners: list[Runner]) -> None:
        self.runners = runners
        for j, r in enumerate(runners):
            r.segment, r.seg_index = self, j
        self.head = runners[0]
        self._sources = [[]] + [
            sources(self.head, prev, r) for prev, r in zip(runners, runners[1:])
        ]
        self.key = self.head.key
        self.device = self.head.device
        self.flight: int | None = None
        self.held = False
        self.ledger = None
        self.unused = UnusedOutputs()
        self.debug = False
        self.fwd_graph = None
        self.bwd_graph = None
        self.static_outputs: list[torch.Tensor] = []
        self.static_grads: list[torch.Tensor | None] = []
        self.static_grad_outputs: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []
        self.autograd_params: list[torch.Tensor] = []
        self.needs_backward = False
        self._slices: list[slice] = []
        self._out_rg: list[int] = []
        self._out_nodiff: list[int] = []
        self._leaves: list[torch.Tensor] = []
        self.packing = ParamGradPacking()
        self.fusion = MainGradFusion(self.head.fusion.enabled)
        self._param_grads: list[torch.Tensor | None] = []
        self._flags: MainGradFlags | None = None
        self._grad_out_zero: list[bool] = []
        self.pending: list[list[torch.Tensor]] | None = None
        self._next = 0
        self._versions: list[int] = []
        self._head_inputs: list[torch.Tensor] = []
        self._head_versions: list[int] = []

    def __repr__(self) -> str:
        return f"Segment({len(self.runners)} x {type(self.head.module).__name__})"

    @property
    def captured(self) -> bool:
        return self.fwd_graph is not None and (
            self.bwd_graph is not None or not self.needs_backward
        )

    # ----------------------------------------------------------------- capture
    def _aliases(self) -> list[torch.Tensor]:
        return [a for r in self.runners for a in r._aliases.values()]

    def _run_forward(self) -> list[torch.Tensor]:
        head_in = self.head.static_inputs
        outs = self.head._run_forward()
        flat = list(outs)
        for r, src in zip(self.runners[1:], self._sources[1:]):
            # rj reads r(j-1)'s outputs of this very run: one autograd graph for the stack
            r.static_inputs = [outs[k] if from_prev else head_in[k] for from_prev, k in src]
            outs = r._run_forward()
            flat += outs
        return flat

    def _run_backward(self) -> tuple:
        graph_outs = self.fwd_graph.live_outputs or self.static_outputs
        head = self.head
        ins = [head.static_inputs[i] for i in head._in_rg] + self._leaves
        grads = torch.autograd.grad(
            [graph_outs[i] for i in self._out_rg],
            ins,
            grad_outputs=self.static_grad_outputs,
            retain_graph=self.fwd_graph.retains_autograd_graph,
            allow_unused=True,
        )
        n = len(head._in_rg)
        rest = self.fusion.apply(self._leaves, self.params, list(grads[n:]))
        return (*grads[:n], *self.packing.pack(rest))

    def capture_forward(self, factory: GraphFactory, warmup: int) -> None:
        head = self.head
        head.prepare_capture()
        for r in self.runners[1:]:
            r.prepare_capture(static_inputs=False)
        self.ledger = factory.ledger
        inputs = [head.static_inputs[i] for i in head._in_rg]
        self.fwd_graph, self.static_outputs = capture_forward_graph(
            factory,
            self.device,
            self._aliases(),
            self._run_forward,
            inputs,
            warmup,
            [m for r in self.runners for m in r.module.modules()],
            head.static_inputs,
        )
        start = 0
        for r in self.runners:
            n = len(r.out_template_tensors())
            self._slices.append(slice(start, start + n))
            r.static_outputs = self.static_outputs[start : start + n]
            start += n
        self._out_rg = [i for i, o in enumerate(self.static_outputs) if o.requires_grad]
        self._out_nodiff = [i for i, o in enumerate(self.static_outputs) if not o.requires_grad]
        self.needs_backward = head.grad_mode and bool(self._out_rg)
        if self.needs_backward:
            rg_outs = [self.static_outputs[i] for i in self._out_rg]
            static_in = {id(t) for t in head.static_inputs}
            reached = [t for t in reached_leaves(rg_outs) if id(t) not in static_in]
            reached_ids = {id(t) for t in reached}
            for r in self.runners:  # module order, then leaves from outside (tied weights)
                for p in r.module.parameters():
                    alias = r._aliases[id(p)]
                    if id(alias) in reached_ids:
                        self._leaves.append(alias)
                        self.params.append(p)
            aliases = {id(a) for r in self.runners for a in r._aliases.values()}
            foreign = [t for t in reached if id(t) not in aliases]
            self._leaves += foreign
            self.params += foreign
            self.unused.setup(rg_outs, inputs, head._in_rg, self._leaves)

    def capture_backward(self, factory: GraphFactory) -> None:
        self.static_grad_outputs = [torch.zeros_like(self.static_outputs[i]) for i in self._out_rg]
        self._grad_out_zero = [True] * len(self.static_grad_outputs)
        self._flags = MainGradFlags(zip(self._leaves, self.params))
        self.bwd_graph, grads = capture_backward_graph(
            factory, self._aliases(), self._run_backward, self._flags, self.fwd_graph
        )
        head = self.head
        self.static_grads, self._param_grads = split_grads(
            grads, len(head.static_inputs), head._in_rg, self.packing
        )
        self.autograd_params = autograd_params(self.fusion, self.params, head._in_rg, self.device)
        self.unused.place_leaves(len(head.static_inputs), kept_positions(self.fusion, self.params))
        for r in self.runners:
            r.samples = []

    def drop_graphs(self) -> None:
        self.fwd_graph = self.bwd_graph = None
        self.static_outputs, self.static_grads, self.static_grad_outputs = [], [], []
        self.params, self._leaves, self.pending = [], [], None
        self.autograd_params = []
        self.ledger, self.held, self.unused = None, False, UnusedOutputs()
        self.packing, self._param_grads, self._flags = ParamGradPacking(), [], None
        self.fusion = MainGradFusion(self.fusion.enabled)
        for r in self.runners:
            r.segment = None
            r.drop_graphs()

    # ------------------------------------------------------------------ replay
    def copy_inputs(self, tensors) -> bool:
        return self.head.copy_inputs(tensors)

    grads_for_autograd = Runner.grads_for_autograd

    copy_grad_outputs = Runner.copy_grad_outputs

    def after_backward(self) -> None:
        self._flags.after_replay()
        if self.debug:
            self.head.after_backward_debug()  # the head's static inputs
            for buf in self.static_grad_outputs:
                buf.fill_(float("nan"))
            self._grad_out_zero = [False] * len(self.static_grad_outputs)

    def start(self, outs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """After the forward replay on the head's ``inputs``: keep every module's outputs
        (and the inputs, which later modules may share); return the head's outputs."""
        self.pending = [outs[s] for s in self._slices]
        self._versions = [t._version for t in outs]
        self._head_inputs = inputs  # the call's own fresh list
        self._head_versions = [t._version for t in inputs]
        self._next = 1
        return self.pending[0]

    def take(self, runner: Runner, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Outputs of ``runner`` if this call continues the replayed stack as captured."""
        j = runner.seg_index
        if self.pending is None or j != self._next:
            return None
        prev, base = self.pending[j - 1], self._slices[j - 1].start
        for t, (from_prev, k) in zip(tensors, self._sources[j]):
            if from_prev:
                src, version = prev[k], self._versions[base + k]
            else:
                src, version = self._head_inputs[k], self._head_versions[k]
            if t is not src or t._version != version:
                self.pending = None  # the stack was left: release its outputs
                self._head_inputs = []
                return None
        self._next += 1
        out = self.pending[j]
        if self._next == len(self.runners):
            self.pending, self._head_inputs = None, []
        return out
