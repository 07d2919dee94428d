"""Call signatures: what a graph was captured for, and how a new call differs from it.

A graph replays fixed kernels on fixed buffers, so it is valid only for calls that match its
capture in every tensor's shape, dtype, device and requires_grad, in every non-tensor argument's
value, in the ``training`` flags of the module and its submodules, in grad mode, autocast and
the SDPA backend selection (:class:`SDPASelection`).
:func:`call_key` reduces a call to a hashable :class:`CallKey`; :func:`difference` turns two keys
into the sentence a warning or error shows. Nested arguments and outputs (tuples, lists, dicts,
named tuples, Hugging Face ``ModelOutput``) are walked once, with ``torch.utils._pytree``;
:class:`Template` keeps a structure with its tensors taken out, to be filled again.
"""

from __future__ import annotations

import contextlib
import enum
import operator
from collections.abc import Iterator
from sys import modules as _sys_modules
from typing import Any, NamedTuple

import torch
import torch.autograd.forward_ad as forward_ad
import torch.utils._pytree as pytree

from tgraph.fp8 import _QUANT as FP8_MODULE
from tgraph.fp8 import region as fp8_region


class Template(NamedTuple):
    """A nested structure with its tensors taken out (no memory pinned)."""

    spec: pytree.TreeSpec
    leaves: tuple  # the non-tensor leaves; None where a tensor goes
    tensor_at: tuple[int, ...]  # leaf positions of the tensors
    bare: bool = False  # the structure is one tensor: fill() returns it (the common case)

    def fill(self, tensors: list[torch.Tensor]) -> Any:
        """The structure again, with ``tensors`` in the tensors' places."""
        if self.bare:
            return tensors[0]
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_at, tensors, strict=True):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)


def split(obj: Any) -> tuple[list[torch.Tensor], Template]:
    """``obj``'s tensors (in pytree order) and the template to rebuild it around others."""
    leaves, spec = pytree.tree_flatten(obj)
    at = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    tensors = [leaves[i] for i in at]
    for i in at:
        leaves[i] = None
    return tensors, Template(spec, tuple(leaves), at, bool(at) and spec.is_leaf())


class CallKey(NamedTuple):
    """What a graph was captured for: one graphed call, reduced to hashable values."""

    tree: Structure
    """Structure of ``(args, kwargs)``, interned: compared and hashed by identity."""
    leaves: tuple
    """Per leaf of the arguments, its description (:func:`describe`)."""
    training: tuple[bool, ...]
    """``training`` of the module and of each of its submodules (``module.modules()`` order)."""
    grad: bool
    """Grad mode."""
    autocast: tuple
    """``((device_type, dtype), ...)`` of the active autocast regions, then the SDPA backend
    selection and TransformerEngine's region where they apply (:func:`autocast_key`)."""
    frozen: tuple[bool, ...]
    """``requires_grad`` of the module's parameters."""


# Non-tensor arguments whose value a graph may bake in: compared by value, immutable.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class MutableArgument(TypeError):
    """A graphed call got an argument that a graph cannot stand for: a Python object compared
    by identity (:func:`describe`), a tensor carrying a forward-mode AD tangent
    (:func:`refuse_transformed`)."""


def describe(leaf: Any, where: str) -> Any:
    """Hashable description of one argument leaf (``where`` names it in errors).

    Raises:
        MutableArgument: an object compared by identity (a cache, a state holder): a graph
            replays kernels, not Python, so whatever the module does to the object would not
            happen at replay, and a new object at each call matches nothing.
        TypeError: a non-tensor argument that is not hashable (it cannot key a graph).
    """
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad, _contiguous(leaf))
    if not isinstance(leaf, _VALUE_TYPES) and _compared_by_identity(leaf):
        raise MutableArgument(
            f"{where} is a {type(leaf).__name__} object, compared by identity: a graph replays "
            "kernels, not Python, so what the module does to this object (a key/value cache "
            "appending tensors, say) would not happen at replay, and a new object at each call "
            "matches no graph. Pass tensors or plain values instead; for Hugging Face models "
            "pass use_cache=False when training."
        )
    try:
        hash(leaf)
    except TypeError:
        raise TypeError(
            f"{where} is an unhashable {type(leaf).__name__}; graphs are keyed by argument "
            "values, so pass tensors, numbers, strings, None or tuples of them"
        ) from None
    return (type(leaf), leaf)


