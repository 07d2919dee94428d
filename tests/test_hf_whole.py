"""``graph_layers(model, whole=True)``: a transformers model as one graphed unit, from the
embeddings through the layers, the final norm, the head and the loss of ``labels=``.

Each test compares with a stock twin (never made graphable) run on the same batches and
generator states. ``strict=True`` makes any call that does not replay raise, so a passing
training run replayed every call after the recorded one; the capture report's counts show
that the unit is the whole model (one forward and one backward graph), not its layers.
"""

from __future__ import annotations

import copy
import gc
import sys
import warnings

import pytest
import torch

pytest.importorskip("transformers")

from hf_models import VOCAB, tiny_model, token_batches  # noqa: E402
from layer_models import ATOL, RTOL  # noqa: E402

import tgraph  # noqa: E402
from tgraph.integrations import transformers as tg_hf  # noqa: E402

LR = 1e-3


def whole_and_twin(kind: str, device, backend: str, *, strict: bool = True, **model_kw):
    model = tiny_model(kind, device, **model_kw)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, whole=True, backend=backend, strict=strict)
    return model, eager


def train(model, xs, *, graphed: bool, eval_x=None, report=None):
    """AdamW steps on ``xs`` (labels = inputs); create_graphs() after the first step, which is
    the recorded iteration (with a no-grad eval call when ``eval_x`` is given), expecting
    ``report`` (runners, graphs): by default the whole model's. Returns the losses, the eval
    logits and the parameters after the last step."""
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    losses, logits = [], []
    for i, x in enumerate(xs):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if eval_x is not None:
            model.eval()
            with torch.no_grad():
                logits.append(model(input_ids=eval_x).logits.clone())
            model.train()
        if graphed and i == 0:
            got = tgraph.create_graphs()
            want = report or (1 + (eval_x is not None), 3 if eval_x is not None else 2)
            assert (got.runners, got.graphs) == want, got
    params = [p.detach().clone() for p in model.parameters()]
    return torch.stack(losses), logits, params


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_whole_model_trains_as_eager(backend, device, kind, swaps):
    """Dropout on: each replay draws fresh masks, eager's (a frozen mask would differ)."""
    model, eager = whole_and_twin(kind, device, backend, dropout=0.1)
    xs = token_batches(device, 5)
    x_eval = token_batches(device, 1, seed=7)[0]
    g_losses, g_logits, g_params = train(model, xs, graphed=True, eval_x=x_eval)
    e_losses, e_logits, e_params = train(eager, xs, graphed=False, eval_x=x_eval)
    assert tgraph.eager_calls() == 0
    assert torch.equal(g_losses, e_losses), (g_losses, e_losses)
    assert all(map(torch.equal, g_logits, e_logits))
    assert all(map(torch.equal, g_params, e_params))


def test_whole_model_state_changed_after_capture_runs_eagerly_named(backend, device):
    """Gradient checkpointing turned on after capture: the graph baked the layers without it,
    so the call runs eagerly (warned, naming the change) with eager's result."""
    model, eager = whole_and_twin("llama", device, backend, strict=False)
    xs = token_batches(device, 3)
    train(model, xs[:1], graphed=True)
    train(eager, xs[:1], graphed=False)
    for m in (model, eager):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    before = tgraph.eager_calls()
    with pytest.warns(tgraph.GraphFallbackWarning, match="gradient checkpointing on"):
        got = model(input_ids=xs[1], labels=xs[1]).loss
    want = eager(input_ids=xs[1], labels=xs[1]).loss
    assert tgraph.eager_calls() == before + 1
    assert torch.equal(got, want)
    got.backward()
    want.backward()
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_whole_model_unrecorded_call_runs_eagerly_and_recorded_calls_replay(backend, device):
    """A call without labels was not recorded: it runs eagerly (warned) with eager's logits;
    the recorded call still replays afterwards (strict on the next one)."""
    model, eager = whole_and_twin("gpt2", device, backend, strict=False)
    xs = token_batches(device, 3)
    train(model, xs[:1], graphed=True)
    train(eager, xs[:1], graphed=False)
    with pytest.warns(tgraph.GraphFallbackWarning):
        got = model(input_ids=xs[1]).logits
    assert torch.equal(got, eager(input_ids=xs[1]).logits)
    n = tgraph.eager_calls()
    with warnings.catch_warnings():
        warnings.simplefilter("error", tgraph.GraphFallbackWarning)
        loss = model(input_ids=xs[2], labels=xs[2]).loss
    assert tgraph.eager_calls() == n
    assert torch.equal(loss, eager(input_ids=xs[2], labels=xs[2]).loss)


