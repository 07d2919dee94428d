"""Per-layer graphs: ``GraphableModule``, the one process-wide state of per-layer graphs and
the call path that reads it (``GraphableModule.__call__`` -> ``_Manager.call``: record, replay
or fall back to eager), and the reports read from that state. ``enable``, ``disable`` and
``reset_layer_graphs`` are in enable.py, ``create_graphs`` in create.py.

Life cycle::

    model = GPT(cfg)                     # its blocks subclass tgraph.GraphableModule
    tgraph.enable(model)                 # graphed modules start recording
    train_step(model, batch)             # iteration 1 runs eagerly; forwards and backwards recorded
    tgraph.create_graphs()               # create the graphs: capture each, in recorded order, one pool
    train_step(model, batch)             # later iterations replay graphs inside ordinary autograd

After ``create_graphs()`` a call that no graph was captured for (new shape, dtype,
requires_grad, non-tensor value, train/eval switch, grad mode) runs eagerly and warns once,
naming what changed; with ``strict=True`` it raises instead. A graph is never replayed for a call
it was not captured for.

The mechanisms this life cycle drives live in their own files: the switches in enable.py, the
recorded iteration (the record) in record.py, the creation of the graphs in create.py, a unit's
warmup and captures in capture.py (frozen into captured.py's capture result), its replay and autograd node in replay.py (its
backward in backward.py), the shared memory pool in tgraph/pool.py.
"""

from __future__ import annotations

import functools
import logging
import operator
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules import module as nn_module
from torch.utils.checkpoint import checkpoint as _checkpoint

from tgraph import rng
from tgraph.baked import _epoch as _module_epoch
from tgraph.baked import call_with_own_hooks, hooks_run_outside, watched
from tgraph.errors import GraphFallbackError, GraphFallbackWarning
from tgraph.layers import capture as _unit
from tgraph.layers import direct_grads, verify
from tgraph.layers.capture import graphed_region
from tgraph.layers.grads import GradHandOff
from tgraph.layers.record import NoteBackward, Record, Turns
from tgraph.layers.replay import BUSY, REBIND, Flight, hold_while_alive, left_after_draw
from tgraph.layers.replay import call as replay_call
from tgraph.layers.runner import Runner, module_call, named
from tgraph.layers.segment import Segment
from tgraph.layers.shortcut import follow, remember_head, shape_of
from tgraph.memory import CaptureReport, MemoryReport
from tgraph.python_state import tensor_holder
from tgraph.signature import MutableArgument, call_key, difference, settle_sdpa, split

logger = logging.getLogger(__name__)


@dataclass
class _ModuleState:
    backend: str
    strict: bool
    warmup: int | None
    debug: bool
    merge: bool = True
    main_grad_fusion: bool = False
    capturable_hooks: bool = False
    direct_grads: bool | None = None
    # Where the module's parameters are (their ``_parameters`` dicts and names): every key
    # reads their requires_grad there, so a replaced parameter (load_state_dict(assign=True))
    # is read anew and the replaced one is not kept alive here.
    param_tables: tuple = ()
    param_keys: tuple = ()
    submodules: tuple = ()  # module.modules(): their training flags are part of every key
    names: list[str] = field(default_factory=list)  # the submodules' names, for messages
    compiled: Any = None  # torch.compile of the module's call (enable(compile=...)), or None
    runners: dict[tuple, list[Runner]] = field(default_factory=dict)
    turns: dict[tuple, Turns] = field(default_factory=dict)  # keys of several runners (record.py)
    warned: set[str] = field(default_factory=set)
    name: str = ""  # the module's qualified name in the enabled model (``blocks.3``), for messages
    plain: bool = False  # graphed only merged (graphed_alone=False), recorded alone: plain calls
    training: tuple = ()  # the submodules' training flags as of module epoch ``training_at``
    training_at: int = -1  # (tgraph.baked._epoch; -1: not every submodule's writes are counted)


