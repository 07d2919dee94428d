"""PyTorch's own ``make_graphed_callables`` tests (test/test_cuda.py), ported to tgraph's API.

The semantics are ported, not the code: tgraph records a real first iteration instead of
taking ``sample_args``, graphs ``GraphableModule`` s instead of arbitrary callables (the two
Python functions of torch's stress test, ``relu`` and ``mse_loss``, become parameter-free
modules), and compares graphed against an eager twin (``copy.deepcopy`` before enabling) with
the same seeds. Sizes are tiny (CPU CI); every test runs on both backends.

Ported:

* ``test_graph_make_graphed_callables`` -> :func:`test_make_graphed_callables_stress`: a dict
  input with an unused tensor, Linear + Dropout sections, a parameter-free gather returning a
  dict, relu and the loss as graphed callables, SGD over 10 iterations, dropout bitwise equal
  to eager under reset seeds; with and without autocast (``cache_enabled`` True and False; on
  the CPU autocast runs in bfloat16), with the unused input requiring grad or not (torch's
  ``allow_unused_input``); then eval runs ungraphed (tgraph: falls back with a warning naming
  the train/eval switch) and matches eager.
* ``test_graph_make_graphed_callables_parameterless_nograd_module`` ->
  :func:`test_parameterless_module_without_backward`: forward-only calls of a parameter-free
  module whose inputs require grad or not, with and without autocast.
* ``test_graph_make_graphed_callables_same_pool`` -> :func:`test_separate_models_share_one_pool`:
  three models graphed into one pool (tgraph always shares one pool), outputs, losses and
  gradients equal to eager, no gradient aliasing; also replayed in orders other than the
  recorded one (all forwards before the backwards, and reversed).
* ``allow_unused_input`` -> also :func:`test_unused_input_and_unused_output_get_no_gradient`
  (an input nobody reads and an output the loss ignores: eager leaves ``.grad`` None).
* non-tensor and None inputs/outputs (torch refuses them; tgraph keys graphs by hashable
  non-tensor values) -> :func:`test_non_tensor_and_none_arguments_and_outputs`.
* module hooks (torch requires none to be registered when a module is graphed) ->
  :func:`test_module_and_tensor_hooks_registered_before_enable`: hooks that change inputs,
  outputs and gradients are part of the captured computation and must match eager.
* ``_test_graphed_optimizer`` / ``test_graph_optims`` and
  ``test_graph_optims_with_explicitly_capturable_param_groups`` ->
  :func:`test_graphed_optimizer_step_matches_eager` and
  :func:`test_non_capturable_param_group_is_refused`, through ``FullIterationGraph``.

Left out, no tgraph equivalent:

* ``sample_args`` and ``num_warmup_iters`` shapes of the API: tgraph records a real iteration
  and warms up by itself (``tgraph.enable(..., warmup_steps=)``).
* ``pool=`` / ``graph_pool_handle()``: tgraph has no user-visible pool; all per-layer graphs
  share one pool by design, which the same-pool port covers.
* graphing plain Python functions: tgraph graphs modules only (the port wraps them).
* ``test_graph_optims`` over every optimizer of ``optim_db`` (ASGD, Adamax, NAdam, RAdam,
  Adadelta, RMSprop, Rprop): ``FullIterationGraph`` moves the learning rate into a tensor only
  for fused/capturable SGD, Adam and AdamW; others would bake a float lr (refused when it
  changes) and the CPU has no capturable kernels for them.
* XPU copies of these tests, memory-statistics and stream tests (no tgraph API involved).

Tolerances: tests/layer_models.py's RTOL/ATOL; autocast runs compare bfloat16/float16
results, which agree bitwise on the emulated backend but may round differently on CUDA if a
graph picks another kernel, so they use ``AMP_TOL``; optimizer-only steps inside
FullIterationGraph use tests/test_full_iteration.py's tolerance (its lr lives in a float32
tensor instead of a Python double: one rounding).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from layer_models import ATOL, RTOL

import tgraph
from tgraph.layers.manager import GraphableModule

AMP_TOL = dict(rtol=2e-2, atol=2e-3)
FULL_TOL = dict(rtol=1e-4, atol=1e-5)
N, D_IN, H, D_OUT = 16, 32, 24, 8


def amp_context(device, amp: str):
    if amp == "off":
        return torch.autocast(device.type, enabled=False)
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, cache_enabled=amp == "cache_on")


# ---------------------------------------------------- test_graph_make_graphed_callables


class MLP1(GraphableModule):
    def __init__(self, d_in: int, h: int, d_out: int) -> None:
        super().__init__()
        self.net_1 = nn.Sequential(nn.Linear(d_in, h), nn.Dropout(p=0.1))
        self.net_2 = nn.Sequential(nn.Linear(h, d_out), nn.Dropout(p=0.2))

    def forward(self, input_dict: dict) -> torch.Tensor:
        return self.net_2(self.net_1(input_dict["x"]))


class MLP2(GraphableModule):
    def __init__(self, d_in: int, h: int, d_out: int) -> None:
        super().__init__()
        self.net_1 = nn.Sequential(nn.Linear(d_in, h), nn.Dropout(p=0.1))
        self.net_2 = nn.Sequential(nn.Linear(h, d_out), nn.Dropout(p=0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net_2(self.net_1(x))


class Gather(GraphableModule):
    """torch's ParameterlessModule: a gather of each row onto itself, returned in a dict."""

    def forward(self, x: torch.Tensor) -> dict:
        idx = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, idx)}


