"""Skipping non-finite steps with a CUDA-graph IF node (``how="conditional"``, experimental:
tgraph/step/if_node.py).

On the CPU: the protocol of the IF-node step (against a stand-in for the capturing graph: the
node opens right before the step and closes right after it, before the skip counter; nothing is
snapshotted; an error inside the step still closes it), its routing (eager steps and CPU flags
take the mask way; ``how="conditional"`` where IF nodes are unavailable fails naming the fix).
The planted-NaN comparisons with eager runs for both ways are in tests/test_optimizer_graph.py.

On the GPU: the captured step inside a real IF node, a NaN planted at a replay, bitwise equal to
an eager run that skips that step, with ``set_sync_debug_mode("error")`` silent over the
replays; a planted always-true flag is caught. Where torch builds no IF nodes (torch 2.11), the
GPU test asserts the error instead.
"""

from __future__ import annotations

import pytest
import torch
from test_optimizer_graph import (
    CFG,
    LR,
    assert_same_training_state,
    make_batches,
    make_model,
    plant,
)

import tgraph
from tgraph.guards import CaptureError
from tgraph.step import if_node, nonfinite
from tgraph.step.nonfinite import ConditionalNodesUnavailable, SkipNonfinite, _Step

# -- the protocol, against a stand-in for torch's capturing graph (CPU) -------------------------


class FakeCapturingGraph:
    """Records what ``torch.cuda.CUDAGraph.get_currently_capturing_graph()`` is asked to do."""

    def __init__(self, events: list) -> None:
        self.events = events

    def begin_capture_to_if_node(self, flag: torch.Tensor) -> None:
        self.events.append(("begin", flag))

    def end_capture_to_conditional_node(self) -> None:
        self.events.append(("end",))


@pytest.fixture
def events(monkeypatch) -> list:
    log: list = []
    graph = FakeCapturingGraph(log)
    monkeypatch.setattr(
        torch.cuda.CUDAGraph,
        "get_currently_capturing_graph",
        staticmethod(lambda: graph),
        raising=False,
    )
    return log


