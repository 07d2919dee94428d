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


def _phase(base: int, fn) -> tuple[float, float]:
    """Run ``fn``; (peak, allocated after) in MiB above ``base``."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    mib = 2**20
    return (
        (torch.cuda.max_memory_allocated() - base) / mib,
        (torch.cuda.memory_allocated() - base) / mib,
    )


def probe(s, mode: str, steps: int) -> dict:
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

        phases["create_graphs"] = _phase(base, create)
        out["memory"] = dataclasses.asdict(tgraph.memory_report())
    phases["step_2"] = _phase(base, lambda: step(1))
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
    a = ap.parse_args()
    s = make_setup(a.config, a.dtype, torch.device("cuda"), "cuda", a.steps, 1, 0)
    rows = {}
    for mode in ("eager", "tgraph_layer"):
        rows[mode] = probe(s, mode, a.steps)
        gc.collect()
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0), "config": a.config}
    (a.out / "probe_layer_memory.json").write_text(json.dumps({"meta": meta, **rows}, indent=1))
    for mode, r in rows.items():
        print(mode, r.get("report", ""))
        for k, v in r["phases"].items():
            print(f"  {k:20s} peak {v[0]:9.1f}  after {v[1]:9.1f} MiB")


if __name__ == "__main__":
    main()
