"""tgraph.integrations.transformers: one call graphs a Hugging Face model's decoder layers.

Each family is a tiny random-init config (2 layers, hidden 64, seq 16; no hub) trained with
AdamW for 3 steps, graphed and eager twins side by side (``copy.deepcopy`` before
``graph_layers``). Tolerance: on the emulated backend a replay runs the very kernels of the
eager call on the same inputs, so losses and gradients are compared bit for bit. On CUDA a graph
may pick another cuBLAS algorithm than the eager call and Adam's division by sqrt(v) magnifies
last-ulp differences: 1e-4 relative (tests/test_hf_models.py's ADAMW_TOL), which still fails
every real bug (a stale input, a lost gradient, a stale adapter move values by >= 1e-3).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install 'tgraph[dev]')")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers import logging as hf_logging  # noqa: E402

import tgraph  # noqa: E402
from tgraph.integrations import transformers as tg_hf  # noqa: E402

hf_logging.set_verbosity_error()

VOCAB, SEQ, BATCH, STEPS = 128, 16, 2, 3
DIMS = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=64, attn_implementation="sdpa")  # fmt: skip
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)  # fmt: skip
# arch -> (model_type, config overrides, experts implementation or None)
FAMILIES = {
    "llama": ("llama", dict(num_key_value_heads=2), None),  # GQA
    "qwen2": ("qwen2", dict(num_key_value_heads=2), None),
    "qwen3": ("qwen3", dict(num_key_value_heads=2, head_dim=16), None),
    "mistral": ("mistral", dict(num_key_value_heads=2, sliding_window=8), None),
    "gemma": ("gemma", dict(num_key_value_heads=1, head_dim=16), None),
    "gpt2": ("gpt2", dict(intermediate_size=None), None),
    "gpt_neox": ("gpt_neox", {}, None),
    # dropout 0.1; transformers <= 5.17 draws LayerDrop's number before every layer
    "opt": (
        "opt",
        dict(ffn_dim=128, word_embed_proj_dim=64, dropout=0.1, attention_dropout=0.1),
        None,
    ),
    "qwen2_moe/batched_mm": ("qwen2_moe", dict(MOE, num_key_value_heads=2), "batched_mm"),
    "qwen3_moe/grouped_mm": ("qwen3_moe", dict(MOE, num_key_value_heads=2), "grouped_mm"),
    "mixtral/batched_mm": ("mixtral", dict(MOE, num_key_value_heads=2), "batched_mm"),
}


def tol(backend: str) -> dict:
    return dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=1e-4, atol=1e-5)


def family_model(arch: str, device, *, seed: int = 0, **extra):
    model_type, overrides, experts = FAMILIES[arch]
    kw = {k: v for k, v in {**DIMS, **overrides, **extra}.items() if v is not None}
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    if experts is not None:
        model.set_experts_implementation(experts)
    if experts == "grouped_mm" and device.type == "cuda":
        model.to(torch.bfloat16)  # torch's grouped GEMM on CUDA (float32 is refused, below)
    return model.to(device)


def batches(device, n: int = STEPS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(n)]


def train(model, xs, *, graphed: bool, lr: float = 1e-3, **call):
    """AdamW steps; ``create_graphs()`` after the first (recorded) one. Losses and gradients."""
    torch.manual_seed(0)  # the same dropout masks, graphed or eager (GPT-2 has dropout 0.1)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)
    losses, grads = [], []
    for i, x in enumerate(xs):
        loss = model(input_ids=x, labels=x, **call).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and i == 0:
            assert tgraph.create_graphs().graphs > 0
    return torch.stack(losses), grads


def assert_same_training(got, want, tolerance):
    torch.testing.assert_close(got[0], want[0], **tolerance)
    for step, (g, w) in enumerate(zip(got[1], want[1])):
        assert g.keys() == w.keys(), f"step {step}: parameters with a gradient differ"
        for name in g:
            torch.testing.assert_close(g[name], w[name], **tolerance, msg=f"step {step} {name}")


def graphed_and_twin(arch, device, backend, **enable):
    model = family_model(arch, device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, backend=backend, **{"strict": True, **enable})
    return model, eager


# ------------------------------------------------------------------------- families


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_training_matches_eager(backend, device, arch):
    """Default calls (``model(input_ids, labels)``, ``use_cache`` left alone) replay graphs."""
    check_family_training(arch, device, backend)


def check_family_training(arch, device, backend, **enable):
    model, eager = graphed_and_twin(arch, device, backend, **enable)
    xs = batches(device)
    # bfloat16 (grouped_mm on CUDA): the same kernels graphed and eager; torch's bf16 tolerance
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    assert_same_training(
        train(model, xs, graphed=True),
        train(eager, xs, graphed=False),
        {} if bf16 else tol(backend),
    )
    # the final norm (norm, ln_f, final_layer_norm) joined the layers' merged stack
    report = tgraph.capture_report()
    assert report.runners == DIMS["num_hidden_layers"] + 1 and report.segments >= 1, report


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_family_whole_model_training_matches_eager(backend, device, arch, swaps):
    """``graph_layers(whole=True)``: each family's whole model is one unit (one runner; strict,
    so every later call replayed and the shadow verifier passed its first replays)."""
    model, eager = graphed_and_twin(arch, device, backend, whole=True)
    xs = batches(device)
    bf16 = next(model.parameters()).dtype == torch.bfloat16
    assert_same_training(
        train(model, xs, graphed=True),
        train(eager, xs, graphed=False),
        {} if bf16 else tol(backend),
    )
    report = tgraph.capture_report()
    assert (report.runners, report.graphs) == (1, 2), report


def test_float32_grouped_experts_on_cuda_are_refused_with_the_fix(device):
    if device.type != "cuda":
        pytest.skip("grouped_mm takes float32 on the CPU")
    model = family_model("qwen3_moe/grouped_mm", device).float()
    with pytest.raises(ValueError, match=r"bfloat16.*batched_mm"):
        tg_hf.graph_layers(model)


def test_eager_expert_loop_is_refused_with_the_fix(device):
    model = family_model("qwen2_moe/batched_mm", device)
    model.set_experts_implementation("eager")
    with pytest.raises(ValueError, match=r'set_experts_implementation\("batched_mm"\)'):
        tg_hf.graph_layers(model)


def test_state_dict_keys_unchanged_and_ungraph_restores(device):
    model = family_model("llama", device)
    keys, cls = list(model.state_dict()), type(model.model.layers[0])
    tg_hf.graph_layers(model, backend="emulated")
    assert isinstance(model.model.layers[0], tgraph.GraphableModule)
    assert list(model.state_dict()) == keys and model.config.use_cache is True
    (x,) = batches(device, 1)
    assert model(input_ids=x).past_key_values is None  # unset use_cache: no cache built
    assert model(input_ids=x, use_cache=None).past_key_values is None
    tg_hf.ungraph(model)
    assert type(model.model.layers[0]) is cls
    assert model(input_ids=x).past_key_values is not None


# ------------------------------------------------------------- gradient checkpointing


def checkpointing_on(model, *, use_reentrant: bool) -> None:
    """``gradient_checkpointing_enable``, by its newer name where transformers has one."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def checkpointing_run(device, backend, *, ckpt: bool, graphed: bool):
    model = family_model("llama", device)
    if ckpt:
        checkpointing_on(model, use_reentrant=False)
    if graphed:
        tg_hf.graph_layers(model, backend=backend, strict=True)
    result = train(model, batches(device), graphed=graphed)
    saved = tgraph.memory_report().saved_activations
    tgraph.disable(model)
    return result, saved


