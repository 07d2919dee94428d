"""A CPU stand-in of megatron-core 0.19.2's ``Float16OptimizerWithFloat16Params`` in bf16 (no
grad scaler), its training loops and checks, shared by the bf16 tests of
tests/test_megatron_optimizer_graph.py; and megatron's clipping arithmetic on the host, which
its stand-ins step with."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from optimizer_models import LR, TOL, make_batches, make_model, plant

import tgraph


def megatron_clip_grad_norm(
    grads_for_norm: list[torch.Tensor], grads: list[torch.Tensor], max_norm: float
) -> float:
    """megatron-core's gradient norm and clipping as its eager step computes them without
    TransformerEngine or apex (core_v0.19.0: optimizer/clip_grads.py and utils.py), host
    syncs and Python doubles included; clips ``grads`` in place, returns the norm."""
    device = grads_for_norm[0].device
    # get_grad_norm_fp32 -> utils.local_multi_tensor_l2_norm:
    #     l2 = [[(torch.norm(tensor)) for tensor in tensor_list] for tensor_list in tensor_lists]
    #     l2_reduced = torch.norm(torch.tensor(l2))
    #     l2_cuda = torch.tensor([float(l2_reduced)], dtype=torch.float, device="cuda")
    l2_reduced = torch.norm(torch.tensor([torch.norm(g) for g in grads_for_norm]))
    grad_norm = torch.tensor([float(l2_reduced)], dtype=torch.float, device=device)
    #     total_norm = grad_norm**norm_type
    #     total_norm = total_norm.item() ** (1.0 / norm_type)
    total_norm = (grad_norm**2.0).item() ** (1.0 / 2.0)
    # clip_grad_by_total_norm_fp32:
    #     clip_coeff = max_norm / (total_norm + 1.0e-6)
    #     elif clip_coeff < 1.0:
    #         multi_tensor_applier(
    #             multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads], clip_coeff
    #         )
    # -> utils.local_multi_tensor_scale:  dst.copy_(src * scale)
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.copy_(g * clip_coeff)
    return total_norm


class FakeFloat16Optimizer:
    """megatron-core's Float16OptimizerWithFloat16Params protocol (bf16, no grad scaler).

    The model's bf16 parameters (``float16_groups``) carry an fp32 ``main_grad`` (megatron DDP
    with ``grad_reduce_in_fp32``); the inner torch optimizer steps fp32 master copies
    (``fp32_from_float16_groups``). ``inner``: ``"adamw"`` (fused on the CPU, capturable on
    CUDA) or ``"sgd"`` (momentum, not fused: a skipped step is undone by snapshot).
    ``copy_back``: ``"copy"`` (megatron's ``copy_``) or ``"eager_only"``, a planted bug: the
    copy of the master weights into the model is left out of a captured step (a graph replays
    the inner step alone).
    """

    def __init__(
        self, model, device, clip_grad: float, inner: str = "adamw", copy_back: str = "copy"
    ):
        self.config = SimpleNamespace(
            clip_grad=clip_grad,
            log_num_zeros_in_grad=False,
            grad_norm_skip_threshold=math.inf,
            bf16=True,
            fp16=False,
        )
        self.grad_scaler = None
        self.is_stub_optimizer = False
        self.copy_back = copy_back
        model_params = [p for p in model.parameters() if p.requires_grad]
        for p in model_params:
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
        masters = [p.detach().clone().float() for p in model_params]
        for p, m in zip(model_params, masters):
            p.main_param = m
        if inner == "sgd":
            self.optimizer = torch.optim.SGD(masters, lr=LR * 32, momentum=0.9)
        else:
            extra = {"capturable": True} if device.type == "cuda" else {"fused": True}
            self.optimizer = torch.optim.AdamW(masters, lr=LR, weight_decay=0.1, **extra)
        self.float16_groups = [model_params]
        self.fp32_from_float16_groups = [masters]
        self.fp32_from_fp32_groups = [[]]

    # -- megatron-core 0.19.2, megatron/core/optimizer/optimizer.py ---------------------------

    def get_parameters(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def get_grads_for_grad_norm(self):
        return [p.grad for p in self.get_parameters() if p.grad is not None]

    def get_grad_stats_parallel_group(self):
        return None

    def _copy_model_grads_to_main_grads(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                main_param.grad = model_param.main_grad.float()
                model_param.grad = None
        for group in self.fp32_from_fp32_groups:
            for p in group:
                p.grad = p.main_grad

    def _copy_main_params_to_model_params(self):
        if self.copy_back == "eager_only" and _capturing():
            return  # the planted bug (an emulated capture patches is_current_stream_capturing)
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                # _multi_tensor_copy_this_to_that without an overflow buffer (bf16)
                model_param.data.copy_(main_param.data)

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self._copy_model_grads_to_main_grads()
        return False  # no grad scaler: no found_inf check

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self.optimizer.step()
        self._copy_main_params_to_model_params()
        return True

    @torch.no_grad()
    def step(self):
        """MixedPrecisionOptimizer.step: the norm and the clip decision on the host."""
        if self.prepare_grads():
            return False, None, None
        grad_norm = 0.0
        if self.config.clip_grad > 0.0:
            grads = self.get_grads_for_grad_norm()
            grad_norm = megatron_clip_grad_norm(grads, grads, self.config.clip_grad)
        return self.step_with_ready_grads(), grad_norm, 0

    def zero_grad(self, set_to_none=True):
        for groups in (self.float16_groups, self.fp32_from_float16_groups):
            for group in groups:
                for p in group:
                    p.grad = None


def _capturing() -> bool:
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # a CPU-only build of torch, outside an emulated capture
        return False


def make_bf16_model(device):
    return make_model(device).to(torch.bfloat16)


def backward_into_main_grad(model, loss) -> None:
    """megatron DDP: ``zero_grad_buffer()`` (done by the caller), then its hooks add each
    gradient into ``main_grad``."""
    params = list(model.parameters())
    for p, g in zip(params, torch.autograd.grad(loss, params)):
        p.main_grad.add_(g)


def float16_run(backend, device, mode: str, bad=(), clip: float = 0.05, **fake):
    """Train the bf16 toy GPT through the stand-in; NaN gradients at the steps in ``bad``.

    mode: ``"megatron"`` (its eager step, with host syncs), ``"safe"`` (``graph_safe_step``
    eagerly), ``"graph"`` (:class:`MegatronOptimizerGraph`, skip_nonfinite) or ``"full"``
    (``graph_safe_step`` inside a :class:`tgraph.FullIterationGraph`, skip_nonfinite). The
    eager modes do not step the steps in ``bad``.
    """
    from tgraph.integrations import megatron as tm

    model = make_bf16_model(device)
    mopt = FakeFloat16Optimizer(model, device, clip_grad=clip, **fake)
    graph = None
    if mode == "graph":
        graph = tm.MegatronOptimizerGraph(mopt, skip_nonfinite=True, backend=backend)
    if mode in ("safe", "full"):
        tm.make_graph_safe(mopt)

    def full_step(batch):
        (x, y), poison = batch
        for p in model.parameters():
            p.main_grad.zero_()
        loss = model(x, y)[1] * poison
        backward_into_main_grad(model, loss)
        tm.graph_safe_step(mopt)
        return loss.detach()

    if mode == "full":
        graph = tgraph.FullIterationGraph(
            full_step, warmup_steps=2, skip_nonfinite=True, backend=backend
        )
    for i, (x, y) in enumerate(make_batches(device)):
        if mode == "full":
            poison = torch.full((), float("nan") if i in bad else 1.0, device=device)
            graph(((x, y), poison.to(torch.bfloat16)))
            mopt.zero_grad()
            continue
        for p in model.parameters():
            p.main_grad.zero_()  # megatron DDP's zero_grad_buffer()
        loss = plant("grad_nan" if i in bad else None, model, model(x, y)[1])
        backward_into_main_grad(model, loss)
        if mode == "graph":
            graph.step(loss)
        elif i not in bad:
            mopt.step() if mode == "megatron" else tm.graph_safe_step(mopt)
        mopt.zero_grad()
    return model, mopt, graph


def assert_same_float16_state(mopt, ref, exact: bool = True) -> None:
    """bf16 model parameters, fp32 master weights and every optimizer state tensor."""

    def same(a, b, what):
        if exact:
            assert torch.equal(a, b), f"{what} differs from the reference"
        else:
            torch.testing.assert_close(a, b, **TOL, msg=f"{what} differs from the reference")

    for i, (p, q) in enumerate(zip(mopt.float16_groups[0], ref.float16_groups[0])):
        assert p.dtype == torch.bfloat16
        same(p, q, f"model parameter {i}")
    for i, (p, q) in enumerate(zip(mopt.get_parameters(), ref.get_parameters())):
        same(p, q, f"master parameter {i}")
        st, rst = mopt.optimizer.state[p], ref.optimizer.state[q]
        assert set(st) == set(rst), f"optimizer state {i}: keys {set(st)}, reference {set(rst)}"
        for k in rst:
            same(st[k], rst[k], f"optimizer state {i} {k!r}")
    for i, (p, m) in enumerate(zip(mopt.float16_groups[0], mopt.get_parameters())):
        assert torch.equal(p, m.to(p.dtype)), f"model parameter {i} is not its master's bf16 copy"
