"""Call signatures: what a graph was captured for, and how a new call differs from it.

A graph replays fixed kernels on fixed buffers, so it is valid only for calls that match its
capture in every tensor's shape, dtype, device and requires_grad, in every non-tensor argument's
value, in the ``training`` flags of the module and its submodules, in grad mode and autocast.
:func:`call_key` reduces a call to a hashable :class:`CallKey`; :func:`difference` turns two keys
into the sentence a warning or error shows. Nested arguments and outputs (tuples, lists, dicts,
named tuples, Hugging Face ``ModelOutput``) are walked once, with ``torch.utils._pytree``;
:class:`Template` keeps a structure with its tensors taken out, to be filled again.
"""

from __future__ import annotations

import enum
import operator
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree


class Template(NamedTuple):
    """A nested structure with its tensors taken out (no memory pinned)."""

    spec: pytree.TreeSpec
    leaves: tuple  # the non-tensor leaves; None where a tensor goes
    tensor_at: tuple[int, ...]  # leaf positions of the tensors

    def fill(self, tensors: list[torch.Tensor]) -> Any:
        """The structure again, with ``tensors`` in the tensors' places."""
        if self.tensor_at and self.spec.is_leaf():  # a bare tensor: the common case
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
    return tensors, Template(spec, tuple(leaves), at)


class CallKey(NamedTuple):
    """What a graph was captured for: one graphed call, reduced to hashable values."""

    tree: Any
    """Structure of ``(args, kwargs)`` (a ``TreeSpec``), or the number of positional arguments
    when every argument is a tensor and there are no keyword arguments (the fast path)."""
    leaves: tuple
    """Per leaf of the arguments, its description (:func:`describe`)."""
    training: tuple[bool, ...]
    """``training`` of the module and of each of its submodules (``module.modules()`` order)."""
    grad: bool
    """Grad mode."""
    autocast: tuple
    """``((device_type, dtype), ...)`` of the active autocast regions."""
    frozen: tuple[bool, ...]
    """``requires_grad`` of the module's parameters."""


# Non-tensor arguments whose value a graph may bake in: compared by value, immutable.
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


class MutableArgument(TypeError):
    """A graphed call got a Python object that a graph cannot stand for (see :func:`describe`)."""


def describe(leaf: Any, where: str) -> Any:
    """Hashable description of one argument leaf (``where`` names it in errors).

    Raises:
        MutableArgument: an object compared by identity (a cache, a state holder): a graph
            replays kernels, not Python, so whatever the module does to the object would not
            happen at replay, and a new object at each call matches nothing.
        TypeError: a non-tensor argument that is not hashable (it cannot key a graph).
    """
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape, leaf.dtype, leaf.device, leaf.requires_grad)
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
    # Called for every graphed call: the hot path of a replayed step. The same fields as
    # ``CallKey(tree, leaves, training, grad, autocast, frozen)``, built without per-element
    # generator frames (``map`` over C getters) and without the named tuple's Python __new__.
    frozen = tuple(map(_REQUIRES_GRAD, params))
    grad = torch.is_grad_enabled()
    autocast = autocast_state()
    if not kwargs:
        for a in args:
            if not isinstance(a, torch.Tensor):
                break
        else:  # the fast path: positional tensors only (describe() of each, inlined)
            tensors.extend(args)
            descs = tuple([(a.shape, a.dtype, a.device, a.requires_grad) for a in args])
            return _new_key(CallKey, (len(args), descs, training, grad, autocast, frozen))
    leaves, spec = pytree.tree_flatten((args, kwargs))
    paths = leaf_paths(spec)
    descs = tuple(describe(x, paths[i]) for i, x in enumerate(leaves))
    tensors.extend(x for x in leaves if isinstance(x, torch.Tensor))
    return CallKey(spec, descs, training, grad, autocast, frozen)


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_new_key = tuple.__new__  # CallKey(*fields) without the generated __new__'s Python frame


def leaf_paths(tree: Any) -> list[str]:
    """Names of the leaves of a :attr:`CallKey.tree`: ``argument 0['mask']``, ``keyword
    argument 'cache'``."""
    if isinstance(tree, int):
        return [f"argument {i}" for i in range(tree)]
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
    if isinstance(desc, tuple) and len(desc) == 4 and isinstance(desc[0], torch.Size):
        shape, dtype, device, rg = desc
        return f"{tuple(shape)} {str(dtype).removeprefix('torch.')} {device} requires_grad={rg}"
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
    if old.frozen != new.frozen:
        changed = [i for i, (a, b) in enumerate(zip(old.frozen, new.frozen)) if a != b]
        return (
            f"requires_grad of the module's parameters {changed} changed (frozen or unfrozen "
            "since the recorded iteration)"
        )
    if old.autocast != new.autocast:
        return f"autocast changed from {old.autocast or 'off'} to {new.autocast or 'off'}"
    if old.tree != new.tree:
        return f"the arguments changed from {_structure(old.tree)} to {_structure(new.tree)}"
    paths = leaf_paths(new.tree)
    for path, a, b in zip(paths, old.leaves, new.leaves):
        if a != b:
            return f"{path} changed from {format_leaf(a)} to {format_leaf(b)}"
    return "no difference in signature (every matching graph is still awaiting its backward)"


def first_difference(old: CallKey, new: CallKey, what: str) -> str:
    """:func:`difference` of two single-argument keys, naming the argument ``what``."""
    return difference(old, new).replace("argument 0", what, 1)


def _structure(tree: Any) -> str:
    return "[" + ", ".join(leaf_paths(tree)) + "]"
