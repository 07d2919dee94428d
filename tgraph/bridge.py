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

from tgraph.pool import LiveOutputs
from tgraph.record import Flight
from tgraph.runner import Runner


def hand_to_autograd(runner: Runner, active: tuple[bool, ...]) -> list[torch.Tensor | None]:
    """Gradients as handed to autograd: never the static parameter-gradient memory itself.

    This is the gradient protection (:class:`tgraph.grads.ParamGradPacking`): parameter
    gradients are views of a fresh clone, so the next replay cannot overwrite a gradient that
    autograd accumulated. Tests plant the bug by replacing this function.
    """
    return runner.grads_for_autograd(active=active)


class GraphedCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, runner: Runner, flight: Flight, *tensors: torch.Tensor):
        runner.fwd_graph.replay()
        ctx.runner, ctx.flight = runner, flight
        # An output the loss did not use gets None, not zeros: then the parameters only it
        # reaches get no gradient, as in eager (tgraph.runner.UnusedOutputs).
        ctx.set_materialize_grads(False)
        outs = tuple(o.detach() for o in runner.static_outputs)
        # The backward graph may read the outputs as saved activations: saving them lets
        # autograd check their version counters (an in-place change raises, as in eager).
        # Keeping them on ctx instead would make a reference cycle through the autograd node.
        ctx.save_for_backward(*outs)
        ctx.mark_non_differentiable(*(outs[i] for i in runner._out_nodiff))
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
        try:
            ctx.saved_tensors  # noqa: B018 - unpacking checks the version counters
        except RuntimeError as exc:
            raise RuntimeError(
                f"an output of {runner} was modified in place after its forward; its backward "
                "graph reads the graph's static outputs, so the gradient would be wrong. Clone "
                "the output before modifying it (y = block(x).clone())."
            ) from exc
        runner.fusion.check()
        active = tuple(grads[i] is not None for i in runner._out_rg)
        if not any(active):  # nothing reached this node's outputs: no gradient anywhere
            flight.land()
            return (None,) * len(ctx.needs_input_grad)
        runner.ledger.before_backward(flight, runner)
        runner.copy_grad_outputs(grads)
        runner.bwd_graph.replay()
        runner.after_backward()
        flight.land()
        return (None, None, *hand_to_autograd(runner, active))


def hold_while_alive(runner: Runner, outputs: list[torch.Tensor]) -> None:
    """Keep ``runner`` in flight while any of ``outputs`` is alive.

    A call without backward (no_grad, frozen or parameter-free modules) has no backward to wait
    for, yet its outputs are the static buffers the next replay overwrites: ``a = enc(x1);
    b = enc(x2)`` must not make ``a`` equal ``b``. While an output lives, the next call gets
    another runner (recording) or runs eagerly with a warning (after capture). Views taken
    of an output and kept after the output itself is dropped are not tracked.
    """
    if outputs:
        flight = Flight(runner, held=True)
        for o in outputs:
            o._tgraph_flight = flight


def replay(runner: Runner, tensors: list[torch.Tensor]) -> list[torch.Tensor] | str:
    """Replay ``runner`` on live ``tensors``; the reason when the call must run eagerly instead."""
    unsafe = runner.ledger.unsafe_forward(runner)
    if unsafe is not None:
        return unsafe
    if not runner.copy_inputs(tensors):
        return (
            "an input captured as another graphed module's output buffer arrived as a different "
            "tensor"
        )
    if not runner.needs_backward:
        runner.fwd_graph.replay()
        outs = [o.detach() for o in runner.static_outputs]
        hold_while_alive(runner, outs)
        LiveOutputs(runner.ledger, runner, outs)
        return outs
    flight = Flight(runner)
    outs = list(GraphedCall.apply(runner, flight, *tensors, *runner.autograd_params))
    LiveOutputs(runner.ledger, runner, outs)  # no other graph overwrites them (tgraph.pool)
    return outs
