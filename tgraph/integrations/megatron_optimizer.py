"""megatron-core's own optimizer (``get_megatron_optimizer``) under tgraph, without host syncs.

:func:`make_graph_safe` checks the optimizer and makes its torch optimizer capturable;
:func:`graph_safe_step` does megatron's step (grad norm, clipping, the inner step) with device
tensors only, so it can run inside :class:`tgraph.FullIterationGraph`; beside per-layer graphs,
:class:`MegatronOptimizerGraph` graphs it on its own (see :mod:`tgraph.integrations.megatron`).
"""

from __future__ import annotations

import math

import torch

import tgraph
from tgraph.step.nonfinite import protect_also

# -- megatron-core's own optimizer without host syncs -------------------------------------------
#
# megatron-core's optimizer step syncs with the host four times per step (megatron/core/optimizer,
# read at core_v0.17.0, core_v0.19.0 and main): clip_grads.get_grad_norm_fp32 returns ``total_norm.item() **
# (1 / norm_type)`` unless TransformerEngine's multi_tensor_scale_tensor is installed;
# clip_grad_by_total_norm_fp32 branches on ``clip_coeff < 1.0`` in Python; without TE or apex the
# local l2-norm fallback builds ``torch.tensor(list_of_cuda_norms)`` and ``float(...)`` of it; and
# MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan reads ``found_inf.item()``. Its
# inner optimizer, torch's AdamW when neither TE nor apex is installed, is built with
# ``capturable=OptimizerConfig.optimizer_cuda_graph`` (False by default) and then reads its step
# count on the host. graph_safe_step does the same math on the device instead.


def _sub_optimizers(mopt) -> list:
    """The megatron optimizers of a ChainedOptimizer (or ``[mopt]``), stubs left out."""
    subs = list(getattr(mopt, "chained_optimizers", [mopt]))
    return [s for s in subs if not getattr(s, "is_stub_optimizer", False)]


def _model_params(sub) -> list[torch.Tensor]:
    """The bf16 model parameters of a ``Float16OptimizerWithFloat16Params`` (its
    ``float16_groups``): they hold ``main_grad``, and its step copies the fp32 master weights it
    steps (``get_parameters()``) into them. Empty for ``FP32Optimizer``, whose model
    parameters are its parameters."""
    return [p for group in getattr(sub, "float16_groups", ()) for p in group]


def _unique(tensors) -> list[torch.Tensor]:
    """``tensors`` in order, each once (by identity)."""
    return list({id(t): t for t in tensors}.values())


def _grad_holders(subs: list) -> list[torch.Tensor]:
    """Every tensor whose ``.grad`` megatron's step sets: the parameters it steps, and the
    model parameters whose ``.grad`` ``prepare_grads()`` sets to None (Float16)."""
    return _unique(p for sub in subs for p in [*sub.get_parameters(), *_model_params(sub)])


