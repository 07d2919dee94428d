"""What a training step touches, noted during the eager calls of :class:`tgraph.FullIterationGraph`.

:class:`Watch` puts two global hooks around an eager call of ``fn``: an optimizer step
pre-hook notes every ``torch.optim.Optimizer`` that steps (their learning rates reach the graph,
their state is snapshotted and checked) and the ``torch.amp.GradScaler`` that steps it, if one
does (:func:`driving_scaler`: the numbers its ``update()`` passes to the device are checked
before each replay), and a module forward pre-hook notes every module that runs (what the graph
bakes in: :class:`tgraph.baked.Baked`). On the way it refuses what cannot
be captured: per-layer graphs enabled inside ``fn`` (:func:`check_not_nested`) and DDP with
fewer eager iterations than PyTorch requires before a capture (:data:`DDP_MIN_WARMUP`).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tgraph.layers.enable import is_enabled, layer_graphs_enabled

DDP_MIN_WARMUP = 11
"""Eager DDP iterations PyTorch requires before a capture (CUDA notes, DDP section)."""


class Owner(Protocol):
    """What the watch fills: the entry's noted optimizers, scalers and modules, by id."""

    warmup_steps: int
    _optimizers: dict[int, torch.optim.Optimizer]
    _scalers: dict[int, torch.amp.GradScaler]
    _modules: dict[int, nn.Module]


def check_not_nested(modules: Iterable[nn.Module], recurse: bool = True) -> None:
    """Refuse per-layer graphs enabled on one of ``modules`` (or their submodules).

    Raises:
        ValueError: naming the module and the fix.
    """
    for m in modules:
        for sub in m.modules() if recurse else (m,):
            if is_enabled(sub):
                raise ValueError(
                    f"FullIterationGraph: {type(sub).__name__} inside the training step has "
                    "per-layer graphs enabled (tgraph.enable). The two modes do not nest: a "
                    "whole-step graph cannot contain per-layer graph replays. Call "
                    "tgraph.disable(model) before using FullIterationGraph, or keep the "
                    "per-layer graphs and call the step without FullIterationGraph."
                )


def driving_scaler(frames: int = 6) -> torch.amp.GradScaler | None:
    """Inside an optimizer step pre-hook: the ``GradScaler`` whose ``step(optimizer)`` runs this
    optimizer step, or None. torch offers no hook on a scaler, and a training step may hold it
    anywhere (a closure, a global, a trainer's attribute); its ``step`` is on the stack a few
    frames up (the pre-hook, ``Optimizer.step``'s hook wrapper, ``GradScaler._maybe_opt_step``,
    ``GradScaler.step``), its ``self`` the scaler."""
    frame = sys._getframe(1)
    for _ in range(frames):
        frame = frame.f_back
        if frame is None:
            return None
        if "self" in frame.f_code.co_varnames:
            owner = frame.f_locals.get("self")
            if isinstance(owner, torch.amp.GradScaler):
                return owner
    return None


_EXTRA_FIRE = r"Using `torch.compile\(module\)` when there are global hooks on modules"


class Watch:
    """During an eager call: note the optimizers that step and the modules that run in ``fn``."""

    def __init__(self, owner: Owner) -> None:
        self._owner = owner
        self._handles: list[Any] = []
        self._quiet = warnings.catch_warnings()

    def __enter__(self) -> Watch:
        self._handles = [
            register_optimizer_step_pre_hook(self._on_step),
            nn.modules.module.register_module_forward_pre_hook(self._on_forward),
        ]
        # torch.compile(model), the README's step, warns at each call that a global hook fires
        # once more for the compiled wrapper: this one is idempotent (a module noted once)
        self._quiet.__enter__()
        warnings.filterwarnings("ignore", message=_EXTRA_FIRE, category=UserWarning)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._quiet.__exit__(*exc)
        for h in self._handles:
            h.remove()

    def _on_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._owner._optimizers.setdefault(id(opt), opt)
        scaler = None if torch.compiler.is_compiling() else driving_scaler()
        if scaler is not None:
            self._owner._scalers.setdefault(id(scaler), scaler)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        # A global hook runs inside a torch.compile'd module's forward too, where dynamo traces
        # it: reading the owner's modules from there would hand dynamo the compiled model a
        # second time ("UnspecializedNNModuleVariable ... already tracked for mutation"). The
        # compiled module itself is called eagerly and is noted, with its submodules, below.
        if torch.compiler.is_compiling():
            return
        owner = self._owner
        if id(module) in owner._modules:
            return
        if isinstance(getattr(module, "_orig_mod", None), nn.Module):  # torch.compile(module):
            for sub in module.modules():
                owner._modules.setdefault(id(sub), sub)
        if layer_graphs_enabled():
            check_not_nested([module])
        if isinstance(module, DistributedDataParallel) and owner.warmup_steps < DDP_MIN_WARMUP:
            raise ValueError(
                f"FullIterationGraph(warmup_steps={owner.warmup_steps}) around a "
                f"DistributedDataParallel model: PyTorch requires at least {DDP_MIN_WARMUP} "
                "DDP-enabled eager iterations before capture (CUDA notes, 'Usage with "
                f"DistributedDataParallel'). Pass warmup_steps={DDP_MIN_WARMUP} or more."
            )
        owner._modules[id(module)] = module


__all__ = ["DDP_MIN_WARMUP", "Watch", "check_not_nested", "driving_scaler"]
