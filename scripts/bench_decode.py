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
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    Skip,
    StepTimer,
    environment,
    environment_markdown,
    fresh_memory,
    markdown_table,
    peak_memory_mib,
    summarize,
    synchronize,
    write_outputs,
)

from tgraph.backend import GraphFactory  # noqa: E402
from tgraph.toy.gpt import GPT, GPTConfig  # noqa: E402

VOCAB = 1024
DIMS = {
    "full": dict(n_layer=12, n_embd=256, n_head=4),
    "smoke": dict(n_layer=2, n_embd=32, n_head=2),
}
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
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95, seed=0)
MIXED_MODES = ["hand_continuous_eager", "hand_continuous_graph", "engine_eager", "engine_graphs"]


# --------------------------------------------------------------------- static-KV decode by hand
class StaticKV:
    """A preallocated KV cache for ``batch`` rows plus static token/position buffers.

    ``step()`` reads only ``tokens`` (B,), ``pos`` (B,) and the cache, writes this step's k/v at
    ``pos`` and returns logits (B, V): a function a CUDA graph can capture as is.
    """

    def __init__(self, model: GPT, batch: int, max_seq: int) -> None:
        cfg, p = model.config, next(model.parameters())
        self.model, self.batch, self.max_seq = model, batch, max_seq
        hs = cfg.n_embd // cfg.n_head
        shape = (cfg.n_layer, batch, cfg.n_head, max_seq, hs)
        self.k = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.v = torch.zeros(shape, device=p.device, dtype=p.dtype)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=p.device)
        self.rows = torch.arange(batch, device=p.device)
        self.slots = torch.arange(max_seq, device=p.device)
        self.active = torch.ones(batch, dtype=torch.bool, device=p.device)

    @torch.no_grad()
    def prefill_row(self, row: int, prompt: list[int]) -> None:
        """Run ``prompt`` through the model (eager), fill row ``row``'s cache, set its next token."""
        m, T = self.model, len(prompt)
        idx = torch.tensor(prompt, device=self.tokens.device)
        x = m.wte(idx)[None] + m.wpe(self.slots[:T])[None]  # (1, T, C)
        for layer, block in enumerate(m.h):
            q, k, v = block.attn.split_heads(block.ln_1(x))  # (1, nh, T, hs)
            self.k[layer, row, :, :T] = k[0]
            self.v[layer, row, :, :T] = v[0]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(1, T, -1))
            x = x + block.mlp(block.ln_2(x))
        logits = m.lm_head(m.ln_f(x[:, -1]))  # (1, V)
        self.tokens[row] = logits.argmax(-1)[0]
        self.pos[row] = T

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        m, B = self.model, self.batch
        x = (m.wte(self.tokens) + m.wpe(self.pos))[:, None]  # (B, 1, C)
        mask = (self.slots[None, :] <= self.pos[:, None])[:, None, None, :]  # (B, 1, 1, S)
        for layer, block in enumerate(m.h):
            q, k, v = block.attn.split_heads(block.ln_1(x))  # (B, nh, 1, hs)
            self.k[layer][self.rows, :, self.pos] = k[:, :, 0]  # (B, nh, hs) at each row's pos
            self.v[layer][self.rows, :, self.pos] = v[:, :, 0]
            y = F.scaled_dot_product_attention(q, self.k[layer], self.v[layer], attn_mask=mask)
            x = x + block.attn.c_proj(y.transpose(1, 2).reshape(B, 1, -1))
            x = x + block.mlp(block.ln_2(x))
        return m.lm_head(m.ln_f(x))[:, 0]  # (B, V)

    def advance(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling outside the graph; idle rows park at position 0 of their own row."""
        nxt = logits.argmax(-1)
        self.tokens.copy_(nxt)
        self.pos.copy_(torch.where(self.active, self.pos + 1, 0))
        return nxt


class HandStep:
    """``StaticKV.step`` run eagerly, or captured once and replayed (CUDA or emulated graph)."""

    def __init__(self, kv: StaticKV, graphed: bool, device: torch.device) -> None:
        self.kv, self.graph, self.capture_s = kv, None, None
        if not graphed:
            return
        factory = GraphFactory("cuda" if device.type == "cuda" else "emulated", device)
        synchronize(device)
        t0 = time.perf_counter()
        with factory.side_stream():
            for _ in range(2):  # warmup (cuBLAS handles, SDPA kernel selection)
                kv.step()
        pos, tokens = kv.pos.clone(), kv.tokens.clone()
        self.graph = factory.new_graph()
        with factory.side_stream():
            self.logits = self.graph.capture(kv.step)
        kv.pos.copy_(pos)  # the emulated capture ran the step once; its k/v write is redone
        kv.tokens.copy_(tokens)
        synchronize(device)
        self.capture_s = time.perf_counter() - t0

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self.kv.step()
        self.graph.replay()
        return self.logits


# ----------------------------------------------------------------------------- fixed batch
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


def fixed_hand(b: Bench, batch: int, graphed: bool) -> dict:
    kv = StaticKV(b.model, batch, b.max_seq)
    prompts = b.prompts(batch)
    for row, p in enumerate(prompts):
        kv.prefill_row(row, p)
    first = kv.tokens.clone()
    step = HandStep(kv, graphed, b.device)
    timer, hist = StepTimer(b.device), [first]
    for i in range(b.warmup + b.steps - 1):
        if i >= b.warmup:
            timer.start()
        hist.append(kv.advance(step()))
        if i >= b.warmup:
            timer.stop()
    times = timer.times_ms()
    tokens = torch.stack(hist, 1).tolist()  # (B, steps)
    return {
        **summarize(times),
        "capture_s": step.capture_s,
        "tokens": tokens,
        "method": "CUDA events per step" if b.device.type == "cuda" else "perf_counter per step",
    }


def _timed(fn, device: torch.device, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        walls.append(time.perf_counter() - t0)
    return statistics.median(walls)


def _per_step_ms(run, n: int, device: torch.device, repeats: int) -> float | None:
    """(T(n tokens) - T(1 token)) / (n - 1): decode steps only, prefill cancels out."""
    t_n = _timed(lambda: run(n), device, repeats)
    t_1 = _timed(lambda: run(1), device, repeats)
    ms = (t_n - t_1) / (n - 1) * 1e3
    return (
        ms if ms > 0 else None
    )  # noise larger than the decode steps: no number rather than a wrong one


def make_engine(b: Bench, max_batch: int, use_graphs: bool, lookahead: bool = True, **extra):
    try:
        from tgraph.decode import DecodeEngine
    except ImportError as exc:
        raise Skip(f"tgraph.decode.DecodeEngine is not importable yet ({exc})") from exc
    synchronize(b.device)
    t0 = time.perf_counter()
    kwargs = dict(max_batch_size=max_batch, max_seq_len=b.max_seq, use_graphs=use_graphs, **extra)
    if not lookahead:
        kwargs["lookahead"] = False
    try:
        engine = DecodeEngine(b.model, **kwargs, progress=False)
    except TypeError:  # an engine without the progress option
        engine = DecodeEngine(b.model, **kwargs)
    synchronize(b.device)
    return engine, time.perf_counter() - t0


def engine_stats(engine) -> dict | None:
    stats = getattr(engine, "stats", None)
    if callable(stats):
        stats = stats()
    if stats is None:
        return None
    if hasattr(stats, "__dataclass_fields__"):
        from dataclasses import asdict

        props = ("ms_per_step", "tokens_per_s", "padding_waste")
        extra = {k: getattr(stats, k) for k in props if hasattr(stats, k)}
        stats = {**asdict(stats), **extra}
    return dict(stats) if isinstance(stats, dict) else {"repr": repr(stats)}


def fixed_engine(
    b: Bench,
    batch: int,
    use_graphs: bool,
    repeats: int,
    lookahead: bool = True,
    sampling: dict | None = None,
) -> dict:
    engine, setup_s = make_engine(b, batch, use_graphs, lookahead)
    prompts = b.prompts(batch)
    n = b.steps
    kw = sampling or {}
    tokens = engine.generate(prompts, n, **kw)  # also the warmup
    per_call = []
    for _ in range(repeats):
        engine.generate(prompts, n, **kw)
        per_call.append(engine_stats(engine) or {})
    stats = per_call[-1]
    if all("ms_per_step" in st for st in per_call):
        ms, method = statistics.median(st["ms_per_step"] for st in per_call), "engine stats"
    else:
        run = lambda k: engine.generate(prompts, k, **kw)  # noqa: E731
        ms, method = _per_step_ms(run, n, b.device, repeats), "(T(n)-T(1))/(n-1) of generate"
    return {
        "ms_median": ms,
        "capture_s": stats.get("capture_seconds", setup_s),
        # sampled tokens are not comparable with greedy hand_eager: no agreement column
        **({} if sampling else {"tokens": [list(t)[-n:] for t in tokens]}),
        "engine_stats": stats,
        "engine_ms_per_step": stats.get("ms_per_step"),
        "method": f"{method}: decode steps of generate(), wall incl. the per-step host read "
        "of sampled tokens, median of repeats; capture_s = engine stats (warmup + capture of "
        "every bucket)",
    }


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


def fixed_hf(b: Bench, batch: int, repeats: int) -> dict:
    model = hf_model(b)
    ids = torch.tensor(b.prompts(batch), device=b.device)
    mask = torch.ones_like(ids)

    def run(k: int):
        with torch.no_grad():
            return model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=k, do_sample=False
            )

    run(b.steps)  # warmup
    ms = _per_step_ms(run, b.steps, b.device, repeats)
    return {
        "ms_median": ms,
        "capture_s": None,
        "method": "(T(n)-T(1))/(n-1) of generate, wall; LlamaForCausalLM, own init",
    }


def ttft(b: Bench, mode: str, repeats: int) -> dict:
    """Median wall time of one request's prompt to its first token on the host."""
    prompt = b.prompts(1)
    if mode == "ttft_hf":
        model = hf_model(b)
        ids = torch.tensor(prompt, device=b.device)

        def first() -> None:
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1)

        stats = {}
    else:
        graphs = mode != "ttft_engine_eager"
        extra = {} if mode == "ttft_prefill_graphs" else {"prefill_sizes": []}
        engine, _ = make_engine(b, 1, graphs, **extra)

        def first() -> None:
            engine.generate(prompt, 1)

        stats = None
    first()  # warmup
    ms = 1e3 * statistics.median(_timed(first, b.device, 1) for _ in range(repeats))
    if stats is None:
        stats = engine_stats(engine) or {}
    return {
        "ms_median": ms,
        "ttft_ms": ms,
        "capture_s": stats.get("capture_seconds"),
        "engine_stats": stats or None,
        "method": "wall of generate(prompt, 1) incl. the host read of the first token, "
        f"synchronized, median of {repeats}",
    }


