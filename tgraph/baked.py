"""What a captured per-layer graph baked in beyond its static inputs (the baked inventory),
and the check before replay.

A graph runs no Python: it keeps the memory each parameter and buffer lived in at capture, the
effect of every Python value its forward read and of every hook that ran. :class:`Baked` is the
frozen inventory of those, taken right after the forward capture; before each replay
:func:`tgraph.layers.replay.check` asks it what differs now (:meth:`Baked.changed_hooks`,
:meth:`Baked.changed_attrs`, :meth:`Baked.moved`: a few microseconds, tuple comparisons of cached
getters).

What is checked, per module of the unit (the graphed module and its submodules):

* **plain attributes**, public and private (bool, int, float, str, None, tuples of them; e.g.
  ``dropout.p``, a temperature, a LoRA ``disable_adapters`` flag), by value, and public tensor
  and function attributes (outside ``_parameters`` and ``_buffers``) by identity;
* **parameters and buffers**: the same tensor objects, on the same memory;
* **hooks**: the module's forward, forward-pre and backward hooks, and the global module hooks.

What is not checked, and therefore a rule (README, "What a graph keeps"): Python state outside the
modules (a global, a config object's fields mutated in place, a closure), read by ``forward``.
"""

from __future__ import annotations

import functools
import operator
import sys
import types
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from operator import getitem

import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from tgraph.pool import storage_uses
from tgraph.python_state import forward_globals, plain, unread

_data_ptr = torch.Tensor.data_ptr
_stride = torch.Tensor.stride
_size = torch.Tensor.size

_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _by_identity(v: object) -> bool:
    """Tensors and functions a forward reads, outside ``_parameters`` and ``_buffers``. Other
    objects are not compared: modules assign some in every forward (megatron's checkpoint and
    offloading managers), which would make every call fall back."""
    return isinstance(v, torch.Tensor) or isinstance(
        v, types.FunctionType | types.BuiltinFunctionType
    )


def _getter(keys: list[str]):
    return operator.itemgetter(*keys) if len(keys) > 1 else (lambda d, k=keys[0]: (d[k],))


@dataclass(frozen=True)
class _Slots:
    """One dict of one module, the keys a graph depends on and their values at capture."""

    where: str  # "fc1" / "fc1.weight" prefix for messages
    table: dict
    keys: tuple[str, ...]
    get: object
    values: tuple


def _slots(where: str, table: dict, keys: list[str], by_id: bool) -> _Slots | None:
    if not keys:
        return None
    get = _getter(keys)
    values = get(table)
    return _Slots(where, table, tuple(keys), get, tuple(map(id, values)) if by_id else values)


