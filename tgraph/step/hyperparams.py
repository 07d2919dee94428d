"""The optimizer hyper-parameters a captured step reads, and how they reach the graph.

A graph bakes every Python number it reads into its kernels, so a learning rate reaches it
through a device tensor. A param_group keeps the value its owner gave it: a Python float stays a
float (schedulers compute the next one in doubles, checkpoints hold it), and the graph reads a
0-dim float32 tensor of tgraph's own instead, which the param_group holds only while the step is
captured (:meth:`HyperParams.lent`) and which is filled with the float before a replay whenever
the float changed (:meth:`HyperParams.refresh`). A learning rate that is a tensor at capture
is read by the graph in place, so its in-place updates (``fill_``, a scheduler) reach it with no
copy. A float learning rate the graph cannot read from a tensor (another optimizer reads it on
the host) is refused at the next step with a message naming the fix. Everything else is named by
:meth:`HyperParams.change` before the next replay, and the step is captured again: an ``lr``
tensor replaced by another object (or a float by a tensor), and a change of the other values of
a param_group (weight decay, betas, momentum: host numbers of torch's kernels, compared with a
copy taken at capture, so a list changed in place is seen too). Never frozen silently. Used by
:class:`tgraph.FullIterationGraph` and :class:`tgraph.OptimizerGraph`.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from itertools import chain
from operator import is_
from typing import Any

import torch


def holds_tensor_lr(group: dict) -> bool:
    """Whether this param_group's optimizer reads a tensor ``lr`` without a host sync."""
    return bool(group.get("fused") or group.get("capturable"))


def _copied(value: Any) -> Any:
    """``value`` with its lists, tuples and dicts copied (recursively): a later in-place change
    of the param_group's value (``group['betas'][0] = 0.5`` on a list) does not reach the copy.
    Other objects are kept as they are (compared by their own ``==``)."""
    if type(value) in (list, tuple):
        return type(value)(map(_copied, value))
    if type(value) is dict:
        return {k: _copied(v) for k, v in value.items()}
    return value


class _HeldLr:
    """A param_group's float learning rate and the device tensor the graph reads it from."""

    __slots__ = ("group", "tensor", "value")

    def __init__(self, group: dict) -> None:
        self.group = group
        # float32: the fused kernels read a tensor lr as float (FusedAdamKernel.cu)
        self.tensor = torch.zeros((), dtype=torch.float32, device=group["params"][0].device)
        self.value: Any = None  # the number the tensor holds (None: not filled yet)

    def fill(self, lr: Any) -> None:
        """Bring the float ``lr`` into the tensor, unless the tensor holds it already."""
        if lr != self.value:
            self.tensor.fill_(lr)
            self.value = lr


