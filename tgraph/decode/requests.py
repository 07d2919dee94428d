"""Generation requests: turning user prompts into validated :class:`Request` objects.

Every check runs before any work starts, so a bad request never leaves half-finished generation
behind. Errors name the request index, what was wrong and how to fix it.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from tgraph.decode.sampling import check_sampling, per_request

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
    """KV slot while running (the engine keeps slot == row of the batch); -1 otherwise."""
    temperature: float = 0.0
    """0 is greedy; otherwise sample from softmax(logits / temperature)."""
    top_k: int | None = None
    top_p: float = 1.0
    seed: int = 0
    """Seed of this request's own random stream (:mod:`tgraph.decode.sampling`)."""

    @property
    def position(self) -> int:
        """Position of the latest token, the one the next decode step feeds in."""
        return len(self.prompt) + len(self.output) - 1

    def append(self, token: int, eos: frozenset[int]) -> bool:
        """Add a generated token; return True when the request is finished (its token budget
        reached, or an end-of-sequence token in ``eos``)."""
        self.output.append(token)
        return len(self.output) >= self.max_new_tokens or token in eos


def _is_bool(value: object) -> bool:
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")


def as_int(value: object) -> int | None:
    """``value`` as a Python int when it is an integral scalar: an int, a numpy integer, a 0-d
    integer tensor or array (``operator.index``); None for anything else, bools included."""
    if type(value) is int:
        return value
    if _is_bool(value) or getattr(value, "ndim", 0) != 0:
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def as_real(value: object) -> float | None:
    """``value`` as a Python float when it is a real scalar: an int, a float, a numpy number, a
    0-d real tensor; None for anything else, bools and complex numbers included."""
    if _is_bool(value) or getattr(value, "ndim", 0) != 0:
        return None
    if isinstance(value, torch.Tensor):
        return None if value.is_complex() else float(value)
    return float(value) if isinstance(value, numbers.Real) else None


def _scalar(value: object) -> bool:
    """One value, not one per request: not iterable, or a 0-d tensor or array."""
    return not isinstance(value, Iterable) or getattr(value, "ndim", None) == 0


def eos_ids(eos_token_id: object, vocab_size: int) -> frozenset[int]:
    """The end-of-sequence ids of ``eos_token_id``: None, one id, or a list (or 1-D tensor) of
    ids, each an integral scalar (:func:`as_int`) in the vocabulary.

    Raises:
        ValueError: an entry that is not an integral scalar, or outside ``[0, vocab_size)``.
    """
    if eos_token_id is None:
        return frozenset()
    entries = [eos_token_id] if _scalar(eos_token_id) else eos_token_id
    ids = []
    for entry in entries:
        token = as_int(entry)
        if token is None:
            raise ValueError(
                f"eos_token_id must be an int token id, a list of them or None, got {entry!r}"
            )
        if not 0 <= token < vocab_size:
            raise ValueError(f"eos_token_id {token} is outside the vocabulary [0, {vocab_size})")
        ids.append(token)
    return frozenset(ids)


def _as_ids(i: int, prompt: Prompt, encode: Callable[[str], list[int]] | None) -> list[int]:
    if isinstance(prompt, str):
        if encode is None:
            raise TypeError(
                f"request {i}: text prompt given, but the model has no encode(text) tokenizer; "
                "pass token-id lists instead"
            )
        return list(encode(prompt))
    if type(prompt).__module__ == "numpy" and getattr(prompt, "ndim", 0) >= 1:
        prompt = torch.from_numpy(prompt)  # an array of ids: as a tensor prompt (no copy)
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise ValueError(
                f"request {i}: a tensor prompt must be 1-D (T,), got shape {tuple(prompt.shape)}"
            )
        if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
            raise ValueError(
                f"request {i}: a tensor prompt holds token ids, an integer dtype, got "
                f"{prompt.dtype}; pass the ids as an integer tensor (e.g. torch.long)"
            )
        return prompt.tolist()
    if not isinstance(prompt, Sequence):
        raise TypeError(
            f"request {i}: a prompt is a string or a list of token ids, got {type(prompt).__name__}"
        )
    ids = list(prompt)
    for j, t in enumerate(ids):
        token = as_int(t)
        if token is None:
            raise ValueError(
                f"request {i}: token {j} is {t!r} ({type(t).__name__}); token ids must be ints"
            )
        ids[j] = token
    return ids


def _or_same(convert: Callable[[object], object | None], value: object) -> object:
    converted = convert(value)
    return value if converted is None else converted