def test_whole_model_refuses_a_module_without_transformers_model():
    with pytest.raises(ValueError, match="no transformers PreTrainedModel"):
        tg_hf._outermost_model(torch.nn.Linear(2, 2))


def test_ungraph_restores_the_whole_models_class(device):
    model = tiny_model("llama", device)
    cls = type(model)
    tg_hf.graph_layers(model, whole=True, backend="emulated")
    assert isinstance(model, tgraph.GraphableModule)
    tg_hf.ungraph(model)
    assert type(model) is cls and "_tgraph_hf_layers" not in model.__dict__
    x = torch.randint(0, VOCAB, (1, 8), device=device)
    model(input_ids=x, labels=x).loss.backward()  # a plain model again


def test_whole_model_around_peft_lora_trains_as_eager(backend, device, swaps):
    """PEFT LoRA around Llama: the transformers model inside is the unit (strict: it replays);
    the adapters disabled after capture (their state is in the key) run eagerly, named."""
    peft = pytest.importorskip("peft")
    base = tiny_model("llama", device)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, whole=True, backend=backend)
    xs = token_batches(device, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tgraph.GraphFallbackWarning)  # as strict, for training
        g_losses, _, g_params = train(model, xs, graphed=True)
    e_losses, _, e_params = train(eager, xs, graphed=False)
    assert tgraph.eager_calls() == 0
    assert torch.equal(g_losses, e_losses)
    assert all(map(torch.equal, g_params, e_params))
    with model.disable_adapter(), eager.disable_adapter():
        with pytest.warns(tgraph.GraphFallbackWarning):  # names requires_grad or the adapters
            got = model(input_ids=xs[0], labels=xs[0]).loss
        assert torch.equal(got, eager(input_ids=xs[0], labels=xs[0]).loss)


def test_grouped_kv_heads_replay_eagers_bits_or_run_eagerly_warned(backend, device, swaps):
    """Grouped k/v heads: transformers' capture branch (explicit mask) may repeat them in Python
    where eager lets SDPA group them. Either the replays pass the verifier (no fallback) or the
    verifier finds the difference and the model runs eagerly, warned. Emulated, at this size
    (head dim 16, 16 tokens): eager's bits, by luck of the CPU kernel's blocking (at head dim 8
    the sums differ: test_grouped_kv_heads_input_gradients_eagers_bits_per_layer_rounding_whole).
    CUDA (an H100, transformers 5.17, 2026-12-07): the loss bit for bit, the gradients of the
    k/v projections summed over each group in another order (repeat_kv's backward against
    SDPA's own), so the parameters after 4 AdamW steps agree within the CUDA tolerance of
    ``layer_models`` (a few ulps), which the verifier's tolerance passes by design (README,
    "The whole model")."""
    from transformers import LlamaForCausalLM

    config = tiny_model("llama", "cpu").config
    config.num_key_value_heads = 2  # of 4 heads
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, whole=True, backend=backend, strict=False)
    xs = token_batches(device, 4)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", tgraph.GraphFallbackWarning)
        g_losses, _, g_params = train(model, xs, graphed=True)
    e_losses, _, e_params = train(eager, xs, graphed=False)
    fallbacks = [w for w in seen if issubclass(w.category, tgraph.GraphFallbackWarning)]
    assert bool(fallbacks) == bool(tgraph.eager_calls())
    assert all("differ" in str(w.message) or "verif" in str(w.message) for w in fallbacks)
    assert torch.equal(g_losses, e_losses)
    if backend == "emulated":
        assert all(map(torch.equal, g_params, e_params))
    else:
        for g, e in zip(g_params, e_params):
            torch.testing.assert_close(g, e, rtol=RTOL, atol=ATOL)


