"""One unit that cannot be graphed leaves the rest graphed (tgraph/layers/create.py).

A graphed module whose capture fails (a host read such as ``.item()``, the emulated analogue
of a CPU tensor copied to the GPU; hooks on its submodules that were not declared capturable;
a host read in its backward) stays eager: the capture report names it with the reason, one
warning says so, and every other module still replays. ``strict=True`` raises instead. The
modules kept eager compute exactly what eager computes, and so do their graphed neighbours.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL
from torch.nn.utils import parametrizations

import tgraph
from tgraph.layers.capture import GraphedUnit
from tgraph.layers.manager import _manager

D = 16
STEPS = 4


class Block(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x))


class HostReadBlock(Block):
    """Reads a value on the host (``.item()``): a CUDA capture cannot contain it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + 0.0 * self.fc.bias.abs().max().item()
        return x + scale * torch.tanh(self.fc(x))


class ListReadBlock(Block):
    """``.tolist()``: a host read too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + 0.0 * max(self.fc.bias.tolist())
        return x + scale * torch.tanh(self.fc(x))


class DataDependentBlock(Block):
    """``torch.nonzero``: its output's shape depends on the values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = torch.nonzero(torch.ones_like(x[:, 0])).squeeze(1)  # every row
        return x + torch.tanh(self.fc(x.index_select(0, rows)))


class CpuCopyBlock(Block):
    """Copies a CPU tensor to the device inside forward (as a stock HF Falcon layer does):
    a CUDA capture of it fails (the emulated backend's tensors are on the CPU already)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor([1.0]).to(x.device)
        return x + scale * torch.tanh(self.fc(x))


class _HostReadInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        if g.abs().sum().item() < 0:  # a host read in the backward pass only
            g = -g
        return g * 2


class BackwardHostReadBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(_HostReadInBackward.apply(x)))


class Net(nn.Module):
    def __init__(self, odd: type[Block] | None = None, at: int = 2, n: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList((odd or Block)() if i == at else Block() for i in range(n))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def batches(device, n=STEPS + 1):
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(5, D, generator=g).to(device), torch.randn(5, 1, generator=g).to(device))
        for _ in range(n)
    ]


def step(model, opt, x, y) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad(set_to_none=True)
    return torch.stack([loss.detach(), *[g.sum() for g in grads]])


def twins(device, odd=None, prepare=None):
    torch.manual_seed(0)
    model = Net(odd).to(device)
    if prepare is not None:
        prepare(model)
    eager = copy.deepcopy(model)
    return model, eager


def enable(model, backend, eager_ok: int | str | None, **options):
    """Every module strict (a fallback raises GraphFallbackError) except block ``eager_ok``
    (every block: ``"all"``), which may stay eager: the strict ones prove that they replay."""
    tgraph.enable(model, backend=backend, strict=eager_ok != "all", **options)
    if isinstance(eager_ok, int):
        tgraph.enable(model.blocks[eager_ok], backend=backend, strict=False, **options)


def tolerance(backend: str) -> dict[str, float]:
    """Exact on the emulated backend; on CUDA a graph may pick other kernels (layer_models)."""
    return dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=RTOL, atol=ATOL)


def train_both(model, eager, backend, device, eager_ok, **options):
    """The recorded step, create_graphs() (its warnings returned), then STEPS steps of both
    models, compared step by step; returns the report and create_graphs()'s warnings."""
    enable(model, backend, eager_ok, **options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
    data = batches(device)
    want = [step(eager, opts[1], *data[0])]
    got = [step(model, opts[0], *data[0])]
    with warnings.catch_warnings(record=True) as at_capture:
        warnings.simplefilter("always")
        report = tgraph.create_graphs()
    eager_calls = tgraph.eager_calls()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tgraph.GraphFallbackWarning)  # none after the one
        for x, y in data[1:]:
            got.append(step(model, opts[0], x, y))
            want.append(step(eager, opts[1], x, y))
    tol = tolerance(backend)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **tol)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, **tol, msg=name)
    fallbacks = [w for w in at_capture if issubclass(w.category, tgraph.GraphFallbackWarning)]
    return report, fallbacks, tgraph.eager_calls() - eager_calls


