"""The optimizer step as one graph, beside per-layer graphs, and skipping non-finite steps on the
device (no host sync).

Usage, next to :func:`tgraph.enable`::

    tgraph.enable(model)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    opt_graph = tgraph.OptimizerGraph(opt, clip_grad_norm=1.0, skip_nonfinite=True)
    for step, (x, y) in enumerate(loader):
        _, loss = model(x, y)
        loss.backward()
        opt_graph.step(loss)        # clip, skip if loss or grad norm is not finite, step, zero .grad
        sched.step()                # reaches the graph through a device tensor (tgraph.step.hyperparams)
        if step == 0:
            tgraph.create_graphs()
        if step % 100 == 0:
            print(opt_graph.skipped_steps)   # the only host read, when asked

Skipping without a host sync (:class:`SkipNonfinite`): a 0/1 device flag says whether the loss
and the gradient norm are finite. For torch's fused Adam/AdamW/SGD the flag goes into the
kernels' own ``found_inf`` input (as ``torch.amp.GradScaler`` drives them): a skipped step leaves
parameters and moments untouched and Adam's step count comes back exactly; nothing is copied.
Other optimizers (e.g. megatron's capturable foreach AdamW): before the step, the parameters and
every state tensor are copied into snapshot buffers; after it, each becomes
``ok * new + (1 - ok) * old`` computed on its *bits* (an integer view), bitwise the new or the old
value (one copy and three integer passes). A first step that created state and is skipped gets
that state deleted (one host read, eager warmup only). A device counter adds ``1 - ok`` at every
step; :attr:`SkipNonfinite.skipped_steps` reads it (one sync).

Gradients (tgraph/step/grad_buffers.py): a CUDA graph reads fixed addresses, while autograd
hands over new ``.grad`` tensors. Gradients that per-layer graphs hand over are read where those
graphs leave them, with no copy and no buffer of the graph's own; for every other gradient the
graph owns one flat buffer, and before each replay the ``.grad`` tensors not already there are
copied into it with one multi-tensor copy. With ``zero_grad=True`` (default) ``.grad`` is set to
None after every step, as ``optimizer.zero_grad()`` does, so the next backward's AccumulateGrad
adopts autograd's tensors without an add kernel per parameter. Every parameter that had a gradient at capture is stepped at
every replay: a ``.grad`` that is None where the capture had one raises, and so does one present
where the capture had none (call :meth:`OptimizerGraph.reset`). Capture happens at the first step
after ``warmup_steps`` eager ones; a captured step that would create optimizer state is undone and
run eagerly, and the next step is captured.

Skipping non-finite steps lives in tgraph/step/nonfinite.py; the capture protocol (optimizer checks,
learning rates as tensors, snapshot, restore on failure) is tgraph/step/capture.py's, shared with
:class:`tgraph.FullIterationGraph`.

Extension points: a subclass that steps another kind of optimizer (megatron-core's, in
:mod:`tgraph.integrations.megatron_optimizer`) overrides the public hooks of
:class:`OptimizerGraph` (listed in its docstring; their defaults step a torch optimizer and own
``.grad`` buffers), and nothing else.
"""

from __future__ import annotations

import logging
import warnings

import torch

from tgraph.backend import GraphFactory, check_backend_name
from tgraph.guards import CaptureError
from tgraph.memory import CaptureReport, MemoryReport, tensor_bytes
from tgraph.step import capture as step_capture
from tgraph.step.capture import StepCapture
from tgraph.step.captured import CapturedStep, Phase
from tgraph.step.grad_buffers import GradBuffers
from tgraph.step.host_state import HostSettings
from tgraph.step.nonfinite import SkipNonfinite, finite, state_layout, total_norm

logger = logging.getLogger(__name__)


# -- the optimizer-step graph ------------------------------------------------------------------


_ELSEWHERE = ", but the graph runs on {device}: one OptimizerGraph per device"
_CLIPPING = ("clip_grad_norm", "norm_type")


