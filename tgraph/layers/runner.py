"""A runner: one graphed module called with one signature (a :class:`~tgraph.layers.capture.GraphedUnit`).

What is the runner's own: its recorded first call (:class:`tgraph.layers.draft.RecordedCall`),
from which its capture fills its static input buffers (or the producer's static output, shared)
and parameter aliases in its draft, and how its module's forward runs under the recorded grad
mode, autocast, SDPA backend selection and ``training`` flags. Capture and the buffers' ownership
are the unit's (:mod:`tgraph.layers.capture`); a replay works on the unit's frozen capture result
(:mod:`tgraph.layers.replay`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from tgraph.baked import hooks_run_outside
from tgraph.fp8 import FP8Region, first_microbatch, set_weight_caching
from tgraph.guards import CaptureError
from tgraph.layers.capture import GraphedUnit, graphed_region
from tgraph.layers.draft import RecordedCall
from tgraph.signature import CallKey, ambient, split


class Runner(GraphedUnit):
    """Graphs of ``module`` for calls with key ``key`` (see :mod:`tgraph.signature`).

    Args:
        module: the graphed module.
        key: the call's :class:`~tgraph.signature.CallKey`.
        args, kwargs: the first call's arguments (their tensors are cloned as capture samples).
        tensors: the first call's tensors, in the order of ``key``.
        links: per tensor, ``(producer runner, output index)`` when that tensor was a recorded
            output of another graphed call (its static output becomes this static input).
        merge: may be captured together with its neighbours (:mod:`tgraph.layers.segment`).
        fusion: add parameter gradients into ``main_grad`` (:class:`tgraph.layers.grads.MainGradFusion`).
        direct: write parameter gradients to ``.grad`` from the node
            (:class:`tgraph.layers.direct_grads.DirectGrads`).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        key: CallKey,
        args: tuple,
        kwargs: dict,
        tensors: list[torch.Tensor],
        links: list[tuple[Runner, int] | None],
        *,
        merge: bool = True,
        fusion: bool = False,
        direct: bool = False,
    ) -> None:
        self.module = module
        self.key = key
        self.merge = merge
        self.segment = None  # the Segment this runner belongs to, if merged
        self.seg_index = 0
        shapes = [tuple(t.shape) for t in tensors]
        self.label = f"Runner({named(module)}, inputs={shapes}, grad={key.grad})"
        call = RecordedCall(
            template=split((args, kwargs))[1],
            samples=[t.detach().clone() for t in tensors],
            requires_grad=[t.requires_grad for t in tensors],
            links=links,
            shared_with=[[] for _ in tensors],  # set by the record (tgraph.layers.manager)
        )
        device = tensors[0].device if tensors else next(module.parameters()).device
        self._init_unit(device, key.grad, fusion, direct, call)

    @property
    def head(self) -> Runner:
        return self

    @property
    def members(self) -> list[Runner]:
        return [self]

    def __repr__(self) -> str:
        return self.label

    # ----------------------------------------------------------------- capture
    def _prepare_capture(self) -> None:
        d = self.draft
        d.static_inputs = [self._static_input(i, s) for i, s in enumerate(d.call.samples)]
        d.in_rg = [i for i, t in enumerate(d.static_inputs) if t.requires_grad]
        self.make_aliases()

    def _static_input(self, i: int, sample: torch.Tensor) -> torch.Tensor:
        link = self.draft.call.links[i]
        producer = link[0] if link is not None else None
        # Share the producer's static output only if the producer has a backward: then it
        # stays in flight (cannot replay again) until after this runner's backward, which may
        # read this buffer as a saved activation. A 0-dim output is handed out as a copy
        # (Captured.fresh_outputs): its consumer copies it in.
        shared = (
            producer is not None
            and producer.draft is not None
            and bool(producer.draft.static_outputs)
            and (producer.segment or producer).draft.needs_backward
            and producer.draft.static_outputs[link[1]].dim() != 0
        )
        self.draft.shared_inputs.append(shared)
        if shared:  # the producer's static output is this static input: no copy at replay
            buf = producer.draft.static_outputs[link[1]].detach()
        else:
            buf = torch.empty_like(sample)
            with torch.no_grad():
                buf.copy_(sample)  # realistic values for warmup (indices must be valid)
        return buf.requires_grad_(self.draft.call.requires_grad[i])

    def make_aliases(self) -> None:
        """One alias leaf per parameter: same storage, its own autograd identity.

        Graphs differentiate with respect to aliases, not the parameters themselves. A
        parameter's AccumulateGrad node, kept alive by any earlier autograd graph (e.g. the
        recorded iteration's ``loss``), remembers the eager stream it was created on, and the
        autograd engine's end-of-backward sync with that stream invalidates a capture
        (cudaErrorStreamCaptureImplicit). Aliases get fresh nodes on the capture stream. Their
        Python attributes start as copies of the parameter's (``main_grad`` is shared).
        """
        aliases = self.draft.aliases = {}
        for p in self.module.parameters():
            alias = p.detach().requires_grad_(p.requires_grad)
            alias.__dict__.update(vars(p))
            aliases[id(p)] = alias

    @contextlib.contextmanager
    def _parameters_aliased(self) -> Iterator[None]:
        swapped, aliases = [], self.draft.aliases
        for mod in self.module.modules():
            for name, p in mod._parameters.items():
                if p is not None and id(p) in aliases:
                    swapped.append((mod, name, p))
                    mod._parameters[name] = aliases[id(p)]
        try:
            yield
        finally:
            for mod, name, p in swapped:
                mod._parameters[name] = p

    def _run_forward(self) -> list[torch.Tensor]:
        d = self.draft
        args, kwargs = d.call.template.fill(d.static_inputs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_mode))
            stack.enter_context(_training_flags(self.module, self.key.training))
            # capture under the recorded autocast regions and SDPA selection
            stack.enter_context(ambient(self.key.autocast))
            for region in self.key.autocast:
                if isinstance(region, FP8Region):  # TransformerEngine's te.autocast
                    stack.enter_context(region.capture_context())
                    set_weight_caching(first_microbatch(kwargs))
            stack.enter_context(self._parameters_aliased())
            stack.enter_context(graphed_region())  # nested GraphableModules are part of this graph
            versions = [t._version for t in d.static_inputs]
            attrs = _tensor_attributes(self.module)
            out = module_call(self.module)(*args, **kwargs)
        # inputs the forward writes in place (running statistics passed as an argument): a
        # replay writes the static buffer, which is copied back to the caller's tensor
        d.mutated |= {i for i, t in enumerate(d.static_inputs) if t._version != versions[i]}
        tensors, template = split(out)
        if not tensors:
            raise TypeError(
                f"{type(self.module).__name__}.forward must return tensors (or tuples, lists or "
                f"dicts of tensors) to be graphed; got {type(out).__name__}"
            )
        # tensors the forward left in module state (self.aux_loss = ...) become extra outputs,
        # which each replay stores in those attributes again (GraphedUnit.bake, _Manager.call)
        stored, extra = [], []
        for m, k, t in _stored_tensors(self.module, attrs):
            at = next((i for i, x in enumerate(tensors) if x is t), None)
            if at is None:
                at = len(tensors) + len(extra)
                extra.append(t)
            stored.append((m, k, at))
        if d.out_template is None:  # warmup; replays keep the capture's template
            d.out_template = template
            d.stored = tuple(stored)
        elif [(m, k) for m, k, _ in stored] != [(m, k) for m, k, _ in d.stored]:
            raise CaptureError(
                f"the forward of {type(self.module).__name__} stores tensors in other module "
                "attributes at each pass; graph it only if it stores the same ones every call"
            )
        return tensors + extra


