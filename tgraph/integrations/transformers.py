"""Per-layer graphs on a Hugging Face transformers model, in one call.

What a transformers user adds::

    from tgraph.integrations import transformers as tg_hf

    model = AutoModelForCausalLM.from_config(config)   # or a PEFT model around one
    tg_hf.graph_layers(model)              # decoder layers graphable, tgraph.enable(model)
    train_step(model, batch)               # first iteration: eager, recorded
    tgraph.create_graphs()                 # later iterations replay one graph per layer stack

The decoder layers are found as transformers' ``GradientCheckpointingLayer`` instances (the
outermost ones), or by the class names in ``model._no_split_modules`` on a transformers
without that class. Each becomes graphable the way :mod:`tgraph.integrations.megatron` does
it: its class is swapped for a subclass with :class:`tgraph.GraphableModule` first in the MRO
(cached per class; the instance, its parameters and its ``state_dict`` keys are unchanged).

What the subclass handles, per call of a decoder layer:

* **Gradient checkpointing** (``model.gradient_checkpointing_enable()``) runs inside the
  graphed region: the forward graph keeps only the layer's inputs and the backward graph
  recomputes the layer (README, "Activation recompute"). transformers up to 5.17 checkpoints in
  ``GradientCheckpointingLayer.__call__``, which the graphed dispatch would skip; the subclass
  checkpoints in ``forward`` instead, as newer transformers does. Reentrant checkpointing
  cannot run under the backward graph's ``torch.autograd.grad`` and is refused with the fix.
* **Output recording** needs nothing here: tgraph runs a graphed layer's own forward hooks
  around every replay, so ``output_hidden_states=True`` replays graphs; attentions and router
  logits, recorded by hooks inside the layer, make those calls run eagerly with a
  :class:`tgraph.GraphFallbackWarning` (:mod:`tgraph.baked`).
* **State a graph would bake in** that is not a call argument (gradient checkpointing on or off,
  PEFT adapters disabled, merged, switched or rescaled) is handed to tgraph as one more hashable
  keyword argument, so a call whose state differs from the capture's matches no graph and runs
  eagerly with a warning naming the change, never a stale replay.
* **The KV cache**: after :func:`graph_layers`, a call that leaves ``use_cache`` unset (or None)
  runs with ``use_cache=False`` (a forward pre-hook on each transformers model; the config,
  and so ``save_pretrained``'s output, is untouched), so default training and evaluation calls
  build no ``DynamicCache`` and replay graphs. A call that asks for one (``use_cache=True``;
  ``generate`` does) hands each layer a cache object, which tgraph never bakes into a graph:
  those calls run eagerly, with a warning naming ``use_cache=False``. The default is not
  applied where it would change the result: a call with ``position_ids`` and no
  ``attention_mask`` while the config says ``use_cache=True``. Without a cache, transformers
  reads packed documents from position ids that restart and masks them apart
  (``masking_utils.find_packed_sequence_indices``); with the config's cache it attends across
  them. That call keeps the config's cache, as eager does, and its layers run eagerly, warned.

**The final norm** (``norm``, ``ln_f``, ``final_layer_norm`` beside the layers' list) becomes
graphable too, as a member only (:attr:`tgraph.GraphableModule.graphed_alone` False): called
right after the last layer on its output, it joins the layers' merged stack, which saves its
eager kernels and autograd nodes each step; called otherwise, it runs plainly.

**The whole model** (``graph_layers(model, whole=True)``): the outermost ``PreTrainedModel``
becomes one graphed unit, embeddings to loss, with one forward and one backward graph per call
signature, so transformers' Python around the layers (masks, rotary tables, output classes, the
loss) leaves the step too; the layers and the norm run plainly inside its graphs. Its call key
carries every layer's state (above), and a call it was not recorded with (no ``labels``, a cache,
``output_attentions``) runs eagerly, warned. transformers' mask code branches on
``torch.cuda.is_current_stream_capturing()`` to skip its host syncs; the capture takes that
branch (an explicit causal mask where eager passes SDPA's causal flag), and the warmup before it
takes the same one (:func:`tgraph.emulated.emulated_capture`). Whether that branch computes
eager's bits depends on the attention kernel and the transformers version. With grouped k/v
heads the mask makes transformers repeat k and v in Python (``repeat_kv``) where eager lets SDPA
group them (``enable_gqa``): the backward adds each group's gradients up in another order, so
the gradients before the attention differ by rounding (1.5e-8 to 3e-8 on the CPU at head dim
8), inside the verifier's tolerance; per-layer graphs give eager's bits there. Measured
(``scripts/probe_hf_mask_path.py``, an H100, transformers 5.17, no attention mask): fp32 bit for
bit; bf16 within rounding (another SDPA kernel: the loss 5e-5 off), which the shadow verifier's
tolerance passes; per-layer graphs are bit for bit there. transformers 5.25 takes the same
branch (its packed-sequence check of the position ids is skipped under capture, so the mask is
built). A difference beyond rounding (the verifier compares the first replays with eager) leaves
the model eager, warned.
A model whose forward syncs with the host outside those branches (dynamic RoPE scaling reads
the largest position id) cannot be captured whole: ``create_graphs()`` says so, and the layers
and norm, recorded inside the model's recorded call (:attr:`tgraph.GraphableModule.graphs_parts`),
keep graphs of their own, the model's own code running eagerly around them, as per-layer
graphs would (``strict=True`` raises instead).
Around a PEFT model the transformers model inside is the unit (its adapters' state is in the
key). A head tied to the embedding (GPT-2) with several forwards in flight before one backward:
each replay's backward hands over that weight's summed uses, where eager's engine adds every
use's contribution in its own order, so the sum may differ in the last bit (compared within
rounding in ``tests/test_hf_whole.py``). Pipeline and interleaved schedules keep per-layer graphs.

MoE layers graph when their experts run grouped or batched
(``model.set_experts_implementation("batched_mm")`` or ``"grouped_mm"``); the eager
expert loop syncs with the host per expert and is refused by :func:`graph_layers`.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import warnings
import weakref
from typing import NamedTuple

import torch
import torch.nn as nn

import tgraph
from tgraph.errors import GraphFallbackWarning
from tgraph.layers.capture import inside_graphed_region
from tgraph.layers.manager import GraphableModule
from tgraph.peft_state import adapter_state, is_adapter_layer
from tgraph.peft_state import describe as describe_adapter

logger = logging.getLogger(__name__)

INSTALL_HINT = "transformers is not installed: pip install 'tgraph[hf]'"

STATE_KWARG = "tgraph_layer_state"
"""The keyword argument that carries a layer's non-argument state into tgraph's call key."""

_cache_hooks: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return transformers


def _checkpointing_layer_class() -> type | None:
    """transformers' ``GradientCheckpointingLayer`` (None before it existed)."""
    _transformers()
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The outermost decoder layers of ``model`` (see the module docstring for how they are found).

    Raises:
        ImportError: transformers is not installed.
        ValueError: no decoder layer found.
    """
    base = _checkpointing_layer_class()

    def is_layer(m: nn.Module) -> bool:
        return base is not None and isinstance(m, base)

    if not any(is_layer(m) for m in model.modules()):
        names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or ())}

        def is_layer(m: nn.Module) -> bool:
            return type(m).__name__ in names or getattr(m, "_tgraph_hf_base", None) is not None

    layers, inside = [], []
    for name, m in model.named_modules():
        if any(name.startswith(p + ".") for p in inside):
            continue
        if is_layer(m):
            layers.append(m)
            inside.append(name)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} contains no transformers decoder layer (no "
            "GradientCheckpointingLayer, none of _no_split_modules); make the blocks to graph "
            "subclass tgraph.GraphableModule and call tgraph.enable(model) instead"
        )
    return layers


_FINAL_NORMS = ("norm", "ln_f", "final_layer_norm", "final_norm")


def _final_norms(model: nn.Module, layers: list[nn.Module]) -> list[nn.Module]:
    """The final norm beside each list of ``layers`` (a parameterised module without submodules
    under one of :data:`_FINAL_NORMS`, on the module that holds the list), not yet graphable."""
    ids = {id(layer) for layer in layers}
    found = []
    for parent in model.modules():
        if not any(
            isinstance(c, nn.ModuleList) and any(id(x) in ids for x in c) for c in parent.children()
        ):
            continue
        for name in _FINAL_NORMS:
            norm = parent._modules.get(name)
            if (
                norm is not None
                and not isinstance(norm, GraphableModule)
                and not norm._modules
                and norm._parameters
            ):
                found.append(norm)
                break
    return found


def graph_layers(model: nn.Module, *, whole: bool = False, **enable_options) -> nn.Module:
    """Make every decoder layer of a transformers model graphable, then :func:`tgraph.enable` it.

    Call it after ``get_peft_model`` (the adapters' parameters must exist) and before the
    recorded iteration. Gradient checkpointing may be turned on before or after.

    Args:
        model: a transformers ``PreTrainedModel``, or a wrapper around one (PEFT, DDP).
        whole: graph the whole model (its outermost ``PreTrainedModel``: embeddings, layers,
            final norm, head and the loss of ``labels=``) as one unit, one forward and one
            backward graph per call signature (module docstring, "The whole model"); per-layer
            graphs (the default) stay the mode for pipeline and interleaved schedules.
        **enable_options: passed to :func:`tgraph.enable` (``backend``, ``strict``,
            ``warmup_steps``, ``debug``, ``merge``, ``direct_grads``).

    Returns:
        ``model``; its transformers models now default to ``use_cache=False`` (except where
        that changes the result: module docstring, "The KV cache")
        (:func:`ungraph` removes that default).

    Raises:
        ImportError: transformers is not installed.
        ValueError: no decoder layer found, or MoE experts that run the eager expert loop.
    """
    layers = decoder_layers(model)
    _refuse_ungraphable_experts(model)
    base = _checkpointing_layer_class()
    for layer in layers:
        if not isinstance(layer, GraphableModule):
            layer.__class__ = _graphable(type(layer), base)
        layer._tgraph_hf_adapters = tuple(m for m in layer.modules() if is_adapter_layer(m))
    for norm in _final_norms(model, layers):
        cls = type(norm)
        norm.__class__ = GraphableModule.of(cls, graphed_alone=False, _tgraph_hf_base=cls)
    inside = {id(m) for layer in layers for m in layer.modules()}
    if whole:
        top = _outermost_model(model)
        if not isinstance(top, GraphableModule):
            top.__class__ = _graphable_model(type(top))
        top._tgraph_hf_layers = tuple(layers)
        config = getattr(top, "config", None)
        if config is not None:
            top._tgraph_hf_config = _config_snapshot(config)  # _model_state compares
        inside |= {id(m) for m in top.modules() if m is not top}
    if model not in _cache_hooks:  # on the models around the graphed units, never inside one
        _cache_hooks[model] = [
            m.register_forward_pre_hook(
                functools.partial(_no_cache_by_default, at), with_kwargs=True
            )
            for m in model.modules()
            if id(m) not in inside and (at := _use_cache_position(m)) is not None
        ]
    logger.info("tgraph: %d %s layers graphable", len(layers), type(layers[0]).__name__)
    return tgraph.enable(model, **enable_options)


def ungraph(model: nn.Module) -> nn.Module:
    """Undo :func:`graph_layers`: eager layers of their own classes, ``use_cache`` default restored.

    Like :func:`tgraph.disable`, this drops every graph and the record of the process.

    Returns:
        ``model``.
    """
    tgraph.disable(model)
    for m in model.modules():
        hf_base = type(m).__dict__.get("_tgraph_hf_base")
        if hf_base is not None:
            m.__class__ = hf_base
            m.__dict__.pop("_tgraph_hf_adapters", None)
            m.__dict__.pop("_tgraph_hf_layers", None)
            m.__dict__.pop("_tgraph_hf_config", None)
    for handle in _cache_hooks.pop(model, []):
        handle.remove()
    return model


class _CacheArgs(NamedTuple):
    """Where a transformers model's ``forward`` takes the arguments the ``use_cache`` default
    reads, by position (:data:`_KEYWORD_ONLY`: by keyword only)."""

    use_cache: int
    position_ids: int
    attention_mask: int


_KEYWORD_ONLY = 1 << 30


def _use_cache_position(m: nn.Module) -> _CacheArgs | None:
    """Where ``m.forward`` takes ``use_cache`` and the arguments beside it, or None when it takes
    no ``use_cache``. Only modules with a ``config.use_cache`` (transformers models and their
    PEFT wrappers)."""
    if not hasattr(getattr(m, "config", None), "use_cache"):
        return None
    params = list(inspect.signature(m.forward).parameters.values())
    names = [p.name for p in params]
    if "use_cache" not in names and not any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return _CacheArgs(
        *(names.index(n) if n in names else _KEYWORD_ONLY for n in _CacheArgs._fields)
    )


def _given(at: int, name: str, args: tuple, kwargs: dict) -> bool:
    return (args[at] if at < len(args) else kwargs.get(name)) is not None


def _no_cache_by_default(at: _CacheArgs, module: nn.Module, args: tuple, kwargs: dict):
    """Forward pre-hook: a call that leaves ``use_cache`` unset (or None) gets ``False``, unless
    that changes the attention mask (module docstring, "The KV cache")."""
    if at.use_cache < len(args) or kwargs.get("use_cache") is not None:
        return args, kwargs  # the caller's choice (positional, even None: no second value)
    if (
        module.config.use_cache
        and _given(at.position_ids, "position_ids", args, kwargs)
        and not _given(at.attention_mask, "attention_mask", args, kwargs)
    ):
        warnings.warn(
            f"tgraph: {type(module).__name__} was called with position_ids and no "
            "attention_mask, use_cache unset and config.use_cache=True: use_cache=False would "
            "make transformers mask packed documents (position ids that restart) apart, where "
            "this call, with the config's cache, attends across them. It keeps the cache, as "
            "eager does, so its decoder layers run eagerly. To graph them, pass "
            "use_cache=False (attention within each document) or an attention_mask",
            GraphFallbackWarning,
            stacklevel=2,
        )
        return args, kwargs
    kwargs["use_cache"] = False
    return args, kwargs


def _refuse_ungraphable_experts(model: nn.Module) -> None:
    for name, m in model.named_modules():
        impl = getattr(getattr(m, "config", None), "_experts_implementation", None)
        # experts stacked in one (num_experts, ...) parameter: a use_experts_implementation class
        stacked = getattr(m, "down_proj", None)
        if impl == "eager" and isinstance(stacked, nn.Parameter) and stacked.dim() == 3:
            raise ValueError(
                f"{name} ({type(m).__name__}) runs the eager expert loop, which syncs with the host "
                "once per expert (nonzero, a Python loop over the experts hit): a CUDA graph cannot "
                "hold it. Run the experts batched or grouped: "
                'model.set_experts_implementation("batched_mm") (or "grouped_mm"), or '
                'experts_implementation="batched_mm" when building the model'
            )
        if impl == "grouped_mm" and isinstance(stacked, nn.Parameter) and stacked.is_cuda:
            if stacked.dtype != torch.bfloat16:  # seen on an H200 with torch 2.11
                raise ValueError(
                    f"{name} ({type(m).__name__}) runs grouped_mm in {stacked.dtype} on CUDA, "
                    "where torch's grouped GEMM takes bfloat16 and its other path copies to the "
                    "host, which a CUDA graph cannot capture. Train the model in bfloat16 "
                    '(model.to(torch.bfloat16)), or run model.set_experts_implementation("batched_mm")'
                )


@functools.lru_cache(maxsize=256)
def _describe_state(checkpointing: bool, adapters: frozenset) -> str:
    """The layer-state string tgraph compares (and names in a fallback warning)."""
    text = "gradient checkpointing " + ("on" if checkpointing else "off")
    if adapters:
        text += "; adapters " + " | ".join(sorted(map(describe_adapter, adapters)))
    return text


_PLAIN_STATES = {on: _describe_state(on, frozenset()) for on in (False, True)}


def _layer_state(layer: nn.Module) -> str:
    """What the layer's graph bakes in beyond its arguments, as one comparable string (a
    layer without PEFT adapters: one of two strings made once; every call asks)."""
    adapters = layer.__dict__.get("_tgraph_hf_adapters")
    checkpointing = bool(getattr(layer, "gradient_checkpointing", False))
    if not adapters:
        return _PLAIN_STATES[checkpointing]
    return _describe_state(checkpointing, frozenset(map(adapter_state, adapters)))


def _refuse_reentrant(layer: nn.Module) -> None:
    fn = getattr(layer, "_gradient_checkpointing_func", None)
    reentrant = getattr(fn, "keywords", {}).get("use_reentrant", None)
    if reentrant is None or reentrant:
        raise ValueError(
            f"{type(layer).__name__} has reentrant gradient checkpointing (use_reentrant True "
            "or unset), which cannot run inside a backward graph (it calls backward inside "
            "backward; the graph uses torch.autograd.grad). Turn it on non-reentrant: "
            "model.gradient_checkpointing_enable("
            'gradient_checkpointing_kwargs={"use_reentrant": False}), or with newer transformers '
            "model.activation_checkpointing_enable("
            'activation_checkpointing_kwargs={"use_reentrant": False})'
        )


def _layer_call(self, *args, **kwargs):
    """The graphable layer's ``__call__``: checks, then tgraph's dispatch."""
    state = self.__dict__.get("_tgraph")
    if state is None or inside_graphed_region():
        return nn.Module.__call__(self, *args, **kwargs)  # forward checkpoints (_graphable)
    if getattr(self, "gradient_checkpointing", False) and self.training and torch.is_grad_enabled():
        _refuse_reentrant(self)
    kwargs[STATE_KWARG] = _layer_state(self)
    return GraphableModule.__call__(self, *args, **kwargs)


def _outermost_model(model: nn.Module) -> nn.Module:
    """The outermost transformers ``PreTrainedModel`` in ``model`` (``model`` itself unless it
    is a wrapper: PEFT, DDP)."""
    base = _transformers().PreTrainedModel
    top = next((m for m in model.modules() if isinstance(m, base)), None)
    if top is None:
        raise ValueError(
            f"whole=True: {type(model).__name__} holds no transformers PreTrainedModel to graph "
            "whole; call graph_layers(model) for per-layer graphs"
        )
    return top


def _model_call(self, *args, **kwargs):
    """The whole model's ``__call__`` (``graph_layers(whole=True)``): its layers' state joins
    the call key, as each layer's does in per-layer graphs (:func:`_layer_call`)."""
    state = self.__dict__.get("_tgraph")
    if state is None or inside_graphed_region():
        return nn.Module.__call__(self, *args, **kwargs)
    layers = self.__dict__.get("_tgraph_hf_layers", ())
    if self.training and torch.is_grad_enabled():
        for layer in layers:
            if getattr(layer, "gradient_checkpointing", False):
                _refuse_reentrant(layer)
    kwargs[STATE_KWARG] = _model_state(self, layers)
    return GraphableModule.__call__(self, *args, **kwargs)


