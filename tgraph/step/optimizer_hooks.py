"""The extension surface of :class:`tgraph.OptimizerGraph`: the public hooks a subclass that
steps another kind of optimizer overrides (megatron-core's, in
:mod:`tgraph.integrations.megatron_optimizer`), and their defaults, which step a torch optimizer
and own ``.grad`` buffers (:class:`tgraph.step.grad_buffers.GradBuffers`).

The hooks read the public :class:`tgraph.OptimizerGraph` attributes they need (``optimizer``,
``clip_grad_norm``, ``norm_type``, ``guard``, ``bound_grads``); each runs inside the captured
step or around it as its docstring says, and none may sync with the host.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tgraph.step.grad_buffers import GradBuffers
from tgraph.step.nonfinite import total_norm

# The private hooks of earlier releases, and the public hooks that replace them.
_OLD_HOOKS = {
    "_protected_extra": "protected_tensors",
    "_norm_and_clip": "norm_and_clip",
    "_inner_step": "inner_step",
    "_grad_ownership": "bind_grads",
    "_check_grads": "refresh_grads",
}


class OptimizerHooks:
    """The hooks of :class:`tgraph.OptimizerGraph` (module docstring).

    Extension points, for a subclass that steps another kind of optimizer (the defaults step
    ``optimizer`` and own ``.grad`` buffers; :class:`tgraph.integrations.megatron_optimizer.
    MegatronOptimizerGraph` overrides them for megatron-core's optimizer):

    * :attr:`optimizers`: the torch optimizers the step runs (their learning rates reach the
      graph, their state is snapshotted and checked);
    * :meth:`params`: the parameters whose gradients the step reads;
    * :meth:`protected_tensors`: tensors besides those a skipped step restores;
    * :meth:`norm_and_clip`: the gradient norm (and clipping) before the step;
    * :meth:`inner_step`: the step itself;
    * :meth:`bind_grads`: at capture, the gradient buffers the graph reads;
    * :meth:`refresh_grads`: before each replay, bring the step's gradients into them.

    Each runs inside the captured step or around it as its docstring says; none may sync with
    the host. (The underscore names of earlier releases still work for one release, with a
    ``DeprecationWarning``.)
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in _OLD_HOOKS.items():
            if old in cls.__dict__ and new not in cls.__dict__:
                warnings.warn(
                    f"{cls.__name__}.{old} overrides a private hook of OptimizerGraph, which is "
                    f"deprecated; override {new}() instead",
                    DeprecationWarning,
                    stacklevel=2,
                )
                setattr(cls, new, cls.__dict__[old])

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers the step runs (their learning rates reach the graph)."""
        return [self.optimizer]

    def params(self) -> list[torch.Tensor]:
        """The parameters whose gradients the step reads (default: the optimizers')."""
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"]]

    def norm_and_clip(self) -> torch.Tensor | None:
        """Inside the step, first: the total gradient norm before clipping (a 0-dim device
        tensor), after clipping to ``clip_grad_norm``; None when neither clipping nor skipping
        needs it."""
        grads = [p.grad for p in self.params() if p.grad is not None]
        if self.clip_grad_norm is not None:
            return torch.nn.utils.clip_grad_norm_(
                self.params(), self.clip_grad_norm, self.norm_type
            )
        if self.guard is not None:
            return total_norm(grads, self.norm_type)
        return None

    def protected_tensors(self) -> list[torch.Tensor]:
        """Tensors besides the optimizers' parameters and state that a skipped step restores
        (default: none)."""
        return []

    def inner_step(self) -> None:
        """Inside the step, after :meth:`norm_and_clip`: the optimizer step itself."""
        self.optimizer.step()

    def bind_grads(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """At capture, before the step is captured: the gradient buffers the graph reads.

        Returns:
            ``(pairs, gradless)``: ``(parameter, buffer)`` for every gradient the graph reads
            (at a fixed address), and the parameters it never steps (they must keep
            ``.grad`` None; checked at every replay). The default
            (:class:`tgraph.step.grad_buffers.GradBuffers`) reads the gradients per-layer
            graphs hand over where they leave them and gives every other gradient a buffer
            of the graph's own (one flat allocation), filled with this step's gradients and
            made the parameters' ``.grad``.

        Raises:
            ValueError: no gradient to step.
        """
        self._buffers = GradBuffers.bind(self.params())
        return list(self._buffers.pairs), list(self._buffers.gradless)

    def refresh_grads(self) -> None:
        """Before a replay (no grad mode): copy the step's gradients into the graph's buffers
        where they are not there already (:meth:`tgraph.step.grad_buffers.GradBuffers.refresh`;
        a copy that would overwrite a gradient kept elsewhere makes this step run eagerly).

        Raises:
            ValueError: a gradient the graph reads is missing, or a parameter it never steps
                has one now (call :meth:`reset`).
        """
        self._buffers.refresh()


__all__ = ["OptimizerHooks"]