def make_graph_safe(mopt) -> list[torch.optim.Optimizer]:
    """Check that a megatron-core optimizer can step inside a graph; make its torch optimizer
    capturable.

    Torch optimizers inside (AdamW/Adam/SGD, megatron's choice without TransformerEngine or apex)
    that are neither fused nor capturable get ``capturable=True`` (their step count moves to the
    GPU; the same update up to rounding of the bias correction); fused ones are graphed as they
    are. Anything that needs the host every step is refused.

    Args:
        mopt: what ``get_megatron_optimizer`` returned.

    Returns:
        The inner torch optimizers (their learning rates reach the graphs as device tensors).

    Raises:
        ValueError: a dynamic loss scaler (fp16), ``log_num_zeros_in_grad``, a finite
            ``grad_norm_skip_threshold``, or a non-torch inner optimizer that is not capturable;
            each message names the ``OptimizerConfig`` field to change.
    """
    inners = []
    for sub in _sub_optimizers(mopt):
        cfg = sub.config
        if getattr(sub, "grad_scaler", None) is not None:
            raise ValueError(
                f"{type(sub).__name__} has a loss scaler: megatron updates it on the host from "
                "found_inf.item() at every step (fp16 or OptimizerConfig.loss_scale), which a "
                "graph cannot contain. Train in bf16 or fp32 without loss_scale for graphs."
            )
        if getattr(cfg, "log_num_zeros_in_grad", False):
            raise ValueError(
                "OptimizerConfig.log_num_zeros_in_grad=True counts zeros with .item() at every "
                "step; set it to False under tgraph graphs"
            )
        if math.isfinite(getattr(cfg, "grad_norm_skip_threshold", math.inf)):
            raise ValueError(
                "OptimizerConfig.grad_norm_skip_threshold is finite: megatron compares the grad "
                "norm on the host. Leave it at inf; tgraph's skip_nonfinite skips non-finite "
                "steps on the device"
            )
        inner = sub.optimizer
        if getattr(inner, "capturable", None) is False:  # TransformerEngine's or apex's FusedAdam
            raise ValueError(
                f"{type(inner).__name__} (inside megatron's {type(sub).__name__}) has "
                "capturable=False: it counts its steps in a Python int, which a graph would "
                "advance once. Build it with OptimizerConfig(optimizer_cuda_graph=True)."
            )
        for g in inner.param_groups:
            if g.get("fused") or "capturable" not in g or g["capturable"]:
                continue  # fused: its step count lives on the device (tgraph/step/host_state.py)
            if not type(inner).__module__.startswith("torch.optim"):
                raise ValueError(
                    f"{type(inner).__name__} (inside megatron's {type(sub).__name__}) has "
                    "capturable=False. Build it with OptimizerConfig(optimizer_cuda_graph=True)."
                )
            g["capturable"] = True
            for p in g["params"]:
                st = inner.state.get(p, {})
                if isinstance(st.get("step"), torch.Tensor) and st["step"].device != p.device:
                    st["step"] = st["step"].to(p.device, torch.float32)
        # a skipped step restores the bf16 model weights too (FullIterationGraph's skip_nonfinite)
        protect_also(inner, _model_params(sub))
        inners.append(inner)
    return inners


def _grads_for_norm(sub) -> list[torch.Tensor]:
    get = getattr(sub, "get_grads_for_grad_norm", None) or sub.get_main_grads_for_grad_norm
    return get()


def _clip_grads():
    """megatron-core's ``clip_grads`` module, whose kernels and branch the step follows; None
    without megatron-core (a CPU stand-in: its fallback without TransformerEngine or apex)."""
    try:
        from megatron.core.optimizer import clip_grads
    except ImportError:
        return None
    return clip_grads


