"""Merged neighbours (tgraph.layers.segment): one forward and one backward graph for a stack."""

from __future__ import annotations

import contextlib

import pytest
import torch
from layer_models import ATOL, RTOL, MLPBlock, MLPNet, mlp_batches, tiny_gpt, twin

import tgraph
from tgraph.layers import capture, direct_grads, manager, record
from tgraph.layers import replay as bridge


def _model(device):
    torch.manual_seed(0)
    return MLPNet(n=4).to(device)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _record_and_capture(model, backend, x, y):
    tgraph.enable(model, backend=backend)
    model(x, y)[1].backward()
    model.zero_grad(set_to_none=True)
    report = tgraph.create_graphs()
    assert report.segments == 1 and report.graphs == 2
    return report


def test_intermediate_outputs_used_outside_get_their_gradients(backend, device):
    """Hidden states collected for an auxiliary loss: gradients through every output."""
    model = _model(device)
    eager = twin(model)
    x, y = mlp_batches(device, 1)[0]

    def step(m):
        h = m.inp(x)
        hidden = []
        for b in m.blocks:
            h = b(h)
            hidden.append(h)
        loss = torch.nn.functional.mse_loss(m.out(h), y) + sum(t.pow(2).mean() for t in hidden[:-1])
        loss.backward()
        return loss.detach()

    tgraph.enable(model, backend=backend, strict=True)
    step(model)
    model.zero_grad(set_to_none=True)
    assert tgraph.create_graphs().segments == 1
    for _ in range(2):
        torch.testing.assert_close(step(model), step(eager), rtol=RTOL, atol=ATOL)
        got, want = _grads(model), _grads(eager)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=ATOL, msg=n)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


def check_inplace_change_between_blocks(backend, device):
    """Eager code that modifies a block's output in place before the next block."""
    model = _model(device)
    eager = twin(model)
    x, y = mlp_batches(device, 1)[0]

    def step(m, modify):
        h = m.inp(x)
        for i, b in enumerate(m.blocks):
            h = b(h)
            if modify and i == 1:
                with torch.no_grad():
                    h.mul_(2.0)  # in place: the next block must see the doubled values
        return m.out(h)

    _record_and_capture(model, backend, x, y)
    with pytest.warns(tgraph.GraphFallbackWarning, match="merged stack"):
        got = step(model, modify=True)
    torch.testing.assert_close(got, step(eager, modify=True), rtol=RTOL, atol=ATOL)


def test_inplace_change_between_blocks_is_not_answered_by_the_merged_graph(backend, device):
    check_inplace_change_between_blocks(backend, device)


def test_planted_bug_missing_version_check_is_caught(backend, device, monkeypatch):
    real_take = bridge.take

    def take_without_version_check(cap, state, j, tensors):
        state.stack.versions = [
            t._version for s in state.stack.pending or [] for t in s
        ] or state.stack.versions
        return real_take(cap, state, j, tensors)

    monkeypatch.setattr(bridge, "take", take_without_version_check)
    with pytest.raises(pytest.fail.Exception, match="DID NOT WARN"):  # answered from the graph
        check_inplace_change_between_blocks(backend, device)


def test_block_called_out_of_order_runs_eagerly(backend, device):
    model = _model(device)
    x, y = mlp_batches(device, 1)[0]
    _record_and_capture(model, backend, x, y)
    h = model.inp(x).detach().requires_grad_()
    with pytest.warns(tgraph.GraphFallbackWarning, match="module 2 of a merged stack"):
        got = model.blocks[2](h)
    torch.testing.assert_close(got, torch.nn.Module.__call__(model.blocks[2], h))


def test_merge_false_graphs_each_block(backend, device):
    model = _model(device)
    x, y = mlp_batches(device, 1)[0]
    tgraph.enable(model, backend=backend, merge=False)
    model(x, y)[1].backward()
    report = tgraph.create_graphs()
    assert report.segments == 0 and report.graphs == 2 * len(model.blocks)


class DropoutBlock(tgraph.GraphableModule):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.dropout(torch.tanh(self.fc(x)), 0.5, self.training)


