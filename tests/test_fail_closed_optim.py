"""Fail closed in the whole-step entries: an optimizer's param groups and state tensors changed
after capture are re-captured or refused by name, and the emulated capture flag stays inside
the captured region.

``OptimizerGraph`` and ``FullIterationGraph`` against eager training of the same small MLP.
Tolerance: as tests/test_optimizer_graph.py explains, the graph replays the eager step's kernels
on the same numbers and the learning rates are powers of two (exact in float32), so results are
bitwise equal in practice; 1e-6 (tests/fail_closed_models.py) is far below the 1e-3 a group that
is never stepped, or stale state tensors, move the weights by.
"""

from __future__ import annotations

import copy
import re
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fail_closed_models import (
    LR,
    STEPS,
    TOL,
    BlindGuard,
    D,
    assert_same_params,
    batches,
    eager_run,
    fallbacks,
    full_iteration_run,
    make_adamw,
    make_mlp,
    optimizer_graph_run,
)
from torch.optim.optimizer import register_optimizer_step_post_hook

import tgraph


class Unfreeze:
    """Progressive unfreezing: the first layer joins training as a new param group at step 4."""

    at = 4

    def start(self, model, device):
        model[0].requires_grad_(False)
        return make_adamw(model[2:].parameters(), device)

    def __call__(self, i, model, opt):
        if i == self.at:
            model[0].requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": LR / 2})


class Rewind:
    """Rewind to the checkpoint of step 2 at step 4 (a loss spike): the model's and the
    optimizer's state dicts are loaded, so the optimizer's state tensors are new ones."""

    at = 4

    def start(self, model, device):
        self.saved = None
        return make_adamw(model.parameters(), device)

    def __call__(self, i, model, opt):
        if i == 2:
            self.saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        if i == self.at:
            model.load_state_dict(self.saved[0])
            opt.load_state_dict(self.saved[1])


class ResetMoments:
    """Reset Adam's first moments at step 4 by assigning new tensors into the optimizer's state
    (the same dicts, the same keys: only the tensors inside them are new)."""

    at = 4

    def start(self, model, device):
        return make_adamw(model.parameters(), device)

    def __call__(self, i, model, opt):
        if i == self.at:
            for st in opt.state.values():
                st["exp_avg"] = torch.zeros_like(st["exp_avg"])


CHANGES = {
    "add_param_group": (Unfreeze, r"add_param_group|param group"),
    "load_state_dict": (
        Rewind,
        r"load_state_dict|optimizer state|state tensor",
    ),
    "state_tensor_assigned": (ResetMoments, r"load_state_dict|optimizer state|state tensor"),
}


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
@pytest.mark.parametrize("what", list(CHANGES))
def test_optimizer_changed_after_capture(backend, device, entry, what):
    """``opt.add_param_group(...)`` or ``opt.load_state_dict(...)`` after capture: the step is
    re-captured (weights equal eager's, the new group stepped, the loaded state used) or a
    RuntimeError names the change; never a graph stepping the old groups or state."""
    cls, names = CHANGES[what]
    want = eager_run(device, cls())
    run = optimizer_graph_run if entry == "optimizer_graph" else full_iteration_run
    try:
        got = run(backend, device, cls())
    except RuntimeError as exc:
        assert re.search(names, str(exc)), exc
    else:
        assert_same_params(got, want)


# -- the emulated capture flag ----------------------------------------------------------------


