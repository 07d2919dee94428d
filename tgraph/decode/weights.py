"""The weights a decode graph baked in, checked before each engine call and followed.

A graph reads the memory each parameter and buffer lived in at capture. A weight sync that
replaces the tensors (``model.load_state_dict(sd, assign=True)``, ``p.data = new``) leaves that
memory behind: without a check the graphs would keep generating the old weights' tokens (and
on CUDA read memory the old tensors no longer own). In-place updates (``copy_``,
``load_state_dict`` without ``assign``) write the captured memory and need nothing.

:class:`BakedWeights` holds the captured memory (aliases, so it outlives a re-pointed tensor)
and, before each call, compares the modules' current tensors with it: one C-level pass over the
modules' parameter and buffer tables (object ids), one over the addresses. A tensor that moved
is followed by a copy into the captured memory before each call, when it has the captured
shape, dtype and device, owns memory of its own, and the captured memory is the engine's alone.
Anything else asks for a re-capture (:meth:`tgraph.decode.DecodeEngine.recapture`), never for a
replay of the old weights: a new shape or dtype, an added parameter, tied weights untied,
weights swapped among themselves, and captured memory still in use elsewhere, which a copy
would overwrite: an EMA swap (``p.data, e.data = e.data, p.data`` hands it to the EMA tensor),
a ``state_dict()`` kept across ``load_state_dict(sd, assign=True)``, the old parameter still
held (the per-layer graphs' rule, :func:`tgraph.layers.follow.follow_moved`). The engine's own
uses of each memory are those its capture added (:func:`tgraph.baked.memory_uses` before it,
:func:`tgraph.baked.own_uses` after), so an alias the user took before the engine was built
counts as someone else's.

The graphs also baked in the module tree, the hooks that ran and the Python attributes the
forwards read (``LayerNorm.eps``). :class:`BakedWeights` keeps the per-layer graphs' inventory of
them (:class:`tgraph.baked.Baked`) and asks for a re-capture when a submodule was replaced
(``model.lm_head = nn.Linear(...)``), a hook added or removed, or an attribute changed. Its
check is gated as :func:`tgraph.layers.replay.check`'s: the hook tables are read only when
torch's hook counter moved (or a hook was present at capture), the attributes and the tree only
when the module epoch moved (a write through ``nn.Module``'s setters to a served module).
PEFT adapter state (disabled, merged, the active adapters and their scales:
:mod:`tgraph.peft_state`), which PEFT writes in place where no epoch sees it, is compared at
every check: ``merge_adapter()``, ``set_scale``, ``set_adapter`` capture again. So are the
configuration values the decoder reads outside the modules (its optional ``config_values()``:
the transformers adapter's ``config.sliding_window``, ``config.layer_types``), which a config
object's plain attribute write changes where no epoch sees it: a few values, compared at every
check.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from itertools import chain
from operator import attrgetter, getitem

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from tgraph.baked import Baked, own_uses, watch_module_writes
from tgraph.baked import _epoch as _module_epoch
from tgraph.peft_state import adapter_state, is_adapter_layer
from tgraph.peft_state import describe as describe_adapter
from tgraph.pool import storage_uses

logger = logging.getLogger(__name__)

_data_ptr = torch.Tensor.data_ptr
_training = attrgetter("training")


def served_modules(*objects: object) -> list[nn.Module]:
    """The modules whose tensors the decode programs read: the model itself when it is a
    module, else the modules among its (and its adapter's) attributes."""
    for obj in objects:
        if isinstance(obj, nn.Module):
            return [obj]
    found = {id(v): v for obj in objects for v in vars(obj).values() if isinstance(v, nn.Module)}
    return list(found.values())


class BakedWeights:
    """The parameters and buffers of ``modules`` as the graphs captured them (module docstring).

    Args:
        modules: the served modules (every submodule's tables are watched).
        uses_before: :func:`tgraph.baked.memory_uses` of ``modules`` before the capture.
        modes: also ask for a re-capture when a module's train/eval mode changed (when the
            engine does not set the mode itself: a decoder without ``serving()``).
        config: the decoder's ``config_values`` (name -> value of each configuration value
            its methods read), compared at every check; None: it reads none.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        uses_before: dict[int, int],
        modes: bool = False,
        config: Callable[[], dict[str, object]] | None = None,
    ) -> None:
        named = {
            id(m): (f"{i}.{name}" if len(modules) > 1 else name, m)
            for i, root in enumerate(modules)
            for name, m in root.named_modules()
        }
        self._tables = [t for _, m in named.values() for t in (m._parameters, m._buffers)]
        self._names = [
            f"{name}.{k}" if name else k
            for name, m in named.values()
            for t in (m._parameters, m._buffers)
            for k in t
        ]
        self._keys = self._table_keys()
        live = self._live()
        # aliases of the captured memory: they keep it when a tensor is re-pointed elsewhere
        self.held = tuple(None if t is None else t.detach() for t in live)
        self._held_ptrs = tuple(None if t is None else _data_ptr(t) for t in live)
        self._remember(live, [])
        watch_module_writes()  # idempotent: the module epoch the check reads
        self.baked = Baked.of([(name, m) for name, m in named.values()], [])
        self._hook_epoch = self.baked.hook_epoch  # scanned as unchanged at this hook epoch
        self._module_epoch = _module_epoch[0]  # ... and at this module epoch
        # PEFT adapter state: written in place (a scaling dict, the merged list), which no
        # epoch sees, so compared at every check (tgraph.peft_state)
        adapters = [(n, m) for n, m in zip(self.baked.dict_names, self.baked.mods)
                    if is_adapter_layer(m)]  # fmt: skip
        self._adapter_names = tuple(n for n, _ in adapters)
        self._adapters = tuple(m for _, m in adapters)
        self._adapter_states = tuple(map(adapter_state, self._adapters))
        self._config = config
        self._config_values = None if config is None else config()  # as the graphs baked them
        # the train/eval mode the graphs ran in (Baked leaves it to the per-layer call key)
        self._training = tuple(map(_training, self.baked.mods)) if modes else None
        # last: every alias the engine keeps (the inventory's too) is made by now
        self._own_uses = own_uses(self.held, uses_before)

    def _table_keys(self) -> tuple:
        return tuple(map(tuple, self._tables))

    def _live(self) -> tuple:
        return tuple(chain.from_iterable(map(dict.values, self._tables)))

    def _remember(self, live: tuple, moved: list[int]) -> None:
        self._ids = tuple(map(id, live))
        self._tensors = tuple(t for t in live if t is not None)
        self._ptrs = tuple(map(_data_ptr, self._tensors))
        self._copy_to = [self.held[i] for i in moved]
        self._copy_from = [live[i] for i in moved]

    def check(self) -> str | None:
        """Before a call: copy moved tensors into the captured memory; None when the graphs
        may replay, else why they must be captured again."""
        why = self._changed_modules()
        if why is not None:
            return why
        live = self._live()
        if tuple(map(id, live)) != self._ids or tuple(map(_data_ptr, self._tensors)) != self._ptrs:
            why = self._follow(live)
            if why is not None:
                return why
        if self._copy_to:
            with torch.no_grad():
                torch._foreach_copy_(self._copy_to, self._copy_from)
        return None

    def _changed_modules(self) -> str | None:
        """Why the module tree, a hook or an attribute differs from the capture's (None: none
        does); the full comparison only off the steady path (as tgraph.layers.replay.check)."""
        b = self.baked
        if self._adapters and tuple(map(adapter_state, self._adapters)) != self._adapter_states:
            return self._changed_adapters()
        if self._config is not None and (now := self._config()) != self._config_values:
            was = self._config_values
            name = next(k for k in (*now, *was) if now.get(k) != was.get(k))
            return (
                f"{name} changed from {was.get(name)!r} to {now.get(name)!r} after capture "
                "(the graphs baked the value in)"
            )
        epoch = RemovableHandle.next_id  # moves whenever a hook is registered anywhere
        if epoch != self._hook_epoch or b.any_hooks:
            why = b.changed_hooks(scan=True)
            if why is not None:
                return why
            self._hook_epoch = epoch
        try:  # the globals the forwards name: no epoch sees them change
            same = tuple(map(getitem, b.global_tables, b.global_keys)) == b.global_values
        except KeyError:
            same = False
        module_epoch = _module_epoch[0]  # moved by nn.Module's setters
        if not same or module_epoch != self._module_epoch:
            why = b.changed_tree() or b.changed_attrs() or self._changed_mode()
            if why is not None:
                return why
            self._module_epoch = module_epoch
        return None

    def _changed_adapters(self) -> str:
        name, was, now = next(
            (n, was, now)
            for n, m, was in zip(self._adapter_names, self._adapters, self._adapter_states)
            if (now := adapter_state(m)) != was
        )
        return (
            f"the PEFT adapters of {name} changed from {describe_adapter(was)} to "
            f"{describe_adapter(now)} after capture (the graphs baked in the disabled/merged "
            "state, the active adapters and their scales)"
        )

    def _changed_mode(self) -> str | None:
        b = self.baked
        if self._training is None or tuple(map(_training, b.mods)) == self._training:
            return None
        name, m = next((n, m) for n, m, t in zip(b.dict_names, b.mods, self._training)
                       if m.training != t)  # fmt: skip
        now, was = ("train", "eval") if m.training else ("eval", "train")
        return (
            f"{name or type(m).__name__} was switched to {now} mode after capture; the graphs "
            f"run it in {was} mode (dropout and other mode-dependent code as captured)"
        )

    def _follow(self, live: tuple) -> str | None:
        """Decide again how each tensor reaches the graphs (only when something moved)."""
        # the tensors of the last check: those that moved no longer keep their old memory's
        # uses (counted below); the next check decides again, as nothing matches ()
        self._tensors = ()
        if self._table_keys() != self._keys:
            return "a parameter or buffer of the model was added or removed after capture"
        held_storages = {
            h.untyped_storage().data_ptr() for h in self.held if h is not None and h.numel()
        }
        moved: list[int] = []
        into: dict[int, int] = {}  # captured address -> the address copied into it
        for i, (name, h, t) in enumerate(zip(self._names, self.held, live, strict=True)):
            if h is None or t is None:
                if h is not t:
                    return f"{name} changed from {_what(h)} to {_what(t)} after capture"
                continue
            if h.numel() == 0 and t.shape == h.shape and t.dtype == h.dtype:
                continue  # nothing the graphs read
            if _data_ptr(t) == self._held_ptrs[i] and t.stride() == h.stride():
                if t.shape == h.shape and t.dtype == h.dtype:
                    continue
            if (t.shape, t.dtype, t.device) != (h.shape, h.dtype, h.device):
                return (
                    f"{name} was replaced by a tensor of {_what(t)} after capture "
                    f"(the graphs read {_what(h)})"
                )
            if t.numel() and t.untyped_storage().data_ptr() in held_storages:
                return f"{name} now lives in memory the graphs read for another tensor or layout"
            if into.setdefault(self._held_ptrs[i], _data_ptr(t)) != _data_ptr(t):
                return f"{name} was tied to another tensor at capture and is not any more"
            if storage_uses(h) > self._own_uses[i]:
                return (
                    f"{name} lives in other memory than at capture, and the memory the graphs "
                    "read is in use elsewhere, so a copy into it would overwrite another "
                    "tensor (an EMA swap, a state_dict() or an old parameter still held)"
                )
            moved.append(i)
        if moved:
            logger.info(
                "DecodeEngine: following %d parameter(s)/buffer(s) replaced after capture "
                "(e.g. %s) by a copy into the graphs' memory before each call; "
                "engine.recapture() graphs the new tensors without the copy",
                len(moved),
                self._names[moved[0]],
            )
        self._remember(live, moved)
        return None


def _what(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)} {t.dtype} {t.device}"


__all__ = ["BakedWeights", "served_modules"]