def _layerdrop_step(bs, h: torch.Tensor, seed: int, draw: bool) -> torch.Tensor:
    """One training step through ``bs``, with LayerDrop's draw before each block where
    ``draw`` (its branch never skips here); the loss."""
    torch.manual_seed(seed)
    for b in bs:
        if draw:
            torch.rand((), device=h.device)
        h = b(h)
    loss = h.square().mean()
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("draw", [False, True], ids=["nothing-between", "draw-between"])
def test_random_draw_between_blocks_keeps_eagers_masks(backend, device, draw, replays):
    """LayerDrop draws a number before every layer (``torch.rand([])``; transformers' OPT up to
    5.17 even at ``layerdrop=0``). Drawn from the generator the blocks' dropout draws from, it
    sits between their masks; a merged stack draws every block's masks in its head's replay,
    which would give the later blocks other masks than eager. Those blocks are graphed apart."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(DropoutBlock(16) for _ in range(3)).to(device)
    eager = twin(blocks)
    xs = [x for x, _ in mlp_batches(device, 4, batch=4)]

    def step(bs, x, seed):
        return _layerdrop_step(bs, x.repeat(1, 2), seed, draw)  # (4, 16)

    tgraph.enable(blocks, backend=backend, strict=True)
    step(blocks, xs[0], 0)
    blocks.zero_grad(set_to_none=True)
    assert tgraph.create_graphs().segments == (0 if draw else 1)
    replays[0] = 0
    for i, x in enumerate(xs[1:]):
        blocks.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        got, want = step(blocks, x, i), step(eager, x, i)
        grads = [(p.grad.clone(), q.grad) for p, q in zip(blocks.parameters(), eager.parameters())]
        if backend == "emulated":  # the same kernels on the same numbers: bit for bit
            assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in grads)
        else:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(*zip(*grads), rtol=RTOL, atol=ATOL)
    assert replays[0] == 3 * (6 if draw else 2)  # a forward and a backward graph per unit


def _freeze(block):
    for p in block.parameters():
        p.requires_grad_(False)


@pytest.mark.parametrize("change", [_freeze, torch.nn.Module.eval], ids=["frozen", "eval"])
def test_later_member_leaving_its_key_keeps_the_stack_from_drawing_its_masks(
    backend, device, change
):
    """A later member frozen (layer freezing for fine-tuning) or put in eval mode after capture
    would run eagerly after the stack's replay drew its dropout masks, drawing them again from
    the moved generator. The head checks the later members' modes first: the whole stack runs
    eagerly, with eager's masks (bitwise on the emulated backend: the same kernels on the
    same numbers), warning. The shadow verifier is off: its first replays would find the eval
    member's stale mask, not the frozen one's."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(DropoutBlock(16) for _ in range(3)).to(device)
    eager = twin(blocks)
    xs = [x.repeat(1, 2) for x, _ in mlp_batches(device, 4, batch=4)]  # (4, 16)

    def step(bs, x, seed):
        torch.manual_seed(seed)
        h = x
        for b in bs:
            h = b(h)
        loss = h.square().mean()
        loss.backward()
        return loss.detach()

    tgraph.enable(blocks, backend=backend)
    step(blocks, xs[0], 0)
    blocks.zero_grad(set_to_none=True)
    assert tgraph.create_graphs().segments == 1
    change(blocks[1]), change(eager[1])
    with tgraph.verification(first=0, every=0):
        for i, x in enumerate(xs[1:]):
            blocks.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
            before = tgraph.eager_calls()
            with pytest.warns(tgraph.GraphFallbackWarning) if i == 0 else contextlib.nullcontext():
                got, want = step(blocks, x, i), step(eager, x, i)
            grads = [(p.grad, q.grad) for p, q in zip(blocks.parameters(), eager.parameters())]
            if backend == "emulated":
                assert torch.equal(got, want), (got, want)
                assert all((g is None) == (w is None) for g, w in grads)
                assert all(torch.equal(g, w) for g, w in grads if g is not None)
            else:
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
                torch.testing.assert_close(*zip(*grads), rtol=RTOL, atol=ATOL)
            assert tgraph.eager_calls() - before == 3  # the whole stack, eagerly


