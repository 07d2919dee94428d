"""The objects a whole training step reaches, and whether one was replaced after capture.

A captured step replays the kernels of the objects ``fn`` reached at capture: a loss module, an
optimizer, a model, a scheduler held in a trainer's attribute, a closure cell, a module global
or a dict entry. One replaced after capture (``trainer.loss_fn = nn.L1Loss()``,
``st["opt"] = Adam(...)``) would be ignored by every replay, silently. :class:`Reach` notes
those objects right after the capture and names the first one replaced before each replay
(:meth:`tgraph.step.captured.CapturedStep.change`); the step then runs eagerly and is captured
again after warmup.

Where it looks (from ``fn``): a bound method's ``__self__.__dict__`` (of a module: its
submodules), a ``functools.partial``'s function, arguments and keywords, the closure cells of
``fn`` and the module globals its code names; and one level deeper, the entries of the dicts
and lists and the ``__dict__`` of the plain objects found there. Compared by identity: every
object that is not a tensor (tensors are the graph's static buffers, checked elsewhere) nor a
plain value (numbers, strings, None: a value ``fn`` reads is baked in, and a counter the
trainer bumps every step must not recapture every step; README, "Not seen"). Containers of
tensors and plain values only (``self.batch = (x, y)``) are not compared either.
"""

from __future__ import annotations

import datetime
import functools
import logging
import types
from collections.abc import Iterator
from operator import attrgetter, getitem
from typing import Any

import torch
import torch.nn as nn

from tgraph.python_state import global_names, plain

_CELL = attrgetter("cell_contents")
# a module's own tables besides its submodules: tensors (checked elsewhere) and hooks
# (tgraph.baked compares those, with its own policy for inert ones)
_MODULE_INTERNALS = frozenset(k for k in vars(nn.Module()) if k != "_modules")


# Objects no kernel of a step reads, which a trainer replaces at will: compared by class only
_INERT = (logging.Logger, datetime.date, datetime.time, datetime.timedelta)


def _tracked(v: object) -> bool:
    """Whether ``v`` is compared: an object that is neither a tensor nor plain, nor a container
    holding only those."""
    if isinstance(v, torch.Tensor) or plain(v):
        return False
    if isinstance(v, dict):
        return any(map(_tracked, v.values()))
    if isinstance(v, list | tuple):
        return any(map(_tracked, v))
    return True


def _by_class(v: object) -> bool:
    """Whether ``v`` is compared by its class, not its identity: a record of plain values only
    (a dataclass a trainer makes anew every step: ``self.state = TrainState(step=i)``; its values,
    like any plain value ``fn`` reads, are baked), a logger, a date or time, an iterator (a data
    iterator made anew every epoch). Identity for everything else: a replaced one of those
    would recapture at every step and never replay."""
    if isinstance(v, _INERT) or (isinstance(v, Iterator) and not isinstance(v, torch.Generator)):
        return True
    return _plain_object(v) and not callable(v) and not any(map(_tracked, vars(v).values()))


def _plain_object(v: object) -> bool:
    """An instance of a user class whose ``__dict__`` is looked into (a trainer, a config, a
    callable helper holding the loss module)."""
    return (
        hasattr(v, "__dict__")
        and not isinstance(v, type | types.ModuleType | types.FunctionType | types.MethodType)
        and not isinstance(v, functools.partial | nn.Module | torch.optim.Optimizer)
    )


