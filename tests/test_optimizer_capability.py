"""Whole-step graphs accept optimizers by what they are: what torch captures safely (fused, or
capturable, or without host state) steps in the graph, bitwise as eager; an optimizer that
keeps state on the host (a CPU step count) is refused before the capture, on both backends,
with one line naming the optimizer, the host state and the fix (tgraph/step/host_state.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tgraph
from tgraph.guards import CaptureError
from tgraph.step import capture as step_capture
from tgraph.step.reach import Reach

D = 8
STEPS = 7
LR = 2.0**-6  # StepLR halves it: every value exact in float32, so the graphs are bitwise


def make_model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, 1)).to(device)


def make_batches(device: torch.device, n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(4, D, generator=g).to(device), torch.randn(4, 1, generator=g).to(device))
        for _ in range(n)
    ]


def run(entry: str, backend: str, device: torch.device, make_opt, *, schedule: bool = False):
    """Train STEPS steps through ``entry`` ("eager", "optimizer_graph", "full_iteration");
    returns the model, the optimizer and the whole-step object (None for eager)."""
    model = make_model(device)
    opt = make_opt(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    graph = None
    if entry == "optimizer_graph":
        graph = tgraph.OptimizerGraph(opt, skip_nonfinite=False, backend=backend)

    def train_step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    if entry == "full_iteration":
        graph = tgraph.FullIterationGraph(train_step, warmup_steps=2, backend=backend)
    for x, y in make_batches(device):
        if entry == "optimizer_graph":
            F.mse_loss(model(x), y).backward()
            graph.step()
        elif entry == "full_iteration":
            graph((x, y))
        else:
            train_step((x, y))
        if sched is not None:
            sched.step()
    return model, opt, graph


def assert_same(model, opt, ref_model, ref_opt) -> None:
    """Parameters and optimizer state (the step count included), bit for bit."""
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        for k, v in ref_opt.state[q].items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=0, atol=0, msg=f"state {k!r}")


# -- refused: state on the host ------------------------------------------------------------------

HOST_STEPPING = {
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=LR),
    "Adagrad_foreach": lambda ps: torch.optim.Adagrad(ps, lr=LR, foreach=True),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=LR),
    "RMSprop": lambda ps: torch.optim.RMSprop(ps, lr=LR),
    "Adam": lambda ps: torch.optim.Adam(ps, lr=LR),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=LR),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=LR),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=LR),
}
if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5: no capturable option, and its step reads
    HOST_STEPPING["Adafactor"] = lambda ps: torch.optim.Adafactor(
        ps, lr=LR
    )  # the count on the host


def expected_fix(name: str, device: torch.device) -> str:
    if name == "Adafactor":
        return f"torch has no capturable Adafactor on {device.type}"
    if name in ("Adam", "AdamW"):
        return "fused=True" + (r"\) or .*capturable=True" if device.type == "cuda" else "")
    if name == "Adagrad":
        return "fused=True" if device.type == "cpu" else "torch has no capturable Adagrad on cuda"
    if device.type == "cuda":
        return "capturable=True"
    return f"torch has no capturable {name} on cpu"


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
@pytest.mark.parametrize("kind", list(HOST_STEPPING))
def test_host_stepping_optimizer_is_refused_by_name(backend, device, kind, entry):
    """Refused before any capture, on both backends alike (the emulated backend has no host
    apart from its device, and is told by what the optimizer is): the message names the
    optimizer, its CPU step count and the fix; the refused call takes no step."""
    name = kind.split("_")[0]
    # before any step ("its step count ... state['step'] ... CPU tensor") or after warmup
    # steps made the state ("state['step'] on the CPU (a CPU tensor beside parameters ...)")
    host = r"keeps (its step count|state\['step'\]) on the CPU \(.*CPU tensors?.*\)"
    match = rf"^{name} param_group 0 .*{host}: .*{expected_fix(name, device)}"
    assert_refused(entry, backend, device, HOST_STEPPING[kind], match)


def assert_refused(entry: str, backend: str, device: torch.device, make_opt, match: str) -> None:
    """Train through ``entry`` until a call raises ``ValueError`` matching ``match``: one line,
    and that call took no step."""
    model = make_model(device)
    opt = make_opt(model.parameters())

    def train_step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    if entry == "optimizer_graph":
        graph = tgraph.OptimizerGraph(opt, skip_nonfinite=False, backend=backend)
    else:
        graph = tgraph.FullIterationGraph(train_step, warmup_steps=2, backend=backend)
    batches = iter(make_batches(device))
    with pytest.raises(ValueError, match=match) as refused:
        for x, y in batches:
            before = [p.detach().clone() for p in model.parameters()]
            if entry == "optimizer_graph":
                F.mse_loss(model(x), y).backward()
                graph.step()
            else:
                graph((x, y))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert "\n" not in str(refused.value)  # one line


class PythonStepSGD(torch.optim.Optimizer):
    """A custom optimizer that counts its steps in a Python int and decays the step with it:
    a graph would keep the count (and the step size) of the capture."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["step"] = st.get("step", 0) + 1
                p.add_(p.grad, alpha=-g["lr"] / st["step"])


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_python_number_in_optimizer_state_written_at_capture_is_refused(backend, device, entry):
    """A Python step count written inside the captured step is refused at the capture, naming
    it (a replay runs no Python: it would step with the capture's count forever)."""
    match = r"PythonStepSGD param_group 0 parameter 0: state\['step'\] \(a Python int\) was written"
    with pytest.raises(CaptureError, match=match):
        run(entry, backend, device, lambda ps: PythonStepSGD(ps, lr=LR))