@pytest.mark.parametrize("strict", [False, True], ids=["warns", "strict"])
def test_random_draw_between_blocks_after_capture_is_seen(backend, device, strict):
    """LayerDrop switched on after capture: a number drawn between the blocks of a stack whose
    replay drew every block's masks already. The draw is seen at the next block's call (the
    generator moved since the replay): that step warns (strict raises), and the stack runs
    eagerly from then on, with eager's masks (bitwise on the emulated backend)."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(DropoutBlock(16) for _ in range(3)).to(device)
    eager = twin(blocks)
    xs = [x.repeat(1, 2) for x, _ in mlp_batches(device, 4, batch=4)]  # (4, 16)

    step = _layerdrop_step
    tgraph.enable(blocks, backend=backend, strict=strict)
    step(blocks, xs[0], 0, draw=False)
    blocks.zero_grad(set_to_none=True)
    assert tgraph.create_graphs().segments == 1
    if strict:
        with pytest.raises(tgraph.GraphFallbackError, match="random numbers were drawn between"):
            step(blocks, xs[1], 1, draw=True)
        return
    with pytest.warns(tgraph.GraphFallbackWarning, match="random numbers were drawn between"):
        step(blocks, xs[1], 1, draw=True)
    for i, x in enumerate(xs[2:]):
        blocks.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        before = tgraph.eager_calls()
        said = pytest.warns(tgraph.GraphFallbackWarning, match="of 0 .* eagerly from now on")
        with said if i == 0 else contextlib.nullcontext():  # the head's refusal, said once
            got, want = step(blocks, x, i, draw=True), step(eager, x, i, draw=True)
        grads = [(p.grad, q.grad) for p, q in zip(blocks.parameters(), eager.parameters())]
        if backend == "emulated":
            assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in grads)
        else:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(*zip(*grads), rtol=RTOL, atol=ATOL)
        assert tgraph.eager_calls() - before == 3  # the whole stack, eagerly


@pytest.mark.parametrize("strict", [False, True], ids=["warns", "strict"])
@pytest.mark.parametrize("how", ["hook", "between", "skip", "other-key", "stop"])
def test_stack_member_falling_back_after_the_draw_is_seen(backend, device, how, strict):
    """After capture, a later block of a stack whose replay drew every block's masks is no
    longer called with the previous block's unmodified output: a forward hook or code between
    the blocks rescales the stream, a block is skipped, a block gets another shape (its key
    differs), or the stack stops midway (the step's last block never called). Falling back, a
    block drew its mask again from the moved generator (every step after off by up to 2.3 in
    the loss, one warning that did not say so). The step that leaves the stack warns that its
    numbers differ (strict raises; for "stop", at the next head call, the first one to see
    it), and the stack runs eagerly from then on, with eager's masks (bitwise on the emulated
    backend)."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(DropoutBlock(16) for _ in range(4)).to(device)
    eager = twin(blocks)
    xs = [x.repeat(1, 2) for x, _ in mlp_batches(device, 5, batch=4)]  # (4, 16)

    def step(bs, x, seed, changed):
        torch.manual_seed(seed)
        h = x
        for i, b in enumerate(bs):
            if changed and how == "skip" and i == 2 or changed and how == "stop" and i == 3:
                continue
            h = b(h)
            if changed and how == "between" and i == 1:
                h = h * 2.0
            if changed and how == "other-key" and i == 1:
                h = h[:3]
        loss = h.square().mean()
        loss.backward()
        return loss.detach()

    tgraph.enable(blocks, backend=backend, strict=strict)
    step(blocks, xs[0], 0, changed=False)
    blocks.zero_grad(set_to_none=True)
    assert tgraph.create_graphs().segments == 1
    if how == "hook":
        for bs in (blocks, eager):
            bs[2].register_forward_hook(lambda m, a, out: out * 2.0)
    said = "random numbers differ from eager's"
    if strict:
        leaving = pytest.raises(tgraph.GraphFallbackError, match=said)
    else:
        leaving = pytest.warns(tgraph.GraphFallbackWarning, match=said)
    if how == "stop":  # nothing falls back in this step: the next head call sees it
        step(blocks, xs[1], 1, changed=True)
    else:
        with leaving:
            step(blocks, xs[1], 1, changed=True)
    if strict:
        if how == "stop":  # raised at the head, before anything ran
            with leaving:
                step(blocks, xs[2], 2, changed=True)
        return
    for i, x in enumerate(xs[2:]):
        blocks.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        before = tgraph.eager_calls()
        said_once = pytest.warns(tgraph.GraphFallbackWarning, match=f"of 0 .*{said}")
        with said_once if i == 0 else contextlib.nullcontext():  # the head's refusal (for
            # "stop", the first warning: the head's call sees the stack left midway)
            got, want = step(blocks, x, i, changed=True), step(eager, x, i, changed=True)
        grads = [(p.grad, q.grad) for p, q in zip(blocks.parameters(), eager.parameters())]
        if backend == "emulated":
            assert torch.equal(got, want)
            assert all((g is None) == (w is None) for g, w in grads)
            assert all(torch.equal(g, w) for g, w in grads if g is not None)
        else:
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            torch.testing.assert_close(*zip(*grads), rtol=RTOL, atol=ATOL)
        assert tgraph.eager_calls() - before == (3 if how in ("skip", "stop") else 4)


