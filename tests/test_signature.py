"""Call signatures: a call no graph was captured for runs eagerly (or raises under strict=True)
with a message naming the difference; arguments a graph cannot stand for are refused."""

from __future__ import annotations

import copy
import json
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


def test_the_priority_order_torch_sets_at_its_first_attention_is_the_usual_one(
    replays, monkeypatch
):
    """torch sets the SDPA priority order itself, once, at the first attention on a CUDA device
    (cuDNN first on H100/H200 under torch 2.11). A model recorded before any attention had run
    keyed its first layer under the old order and every later call under the new one, so that
    layer never replayed (HF Llama on an H100: every step eager). Modeled on the CPU: the
    process's first attention, and ``signature._pick_sdpa`` (torch's kernel choice), set the order
    as torch's CUDA code does; strict replays every call, bitwise against eager. The real thing
    is :func:`test_a_fresh_cuda_process_replays_its_first_layer`."""
    from torch.nn import functional as F

    from tgraph import signature
    from tgraph.toy.gpt import GPT, GPTConfig

    first = torch._C._get_sdp_priority_order()
    for name in ("_settled", "_USUAL_FLAGS", "_USUAL_SDPA"):
        monkeypatch.setattr(signature, name, getattr(signature, name))
    signature._settled = [False]
    pending = [True]

    def torch_sets_its_order(device=None):  # sdp_utils.cpp's priority_order(), preferring cuDNN
        if pending[0]:
            pending[0] = False
            torch._C._set_sdp_priority_order([3, 1, 2, 0, 4])

    attention = F.scaled_dot_product_attention

    def first_attention_sets_it(*args, **kwargs):
        torch_sets_its_order()
        return attention(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", first_attention_sets_it)
    monkeypatch.setattr(signature, "_pick_sdpa", torch_sets_its_order)
    monkeypatch.setattr(signature, "_cuda_ready", lambda: True)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        ref = copy.deepcopy(model)
        tgraph.enable(model, backend="emulated", strict=True)
        x, y = torch.randint(0, 256, (2, 4, 16), generator=torch.Generator().manual_seed(1))

        def step(m):
            _, loss = m(x, y)
            loss.backward()
            grads = [p.grad for p in m.parameters()]
            m.zero_grad(set_to_none=True)
            return [loss.detach(), *grads]

        for i in range(3):
            torch.testing.assert_close(step(model), step(ref), rtol=0, atol=0)
            if i == 0:
                tgraph.create_graphs()
        assert not pending[0] and replays[0] and tgraph.eager_calls() == 0
    finally:
        torch._C._set_sdp_priority_order(first)


_FRESH_PROCESS = """
import copy, json, torch, tgraph
from tgraph.toy.gpt import GPT, GPTConfig
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=16)).cuda()
ref = copy.deepcopy(model)
tgraph.enable(model, backend="cuda", strict=True)
x, y = torch.randint(0, 256, (2, 4, 16), device="cuda")
before = torch._C._get_sdp_priority_order()
losses = []
for i in range(4):
    for m in (model, ref):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = m(x, y)
        loss.backward()
        m.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if i == 0:
        tgraph.create_graphs()
print(json.dumps([before, torch._C._get_sdp_priority_order(), tgraph.eager_calls(), losses]))
"""


@pytest.mark.cuda
def test_a_fresh_cuda_process_replays_its_first_layer():
    """The real case of the test above: a process whose first attention is the recorded
    iteration's (a fresh interpreter); strict, so a layer that did not replay raises. Losses of
    replays equal eager's within bf16 rounding (same kernels, cuBLAS may pick others under
    capture). Prints the order torch started with and the one it settled on (they differ on an
    H100/H200 with torch 2.11)."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, after, eager, losses = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"SDPA priority order: {before} at the start, {after} after the first attention")
    assert eager == 0
    torch.testing.assert_close(losses[0::2], losses[1::2], rtol=1e-2, atol=1e-2)
