"""One shared memory pool: which replays may overwrite what, guarded and modelled.

Graphs captured into one pool may reuse memory that was free *when they were captured*. Number
the captures in order (the *capture index*). A tensor a capture allocates lives in the pool from
that capture until the capture that frees it:

* a graph's **outputs** (static outputs, input and parameter gradients) are held by tgraph and
  never freed: every graph captured *before* them may have used that memory for its own
  temporaries, so replaying an earlier-captured graph overwrites them;
* a forward graph's **saved activations** are freed when its backward graph is captured (autograd
  releases them): graphs captured before the forward *or after the backward* may overwrite them,
  and only graphs captured in between cannot.

So while a unit (a runner or a merged stack) awaits its backward, replaying a graph is safe only
if it was captured between that unit's forward and backward captures; while the caller holds
outputs of a unit, only graphs captured after it are safe. Replaying in the
recorded order always satisfies this (each graph was captured exactly where it now replays),
which is why capturing in execution order lets every graph share one pool. Any other order is
checked by :class:`PoolLedger` at every replay:

* outputs the caller still holds are moved out of the pool (one clone each, into the tensors the
  caller holds) before a replay that may overwrite them: the loss a training loop keeps in a
  variable until the next step, or outputs kept while other graphs run out of recorded order.
  Only the unit's own next replay overwrites its outputs, as documented;
* a forward that is unsafe for a unit awaiting its backward runs eagerly instead (with the once-per-reason warning; ``strict=True``
  raises), which is always possible because nothing has been overwritten yet;
* a backward that is unsafe for another unit's saved activations (backwards of nested units run
  out of nesting order) still replays, since its own inputs are intact, but marks the other unit:
  that unit's backward then raises instead of returning gradients computed from overwritten
  activations.

:class:`EmulatedPool` is the emulated backend's model of the same pool, so CPU tests see what CUDA
does: at every replay it overwrites, with poison (NaN for floats), every output and every
saved activation that the replayed graph *may* reuse on a GPU. The model is the worst case of the
caching allocator, and it knows nothing about :class:`PoolLedger`: with the ledger's check
removed, a replay order that corrupts on a GPU corrupts on the CPU too.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from tgraph.errors import ReplayOrderError

NEVER = math.inf  # capture index of a backward that does not exist (no-grad calls)


class PoolLedger:
    """Live units of one pool and the capture-index window in which replays are safe for them.

    A *flight* (:class:`tgraph.layers.replay.Flight`) enters the ledger when a captured unit's
    forward replays and leaves when its backward has replayed (or its autograd graph is freed);
    the outputs a replay returns enter it as :class:`LiveOutputs` until they are freed. The
    ledger knows a unit only as an ``owner`` (an object compared by identity: its replay
    state), a name for messages and capture indices: it calls nothing of the unit's but the
    ``rescue`` callable a backward hands it (:meth:`hold_grads`).
    """

    def __init__(self) -> None:
        self.clock = 0
        # id(flight) -> (owner, name, lowest safe index, highest safe index)
        self._live: dict[int, tuple[Any, str, int, float]] = {}
        self._clobbered: dict[int, str] = {}  # id(flight) -> the graph that overwrote it
        # id(token) -> (owner, low, weak reference to the token): the outputs keep their token
        # alive, the ledger must not (a token whose outputs are all freed leaves at once)
        self._held: dict[int, tuple[Any, int, weakref.ref]] = {}
        # id(owner) -> (its rescue of the handed-out gradients, its backward's index, the
        # buffers' storages and the uses of them that are tgraph's own)
        self._grads: dict[int, tuple[Callable[[], None], float, tuple[int, ...], int]] = {}

    def stamp(self) -> int:
        """The capture index of the next capture."""
        self.clock += 1
        return self.clock

    def enter(self, key: int, owner: Any, name: str, low: int, high: float) -> None:
        """Flight ``key`` of ``owner`` awaits its backward: replays of captures strictly
        between ``low`` (its forward) and ``high`` (its backward) are safe for it."""
        self._live[key] = (owner, name, low, high)

    def hold_outputs(self, token: LiveOutputs, owner: Any, low: int) -> None:
        """``owner``'s returned outputs are alive while ``token`` is (:class:`LiveOutputs`)."""
        self._held[id(token)] = (owner, low, weakref.ref(token))

    def hold_grads(
        self,
        owner: Any,
        low: float,
        rescue: Callable[[], str | None],
        storages: tuple[int, ...],
        own: int,
    ) -> None:
        """``owner``'s backward (capture ``low``) handed autograd aliases of its gradient
        buffers (parameters' and inputs': ``storages``, ``UntypedStorage._cdata``, used ``own``
        times in all by tgraph); ``rescue`` moves them out (:meth:`tgraph.layers.grads.GradHandOff.rescue`),
        called only while something else still views one; it returns why it could not, or
        None."""
        self._grads[id(owner)] = (rescue, low, storages, own)

    def rescue_outputs(self, index: float, owner: Any) -> str | None:
        """Before ``owner`` replays a graph of capture ``index``: move what the caller holds
        out of the memory that graph may reuse: outputs of other units, and gradients (a
        parameter's ``.grad``, an input gradient the caller kept) that are aliases of a
        backward's static buffers (``owner``'s own too: its backward rewrites them, its forward
        may reuse them). Returns why a gradient
        could not be moved (the replay must not run), else None."""
        if self._held:
            for ref in [
                r for other, low, r in self._held.values() if other is not owner and index <= low
            ]:
                token = ref()
                if token is not None:  # a freed token has left the ledger (its __del__)
                    token.rescue()  # leaves the ledger
        if self._grads:
            for key in [k for k, entry in self._grads.items() if index <= entry[1]]:
                rescue, _, storages, own = self._grads[key]
                why = rescue() if sum(map(_use_count, storages)) > own else None
                if why is not None:  # still held: kept, so the next replay asks again
                    return why
                del self._grads[key]
        return None

    def leave(self, key: int) -> None:
        self._live.pop(key, None)
        self._held.pop(key, None)
        self._clobbered.pop(key, None)

    def conflicts(self, index: float, skip: Any = None) -> list[tuple[int, str]]:
        """Live flights (``(id, name)``) whose memory a replay of capture ``index`` may
        overwrite."""
        return [
            (fid, name)
            for fid, (owner, name, low, high) in self._live.items()
            if owner is not skip and not (low < index < high)
        ]

    def unsafe_forward(self, owner: Any, index: int) -> str | None:
        """Why replaying ``owner``'s forward (capture ``index``) now could corrupt another
        unit; None when safe."""
        found = self.conflicts(index, skip=owner) if self._live else None
        if not found:
            if self._held or self._grads:
                return self.rescue_outputs(index, owner)
            return None
        return (
            f"replay order differs from the recorded one: {found[0][1]} awaits its backward, "
            "which reads memory of the shared graph pool that this graph was captured to reuse "
            "(tgraph.pool explains which orders are safe)"
        )

    def before_backward(self, key: int, owner: Any, name: str, index: float) -> None:
        """Check that the saved activations of flight ``key`` are intact; mark those its
        backward (capture ``index``) overwrites."""
        culprit = self._clobbered.get(key)
        if culprit is not None:
            raise ReplayOrderError(
                f"the saved activations of {name} were overwritten by the backward graph of "
                f"{culprit}, which ran while {name} still awaited its backward. Graphs share one "
                "memory pool and are safe only in the recorded order. Run the backwards in "
                "reverse order of the forwards, as recorded (one backward of a loss over all "
                "outputs does that), or record the order you run: tgraph.reset(), one eager "
                "iteration, tgraph.create_graphs()."
            )
        why = self.rescue_outputs(index, owner)
        if why is not None:
            raise ReplayOrderError(f"the backward of {name} cannot replay: {why}")
        for fid, _ in self.conflicts(index, skip=owner):
            self._clobbered[fid] = name


