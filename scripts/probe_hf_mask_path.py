"""Whether HF Llama's training step gives the same numbers on transformers' capture path.

Under CUDA stream capture, transformers' mask code (``masking_utils``) skips its host syncs
and builds an explicit mask where eager passes ``is_causal`` to SDPA. A graph of the whole
model takes that path; this probe runs the stock step both ways (``is_current_stream_capturing``
answered True for the second) and reports whether losses and gradients are bit for bit equal.
"""

from __future__ import annotations

import argparse
import json
import unittest.mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def run(dtype, batch, capture_path: bool, steps: int = 3):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    m = LlamaForCausalLM(cfg).to(DEV).to(dtype)
    g = torch.Generator(device=DEV).manual_seed(1)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 512, (batch, 128), device=DEV, generator=g)
        ctx = (
            unittest.mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True)
            if capture_path
            else unittest.mock.patch.object(torch, "_dummy_", None, create=True)
        )
        with ctx:
            loss = m(input_ids=x, labels=x, use_cache=False).loss
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.clone() for p in m.parameters()]))
        m.zero_grad(set_to_none=True)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="probe_hf_mask_path.json")
    a = p.parse_args()
    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        for batch in (1, 8):
            e, c = run(dtype, batch, False), run(dtype, batch, True)
            same_loss = all(torch.equal(x[0], y[0]) for x, y in zip(e, c))
            same_grad = all(torch.equal(u, v) for x, y in zip(e, c) for u, v in zip(x[1], y[1]))
            diff = max(float((x[0].float() - y[0].float()).abs()) for x, y in zip(e, c))
            res[f"{dtype}_b{batch}"] = {
                "loss_equal": same_loss,
                "grads_equal": same_grad,
                "max_loss_diff": diff,
            }
    print(json.dumps(res, indent=1))
    json.dump(res, open(a.out, "w"), indent=1)


if __name__ == "__main__":
    main()
