"""Per-layer graphs give eager's losses, parameters and gradients (both backends)."""

from __future__ import annotations

import pytest
import torch
from layer_models import (
    ATOL,
    RTOL,
    MLPNet,
    check_gradient_accumulation,
    gpt_batches,
    mlp_batches,
    param_grads,
    tiny_gpt,
    train,
    twin,
)

import tgraph
from tgraph.toy.gpt import GPT, graph_whole


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per-block"])
@pytest.mark.parametrize("which", ["gpt", "mlp"])
def test_ten_steps_match_eager(backend, device, which, merge):
    if which == "gpt":
        model, batches = tiny_gpt(device), gpt_batches(device, 10)
    else:
        torch.manual_seed(0)
        model, batches = MLPNet().to(device), mlp_batches(device, 10)
    eager = twin(model)
    losses, model = train(model, batches, graphed=True, backend=backend, merge=merge)
    ref, eager = train(eager, batches, graphed=False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
    blocks = list(model.h if which == "gpt" else model.blocks)
    units = {
        id(r.segment or r): r.segment or r for r in tgraph.layers.manager._manager.all_runners()
    }
    for u in units.values():  # every block parameter gets its gradient from the backward graph
        members = u.runners[::-1] if merge else [u]  # the last member's first (_find_params)
        assert [id(p) for p in u.state.route.params] == [
            id(p) for r in members for p in r.module.parameters()
        ]
    report = tgraph.capture_report()
    assert report.graphs == (2 if merge else 2 * len(blocks))
    assert report.segments == (1 if merge else 0)


def test_gradient_accumulation_three_microbatches(backend, device):
    check_gradient_accumulation(backend, device)


def test_interleaved_microbatches(backend, device):
    """fwd 1, fwd 2, bwd 2, bwd 1: a module in flight gets a second runner; grads exact."""
    model = tiny_gpt(device)
    eager = twin(model)
    tgraph.enable(model, backend=backend, strict=True)
    b1, b2 = gpt_batches(device, 2)

    def interleaved(m):
        l1 = m(*b1)[1]
        l2 = m(*b2)[1]
        l2.backward()
        l1.backward()
        return l1.detach(), l2.detach()

    interleaved(model)
    model.zero_grad(set_to_none=True)
    report = tgraph.create_graphs()
    assert report.runners == 2 * len(model.h)  # one runner per block per microbatch in flight
    for _ in range(2):
        got_losses = interleaved(model)
        want_losses = interleaved(eager)
        torch.testing.assert_close(got_losses, want_losses, rtol=RTOL, atol=ATOL)
        got, want = param_grads(model), param_grads(eager)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=ATOL, msg=n)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


def test_no_grad_outputs_are_never_overwritten_while_alive(backend, device):
    """a = enc(x1); b = enc(x2) under no_grad: b must not overwrite a (a siamese evaluation)."""
    model = tiny_gpt(device)
    block = model.h[0]
    tgraph.enable(model, backend=backend)
    x1, x2 = torch.randn(2, 4, 16, 32, device=device)
    with torch.no_grad():
        block(x1)
    tgraph.create_graphs()
    eager = torch.nn.Module.__call__
    fell_back = lambda: tgraph.eager_calls()  # noqa: E731
    with torch.no_grad():
        y1 = block(x1)  # replayed: a view of the static output buffer
        assert fell_back() == 0
        with pytest.warns(tgraph.GraphFallbackWarning, match="awaiting its backward"):
            y2 = block(x2)  # y1 alive: runs eagerly instead of overwriting it
        assert fell_back() == 1
        torch.testing.assert_close(y1, eager(block, x1))
        torch.testing.assert_close(y2, eager(block, x2))
        ptr = y1.data_ptr()
        del y1
        y3 = block(x2)  # y1 gone: the graph replays again, into the same buffer
        assert y3.data_ptr() == ptr and fell_back() == 1
        torch.testing.assert_close(y3, eager(block, x2))


def test_a_no_grad_outputs_copies_are_its_own_and_a_shallow_copy_still_holds(
    backend, device, replays, tmp_path
):
    """An output kept by ``copy.deepcopy`` or ``torch.save`` (the best evaluation's logits):
    the copy is new memory, so it copies (it failed on the tokens that keep the unit in
    flight) and holds nothing: the next call replays into the same buffer, the copies keep
    their values. A shallow ``copy.copy`` shares the buffer, so it keeps the unit busy."""
    import copy

    model = tiny_gpt(device)
    block = model.h[0]
    tgraph.enable(model, backend=backend, strict=True)
    x1, x2 = torch.randn(2, 4, 16, 32, device=device)
    with torch.no_grad():
        block(x1)
    tgraph.create_graphs()
    with torch.no_grad():
        y1 = block(x1)
        kept = copy.deepcopy(y1)
        torch.save(y1, tmp_path / "y1.pt")
        shallow = copy.copy(y1)
        del y1
        with pytest.raises(tgraph.GraphFallbackError, match="awaiting its backward"):
            block(x2)  # the shallow copy is the buffer: it must not be overwritten
        del shallow
        y2 = block(x2)  # replayed into the buffer the copies were taken from
        loaded = torch.load(tmp_path / "y1.pt")
    assert replays[0] == 2 and tgraph.eager_calls() == 1  # the refused call counts
    want1 = torch.nn.Module.__call__(block, x1)
    torch.testing.assert_close(kept, want1)
    torch.testing.assert_close(loaded, want1)
    torch.testing.assert_close(y2, torch.nn.Module.__call__(block, x2))


def test_two_live_no_grad_outputs_in_the_recorded_iteration_get_two_graphs(backend, device):
    model = tiny_gpt(device)
    block = model.h[0]
    tgraph.enable(model, backend=backend, strict=True)
    x1, x2 = torch.randn(2, 4, 16, 32, device=device)
    with torch.no_grad():
        a, b = block(x1), block(x2)
        del a, b
    assert tgraph.create_graphs().runners == 2
    with torch.no_grad():
        a, b = block(x1), block(x2)
        torch.testing.assert_close(a, torch.nn.Module.__call__(block, x1))
        torch.testing.assert_close(b, torch.nn.Module.__call__(block, x2))


def test_the_whole_toy_model_as_one_unit_matches_eager(backend, device):
    """graph_whole: embeddings, blocks, head and loss as one forward graph and one backward
    graph (the blocks inside are part of them, not units of their own), with dropout: ten
    strict steps (no eager call possible) with eager's losses and parameters."""
    model = graph_whole(tiny_gpt(device, dropout=0.1))
    eager = twin(model)
    eager.__class__ = GPT  # the same weights, an ordinary GPT
    batches = gpt_batches(device, 10)
    torch.manual_seed(5)
    losses, model = train(model, batches, graphed=True, backend=backend)
    torch.manual_seed(5)
    ref, eager = train(eager, batches, graphed=False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=name)
    report = tgraph.capture_report()
    assert (report.runners, report.graphs, report.segments) == (1, 2, 0)
    assert report.eager_modules == []  # the blocks are in the model's graphs, not "not called"
    assert [type(r.module).__name__ for r in tgraph.layers.manager._manager.all_runners()] == [
        "GraphableGPT"
    ]
    assert tgraph.eager_calls() == 0
