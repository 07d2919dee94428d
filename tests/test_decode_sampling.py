"""Sampling inside the decode graphs: the draws follow the distribution, and a seeded request
yields the same tokens whatever slot, bucket and company it runs in.

Why token equality across batch shapes holds: a request's draw depends only on its seed, its
position and its logits (tgraph.decode.sampling). Its logits in another batch shape can differ
in the last bits (other kernel blocking), which could flip a draw only where two perturbed
logits tie within ~1e-6; the tiny GPT's wide logit gaps make that negligible, as for greedy.
"""

from __future__ import annotations

import pytest
import torch
from decode_models import prompts, tiny_gpt

from tgraph.decode import DecodeEngine
from tgraph.decode.sampling import Sampler, SamplingRows, seed_key

SAMPLE = dict(temperature=0.9, top_k=40, top_p=0.95)


def rows(n: int, *, temperature=1.0, top_k=6, top_p=1.0, keys=None) -> SamplingRows:
    keys = torch.tensor([seed_key(i) for i in range(n)] if keys is None else keys)
    return SamplingRows(
        torch.full((n,), temperature),
        torch.full((n,), top_k, dtype=torch.int64),
        torch.full((n,), top_p),
        keys,
    )


def frequencies(tokens: torch.Tensor, V: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).float() / tokens.numel()


def test_draws_follow_softmax_top_k_and_top_p():
    """4000 streams draw from one row of logits: frequencies within 0.03 of the target
    (3.5 standard deviations of a proportion at n=4000 is at most 0.028)."""
    V, n = 6, 4000
    sampler = Sampler(V, "cpu")
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(n, V)
    counters = torch.full((n,), 7)
    got = frequencies(sampler(logits, rows(n, temperature=0.7), counters), V)
    torch.testing.assert_close(got, torch.softmax(logits[0] / 0.7, -1), atol=0.03, rtol=0)
    got = frequencies(sampler(logits, rows(n, top_k=2), counters), V)
    torch.testing.assert_close(got, torch.tensor([0.731, 0.269, 0, 0, 0, 0]), atol=0.03, rtol=0)
    probs = torch.softmax(logits[0], -1)  # 0.56, 0.21, 0.13, 0.08, ...: the 0.8 nucleus has 3
    got = frequencies(sampler(logits, rows(n, top_p=0.8), counters), V)
    torch.testing.assert_close(got[:3], probs[:3] / probs[:3].sum(), atol=0.03, rtol=0)
    assert got[3:].sum() == 0


def test_draw_depends_on_seed_and_position_only():
    """The same (seed, position) draws the same token in any row and batch; greedy rows are
    exactly the argmax."""
    V = 50
    sampler = Sampler(V, "cpu")
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, V, generator=g)
    keys = [seed_key(s) for s in (11, 12, 13, 14, 15, 16, 17, 18)]
    counters = torch.arange(8) + 3
    full = sampler(logits, rows(8, top_k=V, keys=keys), counters)
    perm = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    shuffled = sampler(logits[perm], rows(8, top_k=V, keys=[keys[i] for i in perm]), counters[perm])
    assert shuffled.tolist() == full[perm].tolist()
    alone = sampler(logits[3:4], rows(1, top_k=V, keys=keys[3:4]), counters[3:4])
    assert alone.tolist() == full[3:4].tolist()
    greedy = sampler(logits, rows(8, temperature=0.0, keys=keys), counters)
    assert greedy.tolist() == logits.argmax(-1).tolist()
    later = sampler(logits, rows(8, top_k=V, keys=keys), counters + 1)
    assert later.tolist() != full.tolist()  # another position: another draw


# (requests, max_batch_size, max_new_tokens): across the 4 -> 8 bucket boundary while requests
# finish, and requests joining and leaving through 3 slots (rows move as slots compact).
SCENARIOS = {
    "bucket_boundary": (6, 8, [9, 3, 14, 6, 11, 2]),
    "join_and_leave": (7, 3, [5, 16, 9, 1, 12, 6, 10]),
}


def alone(model, device, ps, limits, seeds, **sampling) -> list[list[int]]:
    """Each request on its own: batch 1, slot 0, eager."""
    engine = DecodeEngine(model, max_batch_size=1, max_seq_len=64, use_graphs=False)
    return [
        engine.generate([p], [n], seed=[s], **sampling)[0] for p, n, s in zip(ps, limits, seeds)
    ]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_seeded_request_same_tokens_in_any_slot_bucket_and_company(backend, device, scenario):
    n, max_bs, limits = SCENARIOS[scenario]
    model = tiny_gpt(device)
    ps = prompts(n)
    seeds = [100 + 7 * i for i in range(n)]
    want = alone(model, device, ps, limits, seeds, **SAMPLE)
    graphed = DecodeEngine(
        model, max_batch_size=max_bs, max_seq_len=64, backend=backend, progress=False
    )
    assert graphed.generate(ps, limits, seed=seeds, **SAMPLE) == want
    assert graphed.stats.sampling_steps == graphed.stats.decode_steps > 0
    assert len(graphed.stats.bucket_steps) >= 2  # the batch crossed buckets
    # Reversed order: every request lands in another slot, next to other requests.
    rev = graphed.generate(ps[::-1], limits[::-1], seed=seeds[::-1], **SAMPLE)
    assert rev[::-1] == want
    # An int seed s gives request i the stream s + i.
    assert (
        graphed.generate(ps, limits, seed=100, **SAMPLE)[2]
        == alone(model, device, ps[2:3], limits[2:3], [102], **SAMPLE)[0]
    )


