"""Generate text from a toy-GPT checkpoint, decode steps served by graphs.

    python recipes/generate.py --ckpt runs/quickstart --prompt "def " --temperature 0.8 --top-k 40
    python recipes/generate.py --ckpt runs/quickstart --prompt "import " --prompt "class " --max-new-tokens 100 --temperature 0.8 --top-p 0.9 --seed 1
    python recipes/generate.py --ckpt runs/quickstart/checkpoints/latest --prompt "def " --no-graphs   # greedy, eager

--ckpt takes a run directory of recipes/train_gpt.py (meaning its latest checkpoint), its
checkpoints/ directory, or one checkpoint directory (model.safetensors + config.json written by
tgraph.toy.checkpoint.save). --temperature 0 (the default) decodes greedily: the most likely byte at
every step, which for a small model soon repeats itself; 0.8 with --top-k 40 (or --top-p 0.9)
reads better. A prompt and its new bytes must fit the model's positions (block_size, 128 for
the quickstart model).
Prints each sample under a separator line, then one summary line: tokens/s, ms per decode step,
buckets used and capture time. On a CPU the graphs are emulated (tgraph's stand-in for CUDA
graphs: same code paths, no speed-up). Bad arguments exit with code 2 and one line saying why.

A transformers causal LM's save_pretrained directory (its config.json names a model_type) is
served too, by the same engine: see recipes/hf_serving.py. A training recipe's checkpoint
(trainer.pt beside its weights) is served only once its weights match the sha256 checksums it
recorded, as a resume checks them: damaged weights or a missing manifest exit with code 1.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

import hf_serving  # beside this file: Python puts its directory on sys.path when it runs it
import torch

from tgraph.decode import DecodeEngine
from tgraph.toy import checkpoint
from tgraph.toy.checkpoint import CheckpointError


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block) and exit with code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, OneLineErrorParser]:
    """Parse and check the arguments that need no model.

    Raises:
        SystemExit: code 2, one line naming the bad argument.
    """
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--ckpt",
        required=True,
        help="run directory (its latest checkpoint) or checkpoint directory",
    )
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text; repeat for a batch"
    )
    p.add_argument("--max-new-tokens", type=int, default=100, help="bytes to generate per prompt")
    p.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the k likeliest bytes")
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the likeliest bytes whose probabilities reach p (default 1: all)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling; same seed, same text")
    p.add_argument("--eos-token-id", type=int, default=None, help="stop a sample at this byte")
    p.add_argument(
        "--max-batch-size", type=int, default=None, help="default: the number of prompts"
    )
    p.add_argument("--max-seq-len", type=int, default=None, help="default: the model's block_size")
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "max_batch_size", "max_seq_len", "top_k"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be 1 or more, got {value}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        p.error(f"--temperature must be 0 (greedy) or more, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        p.error(f"--top-p must be in (0, 1] (1 keeps every byte), got {args.top_p}")
    if args.eos_token_id is not None and args.eos_token_id < 0:
        p.error(f"--eos-token-id must be a byte value 0-255, got {args.eos_token_id}")
    for i, prompt in enumerate(args.prompt, 1):
        if not prompt:
            p.error(f"--prompt {i} is empty; give at least one character to continue")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}, but no GPU is visible; use --device cpu")
    return args, p


def check_against_model(args: argparse.Namespace, p: OneLineErrorParser, model) -> int:
    """Check the arguments that depend on the model; returns the KV capacity (max_seq_len).

    Raises:
        SystemExit: code 2, one line naming the bad argument.
    """
    positions, vocab = model.config.block_size, model.config.vocab_size
    if args.max_seq_len is not None and args.max_seq_len > positions:
        p.error(f"--max-seq-len {args.max_seq_len} exceeds the model's {positions} positions")
    max_seq_len = args.max_seq_len or positions
    if args.eos_token_id is not None and args.eos_token_id >= vocab:
        p.error(f"--eos-token-id must be below the vocabulary size {vocab}")
    for i, prompt in enumerate(args.prompt, 1):
        n = len(prompt.encode("utf-8"))  # the toy GPT's tokens are bytes
        if n + args.max_new_tokens > max_seq_len:
            fixes = []
            if max_seq_len - args.max_new_tokens >= 1:
                fixes.append(f"shorten it to at most {max_seq_len - args.max_new_tokens} bytes")
            if max_seq_len - n >= 1:
                fixes.append(f"lower --max-new-tokens to at most {max_seq_len - n}")
            if not fixes:  # neither alone fits
                fixes.append(f"shorten it and lower --max-new-tokens to {max_seq_len} together")
            p.error(
                f"--prompt {i} is {n} bytes; with --max-new-tokens {args.max_new_tokens} it needs "
                f"{n + args.max_new_tokens} positions but there are {max_seq_len}: "
                + " or ".join(fixes)
            )
    return max_seq_len


class _DropCpuMemoryNoise(logging.Filter):
    """On a CPU the decode runner's free-GPU-memory report says only "n/a": drop that part."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "before capture, n/a" in text:
            return False
        record.msg, record.args = text.replace("; after capture, n/a (not CUDA)", ""), ()
        return True


def main(argv: list[str] | None = None) -> list[str]:
    """Run the recipe; returns the completions (also printed).

    Raises:
        SystemExit: code 2 for bad arguments, 1 for an unreadable checkpoint (one line each).
    """
    args, parser = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    runner_log = logging.getLogger("tgraph.decode.graph_runner")
    noise = _DropCpuMemoryNoise()
    if not args.device.startswith("cuda"):
        runner_log.addFilter(noise)
    try:
        return _generate(args, parser)
    finally:
        runner_log.removeFilter(noise)


def _generate(args: argparse.Namespace, parser: OneLineErrorParser) -> list[str]:
    try:
        path = checkpoint.find_checkpoint(args.ckpt)
    except FileNotFoundError as e:
        parser.error(f"--ckpt {e}")
    if hf_serving.is_transformers_checkpoint(path):  # save_pretrained's layout
        model, max_seq_len, eos_token_id, label = hf_serving.prepare(args, parser, path)
    else:
        try:
            # a training recipe's checkpoint is verified, as its resume is
            model = checkpoint.load(
                path, device=args.device, require_checksums=hf_serving.is_recipe_checkpoint(path)
            )
            _, extra = checkpoint.read_config(path)
        except (CheckpointError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(1) from None
        max_seq_len = check_against_model(args, parser, model)
        step = f"step {extra['step']}" if isinstance(extra, dict) and "step" in extra else "no step"
        eos_token_id, label = args.eos_token_id, f"checkpoint {path} ({step})"
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    how += f", top-k {args.top_k}" if args.top_k and args.temperature else ""
    how += f", top-p {args.top_p}" if args.top_p < 1 and args.temperature else ""
    print(f"{label}; {how}, seed {args.seed}", flush=True)
    try:
        engine = DecodeEngine(
            model,
            max_batch_size=args.max_batch_size or len(args.prompt),
            max_seq_len=max_seq_len,
            use_graphs=not args.no_graphs,
        )
        completions = engine.generate(
            args.prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            eos_token_id=eos_token_id,
            seed=args.seed,
        )
    except ValueError as e:  # the engine's own argument checks, should one above miss a case
        parser.error(str(e))
    n = len(args.prompt)
    for i, (prompt, completion) in enumerate(zip(args.prompt, completions), 1):
        print(f"----- sample {i} of {n} " + "-" * 40)
        print(prompt + completion)
    print("-" * 60)
    print(engine.stats.summary())
    return completions


if __name__ == "__main__":
    main()
