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

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Operations a CUDA graph cannot contain: they read device values on the host (a sync) or make
# an output whose shape depends on them. `_local_scalar_dense` is `.item()` and every implicit
# `bool()`/`float()` of a tensor.
_REFUSED = {
    "aten::_local_scalar_dense": ".item(), float()/int()/bool() of a tensor or `if tensor:`",
    "aten::is_nonzero": "bool() of a tensor or `if tensor:`",
    "aten::equal": "torch.equal (returns a Python bool)",
    "aten::nonzero": "torch.nonzero / torch.where(cond) (data-dependent output shape)",
    "aten::argwhere": "torch.argwhere (data-dependent output shape)",
    "aten::masked_select": "masked_select / boolean-mask indexing (data-dependent output shape)",
    "aten::_unique": "torch.unique (data-dependent output shape)",
    "aten::_unique2": "torch.unique (data-dependent output shape)",
    "aten::unique_dim": "torch.unique (data-dependent output shape)",
    "aten::unique_consecutive": "torch.unique_consecutive (data-dependent output shape)",
    "aten::unique_dim_consecutive": "torch.unique_consecutive (data-dependent output shape)",
    "aten::bincount": "torch.bincount (output size read from the data)",
    "aten::_nested_tensor_from_mask": "a nested tensor from a padding mask (data-dependent sizes)",
    "aten::_nested_tensor_from_mask_left_aligned": "a check of a padding mask (a host read)",
}
_MASK_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def refusal(func, args: tuple, kwargs: dict) -> str | None:
    """What a CUDA capture of this operation would fail on, or None (a host read, or a
    data-dependent output shape)."""
    name = func._schema.name
    if name in _REFUSED:
        if name == "aten::_local_scalar_dense" and args and args[0].device.type == "meta":
            return None
        return _REFUSED[name]
    if name in _MASK_INDEXING:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        for t in indices or ():
            if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8):
                return "boolean-mask indexing x[mask] (data-dependent output shape)"
    if name == "aten::repeat_interleave" and kwargs.get("output_size") is None:
        if args and isinstance(args[0], torch.Tensor) and len(args) < 3:
            return "repeat_interleave with tensor repeats and no output_size"
    return None


# torch.tensor(data) hands its new tensor to these: a value from Python data, not a tensor's
_FROM_PYTHON = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}
_DRAWN = "a draw from the CPU's generator"  # a source no check can follow: each call draws anew