class DeclaredNotCapturable(PythonStepSGD):
    """A custom optimizer following torch's convention: ``capturable=False`` and a 0-dim
    CPU step count (torch.tensor(0.0), on the CPU whatever the parameters' device)."""

    def __init__(self, params, lr: float) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "capturable": False})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    st = self.state[p]
                    st.setdefault("step", torch.tensor(0.0))
                    st["step"] += 1
                    p.add_(p.grad / st["step"].to(p.device), alpha=-g["lr"])


def test_custom_optimizer_declaring_capturable_false_is_refused(backend, device):
    with pytest.raises(ValueError, match=r"DeclaredNotCapturable param_group 0 \(capturable="):
        run("full_iteration", backend, device, lambda ps: DeclaredNotCapturable(ps, lr=LR))


class CpuStepOnDevice(DeclaredNotCapturable):
    """No flags at all: only the device of its step count shows it lives on the host."""

    def __init__(self, params, lr: float) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr})


@pytest.mark.cuda
def test_cpu_state_tensor_beside_cuda_parameters_is_refused():
    with pytest.raises(ValueError, match=r"CpuStepOnDevice param_group 0 keeps state\['step'\] on"):
        run("optimizer_graph", "cuda", torch.device("cuda"), lambda ps: CpuStepOnDevice(ps, LR))