def run_fixed(b: Bench, mode: str, batch: int, repeats: int) -> dict:
    row = {"workload": f"batch {batch}", "batch": batch, "mode": mode, "status": "ok", "reason": ""}
    if mode.startswith("ttft_"):
        row["workload"] = f"ttft prompt {b.prompt_len}"
    base = fresh_memory(b.device)
    try:
        if mode in ("hand_eager", "hand_graph"):
            res = fixed_hand(b, batch, mode == "hand_graph")
        elif mode.startswith("ttft_"):
            res = ttft(b, mode, repeats)
        elif mode.startswith("engine_"):
            res = fixed_engine(
                b,
                batch,
                mode != "engine_eager",
                repeats,
                lookahead=not mode.endswith("lookahead"),
                sampling=SAMPLED if mode.endswith("sampled") else None,
            )
        else:
            res = fixed_hf(b, batch, repeats)
        synchronize(b.device)
        row.update(res, peak_mem_mib=peak_memory_mib(b.device, since=base))
        # ttft rows: first tokens per second (one request)
        row["tokens_per_s"] = batch * 1e3 / row["ms_median"] if row["ms_median"] else None
        if row["ms_median"] is None:  # _per_step_ms: timing noise larger than the decode steps
            row.update(status="skipped", reason="timing noise larger than the decode steps")
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - one failing mode must not hide the others
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:400]}")
    _print_row(row)
    return row


