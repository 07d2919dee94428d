"""Training-step benchmark: eager vs. the CUDA-graph peers vs. tgraph, side by side, one process.

Every mode trains a deep copy of ONE toy GPT (same initial weights) on the same fixed batches for
the same number of steps; the first ``--warmup`` steps (capture, compilation) are not timed.
The final losses must agree: the benchmark doubles as a parity check (column ``parity``).

    python scripts/bench_train.py --configs tiny --dtypes fp32 --steps 100 --out bench_out
    python scripts/bench_train.py --smoke --out /tmp/smoke     # seconds, CPU, emulated graphs
    python scripts/bench_train.py --hf                         # HF Llama cells, JSON to $OUT

Modes: eager, graphed_callables (``torch.cuda.make_graphed_callables`` on every block), compile
(``torch.compile(mode="reduce-overhead")`` on the model, optimizer eager), floor (one hand-written
``torch.cuda.CUDAGraph`` of forward+backward+AdamW, PyTorch's "whole network capture" recipe),
tgraph_layer (per-layer graphs), tgraph_full (``tgraph.FullIterationGraph``), megatron_none /
megatron_local (megatron-core GPTModel of the same dims, when importable); compile_default
(``torch.compile`` default mode, inductor without its CUDA graphs), tgraph_layer_compiled /
tgraph_layer_opt_compiled (``tgraph.enable(model, compile=True)``: per-layer graphs over
inductor-compiled layers), tgraph_full_compiled (``FullIterationGraph`` around a step of
``torch.compile(model)``).

The ``llama_*`` configs train a Hugging Face ``LlamaForCausalLM`` of those dims instead of the
toy (random init, SDPA attention; scripts/bench_llama.py); ``--hf`` runs the three Llama cells
(12 layers d256 T128 fp32 at batch 1 and 8, 16 layers d1024 T256 bf16 autocast at batch 4).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    Skip,
    StepTimer,
    environment,
    environment_markdown,
    fresh_memory,
    markdown_table,
    peak_memory_mib,
    summarize,
    synchronize,
    write_outputs,
)
from bench_llama import LLAMA_CONFIGS, LLAMA_DTYPES, LlamaLM, make_graphed_layers  # noqa: E402

import tgraph  # noqa: E402
from tgraph.toy.gpt import GPT, GPTConfig  # noqa: E402

VOCAB = 1024  # the reference configuration of every benchmark in docs/BENCHMARKS.md
CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=12, n_embd=256, n_head=4, seq=128, batch=8),
    "small": dict(n_layer=24, n_embd=512, n_head=8, seq=256, batch=8),
    "medium": dict(n_layer=12, n_embd=1024, n_head=16, seq=512, batch=8),
    "smoke": dict(n_layer=2, n_embd=32, n_head=2, seq=16, batch=2),
    "tiny_b1": dict(n_layer=12, n_embd=256, n_head=4, seq=128, batch=1),  # host-bound
    **LLAMA_CONFIGS,  # Hugging Face LlamaForCausalLM (bench_llama.py)
}
MODES = [
    "eager",
    "graphed_callables",
    "compile",
    "floor",
    "tgraph_layer",
    "tgraph_full",
    "megatron_none",
    "megatron_local",
    "megatron_tgraph_layer",
    "megatron_tgraph_layer_hooks",
    "megatron_tgraph_full",
    "tgraph_layer_opt",
    "tgraph_layer_opt_noskip",
    "tgraph_full_skip",
    "megatron_opt_none",
    "megatron_opt_none_capturable",
    "megatron_opt_local",
    "megatron_opt_tgraph_layer_opt",
    "megatron_opt_tgraph_full",
    "eager_ckpt",
    "tgraph_layer_ckpt",
    "compile_default",
    "tgraph_layer_compiled",
    "tgraph_layer_opt_compiled",
    "tgraph_full_compiled",
]
CPU_MODES = ["eager", "tgraph_layer", "tgraph_full", "tgraph_layer_opt", "tgraph_full_skip"]
# --hf: the Llama cells of bench_llama.LLAMA_DTYPES, these modes, few steps (an H200 in < 5 min)
HF_MODES = [
    "eager",
    "graphed_callables",
    "tgraph_layer",
    "tgraph_layer_opt",
    "tgraph_full",
    "compile",
    "compile_default",
    "tgraph_layer_compiled",
    "tgraph_layer_opt_compiled",
    "tgraph_full_compiled",
]
HF_STEPS, HF_WARMUP = 10, 2  # 12 steps trained: the final loss is the parity check
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1
# Final-loss agreement. The graph modes run the same kernels as eager, so they agree to ~1e-6;
# torch.compile fuses kernels (other reduction orders) and Adam's normalised update amplifies
# those last-bit differences over the steps, so allow 2e-3 relative in fp32. bf16 autocast
# rounds every matmul to 8 mantissa bits: 3e-2.
PARITY_RTOL = {"fp32": 2e-3, "bf16": 3e-2}
NUM_BATCHES = 4


@dataclass
class Setup:
    """One (config, dtype) cell: the shared initial model and batches, and the step counts."""

    name: str
    dtype: str
    device: torch.device
    backend: str
    steps: int
    warmup: int
    dims: dict[str, int]
    base: GPT | LlamaLM
    batches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    setup_peak: int = 0  # bytes: peak allocated before the first timed step (warmup, capture)

    @property
    def total(self) -> int:
        return self.warmup + self.steps

    def batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[i % len(self.batches)]

    def autocast(self):
        # bf16 = autocast over fp32 master weights (same optimizer state in every mode). The
        # autocast weight cache must be off under graph capture (make_graphed_callables asserts).
        if self.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=False)
        return contextlib.nullcontext()

    def fresh(self) -> tuple[GPT | LlamaLM, torch.optim.Optimizer]:
        model = copy.deepcopy(self.base).to(self.device).train()
        return model, make_optimizer(model.parameters(), self.device)


def make_optimizer(params, device: torch.device) -> torch.optim.Optimizer:
    """The same AdamW in every mode (see :func:`optimizer_description`)."""
    # fused=True in every mode: the fastest eager AdamW (one kernel for all parameters). On CUDA
    # also capturable=True (step count and lr on the device), which the whole-step graphs need
    # and which costs the eager modes nothing measurable with fused kernels.
    extra = dict(fused=True, capturable=True) if device.type == "cuda" else dict(fused=True)
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY, **extra)


def optimizer_description(device: torch.device) -> str:
    extra = "fused=True, capturable=True" if device.type == "cuda" else "fused=True"
    return (
        f"AdamW(lr={LR}, betas={BETAS}, weight_decay={WEIGHT_DECAY}, {extra}) in every mode; "
        "zero_grad(set_to_none=True) each step"
    )


def make_setup(
    name: str, dtype: str, device: torch.device, backend: str, steps: int, warmup: int, seed: int
) -> Setup:
    d = CONFIGS[name]
    torch.manual_seed(seed)
    if d.get("model") == "llama":
        base = LlamaLM(d, VOCAB)
    else:
        cfg = GPTConfig(
            vocab_size=VOCAB,
            block_size=d["seq"],
            n_layer=d["n_layer"],
            n_head=d["n_head"],
            n_embd=d["n_embd"],
            dropout=0.0,
        )
        base = GPT(cfg)  # kept on CPU: every mode deep-copies it onto the device
    g = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(NUM_BATCHES):  # a few sequences the model can memorise: the loss moves
        seq = torch.randint(0, VOCAB, (d["batch"], d["seq"] + 1), generator=g)
        batches.append((seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)))
    return Setup(name, dtype, device, backend, steps, warmup, d, base, batches)


def eager_step(model, opt, x, y, s: Setup) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    with s.autocast():
        _, loss = model(x, y)
    loss.backward()
    opt.step()
    return loss


def drive(s: Setup, step: Callable, start: int = 0) -> tuple[list[float], torch.Tensor]:
    """Run steps ``start .. total-1``; time those at index >= warmup. Returns (ms, last loss)."""
    timer = StepTimer(s.device)
    loss = None
    for i in range(start, s.total):
        x, y = s.batch(i)
        if i == s.warmup and s.device.type == "cuda":  # steady-state peak from here on
            synchronize(s.device)
            s.setup_peak = torch.cuda.max_memory_allocated(s.device)
            torch.cuda.reset_peak_memory_stats(s.device)
        if i >= s.warmup:
            timer.start()
        loss = step(x, y)
        if i >= s.warmup:
            timer.stop()
    return timer.times_ms(), loss


def need_cuda(s: Setup) -> None:
    if s.device.type != "cuda":
        raise Skip("needs a CUDA GPU")


# ------------------------------------------------------------------------------------ modes
# Each returns (per-step ms, final loss tensor, capture seconds or None, note).


def mode_eager(s: Setup):
    model, opt = s.fresh()
    times, loss = drive(s, lambda x, y: eager_step(model, opt, x, y, s))
    return times, loss, None, ""


def checkpoint_blocks(model: GPT) -> GPT:
    """Activation recompute: every block's forward through non-reentrant
    ``torch.utils.checkpoint`` (what a user writes; tgraph graphs it as it is)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


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


