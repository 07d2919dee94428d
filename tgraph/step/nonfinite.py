"""Skipping non-finite optimizer steps on the device, with no host sync.

A 0/1 device flag says whether the loss and the gradient norm are finite (:func:`finite`,
:func:`total_norm`). For torch's fused Adam/AdamW/SGD the flag goes into the kernels' own
``found_inf`` input (as ``torch.amp.GradScaler`` drives them): a skipped step leaves parameters
and moments untouched and Adam's step count comes back exactly; nothing is copied. Other
optimizers (e.g. megatron's capturable foreach AdamW): before the step, the parameters and every
state tensor are copied into snapshot buffers; after it, each becomes ``ok * new + (1 - ok) *
old`` computed on its *bits* (an integer view), bitwise the new or the old value (one copy and
three integer passes). A first step that created state and is skipped gets that state deleted
(one host read, eager warmup only). A device counter adds ``1 - ok`` at every step;
:attr:`SkipNonfinite.skipped_steps` reads it (one sync).

Used by :class:`tgraph.OptimizerGraph` and, through :class:`SkipNonfiniteStep`, by
``tgraph.FullIterationGraph(skip_nonfinite=True)`` (always the mask way: its flag is complete
only after ``fn`` returns, after the step).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from tgraph.guards import CaptureError

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
    """Parameters, tensor-valued optimizer state and the tensors a step keeps in its param
    groups: what a step may change. (TransformerEngine's capturable FusedAdam keeps its step
    count in ``group["step"]``, a device tensor it advances in place.) The hyper-parameters
    (the keys of ``opt.defaults``: ``lr``, ``betas``, ...) are read by a step, not written: a
    schedule writes them between steps, and a captured step must not (tgraph.guards)."""
    out = {id(p): p for g in opt.param_groups for p in g["params"]}
    hyper = {"params", "initial_lr", *getattr(opt, "defaults", ())}
    for g in opt.param_groups:
        out.update(
            (id(v), v) for k, v in g.items() if k not in hyper and isinstance(v, torch.Tensor)
        )
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


def state_layout(opt: torch.optim.Optimizer) -> dict[int | tuple[str, int], frozenset]:
    """The keys of each parameter's state (by ``id``) and of each param group (by
    ``("group", index)``): a first step adds some."""
    layout: dict[int | tuple[str, int], frozenset] = {
        id(p): frozenset(k for k, v in st.items() if v is not None) for p, st in opt.state.items()
    }
    layout.update((("group", i), frozenset(g)) for i, g in enumerate(opt.param_groups))
    return layout


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


# -- the mask way ---------------------------------------------------------------------------------


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

    ``with guard.protect(optimizers, ok=ok) as commit: opt.step(); commit(ok)`` keeps parameters
    and state when ``ok`` (a 0-dim bool device tensor, see :func:`finite`) is False. Graph-safe:
    no host read, fixed buffers. The one exception: an optimizer's *first* step creates its state
    (Adam's moments); if that step is to be skipped, the new state is deleted, which needs one
    host read of ``ok``. That happens during eager warmup only; capturing such a step raises.
    """

    def __init__(self) -> None:
        self.last_way: str | None = None
        """How the latest protected step skips: ``"found_inf"`` or ``"snapshot"`` (after a
        CUDA capture: the captured step's way)."""
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
        """
        opts = list(optimizers)
        if ok is None:
            return _Step(self, opts, list(extra), "snapshot")
        way = "found_inf" if all(masks_with_found_inf(o) for o in opts) else "snapshot"
        return _Step(self, opts, list(extra), way, ok)

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
    """One protected step: snapshot on entry; ``commit(ok)`` keeps or reverts it.

    ``way``: ``"found_inf"`` (the fused kernels mask the update), ``"snapshot"`` (save, then
    select bit for bit).
    """

    def __init__(
        self,
        guard: SkipNonfinite,
        optimizers: list[torch.optim.Optimizer],
        extra: list,
        way: str,
        ok: torch.Tensor | None = None,
    ) -> None:
        self._guard = guard
        self._opts = optimizers
        self._extra = extra
        self._way = way
        self._ok = ok
        self._layouts: list[dict[int | tuple[str, int], frozenset]] = []
        self._snap: _Protected | None = None

    def __enter__(self) -> Callable[[torch.Tensor], None]:
        self._layouts = [state_layout(o) for o in self._opts]
        self._guard.last_way = self._way
        if self._way == "found_inf":
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
        if self._way == "found_inf":
            for o in self._opts:
                o.__dict__.pop("found_inf", None)
        return None

    def _select(self, ok: torch.Tensor) -> None:
        if self._snap is not None:
            self._snap.select(ok)

    @torch.no_grad()
    def commit(self, ok: torch.Tensor, count: bool = True) -> None:
        """Keep the step where ``ok`` else revert it; ``count`` adds a skip to the counter."""
        created = [state_layout(o) != before for o, before in zip(self._opts, self._layouts)]
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
            for i, g in enumerate(opt.param_groups):  # e.g. TE FusedAdam's first group["step"]
                for k in [k for k in g if k not in before.get(("group", i), g.keys())]:
                    del g[k]
        return True


def _capturing() -> bool:
    """A CUDA capture, or an emulated one (which patches this function of torch.cuda)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # CPU-only builds of torch
        return False


# optimizer -> tensors besides its own that a skipped step restores (SkipNonfiniteStep)
_ALSO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def protect_also(optimizer: torch.optim.Optimizer, tensors: Iterable[torch.Tensor]) -> None:
    """Name tensors that a step of ``optimizer`` skipped by :class:`SkipNonfiniteStep` restores
    besides its parameters and state: the model weights a mixed-precision optimizer copies its
    master weights into after the step (megatron-core's bf16 optimizer,
    :func:`tgraph.integrations.megatron_optimizer.make_graph_safe`). Replaces any earlier
    list; held as long as the optimizer lives."""
    _ALSO[optimizer] = list(tensors)


class SkipNonfiniteStep:
    """``fn`` of a :class:`tgraph.FullIterationGraph` whose optimizer steps are skipped on the
    device when ``fn``'s loss (its first tensor output) or the gradients are not finite.

    Every optimizer stepping inside ``fn`` is protected from its first ``step()`` call (hook):
    there the gradient flag is computed (after any clipping in ``fn``) and the parameters, the
    state and the tensors :func:`protect_also` named for it are saved; after ``fn`` returns,
    the flag is combined with the loss's and each step is kept or reverted. Eager warmups, the
    capture and (emulated) replays all run this wrapper.
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
            step = self.guard.protect([opt], extra=_ALSO.get(opt, ()))
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


__all__ = [
    "SkipNonfinite",
    "SkipNonfiniteStep",
    "finite",
    "protect_also",
    "total_norm",
]
