"""Fail closed: what a graph baked in beyond its static inputs, changed after capture by real
user code, is either followed (numbers equal eager, no fallback) or refused out loud.

Parameter storage, EMA evaluation, Python state read by a forward, saved-tensor hooks, random
generators and the recorded iteration's unused outputs. Every test trains a graphed model and an
eager twin from the same seed on the same batches (tests/fail_closed_models.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fail_closed_models import (
    TOL,
    BlindGuard,
    Block,
    D,
    Net,
    assert_never_silent,
    assert_same_params,
    batches,
    eager_calls,
    fallback_error,
    fallbacks,
    make_pair,
    train,
)

import tgraph

STEPS = 4

# -- parameter storage re-pointed after capture: followed, graphed ---------------------------


def _reclone(i, model, opt):
    if i == 2:
        for p in model.parameters():
            p.data = p.data.clone()


def _flat_pack(i, model, opt):
    """ZeRO-style: every parameter becomes a view of one flat buffer."""
    if i == 2:
        params = list(model.parameters())
        flat = torch.cat([p.data.reshape(-1) for p in params])
        o = 0
        for p in params:
            n = p.numel()
            p.data = flat[o : o + n].view_as(p)
            o += n


def _round_trip(i, model, opt):
    """Offloaded during another model's turn and brought back (RLHF trainers)."""
    if i == 2:
        if next(model.parameters()).is_cuda:
            model.cpu().cuda()
        else:
            model.double().float()


def _load_assign(i, model, opt):
    """A checkpoint loaded with ``assign=True``: new parameters, so a new optimizer."""
    if i == 2:
        sd = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=True)
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return None


@pytest.mark.parametrize(
    "repoint",
    [_reclone, _flat_pack, _round_trip, _load_assign],
    ids=["data_clone", "flat_buffer", "round_trip", "load_state_dict_assign"],
)
def test_repointed_parameters_train_graphed_on_live_weights(backend, device, repoint):
    """``p.data = ...`` (or a round trip, or ``assign=True``) between steps: the graphs must read
    the live parameters, which the optimizer updates, and keep replaying (no fallback)."""
    model, ref = make_pair(device)
    data = batches(device, STEPS + 2)
    want = train(ref, data, before=repoint)
    counts = []

    def counted(i, model, opt):
        counts.append(eager_calls())
        return repoint(i, model, opt)

    with fallbacks() as msgs:
        got = train(model, data, backend, before=counted)
    counts.append(eager_calls())
    if repoint is _load_assign:
        # The first call of each block after the load runs eagerly, saying so: the last step's
        # graph still holds the old parameters, whose memory the graphs read. Later calls are
        # graphed on the new ones: no fallback after that step.
        assert len(msgs) <= len(model.blocks) and all("replaced" in m for m in msgs), msgs
        assert counts[3] <= len(model.blocks) and counts[3:] == [counts[3]] * (STEPS), counts
    else:
        assert not msgs, msgs
        assert counts == [0] * (STEPS + 3), counts
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)


