"""Direct gradients (``tgraph.enable(model)``'s default where exact, ``direct_grads=True``): the
graphed node writes parameter gradients to ``.grad`` itself (tgraph.layers.direct_grads.DirectGrads),
so autograd's engine runs no AccumulateGrad node per parameter. Every gradient must end as eager
leaves it: set, accumulated, None where no used output reaches it, hooks run, handed to
``autograd.grad`` and ``backward(inputs=...)``; what it cannot do exactly (torch.distributed)
goes back to autograd's path by default and is refused with ``direct_grads=True``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from layer_models import ATOL, RTOL, MLPBlock, TwoOut, gpt_batches, tiny_gpt, twin, two_out_steps

import tgraph
from tgraph.layers.direct_grads import DirectRoute
from tgraph.layers.record import Record


def _train(model, batches, backend=None, *, accumulate=1, lr=0.1, before=None, **enable):
    """SGD with momentum (layer_models.train says why not Adam); ``accumulate`` microbatches a
    step; with ``backend``, graphed with ``direct_grads=True`` after the first step;
    ``before(i)`` before step i. Returns the losses and the last step's gradients by name."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if backend is not None:
        tgraph.enable(model, backend=backend, strict=True, **{"direct_grads": True, **enable})
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


def test_later_microbatches_add_the_buffers_themselves(backend, device, monkeypatch, no_verifier):
    """A microbatch after the first finds every ``.grad`` set: the node adds its static
    buffers into them without an alias per parameter (``DirectRoute.adds``), and no ``.grad``
    ever is a buffer (the next backward would overwrite it). Counted, so that equal numbers
    cannot come from the long way."""
    taken, shared = [], []
    adds, deliver = DirectRoute.adds, DirectRoute.deliver

    def counted(self, asked, hooks_moved):
        taken.append(adds(self, asked, hooks_moved))
        return taken[-1]

    def checked(self, grads, *args):
        out = deliver(self, grads, *args)
        bufs = {g.untyped_storage().data_ptr() for g in grads if g is not None}
        held = {p.grad.untyped_storage().data_ptr() for p in self.params}
        shared.append(bool(bufs & held))
        return out

    monkeypatch.setattr(DirectRoute, "adds", counted)
    monkeypatch.setattr(DirectRoute, "deliver", checked)
    model = tiny_gpt(device)
    batches = gpt_batches(device, 9)
    got = _train(twin(model), batches, backend, accumulate=3)
    _assert_same(got, _train(model, batches, accumulate=3))
    assert taken == [False, True, True] * 2, taken  # (a verified replay goes the long way)
    assert shared == [True, False, False] * 2, shared  # the first: .grad set to an alias


def test_planted_bug_direct_grads_overwrite_instead_of_accumulate(backend, device, monkeypatch):
    """A second microbatch's gradient assigned over the first (not added) must be caught."""

    def assign(self, grads, asked=None, hooks_moved=True, adding=False):
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


@pytest.mark.parametrize("direct", [None, True, False], ids=["default", "on", "off"])
def test_the_engine_runs_no_accumulate_grad_for_parameters_written_directly(
    backend, device, direct
):
    """The point of the mode, on by default, and its documented blind spot: no AccumulateGrad
    node runs for a parameter the node writes, so a hook on that node (not on the tensor) does
    not run either. With the mode off, every parameter's node runs. The gradients are eager's
    every way."""
    model, eager, x = _captured(backend, device, direct_grads=direct, merge=False)
    ran = []
    params = list(model.blocks[0].parameters())
    for p in params:
        node = p.view_as(p).grad_fn.next_functions[0][0]  # held by tgraph: the same node
        node.register_hook(lambda grad_inputs, grad_outputs, ran=ran: ran.append(1))
    model(x).sum().backward()
    eager(x).sum().backward()
    assert len(ran) == (len(params) if direct is False else 0)
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


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
    assert tgraph.eager_calls() == 0
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


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "autograd"])
def test_a_parameter_differentiated_twice_gets_the_sum(backend, device, direct):
    """Also what the shadow verifier compares (strict: a difference raises): the sum of the
    node's two gradients for the parameter against eager's (found with direct gradients on
    by default: it compared one use's gradient with eager's sum, a false alarm both ways)."""
    torch.manual_seed(0)
    model = Twice().to(device)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 8, generator=g), torch.randn(5, 1, generator=g)) for _ in range(6)]
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    got = _train(copy.deepcopy(model), batches, backend, accumulate=2, direct_grads=direct)
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


