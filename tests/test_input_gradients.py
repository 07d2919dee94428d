"""Input gradients: what a graphed unit's backward hands autograd for its inputs.

The backward graph writes them into static buffers, each alone on its storage (not the
grad-output buffer, which the next backward rewrites and ``debug=True`` poisons)."""

from __future__ import annotations

import copy

import pytest
import torch
from layer_models import ATOL, RTOL

import tgraph
from tgraph.layers import grads as grads_module
from tgraph.layers.grads import own_storages


def _exact(backend: str) -> dict:
    """Bitwise on the emulated backend (the same kernels on the same values); on CUDA a graph
    may pick another GEMM algorithm than the eager call (layer_models.RTOL says why)."""
    return dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=RTOL, atol=ATOL)


class _Shifted(tgraph.GraphableModule):
    """``x + shift``: autograd's gradient of ``x`` is the incoming gradient itself, i.e. the
    backward graph's grad-output buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


class _Linear(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_an_input_gradient_that_is_the_grad_output_buffer_gets_a_buffer_of_its_own(
    backend, device, swaps
):
    """An input gradient autograd returned as the grad-output buffer (which the next backward
    rewrites, and debug=True fills with NaN after each backward) gets a buffer of its own:
    the previous unit's gradients equal eager's with debug on."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Linear(), _Shifted()).to(device)
    ref = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True, debug=True, merge=False)
    x = torch.randn(4, 8, device=device)
    for i in range(3):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            (m(x) ** 2).sum().backward()
        if i == 0:
            tgraph.create_graphs()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **_exact(backend), msg=name)
    assert tgraph.eager_calls() == 0
    (unit,) = model[1]._tgraph.runners.values()
    cap = unit[0].cap
    (grad_in,) = cap.static_grads
    outs = {g.untyped_storage()._cdata for g in cap.static_grad_outputs}
    assert grad_in.untyped_storage()._cdata not in outs


def test_planted_bug_input_gradient_on_the_grad_output_buffer_is_caught(
    backend, device, monkeypatch
):
    """Planted: input gradients kept where the capture's autograd made them (the grad-output
    buffer here), which debug mode poisons before the previous unit reads it."""
    real = grads_module.own_storages
    monkeypatch.setattr(
        "tgraph.layers.capture.own_storages",
        lambda grads, others, whole: list(grads) if not whole else real(grads, others, whole),
    )
    with pytest.raises(tgraph.GraphFallbackError, match="differs from eager's"):
        test_an_input_gradient_that_is_the_grad_output_buffer_gets_a_buffer_of_its_own(
            backend, device, True
        )


def test_input_gradients_are_copied_only_where_they_share_a_storage():
    """In the captured backward an input gradient is copied only where its storage is another
    static tensor's (the grad-output buffer here) or an earlier gradient's; one alone on its
    storage stays as autograd laid it out (a strided view, an offset)."""
    grad_out, big, strided = torch.randn(3, 4), torch.randn(10), torch.randn(4, 3).t()
    grads = [None, grad_out, big[2:7], strided, big[:2]]
    got = own_storages(grads, others=[grad_out, None], whole=False)
    assert got[0] is None and got[2] is grads[2] and got[3] is grads[3]  # kept, no copy
    for k in (1, 4):  # copied: the grad-output buffer's storage, then big's again
        assert got[k].untyped_storage().data_ptr() != grads[k].untyped_storage().data_ptr()
        torch.testing.assert_close(got[k], grads[k], rtol=0, atol=0)
