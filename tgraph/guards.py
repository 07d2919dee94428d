"""Capture guards and capture errors: what a CUDA graph cannot contain, refused with a message
that names it, on both backends.

* :class:`RefuseHostSync` (dispatch mode): host syncs (``.item()``, data-dependent shapes).
* :class:`RefuseHostReads` (function mode): reading a tensor on the host without dispatch
  (printing, ``.tolist()``, ``.numpy()``).
* :class:`RefuseLrWrites` (function mode): a learning-rate tensor written inside a captured
  step (a scheduler stepping inside it).
* :class:`CaptureError` and :func:`explain_capture_failure`: the error every failed capture
  raises, naming the likely cause.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Host-side sync points: illegal while a CUDA stream is capturing. The emulated backend refuses
# them during capture so CPU tests see the same failure as the GPU.
_HOST_SYNC_OPS = {
    "aten::_local_scalar_dense": ".item(), float()/int()/bool() of a tensor, `if tensor:` or "
    "printing a tensor",
    "aten::nonzero": "torch.nonzero / boolean-mask indexing (data-dependent output shape)",
    "aten::masked_select": "masked_select / boolean-mask indexing (data-dependent output shape)",
    "aten::_unique2": "torch.unique (data-dependent output shape)",
    "aten::unique_consecutive": "torch.unique_consecutive (data-dependent output shape)",
    "aten::unique_dim": "torch.unique (data-dependent output shape)",
}

CAPTURE_HINT = (
    "Common causes: a host sync inside the captured region (.item(), bool(tensor), printing a "
    "tensor, torch.nonzero, boolean-mask indexing), a CPU tensor created or read inside it, or "
    "memory allocated outside the graph's pool. Move such code out of the graphed module or "
    "function."
)


class CaptureError(RuntimeError):
    """Raised when a graph could not be captured. The message names the likely cause."""


class RefuseHostSync(TorchDispatchMode):
    """Raise CaptureError on host-sync ops (run around a warmup pass to fail before capture).

    Args:
        device_type: refuse only syncs on tensors of this device type (``"cuda"`` for a CUDA
            warmup: ``.item()`` of a CPU tensor is harmless there, and megatron-core's RNG
            tracker does one); None refuses every sync (the emulated backend, whose "device"
            tensors live on the CPU).
    """

    def __init__(self, device_type: str | None = None) -> None:
        super().__init__()
        self._device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _HOST_SYNC_OPS and (
            self._device_type is None
            or any(isinstance(a, torch.Tensor) and a.device.type == self._device_type for a in args)
        ):
            raise CaptureError(
                f"host synchronization during graph capture: {name} ({_HOST_SYNC_OPS[name]}). "
                "A CUDA graph cannot contain it; move it out of the captured region."
            )
        return func(*args, **(kwargs or {}))


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


LR_WRITE_ERROR = (
    "a learning-rate tensor was written inside the captured step (an LR scheduler's "
    "step() inside fn?): the graph would replay that capture-time value at every "
    "step. Call scheduler.step() outside fn, after each step(batch); the new value "
    "reaches the graph through the learning-rate tensor."
)


def check_lr_unwritten(lr_tensors: list[torch.Tensor], versions: list[int]) -> None:
    """After a capture: raise CaptureError if an in-place write bumped a learning-rate
    tensor's version counter since ``versions`` were read. The after-the-fact form of
    :class:`RefuseLrWrites`, invisible to ``torch.compile`` (a torch function mode active at
    capture but not when dynamo compiled makes it recompile inside the capture)."""
    if any(t._version != v for t, v in zip(lr_tensors, versions, strict=True)):
        raise CaptureError(LR_WRITE_ERROR)


class RefuseLrWrites(TorchFunctionMode):
    """During capture: an in-place write into a learning-rate tensor means a scheduler steps
    inside ``fn``; a graph would replay the capture-time value forever."""

    def __init__(self, lr_tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._ids = {id(t) for t in lr_tensors}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.endswith("__") and args and id(args[0]) in self._ids:
            raise CaptureError(LR_WRITE_ERROR)
        return func(*args, **(kwargs or {}))


STALE_STREAM_HINT = (
    " A captured backward synchronized with the default stream: an AccumulateGrad node created "
    "on it before capture is still alive (DDP and megatron-core DDP keep them; so does a live "
    "loss of an eager step). Build the DDP wrapper under torch.cuda.stream(tgraph.capture_stream()), "
    "upgrade PyTorch (set_override_stale_capture_stream lets tgraph redirect the sync), or use "
    "per-layer graphs (tgraph.enable), which do not have this problem."
)


def explain_capture_failure(what: str, exc: BaseException) -> CaptureError:
    """Wrap an exception raised while capturing ``what`` into a CaptureError with the cause."""
    if isinstance(exc, CaptureError):
        return CaptureError(f"capturing {what} failed: {exc}")
    hint = CAPTURE_HINT
    if "Checkpointing is not compatible with .grad()" in str(exc):
        hint = (
            "Reentrant activation checkpointing (torch.utils.checkpoint.checkpoint with "
            "use_reentrant=True, or megatron's tensor_parallel.checkpoint) cannot run inside a "
            "graphed module: its backward graph differentiates with torch.autograd.grad. Use "
            "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
        )
    if "legacy stream depend on a capturing" in str(exc):
        hint += STALE_STREAM_HINT
    return CaptureError(f"capturing {what} failed: {type(exc).__name__}: {exc}. {hint}")