def _grads_of(model, x, how, asked):
    """The gradients ``how`` gives for ``asked`` (names of model's parameters, or "x") through
    a fresh forward, and every parameter's ``.grad`` after it."""
    tensors = [x if n == "x" else model.get_parameter(n) for n in asked]
    loss = model(x).pow(2).sum()
    if how == "autograd_grad":
        got = list(torch.autograd.grad(loss, tensors))
    elif how == "materialize_grads":
        got = list(torch.autograd.grad(loss, tensors, materialize_grads=True))
    else:
        loss.backward(inputs=tensors)
        got = [t.grad for t in tensors]
    return got, {n: p.grad for n, p in model.named_parameters()}


ASKED = {  # parameters the node writes; the input; both; a block's every parameter
    "one_param": ["blocks.1.fc1.bias"],
    "input": ["x"],
    "input_and_params": ["x", "blocks.0.fc2.weight", "blocks.1.fc1.weight"],
    "a_whole_block": [f"blocks.1.{m}.{k}" for m in ("fc1", "fc2") for k in ("weight", "bias")],
    "twice": ["blocks.0.fc1.weight", "blocks.0.fc1.weight"],
}


@pytest.mark.parametrize("asked", list(ASKED))
@pytest.mark.parametrize("how", ["backward_inputs", "autograd_grad", "materialize_grads"])
@pytest.mark.parametrize("direct", [None, True], ids=["default", "on"])
def test_gradients_asked_for_get_eagers(backend, device, asked, how, direct, swaps):
    """``backward(inputs=...)`` and ``torch.autograd.grad`` naming parameters the node writes
    (no edge reaches them: the engine's entry asks for their anchors instead), the input, or
    both: eager's gradients, and no ``.grad`` written beyond what was asked (autograd.grad
    writes none). Planted: the node writing every ``.grad`` whatever was asked; the entry not
    handing back the node's gradients (autograd would return None, or zeros with
    materialize_grads). Then a plain backward trains as eager (strict: replayed)."""
    if how == "materialize_grads" and asked != "one_param":
        pytest.skip("one case of materialize_grads is enough")
    model, eager, x = _captured(backend, device, x_grad=True, direct_grads=direct)
    names = ASKED[asked]
    for _ in range(2):  # asked once, and again with .grad already set (accumulated)
        got, grads = _grads_of(model, x.detach().requires_grad_(), how, names)
        want, eager_grads = _grads_of(eager, x.detach().requires_grad_(), how, names)
        for n, g, w in zip(names, got, want, strict=True):
            if n != "x":
                torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=n)
        for n, w in eager_grads.items():
            if w is None:
                assert grads[n] is None, n
            else:
                torch.testing.assert_close(grads[n], w, rtol=RTOL, atol=ATOL, msg=n)
    model.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    model(x).sum().backward()
    eager(x).sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    assert tgraph.eager_calls() == 0


