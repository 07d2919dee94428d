"""tgraph's TransformerEngine FP8 bookkeeping on the CPU, against a stand-in of TE's delayed
scaling, weight caching and calibration (tests/fake_te.py): the te.autocast region (a
calibrating one too) keys calls and is entered again for the capture, a replay redoes the
backward amax reduction of the region's first FP8 module, and the weight-caching flag follows
each call's ``is_first_microbatch`` (cleared for calls without it). Each part, planted out,
changes the numbers; the real TE runs in tests/test_te.py on a GPU."""

from __future__ import annotations

import contextlib
import copy

import fake_te
import pytest
import torch

import tgraph
from tgraph import fp8, signature
from tgraph.fp8 import FP8Region, FP8Replay
from tgraph.layers import runner


class Block(tgraph.GraphableModule):
    def __init__(self, te) -> None:
        super().__init__()
        self.fc = te.Linear(8, 8)

    def forward(self, x, is_first_microbatch=None):
        return x + torch.tanh(self.fc(x, is_first_microbatch=is_first_microbatch))


def _train(model, te, recipe, *, graphed: bool, steps: int = 5, microbatches: int = 1, **region):
    """SGD steps of ``microbatches`` forward/backward passes, each in its own ``te.autocast``
    (``region``: its arguments, FP8 on by default), with ``is_first_microbatch`` when there are
    several. Returns the losses and, per step, every FP8 scale and amax history."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    losses, scales = [], []
    for i in range(steps):
        for mb in range(microbatches):
            x = torch.randn(4, 8, generator=gen) * (1 + i)
            kw = {"is_first_microbatch": mb == 0} if microbatches > 1 else {}
            with te.autocast(recipe=recipe, **(region or {"enabled": True})):
                y = x
                for blk in model:
                    y = blk(y, **kw)
            loss = y.pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        scales.append(
            [
                t.clone()
                for m in model.modules()
                if hasattr(m, "fp8_meta")
                for k in ("scaling_fwd", "scaling_bwd")
                for t in (m.fp8_meta[k].scale, m.fp8_meta[k].amax_history)
            ]  # fmt: skip
        )
        if graphed and i == 0:
            tgraph.create_graphs()
    return torch.stack(losses), scales


def _run(monkeypatch, backend, skip_left=None, **kw):
    """The graphed model's training and its eager twin's; ``skip_left``: the weight-caching
    flag another graph (or anyone) left behind, set before the graphed run."""
    te = fake_te.install(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(te), Block(te))
    twin = copy.deepcopy(model)
    recipe = te.Recipe()
    want = _train(twin, te, recipe, graphed=False, **kw)
    fake_te.reset()
    if skip_left is not None:
        fake_te.FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(skip_left)
    tgraph.enable(model, backend=backend, strict=True)
    try:
        got = _train(model, te, recipe, graphed=True, **kw)
    finally:
        tgraph.reset()
    return got, want


def _equal(got, want) -> bool:
    same = torch.equal(got[0], want[0])
    return same and all(torch.equal(a, b) for g, w in zip(got[1], want[1]) for a, b in zip(g, w))


def _assert_equal(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for g, w in zip(got[1], want[1], strict=True):
        for a, b in zip(g, w, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp8_delayed_scaling_replays_as_eager(monkeypatch):
    got, want = _run(monkeypatch, "emulated")
    assert len(fake_te.FP8GlobalStateManager.quantization_state.buffer) == 2
    _assert_equal(got, want)


def test_planted_backward_scale_update_out_of_the_replay_is_seen(monkeypatch):
    monkeypatch.setattr(FP8Replay, "after_backward", lambda self: None)
    assert not _equal(*_run(monkeypatch, "emulated"))


def test_planted_capture_outside_the_fp8_region_is_seen(monkeypatch):
    monkeypatch.setattr(FP8Region, "capture_context", lambda self: contextlib.nullcontext())
    assert not _equal(*_run(monkeypatch, "emulated"))


# -- weight caching (is_first_microbatch) -------------------------------------------------------


def test_fp8_weight_caching_across_microbatches(monkeypatch):
    """The first microbatch's graph casts the weights, the later ones' reuse that cast."""
    _assert_equal(*_run(monkeypatch, "emulated", microbatches=3))


@pytest.mark.parametrize("skip_left", [False, True])
def test_fp8_graphs_cast_weights_whatever_weight_caching_left_behind(monkeypatch, skip_left):
    """Calls without ``is_first_microbatch`` cast the weights at every call in eager; their
    graphs read TE's process-wide device flag, so the graph clears it, whatever a later
    microbatch's graph (or anyone) left there."""
    _assert_equal(*_run(monkeypatch, "emulated", skip_left=skip_left))


