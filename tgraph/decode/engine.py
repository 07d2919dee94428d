"""``DecodeEngine``: continuous-batching generation with decode steps served by graphs.

Life of a ``generate`` call (top-down, gpt-fast order):

1. Validate every request (:mod:`tgraph.decode.requests`) before any work.
2. While requests wait and KV slots are free: prefill one request eagerly into its slot and
   sample its first token.
3. One decode step for all running requests: replay the graph of the smallest bucket that holds
   them (padded rows use the dummy slot, their logits are dropped), or run the same step eagerly
   when ``use_graphs=False`` or the batch is larger than every bucket.
4. Sample outside the graph; finished requests (own ``max_new_tokens``, EOS) free their slot, and
   the next waiting requests join at step 2. The running batch shrinks and grows across buckets.

Lookahead (``lookahead=True``, the default): while no running request reaches its
``max_new_tokens`` in the step just launched, the next step is launched *before* the host reads
that step's tokens: its token ids are copied on the device from the sampled ids, its positions
and slots are known on the host. The GPU then never waits for the host's bookkeeping. A request
that ends with EOS is known one step late: its row of the step decoded ahead is computed and
discarded (``DecodeStats.wasted_rows``); it writes one key/value past the request's end into its
own slot, which attention masks out (a later request in that slot overwrites it). Greedy tokens
are those of ``lookahead=False`` except where a step decoded ahead, still carrying an ended
request's row, runs in a larger bucket than step-by-step decoding would: other batch shapes can
change last-bit rounding on a GPU and so flip a near-tie. Seeded sampling is reproducible for a
given setting (a discarded row also consumes random numbers).

Example::

    engine = DecodeEngine(model, max_batch_size=8, max_seq_len=128)
    engine.generate(["Hello", [72, 105]], max_new_tokens=20)   # -> ["...", [..20 ids..]]
    engine.stats.ms_per_step, engine.stats.bucket_steps
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tgraph.backend import resolve_backend
from tgraph.decode.buffers import (
    DecodeBuffers,
    StepInputs,
    as_step_inputs,
    host_staged,
    pack_rows,
)
from tgraph.decode.graph_runner import DecodeGraphRunner, check_buckets, default_buckets
from tgraph.decode.interface import as_decode_model
from tgraph.decode.kv_cache import KVCache
from tgraph.decode.requests import Prompt, Request, make_requests
from tgraph.decode.sampling import check_sampling, make_generator, sample

logger = logging.getLogger(__name__)


@dataclass
class DecodeStats:
    """What the engine did: capture once, then per ``generate`` call (reset at each call)."""

    backend: str | None
    """Graph backend (``"cuda"``/``"emulated"``), or None when graphs are off."""
    buckets: list[int]
    """Bucket sizes; graphs were captured for them unless graphs are off."""
    capture_seconds: float = 0.0
    """Warmup plus capture of all buckets (0 without graphs)."""
    pool_bytes: int = 0
    """CUDA memory the graphs' pool took (0 on the emulated backend or without graphs)."""
    prefills: int = 0
    prefill_seconds: float = 0.0
    decode_steps: int = 0
    """Decode steps in the latest ``generate`` call."""
    decode_seconds: float = 0.0
    """Wall time of those steps: input refresh, replay, sampling and the host read of tokens."""
    bucket_steps: dict[int, int] = field(default_factory=dict)
    """Steps run per bucket size (graphed, or eager-padded when graphs are off)."""
    eager_steps: int = 0
    """Steps larger than the largest bucket, run eagerly without padding."""
    live_rows: int = 0
    """Sum over steps of the running requests."""
    padded_rows: int = 0
    """Sum over steps of the padded rows (wasted compute)."""
    wasted_rows: int = 0
    """Rows decoded ahead for a request that had just ended with EOS (lookahead), discarded."""
    generated_tokens: int = 0
    total_seconds: float = 0.0
    """Wall time of the latest ``generate`` call."""

    @property
    def ms_per_step(self) -> float:
        return 1e3 * self.decode_seconds / max(self.decode_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_seconds if self.total_seconds else 0.0

    @property
    def padding_waste(self) -> float:
        """Fraction of decoded rows that were padding."""
        return self.padded_rows / max(self.live_rows + self.padded_rows, 1)

    def summary(self) -> str:
        """One line: tokens/s, ms per decode step, buckets used, capture time."""
        used = ", ".join(f"{b}x{n}" for b, n in sorted(self.bucket_steps.items())) or "none"
        eager = f" + {self.eager_steps} eager" if self.eager_steps else ""
        mode = self.backend or "eager (no graphs)"
        return (
            f"{self.generated_tokens} tokens in {self.total_seconds:.2f}s: "
            f"{self.tokens_per_s:.1f} tokens/s, {self.ms_per_step:.3f} ms per decode step "
            f"({self.decode_steps} steps), buckets used [{used}]{eager}, padding "
            f"{100 * self.padding_waste:.0f}%, capture {self.capture_seconds:.2f}s [{mode}]"
        )


class _Launched:
    """A decode step on the GPU: its rows and sampled token ids, copied to the host async."""

    def __init__(self, rows: list[Request], tokens: torch.Tensor) -> None:
        self.rows = list(rows)
        self.tokens = tokens  # (n,) on the device; the input of a step decoded ahead
        self._host: torch.Tensor | None = None
        self._done = None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(tokens.device))  # the copy's stream

    def read(self) -> list[int]:
        """The sampled ids; waits for this step (not for steps launched after it)."""
        if self._done is None:
            return self.tokens.tolist()
        self._done.synchronize()
        return self._host.tolist()


