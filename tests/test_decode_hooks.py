"""Forward hooks on a model served by DecodeEngine (the toy GPT here; transformers models in
test_decode_hf.py): a hook the engine cannot honour is refused by name, never silently dropped
or frozen.

* A hook on a module the adapter never calls (a block, its attention, the model) would never
  run: refused at construction, or at the first call after it appears, graphs or not.
* Under graphs, a hook on a module the adapter calls would run at capture only: refused unless
  ``capturable_hooks=True``, which captures it (pure tensor code: its effect replays).
* The eager engine runs hooks on the modules it calls at every call, Python state and all.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from decode_models import engines, prompts, recaptures, tiny_gpt
from torch.nn.modules import module as nn_module

from tgraph.decode import DecodeEngine
from tgraph.decode.requests import make_requests

NEW = 10
SHAPE = dict(max_batch_size=4, max_seq_len=64)


@torch.no_grad()
def full_forward_greedy(model, ps: list[list[int]], n: int = NEW) -> list[list[int]]:
    """Greedy tokens recomputing ``model(idx)`` (its forward, hooks and all) every token."""
    device = model.wte.weight.device
    out = []
    for p in ps:
        seq = list(p)
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq], device=device))[0][0, -1].argmax()))
        out.append(seq[len(p) :])
    return out


def direction(x: torch.Tensor) -> torch.Tensor:
    """A steering direction across ``x``'s features (not a constant: LayerNorm removes that)."""
    return torch.linspace(-3.0, 3.0, x.shape[-1], device=x.device)


def shift(module, args, out):
    """Steering: a direction added to the module's output (pure tensor code)."""
    return out + direction(out)


def shift_input(module, args):
    return (args[0] + direction(args[0]),)


BYPASSED = ["", "h.0", "h.1.attn", "h.0.attn.resid_dropout", "drop"]


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("pre", [False, True], ids=["hook", "pre_hook"])
@pytest.mark.parametrize("where", BYPASSED, ids=lambda w: w or "model")
def test_a_hook_on_a_module_the_adapter_never_calls_is_refused(backend, device, where, pre,
                                                                use_graphs):  # fmt: skip
    """The decoder runs the blocks' parts, never a block's, its attention's or the model's
    forward: a hook there would never run and the tokens would be the unhooked model's. The
    engine refuses it at construction, naming the module, the hook and the fix."""
    model = tiny_gpt(device).eval()
    m = model.get_submodule(where)
    (m.register_forward_pre_hook(shift_input) if pre else m.register_forward_hook(shift))
    name = where or "the model"
    kind = "forward pre-hook shift_input" if pre else "forward hook shift"
    with pytest.raises(RuntimeError, match=rf"^DecodeEngine: {name} has the {kind}, which would "
                       r"never run: .*handle\.remove\(\).*own generate\(\)$"):  # fmt: skip
        DecodeEngine(model, use_graphs=use_graphs, backend=backend, progress=False, **SHAPE)


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
def test_a_hook_added_after_capture_on_a_module_never_called_is_refused(backend, device,
                                                                        use_graphs, replays):  # fmt: skip
    """Registered between generate() calls: the next call refuses it, and once it is removed
    the engine serves again, replaying the graphs it has."""
    model = tiny_gpt(device)
    ps = prompts(3)
    eng = DecodeEngine(model, use_graphs=use_graphs, backend=backend, progress=False, **SHAPE)
    recaptured = recaptures(eng)
    want = eng.generate(ps, NEW)
    handle = model.h[1].register_forward_hook(shift)
    assert full_forward_greedy(model, ps) != want  # the hook matters: ignoring it would show
    with pytest.raises(RuntimeError, match=r"^DecodeEngine: h\.1 has the forward hook shift, "
                       "which would never run"):  # fmt: skip
        eng.generate(ps, NEW)
    (request,) = make_requests([ps[0]], NEW, vocab_size=256, max_seq_len=64, max_positions=64)
    request.slot = 0
    with pytest.raises(RuntimeError, match=r"h\.1 has the forward hook shift"):
        eng.prefill(request)  # a hand-written loop's call too
    handle.remove()
    before = replays[0]
    assert eng.generate(ps, NEW) == want
    assert replays[0] - before >= (NEW if use_graphs else 0) and recaptured[0] == 0


def test_a_hooked_module_swapped_in_is_refused(backend, device):
    """``copy.deepcopy`` copies a module's hooks without registering any (torch's hook counter
    stays put): a hooked block swapped in after capture is found by the module tree's change."""
    model = tiny_gpt(device)
    spare = copy.deepcopy(model.h[0])
    spare.register_forward_hook(shift)
    spare = copy.deepcopy(spare)
    graphed, eager = engines(model, backend, **SHAPE)
    graphed.generate(prompts(2), 2)
    eager.generate(prompts(2), 2)
    model.h[0] = spare
    for eng in (graphed, eager):
        with pytest.raises(RuntimeError, match=r"^DecodeEngine: h\.0 has the forward hook shift"):
            eng.generate(prompts(2), 2)


