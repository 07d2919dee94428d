"""The shadow verifier: the net under every rule of what a graph baked in.

The rules (:mod:`tgraph.baked`, :mod:`tgraph.python_state`) cover the classes someone thought
of. On selected calls the verifier runs a unit eagerly on copies of its inputs, from the same
generator states as the replay, and compares the outputs with the replay's; the gradients are
compared in that call's backward. Memory: the eager run goes member by member, keeping each
member's inputs and outputs but not its autograd graph; the backward runs each member again, last
first, and compares each gradient as it completes (:func:`_backprop`), so a verified replay adds
about one member's activations and gradients to the step, not the unit's (a member that graphs
its parts, a whole model, runs them checkpointed: :func:`tgraph.layers.capture.parts_checkpointed`).
Selected calls: each graph's first :attr:`Settings.first` replays, the first replay after an
event tgraph sees (a fallback, a re-bind), and one in :attr:`Settings.every` after that.

A mismatch leaves the unit eager for good: the call itself runs eagerly from the generator and
buffer states it started from (so its result is eager's), a :class:`tgraph.GraphFallbackWarning`
names the unit and the largest difference (``strict=True`` raises). A gradient mismatch is found
in the backward, after the forward's result was handed out: that backward hands autograd the
eager gradients instead.

Tolerance: the eager run executes the kernels the graph captured, on the same values, so the two
are bitwise equal in practice; ``4 * eps`` of the output's dtype relative to its largest
magnitude leaves room for a library choosing another reduction order (atomics in a backward, a
cuBLAS heuristic), and is far below what a stale value moves (a frozen dropout mask, a replaced
submodule: differences of the order of the values themselves).

:func:`verification` sets what is verified; ``rules=False`` switches the rules off (a test mode:
the verifier alone must then catch the persistent classes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from collections.abc import Iterator

import torch

from tgraph import rng
from tgraph.baked import hooks_run_outside
from tgraph.emulated import EmulatedGraph
from tgraph.errors import GraphFallbackError, GraphFallbackWarning
from tgraph.layers.capture import graphed_region, parts_checkpointed
from tgraph.layers.direct_grads import unguarded
from tgraph.signature import ambient, split


@dataclasses.dataclass
class Settings:
    first: int = 2  # each graph's first replays, verified
    every: int = 1000  # then one replay in this many (0: none)
    rules: bool = True  # the baked checks and the Python read and write sets


settings = Settings()
logger = logging.getLogger(__name__)


class verification:  # noqa: N801 - used as a function and as a context manager
    """Set what the shadow verifier checks, process-wide; as a context manager, restore the
    previous settings on exit.

    Args:
        first: verify each graph's first ``first`` replays (and the first after an event).
        every: then verify one replay in ``every`` (0: never). The default, 1000, costs well
            under 1% of a step (docs/BENCHMARKS.md).
        rules: False switches off the rules (what a graph baked in, the Python read and write
            sets), leaving the verifier alone: a test mode, never for training.
    """

    def __init__(
        self, first: int | None = None, every: int | None = None, rules: bool | None = None
    ) -> None:
        self._old = dataclasses.replace(settings)
        given = {"first": first, "every": every, "rules": rules}
        vars(settings).update({k: v for k, v in given.items() if v is not None})

    def __enter__(self) -> Settings:
        return settings

    def __exit__(self, *exc) -> None:
        vars(settings).update(vars(self._old))


class Twin:
    """One eager run of a unit, member by member (:func:`_eager_chain`): each member's outputs
    (detached: its autograd graph went with the call), and what a backward needs to run the
    member again for its gradients, one member at a time (:func:`_backprop`)."""

    __slots__ = ("outs_of", "inputs_of", "runs", "rg_of")

    def __init__(self) -> None:
        self.outs_of: list[list] = []  # per member: its slice of the static outputs
        self.inputs_of: list[list] = []  # per member: its inputs as its call found them
        self.runs: list = []  # per member: its call again (:func:`_member`)
        self.rg_of: list[list[bool]] = []  # per member input: requires grad

    @property
    def outs(self) -> list:
        return [t for full in self.outs_of for t in full]


class Pending:
    """A verified replay's eager twin, until its backward compares the gradients."""

    __slots__ = ("twin", "params", "member_params", "strict", "rerun")

    def __init__(self, twin: Twin, params: list, member_params: list, strict: bool, rerun) -> None:
        self.twin, self.params, self.strict = twin, params, strict
        self.member_params = member_params  # per member: its parameters among ``params``
        self.rerun = rerun  # () -> Twin: the eager run made again


