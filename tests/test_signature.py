"""Call signatures: a call no graph was captured for runs eagerly (or raises under strict=True)
with a message naming the difference; arguments a graph cannot stand for are refused."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
from layer_models import Cache, CachedBlock, DropBlock, Scaled

import tgraph

CHANGES = {
    "shape": (lambda x: ((x[:2],), {}), "argument 0 changed from (4, 8) float32"),
    "dtype": (lambda x: ((x.double(),), {}), "to (4, 8) float64"),
    "requires_grad": (lambda x: ((x.detach(),), {}), "requires_grad=True to (4, 8) float32"),
    "non-tensor value": (
        lambda x: ((x,), {"scale": 3.0}),
        "arguments changed from [argument 0] to [argument 0, keyword argument 'scale']",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_unmatched_call_runs_eagerly_and_warns_once(backend, device, change):
    make, message = CHANGES[change]
    torch.manual_seed(0)
    mod = Scaled().to(device)
    tgraph.enable(mod, backend=backend)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod(x).sum().backward()
    tgraph.create_graphs()
    args, kwargs = make(x)
    if change == "dtype":
        mod.double()
    with pytest.warns(tgraph.GraphFallbackWarning, match=re.escape(message)):
        got = mod(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second identical call is silent
        again = mod(*args, **kwargs)
    want = torch.nn.Module.__call__(mod, *args, **kwargs)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(again, want)


def test_strict_mode_raises_naming_the_field(backend, device):
    torch.manual_seed(0)
    mod = Scaled().to(device)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod(x).sum().backward()
    tgraph.create_graphs()
    with pytest.raises(RuntimeError, match=r"argument 0 changed from \(4, 8\)"):
        mod(torch.randn(3, 8, device=device, requires_grad=True))
    with pytest.raises(
        RuntimeError,
        match=re.escape("arguments changed from [argument 0] to [argument 0, keyword argument"),
    ):
        mod(x, scale=3.0)


def test_changed_non_tensor_value_is_named(backend, device):
    torch.manual_seed(0)
    mod = Scaled().to(device)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod(x, scale=2.0).sum().backward()
    tgraph.create_graphs()
    torch.testing.assert_close(mod(x, scale=2.0), torch.nn.Module.__call__(mod, x, scale=2.0))
    with pytest.raises(RuntimeError, match="keyword argument 'scale' changed from 2.0 to 3.0"):
        mod(x, scale=3.0)


def test_unhashable_argument_is_a_clear_error(backend, device):
    mod = Scaled().to(device)
    tgraph.enable(mod, backend=backend)
    with pytest.raises(TypeError, match="keyword argument 'scale' is an unhashable set"):
        mod(torch.randn(4, 8, device=device), scale={1.0})


def test_autocast_is_part_of_the_signature(backend, device):
    """A graph recorded under autocast is captured under it; a call without it runs eagerly."""
    torch.manual_seed(0)
    mod = Scaled().to(device)
    tgraph.enable(mod, backend=backend)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        mod(x).sum().backward()
    tgraph.create_graphs()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        got = mod(x)
        want = torch.nn.Module.__call__(mod, x)
    assert tgraph.eager_calls() == 0  # replayed under autocast
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    with pytest.warns(tgraph.GraphFallbackWarning, match="autocast changed"):
        plain = mod(x)
    assert plain.dtype == torch.float32


def test_the_sdpa_backend_selection_is_part_of_the_signature(backend, device, replays):
    """``torch.nn.attention.sdpa_kernel`` picks the kernel eager runs, and a graph keeps the one
    picked at its capture: calls recorded under a selection replay graphs captured under it,
    though ``create_graphs()`` runs outside the block (eager's numbers: bitwise on CPU, the same
    kernels on the same values; to rounding on CUDA, where cuBLAS may pick another algorithm
    under capture); a call under another selection is refused (strict) naming it, as is one
    under the selection torch started with. The toy GPT's attention is
    ``F.scaled_dot_product_attention``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tgraph.toy.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)).to(device)
    ref = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 256, (2, 4, 16), generator=g).to(device)

    def step(m):
        with sdpa_kernel(SDPBackend.MATH):
            _, loss = m(x, y)
        loss.backward()
        grads = [p.grad for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return [loss.detach(), *grads]

    tol = {} if device.type == "cuda" else {"rtol": 0, "atol": 0}
    for i in range(3):
        torch.testing.assert_close(step(model), step(ref), **tol)
        if i == 0:
            tgraph.create_graphs()  # outside the sdpa_kernel block
    assert replays[0] and tgraph.eager_calls() == 0
    with pytest.raises(tgraph.GraphFallbackError, match=r"SDPA backend selection changed from "):
        model(x, y)
    other = SDPBackend.EFFICIENT_ATTENTION if device.type == "cuda" else SDPBackend.FLASH_ATTENTION
    with sdpa_kernel(other), pytest.raises(tgraph.GraphFallbackError, match="SDPA backend"):
        model(x, y)


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


def test_mutable_object_argument_names_the_cause(backend, device):
    block = CachedBlock().to(device)
    tgraph.enable(block, backend=backend)
    x = torch.randn(2, 4, device=device)
    with pytest.warns(tgraph.GraphFallbackWarning, match="Cache object.*use_cache=False"):
        block(x, cache=Cache()).sum().backward()
    with pytest.raises(RuntimeError, match="nothing recorded"):
        tgraph.create_graphs()  # no misleading host-sync hint: nothing was graphable
