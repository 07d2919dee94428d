"""Fail closed on the Python a forward reads and writes, and the shadow verifier under the rules.

The classes a fourth independent suite found silently wrong (issue 44): a submodule replaced or
added after capture, a parametrization removed, a forward that returns tensors inside an object
a replay cannot refill, a forward that writes its own attribute or draws from ``random``, a
global the forward reads. Each test trains a graphed model and its eager twin on the same
batches and asks for eager's numbers, said out loud. Then the shadow verifier: with the rules
switched off (``tgraph.verification(rules=False)``), it alone must catch the persistent classes
within the first verified replays; with the rules on, it catches a change no rule sees.
"""

from __future__ import annotations

import copy
import dataclasses
import random
import types
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fail_closed_models import (
    TOL,
    Block,
    D,
    Net,
    assert_never_silent,
    assert_same_params,
    batches,
    eager_calls,
    fallbacks,
    make_pair,
    train,
)
from torch.nn.utils import parametrize

import tgraph

STEPS = 5
SCALE = 1.0  # a module-level value the forward of _GlobalBlock reads


def _twins(device, factory=Net, before=None, backend=None, **kw):
    """Train a graphed model and its eager twin; returns both and the fallback warnings. The
    shadow verifier is off unless a test turns it on: the rules must stand alone."""
    model, _ = make_pair(device, factory)
    ref, _ = make_pair(device, factory)  # built anew: a parametrized class is not shared
    data = batches(device, STEPS)
    want = train(ref, data, before=before)
    verifier = tgraph.verification() if kw.pop("verify", False) else tgraph.verification(0, 0)
    with verifier, fallbacks() as msgs:
        got = train(model, data, backend, before=before, **kw)
    torch.testing.assert_close(got, want, **TOL)
    return model, ref, msgs


# -- the module tree: a submodule replaced or added, a parametrization removed -----------------


class _DropBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.act = nn.GELU()
        self.extra = nn.ModuleList([nn.Linear(D, D)])

    def forward(self, x):
        h = self.fc2(self.drop(self.act(self.fc1(x))))
        for layer in self.extra:
            h = h + layer(x)
        return x + h


def _replace_fc2(i, model, opt):
    if i == 2:
        torch.manual_seed(7)
        model.blocks[0].fc2 = nn.Linear(2 * D, D).to(model.blocks[0].fc1.weight.device)


def _dropout_off(i, model, opt):
    if i == 2:  # the usual way to switch dropout off for RL fine-tuning
        model.blocks[0].drop = nn.Identity()


def _swap_activation(i, model, opt):
    if i == 2:
        model.blocks[1].act = nn.Tanh()


def _append_layer(i, model, opt):
    if i == 2:
        torch.manual_seed(8)
        dev = model.blocks[0].fc1.weight.device
        model.blocks[0].extra.append(nn.Linear(D, D).to(dev))


class _LoRA(nn.Module):
    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.full((4, base.in_features), 0.1, device=base.weight.device))
        self.b = nn.Parameter(torch.full((base.out_features, 4), 0.1, device=base.weight.device))

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


def _wrap_lora(i, model, opt):
    if i == 2:
        model.blocks[0].fc1 = _LoRA(model.blocks[0].fc1)


@pytest.mark.parametrize(
    "change",
    [_replace_fc2, _dropout_off, _swap_activation, _append_layer, _wrap_lora],
    ids=["replace_linear", "dropout_to_identity", "gelu_to_tanh", "modulelist_append", "lora"],
)
def test_a_submodule_changed_after_capture_is_not_replayed(backend, device, change):
    model, _, msgs = _twins(device, lambda: Net(_DropBlock), before=change, backend=backend)
    assert msgs, "the change ran silently"
    assert_never_silent(msgs, r"replaced|added to or removed|submodule")


class _Half(nn.Module):
    def forward(self, w):
        return 0.5 * w


def _parametrized() -> Net:
    net = Net()
    for b in net.blocks:
        parametrize.register_parametrization(b.fc1, "weight", _Half())
    return net


def _remove_parametrization(i, model, opt):
    if i == 2:
        for b in model.blocks:
            parametrize.remove_parametrizations(b.fc1, "weight", leave_parametrized=True)


def test_a_parametrization_removed_after_capture_is_not_replayed(backend, device):
    model, ref, msgs = _twins(
        device, _parametrized, before=_remove_parametrization, backend=backend
    )
    assert msgs and eager_calls() > 0
    assert_never_silent(msgs, r"parametrization|Linear")
    assert_same_params(model, ref)


