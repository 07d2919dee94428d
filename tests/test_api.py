"""The public API agrees with itself: exports, defaults, one report shape
for every entry, what ``tgraph.reset()`` drops, and the backend decided by the backend."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from step_models import make_batches, make_model, make_optimizer, make_step

import tgraph
from tgraph import errors
from tgraph.backend import GraphFactory
from tgraph.emulated import EmulatedBackend
from tgraph.step import capture as step_capture
from tgraph.step.optimizer_graph import OptimizerGraph

# -- exports -------------------------------------------------------------------------------------


def test_exports_are_exactly_the_user_facing_names():
    assert set(tgraph.__all__) == {
        "CaptureError",
        "CaptureReport",
        "FullIterationGraph",
        "GraphFallbackError",
        "GraphFallbackWarning",
        "GraphableModule",
        "MemoryReport",
        "OptimizerGraph",
        "ReplayOrderError",
        "StaleBackwardError",
        "capture_report",
        "capture_stream",
        "create_graphs",
        "decode",
        "disable",
        "eager_calls",
        "enable",
        "verification",
        "memory_report",
        "register_generator",
        "reset",
        "reset_layer_graphs",
        "unregister_generator",
    }
    for name in tgraph.__all__:
        assert getattr(tgraph, name) is not None


def test_eager_calls_counts_every_fallback_and_resets():
    """``tgraph.eager_calls()``: a call no captured graph matches runs eagerly and counts (each
    one, though it warns once); replays do not; ``reset()`` starts the count again."""
    import warnings

    class Block(tgraph.GraphableModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    model = torch.nn.Sequential(Block())
    tgraph.enable(model, backend="emulated")
    model(torch.randn(2, 4)).sum().backward()
    tgraph.create_graphs()
    model(torch.randn(2, 4)).sum().backward()
    assert tgraph.eager_calls() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tgraph.GraphFallbackWarning)
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()  # a batch size never recorded
    assert tgraph.eager_calls() == 3
    tgraph.reset()
    assert tgraph.eager_calls() == 0


def test_error_classes_are_distinct_runtime_errors():
    kinds = [tgraph.GraphFallbackError, tgraph.ReplayOrderError, tgraph.StaleBackwardError]
    assert kinds == [errors.GraphFallbackError, errors.ReplayOrderError, errors.StaleBackwardError]
    for i, a in enumerate(kinds):
        assert issubclass(a, RuntimeError)
        assert not any(issubclass(a, b) for b in kinds[:i] + kinds[i + 1 :])


# -- skip_nonfinite: one default ------------------------------------------------------------------


def _sgd():
    return torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1, fused=True)


def test_skip_nonfinite_defaults_agree():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert OptimizerGraph(_sgd()).guard is None  # False, as FullIterationGraph's default
        assert tgraph.FullIterationGraph(lambda b: b)._skip is None
        assert OptimizerGraph(_sgd(), skip_nonfinite=True).guard is not None


# -- the optimizer graph's extension points --------------------------------------------------------


def test_an_overridden_inner_step_runs_at_the_eager_step_and_the_capture_only():
    calls = []

    class Counted(OptimizerGraph):
        def inner_step(self):
            calls.append("step")
            self.optimizer.step()

    p = torch.nn.Parameter(torch.ones(2))
    graph = Counted(torch.optim.SGD([p], lr=0.1, fused=True), backend="emulated")
    for _ in range(3):  # eager, capture, replay
        p.grad = torch.ones(2)
        graph.step()
    assert graph.captured
    assert calls == ["step", "step"]  # the replay runs no Python
    torch.testing.assert_close(p.detach(), torch.full((2,), 0.7))


@pytest.mark.parametrize("extend", [False, True], ids=["own_pairs", "super_plus_one"])
def test_bind_grads_overridden_alone_keeps_the_default_refresh(extend):
    """bind_grads and refresh_grads are separate extension points: a subclass that binds its
    own gradient buffers (or adds one to the default's) and keeps the default refresh_grads
    gets its gradients copied in at every replay, the added one too, and trains as eager."""
    from tgraph.step.grad_buffers import flat_like

    torch.manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    ref = [w.detach().clone().requires_grad_() for w in ws]

    class Own(OptimizerGraph):
        def bind_grads(self):
            if extend:  # the default's pairs for the first, a buffer of its own for the second
                pairs, gradless = super().bind_grads()
                (b,) = flat_like([ws[1].grad])
                b.copy_(ws[1].grad)
                ws[1].grad = b
                return [pr for pr in pairs if pr[0] is not ws[1]] + [(ws[1], b)], gradless
            bufs = flat_like([w.grad for w in ws])
            for w, b in zip(ws, bufs):
                b.copy_(w.grad)
                w.grad = b
            return list(zip(ws, bufs)), []

    graph = Own(torch.optim.SGD(ws, lr=0.1, fused=True), skip_nonfinite=False, backend="emulated")
    ref_opt = torch.optim.SGD(ref, lr=0.1)
    for i in range(5):  # eager, capture, replays
        x = torch.full((3,), float(i + 1))
        for params, step in ((ws, graph.step), (ref, ref_opt.step)):
            (params[0] * x + params[1] * x * x).sum().backward()
            step()
            for p in params:
                p.grad = None
    assert graph.captured
    for w, r in zip(ws, ref):
        torch.testing.assert_close(w.detach(), r.detach(), rtol=0, atol=0)


# -- one report shape -------------------------------------------------------------------------------


def _train_full(device, n=5):
    model = make_model(device)
    opt = make_optimizer("adamw", model, device)
    step = tgraph.FullIterationGraph(make_step(model, opt), warmup_steps=2)
    for b in make_batches(device, n=n):
        step(b)
    return step, model


def test_every_entry_reports_in_one_shape(backend, device):
    step, model = _train_full(device)
    report = step.capture_report()
    assert isinstance(report, tgraph.CaptureReport)
    assert report.entry == "FullIterationGraph"
    assert report.graphs == 1 and report.backends == [backend]
    mem = step.memory_report()
    assert isinstance(mem, tgraph.MemoryReport) and report.memory == mem
    x, y = make_batches(device, n=1)[0]
    assert mem.units == 1
    assert mem.static_inputs == x.nbytes + y.nbytes
    assert mem.static_outputs == 4  # the loss, one float32
    assert mem.param_grads == sum(p.nbytes for p in model.parameters())
    assert "FullIterationGraph graph" in str(report)

    p = torch.nn.Parameter(torch.ones(3, device=device))
    opt = torch.optim.SGD([p], lr=0.1, fused=True)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend=backend)
    empty = graph.capture_report()
    assert empty.graphs == 0 and empty.memory == tgraph.MemoryReport()
    for _ in range(3):
        p.grad = torch.ones(3, device=device)
        graph.step(torch.zeros((), device=device))
    report = graph.capture_report()
    assert (report.entry, report.graphs, report.backends) == ("OptimizerGraph", 1, [backend])
    assert report.memory.param_grads == graph.own_grad_bytes == p.nbytes
    assert report.memory.static_inputs == 4  # the static loss

    layers = tgraph.capture_report()  # per-layer graphs: none yet
    assert (layers.entry, layers.graphs) == ("layers", 0)
    assert tgraph.memory_report() == layers.memory


def test_layer_report_is_what_create_graphs_returned(backend, device):
    model = make_model(device)
    tgraph.enable(model, backend=backend)
    x, y = make_batches(device, 1)[0]
    model(x, y)[1].backward()
    report = tgraph.create_graphs()
    assert tgraph.capture_report() is report and report.entry == "layers"
    assert tgraph.memory_report() is report.memory
    assert {f.name for f in report.__dataclass_fields__.values()} >= {"graphs", "memory", "entry"}


# -- what reset() drops --------------------------------------------------------------------------------


def test_reset_drops_whole_step_graphs_too_and_reset_layer_graphs_does_not(backend, device):
    step, _ = _train_full(device)
    assert step.num_graphs == 1
    tgraph.reset_layer_graphs()
    assert step.num_graphs == 1
    p = torch.nn.Parameter(torch.ones(2, device=device))
    opt = torch.optim.SGD([p], lr=0.1, fused=True)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=False, backend=backend)
    for _ in range(2):
        p.grad = torch.ones(2, device=device)
        graph.step()
    assert graph.captured
    tgraph.reset()
    assert step.num_graphs == 0 and not graph.captured
    for _ in range(2):  # warms up and captures again
        p.grad = torch.ones(2, device=device)
        graph.step()
    assert graph.captured


def test_the_whole_step_registry_holds_entries_weakly():
    import gc

    gc.collect()
    before = len(step_capture._owners)
    graph = OptimizerGraph(_sgd(), skip_nonfinite=False)
    assert graph in set(step_capture._owners) and len(step_capture._owners) == before + 1
    del graph
    gc.collect()
    assert len(step_capture._owners) == before  # a graph nobody holds is not kept alive
    tgraph.reset()


# -- the backend decides ---------------------------------------------------------------------------------


def test_the_backend_answers_what_differs():
    f = GraphFactory("emulated", torch.device("cpu"))
    assert isinstance(f.impl, EmulatedBackend)
    assert f.executes_capture and f.backend == "emulated"
    assert (f.warmup_steps(None), f.warmup_steps(0), f.warmup_steps(3)) == (1, 0, 3)
    assert GraphFactory.for_device("auto", torch.device("cpu")).backend == "emulated"
    with pytest.raises(ValueError, match="unknown backend"):
        tgraph.OptimizerGraph(_sgd(), skip_nonfinite=False, backend="tpu")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        GraphFactory.for_device("cuda", torch.device("cpu"))


@pytest.mark.cuda
def test_the_cuda_backend_answers_what_differs():
    f = GraphFactory.for_device("auto", torch.device("cuda"))
    assert f.backend == "cuda" and not f.executes_capture
    assert (f.warmup_steps(None), f.warmup_steps(0)) == (2, 1)


def test_graphable_module_of_a_class_one_did_not_write(backend, device):
    """``GraphableModule.of(cls)``: one class per base (and namespace); an instance swapped to
    it replays (strict) with eager's gradients; a GraphableModule is returned as is."""
    torch.manual_seed(0)
    cls = tgraph.GraphableModule.of(torch.nn.Linear)
    assert cls is tgraph.GraphableModule.of(torch.nn.Linear)
    assert cls is not tgraph.GraphableModule.of(torch.nn.Linear, unread_attributes=frozenset("a"))
    assert tgraph.GraphableModule.of(cls) is cls
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)).to(device)
    eager = copy.deepcopy(model)
    model[1].__class__ = cls
    tgraph.enable(model, backend=backend, strict=True)
    x = torch.randn(2, 4, device=device)
    model(x).sum().backward()
    tgraph.create_graphs()
    model.zero_grad()
    model(x).sum().backward()
    eager(x).sum().backward()
    assert tgraph.capture_report().runners == 1
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_a_module_graphed_only_merged_runs_plainly_when_called_alone(backend, device):
    """``graphed_alone=False`` (graph_layers' final norm): right after a graphed layer it is
    graphed in that stack; called alone (an eager op between the two) it runs plainly: no
    graph of its own, no fallback (strict passes, ``eager_calls()`` stays 0), named in the
    report, eager's gradients."""
    norm_cls = tgraph.GraphableModule.of(torch.nn.LayerNorm, graphed_alone=False)
    layer_cls = tgraph.GraphableModule.of(torch.nn.Linear)
    for alone, runners in ((False, 2), (True, 1)):
        torch.manual_seed(0)
        norm, layer = torch.nn.LayerNorm(4).to(device), torch.nn.Linear(4, 4).to(device)
        between = [torch.nn.Tanh()] if alone else []
        model = torch.nn.Sequential(layer, *between, norm)
        eager = copy.deepcopy(model)
        norm.__class__, layer.__class__ = norm_cls, layer_cls
        tgraph.enable(model, backend=backend, strict=True)
        x = torch.randn(2, 4, device=device)
        model(x).sum().backward()
        report = tgraph.create_graphs()
        assert report.runners == runners and report.segments == runners - 1, report
        assert any("called alone" in e for e in report.eager_modules) == alone
        for _ in range(2):
            model.zero_grad()
            model(x).sum().backward()
        eager(x).sum().backward()
        assert tgraph.eager_calls() == 0
        for p, q in zip(model.parameters(), eager.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)
        if alone:  # plain under inference mode too (the graphed layer's call is refused there)
            with torch.inference_mode():
                torch.testing.assert_close(norm(x), eager[-1](x), rtol=0, atol=0)
        tgraph.disable(model)