@pytest.mark.parametrize("how", ["backward_inputs", "autograd_grad"])
@pytest.mark.parametrize("forwards", [1, 2])
def test_a_parameter_of_two_units_gets_eagers_gradient(backend, device, how, forwards):
    """Recorded with two forwards before their backwards, each block is two units (one per
    call in flight) writing the same parameters: asked for one, the engine's entry must ask
    for both units' anchors (found in review on HF Llama: it asked for one, the other unit's,
    and autograd said the parameter was unused), and hand back their sum when both ran.
    Recorded with a backward each (one backward through both would leave the parameters to
    autograd: test_a_parameter_also_reached_elsewhere_accumulates_as_eager), the later
    forward's first, as the summed loss later runs them. Strict: every call replays."""
    torch.manual_seed(0)
    model = MLPNetLike(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True)
    xs = [torch.randn(4, 16, device=device) for _ in range(2)]
    losses = [model(x).sum() for x in xs]  # the recorded step: two forwards in flight
    for loss in reversed(losses):
        loss.backward()
    model.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    routes = [u.state.route.direct for u in tgraph.layers.manager._manager.units]
    assert len(routes) == 2 and all(len(r.params) == len(r.kept) for r in routes)
    w = model.blocks[1].fc1.weight
    for m in (model, eager):
        loss = sum(m(x).pow(2).sum() for x in xs[:forwards])
        p = m.blocks[1].fc1.weight
        if how == "autograd_grad":
            got = torch.autograd.grad(loss, [p])[0]
        else:
            loss.backward(inputs=[p])
            got = p.grad
        if m is model:
            mine = got
    torch.testing.assert_close(mine, got, rtol=RTOL, atol=ATOL)
    assert w.grad is None or how == "backward_inputs"
    assert tgraph.eager_calls() == 0


def test_a_parameter_of_a_unit_not_run_is_unused_as_in_eager(backend, device):
    """``autograd.grad`` naming a directly written parameter whose unit the loss does not
    reach: eager's error without ``allow_unused``, None with it."""
    model, eager, x = _captured(backend, device)
    p = model.blocks[1].fc1.weight
    with pytest.raises(RuntimeError, match="not have been used"):
        torch.autograd.grad(model.blocks[0](x).sum(), [p])  # blocks[1] not run
    assert torch.autograd.grad(model.blocks[0](x).sum(), [p], allow_unused=True) == (None,)


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


@pytest.mark.parametrize("kind", ["register_hook", "post_accumulate"])
def test_a_hook_registered_between_forward_and_backward_runs_as_in_eager(backend, device, kind):
    """That forward left the parameter's gradient to the node: the node runs the hook as
    AccumulateGrad would (a tensor hook that scales the gradient before the accumulation, a
    post-accumulate hook after it), then the next forward gives the parameter autograd's
    path. Planted: the hook not run (the gradient unscaled, the count short)."""
    model, eager, x = _captured(backend, device)
    calls = []
    for m in (model, eager):
        out = m(x).sum()
        w = m.blocks[1].fc1.weight
        if kind == "register_hook":
            w.register_hook(lambda g: calls.append(1) or 3 * g)
        else:
            w.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.sum().item()))
        out.backward()
        m(x).sum().backward()  # the next step: autograd's path
    assert len(calls) == 4
    if kind == "post_accumulate":
        assert calls[:2] == pytest.approx(calls[2:])
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    assert tgraph.eager_calls() == 0


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


def _accumulator_hooks_run(model) -> tuple[list, list]:
    """A hook on each parameter's AccumulateGrad node, held, as DDP and megatron-core
    register them: the list the hooks append to, and the nodes."""
    ran, nodes = [], [p.view_as(p).grad_fn.next_functions[0][0] for p in model.parameters()]
    for node in nodes:
        node.register_hook(lambda grad_inputs, grad_outputs, ran=ran: ran.append(1))
    return ran, nodes


@pytest.mark.parametrize("when", ["before_enable", "after_capture"])
def test_the_default_under_torch_distributed_keeps_autograds_path(backend, device, when):
    """The default (direct where exact) with torch.distributed initialized, before enable()
    or after capture: the parameters keep autograd's path, so the hooks DDP puts on their
    gradient accumulators run (planted: the default not looking at torch.distributed, 0 of
    6 run), and the gradients are eager's; the replays are strict."""
    dist = torch.distributed
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if when == "before_enable":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model, eager, x = _captured(backend, device, direct_grads=None)
        if when == "after_capture":
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        ran, nodes = _accumulator_hooks_run(model.blocks[0])
        model(x).sum().backward()
        eager(x).sum().backward()
        assert len(ran) == len(nodes)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
        assert tgraph.eager_calls() == 0
    finally:
        dist.destroy_process_group()


