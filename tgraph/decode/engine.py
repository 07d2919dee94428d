"""``DecodeEngine``: continuous-batching generation with prefill and decode served by graphs.

Life of a ``generate`` call (top-down, gpt-fast order):

1. Validate every request, sampling settings included (:mod:`tgraph.decode.requests`).
2. While requests wait and KV slots are free: pad the prompt to its token-count bucket, replay
   that bucket's prefill graph (eager above the largest bucket) into the next free slot; the
   graph also samples the first token, which the host reads (time to first token).
3. Pad the running requests once (:func:`~tgraph.decode.batch.pad_batch`) and copy that batch
   into the static buffers. Then decode steps replay the graph of its bucket (or run the very
   same program eagerly) over and over: each step samples on the device and hands its ids to
   the next step on the device, so the host copies nothing in while the batch is unchanged.
4. A request that reaches its ``max_new_tokens`` or EOS leaves; the last running request moves
   into its KV slot (slots stay rows ``0..n-1``), waiting requests join at step 2, and the new
   batch is padded and copied in once. The batch shrinks and grows across buckets.

Lookahead (``lookahead=True``, the default): while no request can reach its ``max_new_tokens``
in the step just launched, the next step is launched *before* the host reads that step's tokens,
so the GPU never waits for the host's bookkeeping. A request that ends with EOS is known one
step late: its row of the step decoded ahead is computed and discarded
(``DecodeStats.wasted_rows``); it writes one key/value past the request's end into its own slot,
which attention masks out. Tokens never depend on lookahead: the step decoded ahead has the same
rows and bucket as the one before it.

Weights (:mod:`tgraph.decode.weights`): the graphs read the memory each parameter and buffer
had at capture. A sync that replaces them (``load_state_dict(sd, assign=True)``) is followed by a
copy into that memory before each call (only while no other tensor uses it: an EMA swap hands it
to the EMA tensors), or by :meth:`DecodeEngine.recapture`; never old tokens.
So is a change to what the forwards run: a submodule replaced (``model.lm_head = ...``), a hook
added or removed, an attribute they read (``LayerNorm.eps``) or a configuration value the
decoder reads (``config_values()``: Mistral's ``config.sliding_window``) changed: generate()
captures again.

Hooks (:mod:`tgraph.decode.hooks`): a forward hook on a module the adapter never calls (a decoder
layer, the model) is refused, naming it: it would never run. Under graphs a hook on a module it
calls would run at capture only, so it is refused too unless ``capturable_hooks=True``; the
eager engine (``use_graphs=False``) runs such hooks at every call.

Sampling (:mod:`tgraph.decode.sampling`) draws each request's tokens from its own counter-based
stream keyed by its seed and position, so a seeded request gives the same tokens in any slot,
bucket or company, with or without graphs.

Per-step host work: a decode step of an unchanged batch is one graph replay, one
device-to-host copy of the sampled ids into a preallocated pinned buffer plus an event, one wait
for the older step and the appends of the ids. Everything else is done once per batch change or
inside the graph: the host tensor of every row's token, position and slot is built and copied in
when the batch changes; the ids decoded ahead are written by the graph where the next step reads
them; sampling is captured; the pinned buffers and CUDA events are a ring of two; whether a row
decodes ahead is one counter, ``room``, computed per batch; the bucket is looked up once per
padded batch; and on the device, slots are rows of the KV cache read as views, never gathered
(:mod:`tgraph.decode.kv_cache`).

Example::

    engine = DecodeEngine(model, max_batch_size=8, max_seq_len=128)
    engine.generate(["Hello", [72, 105]], max_new_tokens=20)   # -> ["...", [..20 ids..]]
    engine.generate(["Hello"], 20, temperature=0.8, top_p=0.9, seed=1)
    engine.stats.ms_per_step, engine.stats.bucket_steps
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Sequence

import torch

from tgraph.backend import GraphFactory, resolve_backend
from tgraph.baked import memory_uses
from tgraph.decode.batch import (
    PaddedBatch,
    check_buckets,
    default_buckets,
    default_prefill_buckets,
    pad_batch,
    pad_prompt,
)
from tgraph.decode.buffers import DecodeBuffers, PrefillBuffers
from tgraph.decode.graph_runner import BucketGraphs
from tgraph.decode.hooks import HookCheck
from tgraph.decode.interface import as_decode_model
from tgraph.decode.kv_cache import KVCache
from tgraph.decode.requests import Prompt, Request, as_int, eos_ids, make_requests
from tgraph.decode.sampling import Sampler
from tgraph.decode.stats import DecodeStats
from tgraph.decode.steps import TokenReadback, decode_program, prefill_program
from tgraph.decode.weights import BakedWeights, served_modules

logger = logging.getLogger(__name__)

VARIANTS = (False, True)  # greedy, sampling


class DecodeEngine:
    """Serve a model's prefill and decode steps through graphs bucketed by size.

    Args:
        model: any object implementing :class:`tgraph.decode.interface.DecodeModel`, or one
            with a registered adapter (the toy :class:`tgraph.toy.gpt.GPT`: in eval mode while
            the engine captures or generates, each module back in its own train/eval mode
            after).
        max_batch_size: requests decoded together at most (KV slots); more are queued.
        max_seq_len: KV capacity per request (prompt + new tokens); at most the model's
            ``max_positions`` (the GPT's ``block_size``).
        use_graphs: False runs the very same programs eagerly (padded to the same buckets, so
            the kernels and shapes match the graphed run exactly).
        batch_sizes: decode buckets; default 1, 2, 4, 8, then every 8 up to
            ``max_batch_size``. Batches larger than the largest bucket run eagerly.
        prefill_sizes: prefill buckets in prompt tokens; default 16, 32, 64, ... up to
            ``min(max_seq_len, 512)``; ``[]`` prefills every prompt eagerly, unpadded. Longer
            prompts than the largest bucket prefill eagerly.
        backend: ``"auto"``, ``"cuda"`` or ``"emulated"`` (``TGRAPH_BACKEND`` overrides auto).
        progress: show a progress bar over capture.
        lookahead: launch the next decode step before reading the current step's tokens on the
            host (see the module docstring).
        capturable_hooks: capture the forward hooks on the modules the adapter calls as part of
            the graphs (pure tensor code: their effect replays, their Python runs at capture
            and on eagerly served batches only). By default the graphed engine refuses them,
            naming each; hooks on modules the adapter never calls are refused either way.

    Raises:
        ValueError: a size out of range, or an unknown backend.
        TypeError: ``model`` does not implement the decode interface.
        RuntimeError: a hook the engine cannot honour (:mod:`tgraph.decode.hooks`).
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
        prefill_sizes: Sequence[int] | None = None,
        backend: str = "auto",
        progress: bool = True,
        lookahead: bool = True,
        capturable_hooks: bool = False,
    ) -> None:
        self.decoder = d = as_decode_model(model)
        self._modules = served_modules(model, d)  # whose weights the graphs read
        self.hooks = HookCheck(d, self._modules, graphs=use_graphs, capturable=capturable_hooks)
        # The model's mode while the engine runs it (eval for the toy GPT), restored after.
        self._serving = getattr(d, "serving", None) or contextlib.nullcontext
        self.lookahead = lookahead
        given, max_batch_size = max_batch_size, as_int(max_batch_size)
        if max_batch_size is None:
            raise ValueError(f"max_batch_size must be an int >= 1, got {given!r}")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        given, max_seq_len = max_seq_len, as_int(max_seq_len)
        if max_seq_len is None:
            raise ValueError(f"max_seq_len must be an int, got {given!r}")
        if not 1 <= max_seq_len <= d.max_positions:
            raise ValueError(
                f"max_seq_len must be in [1, {d.max_positions}] (the model's positions), got "
                f"{max_seq_len}; lower it or use a model with a larger block_size"
            )
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.use_graphs = use_graphs
        if batch_sizes is not None and not list(batch_sizes):
            raise ValueError("batch_sizes is empty; pass None for the default buckets")
        self.buckets = (
            default_buckets(max_batch_size)
            if batch_sizes is None
            else check_buckets(batch_sizes, max_batch_size, "batch_sizes")
        )
        self.prefill_buckets = (
            default_prefill_buckets(max_seq_len)
            if prefill_sizes is None
            else check_buckets(prefill_sizes, max_seq_len, "prefill_sizes")
        )
        self.device = torch.device(d.device)
        self.cache = self._new_cache()
        # Normal tensors even when the engine is built under torch.inference_mode(): a
        # generate() outside it writes them in place, which inference tensors refuse.
        with torch.inference_mode(False):
            self.buffers = DecodeBuffers(max_batch_size, d.vocab_size, self.device)
            self.prompt_buffers = PrefillBuffers(max_seq_len, d.vocab_size, self.device)
            self.sampler = Sampler(d.vocab_size, self.device)
            self.readback = TokenReadback(max_batch_size, self.device)
        resolved = resolve_backend(backend, self.device) if use_graphs else None
        # One factory: the decode and prefill graphs share one memory pool (tgraph.pool).
        self.factory = GraphFactory(resolved, self.device) if use_graphs else None
        self.decode_graphs = BucketGraphs(  # programs read self.cache when built: a new one
            "decode",  # after a dtype change (recapture) reaches them
            lambda key: decode_program(d, self.cache, self.buffers, self.sampler, *key),
            [(b, s) for b in self.buckets for s in VARIANTS],
            self.factory,
            progress=progress,
        )
        self.prefill_graphs = BucketGraphs(
            "prefill",
            lambda key: prefill_program(d, self.cache, self.prompt_buffers, self.sampler, *key),
            [(t, s) for t in self.prefill_buckets for s in VARIANTS],
            self.factory,
            progress=progress,
        )
        self.stats = DecodeStats(
            backend=resolved, buckets=list(self.buckets), prefill_buckets=self.prefill_buckets
        )
        self.weights: BakedWeights | None = None
        self._generating = False
        self.hooks.check()  # before any capture: an error names the hook, not the capture
        if self.factory is not None:
            self._capture()

    def _new_cache(self) -> KVCache:
        """A KV cache for the model as it is now (its dtype: the decoder's ``dtype``)."""
        d = self.decoder
        with torch.inference_mode(False):  # normal tensors (see __init__)
            return KVCache(
                n_layer=d.n_layer,
                max_batch_size=self.max_batch_size,
                n_head=d.n_head,
                max_seq_len=self.max_seq_len,
                head_dim=d.head_dim,
                dtype=d.dtype,
                device=self.device,
            )

    def _capture(self) -> None:
        """Capture every bucket (largest first, one pool) and note the weights they read."""
        allocated = self.factory.memory_allocated()
        uses = memory_uses(self._modules)  # the user's; those the capture adds are the engine's
        self.hooks.check()  # recapture(): a hook added since
        # The warmups and captures run every bucket on whatever the buffers hold: after a
        # generate() that is its last requests (a prompt longer than a smaller bucket, rows
        # live near max_seq_len that each warmup would move past it). Start from padding.
        self.buffers.reset()
        self.prompt_buffers.reset()
        # outside inference mode: what the warmups make (a model's lazy state, the graphs'
        # static outputs) is written in place by later calls, inside or outside it
        with self._serving(), torch.inference_mode(False):
            self.decode_graphs.capture()
            self.prefill_graphs.capture()
        # a serving() context sets the mode the model runs in; without one, the model's own
        self.weights = BakedWeights(
            self._modules,
            uses,
            modes=self._serving is contextlib.nullcontext,
            config=getattr(self.decoder, "config_values", None),
        )
        self.buffers.reset()  # warmups moved the padding rows' tokens; start clean
        st = self.stats
        st.capture_seconds = (
            self.decode_graphs.capture_seconds + self.prefill_graphs.capture_seconds
        )
        st.pool_bytes = self.factory.memory_allocated() - allocated
        for kind in (self.decode_graphs, self.prefill_graphs):
            for (size, sampling), nbytes in kind.bytes.items():
                name = f"{kind.name} {size} {'sampling' if sampling else 'greedy'}"
                st.graph_bytes[name] = nbytes

    def recapture(self) -> None:
        """Capture the graphs again over the model's current parameters and buffers (after a
        weight sync that replaced them, e.g. ``load_state_dict(sd, assign=True)``: the graphs
        then read the new tensors without a copy per call). Call it between requests: the
        warmups write the KV cache. :meth:`generate` calls it itself when the graphs cannot
        follow a replaced tensor. A model whose dtype changed (``model.to(torch.bfloat16)``)
        gets a new KV cache in its dtype; the old one's contents are dropped."""
        for kind in (self.decode_graphs, self.prefill_graphs):
            kind.reset()  # the graphs and the programs, which hold the cache
        if self.cache.dtype != self.decoder.dtype:
            self.cache = None  # its memory is free before the new one is allocated
            self.cache = self._new_cache()
        if self.factory is None:
            return
        self.factory = GraphFactory(self.factory.backend, self.device)  # a fresh pool
        self.decode_graphs.factory = self.prefill_graphs.factory = self.factory
        self._capture()

    def _check_weights(self, between_requests: bool) -> None:
        """Before a call: the graphs read the model's current weights (BakedWeights). Inside
        generate() no user code runs between its prefills and steps: checked once, at its start."""
        if self._generating:
            return
        self.hooks.check()  # raises: a hook the engine cannot honour
        why = None if self.weights is None else self.weights.check()
        if why is None and self.cache.dtype != self.decoder.dtype:  # use_graphs=False
            why = f"the model's dtype changed from {self.cache.dtype} to {self.decoder.dtype}"
        if why is None:
            return
        if not between_requests:
            raise RuntimeError(
                f"DecodeEngine: {why}, so the captured graphs cannot serve it; call "
                "engine.recapture() between requests (or generate(), which does)"
            )
        logger.info("DecodeEngine: %s; capturing the graphs again", why)
        self.recapture()

    # -- one prefill, one decode step ------------------------------------------------------

    def prefill(self, request: Request) -> torch.Tensor:
        """Prefill ``request``'s prompt into its slot (``request.slot``) and sample its first
        token into :attr:`prompt_buffers.token`; returns the last position's logits (V,).

        The logits are a graph's static output: the next prefill or decode step overwrites
        them (clone to keep).

        Raises:
            RuntimeError: a parameter or buffer was replaced in a way the graphs cannot follow
                (call :meth:`recapture`).
        """
        self._check_weights(between_requests=False)
        padded = pad_prompt(request, buckets=self.prefill_buckets, vocab_size=self.vocab_size)
        self.prompt_buffers.copy_from(padded.tokens, padded.ints, padded.floats)
        self.stats.count_prefill(padded.width, padded.graphed)
        with self._serving():
            return self.prefill_graphs.run(padded.key)[0]

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    def pad(self, running: Sequence[Request]) -> PaddedBatch:
        """The padded batch of ``running`` (request ``i`` in slot ``i``): see :mod:`.batch`."""
        return pad_batch(
            running,
            buckets=self.buckets,
            max_rows=self.max_batch_size,
            vocab_size=self.vocab_size,
            max_seq_len=self.max_seq_len,
        )

    def load(self, batch: PaddedBatch) -> None:
        """Copy ``batch`` into the static buffers (every row; once per batch change) and
        bring the model's current weights to the graphs (raises as :meth:`prefill`)."""
        self._check_weights(between_requests=False)
        self.buffers.copy_from(batch.ints, batch.floats)
        self.stats.refreshes += 1

    def step(self, batch: PaddedBatch) -> torch.Tensor:
        """One decode step of the loaded ``batch``: replay its bucket's graph or run the same
        program eagerly. The sampled ids are then in ``buffers.tokens[:n]`` and the buffers
        advanced for the next step. Returns the logits (width, V), overwritten by the next
        step (clone to keep). Raises as :meth:`prefill` (the weights are checked here outside
        :meth:`generate`, whose loop runs no user code between its steps)."""
        self._check_weights(between_requests=False)
        self.stats.count_step(batch.n, batch.width, batch.graphed, batch.sampling)
        return self.decode_graphs.run(batch.key)

    def decode(self, running: Sequence[Request]) -> torch.Tensor:
        """One decode step for ``running`` (request ``i`` in slot ``i``, at most
        ``max_batch_size``), loaded from the host; returns logits (n, V), a view the next step
        overwrites. The caller appends the tokens it chooses."""
        batch = self.pad(running)
        self.load(batch)
        with self._serving():
            return self.step(batch)[: batch.n]

    def _compact(self, running: list[Request]) -> list[Request]:
        """Drop ended requests (slot -1); move the last ones into the freed slots so the
        running requests hold slots ``0..n-1`` (row == slot) again."""
        keep = [r for r in running if r.slot >= 0]
        m = len(keep)
        held = {r.slot for r in keep}
        holes = [s for s in range(m) if s not in held]
        movers = sorted((r for r in keep if r.slot >= m), key=lambda r: r.slot)
        for hole, r in zip(holes, movers, strict=True):
            self.cache.move(r.slot, hole)
            r.slot = hole
        return sorted(keep, key=lambda r: r.slot)

    # -- the loop ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Prompt],
        max_new_tokens: int | Sequence[int],
        *,
        temperature: float | Sequence[float] = 0.0,
        top_k: int | None | Sequence[int | None] = None,
        top_p: float | Sequence[float] = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[int] | str]:
        """Generate a completion for every prompt with continuous batching.

        Args:
            prompts: a list of prompts, each a list (or 1-D tensor) of token ids or a string
                (encoded with the model's tokenizer, the byte tokenizer for the toy GPT).
            max_new_tokens: new tokens per request, one int for all or one per prompt.
            temperature: 0 is greedy (argmax); otherwise sample from softmax(logits / T). One
                value for all or one per prompt (so are ``top_k``, ``top_p`` and ``seed``).
            top_k: sample only among the k most likely tokens (None: all).
            top_p: sample only among the most likely tokens whose mass reaches p (1: all).
            eos_token_id: a request ends after generating this token, or any of these tokens
                (a list, as a Hugging Face ``generation_config`` may name); it is included.
            seed: an int seeds request ``i``'s own stream with ``seed + i``; a list seeds each
                request; None draws seeds from torch's default generator when some request
                samples (a greedy call leaves that generator untouched). A request with the
                same prompt, settings and seed gets the same tokens whatever else runs.

            Where an int is expected (token ids, ``max_new_tokens``, ``top_k``, ``eos_token_id``,
            ``seed``), a numpy integer or a 0-d integer tensor is that int; where a float is
            (``temperature``, ``top_p``), any real scalar. A tensor prompt of floats is refused.

        Returns:
            One completion per prompt, in prompt order, without the prompt: a list of token ids
            for a token-id prompt, a string for a string prompt. A completion is shorter than
            ``max_new_tokens`` only when it ends with an ``eos_token_id``.

        The model runs in its own dtype: an enclosing ``torch.autocast`` is switched off inside
        (:mod:`tgraph.decode.steps`).

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
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
        )
        eos = eos_ids(eos_token_id, d.vocab_size)
        self._check_weights(between_requests=True)
        self._generating = True
        try:
            with self._serving():
                self._serve(requests, eos)
        finally:
            self._generating = False
        decode_text = getattr(d, "decode", None)
        return [decode_text(r.output) if r.is_text else r.output for r in requests]

    def _serve(self, requests: list[Request], eos: frozenset[int]) -> None:
        """The continuous-batching loop of :meth:`generate`: every request's output filled."""
        st = self.stats = self.stats.fresh()
        start = time.perf_counter()
        waiting = deque(r for r in requests if r.max_new_tokens > 0)
        running: list[Request] = []
        while waiting or running:
            while waiting and len(running) < self.max_batch_size:  # join: prefill into a slot
                t0 = time.perf_counter()
                r = waiting.popleft()
                r.slot = len(running)
                self.prefill(r)
                token = self.prompt_buffers.token.tolist()[0]  # waits: time to first token
                st.prefills += 1
                st.prefill_seconds += time.perf_counter() - t0
                if r.append(token, eos):
                    r.slot = -1
                else:
                    running.append(r)
            if not running:
                continue
            t0 = time.perf_counter()
            batch = self.pad(running)  # the batch changed (a request joined or left): pad once
            self.load(batch)
            self._run_batch(batch, eos)
            st.decode_seconds += time.perf_counter() - t0
            running = self._compact(running)
        st.total_seconds = time.perf_counter() - start
        st.generated_tokens = sum(len(r.output) for r in requests)
        logger.debug("generate: %s", st.summary())

    def _run_batch(self, batch: PaddedBatch, eos: frozenset[int]) -> None:
        """Decode the loaded ``batch`` until a request ends; ended requests get slot -1.

        Invariant: at most two steps await their read (the readback ring); a step is launched
        ahead only while ``room`` says no request can reach its limit in the steps launched.
        """
        requests = batch.requests
        room = batch.room
        inflight: deque = deque()
        ended: set[int] = set()

        def launch() -> None:
            nonlocal room
            room -= 1
            self.stats.decode_steps += 1
            self.step(batch)
            inflight.append((self.readback.copy(self.buffers.tokens[: batch.n]), room == 0))

        launch()
        while inflight:
            if self.lookahead and room > 0 and not ended and len(inflight) == 1:
                launch()  # before the host reads the step in flight: the GPU stays busy
            pending, last = inflight.popleft()
            tokens = self.readback.read(pending)
            if not ended and not last and eos.isdisjoint(tokens):
                for r, t in zip(requests, tokens):  # nobody ends: no per-row checks
                    r.output.append(t)
            else:
                for i, (r, t) in enumerate(zip(requests, tokens)):
                    if i in ended:  # ended with EOS one step earlier: a row decoded ahead
                        self.stats.wasted_rows += 1
                    elif r.append(t, eos):
                        ended.add(i)
                        r.slot = -1
            if not ended and not inflight and room > 0:
                launch()
