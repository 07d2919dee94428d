"""The small interface a model implements to be served by :class:`~tgraph.decode.DecodeEngine`.

The engine owns the KV cache, the static buffers, the graphs, batching and sampling; the model
only has to say how to run its layers against the cache. Any object with these attributes and
two methods can be served (the toy GPT gets one from :class:`tgraph.decode.gpt.GPTDecoder`)::

    class MyDecoder:
        n_layer: int          # attention layers (one KV cache entry each)
        n_head: int           # KV heads per layer
        head_dim: int         # width of one head
        vocab_size: int       # logits width; valid token ids are 0..vocab_size-1
        max_positions: int    # longest sequence the model supports (e.g. learned positions)
        dtype: torch.dtype    # dtype of the KV cache
        device: torch.device  # where the KV cache and static buffers live

        def prefill(self, tokens, slot, cache):       # eager, any prompt length T
            # tokens: (T,) int64. Write keys/values of positions 0..T-1 into `slot`
            # (cache.write_prefill) and return the logits of the last position, shape (V,).

        def decode_step(self, inputs, cache):         # captured in a graph per bucket
            # inputs: StepInputs of B rows. For each row write the new token's key/value at
            # [inputs.slots[i], :, inputs.positions[i]] (cache.write_step), attend to keys
            # 0..inputs.lengths[i]-1 of that slot (cache.read + a mask, stale keys beyond are
            # arbitrary) and return logits (B, V).

        # optional: encode(text) -> list[int] and decode(ids) -> str, for text prompts.

Rules for ``decode_step`` (it is captured as a CUDA graph): no host syncs (``.item()``, printing,
boolean-mask indexing), no shapes that depend on tensor values, no new CPU tensors, no writes
outside the slots it is given, and every row independent of the other rows (padded rows must not
change live rows' logits).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from tgraph.decode.buffers import StepInputs
from tgraph.decode.kv_cache import KVCache


@runtime_checkable
class DecodeModel(Protocol):
    """What :class:`~tgraph.decode.DecodeEngine` needs from a model (see the module docstring)."""

    n_layer: int
    n_head: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: torch.dtype
    device: torch.device

    def prefill(self, tokens: torch.Tensor, slot: int, cache: KVCache) -> torch.Tensor: ...

    def decode_step(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor: ...


def as_decode_model(model: object) -> DecodeModel:
    """Return ``model`` as a :class:`DecodeModel`: the toy GPT is wrapped, others are checked.

    Args:
        model: a :class:`tgraph.models.gpt.GPT` or an object implementing :class:`DecodeModel`.

    Returns:
        An object implementing :class:`DecodeModel`.

    Raises:
        TypeError: ``model`` is neither.
    """
    from tgraph.decode.gpt import GPTDecoder
    from tgraph.models.gpt import GPT

    if isinstance(model, GPT):
        return GPTDecoder(model)
    if isinstance(model, DecodeModel):
        return model
    missing = [
        name
        for name in DecodeModel.__annotations__.keys() | {"prefill", "decode_step"}
        if not hasattr(model, name)
    ]
    raise TypeError(
        f"DecodeEngine cannot serve a {type(model).__name__}: it is not a tgraph GPT and lacks "
        f"{sorted(missing)} of the decode interface; implement prefill/decode_step as described "
        "in tgraph.decode.interface"
    )
