"""Replays in an order other than the recorded one (tgraph/pool.py).

Graphs share one memory pool, which is safe only for replays in the recorded order. Every other
order is either safe by the pool rule or detected: an unsafe forward runs eagerly (warning;
``strict=True`` raises), a backward that overwrites a nested unit's saved activations makes that
unit's backward raise. On the emulated backend, the pool model poisons what a GPU replay may
overwrite, so the planted bug (no check) gives NaN gradients on the CPU too.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL

import tgraph
from tgraph.pool import PoolLedger


class MLP(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def three_models(device):
    torch.manual_seed(0)
    models = [MLP().to(device) for _ in range(3)]
    return models, [copy.deepcopy(m) for m in models]


def inputs(device, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 32, generator=g).to(device) for _ in range(n)]


def record_in_order(models, backend, device, **options):
    """Recorded iteration: fwd 1, bwd 1, fwd 2, bwd 2, fwd 3, bwd 3."""
    for m in models:
        tgraph.enable(m, backend=backend, **options)
    for m, x in zip(models, inputs(device, seed=7)):
        m(x).square().mean().backward()
    for m in models:
        m.zero_grad(set_to_none=True)
    tgraph.create_graphs()


def all_forwards_then_backwards(models, xs):
    """fwd 1, fwd 2, fwd 3, then bwd 1, bwd 2, bwd 3."""
    outs = [m(x) for m, x in zip(models, xs)]
    for y in outs:
        y.square().mean().backward()
    return [y.detach().clone() for y in outs]


def check_grads(models, eager):
    for m, e in zip(models, eager):
        for (name, p), q in zip(m.named_parameters(), e.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


def test_forwards_out_of_recorded_order_run_eagerly_and_stay_exact(backend, device):
    models, eager = three_models(device)
    record_in_order(models, backend, device)
    xs = inputs(device)
    with pytest.warns(tgraph.GraphFallbackWarning, match="replay order differs"):
        got = all_forwards_then_backwards(models, xs)
    want = all_forwards_then_backwards(eager, xs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    check_grads(models, eager)
    for m in models + eager:
        m.zero_grad(set_to_none=True)
    for m, x in zip(models, xs):  # the recorded order still replays the graphs, exactly
        m(x).square().mean().backward()
    for m, x in zip(eager, xs):
        m(x).square().mean().backward()
    check_grads(models, eager)


def test_forwards_out_of_recorded_order_raise_under_strict(backend, device):
    models, _ = three_models(device)
    record_in_order(models, backend, device, strict=True)
    with pytest.raises(RuntimeError, match="replay order differs"):
        all_forwards_then_backwards(models, inputs(device))


def test_planted_bug_no_order_check_gives_wrong_gradients_on_cpu(monkeypatch):
    """Without the checks, the emulated pool overwrites the saved activations of model 1 (as a
    GPU does: 0.34 off on the H200), so the CPU suite sees the corruption."""
    models, eager = three_models("cpu")
    record_in_order(models, "emulated", "cpu")
    monkeypatch.setattr(PoolLedger, "unsafe_forward", lambda self, owner, index: None)
    monkeypatch.setattr(PoolLedger, "before_backward", lambda self, key, owner, name, index: None)
    xs = inputs("cpu")
    all_forwards_then_backwards(models, xs)
    all_forwards_then_backwards(eager, xs)
    with pytest.raises(AssertionError, match=r"net\.\d\.(weight|bias)"):  # msg= names it
        check_grads(models, eager)


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = MLP(), MLP()


def record_nested(backend, device):
    """Recorded: fwd A, fwd B, bwd B, bwd A (one loss over both)."""
    torch.manual_seed(0)
    pair = Pair().to(device)
    eager = copy.deepcopy(pair)
    tgraph.enable(pair, backend=backend, merge=False)
    x1, x2 = inputs(device, 2, seed=3)
    (pair.a(x1).sum() + pair.b(x2).sum()).backward()
    pair.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    return pair, eager


def test_backwards_out_of_nesting_order_raise(backend, device):
    """bwd A before bwd B: A's backward graph was captured after B's and may reuse B's saved
    activations. B's backward must raise instead of returning gradients from garbage."""
    pair, _ = record_nested(backend, device)
    x1, x2 = inputs(device, 2)
    ya, yb = pair.a(x1), pair.b(x2)
    ya.square().sum().backward()
    with pytest.raises(RuntimeError, match="saved activations of .* were overwritten"):
        yb.square().sum().backward()