class _Manager:
    """Process-wide state: the record, the enabled modules, and whether graphs exist."""

    def __init__(self) -> None:
        self.record = Record()
        self.captured = False
        self.modules: weakref.WeakSet[GraphableModule] = weakref.WeakSet()
        self.roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self.report: CaptureReport | None = None
        self.segments: list[Segment] = []
        self.units: list = []  # every captured unit (runners and merged stacks)
        self.eager_calls = 0  # fallbacks to eager since the last reset (create_graphs' message)
        self.outer: list[Runner] = []  # recording: the units whose calls record their parts too

    def call(self, module: GraphableModule, state: _ModuleState, args: tuple, kwargs: dict):
        if state.plain:  # graphed only merged, and create_graphs() found it alone
            return self._plain_call(module, args, kwargs)
        if _inference_mode():
            return self._eager(
                module,
                state,
                args,
                kwargs,
                "it runs under torch.inference_mode(), whose "
                "tensors a graph's static buffers cannot take (use torch.no_grad() to graph it)",
            )
        if _graph_task_id() != -1:  # called by the autograd engine: a recompute in a backward
            if not self.captured:
                return self._plain_call(module, args, kwargs)  # not part of the recorded order
            return self._eager(
                module,
                state,
                args,
                kwargs,
                "it is called during a backward pass (the recompute of reentrant "
                "torch.utils.checkpoint, or a forward run by a backward hook), where a replay "
                "would overwrite the buffers of graphs whose backward is still running",
            )
        tensors: list[torch.Tensor] = []
        if state.training_at == _module_epoch[0]:  # no write to a baked module since: train()
            training = state.training  # and eval() set .training through nn.Module.__setattr__
        else:
            training = tuple(map(_TRAINING, state.submodules))  # no generator frame
            if self.captured and watched(state.submodules):
                state.training, state.training_at = training, _module_epoch[0]
        if self.captured:  # a later member of a replayed merged stack: no call key needed
            out = self._continue_stack(state, args, kwargs, training)
            if out is not None:
                return out
        else:  # recording: the SDPA order torch settles on at its first CUDA attention, now
            settle_sdpa(module)
        try:
            try:  # requires_grad of the parameters the module holds now
                params = map(operator.getitem, state.param_tables, state.param_keys)
                key = call_key(args, kwargs, training, tensors, params)
            except (KeyError, AttributeError):  # one removed or set to None since enable()
                tensors.clear()
                state.param_tables, state.param_keys = _param_slots(module)
                params = map(operator.getitem, state.param_tables, state.param_keys)
                key = call_key(args, kwargs, training, tensors, params)
        except MutableArgument as exc:
            return self._eager(module, state, args, kwargs, str(exc))
        except RuntimeError as exc:  # e.g. a nested tensor, which has no sizes
            return self._eager(
                module, state, args, kwargs, f"its arguments cannot key a graph ({exc})"
            )
        runners = state.runners.get(key)
        if not self.captured:
            runner = self.record.reusable(runners or ())  # free, and safe here (record.py)
            if runner is None:
                links = [self.record.producer(t) for t in tensors]
                runner = Runner(
                    module,
                    key,
                    args,
                    kwargs,
                    tensors,
                    links,
                    merge=state.merge,
                    fusion=state.main_grad_fusion,
                    direct=state.direct_grads,
                )
                runner.draft.call.shared_with = [self.record.consumers(t) for t in tensors]
                runner.within = self.outer[-1] if self.outer else None
                state.runners.setdefault(key, []).append(runner)
            return self._record_call(runner, args, kwargs, tensors)
        if runners:
            turns = state.turns.get(key) if len(runners) > 1 else None
            reason = BUSY  # unless a runner that is free says why it cannot answer
            for r in runners if turns is None else turns.order():  # the recorded one first
                if r.by_parts:  # not graphed whole: its parts replay (create_graphs said so)
                    return module_call(module)(*args, **kwargs)
                j = r.seg_index
                cap = r.cap
                if not j and cap is not None and cap.stored:
                    _release_stored(cap.stored)
                shape = shape_of(r.state.stack, j, args, kwargs) if j else None
                if not j and cap is not None and _verified(r.state):
                    out = verify.checked_replay(
                        r.segment or r,
                        args,
                        kwargs,
                        tensors,
                        lambda cap=cap, r=r: replay_call(cap, r.state, 0, tensors),
                        module_call,
                    )
                else:
                    out = replay_call(cap, r.state, j, tensors)
                if out is REBIND:
                    out = self._rebind(r, tensors)
                if out.__class__ is list:
                    if turns is not None:
                        turns.took(r)
                    if shape is not None:
                        r.state.stack.shapes[j] = shape
                    elif not j and len(r.cap.slices) > 1:
                        remember_head(r.state.stack, args, kwargs)
                    if r.segment is not None:  # what the next member's take() compares with
                        r.state.stack.nodes_at = _autograd_nodes()
                    return _outputs(r, j, out)
                if not j and out is not BUSY and cap is not None:
                    r.state.verify_next = True  # an event: the next replay is verified
                if out is BUSY and r.left_eager is not None:
                    out = r.left_eager  # create_graphs() could not graph it (said so there)
                if reason is BUSY:
                    reason = out
        elif state.runners:
            reason = difference(next(iter(state.runners)), key, state.names)
        else:
            reason = "the module was not called during the recorded iteration"
        return self._eager(module, state, args, kwargs, reason)

    def _continue_stack(self, state: _ModuleState, args: tuple, kwargs: dict, training: tuple):
        """The outputs of this call if it continues a replayed merged stack the way a learned
        :class:`~tgraph.layers.shortcut.Shape` says; None: take the long way."""
        for runners in state.runners.values():
            for r in runners:
                j = r.seg_index
                if not j or r.cap is None:
                    continue
                stack = r.state.stack
                if stack.next != j or stack.pending is None or j not in stack.shapes:
                    continue
                tensors = follow(state, r, args, kwargs, training)
                if tensors is None:
                    return None
                out = replay_call(r.cap, r.state, j, tensors)
                if out.__class__ is not list:
                    return None
                if len(runners) > 1:  # several runners share the key: keep their turns
                    turns = state.turns.get(r.key)
                    if turns is not None:
                        turns.took(r)
                r.state.stack.nodes_at = _autograd_nodes()  # (take() compares)
                return _outputs(r, j, out)
        return None

    def _rebind(self, runner: Runner, tensors: list):
        """The modules of ``runner``'s unit hold new parameter objects: bake them into a new
        capture result (:meth:`tgraph.layers.capture.GraphedUnit.rebind`) and key calls on them, then replay."""
        unit = runner.segment or runner
        unit.rebind()
        unit.state.verify_next = True  # an event: the next replay is verified
        out = replay_call(runner.cap, runner.state, runner.seg_index, tensors)
        return "its parameters were replaced after capture" if out is REBIND else out

    def _record_call(self, runner: Runner, args: tuple, kwargs: dict, inputs: list):
        self.record.add(runner, "fwd")
        self.record.note_inputs(runner, inputs)
        call, first = runner.draft.call, not runner.draft.call.rng_after
        if first:  # where a merged stack may not reorder random draws (tgraph.layers.segment)
            call.rng_before = rng.position(runner.device)
            call.region = rng.forward_region()
            call.nodes_before = _autograd_nodes()  # ... nor eager autograd code
        if runner.direct_grads is not False and not direct_grads.observing():
            direct_grads.observe_backwards(self.record.note_backward)
        span = self.record.open_call(runner, _autograd_nodes())  # the nodes it makes
        try:
            if type(runner.module).graphs_parts:  # its graphable modules record their calls too
                self.outer.append(runner)
                try:
                    out = module_call(runner.module)(*args, **kwargs)
                finally:
                    self.outer.pop()
            else:
                out = self._plain_call(runner.module, args, kwargs)
            if first:
                call.rng_after = rng.position(runner.device)
            out = self._note_outputs(runner, out, inputs)
        finally:
            self.record.close_call(span, _autograd_nodes())
        if first:
            call.nodes_after = span.hi
        return out

    def _note_outputs(self, runner: Runner, out, inputs: list):
        """The recorded call's outputs, with the node that notes their backward on those that
        require grad."""
        outs, template = split(out)
        holder = next(filter(None, map(tensor_holder, template.leaves)), None)
        if holder is not None and verify.settings.rules:
            runner.refused = (
                f"its forward returns a {holder} holding tensors, which a replay cannot refill "
                "(it would hand back the capture's tensors); return tensors in tuples, lists, "
                "dicts or types registered with torch.utils._pytree"
            )
        idx = [i for i, o in enumerate(outs) if o.requires_grad]
        if idx and torch.is_grad_enabled():
            land = Flight(runner.state).land
            noted = NoteBackward.apply(self.record, runner, land, *(outs[i] for i in idx))
            for i, t in zip(idx, noted):
                outs[i] = t
            out = template.fill(outs)
        else:  # no backward: the runner stays busy while its outputs live
            hold_while_alive(runner.state, [o for o in outs if all(o is not t for t in inputs)])
        self.record.note_outputs(runner, outs)
        return out

    def _plain_call(self, module: nn.Module, args: tuple, kwargs: dict):
        with graphed_region():  # compiled (enable(compile=...)): the recorded call compiles
            return module_call(module)(*args, **kwargs)

    def _eager(self, module: nn.Module, state: _ModuleState, args, kwargs, reason: str):
        self.eager_calls += 1
        name = named(module)
        fix = (
            "To graph this case, include it in the recorded iteration and call tgraph.reset() "
            "then tgraph.create_graphs() again."
        )
        if self.captured:  # a later member of a replayed stack that draws (a call take() never
            # saw, its key being another): that step's random numbers differ from eager's
            left = left_after_draw(r for rs in state.runners.values() for r in rs)
            if left is not None:
                reason = f"{reason}; {left}"
        head = f"no captured graph of {name} matches this call: {reason}."
        if state.strict:  # nothing ran: the call raises instead of running eagerly
            raise GraphFallbackError(f"{head} strict=True refuses to run it eagerly. {fix}")
        msg = f"{head} Running it eagerly. {fix}"
        if reason not in state.warned:
            state.warned.add(reason)
            warnings.warn(msg, GraphFallbackWarning, stacklevel=4)
        return self._plain_call(module, args, kwargs)

    def all_runners(self) -> list[Runner]:
        """Every runner of every enabled module."""
        return [r for m in self.modules for rs in m._tgraph.runners.values() for r in rs]


