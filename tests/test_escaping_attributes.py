"""A forward that stores a tensor it computed on the module (``self.aux_loss = ...``, as
Switch/Mixtral-style mixture-of-experts layers do, for the loss to add later). A replay cannot
set that attribute, and the stored tensor would keep the capture's autograd graph: the capture
refuses it by name, and training goes on eagerly or stops with that one line, never with
autograd's "backward through the graph a second time"."""

from __future__ import annotations

import pytest
import torch

import tgraph
from tgraph.guards import CaptureError


class AuxLoss(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.router = torch.nn.Linear(8, 4)
        self.aux_loss = None

    def forward(self, x):
        logits = self.router(x)
        self.aux_loss = logits.softmax(-1).pow(2).mean()
        return x + logits.sum(-1, keepdim=True)


def test_tensor_stored_on_the_module_is_refused_by_name(backend, device):
    model = torch.nn.Sequential(AuxLoss()).to(device)
    tgraph.enable(model, backend=backend, strict=True)
    x = torch.randn(4, 8, device=device)
    (model(x).sum() + model[0].aux_loss).backward()
    with pytest.raises(CaptureError, match=r"AuxLoss\.aux_loss"):
        tgraph.create_graphs()
