"""DecodeEngine serves transformers causal LMs: greedy tokens equal ``model.generate``.

Each family runs tiny random configs in fp32 (nothing is downloaded) with prompts of several
lengths decoded together, so the batch is padded to its bucket (3 rows in bucket 4) and the
prompts to their prefill buckets (16 and 32). The reference is ``generate(do_sample=False)``
of each prompt alone, with transformers' own dynamic cache and masks.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from decode_models import recaptures  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tgraph.decode import DecodeEngine  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB = 128
NEW_TOKENS = 12
WINDOW = 8  # sliding window, shorter than every prompt + completion below
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
    rope_theta=500000.0,
)
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, num_key_value_heads=4)),
    "llama-gqa": lambda: LlamaForCausalLM(LlamaConfig(**COMMON, num_key_value_heads=2)),
    "llama-llama3-rope": lambda: LlamaForCausalLM(
        LlamaConfig(**COMMON, num_key_value_heads=2, rope_parameters=LLAMA3_ROPE)
    ),
    "llama-yarn-rope": lambda: LlamaForCausalLM(
        LlamaConfig(
            **COMMON,
            rope_parameters=dict(
                rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=1e4
            ),
        )
    ),
    "mistral-window": lambda: MistralForCausalLM(
        MistralConfig(**COMMON, num_key_value_heads=2, sliding_window=WINDOW)
    ),
    # layer 0 full attention, layer 1 a sliding window (layer_types from max_window_layers)
    "qwen2-window": lambda: Qwen2ForCausalLM(
        Qwen2Config(
            **COMMON,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        )
    ),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**COMMON, num_key_value_heads=1, head_dim=32)),
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(
            vocab_size=VOCAB,
            n_positions=128,
            n_embd=64,
            n_layer=2,
            n_head=4,
            bos_token_id=None,
            eos_token_id=None,
        )
    ),
}


def make(family: str, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]().to(device).eval()


def prompts(lengths=(3, 17, 9)) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def reference(model, ps: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy completions, one prompt at a time (no padding in the reference)."""
    out = []
    device = next(model.parameters()).device
    for p in ps:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            seq = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        out.append(seq[0, len(p) :].tolist())
    return out


def engine(model, backend: str, **kw) -> DecodeEngine:
    kw = dict(max_batch_size=4, max_seq_len=64, backend=backend, progress=False) | kw
    return DecodeEngine(model, **kw)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_generate(family, backend, device):
    model = make(family, device)
    ps = prompts()
    want = reference(model, ps)
    eng = engine(model, backend)
    assert eng.generate(ps, NEW_TOKENS) == want
    st = eng.stats
    assert st.bucket_steps and set(st.bucket_steps) <= {1, 2, 4} and st.eager_steps == 0
    assert st.prefill_bucket_steps == {16: 2, 32: 1} and st.prefill_eager == 0


def test_a_training_model_is_served_in_eval_mode_and_left_training(backend, device):
    """Sampling between training steps: the engine captures and decodes in eval mode (GPT-2's
    dropout off: the tokens of an eval copy's generate), and the model is training again after
    construction and after each generate, as the toy GPT's adapter leaves it."""
    model = make("gpt2", device)
    want = reference(model, prompts())
    model.train()
    eng = engine(model, backend)
    assert all(m.training for m in model.modules())  # after capture
    assert eng.generate(prompts(), NEW_TOKENS) == want
    assert all(m.training for m in model.modules())  # after generate
    model.eval()
    eng.generate(prompts(), 2)
    assert not any(m.training for m in model.modules())  # an eval model stays in eval mode
    for m in model.modules():  # training without dropout: the dropout modules stay in eval
        m.train(not isinstance(m, torch.nn.Dropout))
    flags = [m.training for m in model.modules()]
    assert eng.generate(prompts(), NEW_TOKENS) == want
    assert [m.training for m in model.modules()] == flags


