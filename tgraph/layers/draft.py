"""What a capture starts from and fills before it is frozen: one :class:`CaptureDraft` per unit
(and member), from the unit's creation until its capture result is baked.

A unit's capture (:mod:`tgraph.layers.capture`) runs in steps, one graph at a time, in the
pool's recorded order: the forward graph with its warmup, the parameters its autograd graph
reaches, the backward graph. Between the steps, and until every graph of the pool exists, what
they found lives here: the static buffers, the graphs, the gradient plumbing being built, the
bookkeeping of the warmup. Once every graph of the pool is captured,
:meth:`tgraph.layers.capture.GraphedUnit.bake` freezes the draft into the unit's capture
result (:class:`tgraph.layers.captured.Captured`) and drops it: a captured unit keeps its
identity, its options, its capture result (``cap``) and its replay state, nothing of the capture's way there.

A runner's draft has three parts: the recorded call the capture starts from
(:class:`RecordedCall`, kept when a failed capture starts over), the unit's (a runner may be
captured alone) and the member's (its static inputs, parameter aliases and output template,
which a merged stack's capture fills for each of its runners).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tgraph.layers.grads import MainGradFlags, MainGradFusion, ParamGradOutputs, UnusedOutputs
from tgraph.memory import UnitMemory
from tgraph.signature import Template


@dataclass(eq=False)
class RecordedCall:
    """A runner's recorded first call, what its capture starts from."""

    template: Template  # the structure of its arguments (args, kwargs)
    samples: list[torch.Tensor]  # its tensors, cloned; the capture copies and drops them
    requires_grad: list[bool]  # ... whether each required grad
    links: list[Any]  # per tensor: (producer runner, output index) or None (tgraph.layers.record)
    shared_with: list[list[Any]]  # per tensor: earlier runners that took the very same tensor
    rng_before: bytes = b""  # the generators' position before its forward (tgraph.rng.position)
    rng_after: bytes = b""  # ... and after it
    region: int = 0  # the autograd Function whose forward it ran in (tgraph.rng.forward_region)
    nodes_before: int = -1  # autograd's node counter before its forward (torch's sequence number)
    nodes_after: int = -1  # ... and after its call, the node that notes its backward included
    hooked: bool = False  # its recorded backward found a hook or retain_grad() on an output


@dataclass(eq=False)
class CaptureDraft:
    """One capture's findings until :meth:`~tgraph.layers.capture.GraphedUnit.bake`."""

    fusion: MainGradFusion  # the unit's main_grad fusion, as the capture decides it
    call: RecordedCall | None = None  # a runner's recorded call (None: a merged stack)
    # ---- the unit's graphs and buffers
    ledger: Any = None  # the pool's replay-order guard (tgraph.pool)
    fwd_graph: Any = None
    bwd_graph: Any = None
    static_outputs: list[torch.Tensor] = field(default_factory=list)
    static_grads: list[torch.Tensor | None] = field(default_factory=list)
    static_grad_outputs: list[torch.Tensor] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)  # what the backward differentiates
    leaves: list[torch.Tensor] = field(default_factory=list)  # ... as the graphs see them
    out_rg: list[int] = field(default_factory=list)  # outputs that require grad
    out_nodiff: list[int] = field(default_factory=list)
    needs_backward: bool = False
    recomputes: bool = False  # the forward checkpoints (torch.utils.checkpoint)
    unused: UnusedOutputs = field(default_factory=UnusedOutputs)
    memory: UnitMemory = field(default_factory=UnitMemory)
    param_out: ParamGradOutputs = field(default_factory=ParamGradOutputs)
    flags: MainGradFlags | None = None
    host_reads: list[torch.Tensor] = field(default_factory=list)  # CPU scalars its kernels read
    slices: list[slice] = field(default_factory=list)  # a merged stack: outputs per member
    # ---- a runner as a member of a unit (its own, or a merged stack)
    static_inputs: list[torch.Tensor] = field(default_factory=list)
    shared_inputs: list[bool] = field(default_factory=list)  # another unit's static output
    in_rg: list[int] = field(default_factory=list)  # inputs that require grad
    aliases: dict[int, torch.Tensor] = field(default_factory=dict)  # id(param) -> graph's leaf
    out_template: Template | None = None  # the structure its call returns
    stored: tuple = ()  # (submodule, attribute, output index): tensors left in module state
    mutated: set[int] = field(default_factory=set)  # inputs its forward writes in place
