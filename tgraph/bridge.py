"""The autograd bridge: a graphed call is one ``autograd.Function`` node.

Forward copies the live inputs into the runner's static buffers (skipped when the live tensor is
the buffer), replays the forward graph and returns views of the static outputs. Backward copies
the incoming gradients into the static grad-output buffers, replays the backward graph and
returns the static input and parameter gradients; the parameters are inputs of the node, so
autograd accumulates their gradients and DDP / FSDP / Megatron hooks fire as in eager mode.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from tgraph.record import Flight
from tgraph.runner import Runner


def hand_to_autograd(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Gradients as handed to autograd: the static buffers themselves, never detached aliases.

    This is the gradient protection (module docstring of :mod:`tgraph.runner`): while the runner
    holds a reference, AccumulateGrad cannot adopt a buffer as ``.grad``, so the next replay
    cannot overwrite an accumulated gradient. Tests plant the bug by replacing this function.
    """
    return grads


class GraphedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: Runner, flight: Flight, n_inputs: int, *tensors: torch.Tensor):
        runner.fwd_graph.replay()
        ctx.runner, ctx.flight = runner, flight
        outs = tuple(o.detach() for o in runner.static_outputs)
        ctx.outs = outs  # the backward graph may read them as saved activations
        ctx.versions = [o._version for o in outs]
        ctx.mark_non_differentiable(
            *(o for o, s in zip(outs, runner.static_outputs) if not s.requires_grad)
        )
        return outs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads: torch.Tensor | None):
        runner, flight = ctx.runner, ctx.flight
        if runner.flight != id(flight):
            raise RuntimeError(
                f"backward through {runner} ran after its graph buffers were reused by a newer "
                "forward (a second backward with retain_graph=True, or a backward of an old step). "
                "Graphed modules support one backward per forward; use tgraph.reset() to go eager."
            )
        if any(o._version != v for o, v in zip(ctx.outs, ctx.versions)):
            raise RuntimeError(
                f"an output of {runner} was modified in place after its forward; its backward "
                "graph reads the graph's static outputs, so the gradient would be wrong. Clone "
                "the output before modifying it (y = block(x).clone())."
            )
        runner.copy_grad_outputs(grads)
        runner.bwd_graph.replay()
        runner.after_backward()
        flight.land()
        return (None, None, None, *hand_to_autograd(runner.static_grads))


def replay(runner: Runner, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Replay ``runner`` on live ``tensors``; None when the call must run eagerly instead."""
    if not runner.copy_inputs(tensors):
        return None
    if not runner.needs_backward:
        runner.fwd_graph.replay()
        return [o.detach() for o in runner.static_outputs]
    flight = Flight(runner)
    return list(GraphedCall.apply(runner, flight, len(tensors), *tensors, *runner.params))
