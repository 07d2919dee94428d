"""tgraph graphs on megatron-core's ``GPTModel`` (local layer spec, no TransformerEngine).

What a megatron-core user adds, with the model built by ``GPTModel(config,
get_gpt_layer_local_spec(), ...)`` and ``config.cuda_graph_impl == "none"``::

    from tgraph.integrations import megatron as tg_megatron

    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=True, force_reset_rng=True)
    model = DistributedDataParallel(config, ddp_config, GPTModel(...))   # main_grad buffers
    tg_megatron.enable_layer_graphs(model)     # every TransformerLayer becomes graphable
    train_step()                               # first iteration: eager, recorded
    tgraph.create_graphs()                     # later iterations replay per-layer graphs

Parameter gradients leave the backward graph through autograd, so megatron-core DDP's gradient
hooks fire eagerly and add them into ``main_grad`` exactly as without graphs (the
``main_grad`` / ``grad_added_to_main_grad`` convention of :mod:`tgraph.grads`). Dropout inside
the layers draws from megatron's RNG tracker; built with ``use_cudagraphable_rng=True`` its
states are generators, which :func:`register_rng_tracker` registers with every graph.

For a whole step, wrap a function that calls megatron's ``forward_backward_func`` in
:class:`tgraph.FullIterationGraph` (see ``recipes/train_megatron_gpt.py``); keep the megatron
optimizer step outside it (it synchronizes with the host to check for inf/NaN).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn as nn

import tgraph
from tgraph.module import GraphableModule

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


@functools.cache
def _graphable(cls: type) -> type:
    """``cls`` with :class:`tgraph.GraphableModule` first in its MRO (``__call__`` dispatch)."""
    return type(f"Graphable{cls.__name__}", (GraphableModule, cls), {"__module__": __name__})


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
        model: a megatron-core model (GPTModel, or its DDP / Float16Module wrapper).
        **options: passed to :func:`tgraph.enable` (``strict``, ``warmup``, ``debug``, ``backend``).

    Returns:
        ``model``.

    Raises:
        ImportError: megatron-core is not installed.
        ValueError: no TransformerLayer found, or megatron's own CUDA graphs are enabled.
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
    register_rng_tracker()
    return tgraph.enable(model, **options)
