"""Activation recompute (torch.utils.checkpoint, non-reentrant) inside per-layer graphs.

The forward graph keeps only the checkpoint's inputs; the backward graph recomputes the forward
with the forward replay's random draws (tgraph.layers.backward.replay_backward), so dropout
masks and gradients equal eager checkpointing's.
"""

from __future__ import annotations

import functools

import pytest
import torch
from layer_models import ATOL, RTOL, gpt_batches, tiny_gpt
from torch.utils.checkpoint import checkpoint

import tgraph
from tgraph.layers import replay as bridge


def checkpointed(model, use_reentrant: bool = False):
    """Wrap every block's forward in torch.utils.checkpoint (instance attribute)."""
    for block in model.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=use_reentrant)
    return model


def train_grads(device, backend, *, graphed, ckpt=True, merge=True, dropout=0.2, steps=4):
    """Per-step parameter gradients of SGD training from one seed (graphs after step 1)."""
    model = tiny_gpt(device, dropout=dropout)
    if ckpt:
        checkpointed(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if graphed:
        tgraph.enable(model, backend=backend, strict=True, merge=merge)
    torch.manual_seed(7)
    if device.type == "cuda":
        torch.cuda.manual_seed(7)
    grads = []
    for i, (x, y) in enumerate(gpt_batches(device, steps)):
        _, loss = model(x, y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and i == 0:
            tgraph.create_graphs()
    tgraph.reset()
    return grads


def assert_same_grads(got, want):
    for step, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            torch.testing.assert_close(
                a, b, rtol=RTOL, atol=ATOL, msg=lambda m, step=step: f"step {step}: {m}"
            )


@pytest.mark.parametrize("merge", [True, False])
def test_checkpoint_grads_equal_eager_checkpointing_with_dropout(backend, device, merge):
    eager = train_grads(device, backend, graphed=False)
    graphed = train_grads(device, backend, graphed=True, merge=merge)
    assert_same_grads(graphed, eager)


def test_checkpoint_without_dropout_equals_eager_without_checkpoint(backend, device):
    eager = train_grads(device, backend, graphed=False, ckpt=False, dropout=0.0)
    graphed = train_grads(device, backend, graphed=True, dropout=0.0)
    assert_same_grads(graphed, eager)


@pytest.mark.usefixtures("no_verifier")  # the replays alone: the verifier would catch it
def test_planted_bug_recompute_draws_other_numbers_is_caught(backend, device, monkeypatch):
    """Without the rewind, the backward graph's recompute draws at the backward replay's
    generator offset, not the forward's: other dropout masks, wrong gradients."""

    def no_rewind(cap, state):
        cap.bwd_graph.replay()

    monkeypatch.setattr(bridge, "replay_backward", no_rewind)
    eager = train_grads(device, backend, graphed=False)
    graphed = train_grads(device, backend, graphed=True)
    with pytest.raises(AssertionError, match="step 1: Tensor-likes are not close"):
        assert_same_grads(graphed, eager)


@pytest.mark.usefixtures("no_verifier")  # the replays alone: the verifier would catch it
def test_planted_bug_rng_not_restored_in_recompute_is_caught(backend, device, monkeypatch):
    """A recompute that does not restore the RNG state (checkpoint's preserve_rng_state off in
    the graphed model only) draws other masks: the comparison must fail."""
    eager = train_grads(device, backend, graphed=False)
    monkeypatch.setattr(
        "torch.utils.checkpoint.checkpoint",
        functools.partial(checkpoint, preserve_rng_state=False),
    )
    monkeypatch.setitem(globals(), "checkpoint", torch.utils.checkpoint.checkpoint)
    graphed = train_grads(device, backend, graphed=True)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_same_grads(graphed, eager)


def saved_activations(device, backend, ckpt: bool, merge: bool) -> int:
    model = tiny_gpt(device, dropout=0.1)
    if ckpt:
        checkpointed(model)
    tgraph.enable(model, backend=backend, merge=merge)
    x, y = gpt_batches(device, 1)[0]
    model(x, y)[1].backward()
    report = tgraph.create_graphs()
    tgraph.reset()
    return report.memory.saved_activations


@pytest.mark.parametrize("merge", [True, False])
def test_forward_graph_keeps_only_what_recompute_needs(backend, device, merge):
    full = saved_activations(device, backend, ckpt=False, merge=merge)
    recompute = saved_activations(device, backend, ckpt=True, merge=merge)
    assert full > 0
    assert recompute <= full // 10, (recompute, full)


def test_unit_knows_it_recomputes(backend, device):
    model = checkpointed(tiny_gpt(device, dropout=0.1))
    tgraph.enable(model, backend=backend, merge=False)
    x, y = gpt_batches(device, 1)[0]
    model(x, y)[1].backward()
    tgraph.create_graphs()
    units = tgraph.layers.manager._manager.units
    assert units and all(u.cap.recomputes for u in units)


def test_reentrant_checkpoint_is_refused_with_a_clear_error(backend, device):
    model = checkpointed(tiny_gpt(device), use_reentrant=True)
    tgraph.enable(model, backend=backend, strict=True)
    x, y = gpt_batches(device, 1)[0]
    model(x, y)[1].backward()
    with pytest.raises(tgraph.CaptureError, match="use_reentrant=False"):
        tgraph.create_graphs()
    model(x, y)[1].backward()  # left eager: still trains
