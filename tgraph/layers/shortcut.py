"""The call of a later member of a merged stack, answered without its call key.

After the head of a merged stack replays, each later member's call normally computes its full
call key (:func:`tgraph.signature.call_key`, a walk over every argument leaf) only to
find the runner that :func:`tgraph.layers.replay.take` then checks against the replayed stack.
In a stack of transformer layers the members are called with the head's own objects (the
attention mask, the position embeddings, the same ``None`` and ``False``) plus the previous
member's output. So once a member's call has been answered the long way, its :class:`Shape`
remembers, per top-level argument, whether it was the previous member's output ``k`` or the
very object the head got at the same position (only where the member is called with the head's
argument structure); a later call shaped the same way is answered from that.

Why that is the call key: the head replayed, so its key (which describes the head's objects)
equals its captured key. An argument that *is* the head's object at the same position has the
head's description there, as it had when the shape was learned, when the member's full key
equalled its runner's key. An argument that is the previous member's output is a static output
of this very replay (same shape, dtype, device). The argument structure follows from the number
of positional arguments, the keyword names and the identical objects. The remaining fields of
the key (grad mode, autocast, ``training`` flags, which parameters require grad) are compared
directly. Only tensors, plain values and flat tuples of them are taken by identity: a list or a
dict could have been changed in place since the head's call. Versions are then checked by
:func:`~tgraph.layers.replay.take`, as on the long way.

A stack whose replay draws random numbers (dropout) checks those fields of its later members
already at the head (:class:`MemberModes`): a member that falls back after the replay would
draw its masks again, from a generator the replay has moved past them.
"""

from __future__ import annotations

import operator
from operator import getitem
from typing import Any

import torch

from tgraph.baked import _epoch as _module_epoch
from tgraph.layers.captured import StackCursor
from tgraph.signature import _VALUE_SET, CallKey, autocast_key, difference

_grad_enabled = torch._C.is_grad_enabled
HEAD = -1  # a top-level argument that is the head's own object at the same position


def _by_identity(v: object) -> bool:
    cls = type(v)
    if cls in _VALUE_SET or isinstance(v, torch.Tensor):
        return True
    return cls is tuple and all(type(x) in _VALUE_SET or isinstance(x, torch.Tensor) for x in v)


class Shape:
    """How one member's call is made of the head's call and the previous member's outputs."""

    __slots__ = ("nargs", "names", "where")

    def __init__(self, nargs: int, names: tuple, where: tuple[int, ...]) -> None:
        self.nargs = nargs  # positional arguments
        self.names = names  # keyword names, in order
        self.where = where  # per top-level argument: an output of the previous member, or HEAD

    @classmethod
    def learn(cls, stack: StackCursor, prev: list, args: tuple, kwargs: dict) -> Shape | None:
        """The shape of a member call that was just answered the long way (None: not one)."""
        head_args, head_kwargs, head = stack.head_call
        # the head's objects count at the same positions only (a final norm called with the
        # last layer's output alone takes none of them)
        like_head = len(args) == len(head_args) and tuple(kwargs) == tuple(head_kwargs)
        where = []
        for i, v in enumerate((*args, *kwargs.values())):
            k = next((k for k, o in enumerate(prev) if v is o), None)
            if k is not None:
                where.append(k)
            elif like_head and v is head[i] and _by_identity(v):
                where.append(HEAD)
            else:
                return None
        return cls(len(args), tuple(kwargs), tuple(where))

    def matches(self, stack: StackCursor, prev: list, args: tuple, kwargs: dict) -> bool:
        if len(args) != self.nargs or tuple(kwargs) != self.names:
            return False
        head = stack.head_call[2]
        for i, (v, k) in enumerate(zip((*args, *kwargs.values()), self.where)):
            if v is not (head[i] if k == HEAD else prev[k]):
                return False
        return True


def same_mode(key: CallKey, training: tuple, frozen: tuple) -> bool:
    """The call key's fields other than the arguments, compared with the call's state now."""
    if _grad_enabled() != key.grad or training != key.training or frozen != key.frozen:
        return False
    return autocast_key() == key.autocast