def _compared_by_identity(obj: Any) -> bool:
    """An instance of a plain class: neither value equality nor hashing of its own.

    Functions, classes, modules and enums are identity-compared too, but they are constants of
    the program, not state that the call mutates.
    """
    if callable(obj) or isinstance(obj, (type, enum.Enum, torch.nn.Module)):
        return False
    cls = type(obj)
    return cls.__eq__ is object.__eq__ and cls.__hash__ is object.__hash__


def autocast_state() -> tuple:
    """``((device_type, dtype), ...)`` of the autocast regions active now; () when none."""
    if not torch._C._is_any_autocast_enabled():
        return ()
    return tuple(
        (dt, torch.get_autocast_dtype(dt))
        for dt in ("cuda", "cpu")
        if torch.is_autocast_enabled(dt)
    )


def autocast_key() -> tuple:
    """:attr:`CallKey.autocast` now: torch's autocast regions, the SDPA backend selection where
    it is not the usual one (:class:`SDPASelection`), then TransformerEngine's ``te.autocast``
    region once TE is imported."""
    autocast = autocast_state() if _any_autocast() else ()
    sdpa = _sdpa_flags()
    if sdpa != _USUAL_FLAGS:
        autocast = (*autocast, _selection(sdpa))
    if FP8_MODULE in _sys_modules:
        fp8 = fp8_region()
        if fp8 is not None:
            autocast = (*autocast, fp8)
    return autocast


class SDPASelection(NamedTuple):
    """The backends ``scaled_dot_product_attention`` may pick, and in which order: process-wide
    flags that ``torch.nn.attention.sdpa_kernel`` and ``torch.backends.cuda.enable_*_sdp`` set
    and that eager reads at every call, where a graph keeps the kernel picked at its capture.
    Part of :attr:`CallKey.autocast` where it differs from the selection torch had when tgraph
    was imported (:data:`_USUAL_SDPA`): another selection needs a graph captured under it."""

    flash: bool
    mem_efficient: bool
    math: bool
    cudnn: bool
    overrideable: bool
    fa3: bool  # FlashAttention-3 registered (torch.nn.attention.register_flash_attention_fa3)
    priority: tuple[int, ...]  # torch._C._get_sdp_priority_order(): SDPBackend values
    math_reduced: bool  # the math backend may reduce in fp16/bf16

    def __repr__(self) -> str:
        on = [n for n in self._fields[:6] if getattr(self, n)]
        text = f"sdpa_kernel({', '.join(on) or 'no backend'}"
        if self.priority != _USUAL_SDPA.priority:
            text += f", priority={list(self.priority)}"
        if self.math_reduced != _USUAL_SDPA.math_reduced:
            text += f", math fp16/bf16 reduction={self.math_reduced}"
        return text + ")"


def _sdpa_flags() -> tuple:
    """The SDPA selection now, as a plain tuple of :class:`SDPASelection`'s fields, the priority
    a list (eight reads of C flags, for every graphed call: torch has no counter of their
    changes)."""
    return (
        _sdp_flash(),
        _sdp_mem_efficient(),
        _sdp_math(),
        _sdp_cudnn(),
        _sdp_overrideable(),
        _sdp_fa3(),
        _sdp_priority(),
        _sdp_math_reduced(),
    )


def _selection(flags: tuple) -> SDPASelection:
    """:func:`_sdpa_flags`' tuple as a hashable :class:`SDPASelection`."""
    return tuple.__new__(SDPASelection, (*flags[:6], tuple(flags[6]), flags[7]))


