"""The replay of a captured unit, and the autograd bridge: one ``autograd.Function`` node.

Everything here works on a unit's frozen capture result (:class:`tgraph.layers.captured.Captured`) and its
:class:`tgraph.layers.captured.ReplayState`, never on the unit itself (:mod:`tgraph.layers.capture` captures;
``torch.cuda.make_graphed_callables``' ``Graphed`` function closes over its capture the same
way). :func:`call` answers one graphed call: the head of a unit checks what the graphs baked
in (:func:`check`), guards the pool's replay order, copies the live inputs into the static
buffers and replays through :class:`GraphedCall`; a later member of a merged stack takes its
outputs of that replay (:func:`take`).

:class:`GraphedCall`'s forward replays the forward graph and returns views of the static
outputs. Its backward checks that this backward may run (one per forward, outputs unmodified,
the pool's replay order) and replays the backward graph through :mod:`tgraph.layers.backward`,
which returns the static input gradients and the parameter gradients; the parameters are inputs
of the node, so autograd accumulates their gradients and DDP / FSDP / Megatron hooks fire as in
eager mode.
"""

from __future__ import annotations

import operator
import weakref
from operator import getitem, is_
from sys import modules as _sys_modules

import torch
from torch.utils.hooks import RemovableHandle

from tgraph import rng
from tgraph.baked import _epoch as _module_epoch
from tgraph.baked import recording_outputs
from tgraph.errors import GraphFallbackError, StaleBackwardError
from tgraph.layers import verify
from tgraph.layers.backward import (
    after_backward,
    copy_grad_outputs,
    grads_for_autograd,
    replay_backward,
)
from tgraph.layers.captured import Captured, ReplayState
from tgraph.layers.follow import follow_moved, move_out_held_outputs, route, set_params
from tgraph.layout import ptrs_equal
from tgraph.pool import LiveOutputs, use_counts

_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_grad_enabled = torch._C.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_autograd_nodes = torch._C._autograd._get_sequence_nr  # autograd's node counter, this thread
_dist = torch.distributed


def _distributed() -> bool:  # direct_grads.distributed, kept on this file's hot path
    return _dist.is_available() and _dist.is_initialized()


_OUTPUT_CAPTURING = "transformers.utils.output_capturing"
# the data-pointer pass of inductor's cudagraph trees, in C++; absent from CPU builds of torch
_ptrs_equal = ptrs_equal
_deref = getattr(operator, "call", weakref.ref.__call__)  # a weakref's target (3.10: no call)

BUSY = (
    "every graph captured for this signature is awaiting its backward, or (a call without "
    "backward) the outputs of its last replay are still alive (more calls in flight than in "
    "the recorded iteration)"
)
DRAWN_BETWEEN = (
    "random numbers were drawn between the calls of its modules after capture (LayerDrop's "
    "torch.rand between layers?), from the generators its replay drew every module's from at "
    "once: that step drew them in another order than eager; it runs eagerly from now on "
    "(record such draws, then tgraph.reset() and tgraph.create_graphs(), to graph its modules "
    "apart)"
)
LEFT_AFTER_DRAW = (
    "its replay had drawn the random numbers of every module of the stack at once, and a "
    "later module was not called right after the previous one with that module's unmodified "
    "output (a hook or code between the modules changing the stream, a module skipped or "
    "called with other arguments, or the stack left midway): that module ran eagerly and drew "
    "its numbers again, or drew none where the replay had, so that step's random numbers "
    "differ from eager's; it runs eagerly from now on (to graph such steps, record them, then "
    "tgraph.reset() and tgraph.create_graphs(), or pass merge=False to tgraph.enable)"
)
NODES_BETWEEN = (
    "eager code between the calls of its modules made autograd nodes after capture (an "
    "auxiliary loss on a module's output?): merged, the stack's backward would add that code's "
    "gradients to the ones inside the stack in another order than eager, off in the last bits; "
    "it runs eagerly from now on (record that code, then tgraph.reset() and "
    "tgraph.create_graphs(), to graph its modules apart)"
)
DIFFERENT_SHARED_INPUT = (
    "an input captured as another graphed module's output buffer arrived as a different tensor"
)


