"""Next-token sampling on the device, inside the graphs: greedy, temperature, top-k, top-p.

Every request carries its own random stream, keyed by its seed. The stream is *counter-based*
(the idea of Philox, Salmon et al., SC'11): the random number for token id ``v`` drawn at
position ``p`` of a request is a pure function ``hash(seed_key, p, v)``, computed on the device
from three integers. Nothing else goes in: not the row the request sits in, not the bucket, not
the other requests of the batch, not how many steps ran before. So a seeded request yields the
same tokens in any slot, bucket or company, on the graph and the eager path alike. There is no
generator state to advance or register with a graph: the counter is the position the step reads
from its static inputs anyway.

The draw is the Gumbel-max trick: ``argmax(logits / T + G)`` with ``G = -log(-log(u))`` samples
from ``softmax(logits / T)``; top-k and top-p set the logits outside the kept set to ``-inf``
first. Per row it costs one sort, a cumulative sum and a few elementwise kernels, with no host
sync and no data-dependent shape, so it can be captured.

Integer hashing uses int64 tensors holding 32-bit values; every multiplier is below 2**31 so no
product overflows int64 (no undefined behaviour, the same bits on every device). The same
:func:`mix32` runs on Python ints (seed keys are mixed on the host once per request).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

M32 = 0xFFFFFFFF
_C1, _C2 = 0x21F0AAAD, 0x735A2D97  # odd, < 2**31: (x < 2**32) * C < 2**63
_VOCAB_SALT = 0x9E3779B9  # golden-ratio constant: vocab keys differ from plain indices


def mix32(x):
    """A 32-bit integer mixer (xor-shift-multiply, hash-prospector style) on ints or int64 tensors
    holding values in ``[0, 2**32)``; returns values in the same range. A bijection."""
    x = x ^ (x >> 16)
    x = (x * _C1) & M32
    x = x ^ (x >> 15)
    x = (x * _C2) & M32
    return x ^ (x >> 15)


def seed_key(seed: int) -> int:
    """The 32-bit stream key of a request seed (any Python int; taken modulo 2**64)."""
    s = seed % 2**64
    return mix32(mix32(s & M32) ^ (s >> 32))


@dataclass(frozen=True)
class SamplingRows:
    """Per-row sampling settings on the device, shape (B,) each (views of static buffers).

    ``temperature`` 0 is greedy for that row; ``top_k`` is in ``[1, V]`` (V keeps all);
    ``top_p`` is in ``(0, 1]`` (1 keeps all); ``seed_keys`` are :func:`seed_key` values.
    """

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64
    top_p: torch.Tensor  # float32
    seed_keys: torch.Tensor  # int64


def check_sampling(temperature: float, top_k: int | None, top_p: float, where: str = "") -> None:
    """Validate one request's sampling settings.

    Raises:
        ValueError: a negative or non-finite temperature, ``top_k < 1``, ``top_p`` outside
            ``(0, 1]``; the message starts with ``where`` (e.g. ``"request 3: "``).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"{where}temperature must be a float >= 0, got {temperature!r}")
    if not 0.0 <= temperature < float("inf"):
        raise ValueError(
            f"{where}temperature must be >= 0 (0 = greedy), got {temperature}; pass "
            "temperature=0.0 for greedy decoding"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{where}top_k must be a positive int or None, got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"{where}top_p must be in (0, 1] (1 keeps every token), got {top_p!r}")


def per_request(value, n: int, name: str) -> list:
    """``value`` for each of ``n`` requests: a scalar for all, or a sequence of ``n``.

    Raises:
        ValueError: a sequence of the wrong length.
    """
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} entries for {n} prompts; give one value for all or "
                "one per prompt"
            )
        return list(value)
    return [value] * n


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) logits -> (B,) argmax token ids (the first index on ties)."""
    return logits.argmax(dim=-1)


class Sampler:
    """Samples one token per row from ``(B, V)`` logits; graph-safe.

    Args:
        vocab_size: V.
        device: where the logits live.

    The per-token keys are built once here (a static tensor, outside any graph pool).
    """

    def __init__(self, vocab_size: int, device: torch.device | str) -> None:
        ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
        self.vocab_keys = mix32((ids + _VOCAB_SALT) & M32)  # (V,)

    def noise(self, seed_keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """Gumbel noise (B, V), a pure function of (seed key, counter, token id) per entry."""
        row = mix32(mix32(seed_keys ^ (counters & M32)) ^ seed_keys)  # (B,) stream position
        bits = mix32(row[:, None] ^ self.vocab_keys[None, :])  # (B, V) in [0, 2**32)
        # 23 bits: (m + 0.5) / 2**23 lies strictly inside (0, 1) in float32 (24 bits would
        # round 1 - 2**-25 up to 1.0 and give an infinite Gumbel value).
        u = ((bits >> 9).to(torch.float32) + 0.5) * 2.0**-23
        return -torch.log(-torch.log(u))

    def __call__(
        self, logits: torch.Tensor, rows: SamplingRows, counters: torch.Tensor
    ) -> torch.Tensor:
        """Pick one token per row.

        Args:
            logits: (B, V).
            rows: each row's settings (temperature 0 rows return exactly :func:`greedy`'s id,
                as do rows whose temperature is too small for ``logits / T`` to be finite).
            counters: (B,) int64, the position each row samples at (its stream counter).

        Returns:
            (B,) int64 token ids.
        """
        sampled = rows.temperature > 0
        scaled = logits.float() / torch.where(sampled, rows.temperature, 1.0)[:, None]  # (B, V)
        ranked = scaled.sort(dim=-1, descending=True).values  # (B, V)
        # A temperature so small that the largest logit / T overflows (+-inf: 1e-45 in float32)
        # leaves no distribution to draw from (softmax gives NaN). Its limit is the greedy
        # token: the gap to the next logit, at least one ulp of the largest, over T is then
        # above 1e31, so exp(-gap / T) is 0. Those rows take greedy's id.
        sampled = sampled & ranked[:, 0].isfinite()  # (B,)
        kth = ranked.gather(1, rows.top_k[:, None] - 1)  # (B, 1) k-th largest: ties kept
        probs = torch.softmax(ranked.masked_fill(ranked < kth, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the better-ranked tokens
        # >= 1 (rank 0 has no mass before it); 0 in a NaN row (above, its draw is discarded):
        # clamped so that the gather stays in range
        n_p = (before < rows.top_p[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)
        pth = ranked.gather(1, n_p - 1)  # smallest logit of the nucleus
        pth = pth.masked_fill(rows.top_p[:, None] >= 1.0, float("-inf"))  # top_p 1: no cut
        cut = torch.maximum(kth, pth)
        race = scaled.masked_fill(scaled < cut, float("-inf")) + self.noise(
            rows.seed_keys, counters
        )
        return torch.where(sampled, race.argmax(dim=-1), greedy(logits))
