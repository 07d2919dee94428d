"""Foreign models: Hugging Face Llama and GPT-2 under tgraph, against eager twins.

Nobody here wrote these models, so they exercise tgraph the way users do: decoder layers made
graphable by a dynamic subclass swapped onto each layer (tests/hf_models.py, as the megatron
integration does it), keyword arguments, a ``(cos, sin)`` tuple argument, ``None`` masks, HF's
own mask and loss code around the graphs. Models are built from tiny configs with random
weights (no hub).

Every graphed model is compared with an eager twin (``copy.deepcopy`` taken before the layers
are made graphable) trained with the same seeds and batches.

Tolerances: per-layer tests without AdamW use tests/layer_models.py's RTOL/ATOL. Tests with
AdamW use ``ADAMW_TOL`` (the full-iteration tests' tolerance): on the emulated backend graphed
and eager are bitwise equal in practice, but on CUDA a graph may pick another cuBLAS algorithm
than the eager call, and Adam divides by sqrt(v), which turns last-ulp differences of
near-cancelling gradient elements into larger parameter differences after a few steps (see
``layer_models.train``). 1e-4 relative still fails every real bug (a stale input, a lost or
doubled gradient, a frozen dropout mask or a train-mode eval graph move values by >= 1e-3).

Greedy decode: ``tgraph.decode.DecodeEngine`` serves the toy GPT or any object implementing
``tgraph.decode.interface.DecodeModel`` (``prefill``/``decode_step`` against its KV cache); HF
models implement neither, so the decode test maps the toy GPT's weights exactly onto a
``GPT2LMHeadModel`` (same pre-LN architecture with ``activation_function="gelu"`` and untied
embeddings; Linear weights transposed into GPT-2's Conv1D layout) and compares graph-served
greedy tokens against HF ``generate(do_sample=False)``.
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from hf_models import (  # noqa: E402
    MAX_POS,
    VOCAB,
    gpt2_config,
    make_layers_graphable,
    tiny_gpt2,
    tiny_llama,
    tiny_model,
    token_batches,
)
from layer_models import ATOL, RTOL  # noqa: E402

import tgraph  # noqa: E402

ADAMW_TOL = dict(rtol=1e-4, atol=1e-5)
LR = 1e-3


def graphed_and_twin(kind: str, device, backend: str, *, strict: bool = True, **model_kw):
    """A tiny HF model with graphable, enabled decoder layers, and its eager twin."""
    model = tiny_model(kind, device, **model_kw)
    eager = copy.deepcopy(model)  # a stock HF model: never made graphable, never enabled
    make_layers_graphable(model)
    tgraph.enable(model, backend=backend, strict=strict)
    return model, eager


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter gradient (zeros where None, with the name kept apart below)."""
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def grad_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.grad is not None]


def run_steps(model, batches, *, graphed: bool, micro: int = 1, seed: int = 0, lr: float = LR):
    """AdamW training steps over ``batches`` (each a list of ``micro`` microbatches).

    With ``graphed``, ``tgraph.create_graphs()`` runs after step 0 (the recorded iteration).
    Returns per-step losses, per-step gradients (taken before ``opt.step``) and their names.
    """
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses, grads, names = [], [], []
    for i, step in enumerate(batches):
        total = 0.0
        for x in step:
            loss = model(input_ids=x, labels=x, use_cache=False).loss / len(step)
            loss.backward()
            total = total + loss.detach()
        losses.append(total)
        grads.append(grads_of(model))
        names.append(grad_names(model))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and i == 0:
            assert tgraph.create_graphs().graphs > 0  # strict=True: every later call replays
    return torch.stack(losses), grads, names


def assert_runs_equal(got, want, tol):
    (g_losses, g_grads, g_names), (e_losses, e_grads, e_names) = got, want
    torch.testing.assert_close(g_losses, e_losses, **tol)
    for step, (gn, en, gg, eg) in enumerate(zip(g_names, e_names, g_grads, e_grads)):
        assert gn == en, f"step {step}: parameters with a gradient differ: {set(gn) ^ set(en)}"
        for name, a, b in zip(gn, gg, eg):
            torch.testing.assert_close(a, b, **tol, msg=lambda m, n=name, s=step: f"{s} {n}: {m}")