class _ScaledBlock(tgraph.GraphableModule):
    """A square weight (transposed in place below) and a (1, D) scale (re-viewed below)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D).reshape(1, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * self.scale


def _transpose_in_place(i, model, opt):
    """The same memory laid out anew: a square weight transposed by p.data = p.data.t()."""
    if i == 2:
        for b in model.blocks:
            b.lin.weight.data = b.lin.weight.data.t()


def test_parameter_laid_out_anew_in_its_memory_runs_eagerly(backend, device):
    """Found in review: the address is the captured one, so only the strides tell; the graph
    would read the old layout (a silently untransposed weight). Each call runs eagerly,
    saying why, and trains as eager."""
    model, ref = make_pair(device, lambda: Net(block=_ScaledBlock))
    data = batches(device, STEPS + 1)
    want = train(ref, data, before=_transpose_in_place)
    with fallbacks() as msgs:
        got = train(model, data, backend, before=_transpose_in_place)
    assert msgs and all("laid out anew" in m for m in msgs), msgs
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)


def _reviewed_in_place(i, model, opt):
    """The same memory re-viewed with another stride on a dimension of size 1: no element
    moves (a channels_last depthwise weight re-viewed gives such strides)."""
    if i == 2:
        for b in model.blocks:
            b.scale.data = b.scale.data.as_strided(b.scale.shape, (1, 1))


def test_an_equivalent_layout_in_the_same_memory_keeps_replaying(backend, device):
    """Found in review of the stride check: only strides of dimensions of size > 1 count."""
    model, ref = make_pair(device, lambda: Net(block=_ScaledBlock))
    data = batches(device, STEPS + 1)
    want = train(ref, data, before=_reviewed_in_place)
    got = train(model, data, backend, before=_reviewed_in_place, strict=True)
    assert model.blocks[0].scale.stride() == (1, 1)
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)


def _python_pointer_pass(tensors, ptrs, indices):
    """torch._C._tensors_data_ptrs_at_indices_equal, as CPU builds of torch lack it, binding
    included: it takes lists only (pybind11 refuses a tuple or a range, found on the H200)."""
    if not all(type(a) is list for a in (tensors, ptrs, indices)):
        raise TypeError("_tensors_data_ptrs_at_indices_equal(): incompatible function arguments")
    return all(tensors[i].data_ptr() == ptrs[i] for i in indices)


@pytest.mark.parametrize("planted", [False, True], ids=["pointer_pass", "planted_blind_pass"])
def test_the_cpp_pointer_pass_still_follows_and_refuses(backend, device, monkeypatch, planted):
    """The hot path's address check uses torch's C++ pass where torch has it (CUDA builds):
    the same cases are followed (re-pointed) and refused (laid out anew). Planted: a pass that
    sees no move lets the graphs read the old memory, and the test says so."""
    from tgraph.layers import replay

    fake = (lambda *a: True) if planted else (replay._ptrs_equal or _python_pointer_pass)
    assert fake is not None
    monkeypatch.setattr(replay, "_ptrs_equal", fake)

    def run():
        test_repointed_parameters_train_graphed_on_live_weights(backend, device, _reclone)
        tgraph.reset()
        test_parameter_laid_out_anew_in_its_memory_runs_eagerly(backend, device)

    if planted:
        with pytest.raises(AssertionError):
            run()
    else:
        run()


@pytest.mark.parametrize("planted", [False, True], ids=["layout_guard", "planted_blind_guard"])
def test_the_cpp_layout_guard_still_refuses_a_new_layout(backend, device, monkeypatch, planted):
    """The hot path checks sizes and strides with a C++ guard (dynamo's TensorGuards) once the
    Python comparison found them as baked: a weight transposed in its own memory still runs
    eagerly, saying why, and the guard is really the check that ran (a replay first built it).
    Planted: a guard that sees no change lets the graph read the old layout, and the test
    says so."""
    from tgraph import layout

    guard, built = BlindGuard if planted else layout._TensorGuards, []
    assert guard is not None

    def counted(*args, **kwargs):
        built.append(guard(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(layout, "_TensorGuards", counted)
    if planted:
        with pytest.raises(AssertionError):
            test_parameter_laid_out_anew_in_its_memory_runs_eagerly(backend, device)
    else:
        test_parameter_laid_out_anew_in_its_memory_runs_eagerly(backend, device)
    assert built


def test_repointed_parameters_do_not_fall_back_under_strict(backend, device):
    """Following a re-pointed parameter is not a fallback: strict mode does not raise."""
    model, ref = make_pair(device)
    data = batches(device, STEPS)
    want = train(ref, data, before=_flat_pack)
    got = train(model, data, backend, before=_flat_pack, strict=True)
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)


# -- EMA evaluation between training steps ---------------------------------------------------


def _ema_run(model, data, x_eval, backend=None, *, how: str):
    """Train; after every step (the recorded one included) evaluate the EMA weights.

    Returns the training losses, the evaluations, and the fallback warnings raised by the
    training calls and by the evaluations, apart.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    params = list(model.parameters())
    ema = [p.detach().clone() for p in params]
    if backend is not None:
        tgraph.enable(model, backend=backend)
    losses, evals, train_msgs, eval_msgs = [], [], [], []
    for i, (x, y) in enumerate(data):
        before = eager_calls()
        with fallbacks() as msgs:
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        n = eager_calls() - before  # a reason warned at an evaluation is not warned again
        if i > 0:
            train_msgs += msgs + ([f"{n} training calls ran eagerly"] if n else [])
        losses.append(loss.detach())
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 0.5)
        with fallbacks() as msgs, torch.no_grad():
            if how == "swap":
                for p, e in zip(params, ema):
                    p.data, e.data = e.data, p.data
                evals.append(model(x_eval).clone())
                for p, e in zip(params, ema):
                    p.data, e.data = e.data, p.data
            else:
                named = dict(zip((n for n, _ in model.named_parameters()), ema))
                evals.append(torch.func.functional_call(model, named, (x_eval,)).clone())
        eval_msgs += msgs
        if backend is not None and i == 0:
            tgraph.create_graphs()
    return torch.stack(losses), torch.stack(evals), train_msgs, eval_msgs


