"""FullIterationGraph against eager training when something the step depends on changes between
calls: the modules' train/eval mode, a parameter frozen or unfrozen, the batch written in place
by the step.

Tolerance: bitwise on the emulated backend (the same kernels on the same numbers, learning rates
exact in float32); on CUDA the suite's ``rtol=1e-4, atol=1e-5`` (reduction order in backward
kernels). Every planted bug below moves losses or parameters by 1e-3 or more.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tgraph
from tgraph.step import full_iteration, hyperparams
from tgraph.step.captured import StepMode

WARMUP = 2
LR = 2.0**-7  # exact in float32: a tensor learning rate is the eager float


def tol(backend: str) -> dict:
    return dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=1e-4, atol=1e-5)


def make_model(device: torch.device, p: float = 0.5) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(p), nn.Tanh(), nn.Linear(16, 4)).to(device)


def make_batches(device: torch.device, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(5, 8, generator=g).to(device), torch.randn(5, 4, generator=g).to(device))
        for _ in range(n)
    ]


def make_fn(model: nn.Module, opt: torch.optim.Optimizer, write_x: bool = False):
    def fn(batch):
        x, y = batch
        if write_x:
            x.mul_(0.5)  # in-place preprocessing of the batch
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    return fn


def adamw(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    extra = {"capturable": True} if device.type == "cuda" else {"fused": True}
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, **extra)


def run(backend, device, graphed, before_step, opt=None, n=13, write_x=False, batches=None):
    """Losses, final parameters and the step of ``n`` steps; ``before_step(i, model)`` runs
    before step ``i``."""
    model = make_model(device)
    opt = (opt or (lambda m, d: torch.optim.SGD(m.parameters(), lr=LR)))(model, device)
    step = make_fn(model, opt, write_x)
    if graphed:
        step = tgraph.FullIterationGraph(step, warmup_steps=WARMUP, backend=backend)
    torch.manual_seed(123)  # the dropout masks: the same draws eagerly and in the graph
    if device.type == "cuda":
        torch.cuda.manual_seed(123)
    losses = []
    for i, b in enumerate(batches or make_batches(device, n)):
        before_step(i, model)
        losses.append(step(b).detach().clone())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], step


def _eval_then_train(i: int, model: nn.Module) -> None:
    if i == 6:
        model.eval()  # dropout off for some steps (captured at 2, replayed 3-5)
    if i == 10:
        model.train()  # back to the first graph


def test_eval_and_train_after_capture_match_eager(backend, device, replays):
    """model.eval() after capture gets a graph of its own (warmed up and captured in eval mode),
    and model.train() replays the train graph again; eager all along would differ from a graph
    that kept drawing dropout masks in eval mode."""
    want = run(backend, device, False, _eval_then_train)
    got = run(backend, device, True, _eval_then_train)
    torch.testing.assert_close(got[0], want[0], **tol(backend))
    torch.testing.assert_close(got[1], want[1], **tol(backend))
    assert got[2].num_graphs == 2
    # train graph: steps 3-5 and 10-12; eval graph: step 9 (+ the captures 2 and 8 on CUDA)
    assert replays[0] == 7 + 2 * (backend == "cuda")


def test_training_flags_are_read_only_after_a_module_write(backend, device, monkeypatch):
    """The steady replay reads no module's training flag unless a module of the step was
    written since (the module epoch): eval() and train() go through nn.Module.__setattr__."""
    reads = [0]
    same_training = StepMode.same_training

    def counted(self):
        reads[0] += 1
        return same_training(self)

    monkeypatch.setattr(StepMode, "same_training", counted)
    steps = []

    def note(i: int, model: nn.Module) -> None:
        steps.append(reads[0])
        if i == 8:
            model.train()  # a write (the same mode): read once more, then cached again

    run(backend, device, True, note, n=12)
    # captured at step 2; read at step 3 (the first replay), then only after the write at 8
    assert steps[4:] == [1, 1, 1, 1, 1, 2, 2, 2]


def test_step_that_sets_its_own_mode_keeps_replaying(backend, device):
    """fn calls model.train() itself and the loop calls model.eval() between steps (an
    evaluation outside the step): eager trains in train mode all along, and so do the graphs;
    every eval() does not make a new graph (max_graphs would stop the run)."""

    def opt_of(model, device):
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        inner = make_fn(model, opt)

        def fn(batch):  # make_fn's step, in train mode whatever the caller left
            model.train()
            return inner(batch)

        return opt, fn

    def evaluate_every_3(i: int, model: nn.Module) -> None:
        if i % 3 == 2:
            model.eval()

    results = []
    for graphed in (False, True):
        model = make_model(device)
        opt, step = opt_of(model, device)
        if graphed:
            step = tgraph.FullIterationGraph(step, warmup_steps=WARMUP, backend=backend)
        torch.manual_seed(123)
        if device.type == "cuda":
            torch.cuda.manual_seed(123)
        losses = []
        for i, b in enumerate(make_batches(device, 16)):
            evaluate_every_3(i, model)
            losses.append(step(b).detach().clone())
        results.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(results[1], results[0], **tol(backend))
    assert step.num_graphs <= 2


def test_mode_beyond_max_graphs_raises(backend, device):
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = tgraph.FullIterationGraph(
        make_fn(model, opt), warmup_steps=WARMUP, backend=backend, max_graphs=1
    )
    batches = make_batches(device, WARMUP + 2)
    for b in batches[:-1]:
        step(b)
    model.eval()
    with pytest.raises(
        RuntimeError, match=r"captured in another mode: .*training changed from True to False"
    ):
        step(batches[-1])


def _freeze_then_unfreeze(i: int, model: nn.Module) -> None:
    if i == 5:
        model[0].weight.requires_grad_(False)  # fine-tuning: the first layer frozen
    if i == 10:
        model[0].weight.requires_grad_(True)


def test_frozen_parameter_after_capture_matches_eager(backend, device, replays):
    """requires_grad_(False) on a parameter after capture gets a graph of its own: the frozen
    weight stays where it is, under fused AdamW (whose weight decay would move it in the first
    graph); unfrozen, the first graph replays again."""
    want = run(backend, device, False, _freeze_then_unfreeze, opt=adamw)
    got = run(backend, device, True, _freeze_then_unfreeze, opt=adamw)
    torch.testing.assert_close(got[0], want[0], **tol(backend))
    torch.testing.assert_close(got[1], want[1], **tol(backend))
    assert got[2].num_graphs == 2
    # first graph: steps 3, 4 and 10-12; frozen graph: 8, 9 (+ the captures 2, 7 on CUDA)
    assert replays[0] == 7 + 2 * (backend == "cuda")


def _own_lr_tensor(device: torch.device):
    """Before step 5 (after the capture) the group gets the caller's own lr tensor; before
    step 9 the caller updates it in place."""
    own = torch.tensor(LR * 2, device=device)

    def change(i: int, opt: torch.optim.Optimizer) -> None:
        if i == 5:
            opt.param_groups[0]["lr"] = own
        if i == 9:
            own.fill_(LR * 4)

    return change


def _betas_list(device: torch.device):
    """A list for ``betas`` (as a config file gives it), changed in place before step 5."""

    def change(i: int, opt: torch.optim.Optimizer) -> None:
        if i == 0:
            opt.param_groups[0]["betas"] = [0.9, 0.999]
        if i == 5:
            opt.param_groups[0]["betas"][0] = 0.5

    return change


_HYPERPARAMETER_CHANGES = {
    # the change, what the warning names, and the naive version that misses it: the caller's
    # tensor taken for a new float (copied once, its in-place update never reaches the graph);
    # the list kept by reference (compared with itself)
    "lr_tensor": (
        _own_lr_tensor,
        "'lr' was a float at capture and is a Tensor now",
        ("_is_float", lambda value: True),
    ),
    "betas_list": (_betas_list, "'betas' changed after capture", ("_copied", lambda value: value)),
}


def _run_changing(backend, device, graphed, change):
    """``run`` with AdamW, calling ``change(i, opt)`` before step ``i``."""
    made = []

    def make_opt(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
        made.append(adamw(model, device))
        return made[-1]

    return run(backend, device, graphed, lambda i, model: change(i, made[-1]), opt=make_opt)


@pytest.mark.parametrize("kind", list(_HYPERPARAMETER_CHANGES))
def test_hyperparameter_changed_in_place_after_capture_matches_eager(
    backend, device, kind, replays
):
    """The caller's own lr tensor assigned after capture (then updated in place), and a betas
    list changed in place: each is named, the step is captured again (reading the caller's
    tensor in place; with the new betas), and training is eager's."""
    make_change, named, _ = _HYPERPARAMETER_CHANGES[kind]
    want = _run_changing(backend, device, False, make_change(device))
    with pytest.warns(tgraph.GraphFallbackWarning, match=named):
        got = _run_changing(backend, device, True, make_change(device))
    torch.testing.assert_close(got[0], want[0], **tol(backend))
    torch.testing.assert_close(got[1], want[1], **tol(backend))
    # steps 3, 4 replay; 5, 6 eager, 7 captured, 8-12 replayed (+ the captures 2, 7 on CUDA)
    assert replays[0] == 7 + 2 * (backend == "cuda")


