"""Serve transformers causal LMs with :class:`~tgraph.decode.DecodeEngine`, graphs and all.

    model = LlamaForCausalLM.from_pretrained(path).cuda()
    engine = DecodeEngine(model, max_batch_size=8, max_seq_len=512)   # no wrapper needed
    engine.generate([[1, 306, 4658]], max_new_tokens=32)

:class:`TransformersDecoder` implements :class:`~tgraph.decode.interface.DecodeModel` with the
model's own modules and weights, called layer by layer as the model's ``forward`` calls them: the
token embedding (and GPT-2's learned positions), each layer's norms, its q/k/v/o projections
(GPT-2's fused ``Conv1D`` ``c_attn``), the model's rotary module, the MLP, the final norm
and ``lm_head``. Only the attention is the engine's: scaled dot-product attention
against the engine's static :class:`~tgraph.decode.KVCache` (no transformers ``Cache`` object
exists inside a graph), with the mask the config implies:

* causal, and a sliding window on each layer that has one (Mistral's ``sliding_window``;
  Qwen2/Qwen3 layers whose ``layer_types`` entry is ``"sliding_attention"``), read from the
  config as transformers' forward reads it at every call: a query at position ``q`` sees keys
  ``q - window < k <= q``, transformers' ``sliding_window_overlay``;
* grouped KV heads (``num_key_value_heads < num_attention_heads``) are cached once per KV head.
  A decode step folds each group's query heads into the query dimension, ``(B, n_kv, groups,
  hd)``, so they read their shared keys in place instead of a repeated copy; prefill repeats the
  keys as transformers' ``repeat_kv`` does (one query row per position, each with its own mask).

Rotary embeddings come from the model's ``rotary_emb`` module, called on the step's positions
inside the graph, so every scaling whose frequencies are fixed at load time (default, linear,
llama3, yarn, ...) gives exactly the model's cos/sin. Scalings that choose frequencies from the
sequence length seen so far (``dynamic``, ``longrope``) are refused: in a batch that length is
another row's, and the choice is made on the host.

The decode step is a replay of a few hundred small kernels, so the kernel count is its cost. Two
of the model's computations are therefore run as fewer kernels, with the model's weights and the
same formula (equal up to floating-point rounding, which the greedy-parity tests bound):

* RMSNorm (``LlamaRMSNorm`` and its Mistral/Qwen copies): ``F.rms_norm`` with the layer's weight
  and ``variance_epsilon``, one fused kernel on CUDA instead of six (transformers swaps in fused
  norms the same way through its kernels hub, ``use_kernel_forward_from_hub("RMSNorm")``);
* the rotation ``x * cos + rotate_half(x) * sin`` of ``apply_rotary_pos_emb``: ``rotate_half(x)
  * sin`` is ``roll(x, hd / 2) * sin_signed`` with ``sin_signed = cat(-sin_1, sin_2)`` made once
  per step, and q and k rotate as one tensor: three kernels (mul, roll, addcmul) for both
  instead of five for each.

Attention masks are additive float masks built once per step (SDPA would convert a boolean
mask in every layer), with the key dimension padded to a multiple of 16 so the memory-efficient
kernel reads them in place.

Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` (its q/k norms too) and ``GPT2LMHeadModel``. Any other
``PreTrainedModel`` raises :class:`TypeError` naming its architecture, and so does a subclass of
a supported one whose ``forward`` (of the model, its base model, a layer, an attention or a
norm replaced above) is not transformers' own: the adapter never calls those methods.

The parts are read from the model at the first call after any write to one of its modules or
a change of the config values they read (:meth:`TransformersDecoder.parts`,
:meth:`~TransformersDecoder.config_values`), not kept from construction: a head, layer, norm or
embedding replaced after capture, an attention's ``scaling`` or the config's ``sliding_window``
changed, is what the engine's re-capture (its check finds the change before the next call) and
its eager runs serve.

Hooks: the adapter calls the modules :meth:`TransformersDecoder.called_modules` names (their
forward and hooks run); a hook on any other module (a decoder layer, its attention, an RMSNorm
run as ``F.rms_norm``, the model) would never run, and the engine refuses it
(:mod:`tgraph.decode.hooks`).

Registration is lazy (:data:`tgraph.decode.interface.LAZY_ADAPTERS`): importing tgraph does not
import transformers; the first model whose class lives in ``transformers`` that reaches
:func:`~tgraph.decode.as_decode_model` imports this module, which registers its adapters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from tgraph.baked import _count_writes_to, watch_module_writes
from tgraph.baked import _epoch as _module_epoch
from tgraph.decode.buffers import PrefillInputs, StepInputs
from tgraph.decode.interface import ServedInEval, as_decode_model, refuse_own_forward
from tgraph.decode.kv_cache import KVCache

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the module is only imported for HF models
    raise ImportError(
        "tgraph.integrations.transformers_decode serves transformers models and needs the "
        'library: pip install "transformers>=4.50"'
    ) from exc

ROTARY_FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED = (*ROTARY_FAMILIES, "GPT2LMHeadModel")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


class Shape(NamedTuple):
    """What the engine's KV cache and buffers are sized for, read from the model."""

    n_layer: int  # decoder layers (one KV cache entry each)
    n_head: int  # KV heads per layer
    groups: int  # query heads per KV head
    head_dim: int
    vocab_size: int