def test_gradient_checkpointing_recomputes_inside_the_graphs(backend, device):
    """Checkpointed graphs keep fewer saved activations (the backward graph recomputes the
    layers) and give eager checkpointing's gradients."""
    plain, saved_plain = checkpointing_run(device, backend, ckpt=False, graphed=True)
    ckpt, saved_ckpt = checkpointing_run(device, backend, ckpt=True, graphed=True)
    eager_ckpt, _ = checkpointing_run(device, backend, ckpt=True, graphed=False)
    assert saved_plain > 0 and saved_ckpt < saved_plain / 2, (saved_ckpt, saved_plain)
    assert_same_training(ckpt, eager_ckpt, tol(backend))
    assert_same_training(plain, eager_ckpt, tol(backend))


def test_reentrant_checkpointing_is_refused_with_the_fix(device):
    model = family_model("llama", device)
    checkpointing_on(model, use_reentrant=True)
    tg_hf.graph_layers(model, backend="emulated")
    (x,) = batches(device, 1)
    with pytest.raises(
        ValueError, match=r'gradient_checkpointing_kwargs=\{"use_reentrant": False\}'
    ):
        model(input_ids=x, labels=x)


def test_checkpointing_switched_on_after_capture_is_not_replayed(backend, device):
    model, eager = graphed_and_twin("llama", device, backend, strict=False)
    xs = batches(device, 2)
    train(model, xs[:1], graphed=True)
    checkpointing_on(model, use_reentrant=False)
    with pytest.warns(
        tgraph.GraphFallbackWarning,
        match="'gradient checkpointing off' to 'gradient checkpointing on'",
    ):
        loss = model(input_ids=xs[1], labels=xs[1]).loss
    loss.backward()


