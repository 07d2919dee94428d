"""Full-iteration graphs: one graph for the whole training step (forward, backward, optimizer).

Usage::

    def train_step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # no host sync: fine
        opt.step()
        return loss

    step = tgraph.FullIterationGraph(train_step)
    for batch in loader:
        loss = step(batch)          # calls 1..3 eager, call 4 captures (and steps), later replay
        sched.step()                # a changing learning rate reaches the graph (see below)

Life cycle, per batch *signature* (shapes, dtypes, devices and structure of the batch, keyed like
:func:`tgraph.signature.call_key`): the first ``warmup_steps`` calls run ``fn`` eagerly (on the
capture side stream on CUDA, as PyTorch's whole-network capture recipe requires); they are real
training steps and update the parameters. The next call copies the batch into *static* buffers,
captures one call of ``fn`` on them; that call's training step is the first replay on CUDA (a
CUDA capture executes nothing) and the capture itself on the emulated backend (which executes
``fn`` once): either way ``fn``'s effects happen exactly once per call.
Python in ``fn`` that asks ``torch.cuda.is_current_stream_capturing()`` (the emulated backend
answers as CUDA does) takes its capture branch in the graph. Transformers' mask code does: without
a KV cache it masks explicitly under a capture where eager passes SDPA ``is_causal=True``, and with
grouped-query attention the graph then differs from eager in the last bits (README, "Full-iteration
graphs"); call such a model with ``use_cache=True`` inside ``fn``.
Later calls copy the live batch into the static buffers and replay. A batch of another signature
gets its own warmups and graph (at most ``max_graphs``), never a replay of the wrong shapes.
So does another *mode* (:class:`tgraph.step.captured.StepMode`): ``model.eval()`` or a parameter
frozen (``requires_grad_(False)``) after capture warms up and captures again in that mode, and
switching back replays the first graph, as per-layer graphs key on the same flags. A step that
sets flags itself (``model.train()`` inside ``fn``) has its replays set them as ``fn`` leaves
them (they run no Python). The modules'
training flags are read only when a module of the step was written since (the module epoch of
:mod:`tgraph.baked`, moved by ``eval()`` and ``train()``); the parameters' ``requires_grad``,
which no epoch sees, at every call (one pass).

Ownership and aliasing:

* The static batch buffers belong to the graph; live batches are copied into them before each
  replay. A list of microbatches gets one static buffer per microbatch. A batch tensor ``fn``
  writes in place (seen at capture: its version moved) is copied back into the caller's tensor
  after each replay, as the eager step leaves it. The static buffers are separate tensors, so a
  written batch tensor whose memory overlaps another's (one a view of the other) is refused;
  disjoint views of one tensor (``x.chunk(2)``) are served. A write that moves no version
  counter (through ``x.data`` or ``x.set_``) is not seen, as for per-layer graphs.
* Returned outputs are fresh, detached clones of the graph's static outputs: safe to keep (a
  list of losses holds each step's value). The clone costs one small copy per output tensor.
* ``param.grad`` after a replay on CUDA is the gradient tensor the graph writes. With the
  optimizer outside ``fn``, zero gradients with ``set_to_none=True`` between calls (or inside
  ``fn``): a graph captured with ``.grad`` None overwrites gradients and refuses to run when one
  is left over; a graph captured with ``.grad`` present accumulates exactly as eager code.
* An LR scheduler must step, and ``group['lr']`` be assigned, outside ``fn``; either inside it
  is refused at capture.
* The objects ``fn`` reaches (a trainer's model, optimizer and loss module, closure variables,
  module globals, dict entries: :mod:`tgraph.step.reach`) are noted at capture; one replaced
  after it (``self.opt = Adam(...)``) makes the next call warn, run eagerly and capture the step
  again after warmup. Plain Python values ``fn`` reads there (numbers, strings) are baked in and
  not compared.

Optimizers (found automatically: every ``torch.optim.Optimizer`` whose ``step`` runs inside
``fn`` during the warmup calls):

* A graph bakes every Python number it reads. Where the optimizer can read a tensor learning
  rate without a host sync (``fused=True``: SGD, Adam, AdamW; ``capturable=True``: Adam, AdamW),
  the graph reads each param_group's float ``lr`` from a 0-dim float32 device tensor of its own,
  filled before each call where the float changed; the param_group keeps the float (schedulers
  compute in doubles, as eagerly). An ``lr`` that is a tensor at capture is read in place:
  update it in place; another tensor in its place captures the step again.
  A float ``lr`` that changes after capture (a plain SGD's) raises a ``ValueError`` naming the
  fix. The other numbers of a param_group (weight decay, betas, momentum) are host numbers of
  torch's fused and capturable kernels: a change (a weight-decay schedule) makes the next call
  warn once, run eagerly and capture the step again after warmup, with the new value. So does a
  change of a ``torch.amp.GradScaler``'s growth factor, backoff factor or growth interval (its
  setters, ``load_state_dict``), which ``scaler.update()`` passes to the device as host numbers:
  the scaler whose ``step`` runs inside ``fn`` is noted during the warmup calls.
* Accepted by what they are (tgraph/step/host_state.py): ``fused=True`` (Adam, AdamW, SGD;
  Adagrad on the CPU), ``capturable=True`` (CUDA), or no state on the host (plain SGD). An
  optimizer that keeps its step count on the host (Adagrad, Adadelta, RMSprop, Adam/AdamW
  without either flag, ...) is refused before the capture, naming the fix: a graph would
  advance that count once, at capture, and never again.

torch DDP inside ``fn`` works. PyTorch's CUDA-graph notes ("Usage with DistributedDataParallel")
require at least 11 DDP-enabled eager iterations before capture (the reducer rebuilds its buckets
after the first iteration and samples runtime statistics, with host syncs, during the first ten);
``warmup_steps`` below 11 raises when a ``DistributedDataParallel`` runs inside ``fn``. On CUDA,
also construct DDP under ``torch.cuda.stream(tgraph.capture_stream())`` and, on old PyTorch, set
``TORCH_NCCL_ASYNC_ERROR_HANDLING=0`` before ``init_process_group``.

Full-iteration graphs and per-layer graphs (:func:`tgraph.enable`) do not nest: a model with
enabled ``GraphableModule`` s inside ``fn`` raises; call ``tgraph.disable(model)`` first.

The capture follows the step-capture protocol shared with :class:`tgraph.OptimizerGraph`
(capture.py: optimizer checks, learning rates as tensors, the snapshot of what the capture
changes, restore on failure); hyper-parameters, the capture guards and non-finite skipping live
in hyperparams.py, guards.py and nonfinite.py.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from tgraph import rng
from tgraph.backend import GraphFactory, check_backend_name
from tgraph.baked import Baked, watch_module_writes
from tgraph.baked import _epoch as _module_epoch
from tgraph.errors import GraphFallbackWarning
from tgraph.layers.enable import layer_graphs_enabled
from tgraph.memory import CaptureReport, MemoryReport, tensor_bytes
from tgraph.signature import call_key, first_difference, split
from tgraph.step import capture as step_capture
from tgraph.step.capture import StepCapture
from tgraph.step.captured import CapturedStep, ParamHooks, Phase, StepMode
from tgraph.step.host_state import grad_scaler_settings
from tgraph.step.hyperparams import HyperParams
from tgraph.step.nonfinite import SkipNonfiniteStep
from tgraph.step.reach import Reach
from tgraph.step.step_grads import grad_modes, grads_weakly, sync_grads_in
from tgraph.step.watch import DDP_MIN_WARMUP, Watch, check_not_nested

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Entry:
    """One batch signature in one mode: its phase, its count of eager calls and, captured, its
    capture result (the mode is the capture's: :class:`tgraph.step.captured.StepMode`)."""

    key: tuple
    factory: GraphFactory
    phase: Phase = Phase.WARMUP
    eager_calls: int = 0
    cap: CapturedStep | None = None  # exactly in Phase.CAPTURED
    warm_mode: StepMode | None = None  # the mode of its last eager call (capture in it only)
    training_at: int = -1  # the module epoch when the modules' training flags were last found
    # as captured (tgraph.baked: eval() and train() write them through nn.Module.__setattr__)


class FullIterationGraph:
    """The whole training step ``fn(batch)`` as one graph (see the module docstring).

    Args:
        fn: the training step; takes a batch (a tensor or nested list/tuple/dict of tensors) and
            returns tensors (nested list/tuple/dict, or None). No host syncs (``.item()``,
            printing a tensor) inside it.
        warmup_steps: eager calls per batch signature before capture (>= 1; >= 11 with DDP).
        backend: ``"auto"``, ``"cuda"`` or ``"emulated"`` (resolved from the batch's device;
            ``TGRAPH_BACKEND`` overrides ``"auto"``).
        max_graphs: most graphs to capture (one per batch signature and mode), each counted
            from its first warmup call; a call that needs yet another raises.
        skip_nonfinite: skip the optimizer steps inside ``fn`` on the device, without a host
            sync, when ``fn``'s loss (its first tensor output) or the gradients at the
            optimizer's ``step()`` are not finite: parameters and optimizer state stay untouched
            (:class:`tgraph.step.nonfinite.SkipNonfiniteStep`). :attr:`skipped_steps` counts them.
            Default False, as :class:`tgraph.OptimizerGraph`: the graph then computes exactly
            what the eager ``fn`` computes, ``fn`` may return anything tensor-valued, and no
            snapshot of parameters and optimizer state is taken at each step.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``warmup_steps`` < 1, ``max_graphs`` < 1 or an unknown backend.
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        warmup_steps: int = 3,
        backend: str = "auto",
        *,
        max_graphs: int = 4,
        skip_nonfinite: bool = False,
    ) -> None:
        if not callable(fn):
            raise TypeError(
                f"FullIterationGraph needs a callable training step, got {type(fn).__name__}"
            )
        if warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be >= 1 (PyTorch requires eager warmup before capture), got {warmup_steps}"
            )
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        check_backend_name(backend)
        self._skip = SkipNonfiniteStep(fn) if skip_nonfinite else None
        self.fn = self._skip or fn
        self._step_fn = fn  # where the objects the step reaches are found (tgraph.step.reach)
        self.warmup_steps = warmup_steps
        self.backend = backend
        self.max_graphs = max_graphs
        # per batch signature, its entries: one per mode captured, the one last used first
        self._entries: dict[tuple, list[_Entry]] = {}
        self._optimizers: dict[int, torch.optim.Optimizer] = {}
        self._scalers: dict[int, torch.amp.GradScaler] = {}  # GradScalers stepping them
        self._modules: dict[int, nn.Module] = {}
        self._hparams: list[HyperParams] = []  # one per batch of optimizers seen at a capture
        self._recaptured: set[str] = set()  # changes after capture already warned about
        step_capture.register(self)

    @property
    def num_graphs(self) -> int:
        """Number of captured graphs (one per batch signature and mode)."""
        return sum(e.phase is Phase.CAPTURED for e in self._all_entries())

    @property
    def skipped_steps(self) -> int:
        """Steps skipped as non-finite (``skip_nonfinite=True``; reads a device counter)."""
        return 0 if self._skip is None else self._skip.guard.skipped_steps

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Optimizers whose ``step`` ran inside ``fn`` (found during the eager calls)."""
        return list(self._optimizers.values())

    def __call__(self, batch: Any) -> Any:
        """Run one training step on ``batch``: eagerly, by capture, or by replay.

        Returns:
            ``fn``'s outputs; after capture, detached clones of the graph's outputs (safe to keep).

        Raises:
            ValueError: a misconfigured optimizer, a hyper-parameter baked into the graph changed,
                per-layer graphs enabled inside ``fn``, DDP with too few warmup steps, or a batch
                tensor ``fn`` writes in place that shares memory with another batch tensor.
            RuntimeError: a batch signature or mode beyond ``max_graphs``.
            tgraph.CaptureError: capture failed (e.g. a host sync inside ``fn``); the call made no
                training step, and later calls of that signature run eagerly.
        """
        if layer_graphs_enabled():  # per-layer graphs exist somewhere: enabled inside fn?
            check_not_nested(self._modules.values(), recurse=False)
        tensors: list[torch.Tensor] = []
        key = call_key((batch,), {}, (False,), tensors)
        entries = self._entries.get(key)
        entry = entries[0] if entries else None
        if entry is not None and (entry.phase is not Phase.CAPTURED or not _in_mode(entry)):
            entry = self._entry_in_mode(key, tensors)  # model.eval(), a parameter frozen, ...
        if entry is not None and entry.phase is Phase.CAPTURED:
            why = entry.cap.change()
            if why is None:
                return self._replay(entry.cap, tensors)
            if why not in self._recaptured:
                self._recaptured.add(why)
                warnings.warn(
                    f"FullIterationGraph: {why}; the step runs eagerly and is captured again "
                    "after warmup",
                    GraphFallbackWarning,
                    stacklevel=2,
                )
            if entry.cap.reach is not None and entry.cap.reach.change() is not None:
                # a replaced model or optimizer: the warmup notes what the step uses now, and
                # the replaced ones are no longer checked, snapshotted or kept alive
                self._optimizers.clear()
                self._scalers.clear()
                self._modules.clear()
            self.reset()
            entry = None
        if entry is None:
            entry = self._new_entry(key, tensors)
        if (
            entry.phase is not Phase.WARMUP
            or entry.eager_calls < self.warmup_steps
            or _mode_moved(entry)
        ):
            return self._eager(entry, batch)
        return self._capture(entry, batch, tensors)

    def reset(self) -> None:
        """Drop every graph; calls warm up anew."""
        for e in self._all_entries():
            if e.cap is not None:
                e.cap.graph.reset()
        self._entries.clear()
        self._hparams = []

    # -- the three kinds of call ------------------------------------------------------------

    def _all_entries(self) -> Iterator[_Entry]:
        return (e for entries in self._entries.values() for e in entries)

    def _entry_in_mode(self, key: tuple, tensors: list[torch.Tensor]) -> _Entry:
        """The entry of batch signature ``key`` for the mode of now, moved first: one captured
        in it, else the one not captured (warming up, or eager after a failed capture), else a
        new one that warms up and captures in this mode (counted toward ``max_graphs`` from
        now: at the limit, the call raises). A step that sets its own mode (``model.train()``
        inside ``fn``) after an ``eval()`` outside thus gets a graph for the eval key too (its
        kernels are those of the mode ``fn`` sets, and its replays set that mode again:
        ``CapturedStep.end_mode``); a call without the ``eval()`` replays the first graph."""
        entries = self._entries[key]
        found = next((e for e in entries if e.phase is Phase.CAPTURED and _in_mode(e)), None)
        found = found or next((e for e in entries if e.phase is not Phase.CAPTURED), None)
        if found is None:
            return self._new_entry(key, tensors)
        entries.remove(found)
        entries.insert(0, found)
        return found

    def _new_entry(self, key: tuple, tensors: list[torch.Tensor]) -> _Entry:
        if not tensors:
            raise ValueError(
                "FullIterationGraph needs a batch with at least one tensor (its device picks the backend)"
            )
        held = sum(map(len, self._entries.values()))
        if held >= self.max_graphs:
            if key in self._entries:
                mode = self._entries[key][0].cap.mode
                why = f"this batch's graphs were captured in another mode: {mode.difference()}"
                fix = "Keep the modules' training flags and requires_grad as at capture"
            else:
                old = next(iter(self._entries))
                why = f"this batch matches none: {first_difference(old, key, 'batch')}"
                fix = "Pad batches to a fixed shape"
            raise RuntimeError(
                f"FullIterationGraph already holds {held} graph(s) "
                f"(captured or warming up; max_graphs={self.max_graphs}) and {why}. {fix}, or raise max_graphs (each "
                "batch signature and mode costs its own warmups and graph memory)."
            )
        entry = _Entry(key, GraphFactory.for_device(self.backend, tensors[0].device))
        self._entries.setdefault(key, []).insert(0, entry)
        return entry

    def _eager(self, entry: _Entry, batch: Any) -> Any:
        if entry.phase is Phase.FAILED:
            entry.phase = Phase.EAGER
            warnings.warn(
                "FullIterationGraph: capture failed for this batch signature; running "
                "the step eagerly from now on",
                GraphFallbackWarning,
                stacklevel=3,
            )
        # The last warmup call before the capture runs unwatched: the capture runs without the
        # watch's global hook, and a torch.compile'd fn must compile for that state in the
        # warmup, not recompile inside the capture (dynamo guards on global module hooks).
        last = 0 < entry.eager_calls >= self.warmup_steps - 1 and entry.phase is Phase.WARMUP
        if entry.phase is Phase.WARMUP:
            entry.warm_mode = StepMode.now(tuple(self._modules.values()), tuple(self._params()))
        with contextlib.nullcontext() if last else self._watch(), entry.factory.side_stream():
            out = self.fn(batch)
        entry.eager_calls += 1
        return out

    def _capture(self, entry: _Entry, batch: Any, tensors: list[torch.Tensor]) -> Any:
        """The step-capture protocol (tgraph.step.capture) around one call of ``fn`` on static
        copies of the batch; this call's training step is the capture (emulated) or the first
        replay (CUDA)."""
        f = entry.factory
        step = StepCapture(
            f,
            "the training step of FullIterationGraph",
            self.optimizers,
            elsewhere=_elsewhere(f.device),
            held=self._hparams,
        )
        static = [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]
        static_batch = split(batch)[1].fill(static)  # the graph's own copies of the batch
        for g in rng.graph_generators(f.device):
            step.graph.register_generator_state(g)
        params = self._params()
        modules = tuple(self._modules.values())
        mode = StepMode.now(modules, tuple(params))
        watch_module_writes()  # eval() and train() move the module epoch (_in_mode reads it)
        step.save(params, self._buffers(), drops_grads=True)
        grads_before = grads_weakly(params)
        versions = [s._version for s in static]
        try:
            out = step.capture(lambda: self.fn(static_batch), modules=modules)
            # the flags fn left (model.train() inside it): replays, which run no Python, set them
            end_mode = StepMode.now(modules, tuple(params))
            _refuse_non_tensors(out)
            # the batch tensors fn writes in place (x.mul_(0.5)): copied back after each replay
            mutated = tuple(i for i, s in enumerate(static) if s._version != versions[i])
            _refuse_shared_writes(tensors, mutated)
            _refuse_batch_grads(static)
        except BaseException as exc:
            entry.phase = Phase.FAILED
            step.fail(exc)  # undone; a CaptureError naming the cause (a ValueError as is)
        self._hparams = step.hparams
        outputs, template = split(out)
        entry.phase = Phase.CAPTURED
        entry.cap = cap = step.result(
            # a GradScaler's growth and backoff: host numbers of the update the graph baked
            settings=[grad_scaler_settings(s) for s in self._scalers.values()],
            new_scalers=True,  # and a scaler made after capture, which fn may reach instead
            static_inputs=tuple(static),
            outputs=tuple(outputs),
            template=template,
            grad_modes=tuple(grad_modes(params, grads_before)),
            # what the step's modules baked in (the modules that ran in it: tgraph.baked; their
            # writes move the module epoch from now on)
            baked=Baked.of([(type(m).__name__, m) for m in modules], []),
            mode=mode,
            end_mode=end_mode if end_mode.differs_from(mode) else None,
            mutated_inputs=mutated,
            # the objects fn reaches, as fn left them: one replaced later is a change
            reach=Reach(self._step_fn),
            # the parameters' gradient hooks its backward ran: one added or removed is a change
            param_hooks=ParamHooks(tuple(params)),
        )
        logger.info(
            "FullIterationGraph: captured on %s in %.3fs, %.1f MiB",
            f.backend,
            cap.seconds,
            cap.pool_bytes / 2**20,
        )
        if f.executes_capture:
            # The emulated capture really executed fn once: that was this call's step (running
            # it again would apply every side effect twice: EMA weights, counters, ...).
            cap.steps.run_post_hooks()  # detached during the capture (tgraph.step.step_hooks)
            _copy_back(cap, tensors)
            return self._outputs(cap)
        return self._replay(cap, tensors, first=True)

    def _outputs(self, cap: CapturedStep) -> Any:
        """What a call returns: fresh detached clones of the graph's outputs, safe to keep past
        the next replay (which overwrites the graph's own)."""
        return cap.template.fill([t.detach().clone() for t in cap.outputs])

    def _replay(self, cap: CapturedStep, tensors: list[torch.Tensor], first: bool = False) -> Any:
        if cap.mutated_inputs:
            _refuse_shared_writes(tensors, cap.mutated_inputs)
        for hp in cap.hparams:
            hp.refresh()
        with torch.no_grad():
            for s, t in zip(cap.static_inputs, tensors):
                if s.data_ptr() != t.data_ptr():
                    s.copy_(t)
            if not first:
                sync_grads_in(cap.grad_modes)
        cap.graph.replay()
        if cap.end_mode is not None:  # fn set the modules' mode itself: as its eager call leaves it
            cap.end_mode.apply()
        _copy_back(cap, tensors)
        for p, grad, _ in cap.grad_modes:  # the gradients the graph wrote are the params' .grad
            p.grad = grad
        cap.steps.run_post_hooks()  # the optimizers' step post-hooks, as the eager step runs them
        return self._outputs(cap)

    # -- reports -------------------------------------------------------------------------------

    def capture_report(self) -> CaptureReport:
        """What the captures made, in the shape of :func:`tgraph.create_graphs`'s report
        (``entry="FullIterationGraph"``; one graph per batch signature and mode)."""
        captured = [e.cap for e in self._all_entries() if e.cap is not None]
        return CaptureReport(
            graphs=len(captured),
            runners=0,
            segments=0,
            seconds=sum(r.seconds for r in captured),
            pool_bytes=sum(r.pool_bytes for r in captured),
            backends=sorted({r.factory.backend for r in captured}),
            eager_modules=[],
            memory=self.memory_report(),
            entry="FullIterationGraph",
        )

    def memory_report(self) -> MemoryReport:
        """The graphs' buffers by kind (:class:`tgraph.MemoryReport`): the static batches
        (``static_inputs``), the outputs (``static_outputs``) and the gradients the graphs
        write (``param_grads``)."""
        report = MemoryReport()
        for e in self._all_entries():
            cap = e.cap
            if cap is None:
                continue
            report.units += 1
            report.static_inputs += tensor_bytes(cap.static_inputs)
            report.static_outputs += tensor_bytes(cap.outputs)
            report.param_grads += tensor_bytes(g for _, g, _ in cap.grad_modes)
        return report

    def _params(self) -> list[torch.Tensor]:
        params = {id(p): p for o in self.optimizers for g in o.param_groups for p in g["params"]}
        params.update(
            (id(p), p) for m in self._modules.values() for p in m.parameters(recurse=False)
        )
        return list(params.values())

    def _buffers(self) -> list[torch.Tensor]:
        return list(
            {id(b): b for m in self._modules.values() for b in nn.Module.buffers(m)}.values()
        )

    def _watch(self) -> Watch:
        return Watch(self)


def _in_mode(entry: _Entry) -> bool:
    """Whether the modules' training flags and the parameters' requires_grad are those
    ``entry`` was captured in. The training flags are read only when the module epoch moved
    since they were last found so (every module of the step is counted: ``Baked.of``);
    ``requires_grad_`` moves no epoch, so those flags are read at every call."""
    mode = entry.cap.mode
    if not mode.same_grads():
        return False
    epoch = _module_epoch[0]
    if entry.training_at != epoch:
        if not mode.same_training():
            return False
        entry.training_at = epoch
    return True


def _mode_moved(entry: _Entry) -> bool:
    """Whether a warming entry is called in another mode than its last eager call (a layer
    unfrozen, ``eval()``): it warms up once more in this mode before the capture, so that what
    the step creates in the new mode (an unfrozen parameter's optimizer state, its ``.grad``)
    exists before the capture instead of being created inside the graph at every replay."""
    mode = entry.warm_mode
    return mode is not None and StepMode.now(mode.modules, mode.params).differs_from(mode)


def _refuse_batch_grads(static: list[torch.Tensor]) -> None:
    """Refuse a step whose backward computed a gradient for a batch tensor that requires grad
    (an adversarial perturbation, an input to explain; ``x + delta`` too): the graph's static
    copy, a leaf, receives it in its ``.grad``, and no replay can hand it to the tensor the
    caller passes or to the graph that made it (eager's ``delta.grad`` would stay as the warmup
    left it, silently).

    Raises:
        ValueError: naming the batch tensor and the fix.
    """
    for i, s in enumerate(static):
        if s.grad is not None:
            raise ValueError(
                f"FullIterationGraph: the step's backward wrote .grad of batch tensor {i} (it "
                "requires grad); a replay cannot hand .grad to the tensor passed at the next "
                "call. Return the gradient from the step instead (g = torch.autograd.grad(loss, "
                "x, retain_graph=True)[0]), or make the tensor a parameter of a module the step "
                "trains."
            )


def _refuse_shared_writes(tensors: list[torch.Tensor], written: tuple[int, ...]) -> None:
    """Refuse a batch where a tensor the step writes in place shares memory with another batch
    tensor (one a view of the other): the graph's static copies of the batch are separate
    tensors, so inside the graph the write would not reach the other one as it does eagerly.
    Views of disjoint parts of one storage (``x.chunk(2)``) are served: only byte ranges that
    intersect are refused (a range spans a strided view's gaps: conservative there).

    Raises:
        ValueError: naming both tensors and the fix.
    """
    if not written:
        return
    storages = [t.untyped_storage().data_ptr() if t.numel() else None for t in tensors]
    for i in written:
        for j, s in enumerate(storages):
            if j != i and s is not None and s == storages[i] and _overlap(tensors[i], tensors[j]):
                raise ValueError(
                    f"FullIterationGraph: the step writes batch tensor {i} in place, and it "
                    f"shares memory with batch tensor {j} (a view of one another); the graph "
                    "keeps a separate static copy of each, so the write would not reach the "
                    "other as it does eagerly. Pass separate tensors (clone one of them)."
                )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges of ``a`` and ``b`` (non-empty, of one storage) intersect."""
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < b1 and b0 < a1


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a non-empty tensor can address: [first, last + 1)."""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * t.element_size(), (last + 1) * t.element_size()


def _copy_back(cap: CapturedStep, tensors: list[torch.Tensor]) -> None:
    """The step's in-place writes to its batch, from the static copies to the caller's
    tensors, as an eager step leaves them."""
    if cap.mutated_inputs:
        with torch.no_grad():
            for i in cap.mutated_inputs:
                static = cap.static_inputs[i]
                if tensors[i].data_ptr() != static.data_ptr():
                    tensors[i].copy_(static)


def _elsewhere(device: torch.device) -> str:
    return (
        f" but the batch is on {device}; move the batch to the parameters' device before "
        "calling the step (a graph reads static device buffers only)"
    )


def _refuse_non_tensors(out: Any) -> None:
    bad = [
        type(x).__name__
        for x in tree_leaves(out)
        if x is not None and not isinstance(x, torch.Tensor)
    ]
    if bad:
        raise ValueError(
            f"fn returned non-tensor values ({', '.join(bad)}); a graph replays kernels, "
            "not Python, so they would keep their capture-time value. Return tensors only."
        )


__all__ = ["DDP_MIN_WARMUP", "FullIterationGraph"]
