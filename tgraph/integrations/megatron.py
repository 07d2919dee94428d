"""tgraph graphs on megatron-core's ``GPTModel`` (local layer spec; the TransformerEngine spec, bf16
and FP8 through :mod:`tgraph.integrations.megatron_te`).

What a megatron-core user adds, with the model built by ``GPTModel(config,
get_gpt_layer_local_spec(), ...)`` and ``config.cuda_graph_impl == "none"``::

    from tgraph.integrations import megatron as tg_megatron

    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
    model = DistributedDataParallel(config, ddp_config, GPTModel(...))   # main_grad buffers
    tg_megatron.enable_layer_graphs(model)     # every TransformerLayer becomes graphable
    train_step()                               # first iteration: eager, recorded
    tgraph.create_graphs()                     # later iterations replay per-layer graphs

With megatron-core DDP and ``overlap_grad_reduce=False`` (the wrapper's hooks then only add
``.grad`` into ``main_grad``), the backward graph adds the layers' parameter gradients into
``main_grad`` itself (:class:`tgraph.layers.grads.MainGradFusion`): no AccumulateGrad and no hook per
parameter per step. Otherwise (``overlap_grad_reduce=True``, whose hooks dispatch the bucket
reductions, or no megatron DDP found in ``model``) parameter gradients leave the graph through
autograd and DDP's hooks fire eagerly, exactly as without graphs; fused-wgrad flags follow the
``main_grad`` / ``grad_added_to_main_grad`` convention of :mod:`tgraph.layers.grads` either way. Dropout inside
the layers draws from megatron's RNG tracker; built with ``use_cudagraphable_rng=True`` its
states are generators, which :func:`register_rng_tracker` registers with every graph.

For a whole step, wrap a function that calls megatron's ``forward_backward_func`` in
:class:`tgraph.FullIterationGraph` (see ``recipes/train_megatron_gpt.py``). megatron-core's own
optimizer (``get_megatron_optimizer``) syncs with the host in its step; inside a graph call
:func:`graph_safe_step` instead (after :func:`make_graph_safe`), and beside per-layer graphs
use :class:`MegatronOptimizerGraph`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

import tgraph
from tgraph.layers.manager import GraphableModule

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "megatron-core is not installed: pip install 'tgraph[megatron]' "
    "(megatron-core >= 0.17 needs Python >= 3.12)"
)


def _transformer_layer_class() -> type:
    try:
        from megatron.core.transformer.transformer_layer import TransformerLayer
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return TransformerLayer


def _graphable(cls: type) -> type:
    """``cls`` with :class:`tgraph.GraphableModule` first in its MRO (``__call__`` dispatch)."""
    # megatron's schedule sets ``current_microbatch`` on every layer at each microbatch; only
    # megatron's own graph replay (``MegatronModule.__call__``, replaced here) reads it.
    return GraphableModule.of(cls, unread_attributes=frozenset({"current_microbatch"}))


def register_rng_tracker() -> int:
    """Register megatron's CUDA RNG tracker states with tgraph's graphs.

    Returns:
        The number of generators registered (0 when the tracker is not graph-safe, which is
        only correct for models without dropout; a warning says so).
    """
    from megatron.core import tensor_parallel

    states = tensor_parallel.get_cuda_rng_tracker().get_states()
    gens = [s for s in states.values() if isinstance(s, torch.Generator)]
    if states and not gens:
        logger.warning(
            "megatron's RNG tracker is not graph-safe: dropout inside graphs would repeat its "
            "mask. Call model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, "
            "force_reset_rng=True) before building the model."
        )
    for g in gens:
        tgraph.register_generator(g)
    return len(gens)


def enable_layer_graphs(model: nn.Module, **options) -> nn.Module:
    """Give every megatron-core ``TransformerLayer`` in ``model`` tgraph per-layer graphs.

    Args:
        model: a megatron-core model (GPTModel, or its DDP / Float16Module wrapper; pass the DDP
            wrapper so its ``overlap_grad_reduce`` setting is seen).
        **options: passed to :func:`tgraph.enable` (``strict``, ``warmup_steps``, ``debug``,
            ``backend``, ``merge``). ``main_grad_fusion`` defaults to True when ``model``
            contains megatron DDP with ``overlap_grad_reduce=False``, else False.

    Returns:
        ``model``.

    Raises:
        ImportError: megatron-core is not installed.
        ValueError: no TransformerLayer found, megatron's own CUDA graphs are enabled, or
            ``main_grad_fusion=True`` with ``overlap_grad_reduce=True``.
    """
    layer_cls = _transformer_layer_class()
    layers = [m for m in model.modules() if isinstance(m, layer_cls)]
    if not layers:
        raise ValueError(f"{type(model).__name__} contains no megatron-core TransformerLayer")
    for layer in layers:
        impl = getattr(layer.config, "cuda_graph_impl", "none")
        if impl not in (None, "none"):
            raise ValueError(
                f"TransformerConfig.cuda_graph_impl is {impl!r}; megatron-core's own CUDA graphs "
                "and tgraph's do not nest. Build the model with cuda_graph_impl='none'."
            )
        if not isinstance(layer, GraphableModule):
            layer.__class__ = _graphable(type(layer))
    from tgraph.integrations.megatron_te import mark_te_host_flags

    mark_te_host_flags(model)  # TE spec: megatron's host-side weight-caching flag (see there)
    overlap = _ddp_overlaps_grad_reduce(model)
    fusion = options.pop("main_grad_fusion", None)
    if fusion is None:
        fusion = overlap is False
    elif fusion and overlap:
        raise ValueError(
            "main_grad_fusion=True with megatron DDP's overlap_grad_reduce=True: its gradient "
            "hooks dispatch the bucket reductions and must run; leave main_grad_fusion unset"
        )
    register_rng_tracker()
    return tgraph.enable(model, main_grad_fusion=fusion, **options)


def _ddp_overlaps_grad_reduce(model: nn.Module) -> bool | None:
    """megatron DDP's ``overlap_grad_reduce`` in ``model`` (True if any), None without DDP."""
    try:
        from megatron.core.distributed import DistributedDataParallel
    except ImportError:
        return None
    found = [m for m in model.modules() if isinstance(m, DistributedDataParallel)]
    if not found:
        return None
    return any(m.ddp_config.overlap_grad_reduce for m in found)


