"""Where per-layer graphs' memory goes on a GPU: tgraph.memory_report() against the allocator.

    python scripts/probe_memory.py --configs tiny,small --out probe_memory.json

For each config (the training benchmark's shapes, fp32, AdamW fused): one eager step (the
recorded iteration), then ``create_graphs()``, then steps. Reports, in MiB: allocated before
capture, after it, the peak during it (capture and warmup), the eager step's peak, the steady
peak of graphed steps, and the report's kinds; ``held`` (the buffers' sizes) is checked against
what capture left allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

import tgraph
from tgraph.toy.gpt import GPT, GPTConfig

CONFIGS = {
    "tiny": dict(n_layer=12, n_embd=256, n_head=4, seq=128, batch=8),
    "small": dict(n_layer=24, n_embd=512, n_head=8, seq=256, batch=8),
}
MIB = 2**20


def probe(name: str, dims: dict, merge: bool) -> dict:
    torch.manual_seed(0)
    seq, batch = dims["seq"], dims["batch"]
    cfg = GPTConfig(
        vocab_size=1024,
        block_size=seq,
        n_layer=dims["n_layer"],
        n_head=dims["n_head"],
        n_embd=dims["n_embd"],
    )
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 1024, (batch, seq), device="cuda")
    y = torch.randint(0, 1024, (batch, seq), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()

    tgraph.enable(model, merge=merge)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()  # recorded, eager
    torch.cuda.synchronize()
    eager_peak = torch.cuda.max_memory_allocated() - base
    opt.zero_grad(set_to_none=True)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    report = tgraph.create_graphs()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    capture_peak = torch.cuda.max_memory_allocated() - base
    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    steady_peak = torch.cuda.max_memory_allocated() - base
    mem = dataclasses.asdict(report.memory)
    out = {
        "config": name,
        "merge": merge,
        "eager_step_peak_mib": eager_peak / MIB,
        "capture_peak_mib": capture_peak / MIB,
        "graphed_step_peak_mib": steady_peak / MIB,
        "allocated_by_capture_mib": (after - before) / MIB,
        "held_mib": report.memory.held / MIB,
        "kinds_mib": {k: v / MIB for k, v in mem.items() if k != "units"},
        "units": mem["units"],
        "report": str(report),
    }
    tgraph.reset()
    tgraph.disable(model)
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny,small")
    p.add_argument("--out", default="probe_memory.json")
    a = p.parse_args()
    rows = [probe(c, CONFIGS[c], merge) for c in a.configs.split(",") for merge in (True, False)]
    for r in rows:
        print(json.dumps({k: v for k, v in r.items() if k != "report"}))
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