@pytest.mark.parametrize("where", ["h.0.mlp", "lm_head", "h.1.ln_2", "h.0.attn.c_proj"])
def test_under_graphs_a_hook_on_a_called_module_needs_capturable_hooks(backend, device, where):
    """Its Python would run at capture only (a steering strength changed later, a recording
    hook): refused by name, at construction or at the first call after it appears, with the
    three ways out."""
    model = tiny_gpt(device)
    handle = model.get_submodule(where).register_forward_hook(shift)
    fix = r"use_graphs=False \(hooks run at every call\).*capturable_hooks=True to DecodeEngine$"
    with pytest.raises(RuntimeError, match=rf"^DecodeEngine: {where} has the forward hook shift, "
                       rf"which a graph would run at capture only .*{fix}"):  # fmt: skip
        DecodeEngine(model, backend=backend, progress=False, **SHAPE)
    handle.remove()
    eng = DecodeEngine(model, backend=backend, progress=False, **SHAPE)
    eng.generate(prompts(2), 2)
    model.get_submodule(where).register_forward_hook(shift)
    with pytest.raises(RuntimeError, match=rf"^DecodeEngine: {where} has the forward hook shift"):
        eng.generate(prompts(2), 2)


def test_the_eager_engine_runs_hooks_at_every_call(device):
    """use_graphs=False runs the hooks on the modules it calls at every step: a steering
    strength changed between calls is honoured (tokens of the hooked model's own forward) and
    a recording hook sees every prefill and step."""
    model = tiny_gpt(device)
    state = {"alpha": 0.0, "calls": 0}

    def steer(module, args, out):
        state["calls"] += 1
        return out + state["alpha"] * direction(out)

    model.h[0].mlp.register_forward_hook(steer)
    eng = DecodeEngine(model, use_graphs=False, progress=False, **SHAPE)
    ps = prompts(3)
    seen = []
    for alpha in (0.0, 3.0):
        state["alpha"], state["calls"] = alpha, 0
        got = eng.generate(ps, NEW)
        assert state["calls"] == len(ps) + eng.stats.decode_steps  # each prefill and step
        calls, state["calls"] = state["calls"], 0
        assert got == full_forward_greedy(model, ps)
        seen.append(got)
        assert calls > NEW
    assert seen[0] != seen[1]  # the strength matters: a frozen hook would show


def test_capturable_hooks_are_captured_and_replayed(backend, device, replays):
    """capturable_hooks=True: hooks of pure tensor code on called modules are part of the
    graphs: tokens equal the eager engine's and the hooked model's own forward, replayed, with
    the hooks' Python run at capture only."""
    model = tiny_gpt(device)
    calls = [0]

    def steer(module, args, out):
        calls[0] += 1
        return out + direction(out)

    model.h[0].mlp.register_forward_hook(steer)
    model.lm_head.register_forward_pre_hook(shift_input)
    graphed, eager = engines(model, backend, capturable_hooks=True, **SHAPE)
    ps = prompts(3)
    calls[0] = 0
    before = replays[0]
    got = graphed.generate(ps, NEW)
    assert calls[0] == 0 and replays[0] - before >= NEW  # replays only, no Python
    assert got == eager.generate(ps, NEW)  # exact: the same kernels on the same numbers
    assert calls[0] > 0  # the eager engine ran it
    assert got == full_forward_greedy(model, ps)
    model.h[0].mlp._forward_hooks.clear()
    assert graphed.generate(ps, NEW) != got  # the hook's effect was in the graphs


def test_a_global_forward_hook_is_refused(backend, device):
    """A global hook (``register_module_forward_hook``) would run around the called modules
    only, never around the blocks or the model: refused, graphs or not."""
    model = tiny_gpt(device)
    handle = nn_module.register_module_forward_hook(lambda m, a, out: out)
    try:
        for use_graphs in (True, False):
            with pytest.raises(RuntimeError, match=r"^DecodeEngine: a global forward hook "
                               r".*<lambda> is registered.*handle\.remove\(\)"):  # fmt: skip
                DecodeEngine(model, use_graphs=use_graphs, backend=backend, progress=False,
                             capturable_hooks=True, **SHAPE)  # fmt: skip
    finally:
        handle.remove()


