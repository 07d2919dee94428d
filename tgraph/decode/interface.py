"""The protocol a model implements to be served by :class:`~tgraph.decode.DecodeEngine`.

The engine owns the KV cache, the static buffers, the graphs, batching and sampling; the model
only says how to run its layers against the cache. Any object with these attributes and two
methods is served; nothing here knows any particular model (the toy GPT's implementation is
:class:`tgraph.toy.gpt_decode.GPTDecoder`)::

    class MyDecoder:
        n_layer: int          # attention layers (one KV cache entry each)
        n_head: int           # KV heads per layer
        head_dim: int         # width of one head
        vocab_size: int       # logits width; valid token ids are 0..vocab_size-1
        max_positions: int    # longest sequence the model supports (e.g. learned positions)
        dtype: torch.dtype    # dtype of the KV cache (a property reading the weights lets
                              # the engine's re-capture follow model.to(dtype))
        device: torch.device  # where the KV cache and static buffers live

        def prefill(self, inputs, cache):             # captured per token-count bucket
            # inputs: PrefillInputs, a prompt padded to T tokens (positions 0..T-1), its real
            # length (1,) and slot (1,). Write keys/values of positions 0..T-1 into the slot
            # (cache.write_prefill), attend causally (so the padding after the prompt cannot
            # reach it) and return the logits of position length-1, shape (1, V).

        def decode_step(self, inputs, cache):         # captured per batch-size bucket
            # inputs: StepInputs of B rows. For each row write the new token's key/value at
            # [inputs.slots[i], :, inputs.positions[i]] (cache.write_step), attend to keys
            # 0..inputs.lengths[i]-1 of row i's slot (cache.read(layer, B)[i] + a mask; stale
            # keys beyond are arbitrary) and return logits (B, V).

        # optional: encode(text) -> list[int] and decode(ids) -> str, for text prompts.
        # optional: serving() -> a context manager the engine enters around capture and every
        # generate/prefill/decode call (the toy GPT's switches the model to eval mode inside
        # and restores its train/eval mode after).
        # optional: called_modules() -> the modules the two methods call (module(x): their
        # forward and hooks run, with their submodules). The engine refuses a forward hook on
        # any other served module, which would never run (tgraph.decode.hooks). Without it,
        # every module is taken to be called.
        # optional: config_values() -> {name: value} of the Python values outside the modules
        # that the methods read (a config's sliding_window): compared before each call, a
        # change captures the graphs again (the methods must read them anew at each call).

Rules for both methods (they are captured as CUDA graphs): no host syncs (``.item()``,
printing, boolean-mask indexing), no shapes that depend on tensor values, no new CPU tensors, no
writes outside the slots they are given, and every row independent of the other rows (padding
rows must not change live rows' logits, padding positions must not change the prompt's).
Read the model's submodules and the Python numbers they use from the model at each call (the toy
GPT's adapter reads ``self.model.h``), not from references kept at construction: after a
submodule is replaced the engine captures again (:mod:`tgraph.decode.weights`), and kept
references would capture the old one.

A model type that cannot carry the methods itself gets an adapter registered with
:func:`as_decode_model` (``@as_decode_model.register(MyModel)``), as ``tgraph.toy.gpt_decode`` does
for the toy GPT; then ``DecodeEngine(my_model, ...)`` serves it directly.

Adapters for another library's models are registered *lazily* (:data:`LAZY_ADAPTERS`, the
mechanism of dask's ``Dispatch.register_lazy``): when no adapter matches, the top-level package of
each class in the model's MRO is looked up, and the adapter module of a listed package is
imported, which registers its adapters, and the call dispatches again. So importing tgraph never
imports transformers, yet ``DecodeEngine(hf_model, ...)`` finds the transformers adapter
(:mod:`tgraph.integrations.transformers_decode`): an object whose class lives in
``transformers`` can only exist once transformers is imported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from tgraph.decode.buffers import PrefillInputs, StepInputs
from tgraph.decode.kv_cache import KVCache


class ServedInEval:
    """An adapter's ``serving()``: ``model`` in eval mode while the engine captures or generates,
    every submodule's own train/eval flag restored after, so sampling between training steps
    leaves it training as it was (a model in ``train()`` whose dropout modules were set to
    ``eval()`` gets them back in eval mode). Nested calls (every decode step inside
    ``generate``) leave the mode to the outermost and cost nothing.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._active = False

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self._active:
            yield
            return
        flags = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self.model.train(flags[0][1])  # the root's train() as before (overrides run), then
            for module, training in flags:  # each module's own flag, which it set to the root's
                module.training = training


