"""Static inputs of the step programs: token ids, positions, slots, lengths, sampling settings.

A graph reads its inputs from the memory it was captured with, so every input lives here
(mini-sglang's ``GraphCaptureBuffer`` pattern), outside the graphs' memory pool:

* :meth:`DecodeBuffers.set_batch` hands out views of the first ``B`` rows; the decode program
  for bucket ``B`` (captured or eager) runs on those views.
* :meth:`DecodeBuffers.copy_from` refreshes **every** row from a
  :class:`~tgraph.decode.batch.PaddedBatch`: the live rows get the requests' values and all other
  rows the padding values (token 0, position 0, length 1, not live, greedy, their own free KV
  slot). It runs only when the batch changes (a request joins or leaves).
* :meth:`DecodeBuffers.advance` runs *inside* each decode program: the sampled ids become the
  next step's tokens and live rows move one position on. So while the batch does not change the
  host copies nothing to the device between steps; a step launched before the host has read the
  previous step's tokens (lookahead) needs no host values at all.

Layout: the integer rows are one ``(7, max_rows)`` int64 tensor and the two float rows one
``(2, max_rows)`` float32 tensor, so a refresh is two copies. :class:`PrefillBuffers` holds the
same for one prompt of up to ``max_tokens`` tokens, plus the sampled first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgraph.decode.sampling import SamplingRows, seed_key

TOKENS, POSITIONS, SLOTS, LENGTHS, LIVE, SEED_KEYS, TOP_K = range(7)
TEMPERATURE, TOP_P = range(2)


@dataclass(frozen=True)
class StepInputs:
    """What a model's ``decode_step`` reads for ``B`` rows (int64, shape (B,), on its device).

    Row ``i`` decodes token ``tokens[i]`` at ``positions[i]`` of KV slot ``slots[i]`` and attends
    to keys ``0..lengths[i]-1`` of that slot (``lengths = positions + 1``). The engine keeps
    ``slots[i] == i`` (see :class:`~tgraph.decode.kv_cache.KVCache`).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


@dataclass(frozen=True)
class PrefillInputs:
    """What a model's ``prefill`` reads: one prompt padded to a token-count bucket.

    ``tokens`` (T,) int64, positions ``0..T-1``; only the first ``length[0]`` are the prompt,
    the rest is padding (token 0) that causal attention keeps out of the prompt's positions.
    ``length`` and ``slot`` are (1,) int64 tensors, so one captured graph serves every prompt
    length of its bucket and every slot.
    """

    tokens: torch.Tensor
    length: torch.Tensor
    slot: torch.Tensor


def _request_rows(requests: Sequence, vocab_size: int) -> tuple[list[int], list[int], list[float]]:
    keys = [seed_key(r.seed) for r in requests]
    top_k = [vocab_size if r.top_k is None else min(r.top_k, vocab_size) for r in requests]
    return keys, top_k, [float(r.temperature) for r in requests]


