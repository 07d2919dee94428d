"""Merged neighbours (tgraph.segment): one forward and one backward graph for a stack."""

from __future__ import annotations

import pytest
import torch
from layer_models import ATOL, RTOL, MLPNet, mlp_batches, twin

import tgraph
from tgraph.segment import Segment


def _model(device):
    torch.manual_seed(0)
    return MLPNet(n=4).to(device)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _record_and_capture(model, backend, x, y):
    tgraph.enable(model, backend=backend)
    model(x, y)[1].backward()
    model.zero_grad(set_to_none=True)
    report = tgraph.create_graphs()
    assert report.segments == 1 and report.graphs == 2
    return report


def test_intermediate_outputs_used_outside_get_their_gradients(backend, device):
    """Hidden states collected for an auxiliary loss: gradients through every output."""
    model = _model(device)
    eager = twin(model)
    x, y = mlp_batches(device, 1)[0]

    def step(m):
        h = m.inp(x)
        hidden = []
        for b in m.blocks:
            h = b(h)
            hidden.append(h)
        loss = torch.nn.functional.mse_loss(m.out(h), y) + sum(t.pow(2).mean() for t in hidden[:-1])
        loss.backward()
        return loss.detach()

    tgraph.enable(model, backend=backend, strict=True)
    step(model)
    model.zero_grad(set_to_none=True)
    assert tgraph.create_graphs().segments == 1
    for _ in range(2):
        torch.testing.assert_close(step(model), step(eager), rtol=RTOL, atol=ATOL)
        got, want = _grads(model), _grads(eager)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=ATOL, msg=n)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


def check_inplace_change_between_blocks(backend, device):
    """Eager code that modifies a block's output in place before the next block."""
    model = _model(device)
    eager = twin(model)
    x, y = mlp_batches(device, 1)[0]

    def step(m, modify):
        h = m.inp(x)
        for i, b in enumerate(m.blocks):
            h = b(h)
            if modify and i == 1:
                with torch.no_grad():
                    h.mul_(2.0)  # in place: the next block must see the doubled values
        return m.out(h)

    _record_and_capture(model, backend, x, y)
    with pytest.warns(tgraph.GraphFallbackWarning, match="merged stack"):
        got = step(model, modify=True)
    torch.testing.assert_close(got, step(eager, modify=True), rtol=RTOL, atol=ATOL)


def test_inplace_change_between_blocks_is_not_answered_by_the_merged_graph(backend, device):
    check_inplace_change_between_blocks(backend, device)


def test_planted_bug_missing_version_check_is_caught(backend, device, monkeypatch):
    real_take = Segment.take

    def take_without_version_check(self, runner, tensors):
        self._versions = [t._version for s in self.pending or [] for t in s] or self._versions
        return real_take(self, runner, tensors)

    monkeypatch.setattr(Segment, "take", take_without_version_check)
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_inplace_change_between_blocks(backend, device)


def test_block_called_out_of_order_runs_eagerly(backend, device):
    model = _model(device)
    x, y = mlp_batches(device, 1)[0]
    _record_and_capture(model, backend, x, y)
    h = model.inp(x).detach().requires_grad_()
    with pytest.warns(tgraph.GraphFallbackWarning, match="module 2 of a merged stack"):
        got = model.blocks[2](h)
    torch.testing.assert_close(got, torch.nn.Module.__call__(model.blocks[2], h))


def test_merge_false_graphs_each_block(backend, device):
    model = _model(device)
    x, y = mlp_batches(device, 1)[0]
    tgraph.enable(model, backend=backend, merge=False)
    model(x, y)[1].backward()
    report = tgraph.create_graphs()
    assert report.segments == 0 and report.graphs == 2 * len(model.blocks)
