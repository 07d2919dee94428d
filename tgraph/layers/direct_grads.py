"""Opt-in direct gradients (``tgraph.enable(model, direct_grads=True)``): a graphed node writes
its parameters' gradients to ``.grad`` itself, in place of autograd's AccumulateGrad nodes.

:class:`DirectGrads` is the unit's switch (and the refusal under torch.distributed);
:class:`DirectRoute` is one unit's route: which parameters the node writes, and the anchor leaf
that stands in for them as the node's input.
"""

from __future__ import annotations

import weakref

import torch
import torch.autograd as _autograd

_ROUTES: weakref.WeakSet[DirectRoute] = weakref.WeakSet()  # the live routes: what the guard asks


class DirectGrads:
    """Opt-in (``tgraph.enable(model, direct_grads=True)``): the graphed node writes parameter
    gradients to ``.grad`` itself instead of handing them to autograd's AccumulateGrad.

    Normally the node takes every parameter as an input, and after each backward autograd's
    engine runs one AccumulateGrad node per parameter (its hooks, a lock, the steal or the add,
    the engine's per-node path): together a few microseconds a parameter on the host, the
    largest part of a host-bound step's backward. With this on, the node takes one internal
    leaf (the *anchor*) and the parameters that keep autograd's path; its backward does for
    the others what AccumulateGrad does: ``.grad`` set to the gradient where it is None, the
    gradient added in place otherwise (one multi-tensor add; one add each where a parameter
    repeats). :class:`DirectRoute` holds one unit's route.

    Exact for ``loss.backward()`` in one process. Refused with an error naming the fix:
    torch.distributed initialized (DDP, FSDP and megatron hook the parameters' grad
    accumulators, which would not run); ``backward(inputs=...)`` or ``torch.autograd.grad``
    through a graphed layer (they would not accumulate into every ``.grad``; one parameter
    per unit keeps autograd's path so that a list of parameters reaches the node, which
    refuses it), and either one asking for a parameter written directly, which no edge
    reaches (refused before autograd's engine runs, by :func:`_guard_inputs`); torch.func
    transforms. Parameters with tensor hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``), non-contiguous or non-leaf ones keep autograd's path; a
    hook registered after capture, or a parameter laid out anew, moves it back to that path
    before the next forward. Not seen: hooks registered on a parameter's AccumulateGrad node
    itself (``p.view_as(p).grad_fn.next_functions[0][0].register_hook``) in one process; they
    do not run for the parameters written directly.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled

    @staticmethod
    def refuse_distributed() -> None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            raise ValueError(
                "tgraph: direct_grads=True with torch.distributed initialized: DDP, FSDP and "
                "megatron-core hook every parameter's gradient accumulator, which direct "
                "gradients skip. Enable without direct_grads (the default)."
            )

    def route(self, kept: list[torch.Tensor], device: torch.device) -> DirectRoute | None:
        """The route of one unit's parameters ``kept`` (those autograd would get), or None
        when off. Its backward hands fresh tensors each time (ParamGradOutputs), which
        AccumulateGrad would adopt as they are."""
        if not self.enabled:
            return None
        self.refuse_distributed()
        return DirectRoute(kept, device)


def _direct(p: torch.Tensor) -> bool:
    """Whether AccumulateGrad's work for ``p`` is only the steal or the add that
    :meth:`DirectRoute.deliver` does: a dense, contiguous leaf without tensor hooks."""
    return (
        p.is_leaf
        and p.requires_grad
        and p.layout == torch.strided
        and p.is_contiguous()
        and not p._backward_hooks
        and not p._post_accumulate_grad_hooks
    )


class DirectRoute:
    """Which of a unit's parameters get their gradients from the node (:class:`DirectGrads`),
    and the anchor leaf that stands in for them as the node's input."""

    __slots__ = ("mask", "params", "ids", "unique", "anchor", "anchor_node", "__weakref__")

    def __init__(self, kept: list[torch.Tensor], device: torch.device) -> None:
        # Per parameter autograd would get: direct? Not the first one: an edge to a parameter
        # makes backward(inputs=params) run the node (to be refused), not skip it silently.
        mask = list(map(_direct, kept))
        first = next((p for p, m in zip(kept, mask) if m), None)
        self.mask = tuple(m and p is not first for p, m in zip(kept, mask))
        self.params = [p for p, m in zip(kept, self.mask) if m]
        self.ids = frozenset(map(id, self.params))  # held by self.params: ids stay theirs
        self.unique = len(self.ids) == len(self.params)
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        with torch.enable_grad():  # held: the node the plain-backward check asks about
            self.anchor_node = self.anchor.view_as(self.anchor).grad_fn.next_functions[0][0]
        _install_guard()
        _ROUTES.add(self)

    def inputs(self, kept: list[torch.Tensor]) -> list[torch.Tensor]:
        """The node's parameter inputs: the anchor, then those that keep autograd's path."""
        return [self.anchor, *(p for p, m in zip(kept, self.mask) if not m)]

    def check_backward(self, name: str, hooks_moved: bool) -> None:
        """Before the backward replay: this is a plain ``backward()``, which runs every node
        (the anchor's too), not ``backward(inputs=...)`` or ``torch.autograd.grad``; and no
        parameter written directly got a tensor hook since its forward (``hooks_moved``: a
        hook was registered somewhere since)."""
        DirectGrads.refuse_distributed()  # initialized after capture
        if hooks_moved:
            hooked = [p for p in self.params if not _direct(p)]
            if hooked:
                raise RuntimeError(
                    f"tgraph: a tensor hook was registered on a parameter of {name} between its "
                    "forward and its backward; with direct_grads=True that forward left the "
                    "parameter's gradient to the node, so the hook would not run. Register it "
                    "before the forward (the next forward gives the parameter autograd's path)."
                )
        try:
            plain = torch._C._will_engine_execute_node(self.anchor_node)
        except RuntimeError:  # torch.autograd.grad
            plain = False
        if not plain:
            raise RuntimeError(
                f"tgraph: {name} writes its parameters' gradients to .grad itself "
                "(direct_grads=True), which is exact only for a plain loss.backward(); this "
                "backward is torch.autograd.grad or backward(inputs=...). Enable without "
                "direct_grads for this training loop."
            )

    def deliver(self, grads: list) -> list:
        """``grads``: per parameter autograd would get. Writes the direct ones to ``.grad``
        (as AccumulateGrad: set where None, added in place otherwise); returns the node's
        gradients for :meth:`inputs` (None for the anchor)."""
        mask, out = self.mask, [None]
        targets, addends = [], []
        params = iter(self.params)
        for g, m in zip(grads, mask):
            if not m:
                out.append(g)
                continue
            p = next(params)
            if g is None or not p.requires_grad:  # frozen since the forward: as AccumulateGrad
                continue
            if p.grad is None:
                p.grad = g
            else:
                targets.append(p.grad)
                addends.append(g)
        if targets:
            if self.unique:
                torch._foreach_add_(targets, addends)
            else:  # one destination twice in one _foreach_add_ races on CUDA
                for t, g in zip(targets, addends):
                    t.add_(g)
        return out