def _model_state(model: nn.Module, layers: tuple) -> str:
    """What the whole model's graph bakes in beyond its arguments: its layers' state and its
    config's entries changed since :func:`graph_layers` (the forward reads the config at every
    call: ``output_hidden_states``, ``loss_type``, the attention implementation), compared by
    value (one dict comparison when nothing changed)."""
    states = tuple(map(_layer_state, layers))
    if len(set(states)) > 1:
        text = "; ".join(f"layer {i}: {state}" for i, state in enumerate(states))
    else:
        text = states[0] if states else ""
    config = getattr(model, "config", None)
    seen = model.__dict__.get("_tgraph_hf_config")
    if config is not None and seen is not None and vars(config) != seen:
        now = vars(config)
        changed = sorted(
            k
            for k in now.keys() | seen.keys()
            if now.get(k, seen) != seen.get(k, now) and not _recorded(k, now, seen, model)
        )
        if changed:
            text += "; config changed: " + ", ".join(
                f"{k}={now.get(k, '(removed)')!r}" for k in changed
            )
        else:  # only what save_pretrained records: compared from here on (the fast path back)
            model.__dict__["_tgraph_hf_config"] = _config_snapshot(config)
    return text


_CONFIG_RECORDS = frozenset({"architectures", "_name_or_path", "transformers_version"})
"""Config entries that ``save_pretrained`` and ``from_pretrained`` write as a record of the
model, which no forward reads: a checkpoint saved mid-training must not end the whole model's
replays (``save_pretrained`` sets ``architectures`` to the class, graphable here, and the dtype
to the name of the parameters' dtype)."""