def _l2_norm(grads: list[torch.Tensor], clip_grads) -> torch.Tensor:
    """megatron's fp32 l2 norm of ``grads`` (``get_grad_norm_fp32``), 0-dim: its own
    multi-tensor kernel (TransformerEngine's or apex's). For its local fallback, which reduces
    the per-tensor norms on the host (``torch.norm(torch.tensor(l2))``), the same per-tensor
    norms reduced on the device: the same bits on the CPU, maybe not in the last bit on a GPU."""
    impl = getattr(clip_grads, "l2_norm_impl", None)
    if impl is not None and getattr(impl, "__module__", None) != "megatron.core.utils":
        overflow = torch.zeros(1, dtype=torch.int, device=grads[0].device)
        norm, _ = clip_grads.multi_tensor_applier(impl, overflow, [grads], False)
        return norm.reshape(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


def _norm_and_clip(subs: list) -> torch.Tensor:
    """After ``prepare_grads()``: megatron's gradient norm and clipping, in its precision, on
    the device (megatron/core/optimizer/clip_grads.py at core_v0.19.0)."""
    import torch.distributed as dist

    grads = [g for sub in subs for g in _grads_for_norm(sub)]
    # megatron's fused kernels are CUDA kernels: CPU tensors (the emulated backend) take the
    # arithmetic of its local fallback, which the CPU stand-ins model
    clip_grads = _clip_grads() if grads and grads[0].is_cuda else None
    sq = _l2_norm(grads, clip_grads) ** 2.0  # total_norm = grad_norm**norm_type (fp32)
    group = subs[0].get_grad_stats_parallel_group()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    clip = subs[0].config.clip_grad
    clipped = [p.grad for sub in subs for p in sub.get_parameters() if p.grad is not None]
    if getattr(clip_grads, "multi_tensor_scale_tensor_impl", None) is not None:
        # With TransformerEngine's multi_tensor_scale_tensor megatron stays on the device, fp32:
        #   total_norm = total_norm.pow(1.0 / norm_type)
        #   clip_coeff = max_norm / (total_norm + 1.0e-6); clip_coeff.clamp_max_(1.0)
        norm = sq.pow(0.5)
        if clip > 0.0:
            torch._foreach_mul_(clipped, (clip / (norm + 1.0e-6)).clamp_max_(1.0))
        return norm
    # Otherwise it reads the sum on the host and goes on in Python doubles:
    #   total_norm = total_norm.item() ** (1.0 / norm_type)
    #   clip_coeff = max_norm / (total_norm + 1.0e-6)
    #   elif clip_coeff < 1.0: multi_tensor_applier(multi_tensor_scale_impl, ..., clip_coeff)
    # and multi_tensor_scale multiplies by the coefficient rounded to float. The same in float64
    # on the device: IEEE addition, division and rounding give the host's bits. Python's ** 0.5
    # is libm's pow, which rounds the other way than sqrt for about 0.1% of values: the norm
    # then differs in its last double bit, the float32 coefficient only if it lies within a
    # double ulp of a float32 rounding boundary (2**-29 of the time).
    norm = sq.double().sqrt()
    if clip > 0.0:
        coeff = torch.full_like(norm, clip) / (norm + 1.0e-6)  # tensor / tensor: no reciprocal
        torch._foreach_mul_(clipped, torch.where(coeff < 1.0, coeff, 1.0).float())
    return norm


def graph_safe_step(mopt) -> torch.Tensor:
    """``mopt.step()`` without host syncs: the same gradient norm, clipping and inner step.

    Per sub-optimizer: ``prepare_grads()`` (``.grad`` = ``main_grad``; with bf16 parameters,
    megatron's ``Float16OptimizerWithFloat16Params``, the fp32 master weights' ``.grad`` = the
    model parameters' ``main_grad`` in fp32), the norm of megatron's gradients for the norm
    (summed over its grad-stats group when that has several ranks), clipping by
    ``clip_grad / (norm + 1e-6)`` when below 1, both in megatron's precision (its fp32 l2 norm,
    then its host doubles, on the device), then ``step_with_ready_grads()`` (the inner step;
    with bf16 parameters, then the copy of the master weights into the model's). ``.grad`` is
    left as before the call (megatron leaves it aliasing ``main_grad`` until ``zero_grad()``; a
    graph replay cannot run that Python). Call :func:`make_graph_safe` once first. Usable
    eagerly and inside a :class:`tgraph.FullIterationGraph` (whose ``skip_nonfinite`` protects
    the inner step, and the bf16 model weights :func:`make_graph_safe` named for it).

    Returns:
        The total gradient norm before clipping, a 0-dim device tensor: float64, megatron's host
        double (float32 where megatron keeps it on the device: with TransformerEngine's
        ``multi_tensor_scale_tensor``).
    """
    subs = _sub_optimizers(mopt)
    saved = [(p, p.grad) for p in _grad_holders(subs)]
    try:
        for sub in subs:
            sub.prepare_grads()
        norm = _norm_and_clip(subs)
        for sub in subs:
            sub.step_with_ready_grads()
    finally:
        for p, g in saved:
            p.grad = g
    return norm


class MegatronOptimizerGraph(tgraph.OptimizerGraph):
    """A megatron-core optimizer's step (:func:`graph_safe_step`) as one tgraph graph.

    Beside :func:`enable_layer_graphs`, megatron's loop becomes::

        opt_graph = MegatronOptimizerGraph(mopt, skip_nonfinite=True)
        for batch in batches:
            loss = forward_backward(model, batch)    # zero_grad_buffer(), fwd/bwd, grad sync
            opt_graph.step(loss)
            mopt.zero_grad()                         # as usual (sets .grad to None)
            scheduler.step(1)                        # megatron's OptimizerParamScheduler

    Gradients are megatron DDP's ``main_grad`` buffers, which never move: the graph reads them
    directly, and ``model.zero_grad_buffer()`` zeroes them in place before the next backward (so
    ``zero_grad`` is False here). Clipping follows ``OptimizerConfig.clip_grad``. With
    ``skip_nonfinite``, the inner optimizer's parameters and state, the bf16 model parameters
    (``Float16OptimizerWithFloat16Params``) and every parameter of the optimizer's
    ``model_chunks`` are restored bitwise when the loss or the norm is not finite.

    With bf16 parameters (``OptimizerConfig(bf16=True)``, no loss scale) the graph holds
    megatron's whole mixed-precision step: the copy of the model's ``main_grad`` into the fp32
    master weights' ``.grad``, norm and clipping, the inner step, and the copy of the master
    weights into the bf16 model parameters.

    Args:
        mopt: what ``get_megatron_optimizer`` returned (made graph-safe here).
        skip_nonfinite, warmup_steps, backend: as :class:`tgraph.OptimizerGraph` (the default
            of ``skip_nonfinite`` is False there and here).

    It overrides :class:`tgraph.OptimizerGraph`'s extension points (its docstring lists them):
    :attr:`optimizers`, :meth:`params`, :meth:`protected_tensors`, :meth:`norm_and_clip`,
    :meth:`inner_step`, :meth:`bind_grads` and :meth:`refresh_grads`.
    """

    def __init__(
        self,
        mopt,
        *,
        skip_nonfinite: bool = False,
        warmup_steps: int = 1,
        backend: str = "auto",
    ) -> None:
        self.megatron_optimizer = mopt
        self._inners = make_graph_safe(mopt)
        if not self._inners:
            raise ValueError(f"{type(mopt).__name__} holds no optimizer with parameters")
        super().__init__(
            self._inners[0],
            skip_nonfinite=skip_nonfinite,
            zero_grad=False,
            warmup_steps=warmup_steps,
            backend=backend,
        )

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._inners)

    def params(self) -> list[torch.Tensor]:
        """The parameters the step writes: the inner optimizers' (fp32 master weights with
        bf16 parameters), then the bf16 model parameters whose ``main_grad`` it reads."""
        subs = _sub_optimizers(self.megatron_optimizer)
        return _unique([*super().params(), *(p for sub in subs for p in _model_params(sub))])

    def protected_tensors(self) -> list[torch.Tensor]:
        """The bf16 model parameters and every parameter of the optimizer's ``model_chunks``
        (the fp32 master weights are copied into them)."""
        chunks = getattr(self.megatron_optimizer, "model_chunks", None) or []
        subs = _sub_optimizers(self.megatron_optimizer)
        return _unique(
            [
                *(p for chunk in chunks for p in chunk.parameters()),
                *(p for sub in subs for p in _model_params(sub)),
            ]
        )

    def norm_and_clip(self) -> torch.Tensor:
        """megatron's ``prepare_grads()`` then its norm and clipping in its precision, on the
        device (:func:`graph_safe_step`)."""
        subs = _sub_optimizers(self.megatron_optimizer)
        self._saved_grads = [(p, p.grad) for p in _grad_holders(subs)]
        for sub in subs:
            sub.prepare_grads()
        return _norm_and_clip(subs)

    def inner_step(self) -> None:
        """megatron's ``step_with_ready_grads()``; ``.grad`` as before the step."""
        for sub in _sub_optimizers(self.megatron_optimizer):
            sub.step_with_ready_grads()
        for p, g in self._saved_grads:  # .grad as before the step (see graph_safe_step)
            p.grad = g

    def bind_grads(self) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
        """megatron DDP's ``main_grad`` buffers, read where they are (they never move)."""
        params = {id(p): p for p in [*self.params(), *self.protected_tensors()]}.values()
        pairs = [(p, p.main_grad) for p in params if getattr(p, "main_grad", None) is not None]
        if not pairs:
            raise ValueError(
                "MegatronOptimizerGraph: no parameter has main_grad; wrap the model in "
                "megatron-core's DistributedDataParallel (its grad buffers have fixed addresses)"
            )
        self._grad_ptrs = [g.data_ptr() for _, g in pairs]  # the addresses the graph reads
        return pairs, []

    def refresh_grads(self) -> None:
        """Nothing to copy; refuse a ``main_grad`` that moved since the capture: another
        tensor, or the same tensor on other memory (megatron DDP's grad buffer freed and
        allocated again, as offloading it and restoring it does: ``grad_data.storage().
        resize_``), where the graph would read memory that is no longer the gradient.

        Raises:
            ValueError: a ``main_grad`` moved; the step is not taken (call :meth:`reset`).
        """
        for (p, g), ptr in zip(self.bound_grads, self._grad_ptrs):
            if p.main_grad is not g or g.data_ptr() != ptr:
                raise ValueError(
                    f"MegatronOptimizerGraph: the {tuple(p.shape)} parameter's main_grad moved "
                    "since capture (the DDP grad buffer was rebuilt, or freed and allocated "
                    "again), so the graph would read stale memory; call reset() to capture anew"
                )
