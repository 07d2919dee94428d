"""Copies of a graphed model (``copy.deepcopy``, pickling, ``swa_utils.AveragedModel``, EMA and
best-model copies) are ordinary eager models: they carry none of tgraph's state, and the
original keeps replaying its graphs (strict mode: a fallback would raise)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel

import tgraph
from tgraph.layers.enable import is_enabled

D = 8
STEPS = 6


class Block(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(D, 1)).to(device)


def make_batches(device: torch.device, n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, D, generator=g).to(device), torch.randn(4, 1, generator=g).to(device))
        for _ in range(n)
    ]


@pytest.fixture
def graphed(backend, device):
    """A trained model with per-layer graphs (strict: no silent fallback)."""
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tgraph.enable(model, backend=backend, strict=True)
    for i, (x, y) in enumerate(make_batches(device, 2)):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:
            tgraph.create_graphs()
    yield model, opt
    tgraph.reset()
    tgraph.disable(model)


def pickled(model: nn.Module) -> nn.Module:
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copy_of_a_graphed_model_is_an_eager_model(graphed, device, how, replays):
    model, _ = graphed
    twin = copy.deepcopy(model) if how == "deepcopy" else pickled(model)
    assert not any(is_enabled(m) for m in twin.modules())
    assert all(is_enabled(m) for m in model.modules() if isinstance(m, Block))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert p is not q and p.data_ptr() != q.data_ptr()
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    x, y = make_batches(device, 1)[0]
    # the copy runs eagerly (no replay), trains on its own, and leaves the original alone
    before = replays[0]
    want = twin(x)
    F.mse_loss(want, y).backward()
    assert replays[0] == before
    assert all(p.grad is None for p in model.parameters())
    assert all(q.grad is not None for q in twin.parameters())
    # the original keeps replaying (strict=True: a fallback would raise), on the same numbers
    got = model(x)
    F.mse_loss(got, y).backward()
    assert replays[0] == before + 2  # the blocks merge: one forward and one backward graph
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


def test_averaged_model_of_a_graphed_model(backend, device, replays):
    """``swa_utils.AveragedModel`` deep-copies the model: an SWA/EMA average of graphed
    training equals the average of eager training, and the training kept replaying."""

    def train(graphed: bool):
        model = make_model(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if graphed:
            tgraph.enable(model, backend=backend, strict=True)
        try:
            for i, (x, y) in enumerate(make_batches(device)):
                F.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if i == 0:
                    if graphed:
                        tgraph.create_graphs()
                    swa = AveragedModel(model)  # a deep copy, taken after the capture
                else:
                    swa.update_parameters(model)
        finally:
            tgraph.reset()
            tgraph.disable(model)
        return swa

    swa = train(graphed=True)
    assert replays[0] == 2 * (STEPS - 1)  # the blocks merge: one forward, one backward graph
    ref = train(graphed=False)
    for p, q in zip(swa.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    x, _ = make_batches(device, 1)[0]
    with torch.no_grad():
        torch.testing.assert_close(swa(x), ref(x), rtol=0, atol=0)