class Rebind:
    """:func:`check`'s answer when the modules hold new parameter objects on memory of their
    own: the unit bakes them into a new capture result
    (:meth:`tgraph.layers.capture.GraphedUnit.rebind`), then retries."""


REBIND = Rebind()


class Flight:
    """Marks a unit in flight (its :class:`ReplayState`) while this token is alive; an
    autograd node holds it until its backward.

    Args:
        state: the unit's replay state.
        cap: the unit's capture result once captured: a flight of a replay also enters the pool's
            :class:`tgraph.pool.PoolLedger`, which checks that no replay overwrites memory
            the unit still needs.
        held: in flight because the outputs of a call without backward are alive, not because
            a backward is awaited (guarded by :class:`tgraph.pool.LiveOutputs` instead).
    """

    __slots__ = ("state", "ledger", "fp8_first", "__weakref__")

    def __init__(self, state: ReplayState, cap: Captured | None = None, held: bool = False):
        self.state = state
        self.fp8_first = False  # holds the first FP8 module of its te.autocast region
        inflight = state.inflight
        inflight.token = id(self)
        inflight.held = held
        self.ledger = cap.ledger if cap is not None and not held else None
        if self.ledger is not None:
            self.ledger.enter(id(self), state, cap.name, cap.fwd_index, cap.bwd_index)

    def land(self) -> None:
        inflight = self.state.inflight
        if inflight.token == id(self):
            inflight.token = None
            inflight.held = False
        if self.ledger is not None:
            self.ledger.leave(id(self))
            self.ledger = None

    def __del__(self) -> None:  # autograd graph freed without a backward
        self.land()

    def __reduce__(self):
        """An output's deep copy, pickle or ``torch.save`` is new memory, which no replay
        overwrites: its copy of this token holds nothing in flight (a shallow
        ``copy.copy`` of an output shares its memory and this very token)."""
        return set, ()  # a global torch.load(weights_only=True) takes: an empty set


def hold_while_alive(state: ReplayState, outputs: list[torch.Tensor]) -> None:
    """Keep the unit of ``state`` in flight while any of ``outputs`` is alive.

    A call without backward (no_grad, frozen or parameter-free modules) has no backward to wait
    for, yet its outputs are the static buffers the next replay overwrites: ``a = enc(x1);
    b = enc(x2)`` must not make ``a`` equal ``b``. While an output lives, the next call gets
    another unit (recording) or runs eagerly with a warning (after capture). Views taken
    of an output and kept after the output itself is dropped are not tracked.
    """
    if outputs:
        flight = Flight(state, held=True)
        for o in outputs:
            o._tgraph_flight = flight


# ----------------------------------------------------------------------------- calls
def call(cap: Captured | None, state: ReplayState, j: int, tensors: list[torch.Tensor]):
    """The outputs of member ``j``'s call (the capture result's ``j``-th template fills them), or the
    reason it must run eagerly, or :data:`REBIND`."""
    if cap is None:
        return BUSY
    if j:
        outs = take(cap, state, j, tensors)
        if outs is not None:
            return outs
        if state.stack.fell_back is not None:  # the stack runs eagerly, for the head's reason
            return (
                f"the merged stack {cap.name} it belongs to runs eagerly: {state.stack.fell_back}"
            )
        return (
            f"it was captured as module {j} of a merged stack ({cap.name}) but was not called "
            "right after the previous module with that module's unmodified output and the "
            "inputs shared with the first module (pass merge=False to tgraph.enable to graph "
            "it alone)"
        )
    if state.stack.pending is not None:  # the last replay's stack was left midway: its
        leave(cap, state)  # later members' outputs, never handed out, keep nothing alive
    if state.inflight.token is not None:
        return BUSY
    why = refusal(cap, state, tensors)
    if why is not None:  # a reason, or REBIND
        if len(cap.slices) > 1:
            state.stack.fell_back = why if isinstance(why, str) else None
        return why
    outs = replay(cap, state, tensors)
    if len(cap.slices) == 1:
        return outs
    state.stack.fell_back = None
    return start(cap, state, outs, tensors)


