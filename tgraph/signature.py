"""Call signatures: what a graph was captured for, and how a new call differs from it.

A graph replays fixed kernels on fixed buffers, so it is valid only for calls that match its
capture in every tensor's shape, dtype, device and requires_grad, in every non-tensor argument's
value, in ``module.training`` and in grad mode. :func:`describe` reduces a call to a hashable
key; :func:`difference` turns two keys into the sentence a warning or error shows.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import torch


class CallKey(NamedTuple):
    """What a graph was captured for: one graphed call, reduced to hashable values."""

    args: tuple
    """Descriptions of the positional arguments (:func:`describe`)."""
    kwargs: tuple
    """``(name, description)`` of the keyword arguments, in the order given."""
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


def describe(obj: Any, tensors: list[torch.Tensor], where: str = "argument") -> Any:
    """Hashable description of ``obj``; appends its tensors, in order, to ``tensors``.

    Raises:
        MutableArgument: a non-tensor argument that is an object compared by identity (a cache,
            a state holder): a graph replays kernels, not Python, so whatever the module does to
            the object would not happen at replay, and a new object each call matches nothing.
        TypeError: a non-tensor argument that is not hashable (it cannot key a graph).
    """
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return (obj.shape, obj.dtype, obj.device, obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(describe(o, tensors, f"{where}[{i}]") for i, o in enumerate(obj)))
    if isinstance(obj, dict):
        return (dict, tuple((k, describe(v, tensors, f"{where}[{k!r}]")) for k, v in obj.items()))
    if not isinstance(obj, _VALUE_TYPES) and _compared_by_identity(obj):
        raise MutableArgument(
            f"{where} is a {type(obj).__name__} object, compared by identity: a graph replays "
            "kernels, not Python, so what the module does to this object (a key/value cache "
            "appending tensors, say) would not happen at replay, and a new object at each call "
            "matches no graph. Pass tensors or plain values instead; for Hugging Face models "
            "pass use_cache=False when training."
        )
    try:
        hash(obj)
    except TypeError:
        raise TypeError(
            f"a graphed module got an unhashable non-tensor argument of type {type(obj).__name__}; "
            "graphs are keyed by argument values, so pass tensors, numbers, strings, None or "
            "tuples of them"
        ) from None
    return (type(obj), obj)


def _compared_by_identity(obj: Any) -> bool:
    """An instance of a plain class: neither value equality nor hashing of its own.

    Functions, classes, modules and enums are identity-compared too, but they are constants of
    the program, not state that the call mutates.
    """
    if callable(obj) or isinstance(obj, (type, enum.Enum, torch.nn.Module)):
        return False
    cls = type(obj)
    return cls.__eq__ is object.__eq__ and cls.__hash__ is object.__hash__


def rebuild(obj: Any, tensors: Any) -> Any:
    """Inverse of :func:`describe`: ``obj`` with its tensors replaced from the iterator."""
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(rebuild(o, tensors) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(rebuild(o, tensors) for o in obj)
    if isinstance(obj, dict):
        items = {k: rebuild(v, tensors) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        try:  # OrderedDict, ModelOutput-like dict subclasses keep their type
            return type(obj)(items)
        except TypeError:
            return items
    return obj


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
    """Key of one call (:class:`CallKey`): a frozen or unfrozen parameter needs another
    backward graph, a submodule switched to eval another forward graph.

    Keyword arguments are keyed in the order given (their tensors are matched by position).
    The fast path covers ``forward(tensor, ...)`` without keyword arguments.

    Raises:
        MutableArgument, TypeError: see :func:`describe`.
    """
    frozen = tuple(p.requires_grad for p in params)
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        tensors.extend(args)
        arg_key = tuple((a.shape, a.dtype, a.device, a.requires_grad) for a in args)
        return CallKey(arg_key, (), training, torch.is_grad_enabled(), autocast_state(), frozen)
    arg_key = tuple(describe(a, tensors, f"argument {i}") for i, a in enumerate(args))
    kw_key = tuple((k, describe(v, tensors, f"keyword argument {k!r}")) for k, v in kwargs.items())
    return CallKey(arg_key, kw_key, training, torch.is_grad_enabled(), autocast_state(), frozen)


def format_leaf(desc: Any) -> str:
    """A described tensor or value, as a message shows it."""
    if isinstance(desc, tuple) and len(desc) == 4 and isinstance(desc[0], torch.Size):
        shape, dtype, device, rg = desc
        return f"{tuple(shape)} {str(dtype).removeprefix('torch.')} {device} requires_grad={rg}"
    if isinstance(desc, tuple) and len(desc) == 2 and isinstance(desc[0], type):
        kind, value = desc
        if kind in (tuple, list, dict):
            return f"{kind.__name__} of {len(value)}"
        return repr(value)
    return repr(desc)


def first_difference(old: Any, new: Any, path: str) -> str:
    """Where two descriptions first differ: ``path[0]['mask'] changed from ... to ...``."""
    nested = (list, tuple, dict)
    if (
        isinstance(old, tuple)
        and isinstance(new, tuple)
        and len(old) == len(new) == 2
        and old[0] in nested
        and new[0] is old[0]
        and len(old[1]) == len(new[1])
    ):
        for i, (a, b) in enumerate(zip(old[1], new[1])):
            if old[0] is dict:
                if a[0] != b[0]:
                    keys = ([k for k, _ in old[1]], [k for k, _ in new[1]])
                    return f"{path} keys changed from {keys[0]} to {keys[1]}"
                a, b, i = a[1], b[1], repr(a[0])
            if a != b:
                return first_difference(a, b, f"{path}[{i}]")
    return f"{path} changed from {format_leaf(old)} to {format_leaf(new)}"


def difference(old: CallKey, new: CallKey, names: list[str] | None = None) -> str:
    """One sentence naming the first field in which call key ``new`` differs from ``old``.

    ``names``: the module's submodule names (``named_modules()`` order), to name a submodule
    whose ``training`` flag changed.
    """
    if old.training != new.training:
        i = next(i for i, (a, b) in enumerate(zip(old.training, new.training)) if a != b)
        mode = {True: "train", False: "eval"}
        a, b = old.training[i], new.training[i]
        if i == 0:
            who = "module.training"
        else:
            who = f"training of submodule {names[i] if names else i!r}"
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
    if len(old.args) != len(new.args):
        return f"number of positional arguments changed from {len(old.args)} to {len(new.args)}"
    for i, (a, b) in enumerate(zip(old.args, new.args)):
        if a != b:
            return first_difference(a, b, f"argument {i}")
    old_d, new_d = dict(old.kwargs), dict(new.kwargs)
    if old_d.keys() != new_d.keys():
        return f"keyword arguments changed from {sorted(old_d)} to {sorted(new_d)}"
    for k in old_d:
        if old_d[k] != new_d[k]:
            return first_difference(old_d[k], new_d[k], f"keyword argument {k!r}")
    if list(old_d) != list(new_d):
        return f"keyword arguments were passed in another order ({list(old_d)} -> {list(new_d)})"
    return "no difference in signature (every matching graph is still awaiting its backward)"
