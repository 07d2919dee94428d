"""Fail closed where eager works: inference mode, nested tensors, data-dependent shapes, double
backward and transformers' output recording either equal eager or fail with a message that
names tgraph and the cause; never a crash from deep inside (tests/fail_closed_models.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fail_closed_models import (
    TOL,
    Block,
    D,
    assert_same_params,
    batches,
    fallbacks,
    make_pair,
)

import tgraph

STEPS = 4

# -- inference mode -----------------------------------------------------------------------------


def _eval_in_inference_mode_run(model, data, x_eval, backend=None):
    """Training steps, each followed by an evaluation under ``torch.inference_mode()``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if backend is not None:
        tgraph.enable(model, backend=backend)
    losses, evals = [], []
    for i, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        with torch.inference_mode():
            evals.append(model(x_eval).clone())
        if backend is not None and i == 0:
            tgraph.create_graphs()
    return torch.stack(losses), torch.cat(evals)


def test_inference_mode_calls_equal_eager(backend, device):
    """An evaluation under ``torch.inference_mode()`` between steps (the recorded one too):
    graphed or run eagerly, never "Inference tensors do not track version counter"."""
    model, ref = make_pair(device)
    data = batches(device, STEPS)
    x_eval = torch.randn(3, D, generator=torch.Generator().manual_seed(7)).to(device)
    want = _eval_in_inference_mode_run(ref, data, x_eval)
    got = _eval_in_inference_mode_run(model, data, x_eval, backend)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    assert_same_params(model, ref)


