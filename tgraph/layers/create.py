"""``create_graphs``: create the graphs of the recorded iteration: capture each, in the record's
order, into one pool per backend and device, then bake each unit's capture result (with the
baked inventory, what its graphs baked in). A unit that
cannot be captured stays eager, named; the others keep their graphs."""

from __future__ import annotations

import logging
import time
import warnings

import torch
import torch.nn as nn

from tgraph import fp8, memory
from tgraph.backend import GraphFactory, resolve_backend
from tgraph.baked import describe_hooks, memory_uses
from tgraph.errors import GraphFallbackWarning
from tgraph.guards import CaptureError, explain_capture_failure
from tgraph.layers import direct_grads, verify
from tgraph.layers.captured import InFlight
from tgraph.layers.enable import reset_layer_graphs
from tgraph.layers.manager import _Manager, _manager
from tgraph.layers.record import Turns
from tgraph.layers.runner import Runner, named
from tgraph.layers.segment import Segment, mergeable_chains
from tgraph.memory import CaptureReport
from tgraph.python_state import PythonState
from tgraph.snapshot import Snapshot

logger = logging.getLogger("tgraph.layers.manager")  # one logger for the per-layer life cycle


def create_graphs() -> CaptureReport:
    """Create the graphs: warm up and capture every recorded runner's forward, then backward
    graph, in recorded order, then bake each unit's capture result.

    A unit that cannot be graphed (its capture fails: a host sync such as ``.item()``, a CPU
    tensor copied to the GPU, a data-dependent shape; hooks on its submodules that
    ``enable(capturable_hooks=True)`` did not declare; or the recorded iteration backed
    through one of its forwards twice, ``retain_graph=True``) stays eager: the report's
    ``eager_modules`` names it with the reason and a :class:`tgraph.GraphFallbackWarning`
    says so once; every other unit is graphed. A merged stack with such a member is split,
    so that its other members are graphed one by one. Neighbours between whose calls eager code
    made autograd nodes are not merged (the report's ``unmerged`` names them).

    Returns:
        A :class:`CaptureReport` (also logged at INFO).

    Raises:
        RuntimeError: nothing was recorded, graphs already exist, or a forward is still
            awaiting its backward.
        tgraph.CaptureError: a unit of a module enabled with ``strict=True`` cannot be
            graphed; every graph is dropped, the state of the model (RNG, ``main_grad``,
            buffers) is restored and the modules keep running eagerly.
    """
    m = _manager
    runners = _recorded_runners(m)
    direct_grads.observe_backwards(None)  # the recorded iteration is over
    start = time.perf_counter()
    # before the capture takes aliases: the uses of the parameters' memory that are not tgraph's
    uses_before = memory_uses(m.modules)
    factory_of = _factories(runners)
    factories = list(dict.fromkeys(factory_of.values()))
    params = {id(p): p for root in m.roots for p in root.parameters()}
    grads_alive = memory.tensor_bytes(p.grad for p in params.values())
    buffers = {id(b): b for mod in m.modules for b in nn.Module.buffers(mod)}
    snaps = [Snapshot(params.values(), buffers.values(), f.device) for f in factories]
    before = sum(f.memory_allocated() for f in factories)
    for f in factories:
        f.synchronize()
    try:
        eager = _undeclared_hooks(runners)  # runner -> why it stays eager
        eager.update(_refused(runners, eager))
        unmerged: list[str] = []
        chains = mergeable_chains(m.record.events, unmerged)
        m.segments = [Segment(c) for c in _without(chains, eager)]
        alone = _alone(runners, eager)
        eager.update(alone)
        for seg in m.segments:
            seg.debug = seg.head.debug
        with fp8.capture_scope(list(m.roots) + list(m.modules)):
            _capture_in_recorded_order(m.record.events, runners, factory_of, eager)
        parts_unused = _inside_graphed_whole(runners, eager)
        for r in parts_unused:  # recorded for a fallback that is not needed
            eager.pop(r, None)
            alone.pop(r, None)
            r.left_eager = f"it was recorded inside {r.within}, which is graphed whole"
            r.draft.call.samples = []
        runners = [r for r in runners if r not in parts_unused]
        _by_parts(runners, eager, alone)
    except BaseException:
        for f in factories:
            f.synchronize()
        reset_layer_graphs()  # modules run (and record) eagerly again; create_graphs() may be retried
        raise
    finally:
        for s in snaps:
            s.restore()
    for f in factories:
        f.synchronize()
    m.segments = [seg for seg in m.segments if seg.head.segment is seg and seg.head in runners]
    units = list(dict.fromkeys(r.segment or r for r in runners if r not in eager))
    _bake(units, uses_before, {u: m.record.reached_elsewhere(u.members) for u in units})
    m.captured, m.units = True, units
    for mod in m.modules:
        st = mod._tgraph
        st.turns = {k: t for k, rs in st.runners.items() if (t := Turns.of(m.record.events, rs))}
    m.record.clear()
    called = {id(r.module) for r in runners}
    inside = {id(s) for r in runners for s in r.module.modules() if s is not r.module}
    caps = [u.cap for u in units]
    m.report = CaptureReport(
        graphs=sum(1 + (c.bwd_graph is not None) for c in caps),
        runners=len(runners) - len(eager),
        segments=len(m.segments),
        seconds=time.perf_counter() - start,
        pool_bytes=sum(f.memory_allocated() for f in factories) - before,
        backends=sorted({f.backend for f in factories}),
        eager_modules=[
            f"{type(mod).__name__} (not called in the recorded iteration)"
            for mod in m.modules
            if id(mod) not in called and id(mod) not in inside  # inside: in the outer graph
        ]
        + _leave_eager(m, {r: why for r, why in eager.items() if r not in alone})
        + _left_plain(alone),
        memory=memory.memory_report(caps, grads_at_capture=grads_alive),
        unmerged=unmerged,
    )
    logger.info("%s", m.report)
    return m.report