def test_whole_model_config_changed_after_capture_runs_eagerly_named(backend, device):
    """The whole model's forward reads its config at every call: ``output_hidden_states`` set
    on the config after capture must not replay a graph that returns none (a stale replay
    would hand back no hidden states); the call runs eagerly, naming the entry."""
    model, eager = whole_and_twin("llama", device, backend, strict=False)
    xs = token_batches(device, 2)
    train(model, xs[:1], graphed=True)
    train(eager, xs[:1], graphed=False)
    for m in (model, eager):
        m.config.output_hidden_states = True
    with pytest.warns(tgraph.GraphFallbackWarning, match="config changed: output_hidden_states"):
        got = model(input_ids=xs[1], labels=xs[1])
    want = eager(input_ids=xs[1], labels=xs[1])
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    assert all(map(torch.equal, got.hidden_states, want.hidden_states))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_whole_model_microbatches_in_flight_and_another_order(backend, device, kind):
    """Recorded: two forwards then one backward, then a forward and backward alone (two
    runners). Replayed in that order, the model's dropout on. Llama: eager's bits. GPT-2 ties
    its head to the embedding: eager's engine adds that weight's four contributions of the two
    microbatches in its own order, the replays add each unit's sum (taken inside its graph)
    one after the other, so the weight's gradient may differ in the last bit (float addition
    is not associative): compared within rounding there, bit for bit elsewhere."""
    model, eager = whole_and_twin(kind, device, backend, dropout=0.1)
    xs = token_batches(device, 12)
    results = []
    for m, graphed in ((model, True), (eager, False)):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        losses = []
        for i in range(4):
            a, b, c = xs[3 * i : 3 * i + 3]
            la, lb = m(input_ids=a, labels=a).loss, m(input_ids=b, labels=b).loss
            (la + lb).backward()
            lc = m(input_ids=c, labels=c).loss
            lc.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(torch.stack([la, lb, lc]).detach())
            if graphed and i == 0:
                assert tgraph.create_graphs().runners == 2
        results.append((torch.stack(losses), [p.detach().clone() for p in m.parameters()]))
    (g_losses, g_params), (e_losses, e_params) = results
    assert tgraph.eager_calls() == 0
    if kind == "llama":
        assert torch.equal(g_losses, e_losses)
        assert all(map(torch.equal, g_params, e_params))
    else:
        torch.testing.assert_close(g_losses, e_losses, rtol=1e-6, atol=1e-6)
        # AdamW's normalised step turns a last-bit difference of a near-zero gradient into up
        # to ~lr * 1e-2 (the per-layer HF tests' tolerance); a stale value moves far more
        torch.testing.assert_close(g_params, e_params, rtol=1e-4, atol=1e-5)


def test_whole_model_key_tells_which_layer_changed(device):
    """The layers' states in the whole model's key are per layer: checkpointing moved from one
    layer to another keeps the set of states, not the key."""
    model = tiny_model("llama", device, n_layer=2)
    tg_hf.graph_layers(model, whole=True, backend="emulated")
    layers = model._tgraph_hf_layers
    layers[0].gradient_checkpointing = True
    first = tg_hf._model_state(model, layers)
    layers[0].gradient_checkpointing, layers[1].gradient_checkpointing = False, True
    assert tg_hf._model_state(model, layers) != first
    layers[1].gradient_checkpointing = False
    assert tg_hf._model_state(model, layers) == "gradient checkpointing off"


def test_whole_model_config_entries_without_equality_compare_by_identity(device):
    """An entry whose copy does not compare equal (an object without ``__eq__``) is compared
    by identity: unchanged, the key says nothing changed; replaced, it names the entry."""

    class Opaque:
        pass

    model = tiny_model("llama", device)
    model.config.opaque = Opaque()
    tg_hf.graph_layers(model, whole=True, backend="emulated")
    assert "config changed" not in tg_hf._model_state(model, model._tgraph_hf_layers)
    model.config.opaque = Opaque()
    assert "config changed: opaque" in tg_hf._model_state(model, model._tgraph_hf_layers)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager_code", "compiled"])
