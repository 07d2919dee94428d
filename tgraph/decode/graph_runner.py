"""Programs keyed by bucket, captured largest first into one shared pool, replayed or run eagerly.

A *program* is a no-argument callable that reads static buffers and returns its output tensor
(the decode step of ``B`` rows, the prefill of a ``T``-token bucket). :class:`BucketGraphs`
captures the programs of its keys into the pool of one :class:`~tgraph.backend.GraphFactory`
(the decode and the prefill graphs share it), largest key first so each smaller graph reuses
the larger ones' intermediate memory, and reports the memory each capture added. :meth:`run`
replays a captured key and calls the very same program eagerly otherwise: with graphs off, or
for a key above the largest bucket.

Pool hazard (``tgraph.pool``): replaying a graph may overwrite the outputs of every graph
captured after it in the pool. So :meth:`run`'s output is valid only until the next ``run`` of
any program of the pool; the programs therefore write what must survive (sampled tokens, the
next step's inputs) into static buffers outside the pool, and the engine reads nothing else.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence

import torch
from tqdm.auto import tqdm

from tgraph.backend import GraphFactory
from tgraph.guards import RefuseHostSync, explain_capture_failure

logger = logging.getLogger(__name__)

Program = Callable[[], torch.Tensor]


def free_memory(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (not CUDA)"
    free, total = torch.cuda.mem_get_info(device)
    return f"{free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB"


def reserved_memory(device: torch.device | None) -> int:
    return torch.cuda.memory_reserved(device) if device is not None and device.type == "cuda" else 0


class BucketGraphs:
    """Programs of one kind (decode or prefill), each captured as a graph when graphs are on.

    Args:
        name: ``"decode"`` or ``"prefill"`` (messages and memory report).
        make_program: builds the program of a key ``(size, variant)``.
        keys: the keys to capture; sizes sorted largest first at capture.
        factory: the graph factory (one pool for all graphs of an engine); None: no graphs.
        warmup: eager runs of each variant of the largest size before the first capture.
        progress: a tqdm bar over the captures.
    """

    def __init__(
        self,
        name: str,
        make_program: Callable[[Hashable], Program],
        keys: Sequence[tuple[int, bool]],
        factory: GraphFactory | None,
        *,
        warmup: int = 2,
        progress: bool = True,
    ) -> None:
        self.name = name
        self.make_program = make_program
        self.keys = sorted(set(keys), key=lambda k: (-k[0], k[1]))
        self.factory = factory
        self.warmup = warmup
        self.progress = progress
        self._programs: dict[Hashable, Program] = {}
        self.graphs: dict[Hashable, tuple[object, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.bytes: dict[Hashable, int] = {}
        """CUDA memory the allocator reserved for each capture (the pool's growth: outputs plus
        temporaries no earlier graph's memory could hold; 0 on the emulated backend)."""

    def program(self, key: Hashable) -> Program:
        if key not in self._programs:
            self._programs[key] = self.make_program(key)
        return self._programs[key]

    def capture(self) -> None:
        """Warm up, then capture every key, largest first, into the factory's pool.

        Raises:
            tgraph.CaptureError: a capture failed (this kind's graphs are dropped; the message
                names the key and the likely cause).
        """
        factory = self.factory
        if factory is None or not self.keys:
            return
        device = factory.device
        logger.info("%s graphs: before capture, %s", self.name, free_memory(device))
        start = time.perf_counter()
        key = self.keys[0]
        try:
            with torch.no_grad(), factory.side_stream():
                # Host syncs fail here with a clear error, before a CUDA capture is invalidated.
                with RefuseHostSync():  # every variant of the largest size: lazy inits happen here
                    for key in [k for k in self.keys if k[0] == self.keys[0][0]]:
                        for _ in range(self.warmup):
                            self.program(key)()
                factory.synchronize()
                bar = tqdm(self.keys, desc=f"capture {self.name} graphs", disable=not self.progress)
                for key in bar:
                    bar.set_postfix(size=key[0], sampling=key[1])
                    before = reserved_memory(device)
                    graph = factory.new_graph()
                    out = graph.capture(self.program(key))
                    self.graphs[key] = (graph, out)
                    factory.synchronize()
                    self.bytes[key] = reserved_memory(device) - before
            factory.synchronize()
        except BaseException as exc:
            self.graphs.clear()
            factory.synchronize()
            what = f"the {self.name} program for size {key[0]} (sampling={key[1]})"
            raise explain_capture_failure(what, exc) from exc
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "%s graphs: captured %d in %.2fs, %.1f MiB; after capture, %s",
            self.name,
            len(self.graphs),
            self.capture_seconds,
            sum(self.bytes.values()) / 2**20,
            free_memory(device),
        )

    def reset(self) -> None:
        """Drop every graph (their memory returns to the pool) and every program (built again
        at their next use, over the buffers they find then); programs run eagerly until
        :meth:`capture` runs again."""
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.bytes.clear()
        self._programs.clear()

    def captured(self, key: Hashable) -> bool:
        return key in self.graphs

    def run(self, key: Hashable) -> torch.Tensor:
        """Replay ``key``'s graph, or run its program eagerly when it has none.

        Returns:
            The program's output (a graph's static output: valid until the next ``run`` of any
            program of the pool; see the module docstring).
        """
        entry = self.graphs.get(key)
        if entry is None:
            with torch.no_grad():
                return self.program(key)()
        graph, out = entry
        graph.replay()
        return out