def _recorded(key: str, now: dict, seen: dict, model: nn.Module) -> bool:
    """Whether ``key``'s change is one of those records: an entry of :data:`_CONFIG_RECORDS`,
    or the dtype set to the name of the model's own dtype where it was unset or that dtype."""
    if key in _CONFIG_RECORDS:
        return True
    if key not in ("dtype", "torch_dtype"):
        return False
    own = _dtype_name(getattr(model, "dtype", None))
    was, new = seen.get(key), now.get(key)
    return (
        isinstance(new, str | torch.dtype)
        and _dtype_name(new) == own
        and (was is None or _dtype_name(was) == own)
    )


def _dtype_name(dtype) -> str:
    """``torch.float32`` or ``"float32"`` as ``"float32"`` (save_pretrained's spelling)."""
    return str(dtype).removeprefix("torch.")


def _config_snapshot(config) -> dict:
    """A config's entries as :func:`_model_state` compares them: by value (a deep copy), or by
    identity where a copy does not compare equal to its original (an object without ``__eq__``)."""
    snap = {}
    for k, v in vars(config).items():
        c = copy.deepcopy(v)
        try:
            same = bool(c == v)
        except Exception:  # an ambiguous or failing comparison: keep the object itself
            same = False
        snap[k] = c if same else v
    return snap