class CpuCounterAttribute(PythonStepSGD):
    """A CPU tensor attribute advanced inside the step (not in ``state``)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr)
        self.calls = torch.zeros(())

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"])


@pytest.mark.cuda
def test_cpu_tensor_written_inside_a_cuda_capture_is_refused():
    with pytest.raises(CaptureError, match=r"CpuCounterAttribute\.calls \(a CPU tensor\) was"):
        run("full_iteration", "cuda", torch.device("cuda"), lambda ps: CpuCounterAttribute(ps, LR))


# -- accepted: what torch captures safely --------------------------------------------------------

CAPTURE_SAFE = {
    "SGD_momentum": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9),  # no host state
    "SGD_fused": lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, fused=True),
    "Adam_fused": lambda ps: torch.optim.Adam(ps, lr=LR, fused=True),
    "AdamW_fused": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1, fused=True),
    "Adagrad_fused": lambda ps: torch.optim.Adagrad(ps, lr=LR, fused=True),  # CPU only in torch
}


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
@pytest.mark.parametrize("kind", list(CAPTURE_SAFE))
def test_capture_safe_optimizer_replays_bitwise_as_eager(backend, device, kind, entry, replays):
    """Fused optimizers (capturable=False: fused keeps its step count on the device) and SGD
    without host state are captured; the learning rate schedule reaches the fused graphs (a
    plain SGD bakes its float lr, so it runs without a schedule); parameters and state equal
    eager bit for bit, and the steps after the capture were replays."""
    if kind == "Adagrad_fused" and device.type != "cpu":
        pytest.skip("torch's fused Adagrad runs on the CPU only")
    schedule = "fused" in kind
    model, opt, graph = run(entry, backend, device, CAPTURE_SAFE[kind], schedule=schedule)
    ref_model, ref_opt, _ = run("eager", backend, device, CAPTURE_SAFE[kind], schedule=schedule)
    assert_same(model, opt, ref_model, ref_opt)
    eager = 1 if entry == "optimizer_graph" else 2  # warmup steps
    captured_here = 0 if backend == "cuda" else 1  # the emulated capture executed that step
    assert replays[0] == STEPS - eager - captured_here
    assert all(g.get("capturable") in (None, False) for g in opt.param_groups)  # as built


def _health_check_during_stream_capture(monkeypatch) -> None:
    """torch's capture health check as on CUDA, where a stream capture runs: a param_group
    that does not say capturable=True refuses to step. The CPU has no stream capture, so
    "capturing" here means inside tgraph's whole-step capture."""
    inside = [False]
    original = step_capture.StepCapture.capture

    def capture(self, *args, **kwargs):
        inside[0] = True
        try:
            return original(self, *args, **kwargs)
        finally:
            inside[0] = False

    def health_check(self):
        if inside[0] and not all(g["capturable"] for g in self.param_groups):
            raise RuntimeError(
                f"Attempting CUDA graph capture of step() for an instance of {type(self).__name__}"
                " but param_groups' capturable is False."
            )

    monkeypatch.setattr(step_capture.StepCapture, "capture", capture)
    monkeypatch.setattr(
        torch.optim.Optimizer, "_accelerator_graph_capture_health_check", health_check
    )


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_fused_adamw_passes_torchs_capture_health_check(backend, device, entry, monkeypatch):
    """torch refuses to capture a step whose groups are not capturable, fused ones included;
    fused groups say capturable=True for the capture only (the fused kernels ignore the flag)."""
    _health_check_during_stream_capture(monkeypatch)
    make = CAPTURE_SAFE["AdamW_fused"]
    model, opt, graph = run(entry, backend, device, make, schedule=True)
    ref_model, ref_opt, _ = run("eager", backend, device, make, schedule=True)
    assert_same(model, opt, ref_model, ref_opt)
    assert opt.param_groups[0]["capturable"] is False