@pytest.mark.parametrize("how", ["swap", "functional_call"])
def test_ema_evaluation_between_steps_sees_the_ema_weights(backend, device, how):
    """``p.data, ema.data = ema.data, p.data`` around a no-grad evaluation, or
    ``torch.func.functional_call(model, ema_params, x)``: the evaluation must use the EMA
    weights. It may be graphed or fall back with a warning naming the parameters; the training
    calls after it must keep replaying graphs."""
    model, ref = make_pair(device)
    data = batches(device, STEPS + 1)
    x_eval = torch.randn(3, D, generator=torch.Generator().manual_seed(7)).to(device)
    want_loss, want_eval, _, _ = _ema_run(ref, data, x_eval, how=how)
    got_loss, got_eval, train_msgs, eval_msgs = _ema_run(model, data, x_eval, backend, how=how)
    torch.testing.assert_close(got_eval, want_eval, **TOL)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    assert_same_params(model, ref)
    assert not train_msgs, train_msgs
    assert_never_silent(eval_msgs, r"param|weight|storage|functional_call")


# -- a state_dict() kept across load_state_dict(assign=True) ----------------------------------


def _kept_state_dict_run(model, data, backend=None, replays=None, *, taken: str):
    """Train; ``taken``: when a ``state_dict()`` (aliases of the parameters) is taken and kept
    (never, before ``enable``, before or after ``create_graphs``). Before step 2, load new
    parameters with ``assign=True``; before step 4, drop the kept state dict.

    Returns the losses, the kept tensors' values before the load and after step 3, and per
    step: the fallback warnings, the eager calls and the replays it made.
    """
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    kept = model.state_dict() if taken == "before_enable" else None
    if backend is not None:
        tgraph.enable(model, backend=backend)
    losses, msgs, calls, replayed, values = [], [], [], [], []

    def step(x, y):  # the loss is not kept: its autograd graph would hold the old parameters
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    for i, (x, y) in enumerate(data):
        if i == 2:
            values.append({k: v.clone() for k, v in (kept or {}).items()})
            new = {k: v.detach().mul(0.5) for k, v in model.state_dict().items()}
            model.load_state_dict(new, assign=True)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if i == 4:
            values.append({k: v.clone() for k, v in (kept or {}).items()})
            kept = None
        before, replays_before = eager_calls(), replays[0] if replays else 0
        with fallbacks() as m:
            losses.append(step(x, y))
        msgs.append(m)
        calls.append(eager_calls() - before)
        replayed.append((replays[0] if replays else 0) - replays_before)
        if i == 0 and taken == "before_create_graphs":
            kept = model.state_dict()
        if backend is not None and i == 0:
            tgraph.create_graphs()
        if i == 0 and taken == "after_create_graphs":
            kept = model.state_dict()
    return torch.stack(losses), values, msgs, calls, replayed


@pytest.mark.parametrize(
    "taken", ["never", "before_enable", "before_create_graphs", "after_create_graphs"]
)
def test_a_state_dict_kept_across_an_assign_load_is_not_overwritten(
    backend, device, replays, taken
):
    """``sd = model.state_dict()`` kept, then ``load_state_dict(new, assign=True)``: the memory
    the graph reads is now the kept tensors', which a copy of the new parameters into it would
    overwrite, also when it was taken before the capture (not tgraph's use of that memory).
    While it is kept, the calls run
    eagerly, saying so, and it keeps its values bitwise; once dropped, the graphs replay on the
    new parameters. Nothing kept: the load is followed by a copy at once, no fallback."""
    model, ref = make_pair(device)
    data = batches(device, STEPS + 2)
    want, want_values, _, _, _ = _kept_state_dict_run(ref, data, taken=taken)
    got, values, msgs, calls, replayed = _kept_state_dict_run(
        model, data, backend, replays, taken=taken
    )
    before, after = values  # the kept tensors: bitwise as the load left them, and as eager's
    assert before.keys() == after.keys() == want_values[1].keys()
    for k in before:
        assert torch.equal(after[k], before[k]), f"{k} of the kept state_dict was overwritten"
        assert torch.equal(after[k], want_values[1][k]), k
    n = len(model.blocks)
    if taken == "never":
        assert msgs == [[]] * len(data), msgs
        assert calls[1:] == [0] * (len(data) - 1), calls
    else:
        assert msgs[2] and all("in use elsewhere" in m for m in msgs[2]), msgs[2]
        assert "blocks.0.fc1.weight" in msgs[2][0]
        assert calls[1:] == [0, n, n] + [0] * (len(data) - 4), calls
        assert replayed[2:4] == [0, 0], replayed
    assert all(r > 0 for r in replayed[4:]), replayed  # dropped: the graphs replay again
    assert all(r > 0 for r in replayed[1:2]), replayed
    if device.type == "cpu":  # the same fp32 kernels on the same values: bitwise
        assert torch.equal(got, want)
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)


