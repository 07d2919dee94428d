"""tgraph: CUDA graphs for PyTorch training and decoding, without the silent wrong results.

Per-layer graphs (:class:`GraphableModule`, :func:`enable`, :func:`create_graphs`,
:func:`reset_layer_graphs`), whole-step graphs (:class:`FullIterationGraph`,
:class:`OptimizerGraph`) and graph-served decode (:mod:`tgraph.decode`); :func:`reset` drops
every graph of the first two. Creating the graphs reports in one shape, whichever entry
(:class:`CaptureReport`, :class:`MemoryReport`). Importing tgraph has no side effects.

``__all__`` lists what a user calls or catches. ``tgraph.rng`` is the submodule behind
:func:`register_generator` and :func:`unregister_generator`.
"""

from tgraph import decode
from tgraph import rng as rng  # the submodule behind register_generator (not in __all__)
from tgraph.backend import capture_stream
from tgraph.errors import (
    GraphFallbackError,
    GraphFallbackWarning,
    ReplayOrderError,
    StaleBackwardError,
)
from tgraph.guards import CaptureError
from tgraph.layers.create import create_graphs
from tgraph.layers.enable import disable, enable, reset_layer_graphs
from tgraph.layers.manager import (
    GraphableModule,
    capture_report,
    eager_calls,
    memory_report,
)
from tgraph.layers.verify import verification
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
    "eager_calls",
    "enable",
    "memory_report",
    "register_generator",
    "reset",
    "reset_layer_graphs",
    "unregister_generator",
    "verification",
]
__version__ = "0.1.0"


def reset() -> None:
    """Drop every graph tgraph holds: the per-layer graphs and the record
    (:func:`reset_layer_graphs`), and the graphs of every :class:`tgraph.FullIterationGraph`
    and :class:`tgraph.OptimizerGraph` alive (their ``reset()``: the next calls warm up and
    capture anew). Enabled modules run eagerly and record
    again."""
    reset_layer_graphs()
    _step_capture.reset_all()
