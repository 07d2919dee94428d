"""The graphs' memory by kind (tgraph.memory): each kind is the size of its buffers, and on a
GPU the buffers held between steps add up to what capture left allocated."""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn
from layer_models import MLPBlock, MLPNet, gpt_batches, tiny_gpt, train

import tgraph


def _first_capture(device) -> None:
    """A capture first in its process also allocates the libraries' per-stream workspaces on
    the capture stream (cuBLAS: tens of MiB), which no graph buffer accounts for: do it once."""
    model = tiny_gpt(device)
    tgraph.enable(model, backend="cuda")
    model(*gpt_batches(device, 1)[0])[1].backward()
    tgraph.create_graphs()
    tgraph.reset()
    tgraph.disable(model)


def test_memory_report_adds_up(backend, device):
    if backend == "cuda":
        _first_capture(device)
    model = tiny_gpt(device)  # 3 blocks, d=32, batch 4, seq 16: merged into one stack
    tgraph.enable(model, backend=backend, strict=True)
    x, y = gpt_batches(device, 1)[0]
    model(x, y)[1].backward()  # recorded: each block's runner clones its input as a sample
    model.zero_grad(set_to_none=True)
    samples = sum(
        s.nbytes for r in tgraph.layers.manager._manager.all_runners() for s in r.draft.call.samples
    )
    report = tgraph.create_graphs()  # frees the samples
    mem = tgraph.memory_report()
    assert report.memory == mem and mem.units == 1
    block_out = 4 * 16 * 32 * 4  # one block's output, fp32 bytes
    assert mem.static_outputs == 3 * block_out
    assert mem.grad_outputs == 3 * block_out  # one buffer per differentiable output
    assert mem.static_inputs == block_out and mem.input_grads == block_out  # the stack's input
    params = sum(p.numel() for b in model.h for p in b.parameters()) * 4
    assert mem.param_grads == params
    assert mem.saved_activations > mem.static_outputs  # attention and MLP intermediates
    assert mem.held == sum(
        (mem.static_inputs, mem.static_outputs, mem.grad_outputs, mem.input_grads, params)
    )
    if backend == "cuda":  # the buffers are what the capture left allocated (samples freed)
        assert report.pool_bytes + samples == pytest.approx(mem.held, rel=0.1)


def test_memory_report_is_empty_before_capture():
    assert tgraph.memory_report().units == 0 and tgraph.memory_report().held == 0


def test_report_names_every_kind_it_holds(backend, device):
    model = tiny_gpt(device)
    train(model, gpt_batches(device, 2), graphed=True, backend=backend)
    text = str(tgraph.capture_report())
    for kind in ("static_outputs", "saved_activations", "param_grads", "held"):
        assert kind in text
    assert torch.cuda.is_available() or "pool 0.0 MiB" in text


def test_report_counts_the_recorded_steps_grads(backend, device):
    """Gradients still alive at create_graphs() add to the peak of creating the graphs: the
    report says how much, and how to avoid it; zeroed first, it reports none."""
    # Models of earlier tests that were enabled and never disabled stay among tgraph's roots
    # (and their gradients in the count) until the garbage collector frees them (a module and
    # its runners form a cycle); on CUDA, GraphFactory collects before counting, emulated not.
    gc.collect()
    for zero_first in (False, True):
        model = tiny_gpt(device)
        tgraph.enable(model, backend=backend)
        x, y = gpt_batches(device, 1)[0]
        model(x, y)[1].backward()
        if zero_first:
            model.zero_grad(set_to_none=True)
        grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
        report = tgraph.create_graphs()
        assert report.memory.grads_at_capture == grads == tgraph.memory_report().grads_at_capture
        assert ("zero_grad(set_to_none=True) before create_graphs()" in str(report)) != zero_first
        tgraph.reset()
        tgraph.disable(model)


def test_capture_samples_are_dropped_before_the_backward_captures(backend, device, monkeypatch):
    """A runner's recorded inputs are copied into its static inputs when its forward is
    captured; held on, every later capture would hold them too (the peak of creating the graphs)."""
    from tgraph.layers.capture import GraphedUnit

    seen = []
    capture_backward = GraphedUnit.capture_backward

    def spy(self, factory):
        seen.append(
            sum(len(r.draft.call.samples) for r in tgraph.layers.manager._manager.all_runners())
        )
        return capture_backward(self, factory)

    monkeypatch.setattr(GraphedUnit, "capture_backward", spy)
    model = tiny_gpt(device)
    tgraph.enable(model, backend=backend, merge=False)
    x, y = gpt_batches(device, 1)[0]
    model(x, y)[1].backward()
    tgraph.create_graphs()
    assert seen and seen == [0] * len(seen)