@pytest.mark.parametrize("assign", [True, False], ids=["assign", "in_place"])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_weight_sync_reaches_the_graphs(family, backend, device, assign):
    """An RL weight sync, ``load_state_dict(sd, assign=True)`` (the model then holds the new
    tensors) or in place: the engine's greedy tokens equal ``generate`` of the new weights."""
    model = make(family, device)
    ps = prompts()
    eng = engine(model, backend)
    old = eng.generate(ps, NEW_TOKENS)
    torch.manual_seed(7)
    new = FAMILIES[family]().to(device).state_dict()
    model.load_state_dict(new, assign=assign)
    got = eng.generate(ps, NEW_TOKENS)
    assert got == reference(model, ps)
    assert got != old  # the test can tell the old weights' tokens apart
    st = eng.stats
    assert st.bucket_steps and st.eager_steps == 0 and st.prefill_eager == 0


def test_a_dtype_change_is_served_in_the_new_dtype(backend, device):
    """``model.to(torch.bfloat16)`` after capture: the next generate captures again over a KV
    cache (and masks) in bfloat16 and gives the bfloat16 model's tokens. On the CPU they equal
    ``generate``'s; on CUDA bfloat16 kernels may round apart from transformers' (fused RMSNorm,
    the rotation as one addcmul), so the reference there is the engine run eagerly."""
    model = make("qwen2-window", device)  # one whose greedy tokens bfloat16 changes
    ps = prompts()
    eng = engine(model, backend)
    old = eng.generate(ps, NEW_TOKENS)
    model.to(torch.bfloat16)
    got = eng.generate(ps, NEW_TOKENS)
    assert eng.cache.dtype == torch.bfloat16 and eng.stats.eager_steps == 0
    assert got == engine(model, backend, use_graphs=False).generate(ps, NEW_TOKENS)
    if device.type == "cpu":
        assert got == reference(model, ps)
        assert got != old  # bfloat16 changes this model's tokens here: stale graphs would show


def test_continuous_batching_and_eager_prefill_equal_generate(backend, device):
    """More requests than slots (they queue, join and leave), different output lengths, and a
    prompt above the largest prefill bucket (eager prefill)."""
    model = make("llama-gqa", device)
    ps = prompts((5, 20, 2, 11, 40))
    news = [6, 12, 3, 9, 5]
    want = [reference(model, [p], n)[0] for p, n in zip(ps, news)]
    eng = engine(model, backend, max_batch_size=2, prefill_sizes=[16, 32])
    assert eng.generate(ps, news) == want
    assert eng.stats.prefill_eager == 1


def test_graphs_equal_eager_when_sampling(backend, device):
    model = make("qwen2-window", device)
    ps = prompts()
    kw = dict(temperature=0.9, top_k=20, top_p=0.9, seed=5)
    graphed = engine(model, backend).generate(ps, NEW_TOKENS, **kw)
    assert graphed == engine(model, backend, use_graphs=False).generate(ps, NEW_TOKENS, **kw)


def layers_of(model) -> torch.nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def replace_head(model) -> None:
    torch.manual_seed(3)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, VOCAB, bias=False).to(model.device)


def replace_layer(model) -> None:
    new = copy.deepcopy(layers_of(model)[1])
    with torch.no_grad():
        for p in new.parameters():
            p.mul_(-2.0)
    layers_of(model)[1] = new


def replace_final_norm(model) -> None:
    new = copy.deepcopy(model.model.norm)
    with torch.no_grad():
        new.weight.mul_(-3.0)
    model.model.norm = new


def replace_embedding(model) -> None:
    torch.manual_seed(3)
    model.set_input_embeddings(torch.nn.Embedding(VOCAB, model.config.hidden_size).to(model.device))


def attention_scaling(model) -> None:
    for layer in layers_of(model):
        attn = layer.attn if hasattr(layer, "attn") else layer.self_attn
        attn.scaling = 2.0  # a Python float SDPA took as its scale


@pytest.mark.parametrize(
    "family, change",
    [("llama-gqa", change) for change in (replace_head, replace_layer, replace_final_norm,
                                          replace_embedding, attention_scaling)]
    + [("gpt2", replace_layer), ("gpt2", attention_scaling)],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)  # fmt: skip
