"""The emulated graph backend: a CPU stand-in for ``torch.cuda.CUDAGraph`` that replays a tape.

Every CPU test trusts this backend as its model of what a CUDA graph does, so it has a CUDA
graph's essential properties, not just its interface:

* **Replay runs no Python.** :meth:`EmulatedGraph.capture` runs the function once under a
  ``TorchDispatchMode`` that writes every ATen operation it executes onto a tape (the backward's too, since
  autograd dispatches its kernels on the same thread): the operator, its arguments and its
  outputs. :meth:`EmulatedGraph.replay` executes exactly that tape. A module attribute read in
  ``forward`` (``dropout.p``, a temperature), a hook, ``torch.func.functional_call``'s
  substituted weights, a Python branch, a global: each keeps its capture-time effect, as on a
  GPU.
* **Fixed addresses.** Tensors are taped by their memory, not by their Python object: the
  tape holds, for every tensor an operation read or wrote, a tensor on the same raw address
  (:func:`_Pins.pin`). Re-pointing a parameter (``p.data = other``) after capture leaves the
  replay reading the old memory, exactly like a CUDA graph. Each result of a replayed operation
  is written into the memory the capture's result occupied, so views stay views of the captured
  storage and a caller's reference to an output sees the next replay overwrite it.
* **Generators.** Registered generators draw fresh numbers at each replay; every other
  generator replays the capture's numbers. A state read inside a graph
  (``torch.get_rng_state``, as ``torch.utils.checkpoint`` does) is a position *within* that
  graph's replay: restoring it in another graph repeats its numbers only if both graphs replay
  from the same generator state, as on CUDA (graph-relative Philox offsets).
* **What a CUDA capture refuses is refused at capture**: host reads (``.item()``, ``bool``,
  ``torch.equal``, printing) and data-dependent shapes (``nonzero``, boolean-mask indexing,
  ``masked_select``, ``unique``), with :class:`tgraph.guards.CaptureError`.
* **One pool.** :class:`tgraph.pool.EmulatedPool` models the memory a CUDA graph of the same
  pool may reuse and poisons it (NaN) at each replay, so a replay order that is unsafe on a GPU
  corrupts the CPU test too (:mod:`tgraph.pool` explains the rule).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map

from tgraph.guards import CaptureError, RefuseHostReads, check_registered, refusal
from tgraph.pool import EmulatedPool, at_address, saved_activations

# Operations skipped at replay: their output holds no value a later operation may rely on.
_ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty"}


class _Pins:
    """Tensors on fixed raw addresses: how a graph sees the memory an operation touched.

    A pin is a tensor on a non-owning storage built from the captured tensor's data pointer,
    with the same dtype, size, stride and offset. It follows the *memory*: ``p.data = other``,
    ``o.data = o.data.clone()`` or a storage swap move the Python object, not the pin. Each
    captured storage is also kept alive (``keep``), so the memory behind a pin is never freed
    while the graph exists (a CUDA pool keeps its memory too).
    """

    def __init__(self) -> None:
        self._raw: dict[tuple[int, int, torch.device], torch.UntypedStorage] = {}
        self._pins: dict[tuple, torch.Tensor] = {}
        self.keep: dict[int, torch.UntypedStorage] = {}

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_nested or t.layout != torch.strided:
            raise CaptureError(
                f"a {t.layout} tensor{' (nested)' if t.is_nested else ''} inside the captured "
                "region: graphs hold strided dense tensors only. Run this module eagerly (e.g. "
                "nn.TransformerEncoder's nested-tensor fast path: enable_nested_tensor=False)"
            )
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        key = (ptr, nbytes, t.dtype, t.storage_offset(), tuple(t.shape), t.stride())
        pin = self._pins.get(key)
        if pin is not None:
            return pin
        raw = self._raw.get((ptr, nbytes, t.device))
        pin = at_address(t, raw)
        if raw is None:
            self._raw[(ptr, nbytes, t.device)] = pin.untyped_storage()
            self.keep.setdefault(storage._cdata, storage)
        self._pins[key] = pin
        return pin


class _Op:
    """One operation of the tape: run ``func`` on the pinned arguments, write fresh results into
    the memory the capture's results occupy (``outs``); views and in-place writes need no
    copy (they already touch the captured memory)."""

    __slots__ = ("func", "args", "kwargs", "copies", "collective")

    def __init__(self, func: Any, args: tuple, kwargs: dict, copies: list) -> None:
        self.func, self.args, self.kwargs, self.copies = func, args, kwargs, copies
        # A collective (DDP's gradient all-reduce) returns a Work handle that the captured code
        # waited on without an operation of its own: replay waits, so its result is in place.
        self.collective = func.namespace == "c10d"

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.copies or self.collective:
            flat = tree_leaves(result)
            for i, dst in self.copies:
                dst.copy_(flat[i])
            for work in flat if self.collective else ():
                if hasattr(work, "wait"):
                    work.wait()


class _RngMark:
    """A generator state read inside a captured region: the position within the graph."""

    __slots__ = ("state", "base")

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None  # the state at this position, latest replay
        self.base: torch.Tensor | None = None  # the state that replay started from


def _count_writes(schema: Any, args: tuple) -> None:
    """Bump the version counters of the tensors an in-place ``_foreach_`` op wrote: under a
    dispatch mode torch leaves them unchanged (without one, and on CUDA, they move), which hid
    a captured write to a learning-rate tensor from the emulated backend (found on the H200)."""
    for arg, value in zip(schema.arguments, args):
        if arg.alias_info is not None and arg.alias_info.is_write:
            for t in value if isinstance(value, list | tuple) else (value,):
                if isinstance(t, torch.Tensor):
                    torch.autograd.graph.increment_version(t)


class _TapeWriter(TorchDispatchMode):
    """Writes the operations a captured function executes onto the tape (see the module
    docstring)."""

    def __init__(self, graph: EmulatedGraph) -> None:
        super().__init__()
        self._graph = graph
        self.pins = _Pins()
        self.tape: list[Any] = []
        self.fresh: set[int] = set()  # data pointers of storages created during the capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = refusal(func, args, kwargs)
        if why is not None:
            raise CaptureError(
                f"host synchronization during graph capture: {func._schema.name} ({why}). A "
                "CUDA graph cannot contain it; move it out of the captured region."
            )
        gen = kwargs.get("generator")
        if gen is not None:
            check_registered(gen, self._graph._registered)
        out = func(*args, **kwargs)
        if func._schema.name.startswith("aten::_foreach_") and func._schema.is_mutable:
            _count_writes(func._schema, args)
        self.tape.append(self._to_op(func, args, kwargs, out))
        return out

    def _to_op(self, func: Any, args: tuple, kwargs: dict, out: Any) -> _Op | None:
        name = func._schema.name
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        copies = []
        for i, o in enumerate(tree_leaves(out)):
            if not isinstance(o, torch.Tensor):
                continue
            ptr = o.untyped_storage().data_ptr()
            if ptr in inputs:
                continue  # a view or an in-place result: already the captured memory
            self.fresh.add(ptr)
            copies.append((i, self.pins.pin(o)))
        schema = func._schema
        views = bool(schema.returns) and all(r.alias_info is not None for r in schema.returns)
        if name in _ALLOCATIONS or (views and not schema.is_mutable and not copies):
            return None  # an allocation or a declared view: nothing to execute at replay
        pin = self.pins.pin
        p_args, p_kwargs = tree_map(
            lambda x: pin(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )
        return _Op(func, p_args, p_kwargs, copies)


class EmulatedGraph:
    """CPU stand-in for :class:`torch.cuda.CUDAGraph` (see the module docstring).

    Args:
        pool: the :class:`tgraph.pool.EmulatedPool` shared by the graphs of one factory.
        frees: the forward graph whose saved activations this (backward) graph's capture frees.
        stamp: gives the capture index in the pool.
    """

    def __init__(
        self,
        *,
        pool: EmulatedPool | None = None,
        frees: EmulatedGraph | None = None,
        stamp: Callable[[], int] | None = None,
    ) -> None:
        self._pool = pool
        self.frees = frees
        self._stamp = stamp
        self.index = 0
        self._registered: list[torch.Generator] = []
        self._tape: list[Any] = []
        self._frozen: list[tuple[torch.Generator, torch.Tensor]] = []
        self._outputs: list[torch.Tensor] = []  # pins of the captured outputs
        self._saved: list[torch.Tensor] = []  # pins of the saved activations it allocated
        self._keep: dict[int, torch.UntypedStorage] = {}

    def register_generator_state(self, generator: torch.Generator) -> None:
        """Let replays advance ``generator`` (fresh random numbers each replay)."""
        if not self.registers(generator):
            self._registered.append(generator)

    def registers(self, generator: torch.Generator) -> bool:
        # by the C++ generator: a dispatch mode sees a new Python wrapper of the same one
        return any(g._cdata == generator._cdata for g in self._registered)

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` once, taping its operations; returns its output (static memory)."""
        from tgraph import rng  # rng imports nothing of ours; keep the import graph flat

        self.index = self._stamp() if self._stamp is not None else 0
        known = [torch.default_generator]
        known += [g for g in rng.extra_generators() if g.device.type == "cpu"]
        self._frozen = [(g, g.get_state()) for g in known if not self.registers(g)]
        writer = _TapeWriter(self)
        with emulated_capture(), _rng_positions(writer), RefuseHostReads(), writer:
            out = fn()
        self._tape = [op for op in writer.tape if op is not None]
        self._keep = writer.pins.keep
        leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        # only outputs on memory the capture allocated are the pool's: one on a parameter's or
        # a static input's memory (a parameter returned as is) is never reused by another graph
        self._outputs = [
            writer.pins.pin(t) for t in leaves if t.untyped_storage().data_ptr() in writer.fresh
        ]
        own = {t.untyped_storage().data_ptr() for t in leaves}
        self._saved = [
            writer.pins.pin(t)
            for t in saved_activations(leaves)
            if t.untyped_storage().data_ptr() in writer.fresh - own
        ]
        if self._pool is not None:
            self._pool.captured(self)
        return out

    def pool_outputs(self) -> list[torch.Tensor]:
        """The captured outputs' memory: what a replay writes and holds in the pool."""
        return self._outputs

    def saved_activations(self) -> list[torch.Tensor]:
        """The memory of the tensors autograd saved in this capture (a forward's)."""
        return self._saved

    def saved_activation_bytes(self, captured: int, output_bytes: int) -> int:
        del captured, output_bytes  # a CUDA graph's measure; here the saved tensors are known
        return sum(t.numel() * t.element_size() for t in self._saved)

    def replay(self) -> None:
        """Execute the tape: the captured operations on the captured memory, no Python."""
        if self._pool is not None:
            self._pool.replayed(self)
        live = [(g, g.get_state()) for g, _ in self._frozen]
        for g, state in self._frozen:  # an unregistered generator replays the capture's numbers
            g.set_state(state)
        base = torch.default_generator.get_state()
        try:
            with torch.no_grad(), _no_autocast():
                for op in self._tape:
                    if type(op) is _Op:
                        op.run()
                    else:
                        op(base)
        finally:
            for g, state in live:  # ... and does not advance
                g.set_state(state)
        if self._pool is not None:
            self._pool.ran(self)

    def reset(self) -> None:
        self.__init__(pool=None)