# ---------------------------------------------------------------- per-layer graphs


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_per_layer_training_matches_eager(backend, device, kind):
    model, eager = graphed_and_twin(kind, device, backend, n_layer=3)
    batches = [[x] for x in token_batches(device, 5)]
    got = run_steps(model, batches, graphed=True)
    want = run_steps(eager, batches, graphed=False)
    assert_runs_equal(got, want, ADAMW_TOL)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_gradient_accumulation_matches_eager(backend, device, kind):
    model, eager = graphed_and_twin(kind, device, backend)
    xs = token_batches(device, 12)
    batches = [xs[i : i + 3] for i in range(0, 12, 3)]  # 4 steps of 3 microbatches
    got = run_steps(model, batches, graphed=True)
    want = run_steps(eager, batches, graphed=False)
    assert_runs_equal(got, want, ADAMW_TOL)


def test_microbatch_order_other_than_recorded_is_right_or_runs_eagerly(backend, device):
    """Recorded: all forwards, then one backward (3 runners per layer, in flight together).
    Replayed: forward, backward per microbatch. Each replayed call matches a captured
    signature, but the replay order differs from the capture order that made sharing one
    memory pool safe. tgraph must give eager's gradients, or run the unsafe
    calls eagerly (with a warning, ignored here); never wrong gradients."""
    model, eager = graphed_and_twin("llama", device, backend, strict=False)
    xs = token_batches(device, 6)
    results = []
    for m, graphed in ((model, True), (eager, False)):
        torch.manual_seed(0)
        losses, grads = [], []
        # recorded iteration: forwards of 3 microbatches in flight, then one backward
        total = sum(m(input_ids=x, labels=x, use_cache=False).loss for x in xs[:3])
        total.backward()
        m.zero_grad(set_to_none=True)
        if graphed:
            tgraph.create_graphs()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tgraph.GraphFallbackWarning)
            for x in xs[3:]:
                loss = m(input_ids=x, labels=x, use_cache=False).loss
                loss.backward()
                losses.append(loss.detach())
            grads.append(grads_of(m))
        results.append((torch.stack(losses), grads, [grad_names(m)]))
    assert_runs_equal(results[0], results[1], dict(rtol=RTOL, atol=ATOL))


