"""OptimizerGraph and non-finite skipping (also inside FullIterationGraph), against eager runs.

Bitwise tests: the graph replays the very kernels of the eager step on the same numbers, and the
learning rate 2**-8 is exact in float32 (the graph reads it from a float32 tensor, eager code
from a Python double), so parameters and optimizer state must be *equal*, not close. A skipped
step must leave them bitwise as an eager run that never took it. Schedules change the learning
rate to values that float32 rounds: those tests compare with ``rtol=1e-4, atol=1e-5`` (as
tests/test_full_iteration.py), far below what a frozen learning rate moves.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
from optimizer_models import (
    LR,
    STEPS,
    TOL,
    assert_same_training_state,
    make_batches,
    make_model,
    make_optimizer,
    plant,
    train_eager,
    train_graphed,
)

import tgraph
from tgraph.guards import RefuseHostSync
from tgraph.step import hyperparams, nonfinite


@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
@pytest.mark.parametrize("clip", [None, 0.05])
def test_bitwise_equal_to_eager(backend, device, clip, opt_kind):
    """0.05 is below the gradient norms here: clipping is active at every step."""
    model, opt, graph = train_graphed(backend, device, clip=clip, opt_kind=opt_kind)
    ref_model, ref_opt = train_eager(device, clip=clip, opt_kind=opt_kind)
    assert_same_training_state(model, opt, ref_model, ref_opt)
    assert graph.skipped_steps == 0
    assert graph.guard.last_way == expected_way(device, opt_kind)


def test_grad_norm_is_the_eager_clip_grad_norm(backend, device):
    model = make_model(device)
    graph = tgraph.OptimizerGraph(
        make_optimizer(model, device), clip_grad_norm=0.05, skip_nonfinite=True, backend=backend
    )
    ref = make_model(device)
    ref_opt = make_optimizer(ref, device)
    for x, y in make_batches(device):
        model(x, y)[1].backward()
        graph.step()
        ref(x, y)[1].backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
        assert torch.equal(graph.grad_norm, norm)


def expected_way(device: torch.device, opt_kind: str = "adamw") -> str:
    """How the captured step skips (``SkipNonfinite.last_way``)."""
    fused = opt_kind == "sgd" or device.type == "cpu"  # make_optimizer: fused on the CPU
    return "found_inf" if fused else "snapshot"


@pytest.mark.parametrize("kind", ["loss", "grad_nan", "grad_inf"])
@pytest.mark.parametrize("k", [0, 5], ids=["first_eager_step", "replay"])
def test_nonfinite_step_is_skipped_bitwise(backend, device, kind, k):
    model, opt, graph = train_graphed(backend, device, clip=0.05, bad={k}, kind=kind)
    ref_model, ref_opt = train_eager(device, clip=0.05, bad={k}, kind=kind)
    assert_same_training_state(model, opt, ref_model, ref_opt)
    assert graph.skipped_steps == 1
    assert graph.guard.last_way == expected_way(device)


@pytest.mark.parametrize("k", [0, 5], ids=["first_eager_step", "replay"])
def test_skipped_step_restores_a_step_count_kept_in_the_param_group(backend, device, k, replays):
    """TransformerEngine's capturable FusedAdam advances ``group["step"]`` (a device tensor in
    the param group, not in ``optimizer.state``): a skipped step must put it back too."""
    model, opt, graph = train_graphed(
        backend, device, bad={k}, kind="grad_nan", opt_kind="group_step"
    )
    ref_model, ref_opt = train_eager(device, bad={k}, kind="grad_nan", opt_kind="group_step")
    assert_same_training_state(model, opt, ref_model, ref_opt)
    assert graph.skipped_steps == 1
    assert graph.guard.last_way == "snapshot"
    # every step replays after the eager one and the capture (and after the first step, when it
    # was skipped: its new state was deleted, so the next step creates it again, eagerly); a
    # CUDA capture executes nothing, so the captured step is replayed once more there
    assert replays[0] == STEPS - 2 - (k == 0) + (backend == "cuda")


def test_a_skipped_step_restores_what_a_step_writes_not_the_hyperparameters(backend, device):
    """The snapshot of a skipped step holds ``group["step"]`` (written by the step) but not the
    learning-rate tensor (written by a schedule, between steps): restoring it inside a captured
    step is a write the lr guard refuses (every capturable optimizer failed so on the H200)."""
    _, opt, graph = train_graphed(backend, device, bad={5}, kind="grad_nan", opt_kind="group_step")
    (hp,) = graph._cap.hparams
    with hp.lent():  # the param_groups as the captured step sees them
        held = {id(t) for t in nonfinite.optimizer_tensors(opt)}
        group = opt.param_groups[0]
        assert isinstance(group["lr"], torch.Tensor) and id(group["lr"]) not in held
        assert id(group["step"]) in held


class EMAOptimizerGraph(tgraph.OptimizerGraph):
    """An extension whose step also moves an average of the weights (a tensor the optimizer
    does not own): it names it in ``protected_tensors``, so a skipped step leaves it as is."""

    def __init__(self, optimizer, **kwargs) -> None:
        super().__init__(optimizer, **kwargs)
        self.ema = [p.detach().clone() for p in self.params()]

    def protected_tensors(self) -> list[torch.Tensor]:
        return self.ema

    def inner_step(self) -> None:
        super().inner_step()
        torch._foreach_lerp_(self.ema, self.params(), 0.25)


@pytest.mark.parametrize("opt_kind", ["sgd", "adamw", "group_step"])
def test_a_skipped_step_restores_the_protected_tensors(backend, device, opt_kind, replays):
    """A NaN step at a replay: the extension's average stays where it was, as in an eager run
    that never took the step, whether the skip snapshots and selects (``group_step``) or the
    fused kernels skip the update themselves (``found_inf``: fused SGD on both backends, fused
    AdamW on the CPU)."""
    bad = 5
    model = make_model(device)
    graph = EMAOptimizerGraph(
        make_optimizer(model, device, opt_kind), skip_nonfinite=True, backend=backend
    )
    ref_model = make_model(device)
    ref_opt = make_optimizer(ref_model, device, opt_kind)
    ref_ema = [p.detach().clone() for p in ref_model.parameters()]
    for i, (x, y) in enumerate(make_batches(device)):
        kind = "grad_nan" if i == bad else None
        plant(kind, model, model(x, y)[1]).backward()
        graph.step()
        plant(kind, ref_model, ref_model(x, y)[1]).backward()
        if i != bad:
            ref_opt.step()
            with torch.no_grad():
                torch._foreach_lerp_(ref_ema, list(ref_model.parameters()), 0.25)
        ref_opt.zero_grad(set_to_none=True)
    assert graph.captured and graph.skipped_steps == 1
    way = "snapshot" if opt_kind == "group_step" else expected_way(device, opt_kind)
    assert graph.guard.last_way == way
    assert replays[0] == STEPS - 2 + (backend == "cuda")  # the NaN step was a replay
    assert_same_training_state(model, graph.optimizer, ref_model, ref_opt)
    for k, (got, want) in enumerate(zip(graph.ema, ref_ema, strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"protected tensor {k}")


def test_planted_unmasked_update_is_caught(backend, device, monkeypatch):
    """The naive version: compute the flag, but let the step through anyway (neither the
    fused kernels' found_inf mask nor the snapshot select)."""
    monkeypatch.setattr(nonfinite, "masks_with_found_inf", lambda opt: False)
    monkeypatch.setattr(nonfinite._Protected, "select", lambda self, ok: None)
    model, opt, _ = train_graphed(backend, device, bad={5}, kind="grad_inf")
    ref_model, ref_opt = train_eager(device, bad={5}, kind="grad_inf")
    with pytest.raises(AssertionError, match="differs from eager"):
        assert_same_training_state(model, opt, ref_model, ref_opt)


def test_skip_counter_and_no_host_sync_in_replays(backend, device):
    model = make_model(device)
    graph = tgraph.OptimizerGraph(
        make_optimizer(model, device),
        clip_grad_norm=1.0,
        skip_nonfinite=True,
        backend=backend,
    )
    bad = {3, 4, 6}
    for i, (x, y) in enumerate(make_batches(device)):
        loss = plant("grad_nan" if i in bad else None, model, model(x, y)[1])
        loss.backward()
        if graph.captured:  # a replay never reads the device on the host
            with RefuseHostSync():
                graph.step(loss)
        else:
            graph.step(loss)
    assert graph.captured
    counter = graph.guard.skipped_steps_tensor
    assert counter.device.type == device.type and counter.dtype == torch.int64
    assert graph.skipped_steps == len(bad)


@pytest.mark.parametrize("sched", ["step", "cosine"])
def test_lr_schedule_reaches_the_optimizer_graph(backend, device, sched):
    model, opt, _ = train_graphed(backend, device, sched=sched)
    ref_model, ref_opt = train_eager(device, sched=sched)
    assert_same_training_state(model, opt, ref_model, ref_opt, exact=False)


def test_planted_frozen_lr_is_caught(backend, device, monkeypatch):
    # The naive implementation: lr stays a Python float (baked at capture), nobody checks it.
    monkeypatch.setattr(hyperparams, "holds_tensor_lr", lambda group: False)
    monkeypatch.setattr(hyperparams.HyperParams, "_check_baked", lambda self: None)
    model, opt, _ = train_graphed(backend, device, sched="step")
    ref_model, ref_opt = train_eager(device, sched="step")
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        assert_same_training_state(model, opt, ref_model, ref_opt, exact=False)


def _train_with_change(backend, device, change, *, graphed: bool, opt_kind: str = "adamw"):
    """Train STEPS steps, calling ``change(opt)`` before step 5 (after the capture at step 2)."""
    model = make_model(device)
    opt = make_optimizer(model, device, opt_kind)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend=backend) if graphed else None
    for i, (x, y) in enumerate(make_batches(device)):
        if i == 5:
            assert graph is None or graph.captured
            change(opt)
        loss = model(x, y)[1]
        loss.backward()
        if graph is not None:
            graph.step(loss)
        else:
            opt.step()
            opt.zero_grad(set_to_none=False)
    return model, opt


