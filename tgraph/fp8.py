"""TransformerEngine's FP8 state under per-layer graphs.

A graph replays kernels, not Python, and TransformerEngine keeps part of FP8 training in Python:

* ``te.autocast`` is process-wide Python state. A graph must be captured inside the region the
  recorded call ran in (the recipe, ``enabled``/``calibrating``, the amax reduction group), so
  that state is part of the call's key (:class:`FP8Region`, beside torch's autocast) and is
  entered again, in TE's graph mode (``_graph=True``), for the warmup and the capture.
* Delayed scaling moves amax histories and scales at two points of an eager step: when the
  outermost ``te.autocast`` exits (forward scales, TE's Python, still runs around graphed
  layers), and after the backward of the first FP8 module of the region (backward scales, run
  by that module's Python backward, which a replay skips). :class:`FP8Replay` redoes the second
  at replay, and registers the unit's modules in TE's global amax buffers, as TE's own
  ``make_graphed_callables`` does (``transformer_engine/pytorch/graph.py``).
* Weight caching across microbatches (``is_first_microbatch``) is a host flag in eager and a
  device flag under TE's graph mode: the capture sets it from the recorded call's argument
  inside the forward graph (:func:`set_weight_caching`), so each replay sets it again.
* Warmups really run, and move amax histories and scales: :func:`capture_scope` keeps them,
  and TE's own capturing flag, for the time of ``create_graphs()``.

Nothing here imports TransformerEngine: it is looked up in ``sys.modules``, so a process that
never imported it pays one dictionary lookup per graphed call.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch

_QUANT = "transformer_engine.pytorch.quantization"
_GRAPH = "transformer_engine.pytorch.graph"
FIRST_MICROBATCH = "is_first_microbatch"  # TE modules' weight-caching argument


class FP8Region:
    """The ``te.autocast`` region a call ran in: hashable, part of its call key.

    Two regions are equal when their recipes print the same (TE keys its amax buffers the same
    way: a recipe made afresh at every step keeps its graphs), ``enabled`` and ``calibrating``
    match and the amax reduction group is the same object.
    """

    __slots__ = ("enabled", "calibrating", "recipe", "group", "_id")

    def __init__(self, enabled: bool, calibrating: bool, recipe: Any, group: Any) -> None:
        self.enabled, self.calibrating, self.recipe, self.group = (
            enabled,
            calibrating,
            recipe,
            group,
        )
        self._id = (enabled, calibrating, type(recipe), repr(recipe), id(group))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FP8Region) and other._id == self._id

    def __hash__(self) -> int:
        return hash(self._id)

    def __repr__(self) -> str:
        mode = "enabled" if self.enabled else "calibrating"
        group = "" if self.group is None else f", amax_reduction_group={self.group!r}"
        return f"te.autocast({mode}, recipe={self.recipe!r}{group})"

    def capture_context(self) -> contextlib.AbstractContextManager:
        """The region again, in TE's graph mode: modules take their delayed-scaling state from
        the graph wrapper (:class:`FP8Replay`) and read the weight-caching flag on the device."""
        te = sys.modules[_QUANT]
        return te.autocast(
            enabled=self.enabled,
            calibrating=self.calibrating,
            recipe=self.recipe,
            amax_reduction_group=self.group,
            _graph=True,
        )


_regions: dict[tuple, FP8Region] = {}  # one FP8Region per live (recipe, group, flags)


def region() -> FP8Region | None:
    """The active ``te.autocast`` region, or None (TE not imported, or FP8 off)."""
    te = sys.modules.get(_QUANT)
    if te is None:
        return None
    qs = te.FP8GlobalStateManager.quantization_state
    if not (qs.fp8_enabled or qs.fp8_calibration):
        return None
    recipe, group = te.FP8GlobalStateManager.get_fp8_recipe(), qs.fp8_distributed_group
    ident = (qs.fp8_enabled, qs.fp8_calibration, id(recipe), id(group))
    found = _regions.get(ident)
    if found is None or found.recipe is not recipe or found.group is not group:
        if len(_regions) > 64:  # recipes made afresh at every step
            _regions.clear()
        found = _regions[ident] = FP8Region(qs.fp8_enabled, qs.fp8_calibration, recipe, group)
    return found


def _is_te_module(m: torch.nn.Module) -> bool:
    return isinstance(getattr(m, "fp8_meta", None), dict)


def _metas(modules: Iterable[torch.nn.Module]) -> list[dict]:
    """The FP8 metadata dicts of the TE modules (and fused-op basic operations) in ``modules``."""
    metas = []
    for root in modules:
        for m in root.modules():
            if _is_te_module(m):
                metas.append(m.fp8_meta)
            for mode in ("forward", "backward"):  # te.ops basic operations
                meta = getattr(m, "_fp8_metas", None)
                if isinstance(meta, dict) and isinstance(meta.get(mode), dict):
                    metas.append(meta[mode])
    return metas


class FP8Replay:
    """What a replay of a unit captured in an FP8 region redoes of TE's Python.

    Args:
        fp8: the region the unit was captured in.
        modules: the unit's graphed modules.
    """

    __slots__ = ("region", "metas")

    def __init__(self, fp8: FP8Region, modules: list[torch.nn.Module]) -> None:
        self.region = fp8
        # those with delayed-scaling state: the only ones TE's global amax buffers take
        self.metas = tuple(m for m in _metas(modules) if "scaling_fwd" in m or "scaling_bwd" in m)

    def __repr__(self) -> str:
        return f"FP8Replay({self.region!r}, {len(self.metas)} FP8 modules)"

    def before_forward(self) -> bool:
        """Before the forward replay: register the modules' amax and scale tensors in TE's
        global buffers (once per module; TE keeps them there) and take the region's
        first-module flag, as the first module's forward takes it in eager. Returns whether
        this unit holds the region's first FP8 module."""
        te = sys.modules[_QUANT].FP8GlobalStateManager
        if self.region.enabled:
            registered = te.get_buffer_info()  # the key TE marks a registered module with
            for meta in self.metas:
                if registered not in meta:  # TE would return at once: skip its Python call
                    meta["fp8_group"] = self.region.group
                    meta["recipe"] = self.region.recipe
                    te.add_fp8_tensors_to_global_buffer(meta)
        return te.is_first_fp8_module()

    def after_backward(self) -> None:
        """After the backward replay of the unit holding the region's first FP8 module: the
        backward amax reduction and scale update that module's backward runs in eager."""
        sys.modules[_QUANT].FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)