def test_fused_adamw_beside_per_layer_graphs(backend, device, replays):
    """The hand-off: per-layer graphs leave the gradients, the fused AdamW step graph reads
    them; a changing learning rate reaches it; equal to eager bit for bit."""

    class Block(tgraph.GraphableModule):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block(), nn.Linear(D, 1)).to(device)
        opt = CAPTURE_SAFE["AdamW_fused"](model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return model, opt, sched

    def train(graphed: bool):
        model, opt, sched = make()
        graph = tgraph.OptimizerGraph(opt, skip_nonfinite=False, backend=backend)
        if graphed:
            tgraph.enable(model, backend=backend, strict=True)
        try:
            for i, (x, y) in enumerate(make_batches(device)):
                F.mse_loss(model(x), y).backward()
                if graphed:
                    graph.step()
                else:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                sched.step()
                if graphed and i == 0:
                    tgraph.create_graphs()
        finally:
            tgraph.reset()
            tgraph.disable(model)
        return model, opt

    model, opt = train(True)
    assert replays[0] > 2 * (STEPS - 1)  # the layers' forwards and backwards, and the steps
    ref_model, ref_opt = train(False)
    assert_same(model, opt, ref_model, ref_opt)


# -- a learning rate held as a Python float by a custom optimizer -------------------------------


class AttributeLrSGD(torch.optim.Optimizer):
    """A custom optimizer that reads its learning rate from ``self.lr``, not param_groups."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {})
        self.lr = lr

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_python_float_lr_of_a_custom_optimizer_reaches_the_step(backend, device, entry, replays):
    """``opt.lr = ...`` after capture (a hand-written schedule): the graph kept the old value,
    so the step is captured again (named in a warning) and training equals eager; it replays
    again afterwards."""

    def make(ps):
        return AttributeLrSGD(ps, lr=LR)

    def train(entry):
        model = make_model(device)
        opt = make(model.parameters())
        graph = None
        if entry == "optimizer_graph":
            graph = tgraph.OptimizerGraph(opt, skip_nonfinite=False, backend=backend)

        def train_step(batch):
            x, y = batch
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            opt.step()

        if entry == "full_iteration":
            graph = tgraph.FullIterationGraph(train_step, warmup_steps=1, backend=backend)
        for i, (x, y) in enumerate(make_batches(device, 12)):
            if i == 4:
                opt.lr = LR / 4
            if entry == "optimizer_graph":
                F.mse_loss(model(x), y).backward()
                graph.step()
            elif entry == "full_iteration":
                graph((x, y))
            else:
                train_step((x, y))
        return model

    with (
        pytest.warns(UserWarning, match=r"AttributeLrSGD\.lr changed from")
        if (entry == "full_iteration")
        else contextlib.nullcontext()
    ):
        model = train(entry)
    before = replays[0]
    ref = train("eager")
    assert replays[0] == before
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert replays[0] >= 12 - 4 - 2  # replayed after the second capture too


class PythonCounter(AttributeLrSGD):
    @torch.no_grad()
    def step(self, closure=None):
        self.steps = getattr(self, "steps", 0) + 1
        super().step()


def test_python_number_attribute_written_at_capture_is_refused(backend, device):
    with pytest.raises(CaptureError, match=r"PythonCounter\.steps \(a Python int\) was written"):
        run("optimizer_graph", backend, device, lambda ps: PythonCounter(ps, lr=LR))


def test_megatron_graph_safe_keeps_a_fused_inner_optimizer_as_it_is(device):
    """megatron's inner torch optimizer built fused is graphed as it is: make_graph_safe does
    not turn it capturable (torch would then warn at every eager step that it is not captured)."""
    from types import SimpleNamespace

    from tgraph.integrations.megatron_optimizer import make_graph_safe

    model = make_model(device)
    inner = CAPTURE_SAFE["AdamW_fused"](model.parameters())
    cfg = SimpleNamespace(log_num_zeros_in_grad=False, grad_norm_skip_threshold=float("inf"))
    sub = SimpleNamespace(optimizer=inner, config=cfg, grad_scaler=None)
    assert make_graph_safe(sub) == [inner]
    assert inner.param_groups[0]["capturable"] is False


class CountsOnTheHost(nn.Module):
    """A CUDA model that counts its calls in a CPU buffer (a CUDA capture runs the CPU op once,
    at capture, and a replay never)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.fc(x)


@pytest.mark.cuda
def test_cpu_buffer_written_inside_a_cuda_capture_is_refused():
    model = CountsOnTheHost()
    model.fc.cuda()  # the buffer stays on the CPU
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def train_step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    graph = tgraph.FullIterationGraph(train_step, warmup_steps=1, backend="cuda")
    with pytest.raises(CaptureError, match=r"CountsOnTheHost\.calls \(a CPU tensor\) was written"):
        for batch in make_batches(torch.device("cuda"), 3):
            graph(batch)


def test_host_writes_names_a_cpu_tensor_written_beside_a_cuda_graph():
    """The check behind the CUDA tests above, on the CPU: for a graph on a CUDA device, a CPU
    buffer of a module and a CPU tensor attribute of an optimizer written between the two
    looks are named; for a CPU graph (every tensor is a CPU tensor) neither is held."""
    from tgraph.step.host_state import HostWrites

    model = CountsOnTheHost()
    opt = CpuCounterAttribute(model.parameters(), LR)
    for device, refused in (("cpu", False), ("cuda", True)):
        writes = HostWrites([opt], torch.device(device), [model])
        model(torch.randn(2, D))
        if refused:
            with pytest.raises(CaptureError, match=r"^CountsOnTheHost\.calls \(a CPU tensor\)"):
                writes.check()
        else:
            writes.check()
    writes = HostWrites([opt], torch.device("cuda"), [])
    F.mse_loss(model(torch.randn(2, D)), torch.zeros(2, 1)).backward()
    opt.step()
    with pytest.raises(CaptureError, match=r"^CpuCounterAttribute\.calls \(a CPU tensor\) was"):
        writes.check()


def test_fused_adamw_with_grad_scaler_inside_full_iteration(backend, device, replays):
    """torch's own capture test of the fused optimizers drives them with GradScaler: the scale
    grows and, on a batch whose gradients are not finite, the fused step is skipped and the
    scale backs off, all on the device; equal to eager bit for bit."""

    def run(graphed: bool):
        model = make_model(device)
        opt = CAPTURE_SAFE["AdamW_fused"](model.parameters())
        scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

        def train_step(batch):
            x, y = batch
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

        step = tgraph.FullIterationGraph(train_step, 2, backend) if graphed else train_step
        for i, (x, y) in enumerate(make_batches(device, 9)):
            if i == 6:
                x = x.clone()
                x[0, 0] = float("inf")  # this step's gradients are not finite: skipped
            step((x, y))
            sched.step()
        return model, opt, scaler

    model, opt, scaler = run(True)
    assert replays[0] == 9 - 2 - (0 if backend == "cuda" else 1)
    ref_model, ref_opt, ref_scaler = run(False)
    # 2**10 grown at steps 1, 3, 5, halved at 6, grown at 8 (16384 had no step been skipped)
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**13
    assert_same(model, opt, ref_model, ref_opt)


class GroupStepSGD(AttributeLrSGD):
    """Counts its steps in a Python int in the param_group (as apex's FusedAdam does without
    capturable) and decays the step with it."""

    def __init__(self, params, lr: float) -> None:
        torch.optim.Optimizer.__init__(self, params, {"lr": lr, "step": 0})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            g["step"] += 1
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] / g["step"])


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_python_step_count_in_a_param_group_is_refused_at_capture(backend, device, entry):
    match = r"GroupStepSGD param_group 0: 'step' \(a Python int\) was written inside the captured"
    with pytest.raises(CaptureError, match=match):
        run(entry, backend, device, lambda ps: GroupStepSGD(ps, lr=LR))


