"""The hand-written baselines of the training benchmark (scripts/bench_train.py): eager PyTorch,
``torch.cuda.make_graphed_callables``, ``torch.compile`` and the "floor" (one hand-written
``torch.cuda.CUDAGraph`` of the whole step, PyTorch's whole-network capture recipe).

Each mode returns (per-step ms, final loss tensor, capture seconds or None, note).
"""

from __future__ import annotations

import time

import torch
from bench_common import Skip, synchronize
from bench_llama import LlamaLM, make_graphed_layers
from bench_train_setup import Setup, checkpoint_blocks, drive, eager_step, need_cuda


def mode_eager(s: Setup):
    model, opt = s.fresh()
    times, loss = drive(s, lambda x, y: eager_step(model, opt, x, y, s))
    return times, loss, None, ""


def mode_eager_ckpt(s: Setup):
    model, opt = s.fresh()
    checkpoint_blocks(model)
    times, loss = drive(s, lambda x, y: eager_step(model, opt, x, y, s))
    return times, loss, None, "every block under torch.utils.checkpoint (non-reentrant)"


def mode_graphed_callables(s: Setup):
    need_cuda(s)
    model, opt = s.fresh()
    if isinstance(model, LlamaLM):  # HF's keyword call, through positional wrappers
        synchronize(s.device)
        t0 = time.perf_counter()
        make_graphed_layers(model, s.batch(0)[0], s.autocast)
        synchronize(s.device)
        capture = time.perf_counter() - t0
        times, loss = drive(s, lambda x, y: eager_step(model, opt, x, y, s))
        return times, loss, capture, "every decoder layer in one call (shared pool); rest eager"
    B, T, C = s.dims["batch"], s.dims["seq"], s.dims["n_embd"]
    # Block inputs are the fp32 residual stream (autocast keeps x + bf16 in fp32) and require
    # grad; make_graphed_callables needs samples whose requires_grad matches the real calls.
    samples = tuple((torch.randn(B, T, C, device=s.device, requires_grad=True),) for _ in model.h)
    synchronize(s.device)
    t0 = time.perf_counter()
    with s.autocast():
        torch.cuda.make_graphed_callables(tuple(model.h), samples)  # replaces each block's forward
    synchronize(s.device)
    capture = time.perf_counter() - t0
    times, loss = drive(s, lambda x, y: eager_step(model, opt, x, y, s))
    return (
        times,
        loss,
        capture,
        "all blocks in one call (shared pool); embeddings, head, loss, AdamW eager",
    )


def mode_compile(s: Setup, mode: str = "reduce-overhead"):
    if mode == "reduce-overhead":  # inductor's CUDA graphs
        need_cuda(s)
    model, opt = s.fresh()
    try:
        cmodel = torch.compile(model, mode=mode)
    except Exception as exc:  # noqa: BLE001 - any compile failure is a skip reason
        raise Skip(f"torch.compile failed: {type(exc).__name__}: {exc}") from exc
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", lambda: None)

    def step(x, y):
        mark()
        return eager_step(cmodel, opt, x, y, s)

    synchronize(s.device)
    t0 = time.perf_counter()
    try:
        for i in range(s.warmup):  # compilation + cudagraph-tree recording happen here
            step(*s.batch(i))
        synchronize(s.device)
    except Exception as exc:  # noqa: BLE001
        raise Skip(f"torch.compile failed: {type(exc).__name__}: {str(exc)[:300]}") from exc
    capture = time.perf_counter() - t0
    times, loss = drive(s, step, start=s.warmup)
    torch._dynamo.reset()
    return (
        times,
        loss,
        capture,
        f"model compiled (mode {mode}); AdamW eager; capture_s = all warmup steps (compile+record)",
    )


def mode_floor(s: Setup):
    need_cuda(s)
    model, opt = s.fresh()
    # PyTorch CUDA-graphs docs, "Whole-network capture": warm up on a side stream (AdamW state
    # is created lazily at the first step), capture fwd+bwd+step with grads set to None so the
    # backward allocates them from the graph's pool, then copy batches into static buffers.
    x0, y0 = s.batch(0)
    static_x, static_y = x0.clone(), y0.clone()
    n_eager = s.warmup - 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(n_eager):
            eager_step(model, opt, *s.batch(i), s)
    torch.cuda.current_stream().wait_stream(side)
    synchronize(s.device)
    t0 = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        with s.autocast():
            _, static_loss = model(static_x, static_y)
        static_loss.backward()
        opt.step()
    synchronize(s.device)
    capture = time.perf_counter() - t0

    def step(x, y):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return static_loss

    times, loss = drive(s, step, start=n_eager)
    return times, loss, capture, "one CUDAGraph: forward+backward+AdamW step"