class ReLU(GraphableModule):  # torch graphs F.relu as a plain callable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)


class MSE(GraphableModule):  # torch graphs F.mse_loss as a plain callable
    def forward(self, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(pred, target)


class Stress(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(MLP1(D_IN, H, H), MLP2(H, H, D_OUT), Gather())
        self.relu = ReLU()
        self.loss = MSE()

    def forward(self, inputs: dict, target: torch.Tensor) -> torch.Tensor:
        y = self.seq(inputs)["output"]
        return self.loss(self.relu(y), target)


@pytest.mark.parametrize(
    "unused_requires_grad", [True, False], ids=["unused_grad", "unused_nograd"]
)
@pytest.mark.parametrize("amp", ["off", "cache_off", "cache_on"])
def test_make_graphed_callables_stress(backend, device, amp, unused_requires_grad):
    torch.manual_seed(5)
    model = Stress().to(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend)
    g = torch.Generator().manual_seed(5)
    real_inputs = [torch.rand(N, D_IN, generator=g).to(device) for _ in range(10)]
    real_targets = [torch.rand(N, D_OUT, generator=g).to(device) for _ in range(10)]
    unused = torch.randn(N, H, device=device, requires_grad=unused_requires_grad)
    results = []
    for m, graphed in ((model, True), (eager, False)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(5)  # same RNG stream: dropout masks equal to eager's
        losses = []
        for i, (data, target) in enumerate(zip(real_inputs, real_targets)):
            opt.zero_grad(set_to_none=True)
            with amp_context(device, amp), warnings.catch_warnings():
                warnings.simplefilter("error", tgraph.GraphFallbackWarning)  # every call replays
                loss = m({"x": data, "unused_input": unused}, target)
                loss.backward()
            opt.step()
            losses.append(loss.detach().float().clone())  # graphed: a static buffer
            if graphed and i == 0:
                tgraph.create_graphs()
        assert unused.grad is None, "an input no callable reads got a gradient"
        results.append((torch.stack(losses), [p.detach().clone() for p in m.parameters()]))
    tol = dict(rtol=RTOL, atol=ATOL) if amp == "off" else AMP_TOL
    torch.testing.assert_close(results[0][0], results[1][0], **tol)
    torch.testing.assert_close(results[0][1], results[1][1], **tol)
    # Graphed in training mode: eval runs ungraphed (tgraph says so) and matches eager.
    model.eval()
    eager.eval()
    with pytest.warns(tgraph.GraphFallbackWarning, match="module.training changed"):
        got = model.seq({"x": real_inputs[0]})["output"]
    torch.testing.assert_close(got, eager.seq({"x": real_inputs[0]})["output"], **tol)


# ------------------------------- test_graph_make_graphed_callables_parameterless_nograd_module


class DictGather(GraphableModule):
    def forward(self, input_dict: dict) -> dict:
        x = input_dict["x"]
        idx = torch.arange(x.size(0), device=x.device).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, idx)}


@pytest.mark.parametrize("requires_grad", [True, False], ids=["input_grad", "input_nograd"])
@pytest.mark.parametrize("amp", ["off", "cache_off", "cache_on"])
def test_parameterless_module_without_backward(backend, device, amp, requires_grad):
    model = nn.Sequential(DictGather()).to(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend)
    g = torch.Generator().manual_seed(5)
    xs = [
        torch.rand(N, D_IN, generator=g).to(device).requires_grad_(requires_grad) for _ in range(10)
    ]
    unused = torch.randn(N, H, device=device)
    for i, x in enumerate(xs):  # outputs dropped at once, never backed through
        with amp_context(device, amp), warnings.catch_warnings():
            warnings.simplefilter("error", tgraph.GraphFallbackWarning)  # every call replays
            got = model({"x": x, "unused_input": unused})["output"].detach().clone()
            want = eager({"x": x, "unused_input": unused})["output"]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        if i == 0:
            tgraph.create_graphs()
    model.eval()
    eager.eval()
    with pytest.warns(tgraph.GraphFallbackWarning, match="module.training changed"):
        got = model({"x": xs[0]})["output"]
    torch.testing.assert_close(got, eager({"x": xs[0]})["output"], rtol=0, atol=0)


# ------------------------------------------------ test_graph_make_graphed_callables_same_pool


def three_models(device):
    torch.manual_seed(5)
    models = []
    for _ in range(3):
        m = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128)).to(device)
        models.append(m)
    eager = copy.deepcopy(models)
    for m in models:
        m.__class__ = GraphableModule.of(nn.Sequential)
    return models, eager


