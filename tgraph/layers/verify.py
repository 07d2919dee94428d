"""The shadow verifier: the net under every rule of what a graph baked in.

The rules (:mod:`tgraph.baked`, :mod:`tgraph.python_state`) cover the classes someone thought
of. On selected calls the verifier runs a unit eagerly on copies of its inputs, from the same
generator states as the replay, and compares the outputs with the replay's; the gradients are
compared in that call's backward. Selected calls: each graph's first :attr:`Settings.first`
replays, the first replay after an event tgraph sees (a fallback, a re-bind), and one in
:attr:`Settings.every` after that.

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

import dataclasses
import logging
import warnings

import torch

from tgraph import rng
from tgraph.baked import hooks_run_outside
from tgraph.errors import GraphFallbackError, GraphFallbackWarning
from tgraph.layers.capture import graphed_region
from tgraph.signature import split


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


class Pending:
    """A verified replay's eager twin, until its backward compares the gradients."""

    __slots__ = ("outs", "inputs", "params", "strict", "rerun")

    def __init__(self, outs: list, inputs: list, params: list, strict: bool, rerun) -> None:
        self.outs, self.inputs, self.params, self.strict = outs, inputs, params, strict
        self.rerun = rerun  # () -> (inputs, outputs): the eager run made again


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
    buffers = [
        (m._buffers, k) for r in unit.members for m in r.module.modules() for k in m._buffers
    ]
    buffers = [(table, k) for table, k in buffers if table[k] is not None]
    saved = [table[k].detach().clone() for table, k in buffers]
    copies = [t.detach().clone() for t in tensors]  # before a forward writes an input in place
    out = replay()
    if out.__class__ is not list:
        return out
    after = rng.get_states(cap.device)
    # gradients compared unless a backward writes beside autograd (megatron's fused wgrad adds
    # into main_grad: an eager backward would add twice)
    grad = cap.needs_backward and torch.is_grad_enabled()
    grad = grad and not any(hasattr(p, "main_grad") for p in state.route.autograd_params)
    live = [table[k] for table, k in buffers]

    def run_eager(copies: list) -> tuple[list, list]:
        """The unit run eagerly on ``copies`` from where the replay started (generators, and
        copies of the buffers as they were), leaving nothing behind."""
        rng.set_states(before, cap.device)
        for (table, k), v in zip(buffers, saved):
            table[k] = v.clone()
        dicts = [(vars(m), dict(vars(m))) for r in unit.members for m in r.module.modules()]
        try:
            return _eager_chain(unit, args, kwargs, tensors, copies, grad, module_call)
        finally:  # what the eager run set (a weight a pre-hook computes, self.aux_loss) goes
            for d, kept in dicts:
                d.clear()
                d.update(kept)
            for (table, k), b in zip(buffers, live):
                table[k] = b
            rng.set_states(after, cap.device)

    try:
        ins, eager = run_eager(copies)
    except Exception as exc:  # the replay stands; an eager rerun that cannot run verifies nothing
        logger.warning(
            "tgraph: %s: the shadow verifier could not rerun it eagerly: %s", cap.name, exc
        )
        return out
    got = out if len(cap.slices) == 1 else [t for member in state.stack.pending for t in member]
    why = _differs(got, eager, "output")
    if why is None:
        node = next((o.grad_fn for o in out if o.grad_fn is not None), None) if grad else None
        if node is not None:  # its backward compares the gradients (GraphedCall.backward)
            node.verify = Pending(
                eager,
                ins,
                list(state.route.autograd_params),
                unit.head.module._tgraph.strict,
                lambda: run_eager([t.detach().clone() for t in ins]),
            )
        return out
    with torch.no_grad():  # undo the replay: this call runs eagerly from where it started
        for b, v in zip(live, saved):
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
    if cap.device.type == "cuda":  # the eager rerun needs about the warmup's peak again
        free, _ = torch.cuda.mem_get_info(cap.device)
        free += torch.cuda.memory_reserved(cap.device) - torch.cuda.memory_allocated(cap.device)
        if free < 1.25 * cap.memory.warmup_peak:
            return "too little free GPU memory for an eager rerun beside the graphs"
    return None


