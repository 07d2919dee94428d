"""Train megatron-core's GPTModel with megatron-core's own optimizer, eagerly or with tgraph graphs.

    python recipes/train_megatron_gpt.py --graph layer+opt --steps 200 --out runs/megatron_opt
    torchrun --standalone --nproc-per-node=2 recipes/train_megatron_gpt.py --graph layer
    python recipes/train_megatron_gpt.py --out runs/megatron_opt --resume latest --steps 400

The model is megatron-core's ``GPTModel`` (local layer spec, fp32) built by
``tgraph.integrations.megatron.build_gpt`` (``--n-layer``/``--num-layers``,
``--n-embd``/``--hidden-size``, ``--n-head``/``--num-heads``, ``--block-size``/``--seq-length``)
in megatron DDP. The optimizer is the one a megatron-core user runs:
``get_megatron_optimizer(OptimizerConfig(optimizer="adam", ...), [model])`` (fp32, megatron's
gradient clipping ``--grad-clip``/``--clip-grad``, no weight decay on biases and norms), with
megatron's ``OptimizerParamScheduler`` (linear warmup from 0, cosine decay to ``--min-lr``),
stepped once per iteration. Each step's ``--batch-size`` sequences run as ``--micro-batches``
micro-batches through megatron's ``forward_backward``. ``--graph`` picks how a step runs:

* ``none``: megatron-core eager: ``mopt.zero_grad(); forward_backward(...); mopt.step()`` (its
  gradient norm and clipping read values on the host).
* ``layer`` (default): the same step, every TransformerLayer replaying tgraph per-layer graphs
  (``enable_layer_graphs``); ``mopt.step()`` stays eager.
* ``layer+opt``: per-layer graphs, and megatron's optimizer step (norm, clipping, AdamW) as one
  graph: ``MegatronOptimizerGraph(mopt, skip_nonfinite=True).step(loss)``.
* ``full``: ``forward_backward`` and ``graph_safe_step(mopt)`` captured together as one
  ``tgraph.FullIterationGraph(..., skip_nonfinite=True)``.

``layer+opt`` and ``full`` build megatron's inner AdamW with ``capturable=True``
(``OptimizerConfig.optimizer_cuda_graph``: its step count lives on the GPU) and skip, on the
device, a step whose loss or gradient norm is not finite; the device counter is read at log
steps only (``skipped_steps``). The scheduler's learning rate reaches their graphs through device
tensors (tgraph.step.hyperparams), which the scheduler refills in place. The eager modes step the
scheduler only after a successful ``mopt.step()``, as megatron-LM's loop does; the graph modes
step it at every iteration (knowing whether the device skipped the step would need a host sync).
``--optimizer-cuda-graph`` builds the capturable AdamW in the eager modes too, for like-for-like
losses. Code: ``gpt_training/megatron_step.py``.

This file adds only the model: :class:`MegatronSpec` and the config fields it reads. The loop,
data, validation, checkpoints, the run directory's rules, metrics, Ctrl-C and torchrun are the
shared trainer's (``gpt_training/``, that of ``recipes/train_gpt.py``), and so are its
protections. Checkpoints go to ``--out/checkpoints/step_NNNNNN``: ``model.safetensors`` (the
unwrapped GPTModel's ``state_dict``), ``checkpoint.json`` (the sha256 of every tensor and of
``trainer.pt``, verified on resume) and ``trainer.pt`` (``mopt.state_dict()``, the scheduler's
state, step, RNG states, config). A resume continues bit for bit with ``--dropout 0`` (the
default); megatron's dropout RNG tracker is not checkpointed.

Precision, with Megatron-LM's flag names: ``--transformer-impl transformer_engine`` builds the
model with TransformerEngine's layer spec (``get_gpt_layer_with_transformer_engine_spec``, causal
fused attention, TE's RNG tracker); ``--bf16`` trains bf16 parameters with megatron's
``Float16OptimizerWithFloat16Params`` (fp32 master weights); ``--fp8-format hybrid`` (or
``e4m3``) adds TE's FP8 with delayed scaling (``--fp8-recipe delayed``, amax history
``--fp8-amax-history-len``), which needs the other two. With TE installed, megatron steps TE's
FusedAdam.

Needs a CUDA GPU and megatron-core (``pip install "tgraph[megatron]"``, Python >= 3.12); without
them it says so in one line (exit code 2). Data parallel over all ranks (megatron DDP); tensor and
pipeline parallel sizes are 1.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from gpt_training import cli
from gpt_training.config import (
    GRAPH_MODES,
    NONFINITE_MODES,
    ConfigGroup,
    DataConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    ReportConfig,
    RunConfig,
    RunOnly,
    StepConfig,
)
from gpt_training.megatron_step import OPTIMIZER, MegatronOptim, MegatronStep, capturable_adam
from gpt_training.spec import ModelSpec, load_verified, read_manifest, write_manifest

from tgraph.toy.checkpoint import CheckpointError

VOCAB = 256  # the corpus is bytes
# TE stores FP8 delayed scaling's metadata as pickles and unpickles them only with this set
TE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"
WEIGHTS = "model.safetensors"


# ------------------------------------------------------------------------------- the config


@dataclass(kw_only=True)
class MegatronStepConfig(RunOnly):
    """How megatron-core runs a step (the same numbers as the graph modes' optimizer)."""

    micro_batches: int = 1
    """Micro-batches per step (megatron's gradient accumulation); must divide batch_size."""
    optimizer_cuda_graph: bool = False
    """Capturable AdamW in the eager modes too (OptimizerConfig.optimizer_cuda_graph; layer+opt and full always step it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_counts(("micro_batches",))
        if self.batch_size % self.micro_batches:
            raise self._invalid("micro_batches", f"it must divide batch_size={self.batch_size}")


@dataclass(kw_only=True)
class MegatronPrecisionConfig(ConfigGroup):
    """Layer spec and number formats, as Megatron-LM's flags name them."""

    transformer_impl: str = "local"
    """local: megatron's own layers (fp32 or bf16); transformer_engine: TE's layer spec."""
    bf16: bool = False
    """bf16 parameters, fp32 master weights in megatron's optimizer (Float16Module)."""
    fp8_format: str = "none"
    """FP8 through TE (needs --transformer-impl transformer_engine and --bf16): hybrid (E4M3 forward, E5M2 gradients) or e4m3."""
    fp8_recipe: str = "delayed"
    """TE's FP8 scaling recipe; delayed scaling is the one this recipe runs."""
    fp8_amax_history_len: int = 16
    """Steps of amax history for delayed scaling."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self._check_counts(("fp8_amax_history_len",))
        if self.fp8_format != "none" and self.transformer_impl != "transformer_engine":
            raise self._invalid("fp8_format", "FP8 needs --transformer-impl transformer_engine")
        if self.fp8_format != "none" and not self.bf16:
            raise self._invalid("fp8_format", "FP8 trains bf16 parameters: add --bf16")

    @property
    def te_spec(self) -> bool:
        return self.transformer_impl == "transformer_engine"

    @property
    def fp8(self) -> str | None:
        """build_gpt's ``fp8``: the scaling recipe, or None."""
        return None if self.fp8_format == "none" else self.fp8_recipe


@dataclass(kw_only=True)
class MegatronTrainConfig(
    ReportConfig,
    OptimizerConfig,
    DataConfig,
    ModelConfig,
    MegatronPrecisionConfig,
    MegatronStepConfig,
    StepConfig,
    JobConfig,
    RunConfig,
):
    """The megatron-core recipe's run: the shared groups with this recipe's defaults."""

    graph_modes = ("none", "layer", "layer+opt", "full")
    default_steps = 200
    cli_choices = {
        "graph": GRAPH_MODES,
        "on_nonfinite": NONFINITE_MODES,
        "transformer_impl": ("local", "transformer_engine"),
        "fp8_format": ("none", "hybrid", "e4m3"),
        "fp8_recipe": ("delayed",),
    }
    cli_aliases = {  # the recipe's megatron-style flags before the port
        "n_layer": ["--num-layers"],
        "n_embd": ["--hidden-size"],
        "n_head": ["--num-heads"],
        "block_size": ["--seq-length"],
        "grad_clip": ["--clip-grad"],
    }

    out: str = "runs/megatron_gpt"
    n_layer: int = 12
    n_embd: int = 256
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.01
    beta2: float = 0.999  # megatron's OptimizerConfig.adam_beta2
    seed: int = 1234
    log_every: int = 20
    ckpt_every: int = 100

    def unavailable(self) -> str | None:
        if self.device == "cpu":
            return "megatron-core training needs a CUDA GPU; --device cpu cannot run it"
        if not torch.cuda.is_available():
            return "megatron-core training needs a CUDA GPU, and none is visible"
        try:
            found = importlib.util.find_spec("megatron.core") is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            from tgraph.integrations.megatron import INSTALL_HINT

            return f"megatron-core training needs megatron-core; {INSTALL_HINT}"
        if self.te_spec and importlib.util.find_spec("transformer_engine") is None:
            return (
                "--transformer-impl transformer_engine needs TransformerEngine "
                "(pip install transformer-engine[pytorch]); or use --transformer-impl local"
            )
        return None


# -------------------------------------------------------------------------------- the model


def init_parallel(seed: int) -> None:
    """A process group (torchrun's, started by the trainer, or a world of one) and megatron's
    model parallel state (1, 1)."""
    from megatron.core import parallel_state

    from tgraph.integrations import megatron as tm

    if "WORLD_SIZE" not in os.environ:
        tm.init_single_gpu(seed)
    elif not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


def _version(module: str) -> str | None:
    """``module.__version__``, or None where it is not installed."""
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def _gpt(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron DDP."""
    return getattr(model, "module", model)


class MegatronSpec(ModelSpec):
    """megatron-core's GPTModel, optimizer, scheduler and step; its checkpoint part is the
    GPTModel's ``state_dict`` as safetensors plus a manifest."""

    title = plot_name = "megatron-core GPTModel"
    recipe = "recipes/train_megatron_gpt.py"

    def build(self, cfg, device):
        from tgraph.integrations import megatron as tm

        init_parallel(cfg.seed)
        model = tm.build_gpt(
            num_layers=cfg.n_layer,
            hidden_size=cfg.n_embd,
            num_attention_heads=cfg.n_head,
            vocab_size=VOCAB,
            seq_length=cfg.block_size,
            dropout=cfg.dropout,
            seed=cfg.seed,
            spec="te" if cfg.te_spec else "local",
            bf16=cfg.bf16,
            fp8=cfg.fp8,
            fp8_format=cfg.fp8_format,
            fp8_amax_history_len=cfg.fp8_amax_history_len,
        )
        return model.train()

    def loss(self, net, x, y):
        from tgraph.integrations.megatron import causal_inputs, wants_attention_mask

        position_ids, mask = causal_inputs(x)
        mask = mask if wants_attention_mask(net) else None
        return net(x, position_ids, mask, labels=y).float().mean()  # per-token losses

    def enable_graphs(self, net, backend):
        from tgraph.integrations import megatron as tm

        tm.enable_layer_graphs(net, backend=backend)

    def disable_graphs(self, net):
        import tgraph

        tgraph.disable(net)

    def make_optimizer(self, model, cfg, device):
        return MegatronOptim(model, cfg)

    def load_optimizer(self, opt, state, device):
        opt.load_state_dict(state)

    def set_lr(self, opt, step, cfg, decay_steps):
        return opt.lr()  # megatron's scheduler set it (stepped by MegatronStep)

    def make_step(self, cfg, model, opt, env, record_eval):
        return MegatronStep(cfg, model, opt, env, record_eval)

    def save_weights(self, model, directory, extra):
        from safetensors.torch import save_file

        state = {
            k: v.detach().cpu().contiguous()  # own copies: no shared storage for safetensors
            for k, v in _gpt(model).state_dict().items()
            if isinstance(v, torch.Tensor)  # megatron's _extra_state entries are None here
        }
        save_file(state, str(Path(directory) / WEIGHTS))
        write_manifest(Path(directory), extra)

    def read_extra(self, directory):
        return read_manifest(Path(directory)).get("extra")

    def load_weights(self, model, directory):
        state = load_verified(Path(directory))
        target = _gpt(model)
        own = {k: v for k, v in target.state_dict().items() if isinstance(v, torch.Tensor)}
        shapes = sorted(
            k
            for k in own.keys() & state.keys()
            # TE's FP8 metadata (serialized bytes) grows from empty at its first FP8 forward
            if own[k].shape != state[k].shape and not k.endswith("_extra_state")
        )
        unexpected, missing = sorted(state.keys() - own.keys()), sorted(own.keys() - state.keys())
        if shapes or unexpected or missing:
            raise CheckpointError(
                f"checkpoint {directory} does not match the model of this run: unexpected keys "
                f"{unexpected}, missing keys {missing}, shape mismatches {shapes}"
            )
        pickled = [k for k, v in state.items() if k.endswith("_extra_state") and v.numel()]
        if pickled and os.environ.get(TE_PICKLE_ENV) != "1":
            raise CheckpointError(
                f"checkpoint {directory} holds TransformerEngine's FP8 delayed-scaling state as "
                f"pickles ({len(pickled)} modules), which TE loads only when told to trust them: "
                f"rerun with {TE_PICKLE_ENV}=1 if this run wrote it (its sha256 matched the "
                "manifest)"
            )
        target.load_state_dict(state, strict=False)  # every tensor key checked above

    def resolved(self, cfg, model):
        return {
            "megatron_core": _version("megatron.core.package_info"),
            "optimizer": OPTIMIZER,
            "capturable_adam": capturable_adam(cfg),
            "transformer_engine": _version("transformer_engine") if cfg.te_spec else None,
        }


MEGATRON_SPEC = MegatronSpec()
DESCRIPTION = __doc__.split("\n\n")[0]


def parse_config(argv: list[str] | None = None) -> MegatronTrainConfig:
    """A :class:`MegatronTrainConfig` from the command line (``gpt_training.cli.parse_config``)."""
    return cli.parse_config(argv, MegatronTrainConfig, DESCRIPTION)


def close_parallel() -> None:
    """Close megatron's model parallel state and the process group of one that ``build``
    opened (torch warns at exit about a group never destroyed)."""
    import torch.distributed as dist

    parallel_state = getattr(sys.modules.get("megatron.core"), "parallel_state", None)
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """Train; returns 0, or exits with the shared recipes' codes (``gpt_training.cli.main``)."""
    import torch.distributed as dist

    # a run of one opens its own group (init_parallel) and closes it; torchrun's ranks leave
    # theirs to the trainer, a caller's (a test's) group stays open
    opens_group = "WORLD_SIZE" not in os.environ and not (
        dist.is_available() and dist.is_initialized()
    )
    try:
        cli.main(argv, MegatronTrainConfig, MEGATRON_SPEC, DESCRIPTION)
    finally:
        if opens_group:
            close_parallel()
    return 0


if __name__ == "__main__":
    sys.exit(main())