@pytest.mark.parametrize("order", ["recorded", "forwards_first", "reversed"])
def test_separate_models_share_one_pool(backend, device, order):
    """Recorded iteration: fwd 1, bwd 1, fwd 2, bwd 2, fwd 3, bwd 3 (torch's loop). Later
    iterations replay in that order, or with every forward before the backwards, or with the
    models reversed. Every call matches its captured signature; the graphs share one pool, so
    an order other than the recorded one must still give eager's numbers (or run the unsafe
    calls eagerly, with a warning, ignored here)."""
    models, eager = three_models(device)
    for m in models:
        tgraph.enable(m, backend=backend, strict=False)
    g = torch.Generator().manual_seed(5)
    iters = [[torch.randn(64, 32, generator=g).to(device) for _ in range(3)] for _ in range(3)]

    def run(ms, xs, how):
        ys, losses = [None] * 3, [None] * 3
        idx = [2, 1, 0] if how == "reversed" else [0, 1, 2]
        if how == "forwards_first":
            for i in idx:
                ys[i] = ms[i](xs[i])
                losses[i] = ys[i].norm()
            for i in idx:
                losses[i].backward()
        else:
            for i in idx:
                ys[i] = ms[i](xs[i])
                losses[i] = ys[i].norm()
                losses[i].backward()
        return [y.detach().clone() for y in ys], [loss.detach() for loss in losses]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tgraph.GraphFallbackWarning)
        for it, xs in enumerate(iters):
            for ms in (models, eager):
                for m in ms:
                    m.zero_grad(set_to_none=True)
            how = "recorded" if it == 0 else order
            y, loss = run(models, xs, how)
            y_ref, loss_ref = run(eager, xs, how)
            if it == 0:
                tgraph.create_graphs()
            elif how == "recorded":  # the recorded order is safe: every call replays
                assert tgraph.eager_calls() == 0
            torch.testing.assert_close(y, y_ref, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(loss, loss_ref, rtol=RTOL, atol=ATOL)
            ptrs = set()
            for m, mc in zip(models, eager):
                for p, pc in zip(m.parameters(), mc.parameters()):
                    torch.testing.assert_close(p.grad, pc.grad, rtol=RTOL, atol=ATOL)
                    assert p.data_ptr() != pc.data_ptr()
                    ptrs.add(p.grad.data_ptr())
            assert len(ptrs) == 12, "graphed gradients alias each other"


# --------------------------------------------------------------------- allow_unused_input


class TwoOut(GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def test_unused_input_and_unused_output_get_no_gradient(backend, device):
    """An input no op reads and an output the loss ignores: eager leaves ``.grad`` None on
    the input and on the parameters reached only through that output, so AdamW leaves them
    alone. Graphed calls must do the same, not hand back zeros."""
    torch.manual_seed(0)
    model = TwoOut().to(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True)
    x = torch.randn(8, 4, device=device, requires_grad=True)
    results = []
    for m, graphed in ((model, True), (eager, False)):
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        unused = torch.randn(8, 4, device=device, requires_grad=True)
        grads = []
        for step in range(3):
            a, b = m(x, unused)
            loss = a.sum() + b.sum() if step == 0 else a.sum()
            loss.backward()
            grads.append({n: p.grad is None for n, p in m.named_parameters()})
            assert unused.grad is None
            opt.step()
            opt.zero_grad(set_to_none=True)
            if graphed and step == 0:
                tgraph.create_graphs()
        results.append((grads, [p.detach().clone() for p in m.parameters()]))
    assert results[0][0] == results[1][0], "parameters without gradient differ from eager"
    torch.testing.assert_close(results[0][1], results[1][1], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------- non-tensor and None args


class Mixed(GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, mask=None, *, scale: float = 1.0, tag: str = "a"):
        y = self.lin(x) * scale
        if mask is not None:
            y = y * mask
        return y, None, tag, {"aux": torch.tanh(y), "count": 3}


@pytest.mark.parametrize("with_mask", [True, False], ids=["mask", "mask_none"])
def test_non_tensor_and_none_arguments_and_outputs(backend, device, with_mask):
    torch.manual_seed(0)
    model = Mixed().to(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 8, generator=g).to(device).requires_grad_() for _ in range(4)]
    mask = (torch.rand(4, 8, generator=g) > 0.3).float().to(device) if with_mask else None
    for i, x in enumerate(xs):
        outs = []
        for m in (model, eager):
            xi = x.detach().clone().requires_grad_()
            y, none, tag, extra = m(xi, mask, scale=2.0, tag="b")
            assert none is None and tag == "b" and extra["count"] == 3
            (y.sum() + extra["aux"].pow(2).sum()).backward()
            outs.append((y.detach().clone(), xi.grad, [p.grad.clone() for p in m.parameters()]))
            m.zero_grad(set_to_none=True)
        torch.testing.assert_close(outs[0], outs[1], rtol=RTOL, atol=ATOL)
        if i == 0:
            tgraph.create_graphs()
    with pytest.raises(RuntimeError, match="'scale' changed from 2.0 to 3.0"):
        model(xs[0], mask, scale=3.0, tag="b")


# ------------------------------------------------------------------------- module hooks


class Hooked(GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def add_hooks(m: Hooked) -> None:
    m.register_forward_pre_hook(lambda mod, args: (args[0] * 0.5,))
    m.register_forward_hook(lambda mod, args, out: out + 1.0)
    m.fc1.register_full_backward_hook(lambda mod, gin, gout: (gin[0] * 3.0,))
    m.fc2.weight.register_hook(lambda grad: grad * 2.0)


def test_module_and_tensor_hooks_registered_before_enable(backend, device):
    """torch refuses modules with hooks; tgraph captures what the hooks compute (forward
    pre/post hooks, a full backward hook on a nested module, a parameter tensor hook) once they
    are declared capturable (without ``capturable_hooks=True``, create_graphs refuses them)."""
    torch.manual_seed(0)
    model = Hooked().to(device)
    eager = copy.deepcopy(model)
    add_hooks(model)
    add_hooks(eager)
    tgraph.enable(model, backend=backend, strict=True, capturable_hooks=True)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randn(4, 8, generator=g).to(device)
        outs = []
        for m in (model, eager):
            xi = x.clone().requires_grad_()
            y = m(xi)
            y.pow(2).sum().backward()
            outs.append((y.detach().clone(), xi.grad, [p.grad.clone() for p in m.parameters()]))
            m.zero_grad(set_to_none=True)
        torch.testing.assert_close(outs[0], outs[1], rtol=RTOL, atol=ATOL)
        if i == 0:
            tgraph.create_graphs()


# -------------------------------------------------------- graphed optimizers (FullIteration)


def optimizer_kwargs(device, name: str) -> dict:
    if name == "sgd":
        return dict(momentum=0.9, fused=True)
    return {"capturable": True} if device.type == "cuda" else {"fused": True}


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_graphed_optimizer_step_matches_eager(backend, device, name):
    """torch's _test_graphed_optimizer: a control optimizer (default implementation) and a
    graphed one (capturable on CUDA, fused on the CPU) fed the same gradients."""
    ctor = OPTIMIZERS[name]
    lr = dict(lr=0.1) if name == "sgd" else {}
    warmup, train = 3, 4
    torch.manual_seed(0)
    params = [torch.randn(i + 5, i + 5, device=device) for i in range(2)]
    params.append(torch.randn((), device=device))
    grads = [[torch.randn_like(p) for p in params] for _ in range(warmup + train)]
    control = [p.clone().requires_grad_() for p in params]
    graphed = [p.clone().requires_grad_() for p in params]
    extra = {"momentum": 0.9} if name == "sgd" else {}
    opt_c = ctor(control, **lr, **extra)
    for gs in grads:
        for p, gr in zip(control, gs):
            p.grad = gr.clone()
        opt_c.step()
    opt_g = ctor(graphed, **lr, **optimizer_kwargs(device, name))

    def step(gs):
        for p, gr in zip(graphed, gs):
            p.grad = gr
        opt_g.step()
        for p in graphed:
            p.grad = None

    step = tgraph.FullIterationGraph(step, warmup_steps=warmup, backend=backend)
    for gs in grads:
        step(gs)
    assert step.num_graphs == 1
    torch.testing.assert_close(graphed, control, **FULL_TOL)


def test_non_capturable_param_group_is_refused(backend, device):
    """torch's test_graph_optims_with_explicitly_capturable_param_groups: a second param group
    that is not graph-safe must be refused at capture, not silently baked."""
    p1 = torch.ones(1, device=device, requires_grad=True)
    p2 = torch.ones(1, device=device, requires_grad=True)
    key = "capturable" if device.type == "cuda" else "fused"
    opt = torch.optim.Adam([{"params": [p1], key: True}, {"params": [p2], key: False}])

    def step(gs):
        p1.grad, p2.grad = gs
        opt.step()
        p1.grad = p2.grad = None

    step = tgraph.FullIterationGraph(step, warmup_steps=2, backend=backend)
    g = torch.Generator().manual_seed(0)
    with pytest.raises((ValueError, RuntimeError), match=r"param_group 1 .*capturable=False"):
        for _ in range(4):
            step([torch.randn(1, generator=g).to(device) for _ in range(2)])