def _draws(func, flat: list[torch.Tensor], kwargs: dict) -> bool:
    """Whether ``func`` draws random numbers on the CPU (tagged as seeded, every tensor it
    takes, ``flat``, on the CPU: an attention kernel's dropout on the GPU draws there)."""
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    device = kwargs.get("device")
    return all(t.device.type == "cpu" for t in flat) and (device is None or device.type == "cpu")


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

    def __init__(
        self,
        device_type: str | None = None,
        generators: list[torch.Generator] | None = None,
        host_scalars: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self._device_type = device_type
        self._generators = generators  # None: do not check the generators drawn from
        # one-element CPU tensors read by an operation on device_type's tensors: a CUDA kernel
        # takes their value at capture (a plain tensor attribute that .cuda() left on the CPU)
        self._host_scalars = host_scalars
        # id -> (CPU scalar an operation of this pass made, the host scalars it was made from):
        # a graph keeps the value of a fresh one (an attention kernel's RNG seed and offset,
        # a `.float()` of an attribute) only as far as its sources keep theirs
        self._made: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    # A function compiled with torch.compile that is called under a dispatch mode runs its
    # Python eagerly, and dynamo may then never run it compiled again (TransformerEngine's
    # fused bias-GELU and bias-dropout-add: graphs of eager kernels, bf16 results off eager's
    # from the first replay). The checked pass asks for plain eager code instead, leaving
    # dynamo's caches alone.
    def _made_of(self, t: torch.Tensor) -> tuple | None:
        """The sources of ``t`` if this pass made it (:attr:`_made`), else None."""
        made = self._made.get(id(t))
        return made[1] if made is not None and made[0] is t else None

    def _note_host_scalars(self, flat: list[torch.Tensor]) -> None:
        if any(t.device.type == self._device_type for t in flat):
            for t in flat:
                if t.device.type == "cpu" and t.numel() == 1:
                    sources = self._made_of(t)
                    if sources is None:
                        self._host_scalars.append(t)
                    elif any(s is _DRAWN for s in sources):
                        raise CaptureError(
                            "a CUDA kernel reads a random number drawn on "
                            "the CPU in the forward; a graph keeps the capture's draw, so "
                            "every replay would repeat it. Draw on the GPU (torch.rand(..., "
                            "device=x.device)) or outside the graphed module."
                        )
                    else:  # made in this pass: its sources
                        self._host_scalars.extend(sources)

    def _note_made(self, flat: list[torch.Tensor], out) -> None:
        """Record the CPU scalars ``out`` holds that this pass made (new, or a view or alias of
        one made before) with the host scalars they were made from. A view of state, or one
        made from a larger CPU tensor, is not recorded: it is checked as itself. Anything made
        from a CPU draw, of any size, is recorded as drawn (``torch.rand(3).sum()``)."""
        cpu = [t for t in flat if t.device.type == "cpu"]
        drawn = any(_DRAWN in (self._made_of(t) or ()) for t in cpu)
        for o in tree_leaves(out):
            if not isinstance(o, torch.Tensor) or o.device.type != "cpu":
                continue
            # new, or made here and written in place (state written from a draw stays state,
            # checked as itself at every call)
            if drawn and (self._made_of(o) is not None or not any(o is t for t in cpu)):
                self._made[id(o)] = (o, (_DRAWN,))
                continue
            if o.numel() != 1:
                continue
            if any(o is t for t in cpu):
                # written in place: state stays state; one made in this pass takes the other
                # inputs' sources as well (or, where they cannot be followed, is checked as itself)
                before = self._made_of(o)
                if before is not None:
                    del self._made[id(o)]
                    made = self._sources([t for t in cpu if t is not o], aliased=False)
                    if made is not None:
                        self._made[id(o)] = (o, before + made)
                continue
            ptr = o.untyped_storage().data_ptr()
            aliased = [t for t in cpu if t.untyped_storage().data_ptr() == ptr]
            made = self._sources(aliased or cpu, aliased=bool(aliased))
            if made is not None:
                self._made[id(o)] = (o, made)

    def _sources(self, ins: list[torch.Tensor], aliased: bool) -> tuple[torch.Tensor, ...] | None:
        """The host scalars a new CPU scalar made from ``ins`` holds the value of (a view or
        alias, ``aliased``: those of its base); None for a view of state or a scalar made from
        a larger tensor, which is then checked as itself."""
        sources: list[torch.Tensor] = []
        for t in ins:
            made = self._made_of(t)
            if made is not None:
                sources.extend(made)
            elif t.numel() == 1 and not aliased:
                sources.append(t)
            else:
                return None
        return tuple(sources)

    def __enter__(self):
        stance = getattr(torch.compiler, "set_stance", None)  # torch >= 2.6
        self._stance = stance("force_eager") if stance is not None else contextlib.nullcontext()
        self._stance.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._stance.__exit__(None, None, None)
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stance.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = None
        if self._host_scalars is not None:
            flat = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self._note_host_scalars(flat)
        why = refusal(func, args, kwargs)
        if why is not None and (
            self._device_type is None
            or any(isinstance(a, torch.Tensor) and a.device.type == self._device_type for a in args)
        ):
            raise CaptureError(
                f"host synchronization during graph capture: {func._schema.name} ({why}). "
                "A CUDA graph cannot contain it; move it out of the captured region."
            )
        gen = kwargs.get("generator")
        if gen is not None and self._generators is not None:
            check_registered(gen, self._generators)
        out = func(*args, **kwargs)
        if flat is not None:
            if _draws(func, flat, kwargs):  # new, or written in place: each call draws anew
                for o in tree_leaves(out):
                    if isinstance(o, torch.Tensor):
                        self._made[id(o)] = (o, (_DRAWN,))
            elif func in _FROM_PYTHON:  # torch.tensor(x): x is Python state, which baked.py checks
                if isinstance(out, torch.Tensor):
                    self._made[id(out)] = (out, ())
            else:
                try:
                    self._note_made(flat, out)
                except RuntimeError:  # no storage to compare (a sparse tensor): not recorded,
                    pass  # so read as itself, as before this pass made it
        return out


def check_registered(gen: torch.Generator, registered: list[torch.Generator]) -> None:
    """Refuse a draw from ``gen`` unless it is one of ``registered`` (compared by the C++
    generator: a dispatch mode sees a new Python wrapper of the same one)."""
    if all(g._cdata != gen._cdata for g in registered):
        raise CaptureError(
            f"a graphed region draws from a torch.Generator ({gen!r}, device {gen.device}) "
            "that is not registered with the graph: every replay would repeat the capture's "
            "random numbers. Register it before capture with tgraph.register_generator(g)."
        )


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


LR_REPLACED_ERROR = (
    "{where}: 'lr' was assigned inside the captured step (group['lr'] = value inside fn, or an "
    "LR scheduler of older PyTorch stepping inside fn): the graph would replay that "
    "capture-time value at every step. Assign the learning rate (or step the scheduler) "
    "outside fn, before each step(batch); the new value reaches the graph through the "
    "learning-rate tensor."
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
    if "leaf Variable that requires grad is being used in an in-place operation" in str(exc):
        hint = (
            "The forward writes an input that requires grad in place (x += ..., x.mul_(...)); "
            "a graph's static inputs are leaves, which autograd does not let it write. Write it "
            "out of place (x = x + ...) to graph the module."
        )
    if "legacy stream depend on a capturing" in str(exc):
        hint += STALE_STREAM_HINT
    return CaptureError(f"capturing {what} failed: {type(exc).__name__}: {exc}. {hint}")
