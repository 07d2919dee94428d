"""The tiny GPT, the prompts and the engine pair shared by the decode tests."""

from __future__ import annotations

import torch

from tgraph.decode import DecodeEngine
from tgraph.toy.gpt import GPT, GPTConfig

CFG = dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32)


def tiny_gpt(device: torch.device, seed: int = 0) -> GPT:
    """A tiny GPT with large random weights: varied, position-dependent tokens, wide logit gaps
    (so no argmax near-ties between differently shaped but equivalent computations)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.to(device)


def prompts(n: int, lengths=(3, 7, 1, 12, 5)) -> list[list[int]]:
    """n prompts of different lengths; first token never 0 (the padded rows' token)."""
    g = torch.Generator().manual_seed(n)
    return [
        torch.randint(1, 256, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)
    ]


def engines(model, backend: str, **kw) -> tuple[DecodeEngine, DecodeEngine]:
    """The same model served with graphs (on ``backend``) and eagerly, same shapes."""
    graphed = DecodeEngine(model, use_graphs=True, backend=backend, progress=False, **kw)
    eager = DecodeEngine(model, use_graphs=False, **kw)
    return graphed, eager


def recaptures(engine: DecodeEngine) -> list[int]:
    """Counts the engine's re-captures (generate() calls recapture() itself)."""
    count = [0]
    recapture = engine.recapture

    def counted() -> None:
        count[0] += 1
        recapture()

    engine.recapture = counted
    return count
