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
    losses, main_grads = [], []
    if mode.startswith("layer"):  # "layer": main_grad fusion (the default here); "layer_hooks"
        tm.enable_layer_graphs(model, strict=True, main_grad_fusion=mode == "layer")
    step = (
        tgraph.FullIterationGraph(lambda mb: tm.forward_backward(model, mb), warmup_steps=3)
        if mode == "full"
        else (lambda mb: tm.forward_backward(model, mb))
    )
    for i, mb in enumerate(_batches(steps)):
        loss = step(mb)
        if i in (0, steps - 1):  # the recorded (eager) step and the last graphed one
            main_grads += [p.main_grad.clone() for p in model.parameters()]
        _sgd(model)
        losses.append(loss.item())
        if mode.startswith("layer") and i == 0:
            tgraph.create_graphs()
    if mode.startswith("layer"):
        tgraph.reset()
        tgraph.disable(model)
    return torch.tensor(losses), main_grads, model


@pytest.mark.parametrize("mode", ["layer", "layer_hooks", "full"])
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


def test_main_grad_fusion_follows_ddp_overlap_setting(monkeypatch):
    """Fusion is the default under megatron DDP without overlap_grad_reduce; with overlap (whose
    hooks dispatch the reductions) it is off by default and refused when asked for."""
    from tgraph.integrations import megatron as tm

    def fusion_flags(model):
        return {m._tgraph.main_grad_fusion for m in model.modules() if "_tgraph" in m.__dict__}

    model = tm.build_gpt(**DIMS)
    tm.enable_layer_graphs(model)
    assert fusion_flags(model) == {True}
    tgraph.disable(model)
    monkeypatch.setattr(tm, "_ddp_overlaps_grad_reduce", lambda m: True)
    with pytest.raises(ValueError, match="overlap_grad_reduce"):
        tm.enable_layer_graphs(model, main_grad_fusion=True)
    tm.enable_layer_graphs(model)
    assert fusion_flags(model) == {False}
    tgraph.disable(model)