def test_a_part_replaced_after_capture_is_served(family, change, backend, device, replays):
    """A submodule the adapter runs replaced after capture (the head, a decoder layer, the
    final norm, the embedding), or the attention scale it passes to SDPA changed: the next
    generate captures again over the model's current parts and its tokens are generate's of
    the changed model, replayed; an eager engine built before the change serves it too."""
    model = make(family, device)
    ps = prompts()
    eng = engine(model, backend)
    eager = engine(model, backend, use_graphs=False)
    recaptured = recaptures(eng)
    old = eng.generate(ps, NEW_TOKENS)
    change(model)
    want = reference(model, ps)
    assert want != old  # the change decodes other tokens: the old parts' would show
    before = replays[0]
    assert eng.generate(ps, NEW_TOKENS) == want
    assert replays[0] - before >= NEW_TOKENS and eng.stats.eager_steps == 0
    assert recaptured[0] == 1
    assert eng.generate(ps, NEW_TOKENS) == want and recaptured[0] == 1  # the new graphs replay
    assert eager.generate(ps, NEW_TOKENS) == want


def test_a_model_the_engine_can_no_longer_serve_names_the_fix(backend, device):
    """After capture: a vocabulary resized (the buffers and the sampler are sized for the old
    one) or a decoder layer whose own forward the adapter would bypass swapped in: generate()
    raises the adapter's error, naming the change and the fix, before any capture."""
    model = make("llama-gqa", device)
    eng = engine(model, backend)
    eng.generate(prompts(), 2)
    model.resize_token_embeddings(VOCAB + 16)
    with pytest.raises(
        RuntimeError,  # the adapter's own error, not a capture failure wrapping it
        match=r"^the served LlamaForCausalLM's vocab_size changed from 128 to 144 .*build a new "
        "DecodeEngine",
    ):
        eng.generate(prompts(), 2)
    model = make("llama-gqa", device)
    eng = engine(model, backend)
    eng.generate(prompts(), 2)
    layer = copy.deepcopy(model.model.layers[1])
    base = type(layer)
    layer.__class__ = type(
        "TiltedLayer", (base,), {"forward": lambda self, *a, **k: base.forward(self, *a, **k) + 1.0}
    )
    model.model.layers[1] = layer
    with pytest.raises(TypeError, match=r"model\.layers\.1 runs TiltedLayer\.forward"):
        eng.generate(prompts(), 2)