@runtime_checkable
class DecodeModel(Protocol):
    """What :class:`~tgraph.decode.DecodeEngine` needs from a model (see the module docstring)."""

    n_layer: int
    n_head: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: torch.dtype
    device: torch.device

    def prefill(self, inputs: PrefillInputs, cache: KVCache) -> torch.Tensor: ...

    def decode_step(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor: ...


LAZY_ADAPTERS: dict[str, str] = {"transformers": "tgraph.integrations.transformers_decode"}
"""Top-level package of a model's class -> the tgraph module registering adapters for it,
imported the first time such a model meets :func:`as_decode_model` (entries are removed once
imported)."""


@functools.singledispatch
def as_decode_model(model: object) -> DecodeModel:
    """Return ``model`` as a :class:`DecodeModel`: an implementation is returned as is, a type
    with a registered adapter is wrapped (``as_decode_model.register``, or an adapter module
    of :data:`LAZY_ADAPTERS`, imported on first use).

    Raises:
        TypeError: ``model`` neither implements the protocol nor has an adapter.
    """
    if isinstance(model, DecodeModel):
        return model
    for cls in type(model).__mro__:
        package = cls.__module__.partition(".")[0]
        if package in LAZY_ADAPTERS:
            importlib.import_module(LAZY_ADAPTERS[package])  # registers its adapters
            del LAZY_ADAPTERS[package]  # once: a second miss is a real miss
            return as_decode_model(model)
    if _is_peft_model(model):
        raise TypeError(
            f"DecodeEngine cannot serve the PEFT wrapper {type(model).__name__} itself: pass the "
            "model it wraps, DecodeEngine(peft_model.base_model.model, ...), whose adapter "
            "layers are served as they are (a later merge_adapter(), set_scale or set_adapter "
            "is captured again), or merge the adapters into it first: "
            "DecodeEngine(peft_model.merge_and_unload(), ...)"
        )
    if isinstance(model, torch.nn.Module) and hasattr(model, "_orig_mod"):
        raise TypeError(
            f"DecodeEngine cannot serve the torch.compile wrapper {type(model).__name__}: pass "
            "the module it wraps, DecodeEngine(compiled._orig_mod, ...) (the engine captures "
            "the model's own code; modules compiled inside it are served as they are)"
        )
    missing = [
        name
        for name in DecodeModel.__annotations__.keys() | {"prefill", "decode_step"}
        if not hasattr(model, name)
    ]
    raise TypeError(
        f"DecodeEngine cannot serve this {type(model).__name__}: it lacks {sorted(missing)} of the "
        "decode interface and no adapter is registered for its type; implement prefill and "
        "decode_step as described in tgraph.decode.interface, or register an adapter with "
        "@tgraph.decode.as_decode_model.register"
    )


def refuse_own_forward(
    model: torch.nn.Module, bypassed: list[torch.nn.Module], *, stock: str
) -> None:
    """Raise where one of ``bypassed`` runs a ``forward`` that is not the stock one: a
    subclass's override, a method patched onto the class or set on the instance (accelerate's
    ``add_hook_to_module`` sets one). For adapters that run a module's parts, not its
    ``forward``.

    Such an adapter never calls these modules' ``forward``, so their own computation would
    silently not happen. tgraph's graphable classes (:meth:`tgraph.GraphableModule.of`, the
    transformers integration's layer classes) wrap the stock ``forward`` and pass.

    Args:
        model: the served model (names the module in the error).
        bypassed: the modules whose ``forward`` the adapter never calls.
        stock: the module-name prefix of the stock classes (``"transformers."``): a
            ``forward`` defined there, on a class defined there, is the stock one.

    Raises:
        TypeError: naming the module, the method and the fix.
    """
    for m in bypassed:
        if "forward" in m.__dict__:
            what = f"a forward set on the {type(m).__name__} instance"
        else:
            owner = next(
                c
                for c in type(m).__mro__
                if "forward" in c.__dict__ and "_tgraph_hf_base" not in c.__dict__
            )
            source = getattr(owner.__dict__["forward"], "__module__", None) or "?"
            if owner.__module__.startswith(stock) and source.startswith(stock):
                continue
            what = f"{owner.__qualname__}.forward (from {source})"
        names = {id(m): n or "the model" for n, m in model.named_modules()}
        raise TypeError(
            f"DecodeEngine cannot serve {type(model).__name__}: {names[id(m)]} runs {what}, "
            f"not the stock forward ({stock.rstrip('.')}), which the decode adapter never calls "
            "(it runs the model's parts with its own KV cache and attention), so the tokens "
            "would be the stock model's. Serve a model of the stock classes (a change inside a "
            "part the forward calls, such as lm_head or mlp, is kept), or implement "
            "prefill/decode_step (tgraph.decode.interface) for your class"
        )


def _is_peft_model(model: object) -> bool:
    """peft's ``PeftModel`` (duck-typed: no import of peft), which wraps the served model at
    ``base_model.model``."""
    cls = type(model)
    return cls.__module__.partition(".")[0] == "peft" and hasattr(
        getattr(model, "base_model", None), "model"
    )