def first_microbatch(kwargs: dict) -> bool | None:
    """The call's ``is_first_microbatch`` argument when it is a bool, else None."""
    flag = kwargs.get(FIRST_MICROBATCH)
    return flag if isinstance(flag, bool) else None


def set_weight_caching(first: bool | None) -> None:
    """Set TE's device flag for weight caching from a call's ``is_first_microbatch``.

    Under TE's graph mode every FP8 module reads the process-wide flag, whether or not its
    call passed ``is_first_microbatch``; a call without it must cast its weights, as in eager,
    so the flag is cleared (a graph of a later microbatch elsewhere leaves it set: its weights
    would then stay the warmup's forever)."""
    sys.modules[_QUANT].FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(
        False if first is None else not first
    )


@contextlib.contextmanager
def capture_scope(modules: Iterable[torch.nn.Module]) -> Iterator[None]:
    """For ``create_graphs()``: TE's capturing flag on (no amax reduction runs in a warmup's or
    a capture's backward), and every FP8 scale, amax history and TE's autocast state as they
    were before, afterwards (warmups really run, and write them)."""
    graph, te = sys.modules.get(_GRAPH), sys.modules.get(_QUANT)
    if graph is None or te is None:
        yield
        return
    manager = te.FP8GlobalStateManager
    saved = []
    for meta in _metas(modules):
        for key in ("scaling_fwd", "scaling_bwd"):
            state = meta.get(key)
            if state is not None and hasattr(state, "amax_history"):
                saved.append((state.scale, state.scale.clone()))
                saved.append((state.amax_history, state.amax_history.clone()))
    autocast = manager.get_autocast_state()
    if manager.get_skip_fp8_weight_update_tensor() is None and torch.cuda.is_available():
        manager.set_skip_fp8_weight_update_tensor(False)  # made here, not inside a capture
    skip = manager.get_skip_fp8_weight_update_tensor()
    skip_value = None if skip is None else skip.clone()
    graph.set_capture_start()
    try:
        yield
    finally:
        graph.set_capture_end()
        manager.set_autocast_state(autocast)
        with torch.no_grad():
            for dst, src in saved:
                dst.copy_(src)
            if skip_value is not None:
                skip.copy_(skip_value)
