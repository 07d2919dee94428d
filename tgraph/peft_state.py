"""The state of a PEFT tuner layer (a LoRA ``Linear``) that a graph bakes in, duck-typed: no
import of peft.

A LoRA layer's forward branches on whether its adapters are disabled or merged, on which ones
are active and multiplies by their ``scaling``: Python values a graph keeps as they were at
capture. PEFT changes them in place (``set_scale``, ``scale_layer`` and ``merge_adapter`` write
into the layer's ``scaling`` dict and ``merged_adapters`` list; ``set_adapter`` stores a list),
where no module setter sees it. Per-layer training graphs put :func:`adapter_state` in each
decoder layer's call key (:mod:`tgraph.integrations.transformers`); decode graphs compare it
before each engine call (:class:`tgraph.decode.weights.BakedWeights`).
"""

from __future__ import annotations

import torch.nn as nn

AdapterState = tuple  # (disabled, merged, active adapter names, their scales)


def is_adapter_layer(m: nn.Module) -> bool:
    """A PEFT tuner layer (the properties of peft's ``BaseTunerLayer`` and the attributes
    behind them, which :func:`adapter_state` reads)."""
    cls = type(m)
    return all(
        isinstance(getattr(cls, a, None), property)
        for a in ("disable_adapters", "merged", "active_adapters")
    ) and all(hasattr(m, a) for a in ("_active_adapter", "_disable_adapters", "merged_adapters"))


def adapter_state(a: nn.Module) -> AdapterState:
    """One PEFT tuner layer's state: (disabled, merged, active adapters, their scales).

    Reads the attributes behind PEFT's properties (``BaseTunerLayer``): this runs at every call
    of every decoder layer, and the properties cost microseconds each.
    """
    active, scaling = a._active_adapter, a.__dict__.get("scaling") or {}
    if isinstance(active, str):  # the common case, without a generator
        active, scales = (active,), (scaling.get(active, 1),)
    else:
        active = tuple(active)
        scales = tuple(scaling.get(n, 1) for n in active)
    return (a._disable_adapters, bool(a.merged_adapters), active, scales)


def describe(state: AdapterState) -> str:
    """``state`` for a message: ``"disabled"`` or ``"default*2.0"`` (``" merged"`` added)."""
    disabled, merged, active, scales = state
    if disabled:
        return "disabled"
    return ",".join(f"{n}*{s}" for n, s in zip(active, scales)) + (" merged" if merged else "")


__all__ = ["AdapterState", "adapter_state", "describe", "is_adapter_layer"]
