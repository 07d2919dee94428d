"""A graphed unit: one forward graph and one backward graph, bridged into autograd.

Two kinds of unit exist, and they differ only in how their forward runs:

* :class:`tgraph.layers.runner.Runner`: one graphed module called with one signature;
* :class:`tgraph.layers.segment.Segment`: a stack of runners called back to back, as one graph pair.

Everything else of a capture lives here, once: warmup, the forward graph, leaf discovery, the
backward graph, each filling the unit's :class:`tgraph.layers.draft.CaptureDraft`, and
:meth:`GraphedUnit.bake`, which freezes the draft into the unit's capture
result (:class:`tgraph.layers.captured.Captured`) once every graph of the pool is captured and
drops it. A replay works on that capture result and the unit's :class:`tgraph.layers.captured.ReplayState` alone
(:mod:`tgraph.layers.replay`), never on the unit.

Ownership and aliasing (what a user of the outputs must know):

* ``static_inputs`` (the head runner's) are the buffers the forward graph reads. Every replay first copies the
  live inputs into them, unless the live tensor already *is* the buffer (layer i's returned
  output is layer i+1's static input, so the copy is skipped by pointer identity).
* ``static_outputs`` are written by every forward replay. The tensors a graphed call returns
  are views of them, valid until this unit's next forward replay, which cannot happen while the
  unit is in flight (awaiting its backward). Another graph that may reuse their memory replays
  only after they are moved out of the pool (:mod:`tgraph.pool`).
* ``static_grads`` (input gradients) are written by every backward replay, each alone on its
  storage, and handed to autograd as aliases, protected as the parameter gradients' are (a
  caller may keep them: ``torch.autograd.grad(loss, x)``, a tensor hook, a leaf's ``.grad``;
  older PyTorch: copies; :class:`tgraph.layers.grads.GradHandOff`). Parameter gradients stay
  where the capture's autograd made them, one static buffer each
  (:class:`tgraph.layers.grads.ParamGradOutputs`). Each backward hands autograd aliases of those
  buffers, which AccumulateGrad adopts as ``.grad`` without a copy: they *are* static memory, so the pool's ledger
  (:meth:`tgraph.pool.PoolLedger.hold_grads`) moves them to a copy before a replay may
  overwrite it (this unit's next backward or forward, or a graph captured before it): every
  tensor still viewing it on PyTorch >= 2.13 (a storage swap), the parameters' ``.grad`` on
  older versions, where a view kept elsewhere makes that replay run eagerly instead.
  ``torch.cuda.make_graphed_callables`` hands autograd ``detach()``-ed aliases of its static
  buffers too, but never moves them, so the next replay overwrites accumulated gradients
  (pytorch issue 181723). Gradient accumulation through a unit is exact either way.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from tgraph import rng
from tgraph.backend import GraphFactory
from tgraph.baked import Baked, own_uses
from tgraph.emulated import emulated_capture
from tgraph.fp8 import FP8Region, FP8Replay
from tgraph.guards import RefuseHostSync
from tgraph.layers.captured import Captured, ReplayState
from tgraph.layers.direct_grads import DirectGrads
from tgraph.layers.draft import CaptureDraft, RecordedCall
from tgraph.layers.follow import route, track_outputs, unfollow
from tgraph.layers.grads import (
    GradHandOff,
    MainGradFlags,
    MainGradFusion,
    own_storages,
    reached_leaves,
)
from tgraph.memory import UnitMemory, tensor_bytes
from tgraph.pool import NEVER

_depth = 0  # > 0 while a graphed module's own forward runs (recorded, warmed up or captured)


@contextlib.contextmanager
def graphed_region() -> Iterator[None]:
    """Inside, GraphableModules run as plain modules: they are part of the enclosing graph."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def inside_graphed_region() -> bool:
    return _depth > 0


_checkpointed = 0  # > 0: graphable modules called in a graphed region run checkpointed