def lora_model(device):
    """A PEFT LoRA model around the GQA Llama, with two adapters (``default`` active) whose
    ``lora_B`` are not zero, so each changes the tokens."""
    peft = pytest.importorskip("peft", reason="needs peft (pip install 'tgraph[dev]')")
    targets = ["q_proj", "v_proj"]
    model = peft.get_peft_model(
        make("llama-gqa", device), peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    model.add_adapter("b", peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    torch.manual_seed(4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 1.0)
    return model.eval()


def lora_layers(model):
    return [m for m in model.modules() if hasattr(m, "set_scale") and hasattr(m, "lora_A")]


def set_scale(model) -> None:
    for m in lora_layers(model):
        m.set_scale("default", 5.0)


def scale_in_place(model) -> None:
    for m in lora_layers(model):
        m.scaling["default"] = 0.5  # the dict PEFT's forward reads, written in place


def test_peft_adapter_changes_after_capture_are_captured_again(backend, device, replays):
    """The model inside a PEFT model is served with its LoRA layers; PEFT then changes their
    state in place, where no module setter sees it (a rescale, a merge that writes the delta
    into the base weights, a switch to another adapter): each generate captures again and its
    tokens are generate's of the model as it is now, replayed. A stale graph would give the
    old scale's tokens, or after a merge add the delta twice."""
    peft_model = lora_model(device)
    model = peft_model.base_model.model
    ps = prompts()
    eng = engine(model, backend)
    recaptured = recaptures(eng)
    seen = [eng.generate(ps, NEW_TOKENS)]
    assert seen[0] == reference(model, ps)
    steps = [
        ("set_scale", lambda: set_scale(peft_model)),
        ("scaling written in place", lambda: scale_in_place(peft_model)),
        ("merge_adapter", peft_model.merge_adapter),
        ("unmerge_adapter", peft_model.unmerge_adapter),
        ("set_adapter", lambda: peft_model.set_adapter("b")),
    ]
    for i, (what, change) in enumerate(steps, 1):
        change()
        want = reference(model, ps)
        before = replays[0]
        assert eng.generate(ps, NEW_TOKENS) == want, what
        assert replays[0] - before >= NEW_TOKENS and eng.stats.eager_steps == 0, what
        assert recaptured[0] == i, what
        seen.append(want)
    assert len({str(t) for t in seen}) >= 4  # the changes decode other tokens


def test_a_peft_model_is_refused_naming_the_model_it_wraps():
    peft_model = lora_model(torch.device("cpu"))
    with pytest.raises(
        TypeError,
        match=r"the PEFT wrapper PeftModel itself: pass the model it wraps, "
        r"DecodeEngine\(peft_model\.base_model\.model, \.\.\.\).*merge_and_unload",
    ):
        DecodeEngine(peft_model, max_batch_size=1, max_seq_len=16, progress=False)


@pytest.mark.parametrize("family", ["mistral-window", "qwen2-window"])
def test_ignoring_the_sliding_window_is_caught(family, monkeypatch):
    """Planted bug: every layer attends to its whole past. The windows must matter here."""
    from tgraph.integrations import transformers_decode

    model = make(family, torch.device("cpu"))
    ps = prompts()
    want = reference(model, ps)
    monkeypatch.setattr(transformers_decode, "_window", lambda layer, attn, config: None)
    assert engine(model, "emulated", use_graphs=False).generate(ps, NEW_TOKENS) != want


def set_window(model, window) -> None:
    model.config.sliding_window = window


def window_on_layer_0(model) -> None:
    model.config.layer_types[0] = "sliding_attention"  # the list written in place


@pytest.mark.parametrize(
    "family, change",
    [("mistral-window", lambda m: set_window(m, None)), ("mistral-window", lambda m: set_window(m, 4)),
     ("qwen2-window", lambda m: set_window(m, 4)), ("qwen2-window", window_on_layer_0)],
    ids=["mistral-off", "mistral-4", "qwen2-4", "qwen2-layer-types"],
)  # fmt: skip
def test_a_config_window_changed_after_capture_is_served(family, change, backend, device, replays):
    """transformers' forward reads ``config.sliding_window`` (and Qwen2's ``layer_types``) at
    every call: changed after capture, the next generate captures again and its tokens are
    generate's of the changed model, replayed; an eager engine built before serves it too."""
    model = make(family, device)
    ps = prompts()
    eng = engine(model, backend)
    eager = engine(model, backend, use_graphs=False)
    recaptured = recaptures(eng)
    old = eng.generate(ps, NEW_TOKENS)
    eager.generate(ps, NEW_TOKENS)
    change(model)
    want = reference(model, ps)
    assert want != old  # the window matters here: the old one's tokens would show
    before = replays[0]
    assert eng.generate(ps, NEW_TOKENS) == want
    assert replays[0] - before >= NEW_TOKENS and eng.stats.eager_steps == 0
    assert recaptured[0] == 1
    assert eng.generate(ps, NEW_TOKENS) == want and recaptured[0] == 1  # the new graphs replay
    assert eager.generate(ps, NEW_TOKENS) == want


def test_the_adapter_reads_its_parts_anew_after_a_config_change():
    """The adapter's parts are cached between module writes; a config value they read changed
    in between is read at the next call (a hand-written step, no module write in between)."""
    from tgraph.integrations.transformers_decode import TransformersDecoder

    decoder = TransformersDecoder(make("mistral-window", torch.device("cpu")))
    assert decoder.parts().windows == (WINDOW, WINDOW)
    decoder.model.config.sliding_window = 3
    assert decoder.parts().windows == (3, 3)


def test_a_config_size_changed_after_capture_names_the_fix(backend, device):
    """``config.num_hidden_layers`` lowered (transformers' forward then runs fewer layers): the
    KV cache is sized for the old count, so the next call raises, naming the fix."""
    model = make("llama-gqa", device)
    for use_graphs in (True, False):
        model.config.num_hidden_layers = 2
        eng = engine(model, backend, use_graphs=use_graphs)
        eng.generate(prompts(), 2)
        model.config.num_hidden_layers = 1
        with pytest.raises(RuntimeError, match=r"n_layer changed from 2 to 1 .*build a new "
                           "DecodeEngine"):  # fmt: skip
            eng.generate(prompts(), 2)


def steer_by(strength: dict):
    """A forward hook adding ``strength["alpha"]`` times a direction to a module's output
    (a layer's MLP: activation steering), counting its calls."""

    def steer(module, args, out):
        strength["calls"] += 1
        return out + strength["alpha"] * torch.linspace(-1, 1, out.shape[-1], device=out.device)

    return steer


BYPASSED = [
    ("llama-gqa", ""),
    ("llama-gqa", "model"),
    ("llama-gqa", "model.layers.0"),
    ("llama-gqa", "model.layers.0.self_attn"),
    ("llama-gqa", "model.layers.1.input_layernorm"),  # run as F.rms_norm
    ("llama-gqa", "model.norm"),
    ("qwen3", "model.layers.0.self_attn.q_norm"),
    ("gpt2", "transformer.h.1"),
    ("gpt2", "transformer.h.0.attn"),
    ("gpt2", "transformer.h.0.attn.resid_dropout"),  # called only by the attention's forward
]


@pytest.mark.parametrize("use_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("family, where", BYPASSED, ids=lambda v: v or "the model")
def test_a_hook_the_adapter_never_runs_is_refused(family, where, use_graphs, backend, device):
    """The adapter runs a layer's parts, never the layer's, its attention's, an RMSNorm's or
    the model's forward: a hook there (activation steering on a decoder layer, the probe's
    case) would never run, and the tokens would be the unhooked model's. Refused by name."""
    model = make(family, device)
    model.get_submodule(where).register_forward_hook(steer_by({"alpha": 3.0, "calls": 0}))
    name = where or "the model"
    with pytest.raises(RuntimeError, match=rf"^DecodeEngine: {name} has the forward hook "
                       r"steer_by\.<locals>\.steer, which would never run"):  # fmt: skip
        engine(model, backend, use_graphs=use_graphs)
    model.get_submodule(where)._forward_hooks.clear()
    eng = engine(model, backend, use_graphs=use_graphs)
    eng.generate(prompts(), 2)
    model.get_submodule(where).register_forward_pre_hook(lambda m, args: None)
    with pytest.raises(RuntimeError, match=rf"^DecodeEngine: {name} has the forward pre-hook"):
        eng.generate(prompts(), 2)  # registered after capture: the next call


def test_hooks_on_the_modules_the_adapter_calls(backend, device, replays):
    """A steering hook on an MLP: the eager engine runs it at every call (a strength changed
    between calls is honoured: generate's tokens of the hooked model); the graphed engine
    refuses it unless capturable_hooks=True, which captures it and replays its effect."""
    model = make("llama-gqa", device)
    ps = prompts()
    strength = {"alpha": 0.0, "calls": 0}
    model.model.layers[0].mlp.register_forward_hook(steer_by(strength))
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp has the forward hook "
                       r"steer_by\.<locals>\.steer, which a graph would run at capture only"):  # fmt: skip
        engine(model, backend)
    eager = engine(model, backend, use_graphs=False)
    seen = []
    for alpha in (0.0, 4.0):
        strength["alpha"] = alpha
        want = reference(model, ps)
        strength["calls"] = 0
        assert eager.generate(ps, NEW_TOKENS) == want
        assert strength["calls"] == len(ps) + eager.stats.decode_steps  # every prefill and step
        seen.append(want)
    assert seen[0] != seen[1]  # the strength matters: a frozen one would show
    graphed = engine(model, backend, capturable_hooks=True)  # captured at alpha 4
    strength["calls"] = 0
    before = replays[0]
    assert graphed.generate(ps, NEW_TOKENS) == seen[1]
    assert replays[0] - before >= NEW_TOKENS and strength["calls"] == 0  # replays, no Python


def test_transformers_own_hooks_are_served(backend, device, replays):
    """transformers' output-recording hooks (installed on every layer and attention at the
    first ``output_hidden_states`` call, for good, inert otherwise) and
    ``enable_input_require_grads``' hook on the embedding do nothing for decode: served,
    replayed; the recording hooks installed after capture do not even capture again."""
    model = make("llama-gqa", device)
    ps = prompts()
    want = reference(model, ps)
    ids = torch.tensor([ps[0]], device=device)
    with torch.no_grad():
        model(ids, output_hidden_states=True)
    assert model.model.layers[0]._forward_hooks  # the recording hooks are there
    model.enable_input_require_grads()
    fresh = make("llama-gqa", device)
    late = engine(fresh, backend)
    recaptured = recaptures(late)
    late.generate(ps, 2)
    with torch.no_grad():
        fresh(ids, output_hidden_states=True)  # installed after capture
    for eng in (engine(model, backend), late):
        before = replays[0]
        assert eng.generate(ps, NEW_TOKENS) == want
        assert replays[0] - before >= NEW_TOKENS
    assert recaptured[0] == 0


def test_unsupported_architecture_is_named():
    torch.manual_seed(0)
    cfg = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64,
    )  # fmt: skip
    model = GPTNeoXForCausalLM(cfg)
    with pytest.raises(
        TypeError, match=r"no adapter for the transformers model GPTNeoXForCausalLM"
    ):
        DecodeEngine(model, max_batch_size=1, max_seq_len=16, progress=False)


class TiltedLlama(LlamaForCausalLM):
    """A user's subclass whose own ``forward`` changes the logits (a fixed bias per token)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + torch.linspace(0, 3, VOCAB, device=out.logits.device)
        return out


class StockForward(LlamaForCausalLM):
    """A subclass that adds a method and keeps transformers' forward: served as stock."""

    def describe(self) -> str:
        return "stock forward"


def tilted(layer_override: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(**COMMON, num_key_value_heads=2)
    if not layer_override:
        return TiltedLlama(cfg).eval()
    model = LlamaForCausalLM(cfg).eval()
    layer = model.model.layers[1]
    base = type(layer)
    # a decoder layer whose own forward shifts its output: bypassed by the adapter
    tilted_layer = type(
        "TiltedLayer", (base,), {"forward": lambda self, *a, **k: base.forward(self, *a, **k) + 1.0}
    )
    layer.__class__ = tilted_layer
    return model


@pytest.mark.parametrize("layer_override", [False, True], ids=["model", "layer"])
def test_a_forward_the_adapter_bypasses_is_refused_by_name(layer_override):
    """The adapter runs a model's parts, never its own forward: a class whose forward is not
    transformers' (a subclass of a supported one) would be served the stock tokens."""
    model = tilted(layer_override)
    with torch.no_grad():  # the override changes greedy tokens: serving it stock is wrong
        stock = LlamaForCausalLM(model.config).eval()
        stock.load_state_dict(model.state_dict())
        assert reference(model, prompts()) != reference(stock, prompts())
    where = (
        r"model\.layers\.1 runs TiltedLayer\.forward"
        if layer_override
        else r"the model runs TiltedLlama\.forward"
    )
    with pytest.raises(TypeError, match=rf"cannot serve \w+: {where}.*prefill/decode_step"):
        DecodeEngine(model, max_batch_size=1, max_seq_len=16, progress=False)


def test_a_subclass_keeping_the_stock_forward_and_graphed_layers_are_served(backend, device):
    torch.manual_seed(0)
    model = StockForward(LlamaConfig(**COMMON, num_key_value_heads=2)).to(device).eval()
    assert engine(model, backend).generate(prompts(), NEW_TOKENS) == reference(model, prompts())
    from tgraph.integrations import transformers as tg_hf

    stock = make("llama", device)
    tg_hf.graph_layers(stock, backend=backend)  # tgraph's own layer classes wrap the stock forward
    try:
        assert engine(stock, backend).generate(prompts(), NEW_TOKENS) == reference(stock, prompts())
    finally:
        tg_hf.ungraph(stock)


def test_length_dependent_rope_is_refused():
    torch.manual_seed(0)
    rope = dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)
    model = LlamaForCausalLM(LlamaConfig(**COMMON, rope_parameters=rope))
    with pytest.raises(TypeError, match="rope_type 'dynamic'"):
        DecodeEngine(model, max_batch_size=1, max_seq_len=16, progress=False)


def test_text_prompts_use_bytes_without_a_tokenizer():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(COMMON | dict(vocab_size=256)))).eval()
    eng = DecodeEngine(model, max_batch_size=1, max_seq_len=32, progress=False)
    (text,) = eng.generate(["hi"], 4)
    assert isinstance(text, str)
    (ids,) = eng.generate([list(b"hi")], 4)
    assert text == eng.decoder.decode(ids)


