"""Fixed-batch and time-to-first-token modes of the decode benchmark (scripts/bench_decode.py):
one row per (mode, batch size), ms per decode step and tokens/s."""

from __future__ import annotations

import statistics

import torch
from bench_common import (
    Skip,
    StepTimer,
    fresh_memory,
    peak_memory_mib,
    summarize,
    synchronize,
)
from bench_decode_hand import HandStep, StaticKV
from bench_decode_setup import (
    Bench,
    engine_stats,
    hf_model,
    make_engine,
    per_step_ms,
    print_row,
    timed,
)

SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95, seed=0)


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


def fixed_engine(
    b: Bench,
    batch: int,
    use_graphs: bool,
    repeats: int,
    lookahead: bool = True,
    sampling: dict | None = None,
) -> dict:
    engine = make_engine(b, batch, use_graphs, lookahead)
    prompts = b.prompts(batch)
    n = b.steps
    kw = sampling or {}
    tokens = engine.generate(prompts, n, **kw)  # also the warmup
    per_call = []
    for _ in range(repeats):
        engine.generate(prompts, n, **kw)
        per_call.append(engine_stats(engine))
    stats = per_call[-1]
    return {
        "ms_median": statistics.median(st["ms_per_step"] for st in per_call),
        "capture_s": stats["capture_seconds"],
        # sampled tokens are not comparable with greedy hand_eager: no agreement column
        **({} if sampling else {"tokens": [list(t)[-n:] for t in tokens]}),
        "engine_stats": stats,
        "engine_ms_per_step": stats["ms_per_step"],
        "method": "engine stats: decode steps of generate(), wall incl. the per-step host read "
        "of sampled tokens, median of repeats; capture_s = engine stats (warmup + capture of "
        "every bucket)",
    }


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
    ms = per_step_ms(run, b.steps, b.device, repeats)
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
        engine = make_engine(b, 1, graphs, **extra)

        def first() -> None:
            engine.generate(prompt, 1)

        stats = None
    first()  # warmup
    ms = 1e3 * statistics.median(timed(first, b.device, 1) for _ in range(repeats))
    if stats is None:
        stats = engine_stats(engine)
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
        if row["ms_median"] is None:  # per_step_ms: timing noise larger than the decode steps
            row.update(status="skipped", reason="timing noise larger than the decode steps")
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - one failing mode must not hide the others
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:400]}")
    print_row(row)
    return row