def _flag_from_argument_only(first):
    """Planted: the flag set as ``not is_first_microbatch``, also for calls without it."""
    fake_te.FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not first)


def _flag_left_alone_without_argument(first):
    """Planted: calls without ``is_first_microbatch`` leave the flag as it was."""
    if first is not None:
        fake_te.FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(not first)


@pytest.mark.parametrize(
    "planted, skip_left",
    [(_flag_from_argument_only, None), (_flag_left_alone_without_argument, True)],
)
def test_planted_weight_update_skipped_without_is_first_microbatch_is_seen(
    monkeypatch, planted, skip_left
):
    monkeypatch.setattr(runner, "set_weight_caching", planted)
    assert not _equal(*_run(monkeypatch, "emulated", skip_left=skip_left))


# -- calibration (te.autocast(enabled=False, calibrating=True)) ---------------------------------

CALIBRATING = dict(enabled=False, calibrating=True)


def test_fp8_calibration_replays_as_eager(monkeypatch):
    """A calibrating region computes in high precision and records the amaxes: its graphs
    are captured in it and record them at every replay."""
    got, want = _run(monkeypatch, "emulated", **CALIBRATING)
    assert all(h.abs().sum() > 0 for h in got[1][-1][1::4])  # forward amaxes recorded
    _assert_equal(got, want)


def _region_without_calibration():
    """Planted: a calibrating region is no region (only FP8 execution keys a call)."""
    found = fp8.region()
    return found if found is None or found.enabled else None


def test_planted_calibration_out_of_the_call_key_is_seen(monkeypatch):
    monkeypatch.setattr(signature, "fp8_region", _region_without_calibration)
    assert not _equal(*_run(monkeypatch, "emulated", **CALIBRATING))


def test_a_calibrating_call_finds_no_high_precision_graph(monkeypatch):
    """A graph captured outside any region records no amax: a calibrating call (the same
    arguments, the same high-precision numbers) runs eagerly, named, and records them."""
    te = fake_te.install(monkeypatch)
    model = torch.nn.Sequential(Block(te))
    tgraph.enable(model, backend="emulated", strict=True)
    _train(model, te, te.Recipe(), graphed=True, steps=2, enabled=False)
    history = model[0].fc.fp8_meta["scaling_fwd"].amax_history
    assert not history.any()
    with te.autocast(**CALIBRATING):
        with pytest.raises(tgraph.GraphFallbackError, match="autocast changed"):
            model(torch.randn(4, 8))
    tgraph.reset()


def test_region_change_after_capture_finds_no_graph(monkeypatch):
    te = fake_te.install(monkeypatch)
    model = torch.nn.Sequential(Block(te))
    tgraph.enable(model, backend="emulated", strict=True)
    _train(model, te, te.Recipe(), graphed=True, steps=2)
    x = torch.randn(4, 8)
    with te.autocast(enabled=True, recipe=te.Recipe(margin=1)):  # another recipe
        with pytest.raises(tgraph.GraphFallbackError, match="autocast changed"):
            model(x)
    with pytest.raises(tgraph.GraphFallbackError, match="autocast changed"):
        model(x)  # FP8 off
    tgraph.reset()