def _recorded_runners(m: _Manager) -> list[Runner]:
    """The recorded iteration's runners, in first-call order, or the error that says why
    there is nothing to capture yet."""
    if m.captured:
        raise RuntimeError("graphs already exist; call tgraph.reset() before create_graphs() again")
    if not m.record.events and m.eager_calls:
        reasons = sorted({r for mod in m.modules for r in mod._tgraph.warned})
        raise RuntimeError(
            f"nothing recorded: all {m.eager_calls} calls of graphed modules since "
            "tgraph.enable (or tgraph.reset) ran eagerly instead"
            + (f" ({reasons[0]})" if reasons else "")
            + ". Make those calls graphable (the GraphFallbackWarning says why each fell back), "
            "run one iteration again, then call tgraph.create_graphs()"
        )
    if not m.record.events:
        raise RuntimeError(
            "nothing recorded: call tgraph.enable(model), run one training iteration (forward "
            "and backward) eagerly, then call tgraph.create_graphs()"
        )
    runners = list(dict.fromkeys(r for r, _ in m.record.events))
    waiting = [
        r for r in runners if r.state.inflight.token is not None and not r.state.inflight.held
    ]
    if waiting:
        raise RuntimeError(
            f"create_graphs() was called while a graphed forward ({waiting[0]}) still awaits its "
            "backward: the recorded iteration's backward never reached it. A backward restricted "
            "to some tensors (loss.backward(inputs=[...]), torch.autograd.grad(loss, [...])) "
            "runs no backward of the graphed modules it does not need, and an output still held "
            "from a forward with grad enabled that was never backed through waits too. Run "
            "another iteration whose backward reaches every graphed forward (a plain "
            "loss.backward(), or inputs that include the graphed modules' parameters), then call "
            "create_graphs() between iterations, after every backward of the recorded one"
        )
    for r in runners:  # recorded no-grad outputs that are still alive are eager tensors:
        r.state.inflight = InFlight()  # capturing cannot touch them
    return runners


def _factories(runners: list[Runner]) -> dict[Runner, GraphFactory]:
    """One graph factory (backend and pool) per backend and device, by runner."""
    factories: dict[tuple[str, torch.device], GraphFactory] = {}
    of: dict[Runner, GraphFactory] = {}
    for r in runners:
        st = r.module._tgraph
        k = (resolve_backend(st.backend, r.device), r.device)
        if k not in factories:
            factories[k] = GraphFactory(*k)
        of[r] = factories[k]
        r.debug = st.debug
    return of


def _capture_in_recorded_order(
    events, runners: list[Runner], factory_of: dict, eager: dict[Runner, str]
) -> None:
    """Each unit's forward graph at its first recorded forward, its backward graph at its
    first recorded backward (then those whose backward never ran), all into one pool. A unit
    whose capture fails joins ``eager`` (:func:`_capture`)."""
    for r, phase in events:
        if r in eager or _graphed_whole_around(r, eager):
            continue
        unit = r.segment or r
        f = factory_of[r]
        d = unit.draft
        if phase == "fwd" and d.fwd_graph is None and r.seg_index == 0:
            _capture(unit, "fwd", f, runners, eager)
        elif (
            phase == "bwd" and d.fwd_graph is not None and d.needs_backward and d.bwd_graph is None
        ):
            _capture(unit, "bwd", f, runners, eager)
    for unit in dict.fromkeys(
        r.segment or r for r in runners if r not in eager and not _graphed_whole_around(r, eager)
    ):
        d = unit.draft
        if d.fwd_graph is not None and d.needs_backward and d.bwd_graph is None:  # never ran
            _capture(unit, "bwd", factory_of[unit.head], runners, eager)