def test_gpt2_dropout_masks_change_and_match_eager(backend, device):
    """Dropout inside the graphed GPT-2 blocks only (embedding dropout off, so every loss
    difference below comes from masks drawn inside the graphs). The same seed before the
    graphed and the eager run aligns their RNG streams: per-layer graphs consume random
    numbers in eager's order (the blocks' forwards in model order, no RNG in backward), and
    create_graphs() restores every generator after warmup and capture; on CUDA the default
    generator is registered with each graph, so replays draw from eager's Philox offsets."""
    model, eager = graphed_and_twin("gpt2", device, backend, dropout=0.1, embd_dropout=0.0)
    (x,) = token_batches(device, 1)
    results = []
    for m, graphed in ((model, True), (eager, False)):
        torch.manual_seed(123)
        losses, grads = [], []
        for i in range(4):  # identical batch, no optimizer: only the masks change
            loss = m(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            losses.append(loss.detach())
            grads.append(grads_of(m))
            m.zero_grad(set_to_none=True)
            if graphed and i == 0:
                tgraph.create_graphs()
        results.append((torch.stack(losses), grads, [grad_names(m)] * 4))
    g = results[0][0]
    assert len({round(v, 6) for v in g[1:].tolist()}) == 3, (
        f"graphed losses repeat across replays of an identical batch: {g.tolist()} "
        "(dropout mask frozen in the graph)"
    )
    assert_runs_equal(results[0], results[1], dict(rtol=RTOL, atol=ATOL))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_eval_after_training_matches_eager(backend, device, kind):
    """The recorded iteration is a training step then a no-grad eval call;
    after create_graphs(), training steps replay the training graphs and eval calls replay
    the eval graphs, which must have been captured in eval mode (dropout off)."""
    model, eager = graphed_and_twin(kind, device, backend, dropout=0.1)
    xs = token_batches(device, 5)
    x_eval = token_batches(device, 1, seed=7)[0]
    results = []
    for m, graphed in ((model, True), (eager, False)):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1)
        losses, logits = [], []
        for i, x in enumerate(xs):
            loss = m(input_ids=x, labels=x, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            m.eval()
            with torch.no_grad():
                logits.append(m(input_ids=x_eval, use_cache=False).logits.clone())
            m.train()
            if graphed and i == 0:
                tgraph.create_graphs()
        results.append((torch.stack(losses), torch.stack(logits)))
    (g_losses, g_logits), (e_losses, e_logits) = results
    torch.testing.assert_close(g_losses, e_losses, **ADAMW_TOL)
    torch.testing.assert_close(g_logits, e_logits, **ADAMW_TOL)


# ------------------------------------------------------------------ full iteration


@pytest.mark.parametrize("use_cache", ["default", False])
def test_full_iteration_llama_with_lr_schedule(backend, device, use_cache):
    """A stock HF Llama training step inside FullIterationGraph.

    ``use_cache="default"`` is the usual call (``model(input_ids=x, labels=x)``), which
    builds a DynamicCache inside the step; ``use_cache=False`` takes HF's mask path without a
    cache, whose host sync is skipped only when ``torch.cuda.is_current_stream_capturing()``
    (via transformers' ``is_tracing``) is true, so an emulated capture must answer as CUDA's
    does. AdamW: ``capturable=True`` on CUDA; on the CPU ``capturable`` is CUDA-only and
    FullIterationGraph asks for ``fused=True`` instead (tgraph/step/full_iteration.py).
    """
    kw = {} if use_cache == "default" else {"use_cache": False}
    xs = token_batches(device, 8)

    def run(graphed: bool, schedule: bool = True):
        m = tiny_llama(device)
        extra = {"capturable": True} if device.type == "cuda" else {"fused": True}
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1, **extra)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, (lambda s: 1.0 / (1 + 2 * s)) if schedule else (lambda s: 1.0)
        )

        def step(x):
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=x, labels=x, **kw).loss
            loss.backward()
            opt.step()
            return loss.detach()

        if graphed:
            step = tgraph.FullIterationGraph(step, warmup_steps=2, backend=backend)
        losses, lrs = [], []
        for x in xs:
            losses.append(step(x).reshape(()))
            sched.step()
            lrs.append(float(opt.param_groups[0]["lr"]))
        params = [p.detach().clone() for p in m.parameters()]
        return torch.stack(losses), params, lrs, step

    g_losses, g_params, g_lrs, g_step = run(True)
    e_losses, e_params, e_lrs, _ = run(False)
    assert g_step.num_graphs == 1
    assert len(set(g_lrs)) == len(xs) and g_lrs == pytest.approx(e_lrs)
    torch.testing.assert_close(g_losses, e_losses, **ADAMW_TOL)
    torch.testing.assert_close(g_params, e_params, **ADAMW_TOL)
    # the schedule matters: without it the same steps end elsewhere (so a frozen lr would fail)
    c_losses, c_params, _, _ = run(False, schedule=False)
    assert not torch.allclose(
        torch.cat([p.flatten() for p in c_params]),
        torch.cat([p.flatten() for p in e_params]),
        **ADAMW_TOL,
    )
    del c_losses


# ------------------------------------------------------------------ greedy decode


def toy_gpt_and_hf_twin(device):
    """The toy GPT with large random weights (wide logit gaps, no argmax near-ties) and a
    GPT2LMHeadModel holding exactly the same weights."""
    from transformers import GPT2LMHeadModel

    from tgraph.toy.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    toy = GPT(GPTConfig(vocab_size=VOCAB, block_size=MAX_POS, n_layer=2, n_head=4, n_embd=64))
    with torch.no_grad():
        for p in toy.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    cfg = gpt2_config(
        n_layer=2, n_inner=4 * 64, activation_function="gelu", tie_word_embeddings=False
    )
    hf = GPT2LMHeadModel(cfg)
    conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # GPT-2 stores (in, out)
    state = {
        (k if k.startswith("lm_head.") else f"transformer.{k}"): (
            v.t().contiguous() if k.endswith(conv1d) else v
        )
        for k, v in toy.state_dict().items()
    }
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return toy.to(device).eval(), hf.to(device).eval()