def mode_tgraph_layer(s: Setup, ckpt: bool = False, compile: bool = False):  # noqa: A002
    """``compile``: enable(compile=True); capture_s then includes the recorded iteration,
    where inductor compiles the layers."""
    model, opt = s.fresh()
    if ckpt:
        checkpoint_blocks(model)
    tgraph.enable(model, backend=s.backend, compile=compile)
    try:
        synchronize(s.device)
        t_record = time.perf_counter()
        eager_step(model, opt, *s.batch(0), s)  # recorded iteration (a real training step)
        # As README's loop: the recorded step's gradients are dropped before capture (the next
        # step would drop them anyway); alive, they add their size to the capture's peak.
        opt.zero_grad(set_to_none=True)
        synchronize(s.device)
        t0 = time.perf_counter()
        # Capture under the same autocast state as the recorded calls: the call signature does
        # not include autocast, so capturing outside it would graph fp32 blocks.
        with s.autocast():
            report = tgraph.create_graphs()
        synchronize(s.device)
        capture = time.perf_counter() - (t_record if compile else t0)
        times, loss = drive(s, lambda x, y: eager_step(model, opt, x, y, s), start=1)
        return times, loss, capture, str(report)
    finally:
        tgraph.reset()
        tgraph.disable(model)


def mode_tgraph_full(s: Setup, skip: bool = False, compiled: bool = False):
    """``skip``: FullIterationGraph(skip_nonfinite=True), the cost of the device flag.
    ``compiled``: the step runs ``torch.compile(model)`` (inductor, default mode); capture_s
    then covers the warmup steps too, where dynamo and inductor compile."""
    FullIterationGraph = tgraph.FullIterationGraph
    model, opt = s.fresh()
    run = torch.compile(model) if compiled else model

    def train_step(batch):
        x, y = batch
        return eager_step(run, opt, x, y, s).detach()

    # warmup_steps eager calls, then the call that captures (and runs) the step.
    step_graph = FullIterationGraph(
        train_step, warmup_steps=s.warmup - 1, backend=s.backend, skip_nonfinite=skip
    )
    synchronize(s.device)
    t_warm = time.perf_counter()
    for i in range(s.warmup - 1):
        step_graph(s.batch(i))
    synchronize(s.device)
    t0 = time.perf_counter()
    step_graph(s.batch(s.warmup - 1))
    synchronize(s.device)
    capture = time.perf_counter() - (t_warm if compiled else t0)
    times, loss = drive(s, lambda x, y: step_graph((x, y)), start=s.warmup)
    note = "capture_s = the capturing call (capture + its step)"
    if compiled:
        note = "torch.compile(model) inside the step; capture_s = warmup (compile) + capture"
    return times, loss, capture, note + ("; skip_nonfinite=True" if skip else "")


