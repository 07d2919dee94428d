"""DecodeEngine after a weight sync that replaces the model's tensors (an RL loop's
``load_state_dict(sd, assign=True)``, ``p.data = new``): the graphs follow the new weights (a
copy into the captured memory, or a re-capture), and greedy tokens equal an eager engine's with
the new weights; never the old weights' tokens. In-place syncs keep working."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from decode_models import engines, prompts, recaptures, tiny_gpt

from tgraph.decode import DecodeEngine, as_decode_model
from tgraph.decode.requests import Request, make_requests

NEW = 12
SHAPE = dict(max_batch_size=4, max_seq_len=64)


def new_weights(device, seed: int = 5) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in tiny_gpt(device, seed=seed).state_dict().items()}


def assert_graphed_equal_eager(graphed, eager, replays, ps) -> list[list[int]]:
    before = replays[0]
    got = graphed.generate(ps, NEW)
    assert got == eager.generate(ps, NEW)  # exact: the same kernels on the same numbers
    assert graphed.stats.eager_steps == 0
    assert replays[0] - before >= NEW  # the graphs served it
    return got


def sync_assign(model, device) -> None:
    model.load_state_dict(new_weights(device), assign=True)


def sync_repoint(model, device) -> None:
    new = new_weights(device)
    for k, p in model.state_dict(keep_vars=True).items():
        p.data = new[k]


def sync_in_place(model, device) -> None:
    model.load_state_dict(new_weights(device))


@pytest.mark.parametrize("sync", [sync_assign, sync_repoint, sync_in_place])
def test_weight_sync_reaches_the_decode_graphs(backend, device, sync, replays):
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, **SHAPE)
    recaptured = recaptures(graphed)
    ps = prompts(3)
    old = assert_graphed_equal_eager(graphed, eager, replays, ps)
    sync(model, device)
    got = assert_graphed_equal_eager(graphed, eager, replays, ps)
    assert got != old  # the new weights decode other tokens (the test can see stale ones)
    assert recaptured[0] == 0  # followed by a copy: the old memory is the engine's alone
    # a second sync, in place into the tensors the model holds now, is followed too
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    assert_graphed_equal_eager(graphed, eager, replays, ps)


def test_weights_swapped_among_themselves_are_captured_again(backend, device, replays):
    """Layer 0's tensors and layer 1's exchanged (assign=True, the same tensors): no copy can
    follow that (each reads what the other overwrites), so generate() captures again."""
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, **SHAPE)
    ps = prompts(3)
    old = assert_graphed_equal_eager(graphed, eager, replays, ps)
    pool = graphed.factory
    swap_layers(model)
    got = assert_graphed_equal_eager(graphed, eager, replays, ps)
    assert got != old
    assert graphed.factory is not pool  # captured again, in a fresh pool


def test_a_dtype_change_is_captured_again_with_a_cache_in_the_new_dtype(backend, device, replays):
    """``model.to(torch.bfloat16)`` after capture: generate() captures again, over a KV cache
    and masks in bfloat16 (the float32 cache cannot take bfloat16 keys), and the engine without
    graphs follows too; their tokens are equal and the bfloat16 model's, not the old ones."""
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, **SHAPE)
    ps = prompts(3)
    old = assert_graphed_equal_eager(graphed, eager, replays, ps)
    model.to(torch.bfloat16)  # new tensors, rounded: this model's tokens change
    got = assert_graphed_equal_eager(graphed, eager, replays, ps)
    assert graphed.cache.dtype == eager.cache.dtype == torch.bfloat16
    fresh = DecodeEngine(model, use_graphs=False, **SHAPE)  # built on the bfloat16 model
    assert got == fresh.generate(ps, NEW)
    if device.type == "cpu":  # bfloat16 changes this model's tokens (checked on the CPU): a
        assert got != old  # stale graph's float32 tokens would show


def swap_layers(model) -> None:
    sd = model.state_dict()
    swapped = {k.replace("h.0.", "h.X.").replace("h.1.", "h.0.").replace("h.X.", "h.1."): v
               for k, v in sd.items()}  # fmt: skip
    model.load_state_dict(swapped, assign=True)


