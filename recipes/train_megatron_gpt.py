"""Train megatron-core's GPTModel with megatron-core's own optimizer, eagerly or with tgraph graphs.

    torchrun --standalone --nproc-per-node=1 recipes/train_megatron_gpt.py --graph layer
    python recipes/train_megatron_gpt.py --graph layer+opt --steps 200 --out runs/megatron_opt

The optimizer is the one a megatron-core user runs:
``get_megatron_optimizer(OptimizerConfig(optimizer="adam", ...), [model])`` (fp32, megatron's
gradient clipping, no weight decay on biases and norms), with megatron's
``OptimizerParamScheduler`` (linear warmup from 0, cosine decay to ``--min-lr``), stepped once
per iteration. ``--graph`` picks how a step runs:

* ``none``: megatron-core eager: ``mopt.zero_grad(); forward_backward(...); mopt.step()`` (its
  gradient norm and clipping read values on the host).
* ``layer`` (default): the same step, every TransformerLayer replaying tgraph per-layer graphs
  (``enable_layer_graphs``); ``mopt.step()`` stays eager.
* ``layer+opt``: per-layer graphs, and megatron's optimizer step (norm, clipping, AdamW) as one
  graph: ``MegatronOptimizerGraph(mopt, skip_nonfinite=True).step(loss)``.
* ``full``: ``forward_backward`` and ``graph_safe_step(mopt)`` captured together as one
  ``tgraph.FullIterationGraph(..., skip_nonfinite=True)``.

``layer+opt`` and ``full`` build megatron's inner AdamW with ``capturable=True``
(``OptimizerConfig.optimizer_cuda_graph``: its step count lives on the GPU) and skip, on the
device, a step whose loss or gradient norm is not finite; the device counter is read at log
steps only (``skipped_steps``). The scheduler's learning rate reaches their graphs through device
tensors (tgraph.step.hyperparams), which the scheduler refills in place. The eager modes step the scheduler only after a successful ``mopt.step()``, as
megatron-LM's loop does; the graph modes step it at every iteration (knowing whether the device
skipped the step would need a host sync). ``--optimizer-cuda-graph`` builds the capturable AdamW
in the eager modes too, for like-for-like losses.

Needs a GPU and megatron-core (``pip install "tgraph[megatron]"``, Python >= 3.12). Data
parallel over all ranks (megatron DDP); tensor and pipeline parallel sizes are 1. Writes
``metrics.jsonl`` and ``summary.json`` into ``--out``; an ``--out`` that already holds them is
refused unless ``--overwrite`` is given. No checkpoints and no resume.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tgraph
from tgraph.toy.corpus import BatchSampler, load_split

GRAPH_MODES = ("none", "layer", "layer+opt", "full")
OPTIMIZER = "megatron get_megatron_optimizer adam"
FULL_WARMUP = 3  # eager calls of the FullIterationGraph before its capture
RUN_FILES = ("metrics.jsonl", "summary.json")


def build_parser() -> argparse.ArgumentParser:
    """The recipe's flags, each with its help text and default (``--help``)."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--graph",
        choices=GRAPH_MODES,
        default="layer",
        help="how a step runs: none (eager), layer (per-layer graphs), layer+opt (and the "
        "optimizer step as a graph) or full (the whole step as one graph); see the module "
        "docstring",
    )
    p.add_argument("--steps", type=int, default=200, help="training iterations (at least 2)")
    p.add_argument("--num-layers", type=int, default=12, help="TransformerLayers")
    p.add_argument("--hidden-size", type=int, default=256, help="width of the residual stream")
    p.add_argument(
        "--num-heads", type=int, default=4, help="attention heads; must divide --hidden-size"
    )
    p.add_argument(
        "--seq-length", type=int, default=128, help="bytes per sequence (the context length)"
    )
    p.add_argument(
        "--micro-batch-size", type=int, default=8, help="sequences per micro-batch per rank"
    )
    p.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (after warmup)")
    p.add_argument(
        "--min-lr", type=float, default=1e-4, help="the cosine's floor (reached at --steps)"
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=10,
        help="linear warmup from 0 (megatron's lr_warmup_steps; at most --steps - 1)",
    )
    p.add_argument("--weight-decay", type=float, default=0.01, help="OptimizerConfig.weight_decay")
    p.add_argument(
        "--clip-grad", type=float, default=1.0, help="OptimizerConfig.clip_grad; 0 disables it"
    )
    p.add_argument(
        "--optimizer-cuda-graph",
        action="store_true",
        help="capturable AdamW in the eager modes too (OptimizerConfig.optimizer_cuda_graph; "
        "layer+opt and full always step it)",
    )
    p.add_argument(
        "--dropout", type=float, default=0.0, help="attention and hidden dropout probability"
    )
    p.add_argument(
        "--seed", type=int, default=1234, help="seed of the initial weights and of the batches"
    )
    p.add_argument("--log-every", type=int, default=20, help="a metrics line every this many steps")
    p.add_argument(
        "--out", default="runs/megatron_gpt", help="run directory (metrics.jsonl, summary.json)"
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the metrics of a run already in --out (refused otherwise)",
    )
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the flags.

    Raises:
        SystemExit: code 2, naming the bad flag.
    """
    p = build_parser()
    a = p.parse_args(argv)
    if a.steps < 2 or a.micro_batches < 1:
        p.error("--steps must be >= 2 and --micro-batches >= 1")
    if not 0.0 <= a.min_lr <= a.lr:
        p.error(f"--min-lr must be in [0, --lr={a.lr}]")
    if a.warmup_steps < 0 or a.weight_decay < 0 or a.clip_grad < 0 or a.log_every < 1:
        p.error("--warmup-steps, --weight-decay and --clip-grad must be >= 0, --log-every >= 1")
    a.warmup_steps = min(a.warmup_steps, a.steps - 1)  # megatron: lr_warmup_steps < decay steps
    return a


def claim_out(a: argparse.Namespace) -> Path:
    """Refuse an ``--out`` that holds another run's metrics, unless ``--overwrite``."""
    out = Path(a.out)
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found and not a.overwrite:
        print(
            f"error: {out} already holds a run ({', '.join(found)}). Choose another --out, or "
            "pass --overwrite to replace its metrics",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return out


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


def capturable_adam(a: argparse.Namespace) -> bool:
    return a.optimizer_cuda_graph or a.graph in ("layer+opt", "full")


def build_optimizer(a: argparse.Namespace, model):
    """megatron's own optimizer and learning-rate scheduler, as a megatron-core user builds them."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam",
        lr=a.lr,
        min_lr=a.min_lr,
        weight_decay=a.weight_decay,
        clip_grad=a.clip_grad,
        bf16=False,  # build_gpt's GPTModel is fp32: megatron's FP32Optimizer, no loss scaler
        fp16=False,
        # capturable inner AdamW: what the graph modes step (make_graph_safe would switch it
        # anyway; building it so also serves an inner optimizer it cannot switch, e.g. TE's)
        optimizer_cuda_graph=capturable_adam(a),
    )
    mopt = get_megatron_optimizer(config, [model])
    sched = OptimizerParamScheduler(
        mopt,
        init_lr=0.0,
        max_lr=a.lr,
        min_lr=a.min_lr,
        lr_warmup_steps=a.warmup_steps,
        lr_decay_steps=a.steps,
        lr_decay_style="cosine",
        start_wd=a.weight_decay,
        end_wd=a.weight_decay,
        wd_incr_steps=a.steps,
        wd_incr_style="constant",
    )  # sets the learning rate of step 0 (and weight decay 0 on the wd_mult=0 groups)
    return mopt, sched


def megatron_version() -> str | None:
    try:
        from megatron.core.package_info import __version__
    except ImportError:
        return None
    return __version__


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    out = claim_out(a)
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
    mopt, sched = build_optimizer(a, model)
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

    layer_graphs = a.graph in ("layer", "layer+opt")
    opt_graph = full_graph = None
    eager_skipped = 0  # eager modes: megatron's mopt.step() reported no update
    last_norm: float | torch.Tensor | None = None
    updated = True  # whether the last step advances the schedule
    gens_before = {id(g) for g in tgraph.rng.extra_generators()}
    if layer_graphs:
        tm.enable_layer_graphs(model)
    if a.graph == "layer+opt":
        opt_graph = tm.MegatronOptimizerGraph(mopt, skip_nonfinite=True)  # capturable AdamW
    if a.graph == "full":
        tm.make_graph_safe(mopt)  # capturable AdamW; refuses what needs the host every step

        def full_step(microbatches):
            loss = tm.forward_backward(model, microbatches)
            norm = tm.graph_safe_step(mopt)  # megatron's norm, clipping and AdamW, no host sync
            return loss.detach(), norm

        full_graph = tgraph.FullIterationGraph(
            full_step, warmup_steps=FULL_WARMUP, skip_nonfinite=True
        )

    def train_step(microbatches) -> torch.Tensor:
        """One iteration (forward, backward, optimizer step); returns the loss."""
        nonlocal eager_skipped, last_norm, updated
        if full_graph is not None:
            loss, last_norm = full_graph(microbatches)
            return loss
        mopt.zero_grad()
        loss = tm.forward_backward(model, microbatches)  # zero_grad_buffer, fwd/bwd, grad sync
        if opt_graph is not None:
            opt_graph.step(loss)
            return loss.detach()
        updated, last_norm, _ = mopt.step()  # megatron eager: host syncs inside
        eager_skipped += not updated
        return loss.detach()

    def skipped_steps() -> int:
        """Steps that changed nothing (graph modes: reads the device counter, one sync)."""
        if opt_graph is not None:
            return opt_graph.skipped_steps
        if full_graph is not None:
            return full_graph.skipped_steps
        return eager_skipped

    def grad_norm() -> float | None:
        if opt_graph is not None:
            n = opt_graph.grad_norm
            return None if n is None else float(n)
        return None if last_norm is None else float(last_norm)

    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name in RUN_FILES:  # --overwrite: a run that dies early leaves no old summary behind
            (out / name).unlink(missing_ok=True)
    metrics = open(out / "metrics.jsonl", "w") if rank == 0 else None  # noqa: SIM115
    times, losses, capture_s = [], [], 0.0
    try:
        for step in range(a.steps):
            batch = next_batch()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = train_step(batch)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if layer_graphs and step == 0:
                t1 = time.perf_counter()
                report = tgraph.create_graphs()
                capture_s = time.perf_counter() - t1
                if rank == 0:
                    print(report, flush=True)
            if opt_graph is not None and step == 1:  # captured at its second step
                capture_s += opt_graph.capture_seconds
            if full_graph is not None and step == FULL_WARMUP:  # capture and first replay
                capture_s = dt
            if step >= 5:
                times.append(dt)
            losses.append(loss.item())
            if step % a.log_every == 0 or step == a.steps - 1:
                lr = float(mopt.param_groups[0]["lr"])  # this step's (graph modes: a tensor)
            if metrics and (step % a.log_every == 0 or step == a.steps - 1):
                row = {
                    "step": step,
                    "loss": losses[-1],
                    "lr": lr,
                    "grad_norm": grad_norm(),
                    "skipped_steps": skipped_steps(),
                    "ms_per_step": 1e3 * dt,
                    "graph": a.graph,
                }
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                print(json.dumps(row), flush=True)
            # megatron-LM steps the scheduler after a successful update; the graph modes cannot
            # know without a host sync and step it always (a skipped step still advances it)
            if updated:
                sched.step(1)
        skipped = skipped_steps()
    finally:
        if metrics:
            metrics.close()
        if full_graph is not None:
            full_graph.reset()
        if opt_graph is not None:
            opt_graph.reset()
        if layer_graphs:
            tgraph.reset()
            tgraph.disable(model)
        for g in tgraph.rng.extra_generators():
            if id(g) not in gens_before:  # megatron's RNG tracker (enable_layer_graphs)
                tgraph.unregister_generator(g)

    ms = 1e3 * statistics.median(times) if times else float("nan")
    tokens = a.micro_batch_size * a.micro_batches * a.seq_length * world
    summary = {
        "graph": a.graph,
        "optimizer": OPTIMIZER,
        "optimizer_config": {
            "lr": a.lr,
            "min_lr": a.min_lr,
            "warmup_steps": a.warmup_steps,
            "lr_decay_style": "cosine",
            "weight_decay": a.weight_decay,
            "clip_grad": a.clip_grad,
            "precision": "fp32",
            "capturable_adam": capturable_adam(a),
        },
        "skip_nonfinite": a.graph in ("layer+opt", "full"),
        "skipped_steps": skipped,
        "steps": a.steps,
        "world_size": world,
        "median_ms_per_step": ms,
        "tokens_per_s": tokens / (ms / 1e3) if math.isfinite(ms) else float("nan"),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "final_lr": lr,
        "capture_s": capture_s,
        "peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "megatron_core": megatron_version(),
    }
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print("done:", json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
