"""Graph-served decode: graphs == eager tokens, continuous batching, padding, planted bugs, errors.

Why exact token equality between graphs and eager: ``use_graphs=False`` runs the very same
decode-step function padded to the same bucket, so both paths run the same kernels on the same
shapes (the emulated backend literally re-runs the function; a CUDA graph replays the kernels
the eager call launched). Their logits are bitwise equal, so their argmax tokens are too.
"""

from __future__ import annotations

import pytest
import torch
from decode_models import CFG, engines, prompts, tiny_gpt

from tgraph.decode import DecodeBuffers, DecodeEngine
from tgraph.decode.batch import default_buckets
from tgraph.decode.requests import Request
from tgraph.guards import CaptureError
from tgraph.toy.gpt import GPT, GPTConfig, encode
from tgraph.toy.gpt_decode import GPTDecoder


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(3) == [1, 2, 3]
    assert default_buckets(8) == [1, 2, 4, 8]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert default_buckets(32) == [1, 2, 4, 8, 16, 24, 32]


# (number of requests, max_batch_size, max_new_tokens): batch 1, exactly a bucket (4),
# a bucket + 1 (5 -> padded to 8), 50 steps, and more requests than slots with different
# lengths (requests finish early, waiting ones join, the batch crosses buckets).
SCENARIOS = {
    "batch1": (1, 1, 20),
    "bucket": (4, 8, 20),
    "bucket_plus_1": (5, 8, 20),
    "50_steps": (3, 4, 50),
    "join_and_leave": (7, 3, [5, 30, 12, 1, 20, 8, 15]),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_greedy_graphs_match_eager(backend, device, scenario):
    n, max_bs, new = SCENARIOS[scenario]
    graphed, eager = engines(tiny_gpt(device), backend, max_batch_size=max_bs, max_seq_len=64)
    ps = prompts(n)
    out = graphed.generate(ps, new)
    assert out == eager.generate(ps, new)  # exact: see the module docstring
    limits = new if isinstance(new, list) else [new] * n
    assert [len(o) for o in out] == limits
    assert graphed.stats.eager_steps == 0
    assert graphed.stats.bucket_steps == eager.stats.bucket_steps
    if scenario == "join_and_leave":  # the running batch shrank and grew across buckets
        assert len(graphed.stats.bucket_steps) >= 2 and graphed.stats.prefills == n


def test_decode_matches_full_forward(backend, device):
    """Prefill + decode steps against recomputing ``model(idx)`` on the growing sequence.

    Different kernels (full causal attention vs one query over the cache): fp32 rounding only,
    so logits agree to 1e-4 and argmax tokens exactly (the weights give wide logit gaps; the
    assertion on the margin makes a near-tie visible instead of a mystery failure).
    """
    model = tiny_gpt(device)
    engine = DecodeEngine(model, max_batch_size=2, max_seq_len=64, backend=backend, progress=False)
    reqs = [
        Request(0, prompts(2)[0], 10, False, slot=0),
        Request(1, [9, 8, 7, 6], 10, False, slot=1),
    ]
    seqs = [list(r.prompt) for r in reqs]
    with torch.no_grad():
        for r in reqs:
            r.output.append(int(engine.prefill(r).argmax()))
        for _ in range(8):
            logits = engine.decode(reqs).clone()
            for i, r in enumerate(reqs):
                seqs[i].append(r.output[-1])
                ref = model(torch.tensor([seqs[i]], device=device))[0][0, -1]
                torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=1e-4)
                top2 = ref.topk(2).values
                assert top2[0] - top2[1] > 1e-3, "near-tie: pick another seed"
                r.output.append(int(ref.argmax()))
                assert int(logits[i].argmax()) == r.output[-1]


def test_positions_not_advanced_on_the_device_is_caught(backend, device, monkeypatch):
    """Planted bug: the step's device-side hand-off forgets to move positions on, so every step
    of a batch rewrites the same KV position. Graph tokens must diverge."""
    model = tiny_gpt(device)
    ps, new = prompts(3), 15
    expected = DecodeEngine(model, max_batch_size=4, max_seq_len=64, use_graphs=False).generate(
        ps, new
    )

    def no_position_advance(inputs, live, tokens):
        inputs.tokens.copy_(tokens)

    monkeypatch.setattr(DecodeBuffers, "advance", staticmethod(no_position_advance))
    graphed = DecodeEngine(model, max_batch_size=4, max_seq_len=64, backend=backend, progress=False)
    assert graphed.generate(ps, new) != expected