def _assign_float_lr(opt) -> None:
    for g in opt.param_groups:
        g["lr"] = LR / 4  # a float replacing the tensor the graph reads; exact in float32


@pytest.mark.parametrize("opt_kind", ["adamw", "sgd"])
def test_float_lr_assigned_after_capture_reaches_the_optimizer_graph(backend, device, opt_kind):
    """A float learning rate assigned after capture is copied into the graph's lr tensor at
    the next replay (HyperParams.refresh): the same numbers as eager, bit for bit; the
    param_groups keep the floats."""
    model, opt = _train_with_change(backend, device, _assign_float_lr, graphed=True,
                                    opt_kind=opt_kind)  # fmt: skip
    ref_model, ref_opt = _train_with_change(backend, device, _assign_float_lr, graphed=False,
                                            opt_kind=opt_kind)  # fmt: skip
    assert_same_training_state(model, opt, ref_model, ref_opt)
    assert all(g["lr"] == LR / 4 and isinstance(g["lr"], float) for g in opt.param_groups)


def test_planted_replay_without_refresh_is_caught(backend, device, monkeypatch):
    monkeypatch.setattr(hyperparams.HyperParams, "refresh", lambda self: None)
    model, opt = _train_with_change(backend, device, _assign_float_lr, graphed=True)
    ref_model, ref_opt = _train_with_change(backend, device, _assign_float_lr, graphed=False)
    with pytest.raises(AssertionError, match="parameter 0 differs from eager"):
        assert_same_training_state(model, opt, ref_model, ref_opt)