# -- outputs a replay cannot refill ------------------------------------------------------------


@dataclasses.dataclass
class _Out:
    y: torch.Tensor
    aux: torch.Tensor


class _DataclassBlock(Block):
    def forward(self, x):
        h = self.fc1(x)
        return _Out(x + self.fc2(torch.tanh(h)), h.mean())


class _NamespaceBlock(Block):
    def forward(self, x):
        return types.SimpleNamespace(y=x + self.fc2(torch.tanh(self.fc1(x))))


class _NormalBlock(Block):
    def forward(self, x):
        return torch.distributions.Normal(x + self.fc2(torch.tanh(self.fc1(x))), 1.0)


class _OutNet(Net):
    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            o = b(h)
            h = o.mean if isinstance(o, torch.distributions.Normal) else o.y
        return self.head(h)


@pytest.mark.parametrize(
    "block,name",
    [(_DataclassBlock, "_Out"), (_NamespaceBlock, "SimpleNamespace"), (_NormalBlock, "Normal")],
    ids=["dataclass", "namespace", "distribution"],
)
def test_tensors_returned_inside_an_opaque_object_keep_the_unit_eager(backend, device, block, name):
    _, _, msgs = _twins(device, lambda: _OutNet(block), backend=backend)
    assert any(name in m and "cannot be graphed" in m for m in msgs), msgs
    assert eager_calls() > 0  # the blocks ran eagerly: their numbers are eager's


def test_opaque_outputs_under_strict_raise_naming_the_type(backend, device):
    model, _ = make_pair(device, lambda: _OutNet(_DataclassBlock))
    tgraph.enable(model, backend=backend, strict=True)
    x, y = batches(device, 1)[0]
    F.mse_loss(model(x), y).backward()
    with pytest.raises(tgraph.CaptureError, match="_Out holding tensors"):
        tgraph.create_graphs()


# -- a forward that writes Python state ---------------------------------------------------------


