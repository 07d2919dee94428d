"""The emulated backend's own contract: every CPU test's oracle, tested.

Each property is one that a CUDA graph has and that, if the emulated graph lacked it, would let
a tgraph bug pass the CPU suite: static memory only, no Python at replay (attributes, globals,
branches and substituted weights keep their capture-time effect), fixed addresses, frozen
unregistered generators, host syncs and data-dependent shapes refused,
``is_current_stream_capturing()`` for the captured code only, and a pool whose replays overwrite
what a GPU replay may overwrite.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tgraph.backend import GraphFactory
from tgraph.emulated import EmulatedGraph
from tgraph.guards import CaptureError


def test_replay_reads_only_the_captured_inputs_and_writes_the_captured_outputs():
    x = torch.ones(3)
    g = EmulatedGraph()
    out = g.capture(lambda: x * 2)
    x.fill_(5)  # refresh the static input in place: seen
    g.replay()
    assert torch.equal(out, torch.full((3,), 10.0))
    fresh = torch.full((3,), 7.0)  # a new tensor is not the captured input: not seen
    g.replay()
    assert torch.equal(out, torch.full((3,), 10.0)) and fresh[0] == 7


def test_unregistered_generator_replays_the_captures_numbers_registered_one_advances():
    frozen, fresh = EmulatedGraph(), EmulatedGraph()
    fresh.register_generator_state(torch.default_generator)
    a = frozen.capture(lambda: torch.rand(4))
    b = fresh.capture(lambda: torch.rand(4))
    first_a, first_b = a.clone(), b.clone()
    frozen.replay()
    fresh.replay()
    assert torch.equal(a, first_a), "a graph bakes in an unregistered generator's state"
    assert not torch.equal(b, first_b), "a registered generator draws fresh numbers"


def test_replay_follows_the_captures_training_flags():
    torch.manual_seed(0)
    drop = nn.Dropout(0.5)
    g = EmulatedGraph()
    g.register_generator_state(torch.default_generator)
    x = torch.ones(1000)
    drop.eval()
    out = g.capture(lambda: drop(x))
    drop.train()  # a CUDA graph still holds the eval kernels (no dropout)
    g.replay()
    assert torch.equal(out, x)
    assert drop.training, "the live flag is left as it was"


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))
        self.temperature = 2.0
        self.enabled = True

    def forward(self, x):
        y = x * self.w / self.temperature
        return y + 1 if self.enabled else y


def test_replay_runs_no_python_attributes_and_branches_keep_their_capture_time_effect():
    m, x = _Scaled(), torch.ones(3)
    g = EmulatedGraph()
    out = g.capture(lambda: m(x))
    m.temperature, m.enabled = 4.0, False  # read by forward: a CUDA graph baked 2.0 and `+ 1`
    g.replay()
    assert torch.equal(out, torch.full((3,), 1.5))


_GLOBAL_SCALE = [3.0]


def test_a_global_read_in_the_captured_code_is_baked_in():
    x = torch.ones(2)
    g = EmulatedGraph()
    out = g.capture(lambda: x * _GLOBAL_SCALE[0])
    _GLOBAL_SCALE[0] = 5.0
    try:
        g.replay()
    finally:
        _GLOBAL_SCALE[0] = 3.0
    assert torch.equal(out, torch.full((2,), 3.0))


def test_repointed_parameter_storage_is_not_seen_the_graph_reads_the_old_memory():
    m, x = _Scaled(), torch.ones(3)
    g = EmulatedGraph()
    out = g.capture(lambda: m(x))
    old = m.w.data
    m.w.data = torch.full((3,), 10.0)  # new storage: the graph keeps the captured address
    g.replay()
    assert torch.equal(out, torch.full((3,), 1.5))
    old.fill_(4.0)  # the captured memory itself: seen
    g.replay()
    assert torch.equal(out, torch.full((3,), 3.0))


def test_functional_call_weights_of_the_capture_are_baked_in():
    m, x = _Scaled(), torch.ones(3)
    ema = {"w": torch.full((3,), 6.0)}
    g = EmulatedGraph()
    out = g.capture(lambda: torch.func.functional_call(m, ema, (x,)))
    assert torch.equal(out, torch.full((3,), 4.0))
    ema["w"] = torch.zeros(3)  # another dict entry: the graph still reads the captured tensor
    g.replay()
    assert torch.equal(out, torch.full((3,), 4.0))


def test_outputs_kept_by_the_caller_are_overwritten_by_the_next_replay():
    x = torch.ones(2)
    g = EmulatedGraph()
    out = g.capture(lambda: x + 1)
    view = out[:1]
    x.fill_(3)
    g.replay()
    assert torch.equal(out, torch.full((2,), 4.0)) and view.item() == 4.0


def test_backward_is_replayed_from_the_tape_on_the_captured_activations():
    w = torch.ones(3, requires_grad=True)
    x = torch.full((3,), 2.0)
    fwd, bwd = EmulatedGraph(), EmulatedGraph()
    y = fwd.capture(lambda: (w * x).exp())
    grad = bwd.capture(lambda: torch.autograd.grad(y, [w], torch.ones(3))[0])
    x.fill_(1.0)
    fwd.replay()
    bwd.replay()
    torch.testing.assert_close(grad, torch.full((3,), math.e))


def test_data_dependent_shapes_are_refused_at_capture():
    x = torch.randn(8)
    for fn in (
        lambda: x[x > 0],
        lambda: torch.nonzero(x),
        lambda: torch.masked_select(x, x > 0),
        lambda: torch.unique(x),
    ):
        with pytest.raises(CaptureError, match="data-dependent"):
            EmulatedGraph().capture(fn)


def test_host_reads_are_refused_at_capture():
    x = torch.ones(2)
    for fn in (lambda: x * float(x.sum()), lambda: x if torch.equal(x, x) else x, x.tolist):
        with pytest.raises(CaptureError, match="host synchronization"):
            EmulatedGraph().capture(fn)


def test_an_unregistered_generator_passed_to_an_op_is_refused_at_capture():
    gen = torch.Generator().manual_seed(0)
    g = EmulatedGraph()
    with pytest.raises(CaptureError, match="register_generator"):
        g.capture(lambda: torch.rand(3, generator=gen))
    ok = EmulatedGraph()
    ok.register_generator_state(gen)
    out = ok.capture(lambda: torch.rand(3, generator=gen))
    first = out.clone()
    ok.replay()
    assert not torch.equal(out, first), "a registered generator draws fresh numbers"


def test_capture_answers_is_current_stream_capturing_and_replay_runs_no_python():
    seen = []

    def fn():
        seen.append(torch.cuda.is_current_stream_capturing())
        return torch.ones(1)

    original = torch.cuda.is_current_stream_capturing
    g = EmulatedGraph()
    g.capture(fn)
    g.replay()
    assert seen == [True], "the capture takes a CUDA capture's branch; replay runs no Python"
    assert torch.cuda.is_current_stream_capturing is original  # (raises on a CPU-only build)


def test_torch_optimizers_on_cpu_tensors_are_not_told_a_cuda_capture_runs():
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    g = EmulatedGraph()
    g.capture(opt.step)  # a fused CPU step is capturable here, on a machine with a GPU too
    before = p.detach().clone()
    g.replay()
    assert not torch.equal(p, before)


def test_capture_failure_restores_is_current_stream_capturing():
    original = torch.cuda.is_current_stream_capturing
    g = EmulatedGraph()
    with pytest.raises(ZeroDivisionError):
        g.capture(lambda: 1 / 0)
    assert torch.cuda.is_current_stream_capturing is original


def _pool():
    return GraphFactory("emulated")


def test_replay_poisons_outputs_of_graphs_captured_later():
    f = _pool()
    x = torch.ones(4)
    early, late = f.new_graph(), f.new_graph()
    a = early.capture(lambda: x + 1)
    b = late.capture(lambda: x + 2)
    late.replay()
    assert torch.equal(b, torch.full((4,), 3.0))
    early.replay()  # may reuse what `late`'s outputs occupy: they are garbage now
    assert b.isnan().all() and torch.equal(a, torch.full((4,), 2.0))
    late.replay()
    assert torch.equal(b, torch.full((4,), 3.0))


def test_replay_leaves_outputs_of_earlier_captures_alone():
    f = _pool()
    x = torch.ones(4)
    early, late = f.new_graph(), f.new_graph()
    a = early.capture(lambda: x + 1)
    late.capture(lambda: x + 2)
    early.replay()
    late.replay()
    assert torch.equal(a, torch.full((4,), 2.0))


def _forward_backward(f, w):
    fwd = f.new_graph()
    out = fwd.capture(lambda: (w * torch.ones(3)).exp())

    def backward():
        return torch.autograd.grad(out, [w], [torch.ones(3)])

    bwd = f.new_graph(frees=fwd)
    grad = bwd.capture(backward)
    return fwd, bwd, out, grad


def test_saved_activations_are_poisoned_by_graphs_captured_outside_their_lifetime():
    """A forward's saved activations live from its capture to its backward's capture; a graph
    captured after the backward may reuse them, one captured in between may not."""
    f = _pool()
    w = torch.ones(1, requires_grad=True)
    x = torch.ones(2)
    fwd, bwd, _, grad = _forward_backward(f, w)
    after = f.new_graph()
    after.capture(lambda: x * 3)
    fwd.replay()
    after.replay()  # between fwd and bwd, out of the recorded order
    bwd.replay()
    assert math.isnan(grad[0].item())
    fwd.replay()  # in order: exact
    bwd.replay()
    after.replay()
    torch.testing.assert_close(grad[0], torch.tensor([3 * math.e]))


def test_saved_activations_survive_graphs_captured_inside_their_lifetime():
    f = _pool()
    w = torch.ones(1, requires_grad=True)
    fwd = f.new_graph()
    out = fwd.capture(lambda: (w * torch.ones(3)).exp())
    inside = f.new_graph()
    inside.capture(lambda: torch.ones(2) * 5)  # captured while fwd's activations were alive
    bwd = f.new_graph(frees=fwd)
    grad = bwd.capture(lambda: torch.autograd.grad(out, [w], [torch.ones(3)]))
    fwd.replay()
    inside.replay()
    bwd.replay()
    torch.testing.assert_close(grad[0], torch.tensor([3 * math.e]))