@pytest.mark.parametrize(
    "odd, cause",
    [
        (HostReadBlock, ".item()"),
        (ListReadBlock, ".item()"),  # tolist() reads each element on the host
        (DataDependentBlock, "torch.nonzero"),
        pytest.param(CpuCopyBlock, "", marks=pytest.mark.cuda),
    ],
)
def test_a_block_that_cannot_be_captured_stays_eager_and_the_rest_replays(
    backend, device, odd, cause
):
    """Block 2 of a mergeable stack of 4 cannot be captured: the stack is split, blocks 0, 1
    and 3 replay (strict: a fallback would raise), block 2 runs eagerly, named once, and
    nothing of the failed capture is left behind."""
    if odd is CpuCopyBlock and backend != "cuda":
        pytest.skip("a CPU tensor copied to the GPU fails a CUDA capture only")
    model, eager = twins(device, odd)
    report, warned, eager_calls = train_both(model, eager, backend, device, eager_ok=2)
    label = f"blocks.2 ({odd.__name__})"
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert label in str(warned[0].message) and cause in str(warned[0].message)
    assert [e for e in report.eager_modules if e.startswith(label)], report.eager_modules
    assert report.runners == 3 and len(_manager.units) == 3
    assert eager_calls == STEPS  # block 2, once a step; every other call replayed
    assert not torch._C._len_torch_dispatch_stack()  # no host-sync check or tape left on
    assert not tgraph.layers.capture.inside_graphed_region()
    if device.type == "cuda":
        assert not torch.cuda.is_current_stream_capturing()


def test_a_failed_capture_leaves_the_model_state_as_before(backend, device):
    """The failed unit's warmup and the other units' warmups and captures are undone: the RNG
    and every parameter are as before create_graphs()."""
    model, _ = twins(device, HostReadBlock)
    tgraph.enable(model, backend=backend)
    x, y = batches(device, 1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    rng = torch.get_rng_state()
    params = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(tgraph.GraphFallbackWarning, match="HostReadBlock"):
        tgraph.create_graphs()
    assert torch.equal(torch.get_rng_state(), rng)
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q) and p.grad is None


def test_strict_raises_and_leaves_everything_eager(backend, device):
    model, _ = twins(device, HostReadBlock)
    tgraph.enable(model, backend=backend, strict=True)
    x, y = batches(device, 1)[0]
    nn.functional.mse_loss(model(x), y).backward()
    rng = torch.get_rng_state()
    with pytest.raises(tgraph.CaptureError, match=r"HostReadBlock.*\.item\(\)"):
        tgraph.create_graphs()
    assert not _manager.captured and not _manager.units
    assert torch.equal(torch.get_rng_state(), rng)
    if device.type == "cuda":
        assert not torch.cuda.is_current_stream_capturing()


@pytest.mark.parametrize("merge", [True, False])
def test_a_host_read_in_a_backward_leaves_that_block_eager(backend, device, merge):
    """The backward of block 2 reads the host. The warmup's first pass checks the backward
    too, so this fails before any graph of the stack exists: the stack is split, block 2 runs
    eagerly, the others replay (strict)."""
    model, eager = twins(device, BackwardHostReadBlock)
    report, warned, eager_calls = train_both(model, eager, backend, device, eager_ok=2, merge=merge)
    assert len(warned) == 1 and "blocks.2 (BackwardHostReadBlock)" in str(warned[0].message)
    assert report.runners == 3 and eager_calls == STEPS


def _fail_backward_capture_of(monkeypatch, module):
    """Plant a failure in the backward capture of the unit that holds ``module``: its forward
    graph exists already (and the next block's graph reads its static output)."""
    real = GraphedUnit.capture_backward

    def capture_backward(self, factory):
        if any(r.module is module for r in self.members):
            raise RuntimeError("planted: operation not permitted when stream is capturing")
        return real(self, factory)

    monkeypatch.setattr(GraphedUnit, "capture_backward", capture_backward)


def test_a_failed_backward_capture_leaves_that_unit_eager(backend, device, monkeypatch):
    """merge=False: block 2's forward graph was captured, its backward capture fails. Block 2
    runs eagerly; block 3, whose graph took block 2's static output as its own static input,
    copies its input instead; blocks 0, 1 and 3 replay (strict), exactly as eager."""
    model, eager = twins(device)
    _fail_backward_capture_of(monkeypatch, model.blocks[2])
    report, warned, eager_calls = train_both(model, eager, backend, device, eager_ok=2, merge=False)
    assert len(warned) == 1 and "planted" in str(warned[0].message)
    assert "blocks.2 (Block)" in str(warned[0].message)
    assert report.runners == 3 and eager_calls == STEPS
    (block3,) = [u for u in _manager.units if u.head.module is model.blocks[3]]
    assert block3.cap.shared_inputs == (False,)  # its input is copied, not read in place


