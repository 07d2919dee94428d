"""What a captured training step reads and changes, for :mod:`tgraph.full_iteration`.

* :class:`HyperParams`: the optimizers' hyper-parameters. A graph bakes every Python number it
  reads, so learning rates move into device tensors that schedulers keep updating, and a value
  that cannot (a float another optimizer reads on the host) is refused or warned about.
* :class:`RefuseHostReads` / :class:`RefuseLrWrites`: capture-time guards against reading a
  tensor on the host and against a scheduler stepping inside the captured function.
* :class:`EmulatedStepGraph`: the CPU stand-in for a whole-step CUDA graph, freezing Python
  hyper-parameters at their capture values as a real graph would.
* :class:`StepSnapshot`: the training state a capture may change, restored after an emulated
  capture or a failed one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from tgraph import rng
from tgraph.backend import (
    CaptureError,
    EmulatedGraph,
    RefuseHostSync,
    _default_generators,
    emulated_capture,
)


def holds_tensor_lr(group: dict) -> bool:
    """Whether this param_group's optimizer reads a tensor ``lr`` without a host sync."""
    return bool(group.get("fused") or group.get("capturable"))


def detach_clone(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


class HyperParams:
    """The optimizer hyper-parameters a captured step reads, and how they reach the graph."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._groups = [
            (type(o).__name__, i, g) for o in optimizers for i, g in enumerate(o.param_groups)
        ]
        self._converted: list[tuple[dict, torch.Tensor, float]] = []
        self._tensor_lrs: list[tuple[dict, torch.Tensor]] = []
        self._baked: list[tuple[str, int, dict, str, Any]] = []

    def prepare(self) -> None:
        """Move float learning rates into device tensors; remember the values a graph bakes."""
        for _, _, g in self._groups:
            lr = g["lr"]
            if not isinstance(lr, torch.Tensor) and holds_tensor_lr(g):
                # float32: the fused kernels read the tensor lr as float (FusedAdamKernel.cu).
                t = torch.tensor(float(lr), dtype=torch.float32, device=g["params"][0].device)
                self._converted.append((g, t, lr))
                g["lr"] = t
        self._tensor_lrs = [
            (g, g["lr"]) for _, _, g in self._groups if isinstance(g["lr"], torch.Tensor)
        ]
        self._baked = [
            (name, i, g, k, v)
            for name, i, g in self._groups
            for k, v in g.items()
            if k not in ("params", "initial_lr") and not isinstance(v, torch.Tensor)
        ]

    def refresh(self) -> None:
        """Before a replay: bring replaced learning rates into their tensors; refuse baked changes."""
        self._refresh_tensor_lrs()
        self._check_baked()

    def _refresh_tensor_lrs(self) -> None:
        for g, t in self._tensor_lrs:
            live = g["lr"]
            if live is not t:  # a scheduler (older PyTorch) or the user assigned a new value
                with torch.no_grad():
                    t.copy_(live) if isinstance(live, torch.Tensor) else t.fill_(float(live))
                g["lr"] = t

    def _check_baked(self) -> None:
        for name, i, g, k, v in self._baked:
            if g.get(k, v) != v:
                fix = (
                    f"build {name} with fused=True (or capturable=True for Adam/AdamW) so tgraph "
                    "holds the learning rate in a device tensor"
                    if k == "lr"
                    else "call step.reset() to capture again with the new value"
                )
                raise ValueError(
                    f"{name} param_group {i}: {k!r} changed from {v!r} to {g[k]!r} after capture, "
                    f"but the captured graph baked {v!r} into its kernels. To fix: {fix}."
                )

    def restore(self) -> None:
        """Undo :meth:`prepare`: float learning rates again (current values)."""
        for g, t, _ in self._converted:
            if g["lr"] is t:
                g["lr"] = float(t)
        self._converted.clear()


# Tensor methods that read a tensor's values on the host without `_local_scalar_dense` (printing
# disables dispatch modes, so the backend's host-sync guard cannot see it): illegal in a CUDA graph.
HOST_READS = {
    torch.Tensor.__repr__: "printing a tensor (repr)",
    torch.Tensor.__str__: "printing a tensor (str)",
    torch.Tensor.__format__: "formatting a tensor (f-string)",
    torch.Tensor.tolist: ".tolist()",
    torch.Tensor.numpy: ".numpy()",
}


class RefuseHostReads(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            raise CaptureError(
                f"host synchronization during graph capture: {HOST_READS[func]} (reads the "
                "tensor on the host, like .item()). A CUDA graph cannot contain it; move it out "
                "of the captured step."
            )
        return func(*args, **(kwargs or {}))


class RefuseLrWrites(TorchFunctionMode):
    """During capture: an in-place write into a learning-rate tensor means a scheduler steps
    inside ``fn``; a graph would replay the capture-time value forever."""

    def __init__(self, lr_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._ids = {id(t) for t in lr_tensors}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args and id(args[0]) in self._ids:
            raise CaptureError(
                "a learning-rate tensor was written inside the captured step (an LR scheduler's "
                "step() inside fn?): the graph would replay that capture-time value at every "
                "step. Call scheduler.step() outside fn, after each step(batch); the new value "
                "reaches the graph through the learning-rate tensor."
            )
        return func(*args, **(kwargs or {}))


class EmulatedStepGraph(EmulatedGraph):
    """Emulated graph of a whole step (backward inside the captured function).

    Replays re-run the function as :class:`~tgraph.backend.EmulatedGraph` does, without its
    saved-tensor bookkeeping (the backward runs inside the function), and with every Python value
    of the optimizers' param_groups set to its capture value for the duration of the replay: a
    CUDA graph bakes those floats into its kernels, so a learning rate that did not reach a
    tensor is frozen here exactly as on a GPU.
    """

    def __init__(self, groups: list[dict]) -> None:
        super().__init__()
        self._groups = groups
        self._frozen_hparams: list[tuple[dict, dict]] = []

    def capture(self, fn: Callable[[], Any]) -> Any:
        known = _default_generators() + [
            g for g in rng.extra_generators() if g.device.type == "cpu"
        ]
        self._frozen = [
            (g, g.get_state()) for g in known if all(g is not r for r in self._registered)
        ]
        with RefuseHostSync(), RefuseHostReads(), emulated_capture():
            out = fn()
        self._fn = fn
        self._outputs = tree_leaves(out)
        self._frozen_hparams = [
            (g, {k: v for k, v in g.items() if k != "params"}) for g in self._groups
        ]
        return out

    def replay(self) -> None:
        assert self._fn is not None, "replay() before capture()"
        live_rng = [(g, g.get_state()) for g, _ in self._frozen]
        live_hparams = [
            (g, {k: g[k] for k in frozen if k in g}) for g, frozen in self._frozen_hparams
        ]
        try:
            for g, state in self._frozen:
                g.set_state(state)
            for g, frozen in self._frozen_hparams:
                g.update(frozen)
            with emulated_capture():
                out = self._fn()
            with torch.no_grad():
                for dst, src in zip(self._outputs, tree_leaves(out), strict=True):
                    if isinstance(dst, torch.Tensor) and dst is not src:
                        dst.copy_(src)
        finally:
            for g, state in live_rng:
                g.set_state(state)
            for g, live in live_hparams:
                g.update(live)


class StepSnapshot:
    """Training state a capture may change: restored after an emulated capture or a failure.

    Args:
        values: also clone tensor values (parameters, gradients, optimizer state, buffers);
            needed when the capture really executes (emulated). A CUDA capture executes nothing,
            so only Python references (``.grad``) and RNG states are kept.
    """

    def __init__(self, params, optimizers, buffers, device: torch.device, values: bool) -> None:
        clone = detach_clone if values else (lambda t: None)
        self._device = device
        self._params = [(p, clone(p)) for p in params]
        self._grads = [(p, p.grad, None if p.grad is None else clone(p.grad)) for p in params]
        self._states = []
        for opt in optimizers:
            per_param = [
                (st, dict(st), {k: clone(v) for k, v in st.items() if isinstance(v, torch.Tensor)})
                for st in opt.state.values()
            ]
            self._states.append((opt, set(opt.state), per_param))
        self._buffers = [(b, clone(b)) for b in buffers]
        self._rng = rng.get_states(device)

    @torch.no_grad()
    def restore(self) -> None:
        for p, saved in self._params:
            if saved is not None:
                p.copy_(saved)
        for p, grad, saved in self._grads:
            p.grad = grad
            if saved is not None:
                grad.copy_(saved)
        for opt, keys, per_param in self._states:
            for k in [k for k in opt.state if k not in keys]:
                del opt.state[k]
            for st, shallow, tensors in per_param:
                st.clear()
                st.update(shallow)
                for k, saved in tensors.items():
                    if saved is not None:
                        st[k].copy_(saved)
        for b, saved in self._buffers:
            if saved is not None:
                b.copy_(saved)
        rng.set_states(self._rng, self._device)