def _print_row(row: dict) -> None:
    if row["status"] != "ok":
        print(f"  {row['workload']} {row['mode']}: {row['status']}: {row['reason']}", flush=True)
    else:
        print(
            f"  {row['workload']} {row['mode']}: {row['ms_median']:.3f} ms/step, "
            f"{row['tokens_per_s']:.0f} tok/s",
            flush=True,
        )


# ---------------------------------------------------------------------- mixed workload
@dataclass(frozen=True)
class Request:
    arrival: int  # decode step at which the request arrives
    prompt: list[int]
    new_tokens: int


def mixed_requests(n: int, max_prompt: int, max_new: int, seed: int) -> list[Request]:
    g = random.Random(seed)
    reqs, t = [], 0
    for _ in range(n):
        t += g.choice((0, 0, 1, 2))  # bursts and gaps: ~1 arrival per decode step
        prompt = [g.randrange(VOCAB) for _ in range(g.randint(4, max_prompt))]
        reqs.append(Request(t, prompt, g.randint(8, max_new)))
    return reqs


def continuous_hand(b: Bench, reqs: list[Request], max_batch: int, graphed: bool) -> dict:
    """Continuous batching over one max-batch step: finished rows free their slot at once."""
    kv = StaticKV(b.model, max_batch, b.max_seq)
    kv.active.fill_(False)
    kv.pos.zero_()
    step = HandStep(kv, graphed, b.device)
    queue, slots = (
        deque(sorted(range(len(reqs)), key=lambda i: reqs[i].arrival)),
        [None] * max_batch,
    )
    left = [0] * max_batch
    hist, owners, firsts = [], [], {}
    timer, now, busy, total = StepTimer(b.device), 0, 0, 0
    synchronize(b.device)
    t0 = time.perf_counter()
    while queue or any(s is not None for s in slots):
        changed = False
        for row in range(max_batch):
            if slots[row] is None and queue and reqs[queue[0]].arrival <= now:
                i = queue.popleft()
                kv.prefill_row(row, reqs[i].prompt)
                firsts[i] = kv.tokens[row].clone()
                slots[row], left[row], changed = i, reqs[i].new_tokens - 1, True
        if changed:
            kv.active.copy_(torch.tensor([s is not None for s in slots]), non_blocking=True)
        if all(s is None for s in slots):
            now = reqs[queue[0]].arrival  # idle until the next arrival
            continue
        timer.start()
        hist.append(kv.advance(step()))
        timer.stop()
        owners.append(list(slots))
        busy += sum(s is not None and left[r] > 0 for r, s in enumerate(slots))
        total += max_batch
        for row, s in enumerate(slots):
            if s is not None:
                left[row] -= 1
                if left[row] <= 0:
                    slots[row] = None
                    kv.active[row] = False
        now += 1
    synchronize(b.device)
    wall = time.perf_counter() - t0
    out = {i: [int(t)] for i, t in firsts.items()}
    steps = torch.stack(hist).tolist() if hist else []
    for toks, own in zip(steps, owners):
        for row, i in enumerate(own):
            if i is not None and len(out[i]) < reqs[i].new_tokens:
                out[i].append(toks[row])
    return _mixed_result(
        timer.times_ms(),
        wall,
        reqs,
        [out[i] for i in range(len(reqs))],
        1 - busy / total if total else None,
        step.capture_s,
        "requests join at their arrival step; one max-batch step",
    )