@dataclass(frozen=True)
class Baked:
    """The baked inventory of one unit's graphs (see the module docstring)."""

    attrs: tuple[_Slots, ...]
    tensors: tuple[_Slots, ...]  # parameters and buffers, by identity
    refs: tuple[weakref.ref, ...]  # the same parameters and buffers, in order (weakly)
    held: tuple[torch.Tensor, ...]  # ... aliases of the memory the graph reads (kept alive)
    place: tuple[tuple, tuple, tuple]  # ... where and how the graph reads it (:func:`where`)
    names: tuple[str, ...]  # ... and their qualified names
    is_buffer: tuple[bool, ...]
    hooks: tuple[tuple[str, dict], ...]
    hook_counts: tuple[int, ...]
    live_counts: tuple[int, ...] = ()  # ... without transformers' inert output hooks (_inert)
    # Found as captured although they differ (transformers installs its inert hooks and a
    # bookkeeping flag at the first output_attentions call, for good): [torch's hook counter,
    # the hook tables' sizes] and [the modules' __dict__ sizes], where last seen so
    inert_hooks: list = field(default_factory=lambda: [-1, ()])
    inert_sizes: list = field(default_factory=lambda: [()])
    # Flat copies of the above for the per-call checks: one C-level pass each (map over
    # parallel tuples), not a Python loop over modules.
    objects: tuple[_Slots, ...] = ()  # other public attributes, by identity
    object_tables: tuple[dict, ...] = ()
    object_keys: tuple[str, ...] = ()
    object_ids: tuple[int, ...] = ()
    attr_tables: tuple[dict, ...] = ()
    attr_keys: tuple[str, ...] = ()
    attr_values: tuple = ()
    tensor_tables: tuple[dict, ...] = ()
    tensor_keys: tuple[str, ...] = ()
    dicts: tuple[dict, ...] = ()  # each module's __dict__: a new key (an instance attribute
    dict_sizes: tuple[int, ...] = ()  # shadowing a class attribute) changes its size
    dict_names: tuple[str, ...] = ()
    dict_keys: tuple[frozenset, ...] = ()
    # the module tree: each module's class (a parametrization changes it) and submodules
    mods: tuple[nn.Module, ...] = ()
    classes: tuple[type, ...] = ()
    sub_tables: tuple[dict, ...] = ()  # each module's _modules
    sub_sizes: tuple[int, ...] = ()
    sub_slots: tuple[dict, ...] = ()  # ... flat, per submodule: its table, key and identity
    sub_keys: tuple[str, ...] = ()
    sub_ids: tuple[int, ...] = ()
    # the globals the forwards name, flat (checked at every call: no epoch sees them change);
    # values compared with ==: plain values by value, functions by identity
    global_tables: tuple[dict, ...] = ()
    global_keys: tuple[str, ...] = ()
    global_values: tuple = ()
    ptr_list: list = field(default_factory=list)  # place's addresses and their indices, as
    all_indices: list = field(default_factory=list)  # lists: torch's C++ pointer pass takes lists
    hook_epoch: int = -1  # torch's hook-handle counter when taken: no hook registered since
    any_hooks: bool = True  # a hook (other than transformers' inactive ones) when taken

    @classmethod
    def of(
        cls,
        modules: list[tuple[str, nn.Module]],
        roots: list[nn.Module],
        graph_memory: Baked | None = None,
        skip: dict[int, set[str]] | None = None,
    ) -> Baked:
        """The inventory of ``modules`` (qualified name, module) as they are now; ``roots``: the graphed
        modules among them (their own forward hooks run eagerly at every call, see
        :func:`call_with_own_hooks`); ``graph_memory``: keep the memory of an earlier inventory
        as what the graph reads (after a re-bind); ``skip``: per module (by id), attributes
        a replay itself stores (tensors the forward leaves in module state)."""
        attrs, objects, tensors, memory, names, hooks, is_buffer = [], [], [], [], [], [], []
        for name, m in modules:
            d = vars(m)
            skipped = unread(m)
            keys = [k for k, v in d.items() if k not in skipped and plain(v)]
            s = _slots(name, d, keys, by_id=False)
            if s is not None:
                attrs.append(s)
            stored = skip.get(id(m), ()) if skip else ()
            keys = [
                k
                for k, v in d.items()
                if not k.startswith("_") and _by_identity(v) and k not in stored
            ]
            s = _slots(name, d, keys, by_id=True)  # a tensor attribute, a function
            if s is not None:
                objects.append(s)
            for table_name in ("_parameters", "_buffers"):
                table = d[table_name]
                keys = [k for k, v in table.items() if v is not None]
                s = _slots(name, table, keys, by_id=True)
                if s is not None:
                    tensors.append(s)
                    for k in keys:
                        memory.append(table[k])
                        names.append(f"{name}.{k}" if name else k)
                        is_buffer.append(table_name == "_buffers")
            own = _OWN_HOOKS if m in roots and hooks_run_outside(m) else ()
            hooks += [(f"{name}.{h}", d[h]) for h in _HOOKS if h not in own]
        hooks += [(f"torch.nn.modules.module.{h}", getattr(nn_module, h)) for h in _GLOBAL_HOOKS]
        read = forward_globals([m for _, m in modules])  # the read set
        for where_, g, keys in read:
            s = _slots(where_, g, [k for k in keys if plain(g[k])], by_id=False)
            attrs += [s] if s is not None else []
            s = _slots(where_, g, [k for k in keys if not plain(g[k])], by_id=True)
            objects += [s] if s is not None else []
        glob = [(g, k) for _, g, keys in read for k in keys]
        mods = tuple(m for _, m in modules)
        _count_writes_to(mods)
        subs = [(vars(m)["_modules"], k) for m in mods for k in vars(m)["_modules"]]
        held = tuple(t.detach() for t in memory) if graph_memory is None else graph_memory.held
        place = where(held)
        return cls(
            attrs=tuple(attrs),
            tensors=tuple(tensors),
            refs=tuple(weakref.ref(t) for t in memory),
            held=held,
            place=place,
            ptr_list=list(place[0]),
            all_indices=list(range(len(held))),
            names=tuple(names),
            is_buffer=tuple(is_buffer),
            hooks=tuple(hooks),
            hook_counts=tuple(len(h) for _, h in hooks),
            live_counts=tuple(_live(h) for _, h in hooks),
            objects=tuple(objects),
            object_tables=tuple(o.table for o in objects for _ in o.keys),
            object_keys=tuple(k for o in objects for k in o.keys),
            object_ids=tuple(v for o in objects for v in o.values),
            attr_tables=tuple(a.table for a in attrs for _ in a.keys),
            attr_keys=tuple(k for a in attrs for k in a.keys),
            attr_values=tuple(v for a in attrs for v in a.values),
            tensor_tables=tuple(t.table for t in tensors for _ in t.keys),
            tensor_keys=tuple(k for t in tensors for k in t.keys),
            dicts=tuple(vars(m) for _, m in modules),
            dict_sizes=tuple(len(vars(m)) for _, m in modules),
            dict_names=tuple(name for name, _ in modules),
            dict_keys=tuple(frozenset(vars(m)) for _, m in modules),
            mods=mods,
            global_tables=tuple(g for g, _ in glob),
            global_keys=tuple(k for _, k in glob),
            global_values=tuple(g[k] for g, k in glob),
            classes=tuple(map(type, mods)),
            sub_tables=tuple(vars(m)["_modules"] for m in mods),
            sub_sizes=tuple(len(vars(m)["_modules"]) for m in mods),
            sub_slots=tuple(t for t, _ in subs),
            sub_keys=tuple(k for _, k in subs),
            sub_ids=tuple(id(t[k]) for t, k in subs),
            hook_epoch=RemovableHandle.next_id,
            any_hooks=any(not _inert(f) for _, h in hooks for f in h.values()),
        )

    # ------------------------------------------------------------------ checks
    def changed_hooks(self, scan: bool = False) -> str | None:
        """Why the hooks differ from the inventory's (None: they do not). Without ``scan``, the
        tables are read only if a hook was registered anywhere since it was taken, or one was
        present (it may have been removed)."""
        epoch = RemovableHandle.next_id
        if not scan and not self.any_hooks and epoch in (self.hook_epoch, self.inert_hooks[0]):
            return None  # no hook registered anywhere since, none to remove: unchanged
        counts = tuple(len(h) for _, h in self.hooks)
        if counts == self.hook_counts or counts == self.inert_hooks[1]:
            return None
        if tuple(_live(h) for _, h in self.hooks) == self.live_counts:
            self.inert_hooks[:] = epoch, counts  # only inert hooks came or went: as captured
            return None
        for (where, table), n in zip(self.hooks, self.live_counts):
            if _live(table) != n:
                fns = ", ".join(getattr(f, "__name__", repr(f)) for f in table.values())
                return (
                    f"the hooks of {where} changed after capture (now: {fns or 'none'}); a graph "
                    "replays the effect of the hooks present at capture only"
                )
        return None

    def same_tree(self) -> bool:
        """Whether every module has its class and submodules of the capture (C-level passes)."""
        try:
            return (
                tuple(map(type, self.mods)) == self.classes
                and tuple(map(len, self.sub_tables)) == self.sub_sizes
                and tuple(map(id, map(getitem, self.sub_slots, self.sub_keys))) == self.sub_ids
            )
        except KeyError:
            return False

    def changed_tree(self) -> str | None:
        """Why the module tree is not the captured one (None: it is): a submodule replaced,
        added or removed, or a module's class changed (a parametrization added or removed)."""
        if self.same_tree():
            return None
        for name, m, cls in zip(self.dict_names, self.mods, self.classes):
            if type(m) is not cls:
                return (
                    f"{name} is now a {type(m).__name__}, captured as a {cls.__name__} (a "
                    "parametrization added or removed?); the graph runs the captured one's code"
                )
        for name, table, n in zip(self.dict_names, self.sub_tables, self.sub_sizes):
            if len(table) != n:
                return (
                    f"a submodule was added to or removed from {name} after capture; the graph "
                    "runs the submodules it captured"
                )
        for table, k, was in zip(self.sub_slots, self.sub_keys, self.sub_ids):
            if k not in table or id(table[k]) != was:
                name = next(n for n, t in zip(self.dict_names, self.sub_tables) if t is table)
                return (
                    f"{name}.{k} was replaced by another module after capture; the graph runs "
                    "the one it captured"
                )
        return None

    def changed_attrs(self) -> str | None:
        sizes = tuple(map(len, self.dicts))
        if sizes != self.dict_sizes and sizes != self.inert_sizes[0]:
            for name, d, n, keys in zip(
                self.dict_names, self.dicts, self.dict_sizes, self.dict_keys
            ):
                if len(d) != n:
                    added, gone = sorted(set(d) - keys - _BOOKKEEPING), sorted(keys - set(d))
                    if not added and not gone:
                        continue
                    what = (
                        f"{name}.{added[0]} was set" if added else f"{name}.{gone[0]} was deleted"
                    )
                    return f"{what} after capture; the graph reads what the forward saw at capture"
            self.inert_sizes[0] = sizes  # only bookkeeping flags came: as captured
        try:
            if tuple(map(getitem, self.attr_tables, self.attr_keys)) == self.attr_values and (
                tuple(map(id, map(getitem, self.object_tables, self.object_keys)))
                == self.object_ids
            ):
                return None
        except KeyError:
            pass
        for s in self.objects:
            for k, was in zip(s.keys, s.values):
                if k not in s.table:
                    return f"{s.where}.{k} was deleted after capture"
                if id(s.table[k]) != was:
                    return (
                        f"{s.where}.{k} was replaced by another object after capture; the graph "
                        "reads the one it saw at capture"
                    )
        for s in self.attrs:
            try:
                now = s.get(s.table)
            except KeyError:
                return f"an attribute of {s.where or 'the module'} was deleted after capture"
            if now != s.values:
                for k, was, v in zip(s.keys, s.values, now):
                    if v != was:
                        where = f"{s.where}.{k}" if s.where else k
                        return (
                            f"{where} changed from {was!r} to {v!r} after capture; the graph "
                            f"baked {was!r} into its kernels"
                        )
        return None

    def replaced_tensors(self, live: tuple[torch.Tensor, ...] | None = None) -> str | None:
        """Why the parameters and buffers are not the captured objects (None: they are)."""
        if live is not None and all(t is r() for t, r in zip(live, self.refs)):
            return None
        for s in self.tensors:
            try:
                now = tuple(map(id, s.get(s.table)))
            except KeyError:
                return f"a parameter or buffer of {s.where} was removed after capture"
            if now != s.values:
                return f"a parameter or buffer of {s.where} was replaced after capture"
        return None

    def changed(self) -> str | None:
        """Anything changed since the inventory was taken, followed or not (a whole-step graph captures
        again): a parameter or buffer replaced or re-pointed, a hook, an attribute."""
        live = self.live()
        if live is None or self.replaced_tensors(live) is not None:
            return self.replaced_tensors() or "a parameter or buffer was removed after capture"
        moved = self.moved(where(live))
        if moved:
            return (
                f"{self.names[moved[0]]} lives in other memory than at capture, or is laid out "
                "otherwise (p.data = ...)"
            )
        return self.changed_hooks() or self.changed_tree() or self.changed_attrs()

    def live(self) -> tuple[torch.Tensor, ...] | None:
        """The parameters and buffers the modules hold now, in the inventory's order (None when
        one was removed)."""
        try:
            return tuple(map(getitem, self.tensor_tables, self.tensor_keys))
        except KeyError:
            return None

    def incompatible(self, live: tuple[torch.Tensor, ...]) -> str | None:
        """Why ``live`` cannot be copied into the graph's memory (None: it can)."""
        for name, t, h in zip(self.names, live, self.held):
            if t.shape != h.shape or t.dtype != h.dtype or t.device != h.device:
                return (
                    f"{name} is now {tuple(t.shape)} {t.dtype} on {t.device}, captured as "
                    f"{tuple(h.shape)} {h.dtype} on {h.device}"
                )
        return None

    def moved(self, now: tuple) -> list[int]:
        """Indices of the tensors that are not the memory the graph reads as it reads it, by
        ``now`` (:func:`where` of the live tensors): other memory (``p.data = ...``), or the
        same memory with other sizes or strides (``p.data = p.data.t()``). Strides of
        dimensions of size 1, and of empty tensors, do not count (no element moves)."""
        if now == self.place:
            return []
        return [
            i
            for i, (p, s, n, p0, s0, n0) in enumerate(zip(*now, *self.place))
            if p != p0 or n != n0 or (s != s0 and not _same_layout(s, s0, n))
        ]

    def relaid(self, live: tuple[torch.Tensor, ...], moved: list[int]) -> str | None:
        """Why a ``moved`` tensor cannot be followed by a copy: it is the graph's memory itself,
        laid out otherwise (a copy would overlap itself)."""
        ptrs, strides, sizes = self.place
        for i in moved:
            if live[i].data_ptr() == ptrs[i]:
                return (
                    f"{self.names[i]} was laid out anew in the memory the graph reads (same "
                    f"address, now strides {live[i].stride()} and sizes {tuple(live[i].shape)}, "
                    f"captured as {strides[i]} and {tuple(sizes[i])}: "
                    "p.data = p.data.t() or a view); the graph would read the old layout"
                )
        return None