@contextlib.contextmanager
def _no_autocast() -> Iterator[None]:
    """The tape holds the capture's casts already: replay must not cast again."""
    with torch.autocast("cpu", enabled=False):
        if torch.cuda.is_available():
            with torch.autocast("cuda", enabled=False):
                yield
        else:
            yield


# ---------------------------------------------------------------------------- RNG positions


@contextlib.contextmanager
def _rng_positions(writer: _TapeWriter) -> Iterator[None]:
    """During capture, ``torch.get_rng_state`` / ``torch.set_rng_state`` (default generator)
    also mark and seek positions on the tape (module docstring, Generators)."""
    saved = (torch.get_rng_state, torch.set_rng_state)

    def get_rng_state() -> torch.Tensor:
        state = saved[0]()
        mark = _RngMark()
        state._tgraph_rng_mark = mark

        def at_replay(base: torch.Tensor) -> None:
            mark.state, mark.base = torch.default_generator.get_state(), base

        writer.tape.append(at_replay)
        return state

    def set_rng_state(new_state: torch.Tensor) -> None:
        saved[1](new_state)
        mark = getattr(new_state, "_tgraph_rng_mark", None)
        fixed = new_state.clone()

        def at_replay(base: torch.Tensor) -> None:
            if mark is None or mark.state is None:  # a state from outside the graph: baked in
                torch.default_generator.set_state(fixed)
                return
            torch.default_generator.set_state(mark.state)
            if not torch.equal(mark.base, base):  # same position, another replay offset
                torch.empty(1).random_()

        writer.tape.append(at_replay)

    torch.get_rng_state, torch.set_rng_state = get_rng_state, set_rng_state
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = saved