class _WarmupBlock(Block):
    """``self.calls += 1; alpha = min(1, calls / 8)``: a forward that ramps itself."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        alpha = min(1.0, self.calls / 8)
        return x + alpha * self.fc2(torch.tanh(self.fc1(x)))


class _LayerDropBlock(Block):
    def forward(self, x):
        if self.training and random.random() < 0.5:
            return x
        return x + self.fc2(torch.tanh(self.fc1(x)))


def test_a_forward_updating_its_own_attribute_stays_eager(backend, device):
    model, ref, msgs = _twins(device, lambda: Net(_WarmupBlock), backend=backend)
    assert any("writes Python state" in m and "calls" in m for m in msgs), msgs
    assert [b.calls for b in model.blocks] == [b.calls for b in ref.blocks] == [STEPS] * 2


def test_a_forward_drawing_from_python_random_stays_eager(backend, device):
    def seeded(i, model, opt):
        if i == 0:
            random.seed(3)

    _, _, msgs = _twins(device, lambda: Net(_LayerDropBlock), before=seeded, backend=backend)
    assert any("random" in m for m in msgs), msgs


# -- a global the forward reads -----------------------------------------------------------------


class _GlobalBlock(Block):
    def forward(self, x):
        return x + SCALE * self.fc2(torch.tanh(self.fc1(x)))


def _rescale(i, model, opt):
    global SCALE
    SCALE = 0.5 if i >= 2 else 1.0


def test_a_global_read_by_the_forward_changed_after_capture_is_not_replayed(backend, device):
    try:
        _, _, msgs = _twins(device, lambda: Net(_GlobalBlock), before=_rescale, backend=backend)
    finally:
        _rescale(0, None, None)
    assert_never_silent(msgs, r"SCALE")


class _AttributeBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x):
        return x + self.scale * self.fc2(torch.tanh(self.fc1(x)))


scale = 0  # a module-level name the forward of _AttributeBlock reads only as an attribute


def _count(i, model, opt):
    global scale
    scale = i  # a script's loop variable, say


def test_a_global_named_like_an_attribute_the_forward_reads_is_not_a_read(backend, device):
    """``self.scale`` puts ``scale`` in the code's names, but the forward reads no global
    ``scale``: a module-level variable of that name changing at every step must not stop the
    replays (it made every call eager, or raise under strict)."""
    try:
        _, _, msgs = _twins(
            device, lambda: Net(_AttributeBlock), before=_count, backend=backend, strict=True
        )
    finally:
        _count(0, None, None)
    assert msgs == [] and tgraph.eager_calls() == 0


# -- the shadow verifier --------------------------------------------------------------------------


class _FlagBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.cfg = {"scale": 1.0}  # a container mutated in place: no rule compares it

    def forward(self, x):
        return x + self.scale * self.cfg["scale"] * self.fc2(torch.tanh(self.fc1(x)))


def _set_attribute(i, model, opt):
    if i == 2:
        model.blocks[0].scale = 0.5


def _mutate_config(i, model, opt):
    if i == 2:
        model.blocks[0].cfg["scale"] = 0.5


def _add_hook(i, model, opt):
    if i == 2:
        model.blocks[0].fc2.register_forward_hook(lambda m, a, out: out * 0.5)


def _replace_fc2_flag(i, model, opt):
    if i == 2:
        torch.manual_seed(7)
        model.blocks[0].fc2 = nn.Linear(2 * D, D).to(model.blocks[0].fc1.weight.device)


PERSISTENT = [_set_attribute, _replace_fc2_flag, _add_hook, _rescale, _remove_parametrization]


def _factory_for(change):
    if change is _rescale:
        return lambda: Net(_GlobalBlock)
    if change is _remove_parametrization:
        return _parametrized
    return lambda: Net(_FlagBlock)


@pytest.mark.parametrize(
    "change",
    PERSISTENT,
    ids=["attribute", "submodule", "hook", "global", "parametrization"],
)
def test_with_the_rules_off_the_verifier_alone_catches_persistent_classes(backend, device, change):
    """Test mode: no baked checks, no read or write sets. The verifier, verifying every replay,
    must still find each change on the first replay after it, and that call's numbers (and
    every later one's) must be eager's."""
    try:
        with tgraph.verification(rules=False, every=1):
            _, _, msgs = _twins(
                device, _factory_for(change), before=change, backend=backend, verify=True
            )
    finally:
        _rescale(0, None, None)
    assert msgs and all("shadow verifier" in m for m in msgs), "\n".join(msgs)


def test_the_verifier_catches_what_no_rule_sees(backend, device):
    """A config dict mutated in place: no rule compares containers. Verified replays find it."""
    with tgraph.verification(every=1):
        _, _, msgs = _twins(
            device, lambda: Net(_FlagBlock), before=_mutate_config, backend=backend, verify=True
        )
    assert msgs and all("shadow verifier" in m for m in msgs), "\n".join(msgs)


def test_without_the_verifier_the_rules_off_mode_is_silently_wrong(backend, device):
    """The planted bug behind the two tests above: nothing verified, no rule, wrong numbers.
    (Proves those tests can fail.)"""
    model, ref = make_pair(device, lambda: Net(_FlagBlock))
    data = batches(device, STEPS)
    want = train(ref, data, before=_set_attribute)
    with tgraph.verification(rules=False, first=0, every=0), fallbacks() as msgs:
        got = train(model, data, backend, before=_set_attribute)
    assert not msgs
    assert not torch.allclose(got, want, **TOL)


def test_the_verifier_under_strict_raises(backend, device):
    model, _ = make_pair(device, lambda: Net(_FlagBlock))
    data = batches(device, STEPS)
    with tgraph.verification(every=1), pytest.raises(tgraph.GraphFallbackError, match="shadow"):
        train(model, data, backend, before=_mutate_config, strict=True)


def test_the_verifier_samples_first_replays_then_one_in_n(backend, device, monkeypatch):
    from tgraph.layers import verify

    seen = []
    real = verify.checked_replay

    def counted(unit, *a):
        seen.append(unit.state.replays)
        return real(unit, *a)

    monkeypatch.setattr(verify, "checked_replay", counted)
    model, _ = make_pair(device)
    with tgraph.verification(first=2, every=4):
        train(model, batches(device, 12), backend, merge=False)
    per_block = sorted(seen)[::2]  # two blocks, verified at the same replays
    assert per_block == [1, 2, 5, 9], seen  # replays 0, 1, then 4 and 8 (counted after)


def test_a_verified_replay_changes_nothing(backend, device):
    """Verifying runs the unit once more, eagerly: buffers (running statistics), generator
    states and stored attributes must be as an unverified replay leaves them."""

    class BNBlock(Block):
        def __init__(self) -> None:
            super().__init__()
            self.bn = nn.BatchNorm1d(2 * D)
            self.drop = nn.Dropout(0.3)

        def forward(self, x):
            return x + self.fc2(self.drop(torch.tanh(self.bn(self.fc1(x)))))

    with tgraph.verification(every=1):
        model, ref, msgs = _twins(device, lambda: Net(BNBlock), backend=backend, verify=True)
    assert not msgs and eager_calls() == 0
    for b, r in zip(model.blocks, ref.blocks):
        torch.testing.assert_close(b.bn.running_mean, r.bn.running_mean, **TOL)
    assert_same_params(model, ref)


def test_a_wrong_gradient_of_a_merged_stack_is_caught_in_its_backward(backend, device, monkeypatch):
    """The replay's outputs right, its gradients wrong (planted: doubled). The verified replay's
    backward recomputes the eager twin one member at a time (checkpointed, dropout masks from
    each member's own generator states), finds the difference and hands autograd eager's
    gradients; the stack runs eagerly from then on, and training equals eager's."""
    from tgraph.layers import replay

    real = replay.grads_for_autograd

    def doubled(*args, **kwargs):
        return [None if g is None else 2 * g for g in real(*args, **kwargs)]

    monkeypatch.setattr(replay, "grads_for_autograd", doubled)
    with tgraph.verification(every=1):
        model, ref, msgs = _twins(device, lambda: Net(_DropBlock), backend=backend, verify=True)
    assert msgs and "gradient" in msgs[0] and "shadow verifier" in msgs[0], msgs
    assert_same_params(model, ref)


class _Token:
    pass


class _Counted(torch.autograd.Function):
    """Identity whose autograd node keeps a token alive: the live tokens count the graphed
    blocks' autograd graphs (their activations) alive at a time."""

    live: weakref.WeakSet = weakref.WeakSet()
    most = 0

    @staticmethod
    def forward(ctx, x):
        ctx.token = token = _Token()
        _Counted.live.add(token)
        _Counted.most = max(_Counted.most, len(_Counted.live))
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


class _CountedBlock(Block):
    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(_Counted.apply(x))))