def capturing_now() -> bool:
    """``torch.cuda.is_current_stream_capturing()``; False where torch is built without CUDA
    (there the call raises, unless something patched it)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


def _capturing_seen(device, on_step):
    """FullIterationGraph of a CPU model with fused AdamW; ``on_step()`` runs inside fn."""
    model = make_mlp(device)
    opt = make_adamw(model.parameters(), device)

    def train_step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        on_step()
        return loss

    step = tgraph.FullIterationGraph(train_step, warmup_steps=2, backend="emulated")
    outside = []
    for batch in batches(device, 5):
        step(batch)
        outside.append(capturing_now())
    assert step.num_graphs == 1
    return model, outside


def test_emulated_capture_flag_does_not_leak_to_other_threads():
    """While an emulated capture runs, code outside the captured region (another thread, here
    asking as a CPU optimizer or a data loader would) is not told a CUDA capture is running;
    nor is code after the call."""
    seen = []

    def from_another_thread():
        t = threading.Thread(target=lambda: seen.append(capturing_now()))
        t.start()
        t.join()

    _, outside = _capturing_seen(torch.device("cpu"), from_another_thread)
    assert seen and not any(seen), seen
    assert not any(outside), outside


def _health_check_as_torch_2_11(self):
    """torch < 2.13's ``_cuda_graph_capture_health_check`` (without its CUDA-available guard):
    an optimizer whose groups are not capturable refuses to step while
    ``torch.cuda.is_current_stream_capturing()`` says a capture runs."""
    if capturing_now() and not all(g["capturable"] for g in self.param_groups):
        raise RuntimeError(
            f"Attempting CUDA graph capture of step() for an instance of {type(self).__name__} "
            "but param_groups' capturable is False."
        )


def test_cpu_fused_adamw_steps_inside_an_emulated_capture(monkeypatch):
    """On a machine with a GPU, torch < 2.13 asks ``torch.cuda.is_current_stream_capturing()``
    at every optimizer step: the emulated capture of a CPU model's step must not make CPU fused
    AdamW (capturable False) refuse to step. Planted here with torch 2.11's check."""
    monkeypatch.setattr(
        torch.optim.Optimizer,
        "_accelerator_graph_capture_health_check",
        _health_check_as_torch_2_11,
    )
    cpu = torch.device("cpu")
    _capturing_seen(cpu, lambda: None)
    graph_model = make_mlp(cpu)
    opt = make_adamw(graph_model.parameters(), cpu)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend="emulated")
    for x, y in batches(cpu, 4):
        F.mse_loss(graph_model(x), y).backward()
        graph.step()
    assert graph.captured


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a machine with a CUDA GPU")
@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_cpu_whole_step_entries_on_a_machine_with_a_gpu(entry):
    """The CPU cases run on the GPU machine: a CPU model with fused AdamW under the emulated
    backend trains as eager, although CUDA is available."""
    cpu = torch.device("cpu")

    class Nothing:
        at = STEPS + 1

        def start(self, model, device):
            return make_adamw(model.parameters(), device)

        def __call__(self, i, model, opt):
            pass

    want = eager_run(cpu, Nothing())
    run = optimizer_graph_run if entry == "optimizer_graph" else full_iteration_run
    assert_same_params(run("emulated", cpu, Nothing()), want)


def _repoint_params(i, model, opt):
    if i == 6:
        for p in model.parameters():
            p.data = p.data.clone()


def _scale_attribute(i, model, opt):
    if i == 6:
        model[0].out_features_scale = 0.5


@pytest.mark.parametrize("change", [_repoint_params, _scale_attribute], ids=["p_data", "attribute"])
def test_full_iteration_follows_what_its_modules_baked_in(backend, device, change):
    """Whole-step graphs keep the parameters' memory and the modules' attributes too: after
    ``p.data = ...`` or an attribute change the step is captured again (eager meanwhile, with
    a warning naming it), and training equals eager."""

    class Scaled(nn.Linear):
        out_features_scale = 1.0

        def forward(self, x):
            return super().forward(x) * self.out_features_scale

    def make():
        torch.manual_seed(0)
        return nn.Sequential(Scaled(D, D), nn.Tanh(), nn.Linear(D, 1)).to(device)

    def run(graphed):
        model = make()
        extra = {"capturable": True} if device.type == "cuda" else {"fused": True}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, **extra)

        def step(batch):
            x, y = batch
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        fn = tgraph.FullIterationGraph(step, warmup_steps=2, backend=backend) if graphed else step
        losses = []
        for i, b in enumerate(batches(device, 10)):
            change(i, model, opt)
            losses.append(fn(b))
        return torch.stack(losses), model

    want, ref = run(False)
    with fallbacks() as msgs:
        got, model = run(True)
    torch.testing.assert_close(got, want, **TOL)
    assert_same_params(model, ref)
    assert msgs and all("FullIterationGraph" in m for m in msgs), msgs
    names = "out_features_scale" if change is _scale_attribute else r"weight|bias"
    assert all(re.search(names, m) for m in msgs), msgs


