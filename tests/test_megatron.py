"""tgraph on megatron-core's GPTModel (GPU only; needs megatron-core, Python >= 3.12)."""

from __future__ import annotations

import pytest
import torch

import tgraph

pytestmark = [pytest.mark.cuda, pytest.mark.megatron]

DIMS = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32)
LR = 0.05


@pytest.fixture(scope="module", autouse=True)
def megatron_env():
    from tgraph.integrations import megatron as tm

    tm.init_single_gpu()
    yield


def _batches(n, micro=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randint(0, 256, (4, 32), generator=g).cuda(),
                torch.randint(0, 256, (4, 32), generator=g).cuda(),
            )
            for _ in range(micro)
        ]
        for _ in range(n)
    ]


@torch.no_grad()
def _sgd(model):
    for p in model.parameters():
        p.sub_(LR * p.main_grad)


def _train(mode: str, steps: int, dropout: float = 0.0):
    from tgraph.integrations import megatron as tm

    model = tm.build_gpt(**DIMS, dropout=dropout)
    losses, main_grads = [], None
    if mode == "layer":
        tm.enable_layer_graphs(model, strict=True)
    step = (
        tgraph.FullIterationGraph(lambda mb: tm.forward_backward(model, mb), warmup_steps=3)
        if mode == "full"
        else (lambda mb: tm.forward_backward(model, mb))
    )
    for i, mb in enumerate(_batches(steps)):
        loss = step(mb)
        if i == 0:
            main_grads = [p.main_grad.clone() for p in model.parameters()]
        _sgd(model)
        losses.append(loss.item())
        if mode == "layer" and i == 0:
            tgraph.create_graphs()
    if mode == "layer":
        tgraph.reset()
        tgraph.disable(model)
    return torch.tensor(losses), main_grads, model


@pytest.mark.parametrize("mode", ["layer", "full"])
def test_twenty_steps_match_megatron_eager(mode):
    ref, ref_grads, _ = _train("none", 20)
    got, grads, _ = _train(mode, 20)
    # fp32, same kernels; SGD keeps rounding differences at rounding size (see layer_models.py)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dropout_masks_change_and_training_matches_statistically():
    from tgraph.integrations import megatron as tm

    ref, _, _ = _train("none", 20, dropout=0.1)
    got, _, model = _train("layer", 20, dropout=0.1)
    assert abs(got[-5:].mean() - ref[-5:].mean()) < 0.05 * ref[-5:].mean()
    tm.enable_layer_graphs(model)
    mb = _batches(1, micro=1)[0]
    tm.forward_backward(model, mb)
    tgraph.create_graphs()
    tokens, labels = mb[0]
    pos, mask = tm.causal_inputs(tokens)
    a = model(tokens, pos, mask, labels=labels).detach().clone()
    b = model(tokens, pos, mask, labels=labels).detach().clone()
    assert not torch.equal(a, b), "dropout mask repeated across replays"
