"""A runner: one graphed module called with one signature, and its two graphs.

Ownership and aliasing (what a user of the outputs must know):

* ``static_inputs`` are the buffers the forward graph reads. Every replay first copies the live
  inputs into them, unless the live tensor already *is* the buffer (layer i's returned output is
  layer i+1's static input, so the copy is skipped by pointer identity).
* ``static_outputs`` are written by every forward replay. The tensors a graphed call returns are
  views of them: valid until this runner's next forward replay, which cannot happen while the
  runner is in flight (awaiting its backward). Clone an output you keep across steps.
* ``static_grads`` (input gradients) are written by every backward replay and handed to
  autograd, which consumes them before this runner's next backward. Parameter gradients are
  packed into one flat static buffer inside the graph; each backward hands autograd views of a
  fresh clone of it (:class:`tgraph.grads.ParamGradPacking`), never the static memory itself.
  ``torch.cuda.make_graphed_callables`` hands autograd ``detach()``-ed aliases of its static
  buffers, which AccumulateGrad adopts as ``.grad``, so the next replay overwrites accumulated
  gradients (pytorch issue 181723). Gradient accumulation through a runner is exact.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any

import torch

from tgraph import rng
from tgraph.backend import GraphFactory, RefuseHostSync
from tgraph.grads import MainGradFlags, MainGradFusion, ParamGradPacking
from tgraph.record import graphed_region
from tgraph.signature import rebuild


def reached_leaves(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that ``outputs``' autograd graph reaches (AccumulateGrad)."""
    # Python wrappers of autograd nodes live only while referenced and their ids are recycled:
    # keep every visited wrapper alive, so the same node keeps its wrapper and id-dedup holds.
    seen: dict[int, object] = {}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    leaves: list[torch.Tensor] = []
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        var = getattr(fn, "variable", None)
        if var is not None:
            leaves.append(var)
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return leaves


def output_reach(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], leaves: list[torch.Tensor]
) -> list[tuple[frozenset[int], frozenset[int]]]:
    """Per output: (indices into ``inputs``, indices into ``leaves``) that it reaches.

    A gradient flows to an input or parameter only through outputs that reach it; autograd
    gives it none (``None``, not zeros) when no output the loss used reaches it.
    """
    in_pos = {id(t): i for i, t in enumerate(inputs)}
    leaf_pos = {id(t): j for j, t in enumerate(leaves)}
    found = []
    for o in outputs:
        ids = {id(t) for t in reached_leaves([o])}
        found.append(
            (
                frozenset(i for k, i in in_pos.items() if k in ids),
                frozenset(j for k, j in leaf_pos.items() if k in ids),
            )
        )
    return found


class UnusedOutputs:
    """Which gradients to hand autograd as None when the loss ignored some outputs.

    Autograd gives the bridge ``None`` for an output the loss did not use (materialized zeros
    are turned off). The backward graph still runs with a zero gradient for it, and every input
    or parameter reached *only* through such outputs gets None, as in eager: a zero gradient is
    not the same thing to an optimizer (AdamW's momentum and weight decay would still move it).
    """

    def __init__(self) -> None:
        self.reach: list[tuple[frozenset[int], frozenset[int]]] = []
        self.input_index: list[int] = []  # position of each differentiable input in the result
        self.leaf_index: list[int | None] = []  # position of each leaf's gradient, None if fused
        self._cache: dict[tuple[bool, ...], list[int]] = {}

    def setup(self, outputs, inputs, in_rg, leaves) -> None:
        self.reach = output_reach(outputs, inputs, leaves)
        self.input_index = list(in_rg)
        self._cache = {}

    def place_leaves(self, n_inputs: int, kept: list[int | None]) -> None:
        """``kept[j]``: index of leaf j among the parameters handed to autograd (None: fused)."""
        self.leaf_index = [None if k is None else n_inputs + k for k in kept]

    def none_positions(self, active: tuple[bool, ...]) -> list[int]:
        """Positions of the gradients no active output reaches."""
        found = self._cache.get(active)
        if found is None:
            ins = set().union(*(r[0] for r, a in zip(self.reach, active) if a))
            leaves = set().union(*(r[1] for r, a in zip(self.reach, active) if a))
            found = [p for k, p in enumerate(self.input_index) if k not in ins]
            found += [p for j, p in enumerate(self.leaf_index) if p is not None and j not in leaves]
            self._cache[active] = found
        return found