def _four_counted_blocks() -> Net:
    net = Net(_CountedBlock)
    net.blocks.extend([_CountedBlock(), _CountedBlock()])
    return net


def test_a_verified_replay_holds_one_members_graph_at_a_time(backend, device):
    """The verifier's eager twin of a 4-block stack keeps no block's autograd graph past the
    block's call, and the verified backward runs the blocks again one at a time: at no point
    does a verified step hold more than one block's graph (activations) beyond an unverified
    step's. The whole twin held all four until the backward (the d1024 peak at 1.26x eager's)."""

    def counts(settings: dict) -> tuple[int, int, int]:
        model, _ = make_pair(device, _four_counted_blocks)
        data = batches(device, 4)
        with tgraph.verification(0, 0):
            train(model, data[:3], backend, merge=True)
        x, y = data[3]
        with tgraph.verification(**settings):
            _Counted.most = len(_Counted.live)
            loss = F.mse_loss(model(x), y)
            after, forward_most = len(_Counted.live), _Counted.most
            _Counted.most = after
            loss.backward()
        tgraph.reset()
        tgraph.disable(model)
        return after, forward_most, _Counted.most

    off = counts(dict(first=0, every=0))
    on = counts(dict(every=1))
    assert eager_calls() == 0
    assert on[0] == off[0], (on, off)  # after the forward: no twin graph kept
    assert on[1] <= off[1] + 1 and on[2] <= off[2] + 1, (on, off)  # one block's at a time


class _CrossBlock(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(D, D), nn.Linear(D, D), nn.Dropout(0.2)

    def forward(self, h, enc):
        return h + self.drop(torch.tanh(self.a(h) + self.b(enc)))


class _CrossNet(nn.Module):
    """Four blocks that each read the same encoder output, which requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(D, D)
        self.blocks = nn.ModuleList(_CrossBlock() for _ in range(4))
        self.out = nn.Linear(D, 1)

    def forward(self, x):
        enc, h = self.enc(x.flip(0)), x
        for b in self.blocks:
            h = b(h, enc)
        return self.out(h)


def test_a_verified_stack_sharing_an_input_that_requires_grad_matches_eager(backend, device):
    """The verified backward hands each member's input gradients back by hand: the encoder
    output every block reads gets the sum of four, the hidden state each block's own. Every
    replay verified, with dropout: no false alarm, and eager's numbers."""
    with tgraph.verification(every=1):
        model, ref, msgs = _twins(device, _CrossNet, backend=backend, verify=True, strict=True)
    assert not msgs and eager_calls() == 0
    assert_same_params(model, ref)


# -- the layout of an input (issue 44, item 10) ------------------------------------------------


class _ConvBlock(tgraph.GraphableModule):
    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return x + torch.tanh(self.conv(x))


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList([_ConvBlock(), _ConvBlock()])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h.mean((2, 3)))