def megatron_model(s: Setup, variant: str):
    """(tgraph's megatron integration, a megatron-core GPTModel + DDP of the cell's dims), or
    Skip when megatron-core is missing or the cell is not fp32 on CUDA."""
    need_cuda(s)
    try:
        from tgraph.integrations import megatron as tm

        tm._transformer_layer_class()
    except ImportError as exc:
        raise Skip(f"megatron-core not importable ({exc}); pip install 'tgraph[megatron]'") from exc
    if s.dtype != "fp32":
        raise Skip("megatron modes are measured in fp32 only")
    tm.init_single_gpu()
    d = s.dims
    model = tm.build_gpt(
        num_layers=d["n_layer"],
        hidden_size=d["n_embd"],
        num_attention_heads=d["n_head"],
        vocab_size=VOCAB,
        seq_length=d["seq"],
        cuda_graph_impl="local" if variant == "local" else "none",
    )
    return tm, model


def mode_megatron(s: Setup, variant: str):
    """megatron-core GPTModel + its DDP (main_grad), same dims; fused AdamW on main_grad.

    variant: "none" (megatron eager), "local" (megatron-core's own per-layer graphs),
    "tgraph_layer" (tgraph per-layer graphs on megatron's TransformerLayers) or
    "tgraph_full" (forward_backward_func + optimizer step in one tgraph.FullIterationGraph).
    """
    tm, model = megatron_model(s, variant)
    params = list(model.parameters())
    opt = make_optimizer(params, s.device)

    def train_step(batch):
        loss = tm.forward_backward(model, [batch])
        tm.optimizer_step(opt, params)  # on megatron DDP's fp32 main_grad buffers
        return loss.detach()

    capture = None
    note = "megatron-core GPTModel (local spec) + megatron DDP, own init: parity n/a"
    try:
        if variant == "tgraph_full":
            graph = tgraph.FullIterationGraph(train_step, warmup_steps=s.warmup - 1)
            for i in range(s.warmup - 1):
                graph(s.batch(i))
            synchronize(s.device)
            t0 = time.perf_counter()
            graph(s.batch(s.warmup - 1))
            synchronize(s.device)
            capture = time.perf_counter() - t0
            times, loss = drive(s, lambda x, y: graph((x, y)), start=s.warmup)
            return times, loss, capture, note
        if variant.startswith("tgraph_layer"):  # _hooks: gradients through DDP's hooks
            tm.enable_layer_graphs(model, main_grad_fusion=variant == "tgraph_layer")
        train_step(s.batch(0))  # recorded / warmup iteration
        synchronize(s.device)
        t0 = time.perf_counter()
        if variant.startswith("tgraph_layer"):
            note += f"; {tgraph.create_graphs()}"
        elif variant == "local":
            from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

            _CudagraphGlobalRecord.create_cudagraphs()
        synchronize(s.device)
        capture = time.perf_counter() - t0 if variant != "none" else None
        times, loss = drive(s, lambda x, y: train_step((x, y)), start=1)
        return times, loss, capture, note
    finally:
        if variant.startswith("tgraph_layer"):
            tgraph.reset()
            tgraph.disable(model)
        if variant == "local":
            with contextlib.suppress(Exception):
                from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

                delete_cuda_graphs()