def pack_step_rows(
    requests: Sequence, *, max_rows: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host tensors ``(7, max_rows)`` int64 and ``(2, max_rows)`` float32 for a decode batch.

    Row ``i < len(requests)`` is request ``i`` (which must sit in KV slot ``i``), decoding its
    latest token; the rest are padding rows.
    """
    n = len(requests)
    ints = torch.zeros(7, max_rows, dtype=torch.int64)
    floats = torch.zeros(2, max_rows, dtype=torch.float32)
    ints[SLOTS] = torch.arange(max_rows)  # a padding row writes only its own (free) slot
    ints[LENGTHS] = 1  # a padding row attends to the one key it wrote: no all-masked softmax
    ints[TOP_K] = vocab_size
    floats[TOP_P] = 1.0
    if n:
        keys, top_k, temps = _request_rows(requests, vocab_size)
        positions = [r.position for r in requests]
        ints[:, :n] = torch.tensor(
            [
                [r.output[-1] for r in requests],
                positions,
                [r.slot for r in requests],
                [p + 1 for p in positions],
                [1] * n,
                keys,
                top_k,
            ]
        )
        floats[:, :n] = torch.tensor([temps, [r.top_p for r in requests]])
    return ints, floats


def pack_prompt(
    request, *, width: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Host tensors for one prompt: tokens (width,) zero-padded, ints (4,), floats (2,)."""
    T = len(request.prompt)
    tokens = torch.zeros(width, dtype=torch.int64)
    tokens[:T] = torch.tensor(request.prompt)
    keys, top_k, temps = _request_rows([request], vocab_size)
    ints = torch.tensor([request.slot, T, keys[0], top_k[0]], dtype=torch.int64)
    floats = torch.tensor([temps[0], request.top_p], dtype=torch.float32)
    return tokens, ints, floats


def staged_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` from the host without making the host wait for the running step:
    pinned for CUDA (torch's host allocator keeps the pinned block until the copy ends)."""
    if dst.is_cuda:
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


class DecodeBuffers:
    """The static inputs of every decode program.

    Args:
        max_rows: the most rows a step computes (``max_batch_size``).
        vocab_size: V (padding rows keep all V tokens for top-k).
        device: the model's device.

    Ownership: the views returned by :meth:`set_batch` and :meth:`sampling` alias this object's
    memory; :meth:`copy_from` and every decode step (:meth:`advance`) overwrite them.
    """

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        self.ints = torch.zeros(7, max_rows, dtype=torch.int64, device=device)
        self.floats = torch.zeros(2, max_rows, dtype=torch.float32, device=device)
        self.reset()

    @property
    def tokens(self) -> torch.Tensor:
        return self.ints[TOKENS]

    @property
    def positions(self) -> torch.Tensor:
        return self.ints[POSITIONS]

    def set_batch(self, rows: int) -> StepInputs:
        """Views of the first ``rows`` rows: what the program for bucket ``rows`` reads."""
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows must be in [1, {self.max_rows}], got {rows}")
        i = self.ints[:, :rows]
        return StepInputs(i[TOKENS], i[POSITIONS], i[SLOTS], i[LENGTHS])

    def sampling(self, rows: int) -> SamplingRows:
        """Sampling settings of the first ``rows`` rows (views)."""
        i, f = self.ints[:, :rows], self.floats[:, :rows]
        return SamplingRows(f[TEMPERATURE], i[TOP_K], f[TOP_P], i[SEED_KEYS])

    def live(self, rows: int) -> torch.Tensor:
        """(rows,) int64: 1 for a request's row, 0 for a padding row."""
        return self.ints[LIVE, :rows]

    def reset(self) -> None:
        """Every row a padding row (before warmup and capture: they write only free slots)."""
        ints, floats = pack_step_rows([], max_rows=self.max_rows, vocab_size=self.vocab_size)
        self.copy_from(ints, floats)

    def copy_from(self, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Refresh all rows from host tensors made by :func:`pack_step_rows`."""
        staged_copy(self.ints, ints)
        staged_copy(self.floats, floats)

    @staticmethod
    def advance(inputs: StepInputs, live: torch.Tensor, tokens: torch.Tensor) -> None:
        """Inside a decode program: hand the sampled ids to the next step on the device.

        The sampled ids become the next tokens, live rows move one position on; padding rows
        stay at position 0 of their own slot.
        """
        inputs.tokens.copy_(tokens)
        inputs.positions.add_(live)
        inputs.lengths.add_(live)


class PrefillBuffers:
    """The static inputs of every prefill program, and the token it samples.

    Args:
        max_tokens: the longest prompt (``max_seq_len``).
        vocab_size: V.
        device: the model's device.

    Ownership: :attr:`token` (1,) holds the latest prefill's sampled first token; it lives
    outside the graph pool (a later replay of another graph cannot overwrite it) and the next
    prefill overwrites it.
    """

    def __init__(self, max_tokens: int, vocab_size: int, device: torch.device | str) -> None:
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.tokens = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.ints = torch.tensor([0, 1, 0, vocab_size], dtype=torch.int64, device=device)
        self.floats = torch.tensor([0.0, 1.0], dtype=torch.float32, device=device)
        self.token = torch.zeros(1, dtype=torch.int64, device=device)

    def reset(self) -> None:
        """A one-token greedy prompt in slot 0 (before warmup and capture: every bucket's
        program indexes its last position, ``length - 1``, within its width; a re-capture
        after a longer prompt would otherwise index past the smallest buckets)."""
        self.ints.copy_(torch.tensor([0, 1, 0, self.vocab_size]))
        self.floats.copy_(torch.tensor([0.0, 1.0]))

    def inputs(self, width: int) -> PrefillInputs:
        """Views for a prompt padded to ``width`` tokens."""
        return PrefillInputs(self.tokens[:width], self.ints[1:2], self.ints[0:1])

    def sampling(self) -> SamplingRows:
        return SamplingRows(self.floats[0:1], self.ints[3:4], self.floats[1:2], self.ints[2:3])

    def copy_from(self, tokens: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Refresh from host tensors made by :func:`pack_prompt` (only ``len(tokens)`` tokens;
        the program for that width reads no further)."""
        staged_copy(self.tokens[: tokens.shape[0]], tokens)
        staged_copy(self.ints, ints)
        staged_copy(self.floats, floats)
