"""Optimizer step hooks under whole-step graphs: post-hooks run after each replay, as in eager.

torch runs an optimizer's step hooks (``register_step_pre_hook``, ``register_step_post_hook``
and the global ``torch.optim.optimizer.register_optimizer_step_pre_hook`` /
``register_optimizer_step_post_hook``) in Python around every ``Optimizer.step``
(``Optimizer.profile_hook_step``). A graph runs no Python: a hook would run only at the warmup
and capture calls (a counter, a scheduler step stop), and the tensor work it did during the
capture (an EMA of the weights) would be baked into the graph. So:

* the capture runs with the post-hooks detached (:func:`recorded`), so no hook is baked in, and
  notes each optimizer step it makes with its arguments, ``(optimizer, args, kwargs)``;
* after each replay (and after a capture that executed the step), :meth:`OptimizerSteps.run_post_hooks`
  runs the post-hooks registered now for each of those steps, in torch's order (the
  optimizer's, then the global ones), with those arguments: a hook's Python and its tensor
  work happen once per step, on the parameters the step just wrote, as in eager;
* a pre-hook runs in eager code after the backward, right before the step: a replay of the
  whole step (or of clipping and the step) has no such point, so a pre-hook is refused at
  capture, naming it (:func:`refuse_pre_hooks`), and one registered after the capture makes
  the next call capture again (:meth:`OptimizerSteps.change`), which refuses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from itertools import chain
from typing import Any

import torch
import torch.optim.optimizer as optim_module

Step = tuple[torch.optim.Optimizer, tuple, dict]
_NONE: dict = {}


def _table(opt: torch.optim.Optimizer, kind: str) -> dict:
    """``opt``'s pre- or post-hook table (an optimizer that skipped ``Optimizer.__init__`` has
    none, and runs no hooks)."""
    return getattr(opt, f"_optimizer_step_{kind}_hooks", _NONE)


def _name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def pre_hook_refusal(optimizers: Sequence[torch.optim.Optimizer], what: str) -> str | None:
    """Why ``what`` cannot be graphed for a step pre-hook of ``optimizers`` (or a global one),
    or None when they have none."""
    for opt in optimizers:
        hooks = chain(
            optim_module._global_optimizer_pre_hooks.values(),
            _table(opt, "pre").values(),
        )
        hook = next(hooks, None)
        if hook is not None:
            return (
                f"{type(opt).__name__} has a step pre-hook ({_name(hook)}), which eager code runs "
                f"after the backward, right before the step; {what} is replayed whole and runs no "
                "Python, so it cannot run the hook there. Do the hook's work before calling the "
                "step, or register it with register_step_post_hook: post-hooks run after each "
                "replay, as in eager"
            )
    return None


def refuse_pre_hooks(optimizers: Sequence[torch.optim.Optimizer], what: str) -> None:
    """At capture: refuse a step pre-hook (module docstring).

    Raises:
        ValueError: naming the optimizer, the hook and the fix.
    """
    why = pre_hook_refusal(optimizers, what)
    if why is not None:
        raise ValueError(why)


@contextlib.contextmanager
def recorded(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[list[Step]]:
    """Inside: the step post-hooks of ``optimizers`` and the global ones are detached (put
    back on exit, in their order), and each step of one of ``optimizers`` is appended to the
    list yielded as ``(optimizer, args, kwargs)``."""
    steps: list[Step] = []
    hooked = [o for o in optimizers if _table(o, "post") is not _NONE]
    tables = [_table(o, "post") for o in hooked]
    tables.append(optim_module._global_optimizer_post_hooks)
    saved = [dict(t) for t in tables]
    for t in tables:
        t.clear()
    handles = [o.register_step_post_hook(lambda *step: steps.append(step)) for o in hooked]
    try:
        yield steps
    finally:
        for h in handles:
            h.remove()
        for t, hooks in zip(tables, saved, strict=True):
            t.clear()
            t.update(hooks)


class OptimizerSteps:
    """The optimizer steps a captured whole step makes (module docstring), frozen at capture.

    Args:
        steps: ``(optimizer, args, kwargs)`` of each step, in order (:func:`recorded`).
        optimizers: the optimizers of the captured step (whose pre-hooks are refused).
        what: names the captured step in messages.
    """

    __slots__ = ("steps", "optimizers", "what")

    def __init__(
        self, steps: Sequence[Step], optimizers: Sequence[torch.optim.Optimizer], what: str
    ) -> None:
        self.steps = tuple(steps)
        self.optimizers = tuple(optimizers)
        self.what = what

    def change(self) -> str | None:
        """A step pre-hook registered since the capture (the next capture refuses it), or None."""
        if not optim_module._global_optimizer_pre_hooks and not any(
            _table(o, "pre") for o in self.optimizers
        ):
            return None
        return pre_hook_refusal(self.optimizers, self.what)

    def run_post_hooks(self) -> None:
        """After a replay: each step's post-hooks, as ``Optimizer.step`` runs them."""
        global_hooks = optim_module._global_optimizer_post_hooks
        for opt, args, kwargs in self.steps:
            hooks = _table(opt, "post")
            if hooks or global_hooks:
                for hook in (*hooks.values(), *global_hooks.values()):
                    hook(opt, args, kwargs)


__all__ = ["OptimizerSteps", "pre_hook_refusal", "recorded", "refuse_pre_hooks"]