def split_grads(grads, n_inputs: int, in_rg: list[int], packing: ParamGradPacking):
    """Captured backward outputs -> (per-input static grads, unpacked static param grads)."""
    n = len(in_rg)
    input_grads: list[torch.Tensor | None] = [None] * n_inputs
    for k, i in enumerate(in_rg):
        input_grads[i] = grads[k]
    if packing.packed:
        packing.flat = grads[n]
        return input_grads, []
    return input_grads, list(grads[n:])


def autograd_params(fusion, params, in_rg, device) -> list[torch.Tensor]:
    """The parameters a graph's autograd node takes: all but those fused into ``main_grad``.

    When fusion leaves the node no input that requires grad, a zero-dim anchor leaf takes their
    place: without one, the node's outputs would not require grad and its backward (which adds
    the fused gradients) would never run.
    """
    kept = fusion.keep(params)
    if params and not kept and not in_rg:
        return [torch.zeros((), device=device, requires_grad=True)]
    return kept


def run_warmup(fn, input_leaves: list[torch.Tensor], warmup: int, device: torch.device) -> None:
    """Eager passes of ``fn`` (forward, plus backward where outputs need grad) before capture.

    The first pass refuses host syncs on ``device``'s tensors, so they fail here with a clear
    error instead of invalidating a CUDA capture.
    """
    for i in range(warmup):
        with RefuseHostSync(device.type) if i == 0 else contextlib.nullcontext():
            outs = fn()
        rg = [o for o in outs if o.requires_grad]
        if rg:
            ins = list(input_leaves)
            ins += [p for p in reached_leaves(rg) if all(p is not x for x in ins)]
            torch.autograd.grad(rg, ins, [torch.ones_like(o) for o in rg], allow_unused=True)
        del outs, rg


def capture_forward_graph(
    factory: GraphFactory,
    device: torch.device,
    watch,
    fn,
    input_leaves,
    warmup: int,
    modules: list[torch.nn.Module],
    static_inputs: list[torch.Tensor],
):
    """Warm ``fn`` up, then capture it on the capture stream. Returns (graph, outputs)."""
    graph = factory.new_graph(watch=watch, freeze=modules, external=static_inputs)
    for g in rng.graph_generators(device):
        graph.register_generator_state(g)
    with factory.side_stream():
        run_warmup(fn, input_leaves, warmup, device)
        outputs = graph.capture(fn)
    return graph, outputs


def capture_backward_graph(factory: GraphFactory, watch, fn, flags: MainGradFlags, fwd_graph):
    """Capture the backward ``fn``, noting which ``main_grad`` flags it sets. (graph, grads).

    ``fwd_graph``'s saved activations are freed by this capture (tgraph.pool).
    """
    graph = factory.new_graph(watch=watch, frees=fwd_graph)
    flags.before_capture()
    try:
        with factory.side_stream():
            grads = graph.capture(fn)
    finally:
        flags.after_capture()
    return graph, grads


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(math.nan)


