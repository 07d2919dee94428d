"""Fail closed at the edges of torch's API: forward-mode AD and torch.func transforms into graphed
layers, and a backward
restricted to some inputs in the recorded step. Each either equals eager or stops with a message
that names tgraph, the cause and the fix; never a crash from inside torch
(tests/fail_closed_models.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from fail_closed_models import (
    TOL,
    assert_never_silent,
    assert_same_params,
    batches,
    fallbacks,
    make_pair,
    train,
)

import tgraph

# -- forward-mode AD ------------------------------------------------------------------------------


def dual_call(model, x, tangent):
    """``model`` on a ``torch.autograd.forward_ad`` dual tensor: (primal, tangent) of its output."""
    with fwAD.dual_level():
        out = fwAD.unpack_dual(model(fwAD.make_dual(x, tangent)))
        return out.primal.detach().clone(), out.tangent.detach().clone()


def jvp_call(model, x, tangent):
    primal, out_tangent = torch.func.jvp(model, (x,), (tangent,))
    return primal.detach(), out_tangent.detach()


@pytest.mark.parametrize("how", [dual_call, jvp_call], ids=["dual_level", "torch.func.jvp"])
def test_forward_mode_ad_runs_eagerly_with_eagers_tangents(backend, device, replays, how):
    """A replay computes no tangent (and torch's ``_foreach_copy_`` of the inputs has no
    forward AD formula): a call whose arguments carry tangents runs eagerly, counted and warned,
    and gives eager's primal and tangent; calls without tangents replay again after it."""
    model, ref = make_pair(device)
    data = batches(device, 2)
    train(model, data[:1], backend)
    train(ref, data[:1])
    x = data[1][0]
    tangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(device)
    before = tgraph.eager_calls()
    with fallbacks() as msgs:
        got = how(model, x, tangent)
    want = how(ref, x, tangent)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    assert tgraph.eager_calls() - before == 2  # both graphed blocks, eagerly
    assert msgs
    assert_never_silent(msgs, r"argument 0 carries a forward-mode AD tangent")
    before, replayed = tgraph.eager_calls(), replays[0]
    torch.testing.assert_close(model(x).detach().clone(), ref(x).detach(), **TOL)
    assert tgraph.eager_calls() == before and replays[0] > replayed


def test_forward_mode_ad_under_strict_names_the_cause(backend, device):
    model, _ = make_pair(device)
    data = batches(device, 2)
    train(model, data[:1], backend, strict=True)
    x = data[1][0]
    with pytest.raises(tgraph.GraphFallbackError, match=r"forward-mode AD tangent.*strict=False"):
        dual_call(model, x, torch.ones_like(x))


def grad_call(model, x):
    """``torch.func.grad`` of the model's squared output with respect to its input."""
    return (torch.func.grad(lambda xx: model(xx).pow(2).sum())(x),)


def vmap_call(model, x):
    return (torch.func.vmap(model)(x.unsqueeze(1)).squeeze(1),)


@pytest.mark.parametrize("how", [grad_call, vmap_call], ids=["torch.func.grad", "torch.func.vmap"])
def test_torch_func_transforms_run_eagerly_with_eagers_results(backend, device, replays, how):
    """torch.func.grad and vmap hand the blocks wrapped tensors, which have no memory of their
    own for a graph to read (found: the replay's input copy raised from inside torch, "Cannot
    access data pointer"): the call runs eagerly, counted and named, with eager's result; plain
    calls replay again after it."""
    model, ref = make_pair(device)
    data = batches(device, 2)
    train(model, data[:1], backend)
    train(ref, data[:1])
    x = data[1][0]
    before = tgraph.eager_calls()
    with fallbacks() as msgs:
        got = how(model, x)
    want = how(ref, x)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **TOL)
    assert tgraph.eager_calls() > before
    assert_never_silent(msgs, r"argument 0 is a torch.func transform's tensor")
    before, replayed = tgraph.eager_calls(), replays[0]
    torch.testing.assert_close(model(x).detach().clone(), ref(x).detach(), **TOL)
    assert tgraph.eager_calls() == before and replays[0] > replayed


# -- a backward restricted to some inputs in the recorded step -----------------------------------


def test_recorded_backward_on_a_subset_names_the_cause_and_loses_nothing(backend, device):
    """``loss.backward(inputs=head's parameters)`` in the recorded step runs no backward of the
    graphed blocks: ``create_graphs()`` must name that cause and the fix, not only "still
    awaits its backward". The next plain iteration records, and training goes on as eager."""
    model, ref = make_pair(device)
    data = batches(device, 4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ref, model)]
    tgraph.enable(model, backend=backend)
    losses = [[], []]
    for i, (x, y) in enumerate(data):
        for m, opt, out in zip((ref, model), opts, losses):  # the graphed model's loss stays held
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward(inputs=list(m.head.parameters()) if i == 0 else None)
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.detach())
        if i == 0:
            with pytest.raises(RuntimeError, match=r"loss\.backward\(inputs=\[\.\.\.\]\).*plain"):
                tgraph.create_graphs()
        if i == 1:
            assert tgraph.create_graphs().graphs > 0
            before = tgraph.eager_calls()
    torch.testing.assert_close(torch.stack(losses[0]), torch.stack(losses[1]), **TOL)
    assert_same_params(model, ref)
    assert tgraph.eager_calls() == before  # the steps after capture replayed
