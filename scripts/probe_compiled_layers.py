"""Probe: per-layer graphs over compiled Hugging Face Llama layers on CUDA
(``tgraph.enable(model, compile=True)``). Prints dynamo's frame counters after each stage and,
with ``TORCH_LOGS=recompiles``, why dynamo recompiles (the H200 run of 2026-12-02 failed there:
inductor compiled inside the capture). Usage: python scripts/probe_compiled_layers.py [layers]
"""

from __future__ import annotations

import os
import sys

sys.path[:0] = [
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    os.path.dirname(__file__),
]

import torch  # noqa: E402
from bench_llama import LlamaLM  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

import tgraph  # noqa: E402


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = LlamaLM(dict(n_layer=layers, n_embd=256, n_head=4, seq=128), 1024).to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    tgraph.enable(model, backend="cuda", compile=True)
    x = torch.randint(0, 1024, (1, 128), device=dev)

    def step():
        loss = model(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    step()
    print("frames after the recorded step", dict(counters["frames"]), flush=True)
    try:
        print(tgraph.create_graphs())
    except Exception as exc:  # noqa: BLE001 - the probe reports it
        print("create_graphs failed:", type(exc).__name__, str(exc)[:600], flush=True)
    print("frames after create_graphs", dict(counters["frames"]), flush=True)
    print("loss", float(step()), "frames", dict(counters["frames"]), flush=True)


if __name__ == "__main__":
    main()