class Runner:
    """Graphs of ``module`` for calls with key ``key`` (see :mod:`tgraph.signature`).

    Args:
        module: the graphed module.
        key: call key from :func:`tgraph.signature.call_key`.
        args, kwargs: the first call's arguments (their tensors are cloned as capture samples).
        tensors: the first call's tensors, in the order of ``key``.
        links: per tensor, ``(producer runner, output index)`` when that tensor was a recorded
            output of another graphed call (its static output becomes this static input).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        key: tuple,
        args: tuple,
        kwargs: dict,
        tensors: list[torch.Tensor],
        links: list[tuple[Runner, int] | None],
    ) -> None:
        self.module = module
        self.key = key
        self.flight: int | None = None
        self.links = links
        # per tensor, the earlier recorded calls that took the very same tensor (tgraph.segment)
        self.shared_with: list[list[tuple[Runner, int]]] = [[] for _ in tensors]
        self._args, self._kwargs = _strip(args), _strip(kwargs)
        self.device = tensors[0].device if tensors else next(module.parameters()).device
        self.samples = [t.detach().clone() for t in tensors]
        self._requires_grad = [t.requires_grad for t in tensors]
        self.grad_mode = key.grad
        self.ledger = None  # the pool's replay-order guard, once captured (tgraph.pool)
        self.held = False  # in flight only because a no-grad call's outputs are alive
        self.unused = UnusedOutputs()
        self.fwd_graph = None
        self.bwd_graph = None
        self.static_inputs: list[torch.Tensor] = []
        self.static_outputs: list[torch.Tensor] = []
        self.out_template: Any = None
        self.params: list[torch.Tensor] = []
        self.autograd_params: list[torch.Tensor] = []  # params minus those fused into main_grad
        self.static_grads: list[torch.Tensor | None] = []
        self.static_grad_outputs: list[torch.Tensor] = []
        self.needs_backward = False
        self.debug = False
        self._out_rg: list[int] = []
        self._in_rg: list[int] = []
        self._out_nodiff: list[int] = []
        self._flags: MainGradFlags | None = None
        self._grad_out_zero: list[bool] = []
        self.merge = True  # may be captured together with its neighbours (tgraph.segment)
        self.segment = None  # the Segment this runner belongs to, if merged
        self.seg_index = 0
        self._aliases: dict[int, torch.Tensor] = {}  # id(param) -> alias leaf used in graphs
        self._leaves: list[torch.Tensor] = []  # what the backward differentiates (aliases)
        self.packing = ParamGradPacking()
        self.fusion = MainGradFusion()
        self._param_grads: list[torch.Tensor | None] = []

    # ----------------------------------------------------------------- capture
    @property
    def captured(self) -> bool:
        return self.fwd_graph is not None and (
            self.bwd_graph is not None or not self.needs_backward
        )

    def _static_input(self, i: int, sample: torch.Tensor) -> torch.Tensor:
        link = self.links[i]
        producer = link[0] if link is not None else None
        # Share the producer's static output only if the producer has a backward: then it
        # stays in flight (cannot replay again) until after this runner's backward, which may
        # read this buffer as a saved activation.
        shared = (
            producer is not None
            and bool(producer.static_outputs)
            and (producer.segment or producer).needs_backward
        )
        self._shared_inputs.append(shared)
        if shared:  # the producer's static output is this static input: no copy at replay
            buf = producer.static_outputs[link[1]].detach()
        else:
            buf = torch.empty_like(sample)
            with torch.no_grad():
                buf.copy_(sample)  # realistic values for warmup (indices must be valid)
        return buf.requires_grad_(self._requires_grad[i])

    def _make_aliases(self) -> None:
        """One alias leaf per parameter: same storage, its own autograd identity.

        Graphs differentiate with respect to aliases, not the parameters themselves. A
        parameter's AccumulateGrad node, kept alive by any earlier autograd graph (e.g. the
        recorded iteration's ``loss``), remembers the eager stream it was created on, and the
        autograd engine's end-of-backward sync with that stream invalidates a capture
        (cudaErrorStreamCaptureImplicit). Aliases get fresh nodes on the capture stream. Their
        Python attributes start as copies of the parameter's (``main_grad`` is shared).
        """
        self._aliases = {}
        for p in self.module.parameters():
            alias = p.detach().requires_grad_(p.requires_grad)
            alias.__dict__.update(vars(p))
            self._aliases[id(p)] = alias

    @contextlib.contextmanager
    def _parameters_aliased(self):
        swapped = []
        for mod in self.module.modules():
            for name, p in mod._parameters.items():
                if p is not None and id(p) in self._aliases:
                    swapped.append((mod, name, p))
                    mod._parameters[name] = self._aliases[id(p)]
        try:
            yield
        finally:
            for mod, name, p in swapped:
                mod._parameters[name] = p

    def _run_forward(self) -> list[torch.Tensor]:
        args = rebuild(self._args, iter(self.static_inputs))
        kwargs = rebuild(self._kwargs, iter(self.static_inputs[self._n_args_tensors :]))
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_mode))
            stack.enter_context(_training_flags(self.module, self.key.training))
            for device_type, dtype in self.key.autocast:  # capture under the recorded autocast
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
            stack.enter_context(self._parameters_aliased())
            stack.enter_context(graphed_region())  # nested GraphableModules are part of this graph
            out = torch.nn.Module.__call__(self.module, *args, **kwargs)
        if self.fwd_graph is None:  # warmup and capture; replays keep the capture's template
            self.out_template = _strip(out)
        tensors: list[torch.Tensor] = []
        rebuild_out = _collect(out, tensors)
        if not rebuild_out:
            raise TypeError(
                f"{type(self.module).__name__}.forward must return tensors (or tuples, lists or "
                f"dicts of tensors) to be graphed; got {type(out).__name__}"
            )
        return tensors

    def _run_backward(self) -> tuple:
        graph_outs = self.fwd_graph.live_outputs or self.static_outputs
        outs = [graph_outs[i] for i in self._out_rg]
        ins = [self.static_inputs[i] for i in self._in_rg] + self._leaves
        grads = torch.autograd.grad(
            outs,
            ins,
            grad_outputs=self.static_grad_outputs,
            retain_graph=self.fwd_graph.retains_autograd_graph,
            allow_unused=True,
        )
        n = len(self._in_rg)
        rest = self.fusion.apply(self._leaves, self.params, list(grads[n:]))
        return (*grads[:n], *self.packing.pack(rest))

    def prepare_capture(self, static_inputs: bool = True) -> None:
        """Static input buffers (unless a segment feeds them) and parameter aliases."""
        self._n_args_tensors = _count_tensors(self._args)
        if static_inputs:
            self._shared_inputs: list[bool] = []
            self.static_inputs = [self._static_input(i, s) for i, s in enumerate(self.samples)]
            self._in_rg = [i for i, t in enumerate(self.static_inputs) if t.requires_grad]
        self._make_aliases()

    def out_template_tensors(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = []
        _collect(self.out_template, found)
        return found

    def capture_forward(self, factory: GraphFactory, warmup: int) -> None:
        """Warm up, then capture the forward graph (and find the parameters it reaches)."""
        self.prepare_capture()
        self.ledger = factory.ledger
        inputs = [self.static_inputs[i] for i in self._in_rg]
        self.fwd_graph, self.static_outputs = capture_forward_graph(
            factory,
            self.device,
            self._aliases.values(),
            self._run_forward,
            inputs,
            warmup,
            list(self.module.modules()),
            self.static_inputs,
        )
        self._out_rg = [i for i, o in enumerate(self.static_outputs) if o.requires_grad]
        self._out_nodiff = [i for i, o in enumerate(self.static_outputs) if not o.requires_grad]
        self.needs_backward = self.grad_mode and bool(self._out_rg)
        if not self.needs_backward:
            self.samples = []
        if self.needs_backward:
            static_in = self.static_inputs
            reached = [
                p
                for p in reached_leaves([self.static_outputs[i] for i in self._out_rg])
                if all(p is not x for x in static_in)
            ]
            reached_ids = {id(r) for r in reached}
            own = [p for p in self.module.parameters() if id(self._aliases[id(p)]) in reached_ids]
            alias_ids = {id(a) for a in self._aliases.values()}
            foreign = [
                r for r in reached if id(r) not in alias_ids
            ]  # e.g. weights tied from outside
            self.params = own + foreign
            self._leaves = [self._aliases[id(p)] for p in own] + foreign
            self.unused.setup(
                [self.static_outputs[i] for i in self._out_rg],
                [self.static_inputs[i] for i in self._in_rg],
                [i for i in self._in_rg],
                self._leaves,
            )

    def capture_backward(self, factory: GraphFactory) -> None:
        """Capture ``autograd.grad(outputs, inputs + params)`` into the backward graph."""
        self.static_grad_outputs = [torch.zeros_like(self.static_outputs[i]) for i in self._out_rg]
        self._grad_out_zero = [True] * len(self.static_grad_outputs)
        self._flags = MainGradFlags(zip(self._leaves, self.params))
        self.bwd_graph, grads = capture_backward_graph(
            factory, self._aliases.values(), self._run_backward, self._flags, self.fwd_graph
        )
        self.static_grads, self._param_grads = split_grads(
            grads, len(self.static_inputs), self._in_rg, self.packing
        )
        self.autograd_params = autograd_params(self.fusion, self.params, self._in_rg, self.device)
        self.unused.place_leaves(len(self.static_inputs), kept_positions(self.fusion, self.params))
        self.samples = []

    def drop_graphs(self) -> None:
        """Forget every graph and buffer (after a failed capture or on reset)."""
        self.fwd_graph = self.bwd_graph = None
        self.static_inputs, self.static_outputs, self.static_grads = [], [], []
        self.static_grad_outputs, self.params, self._leaves = [], [], []
        self.autograd_params = []
        self._param_grads, self.packing = [], ParamGradPacking()
        self.fusion = MainGradFusion(self.fusion.enabled)
        self._aliases = {}
        self.out_template = None
        self.ledger, self.held, self.unused = None, False, UnusedOutputs()

    # ------------------------------------------------------------------ replay
    def copy_inputs(self, tensors: tuple[torch.Tensor, ...]) -> bool:
        """Copy live inputs into the static buffers. False if a shared buffer would be clobbered."""
        for i, (buf, x) in enumerate(zip(self.static_inputs, tensors)):
            if x.data_ptr() == buf.data_ptr() and x.stride() == buf.stride():
                continue  # already the buffer: layer i's output is layer i+1's input
            if self._shared_inputs[i]:
                return False  # the buffer is another runner's output; writing it would corrupt it
            buf.detach().copy_(x)
        return True

    def grads_for_autograd(
        self, clone: bool = True, active: tuple[bool, ...] | None = None
    ) -> list[torch.Tensor | None]:
        """Input gradients (static) + parameter gradients (fresh views; see ParamGradPacking).

        ``active``: per differentiable output, whether autograd gave it a gradient; inputs and
        parameters that only inactive outputs reach get None (:class:`UnusedOutputs`).
        """
        kept = self.fusion.keep(self.packing.for_autograd(self._param_grads, clone))
        if not kept and self.autograd_params:  # the anchor leaf (see autograd_params)
            kept = [None]
        grads = [*self.static_grads, *kept]
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
        self.after_backward_debug()

    def after_backward_debug(self) -> None:
        if self.debug:  # stale reads show up as NaN instead of plausible numbers
            for i, buf in enumerate(self.static_inputs):
                if not self._shared_inputs[i]:
                    _poison(buf.detach())
            for buf in self.static_grad_outputs:
                _poison(buf)
            self._grad_out_zero = [False] * len(self.static_grad_outputs)

    def outputs(self, tensors: list[torch.Tensor]) -> Any:
        """The call's return value, in the structure the module returned."""
        if isinstance(self.out_template, torch.Tensor):
            return tensors[0]
        return rebuild(self.out_template, iter(tensors))

    def __repr__(self) -> str:
        shapes = [tuple(s.shape) for s in self.samples or self.static_inputs]
        return f"Runner({type(self.module).__name__}, inputs={shapes}, grad={self.grad_mode})"


