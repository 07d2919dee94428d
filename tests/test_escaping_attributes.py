"""A forward that stores a tensor it computed on the module (``self.aux_loss = ...``, as
Switch/Mixtral-style mixture-of-experts layers do, for the loss to add later). A replay runs no
Python, so the graph returns the stored tensors as extra outputs and each replay stores them
in those attributes again: the loss that adds them trains exactly as eager."""

from __future__ import annotations

import copy

import pytest
import torch

import tgraph


class Router(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)
        self.z_loss = None  # set by every forward, on a submodule

    def forward(self, x):
        logits = self.gate(x)
        self.z_loss = logits.logsumexp(-1).pow(2).mean()
        return logits.softmax(-1)


class MoE(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.router = Router()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.aux_loss = None

    def forward(self, x):
        probs = self.router(x)
        self.aux_loss = probs.mean(0).pow(2).sum() * 4  # load balancing
        out = sum(probs[:, i : i + 1] * e(x) for i, e in enumerate(self.experts))
        return x + out


def _train(model, device, *, graphed: bool, steps: int = 5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator(device=device).manual_seed(1)
    losses = []
    for i in range(steps):
        y = torch.randn(6, 8, device=device, generator=gen)
        for blk in model:
            y = blk(y)
        aux = sum(b.aux_loss + 0.1 * b.router.z_loss for b in model)
        loss = y.pow(2).mean() + 0.01 * aux
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and i == 0:
            tgraph.create_graphs()
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("merge", [True, False])
def test_a_stored_auxiliary_loss_is_an_extra_output_of_the_graph(backend, device, merge):
    torch.manual_seed(0)
    model = torch.nn.Sequential(MoE(), MoE(), MoE()).to(device)
    eager = copy.deepcopy(model)
    want = _train(eager, device, graphed=False)
    tgraph.enable(model, backend=backend, strict=True, merge=merge)  # every later call replays
    got = _train(model, device, graphed=True)
    exact = {"rtol": 0, "atol": 0} if backend == "emulated" else {}
    torch.testing.assert_close(got[0], want[0], **exact)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, **exact)
    assert all(isinstance(b.aux_loss, torch.Tensor) for b in model)
    tgraph.reset()
