"""Decode benchmark on transformers Llama models: DecodeEngine vs. transformers ``generate``.

    OUT=bench_out python scripts/bench_decode_hf.py            # H200: under 4 minutes
    python scripts/bench_decode_hf.py --smoke --out /tmp/smoke   # CPU, seconds

Three peers serve the same random-init ``LlamaForCausalLM`` (one object per config) in one
process, greedy, the same prompts of ``--prompt-len`` tokens, at batch 1 and 8:

  engine             ``tgraph.decode.DecodeEngine(model, ...)``: the transformers adapter, decode
                     and prefill graphs, in-graph greedy sampling
  hf_dynamic         ``model.generate(do_sample=False)`` with its default dynamic cache (eager)
  hf_static_compile  ``generate`` with ``cache_implementation="static"`` and, as transformers
                     documents it, ``model.forward = torch.compile(model.forward,
                     mode="reduce-overhead", fullgraph=True)`` (``disable_compile`` set so
                     generate does not compile its own second copy); compile time is reported
                     separately (``setup_s``)
  hf_static_auto     ``generate`` with ``cache_implementation="static"`` and its own automatic
                     compile of the decode step (prefill eager)

The compiled peers run at ``--compile-batches`` (default 1: compiling again per batch size
costs most of the time budget); rows run by priority (:func:`schedule`), batch 1 of every
config first.

Configs: ``llama-12x256-fp32`` (the design size of bench_decode.py: 12 layers, d 256, 4 heads,
vocab 1024, fp32) and ``llama-16x1024-bf16`` (16 layers, d 1024, 16 heads of which 4 KV heads,
vocab 32000, bf16). Every peer is timed the same way: ms per decode step =
(T(n new tokens) - T(1 new token)) / (n - 1) of whole ``generate`` calls, synchronized, median
of ``--repeats`` (prefill cancels out); tokens/s = batch * 1000 / ms. Each row has the peak
memory allocated while the peer ran (and above the model's weights), and whether its greedy
tokens equal ``hf_dynamic``'s (``tokens_equal``; ``agreement`` is the fraction of equal tokens:
bf16 kernels round differently, so a near-tie can flip a later token).

Robust by construction: every peer runs in its own try/except and records the error string
(the compiled peers in a child process of their own: compiled code can kill the interpreter); a
time budget (``--budget-s``, default 220 s on a GPU) skips what would not fit, with the reason.
Writes ``bench_decode_hf.json`` and ``.md`` under ``--out`` (default ``$OUT``, else ``out``) and
prints a summary with the goals: at batch 1, engine >= 10x hf_dynamic and no slower than
hf_static_compile.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_common import (  # noqa: E402
    Skip,
    environment,
    environment_markdown,
    fresh_memory,
    markdown_table,
    peak_memory_mib,
    synchronize,
    write_outputs,
)

CONFIGS = {
    "llama-12x256-fp32": dict(
        hidden_size=256, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=1024, vocab_size=1024, dtype=torch.float32,
    ),
    "llama-16x1024-bf16": dict(
        hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
        intermediate_size=2816, vocab_size=32000, dtype=torch.bfloat16,
    ),
    "llama-2x32-fp32-smoke": dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=128, dtype=torch.float32,
    ),
}  # fmt: skip
PEERS = ("hf_dynamic", "engine", "hf_static_compile", "hf_static_auto")
COMPILED = ("hf_static_compile", "hf_static_auto")
COMPILE_RESERVE_S = 75  # a compile peer starts only with this much budget left


# ------------------------------------------------------------------------------------ models
def make_model(name: str, max_positions: int, device: torch.device, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers import logging as hf_logging

    hf_logging.set_verbosity_error()
    spec = dict(CONFIGS[name])
    dtype = spec.pop("dtype")
    cfg = LlamaConfig(
        **spec,
        max_position_embeddings=max_positions,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.generation_config.eos_token_id = None  # never stop early: every call decodes n tokens
    model.generation_config.pad_token_id = 0
    return model


def prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    g = random.Random(seed + batch)
    return [[g.randrange(vocab) for _ in range(length)] for _ in range(batch)]


# ------------------------------------------------------------------------------------ timing
def timed(fn, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def per_step_ms(run, n: int, device: torch.device, repeats: int) -> float | None:
    """(T(n tokens) - T(1 token)) / (n - 1), medians of ``repeats``: decode steps only."""
    t_n = statistics.median(timed(lambda: run(n), device) for _ in range(repeats))
    t_1 = statistics.median(timed(lambda: run(1), device) for _ in range(repeats))
    ms = (t_n - t_1) / (n - 1) * 1e3
    return ms if ms > 0 else None  # noise above the decode steps: no number, not a wrong one


# ------------------------------------------------------------------------------------- peers
def hf_runner(model, ps: list[list[int]]):
    ids = torch.tensor(ps, device=model.device)
    mask = torch.ones_like(ids)

    def run(k: int) -> list[list[int]]:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=k, do_sample=False
            )
        return out[:, ids.shape[1] :].tolist()

    return run


def peer_hf_dynamic(model, ps, args, device) -> dict:
    run = hf_runner(model, ps)
    setup = timed(lambda: run(args.steps), device)  # warmup
    return {
        "setup_s": setup,
        "ms_per_step": per_step_ms(run, args.steps, device, args.repeats),
        "tokens": run(args.steps),
        "method": "generate, default dynamic cache, eager",
    }


def peer_engine(model, ps, args, device) -> dict:
    from tgraph.decode import DecodeEngine

    backend = "cuda" if device.type == "cuda" else "emulated"
    t0 = time.perf_counter()
    engine = DecodeEngine(
        model,
        max_batch_size=len(ps),
        max_seq_len=args.prompt_len + args.steps,
        backend=backend,
        progress=False,
    )
    synchronize(device)
    setup = time.perf_counter() - t0
    run = lambda k: engine.generate(ps, k)  # noqa: E731
    run(args.steps)  # warmup
    ms = per_step_ms(run, args.steps, device, args.repeats)
    tokens = run(args.steps)
    return {  # the engine (KV cache, graphs) is freed on return
        "setup_s": setup,
        "ms_per_step": ms,
        "tokens": tokens,
        "engine_ms_per_step": engine.stats.ms_per_step,
        "engine_stats": engine.stats.summary(),
        "method": f"DecodeEngine ({backend} graphs), capture in setup_s",
    }


def peer_hf_static_compile(model, ps, args, device) -> dict:
    """transformers' documented recipe, as written (static cache, compiled forward)."""
    if device.type != "cuda" and not args.compile_on_cpu:
        raise Skip("torch.compile peer runs on CUDA only (--compile-on-cpu to force)")
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    try:
        return _static_generate(model, ps, args, device, disable_compile=True) | {
            "method": 'generate, cache_implementation="static", forward = torch.compile('
            'forward, mode="reduce-overhead", fullgraph=True); compile in setup_s',
        }
    finally:
        del model.forward  # the class's forward again
        torch._dynamo.reset()


