"""The graphs' memory by kind (tgraph.memory): each kind is the size of its buffers, and on a
GPU the buffers held between steps add up to what capture left allocated."""

from __future__ import annotations

import pytest
import torch
from layer_models import gpt_batches, tiny_gpt, train

import tgraph


def test_memory_report_adds_up(backend, device):
    model = tiny_gpt(device)  # 3 blocks, d=32, batch 4, seq 16: merged into one stack
    tgraph.enable(model, backend=backend, strict=True)
    x, y = gpt_batches(device, 1)[0]
    model(x, y)[1].backward()  # recorded: each block's runner clones its input as a sample
    model.zero_grad(set_to_none=True)
    samples = sum(s.nbytes for r in tgraph.module._manager.all_runners() for s in r.samples)
    report = tgraph.create_graphs()  # frees the samples
    mem = tgraph.memory_report()
    assert report.memory == mem and mem.units == 1
    block_out = 4 * 16 * 32 * 4  # one block's output, fp32 bytes
    assert mem.static_outputs == 3 * block_out
    assert mem.grad_outputs == 3 * block_out  # one buffer per differentiable output
    assert mem.static_inputs == block_out and mem.input_grads == block_out  # the stack's input
    params = sum(p.numel() for b in model.h for p in b.parameters()) * 4
    assert mem.param_grads == params
    assert mem.saved_activations > mem.static_outputs  # attention and MLP intermediates
    assert mem.held == sum(
        (mem.static_inputs, mem.static_outputs, mem.grad_outputs, mem.input_grads, params)
    )
    if backend == "cuda":  # the buffers are what the capture left allocated (samples freed)
        assert report.pool_bytes + samples == pytest.approx(mem.held, rel=0.1)


def test_memory_report_is_empty_before_capture():
    assert tgraph.memory_report().units == 0 and tgraph.memory_report().held == 0


def test_report_names_every_kind_it_holds(backend, device):
    model = tiny_gpt(device)
    train(model, gpt_batches(device, 2), graphed=True, backend=backend)
    text = str(tgraph.module._manager.report)
    for kind in ("static_outputs", "saved_activations", "param_grads", "held"):
        assert kind in text
    assert torch.cuda.is_available() or "pool 0.0 MiB" in text
