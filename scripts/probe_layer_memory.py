"""Where per-layer graphs' peak memory goes, phase by phase, beside eager's (CUDA):
the recorded step, ``create_graphs()`` (warmup and capture), the first replayed step and the
steady steps. Peaks are bytes allocated above what was allocated when the mode started.

    python scripts/probe_layer_memory.py --config llama_d1024 --dtype bf16 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
from pathlib import Path

import torch
from bench_train_setup import eager_step, make_setup

import tgraph

TIMELINES: dict[str, dict] = {}  # phase -> what was alive at its peak (--timeline)


def _label(frames: list[dict]) -> str:
    """Who allocated a block: the innermost frame in the model's library, else in tgraph,
    else the innermost Python frame."""
    for key in ("/transformers/", "/tgraph/", "/torch/"):
        for f in frames:
            if key in f["filename"]:
                return f"{f['filename'].split(key)[-1]}:{f['name']}:{f['line']}"
    return f"{frames[0]['filename']}:{frames[0]['name']}" if frames else "?"


def _at_peak(trace: list[dict]) -> dict:
    """Replay the allocator's trace of one phase: the blocks the phase allocated and still held
    at its highest point, in MiB by allocating frame (the top 12)."""
    live: dict[int, tuple[int, str]] = {}
    now = best = 0
    best_live: dict[int, tuple[int, str]] = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _label(e.get("frames", [])))
            now += e["size"]
            if now > best:
                best, best_live = now, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    by: dict[str, float] = {}
    for size, label in best_live.values():
        by[label] = by.get(label, 0.0) + size / 2**20
    top = sorted(by.items(), key=lambda kv: -kv[1])[:12]
    return {"peak_mib": best / 2**20, "by_frame_mib": dict(top)}


def _phase(base: int, fn, name: str = "", timeline: bool = False) -> tuple[float, float]:
    """Run ``fn``; (peak, allocated after) in MiB above ``base``. ``timeline``: also record
    the allocator's trace and keep what was alive at the phase's peak (TIMELINES)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if timeline:
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=1_000_000)
    fn()
    torch.cuda.synchronize()
    if timeline:
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        torch.cuda.memory._record_memory_history(enabled=None)
        TIMELINES[name] = _at_peak(trace)
    mib = 2**20
    return (
        (torch.cuda.max_memory_allocated() - base) / mib,
        (torch.cuda.memory_allocated() - base) / mib,
    )


def probe(s, mode: str, steps: int, timeline: bool = False) -> dict:
    """One mode's phases on a fresh copy of the model (freed before the next mode starts)."""
    model, opt = s.fresh()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()  # the model on the device: in both modes
    if mode == "tgraph_layer":
        tgraph.enable(model, backend="cuda")
    phases, out = {}, {}

    def step(i):
        eager_step(model, opt, *s.batch(i), s)

    phases["step_1 (recorded)"] = _phase(base, lambda: step(0))
    if mode == "tgraph_layer":
        opt.zero_grad(set_to_none=True)  # as README's loop and bench_train.py

        def create():
            with s.autocast():
                out["report"] = str(tgraph.create_graphs())

        phases["create_graphs"] = _phase(base, create, "create_graphs", timeline)
        out["memory"] = dataclasses.asdict(tgraph.memory_report())
    phases["step_2"] = _phase(base, lambda: step(1), f"{mode} step_2", timeline)
    phases["steady"] = _phase(base, lambda: [step(i) for i in range(2, 2 + steps)])
    if mode == "tgraph_layer":
        tgraph.reset()
        tgraph.disable(model)
    return {"phases": phases, **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="llama_d1024")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="also what was alive at the peak of create_graphs and of step 2, by allocating frame",
    )
    a = ap.parse_args()
    s = make_setup(a.config, a.dtype, torch.device("cuda"), "cuda", a.steps, 1, 0)
    rows = {}
    for mode in ("eager", "tgraph_layer"):
        rows[mode] = probe(s, mode, a.steps, a.timeline)
        gc.collect()
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "config": a.config}
    rows = {**rows, "timelines": TIMELINES} if TIMELINES else rows
    (a.out / "probe_layer_memory.json").write_text(json.dumps({"meta": meta, **rows}, indent=1))
    for name, t in TIMELINES.items():
        print(f"{name}: {t['peak_mib']:.1f} MiB at its peak, by allocating frame:")
        for label, mib in t["by_frame_mib"].items():
            print(f"  {mib:9.1f}  {label}")
    for mode, r in rows.items():
        if mode == "timelines":
            continue
        print(mode, r.get("report", ""))
        for k, v in r["phases"].items():
            print(f"  {k:20s} peak {v[0]:9.1f}  after {v[1]:9.1f} MiB")


if __name__ == "__main__":
    main()