@pytest.mark.parametrize(
    "opt_kind, key, value",
    [("sgd", "momentum", 0.5), ("adamw", "betas", (0.8, 0.99)), ("adamw", "weight_decay", 0.0)],
)
def test_baked_hyperparameter_changed_after_capture_is_captured_again(
    backend, device, opt_kind, key, value, replays, caplog
):
    """Momentum, betas, weight decay are host numbers of the captured kernels (no tensor form
    in torch's fused and capturable optimizers): a change before step 5 is named, the step is
    captured again after warmup with the new value, and training is eager's, bit for bit."""

    def change(opt) -> None:
        opt.param_groups[0][key] = value

    with caplog.at_level("WARNING", logger="tgraph.step.optimizer_graph"):
        model, opt = _train_with_change(backend, device, change, graphed=True, opt_kind=opt_kind)
    assert f"'{key}' changed after capture" in caplog.text
    ref_model, ref_opt = _train_with_change(backend, device, change, graphed=False,
                                            opt_kind=opt_kind)  # fmt: skip
    assert_same_training_state(model, opt, ref_model, ref_opt)
    # replays: steps 2-4, then step 5 eager, 6 captured, 7 replayed (+ the captures on CUDA)
    assert replays[0] == 4 + 2 * (backend == "cuda")