def mode_tgraph_layer_opt(s: Setup, skip: bool = True, compile: bool = False):  # noqa: A002
    """Per-layer graphs for forward/backward plus tgraph.OptimizerGraph for the AdamW step;
    ``skip``: non-finite steps skipped on the device (the default); ``compile``:
    enable(compile=True), capture_s then includes the recorded (compiling) iteration."""
    model, opt = s.fresh()
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=skip, backend=s.backend)

    def step(x, y):
        with s.autocast():
            _, loss = model(x, y)
        loss.backward()
        graph.step(loss)  # zeroes .grad in place (the graph owns the gradient buffers)
        return loss

    tgraph.enable(model, backend=s.backend, compile=compile)
    try:
        synchronize(s.device)
        t_record = time.perf_counter()
        step(*s.batch(0))  # recorded iteration (eager optimizer step: warmup)
        synchronize(s.device)
        t0 = t_record if compile else time.perf_counter()
        with s.autocast():
            report = tgraph.create_graphs()
        step(*s.batch(1))  # the optimizer graph's capture (warmup_steps=1)
        synchronize(s.device)
        capture = time.perf_counter() - t0
        times, loss = drive(s, step, start=2)
        note = f"{report}; optimizer graph captured={graph.captured}, skip_nonfinite={skip}"
        return times, loss, capture, note
    finally:
        tgraph.reset()
        tgraph.disable(model)