def test_importing_tgraph_does_not_import_transformers():
    code = (
        "import sys, tgraph, tgraph.decode, tgraph.toy; "
        "assert 'transformers' not in sys.modules, 'tgraph imported transformers'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _load_generate_recipe():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "recipes" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_recipe_hf", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, path


def test_generate_recipe_serves_a_save_pretrained_directory(tmp_path, capsys):
    """A tiny random Llama saved by save_pretrained (bytes as tokens: vocabulary 256) is served
    by recipes/generate.py with graphs, and its completions are generate's."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**(COMMON | dict(vocab_size=256)), num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    ckpt = tmp_path / "hf_llama"
    model.save_pretrained(ckpt)
    gen, recipe = _load_generate_recipe()
    texts = ["ab", "hello"]
    argv = ["--ckpt", str(ckpt), "--max-new-tokens", "6", "--device", "cpu"]
    completions = gen.main([*argv, "--prompt", texts[0], "--prompt", texts[1]])
    want = [reference(model, [list(t.encode())], 6)[0] for t in texts]
    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731
    assert completions == [decode(ids) for ids in want]
    out = capsys.readouterr().out
    assert "(LlamaForCausalLM)" in out and "----- sample 2 of 2 " in out
    # --top-p reaches the engine: a nucleus of the likeliest token alone is greedy
    nucleus = gen.main([*argv, "--prompt", texts[0], "--temperature", "1", "--top-p", "1e-9"])
    assert nucleus == completions[:1]
    assert "top-p 1e-09" in capsys.readouterr().out
    proc = subprocess.run(
        [sys.executable, str(recipe), *argv, "--prompt", texts[0]],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert texts[0] + completions[0] in proc.stdout


@pytest.mark.parametrize("named", ["int", "list"])
def test_generate_recipe_stops_at_the_eos_of_the_generation_config(tmp_path, capsys, named):
    """Planted: the model's own greedy completion holds a token, which the checkpoint's
    generation_config names as its EOS (alone, or second in a list, as Llama 3's chat models
    name two): the recipe, given no --eos-token-id, ends the completion there."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(COMMON | dict(vocab_size=256)))).eval()
    (full,) = reference(model, [list(b"ab")], 12)
    at = next(i for i in range(2, len(full)) if full[i] not in full[:i])  # its first occurrence
    never = next(t for t in range(256) if t not in full)
    model.generation_config.eos_token_id = full[at] if named == "int" else [never, full[at]]
    ckpt = tmp_path / "hf_llama"
    model.save_pretrained(ckpt)
    gen, _ = _load_generate_recipe()
    argv = ["--ckpt", str(ckpt), "--prompt", "ab", "--max-new-tokens", "12", "--device", "cpu"]
    (completion,) = gen.main(argv)
    assert completion == bytes(full[: at + 1]).decode("utf-8", errors="replace")
    (longer,) = gen.main([*argv, "--eos-token-id", str(never)])  # the user's EOS wins
    assert longer == bytes(full).decode("utf-8", errors="replace")


def test_benchmark_smoke_writes_rows_with_equal_tokens(tmp_path):
    """scripts/bench_decode_hf.py --smoke: every row has a status, the engine's greedy tokens
    equal generate's, and the compiled peers (CUDA only) are skipped with a reason."""
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_hf.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "bench_decode_hf.json").read_text())["results"]
    assert {(r["batch"], r["peer"]) for r in rows} >= {(1, "engine"), (8, "hf_dynamic")}
    for r in rows:
        if r["peer"] == "engine":
            assert r["status"] == "ok" and r["tokens_equal"], r
        if r["peer"].startswith("hf_static"):
            assert r["status"] == "skipped" and r["reason"], r