def test_a_failed_backward_capture_of_a_merged_stack_leaves_the_stack_eager(
    backend, device, monkeypatch
):
    """A merged stack's forward graph holds every member: when its backward capture fails,
    the whole stack runs eagerly, each member named, exactly as eager."""
    model, eager = twins(device)
    _fail_backward_capture_of(monkeypatch, model.blocks[2])
    report, warned, eager_calls = train_both(model, eager, backend, device, eager_ok="all")
    assert len(warned) == 1 and "blocks.0 (Block), blocks.1 (Block)" in str(warned[0].message)
    assert sum(e.startswith("blocks.") for e in report.eager_modules) == 4, report.eager_modules
    assert report.runners == 0 and eager_calls == 4 * STEPS


def test_a_hook_on_a_submodule_leaves_that_block_eager(backend, device):
    """An activation logger on blocks[1].fc: block 1 runs eagerly (so the hook runs at every
    call, as in eager), named with the hook; the other blocks replay."""
    seen: list[int] = []
    model, eager = twins(device)
    eager_seen: list[int] = []
    model.blocks[1].fc.register_forward_hook(lambda m, a, out: seen.append(out.shape[0]))
    eager.blocks[1].fc.register_forward_hook(lambda m, a, out: eager_seen.append(out.shape[0]))
    report, warned, eager_calls = train_both(model, eager, backend, device, eager_ok=1)
    assert len(warned) == 1 and "blocks.1 (Block)" in str(warned[0].message)
    assert "forward hook" in str(warned[0].message)
    assert any("capturable_hooks" in e for e in report.eager_modules)
    assert seen == eager_seen and len(seen) == STEPS + 1
    assert report.runners == 3 and eager_calls == STEPS


def _old_style_pair(device, norm: str):
    """A model whose block 1 has an old-style norm (a forward pre-hook), and its eager twin
    (built the same way: the hook's tensors cannot be deep-copied)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        model = Net().to(device)
        getattr(torch.nn.utils, norm)(model.blocks[1].fc)
        models.append(model)
    return models


@pytest.mark.filterwarnings("ignore:.*weight_norm.* is deprecated:FutureWarning")
@pytest.mark.parametrize(
    "norm, hook", [("weight_norm", "WeightNorm"), ("spectral_norm", "SpectralNorm")]
)
def test_old_style_norms_stay_eager_unless_declared_capturable(backend, device, norm, hook):
    """torch.nn.utils.weight_norm and spectral_norm recompute the weight in a forward
    pre-hook: by default the block stays eager, named; with capturable_hooks=True the hook is
    captured (pure tensor code: the spectral norm's power iteration updates its buffers at
    every replay) and every block replays, as eager."""
    model, eager = _old_style_pair(device, norm)
    report, warned, eager_calls = train_both(model, eager, backend, device, eager_ok=1)
    assert len(warned) == 1 and hook in str(warned[0].message)
    assert "blocks.1 (Block)" in str(warned[0].message) and eager_calls == STEPS
    tgraph.reset()
    model, eager = _old_style_pair(device, norm)
    report, warned, eager_calls = train_both(
        model, eager, backend, device, eager_ok=None, capturable_hooks=True
    )
    assert not warned and eager_calls == 0 and report.runners == 4
    for a, b in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, **tolerance(backend))


@pytest.mark.parametrize("norm", ["weight_norm", "spectral_norm"])
def test_parametrized_norms_are_graphed(backend, device, norm):
    """torch.nn.utils.parametrizations recompute the weight inside forward (no hook): every
    block replays (strict) and trains as in eager, the spectral norm's power iteration
    updating its buffers at every replay."""
    model, eager = twins(device, prepare=lambda m: getattr(parametrizations, norm)(m.blocks[1].fc))
    report, warned, eager_calls = train_both(model, eager, backend, device, eager_ok=None)
    assert not warned and eager_calls == 0
    for a, b in zip(model.buffers(), eager.buffers()):
        torch.testing.assert_close(a, b, **tolerance(backend))