_manager = _Manager()
_TRAINING = operator.attrgetter("training")
_settings = verify.settings
_inference_mode = torch.is_inference_mode_enabled
_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass
# autograd's node counter: the sequence number its next node gets (this thread's)
_autograd_nodes = torch._C._autograd._get_sequence_nr


def _verified(state) -> bool:
    """Whether this replay of a unit (its head's ``ReplayState``) is verified by the shadow
    verifier (:mod:`tgraph.layers.verify`): its first replays, the first after an event, then
    one in ``every``. Counts the replay."""
    n = state.replays
    state.replays = n + 1
    if state.verify_next:
        state.verify_next = False
        return True
    every = _settings.every
    return n < _settings.first or (every > 0 and n % every == 0)


def _outputs(r: Runner, j: int, out: list) -> Any:
    """Member ``j``'s outputs of a replay, in the structure its forward returns."""
    template = r.cap.templates[j]
    if r.cap.stored and r.cap.stored[j]:
        out = _store(r.cap.stored[j], out, template)
    return out[0] if template.bare else template.fill(out)


def _release_stored(stored: tuple) -> None:
    """Before a replay: the attributes a forward stores in (``self.aux_loss``) stop holding the
    last replay's outputs, which the replay overwrites (eager would replace them too)."""
    for member in stored:
        for m, k, _ in member:
            m.__dict__[k] = None