class HyperParams:
    """The optimizer hyper-parameters a captured step reads, and how they reach the graph."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._groups = [
            (type(o).__name__, i, g) for o in optimizers for i, g in enumerate(o.param_groups)
        ]
        self._held: list[_HeldLr] = []  # float lrs, read by the graph from tensors of our own
        self._in_place: list[tuple[dict, torch.Tensor]] = []  # tensor lrs, read as they are
        self._baked_lrs: list[tuple[str, int, dict, str, Any]] = []
        self._baked: list[tuple[str, int, dict, str, Any]] = []
        self._lent: list[tuple[_HeldLr, Any]] = []  # during lent(): the floats lent out

    @property
    def groups(self) -> list[dict]:
        """The param_group dicts these hyper-parameters cover (every group of the optimizers
        given at construction)."""
        return [g for _, _, g in self._groups]

    def covers(self, group: dict) -> bool:
        """Whether ``group`` (a param_group dict) is one of :attr:`groups`."""
        return any(g is group for _, _, g in self._groups)

    def lr_tensors(self) -> list[torch.Tensor]:
        """The tensors the captured graph reads its learning rates from (after
        :meth:`prepare`): tgraph's own, for float learning rates, and the param_groups' own
        tensors."""
        return [h.tensor for h in self._held] + [t for _, t in self._in_place]

    def prepare(self) -> None:
        """Before the first capture: note how each learning rate reaches the graph (a float in
        a tensor of tgraph's own, where the optimizer reads a tensor ``lr``; a tensor in place)
        and copy the values the graph bakes."""
        for _, _, g in self._groups:
            lr = g.get("lr")  # a custom optimizer may have none
            if isinstance(lr, torch.Tensor):
                self._in_place.append((g, lr))
            elif _is_float(lr) and holds_tensor_lr(g):
                self._held.append(_HeldLr(g))
        read = {id(h.group) for h in self._held} | {id(g) for g, _ in self._in_place}
        baked = [
            (name, i, g, k, _copied(v))
            for name, i, g in self._groups
            for k, v in g.items()
            if k not in ("params", "initial_lr") and not isinstance(v, torch.Tensor)
        ]
        self._baked_lrs = [b for b in baked if b[3] == "lr" and id(b[2]) not in read]
        self._baked = [b for b in baked if b[3] != "lr"]

    @contextlib.contextmanager
    def lent(self) -> Iterator[None]:
        """While a step is captured: each float learning rate is replaced in its param_group by
        the tensor the graph reads (filled with it), so that the captured kernels read the
        tensor; afterwards the float is back, also when the capture raises. (A group whose
        ``lr`` is no longer a float keeps it: :meth:`change` names that after the capture.)"""
        self._lent = [(h, h.group["lr"]) for h in self._held if _is_float(h.group["lr"])]
        for h, lr in self._lent:
            h.fill(lr)
            h.group["lr"] = h.tensor
        try:
            yield
        finally:
            for h, lr in self._lent:
                if h.group["lr"] is h.tensor:  # else the step assigned it: replaced() says so
                    h.group["lr"] = lr
            self._lent = []

    def refresh(self) -> None:
        """Before a replay (after :meth:`change` found none): bring a changed float learning
        rate into the tensor the graph reads; refuse a change of a float learning rate the
        graph baked in."""
        for h in self._held:
            h.fill(h.group["lr"])
        self._check_baked()

    def replaced(self) -> str | None:
        """After a capture, within :meth:`lent`: the param_group whose learning-rate tensor the
        captured step itself replaced (``group['lr'] = 0.01`` inside it: the graph baked that
        value), or None."""
        for g, t in [(h.group, h.tensor) for h, _ in self._lent] + self._in_place:
            if g.get("lr") is not t:
                name, i = self._where(g)
                return f"{name} param_group {i}"
        return None

    def change(self) -> str | None:
        """Why a captured step no longer fits, or None: a param_group's learning-rate tensor
        replaced (or its float replaced by a tensor: the graph reads the tensor it had), or a
        Python value of a param_group other than a float ``lr`` (``weight_decay``, ``betas``,
        ``momentum``, ...) changed since the capture, in place or not. The fused and capturable
        kernels take these as host numbers, so no device tensor can carry them: the entry
        captures the step again after warmup, with the new value."""
        for h in self._held:
            lr = h.group.get("lr")
            if not _is_float(lr):
                name, i = self._where(h.group)
                return (
                    f"{name} param_group {i}: 'lr' was a float at capture and is a "
                    f"{type(lr).__name__} now"
                )
        for g, t in self._in_place:
            if g.get("lr") is not t:
                name, i = self._where(g)
                return (
                    f"{name} param_group {i}: its 'lr' tensor was replaced after capture (the "
                    "graph reads the one it had; update that one in place, lr.fill_(value), to "
                    "keep the step replaying)"
                )
        for name, i, g, k, v in self._baked:
            if g.get(k, v) != v:
                return (
                    f"{name} param_group {i}: {k!r} changed after capture (a Python number the "
                    "graph bakes into its kernels; a value changed at every step keeps the step "
                    "mostly eager: change it less often)"
                )
        return None

    def _where(self, group: dict) -> tuple[str, int]:
        return next((name, i) for name, i, g in self._groups if g is group)

    def _check_baked(self) -> None:
        for name, i, g, k, v in self._baked_lrs:
            now = g.get(k, v)
            if now is not v and (isinstance(now, torch.Tensor) or now != v):
                raise ValueError(
                    f"{name} param_group {i}: {k!r} changed from {v!r} to {now!r} after capture, "
                    f"but the captured graph baked {v!r} into its kernels. To fix: build {name} "
                    "with fused=True (or capturable=True for Adam/AdamW) so tgraph holds the "
                    "learning rate in a device tensor."
                )


def _is_float(value: Any) -> bool:
    """A Python number (``float`` first: an ABC check costs a few hundred nanoseconds)."""
    return type(value) is float or (
        isinstance(value, numbers.Real) and not isinstance(value, torch.Tensor)
    )


def baked_layout(optimizers: list[torch.optim.Optimizer]) -> tuple:
    """What a captured optimizer step baked in beyond hyper-parameters: the param groups (which
    parameters each steps) and the state tensors (by identity: ``load_state_dict`` replaces
    them, and the graph would keep stepping the old ones)."""
    return tuple(
        (
            tuple((id(g), tuple(map(id, g["params"]))) for g in opt.param_groups),
            tuple(
                (id(p), tuple(id(v) for v in st.values() if isinstance(v, torch.Tensor)))
                for p, st in opt.state.items()
            ),
        )
        for opt in optimizers
    )


def layout_objects(optimizers: list[torch.optim.Optimizer]) -> list:
    """Everything :func:`baked_layout` holds, as the objects themselves (the groups, the
    parameters, the state's keys, sizes and values), in one flat list built by C-level passes:
    compared by identity (``is``), it needs no int per object and no id a freed object left
    can match."""
    key: list = []
    for opt in optimizers:
        groups, state = opt.param_groups, opt.state
        key += groups
        for g in groups:
            key.append(len(g["params"]))
            key += g["params"]
        key.append(len(state))
        key += state
        key += map(len, state.values())
        key += chain.from_iterable(map(dict.values, state.values()))
    return key


def layout_change(before: tuple, optimizers: list[torch.optim.Optimizer]) -> str | None:
    """Why the optimizers' layout differs from ``before`` (:func:`baked_layout`), or None."""
    now = baked_layout(optimizers)
    if now == before:
        return None
    for opt, (groups, states), (groups0, states0) in zip(optimizers, now, before):
        name = type(opt).__name__
        if len(groups) != len(groups0):
            return f"{name} has {len(groups)} param groups, captured with {len(groups0)} (add_param_group)"
        if [p for _, p in groups] != [p for _, p in groups0]:
            return f"the parameters of a {name} param group changed after capture"
        if groups != groups0:
            return (
                f"{name}'s param groups were replaced after capture (optimizer.load_state_dict "
                "or a new param_groups list)"
            )
        if states != states0:
            return f"{name}'s state tensors were replaced after capture (optimizer.load_state_dict)"
    return "the optimizers changed after capture"


class BakedLayout:
    """The layout a captured step baked in (:func:`baked_layout`), checked before every replay.

    The check compares one flat list of objects by identity (:func:`layout_objects`, a few
    microseconds for hundreds of parameters); only when that differs (a value that is not a
    tensor, such as a Python step count, moves at every step; or a real change) does the
    structured comparison run, which names what changed.
    """

    __slots__ = ("optimizers", "before", "key")

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.before = baked_layout(self.optimizers)
        self.key = layout_objects(self.optimizers)

    def change(self) -> str | None:
        """Why the optimizers' layout differs from the captured one, or None."""
        key = layout_objects(self.optimizers)
        if len(key) == len(self.key) and all(map(is_, key, self.key)):
            return None
        why = layout_change(self.before, self.optimizers)
        if why is None:
            self.key = key  # only values that are not tensors moved
        return why