def test_replay_order_error_is_its_own_class(backend, device):
    """The out-of-order backward raises tgraph.ReplayOrderError, which a caller can catch apart
    from other RuntimeErrors."""
    pair, _ = record_nested(backend, device)
    x1, x2 = inputs(device, 2)
    ya, yb = pair.a(x1), pair.b(x2)
    ya.square().sum().backward()
    with pytest.raises(tgraph.ReplayOrderError, match="were overwritten by the backward graph"):
        yb.square().sum().backward()
    assert issubclass(tgraph.ReplayOrderError, RuntimeError)


def test_backwards_in_nesting_order_replay_exactly(backend, device):
    pair, eager = record_nested(backend, device)
    x1, x2 = inputs(device, 2)
    for m in (pair, eager):
        ya, yb = m.a(x1), m.b(x2)
        yb.square().sum().backward()
        ya.square().sum().backward()
    check_grads([pair], [eager])
    assert tgraph.eager_calls() == 0  # both replayed


@pytest.mark.usefixtures("no_verifier")  # the replays alone: the verifier would catch it
def test_planted_bug_no_backward_check_gives_nan_on_cpu(monkeypatch):
    pair, _ = record_nested("emulated", "cpu")
    monkeypatch.setattr(PoolLedger, "before_backward", lambda self, key, owner, name, index: None)
    x1, x2 = inputs("cpu", 2)
    ya, yb = pair.a(x1), pair.b(x2)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert any(p.grad.isnan().any() for p in pair.b.parameters())


def test_eval_call_inside_a_training_step_runs_eagerly(backend, device):
    """A no-grad call recorded after the training step, made while a training forward awaits
    its backward: its graph was captured where it may reuse that forward's activations."""
    torch.manual_seed(0)
    model = MLP().to(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend)
    x, x_eval = inputs(device, 2)
    model(x).square().mean().backward()
    with torch.no_grad():
        model(x_eval)
    model.zero_grad(set_to_none=True)
    tgraph.create_graphs()

    def step(m):
        y = m(x)
        with torch.no_grad():
            ev = m(x_eval).clone()
        y.square().mean().backward()
        return ev

    with pytest.warns(tgraph.GraphFallbackWarning, match="replay order differs"):
        got = step(model)
    want = step(eager)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    check_grads([model], [eager])


def reversed_order(models, xs):
    """Model 3, then 2, then 1, each forward followed by its backward; outputs kept."""
    outs = {}
    for i in (2, 1, 0):
        outs[i] = models[i](xs[i])
        outs[i].square().mean().backward()
    return [outs[i] for i in range(3)]


def test_outputs_the_caller_keeps_survive_earlier_captured_replays(backend, device):
    """Model 1's graph was captured first, so it may reuse the memory of model 3's outputs:
    outputs still held are moved out of the pool before such a replay."""
    models, eager = three_models(device)
    record_in_order(models, backend, device, strict=True)
    xs = inputs(device)
    got, want = reversed_order(models, xs), reversed_order(eager, xs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    check_grads(models, eager)


def test_planted_bug_kept_outputs_not_rescued_is_caught_on_cpu(monkeypatch):
    from tgraph.pool import LiveOutputs

    monkeypatch.setattr(LiveOutputs, "rescue", lambda self: None)
    models, eager = three_models("cpu")
    record_in_order(models, "emulated", "cpu", strict=True)
    xs = inputs("cpu")
    got = reversed_order(models, xs)
    assert got[2].isnan().all() and not got[0].isnan().any()


def test_the_ledger_forgets_outputs_once_freed(backend, device):
    """Outputs the caller dropped leave the ledger: steady-state training keeps it small (it was
    one entry per step, so every replay's rescue scan grew with the step count)."""
    models, _ = three_models(device)
    record_in_order(models, backend, device, strict=True)
    xs = inputs(device)
    ledger = tgraph.layers.manager._manager.units[0].cap.ledger
    for _ in range(20):
        for m, x in zip(models, xs):
            m(x).square().mean().backward()
    assert len(ledger._held) == 0 and len(ledger._live) == 0
    kept = models[0](xs[0])  # held by the caller, awaiting its backward
    assert len(ledger._held) == 1 and len(ledger._live) == 1
    del kept
    assert len(ledger._held) == 0 and len(ledger._live) == 0
