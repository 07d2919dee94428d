"""A captured unit's capture result is never changed: replays change only its replay state.

Every field of each unit's capture result (:class:`tgraph.layers.captured.Captured`), and every
attribute of its parts (the gradient packing and plumbing, the baked inventory, the memory
accounting), keeps its identity and its value over training steps that replay the graphs,
accumulate gradients (the gradient buffers' aliases are moved out at every replay) and
evaluate.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from layer_models import gpt_batches, tiny_gpt

import tgraph
from tgraph.layers.grads import GradHandOff

_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)
_PARTS = ("param_out", "fusion", "direct", "flags", "unused", "baked", "memory", "fp8")


def _value(v):
    """What of ``v`` must not change: scalars by value, tensors by memory and shape (a
    replay writes their values), containers by their members' identities."""
    if isinstance(v, _SCALARS):
        return v
    if isinstance(v, torch.Tensor):
        return (v.data_ptr(), tuple(v.shape), tuple(v.stride()))
    if isinstance(v, (list, tuple)):
        return tuple(x if isinstance(x, _SCALARS) else id(x) for x in v)
    if isinstance(v, dict):
        return tuple((k, id(x)) for k, x in v.items())
    if isinstance(v, (set, frozenset)):
        return frozenset(v)
    return None  # identity alone


def _attributes(obj) -> dict:
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    elif hasattr(obj, "__dict__"):
        names = list(vars(obj))
    else:
        names = [n for c in type(obj).__mro__ for n in getattr(c, "__slots__", ())]
    return {n: (id(getattr(obj, n)), _value(getattr(obj, n))) for n in names if hasattr(obj, n)}


def _snapshot(units) -> list:
    """Per unit: its capture result's identity and fields, and each frozen part's attributes."""
    out = []
    for u in units:
        cap = u.cap
        parts = {p: _attributes(getattr(cap, p)) for p in _PARTS if getattr(cap, p) is not None}
        out.append((id(u.cap), [id(r.cap) for r in u.members], _attributes(cap), parts))
    return out


def _train(model, batches, accumulate: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(0, len(batches), accumulate):
        for x, y in batches[step : step + accumulate]:
            model(x, y)[1].backward()  # the second microbatch adds to .grad: held views
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            model(*batches[0])


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_layer"])
def test_replays_never_change_the_capture_result(backend, device, merge):
    model = tiny_gpt(device)
    tgraph.enable(model, backend=backend, merge=merge, strict=True)
    batches = gpt_batches(device, 6)
    model(*batches[0])[1].backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # an evaluation call is recorded too
        model(*batches[0])
    tgraph.create_graphs()
    units = tgraph.layers.manager._manager.units
    assert units and all(u.draft is None for u in units)  # bake dropped the capture's draft
    before = _snapshot(units)
    _train(model, batches, accumulate=2)
    assert _snapshot(units) == before


def test_a_replay_that_changes_the_capture_result_is_caught(backend, device, monkeypatch):
    """Planted: the hand-off's rescue (at every replay while gradients are held) re-plans the
    gradient outputs it reads, as the packing did when it held its own replay-time views."""
    rescue = GradHandOff.rescue

    def rescue_and_replan(self):
        self.plan._index = list(self.plan._index)
        return rescue(self)

    model = tiny_gpt(device)
    tgraph.enable(model, backend=backend, strict=True)
    batches = gpt_batches(device, 4)
    model(*batches[0])[1].backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():  # an evaluation call is recorded too
        model(*batches[0])
    tgraph.create_graphs()
    units = tgraph.layers.manager._manager.units
    assert any(u.cap.param_out.present for u in units)
    before = _snapshot(units)
    monkeypatch.setattr(GradHandOff, "rescue", rescue_and_replan)
    _train(model, batches, accumulate=2)
    assert _snapshot(units) != before
