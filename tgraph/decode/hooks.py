"""The forward hooks on a served model, and which of them the decode engine can honour.

A decode adapter runs a model's parts, not its ``forward`` (the transformers adapter calls each
layer's projections, MLP and norms around its own attention and KV cache; the toy GPT's calls a
block's norms, projections and MLP): a hook on a module whose ``forward`` it never calls (a
decoder layer, its attention, an RMSNorm run as ``F.rms_norm``, the model itself) would never
run, and the tokens would be the unhooked model's. A hook on a module it does call runs at every
eager call; a graph replays kernels, not Python, so under graphs the hook's Python runs at
capture only: state it reads is frozen into the graphs and a hook that records activations
records nothing at replays.

:class:`HookCheck` therefore refuses, naming the module, the hook and the fix:

* a forward or forward-pre hook on a module the adapter never calls (``called_modules()`` of
  the decoder; a decoder without it is taken to call all of its modules), and a global forward
  hook (``register_module_forward_hook``), which runs only around the modules the adapter calls;
* a ``forward`` set on a module instance (not ``torch.compile``'s wrapper, whose forward is the
  module's own code; accelerate's ``add_hook_to_module`` sets one, a
  patch such as ``mlp.forward = steered`` too) as a forward hook of that module: it replaces
  the module's computation where the adapter calls the module, and never runs elsewhere;
* under graphs, any other forward hook, unless the engine was built with
  ``capturable_hooks=True``, which declares them pure tensor code whose effect the graphs keep
  (the per-layer graphs' rule, ``tgraph.enable(capturable_hooks=True)``).

Hooks that do nothing for decode pass: transformers' output-recording hooks (inert unless a
call records attentions), ``enable_input_require_grads``' hook (an autograd flag, moot under
``no_grad``) and tgraph's own ``use_cache`` default (:func:`tgraph.integrations.transformers.
graph_layers`; the engine never passes ``use_cache``). Backward hooks never fire under
``no_grad`` and pass too.

The check runs when the engine is built and before each call. While neither torch's
hook-handle counter (moved by any hook registered anywhere, a tensor's too) nor the module epoch
(a module write: the engine's own train/eval switch) moved, it costs two counter reads; else a
few C-level passes compare the module tree, or the hook tables' keys, with the last clean scan
(each about 30 us for a 32-layer Llama), and only a difference scans the modules again: a hook added,
or a submodule swapped in with hooks of its own (``copy.deepcopy`` copies them without
registering any).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from itertools import repeat
from operator import getitem

import torch.nn as nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from tgraph.baked import _count_writes_to, _inert, _name, _structural, watch_module_writes
from tgraph.baked import _epoch as _module_epoch

_FORWARD_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"))
_GLOBAL_HOOKS = (
    ("_global_forward_pre_hooks", "global forward pre-hook"),
    ("_global_forward_hooks", "global forward hook"),
)


@dataclass(frozen=True)
class _Scanned:
    """The served modules as last found clean: each module's class and submodules, and the
    keys of every forward hook table (torch's handle ids: a hook removed and another added is
    a change), flat, so that each comparison is a few C-level passes (as
    :meth:`tgraph.baked.Baked.same_tree`)."""

    mods: tuple[nn.Module, ...]
    classes: tuple[type, ...]
    sub_tables: tuple[dict, ...]
    sub_sizes: tuple[int, ...]
    sub_slots: tuple[dict, ...]
    sub_keys: tuple[str, ...]
    sub_ids: tuple[int, ...]
    hook_tables: tuple[dict, ...]
    hook_keys: tuple[tuple, ...]
    dicts: tuple[dict, ...]
    forwards: tuple[int, ...]

    @classmethod
    def of(cls, mods: tuple[nn.Module, ...]) -> _Scanned:
        tables = tuple(vars(m)["_modules"] for m in mods)
        subs = [(t, k) for t in tables for k in t]
        hooks = tuple(vars(m)[t] for m in mods for t, _ in _FORWARD_HOOKS)
        hooks += tuple(getattr(nn_module, t) for t, _ in _GLOBAL_HOOKS)
        return cls(
            mods=mods,
            classes=tuple(map(type, mods)),
            sub_tables=tables,
            sub_sizes=tuple(map(len, tables)),
            sub_slots=tuple(t for t, _ in subs),
            sub_keys=tuple(k for _, k in subs),
            sub_ids=tuple(id(t[k]) for t, k in subs),
            hook_tables=hooks,
            hook_keys=tuple(map(tuple, hooks)),
            dicts=tuple(map(vars, mods)),
            forwards=_forwards(map(vars, mods)),
        )

    def same_hooks(self) -> bool:
        return tuple(map(tuple, self.hook_tables)) == self.hook_keys

    def same_tree(self) -> bool:
        try:
            return (
                tuple(map(len, self.sub_tables)) == self.sub_sizes
                and tuple(map(id, map(getitem, self.sub_slots, self.sub_keys))) == self.sub_ids
                and tuple(map(type, self.mods)) == self.classes
                and _forwards(self.dicts) == self.forwards
            )
        except KeyError:
            return False


def _forwards(dicts) -> tuple[int, ...]:
    """The id of each module's instance ``forward`` (that of None where it has none)."""
    return tuple(map(id, map(dict.get, dicts, repeat("forward"))))


