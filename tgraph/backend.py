"""Graph backends: one interface (`capture` a callable, `replay` it) over two implementations.

* ``"cuda"`` (:class:`CudaBackend`, here) wraps :class:`torch.cuda.CUDAGraph`: kernels are
  captured once and replayed on the same memory addresses.
* ``"emulated"`` (:class:`tgraph.emulated.EmulatedBackend`) is a CPU stand-in that writes the
  ATen operations of the capture onto a tape and replays that tape on the captured memory, running no
  Python, as a CUDA graph.

``"auto"`` picks ``"cuda"`` for CUDA tensors and ``"emulated"`` otherwise; the environment
variable ``TGRAPH_BACKEND`` overrides ``"auto"``. That choice is made here only
(:func:`resolve_backend`, :meth:`GraphFactory.for_device`); everything that differs between the
two backends is a member of the :class:`Backend` protocol, so callers ask the factory's
backend (``factory.executes_capture``, ``factory.warmup_steps(...)``) instead of testing a
device type or a backend name.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from tgraph.emulated import EmulatedBackend
from tgraph.pool import PoolLedger

BACKENDS = ("cuda", "emulated")
BACKEND_CHOICES = ("auto", *BACKENDS)


def check_backend_name(backend: str) -> None:
    """Refuse a ``backend=`` argument that names no backend (before any device is known).

    Raises:
        ValueError: not ``"auto"``, ``"cuda"`` or ``"emulated"``.
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'cuda' or 'emulated'")


def resolve_backend(backend: str, device: torch.device | str | None) -> str:
    """Turn ``"auto"`` into a concrete backend for tensors on ``device``.

    Args:
        backend: ``"auto"``, ``"cuda"`` or ``"emulated"``.
        device: device of the tensors that will be captured.

    Returns:
        ``"cuda"`` or ``"emulated"``.

    Raises:
        ValueError: unknown backend name, or ``"cuda"`` for non-CUDA tensors.
    """
    if backend == "auto":
        env = os.environ.get("TGRAPH_BACKEND", "").strip()
        if env:
            backend = env
        else:
            is_cuda = device is not None and torch.device(device).type == "cuda"
            backend = "cuda" if is_cuda else "emulated"
    if backend not in BACKENDS:
        raise ValueError(
            f"unknown graph backend {backend!r}; expected one of 'auto', 'cuda', 'emulated' "
            "(check the backend= argument and the TGRAPH_BACKEND environment variable)"
        )
    if backend == "cuda" and (device is None or torch.device(device).type != "cuda"):
        raise ValueError(
            f"backend 'cuda' needs CUDA tensors, but the tensors are on {device}; move the model "
            "to a GPU or use backend='emulated'"
        )
    return backend


class CudaGraph:
    """Thin wrapper of :class:`torch.cuda.CUDAGraph` with tgraph's capture discipline.

    Capture runs on ``stream`` into ``pool`` and never leaves a stream capturing if ``fn`` raises.
    """

    def __init__(
        self,
        pool: Any,
        stream: torch.cuda.Stream,
        stamp: Callable[[], int] | None = None,
        failed: list | None = None,
    ) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool
        self._stream = stream
        self._stamp = stamp
        self._failed = failed if failed is not None else []
        self.index = 0  # capture index in the pool (tgraph.pool)

    def register_generator_state(self, generator: torch.Generator) -> None:
        self._graph.register_generator_state(generator)

    def capture(self, fn: Callable[[], Any]) -> Any:
        # A garbage collection inside the capture could free CUDA memory of unrelated tensors
        # and invalidate it; GraphFactory collects once up front, and the capture runs without.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._capture(fn)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _capture(self, fn: Callable[[], Any]) -> Any:
        self.index = self._stamp() if self._stamp is not None else 0
        with torch.cuda.stream(self._stream):
            self._graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                out = fn()
            except BaseException:
                with contextlib.suppress(Exception):
                    self._graph.capture_end()
                # Older PyTorch's capture_end checks cudaStreamEndCapture before it stops
                # routing allocations to the pool, so an invalidated capture (a CPU copy, a
                # host sync) left the pool's capture underway for the next capture into it.
                # Newer PyTorch stops it first; then this raises, and is ignored.
                with contextlib.suppress(Exception):
                    torch._C._cuda_endAllocateToPool(self._stream.device.index, self._pool)
                # Not reset: a reset gives back the graph's hold on the shared pool, and when a
                # pool's first capture fails, blocks it allocated may still be alive; the pool
                # then stays with no holder and the next capture into it trips the caching
                # allocator's `use_count > 0` assert (seen on the H200, torch 2.11). The failed
                # graph is kept with the pool's other graphs until they are dropped together.
                self._failed.append(self._graph)
                self._graph = torch.cuda.CUDAGraph()
                _unstick_generators(self._stream.device)
                raise
            self._graph.capture_end()
        return out

    def replay(self) -> None:
        self._graph.replay()

    def saved_activation_bytes(self, captured: int, output_bytes: int) -> int:
        """What a forward's capture allocated beyond its outputs: its saved activations."""
        return max(0, captured - output_bytes)

    def reset(self) -> None:
        self._graph.reset()


