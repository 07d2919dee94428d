"""The step programs (what one decode step and one prefill run on the device) and the token
read-back (how their sampled ids reach the host).

A program is built once per key and closes over views of the static buffers, so its graph and
its eager run read and write exactly the same memory:

* decode, ``(B, sampling)``: the model's ``decode_step`` on rows ``0..B-1``, then the sampled
  ids (greedy argmax, or :class:`~tgraph.decode.sampling.Sampler` when ``sampling``), then
  :meth:`~tgraph.decode.buffers.DecodeBuffers.advance` (the ids become the next inputs).
* prefill, ``(T, sampling)``: the model's ``prefill`` of a prompt padded to ``T`` tokens, then
  the first token, written to :attr:`~tgraph.decode.buffers.PrefillBuffers.token`.

Greedy batches run the greedy variant: the sampling kernels (a sort, a cumulative sum, the
counter-based noise, about 40 small kernels) cost nothing when no row samples. In the sampling
variant a greedy row still gets exactly :func:`~tgraph.decode.sampling.greedy`'s id.

Both run with autocast off on the model's device: the engine serves the model in its own dtype
(its KV cache's), so a ``generate`` under ``torch.autocast`` decodes the tokens it decodes
outside, graphed or eager (to serve in bfloat16, ``model.to(torch.bfloat16)``). Both run
tgraph's graphable modules as plain modules (a decoder may call a block that per-layer
graphs are enabled on: the program is its own graph, and its calls are no training call to
record or replay). Both write their results into buffers outside the graph pool and return the logits only for
inspection; the logits are overwritten by the next replay of any graph of the pool.
"""

from __future__ import annotations

import torch

from tgraph.decode.buffers import DecodeBuffers, PrefillBuffers
from tgraph.decode.interface import DecodeModel
from tgraph.decode.kv_cache import KVCache
from tgraph.decode.sampling import Sampler, greedy
from tgraph.layers.capture import graphed_region


def decode_program(
    decoder: DecodeModel,
    cache: KVCache,
    buffers: DecodeBuffers,
    sampler: Sampler,
    rows: int,
    sampling: bool,
):
    """The decode step of ``rows`` rows as a no-argument callable returning logits (B, V)."""
    inputs = buffers.set_batch(rows)
    params = buffers.sampling(rows)
    live = buffers.live(rows)
    device_type = cache.k.device.type

    def step() -> torch.Tensor:
        # graphable modules it calls: plain modules; the model's own dtype (module docstring)
        with torch.no_grad(), graphed_region(), torch.autocast(device_type, enabled=False):
            logits = decoder.decode_step(inputs, cache)
            if sampling:  # counter: the position this row samples at
                tokens = sampler(logits, params, inputs.positions)
            else:
                tokens = greedy(logits)
            buffers.advance(inputs, live, tokens)
        return logits

    return step


def prefill_program(
    decoder: DecodeModel,
    cache: KVCache,
    buffers: PrefillBuffers,
    sampler: Sampler,
    width: int,
    sampling: bool,
):
    """The prefill of a prompt padded to ``width`` tokens, returning logits (1, V)."""
    inputs = buffers.inputs(width)
    params = buffers.sampling()
    device_type = cache.k.device.type

    def run() -> torch.Tensor:
        with torch.no_grad(), graphed_region(), torch.autocast(device_type, enabled=False):
            logits = decoder.prefill(inputs, cache)
            if sampling:  # counter: the prompt's last position, where its first token is drawn
                token = sampler(logits, params, inputs.length - 1)
            else:
                token = greedy(logits)
            buffers.token.copy_(token)
        return logits

    return run


class PendingTokens:
    """One step's sampled ids on their way to the host."""

    def __init__(self, host: torch.Tensor, event) -> None:
        self.host = host
        self.event = event

    def read(self) -> list[int]:
        """The ids; waits for this step only (not for a step launched after it)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class TokenReadback:
    """Copies sampled ids to the host without making it wait: a ring of ``depth`` preallocated
    pinned buffers and events (no pinned allocation or event creation per step).

    The copy is issued right after the step, before any later replay: it reads the static
    token buffer (outside the pool) in stream order, so a step launched ahead cannot overwrite
    what the host reads. At most ``depth`` steps may await their read.
    """

    def __init__(self, rows: int, device: torch.device, depth: int = 2) -> None:
        cuda = device.type == "cuda"
        self.host = [torch.zeros(rows, dtype=torch.int64, pin_memory=cuda) for _ in range(depth)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(depth)]
        self.pending: list[PendingTokens | None] = [None] * depth
        self.next = 0

    def copy(self, tokens: torch.Tensor) -> PendingTokens:
        """Start copying ``tokens`` (n,) to the host."""
        i = self.next
        self.next = (i + 1) % len(self.host)
        assert self.pending[i] is None, "more steps in flight than read-back buffers"
        host = self.host[i][: tokens.shape[0]]
        host.copy_(tokens, non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()
        self.pending[i] = PendingTokens(host, self.events[i])
        return self.pending[i]

    def read(self, pending: PendingTokens) -> list[int]:
        """The ids of ``pending``; frees its buffer."""
        ids = pending.read()
        self.pending[self.pending.index(pending)] = None
        return ids