def start(cap: Captured, state: ReplayState, outs: list, inputs: list) -> list[torch.Tensor]:
    """After a merged stack's replay on the head's ``inputs``: keep every member's outputs (and
    the inputs, which later members may share); return the head's outputs."""
    stack = state.stack
    stack.pending = [outs[s] for s in cap.slices]
    stack.versions = [t._version for t in outs]
    stack.head_inputs = inputs  # the call's own fresh list
    stack.head_versions = [t._version for t in inputs]
    stack.next = 1
    if cap.rng_read is not None:  # the stack draws: nothing may draw until its last member
        stack.rng_at = cap.rng_read()
    return stack.pending[0]


def take(cap: Captured, state: ReplayState, j: int, tensors: list) -> list | None:
    """Outputs of member ``j`` if this call continues the replayed stack as captured: each
    input is the very tensor it was (the previous member's output, or the head's input),
    unmodified."""
    stack = state.stack
    pending = stack.pending
    if pending is None or j != stack.next:  # (a member skipped: left at its fallback)
        return None
    prev, base, versions = pending[j - 1], cap.slices[j - 1].start, stack.versions
    head, head_versions = stack.head_inputs, stack.head_versions
    for t, (from_prev, k) in zip(tensors, cap.sources[j]):
        if from_prev:
            if t is prev[k] and t._version == versions[base + k]:
                continue
        elif t is head[k] and t._version == head_versions[k]:
            continue
        leave(cap, state)  # the stack was left: its outputs go
        return None
    if cap.rng_read is not None and cap.rng_read() != stack.rng_at:
        leave(cap, state, DRAWN_BETWEEN)
        return None
    # the recorded stack made no node between its calls (tgraph.layers.segment): code that
    # does now would have its gradients summed in another order than eager
    if _autograd_nodes() != stack.nodes_at and cap.needs_backward:
        leave(cap, state, NODES_BETWEEN)
        return None
    stack.next = j + 1
    if j + 1 == len(pending):
        stack.release()
    return pending[j]


def leave(cap: Captured, state: ReplayState, why: str = LEFT_AFTER_DRAW) -> None:
    """The replayed stack is left before its last member took its part: its outputs go. A
    stack that draws random numbers drew every member's at its replay, where eager draws
    them at each call: a member falling back draws its own again, one never called drew none,
    and no position of the generators is known to be eager's from here. That step's numbers
    differ from eager's, which cannot be undone after the fact: the member's fallback says so
    (strict raises) and the stack runs eagerly from now on (``why``: :data:`LEFT_AFTER_DRAW`,
    or :data:`DRAWN_BETWEEN` where the generators moved between its calls). A stack whose
    backward would sum gradients in another order than eager (:data:`NODES_BETWEEN`) runs
    eagerly from now on too, drawing or not. Called off the hot path only (a member that takes
    its part never gets here)."""
    stack = state.stack
    if stack.pending is not None and (cap.rng_read is not None or why is NODES_BETWEEN):
        stack.fell_back = state.wrong = why
    stack.release()


def left_after_draw(runners) -> str | None:
    """Before a module runs eagerly for a reason of its own call (say its key differs from
    every runner's, so :func:`take` never saw the call): when one of ``runners`` is a later
    member of a replayed stack that draws random numbers and still awaits its members, the
    stack is left (:func:`leave`) and this says why the step's numbers differ; None
    otherwise."""
    for r in runners:
        cap = r.cap
        if r.seg_index and cap is not None and cap.rng_read is not None:
            if r.state.stack.pending is not None:
                leave(cap, r.state)
                return f"the merged stack {cap.name} it belongs to runs eagerly: {r.state.wrong}"
    return None


