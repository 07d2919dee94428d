"""Fail closed: module hooks never vanish silently, and outputs never change under the caller.

A graphed module's own forward and forward-pre hooks run eagerly around every call, as in eager
mode. Hooks a graph would bake in (on its submodules, or backward hooks) are refused at
``create_graphs()``, naming each hook, unless declared capturable; such a hook registered after
capture makes the next call fall back (or raise under ``strict``).
Outputs that alias an input, and training outputs the caller keeps across steps, keep their
values. Every graphed run is compared with an eager twin (tests/fail_closed_models.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fail_closed_models import (
    TOL,
    Block,
    D,
    Net,
    assert_same_params,
    batches,
    eager_calls,
    fallback_error,
    fallbacks,
    make_pair,
    train,
)

import tgraph
from tgraph.layers.grads import swaps_storage

STEPS = 4

# -- hooks present at capture ----------------------------------------------------------------


def _register(kind: str, module: nn.Module, calls: list[str]):
    """An activation logger's hook of ``kind`` on ``module``; returns the hook function."""

    def log_activation(mod, args, output):
        calls.append("forward")

    def log_inputs(mod, args):
        calls.append("forward_pre")

    def log_grads(mod, grad_input, grad_output):
        calls.append("backward")

    if kind == "forward":
        module.register_forward_hook(log_activation)
        return log_activation
    if kind == "forward_pre":
        module.register_forward_pre_hook(log_inputs)
        return log_inputs
    module.register_full_backward_hook(log_grads)
    return log_grads


KINDS = ["forward", "forward_pre", "full_backward"]


@pytest.mark.parametrize(
    "kind,where",
    [(k, "submodule") for k in KINDS] + [("full_backward", "module")],
)
def test_hook_present_at_capture_is_refused_naming_it(backend, device, kind, where):
    """A logger's hook on a submodule of a graphed module (or a backward hook on the module)
    would run during warmup and capture and never at replay: under ``strict=True`` create_graphs
    raises, naming the module, the hook and the fix (``capturable_hooks=True``); without it the
    module stays eager, named (test_capture_failure.py)."""
    torch.manual_seed(0)
    model = Net().to(device)
    target = model.blocks[0] if where == "module" else model.blocks[0].fc1
    calls: list[str] = []
    fn = _register(kind, target, calls)
    tgraph.enable(model, backend=backend, strict=True)
    x, y = batches(device, 1)[0]
    F.mse_loss(model(x), y).backward()
    with pytest.raises(tgraph.CaptureError) as info:
        tgraph.create_graphs()
    msg = str(info.value)
    assert fn.__name__ in msg, msg
    assert "capturable_hooks" in msg, msg
    if where == "submodule":
        assert "fc1" in msg, msg
    else:
        assert "Block" in msg or "blocks.0" in msg, msg


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_hooks_of_the_graphed_module_itself_run_at_every_call(backend, device, kind):
    """An activation logger on the graphed module itself runs eagerly around each call, graphed
    or not, exactly as often as in eager mode and on the same values."""
    model, ref = make_pair(device)
    data = batches(device, STEPS)
    want_calls: list[str] = []
    got_calls: list[str] = []
    _register(kind, ref.blocks[0], want_calls)
    _register(kind, model.blocks[0], got_calls)
    want = train(ref, data)
    with fallbacks() as msgs:
        got = train(model, data, backend)
    assert not msgs, msgs
    torch.testing.assert_close(got, want, **TOL)
    assert got_calls == want_calls


def scale_weight(module, args):
    """Old-style ``weight_norm``: weight = g * v / ||v||, recomputed before every forward."""
    v = module.weight_v
    module.weight = v * (module.weight_g / v.norm(dim=1, keepdim=True))


class WeightNormBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        w = self.fc1.weight.detach()
        del self.fc1.weight
        self.fc1.weight_g = nn.Parameter(w.norm(dim=1, keepdim=True))
        self.fc1.weight_v = nn.Parameter(w.clone())
        self.fc1.register_forward_pre_hook(scale_weight)
        scale_weight(self.fc1, ())


def test_capturable_hooks_are_captured(backend, device):
    """``enable(model, capturable_hooks=True)``: a pure-tensor pre-hook (weight norm) is part of
    the graph; training equals eager. (Built twice from one seed: a module holding a computed
    weight cannot be deep-copied.)"""
    torch.manual_seed(0)
    model = Net(WeightNormBlock).to(device)
    torch.manual_seed(0)
    ref = Net(WeightNormBlock).to(device)
    data = batches(device, STEPS)
    want = train(ref, data)
    with fallbacks() as msgs:
        got = train(model, data, backend, capturable_hooks=True)
    assert not msgs, msgs
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)


def _hook_after_capture(kind):
    calls: list[str] = []
    names: list[str] = []

    def before(i, model, opt):
        if i == 2:  # on a submodule: the graph would never run it
            names.append(_register(kind, model.blocks[1].fc1, calls).__name__)

    return before, calls, names


@pytest.mark.parametrize("kind", KINDS)
def test_hook_registered_after_capture_falls_back_naming_it(backend, device, kind):
    """A hook registered after capture: the next calls run eagerly (so the hook runs exactly as
    often as in eager) with a GraphFallbackWarning naming the hook."""
    model, ref = make_pair(device)
    data = batches(device, STEPS + 1)
    before, want_calls, _ = _hook_after_capture(kind)
    want = train(ref, data, before=before)
    before, got_calls, names = _hook_after_capture(kind)
    with fallbacks() as msgs:
        got = train(model, data, backend, before=before)
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)
    assert got_calls == want_calls
    assert any(names[0] in m for m in msgs), msgs