@contextlib.contextmanager
def stale_stream_override() -> Iterator[None]:
    """Let autograd redirect stale AccumulateGrad streams during a capture (newer PyTorch).

    An AccumulateGrad node remembers the stream it was created on. Nodes created eagerly on the
    default stream and kept alive (by DDP's reducer, megatron-core DDP's hooks, or a live
    ``loss``) make a captured backward sync with the default stream, which invalidates the
    capture (cudaErrorStreamCaptureImplicit). PyTorch versions with
    ``torch.autograd.graph.set_override_stale_capture_stream`` can redirect those syncs to the
    capturing stream; this enables it for the duration of the capture only. Per-layer graphs
    avoid the problem altogether (they differentiate fresh parameter aliases).
    """
    setter = getattr(torch._C, "_set_override_stale_capture_stream", None)
    getter = getattr(torch._C, "_override_stale_capture_stream", None)
    if setter is None or getter is None:
        yield
        return
    before = getter()
    setter(True)
    try:
        yield
    finally:
        setter(before)


def _unstick_generators(device: torch.device) -> None:
    """After an aborted capture, give CUDA generators a fresh state object.

    ``capture_end`` raises before it ends the generators' capture mode when the capture was
    invalidated, leaving them "capturing" ("Offset increment outside graph capture encountered
    unexpectedly" at the next random op). A cloned state carries seed and offset, not the flag.
    """
    from tgraph import rng

    gens = [torch.cuda.default_generators[device.index or 0]]
    gens += [g for g in rng.extra_generators() if g.device.type == "cuda"]
    for g in gens:
        with contextlib.suppress(Exception):
            g.graphsafe_set_state(g.clone_state())


_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device | str | int | None = None) -> torch.cuda.Stream:
    """The side stream on which tgraph warms up and captures every graph on ``device``.

    One stream per device for the whole process. Build a DDP wrapper (torch or megatron-core)
    under it when you capture whole steps with :class:`tgraph.FullIterationGraph`: DDP keeps
    the parameters' AccumulateGrad nodes alive, and a node created on the default stream makes
    a captured backward sync with that stream, which invalidates the capture::

        with torch.cuda.stream(tgraph.capture_stream()):
            model = DistributedDataParallel(model)
    """
    index = torch.device("cuda", torch.cuda.current_device()) if device is None else device
    index = torch.device(index).index if not isinstance(index, int) else index
    if index is None:
        index = torch.cuda.current_device()
    if index not in _capture_streams:
        _capture_streams[index] = torch.cuda.Stream(device=index)
    return _capture_streams[index]