# ---------------------------------------------------------------- output recording


def recorded_call(model, x, flag):
    return model(input_ids=x, labels=x, **{flag: True})


def test_output_hidden_states_replays_and_matches(backend, device):
    """The layers' own hooks record the hidden states around every replay. The flag reaches the
    layers as an argument, so the recorded iteration must carry it too (strict: no fallback)."""
    model, eager = graphed_and_twin("llama", device, backend)
    xs = batches(device)
    flag = dict(output_hidden_states=True)
    assert_same_training(
        train(model, xs[:2], graphed=True, **flag),
        train(eager, xs[:2], graphed=False, **flag),
        tol(backend),
    )
    got, want = (
        recorded_call(model, xs[2], "output_hidden_states"),
        recorded_call(eager, xs[2], "output_hidden_states"),
    )
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    torch.testing.assert_close(list(got.hidden_states), list(want.hidden_states), **tol(backend))


def test_output_router_logits_runs_eagerly_and_matches(backend, device):
    """Router logits are recorded by hooks inside the layers, which a replay does not run: the
    layers run eagerly, with a warning (strict: an error) naming them."""
    model, eager = graphed_and_twin("qwen2_moe/batched_mm", device, backend, strict=False)
    xs = batches(device, 2)
    train(model, xs[:1], graphed=True)
    train(eager, xs[:1], graphed=False)
    with pytest.warns(tgraph.GraphFallbackWarning, match="router_logits"):
        got = recorded_call(model, xs[1], "output_router_logits")
    want = recorded_call(eager, xs[1], "output_router_logits")
    assert len(got.router_logits) == len(want.router_logits) == 2
    torch.testing.assert_close(list(got.router_logits), list(want.router_logits), **tol(backend))
    torch.testing.assert_close(got.aux_loss, want.aux_loss, **tol(backend))
    tgraph.disable(model)
    tg_hf.graph_layers(model, backend=backend, strict=True)
    train(model, xs[:1], graphed=True)
    with pytest.raises(tgraph.GraphFallbackError, match="router_logits"):
        recorded_call(model, xs[1], "output_router_logits")


# ----------------------------------------------------------------------- the cache


def test_a_cache_asked_for_runs_eagerly_and_is_filled(backend, device):
    """``use_cache=True`` hands the layers a DynamicCache: never baked into a graph."""
    model, eager = graphed_and_twin("llama", device, backend, strict=False)
    xs = batches(device, 2)
    train(model, xs[:1], graphed=True)
    train(eager, xs[:1], graphed=False)
    model.eval(), eager.eval()
    with torch.no_grad():
        with pytest.warns(tgraph.GraphFallbackWarning, match="use_cache=False"):
            got = model(input_ids=xs[1], use_cache=True)
        want = eager(input_ids=xs[1], use_cache=True)
    assert got.past_key_values.get_seq_length() == SEQ
    torch.testing.assert_close(got.logits, want.logits, **tol(backend))