def test_buffers_reset_stale_tail(device):
    """A refresh rewrites every row: a shorter batch leaves no stale row behind."""
    from tgraph.decode.buffers import pack_step_rows

    buffers = DecodeBuffers(4, vocab_size=256, device=device)
    reqs = [Request(i, [5 + i] * (3 + i), 9, False, slot=i) for i in range(3)]
    for r in reqs:
        r.output.append(7 + r.index)
    buffers.copy_from(*pack_step_rows(reqs, max_rows=4, vocab_size=256))
    buffers.copy_from(*pack_step_rows(reqs[:1], max_rows=4, vocab_size=256))
    inputs = buffers.set_batch(4)
    assert inputs.tokens.tolist() == [7, 0, 0, 0]
    assert inputs.positions.tolist() == [3, 0, 0, 0]
    assert inputs.slots.tolist() == [0, 1, 2, 3]  # padding rows: their own (free) slots
    assert inputs.lengths.tolist() == [4, 1, 1, 1]
    assert buffers.live(4).tolist() == [1, 0, 0, 0]


def test_padding_rows_are_padding_at_every_step(backend, device):
    """A request leaves a batch of 4 (bucket 4 keeps running 3): from the next step on, its old
    row is a padding row again (not live, position 0, its own slot), so it neither advances nor
    writes past its slot's end; every step of the run is checked."""
    engine = DecodeEngine(
        tiny_gpt(device), max_batch_size=4, max_seq_len=64, backend=backend, progress=False
    )
    real_step = engine.step
    seen = []

    def checked_step(batch):
        pad = slice(batch.n, batch.width)
        rows = torch.arange(batch.width)[pad].tolist()
        assert engine.buffers.live(batch.width)[pad].tolist() == [0] * len(rows)
        inputs = engine.buffers.set_batch(batch.width)
        assert inputs.positions[pad].tolist() == [0] * len(rows)
        assert inputs.lengths[pad].tolist() == [1] * len(rows)
        assert inputs.slots[pad].tolist() == rows
        seen.append((batch.n, batch.width))
        return real_step(batch)

    engine.step = checked_step
    out = engine.generate(prompts(4), [3, 20, 20, 20])
    assert [len(o) for o in out] == [3, 20, 20, 20]
    assert (4, 4) in seen and (3, 4) in seen  # the batch shrank inside bucket 4


def _live_logits(engine: DecodeEngine, ps: list[list[int]]) -> torch.Tensor:
    """Prefill ``ps`` into slots 0.. and return the live rows' logits of 3 decode steps."""
    reqs = [Request(i, p, 5, False, slot=i) for i, p in enumerate(ps)]
    out = []
    for r in reqs:
        r.output.append(int(engine.prefill(r).argmax()))
    for _ in range(3):
        logits = engine.decode(reqs).clone()
        out.append(logits)
        for r, t in zip(reqs, logits.argmax(-1).tolist()):
            r.output.append(t)
    return torch.stack(out)


