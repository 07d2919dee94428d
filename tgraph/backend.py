"""Graph backends: one interface (`capture` a callable, `replay` it) over two implementations.

* ``"cuda"`` wraps :class:`torch.cuda.CUDAGraph`: kernels are recorded once and replayed on the
  same memory addresses.
* ``"emulated"`` is a CPU stand-in with the one property that matters for correctness: a replay
  re-runs the captured function on the captured static buffers and writes every result into the
  output tensors the *capture* produced. Nothing else is refreshed. A
  forgotten input copy, a stale buffer or an output overwritten by the next replay therefore
  breaks a CPU test exactly as it breaks a GPU run. It also refuses host syncs during capture and
  freezes every generator not registered with the graph, as CUDA graphs do.

``"auto"`` picks ``"cuda"`` for CUDA tensors and ``"emulated"`` otherwise; the environment
variable ``TGRAPH_BACKEND`` overrides ``"auto"``.

Over 400 lines: both backends and their factory belong together, since the emulated graph is
the executable model of every CUDA-graph property the CPU tests rely on (static memory, frozen
generators and hyper-parameters, graph-relative RNG, pool reuse through tgraph.pool).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from tgraph.guards import RefuseHostReads, RefuseHostSync
from tgraph.pool import EmulatedPool, PoolLedger

BACKENDS = ("cuda", "emulated")


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


def _default_generators() -> list[torch.Generator]:
    return [torch.default_generator]


class EmulatedGraph:
    """CPU stand-in for :class:`torch.cuda.CUDAGraph` (see the module docstring).

    Args:
        watch: objects (typically parameters) whose Python attributes a real graph cannot change
            at replay; the emulated replay restores them afterwards, so Python side effects of the
            captured code (e.g. setting ``grad_added_to_main_grad``) are skipped as on a GPU.
        pool: the :class:`tgraph.pool.EmulatedPool` shared by the graphs of one factory; it
            poisons, at each replay, the memory a real graph of the same pool may overwrite.
        frees: the forward graph whose saved activations this (backward) graph's capture frees.
        freeze: modules whose ``training`` flags the replays see as they were at capture (a real
            graph replays the kernels of the capture's control flow, e.g. dropout on or off).
        external: tensors the function reads that live outside the pool (static inputs).
        frozen_values: dicts (optimizers' ``param_groups``) whose Python values the replays
            see as they were at capture: a CUDA graph bakes those floats into its kernels, so a
            learning rate that did not reach a tensor is frozen here exactly as on a GPU.
    """

    retains_autograd_graph = True

    def __init__(
        self,
        watch: Iterable[Any] = (),
        *,
        pool: EmulatedPool | None = None,
        frees: Any = None,
        freeze: Iterable[torch.nn.Module] = (),
        external: Iterable[torch.Tensor] = (),
        stamp: Callable[[], int] | None = None,
        frozen_values: Iterable[dict] = (),
    ) -> None:
        self._fn: Callable[[], Any] | None = None
        self._frozen_dicts = list(frozen_values)
        self._values: list[tuple[dict, dict]] = []
        self._outputs: list[Any] = []
        self._registered: list[torch.Generator] = []
        self._frozen: list[tuple[torch.Generator, torch.Tensor]] = []
        self._watch = list(watch)
        self._pool = pool
        self.frees = frees
        self._freeze = list(freeze)
        self._modes: list[tuple[torch.nn.Module, bool]] = []
        self._external = [t for t in (*self._watch, *external) if isinstance(t, torch.Tensor)]
        self._stamp = stamp
        self.index = 0
        self.live_outputs: list[Any] | None = None
        """Outputs of the latest run, with their autograd graph. A real graph's backward
        differentiates the capture's graph, whose saved activations every replay overwrites in
        place; differentiating the latest run's graph is the same computation on CPU."""

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Let replays advance ``generator`` (fresh random numbers each replay)."""
        if all(g is not generator for g in self._registered):
            self._registered.append(generator)

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once; its outputs become this graph's static memory. Returns its output."""
        self.index = self._stamp() if self._stamp is not None else 0
        known = _default_generators()
        from tgraph import rng  # local import: rng depends on nothing here, avoid a cycle

        known += [g for g in rng.extra_generators() if g.device.type == "cpu"]
        self._frozen = [
            (g, g.get_state()) for g in known if all(g is not r for r in self._registered)
        ]
        self._modes = [(m, m.training) for m in self._freeze]
        with RefuseHostSync(), RefuseHostReads(), emulated_capture(), self._rng_relative():
            out = fn()
        self._fn = fn
        self._outputs = tree_leaves(out)
        self.live_outputs = self._outputs
        self._values = [
            (d, {k: v for k, v in d.items() if k != "params"}) for d in self._frozen_dicts
        ]
        if self._pool is not None:
            self._pool.captured(self)
        return out

    def _rng_relative(self) -> contextlib.AbstractContextManager:
        """Model CUDA's graph-relative RNG positions for the default CPU generator (registered).

        A CUDA graph's random kernels draw at (the generator's offset when the graph replays) +
        (an offset within the graph baked at capture). ``torch.cuda.get_rng_state()`` inside a
        capture returns that within-graph offset, and ``set_rng_state`` inside another capture
        positions *that* graph's draws relative to *its* replay offset. So a state saved in one
        graph (``torch.utils.checkpoint``'s forward) and restored in another (its recompute in
        the backward graph) repeats the saved draws only if both graphs replay from the same
        generator offset. Here, a state read during a run is tagged with the generator state at
        the run's start; restoring it during a run that started elsewhere gives other numbers.
        """
        if all(g is not torch.default_generator for g in self._registered):
            return contextlib.nullcontext()
        return _relative_rng(torch.default_generator.get_state())

    def pool_outputs(self) -> list[torch.Tensor]:
        """The captured outputs: memory of the pool that this graph's replays write."""
        return [t.data for t in self._outputs if isinstance(t, torch.Tensor)]

    def external_tensors(self) -> list[torch.Tensor]:
        """Tensors the function reads that live outside the pool (parameters, static inputs)."""
        return self._external

    def replay(self) -> None:
        """Re-run the captured function and write its results into the captured outputs."""
        assert self._fn is not None, "replay() before capture()"
        if self._pool is not None:
            self._pool.replayed(self)
        attrs = [(obj, dict(vars(obj))) for obj in self._watch]
        live = [(g, g.get_state()) for g, _ in self._frozen]
        modes = [(m, m.training) for m, _ in self._modes]
        values = [(d, {k: d[k] for k in frozen if k in d}) for d, frozen in self._values]
        for g, state in self._frozen:  # unregistered generators replay the capture's numbers
            g.set_state(state)
        for d, frozen in self._values:  # the capture's hyper-parameters, baked in
            d.update(frozen)
        for m, training in self._modes:  # the capture's control flow, not today's flags
            m.training = training
        try:
            self.live_outputs = None
            with emulated_capture(), self._rng_relative():
                new = tree_leaves(self._fn())
            with torch.no_grad():
                for dst, src in zip(self._outputs, new, strict=True):
                    if isinstance(dst, torch.Tensor) and dst is not src:
                        dst.copy_(src)
            self.live_outputs = new
            if self._pool is not None:
                self._pool.ran(self)
        finally:
            for g, state in live:  # an unregistered generator does not advance at replay
                g.set_state(state)
            for m, training in modes:
                m.training = training
            for d, live_values in values:
                d.update(live_values)
            for obj, saved in attrs:
                vars(obj).clear()
                vars(obj).update(saved)

    def reset(self) -> None:
        self.__init__()


@contextlib.contextmanager
def emulated_capture() -> Iterator[None]:
    """``torch.cuda.is_current_stream_capturing()`` answers True, as under a real capture.

    Libraries branch on it to avoid host syncs while a graph is captured (Hugging Face's mask
    code does); an emulated capture, and its replays (which re-run the captured Python), must
    take the same branch as a CUDA capture. The attribute is replaced for the duration only.
    """
    modules = [torch.cuda, torch.cuda.graphs]
    saved = [m.is_current_stream_capturing for m in modules]
    for m in modules:
        m.is_current_stream_capturing = _capturing
    try:
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.is_current_stream_capturing = fn


def _capturing() -> bool:
    return True


_rng_bases: list[torch.Tensor] = []  # generator state at the start of each running graph


@contextlib.contextmanager
def _relative_rng(base: torch.Tensor) -> Iterator[None]:
    """See :meth:`EmulatedGraph._rng_relative`: inside, ``torch.get_rng_state()`` tags the state
    with ``base`` and ``torch.set_rng_state(state)`` of a state tagged with another base lands
    on other random numbers (as a CUDA graph replayed from another offset would)."""
    _rng_bases.append(base)
    saved = (torch.get_rng_state, torch.set_rng_state)
    if len(_rng_bases) == 1:
        torch.get_rng_state, torch.set_rng_state = _tagged_get_rng_state, _relative_set_rng_state
    try:
        yield
    finally:
        _rng_bases.pop()
        if not _rng_bases:
            torch.get_rng_state, torch.set_rng_state = saved


def _tagged_get_rng_state() -> torch.Tensor:
    state = torch.default_generator.get_state()
    state._tgraph_rng_base = _rng_bases[-1]
    return state


def _relative_set_rng_state(new_state: torch.Tensor) -> None:
    torch.default_generator.set_state(new_state)
    base = getattr(new_state, "_tgraph_rng_base", None)
    if base is not None and _rng_bases and not torch.equal(base, _rng_bases[-1]):
        torch.empty(1).random_()  # same position in the graph, another replay offset


class CudaGraph:
    """Thin wrapper of :class:`torch.cuda.CUDAGraph` with tgraph's capture discipline.

    Capture runs on ``stream`` into ``pool`` and never leaves a stream capturing if ``fn`` raises.
    """

    retains_autograd_graph = False
    live_outputs = None  # the backward differentiates the capture's graph (static memory)

    def __init__(
        self, pool: Any, stream: torch.cuda.Stream, stamp: Callable[[], int] | None = None
    ) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._pool = pool
        self._stream = stream
        self._stamp = stamp
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
                with contextlib.suppress(Exception):
                    self._graph.reset()
                _unstick_generators(self._stream.device)
                raise
            self._graph.capture_end()
        return out

    def replay(self) -> None:
        self._graph.replay()

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


class GraphFactory:
    """Makes graphs for one backend that share one memory pool and one capture stream.

    Args:
        backend: ``"cuda"`` or ``"emulated"`` (already resolved).
        device: device of the captured tensors.
    """

    def __init__(self, backend: str, device: torch.device | None = None) -> None:
        self.backend = backend
        self.device = device
        self.ledger = PoolLedger()  # capture indices and the replay-order guard (tgraph.pool)
        if backend == "cuda":
            gc.collect()  # see CudaGraph.capture
            self.pool = torch.cuda.graph_pool_handle()
            self.stream: torch.cuda.Stream | None = capture_stream(device)
            self.emulated_pool = None
        else:
            self.pool = None
            self.stream = None
            self.emulated_pool = EmulatedPool()

    def new_graph(
        self,
        watch: Iterable[Any] = (),
        *,
        frees: Any = None,
        freeze: Iterable[torch.nn.Module] = (),
        external: Iterable[torch.Tensor] = (),
        frozen_values: Iterable[dict] = (),
    ) -> EmulatedGraph | CudaGraph:
        """A graph of this factory's pool. The emulated-only arguments are documented on
        :class:`EmulatedGraph`; a CUDA graph gets that behaviour from the hardware."""
        if self.backend == "cuda":
            return CudaGraph(self.pool, self.stream, self.ledger.stamp)
        return EmulatedGraph(
            watch,
            pool=self.emulated_pool,
            frees=frees,
            freeze=freeze,
            external=external,
            stamp=self.ledger.stamp,
            frozen_values=frozen_values,
        )

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """Run warmups and captures on the capture stream (CUDA); a no-op when emulated."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        if self.backend == "cuda":
            torch.cuda.synchronize(self.device)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.backend == "cuda" else 0

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self.backend == "cuda" else 0
