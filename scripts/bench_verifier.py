"""What the shadow verifier costs a training step (issue 44): the toy GPT with per-layer graphs,
side by side in one process, under four settings of ``tgraph.verification``:

* ``off``: nothing verified (``first=0, every=0``), the floor;
* ``default``: each graph's first 2 replays, then one in 1000 (the default);
* ``every_100``: one in 100;
* ``every_1``: every replay (the worst case: an eager rerun per call).

Each setting gets a fresh model, its recorded step, ``create_graphs()`` and ``--steps`` timed
steps (a synchronize per step), ``--repeat`` rounds interleaved; median ms per step and the
ratio against ``off``. Also plain eager, for scale. Writes ``bench_verifier.json`` to --out.

    python scripts/bench_verifier.py --device cuda --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import environment, synchronize  # noqa: E402

import tgraph  # noqa: E402
from tgraph.toy.gpt import GPT, GPTConfig  # noqa: E402

SETTINGS = {
    "eager": None,
    "off": dict(first=0, every=0),
    "default": dict(first=2, every=1000),
    "every_100": dict(first=2, every=100),
    "every_1": dict(first=2, every=1),
}


def run(name: str, device: torch.device, steps: int, batch: int) -> float:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=6, n_head=4, n_embd=128)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=device.type == "cuda")
    x = torch.randint(0, 256, (batch, 64), device=device)
    y = torch.randint(0, 256, (batch, 64), device=device)
    setting = SETTINGS[name]
    if setting is not None:
        tgraph.enable(model, backend="cuda" if device.type == "cuda" else "emulated")

    def step() -> None:
        logits = model(x)[0]
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with tgraph.verification(**(setting or {})):
        step()
        if setting is not None:
            tgraph.create_graphs()
        for _ in range(5):
            step()
        times = []
        for _ in range(steps):
            synchronize(device)
            t0 = time.perf_counter()
            step()
            synchronize(device)
            times.append((time.perf_counter() - t0) * 1e3)
    eager = tgraph.eager_calls()
    tgraph.reset()
    if setting is not None and eager:
        raise RuntimeError(f"{name}: {eager} eager calls; the benchmark must replay")
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    device = torch.device(args.device)
    medians: dict[str, list[float]] = {k: [] for k in SETTINGS}
    for _ in range(args.repeat):
        for name in SETTINGS:
            medians[name].append(run(name, device, args.steps, args.batch))
    ms = {k: statistics.median(v) for k, v in medians.items()}
    result = {
        "env": environment(device),
        "model": "toy GPT, 6 layers, d=128, T=64, AdamW, per-layer graphs",
        "batch": args.batch,
        "steps": args.steps,
        "repeat": args.repeat,
        "ms_per_step": ms,
        "ratio_vs_off": {k: ms[k] / ms["off"] for k in ms},
    }
    print(json.dumps(result, indent=1))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_verifier.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
