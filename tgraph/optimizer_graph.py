"""The optimizer step as one graph, beside per-layer graphs, and skipping non-finite steps on the
device (no host sync).

Usage, next to :func:`tgraph.enable`::

    tgraph.enable(model)
    opt = torch.optim.AdamW(model.parameters(), fused=True, capturable=True)
    opt_graph = tgraph.OptimizerGraph(opt, clip_grad_norm=1.0)   # skip_nonfinite=True
    for step, (x, y) in enumerate(loader):
        _, loss = model(x, y)
        loss.backward()
        opt_graph.step(loss)        # clip, skip if loss or grad norm is not finite, step, zero .grad
        sched.step()                # reaches the graph through a device tensor (tgraph.step_state)
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

Gradients: a CUDA graph reads fixed addresses, while autograd hands over new ``.grad`` tensors
(per-layer graphs do at every backward). :class:`OptimizerGraph` owns one flat gradient buffer;
before each replay the step's ``.grad`` tensors are copied into it with one multi-tensor copy,
and with ``zero_grad=True`` (default) ``.grad`` is set to None after every step, as
``optimizer.zero_grad()`` does, so the next backward's AccumulateGrad adopts autograd's tensors
without an add kernel per parameter. Every parameter that had a gradient at capture is stepped at
every replay: a ``.grad`` that is None where the capture had one raises, and so does one present
where the capture had none (call :meth:`OptimizerGraph.reset`). Capture happens at the first step
after ``warmup_steps`` eager ones; a captured step that would create optimizer state is undone and
run eagerly, and the next step is captured.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from tgraph.backend import CaptureError, GraphFactory, explain_capture_failure, resolve_backend
from tgraph.step_state import EmulatedStepGraph, HyperParams, RefuseLrWrites, StepSnapshot

logger = logging.getLogger(__name__)

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of ``t``'s memory (arithmetic on it is exact, NaN and Inf included)."""
    t = t.detach()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_floating_point():
        return t.view(_BITS[t.element_size()])
    if t.is_complex():
        raise ValueError(f"SkipNonfinite cannot protect a {t.dtype} tensor (no integer view)")
    return t


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters and tensor-valued optimizer state: what a step may change."""
    out = {id(p): p for g in opt.param_groups for p in g["params"]}
    for st in opt.state.values():
        out.update((id(v), v) for v in st.values() if isinstance(v, torch.Tensor))
    return list(out.values())


def masks_with_found_inf(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` skips its update on ``opt.found_inf == 1`` without side effects:
    torch's fused Adam/AdamW/SGD (the kernels GradScaler drives)."""
    return (
        type(opt).__module__.startswith("torch.optim")
        and bool(getattr(opt, "_step_supports_amp_scaling", False))
        and all(g.get("fused") for g in opt.param_groups)
    )


def _state_layout(opt: torch.optim.Optimizer) -> dict[int, frozenset]:
    return {
        id(p): frozenset(k for k, v in st.items() if v is not None) for p, st in opt.state.items()
    }


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The gradient norm as a device tensor (no host sync), as ``clip_grad_norm_`` computes it."""
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch >= 2.6
        return torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=False)
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def finite(*values: torch.Tensor | None) -> torch.Tensor:
    """0-dim bool device tensor: every element of every given tensor is finite."""
    flags = [torch.isfinite(v.detach()).all() for v in values if v is not None]
    ok = flags[0]
    for f in flags[1:]:
        ok = ok & f
    return ok


class _Protected:
    """One step's snapshot of some tensors (reused buffers: fixed addresses across replays)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        # grouped by device too: a non-capturable optimizer keeps its step count on the host
        # (eager warmups only; such an optimizer is refused before capture)
        self.by_dtype: dict[
            tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]
        ] = {}
        for t in tensors:
            b = _bits(t)
            cur, snap = self.by_dtype.setdefault((b.device, b.dtype), ([], []))
            cur.append(b)
            snap.append(torch.empty_like(b))

    def save(self) -> None:
        for cur, snap in self.by_dtype.values():
            torch._foreach_copy_(snap, cur)

    def select(self, ok: torch.Tensor) -> None:
        """Each tensor becomes itself where ``ok`` else its snapshot, bit for bit."""
        for (device, dtype), (cur, snap) in self.by_dtype.items():
            keep = ok.to(device=device, dtype=dtype)
            torch._foreach_mul_(cur, keep)
            torch._foreach_mul_(snap, 1 - keep)
            torch._foreach_add_(cur, snap)