# -- refused: a tensor learning rate read on the host ------------------------------------------

TENSOR_LR_SGD = {
    "foreach": dict(foreach=True),
    "for_loop": dict(foreach=False),
    "momentum": dict(momentum=0.9),
}


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
@pytest.mark.parametrize("kind", list(TENSOR_LR_SGD))
def test_tensor_lr_of_a_plain_sgd_is_refused_by_name(backend, device, kind, entry):
    """torch's SGD without fused=True passes its lr to the kernels as a Python scalar: a tensor
    lr is read with .item() at every step, which no graph can contain. Refused before the
    capture in one line naming the tensor lr and the fix, not as a host sync inside the
    capture; the refused call takes no step."""

    def make(ps):
        return torch.optim.SGD(ps, lr=torch.tensor(LR, device=device), **TENSOR_LR_SGD[kind])

    match = r"^SGD param_group 0 \(fused=False\) holds a tensor lr, .*\(\.item\(\)\).*fused=True"
    assert_refused(entry, backend, device, make, match)


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_tensor_lr_of_a_fused_sgd_replays_bitwise_as_eager(backend, device, entry, replays):
    """The fix the refusal names: fused=True reads the tensor lr on the device; the schedule
    reaches the graph and training is eager's bit for bit, with replays."""

    def make(ps):
        return torch.optim.SGD(ps, lr=torch.tensor(LR, device=device), momentum=0.9, fused=True)

    model, opt, _ = run(entry, backend, device, make, schedule=True)
    ref_model, ref_opt, _ = run("eager", backend, device, make, schedule=True)
    assert_same(model, opt, ref_model, ref_opt)
    eager = 1 if entry == "optimizer_graph" else 2  # warmup steps
    assert replays[0] == STEPS - eager - (0 if backend == "cuda" else 1)


# -- a checkpoint that changes the optimizer's flags -------------------------------------------


def _foreach_adam_checkpoint(device: torch.device) -> tuple[dict, dict]:
    """The model and optimizer state dicts of an eager foreach Adam after 3 steps."""
    model = make_model(device)
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=True)
    for x, y in make_batches(device, 3):
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.state_dict(), opt.state_dict()


