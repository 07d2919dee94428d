"""The toy GPT, its optimizers, batches and training step shared by the whole-step graph tests."""

from __future__ import annotations

import torch

from tgraph.toy.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
STEPS = 10


def make_model(device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).to(device)


def make_optimizer(kind: str, model: GPT, device: torch.device) -> torch.optim.Optimizer:
    cuda = device.type == "cuda"
    if kind == "sgd":  # default implementation: its float lr is baked, fine without a schedule
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    if kind == "sgd_fused":  # reads a tensor lr without a host sync: schedules reach the graph
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, fused=True)
    if kind == "adamw":  # capturable is CUDA-only; on the CPU the fused kernel avoids .item()
        extra = {"capturable": True} if cuda else {"fused": True}
        return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, **extra)
    raise ValueError(kind)


def make_batches(device: torch.device, n: int = STEPS, micro: int = 0, batch_size: int = 4):
    g = torch.Generator().manual_seed(1)

    def one(bs):
        x = torch.randint(0, CFG.vocab_size, (bs, CFG.block_size), generator=g)
        y = torch.randint(0, CFG.vocab_size, (bs, CFG.block_size), generator=g)
        return x.to(device), y.to(device)

    if micro:
        return [[one(batch_size) for _ in range(micro)] for _ in range(n)]
    return [one(batch_size) for _ in range(n)]


def make_step(model: GPT, opt: torch.optim.Optimizer, clip: bool = False, sync: str = ""):
    def step(batch):
        opt.zero_grad(set_to_none=True)
        micro = batch if isinstance(batch, list) else [batch]
        total = torch.zeros((), device=micro[0][0].device)
        for x, y in micro:
            _, loss = model(x, y)
            (loss / len(micro)).backward()
            total = total + loss.detach() / len(micro)
        if clip:  # foreach on CUDA; neither path syncs with the host
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        if sync == "item":
            loss.item()
        elif sync == "print":
            print(loss)
        return total

    return step