def test_decode_call_that_cannot_follow_names_the_fix(backend, device, replays):
    """Between the calls of a hand-written loop (prefill(), decode(), step()), a change that
    needs a re-capture raises, naming it and the fix (a re-capture writes the KV cache)."""
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, **SHAPE)
    swap_layers(model)
    (request,) = make_requests([prompts(1)[0]], NEW, vocab_size=256, max_seq_len=64,
                               max_positions=64)  # fmt: skip
    request.slot = 0
    match = r"h\.0\..* now lives in memory the graphs read .*call engine\.recapture\(\)"
    with pytest.raises(RuntimeError, match=match):
        graphed.prefill(request)
    graphed.recapture()
    torch.testing.assert_close(graphed.prefill(request), eager.prefill(request), rtol=0, atol=0)
    assert_graphed_equal_eager(graphed, eager, replays, prompts(3))


def ema_swap(model, ema: list[torch.Tensor]) -> None:
    for p, e in zip(model.parameters(), ema, strict=True):
        p.data, e.data = e.data, p.data


def test_an_ema_swap_leaves_every_tensor_as_the_user_left_it(backend, device, replays):
    """Sampling under EMA weights (``p.data, e.data = e.data, p.data``) hands the memory the
    graphs read to the EMA tensors: a copy of the EMA weights into it would overwrite the
    trained weights they now hold. generate() captures again instead: the EMA weights' tokens
    under the swap, the trained ones after swapping back, every tensor bitwise unchanged."""
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, **SHAPE)
    recaptured = recaptures(graphed)
    ps = prompts(3)
    trained = assert_graphed_equal_eager(graphed, eager, replays, ps)
    ema = [p.detach().clone() for p in tiny_gpt(device, seed=5).parameters()]
    kept_trained = [p.detach().clone() for p in model.parameters()]
    kept_ema = [e.clone() for e in ema]
    ema_swap(model, ema)
    assert assert_graphed_equal_eager(graphed, eager, replays, ps) != trained
    assert all(map(torch.equal, ema, kept_trained))  # the trained weights, now in ema
    ema_swap(model, ema)
    assert assert_graphed_equal_eager(graphed, eager, replays, ps) == trained
    assert all(map(torch.equal, model.parameters(), kept_trained))
    assert all(map(torch.equal, ema, kept_ema))
    assert recaptured[0] == 2  # each swap; never a copy into memory the other set holds


@pytest.mark.parametrize("taken", ["before", "after"])
def test_a_state_dict_kept_across_an_assign_sync_is_not_overwritten(
    backend, device, taken, replays
):
    """``sd_a = model.state_dict()`` (aliases of the memory the graphs read, taken before or
    after the engine was built), then ``load_state_dict(sd_b, assign=True)``: the graphs serve
    B without writing it into sd_a's tensors, and loading sd_a back serves A's tokens."""
    model = tiny_gpt(device)
    sd_a = model.state_dict() if taken == "before" else None
    graphed, eager = engines(model, backend, **SHAPE)
    sd_a = model.state_dict() if sd_a is None else sd_a
    kept_a = {k: v.clone() for k, v in sd_a.items()}
    ps = prompts(3)
    tokens_a = assert_graphed_equal_eager(graphed, eager, replays, ps)
    model.load_state_dict(new_weights(device), assign=True)
    assert assert_graphed_equal_eager(graphed, eager, replays, ps) != tokens_a
    assert all(torch.equal(sd_a[k], kept_a[k]) for k in sd_a)
    model.load_state_dict(sd_a, assign=True)
    assert assert_graphed_equal_eager(graphed, eager, replays, ps) == tokens_a
    assert all(torch.equal(sd_a[k], kept_a[k]) for k in sd_a)


def test_one_of_two_tied_weights_replaced_leaves_the_other_intact(backend, device, replays):
    """lm_head.weight tied to wte.weight at capture, then lm_head alone replaced (untied):
    its captured memory is still wte's, so the new head is not copied into it; generate()
    captures again and wte keeps its values."""
    model = tiny_gpt(device)
    model.lm_head.weight = model.wte.weight
    graphed, eager = engines(model, backend, **SHAPE)
    ps = prompts(3)
    tied = assert_graphed_equal_eager(graphed, eager, replays, ps)
    kept_wte = model.wte.weight.detach().clone()
    sd = model.state_dict()
    sd["lm_head.weight"] = new_weights(device)["lm_head.weight"]
    model.load_state_dict(sd, assign=True)
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()
    assert assert_graphed_equal_eager(graphed, eager, replays, ps) != tied
    assert torch.equal(model.wte.weight, kept_wte)


