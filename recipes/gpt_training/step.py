"""One training step in the configured graph mode: all of the recipe's graph-mode code.

``--graph none`` runs the step eagerly. ``layer`` graphs every transformer block (the model
spec's ``enable_graphs``: ``tgraph.enable``, or ``graph_layers`` for transformers models): the
first step runs eagerly and is recorded, together with one validation forward, then
``tgraph.create_graphs()`` captures and later calls replay. ``model`` (where the recipe offers
it) does the same with the whole model as the one graphed unit (``enable_model_graph``: its
forward, embeddings to loss, and its backward as one graph each). ``layer+opt`` (where the
recipe's config offers it) adds clipping and AdamW as one graph (``tgraph.OptimizerGraph``). ``full`` captures
forward, backward, the all-reduce and AdamW as one graph (``tgraph.FullIterationGraph``) after
``FULL_WARMUP`` eager calls. The three modes run the same eager step function, so they compute
the same numbers.

Data parallelism depends on the mode too. Eager and per-layer graphs use DDP: per-layer graphs
return parameter gradients through autograd, so DDP's hooks fire as usual. A full-iteration graph
holds the whole step, and DDP's reducer (Python-side bucketing, rebuilt after the first
iterations) does not belong in one: the step all-reduces one flat gradient buffer itself, inside
the graph.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tgraph
from tgraph.backend import resolve_backend

from .config import TrainConfig
from .parallel import DistEnv, all_finite, synchronize


class StepSpec(Protocol):
    """What a step asks of the model's spec (``gpt_training.spec.ModelSpec`` has it; the spec
    calls :func:`make_step`, so this module does not import it)."""

    clip_in_optimizer_order: bool

    def loss(self, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    def whole_step_loss(
        self, net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> torch.Tensor: ...

    def enable_graphs(self, net: torch.nn.Module, backend: str, compile: bool) -> None: ...  # noqa: A002

    def enable_model_graph(self, net: torch.nn.Module, backend: str, compile: bool) -> None: ...  # noqa: A002

    def disable_graphs(self, net: torch.nn.Module) -> None: ...


logger = logging.getLogger("train_gpt")  # the recipe's one logger name in every module

FULL_WARMUP = 3  # eager calls of the full-iteration step before its capture (tgraph's default)


class StepOutput(NamedTuple):
    loss: torch.Tensor | None
    """The step's loss (a detached device tensor, not read on the host; safe to keep: with
    --graph full a clone of the graph's output), or None: --on-nonfinite skip skipped the
    update."""
    capture_s: float | None
    """Seconds this call spent capturing graphs; None when it captured none."""


class TrainStep:
    """Call once per optimizer step: ``step(x, y) -> StepOutput``. Build it with :func:`make_step`.

    Attributes:
        net: what the forward runs through: the model, or its DDP wrapper (eager and
            per-layer graphs under torchrun); with ``--compile`` and ``--graph none`` or
            ``full``, compiled in place (``nn.Module.compile``; the graphed units of the other
            modes compile inside tgraph: ``enable(compile=True)``).
        backend: the graph backend in use ("cuda" or "emulated"), None when eager.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        env: DistEnv,
        record_eval: Callable[[], object],
        spec: StepSpec,
    ) -> None:
        self.cfg, self.opt, self.env, self.spec = cfg, opt, env, spec
        self.params = list(model.parameters())
        if spec.clip_in_optimizer_order:  # the order OptimizerGraph sums the norm in
            self.params = [p for g in opt.param_groups for p in g["params"]]
        self.layered = cfg.graph in ("layer", "layer+opt", "model")  # tgraph.create_graphs()
        self.loss_fn = spec.whole_step_loss if cfg.graph == "full" else spec.loss
        self.record_eval = record_eval
        self.calls = 0
        self.net: torch.nn.Module = model
        if env.world_size > 1 and cfg.graph != "full":
            self.net = DDP(
                model, device_ids=[env.device.index] if env.device.type == "cuda" else None
            )
        elif env.world_size > 1:
            for p in self.params:
                dist.broadcast(p.data, src=0)  # what DDP's constructor does for the others
        self.full_graph: tgraph.FullIterationGraph | None = None
        self.opt_graph: tgraph.OptimizerGraph | None = None
        compiled = getattr(cfg, "compile", False)  # --compile (CompileConfig), where offered
        if cfg.graph == "model":
            spec.enable_model_graph(self.net, cfg.backend, compile=compiled)
        elif self.layered:
            spec.enable_graphs(self.net, cfg.backend, compile=compiled)
        elif compiled:  # eager or the full-iteration graph: the whole forward compiled, in
            self.net.compile()  # place (no wrapper module for the full step's module hooks)
        if cfg.graph == "layer+opt":
            self.opt_graph = tgraph.OptimizerGraph(
                opt, clip_grad_norm=cfg.grad_clip or None, skip_nonfinite=False, backend=cfg.backend
            )
        elif cfg.graph == "full":
            self.full_graph = tgraph.FullIterationGraph(
                lambda batch: self.eager_step(*batch), warmup_steps=FULL_WARMUP, backend=cfg.backend
            )
        self.backend: str | None = None
        if cfg.graph != "none":
            with contextlib.suppress(ValueError):  # enable / FullIterationGraph report bad values
                self.backend = resolve_backend(cfg.backend, env.device)
        if self.backend == "emulated" and env.is_main:
            logger.info(
                "graphs are emulated (no GPU): tgraph's CPU stand-in for CUDA graphs runs the "
                "same record/capture/replay code and catches the same bugs, but is not faster "
                "than eager; the speed-up needs a GPU"
            )

    def eager_step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step, run eagerly (or recorded, or captured); returns the loss, or None
        when --on-nonfinite skip skipped it."""
        cfg, env, params = self.cfg, self.env, self.params
        if self.opt_graph is None:  # (OptimizerGraph owns the .grad tensors and zeroes them)
            self.opt.zero_grad(set_to_none=True)
        loss = self.loss_fn(self.net, x, y)
        loss.backward()
        if self.opt_graph is not None:  # clips, steps and zeroes the gradients
            self.opt_graph.step(loss.detach())
            return loss.detach()
        if env.world_size > 1 and cfg.graph == "full":
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # one all-reduce in all
            dist.all_reduce(flat)
            flat /= env.world_size
            for p, chunk in zip(params, flat.split([p.numel() for p in params])):
                p.grad.copy_(chunk.view_as(p))
        if cfg.on_nonfinite == "skip":
            # The one host sync per step that skipping costs (never with --graph full). The
            # gradients are all-reduced already; the flag is too, so every rank skips together.
            grads = [p.grad for p in params if p.grad is not None]
            if not all_finite([loss.detach(), *grads], env):
                return None
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=True)
        self.opt.step()
        return loss.detach()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        """Run one optimizer step; the call that captures graphs also reports their seconds
        (``--graph layer``: the first; ``full``: call ``FULL_WARMUP + 1``)."""
        t0 = time.perf_counter()
        first = self.calls == 0
        self.calls += 1
        if self.full_graph is None:
            loss = self.eager_step(x, y)
        else:
            loss = self.full_graph((x, y))
            if self.calls == FULL_WARMUP + 1:
                synchronize(self.env.device)  # this call captured the graph and replayed it once
                return StepOutput(loss, time.perf_counter() - t0)
        if first and self.layered:
            # Record one validation forward too (eval mode, no grad, validation's batch shape),
            # so create_graphs() captures a graph for it and validation replays instead of
            # falling back to eager with a warning. Its loss is discarded; it draws no RNG.
            self.record_eval()
            # the recorded step's gradients would add their size to the peak of creating the
            # graphs; the next step drops them anyway
            if self.opt_graph is None:
                self.opt.zero_grad(set_to_none=True)
            report = tgraph.create_graphs()  # logs the report
            return StepOutput(loss, report.seconds)
        return StepOutput(loss, None)

    def report(self) -> dict:
        """Extra entries of the metrics lines and the summary: with per-layer graphs, the calls
        of graphed layers that ran eagerly instead of replaying (``tgraph.eager_calls``)."""
        return {"eager_calls": tgraph.eager_calls()} if self.layered else {}

    def close(self) -> None:
        """Give the model back without per-layer graphs (the end of a successful run)."""
        if self.layered:
            self.spec.disable_graphs(self.net)


def make_step(
    cfg: TrainConfig,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    env: DistEnv,
    record_eval: Callable[[], object],
    spec: StepSpec,
) -> TrainStep:
    """The training step of ``cfg.graph``, with the data parallelism that mode needs.

    Args:
        cfg: the graph mode and backend, gradient clipping, non-finite handling.
        model: the model on ``env.device``, every rank's copy identical or about to be made so
            (DDP's constructor or a broadcast from rank 0, collectives every rank must reach).
        opt: its optimizer, learning rates in device tensors (``optim.make_optimizer``).
        env: rank, world size and device.
        record_eval: runs one validation forward of ``model``; ``--graph layer`` calls it after
            the first (recorded) step so validation gets its own graphs.
        spec: the model's spec (``gpt_training.spec``): its loss and how its layers are graphed.

    Returns:
        The step; ``step.close()`` removes per-layer graphs at the end.

    Raises:
        ValueError: a backend tgraph cannot use on ``env.device`` (from tgraph).
    """
    return TrainStep(cfg, model, opt, env, record_eval, spec)
