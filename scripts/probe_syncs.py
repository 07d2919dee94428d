"""Where a training step of HF Llama makes the host wait for the GPU (a host sync).

One steady step per mode (eager, per-layer graphs, the whole model as one unit) of the
benchmark's Llama (``bench_llama.py``, batch 1) runs under
``torch.cuda.set_sync_debug_mode("warn")``; each warning is printed with the frames that led to
it, and a JSON (``--out``) keeps the count per mode and the innermost frames of each. A sync in
the forward stalls the host until the GPU has drained the previous step: whatever the host does
after it, up to the next long GPU work, is then GPU idle time in every step.

    python scripts/probe_syncs.py --out docs/benchmarks/<date>_<gpu>_<tree>_syncs.json
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_llama import LLAMA_CONFIGS, LlamaLM  # noqa: E402

import tgraph  # noqa: E402


def _step(model, opt, x, y):
    _, loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _syncs(model, opt, x, y) -> list[list[str]]:
    """The frames (innermost last) of every host sync in one step."""
    found: list[list[str]] = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # set_sync_debug_mode's own "prototype" warning
            return
        frames = [
            f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")
        ]
        found.append(
            [
                f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.lineno} {f.name}"
                for f in frames[-8:]
            ]
        )

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on the way out
            warnings.simplefilter("always")
            warnings.showwarning = record
            _step(model, opt, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe_syncs.json")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (emulated graphs, no syncs)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit(
            "probe_syncs.py needs a CUDA GPU (set_sync_debug_mode); --device cpu dry-runs"
        )
    d = LLAMA_CONFIGS["llama_b1"]
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 1024, (d["batch"], d["seq"]), generator=gen).to(dev)
    y = torch.randint(0, 1024, (d["batch"], d["seq"]), generator=gen).to(dev)
    gpu = torch.cuda.get_device_name() if cuda else None
    result = {"torch": torch.__version__, "gpu": gpu, "modes": {}}
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass
    for mode in ("eager", "per-layer", "whole"):
        torch.manual_seed(0)
        model = LlamaLM(dict(d), 1024).to(dev)
        extra = dict(capturable=True) if cuda else {}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, **extra)
        if mode == "whole":  # HF's forward and the loss as one unit, as bench_train.py's
            model.__class__ = tgraph.GraphableModule.of(type(model))
        if mode != "eager":
            tgraph.enable(model, backend="cuda" if cuda else "emulated")
        _step(model, opt, x, y)
        if mode != "eager":
            tgraph.create_graphs()
        for _ in range(3):
            _step(model, opt, x, y)
        before = tgraph.eager_calls()
        syncs = _syncs(model, opt, x, y) if cuda else []
        result["modes"][mode] = {
            "syncs": len(syncs),
            "eager_calls_in_step": tgraph.eager_calls() - before,
            "where": syncs,
        }
        print(f"== {mode}: {len(syncs)} host sync(s) in a steady step")
        for frames in syncs:
            print("   " + "\n   ".join(frames[-5:]))
        tgraph.reset()
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
