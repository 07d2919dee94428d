"""Does torch AdamW capturable=True vs False alone move a 60-step run's loss by percents? (toy GPT, H200)

python scripts/probe_adam_capturable.py
"""

import copy
import json

import torch

from tgraph.toy.gpt import GPT, GPTConfig

torch.manual_seed(0)
cfg = GPTConfig(vocab_size=1024, block_size=128, n_layer=12, n_head=4, n_embd=256)
base = GPT(cfg).cuda()
g = torch.Generator().manual_seed(1)
batches = [
    (
        torch.randint(0, 1024, (8, 128), generator=g).cuda(),
        torch.randint(0, 1024, (8, 128), generator=g).cuda(),
    )
    for _ in range(8)
]
out = {}
for name, kw in [
    ("foreach", dict(foreach=True)),
    ("capturable", dict(foreach=True, capturable=True)),
    ("fused", dict(fused=True)),
    ("foreach_again", dict(foreach=True)),
]:
    m = copy.deepcopy(base)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, **kw)
    losses = []
    for i in range(60):
        x, y = batches[i % 8]
        opt.zero_grad(set_to_none=True)
        loss = m(x, y)[1]
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out[name] = [losses[i] for i in (0, 9, 19, 39, 59)]
print(json.dumps(out, indent=1))
