"""DecodeEngine and the caller's state: the engine serves the model as it is, whatever contexts
surround the call (autocast, inference mode), and leaves the caller's state as it found it (each
module's train/eval flag, torch's global random generator)."""

from __future__ import annotations

import pytest
import torch
from decode_models import CFG, engines, prompts, tiny_gpt

from tgraph.decode import DecodeEngine
from tgraph.toy.gpt import GPT, GPTConfig

SHAPE = dict(max_batch_size=2, max_seq_len=64, prefill_sizes=[8])
PROMPTS = prompts(3, lengths=(3, 12, 5))  # 12 tokens: above the largest prefill bucket (eager)


@pytest.mark.parametrize("built", ["outside", "under_autocast"])
def test_autocast_around_the_engine_serves_the_model_dtype(backend, device, built):
    """Under ``torch.autocast`` the engine serves the model in its own dtype (its KV cache's):
    graphed buckets, a prompt above the largest prefill bucket (eager) and ``use_graphs=False``
    decode the tokens they decode outside it, also for an engine built (captured) under it."""
    model = tiny_gpt(device)
    want = DecodeEngine(model, use_graphs=False, **SHAPE).generate(PROMPTS, 8)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    if built == "under_autocast":
        with autocast:
            graphed, eager = engines(model, backend, **SHAPE)
    else:
        graphed, eager = engines(model, backend, **SHAPE)
    with autocast:
        assert graphed.generate(PROMPTS, 8) == want
        assert eager.generate(PROMPTS, 8) == want
    assert graphed.stats.prefill_eager == 1 and graphed.stats.eager_steps == 0
    assert graphed.generate(PROMPTS, 8) == want


@pytest.mark.parametrize("use_graphs", [True, False])
def test_an_engine_built_under_inference_mode_serves_outside_it(backend, device, use_graphs):
    """The engine's buffers, KV cache and captures are normal tensors even when it is built
    under ``torch.inference_mode()``: a generate() outside it (which writes them in place) gives
    the tokens of one inside it and of an engine built outside."""
    model = tiny_gpt(device)
    want = DecodeEngine(model, use_graphs=False, **SHAPE).generate(PROMPTS, 8)
    with torch.inference_mode():
        engine = DecodeEngine(
            model, use_graphs=use_graphs, backend=backend, progress=False, **SHAPE
        )
        assert engine.generate(PROMPTS, 8) == want
    assert engine.generate(PROMPTS, 8) == want
    engine.recapture()  # outside: a capture over the engine's tensors
    assert engine.generate(PROMPTS, 8) == want


def test_every_module_gets_its_own_mode_back(backend, device):
    """A model in train() whose dropout modules the user set to eval() (training without
    dropout): after the engine's capture and after generate(), each module has its own flag
    again, not the root's."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG, dropout=0.1)).to(device).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.eval()
    flags = [m.training for m in model.modules()]
    assert True in flags and False in flags
    graphed, eager = engines(model, backend, max_batch_size=2, max_seq_len=64)
    assert [m.training for m in model.modules()] == flags  # after capture
    ps = prompts(2)
    assert graphed.generate(ps, 6) == eager.generate(ps, 6)
    assert [m.training for m in model.modules()] == flags  # after generate


def rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def test_greedy_generate_leaves_torch_rng_untouched(backend, device):
    """Only a sampling request reads a seed: a greedy generate() without one leaves torch's
    generators as it found them (a training loop that evaluates greedily between steps keeps
    its dropout masks); a sampling one draws its seeds there, repeatable with manual_seed."""
    graphed, eager = engines(tiny_gpt(device), backend, **SHAPE)
    for engine in (graphed, eager):
        torch.manual_seed(0)
        before = rng_states(device)
        engine.generate(PROMPTS, 4)
        assert all(map(torch.equal, rng_states(device), before))
    torch.manual_seed(0)
    sampled = graphed.generate(PROMPTS, 4, temperature=[0.0, 1.0, 0.0])
    assert not torch.equal(torch.get_rng_state(), before[0])
    torch.manual_seed(0)
    assert eager.generate(PROMPTS, 4, temperature=[0.0, 1.0, 0.0]) == sampled
