"""How the parameters' ``.grad`` relate to a whole-step graph (:class:`tgraph.FullIterationGraph`).

A CUDA graph writes the gradient tensors it was captured with. How it writes them depends on what
``.grad`` was at the capture (:func:`grad_modes`): a gradient present before the capture is
accumulated into ("add"); a gradient the step creates is written fresh ("assign"), or the step
clears ``.grad`` itself ("cleared"). Before each replay (:func:`sync_grads_in`) the graph's
tensors get the values eager execution would add into, or a left-over gradient is refused.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


def grads_weakly(params: list[torch.Tensor]) -> dict[int, Any]:
    """Each parameter's ``.grad`` before the capture, weakly: a gradient the step drops is
    freed during the capture (its peak), not held."""
    return {id(p): None if p.grad is None else weakref.ref(p.grad) for p in params}


def grad_modes(params: list[torch.Tensor], before: dict[int, Any]) -> list[tuple]:
    """How each ``.grad`` relates to the graph. "add": the graph accumulates into the ``.grad``
    that existed at capture; "assign": it writes fresh gradients (``zero_grad`` with
    ``set_to_none=True`` ran before the capture; "cleared" when it ran inside ``fn``)."""
    modes = []
    for p in params:
        ref, g = before[id(p)], p.grad
        if g is None:
            continue
        if ref is None:
            mode = "assign"
        else:
            mode = "add" if g is ref() else "cleared"
        modes.append((p, g, mode))
    return modes


def sync_grads_in(grads: list[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
    """Before a replay: make the graph see the ``.grad`` that eager execution would
    accumulate into (``grads``: :func:`grad_modes`).

    Raises:
        ValueError: a gradient left over where the graph overwrites instead of adding.
    """
    for p, g, mode in grads:
        live = p.grad
        if mode == "add":  # the graph adds into g: give it the live starting value
            if live is not g:
                g.zero_() if live is None else g.copy_(live)
        elif mode == "assign" and live is not None:
            # The graph overwrites g, eager execution would add to ``live``: refused, also when
            # ``live`` is g itself, the last replay's gradient nobody zeroed (accumulation
            # over calls with the optimizer outside fn).
            raise ValueError(
                "FullIterationGraph: a parameter's .grad holds a gradient before this step, "
                "but the step was captured with .grad set to None, so the graph overwrites "
                "it instead of accumulating into it as eager execution would. Call "
                "optimizer.zero_grad(set_to_none=True) before each step, or accumulate "
                "inside fn (pass a list of microbatches)."
            )


__all__ = ["grad_modes", "grads_weakly", "sync_grads_in"]