def refusal(cap: Captured, state: ReplayState, tensors: list[torch.Tensor]):
    """Why this call of the unit cannot replay (a sentence, or :data:`REBIND`), or None when
    it can. What can be followed is followed here (a re-pointed parameter copied in, held
    outputs moved out), so that :func:`replay` only acts."""
    if state.wrong is not None:  # found wrong: by the shadow verifier (tgraph.layers.verify),
        # or random numbers drawn between a merged stack's calls (take)
        return state.wrong
    why = check(cap, state) if _settings.rules else None
    if why is not None:
        return why
    if cap.modes is not None:  # a merged stack that draws: would every member take its part?
        why = cap.modes.changed(state.stack)
        if why is not None:
            return why
    for i, value in cap.host_values:  # a CUDA kernel took the host scalar's value at capture
        if tensors[i].item() != value:
            return (
                f"CPU scalar argument {i} is {tensors[i].item()} where the graph baked in "
                f"{value} (a CUDA graph keeps a host scalar's value; pass a CUDA tensor to "
                "graph every value, or a Python number to graph each one)"
            )
    for t, value in cap.foreign_host:  # e.g. a tensor attribute that .cuda() left on the CPU
        if t.item() != value:
            return (
                f"a CPU scalar tensor the graph reads (not an argument: a tensor attribute or "
                f"a closure) holds {t.item()} where the graph baked in {value} (a CUDA graph "
                "keeps a host scalar's value; move it to the GPU to graph every value)"
            )
    if use_counts(state.outputs.cdata) != state.outputs.uses:
        why = move_out_held_outputs(cap, state)
        if why is not None:
            return why
    why = cap.ledger.unsafe_forward(state, cap.fwd_index)
    if why is not None:
        return why
    if any(cap.shared_inputs):  # a buffer that is another unit's output must not be written
        for x, ptr, stride, shared in zip(
            tensors, cap.input_ptrs, cap.input_strides, cap.shared_inputs
        ):
            if shared and (x.data_ptr() != ptr or x.stride() != stride):
                return DIFFERENT_SHARED_INPUT
    return None


def replay(cap: Captured, state: ReplayState, tensors: list[torch.Tensor]) -> list:
    """Replay the forward on live ``tensors`` (:func:`refusal` said it can): the static
    outputs' views, in an autograd node when the call needs a backward."""
    copy_inputs(cap, tensors)
    fp8_first = cap.fp8 is not None and cap.fp8.before_forward()
    if not cap.needs_backward:
        cap.fwd_graph.replay()
        outs = [o.detach() for o in cap.static_outputs]
        copied = cap.nograd_copies
        for i in copied:  # the static input buffer (the next call's copy would overwrite it),
            outs[i] = outs[i].clone()  # or a loss
        for i in cap.out_rg:  # a leaf that requires grad under no_grad, as the eager call
            outs[i].requires_grad_()  # made it (megatron's make_viewless_tensor): next keys
        hold_while_alive(
            state, [o for i, o in enumerate(outs) if i not in copied] if copied else outs
        )
    else:
        flight = Flight(state, cap)
        flight.fp8_first = fp8_first
        if cap.recomputes:
            state.inflight.rng_at_forward = rng.default_generator(cap.device).get_state()
        if state.route.direct is not None and (_functorch_active() or _distributed()):
            cap.direct.leave(cap.name)  # the default: autograd's path from now on
            set_params(cap, state, state.route.params)
        if _functorch_active():
            outs = list(
                GraphedCall.apply(cap, state, flight, *tensors, *state.route.autograd_params)
            )
        else:  # Function.apply without its Python wrapper's per-argument pass
            outs = list(_apply(cap, state, flight, *tensors, *state.route.autograd_params))
    if cap.mutated_inputs:  # the forward writes these inputs in place: so must the replay
        with torch.no_grad():
            for i in cap.mutated_inputs:
                if tensors[i].data_ptr() != cap.input_ptrs[i]:
                    tensors[i].copy_(cap.static_inputs[i])
    if state.route.copy_in:
        with torch.no_grad():  # a buffer the forward updates (running statistics)
            b = cap.baked
            for i in state.route.copy_in:
                if b.is_buffer[i]:
                    state.route.live[i].copy_(b.held[i])
    token = LiveOutputs(cap.ledger, state, cap.fwd_index, outs)  # no other graph overwrites them
    state.inflight.last_outputs = weakref.ref(token)  # (tgraph.pool) nor this unit's next replay
    return outs


