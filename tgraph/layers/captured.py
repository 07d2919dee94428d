"""What one capture made, frozen, and the little that a replay changes.

A unit's captures (:mod:`tgraph.layers.capture`: a runner or a merged stack) end in its capture
result, a :class:`Captured`: the two graphs, the static buffers, the outputs' templates, the
gradient plumbing and the baked inventory (:class:`tgraph.baked.Baked`, what the graphs baked
in), with the flat tuples the per-call checks compare. The autograd bridge
(:mod:`tgraph.layers.replay`) closes over the capture result, as
``torch.cuda.make_graphed_callables``' ``Graphed`` function closes over its capture's tuples.
A capture result is never changed; a re-bound parameter (``load_state_dict(assign=True)``) gets
a new one over the same graphs (:meth:`tgraph.layers.capture.GraphedUnit.rebind`).

What a replay must change lives in one :class:`ReplayState` per unit, in small objects each
written by one owner: the call in flight (:class:`InFlight`: until its backward, the generator
state a recomputing backward starts from, the latest outputs), the parameter route
(:class:`ParamRoute`: where gradients go, what a re-pointed parameter is copied from), who holds
the static outputs (:class:`HeldOutputs`), a merged stack's cursor (:class:`StackCursor`), the
parameter gradients' hand-off (:class:`tgraph.layers.grads.GradHandOff`), and beside them which
grad-output buffers hold zeros, which gradients a pattern of unused outputs hands as None, and
the hook epoch last checked.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from tgraph.baked import Baked
from tgraph.fp8 import FP8Replay
from tgraph.layers.direct_grads import DirectGrads, DirectRoute
from tgraph.layers.grads import (
    GradHandOff,
    MainGradFlags,
    MainGradFusion,
    ParamGradOutputs,
    UnusedOutputs,
)
from tgraph.layout import LayoutGuards
from tgraph.memory import UnitMemory
from tgraph.pool import PoolLedger
from tgraph.signature import Template


@dataclass(frozen=True, slots=True, eq=False)
class Captured:
    """One unit's capture: its graphs, static buffers, templates and checks."""

    name: str  # the unit, as messages name it
    device: torch.device
    ledger: PoolLedger  # the pool's replay-order guard (tgraph.pool)
    fwd_graph: Any
    bwd_graph: Any  # None when the forward needs no backward
    fwd_index: int  # capture indices (tgraph.pool)
    bwd_index: float
    needs_backward: bool
    recomputes: bool  # the forward checkpoints: the backward replays from the forward's RNG
    debug: bool  # poison the static buffers after each backward (enable(debug=True))
    # ---- inputs: the head's static buffers, what the replay copies into them
    static_inputs: tuple[torch.Tensor, ...]
    shared_inputs: tuple[bool, ...]  # the buffer is another unit's static output
    input_ptrs: tuple[int, ...]
    input_strides: tuple[tuple[int, ...], ...]
    # ---- outputs
    static_outputs: tuple[torch.Tensor, ...]
    out_rg: tuple[int, ...]  # outputs that require grad (the backward's outputs)
    out_nodiff: tuple[int, ...]
    fresh_outputs: tuple[int, ...]  # 0-dim outputs (a loss), handed out as copies: a caller
    # keeps them across steps (a list of losses), which a PyTorch without storage swaps could
    # not move out of the graph's memory (tgraph.layers.follow.move_out_held_outputs)
    nograd_copies: tuple[int, ...]  # what a no-grad replay hands out as copies: the fresh
    # outputs and those that are (views of) static inputs, which the next call's copy overwrites
    output_internal: tuple[tuple[torch.Tensor, ...], ...]  # tgraph's tensors on each output
    templates: tuple[Template, ...]  # per member: the structure its call returns
    slices: tuple[slice, ...]  # per member: its outputs among static_outputs
    sources: tuple[tuple[tuple[bool, int], ...], ...]  # per later member: its inputs' sources
    # ---- backward
    static_grad_outputs: tuple[torch.Tensor, ...]
    static_grads: tuple[torch.Tensor | None, ...]  # input gradients, per static input
    params: tuple[torch.Tensor | None, ...]  # what the backward differentiates; None: slot's
    param_out: ParamGradOutputs  # the parameter gradients' static buffers
    fusion: MainGradFusion
    direct: DirectGrads  # opt-in: the node writes parameter gradients to .grad itself
    flags: MainGradFlags | None
    unused: UnusedOutputs
    # ---- what the graphs baked in (tgraph.baked), and what the checks need beside it
    baked: Baked | None
    slot: tuple[int | None, ...]  # per parameter of the backward: its baked index
    own_uses: tuple[int, ...]  # per baked tensor: uses of its memory by tgraph alone
    memory: UnitMemory  # its buffers' bytes by kind
    fp8: FP8Replay | None = None  # captured in a te.autocast region: TE's Python it redoes
    mutated_inputs: tuple[int, ...] = ()  # static inputs the forward writes: copied back
    host_values: tuple[tuple[int, Any], ...] = ()  # (input, value): host scalars CUDA baked in
    foreign_host: tuple[tuple[torch.Tensor, Any], ...] = ()  # other host scalars, with values
    # per member: (submodule, attribute, output index) of the tensors its forward stores in
    # module state (self.aux_loss = ...), extra outputs a replay stores there again
    stored: tuple[tuple[tuple[Any, str, int], ...], ...] = ()
    # a merged stack that draws random numbers: its later members' modes, checked at the head
    # (tgraph.layers.shortcut.MemberModes)
    modes: Any = None
    rng_read: Any = None  # ... and where its generators stand, read cheaply (tgraph.rng.reader)
    # a merged stack: its outputs that require grad of every member but the last, whose
    # gradients from inside the stack its backward graph adds (checked for hooks at backward)
    inner: tuple[int, ...] = ()

    @property
    def members(self) -> int:
        return len(self.templates)


