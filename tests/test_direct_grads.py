"""``tgraph.enable(model, direct_grads=True)``: the graphed node writes parameter gradients to
``.grad`` itself (tgraph.layers.direct_grads.DirectGrads), so autograd's engine runs no AccumulateGrad node
per parameter. Every gradient must end as eager leaves it: set, accumulated, None where no used
output reaches it, hooks run; whatever it cannot do exactly is refused with an error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from layer_models import ATOL, RTOL, MLPBlock, TwoOut, gpt_batches, tiny_gpt, twin, two_out_steps

import tgraph
from tgraph.layers.direct_grads import DirectRoute


def _train(model, batches, backend=None, *, accumulate=1, lr=0.1, before=None, **enable):
    """SGD with momentum (layer_models.train says why not Adam); ``accumulate`` microbatches a
    step; with ``backend``, graphed with ``direct_grads=True`` after the first step;
    ``before(i)`` before step i. Returns the losses and the last step's gradients by name."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if backend is not None:
        tgraph.enable(model, backend=backend, strict=True, direct_grads=True, **enable)
    losses, grads = [], {}
    for i in range(0, len(batches), accumulate):
        if before is not None:
            before(i)
        for x, y in batches[i : i + accumulate]:
            _, loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        if backend is not None and i == 0:
            tgraph.create_graphs()
    return losses, grads


def _assert_same(got, want):
    assert got[1].keys() == want[1].keys()
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=RTOL, atol=ATOL)
    for n in want[1]:
        torch.testing.assert_close(got[1][n], want[1][n], rtol=RTOL, atol=ATOL, msg=n)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_module"])
@pytest.mark.parametrize("accumulate", [1, 3], ids=["step", "accumulate3"])
def test_direct_grads_train_as_eager(backend, device, merge, accumulate):
    """Losses and gradients equal eager's: one backward a step, and three microbatches
    accumulated into .grad (set by the first backward, added by the next two)."""
    model = tiny_gpt(device)
    batches = gpt_batches(device, 9)
    got = _train(twin(model), batches, backend, accumulate=accumulate, merge=merge)
    want = _train(model, batches, accumulate=accumulate)
    _assert_same(got, want)


def test_planted_bug_direct_grads_overwrite_instead_of_accumulate(backend, device, monkeypatch):
    """A second microbatch's gradient assigned over the first (not added) must be caught."""

    def assign(self, grads):
        out = [None]
        params = iter(self.params)
        for g, m in zip(grads, self.mask):
            if not m:
                out.append(g)
            elif (p := next(params)) is not None and g is not None:
                p.grad = g
        return out

    monkeypatch.setattr(DirectRoute, "deliver", assign)
    model = tiny_gpt(device)
    batches = gpt_batches(device, 6)
    got = _train(twin(model), batches, backend, accumulate=3)
    want = _train(model, batches, accumulate=3)
    with pytest.raises(AssertionError):
        _assert_same(got, want)


def test_the_engine_runs_no_accumulate_grad_for_parameters_written_directly(backend, device):
    """The point of the mode, and its documented blind spot: no AccumulateGrad node runs for a
    parameter the node writes, so a hook on that node (not on the tensor) does not run either;
    one parameter per unit keeps autograd's path (what makes backward(inputs=...) run the node,
    which refuses it). With the mode off, every parameter's node runs. The gradients are
    eager's both ways."""
    for direct in (True, False):
        model, eager, x = _captured(backend, device, direct_grads=direct, merge=False)
        ran = []
        params = list(model.blocks[0].parameters())
        for p in params:
            node = p.view_as(p).grad_fn.next_functions[0][0]  # held by tgraph: the same node
            node.register_hook(lambda grad_inputs, grad_outputs, ran=ran: ran.append(1))
        model(x).sum().backward()
        eager(x).sum().backward()
        assert len(ran) == (1 if direct else len(params)), direct
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
        tgraph.reset()
        tgraph.disable(model)


class MLPNetLike(nn.Module):
    def __init__(self, device, n: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(16) for _ in range(n)).to(device)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _captured(backend, device, x_grad=False, **enable):
    """A graphed MLPNetLike (direct_grads on unless ``enable`` says otherwise), its eager twin
    and an input: one recorded step, then the graphs created."""
    torch.manual_seed(0)
    model = MLPNetLike(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True, **{"direct_grads": True, **enable})
    x = torch.randn(4, 16, device=device, requires_grad=x_grad)
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    return model, eager, x


