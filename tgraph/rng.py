"""Random-number generators that graphs must register.

A CUDA graph bakes the generator's seed and offset of its capture into its kernels unless the
generator is registered with the graph (``CUDAGraph.register_generator_state``); then each replay
draws fresh numbers and advances the generator, as eager code would. PyTorch registers the
default CUDA generator by itself. tgraph registers, for every graph it captures:

* the default CPU generator (for the emulated backend), and
* every generator added with :func:`register_generator` -- e.g. the generator behind a
  model-parallel RNG tracker (megatron-core's ``CudaRNGStatesTracker`` built with
  ``use_cudagraphable_rng=True``), or any ``torch.Generator`` your layers pass to ``torch.rand``.

Example::

    g = torch.Generator(device="cuda")
    tgraph.register_generator(g)     # before tgraph.create_graphs()
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.function import FunctionCtx

_extra: list[torch.Generator] = []


def register_generator(generator: torch.Generator) -> None:
    """Register ``generator`` with every graph tgraph captures from now on.

    Args:
        generator: a ``torch.Generator`` that code inside graphed modules draws from.

    Raises:
        TypeError: ``generator`` is not a ``torch.Generator``.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"register_generator expects a torch.Generator, got {type(generator)}")
    if all(g is not generator for g in _extra):
        _extra.append(generator)


def unregister_generator(generator: torch.Generator) -> None:
    """Undo :func:`register_generator` (no error if it was not registered)."""
    _extra[:] = [g for g in _extra if g is not generator]


def extra_generators() -> list[torch.Generator]:
    """The generators added with :func:`register_generator`."""
    return list(_extra)


def graph_generators(device: torch.device) -> list[torch.Generator]:
    """Generators to register with a graph on ``device`` (the default CUDA one is implicit)."""
    gens = [g for g in _extra if g.device.type == device.type]
    if device.type != "cuda":
        gens.insert(0, torch.default_generator)
    return gens


def position(device: torch.device) -> bytes:
    """Where the generators a graph on ``device`` draws from stand now: two equal positions
    mean no random number was drawn from them in between."""
    gens = {id(g): g for g in (*graph_generators(device), default_generator(device))}
    return b"".join(g.get_state().numpy().tobytes() for g in gens.values())


def reader(device: torch.device) -> Callable[[], Any]:
    """A cheap :func:`position`, for two moments of one step: a function whose two equal
    results mean no random number was drawn in between from the generators a graph on
    ``device`` draws from (CUDA: their Philox offsets, which a replay advances on the host
    too; CPU: their states)."""
    gens = {id(g): g for g in (*graph_generators(device), default_generator(device))}
    reads = [
        g.get_offset if g.device.type == "cuda" else functools.partial(_state_bytes, g)
        for g in gens.values()
    ]
    if len(reads) == 1:
        return reads[0]
    return lambda: [read() for read in reads]


def _state_bytes(g: torch.Generator) -> bytes:
    return g.get_state().numpy().tobytes()


def get_states(device: torch.device | None) -> list[tuple[torch.Generator | None, torch.Tensor]]:
    """Snapshot every generator a capture may advance (to undo warmup and capture)."""
    states: list[tuple[torch.Generator | None, torch.Tensor]] = [
        (torch.default_generator, torch.default_generator.get_state())
    ]
    if device is not None and device.type == "cuda":
        states.append((None, torch.cuda.get_rng_state(device)))
    states += [(g, g.get_state()) for g in _extra]
    return states


def set_states(states: list[tuple[torch.Generator | None, torch.Tensor]], device) -> None:
    """Restore a snapshot taken by :func:`get_states`."""
    for g, state in states:
        if g is None:
            torch.cuda.set_rng_state(state, device)
        else:
            g.set_state(state)


def default_generator(device: torch.device) -> torch.Generator:
    """The generator ``torch.utils.checkpoint`` saves and restores for ``device``'s tensors."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


_regions = itertools.count(1)


def forward_region() -> int:
    """The custom ``autograd.Function`` whose ``forward`` this call runs in, innermost first,
    as a number (0: none). A reentrant checkpoint (``torch.utils.checkpoint`` with
    ``use_reentrant=True``, megatron's and DeepSpeed's) reads the generators' state as its
    forward starts, to restore it for its recompute: two calls in different regions have such
    a read between them. Walks the Python stack: for the recorded iteration only."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "forward" and code.co_argcount:
            ctx = frame.f_locals.get(code.co_varnames[0])
            if isinstance(ctx, FunctionCtx):
                region = ctx.__dict__.get("_tgraph_region")
                if region is None:  # numbered on the ctx: an id could be reused once it dies
                    region = ctx._tgraph_region = next(_regions)
                return region
        frame = frame.f_back
    return 0


def _checkpoint_hook(saved: Any) -> bool:
    hook = getattr(saved, "unpack_hook", None)
    return getattr(hook, "__module__", None) == "torch.utils.checkpoint"


def recomputes(outputs: list[torch.Tensor]) -> bool:
    """Whether the autograd graph behind ``outputs`` recomputes (non-reentrant
    ``torch.utils.checkpoint``: its saved tensors are unpacked by checkpoint's hook)."""
    seen: dict[int, Any] = {}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        for name in dir(node):
            if name.startswith("_raw_saved_"):
                v = getattr(node, name)
                if any(_checkpoint_hook(x) for x in (v if isinstance(v, (list, tuple)) else (v,))):
                    return True
        stack.extend(nxt for nxt, _ in node.next_functions)
    return False
