"""The megatron-core / TransformerEngine gradient-accumulation-fusion convention.

A parameter may carry ``main_grad`` (fp32 buffer) and ``grad_added_to_main_grad``. TE's fused
wgrad kernels accumulate into ``main_grad`` and set the flag, returning a dummy wgrad; Megatron's
DDP hook adds ``.grad`` into ``main_grad`` only if the flag is unset, then drops ``.grad``.
TransformerEngine cannot be installed here, so :class:`FusedWgradLinear` plays its part.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL

import tgraph
from tgraph.layers import capture
from tgraph.layers.grads import MainGradFlags, MainGradFusion


class _FusedWgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gy @ weight
        # as TE's fuse_wgrad_accumulation: GEMM accumulates into main_grad, flag set, dummy wgrad
        weight.main_grad.add_(gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
        weight.grad_added_to_main_grad = True
        return gx, torch.zeros_like(weight), gy.reshape(-1, gy.shape[-1]).sum(0)


class FusedWgradLinear(nn.Linear):
    def forward(self, x):
        return _FusedWgrad.apply(x, self.weight, self.bias)


class Block(tgraph.GraphableModule):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fused = FusedWgradLinear(d, d)  # wgrad accumulated inside backward
        self.plain = nn.Linear(d, d)  # wgrad accumulated by the DDP hook

    def forward(self, x):
        return x + self.plain(torch.relu(self.fused(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d=16, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


class MegatronLikeDDP:
    """The part of megatron-core's DDP the convention is about: main_grad buffers and hooks."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.hook_calls = 0
        self._accumulators = []
        for p in self.params:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.grad_added_to_main_grad = False
            acc = p.expand_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(self._hook(p))
            self._accumulators.append(acc)  # keep the AccumulateGrad nodes alive

    def _hook(self, p):
        def hook(*_):
            self.hook_calls += 1
            if p.grad is not None and not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad)
            p.grad = None

        return hook

    def zero_grad_buffer(self) -> None:
        for p in self.params:
            p.main_grad.zero_()
            p.grad_added_to_main_grad = False


def state(ddp: MegatronLikeDDP):
    return [(p.main_grad.clone(), p.grad_added_to_main_grad, p.grad) for p in ddp.params]


def check_main_grad_convention(backend, device, fusion=False):
    torch.manual_seed(0)
    model = Net().to(device)
    eager = copy.deepcopy(model)
    ddp, ddp_eager = MegatronLikeDDP(model), MegatronLikeDDP(eager)
    tgraph.enable(model, backend=backend, strict=True, main_grad_fusion=fusion)
    xs = torch.randn(4, 3, 5, 16, device=device)

    def step(m, d, micro):
        d.zero_grad_buffer()
        for x in micro:  # gradient accumulation over microbatches into main_grad
            m(x).backward()
        return state(d)

    step(model, ddp, xs[:1])
    tgraph.create_graphs()
    for i in range(2):
        ddp.hook_calls = 0
        got = step(model, ddp, xs[i : i + 3])
        # fusion: the graph adds every block parameter's gradient into main_grad itself except
        # the fused-wgrad weights' (their kernel does); the other hooks do not run at all
        fused_by_graph = [
            p for b in model.blocks for p in b.parameters() if p is not b.fused.weight
        ]
        want_calls = 3 * (len(ddp.params) - (len(fused_by_graph) if fusion else 0))
        assert ddp.hook_calls == want_calls
        want = step(eager, ddp_eager, xs[i : i + 3])
        for (g_mg, g_flag, g_grad), (w_mg, w_flag, w_grad) in zip(got, want):
            torch.testing.assert_close(g_mg, w_mg, rtol=RTOL, atol=ATOL)
            assert g_flag == w_flag, f"grad_added_to_main_grad {g_flag} != eager {w_flag}"
            assert g_grad is None and w_grad is None
    fused = [b.fused.weight for b in model.blocks]
    assert all(p.grad_added_to_main_grad for p in fused)
    assert not any(b.plain.weight.grad_added_to_main_grad for b in model.blocks)