def _train_with_clipping_change(backend, device, key, value, *, graphed: bool):
    """Train STEPS steps clipped to 0.05 (below the gradient norms: active at every step),
    setting the OptimizerGraph's ``key`` (and the eager clipping's) to ``value`` before step 5,
    after the capture at step 1."""
    model = make_model(device)
    opt = make_optimizer(model, device)
    clip = {"clip_grad_norm": 0.05, "norm_type": 2.0}
    graph = tgraph.OptimizerGraph(opt, **clip, backend=backend) if graphed else None
    for i, (x, y) in enumerate(make_batches(device)):
        if i == 5:
            clip[key] = value
            if graph is not None:
                assert graph.captured
                setattr(graph, key, value)
        model(x, y)[1].backward()
        if graph is not None:
            graph.step()
            continue
        if clip["clip_grad_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), *clip.values())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


CLIPPING_CHANGES = [("clip_grad_norm", 1e-3), ("norm_type", float("inf")), ("clip_grad_norm", None)]


@pytest.mark.parametrize("key, value", CLIPPING_CHANGES)
def test_clipping_changed_after_capture_is_captured_again(
    backend, device, key, value, replays, caplog
):
    """clip_grad_norm and norm_type are host numbers of the captured clipping: set after the
    capture (None included: no clipping), the change is named, the step is captured again with
    it after warmup, and training is eager's, bit for bit."""
    with caplog.at_level("WARNING", logger="tgraph.step.optimizer_graph"):
        model, opt = _train_with_clipping_change(backend, device, key, value, graphed=True)
    assert f"OptimizerGraph.{key} changed from" in caplog.text
    ref_model, ref_opt = _train_with_clipping_change(backend, device, key, value, graphed=False)
    assert_same_training_state(model, opt, ref_model, ref_opt)
    # replays: steps 2-4, then step 5 eager, 6 captured, 7 replayed (+ the captures on CUDA)
    assert replays[0] == 4 + 2 * (backend == "cuda")


def test_planted_clipping_not_checked_is_caught(backend, device, monkeypatch):
    """Without the clipping among what a replay checks, the graph keeps clipping to 0.05."""
    from tgraph.step import optimizer_graph

    monkeypatch.setattr(optimizer_graph, "_CLIPPING", ())
    model, opt = _train_with_clipping_change(backend, device, "clip_grad_norm", 1e-3, graphed=True)
    ref = _train_with_clipping_change(backend, device, "clip_grad_norm", 1e-3, graphed=False)
    with pytest.raises(AssertionError, match="parameter 0 differs from eager"):
        assert_same_training_state(model, opt, *ref)


def _train_calling(backend, device, before_step, *, graphed: bool, steps: int = STEPS):
    """Train ``steps`` steps (AdamW), calling ``before_step(i, opt, sched)`` before step ``i``
    (an ``ExponentialLR(0.9)`` steps after each); the graph captures at step 1."""
    model = make_model(device)
    opt = make_optimizer(model, device)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    graph = tgraph.OptimizerGraph(opt, backend=backend) if graphed else None
    for i, (x, y) in enumerate(make_batches(device, n=steps)):
        before_step(i, opt, sched)
        model(x, y)[1].backward()
        if graph is not None:
            graph.step()
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return model, opt


def _own_lr_tensor(device):
    """Before step 3 (after the capture) the group gets the caller's own lr tensor; before
    step 6 the caller updates it in place. Powers of two: exact in float32."""
    own = torch.tensor(LR * 2, device=device)

    def before_step(i, opt, sched) -> None:
        if i == 3:
            opt.param_groups[0]["lr"] = own
        if i == 6:
            own.fill_(LR * 4)

    return before_step


def test_lr_tensor_assigned_after_capture_is_read_in_place(backend, device, replays, caplog):
    """A float learning rate at capture, then the caller's own tensor: the step is captured
    again and reads that tensor in place, so its later in-place update reaches the graph (the
    group keeps the caller's tensor). Bit for bit with eager."""
    with caplog.at_level("WARNING", logger="tgraph.step.optimizer_graph"):
        model, opt = _train_calling(backend, device, _own_lr_tensor(device), graphed=True, steps=10)
    assert "'lr' was a float at capture and is a Tensor now" in caplog.text
    ref_model, ref_opt = _train_calling(backend, device, _own_lr_tensor(device), graphed=False,
                                        steps=10)  # fmt: skip
    assert_same_training_state(model, opt, ref_model, ref_opt)
    assert opt.param_groups[0]["lr"].item() == LR * 4
    # step 2 replays; 3 eager, 4 captured, 5-9 replayed (+ one replay per CUDA capture)
    assert replays[0] == 6 + 2 * (backend == "cuda")


def test_planted_lr_tensor_copied_once_is_caught(backend, device, monkeypatch):
    """The naive version: the caller's tensor is taken for a new float, copied into the graph's
    tensor once and never again (the in-place update never reaches the graph)."""
    monkeypatch.setattr(hyperparams, "_is_float", lambda value: True)
    model, opt = _train_calling(backend, device, _own_lr_tensor(device), graphed=True, steps=10)
    ref_model, ref_opt = _train_calling(backend, device, _own_lr_tensor(device), graphed=False,
                                        steps=10)  # fmt: skip
    with pytest.raises(AssertionError, match="parameter 0 differs from eager"):
        assert_same_training_state(model, opt, ref_model, ref_opt)


def _schedule(i, opt, sched) -> None:
    if i > 0:
        sched.step()  # after step i - 1: gamma 0.9, not exact in float32


def test_chainable_schedule_computes_in_doubles_as_eager(backend, device, replays):
    """ExponentialLR computes the next learning rate from ``group['lr']``: the group keeps the
    Python float, so the schedule runs in doubles as in eager code (a float32 tensor there
    would round at every step and drift). The graph reads the float rounded to float32, so
    the parameters are eager's to ``TOL``."""
    model, opt = _train_calling(backend, device, _schedule, graphed=True)
    ref_model, ref_opt = _train_calling(backend, device, _schedule, graphed=False)
    lr, ref_lr = opt.param_groups[0]["lr"], ref_opt.param_groups[0]["lr"]
    assert type(lr) is float and lr == ref_lr
    assert_same_training_state(model, opt, ref_model, ref_opt, exact=False)
    assert replays[0] == STEPS - 2 + (backend == "cuda")


def test_planted_lr_tensor_left_in_the_group_is_caught(backend, device, monkeypatch):
    """The naive version: the graph's float32 tensor stays in the param_group after capture,
    and the schedule multiplies it in float32."""

    @contextlib.contextmanager
    def kept(self):
        for h in self._held:
            h.fill(h.group["lr"])
            h.group["lr"] = h.tensor
        self._lent = [(h, h.tensor) for h in self._held]
        yield

    monkeypatch.setattr(hyperparams.HyperParams, "lent", kept)
    _, opt = _train_calling(backend, device, _schedule, graphed=True)
    _, ref_opt = _train_calling(backend, device, _schedule, graphed=False)
    assert float(opt.param_groups[0]["lr"]) != ref_opt.param_groups[0]["lr"]


def _betas_list(i, opt, sched) -> None:
    if i == 0:
        opt.param_groups[0]["betas"] = [0.9, 0.999]  # a list, as a config file gives it
    if i == 4:
        opt.param_groups[0]["betas"][0] = 0.5  # changed in place, after the capture


def test_betas_list_changed_in_place_is_captured_again(backend, device, replays, caplog):
    """A hyper-parameter held in a list and changed in place is a change: compared with the
    copy taken at capture, named, captured again. Bit for bit with eager."""
    with caplog.at_level("WARNING", logger="tgraph.step.optimizer_graph"):
        model, opt = _train_calling(backend, device, _betas_list, graphed=True)
    assert "'betas' changed after capture" in caplog.text
    ref_model, ref_opt = _train_calling(backend, device, _betas_list, graphed=False)
    assert_same_training_state(model, opt, ref_model, ref_opt)
    # step 2-3 replays; 4 eager, 5 captured, 6-7 replayed (+ one replay per CUDA capture)
    assert replays[0] == 4 + 2 * (backend == "cuda")


def test_planted_betas_list_held_by_reference_is_caught(backend, device, monkeypatch):
    """The naive version: the capture keeps a reference to the list, compared with itself."""
    monkeypatch.setattr(hyperparams, "_copied", lambda value: value)
    model, opt = _train_calling(backend, device, _betas_list, graphed=True)
    ref_model, ref_opt = _train_calling(backend, device, _betas_list, graphed=False)
    with pytest.raises(AssertionError, match="parameter 0 differs from eager"):
        assert_same_training_state(model, opt, ref_model, ref_opt)


def test_weight_decay_schedule_is_eagers_bit_for_bit(backend, device):
    """A weight decay changed at every step: never a replay of a stale value."""

    def run(graphed: bool):
        model = make_model(device)
        opt = make_optimizer(model, device)
        graph = tgraph.OptimizerGraph(opt, backend=backend) if graphed else None
        for i, (x, y) in enumerate(make_batches(device)):
            opt.param_groups[0]["weight_decay"] = 0.1 * 0.7**i
            model(x, y)[1].backward()
            if graph is not None:
                graph.step()
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return model, opt

    assert_same_training_state(*run(graphed=True), *run(graphed=False))


def test_beside_per_layer_graphs(backend, device):
    """The intended use: per-layer graphs for forward/backward, OptimizerGraph for the step."""
    model = make_model(device)
    opt = make_optimizer(model, device)
    graph = tgraph.OptimizerGraph(opt, clip_grad_norm=0.05, skip_nonfinite=True, backend=backend)
    tgraph.enable(model, backend=backend, strict=True)
    try:
        for i, (x, y) in enumerate(make_batches(device)):
            loss = plant("grad_nan" if i == 5 else None, model, model(x, y)[1])
            loss.backward()
            graph.step(loss)
            if i == 0:
                tgraph.create_graphs()
    finally:
        tgraph.reset()
        tgraph.disable(model)
    ref_model, ref_opt = train_eager(device, clip=0.05, bad={5}, kind="grad_nan")
    assert_same_training_state(model, opt, ref_model, ref_opt, exact=False)
    assert graph.skipped_steps == 1


def test_grad_ownership_rules(backend, device):
    """zero_grad=True: .grad is None after every step (as optimizer.zero_grad()); the graph copies
    each step's gradients into its own buffers, so autograd's tensors are used as they come."""
    model = make_model(device)
    opt = make_optimizer(model, device)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend=backend)
    batches = make_batches(device)
    for x, y in batches[:3]:
        model(x, y)[1].backward()
        graph.step()
        assert all(p.grad is None for p in model.parameters())
    assert graph.captured
    # .grad None where the capture had one: the graph would step it, eager would not.
    with pytest.raises(ValueError, match=r"has no \.grad: no parameter has one"):
        graph.step()


