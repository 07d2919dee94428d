"""What a replay reads and hands back: static inputs refreshed, parameter gradients handed over
without a copy yet never overwritten while held, None (not zeros) for outputs the loss did not
use, outputs not modified in place."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from layer_models import (
    ATOL,
    RTOL,
    Scaled,
    TwoOut,
    check_gradient_accumulation,
    gpt_batches,
    tiny_gpt,
    train,
    twin,
    two_out_steps,
)

import tgraph
from tgraph.layers import replay as bridge
from tgraph.layers.captured import ParamRoute
from tgraph.layers.grads import GradHandOff, ParamGradOutputs, UnusedOutputs
from tgraph.layers.record import NoteBackward


def check_parity(backend, device):
    model = tiny_gpt(device)
    batches = gpt_batches(device, 4)
    losses, _ = train(twin(model), batches, graphed=True, backend=backend)
    ref, _ = train(model, batches, graphed=False)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)


@pytest.mark.usefixtures("no_verifier")  # the replays alone: the verifier would catch it
def test_planted_bug_skipped_input_copy_is_caught(backend, device, monkeypatch):
    check_parity(backend, device)
    tgraph.reset()
    monkeypatch.setattr(bridge, "copy_inputs", lambda cap, tensors: True)  # no copy
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        check_parity(backend, device)


def test_planted_bug_unprotected_param_grads_is_caught(backend, device, swaps):
    # What torch.cuda.make_graphed_callables does (pytorch issue 181723): .grad aliases the
    # static buffer, and the next microbatch's replay overwrites it. Planted: never moved out.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GradHandOff, "rescue", lambda self: None)
        with pytest.raises(AssertionError, match=r"^[\w.]+$"):  # msg= is the parameter's name
            check_gradient_accumulation(backend, device)


def _scaled_pair(backend, device, strict=True, **enable):
    """A graphed Scaled and its eager twin, graphs created after one recorded step."""
    torch.manual_seed(0)
    mod = Scaled().to(device)
    eager = copy.deepcopy(mod)
    tgraph.enable(mod, backend=backend, strict=strict, **enable)
    x = torch.randn(4, 8, device=device)
    mod(x).sum().backward()
    mod.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    return mod, eager, x


def test_usual_step_hands_over_gradients_without_a_copy(backend, device, swaps):
    """backward, step, zero_grad(set_to_none=True): .grad is the static memory, never copied,
    on every PyTorch; a gradient kept past the next replay (accumulation) gets its own copy
    first (storage swap, or the .grad re-pointed where it cannot swap)."""
    mod, eager, x = _scaled_pair(backend, device)
    mod(x).sum().backward()
    unit = next(iter(mod._tgraph.runners.values()))[0]
    static = {b.untyped_storage().data_ptr() for b in unit.cap.param_out.bufs}
    assert mod.lin.weight.grad.untyped_storage().data_ptr() in static
    assert mod.lin.bias.grad.untyped_storage().data_ptr() in static
    mod(2 * x).sum().backward()  # accumulate: the first gradient was moved out before replay
    assert mod.lin.weight.grad.untyped_storage().data_ptr() not in static
    eager(x).sum().backward()
    eager(2 * x).sum().backward()
    for p, q in zip(mod.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
    assert tgraph.eager_calls() == 0  # strict: replayed


def test_gradient_outputs_own_their_storage_and_are_handed_as_fresh_aliases():
    """ParamGradOutputs keeps a gradient where autograd made it when it owns its storage, laid
    out contiguously; one that shares memory with another gradient or with the graph's other
    static tensors, or that is a strided view, is copied (equal values). GradHandOff hands
    autograd detached aliases of the buffers, fresh tensors at every backward (AccumulateGrad
    adopts them), None where the parameter got no gradient; 0-d and empty gradients too."""
    grad_out = torch.randn(3, 4)
    big = torch.randn(10)
    own = [torch.randn(3, 4), torch.randn(()), torch.randn(2, 0, 3), torch.randn(5)]
    shared = [grad_out, big[2:7], torch.randn(4, 3).t(), own[0]]  # each must be copied
    grads = [own[0], None, own[1], own[2], own[3], *shared]
    plan = ParamGradOutputs()
    plan.set_outputs(plan.own(grads, others=[grad_out, None]))
    assert plan.present and plan._index == [0, 2, 3, 4, 5, 6, 7, 8]
    assert all(a is b for a, b in zip(plan.bufs, own))  # kept, no copy
    for buf, g in zip(plan.bufs[4:], shared):  # copied: storage of their own
        assert buf.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
        assert buf.is_contiguous() and buf.storage_offset() == 0
        torch.testing.assert_close(buf, g, rtol=0, atol=0)
    storages = {b.untyped_storage()._cdata for b in plan.bufs}
    assert len(storages) == len(plan.bufs)
    hand = GradHandOff(plan, ParamRoute())
    got = hand.for_autograd()
    assert len(got) == len(grads) and got[1] is None
    handed = [got[0], *got[2:]]
    for a, b in zip(handed, plan.bufs, strict=True):
        assert a is not b and not a.requires_grad and a._base is None
        assert (a.shape, a.stride(), a.storage_offset(), a.dtype) == (
            b.shape,
            b.stride(),
            b.storage_offset(),
            b.dtype,
        )
        assert a.untyped_storage()._cdata == b.untyped_storage()._cdata
    again = hand.for_autograd()
    assert all(x is not y for x, y in zip(got, again) if x is not None)
    assert hand.held_elsewhere()  # the handed aliases are alive here
    del got, again, handed, a, b
    assert not hand.held_elsewhere()  # the aliases gone: nothing but tgraph uses the buffers


def test_a_gradient_kept_anywhere_is_never_overwritten(backend, device, swaps):
    """A hook's list or a loop variable keeps last step's gradient: the next replays never
    overwrite it. With the storage swap its memory moves out; without it (PyTorch < 2.13) a
    parameter with a gradient hook makes its unit hand out copies (the hook may keep what it
    is given), so nothing views the graph's memory. Every call replays either way."""
    torch.manual_seed(0)
    mod = Scaled().to(device)
    eager = copy.deepcopy(mod)
    tgraph.enable(mod, backend=backend, strict=True)  # every call replays
    x = torch.randn(4, 8, device=device)
    mod(x).sum().backward()
    mod.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    kept, want = [], []
    mod.lin.weight.register_hook(lambda g: kept.append(g))
    eager.lin.weight.register_hook(lambda g: want.append(g))
    for m in (mod, eager):
        for scale in (1.0, 2.0, 3.0):
            m(scale * x).sum().backward()
            last = m.lin.weight.grad  # a loop variable holding the gradient
            m.zero_grad(set_to_none=True)
        assert last is not None
    for got, ref in zip(kept, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)
    unit = next(iter(mod._tgraph.runners.values()))[0]
    assert unit.state.grads.copying == (not swaps)


