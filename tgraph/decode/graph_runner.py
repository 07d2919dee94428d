"""One decode-step graph per batch-size bucket, captured largest first into one shared pool.

A batch of ``n`` running requests replays the graph of the smallest bucket ``B >= n``; rows
``n..B-1`` are padded rows (dummy slot, position 0, token 0) whose logits are dropped. The graphs
share one memory pool: the largest is captured first, and each smaller one reuses its
intermediate memory. Sharing is safe because the graphs never run concurrently and every graph's
output tensor stays referenced (so no other graph is given its memory).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from tgraph.backend import GraphFactory, RefuseHostSync, explain_capture_failure
from tgraph.decode.buffers import DecodeBuffers, StepInputs

logger = logging.getLogger(__name__)

StepFn = Callable[[StepInputs], torch.Tensor]


def default_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to ``max_batch_size``, which is always included."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch_size}
    sizes.update(range(16, max_batch_size + 1, 8))
    sizes.add(max_batch_size)
    return sorted(sizes)


def check_buckets(batch_sizes: Sequence[int], max_batch_size: int) -> list[int]:
    """Sorted unique bucket sizes, each in ``[1, max_batch_size]``.

    Raises:
        ValueError: an empty list, or a size that is not an int in range.
    """
    sizes = list(batch_sizes)
    if not sizes:
        raise ValueError("batch_sizes is empty; pass None for the default buckets")
    for b in sizes:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= max_batch_size:
            raise ValueError(
                f"batch_sizes entry {b!r} must be an int in [1, max_batch_size={max_batch_size}]"
            )
    return sorted(set(sizes))


def _free_memory(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (not CUDA)"
    free, total = torch.cuda.mem_get_info(device)
    return f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB"


class DecodeGraphRunner:
    """Captures and replays the decode step for each bucket.

    Args:
        step: the decode step, ``step(inputs) -> logits (B, V)``; it must be graph-safe.
        buffers: the static inputs the graphs read.
        buckets: bucket sizes, sorted ascending; the largest must equal ``buffers.max_rows``.
        backend: ``"cuda"`` or ``"emulated"`` (resolved).
        device: the model's device.
        warmup: eager runs of the largest bucket before the first capture.
        progress: show a tqdm bar over the captures.

    Ownership: :meth:`replay` returns the graph's static logits; the next replay of any bucket
    may overwrite them, so read (sample) before the next step or clone.
    """

    def __init__(
        self,
        step: StepFn,
        buffers: DecodeBuffers,
        buckets: Sequence[int],
        *,
        backend: str,
        device: torch.device,
        warmup: int = 2,
        progress: bool = True,
    ) -> None:
        assert list(buckets) == sorted(set(buckets)) and buckets[-1] == buffers.max_rows
        self.step = step
        self.buffers = buffers
        self.buckets = list(buckets)
        self.backend = backend
        self.device = device
        self.warmup = warmup
        self.progress = progress
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def bucket_for(self, rows: int) -> int | None:
        """Smallest bucket that holds ``rows`` rows; None if ``rows`` exceeds the largest."""
        i = bisect.bisect_left(self.buckets, rows)
        return self.buckets[i] if i < len(self.buckets) else None

    def capture(self) -> None:
        """Warm up, then capture every bucket, largest first, into one pool.

        Raises:
            tgraph.CaptureError: a capture failed (every graph is dropped; the message names the
                bucket and the likely cause).
        """
        factory = GraphFactory(self.backend, self.device)
        logger.info("decode graphs: before capture, %s", _free_memory(self.device))
        start = time.perf_counter()
        allocated = factory.memory_allocated()
        self.buffers.reset()  # warmup and capture see only dummy rows: they write the dummy slot
        order = sorted(self.buckets, reverse=True)
        bucket = order[0]
        try:
            with torch.no_grad(), factory.side_stream():
                # Host syncs fail here with a clear error, before a CUDA capture is invalidated.
                with RefuseHostSync():
                    for _ in range(self.warmup):
                        self.step(self.buffers.set_batch(bucket))
                bar = tqdm(order, desc="capture decode graphs", disable=not self.progress)
                for bucket in bar:
                    bar.set_postfix(batch=bucket)
                    inputs = self.buffers.set_batch(bucket)
                    graph = factory.new_graph()
                    logits = graph.capture(lambda inputs=inputs: self.step(inputs))
                    self.graphs[bucket] = (graph, logits)
            factory.synchronize()
        except BaseException as exc:
            self.graphs.clear()
            factory.synchronize()
            raise explain_capture_failure(f"the decode step for batch size {bucket}", exc) from exc
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = factory.memory_allocated() - allocated
        logger.info(
            "decode graphs: captured %d buckets %s on %s in %.2fs; after capture, %s",
            len(self.graphs),
            self.buckets,
            self.backend,
            self.capture_seconds,
            _free_memory(self.device),
        )

    def replay(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        device_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Refresh the static inputs, replay the bucket's graph and return its logits.

        Args:
            tokens: token id of each live row.
            positions: position of each live row's token.
            slots: KV slot of each live row.
            device_tokens: if given, the live rows' token ids on the device (they replace
                ``tokens`` by a device-to-device copy; the host never reads them).

        Returns:
            The bucket graph's static logits (B, V), B >= len(tokens); rows past ``len(tokens)``
            are padded rows. Overwritten by the next replay.
        """
        bucket = self.bucket_for(len(tokens))
        assert bucket is not None and bucket in self.graphs, f"no graph for {len(tokens)} rows"
        graph, logits = self.graphs[bucket]
        self.buffers.copy_from(tokens, positions, slots)  # every row, stale tails reset
        if device_tokens is not None:
            self.buffers.tokens[: len(tokens)].copy_(device_tokens)
        with torch.no_grad():
            graph.replay()
        return logits
