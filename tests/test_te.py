"""TransformerEngine layers under per-layer graphs, against an eager twin, in bf16 and FP8.

TE's own ``make_graphed_callables`` is bitwise equal to eager in bf16 and in FP8 on an H200, so
these tests ask the same of tgraph: equal losses, parameters and FP8 scaling state at every
step, with every graphed call proven to replay (``strict=True``). Each FP8 test is also run with
the backward scale update planted out of the replay, and must then see a difference.
"""

from __future__ import annotations

import copy

import pytest
import torch

import tgraph
from tgraph.fp8 import FP8Replay

pytestmark = [pytest.mark.cuda, pytest.mark.te]

D, SEQ, BATCH, STEPS = 256, 32, 4, 6


def _te():
    import transformer_engine.pytorch as te

    return te


def _recipe(name: str):
    from transformer_engine.common import recipe

    if name == "bf16":
        return None
    if name == "delayed":
        return recipe.DelayedScaling(
            fp8_format=recipe.Format.HYBRID, amax_history_len=4, amax_compute_algo="max"
        )
    if name == "current":
        return recipe.Float8CurrentScaling()
    if name == "block":
        return recipe.Float8BlockScaling()
    raise ValueError(name)


class LinearBlock(tgraph.GraphableModule):
    """LayerNormLinear + GELU + Linear, with a residual (the measurement of the FP8 report)."""

    def __init__(self) -> None:
        super().__init__()
        te = _te()
        self.ln_fc = te.LayerNormLinear(D, 4 * D, params_dtype=torch.bfloat16)
        self.proj = te.Linear(4 * D, D, params_dtype=torch.bfloat16)

    def forward(self, x, is_first_microbatch=None):
        h = self.ln_fc(x, is_first_microbatch=is_first_microbatch)
        h = torch.nn.functional.gelu(h)
        return x + self.proj(h, is_first_microbatch=is_first_microbatch)


class MLPBlock(tgraph.GraphableModule):
    """LayerNormMLP beside a torch Linear: TE and torch modules in one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = _te().LayerNormMLP(D, 4 * D, params_dtype=torch.bfloat16)
        self.mix = torch.nn.Linear(D, D, dtype=torch.bfloat16)

    def forward(self, x, is_first_microbatch=None):
        return x + self.mix(self.mlp(x, is_first_microbatch=is_first_microbatch))


class LayerBlock(tgraph.GraphableModule):
    """te.TransformerLayer (fused attention, causal), dropout off."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.layer = _te().TransformerLayer(
            D,
            4 * D,
            4,
            hidden_dropout=dropout,
            attention_dropout=dropout,
            self_attn_mask_type="causal",
            params_dtype=torch.bfloat16,
        )

    def forward(self, x, is_first_microbatch=None):
        return self.layer(x, is_first_microbatch=is_first_microbatch)


BLOCKS = {"linear": LinearBlock, "mlp": MLPBlock, "layer": LayerBlock}


def _model(kind: str, n: int = 3) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[BLOCKS[kind]() for _ in range(n)]).cuda()