def _resume_from(entry, backend, device, flags: dict, replays):
    """A fused Adam trained through ``entry``; before step 3 (after the capture) the foreach
    checkpoint is loaded, its param_groups' flags updated with ``flags`` first. Returns the
    model, the optimizer and the replays after the load."""
    model_sd, opt_sd = _foreach_adam_checkpoint(device)
    for g in opt_sd["param_groups"]:
        g.update(flags)
    model = make_model(device)
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)

    def train_step(batch):
        x, y = batch
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    graph = None
    if entry == "optimizer_graph":
        graph = tgraph.OptimizerGraph(opt, backend=backend)
    elif entry == "full_iteration":
        graph = tgraph.FullIterationGraph(train_step, warmup_steps=2, backend=backend)
    at_load = 0
    for i, (x, y) in enumerate(make_batches(device)):
        if i == 3:
            if entry == "optimizer_graph":
                assert graph.captured
            elif entry == "full_iteration":
                assert graph.num_graphs == 1
            model.load_state_dict(model_sd)
            opt.load_state_dict(opt_sd)
            at_load = replays[0]
        if entry == "optimizer_graph":
            F.mse_loss(model(x), y).backward()
            graph.step()
        elif entry == "full_iteration":
            with pytest.warns(tgraph.GraphFallbackWarning) if i == 3 else contextlib.nullcontext():
                graph((x, y))
        else:
            train_step((x, y))
    return model, opt, replays[0] - at_load


@pytest.mark.parametrize("entry", ["optimizer_graph", "full_iteration"])
def test_checkpoint_of_a_foreach_adam_loaded_into_a_fused_one_is_refused_naming_the_flags(
    backend, device, entry, replays
):
    """torch's load_state_dict replaces each param_group's flags with those of the optimizer
    that saved it: a foreach Adam's checkpoint makes the fused Adam a host-stepping one after
    capture. Refused in one line that says so and how to load it, not "construct it with
    fused=True", which the user did. The fix it names (the flag set in the state dict before
    loading) trains as eager, bit for bit, and replays after the load."""
    match = (
        r"^Adam param_group 0 .*keeps .* on the CPU .*Adam was constructed with fused=True, but "
        r"a loaded state dict \(optimizer\.load_state_dict\) replaced the group's flags .*"
        r"g\['fused'\] = True"
    )
    with pytest.raises(ValueError, match=match) as refused:
        _resume_from(entry, backend, device, {}, replays)
    assert "\n" not in str(refused.value)

    fixed = {"fused": True}
    model, opt, after_load = _resume_from(entry, backend, device, fixed, replays)
    ref_model, ref_opt, _ = _resume_from("eager", backend, device, fixed, replays)
    assert_same(model, opt, ref_model, ref_opt)
    # steps 3.. warm up, capture and replay again (the capture is a replay on CUDA)
    warmup = 1 if entry == "optimizer_graph" else 2
    assert after_load == STEPS - 3 - warmup - (0 if backend == "cuda" else 1)


# -- GradScaler: the host numbers of scaler.update() ---------------------------------------------

SCALER_CHANGES = {
    "set_growth_factor": ("growth_factor", lambda s: s.set_growth_factor(4.0)),
    "set_backoff_factor": ("backoff_factor", lambda s: s.set_backoff_factor(0.25)),
    "set_growth_interval": ("growth_interval", lambda s: s.set_growth_interval(1)),
    "load_state_dict": (
        "growth_factor",
        lambda s: s.load_state_dict({**s.state_dict(), "growth_factor": 8.0, "scale": 2.0**4}),
    ),
}


class ScaledTrainer:
    """A trainer that keeps its GradScaler as an attribute; its bound ``step`` is the
    training step (the scaler is neither a closure variable nor a global of it)."""

    def __init__(self, device: torch.device) -> None:
        self.model = make_model(device)
        self.opt = CAPTURE_SAFE["AdamW_fused"](self.model.parameters())
        self.scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10, growth_interval=2)

    def step(self, batch):
        x, y = batch
        self.opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(self.model(x), y)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        return loss


def _train_scaled(backend, device, change, graphed: bool) -> tuple[ScaledTrainer, list[float]]:
    """10 steps; ``change(scaler)`` before step 5 (after the capture at step 2); step 7's
    gradients are not finite (skipped, the scale backs off). Returns the trainer and the scale
    after every step."""
    trainer = ScaledTrainer(device)
    step = tgraph.FullIterationGraph(trainer.step, 2, backend) if graphed else trainer.step
    scales = []
    for i, (x, y) in enumerate(make_batches(device, 10)):
        if i == 5:
            change(trainer.scaler)
        if i == 7:
            x = x.clone()
            x[0, 0] = float("inf")
        step((x, y))
        scales.append(trainer.scaler.get_scale())
    return trainer, scales


