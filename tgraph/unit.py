"""A graphed unit: one forward graph and one backward graph, bridged into autograd.

Two kinds of unit exist, and they differ only in how their forward runs:

* :class:`tgraph.runner.Runner`: one graphed module called with one signature;
* :class:`tgraph.segment.Segment`: a stack of runners called back to back, as one graph pair.

Everything else lives here, once: capture (warmup, the forward graph, leaf discovery, the
backward graph), replay (the pool's replay-order guard, input copies, the flight token, the
autograd node) and the buffers' ownership.

Ownership and aliasing (what a user of the outputs must know):

* ``head.static_inputs`` are the buffers the forward graph reads. Every replay first copies the
  live inputs into them, unless the live tensor already *is* the buffer (layer i's returned
  output is layer i+1's static input, so the copy is skipped by pointer identity).
* ``static_outputs`` are written by every forward replay. The tensors a graphed call returns
  are views of them, valid until this unit's next forward replay, which cannot happen while the
  unit is in flight (awaiting its backward). Another graph that may reuse their memory replays
  only after they are moved out of the pool (:mod:`tgraph.pool`).
* ``static_grads`` (input gradients) are written by every backward replay and handed to
  autograd, which consumes them before this unit's next backward. Parameter gradients are
  packed into one flat static buffer inside the graph (:class:`tgraph.grads.ParamGradPacking`).
  On PyTorch >= 2.13 each backward hands autograd views of that static buffer itself, which
  AccumulateGrad adopts as ``.grad`` without a copy: they *are* static memory, so the pool's
  ledger (:meth:`tgraph.pool.PoolLedger.hold_grads`) moves it out from under every tensor still
  viewing it before a replay may overwrite it (this unit's next backward or forward, or a graph
  captured before it). On older PyTorch each backward hands autograd views of a fresh clone.
  ``torch.cuda.make_graphed_callables`` hands autograd ``detach()``-ed aliases of its static
  buffers too, but never moves them, so the next replay overwrites accumulated gradients
  (pytorch issue 181723). Gradient accumulation through a unit is exact either way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from tgraph import rng
from tgraph.backend import GraphFactory
from tgraph.baked import Baked, recording_outputs
from tgraph.bridge import GraphedCall
from tgraph.grads import (
    MainGradFlags,
    MainGradFusion,
    ParamGradPacking,
    UnusedOutputs,
    reached_leaves,
    swaps_storage,
)
from tgraph.guards import RefuseHostSync
from tgraph.memory import UnitMemory, tensor_bytes
from tgraph.pool import LiveOutputs, move_memory_out, storage_uses

logger = logging.getLogger(__name__)
_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
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


class Flight:
    """Marks ``runner`` in flight while this token (held by an autograd node) is alive.

    Args:
        runner: a runner or a merged stack.
        held: in flight because the outputs of a call without backward are alive, not because
            a backward is awaited.

    A captured runner's flight is also entered in its pool's :class:`tgraph.pool.PoolLedger`,
    which checks that no replay overwrites memory the runner still needs.
    """

    __slots__ = ("runner", "ledger", "__weakref__")

    def __init__(self, runner: Any, held: bool = False) -> None:
        self.runner = runner
        runner.flight = id(self)
        runner.held = held
        # a held call's outputs are guarded by tgraph.pool.LiveOutputs, not by its flight
        self.ledger = runner.ledger if runner.captured and not held else None
        if self.ledger is not None:
            self.ledger.enter(self, runner)

    def land(self) -> None:
        if self.runner.flight == id(self):
            self.runner.flight = None
            self.runner.held = False
        if self.ledger is not None:
            self.ledger.leave(self)
            self.ledger = None

    def __del__(self) -> None:  # autograd graph freed without a backward
        self.land()


def hold_while_alive(unit: Any, outputs: list[torch.Tensor]) -> None:
    """Keep ``unit`` in flight while any of ``outputs`` is alive.

    A call without backward (no_grad, frozen or parameter-free modules) has no backward to wait
    for, yet its outputs are the static buffers the next replay overwrites: ``a = enc(x1);
    b = enc(x2)`` must not make ``a`` equal ``b``. While an output lives, the next call gets
    another unit (recording) or runs eagerly with a warning (after capture). Views taken
    of an output and kept after the output itself is dropped are not tracked.
    """
    if outputs:
        flight = Flight(unit, held=True)
        for o in outputs:
            o._tgraph_flight = flight


def run_warmup(
    fn, input_leaves: list[torch.Tensor], warmup: int, device: torch.device
) -> list[torch.Tensor]:
    """Eager passes of ``fn`` (forward, plus backward where outputs need grad) before capture.

    The first pass refuses host syncs on ``device``'s tensors, so they fail here with a clear
    error instead of invalidating a CUDA capture. Returns the last pass's outputs, detached
    (leaves that require grad where the outputs did).
    """
    last: list[torch.Tensor] = []
    gens = [*rng.graph_generators(device), rng.default_generator(device)]
    for i in range(warmup):
        with RefuseHostSync(device.type, gens) if i == 0 else contextlib.nullcontext():
            outs = fn()
        rg = [o for o in outs if o.requires_grad]
        if rg:
            ins = list(input_leaves)
            ins += [p for p in reached_leaves(rg) if all(p is not x for x in ins)]
            torch.autograd.grad(rg, ins, [torch.ones_like(o) for o in rg], allow_unused=True)
        last = [o.detach().requires_grad_(o.requires_grad) for o in outs]
        del outs, rg
    return last


BUSY = (
    "every graph captured for this signature is awaiting its backward "
    "(more calls in flight than in the recorded iteration)"
)


class GraphedUnit:
    """State and mechanics shared by runners and merged stacks (module docstring).

    Subclasses set ``head`` (the runner whose static inputs the forward graph reads),
    ``members`` (the runners whose modules run in the forward) and implement
    :meth:`_run_forward` and :meth:`_prepare_capture`.
    """

    head: Any
    members: list

    def _init_unit(self, device: torch.device, grad_mode: bool, fusion: bool) -> None:
        self.device = device
        self.grad_mode = grad_mode
        self.flight: int | None = None
        self.held = False  # in flight only because a no-grad call's outputs are alive
        self.ledger = None  # the pool's replay-order guard, once captured (tgraph.pool)
        self.debug = False
        self.fusion = MainGradFusion(fusion)
        self._drop_capture()

    def _drop_capture(self) -> None:
        self.fwd_graph = None
        self.bwd_graph = None
        self.static_outputs: list[torch.Tensor] = []
        self.static_grads: list[torch.Tensor | None] = []
        self.static_grad_outputs: list[torch.Tensor] = []
        self.params: list[torch.Tensor] = []  # parameters the backward differentiates
        self.autograd_params: list[torch.Tensor] = []  # params minus those fused into main_grad
        self.needs_backward = False
        self.unused = UnusedOutputs()
        self.memory = UnitMemory()
        self.packing = ParamGradPacking()
        self.fusion = MainGradFusion(self.fusion.enabled)
        self._out_rg: list[int] = []
        self._out_nodiff: list[int] = []
        self._leaves: list[torch.Tensor] = []  # what the backward differentiates (aliases)
        self._param_grads: list[torch.Tensor | None] = []
        self._flags: MainGradFlags | None = None
        self._grad_out_zero: list[bool] = []
        self.recomputes = False  # the forward checkpoints (torch.utils.checkpoint): see RngRewind
        self._rng_at_forward: list[torch.Tensor] | None = None
        self.baked: Baked | None = None  # what the graphs baked in (tgraph.baked)
        self._others_use: list[int] = []  # per baked tensor: uses of its memory by tgraph alone
        self._copy_in: list[int] = []  # baked tensors followed by a copy into the graph's memory
        self._live: tuple[torch.Tensor, ...] = ()
        self._slot: list[int | None] = []  # per parameter of the backward: its baked index
        self._rerouted = False
        self._hook_epoch = -1  # torch's hook counter when the hooks were last found unchanged
        self._aliasing_outputs: list[int] = []  # outputs that are (views of) static inputs
        self._output_uses: list[int] = []  # uses of each static output's memory by tgraph
        self._output_internal: list[list[torch.Tensor]] = []  # tgraph's tensors on each
        self._last_outputs: weakref.ref | None = None  # LiveOutputs of the latest replay

    # ----------------------------------------------------------------- capture
    @property
    def captured(self) -> bool:
        return self.fwd_graph is not None and (
            self.bwd_graph is not None or not self.needs_backward
        )

    def _run_forward(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def _prepare_capture(self) -> None:
        raise NotImplementedError

    def _aliases(self) -> list[torch.Tensor]:
        return [a for r in self.members for a in r.aliases.values()]

    def capture_forward(self, factory: GraphFactory, warmup: int) -> None:
        """Warm up, then capture the forward graph (and find the parameters it reaches)."""
        self._prepare_capture()
        for r in self.members:  # copied into static inputs (or unused): drop them before the
            r.samples = []  # later captures, whose peak they would otherwise add to
        self.ledger = factory.ledger
        head = self.head
        graph = factory.new_graph()
        for g in rng.graph_generators(self.device):
            graph.register_generator_state(g)
        inputs = [head.static_inputs[i] for i in head.in_rg]
        with factory.side_stream():
            base, peak = factory.memory_allocated(), factory.max_memory_allocated()
            self._warmup(inputs, warmup)
            warm_peak = factory.max_memory_allocated()
            before = factory.memory_allocated()
            self.static_outputs = graph.capture(self._run_forward)
            captured = factory.memory_allocated() - before
        self.fwd_graph = graph
        self._account_forward(captured, warm_peak - base if warm_peak > peak else 0)
        self._out_rg = [i for i, o in enumerate(self.static_outputs) if o.requires_grad]
        self._out_nodiff = [i for i, o in enumerate(self.static_outputs) if not o.requires_grad]
        self.needs_backward = self.grad_mode and bool(self._out_rg)
        if self.needs_backward:
            self._find_params(inputs)
            self.recomputes = rng.recomputes([self.static_outputs[i] for i in self._out_rg])

    def _warmup(self, inputs: list[torch.Tensor], warmup: int) -> None:
        """Eager passes before capture (:func:`run_warmup`); a merged stack overrides this."""
        run_warmup(self._run_forward, inputs, warmup, self.device)

    def _account_forward(self, captured: int, warmup_peak: int) -> None:
        """Bytes of the forward's buffers (tgraph.memory); ``captured``: allocated by the
        capture (CUDA), ``warmup_peak``: the warmup's rise of the peak (0 if it did not)."""
        head, m = self.head, UnitMemory(warmup_peak=warmup_peak)
        shared = [t for t, s in zip(head.static_inputs, head.shared_inputs) if s]
        m.static_inputs = tensor_bytes(
            head.static_inputs, skip=[t.untyped_storage().data_ptr() for t in shared]
        )
        m.static_outputs = tensor_bytes(self.static_outputs)
        m.saved_activations = self.fwd_graph.saved_activation_bytes(captured, m.static_outputs)
        self.memory = m

    def _find_params(self, inputs: list[torch.Tensor]) -> None:
        """The parameters the forward's autograd graph reaches: module order, then leaves
        from outside (e.g. weights tied from another module)."""
        rg_outs = [self.static_outputs[i] for i in self._out_rg]
        static_in = {id(t) for t in self.head.static_inputs}
        reached = [t for t in reached_leaves(rg_outs) if id(t) not in static_in]
        reached_ids = {id(t) for t in reached}
        for r in self.members:
            for p in r.module.parameters():
                alias = r.aliases[id(p)]
                if id(alias) in reached_ids:
                    self._leaves.append(alias)
                    self.params.append(p)
        aliases = {id(a) for a in self._aliases()}
        foreign = [t for t in reached if id(t) not in aliases]
        self._leaves += foreign
        self.params += foreign
        self.unused.setup(rg_outs, inputs, self.head.in_rg, self._leaves)

    def _run_backward(self) -> tuple:
        if self.recomputes:
            # One draw, so that the backward graph's replays always load the generator's
            # offset (a CUDA graph whose draws add up to nothing skips that; the recompute's
            # fork_rng restores the offset it started from).
            torch.empty(1, device=self.device).uniform_()
        head = self.head
        ins = [head.static_inputs[i] for i in head.in_rg] + self._leaves
        grads = torch.autograd.grad(
            [self.static_outputs[i] for i in self._out_rg],
            ins,
            grad_outputs=self.static_grad_outputs,
            allow_unused=True,
        )
        n = len(head.in_rg)
        rest = self.fusion.apply(self._leaves, self.params, list(grads[n:]))
        return (*grads[:n], *self.packing.pack(rest))

    def capture_backward(self, factory: GraphFactory) -> None:
        """Capture ``autograd.grad(outputs, inputs + params)`` into the backward graph; its
        capture frees the forward's saved activations (tgraph.pool)."""
        head = self.head
        self.static_grad_outputs = [torch.zeros_like(self.static_outputs[i]) for i in self._out_rg]
        self._grad_out_zero = [True] * len(self.static_grad_outputs)
        self._flags = MainGradFlags(zip(self._leaves, self.params))
        graph = factory.new_graph(frees=self.fwd_graph)
        for g in rng.graph_generators(self.device):  # as on CUDA, where every graph has them
            graph.register_generator_state(g)
        self._flags.before_capture()
        try:
            with factory.side_stream():
                grads = graph.capture(self._run_backward)
        finally:
            self._flags.after_capture()
        self.bwd_graph = graph
        n_in, n_rg = len(head.static_inputs), len(head.in_rg)
        self.static_grads = [None] * n_in
        for k, i in enumerate(head.in_rg):
            self.static_grads[i] = grads[k]
        if self.packing.packed:
            self.packing.set_flat(grads[n_rg])
        else:
            self._param_grads = list(grads[n_rg:])
        self.autograd_params = self._autograd_params()
        kept = self.fusion.keep(list(range(len(self.params))))
        where = {j: k for k, j in enumerate(kept)}
        self.unused.place_leaves(n_in, [where.get(j) for j in range(len(self.params))])
        m = self.memory
        m.grad_outputs = tensor_bytes(self.static_grad_outputs)
        m.input_grads = tensor_bytes(self.static_grads)
        held = [self.packing.flat] if self.packing.packed else self._param_grads
        m.param_grads = tensor_bytes(held)
        copied = not (self.packing.packed and swaps_storage())  # see ParamGradPacking
        m.param_grad_copy = m.param_grads if copied and self.autograd_params else 0

    def _autograd_params(self) -> list[torch.Tensor]:
        """The parameters the autograd node takes: all but those fused into ``main_grad``.

        When fusion leaves the node no input that requires grad, a zero-dim anchor leaf takes
        their place: without one, the node's outputs would not require grad and its backward
        (which adds the fused gradients) would never run.
        """
        kept = self.fusion.keep(self.params)
        if self.params and not kept and not self.head.in_rg:
            return [torch.zeros((), device=self.device, requires_grad=True)]
        return kept

    def drop_graphs(self) -> None:
        """Forget every graph and buffer (after a failed capture or on reset)."""
        self._drop_capture()
        self.ledger, self.held = None, False
        for r in self.members:
            r.drop_capture_state()

    # ----------------------------------------------------- what the graphs baked in
    def labelled_modules(self) -> list[tuple[str, torch.nn.Module]]:
        out = []
        for r in self.members:
            root = type(r.module).__name__
            out += [(f"{root}.{n}" if n else root, m) for n, m in r.module.named_modules()]
        return out

    def roots(self) -> list[torch.nn.Module]:
        return [r.module for r in self.members]

    def bake(self, internal: dict[int, list[torch.Tensor]]) -> None:
        """After every capture of the pool: record what the graphs baked in, and how much of
        their memory tgraph alone uses (a re-pointed parameter's old memory may then be
        written; one swapped into another tensor may not). ``internal``: per static buffer's
        data pointer, tgraph's own tensors on it (all units')."""
        self.baked = Baked.of(self.labelled_modules(), self.roots())
        self._hook_epoch = self.baked.hook_epoch
        self._others_use = [storage_uses(t) - 1 for t in self.baked.held]
        where = {id(r()): i for i, r in enumerate(self.baked.refs)}
        self._slot = [where.get(id(p)) for p in self.params]  # None: a foreign leaf
        self._rerouted = False
        self._output_uses = [storage_uses(t) for t in self.static_outputs]
        self._output_internal = [
            internal.get(o.untyped_storage().data_ptr(), [o]) for o in self.static_outputs
        ]
        ins = {t.untyped_storage().data_ptr() for t in self.head.static_inputs}
        self._aliasing_outputs = [
            i for i, o in enumerate(self.static_outputs) if o.untyped_storage().data_ptr() in ins
        ]

    def check_baked(self) -> str | None:
        """Before a replay: follow what can be followed (re-pointed or replaced parameters,
        by a copy into the memory the graph reads); the reason to run eagerly otherwise."""
        b = self.baked
        if b is None:
            return None
        epoch = RemovableHandle.next_id  # moves whenever a hook is registered anywhere
        if epoch != self._hook_epoch or b.any_hooks:
            why = b.changed_hooks(scan=True)
            if why is not None:
                return why
            self._hook_epoch = epoch  # scanned: unchanged as of this epoch
        why = b.changed_attrs()
        if why is not None:
            return why
        recording = recording_outputs()
        if recording is not None:
            return (
                f"transformers is recording {recording} through hooks inside the layer "
                "(output_attentions / output_router_logits), which a graph does not run"
            )
        if self.needs_backward and _saved_tensors_hooks(False) is not None:
            return (
                "torch.autograd.graph.saved_tensors_hooks are active, and a graph's backward "
                "reads its saved activations without them"
            )
        live = b.live()
        if live is None:
            return b.replaced_tensors()  # names the removed parameter or buffer
        if self._rerouted or b.replaced_tensors(live) is not None:
            self._route(live)  # gradients go to the tensors the modules hold now
            if b.replaced_tensors(live) is not None:
                kept = [
                    n for n, r, t in zip(b.names, b.refs, live) if r() is not None and r() is not t
                ]
                if kept:
                    return (
                        f"{kept[0]} was replaced after capture while the captured tensor is still "
                        "alive (torch.func.functional_call substitutes weights for one call; "
                        "after load_state_dict(assign=True), the previous step's autograd graph "
                        "holds the old parameters until it is freed)"
                    )
                self.baked = b = Baked.of(self.labelled_modules(), self.roots(), graph_memory=b)
                self._copy_in, self._rerouted = [], False
                for r in self.members:  # the call key reads their requires_grad
                    r.module._tgraph.params = tuple(r.module.parameters())
        moved = b.moved(live)
        if moved != self._copy_in:
            for i in moved:
                if storage_uses(b.held[i]) > self._others_use[i]:
                    return (
                        f"{b.names[i]} lives in other memory than at capture (p.data = ...), "
                        "and the memory the graph reads is in use elsewhere (swapped into another "
                        "tensor, e.g. for an EMA evaluation)"
                    )
            why = b.incompatible(live)
            if why is not None:
                return why
            if moved:
                logger.info(
                    "tgraph: %s: following %s, re-pointed after capture, by a copy into the "
                    "graph's memory at each call (tgraph.reset() and create_graphs() graph it "
                    "without the copy)",
                    self,
                    ", ".join(b.names[i] for i in moved),
                )
            self._copy_in = moved
        if self._copy_in:
            with torch.no_grad():
                for i in self._copy_in:
                    b.held[i].copy_(live[i])
            self._live = live
        return None

    def _route(self, live: tuple[torch.Tensor, ...]) -> None:
        """Hand the parameters' gradients to ``live`` (the module's current tensors)."""
        self.params = [p if k is None else live[k] for p, k in zip(self.params, self._slot)]
        self.autograd_params = self._autograd_params()
        self._rerouted = any(r() is not t for r, t in zip(self.baked.refs, live))

    def _move_out_held_outputs(self) -> str | None:
        """Before the forward replays again: outputs of its last replay that the caller still
        holds (a ``.detach()`` or a view kept across steps) get their own memory."""
        for i, o in enumerate(self.static_outputs):
            if storage_uses(o) > self._output_uses[i]:
                token = self._last_outputs() if self._last_outputs is not None else None
                if token is not None:  # the returned tensors themselves: re-pointed, one copy
                    token.rescue()
                    self._last_outputs = None
                if storage_uses(o) <= self._output_uses[i]:
                    continue
                if not swaps_storage():
                    return (
                        "an output of its previous call (or a view or .detach() of it) is still "
                        "held, and this PyTorch cannot move it out of the graph's memory "
                        "(UntypedStorage._swap_data_ptr_, PyTorch >= 2.13); clone outputs you keep"
                    )
                move_memory_out(o, self._output_internal[i])
                self._output_uses[i] = storage_uses(o)
        return None

    # ------------------------------------------------------------------ replay
    def replay(self, tensors: list[torch.Tensor]) -> list[torch.Tensor] | str:
        """Replay the forward on live ``tensors``: the static outputs' views, or the reason
        the call must run eagerly instead."""
        why = self.check_baked() or self._move_out_held_outputs()
        if why is not None:
            return why
        unsafe = self.ledger.unsafe_forward(self)
        if unsafe is not None:
            return unsafe
        if not self._copy_inputs(tensors):
            return (
                "an input captured as another graphed module's output buffer arrived as a "
                "different tensor"
            )
        if not self.needs_backward:
            self.fwd_graph.replay()
            outs = [o.detach() for o in self.static_outputs]
            for i in self._aliasing_outputs:  # the static input buffer: the next call's copy
                outs[i] = outs[i].clone()  # would overwrite it under the caller
            hold_while_alive(self, outs)
        else:
            flight = Flight(self)
            if self.recomputes:
                self._rng_at_forward = rng.default_generator(self.device).get_state()
            outs = list(GraphedCall.apply(self, flight, *tensors, *self.autograd_params))
        if self._copy_in:
            with torch.no_grad():  # a buffer the forward updates (running statistics)
                for i in self._copy_in:
                    if self.baked.is_buffer[i]:
                        self._live[i].copy_(self.baked.held[i])
        token = LiveOutputs(self.ledger, self, outs)  # no other graph overwrites them
        self._last_outputs = weakref.ref(token)  # (tgraph.pool) nor this unit's next replay
        return outs

    def replay_backward(self) -> None:
        """Replay the backward graph; a recomputing unit's replays from the generator offset
        its forward replay started from.

        ``torch.utils.checkpoint`` saves the RNG state before the checkpointed forward and
        restores it before the recompute. Inside graphs that state is a position *within* the
        forward graph (CUDA), and the recompute inside the backward graph positions that graph's
        draws relative to the offset the backward graph replays from. Replaying the backward
        from the forward replay's offset (then putting the generator back where it was) makes
        the recompute draw the forward's numbers: the same dropout masks as eager checkpointing.
        """
        if not self.recomputes or self._rng_at_forward is None:
            self.bwd_graph.replay()
            return
        now = rng.default_generator(self.device).get_state()
        rng.default_generator(self.device).set_state(self._rng_at_forward)
        try:
            self.bwd_graph.replay()
        finally:
            rng.default_generator(self.device).set_state(now)
            self._rng_at_forward = None

    def _copy_inputs(self, tensors: list[torch.Tensor]) -> bool:
        """Copy live inputs into the head's static buffers; False if a shared buffer (another
        unit's static output) would be overwritten."""
        head = self.head
        for buf, shared, x in zip(head.static_inputs, head.shared_inputs, tensors):
            if x.data_ptr() == buf.data_ptr() and x.stride() == buf.stride():
                continue  # already the buffer: layer i's output is layer i+1's input
            if shared:
                return False  # the buffer is another runner's output; writing it would corrupt it
            buf.detach().copy_(x)
        return True

    def grads_for_autograd(
        self, active: tuple[bool, ...] | None = None
    ) -> list[torch.Tensor | None]:
        """Input gradients (static) + parameter gradients (views of the packed buffer, which
        the pool's ledger protects, or of a copy of it; see ParamGradPacking).

        ``active``: per differentiable output, whether autograd gave it a gradient; inputs and
        parameters that only inactive outputs reach get None (:class:`UnusedOutputs`).
        """
        clone = not swaps_storage()  # see ParamGradPacking
        kept = self.fusion.keep(self.packing.for_autograd(self._param_grads, clone))
        if not kept and self.autograd_params:  # the anchor leaf (see _autograd_params)
            kept = [None]
        grads = [*self.static_grads, *kept]
        if not clone and self.packing.packed:
            self.ledger.hold_grads(self)  # rescued before the buffer may be overwritten
        if active is not None and not all(active):
            for pos in self.unused.none_positions(active):
                grads[pos] = None
        return grads

    def copy_grad_outputs(self, grads) -> None:
        """Refresh the static grad-output buffers; a None gradient means zeros.

        A buffer already known to hold zeros is not zeroed again (outputs whose gradient is
        always None, e.g. the inner outputs of a merged stack, cost no kernel per step).
        """
        for k, (buf, i) in enumerate(zip(self.static_grad_outputs, self._out_rg)):
            g = grads[i]
            if g is None:
                if not self._grad_out_zero[k]:
                    buf.zero_()
                    self._grad_out_zero[k] = True
            else:
                if g.data_ptr() != buf.data_ptr():
                    buf.copy_(g)
                self._grad_out_zero[k] = False

    def after_backward(self) -> None:
        self._flags.after_replay()
        if self.debug:  # stale reads show up as NaN instead of plausible numbers
            head = self.head
            for buf, shared in zip(head.static_inputs, head.shared_inputs):
                if not shared:
                    _poison(buf.detach())
            for buf in self.static_grad_outputs:
                _poison(buf)
            self._grad_out_zero = [False] * len(self.static_grad_outputs)


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(math.nan)