_sdp_flash = torch._C._get_flash_sdp_enabled
_sdp_mem_efficient = torch._C._get_mem_efficient_sdp_enabled
_sdp_math = torch._C._get_math_sdp_enabled
_sdp_cudnn = torch._C._get_cudnn_sdp_enabled
_sdp_overrideable = torch._C._get_overrideable_sdp_enabled
_sdp_fa3 = getattr(torch._C, "_get_fa3_sdp_enabled", bool)  # absent from older PyTorch
_sdp_priority = torch._C._get_sdp_priority_order
_sdp_math_reduced = torch._C._get_math_sdp_allow_fp16_bf16_reduction
_USUAL_FLAGS = _sdpa_flags()  # a call under it keys no SDPASelection (the common case: short keys)
_USUAL_SDPA = _selection(_USUAL_FLAGS)
_settled = [False]  # settle_sdpa() has had torch pick its priority order


def _cuda_ready() -> bool:
    return torch.cuda.is_initialized() and not torch.cuda.is_current_stream_capturing()


def _pick_sdpa(device: torch.device | None = None) -> None:
    """Ask torch which kernel it would pick for a tiny attention on ``device`` (default: the
    current CUDA device; no kernel runs)."""
    q = torch.zeros(1, 1, 1, 8, device=device or "cuda", dtype=torch.float16)
    with contextlib.suppress(RuntimeError):  # every backend off: torch picks none, sets nothing
        torch._fused_sdp_choice(q, q, q)


def settle_sdpa(module: torch.nn.Module | None = None) -> None:
    """Have torch settle the SDPA priority order it uses in this process, before a recorded
    call reads it into a key; the order it settles on becomes the usual one (no
    SDPASelection keyed for it). torch sets that order itself, once, at the first SDPA on a CUDA
    device (``priority_order()`` in ATen's ``sdp_utils.cpp``: cuDNN first on sm90/sm100 with
    cuDNN > 9.15, torch 2.11), so without this the first layer of a model recorded before any
    attention had run keyed the old order, every later call the new one: that layer (and the
    merged stack after it) never replayed. Asking torch which kernel it would pick
    (``_fused_sdp_choice``, no kernel launched) runs that one-time step now, on the device of
    ``module``'s first parameter where it is a CUDA one (torch decides by the current device's
    properties; no context is made on another GPU). A no-op once done, before CUDA is
    initialised and during a capture."""
    global _USUAL_FLAGS, _USUAL_SDPA
    if _settled[0] or not _cuda_ready():
        return
    _settled[0] = True
    p = next(module.parameters(), None) if module is not None else None
    device = p.device if p is not None and p.is_cuda else None
    before = _sdp_priority()
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        _pick_sdpa(device)
    after = _sdp_priority()
    if after != before and _USUAL_FLAGS[6] == before:
        _USUAL_FLAGS = (*_USUAL_FLAGS[:6], after, _USUAL_FLAGS[7])
        _USUAL_SDPA = _selection(_USUAL_FLAGS)


_SDPA_SETTERS = (
    torch._C._set_sdp_use_flash,
    torch._C._set_sdp_use_mem_efficient,
    torch._C._set_sdp_use_math,
    torch._C._set_sdp_use_cudnn,
    torch._C._set_sdp_use_overrideable,
    getattr(torch._C, "_set_sdp_use_fa3", bool),
    lambda order: torch._C._set_sdp_priority_order(list(order)),
    torch._C._set_math_sdp_allow_fp16_bf16_reduction,
)


@contextlib.contextmanager
def ambient(regions: tuple) -> Iterator[None]:
    """Run under torch's autocast regions and the SDPA selection of a call key's ``regions``
    (:attr:`CallKey.autocast`), whatever is active now: the capture of a graph
    (``create_graphs()`` may run outside the block the recorded call ran in) and the shadow
    verifier's eager run in a backward (which runs outside it). TransformerEngine's region is
    the caller's to enter (the capture enters it in TE's graph mode)."""
    want = dict(r for r in regions if type(r) is tuple)  # device type -> dtype
    sdpa = next((r for r in regions if isinstance(r, SDPASelection)), _USUAL_SDPA)
    now = dict(autocast_state())
    with contextlib.ExitStack() as stack:
        for device_type in ("cuda", "cpu"):
            if device_type in want:
                dtype = want[device_type]
                stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=False))
            elif device_type in now:
                stack.enter_context(torch.autocast(device_type, enabled=False))
        live = _selection(_sdpa_flags())
        changed = [(i, v) for i, (v, w) in enumerate(zip(live, sdpa)) if v != w]
        try:
            for i, _ in changed:
                _SDPA_SETTERS[i](sdpa[i])
            yield
        finally:
            for i, v in changed:
                _SDPA_SETTERS[i](v)


