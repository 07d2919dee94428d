"""Train a Hugging Face transformers causal LM (random init) on the byte corpus, eagerly or graphed.

    python recipes/train_hf.py --arch llama --steps 200 --out runs/hf_llama
    python recipes/train_hf.py --arch qwen2 --graph layer+opt --out runs/hf_qwen2
    python recipes/train_hf.py --config my_config.json --graph full --out runs/hf_custom
    torchrun --standalone --nproc-per-node=2 recipes/train_hf.py --arch gpt2 --graph layer
    python recipes/train_hf.py --out runs/hf_llama --resume latest --steps 400   # train on (same --arch)

The model is ``AutoModelForCausalLM.from_config`` of a preset (``--arch``, sized by
``--n-layer``, ``--n-embd``, ``--n-head``, ``--block-size``) or of a config file (``--config``, a
transformers ``config.json``); its vocabulary is the corpus's 256 byte values. ``--graph`` picks
how a step runs; all five compute the same numbers:

* ``none``: eager (DDP under torchrun).
* ``layer`` (default): the decoder layers replay per-layer graphs
  (``tgraph.integrations.transformers.graph_layers``; the first step runs eagerly and is
  recorded, then ``tgraph.create_graphs()``); the optimizer step stays eager.
* ``layer+opt``: per-layer graphs, plus clipping and AdamW as one graph (``tgraph.OptimizerGraph``).
* ``model``: the transformers model, embeddings to logits, as one graphed unit
  (``graph_layers(model, whole=True)``); the loss and the optimizer step stay eager.
* ``full``: forward, backward, the gradient all-reduce, clipping and AdamW as one
  ``tgraph.FullIterationGraph``.

``--compile`` adds inductor's fused kernels to any mode (``graph_layers(..., compile=True)``;
none and full run ``torch.compile(model)``), the same numbers up to float32 reordering;
``--graph model --compile`` is the fastest mode that keeps the loop eager (docs/BENCHMARKS.md).

This file adds only the model: :class:`HFSpec` and the config fields it reads. The loop, the data,
validation, checkpoints, the run directory's rules, metrics, Ctrl-C and torchrun are the shared
trainer's (``gpt_training/``, that of ``recipes/train_gpt.py``), and so are its protections.
Checkpoints go to ``--out/checkpoints/step_NNNNNN``: ``save_pretrained`` output (``config.json``,
``model.safetensors``: ``AutoModelForCausalLM.from_pretrained(dir)`` loads it), ``checkpoint.json``
(the sha256 of every tensor, of ``config.json`` and of ``trainer.pt``, verified on resume) and
``trainer.pt`` (optimizer, step, RNG states, config). ``--resume latest`` without ``--steps``
continues to the run's own total (a fresh run's is 200).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch.nn.functional as F
from gpt_training import cli
from gpt_training.checkpointing import RunDirectoryError, earlier_checkpoints_hint
from gpt_training.config import (
    GRAPH_MODES,
    NONFINITE_MODES,
    CompileConfig,
    ConfigGroup,
    DataConfig,
    JobConfig,
    OptimizerConfig,
    ReportConfig,
    RunConfig,
    RunOnly,
    StepConfig,
)
from gpt_training.spec import (
    ModelError,
    ModelSpec,
    load_verified_into,
    read_manifest,
    verify_files,
    write_manifest,
)

from tgraph.toy.checkpoint import CheckpointError, unwrap

VOCAB = 256  # the corpus is bytes
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2)
EXPERTS = ("batched_mm", "grouped_mm", "eager")  # --experts: transformers' implementations
# --arch presets: transformers model_type and what that family needs beyond the common sizes
ARCHS = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "gemma": ("gemma", {}),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "qwen2_moe": ("qwen2_moe", MOE),
    "qwen3_moe": ("qwen3_moe", MOE),
    "mixtral": ("mixtral", MOE),
}


# ------------------------------------------------------------------------------- the config


@dataclass(kw_only=True)
class HFModelConfig(ConfigGroup):
    """The transformers model: an --arch preset and its sizes, or a config file."""

    arch: str = "llama"
    """Preset family (transformers model_type) built by AutoModelForCausalLM.from_config."""
    config: str = ""
    """A transformers config.json to build instead of --arch (vocab_size >= 256)."""
    n_layer: int = 4
    """Decoder layers (--arch presets)."""
    n_embd: int = 128
    """Hidden size (--arch presets)."""
    n_head: int = 4
    """Attention heads (--arch presets; key/value heads: half of them where the family has GQA)."""
    block_size: int = 128
    """Tokens per training window."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_counts(("n_layer", "n_embd", "n_head", "block_size"))
        if self.arch not in ARCHS:
            raise self._invalid("arch", f"use one of {', '.join(sorted(ARCHS))}")
        if self.n_embd % self.n_head:
            raise self._invalid("n_head", f"it must divide n_embd={self.n_embd}")
        if self.config and _names_a_local_path(self.config) and not Path(self.config).exists():
            # transformers would look a missing file up on the Hub (offline: retries, ~45 s)
            raise self._invalid(
                "config", "no such file; pass the path of a transformers config.json"
            )


