"""A steady graphed training step makes no host sync of tgraph's own.

A host sync (``.item()``, ``bool(tensor)``, ``torch.equal``, a copy to the CPU) stops the host
until the GPU has drained: the lead the host keeps over the GPU, which is what graphs buy, is
gone for that step. Counted by a dispatch mode on both backends (the operations a CUDA capture
refuses as host reads, :func:`tgraph.guards.refusal`, and copies from a device to the CPU); on
CUDA the step also runs under ``set_sync_debug_mode("error")``, which sees syncs outside the
dispatcher too. The toy GPT has none of its own, so every sync of its step counts. A Hugging
Face model's forward has transformers' own (``masking_utils``' packed-sequence check reads
``.all()`` of the position ids in every training forward): per-layer graphs keep it, only the
syncs made from tgraph's code count there; the whole model as one unit leaves none (the check
is inside the captured forward). The optimizer step as an ``OptimizerGraph`` (clipping, skipping
non-finite steps) and the whole step as a ``FullIterationGraph`` make none either: a host that
never waits keeps the GPU fed (``bench_train.py --trace`` measures the GPU's idle share).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from layer_models import gpt_batches, tiny_gpt
from optimizer_models import make_optimizer  # AdamW, its step count on the device
from torch.utils._python_dispatch import TorchDispatchMode

import tgraph
from tgraph.guards import refusal

_TGRAPH = str(Path(tgraph.__file__).parent)


class CountSyncs(TorchDispatchMode):
    """Host reads of tensors (``refusal``'s classes and device-to-CPU copies); ``ours``: those
    made with a frame of tgraph's package on the Python stack. On CUDA only reads of CUDA
    tensors sync (``.item()`` of a CPU scalar the graph baked in, which ``replay.refusal``
    compares, does not); the emulated backend's device is the CPU, so every read counts."""

    def __init__(self, device) -> None:
        super().__init__()
        self.cuda = device.type == "cuda"
        self.all: list[str] = []
        self.ours: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        to_cpu = (
            name in ("aten::_to_copy", "aten::copy_")
            and any(isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args)
            and (
                kwargs.get("device") == torch.device("cpu")
                or (name == "aten::copy_" and args[0].device.type == "cpu")
            )
        )
        on_device = not self.cuda or any(
            isinstance(a, torch.Tensor) and a.device.type == "cuda" for a in args
        )
        if to_cpu or (on_device and refusal(func, args, kwargs) is not None):
            self.all.append(name)
            f = sys._getframe(1)
            while f is not None:
                if f.f_code.co_filename.startswith(_TGRAPH):
                    self.ours.append(f"{name} at {f.f_code.co_filename}:{f.f_lineno}")
                    break
                f = f.f_back
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_sync_on_cuda(device, on: bool):
    if device.type != "cuda" or not on:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def steady_step(model, step, batches, device, *, model_syncs: bool = False):
    """Record and capture with ``step``, two steady steps, then one counted (on CUDA under
    ``set_sync_debug_mode("error")`` unless the model makes syncs of its own)."""
    step(batches[0])
    tgraph.create_graphs()
    for b in batches[1:3]:
        step(b)
    count = CountSyncs(device)
    before = tgraph.eager_calls()
    with no_sync_on_cuda(device, not model_syncs), count:
        step(batches[3])
    assert tgraph.eager_calls() == before  # strict too: every call of the counted step replayed
    return count


@pytest.mark.parametrize("direct", [True, False], ids=["direct_grads", "autograd_path"])
def test_a_steady_per_layer_step_of_the_toy_makes_no_host_sync(backend, device, direct):
    model = tiny_gpt(device)
    tgraph.enable(model, backend=backend, strict=True, direct_grads=direct)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # no host read of its own

    def step(b):
        model(*b)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    count = steady_step(model, step, gpt_batches(device, 4), device)
    assert count.all == [], count.all


@pytest.mark.parametrize("whole", [False, True], ids=["per_layer", "whole_model"])
def test_a_steady_hf_llama_step_makes_no_host_sync_of_tgraphs(backend, device, whole):
    pytest.importorskip("transformers")
    from hf_models import tiny_model, token_batches

    from tgraph.integrations import transformers as tg_hf

    model = tiny_model("llama", device)
    tg_hf.graph_layers(model, whole=whole, backend=backend, strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(x):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    count = steady_step(model, step, token_batches(device, 4), device, model_syncs=not whole)
    assert count.ours == [], count.ours
    if whole:  # transformers' own check runs inside the captured forward
        assert count.all == [], count.all


def test_a_steady_optimizer_graph_step_makes_no_host_sync(backend, device, replays):
    """Per-layer graphs and the optimizer step as an OptimizerGraph that clips and skips
    non-finite steps: the norm, the skip decision and the learning rate stay on the device."""
    model = tiny_gpt(device)
    tgraph.enable(model, backend=backend, strict=True)
    graph = tgraph.OptimizerGraph(
        make_optimizer(model, device), clip_grad_norm=1.0, skip_nonfinite=True, backend=backend
    )

    def step(b):
        loss = model(*b)[1]
        loss.backward()
        graph.step(loss)

    count = steady_step(model, step, gpt_batches(device, 4), device)
    assert graph.captured and replays[0] > 0
    assert count.all == [], count.all


def test_a_steady_full_iteration_step_makes_no_host_sync(backend, device, replays):
    """The whole step as one FullIterationGraph: one counted call is one replay, no sync."""
    model = tiny_gpt(device)
    opt = make_optimizer(model, device)

    def train_step(b):
        opt.zero_grad(set_to_none=True)
        loss = model(*b)[1]
        loss.backward()
        opt.step()
        return loss.detach()

    graph = tgraph.FullIterationGraph(train_step, warmup_steps=2, backend=backend)
    batches = gpt_batches(device, 5)
    for b in batches[:4]:  # warmup, capture, one replay
        graph(b)
    count = CountSyncs(device)
    before = replays[0]
    with no_sync_on_cuda(device, True), count:
        graph(batches[4])
    assert replays[0] == before + 1  # replayed, not run eagerly
    assert count.all == [], count.all
