"""Direct gradients (``tgraph.enable(model, direct_grads=...)``, on by default where exact): a
graphed node writes its parameters' gradients to ``.grad`` itself, in place of autograd's
AccumulateGrad nodes.

:class:`DirectGrads` is the unit's switch (and the refusal under torch.distributed);
:class:`DirectRoute` is one unit's route: which parameters the node writes, and the anchor leaf
that stands in for them as the node's input.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from itertools import compress, repeat
from operator import attrgetter, is_, is_not

import torch
import torch.autograd as _autograd

_ROUTES: weakref.WeakSet[DirectRoute] = weakref.WeakSet()  # the live routes: what the guard asks


class DirectGrads:
    """Whether a unit's node writes its parameters' gradients to ``.grad`` itself instead of
    handing them to autograd's AccumulateGrad (``tgraph.enable(direct_grads=...)``; None, the
    default: wherever torch.distributed is not initialized).

    Normally the node takes every parameter as an input: ``Function.apply`` then pays for each
    (about 0.5 us a parameter on the host, 60 us for a 12-layer stack's 112), and after each
    backward autograd's engine runs one AccumulateGrad node per parameter (its hooks, a lock,
    the steal or the add, the engine's per-node path): together the largest part of a
    host-bound step's graphed calls. Direct, the node takes one internal leaf (the *anchor*)
    and the parameters that keep autograd's path; its backward does for the others what
    AccumulateGrad does: ``.grad`` set to the gradient where it is None, the gradient added in
    place otherwise (one multi-tensor add), a tensor hook registered since the forward run
    first, a post-accumulate one after. :class:`DirectRoute` holds one unit's route.

    ``backward(inputs=...)`` and ``torch.autograd.grad`` get what eager gives them: the
    engine's entry (:func:`_guard_inputs`) asks for the anchor of a directly written parameter
    in its place and hands back that parameter's gradient, and the node writes no ``.grad``
    the call did not ask for. Parameters with tensor hooks, non-contiguous, non-leaf or
    subclassed ones keep autograd's path, and so do those that a backward of the recorded
    iteration reached through the unit and elsewhere too (``shared``: eager code outside the
    unit, such as a head that reuses a block's weight, another unit, or another call of the unit
    in flight; :meth:`tgraph.layers.record.Record.note_backward`): autograd adds up a leaf's
    gradients before it accumulates them into ``.grad``, which writing one's share into
    ``.grad`` apart would round otherwise once ``.grad`` holds an earlier microbatch's
    (``(G + o) + g`` where eager computes ``G + (o + g)``). Such a use that only begins after
    the recorded iteration is not seen. Never direct: units under torch.distributed (DDP,
    FSDP and megatron-core hook the parameters' gradient accumulators, which would not run) or
    a torch.func transform; by default a unit finding either at a forward goes back to
    autograd's path for good, and ``direct_grads=True`` refuses them. Not seen: hooks
    registered on a parameter's AccumulateGrad node itself
    (``p.view_as(p).grad_fn.next_functions[0][0].register_hook``) in one process without
    torch.distributed; they do not run for the parameters written directly
    (``direct_grads=False`` runs them).
    """

    def __init__(self, enabled: bool | None = None, shared: tuple[bool, ...] = ()) -> None:
        self.enabled = enabled  # None: wherever it is exact (chosen, not asked for)
        # per parameter of the node (fused ones left out): reached elsewhere too in the record
        self.shared = shared

    @staticmethod
    def refuse_distributed() -> None:
        if distributed():
            raise ValueError(
                "tgraph: direct_grads=True with torch.distributed initialized: DDP, FSDP and "
                "megatron-core hook every parameter's gradient accumulator, which direct "
                "gradients skip. Enable without direct_grads (the default chooses)."
            )

    def route(self, kept: list[torch.Tensor], device: torch.device) -> DirectRoute | None:
        """The route of one unit's parameters ``kept`` (those autograd would get), or None
        when off. Its backward hands fresh tensors each time (ParamGradOutputs), which
        AccumulateGrad would adopt as they are."""
        if self.enabled is False:
            return None
        if self.enabled is None and (distributed() or not _guardable()):
            self.enabled = False
            return None
        self.refuse_distributed()
        return DirectRoute(kept, device, self.shared)

    def leave(self, name: str) -> None:
        """At a forward under a torch.func transform or torch.distributed: the default goes
        back to autograd's path for good (the caller re-routes); ``direct_grads=True``
        refuses."""
        if self.enabled is None:
            self.enabled = False
            return
        self.refuse_distributed()
        raise RuntimeError(
            f"tgraph: {name} was enabled with direct_grads=True, whose node writes .grad "
            "itself, under a torch.func transform (which takes gradients through autograd). "
            "Enable without direct_grads=True to graph it under torch.func."
        )


def distributed() -> bool:
    """Whether torch.distributed is initialized (never direct then)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _direct(p: torch.Tensor) -> bool:
    """Whether AccumulateGrad's work for ``p`` is only the steal or the add that
    :meth:`DirectRoute.deliver` does: a dense, contiguous leaf of a plain class (a subclass
    may accumulate its own way) without tensor hooks, and without megatron-core's
    ``main_grad`` (whose DDP hooks the gradient accumulator, even in one process)."""
    return (
        type(p) in _PLAIN
        and not hasattr(p, "main_grad")
        and p.is_leaf
        and p.requires_grad
        and p.layout == torch.strided
        and p.is_contiguous()
        and not p._backward_hooks
        and not p._post_accumulate_grad_hooks
    )


_PLAIN = (torch.nn.Parameter, torch.Tensor)


class DirectRoute:
    """Which of a unit's parameters get their gradients from the node (:class:`DirectGrads`),
    and the anchor leaf that stands in for them as the node's input."""

    __slots__ = (
        "kept",
        "mask",
        "keeps",
        "params",
        "unique",
        "alone",
        "anchor",
        "anchor_node",
        "__weakref__",
    )

    def __init__(
        self, kept: list[torch.Tensor], device: torch.device, shared: tuple[bool, ...] = ()
    ) -> None:
        self.kept = kept  # per parameter gradient the node's backward computes
        shared = shared or (False,) * len(kept)  # reached elsewhere too: autograd's path
        self.mask = tuple(_direct(p) and not s for p, s in zip(kept, shared, strict=True))
        self.keeps = tuple(not m for m in self.mask)  # those that keep autograd's path
        self.params = list(compress(kept, self.mask))
        self.unique = len(set(map(id, self.params))) == len(self.params)
        self.alone = not any(self.keeps)  # no parameter of the unit keeps autograd's path
        self.anchor = torch.zeros((), device=device, requires_grad=True)
        with torch.enable_grad():  # held: the node the plain-backward check asks about
            self.anchor_node = self.anchor.view_as(self.anchor).grad_fn.next_functions[0][0]
        _install_guard()
        _ROUTES.add(self)

    def inputs(self) -> list[torch.Tensor]:
        """The node's parameter inputs: the anchor, then those that keep autograd's path."""
        return [self.anchor, *compress(self.kept, self.keeps)]

    def request(self, name: str, strict_dist: bool) -> Request | None:
        """Before the backward replay: None in a plain ``backward()`` (the engine runs every
        node, the anchor's too); the :class:`Request` of a ``backward(inputs=...)`` or
        ``torch.autograd.grad`` (set by the engine's entry). ``strict_dist``: refuse
        torch.distributed initialized since the forward (``direct_grads=True``)."""
        if strict_dist:
            DirectGrads.refuse_distributed()
        asked = _request[0]
        if asked is not None:
            return asked
        try:
            plain = torch._C._will_engine_execute_node(self.anchor_node)
        except RuntimeError:  # torch.autograd.grad
            plain = False
        if not plain:  # entered past torch.autograd's Python entry (which sets the request)
            raise RuntimeError(
                f"tgraph: {name} writes its parameters' gradients to .grad itself, and this "
                "backward entered autograd's engine past torch.autograd.backward and grad, so "
                "it cannot tell which gradients were asked for. Enable with "
                "direct_grads=False for this training loop."
            )
        return None

    def adds(self, asked: Request | None, hooks_moved: bool) -> bool:
        """Whether :meth:`deliver` will only add into ``.grad`` tensors that exist (a plain
        backward, no hook registered since the forward, each parameter once and requiring
        grad, every one with a ``.grad``: zeroed in place, or a later microbatch). Then the
        static buffers themselves can be the addends: no alias per parameter."""
        params = self.params
        return (  # .grad first: after zero_grad(set_to_none=True) the first None ends it
            asked is None
            and not hooks_moved
            and self.unique
            and self.alone
            and all(map(is_not, map(_grad, params), repeat(None)))
            and all(map(_requires_grad, params))
        )

    def deliver(
        self,
        grads: list,
        asked: Request | None = None,
        hooks_moved: bool = True,
        adding: bool = False,
    ) -> list:
        """``grads``: per parameter autograd would get. Writes the direct ones to ``.grad``
        (as AccumulateGrad: a tensor hook first, then set where None, added in place
        otherwise, then a post-accumulate hook), only those ``asked`` names when a backward
        names its inputs (or, for ``autograd.grad``, hands them to it); returns the node's
        gradients for :meth:`inputs` (a zero for the anchor the engine was asked for).
        ``hooks_moved``: a hook was registered somewhere since the forward. ``adding``:
        :meth:`adds` said so, and ``grads`` may be the static buffers themselves."""
        out = [None if asked is None else self.anchor.new_zeros(()), *compress(grads, self.keeps)]
        gs = list(compress(grads, self.mask))
        params = self.params
        if adding:  # add only: a buffer never becomes a .grad
            have = list(map(_grad, params))
            if not all(map(is_not, gs, repeat(None))):  # outputs the loss did not reach
                have = [h for h, g in zip(have, gs) if g is not None]
                gs = [g for g in gs if g is not None]
            if gs:
                torch._foreach_add_(have, gs)
            return out
        if asked is None and not hooks_moved and self.unique and all(map(is_not, gs, repeat(None))):
            if all(map(_requires_grad, params)):  # the steady step: C-level passes
                have = list(map(_grad, params))
                if all(map(is_, have, repeat(None))):  # set_to_none: set each
                    list(map(setattr, params, repeat("grad"), gs))
                    return out
                if all(map(is_not, have, repeat(None))):  # zeroed in place, or accumulating
                    torch._foreach_add_(have, gs)
                    return out
        if not self.unique:  # a parameter the node differentiates more than once
            params, gs = _summed(params, gs)
        targets, addends, hooked = [], [], []
        for p, g in zip(params, gs):
            if g is None or not p.requires_grad:  # frozen since the forward: as AccumulateGrad
                continue
            if asked is not None:
                if id(p) not in asked.wanted:
                    continue
                if not asked.accumulate:
                    have = asked.got.get(id(p))
                    # handed to the caller, who may keep it: its own memory, as eager's
                    asked.got[id(p)] = g.clone() if have is None else have + g
                    continue
            if p._backward_hooks or p._post_accumulate_grad_hooks:  # registered since
                hooked.append((p, g))
            elif p.grad is None:
                p.grad = g
            else:
                targets.append(p.grad)
                addends.append(g)
        if targets:
            torch._foreach_add_(targets, addends)
        for p, g in hooked:
            _accumulate_with_hooks(p, g)
        return out


_requires_grad = attrgetter("requires_grad")
_grad = attrgetter("grad")


def _summed(params: list[torch.Tensor], grads: list) -> tuple[list[torch.Tensor], list]:
    """Each parameter once, with the sum of its gradients in ``grads``' order (None where it
    has none), as AccumulateGrad gets it: autograd adds up a leaf's gradients in its input
    buffer first, in the order they arrive (for a merged stack's node, the order of its inputs:
    :meth:`tgraph.layers.capture.GraphedUnit._find_params`), and accumulates the sum into
    ``.grad`` once, calling the leaf's hooks once."""
    sums: dict[int, list] = {}
    for p, g in zip(params, grads):
        have = sums.get(id(p))
        if have is None:
            sums[id(p)] = [p, g]
        elif g is not None:
            have[1] = g if have[1] is None else have[1] + g
    return [p for p, _ in sums.values()], [g for _, g in sums.values()]


def _accumulate_with_hooks(p: torch.Tensor, g: torch.Tensor) -> None:
    """AccumulateGrad's order for a parameter that got a hook between its forward and its
    backward: tensor hooks (each may replace the gradient), the accumulation, then the
    post-accumulate hooks."""
    for hook in (p._backward_hooks or {}).values():
        r = hook(g)
        if r is not None:
            g = r
    if p.grad is None:
        p.grad = g
    else:
        p.grad.add_(g)
    for hook in (p._post_accumulate_grad_hooks or {}).values():
        hook(p)


class Request:
    """A ``backward(inputs=...)`` or ``torch.autograd.grad`` in progress that asks for
    directly written parameters (``wanted``, by id): ``accumulate`` (``backward``: into their
    ``.grad``) or not (``grad``: their gradients, summed in ``got``, handed back in place of
    their anchors')."""

    __slots__ = ("wanted", "accumulate", "got")

    def __init__(self, wanted: set[int], accumulate: bool) -> None:
        self.wanted, self.accumulate, self.got = wanted, accumulate, {}


_request: list[Request | None] = [None]  # the engine call in progress that names its inputs
_unguarded = [0]  # inside unguarded(): tgraph's own eager autograd.grad (the shadow verifier)


@contextlib.contextmanager
def unguarded() -> Iterator[None]:
    """tgraph's own ``autograd.grad`` on eagerly run modules (the shadow verifier), whose
    parameters are reached by their own edges: the engine's entry leaves them as asked."""
    _unguarded[0] += 1
    try:
        yield
    finally:
        _unguarded[0] -= 1


def _guard_inputs(run):
    """torch.autograd's engine entry: a backward or ``autograd.grad`` that names its inputs
    gets, for a directly written parameter (which no edge reaches: its gradient comes from the
    node), the anchors of the live routes writing it asked for in its place (one per unit that
    holds it: a unit recorded for several calls, two forwards in flight), and the gradient the
    nodes hand the :class:`Request`, summed. A plain ``loss.backward()`` passes no inputs: one
    falsy test."""

    def run_backward(t_outputs, *args, **kwargs):
        if _observer[0] is not None and _graph_task_id() == -1:  # per-layer graphs record
            _observer[0](t_outputs)
        inputs = args[3] if len(args) > 3 else kwargs.get("inputs")
        if not inputs or not _ROUTES or _unguarded[0]:
            return run(t_outputs, *args, **kwargs)
        anchors: dict[int, list[torch.Tensor]] = {}  # per parameter written directly
        for r in list(_ROUTES):
            for p in r.params:
                anchors.setdefault(id(p), []).append(r.anchor)
        wanted = {id(t) for t in inputs if id(t) in anchors}
        accumulate = args[5] if len(args) > 5 else kwargs.get("accumulate_grad", True)
        asked = Request(wanted, accumulate)
        unused_ok = args[4] if len(args) > 4 else kwargs.get("allow_unreachable", False)
        asked_anchors = list({id(a): a for i in wanted for a in anchors[i]}.values())
        if wanted:  # the other inputs, then the anchors (a unit not run leaves its anchor unused)
            others = tuple(t for t in inputs if id(t) not in wanted)
            args, kwargs = _set(args, kwargs, 3, "inputs", others + tuple(asked_anchors))
            args, kwargs = _set(args, kwargs, 4, "allow_unreachable", True)
        before, _request[0] = _request[0], asked
        try:
            out = run(t_outputs, *args, **kwargs)
        finally:
            _request[0] = before
            if accumulate:
                for a in asked_anchors:  # the engine gave the anchors a zero
                    a.grad = None
        if not wanted or accumulate:
            return out
        rest = iter(out)
        got = [asked.got.get(id(t)) if id(t) in wanted else next(rest) for t in inputs]
        if not unused_ok and any(g is None for g in got):
            raise RuntimeError(
                "One of the differentiated Tensors appears to not have been used in the graph. "
                "Set allow_unused=True if this is the desired behavior."
            )
        return tuple(got)

    run_backward._tgraph_guard = True
    return run_backward


_observer: list[Callable[[tuple], None] | None] = [None]  # sees each backward's roots
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass


def observe_backwards(observer: Callable[[tuple], None] | None) -> None:
    """While per-layer graphs record: ``observer`` sees the roots of every backward and
    ``autograd.grad`` started outside a backward pass (the record finds there the parameters a
    unit and other code both reach, which keep autograd's path:
    :meth:`tgraph.layers.record.Record.note_backward`); None: none. Nothing is observed where
    direct gradients stay off: torch.distributed initialized, or no engine's entry to wrap
    (another PyTorch)."""
    if observer is not None:
        if not _guardable() or distributed():
            return
        _install_guard()
    _observer[0] = observer


def observing() -> bool:
    return _observer[0] is not None


def _set(args: tuple, kwargs: dict, i: int, name: str, value) -> tuple[tuple, dict]:
    """The engine's arguments with argument ``i`` (keyword ``name``) set to ``value``."""
    if len(args) > i:
        return (*args[:i], value, *args[i + 1 :]), kwargs
    return args, {**kwargs, name: value}


def _guardable() -> bool:
    return hasattr(_autograd, "_engine_run_backward") and hasattr(
        _autograd.graph, "_engine_run_backward"
    )


def _install_guard() -> None:
    """Route ``torch.autograd.backward`` and ``grad`` through :func:`_guard_inputs` (their
    module's own name for the engine's entry, and ``torch.autograd.graph``'s, which torch's own
    temporary patches save and put back; once). Without that entry (another PyTorch) direct
    gradients are refused, since nothing would see such a request."""
    if not _guardable():
        raise ValueError(
            "tgraph: direct_grads=True needs torch.autograd._engine_run_backward (PyTorch >= "
            "2.3) to serve a backward that asks for a directly written parameter; enable "
            "with direct_grads=False."
        )
    run = _autograd._engine_run_backward
    if not getattr(run, "_tgraph_guard", False):
        _autograd._engine_run_backward = _autograd.graph._engine_run_backward = _guard_inputs(run)
