"""Capture: clear errors that leave no state behind, graphs of the recorded call's mode, and
warmup side effects undone (module buffers, RNG)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL, Cache, CachedBlock, DropBlock

import tgraph
from tgraph.snapshot import Snapshot


def test_create_graphs_without_record_is_a_clear_error():
    with pytest.raises(RuntimeError, match="nothing recorded"):
        tgraph.create_graphs()


def test_create_graphs_after_only_eager_fallbacks_says_so(backend, device):
    """Every graphed call fell back to eager (a cache argument, as with Hugging Face's default
    use_cache=True): the message names that, not "run one iteration", which the user did."""
    block = CachedBlock().to(device)
    tgraph.enable(block, backend=backend)
    with pytest.warns(tgraph.GraphFallbackWarning):
        for _ in range(2):
            block(torch.randn(2, 4, device=device), cache=Cache()).sum().backward()
    match = r"nothing recorded: all 2 calls of graphed modules .* ran eagerly instead \(.*Cache"
    with pytest.raises(RuntimeError, match=match):
        tgraph.create_graphs()
    tgraph.reset()
    with pytest.raises(RuntimeError, match="nothing recorded: call tgraph.enable"):
        tgraph.create_graphs()


def test_enable_on_model_without_graphable_modules():
    with pytest.raises(ValueError, match="contains no tgraph.GraphableModule"):
        tgraph.enable(nn.Linear(2, 2))


class HostSync(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 1e9:  # a host sync: bool() of a device tensor
            y = y * 2
        return y


def test_capture_failure_is_clear_and_leaves_no_state(backend, device):
    """strict=True: the failure raises (without it, the module stays eager: test_capture_failure.py)."""
    torch.manual_seed(0)
    mod = HostSync().to(device)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod(x).sum().backward()
    rng_before = torch.get_rng_state()
    with pytest.raises(
        tgraph.CaptureError, match=r"capturing Runner\(HostSync.*(\.item\(\)|host sync)"
    ):
        tgraph.create_graphs()
    assert not tgraph.layers.manager._manager.captured
    assert torch.equal(torch.get_rng_state(), rng_before)
    if device.type == "cuda":
        assert not torch.cuda.is_current_stream_capturing()
        torch.cuda.synchronize()
    # the module keeps working eagerly, with correct values and gradients
    y = mod(x)
    torch.testing.assert_close(y, torch.nn.Module.__call__(mod, x))
    y.sum().backward()
    assert mod.lin.weight.grad is not None


class DropNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DropBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def eval_after_training(model, backend, x, x_eval, graphed: bool):
    torch.manual_seed(1)  # the same dropout masks in the recorded step of both twins
    if graphed:
        tgraph.enable(model, backend=backend, strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).square().mean().backward()  # recorded: a training step ...
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        model(x_eval)  # ... then an evaluation
    model.train()
    if graphed:
        tgraph.create_graphs()  # the model is in train mode now
    model.eval()
    with torch.no_grad():
        return model(x_eval).clone()


def test_eval_graph_is_captured_in_eval_mode(backend, device):
    """Captured after model.train(), the recorded eval call's graph must still have dropout off
    (on the H200 it had it on: HF GPT-2 logits 0.12 off the eager twin)."""
    torch.manual_seed(0)
    model = DropNet().to(device)
    eager = copy.deepcopy(model)
    x, x_eval = torch.randn(2, 8, 32, device=device).unbind(0)
    got = eval_after_training(model, backend, x, x_eval, graphed=True)
    want = eval_after_training(eager, backend, x, x_eval, graphed=False)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_planted_bug_capture_in_current_mode_is_caught_on_cpu(monkeypatch):
    """The emulated backend replays the capture's control flow (dropout on or off), as a CUDA
    graph does, so capturing in the model's current mode shows up on the CPU."""
    from tgraph.layers import runner

    monkeypatch.setattr(runner, "_training_flags", lambda module, flags: _nothing())
    torch.manual_seed(0)
    model = DropNet()
    eager = copy.deepcopy(model)
    x, x_eval = torch.randn(2, 8, 32).unbind(0)
    with tgraph.verification(first=0, every=0):  # the replays alone (the verifier would
        got = eval_after_training(model, "emulated", x, x_eval, graphed=True)  # catch it)
    want = eval_after_training(eager, "emulated", x, x_eval, graphed=False)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_live_no_grad_output_of_the_recorded_step_does_not_block_capture(backend, device):
    block = CachedBlock().to(device)
    tgraph.enable(block, backend=backend, strict=True)
    x = torch.randn(2, 4, device=device)
    block(x).sum().backward()
    with torch.no_grad():
        kept = block(x)  # alive while create_graphs() runs
    tgraph.create_graphs()
    with torch.no_grad():
        torch.testing.assert_close(block(x), kept)


class BNBlock(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.lin(x))


def bn_run(mod, xs, graphed, backend):
    if graphed:
        tgraph.enable(mod, backend=backend, strict=True)
    mod(xs[0]).square().mean().backward()
    if graphed:
        tgraph.create_graphs()  # warmups and the capture must leave the statistics alone
    stats = [(mod.bn.running_mean.clone(), mod.bn.num_batches_tracked.clone())]
    for x in xs[1:]:
        mod(x).square().mean().backward()
        stats.append((mod.bn.running_mean.clone(), mod.bn.num_batches_tracked.clone()))
    return stats


def test_batchnorm_statistics_equal_eager_after_capture(backend, device):
    torch.manual_seed(0)
    mod = BNBlock().to(device)
    eager = copy.deepcopy(mod)
    xs = list(torch.randn(3, 16, 8, device=device).unbind(0))
    got = bn_run(mod, xs, True, backend)
    want = bn_run(eager, xs, False, backend)
    for (gm, gn), (wm, wn) in zip(got, want):
        torch.testing.assert_close(gm, wm, rtol=RTOL, atol=ATOL)
        assert gn.item() == wn.item()


def test_planted_bug_buffers_not_restored_is_caught(backend, device, monkeypatch):
    real = Snapshot.restore

    def forget_buffers(self):
        self._buffers = []
        real(self)

    monkeypatch.setattr(Snapshot, "restore", forget_buffers)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        test_batchnorm_statistics_equal_eager_after_capture(backend, device)


class Counted(tgraph.GraphableModule):
    unread_attributes = frozenset({"calls"})  # bookkeeping: counts the passes, read by no one

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def forwards_during_capture(**options) -> int:
    mod = Counted()
    tgraph.enable(mod, backend="emulated", **options)
    mod(torch.randn(4, 8)).sum().backward()
    mod.calls = 0
    tgraph.create_graphs()
    return mod.calls  # the warmup passes, then the capture's one


def test_enable_warmup_steps_sets_the_eager_passes_before_capture():
    assert forwards_during_capture(warmup_steps=3) == 3 + 1
    tgraph.reset()
    assert forwards_during_capture() == 1 + 1  # the emulated default