def _mixed_result(times, wall, reqs, tokens, waste, capture, note) -> dict:
    generated = sum(len(t) for t in tokens)
    return {
        **summarize(times),
        "tokens_per_s": generated / wall,
        "wall_s": wall,
        "generated_tokens": generated,
        "padding_waste": waste,
        "capture_s": capture,
        "tokens": tokens,
        "note": note,
    }


def continuous_engine(b: Bench, reqs: list[Request], max_batch: int, use_graphs: bool) -> dict:
    engine, setup_s = make_engine(b, max_batch, use_graphs)
    prompts, news = [r.prompt for r in reqs], [r.new_tokens for r in reqs]
    engine.generate(prompts[:2], 4)  # warmup
    synchronize(b.device)
    t0 = time.perf_counter()
    tokens = engine.generate(prompts, news)  # per-request max_new_tokens
    synchronize(b.device)
    wall = time.perf_counter() - t0
    stats = engine_stats(engine) or {}
    waste = next(
        (stats[k] for k in ("padding_waste", "padding_fraction", "padding") if k in stats), None
    )
    res = _mixed_result(
        [],
        wall,
        reqs,
        [list(t)[-n:] for t, n in zip(tokens, news)],
        waste,
        stats.get("capture_seconds", setup_s),
        "all requests submitted at t=0 (generate() has no arrival times); "
        "waiting ones join as slots free",
    )
    res["engine_stats"] = stats
    ms = next(
        (
            stats[k]
            for k in ("ms_per_step", "decode_ms_per_step", "ms_per_decode_step")
            if k in stats
        ),
        None,
    )
    res["ms_median"] = ms
    return res