def peer_hf_static_auto(model, ps, args, device) -> dict:
    """generate's own compilation: with a static cache on CUDA it compiles the decode forward
    (its default CompileConfig: mode "reduce-overhead"), the prefill runs eagerly."""
    if device.type != "cuda" and not args.compile_on_cpu:
        raise Skip("torch.compile peer runs on CUDA only (--compile-on-cpu to force)")
    try:
        return _static_generate(model, ps, args, device, disable_compile=False) | {
            "method": 'generate, cache_implementation="static", its automatic compile of '
            "the decode step; compile in setup_s",
        }
    finally:
        for name in ("_compiled_call", "_last_compile_config"):
            if hasattr(model, name):
                delattr(model, name)
        torch._dynamo.reset()


def _static_generate(model, ps, args, device, *, disable_compile: bool) -> dict:
    gen = model.generation_config
    saved = (gen.cache_implementation, getattr(gen, "disable_compile", False))
    gen.cache_implementation, gen.disable_compile = "static", disable_compile
    try:
        run = hf_runner(model, ps)
        setup = timed(lambda: run(args.steps), device)  # compiles
        run(args.steps)  # cudagraph trees record on the first warm calls
        return {
            "setup_s": setup,
            "ms_per_step": per_step_ms(run, args.steps, device, args.repeats),
            "tokens": run(args.steps),
        }
    finally:
        gen.cache_implementation, gen.disable_compile = saved


PEER_FUNCS = {
    "hf_dynamic": peer_hf_dynamic,
    "engine": peer_engine,
    "hf_static_compile": peer_hf_static_compile,
    "hf_static_auto": peer_hf_static_auto,
}


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> float:
    pairs = [(a, b) for r, s in zip(tokens, ref) for a, b in zip(r, s)]
    return sum(a == b for a, b in pairs) / max(len(pairs), 1)


