"""Next-token sampling, outside the graph: greedy, temperature and top-k, seeded.

Sampling runs on the logits a decode step returned (a static graph output), so it reads them
before the next replay overwrites them. Random draws come from an explicit ``torch.Generator``:
the same seed, prompts and settings give the same tokens.
"""

from __future__ import annotations

import torch


def check_sampling(temperature: float, top_k: int | None) -> None:
    """Validate sampling settings.

    Raises:
        ValueError: negative temperature or ``top_k < 1``.
    """
    if not temperature >= 0.0:
        raise ValueError(
            f"temperature must be >= 0 (0 = greedy), got {temperature}; pass temperature=0.0 "
            "for greedy decoding"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")


def make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """A generator on ``device``, seeded with ``seed`` (a fresh random seed when None)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set every logit below the k-th largest of its row to -inf. logits: (B, V)."""
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def sample(
    logits: torch.Tensor,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: (B, V) next-token logits.
        temperature: 0 picks the argmax (greedy); otherwise logits are divided by it and a token
            is drawn from the softmax.
        top_k: keep only the k most likely tokens before drawing (ignored when greedy).
        generator: source of randomness for the draw.

    Returns:
        (B,) int64 token ids, on the logits' device.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
