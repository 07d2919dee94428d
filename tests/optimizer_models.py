"""Models, optimizers, batches and planted bugs shared by the optimizer-graph tests
(tests/test_optimizer_graph.py, tests/test_megatron_optimizer_graph.py)."""

from __future__ import annotations

import importlib.util

import torch

import tgraph
from tgraph.toy.gpt import GPT, GPTConfig

HAS_TE = importlib.util.find_spec("transformer_engine") is not None
CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
LR = 2.0**-8
STEPS = 8
TOL = dict(rtol=1e-4, atol=1e-5)


def make_model(device: torch.device) -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).to(device)


class GroupStepSGD(torch.optim.Optimizer):
    """Keeps its step count where TransformerEngine's capturable FusedAdam does: a device tensor
    in the param group (``group["step"]``), not in ``optimizer.state``; the update depends on it."""

    def __init__(self, params, lr: float) -> None:
        # capturable: tgraph holds its lr in a device tensor, which a skipped step must not
        # write (the step never does; a schedule does, outside the step)
        super().__init__(params, dict(lr=lr, capturable=True))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if "step" not in group:
                group["step"] = torch.zeros((), device=params[0].device)
            group["step"] += 1
            scale = -group["lr"] / group["step"].sqrt()
            torch._foreach_add_(params, torch._foreach_mul([p.grad for p in params], scale))


def make_optimizer(model: GPT, device: torch.device, kind: str = "adamw"):
    if kind == "group_step":
        return GroupStepSGD(model.parameters(), lr=LR * 32)
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR * 32, momentum=0.9, fused=True)
    extra = {"capturable": True} if device.type == "cuda" else {"fused": True}
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **extra)


def make_batches(device: torch.device, n: int = STEPS):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
        y = torch.randint(0, CFG.vocab_size, (4, CFG.block_size), generator=g)
        out.append((x.to(device), y.to(device)))
    return out


def plant(kind: str | None, model: GPT, loss: torch.Tensor) -> torch.Tensor:
    """A non-finite step: before backward ("loss", "grad_nan") or after it ("grad_inf")."""
    if kind == "loss":  # the loss is NaN, the gradients are finite: only the loss check sees it
        return loss + float("nan")
    if kind == "grad_nan":
        return loss * float("nan")
    return loss


def plant_after_backward(kind: str | None, model: GPT) -> None:
    if kind == "grad_inf":
        with torch.no_grad():
            next(model.parameters()).grad.view(-1)[3] = float("inf")


def train_eager(device, *, clip=None, sched=None, bad=None, kind=None, opt_kind="adamw"):
    """Eager reference: zero_grad(set_to_none=False); the steps in ``bad`` are not taken."""
    model = make_model(device)
    opt = make_optimizer(model, device, opt_kind)
    schedule = make_schedule(sched, opt)
    for i, (x, y) in enumerate(make_batches(device)):
        loss = plant(kind if i in (bad or ()) else None, model, model(x, y)[1])
        loss.backward()
        plant_after_backward(kind if i in (bad or ()) else None, model)
        if i not in (bad or ()):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        opt.zero_grad(set_to_none=False)
        if schedule is not None:
            schedule.step()
    return model, opt


def train_graphed(backend, device, *, clip=None, sched=None, bad=None, kind=None, **kw):
    model = make_model(device)
    opt = make_optimizer(model, device, kw.pop("opt_kind", "adamw"))
    schedule = make_schedule(sched, opt)
    kw.setdefault("skip_nonfinite", True)
    graph = tgraph.OptimizerGraph(opt, clip_grad_norm=clip, backend=backend, **kw)
    for i, (x, y) in enumerate(make_batches(device)):
        loss = plant(kind if i in (bad or ()) else None, model, model(x, y)[1])
        loss.backward()
        plant_after_backward(kind if i in (bad or ()) else None, model)
        graph.step(loss)
        if schedule is not None:
            schedule.step()
    assert graph.captured
    return model, opt, graph


def make_schedule(kind, opt):
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if kind == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=0.0)
    return None


def assert_same_training_state(model, opt, ref_model, ref_opt, exact: bool = True):
    """Parameters and every optimizer state tensor (Adam's step count included)."""
    for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        if exact:
            assert torch.equal(p, q), f"parameter {i} differs from eager"
        else:
            torch.testing.assert_close(p, q, **TOL)
    for i, (g, h) in enumerate(zip(opt.param_groups, ref_opt.param_groups)):
        for k, v in h.items():
            if isinstance(v, torch.Tensor):  # e.g. a step count kept in the group
                assert torch.equal(g[k], v), f"param group {i} {k!r} differs from eager"
    for i, (p, q) in enumerate(zip(model.parameters(), ref_model.parameters())):
        got, ref = opt.state[p], ref_opt.state[q]
        assert set(got) == set(ref), f"optimizer state {i} has keys {set(got)}, eager {set(ref)}"
        for k in ref:
            if exact:
                assert torch.equal(got[k], ref[k]), f"optimizer state {i} {k!r} differs from eager"
            else:
                torch.testing.assert_close(got[k], ref[k], **TOL)
