"""Non-finite skipping in an optimizer graph: the mask way vs a CUDA-graph IF node (issue 16.2).

    python scripts/probe_conditional_skip.py --out probe_conditional_skip.json

On CUDA, for the toy GPT's "small" shape (24 layers, width 512, vocab 1024: about 77M
parameters) and two optimizers, torch's fused AdamW and its foreach AdamW (both
``capturable=True``), an :class:`tgraph.OptimizerGraph` (clipping at 1.0) is captured with
``skip_nonfinite_how`` "mask", "conditional", and without skipping ("off", the floor); then
``--replays`` steps (default 200) are timed with a finite loss and again with a NaN loss (every
step skipped). Per step: GPU milliseconds (CUDA events around the whole run) and host
microseconds (wall clock of the ``step()`` calls, before the final synchronize). Also recorded:
how the captured step skips (``found_inf``, ``snapshot`` or ``if_node``), the device memory the
capture added (Adam's state excluded: it exists before), whether the parameters stayed bitwise
unchanged over the NaN steps, and the skip counter. Where torch builds no IF nodes (torch 2.11)
the "conditional" rows are left out and the script says why: "conditional nodes unavailable:
<reason>". Exit status 0 when it measured, 1 without a CUDA device.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # bench_common, and tgraph uninstalled

from bench_common import environment  # noqa: E402

import tgraph  # noqa: E402
from tgraph.nonfinite import conditional_nodes_unavailable  # noqa: E402
from tgraph.toy.gpt import GPT, GPTConfig  # noqa: E402

SMALL = GPTConfig(vocab_size=1024, block_size=256, n_layer=24, n_head=8, n_embd=512)
BATCH = 8


def make_optimizer(model: torch.nn.Module, kind: str) -> torch.optim.Optimizer:
    fused = {"fused": True} if kind == "fused" else {"foreach": True}
    return torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.1, capturable=True, **fused
    )


def _time_steps(graph: tgraph.OptimizerGraph, loss: torch.Tensor, n: int) -> dict[str, float]:
    for _ in range(10):  # settle clocks and caches
        graph.step(loss)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.step(loss)
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return {
        "gpu_ms_per_step": round(start.elapsed_time(end) / n, 4),
        "host_us_per_step": round(host / n * 1e6, 2),
    }


def time_optimizer_graph(opt_kind: str, how: str, replays: int = 200) -> dict[str, Any]:
    """One optimizer graph (``how``: "mask", "conditional" or "off"), timed over ``replays``
    finite steps and ``replays`` NaN steps."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = GPT(SMALL).to(device)
    opt = make_optimizer(model, opt_kind)
    g = torch.Generator().manual_seed(1)
    x, y = (
        torch.randint(0, SMALL.vocab_size, (BATCH, SMALL.block_size), generator=g).to(device)
        for _ in range(2)
    )
    loss = model(x, y)[1].detach()
    model(x, y)[1].backward()
    graph = tgraph.OptimizerGraph(
        opt,
        clip_grad_norm=1.0,
        skip_nonfinite=how != "off",
        skip_nonfinite_how="auto" if how == "off" else how,
        zero_grad=False,  # the same .grad tensors at every step: nothing is copied in
    )
    graph.step(loss)  # eager: creates Adam's state
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph.step(loss)  # captured (and replayed once)
    torch.cuda.synchronize()
    assert graph.captured, "the optimizer graph was not captured"
    row: dict[str, Any] = {
        "optimizer": f"AdamW {opt_kind} capturable",
        "how": how,
        "captured_way": graph.guard.last_way if graph.guard is not None else None,
        "capture_added_mib": round((torch.cuda.memory_allocated() - before) / 2**20, 1),
        "params": sum(p.numel() for p in model.parameters()),
    }
    row["finite"] = _time_steps(graph, loss, replays)
    params = [p.detach().clone() for p in model.parameters()]
    skipped_before = graph.skipped_steps
    row["nonfinite"] = _time_steps(graph, torch.full_like(loss, float("nan")), replays)
    if graph.guard is not None:
        row["nonfinite"]["skipped"] = graph.skipped_steps - skipped_before
        row["nonfinite"]["params_unchanged"] = all(
            torch.equal(p, q) for p, q in zip(model.parameters(), params)
        )
    graph.reset()
    del graph, opt, model, params
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args()
    result: dict[str, Any] = {"replays": args.replays, "model": SMALL.to_dict(), "batch": BATCH}
    if not torch.cuda.is_available():
        result["error"] = "no CUDA device: nothing measured"
        print(result["error"])
        _write(args.out, result)
        return 1
    result["env"] = environment(torch.device("cuda"))
    reason = conditional_nodes_unavailable("cuda")
    result["conditional_nodes"] = {"available": reason is None, "reason": reason}
    if reason is not None:
        print(f"conditional nodes unavailable: {reason}")
    hows = ["off", "mask"] + (["conditional"] if reason is None else [])
    rows = []
    for opt_kind in ("fused", "foreach"):
        for how in hows:
            try:
                rows.append(time_optimizer_graph(opt_kind, how, args.replays))
            except Exception as exc:  # noqa: BLE001 - record and go on with the next row
                rows.append(
                    {"optimizer": opt_kind, "how": how, "error": f"{type(exc).__name__}: {exc}"}
                )
            print(json.dumps(rows[-1]), flush=True)
    result["runs"] = rows
    print()
    print(f"{'optimizer':26} {'how':12} {'way':10} {'finite ms':>10} {'NaN ms':>8} {'+MiB':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['optimizer']:26} {r['how']:12} error: {r['error'][:80]}")
            continue
        print(
            f"{r['optimizer']:26} {r['how']:12} {r['captured_way'] or '-':10} "
            f"{r['finite']['gpu_ms_per_step']:10.3f} {r['nonfinite']['gpu_ms_per_step']:8.3f} "
            f"{r['capture_added_mib']:7.1f}"
        )
    _write(args.out, result)
    return 0


def _write(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
