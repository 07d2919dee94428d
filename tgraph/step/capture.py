"""The whole-step capture protocol, shared by :class:`tgraph.FullIterationGraph` and
:class:`tgraph.OptimizerGraph`.

A whole-step capture (a training step, or the optimizer step alone) does the same five things
in the same order, whichever entry asks:

1. refuse optimizers a graph cannot step: parameters elsewhere, state on the host
   (:func:`tgraph.step.host_state.check_graphable_optimizer`);
2. note how the learning rates of optimizers not covered yet reach the graph: a float through
   a device tensor of tgraph's own, a tensor in place
   (:class:`tgraph.step.hyperparams.HyperParams`);
3. snapshot what the capture may change (:class:`tgraph.snapshot.Snapshot`: values too when the
   backend executes the captured function, references only on CUDA);
4. capture on the backend's side stream (fused param_groups say ``capturable=True`` meanwhile,
   :func:`tgraph.step.host_state.fused_groups_capturable`, and hold the learning-rate tensors
   in place of their floats, :meth:`tgraph.step.hyperparams.HyperParams.lent`), refusing a
   learning-rate tensor written or replaced inside the step (a scheduler stepping inside it,
   ``group['lr'] = x``), host state it wrote (:class:`tgraph.step.host_state.HostWrites`) and
   optimizer step pre-hooks, with the step post-hooks detached and the optimizer steps noted,
   to run the hooks after each replay (:mod:`tgraph.step.step_hooks`);
5. on failure, undo 3 and drop 2 and raise a :class:`tgraph.CaptureError` that names the likely cause
   (a ``ValueError``, a misconfiguration the message already explains, passes unchanged).

:class:`StepCapture` holds one such capture. Usage::

    step = StepCapture(factory, "the training step of X", optimizers, elsewhere=..., held=hps)
    step.save(params, buffers)
    try:
        out = step.capture(fn)
    except BaseException as exc:
        step.fail(exc)                                      # undone, raised as CaptureError
    cap = step.result(outputs=..., static_inputs=...)      # what the replays read, frozen
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

import torch

from tgraph.backend import GraphFactory, stale_stream_override
from tgraph.guards import (
    LR_REPLACED_ERROR,
    CaptureError,
    RefuseLrWrites,
    check_lr_unwritten,
    explain_capture_failure,
)
from tgraph.snapshot import Snapshot
from tgraph.step.captured import CapturedStep
from tgraph.step.host_state import (
    BakedNumbers,
    HostSettings,
    HostWrites,
    check_graphable_optimizer,
    fused_groups_capturable,
)
from tgraph.step.hyperparams import BakedLayout, HyperParams
from tgraph.step.step_hooks import OptimizerSteps, recorded, refuse_pre_hooks


def check_optimizers(
    optimizers: Iterable[torch.optim.Optimizer], device: torch.device, elsewhere: str
) -> None:
    """Step 1: refuse an optimizer a graph on ``device`` cannot step (``elsewhere`` ends the
    message for parameters on another device with the fix).

    Raises:
        ValueError: naming the param_group and the fix.
    """
    for opt in optimizers:
        check_graphable_optimizer(opt, device, elsewhere)


class StepCapture:
    """One whole-step capture (module docstring): steps 1 and 2 at construction.

    Args:
        factory: the graphs' factory (its backend decides what the snapshot keeps).
        what: names the captured step in error messages (``"the optimizer step of ..."``).
        optimizers: the optimizers the step runs.
        elsewhere: the end of the message for an optimizer with parameters on another device.
        held: hyper-parameters prepared by earlier captures of the same owner; only the
            param_groups they do not cover get new ones (:attr:`fresh`).

    Raises:
        ValueError: an optimizer a graph cannot step.
    """

    def __init__(
        self,
        factory: GraphFactory,
        what: str,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        elsewhere: str,
        held: Sequence[HyperParams] = (),
    ) -> None:
        self.factory = factory
        self.what = what
        self.optimizers = list(optimizers)
        check_optimizers(self.optimizers, factory.device, elsewhere)
        new = [o for o in self.optimizers if not all(_covered(g, held) for g in o.param_groups)]
        self.fresh: HyperParams | None = HyperParams(new) if new else None
        if self.fresh is not None:
            self.fresh.prepare()
        self.hparams: list[HyperParams] = [*held, *([self.fresh] if self.fresh else [])]
        """The hyper-parameters the captured graph reads: ``held`` plus :attr:`fresh`."""
        self.lr_tensors = [t for hp in self.hparams for t in hp.lr_tensors()]
        self.graph = factory.new_graph()
        self.snapshot: Snapshot | None = None
        self.seconds = 0.0
        """Wall time of the capture (after synchronizing the device)."""
        self.pool_bytes = 0
        """Device memory the capture allocated (0 on the emulated backend)."""
        self.steps: OptimizerSteps | None = None
        """The optimizer steps the capture made (their post-hooks run after each replay)."""

    def save(
        self,
        params: Iterable[torch.Tensor],
        buffers: Iterable[torch.Tensor],
        *,
        drops_grads: bool = False,
    ) -> None:
        """Step 3: snapshot ``params`` (``.grad``, ``main_grad``), ``buffers`` and the
        optimizers' state, with their values when the backend executes the captured step.

        ``drops_grads``: the step may drop ``.grad`` (``zero_grad(set_to_none=True)`` inside
        it); on CUDA the snapshot then holds ``.grad`` weakly, so a dropped gradient is freed
        during the capture instead of adding to its peak (:class:`tgraph.snapshot.Snapshot`).
        """
        runs = self.factory.executes_capture
        self.snapshot = Snapshot(
            params,
            buffers,
            self.factory.device,
            optimizers=self.optimizers,
            params_values=runs,
            state_values=runs,
            weak_grads=drops_grads and not runs,
        )

    def capture(
        self,
        fn: Callable[[], Any],
        *,
        refuse_lr_writes: bool = False,
        modules: Iterable[torch.nn.Module] = (),
    ) -> Any:
        """Step 4: capture ``fn`` into :attr:`graph` on the backend's side stream; returns
        its output (the graph's static outputs).

        Host state of the optimizers (or a CPU tensor of ``modules``, on CUDA) written inside
        ``fn`` raises :class:`tgraph.CaptureError`
        (:class:`tgraph.step.host_state.HostWrites`). So does a learning-rate tensor written
        inside ``fn``: after the capture, from the tensors' version counters (invisible to
        ``torch.compile``), or, with ``refuse_lr_writes``, at the write itself (a torch
        function mode: the error's traceback points at the write). So does a learning-rate
        tensor replaced in its param_group inside ``fn`` (``group['lr'] = 0.01``: the graph
        bakes that number), found after the capture. An optimizer step pre-hook
        raises ``ValueError``; post-hooks are detached meanwhile (:mod:`tgraph.step.step_hooks`).
        """
        refuse_pre_hooks(self.optimizers, self.what)
        with contextlib.ExitStack() as lent:
            for hp in self.hparams:  # the param_groups hold the learning-rate tensors meanwhile
                lent.enter_context(hp.lent())
            return self._capture(fn, refuse_lr_writes, modules)

    def _capture(
        self, fn: Callable[[], Any], refuse_lr_writes: bool, modules: Iterable[torch.nn.Module]
    ) -> Any:
        f = self.factory
        f.synchronize()
        before, start = f.memory_allocated(), time.perf_counter()
        versions = [t._version for t in self.lr_tensors]
        host = HostWrites(self.optimizers, f.device, modules)
        guard = RefuseLrWrites(self.lr_tensors) if refuse_lr_writes else contextlib.nullcontext()
        with f.side_stream(), stale_stream_override(), guard, recorded(self.optimizers) as steps:
            with fused_groups_capturable(self.optimizers):
                out = self.graph.capture(fn)
        self.steps = OptimizerSteps(steps, self.optimizers, self.what)
        check_lr_unwritten(self.lr_tensors, versions)
        for hp in self.hparams:
            where = hp.replaced()
            if where is not None:
                raise CaptureError(LR_REPLACED_ERROR.format(where=where))
        host.check()
        f.synchronize()
        self.seconds = time.perf_counter() - start
        self.pool_bytes = f.memory_allocated() - before
        return out

    def result(
        self, *, settings: Sequence[HostSettings] = (), new_scalers: bool = False, **parts: Any
    ) -> CapturedStep:
        """After a successful :meth:`capture`: the step's capture result, the frozen
        :class:`tgraph.step.captured.CapturedStep` a replay reads, with the graph, its
        hyper-parameters, what the optimizers baked in (their layout and Python numbers, taken
        now, with the entry's ``settings``: other objects' numbers the step read on the host;
        ``new_scalers``: a GradScaler made after capture counts as a change)
        and the capture's cost; ``parts`` are
        the entry's own fields (static batch, outputs, gradients, ``baked``)."""
        return CapturedStep(
            graph=self.graph,
            factory=self.factory,
            hparams=tuple(self.hparams),
            layout=BakedLayout(self.optimizers),
            numbers=BakedNumbers(self.optimizers, settings, new_scalers),
            seconds=self.seconds,
            pool_bytes=self.pool_bytes,
            steps=self.steps,
            **parts,
        )

    def undo(self) -> None:
        """Put back what :meth:`save` saved and drop the hyper-parameters this capture
        prepared (the graph itself is the caller's to reset)."""
        self.factory.synchronize()
        if self.snapshot is not None:
            self.snapshot.restore()
        self.hparams = [hp for hp in self.hparams if hp is not self.fresh]

    def fail(self, exc: BaseException) -> NoReturn:
        """Step 5, for ``exc`` raised by :meth:`capture` (or by a check of its output): undo
        the capture (:meth:`undo`) and raise: a ``ValueError`` as it is, anything else as a
        :class:`tgraph.CaptureError` naming the likely cause (its ``__cause__`` is ``exc``)."""
        self.undo()
        if isinstance(exc, ValueError):
            raise exc
        raise explain_capture_failure(self.what, exc) from exc


def _covered(group: dict, held: Sequence[HyperParams]) -> bool:
    return any(hp.covers(group) for hp in held)


# -- every whole-step graph alive, for tgraph.reset() ---------------------------------------------

_owners: weakref.WeakSet = weakref.WeakSet()


def register(owner: Any) -> None:
    """Note a whole-step entry (an object with ``reset()``) so that :func:`reset_all` reaches
    it; held weakly (an entry nobody references is dropped with its graphs)."""
    _owners.add(owner)


def reset_all() -> None:
    """``reset()`` every whole-step entry alive: :class:`tgraph.FullIterationGraph` and
    :class:`tgraph.OptimizerGraph` (their graphs dropped)."""
    for owner in list(_owners):
        owner.reset()


__all__ = ["StepCapture", "check_optimizers", "register", "reset_all"]