def test_zero_grad_false_leaves_grad_to_the_caller(backend, device):
    model = make_model(device)
    opt = make_optimizer(model, device)
    graph = tgraph.OptimizerGraph(opt, zero_grad=False, skip_nonfinite=True, backend=backend)
    ref_model = make_model(device)
    ref_opt = make_optimizer(ref_model, device)
    for x, y in make_batches(device):
        model(x, y)[1].backward()
        grads = [p.grad for p in model.parameters()]
        graph.step()
        assert all(p.grad is g for p, g in zip(model.parameters(), grads))
        opt.zero_grad(set_to_none=False)  # in place: the graph copies the new values anyway
        ref_model(x, y)[1].backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=False)
    assert graph.captured
    assert_same_training_state(model, opt, ref_model, ref_opt)


def test_capture_right_after_the_state_creating_step(backend, device):
    """warmup_steps=1: the first (eager) step creates Adam's state, the second is captured (the
    H200 run: `assert graph.captured` after two steps failed, the capture then ran inside
    set_sync_debug_mode("error"))."""
    model = make_model(device)
    graph = tgraph.OptimizerGraph(
        make_optimizer(model, device), clip_grad_norm=1.0, skip_nonfinite=True, backend=backend
    )
    for x, y in make_batches(device, 2):
        loss = model(x, y)[1]
        loss.backward()
        graph.step(loss)
    assert graph.captured