def test_packed_position_ids_keep_the_configs_cache_and_eagers_result(backend, device):
    """Position ids that restart per packed document, no attention mask, ``use_cache`` at the
    config's True: eager attends across the documents (a cache turns transformers' packed mask
    off). ``graph_layers``' ``use_cache=False`` default would mask them apart, another loss; it
    keeps the config's cache there, so the layers run eagerly, warned, with eager's result."""
    model, eager = graphed_and_twin("llama", device, backend, strict=False)
    assert model.config.use_cache is True
    xs = batches(device)
    train(model, xs[:1], graphed=True)  # a plain recorded step: the layers graph
    train(eager, xs[:1], graphed=False)
    pos = torch.cat([torch.arange(6), torch.arange(SEQ - 6)]).expand(BATCH, SEQ).to(device)
    for x in xs[1:]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            got = model(input_ids=x, labels=x, position_ids=pos)
        want = eager(input_ids=x, labels=x, position_ids=pos)
        torch.testing.assert_close(got.loss, want.loss, **tol(backend))
        torch.testing.assert_close(got.logits, want.logits, **tol(backend))
        assert any("position_ids and no attention_mask" in str(w.message) for w in seen), seen


# ---------------------------------------------------------------------- PEFT LoRA


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3_moe/grouped_mm"])
def test_family_training_with_direct_grads_matches_eager(backend, device, arch):
    """enable(direct_grads=True): the graphed node writes every decoder layer's .grad itself
    (tgraph.layers.direct_grads.DirectGrads); the gradients and losses stay eager's, exactly on the emulated
    backend."""
    check_family_training(arch, device, backend, direct_grads=True)


def lora_model(device):
    peft = pytest.importorskip("peft", reason="needs peft (pip install 'tgraph[dev]')")
    base = family_model("llama", device)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # lora_B starts at zero; make the adapters matter from step one
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("direct", [False, True], ids=["autograd", "direct_grads"])
def test_lora_training_matches_eager(backend, device, direct):
    """Frozen base weights, trained adapters; also with direct_grads (only the adapters get
    .grad, written by the node)."""
    model = lora_model(device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, backend=backend, strict=True, direct_grads=direct)
    xs = batches(device)
    got = train(model, xs, graphed=True, lr=1e-2)
    assert all("lora_" in n for n in got[1][0])
    assert_same_training(got, train(eager, xs, graphed=False, lr=1e-2), tol(backend))


def test_disable_adapter_is_never_replayed_stale(backend, device):
    model = lora_model(device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, backend=backend)
    xs = batches(device, 2)
    train(model, xs[:1], graphed=True)
    train(eager, xs[:1], graphed=False)
    x = xs[1]
    with model.disable_adapter(), eager.disable_adapter():
        with pytest.warns(
            tgraph.GraphFallbackWarning,
            match=r"adapters disabled|requires_grad of the module's parameters",
        ):
            off = model(input_ids=x, labels=x).loss
        off_want = eager(input_ids=x, labels=x).loss
    with warnings.catch_warnings():
        warnings.simplefilter("error", tgraph.GraphFallbackWarning)  # adapters back on: replays
        on = model(input_ids=x, labels=x).loss
    on_want = eager(input_ids=x, labels=x).loss
    assert not torch.allclose(on_want, off_want), "the adapters must change the loss"
    torch.testing.assert_close(off, off_want, **tol(backend))
    torch.testing.assert_close(on, on_want, **tol(backend))


def test_rescaled_adapters_are_never_replayed_stale(backend, device):
    """A LoRA scale is a Python float the graphs baked in, with no parameter frozen or
    unfrozen: the layers' state key alone tells the calls apart."""
    model = lora_model(device)
    eager = copy.deepcopy(model)
    tg_hf.graph_layers(model, backend=backend)
    xs = batches(device, 2)
    train(model, xs[:1], graphed=True)
    train(eager, xs[:1], graphed=False)
    for m in (model, eager):
        for layer in m.modules():
            if hasattr(layer, "scale_layer") and hasattr(layer, "lora_A"):
                layer.scale_layer(0.5)
    x = xs[1]
    with pytest.warns(
        tgraph.GraphFallbackWarning, match=r"adapters default\*2\.0' to .*default\*1\.0"
    ):
        got = model(input_ids=x, labels=x).loss
    torch.testing.assert_close(got, eager(input_ids=x, labels=x).loss, **tol(backend))