def checked_replay(unit, args: tuple, kwargs: dict, tensors: list, replay, module_call):
    """Replay ``unit`` (a runner or merged stack, called at its head with ``args``, ``kwargs``
    and their ``tensors``) through ``replay()``, then run it eagerly from the generator and
    buffer states the replay started from, and compare; returns what ``replay()`` returns, or
    the reason to run this call eagerly (its replay undone)."""
    cap, state = unit.cap, unit.state
    why_not = _not_verifiable(unit)
    if why_not is not None:
        if why_not not in _said:
            _said.add(why_not)
            logger.info("tgraph: %s: replays not verified: %s", cap.name, why_not)
        return replay()
    before = rng.get_states(cap.device)
    modules = [m for r in unit.members for m in r.module.modules()]
    buffers = _buffers_of(modules)
    copies = [t.detach().clone() for t in tensors]  # before a forward writes an input in place
    out = replay()
    if out.__class__ is not list:
        return out
    after = rng.get_states(cap.device)
    # gradients compared unless a backward writes beside autograd (megatron's fused wgrad adds
    # into main_grad: an eager backward would add twice)
    mode = torch.is_grad_enabled()  # of the call: a rerun in its backward runs in it too
    grad = cap.needs_backward and mode
    direct = state.route.direct  # its gradients are compared before it writes them
    params = list(state.route.autograd_params if direct is None else direct.kept)
    grad = grad and not any(hasattr(p, "main_grad") for p in params)
    live = [table[k] for table, k, _ in buffers]

    def run_eager(copies: list) -> Twin:
        """The unit run eagerly on ``copies`` from where the replay started (generators, and
        copies of the buffers as they were), leaving nothing behind."""
        with _as_before(modules, before, buffers, cap.device, after):
            return _eager_chain(unit, tensors, copies, mode, grad, module_call)

    try:
        twin = run_eager(copies)
    except Exception as exc:  # the replay stands; an eager rerun that cannot run verifies nothing
        logger.warning(
            "tgraph: %s: the shadow verifier could not rerun it eagerly: %s", cap.name, exc
        )
        return out
    got = out if len(cap.slices) == 1 else [t for member in state.stack.pending for t in member]
    why = _differs(got, twin.outs, "output")
    if why is None:
        node = next((o.grad_fn for o in out if o.grad_fn is not None), None) if grad else None
        if node is not None:  # its backward compares the gradients (GraphedCall.backward)
            ids = {id(p) for p in params}
            owned = [[p for p in r.module.parameters() if id(p) in ids] for r in unit.members]
            held = {id(p) for ps in owned for p in ps}
            rest = [p for p in params if id(p) not in held]  # no member holds it: any may use it
            node.verify = Pending(
                twin,
                params,
                [ps + rest for ps in owned],
                unit.head.module._tgraph.strict,
                lambda: run_eager([t.detach().clone() for t in twin.inputs_of[0]]),
            )
        return out
    with torch.no_grad():  # undo the replay: this call runs eagerly from where it started
        for b, (_, _, v) in zip(live, buffers):
            b.copy_(v)
    rng.set_states(before, cap.device)
    why = wrong(state, why)
    if len(cap.slices) > 1:
        state.stack.release()
        state.stack.fell_back = why  # its later members say why they run eagerly
    return why


_said: set[str] = set()


def _not_verifiable(unit) -> str | None:
    """Why this call of ``unit`` is not verified (None: it is)."""
    cap = unit.cap
    if cap.fp8 is not None:
        return "TransformerEngine's FP8 state (amax history) would advance twice"
    if torch._C._are_functorch_transforms_active():
        return "a torch.func transform is active"
    if not all(hooks_run_outside(r.module) for r in unit.members):
        return "a backward hook on the module would run for the eager rerun too"
    if cap.device.type == "cuda":  # the warmup's peak: more than the member-by-member rerun needs
        free, _ = torch.cuda.mem_get_info(cap.device)
        free += torch.cuda.memory_reserved(cap.device) - torch.cuda.memory_allocated(cap.device)
        if free < 1.25 * cap.memory.warmup_peak:
            return "too little free GPU memory for an eager rerun beside the graphs"
    return None


