"""Side effects a graph skips, and how tgraph undoes or redoes them.

**Gradient-accumulation fusion (megatron-core / TransformerEngine convention).** A parameter may
carry ``main_grad`` (an fp32 accumulation buffer at a fixed address) and a flag
``grad_added_to_main_grad``. Fused-wgrad kernels accumulate the weight gradient straight into
``main_grad`` inside backward and set the flag, returning a dummy ``.grad``; Megatron's DDP hook
then adds ``.grad`` into ``main_grad`` only when the flag is not set. Inside a graph the
accumulation kernel is captured and replays into the same ``main_grad``, but the Python
assignment of the flag is not: :class:`MainGradFlags` notes, at capture, which parameters'
flags the backward sets and sets them again after every replay. Parameters whose wgrad comes
back through autograd are untouched (their hook accumulates eagerly, as in eager execution), so
``main_grad`` and the flags end exactly as eager execution leaves them.

**Warmup and capture side effects** are undone by :class:`tgraph.snapshot.Snapshot`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable

import torch

from tgraph.pool import move_memory_out, use_counts
from tgraph.snapshot import FLAG

_detach = torch.Tensor.detach


def swaps_storage() -> bool:
    """Whether this PyTorch can swap the memory of two storages (``UntypedStorage.
    _swap_data_ptr_``, PyTorch >= 2.13: :meth:`GradHandOff.rescue`); older versions re-point
    the parameters' ``.grad`` instead."""
    return getattr(torch.UntypedStorage, "_swap_data_ptr_", None) is not None