@pytest.mark.parametrize("change", list(SCALER_CHANGES))
def test_grad_scaler_settings_changed_after_capture_are_captured_again(
    backend, device, change, replays
):
    """scaler.update() passes its growth factor, backoff factor and growth interval to the
    device kernel as host numbers, which the graph keeps. Changed after the capture (a setter,
    or load_state_dict), the next call warns naming it, runs eagerly and the step is captured
    again with the new numbers: the scale (which decides which fp16 steps are skipped), the
    parameters and the state are eager's bit for bit."""
    name, fn = SCALER_CHANGES[change]
    with pytest.warns(tgraph.GraphFallbackWarning, match=rf"GradScaler\.{name} changed from"):
        trainer, scales = _train_scaled(backend, device, fn, graphed=True)
    ref, ref_scales = _train_scaled(backend, device, fn, graphed=False)
    assert scales == ref_scales
    assert_same(trainer.model, trainer.opt, ref.model, ref.opt)
    # replays: steps 3, 4, then 5 and 6 eager, 7 captured, 8 and 9 replayed (+ the captures on CUDA)
    assert replays[0] == 4 + 2 * (backend == "cuda")


def test_planted_grad_scaler_not_found_is_caught(backend, device, monkeypatch):
    """The scaler found on the stack of its step is what makes a replay check its numbers:
    without it, the graph keeps growing the scale by the captured factor."""
    from tgraph.step import watch

    monkeypatch.setattr(watch, "driving_scaler", lambda frames=6: None)
    _, scales = _train_scaled(backend, device, SCALER_CHANGES["set_growth_factor"][1], True)
    _, ref_scales = _train_scaled(backend, device, SCALER_CHANGES["set_growth_factor"][1], False)
    assert scales != ref_scales


def _train_with_a_new_scaler(backend, device, graphed: bool):
    """As :func:`_train_scaled`, but before step 5 the trainer gets a new GradScaler (another
    initial scale and growth interval), which the step reaches through ``self.scaler``."""
    trainer = ScaledTrainer(device)
    step = tgraph.FullIterationGraph(trainer.step, 2, backend) if graphed else trainer.step
    scales = []
    for i, batch in enumerate(make_batches(device, 10)):
        if i == 5:
            trainer.scaler = torch.amp.GradScaler(device.type, init_scale=2.0**4, growth_interval=1)
        step(batch)
        scales.append(trainer.scaler.get_scale())
    return trainer, scales


@pytest.mark.parametrize("planted", [False, True], ids=["counted", "planted_uncounted"])
def test_a_grad_scaler_made_after_capture_is_captured_again(
    backend, device, planted, replays, monkeypatch
):
    """A new GradScaler that the step reaches after the capture (``self.scaler = GradScaler()``)
    was never used: the graph kept scaling and updating the captured scaler's tensors (the new
    one's scale stayed 16 where eager's grew to 512). A scaler made after capture is a change:
    the next call warns, runs eagerly and captures again, and the scales, parameters and state
    are eager's bit for bit. Planted (constructions not counted): the scales differ."""
    if planted:
        init = torch.amp.GradScaler.__init__
        init = getattr(init, "__wrapped__", init)

        def uncounted(self, *args, **kwargs):
            init(self, *args, **kwargs)

        uncounted._tgraph_counts = True
        monkeypatch.setattr(torch.amp.GradScaler, "__init__", uncounted)
        # the trainer's attribute replaced is seen by the reach too (tgraph.step.reach): off,
        # so that this checks the count alone (a scaler reached where the reach does not look)
        monkeypatch.setattr(Reach, "change", lambda self: None)
        _, scales = _train_with_a_new_scaler(backend, device, graphed=True)
        _, ref_scales = _train_with_a_new_scaler(backend, device, graphed=False)
        assert scales != ref_scales
        return
    with pytest.warns(tgraph.GraphFallbackWarning, match="GradScaler was created after capture"):
        trainer, scales = _train_with_a_new_scaler(backend, device, graphed=True)
    ref, ref_scales = _train_with_a_new_scaler(backend, device, graphed=False)
    assert scales == ref_scales
    assert_same(trainer.model, trainer.opt, ref.model, ref.opt)
    # replays: steps 3, 4, then 5 and 6 eager, 7 captured, 8 and 9 replayed (+ the captures on CUDA)
    assert replays[0] == 4 + 2 * (backend == "cuda")