class GatedBlock(tgraph.GraphableModule):
    """Takes the stream ``x`` plus ``gate``, one tensor passed to every block (like a mask)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(x)) * gate


class GatedNet(torch.nn.Module):
    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, d)
        self.blocks = torch.nn.ModuleList(GatedBlock(d) for _ in range(n))

    def forward(self, x, gate, gates=None):
        h = self.inp(x)
        for i, b in enumerate(self.blocks):
            h = b(h, gate if gates is None else gates[i])
        return h.pow(2).mean()


def _gate_batches(device, n, gate_requires_grad):
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(5, 8, generator=g).to(device),
            torch.rand(16, generator=g).to(device).requires_grad_(gate_requires_grad),
        )
        for _ in range(n)
    ]


@pytest.mark.parametrize("gate_grad", [False, True], ids=["mask-like", "differentiable"])
def test_input_shared_by_every_block_is_merged_and_fresh(backend, device, gate_grad):
    """An input passed to every block (a new tensor each step) keeps the stack one segment;
    each replay reads this step's values (a stale shared input changes the loss) and, when it
    requires grad, its gradient sums every block's use."""
    torch.manual_seed(0)
    model = GatedNet().to(device)
    eager = twin(model)
    batches = _gate_batches(device, 4, gate_grad)
    tgraph.enable(model, backend=backend, strict=True)
    for i, (x, gate) in enumerate(batches):
        gate_e = gate.detach().clone().requires_grad_(gate_grad)
        got, want = model(x, gate), eager(x, gate_e)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=n)
        if gate_grad:
            torch.testing.assert_close(gate.grad, gate_e.grad, rtol=RTOL, atol=ATOL)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
        if i == 0:
            report = tgraph.create_graphs()
            assert report.segments == 1 and report.graphs == 2


def test_block_given_another_shared_tensor_runs_eagerly(backend, device):
    """A later block that gets a different tensor than the first block did (same shape) is not
    answered by the merged graph, which computed it with the first block's tensor."""
    torch.manual_seed(0)
    model = GatedNet().to(device)
    eager = twin(model)
    (x, gate), (x2, gate2) = _gate_batches(device, 2, False)
    tgraph.enable(model, backend=backend)
    model(x, gate).backward()
    assert tgraph.create_graphs().segments == 1
    gates = [gate2, gate2, gate2.flip(0), gate2]  # block 2 gets another tensor
    with pytest.warns(tgraph.GraphFallbackWarning, match="module 2 of a merged stack"):
        got = model(x2, None, gates)
    torch.testing.assert_close(got, eager(x2, None, gates), rtol=RTOL, atol=ATOL)


