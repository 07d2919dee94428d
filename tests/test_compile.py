"""Per-layer graphs over layers compiled by ``torch.compile`` (``enable(compile=True)``): the
recorded iteration compiles each graphed module's call once per layer class, warmup and capture
run the compiled code, and training matches eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import tgraph
from tgraph.layers import verify
from tgraph.layers.runner import module_call
from tgraph.toy.gpt import GPT, GPTConfig


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _toy(device: torch.device) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16, dropout=0.0)
    return GPT(cfg).to(device)


def _train(model: GPT, x: torch.Tensor, y: torch.Tensor, steps: int, graphs: bool) -> list:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if graphs and i == 0:
            opt.zero_grad(set_to_none=True)
            tgraph.create_graphs()
    return losses


def test_compiled_layers_graphed_match_eager(backend, device):
    model = _toy(device)
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 8), generator=g).to(device) for _ in range(2))
    want = _train(eager, x, y, 4, graphs=False)
    tgraph.enable(model, backend=backend, compile=True)
    got = _train(model, x, y, 4, graphs=True)
    assert tgraph.eager_calls() == 0  # the steps after capture replayed
    # inductor fuses kernels (other rounding): equal to eager up to float32 reordering
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-5)
    # the three blocks share their compiled code (dynamo treats parameters as inputs): one
    # compilation for the recorded calls, at most one more for the graphs' parameter aliases
    assert counters["frames"]["ok"] <= 2
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_code_survives_the_warmup_host_sync_check(backend, device):
    """Dynamo stops running a compiled function once it was called under a dispatch mode; the
    warmup's host-sync check is one, so it must call the module itself, or the capture would
    graph eager kernels."""
    model = _toy(device)
    tgraph.enable(model, backend=backend, compile=True)
    x = torch.randint(0, 64, (2, 8), device=device)
    _train(model, x, x, 1, graphs=True)  # the recorded step compiles; create_graphs warms up
    h = torch.randn(2, 8, 16, device=device, requires_grad=True)  # as the recorded calls'
    with torch.profiler.profile() as prof:
        module_call(model.h[0])(h)
    assert any("Torch-Compiled Region" in e.name for e in prof.events())
    assert counters["frames"]["ok"] <= 2  # the recorded calls, the aliases (see above)


@pytest.mark.parametrize("merge", [True, False])
def test_warmup_runs_the_compiled_code_before_the_capture(backend, device, merge):
    """Dynamo compiles once more for the graphs' parameter aliases. That must happen in the
    warmup: a CUDA capture calls the compiled code too, and inductor compiling inside a capture
    fails (cudaErrorStreamCaptureUnsupported: seen on the H200 with Hugging Face Llama layers
    in a merged stack, whose warmup ran every pass under its host-sync check, where dynamo does
    not run). So every graphed module's compiled call runs in the warmup, outside any dispatch
    mode, merged stacks too; the emulated capture, under its dispatch mode, calls it never."""
    model = _toy(device)
    tgraph.enable(model, backend=backend, compile=True, merge=merge)
    x = torch.randint(0, 64, (2, 8), device=device)
    _train(model, x, x, 1, graphs=False)  # the recorded step compiles
    calls = {}
    for i, block in enumerate(model.h):
        state = block._tgraph
        compiled = state.compiled

        def counted(*args, _i=i, _compiled=compiled, **kwargs):
            if not torch._C._len_torch_dispatch_stack():
                calls[_i] = calls.get(_i, 0) + 1
            return _compiled(*args, **kwargs)

        state.compiled = counted
    tgraph.create_graphs()
    assert sorted(calls) == list(range(len(model.h))), calls
    frames = counters["frames"]["ok"]
    _train(model, x, x, 2, graphs=False)  # replays compile nothing
    assert counters["frames"]["ok"] == frames


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_compile_modes_with_their_own_cuda_graphs_are_refused(mode):
    with pytest.raises(ValueError, match="max-autotune-no-cudagraphs"):
        tgraph.enable(_toy(torch.device("cpu")), compile={"mode": mode})


def test_full_iteration_graph_around_a_compiled_model(backend, device):
    """The whole step of a ``torch.compile``d model (inductor, default mode) as one graph;
    dynamo compiles during the warmup steps, while tgraph's module discovery hook is on."""
    model = _toy(device)
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [
        tuple(torch.randint(0, 64, (2, 8), generator=g).to(device) for _ in range(2))
        for _ in range(2)
    ]

    def make_step(m: torch.nn.Module):  # the graph's step runs the compiled model
        extra = {"capturable": True} if device.type == "cuda" else {"fused": True}
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, **extra)
        run = torch.compile(m) if m is model else m

        def step(batch):
            opt.zero_grad(set_to_none=True)
            _, loss = run(*batch)
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    eager_step = make_step(eager)
    ref = [eager_step(batches[i % 2]) for i in range(6)]
    graph = tgraph.FullIterationGraph(make_step(model), warmup_steps=2, backend=backend)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = [graph(batches[i % 2]) for i in range(2)]  # the warmup: dynamo compiles
    # torch warns that a global module hook fires once more for the compiled wrapper: the
    # warmup's module discovery is such a hook, and an idempotent one (no noise for the user)
    assert not [w for w in seen if "global hooks" in str(w.message)], seen
    compiled = counters["frames"]["ok"]
    assert compiled >= 1
    got += [graph(batches[i % 2]) for i in range(2, 6)]  # capture, then replays
    assert graph.num_graphs == 1
    # the last warmup ran as the capture runs (no discovery hook): nothing recompiles later
    assert counters["frames"]["ok"] == compiled
    torch.testing.assert_close(torch.stack(got), torch.stack(ref), rtol=1e-4, atol=1e-5)


