"""Train megatron-core's GPTModel on the stdlib byte corpus, eagerly or with tgraph graphs.

    torchrun --standalone --nproc-per-node=1 recipes/train_megatron_gpt.py --graph layer
    python recipes/train_megatron_gpt.py --graph full --steps 200

``--graph none`` is megatron-core eager (``cuda_graph_impl="none"``); ``layer`` gives every
TransformerLayer tgraph per-layer graphs; ``full`` captures megatron's ``forward_backward_func``
and the optimizer step as one :class:`tgraph.FullIterationGraph`. Needs a GPU and megatron-core
(``pip install "tgraph[megatron]"``, Python >= 3.12). Data parallel over all ranks (megatron
DDP); tensor and pipeline parallel sizes are 1. Writes ``metrics.jsonl`` and ``summary.json``
into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tgraph
from tgraph.toy.corpus import BatchSampler, load_split


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graph", choices=["none", "layer", "full"], default="layer")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--out", default="runs/megatron_gpt")
    a = p.parse_args(argv)
    if a.steps < 2 or a.micro_batches < 1:
        p.error("--steps must be >= 2 and --micro-batches >= 1")
    return a


def init(seed: int) -> tuple[int, int]:
    """Process group (torchrun's environment, or a world of one), model parallel (1, 1)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from tgraph.integrations import megatron as tm

    if "WORLD_SIZE" not in os.environ:
        tm.init_single_gpu(seed)
        return 0, 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
    return rank, world


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: megatron-core training needs a CUDA GPU")
    from tgraph.integrations import megatron as tm

    rank, world = init(a.seed)
    model = tm.build_gpt(
        num_layers=a.num_layers,
        hidden_size=a.hidden_size,
        num_attention_heads=a.num_heads,
        vocab_size=256,
        seq_length=a.seq_length,
        dropout=a.dropout,
        seed=a.seed,
    )
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=a.lr, fused=True, capturable=True)
    sampler = BatchSampler(
        load_split("train", rank=rank, world_size=world),
        a.micro_batch_size,
        a.seq_length,
        seed=a.seed + rank,
    )

    def next_batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            tuple(t.cuda(non_blocking=True) for t in sampler.next()) for _ in range(a.micro_batches)
        ]

    def train_step(microbatches):
        loss = tm.forward_backward(model, microbatches)
        tm.optimizer_step(opt, params)  # on megatron DDP's fp32 main_grad buffers
        return loss.detach()

    step_fn = train_step
    if a.graph == "layer":
        tm.enable_layer_graphs(model)
    elif a.graph == "full":
        step_fn = tgraph.FullIterationGraph(train_step, warmup_steps=3)

    out = Path(a.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    metrics = open(out / "metrics.jsonl", "w") if rank == 0 else None  # noqa: SIM115
    times, losses, capture_s = [], [], 0.0
    for step in range(a.steps):
        batch = next_batch()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step_fn(batch)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if a.graph == "layer" and step == 0:
            t1 = time.perf_counter()
            report = tgraph.create_graphs()
            capture_s = time.perf_counter() - t1
            if rank == 0:
                print(report, flush=True)
        if step >= 5:
            times.append(dt)
        losses.append(loss.item())
        if metrics and (step % a.log_every == 0 or step == a.steps - 1):
            row = {"step": step, "loss": losses[-1], "ms_per_step": 1e3 * dt, "graph": a.graph}
            metrics.write(json.dumps(row) + "\n")
            metrics.flush()
            print(json.dumps(row), flush=True)
    ms = 1e3 * statistics.median(times) if times else float("nan")
    tokens = a.micro_batch_size * a.micro_batches * a.seq_length * world
    summary = {
        "graph": a.graph,
        "steps": a.steps,
        "world_size": world,
        "median_ms_per_step": ms,
        "tokens_per_s": tokens / (ms / 1e3),
        "final_loss": losses[-1],
        "capture_s": capture_s,
        "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    if rank == 0:
        metrics.close()
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print("done:", json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
