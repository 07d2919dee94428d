"""megatron-core's optimizer, schedule and step for the shared trainer (``recipes/train_megatron_gpt.py``).

:class:`MegatronOptim` holds what a megatron-core user builds: ``get_megatron_optimizer(
OptimizerConfig(optimizer="adam", ...), [model])`` and its ``OptimizerParamScheduler``; its
``state_dict()`` (both of theirs) is the optimizer part of ``trainer.pt``. :class:`MegatronStep`
is one iteration in the four graph modes of the recipe's docstring: megatron's
``forward_backward`` (``tgraph.integrations.megatron``), then ``mopt.step()`` eagerly,
``MegatronOptimizerGraph`` or, with ``--graph full``, both inside one ``FullIterationGraph``.
Gradients live in megatron DDP's ``main_grad`` buffers, synchronized by ``forward_backward``
(``finish_grad_sync``): no torch DDP and no all-reduce of the trainer's own.
"""

from __future__ import annotations

import time

import torch

import tgraph
from tgraph.backend import resolve_backend

from .parallel import DistEnv, all_finite, synchronize
from .step import FULL_WARMUP, StepOutput

OPTIMIZER = "megatron get_megatron_optimizer adam"


def capturable_adam(cfg) -> bool:
    """Whether megatron's inner AdamW is built capturable (``optimizer_cuda_graph``): always for
    the graph-stepped modes, in the eager ones with ``--optimizer-cuda-graph``."""
    return cfg.optimizer_cuda_graph or cfg.graph in ("layer+opt", "full")


def _torch_part(state: dict) -> dict:
    """The torch optimizer's state dict inside a megatron optimizer's: the whole of an
    ``FP32Optimizer``'s, ``["optimizer"]`` of a ``Float16OptimizerWithFloat16Params``' (which
    keeps its fp32 masters beside it)."""
    return state if "param_groups" in state else state["optimizer"]


def _with_groups(state: dict, groups: list[dict]) -> dict:
    """``state`` with its torch part's ``param_groups`` replaced (:func:`_torch_part`)."""
    if "param_groups" in state:
        return {**state, "param_groups": groups}
    return {**state, "optimizer": {**state["optimizer"], "param_groups": groups}}


