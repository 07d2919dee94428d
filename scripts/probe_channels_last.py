"""Probe (issue 44 item 10): channels_last images after a capture on contiguous ones. Which tensor
is wrong: the input gradient a graph hands back, its strides, or a parameter gradient?"""

import copy, json, os, sys, warnings
import torch, torch.nn as nn, torch.nn.functional as F
import tgraph

warnings.simplefilter("ignore")
dev = "cuda"


class Blk(tgraph.GraphableModule):
    def __init__(self, c=16):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return x + F.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.blocks = nn.Sequential(Blk(), Blk())
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        h = self.stem(x)
        h.register_hook(lambda g: seen.append(g))
        return self.head(self.blocks(h).mean((2, 3)))


seen = []


def run(model, graphed, fmt_step, backend="cuda"):
    torch.manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if graphed:
        tgraph.enable(model, backend=backend)
    res = []
    for i in range(4):
        x = torch.randn(8, 3, 16, 16, device=dev)
        y = torch.randint(0, 10, (8,), device=dev)
        if i >= fmt_step:
            x = x.contiguous(memory_format=torch.channels_last)
        seen.clear()
        F.cross_entropy(model(x), y).backward()
        g = seen[0]
        res.append(
            dict(
                step=i,
                stem_grad=model.stem.weight.grad.clone(),
                h_grad=g.clone(),
                h_grad_stride=tuple(g.stride()),
                grads={n: p.grad.clone() for n, p in model.named_parameters()},
            )
        )
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and i == 0:
            tgraph.create_graphs()
    ec = tgraph.eager_calls()
    tgraph.reset()
    return res, ec


out = {}
for variant in ("input_channels_last", "model_channels_last"):
    torch.manual_seed(0)
    m = Net().to(dev)
    e = copy.deepcopy(m)
    if variant == "model_channels_last":
        pass
    want, _ = run(e, False, 2)
    got, ec = run(m, True, 2)
    rows = []
    for g, w in zip(got, want):
        rows.append(
            dict(
                step=g["step"],
                h_grad_diff=(g["h_grad"] - w["h_grad"]).abs().max().item(),
                h_grad_stride=[g["h_grad_stride"], w["h_grad_stride"]],
                param_diffs={
                    n: (g["grads"][n] - w["grads"][n]).abs().max().item() for n in g["grads"]
                },
            )
        )
    out[variant] = dict(eager_calls=ec, rows=rows)
    print(variant, json.dumps(out[variant])[:1500])
od = os.environ.get("OUT", "/tmp")
json.dump(out, open(os.path.join(od, "probe_channels_last.json"), "w"), indent=1)