def copy_inputs(cap: Captured, tensors: list[torch.Tensor]) -> None:
    """Copy live inputs into the static buffers (a shared buffer, another unit's static
    output, already is the input: :func:`refusal` made sure)."""
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    for buf, ptr, stride, x in zip(cap.static_inputs, cap.input_ptrs, cap.input_strides, tensors):
        if x.data_ptr() == ptr and x.stride() == stride:
            continue  # already the buffer: layer i's output is layer i+1's input
        dst.append(buf)
        src.append(x)
    if dst:
        was = _grad_enabled()
        _set_grad_enabled(False)
        try:
            first = dst[0].dtype
            if all(d.dtype is first for d in dst):
                torch._foreach_copy_(dst, src)
            else:  # CUDA's one-kernel route takes one dtype: a list per dtype (hidden states
                by: dict = {}  # and rotary tables, position ids), not one copy per tensor
                for d, x in zip(dst, src):
                    pair = by.setdefault(d.dtype, ([], []))
                    pair[0].append(d)
                    pair[1].append(x)
                for d, x in by.values():
                    torch._foreach_copy_(d, x)
        finally:
            _set_grad_enabled(was)


# ------------------------------------------------------------ what the graphs baked in
def check(cap: Captured, state: ReplayState):
    """Before a replay: None when nothing the graphs baked in changed (a few C-level tuple
    comparisons); otherwise follow what can be followed (re-pointed parameters, by a copy into
    the memory the graph reads) or give the reason to run eagerly, or :data:`REBIND`."""
    b = cap.baked
    if b is None:
        return None
    epoch = RemovableHandle.next_id  # moves whenever a hook is registered anywhere
    if epoch != state.hook_epoch or b.any_hooks:
        why = b.changed_hooks(scan=True)
        if why is not None:
            return why
        if state.route.direct is not None and epoch != state.hook_epoch:  # a hook on a parameter:
            set_params(cap, state, state.route.params)  # autograd's path for it
        if epoch != state.hook_epoch and state.grads is not None:
            state.grads.watch_hooks()  # one that may keep its gradient: hand out copies
        state.hook_epoch = epoch  # scanned: unchanged as of this epoch
    try:  # the globals the forwards name: no epoch sees them change
        same = tuple(map(getitem, b.global_tables, b.global_keys)) == b.global_values
    except KeyError:
        same = False
    module_epoch = _module_epoch[0]  # moved by nn.Module's setters (baked.watch_module_writes)
    if not same or module_epoch != state.module_epoch:  # off the steady path: baked.py's
        why = b.changed_tree() or b.changed_attrs()  # C-level passes first, then the names
        if why is not None:
            return why
        state.module_epoch = module_epoch  # found as baked as of this epoch
    capturing = _sys_modules.get(_OUTPUT_CAPTURING)  # transformers imported
    collector = getattr(capturing, "_active_collector", None)
    if collector is not None and collector.get():  # recording now: baked.py names what
        recording = recording_outputs()
        if recording is not None:
            return (
                f"transformers is recording {recording} through hooks inside the layer "
                "(output_attentions / output_router_logits), which a graph does not run"
            )
    if cap.needs_backward and _saved_tensors_hooks(False) is not None:
        return (
            "torch.autograd.graph.saved_tensors_hooks are active, and a graph's backward "
            "reads its saved activations without them"
        )
    try:
        live = tuple(map(getitem, b.tensor_tables, b.tensor_keys))
    except KeyError:
        return b.replaced_tensors()  # names the removed parameter or buffer
    # the captured objects themselves (by weakref: no id a dead tensor left can pass)
    if state.route.rerouted or not all(map(is_, live, map(_deref, b.refs))):
        gone = next((n for n, t in zip(b.names, live) if t is None), None)
        if gone is not None:  # a later member's own key would find it (merged stack's head)
            return f"{gone} was set to None after capture"
        route(cap, state, live)  # gradients go to the tensors the modules hold now
        if b.replaced_tensors(live) is not None:
            kept = [n for n, r, t in zip(b.names, b.refs, live) if r() is not None and r() is not t]
            if kept:
                return (
                    f"{kept[0]} was replaced after capture while the captured tensor is still "
                    "alive (torch.func.functional_call substitutes weights for one call; "
                    "after load_state_dict(assign=True), the previous step's autograd graph "
                    "holds the old parameters until it is freed)"
                )
            return REBIND
    # baked.where, spelled out here: the hot path stays out of baked.py unless a check fails
    if state.route.copy_in or not _in_place(live, b, state):
        now = (tuple(map(_data_ptr, live)), tuple(map(_stride, live)), tuple(map(_size, live)))
        return follow_moved(cap, state, live, now)
    return None