class InFlight:
    """One call's replay, until its backward (written by :mod:`tgraph.layers.replay` and its
    backward, :mod:`tgraph.layers.backward`)."""

    __slots__ = ("token", "held", "rng_at_forward", "last_outputs")

    def __init__(self) -> None:
        self.token: int | None = None  # id of the Flight token while in flight
        self.held = False  # in flight only because a no-grad call's outputs are alive
        self.rng_at_forward: torch.Tensor | None = None  # a recomputing forward's RNG state
        self.last_outputs: weakref.ref | None = None  # LiveOutputs of the latest replay


class ParamRoute:
    """Where parameter gradients go and what a replay copies into the graph's memory
    (written only by :mod:`tgraph.layers.follow`)."""

    __slots__ = (
        "params",
        "autograd_params",
        "accumulators",
        "direct",
        "copy_in",
        "followed",
        "live",
        "rerouted",
    )

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []  # where parameter gradients go (re-routed)
        self.autograd_params: list[torch.Tensor] = []  # the autograd node's parameter inputs
        self.accumulators: list = []  # ... their AccumulateGrad nodes, held (follow.set_params)
        self.direct: DirectRoute | None = None  # direct_grads: the parameters the node writes
        self.copy_in: list[int] = []  # baked tensors followed by a copy into the graph's memory
        self.followed: tuple | None = None  # ... decided for these addresses and layouts
        self.live: tuple[torch.Tensor, ...] = ()  # ... and the tensors copied from
        self.rerouted = False  # some gradient goes to a tensor other than the captured one


class HeldOutputs:
    """Who else uses the static outputs' memory (written only by :mod:`tgraph.layers.follow`,
    which moves held outputs out)."""

    __slots__ = ("cdata", "uses", "rescued")

    def __init__(self) -> None:
        self.cdata: tuple[int, ...] = ()  # each static output's storage (its _cdata)
        self.uses: tuple[int, ...] = ()  # ... and its uses by tgraph alone
        self.rescued: weakref.ref | None = None  # the InFlight.last_outputs already moved out


class StackCursor:
    """A merged stack between the head's replay and the last member's call (written only by
    :func:`tgraph.layers.replay.call` and the functions it calls; ``head_call``, ``head_grad``
    and ``shapes``, what later members are answered from, by :mod:`tgraph.layers.shortcut`)."""

    __slots__ = (
        "pending",
        "versions",
        "head_inputs",
        "head_versions",
        "head_call",
        "head_grad",
        "next",
        "fell_back",
        "shapes",
        "modes_at",
        "rng_at",
        "nodes_at",
    )

    def __init__(self) -> None:
        self.pending: list[list[torch.Tensor]] | None = None  # every member's outputs
        self.versions: list[int] = []  # ... their version counters
        self.head_inputs: list[torch.Tensor] = []  # the head call's tensors
        self.head_versions: list[int] = []
        self.head_call: tuple | None = None  # the head call's (args, kwargs, their values)
        self.head_grad: tuple[bool, ...] = ()  # ... and its tensors' requires_grad
        self.next = 0  # the member whose call comes next
        self.fell_back: str | None = None  # why the head's last call ran eagerly
        self.shapes: dict = {}  # member -> its calls' tgraph.layers.shortcut.Shape, once learned
        self.modes_at = -1  # module epoch when members' training flags were last found as keyed
        self.rng_at: object = None  # where the generators stood after the replay (rng_read)
        # autograd's node counter when the previous member's outputs were handed out
        self.nodes_at = -1

    def release(self) -> None:
        """Forget the replayed stack's outputs and head inputs (its last member took its
        outputs, or the stack was left)."""
        self.pending, self.head_inputs, self.head_call = None, [], None


class ReplayState:
    """What replays of one unit change (the module docstring), by owner."""

    __slots__ = (
        "inflight",
        "route",
        "outputs",
        "stack",
        "grads",
        "grad_out_zero",
        "none_at",
        "hook_epoch",
        "module_epoch",
        "layout",
        "replays",
        "verify_next",
        "wrong",
    )

    def __init__(self) -> None:
        self.inflight = InFlight()
        self.route = ParamRoute()
        self.outputs = HeldOutputs()
        self.stack = StackCursor()
        self.grads: GradHandOff | None = None  # the parameter gradients' hand-off (set at bake)
        # per grad-output buffer: known to hold zeros (tgraph.layers.backward)
        self.grad_out_zero: list[bool] = []
        # per pattern of outputs given a gradient: the gradients handed as None (backward)
        self.none_at: dict[tuple[bool, ...], list[int]] = {}
        # torch's hook counter when the hooks were last found unchanged (replay.check)
        self.hook_epoch = -1
        # the module epoch when the attributes and module tree were last found as baked
        self.module_epoch = -1
        # C++ checks of the baked tensors' sizes and strides (replay._in_place)
        self.layout = LayoutGuards()
        # the shadow verifier (tgraph.layers.verify): replays so far, verify the next one (an
        # event), why the unit runs eagerly for good
        self.replays = 0
        self.verify_next = False
        self.wrong: str | None = None
