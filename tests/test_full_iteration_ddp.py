"""FullIterationGraph around torch DDP: 2-process gloo (CPU, emulated), and nccl world size 1.

Tolerance: the graphed and eager runs execute the same kernels and the same all-reduces on the
same numbers; on the CPU they agree bit for bit, and ``rtol=1e-4, atol=1e-5`` (as in
test_full_iteration.py) leaves room for the float32 tensor learning rate and CUDA reduction order.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tgraph
from tgraph.toy.gpt import GPT, GPTConfig

TOL = dict(rtol=1e-4, atol=1e-5)
WORKER = Path(__file__).with_name("full_iteration_ddp_worker.py")
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)


@pytest.mark.slow
def test_two_process_gloo_ddp_matches_eager(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path), "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for res in ranks:
        assert res["num_graphs"] == 1
        torch.testing.assert_close(res["graph"], res["eager"], **TOL)
        torch.testing.assert_close(res["graph_params"], res["eager_params"], **TOL)
    # Different data per rank, one model: the gradient all-reduce really ran in the graph.
    assert not torch.equal(ranks[0]["graph"], ranks[1]["graph"])
    torch.testing.assert_close(ranks[0]["graph_params"], ranks[1]["graph_params"], rtol=0, atol=0)


def _batches(device, n):
    g = torch.Generator().manual_seed(3)
    return [
        tuple(
            torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g).to(device)
            for _ in "xy"
        )
        for _ in range(n)
    ]


def _make_step(model, opt):
    def step(batch):
        opt.zero_grad(set_to_none=True)
        _, loss = model(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss.detach()

    return step


@pytest.fixture
def process_group(tmp_path, backend):
    """A world-size-1 process group in this process: gloo on the CPU, nccl on CUDA."""
    if dist.is_initialized():  # megatron's tests keep their world-size-1 group for the session
        assert dist.get_world_size() == 1
        yield
        return
    if backend == "cuda":
        pg_backend = "nccl"
        # PyTorch CUDA notes, DDP section: async error handling off (needed on old NCCL/PyTorch).
        mp = pytest.MonkeyPatch()
        mp.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        mp.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")
    else:
        pg_backend, mp = "gloo", None
    dist.init_process_group(
        pg_backend, init_method=f"file://{tmp_path}/store", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
        if mp is not None:
            mp.undo()


def _ddp(device):
    torch.manual_seed(0)
    model = GPT(CFG).to(device)
    if device.type != "cuda":
        return DDP(model)
    # PyTorch CUDA notes: DDP must be constructed in a side-stream context before capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ddp = DDP(model)
    torch.cuda.current_stream().wait_stream(side)
    return ddp


def test_ddp_needs_eleven_warmup_steps(backend, device, process_group):
    model = _ddp(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = tgraph.FullIterationGraph(_make_step(model, opt), warmup_steps=3, backend=backend)
    with pytest.raises(ValueError, match=r"at least 11 .*warmup_steps=11"):
        step(_batches(device, 1)[0])


def test_ddp_world_size_one_matches_eager(backend, device, process_group):
    warmup = tgraph.step.full_iteration.DDP_MIN_WARMUP
    batches = _batches(device, warmup + 4)
    runs = []
    for graphed in (False, True):
        model = _ddp(device)
        extra = {"capturable": True} if device.type == "cuda" else {"fused": True}
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, **extra)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        step = _make_step(model, opt)
        if graphed:
            step = tgraph.FullIterationGraph(step, warmup_steps=warmup, backend=backend)
        losses = []
        for b in batches:
            losses.append(step(b))
            sched.step()
        runs.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], **TOL)
    torch.testing.assert_close(runs[1][1], runs[0][1], **TOL)
