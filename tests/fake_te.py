"""A small stand-in for TransformerEngine's FP8 bookkeeping, for CPU tests of tgraph's FP8 path.

It keeps the parts of TE that a graph must account for, with TE's names: a process-wide
``te.autocast`` state (``FP8GlobalStateManager.quantization_state``), delayed scaling (each
module writes its amax into a history during its forward and backward kernels; the scales move
when the outermost autocast exits, and after the backward of the region's first FP8 module),
TE's graph mode (``_graph=True``: modules do not register themselves) and its capturing flag
(``graph.set_capture_start``: no reduction in a warmup's or a capture's backward), the FP8 weight
cache (``is_first_microbatch``: True or None casts the weight, False reuses the cast of the
first microbatch; in graph mode the device flag ``skip_fp8_weight_update_tensor`` decides,
whatever the call passed) and calibration (``te.autocast(enabled=False, calibrating=True)``:
high-precision outputs, but the amaxes are recorded into the histories, which the scales of
later FP8 steps start from). Quantizing is a rounding to the scale's grid, so a stale scale or
a stale weight cast changes every number. Semantics as in TransformerEngine 2.x
(``transformer_engine/pytorch/quantization.py``, ``module/linear.py``).

``install(monkeypatch)`` puts it in ``sys.modules`` under TE's module names.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch

FP8_MAX = 448.0


@dataclass
class Recipe:
    margin: int = 0
    amax_history_len: int = 4


@dataclass
class QState:
    fp8_enabled: bool = False
    fp8_calibration: bool = False
    fp8_recipe: Recipe | None = None
    fp8_distributed_group: object = None
    is_first_fp8_module: bool = False
    fp8_graph_capturing: bool = False
    autocast_depth: int = 0
    buffer: list = field(default_factory=list)  # registered fp8 metas
    skip: torch.Tensor | None = None


class FP8GlobalStateManager:
    quantization_state = QState()

    @classmethod
    def get_fp8_recipe(cls) -> Recipe:
        return cls.quantization_state.fp8_recipe or Recipe()

    @classmethod
    def get_autocast_state(cls) -> tuple:
        q = cls.quantization_state
        return (q.fp8_enabled, q.fp8_calibration, q.fp8_recipe, q.fp8_distributed_group,
                q.is_first_fp8_module, q.fp8_graph_capturing)  # fmt: skip

    @classmethod
    def set_autocast_state(cls, state: tuple) -> None:
        q = cls.quantization_state
        (q.fp8_enabled, q.fp8_calibration, q.fp8_recipe, q.fp8_distributed_group,
         q.is_first_fp8_module, q.fp8_graph_capturing) = state  # fmt: skip

    @classmethod
    def is_first_fp8_module(cls) -> bool:
        first = cls.quantization_state.is_first_fp8_module
        cls.quantization_state.is_first_fp8_module = False
        return first

    @classmethod
    def get_buffer_info(cls) -> str:
        return "buffer_index_and_autocast_key"

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, meta: dict) -> None:
        if cls.get_buffer_info() not in meta:
            meta[cls.get_buffer_info()] = len(cls.quantization_state.buffer)
            cls.quantization_state.buffer.append(meta)

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward: bool = True) -> None:
        key = "scaling_fwd" if forward else "scaling_bwd"
        with torch.no_grad():
            for meta in cls.quantization_state.buffer:
                st = meta[key]
                amax = st.amax_history.amax(0)
                st.scale.copy_(FP8_MAX / torch.clamp(amax, min=1e-6))
                st.amax_history.copy_(st.amax_history.roll(1, 0))
                st.amax_history[0].zero_()

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip: bool) -> None:
        q = cls.quantization_state
        if q.skip is None:
            q.skip = torch.empty(1)
        q.skip.fill_(skip)

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls) -> torch.Tensor | None:
        return cls.quantization_state.skip


class autocast:  # noqa: N801 - TE's name
    def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None,
                 _graph=False) -> None:  # fmt: skip
        self.enabled, self.calibrating, self.recipe, self.group, self.graph = (
            enabled,
            calibrating,
            recipe,
            amax_reduction_group,
            _graph,
        )

    def __enter__(self):
        m = FP8GlobalStateManager
        q = m.quantization_state
        self.saved = m.get_autocast_state()
        q.fp8_enabled, q.fp8_calibration = self.enabled, self.calibrating
        q.fp8_recipe = self.recipe or Recipe()
        q.fp8_distributed_group, q.fp8_graph_capturing = self.group, self.graph
        if q.autocast_depth == 0:
            q.is_first_fp8_module = True
        q.autocast_depth += 1
        return self

    def __exit__(self, *exc) -> None:
        m = FP8GlobalStateManager
        q = m.quantization_state
        m.set_autocast_state(self.saved)
        q.autocast_depth -= 1
        if self.enabled and q.autocast_depth == 0 and not self.graph and torch.is_grad_enabled():
            m.reduce_and_update_fp8_tensors(forward=True)


_capturing = [False]


def set_capture_start() -> None:
    _capturing[0] = True


def set_capture_end() -> None:
    _capturing[0] = False


class Scaling:
    """Delayed-scaling state of ``n`` tensors (forward: the input and the weight)."""

    def __init__(self, history: int, n: int = 1) -> None:
        self.amax_history = torch.zeros(history, n)
        self.scale = torch.ones(n)


def _quantize(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.round(t * scale) / scale


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, weightmat, meta, fp8, first):
        if fp8:
            fwd = meta["scaling_fwd"]
            with torch.no_grad():
                fwd.amax_history[0, 0].copy_(x.abs().amax())
            x = _quantize(x, fwd.scale[0])
        ctx.save_for_backward(x, weightmat)
        ctx.meta, ctx.fp8, ctx.first = meta, fp8, first
        return x @ weightmat.t()

    @staticmethod
    def backward(ctx, g):
        x, weightmat = ctx.saved_tensors
        if ctx.fp8:
            with torch.no_grad():
                ctx.meta["scaling_bwd"].amax_history[0].copy_(g.abs().amax().reshape(1))
            g = _quantize(g, ctx.meta["scaling_bwd"].scale)
        if ctx.first and not _capturing[0]:
            FP8GlobalStateManager.reduce_and_update_fp8_tensors(forward=False)
        return g @ weightmat, g.t() @ x, None, None, None, None


class Linear(torch.nn.Module):
    """An FP8 linear layer with delayed scaling, weight caching and calibration, as TE's
    modules keep them."""

    def __init__(self, d_in: int, d_out: int, history: int = 4) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.fp8_meta = {
            "scaling_fwd": Scaling(history, 2),
            "scaling_bwd": Scaling(history),
            "recipe": None,
            "fp8_group": None,
        }
        self._fp8_workspaces: dict[str, torch.Tensor] = {}  # the cached FP8 weight

    def forward(self, x, is_first_microbatch=None):
        m = FP8GlobalStateManager
        q = m.quantization_state
        # TE's graph mode reads the device flag, whatever the call passed (module/linear.py)
        skip = q.skip if q.fp8_graph_capturing else None
        if skip is not None:
            is_first_microbatch = False
        fp8, first, weightmat = q.fp8_enabled, False, self.weight
        if fp8:
            if not q.fp8_graph_capturing:
                m.add_fp8_tensors_to_global_buffer(self.fp8_meta)
            first = m.is_first_fp8_module()
            weightmat = self._fp8_weight(is_first_microbatch, skip)
        elif q.fp8_calibration:  # high precision, amaxes recorded (quantizer.calibrate)
            with torch.no_grad():
                amaxes = torch.stack([x.abs().amax(), self.weight.abs().amax()])
                self.fp8_meta["scaling_fwd"].amax_history[0].copy_(amaxes)
        return _Linear.apply(x, self.weight, weightmat, self.fp8_meta, fp8, first)

    @torch.no_grad()
    def _fp8_weight(self, is_first_microbatch: bool | None, skip: torch.Tensor | None):
        """The weight cast to FP8: anew (its amax recorded) for None (no cache) and True
        (the cache refreshed), the cache for False; in graph mode as the device flag says."""
        fwd = self.fp8_meta["scaling_fwd"]
        amax = self.weight.abs().amax()
        cast = _quantize(self.weight.detach(), fwd.scale[1])
        if is_first_microbatch is None:
            fwd.amax_history[0, 1].copy_(amax)
            return cast
        cache = self._fp8_workspaces.get("weight")
        if skip is not None:  # decided on the device: the graph replays both ways
            if cache is None:
                cache = self._fp8_workspaces["weight"] = torch.zeros_like(cast)
            keep = skip[0].bool()
            cache.copy_(torch.where(keep, cache, cast))
            fwd.amax_history[0, 1].copy_(torch.where(keep, fwd.amax_history[0, 1], amax))
        elif is_first_microbatch or cache is None:
            fwd.amax_history[0, 1].copy_(amax)
            if cache is None:
                cache = self._fp8_workspaces["weight"] = cast
            else:
                cache.copy_(cast)
        return cache


def reset() -> None:
    FP8GlobalStateManager.quantization_state = QState()
    _capturing[0] = False


def install(monkeypatch) -> types.SimpleNamespace:
    """Put the stand-in in ``sys.modules`` under TransformerEngine's module names."""
    import sys

    reset()
    quant = types.ModuleType("transformer_engine.pytorch.quantization")
    quant.FP8GlobalStateManager, quant.autocast = FP8GlobalStateManager, autocast
    graph = types.ModuleType("transformer_engine.pytorch.graph")
    graph.set_capture_start, graph.set_capture_end = set_capture_start, set_capture_end
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization", quant)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.graph", graph)
    return types.SimpleNamespace(autocast=autocast, Linear=Linear, Recipe=Recipe)