def run_peer(peer: str, model, config: str, batch: int, args, device, deadline: float) -> dict:
    row = {"config": config, "batch": batch, "peer": peer, "status": "ok", "reason": ""}
    left = deadline - time.perf_counter()
    need = COMPILE_RESERVE_S if peer in COMPILED and device.type == "cuda" else 5
    if left < need:
        row.update(status="skipped", reason=f"time budget: {left:.0f}s left, needs ~{need}s")
        return row
    base = fresh_memory(device)  # the model's weights (and nothing else) stay allocated
    try:
        ps = prompts(model.config.vocab_size, batch, args.prompt_len, args.seed)
        res = PEER_FUNCS[peer](model, ps, args, device)
        synchronize(device)
        ms = res["ms_per_step"]
        row.update(res)
        row["peak_mem_mib"] = peak_memory_mib(device)
        row["peak_over_weights_mib"] = peak_memory_mib(device, since=base)
        row["tokens_per_s"] = batch * 1e3 / ms if ms else None
        if ms is None:  # the tokens stand; only the time is unknown
            row.update(reason="no time: timing noise larger than the decode steps")
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - one failing peer must not hide the others
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:600]}")
        row["traceback"] = traceback.format_exc()[-3000:]
    gc.collect()
    return row


def schedule(
    configs: list[str], batches: list[int], peers: list[str], compile_batches: list[int]
) -> list[tuple[int, str, str]]:
    """(batch, config, peer) by priority, so that the time budget cuts the least useful rows:
    the goal rows of the first batch for every config (hf_dynamic, engine, hf_static_auto),
    then the documented compile recipe, then the other batches."""
    first, rest = batches[0], batches[1:]
    jobs = [(first, c, p) for c in configs for p in ("hf_dynamic", "engine", "hf_static_auto")]
    jobs += [(first, c, "hf_static_compile") for c in configs]
    jobs += [(b, c, p) for b in rest for c in configs for p in ("hf_dynamic", "engine")]
    jobs += [(b, c, p) for b in rest for c in configs for p in COMPILED]
    return [
        (b, c, p) for b, c, p in jobs if p in peers and (p not in COMPILED or b in compile_batches)
    ]


def run_isolated(peer: str, config: str, batch: int, args, device, deadline: float) -> dict:
    """``run_peer`` in a child process: compiled code that crashes the interpreter (a segfault
    inside a cudagraph replay was seen) loses its own row only."""
    row = {"config": config, "batch": batch, "peer": peer, "status": "ok", "reason": ""}
    left = deadline - time.perf_counter()
    if device.type != "cuda" and not args.compile_on_cpu:
        return row | {"status": "skipped", "reason": "torch.compile peer runs on CUDA only"}
    if left < COMPILE_RESERVE_S:
        return row | {"status": "skipped", "reason": f"time budget: {left:.0f}s left"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--child", f"{config}:{batch}:{peer}",
               "--child-out", str(out), "--steps", str(args.steps), "--prompt-len",
               str(args.prompt_len), "--repeats", str(args.repeats), "--seed", str(args.seed),
               "--device", str(device), "--out", args.out]  # fmt: skip
        cmd += ["--compile-on-cpu"] if args.compile_on_cpu else []
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            return row | {"status": "error", "reason": f"timed out after {left:.0f}s (budget)"}
        if out.is_file():
            return json.loads(out.read_text())
    rc = proc.returncode
    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    return row | {
        "status": "error",
        "reason": f"child process died with {how} before writing its row",
        "traceback": proc.stderr[-3000:],
    }


def child(args, device) -> int:
    """``--child CONFIG:BATCH:PEER``: one row, written as JSON to ``--child-out``."""
    config, batch, peer = args.child.split(":")
    model = make_model(config, args.prompt_len + args.steps, device, args.seed)
    row = run_peer(peer, model, config, int(batch), args, device, deadline=float("inf"))
    Path(args.child_out).write_text(json.dumps(row, default=str))
    return 0


# ----------------------------------------------------------------------------------- report
def compare(rows: list[dict]) -> dict:
    """Token equality with hf_dynamic, speed-ups, and the batch-1 goals, per config."""
    goals = {}
    by_key = {(r["config"], r["batch"], r["peer"]): r for r in rows}
    for r in rows:
        ref = by_key.get((r["config"], r["batch"], "hf_dynamic"))
        if r["status"] == "ok" and ref and ref["status"] == "ok" and r["peer"] != "hf_dynamic":
            r["tokens_equal"] = r["tokens"] == ref["tokens"]
            r["agreement"] = agreement(r["tokens"], ref["tokens"])
    for (config, batch, peer), r in by_key.items():
        if peer != "engine" or r["status"] != "ok":
            continue
        for other in ("hf_dynamic", *COMPILED):
            o = by_key.get((config, batch, other))
            if o and o["status"] == "ok" and o["ms_per_step"] and r["ms_per_step"]:
                r[f"speedup_vs_{other}"] = o["ms_per_step"] / r["ms_per_step"]
        if batch == 1:
            dyn = r.get("speedup_vs_hf_dynamic")
            comp = r.get("speedup_vs_hf_static_compile")
            auto = r.get("speedup_vs_hf_static_auto")
            goals[config] = {
                "engine >= 10x hf_dynamic": None if dyn is None else dyn >= 10,
                "engine no slower than hf_static_compile": None if comp is None else comp >= 1,
                "engine no slower than hf_static_auto": None if auto is None else auto >= 1,
                "speedup_vs_hf_dynamic": dyn,
                "speedup_vs_hf_static_compile": comp,
                "speedup_vs_hf_static_auto": auto,
            }
    return goals


