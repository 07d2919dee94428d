"""``recipes/generate.py`` on a transformers checkpoint: a directory written by ``save_pretrained``.

    python recipes/generate.py --ckpt runs/hf_llama --prompt "def " --max-new-tokens 50

The model is loaded with ``AutoModelForCausalLM.from_pretrained`` (in the dtype it was saved in)
and served by :class:`tgraph.decode.DecodeEngine` through
:class:`tgraph.integrations.transformers_decode.TransformersDecoder`. Text prompts go through the
checkpoint's tokenizer when the directory has one (``tokenizer.json`` or
``tokenizer_config.json``), else through bytes (a model of at least 256 tokens trained on bytes,
as tgraph's corpus is). Generation stops at ``--eos-token-id``, else at any EOS the checkpoint's
``generation_config.json`` names (one, or a list).

A checkpoint of ``recipes/train_hf.py`` (its ``checkpoint.json`` manifest or ``trainer.pt`` beside
the weights) is served only once every tensor matches the sha256 its manifest records, as a resume
checks it (``gpt_training.spec.load_verified_into``): damaged weights, or a manifest missing, are
refused in one line (exit code 1). A ``save_pretrained`` directory of another origin carries no
checksums and is served as it is.

transformers is imported only when such a directory is served.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def is_transformers_checkpoint(path: str | Path) -> bool:
    """True for a ``save_pretrained`` directory: its ``config.json`` names a ``model_type``
    (tgraph's toy checkpoints name their ``format`` instead)."""
    config = Path(path) / "config.json"
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" in data and "format" not in data


def load(path: Path, device: str):
    """The checkpoint's model and tokenizer (None without tokenizer files) as a decoder.

    Raises:
        SystemExit: code 1 with one line when transformers cannot load the directory, or a
            recipe's checkpoint does not verify.
    """
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from tgraph.integrations.transformers_decode import TransformersDecoder
    except ImportError as e:
        _fail(f"{path} is a transformers checkpoint: {e}")
    hf_logging.disable_progress_bar()  # from_pretrained's bar: the output is samples and one line
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
        if is_recipe_checkpoint(path):
            _verify(model, path)
        model = model.to(device)
        has_tokenizer = any((path / name).is_file() for name in TOKENIZER_FILES)
        tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
        return TransformersDecoder(model, tokenizer)
    except (OSError, ValueError, TypeError, KeyError) as e:
        _fail(f"cannot serve {path}: {type(e).__name__}: {str(e).splitlines()[0]}")


def is_recipe_checkpoint(path: Path) -> bool:
    """True for a checkpoint the training recipes wrote: a manifest or ``trainer.pt`` is there."""
    from gpt_training.spec import MANIFEST_NAME

    return (path / MANIFEST_NAME).is_file() or (path / "trainer.pt").is_file()


def _verify(model, path: Path) -> None:
    """Replace ``model``'s weights by the checkpoint's, each checked against its manifest.

    Raises:
        SystemExit: code 1 with one line, for a missing manifest or a damaged weight.
    """
    from gpt_training.spec import load_verified_into

    from tgraph.toy.checkpoint import CheckpointError

    try:
        load_verified_into(model, path)
    except FileNotFoundError as e:
        _fail(f"cannot serve {path}: {e}, so its weights cannot be verified; serve another "
              "checkpoint of the run (--ckpt DIR)")  # fmt: skip
    except CheckpointError as e:
        _fail(f"cannot serve {path}: {e}; serve another checkpoint of the run (--ckpt DIR)")


def _fail(message: str):
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(1)


def _eos(decoder, args: argparse.Namespace) -> int | list[int] | None:
    """``--eos-token-id``, else every EOS the checkpoint's ``generation_config`` names (an int
    or a list: Llama 3's chat models end at either of two)."""
    if args.eos_token_id is not None:
        return args.eos_token_id
    return getattr(decoder.model.generation_config, "eos_token_id", None)


def prepare(args: argparse.Namespace, parser, path: Path):
    """The transformers checkpoint ``path`` ready for generate.py's engine: ``(decoder,
    max_seq_len, eos_token_id, label)``.

    Raises:
        SystemExit: code 2 for arguments the model cannot serve, 1 for an unloadable checkpoint.
    """
    decoder = load(path, args.device)
    if not hasattr(decoder, "encode"):
        parser.error(
            f"{path} has no tokenizer and {decoder.vocab_size} tokens (fewer than 256 bytes): "
            "text prompts need tokenizer files in the checkpoint directory"
        )
    ids = [decoder.encode(p) for p in args.prompt]
    positions, vocab = decoder.max_positions, decoder.vocab_size
    if args.max_seq_len is not None and args.max_seq_len > positions:
        parser.error(f"--max-seq-len {args.max_seq_len} exceeds the model's {positions} positions")
    # Default KV capacity: what these prompts need, not the model's (possibly huge) positions.
    max_seq_len = args.max_seq_len or min(positions, max(map(len, ids)) + args.max_new_tokens)
    if args.eos_token_id is not None and args.eos_token_id >= vocab:
        parser.error(f"--eos-token-id must be below the vocabulary size {vocab}")
    for i, p in enumerate(ids, 1):
        if len(p) + args.max_new_tokens > max_seq_len:
            parser.error(
                f"--prompt {i} is {len(p)} tokens; with --max-new-tokens {args.max_new_tokens} it "
                f"needs {len(p) + args.max_new_tokens} positions but there are {max_seq_len}"
            )
    label = f"transformers checkpoint {path} ({decoder.architecture})"
    return decoder, max_seq_len, _eos(decoder, args), label