def test_planted_bug_hooked_parameters_without_copies_fall_back(backend, device, swaps):
    """Planted: without the storage swap and without the switch to copies, the hook's kept
    gradient views the graph's memory, so the replays that would overwrite it run eagerly."""
    if swaps:
        pytest.skip("the storage swap moves kept gradients out: no switch to plant")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GradHandOff, "watch_hooks", lambda self: None)
        with pytest.raises(tgraph.GraphFallbackError, match="cannot move it out"):
            test_a_gradient_kept_anywhere_is_never_overwritten(backend, device, swaps)


def test_a_gradient_a_loop_variable_keeps_costs_at_most_one_eager_call(backend, device, swaps):
    """``last = p.grad`` kept until the next step's backward: with the storage swap it moves out
    and every call replays; without it (PyTorch < 2.13) the next call runs eagerly once (the
    kept tensor is not ``.grad`` any more, so it cannot be re-pointed), and from then on the
    unit hands autograd copies and replays. Every gradient equals eager's, and the kept one
    still has its values after the next step."""
    mod, eager, x = _scaled_pair(backend, device, strict=False)
    seen = {}
    for m in (mod, eager):
        seen[m], last = [], None
        for scale in (1.0, 2.0, 3.0, 4.0, 5.0):
            m(scale * x).sum().backward()
            if last is not None:  # the next step ran: the kept gradient has its values still
                torch.testing.assert_close(last, seen[m][-1], rtol=0, atol=0)
            last = m.lin.weight.grad  # held across the next forward and backward
            m.zero_grad(set_to_none=True)
            seen[m].append(last.clone())
    for got, want in zip(seen[mod], seen[eager], strict=True):
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert tgraph.eager_calls() == (0 if swaps else 1)
    unit = next(iter(mod._tgraph.runners.values()))[0]
    assert unit.state.grads.copying == (not swaps)