def init_single_gpu(seed: int = 1234, port: int = 29512) -> None:
    """World-size-1 setup that megatron-core needs on one GPU (idempotent).

    A process group (nccl) of one rank, ``parallel_state.initialize_model_parallel(1, 1)``, and
    megatron's RNG tracker seeded with graph-safe generators
    (``use_cudagraphable_rng=True, force_reset_rng=True``), as verified on an H200.
    """
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)


def build_gpt(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    vocab_size: int,
    seq_length: int,
    dropout: float = 0.0,
    seed: int = 1234,
    cuda_graph_impl: str = "none",
    spec: str = "local",
    bf16: bool = False,
    fp8: str | None = None,
    fp8_format: str = "hybrid",
    fp8_amax_history_len: int = 16,
) -> nn.Module:
    """megatron-core GPTModel wrapped in its DDP (and in its ``Float16Module`` with ``bf16``).

    ``cuda_graph_impl`` stays ``"none"`` for tgraph; ``"local"`` builds megatron-core's own
    per-layer graphs and ``"transformer_engine"`` its TE graphs (side-by-side benchmarks).
    ``spec``: ``"local"`` (megatron's own modules) or ``"te"`` (TransformerEngine's layer spec,
    causal fused attention: call :func:`forward_backward` with ``attention_mask=False``).
    ``bf16``: bf16 parameters, as megatron's training builds them (``params_dtype`` and
    ``Float16Module``); ``fp8="delayed"``: TE's delayed scaling in ``fp8_format`` ("hybrid" or
    "e4m3"; needs ``spec="te"``, ``bf16``; fields in
    :func:`tgraph.integrations.megatron_te.precision_kwargs`).

    Every parameter gets ``main_grad`` (megatron-core DDP's contiguous fp32 grad buffer).
    Weights are initialized on the CPU from ``seed``, so two calls build identical models.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tgraph.integrations.megatron_te import layer_spec, precision_kwargs

    if fp8 is not None and spec != "te":
        raise ValueError("fp8 needs TransformerEngine's layer spec: spec='te'")
    precision = precision_kwargs(
        bf16=bf16, fp8=fp8, fp8_format=fp8_format, amax_history_len=fp8_amax_history_len
    )
    torch.manual_seed(seed)
    # TE's attention refuses any RNG tracker but TE's own inside a graph capture (megatron's
    # TECudaRNGStatesTracker, graph-safe generators): the TE spec takes it, as megatron does
    te = spec == "te"
    model_parallel_cuda_manual_seed(
        seed, te_rng_tracker=te, use_cudagraphable_rng=True, force_reset_rng=True
    )
    if te:
        precision["use_te_rng_tracker"] = True
    config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        use_cpu_initialization=True,
        cuda_graph_impl=cuda_graph_impl,
        **precision,
    )
    gpt = GPTModel(
        config, layer_spec(spec), vocab_size=vocab_size, max_sequence_length=seq_length
    ).cuda()
    if bf16:
        gpt = Float16Module(config, gpt)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    # DDP creates (and keeps) the AccumulateGrad nodes its hooks hang on: create them on the
    # capture stream, so a whole-step capture never syncs with the default stream.
    side = tgraph.capture_stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model = DistributedDataParallel(config, ddp_config, gpt)
    torch.cuda.current_stream().wait_stream(side)
    return model


def optimizer_step(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    """Step a torch optimizer on megatron DDP's fp32 ``main_grad`` buffers.

    ``.grad`` points at ``main_grad`` only for the step and is cleared after it, as megatron's
    own ``optimizer.zero_grad()`` does: a ``.grad`` left aliasing ``main_grad`` makes the next
    backward accumulate into ``main_grad`` and DDP's hook then add ``main_grad`` to itself
    (doubled gradients). Graph-safe (inside a :class:`tgraph.FullIterationGraph` too).
    """
    for p in params:
        p.grad = p.main_grad
    opt.step()
    for p in params:
        p.grad = None


def wants_attention_mask(model: nn.Module) -> bool:
    """Whether ``model``'s attention takes :func:`causal_inputs`' mask: megatron's local layers
    do; TransformerEngine's spec attends causally by its mask type and takes none."""
    return not any(type(m).__name__ == "TEDotProductAttention" for m in model.modules())


