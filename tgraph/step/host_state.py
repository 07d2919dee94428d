"""Which optimizers a whole-step graph can step: optimizer state that lives on the host.

A CUDA graph replays device kernels and nothing else. An optimizer that keeps part of its state
on the host advances it once, while the step is captured, and never again: torch's Adagrad,
Adadelta, RMSprop, Adamax, NAdam, RAdam, ASGD, Rprop, Adafactor, and Adam/AdamW without
``fused`` or ``capturable``, keep ``state['step']`` in a CPU tensor ("Deliberately host `step`
on CPU if both capturable and fused are off", torch/optim/adam.py); a replayed Adagrad would
keep stepping with the count of the capture (2 where eager has 3). Such optimizers are refused
before the capture (:func:`check_graphable_optimizer`), decided by what the optimizer is, not by
the device: the emulated backend, whose tensors are all CPU tensors, refuses exactly what CUDA
refuses. (A custom optimizer without a ``capturable`` flag that creates its step count on the CPU
is known by its device only: refused beside CUDA parameters; on the CPU that count is device
memory, which the emulated graph replays.)

What torch captures safely is accepted:

* ``fused=True`` (Adam, AdamW and SGD on CUDA and the CPU, Adagrad on the CPU): the step count
  lives on the device. torch's capture health check asks for ``capturable=True`` even there
  (the fused kernels ignore the flag: ``capturable  # Needed for consistency`` in
  torch/optim/adam.py ``_fused_adam``), so such groups say ``capturable=True`` for the duration
  of a capture only (:func:`fused_groups_capturable`);
* ``capturable=True`` (CUDA);
* an optimizer without host state (SGD, fused or not: its momentum buffers live beside the
  parameters), with a float ``lr``: torch's optimizers that are neither fused nor capturable
  pass a tensor ``lr`` to their kernels as a Python scalar (``.item()`` at every step), and such
  a group is refused too, naming ``fused=True`` or a float ``lr``.

A group that lost the ``fused`` or ``capturable`` flag its optimizer was constructed with is
refused saying so: torch's ``load_state_dict`` replaces the flags with those of the optimizer
that saved the state dict (an eager foreach Adam's checkpoint loaded into a fused Adam).

After a capture, :class:`HostWrites` refuses what the checks before it could not know: a CPU
tensor of an optimizer's state or attributes, or of a module that ran in the step, written
inside a CUDA capture, and a Python number in an optimizer's state or attributes (a custom
optimizer's ``state['step'] += 1``) written inside a capture on either backend; a graph keeps
both at their capture-time value. A Python number the step only reads (a custom optimizer's
``self.lr``), or a setting of another object it reads on the host (a ``GradScaler``'s growth
factor, an :class:`tgraph.OptimizerGraph`'s clipping norm) is :class:`BakedNumbers`': a change
after capture captures the step again.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import warnings
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain
from typing import NamedTuple

import torch
import torch.nn as nn

from tgraph.guards import CaptureError
from tgraph.step.hyperparams import holds_tensor_lr

# torch's fused implementations, and the devices each runs on (None: every device torch's fused
# kernels support). torch refuses fused Adagrad on CUDA (_device_dtype_check_for_fused(...,
# cuda_unsupported=True)).
_FUSED_DEVICES: dict[str, set[str] | None] = {
    "Adam": None,
    "AdamW": None,
    "SGD": None,
    "Adagrad": {"cpu"},
}
_ALTERNATIVE = "an optimizer torch captures, e.g. torch.optim.AdamW(..., fused=True)"
# torch's optimizers without a ``capturable`` option that keep their step count in a CPU tensor
# all the same: Adagrad (``fused`` only) and Adafactor (neither; its step reads the count with
# ``.item()``, torch/optim/_adafactor.py)
_HOST_STEPPING = tuple(
    c for c in (torch.optim.Adagrad, getattr(torch.optim, "Adafactor", None)) if c is not None
)


def host_state(opt: torch.optim.Optimizer, group: dict) -> str | None:
    """What of one param_group's optimizer state lives on the host, or None.

    Decided from what the optimizer is: a CPU state tensor beside parameters on another device
    (any optimizer); else, in a group with neither ``fused`` nor ``capturable`` set, torch's
    convention for optimizers that have a ``capturable`` option (and Adagrad, which has
    ``fused`` only, and Adafactor, which has neither): their 0-dim state tensors (``step``;
    NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) are CPU tensors, whatever the
    parameters' device.
    """
    for p in group["params"]:
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.device.type == "cpu" != p.device.type:
                return (
                    f"keeps state[{k!r}] on the CPU (a CPU tensor beside parameters on {p.device})"
                )
    if group.get("fused") or group.get("capturable"):
        return None
    if "capturable" not in group and not isinstance(opt, _HOST_STEPPING):
        return None
    keys = sorted(
        {
            k
            for p in group["params"]
            for k, v in opt.state.get(p, {}).items()
            if isinstance(v, torch.Tensor) and v.dim() == 0
        }
        or {"step"}
    )
    which = ", ".join(f"state[{k!r}]" for k in keys)
    are = "is a CPU tensor" if len(keys) == 1 else "are CPU tensors"
    return f"keeps its step count on the CPU ({which} {are})"


def _fix(opt: torch.optim.Optimizer, group: dict, device: torch.device) -> str:
    name = type(opt).__name__
    ctor = f"torch.optim.{name}" if type(opt).__module__.startswith("torch.optim") else name
    ways = []
    if name in _FUSED_DEVICES and "fused" in group:
        devices = _FUSED_DEVICES[name]
        if devices is None or device.type in devices:
            ways.append(f"{ctor}(..., fused=True)")
    if "capturable" in group and device.type != "cpu":
        ways.append(f"{ctor}(..., capturable=True)")
    if ways:
        return f"Construct it with {' or '.join(ways)}."
    return (
        f"torch has no capturable {name} on {device.type}: use {_ALTERNATIVE}, or keep this "
        "optimizer's step out of the graph."
    )


def check_graphable_optimizer(
    opt: torch.optim.Optimizer, device: torch.device, elsewhere: str
) -> None:
    """Refuse an optimizer a graph on ``device`` cannot step: parameters on another device
    (``elsewhere`` ends the message with the fix), or state on the host (:func:`host_state`).

    Raises:
        ValueError: naming the optimizer, the param_group, the host state and the fix.
    """
    name = type(opt).__name__
    for i, g in enumerate(opt.param_groups):
        devices = {p.device for p in g["params"]}
        if devices - {device}:
            raise ValueError(
                f"{name} param_group {i} holds parameters on {sorted(map(str, devices))}{elsewhere}"
            )
        flags = ", ".join(f"{k}={bool(g[k])}" for k in ("capturable", "fused") if k in g)
        flags = f" ({flags})" if flags else ""
        what = host_state(opt, g)
        if what is not None:
            raise ValueError(
                f"{name} param_group {i}{flags} {what}: a graph would advance it once, at "
                f"capture, and never again. {_lost_flags(opt, g) or _fix(opt, g, device)}"
            )
        if _reads_lr_on_host(opt, g):
            raise ValueError(
                f"{name} param_group {i}{flags} holds a tensor lr, which {name} reads on the "
                "host at every step (.item()) unless it is fused or capturable: a graph cannot "
                f"contain that read. {_lr_fix(opt, g, device)}"
            )


def _lost_flags(opt: torch.optim.Optimizer, group: dict) -> str | None:
    """Where the optimizer was constructed ``fused`` or ``capturable`` and ``group`` is no
    longer: the fix, for torch's ``load_state_dict``, which replaces each param_group's flags
    with those of the optimizer that saved the state dict (an eager foreach Adam's checkpoint
    loaded into a fused one); else None."""
    lost = [k for k in ("fused", "capturable") if opt.defaults.get(k) and not group.get(k)]
    if not lost:
        return None
    flag = lost[0]
    return (
        f"{type(opt).__name__} was constructed with {flag}=True, but a loaded state dict "
        "(optimizer.load_state_dict) replaced the group's flags with those of the optimizer "
        f"that saved it: set them in the state dict before loading (for g in "
        f"sd['param_groups']: g[{flag!r}] = True, then optimizer.load_state_dict(sd): it puts "
        f"the step count on the device), or load a checkpoint of a {flag} optimizer."
    )


def _reads_lr_on_host(opt: torch.optim.Optimizer, group: dict) -> bool:
    """Whether one of torch's optimizers reads this param_group's tensor ``lr`` on the host:
    every one of them without ``fused`` or ``capturable`` passes it as a Python scalar
    (``param.add_(grad, alpha=-lr)``: a host sync on a tensor). A custom optimizer may read a
    tensor ``lr`` on the device: not refused here (a host read fails at capture)."""
    return (
        isinstance(group.get("lr"), torch.Tensor)
        and not holds_tensor_lr(group)
        and type(opt).__module__.startswith("torch.optim")
    )


def _lr_fix(opt: torch.optim.Optimizer, group: dict, device: torch.device) -> str:
    name = type(opt).__name__
    floats = "give it a float lr (baked into the graph: keep it constant after capture)"
    if "fused" in group and name in _FUSED_DEVICES:
        devices = _FUSED_DEVICES[name]
        if devices is None or device.type in devices:
            return (
                f"Construct it with torch.optim.{name}(..., fused=True) (tgraph keeps its "
                f"learning rate in a device tensor that schedulers update), or {floats}."
            )
    return f"Use {_ALTERNATIVE} for a scheduled learning rate, or {floats}."


@contextlib.contextmanager
def fused_groups_capturable(optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """During a capture: fused param_groups say ``capturable=True``, so that torch's capture
    health check lets their step be captured (the fused kernels ignore the flag; the module
    docstring). Restored afterwards, also when the capture raises; torch's warning that a
    capturable step runs uncaptured (an emulated capture on a machine with a GPU) is silenced
    for the duration."""
    flipped = [
        g
        for o in optimizers
        for g in o.param_groups
        if g.get("fused") and g.get("capturable", True) is False
    ]
    for g in flipped:
        g["capturable"] = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="This instance was constructed with capt")
            yield
    finally:
        for g in flipped:
            g["capturable"] = False


class HostWrites:
    """Before a capture: the host values a captured step must not write; :meth:`check` after it.

    Held: every CPU tensor in the optimizers' state and tensor attributes and among the
    parameters and buffers of ``modules``, when the graph's device is not the CPU (by version
    counter), and every Python number in their param_groups, state
    and attributes (by value, on either backend: a capture runs the Python of the step once, a
    replay never).
    """

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        device: torch.device,
        modules: Iterable[nn.Module] = (),
    ) -> None:
        self._tensors: list[tuple[str, torch.Tensor, int]] = []
        self._numbers: list[tuple[str, dict, str, object]] = []
        host_tensors = device.type != "cpu"
        for m in modules if host_tensors else ():
            for k, t in chain(m._parameters.items(), m._buffers.items()):
                if t is not None and t.device.type == "cpu":
                    self._tensors.append((f"{type(m).__name__}.{k} (a CPU tensor)", t, t._version))
        for opt in optimizers:
            name = type(opt).__name__
            for i, g in enumerate(opt.param_groups):
                for k, v in g.items():  # a Python step count in the group (apex's
                    if _is_number(v):  # FusedAdam without capturable keeps one there)
                        where = f"{name} param_group {i}: {k!r} (a Python {type(v).__name__})"
                        self._numbers.append((where, g, k, v))
                for j, p in enumerate(g["params"]):
                    for k, v in opt.state.get(p, {}).items():
                        where = f"{name} param_group {i} parameter {j}: state[{k!r}]"
                        if isinstance(v, torch.Tensor):
                            if host_tensors and v.device.type == "cpu":
                                self._tensors.append((f"{where} (a CPU tensor)", v, v._version))
                        elif _is_number(v):
                            st = opt.state[p]
                            self._numbers.append(
                                (f"{where} (a Python {type(v).__name__})", st, k, v)
                            )
            attributes = vars(opt)
            for k, v in attributes.items():
                if host_tensors and isinstance(v, torch.Tensor) and v.device.type == "cpu":
                    self._tensors.append((f"{name}.{k} (a CPU tensor)", v, v._version))
                elif _is_number(v):
                    self._numbers.append(
                        (f"{name}.{k} (a Python {type(v).__name__})", attributes, k, v)
                    )

    def check(self) -> None:
        """After the capture: refuse a held value the captured step wrote.

        Raises:
            CaptureError: naming the first value written and the fix.
        """
        for where, t, version in self._tensors:
            if t._version != version:
                self._refuse(where)
        for where, st, k, v in self._numbers:
            if st.get(k, v) is not v and st.get(k, v) != v:
                self._refuse(where)

    @staticmethod
    def _refuse(where: str) -> None:
        raise CaptureError(
            f"{where} was written inside the captured step: it lives on the host, which a graph "
            "never replays, so it would keep its capture-time value. Keep such state in tensors "
            "on the graph's device (for an optimizer: " + _ALTERNATIVE + ")."
        )


class HostSettings(NamedTuple):
    """Attributes of an object besides the optimizers whose values a captured step reads on the
    host, so that the graph keeps them (:class:`BakedNumbers` compares them before each
    replay): an :class:`tgraph.OptimizerGraph`'s clipping, a ``GradScaler``'s growth and
    backoff (:func:`grad_scaler_settings`)."""

    owner: object
    names: tuple[str, ...]  # attribute names (a leading underscore is dropped in messages)
    how: str  # how the step reads them: "a number the captured clipping reads"


def grad_scaler_settings(scaler: torch.amp.GradScaler) -> HostSettings:
    """The numbers ``scaler.update()`` passes to ``torch._amp_update_scale_`` as host arguments
    (growth factor, backoff factor, growth interval): ``set_growth_factor`` and the other
    setters, or ``load_state_dict``, change them after a capture that baked them."""
    return HostSettings(
        scaler,
        ("_growth_factor", "_backoff_factor", "_growth_interval"),
        "a host number scaler.update() passes to torch._amp_update_scale_",
    )


class BakedNumbers:
    """The Python numbers a captured step read on the host, which the graph keeps at their
    capture-time value: the optimizers' own numeric attributes (a custom optimizer's
    ``self.lr``) and the ``settings`` of other objects (:class:`HostSettings`). A change after
    capture (a schedule assigning ``opt.lr``, ``scaler.set_growth_factor(4.0)``) is named by
    :meth:`change` before the next replay, and the entry captures the step again. (Learning
    rates in param_groups are :class:`tgraph.step.hyperparams.HyperParams`'.)"""

    __slots__ = ("_held", "_scalers_at")

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        settings: Sequence[HostSettings] = (),
        new_scalers: bool = False,
    ) -> None:
        # new_scalers: a GradScaler made after capture is a change too (a whole step that
        # reaches its scaler through a container, st["scaler"] = GradScaler(...), would replay
        # the captured scaler's scale and growth tracker, never touching the new one's)
        self._scalers_at = scalers_made() if new_scalers else None
        self._held = [
            (vars(o), k, v, f"{type(o).__name__}.{k}", "a Python number its step reads")
            for o in optimizers
            for k, v in vars(o).items()
            if _is_number(v)
        ]
        for s in settings:
            attributes, owner = vars(s.owner), type(s.owner).__name__
            self._held += [
                (attributes, k, attributes.get(k), f"{owner}.{k.lstrip('_')}", s.how)
                for k in s.names
            ]

    def change(self) -> str | None:
        """What changed since the capture, or None."""
        if self._scalers_at is not None and _scalers_made[0] != self._scalers_at:
            return (
                "a torch.amp.GradScaler was created after capture; the step may now use it, "
                "where the graph updates the captured scaler's scale"
            )
        for attributes, k, v, name, how in self._held:
            now = attributes.get(k)
            if now is not v and now != v:
                return (
                    f"{name} changed from {v!r} to {now!r} after capture ({how}, which the "
                    "graph keeps)"
                )
        return None


_scalers_made = [0]  # torch.amp.GradScaler constructions since scalers_made() first ran


def scalers_made() -> int:
    """How many ``torch.amp.GradScaler`` (and subclasses: ``torch.cuda.amp``'s) were made since
    the first call; the first call starts counting (wraps the class's ``__init__``, once)."""
    cls = torch.amp.GradScaler
    init = cls.__init__
    if not getattr(init, "_tgraph_counts", False):

        @functools.wraps(init)
        def counted(self, *args, **kwargs):
            _scalers_made[0] += 1
            init(self, *args, **kwargs)

        counted._tgraph_counts = True
        cls.__init__ = counted
    return _scalers_made[0]


def _is_number(v: object) -> bool:
    return isinstance(v, numbers.Number) and not isinstance(v, bool)


__all__ = [
    "BakedNumbers",
    "HostSettings",
    "HostWrites",
    "check_graphable_optimizer",
    "fused_groups_capturable",
    "grad_scaler_settings",
    "host_state",
]