def test_hand_written_loop_steps_on_the_new_weights(backend, device, replays):
    """load() once, then step() after step(): a sync between two steps reaches the next one
    (each engine serves its own copy of the model, synced at the same point)."""
    logits = []
    for use_graphs in (True, False):
        model = tiny_gpt(device)
        engine = DecodeEngine(model, use_graphs=use_graphs, backend=backend, progress=False,
                              **SHAPE)  # fmt: skip
        reqs = [Request(i, p, NEW, False, slot=i) for i, p in enumerate(prompts(2))]
        for r in reqs:
            r.output.append(int(engine.prefill(r).argmax()))
        batch = engine.pad(reqs)
        engine.load(batch)
        engine.step(batch)
        sync_assign(model, device)
        before = replays[0]
        logits.append(engine.step(batch)[: batch.n].clone())
        assert replays[0] == before + use_graphs
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


# -- the modules' code and Python state: a submodule swapped, a hook, an attribute ----------


def replace_head(model, device) -> None:
    """A fine-tuned head swapped in: a new module, with new tensors the graphs never read."""
    new = nn.Linear(32, 256, bias=False).to(device)
    with torch.no_grad():
        new.weight.normal_(0.0, 0.3)
    model.lm_head = new


def negate_logits(model, device) -> None:
    model.lm_head.register_forward_hook(lambda module, args, out: -out)


def ln_eps(model, device) -> None:
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = 10.0  # a Python float the LayerNorm kernels baked in


@pytest.mark.parametrize("change", [replace_head, negate_logits, ln_eps])
def test_a_module_change_after_capture_is_captured_again(backend, device, change, replays):
    """A change to what the forwards run (a submodule replaced, a hook added, an attribute they
    read): generate() captures again and its tokens equal the eager engine's, not the old ones;
    the next call replays the new graphs without capturing again. (The hook negates: pure
    tensor code, which capturable_hooks=True lets the graphs capture.)"""
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, capturable_hooks=True, **SHAPE)
    recaptured = recaptures(graphed)
    ps = prompts(3)
    old = assert_graphed_equal_eager(graphed, eager, replays, ps)
    change(model, device)
    got = assert_graphed_equal_eager(graphed, eager, replays, ps)
    assert got != old  # the change decodes other tokens: stale graphs would show
    assert recaptured[0] == 1
    assert_graphed_equal_eager(graphed, eager, replays, ps)
    assert recaptured[0] == 1  # the new graphs replay


@pytest.mark.parametrize("last", ["long_prompt", "at_max_seq_len"])
@pytest.mark.parametrize("how", ["recapture", "replace_head"])
def test_a_recapture_after_any_request_serves_the_next(backend, device, last, how, replays):
    """The warmups and captures run every bucket on the static buffers, so what the last
    generate() left there must not reach them: a 20-token prompt (its length above the 16-token
    prefill bucket's) or rows ended at max_seq_len (live: each warmup moved them past it).
    recapture() and the re-capture of generate() after a change serve the next requests."""
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, **SHAPE)
    recaptured = recaptures(graphed)
    if last == "long_prompt":
        ps, new = prompts(1, lengths=(20,)), 4
    else:  # both end at max_seq_len = 64
        ps, new = prompts(2, lengths=(10, 3)), [54, 61]
    assert graphed.generate(ps, new) == eager.generate(ps, new)
    if how == "recapture":
        graphed.recapture()
    else:
        replace_head(model, device)
    assert_graphed_equal_eager(graphed, eager, replays, prompts(3))
    assert recaptured[0] == 1


def test_a_hook_removed_after_capture_is_captured_again(backend, device, replays):
    """A hook present at capture is baked in (capturable_hooks=True); removing it captures
    again (the old tokens)."""
    model = tiny_gpt(device)
    handle = model.lm_head.register_forward_hook(lambda module, args, out: -out)
    graphed, eager = engines(model, backend, capturable_hooks=True, **SHAPE)
    recaptured = recaptures(graphed)
    ps = prompts(3)
    hooked = assert_graphed_equal_eager(graphed, eager, replays, ps)
    handle.remove()
    assert assert_graphed_equal_eager(graphed, eager, replays, ps) != hooked
    assert recaptured[0] == 1