def test_capture_that_creates_state_runs_eagerly(backend, device):
    """A parameter gets its first gradient at the capturing step: its state is created there,
    which a graph must not contain (it would re-create it at every replay). The capture is undone,
    the step runs eagerly, the next one is captured; bitwise equal to eager."""
    kw = dict(backend=backend, warmup_steps=1, skip_nonfinite=True)

    def run(graphed: bool):
        model = make_model(device)
        opt = make_optimizer(model, device)
        graph = tgraph.OptimizerGraph(opt, **kw) if graphed else None
        head = model.lm_head.weight if hasattr(model, "lm_head") else None
        frozen = [p for p in model.parameters() if p is not head][-1]
        for i, (x, y) in enumerate(make_batches(device)):
            model(x, y)[1].backward()
            if i == 0:
                frozen.grad = None  # no gradient (no state) at the first step only
            if graphed:
                graph.step()
                if i == 1:
                    assert not graph.captured
            else:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return model, opt, graph

    model, opt, graph = run(True)
    ref_model, ref_opt, _ = run(False)
    assert graph.captured
    assert_same_training_state(model, opt, ref_model, ref_opt)


def _layers_and_optimizer_graph(backend, device, strict=True):
    """A model with per-layer graphs enabled (``strict``: every call replays) and an
    OptimizerGraph of its optimizer, and an eager twin with its own optimizer."""
    model = make_model(device)
    opt = make_optimizer(model, device)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend=backend)
    tgraph.enable(model, backend=backend, strict=strict)
    ref = make_model(device)
    return model, opt, graph, ref, make_optimizer(ref, device)


@pytest.mark.parametrize("keep_from", [0, 3], ids=["from_the_start", "after_capture"])
def test_kept_gradients_beside_the_optimizer_graph_are_never_overwritten(
    backend, device, swaps, keep_from
):
    """A hook keeps every step's gradient of a block's weight. Beside per-layer graphs the
    optimizer graph reads the blocks' gradients where their backward graphs leave them; a kept
    gradient is that memory, so the next steps must not overwrite it: with the storage swap it
    is moved out first; without it (PyTorch < 2.13) the hooked parameter's unit hands out
    copies from the step the hook appears (it may keep what it is given), and a step that would
    copy into memory the hook still views runs eagerly. Training equals eager throughout, and
    every layer call replays."""
    model, opt, graph, ref, ref_opt = _layers_and_optimizer_graph(backend, device)
    kept, copies = [], []
    weight = model.h[0].mlp.c_fc.weight
    try:
        for i, (x, y) in enumerate(make_batches(device)):
            if i == keep_from:
                weight.register_hook(lambda g: kept.append(g) or copies.append(g.detach().clone()))
            for m, o, step in ((model, opt, graph.step), (ref, ref_opt, ref_opt.step)):
                m(x, y)[1].backward()
                step()
                o.zero_grad(set_to_none=True)
            if i == 0:
                tgraph.create_graphs()
        assert graph.captured and len(kept) == len(copies) > 2
        for k, (g, c) in enumerate(zip(kept, copies)):
            torch.testing.assert_close(g, c, rtol=0, atol=0, msg=f"kept gradient {k} changed")
        assert tgraph.eager_calls() == 0  # strict: all replayed
        assert_same_training_state(model, opt, ref, ref_opt, exact=False)
    finally:
        tgraph.reset()
        tgraph.disable(model)


def test_a_gradient_kept_in_a_loop_variable_beside_the_optimizer_graph_keeps_its_values(
    backend, device, swaps, replays
):
    """``last = weight.grad`` kept across the next step, no hook: with the storage swap the
    replays move it out of the graphs' memory; without it (PyTorch < 2.13) the ledger cannot
    re-point it (it is not ``.grad`` any more), so the next step's layer calls run eagerly,
    and the optimizer graph, whose step would copy the (now eager) gradients into the memory
    ``last`` views, runs that step eagerly too. ``last`` keeps its values, training equals
    eager, and once ``last`` is let go everything replays again."""
    model, opt, graph, ref, ref_opt = _layers_and_optimizer_graph(backend, device, strict=False)
    last = {}
    try:
        for i, (x, y) in enumerate(make_batches(device)):
            for m, o, step in ((model, opt, graph.step), (ref, ref_opt, ref_opt.step)):
                m(x, y)[1].backward()
                grad = m.h[0].mlp.c_fc.weight.grad
                step()
                o.zero_grad(set_to_none=True)
                if m in last:
                    kept, values = last[m]
                    torch.testing.assert_close(
                        kept,
                        values,
                        rtol=0,
                        atol=0,
                        msg=lambda why, i=i: f"kept gradient changed at step {i}: {why}",
                    )
                last[m] = (grad, grad.clone())  # kept until the next step has run
            if i == 0:
                tgraph.create_graphs()
        assert graph.captured
        torch.testing.assert_close(*last[model], rtol=0, atol=0)
        torch.testing.assert_close(last[model][0], last[ref][0], **TOL)
        assert_same_training_state(model, opt, ref, ref_opt, exact=False)
        del last, kept, grad
        before, replays[0] = tgraph.eager_calls(), 0
        model(*make_batches(device, 1)[0])[1].backward()
        graph.step()
        assert tgraph.eager_calls() == before  # the layers replayed ...
        assert replays[0] == 3  # ... their stack's forward and backward, and the step
    finally:
        tgraph.reset()
        tgraph.disable(model)