@pytest.mark.parametrize("fusion", [False, True], ids=["hooks", "fused"])
def test_main_grad_and_flags_match_eager(backend, device, fusion):
    """Gradient accumulation over 3 microbatches: main_grad, flags and .grad as in eager, with
    gradients handed to the DDP hooks or (fusion) added into main_grad inside the graph."""
    check_main_grad_convention(backend, device, fusion)


def test_planted_bug_fused_gradients_not_added_is_caught(backend, device, monkeypatch):
    """Planted bug: the graph takes the fused gradients away from autograd but never adds them."""
    real = MainGradFusion.apply

    def without_add(self, leaves, params, grads):
        add = torch._foreach_add_
        torch._foreach_add_ = lambda *args: None
        try:
            return real(self, leaves, params, grads)
        finally:
            torch._foreach_add_ = add

    monkeypatch.setattr(MainGradFusion, "apply", without_add)
    with pytest.raises(AssertionError, match="not close|Mismatched"):
        check_main_grad_convention(backend, device, fusion=True)


def test_fusion_refuses_a_replaced_main_grad(backend, device):
    torch.manual_seed(0)
    model = Net().to(device)
    ddp = MegatronLikeDDP(model)
    tgraph.enable(model, backend=backend, main_grad_fusion=True)
    x = torch.randn(3, 5, 16, device=device)
    model(x).backward()
    tgraph.create_graphs()
    p = model.blocks[0].plain.weight
    p.main_grad = torch.zeros_like(p.main_grad)  # e.g. buffers re-created by the user
    loss = model(x)
    with pytest.raises(RuntimeError, match="main_grad was replaced"):
        loss.backward()
    del ddp


@pytest.mark.parametrize("planted", [False, True], ids=["fixed", "planted"])
def test_main_grad_re_created_every_step_keeps_the_fused_wgrad(
    backend, device, replays, monkeypatch, planted
):
    """megatron-style buffers re-created between steps (``p.main_grad = zeros``), no fusion:
    the fused-wgrad kernel inside the backward graph adds into the main_grad it was captured
    with, so before, that weight's gradient went to the old buffer and was lost while its flag
    said added (main_grad 0 where eager has 2.1), silently. The captured buffer is loaded with
    the live one before the replay and the sum copied back after. Planted (no copy), the
    fused weights' main_grad differs."""
    if planted:
        monkeypatch.setattr(MainGradFlags, "moved", lambda self: [])
    torch.manual_seed(0)
    model = Net().to(device)
    eager = copy.deepcopy(model)
    ddp, ddp_eager = MegatronLikeDDP(model), MegatronLikeDDP(eager)
    tgraph.enable(model, backend=backend, strict=True)
    xs = torch.randn(4, 3, 5, 16, device=device)

    def step(m, d, x):
        for p in d.params:  # re-created, not zeroed
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
            p.grad_added_to_main_grad = False
        m(x).backward()
        return state(d)

    step(model, ddp, xs[0])
    tgraph.create_graphs()
    for i in (1, 2, 3):
        before = replays[0]
        got, want = step(model, ddp, xs[i]), step(eager, ddp_eager, xs[i])
        assert replays[0] - before == 2  # the merged blocks' forward and backward graphs
        for p in (b.fused.weight for b in model.blocks):
            assert p.grad_added_to_main_grad
        pairs = enumerate(zip(got, want))
        mismatch = [
            k
            for k, ((g, gf, _), (w, wf, _)) in pairs
            if gf != wf or not torch.allclose(g, w, rtol=RTOL, atol=ATOL)
        ]
        assert bool(mismatch) == planted, mismatch


def test_planted_bug_flag_not_redone_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(MainGradFlags, "after_replay", lambda self, moved=(): None)
    with pytest.raises(AssertionError, match="grad_added_to_main_grad"):
        check_main_grad_convention(backend, device)