# ------------------------------------ a parameter reached through a unit and elsewhere
# Autograd adds up a leaf's gradients before it accumulates them into .grad: G + (o + g). A node
# writing its share into .grad apart rounds (G + o) + g once .grad holds an earlier microbatch's.


class TanhBlock(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class SharedUse(nn.Module):
    """Two graphed blocks and an eager head; ``how`` says where the first block's weight has
    another use: eager code before the blocks or after them, the second block (tied), or a
    second call of the first block in flight in the same backward (``twice``)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.a, self.b, self.head = TanhBlock(), TanhBlock(), nn.Linear(8, 1)
        if how == "tied":
            self.b.fc.weight = self.a.fc.weight

    def forward(self, x):
        w = self.a.fc.weight
        if self.how == "twice":
            return self.head(self.a(self.a(x))).square().mean() + self.head(self.a(x)).mean()
        if self.how == "before":
            side = (x @ w.t()).sum(-1, keepdim=True)
            return (self.head(self.b(self.a(x))) + side).square().mean()
        h = self.b(self.a(x))
        side = (h @ w.t()).sum(-1, keepdim=True) if self.how == "after" else 0.0
        return (self.head(h) + side).square().mean()


def check_shared_use(backend, device, replays, how, merge):
    """Graphed (direct gradients by default) and eager twins, two microbatches a step, SGD:
    every gradient bitwise eager's on the emulated backend (CUDA: within RTOL). Strict: every
    call after the recorded one replays, counted. Returns the graphed model and the
    parameters its units write directly."""
    torch.manual_seed(0)
    model = SharedUse(how).to(device)
    eager = twin(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
    tgraph.enable(model, backend=backend, strict=True, merge=merge)
    g = torch.Generator().manual_seed(0)
    steps = [[torch.randn(4, 8, generator=g).to(device) for _ in range(2)] for _ in range(4)]
    tol = dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=RTOL, atol=ATOL)
    for i, micro in enumerate(steps):
        before = replays[0]
        for m, opt in zip((model, eager), opts):
            for x in micro:
                m(x).backward()
                if i == 0 and m is model and not tgraph.layers.manager._manager.captured:
                    tgraph.create_graphs()
            grads = [p.grad.clone() for p in m.parameters() if p.grad is not None]
            if m is model:
                got = grads
            opt.step()
            opt.zero_grad(set_to_none=True)
        for k, (p, q) in enumerate(zip(got, grads)):
            torch.testing.assert_close(p, q, **tol, msg=lambda s, i=i, k=k: f"step {i}, {k}: {s}")
        units = tgraph.layers.manager._manager.units
        if i:
            assert replays[0] - before == 2 * len(units) * len(micro)
    assert tgraph.eager_calls() == 0
    return model, [p for u in units for p in u.state.route.direct.params]


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_module"])
@pytest.mark.parametrize("how", ["before", "after", "tied", "twice"])
def test_a_parameter_also_reached_elsewhere_accumulates_as_eager(
    backend, device, replays, how, merge
):
    """A parameter that the recorded backward reached through a unit and elsewhere too keeps
    autograd's path (its AccumulateGrad adds the two up first, as eager's does); the units
    still write their other parameters themselves, and a merged stack the weight its blocks
    tie (it sums the two itself). Found by a probe: written directly, the first block's
    weight was up to 9.5e-7 off eager's from the second microbatch on."""
    model, direct = check_shared_use(backend, device, replays, how, merge)
    assert any(p is model.a.fc.weight for p in direct) == (how == "tied" and merge)
    assert any(p is model.b.fc.bias for p in direct) == (how != "twice")  # twice: b unused


def test_planted_bug_a_parameter_reached_elsewhere_written_directly_is_caught(
    backend, device, replays, monkeypatch
):
    if backend != "emulated":
        pytest.skip("bitwise only on the emulated backend")
    monkeypatch.setattr(Record, "reached_elsewhere", lambda self, members: set())
    with pytest.raises(AssertionError, match="not equal"):
        check_shared_use(backend, device, replays, "before", False)