def _capture(unit, phase: str, f: GraphFactory, runners: list[Runner], eager: dict) -> None:
    """Capture ``unit``'s forward or backward graph. A merged stack whose forward fails is
    split: its members are captured one by one instead. Any other unit that fails raises
    where a member was enabled with ``strict=True``; otherwise it stays eager (``eager`` names
    each member with the reason), having dropped every graph and buffer of its own.

    Nothing of a failed capture stays in the pool's order: its graphs never replay and never
    enter the pool's ledger; a CUDA capture that raised was ended (:class:`CudaGraph`) and the
    device is synchronized before the next capture, so a failure surfaces here, not later.
    """
    # the capture drops the recorded samples; a split needs them
    samples = [r.draft.call.samples for r in unit.members]
    try:
        if phase == "fwd":
            written = PythonState(unit.labelled_modules()) if verify.settings.rules else None
            try:
                unit.capture_forward(f, f.warmup_steps(unit.head.module._tgraph.warmup))
            finally:  # warmup and capture ran the forward's Python more often than eager
                why = written.changes() if written is not None else None
                if written is not None:
                    written.restore()
            if why is not None:
                raise CaptureError(
                    f"its forward writes Python state at every call: {why}. A graph runs no "
                    "Python, so that state would stop changing at capture; the module stays "
                    "eager (name an attribute the forward never reads in unread_attributes)"
                )
        else:
            unit.capture_backward(f)
        return
    except Exception as exc:
        for r, kept in zip(unit.members, samples):
            r.draft.call.samples = kept
        error = explain_capture_failure(f"{unit}", exc)
        split = phase == "fwd" and len(unit.members) > 1  # to find the member that failed
        if not split and any(r.module._tgraph.strict for r in unit.members):
            raise error from exc
        try:
            f.synchronize()
        except Exception:
            raise error from exc  # the device is unusable: nothing can be graphed after this
        reason = str(error)
    members = list(unit.members)
    outputs = {t.untyped_storage().data_ptr() for t in unit.draft.static_outputs}
    unit.drop_graphs()  # a merged stack's drop also releases its members (segment.py)
    for r in members:
        r.seg_index = 0
    if split:
        for r in members:  # in recorded order: each one's forward graph where the stack's was
            _capture(r, "fwd", f, runners, eager)
        return
    for r in members:
        eager[r] = reason
    for r in runners:  # units reading its static outputs as their static inputs copy instead
        d = r.draft
        for i, t in enumerate(d.static_inputs):
            if d.shared_inputs[i] and t.untyped_storage().data_ptr() in outputs:
                d.shared_inputs[i] = False


def _graphed_whole_around(r: Runner, eager: dict[Runner, str]) -> bool:
    """Whether ``r`` was recorded inside a unit (``GraphableModule.graphs_parts``) that is
    graphed whole, or not yet known to fall back (its forward event comes first), so that ``r``
    runs inside that unit's graphs: not captured."""
    o = r.within
    while o is not None:
        if o not in eager:
            return True
        o = o.within
    return False


def _inside_graphed_whole(runners: list[Runner], eager: dict[Runner, str]) -> list[Runner]:
    """The runners recorded inside units graphed whole (none of their own graphs), and those
    whose unit fell back but whose forward was captured before its backward failed."""
    return [
        r
        for r in runners
        if _graphed_whole_around(r, eager)
        or (r.within is not None and r not in eager and (r.segment or r).draft.fwd_graph is None)
    ]


def _by_parts(runners: list[Runner], eager: dict[Runner, str], plain: dict[Runner, str]) -> None:
    """Units that could not be captured whole and whose recorded parts were all captured (or
    left to plain calls, ``plain``: a final norm graphed only merged, found alone): their
    calls run their own code plainly around the parts' replays (:attr:`Runner.by_parts`)."""
    parts: dict[Runner, list[Runner]] = {}
    for r in runners:
        if r.within is not None:
            parts.setdefault(r.within, []).append(r)
    for o, inner in parts.items():
        graphed = [r for r in inner if r not in eager]
        if o in eager and graphed and all(r in plain for r in inner if r in eager):
            o.by_parts = True
            eager[o] = f"{eager[o]}; the graphed modules inside it keep their own graphs"