_PLACEHOLDER = torch.empty(0)


def _strip(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a placeholder (a template that pins no memory)."""
    return rebuild(obj, itertools.repeat(_PLACEHOLDER))


def kept_positions(fusion: MainGradFusion, params: list) -> list[int | None]:
    """Per parameter, its index among the parameters handed to autograd (None: fused)."""
    kept = fusion.keep(list(range(len(params))))
    where = {j: k for k, j in enumerate(kept)}
    return [where.get(j) for j in range(len(params))]


@contextlib.contextmanager
def _training_flags(module: torch.nn.Module, flags: tuple[bool, ...]):
    """Run with the ``training`` flags of the recorded call (``module`` and its submodules).

    A graph is captured after the recorded iteration, when the model may be in another mode
    (``model.eval()`` for a recorded evaluation, then ``model.train()`` before
    ``create_graphs()``); the graph must contain the recorded call's kernels (dropout off).
    """
    modules = list(module.modules())
    live = [m.training for m in modules]
    if len(flags) != len(modules):
        raise RuntimeError(
            f"{type(module).__name__} gained or lost submodules since the recorded iteration; "
            "call tgraph.reset() and record again"
        )
    for m, flag in zip(modules, flags):
        m.training = flag
    try:
        yield
    finally:
        for m, flag in zip(modules, live):
            m.training = flag


def _count_tensors(obj: Any) -> int:
    found: list[torch.Tensor] = []
    _collect(obj, found)
    return len(found)


def _collect(obj: Any, tensors: list[torch.Tensor]) -> bool:
    """Append ``obj``'s tensors to ``tensors``; False if it holds no tensor at all."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return True
    if isinstance(obj, (tuple, list)):
        return any([_collect(o, tensors) for o in obj])
    if isinstance(obj, dict):
        return any([_collect(v, tensors) for v in obj.values()])
    return False