def _store(stored: tuple, out: list, template: Any) -> list:
    """After a replay: store the extra outputs in the attributes the forward stored them in,
    and return the call's own outputs."""
    for m, k, i in stored:
        m.__dict__[k] = out[i]
    return out if template.bare else out[: len(template.tensor_at)]


class GraphableModule(nn.Module):
    """Base class of modules that tgraph may graph. Write ``forward`` as usual.

    Until :func:`tgraph.enable` is called on a model containing it, the module is an ordinary
    ``nn.Module``. Requirements of a graphed ``forward``: take and return tensors (or tuples,
    lists, dicts of them, and hashable non-tensor values), no host syncs (``.item()``), and no
    tensors read from outside its arguments, parameters and buffers other than constants.
    Its own forward (pre-)hooks run eagerly around every call, graphed or not, as in eager
    mode; hooks on its submodules would be baked into the graphs, so ``create_graphs()``
    refuses them unless ``enable(..., capturable_hooks=True)``.

    Every plain attribute of the module and its submodules is taken as read by ``forward``: a
    change after capture runs the call eagerly (see README, "What a graph keeps"). Name in
    ``unread_attributes`` the attributes a framework sets that ``forward`` never reads (megatron
    sets ``current_microbatch`` on each layer at every microbatch for its own graphs).
    """

    unread_attributes: frozenset[str] = frozenset()
    graphs_parts: bool = False
    """True: where ``create_graphs()`` cannot capture this module whole (a host sync in its own
    code, say), the graphable modules inside it keep graphs of their own, recorded in its
    recorded call, and its calls run its own code plainly around their replays (a whole-model
    unit: ``graph_layers(model, whole=True)``). False: it is graphed whole or runs eagerly."""
    graphed_alone: bool = True
    """False: graphed only as a member of a merged stack (a final norm after the layers, whose
    own graph would cost the host more than its few eager kernels); a module that
    ``create_graphs()`` finds only alone then runs plainly, without a warning or a fallback
    count, named in the report's ``eager_modules``."""

    @staticmethod
    def of(base: type[nn.Module], **namespace: Any) -> type[nn.Module]:
        """``base`` with :class:`GraphableModule` first in its MRO (its ``__call__``
        dispatches), for a module class one did not write: ``layer.__class__ =
        tgraph.GraphableModule.of(type(layer))``. One class per ``base`` and ``namespace``
        (class attributes of the new class: ``unread_attributes``, a ``forward``)."""
        if issubclass(base, GraphableModule) and not namespace:
            return base
        key = (base, tuple(sorted(namespace.items())))
        made = _graphable_classes.get(key)
        if made is None:
            attrs = {"__module__": base.__module__, **namespace}
            made = _graphable_classes[key] = type(
                f"Graphable{base.__name__}", (GraphableModule, base), attrs
            )
        return made

    def __call__(self, *args, **kwargs):
        state = self.__dict__.get("_tgraph")
        if state is None or _unit._depth:  # _depth: inside_graphed_region(), read in place
            if _unit._checkpointed and state is not None and torch.is_grad_enabled():
                call = functools.partial(super().__call__, **kwargs)  # (no keyword of its own
                return _checkpoint(call, *args, use_reentrant=False)  # taken by checkpoint)
            return super().__call__(*args, **kwargs)
        if _is_compiling():  # dynamo traces a compiled unit holding this one (a whole model's
            return _untraced(self, args, kwargs)  # recorded call): see _untraced
        if (  # the module's or the global forward hooks, read in place: every call asks
            self._forward_hooks
            or self._forward_pre_hooks
            or nn_module._global_forward_hooks
            or nn_module._global_forward_pre_hooks
        ) and hooks_run_outside(self):
            return call_with_own_hooks(
                self, lambda a, k: _manager.call(self, state, a, k), args, kwargs
            )
        return _manager.call(self, state, args, kwargs)

    def __getstate__(self) -> dict:
        """A copy (deepcopy, pickling: AveragedModel, EMA) is an ordinary eager module."""
        return {k: v for k, v in super().__getstate__().items() if k != "_tgraph"}


