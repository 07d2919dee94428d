"""Pad once: the one padded batch (or prompt) that the graph and the eager path both run.

mini-sglang pads a batch once, with dummy rows, and hands the same padded batch to the graph
runner and to the eager forward. Here :func:`pad_batch` and :func:`pad_prompt` are the only
places that choose a bucket and build padding; the engine copies the result into the static
buffers and then either replays the graph of ``key`` or calls the very same program eagerly
(``use_graphs=False``, or a size above the largest bucket). So both paths see the same rows,
shapes and kernels, which is why greedy decode through graphs equals eager decode bitwise.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tgraph.decode.buffers import pack_prompt, pack_step_rows
from tgraph.decode.requests import Request, as_int


def default_buckets(max_batch_size: int) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then every 8 up to ``max_batch_size``, which is included."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def default_prefill_buckets(max_seq_len: int) -> list[int]:
    """Prefill token-count buckets: 16, 32, 64, ... up to ``min(max_seq_len, 512)``.

    Longer prompts run eagerly: a prefill graph pays off while launch overhead dominates, and
    beyond a few hundred tokens the kernels themselves dominate (and padding costs real work).
    """
    sizes, b = [], 16
    while b <= min(max_seq_len, 512):
        sizes.append(b)
        b *= 2
    if not sizes or (max_seq_len < 512 and sizes[-1] < max_seq_len):
        sizes.append(min(max_seq_len, 512))
    return sizes


def check_buckets(sizes: Sequence[int], largest: int, name: str) -> list[int]:
    """Sorted unique bucket sizes, each an int in ``[1, largest]`` (an empty list is allowed:
    no graphs of that kind).

    Raises:
        ValueError: a size that is not an int in range; the message names ``name``.
    """
    ints = [as_int(b) for b in sizes]
    for b, i in zip(sizes, ints):
        if i is None or not 1 <= i <= largest:
            raise ValueError(f"{name} entry {b!r} must be an int in [1, {largest}]")
    return sorted(set(ints))


def bucket_for(buckets: Sequence[int], n: int) -> int | None:
    """Smallest bucket that holds ``n``; None when ``n`` exceeds the largest (or no buckets)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass(frozen=True)
class PaddedBatch:
    """A decode batch padded to its bucket: what the buffers hold while the batch runs.

    Row ``i`` is ``requests[i]`` (in KV slot ``i``); rows ``n..width-1`` are padding.
    """

    requests: tuple[Request, ...]
    width: int
    """Rows computed: the bucket, or ``n`` above the largest bucket (eager, unpadded)."""
    graphed: bool
    """``width`` is a bucket (a graph exists when graphs are on)."""
    sampling: bool
    """Some row samples (temperature > 0): the sampling variant of the program runs."""
    room: int
    """Steps this batch can run before a request reaches its ``max_new_tokens``."""
    ints: torch.Tensor
    floats: torch.Tensor

    @property
    def n(self) -> int:
        return len(self.requests)

    @property
    def key(self) -> tuple[int, bool]:
        """Which program runs it: (rows, sampling)."""
        return self.width, self.sampling


def pad_batch(
    requests: Sequence[Request],
    *,
    buckets: Sequence[int],
    max_rows: int,
    vocab_size: int,
    max_seq_len: int,
) -> PaddedBatch:
    """Pad ``requests`` (request ``i`` in KV slot ``i``) to the smallest bucket that holds them.

    Raises:
        ValueError: more requests than ``max_rows``, a request not in the slot of its row, or a
            position at or past ``max_seq_len`` (no KV room left).
    """
    n = len(requests)
    if not 1 <= n <= max_rows:
        raise ValueError(f"a decode batch holds 1..{max_rows} requests, got {n}")
    for i, r in enumerate(requests):
        if r.slot != i:
            raise ValueError(f"request {r.index} is in KV slot {r.slot} but row {i}; rows == slots")
        if r.position >= max_seq_len:
            raise ValueError(
                f"request {r.index} decodes at position {r.position}: max_seq_len={max_seq_len} "
                "leaves the KV cache no room for it (it decoded past prompt + max_new_tokens)"
            )
    bucket = bucket_for(buckets, n)
    ints, floats = pack_step_rows(requests, max_rows=max_rows, vocab_size=vocab_size)
    return PaddedBatch(
        requests=tuple(requests),
        width=n if bucket is None else bucket,
        graphed=bucket is not None,
        sampling=any(r.temperature > 0 for r in requests),
        room=min(r.max_new_tokens - len(r.output) for r in requests),
        ints=ints,
        floats=floats,
    )


@dataclass(frozen=True)
class PaddedPrompt:
    """One prompt padded to its token-count bucket (token 0 after the prompt)."""

    request: Request
    width: int
    graphed: bool
    sampling: bool
    tokens: torch.Tensor
    ints: torch.Tensor
    floats: torch.Tensor

    @property
    def key(self) -> tuple[int, bool]:
        return self.width, self.sampling


def pad_prompt(request: Request, *, buckets: Sequence[int], vocab_size: int) -> PaddedPrompt:
    """Pad ``request``'s prompt to the smallest prefill bucket that holds it (or not at all
    above the largest)."""
    T = len(request.prompt)
    bucket = bucket_for(buckets, T)
    width = T if bucket is None else bucket
    tokens, ints, floats = pack_prompt(request, width=width, vocab_size=vocab_size)
    return PaddedPrompt(
        request, width, bucket is not None, request.temperature > 0, tokens, ints, floats
    )
