"""No silent wrong results: planted bugs, RNG, new situations, capture failures."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
from layer_models import ATOL, RTOL, gpt_batches, tiny_gpt, train, twin
from test_layer_parity import check_gradient_accumulation

import tgraph
from tgraph import rng
from tgraph.unit import GraphedUnit

# ----------------------------------------------------------------- planted bugs


def check_parity(backend, device):
    model = tiny_gpt(device)
    batches = gpt_batches(device, 4)
    losses, _ = train(twin(model), batches, graphed=True, backend=backend)
    ref, _ = train(model, batches, graphed=False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)


def test_planted_bug_skipped_input_copy_is_caught(backend, device, monkeypatch):
    check_parity(backend, device)
    tgraph.reset()
    monkeypatch.setattr(GraphedUnit, "_copy_inputs", lambda self, tensors: True)  # no copy
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        check_parity(backend, device)


def test_planted_bug_unprotected_param_grads_is_caught(backend, device, monkeypatch):
    # What torch.cuda.make_graphed_callables does (pytorch issue 181723): detached aliases let
    # AccumulateGrad adopt the static buffer as .grad; the next microbatch overwrites it.
    real = GraphedUnit.grads_for_autograd
    monkeypatch.setattr(
        GraphedUnit,
        "grads_for_autograd",
        lambda self, clone=True, active=None: real(self, False, active),
    )
    with pytest.raises(AssertionError, match=r"^[\w.]+$"):  # msg= is the parameter's name
        check_gradient_accumulation(backend, device)


class GenDropout(tgraph.GraphableModule):
    """Dropout drawing from an explicit generator (like a model-parallel RNG tracker)."""

    def __init__(self, generator: torch.Generator | None) -> None:
        super().__init__()
        self.generator = generator
        self.lin = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, device=x.device, generator=self.generator) > 0.5
        return self.lin(x) * keep


def check_masks_change(backend, device, *, explicit_generator: bool):
    """Graphed dropout draws a new mask at every replay."""
    gen = None
    if explicit_generator:
        gen = torch.Generator(device=device).manual_seed(123)
        tgraph.register_generator(gen)
    torch.manual_seed(0)
    mod = GenDropout(gen).to(device)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(8, 64, device=device, requires_grad=True)
    mod(x).sum().backward()
    tgraph.create_graphs()
    masks = []
    for _ in range(3):
        y = mod(x)
        y.sum().backward()
        masks.append((y != 0).clone())
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2]), (
        "dropout mask repeated across replays: generator not registered with the graph"
    )


@pytest.mark.parametrize("explicit_generator", [False, True])
def test_dropout_masks_change_every_replay(backend, device, explicit_generator):
    if backend == "cuda" and not explicit_generator:
        pass  # PyTorch registers the default CUDA generator itself
    check_masks_change(backend, device, explicit_generator=explicit_generator)


def test_planted_bug_unregistered_rng_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(rng, "graph_generators", lambda device: [])
    with pytest.raises((AssertionError, RuntimeError), match="dropout mask repeated|capture"):
        # emulated: the unregistered generator is frozen -> same mask each replay;
        # CUDA: the explicit generator is not registered -> frozen mask or a capture error.
        check_masks_change(backend, device, explicit_generator=True)


def test_gpt_dropout_is_random_and_eval_never_replays_training_graph(backend, device):
    model = tiny_gpt(device, dropout=0.3)
    eager = twin(model)
    tgraph.enable(model, backend=backend)
    x, y = gpt_batches(device, 1)[0]
    model(x, y)[1].backward()
    tgraph.create_graphs()
    a = model(x, y)[0].detach().clone()
    b = model(x, y)[0].detach().clone()
    assert not torch.equal(a, b)
    model.eval()
    eager.eval()
    with pytest.warns(
        tgraph.GraphFallbackWarning, match="module.training changed from True to False"
    ):
        got = model(x, y)[0]
    torch.testing.assert_close(got, eager(x, y)[0], rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------ new situations


class Scaled(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> torch.Tensor:
        return torch.relu(self.lin(x)) * scale


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


def test_create_graphs_without_record_is_a_clear_error():
    with pytest.raises(RuntimeError, match="nothing recorded"):
        tgraph.create_graphs()


def test_enable_on_model_without_graphable_modules():
    with pytest.raises(ValueError, match="contains no tgraph.GraphableModule"):
        tgraph.enable(nn.Linear(2, 2))


# ------------------------------------------------------------ capture failure


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
    torch.manual_seed(0)
    mod = HostSync().to(device)
    tgraph.enable(mod, backend=backend)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod(x).sum().backward()
    rng_before = torch.get_rng_state()
    with pytest.raises(
        tgraph.CaptureError, match=r"capturing Runner\(HostSync.*(\.item\(\)|host sync)"
    ):
        tgraph.create_graphs()
    assert not tgraph.module._manager.captured
    assert torch.equal(torch.get_rng_state(), rng_before)
    if device.type == "cuda":
        assert not torch.cuda.is_current_stream_capturing()
        torch.cuda.synchronize()
    # the module keeps working eagerly, with correct values and gradients
    y = mod(x)
    torch.testing.assert_close(y, torch.nn.Module.__call__(mod, x))
    y.sum().backward()
    assert mod.lin.weight.grad is not None


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
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    with pytest.warns(tgraph.GraphFallbackWarning, match="autocast changed"):
        plain = mod(x)
    assert plain.dtype == torch.float32


def test_inplace_change_of_an_output_before_backward_is_an_error(backend, device):
    torch.manual_seed(0)
    mod = Scaled().to(device)
    tgraph.enable(mod, backend=backend)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod(x).sum().backward()
    tgraph.create_graphs()
    y = mod(x)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after its forward"):
        y.sum().backward()