class OptimizerGraph:
    """``optimizer.step()`` with clipping, non-finite skipping and gradient zeroing as one graph.

    Args:
        optimizer: a torch optimizer without state on the host: ``fused=True`` (Adam, AdamW,
            SGD; Adagrad on the CPU), ``capturable=True`` (CUDA) or none (plain SGD); one that
            keeps its step count on the host is refused, naming the fix
            (:mod:`tgraph.step.host_state`). Its float learning rates reach the graph through
            device tensors (fused or capturable), so LR schedulers keep working
            (:class:`tgraph.step.hyperparams.HyperParams`).
        clip_grad_norm: clip the gradients to this total norm first, exactly as
            ``torch.nn.utils.clip_grad_norm_(params, clip_grad_norm, norm_type)`` (on the device).
            The attribute may be set later (None: no clipping); the graph bakes it, so a change
            after capture captures the step again after warmup (logged).
        norm_type: the norm of clipping and of the finiteness check (the same after capture).
        skip_nonfinite: skip the step (parameters and state untouched, Adam's step count
            included) when the gradient norm, or the loss passed to :meth:`step`, is not finite.
            Default False, as :class:`tgraph.FullIterationGraph`: the graph then steps exactly
            as the eager ``optimizer.step()`` it replaces, and costs nothing extra (skipping an
            optimizer that is not fused snapshots every parameter and state tensor at each
            step).
        zero_grad: set every ``.grad`` to None at the end of every step, as
            ``optimizer.zero_grad()`` does (see the module docstring on gradients). With False
            the step leaves ``.grad`` alone and you zero it yourself.
        warmup_steps: eager steps before capture (more if a step created optimizer state).
        backend: ``"auto"``, ``"cuda"`` or ``"emulated"`` (from the parameters' device).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: a bad argument value.

    Extension points, for a subclass that steps another kind of optimizer (the defaults step
    ``optimizer`` and own ``.grad`` buffers; :class:`tgraph.integrations.megatron_optimizer.
    MegatronOptimizerGraph` overrides them for megatron-core's optimizer):

    * :attr:`optimizers`: the torch optimizers the step runs (their learning rates reach the
      graph, their state is snapshotted and checked);
    * :meth:`params`: the parameters whose gradients the step reads;
    * :meth:`protected_tensors`: tensors besides those a skipped step restores;
    * :meth:`norm_and_clip`: the gradient norm (and clipping) before the step;
    * :meth:`inner_step`: the step itself;
    * :meth:`bind_grads`: at capture, the gradient buffers the graph reads;
    * :meth:`refresh_grads`: before each replay, bring the step's gradients into them.

    Each runs inside the captured step or around it as its docstring says, reads the public
    attributes it needs (``optimizer``, ``clip_grad_norm``, ``norm_type``, ``guard``,
    :attr:`bound_grads`), and none may sync with the host.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip_grad_norm: float | None = None,
        norm_type: float = 2.0,
        skip_nonfinite: bool = False,
        zero_grad: bool = True,
        warmup_steps: int = 1,
        backend: str = "auto",
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"OptimizerGraph needs a torch.optim.Optimizer, got {type(optimizer)}")
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
        if warmup_steps < 1:
            raise ValueError(
                f"warmup_steps must be >= 1 (optimizer state is created lazily), got {warmup_steps}"
            )
        check_backend_name(backend)
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        self.norm_type = float(norm_type)
        self.guard = SkipNonfinite() if skip_nonfinite else None
        self.zero_grad = zero_grad
        self.warmup_steps = warmup_steps
        self.backend = backend
        self._reset_state()
        step_capture.register(self)

    def _reset_state(self) -> None:
        self._phase = Phase.WARMUP
        self._cap: CapturedStep | None = None  # exactly in Phase.CAPTURED
        self._factory: GraphFactory | None = None  # from the parameters' device, at the first step
        self._eager_calls = 0
        self._stepped: set[int] = set()  # parameters that had a gradient at an eager step
        self._buffers: GradBuffers | None = None  # the gradient buffers bound at capture
        self._with_loss: bool | None = None  # whether the first step was given a loss
        self._static_loss: torch.Tensor | None = None  # the loss the graph reads
        self._norm: torch.Tensor | None = None  # the gradient norm the graph writes

    def _clear_grads(self) -> None:
        """After a step (eager, captured or replayed): ``.grad = None``, as
        ``optimizer.zero_grad()``; the next backward hands autograd's tensors over unchanged."""
        if self.zero_grad:
            for p in self._cap.params if self._cap is not None else self.params():
                p.grad = None

    # -- the hooks: a subclass's extension surface (class docstring) -----------------------

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers the step runs (their learning rates reach the graph)."""
        return [self.optimizer]

    def params(self) -> list[torch.Tensor]:
        """The parameters whose gradients the step reads (default: the optimizers')."""
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"]]

    def norm_and_clip(self) -> torch.Tensor | None:
        """Inside the step, first: the total gradient norm before clipping (a 0-dim device
        tensor), after clipping to ``clip_grad_norm``; None when neither clipping nor skipping
        needs it."""
        grads = [p.grad for p in self.params() if p.grad is not None]
        if self.clip_grad_norm is not None:
            return torch.nn.utils.clip_grad_norm_(
                self.params(), self.clip_grad_norm, self.norm_type
            )
        if self.guard is not None:
            return total_norm(grads, self.norm_type)
        return None

    def protected_tensors(self) -> list[torch.Tensor]:
        """Tensors besides the optimizers' parameters and state that a skipped step restores
        (default: none)."""
        return []

    def inner_step(self) -> None:
        """Inside the step, after :meth:`norm_and_clip`: the optimizer step itself."""
        self.optimizer.step()

    def bind_grads(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """At capture, before the step is captured: the gradient buffers the graph reads.

        Returns:
            ``(pairs, gradless)``: ``(parameter, buffer)`` for every gradient the graph reads
            (at a fixed address), and the parameters it never steps (they must keep
            ``.grad`` None; checked at every replay). The default
            (:class:`tgraph.step.grad_buffers.GradBuffers`) reads the gradients per-layer
            graphs hand over where they leave them and gives every other gradient a buffer
            of the graph's own (one flat allocation), filled with this step's gradients and
            made the parameters' ``.grad``.

        Raises:
            ValueError: no gradient to step.
        """
        self._buffers = GradBuffers.bind(self.params())
        return list(self._buffers.pairs), list(self._buffers.gradless)

    def refresh_grads(self) -> None:
        """Before a replay (no grad mode): copy the step's gradients into the graph's buffers
        where they are not there already (:meth:`tgraph.step.grad_buffers.GradBuffers.refresh`;
        a copy that would overwrite a gradient kept elsewhere makes this step run eagerly).

        Raises:
            ValueError: a gradient the graph reads is missing, or a parameter it never steps
                has one now (call :meth:`reset`).
        """
        self._buffers.refresh()

    # -- the step ---------------------------------------------------------------------------

    def _run(self) -> None:
        """The captured body: norm (and clip), flag, protected step, zeroing."""
        with torch.no_grad():
            norm = self.norm_and_clip()
            if self.guard is not None:
                ok = finite(norm, self._static_loss)
                with self.guard.protect(self.optimizers, self.protected_tensors(), ok) as commit:
                    self.inner_step()
                    commit(ok)
            else:
                self.inner_step()
            if norm is not None:
                if self._norm is None:
                    self._norm = torch.zeros_like(norm)
                self._norm.copy_(norm)

    def step(self, loss: torch.Tensor | None = None) -> None:
        """One optimizer step: eager during warmup, then captured, then replayed.

        Args:
            loss: the step's loss (a device tensor); with ``skip_nonfinite`` a non-finite loss
                skips the step. Pass it at every call or at none (the graph reads a static copy).

        Raises:
            ValueError: see :meth:`refresh_grads`, a misconfigured optimizer, a changed baked
                hyper-parameter, or ``loss`` given at some calls only.
            tgraph.CaptureError: capture failed; later steps run eagerly (with a warning).
        """
        self._take_loss(loss)
        if self._phase is Phase.CAPTURED:
            why = self._cap.change()
            if why is None:
                return self._replay()
            logger.warning("OptimizerGraph: %s; capturing the step again after warmup", why)
            self.reset()
        if self._factory is None:
            device = self.params()[0].device
            # before any step: a host-stepping optimizer would be refused at capture anyway,
            # and its eager steps keep tensors on the host (Adam's step count) that the skip
            # guard would mix with device tensors
            step_capture.check_optimizers(self.optimizers, device, _ELSEWHERE.format(device=device))
            self._factory = GraphFactory.for_device(self.backend, device)
        if self._phase is not Phase.WARMUP or self._eager_calls < self.warmup_steps:
            return self._eager()
        if self.guard is not None and self.guard.state_pending:
            # The last eager step was a skipped first step and deleted the state it created:
            # this step creates it again, which a capture must not contain.
            return self._eager()
        if any(p.grad is not None and id(p) not in self._stepped for p in self.params()):
            # a parameter's first step creates its optimizer state, which a capture must not
            # contain (undoing it would free pool memory still referenced): step it eagerly
            return self._eager()
        return self._capture()

    def _take_loss(self, loss: torch.Tensor | None) -> None:
        given = loss is not None
        if self._with_loss is None:
            self._with_loss = given
        elif given != self._with_loss:
            raise ValueError(
                f"OptimizerGraph.step: loss was {'not ' if self._with_loss else ''}passed at the "
                "first call, the graph reads it (or not) at every step: pass it at every call or "
                "at none"
            )
        if given and self.guard is not None:
            with torch.no_grad():
                if self._static_loss is None:
                    self._static_loss = loss.detach().clone()
                else:
                    self._static_loss.copy_(loss.detach())

    def _eager(self) -> None:
        if self._phase is Phase.FAILED:
            self._phase = Phase.EAGER
            warnings.warn(
                "OptimizerGraph: capture failed; running the optimizer step eagerly from now on",
                stacklevel=3,
            )
        self._stepped.update(id(p) for p in self.params() if p.grad is not None)
        with self._factory.side_stream():
            self._run()
        self._clear_grads()
        self._eager_calls += 1

    def _capture(self) -> None:
        """The step-capture protocol (tgraph.step.capture) around :meth:`_run`; a step that
        created optimizer state is undone and run eagerly instead (the next step captures)."""
        f = self._factory
        step = StepCapture(
            f,
            "the optimizer step of OptimizerGraph",
            self.optimizers,
            elsewhere=_ELSEWHERE.format(device=f.device),
        )
        layout = self._state_layouts()
        live_grads = [(p, p.grad) for p in self.params()]
        written = [self._norm, self.guard and self.guard.skipped_steps_tensor]
        step.save(self.params(), [t for t in written if t is not None])
        buffers = self._bind(step)
        try:
            step.capture(self._run, refuse_lr_writes=True)
        except BaseException as exc:
            if isinstance(exc, CaptureError) and self._state_layouts() != layout:
                # SkipNonfinite refuses to capture a step that creates optimizer state (e.g.
                # the first step of a parameter that had no gradient before): not capturable,
                # but not a failure either. Undo it (the snapshot deletes the state it
                # created), run it eagerly; capture at the next step.
                step.undo()
                return self._eager()
            self._phase = Phase.FAILED
            step.fail(exc)  # undone; a CaptureError naming the cause (a ValueError as is)
        if self._state_layouts() != layout:
            return self._eager_instead(step)
        self._phase = Phase.CAPTURED
        self._cap = step.result(
            # the clipping the graph baked (clip_grad_norm_ reads both on the host): a change
            # after capture, None included, captures the step again
            settings=[HostSettings(self, _CLIPPING, "a number the captured clipping reads")],
            params=tuple(self.params()),
            static_inputs=() if self._static_loss is None else (self._static_loss,),
            grad_buffers=buffers,
        )
        logger.info("OptimizerGraph: captured on %s in %.3fs", f.backend, step.seconds)
        if not f.executes_capture:  # a CUDA capture executed nothing: this step is a replay
            step.graph.replay()
        self._cap.steps.run_post_hooks()  # detached during the capture (tgraph.step.step_hooks)
        self._after_step(live_grads)

    def _bind(self, step: StepCapture) -> GradBuffers:
        """At capture, before the step is captured: the gradient buffers the graph reads
        (:meth:`bind_grads`), frozen for :meth:`refresh_grads`. A failure undoes ``step`` and
        raises as it is."""
        self._buffers = None  # the default bind_grads sets it
        try:
            pairs, gradless = self.bind_grads()
            if self._buffers is None:  # a subclass's bind_grads bound its own pairs
                self._buffers = GradBuffers()
            # what the default refresh_grads compares, over the pairs whoever bound them
            self._buffers.freeze(pairs, gradless)
        except BaseException:
            step.undo()
            raise
        return self._buffers

    def _eager_instead(self, step: StepCapture) -> None:
        """A captured step that created optimizer state: undo it, the state first (the graph's
        pool must hold no live tensor), drop the graph and run the step eagerly."""
        step.undo()
        step.graph.reset()
        self._eager()

    def _state_layouts(self) -> list[dict[int | tuple[str, int], frozenset]]:
        return [state_layout(o) for o in self.optimizers]

    def _after_step(self, live_grads: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        if self.zero_grad:
            self._clear_grads()
        else:  # the caller's gradient tensors stay .grad (they zero them themselves)
            for p, g in live_grads:
                p.grad = g

    def _replay(self) -> None:
        cap = self._cap
        for hp in cap.hparams:
            hp.refresh()
        live = None if self.zero_grad else [(p, p.grad) for p in self.params()]
        with torch.no_grad():
            self.refresh_grads()
        if cap.grad_buffers.held_elsewhere:  # the graph's gradient memory is held elsewhere
            with cap.factory.side_stream():
                self._run()
        else:
            cap.graph.replay()
            cap.steps.run_post_hooks()  # the optimizers' step post-hooks, as in eager
        if live is not None:
            self._after_step(live)
        else:
            self._clear_grads()

    # -- reading results ----------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        """Whether the step is captured (the next steps replay it)."""
        return self._phase is Phase.CAPTURED

    @property
    def bound_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The ``(parameter, buffer)`` pairs the captured graph reads its gradients from, as
        :meth:`bind_grads` returned them (empty before the capture); what an override of
        :meth:`refresh_grads` checks or fills."""
        return [] if self._cap is None else list(self._cap.grad_buffers.pairs)

    @property
    def capture_seconds(self) -> float:
        """Wall time of the capture (0.0 before it)."""
        return 0.0 if self._cap is None else self._cap.seconds

    @property
    def pool_bytes(self) -> int:
        """Device memory the capture allocated (0 before it, and on the emulated backend)."""
        return 0 if self._cap is None else self._cap.pool_bytes

    @property
    def own_grad_bytes(self) -> int:
        """The bytes of the gradient buffers of the graph's own (the rest is read in place
        where per-layer graphs leave it)."""
        return 0 if self._buffers is None else self._buffers.own_bytes

    @property
    def skipped_steps(self) -> int:
        """Steps skipped as non-finite so far (one host read; 0 without ``skip_nonfinite``)."""
        return 0 if self.guard is None else self.guard.skipped_steps

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last step's total gradient norm before clipping (a fresh device tensor), or None
        without clipping and skipping."""
        return None if self._norm is None else self._norm.clone()

    def capture_report(self) -> CaptureReport:
        """What the capture made, in the shape of :func:`tgraph.create_graphs`'s report
        (``entry="OptimizerGraph"``; all zeros before the capture)."""
        return CaptureReport(
            graphs=int(self.captured),
            runners=0,
            segments=0,
            seconds=self.capture_seconds,
            pool_bytes=self.pool_bytes,
            backends=[self._cap.factory.backend] if self.captured else [],
            eager_modules=[],
            memory=self.memory_report(),
            entry="OptimizerGraph",
        )

    def memory_report(self) -> MemoryReport:
        """The graph's buffers by kind (:class:`tgraph.MemoryReport`): the static loss
        (``static_inputs``) and the gradient buffers of its own (``param_grads``; gradients
        read in place from per-layer graphs are theirs)."""
        if not self.captured:
            return MemoryReport()
        return MemoryReport(
            units=1,
            static_inputs=tensor_bytes(self._cap.static_inputs),
            param_grads=self.own_grad_bytes,
        )

    def reset(self) -> None:
        """Drop the graph; the next steps warm up anew."""
        if self._cap is not None:
            self._cap.graph.reset()
        self._reset_state()


__all__ = ["OptimizerGraph"]