@pytest.mark.parametrize("bug", [None, "blind_guard", "in_place_copy"])
def test_a_gradient_relaid_in_the_buffer_the_graph_reads_is_copied_in_its_new_layout(
    device, monkeypatch, bug
):
    """OptimizerGraph's gradient buffers (GradBuffers.refresh): addresses by a C++ pass, strides
    by a C++ guard once found as baked (tgraph.layout). A gradient that is the buffer the graph
    reads, transposed in its own memory (``p.grad = p.grad.t()``: same address, other strides),
    must reach the graph in its new layout (before: torch refused the overlapping copy, so the
    step raised). Planted: a guard that sees no change (the graph reads the old layout,
    silently), and the copy in place without the clone (refused by torch)."""
    from tgraph import layout
    from tgraph.step.grad_buffers import GradBuffers

    if bug == "blind_guard":
        monkeypatch.setattr(layout, "_TensorGuards", BlindGuard)
    if bug == "in_place_copy":
        monkeypatch.setattr(torch.Tensor, "clone", lambda t, *a, **k: t)
    p = nn.Parameter(torch.zeros(D, D, device=device))
    buf = torch.arange(D * D, dtype=torch.float32, device=device).reshape(D, D)
    p.grad = buf
    grads = GradBuffers()
    grads.freeze([(p, buf)], [])
    assert grads.refresh() is False  # in place: nothing to copy; the guard is built now
    want = buf.t().clone()
    p.grad = buf.t()
    if bug == "in_place_copy":
        with pytest.raises(RuntimeError, match="single memory location"):
            grads.refresh()
        return
    grads.refresh()
    if bug is None:
        assert torch.equal(buf, want)
    else:
        assert not torch.equal(buf, want)


# -- optimizer step hooks -------------------------------------------------------------------------


class EMAAndCounter:
    """A step post-hook: an EMA of the weights (tensor work) and a count of its calls (Python),
    with the arguments torch handed it."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())
        self.ema = [p.detach().clone() for p in self.params]
        self.calls: list[tuple] = []

    def __call__(self, opt, args, kwargs) -> None:
        self.calls.append((opt, args, kwargs))
        with torch.no_grad():
            for e, p in zip(self.ema, self.params):
                e.mul_(0.9).add_(p, alpha=0.1)


def _hooked_run(backend, device, entry, where):
    """STEPS AdamW steps with an :class:`EMAAndCounter` post-hook (eager when ``backend`` is
    None); returns the model and the hook."""
    model = make_mlp(device)
    opt = make_adamw(model.parameters(), device)
    hook = EMAAndCounter(model)
    if where == "optimizer":
        handle = opt.register_step_post_hook(hook)
    else:
        handle = register_optimizer_step_post_hook(hook)
    try:
        graph = None
        if backend is not None and entry == "optimizer_graph":
            graph = tgraph.OptimizerGraph(opt, backend=backend)

        def train_step(batch):
            x, y = batch
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if graph is None:
                opt.step()
            else:
                graph.step()
            return loss

        if backend is not None and entry == "full_iteration":
            train_step = tgraph.FullIterationGraph(train_step, warmup_steps=2, backend=backend)
        for batch in batches(device, STEPS):
            train_step(batch)
    finally:
        handle.remove()  # a global hook must not outlive the test
    return model, opt, hook


@pytest.mark.parametrize("where", ["optimizer", "global"])
@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_step_post_hooks_run_after_every_replay(backend, device, entry, where, replays):
    """``register_step_post_hook`` (or the global ``register_optimizer_step_post_hook``) with an
    EMA and a counter: a replay runs no Python, so tgraph runs the hooks after each replay,
    with the captured step's arguments, and captures the step with them detached (their tensor
    work is not in the graph, nor done twice). Counts equal eager's over 7 steps, the EMA and
    the weights bit for bit."""
    model, opt, hook = _hooked_run(backend, device, entry, where)
    ref, ref_opt, ref_hook = _hooked_run(None, device, entry, where)
    assert replays[0] >= 4  # the hooks ran around replays, not around eager steps only
    assert len(hook.calls) == len(ref_hook.calls) == STEPS
    assert all(a == (opt,) and k == {} and o is opt for o, a, k in hook.calls)
    exact = dict(rtol=0, atol=0) if backend == "emulated" else TOL
    torch.testing.assert_close(hook.ema, ref_hook.ema, **exact)
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), **exact)


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_step_pre_hook_is_refused_at_capture_by_name(backend, device, entry):
    """A pre-hook runs after the backward, right before the step, a point a replay of the whole
    step does not have: the capture refuses it, naming it, and the eager steps before it ran
    the hook as eager code does."""
    model = make_mlp(device)
    opt = make_adamw(model.parameters(), device)
    seen = []

    def count_steps(optimizer, args, kwargs):
        seen.append(optimizer)

    opt.register_step_pre_hook(count_steps)
    graph = tgraph.OptimizerGraph(opt, backend=backend) if entry == "optimizer_graph" else None

    def train_step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step() if graph is None else graph.step()

    step = train_step if graph else tgraph.FullIterationGraph(train_step, 2, backend=backend)
    match = r"AdamW has a step pre-hook \(.*count_steps\).*register_step_post_hook"
    data = batches(device, 3)
    warmups = 1 if graph else 2
    for batch in data[:warmups]:
        step(batch)
    with pytest.raises(ValueError, match=match):
        step(data[warmups])
    assert len(seen) == warmups
