"""Call signatures: what a graph was captured for, and how a new call differs from it.

A graph replays fixed kernels on fixed buffers, so it is valid only for calls that match its
capture in every tensor's shape, dtype, device and requires_grad, in every non-tensor argument's
value, in ``module.training`` and in grad mode. :func:`describe` reduces a call to a hashable
key; :func:`difference` turns two keys into the sentence a warning or error shows.
"""

from __future__ import annotations

from typing import Any

import torch


def describe(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Hashable description of ``obj``; appends its tensors, in order, to ``tensors``.

    Raises:
        TypeError: a non-tensor argument that is not hashable (it cannot key a graph).
    """
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return (obj.shape, obj.dtype, obj.device, obj.requires_grad)
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(describe(o, tensors) for o in obj))
    if isinstance(obj, dict):
        return (dict, tuple((k, describe(v, tensors)) for k, v in obj.items()))
    try:
        hash(obj)
    except TypeError:
        raise TypeError(
            f"a graphed module got an unhashable non-tensor argument of type {type(obj).__name__}; "
            "graphs are keyed by argument values, so pass tensors, numbers, strings, None or "
            "tuples of them"
        ) from None
    return (type(obj), obj)


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
    training: bool,
    tensors: list[torch.Tensor],
    params: tuple[torch.Tensor, ...] = (),
) -> tuple:
    """Key of one call: (args, kwargs, module.training, grad mode, autocast state,
    requires_grad of ``params``: a frozen or unfrozen parameter needs another backward graph).

    Keyword arguments are keyed in the order given (their tensors are matched by position).
    The fast path covers ``forward(tensor, ...)`` without keyword arguments.
    """
    frozen = tuple(p.requires_grad for p in params)
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        tensors.extend(args)
        arg_key = tuple((a.shape, a.dtype, a.device, a.requires_grad) for a in args)
        return (arg_key, (), training, torch.is_grad_enabled(), autocast_state(), frozen)
    arg_key = tuple(describe(a, tensors) for a in args)
    kw_key = tuple((k, describe(v, tensors)) for k, v in kwargs.items())
    return (arg_key, kw_key, training, torch.is_grad_enabled(), autocast_state(), frozen)


def _fmt(desc: Any) -> str:
    if isinstance(desc, tuple) and len(desc) == 4 and isinstance(desc[0], torch.Size):
        shape, dtype, device, rg = desc
        return f"{tuple(shape)} {str(dtype).removeprefix('torch.')} {device} requires_grad={rg}"
    if isinstance(desc, tuple) and len(desc) == 2 and isinstance(desc[0], type):
        kind, value = desc
        if kind in (tuple, list, dict):
            return f"{kind.__name__} of {len(value)}"
        return repr(value)
    return repr(desc)


def difference(old: tuple, new: tuple) -> str:
    """One sentence naming the first field in which call key ``new`` differs from ``old``."""
    (old_args, old_kw, old_train, old_grad, old_amp, old_frozen) = old
    (new_args, new_kw, new_train, new_grad, new_amp, new_frozen) = new
    if old_train != new_train:
        mode = {True: "train", False: "eval"}
        return f"module.training changed from {old_train} to {new_train} ({mode[old_train]} -> {mode[new_train]})"
    if old_grad != new_grad:
        return f"grad mode changed from {'enabled' if old_grad else 'disabled'} to {'enabled' if new_grad else 'disabled'}"
    if old_frozen != new_frozen:
        changed = [i for i, (a, b) in enumerate(zip(old_frozen, new_frozen)) if a != b]
        return (
            f"requires_grad of the module's parameters {changed} changed (frozen or unfrozen "
            "since the recorded iteration)"
        )
    if old_amp != new_amp:
        return f"autocast changed from {old_amp or 'off'} to {new_amp or 'off'}"
    if len(old_args) != len(new_args):
        return f"number of positional arguments changed from {len(old_args)} to {len(new_args)}"
    for i, (a, b) in enumerate(zip(old_args, new_args)):
        if a != b:
            return f"argument {i} changed from {_fmt(a)} to {_fmt(b)}"
    old_d, new_d = dict(old_kw), dict(new_kw)
    if old_d.keys() != new_d.keys():
        return f"keyword arguments changed from {sorted(old_d)} to {sorted(new_d)}"
    for k in old_d:
        if old_d[k] != new_d[k]:
            return f"keyword argument {k!r} changed from {_fmt(old_d[k])} to {_fmt(new_d[k])}"
    if list(old_d) != list(new_d):
        return f"keyword arguments were passed in another order ({list(old_d)} -> {list(new_d)})"
    return "no difference in signature (every matching graph is still awaiting its backward)"
