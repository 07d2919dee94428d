"""What a warmup or a capture may change, saved to be restored: one snapshot for per-layer
graphs (:func:`tgraph.create_graphs`), whole steps (:class:`tgraph.FullIterationGraph`) and
the optimizer-step graph (:class:`tgraph.OptimizerGraph`).

Warmups really run, and so does an emulated capture: they advance RNG state, accumulate into
``main_grad``, update module buffers (running statistics), and a whole step moves parameters,
gradients and optimizer state. A CUDA capture executes nothing, so for it only Python references
(``.grad``, optimizer state entries) and RNG states need keeping.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from tgraph import rng

# megatron-core's flag that a fused-wgrad kernel added a gradient into ``main_grad``
FLAG = "grad_added_to_main_grad"


def _clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


class Snapshot:
    """Training state saved at construction, put back by :meth:`restore`.

    Args:
        params: parameters: their ``.grad`` (reference), ``main_grad`` and
            ``grad_added_to_main_grad``.
        buffers: module buffers (running statistics and the like).
        device: the device whose generators to snapshot (CPU generators always are).
        optimizers: optimizers whose state entries to keep.
        params_values: also clone parameter and gradient values (a step that updates them runs).
        state_values: clone buffers, ``main_grad`` and optimizer-state values (False: a CUDA
            capture, which executes nothing).
        weak_grads: hold ``.grad`` by weak reference (a CUDA capture of a whole step): a
            gradient the captured step drops (``zero_grad(set_to_none=True)``) is freed during
            the capture instead of adding its size to the capture's peak, and restores as None,
            which is what the step leaves anyway.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        buffers: Iterable[torch.Tensor],
        device: torch.device | None,
        *,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        params_values: bool = False,
        state_values: bool = True,
        weak_grads: bool = False,
    ) -> None:
        params = list(params)
        self._device = device
        keep = _clone if params_values else (lambda t: None)
        state = _clone if state_values else (lambda t: None)
        self._params = [(p, keep(p)) for p in params]
        grad_ref = weakref.ref if weak_grads else (lambda t: t)
        self._grads = [
            (
                p,
                None if p.grad is None else grad_ref(p.grad),
                None if p.grad is None else keep(p.grad),
            )
            for p in params
        ]
        self._weak_grads = weak_grads
        self._main_grads = [
            (p, state(p.main_grad))
            for p in params
            if isinstance(getattr(p, "main_grad", None), torch.Tensor)
        ]
        self._flags = [(p, getattr(p, FLAG)) for p in params if hasattr(p, FLAG)]
        self._buffers = [(b, state(b)) for b in buffers]
        self._states = []
        for opt in optimizers:
            per_param = [
                (st, dict(st), {k: state(v) for k, v in st.items() if isinstance(v, torch.Tensor)})
                for st in opt.state.values()
            ]
            self._states.append((opt, set(opt.state), per_param))
        self._rng = rng.get_states(device)

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in self._params:
            if saved is not None:
                p.copy_(saved)
        for p, grad, saved in self._grads:
            if self._weak_grads and grad is not None:
                grad = grad()  # None: the captured code dropped it (zero_grad(set_to_none))
            p.grad = grad
            if saved is not None:
                grad.copy_(saved)
        for p, saved in self._main_grads:
            if saved is not None:
                p.main_grad.copy_(saved)
        for p, flag in self._flags:
            setattr(p, FLAG, flag)
        for b, saved in self._buffers:
            if saved is not None:
                b.copy_(saved)
        for opt, keys, per_param in self._states:
            for k in [k for k in opt.state if k not in keys]:
                del opt.state[k]
            for st, shallow, tensors in per_param:
                st.clear()
                st.update(shallow)
                for k, saved in tensors.items():
                    if saved is not None:
                        st[k].copy_(saved)
        rng.set_states(self._rng, self._device)