# ------------------------------------------------------------------- the module epoch
# Moved by every write through nn.Module's own setters (an attribute, a submodule, a parameter,
# a buffer, a class change) once watch_module_writes() ran: a replay compares a unit's attributes
# and module tree only when it moved since they were last found as baked. A write that bypasses
# the setters (``m.__dict__[k] = v``, ``ModuleList.insert``) is the shadow verifier's to find.
_epoch = [0]
_WATCHED = ("__setattr__", "__delattr__", "add_module", "register_parameter", "register_buffer")
_baked_modules: dict[int, weakref.ref] = {}  # the modules some inventory holds, by id (only
# they count: transformers builds a new ModuleList at every forward, self.layers[:n]); a module
# leaves at its death, before its id can be another's (a stale id would move the epoch at every
# write to whatever object takes it next)


def _count_writes_to(mods) -> None:
    for m in mods:
        i = id(m)
        if i not in _baked_modules:
            _baked_modules[i] = weakref.ref(m, functools.partial(_forget_module, i))


def watched(modules) -> bool:
    """Whether a write to any of ``modules`` through nn.Module's setters moves the epoch."""
    return all(id(m) in _baked_modules for m in modules)


def _forget_module(i: int, _ref, _modules: dict = _baked_modules) -> None:
    _modules.pop(i, None)  # (bound at definition: may run while the interpreter shuts down)