def mode_megatron_optimizer(s: Setup, variant: str):
    """The megatron-core harness: GPTModel + megatron DDP + megatron's OWN optimizer,
    ``get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])`` (clip_grad 1.0).

    variant: "none" (megatron eager, ``opt.step()`` with its host syncs), "local" (megatron-core's
    own per-layer graphs, same optimizer), "tgraph_layer_opt" (tgraph per-layer graphs plus
    tgraph.integrations.megatron.MegatronOptimizerGraph), "tgraph_full" (forward_backward and
    graph_safe_step in one FullIterationGraph(skip_nonfinite=True)).
    """
    tm, model = megatron_model(s, variant)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    capturable = variant == "none_capturable"  # megatron eager, capturable AdamW (see below)
    mopt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, optimizer_cuda_graph=capturable), [model]
    )
    note = "megatron-core GPTModel + DDP + get_megatron_optimizer(adam, lr=1e-3, clip_grad=1.0)"
    if capturable:
        note += ", optimizer_cuda_graph=True (the inner AdamW the tgraph modes step)"
    capture = None
    try:
        if variant == "tgraph_full":
            tm.make_graph_safe(mopt)

            def full_step(batch):
                loss = tm.forward_backward(model, [batch])
                tm.graph_safe_step(mopt)
                return loss.detach()

            graph = tgraph.FullIterationGraph(
                full_step, warmup_steps=s.warmup - 1, skip_nonfinite=True
            )
            for i in range(s.warmup - 1):
                graph(s.batch(i))
            synchronize(s.device)
            t0 = time.perf_counter()
            graph(s.batch(s.warmup - 1))
            synchronize(s.device)
            capture = time.perf_counter() - t0
            times, loss = drive(s, lambda x, y: graph((x, y)), start=s.warmup)
            return times, loss, capture, note + f"; skipped {graph.skipped_steps}"
        opt_graph = None
        if variant == "tgraph_layer_opt":
            tm.enable_layer_graphs(model)
            opt_graph = tm.MegatronOptimizerGraph(mopt)

        def train_step(x, y):
            mopt.zero_grad()
            loss = tm.forward_backward(model, [(x, y)])  # zero_grad_buffer, fwd/bwd, grad sync
            if opt_graph is None:
                mopt.step()
            else:
                opt_graph.step(loss)
            return loss.detach()

        train_step(*s.batch(0))  # recorded / warmup iteration
        synchronize(s.device)
        t0 = time.perf_counter()
        if variant == "tgraph_layer_opt":
            note += f"; {tgraph.create_graphs()}"
        elif variant == "local":
            from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

            _CudagraphGlobalRecord.create_cudagraphs()
        train_step(*s.batch(1))  # the optimizer graph's capture
        synchronize(s.device)
        capture = time.perf_counter() - t0 if not variant.startswith("none") else None
        times, loss = drive(s, train_step, start=2)
        return times, loss, capture, note
    finally:
        if variant == "tgraph_layer_opt":
            tgraph.reset()
            tgraph.disable(model)
        if variant == "local":
            with contextlib.suppress(Exception):
                from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

                delete_cuda_graphs()


MODE_FUNCS: dict[str, Callable] = {
    "eager": mode_eager,
    "graphed_callables": mode_graphed_callables,
    "compile": mode_compile,
    "floor": mode_floor,
    "tgraph_layer": mode_tgraph_layer,
    "tgraph_full": mode_tgraph_full,
    "megatron_none": lambda s: mode_megatron(s, "none"),
    "megatron_local": lambda s: mode_megatron(s, "local"),
    "megatron_tgraph_layer": lambda s: mode_megatron(s, "tgraph_layer"),
    "megatron_tgraph_layer_hooks": lambda s: mode_megatron(s, "tgraph_layer_hooks"),
    "megatron_tgraph_full": lambda s: mode_megatron(s, "tgraph_full"),
    "tgraph_layer_opt": mode_tgraph_layer_opt,
    "tgraph_layer_opt_noskip": lambda s: mode_tgraph_layer_opt(s, skip=False),
    "tgraph_full_skip": lambda s: mode_tgraph_full(s, skip=True),
    "megatron_opt_none": lambda s: mode_megatron_optimizer(s, "none"),
    "megatron_opt_none_capturable": lambda s: mode_megatron_optimizer(s, "none_capturable"),
    "megatron_opt_local": lambda s: mode_megatron_optimizer(s, "local"),
    "megatron_opt_tgraph_layer_opt": lambda s: mode_megatron_optimizer(s, "tgraph_layer_opt"),
    "megatron_opt_tgraph_full": lambda s: mode_megatron_optimizer(s, "tgraph_full"),
    "eager_ckpt": mode_eager_ckpt,
    "tgraph_layer_ckpt": lambda s: mode_tgraph_layer(s, ckpt=True),
    "compile_default": lambda s: mode_compile(s, mode="default"),
    "tgraph_layer_compiled": lambda s: mode_tgraph_layer(s, compile=True),
    "tgraph_layer_opt_compiled": lambda s: mode_tgraph_layer_opt(s, compile=True),
    "tgraph_full_compiled": lambda s: mode_tgraph_full(s, compiled=True),
}