class _LeafOutBlock(tgraph.GraphableModule):
    """Returns, under no_grad, a leaf that requires grad, as megatron's TransformerLayer does
    (``make_viewless_tensor(..., requires_grad=True)``): the next block's call key sees it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.lin(h))
        return out if torch.is_grad_enabled() else out.detach().requires_grad_()


def _leaf_out_model(device):
    torch.manual_seed(0)
    model = MLPNet(n=3).to(device)
    model.blocks = torch.nn.ModuleList(_LeafOutBlock() for _ in range(3)).to(device)
    return model


def _record_train_and_eval(model, backend, x, y):
    tgraph.enable(model, backend=backend, strict=True)  # a fallback raises
    model(x, y)[1].backward()
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.eval()
        model(x, y)
        model.train()
    assert tgraph.create_graphs().segments == 2  # the training stack and the eval stack


def test_eval_outputs_that_require_grad_replay_as_recorded(backend, device):
    """megatron's eval forward (found by the recipe's ``eager_calls``): under no_grad each layer
    returns a leaf that requires grad; the replay must return it so too, or the next layer's key
    (its input's ``requires_grad``) differs from the recorded one and the stack runs eagerly."""
    model = _leaf_out_model(device)
    eager = twin(model)
    batches = mlp_batches(device, 3)
    _record_train_and_eval(model, backend, *batches[0])
    model.eval(), eager.eval()
    with torch.no_grad():
        for x, y in batches:
            got, want = model(x, y), eager(x, y)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            h = model.blocks[0](model.inp(x))
            assert h.requires_grad and h.is_leaf  # as eager returns it
            del h
    assert tgraph.eager_calls() == 0


def test_stack_left_midway_without_backward_replays_next_time(backend, device):
    """A no_grad call of the stack's first block alone (its later members never called) must
    not keep the stack busy: the outputs it never handed out are tgraph's own, not the caller's."""
    model = _leaf_out_model(device)
    eager = twin(model)
    (x, y), (x2, y2) = mlp_batches(device, 2)
    _record_train_and_eval(model, backend, x, y)
    model.eval(), eager.eval()
    with torch.no_grad():
        h = model.blocks[0](model.inp(x))  # the stack's head replays; the rest is not called
        torch.testing.assert_close(h, eager.blocks[0](eager.inp(x)), rtol=RTOL, atol=ATOL)
        del h
        torch.testing.assert_close(model(x2, y2), eager(x2, y2), rtol=RTOL, atol=ATOL)
    assert tgraph.eager_calls() == 0


# ------------------------------------------------- gradient sums in eager's order
# Autograd adds up a tensor's gradients in the order its backward reaches them; a float sum of
# three or more terms depends on that order. A merged stack must add them up as eager does.


def _head_loss(m, h, y):
    return torch.nn.functional.cross_entropy(m.lm_head(m.ln_f(h)).flatten(0, 1), y.flatten())


def _block_thrice(m, x, y):  # one block called three times in one stack (ALBERT-style)
    h = x
    for _ in range(3):
        h = m.h[0](h)
    return _head_loss(m, h, y)


def _tied_weight(m, x, y):  # every block holds the same MLP weight
    h = x
    for b in m.h:
        h = b(h)
    return _head_loss(m, h, y)


def _aux_per_block(m, x, y):  # an auxiliary loss on every block's output, as it comes
    h, loss = x, 0.0
    for w, b in zip([0.2, 0.3, 1.0], m.h):
        h = b(h)
        loss = loss + w * _head_loss(m, h, y)
    return loss


def _tie(m):
    for b in m.h[1:]:
        b.mlp.c_fc.weight = m.h[0].mlp.c_fc.weight


# pattern: (loss, tie the weight, merged stacks, replays per microbatch)
SUMS = {
    "block_thrice": (_block_thrice, False, 1, 2),
    "tied_weight": (_tied_weight, True, 1, 2),
    "aux_per_block": (_aux_per_block, False, 0, 6),  # not merged: 3 blocks, 2 graphs each
}


def check_sums_in_eager_order(backend, device, replays, pattern, direct):
    """Graphed and eager twins, AdamW, two microbatches a step (the second accumulates into
    .grad): the parameters bitwise equal after every step on the emulated backend (on CUDA a
    graph may pick another cuBLAS algorithm: within RTOL)."""
    loss_fn, tie, segments, per_micro = SUMS[pattern]
    model = tiny_gpt(device)
    if tie:
        _tie(model)
    eager = twin(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    tgraph.enable(model, backend=backend, strict=True, direct_grads=direct)
    g = torch.Generator().manual_seed(0)

    def batch():  # a block's input (the embeddings) and the targets
        return torch.randn(2, 8, 32, generator=g), torch.randint(0, 256, (2, 8), generator=g)

    steps = [[batch(), batch()] for _ in range(4)]
    report = None
    for i, micro in enumerate(steps):
        before = replays[0]
        for m, opt in zip((model, eager), opts):
            for x, y in micro:
                loss_fn(m, x.to(device), y.to(device)).backward()
                if i == 0 and m is model and report is None:
                    report = tgraph.create_graphs()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if i:
            assert replays[0] - before == per_micro * len(micro)
        tol = dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=RTOL, atol=ATOL)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, **tol, msg=lambda m, i=i, n=n: f"step {i}, {n}: {m}")
    return report


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "autograd"])
@pytest.mark.parametrize("pattern", list(SUMS))
def test_merged_stack_sums_gradients_in_eagers_order(backend, device, replays, pattern, direct):
    """A parameter three blocks of a stack hold gets its gradients added in eager's order (the
    last block's first), whether the node hands them to autograd or writes .grad itself; blocks
    with an auxiliary loss between them stay apart (eager adds its gradient last), and the
    report says so."""
    report = check_sums_in_eager_order(backend, device, replays, pattern, direct)
    assert report.segments == SUMS[pattern][2]
    if pattern == "aux_per_block":
        assert [u.split(" (eager code")[0] for u in report.unmerged] == [
            "h.0 (Block) and h.1 (Block)",
            "h.1 (Block) and h.2 (Block)",
        ]
        assert "not merged: h.0 (Block) and h.1 (Block)" in str(report)
    else:
        assert report.unmerged == []