def markdown(payload: dict) -> str:
    head = ["config", "batch", "peer", "ms/step", "tokens/s", "peak MiB", "over weights MiB",
            "setup s", "tokens equal", "status"]  # fmt: skip
    table = [
        [r["config"], r["batch"], r["peer"], r.get("ms_per_step"), r.get("tokens_per_s"),
         r.get("peak_mem_mib"), r.get("peak_over_weights_mib"), r.get("setup_s"),
         r.get("tokens_equal", "-" if r["peer"] != "hf_dynamic" else "ref"),
         r["status"] + (f": {r['reason'][:80]}" if r["reason"] else "")]
        for r in payload["results"]
    ]  # fmt: skip
    lines = [
        "# bench_decode_hf",
        "",
        environment_markdown(payload["meta"]["env"]),
        "",
        markdown_table(head, table),
        "",
        "Goals at batch 1:",
    ]
    for config, g in payload["goals"].items():
        lines.append(f"- {config}: {g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="llama-12x256-fp32,llama-16x1024-bf16")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--peers", default=",".join(PEERS))
    p.add_argument("--compile-batches", default="1", help="batches at which the compiled peers run")
    p.add_argument("--steps", type=int, default=64, help="new tokens per timed generate call")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=None, help="default 220 (GPU), 120 (CPU)")
    p.add_argument("--device", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--smoke", action="store_true", help="CPU, emulated graphs, a tiny config")
    p.add_argument("--compile-on-cpu", action="store_true", help="run the torch.compile peer")
    p.add_argument("--in-process", action="store_true", help="compiled peers in this process")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:
        args.configs, args.steps, args.repeats = "llama-2x32-fp32-smoke", 8, 1
        args.device = args.device or "cpu"
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.child:
        return child(args, device)
    budget = args.budget_s or (220.0 if device.type == "cuda" else 120.0)
    start = time.perf_counter()
    deadline = start + budget
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32 for every peer
    batches = [int(b) for b in args.batches.split(",")]
    peers = args.peers.split(",")
    compile_batches = [int(b) for b in args.compile_batches.split(",") if b]
    env = environment(device)
    print(f"bench_decode_hf on {env.get('gpu') or device}, torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    models: dict[str, object] = {}
    for config in args.configs.split(","):
        try:
            models[config] = make_model(config, args.prompt_len + args.steps, device, args.seed)
        except Exception as exc:  # noqa: BLE001
            rows.append({"config": config, "batch": None, "peer": "model", "status": "error",
                         "reason": f"{type(exc).__name__}: {exc}"})  # fmt: skip
    for batch, config, peer in schedule(list(models), batches, peers, compile_batches):
        model = models[config]
        if peer in COMPILED and not args.in_process:
            row = run_isolated(peer, config, batch, args, device, deadline)
        else:
            row = run_peer(peer, model, config, batch, args, device, deadline)
        rows.append(row)
        _print_row(row)
    order = {name: i for i, name in enumerate([*models, *PEERS])}
    rows.sort(key=lambda r: (order.get(r["config"], -1), r["batch"] or 0, order[r["peer"]]))
    models.clear()
    gc.collect()
    goals = compare(rows)
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    payload = {
        "meta": {
            "env": env | {"transformers": hf_version},
            "args": vars(args),
            "wall_s": time.perf_counter() - start,
        },
        "results": rows,
        "goals": goals,
    }
    js, md = write_outputs(args.out, "bench_decode_hf", payload, markdown(payload))
    print(markdown(payload))
    print(f"wrote {js} and {md} in {payload['meta']['wall_s']:.0f}s", flush=True)
    return 0


def _print_row(r: dict) -> None:
    where = f"  {r['config']} batch {r['batch']} {r['peer']}"
    if r["status"] != "ok":
        print(f"{where}: {r['status']}: {r['reason']}", flush=True)
        return
    mem, ms = r.get("peak_mem_mib"), r["ms_per_step"]
    if ms is None:
        print(f"{where}: {r['reason']}", flush=True)
        return
    print(
        f"{where}: {ms:.3f} ms/step, {r['tokens_per_s']:.0f} tok/s, "
        f"peak {'-' if mem is None else f'{mem:.0f} MiB'}, setup {r['setup_s']:.1f}s",
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