def run_mode(mode: str, s: Setup) -> dict:
    row: dict = {"config": s.name, "dtype": s.dtype, "mode": mode, "status": "ok", "reason": ""}
    base = fresh_memory(s.device)
    s.setup_peak = 0
    try:
        times, loss, capture, note = MODE_FUNCS[mode](s)
        synchronize(s.device)
        row.update(summarize(times))
        steady = peak_memory_mib(s.device, since=base)
        row.update(
            capture_s=capture,
            final_loss=float(loss.detach().float()),
            note=note,
            # above the memory allocated when the mode started (model copies included)
            peak_mem_mib=None if steady is None else max(steady, (s.setup_peak - base) / 2**20),
            steady_peak_mib=steady,
            baseline_mib=base / 2**20,
            steps_trained=s.total,
        )
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - one failing mode must not hide the others
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:400]}")
    torch._dynamo.reset()  # compiled modes: no cache (or recompile limit) shared with the next
    if row["status"] != "ok":
        print(f"  {mode}: {row['status']}: {row['reason']}", flush=True)
    else:
        print(f"  {mode}: {row['ms_median']:.3f} ms/step, loss {row['final_loss']:.6f}", flush=True)
    fresh_memory(s.device)
    return row


def add_comparisons(rows: list[dict], dtype: str) -> None:
    """Ratios to the floor and to eager, and the parity verdict against eager's final loss."""
    ok = {r["mode"]: r for r in rows if r["status"] == "ok"}
    floor = ok.get("floor", {}).get("ms_median")
    eager = ok.get("eager", {}).get("ms_median")
    ref_row = ok.get("eager") or next(iter(ok.values()), None)
    tol = PARITY_RTOL[dtype]
    for r in rows:
        r["ratio_floor"] = r["ms_median"] / floor if floor and r.get("ms_median") else None
        r["ratio_eager"] = r["ms_median"] / eager if eager and r.get("ms_median") else None
        if r["status"] != "ok":
            r["parity"] = None
        else:
            # megatron modes have their own init: they are checked against megatron eager (its
            # own optimizer: against megatron_opt_none)
            base = ok.get("megatron_none") if r["mode"].startswith("megatron") else ref_row
            if r["mode"].startswith("megatron_opt"):
                # The tgraph modes step megatron's AdamW with capturable=True (make_graph_safe):
                # its bias correction is fp32 on the device instead of double on the host, which
                # this short memorising run can amplify; megatron eager with the same inner
                # optimizer (optimizer_cuda_graph=True) is their like-for-like reference.
                base = ok.get("megatron_opt_none")
                if "tgraph" in r["mode"] and "megatron_opt_none_capturable" in ok:
                    base = ok["megatron_opt_none_capturable"]
            if not base:
                r["parity"] = "n/a"
                continue
            r["loss_rel_diff"] = abs(r["final_loss"] - base["final_loss"]) / max(
                1.0, abs(base["final_loss"])
            )
            r["parity"] = "ok" if r["loss_rel_diff"] <= tol else "MISMATCH"


