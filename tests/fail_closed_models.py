"""Small models and loops shared by the fail-closed tests (tests/test_fail_closed*.py).

The contract those tests pin: a graph replays only while everything it baked in is unchanged.
When something changes after capture, tgraph either follows the change (numbers equal eager, no
warning) or runs the call eagerly with a ``tgraph.GraphFallbackWarning`` naming the change
(``tgraph.GraphFallbackError`` under ``strict=True``). Never silently wrong numbers.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

import tgraph

D = 16

# Graphed and eager runs execute the same fp32 kernels on the same values in the same order, so
# on the CPU they are bitwise equal in practice. 1e-6 (a few fp32 ulps of the values here, which
# are O(1)) leaves room for a CUDA graph picking another cuBLAS algorithm than the eager call over
# the few steps these tests run, and is far below what every bug pinned here moves values by
# (frozen weights, stale buffers, skipped hooks: 3e-4 and more).
TOL = dict(rtol=1e-6, atol=1e-6)


class Block(tgraph.GraphableModule):
    """Residual two-layer MLP: the graphed unit of most tests."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Linear, two graphed blocks, Linear head."""

    def __init__(self, block: Callable[[], nn.Module] = Block, d: int = D) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.blocks = nn.ModuleList([block(), block()])
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def make_pair(device, factory: Callable[[], nn.Module] = Net, seed: int = 0):
    """A model and its eager twin, equal weights."""
    torch.manual_seed(seed)
    model = factory().to(device)
    return model, copy.deepcopy(model)


def batches(device, n: int, batch: int = 4, d: int = D, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, d, generator=g).to(device),
            torch.randn(batch, 1, generator=g).to(device),
        )
        for _ in range(n)
    ]


def train(
    model: nn.Module,
    data,
    backend: str | None = None,
    *,
    before: Callable[[int, nn.Module, torch.optim.Optimizer], torch.optim.Optimizer | None]
    | None = None,
    lr: float = 0.05,
    **enable_kw,
) -> torch.Tensor:
    """Plain SGD steps over ``data``; returns the losses.

    With ``backend``, the model is enabled and graphs are created after step 0 (the recorded
    iteration). ``before(i, model, opt)`` runs before step i in both twins; it may return a new
    optimizer (after parameters were replaced).
    """
    torch.manual_seed(1234)  # dropout draws the same masks in both twins
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    if backend is not None:
        tgraph.enable(model, backend=backend, **enable_kw)
    losses = []
    for i, (x, y) in enumerate(data):
        if before is not None:
            opt = before(i, model, opt) or opt
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if backend is not None and i == 0:
            tgraph.create_graphs()
    return torch.stack(losses)


def assert_same_params(model: nn.Module, ref: nn.Module) -> None:
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, **TOL, msg=lambda m, n=n: f"{n}: {m}")


@contextmanager
def fallbacks() -> Iterator[list[str]]:
    """Collect the messages of every GraphFallbackWarning raised inside."""
    msgs: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield msgs
    for w in caught:
        if issubclass(w.category, tgraph.GraphFallbackWarning):
            msgs.append(str(w.message))
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)


def eager_calls() -> int:
    """Calls of graphed modules that ran eagerly since the last reset (each fallback counts;
    warnings are given once per reason, so they cannot count replays)."""
    return tgraph.eager_calls()


def assert_never_silent(msgs: list[str], names: str) -> None:
    """Fallback-or-follow: every fallback warning must name the change (regex ``names``), in
    its reason: the rest of the message (the module's class, "call ... again") is the same
    for every fallback and would match a short name by chance."""
    for m in msgs:
        found = re.search(r"matches this call: (.*?)\. (?:Running it eagerly|strict=True)", m, re.S)
        reason = found.group(1) if found else m
        assert re.search(names, reason), f"fallback warning does not name {names!r}: {m}"


def fallback_error() -> type[BaseException]:
    """``tgraph.GraphFallbackError``, looked up at run time (collection must not need it)."""
    err = tgraph.GraphFallbackError
    assert issubclass(err, RuntimeError)
    return err


class BlindGuard:
    """A planted layout guard (``tgraph.layout._TensorGuards``) that sees no change: every
    check passes, whatever the tensors' sizes and strides are now."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def check(self, *tensors) -> bool:
        return True


# -- the whole-step entries (tests/test_fail_closed_optim.py, tests/test_planted_optim.py) ----

LR = 2.0**-6
STEPS = 7  # steps of the whole-step runs


def make_mlp(device) -> nn.Sequential:
    """The whole-step entries' small MLP."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D), nn.Tanh(), nn.Linear(D, 1)
    ).to(device)


def make_adamw(params, device) -> torch.optim.AdamW:
    """AdamW a whole-step graph can capture: capturable on CUDA, fused on the CPU."""
    extra = {"capturable": True} if device.type == "cuda" else {"fused": True}
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, **extra)


def eager_run(device, change):
    """``change`` (a scripted change to the model or optimizer) applied in an eager run."""
    model = getattr(change, "make_model", make_mlp)(device)
    opt = change.start(model, device)
    for i, (x, y) in enumerate(batches(device, STEPS)):
        change(i, model, opt)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def optimizer_graph_run(backend, device, change):
    """The same run through :class:`tgraph.OptimizerGraph` (the change comes after capture)."""
    model = getattr(change, "make_model", make_mlp)(device)
    opt = change.start(model, device)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend=backend)
    for i, (x, y) in enumerate(batches(device, STEPS)):
        change(i, model, opt)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        graph.step(loss)
        if i == change.at - 1:
            assert graph.captured  # the change comes after capture
    return model


def full_iteration_run(backend, device, change):
    """The same run through :class:`tgraph.FullIterationGraph` (the change after capture)."""
    model = getattr(change, "make_model", make_mlp)(device)
    opt = change.start(model, device)

    def train_step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    step = tgraph.FullIterationGraph(train_step, warmup_steps=2, backend=backend)
    for i, batch in enumerate(batches(device, STEPS)):
        change(i, model, opt)
        step(batch)
        if i == change.at - 1:
            assert step.num_graphs == 1  # the change comes after capture
    return model