def test_backward_hooks_are_served(backend, device, replays):
    """Decode runs under no_grad, where backward hooks never fire (as in the model's own
    generation): served, replayed, tokens equal the eager engine's."""
    model = tiny_gpt(device)
    model.h[0].register_full_backward_hook(lambda m, gi, go: None)
    graphed, eager = engines(model, backend, **SHAPE)
    before = replays[0]
    assert graphed.generate(prompts(3), NEW) == eager.generate(prompts(3), NEW)
    assert replays[0] - before >= NEW


def steered_forward(mlp, state: dict):
    """An instance ``forward`` as accelerate's ``add_hook_to_module`` or a patch sets one: the
    module's own forward, steered by ``state["alpha"]`` (read at each call)."""
    stock = mlp.forward

    def forward(x):
        out = stock(x)
        return out + state["alpha"] * direction(out)

    return forward


@pytest.mark.parametrize("after", [False, True], ids=["at_build", "after_capture"])
def test_under_graphs_an_instance_forward_on_a_called_module_is_refused(backend, device, after):
    """A forward set on the instance of a module the adapter calls replaces its computation;
    graphs would freeze the Python around it (the steering strength at capture): refused like
    a forward hook, at construction or at the first call after it appears."""
    model = tiny_gpt(device).eval()
    mlp, state = model.h[0].mlp, {"alpha": 1.0}
    if after:
        eng = DecodeEngine(model, backend=backend, progress=False, **SHAPE)
        eng.generate(prompts(2), 2)
    mlp.forward = steered_forward(mlp, state)
    msg = r"^DecodeEngine: h\.0\.mlp has the instance forward .*capture only.*del module\.forward"
    with pytest.raises(RuntimeError, match=msg):
        if after:
            eng.generate(prompts(2), 2)
        else:
            DecodeEngine(model, backend=backend, progress=False, **SHAPE)


def test_the_eager_engine_runs_an_instance_forward_at_every_call(device):
    """use_graphs=False runs a called module's instance forward at every step: a strength
    changed between calls is honoured (the steered model's own tokens)."""
    model = tiny_gpt(device).eval()
    state = {"alpha": 0.0}
    model.h[0].mlp.forward = steered_forward(model.h[0].mlp, state)
    eng = DecodeEngine(model, use_graphs=False, progress=False, **SHAPE)
    ps, seen = prompts(3), []
    for alpha in (0.0, 3.0):
        state["alpha"] = alpha
        got = eng.generate(ps, NEW)
        assert got == full_forward_greedy(model, ps)
        seen.append(got)
    assert seen[0] != seen[1]  # the strength matters: a frozen forward would show


def test_a_compiled_called_module_is_served_not_taken_for_a_hook(backend, device, replays):
    """torch.compile(module) is a wrapper whose instance forward is the module's own code,
    compiled: not a hook. A compiled called module is served under graphs, replayed, with the
    tokens of the eager engine and of the model's own forward."""
    model = tiny_gpt(device).eval()
    model.h[0].mlp = torch.compile(model.h[0].mlp, backend="eager")
    graphed, eager = engines(model, backend, **SHAPE)
    ps = prompts(3)
    before = replays[0]
    got = graphed.generate(ps, NEW)
    assert replays[0] - before >= NEW
    assert got == eager.generate(ps, NEW) == full_forward_greedy(model, ps)


class _SteeredAttention(torch.nn.Module):
    """Mixed into the toy attention's class: a subclass with a forward of its own."""

    def forward(self, x):
        y = super().forward(x)
        return y + direction(y)


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("how", ["instance", "subclass"])
@pytest.mark.parametrize("after", [False, True], ids=["at_build", "after_build"])
def test_a_forward_of_its_own_on_a_bypassed_module_is_refused(backend, device, how, after,
                                                              use_graphs):  # fmt: skip
    """The decoder runs a block's and its attention's parts, never their forward: a forward
    set on the instance (accelerate's add_hook_to_module) or a subclass's override would
    silently not run. Refused, naming the module, graphs or not, at build or after."""
    model = tiny_gpt(device).eval()
    eng = None
    if after:
        eng = DecodeEngine(model, use_graphs=use_graphs, backend=backend, progress=False, **SHAPE)
        eng.generate(prompts(2), 2)
    if how == "instance":
        block = model.h[0]
        block.forward = functools.partial(type(block).forward, block)
        msg = r"h\.0 runs a forward set on the Block instance"
    else:
        attn = model.h[1].attn
        attn.__class__ = type("Steered", (_SteeredAttention, type(attn)), {})
        msg = r"h\.1\.attn runs _SteeredAttention\.forward"
    with pytest.raises((TypeError, RuntimeError), match=rf"^DecodeEngine .*{msg}|{msg}"):
        if after:
            eng.generate(prompts(2), 2)
        else:
            DecodeEngine(model, use_graphs=use_graphs, backend=backend, progress=False, **SHAPE)