class HookCheck:
    """Refuses the hooks a decode engine cannot honour (module docstring).

    Args:
        decoder: the served decoder; its optional ``called_modules()`` names the modules its
            ``prefill``/``decode_step`` call (their forward, hooks and submodules run).
        roots: the served modules (:func:`tgraph.decode.weights.served_modules`).
        graphs: the engine serves through graphs (hooks there run at capture only).
        capturable: ``capturable_hooks=True``: hooks on called modules are captured.
    """

    def __init__(
        self, decoder: object, roots: list[nn.Module], *, graphs: bool, capturable: bool
    ) -> None:
        self.decoder = decoder
        self.roots = roots
        self.graphs = graphs
        self.capturable = capturable
        self._epochs = (-1, -1)  # torch's hook counter and the module epoch when found clean
        self._scanned: _Scanned | None = None
        watch_module_writes()  # idempotent: the module epoch check() reads

    def check(self) -> None:
        """Raise if a hook the engine cannot honour is present (module docstring).

        Raises:
            RuntimeError: naming the module, the hook and the fix.
        """
        epochs = (RemovableHandle.next_id, _module_epoch[0])
        if epochs == self._epochs:
            return  # no hook registered anywhere, no module written since
        hooks, modules = (now != was for now, was in zip(epochs, self._epochs))
        last = self._scanned
        if last is None or (hooks and not last.same_hooks()) or (modules and not last.same_tree()):
            self._scan()
        self._epochs = epochs

    def _scan(self) -> None:
        named = [
            (f"{i}.{n}" if len(self.roots) > 1 and n else n, m)
            for i, root in enumerate(self.roots)
            for n, m in root.named_modules()
        ]
        called = getattr(self.decoder, "called_modules", None)
        run = None if called is None else {id(m) for c in called() for m in c.modules()}
        for name, m in named:
            own = vars(m).get("forward")  # accelerate's add_hook_to_module sets one
            if own is not None and not _compiled(m):
                hf_hook = vars(m).get("_hf_hook")
                kind = "instance forward" + (
                    f" of accelerate's {type(hf_hook).__name__} hook" if hf_hook is not None else ""
                )
                remove = (
                    "accelerate's remove_hook_from_module(module)"
                    if hf_hook is not None
                    else "del module.forward"
                )
                if run is not None and id(m) not in run:
                    raise RuntimeError(_never_runs(name or "the model", kind, own, remove))
                if self.graphs and not self.capturable:
                    raise RuntimeError(_baked(name or "the model", kind, own, remove))
            for table, kind in _FORWARD_HOOKS:
                for fn in vars(m)[table].values():
                    if _inert_for_decode(fn):
                        continue
                    if run is not None and id(m) not in run:
                        raise RuntimeError(_never_runs(name or "the model", kind, fn))
                    if self.graphs and not self.capturable:
                        raise RuntimeError(_baked(name or "the model", kind, fn))
        for table, kind in _GLOBAL_HOOKS:
            for fn in getattr(nn_module, table).values():
                if run is not None:
                    raise RuntimeError(_global(kind, fn))
                if self.graphs and not self.capturable:
                    raise RuntimeError(_baked("every module", kind, fn))
        mods = tuple(m for _, m in named)
        _count_writes_to(mods)  # a write to any of them moves the module epoch
        self._scanned = _Scanned.of(mods)


def _compiled(m: nn.Module) -> bool:
    """``torch.compile(module)``'s wrapper, whose instance ``forward`` is the wrapped module's
    own computation, compiled (served as the module itself, as before the wrapper)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    return dynamo is not None and isinstance(m, dynamo.OptimizedModule)


def _inert_for_decode(fn: object) -> bool:
    """A hook that does nothing for decode (module docstring)."""
    if _inert(fn) or _structural(fn):
        return True
    hf = sys.modules.get("tgraph.integrations.transformers")  # graph_layers' use_cache default
    return hf is not None and getattr(fn, "func", None) is hf._no_cache_by_default


def _never_runs(where: str, kind: str, fn: object, remove: str = "handle.remove()") -> str:
    return (
        f"DecodeEngine: {where} has the {kind} {_name(fn)}, which would never run: the decode "
        "adapter runs that module's parts, never its forward, so the tokens would be the "
        f"unhooked model's. Remove the hook ({remove}), register it on a module the "
        "adapter calls (an mlp, a projection, lm_head), or generate with the model's own "
        "generate()"
    )


def _global(kind: str, fn: object) -> str:
    return (
        f"DecodeEngine: a {kind} {_name(fn)} is registered, which would run only around the "
        "modules the decode adapter calls, never around the layers, attentions or model whose "
        "parts it runs. Remove it while decoding (handle.remove()), or generate with the "
        "model's own generate()"
    )


def _baked(where: str, kind: str, fn: object, remove: str = "handle.remove()") -> str:
    return (
        f"DecodeEngine: {where} has the {kind} {_name(fn)}, which a graph would run at capture "
        "only (a replay runs kernels, not Python: state the hook reads is frozen, a recording "
        f"hook records nothing). Remove it ({remove}), serve with use_graphs=False (hooks run at every "
        "call), or, if it is pure tensor code whose effect belongs in the graphs, pass "
        "capturable_hooks=True to DecodeEngine"
    )


__all__ = ["HookCheck"]