def _images(device, n):
    g = torch.Generator().manual_seed(2)
    return [
        (torch.randn(2, 3, 6, 6, generator=g).to(device), torch.randn(2, 1, generator=g).to(device))
        for _ in range(n)
    ]


@pytest.mark.parametrize("how", ["input", "model"])
def test_channels_last_after_a_contiguous_capture_runs_eagerly(backend, device, how):
    """A graph replays the kernels of the layout it captured and hands back outputs and input
    gradients in it; eager picks other kernels and layouts for channels_last images (on CUDA
    the eager stem's gradient differed). The layout is part of the signature: such a call runs
    eagerly, named, with eager's numbers, and the contiguous calls keep replaying."""
    data = _images(device, STEPS)

    def to_cl(i, model, opt):
        if how == "model" and i == 2:
            model.to(memory_format=torch.channels_last)

    def run(model, backend=None):
        losses = []
        with tgraph.verification(0, 0), fallbacks() as msgs:
            losses = train(
                model,
                [
                    (x.contiguous(memory_format=torch.channels_last) if i >= 2 else x, y)
                    for i, (x, y) in enumerate(data)
                ],
                backend,
                before=to_cl,
            )
        return losses, msgs

    model, ref = make_pair(device, _ConvNet)
    want, _ = run(ref)
    got, msgs = run(model, backend)
    assert torch.equal(got, want), (got - want).abs().max()
    assert msgs, "channels_last calls replayed the contiguous capture"
    assert_never_silent(msgs, r"non-contiguous")
    assert_same_params(model, ref)


def _write_dict_directly(i, model, opt):
    if i == 2:  # bypasses nn.Module.__setattr__: the module epoch does not move
        model.blocks[0].__dict__["scale"] = 0.5


def test_a_write_the_module_epoch_misses_is_caught_by_the_verifier(backend, device):
    """The attribute checks run only when nn.Module's setters moved the module epoch; a write
    straight into ``__dict__`` slips past them, and the verifier catches it on its next verified
    replay (here: every replay)."""
    with tgraph.verification(every=1):
        _, _, msgs = _twins(
            device,
            lambda: Net(_FlagBlock),
            before=_write_dict_directly,
            backend=backend,
            verify=True,
        )
    assert msgs and all("shadow verifier" in m for m in msgs), "\n".join(msgs)


def test_a_steady_hf_step_moves_no_module_epoch():
    """The attribute and module-tree checks run only when a baked module was written through
    nn.Module's setters: a steady training step of an HF Llama writes none (transformers builds
    a new ModuleList per forward, which is no baked module), so its replays skip them."""
    from hf_models import tiny_llama, token_batches

    from tgraph.baked import _epoch
    from tgraph.integrations.transformers import graph_layers

    model = tiny_llama("cpu")
    graph_layers(model, backend="emulated")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    moved = []
    for i, x in enumerate(token_batches("cpu", 4)):
        before = _epoch[0]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        moved.append(_epoch[0] - before)
        if i == 0:
            tgraph.create_graphs()
    assert moved[2:] == [0, 0], moved
    assert tgraph.eager_calls() == 0


def test_a_dead_model_leaves_the_module_epoch(backend, device):
    """The epoch counts writes to modules some inventory holds, by id: a graphed model that
    died leaves none of its ids behind, or every object that later takes one (transformers'
    per-forward ModuleList, say) would move the epoch at each write, and replays would run the
    full checks (seen on the GPU machine: a steady HF step after other tests' models)."""
    import gc

    from tgraph.baked import _baked_modules

    model, _ = make_pair(device)
    train(model, batches(device, 3), backend)
    ids = {id(m) for m in model.modules()}
    assert ids & set(_baked_modules)  # the graphed blocks and their submodules are counted
    tgraph.disable(model)
    del model
    gc.collect()
    assert not ids & set(_baked_modules)


