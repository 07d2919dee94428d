"""Decode benchmark: ms per decode step and tokens/s, eager vs. graphs vs. Hugging Face, one process.

    python scripts/bench_decode.py --batches 1,8,64 --steps 100 --out bench_out
    python scripts/bench_decode.py --smoke --out /tmp/smoke   # seconds, CPU, emulated graphs
    python scripts/bench_decode.py --batches 1 --profile-batch 1 --out bench_out  # + profile

Fixed-batch modes (same toy GPT, same prompts, greedy, one token per step):
  hand_eager   a static-KV decode step written in this script, run eagerly
  hand_graph   the same step captured by hand in one ``torch.cuda.CUDAGraph`` per batch size
  engine_eager / engine_graphs   ``tgraph.decode.DecodeEngine(use_graphs=False / True)``
  engine_graphs_no_lookahead     DecodeEngine graphs reading every step's tokens before the next
  engine_graphs_sampled          DecodeEngine graphs, sampling in the graph (T 0.8, top-k 40,
                                 top-p 0.95, seeded): what in-graph sampling costs per step
  hf_generate  ``transformers`` LlamaForCausalLM of the same size, ``generate`` (eager; only at
               ``--hf-batches``)
Time to first token (``--ttft``, batch 1, one prompt of ``--prompt-len``): ``generate(prompt, 1)``
wall time, median of ``--ttft-repeats``: ttft_prefill_graphs (prefill graphs by token bucket),
ttft_prefill_eager (decode graphs, eager prefill), ttft_engine_eager (no graphs), ttft_hf.
Every row has its peak memory; engine rows carry the memory each captured graph added
(``engine_stats.graph_bytes``). ``ratios`` in the JSON: each fixed-batch mode's ms/step over
hand_graph's and HF's ms/step over it, and TTFT over ttft_prefill_eager's; ``goals`` checks the
decode targets (engine within 1.05x of the hand-written graph, >= 10x HF ``generate`` at
batch 1, prefill graphs <= 0.5x eager prefill). ``--profile-batch B`` writes torch.profiler tables of hand_graph and
engine_graphs at batch B (``bench_decode_profile.txt``).
Mixed workload: requests with different prompt and output lengths arriving over time, served by
continuous batching (hand-written slots over one max-batch graph, and DecodeEngine): tokens/s,
ms per step, padding waste, peak memory.

Token parity: hand_graph must give exactly hand_eager's tokens; engine modes are compared with
hand_eager (fraction of equal tokens; greedy argmax of a random model can flip on last-bit ties).

Files: this one (the modes and the command line), ``bench_decode_setup.py`` (sizes, the model and
prompts, engine and HF construction, timing), ``bench_decode_hand.py`` (the hand-written
static-KV step), ``bench_decode_fixed.py`` (fixed-batch and TTFT modes), ``bench_decode_mixed.py``
(the mixed workload), ``bench_decode_report.py`` (parity, ratios, Markdown) and
``bench_decode_profile.py`` (``--profile-batch``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import environment, write_outputs  # noqa: E402
from bench_decode_fixed import run_fixed  # noqa: E402
from bench_decode_mixed import mixed_requests, run_mixed  # noqa: E402
from bench_decode_profile import profile  # noqa: E402
from bench_decode_report import add_parity, add_ratios, markdown  # noqa: E402
from bench_decode_setup import DIMS, VOCAB, Bench  # noqa: E402

from tgraph.toy.gpt import GPT, GPTConfig  # noqa: E402

FIXED_MODES = [
    "hand_eager",
    "hand_graph",
    "engine_eager",
    "engine_graphs",
    "engine_graphs_no_lookahead",
    "engine_graphs_sampled",
    "hf_generate",
]
TTFT_MODES = ["ttft_prefill_graphs", "ttft_prefill_eager", "ttft_engine_eager", "ttft_hf"]
MIXED_MODES = ["hand_continuous_eager", "hand_continuous_graph", "engine_eager", "engine_graphs"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--modes", default=",".join(FIXED_MODES))
    p.add_argument("--hf-batches", default="1", help="batches at which hf_generate runs")
    p.add_argument("--ttft-modes", default=",".join(TTFT_MODES))
    p.add_argument("--no-ttft", action="store_true")
    p.add_argument("--ttft-repeats", type=int, default=20)
    p.add_argument("--profile-batch", default="", help="profile these batch sizes (e.g. 1,64)")
    p.add_argument("--mixed-modes", default=",".join(MIXED_MODES))
    p.add_argument("--no-mixed", action="store_true")
    p.add_argument("--mixed-requests", type=int, default=96)
    p.add_argument("--mixed-max-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=100, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="generate() timings per mode (median)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out")
    p.add_argument("--smoke", action="store_true", help="CPU, emulated graphs, tiny dims")
    a = p.parse_args(argv)
    dims = DIMS["full"]
    if a.smoke:
        dims, a.device, a.batches, a.steps, a.warmup = DIMS["smoke"], "cpu", "1,3", 4, 2
        a.prompt_len, a.mixed_requests, a.mixed_max_batch, a.repeats = 5, 6, 2, 1
        a.ttft_repeats, a.hf_batches = 2, "1,3"
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    max_prompt, max_new = max(a.prompt_len, 48), 96 if not a.smoke else 8
    max_seq = max(a.prompt_len + a.warmup + a.steps, max_prompt + max_new) + 8
    torch.manual_seed(a.seed)
    cfg = GPTConfig(vocab_size=VOCAB, block_size=max_seq, dropout=0.0, **dims)
    model = GPT(cfg).to(device).eval()
    b = Bench(model, device, a.steps, a.warmup, a.prompt_len, max_seq, a.seed)
    env = environment(device)
    print(f"bench_decode: {env['gpu'] or 'cpu'}, torch {env['torch']}", flush=True)
    results: list[dict] = []

    def save() -> dict:
        rows = [dict(r) for r in results]  # parity on copies: the token lists stay for later rows
        add_parity(rows)
        ratios, goals = add_ratios(rows)
        payload = {
            "meta": {
                "env": env,
                "model": f"toy GPT {dims}, vocab {VOCAB}, max_seq {max_seq}, fp32",
                "prompt_len": a.prompt_len,
                "steps": a.steps,
                "warmup": a.warmup,
                "mixed": {
                    "requests": a.mixed_requests,
                    "max_batch": a.mixed_max_batch,
                    "prompt_len": [4, max_prompt],
                    "new_tokens": [8, max_new],
                },
                "notes": "hand modes: per-step time of one decode step (step + greedy argmax + "
                "buffer refresh, no host sync); engine: its own per-step stats (includes the "
                "host read of sampled tokens); hf: (T(n)-T(1))/(n-1) of generate(); padding waste = "
                "idle row-steps / computed row-steps.",
                "smoke": a.smoke,
            },
            "ratios": ratios,
            "goals": goals,
            "results": rows,
        }
        write_outputs(a.out, "bench_decode", payload, markdown(payload))
        return payload

    hf_batches = {int(x) for x in a.hf_batches.split(",") if x}
    for batch in (int(x) for x in a.batches.split(",")):
        print(f"[batch {batch}]", flush=True)
        for m in a.modes.split(","):
            if m == "hf_generate" and batch not in hf_batches:
                continue
            results.append(run_fixed(b, m, batch, a.repeats))
            save()  # a run killed by a time limit keeps what it measured
    if not a.no_ttft:
        print(f"[time to first token, prompt {a.prompt_len}]", flush=True)
        for m in a.ttft_modes.split(","):
            results.append(run_fixed(b, m, 1, a.ttft_repeats))
            save()
    if a.profile_batch:
        profile(b, [int(x) for x in a.profile_batch.split(",")], a.out)
    if not a.no_mixed:
        print(f"[mixed: {a.mixed_requests} requests, max batch {a.mixed_max_batch}]", flush=True)
        reqs = mixed_requests(a.mixed_requests, max_prompt if not a.smoke else 6, max_new, a.seed)
        for m in a.mixed_modes.split(","):
            results.append(run_mixed(b, m, reqs, a.mixed_max_batch))
            save()
    payload = save()
    print(markdown(payload))
    print(f"wrote {a.out}/bench_decode.json and .md")
    graphs = ("hand_graph", "hand_continuous_graph")
    bad = [
        r
        for r in payload["results"]
        if r["mode"] in graphs and r["status"] == "ok" and r.get("token_agreement") != 1.0
    ]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
