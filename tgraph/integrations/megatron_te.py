"""megatron-core's GPTModel with the TransformerEngine layer spec, in bf16 or FP8, under tgraph.

:func:`tgraph.integrations.megatron.build_gpt` builds it with ``spec="te"``; this module holds
what that build and its graphs need beyond the local spec (read against megatron-core 0.19.2
and TransformerEngine 2.20.2):

* :func:`precision_kwargs`: the ``TransformerConfig`` fields of bf16 and of FP8 delayed scaling
  (``fp8="hybrid"``, ``fp8_recipe="delayed"``, ``fp8_amax_history_len``,
  ``fp8_amax_compute_algo``); megatron's ``TransformerBlock`` then enters TE's autocast around
  all its layers (delayed scaling) with the amax reduction group of ``parallel_state``.
* :func:`mark_te_host_flags`: megatron's TE linear wrappers keep ``is_first_microbatch`` as a
  Python attribute, set True by the schedule at every step under FP8 and False by their own
  forward. Under TE's graph mode (which tgraph's capture enters) TE ignores that host flag and
  reads its device flag instead (``transformer_engine/pytorch/module/linear.py``: with
  ``fp8_graph_capturing()`` it sets ``is_first_microbatch = False`` and quantizes the weight
  under ``skip_fp8_weight_update_tensor``, which :func:`tgraph.fp8.set_weight_caching` sets at
  each replay); without FP8 the flag is inert (no weight workspace). The attribute is therefore
  declared unread for tgraph's baked-state check, which would otherwise see it flip at every
  step and refuse the replay.
* :func:`init_microbatches` and :func:`te_graph_helper`: megatron's own TE graphs
  (``cuda_graph_impl="transformer_engine"``) are captured by ``TECudaGraphHelper``, which reads
  megatron's global microbatch calculator.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

SPECS = ("local", "te")
FP8_RECIPES = (None, "delayed")
HOST_FLAGS = frozenset({"is_first_microbatch"})


def layer_spec(spec: str):
    """megatron-core's GPT layer spec: ``"local"`` (its own modules) or ``"te"``."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if spec == "local":
        return specs.get_gpt_layer_local_spec()
    if spec == "te":
        try:
            import transformer_engine  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "spec='te' needs TransformerEngine (pip install transformer_engine[pytorch])"
            ) from exc
        return specs.get_gpt_layer_with_transformer_engine_spec()
    raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")


def precision_kwargs(
    *,
    bf16: bool,
    fp8: str | None,
    fp8_format: str = "hybrid",
    amax_history_len: int = 16,
    amax_compute_algo: str = "max",
) -> dict:
    """``TransformerConfig`` fields for bf16 parameters and FP8 (``fp8="delayed"``: TE's delayed
    scaling; ``fp8_format`` "hybrid": E4M3 forward, E5M2 gradients, or "e4m3" for both)."""
    if fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8 must be one of {FP8_RECIPES}, got {fp8!r}")
    if fp8 is not None and fp8_format not in ("hybrid", "e4m3"):
        raise ValueError(f"fp8_format must be 'hybrid' or 'e4m3', got {fp8_format!r}")
    out: dict = {}
    if bf16:
        out.update(bf16=True, params_dtype=torch.bfloat16)
    if fp8 == "delayed":
        if not bf16:
            raise ValueError("fp8='delayed' trains bf16 parameters: pass bf16=True")
        out.update(
            fp8=fp8_format,
            fp8_recipe="delayed",
            fp8_margin=0,
            fp8_amax_history_len=amax_history_len,
            fp8_amax_compute_algo=amax_compute_algo,
        )
    return out


@functools.cache
def _unread_flags(cls: type) -> type:
    attrs = {"__module__": __name__, "unread_attributes": HOST_FLAGS}
    return type(cls.__name__, (cls,), attrs)


def mark_te_host_flags(model: nn.Module) -> int:
    """Declare megatron's TE wrappers' ``is_first_microbatch`` attribute unread by graphs (see
    the module docstring); returns how many modules were marked."""
    n = 0
    for m in model.modules():
        if "is_first_microbatch" in vars(m) and HOST_FLAGS - getattr(
            type(m), "unread_attributes", frozenset()
        ):
            m.__class__ = _unread_flags(type(m))
            n += 1
    return n


def init_microbatches(micro_batch_size: int, num_microbatches: int = 1) -> None:
    """megatron's global microbatch calculator on one rank (``TECudaGraphHelper`` reads it)."""
    from megatron.core import num_microbatches_calculator as calc

    calc.unset_num_microbatches_calculator()
    calc.init_num_microbatches_calculator(
        rank=0,
        rampup_batch_size=None,
        global_batch_size=micro_batch_size * num_microbatches,
        micro_batch_size=micro_batch_size,
        data_parallel_size=1,
    )


def te_graph_helper(model: nn.Module, *, seq_length: int, micro_batch_size: int, optimizers=()):
    """megatron-core's ``TECudaGraphHelper`` for a one-chunk model built with
    ``cuda_graph_impl="transformer_engine"``. As megatron's training loop does, call its
    ``create_cudagraphs()`` after ``config.cuda_graph_warmup_steps`` eager iterations; later
    iterations replay TE's per-layer graphs."""
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper
    from megatron.core.utils import get_model_config

    config = get_model_config(model)
    init_microbatches(micro_batch_size)
    return TECudaGraphHelper(
        model=[model],
        config=config,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        optimizers=list(optimizers),
    )
