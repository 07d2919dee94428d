"""KV-cache prefill and decode step for the toy GPT, reusing its own submodules and weights.

:class:`GPTDecoder` implements :class:`tgraph.decode.interface.DecodeModel` for
:class:`tgraph.toy.gpt.GPT` without changing the model: it calls ``wte``, ``wpe``, each
block's ``ln_1``, ``attn.split_heads`` (``c_attn``), ``attn.c_proj``, ``ln_2``, ``mlp``, then
``ln_f`` and ``lm_head``, exactly as ``GPT.forward`` does, but attends to cached keys and values
instead of recomputing the whole sequence. Dropout is skipped: the model is in eval mode while
the engine runs it (:attr:`GPTDecoder.serving`) and gets its own mode back afterwards, so a model
sampled from between training steps keeps training with dropout (and its per-layer graphs).

Registered as the :func:`~tgraph.decode.interface.as_decode_model` adapter of ``GPT``, so
``DecodeEngine(gpt, ...)`` serves the toy model directly; the interface itself knows no model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tgraph.decode.buffers import PrefillInputs, StepInputs
from tgraph.decode.interface import ServedInEval, as_decode_model, refuse_own_forward
from tgraph.decode.kv_cache import KVCache
from tgraph.toy import gpt as gpt_model


class GPTDecoder:
    """Serve a :class:`~tgraph.toy.gpt.GPT` through the decode interface.

    Args:
        model: the GPT; in eval mode (dropout off) inside :attr:`serving`, its own mode outside.
            Its weights are used in place, so later weight updates are seen by the decoder
            (reallocated ones, by a sync or ``model.to(dtype)``, are followed by the engine's
            weight check; to move the model to another device, build a new engine).
    """

    def __init__(self, model: gpt_model.GPT) -> None:
        cfg = model.config
        self.model = model
        # serving(): eval mode while the engine captures or generates, its own mode after
        self.serving = ServedInEval(model)
        self.n_layer = cfg.n_layer
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.vocab_size = cfg.vocab_size
        self.max_positions = cfg.block_size
        self.device = model.wte.weight.device
        self.called_modules()  # raises: a forward it would bypass

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype now: the KV cache follows a ``model.to(dtype)`` at re-capture."""
        return self.model.wte.weight.dtype

    def called_modules(self) -> list[torch.nn.Module]:
        """The modules :meth:`prefill` and :meth:`decode_step` call, whose forward and hooks
        run: ``wte``, ``wpe``, each block's norms, ``attn.c_attn`` (through ``split_heads``),
        ``attn.c_proj`` and ``mlp``, ``ln_f`` and ``lm_head``; never the model's, a block's or
        its attention's forward, so the engine refuses hooks there (:mod:`tgraph.decode.hooks`,
        which asks again after any change to the module tree).

        Raises:
            TypeError: one of those bypassed modules runs a forward of its own (a subclass's,
                one set on the instance): it would silently not run.
        """
        m = self.model
        bypassed = [m, *m.h, *(block.attn for block in m.h)]
        refuse_own_forward(m, bypassed, stock=gpt_model.__name__)
        out = [m.wte, m.wpe, m.ln_f, m.lm_head]
        for block in m.h:
            out += [block.ln_1, block.attn.c_attn, block.attn.c_proj, block.ln_2, block.mlp]
        return out

    @staticmethod
    def encode(text: str) -> list[int]:
        """Byte tokenizer of the toy GPT."""
        return gpt_model.encode(text)

    @staticmethod
    def decode(ids: list[int]) -> str:
        """Inverse of :meth:`encode`."""
        return gpt_model.decode(ids)

    @torch.no_grad()
    def prefill(self, inputs: PrefillInputs, cache: KVCache) -> torch.Tensor:
        """Run the padded prompt, store its keys/values in its slot; return the logits of its
        last real position (1, V). Graph-safe: causal attention keeps the padding out."""
        m = self.model
        T = inputs.tokens.shape[0]
        x = (m.wte(inputs.tokens) + m.wpe(cache.key_positions[:T]))[None]  # (1, T, C)
        C = x.shape[-1]
        for layer, block in enumerate(m.h):
            q, k, v = block.attn.split_heads(block.ln_1(x))  # (1, nh, T, hs)
            cache.write_prefill(layer, inputs.slot, k[0], v[0])
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (1, nh, T, hs)
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(1, T, C))
            x = x + block.mlp(block.ln_2(x))
        last = x[0].index_select(0, inputs.length - 1)  # (1, C): the prompt's last position
        return m.lm_head(m.ln_f(last))  # (1, V)

    @torch.no_grad()
    def decode_step(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """One token per row against the cache; returns logits (B, V). Graph-safe."""
        m = self.model
        B = inputs.rows
        x = (m.wte(inputs.tokens) + m.wpe(inputs.positions))[:, None]  # (B, 1, C)
        C = x.shape[-1]
        # Row i sees keys 0..lengths[i]-1 of its slot; stale keys past that are masked out.
        mask = cache.key_positions[None, :] < inputs.lengths[:, None]  # (B, S)
        mask = mask[:, None, None, :]  # (B, 1, 1, S), broadcast over heads and the query
        for layer, block in enumerate(m.h):
            q, k, v = block.attn.split_heads(block.ln_1(x))  # (B, nh, 1, hs)
            cache.write_step(layer, inputs.slots, inputs.positions, k[:, :, 0], v[:, :, 0])
            keys, values = cache.read(layer, B)  # (B, nh, S, hs), views of slots 0..B-1
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # (B, nh, 1, hs)
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, 1, C))
            x = x + block.mlp(block.ln_2(x))
        return m.lm_head(m.ln_f(x[:, 0]))  # (B, V)


@as_decode_model.register
def _(model: gpt_model.GPT) -> GPTDecoder:
    return GPTDecoder(model)
