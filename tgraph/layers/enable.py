"""Turning per-layer graphs on and off: :func:`enable`, :func:`disable`,
:func:`reset_layer_graphs`, and whether they are on (:func:`is_enabled`,
:func:`layer_graphs_enabled`).

:func:`enable` gives every :class:`tgraph.layers.manager.GraphableModule` of a model its
per-module state (its options and where its parameters and ``training`` flags are read), which
the call path in :mod:`tgraph.layers.manager` reads at every call; :func:`reset_layer_graphs`
drops the per-layer graphs and the record of the process, so that enabled modules record again
(``create_graphs``, which creates their graphs, is in :mod:`tgraph.layers.create`).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from tgraph.backend import check_backend_name
from tgraph.baked import watch_module_writes
from tgraph.layers.direct_grads import DirectGrads, observe_backwards
from tgraph.layers.manager import GraphableModule, _manager, _ModuleState, _param_slots
from tgraph.layers.runner import compile_options_of, compiled_call, warn_skipped_call


def enable(
    model: nn.Module,
    backend: str = "auto",
    *,
    strict: bool = False,
    warmup_steps: int | None = None,
    debug: bool = False,
    merge: bool = True,
    main_grad_fusion: bool = False,
    capturable_hooks: bool = False,
    compile: bool | dict[str, Any] = False,  # noqa: A002 - the option's name, as torch.compile
    direct_grads: bool | None = None,
) -> nn.Module:
    """Turn on per-layer graphs for every :class:`GraphableModule` in ``model``.

    Args:
        model: any module (a DDP wrapper too); its ``GraphableModule`` descendants get graphed.
        backend: ``"auto"``, ``"cuda"`` or ``"emulated"`` (``TGRAPH_BACKEND`` overrides auto).
        strict: raise instead of falling back to eager when a call matches no captured graph.
        warmup_steps: eager warmup passes before each capture (default 2 on CUDA, 1 emulated),
            the option's name in :class:`FullIterationGraph` and :class:`OptimizerGraph` too.
        debug: poison static buffers with NaN after each backward replay, so a stale read shows
            up as NaN instead of plausible numbers.
        merge: capture a stack of graphed modules called back to back (each taking the previous
            one's output, backed through in reverse order) as one forward and one backward
            graph (:mod:`tgraph.layers.segment`); False graphs every call on its own.
        main_grad_fusion: add parameter gradients into ``param.main_grad`` inside the backward
            graph instead of handing them to autograd (no AccumulateGrad, no gradient hooks
            for those parameters; ``.grad`` stays None). Only for gradients consumed through
            ``main_grad`` by hooks that do nothing else: megatron-core DDP without
            ``overlap_grad_reduce`` (:class:`tgraph.layers.grads.MainGradFusion`).
        capturable_hooks: capture the hooks on graphed modules and their submodules as part
            of the graph (pure tensor code, e.g. old-style ``weight_norm``'s pre-hook: its
            effect replays, its Python does not). By default ``create_graphs()`` refuses
            graphed modules with hooks, naming each one.
        compile: graph each module's call compiled by ``torch.compile`` (inductor's fused
            kernels, then one graph replay per layer stack): True for the default options, or
            a dict of ``torch.compile`` keyword arguments. The recorded iteration compiles
            (once per layer class: identical layers share the compiled code), capture graphs
            the compiled kernels, eager fallbacks run them too. The warmup runs at least two
            passes: the first eagerly (dynamo does not run under its host-sync check, a
            dispatch mode), the next compiled, where dynamo compiles once more for the graphs'
            parameter aliases, so that nothing compiles inside the capture. Modes
            that put inductor's own CUDA graphs inside ours (``"reduce-overhead"``,
            ``"max-autotune"``) are refused: use ``"max-autotune-no-cudagraphs"``.
        direct_grads: whether the graphed node writes parameter gradients to ``.grad``
            itself (set where None, added in place otherwise, a hook registered since the
            forward run as AccumulateGrad runs it) instead of taking every parameter as an
            autograd input and handing autograd their gradients, whose engine runs one
            AccumulateGrad node per parameter: together the largest host cost of a host-bound
            step's graphed calls. None (the default): wherever it is exact, that is without
            torch.distributed (DDP, FSDP and megatron-core hook the gradient accumulators) and
            outside torch.func transforms; a unit finding either at a forward goes back to
            autograd's path. True: refuse those with an error. False: never.
            ``backward(inputs=...)`` and ``torch.autograd.grad`` get eager's gradients either
            way. Parameters with tensor hooks, subclassed ones and units of mixed-dtype
            parameters keep autograd's path. Hooks registered on a parameter's AccumulateGrad
            node itself (not on the tensor) do not run for a parameter written directly: pass
            False for them (:class:`tgraph.layers.direct_grads.DirectGrads`).

    Returns:
        ``model`` (unchanged apart from the flag on its graphable modules).

    Raises:
        ValueError: no ``GraphableModule`` in ``model``, an unknown backend, a compile mode
            with CUDA graphs of its own, or ``direct_grads=True`` with torch.distributed
            initialized.
        RuntimeError: graphs already exist (call :func:`reset` first).
    """
    compile_options = compile_options_of(compile)
    check_backend_name(backend)
    if direct_grads:
        DirectGrads.refuse_distributed()
    if _manager.captured:
        raise RuntimeError(
            "tgraph.enable() after tgraph.create_graphs(); call tgraph.reset() first"
        )
    watch_module_writes()  # the module epoch the replay checks read (tgraph.baked)
    found = [m for m in model.modules() if isinstance(m, GraphableModule)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} contains no tgraph.GraphableModule; make the blocks to graph "
            "subclass tgraph.GraphableModule instead of nn.Module"
        )
    for cls in {type(m) for m in found}:
        warn_skipped_call(cls, GraphableModule)
    qualified = {id(m): n for n, m in model.named_modules()}
    for m in found:
        old = m.__dict__.get("_tgraph")
        named = list(m.named_modules())
        tables, keys = _param_slots(m)
        m._tgraph = _ModuleState(
            backend,
            strict,
            warmup_steps,
            debug,
            merge=merge,
            main_grad_fusion=main_grad_fusion,
            capturable_hooks=capturable_hooks,
            direct_grads=direct_grads,
            param_tables=tables,
            param_keys=keys,
            submodules=tuple(sub for _, sub in named),
            names=[name or type(m).__name__ for name, _ in named],
            compiled=compiled_call(m, compile_options),
            name=qualified.get(id(m)) or type(m).__name__,
        )
        if old is not None:  # enabled again: new options, same recorded runners
            m._tgraph.runners = old.runners
            for r in (r for rs in old.runners.values() for r in rs):
                r.merge, r.main_grad_fusion = merge, main_grad_fusion
                r.direct_grads = direct_grads
        _manager.modules.add(m)
    _manager.roots.add(model)
    return model


def disable(model: nn.Module) -> None:
    """Make every graphable module of ``model`` an ordinary eager module again.

    Per-layer graphs and the record are process-wide (one pool, one recorded order), so this
    also drops the per-layer graphs and the record of every other enabled model, as
    :func:`reset_layer_graphs` does; they record again on their next iteration. Whole-step
    graphs (:class:`tgraph.FullIterationGraph`, :class:`tgraph.OptimizerGraph`) are kept.
    """
    reset_layer_graphs()
    for m in model.modules():
        if isinstance(m, GraphableModule) and "_tgraph" in m.__dict__:
            del m.__dict__["_tgraph"]
            _manager.modules.discard(m)
    _manager.roots.discard(model)


def reset_layer_graphs() -> None:
    """Drop the per-layer graphs and the record only; enabled modules run eagerly and record
    again (whole-step graphs are kept)."""
    for seg in _manager.segments:
        seg.drop_graphs()
    _manager.segments = []
    _manager.units = []
    for r in _manager.all_runners():
        r.drop_graphs()
    for mod in _manager.modules:
        mod._tgraph.runners.clear()
        mod._tgraph.turns.clear()
        mod._tgraph.warned.clear()
        mod._tgraph.plain = False
    _manager.record.clear()
    observe_backwards(None)
    _manager.captured = False
    _manager.report = None
    _manager.eager_calls = 0


def layer_graphs_enabled() -> bool:
    """Whether any module of this process has per-layer graphs enabled (:func:`enable`)."""
    return bool(_manager.modules)


def is_enabled(module: nn.Module) -> bool:
    """Whether ``module`` itself (not its submodules) has per-layer graphs enabled."""
    return "_tgraph" in module.__dict__
