"""The optimizer hyper-parameters a captured step reads, and how they reach the graph.

A graph bakes every Python number it reads into its kernels. So learning rates move into device
tensors that schedulers keep updating (:meth:`HyperParams.prepare`, :meth:`HyperParams.refresh`),
and a learning rate that cannot (a float another optimizer reads on the host) is refused at the
next step with a message naming the fix. The other numbers of a param_group (weight decay, betas,
momentum) have no tensor form in torch's kernels: a change is named by
:meth:`HyperParams.change` before the next replay and the step is captured again with it. Never
frozen silently. Used by :class:`tgraph.FullIterationGraph`
and :class:`tgraph.OptimizerGraph`.
"""

from __future__ import annotations

from itertools import chain
from operator import is_
from typing import Any

import torch


def holds_tensor_lr(group: dict) -> bool:
    """Whether this param_group's optimizer reads a tensor ``lr`` without a host sync."""
    return bool(group.get("fused") or group.get("capturable"))


class HyperParams:
    """The optimizer hyper-parameters a captured step reads, and how they reach the graph."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self._groups = [
            (type(o).__name__, i, g) for o in optimizers for i, g in enumerate(o.param_groups)
        ]
        self._converted: list[tuple[dict, torch.Tensor, float]] = []
        self._tensor_lrs: list[tuple[dict, torch.Tensor]] = []
        self._baked_lrs: list[tuple[str, int, dict, str, Any]] = []
        self._baked: list[tuple[str, int, dict, str, Any]] = []

    @property
    def groups(self) -> list[dict]:
        """The param_group dicts these hyper-parameters cover (every group of the optimizers
        given at construction)."""
        return [g for _, _, g in self._groups]

    def covers(self, group: dict) -> bool:
        """Whether ``group`` (a param_group dict) is one of :attr:`groups`."""
        return any(g is group for _, _, g in self._groups)

    def lr_tensors(self) -> list[torch.Tensor]:
        """The learning rates held in device tensors now (after :meth:`prepare`: every group
        whose optimizer reads a tensor ``lr``)."""
        return [g["lr"] for _, _, g in self._groups if isinstance(g.get("lr"), torch.Tensor)]

    def prepare(self) -> None:
        """Move float learning rates into device tensors; remember the values a graph bakes."""
        for _, _, g in self._groups:
            lr = g.get("lr")  # a custom optimizer may have none
            if not isinstance(lr, torch.Tensor) and holds_tensor_lr(g):
                # float32: the fused kernels read the tensor lr as float (FusedAdamKernel.cu).
                t = torch.tensor(float(lr), dtype=torch.float32, device=g["params"][0].device)
                self._converted.append((g, t, lr))
                g["lr"] = t
        self._tensor_lrs = [
            (g, g["lr"]) for _, _, g in self._groups if isinstance(g.get("lr"), torch.Tensor)
        ]
        baked = [
            (name, i, g, k, v)
            for name, i, g in self._groups
            for k, v in g.items()
            if k not in ("params", "initial_lr") and not isinstance(v, torch.Tensor)
        ]
        self._baked_lrs = [b for b in baked if b[3] == "lr"]
        self._baked = [b for b in baked if b[3] != "lr"]

    def refresh(self) -> None:
        """Before a replay: bring replaced learning rates into their tensors; refuse a change of
        a float learning rate the graph baked in."""
        self._refresh_tensor_lrs()
        self._check_baked()

    def reinstate(self) -> None:
        """Before another capture reads these hyper-parameters: bring replaced learning rates
        into their tensors and put the tensors back in their param_groups, so that the new graph
        reads the tensors too instead of baking the float a scheduler or the user assigned."""
        self._refresh_tensor_lrs()

    def replaced(self) -> str | None:
        """After a capture: the param_group whose learning-rate tensor the captured step itself
        replaced (``group['lr'] = 0.01`` inside it: the graph baked that value, and a later
        value would be copied into a tensor the graph does not read), or None."""
        held = {id(g): t for g, t in self._tensor_lrs}
        for name, i, g in self._groups:
            if id(g) in held and g.get("lr") is not held[id(g)]:
                return f"{name} param_group {i}"
        return None

    def change(self) -> str | None:
        """Why a captured step no longer fits: a Python number of a param_group other than a
        float ``lr`` (``weight_decay``, ``betas``, ``momentum``, ...) changed since the capture.
        The fused and capturable kernels take these as host numbers, so no device tensor can
        carry them: the entry captures the step again after warmup, with the new value. None:
        unchanged."""
        for name, i, g, k, v in self._baked:
            if g.get(k, v) != v:
                return (
                    f"{name} param_group {i}: {k!r} changed after capture (a Python number the "
                    "graph bakes into its kernels; a value changed at every step keeps the step "
                    "mostly eager: change it less often)"
                )
        return None

    def _refresh_tensor_lrs(self) -> None:
        for g, t in self._tensor_lrs:
            live = g["lr"]
            if live is not t:  # a scheduler (older PyTorch) or the user assigned a new value
                with torch.no_grad():
                    t.copy_(live) if isinstance(live, torch.Tensor) else t.fill_(float(live))
                g["lr"] = t

    def _check_baked(self) -> None:
        for name, i, g, k, v in self._baked_lrs:
            if g.get(k, v) != v:
                raise ValueError(
                    f"{name} param_group {i}: {k!r} changed from {v!r} to {g[k]!r} after capture, "
                    f"but the captured graph baked {v!r} into its kernels. To fix: build {name} "
                    "with fused=True (or capturable=True for Adam/AdamW) so tgraph holds the "
                    "learning rate in a device tensor."
                )

    def restore(self) -> None:
        """Undo :meth:`prepare`: float learning rates again (current values)."""
        for g, t, _ in self._converted:
            if g["lr"] is t:
                g["lr"] = float(t)
        self._converted.clear()


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
        if groups != groups0:
            return f"the parameters of a {name} param group changed after capture"
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