# -- Python state read by the forward, changed after capture ----------------------------------


class DropoutBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return x + self.drop(self.fc2(torch.tanh(self.fc1(x))))


class TemperatureBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = 1.0

    def forward(self, x):
        return x + torch.softmax(self.fc1(x) / self.temperature, dim=-1) @ self.fc2.weight.T


def _disable_dropout(i, model, opt):
    """TRL's ``disable_dropout_in_model``, after the graphs were captured."""
    if i == 1:
        for m in model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0


def _anneal(i, model, opt):
    for b in model.blocks:
        b.temperature = 1.0 / (1 + i)


class PrivateScaleBlock(Block):
    """A private flag read by forward (as PEFT's ``_disable_adapters``)."""

    def __init__(self) -> None:
        super().__init__()
        self._gain = 1.0

    def forward(self, x):
        return x + self._gain * self.fc2(torch.tanh(self.fc1(x)))


class TensorAttributeBlock(Block):
    """A tensor attribute that is neither a parameter nor a buffer, replaced after capture."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.zeros(D)

    def _apply(self, fn, recurse=True):  # moved with the module, as a user's would be
        self.shift = fn(self.shift)
        return super()._apply(fn, recurse)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x + self.shift)))


class ClassDefaultBlock(Block):
    """A default held by the class, overridden on an instance after capture."""

    gain = 1.0

    def forward(self, x):
        return x + self.gain * self.fc2(torch.tanh(self.fc1(x)))


def _instance_gain(i, model, opt):
    if i == 2:
        model.blocks[1].gain = 0.25


def _private_gain(i, model, opt):
    if i == 2:
        for b in model.blocks:
            b._gain = 0.5


def _new_shift(i, model, opt):
    if i == 2:
        for b in model.blocks:
            b.shift = torch.full_like(b.shift, 0.3)


PY_STATE = {
    "dropout_p": (DropoutBlock, _disable_dropout, r"\bp\b|[Dd]ropout"),
    "temperature": (TemperatureBlock, _anneal, r"temperature"),
    "private_flag": (PrivateScaleBlock, _private_gain, r"_gain"),
    "tensor_attribute": (TensorAttributeBlock, _new_shift, r"shift"),
    "instance_over_class": (ClassDefaultBlock, _instance_gain, r"gain"),
}


@pytest.mark.parametrize("case", list(PY_STATE))
def test_python_attribute_changed_after_capture_is_not_baked(backend, device, case):
    """A non-tensor attribute the forward reads (``Dropout.p`` set to 0 on every dropout; a
    temperature annealed every step) changes after capture: followed, or a fallback naming it.

    Dropout is on only in the recorded step, which runs eagerly in both twins."""
    block, before, names = PY_STATE[case]
    model, ref = make_pair(device, lambda: Net(block))
    data = batches(device, STEPS)
    want = train(ref, data, before=before)
    with fallbacks() as msgs:
        got = train(model, data, backend, before=before)
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)
    assert_never_silent(msgs, names)


@pytest.mark.parametrize("case", list(PY_STATE))
def test_python_attribute_changed_after_capture_under_strict(backend, device, case):
    """Under ``strict=True`` the same change is followed or raises GraphFallbackError naming it."""
    block, before, names = PY_STATE[case]
    model, ref = make_pair(device, lambda: Net(block))
    data = batches(device, STEPS)
    want = train(ref, data, before=before)
    try:
        got = train(model, data, backend, before=before, strict=True)
    except RuntimeError as exc:
        assert isinstance(exc, fallback_error()), exc
        assert_never_silent([str(exc)], names)
    else:
        torch.testing.assert_close(got, want, **TOL)


class CountedBlock(Block):
    """A framework's bookkeeping attribute, set before every call and never read by forward
    (megatron's ``current_microbatch``), named in ``unread_attributes``."""

    unread_attributes = frozenset({"calls_seen"})

    def __init__(self) -> None:
        super().__init__()
        self.calls_seen = 0


class UncountedBlock(CountedBlock):
    unread_attributes = frozenset()


def test_unread_attributes_change_without_a_fallback(backend, device):
    """A change of a named unread attribute replays the graph; any other attribute still falls
    back (the same block with the name left out raises under strict)."""

    def count(i, model, opt):
        for b in model.blocks:
            b.calls_seen = i

    model, ref = make_pair(device, lambda: Net(CountedBlock))
    data = batches(device, STEPS)
    want = train(ref, data, before=count)
    got = train(model, data, backend, before=count, strict=True)  # no GraphFallbackError
    torch.testing.assert_close(got, want, **TOL)
    tgraph.disable(model)
    model, _ = make_pair(device, lambda: Net(UncountedBlock))
    with pytest.raises(fallback_error(), match="calls_seen"):
        train(model, data, backend, before=count, strict=True)


class LoraLinear(tgraph.GraphableModule):
    """A LoRA-adapted linear layer with PEFT's ``disable_adapters`` switch."""

    def __init__(self, d: int = D, r: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d, d)
        self.lora_a = nn.Linear(d, r, bias=False)
        self.lora_b = nn.Linear(r, d, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.5)  # nonzero: the adapter visibly matters
        self.base.requires_grad_(False)
        self.disable_adapters = False

    def forward(self, x):
        y = self.base(x)
        if not self.disable_adapters:
            y = y + self.lora_b(self.lora_a(x))
        return y


class LoraNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([LoraLinear(), LoraLinear()])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum(-1, keepdim=True)


def _dpo_run(model, data, backend=None):
    """Policy training steps, each followed by a no-grad reference pass with adapters off."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    if backend is not None:
        tgraph.enable(model, backend=backend)
    refs, losses = [], []
    with fallbacks() as msgs:
        for i, (x, y) in enumerate(data):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            with torch.no_grad():
                for layer in model.layers:
                    layer.disable_adapters = True
                refs.append(model(x).clone())
                for layer in model.layers:
                    layer.disable_adapters = False
            if backend is not None and i == 0:
                tgraph.create_graphs()  # captured with the adapters on
    return torch.stack(losses), torch.stack(refs), msgs


def test_disable_adapters_reference_pass_uses_the_base_model(backend, device):
    """DPO's reference pass toggles ``disable_adapters``: its logits must be the base model's."""
    model, ref = make_pair(device, LoraNet)
    data = batches(device, STEPS)
    want_loss, want_ref, _ = _dpo_run(ref, data)
    got_loss, got_ref, msgs = _dpo_run(model, data, backend)
    torch.testing.assert_close(got_ref, want_ref, **TOL)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    assert_never_silent(msgs, r"disable_adapters")


# -- saved-tensor hooks around a graphed call ----------------------------------------------


def _saved_hooks_run(model, data, backend=None):
    """Activation compression: every saved tensor is packed as bfloat16 (changes gradients)."""
    packed = [0]

    def pack(t):
        packed[0] += 1
        return t.dtype, t.to(torch.bfloat16) if t.is_floating_point() else t

    def unpack(saved):
        dtype, t = saved
        return t.to(dtype)

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if backend is not None:
        tgraph.enable(model, backend=backend)
    losses = []
    with fallbacks() as msgs:
        for i, (x, y) in enumerate(data):
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            if backend is not None and i == 0:
                tgraph.create_graphs()
    return torch.stack(losses), msgs, packed[0]


def test_saved_tensors_hooks_apply_to_graphed_calls(backend, device):
    """``torch.autograd.graph.saved_tensors_hooks`` active around the forward: the graphed
    blocks' saved activations must go through the hooks (the weights then equal eager's, which
    the bfloat16 packing moves by ~1e-3), or the calls fall back naming the hooks."""
    model, ref = make_pair(device)
    data = batches(device, STEPS)
    want, _, _ = _saved_hooks_run(ref, data)
    got, msgs, packed = _saved_hooks_run(model, data, backend)
    assert packed > 0
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)
    assert_never_silent(msgs, r"saved_tensors_hooks")


def test_packing_changes_the_numbers():
    """The hooks above are not a no-op: without them, training ends elsewhere."""
    model, ref = make_pair("cpu")
    data = batches("cpu", STEPS)
    with_hooks, _, _ = _saved_hooks_run(model, data)
    plain = train(ref, data)
    assert not torch.allclose(with_hooks[1:], plain[1:], **TOL)


# -- generators -----------------------------------------------------------------------------


class NoisyBlock(Block):
    """Draws noise from its own ``torch.Generator`` (a model-parallel RNG tracker's pattern)."""

    gen: torch.Generator | None = None

    def forward(self, x):
        noise = torch.randn(x.shape, generator=self.gen, device=x.device)
        return super().forward(x + 0.1 * noise)


def _give_generators(model, device) -> list[torch.Generator]:
    for k, b in enumerate(model.blocks):
        b.gen = torch.Generator(device=device).manual_seed(100 + k)
    return [b.gen for b in model.blocks]


def test_unregistered_generator_is_refused_at_capture(backend, device):
    """A forward drawing from a generator not registered with tgraph: create_graphs
    (``strict=True``) raises, naming the generator and ``tgraph.register_generator``, instead of
    freezing it (without ``strict`` the module stays eager, named)."""
    torch.manual_seed(0)
    model = Net(NoisyBlock).to(device)
    _give_generators(model, device)
    tgraph.enable(model, backend=backend, strict=True)
    x, y = batches(device, 1)[0]
    F.mse_loss(model(x), y).backward()
    with pytest.raises(tgraph.CaptureError, match=r"(?s)[Gg]enerator.*register_generator"):
        tgraph.create_graphs()


def test_registered_generator_draws_as_eager(backend, device):
    """The same forward with its generators registered: fresh noise at every replay, as eager."""
    model, ref = make_pair(device, lambda: Net(NoisyBlock))
    _give_generators(ref, device)
    for g in _give_generators(model, device):
        tgraph.register_generator(g)
    data = batches(device, STEPS)
    want = train(ref, data)
    got = train(model, data, backend, strict=True)
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)