def run_mixed(b: Bench, mode: str, reqs: list[Request], max_batch: int) -> dict:
    row = {"workload": "mixed", "batch": max_batch, "mode": mode, "status": "ok", "reason": ""}
    base = fresh_memory(b.device)
    try:
        if mode.startswith("hand"):
            res = continuous_hand(b, reqs, max_batch, mode.endswith("graph"))
        else:
            res = continuous_engine(b, reqs, max_batch, mode == "engine_graphs")
        row.update(res, peak_mem_mib=peak_memory_mib(b.device, since=base))
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:400]}")
    if row["status"] == "ok":
        print(
            f"  mixed {mode}: {row['tokens_per_s']:.0f} tok/s, waste {row['padding_waste']}",
            flush=True,
        )
    else:
        _print_row(row)
    return row


# ----------------------------------------------------------------------------- report
def add_parity(rows: list[dict]) -> None:
    """Token agreement with hand_eager of the same workload (hf: different model, n/a)."""
    for r in rows:
        ref = next(
            (
                x
                for x in rows
                if x["workload"] == r["workload"]
                and x["status"] == "ok"
                and x["mode"] in ("hand_eager", "hand_continuous_eager")
            ),
            None,
        )
        if r["status"] != "ok" or "tokens" not in r or ref is None:
            r["token_agreement"] = None
            continue
        pairs = [(a, c) for ta, tc in zip(r["tokens"], ref["tokens"]) for a, c in zip(ta, tc)]
        r["token_agreement"] = sum(a == c for a, c in pairs) / len(pairs) if pairs else None
    for r in rows:
        r.pop("tokens", None)  # keep the JSON small


def add_ratios(rows: list[dict]) -> tuple[dict, dict]:
    """Per fixed-batch mode: ms over hand_graph's, HF's ms over its; TTFT over eager prefill's.
    Returns (ratios, goals): the decode targets and whether the numbers meet them."""

    def ms(workload: str, mode: str) -> float | None:
        r = next((x for x in rows if x["workload"] == workload and x["mode"] == mode), None)
        return r.get("ms_median") if r and r["status"] == "ok" else None

    ratios: dict = {}
    for r in rows:
        if r["status"] != "ok" or not r.get("ms_median") or r["workload"] == "mixed":
            continue
        if r["workload"].startswith("ttft"):
            base = ms(r["workload"], "ttft_prefill_eager")
            r["x_ttft_prefill_eager"] = r["ms_median"] / base if base else None
            ratios[f"{r['workload']}/{r['mode']}"] = {"x_prefill_eager": r["x_ttft_prefill_eager"]}
            continue
        hand, hf = ms(r["workload"], "hand_graph"), ms(r["workload"], "hf_generate")
        r["x_hand_graph"] = r["ms_median"] / hand if hand else None
        r["hf_speedup"] = hf / r["ms_median"] if hf else None
        ratios[f"{r['workload']}/{r['mode']}"] = {
            "x_hand_graph": r["x_hand_graph"],
            "hf_speedup": r["hf_speedup"],
        }
    goals = {}
    for r in rows:
        if r["mode"] == "engine_graphs" and r.get("x_hand_graph") is not None:
            x = r["x_hand_graph"]
            goals[f"{r['workload']}: engine_graphs <= 1.05x hand_graph"] = [round(x, 3), x <= 1.05]
            if r["batch"] == 1 and r.get("hf_speedup") is not None:
                h = r["hf_speedup"]
                goals["batch 1: engine_graphs >= 10x hf_generate"] = [round(h, 2), h >= 10]
        if r["mode"] == "ttft_prefill_graphs" and r.get("x_ttft_prefill_eager") is not None:
            x = r["x_ttft_prefill_eager"]
            goals[f"{r['workload']}: prefill graphs <= 0.5x eager prefill"] = [
                round(x, 3),
                x <= 0.5,
            ]
    return ratios, goals


