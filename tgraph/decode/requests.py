"""Generation requests: turning user prompts into validated :class:`Request` objects.

Every check runs before any work starts, so a bad request never leaves half-finished generation
behind. Errors name the request index, what was wrong and how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

Prompt = str | Sequence[int] | torch.Tensor


@dataclass
class Request:
    """One prompt being served. ``output`` grows by one token per step until the request ends."""

    index: int
    """Position of the prompt in the ``generate`` call."""
    prompt: list[int]
    max_new_tokens: int
    is_text: bool
    """The prompt was a string: the completion is returned as text."""
    output: list[int] = field(default_factory=list)
    slot: int = -1
    """KV slot while running; -1 while waiting or finished."""

    @property
    def position(self) -> int:
        """Position of the latest token, the one the next decode step feeds in."""
        return len(self.prompt) + len(self.output) - 1

    def append(self, token: int, eos_token_id: int | None) -> bool:
        """Add a generated token; return True when the request is finished."""
        self.output.append(token)
        return len(self.output) >= self.max_new_tokens or token == eos_token_id


def _as_ids(i: int, prompt: Prompt, encode: Callable[[str], list[int]] | None) -> list[int]:
    if isinstance(prompt, str):
        if encode is None:
            raise TypeError(
                f"request {i}: text prompt given, but the model has no encode(text) tokenizer; "
                "pass token-id lists instead"
            )
        return list(encode(prompt))
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(
                f"request {i}: a tensor prompt must be 1-D (T,), got shape {tuple(prompt.shape)}"
            )
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, Sequence):
        raise TypeError(
            f"request {i}: a prompt is a string or a list of token ids, got {type(prompt).__name__}"
        )
    ids = list(prompt)
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(
                f"request {i}: token {j} is {t!r} ({type(t).__name__}); token ids must be ints"
            )
    return ids


def make_requests(
    prompts: Sequence[Prompt],
    max_new_tokens: int | Sequence[int],
    *,
    vocab_size: int,
    max_seq_len: int,
    max_positions: int,
    encode: Callable[[str], list[int]] | None = None,
) -> list[Request]:
    """Validate ``prompts`` and ``max_new_tokens`` and build one :class:`Request` each.

    Args:
        prompts: a list of prompts, each a string or a list (or 1-D tensor) of token ids.
        max_new_tokens: one limit for all requests, or one per request.
        vocab_size: valid token ids are ``0..vocab_size-1``.
        max_seq_len: the engine's KV capacity per request (prompt + new tokens).
        max_positions: the model's longest sequence (engine limit, for the error message).
        encode: tokenizer for text prompts.

    Returns:
        The requests, in prompt order.

    Raises:
        TypeError: ``prompts`` is not a list of prompts (e.g. one bare string or a flat id list).
        ValueError: an empty prompt, a token id outside the vocabulary, a prompt length plus
            ``max_new_tokens`` above ``max_seq_len``, a negative ``max_new_tokens``, or a
            ``max_new_tokens`` list of the wrong length.
    """
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a list of prompts, got {type(prompts).__name__}; wrap a single "
            "prompt in a list: generate([prompt], ...)"
        )
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise TypeError(
            "prompts is a flat list of ints; it must be a list of prompts. Wrap one token-id "
            "prompt in a list: generate([ids], ...)"
        )
    if isinstance(max_new_tokens, int):
        limits = [max_new_tokens] * len(prompts)
    else:
        limits = list(max_new_tokens)
        if len(limits) != len(prompts):
            raise ValueError(
                f"max_new_tokens has {len(limits)} entries for {len(prompts)} prompts; give one "
                "int for all or one per prompt"
            )
    requests = []
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"request {i}: max_new_tokens must be an int >= 0, got {limit!r}")
        ids = _as_ids(i, prompt, encode)
        if not ids:
            raise ValueError(
                f"request {i}: empty prompt; give at least one token (e.g. a newline or a BOS "
                "token) to condition on"
            )
        bad = [(j, t) for j, t in enumerate(ids) if not 0 <= t < vocab_size]
        if bad:
            j, t = bad[0]
            raise ValueError(
                f"request {i}: token id {t} at position {j} is outside the vocabulary "
                f"[0, {vocab_size}); {len(bad)} such token(s). Tokenize with the model's tokenizer"
            )
        if len(ids) + limit > max_seq_len:
            raise ValueError(
                f"request {i}: prompt of {len(ids)} tokens + max_new_tokens {limit} = "
                f"{len(ids) + limit} exceeds max_seq_len {max_seq_len}; shorten the prompt, lower "
                f"max_new_tokens, or build the engine with a larger max_seq_len (at most the "
                f"model's {max_positions} positions)"
            )
        requests.append(Request(i, ids, limit, isinstance(prompt, str)))
    return requests