def test_mixed_greedy_and_sampled_rows(backend, device):
    """Greedy requests next to sampled ones (the sampling variant of the graph) get exactly the
    tokens of an all-greedy run of the same batch: bitwise-equal logits, the same argmax."""
    model = tiny_gpt(device)
    ps = prompts(4)
    kw = dict(max_batch_size=4, max_seq_len=64)
    graphed = DecodeEngine(model, backend=backend, progress=False, **kw)
    eager = DecodeEngine(model, use_graphs=False, **kw)
    temps = [0.0, 1.0, 0.0, 0.7]
    mixed = graphed.generate(ps, 12, temperature=temps, seed=5)
    assert mixed == eager.generate(ps, 12, temperature=temps, seed=5)
    all_greedy = graphed.generate(ps, 12)
    assert mixed[0] == all_greedy[0] and mixed[2] == all_greedy[2]
    assert mixed[1] != all_greedy[1] or mixed[3] != all_greedy[3]


def test_a_temperature_too_small_for_float32_gives_the_greedy_token():
    """Logits / T overflowing float32 (T = 1e-45 rounds to the smallest subnormal): no
    distribution is left (softmax gives NaN), and its T -> 0 limit is the argmax, so the row
    returns greedy's id, whether the largest logit overflows to +inf or all of them to -inf,
    with any top-k / top-p. The other rows of the batch draw as they do alone."""
    V = 16
    sampler = Sampler(V, "cpu")
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 4
    logits[1] -= 100.0  # all negative: every logit / T overflows to -inf
    tiny = rows(4, temperature=1e-45, top_k=V, top_p=0.5)
    counters = torch.arange(4)
    assert sampler(logits, tiny, counters).tolist() == logits.argmax(-1).tolist()
    mixed = rows(4, top_k=V, top_p=0.9)
    mixed.temperature[2] = 1e-45
    drawn = sampler(logits, mixed, counters)
    assert drawn[2] == logits[2].argmax()
    normal = sampler(logits, rows(4, top_k=V, top_p=0.9), counters)
    assert drawn[[0, 1, 3]].tolist() == normal[[0, 1, 3]].tolist()


def test_a_tiny_temperature_decodes_the_greedy_tokens(backend, device, replays):
    """generate() with temperature 1e-45 next to sampled requests, on the graphs and eagerly:
    the tiny-temperature requests get the greedy tokens, the others their own draws."""
    model = tiny_gpt(device)
    ps = prompts(4)
    kw = dict(max_batch_size=4, max_seq_len=64)
    graphed = DecodeEngine(model, backend=backend, progress=False, **kw)
    eager = DecodeEngine(model, use_graphs=False, **kw)
    sampling = dict(top_k=[None, 40, 3, None], top_p=[1.0, 0.95, 0.5, 0.9], seed=5)
    before = replays[0]
    got = graphed.generate(ps, 12, temperature=[1e-45, 0.9, 1e-45, 0.9], **sampling)
    assert replays[0] - before >= 12 and graphed.stats.eager_steps == 0
    assert got == eager.generate(ps, 12, temperature=[1e-45, 0.9, 1e-45, 0.9], **sampling)
    greedy = eager.generate(ps, 12)
    drawn = eager.generate(ps, 12, temperature=[0.0, 0.9, 0.0, 0.9], **sampling)
    assert [got[0], got[2]] == [greedy[0], greedy[2]]
    assert [got[1], got[3]] == [drawn[1], drawn[3]]


def test_row_keyed_noise_is_caught(backend, device, monkeypatch):
    """Planted bug: the noise keyed by the row (as a batch-wide generator would be) instead of
    the request's seed. A request then draws differently in another slot or batch."""
    real = Sampler.noise

    def row_keyed(self, seed_keys, counters):
        return real(self, torch.arange(seed_keys.shape[0], device=seed_keys.device), counters)

    monkeypatch.setattr(Sampler, "noise", row_keyed)
    n, max_bs, limits = SCENARIOS["join_and_leave"]
    model = tiny_gpt(device)
    ps, seeds = prompts(n), list(range(n))
    want = alone(model, device, ps, limits, seeds, **SAMPLE)
    graphed = DecodeEngine(
        model, max_batch_size=max_bs, max_seq_len=64, backend=backend, progress=False
    )
    assert graphed.generate(ps, limits, seed=seeds, **SAMPLE) != want


def test_sampling_arguments_checked(device):
    engine = DecodeEngine(tiny_gpt(device), max_batch_size=2, max_seq_len=64, use_graphs=False)
    with pytest.raises(ValueError, match=r"request 1: top_p must be in \(0, 1\]"):
        engine.generate([[1], [2]], 3, temperature=1.0, top_p=[0.5, 0.0])
    with pytest.raises(ValueError, match="temperature has 3 entries for 2 prompts"):
        engine.generate([[1], [2]], 3, temperature=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="request 0: seed must be an int"):
        engine.generate([[1]], 3, temperature=1.0, seed=[1.5])
    with pytest.raises(ValueError, match="request 0: temperature must be >= 0"):
        engine.generate([[1]], 3, temperature=float("nan"))