class Structure:
    """The nested structure of a call's ``(args, kwargs)``: one object per distinct structure.

    Interned (:func:`structure_of`), so keys compare and hash structures by identity: a
    ``TreeSpec`` hashes and compares in Python, far too slow for every graphed call.
    """

    __slots__ = ("spec", "_paths")

    def __init__(self, spec: pytree.TreeSpec) -> None:
        self.spec = spec
        self._paths: list[str] | None = None

    @property
    def paths(self) -> list[str]:
        """Names of the leaves, as messages show them (:func:`leaf_paths`)."""
        if self._paths is None:
            self._paths = _spec_paths(self.spec)
        return self._paths

    def __repr__(self) -> str:
        return f"Structure({_structure(self)})"


_BY_SPEC: dict[pytree.TreeSpec, Structure] = {}  # the interned structures
# (number of positional arguments, keyword names, container tokens) -> Structure, or None where
# pytree's leaf order differs: what the hot path looks structures up by (see _plain_leaves)
_BY_SHAPE: dict[tuple, Structure | None] = {}
_MAX_SHAPES = 4096
_UNSEEN = object()


def structure_of(spec: pytree.TreeSpec) -> Structure:
    """The interned :class:`Structure` of ``spec``."""
    found = _BY_SPEC.get(spec)
    if found is None:
        found = _BY_SPEC[spec] = Structure(spec)
    return found


def call_key(
    args: tuple,
    kwargs: dict,
    training: tuple[bool, ...],
    tensors: list[torch.Tensor],
    params: tuple[torch.Tensor, ...] = (),
) -> CallKey:
    """Key of one call (:class:`CallKey`); appends the call's tensors, in leaf order, to
    ``tensors``. A frozen or unfrozen parameter needs another backward graph, a submodule
    switched to eval another forward graph.

    Raises:
        MutableArgument, TypeError: see :func:`describe`.
    """
    if forward_ad._current_level >= 0 or _functorch_active():  # rare: one read each
        refuse_transformed(args, kwargs)
    # Called for every graphed call: the hot path of a replayed step. Plain arguments (tensors
    # and values in tuples, lists and dicts) are walked by _plain_leaves, and their structure
    # is looked up by a flat tuple of its containers' sizes and keys; pytree runs only for a
    # structure seen for the first time, or for other containers (named tuples, ModelOutput).
    # The fields are those of CallKey(tree, leaves, training, grad, autocast, frozen), built
    # without per-element generator frames and without the named tuple's Python __new__.
    frozen = tuple(map(_REQUIRES_GRAD, params))
    grad = torch.is_grad_enabled()
    autocast = autocast_key()
    n = len(tensors)
    descs: list = []
    shape: list = [len(args), *kwargs]
    if _plain_leaves(args, descs, tensors, shape) and _plain_leaves(
        kwargs.values(), descs, tensors, shape
    ):
        shape = tuple(shape)
        tree = _BY_SHAPE.get(shape, _UNSEEN)
        if tree is _UNSEEN:
            if len(_BY_SHAPE) >= _MAX_SHAPES:  # keyword names made up at run time
                _BY_SHAPE.clear()
            tree = _BY_SHAPE[shape] = _plain_structure(args, kwargs, tensors[n:])
        if tree is not None:
            return _new_key(CallKey, (tree, tuple(descs), training, grad, autocast, frozen))
    del tensors[n:]  # the general path: any pytree node
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tree = structure_of(spec)
    paths = tree.paths
    descs = tuple([describe(x, paths[i]) for i, x in enumerate(leaves)])
    tensors.extend(x for x in leaves if isinstance(x, torch.Tensor))
    return CallKey(tree, descs, training, grad, autocast, frozen)