class SkipNonfinite:
    """Skips optimizer steps on a device flag, and counts them on the device.

    ``with guard.protect(optimizers) as commit: opt.step(); commit(ok)`` keeps parameters and
    state when ``ok`` (a 0-dim bool device tensor, see :func:`finite`) is False. Graph-safe: no
    host read, fixed buffers. The one exception: an optimizer's *first* step creates its state
    (Adam's moments); if that step is to be skipped, the new state is deleted, which needs one
    host read of ``ok``. That happens during eager warmup only; capturing such a step raises.
    """

    def __init__(self) -> None:
        self._counter: torch.Tensor | None = None
        self.state_pending = False
        """The latest step created optimizer state and was skipped: the state is still missing."""
        # per set of optimizers: (ids of the protected tensors, their snapshot buffers)
        self._snapshots: dict[tuple[int, ...], tuple[tuple[int, ...], _Protected]] = {}

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reads the device counter: one host sync)."""
        return 0 if self._counter is None else int(self._counter.item())

    @property
    def skipped_steps_tensor(self) -> torch.Tensor | None:
        """The device counter itself (0-dim int64; updated in place by every step)."""
        return self._counter

    def protect(
        self,
        optimizers: Iterable[torch.optim.Optimizer],
        extra: Iterable[torch.Tensor] = (),
        ok: torch.Tensor | None = None,
    ) -> _Step:
        """Snapshot the optimizers' parameters and state, and ``extra`` tensors (e.g. model
        weights a mixed-precision optimizer copies its fp32 master weights into).

        With ``ok`` known before the step and only fused torch optimizers (Adam, AdamW, SGD
        with ``fused=True``), nothing is snapshotted: their kernels read ``found_inf``
        (``1 - ok``, as :class:`torch.amp.GradScaler` sets it) and leave parameters and state
        untouched on a skipped step (Adam's step count is incremented, then decremented: exact).
        ``commit`` must then be given the same ``ok``.
        """
        opts = list(optimizers)
        mask = ok is not None and all(masks_with_found_inf(o) for o in opts)
        return _Step(self, opts, list(extra), found_inf_of=ok if mask else None)

    def _snapshot(
        self, opts: list[torch.optim.Optimizer], tensors: list[torch.Tensor]
    ) -> _Protected:
        key, ids = tuple(id(o) for o in opts), tuple(id(t) for t in tensors)
        held = self._snapshots.get(key)
        if held is None or held[0] != ids:  # new state tensors (first steps): new buffers
            held = self._snapshots[key] = (ids, _Protected(tensors))
        return held[1]

    def _count(self, ok: torch.Tensor) -> None:
        if self._counter is None:
            self._counter = torch.zeros((), dtype=torch.int64, device=ok.device)
        self._counter.add_(1 - ok.to(torch.int64))


class _Step:
    """One protected step: snapshot on entry; ``commit(ok)`` keeps or reverts it."""

    def __init__(
        self,
        guard: SkipNonfinite,
        optimizers: list[torch.optim.Optimizer],
        extra: list,
        found_inf_of: torch.Tensor | None = None,
    ) -> None:
        self._guard = guard
        self._opts = optimizers
        self._extra = extra
        self._ok = found_inf_of  # set: the fused kernels mask the update (found_inf)
        self._layouts: list[dict[int, frozenset]] = []
        self._snap: _Protected | None = None

    def __enter__(self) -> Callable[[torch.Tensor], None]:
        self._layouts = [_state_layout(o) for o in self._opts]
        if self._ok is not None:
            # only what the optimizers do not own needs a snapshot (usually nothing)
            owned = {id(p) for o in self._opts for g in o.param_groups for p in g["params"]}
            tensors = {id(t): t for t in self._extra if id(t) not in owned}
            with torch.no_grad():
                found_inf = (~self._ok).to(torch.float32)
            for o in self._opts:
                o.found_inf = found_inf
        else:
            tensors = {id(t): t for o in self._opts for t in optimizer_tensors(o)}
            tensors.update((id(t), t) for t in self._extra)
        tensors = list(tensors.values())
        self._snap = self._guard._snapshot(self._opts, tensors) if tensors else None
        if self._snap is not None:
            with torch.no_grad():
                self._snap.save()
        return self.commit

    def __exit__(self, *exc: Any) -> None:
        if self._ok is not None:
            for o in self._opts:
                o.__dict__.pop("found_inf", None)
        return None

    def _select(self, ok: torch.Tensor) -> None:
        if self._snap is not None:
            self._snap.select(ok)

    @torch.no_grad()
    def commit(self, ok: torch.Tensor, count: bool = True) -> None:
        """Keep the step where ``ok`` else revert it; ``count`` adds a skip to the counter."""
        created = [_state_layout(o) != before for o, before in zip(self._opts, self._layouts)]
        if any(created):
            self._guard.state_pending = self._commit_first_step(ok, created)
        else:
            self._guard.state_pending = False
            self._select(ok)
        if count:
            self._guard._count(ok)

    def _commit_first_step(self, ok: torch.Tensor, created: list[bool]) -> bool:
        """Returns whether the step was skipped (its new state deleted)."""
        if _capturing():
            raise CaptureError(
                "the optimizer created its state (e.g. Adam's moments) inside the captured step, "
                "so a skipped step could not delete it again: every warmup step so far was "
                "skipped as non-finite. Run more warmup steps (warmup_steps=...) with finite "
                "losses before capture."
            )
        if bool(ok):  # eager warmup only (see SkipNonfinite): one host read
            return False
        self._select(ok)  # parameters and any state that existed before
        for opt, before, changed in zip(self._opts, self._layouts, created):
            if not changed:
                continue
            for p in list(opt.state):
                keys = before.get(id(p))
                if keys is None:
                    del opt.state[p]
                else:
                    for k in [k for k in opt.state[p] if k not in keys]:
                        del opt.state[p][k]
        return True


def _flat_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers shaped like ``tensors``: views of one allocation per (device, dtype)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (device, dtype), idx in groups.items():
        flat = torch.empty(sum(tensors[i].numel() for i in idx), device=device, dtype=dtype)
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].view(tensors[i].shape)
            offset += n
    return out


def _capturing() -> bool:
    """A CUDA capture, or an emulated one (which patches this function of torch.cuda)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # CPU-only builds of torch
        return False


# -- the optimizer-step graph ------------------------------------------------------------------


def check_graphable_optimizer(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Refuse an optimizer whose step reads its step count on the host (as FullIterationGraph)."""
    name = type(opt).__name__
    for i, g in enumerate(opt.param_groups):
        devices = {p.device for p in g["params"]}
        if devices - {device}:
            raise ValueError(
                f"{name} param_group {i} holds parameters on {sorted(map(str, devices))}, but the "
                f"graph runs on {device}: one OptimizerGraph per device"
            )
        if "capturable" in g and not g["capturable"]:
            if device.type == "cuda":
                raise ValueError(
                    f"{name} param_group {i} has capturable=False: its step reads the step count "
                    f"on the host, which a CUDA graph cannot contain. Construct it with "
                    f"torch.optim.{name}(..., capturable=True)."
                )
            if not g.get("fused"):
                raise ValueError(
                    f"{name} param_group {i} has capturable=False and fused=False: its step reads "
                    f"the step count on the host (.item()). On {device.type} construct it with "
                    f"torch.optim.{name}(..., fused=True) (capturable=True is CUDA-only)."
                )


class OptimizerGraph:
    """``optimizer.step()`` with clipping, non-finite skipping and gradient zeroing as one graph.

    Args:
        optimizer: a torch optimizer whose step needs no host sync: ``fused=True`` or
            ``capturable=True`` (Adam/AdamW need ``capturable=True`` on CUDA, ``fused=True`` on
            the CPU). Its float learning rates move into device tensors at capture, so LR
            schedulers keep working (:class:`tgraph.step_state.HyperParams`).
        clip_grad_norm: clip the gradients to this total norm first, exactly as
            ``torch.nn.utils.clip_grad_norm_(params, clip_grad_norm, norm_type)`` (on the device).
        norm_type: the norm of clipping and of the finiteness check.
        skip_nonfinite: skip the step (parameters and state untouched, Adam's step count
            included) when the gradient norm, or the loss passed to :meth:`step`, is not finite.
        zero_grad: zero the captured ``.grad`` tensors in place at the end of every step (see the
            module docstring on gradient ownership). With False, zero them yourself in place
            (``optimizer.zero_grad(set_to_none=False)``).
        warmup_steps: eager steps before capture (more if a step created optimizer state).
        backend: ``"auto"``, ``"cuda"`` or ``"emulated"`` (from the parameters' device).

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: a bad argument value.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip_grad_norm: float | None = None,
        norm_type: float = 2.0,
        skip_nonfinite: bool = True,
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
        if backend not in ("auto", "cuda", "emulated"):
            raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'cuda' or 'emulated'")
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        self.norm_type = float(norm_type)
        self.guard = SkipNonfinite() if skip_nonfinite else None
        self.zero_grad = zero_grad
        self.warmup_steps = warmup_steps
        self.backend = backend
        self.capture_seconds = 0.0
        self._reset_state()

    def _reset_state(self) -> None:
        self._factory: GraphFactory | None = None
        self._graph: Any = None
        self._hparams: HyperParams | None = None
        self._eager_calls = 0
        self._state_changed = True  # the last eager step created optimizer state
        self._failed = self._warned = False
        self._grads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (param, graph's buffer)
        self._gradless: list[torch.Tensor] = []
        self._checked = False
        self._static_loss: torch.Tensor | None = None
        self._with_loss: bool | None = None
        self._norm: torch.Tensor | None = None

    # -- what the graph reads and changes (overridden by tgraph.integrations.megatron) --------

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers the step runs (their learning rates reach the graph)."""
        return [self.optimizer]

    def params(self) -> list[torch.Tensor]:
        return [p for o in self.optimizers for g in o.param_groups for p in g["params"]]

    def _norm_and_clip(self) -> torch.Tensor | None:
        grads = [p.grad for p in self.params() if p.grad is not None]
        if self.clip_grad_norm is not None:
            return torch.nn.utils.clip_grad_norm_(
                self.params(), self.clip_grad_norm, self.norm_type
            )
        if self.guard is not None:
            return total_norm(grads, self.norm_type)
        return None

    def _protected_extra(self) -> list[torch.Tensor]:
        """Tensors besides the optimizers' parameters and state that a skipped step restores."""
        return []

    def _inner_step(self) -> None:
        self.optimizer.step()

    def _clear_grads(self) -> None:
        """After a step (eager, captured or replayed): ``.grad = None``, as
        ``optimizer.zero_grad()``; the next backward hands autograd's tensors over unchanged."""
        if self.zero_grad:
            for p in self.params():
                p.grad = None

    def _grad_ownership(self) -> None:
        """At capture: the graph's own gradient buffers (one flat allocation, fixed address),
        filled with this step's gradients; the parameters it never steps."""
        live = [(p, p.grad) for p in self.params() if p.grad is not None]
        self._gradless = [p for p in self.params() if p.grad is None]
        if not live:
            raise ValueError(
                "OptimizerGraph: no parameter has a .grad at capture; call step() after "
                "backward(), as optimizer.step()"
            )
        buffers = _flat_like([g for _, g in live])
        with torch.no_grad():
            torch._foreach_copy_(buffers, [g for _, g in live])
        self._grads = [(p, b) for (p, _), b in zip(live, buffers)]
        for p, b in self._grads:
            p.grad = b

    def _check_grads(self) -> None:
        """Before a replay: copy the step's gradients into the graph's buffers (one
        multi-tensor copy; module docstring)."""
        dst, src = [], []
        for p, b in self._grads:
            live = p.grad
            if live is None:
                raise ValueError(
                    "OptimizerGraph: a parameter's .grad is None, but the graph was captured with "
                    "a gradient for it and would step it (eager code would skip it). Call reset() "
                    "to capture anew when the set of parameters with gradients changes."
                )
            if live is not b:
                dst.append(b)
                src.append(live)
        if dst:
            torch._foreach_copy_(dst, src)
        if not self._checked:  # the set of gradient-less parameters is checked once per capture
            self._checked = True
            for p in self._gradless:
                if p.grad is not None:
                    raise ValueError(
                        "OptimizerGraph: a parameter without .grad at capture has one now; the "
                        "graph would not step it. Call reset() to capture anew with it."
                    )

    # -- the step ---------------------------------------------------------------------------

    def _run(self) -> None:
        """The captured body: norm (and clip), flag, protected step, zeroing."""
        with torch.no_grad():
            norm = self._norm_and_clip()
            if self.guard is not None:
                ok = finite(norm, self._static_loss)
                with self.guard.protect(self.optimizers, self._protected_extra(), ok) as commit:
                    self._inner_step()
                    commit(ok)
            else:
                self._inner_step()
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
            ValueError: see :meth:`_check_grads`, a misconfigured optimizer, a changed baked
                hyper-parameter, or ``loss`` given at some calls only.
            tgraph.CaptureError: capture failed; later steps run eagerly (with a warning).
        """
        self._take_loss(loss)
        if self._graph is not None:
            return self._replay()
        if self._factory is None:
            device = self.params()[0].device
            # before any step: a host-stepping optimizer would be refused at capture anyway,
            # and its eager steps keep tensors on the host (Adam's step count) that the skip
            # guard would mix with device tensors
            for opt in self.optimizers:
                check_graphable_optimizer(opt, device)
            self._factory = GraphFactory(resolve_backend(self.backend, device), device)
        if self._failed or self._eager_calls < self.warmup_steps or self._state_changed:
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
        if self._failed and not self._warned:
            self._warned = True
            warnings.warn(
                "OptimizerGraph: capture failed; running the optimizer step eagerly from now on",
                stacklevel=3,
            )
        with self._factory.side_stream():
            self._run()
        self._clear_grads()
        # A skipped first step deleted the state it created: the next step creates it again,
        # which a capture must not contain. (A capture that creates state anyway is undone
        # and run eagerly, see _capture.)
        self._state_changed = bool(self.guard and self.guard.state_pending)
        self._eager_calls += 1

    def _capture(self) -> None:
        f = self._factory
        for opt in self.optimizers:
            check_graphable_optimizer(opt, f.device)
        layout = [_state_layout(o) for o in self.optimizers]
        live_grads = [(p, p.grad) for p in self.params()]
        hp = HyperParams(self.optimizers)
        hp.prepare()
        lr_tensors = [g["lr"] for _, _, g in hp._groups if isinstance(g["lr"], torch.Tensor)]
        groups = [g for o in self.optimizers for g in o.param_groups]
        graph = f.new_graph() if f.backend == "cuda" else EmulatedStepGraph(groups)
        extra = [
            t for t in (self._norm, self.guard and self.guard.skipped_steps_tensor) if t is not None
        ]
        snap = StepSnapshot(
            self.params(), self.optimizers, extra, f.device, values=f.backend != "cuda"
        )
        self._grad_ownership()
        f.synchronize()
        start = time.perf_counter()
        try:
            with f.side_stream(), RefuseLrWrites(lr_tensors):
                graph.capture(self._run)
        except BaseException as exc:
            created = [_state_layout(o) for o in self.optimizers] != layout
            f.synchronize()
            snap.restore()  # also deletes state the capture created
            hp.restore()
            self._grads, self._gradless = [], []
            if created and isinstance(exc, CaptureError):
                # The step created optimizer state (SkipNonfinite refuses to capture that, e.g.
                # the first step of a parameter that had no gradient before): not capturable,
                # but not a failure either. Run it eagerly; capture at the next step.
                return self._eager()
            self._failed = True
            if isinstance(exc, ValueError):
                raise
            raise explain_capture_failure("the optimizer step of OptimizerGraph", exc) from exc
        if [_state_layout(o) for o in self.optimizers] != layout:  # created state: undo
            f.synchronize()
            graph.reset()
            snap.restore()
            hp.restore()
            self._grads, self._gradless = [], []
            return self._eager()
        f.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self._graph, self._hparams = graph, hp
        logger.info("OptimizerGraph: captured on %s in %.3fs", f.backend, self.capture_seconds)
        if f.backend == "cuda":  # a CUDA capture executed nothing: this call's step is a replay
            graph.replay()
        self._after_step(live_grads)

    def _after_step(self, live_grads: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        if self.zero_grad:
            self._clear_grads()
        else:  # the caller's gradient tensors stay .grad (they zero them themselves)
            for p, g in live_grads:
                p.grad = g

    def _replay(self) -> None:
        self._hparams.refresh()
        emulated = self._factory.backend != "cuda"
        live = None if self.zero_grad and not emulated else [(p, p.grad) for p in self.params()]
        with torch.no_grad():
            self._check_grads()
        if emulated:  # the emulated replay re-runs the step's Python: it must see the buffers
            for p, b in self._grads:
                p.grad = b
        self._graph.replay()
        if live is not None:
            self._after_step(live)
        else:
            self._clear_grads()

    # -- reading results ----------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def skipped_steps(self) -> int:
        """Steps skipped as non-finite so far (one host read; 0 without ``skip_nonfinite``)."""
        return 0 if self.guard is None else self.guard.skipped_steps

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The last step's total gradient norm before clipping (a fresh device tensor), or None
        without clipping and skipping."""
        return None if self._norm is None else self._norm.clone()

    def reset(self) -> None:
        """Drop the graph; learning rates become floats again; the next steps warm up anew."""
        if self._graph is not None:
            self._graph.reset()
        if self._hparams is not None:
            self._hparams.restore()
        self._reset_state()


# -- skipping inside FullIterationGraph --------------------------------------------------------


class SkipNonfiniteStep:
    """``fn`` of a :class:`tgraph.FullIterationGraph` whose optimizer steps are skipped on the
    device when ``fn``'s loss (its first tensor output) or the gradients are not finite.

    Every optimizer stepping inside ``fn`` is protected from its first ``step()`` call (hook):
    there the gradient flag is computed (after any clipping in ``fn``) and the parameters and
    state are saved; after ``fn`` returns, the flag is combined with the loss's and each step is
    kept or reverted. Eager warmups, the capture and (emulated) replays all run this wrapper.
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn
        self.guard = SkipNonfinite()

    def __call__(self, batch: Any) -> Any:
        steps: dict[int, tuple[Any, torch.Tensor, Callable]] = {}

        def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            if id(opt) in steps:
                return
            with torch.no_grad():
                grads = [
                    p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None
                ]
                ok = finite(total_norm(grads)) if grads else None
            step = self.guard.protect([opt])
            steps[id(opt)] = (step, ok, step.__enter__())

        handle = register_optimizer_step_pre_hook(before_step)
        try:
            out = self.fn(batch)
        finally:
            handle.remove()
        loss = next((x for x in tree_leaves(out) if isinstance(x, torch.Tensor)), None)
        if loss is None:
            raise ValueError(
                "FullIterationGraph(skip_nonfinite=True): fn returned no tensor; return the loss "
                "(its first tensor output is checked)"
            )
        with torch.no_grad():
            ok = finite(loss)
            for _, grad_ok, _ in steps.values():
                ok = ok if grad_ok is None else ok & grad_ok  # one flag: skip all or none
            for i, (_, _, commit) in enumerate(steps.values()):
                commit(ok, count=i == 0)
        return out


__all__ = ["OptimizerGraph", "SkipNonfinite", "SkipNonfiniteStep", "finite", "total_norm"]
