"""Which allocations make the per-layer capture's peak? The allocator's own trace says.

    python scripts/probe_memory_trace.py --configs tiny --out trace.json [--pickle DIR]

Each (config, merge) runs in a fresh process (nothing allocated by an earlier case, no cuBLAS
workspace already made) with ``torch.cuda.memory._record_memory_history``: one eager step (the
recorded iteration), ``create_graphs()``, three graphed steps. The trace is replayed (alloc /
free_completed) to find each phase's peak and the blocks alive at it, grouped by the first
tgraph or script frame that allocated them and by stream. ``--pickle`` keeps the raw snapshots.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
from collections import defaultdict

import torch

CONFIGS = {
    "tiny": dict(n_layer=12, n_embd=256, n_head=4, seq=128, batch=8),
    "small": dict(n_layer=24, n_embd=512, n_head=8, seq=256, batch=8),
}
MIB = 2**20


def _site(frames: list[dict]) -> str:
    """Where a block came from: the innermost torch frame and the first two of ours."""
    ours = [
        f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
        for f in frames
        if "/tgraph/" in f["filename"] or "/scripts/" in f["filename"]
    ][:2]
    inner = next((f"{f['name']}" for f in frames if f["filename"].endswith(".py")), "<c++>")
    return " <- ".join([inner, *ours])


def _replay(events: list[dict], bounds: dict[str, tuple[int, int]]) -> dict:
    """Peak and live blocks at it, per phase [start, end) of the event list."""
    live: dict[int, dict] = {}
    total = 0
    out: dict[str, dict] = {}
    phase_of = sorted((s, e, name) for name, (s, e) in bounds.items())
    best: dict[str, tuple[int, int]] = {}
    for i, ev in enumerate(events):
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
        elif act == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
        for s, e, name in phase_of:
            if s <= i < e and total > best.get(name, (-1, 0))[0]:
                best[name] = (total, i)
    # second pass: the live set at each phase's peak index
    for name, (peak, idx) in best.items():
        live, total = {}, 0
        start_total = None
        s = bounds[name][0]
        for i, ev in enumerate(events[: idx + 1]):
            if i == s:
                start_total = total
            if ev["action"] == "alloc":
                live[ev["addr"]] = ev
                total += ev["size"]
            elif ev["action"] == "free_completed" and ev["addr"] in live:
                total -= live.pop(ev["addr"])["size"]
        groups: dict[str, int] = defaultdict(int)
        born_in_phase: dict[str, int] = defaultdict(int)
        big = []
        for ev in live.values():
            groups[f"stream {ev['stream']}: {_site(ev.get('frames', []))}"] += ev["size"]
        for ev in events[s : idx + 1]:
            if ev["action"] == "alloc" and live.get(ev["addr"]) is ev:
                born_in_phase[f"stream {ev['stream']}: {_site(ev.get('frames', []))}"] += ev["size"]
                if ev["size"] >= 4 * MIB:
                    big.append(
                        {
                            "mib": ev["size"] / MIB,
                            "stream": ev["stream"],
                            "frames": [
                                f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
                                for f in ev.get("frames", [])[:12]
                            ],
                        }
                    )
        top = sorted(groups.items(), key=lambda kv: -kv[1])[:30]
        top_new = sorted(born_in_phase.items(), key=lambda kv: -kv[1])[:30]
        out[name] = {
            "peak_mib": peak / MIB,
            "at_phase_start_mib": (start_total or 0) / MIB,
            "live_by_site_mib": {k: v / MIB for k, v in top},
            "born_in_phase_by_site_mib": {k: v / MIB for k, v in top_new},
            "big_blocks_born_in_phase": sorted(big, key=lambda b: -b["mib"])[:20],
        }
    return out


def child(config: str, merge: bool, pickle_dir: str | None) -> dict:
    import tgraph
    from tgraph.toy.gpt import GPT, GPTConfig

    dims = CONFIGS[config]
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=1024,
        block_size=dims["seq"],
        n_layer=dims["n_layer"],
        n_head=dims["n_head"],
        n_embd=dims["n_embd"],
    )
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 1024, (dims["batch"], dims["seq"]), device="cuda")
    y = torch.randint(0, 1024, (dims["batch"], dims["seq"]), device="cuda")

    def step():
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()

    tgraph.enable(model, merge=merge)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")

    def mark() -> int:
        torch.cuda.synchronize()
        return len(torch.cuda.memory._snapshot()["device_traces"][0])

    def alloc() -> float:
        return torch.cuda.memory_allocated() / MIB

    m0, a0 = mark(), alloc()
    step()
    opt.zero_grad(set_to_none=True)  # as README's loop: no stale .grad through the capture
    m1, a1 = mark(), alloc()
    report = tgraph.create_graphs()
    m2, a2 = mark(), alloc()
    for _ in range(3):
        step()
    m3, a3 = mark(), alloc()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    if pickle_dir:
        with open(os.path.join(pickle_dir, f"{config}_merge{int(merge)}.pickle"), "wb") as f:
            pickle.dump(snap, f)
    events = snap["device_traces"][0]
    phases = _replay(
        events, {"eager_step": (m0, m1), "create_graphs": (m1, m2), "graphed_steps": (m2, m3)}
    )
    return {
        "config": config,
        "merge": merge,
        "allocated_mib": {"start": a0, "after_eager": a1, "after_capture": a2, "after_steps": a3},
        "report": str(report),
        "phases": phases,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny")
    p.add_argument("--out", default="probe_memory_trace.json")
    p.add_argument("--pickle", default=None, help="folder for the raw snapshots")
    p.add_argument("--child", nargs=2, metavar=("CONFIG", "MERGE"))
    a = p.parse_args()
    if a.child:
        json.dump(child(a.child[0], a.child[1] == "1", a.pickle), sys.stdout)
        return
    rows = []
    for config in a.configs.split(","):
        for merge in ("1", "0"):
            cmd = [sys.executable, __file__, "--child", config, merge]
            if a.pickle:
                cmd += ["--pickle", a.pickle]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                rows.append({"config": config, "merge": merge, "error": res.stderr[-3000:]})
            else:
                rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1])[:2000], flush=True)
    meta = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