def make_requests(
    prompts: Sequence[Prompt],
    max_new_tokens: int | Sequence[int],
    *,
    vocab_size: int,
    max_seq_len: int,
    max_positions: int,
    encode: Callable[[str], list[int]] | None = None,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | None | Sequence[int | None] = None,
    top_p: float | Sequence[float] = 1.0,
    seed: int | Sequence[int] | None = None,
) -> list[Request]:
    """Validate ``prompts`` and ``max_new_tokens`` and build one :class:`Request` each.

    Args:
        prompts: a list of prompts, each a string or a list (or 1-D tensor) of token ids.
        max_new_tokens: one limit for all requests, or one per request.
        vocab_size: valid token ids are ``0..vocab_size-1``.
        max_seq_len: the engine's KV capacity per request (prompt + new tokens).
        max_positions: the model's longest sequence (engine limit, for the error message).
        encode: tokenizer for text prompts.
        temperature: one value for all requests or one per request (same for the next three).
        top_k: keep only the k most likely tokens (None keeps all).
        top_p: keep the smallest set of most likely tokens whose mass reaches p (1 keeps all).
        seed: an int seeds request ``i`` with ``seed + i`` (so ``generate([p], seed=s + i)``
            reproduces request ``i`` alone); a list gives each request its seed; None draws the
            seeds from torch's default generator (``torch.manual_seed`` makes them repeatable)
            when some request samples, and leaves it untouched when every request is greedy.

    Where an int is expected (token ids, ``max_new_tokens``, ``top_k``, ``seed``) a numpy
    integer or a 0-d integer tensor is taken as that int; where a float is expected
    (``temperature``, ``top_p``) any real scalar.

    Returns:
        The requests, in prompt order.

    Raises:
        TypeError: ``prompts`` is not a list of prompts (e.g. one bare string or a flat id list).
        ValueError: an empty prompt, a token id outside the vocabulary, a tensor prompt of
            floats, a prompt length plus ``max_new_tokens`` above ``max_seq_len``, a negative
            ``max_new_tokens``, or a ``max_new_tokens`` list of the wrong length, bad sampling
            settings.
    """
    if isinstance(prompts, (str, torch.Tensor)) or not isinstance(prompts, Sequence):
        raise TypeError(
            f"prompts must be a list of prompts, got {type(prompts).__name__}; wrap a single "
            "prompt in a list: generate([prompt], ...)"
        )
    if prompts and all(as_int(p) is not None for p in prompts):
        raise TypeError(
            "prompts is a flat list of ints; it must be a list of prompts. Wrap one token-id "
            "prompt in a list: generate([ids], ...)"
        )
    if _scalar(max_new_tokens):
        limits = [max_new_tokens] * len(prompts)  # an int (or a bad value, named below)
    else:
        limits = list(max_new_tokens)
        if len(limits) != len(prompts):
            raise ValueError(
                f"max_new_tokens has {len(limits)} entries for {len(prompts)} prompts; give one "
                "int for all or one per prompt"
            )
    n = len(prompts)
    temps = per_request(temperature, n, "temperature")
    ks = per_request(top_k, n, "top_k")
    ps = per_request(top_p, n, "top_p")
    for i in range(n):  # numpy and 0-d tensor scalars as Python numbers; others named below
        temps[i] = _or_same(as_real, temps[i])
        ks[i] = _or_same(as_int, ks[i])
        ps[i] = _or_same(as_real, ps[i])
        check_sampling(temps[i], ks[i], ps[i], where=f"request {i}: ")
    if seed is None:
        # Only sampling reads a seed: a greedy call leaves torch's generator as it found it.
        sampling = any(t > 0 for t in temps)
        seeds = torch.randint(0, 2**62, (n,)).tolist() if sampling else [0] * n
    elif as_int(seed) is not None:
        seeds = [as_int(seed) + i for i in range(n)]
    else:
        seeds = per_request(seed, n, "seed")
    for i, s in enumerate(seeds):
        seeds[i] = as_int(s)
        if seeds[i] is None:
            raise ValueError(f"request {i}: seed must be an int, got {s!r}")
    requests = []
    for i, (prompt, limit) in enumerate(zip(prompts, limits)):
        if as_int(limit) is None or as_int(limit) < 0:
            raise ValueError(f"request {i}: max_new_tokens must be an int >= 0, got {limit!r}")
        limit = as_int(limit)
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
        requests.append(
            Request(
                i,
                ids,
                limit,
                isinstance(prompt, str),
                temperature=float(temps[i]),
                top_k=ks[i],
                top_p=float(ps[i]),
                seed=seeds[i],
            )
        )
    return requests