def _tensor_attributes(module: torch.nn.Module) -> dict[tuple[str, str], int]:
    """``(submodule name, attribute)`` -> identity of each plain tensor attribute."""
    return {
        (name, k): id(v)
        for name, m in module.named_modules()
        for k, v in vars(m).items()
        if isinstance(v, torch.Tensor)
    }


def _stored_tensors(
    module: torch.nn.Module, before: dict[tuple[str, str], int]
) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
    """The tensors the forward left in module state (``self.aux_loss = ...``, as
    mixture-of-experts layers do), as ``(submodule, attribute, tensor)``. A replay runs no
    Python, so it could not set them, and the stored tensor would keep the capture's autograd
    graph: they become extra outputs of the graph instead."""
    found = []
    for name, m in module.named_modules():
        if m._forward_pre_hooks:  # a pre-hook recomputing a weight for the forward itself
            continue  # (weight_norm under capturable_hooks): read inside the graph, not after
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and before.get((name, k)) != id(v):
                found.append((m, k, v))
    return found


def named(module: torch.nn.Module) -> str:
    """``module`` as messages name it: its path in the enabled model and its class
    (``blocks.3 (Block)``), or its class where the path is not known."""
    cls = type(module).__name__
    path = getattr(module.__dict__.get("_tgraph"), "name", "")
    return f"{path} ({cls})" if path and path != cls else cls