def test_module_writes_that_change_nothing_keep_the_graphs(backend, device, replays):
    """Sampling between training steps: train() and eval() write every module's ``training``,
    an attribute set to its own value: the module epoch moves, the comparison finds the
    captured state and the graphs replay without a re-capture."""
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, **SHAPE)
    recaptured = recaptures(graphed)
    ps = prompts(3)
    assert_graphed_equal_eager(graphed, eager, replays, ps)
    model.train()
    model.ln_f.eps = model.ln_f.eps
    assert_graphed_equal_eager(graphed, eager, replays, ps)
    model.eval()
    assert_graphed_equal_eager(graphed, eager, replays, ps)
    assert recaptured[0] == 0


def test_a_module_swap_between_hand_written_calls_names_the_fix(backend, device, replays):
    """prefill()/decode()/step() between requests: a swapped submodule raises, naming it and
    the fix; after recapture() the calls serve the new head."""
    model = tiny_gpt(device)
    graphed, eager = engines(model, backend, **SHAPE)
    (request,) = make_requests([prompts(1)[0]], NEW, vocab_size=256, max_seq_len=64,
                               max_positions=64)  # fmt: skip
    request.slot = 0
    graphed.prefill(request)
    replace_head(model, device)
    with pytest.raises(RuntimeError, match=r"lm_head was replaced by another module.*recapture"):
        graphed.prefill(request)
    graphed.recapture()
    before = replays[0]
    torch.testing.assert_close(graphed.prefill(request), eager.prefill(request), rtol=0, atol=0)
    assert replays[0] == before + 1


def test_a_mode_switch_of_a_decoder_without_serving_is_captured_again(backend, device, replays):
    """A decoder without ``serving()`` runs the model in the mode its user set: train() after
    an eval-mode capture captures again (the graphs ran eval-mode code). Dropout is 0 here, so
    the tokens stay equal; the count shows the switch was seen."""
    model = tiny_gpt(device).eval()
    decoder = as_decode_model(model)
    decoder.serving = None  # the engine enters nothing: the model's own mode
    graphed, eager = engines(decoder, backend, **SHAPE)
    recaptured = recaptures(graphed)
    ps = prompts(3)
    assert_graphed_equal_eager(graphed, eager, replays, ps)
    model.train()
    assert_graphed_equal_eager(graphed, eager, replays, ps)
    assert recaptured[0] == 1


class StandInLoRA(nn.Module):
    """A PEFT LoRA ``Linear`` as tgraph reads one (:mod:`tgraph.peft_state`), without peft:
    its forward adds the active adapter's delta times its ``scaling`` entry, unless disabled
    or merged; PEFT's ``set_scale`` writes that dict in place."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, 4, bias=False)
        self.lora_B = nn.Linear(4, base.out_features, bias=False)
        self.scaling = {"default": 1.0}
        self._active_adapter = "default"
        self._disable_adapters = False
        self.merged_adapters: list[str] = []

    disable_adapters = property(lambda self: self._disable_adapters)
    merged = property(lambda self: bool(self.merged_adapters))
    active_adapters = property(lambda self: [self._active_adapter])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        if self._disable_adapters or self.merged_adapters:
            return out
        return out + self.lora_B(self.lora_A(x)) * self.scaling[self._active_adapter]


def test_adapter_scaling_written_in_place_is_captured_again(backend, device, replays):
    """A LoRA-style head whose forward reads a dict entry that is changed in place (no module
    setter runs, so no module epoch moves): generate() captures again and its tokens equal the
    eager engine's with the new scale, not the captured scale's."""
    model = tiny_gpt(device)
    torch.manual_seed(6)
    model.lm_head = StandInLoRA(model.lm_head).to(device)
    with torch.no_grad():
        model.lm_head.lora_B.weight.normal_(0.0, 0.3)
    graphed, eager = engines(model, backend, **SHAPE)
    recaptured = recaptures(graphed)
    ps = prompts(3)
    old = assert_graphed_equal_eager(graphed, eager, replays, ps)
    model.lm_head.scaling["default"] = 6.0
    scaled = assert_graphed_equal_eager(graphed, eager, replays, ps)
    assert scaled != old and recaptured[0] == 1
    model.lm_head.merged_adapters.append("default")  # merge_adapter's list, in place
    assert assert_graphed_equal_eager(graphed, eager, replays, ps) != scaled
    assert recaptured[0] == 2