def refuse_transformed(args: tuple, kwargs: dict) -> None:
    """Raise where an argument carries a forward-mode AD tangent (a ``torch.autograd.forward_ad``
    dual tensor, or an input of ``torch.func.jvp``) or is a torch.func transform's wrapped
    tensor (``torch.func.grad``, ``vjp``, ``vmap``): a graph replays kernels on plain tensors'
    memory, so such a call must run eagerly.

    Raises:
        MutableArgument: naming the argument.
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        if forward_ad._current_level >= 0 and forward_ad.unpack_dual(x).tangent is not None:
            what = (
                "carries a forward-mode AD tangent (a torch.autograd.forward_ad dual tensor, or "
                "torch.func.jvp): a graph replays kernels on the primal values and would drop "
                "the tangent"
            )
        elif _functorch_wrapped(x):
            what = (
                "is a torch.func transform's tensor (torch.func.grad, vjp or vmap), which has no "
                "memory of its own for a graph to read"
            )
        else:
            continue
        raise MutableArgument(
            f"{structure_of(spec).paths[i]} {what}, so the call runs eagerly (under "
            "strict=True, run it with strict=False or without tgraph.enable)"
        )


_functorch_active = torch._C._are_functorch_transforms_active
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
# The layout is part of a tensor's signature: a graph replays the kernels chosen for the captured
# layout and returns outputs and input gradients in it, where eager would pick other kernels and
# layouts for another (channels_last images after a capture on contiguous ones).
_contiguous = torch.Tensor.is_contiguous
_new_key = tuple.__new__  # CallKey(*fields) without the generated __new__'s Python frame
_any_autocast = torch._C._is_any_autocast_enabled
_VALUE_SET = frozenset(_VALUE_TYPES)


def _plain_leaves(items, descs: list, tensors: list, shape: list) -> bool:
    """Describe the leaves of ``items`` (pytree order) into ``descs``, their tensors into
    ``tensors``, and the structure into ``shape``: a ``None`` per leaf, ``(tuple, n)`` or
    ``(list, n)`` and ``(dict, keys)`` per container, in preorder, which a tree determines and
    which determines it. False at the first object other than a tensor, a plain value or a
    plain tuple, list or dict: the caller takes pytree's general path."""
    for x in items:
        cls = type(x)
        if cls in _VALUE_SET:
            descs.append((cls, x))
        elif isinstance(x, torch.Tensor):
            descs.append((x.shape, x.dtype, x.device, x.requires_grad, _contiguous(x)))
            tensors.append(x)
        elif cls is tuple or cls is list:
            shape.append((cls, len(x)))
            if not _plain_leaves(x, descs, tensors, shape):
                return False
            continue
        elif cls is dict:
            shape.append((dict, *x))
            if not _plain_leaves(x.values(), descs, tensors, shape):
                return False
            continue
        else:
            return False
        shape.append(None)
    return True