class _Jitter(torch.autograd.Function):
    """Identity whose backward adds noise of 1e-5: a backward that is not deterministic (as
    atomics make flash attention's and index_add_'s on a GPU)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g + 1e-5 * torch.rand_like(g)


class _JitterBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)  # later masks show a generator the verifier moved

    def forward(self, x):
        return x + self.fc2(self.drop(torch.tanh(_Jitter.apply(self.fc1(x)))))


def test_a_backward_that_is_not_deterministic_is_not_flagged(backend, device):
    """The replay's gradients differ from eager's as much as eager's differ from eager's own
    (1e-5 here, far above 4 ulps): the verifier compares against that noise, not only ulps, and
    keeps the graph; the generator it drew from is put back (losses equal an unverified run)."""
    model, _ = make_pair(device, lambda: Net(_JitterBlock))
    plain, _ = make_pair(device, lambda: Net(_JitterBlock))
    data = batches(device, STEPS)
    with tgraph.verification(every=1), fallbacks() as msgs:
        got = train(model, data, backend)
    tgraph.reset()
    with tgraph.verification(0, 0):
        want = train(plain, data, backend)
    assert not msgs, "\n".join(msgs)
    torch.testing.assert_close(got, want, **TOL)


def test_the_verifier_checks_no_grad_calls_too(backend, device):
    """Evaluation and RL rollouts run graphed blocks under no_grad: a verified replay there is
    compared as well (outputs only: no backward), and a change no rule sees runs eagerly."""
    model, _ = make_pair(device, lambda: Net(_FlagBlock))
    ref, _ = make_pair(device, lambda: Net(_FlagBlock))
    x = batches(device, 1)[0][0]
    tgraph.enable(model, backend=backend)
    with torch.no_grad():
        model(x)  # the recorded call
    tgraph.create_graphs()
    with tgraph.verification(every=1), fallbacks() as msgs, torch.no_grad():
        for i in range(4):
            _mutate_config(i, model, None)
            _mutate_config(i, ref, None)
            torch.testing.assert_close(model(x), ref(x), **TOL)
    assert msgs and all("shadow verifier" in m for m in msgs), "\n".join(msgs)


def test_an_eager_rerun_that_fails_leaves_the_replay_standing(backend, device, monkeypatch):
    """The verifier is a net, not a new way to fail: when its eager rerun raises, the replay's
    result stands (said in the log) and training goes on as unverified."""
    from tgraph.layers import verify

    def broken(*args, **kwargs):
        raise RuntimeError("planted: the eager rerun cannot run")

    monkeypatch.setattr(verify, "_eager_chain", broken)
    _, _, msgs = _twins(device, backend=backend, verify=True)
    assert not msgs and eager_calls() == 0


class _InPlaceBlock(Block):
    def forward(self, x):
        x.mul_(0.5)  # allowed in eager: its caller's x is not a leaf
        return x + self.fc2(torch.tanh(self.fc1(x)))


class _InPlaceNet(Net):
    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h * 1.0)
        return self.head(h)


def test_a_forward_writing_an_input_that_requires_grad_stays_eager_saying_why(backend, device):
    """A graph's static inputs are leaves, which autograd does not let a forward write in
    place: such a module stays eager (eager's numbers), and the warning names the cause and the
    fix, not a host sync."""
    _, _, msgs = _twins(device, lambda: _InPlaceNet(_InPlaceBlock), backend=backend)
    assert msgs and all("writes an input that requires grad in place" in m for m in msgs), msgs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_verifier_reruns_a_backward_under_the_forwards_autocast(
    backend, device, dtype, replays, monkeypatch
):
    """The usual AMP step: the forward under ``torch.autocast``, the backward outside it. The
    verifier's eager rerun in the backward runs under the forward's autocast too, so it finds
    the replays right (``strict=True`` raises at a mismatch) and the gradients are eager's:
    bitwise on CPU (the same kernels on the same values), to rounding on CUDA."""
    from tgraph.layers import verify
    from tgraph.toy.gpt import GPT, GPTConfig

    compared = []
    real = verify.check_grads

    def counted(*args):
        compared.append(1)
        return real(*args)

    monkeypatch.setattr(verify, "check_grads", counted)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16)).to(device)
    ref = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, 256, (2, 4, 16), generator=g).to(device) for _ in range(4)]

    def step(m, xy):
        with torch.autocast(device.type, dtype=dtype):
            _, loss = m(*xy)
        loss.backward()  # outside autocast, as torch's AMP recipe does
        grads = [p.grad for p in m.parameters()]
        m.zero_grad(set_to_none=True)
        return [loss.detach(), *grads]

    tol = {} if device.type == "cuda" else {"rtol": 0, "atol": 0}
    with tgraph.verification(first=2, every=1):
        for i, xy in enumerate(data):
            torch.testing.assert_close(step(model, xy), step(ref, xy), **tol)
            if i == 0:
                tgraph.create_graphs()
    assert replays[0] and compared and tgraph.eager_calls() == 0
