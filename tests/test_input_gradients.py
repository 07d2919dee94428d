"""Input gradients: what a graphed unit's backward hands autograd for its inputs.

The backward graph writes them into static buffers, each alone on its storage (not the
grad-output buffer, which the next backward rewrites and ``debug=True`` poisons), that its next
replay (and the forward replays of graphs captured before it) overwrite. A caller may keep them:
``torch.autograd.grad(loss, x)`` w.r.t. a graphed unit's input, a tensor hook that stores its
gradient (saliency, Grad-CAM), gradients w.r.t. a Hugging Face model's ``inputs_embeds``; what
it holds keeps its values (:class:`tgraph.layers.grads.GradHandOff`), as in eager."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import tiny_llama
from layer_models import ATOL, RTOL, tiny_gpt

import tgraph
from tgraph.integrations import transformers as tg_hf
from tgraph.layers import grads as grads_module
from tgraph.layers.grads import GradHandOff, own_storages

STEPS = 4


def _exact(backend: str) -> dict:
    """Bitwise on the emulated backend (the same kernels on the same values); on CUDA a graph
    may pick another GEMM algorithm than the eager call (layer_models.RTOL says why)."""
    return dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=RTOL, atol=ATOL)


def _blocks(model, x: torch.Tensor) -> torch.Tensor:
    for block in model.h:
        x = block(x)
    return x


def _kept_input_gradients(model, device, how: str, leaf: bool, graphed: bool) -> list:
    """Per step, the gradient w.r.t. the blocks' input (``how``: by autograd.grad, or kept by a
    tensor hook), then another step's backward through the same blocks (the next micro-batch)
    before the next one; every gradient is kept to the end. Graphs created after step 0."""
    kept = []
    for i in range(STEPS):
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(2, 8, 32, generator=gen).to(device).requires_grad_()
        h = x if leaf else x * 1.0
        loss = _blocks(model, h).square().mean()
        if how == "autograd.grad":
            (g,) = torch.autograd.grad(loss, h)
        else:
            box: list[torch.Tensor] = []
            h.register_hook(box.append)
            loss.backward()
            (g,) = box
        kept.append(g)
        x2 = torch.randn(2, 8, 32, generator=gen).to(device).requires_grad_()
        _blocks(model, x2).sum().backward()
        model.zero_grad(set_to_none=True)
        if graphed and i == 0:
            tgraph.create_graphs()
    return kept


def _check_kept(backend, device, replays, how, leaf, merge, direct) -> None:
    model = tiny_gpt(device)
    eager = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True, merge=merge, direct_grads=direct)
    got = _kept_input_gradients(model, device, how, leaf, graphed=True)
    want = _kept_input_gradients(eager, device, how, leaf, graphed=False)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **_exact(backend), msg=f"step {step}")
    # strict: every later call replayed; each graph twice a step (two forwards, two backwards)
    assert tgraph.eager_calls() == 0
    assert replays[0] == 2 * tgraph.capture_report().graphs * (STEPS - 1) > 0


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non_leaf"])
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_block"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "autograd"])
def test_an_input_gradient_from_autograd_grad_kept_across_steps(
    backend, device, replays, swaps, leaf, merge, direct
):
    """``(gx,) = torch.autograd.grad(loss, x)`` kept while the graphs replay again equals
    eager's gx, on every path (a leaf or a computed input, merged blocks or one unit each,
    parameter gradients written directly or through autograd, storage swap or copies)."""
    _check_kept(backend, device, replays, "autograd.grad", leaf, merge, direct)


@pytest.mark.parametrize("leaf", [True, False], ids=["leaf", "non_leaf"])
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per_block"])
def test_an_input_gradient_a_tensor_hook_keeps(backend, device, replays, swaps, leaf, merge):
    """``x.register_hook(box.append)`` (saliency, Grad-CAM): the gradient the hook keeps
    equals eager's after later steps replayed the graphs."""
    _check_kept(backend, device, replays, "hook", leaf, merge, True)


def _saliency(model, device, graphed: bool) -> list:
    """Gradients w.r.t. ``inputs_embeds``, one batch after another, all kept."""
    maps = []
    for i in range(STEPS):
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(i))
        ids = ids.to(device)
        emb = model.get_input_embeddings()(ids).detach().requires_grad_()
        loss = model(inputs_embeds=emb, labels=ids).loss
        maps.append(torch.autograd.grad(loss, emb)[0])
        if graphed and i == 0:
            tgraph.create_graphs()
    return maps


def test_hf_llama_saliency_over_inputs_embeds(backend, device, replays, swaps):
    """A saliency map per batch, w.r.t. a LlamaForCausalLM's ``inputs_embeds`` (the graphed
    decoder stack's input), kept over the batches: each equals eager's."""
    model = tiny_llama(device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, backend=backend, strict=True)
    got = _saliency(model, device, graphed=True)
    want = _saliency(eager, device, graphed=False)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, **_exact(backend), msg=f"batch {step}")
    assert tgraph.eager_calls() == 0
    assert replays[0] == tgraph.capture_report().graphs * (STEPS - 1) > 0


def _plant_static_input_gradients(mp: pytest.MonkeyPatch) -> None:
    """The old hand-off: autograd gets the static input-gradient buffers themselves."""
    mp.setattr(GradHandOff, "for_inputs", lambda self: list(self.inputs))


@pytest.mark.usefixtures("no_verifier")  # the replays alone: the verifier would catch it
@pytest.mark.parametrize("how", ["autograd.grad", "hook"])
def test_planted_bug_static_input_gradients_handed_out_are_caught(backend, device, replays, how):
    with pytest.MonkeyPatch.context() as mp:
        _plant_static_input_gradients(mp)
        with pytest.raises(AssertionError, match="step [123]"):
            _check_kept(backend, device, replays, how, False, True, True)


@pytest.mark.usefixtures("no_verifier")
def test_planted_bug_static_saliency_maps_are_caught(backend, device, replays):
    with pytest.MonkeyPatch.context() as mp:
        _plant_static_input_gradients(mp)
        with pytest.raises(AssertionError, match="batch [12]"):
            test_hf_llama_saliency_over_inputs_embeds(backend, device, replays, True)


def test_training_keeps_no_input_gradient_and_copies_nothing(backend, device, swaps, monkeypatch):
    """The usual step (backward, optimizer step, zero_grad(set_to_none=True)): nothing but
    autograd holds an input gradient until the next replay, so nothing is moved out of the
    graph's memory; a gradient the caller keeps is moved once, at the next replay."""
    moved = []
    real = grads_module.move_memory_out
    monkeypatch.setattr(
        grads_module, "move_memory_out", lambda t, keep: moved.append(real(t, keep))
    )
    model = tiny_gpt(device)
    tgraph.enable(model, backend=backend, strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 8, 32, device=device, requires_grad=True)
    for i in range(STEPS):
        h = x * 1.0  # as an embedding's output: its gradient flows on through autograd
        _blocks(model, h).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i == 0:
            tgraph.create_graphs()
    assert moved == [] and tgraph.eager_calls() == 0
    kept = []
    for _ in range(2):
        h = x.detach().clone().requires_grad_()
        kept.append(torch.autograd.grad(_blocks(model, h).sum(), h)[0])
    assert len(moved) == (1 if swaps else 0)  # the first, before the second step's replays


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
