"""The mixed workload of the decode benchmark (scripts/bench_decode.py): requests of different
prompt and output lengths arriving over time, served by continuous batching (hand-written slots
over one max-batch step, and DecodeEngine)."""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass

import torch
from bench_common import Skip, StepTimer, fresh_memory, peak_memory_mib, summarize, synchronize
from bench_decode_hand import HandStep, StaticKV
from bench_decode_setup import VOCAB, Bench, engine_stats, make_engine, print_row


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
    engine = make_engine(b, max_batch, use_graphs)
    prompts, news = [r.prompt for r in reqs], [r.new_tokens for r in reqs]
    engine.generate(prompts[:2], 4)  # warmup
    synchronize(b.device)
    t0 = time.perf_counter()
    tokens = engine.generate(prompts, news)  # per-request max_new_tokens
    synchronize(b.device)
    wall = time.perf_counter() - t0
    stats = engine_stats(engine)
    res = _mixed_result(
        [],
        wall,
        reqs,
        [list(t)[-n:] for t, n in zip(tokens, news)],
        stats["padding_waste"],
        stats["capture_seconds"],
        "all requests submitted at t=0 (generate() has no arrival times); "
        "waiting ones join as slots free",
    )
    res["engine_stats"] = stats
    res["ms_median"] = stats["ms_per_step"]
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
        print_row(row)
    return row
