"""Train the toy GPT on the Python standard library's own sources, eagerly or with graphs.

    python recipes/train_gpt.py                                    # one process, defaults
    python recipes/train_gpt.py --graph full --steps 300 --out runs/full
    torchrun --standalone --nproc-per-node=2 recipes/train_gpt.py --graph layer
    python recipes/train_gpt.py --out runs/gpt --resume latest     # continue a stopped run
    python recipes/train_gpt.py --out runs/gpt --resume latest --steps 4000   # train it longer
    python recipes/generate.py --ckpt runs/gpt --prompt "def "   # decode from its latest checkpoint

``--graph none`` runs eagerly; ``layer`` graphs every transformer block (``tgraph.enable``: the
first iteration runs eagerly and is recorded, ``tgraph.create_graphs()`` captures, later
iterations replay); ``full`` captures forward, backward, all-reduce and AdamW as one graph
(``tgraph.FullIterationGraph``); ``model`` graphs the whole model as one unit. All compute
the same numbers. ``--compile`` runs inductor's fused kernels in any mode (per-layer and model
graphs hold each unit's compiled code; none and full run ``torch.compile(model)``), the same
numbers up to float32 reordering. The run directory gets
``config.json`` (resolved config), ``metrics.jsonl``, ``loss.png``, ``summary.json`` and
``checkpoints/step_NNNNNN`` (model safetensors + ``trainer.pt``: optimizer, step, RNG states,
config), each written to a temporary directory and renamed into place, so a killed run leaves
only complete checkpoints; ``checkpoints/latest`` links the newest checkpoint of the current run.

A run never loses a trained model or a file of yours: a fresh run into an ``--out`` that is not
empty is refused (continue it with ``--resume latest``, pick an empty or new ``--out``, or pass
``--overwrite``; files no run wrote, such as a model's, are refused even then);
a non-finite loss stops the run before any checkpoint is written (``--on-nonfinite skip`` skips
such steps instead); every checkpoint records the sha256 of its tensors and of ``trainer.pt``,
verified on resume; Ctrl-C finishes the current step, writes a checkpoint and exits.

This file names the model (``gpt_training.spec.GPT_SPEC``) and its config; the shared trainer
lives in ``gpt_training/`` beside it (``recipes/train_hf.py`` runs on it too), one concept per
module: ``config.py`` (config groups; the run-only groups are what may change on resume),
``spec.py`` (the model seam), ``step.py`` (``make_step``: every line of graph-mode code),
``trainer.py`` (the loop), ``checkpointing.py``, ``metrics.py``, ``optim.py``, ``parallel.py``,
``cli.py`` (flags from the config, one-line errors, exit codes).
"""

from __future__ import annotations

from gpt_training import cli
from gpt_training.checkpointing import RunDirectoryError
from gpt_training.cli import EXIT_INTERRUPTED, OneLineErrorParser, _field_docs, run_cli
from gpt_training.config import TrainConfig
from gpt_training.spec import GPT_SPEC
from gpt_training.trainer import NonFiniteLossError, TrainingInterrupted, train

from tgraph.toy.checkpoint import CheckpointError

__all__ = [
    "EXIT_INTERRUPTED",
    "CheckpointError",
    "NonFiniteLossError",
    "OneLineErrorParser",
    "RunDirectoryError",
    "TrainConfig",
    "TrainingInterrupted",
    "_field_docs",
    "main",
    "parse_config",
    "run_cli",
    "train",
]
DESCRIPTION = __doc__.split("\n\n")[0]


def parse_config(argv: list[str] | None = None) -> TrainConfig:
    """A :class:`TrainConfig` from the command line (``gpt_training.cli.parse_config``)."""
    return cli.parse_config(argv, TrainConfig, DESCRIPTION)


def main(argv: list[str] | None = None) -> None:
    cli.main(argv, TrainConfig, GPT_SPEC, DESCRIPTION)


if __name__ == "__main__":
    main()