def test_greedy_decode_matches_hf_generate(backend, device):
    from tgraph.decode import DecodeEngine

    toy, hf = toy_gpt_and_hf_twin(device)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (5, 1, 9)]
    x = torch.tensor([prompts[0]], device=device)
    torch.testing.assert_close(hf(input_ids=x).logits, toy(x)[0], rtol=1e-4, atol=1e-4)
    new = 20
    engine = DecodeEngine(
        toy, max_batch_size=4, max_seq_len=MAX_POS, backend=backend, progress=False
    )
    got = engine.generate(prompts, new)
    assert engine.stats.eager_steps == 0
    for p, tokens in zip(prompts, got):
        ids = torch.tensor([p], device=device)
        ref = hf.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        assert tokens == ref[0, len(p) :].tolist(), f"prompt {p}"


# ------------------------------------------------------------------ messages (case 5)


class DictArg(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, inputs: dict) -> torch.Tensor:
        return self.lin(inputs["hidden"]) + inputs["bias"]


def test_dict_tensor_requires_grad_change_is_named(backend, device):
    torch.manual_seed(0)
    mod = DictArg().to(device)
    tgraph.enable(mod, backend=backend)
    h = torch.randn(4, 8, device=device, requires_grad=True)
    bias = torch.randn(4, 8, device=device)
    mod({"hidden": h, "bias": bias}).sum().backward()
    tgraph.create_graphs()
    with pytest.warns(tgraph.GraphFallbackWarning, match=r"(?s)(?=.*requires_grad)(?=.*bias)"):
        mod({"hidden": h, "bias": bias.clone().requires_grad_()}).sum().backward()


def test_default_use_cache_gives_a_message_naming_use_cache_false(backend, device):
    """HF's default use_cache=True hands every decoder layer a new DynamicCache, even in
    training. tgraph may refuse (raise) or run those calls eagerly (warn); either way the
    message must name the cause's fix, ``use_cache=False``, not a host sync."""
    model, eager = graphed_and_twin("gpt2", device, backend, strict=False)
    xs = token_batches(device, 3)
    messages = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for i, x in enumerate(xs):
                model(input_ids=x, labels=x).loss.backward()  # use_cache left at its default
                if i == 0:
                    tgraph.create_graphs()
        except Exception as exc:  # noqa: BLE001 - any error type, judged by its message
            messages.append(f"{type(exc).__name__}: {exc}")
    messages += [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert any(re.search(r"use_cache=False", m) for m in messages), messages


def test_live_no_grad_output_of_recorded_step_does_not_block_create_graphs(backend, device):
    """The recorded iteration ends with a no-grad eval call whose outputs (the blocks'
    hidden states) the caller still holds; they await no backward, so create_graphs() must
    succeed, and must leave the held outputs intact."""
    model, eager = graphed_and_twin("gpt2", device, backend, strict=False)
    x = token_batches(device, 1)[0]
    model(input_ids=x, labels=x, use_cache=False).loss.backward()
    model.eval()
    with torch.no_grad():
        held = model(input_ids=x, use_cache=False, output_hidden_states=True)
    model.train()
    kept = [h.clone() for h in held.hidden_states]
    tgraph.create_graphs()
    for a, b in zip(held.hidden_states, kept):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    eager.eval()
    with torch.no_grad():
        ref = eager(input_ids=x, use_cache=False).logits
    torch.testing.assert_close(held.logits, ref, rtol=RTOL, atol=ATOL)


def test_llama_and_gpt2_layers_are_graphable_subclasses():
    """The helper swaps classes in place: same instances, tgraph first in the MRO."""
    for model in (tiny_llama("cpu"), tiny_gpt2("cpu")):
        before = list(model.modules())
        make_layers_graphable(model)
        assert list(model.modules()) == before
        layers = [m for m in model.modules() if isinstance(m, tgraph.GraphableModule)]
        assert len(layers) == 2
        assert all(type(m).__mro__[1] is tgraph.GraphableModule for m in layers)