def test_a_model_that_cannot_be_graphed_whole_keeps_its_layers_graphs(
    backend, device, replays, compiled
):
    """Dynamic RoPE scaling reads the largest position id on the host in the model's own code,
    so the whole model cannot be captured; its layers (and final norm), recorded inside its
    recorded call, keep graphs of their own: one merged stack, replayed (a forward and a
    backward replay per step), eager's bits, no fallback counted. Compiled
    (``compile=True``): the layers were recorded inside the compiled model's call, outside
    dynamo's trace, and replay their compiled code (within float32 reordering, as
    ``test_compile``); the compiled code between the last layer and the final norm makes an
    autograd node, which the stack cannot tell from an auxiliary loss on the last layer's
    output, so the norm is not merged (and runs plainly: it is graphed only merged)."""
    from transformers import LlamaForCausalLM

    torch._dynamo.reset()
    config = tiny_model("llama", "cpu").config
    config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, whole=True, backend=backend, strict=False, compile=compiled)
    xs = token_batches(device, 4)
    with pytest.warns(tgraph.GraphFallbackWarning, match="keep their own graphs"):
        g_losses, _, g_params = train(model, xs, graphed=True, report=(2 if compiled else 3, 2))
    e_losses, _, e_params = train(eager, xs, graphed=False)
    torch._dynamo.reset()
    assert tgraph.capture_report().segments == 1
    assert [u.split(" (eager code")[0] for u in tgraph.capture_report().unmerged] == (
        ["model.layers.1 (GraphableLlamaDecoderLayer) and model.norm (GraphableLlamaRMSNorm)"]
        if compiled
        else []
    )
    assert replays[0] == 2 * (len(xs) - 1)  # the stack's forward and backward, each later step
    assert tgraph.eager_calls() == 0
    if compiled:
        torch.testing.assert_close(g_losses, e_losses, rtol=1e-5, atol=1e-5)
        for g, e in zip(g_params, e_params):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
        return
    assert torch.equal(g_losses, e_losses)
    assert all(map(torch.equal, g_params, e_params))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_whole_model_recorded_with_gradient_checkpointing_trains_as_eager(backend, device, kind):
    """Gradient checkpointing (non-reentrant) on before graph_layers: transformers hooks the
    input embedding (``enable_input_require_grads``), inside the whole unit; its effect is
    part of the captured autograd graph, so the model captures (it raised as an undeclared
    hook), and trains as eager with every replay verified against an eager twin (whose layers
    run checkpointed inside checkpointed parts)."""
    model = tiny_model(kind, device, dropout=0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, whole=True, backend=backend, strict=True)
    xs = token_batches(device, 4)
    with tgraph.verification(every=1):
        g_losses, _, g_params = train(model, xs, graphed=True)
    e_losses, _, e_params = train(eager, xs, graphed=False)
    assert tgraph.eager_calls() == 0
    assert torch.equal(g_losses, e_losses)
    for p, q in zip(g_params, e_params):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_attention_masks_that_change_after_capture_give_eagers_numbers(backend, device, kind):
    """Recorded with an all-ones attention mask, replayed with padded ones every other step.
    Eager branches on the mask's values (all ones: SDPA's causal flag; padding: an explicit
    mask); the captured branch builds the mask from the values inside the graph, so each
    replay computes what eager does (strict: every call replayed)."""
    model, eager = whole_and_twin(kind, device, backend)
    xs = token_batches(device, 4)
    masks = [torch.ones_like(x) for x in xs]
    for m in masks[1::2]:
        m[0, -3:] = 0

    def run(m, graphed):
        torch.manual_seed(0)
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        out = []
        for i, (x, mask) in enumerate(zip(xs, masks)):
            loss = m(input_ids=x, attention_mask=mask, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.detach())
            if graphed and i == 0:
                tgraph.create_graphs()
        return torch.stack(out)

    got, want = run(model, True), run(eager, False)
    assert tgraph.eager_calls() == 0
    # on a GPU the all-ones steps may run another SDPA kernel than eager's causal flag (the
    # probe, BENCHMARKS.md): fp32's default tolerance there; bit for bit on the CPU
    torch.testing.assert_close(got, want, **({} if backend == "cuda" else {"rtol": 0, "atol": 0}))


def test_whole_model_compiled_records_its_layers_outside_dynamos_trace(
    backend, device, replays, monkeypatch
):
    """``graph_layers(whole=True, compile=True)``: the recorded call runs the compiled model,
    whose trace meets the layers' graphable calls (they record as the model's parts). tgraph's
    bookkeeping must run outside the trace: traced, dynamo made flight tokens without running
    their ``__init__`` and freed them at its cleanup, where their finalizers raised (seen only by
    ``sys.unraisablehook``). Training then matches eager, every call after the recorded one a
    replay of the whole model's two graphs. Inductor fuses kernels: within float32 reordering,
    as ``test_compile``."""
    torch._dynamo.reset()
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    model = tiny_model("llama", device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, whole=True, backend=backend, strict=True, compile=True)
    xs = token_batches(device, 4)
    g_losses, _, g_params = train(model, xs, graphed=True)
    e_losses, _, e_params = train(eager, xs, graphed=False)
    gc.collect()
    torch._dynamo.reset()
    assert not unraisable, [f"{u.exc_value!r} in {u.object}" for u in unraisable]
    assert tgraph.eager_calls() == 0 and replays[0] == 2 * 3  # strict: none ran eagerly
    torch.testing.assert_close(g_losses, e_losses, rtol=1e-5, atol=1e-5)
    for g, e in zip(g_params, e_params):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_saved_mid_training_keeps_the_whole_model_replaying(
    backend, device, replays, tmp_path
):
    """``save_pretrained`` writes records into the config (``architectures``: the graphable
    class; ``dtype``: the parameters' dtype by name, where it was unset): no forward reads
    them, so the whole model keeps replaying (strict) and trains as eager, and the checkpoint
    loads. A dtype that is not the parameters' is a change the forward may read: eager, named."""
    from transformers import AutoModelForCausalLM

    model, eager = whole_and_twin("llama", device, backend)
    xs = token_batches(device, 4)
    train(model, xs[:1], graphed=True)
    train(eager, xs[:1], graphed=False)
    model.save_pretrained(tmp_path / "ckpt")
    assert model.config.architectures == [type(model).__name__]
    n = replays[0]
    g_losses, _, g_params = train(model, xs[1:], graphed=False)
    e_losses, _, e_params = train(eager, xs[1:], graphed=False)
    assert replays[0] - n == 2 * 3 and tgraph.eager_calls() == 0
    assert torch.equal(g_losses, e_losses)
    assert all(map(torch.equal, g_params, e_params))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    model.config.dtype = "bfloat16"
    with pytest.raises(tgraph.GraphFallbackError, match="config changed: dtype='bfloat16'"):
        model(input_ids=xs[0], labels=xs[0])