class Backend(Protocol):
    """What differs between graph backends, for the graphs of one pool on one device.

    Implemented by :class:`CudaBackend` (here) and :class:`tgraph.emulated.EmulatedBackend`.
    """

    name: str
    """``"cuda"`` or ``"emulated"``."""
    executes_capture: bool
    """Whether a capture runs the captured function once (emulated: it tapes what it runs)
    or only captures kernels (CUDA: nothing executes until the first replay)."""
    default_warmup: int
    """Eager warmup passes before a per-layer capture when the user sets none."""
    min_warmup: int
    """The fewest warmup passes a capture needs (CUDA: 1, for lazy initialisation and the
    host-sync check; emulated: 0)."""

    def new_graph(self, stamp: Callable[[], int], frees: Any = None) -> Any:
        """A graph of this backend's pool (``capture``, ``replay``, ``reset``, ...)."""

    def side_stream(self) -> AbstractContextManager[None]:
        """Where warmups and captures run (CUDA: the capture stream)."""

    def synchronize(self) -> None: ...

    def memory_allocated(self) -> int: ...

    def max_memory_allocated(self) -> int: ...


class CudaBackend:
    """Real CUDA graphs of one pool, captured on the device's capture stream."""

    name = "cuda"
    executes_capture = False
    default_warmup = 2
    min_warmup = 1

    def __init__(self, device: torch.device | None) -> None:
        self.device = device
        gc.collect()  # see CudaGraph.capture
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = capture_stream(device)
        self.failed: list = []  # graphs whose capture failed, holding the pool (CudaGraph)

    def new_graph(self, stamp: Callable[[], int], frees: Any = None) -> CudaGraph:
        del frees  # a CUDA pool tracks its own memory
        return CudaGraph(self.pool, self.stream, stamp, self.failed)

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


def make_backend(backend: str, device: torch.device | None) -> Backend:
    """The :class:`Backend` of an already resolved name (:func:`resolve_backend`)."""
    if backend == "cuda":
        return CudaBackend(device)
    if backend == "emulated":
        return EmulatedBackend(device)
    raise ValueError(f"unknown graph backend {backend!r}; expected 'cuda' or 'emulated'")


class GraphFactory:
    """Makes graphs for one backend that share one memory pool and one capture stream.

    Args:
        backend: ``"cuda"`` or ``"emulated"`` (already resolved; :meth:`for_device` resolves).
        device: device of the captured tensors.

    The backend's differences are read through the factory: :attr:`executes_capture`,
    :meth:`warmup_steps`, :meth:`side_stream`, :meth:`synchronize`, the memory counters.
    """

    def __init__(self, backend: str, device: torch.device | None = None) -> None:
        self.impl: Backend = make_backend(backend, device)
        self.backend = self.impl.name
        self.device = device
        self.ledger = PoolLedger()  # capture indices and the replay-order guard (tgraph.pool)

    @classmethod
    def for_device(cls, backend: str, device: torch.device) -> GraphFactory:
        """The factory for ``backend`` (``"auto"`` resolved for tensors on ``device``)."""
        return cls(resolve_backend(backend, device), device)

    @property
    def executes_capture(self) -> bool:
        """Whether a capture runs the function once (emulated), so its effects happened."""
        return self.impl.executes_capture

    def warmup_steps(self, requested: int | None) -> int:
        """Eager warmup passes before a capture: ``requested`` (None: the backend's default),
        at least the backend's minimum."""
        if requested is None:
            return self.impl.default_warmup
        return max(requested, self.impl.min_warmup)

    def new_graph(self, *, frees: Any = None) -> Any:
        """A graph of this factory's pool; ``frees``: the forward graph whose saved activations
        this backward graph's capture frees (the emulated pool model needs it)."""
        return self.impl.new_graph(self.ledger.stamp, frees)

    def side_stream(self) -> AbstractContextManager[None]:
        """Run warmups and captures on the capture stream (CUDA); a no-op when emulated."""
        return self.impl.side_stream()

    def synchronize(self) -> None:
        self.impl.synchronize()

    def memory_allocated(self) -> int:
        return self.impl.memory_allocated()

    def max_memory_allocated(self) -> int:
        return self.impl.max_memory_allocated()
