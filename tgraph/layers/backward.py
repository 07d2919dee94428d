"""The backward half of a graphed call: what :class:`tgraph.layers.replay.GraphedCall`'s
backward does once it has checked that this backward may run.

Like the forward replay, everything here works on the unit's frozen capture
result (:class:`tgraph.layers.captured.Captured`) and its
:class:`tgraph.layers.captured.ReplayState`: :func:`copy_grad_outputs` copies the incoming
gradients into the static grad-output buffers, :func:`replay_backward` replays the backward
graph (from the forward's generator offset when the unit recomputes), :func:`after_backward`
sets the ``main_grad`` flags the graph skips (and poisons the input buffers in debug mode), and
:func:`grads_for_autograd` hands autograd the input gradients and the parameter gradients
(aliases of their static buffers, which the pool's ledger moves out from under them before a
replay may overwrite them: :class:`tgraph.layers.grads.GradHandOff`).
"""

from __future__ import annotations

import math

import torch

from tgraph import rng
from tgraph.layers.captured import Captured, ReplayState


def copy_grad_outputs(cap: Captured, state: ReplayState, grads) -> None:
    """Refresh the static grad-output buffers; a None gradient means zeros.

    A buffer already known to hold zeros is not zeroed again (outputs whose gradient is
    always None, e.g. the inner outputs of a merged stack, cost no kernel per step).
    """
    zero = state.grad_out_zero
    for k, (buf, i) in enumerate(zip(cap.static_grad_outputs, cap.out_rg)):
        g = grads[i]
        if g is None:
            if not zero[k]:
                buf.zero_()
                zero[k] = True
        else:
            if g.data_ptr() != buf.data_ptr():
                buf.copy_(g)
            zero[k] = False


def replay_backward(cap: Captured, state: ReplayState) -> None:
    """Replay the backward graph; a recomputing unit's replays from the generator offset its
    forward replay started from.

    ``torch.utils.checkpoint`` saves the RNG state before the checkpointed forward and restores
    it before the recompute. Inside graphs that state is a position *within* the forward graph
    (CUDA), and the recompute inside the backward graph positions that graph's draws relative
    to the offset the backward graph replays from. Replaying the backward from the forward
    replay's offset (then putting the generator back where it was) makes the recompute draw the
    forward's numbers: the same dropout masks as eager checkpointing.
    """
    if not cap.recomputes or state.inflight.rng_at_forward is None:
        cap.bwd_graph.replay()
        return
    gen = rng.default_generator(cap.device)
    now = gen.get_state()
    gen.set_state(state.inflight.rng_at_forward)
    try:
        cap.bwd_graph.replay()
    finally:
        gen.set_state(now)
        state.inflight.rng_at_forward = None


def after_backward(cap: Captured, state: ReplayState, moved: list = ()) -> None:
    cap.flags.after_replay(moved)
    if cap.debug:  # stale reads show up as NaN instead of plausible numbers
        for buf, shared in zip(cap.static_inputs, cap.shared_inputs):
            if not shared:
                _poison(buf.detach())
        for buf in cap.static_grad_outputs:
            _poison(buf)
        state.grad_out_zero = [False] * len(cap.static_grad_outputs)


def grads_for_autograd(
    cap: Captured,
    state: ReplayState,
    active: tuple[bool, ...] | None = None,
    raw: bool = False,
) -> list[torch.Tensor | None]:
    """Input gradients + parameter gradients: aliases of their static buffers, which the pool's
    ledger protects, or copies of them (:class:`tgraph.layers.grads.GradHandOff`).

    ``active``: per differentiable output, whether autograd gave it a gradient; inputs and
    parameters that only inactive outputs reach get None (:class:`tgraph.layers.grads.UnusedOutputs`).
    ``raw``: the parameter gradients are the buffers themselves, for ``direct_grads`` adding
    them into existing ``.grad`` tensors (:meth:`~tgraph.layers.direct_grads.DirectRoute.adds`).
    """
    hand = state.grads
    kept = cap.fusion.keep(hand.for_autograd(raw))
    if not kept and state.route.autograd_params:  # the anchor leaf (see autograd_params)
        kept = [None]
    grads = [*hand.for_inputs(), *kept]
    if hand.aliased:  # rescued before the buffers may be overwritten
        cap.ledger.hold_grads(state, cap.bwd_index, hand.rescue, hand.storages, hand.baseline)
    if active is not None and not all(active):
        for pos in cap.unused.none_positions(active, state.none_at):
            grads[pos] = None
    return grads


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(math.nan)