@pytest.mark.parametrize("kind", list(_HYPERPARAMETER_CHANGES))
def test_planted_hyperparameter_change_missed_is_caught(backend, device, kind, monkeypatch):
    make_change, _, (name, naive) = _HYPERPARAMETER_CHANGES[kind]
    monkeypatch.setattr(hyperparams, name, naive)
    want = _run_changing(backend, device, False, make_change(device))
    got = _run_changing(backend, device, True, make_change(device))
    with pytest.raises(AssertionError, match="Tensor-likes are not"):
        torch.testing.assert_close(got[1], want[1], **tol(backend))


def test_step_writing_its_batch_in_place_reaches_the_caller(backend, device, replays):
    """fn scales its batch in place: after a replay the caller's tensor holds what eager leaves
    in it, and a loop that reuses one batch trains on the same data as eager."""
    x, y = make_batches(device, 1)[0]
    results = []
    for graphed in (False, True):
        batch = (x.clone(), y.clone())
        kept = []

        def note(i: int, model: nn.Module, kept=kept, batch=batch) -> None:
            kept.append(batch[0].clone())  # the caller's x before each step

        losses, params, _ = run(
            backend, device, graphed, note, n=6, write_x=True, batches=[batch] * 6
        )
        results.append((losses, params, kept, batch[0].clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, **tol(backend))
    assert replays[0] == 3 + (backend == "cuda")  # steps 3-5 (+ 1 on CUDA: the capture)


def test_planted_missing_write_back_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(full_iteration, "_copy_back", lambda cap, tensors: None)
    with pytest.raises(AssertionError, match="Tensor-likes are not"):
        test_step_writing_its_batch_in_place_reaches_the_caller(backend, device, [0])


def _aliased(batch):
    x, _ = batch
    return (x, x.view(-1)[:20].view(5, 4))  # y is a view of x (contiguous: the same signature)


def test_batch_views_are_served_while_the_step_only_reads_them(backend, device, replays):
    batches = [_aliased(b) for b in make_batches(device, 6)]
    want = run(backend, device, False, lambda i, m: None, batches=batches)
    batches = [_aliased(b) for b in make_batches(device, 6)]
    got = run(backend, device, True, lambda i, m: None, batches=batches)
    torch.testing.assert_close(got[0], want[0], **tol(backend))
    assert replays[0] == 3 + (backend == "cuda")


def _write_y(model, opt):
    def fn(batch):
        x, y = batch
        y.mul_(2)  # reaches x eagerly, where y is a view of x
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    return fn


@pytest.mark.parametrize("when", ["capture", "replay"])
def test_batch_views_written_in_place_are_refused(backend, device, when):
    """A step that writes a batch tensor which is a view of another batch tensor: the graph's
    static copies are separate tensors, so the write would not reach the other one. Refused
    before the step runs, at the capture or at a later call; the parameters stay as eager left
    them."""
    model = make_model(device, p=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    step = tgraph.FullIterationGraph(_write_y(model, opt), warmup_steps=WARMUP, backend=backend)
    batches = make_batches(device, WARMUP + 3)
    n = WARMUP if when == "capture" else WARMUP + 1  # the calls before the refused one
    for b in batches[:n]:
        step(_aliased(b) if when == "capture" else b)  # eager (and, separate, captured)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="writes batch tensor 1 in place, and it shares memory"):
        step(_aliased(batches[n]))
    torch.testing.assert_close([p.detach() for p in model.parameters()], before, rtol=0, atol=0)
    if when == "capture":  # failed: eager from now on, as after any failed capture
        with pytest.warns(tgraph.GraphFallbackWarning, match="capture failed"):
            step(_aliased(batches[n + 1]))
    else:  # the graph stays for batches of separate tensors
        step(batches[n + 1])
        assert step.num_graphs == 1


def test_a_batch_tensor_whose_grad_the_step_writes_is_refused(backend, device):
    """A batch tensor that requires grad, whose gradient the step's backward computes (x + delta,
    an adversarial perturbation the caller trains): the graph's static copy of it is a leaf, so
    no replay could reach delta's .grad (it would stay as the warmup left it). The capture
    refuses in one line, before the step runs."""
    model = make_model(device, p=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def fn(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        return loss

    step = tgraph.FullIterationGraph(fn, warmup_steps=WARMUP, backend=backend)
    batches = make_batches(device, WARMUP + 1)
    delta = torch.zeros_like(batches[0][0], requires_grad=True)
    for x, y in batches[:WARMUP]:
        step((x + delta, y))  # eager: the gradient reaches delta
    assert delta.grad is not None
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches[WARMUP]
    with pytest.raises(ValueError, match=r"wrote \.grad of batch tensor 0 .*autograd\.grad"):
        step((x + delta, y))  # the graph's copy of x + delta is a leaf: delta would get nothing
    torch.testing.assert_close([p.detach() for p in model.parameters()], before, rtol=0, atol=0)


def _param_hooks(kind: str, at: int, handles: list):
    """Before step ``at``: a hook halving a parameter's gradient added (``add``), or the one
    added before step 0 removed (``remove``); a tensor hook or a post-accumulate hook."""

    def halve(g):
        return g * 0.5

    def halve_grad(p):
        p.grad.mul_(0.5)

    def before(i, model):
        p = next(model.parameters())
        if (kind.startswith("add") and i == at) or (kind.startswith("remove") and i == 0):
            hook = p.register_hook(halve) if kind.endswith("tensor") else None
            hook = hook or p.register_post_accumulate_grad_hook(halve_grad)
            handles.append(hook)
        if kind.startswith("remove") and i == at:
            handles.pop().remove()

    return before


@pytest.mark.parametrize("kind", ["add_tensor", "add_post", "remove_tensor", "remove_post"])
def test_a_parameter_hook_added_or_removed_after_capture_is_seen(backend, device, kind, replays):
    """A parameter's gradient hook ran inside the captured backward, so the graph replays the
    hooks of capture: one added (or removed) after capture makes the next call warn and capture
    again, with eager's numbers, and the new graph replays."""
    want = run(backend, device, False, _param_hooks(kind, 5, []), n=10)
    hooks, at_change = _param_hooks(kind, 5, []), []

    def before(i, model):
        hooks(i, model)
        if i == 5:
            at_change.append(replays[0])

    with pytest.warns(tgraph.GraphFallbackWarning, match="gradient hooks of parameter 0"):
        got = run(backend, device, True, before, n=10)
    torch.testing.assert_close(got[0], want[0], **tol(backend))
    torch.testing.assert_close(got[1], want[1], **tol(backend))
    assert at_change[0] >= 2 and replays[0] > at_change[0]  # replayed before and after


def _own_mode_run(backend, device, graphed, n=8):
    """fn calls model.train() itself; before every step the loop calls model.eval() and runs a
    validation forward; after it, a forward that reads the mode the step left (dropout)."""
    model = make_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inner = make_fn(model, opt)

    def fn(batch):
        model.train()
        return inner(batch)

    step = tgraph.FullIterationGraph(fn, warmup_steps=WARMUP, backend=backend) if graphed else fn
    torch.manual_seed(123)
    if device.type == "cuda":
        torch.cuda.manual_seed(123)
    losses, flags, after = [], [], []
    for x, y in make_batches(device, n):
        model.eval()
        with torch.no_grad():
            model(x)  # validation
        losses.append(step((x, y)).detach().clone())
        flags.append([m.training for m in model.modules()])
        with torch.no_grad():
            after.append(model(x))  # dropout drawn as the mode the step left says
    params = [p.detach().clone() for p in model.parameters()]
    return flags, (torch.stack(losses), torch.stack(after), params)


def test_step_that_sets_its_own_mode_leaves_the_flags_as_eager(backend, device, replays):
    """The graph captured after eval() ran fn's model.train(); its replays run no Python, so
    they set the flags fn left (the model trains on in train mode, as eager)."""
    want = _own_mode_run(backend, device, False)
    got = _own_mode_run(backend, device, True)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], **tol(backend))
    assert replays[0] == 5 + (backend == "cuda")  # steps 3-7 (+ 1 on CUDA: the capture)


def test_planted_own_mode_not_set_after_replay_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(StepMode, "apply", lambda self: None)
    with pytest.raises(AssertionError):
        test_step_that_sets_its_own_mode_leaves_the_flags_as_eager(backend, device, [0])


def _unfreeze_at_capture(i: int, model: nn.Module) -> None:
    if i == 0:
        model[0].weight.requires_grad_(False)
    if i == WARMUP:
        model[0].weight.requires_grad_(True)  # progressive unfreezing, at the capture call


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_layer_unfrozen_at_the_capture_matches_eager(backend, device, replays, opt_kind):
    """A layer unfrozen at the call that would capture: that call warms up once more in the
    new mode (the weight gets its .grad and optimizer state eagerly), the next captures; the
    weight's gradient then counts as cleared by fn's zero_grad, nothing to refuse."""
    opt = adamw if opt_kind == "adamw" else None
    want = run(backend, device, False, _unfreeze_at_capture, opt=opt, n=8)
    got = run(backend, device, True, _unfreeze_at_capture, opt=opt, n=8)
    torch.testing.assert_close(got[0], want[0], **tol(backend))
    torch.testing.assert_close(got[1], want[1], **tol(backend))
    assert replays[0] == 4 + (backend == "cuda")  # steps 4-7 (+ 3 on CUDA)


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw"])
def test_planted_capture_in_a_mode_not_warmed_up_is_caught(backend, device, monkeypatch, opt_kind):
    """Captured right at the unfreezing: SGD's graph was refused (the unfrozen .grad None at
    the capture), AdamW's created the weight's state inside the graph, anew at every replay."""
    monkeypatch.setattr(full_iteration, "_mode_moved", lambda entry: False)
    with pytest.raises((ValueError, AssertionError)):
        test_layer_unfrozen_at_the_capture_matches_eager(backend, device, [0], opt_kind)


def _chunked_run(backend, device, graphed, n=6):
    """fn takes microbatches made by x.chunk(2) (disjoint views of one batch tensor) and
    centres each in place; the caller's x after each step is kept."""
    model = make_model(device, p=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def fn(mbs):
        opt.zero_grad(set_to_none=True)
        total = 0
        for x, y in mbs:
            x.sub_(x.mean(0, keepdim=True))
            loss = ((model(x) - y) ** 2).mean() / len(mbs)
            loss.backward()
            total = total + loss.detach()
        opt.step()
        return total

    step = tgraph.FullIterationGraph(fn, warmup_steps=WARMUP, backend=backend) if graphed else fn
    g = torch.Generator().manual_seed(1)
    losses, xs = [], []
    for _ in range(n):
        x, y = torch.randn(8, 8, generator=g).to(device), torch.randn(8, 4, generator=g).to(device)
        losses.append(step(list(zip(x.chunk(2), y.chunk(2)))).detach().clone())
        xs.append(x.clone())
    return torch.stack(losses), torch.stack(xs), [p.detach().clone() for p in model.parameters()]


def test_chunked_microbatches_written_in_place_match_eager(backend, device, replays):
    """Disjoint views of one storage are not refused: each write reaches only its own rows,
    in the graph's static copies as eagerly, and is copied back to the caller's x."""
    want = _chunked_run(backend, device, False)
    got = _chunked_run(backend, device, True)
    torch.testing.assert_close(got, want, **tol(backend))
    assert replays[0] == 3 + (backend == "cuda")  # steps 3-5 (+ 1 on CUDA: the capture)


def test_planted_storage_wide_refusal_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(full_iteration, "_overlap", lambda a, b: True)
    with pytest.raises(ValueError, match="shares memory"):
        test_chunked_microbatches_written_in_place_match_eager(backend, device, [0])


def test_overlap_of_batch_views():
    """Byte ranges: chunks and disjoint slices are apart; views sharing an element, or strided
    views whose ranges interleave (conservative), overlap."""
    x = torch.zeros(4, 6)
    a, b = x.chunk(2)
    assert not full_iteration._overlap(a, b)
    assert not full_iteration._overlap(x[:, :3], x[3:, 3:])
    assert full_iteration._overlap(x, x.view(-1)[20:22])
    assert full_iteration._overlap(x[1:3], x[2])
    assert full_iteration._overlap(x[:, ::2], x[:, 1::2])


# -- objects the step reaches, replaced after capture (tgraph.step.reach) ------------------------


class Trainer:
    """A training step reaching its model, optimizer and loss through ``self``."""

    def __init__(self, device: torch.device) -> None:
        self.model = make_model(device, p=0.0)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.loss_fn = nn.MSELoss()
        self.calls = 0  # a counter bumped outside the step: no recapture

    def step(self, batch):
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss


def _replace(what: str, device: torch.device, model: nn.Module) -> dict:
    """The new objects for ``what``: a loss module, an optimizer over the same parameters (its
    state fresh), or a new model and its optimizer."""
    if what == "loss":
        return {"loss_fn": nn.L1Loss()}
    if what == "opt":
        return {"opt": adamw(model, device)}
    torch.manual_seed(7)
    new = make_model(device, p=0.0)
    return {"model": new, "opt": torch.optim.SGD(new.parameters(), lr=4 * LR)}


def _reach_run(backend, device, graphed, what, via, n=12, at=6):
    """Losses, the final model's parameters and the warnings of ``n`` steps of a step reaching
    its objects ``via`` a trainer's attributes, a closed-over dict or closure variables, with
    ``what`` replaced before step ``at``."""
    tr = Trainer(device)
    if via == "attribute":
        fn = tr.step
        objects = vars(tr)
    elif via == "dict":
        st = {"model": tr.model, "opt": tr.opt, "loss_fn": tr.loss_fn}

        def fn(batch):
            st["opt"].zero_grad(set_to_none=True)
            loss = st["loss_fn"](st["model"](batch[0]), batch[1])
            loss.backward()
            st["opt"].step()
            return loss

        objects = st
    else:  # closure variables, rebound through nonlocal
        model, opt, loss_fn = tr.model, tr.opt, tr.loss_fn

        def fn(batch):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(batch[0]), batch[1])
            loss.backward()
            opt.step()
            return loss

        def rebind(new):
            nonlocal model, opt, loss_fn
            model, opt = new.get("model", model), new.get("opt", opt)
            loss_fn = new.get("loss_fn", loss_fn)
            return {"model": model}

        objects = None
    step = tgraph.FullIterationGraph(fn, warmup_steps=WARMUP, backend=backend) if graphed else fn
    losses, current = [], tr.model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, b in enumerate(make_batches(device, n)):
            if i == at:
                new = _replace(what, device, current)
                if objects is None:
                    rebind(new)
                else:
                    objects.update(new)
                current = new.get("model", current)
            losses.append(step(b).detach().clone())
    params = [p.detach().clone() for p in current.parameters()]
    return torch.stack(losses), params, [str(w.message) for w in caught]


_REPLACED = {"loss": "loss_fn", "opt": "opt", "model": "model"}


@pytest.mark.parametrize("via", ["attribute", "dict", "closure"])
@pytest.mark.parametrize("what", ["loss", "opt", "model"])
def test_object_replaced_after_capture_matches_eager(backend, device, replays, what, via):
    """A loss module, an optimizer (a new one over the same parameters) or the model and its
    optimizer replaced after capture: the next call warns naming it, runs eagerly and the step
    is captured again; every step as eager's. Replays: steps 3-5, then 9-11 after the new
    capture at 8 (+1 each on CUDA: its capture's step is a replay)."""
    want_losses, want_params, _ = _reach_run(backend, device, False, what, via)
    losses, params, caught = _reach_run(backend, device, True, what, via)
    torch.testing.assert_close(losses, want_losses, **tol(backend))
    torch.testing.assert_close(params, want_params, **tol(backend))
    assert [m for m in caught if "was replaced after capture" in m] == [caught[0]]
    assert _REPLACED[what] in caught[0] and len(caught) == 1, caught
    assert replays[0] == 6 + 2 * (backend == "cuda")


@pytest.mark.parametrize("what", ["loss", "opt", "model"])
def test_planted_replaced_object_missed_is_caught(backend, device, what, monkeypatch):
    """Planted: the replaced object not seen, the graph replays the captured one's kernels."""
    from tgraph.step.reach import Reach

    monkeypatch.setattr(Reach, "change", lambda self: None)
    want_losses, _, _ = _reach_run(backend, device, False, what, "attribute")
    losses, _, caught = _reach_run(backend, device, True, what, "attribute")
    assert not caught
    assert not torch.allclose(losses, want_losses, rtol=1e-3, atol=1e-3)


def test_counter_bumped_outside_the_step_keeps_replaying(backend, device, replays):
    """Plain values on the trainer (a step counter, a float) and tensors assigned between steps
    are not objects the step reaches: no warning, every step after the capture replays."""
    tr = Trainer(device)
    tr.history = []
    step = tgraph.FullIterationGraph(tr.step, warmup_steps=WARMUP, backend=backend)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for b in make_batches(device, 10):
            loss = step(b)
            tr.calls += 1
            tr.last_loss = loss
            tr.seconds = 0.1 * tr.calls
            tr.batch = b  # a tuple of tensors, replaced every step
            tr.history.append(tr.calls)
            # records of plain values, loggers, times and iterators made anew every step are
            # compared by class: a probe saw them recapture at every step, never replaying
            tr.state = _TrainState(step=tr.calls, loss=loss.item())
            tr.logger = logging.getLogger(f"tgraph.test.{tr.calls}")
            tr.when = datetime.datetime.now()
            tr.it = iter(range(3))
    assert replays[0] == 7 + (backend == "cuda")


@dataclasses.dataclass
class _TrainState:
    step: int
    loss: float


class _LossHelper:
    """A callable helper holding the loss module (a trainer's ``self.loss_fn``)."""

    def __init__(self, crit: nn.Module) -> None:
        self.crit = crit

    def __call__(self, out, y):
        return self.crit(out, y)


@pytest.mark.parametrize("where", ["helper", "module_attribute"])
def test_an_object_replaced_one_level_inside_is_seen(backend, device, replays, where):
    """The loss module replaced inside a callable helper the trainer holds
    (``tr.loss_fn.crit = ...``), or a loss function (a partial) held by the model and replaced
    (``tr.model.crit = partial(...)``): the graph replayed the captured loss, silently (a probe:
    params 8e-3 and 1e-2 off). One level inside the objects the step reaches is compared:
    warned, captured again, as eager."""

    def run(graphed):
        tr = Trainer(device)
        if where == "helper":
            tr.loss_fn = _LossHelper(nn.MSELoss())
        else:
            tr.model.crit = functools.partial(F.mse_loss)
            tr.loss_fn = lambda out, y: tr.model.crit(out, y)
        step = tgraph.FullIterationGraph(tr.step, warmup_steps=WARMUP, backend=backend)
        losses = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for i, b in enumerate(make_batches(device, 12)):
                if i == 6 and where == "helper":
                    tr.loss_fn.crit = nn.L1Loss()
                elif i == 6:
                    tr.model.crit = functools.partial(F.l1_loss)
                losses.append((step if graphed else tr.step)(b).detach().clone())
        return torch.stack(losses), [str(w.message) for w in caught]

    want, _ = run(False)
    got, caught = run(True)
    torch.testing.assert_close(got, want, **tol(backend))
    assert len(caught) == 1 and "was replaced after capture" in caught[0], caught
    assert replays[0] == 6 + 2 * (backend == "cuda")


def test_a_record_replaced_by_another_class_is_named():
    """Entries compared by class (a record of plain values) still name a change of class."""
    from tgraph.step.reach import Reach

    tr = Trainer(torch.device("cpu"))
    tr.state = _TrainState(step=0, loss=0.0)
    reach = Reach(tr.step)
    tr.state = _TrainState(step=1, loss=1.0)
    assert reach.change() is None
    tr.state = object()
    assert reach.change().startswith("Trainer.state is now a object, a _TrainState at capture")


def test_reach_names_where_and_costs_little():
    """Where the objects were found, in the message; the check before a replay is two C-level
    passes (a few microseconds for a trainer's dozen entries)."""
    import timeit

    from tgraph.step.reach import Reach

    tr = Trainer(torch.device("cpu"))
    st = {"opt": tr.opt}
    reach = Reach(tr.step)
    assert reach.change() is None
    per_call = min(timeit.repeat(reach.change, number=1000, repeat=5)) / 1000
    assert per_call < 50e-6, per_call
    tr.loss_fn = nn.L1Loss()
    assert reach.change().startswith("Trainer.loss_fn was replaced after capture (now a L1Loss")
    del tr.loss_fn
    assert reach.change().startswith("Trainer.loss_fn was removed after capture")

    def fn(batch):
        return st["opt"]

    reach = Reach(fn)
    st["opt"] = adamw(tr.model, torch.device("cpu"))
    assert reach.change().startswith("st['opt'] was replaced after capture (now a AdamW")


def test_replaced_optimizer_is_dropped_from_the_step(backend, device, replays):
    """After a replaced optimizer's recapture the step holds only the new one: the old one is no
    longer checked, snapshotted at captures or kept alive."""
    tr = Trainer(device)
    step = tgraph.FullIterationGraph(tr.step, warmup_steps=WARMUP, backend=backend)
    with pytest.warns(tgraph.GraphFallbackWarning, match="Trainer.opt was replaced"):
        for i, b in enumerate(make_batches(device, 10)):
            if i == 5:
                tr.opt = adamw(tr.model, device)
            step(b)
    assert step.optimizers == [tr.opt]
    assert replays[0] == 4 + 2 * (backend == "cuda")  # steps 3, 4, then 8, 9 (captured at 7)