def _peak_above(fn) -> int:
    """Bytes ``fn`` allocated at its peak above what was allocated before it (CUDA)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _verified_step_peak(model, step) -> int:
    """Enable ``model`` (CUDA, strict), record and capture with ``step``, one unverified
    replayed step, then the peak (:func:`_peak_above`) of a step with every replay verified."""
    with tgraph.verification(first=0, every=0):
        tgraph.enable(model, backend="cuda", strict=True)
        step()  # recorded
        tgraph.create_graphs()
        step()
    with tgraph.verification(every=1):
        return _peak_above(step)


@pytest.mark.cuda
def test_creating_graphs_holds_each_gradient_once():
    """A weight-heavy stack (8 blocks of 16 MiB, tiny activations): creating its graphs peaks
    about where eager's step does, each parameter gradient held once, as eager's backward holds
    it (ParamGradOutputs). Packing the gradients into one flat buffer inside the graph held
    them twice at the end of the capture: 2x here. Replayed steps peak no higher than eager."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = MLPNet(d=1024, n=8).to(device)
    x, y = torch.randn(4, 8, device=device), torch.randn(4, 1, device=device)

    def step():
        model(x, y)[1].backward()
        model.zero_grad(set_to_none=True)

    step()  # cuBLAS workspaces and the like, before anything is measured
    eager = _peak_above(step)
    grads = sum(p.nbytes for b in model.blocks for p in b.parameters())
    assert grads <= eager < 1.2 * grads
    tgraph.enable(model, backend="cuda", strict=True)
    model(x, y)[1].backward()  # recorded
    model.zero_grad(set_to_none=True)
    created = _peak_above(tgraph.create_graphs)
    assert created < eager + grads // 4, (created, eager, grads)
    for _ in range(2):  # the shadow verifier's first replays: each reruns the unit eagerly
        step()  # beside the replay (its gradients on top), then one replay in 1000
    replayed = _peak_above(step)
    assert replayed <= eager and tgraph.eager_calls() == 0


@pytest.mark.cuda
def test_a_verified_replay_holds_one_members_activations(monkeypatch):
    """8 activation-heavy blocks (hidden 8d: about 80 MiB of saved activations each, 8 MiB
    outputs, small weights): a verified replay reruns the stack eagerly beside the graphs, whose pool
    holds the replay's activations. The eager twin keeps each block's inputs and outputs, not
    its activations, and the verified backward runs one block at a time (tgraph.layers.verify):
    the step holds the outputs and one block's activations on top of the replay, not a second
    copy of all of them (about eager's step again: 1.26x eager's peak at HF Llama d1024)."""
    from tgraph.layers import verify

    device = torch.device("cuda")
    torch.manual_seed(0)
    blocks = nn.ModuleList(MLPBlock(128, hidden=8) for _ in range(8)).to(device)
    x = torch.randn(16384, 128, device=device, requires_grad=True)

    def step():
        h = x
        for b in blocks:
            h = b(h)
        h.square().mean().backward()
        blocks.zero_grad(set_to_none=True)
        x.grad = None

    step()
    eager = _peak_above(step)
    verified = []
    real = verify.checked_replay
    monkeypatch.setattr(
        verify, "checked_replay", lambda unit, *a: verified.append(1) or real(unit, *a)
    )
    checked = _verified_step_peak(blocks, step)
    assert verified == [1] and tgraph.eager_calls() == 0  # one verified replay, no fallback
    assert checked < 0.5 * eager, (checked, eager)


class _Whole(tgraph.GraphableModule):
    """A unit that graphs its parts (as graph_layers(model, whole=True)'s model): its graphable
    blocks are captured inside its graphs, or keep graphs of their own where it cannot be."""

    graphs_parts = True

    def __init__(self, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


def test_a_verified_whole_unit_checkpoints_its_parts(backend, device, monkeypatch, swaps):
    """The shadow verifier's eager twin of a whole unit runs its graphable parts under
    non-reentrant checkpoint (tgraph.layers.capture.parts_checkpointed): forward and the
    backward's rerun, one checkpoint per block each, counted; the verified steps keep eager's
    numbers (strict: a mismatch would raise) and the unit replays (no eager call)."""
    import tgraph.layers.manager as manager

    calls = []
    real = manager._checkpoint
    monkeypatch.setattr(manager, "_checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    blocks = nn.ModuleList(MLPBlock(16, hidden=4) for _ in range(3)).to(device)
    ref = _Whole(blocks).to(device)
    model = copy.deepcopy(ref)
    xs = [torch.randn(8, 16, device=device) for _ in range(4)]

    def train(m, steps):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        out = []
        for i, x in enumerate(xs):
            loss = m(x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.detach())
            if steps is not None and i == 0:
                steps()
        return torch.stack(out)

    want = train(ref, None)
    tgraph.enable(model, backend=backend, strict=True)
    with tgraph.verification(every=1):
        got = train(model, tgraph.create_graphs)
    assert torch.equal(got, want)
    assert tgraph.eager_calls() == 0
    assert len(calls) == 3 * 2 * 3, len(calls)  # 3 verified steps, forward and rerun, 3 blocks


@pytest.mark.cuda
def test_a_verified_whole_unit_holds_one_parts_activations():
    """The whole-unit twin of the test above: 8 activation-heavy blocks inside one unit. A
    verified replay's eager twin without checkpointed parts holds every block's activations
    beside the graphs (about eager's step again); with them, the blocks' inputs and one
    block's activations."""
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = _Whole(nn.ModuleList(MLPBlock(128, hidden=8) for _ in range(8))).to(device)
    x = torch.randn(16384, 128, device=device)

    def step():
        model(x).backward()
        model.zero_grad(set_to_none=True)

    step()
    eager = _peak_above(step)
    checked = _verified_step_peak(model, step)
    assert tgraph.eager_calls() == 0
    assert checked < 0.5 * eager, (checked, eager)
