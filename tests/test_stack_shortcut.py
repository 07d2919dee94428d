"""A later member of a replayed merged stack answered without its call key
(tgraph.layers.shortcut): only when the call is made of the head's own objects and the previous
member's output, in the same modes; anything else takes the long way and is refused there."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL, twin

import tgraph
from tgraph.layers import manager, shortcut

D, N = 16, 4


class Doubling(nn.Module):
    """Behaves differently in eval (which the graphs of the train mode bake in)."""

    def forward(self, x):
        return x * 2.0 if self.training else x


class KwBlock(tgraph.GraphableModule):
    """Called the way Hugging Face decoder layers are: keyword arguments shared by every layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.gate = Doubling()

    def forward(self, x, mask=None, pos=None, scale=1.0, flags=(), use_cache=False):
        h = self.gate(self.lin(x)) * mask
        if pos is not None:
            h = h * pos[0] + pos[1]
        return x + torch.tanh(h) * scale + len(flags)


class KwNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, D)
        self.blocks = nn.ModuleList(KwBlock() for _ in range(N))


def run(model, x, tweak=None, flags=()):
    """One forward and backward; ``tweak(i, h, kwargs)`` may change block ``i``'s call."""
    h = model.inp(x)
    kwargs = dict(mask=(x[:, :1] > 0).float(), pos=(h.cos(), h.sin()), scale=0.5, flags=flags)
    for i, b in enumerate(model.blocks):
        if tweak is None:
            h = b(h, **kwargs)
        else:
            h = tweak(i, b, h, dict(kwargs))
    loss = h.pow(2).mean()
    loss.backward()
    return loss.detach()


@pytest.fixture
def keys(monkeypatch) -> list[int]:
    """Counts call keys computed (the long way)."""
    count = [0]
    original = manager.call_key

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(manager, "call_key", counted)
    return count


def setup(backend, device, flags=()):
    torch.manual_seed(0)
    model = KwNet().to(device)
    eager = twin(model)
    xs = [torch.randn(4, 8, device=device) for _ in range(4)]
    tgraph.enable(model, backend=backend)
    run(model, xs[0], flags=flags)
    report = tgraph.create_graphs()
    assert report.segments == 1 and report.graphs == 2
    run(eager, xs[0], flags=flags)
    return model, eager, xs


def same_training(model, eager):
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL, msg=n)
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=n)


def test_members_are_answered_without_their_call_key(backend, device, keys, replays):
    model, eager, xs = setup(backend, device)
    for x in xs[1:]:
        keys[0], replays[0] = 0, 0
        torch.testing.assert_close(run(model, x), run(eager, x), rtol=RTOL, atol=ATOL)
        # the first replayed step learns each member's shape the long way; then only the head
        assert replays[0] == 2  # the stack's forward and backward graphs
        assert keys[0] == (N if x is xs[1] else 1)
    same_training(model, eager)


def _eval_gate(i, b, h, kw):
    if i == 2:
        b.gate.eval()
    return b(h, **kw)


def _no_grad(i, b, h, kw):
    if i != 2:
        return b(h, **kw)
    with torch.no_grad():
        return b(h, **kw)


def _other_mask(i, b, h, kw):
    if i == 2:
        kw["mask"] = kw["mask"].clone()  # the same values, another tensor than the head's
        kw["mask"][0] = 0.0
    return b(h, **kw)


def _reordered(i, b, h, kw):
    if i == 2:
        kw = {k: kw[k] for k in reversed(kw)}
    return b(h, **kw)


def _positional_mask(i, b, h, kw):
    if i == 2:
        return b(h, kw.pop("mask"), **kw)
    return b(h, **kw)


def _renamed(i, b, h, kw):
    if i == 2:  # the head's very object at the same position, under another keyword name
        kw["use_cache"] = kw.pop("flags")
    return b(h, **kw)


def _frozen(i, b, h, kw):
    if i == 2:
        b.lin.bias.requires_grad_(False)
    return b(h, **kw)


TWEAKS = {
    "submodule_eval": (_eval_gate, "training of submodule"),
    "no_grad": (_no_grad, "grad mode"),
    "other_mask_object": (_other_mask, "merged stack"),
    "keyword_order": (_reordered, "arguments changed"),
    "positional": (_positional_mask, "arguments changed"),
    "frozen_parameter": (_frozen, "requires_grad"),
}


@pytest.mark.parametrize("name", list(TWEAKS))
def test_a_member_called_otherwise_takes_the_long_way(backend, device, name):
    """After the shapes are learned, block 2 is called differently: it and the rest of the
    stack run eagerly, named, and the numbers are eager's."""
    tweak, reason = TWEAKS[name]
    model, eager, xs = setup(backend, device)
    torch.testing.assert_close(run(model, xs[1]), run(eager, xs[1]), rtol=RTOL, atol=ATOL)
    with pytest.warns(tgraph.GraphFallbackWarning, match=reason):
        got = run(model, xs[2], tweak)
    torch.testing.assert_close(got, run(eager, xs[2], tweak), rtol=RTOL, atol=ATOL)
    same_training(model, eager)


def test_a_member_given_the_heads_object_under_another_keyword_takes_the_long_way(backend, device):
    """Block 2 gets the head's ``flags`` tuple as ``use_cache``: every argument is the head's
    object at its position, but the call means another thing (``len(flags)`` is 0 there), so the
    shortcut compares the keyword names and the call runs eagerly, named."""
    flags = (1,)
    model, eager, xs = setup(backend, device, flags=flags)
    torch.testing.assert_close(
        run(model, xs[1], flags=flags), run(eager, xs[1], flags=flags), rtol=RTOL, atol=ATOL
    )
    with pytest.warns(tgraph.GraphFallbackWarning, match="keyword argument 'use_cache'"):
        got = run(model, xs[2], _renamed, flags=flags)
    torch.testing.assert_close(got, run(eager, xs[2], _renamed, flags=flags), rtol=RTOL, atol=ATOL)
    same_training(model, eager)