class MainGradFlags:
    """Which parameters' ``grad_added_to_main_grad`` a captured backward sets.

    Args:
        pairs: ``(leaf, param)``: the leaf the graph differentiates (an alias of ``param``
            whose attributes the captured code sees and sets) and the parameter whose flag
            eager execution would have set.

    A fused-wgrad kernel in the backward graph adds into the ``main_grad`` the capture saw; a
    ``main_grad`` re-created since is loaded into it before the replay and given the sum after
    (:meth:`moved`), where before that weight's gradient went to the old buffer, silently.
    """

    def __init__(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._pairs = [
            (leaf, p) for leaf, p in pairs if hasattr(p, "main_grad") and hasattr(leaf, FLAG)
        ]
        self._before: list[bool] = []
        self.fused: list[torch.Tensor] = []
        # the main_grad each fused parameter's graph adds into
        self._targets: list[torch.Tensor] = []

    def before_capture(self) -> None:
        self._before = [getattr(leaf, FLAG) for leaf, _ in self._pairs]
        for leaf, _ in self._pairs:
            setattr(leaf, FLAG, False)

    def after_capture(self) -> None:
        done = [(leaf, p) for leaf, p in self._pairs if getattr(leaf, FLAG)]
        self.fused = [p for _, p in done]
        # the captured kernels add into these very tensors at every replay (held: the memory
        # must outlive the graph)
        self._targets = [leaf.main_grad for leaf, _ in done]
        for (leaf, _), flag in zip(self._pairs, self._before):
            setattr(leaf, FLAG, flag)

    def moved(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Before a backward replay: ``(target, live)`` for each fused parameter whose
        ``main_grad`` was replaced since the capture (megatron re-creating its gradient
        buffers), each target loaded with the live values, so that the replay's addition lands
        on them; :meth:`after_replay` copies the sums back. Empty on the steady path."""
        pairs = [
            (t, p.main_grad) for p, t in zip(self.fused, self._targets) if p.main_grad is not t
        ]
        for t, live in pairs:
            if live.shape != t.shape or live.dtype != t.dtype:
                raise RuntimeError(
                    f"a parameter's main_grad was replaced after capture by one of shape "
                    f"{tuple(live.shape)} and dtype {live.dtype} (captured: {tuple(t.shape)}, "
                    f"{t.dtype}); the backward graph's fused weight-gradient kernel adds into the "
                    "captured buffer. Call tgraph.reset() after changing gradient buffers."
                )
            t.copy_(live)
        return pairs

    def after_replay(self, moved: list[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        for t, live in moved:  # the replay added into the captured buffer: the live one's sum
            live.copy_(t)
        for p in self.fused:
            setattr(p, FLAG, True)


class MainGradFusion:
    """Opt-in: parameter gradients added into ``main_grad`` inside the backward graph.

    Normally a backward graph hands parameter gradients to autograd, whose AccumulateGrad and
    the DDP hook then add each into ``main_grad`` eagerly: per parameter, one Python hook and one
    kernel launch per step. With fusion on, the captured backward adds them itself (one
    ``_foreach_add_``) and the graph's autograd node does not take those parameters as inputs, so
    autograd runs neither their AccumulateGrad nor their hooks (which fire even for a None
    gradient). Exact
    only where that hook does nothing else: megatron-core DDP with ``overlap_grad_reduce=False``
    (:func:`tgraph.integrations.megatron.enable_layer_graphs` switches it on there). Parameters
    a fused-wgrad kernel already accumulates (it sets ``grad_added_to_main_grad`` during the
    captured backward) are left to that kernel. A graph writes into the ``main_grad`` tensors it
    was captured with; a replay after ``main_grad`` was replaced raises. A parameter the graph
    differentiates more than once (a module called twice in a merged stack, weights shared by
    two blocks) gets the sum of its gradients added once. Limitation: every backward through
    the graph adds into ``main_grad``, also ``torch.autograd.grad(loss, inputs)``, which would
    not accumulate eagerly.
    """

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self._mask: list[bool] | None = None  # per parameter, decided when first captured
        self._params: list[torch.Tensor] = []  # unique fused parameters
        self._targets: list[torch.Tensor] = []  # their main_grad at capture
        self._groups: list[list[int]] = []  # per unique fused parameter, its gradient indices

    def apply(self, leaves, params, grads: list) -> list:
        """Inside the captured backward: add fused gradients into ``main_grad``; return the
        gradients left for autograd (None where fused)."""
        if not self.enabled:
            return grads
        if self._mask is None:
            self._mask = [
                g is not None
                and isinstance(getattr(p, "main_grad", None), torch.Tensor)
                and p.main_grad.shape == g.shape
                and not getattr(leaf, FLAG, False)
                for leaf, p, g in zip(leaves, params, grads)
            ]
            groups: dict[int, list[int]] = {}
            for i, (p, m) in enumerate(zip(params, self._mask)):
                if m:
                    groups.setdefault(id(p), []).append(i)
            self._groups = list(groups.values())
            self._params = [params[idx[0]] for idx in self._groups]
            self._targets = [p.main_grad for p in self._params]
        if self._groups:
            # one addend per parameter (duplicate destinations in one _foreach_add_ race on
            # CUDA), added up in the order autograd would: that of the leaves (_find_params)
            sums = [functools.reduce(operator.add, [grads[i] for i in idx]) for idx in self._groups]
            torch._foreach_add_([p.main_grad for p in self._params], sums)
        return [None if m else g for g, m in zip(grads, self._mask)]

    def keep(self, items: list) -> list:
        """``items`` (one per parameter) without the fused parameters' entries."""
        if self._mask is None:  # fusion off, or nothing captured yet
            return items
        return [x for x, m in zip(items, self._mask) if not m]

    def check(self) -> None:
        """Before a backward replay: the graph's ``main_grad`` targets are still the params'."""
        for p, t in zip(self._params, self._targets):
            if p.main_grad is not t:
                raise RuntimeError(
                    "a parameter's main_grad was replaced after tgraph captured a backward graph "
                    "that adds into it (main_grad fusion); the gradient would go to the old "
                    "buffer. Call tgraph.reset() and tgraph.create_graphs() again after "
                    "re-creating gradient buffers."
                )


class ParamGradOutputs:
    """Parameter gradients leave a backward graph in static buffers, one per gradient, each
    owning its storage; autograd gets fresh detached aliases of them, which AccumulateGrad
    adopts as ``.grad`` without a copy.

    The backward graph writes every parameter gradient into static memory that its next
    replay overwrites (and that graphs captured before it may reuse, :mod:`tgraph.pool`).
    Handing autograd the static tensors themselves while holding a reference makes
    AccumulateGrad clone each one: one allocation and one copy kernel per parameter per step.
    A detached alias is a tensor of its own on the same memory, which AccumulateGrad adopts:
    no copy and no memory of the step's own in the usual step (backward, optimizer step,
    ``zero_grad(set_to_none=True)``), so the gradients take the memory they take in eager. The
    buffers are the gradients autograd computed in the capture, where they were: the capture's
    memory rises as eager's backward does (activations freed as gradients are made), and no
    copy kernel replays. (Packing them into one flat buffer with ``torch.cat`` inside the graph,
    as tgraph did before, held every gradient twice at the end of the capture and copied them
    all at every replay: 1 GiB and about 0.5 ms a step at HF Llama d=1024.) A gradient that
    shares memory with another output or a static buffer of the graph, or that is laid out
    other than contiguously on a storage of its own, is copied into one inside the graph, so
    that each buffer's storage is its alone (rescues and alias counts work per storage).

    Those ``.grad`` tensors then alias static memory, so before anything may overwrite it (this
    unit's next backward, or a replay of a graph captured before it)
    :meth:`GradHandOff.rescue` moves them to a copy: gradient accumulation stays exact, unlike
    ``make_graphed_callables``, whose aliases are overwritten (pytorch issue 181723).
    Aliases are counted on the buffers' storages, so a gradient kept anywhere is found:

    * PyTorch >= 2.13 moves the memory out from under every tensor on it
      (``UntypedStorage._swap_data_ptr_``): a ``.grad``, a hook's list, a loop variable alike;
    * older versions re-point the parameters' ``.grad`` tensors on them (``Tensor.set_``) onto
      copies, which covers accumulation. An alias of a gradient kept elsewhere (a variable
      holding last step's ``.grad``, a hook's list) cannot be re-pointed: the replays that
      would overwrite it do not run while it is held (a forward runs eagerly, with the
      reason; a backward out of the recorded order raises), and from then on the unit hands
      autograd copies at each backward, which nothing pins. A unit whose parameters have
      gradient hooks (which may keep what they are given) hands out copies from the start
      (:meth:`GradHandOff.watch_hooks`).

    Which gradients the graph returns is decided at capture and never changes after it (it is
    part of the unit's frozen capture result); what the hand-off changes at replays (the
    uses of the buffers that are tgraph's own, copying) lives in the unit's
    :class:`GradHandOff`.
    """

    def __init__(self) -> None:
        self.bufs: tuple[torch.Tensor, ...] = ()  # the static gradients, per present gradient
        self._n = 0
        self._index: list[int] = []  # per buffer, its parameter's position

    def own(self, grads: list[torch.Tensor | None], others: list) -> list[torch.Tensor]:
        """Inside the captured function: the present gradients, each on a storage of its own
        (one shared with another gradient or with one of ``others``, the graph's other static
        tensors, or laid out otherwise, is copied: :func:`own_storages`)."""
        self._n = len(grads)
        self._index = [i for i, g in enumerate(grads) if g is not None]
        return [g for g in own_storages(grads, others, whole=True) if g is not None]

    def set_outputs(self, outputs: list[torch.Tensor]) -> None:
        """After capture: the backward graph's parameter-gradient outputs (what :meth:`own`
        returned, as static tensors)."""
        self.bufs = tuple(outputs)

    @property
    def present(self) -> bool:
        """Whether the graph returns any parameter gradient."""
        return bool(self._index)


def own_storages(
    grads: list[torch.Tensor | None], others: list, whole: bool
) -> list[torch.Tensor | None]:
    """Inside a captured backward: ``grads`` (None stays None), each on a storage that no other
    of them and none of ``others`` (the graph's other static tensors) uses; one that shares
    its storage is copied. A buffer alone on its storage is what the hand-off's counts and
    rescues work on (:class:`GradHandOff`). ``whole``: also copy a gradient laid out other than
    contiguously over all of its storage (a parameter's, :class:`ParamGradOutputs`)."""
    taken = {t.untyped_storage()._cdata for t in others if isinstance(t, torch.Tensor)}
    out: list[torch.Tensor | None] = []
    for g in grads:
        if g is not None:
            storage = g.untyped_storage()
            if storage._cdata in taken or (
                whole
                and (
                    g.storage_offset()
                    or not g.is_contiguous()
                    or storage.nbytes() != g.numel() * g.element_size()
                )
            ):
                g = g.clone(memory_format=torch.contiguous_format)
                storage = g.untyped_storage()
            taken.add(storage._cdata)
        out.append(g)
    return out


class GradHandOff:
    """What handing one unit's gradients to autograd changes at replays: the parameter
    gradients (its :class:`ParamGradOutputs`, ``plan``, stays as captured) and the input
    gradients (``inputs``: the capture result's ``static_grads``).

    Input gradients leave the backward graph in static buffers too, each alone on its storage
    (:func:`own_storages`), and a caller may keep them: ``torch.autograd.grad(loss, x)``, a
    tensor hook that stores its gradient (saliency, Grad-CAM), a leaf's ``.grad``. So autograd
    gets fresh detached aliases of them, counted on their storages with the parameter
    gradients', and :meth:`rescue` moves held ones to a copy before a replay may overwrite
    them. Where the memory cannot be moved (PyTorch < 2.13) autograd gets copies of the input
    gradients instead: a view kept elsewhere could not be re-pointed, and nothing says at
    the backward whether it will be kept.

    Created when the unit's capture result is baked, when nothing but tgraph uses the static
    buffers; it lives in the unit's replay state (:class:`tgraph.layers.captured.ReplayState`),
    whose ``route.params`` (the parameters the gradients go to) :meth:`rescue` reads.
    """

    __slots__ = (
        "plan",
        "route",
        "inputs",
        "copies_inputs",
        "handed",
        "storages",
        "uses",
        "baseline",
        "param_storages",
        "param_baseline",
        "copying",
    )

    def __init__(self, plan: ParamGradOutputs, route, inputs: tuple = ()) -> None:
        self.plan = plan
        self.route = route
        self.inputs: tuple[torch.Tensor | None, ...] = inputs
        self.copies_inputs = not swaps_storage()  # else aliases, moved out when held
        self._count()
        self.copying = False  # hands out copies (a view of a buffer was kept: rescue)
        self.watch_hooks()

    def _count(self) -> None:
        """The storages of the buffers handed out as aliases (the parameter gradients' first,
        then the input gradients') and the uses of them that are tgraph's own."""
        bufs = self.plan.bufs
        if not self.copies_inputs:
            bufs += tuple(b for b in self.inputs if b is not None)
        self.handed = bufs
        self.storages = tuple(b.untyped_storage()._cdata for b in bufs)
        self.uses = use_counts(self.storages)
        self.baseline = sum(self.uses)
        n = len(self.plan.bufs)  # the parameter gradients' part (held_elsewhere)
        self.param_storages, self.param_baseline = self.storages[:n], sum(self.uses[:n])

    def watch_hooks(self) -> None:
        """Where storage memory cannot be swapped: hand out copies from now on if a parameter
        has a gradient hook, which may keep the gradient it is given (a view of a buffer that
        nothing could move out). Called at bake and whenever torch's hook counter moved."""
        if not self.copying and self.plan.present and not swaps_storage():
            self.copying = any(
                p._backward_hooks or p._post_accumulate_grad_hooks for p in self.route.params
            )

    @property
    def bufs(self) -> tuple[torch.Tensor, ...]:
        """Where the last backward's parameter gradients are, at addresses that stay (the
        rescues move held aliases off them, not the buffers); empty when there are none."""
        return self.plan.bufs

    @property
    def present(self) -> bool:
        return self.plan.present

    @property
    def aliased(self) -> bool:
        """Whether a backward hands autograd aliases of static memory (which the pool's ledger
        must have moved out before a replay may overwrite it)."""
        return bool(self.storages) and not self.copying

    def for_autograd(self, raw: bool = False) -> list:
        """Per-parameter gradients for autograd after a replay: aliases of the buffers (``raw``:
        the buffers themselves, for a caller that only adds them into ``.grad`` tensors)."""
        plan = self.plan
        if not self.copying:  # one C-level pass: fresh tensors AccumulateGrad adopts
            handed = list(plan.bufs) if raw else list(map(_detach, plan.bufs))
        else:
            handed = [b.clone() for b in plan.bufs]
        if len(handed) == plan._n:
            return handed
        out: list[torch.Tensor | None] = [None] * plan._n
        for i, t in zip(plan._index, handed):
            out[i] = t
        return out

    def for_inputs(self) -> list[torch.Tensor | None]:
        """Per static input, its gradient for autograd after a replay (None where the input
        gets none): a fresh alias of its buffer, or a copy (:attr:`copies_inputs`)."""
        if self.copies_inputs:
            return [None if b is None else b.clone() for b in self.inputs]
        return [None if b is None else _detach(b) for b in self.inputs]

    def held_elsewhere(self, on_it: int = 0) -> bool:
        """Whether something besides tgraph and ``on_it`` ``.grad`` tensors views a parameter
        gradient buffer (a gradient a hook kept, say), which writing into it would
        overwrite."""
        return sum(use_counts(self.param_storages)) > self.param_baseline + on_it

    @torch.no_grad()
    def rescue(self) -> str | None:
        """Before the buffers may be overwritten: if anything still views one (a ``.grad``
        being accumulated, a gradient a hook kept, an input gradient the caller kept), move it
        to a copy (one copy per buffer still held; :class:`ParamGradOutputs` says how).
        Returns why it could not (a view of a gradient kept elsewhere, on PyTorch < 2.13),
        else None."""
        now = use_counts(self.storages)
        if sum(now) <= self.baseline:
            return None
        bufs = self.handed
        held = [k for k, (n, own) in enumerate(zip(now, self.uses)) if n > own]
        if swaps_storage():
            for k in held:  # every alias views a copy, the buffer not
                move_memory_out(bufs[k], [bufs[k]])
            self._count()  # the buffers are on new storage objects now
            return None
        where = {self.storages[k]: k for k in held}
        copies: dict[int, torch.UntypedStorage] = {}
        for p in self.route.params:
            g = p.grad
            k = where.get(g.untyped_storage()._cdata) if g is not None else None
            if k is not None:
                if k not in copies:
                    copies[k] = bufs[k].untyped_storage().clone()
                g.set_(copies[k], g.storage_offset(), g.shape, g.stride())
        if sum(use_counts(self.storages)) > self.baseline:  # from now on copies, which
            self.copying = True  # nothing pins
            return (
                "a view of a parameter gradient that a graph's backward handed out (other than "
                "the parameter's .grad) is still held where this graph would overwrite it, "
                "and this PyTorch cannot move it out of the graph's memory "
                "(UntypedStorage._swap_data_ptr_, PyTorch >= 2.13); clone gradients you keep"
            )
        return None


def reached_leaves(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Leaf tensors requiring grad that ``outputs``' autograd graph reaches (AccumulateGrad)."""
    # Python wrappers of autograd nodes live only while referenced and their ids are recycled:
    # keep every visited wrapper alive, so the same node keeps its wrapper and id-dedup holds.
    seen: dict[int, object] = {}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    # an output that is itself a leaf (a parameter returned as is) reaches itself
    leaves: list[torch.Tensor] = [o for o in outputs if o.grad_fn is None and o.requires_grad]
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        var = getattr(fn, "variable", None)
        if var is not None:
            leaves.append(var)
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return leaves


def output_reach(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], leaves: list[torch.Tensor]
) -> list[tuple[frozenset[int], frozenset[int]]]:
    """Per output: (indices into ``inputs``, indices into ``leaves``) that it reaches.

    A gradient flows to an input or parameter only through outputs that reach it; autograd
    gives it none (``None``, not zeros) when no output the loss used reaches it.
    """
    in_pos = {id(t): i for i, t in enumerate(inputs)}
    leaf_pos = {id(t): j for j, t in enumerate(leaves)}
    found = []
    for o in outputs:
        ids = {id(t) for t in reached_leaves([o])}
        found.append(
            (
                frozenset(i for k, i in in_pos.items() if k in ids),
                frozenset(j for k, j in leaf_pos.items() if k in ids),
            )
        )
    return found


class UnusedOutputs:
    """Which gradients to hand autograd as None when the loss ignored some outputs.

    Autograd gives the bridge ``None`` for an output the loss did not use (materialized zeros
    are turned off). The backward graph still runs with a zero gradient for it, and every input
    or parameter reached *only* through such outputs gets None, as in eager: a zero gradient is
    not the same thing to an optimizer (AdamW's momentum and weight decay would still move it).
    """

    def __init__(self) -> None:
        self.reach: list[tuple[frozenset[int], frozenset[int]]] = []
        self.input_index: list[int] = []  # position of each differentiable input in the result
        self.leaf_index: list[int | None] = []  # position of each leaf's gradient, None if fused

    def setup(self, outputs, inputs, in_rg, leaves) -> None:
        self.reach = output_reach(outputs, inputs, leaves)
        self.input_index = list(in_rg)

    def place_leaves(self, n_inputs: int, kept: list[int | None]) -> None:
        """``kept[j]``: index of leaf j among the parameters handed to autograd (None: fused)."""
        self.leaf_index = [None if k is None else n_inputs + k for k in kept]

    def none_positions(self, active: tuple[bool, ...], memo: dict) -> list[int]:
        """Positions of the gradients no active output reaches; ``memo`` (the replay
        state's, by ``active``) keeps them for the next backward with the same pattern."""
        found = memo.get(active)
        if found is None:
            ins = set().union(*(r[0] for r, a in zip(self.reach, active) if a))
            leaves = set().union(*(r[1] for r, a in zip(self.reach, active) if a))
            found = [p for k, p in enumerate(self.input_index) if k not in ins]
            found += [p for j, p in enumerate(self.leaf_index) if p is not None and j not in leaves]
            memo[active] = found
        return found