def _asked_direct(inputs) -> bool:
    """Whether ``inputs`` (a backward's ``inputs=``, ``autograd.grad``'s inputs) names a
    parameter some live route writes directly."""
    routes = list(_ROUTES)
    return any(isinstance(t, torch.Tensor) and any(id(t) in r.ids for r in routes) for t in inputs)


def _guard_inputs(run):
    """torch.autograd's engine entry, refusing first a backward or ``autograd.grad`` that asks
    for a parameter written directly: no edge of the graph reaches it (its gradient comes from
    the node, only in a plain backward), so autograd would skip the node and hand back None,
    or zeros, or leave ``.grad`` untouched, silently. A plain ``loss.backward()`` passes no
    inputs: one falsy test."""

    def run_backward(t_outputs, *args, **kwargs):
        inputs = args[3] if len(args) > 3 else kwargs.get("inputs")
        if inputs and _ROUTES and _asked_direct(inputs):
            raise RuntimeError(
                "tgraph: this backward(inputs=...) or torch.autograd.grad asks for the gradient "
                "of a parameter whose graphed module writes .grad itself (direct_grads=True), "
                "which is exact only for a plain loss.backward(); autograd would return no "
                "gradient for it. Enable without direct_grads for this training loop."
            )
        return run(t_outputs, *args, **kwargs)

    run_backward._tgraph_guard = True
    return run_backward


def _install_guard() -> None:
    """Route ``torch.autograd.backward`` and ``grad`` through :func:`_guard_inputs` (their
    module's own name for the engine's entry, and ``torch.autograd.graph``'s, which torch's own
    temporary patches save and put back; once). Without that entry (another PyTorch) direct
    gradients are refused, since nothing would see such a request."""
    graph = _autograd.graph
    run = getattr(_autograd, "_engine_run_backward", None)
    if run is None or getattr(graph, "_engine_run_backward", None) is None:
        raise ValueError(
            "tgraph: direct_grads=True needs torch.autograd._engine_run_backward (PyTorch >= "
            "2.3) to refuse a backward that asks for a directly written parameter; enable "
            "without direct_grads."
        )
    if not getattr(run, "_tgraph_guard", False):
        _autograd._engine_run_backward = graph._engine_run_backward = _guard_inputs(run)
