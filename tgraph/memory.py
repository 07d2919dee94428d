"""Where graphs' memory goes, by kind, and what a capture made (:class:`CaptureReport`).

Every entry reports in one shape: :func:`tgraph.create_graphs` (per-layer graphs),
:meth:`tgraph.FullIterationGraph.capture_report` and :meth:`tgraph.OptimizerGraph.capture_report`
return a :class:`CaptureReport` whose ``memory`` is a :class:`MemoryReport`. The kinds below are
per-layer graphs'; a whole-step graph fills the ones it has (its static batch or loss in
``static_inputs``, its outputs in ``static_outputs``, the gradients it writes or owns in
``param_grads``) and leaves the others 0.

Every unit notes, at capture, the bytes of each kind of buffer it owns (:class:`UnitMemory`);
:func:`memory_report` adds them up over every captured unit. The kinds:

* ``static_inputs``: input buffers the forward graph reads (outside the pool; shared inputs,
  which are another unit's static outputs, are not counted twice);
* ``static_outputs``: the forward graph's outputs (pool, held);
* ``saved_activations``: what the backward graph reads from the forward (pool; alive from a
  forward replay to its backward replay, reused by other graphs otherwise, so it counts in the
  pool's reserved memory, not in ``torch.cuda.memory_allocated`` between steps);
* ``grad_outputs``: the buffers incoming gradients are copied into (outside the pool);
* ``input_grads``: the backward graph's input gradients (pool, held);
* ``param_grads``: the parameter-gradient buffers (pool, held); the parameters' ``.grad``
  are aliases of them (:class:`tgraph.layers.grads.ParamGradOutputs`), so it is the memory eager's
  ``.grad`` would take, not more;
* ``warmup_peak``: the most memory one unit's eager warmup held at once above what was
  allocated before it (transient; CUDA only).

Not the graphs' own, but reported because it adds to the peak of creating the graphs:
:attr:`MemoryReport.grads_at_capture`, the parameter ``.grad`` of the recorded step that were
still alive when ``create_graphs()`` ran.

On CUDA, ``saved_activations`` is measured (memory allocated by the forward capture minus its
outputs); on the emulated backend it is the size of the tensors autograd saved in the capture.
The other kinds are sizes of the buffers themselves, so their sum can be checked against
``torch.cuda.memory_allocated`` (:attr:`MemoryReport.held`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields

import torch

KINDS = (
    "static_inputs",
    "static_outputs",
    "saved_activations",
    "grad_outputs",
    "input_grads",
    "param_grads",
    "warmup_peak",
)


@dataclass
class UnitMemory:
    """Bytes of one unit's buffers, by kind (module docstring)."""

    static_inputs: int = 0
    static_outputs: int = 0
    saved_activations: int = 0
    grad_outputs: int = 0
    input_grads: int = 0
    param_grads: int = 0
    warmup_peak: int = 0


@dataclass
class MemoryReport(UnitMemory):
    """:class:`UnitMemory` summed over every captured unit (``warmup_peak``: the largest)."""

    units: int = 0
    #: bytes of parameter ``.grad`` alive while ``create_graphs()`` created the graphs (the
    #: recorded step's, not the graphs'): they add to its peak; zeroing them first saves it
    grads_at_capture: int = 0

    @property
    def held(self) -> int:
        """Bytes held between steps by the buffers (what ``memory_allocated`` sees)."""
        return (
            self.static_inputs
            + self.static_outputs
            + self.grad_outputs
            + self.input_grads
            + self.param_grads
        )

    def __str__(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / 2**20:.1f}" for k in KINDS if getattr(self, k))
        text = f"graph memory MiB ({self.units} units): {parts}; held {self.held / 2**20:.1f}"
        if self.grads_at_capture:
            text += (
                f"; {self.grads_at_capture / 2**20:.1f} MiB of parameter .grad were alive during "
                "capture (optimizer.zero_grad(set_to_none=True) before create_graphs() frees "
                "them first)"
            )
        return text


@dataclass
class CaptureReport:
    """What creating the graphs made: :func:`tgraph.create_graphs` returns one (``entry="layers"``);
    :meth:`tgraph.FullIterationGraph.capture_report` and
    :meth:`tgraph.OptimizerGraph.capture_report` give the same shape."""

    graphs: int
    """Number of graphs captured (forward and backward counted separately)."""
    runners: int
    """Number of (module, signature) runners (per-layer graphs; 0 for a whole-step entry)."""
    segments: int
    """Number of merged stacks (each one forward and one backward graph for several runners)."""
    seconds: float
    """Wall time of creating the graphs (per-layer: warmup, captures, bake), or of the captures
    (whole-step)."""
    pool_bytes: int
    """CUDA memory held after creating the graphs minus before (0 on the emulated backend)."""
    backends: list[str]
    """Backends used."""
    eager_modules: list[str]
    """Enabled modules that stay eager, with the reason (per-layer graphs)."""
    memory: MemoryReport = field(default_factory=MemoryReport)
    """The graphs' memory by kind."""
    entry: str = "layers"
    """Which entry captured: ``"layers"``, ``"FullIterationGraph"`` or ``"OptimizerGraph"``."""
    unmerged: list[str] = field(default_factory=list)
    """Neighbouring graphed modules called back to back and left in separate graphs because eager
    code between their calls would see their gradients summed in another order (per-layer)."""

    def __str__(self) -> str:
        eager = f"; eager: {', '.join(self.eager_modules)}" if self.eager_modules else ""
        if self.unmerged:
            eager += f"; not merged: {', '.join(self.unmerged)}"
        made = (
            f"{self.graphs} graphs for {self.runners} runners ({self.segments} merged stacks)"
            if self.entry == "layers"
            else f"{self.graphs} {self.entry} graph{'s' if self.graphs != 1 else ''}"
        )
        return (
            f"tgraph: captured {made} on "
            f"{'/'.join(self.backends)} in {self.seconds:.2f}s, pool {self.pool_bytes / 2**20:.1f} MiB"
            f"{eager}; {self.memory}"
        )


def tensor_bytes(tensors: Iterable[torch.Tensor | None], skip: Iterable[int] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (storages in ``skip`` excluded)."""
    seen = set(skip)
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def memory_report(caps: Iterable, grads_at_capture: int = 0) -> MemoryReport:
    """Add up the :class:`UnitMemory` of ``caps``, the units' capture results
    (:class:`tgraph.layers.captured.Captured`)."""
    report = MemoryReport(grads_at_capture=grads_at_capture)
    for c in caps:
        m = c.memory
        report.units += 1
        for f in fields(UnitMemory):
            if f.name == "warmup_peak":
                report.warmup_peak = max(report.warmup_peak, m.warmup_peak)
            else:
                setattr(report, f.name, getattr(report, f.name) + getattr(m, f.name))
    return report