def _counted(fn):
    @functools.wraps(fn)  # sets __wrapped__: watch_module_writes wraps once
    def counted(self, *args, **kwargs):
        if id(self) in _baked_modules:
            _epoch[0] += 1
        return fn(self, *args, **kwargs)

    return counted


def watch_module_writes() -> None:
    """Count writes through ``nn.Module``'s setters (idempotent; :func:`tgraph.enable` calls it,
    so that importing tgraph changes nothing)."""
    for name in _WATCHED:
        fn = nn.Module.__dict__[name]
        if getattr(fn, "__wrapped__", None) is None:
            setattr(nn.Module, name, _counted(fn))


def where(live: tuple[torch.Tensor, ...]) -> tuple:
    """The addresses, strides and sizes of ``live``: three C-level passes."""
    return (tuple(map(_data_ptr, live)), tuple(map(_stride, live)), tuple(map(_size, live)))


def _same_layout(a: tuple, b: tuple, sizes: torch.Size) -> bool:
    """Strides ``a`` and ``b`` address the same elements for ``sizes``."""
    return 0 in sizes or all(x == y for x, y, n in zip(a, b, sizes) if n > 1)


# ------------------------------------------------------------- who uses the captured memory
# A parameter re-pointed after capture (p.data = ..., load_state_dict(assign=True)) is followed by
# a copy into the memory the graphs read, which is safe only while no tensor but tgraph's own uses
# that memory: an EMA swap hands it to the EMA tensor, a state_dict() kept from before shares it.
# Counted by storage: tgraph's own uses are those its capture added (memory_uses before it, the
# same count after), so an alias the user took before the capture counts as someone else's.


