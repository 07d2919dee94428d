"""Worker of tests/test_full_iteration_ddp.py: eager DDP and FullIterationGraph DDP, same start.

Run by the test as ``python tests/full_iteration_ddp_worker.py OUT_DIR [WORLD_SIZE]``; spawns the
ranks itself (CPU, gloo, emulated backend) and saves each rank's losses and final parameters to
``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import tgraph
from tgraph.toy.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
WARMUP = tgraph.step.full_iteration.DDP_MIN_WARMUP
STEPS = WARMUP + 4  # warmups, the capture call, three replays


def run(rank: int, world: int, out_dir: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        batches = [
            tuple(torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g) for _ in "xy")
            for _ in range(STEPS)
        ]
        result = {}
        for graphed in (False, True):
            torch.manual_seed(0)
            model = DDP(GPT(CFG))
            opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

            def step(batch, model=model, opt=opt):
                opt.zero_grad(set_to_none=True)
                _, loss = model(*batch)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                return loss.detach()

            if graphed:
                step = tgraph.FullIterationGraph(step, warmup_steps=WARMUP, backend="emulated")
            losses = []
            for b in batches:
                losses.append(step(b))
                sched.step()
            name = "graph" if graphed else "eager"
            result[name] = torch.stack(losses)
            result[name + "_params"] = [p.detach().clone() for p in model.parameters()]
            if graphed:
                result["num_graphs"] = step.num_graphs
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    # Results are saved: skip interpreter teardown, where gloo's threads occasionally abort
    # ("terminate called without an active exception") and fail a run that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    out, world = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
    mp.spawn(run, args=(world, out), nprocs=world, join=True)
