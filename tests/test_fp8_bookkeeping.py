"""tgraph's TransformerEngine FP8 bookkeeping on the CPU, against a stand-in of TE's delayed
scaling (tests/fake_te.py): the te.autocast region keys calls and is entered again for the
capture, and a replay redoes the backward amax reduction of the region's first FP8 module.
Each part, planted out, changes the numbers; the real TE runs in tests/test_te.py on a GPU."""

from __future__ import annotations

import contextlib
import copy

import fake_te
import pytest
import torch

import tgraph
from tgraph.fp8 import FP8Region, FP8Replay


class Block(tgraph.GraphableModule):
    def __init__(self, te) -> None:
        super().__init__()
        self.fc = te.Linear(8, 8)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


def _train(model, te, recipe, *, graphed: bool, steps: int = 5):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    losses, scales = [], []
    for i in range(steps):
        x = torch.randn(4, 8, generator=gen) * (1 + i)
        with te.autocast(enabled=True, recipe=recipe):
            y = x
            for blk in model:
                y = blk(y)
        loss = y.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        scales.append(
            [
                m.fp8_meta[k].scale.clone()
                for m in model.modules()
                if hasattr(m, "fp8_meta")
                for k in ("scaling_fwd", "scaling_bwd")
            ]  # fmt: skip
        )
        if graphed and i == 0:
            tgraph.create_graphs()
    return torch.stack(losses), scales


def _run(monkeypatch, backend):
    te = fake_te.install(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(te), Block(te))
    twin = copy.deepcopy(model)
    recipe = te.Recipe()
    want = _train(twin, te, recipe, graphed=False)
    fake_te.reset()
    tgraph.enable(model, backend=backend, strict=True)
    try:
        got = _train(model, te, recipe, graphed=True)
    finally:
        tgraph.reset()
    return got, want


def _equal(got, want) -> bool:
    same = torch.equal(got[0], want[0])
    return same and all(torch.equal(a, b) for g, w in zip(got[1], want[1]) for a, b in zip(g, w))


def test_fp8_delayed_scaling_replays_as_eager(monkeypatch):
    got, want = _run(monkeypatch, "emulated")
    assert len(fake_te.FP8GlobalStateManager.quantization_state.buffer) == 2
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1], want[1]):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_planted_backward_scale_update_out_of_the_replay_is_seen(monkeypatch):
    monkeypatch.setattr(FP8Replay, "after_backward", lambda self: None)
    assert not _equal(*_run(monkeypatch, "emulated"))


def test_planted_capture_outside_the_fp8_region_is_seen(monkeypatch):
    monkeypatch.setattr(FP8Region, "capture_context", lambda self: contextlib.nullcontext())
    assert not _equal(*_run(monkeypatch, "emulated"))


def test_region_change_after_capture_finds_no_graph(monkeypatch):
    te = fake_te.install(monkeypatch)
    model = torch.nn.Sequential(Block(te))
    tgraph.enable(model, backend="emulated", strict=True)
    _train(model, te, te.Recipe(), graphed=True, steps=2)
    x = torch.randn(4, 8)
    with te.autocast(enabled=True, recipe=te.Recipe(margin=1)):  # another recipe
        with pytest.raises(tgraph.GraphFallbackError, match="autocast changed"):
            model(x)
    with pytest.raises(tgraph.GraphFallbackError, match="autocast changed"):
        model(x)  # FP8 off
    tgraph.reset()