def memory_uses(modules: Iterable[nn.Module]) -> dict[int, int]:
    """How many tensors use the memory of each parameter and buffer of ``modules`` (and their
    submodules), by storage (``UntypedStorage._cdata``). Taken before a capture, it tells
    :func:`own_uses` which uses the capture added (tgraph's) from those that were there before
    (the modules' own and the user's).

    Args:
        modules: the modules whose graphs are about to be captured.

    Returns:
        Per storage, its uses now (the modules' tensors, aliases held anywhere).
    """
    return {
        t.untyped_storage()._cdata: storage_uses(t) - 1  # less the storage's Python object
        for root in modules
        for m in root.modules()
        for t in chain(m._parameters.values(), m._buffers.values())
        if t is not None
    }


def own_uses(
    held: Iterable[torch.Tensor | None], uses_before: dict[int, int]
) -> tuple[int | None, ...]:
    """Per captured tensor in ``held``: the uses of its memory while only tgraph uses it, the
    threshold above which a copy into it would overwrite someone else's tensor.

    Taken once every alias tgraph keeps exists (``held`` itself, the inventory's, the
    emulated graphs' tapes) and no draft of the capture holds one any more: the uses now less
    those that were there before the capture (the module's own tensor, the user's aliases).
    Memory made during the capture (a buffer a warmup registered) had only the module's. A
    check then compares ``storage_uses`` of the held tensor with it: the moved tensor's use
    is gone and the check's own storage object takes its place.

    Args:
        held: aliases of the captured memory (None: nothing captured there).
        uses_before: :func:`memory_uses` of the modules before the capture.
    """
    return tuple(
        None if h is None else storage_uses(h) - uses_before.get(h.untyped_storage()._cdata, 1)
        for h in held
    )