def sgd(params) -> torch.optim.Optimizer:
    """Not fused: the mask way snapshots its parameters and momentum."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, foreach=True)


def logged_step(opt: torch.optim.Optimizer, log: list):
    def step():
        log.append(("step",))
        opt.step()

    return step


def test_if_node_holds_the_step_only(events, monkeypatch):
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 0.25)
    opt = sgd([p])
    guard = SkipNonfinite("conditional")
    ok = torch.tensor(True)
    with guard.protect([opt], ok=ok) as commit:  # a CPU flag: the mask way (a snapshot)
        opt.step()
        commit(ok)
    assert guard.last_way == "snapshot" and guard._snapshots
    assert events == []

    count = guard._count
    monkeypatch.setattr(guard, "_count", lambda flag: (events.append(("count",)), count(flag)))
    step = logged_step(opt, events)
    with _Step(guard, [opt], [], "if_node", ok) as commit:
        step()
        commit(ok)
    assert [e[0] for e in events] == ["begin", "step", "end", "count"]
    assert events[0][1] is ok
    assert guard.last_way == "if_node"
    assert not guard._snapshots  # the warmups' snapshot buffers are freed, none is taken
    assert guard.skipped_steps == 0


def test_error_inside_the_step_closes_the_if_node(events):
    p = torch.nn.Parameter(torch.ones(2))
    opt = sgd([p])
    guard = SkipNonfinite("conditional")
    with pytest.raises(RuntimeError, match="boom"):
        with _Step(guard, [opt], [], "if_node", torch.tensor(True)):
            raise RuntimeError("boom")
    assert [e[0] for e in events] == ["begin", "end"]


def test_state_created_inside_the_if_node_is_refused_after_closing_it(events, monkeypatch):
    """As the mask way: a captured step must not create optimizer state (OptimizerGraph then
    runs it eagerly and captures the next one)."""
    # what an emulated capture answers (tgraph.emulated.emulated_capture patches it the same way)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = sgd([p])  # no momentum buffer yet: the step creates it
    guard = SkipNonfinite("conditional")
    ok = torch.tensor(True)
    with pytest.raises(CaptureError, match="created its state"):
        with _Step(guard, [opt], [], "if_node", ok) as commit:
            logged_step(opt, events)()
            commit(ok)
    assert [e[0] for e in events] == ["begin", "step", "end"]


class CudaFlag:
    """What ``SkipNonfinite`` reads of a CUDA flag when it picks the way (CPU stand-in)."""

    is_cuda = True
    device = torch.device("cuda", 0)


def test_routing(monkeypatch):
    opt = sgd([torch.nn.Parameter(torch.ones(2))])
    with pytest.raises(ValueError, match="how must be one of"):
        SkipNonfinite("if")
    with pytest.raises(ValueError, match="needs the flag before the step"):
        SkipNonfinite("conditional").protect([opt])
    assert not if_node.uses_if_node("conditional", torch.tensor(True))  # a CPU flag

    monkeypatch.setattr(if_node, "conditional_nodes_unavailable", lambda device: "no IF here")
    with pytest.raises(ConditionalNodesUnavailable, match=r"no IF here.*how='mask'.*2\.13"):
        if_node.uses_if_node("conditional", CudaFlag())
    assert not if_node.uses_if_node("auto", CudaFlag())  # the IF node is opt-in only
    assert not if_node.uses_if_node("mask", CudaFlag())

    monkeypatch.setattr(if_node, "conditional_nodes_unavailable", lambda device: None)
    # torch's own stream query: no CUDA capture under way (eager) takes the mask way
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: False, raising=False)
    assert not if_node.uses_if_node("conditional", CudaFlag())
    monkeypatch.setattr(torch._C, "_cuda_isCurrentStreamCapturing", lambda: True, raising=False)
    assert if_node.uses_if_node("conditional", CudaFlag())
    assert not if_node.uses_if_node("auto", CudaFlag())


def test_availability_is_answered_with_a_reason():
    reason = nonfinite.conditional_nodes_unavailable()
    if not torch.cuda.is_available():
        assert "no CUDA device" in reason
    else:
        assert reason is None or isinstance(reason, str)


# -- on the GPU: a real IF node --------------------------------------------------------------------


def make_cuda_optimizer(model, kind: str) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(
            model.parameters(), lr=LR, weight_decay=0.1, fused=True, capturable=True
        )
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, capturable=True)


def run_cuda(kind: str, *, graphed: bool, bad=(), steps: int = 12, sync_check: bool = False):
    """Steps 0 (eager, creates the state) and 1 (capture); replays from 2 on. A NaN loss (and
    NaN gradients) at the steps in ``bad``; the eager run skips them."""
    device = torch.device("cuda")
    model = make_model(device)
    opt = make_cuda_optimizer(model, kind)
    graph = (
        tgraph.OptimizerGraph(
            opt, clip_grad_norm=0.05, skip_nonfinite=True, skip_nonfinite_how="conditional"
        )
        if graphed
        else None
    )
    for i, (x, y) in enumerate(make_batches(device, steps)):
        loss = plant("grad_nan" if i in bad else None, model, model(x, y)[1])
        loss.backward()
        if not graphed:
            if i not in bad:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
            opt.zero_grad(set_to_none=True)
            continue
        if sync_check and graph.captured:
            torch.cuda.set_sync_debug_mode("error")
        try:
            graph.step(loss)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return model, opt, graph


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_if_node_skips_a_replayed_nan_step_bitwise(kind):
    if missing := nonfinite.conditional_nodes_unavailable("cuda"):
        with pytest.raises(ConditionalNodesUnavailable, match="how='mask'") as err:
            run_cuda(kind, graphed=True, bad={5})
        assert missing in str(err.value)
        return
    model, opt, graph = run_cuda(kind, graphed=True, bad={5, 6, 9}, sync_check=True)
    ref_model, ref_opt, _ = run_cuda(kind, graphed=False, bad={5, 6, 9})
    assert graph.captured and graph.guard.last_way == "if_node"
    assert not graph.guard._snapshots  # nothing snapshotted for the graph
    assert_same_training_state(model, opt, ref_model, ref_opt)
    assert graph.skipped_steps == 3
    assert CFG.n_layer == 2  # the model the bitwise claim was made for


@pytest.mark.cuda
def test_planted_always_true_flag_is_caught(monkeypatch):
    """The naive version: the step inside an IF node whose flag is always true (the step is
    never skipped) must differ from the eager run that skips the NaN step."""
    if nonfinite.conditional_nodes_unavailable("cuda"):
        pytest.skip("no CUDA-graph IF nodes here: see test_if_node_skips_a_replayed_nan_step")
    true = torch.ones((), dtype=torch.bool, device="cuda")
    real = torch.cuda.CUDAGraph.get_currently_capturing_graph

    class AlwaysTrue:
        def __init__(self, graph):
            self.graph = graph

        def begin_capture_to_if_node(self, flag):
            self.graph.begin_capture_to_if_node(true)

        def end_capture_to_conditional_node(self):
            self.graph.end_capture_to_conditional_node()

    monkeypatch.setattr(
        torch.cuda.CUDAGraph,
        "get_currently_capturing_graph",
        staticmethod(lambda: AlwaysTrue(real())),
    )
    model, opt, _ = run_cuda("foreach", graphed=True, bad={5})
    ref_model, ref_opt, _ = run_cuda("foreach", graphed=False, bad={5})
    with pytest.raises(AssertionError, match="differs from eager"):
        assert_same_training_state(model, opt, ref_model, ref_opt)