@pytest.mark.parametrize("whole", [False, True], ids=["per_layer", "whole"])
def test_an_output_hidden_states_call_leaves_training_graphed(backend, device, whole, replays):
    """transformers installs its output-recording forward hooks on the attention modules (and
    sets a flag on the model) at the first ``output_hidden_states``/``output_attentions`` call,
    for good; they do nothing unless a call records. One such evaluation between training
    steps made every later step eager (the hook tables and the model's attributes had changed).
    Now those hooks and that flag count as captured: the steps after it replay, bit for bit
    with the eager twin (bitwise on the CPU; the files' tolerance on CUDA)."""
    model = tiny_model("llama", device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, whole=whole, backend=backend)
    xs, x_eval = token_batches(device, 5), token_batches(device, 1, seed=7)[0]
    tol = {"rtol": 0, "atol": 0} if device.type == "cpu" else {"rtol": RTOL, "atol": ATOL}
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (model, eager)]
    per_step = []
    for i, x in enumerate(xs):
        before = replays[0]
        losses = []
        for m, opt in zip((model, eager), opts):
            loss = m(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        torch.testing.assert_close(*losses, **tol)
        per_step.append(replays[0] - before)
        if i == 0:
            tgraph.create_graphs()
        if i == 1:
            for m in (model, eager):
                m.eval()
                with torch.no_grad(), warnings.catch_warnings():
                    warnings.simplefilter("ignore", tgraph.GraphFallbackWarning)
                    m(input_ids=x_eval, output_hidden_states=True)
                m.train()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, **tol)
    assert per_step[0] == 0 and per_step[1] > 0 and per_step[2:] == [per_step[1]] * 3, per_step


@pytest.mark.parametrize("whole", [False, True], ids=["per_layer", "whole"])
def test_grouped_kv_heads_input_gradients_eagers_bits_per_layer_rounding_whole(
    backend, device, whole, replays
):
    """Gradients w.r.t. ``inputs_embeds`` (saliency maps) of a Llama with 2 k/v heads of 4 at
    head dim 8, replayed, strict. Per-layer graphs: eager's bits on the CPU (transformers
    builds the mask outside the layers, as eager builds it). The whole model: the capture's
    explicit mask makes transformers repeat k and v in Python where eager lets SDPA group them,
    and the backward sums each group in another order: the loss bit for bit, the gradients
    within rounding (README, "The whole model"; a probe found 1.5e-8 to 2.2e-8 on the CPU), and
    no fallback: the verifier's tolerance passes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        attn_implementation="sdpa",
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg).to(device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, whole=whole, backend=backend, strict=True)
    exact = {"rtol": 0, "atol": 0} if device.type == "cpu" else {"rtol": RTOL, "atol": ATOL}
    tol = exact if not whole else {"rtol": RTOL, "atol": ATOL}
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, 64, (2, 12), generator=g).to(device)
        before = replays[0]
        got = []
        for m in (model, eager):
            emb = m.get_input_embeddings()(ids).detach().requires_grad_(True)
            loss = m(inputs_embeds=emb, labels=ids).loss
            got.append((loss.detach(), *torch.autograd.grad(loss, emb)))
            if i == 0 and m is model:
                tgraph.create_graphs()
        torch.testing.assert_close(got[0][0], got[1][0], **exact)
        torch.testing.assert_close(got[0][1], got[1][1], **tol)
        assert i == 0 or replays[0] - before == 2  # one forward and one backward graph
    assert tgraph.eager_calls() == 0
