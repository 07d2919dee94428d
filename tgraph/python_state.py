"""The Python state around a graphed forward: what it reads (the globals it names), what it may
write (its modules' attributes and submodules, the ``random`` and NumPy generators, those
globals), and tensors returned inside objects a graph cannot refill.

A graph runs no Python. A forward whose Python writes state on every call (a step counter, a
cache, a LayerDrop draw from ``random``) would advance it at warmup and capture and never again;
one that reads a global would keep the value it saw. :class:`PythonState` is taken around the
warmup and capture of a unit, and a unit whose forward wrote Python state there stays eager
(:mod:`tgraph.layers.create`); :func:`forward_globals` is the read set that the baked inventory
(:class:`tgraph.baked.Baked`) compares before each replay.

What is compared, and why not more: plain values (bool, int, float, str, None, tuples of them)
by value, the keys of each module's ``__dict__``, each ``_modules`` entry and each module's
class by identity. Other objects a forward replaces on every call (megatron's checkpoint and
offloading managers) and containers mutated in place are not compared: the shadow verifier
(:mod:`tgraph.layers.verify`) is the net under these rules.
"""

from __future__ import annotations

import dataclasses
import dis
import functools
import random
import sys
import types

import torch
import torch.nn as nn

_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device)
# torch's own bookkeeping, the training flags (part of the call key) and tgraph's state
NOT_READ = frozenset({"training", "_is_full_backward_hook", "_compiled_call_impl", "_tgraph"})


def plain(v: object) -> bool:
    return isinstance(v, _PLAIN) or (
        isinstance(v, tuple) and len(v) < 16 and all(isinstance(x, _PLAIN) for x in v)
    )


def unread(m: nn.Module) -> frozenset[str]:
    """The attributes of ``m`` a forward is declared not to read (``unread_attributes``)."""
    return NOT_READ | getattr(type(m), "unread_attributes", frozenset())


@functools.lru_cache(maxsize=1024)
def global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names ``code`` loads as globals (``LOAD_GLOBAL``), nested code (a comprehension, a
    lambda) included, in order of first use. Not ``co_names``, which also holds the attribute
    and method names it reads: ``self.scale`` names ``scale`` there, and a script's loop
    variable ``scale`` would look like a global the forward reads."""
    names = [i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += global_names(const)
    return tuple(dict.fromkeys(names))


def forward_globals(modules: list[nn.Module]) -> list[tuple[str, dict, list[str]]]:
    """The module-level names the ``forward`` of each module's class reads that hold plain
    values or functions, as ``(where, globals dict, names)``: a graph keeps what they held at
    capture. Only each ``forward``'s own code is read (not the functions it calls)."""
    found: dict[int, tuple[str, dict, list[str]]] = {}
    for m in modules:
        fn = getattr(type(m), "forward", None)
        code = getattr(fn, "__code__", None)
        if code is None or type(m).__module__.startswith("torch."):
            continue
        g = fn.__globals__
        keys = found.setdefault(id(g), (f"global {g.get('__name__')}", g, []))[2]
        for k in global_names(code):
            if k in g and k not in keys and (plain(g[k]) or isinstance(g[k], types.FunctionType)):
                keys.append(k)
    return [entry for entry in found.values() if entry[2]]


def _value(v: object) -> object:
    return v if plain(v) else id(v)


class PythonState:
    """The Python state ``modules``' forwards may write, saved at construction
    (:meth:`changes` names a write since, :meth:`restore` puts the saved values back)."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self._dicts = []
        for name, m in modules:
            d = vars(m)
            skip = unread(m)
            plain_keys = {k: v for k, v in d.items() if k not in skip and plain(v)}
            self._dicts.append((name, m, d, set(d) - skip, plain_keys, dict(d["_modules"])))
        self._classes = [(m, type(m)) for _, m in modules]
        self._globals = [
            (where, g, {k: _value(g[k]) for k in keys}, {k: g[k] for k in keys})
            for where, g, keys in forward_globals([m for _, m in modules])
        ]
        self._random = random.getstate()
        np = sys.modules.get("numpy")
        self._numpy = np.random.get_state() if np is not None else None

    def changes(self) -> str | None:
        """The first write since construction, in words, or None."""
        for name, m, d, keys, values, mods in self._dicts:
            where = name or type(m).__name__
            added = sorted(k for k in set(d) - unread(m) - keys if not torch.is_tensor(d[k]))
            if added:
                return f"it sets {where}.{added[0]}"
            for k, v in values.items():
                if k in d and d[k] != v:
                    return f"it changes {where}.{k} (from {v!r} to {d[k]!r})"
            if d["_modules"].keys() != mods.keys() or any(
                d["_modules"][k] is not v for k, v in mods.items()
            ):
                return f"it replaces, adds or removes submodules of {where}"
        for m, cls in self._classes:
            if type(m) is not cls:
                return f"it changes the class of {type(m).__name__}"
        for where, g, values, _ in self._globals:
            for k, v in values.items():
                if _value(g.get(k)) != v:
                    return f"it rebinds {where}.{k}"
        if random.getstate() != self._random:
            return "it draws from Python's random module"
        np = sys.modules.get("numpy")
        if self._numpy is not None and np is not None:
            now = np.random.get_state()
            if now[2] != self._numpy[2] or not (now[1] == self._numpy[1]).all():
                return "it draws from NumPy's global random generator"
        return None

    def restore(self) -> None:
        """Put the saved plain attributes, submodules, classes, globals and generator states
        back (a warmup and a capture run the forward's Python more often than eager would)."""
        for _, m, d, keys, values, mods in self._dicts:
            for k in set(d) - unread(m) - keys:
                if plain(d[k]):
                    del d[k]
            d.update(values)
            d["_modules"].clear()
            d["_modules"].update(mods)
        for m, cls in self._classes:
            m.__class__ = cls
        for _, g, _, objects in self._globals:
            g.update(objects)
        random.setstate(self._random)
        np = sys.modules.get("numpy")
        if self._numpy is not None and np is not None:
            np.random.set_state(self._numpy)


def tensor_holder(obj: object, depth: int = 3) -> str | None:
    """The type name of an object in ``obj`` (an output's pytree leaf) that holds tensors a
    graph could not refill (a dataclass, a ``SimpleNamespace``, a distribution), or None."""
    if depth == 0 or isinstance(obj, torch.Tensor | type) or plain(obj):
        return None
    if isinstance(obj, list | tuple | set | frozenset):
        items = list(obj)
    elif isinstance(obj, dict):
        items = list(obj.values())
    elif dataclasses.is_dataclass(obj):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, types.ModuleType | nn.Module):
        items = list(vars(obj).values())
    else:
        items = [getattr(obj, s, None) for s in getattr(type(obj), "__slots__", ())]
    for x in items:
        if isinstance(x, torch.Tensor) or tensor_holder(x, depth - 1) is not None:
            return type(obj).__qualname__
    return None