def test_per_layer_graphs_inside_a_model_the_user_compiled(backend, device, replays):
    """``torch.compile(model)`` around a model whose blocks tgraph graphs: dynamo meets the
    blocks' calls in its trace and leaves them to tgraph (a graph break each), so the recorded
    step records them, and every later call replays (strict) with eager's losses."""
    model = _toy(device)
    eager = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 64, (2, 8), generator=g).to(device) for _ in range(2))
    tgraph.enable(model, backend=backend, strict=True)
    got = _train(torch.compile(model), x, y, 4, graphs=True)
    want = _train(eager, x, y, 4, graphs=False)
    assert tgraph.eager_calls() == 0 and replays[0] == 2 * 3  # one merged stack: fwd + bwd
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-5)


def _reordering_backend(gm, example_inputs):
    """A dynamo backend standing for inductor's other rounding: the captured FX graph, its
    float outputs scaled by 1 + 1e-5 (beyond the verifier's tolerance of a few ulps)."""

    def run(*args):
        outs = gm(*args)
        if isinstance(outs, torch.Tensor):
            return outs * (1 + 1e-5) if outs.is_floating_point() else outs
        return type(outs)(o * (1 + 1e-5) if o.is_floating_point() else o for o in outs)

    return run


def test_shadow_verifier_compares_with_the_code_the_graph_holds(
    backend, device, replays, monkeypatch
):
    """The verifier's eager twin must run what the graph captured: a CUDA capture graphs the
    compiled code, an emulated capture (under its dispatch mode, where dynamo does not run) the
    module's own. Compiled code that rounds otherwise (here a backend that scales its outputs)
    must not make every verified replay look wrong: before, the emulated twin ran the compiled
    code against a graph of the plain one, and the first verified replay sent the layers eager
    for good (seen in the HF recipe resumed with --compile: 5.4e-7 apart)."""
    model = _toy(device)
    tgraph.enable(model, backend=backend, compile={"backend": _reordering_backend}, strict=True)
    x = torch.randint(0, 64, (2, 8), device=device)
    twins = []
    real = verify._eager_chain

    def counted(*args, **kwargs):
        twins.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(verify, "_eager_chain", counted)
    with tgraph.verification(every=1):
        _train(model, x, x, 4, graphs=True)
    assert len(twins) >= 3 and replays[0] == 2 * 3  # each step's stack verified and replayed
    assert tgraph.eager_calls() == 0


@torch.compile
def _bias_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x + b, approximate="tanh") * 1.1


class _InnerCompiled(tgraph.GraphableModule):
    """A forward that calls a torch.compile'd fusion, as TransformerEngine's bias-GELU does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64, dtype=torch.bfloat16)
        self.b = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))

    def forward(self, x):
        return _bias_gelu(self.lin(x), self.b)


@pytest.mark.cuda
def test_inner_compiled_function_stays_compiled_in_the_graph():
    """The warmup's host-sync check (a dispatch mode) must not turn a compiled function into
    eager code for the capture: the graph would then hold unfused kernels, and bf16 results
    differ from eager's from the first replay (the emulated backend runs a compiled function's
    eager code at capture by construction, so this is a CUDA test)."""
    torch.manual_seed(0)
    graphed = torch.nn.Sequential(_InnerCompiled(), _InnerCompiled()).cuda()
    eager = copy.deepcopy(graphed)
    tgraph.enable(graphed, strict=True)
    losses = []
    for model, record in ((eager, False), (graphed, True)):
        torch.manual_seed(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = []
        for step in range(4):
            x = torch.randn(32, 64, dtype=torch.bfloat16, device="cuda")
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.detach())
            if record and step == 0:
                tgraph.create_graphs()
        losses.append(torch.stack(run))
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