def markdown(payload: dict) -> str:
    meta = payload["meta"]
    parts = [
        "# Decode benchmark",
        "",
        environment_markdown(meta["env"]),
        "",
        f"Model: {meta['model']}. Prompt length {meta['prompt_len']}, {meta['steps']} "
        f"decode steps after {meta['warmup']} warmup steps; greedy. {meta['notes']}",
    ]
    if payload.get("goals"):
        parts += ["", "## Goals", ""]
        parts.append(
            markdown_table(
                ["goal", "measured", "met"], [[k, v[0], v[1]] for k, v in payload["goals"].items()]
            )
        )
    headers = [
        "mode",
        "ms/step",
        "tokens/s",
        "x hand_graph",
        "peak MiB",
        "capture s",
        "token agreement",
        "status",
    ]
    for wl in dict.fromkeys(r["workload"] for r in payload["results"]):
        rows = [r for r in payload["results"] if r["workload"] == wl]
        graph = next(
            (r.get("ms_median") for r in rows if r["mode"] == "hand_graph" and r["status"] == "ok"),
            None,
        )
        parts += ["", f"## {wl}", ""]
        h = headers if wl != "mixed" else headers[:3] + ["padding waste"] + headers[4:]
        if wl.startswith("ttft"):
            h = ["mode", "TTFT ms", "first tok/s", "x prefill eager"] + headers[4:]
        table = []
        for r in rows:
            if wl == "mixed":
                third = r.get("padding_waste")
            elif wl.startswith("ttft"):
                third = r.get("x_ttft_prefill_eager")
            else:
                third = r["ms_median"] / graph if graph and r.get("ms_median") else None
            table.append(
                [
                    r["mode"],
                    r.get("ms_median"),
                    r.get("tokens_per_s"),
                    third,
                    r.get("peak_mem_mib"),
                    r.get("capture_s"),
                    r.get("token_agreement"),
                    "ok" if r["status"] == "ok" else f"{r['status']}: {r['reason']}",
                ]
            )
        parts.append(markdown_table(h, table))
    return "\n".join(parts)


def profile(b: Bench, batches: list[int], out: str, steps: int = 20) -> None:
    """torch.profiler tables of hand_graph and engine_graphs steps at each batch size (where the
    engine's step costs more than the hand-written loop: host time, copies, extra kernels)."""
    parts = []
    for batch in batches:
        parts += _profile_batch(b, batch, steps)
    path = os.path.join(out, "bench_decode_profile.txt")
    os.makedirs(out, exist_ok=True)
    with open(path, "w") as f:
        f.write("\n\n".join(parts) + "\n")
    print(f"wrote {path}", flush=True)


def _profile_batch(b: Bench, batch: int, steps: int) -> list[str]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if b.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sort = "self_cuda_time_total" if b.device.type == "cuda" else "self_cpu_time_total"
    parts = []
    kv = StaticKV(b.model, batch, b.max_seq)
    for row, p in enumerate(b.prompts(batch)):
        kv.prefill_row(row, p)
    step = HandStep(kv, True, b.device)
    for _ in range(3):
        kv.advance(step())
    synchronize(b.device)
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            kv.advance(step())
        synchronize(b.device)
    parts += [f"== hand_graph, batch {batch}, {steps} steps ==", _table(prof, sort)]
    engine, _ = make_engine(b, batch, True)
    prompts = b.prompts(batch)
    engine.generate(prompts, steps)
    synchronize(b.device)
    with torch_profile(activities=activities) as prof:
        engine.generate(prompts, steps)
        synchronize(b.device)
    parts += [f"== engine_graphs generate, batch {batch}, {steps} tokens ==", _table(prof, sort)]
    return parts


def _table(prof, sort: str) -> str:
    return prof.key_averages().table(sort_by=sort, row_limit=30, max_name_column_width=60)


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