@pytest.mark.parametrize("at_replay", [1, 3])
def test_a_gradient_the_graph_never_steps_is_refused_at_any_replay(backend, device, at_replay):
    """A parameter had no gradient at capture, so the graph never steps it. When it gets one,
    at the first replay or a later one, the step raises instead of dropping that gradient
    (zero_grad would clear it, and the parameter would silently stop training)."""
    model = make_model(device)
    opt = make_optimizer(model, device)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend=backend, warmup_steps=1)
    head = model.lm_head.weight if hasattr(model, "lm_head") else None
    unstepped = [p for p in model.parameters() if p is not head][-1]
    for i, (x, y) in enumerate(make_batches(device)):
        model(x, y)[1].backward()
        if i < 1 + at_replay:  # the eager step, the capture, replays without it
            unstepped.grad = None
            graph.step()
            continue
        with pytest.raises(ValueError, match="without .grad at capture has one now"):
            graph.step()
        return
    raise AssertionError("too few batches")


def test_loss_given_at_some_calls_only_is_refused(backend, device):
    model = make_model(device)
    graph = tgraph.OptimizerGraph(
        make_optimizer(model, device), skip_nonfinite=True, backend=backend
    )
    x, y = make_batches(device, 1)[0]
    loss = model(x, y)[1]
    loss.backward()
    graph.step(loss)
    with pytest.raises(ValueError, match="pass it at every call or at none"):
        graph.step()


def test_host_syncing_optimizer_is_refused(backend, device):
    """Refused at the first step, before any eager step: such an optimizer keeps its step count
    on the host, and the skip guard of an eager step would mix it with device tensors (the H200
    run: "Expected all tensors to be on the same device, ... cuda:0 and cpu")."""
    model = make_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)  # neither capturable nor fused
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=True, backend=backend)
    fix = "capturable=True" if device.type == "cuda" else "fused=True"
    x, y = make_batches(device, 1)[0]
    loss = model(x, y)[1]
    loss.backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"AdamW param_group 0 .*{fix}"):
        graph.step(loss)
    assert not opt.state  # no step was taken
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_skip_guard_groups_tensors_by_device():
    """A tensor on another device than the flag (a host step count) is selected on its own
    device, never in one foreach list with device tensors."""
    t = [torch.ones(3), torch.zeros((), dtype=torch.float32)]
    prot = nonfinite._Protected(t)
    assert all(len(cur) == 1 or d.type == "cpu" for (d, _), (cur, _) in prot.by_dtype.items())
    prot.save()
    t[0].add_(1.0)
    prot.select(torch.tensor(False))
    assert torch.equal(t[0], torch.ones(3))


def test_bad_arguments():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(TypeError):
        tgraph.OptimizerGraph(object())
    with pytest.raises(ValueError, match="clip_grad_norm"):
        tgraph.OptimizerGraph(opt, clip_grad_norm=0.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        tgraph.OptimizerGraph(opt, warmup_steps=0)
    with pytest.raises(ValueError, match="backend"):
        tgraph.OptimizerGraph(opt, backend="tpu")


# -- FullIterationGraph(skip_nonfinite=True) ---------------------------------------------------


def two_optimizers(model, device) -> list[torch.optim.Optimizer]:
    """The blocks' parameters step with one AdamW, the others with another."""
    blocks = {id(p) for p in model.h.parameters()}
    groups = [
        [p for p in model.parameters() if (id(p) in blocks) == in_blocks]
        for in_blocks in (True, False)
    ]
    return [make_optimizer(nn.ParameterList(g), device) for g in groups]


class TwoOptimizerGraph(tgraph.OptimizerGraph):
    """An extension that steps several optimizers as one step."""

    def __init__(self, optimizers, **kwargs) -> None:
        self._all = list(optimizers)
        super().__init__(self._all[0], **kwargs)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self._all)

    def inner_step(self) -> None:
        for opt in self._all:
            opt.step()


def test_optimizer_graph_counts_a_skipped_step_once_for_two_optimizers(backend, device, replays):
    bad = {3, 5}
    model, ref_model = make_model(device), make_model(device)
    graph = TwoOptimizerGraph(two_optimizers(model, device), skip_nonfinite=True, backend=backend)
    ref_opts = two_optimizers(ref_model, device)
    for i, (x, y) in enumerate(make_batches(device)):
        kind = "grad_nan" if i in bad else None
        plant(kind, model, model(x, y)[1]).backward()
        graph.step()
        plant(kind, ref_model, ref_model(x, y)[1]).backward()
        for opt in ref_opts:
            if i not in bad:
                opt.step()
            opt.zero_grad(set_to_none=True)
    assert graph.captured and replays[0] == STEPS - 2 + (backend == "cuda")
    assert graph.skipped_steps == len(bad)
    for opt, ref_opt in zip(graph.optimizers, ref_opts, strict=True):
        assert_same_training_state(model, opt, ref_model, ref_opt)


