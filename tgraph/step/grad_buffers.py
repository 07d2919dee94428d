"""Where a captured optimizer step reads the gradients, and how each replay gets them there.

A CUDA graph reads fixed addresses, while autograd hands over new ``.grad`` tensors. Gradients
that per-layer graphs hand over are read where those graphs leave them, at an address that stays
(:attr:`tgraph.layers.grads.GradHandOff.bufs`): no copy and no buffer of the step's own.
Every other gradient gets a buffer of the step's own (one flat allocation per device and dtype),
into which each replay copies the ``.grad`` tensors not already there, with one multi-tensor
copy. A gradient that per-layer graphs handed over may still be viewed from elsewhere (kept by
a hook) when the step's gradient is another tensor (accumulated into a copy); a replay that
would copy into that memory then says so (:meth:`GradBuffers.refresh`), and the step runs
eagerly instead of overwriting it.
Used by :class:`tgraph.OptimizerGraph`'s default ``bind_grads`` and ``refresh_grads``.
"""

from __future__ import annotations

import logging
from itertools import compress, repeat
from operator import attrgetter, is_, is_not, ne, or_

import torch

from tgraph.layout import LayoutGuards, ptrs_equal
from tgraph.pool import at_address

# A tensor on a raw address (below) needs this private constructor; without it every gradient
# gets a buffer of the step's own.
_RAW_STORAGE = hasattr(torch._C, "_construct_storage_from_data_pointer")
_GRAD = attrgetter("grad")
_data_ptr, _stride, _size = torch.Tensor.data_ptr, torch.Tensor.stride, torch.Tensor.size
logger = logging.getLogger(__name__)


def _gradient_hand_offs() -> list:
    """Every captured per-layer unit's parameter-gradient hand-off (tgraph.layers.grads)."""
    from tgraph.layers.manager import gradient_hand_offs  # imports this module's users: lazily

    return gradient_hand_offs()


def _within(t: torch.Tensor, region: tuple[int, int]) -> bool:
    """Whether the region (start, bytes) holds all of ``t``."""
    lo, (start, n) = t.data_ptr(), region
    return start <= lo and lo + t.numel() * t.element_size() <= start + n


def _region(t: torch.Tensor, regions: list[tuple[int, int]]) -> int:
    """Index of the region (start, bytes) holding all of ``t``, or -1."""
    return next((k for k, r in enumerate(regions) if _within(t, r)), -1)