class Twice(nn.Module):
    """One block called twice back to back: a merged stack that differentiates the same
    parameters twice (their gradient is the sum of both, added by one destination twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = MLPBlock(16)
        self.out = nn.Linear(16, 1)

    def forward(self, x, y):
        pred = self.out(self.block(self.block(self.inp(x))))
        return pred, F.mse_loss(pred, y)


def test_a_parameter_differentiated_twice_gets_the_sum(backend, device):
    torch.manual_seed(0)
    model = Twice().to(device)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 8, generator=g), torch.randn(5, 1, generator=g)) for _ in range(6)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    got = _train(copy.deepcopy(model), batches, backend, accumulate=2)
    want = _train(model, batches, accumulate=2)
    _assert_same(got, want)


def test_unused_output_leaves_its_parameters_without_gradient(backend, device):
    """b is reached only through the output the loss ignores at steps 2 and 3: its .grad stays
    None, as eager leaves it (not zeros, which AdamW would turn into drift)."""
    torch.manual_seed(0)
    mod = TwoOut().to(device)
    eager = copy.deepcopy(mod)
    tgraph.enable(mod, backend=backend, strict=True, direct_grads=True)
    x = torch.randn(8, 4, device=device, requires_grad=True)
    got = two_out_steps(mod, x, True, backend)
    want = two_out_steps(eager, x, False, backend)
    torch.testing.assert_close(got[1][0], want[1][0], rtol=RTOL, atol=ATOL)
    for (gb, gx), (wb, wx) in zip(got[2:], want[2:]):
        assert wb is None and gb is None
        torch.testing.assert_close(gx, wx, rtol=RTOL, atol=ATOL)
    for p, q in zip(mod.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("when", ["before_capture", "after_capture"])
@pytest.mark.parametrize("kind", ["register_hook", "post_accumulate"])
def test_a_parameter_with_a_hook_keeps_autograd_path(backend, device, when, kind):
    """A tensor hook (one that scales the gradient, or a post-accumulate hook that records it)
    runs as eagerly, registered before capture or after it (the next forward moves that
    parameter back to autograd's path)."""
    model = tiny_gpt(device)
    eager = twin(model)
    seen = {"graphed": 0, "eager": 0}

    def hook_on(m, tag):
        w = m.h[1].mlp.c_fc.weight
        if kind == "register_hook":

            def scale(g):
                seen[tag] += 1
                return 3 * g

            w.register_hook(scale)
        else:
            w.register_post_accumulate_grad_hook(lambda p: seen.__setitem__(tag, seen[tag] + 1))

    batches = gpt_batches(device, 5)
    at = 0 if when == "before_capture" else 2  # graphs are created after step 0
    want = _train(eager, batches, before=lambda i: i == at and hook_on(eager, "eager"))
    got = _train(model, batches, backend, before=lambda i: i == at and hook_on(model, "graphed"))
    _assert_same(got, want)
    assert seen["graphed"] == seen["eager"] > 0


def test_autograd_grad_and_backward_inputs_are_refused(backend, device):
    model, _, x = _captured(backend, device, x_grad=True)
    w = model.blocks[1].fc1.weight
    with pytest.raises(RuntimeError, match="direct_grads=True.*plain loss.backward"):
        torch.autograd.grad(model(x).sum(), [x])
    with pytest.raises(RuntimeError, match="direct_grads=True.*plain loss.backward"):
        model(x).sum().backward(inputs=[x])
    assert w.grad is None
    model(x).sum().backward()  # a plain backward still works after the refusals
    assert w.grad is not None


@pytest.mark.parametrize("how", ["backward_inputs", "autograd_grad"])
def test_gradients_asked_for_the_parameters_are_refused(backend, device, how):
    """``backward(inputs=params)`` and ``autograd.grad(loss, params, allow_unused=True)`` where
    nothing upstream of the graphed layers requires grad: the node's only edge was the anchor,
    so autograd skipped it and every graphed parameter got no gradient, with no error. The
    node must run and refuse; then a plain backward trains as eager."""
    model, eager, x = _captured(backend, device)
    params = list(model.parameters())
    with pytest.raises(RuntimeError, match="direct_grads=True.*plain loss.backward"):
        if how == "backward_inputs":
            model(x).sum().backward(inputs=params)
        else:
            torch.autograd.grad(model(x).sum(), params, allow_unused=True)
    assert all(p.grad is None for p in params)
    model(x).sum().backward()  # strict: replayed
    eager(x).sum().backward()
    for p, q in zip(params, eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("how", ["backward_inputs", "autograd_grad", "materialize_grads"])
def test_a_gradient_asked_for_one_directly_written_parameter_is_refused(backend, device, how):
    """Asked for a parameter the node writes (not the unit's first, which keeps an edge):
    no edge reaches it, so autograd skipped the node and returned None (zeros with
    ``materialize_grads``, ``.grad`` untouched for ``backward(inputs=...)``) where eager
    has its gradient. Refused before the engine runs, losing nothing."""
    model, eager, x = _captured(backend, device)
    p = model.blocks[1].fc1.bias
    with pytest.raises(RuntimeError, match="asks for the gradient of a parameter.*direct_grads"):
        if how == "backward_inputs":
            model(x).sum().backward(inputs=[p])
        else:
            kw = {"allow_unused": True} if how == "autograd_grad" else {"materialize_grads": True}
            torch.autograd.grad(model(x).sum(), [p], **kw)
    assert p.grad is None
    model(x).sum().backward()  # strict: replayed
    eager(x).sum().backward()
    torch.testing.assert_close(p.grad, eager.blocks[1].fc1.bias.grad, rtol=RTOL, atol=ATOL)


def test_torch_distributed_is_refused(backend, device):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    model = MLPNetLike(device)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="direct_grads=True with torch.distributed"):
            tgraph.enable(model, backend=backend, direct_grads=True)
    finally:
        dist.destroy_process_group()


def test_direct_grads_beside_the_optimizer_graph(backend, device):
    """AdamW as an OptimizerGraph reads the .grad tensors the node wrote, and zeroes them in
    place (so every backward adds): parameters equal those of the same run with autograd's
    path, bitwise (0 + g is g either way), which other tests compare with eager."""
    results = []
    for direct in (True, False):
        model = tiny_gpt(device)
        extra = dict(fused=True, capturable=True) if device.type == "cuda" else dict(fused=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **extra)
        graph = tgraph.OptimizerGraph(opt, backend=backend)
        tgraph.enable(model, backend=backend, strict=True, direct_grads=direct)
        for i, (x, y) in enumerate(gpt_batches(device, 5)):
            _, loss = model(x, y)
            loss.backward()
            graph.step(loss)
            if i == 0:
                tgraph.create_graphs()
        assert graph.captured
        results.append([p.detach().clone() for p in model.parameters()])
        tgraph.reset()
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_hook_registered_between_forward_and_backward_is_refused(backend, device):
    """That forward left the parameter's gradient to the node: its hook could not run, so
    the backward raises (no silent skip); the next forward gives it autograd's path."""
    model, eager, x = _captured(backend, device)
    out = model(x).sum()
    calls = []
    model.blocks[1].fc1.weight.register_hook(lambda g: calls.append(1))
    with pytest.raises(RuntimeError, match="between its forward and its backward"):
        out.backward()
    assert not calls
    del out  # its autograd graph (and the unit's flight) goes with it
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    eager(x).sum().backward()
    assert calls == [1]
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


class MixedBlock(tgraph.GraphableModule):
    """Parameters of two dtypes: the unit's gradients are not packed, so its backward hands
    its static buffers (which AccumulateGrad clones): it keeps autograd's path."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 16).double()

    def forward(self, x):
        return x + self.fc(self.norm(x).double()).float()


class MixedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(MixedBlock() for _ in range(2))
        self.out = nn.Linear(16, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        pred = self.out(h)
        return pred, F.mse_loss(pred, y)


def _regression_batches(device, n):
    g = torch.Generator().manual_seed(1)
    xs = [(torch.randn(5, 8, generator=g), torch.randn(5, 1, generator=g)) for _ in range(n)]
    return [(x.to(device), y.to(device)) for x, y in xs]


def test_a_unit_of_mixed_dtypes_accumulates_exactly(backend, device):
    """Found in review: .grad was the graph's static buffer itself, so the next microbatch's
    replay overwrote it (2 x the last gradient instead of the sum)."""
    torch.manual_seed(0)
    model = MixedNet().to(device)
    batches = _regression_batches(device, 6)
    got = _train(copy.deepcopy(model), batches, backend, accumulate=2)
    want = _train(model, batches, accumulate=2)
    _assert_same(got, want)


def test_a_parameter_frozen_between_forward_and_backward_gets_no_gradient(backend, device):
    """As AccumulateGrad: a parameter whose requires_grad was turned off after the forward
    gets no .grad from that backward."""
    model, _, x = _captured(backend, device)
    w = model.blocks[1].fc1.weight
    out = model(x).sum()
    w.requires_grad_(False)
    out.backward()
    assert w.grad is None
    assert model.blocks[1].fc2.weight.grad is not None


def test_a_parameter_laid_out_anew_gets_gradients_in_its_layout(backend, device):
    """p.data re-pointed to a transposed layout after capture (also after a first re-point,
    found in review): followed by a copy into the graph's memory, and .grad has the
    parameter's strides, as AccumulateGrad gives it."""
    model, eager, x = _captured(backend, device)
    for again in (False, True):  # laid out anew at once, or after being followed already
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
            w = m.blocks[0].fc1.weight
            w.data = w.data.t().contiguous().t() if again else w.data.clone()
        for m in (model, eager):
            m(x).sum().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            assert p.grad.stride() == q.grad.stride(), again
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_torch_distributed_initialized_after_capture_is_refused(backend, device):
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    model, _, x = _captured(backend, device)
    out = model(x).sum()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="direct_grads=True with torch.distributed"):
            out.backward()
    finally:
        dist.destroy_process_group()
