"""Hugging Face Llama in the training benchmark and the host profile.

A stock ``LlamaForCausalLM`` (random init from a ``LlamaConfig``, SDPA attention) behind the
toy GPT's interface, ``model(idx, targets) -> (logits, loss)``, so that every mode of
``bench_train.py`` trains it unchanged. Its decoder layers are made graphable by a class swap
(:func:`make_layers_graphable`, as ``tests/hf_models.py`` and tgraph's megatron integration do);
a graphable module that is not enabled is an ordinary module, so the eager and compile modes
run the same model. ``torch.cuda.make_graphed_callables`` takes positional tensors only, so
:func:`make_graphed_layers` graphs each layer through a positional wrapper around HF's keyword
call.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import tgraph

LLAMA_CONFIGS: dict[str, dict[str, Any]] = {
    # (layers, width, tokens, batch): host-bound at B1, GPU-bound at B8 and d1024
    "llama_b1": dict(model="llama", n_layer=12, n_embd=256, n_head=4, seq=128, batch=1),
    "llama_b8": dict(model="llama", n_layer=12, n_embd=256, n_head=4, seq=128, batch=8),
    "llama_d1024": dict(model="llama", n_layer=16, n_embd=1024, n_head=16, seq=256, batch=4),
    "llama_smoke": dict(model="llama", n_layer=2, n_embd=32, n_head=2, seq=16, batch=2),
}
LLAMA_DTYPES = {"llama_b1": "fp32", "llama_b8": "fp32", "llama_d1024": "bf16"}


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "the Llama configurations need transformers: pip install transformers"
        ) from exc
    transformers.logging.set_verbosity_error()
    return transformers


def make_layers_graphable(model: nn.Module) -> nn.Module:
    """Swap every Llama decoder layer of ``model`` onto its graphable subclass, and the final
    norm onto a member-only one (``graphed_alone=False``), as ``graph_layers`` does."""
    layer_cls = _transformers().models.llama.modeling_llama.LlamaDecoderLayer
    for m in model.modules():
        if isinstance(m, layer_cls) and not isinstance(m, tgraph.GraphableModule):
            m.__class__ = tgraph.GraphableModule.of(type(m))
    norm = model.model.norm
    if not isinstance(norm, tgraph.GraphableModule):
        cls = type(norm)
        norm.__class__ = tgraph.GraphableModule.of(cls, graphed_alone=False, _tgraph_hf_base=cls)
    return model


class LlamaLM(nn.Module):
    """``LlamaForCausalLM`` with the toy GPT's call: ``(idx, targets) -> (logits, loss)``.

    ``targets`` are the next tokens (already shifted, as the benchmark's batches are); the
    loss is the cross-entropy of fp32 logits, as the toy's. ``h``: the decoder layers.
    """

    def __init__(self, d: dict[str, Any], vocab: int) -> None:
        super().__init__()
        tf = _transformers()
        cfg = tf.LlamaConfig(
            vocab_size=vocab,
            hidden_size=d["n_embd"],
            intermediate_size=4 * d["n_embd"],  # as the toy GPT's MLP
            num_hidden_layers=d["n_layer"],
            num_attention_heads=d["n_head"],
            num_key_value_heads=d["n_head"],
            max_position_embeddings=d["seq"],
            attn_implementation="sdpa",
            use_cache=False,
        )
        self.hf = make_layers_graphable(tf.LlamaForCausalLM(cfg))
        self.vocab = vocab

    @property
    def h(self) -> nn.ModuleList:
        return self.hf.model.layers

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits = self.hf(input_ids=idx, use_cache=False).logits  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return logits, loss


Autocast = Callable[[], contextlib.AbstractContextManager]  # a fresh autocast region per call


def layer_call_sample(model: LlamaLM, idx: torch.Tensor, autocast: Autocast) -> tuple[tuple, dict]:
    """The arguments HF passes to the first decoder layer (one no-grad forward under
    ``autocast``): what the graphed calls of the benchmark look like."""
    seen: list[tuple[tuple, dict]] = []

    def hook(module, args, kwargs):
        if not seen:
            seen.append((args, dict(kwargs)))

    handle = model.h[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad(), autocast():
            model(idx)
    finally:
        handle.remove()
    return seen[0]


class _PositionalLayer(nn.Module):
    """A decoder layer called with positional tensors ``(hidden_states, cos, sin)``."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden_states, cos, sin):
        # the class's forward: the layer's own ``forward`` attribute is replaced below
        return type(self.layer).forward(
            self.layer, hidden_states, attention_mask=None, position_embeddings=(cos, sin)
        )


def _graphed_layer_forward(
    wrapper, hidden_states, attention_mask=None, position_embeddings=None, **_
):
    if attention_mask is not None:
        raise RuntimeError(
            "make_graphed_callables over Llama layers assumes SDPA's causal path (no mask "
            "tensor); this call got an attention mask"
        )
    return wrapper(hidden_states, *position_embeddings)


def make_graphed_layers(model: LlamaLM, idx: torch.Tensor, autocast: Autocast) -> None:
    """``torch.cuda.make_graphed_callables`` over every decoder layer (one call, shared pool),
    with samples shaped like HF's real calls; each layer's ``forward`` then replays."""
    args, kwargs = layer_call_sample(model, idx, autocast)
    h = args[0] if args else kwargs["hidden_states"]
    cos, sin = kwargs["position_embeddings"]
    wrappers = [_PositionalLayer(layer) for layer in model.h]
    samples = tuple(
        (torch.randn_like(h).requires_grad_(), cos.clone(), sin.clone()) for _ in wrappers
    )
    with autocast():
        torch.cuda.make_graphed_callables(tuple(wrappers), samples)
    for layer, w in zip(model.h, wrappers):
        layer.forward = functools.partial(_graphed_layer_forward, w)