def test_inplace_change_of_an_output_before_backward_is_an_error(backend, device):
    torch.manual_seed(0)
    mod = Scaled().to(device)
    tgraph.enable(mod, backend=backend)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod(x).sum().backward()
    tgraph.create_graphs()
    y = mod(x)
    with torch.no_grad():
        y.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place after its forward"):
        y.sum().backward()


def test_second_backward_through_a_replay_is_a_stale_backward_error(backend, device):
    """One backward per forward: a second backward (retain_graph=True) that the recorded
    iteration did not show would read buffers the first already consumed, so it raises
    tgraph.StaleBackwardError, catchable on its own, naming the cause and fixes that work."""
    torch.manual_seed(0)
    mod = Scaled().to(device)
    tgraph.enable(mod, backend=backend)
    x = torch.randn(4, 8, device=device, requires_grad=True)
    mod(x).sum().backward()
    tgraph.create_graphs()
    loss = mod(x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(tgraph.StaleBackwardError, match="second backward through one forward"):
        loss.backward()
    assert issubclass(tgraph.StaleBackwardError, RuntimeError)
    tgraph.reset()  # the fix the message names: record such a step
    eager = copy.deepcopy(mod)
    twice = [mod, eager]
    for m in twice:
        m.zero_grad(set_to_none=True)
        loss = m(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    with pytest.warns(tgraph.GraphFallbackWarning, match="backward ran more than once"):
        tgraph.create_graphs()
    for m in twice:  # now runs eagerly, as eager does
        loss = m(x).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    torch.testing.assert_close(mod.lin.weight.grad, eager.lin.weight.grad, rtol=0, atol=0)


class Head(tgraph.GraphableModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class MultiTask(nn.Module):
    """A shared trunk and one head per task."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(Scaled(), Scaled())
        self.heads = nn.ModuleList(Head() for _ in range(2))


def per_task_step(m: MultiTask, opt, x: torch.Tensor) -> list[torch.Tensor]:
    """PCGrad / GradNorm's pattern: one autograd.grad per task loss through the shared trunk
    (its forward backed through once per task), then the trunk's gradients combined."""
    h = m.trunk(x)
    trunk = list(m.trunk.parameters())
    per_task = []
    for head in m.heads:
        loss = head(h).square().mean()
        per_task.append(torch.autograd.grad(loss, [*trunk, *head.parameters()], retain_graph=True))
    for k, p in enumerate(trunk):
        p.grad = per_task[0][k] + per_task[1][k]
    for head, grads in zip(m.heads, per_task):
        for p, g in zip(head.parameters(), grads[len(trunk) :]):
            p.grad = g
    opt.step()
    opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in m.parameters()]


def check_backward_twice_stays_eager(backend, device, replays):
    """The trunk, backed through twice per forward in the recorded step, stays eager (named,
    warned); the heads, backed through once, replay; every step equals eager's (bitwise on the
    emulated backend)."""
    torch.manual_seed(0)
    model = MultiTask().to(device)
    eager = twin(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    xs = torch.randn(4, 4, 8, device=device)
    tgraph.enable(model, backend=backend)
    for i, x in enumerate(xs):
        before = replays[0]
        got, want = per_task_step(model, opts[0], x), per_task_step(eager, opts[1], x)
        if i == 0:
            with pytest.warns(tgraph.GraphFallbackWarning, match="backward ran more than once"):
                report = tgraph.create_graphs()
            assert [e.split(" (its backward ran more")[0] for e in report.eager_modules] == [
                "trunk.0 (Scaled)",
                "trunk.1 (Scaled)",
            ]
        else:
            assert replays[0] - before == 4  # each head: its forward and its backward
        tol = dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(got, want, **tol)


def test_backward_twice_in_the_recorded_step_stays_eager(backend, device, replays):
    check_backward_twice_stays_eager(backend, device, replays)


def test_planted_bug_backward_twice_not_noted_is_caught(backend, device, replays, monkeypatch):
    def backward(ctx, *grads):  # notes the backward, never that it ran twice
        ctx.record.add(ctx.runner, "bwd")
        ctx.land()
        return (None, None, None, *grads)

    monkeypatch.setattr(NoteBackward, "backward", staticmethod(backward))
    with pytest.raises(pytest.fail.Exception, match="DID NOT WARN"):
        check_backward_twice_stays_eager(backend, device, replays)


def test_backward_twice_in_the_recorded_step_is_refused_under_strict(backend, device):
    torch.manual_seed(0)
    model = MultiTask().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tgraph.enable(model, backend=backend, strict=True)
    per_task_step(model, opt, torch.randn(4, 8, device=device))
    with pytest.raises(tgraph.CaptureError, match="backward ran more than once for one forward"):
        tgraph.create_graphs()


def test_unused_output_gives_no_gradient(backend, device):
    torch.manual_seed(0)
    mod = TwoOut().to(device)
    eager = copy.deepcopy(mod)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(8, 4, device=device, requires_grad=True)
    got = two_out_steps(mod, x, True, backend)
    want = two_out_steps(eager, x, False, backend)
    torch.testing.assert_close(got[1], want[1], rtol=RTOL, atol=ATOL)
    for (gb, gx), (wb, wx) in zip(got[2:], want[2:]):
        assert wb is None and gb is None, "b is reached only through the unused output"
        torch.testing.assert_close(gx, wx, rtol=RTOL, atol=ATOL)  # a's path only
    for p, q in zip(mod.parameters(), eager.parameters()):  # AdamW left b alone, as eagerly
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_planted_bug_unused_output_gives_zeros_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(UnusedOutputs, "none_positions", lambda self, active, memo: [])
    torch.manual_seed(0)
    mod = TwoOut().to(device)
    tgraph.enable(mod, backend=backend, strict=True)
    x = torch.randn(8, 4, device=device, requires_grad=True)
    got = two_out_steps(mod, x, True, backend)
    assert torch.count_nonzero(got[2][0]) == 0  # zeros: the bug AdamW turns into drift


@pytest.mark.usefixtures("no_verifier")  # the replays alone: the verifier would catch it
def test_planted_bug_stale_grad_output_buffer_is_caught(backend, device, monkeypatch):
    """The known-zero branch runs now: when b's gradient goes from used to unused, its buffer
    must be zeroed, or x.grad keeps b's old contribution."""

    def never_zero(cap, state, grads):
        for buf, i in zip(cap.static_grad_outputs, cap.out_rg):
            if grads[i] is not None:
                buf.copy_(grads[i])

    monkeypatch.setattr(bridge, "copy_grad_outputs", never_zero)
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        test_unused_output_gives_no_gradient(backend, device)


class _PosBlock(tgraph.GraphableModule):
    """``lin(x) + pos``, ``pos`` of the output's shape: autograd's gradient of ``pos`` is the
    incoming gradient itself, i.e. the backward graph's grad-output buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.pos = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return self.lin(x) + self.pos


def test_a_gradient_that_is_the_grad_output_buffer_survives_debug_poisoning(backend, device, swaps):
    """debug=True fills the grad-output buffers with NaN after each backward replay. A parameter
    gradient that autograd returned as that very buffer must reach .grad first (in a buffer
    of its own), so training with debug on equals eager, with the storage swap and without."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_PosBlock(), _PosBlock()).to(device)
    ref = copy.deepcopy(model)
    tgraph.enable(model, backend=backend, strict=True, debug=True)
    x = torch.randn(4, 8, device=device)
    for i in range(3):
        for m in (model, ref):
            m.zero_grad(set_to_none=True)
            (m(x) ** 2).sum().backward()
        if i == 0:
            tgraph.create_graphs()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)


def _accumulator(p: torch.Tensor):
    return p.view_as(p).grad_fn.next_functions[0][0]


def test_the_parameters_gradient_accumulators_live_as_long_as_the_graphs(backend, device):
    """Autograd holds a leaf's AccumulateGrad node only through the graph's edges: tgraph holds
    the graphed parameters' nodes, so replays do not build them anew each step. Seen through
    the node's metadata, which lives and dies with the node; also after the gradients are
    re-routed to parameters replaced after capture (load_state_dict(assign=True)); every call
    replays (strict mode). On autograd's path (direct_grads=False): a parameter written
    directly has no node to hold."""
    mod, eager, x = _scaled_pair(backend, device, direct_grads=False)
    loose = nn.Parameter(torch.ones(()))  # no holder: a new node at each call
    _accumulator(loose).metadata["mark"] = 1
    assert "mark" not in _accumulator(loose).metadata
    _accumulator(mod.lin.weight).metadata["mark"] = 1
    for _ in range(2):
        mod(x).sum().backward()
        mod.zero_grad(set_to_none=True)
    assert _accumulator(mod.lin.weight).metadata.get("mark") == 1
    mod.load_state_dict({k: v.clone() for k, v in eager.state_dict().items()}, assign=True)
    mod(x).sum().backward()  # replayed on the new parameters: nothing holds the old ones
    eager(x).sum().backward()
    _accumulator(mod.lin.weight).metadata["mark"] = 2
    for _ in range(2):  # graphed on the new parameters
        mod(x).sum().backward()
        eager(x).sum().backward()
    assert _accumulator(mod.lin.weight).metadata.get("mark") == 2
    for p, q in zip(mod.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


def test_the_held_accumulators_follow_a_dtype_round_trip(backend, device):
    """model.double().float() (an offload round trip) gives each parameter a new
    AccumulateGrad node; the held ones follow (found in review: the stale ones stayed held and
    every step built the nodes anew again). On autograd's path (direct_grads=False)."""
    mod, eager, x = _scaled_pair(backend, device, direct_grads=False)
    mod(x).sum().backward()
    for trip in range(2):  # the second while the first is followed (found in review)
        for m in (mod, eager):
            m.double().float()
        for m in (mod, eager):
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        _accumulator(mod.lin.weight).metadata["mark"] = trip
        mod.zero_grad(set_to_none=True)
        mod(x).sum().backward()
        assert _accumulator(mod.lin.weight).metadata.get("mark") == trip
    for p, q in zip(mod.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)


class _PassedThrough(tgraph.GraphableModule):
    """Parameters whose gradient autograd hands on as one tensor: in ``lin(x) + a + b`` with
    full-shaped ``a`` and ``b``, AddBackward passes the incoming gradient itself to both."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.a = torch.nn.Parameter(torch.randn(4, 8))
        self.b = torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.a + self.b


def test_gradients_autograd_passes_through_get_buffers_of_their_own(backend, device, swaps):
    """The capture's autograd returns the incoming gradient (the static grad-output buffer)
    as two parameters' gradients: each gets a buffer of its own, so accumulating over
    microbatches (each backward rewrites the grad-output buffer) equals eager."""
    unit = _accumulate_passed_through(backend, device)
    storages = [b.untyped_storage()._cdata for b in unit.cap.param_out.bufs]
    grad_outs = {g.untyped_storage()._cdata for g in unit.cap.static_grad_outputs}
    assert len(set(storages)) == len(storages) == 4 and not grad_outs & set(storages)


def test_planted_bug_gradients_kept_where_autograd_shared_them_is_caught(
    backend, device, swaps, monkeypatch
):
    """Planted: every gradient kept where the capture's autograd made it, shared or not; a
    and b then share one buffer, the grad-output buffer, and accumulation goes wrong."""

    def keep_all(self, grads, others):
        self._n, self._index = len(grads), [i for i, g in enumerate(grads) if g is not None]
        return [g for g in grads if g is not None]

    monkeypatch.setattr(ParamGradOutputs, "own", keep_all)
    with pytest.raises(AssertionError, match=r"^[ab]$"):  # msg= is the parameter's name
        _accumulate_passed_through(backend, device)


def _accumulate_passed_through(backend, device):
    """Three microbatches accumulated through a graphed _PassedThrough equal eager's; returns
    its unit. After each backward ``a``'s gradient is halved in place, as per-parameter
    gradient scaling does: a ``b.grad`` sharing its memory then differs from eager's on every
    backend. (The accumulation alone did not show it on CUDA: a and b have the same gradient,
    and one ``_foreach_add_`` into two tensors on one memory most likely races there, so the
    doubled addend lands once.)"""
    torch.manual_seed(0)
    mod = _PassedThrough().to(device)
    eager = copy.deepcopy(mod)
    tgraph.enable(mod, backend=backend, strict=True)
    mod(torch.randn(4, 8, device=device)).square().sum().backward()
    mod.zero_grad(set_to_none=True)
    tgraph.create_graphs()
    xs = [torch.randn(4, 8, device=device) for _ in range(3)]
    for m in (mod, eager):
        for x in xs:
            m(x).square().sum().backward()
            m.a.grad.mul_(0.5)
    for (name, p), q in zip(mod.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL, msg=name)
    assert tgraph.eager_calls() == 0  # strict: replayed
    return next(iter(mod._tgraph.runners.values()))[0]