def describe_hooks(modules: list[tuple[str, nn.Module]], roots: list[nn.Module]) -> list[str]:
    """Every hook a graph would bake in: ``"where: kind fn"`` (the roots' own forward hooks
    and transformers' inactive output-recording hooks excepted)."""
    found = []
    for name, m in modules:
        own = _OWN_HOOKS if m in roots and hooks_run_outside(m) else ()
        for h in _HOOKS:
            for fn in vars(m)[h].values() if h not in own else ():
                if not _inert(fn) and not _structural(fn):
                    found.append(f"{name}: {h.strip('_').replace('_', ' ')[:-1]} {_name(fn)}")
    for h in _GLOBAL_HOOKS:
        for fn in getattr(nn_module, h).values():
            found.append(f"global {h.strip('_').replace('_', ' ')[:-1]} {_name(fn)}")
    return found


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


# ------------------------------------------------------------- hooks of the graphed module


_OWN_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def hooks_run_outside(m: nn.Module) -> bool:
    """Whether ``m``'s own forward hooks run eagerly around its graphed calls (always, unless
    it or the process has backward hooks, which need ``nn.Module.__call__``'s wrapping)."""
    return not (
        m._backward_hooks
        or m._backward_pre_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


def call_with_own_hooks(m: nn.Module, call, args: tuple, kwargs: dict):
    """``call(args, kwargs)`` between ``m``'s forward pre-hooks and forward hooks, run eagerly
    as ``nn.Module.__call__`` runs them: they see each call's real inputs and outputs."""
    pre_kw = m._forward_pre_hooks_with_kwargs
    for hid, hook in (*nn_module._global_forward_pre_hooks.items(), *m._forward_pre_hooks.items()):
        if hid in pre_kw:
            res = hook(m, args, kwargs)
            if res is not None:
                args, kwargs = res
        else:
            res = hook(m, args)
            if res is not None:
                args = res if isinstance(res, tuple) else (res,)
    out = call(args, kwargs)
    fwd_kw = m._forward_hooks_with_kwargs
    global_kw = getattr(nn_module, "_global_forward_hooks_with_kwargs", {})
    for hid, hook in (*nn_module._global_forward_hooks.items(), *m._forward_hooks.items()):
        res = (
            hook(m, args, kwargs, out) if hid in fwd_kw or hid in global_kw else hook(m, args, out)
        )
        if res is not None:
            out = res
    return out


# ----------------------------------------------------- transformers' output-recording hooks


# Attributes transformers sets on a model for its own bookkeeping, read by no forward's numbers:
# once its output-recording hooks are installed (the first output_attentions call), for good
_BOOKKEEPING = frozenset({"_output_capturing_hooks_installed"})


def _live(table: dict) -> int:
    """How many hooks of ``table`` do something (not :func:`_inert`)."""
    return sum(not _inert(fn) for fn in table.values())


def _inert(fn: object) -> bool:
    """transformers (>= 5) installs output-recording forward hooks on every layer and
    attention module; they do nothing unless a model call records outputs
    (``output_attentions``, ``output_router_logits``), which :func:`recording_outputs` tells."""
    return _transformers_hook(fn, "output_capturing_hook")


def _structural(fn: object) -> bool:
    """transformers' ``enable_input_require_grads`` hook (``gradient_checkpointing_enable``
    installs it on the input embedding): it marks the embedding's output as requiring grad, a
    fact of the autograd graph that a captured forward and backward keep as they were captured
    (removing it moves torch's hook counter, and the hook tables are compared again)."""
    return _transformers_hook(fn, "make_inputs_require_grads")


def _transformers_hook(fn: object, name: str) -> bool:
    return getattr(fn, "__module__", "").startswith("transformers.") and _name(fn).endswith(name)


def recording_outputs() -> str | None:
    """The outputs transformers is recording through hooks now (beyond the layers' hidden
    states, which the graphed layers' own hooks record), or None."""
    oc = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(oc, "_active_collector", None)
    active = collector.get() if collector is not None else None
    if not active:
        return None
    keys = [k for k in active if not k.startswith("_") and k != "hidden_states"]
    return ", ".join(keys) or None
