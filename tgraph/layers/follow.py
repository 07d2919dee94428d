"""What a replay follows instead of falling back: changes found by :func:`tgraph.layers.replay.check`.

A parameter or buffer re-pointed after capture (``p.data = ...``) is copied into the memory the
graph reads at each call (:func:`follow_moved`); gradients go to the tensors the modules hold now
(:func:`route`); outputs of the last replay that the caller still holds get memory of their own
before the graph overwrites them (:func:`move_out_held_outputs`). These run only when the
capture result's checks found a difference, never on an unchanged replay.
"""

from __future__ import annotations

import logging

import torch

from tgraph.layers import grads as grads_module
from tgraph.layers.captured import Captured, ReplayState
from tgraph.pool import move_memory_out, storage_uses, use_counts

logger = logging.getLogger(__name__)


def follow_moved(cap: Captured, state: ReplayState, live: tuple[torch.Tensor, ...], now: tuple):
    """Parameters or buffers re-pointed after capture (``p.data = ...``): copied into the
    memory the graph reads at each call, unless that memory is in use elsewhere. ``now``:
    :func:`tgraph.baked.where` of ``live``; decided again whenever it changes (a parameter
    followed already may be re-pointed again, to another dtype or layout)."""
    b = cap.baked
    if now != state.route.followed:
        moved = b.moved(now)
        why = b.relaid(live, moved)
        if why is not None:
            return why
        for i in moved:
            if storage_uses(b.held[i]) > cap.own_uses[i]:
                return (
                    f"{b.names[i]} lives in other memory than at capture (p.data = ...), "
                    "and the memory the graph reads is in use elsewhere, so a copy into it "
                    "would overwrite another tensor (an EMA swap, a state_dict() kept from "
                    "before the load, or the old parameter still held)"
                )
        why = b.incompatible(live)
        if why is not None:
            return why
        if moved:
            logger.info(
                "tgraph: %s: following %s, re-pointed after capture, by a copy into the "
                "graph's memory at each call (tgraph.reset() and create_graphs() graph it "
                "without the copy)",
                cap.name,
                ", ".join(b.names[i] for i in moved),
            )
        state.route.copy_in, state.route.followed = moved, now
        # The held AccumulateGrad nodes (torch renews a leaf's node when its dtype changes, as
        # in model.double().float()) and direct_grads' route (a parameter laid out otherwise
        # gets autograd's path, whose AccumulateGrad gives .grad the parameter's strides).
        set_params(cap, state, state.route.params)
    if state.route.copy_in:
        with torch.no_grad():
            for i in state.route.copy_in:
                b.held[i].copy_(live[i])
        state.route.live = live
    return None


def route(cap: Captured, state: ReplayState, live: tuple[torch.Tensor, ...]) -> None:
    """Hand the parameters' gradients to ``live`` (the modules' current tensors)."""
    set_params(cap, state, [p if k is None else live[k] for p, k in zip(cap.params, cap.slot)])
    state.route.rerouted = any(r() is not t for r, t in zip(cap.baked.refs, live))


def set_params(cap: Captured, state: ReplayState, params: list[torch.Tensor]) -> None:
    """Where the gradients go: ``params``, the autograd node's inputs among them (with
    ``direct_grads``, the anchor and those that keep autograd's path:
    :class:`tgraph.layers.direct_grads.DirectRoute`), and those leaves' gradient accumulators, held.

    Autograd holds a leaf's AccumulateGrad node only weakly (through the graph's edges), so
    without a holder every step's ``Function.apply`` builds each one anew and its backward
    frees them: about 0.2 us a parameter on the head's host path (DDP holds them the same
    way, for its hooks)."""
    state.route.params = params
    kept = cap.fusion.keep(params)
    state.route.direct = cap.direct.route(kept, cap.device) if kept else None
    if state.route.direct is not None:  # direct_grads: the anchor stands in for the direct ones
        state.route.autograd_params = state.route.direct.inputs()
    else:
        state.route.autograd_params = autograd_params(cap, params)
    with torch.enable_grad():
        state.route.accumulators = [
            p.view_as(p).grad_fn.next_functions[0][0]
            for p in state.route.autograd_params
            if p.requires_grad and p.is_leaf
        ]


def autograd_params(cap: Captured, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters the autograd node takes: all but those fused into ``main_grad``.

    When fusion leaves the node no input that requires grad, a zero-dim anchor leaf takes
    their place: without one, the node's outputs would not require grad and its backward
    (which adds the fused gradients) would never run.
    """
    kept = cap.fusion.keep(params)
    if params and not kept and not any(t.requires_grad for t in cap.static_inputs):
        return [torch.zeros((), device=cap.device, requires_grad=True)]
    return kept


def move_out_held_outputs(cap: Captured, state: ReplayState) -> str | None:
    """Before the forward replays again: outputs of its last replay that the caller still
    holds (a ``.detach()`` or a view kept across steps) get their own memory."""
    uses = list(state.outputs.uses)
    for i, o in enumerate(cap.static_outputs):
        if use_counts((state.outputs.cdata[i],))[0] > uses[i]:
            last = state.inflight.last_outputs
            token = last() if last is not None and last is not state.outputs.rescued else None
            if token is not None:  # the returned tensors themselves: re-pointed, one copy
                token.rescue()
                state.outputs.rescued = last
            if use_counts((state.outputs.cdata[i],))[0] <= uses[i]:
                continue
            if not grads_module.swaps_storage():
                return (
                    "an output of its previous call (or a view or .detach() of it) is still "
                    "held, and this PyTorch cannot move it out of the graph's memory "
                    "(UntypedStorage._swap_data_ptr_, PyTorch >= 2.13); clone outputs you keep"
                )
            move_memory_out(o, list(cap.output_internal[i]))
            state.outputs.cdata = output_cdata(cap.static_outputs)  # o has a new storage
            uses[i] = use_counts((state.outputs.cdata[i],))[0]
    state.outputs.uses = tuple(uses)
    return None


def track_outputs(cap: Captured, state: ReplayState) -> None:
    """The static outputs' storages and their uses by tgraph alone, at bake: a replay finds a
    held output by a use count above these."""
    state.outputs.cdata = output_cdata(cap.static_outputs)
    state.outputs.uses = use_counts(state.outputs.cdata)


def unfollow(state: ReplayState) -> None:
    """A new capture result over the same graphs (:meth:`tgraph.layers.capture.GraphedUnit.rebind`):
    nothing is followed yet; :func:`tgraph.layers.replay.check` decides anew."""
    state.route.copy_in, state.route.rerouted, state.route.followed = [], False, None


def output_cdata(outputs) -> tuple[int, ...]:
    """Each output's storage, as :func:`tgraph.pool.use_counts` reads it (the outputs keep
    them alive)."""
    return tuple(o.untyped_storage()._cdata for o in outputs)
