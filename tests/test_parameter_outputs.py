"""A graphed module that returns one of its own parameters as an output (a learned scale the
caller applies): the output is the parameter's memory, not the pool's. Gradients reach it and
every other parameter as in eager, and an output kept across steps is never moved out from
under the parameter."""

from __future__ import annotations

import copy

import pytest
import torch

import tgraph


class ScaleOut(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.fc(x), self.scale


def _train(model, device, *, graphed: bool, keep: bool, steps: int = 5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator(device=device).manual_seed(1)
    kept, grads = [], []
    for i in range(steps):
        y = torch.randn(4, 8, device=device, generator=gen)
        loss = 0
        for blk in model:
            y, scale = blk(y)
            y = y * scale
            if keep:
                kept.append(scale)  # the returned tensor itself, kept across steps
            loss = loss + y.pow(2).mean()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and i == 0:
            tgraph.create_graphs()
    return grads, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
@pytest.mark.parametrize("merge", [True, False])
def test_a_parameter_returned_as_an_output_trains_as_eager(backend, device, merge, keep):
    torch.manual_seed(0)
    model = torch.nn.Sequential(ScaleOut(), ScaleOut()).to(device)
    eager = copy.deepcopy(model)
    want = _train(eager, device, graphed=False, keep=keep)
    tgraph.enable(model, backend=backend, strict=True, merge=merge)
    got = _train(model, device, graphed=True, keep=keep)
    for step, (g, w) in enumerate(zip(got[0], want[0])):
        for a, b in zip(g, w):
            torch.testing.assert_close(a, b, msg=lambda m, step=step: f"step {step}: {m}")
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b)
