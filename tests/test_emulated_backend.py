"""The emulated backend's own contract: every CPU test's oracle, tested (issue 12).

Each property is one that a CUDA graph has and that, if the emulated graph lacked it, would let
a tgraph bug pass the CPU suite: static memory only, frozen unregistered generators, the
capture's control flow, host syncs refused, ``is_current_stream_capturing()`` during capture,
and a pool whose replays overwrite what a GPU replay may overwrite.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tgraph.backend import EmulatedGraph, GraphFactory
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
    g = EmulatedGraph(freeze=[drop])
    g.register_generator_state(torch.default_generator)
    x = torch.ones(1000)
    drop.eval()
    out = g.capture(lambda: drop(x))
    drop.train()  # a CUDA graph still holds the eval kernels (no dropout)
    g.replay()
    assert torch.equal(out, x)
    assert drop.training, "the live flag is left as it was"


def test_host_sync_during_capture_is_refused():
    g = EmulatedGraph()
    with pytest.raises(CaptureError, match="host synchronization"):
        g.capture(lambda: torch.ones(2) * torch.ones(1).item())


def test_capture_and_replay_answer_is_current_stream_capturing():
    seen = []

    def fn():
        seen.append(torch.cuda.is_current_stream_capturing())
        return torch.ones(1)

    original = torch.cuda.is_current_stream_capturing
    g = EmulatedGraph()
    g.capture(fn)
    g.replay()
    assert seen == [True, True]
    assert torch.cuda.is_current_stream_capturing is original  # (raises on a CPU-only build)


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
    fwd = f.new_graph(external=[w])
    out = fwd.capture(lambda: (w * torch.ones(3)).exp())

    def backward():
        return torch.autograd.grad(fwd.live_outputs, [w], [torch.ones(3)], retain_graph=True)

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
    fwd = f.new_graph(external=[w])
    fwd.capture(lambda: (w * torch.ones(3)).exp())
    inside = f.new_graph()
    inside.capture(lambda: torch.ones(2) * 5)  # captured while fwd's activations were alive
    bwd = f.new_graph(frees=fwd)
    grad = bwd.capture(
        lambda: torch.autograd.grad(fwd.live_outputs, [w], [torch.ones(3)], retain_graph=True)
    )
    fwd.replay()
    inside.replay()
    bwd.replay()
    torch.testing.assert_close(grad[0], torch.tensor([3 * math.e]))