def compiled_call(module: torch.nn.Module, options: dict[str, Any] | None) -> Any:
    """``torch.compile`` of ``module``'s call (its forward and hooks), or None when ``options``
    is None. Compilation is lazy: the first call of the returned callable compiles. Modules of
    one class share the compiled code: dynamo guards on the module's attributes and treats its
    parameters as inputs, so a stack of identical layers compiles once."""
    if options is None:
        return None

    def call(*args, _tgraph_module=module, **kwargs):  # its own hooks run around the call
        return _tgraph_module.forward(*args, **kwargs)

    return torch.compile(call, **options)


def compile_options_of(compile: bool | dict[str, Any]) -> dict[str, Any] | None:  # noqa: A002
    """``torch.compile`` keyword arguments of ``enable(compile=...)``; None: no compilation."""
    if compile is False or compile is None:
        return None
    options = {} if compile is True else dict(compile)
    mode = options.get("mode") or "default"
    if mode in ("reduce-overhead", "max-autotune"):
        raise ValueError(
            f"enable(compile={{'mode': {mode!r}}}) would capture inductor's own CUDA graphs "
            "inside tgraph's; use mode 'default' or 'max-autotune-no-cudagraphs'"
        )
    return options


def warn_skipped_call(cls: type, base: type) -> None:
    """A class after ``base`` (GraphableModule) in ``cls``'s MRO whose ``__call__`` the graphed
    dispatch takes the place of (transformers' ``GradientCheckpointingLayer`` checkpoints
    there): say so once, unless ``cls`` itself defines ``__call__`` (it handled that)."""
    mro = cls.__mro__
    if "__call__" in cls.__dict__ or base not in mro:
        return
    after = mro[mro.index(base) + 1 :]
    skipped = [c for c in after if c not in (torch.nn.Module, object) and "__call__" in c.__dict__]
    if skipped:
        hint = (
            " For transformers layers use tgraph.integrations.transformers.graph_layers(model)."
            if skipped[0].__module__.startswith("transformers")
            else ""
        )
        warnings.warn(
            f"{cls.__name__}: GraphableModule.__call__ takes the place of "
            f"{skipped[0].__qualname__}.__call__, which does not run for graphed calls (e.g. "
            f"gradient checkpointing done there).{hint}",
            UserWarning,
            stacklevel=3,
        )


def module_call(module: torch.nn.Module, compiled: bool = True) -> Any:
    """How the recorded call, eager fallbacks, warmup and capture call ``module``: its
    compiled call when enabled with ``compile=...`` (:func:`compiled_call`; ``compiled=False``:
    never, as an emulated capture calls it), else its ``forward`` (its own forward hooks run
    around the call, :mod:`tgraph.baked`), else (it has backward hooks) ``nn.Module.__call__``."""
    state = module.__dict__.get("_tgraph")
    code = getattr(state, "compiled", None) if compiled else None
    # Dynamo does not run under a dispatch mode (the warmup's host-sync check, an emulated
    # capture) and, once a compiled function was called under one, stops running it at all
    # (torch 2.13): such passes call the module itself, so that a CUDA capture, which runs no
    # dispatch mode, still graphs the compiled kernels.
    if code is not None and not torch._C._len_torch_dispatch_stack():
        return code
    if hooks_run_outside(module):  # GraphableModule.__call__ runs its own forward hooks
        return module.forward
    return functools.partial(torch.nn.Module.__call__, module)


@contextlib.contextmanager
def _training_flags(module: torch.nn.Module, flags: tuple[bool, ...]) -> Iterator[None]:
    """Run with the ``training`` flags of the recorded call (``module`` and its submodules).

    A graph is captured after the recorded iteration, when the model may be in another mode
    (``model.eval()`` for a recorded evaluation, then ``model.train()`` before
    ``create_graphs()``); the graph must contain the recorded call's kernels (dropout off).
    """
    modules = list(module.modules())
    if len(flags) != len(modules):
        raise RuntimeError(
            f"{type(module).__name__} gained or lost submodules since the recorded iteration; "
            "call tgraph.reset() and record again"
        )
    live = [m.training for m in modules]
    for m, flag in zip(modules, flags):
        m.training = flag
    try:
        yield
    finally:
        for m, flag in zip(modules, live):
            m.training = flag