def restore_group_tensors(built: list[dict], loaded: list[dict]) -> None:
    """Put a loaded optimizer's group tensors back where this run keeps them.

    torch's ``load_state_dict`` keeps a param group's values as saved. TransformerEngine's
    capturable FusedAdam keeps its lr (saved as a float: ``state_dict``) and its step count
    (loaded on the host) in the group as device tensors its kernel takes: an lr that was a
    tensor when built is filled in place, and a loaded tensor moves to its parameters' device.
    """
    for was, g in zip(built, loaded, strict=True):
        for k, v in g.items():
            if k == "params" or not g["params"]:
                continue
            if isinstance(was.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
                g[k] = was[k].fill_(v)
            elif isinstance(v, torch.Tensor):
                g[k] = v.to(g["params"][0].device)


class MegatronOptim:
    """megatron's optimizer (``mopt``) and learning-rate scheduler (``sched``), as one object."""

    def __init__(self, model: torch.nn.Module, cfg) -> None:
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.capturable = capturable_adam(cfg)
        config = OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.beta1,
            adam_beta2=cfg.beta2,
            clip_grad=cfg.grad_clip,
            # --bf16: Float16OptimizerWithFloat16Params (fp32 masters); else megatron's
            # FP32Optimizer; no loss scaler either way
            bf16=cfg.bf16,
            params_dtype=torch.bfloat16 if cfg.bf16 else torch.float32,
            fp16=False,
            # capturable inner AdamW: what the graph modes step (make_graph_safe would switch it
            # anyway; building it so also serves an inner optimizer it cannot switch, e.g. TE's)
            optimizer_cuda_graph=self.capturable,
        )
        self.mopt = get_megatron_optimizer(config, [model])
        # The cosine's horizon is this start's --steps; a resume takes the checkpoint's (the
        # run's first start: use_checkpoint_opt_param_scheduler, megatron's default).
        self.sched = OptimizerParamScheduler(
            self.mopt,
            init_lr=0.0,
            max_lr=cfg.lr,
            min_lr=cfg.min_lr,
            lr_warmup_steps=min(cfg.warmup_steps, cfg.steps - 1),  # megatron: < decay steps
            lr_decay_steps=cfg.steps,
            lr_decay_style="cosine",
            start_wd=cfg.weight_decay,
            end_wd=cfg.weight_decay,
            wd_incr_steps=cfg.steps,
            wd_incr_style="constant",
        )  # sets the learning rate of step 0 (and weight decay 0 on the wd_mult=0 groups)

    @property
    def param_groups(self) -> list[dict]:
        return self.mopt.param_groups

    def lr(self) -> float:
        """The scheduler's learning rate for the next step, computed on the host (no sync)."""
        return float(self.sched.get_lr(self.mopt.param_groups[0]))

    def state_dict(self) -> dict:
        """``mopt.state_dict()`` (learning rates as floats: the graph modes hold device tensors
        there) and ``sched.state_dict()``."""
        inner = self.mopt.state_dict()
        groups = [
            {**g, "lr": float(g["lr"])} if isinstance(g.get("lr"), torch.Tensor) else g
            for g in _torch_part(inner)["param_groups"]
        ]
        return {
            "megatron": _with_groups(inner, groups),
            "scheduler": self.sched.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s. The inner AdamW stays as this run built it (capturable
        or not: the graph mode may change on resume; ``load_state_dict`` then puts its step
        counts on the device or leaves them on the host accordingly)."""
        inner = state["megatron"]
        groups = [
            {**g, "capturable": self.capturable} if "capturable" in g else dict(g)
            for g in _torch_part(inner)["param_groups"]
        ]
        built = [dict(g) for g in self.mopt.param_groups]
        self.mopt.load_state_dict(_with_groups(inner, groups))
        restore_group_tensors(built, self.mopt.param_groups)
        self.sched.load_state_dict(state["scheduler"])  # sets this step's lr and weight decay


class MegatronStep:
    """One training iteration of megatron-core in ``cfg.graph``'s mode (see the module docstring).

    ``step(x, y)`` splits the batch into ``cfg.micro_batches`` micro-batches for megatron's
    schedule. The scheduler steps after every iteration, except after an eager one that did not
    update (megatron-LM's rule); the graph-stepped modes cannot know without a host sync and step
    it always (their skipped steps are counted on the device: ``report()``).
    """

    def __init__(self, cfg, model, opt: MegatronOptim, env: DistEnv, record_eval) -> None:
        from tgraph.integrations import megatron as tm

        self.tm, self.cfg, self.model, self.opt, self.env = tm, cfg, model, opt, env
        self.net = model  # megatron DDP (build_gpt): forward_backward synchronizes main_grad
        self.masked = tm.wants_attention_mask(model)  # TE's spec attends causally by itself
        self.record_eval = record_eval
        self.layered = cfg.graph in ("layer", "layer+opt")
        self.calls = 0
        self.eager_skipped = 0
        self.last_norm: torch.Tensor | float | None = None
        self.opt_graph = self.full_graph = None
        self._generators = {id(g) for g in tgraph.rng.extra_generators()}
        if self.layered:
            tm.enable_layer_graphs(model, backend=cfg.backend)
        if cfg.graph == "layer+opt":  # capturable AdamW; skips non-finite steps on the device
            self.opt_graph = tm.MegatronOptimizerGraph(
                opt.mopt, skip_nonfinite=True, backend=cfg.backend
            )
        elif cfg.graph == "full":
            tm.make_graph_safe(opt.mopt)  # refuses what needs the host every step
            self.full_graph = tgraph.FullIterationGraph(
                self._full_step, warmup_steps=FULL_WARMUP, skip_nonfinite=True, backend=cfg.backend
            )
        self.backend = None if cfg.graph == "none" else resolve_backend(cfg.backend, env.device)

    def _full_step(self, microbatches):
        loss = self.tm.forward_backward(self.model, microbatches, attention_mask=self.masked)
        norm = self.tm.graph_safe_step(self.opt.mopt)  # norm, clipping, AdamW: no host sync
        return loss.detach(), norm

    def _eager_step(self, microbatches) -> torch.Tensor | None:
        mopt = self.opt.mopt
        mopt.zero_grad()
        loss = self.tm.forward_backward(
            self.model, microbatches, attention_mask=self.masked
        )  # fwd/bwd, grad sync
        if self.opt_graph is not None:
            self.opt_graph.step(loss)
            return loss.detach()
        if self.cfg.on_nonfinite == "skip":  # main_grad is all-reduced: every rank agrees
            grads = [p.main_grad for p in self.model.parameters() if hasattr(p, "main_grad")]
            if not all_finite([loss.detach(), *grads], self.env):
                self.eager_skipped += 1
                return None
        updated, self.last_norm, _ = mopt.step()  # megatron eager: host syncs inside
        if not updated:
            self.eager_skipped += 1
            return None
        return loss.detach()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> StepOutput:
        t0 = time.perf_counter()
        self.calls += 1
        m = self.cfg.micro_batches
        microbatches = list(zip(x.chunk(m), y.chunk(m)))
        capture_s = None
        if self.full_graph is not None:
            loss, self.last_norm = self.full_graph(microbatches)
            loss = loss.clone()  # the graph's output buffer is overwritten by the next replay
            if self.calls == FULL_WARMUP + 1:  # captured, then replayed once
                synchronize(self.env.device)
                capture_s = time.perf_counter() - t0
        else:
            loss = self._eager_step(microbatches)
            if self.opt_graph is not None and self.calls == 2:  # captured at its second step
                capture_s = self.opt_graph.capture_seconds
        if loss is not None or self.cfg.graph in ("layer+opt", "full"):
            self.opt.sched.step(1)
        if self.calls == 1 and self.layered:
            self.record_eval()  # validation's forward gets its own graphs (see step.TrainStep)
            capture_s = tgraph.create_graphs().seconds  # logs the report
        return StepOutput(loss, capture_s)

    def report(self) -> dict:
        """The last gradient norm and the steps that changed nothing (graph modes: read on the
        device, one sync)."""
        graph = self.opt_graph or self.full_graph
        norm = self.opt_graph.grad_norm if self.opt_graph is not None else self.last_norm
        return {
            "grad_norm": None if norm is None else float(norm),
            "skipped_steps": graph.skipped_steps if graph is not None else self.eager_skipped,
            "optimizer": OPTIMIZER,
            "capturable_adam": self.opt.capturable,
            **({"eager_calls": tgraph.eager_calls()} if self.layered else {}),
        }

    def close(self) -> None:
        """Drop the graphs and give the model back without per-layer graphs."""
        for graph in (self.full_graph, self.opt_graph):
            if graph is not None:
                graph.reset()
        if self.layered:
            tgraph.reset()
            tgraph.disable(self.model)
        for g in tgraph.rng.extra_generators():
            if id(g) not in self._generators:  # megatron's RNG tracker (enable_layer_graphs)
                tgraph.unregister_generator(g)