def flat_like(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Buffers shaped like ``tensors``: views of one allocation per (device, dtype)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (device, dtype), idx in groups.items():
        flat = torch.empty(sum(tensors[i].numel() for i in idx), device=device, dtype=dtype)
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = flat[offset : offset + n].view(tensors[i].shape)
            offset += n
    return out


class GradBuffers:
    """The gradient buffers of one captured step (module docstring).

    Attributes:
        pairs: ``(parameter, buffer)`` for every gradient the step reads, at a fixed address.
        gradless: the parameters the step never steps (they must keep ``.grad`` None).
        read_in_place: the per-layer gradient buffers it reads; their memory must outlive
            the graph (until ``tgraph.reset()``).
        own_bytes: the bytes of the buffers of its own.
        held_elsewhere: the latest :meth:`refresh` found per-layer gradient memory it would
            copy into viewed elsewhere and copied nothing: that step runs eagerly.
    """

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.gradless: list[torch.Tensor] = []
        self.read_in_place: list[torch.Tensor] = []
        self.own_bytes = 0
        self.held_elsewhere = False
        self._warned = False  # the held_elsewhere warning, once
        self._hand_off: dict[int, object] = {}  # id(param) -> the hand-off whose buffer it reads
        self._params: tuple = ()
        self._bufs: list[torch.Tensor] = []
        self._ptrs: tuple = ()
        self._strides: tuple = ()
        self._hand_off_of: list = []  # per frozen pair: that hand-off, or None

    @classmethod
    def bind(cls, params: list[torch.Tensor], name: str = "OptimizerGraph") -> GradBuffers:
        """At capture, before the step is captured: the buffers for ``params``' gradients;
        this step's gradients are copied into the buffers of its own, which become the
        parameters' ``.grad``.

        Raises:
            ValueError: no gradient to step.
        """
        self = cls()
        live = [(p, p.grad) for p in params if p.grad is not None]
        self.gradless = [p for p in params if p.grad is None]
        if not live:
            raise ValueError(
                f"{name}: no parameter has a .grad at capture; call step() after "
                "backward(), as optimizer.step()"
            )
        hand_offs = _gradient_hand_offs() if _RAW_STORAGE else []
        readers = [(k, b) for k in hand_offs for b in k.bufs]
        self.read_in_place = [b for _, b in readers]
        regions = [(b.data_ptr(), b.numel() * b.element_size()) for b in self.read_in_place]
        starts = {start: k for k, (start, n) in enumerate(regions) if n}
        where = [
            k
            if (k := starts.get(g.data_ptr(), -1)) >= 0 and _within(g, regions[k])
            else _region(g, regions)
            for _, g in live
        ]
        own = [g for (_, g), r in zip(live, where) if r < 0]
        buffers = iter(flat_like(own))
        for (p, g), r in zip(live, where):
            if r >= 0:  # the memory the layer's backward graph writes, forever: read at its
                # address, which the rescues that move .grad views out leave alone
                self.pairs.append((p, at_address(g)))
                self._hand_off[id(p)] = readers[r][0]
            else:
                b = next(buffers)
                with torch.no_grad():
                    b.copy_(g)
                self.pairs.append((p, b))
                p.grad = b
        self.own_bytes = sum(g.numel() * g.element_size() for g in own)
        return self

    def freeze(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], gradless: list[torch.Tensor]
    ) -> None:
        """After binding, with the pairs and gradient-less parameters the graph reads (those of
        :meth:`bind`, or of a subclass's ``bind_grads``, which may add to them or replace
        them): what :meth:`refresh` compares at every replay."""
        self.pairs, self.gradless = pairs, gradless
        self._params = tuple(p for p, _ in pairs)
        self._bufs = [b for _, b in pairs]
        self._ptrs = tuple(map(_data_ptr, self._bufs))
        self._ptr_list, self._all = list(self._ptrs), list(range(len(self._ptrs)))
        self._strides = tuple(map(_stride, self._bufs))
        self._layout = LayoutGuards()  # C++ checks of the gradients' layout (tgraph.layout)
        self._hand_off_of = [self._hand_off.get(id(p)) for p in self._params]

    def refresh(self) -> bool:
        """Before a replay (no grad mode): copy the step's gradients that are not where the
        graph reads them into its buffers (autograd's own tensors: one multi-tensor copy). In
        the usual replay beside per-layer graphs that is a few C-level passes and no copy.
        Returns True, copying nothing, when per-layer gradient memory it would copy into is
        viewed elsewhere: run this step eagerly (also kept in :attr:`held_elsewhere`; logged
        once).

        Raises:
            ValueError: a gradient the graph reads is missing, or a parameter it never steps
                has one now (call ``reset()``).
        """
        if any(map(is_not, map(_GRAD, self.gradless), repeat(None))):
            raise ValueError(
                "OptimizerGraph: a parameter without .grad at capture has one now; the "
                "graph would not step it. Call reset() to capture anew with it."
            )
        lives = list(map(_GRAD, self._params))
        if any(map(is_, lives, repeat(None))):
            p = self._params[lives.index(None)]
            why = (
                "no parameter has one (a step without a backward before it?)"
                if all(map(is_, lives, repeat(None)))
                else "it was frozen after capture (requires_grad=False)"
                if not p.requires_grad
                else "the loss no longer reaches it: if the model re-created it "
                "(module.weight = nn.Parameter(...), load_state_dict(assign=True)), the "
                "optimizer still holds the old one; give the optimizer the new parameters"
            )
            raise ValueError(
                f"OptimizerGraph: the {tuple(p.shape)} parameter the graph steps has no .grad: "
                f"{why}. The graph would step it (eager code would skip it); call reset() to "
                "capture anew when the set of parameters with gradients changes."
            )
        self.held_elsewhere = False
        if any(g.check(*lives) for g in self._layout.guards) and (
            ptrs_equal(lives, self._ptr_list, self._all)
            if ptrs_equal is not None
            else tuple(map(_data_ptr, lives)) == self._ptrs
        ):
            return False  # every gradient where the graph reads it: two C++ passes
        moved = list(
            compress(
                range(len(lives)),
                map(
                    or_,
                    map(ne, map(_data_ptr, lives), self._ptrs),
                    map(ne, map(_stride, lives), self._strides),
                ),
            )
        )
        if not moved:
            self._layout.remember(lives, tuple(map(_size, lives)), self._strides)
            return False
        if self._held(moved):
            self.held_elsewhere = True
            if not self._warned:
                self._warned = True
                logger.warning(
                    "OptimizerGraph: a gradient a backward graph handed out is kept (e.g. by "
                    "a hook) in memory the step reads, and the step's gradient is another "
                    "tensor (accumulated); such steps run eagerly instead of overwriting it"
                )
            return True
        dst = [self._bufs[i] for i in moved]
        # a gradient laid out anew in its buffer's own memory (p.grad = p.grad.t()) goes
        # through a copy: copied in place, it would read elements it already overwrote
        src = [
            g.clone() if g.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() else g
            for g, b in zip(map(lives.__getitem__, moved), dst)
        ]
        torch._foreach_copy_(dst, src)
        return False

    def _held(self, moved: list[int]) -> bool:
        """Whether per-layer gradient memory that ``moved`` gradients would be copied into is
        viewed by something besides tgraph and the ``.grad`` tensors still on it
        (:meth:`tgraph.layers.grads.GradHandOff.held_elsewhere`)."""
        targets = {id(k): k for k in map(self._hand_off_of.__getitem__, moved) if k is not None}
        if not targets:
            return False
        moved_set = set(moved)
        on = dict.fromkeys(targets, 0)  # per buffer, the .grad tensors still on it
        for i, k in enumerate(self._hand_off_of):
            if k is not None and id(k) in on and i not in moved_set:
                on[id(k)] += 1
        return any(k.held_elsewhere(on[key]) for key, k in targets.items())