def _bake(units: list, uses_before: dict[int, int], shared: dict) -> None:
    """Each unit's frozen capture result, once every graph of the pool exists; each learns which
    tensors on its static buffers are tgraph's own (the others are held by the caller), and
    which uses of its parameters' memory (``uses_before``: :func:`tgraph.baked.memory_uses`
    before the capture). ``shared``: per unit, its parameters that the recorded backward also
    reached elsewhere (:meth:`tgraph.layers.record.Record.reached_elsewhere`)."""
    internal: dict[int, list[torch.Tensor]] = {}
    for u in units:
        ins = (x for r in u.members for x in r.draft.static_inputs)
        for t in [*u.draft.static_outputs, *ins]:
            internal.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    for u in units:
        u.bake(internal, shared[u])
    for u in units:
        u.count_uses(uses_before)


def _undeclared_hooks(runners: list[Runner]) -> dict[Runner, str]:
    """Runners whose modules carry hooks a graph would bake in (they would run during warmup
    and capture and never again) that ``capturable_hooks=True`` did not declare: the reason
    each stays eager. Under ``strict=True``, the error instead."""
    found: dict[Runner, str] = {}
    for r in runners:
        if r.module._tgraph.capturable_hooks:
            continue
        hooks = describe_hooks(r.labelled_modules(), r.roots())
        if not hooks:
            continue
        why = (
            f"graphed module {type(r.module).__name__} has hooks: {'; '.join(hooks)}. A "
            "graph replays kernels, not Python: these hooks would run during warmup and "
            "capture and never again. Remove them before tgraph.create_graphs() (register "
            "them on a module outside the graphed ones), or, if they are pure tensor code "
            "whose effect belongs in the graph (e.g. old-style weight_norm), pass "
            "capturable_hooks=True to tgraph.enable."
        )
        if r.module._tgraph.strict:
            raise CaptureError(why)
        found[r] = why
    return found


def _refused(runners: list[Runner], eager: dict[Runner, str]) -> dict[Runner, str]:
    """Runners whose recorded call showed they cannot be graphed (a forward returning tensors
    inside an object a replay cannot refill, a forward backed through twice): the reason each
    stays eager; under
    ``strict=True``, the error instead."""
    found = {r: r.refused for r in runners if r.refused is not None and r not in eager}
    for r, why in found.items():
        if r.module._tgraph.strict:
            raise CaptureError(f"{r}: {why}")
    return found


def _without(chains: list[list[Runner]], eager: dict[Runner, str]) -> list[list[Runner]]:
    """The mergeable chains split around the runners that stay eager (2 or more runners)."""
    out: list[list[Runner]] = []
    for chain in chains:
        part: list[Runner] = []
        for r in [*chain, None]:
            if r is not None and r not in eager:
                part.append(r)
                continue
            if len(part) > 1:
                out.append(part)
            part = []
    return out


def _alone(runners: list[Runner], eager: dict[Runner, str]) -> dict[Runner, str]:
    """Runners of modules that are graphed only merged (``graphed_alone=False``) and whose every
    recorded runner is in no merged stack: why each is left to plain calls."""
    by_module: dict[int, list[Runner]] = {}
    for r in runners:
        if not type(r.module).graphed_alone:
            by_module.setdefault(id(r.module), []).append(r)
    return {
        r: "graphed only merged with the modules called around it, and called alone"
        for rs in by_module.values()
        if all(r.segment is None and r not in eager for r in rs)
        for r in rs
    }


def _left_plain(alone: dict[Runner, str]) -> list[str]:
    """Make ``alone``'s modules run plainly (:func:`_alone`), quietly; the report's entries."""
    for r in alone:
        r.module._tgraph.plain = True
        r.draft.call.samples = []
    return list(dict.fromkeys(f"{named(r.module)} ({why})" for r, why in alone.items()))


def _leave_eager(m: _Manager, eager: dict[Runner, str]) -> list[str]:
    """Make the calls of ``eager``'s runners run eagerly, without a warning per call: one
    warning per reason here, naming each module it keeps eager. Returns the report's
    entries."""
    names = {id(mod): name for root in m.roots for name, mod in root.named_modules() if name}
    entries: list[str] = []
    for reason in dict.fromkeys(eager.values()):
        members = [r for r, why in eager.items() if why == reason]
        labels = list(
            dict.fromkeys(
                f"{names[id(r.module)]} ({type(r.module).__name__})"
                if id(r.module) in names
                else type(r.module).__name__
                for r in members
            )
        )
        for r in members:
            r.left_eager = f"it runs eagerly: create_graphs() could not graph it ({reason})"
            r.module._tgraph.warned.add(r.left_eager)
            r.draft.call.samples = []  # kept for a capture that will not come
        warnings.warn(
            f"tgraph.create_graphs(): {', '.join(labels)} cannot be graphed and "
            f"run{'s' if len(labels) == 1 else ''} eagerly (the others keep their graphs). "
            f"{reason} (strict=True raises this instead)",
            GraphFallbackWarning,
            stacklevel=3,
        )
        entries += [f"{label} ({reason})" for label in labels]
    return entries
