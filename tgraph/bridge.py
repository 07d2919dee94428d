"""The autograd bridge: a replayed unit is one ``autograd.Function`` node.

Forward replays the forward graph (the unit has copied the live inputs into its static buffers)
and returns views of the static outputs. Backward copies the incoming gradients into the static
grad-output buffers, replays the backward graph and returns the static input gradients and the
parameter gradients (on PyTorch >= 2.13 views of the packed static buffer, which the pool's
ledger moves out from under them before a replay may overwrite it; before 2.13 views of a fresh
clone: :class:`tgraph.grads.ParamGradPacking`); the parameters are inputs of the node, so autograd
accumulates their gradients and DDP / FSDP / Megatron hooks fire as in eager mode. ``unit`` is a
:class:`tgraph.unit.GraphedUnit`.
"""

from __future__ import annotations

from typing import Any

import torch

from tgraph.errors import StaleBackwardError


class GraphedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unit: Any, flight: Any, *tensors: torch.Tensor):
        unit.fwd_graph.replay()
        ctx.unit, ctx.flight = unit, flight
        # An output the loss did not use gets None, not zeros: then the parameters only it
        # reaches get no gradient, as in eager (tgraph.grads.UnusedOutputs).
        ctx.set_materialize_grads(False)
        outs = tuple([o.detach() for o in unit.static_outputs])
        # The backward graph may read the outputs as saved activations: saving them lets
        # autograd check their version counters (an in-place change raises, as in eager).
        # Keeping them on ctx instead would make a reference cycle through the autograd node.
        ctx.save_for_backward(*outs)
        if unit._out_nodiff:  # marking none is the default
            ctx.mark_non_differentiable(*[outs[i] for i in unit._out_nodiff])
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        unit, flight = ctx.unit, ctx.flight
        if torch.is_grad_enabled():  # backward(create_graph=True), e.g. a gradient penalty
            raise RuntimeError(
                f"tgraph: double backward through the graphed {unit} is not supported (its "
                "backward is a replayed graph, which autograd cannot differentiate). Run that "
                "module eagerly for this loss: call it with a signature that was not recorded, "
                "or tgraph.disable(model) for the gradient-penalty step."
            )
        if unit.flight != id(flight):
            raise StaleBackwardError(
                f"backward through {unit} ran after its graph buffers were reused by a newer "
                "forward (a second backward with retain_graph=True, or a backward of an old step). "
                "Graphed modules support one backward per forward; use tgraph.reset() to go eager."
            )
        try:
            ctx.saved_tensors  # noqa: B018 - unpacking checks the version counters
        except RuntimeError as exc:
            raise RuntimeError(
                f"an output of {unit} was modified in place after its forward; its backward "
                "graph reads the graph's static outputs, so the gradient would be wrong. Clone "
                "the output before modifying it (y = block(x).clone())."
            ) from exc
        unit.fusion.check()
        active = tuple(grads[i] is not None for i in unit._out_rg)
        if not any(active):  # nothing reached this node's outputs: no gradient anywhere
            flight.land()
            return (None,) * len(ctx.needs_input_grad)
        unit.ledger.before_backward(flight, unit)
        unit.copy_grad_outputs(grads)
        unit.replay_backward()  # tgraph.unit: the RNG offset a recompute needs
        unit.after_backward()
        flight.land()
        return (None, None, *unit.grads_for_autograd(active=active))