_graphable_classes: dict[tuple, type[nn.Module]] = {}  # GraphableModule.of's
_is_compiling = torch.compiler.is_compiling


@torch._disable_dynamo  # torch's own lazy form of torch.compiler.disable (optimizer.zero_grad's)
def _untraced(module: GraphableModule, args: tuple, kwargs: dict):
    """A graphed module's call met while dynamo traces the compiled unit that holds it (its
    parts are recorded inside a compiled whole model's recorded call): the call again, outside
    the trace (where ``is_compiling()`` is False), so tgraph's bookkeeping (the record, the
    flight tokens, the ledger) runs as Python, where a trace would make objects whose
    ``__init__`` never ran and replay their side effects after its graph. The module's own
    compiled code still runs (:func:`tgraph.layers.runner.module_call`); the trace breaks
    around the call, as it did at tgraph's code before."""
    return module(*args, **kwargs)


def _param_slots(module: nn.Module) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """Per parameter of ``module`` (``parameters()`` order), its ``_parameters`` dict and name."""
    named = [n.rpartition(".") for n, _ in module.named_parameters()]
    return tuple(module.get_submodule(m)._parameters for m, _, _ in named), tuple(
        k for _, _, k in named
    )


def memory_report() -> MemoryReport:
    """Where the captured per-layer graphs' memory goes, by kind (:mod:`tgraph.memory`).

    Returns:
        A :class:`tgraph.memory.MemoryReport` (all zeros before :func:`create_graphs`).
    """
    return capture_report().memory


def eager_calls() -> int:
    """Calls of graphed modules that ran eagerly instead of replaying (each fallback counts,
    though its warning is given once per reason) since per-layer graphs were last reset; a
    training loop can log it to see that its layers replay."""
    return _manager.eager_calls


def capture_report() -> CaptureReport:
    """The report of the last :func:`create_graphs` (the same object it returned), or an empty
    one (no graphs) before it; the whole-step entries have a ``capture_report()`` method of
    the same shape."""
    report = _manager.report
    if _manager.captured and report is not None:
        return report
    return CaptureReport(0, 0, 0, 0.0, 0, [], [])


def gradient_hand_offs() -> list[GradHandOff]:
    """The parameter gradients of every captured per-layer unit: where their backward graphs
    leave them (:attr:`tgraph.layers.grads.GradHandOff.bufs`)."""
    return [u.state.grads for u in _manager.units if u.cap.param_out.present]