def full_iteration_run(backend, device, bad, graphed: bool, warmup: int = 3, optimizers: int = 1):
    """``optimizers=2``: :func:`two_optimizers`."""
    model = make_model(device)
    opts = [make_optimizer(model, device)] if optimizers == 1 else two_optimizers(model, device)

    def fn(batch):
        x, y, scale = batch
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        loss = model(x, y)[1] * scale  # scale 1.0 (exact) or NaN (planted)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        for opt in opts:
            opt.step()
        return loss.detach()

    step = (
        tgraph.FullIterationGraph(fn, warmup_steps=warmup, backend=backend, skip_nonfinite=True)
        if graphed
        else fn
    )
    for i, (x, y) in enumerate(make_batches(device)):
        nan = i in bad
        if nan and not graphed:
            continue  # the eager reference never takes the step
        scale = torch.tensor(float("nan") if nan else 1.0, device=device)
        step((x, y, scale))
    return model, opts, step


@pytest.mark.parametrize("optimizers", [1, 2])
@pytest.mark.parametrize("k", [0, 2, 5], ids=["first_step", "warmup", "replay"])
def test_full_iteration_skips_nonfinite_bitwise(backend, device, k, optimizers):
    """A NaN step skips every optimizer's step, and counts as one skipped step."""
    model, opts, step = full_iteration_run(backend, device, {k}, True, optimizers=optimizers)
    ref_model, ref_opts, _ = full_iteration_run(backend, device, {k}, False, optimizers=optimizers)
    assert step.num_graphs == 1
    for opt, ref_opt in zip(opts, ref_opts, strict=True):
        assert_same_training_state(model, opt, ref_model, ref_opt)
    assert step.skipped_steps == 1


def test_full_iteration_capture_after_only_skipped_warmups_is_refused(backend, device):
    """Every warmup skipped: Adam's state would be created inside the graph (not revertible)."""
    with pytest.raises(tgraph.CaptureError, match="created its state"):
        full_iteration_run(backend, device, {0, 1}, graphed=True, warmup=2)


@pytest.mark.parametrize("microbatches", [1, 2, "1 then 2"])
def test_per_layer_gradients_are_read_in_place(backend, device, microbatches, swaps):
    """Beside per-layer graphs, the optimizer graph reads the gradients the layers' backward
    graphs hand over where they leave them: it keeps buffers of its own only for the other
    parameters (embeddings, head), and training equals eager. With the storage swap and two
    microbatches the first one's gradients are moved out of the packed buffer before the second
    backward (the accumulated .grad lives elsewhere: a storage swap, or on PyTorch < 2.13 the
    .grad re-pointed), so the graph copies them into buffers of its own."""
    model, opt, graph, ref, ref_opt = _layers_and_optimizer_graph(backend, device)
    try:
        for i, (x, y) in enumerate(make_batches(device)):
            n = (1 if i < 4 else 2) if microbatches == "1 then 2" else microbatches
            for m, o, step in ((model, opt, graph.step), (ref, ref_opt, ref_opt.step)):
                for k in range(n):  # "1 then 2": the same batch twice (the captured shape)
                    half = slice(None) if microbatches == "1 then 2" else slice(k * 2, k * 2 + 2)
                    (m(x[half], y[half])[1] / n).backward()
                step()
                o.zero_grad(set_to_none=True)
            if i == 0:
                tgraph.create_graphs()
        assert graph.captured
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        blocks = sum(p.numel() * p.element_size() for b in model.h for p in b.parameters())
        # one microbatch: the blocks' gradients are read in place; two: the accumulated
        # gradients live outside the packed buffers, so the graph holds its own copy of all
        in_place = microbatches != 2
        want = total - blocks if in_place else total
        assert graph.own_grad_bytes == want, (graph.own_grad_bytes, total, blocks)
        assert_same_training_state(model, opt, ref, ref_opt, exact=False)
    finally:
        tgraph.reset()
        tgraph.disable(model)


def test_param_groups_replaced_by_load_state_dict_are_named_as_such():
    """optimizer.load_state_dict replaces the param_groups' dicts, not their parameters: the
    recapture's warning said "the parameters of a ... param group changed"; it names the
    replaced groups, and a real change of parameters keeps its own message."""
    from tgraph.step.hyperparams import baked_layout, layout_change

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    before = baked_layout([opt])
    opt.load_state_dict(opt.state_dict())
    assert "param groups were replaced" in layout_change(before, [opt])
    before = baked_layout([opt])
    opt.param_groups[0]["params"] = opt.param_groups[0]["params"][:1]
    assert "parameters of a AdamW param group changed" in layout_change(before, [opt])