# ----------------------------------------------------------------- is_current_stream_capturing


@contextlib.contextmanager
def emulated_capture() -> Iterator[None]:
    """``torch.cuda.is_current_stream_capturing()`` answers True to the captured code.

    Libraries branch on it to avoid host syncs while a graph is captured (Hugging Face's mask
    code does), so an emulated capture must take the branch a CUDA capture takes. torch's own
    optimizers ask it to refuse a CUDA capture of a non-capturable step; the emulated graph's
    tensors are CPU tensors, for which a CUDA capture is no concern, so an optimizer asking (a
    method of a ``torch.optim.Optimizer``) and every other thread get the true answer. The
    attribute is replaced for the duration only. The eager warmup passes before a capture run
    under it on every backend (:func:`tgraph.layers.capture.run_warmup`): they run the branch
    the capture will run, and the pass that refuses host syncs checks that branch, not eager's
    (HF's mask code syncs on the host outside a capture only).
    """
    modules = [torch.cuda, torch.cuda.graphs]
    saved = [m.is_current_stream_capturing for m in modules]
    original = saved[0]
    thread = threading.get_ident()  # the capturing thread; autograd runs CPU backward on it

    def capturing() -> bool:
        if threading.get_ident() != thread or _asked_by_optimizer(sys._getframe(1)):
            return original() if torch.cuda.is_available() else False
        return True

    for m in modules:
        m.is_current_stream_capturing = capturing
    try:
        yield
    finally:
        for m, fn in zip(modules, saved):
            m.is_current_stream_capturing = fn


def _asked_by_optimizer(frame: Any, depth: int = 3) -> bool:
    """Whether a method of a ``torch.optim.Optimizer`` (within ``depth`` frames) asks."""
    for _ in range(depth):
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), torch.optim.Optimizer):
            return True
        frame = frame.f_back
    return False


# ------------------------------------------------------------------------------ the backend


class EmulatedBackend:
    """The emulated member of :class:`tgraph.backend.Backend`: graphs of one
    :class:`tgraph.pool.EmulatedPool`, captured on the current thread (no streams, no device memory
    counters)."""

    name = "emulated"
    executes_capture = True  # the capture runs the function once, taping it
    default_warmup = 1
    min_warmup = 0

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.pool = EmulatedPool()

    def new_graph(self, stamp: Callable[[], int], frees: Any = None) -> EmulatedGraph:
        return EmulatedGraph(pool=self.pool, frees=frees, stamp=stamp)

    def side_stream(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        pass

    def memory_allocated(self) -> int:
        return 0

    def max_memory_allocated(self) -> int:
        return 0


__all__ = ["EmulatedBackend", "EmulatedGraph", "emulated_capture"]
