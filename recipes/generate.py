"""Generate text from a toy-GPT checkpoint, decode steps served by CUDA graphs.

    python recipes/generate.py --ckpt runs/gpt --prompt "Once upon a time" --max-new-tokens 100
    python recipes/generate.py --ckpt runs/gpt --prompt "Hi" --prompt "Bye" --temperature 0.8 --seed 0
    python recipes/generate.py --ckpt runs/gpt --prompt "Once upon a time" --no-graphs  # eager

The checkpoint is a directory written by ``tgraph.checkpoint.save`` (``model.safetensors`` +
``config.json``), e.g. by ``recipes/train_gpt.py``. Prints each prompt with its completion, then
one summary line: tokens/s, ms per decode step, buckets used and capture time.
"""

from __future__ import annotations

import argparse
import logging

import torch

from tgraph import checkpoint
from tgraph.decode import DecodeEngine


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ckpt", required=True, help="checkpoint directory (tgraph.checkpoint.save)")
    p.add_argument(
        "--prompt", action="append", required=True, help="prompt text; repeat for a batch"
    )
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--no-graphs", action="store_true", help="run decode steps eagerly")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument(
        "--max-batch-size", type=int, default=None, help="default: the number of prompts"
    )
    p.add_argument("--max-seq-len", type=int, default=None, help="default: the model's block_size")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[str]:
    """Run the recipe; returns the completions (also printed)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model = checkpoint.load(args.ckpt, device=args.device)
    engine = DecodeEngine(
        model,
        max_batch_size=args.max_batch_size or len(args.prompt),
        max_seq_len=args.max_seq_len or model.config.block_size,
        use_graphs=not args.no_graphs,
    )
    completions = engine.generate(
        args.prompt,
        args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        eos_token_id=args.eos_token_id,
        seed=args.seed,
    )
    for prompt, completion in zip(args.prompt, completions):
        print(prompt + completion)
    print(engine.stats.summary())
    return completions


if __name__ == "__main__":
    main()