def markdown(payload: dict) -> str:
    meta = payload["meta"]
    parts = [
        "# Training-step benchmark",
        "",
        environment_markdown(meta["env"]),
        "",
        f"Optimizer: {meta['optimizer']}. Precision: {meta['precision']}. "
        f"{meta['steps']} timed steps after {meta['warmup']} untimed warmup steps; "
        f"{meta['timing']}. Parity: final loss vs eager, rtol {meta['parity_rtol']}. "
        "Memory: peak allocated above what was allocated when the mode started (peak MiB: "
        "whole mode incl. warmup and capture; steady MiB: timed steps only).",
    ]
    headers = [
        "mode",
        "ms/step (median)",
        "p10",
        "p90",
        "x floor",
        "x eager",
        "peak MiB",
        "steady MiB",
        "capture s",
        "final loss",
        "parity",
        "status",
    ]
    cells = list(dict.fromkeys((r["config"], r["dtype"]) for r in payload["results"]))
    for cfg, dt in cells:
        rows = [r for r in payload["results"] if (r["config"], r["dtype"]) == (cfg, dt)]
        d = CONFIGS[cfg]
        parts += [
            "",
            f"## {cfg} ({d['n_layer']} layers, d={d['n_embd']}, {d['n_head']} heads, "
            f"seq {d['seq']}, batch {d['batch']}, vocab {VOCAB}), {dt}",
            "",
        ]
        table = [
            [
                r["mode"],
                r.get("ms_median"),
                r.get("ms_p10"),
                r.get("ms_p90"),
                r.get("ratio_floor"),
                r.get("ratio_eager"),
                r.get("peak_mem_mib"),
                r.get("steady_peak_mib"),
                r.get("capture_s"),
                None if r.get("final_loss") is None else f"{r['final_loss']:.6f}",
                r.get("parity"),
                r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}",
            ]
            for r in rows
        ]
        parts.append(markdown_table(headers, table))
    mism = [r for r in payload["results"] if r.get("parity") == "MISMATCH"]
    if mism:
        parts += [
            "",
            "**PARITY MISMATCH**: "
            + ", ".join(f"{r['config']}/{r['dtype']}/{r['mode']}" for r in mism),
        ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--dtypes", default="fp32", help="comma list of fp32,bf16")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--steps", type=int, default=100, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per mode (>= 2)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--backend", default="auto", help="tgraph backend: auto, cuda, emulated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="default: $OUT")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, emulated graphs, tiny dims, 3 steps: keeps the script alive in CI",
    )
    p.add_argument(
        "--hf",
        action="store_true",
        help=f"the Hugging Face Llama cells {LLAMA_DTYPES}, modes {HF_MODES} (unless --modes), "
        f"{HF_STEPS} timed steps after {HF_WARMUP} warmup steps",
    )
    a = p.parse_args(argv)
    cells = None
    if a.hf:
        cells = list(LLAMA_DTYPES.items())
        a.steps, a.warmup = HF_STEPS, HF_WARMUP
        if a.modes == ",".join(MODES):
            a.modes = ",".join(HF_MODES)
    if a.smoke:
        cells = [("smoke", "fp32"), ("llama_smoke", "fp32")] if cells is None else cells
        a.steps, a.warmup = 3, 3
        a.device, a.backend = "cpu", "emulated"
        a.modes = ",".join(m for m in a.modes.split(",") if m in CPU_MODES)
    if cells is not None:
        a.configs = ",".join(dict.fromkeys(c for c, _ in cells))
        a.dtypes = ",".join(dict.fromkeys(d for _, d in cells))
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configs, dtypes, modes = a.configs.split(","), a.dtypes.split(","), a.modes.split(",")
    if cells is None:
        cells = [(c, d) for c in configs for d in dtypes]
    for name, allowed, given in (
        ("config", CONFIGS, configs),
        ("dtype", PARITY_RTOL, dtypes),
        ("mode", MODES, modes),
    ):
        bad = [g for g in given if g not in allowed]
        if bad:
            p.error(f"unknown {name} {bad}; expected some of {list(allowed)}")
    if a.warmup < 2:
        p.error("--warmup must be >= 2 (the floor needs an eager AdamW step before capture)")
    env = environment(device)
    print(
        f"bench_train: {env['gpu'] or 'cpu'}, torch {env['torch']}, cuda {env['cuda']}", flush=True
    )
    results: list[dict] = []
    for cfg, dt in cells:
        print(f"[{cfg} {dt}]", flush=True)
        s = make_setup(cfg, dt, device, a.backend, a.steps, a.warmup, a.seed)
        rows: list[dict] = []
        for m in modes:
            rows.append(run_mode(m, s))
            add_comparisons(rows, dt)
            # written after every mode: a run killed by a time limit keeps what it measured
            partial = _payload(a, device, env, results + rows)
            write_outputs(a.out, "bench_train", partial, markdown(partial))
        results += rows
    payload = _payload(a, device, env, results)
    md = markdown(payload)
    js, mdp = write_outputs(a.out, "bench_train", payload, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    return 1 if any(r.get("parity") == "MISMATCH" for r in results) else 0


def _payload(a: argparse.Namespace, device: torch.device, env: dict, results: list[dict]) -> dict:
    return {
        "meta": {
            "env": env,
            "optimizer": optimizer_description(device),
            "precision": "fp32 weights; bf16 = torch.autocast(bfloat16, cache_enabled=False) "
            "over fp32 master weights",
            "steps": a.steps,
            "warmup": a.warmup,
            "timing": (
                "CUDA events around each step, no per-step sync"
                if device.type == "cuda"
                else "perf_counter around each step"
            ),
            "parity_rtol": PARITY_RTOL,
            "backend": a.backend,
            "smoke": a.smoke,
            "vocab": VOCAB,
        },
        "results": results,
    }


if __name__ == "__main__":
    sys.exit(main())
