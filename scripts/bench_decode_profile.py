"""torch.profiler tables of the decode benchmark's hand-written graph and DecodeEngine graphs
(scripts/bench_decode.py ``--profile-batch``)."""

from __future__ import annotations

import os

from bench_common import synchronize
from bench_decode_hand import HandStep, StaticKV
from bench_decode_setup import Bench, make_engine


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
    engine = make_engine(b, batch, True)
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
