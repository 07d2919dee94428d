"""Probe (issue 44, item 10): channels_last images after a capture on contiguous ones.

An eager stem, two graphed conv blocks, an eager head; graphs captured on contiguous images,
then from step 2 on, the images (``input``) or the whole model (``model``) in channels_last.
Per step, beside an eager twin: the largest difference of the gradient the graphs hand back
to the stem's output, its strides in both runs, and of every parameter's gradient. Writes
``probe_channels_last.json`` to $OUT.
"""

from __future__ import annotations

import copy
import json
import os
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import tgraph

warnings.simplefilter("ignore")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CL = torch.channels_last


class Blk(tgraph.GraphableModule):
    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + F.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(Blk(), Blk())
        self.head = nn.Linear(16, 10)
        self.seen: list[torch.Tensor] = []

    def forward(self, x):
        h = self.stem(x)
        h.register_hook(self.seen.append)
        return self.head(self.blocks(h).mean((2, 3)))


def run(model: Net, graphed: bool, variant: str) -> tuple[list[dict], int]:
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if graphed:
        tgraph.enable(model, backend="cuda" if DEV == "cuda" else "emulated")
    rows = []
    for i in range(5):
        x = torch.randn(8, 3, 16, 16, device=DEV)
        y = torch.randint(0, 10, (8,), device=DEV)
        if i >= 2:
            x = x.contiguous(memory_format=CL)
            if variant == "model" and i == 2:
                model.to(memory_format=CL)
        model.seen.clear()
        F.cross_entropy(model(x), y).backward()
        g = model.seen[0]
        rows.append(
            {
                "h_grad": g.clone(),
                "h_stride": tuple(g.stride()),
                "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
            }
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and i == 0:
            tgraph.create_graphs()
    calls = tgraph.eager_calls()
    tgraph.reset()
    return rows, calls


def main() -> None:
    out = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu"}
    for variant in ("input", "model"):
        torch.manual_seed(0)
        model = Net().to(DEV)
        twin = copy.deepcopy(model)
        want, _ = run(twin, False, variant)
        with tgraph.verification(first=0, every=0):  # the replays alone
            got, calls = run(model, True, variant)
        steps = []
        for i, (g, w) in enumerate(zip(got, want)):
            steps.append(
                {
                    "step": i,
                    "h_grad_diff": (g["h_grad"] - w["h_grad"]).abs().max().item(),
                    "h_stride": [g["h_stride"], w["h_stride"]],
                    "param_grad_diff": {
                        n: (g["grads"][n] - w["grads"][n]).abs().max().item() for n in g["grads"]
                    },
                }
            )
        out[variant] = {"eager_calls": calls, "steps": steps}
        print(variant, json.dumps(out[variant]))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "probe_channels_last.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