def _eager_chain(unit, args, kwargs, tensors, copies, grad: bool, module_call):
    """Run every member of ``unit`` eagerly on copies of the head's inputs, chained as the
    capture chained them; returns the copies and the outputs in the order of the graph's static
    outputs (each member's, then the tensors it stored in module state; None where it stored
    none)."""
    cap = unit.cap
    ins = [c.requires_grad_(t.requires_grad and grad) for t, c in zip(tensors, copies)]
    outs_of: list[list] = []
    with torch.set_grad_enabled(grad), graphed_region():
        # the forward gets non-leaf copies, as its caller's tensors are: it may write them in
        # place (x += ...), which autograd refuses on a leaf that requires grad
        given = [x.clone() if x.requires_grad else x for x in ins]
        for j, r in enumerate(unit.members):
            mine = (
                [outs_of[-1][k] if prev else given[k] for prev, k in cap.sources[j]] if j else given
            )
            a, kw = r.call_template.fill(mine)
            tensors = split(module_call(r.module)(*a, **kw))[0]
            s = cap.slices[j]
            full = tensors + [None] * (s.stop - s.start - len(tensors))
            for m, k, at in cap.stored[j] if cap.stored else ():  # self.aux_loss = ...
                full[at] = m.__dict__[k]
            outs_of.append(full)
    return ins, [t for full in outs_of for t in full]


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
    ``grads``, compared with the replay's ``result`` (what the node hands autograd: the input
    gradients, then the parameter gradients). Returns what to hand autograd."""
    rg = [i for i in cap.out_rg if grads[i] is not None and pending.outs[i] is not None]
    n = len(cap.static_grads)
    direct = state.route.direct is not None or len(result) - n != len(pending.params)
    # a parameter with a tensor hook is left out: autograd.grad would run the hook (it may keep
    # or count what it is given), and the node hands autograd the gradient before the hook
    params = [] if direct else [p for p in pending.params if _compared(p)]
    if not rg or (not params and not any(t.requires_grad for t in pending.inputs)):
        return result  # nothing to compare (direct_grads writes .grad itself)
    states = rng.get_states(cap.device)  # an eager backward that draws leaves no trace

    def eager_grads(ins: list, outs: list) -> list:
        need = [t for t in ins if t.requires_grad]
        incoming = [grads[i] for i in rg]
        return list(
            torch.autograd.grad([outs[i] for i in rg], need + params, incoming, allow_unused=True)
        )

    eager = eager_grads(pending.inputs, pending.outs)
    got = [result[i] for i, t in enumerate(pending.inputs) if t.requires_grad]
    if not direct:
        got += [g for g, p in zip(result[n:], pending.params) if _compared(p)]
    why = _differs(got, eager, "gradient")
    if why is not None:  # eager against itself, run again: a
        again = eager_grads(*pending.rerun())  # backward that is not deterministic (atomics in
        why = _differs(got, eager, "gradient", noise=_gaps(eager, again))  # flash attention's
    rng.set_states(states, cap.device)  # dq, index_add_; one that draws) differs as much
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
    fixed, it = list(result), iter(eager)
    for i, t in enumerate(pending.inputs):
        if t.requires_grad:
            fixed[i] = next(it)
    for k, p in enumerate(pending.params if not direct else ()):
        if _compared(p):
            fixed[n + k] = next(it)
    return fixed


def _compared(p: torch.Tensor) -> bool:
    return p.requires_grad and not p._backward_hooks


def wrong(state, why: str) -> str:
    """The unit of ``state`` replayed other numbers than eager: it runs eagerly from now on."""
    state.wrong = (
        f"the shadow verifier found its replay wrong ({why}): a state the graph baked in "
        "changed in a way no check saw; it runs eagerly from now on"
    )
    return state.wrong