@pytest.mark.parametrize("plant_bug", [False, True])
def test_padded_rows_never_touch_live_slots(backend, device, monkeypatch, plant_bug):
    """3 live rows in bucket 4: the padded row must write only its own free slot (3).

    The free slot is poisoned with NaN, so a live row that reads it shows NaN. The planted bug
    points padded rows at slot 0 (a live request): its keys at position 0 are overwritten and
    its logits change, which the comparison with the unpadded eager run must catch. Tolerance:
    the reference runs 3 rows instead of a padded 4, so kernels may round differently (fp32,
    seen ~4e-6 on CPU); 1e-4 is far below the planted bug's effect (logits off by ~4).
    """
    model = tiny_gpt(device)
    ps = prompts(3)
    ref_engine = DecodeEngine(
        model, max_batch_size=4, max_seq_len=64, use_graphs=False, batch_sizes=[1]
    )
    reference = _live_logits(ref_engine, ps)  # 3 rows > largest bucket: eager, no padded rows
    assert ref_engine.stats.eager_steps == 3 and ref_engine.stats.padded_rows == 0

    engine = DecodeEngine(model, max_batch_size=4, max_seq_len=64, backend=backend, progress=False)
    engine.cache.k[:, 3] = float("nan")
    engine.cache.v[:, 3] = float("nan")
    if plant_bug:
        from tgraph.decode import batch as batch_module
        from tgraph.decode.buffers import SLOTS, pack_step_rows

        def padding_into_slot_0(requests, **kw):
            ints, floats = pack_step_rows(requests, **kw)
            ints[SLOTS, len(requests) :] = 0
            return ints, floats

        monkeypatch.setattr(batch_module, "pack_step_rows", padding_into_slot_0)
    live = _live_logits(engine, ps)
    assert engine.stats.bucket_steps == {4: 3} and engine.stats.padded_rows == 3
    if plant_bug:
        with pytest.raises(AssertionError, match="Tensor-likes are not close"):
            torch.testing.assert_close(live, reference, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(live, reference, atol=1e-4, rtol=1e-4)


def test_more_requests_than_slots_all_complete(backend, device):
    """9 requests through 2 slots: each equals the same prompt generated alone (batch 1).

    Alone vs batched shapes differ (1 vs 2 rows), so logits may differ by fp32 rounding; the
    wide logit gaps of these weights keep the argmax tokens identical.
    """
    model = tiny_gpt(device)
    ps, limits = prompts(9), [6, 3, 9, 1, 4, 12, 2, 7, 5]
    engine = DecodeEngine(model, max_batch_size=2, max_seq_len=64, backend=backend, progress=False)
    out = engine.generate(ps, limits)
    alone = DecodeEngine(model, max_batch_size=1, max_seq_len=64, use_graphs=False)
    assert out == [alone.generate([p], n)[0] for p, n in zip(ps, limits)]
    assert engine.stats.prefills == 9


def test_larger_than_largest_bucket_runs_eagerly(backend, device):
    model = tiny_gpt(device)
    kw = dict(max_batch_size=4, max_seq_len=64, batch_sizes=[1, 2])
    graphed, eager = engines(model, backend, **kw)
    ps = prompts(4)
    assert graphed.generate(ps, [8, 3, 10, 6]) == eager.generate(ps, [8, 3, 10, 6])
    assert graphed.stats.eager_steps > 0 and set(graphed.stats.bucket_steps) <= {1, 2}


def test_eos_ends_request_early(backend, device):
    graphed, eager = engines(tiny_gpt(device), backend, max_batch_size=4, max_seq_len=64)
    ps = prompts(3)
    full = eager.generate(ps, 20)
    eos = full[0][4]  # request 0's fifth token
    out = graphed.generate(ps, 20, eos_token_id=eos)
    for o, f in zip(out, full):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert o == f[:cut]
    assert len(out[0]) <= 5 and out[0][-1] == eos
    assert out == eager.generate(ps, 20, eos_token_id=eos)
    either = [full[1][2], eos]  # several EOS ids (a generation_config's list): the first ends it
    out = graphed.generate(ps, 20, eos_token_id=either)
    for o, f in zip(out, full):
        assert o == f[: next((i + 1 for i, t in enumerate(f) if t in either), len(f))]
    assert len(out[1]) <= 3 and out == eager.generate(ps, 20, eos_token_id=either)


def test_sampling_seeded_reproducible(backend, device):
    graphed, eager = engines(tiny_gpt(device), backend, max_batch_size=4, max_seq_len=64)
    ps = prompts(3)
    kw = dict(temperature=0.8, top_k=20, seed=123)
    a = graphed.generate(ps, 15, **kw)
    assert a == graphed.generate(ps, 15, **kw)
    assert a == eager.generate(ps, 15, **kw)  # same logits bitwise, same draws
    assert a != graphed.generate(ps, 15, temperature=0.8, top_k=20, seed=124)
    assert graphed.generate(ps, 15, temperature=1.0, top_k=1, seed=5) == graphed.generate(ps, 15)


def test_numpy_and_tensor_scalars_are_the_numbers_they_hold(backend, device):
    """Integral numpy scalars and 0-d tensors where ints are expected (token ids, limits, top_k,
    seeds, EOS ids), real ones where floats are: the tokens of the Python numbers."""
    np = pytest.importorskip("numpy")
    graphed, eager = engines(tiny_gpt(device), backend, max_batch_size=4, max_seq_len=64)
    ps = prompts(3)
    eos = graphed.generate(ps, 12)[0][3]  # request 0 ends after 4 tokens: EOS is read
    kw = dict(temperature=[0.0, 0.8, 1.5], top_k=20, top_p=0.9, seed=123, eos_token_id=eos)
    want = eager.generate(ps, 12, **kw)
    assert len(want[0]) == 4 and want == graphed.generate(ps, 12, **kw)
    unseen = next(t for t in range(256) if all(t not in o for o in want))  # a second EOS id
    scalars = [
        dict(temperature=[0, np.float32(0.8), torch.tensor(1.5)], top_k=np.int64(20),
             top_p=np.float64(0.9), seed=torch.tensor(123), eos_token_id=torch.tensor(eos)),
        dict(temperature=[np.int64(0), torch.tensor(0.8), np.float16(1.5)],
             top_k=torch.tensor(20), top_p=torch.tensor(0.9), seed=[np.int64(123), 124, 125],
             eos_token_id=torch.tensor([eos, unseen])),
    ]  # fmt: skip
    limits = [
        np.int64(12),
        torch.tensor(12),
        [np.int32(12), torch.tensor(12, dtype=torch.int32), 12],
    ]
    ids = [[np.int64(t) for t in ps[0]], torch.tensor(ps[1]), np.array(ps[2], dtype=np.int32)]
    for settings in scalars:
        for limit in limits:
            assert graphed.generate(ids, limit, **settings) == want
    with pytest.raises(ValueError, match="request 0: a tensor prompt holds token ids"):
        graphed.generate([np.array(ps[0], dtype=np.float32)], 4)


def test_a_compiled_wrapper_is_refused_naming_the_module_it_wraps(device):
    """torch.compile(model) is an OptimizedModule without the decode interface: the refusal
    names the fix (the wrapped module), not the interface's missing methods."""
    compiled = torch.compile(tiny_gpt(device))
    with pytest.raises(TypeError, match=r"torch.compile wrapper OptimizedModule: .*_orig_mod"):
        DecodeEngine(compiled, max_batch_size=2, max_seq_len=64, progress=False)


def test_text_prompts_return_text(backend, device):
    graphed = DecodeEngine(
        tiny_gpt(device), max_batch_size=2, max_seq_len=64, backend=backend, progress=False
    )
    text, ids = graphed.generate(["Hello", encode("Hello")], 10)
    assert isinstance(text, str) and isinstance(ids, list)
    assert text == bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


BAD = {
    "empty prompt": (lambda: [[1, 2], []], 5, "request 1: empty prompt"),
    "token >= vocab": (lambda: [[1, 256]], 5, r"request 0: token id 256 .* outside the vocab"),
    "negative token": (lambda: [[3], [-1]], 5, r"request 1: token id -1"),
    "too long": (
        lambda: [[1] * 10, [1] * 60],
        5,
        r"request 1: prompt of 60 tokens.*max_seq_len 64",
    ),
    "per-request too long": (lambda: [[1] * 10, [1]], [60, 5], r"request 0: .*= 70 exceeds"),
    "limits length": (lambda: [[1], [2]], [3], "max_new_tokens has 1 entries for 2 prompts"),
    "negative limit": (lambda: [[1]], -1, "max_new_tokens must be an int >= 0"),
    "float token": (lambda: [[1.5]], 5, "token ids must be ints"),
    "bool token": (lambda: [[True, 2]], 5, "token ids must be ints"),
    "float tensor prompt": (
        lambda: [[1, 2], torch.tensor([1.7, 2.2])],
        5,
        r"request 1: a tensor prompt holds token ids, an integer dtype, got torch.float32",
    ),
    "float tensor limit": (lambda: [[1]], torch.tensor(4.0), "max_new_tokens must be an int"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_requests_rejected_before_any_work(device, case):
    make, limit, match = BAD[case]
    engine = DecodeEngine(tiny_gpt(device), max_batch_size=2, max_seq_len=64, use_graphs=False)
    with pytest.raises(ValueError, match=match):
        engine.generate(make(), limit)
    assert engine.cache.k.abs().sum() == 0  # nothing was prefilled


def test_bad_arguments(device):
    model = tiny_gpt(device)
    engine = DecodeEngine(model, max_batch_size=2, max_seq_len=64, use_graphs=False)
    with pytest.raises(TypeError, match="wrap a single prompt"):
        engine.generate("Hello", 5)
    with pytest.raises(TypeError, match="flat list of ints"):
        engine.generate([1, 2, 3], 5)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate([[1]], 5, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        engine.generate([[1]], 5, temperature=1.0, top_k=0)
    with pytest.raises(ValueError, match="eos_token_id 300"):
        engine.generate([[1]], 5, eos_token_id=300)
    with pytest.raises(ValueError, match="eos_token_id must be an int token id"):
        engine.generate([[1]], 5, eos_token_id=1.0)
    with pytest.raises(ValueError, match="eos_token_id must be an int token id, .* got True"):
        engine.generate([[1]], 5, eos_token_id=[2, True])
    with pytest.raises(ValueError, match="seed must be an int, got 1.5"):
        engine.generate([[1]], 5, temperature=1.0, seed=1.5)
    with pytest.raises(ValueError, match=r"max_seq_len must be in \[1, 64\]"):
        DecodeEngine(model, max_batch_size=2, max_seq_len=65, use_graphs=False)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1"):
        DecodeEngine(model, max_batch_size=0, max_seq_len=8, use_graphs=False)
    with pytest.raises(ValueError, match="batch_sizes entry 3"):
        DecodeEngine(model, max_batch_size=2, max_seq_len=8, batch_sizes=[1, 3])
    with pytest.raises(TypeError, match="decode interface"):
        DecodeEngine(torch.nn.Linear(2, 2), max_batch_size=1, max_seq_len=8)


class _SyncingDecoder(GPTDecoder):
    """Planted capture hazard: a host sync inside the decode step."""

    def decode_step(self, inputs, cache):
        if inputs.tokens.sum().item() < 0:  # .item(): illegal inside a graph
            raise AssertionError("unreachable")
        return super().decode_step(inputs, cache)


def test_custom_decoder_served_and_capture_failure_explained(backend, device):
    model = tiny_gpt(device)
    custom = GPTDecoder(model)  # any object with the interface, here the GPT adapter itself
    graphed = DecodeEngine(
        custom, max_batch_size=2, max_seq_len=64, backend=backend, progress=False
    )
    ps = prompts(2)
    assert graphed.generate(ps, 5) == DecodeEngine(
        model, max_batch_size=2, max_seq_len=64, use_graphs=False
    ).generate(ps, 5)
    with pytest.raises(CaptureError, match=r"decode program for size 2 .*\.item\(\)"):
        DecodeEngine(
            _SyncingDecoder(model),
            max_batch_size=2,
            max_seq_len=64,
            backend=backend,
            progress=False,
        )


def test_generate_recipe(backend, device, tmp_path, capsys, monkeypatch):
    import importlib.util
    from pathlib import Path

    from tgraph.toy import checkpoint

    path = Path(__file__).parents[1] / "recipes" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    main = recipe.main

    monkeypatch.setenv("TGRAPH_BACKEND", backend)
    checkpoint.save(tiny_gpt(torch.device("cpu")), tmp_path)
    args = ["--ckpt", str(tmp_path), "--prompt", "Hi", "--max-new-tokens", "6"]
    graphed = main([*args, "--device", str(device)])
    eager = main([*args, "--device", str(device), "--no-graphs"])
    assert graphed == eager
    out = capsys.readouterr().out
    assert "tokens/s" in out and "ms per decode step" in out and f"[{backend}]" in out


def test_serves_model_with_per_layer_graphs_enabled(backend, device):
    """The decoder calls the blocks' submodules, never the graphed blocks: same tokens."""
    import tgraph

    model, plain = tiny_gpt(device), tiny_gpt(device)
    tgraph.enable(model, backend=backend)
    ps = prompts(3)
    kw = dict(max_batch_size=4, max_seq_len=64, backend=backend, progress=False)
    assert DecodeEngine(model, **kw).generate(ps, 10) == DecodeEngine(plain, **kw).generate(ps, 10)


def test_a_decoder_calling_a_graphed_module_serves_it_plainly(backend, device):
    """A decoder that calls a module per-layer graphs are enabled on (here the toy's final
    norm, made graphable and recorded as a member of the blocks' stack): the decode program
    is its own graph, so the call is plain: same tokens as a plain copy, nothing recorded or
    replayed from training, and training replays on after it (strict: no fallback)."""
    import copy

    import tgraph

    model = tiny_gpt(device)
    plain = copy.deepcopy(model)
    model.ln_f.__class__ = tgraph.GraphableModule.of(type(model.ln_f), graphed_alone=False)
    tgraph.enable(model, backend=backend, strict=True)
    x = torch.randint(0, 256, (2, 16), device=device)
    model(x, x)[1].backward()
    report = tgraph.create_graphs()
    assert report.runners == CFG["n_layer"] + 1 and report.segments == 1, report
    ps = prompts(3)
    kw = dict(max_batch_size=4, max_seq_len=64, backend=backend, progress=False)
    assert DecodeEngine(model, **kw).generate(ps, 10) == DecodeEngine(plain, **kw).generate(ps, 10)
    model(x, x)[1].backward()  # strict: replayed
    assert tgraph.eager_calls() == 0


def test_sampling_during_training_leaves_the_model_training(backend, device):
    """Sampling every N steps of a training run: the engine decodes without dropout, then the
    model is back in train mode and its per-layer graphs still replay (strict: no fallback)."""
    import tgraph

    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, dropout=0.1)).to(device)
    reference = GPT(GPTConfig(**CFG, dropout=0.1)).to(device)
    reference.load_state_dict(model.state_dict())
    reference.eval()
    tgraph.enable(model, backend=backend, strict=True)
    x = torch.randint(0, 256, (2, 16), device=device)

    def train_step() -> None:
        model(x, x)[1].backward()

    train_step()  # recorded
    tgraph.create_graphs()
    train_step()  # replayed
    kw = dict(max_batch_size=2, max_seq_len=64)
    graphed, eager = engines(model, backend, **kw)
    assert all(m.training for m in model.modules())  # after capture
    ps = prompts(2)
    expected = DecodeEngine(reference, use_graphs=False, **kw).generate(ps, 8)
    assert graphed.generate(ps, 8) == eager.generate(ps, 8) == expected  # no dropout
    assert all(m.training for m in model.modules())  # after generate
    assert not reference.training  # an eval model stays in eval mode
    train_step()  # strict=True: a fallback to eager (a mode mismatch) would raise
    assert all(m.training for m in model.modules())


@pytest.mark.parametrize("scenario", ["50_steps", "join_and_leave"])
def test_lookahead_gives_the_tokens_of_step_by_step_decoding(backend, device, scenario):
    """Steps launched before the host reads the previous tokens (device-side token hand-off)
    give exactly the tokens of reading every step first, including requests ending by EOS while
    others run on (their row decoded ahead is dropped) and slots reused after them."""
    n, max_bs, new = SCENARIOS[scenario]
    model = tiny_gpt(device)
    ps = prompts(n)
    step_by_step = DecodeEngine(
        model, max_batch_size=max_bs, max_seq_len=64, use_graphs=False, lookahead=False
    )
    graphed = DecodeEngine(
        model, max_batch_size=max_bs, max_seq_len=64, backend=backend, progress=False
    )
    want = step_by_step.generate(ps, new)
    assert graphed.generate(ps, new) == want
    eos = want[0][3]  # ends request 0 after at most 4 tokens; others may contain it too
    want_eos = step_by_step.generate(ps, new, eos_token_id=eos)
    assert graphed.generate(ps, new, eos_token_id=eos) == want_eos
    assert graphed.stats.wasted_rows >= 1  # request 0 ended by EOS while the batch ran ahead
    assert step_by_step.stats.wasted_rows == 0


def test_lookahead_stale_token_hand_off_is_caught(backend, device, monkeypatch):
    """Planted bug: the step hands the next step its own input ids instead of the just-sampled
    ids (the device-side hand-off forgets the tokens). Tokens must diverge."""
    model = tiny_gpt(device)
    ps, new = prompts(3), 15
    want = DecodeEngine(
        model, max_batch_size=4, max_seq_len=64, use_graphs=False, lookahead=False
    ).generate(ps, new)

    def stale_tokens(inputs, live, tokens):
        inputs.positions.add_(live)
        inputs.lengths.add_(live)

    monkeypatch.setattr(DecodeBuffers, "advance", staticmethod(stale_tokens))
    graphed = DecodeEngine(model, max_batch_size=4, max_seq_len=64, backend=backend, progress=False)
    assert graphed.generate(ps, new) != want


def test_padded_batch_arguments_checked(device):
    engine = DecodeEngine(tiny_gpt(device), max_batch_size=2, max_seq_len=8, use_graphs=False)
    a = Request(0, [5, 6, 7], 4, False, slot=0)
    b = Request(1, [8, 9], 4, False, slot=0)
    a.output.append(1)
    b.output.append(2)
    with pytest.raises(ValueError, match="request 1 is in KV slot 0 but row 1"):
        engine.decode([a, b])
    a.output += [1, 1, 1, 1]  # position 7: the last of an 8-long cache
    engine.decode([a])
    a.output.append(1)  # position 8
    with pytest.raises(ValueError, match="max_seq_len=8"):
        engine.decode([a])