def _eager_chain(unit, tensors, copies, mode: bool, grad: bool, module_call) -> Twin:
    """Run every member of ``unit`` eagerly on ``copies`` of the head's inputs, chained as the
    capture chained them, in the call's grad ``mode``. Each member's autograd graph goes as
    soon as the member returns: a verified replay holds one member's activations at a time
    beside the graphs, not a second copy of the unit's (with ``grad``, the backward computes
    the gradients one member at a time again: :func:`_backprop`)."""
    cap = unit.cap
    twin = Twin()
    with graphed_region():
        for j, r in enumerate(unit.members):
            if j:
                prev = twin.outs_of[-1]
                mine = [prev[k] if from_prev else copies[k] for from_prev, k in cap.sources[j]]
                s = cap.slices[j - 1].start
                rg = [
                    mode and (s + k in cap.out_rg if from_prev else tensors[k].requires_grad)
                    for from_prev, k in cap.sources[j]
                ]
            else:
                mine, rg = copies, [mode and t.requires_grad for t in tensors]
            run = _member(cap, j, r, module_call, grad)
            if grad:  # the member's inputs as it found them: it may write one it gets as is in
                # place (one that requires grad it gets as a clone: kept as it is)
                twin.inputs_of.append([x if needs else x.clone() for x, needs in zip(mine, rg)])
                twin.runs.append(run)
                twin.rg_of.append(rg)
            with torch.set_grad_enabled(mode):  # nothing keeps the member's graph past this
                twin.outs_of.append([None if t is None else t.detach() for t in run(mine, rg)])
    return twin


def _member(cap, j: int, r, module_call, grad: bool):
    """Member ``j``'s eager call on its input tensors (those of ``rg`` as leaves that require
    grad; the call gets clones of them, which it may write in place): its outputs padded to its
    slice of the static outputs, with the tensors it stores in module state
    (``self.aux_loss = ...``) at their places. It runs under the autocast regions and SDPA
    selection of the member's call key (:func:`tgraph.signature.ambient`), in a backward too.
    With ``grad``, :func:`_backprop` calls it again: it then starts from the generator states
    and buffers of its first run, and leaves the generators, the module's attributes and its
    buffers as it found them."""
    s, stored = cap.slices[j], cap.stored[j] if cap.stored else ()
    first: list = []  # the generator states and buffers its first run started from
    # the code the graph holds: an emulated capture ran the module's own (under its dispatch
    # mode, where dynamo does not run), a CUDA capture the compiled code of compile=...
    compiled = not isinstance(cap.fwd_graph, EmulatedGraph)

    def run(mine: list, rg: list, leaves: list | None = None) -> list:
        if first:  # again: from where the first run started, leaving nothing behind
            modules = list(r.module.modules())
            with _as_before(modules, *first, cap.device, rng.get_states(cap.device)):
                return call(mine, rg, leaves)
        if grad:
            first.extend((rng.get_states(cap.device), _buffers_of(r.module.modules())))
        return call(mine, rg, leaves)

    def call(mine: list, rg: list, leaves: list | None) -> list:
        given = []
        for x, needs in zip(mine, rg):
            if needs:
                leaf = x.detach().requires_grad_()
                if leaves is not None:
                    leaves.append(leaf)
                x = leaf.clone()
            given.append(x)
        parts = parts_checkpointed() if type(r.module).graphs_parts else contextlib.nullcontext()
        # parts: a whole model's layers' activations recomputed; ambient: the call's autocast
        # and SDPA selection, for a rerun in the backward too (which runs outside the user's
        # blocks)
        with graphed_region(), parts, ambient(r.key.autocast):
            a, kw = r.call_template.fill(given)
            tensors = split(module_call(r.module, compiled)(*a, **kw))[0]
        full = tensors + [None] * (s.stop - s.start - len(tensors))
        for m, k, at in stored:
            full[at] = m.__dict__[k]
        return full

    return run


def _buffers_of(modules) -> list[tuple[dict, str, torch.Tensor]]:
    """``(table, name, copy of its value)`` for every buffer of ``modules``."""
    return [
        (m._buffers, k, b.detach().clone())
        for m in modules
        for k, b in m._buffers.items()
        if b is not None
    ]