class LiveOutputs:
    """Attached to the tensors a graphed call returns; the ledger counts them alive until
    every one of them is freed, or until :meth:`rescue` moves them out of the pool."""

    __slots__ = ("ledger", "refs", "__weakref__")

    def __init__(
        self, ledger: PoolLedger, owner: Any, low: int, outputs: list[torch.Tensor]
    ) -> None:
        self.ledger = ledger
        self.refs = [weakref.ref(o) for o in outputs]
        for o in outputs:
            o._tgraph_alive = self
        ledger.hold_outputs(self, owner, low)

    @torch.no_grad()
    def rescue(self) -> None:
        """Give every output still alive its own copy of its values (same tensor object, same
        autograd identity), so no replay can overwrite them."""
        for ref in self.refs:
            o = ref()
            if o is not None:
                o.data = o.data.clone()
        self.ledger.leave(id(self))

    def __del__(self) -> None:
        self.ledger.leave(id(self))

    def __reduce__(self):
        """An output's deep copy, pickle or ``torch.save`` is new memory, outside the pool: its
        copy of this token holds nothing (a shallow ``copy.copy`` shares the memory and the token)."""
        return set, ()  # a global torch.load(weights_only=True) takes: an empty set


class PoolGraph(Protocol):
    """What :class:`EmulatedPool` reads of a graph (:class:`tgraph.emulated.EmulatedGraph`)."""

    index: int  # its capture index
    frees: Any  # the forward graph whose saved activations its capture freed (a backward's)

    def pool_outputs(self) -> list[torch.Tensor]: ...

    def saved_activations(self) -> list[torch.Tensor]: ...


