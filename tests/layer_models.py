"""Small models and training loops shared by the per-layer graph tests."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import tgraph
from tgraph.toy.gpt import GPT, GPTConfig

# Graphed and eager runs execute the same kernels on the same values in the same order, so on
# the emulated backend results are bitwise equal in practice; on CUDA a graph may pick another
# cuBLAS/cuDNN algorithm than the eager call on the default stream, which perturbs fp32 results
# by a few ulps that compound over steps. 1e-5 relative (about 80 fp32 ulps) covers that and
# still catches any real bug (a stale input or a lost gradient moves values by >= 1e-3).
RTOL, ATOL = 1e-5, 1e-6


def tiny_gpt(device, dropout: float = 0.0, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16, dropout=dropout)
    return GPT(cfg).to(device)


class MLPBlock(tgraph.GraphableModule):
    """A non-transformer block: residual two-layer MLP with LayerNorm."""

    def __init__(self, d: int, hidden: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden * d)
        self.fc2 = nn.Linear(hidden * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class MLPNet(nn.Module):
    def __init__(self, d: int = 16, n: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(MLPBlock(d) for _ in range(n))
        self.out = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        pred = self.out(h)
        return pred, F.mse_loss(pred, y)


def gpt_batches(device, n: int, batch: int = 4, seq: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randint(0, 256, (batch, seq), generator=g).to(device),
            torch.randint(0, 256, (batch, seq), generator=g).to(device),
        )
        for _ in range(n)
    ]


def mlp_batches(device, n: int, batch: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, 8, generator=g).to(device),
            torch.randn(batch, 1, generator=g).to(device),
        )
        for _ in range(n)
    ]


def train(
    model: nn.Module,
    batches,
    *,
    graphed: bool,
    backend: str = "auto",
    lr: float = 0.1,
    merge: bool = True,
):
    """SGD-with-momentum steps over ``batches``; with ``graphed``, graphs are created after step 1.

    SGD, not Adam: Adam divides by sqrt(v), so a gradient element that is ~0 turns a last-ulp
    difference (CUDA attention and embedding backward kernels use atomics and are not bitwise
    reproducible even eager-vs-eager) into an lr-sized update, which no tight tolerance survives.
    SGD keeps rounding differences at rounding size, so a tolerance of 1e-5 stays meaningful.

    Returns the per-step losses (floats) and the model.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if graphed:
        tgraph.enable(model, backend=backend, strict=True, merge=merge)
    losses = []
    for i, (x, y) in enumerate(batches):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if graphed and i == 0:
            tgraph.create_graphs()
    return losses, model


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


class Scaled(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return torch.relu(self.lin(x)) * scale


class DropBlock(tgraph.GraphableModule):
    def __init__(self, d: int = 32, p: float = 0.5) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.lin(x)))


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


class TwoOut(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


def two_out_steps(mod, x, graphed: bool, backend: str):
    opt = torch.optim.AdamW(mod.parameters(), lr=0.1)
    grads = []
    for step in range(4):  # b used at steps 0 (recorded) and 1, unused at steps 2 and 3
        a, b = mod(x)
        (a.sum() + b.sum() if step < 2 else a.sum()).backward()
        # cloned: a gradient view kept past the next replay cannot be moved out of graph
        # memory on PyTorch < 2.13 (that replay would run eagerly)
        grads.append((_clone(mod.b.weight.grad), _clone(x.grad)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        x.grad = None
        if graphed and step == 0:
            tgraph.create_graphs()
    return grads


def param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """A clone of every parameter gradient, by name."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def accumulate(model: nn.Module, batches) -> dict[str, torch.Tensor]:
    """Backward of every batch's loss, without a step between; the accumulated gradients."""
    for x, y in batches:
        model(x, y)[1].backward()
    return param_grads(model)


def check_gradient_accumulation(backend, device):
    """3 microbatches accumulated into .grad equal eager's accumulated gradients."""
    model = tiny_gpt(device)
    eager = twin(model)
    tgraph.enable(model, backend=backend, strict=True)
    batches = gpt_batches(device, 3)
    accumulate(model, batches[:1])  # recorded iteration
    model.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    got = accumulate(model, batches)
    want = accumulate(eager, batches)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=ATOL, msg=n)
