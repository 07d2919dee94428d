"""Tiny Hugging Face models (random weights, built from configs) with graphable decoder layers.

The decoder layers become graphable the way :mod:`tgraph.integrations.megatron` does it for
megatron-core's ``TransformerLayer``: a dynamic subclass with :class:`tgraph.GraphableModule`
first in the MRO (so its ``__call__`` dispatches to tgraph) is swapped onto each layer instance
with ``layer.__class__ = ...``. Nothing is downloaded: no hub exists on the test machines.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import logging as hf_logging
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from tgraph.layers.manager import GraphableModule

hf_logging.set_verbosity_error()  # config notes about unused token ids etc. are noise here

VOCAB = 128
MAX_POS = 64
HIDDEN = 64
HEADS = 4
DECODER_LAYERS = (LlamaDecoderLayer, GPT2Block)


def make_layers_graphable(model: nn.Module) -> nn.Module:
    """Swap every Llama / GPT-2 decoder layer of ``model`` onto its graphable subclass."""
    n = 0
    for m in model.modules():
        if isinstance(m, DECODER_LAYERS) and not isinstance(m, GraphableModule):
            m.__class__ = GraphableModule.of(type(m))
            n += 1
    assert n, f"{type(model).__name__} has no Llama or GPT-2 decoder layer"
    return model


def tiny_llama(device, *, n_layer: int = 2, dropout: float = 0.0, seed: int = 0):
    """LlamaForCausalLM: hidden 64, 4 heads, vocab 128, 64 positions, SDPA attention."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=n_layer,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=MAX_POS,
        attention_dropout=dropout,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).to(device)


def gpt2_config(*, n_layer: int = 2, dropout: float = 0.0, embd_dropout=None, **extra):
    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=MAX_POS,
        n_embd=HIDDEN,
        n_layer=n_layer,
        n_head=HEADS,
        resid_pdrop=dropout,
        attn_pdrop=dropout,
        embd_pdrop=dropout if embd_dropout is None else embd_dropout,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
        **extra,
    )


def tiny_gpt2(device, *, n_layer: int = 2, dropout: float = 0.0, embd_dropout=None, seed: int = 0):
    """GPT2LMHeadModel: hidden 64, 4 heads, vocab 128, 64 positions, SDPA attention."""
    torch.manual_seed(seed)
    cfg = gpt2_config(n_layer=n_layer, dropout=dropout, embd_dropout=embd_dropout)
    return GPT2LMHeadModel(cfg).to(device)


def tiny_model(kind: str, device, **kw):
    return {"llama": tiny_llama, "gpt2": tiny_gpt2}[kind](device, **kw)


def token_batches(device, n: int, *, batch: int = 2, seq: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g).to(device) for _ in range(n)]
