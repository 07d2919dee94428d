"""Plausible user code around per-layer graphs: each case equals eager or fails clearly.

Found by review (each was a silent wrong result or a crash before its fix).
"""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL

import tgraph


def _grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _check_steps(net, ref, inputs, steps=3):
    for _ in range(steps):
        a, b = net(*inputs), ref(*inputs)
        a.backward()
        b.backward()
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        got, want = _grads(net), _grads(ref)
        assert got.keys() == want.keys()
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=ATOL, msg=n)
        net.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)


class Stem(tgraph.GraphableModule):  # no parameters: its calls have no backward
    def forward(self, x):
        return torch.tanh(x) * 2


class Lin(tgraph.GraphableModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h):
        return torch.relu(self.lin(h))  # relu saves its output for backward


def test_producer_without_backward_replayed_before_consumer_backward(backend, device):
    """z = blk(stem(x)); t = stem(y): stem's second replay must not change blk's saved input."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.blk = Stem(), Lin()

        def forward(self, x, y):
            return ((self.blk(self.stem(x)) - self.stem(y)) ** 2).mean()

    torch.manual_seed(0)
    net = Net().to(device)
    ref = copy.deepcopy(net)
    x, y = torch.randn(2, 4, 8, device=device)
    tgraph.enable(net, backend=backend, strict=True)
    net(x, y).backward()
    net.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    _check_steps(net, ref, (x, y))


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per-layer"])
def test_layers_saving_their_outputs_capture_and_match(backend, device, merge):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Lin() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.pow(2).mean()

    torch.manual_seed(0)
    net = Net().to(device)
    ref = copy.deepcopy(net)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    tgraph.enable(net, backend=backend, strict=True, merge=merge)
    net(x).backward()
    net.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    _check_steps(net, ref, (x,))


def test_nested_graphable_modules_are_part_of_the_outer_graph(backend, device):
    class Inner(tgraph.GraphableModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, h):
            return torch.tanh(self.lin(h))

    class Outer(tgraph.GraphableModule):
        def __init__(self):
            super().__init__()
            self.inner, self.norm = Inner(), nn.LayerNorm(8)

        def forward(self, h):
            return h + self.inner(self.norm(h))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.block = nn.Linear(8, 8), Outer()

        def forward(self, x):
            return self.block(self.inp(x)).pow(2).mean()

    torch.manual_seed(0)
    net = Net().to(device)
    ref = copy.deepcopy(net)
    x = torch.randn(4, 8, device=device)
    tgraph.enable(net, backend=backend, strict=True)
    net(x).backward()
    net.zero_grad(set_to_none=True)
    report = tgraph.create_graphs()
    assert report.runners == 1 and not net.block.inner._tgraph.runners
    _check_steps(net, ref, (x,))


def test_unfreezing_a_parameter_after_capture_is_not_silently_ignored(backend, device):
    torch.manual_seed(0)
    layer = Lin().to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    layer.lin.weight.requires_grad_(False)
    tgraph.enable(layer, backend=backend)
    layer(x).sum().backward()
    tgraph.create_graphs()
    layer.lin.weight.requires_grad_(True)
    with pytest.warns(
        tgraph.GraphFallbackWarning, match="requires_grad of the module's parameters"
    ):
        layer(x).sum().backward()
    assert layer.lin.weight.grad is not None


Pair = collections.namedtuple("Pair", "h aux")


class Structured(tgraph.GraphableModule):
    def __init__(self, kind):
        super().__init__()
        self.kind, self.lin = kind, nn.Linear(8, 8)

    def forward(self, h):
        y = self.lin(h)
        if self.kind == "namedtuple":
            return Pair(y, y.sum())
        return collections.OrderedDict(h=y, aux=y.sum())


@pytest.mark.parametrize("kind", ["namedtuple", "ordereddict"])
def test_structured_outputs_keep_their_type(backend, device, kind):
    torch.manual_seed(0)
    mod = Structured(kind).to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    tgraph.enable(mod, backend=backend, strict=True)
    out = mod(x)
    assert type(out) is (Pair if kind == "namedtuple" else collections.OrderedDict)
    (out[1] if kind == "namedtuple" else out["aux"]).backward()
    tgraph.create_graphs()
    out = mod(x)
    assert type(out) is (Pair if kind == "namedtuple" else collections.OrderedDict)
    want = torch.nn.Module.__call__(mod, x)
    torch.testing.assert_close(
        out[0] if kind == "namedtuple" else out["h"], want[0] if kind == "namedtuple" else want["h"]
    )


def test_disable_then_record_and_capture_again(backend, device):
    torch.manual_seed(0)
    a, b = Lin().to(device), Lin().to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    tgraph.enable(a, backend=backend)
    tgraph.enable(b, backend=backend)
    a(x).sum().backward()
    b(x).sum().backward()
    tgraph.disable(a)  # drops every graph and record; b records again
    b(x).sum().backward()
    assert tgraph.create_graphs().runners == 1
    assert "_tgraph" not in a.__dict__
    b(x).sum().backward()
    assert tgraph.eager_calls() == 0  # b replayed


def test_enable_again_after_recording_keeps_the_record(backend, device):
    torch.manual_seed(0)
    layer = Lin().to(device)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    tgraph.enable(layer, backend=backend)
    layer(x).sum().backward()
    tgraph.enable(layer, backend=backend, strict=True)  # new options, same recorded runners
    tgraph.create_graphs()
    torch.testing.assert_close(layer(x), torch.nn.Module.__call__(layer, x))


class _ScalarOut(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y, y.square().mean()  # a 0-dim output: handed out as a copy


class _ScalarIn(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, t):
        return self.lin(x) * t


class _ScalarNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = _ScalarOut(), _ScalarIn()

    def forward(self, x):
        y, t = self.a(x)
        return self.b(y, t).sum() + t, t


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_module"])
def test_a_kept_scalar_output_and_a_scalar_passed_on_replay(backend, device, merge, swaps):
    """A 0-dim output (a loss, an auxiliary loss) kept across steps, as a list of losses keeps
    it, and passed on to the next graphed module: each step replays (strict) with eager's
    numbers, on PyTorch without storage swaps too (a kept view of graph memory would run the
    next call eagerly there). The next module copies the scalar in rather than reading the
    producer's buffer, which the caller never gets."""
    torch.manual_seed(0)
    ref = _ScalarNet().to(device)
    net = copy.deepcopy(ref)
    tgraph.enable(net, backend=backend, strict=True, merge=merge)
    x = torch.randn(4, 8, device=device)
    kept = []
    for i in range(4):
        (got, t), (want, u) = net(x), ref(x)
        got.backward()
        want.backward()
        kept.append((torch.stack([got, t]).detach(), torch.stack([want, u]).detach(), t.detach()))
        if i == 0:
            tgraph.create_graphs()
    assert tgraph.eager_calls() == 0
    for got, want, t in kept:
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        assert torch.equal(t, got[1])  # the kept scalar: not overwritten by later replays
    torch.testing.assert_close(_grads(net), _grads(ref), rtol=RTOL, atol=ATOL)


