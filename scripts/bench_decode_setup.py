"""What every decode-benchmark mode shares (scripts/bench_decode.py): the model sizes, one run's
model and prompts (:class:`Bench`), the engine and the Hugging Face model of the same size, and
the wall-clock timing of ``generate`` calls."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from bench_common import Skip, synchronize

from tgraph.decode import DecodeEngine
from tgraph.toy.gpt import GPT

VOCAB = 1024
DIMS = {
    "full": dict(n_layer=12, n_embd=256, n_head=4),
    "smoke": dict(n_layer=2, n_embd=32, n_head=2),
}


@dataclass
class Bench:
    model: GPT
    device: torch.device
    steps: int
    warmup: int
    prompt_len: int
    max_seq: int
    seed: int

    def prompts(self, batch: int) -> list[list[int]]:
        g = random.Random(self.seed + batch)
        return [[g.randrange(VOCAB) for _ in range(self.prompt_len)] for _ in range(batch)]


def timed(fn, device: torch.device, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def per_step_ms(run, n: int, device: torch.device, repeats: int) -> float | None:
    """(T(n tokens) - T(1 token)) / (n - 1): decode steps only, prefill cancels out."""
    t_n = timed(lambda: run(n), device, repeats)
    t_1 = timed(lambda: run(1), device, repeats)
    ms = (t_n - t_1) / (n - 1) * 1e3
    return (
        ms if ms > 0 else None
    )  # noise larger than the decode steps: no number rather than a wrong one


def make_engine(
    b: Bench, max_batch: int, use_graphs: bool, lookahead: bool = True, **extra
) -> DecodeEngine:
    """A DecodeEngine over the run's model (its graphs captured here, when on)."""
    return DecodeEngine(
        b.model,
        max_batch_size=max_batch,
        max_seq_len=b.max_seq,
        use_graphs=use_graphs,
        lookahead=lookahead,
        progress=False,
        **extra,
    )


def engine_stats(engine: DecodeEngine) -> dict:
    """The engine's :class:`tgraph.decode.stats.DecodeStats` as a dict, its derived figures too."""
    st = engine.stats
    derived = {k: getattr(st, k) for k in ("ms_per_step", "tokens_per_s", "padding_waste")}
    return {**asdict(st), **derived}


def hf_model(b: Bench):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise Skip(f"transformers not importable ({exc})") from exc
    d = DIMS["smoke" if b.model.config.n_layer == 2 else "full"]
    cfg = LlamaConfig(
        hidden_size=d["n_embd"],
        intermediate_size=4 * d["n_embd"],
        num_hidden_layers=d["n_layer"],
        num_attention_heads=d["n_head"],
        num_key_value_heads=d["n_head"],
        vocab_size=VOCAB,
        max_position_embeddings=b.max_seq,
    )
    torch.manual_seed(b.seed)
    model = LlamaForCausalLM(cfg).to(b.device).eval()
    model.generation_config.eos_token_id = None  # never stop early: every call decodes n tokens
    model.generation_config.pad_token_id = 0
    return model


def print_row(row: dict) -> None:
    if row["status"] != "ok":
        print(f"  {row['workload']} {row['mode']}: {row['status']}: {row['reason']}", flush=True)
    else:
        print(
            f"  {row['workload']} {row['mode']}: {row['ms_median']:.3f} ms/step, "
            f"{row['tokens_per_s']:.0f} tok/s",
            flush=True,
        )
