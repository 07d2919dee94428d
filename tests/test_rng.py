"""Random numbers under graphs: dropout draws new masks at every replay; unregistered
generators are caught."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL, gpt_batches, tiny_gpt, twin

import tgraph
from tgraph import rng


class GenDropout(tgraph.GraphableModule):
    """Dropout drawing from an explicit generator (like a model-parallel RNG tracker)."""

    def __init__(self, generator: torch.Generator | None) -> None:
        super().__init__()
        self.generator = generator
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, device=x.device, generator=self.generator) > 0.5
        return self.lin(x) * keep


def check_masks_change(backend, device, *, explicit_generator: bool):
    """Graphed dropout draws a new mask at every replay."""
    gen = None
    if explicit_generator:
        gen = torch.Generator(device=device).manual_seed(123)
        tgraph.register_generator(gen)
    torch.manual_seed(0)
    mod = GenDropout(gen).to(device)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    mod(x).sum().backward()
    tgraph.create_graphs()
    masks = []
    for _ in range(3):
        y = mod(x)
        y.sum().backward()
        masks.append((y != 0).clone())
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2]), (
        "dropout mask repeated across replays: generator not registered with the graph"
    )


@pytest.mark.parametrize("explicit_generator", [False, True])
def test_dropout_masks_change_every_replay(backend, device, explicit_generator):
    if backend == "cuda" and not explicit_generator:
        pass  # PyTorch registers the default CUDA generator itself
    check_masks_change(backend, device, explicit_generator=explicit_generator)


def test_planted_bug_unregistered_rng_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(rng, "graph_generators", lambda device: [])
    with pytest.raises((AssertionError, RuntimeError), match="dropout mask repeated|capture"):
        # emulated: the unregistered generator is frozen -> same mask each replay;
        # CUDA: the explicit generator is not registered -> frozen mask or a capture error.
        check_masks_change(backend, device, explicit_generator=True)


def test_gpt_dropout_is_random_and_eval_never_replays_training_graph(backend, device):
    model = tiny_gpt(device, dropout=0.3)
    eager = twin(model)
    tgraph.enable(model, backend=backend)
    x, y = gpt_batches(device, 1)[0]
    model(x, y)[1].backward()
    tgraph.create_graphs()
    a = model(x, y)[0].detach().clone()
    b = model(x, y)[0].detach().clone()
    assert tgraph.eager_calls() == 0  # both replayed: new masks each
    assert not torch.equal(a, b)
    model.eval()
    eager.eval()
    with pytest.warns(
        tgraph.GraphFallbackWarning, match="module.training changed from True to False"
    ):
        got = model(x, y)[0]
    torch.testing.assert_close(got, eager(x, y)[0], rtol=RTOL, atol=ATOL)