def test_planted_bug_repeated_parameter_summed_in_member_order_is_caught(
    backend, device, replays, monkeypatch
):
    if backend != "emulated":
        pytest.skip("bitwise only on the emulated backend")
    monkeypatch.setattr(capture, "reversed", list, raising=False)  # _find_params' member order
    with pytest.raises(AssertionError, match="not equal"):
        check_sums_in_eager_order(backend, device, replays, "block_thrice", False)


def test_planted_bug_direct_grads_adding_each_gradient_into_grad_is_caught(
    backend, device, replays, monkeypatch
):
    if backend != "emulated":
        pytest.skip("bitwise only on the emulated backend")
    monkeypatch.setattr(direct_grads, "_summed", lambda params, grads: (params, grads))
    with pytest.raises(AssertionError, match="not equal"):
        check_sums_in_eager_order(backend, device, replays, "tied_weight", None)


def test_planted_bug_stack_merged_across_an_auxiliary_loss_is_caught(
    backend, device, replays, monkeypatch
):
    if backend != "emulated":
        pytest.skip("bitwise only on the emulated backend")
    for where in (manager, bridge):  # nothing seen between calls, recorded or replayed
        monkeypatch.setattr(where, "_autograd_nodes", lambda: 0)
    with pytest.raises(AssertionError, match="not equal"):
        check_sums_in_eager_order(backend, device, replays, "aux_per_block", None)


def _hooked_step(blocks, device, seed: int, how: str | None, at: int = 0):
    """Three blocks called in a row; a hook or retain_grad() on block ``at``'s output. Returns
    that output's gradient as the hook saw it (None: not seen)."""
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed)).to(device)
    hs = [x]
    for b in blocks:
        hs.append(b(hs[-1]))
    seen, h = [], hs[at + 1]
    if how == "hook":
        h.register_hook(seen.append)
    elif how == "retain_grad":
        h.retain_grad()
    hs[-1].square().mean().backward()
    return (seen[0] if seen else None) if how == "hook" else h.grad


def check_hooked_inner_output(backend, device, replays, how):
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(MLPBlock(16) for _ in range(3)).to(device)
    eager = twin(blocks)
    tgraph.enable(blocks, backend=backend, strict=True)
    tol = dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=RTOL, atol=ATOL)
    report = None
    for i in range(3):
        before = replays[0]
        got = _hooked_step(blocks, device, i, how)
        want = _hooked_step(eager, device, i, how)
        if i == 0:
            report = tgraph.create_graphs()
        else:  # block 0 alone (forward, backward), blocks 1 and 2 merged (forward, backward)
            assert replays[0] - before == 4 and tgraph.eager_calls() == 0
        assert got is not None, f"step {i}: the hook saw no gradient"
        torch.testing.assert_close(got, want, **tol)
        for p, q in zip(blocks.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **tol)
        blocks.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    return report


@pytest.mark.parametrize("how", ["hook", "retain_grad"])
def test_hook_on_inner_output_recorded_keeps_its_block_apart(backend, device, replays, how):
    """A hook (or retain_grad()) on a block's output, there in the recorded step too, keeps
    that block out of the stack: the hook sees eager's gradient at every replay, and the
    report names the pair left apart."""
    report = check_hooked_inner_output(backend, device, replays, how)
    assert report.segments == 1
    assert [u.split(" (the recorded")[0] for u in report.unmerged] == [
        "0 (MLPBlock) and 1 (MLPBlock)"
    ]
    assert "retain_grad() on the first one's output" in report.unmerged[0]