def causal_inputs(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``position_ids`` (B, S) and the boolean causal ``attention_mask`` (1, 1, S, S) for GPTModel."""
    B, S = tokens.shape
    position_ids = torch.arange(S, device=tokens.device).unsqueeze(0).expand(B, S)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=tokens.device), diagonal=1)
    return position_ids, mask[None, None]


def forward_backward(
    model: nn.Module,
    microbatches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    attention_mask: bool = True,
):
    """One step's forward and backward through megatron-core's schedule; returns the mean loss.

    ``attention_mask=False`` passes no mask: TransformerEngine's layer spec attends causally by
    its mask type (megatron's runs without a mask in the data loader do the same).

    ``main_grad`` is zeroed first and synchronized after (megatron DDP), so this function is
    the whole gradient computation of a step: eager, per-layer graphed, or inside a
    :class:`tgraph.FullIterationGraph`.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.zero_grad_buffer()
    data = iter(microbatches)
    losses: list[torch.Tensor] = []

    def forward_step(data_iterator, m):
        tokens, labels = next(data_iterator)
        position_ids, mask = causal_inputs(tokens)
        per_token = m(tokens, position_ids, mask if attention_mask else None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            losses.append(loss.detach())
            return loss, {"lm loss": loss.detach()}

        return per_token, loss_func

    tokens = microbatches[0][0]
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data,
        model=model,
        num_microbatches=len(microbatches),
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=False,
    )
    model.finish_grad_sync()
    return torch.stack(losses).mean()


# megatron-core's own optimizer: tgraph/integrations/megatron_optimizer.py
from tgraph.integrations.megatron_optimizer import (  # noqa: E402
    MegatronOptimizerGraph,
    graph_safe_step,
    make_graph_safe,
)

__all__ = [
    "MegatronOptimizerGraph",
    "build_gpt",
    "causal_inputs",
    "enable_layer_graphs",
    "forward_backward",
    "graph_safe_step",
    "init_single_gpu",
    "make_graph_safe",
    "optimizer_step",
    "register_rng_tracker",
]
