"""AdamW with learning rates in device tensors, and the warmup-then-cosine schedule."""

from __future__ import annotations

import math

import torch

from .config import TrainConfig


def lr_at(step: int, cfg: TrainConfig, decay_steps: int | None = None) -> float:
    """Learning rate of step ``step`` (0-based): linear warmup, then cosine decay to ``min_lr``.

    Args:
        step: the step.
        cfg: warmup, peak and final learning rates.
        decay_steps: where the cosine reaches ``min_lr``; None: ``cfg.steps``. A run keeps the
            horizon of its first start through every resume, so a finished run continued with a
            larger ``--steps`` trains on at ``min_lr``. Stretching the cosine to the new total
            instead would raise the learning rate again right after the resume (a jump from
            ``min_lr`` back towards ``lr`` that undoes part of the annealing and spikes the loss);
            holding it keeps the schedule continuous and never changes the learning rate of a
            step already taken, so an interrupted run resumes bit for bit whatever ``--steps``.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max((cfg.steps if decay_steps is None else decay_steps) - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def make_optimizer(
    model: torch.nn.Module, cfg: TrainConfig, device: torch.device
) -> torch.optim.AdamW:
    """AdamW, the same in every graph mode so the three modes compute the same numbers.

    Weight decay on matrices only (nanoGPT). A graph cannot contain AdamW's default step, which
    reads the step count on the host: on a GPU use ``capturable=True``, on the CPU ``fused=True``
    (``capturable`` is CUDA-only). The learning rate lives in a float32 device tensor per group
    that :func:`set_lr` refills in place, so a captured step reads each step's value.
    """
    return adamw(model, device, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))


def adamw(
    model: torch.nn.Module,
    device: torch.device,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
) -> torch.optim.AdamW:
    """:func:`make_optimizer` from plain values (also the transformers recipe's optimizer)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kind = {"capturable": True} if device.type == "cuda" else {"fused": True}
    opt = torch.optim.AdamW(groups, lr=lr, betas=betas, **kind)
    tensor_lrs(opt, device)
    return opt


def tensor_lrs(opt: torch.optim.Optimizer, device: torch.device) -> None:
    """Give every param_group its own float32 ``lr`` tensor on ``device`` (also after
    ``load_state_dict``, which brings back the checkpoint's CPU tensors)."""
    for g in opt.param_groups:
        g["lr"] = torch.tensor(float(g["lr"]), dtype=torch.float32, device=device)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Write ``lr`` into the groups' lr tensors in place (no host sync; graphs see it)."""
    for g in opt.param_groups:
        g["lr"].fill_(lr)