def test_planted_bug_hooked_block_merged_is_caught(backend, device, replays, monkeypatch):
    """Without the record's hook check the block is merged; the replay's check then raises
    (without that too, the hook would see nothing: test_hook_on_inner_output_after_capture_raises
    fails when it is planted)."""
    monkeypatch.setattr(record, "_hooked", lambda ref: False)  # the record sees no hook
    with pytest.raises(tgraph.GraphFallbackError, match="module 0 of the merged stack"):
        check_hooked_inner_output(backend, device, replays, "hook")


@pytest.mark.parametrize("how", ["hook", "retain_grad"])
def test_hook_on_inner_output_after_capture_raises(backend, device, replays, how):
    """A hook on an inner output of a merged stack that the recorded step did not show cannot
    get its gradient from the stack's backward graph: the backward raises, never a silent
    None, and names the fix."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(MLPBlock(16) for _ in range(3)).to(device)
    tgraph.enable(blocks, backend=backend, strict=True)
    _hooked_step(blocks, device, 0, None)
    assert tgraph.create_graphs().segments == 1
    before = replays[0]
    _hooked_step(blocks, device, 1, how, at=2)  # the last block's output: its own gradient
    assert replays[0] - before == 2 and tgraph.eager_calls() == 0
    with pytest.raises(tgraph.GraphFallbackError, match=r"module 1 of the merged stack.*merge="):
        _hooked_step(blocks, device, 2, how, at=1)


def _aux_after_capture(backend, device, replays, strict, direct, aux_from=2, steps=5):
    """A stack merged without code between its blocks, then an auxiliary loss on every block's
    output from step ``aux_from`` on (AdamW, graphed and eager twins): the parameters bitwise
    equal after every step on the emulated backend. Returns the eager calls per step."""
    model = tiny_gpt(device)
    eager = twin(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    tgraph.enable(model, backend=backend, strict=strict, direct_grads=direct)
    g = torch.Generator().manual_seed(0)
    tol = dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=RTOL, atol=ATOL)
    calls = []
    for i in range(steps):
        x, y = torch.randn(2, 8, 32, generator=g), torch.randint(0, 256, (2, 8), generator=g)
        loss_fn = _aux_per_block if i >= aux_from else _tied_weight  # (no tie: a plain stack)
        before, eager_before = replays[0], tgraph.eager_calls()
        for m, opt in zip((model, eager), opts):
            loss_fn(m, x.to(device), y.to(device)).backward()
            if i == 0 and m is model:
                assert tgraph.create_graphs().segments == 1
            opt.step()
            opt.zero_grad(set_to_none=True)
        if 0 < i < aux_from:  # the stack replays whole, every member answered by the graph
            assert replays[0] - before == 2 and tgraph.eager_calls() == eager_before
        calls.append(tgraph.eager_calls() - eager_before)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, **tol, msg=lambda m, i=i, n=n: f"step {i}, {n}: {m}")
    return calls


@pytest.mark.parametrize("direct", [None, False], ids=["direct", "autograd"])
@pytest.mark.parametrize("strict", [False, True], ids=["warns", "strict"])
def test_auxiliary_loss_between_blocks_after_capture_is_seen(
    backend, device, replays, strict, direct
):
    """An auxiliary loss between the blocks of a merged stack that starts only after capture
    makes autograd nodes between the members' calls (the recorded stack made none): the next
    member's call sees autograd's node counter moved since the previous member's outputs were
    handed out. That step warns (strict raises) and its later members run eagerly, as does the
    whole stack from then on: the gradients are summed in eager's order (bitwise on the emulated
    backend), where the merged backward would add the auxiliary loss's in another."""
    if strict:
        with pytest.raises(tgraph.GraphFallbackError, match="made autograd nodes after capture"):
            _aux_after_capture(backend, device, replays, strict, direct)
        return
    with pytest.warns(tgraph.GraphFallbackWarning, match="made autograd nodes after capture"):
        calls = _aux_after_capture(backend, device, replays, strict, direct)
    assert calls == [0, 0, 2, 3, 3]  # step 2: the later members; then the whole stack


def test_planted_bug_auxiliary_loss_after_capture_unseen_is_caught(
    backend, device, replays, monkeypatch
):
    if backend != "emulated":
        pytest.skip("bitwise only on the emulated backend")
    for where in (bridge, manager):  # take() sees no node made between the calls
        monkeypatch.setattr(where, "_autograd_nodes", lambda: 0)
    with pytest.raises(AssertionError, match="not equal"):
        _aux_after_capture(backend, device, replays, False, None)