class Reach:
    """The objects ``fn`` reaches (module docstring), noted now; :meth:`change` names the
    first one replaced since. Held flat: ``tables[i][keys[i]]`` was ``objects[i]`` (a C-level
    pass of ``getitem`` and ``id`` per replay), and closure ``cells[j]`` held ``cell_objects[j]``.
    The objects are held, so their ids are not reused."""

    __slots__ = (
        "_cell_ids",
        "_cell_names",
        "_cells",
        "_class_keys",
        "_class_names",
        "_class_tables",
        "_classes",
        "_held",
        "_ids",
        "_keys",
        "_names",
        "_tables",
    )

    def __init__(self, fn: Any) -> None:
        self._tables: list[Any] = []
        self._keys: list[Any] = []
        self._names: list[str] = []
        self._cells: list[types.CellType] = []
        self._cell_names: list[str] = []
        self._class_tables: list[Any] = []  # entries compared by class (_by_class)
        self._class_keys: list[Any] = []
        self._class_names: list[str] = []
        self._root(fn, getattr(fn, "__qualname__", type(fn).__name__), set())
        self._ids = tuple(map(id, map(getitem, self._tables, self._keys)))
        self._classes = tuple(map(type, map(getitem, self._class_tables, self._class_keys)))
        self._cell_ids = tuple(map(id, map(_CELL, self._cells)))
        # the objects themselves, so that an id seen now is never another object's later
        self._held = (tuple(map(getitem, self._tables, self._keys)), tuple(map(_CELL, self._cells)))

    # -- what fn reaches ------------------------------------------------------------------------

    def _root(self, fn: Any, where: str, seen: set[int]) -> None:
        if id(fn) in seen:
            return
        seen.add(id(fn))
        if isinstance(fn, functools.partial):
            self._root(fn.func, where, seen)
            for i, a in enumerate(fn.args):
                self._value(a, f"{where} argument {i}", deeper=True)
            self._table(fn.keywords, f"{where} keyword", deeper=True)
            return
        if isinstance(fn, types.MethodType):
            self._object(fn.__self__, f"{type(fn.__self__).__name__}", deeper=True)
            fn = fn.__func__
        wrapped = getattr(fn, "__wrapped__", None)  # functools.wraps, torch.compile
        if wrapped is not None:
            self._root(wrapped, where, seen)
        code = getattr(fn, "__code__", None)
        if code is None:  # a callable object: its attributes
            if not isinstance(fn, types.BuiltinFunctionType):
                self._object(fn, type(fn).__name__, deeper=True)
            return
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later in the outer function)
                continue
            if _tracked(v):
                self._cells.append(cell)
                self._cell_names.append(f"closure variable {name!r} of {where}")
            self._value(v, name, deeper=True, note=False)
        g = fn.__globals__
        names = [k for k in global_names(code) if k in g]
        self._table(g, "global", deeper=True, keys=names, attrs=True)

    def _object(self, obj: Any, where: str, deeper: bool) -> None:
        table = getattr(obj, "__dict__", None)
        if not isinstance(table, dict):
            return
        if isinstance(obj, nn.Module):
            keys = [k for k in table if k not in _MODULE_INTERNALS]
            self._table(table, where, deeper, keys, attrs=True)
        else:
            self._table(table, where, deeper, attrs=True)

    def _table(
        self, table: Any, where: str, deeper: bool, keys: Any = None, attrs: bool = False
    ) -> None:
        """``table``'s entries (of ``keys``): a list's, a dict's, or attributes (``attrs``)."""
        if isinstance(table, list):
            keys = range(len(table))
        elif keys is None:
            keys = list(table)
        for k in keys:
            name = f"{where}.{k}" if attrs else f"{where}[{k!r}]"
            self._value(table[k], name, deeper, table=table, key=k)

    def _value(
        self,
        v: Any,
        where: str,
        deeper: bool,
        table: Any = None,
        key: Any = None,
        note: bool = True,
    ) -> None:
        if not _tracked(v):
            return
        if _by_class(v):
            if note and table is not None:
                self._class_tables.append(table)
                self._class_keys.append(key)
                self._class_names.append(where)
            return
        if note and table is not None:
            self._tables.append(table)
            self._keys.append(key)
            self._names.append(where)
        if not deeper:
            return
        if isinstance(v, dict | list):
            self._table(v, where, deeper=False)
        elif isinstance(v, nn.Module):  # its submodules and the objects it holds (a partial)
            self._object(v, where, deeper=False)
        elif _plain_object(v):
            self._object(v, where, deeper=False)

    # -- before each replay ---------------------------------------------------------------------

    def change(self) -> str | None:
        """The first object replaced since capture, in words, or None (two C-level passes)."""
        try:
            if (
                tuple(map(id, map(getitem, self._tables, self._keys))) == self._ids
                and tuple(map(id, map(_CELL, self._cells))) == self._cell_ids
                and tuple(map(type, map(getitem, self._class_tables, self._class_keys)))
                == self._classes
            ):
                return None
        except (KeyError, IndexError, ValueError):
            pass
        return self._difference()

    def _difference(self) -> str:
        for table, key, was, name in zip(self._tables, self._keys, self._ids, self._names):
            try:
                now = table[key]
            except (KeyError, IndexError):
                return f"{name} was removed after capture (the graph replays the captured one)"
            if id(now) != was:
                return _replaced(name, now)
        for cell, was, name in zip(self._cells, self._cell_ids, self._cell_names):
            try:
                now = cell.cell_contents
            except ValueError:
                return f"{name} was deleted after capture (the graph replays the captured one)"
            if id(now) != was:
                return _replaced(name, now)
        for table, key, was, name in zip(
            self._class_tables, self._class_keys, self._classes, self._class_names
        ):
            now = table.get(key) if isinstance(table, dict) else None
            if type(now) is not was:
                return (
                    f"{name} is now a {type(now).__name__}, a {was.__name__} at capture (the "
                    "graph replays what the captured one's code did)"
                )
        return "an object the step reaches was replaced after capture"


def _replaced(name: str, now: object) -> str:
    return (
        f"{name} was replaced after capture (now a {type(now).__name__}; the graph replays "
        "the kernels of the captured one)"
    )


__all__ = ["Reach"]