class EmulatedPool:
    """The emulated backend's worst-case model of a CUDA graph pool (the module docstring states
    the rule).

    Each graph tells the pool what it allocated at capture (its outputs; a forward's saved
    activations) and which forward's saved activations its capture freed (a backward's
    ``frees``). At every replay, the pool poisons every output and every live saved activation
    that the replayed graph may reuse on a GPU.
    """

    def __init__(self) -> None:
        self._graphs: list[weakref.ref] = []  # every graph of the pool, in capture order
        self._regions: dict[int, _Region] = {}  # id(forward graph) -> its saved activations

    def captured(self, graph: PoolGraph) -> None:
        self._graphs.append(weakref.ref(graph))
        self._regions[id(graph)] = _Region(graph)
        freed = graph.frees
        if freed is not None and id(freed) in self._regions:
            self._regions[id(freed)].high = graph.index
            self._regions[id(freed)].filled = False

    def replayed(self, graph: PoolGraph) -> None:
        """``graph`` is about to replay: poison what it may overwrite on a GPU."""
        index = graph.index
        for ref in self._graphs:
            other = ref()
            if other is not None and other is not graph and other.index > index:
                for t in other.pool_outputs():
                    poison_(t)
        freed = graph.frees
        for key, region in self._regions.items():
            if key == id(graph) or (freed is not None and key == id(freed)):
                continue
            if region.filled and not (region.low < index < region.high):
                region.poison()
                region.filled = False

    def ran(self, graph: PoolGraph) -> None:
        """``graph`` replayed: a forward's saved activations are live, a backward's dead."""
        region = self._regions.get(id(graph))
        if region is not None:
            region.filled = True
        freed = graph.frees
        if freed is not None and id(freed) in self._regions:
            self._regions[id(freed)].filled = False


class _Region:
    """The saved activations of one forward graph: allocated at its capture (``low``), freed at
    its backward's capture (``high``)."""

    def __init__(self, graph: PoolGraph) -> None:
        self.graph = weakref.ref(graph)
        self.low = graph.index
        self.high: float = NEVER
        self.filled = True  # the capture's own activations, until the backward capture

    def poison(self) -> None:
        graph = self.graph()
        if graph is not None:
            for t in graph.saved_activations():
                poison_(t)