def test_an_eval_loop_keeping_each_scalar_replays_every_call(backend, device):
    """Under no_grad a call's outputs keep its graph from replaying while they live (the next
    replay would overwrite them); a 0-dim output is a copy, so an eval loop that keeps each
    call's loss (and drops the rest) replays every call, strict, with eager's values."""
    torch.manual_seed(0)
    ref = _ScalarOut().to(device)
    net = copy.deepcopy(ref)
    tgraph.enable(net, backend=backend, strict=True)
    xs = [torch.randn(4, 8, device=device) for _ in range(5)]
    with torch.no_grad():
        net(xs[0])  # recorded
        tgraph.create_graphs()
        got = [net(x)[1] for x in xs]
        want = [ref(x)[1] for x in xs]
    assert tgraph.eager_calls() == 0
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)


class Positioned(tgraph.GraphableModule):
    """Called as a transformers layer is: float hidden states and integer position ids."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.pos = nn.Embedding(16, 8)

    def forward(self, x, position_ids, scale):
        return torch.tanh(self.lin(x) + self.pos(position_ids)) * scale


def test_inputs_of_several_dtypes_are_copied_a_list_per_dtype(backend, device, monkeypatch):
    """New float and integer inputs each call: one ``_foreach_copy_`` per dtype (CUDA's
    one-kernel route takes a single dtype; a mixed list is copied tensor by tensor), and the
    replays (strict) equal eager."""
    torch.manual_seed(0)
    net = Positioned().to(device)
    ref = copy.deepcopy(net)
    tgraph.enable(net, backend=backend, strict=True)
    calls: list[set] = []
    original = torch._foreach_copy_

    def recorded(dst, src, **kw):
        calls.append({t.dtype for t in dst})
        return original(dst, src, **kw)

    def inputs():
        x = torch.randn(2, 4, 8, device=device)
        return x, torch.arange(4, device=device).expand(2, 4) + 0, x.new_full((2, 4, 1), 0.5)

    net(*inputs()).sum().backward()
    tgraph.create_graphs()
    monkeypatch.setattr(torch, "_foreach_copy_", recorded)
    for _ in range(3):
        xs = inputs()
        got, want = net(*xs), ref(*xs)
        got.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert tgraph.eager_calls() == 0
    mixed = [c for c in calls if len(c) > 1]
    assert not mixed and {torch.int64} in calls, calls