@functools.cache
def _graphable_model(cls: type) -> type:
    """``cls`` (a transformers model) as one graphable unit, calling its layers plainly inside."""
    base_forward = cls.forward

    def forward(self, *args, **kwargs):
        kwargs.pop(STATE_KWARG, None)
        return base_forward(self, *args, **kwargs)

    forward.__doc__ = base_forward.__doc__
    forward.__signature__ = inspect.signature(base_forward)  # _use_cache_position reads it
    return GraphableModule.of(
        cls, __call__=_model_call, forward=forward, _tgraph_hf_base=cls, graphs_parts=True
    )


@functools.cache
def _graphable(cls: type, checkpointing_base: type | None) -> type:
    """``cls`` with :class:`tgraph.GraphableModule` first in its MRO, checkpointing in ``forward``."""
    base_forward = cls.forward
    # transformers <= 5.17 checkpoints in GradientCheckpointingLayer.__call__, which _layer_call
    # bypasses; later versions wrap every subclass's forward (__init_subclass__), this one too.
    in_call = checkpointing_base is not None and "__call__" in checkpointing_base.__dict__

    def forward(self, *args, **kwargs):
        kwargs.pop(STATE_KWARG, None)
        if in_call and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            keep_cache = getattr(self, "_can_checkpoint_with_cache", False)
            for k in ("past_key_values", "past_key_value", "layer_past"):
                if kwargs.get(k) is not None and not keep_cache:
                    kwargs[k] = None  # as transformers does: a recompute would update it twice
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            return self._gradient_checkpointing_func(
                functools.partial(base_forward, self, **kwargs), *args
            )
        return base_forward(self, *args, **kwargs)

    forward.__doc__ = base_forward.__doc__
    return GraphableModule.of(cls, __call__=_layer_call, forward=forward, _tgraph_hf_base=cls)