def test_warmup_and_capture_leave_main_grad_untouched(backend, device):
    torch.manual_seed(0)
    model = Net().to(device)
    ddp = MegatronLikeDDP(model)
    tgraph.enable(model, backend=backend)
    x = torch.randn(3, 5, 16, device=device)
    model(x).backward()
    before = state(ddp)
    tgraph.create_graphs()
    for (mg, flag, _), (mg2, flag2, _) in zip(before, state(ddp)):
        assert torch.equal(mg, mg2) and flag == flag2


class PlainBlock(tgraph.GraphableModule):
    def __init__(self, d=16):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    """Blocks fed a raw input (requires no grad); ``order`` may call a block twice."""

    def __init__(self, n=2, order=None):
        super().__init__()
        self.blocks = nn.ModuleList(PlainBlock() for _ in range(n))
        self.order = order or list(range(n))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(x).pow(2).mean()


def _fused_vs_eager(backend, device, model, merge=True, exact=False):
    eager = copy.deepcopy(model)
    ddp, ddp_eager = MegatronLikeDDP(model), MegatronLikeDDP(eager)
    tgraph.enable(model, backend=backend, strict=True, merge=merge, main_grad_fusion=True)
    xs = torch.randn(4, 5, 16, device=device)

    def step(m, d, x):
        d.zero_grad_buffer()
        m(x).backward()
        return state(d)

    step(model, ddp, xs[0])
    tgraph.create_graphs()
    tol = dict(rtol=0, atol=0) if exact and backend == "emulated" else dict(rtol=RTOL, atol=ATOL)
    for x in xs[1:]:
        for (got, _, _), (want, _, _) in zip(step(model, ddp, x), step(eager, ddp_eager, x)):
            torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "per-block"])
def test_fusion_with_inputs_that_need_no_grad(backend, device, merge):
    """Every parameter fused and no input requiring grad: the graph's node still runs its
    backward (an anchor leaf keeps its outputs differentiable), so main_grad gets the gradients."""
    torch.manual_seed(0)
    _fused_vs_eager(backend, device, Stack().to(device), merge)


def test_fusion_adds_each_parameter_once(backend, device, monkeypatch):
    """A block called twice in a merged stack: its gradients are summed and added once (the same
    destination twice in one _foreach_add_ loses updates on CUDA)."""
    torch.manual_seed(0)
    seen = []
    real = torch._foreach_add_

    def recording(dst, src, *args, **kwargs):
        seen.append([id(t) for t in dst])
        return real(dst, src, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_add_", recording)
    _fused_vs_eager(backend, device, Stack(order=[0, 0, 1]).to(device))
    assert seen and all(len(ids) == len(set(ids)) for ids in seen)


def test_fusion_sums_a_repeated_parameter_in_eagers_order(backend, device):
    """A block called three times in a merged stack: main_grad gets the sum of its gradients
    added up as autograd adds them before megatron's hook, the last call's first (bitwise on
    the emulated backend; on CUDA a graph may pick another cuBLAS algorithm: within RTOL)."""
    torch.manual_seed(0)
    _fused_vs_eager(backend, device, Stack(order=[0, 0, 0, 1]).to(device), exact=True)


def test_planted_bug_fusion_sum_in_member_order_is_caught(backend, device, monkeypatch):
    if backend != "emulated":
        pytest.skip("bitwise only on the emulated backend")
    monkeypatch.setattr(capture, "reversed", list, raising=False)  # _find_params' member order
    with pytest.raises(AssertionError, match="not equal"):
        test_fusion_sums_a_repeated_parameter_in_eagers_order(backend, device)


def test_blocks_with_different_fusion_settings_are_not_merged(backend, device):
    torch.manual_seed(0)
    model = Stack(n=3).to(device)
    MegatronLikeDDP(model)
    tgraph.enable(model.blocks[0], backend=backend, main_grad_fusion=True)
    tgraph.enable(model.blocks[1:], backend=backend, main_grad_fusion=False)
    model(torch.randn(5, 16, device=device)).backward()
    report = tgraph.create_graphs()
    assert report.segments == 1 and report.graphs == 4  # block 0 alone, blocks 1-2 merged