def same_grad(stack: StackCursor) -> bool:
    """The head's tensors still require grad as at the head's call (``requires_grad_()`` moves
    no version counter, which :func:`~tgraph.layers.replay.take` checks)."""
    return tuple(map(_requires_grad, stack.head_inputs)) == stack.head_grad


def remember_head(stack: StackCursor, args: tuple, kwargs: dict) -> None:
    """After a merged stack's head replayed: the call its later members' shapes refer to."""
    stack.head_call = (args, kwargs, (*args, *kwargs.values()))
    stack.head_grad = tuple(map(_requires_grad, stack.head_inputs))


def shape_of(stack: StackCursor, j: int, args: tuple, kwargs: dict) -> Shape | None:
    """Before member ``j``'s call is answered the long way: its shape, to keep if it takes
    (None when it is learned already or the call does not continue the stack)."""
    if j in stack.shapes or stack.pending is None or stack.next != j or not stack.head_call:
        return None
    return Shape.learn(stack, stack.pending[j - 1], args, kwargs)


def follow(state: Any, r: Any, args: tuple, kwargs: dict, training: tuple) -> list | None:
    """The tensors of this call of later member ``r`` (a runner whose replayed stack awaits it,
    with a learned :class:`Shape`) when the call is made the way the shape says, in the modes
    of its key; None: the long way. ``state``: the module's
    ``tgraph.layers.manager._ModuleState``."""
    stack = r.state.stack
    j = r.seg_index
    prev = stack.pending[j - 1]
    if not stack.shapes[j].matches(stack, prev, args, kwargs):
        return None
    try:
        frozen = tuple(map(_requires_grad, map(getitem, state.param_tables, state.param_keys)))
    except (KeyError, AttributeError):
        return None
    if not same_mode(r.key, training, frozen) or not same_grad(stack):
        return None
    head = stack.head_inputs
    return [prev[k] if p else head[k] for p, k in r.cap.sources[j]]


class MemberModes:
    """At the head of a merged stack whose replay draws random numbers: whether each later
    member's call key still has its ``training`` flags and the ``requires_grad`` of its
    parameters. A member that would not take its part runs eagerly after the replay, drawing
    its random numbers a second time, where eager draws them once: the head must not replay.

    Args:
        members: per later member, its runner and its module's
            ``tgraph.layers.manager._ModuleState`` (where its key reads its parameters).
    """

    __slots__ = ("members", "tables", "keys", "frozen", "submodules", "training")

    def __init__(self, members: list[tuple[Any, Any]]) -> None:
        self.members = members
        self.tables = tuple(t for _, ms in members for t in ms.param_tables)
        self.keys = tuple(k for _, ms in members for k in ms.param_keys)
        self.frozen = tuple(b for r, _ in members for b in r.key.frozen)
        self.submodules = tuple(m for _, ms in members for m in ms.submodules)
        self.training = tuple(b for r, _ in members for b in r.key.training)

    def changed(self, stack: StackCursor) -> str | None:
        """Why a later member would not take its part (None: each would). ``requires_grad``
        moves no epoch: read at every call; ``training`` only when a module was written to
        since it was last found as keyed (``train()``/``eval()`` move the module epoch)."""
        try:
            frozen = tuple(map(_requires_grad, map(getitem, self.tables, self.keys)))
        except (KeyError, AttributeError):  # a parameter removed: the member's key names it
            frozen = None
        if frozen != self.frozen:
            return self._why()
        epoch = _module_epoch[0]
        if epoch != stack.modes_at:
            if tuple(map(_training, self.submodules)) != self.training:
                return self._why()
            stack.modes_at = epoch
        return None

    def _why(self) -> str:
        for r, ms in self.members:
            training = tuple(map(_training, ms.submodules))
            try:
                frozen = tuple(map(_requires_grad, map(getitem, ms.param_tables, ms.param_keys)))
            except (KeyError, AttributeError):
                frozen = ()
            now = r.key._replace(training=training, frozen=frozen)
            if now != r.key:
                return (
                    f"{ms.name or type(r.module).__name__}, a later module of its merged stack, "
                    f"would run eagerly ({difference(r.key, now, ms.names)}) after the stack's "
                    "replay drew its random numbers"
                )
        return "a later module of its merged stack would run eagerly"


_requires_grad = operator.attrgetter("requires_grad")
_training = operator.attrgetter("training")