def test_a_list_argument_is_never_taken_by_identity(backend, device, keys):
    """A list the head got could be changed in place before a member's call: members given a
    list are keyed the long way every time, and a change is seen."""
    flags = [1]
    model, eager, xs = setup(backend, device, flags=flags)
    run(model, xs[1], flags=flags), run(eager, xs[1], flags=flags)
    keys[0] = 0
    run(model, xs[2], flags=flags), run(eager, xs[2], flags=flags)
    assert keys[0] == N

    def grow(i, b, h, kw):
        if i == 2:
            kw["flags"].append(2)
        return b(h, **kw)

    with pytest.warns(tgraph.GraphFallbackWarning, match="arguments changed"):
        got = run(model, xs[3], grow, flags=[1])
    torch.testing.assert_close(got, run(eager, xs[3], grow, flags=[1]), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("planted", ["grad_unchecked"])
def test_planted_requires_grad_bug_is_caught(backend, device, monkeypatch, planted):
    monkeypatch.setattr(shortcut, "same_grad", lambda stack: True)
    with pytest.raises(AssertionError):
        test_a_shared_input_made_to_require_grad_between_members_gets_its_gradient(backend, device)


def _matches_by_count(self, stack, prev, args, kwargs):
    """``Shape.matches`` comparing how many keywords, not their names."""
    if len(kwargs) != len(self.names):
        return False
    return matches(self, stack, prev, args, dict(zip(self.names, kwargs.values())))


matches = shortcut.Shape.matches


@pytest.mark.parametrize("planted", ["modes_unchecked", "any_object_matches", "names_unchecked"])
def test_planted_shortcut_bugs_are_caught(backend, device, monkeypatch, planted):
    flags = ()
    if planted == "modes_unchecked":
        monkeypatch.setattr(shortcut, "same_mode", lambda *a: True)
        tweak = _eval_gate
    elif planted == "any_object_matches":
        monkeypatch.setattr(shortcut.Shape, "matches", lambda *a: True)
        tweak = _other_mask
    else:
        monkeypatch.setattr(shortcut.Shape, "matches", _matches_by_count)
        tweak, flags = _renamed, (1,)
    model, eager, xs = setup(backend, device, flags=flags)
    run(model, xs[1], flags=flags), run(eager, xs[1], flags=flags)
    with pytest.raises(AssertionError):
        got = run(model, xs[2], tweak, flags=flags)
        torch.testing.assert_close(got, run(eager, xs[2], tweak, flags=flags), rtol=RTOL, atol=ATOL)


def test_a_shared_input_made_to_require_grad_between_members_gets_its_gradient(backend, device):
    """``requires_grad_`` moves no version counter: the shortcut compares the head's inputs'
    requires_grad too, so block 2 (called the long way, eagerly) gives the mask its gradient."""
    model, eager, xs = setup(backend, device)
    run(model, xs[1]), run(eager, xs[1])
    grads = []
    for m in (model, eager):
        x = xs[2]
        h = m.inp(x)
        mask = (x[:, :1] > 0).float()
        kwargs = dict(mask=mask, pos=(h.cos(), h.sin()), scale=0.5, flags=())
        for i, b in enumerate(m.blocks):
            if i == 2:
                mask.requires_grad_(True)
            h = b(h, **kwargs)
        h.pow(2).mean().backward()
        grads.append(mask.grad)
    assert grads[1] is not None
    torch.testing.assert_close(grads[0], grads[1], rtol=RTOL, atol=ATOL)


class NormNet(KwNet):
    """KwNet's blocks, then a final norm called with the last block's output alone (as
    transformers' ``norm(hidden_states)`` after its decoder layers): a member whose call has
    another argument structure than the head's."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = tgraph.GraphableModule.of(nn.LayerNorm)(D)


def run_norm(model, x, other=False):
    h = model.inp(x)
    kwargs = dict(mask=(x[:, :1] > 0).float(), pos=(h.cos(), h.sin()), scale=0.5)
    for b in model.blocks:
        h = b(h, **kwargs)
    loss = model.norm(h.clone() if other else h).pow(2).mean()
    loss.backward()
    return loss.detach()


def test_a_member_with_its_own_argument_structure_is_answered_without_its_key(
    backend, device, keys, replays
):
    """The norm (one positional argument: the last block's output) learns its shape and is
    answered without its call key; given another tensor, it takes the long way, named, and
    the numbers are eager's."""
    torch.manual_seed(0)
    model = NormNet().to(device)
    eager = twin(model)
    xs = [torch.randn(4, 8, device=device) for _ in range(4)]
    tgraph.enable(model, backend=backend)
    run_norm(model, xs[0])
    report = tgraph.create_graphs()
    assert report.segments == 1 and report.runners == N + 1, report
    run_norm(eager, xs[0])
    for x in xs[1:3]:
        keys[0], replays[0] = 0, 0
        torch.testing.assert_close(run_norm(model, x), run_norm(eager, x), rtol=RTOL, atol=ATOL)
        assert replays[0] == 2
        assert keys[0] == (N + 1 if x is xs[1] else 1)  # learned, then only the head's key
    with pytest.warns(tgraph.GraphFallbackWarning, match="merged stack"):
        got = run_norm(model, xs[3], other=True)
    torch.testing.assert_close(got, run_norm(eager, xs[3], other=True), rtol=RTOL, atol=ATOL)
    same_training(model, eager)