@contextlib.contextmanager
def _as_before(modules: list, states: list, buffers: list, device, leave: list) -> Iterator[None]:
    """Run from the generator ``states``, with every buffer of ``buffers`` (from
    :func:`_buffers_of`) a fresh copy of its value; afterwards the buffers are the modules' own
    again, what the run set on the modules goes (a weight a pre-hook computes,
    ``self.aux_loss``) and the generators are at ``leave``."""
    live = [(table, k, table[k]) for table, k, _ in buffers]
    rng.set_states(states, device)
    for table, k, v in buffers:
        table[k] = v.clone()
    dicts = [(vars(m), dict(vars(m))) for m in modules]
    try:
        yield
    finally:
        for d, kept in dicts:
            d.clear()
            d.update(kept)
        for table, k, v in live:
            table[k] = v
        rng.set_states(leave, device)


def _backprop(cap, twins: list[Twin], grads: tuple, member_params: list):
    """The eager gradients of ``twins`` for the node's incoming ``grads``, member by member
    from the last: each member runs again (:func:`_member`) and its gradients flow to the
    previous member's outputs, so that about one member's activations and gradients are alive
    at a time. Yields ``(parameter, [its gradient per twin])`` as each parameter's gradient is
    complete, then ``(None, [[gradients of the head's inputs] per twin])``."""
    last = len(twins[0].outs_of) - 1
    done_at: dict[int, int] = {}  # a parameter's gradient is complete at the first member using it
    for j, ps in enumerate(member_params):
        for p in ps:
            done_at.setdefault(id(p), j)
    n_in = len(twins[0].inputs_of[0])
    acc = [dict() for _ in twins]  # (member, output index) -> gradient from later members
    head = [[None] * n_in for _ in twins]
    pgrads: list[dict] = [dict() for _ in twins]
    for j in range(last, -1, -1):
        s = cap.slices[j]
        ps = member_params[j]
        for t, twin in enumerate(twins):
            incoming = [
                _add(grads[s.start + k], acc[t].pop((j, k), None)) for k in range(s.stop - s.start)
            ]
            if all(g is None for g in incoming):
                continue
            leaves: list = []
            with torch.enable_grad():
                full = twin.runs[j](twin.inputs_of[j], twin.rg_of[j], leaves)
            pairs = [
                (o, g)
                for o, g in zip(full, incoming)
                if g is not None and o is not None and o.requires_grad
            ]
            if not pairs:
                continue
            with unguarded():  # the parameters' own edges: asked as they are
                found = torch.autograd.grad(
                    [o for o, _ in pairs], leaves + ps, [g for _, g in pairs], allow_unused=True
                )
            del full, pairs
            found = iter(found)  # the leaves' gradients, then the parameters'
            for k, needs in enumerate(twin.rg_of[j]):
                if needs:  # to the previous member's output, or the head's input
                    from_prev, kk = cap.sources[j][k] if j else (False, k)
                    g = next(found)
                    if from_prev:
                        acc[t][(j - 1, kk)] = _add(acc[t].get((j - 1, kk)), g)
                    else:
                        head[t][kk] = _add(head[t][kk], g)
            for p, g in zip(ps, found):
                pgrads[t][id(p)] = _add(pgrads[t].get(id(p)), g)
        for p in ps:
            if done_at[id(p)] == j:
                yield p, [pg.pop(id(p), None) for pg in pgrads]
    yield None, head


def _add(a, b):
    return b if a is None else a if b is None else a + b


def _gaps(a: list, b: list) -> list[float]:
    """Per pair, the largest difference between two eager runs (0 where either is None)."""
    return [
        0.0 if x is None or y is None else (x.float() - y.float()).abs().nan_to_num(0).max().item()
        for x, y in zip(a, b)
    ]


def _differs(got: list, want: list, what: str, noise: list | None = None) -> str | None:
    """The largest difference between the replay's ``got`` and eager's ``want`` beyond the
    tolerance (module docstring), in words; None: none. ``noise``: per pair, how far eager
    differs from itself (a backward that is not deterministic): twice that is allowed too."""
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None and what == "output":
            continue
        if g is None or w is None:
            if (g is None) != (w is None) and not _zero(g if w is None else w):
                return f"{what} {i} is None in one run only"
            continue
        if g.shape != w.shape:
            return f"{what} {i} has shape {tuple(g.shape)} where eager gives {tuple(w.shape)}"
        if torch.equal(g, w):
            continue
        if not g.is_floating_point():
            return f"{what} {i} differs from eager's"
        g32, w32 = g.detach().float(), w.detach().float()
        both_nan = g32.isnan() & w32.isnan()
        diff = (g32 - w32).abs().masked_fill(both_nan, 0).nan_to_num(float("inf")).max().item()
        scale = max(1.0, w32.abs().nan_to_num(0).max().item())
        allowed = 4 * torch.finfo(g.dtype).eps * scale + (2 * noise[i] if noise else 0.0)
        if diff > allowed:
            return f"{what} {i} differs from eager's by up to {diff:.3g}"
    return None