def _in_place(live: tuple, b, state: ReplayState) -> bool:
    """Whether ``live`` sit at the addresses, with the strides and sizes, of ``b.place``:
    addresses by one C++ pass, sizes and strides by a C++ guard once the Python comparison
    found them as baked (:mod:`tgraph.layout`)."""
    ptrs, strides, sizes = b.place
    if _ptrs_equal is None:
        if tuple(map(_data_ptr, live)) != ptrs:
            return False
    elif not _ptrs_equal(list(live), b.ptr_list, b.all_indices):  # one C++ pass (lists only)
        return False
    for guard in state.layout.guards:  # C++ calls: the hot path stays in this file
        if guard.check(*live):
            return True
    if tuple(map(_stride, live)) != strides or tuple(map(_size, live)) != sizes:
        return False
    state.layout.remember(live, sizes, strides)
    return True


# ------------------------------------------------------------------- the autograd node
class GraphedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cap: Captured, state: ReplayState, flight: Flight, *tensors: torch.Tensor):
        cap.fwd_graph.replay()
        ctx.cap, ctx.state, ctx.flight = cap, state, flight
        # An output the loss did not use gets None, not zeros: then the parameters only it
        # reaches get no gradient, as in eager (tgraph.layers.grads.UnusedOutputs).
        ctx.set_materialize_grads(False)
        outs = [o.detach() for o in cap.static_outputs]
        for i in cap.fresh_outputs:  # a loss: kept across steps by callers, so a copy
            outs[i] = outs[i].clone()
        outs = tuple(outs)
        if cap.inner:  # a merged stack's inner outputs, for the backward's hook check (weak:
            ctx.inner = [weakref.ref(outs[i]) for i in cap.inner]  # no cycle through the node)
        # The backward graph may read the outputs as saved activations: saving them lets
        # autograd check their version counters (an in-place change raises, as in eager).
        # Keeping them on ctx instead would make a reference cycle through the autograd node.
        ctx.save_for_backward(*outs)
        if cap.out_nodiff:  # marking none is the default
            ctx.mark_non_differentiable(*[outs[i] for i in cap.out_nodiff])
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        cap, state, flight = ctx.cap, ctx.state, ctx.flight
        if torch.is_grad_enabled():  # backward(create_graph=True), e.g. a gradient penalty
            raise RuntimeError(
                f"tgraph: double backward through the graphed {cap.name} is not supported (its "
                "backward is a replayed graph, which autograd cannot differentiate). Run that "
                "module eagerly for this loss: call it with a signature that was not recorded, "
                "or tgraph.disable(model) for the gradient-penalty step."
            )
        if state.inflight.token != id(flight):  # landed: only this node's backward lands it
            raise StaleBackwardError(
                f"tgraph: a second backward through one forward of the graphed {cap.name}: its "
                "first backward already ran (outputs kept with retain_graph=True and backed "
                "through again, e.g. one torch.autograd.grad per loss as PCGrad or GradNorm "
                "take). A graph's backward replays once per forward, after which the pool reuses "
                "the forward's saved activations. Record a step that does this (tgraph.reset(), "
                "one such step, then tgraph.create_graphs(), which leaves the modules backed "
                "through more than once eager), or run the model eagerly (tgraph.disable(model))."
            )
        try:
            ctx.saved_tensors  # noqa: B018 - unpacking checks the version counters
        except RuntimeError as exc:
            raise RuntimeError(
                f"an output of {cap.name} was modified in place after its forward; its backward "
                "graph reads the graph's static outputs, so the gradient would be wrong. Clone "
                "the output before modifying it (y = block(x).clone())."
            ) from exc
        if cap.inner:
            for i, ref in zip(cap.inner, ctx.inner):
                t = ref()
                if t is not None and (t._backward_hooks or t.retains_grad):
                    flight.land()
                    raise GraphFallbackError(hooked_inner(cap, i))
        cap.fusion.check()
        direct = state.route.direct
        asked = None if direct is None else direct.request(cap.name, cap.direct.enabled is True)
        active = tuple(grads[i] is not None for i in cap.out_rg)
        if not any(active):  # nothing reached this node's outputs: no gradient anywhere
            flight.land()
            return (None,) * len(ctx.needs_input_grad)
        cap.ledger.before_backward(id(flight), state, cap.name, cap.bwd_index)
        copy_grad_outputs(cap, state, grads)
        moved = cap.flags.moved() if cap.flags.fused else ()  # main_grad re-created since
        replay_backward(cap, state)  # the RNG offset a recompute needs
        after_backward(cap, state, moved)
        if flight.fp8_first:  # the backward amax reduction the first FP8 module runs in eager
            cap.fp8.after_backward()
        flight.land()
        pending = getattr(ctx, "verify", None)  # a verified replay (tgraph.layers.verify)
        moved = direct is not None and RemovableHandle.next_id != state.hook_epoch
        adding = direct is not None and pending is None and direct.adds(asked, moved)
        result = grads_for_autograd(cap, state, active, raw=adding)
        if pending is not None:  # its eager twin's graph goes now: it holds saved weights
            ctx.verify = None
            result = verify.check_grads(cap, state, pending, result, grads)
        if direct is not None:  # written to .grad here (the verifier compared them first)
            n = len(cap.static_grads)
            result[n:] = direct.deliver(result[n:], asked, moved, adding)
        return (None, None, None, *result)


def hooked_inner(cap: Captured, i: int) -> str:
    """Why a merged stack's backward refuses: a hook or ``retain_grad()`` on output ``i``,
    an inner member's, which the recorded iteration did not show."""
    j = next(j for j, s in enumerate(cap.slices) if s.start <= i < s.stop)
    return (
        f"tgraph: a hook or retain_grad() on an output of module {j} of the merged stack "
        f"{cap.name}, which the recorded iteration did not show: the stack's backward graph adds "
        "that output's gradient from the next module inside itself, so the hook would never see "
        "it. Record a step with the hook (tgraph.reset(), one such step, then "
        "tgraph.create_graphs(), which keeps that module apart), or pass merge=False to "
        "tgraph.enable."
    )


_apply = super(torch.autograd.Function, GraphedCall).apply
_settings = verify.settings  # read in place (tgraph.verification changes its fields)
_data_ptr, _stride, _size = (
    torch.Tensor.data_ptr,
    torch.Tensor.stride,
    torch.Tensor.size,
)  # torch._C._FunctionBase.apply