def _names_a_local_path(name: str) -> bool:
    """Whether ``--config name`` means a file here rather than a Hub model id ("org/name"): it
    ends in .json, starts like a path, has more than one "/", or its directory exists."""
    return (
        name.endswith(".json")
        or name.startswith((".", "/"))
        or name.count("/") > 1
        or ("/" in name and Path(name).parent.is_dir())
    )


@dataclass(kw_only=True)
class HFStepConfig(RunOnly):
    """How the transformers model runs its layers (the same numbers either way)."""

    experts: str = "batched_mm"
    """MoE experts_implementation: batched_mm, grouped_mm (graphed on a GPU only in bfloat16, not this recipe's float32) or eager (a host sync per expert: --graph none only)."""
    gradient_checkpointing: bool = False
    """Recompute the decoder layers in the backward (non-reentrant)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.experts not in EXPERTS:
            raise self._invalid("experts", f"use --experts {', '.join(EXPERTS)}")


@dataclass(kw_only=True)
class HFTrainConfig(
    ReportConfig,
    OptimizerConfig,
    DataConfig,
    HFModelConfig,
    HFStepConfig,
    CompileConfig,
    StepConfig,
    JobConfig,
    RunConfig,
):
    """The transformers recipe's run: the shared groups (this recipe's defaults), its model."""

    graph_modes = ("none", "layer", "layer+opt", "model", "full")
    default_steps = 200
    cli_choices = {
        "graph": GRAPH_MODES,
        "on_nonfinite": NONFINITE_MODES,
        "arch": sorted(ARCHS),
        "experts": EXPERTS,
    }
    cli_aliases = {"keep_checkpoints": ["--keep"]}  # the recipe's own flag before the port

    out: str = "runs/hf"
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    seed: int = 1234
    log_every: int = 20
    ckpt_every: int = 100
    keep_checkpoints: int = 3


# -------------------------------------------------------------------------------- the model


def build_config(cfg: HFTrainConfig):
    """The transformers config of ``--config`` or of the ``--arch`` preset.

    Raises:
        ModelError: a config file transformers cannot read or that holds no causal LM, too few
            positions or tokens, or preset sizes transformers refuses (RoPE's even head size).
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    if cfg.config:
        try:
            hf = AutoConfig.from_pretrained(cfg.config)
        except (OSError, *_config_errors()) as e:
            raise ModelError(
                f"--config {cfg.config} cannot be read as a transformers config: {_first_line(e)}"
            ) from e
        if type(hf) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ModelError(
                f"--config {cfg.config} is a {hf.model_type!r} config, which no causal LM of "
                "transformers (AutoModelForCausalLM) is built from; pass a decoder-only model's "
                "config"
            )
        if hf.vocab_size < VOCAB:
            raise ModelError(f"--config {cfg.config}: vocab_size {hf.vocab_size} < {VOCAB} (bytes)")
        positions = getattr(hf, "max_position_embeddings", None)
        if positions is not None and positions < cfg.block_size:
            raise ModelError(
                f"--config {cfg.config}: max_position_embeddings {positions} < --block-size "
                f"{cfg.block_size}; pass --block-size {positions} or less, or raise "
                "max_position_embeddings in the config"
            )
        return hf
    model_type, extra = ARCHS[cfg.arch]
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=max(1, cfg.n_head // 2),  # GQA where the family has it
        head_dim=cfg.n_embd // cfg.n_head,
        intermediate_size=4 * cfg.n_embd,
        moe_intermediate_size=cfg.n_embd,
        max_position_embeddings=cfg.block_size,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    if model_type == "gpt2":  # GPT-2 spells its MLP width n_inner and has no GQA
        kw["n_inner"] = kw.pop("intermediate_size")
        kw.pop("num_key_value_heads")
    try:
        return AutoConfig.for_model(model_type, **kw)
    except _config_errors() as e:  # the config's own validation (a RoPE head size that is odd)
        sizes = f"--n-embd {cfg.n_embd} --n-head {cfg.n_head}"
        raise ModelError(
            f"--arch {cfg.arch} {sizes}: transformers refuses the config ({_first_line(e)}); "
            "pick other sizes"
        ) from e


def _config_errors() -> tuple[type[Exception], ...]:
    """What building a transformers config raises for values it refuses: ValueError, or (the
    strict dataclasses of transformers 5) huggingface_hub's validation error."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return (ValueError,)
    return (ValueError, StrictDataclassError)


def _first_line(e: BaseException) -> str:
    """The first line of what ``e`` says, or of its cause's (a validator's own ValueError)."""
    while e.__cause__ is not None:
        e = e.__cause__
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _is_moe(config) -> bool:
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


def _graph_layers(net, whole: bool, backend: str, compile: bool) -> None:  # noqa: A002
    """``graph_layers`` of the model; its refusal of the model (``ValueError``: MoE experts it
    cannot graph, no decoder layers) as a :class:`ModelError` (one line, exit code 2)."""
    from tgraph.integrations import transformers as tg_hf

    try:
        tg_hf.graph_layers(unwrap(net), whole=whole, backend=backend, compile=compile)
    except ValueError as e:
        mode = "model" if whole else "layer"
        raise ModelError(f"--graph {mode} cannot graph this model: {_first_line(e)}") from e


# config.json fields that record a save, not the model: compared by neither side of a resume
# (the recipe's per-run settings, attention and experts implementations, are "_" fields)
CONFIG_RECORDS = frozenset(
    {"transformers_version", "architectures", "dtype", "torch_dtype", "use_cache"}
)


def config_differences(now: dict, saved: dict) -> list[str]:
    """The keys of two transformers config dicts (``to_dict()``) whose values differ, sorted,
    except :data:`CONFIG_RECORDS` and private ("_") keys."""
    keys = (set(now) | set(saved)) - CONFIG_RECORDS
    return sorted(k for k in keys if not k.startswith("_") and now.get(k) != saved.get(k))


class HFSpec(ModelSpec):
    """A transformers causal LM; its checkpoint part is ``save_pretrained``'s plus a manifest."""

    title = plot_name = "transformers causal LM"
    recipe = "recipes/train_hf.py"
    clip_in_optimizer_order = True  # eager clipping sums the norm as OptimizerGraph does

    def check(self, cfg):
        hf = build_config(cfg)
        if cfg.experts == "eager" and cfg.graph != "none" and _is_moe(hf):
            raise ModelError(
                "--experts eager runs transformers' loop over the experts, a host sync per "
                f"expert, which no graph can hold (--graph {cfg.graph}): use --experts "
                "batched_mm, or --graph none"
            )

    def build(self, cfg, device):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(build_config(cfg), attn_implementation="sdpa")
        if _is_moe(model.config):
            model.set_experts_implementation(cfg.experts)
        if cfg.gradient_checkpointing:  # non-reentrant: the only kind a backward graph can run
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # its newer name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return model.to(device).train()

    def loss(self, net, x, y, use_cache=False):
        logits = net(input_ids=x, use_cache=use_cache).logits  # (B, T, vocab)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def whole_step_loss(self, net, x, y):
        # Without a cache transformers' mask code looks for packed sequences in the position ids.
        # Eagerly that is a host read that finds none, and SDPA masks with is_causal=True. Under
        # a capture it cannot read, so it builds an explicit causal mask; with a mask,
        # transformers repeats grouped k/v heads in Python (repeat_kv) instead of letting SDPA
        # group them (enable_gqa), and the k/v gradients come out summed in another order (1e-7
        # off eager). With a cache it reads nothing and takes eager's branch (not transformers
        # 5.17, which masks under every capture: transformers issue 48925). Only where heads
        # are grouped: the cache copies k/v (torch.cat), which changes GPT-2's bits (its k/v
        # are strided views).
        config = unwrap(net).config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return self.loss(net, x, y, use_cache=kv_heads < config.num_attention_heads)

    def enable_graphs(self, net, backend, compile=False):  # noqa: A002 - enable's option
        _graph_layers(net, whole=False, backend=backend, compile=compile)

    def enable_model_graph(self, net, backend, compile=False):  # noqa: A002
        _graph_layers(net, whole=True, backend=backend, compile=compile)

    def disable_graphs(self, net):
        from tgraph.integrations import transformers as tg_hf

        tg_hf.ungraph(unwrap(net))

    def save_weights(self, model, directory, extra):
        unwrap(model).save_pretrained(directory, safe_serialization=True)
        write_manifest(Path(directory), extra, files=("config.json",))

    def read_extra(self, directory):
        return read_manifest(Path(directory)).get("extra")

    def load_weights(self, model, directory):
        load_verified_into(unwrap(model), Path(directory))

    def check_resume(self, cfg, directory):
        """The model config this run builds (``build_config``: ``--config``'s file as it reads
        now) against the checkpoint's ``config.json``: a file edited since the checkpoint was
        written builds another model whose shapes may still fit the weights. A ``config.json``
        missing, damaged (its sha256 is in the manifest) or unreadable refuses the checkpoint
        (``CheckpointError``) like any other damaged file of it."""
        from transformers import AutoConfig

        try:
            verify_files(Path(directory))
            saved = AutoConfig.from_pretrained(directory).to_dict()
        except (OSError, *_config_errors()) as e:  # CheckpointError is a ValueError
            raise CheckpointError(
                f"cannot resume from {directory}: its config.json cannot be used "
                f"({_first_line(e)}). "
                f"{earlier_checkpoints_hint(Path(directory))}"
            ) from e
        now = build_config(cfg).to_dict()
        differ = config_differences(now, saved)
        if differ:
            source = f"--config {cfg.config}" if cfg.config else f"--arch {cfg.arch}"
            shown = "; ".join(
                f"{k}={saved.get(k)!r} in the checkpoint but {now.get(k)!r} now" for k in differ[:4]
            ) + (f"; and {len(differ) - 4} more" if len(differ) > 4 else "")
            raise RunDirectoryError(
                f"checkpoint {directory} holds another model than {source} builds now ({shown}). "
                "Restore the config the run started with (the checkpoint's config.json), or "
                "start a fresh run with another --out"
            )

    def resolved(self, cfg, model):
        return {"transformers_config": json.loads(unwrap(model).config.to_json_string())}


HF_SPEC = HFSpec()
DESCRIPTION = __doc__.split("\n\n")[0]


def parse_config(argv: list[str] | None = None) -> HFTrainConfig:
    """An :class:`HFTrainConfig` from the command line (``gpt_training.cli.parse_config``)."""
    return cli.parse_config(argv, HFTrainConfig, DESCRIPTION)


def main(argv: list[str] | None = None) -> int:
    """Train; returns 0, or exits with the shared recipes' codes (``gpt_training.cli.main``)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's per-checkpoint bars
    cli.main(argv, HFTrainConfig, HF_SPEC, DESCRIPTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
