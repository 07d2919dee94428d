"""Prefill graphs by token-count bucket: padding never changes a prompt's result,
long prompts prefill eagerly, and the prefill graphs live in the decode graphs' pool.

Exactness: a graphed prefill and the eager prefill of the same bucket run the same program on
the same padded shapes, so their logits are bitwise equal. Against an unpadded prefill (another
sequence length: other kernel blocking) they agree to fp32 rounding, and greedy tokens exactly.
"""

from __future__ import annotations

import pytest
import torch
from decode_models import prompts, tiny_gpt

from tgraph.decode import DecodeEngine
from tgraph.decode.requests import Request
from tgraph.toy import gpt_decode as gpt_decoder

LENGTHS = (1, 5, 16, 17, 40)  # bucket 16, exactly 16, the next bucket, above the largest


def prefill_logits(engine: DecodeEngine, ps: list[list[int]]) -> torch.Tensor:
    out = []
    for p in ps:
        out.append(engine.prefill(Request(0, p, 1, False, slot=0)).clone())
    return torch.stack(out)


def long_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(1, 256, (n,), generator=g).tolist() for n in LENGTHS]


def test_prefill_graphs_match_eager_and_ignore_padding(backend, device):
    model = tiny_gpt(device)
    ps = long_prompts()
    kw = dict(max_batch_size=2, max_seq_len=64, prefill_sizes=[16, 32])
    graphed = DecodeEngine(model, backend=backend, progress=False, **kw)
    got = prefill_logits(graphed, ps)
    assert graphed.stats.prefill_bucket_steps == {16: 3, 32: 1}
    assert graphed.stats.prefill_eager == 1  # 40 tokens: above the largest bucket
    padded_eager = prefill_logits(DecodeEngine(model, use_graphs=False, **kw), ps)
    assert torch.equal(got, padded_eager)  # same program, same shapes: bitwise
    unpadded = DecodeEngine(
        model, max_batch_size=2, max_seq_len=64, use_graphs=False, prefill_sizes=[]
    )
    torch.testing.assert_close(got, prefill_logits(unpadded, ps), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        full = torch.stack([model(torch.tensor([p], device=device))[0][0, -1] for p in ps])
    torch.testing.assert_close(got, full, atol=1e-4, rtol=1e-4)


def test_generate_with_prefill_graphs_gives_eager_tokens(backend, device):
    """Greedy and seeded-sampled tokens equal those of unpadded eager prefill."""
    model = tiny_gpt(device)
    ps = prompts(4, lengths=(3, 16, 20, 9))
    graphed = DecodeEngine(model, max_batch_size=4, max_seq_len=64, backend=backend, progress=False)
    eager = DecodeEngine(
        model, max_batch_size=4, max_seq_len=64, use_graphs=False, prefill_sizes=[]
    )
    assert graphed.generate(ps, 10) == eager.generate(ps, 10)
    kw = dict(temperature=0.8, top_p=0.9, seed=3)
    assert graphed.generate(ps, 10, **kw) == eager.generate(ps, 10, **kw)
    assert graphed.stats.prefills == 4 and graphed.stats.prefill_eager == 0


class _LeakyF:
    """Planted bug: attention over the padded prompt without the causal mask, so the prompt's
    positions attend to the padding (and to each other's future)."""

    def __getattr__(self, name):
        return getattr(torch.nn.functional, name)

    @staticmethod
    def scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)


def test_padding_leaking_into_the_prompt_is_caught(backend, device, monkeypatch):
    model = tiny_gpt(device)
    ps = long_prompts()[:2]
    unpadded = DecodeEngine(
        model, max_batch_size=1, max_seq_len=64, use_graphs=False, prefill_sizes=[]
    )
    want = prefill_logits(unpadded, ps)
    monkeypatch.setattr(gpt_decoder, "F", _LeakyF())
    graphed = DecodeEngine(model, max_batch_size=1, max_seq_len=64, backend=backend, progress=False)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        torch.testing.assert_close(prefill_logits(graphed, ps), want, atol=1e-5, rtol=1e-5)


def test_prefill_and_decode_graphs_share_one_pool_and_report_memory(backend, device):
    model = tiny_gpt(device)
    engine = DecodeEngine(model, max_batch_size=4, max_seq_len=64, backend=backend, progress=False)
    assert engine.prefill_graphs.factory is engine.decode_graphs.factory is engine.factory
    decode = [g.index for g, _ in engine.decode_graphs.graphs.values()]
    prefill = [g.index for g, _ in engine.prefill_graphs.graphs.values()]
    assert sorted(decode + prefill) == list(range(1, len(decode) + len(prefill) + 1))
    assert max(decode) < min(prefill)  # one pool, one capture order: decode first
    st = engine.stats
    assert set(st.graph_bytes) == {
        f"{kind} {size} {variant}"
        for kind, sizes in (("decode", [1, 2, 4]), ("prefill", [16, 32, 64]))
        for size in sizes
        for variant in ("greedy", "sampling")
    }
    if backend == "cuda":
        assert st.pool_bytes > 0 and all(b >= 0 for b in st.graph_bytes.values())


def test_pool_hazard_modelled_and_avoided(device):
    """On the emulated pool, a prefill graph's logits (captured after the decode graphs) are
    overwritten by the next decode replay, as a CUDA pool may; the engine reads only the token
    the prefill program wrote outside the pool."""
    model = tiny_gpt(device)
    engine = DecodeEngine(
        model, max_batch_size=2, max_seq_len=64, backend="emulated", progress=False
    )
    r = Request(0, [5, 6, 7], 4, False, slot=0)
    logits = engine.prefill(r)
    first = engine.prompt_buffers.token.tolist()[0]
    assert first == int(logits.argmax())
    r.output.append(first)
    engine.decode([r])
    assert torch.isnan(logits).all()  # the hazard, modelled
    assert engine.prompt_buffers.token.tolist()[0] == first  # outside the pool: intact
