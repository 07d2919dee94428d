"""The hand-written baseline of the decode benchmark (scripts/bench_decode.py): a static-KV decode
step of the toy GPT (:class:`StaticKV`), run eagerly or captured by hand in one graph
(:class:`HandStep`)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from bench_common import synchronize

from tgraph.backend import GraphFactory
from tgraph.toy.gpt import GPT


class StaticKV:
    """A preallocated KV cache for ``batch`` rows plus static token/position buffers.

    ``step()`` reads only ``tokens`` (B,), ``pos`` (B,) and the cache, writes this step's k/v at
    ``pos`` and returns logits (B, V): a function a CUDA graph can capture as is.
    """

    def __init__(self, model: GPT, batch: int, max_seq: int) -> None:
        cfg, p = model.config, next(model.parameters())
        self.model, self.batch, self.max_seq = model, batch, max_seq
        hs = cfg.n_embd // cfg.n_head
        shape = (cfg.n_layer, batch, cfg.n_head, max_seq, hs)
        self.k = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.v = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.rows = torch.arange(batch, device=p.device)
        self.slots = torch.arange(max_seq, device=p.device)
        self.active = torch.ones(batch, dtype=torch.bool, device=p.device)

    @torch.no_grad()
    def prefill_row(self, row: int, prompt: list[int]) -> None:
        """Run ``prompt`` through the model (eager), fill row ``row``'s cache, set its next token."""
        m, T = self.model, len(prompt)
        idx = torch.tensor(prompt, device=self.tokens.device)
        x = m.wte(idx)[None] + m.wpe(self.slots[:T])[None]  # (1, T, C)
        for layer, block in enumerate(m.h):
            q, k, v = block.attn.split_heads(block.ln_1(x))  # (1, nh, T, hs)
            self.k[layer, row, :, :T] = k[0]
            self.v[layer, row, :, :T] = v[0]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(1, T, -1))
            x = x + block.mlp(block.ln_2(x))
        logits = m.lm_head(m.ln_f(x[:, -1]))  # (1, V)
        self.tokens[row] = logits.argmax(-1)[0]
        self.pos[row] = T

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        m, B = self.model, self.batch
        x = (m.wte(self.tokens) + m.wpe(self.pos))[:, None]  # (B, 1, C)
        mask = (self.slots[None, :] <= self.pos[:, None])[:, None, None, :]  # (B, 1, 1, S)
        for layer, block in enumerate(m.h):
            q, k, v = block.attn.split_heads(block.ln_1(x))  # (B, nh, 1, hs)
            self.k[layer][self.rows, :, self.pos] = k[:, :, 0]  # (B, nh, hs) at each row's pos
            self.v[layer][self.rows, :, self.pos] = v[:, :, 0]
            y = F.scaled_dot_product_attention(q, self.k[layer], self.v[layer], attn_mask=mask)
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, 1, -1))
            x = x + block.mlp(block.ln_2(x))
        return m.lm_head(m.ln_f(x))[:, 0]  # (B, V)

    def advance(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling outside the graph; idle rows park at position 0 of their own row."""
        nxt = logits.argmax(-1)
        self.tokens.copy_(nxt)
        self.pos.copy_(torch.where(self.active, self.pos + 1, 0))
        return nxt


class HandStep:
    """``StaticKV.step`` run eagerly, or captured once and replayed (CUDA or emulated graph)."""

    def __init__(self, kv: StaticKV, graphed: bool, device: torch.device) -> None:
        self.kv, self.graph, self.capture_s = kv, None, None
        if not graphed:
            return
        factory = GraphFactory("cuda" if device.type == "cuda" else "emulated", device)
        synchronize(device)
        t0 = time.perf_counter()
        with factory.side_stream():
            for _ in range(2):  # warmup (cuBLAS handles, SDPA kernel selection)
                kv.step()
        pos, tokens = kv.pos.clone(), kv.tokens.clone()
        self.graph = factory.new_graph()
        with factory.side_stream():
            self.logits = self.graph.capture(kv.step)
        kv.pos.copy_(pos)  # the emulated capture ran the step once; its k/v write is redone
        kv.tokens.copy_(tokens)
        synchronize(device)
        self.capture_s = time.perf_counter() - t0

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.kv.step()
        self.graph.replay()
        return self.logits
