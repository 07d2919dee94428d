"""tgraph: CUDA graphs for PyTorch training and decoding, without the silent wrong results.

Per-layer graphs (:class:`GraphableModule`, :func:`enable`, :func:`create_graphs`,
:func:`reset_layer_graphs`), whole-step graphs (:class:`FullIterationGraph`,
:class:`OptimizerGraph`) and graph-served decode (:mod:`tgraph.decode`); :func:`reset` drops
every graph of the first two. Every capture reports in one shape (:class:`CaptureReport`,
:class:`MemoryReport`). Importing tgraph has no side effects.

``__all__`` lists what a user calls or catches. ``tgraph.resolve_backend`` (internal: backends
are chosen by the ``backend=`` arguments) still works for one release, with a
``DeprecationWarning``; use ``tgraph.backend.resolve_backend``. ``tgraph.rng`` is the submodule
behind :func:`register_generator` and :func:`unregister_generator`.
"""

import warnings as _warnings

from tgraph import decode
from tgraph import rng as rng  # the submodule behind register_generator (not in __all__)
from tgraph.backend import capture_stream
from tgraph.errors import GraphFallbackError, ReplayOrderError, StaleBackwardError
from tgraph.guards import CaptureError
from tgraph.layers.create import create_graphs
from tgraph.layers.manager import (
    GraphableModule,
    GraphFallbackWarning,
    capture_report,
    disable,
    enable,
    memory_report,
    reset_layer_graphs,
)
from tgraph.memory import CaptureReport, MemoryReport
from tgraph.rng import register_generator, unregister_generator
from tgraph.step import capture as _step_capture
from tgraph.step.full_iteration import FullIterationGraph
from tgraph.step.optimizer_graph import OptimizerGraph

__all__ = [
    "CaptureError",
    "CaptureReport",
    "capture_report",
    "capture_stream",
    "decode",
    "FullIterationGraph",
    "GraphFallbackError",
    "GraphFallbackWarning",
    "OptimizerGraph",
    "GraphableModule",
    "MemoryReport",
    "ReplayOrderError",
    "StaleBackwardError",
    "create_graphs",
    "disable",
    "enable",
    "memory_report",
    "register_generator",
    "reset",
    "reset_layer_graphs",
    "unregister_generator",
]
__version__ = "0.1.0"


def reset() -> None:
    """Drop every graph tgraph holds: the per-layer graphs and the record
    (:func:`reset_layer_graphs`), and the graphs of every :class:`tgraph.FullIterationGraph`
    and :class:`tgraph.OptimizerGraph` alive (their ``reset()``: learning rates become floats
    again, the next calls warm up and capture anew). Enabled modules run eagerly and record
    again."""
    reset_layer_graphs()
    _step_capture.reset_all()


_DEPRECATED = {"resolve_backend": ("tgraph.backend", "tgraph.backend.resolve_backend")}


def __getattr__(name: str):
    if name in _DEPRECATED:
        module, new = _DEPRECATED[name]
        _warnings.warn(
            f"tgraph.{name} is deprecated (not part of the public API); use {new}",
            DeprecationWarning,
            stacklevel=2,
        )
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'tgraph' has no attribute {name!r}")