@contextlib.contextmanager
def parts_checkpointed() -> Iterator[None]:
    """Inside (and in a graphed region), a graphable module called with grad enabled runs
    under non-reentrant ``torch.utils.checkpoint``: autograd keeps its inputs, not its
    activations, and recomputes them in the backward, from the same generator states (the
    same numbers). The shadow verifier's eager twin of a unit that graphs its parts (a whole
    model) runs so, so that it holds about one layer's activations beside the graphs, not a
    second copy of the model's."""
    global _checkpointed
    _checkpointed += 1
    try:
        yield
    finally:
        _checkpointed -= 1


def warmup_passes(warmup: int, compiled: bool) -> int:
    """How many warmup passes a unit runs: ``warmup``, and at least two when it runs compiled
    code. The first pass runs under the host-sync check, a dispatch mode, where dynamo does not
    run (the module runs eagerly); dynamo compiles once more for the graphs' parameter aliases,
    which must happen in a later pass: a CUDA capture calls the compiled code too, and inductor
    compiling inside a capture fails (cudaErrorStreamCaptureUnsupported)."""
    return max(warmup, 2) if compiled else warmup


def run_warmup(
    fn,
    input_leaves: list[torch.Tensor],
    warmup: int,
    device: torch.device,
    check_first: bool = True,
    host_scalars: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Eager passes of ``fn`` (forward, plus backward where outputs need grad) before capture.

    The first pass (``check_first``) refuses host syncs on ``device``'s tensors, in the
    forward and in the backward, so they fail here with a clear error instead of invalidating
    a CUDA capture (and in a merged stack's warmup, where the stack can still be split).
    Returns the last pass's outputs, detached (leaves that require grad where the outputs did).
    On CUDA the checked pass also appends to ``host_scalars`` the one-element CPU tensors the
    operations read (a CUDA graph keeps their values).
    """
    last: list[torch.Tensor] = []
    gens = [*rng.graph_generators(device), rng.default_generator(device)]
    for i in range(warmup):
        checked = i == 0 and check_first
        host = host_scalars if device.type == "cuda" else None
        refuse = RefuseHostSync(device.type, gens, host) if checked else contextlib.nullcontext()
        with emulated_capture(), refuse:  # the branches the capture takes (emulated_capture)
            outs = fn()
            rg = [o for o in outs if o.requires_grad]
            if rg:
                ins = list(input_leaves)
                ins += [p for p in reached_leaves(rg) if all(p is not x for x in ins)]
                grads = [torch.ones_like(o) for o in rg]
                torch.autograd.grad(rg, ins, grads, allow_unused=True)
        last = [o.detach().requires_grad_(o.requires_grad) for o in outs]
        del outs, rg
    return last


class GraphedUnit:
    """State and mechanics shared by runners and merged stacks (module docstring).

    Subclasses set ``head`` (the runner whose static inputs the forward graph reads),
    ``members`` (the runners whose modules run in the forward) and implement
    :meth:`_run_forward` and :meth:`_prepare_capture`.
    """

    head: Any
    members: list
    #: why the unit runs eagerly although it was recorded (its capture failed), set by
    #: :func:`tgraph.create_graphs`; None for a captured unit
    left_eager: str | None = None
    #: why the recorded call cannot be graphed (set while recording: manager._record_call,
    #: record.NoteBackward)
    refused: str | None = None
    #: the runner whose recorded call recorded this one (a module inside a unit that
    #: ``GraphableModule.graphs_parts`` lets fall back to its parts), or None
    within: Any = None
    #: the unit could not be captured whole and the graphed modules inside it keep their graphs:
    #: its calls run its own code plainly and theirs replay (set by create_graphs)
    by_parts: bool = False

    def _init_unit(
        self,
        device: torch.device,
        grad_mode: bool,
        fusion: bool,
        direct: bool = False,
        call: RecordedCall | None = None,
    ) -> None:
        self.device = device
        self.grad_mode = grad_mode
        self.debug = False  # poison the static buffers after each backward (enable(debug=True))
        self.main_grad_fusion = fusion  # options (MainGradFusion, DirectGrads)
        self.direct_grads = direct
        self.cap: Captured | None = None  # the frozen capture result, once every graph is captured
        self.state = ReplayState()  # what replays change (tgraph.layers.captured)
        self.draft: CaptureDraft | None = None  # the capture's findings until bake
        self.new_draft(call)

    def new_draft(self, call: RecordedCall | None = None) -> None:
        """A fresh :class:`tgraph.layers.draft.CaptureDraft` (before a capture, and again after
        a failed one, from the same recorded ``call``); :meth:`bake` drops it."""
        if call is None and self.draft is not None:
            call = self.draft.call
        self.draft = CaptureDraft(MainGradFusion(self.main_grad_fusion), call)

    # ----------------------------------------------------------------- capture
    def _run_forward(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _prepare_capture(self) -> None:
        raise NotImplementedError

    def _aliases(self) -> list[torch.Tensor]:
        return [a for r in self.members for a in r.draft.aliases.values()]

    def capture_forward(self, factory: GraphFactory, warmup: int) -> None:
        """Warm up, then capture the forward graph (and find the parameters it reaches)."""
        self._prepare_capture()
        for r in self.members:  # copied into static inputs (or unused): drop them before the
            r.draft.call.samples = []  # later captures, whose peak they would otherwise add to
        self.draft.ledger = factory.ledger
        head = self.head
        graph = factory.new_graph()
        for g in rng.graph_generators(self.device):
            graph.register_generator_state(g)
        inputs = [head.draft.static_inputs[i] for i in head.draft.in_rg]
        with factory.side_stream():
            base, peak = factory.memory_allocated(), factory.max_memory_allocated()
            self._warmup(inputs, warmup)
            warm_peak = factory.max_memory_allocated()
            before = factory.memory_allocated()
            self.draft.static_outputs = graph.capture(self._run_forward)
            captured = factory.memory_allocated() - before
        d = self.draft
        d.fwd_graph = graph
        self._account_forward(captured, warm_peak - base if warm_peak > peak else 0)
        d.out_rg = [i for i, o in enumerate(d.static_outputs) if o.requires_grad]
        d.out_nodiff = [i for i, o in enumerate(d.static_outputs) if not o.requires_grad]
        d.needs_backward = self.grad_mode and bool(d.out_rg)
        if d.needs_backward:
            self._find_params(inputs)
            d.recomputes = rng.recomputes([d.static_outputs[i] for i in d.out_rg])

    @property
    def compiled(self) -> bool:
        """Whether a member runs compiled code (``enable(compile=...)``)."""
        states = (r.module.__dict__.get("_tgraph") for r in self.members)
        return any(getattr(st, "compiled", None) is not None for st in states)

    def _warmup(self, inputs: list[torch.Tensor], warmup: int) -> None:
        """Eager passes before capture (:func:`run_warmup`); a merged stack overrides this."""
        passes = warmup_passes(warmup, self.compiled)
        run_warmup(
            self._run_forward, inputs, passes, self.device, host_scalars=self.draft.host_reads
        )

    def _account_forward(self, captured: int, warmup_peak: int) -> None:
        """Bytes of the forward's buffers (tgraph.memory); ``captured``: allocated by the
        capture (CUDA), ``warmup_peak``: the warmup's rise of the peak (0 if it did not)."""
        head, m = self.head, UnitMemory(warmup_peak=warmup_peak)
        shared = [t for t, s in zip(head.draft.static_inputs, head.draft.shared_inputs) if s]
        m.static_inputs = tensor_bytes(
            head.draft.static_inputs, skip=[t.untyped_storage().data_ptr() for t in shared]
        )
        m.static_outputs = tensor_bytes(self.draft.static_outputs)
        m.saved_activations = self.draft.fwd_graph.saved_activation_bytes(
            captured, m.static_outputs
        )
        self.draft.memory = m

    def _find_params(self, inputs: list[torch.Tensor]) -> None:
        """The parameters the forward's autograd graph reaches: module order, the last member's
        first, then leaves from outside (e.g. weights tied from another module).

        A parameter several members hold (a block called twice in a merged stack, a weight tied
        across blocks) has one leaf per member: the node hands autograd one gradient per leaf,
        which autograd adds up in the order of the node's inputs. Eager adds them in the order
        the backward reaches them, the last member's first: so that order, bitwise the same
        sum once three or more add up."""
        rg_outs = [self.draft.static_outputs[i] for i in self.draft.out_rg]
        static_in = {id(t) for t in self.head.draft.static_inputs}
        reached = [t for t in reached_leaves(rg_outs) if id(t) not in static_in]
        reached_ids = {id(t) for t in reached}
        for r in reversed(self.members):
            for p in r.module.parameters():
                alias = r.draft.aliases[id(p)]
                if id(alias) in reached_ids:
                    self.draft.leaves.append(alias)
                    self.draft.params.append(p)
        aliases = {id(a) for a in self._aliases()}
        foreign = [t for t in reached if id(t) not in aliases]
        self.draft.leaves += foreign
        self.draft.params += foreign
        self.draft.unused.setup(rg_outs, inputs, self.head.draft.in_rg, self.draft.leaves)

    def _run_backward(self) -> tuple:
        if self.draft.recomputes:
            # One draw, so that the backward graph's replays always load the generator's
            # offset (a CUDA graph whose draws add up to nothing skips that; the recompute's
            # fork_rng restores the offset it started from).
            torch.empty(1, device=self.device).uniform_()
        head = self.head
        ins = [head.draft.static_inputs[i] for i in head.draft.in_rg] + self.draft.leaves
        grads = torch.autograd.grad(
            [self.draft.static_outputs[i] for i in self.draft.out_rg],
            ins,
            grad_outputs=self.draft.static_grad_outputs,
            allow_unused=True,
        )
        n = len(head.draft.in_rg)
        rest = self.draft.fusion.apply(self.draft.leaves, self.draft.params, list(grads[n:]))
        others = [*head.draft.static_inputs, *self.draft.static_outputs]
        others += [*self.draft.static_grad_outputs, *self.draft.leaves]
        # each input gradient alone on its storage (not the grad-output buffer, which the next
        # backward rewrites and debug mode poisons; GradHandOff moves held aliases off it),
        # then each parameter gradient
        ins = own_storages(list(grads[:n]), others, whole=False)
        return (*ins, *self.draft.param_out.own(rest, [*ins, *others]))

    def capture_backward(self, factory: GraphFactory) -> None:
        """Capture ``autograd.grad(outputs, inputs + params)`` into the backward graph; its
        capture frees the forward's saved activations (tgraph.pool)."""
        head = self.head
        d = self.draft
        d.static_grad_outputs = [torch.zeros_like(d.static_outputs[i]) for i in d.out_rg]
        self.draft.flags = MainGradFlags(zip(self.draft.leaves, self.draft.params))
        graph = factory.new_graph(frees=self.draft.fwd_graph)
        for g in rng.graph_generators(self.device):  # as on CUDA, where every graph has them
            graph.register_generator_state(g)
        self.draft.flags.before_capture()
        try:
            with factory.side_stream():
                grads = graph.capture(self._run_backward)
        finally:
            self.draft.flags.after_capture()
        self.draft.bwd_graph = graph
        n_in, n_rg = len(head.draft.static_inputs), len(head.draft.in_rg)
        self.draft.static_grads = [None] * n_in
        for k, i in enumerate(head.draft.in_rg):
            self.draft.static_grads[i] = grads[k]
        self.draft.param_out.set_outputs(list(grads[n_rg:]))
        kept = self.draft.fusion.keep(list(range(len(self.draft.params))))
        where = {j: k for k, j in enumerate(kept)}
        self.draft.unused.place_leaves(n_in, [where.get(j) for j in range(len(self.draft.params))])
        m = self.draft.memory
        m.grad_outputs = tensor_bytes(self.draft.static_grad_outputs)
        m.input_grads = tensor_bytes(self.draft.static_grads)
        m.param_grads = tensor_bytes(self.draft.param_out.bufs)

    def drop_graphs(self) -> None:
        """Forget every graph and buffer (after a failed capture or on reset)."""
        self.cap, self.state = None, ReplayState()
        for r in {id(u): u for u in [self, *self.members]}.values():
            r.new_draft()

    # ----------------------------------------------------- what the graphs baked in
    def labelled_modules(self) -> list[tuple[str, torch.nn.Module]]:
        out = []
        for r in self.members:
            root = getattr(r.module.__dict__.get("_tgraph"), "name", "") or type(r.module).__name__
            out += [(f"{root}.{n}" if n else root, m) for n, m in r.module.named_modules()]
        return out

    def roots(self) -> list[torch.nn.Module]:
        return [r.module for r in self.members]

    def bake(self, internal: dict[int, list[torch.Tensor]], shared: set[int] = frozenset()) -> None:
        """After every capture of the pool: freeze the capture into :attr:`cap` with what the
        graphs baked in (:class:`tgraph.baked.Baked`) and how much of their memory tgraph
        alone uses (a re-pointed parameter's old memory may then be written; one swapped into
        another tensor may not), and set the replay state up. ``internal``: per static buffer's
        data pointer, tgraph's own tensors on it (all units'). ``shared``: ids of parameters the
        recorded iteration's backward reached through this unit and elsewhere too
        (:meth:`tgraph.layers.record.Record.reached_elsewhere`), which keep autograd's path
        under direct gradients."""
        stored = tuple(r.draft.stored for r in self.members)
        skip = {id(m): {k for m2, k, _ in st if m2 is m} for st in stored for m, _, _ in st}
        baked = Baked.of(self.labelled_modules(), self.roots(), skip=skip)
        head, outs = self.head, self.draft.static_outputs
        where = {id(r()): i for i, r in enumerate(baked.refs)}
        ins = {t.untyped_storage().data_ptr() for t in head.draft.static_inputs}
        modes = self._member_modes()  # a merged stack that draws random numbers
        cap = Captured(
            name=repr(self),
            device=self.device,
            ledger=self.draft.ledger,
            fwd_graph=self.draft.fwd_graph,
            bwd_graph=self.draft.bwd_graph,
            fwd_index=self.draft.fwd_graph.index,
            bwd_index=self.draft.bwd_graph.index if self.draft.bwd_graph is not None else NEVER,
            needs_backward=self.draft.needs_backward,
            recomputes=self.draft.recomputes,
            debug=self.debug,
            static_inputs=tuple(head.draft.static_inputs),
            shared_inputs=tuple(head.draft.shared_inputs),
            input_ptrs=tuple(t.data_ptr() for t in head.draft.static_inputs),
            input_strides=tuple(t.stride() for t in head.draft.static_inputs),
            static_outputs=tuple(outs),
            out_rg=tuple(self.draft.out_rg),
            out_nodiff=tuple(self.draft.out_nodiff),
            fresh_outputs=tuple(i for i, o in enumerate(outs) if o.dim() == 0),
            nograd_copies=tuple(
                i
                for i, o in enumerate(outs)
                if o.dim() == 0 or o.untyped_storage().data_ptr() in ins
            ),
            output_internal=tuple(
                tuple(internal.get(o.untyped_storage().data_ptr(), [o])) for o in outs
            ),
            templates=tuple(r.draft.out_template for r in self.members),
            slices=tuple(self._member_slices()),
            inner=tuple(i for i in self.draft.out_rg if i < self._member_slices()[-1].start),
            sources=tuple(tuple(src) for src in self._member_sources()),
            static_grad_outputs=tuple(self.draft.static_grad_outputs),
            static_grads=tuple(self.draft.static_grads),
            # a module's parameter is found in the modules (its slot): not held here, so one
            # replaced by load_state_dict(assign=True) is freed and the unit can re-bind
            params=tuple(p if id(p) not in where else None for p in self.draft.params),
            param_out=self.draft.param_out,
            fusion=self.draft.fusion,
            direct=DirectGrads(
                self.direct_grads,
                tuple(self.draft.fusion.keep([id(p) in shared for p in self.draft.params])),
            ),
            flags=self.draft.flags,
            unused=self.draft.unused,
            baked=baked,
            slot=tuple(where.get(id(p)) for p in self.draft.params),  # None: a foreign leaf
            own_uses=(),  # counted once no draft holds an alias (count_uses)
            memory=self.draft.memory,
            fp8=self._fp8_replay(),
            stored=stored if any(stored) else (),
            mutated_inputs=self._mutated_inputs(),
            modes=modes,
            rng_read=rng.reader(self.device) if modes is not None else None,
            foreign_host=self._foreign_host(),
            host_values=tuple(
                (i, t.item())
                for i, t in enumerate(head.draft.static_inputs)
                if self.device.type == "cuda" and t.device.type == "cpu" and t.numel() == 1
            ),
        )
        st = self.state
        st.hook_epoch = baked.hook_epoch
        route(cap, st, baked.live())
        st.grad_out_zero = [True] * len(cap.static_grad_outputs)
        track_outputs(cap, st)
        st.grads = GradHandOff(cap.param_out, st.route, cap.static_grads)
        for r in self.members:
            r.call_template = r.draft.call.template  # the shadow verifier's eager run
        self.cap, self.draft = cap, None  # the capture result holds what a replay needs
        for r in self.members:
            r.cap, r.state, r.draft = cap, st, None

    def count_uses(self, uses_before: dict[int, int]) -> None:
        """Once every unit of the pool is baked, so that no draft holds a parameter's alias any
        more: per baked tensor, how many uses of its memory are tgraph's own (a re-pointed
        parameter's old memory may be written only while nothing else uses it): those the
        capture added to ``uses_before`` (:func:`tgraph.baked.memory_uses` before it), so that
        an alias the user took earlier (a ``state_dict()``) counts as someone else's."""
        cap = self.cap
        self.cap = dataclasses.replace(cap, own_uses=own_uses(cap.baked.held, uses_before))
        for r in self.members:
            r.cap = self.cap

    def _foreign_host(self) -> tuple[tuple[torch.Tensor, Any], ...]:
        """The CPU scalars the CUDA kernels read other than the call's own arguments (a tensor
        attribute left on the CPU, a closure), with the values the graphs keep."""
        ins = self.head.draft.static_inputs
        found: dict[int, torch.Tensor] = {}
        for t in self.draft.host_reads:
            if all(t is not x for x in ins):
                found.setdefault(id(t), t)
        return tuple((t, t.item()) for t in found.values())

    def _mutated_inputs(self) -> tuple[int, ...]:
        """The head's static inputs that a member's forward writes in place (a later member
        writes the head's input when it takes that input too)."""
        found = set(self.head.draft.mutated)
        for r, src in zip(self.members[1:], self._member_sources()[1:]):
            mutated = r.draft.mutated
            found |= {k for i, (from_prev, k) in enumerate(src) if not from_prev and i in mutated}
        return tuple(sorted(found))

    def _fp8_replay(self) -> FP8Replay | None:
        """What a replay redoes of TransformerEngine's Python, when captured in its FP8 region."""
        region = next((a for a in self.head.key.autocast if isinstance(a, FP8Region)), None)
        return None if region is None else FP8Replay(region, [r.module for r in self.members])

    def _member_slices(self) -> list[slice]:
        return [slice(0, len(self.draft.static_outputs))]

    def _member_modes(self) -> Any:
        return None  # a merged stack's (tgraph.layers.segment.Segment)

    def _member_sources(self) -> list[list[tuple[bool, int]]]:
        return [[]]

    def rebind(self) -> None:
        """The modules hold new parameter objects (``load_state_dict(assign=True)``), the
        old ones are gone: a new capture result over the same graphs and memory, with the new objects
        baked in (:func:`tgraph.layers.replay.check` asked for it)."""
        cap = self.cap
        skip = {id(m): {k for m2, k, _ in st if m2 is m} for st in cap.stored for m, _, _ in st}
        baked = Baked.of(self.labelled_modules(), self.roots(), graph_memory=cap.baked, skip=skip)
        self.cap = dataclasses.replace(cap, baked=baked)
        unfollow(self.state)
        for r in self.members:
            r.cap = self.cap