@pytest.mark.parametrize("kind", KINDS)
def test_hook_registered_after_capture_raises_under_strict(backend, device, kind):
    model, _ = make_pair(device)
    before, _, names = _hook_after_capture(kind)
    with pytest.raises(RuntimeError) as info:
        train(model, batches(device, STEPS), backend, before=before, strict=True)
    assert isinstance(info.value, fallback_error()), info.value
    assert names[0] in str(info.value)


# -- outputs aliasing an input, and outputs kept across calls ---------------------------------


class PassThrough(tgraph.GraphableModule):
    """Returns its input (or a view of it) beside its result, as skip connections do."""

    def __init__(self, view: bool) -> None:
        super().__init__()
        self.view = view
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return (x[1:] if self.view else x), torch.tanh(self.fc(x))


def _keep_inputs_run(model, data, backend=None, *, grad: bool):
    torch.manual_seed(1234)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if backend is not None:
        tgraph.enable(model, backend=backend)
    kept = []
    for i, (x, y) in enumerate(data):
        with torch.set_grad_enabled(grad):
            skip, f = model(x)
        if grad:
            F.mse_loss(f.sum(-1, keepdim=True), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        kept.append((skip, f.detach() if grad else f))  # held across the next calls
        if backend is not None and i == 0:
            tgraph.create_graphs()
    return [torch.stack([k[j] for k in kept]) for j in (0, 1)]


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no_grad"])
@pytest.mark.parametrize("view", [False, True], ids=["input", "view"])
def test_output_aliasing_the_input_keeps_its_value(backend, device, view, grad):
    """``return x, f(x)`` (or ``x[1:]``): the caller keeps both across the next calls, which
    must not overwrite them (the input one is the static input buffer a replay refills)."""
    torch.manual_seed(0)
    model = PassThrough(view).to(device)
    ref = PassThrough(view).to(device)
    ref.load_state_dict(model.state_dict())
    data = batches(device, STEPS)
    want = _keep_inputs_run(ref, data, grad=grad)
    got = _keep_inputs_run(model, data, backend, grad=grad)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    # Training calls replay (kept outputs are moved out of the graph's memory, which needs
    # PyTorch >= 2.13); without grad the kept outputs hold the unit (hold_while_alive): the
    # first call after capture replays, the later ones run eagerly, saying so.
    if not grad:
        assert eager_calls() == STEPS - 2
    elif swaps_storage():
        assert eager_calls() == 0


class FeatureNet(Net):
    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h), h


def _bank_run(model, data, backend=None, *, how: str):
    torch.manual_seed(1234)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if backend is not None:
        tgraph.enable(model, backend=backend)
    bank = []
    for i, (x, y) in enumerate(data):
        pred, feat = model(x)
        F.mse_loss(pred, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        bank.append(feat.detach() if how == "detach" else feat[:, 0])  # a feature bank
        if backend is not None and i == 0:
            tgraph.create_graphs()
    return torch.stack([b.detach() for b in bank])


@pytest.mark.parametrize("how", ["detach", "view"])
def test_training_output_kept_across_steps(backend, device, how):
    """``bank.append(feat.detach())`` (or ``feat[:, 0]``) every step: the bank equals eager's;
    the graph's next replay must not overwrite what the caller still holds."""
    model, ref = make_pair(device, FeatureNet)
    data = batches(device, STEPS)
    want = _bank_run(ref, data, how=how)
    got = _bank_run(model, data, backend, how=how)
    torch.testing.assert_close(got, want, **TOL)
    if swaps_storage():  # replayed, the kept outputs moved out of the graph's memory
        assert eager_calls() == 0


def test_held_outputs_are_protected_without_storage_swaps(backend, device, monkeypatch):
    """On a PyTorch without ``UntypedStorage._swap_data_ptr_`` (< 2.13): outputs the caller
    holds across calls (the previous step's tensor, still in the loop variable) are moved out
    by re-pointing the returned tensors; a ``.detach()`` kept of them falls back, saying so."""
    monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", None, raising=False)
    model, ref = make_pair(device)
    data = batches(device, STEPS)
    want = [ref(x).detach().clone() for x, _ in data]
    tgraph.enable(model, backend=backend, strict=True)
    kept = []
    for i, (x, _) in enumerate(data):
        out = model(x)  # the previous `out` is still alive during this call
        out.sum().backward()
        kept.append(out)
        if i == 0:
            tgraph.create_graphs()
    for got, w in zip(kept, want, strict=True):
        torch.testing.assert_close(got.detach(), w, **TOL)

    def blocks(x):
        h = model.inp(x)
        for b in model.blocks:
            h = b(h)
        return h

    out = blocks(data[0][0])
    out.sum().backward()
    held = out.detach()  # a view of the graph's memory, invisible to tgraph
    del out
    with pytest.raises(RuntimeError, match="still held"):
        blocks(data[1][0])
    del held


def test_hooks_registered_elsewhere_every_step_keep_graphs(backend, device):
    """A tensor hook registered anywhere at every step moves torch's hook counter: the graphed
    modules' hook tables are then scanned, found unchanged, and the graphs keep replaying."""
    model, ref = make_pair(device)
    data = batches(device, STEPS)

    def before(i, model, opt):
        model.head.weight.register_hook(lambda g: g)  # identity: the numbers stay eager's

    want = train(ref, data, before=before)
    got = train(model, data, backend, before=before, strict=True)
    torch.testing.assert_close(got, want, **TOL)