def test_inference_mode_inputs_after_capture(backend, device):
    """Training graphs captured; then a call with an inference tensor as input, in and out of
    inference mode: equals eager."""
    model, ref = make_pair(device)
    x, y = batches(device, 1)[0]
    tgraph.enable(model, backend=backend)
    F.mse_loss(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    with torch.inference_mode():
        x_inf = x * 2
        got = model(x_inf).clone()
        want = ref(x_inf).clone()
    torch.testing.assert_close(got, want, **TOL)
    with torch.no_grad():
        torch.testing.assert_close(model(x_inf).clone(), ref(x_inf), **TOL)


# -- nested tensors: nn.TransformerEncoder's fast path --------------------------------------


class GraphableEncoderLayer(tgraph.GraphableModule, nn.TransformerEncoderLayer):
    """PyTorch's encoder layer, graphed (its encoder hands it nested tensors in eval)."""


def _encoder(layer_cls) -> nn.TransformerEncoder:
    layer = layer_cls(D, nhead=2, dim_feedforward=2 * D, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=True)


class WrappedEncoder(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = _encoder(nn.TransformerEncoderLayer)

    def forward(self, x, pad):
        return self.encoder(x, src_key_padding_mask=pad)


def _padded_batches(device, n: int):
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(n):
        x = torch.randn(3, 6, D, generator=g)
        pad = torch.zeros(3, 6, dtype=torch.bool)
        pad[0, 4:] = True
        pad[2, 2:] = True
        out.append((x.to(device), pad.to(device)))
    return out


@pytest.mark.parametrize("graphed", ["layers", "wrapper"])
def test_transformer_encoder_with_padding_mask_in_eval(backend, device, graphed):
    """``nn.TransformerEncoder`` with a padding mask in eval (its nested-tensor fast path),
    its layers graphed or the whole encoder wrapped: no crash, outputs equal eager. The layers
    get nested tensors, which key no graph: they run eagerly (and create_graphs says that every
    call did). The wrapper's fast path reads the
    mask on the host, which a CUDA capture cannot contain: create_graphs says so (a
    CaptureError naming it) and the model keeps running eagerly."""
    torch.manual_seed(0)
    model = (_encoder(GraphableEncoderLayer) if graphed == "layers" else WrappedEncoder()).to(
        device
    )
    ref = copy.deepcopy(model)
    model.eval()
    ref.eval()
    tgraph.enable(model, backend=backend)
    data = _padded_batches(device, 3)
    got, want = [], []
    with fallbacks(), torch.no_grad():
        for i, (x, pad) in enumerate(data):
            if graphed == "layers":
                got.append(model(x, src_key_padding_mask=pad).clone())
                want.append(ref(x, src_key_padding_mask=pad))
            else:
                got.append(model(x, pad).clone())
                want.append(ref(x, pad))
            if i == 0:
                try:
                    tgraph.create_graphs()
                except tgraph.CaptureError as exc:
                    assert graphed == "wrapper" and "mask" in str(exc), exc
                except RuntimeError as exc:  # every call ran eagerly: nothing to capture
                    assert graphed == "layers" and "ran eagerly" in str(exc), exc
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)


# -- data-dependent output shapes ----------------------------------------------------------


class PositivePart(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return h[h > 0]  # shape depends on the values


def test_data_dependent_output_shape_is_refused_at_capture(backend, device):
    """``h[h > 0]`` in a graphed forward: create_graphs (``strict=True``) raises CaptureError
    naming the data-dependent shape (the ``nonzero`` inside ``aten::index``), not a crash at
    replay; without ``strict`` the module stays eager, named (test_capture_failure.py)."""
    torch.manual_seed(0)
    model = PositivePart().to(device)
    tgraph.enable(model, backend=backend, strict=True)
    x = torch.randn(4, D, device=device)
    model(x).sum().backward()
    with pytest.raises(tgraph.CaptureError, match="data-dependent"):
        tgraph.create_graphs()


# -- double backward ---------------------------------------------------------------------------


def _gradient_penalty_run(model, data, backend=None):
    """WGAN-GP style: the loss includes the norm of d(output)/d(input), differentiated again."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if backend is not None:
        tgraph.enable(model, backend=backend)
    losses = []
    for i, (x, y) in enumerate(data):
        x = x.clone().requires_grad_(True)
        out = model(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        loss = F.mse_loss(out, y) + ((g.norm(dim=1) - 1) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if backend is not None and i == 0:
            tgraph.create_graphs()
    return torch.stack(losses)


def test_double_backward_through_a_graphed_call(backend, device):
    """A gradient penalty backs through a graphed call's backward: equals eager, or a
    RuntimeError naming tgraph and the module (not only PyTorch's @once_differentiable)."""
    model, ref = make_pair(device)
    data = batches(device, STEPS)
    want = _gradient_penalty_run(ref, data)
    try:
        got = _gradient_penalty_run(model, data, backend)
    except RuntimeError as exc:
        msg = str(exc)
        assert "tgraph" in msg and Block.__name__ in msg, msg
    else:
        torch.testing.assert_close(got, want, **TOL)
        assert_same_params(model, ref)


# -- transformers' output recording -------------------------------------------------------


def test_hf_output_hidden_states_equals_eager_or_is_refused(backend, device):
    """A tiny Llama with graphed decoder layers trained with ``output_hidden_states=True``
    (transformers collects them with hooks inside the layers): equals eager, or an error naming
    ``output_hidden_states``; never an IndexError or "backward through the graph a second time"."""
    pytest.importorskip("transformers")
    from hf_models import make_layers_graphable, tiny_llama, token_batches

    model = tiny_llama(device)
    ref = copy.deepcopy(model)
    make_layers_graphable(model)
    data = token_batches(device, STEPS)

    def run(m, graphed):
        torch.manual_seed(1234)
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        if graphed:
            tgraph.enable(m, backend=backend)
        losses, hidden = [], []
        for i, ids in enumerate(data):
            out = m(input_ids=ids, labels=ids, use_cache=False, output_hidden_states=True)
            aux = sum(h.pow(2).mean() for h in out.hidden_states[1:])  # a hidden-state loss
            (out.loss + 0.01 * aux).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(out.loss.detach())
            hidden.append(torch.stack([h.detach() for h in out.hidden_states]))
            if graphed and i == 0:
                tgraph.create_graphs()
        return torch.stack(losses), torch.stack(hidden)

    want = run(ref, False)
    try:
        got = run(model, True)
    except Exception as exc:  # noqa: BLE001 - the type is part of what is checked
        assert not isinstance(exc, IndexError), exc
        assert "second time" not in str(exc), exc
        assert "output_hidden_states" in str(exc), exc
    else:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **TOL)


class _CheckpointingBase(nn.Module):
    """Like transformers' GradientCheckpointingLayer (<= 5.17): work done in ``__call__``."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)

    def forward(self, x):
        return x * 2


class _SwappedByHand(tgraph.GraphableModule, _CheckpointingBase):
    pass


def test_a_base_call_that_graphed_dispatch_skips_is_named_at_enable():
    """A class swap by hand puts GraphableModule.__call__ ahead of a base class's own
    ``__call__`` (transformers' gradient checkpointing): enable says so instead of dropping
    it silently."""
    with pytest.warns(UserWarning, match=r"_CheckpointingBase.__call__"):
        tgraph.enable(nn.Sequential(_SwappedByHand()), backend="emulated")