@torch.no_grad()
def poison_(t: torch.Tensor) -> None:
    """Overwrite ``t`` with values no computation gives by chance (no version-counter bump:
    a graph replay does not bump them either)."""
    t = t.data
    if t.is_floating_point() or t.is_complex():
        t.fill_(math.nan)
    elif t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def saved_activations(outputs: list[Any]) -> list[torch.Tensor]:
    """Tensors saved for backward anywhere in the autograd graph behind ``outputs``."""
    found: list[torch.Tensor] = []
    seen: dict[int, Any] = {}  # keep visited node wrappers alive (ids are recycled otherwise)
    stack = [o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        # The packed values (_raw_saved_*), never the unpacked ones: unpacking a tensor saved
        # under torch.utils.checkpoint would recompute it. A checkpoint keeps only its inputs.
        names = [n for n in dir(node) if n.startswith("_raw_saved_")]
        if not names and hasattr(type(node), "saved_tensors"):  # a custom Function's context
            names = ["saved_tensors"]
        values = []
        for n in names:  # none where a backward freed them (a custom Function raises then)
            with contextlib.suppress(RuntimeError):
                values.append(getattr(node, n))
        for v in values:
            for t in v if isinstance(v, (tuple, list)) else (v,):
                found += _packed_tensors(t)
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


def _packed_tensors(saved: Any) -> list[torch.Tensor]:
    """The tensors a saved value keeps alive: itself, or for a tensor packed by
    ``torch.utils.checkpoint`` (a holder, recomputed at backward) the checkpoint's inputs."""
    if isinstance(saved, torch.Tensor):
        return [saved]
    data = getattr(saved, "data", None)  # a torch._C._autograd.SavedTensor
    if isinstance(data, torch.Tensor):
        return [data]
    hook = getattr(saved, "unpack_hook", None)
    cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ())) if hook else {}
    frame = cells["frame"].cell_contents if "frame" in cells else None
    out = []
    for arg in getattr(frame, "saved_args", None) or ():
        t = getattr(arg, "data", arg)
        if isinstance(t, torch.Tensor):
            out.append(t)
    return out


def storage_uses(t: torch.Tensor) -> int:
    """How many tensors (and storage objects) use ``t``'s memory."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_use_count = torch._C._storage_Use_Count


def use_counts(storages: tuple[int, ...]) -> tuple[int, ...]:
    """How many tensors use each of ``storages`` (``UntypedStorage._cdata`` of storages that
    something else keeps alive): one C call each, no storage object made."""
    return tuple(map(_use_count, storages))


def move_memory_out(t: torch.Tensor, keep: list[torch.Tensor]) -> None:
    """Give every other tensor on ``t``'s memory a copy of it, while the tensors in ``keep``
    (tgraph's own: a static buffer and those sharing it) keep the memory, which a graph writes.
    One copy. Needs ``UntypedStorage._swap_data_ptr_`` (PyTorch >= 2.13)."""
    held = t.untyped_storage()
    graph_memory = held.clone()
    held._swap_data_ptr_(graph_memory)  # every tensor on it now views the copy ...
    with torch.no_grad():
        for x in keep:  # ... except those, which keep the graph's memory
            x.set_(graph_memory, x.storage_offset(), x.shape, x.stride())


def at_address(t: torch.Tensor, raw: torch.UntypedStorage | None = None) -> torch.Tensor:
    """A tensor on ``t``'s memory (its raw address, as a graph sees it) that does not follow
    ``t``: ``p.data = ...`` or a storage swap move ``t``, not this tensor. The memory is not
    owned: the caller keeps it alive. ``raw``: a non-owning storage of ``t``'s storage, reused."""
    storage = t.untyped_storage()
    if raw is None:
        raw = torch._C._construct_storage_from_data_pointer(
            storage.data_ptr(), t.device, storage.nbytes()
        )
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(raw, t.storage_offset(), t.shape, t.stride())
