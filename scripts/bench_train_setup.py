"""The set-up every training-benchmark mode shares (scripts/bench_train.py): the configs, one
cell's model, batches and optimizer (:class:`Setup`), the eager step and the timed loop."""

from __future__ import annotations

import contextlib
import copy
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from bench_common import Skip, StepTimer, gpu_timeline, synchronize
from bench_llama import LLAMA_CONFIGS, LlamaLM

from tgraph.toy.gpt import GPT, GPTConfig

VOCAB = 1024  # the reference configuration of every benchmark in docs/BENCHMARKS.md
CONFIGS: dict[str, dict[str, int]] = {
    "tiny": dict(n_layer=12, n_embd=256, n_head=4, seq=128, batch=8),
    "small": dict(n_layer=24, n_embd=512, n_head=8, seq=256, batch=8),
    "medium": dict(n_layer=12, n_embd=1024, n_head=16, seq=512, batch=8),
    "smoke": dict(n_layer=2, n_embd=32, n_head=2, seq=16, batch=2),
    "tiny_b1": dict(n_layer=12, n_embd=256, n_head=4, seq=128, batch=1),  # host-bound
    **LLAMA_CONFIGS,  # Hugging Face LlamaForCausalLM (bench_llama.py)
}
LR, BETAS, WEIGHT_DECAY = 1e-3, (0.9, 0.95), 0.1
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
    trace_steps: int = 0  # after the timed steps, this many more under torch.profiler (--trace)
    trace: dict = field(default_factory=dict)  # ... the mode's GPU timeline (gpu_timeline)

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
    times = timer.times_ms()
    if s.trace_steps and s.device.type == "cuda":  # the timed loss, before replays overwrite it
        loss = loss.detach().clone()
        try:
            s.trace = gpu_timeline(
                lambda i: step(*s.batch(s.total + i)),
                s.trace_steps,
                s.device,
                head_start_ms=statistics.median(times) if times else 0.0,  # about one step
            )
        except Exception as exc:  # noqa: BLE001 - a failed trace must not lose the timed steps
            print(f"  trace failed: {type(exc).__name__}: {exc}", flush=True)
    return times, loss


def need_cuda(s: Setup) -> None:
    if s.device.type != "cuda":
        raise Skip("needs a CUDA GPU")


def checkpoint_blocks(model: GPT) -> GPT:
    """Activation recompute: every block's forward through non-reentrant
    ``torch.utils.checkpoint`` (what a user writes; tgraph graphs it as it is)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    return model


def drive_whole_step(s: Setup, graph, *, with_warmup: bool = False):
    """A ``FullIterationGraph``'s warmup calls, the call that captures, then the timed steps:
    ``(times, loss, capture_s)``; capture_s is the capturing call, or with ``with_warmup`` the
    warmups too (where a compiled step compiles)."""
    synchronize(s.device)
    t_warm = time.perf_counter()
    for i in range(s.warmup - 1):
        graph(s.batch(i))
    synchronize(s.device)
    t0 = time.perf_counter()
    graph(s.batch(s.warmup - 1))
    synchronize(s.device)
    capture = time.perf_counter() - (t_warm if with_warmup else t0)
    times, loss = drive(s, lambda x, y: graph((x, y)), start=s.warmup)
    return times, loss, capture