def _scaling(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every FP8 scale and amax history of the model's TE modules (delayed scaling)."""
    out = []
    for m in model.modules():
        meta = getattr(m, "fp8_meta", None)
        if isinstance(meta, dict):
            for key in ("scaling_fwd", "scaling_bwd"):
                st = meta.get(key)
                if st is not None and hasattr(st, "amax_history"):
                    out += [st.scale.clone(), st.amax_history.clone()]
    return out


def _train(
    model,
    recipe,
    *,
    graphed: bool,
    steps: int = STEPS,
    microbatches: int = 1,
    calibrating: bool = False,
):
    """Steps of AdamW; per step ``microbatches`` forward/backward passes, each in its own
    ``te.autocast`` (TE's weight caching: ``is_first_microbatch`` when there are several;
    ``calibrating``: FP8 off, the recipe's amaxes recorded). Returns the losses and, per step,
    the FP8 scaling state."""
    te = _te()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses, scaling = [], []
    for step in range(steps):
        for mb in range(microbatches):
            x = torch.randn(SEQ, BATCH, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            kw = {"is_first_microbatch": mb == 0} if microbatches > 1 else {}
            fp8 = recipe is not None and not calibrating
            with te.autocast(enabled=fp8, calibrating=calibrating, recipe=recipe):
                y = x
                for blk in model:
                    y = blk(y, **kw)
            loss = y.float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        scaling.append(_scaling(model))
        if graphed and step == 0:
            tgraph.create_graphs()
    return torch.stack(losses), scaling


def _pair(kind: str, recipe_name: str, microbatches: int = 1, n: int = 3, **kw):
    eager = _model(kind, n)
    graphed = copy.deepcopy(eager)
    tgraph.enable(graphed, strict=True)
    recipe = _recipe(recipe_name)
    try:
        want = _train(eager, recipe, graphed=False, microbatches=microbatches, **kw)
        got = _train(graphed, recipe, graphed=True, microbatches=microbatches, **kw)
    finally:
        tgraph.reset()
        tgraph.disable(graphed)
    return eager, graphed, want, got


def _assert_equal(eager, graphed, want, got) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for a, b in zip(got[1], want[1]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    for p, q in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def _fp8_ok(name: str) -> None:
    from transformer_engine.pytorch.quantization import is_fp8_block_scaling_available

    if name == "block":
        ok, why = is_fp8_block_scaling_available(return_reason=True)
        if not ok:
            pytest.skip(why)


@pytest.mark.parametrize("kind", ["linear", "mlp", "layer"])
@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current", "block"])
def test_te_blocks_equal_eager(kind, recipe_name):
    _fp8_ok(recipe_name)
    _assert_equal(*_pair(kind, recipe_name))


def test_fp8_weight_caching_across_microbatches():
    _assert_equal(*_pair("linear", "delayed", microbatches=3))


def test_fp8_graphs_cast_weights_whatever_weight_caching_left_behind():
    """TE's weight-caching flag is process-wide; a graph captured for a call without
    ``is_first_microbatch`` must not read what a later microbatch's graph (or anyone) left."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(True)
    try:
        _assert_equal(*_pair("linear", "delayed"))
    finally:
        FP8GlobalStateManager.set_skip_fp8_weight_update_tensor(False)


def test_fp8_calibration_equal_eager():
    """A calibrating region (high precision, the amaxes recorded for a later FP8 run) is
    captured in it: every replay records them as eager does."""
    _assert_equal(*_pair("linear", "delayed", calibrating=True))


def test_fp8_calibrating_call_finds_no_high_precision_graph():
    """A graph captured outside any te.autocast region records no amax: a calibrating call of
    the same arguments finds no graph, and strict mode says so."""
    te = _te()
    model = _model("linear", 2)
    tgraph.enable(model, strict=True)
    try:
        _train(model, None, graphed=True, steps=2)
        x = torch.randn(SEQ, BATCH, D, device="cuda", dtype=torch.bfloat16)
        with te.autocast(enabled=False, calibrating=True, recipe=_recipe("delayed")):
            with pytest.raises(tgraph.GraphFallbackError, match="autocast changed"):
                model[0](x)
    finally:
        tgraph.reset()
        tgraph.disable(model)


def test_fp8_planted_scale_update_out_of_the_replay_is_seen(monkeypatch):
    """Without the backward amax reduction at replay, the scales drift from eager's: the
    equality tests above would fail."""
    monkeypatch.setattr(FP8Replay, "after_backward", lambda self: None)
    eager, graphed, want, got = _pair("linear", "delayed")
    with pytest.raises(AssertionError):
        _assert_equal(eager, graphed, want, got)


def test_fp8_recipe_change_after_capture_runs_eagerly():
    """The te.autocast region is part of the call key: another recipe (or FP8 switched off)
    finds no graph, and strict mode says so instead of replaying the old region's kernels."""
    te = _te()
    model = _model("linear", 2)
    tgraph.enable(model, strict=True)
    try:
        _train(model, _recipe("delayed"), graphed=True, steps=2)
        x = torch.randn(SEQ, BATCH, D, device="cuda", dtype=torch.bfloat16)
        for other in (_recipe("current"), None):
            with te.autocast(enabled=other is not None, recipe=other):
                with pytest.raises(tgraph.GraphFallbackError, match="autocast changed"):
                    model[0](x)
    finally:
        tgraph.reset()
        tgraph.disable(model)


def _fp8_primary_run(model, recipe, *, graphed: bool) -> torch.Tensor:
    """Steps of TE's FusedAdam with fp32 master weights (what FP8 primary weights train with;
    eager: TE refuses a capturable FusedAdam over FP8 weights)."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    te = _te()
    opt = FusedAdam(model.parameters(), lr=1e-3, master_weights=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for step in range(STEPS):
        x = torch.randn(SEQ, BATCH, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        with te.autocast(enabled=True, recipe=recipe):
            y = x
            for blk in model:
                y = blk(y)
        loss = y.float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if graphed and step == 0:
            tgraph.create_graphs()
    return torch.stack(losses)


def test_fp8_primary_weights_equal_eager():
    """FP8 primary weights (``te.quantized_model_init``: the parameters are FP8 tensors, their
    fp32 masters in the optimizer): per-layer graphs replay (strict) and train as eager, bit
    for bit, while the optimizer re-quantizes the weights in place between steps."""
    te = _te()
    recipe = _recipe("delayed")

    def build():
        torch.manual_seed(0)
        with te.quantized_model_init(enabled=True, recipe=recipe):
            return torch.nn.Sequential(*[LinearBlock() for _ in range(3)]).cuda()

    eager, graphed = build(), build()
    quantized = [n for n, p in graphed.named_parameters() if hasattr(p, "dequantize")]
    assert quantized, "quantized_model_init made no FP8 parameter"
    tgraph.enable(graphed, strict=True)
    try:
        want = _fp8_primary_run(eager, recipe, graphed=False)
        got = _fp8_primary_run(graphed, recipe, graphed=True)
    finally:
        tgraph.reset()
        tgraph.disable(graphed)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for (n, p), q in zip(graphed.named_parameters(), eager.parameters()):
        a = p.dequantize() if hasattr(p, "dequantize") else p
        b = q.dequantize() if hasattr(q, "dequantize") else q
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_recipe_hopper_cannot_run_is_refused():
    from transformer_engine.common import recipe

    te = _te()
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("this GPU runs MXFP8")
    model = _model("linear", 1)
    tgraph.enable(model)
    try:
        x = torch.randn(SEQ, BATCH, D, device="cuda", dtype=torch.bfloat16)
        with pytest.raises((AssertionError, RuntimeError, ValueError)):
            with te.autocast(enabled=True, recipe=recipe.MXFP8BlockScaling()):
                model[0](x)
    finally:
        tgraph.reset()
        tgraph.disable(model)


def _steps_whole(model, recipe, *, mode: str, steps: int = STEPS):
    """AdamW (capturable) steps: eager, per-layer graphs plus tgraph.OptimizerGraph, or one
    tgraph.FullIterationGraph around forward, backward and the step."""
    te = _te()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
    opt_graph = tgraph.OptimizerGraph(opt) if mode in ("layer_opt", "opt") else None
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [
        torch.randn(SEQ, BATCH, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(steps)
    ]

    def forward_backward(x):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            y = x
            for blk in model:
                y = blk(y)
        loss = y.float().pow(2).mean()
        loss.backward()
        return loss.detach()

    def step(x):
        loss = forward_backward(x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    full = tgraph.FullIterationGraph(step) if mode == "full" else None
    replays = []
    if full is not None:  # count replays: equal numbers alone cannot tell them from eager
        replay = full._replay
        full._replay = lambda *a, **k: replays.append(1) or replay(*a, **k)
    losses = []
    for i, x in enumerate(xs):
        if full is not None:
            losses.append(full(x).clone())
        elif opt_graph is not None:
            losses.append(forward_backward(x))
            opt_graph.step()
        else:
            losses.append(step(x))
        if mode == "layer_opt" and i == 0:
            tgraph.create_graphs()
    if full is not None:  # warmup_steps eager steps, then captured and replayed
        assert len(replays) == steps - full.warmup_steps
    return torch.stack(losses), _scaling(model)


@pytest.mark.parametrize("mode", ["layer_opt", "full"])
@pytest.mark.parametrize("recipe_name", ["bf16", "delayed"])
def test_te_whole_step_graphs_equal_eager(mode, recipe_name):
    eager = _model("linear", 3)
    graphed = copy.deepcopy(eager)
    recipe = _recipe(recipe_name)
    want = _steps_whole(eager, recipe, mode="eager")
    if mode == "layer_opt":
        tgraph.enable(graphed, strict=True)
    try:
        got = _steps_whole(graphed, recipe, mode=mode)
    finally:
        tgraph.reset()
        tgraph.disable(graphed)
    _assert_equal(eager, graphed, (want[0], [want[1]]), (got[0], [got[1]]))