# -- unused outputs in the recorded iteration ------------------------------------------------


class TwoHeads(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(D, D)
        self.aux = nn.Linear(D, D)  # reached only through the output the loss ignores

    def forward(self, x):
        return torch.tanh(self.main(x)), self.aux(x)


class TwoHeadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = TwoHeads()
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        h, _aux = self.body(x)
        return self.head(h)


def _adamw_run(model, data, backend=None):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if backend is not None:
        tgraph.enable(model, backend=backend, strict=True)
    aux_grads = []
    for i, (x, y) in enumerate(data):
        F.mse_loss(model(x), y).backward()
        aux_grads.append([p.grad for p in model.body.aux.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        if backend is not None and i == 0:
            tgraph.create_graphs()
    return aux_grads, opt


def test_unused_output_leaves_grad_none_in_the_recorded_step_too(backend, device):
    """A module returns two outputs and the loss uses one: the parameters reached only through
    the other keep ``.grad`` None at every step, step 0 (recorded, eager) included, so AdamW's
    weight decay never moves them, as in eager."""
    model, ref = make_pair(device, TwoHeadNet)
    data = batches(device, STEPS)
    want_grads, ref_opt = _adamw_run(ref, data)
    got_grads, opt = _adamw_run(model, data, backend)
    assert all(g is None for step in want_grads for g in step)
    for i, step in enumerate(got_grads):
        assert all(g is None for g in step), f"step {i}: aux .grad is {step}, eager None"
    assert_same_params(model, ref)
    assert not any(p in opt.state for p in model.body.aux.parameters())


class ManagerEveryForward(Block):
    """Sets a fresh helper object (as megatron's offloading and checkpoint managers) in every
    forward: that is the module's own bookkeeping, not state a graph bakes in."""

    def forward(self, x):
        self.norm_manager = object()
        return super().forward(x)


def test_an_object_the_forward_assigns_itself_does_not_force_eager(backend, device):
    model, ref = make_pair(device, lambda: Net(ManagerEveryForward))
    data = batches(device, STEPS)
    want = train(ref, data)
    got = train(model, data, backend, strict=True)
    torch.testing.assert_close(got, want, **TOL)
