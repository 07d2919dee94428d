"""Issue 12, cases 2 to 5: wrong results seen with models tgraph did not write, on our own toys.

Each test fails on 8ca34af; the Hugging Face versions of the same cases are in
tests/test_hf_models.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL

import tgraph
from tgraph.grads import StateSnapshot, UnusedOutputs

# ------------------------------------------------ case 2: eval recorded after the training step


class DropBlock(tgraph.GraphableModule):
    def __init__(self, d: int = 32, p: float = 0.5) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


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
    from tgraph import runner

    monkeypatch.setattr(runner, "_training_flags", lambda module, flags: _nothing())
    torch.manual_seed(0)
    model = DropNet()
    eager = copy.deepcopy(model)
    x, x_eval = torch.randn(2, 8, 32).unbind(0)
    got = eval_after_training(model, "emulated", x, x_eval, graphed=True)
    want = eval_after_training(eager, "emulated", x, x_eval, graphed=False)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def test_submodule_switched_to_eval_gets_its_own_graph(backend, device):
    """The training flags of submodules key the graph too (only module.training did)."""
    torch.manual_seed(0)
    block = DropBlock().to(device)
    tgraph.enable(block, backend=backend)
    x = torch.randn(4, 32, device=device)
    block(x).sum().backward()
    tgraph.create_graphs()
    block.drop.eval()
    with pytest.warns(tgraph.GraphFallbackWarning, match="training of submodule 'drop'"):
        y = block(x)
    torch.testing.assert_close(y, x + torch.tanh(block.lin(x)))


# ------------------------------------------- case 3: an output the loss did not use: no grad


class TwoOut(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def two_out_steps(mod, x, graphed: bool, backend: str):
    opt = torch.optim.AdamW(mod.parameters(), lr=0.1)
    grads = []
    for step in range(4):  # b used at steps 0 (recorded) and 1, unused at steps 2 and 3
        a, b = mod(x)
        (a.sum() + b.sum() if step < 2 else a.sum()).backward()
        grads.append((mod.b.weight.grad, None if x.grad is None else x.grad.clone()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        x.grad = None
        if graphed and step == 0:
            tgraph.create_graphs()
    return grads


def test_unused_output_gives_no_gradient(backend, device):
    torch.manual_seed(0)
    mod = TwoOut().to(device)
    eager = copy.deepcopy(mod)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(8, 4, device=device, requires_grad=True)
    got = two_out_steps(mod, x, True, backend)
    want = two_out_steps(eager, x, False, backend)
    torch.testing.assert_close(got[1], want[1], rtol=RTOL, atol=ATOL)
    for (gb, gx), (wb, wx) in zip(got[2:], want[2:]):
        assert wb is None and gb is None, "b is reached only through the unused output"
        torch.testing.assert_close(gx, wx, rtol=RTOL, atol=ATOL)  # a's path only
    for p, q in zip(mod.parameters(), eager.parameters()):  # AdamW left b alone, as eagerly
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_planted_bug_unused_output_gives_zeros_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(UnusedOutputs, "none_positions", lambda self, active: [])
    torch.manual_seed(0)
    mod = TwoOut().to(device)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(8, 4, device=device, requires_grad=True)
    got = two_out_steps(mod, x, True, backend)
    assert torch.count_nonzero(got[2][0]) == 0  # zeros: the bug AdamW turns into drift


def test_planted_bug_stale_grad_output_buffer_is_caught(backend, device, monkeypatch):
    """The known-zero branch runs now: when b's gradient goes from used to unused, its buffer
    must be zeroed, or x.grad keeps b's old contribution."""
    from tgraph.runner import Runner

    def never_zero(self, grads):
        for buf, i in zip(self.static_grad_outputs, self._out_rg):
            if grads[i] is not None:
                buf.copy_(grads[i])

    monkeypatch.setattr(Runner, "copy_grad_outputs", never_zero)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        test_unused_output_gives_no_gradient(backend, device)


# --------------------------------------------------- case 5: messages that name the cause


class DictBlock(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inputs: dict):
        return self.lin(inputs["x"]) * inputs["scale"]


def test_changed_requires_grad_inside_a_dict_is_named(backend, device):
    block = DictBlock().to(device)
    tgraph.enable(block, backend=backend)
    x, s = torch.randn(2, 4, device=device), torch.ones(2, 4, device=device)
    block({"x": x, "scale": s}).sum().backward()
    tgraph.create_graphs()
    with pytest.warns(
        tgraph.GraphFallbackWarning,
        match=r"argument 0\['scale'\] changed from .*requires_grad=False to .*requires_grad=True",
    ):
        block({"x": x, "scale": s.clone().requires_grad_()})


class Cache:
    """A key/value cache like Hugging Face's DynamicCache: a new object per model call."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []


class CachedBlock(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        y = self.lin(x)
        if cache is not None:
            cache.keys.append(y)
        return y


def test_mutable_object_argument_names_the_cause(backend, device):
    block = CachedBlock().to(device)
    tgraph.enable(block, backend=backend)
    x = torch.randn(2, 4, device=device)
    with pytest.warns(tgraph.GraphFallbackWarning, match="Cache object.*use_cache=False"):
        block(x, cache=Cache()).sum().backward()
    with pytest.raises(RuntimeError, match="nothing recorded"):
        tgraph.create_graphs()  # no misleading host-sync hint: nothing was graphable


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


# ---------------------------------------------------- buffers restored after warmup


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
    real = StateSnapshot.restore

    def forget_buffers(self):
        self._buffers = []
        real(self)

    monkeypatch.setattr(StateSnapshot, "restore", forget_buffers)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        test_batchnorm_statistics_equal_eager_after_capture(backend, device)
