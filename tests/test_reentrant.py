"""Graphed modules called during a backward pass: reentrant torch.utils.checkpoint around a
merged stack recomputes its forward inside the autograd engine, where a replay would overwrite
buffers that graphs still in flight need. Such calls run eagerly (one warning), the rest of the
step replays, and gradients equal eager reentrant checkpointing's."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import tgraph
from tgraph.errors import GraphFallbackWarning


class Block(tgraph.GraphableModule):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.tanh(self.fc(x)))


class Checkpointed(torch.nn.Module):
    """Three blocks under one reentrant checkpoint, then a graphed head outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = Block()

    def _stack(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x):
        return self.head(checkpoint(self._stack, x, use_reentrant=True))


def _train(model, device, *, graphed: bool, backend: str | None = None, steps: int = 4, made=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if graphed:
        tgraph.enable(model, backend=backend)
    torch.manual_seed(3)
    grads, caught = [], []
    for i in range(steps):
        x = torch.randn(8, 16, device=device, requires_grad=True)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model(x).pow(2).mean().backward()
        caught += [str(m.message) for m in w if issubclass(m.category, GraphFallbackWarning)]
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and i == 0:
            report = tgraph.create_graphs()
            if made is not None:
                made.append(report)
    fallbacks = tgraph.eager_calls()
    tgraph.reset()
    return grads, caught, fallbacks


@pytest.mark.parametrize("merge", [True, False])
def test_reentrant_checkpoint_recompute_runs_eagerly(backend, device, merge):
    torch.manual_seed(0)
    model = Checkpointed().to(device)
    eager = copy.deepcopy(model)
    want, _, _ = _train(eager, device, graphed=False)
    tgraph.enable(model, backend=backend, merge=merge)
    got, caught, fallbacks = _train(model, device, graphed=True, backend=backend)
    for step, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, msg=lambda m, step=step: f"step {step}: {m}")
    # the recomputes (3 blocks, 3 steps after capture), and only they, ran eagerly: the
    # checkpoint's no-grad forwards and the head replayed
    assert caught and all("during a backward pass" in m for m in caught), caught
    assert fallbacks == 9


class _InputThenCheckpoint(torch.nn.Module):
    """Issue 44, item 9: an eager input layer, then reentrant checkpointing around graphed
    blocks with dropout and an eager dropout between them, then an eager head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        self.head = torch.nn.Linear(16, 1)

    def _stack(self, x):
        x = torch.nn.functional.dropout(x, 0.2)
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x):
        return self.head(checkpoint(self._stack, self.inp(x), use_reentrant=True))


@pytest.mark.parametrize("merge", [True, False])
def test_reentrant_checkpoint_draws_the_same_dropout_in_forward_and_recompute(
    backend, device, merge
):
    """The checkpoint's no-grad forward replays graphs and its recompute runs eagerly: both
    must draw the same dropout masks, or every gradient below the checkpoint (``inp.weight``)
    is wrong. Bitwise: the same kernels on the same values."""
    torch.manual_seed(0)
    model = _InputThenCheckpoint().to(device)
    eager = copy.deepcopy(model)
    want, _, _ = _train(eager, device, graphed=False)
    with tgraph.verification(first=0, every=0):  # the replays alone, nothing re-run
        tgraph.enable(model, backend=backend, merge=merge)
        got, _, fallbacks = _train(model, device, graphed=True, backend=backend)
    assert fallbacks == 9  # only the recomputes ran eagerly: the no-grad forwards replayed
    for step, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"


class _CheckpointEachBlock(torch.nn.Module):
    """A reentrant checkpoint around each graphed block (what ``gradient_checkpointing_enable``
    does to a transformer's layers), every block's forward under no_grad there."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(3))
        for b in self.blocks:
            b.drop.p = p

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True)
        return x


@pytest.mark.parametrize("p", [0.3, 0.0])
def test_checkpoint_around_each_block_recomputes_the_dropout_it_drew(backend, device, p):
    """Each checkpoint saves the generators' state as its block starts and its recompute draws
    from it: a merged stack would have drawn every block's masks by the second checkpoint's
    start, so the blocks that draw stay apart (bitwise: the same kernels on the same values);
    blocks that draw nothing still merge."""
    torch.manual_seed(0)
    model = _CheckpointEachBlock(p).to(device)
    eager = copy.deepcopy(model)
    want, _, _ = _train(eager, device, graphed=False)
    made = []
    with tgraph.verification(first=0, every=0):  # the replays alone, nothing re-run
        got, _, fallbacks = _train(model, device, graphed=True, backend=backend, made=made)
    assert fallbacks == 9  # only the recomputes ran eagerly: the no-grad forwards replayed
    for step, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"
    assert made[0].segments == (0 if p else 1), made[0]