@dataclass(frozen=True)
class Parts:
    """The model's modules and the Python numbers the decode methods read, as the model held
    them at the last write to one of its modules (:meth:`TransformersDecoder.parts`)."""

    shape: Shape
    embed: nn.Module
    positions: nn.Module | None  # GPT-2's learned positions
    rotary: nn.Module | None  # the rotary families' rotary_emb
    layers: tuple[nn.Module, ...]
    final_norm: nn.Module
    lm_head: nn.Module
    scales: tuple[float, ...]  # each layer's attention scale
    windows: tuple[int | None, ...]  # each layer's sliding window (None: full attention)


class TransformersDecoder:
    """A transformers causal LM behind the decode interface (see the module docstring).

    Args:
        model: one of :data:`SUPPORTED`; in eval mode while the engine captures or generates
            (:attr:`serving`), each module in its own train/eval mode after. Its weights are used in place
            (reallocated ones, by a sync or ``model.to(dtype)``, are followed by the engine's
            weight check; to move the model to another device, build a new engine). Its parts
            are read anew after a write to one of its modules or a change of the config values
            they read (:meth:`parts`): a submodule replaced (``model.lm_head = ...``, a decoder
            layer, the final norm, the embedding), an attribute changed
            (``self_attn.scaling``) or ``config.sliding_window`` changed is served by the next
            eager call and by the graphs the engine captures again, which its check before
            each call does.
        tokenizer: optional transformers tokenizer for text prompts (``encode``/``decode``).
            Without one, a model of at least 256 tokens gets a byte-level tokenizer (UTF-8
            bytes are token ids, as tgraph's toy corpus uses); a smaller one takes ids only.

    Raises:
        TypeError: an unsupported architecture or configuration (the message names it).
    """

    def __init__(self, model: nn.Module, tokenizer=None) -> None:
        name = type(model).__name__
        family = _family(model)
        if family is None:
            raise TypeError(
                f"DecodeEngine has no adapter for the transformers model {name} (model_type "
                f"{getattr(model.config, 'model_type', '?')!r}); supported: {', '.join(SUPPORTED)}. "
                "Implement prefill/decode_step (tgraph.decode.interface) for it, or register an "
                "adapter with @tgraph.decode.as_decode_model.register"
            )
        self.model = model
        self._eval = ServedInEval(model)  # eval mode while served, its own mode after
        self.architecture = family
        self.gpt2 = family == "GPT2LMHeadModel"
        cfg = model.config
        self.max_positions = cfg.n_positions if self.gpt2 else cfg.max_position_embeddings
        self.device = model.get_input_embeddings().weight.device
        self._config_keys = _config_keys(model.config, self.gpt2)
        self.shape = self._read().shape
        self._parts: Parts | None = None  # read at this module epoch, with these config values
        self._epoch = -1
        self._config: dict[str, object] = {}
        watch_module_writes()  # idempotent: the module epoch parts() reads
        self.n_layer, self.n_head, self.groups, self.head_dim, self.vocab_size = self.shape
        self.n_query_heads = self.n_head * self.groups
        self._set_tokenizer(tokenizer)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Entered by the engine around capture and every call: the model in eval mode
        (:class:`~tgraph.decode.interface.ServedInEval`) and its parts checked, so a part
        replaced by one the adapter cannot serve raises here, before a capture starts (where
        the error would read as a capture failure)."""
        with self._eval():
            self.parts()
            yield

    @property
    def dtype(self) -> torch.dtype:
        """The model's dtype now (its embedding's): the KV cache and the masks follow a
        ``model.to(dtype)`` at the engine's re-capture."""
        return self.model.get_input_embeddings().weight.dtype

    # -- the model's parts ------------------------------------------------------------------

    def config_values(self) -> dict[str, object]:
        """The config values the parts are read from (``config.sliding_window``, the shape's
        sizes), by name; lists as tuples (a list written in place is a change). The engine
        compares them before each call and captures again when one changed. Read from the
        config's ``__dict__`` (about 1.5 us; ``getattr`` through transformers' attribute map
        costs several times that), where a write to any of them lands."""
        values = vars(self.model.config)
        return {
            f"config.{k}": tuple(v) if isinstance(v := values.get(k), list) else v
            for k in self._config_keys
        }

    def parts(self) -> Parts:
        """The model's parts now (:class:`Parts`), checked as at construction.

        Read at the first call (:meth:`serving`, a prefill, a decode step) after a write to
        any of the model's modules through ``nn.Module``'s setters (the module epoch of
        :mod:`tgraph.baked`, which the engine's check reads too) or a change of
        :meth:`config_values` (a few attribute reads per call), else the last read's: a read
        costs about 0.3 ms for a 32-layer model, which an eager step would otherwise pay every
        time. A write that bypasses the setters (``m.__dict__[k] = v``) is not seen, as the
        engine's check does not see it (README, "What a graph keeps").

        Raises:
            TypeError: as the constructor (a replaced part runs a ``forward`` of its own).
            RuntimeError: the model's shape changed since the engine sized its KV cache and
                buffers (``resize_token_embeddings``, a layer added): build a new engine.
        """
        config = self.config_values()
        if self._epoch == _module_epoch[0] and config == self._config:
            return self._parts
        parts = self._read()
        if parts.shape != self.shape:
            field, was, now = next(
                (f, a, b) for f, a, b in zip(Shape._fields, self.shape, parts.shape) if a != b
            )
            raise RuntimeError(
                f"the served {type(self.model).__name__}'s {field} changed from {was} to {now} "
                "after the DecodeEngine was built (its KV cache and buffers are sized for "
                f"{was}); build a new DecodeEngine for the changed model"
            )
        _count_writes_to(tuple(self.model.modules()))  # a module swapped in is watched too
        self._parts, self._epoch, self._config = parts, _module_epoch[0], config
        return parts

    def called_modules(self) -> list[nn.Module]:
        """The modules :meth:`prefill` and :meth:`decode_step` call, whose forward and hooks
        run (with their submodules): the embedding (GPT-2's positions too), the rotary module,
        each layer's projections and MLP, the norms not run as ``F.rms_norm`` and ``lm_head``.
        The engine refuses a hook on any other module (:mod:`tgraph.decode.hooks`)."""
        p = self.parts()
        out = [p.embed, p.positions, p.rotary, p.final_norm, p.lm_head]
        for layer in p.layers:
            if self.gpt2:
                attn = layer.attn
                out += [layer.ln_1, attn.c_attn, attn.c_proj, layer.ln_2, layer.mlp]
            else:
                attn = layer.self_attn
                out += [layer.input_layernorm, attn.q_proj, attn.k_proj, attn.v_proj]
                out += [attn._modules.get("q_norm"), attn._modules.get("k_norm")]  # Qwen3
                out += [attn.o_proj, layer.post_attention_layernorm, layer.mlp]
        return [m for m in out if m is not None and not _fused(m)]  # rms_norm runs those

    def _read(self) -> Parts:
        model = self.model
        parts = _gpt2_parts(model) if self.gpt2 else _rotary_parts(model)
        refuse_own_forward(model, self._bypassed(parts), stock="transformers.")
        return parts

    def _bypassed(self, parts: Parts) -> list[nn.Module]:
        """The modules whose ``forward`` the adapter never runs (it runs their parts instead):
        the model, its base model, each layer and its attention, the norms :func:`rms_norm`
        replaces."""
        model, layers = self.model, parts.layers
        out = [model, model.transformer if self.gpt2 else model.model, *layers]
        out += [layer.attn if self.gpt2 else layer.self_attn for layer in layers]
        if not self.gpt2:
            norms = [parts.final_norm]
            for layer in layers:
                norms += [layer.input_layernorm, layer.post_attention_layernorm]
                q_and_k = layer.self_attn._modules  # Qwen3's q_norm and k_norm, if any
                norms += [q_and_k.get("q_norm"), q_and_k.get("k_norm")]
            out += [n for n in norms if n is not None and _fused(n)]
        return out

    def _set_tokenizer(self, tokenizer) -> None:
        if tokenizer is not None:
            self.encode = lambda text: list(tokenizer.encode(text))
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        elif self.vocab_size >= 256:
            self.encode = lambda text: list(text.encode("utf-8"))
            self.decode = lambda ids: bytes(i for i in ids if 0 <= i < 256).decode(
                "utf-8", errors="replace"
            )

    # -- one layer's parts ------------------------------------------------------------------

    def _norms(self, layer: nn.Module) -> tuple[Norm, Norm]:
        if self.gpt2:
            return layer.ln_1, layer.ln_2
        return rms_norm(layer.input_layernorm), rms_norm(layer.post_attention_layernorm)

    def _qkv(
        self, layer: nn.Module, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries (B, H, T, hd), keys and values (B, n_kv, T, hd) of normed input (B, T, C)."""
        B, T, _ = h.shape
        hd = self.head_dim
        if self.gpt2:  # one Conv1D for q, k and v
            attn = layer.attn
            q, k, v = attn.c_attn(h).split(attn.split_size, dim=2)  # (B, T, C) each
            return tuple(t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        attn = layer.self_attn
        q = attn.q_proj(h).view(B, T, -1, hd)  # (B, T, H, hd)
        k = attn.k_proj(h).view(B, T, -1, hd)  # (B, T, n_kv, hd)
        v = attn.v_proj(h).view(B, T, -1, hd).transpose(1, 2)  # (B, n_kv, T, hd)
        if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm over each head, before the rotation
            q, k = rms_norm(attn.q_norm)(q), rms_norm(attn.k_norm)(k)
        # q and k rotate together: three kernels for both instead of three each.
        qk = rotate(torch.cat((q, k), dim=2).transpose(1, 2), *rope)  # (B, H + n_kv, T, hd)
        return qk[:, : self.n_query_heads], qk[:, self.n_query_heads :], v

    def _out(self, layer: nn.Module, y: torch.Tensor) -> torch.Tensor:
        """Output projection of attention output (B, T, H * hd)."""
        return (layer.attn.c_proj if self.gpt2 else layer.self_attn.o_proj)(y)

    def _embed(self, parts: Parts, tokens: torch.Tensor, positions: torch.Tensor):
        """Embeddings (B, T, C) and rotary (cos, sin) of tokens and positions (B, T)."""
        x = parts.embed(tokens)
        if self.gpt2:
            return x + parts.positions(positions), None
        return x, rotation(*parts.rotary(x, positions), self.n_query_heads + self.n_head)

    def _logits(self, parts: Parts, x: torch.Tensor) -> torch.Tensor:
        norm = parts.final_norm if self.gpt2 else rms_norm(parts.final_norm)
        return parts.lm_head(norm(x))

    # -- the decode interface ---------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, inputs: PrefillInputs, cache: KVCache) -> torch.Tensor:
        """Run the padded prompt, store its keys/values in its slot; return the logits of its
        last real position (1, V). Graph-safe: the causal mask keeps the padding out."""
        p = self.parts()
        T = inputs.tokens.shape[0]
        positions = cache.key_positions[:T]  # (T,)
        x, rope = self._embed(p, inputs.tokens[None], positions[None])  # (1, T, C)
        masks = prompt_masks(positions, p.windows, self.dtype)
        for i, layer in enumerate(p.layers):
            norm_attn, norm_mlp = self._norms(layer)
            q, k, v = self._qkv(layer, norm_attn(x), rope)  # (1, H | n_kv, T, hd)
            cache.write_prefill(i, inputs.slot, k[0], v[0])
            if self.groups > 1:  # transformers' repeat_kv: query head h reads KV head h // g
                k, v = (t.repeat_interleave(self.groups, dim=1) for t in (k, v))
            window = p.windows[i]
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=masks[window], is_causal=window is None, scale=p.scales[i]
            )  # (1, H, T, hd)
            x = x + self._out(layer, y.transpose(1, 2).reshape(1, T, -1))
            x = x + layer.mlp(norm_mlp(x))
        last = x[0].index_select(0, inputs.length - 1)  # (1, C): the prompt's last position
        return self._logits(p, last)  # (1, V)

    @torch.no_grad()
    def decode_step(self, inputs: StepInputs, cache: KVCache) -> torch.Tensor:
        """One token per row against the cache; returns logits (B, V). Graph-safe."""
        p = self.parts()
        B, H, g, hd = inputs.rows, self.n_query_heads, self.groups, self.head_dim
        x, rope = self._embed(p, inputs.tokens[:, None], inputs.positions[:, None])  # (B, 1, C)
        masks = step_masks(cache.key_positions, inputs.lengths, p.windows, self.dtype)
        for i, layer in enumerate(p.layers):
            norm_attn, norm_mlp = self._norms(layer)
            q, k, v = self._qkv(layer, norm_attn(x), rope)  # (B, H | n_kv, 1, hd)
            cache.write_step(i, inputs.slots, inputs.positions, k[:, :, 0], v[:, :, 0])
            keys, values = cache.read(i, B)  # (B, n_kv, S, hd), views of slots 0..B-1
            # One query per row: a group's g query heads become g query rows of its KV head.
            q = q.reshape(B, self.n_head, g, hd)  # (B, n_kv, g, hd)
            y = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=masks[p.windows[i]], scale=p.scales[i]
            )  # (B, n_kv, g, hd)
            x = x + self._out(layer, y.reshape(B, 1, H * hd))
            x = x + layer.mlp(norm_mlp(x))
        return self._logits(p, x[:, 0])  # (B, V)


# -- masks -------------------------------------------------------------------------------------


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``allowed``, -inf elsewhere, in ``dtype``; the last dimension is padded to a
    multiple of 16 (and sliced back) so SDPA's memory-efficient kernel takes it without a copy."""
    *lead, S = allowed.shape
    out = allowed.new_zeros((*lead, -(-S // 16) * 16), dtype=dtype)[..., :S]
    return out.masked_fill_(allowed.logical_not(), float("-inf"))


def prompt_masks(
    positions: torch.Tensor, windows: Sequence[int | None], dtype: torch.dtype
) -> dict[int | None, torch.Tensor | None]:
    """Prefill masks (T, T) by window: None is plain causal (SDPA's ``is_causal``, no mask);
    a window ``w`` lets query ``q`` see keys ``q - w < k <= q``."""
    masks: dict[int | None, torch.Tensor | None] = {None: None}
    distance = positions[:, None] - positions[None, :]  # (T, T): query minus key position
    for w in set(windows) - {None}:
        masks[w] = additive((distance >= 0) & (distance < w), dtype)
    return masks


def step_masks(
    key_positions: torch.Tensor,
    lengths: torch.Tensor,
    windows: Sequence[int | None],
    dtype: torch.dtype,
) -> dict[int | None, torch.Tensor]:
    """Decode-step masks (B, 1, 1, S) by window: row ``i`` sees keys ``0..lengths[i]-1``, or
    the last ``w`` of them; stale keys past a row's length are masked out."""
    lengths = lengths[:, None]  # (B, 1)
    seen = key_positions[None, :] < lengths  # (B, S)
    masks = {None: additive(seen, dtype)[:, None, None, :]}  # over KV heads and query rows
    for w in set(windows) - {None}:
        allowed = seen & (key_positions[None, :] >= lengths - w)
        masks[w] = additive(allowed, dtype)[:, None, None, :]
    return masks


# -- the model's norms and rotation, in fewer kernels -----------------------------------------

Norm = Callable[[torch.Tensor], torch.Tensor]
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def rms_norm(norm: nn.Module) -> Norm:
    """``norm`` as ``F.rms_norm`` with its weight and eps when it is one of :data:`RMS_NORMS`
    (``weight * x / sqrt(mean(x^2) + eps)``, fused on CUDA); any other module as itself."""
    if not _fused(norm):
        return norm
    return lambda x: F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)


def _fused(norm: nn.Module) -> bool:
    """Whether :func:`rms_norm` runs ``norm`` as ``F.rms_norm`` (not through its forward)."""
    cls = type(norm).__dict__.get("_tgraph_hf_base", type(norm))  # graph_layers' final norm
    return cls.__name__ in RMS_NORMS and hasattr(F, "rms_norm")


def rotation(cos: torch.Tensor, sin: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step, from the rotary module's (B, T, hd) cos/sin: cos and sin with its first half
    negated (``rotate_half(x) * sin == roll(x, hd / 2) * sin_signed``), each expanded once to
    (B, heads, T, hd) so every layer's rotation runs non-broadcasting kernels."""
    half = sin.shape[-1] // 2
    sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
    B, T, hd = cos.shape
    return tuple(t[:, None].expand(B, heads, T, hd).contiguous() for t in (cos, sin_signed))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """``apply_rotary_pos_emb``'s ``x * cos + rotate_half(x) * sin`` for x (B, heads, T, hd)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


# -- configuration ------------------------------------------------------------------------------


def _family(model: nn.Module) -> str | None:
    """The supported architecture ``model`` is an instance of (subclasses included), or None."""
    for name in SUPPORTED:
        cls = getattr(transformers, name, None)
        if cls is not None and isinstance(model, cls):
            return name
    return None


def _rotary_parts(model: nn.Module) -> Parts:
    """Llama, Mistral, Qwen2, Qwen3: RMSNorm, rotary positions, grouped KV heads."""
    cfg, base = model.config, model.model
    rotary = base.rotary_emb
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type in LENGTH_DEPENDENT_ROPE:
        raise TypeError(
            f"{type(model).__name__} uses rope_type {rope_type!r}, whose frequencies depend on "
            "the longest sequence of the batch at each step (chosen on the host): rows would "
            "not be independent and graphs would freeze one choice. Serve it with a static "
            "scaling (default, linear, llama3, yarn) or without graphs in transformers"
        )
    layers = tuple(base.layers)[: cfg.num_hidden_layers]
    shape = Shape(
        n_layer=len(layers),
        n_head=cfg.num_key_value_heads,
        groups=cfg.num_attention_heads // cfg.num_key_value_heads,
        head_dim=layers[0].self_attn.head_dim,
        vocab_size=cfg.vocab_size,
    )
    return Parts(
        shape=shape,
        embed=base.embed_tokens,
        positions=None,
        rotary=rotary,
        layers=layers,
        final_norm=base.norm,
        lm_head=model.lm_head,
        scales=tuple(layer.self_attn.scaling for layer in layers),
        windows=tuple(_window(i, layer.self_attn, cfg) for i, layer in enumerate(layers)),
    )


def _gpt2_parts(model: nn.Module) -> Parts:
    """GPT-2: LayerNorm, learned positions, fused Conv1D q/k/v, one KV head per head."""
    cfg, base = model.config, model.transformer
    if getattr(cfg, "add_cross_attention", False):
        raise TypeError(
            "GPT2LMHeadModel with add_cross_attention=True attends to an encoder; "
            "DecodeEngine serves decoder-only models"
        )
    layers = tuple(base.h)
    return Parts(
        shape=Shape(len(layers), cfg.n_head, 1, cfg.n_embd // cfg.n_head, cfg.vocab_size),
        embed=base.wte,
        positions=base.wpe,
        rotary=None,
        layers=layers,
        final_norm=base.ln_f,
        lm_head=model.lm_head,
        scales=tuple(_gpt2_scale(block.attn, i) for i, block in enumerate(layers)),
        windows=(None,) * len(layers),
    )


def _window(layer: int, attn: nn.Module, config) -> int | None:
    """The sliding window of one attention layer, or None for full attention, as
    transformers' SDPA forward reads it at every call: Mistral's mask uses
    ``config.sliding_window`` for every layer; Qwen2/Qwen3 pick each layer's mask by
    ``config.layer_types`` and make the sliding one with ``config.sliding_window`` (the
    attention's own ``sliding_window``, set from them at construction, is read only by other
    attention kernels). Without ``layer_types`` (older configs), the attention's attribute.
    """
    if config.model_type == "mistral":
        return getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if config.model_type in ("qwen2", "qwen3") and types is not None:
        return config.sliding_window if types[layer] == "sliding_attention" else None
    return vars(attn).get("sliding_window")  # (not getattr: a miss raises, per layer per read)


def _config_keys(cfg, gpt2: bool) -> tuple[str, ...]:
    """The config entries :func:`_gpt2_parts` (``gpt2``) or :func:`_rotary_parts` (and
    :func:`_window`) read."""
    if gpt2:
        return ("n_head", "n_embd", "vocab_size", "add_cross_attention")
    keys = ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
    if cfg.model_type == "mistral":
        keys += ("sliding_window",)
    elif cfg.model_type in ("qwen2", "qwen3"):
        keys += ("sliding_window", "layer_types")
    return keys


def _gpt2_scale(attn: nn.Module, layer: int) -> float:
    """GPT-2's attention scale: ``attn.scaling`` where transformers precomputes it."""
    if hasattr(attn, "scaling"):
        return attn.scaling
    scale = attn.head_dim**-0.5 if attn.scale_attn_weights else 1.0
    return scale / (layer + 1) if attn.scale_attn_by_inverse_layer_idx else scale


def _adapter(model: nn.Module) -> TransformersDecoder:
    return TransformersDecoder(model)


as_decode_model.register(transformers.PreTrainedModel)(_adapter)