def _zero(t) -> bool:
    return t is None or t.numel() == 0 or not bool(t.detach().abs().max())


def check_grads(cap, state, pending: Pending, result: list, grads: tuple) -> list:
    """In the backward of a verified replay: the eager twin's gradients for the same incoming
    ``grads``, member by member (:func:`_backprop`), compared with the replay's ``result``
    (what the node hands autograd: the input gradients, then the parameter gradients) as each
    is complete. Returns what to hand autograd."""
    n = len(cap.static_grads)
    unmatched = len(result) - n != len(pending.params)  # routed otherwise since the forward
    # a parameter with a tensor hook is left out: autograd.grad would run the hook (it may keep
    # or count what it is given), and the node hands autograd the gradient before the hook
    member_params = [
        [] if unmatched else [p for p in ps if _compared(p)] for ps in pending.member_params
    ]
    if all(g is None for g in grads) or not (any(member_params) or any(pending.twin.rg_of[0])):
        return result  # nothing to compare
    at: dict[int, list[int]] = {}  # where result holds a parameter's gradients (one a use)
    for k, p in enumerate(pending.params):
        at.setdefault(id(p), []).append(n + k)
    states = rng.get_states(cap.device)  # an eager backward that draws leaves no trace
    try:
        why = _compare(cap, [pending.twin], grads, member_params, result, at)
        if why is not None:
            # two more eager runs side by side: a backward that is not deterministic (atomics
            # in flash attention's dq, index_add_; one that draws) differs from itself as much
            twins = [pending.rerun(), pending.rerun()]
            why = _compare(cap, twins, grads, member_params, result, at)
        eager = None  # confirmed wrong: eager's gradients in full, to hand autograd
        if why is not None:
            eager = list(_backprop(cap, [pending.rerun()], grads, member_params))
    except Exception as exc:  # as in the forward: the replay stands, unverified
        logger.warning(
            "tgraph: %s: the shadow verifier could not rerun its backward eagerly: %s",
            cap.name,
            exc,
        )
        return result
    finally:
        rng.set_states(states, cap.device)
    if why is None:
        return result
    reason = wrong(state, why)
    if pending.strict:
        raise GraphFallbackError(f"{cap.name}: {reason}")
    warnings.warn(
        f"{cap.name}: {reason}; this backward hands autograd the eager gradients",
        GraphFallbackWarning,
        stacklevel=3,
    )
    fixed = list(result)
    for p, (g, *_) in eager:
        if p is not None:
            first, *more = at[id(p)]
            fixed[first] = g  # autograd (or the direct route) sums a parameter's uses
            for i in more:
                fixed[i] = None
        else:
            for i, needs in enumerate(pending.twin.rg_of[0]):
                if needs:
                    fixed[i] = g[i]
    return fixed


def _compare(cap, twins: list[Twin], grads, member_params, result: list, at: dict) -> str | None:
    """The first gradient of the replay's ``result`` that differs from the first twin's beyond
    the tolerance (and, given two twins, beyond twice what they differ by), in words; None: none.
    Each is compared and freed as :func:`_backprop` completes it."""
    for p, gs in _backprop(cap, twins, grads, member_params):
        if p is not None:
            where = at[id(p)]  # a parameter used twice: the sum of the replay's gradients
            pairs = [(where[0], [functools.reduce(_add, [result[i] for i in where], None)], gs)]
        else:
            pairs = [
                (i, [result[i]], [g[i] for g in gs])
                for i, need in enumerate(twins[0].rg_of[0])
                if need
            ]
        for i, got, gs_i in pairs:
            noise = _gaps(gs_i[:1], gs_i[1:]) if len(gs_i) > 1 else None
            why = _differs(got, gs_i[:1], "gradient", noise=noise)
            if why is not None:
                return why.replace("gradient 0", f"gradient {i}", 1)
    return None


def _compared(p: torch.Tensor) -> bool:
    return p.requires_grad and not p._backward_hooks


def wrong(state, why: str) -> str:
    """The unit of ``state`` replayed other numbers than eager: it runs eagerly from now on."""
    state.wrong = (
        f"the shadow verifier found its replay wrong ({why}): a state the graph baked in "
        "changed in a way no check saw; it runs eagerly from now on"
    )
    return state.wrong