class DecodeEngine:
    """Serve a model's decode steps through one graph per batch-size bucket.

    Args:
        model: a :class:`tgraph.models.gpt.GPT` (switched to eval mode) or any object that
            implements :class:`tgraph.decode.interface.DecodeModel`.
        max_batch_size: requests decoded together at most; more are queued.
        max_seq_len: KV capacity per request (prompt + new tokens); at most the model's
            ``max_positions`` (the GPT's ``block_size``).
        use_graphs: False runs the very same decode step eagerly (padded to the same buckets,
            so the kernels and shapes match the graphed run exactly).
        batch_sizes: bucket sizes; default 1, 2, 4, 8, then every 8 up to ``max_batch_size``.
            Batches larger than the largest bucket run eagerly.
        backend: ``"auto"``, ``"cuda"`` or ``"emulated"`` (``TGRAPH_BACKEND`` overrides auto).
        progress: show a progress bar over capture.
        lookahead: launch the next decode step before reading the current step's tokens on the
            host (see the module docstring).

    Raises:
        ValueError: a size out of range, or an unknown backend.
        TypeError: ``model`` does not implement the decode interface.
        tgraph.CaptureError: capturing a bucket failed.
    """

    def __init__(
        self,
        model: object,
        *,
        max_batch_size: int,
        max_seq_len: int,
        use_graphs: bool = True,
        batch_sizes: Sequence[int] | None = None,
        backend: str = "auto",
        progress: bool = True,
        lookahead: bool = True,
    ) -> None:
        self.decoder = as_decode_model(model)
        self.lookahead = lookahead
        d = self.decoder
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int):
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not 1 <= max_seq_len <= d.max_positions:
            raise ValueError(
                f"max_seq_len must be in [1, {d.max_positions}] (the model's positions), got "
                f"{max_seq_len}; lower it or use a model with a larger block_size"
            )
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.use_graphs = use_graphs
        if batch_sizes is None:
            self.buckets = default_buckets(max_batch_size)
        else:
            self.buckets = check_buckets(batch_sizes, max_batch_size)
        self.device = torch.device(d.device)
        self.cache = KVCache(
            n_layer=d.n_layer,
            max_batch_size=max_batch_size,
            n_head=d.n_head,
            max_seq_len=max_seq_len,
            head_dim=d.head_dim,
            dtype=d.dtype,
            device=self.device,
        )
        self.runner: DecodeGraphRunner | None = None
        resolved = resolve_backend(backend, self.device) if use_graphs else None
        self.stats = DecodeStats(backend=resolved, buckets=list(self.buckets))
        if use_graphs:
            buffers = DecodeBuffers(self.buckets[-1], self.cache.dummy_slot, self.device)
            self.runner = DecodeGraphRunner(
                self._step,
                buffers,
                self.buckets,
                backend=resolved,
                device=self.device,
                progress=progress,
            )
            self.runner.capture()
            self.stats.capture_seconds = self.runner.capture_seconds
            self.stats.pool_bytes = self.runner.pool_bytes

    # -- one step ---------------------------------------------------------------------------

    def _step(self, inputs: StepInputs) -> torch.Tensor:
        """The decode step every path runs (graph capture, graph replay on CPU, eager)."""
        with torch.no_grad():
            return self.decoder.decode_step(inputs, self.cache)

    def _bucket_for(self, rows: int) -> int | None:
        if self.runner is not None:
            return self.runner.bucket_for(rows)
        return next((b for b in self.buckets if b >= rows), None)

    def decode(self, running: Sequence[Request], ahead: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step for ``running`` (at most ``max_batch_size``); returns logits (n, V).

        Args:
            running: the requests, one row each.
            ahead: (n,) token ids on the device to decode instead of each request's last
                output token: the samples of a step whose tokens the host has not appended yet
                (lookahead). Positions are then one past each request's last appended token.

        The returned tensor may be a view of a graph's static output: the next step overwrites
        it. Clone it to keep it.
        """
        n = len(running)
        if ahead is not None and tuple(ahead.shape) != (n,):
            raise ValueError(
                f"ahead must hold one token id per row, shape ({n},); got {tuple(ahead.shape)}"
            )
        shift = 0 if ahead is None else 1
        tokens = [r.output[-1] for r in running] if ahead is None else [0] * n
        positions = [r.position + shift for r in running]
        if positions and max(positions) >= self.max_seq_len:
            raise ValueError(
                f"a decode position reaches max_seq_len={self.max_seq_len}: the KV cache has no "
                "room for it (a request decoded past its prompt + max_new_tokens)"
            )
        slots = [r.slot for r in running]
        bucket = self._bucket_for(n)
        st = self.stats
        if bucket is None:  # larger than every bucket: eager, unpadded
            st.eager_steps += 1
            width = n
        else:
            st.bucket_steps[bucket] = st.bucket_steps.get(bucket, 0) + 1
            width = bucket
        st.live_rows += n
        st.padded_rows += width - n
        if self.runner is not None and bucket is not None:
            return self.runner.replay(tokens, positions, slots, ahead)[:n]
        packed = pack_rows(tokens, positions, slots, width=width, dummy_slot=self.cache.dummy_slot)
        packed = host_staged(packed, self.device).to(self.device, non_blocking=True)
        if ahead is not None:
            packed[0, :n] = ahead
        return self._step(as_step_inputs(packed))[:n]

    def prefill(self, request: Request) -> torch.Tensor:
        """Run ``request``'s prompt eagerly into its slot; returns last-position logits (V,)."""
        tokens = torch.tensor(request.prompt, dtype=torch.int64, device=self.device)
        with torch.no_grad():
            return self.decoder.prefill(tokens, request.slot, self.cache)

    # -- the loop ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int | Sequence[int],
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        eos_token_id: int | None = None,
        seed: int | None = None,
    ) -> list[list[int] | str]:
        """Generate a completion for every prompt with continuous batching.

        Args:
            prompts: a list of prompts, each a list (or 1-D tensor) of token ids or a string
                (encoded with the model's tokenizer, the byte tokenizer for the toy GPT).
            max_new_tokens: new tokens per request, one int for all or one per prompt.
            temperature: 0 is greedy (argmax); otherwise sample from softmax(logits / T).
            top_k: sample only among the k most likely tokens.
            eos_token_id: a request ends after generating this token (it is included).
            seed: seed of the sampling generator; same seed, same tokens. None: random.

        Returns:
            One completion per prompt, in prompt order, without the prompt: a list of token ids
            for a token-id prompt, a string for a string prompt. A completion is shorter than
            ``max_new_tokens`` only when it ends with ``eos_token_id``.

        Raises:
            ValueError: an empty prompt, a token id outside the vocabulary, a prompt length plus
                ``max_new_tokens`` above ``max_seq_len``, bad sampling settings (checked for
                every request before any work starts; the message names the request).
            TypeError: ``prompts`` is not a list of prompts.
        """
        d = self.decoder
        requests = make_requests(
            prompts,
            max_new_tokens,
            vocab_size=d.vocab_size,
            max_seq_len=self.max_seq_len,
            max_positions=d.max_positions,
            encode=getattr(d, "encode", None),
        )
        check_sampling(temperature, top_k)
        if eos_token_id is not None and not 0 <= eos_token_id < d.vocab_size:
            raise ValueError(
                f"eos_token_id {eos_token_id} is outside the vocabulary [0, {d.vocab_size})"
            )
        generator = make_generator(self.device, seed) if temperature > 0 else None
        st = self.stats = DecodeStats(
            backend=self.stats.backend,
            buckets=self.stats.buckets,
            capture_seconds=self.stats.capture_seconds,
            pool_bytes=self.stats.pool_bytes,
        )

        def pick(logits: torch.Tensor) -> torch.Tensor:
            return sample(logits, temperature=temperature, top_k=top_k, generator=generator)

        def launch(rows: list[Request], ahead: torch.Tensor | None = None) -> _Launched:
            st.decode_steps += 1
            return _Launched(rows, pick(self.decode(rows, ahead)))

        start = time.perf_counter()
        waiting = deque(r for r in requests if r.max_new_tokens > 0)
        free = list(range(self.max_batch_size))  # a heap: the lowest free slot goes first
        running: list[Request] = []
        step: _Launched | None = None  # launched, its tokens not yet read by the host
        while waiting or running or step:
            if step is None:
                while waiting and free:  # join: prefill waiting requests into free slots
                    t0 = time.perf_counter()
                    r = waiting.popleft()
                    r.slot = heapq.heappop(free)
                    token = int(pick(self.prefill(r)[None])[0])
                    st.prefills += 1
                    st.prefill_seconds += time.perf_counter() - t0
                    if r.append(token, eos_token_id):
                        heapq.heappush(free, r.slot)
                    else:
                        running.append(r)
                if not running:
                    continue
                t0 = time.perf_counter()
                step = launch(running)
            else:
                t0 = time.perf_counter()
            ahead = None
            # Decode ahead only while the batch cannot change except by EOS: no request of this
            # step reaches max_new_tokens (nor has ended), so no slot frees and nobody joins.
            if self.lookahead and all(
                r.slot >= 0 and len(r.output) + 1 < r.max_new_tokens for r in step.rows
            ):
                ahead = launch(step.rows, step.tokens)
            tokens = step.read()  # waits for that step only; the one ahead keeps the GPU busy
            st.decode_seconds += time.perf_counter() - t0
            still = []
            for r, token in zip(step.rows, tokens, strict=True):
                if r.slot < 0:  # ended with EOS one step earlier: a row decoded ahead, dropped
                    st.wasted_rows += 1
                    continue
                if r.append(token, eos_token_id):
                    heapq.heappush(free, r.slot)
                    r.slot = -1
                else:
                    still.append(r)
            running, step = still, ahead
        st.total_seconds = time.perf_counter() - start
        st.generated_tokens = sum(len(r.output) for r in requests)
        logger.debug("generate: %s", st.summary())
        encode_out = getattr(d, "decode", None)
        return [encode_out(r.output) if r.is_text else r.output for r in requests]