def _plain_structure(args: tuple, kwargs: dict, tensors: list) -> Structure | None:
    """The structure of plain arguments seen for the first time, from pytree; None if pytree
    orders their leaves otherwise than :func:`_plain_leaves` (then the general path serves
    this structure from now on)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    found = [x for x in leaves if isinstance(x, torch.Tensor)]
    if len(found) != len(tensors) or any(a is not b for a, b in zip(found, tensors)):
        return None
    return structure_of(spec)


def leaf_paths(tree: Any) -> list[str]:
    """Names of the leaves of a :attr:`CallKey.tree` (a :class:`Structure`, a ``TreeSpec`` of
    ``(args, kwargs)``, or a number of positional arguments): ``argument 0['mask']``,
    ``keyword argument 'cache'``."""
    if isinstance(tree, Structure):
        return tree.paths
    if isinstance(tree, int):
        return [f"argument {i}" for i in range(tree)]
    return _spec_paths(tree)


def _spec_paths(tree: pytree.TreeSpec) -> list[str]:
    numbered = pytree.tree_unflatten(list(range(tree.num_leaves)), tree)
    names = [""] * tree.num_leaves
    for path, i in pytree.tree_flatten_with_path(numbered)[0]:
        (kind, first), rest = path[:2], pytree.keystr(path[2:])
        names[i] = (
            f"argument {first.idx}{rest}"
            if kind.idx == 0
            else f"keyword argument {first.key!r}{rest}"
        )
    return names


def format_leaf(desc: Any) -> str:
    """A described tensor or value, as a message shows it."""
    if isinstance(desc, tuple) and len(desc) == 5 and isinstance(desc[0], torch.Size):
        shape, dtype, device, rg, contiguous = desc
        layout = "" if contiguous else " non-contiguous (channels_last, a view)"
        return f"{tuple(shape)} {str(dtype).removeprefix('torch.')} {device} requires_grad={rg}" + (
            layout
        )
    if isinstance(desc, tuple) and len(desc) == 2 and isinstance(desc[0], type):
        return repr(desc[1])
    return repr(desc)


def difference(old: CallKey, new: CallKey, names: list[str] | None = None) -> str:
    """One sentence naming the first field in which call key ``new`` differs from ``old``.

    ``names``: the module's submodule names (``named_modules()`` order), to name a submodule
    whose ``training`` flag changed.
    """
    if old.training != new.training:
        i = next(i for i, (a, b) in enumerate(zip(old.training, new.training)) if a != b)
        mode = {True: "train", False: "eval"}
        a, b = old.training[i], new.training[i]
        who = "module.training" if i == 0 else f"training of submodule {names[i] if names else i!r}"
        return f"{who} changed from {a} to {b} ({mode[a]} -> {mode[b]})"
    if old.grad != new.grad:
        was, now = ("enabled" if g else "disabled" for g in (old.grad, new.grad))
        return f"grad mode changed from {was} to {now}"
    if len(old.frozen) != len(new.frozen):
        return (
            f"the module holds {len(new.frozen)} parameters, recorded with {len(old.frozen)} "
            "(one removed, set to None or added since the recorded iteration)"
        )
    if old.frozen != new.frozen:
        changed = [i for i, (a, b) in enumerate(zip(old.frozen, new.frozen)) if a != b]
        return (
            f"requires_grad of the module's parameters {changed} changed (frozen or unfrozen "
            "since the recorded iteration)"
        )
    if old.autocast != new.autocast:
        return _regions_difference(old.autocast, new.autocast)
    if old.tree != new.tree:
        return f"the arguments changed from {_structure(old.tree)} to {_structure(new.tree)}"
    paths = leaf_paths(new.tree)
    for path, a, b in zip(paths, old.leaves, new.leaves):
        if a != b:
            return f"{path} changed from {format_leaf(a)} to {format_leaf(b)}"
    return "no difference in signature (every matching graph is still awaiting its backward)"


def _regions_difference(old: tuple, new: tuple) -> str:
    """:func:`difference` of two :attr:`CallKey.autocast` fields."""
    was, now = (
        next((r for r in x if isinstance(r, SDPASelection)), _USUAL_SDPA) for x in (old, new)
    )
    if was != now:
        return (
            f"the SDPA backend selection changed from {was} to {now} (torch.nn.attention."
            "sdpa_kernel, torch.backends.cuda.enable_*_sdp): a graph keeps the kernel picked at "
            "its capture"
        )
    was, now = (tuple(r for r in x if not isinstance(r, SDPASelection)) for x in (old, new))
    return f"autocast changed from {was or 'off'} to {now or 'off'}"


def first_difference(old: CallKey, new: CallKey, what: str) -> str:
    """:func:`difference` of two single-argument keys, naming the argument ``what``."""
    return difference(old, new).replace("argument 0", what, 1)


def _structure(tree: Any) -> str:
    return "[" + ", ".join(leaf_paths(tree)) + "]"
