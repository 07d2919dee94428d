"""tgraph: CUDA graphs for PyTorch training and decoding, without the silent wrong results.

Per-layer graphs (:class:`GraphableModule`, :func:`enable`, :func:`create_graphs`, :func:`reset`),
whole-step graphs (:class:`FullIterationGraph`) and graph-served decode (:mod:`tgraph.decode`).
Importing tgraph has no side effects.
"""

from tgraph import decode, rng
from tgraph.backend import capture_stream, resolve_backend
from tgraph.errors import GraphFallbackError, ReplayOrderError, StaleBackwardError
from tgraph.full_iteration import FullIterationGraph
from tgraph.guards import CaptureError
from tgraph.memory import MemoryReport
from tgraph.module import (
    CaptureReport,
    GraphableModule,
    GraphFallbackWarning,
    create_graphs,
    disable,
    enable,
    memory_report,
    reset,
)
from tgraph.nonfinite import ConditionalNodesUnavailable
from tgraph.optimizer_graph import OptimizerGraph
from tgraph.rng import register_generator, unregister_generator

__all__ = [
    "CaptureError",
    "CaptureReport",
    "capture_stream",
    "ConditionalNodesUnavailable",
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
    "rng",
    "reset",
    "resolve_backend",
    "unregister_generator",
]
__version__ = "0.1.0"
