"""``create_graphs``: capture every graph of the recorded iteration, in its order, into one pool
per backend and device, then freeze each unit's record (what its graphs baked in)."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn as nn

from tgraph import fp8, memory
from tgraph.backend import GraphFactory, resolve_backend
from tgraph.baked import describe_hooks
from tgraph.guards import CaptureError, explain_capture_failure
from tgraph.layers.manager import _Manager, _manager, reset_layer_graphs
from tgraph.layers.runner import Runner
from tgraph.layers.segment import Segment, mergeable_chains
from tgraph.memory import CaptureReport
from tgraph.snapshot import Snapshot

logger = logging.getLogger("tgraph.layers.manager")  # one logger for the per-layer life cycle


def create_graphs() -> CaptureReport:
    """Capture every recorded runner's forward, then backward graph, in recorded order.

    Returns:
        A :class:`CaptureReport` (also logged at INFO).

    Raises:
        RuntimeError: nothing was recorded, graphs already exist, or a forward is still
            awaiting its backward.
        tgraph.CaptureError: a capture failed; every graph is dropped, the state of the model
            (RNG, ``main_grad``, buffers) is restored and the modules keep running eagerly.
    """
    m = _manager
    runners = _recorded_runners(m)
    start = time.perf_counter()
    factory_of = _factories(runners)
    factories = list(dict.fromkeys(factory_of.values()))
    params = {id(p): p for root in m.roots for p in root.parameters()}
    grads_alive = memory.tensor_bytes(p.grad for p in params.values())
    buffers = {id(b): b for mod in m.modules for b in nn.Module.buffers(mod)}
    snaps = [Snapshot(params.values(), buffers.values(), f.device) for f in factories]
    before = sum(f.memory_allocated() for f in factories)
    for f in factories:
        f.synchronize()
    m.segments = [Segment(chain) for chain in mergeable_chains(m.record.events)]
    for seg in m.segments:
        seg.debug = seg.head.debug
    units = list(dict.fromkeys(r.segment or r for r in runners))
    _refuse_hooks(units)
    try:
        with fp8.capture_scope(list(m.roots) + list(m.modules)):
            _capture_in_recorded_order(m.record.events, units, factory_of)
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
    _bake(units)
    m.captured, m.units = True, units
    m.record.clear()
    called = {id(r.module) for r in runners}
    records = [u.cap for u in units]
    m.report = CaptureReport(
        graphs=sum(1 + (c.bwd_graph is not None) for c in records),
        runners=len(runners),
        segments=len(m.segments),
        seconds=time.perf_counter() - start,
        pool_bytes=sum(f.memory_allocated() for f in factories) - before,
        backends=sorted({f.backend for f in factories}),
        eager_modules=[
            f"{type(mod).__name__} (not called in the recorded iteration)"
            for mod in m.modules
            if id(mod) not in called
        ],
        memory=memory.memory_report(records, grads_at_capture=grads_alive),
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
    waiting = [r for r in runners if r.state.flight is not None and not r.state.held]
    if waiting:
        raise RuntimeError(
            f"create_graphs() was called while a graphed forward ({waiting[0]}) still awaits its "
            "backward; call it between iterations, after every backward of the recorded one"
        )
    for r in runners:  # recorded no-grad outputs that are still alive are eager tensors:
        r.state.flight, r.state.held = None, False  # capturing cannot touch them
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


def _capture_in_recorded_order(events, units: list, factory_of: dict) -> None:
    """Each unit's forward graph at its first recorded forward, its backward graph at its
    first recorded backward (then those whose backward never ran), all into one pool."""
    current = None
    try:
        for r, phase in events:
            current = r.segment or r
            f = factory_of[r]
            if phase == "fwd" and current.fwd_graph is None and r.seg_index == 0:
                current.capture_forward(f, f.warmup_steps(r.module._tgraph.warmup))
            elif (
                phase == "bwd"
                and current.fwd_graph is not None
                and current.needs_backward
                and current.bwd_graph is None
            ):
                current.capture_backward(f)
        for current in units:  # forwards whose backward never ran in the recorded iteration
            if current.needs_backward and current.bwd_graph is None:
                current.capture_backward(factory_of[current.head])
    except BaseException as exc:
        raise explain_capture_failure(f"{current}", exc) from exc


def _bake(units: list) -> None:
    """Each unit's frozen record, once every graph of the pool exists; each learns which
    tensors on its static buffers are tgraph's own (the others are held by the caller)."""
    internal: dict[int, list[torch.Tensor]] = {}
    for u in units:
        for t in [*u.static_outputs, *(x for r in u.members for x in r.static_inputs)]:
            internal.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    for u in units:
        u.bake(internal)


def _refuse_hooks(units: list) -> None:
    """A hook on a graphed module would run during warmup and capture and never at replay."""
    for u in units:
        if all(r.module._tgraph.capturable_hooks for r in u.members):
            continue
        found = describe_hooks(u.labelled_modules(), u.roots())
        if found:
            raise CaptureError(
                f"graphed module {type(u.head.module).__name__} has hooks: {'; '.join(found)}. A "
                "graph replays kernels, not Python: these hooks would run during warmup and "
                "capture and never again. Remove them before tgraph.create_graphs() (register "
                "them on a module outside the graphed ones), or, if they are pure tensor code "
                "whose effect belongs in the graph (e.g. old-style weight_norm), pass "
                "capturable_hooks=True to tgraph.enable."
            )
