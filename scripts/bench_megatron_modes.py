"""The megatron-core modes of the training benchmark (scripts/bench_train.py): megatron's GPTModel
of the same dims as the toy, eager, with megatron's own CUDA graphs, and under tgraph's per-layer
and whole-step graphs; and megatron's own optimizer (``get_megatron_optimizer``) in those modes.
Every mode skips itself when megatron-core is not importable or the cell is not fp32 on CUDA.

Each mode returns (per-step ms, final loss tensor, capture seconds or None, note).
"""

from __future__ import annotations

import contextlib
import time

from bench_common import Skip, synchronize
from bench_train_setup import (
    LR,
    VOCAB,
    Setup,
    drive,
    drive_whole_step,
    make_optimizer,
    need_cuda,
)

import tgraph


def megatron_model(s: Setup, variant: str):
    """(tgraph's megatron integration, a megatron-core GPTModel + DDP of the cell's dims), or
    Skip when megatron-core is missing or the cell is not fp32 on CUDA."""
    need_cuda(s)
    try:
        from tgraph.integrations import megatron as tm

        tm._transformer_layer_class()
    except ImportError as exc:
        raise Skip(f"megatron-core not importable ({exc}); pip install 'tgraph[megatron]'") from exc
    if s.dtype != "fp32":
        raise Skip("megatron modes are measured in fp32 only")
    tm.init_single_gpu()
    d = s.dims
    model = tm.build_gpt(
        num_layers=d["n_layer"],
        hidden_size=d["n_embd"],
        num_attention_heads=d["n_head"],
        vocab_size=VOCAB,
        seq_length=d["seq"],
        cuda_graph_impl="local" if variant == "local" else "none",
    )
    return tm, model


def mode_megatron(s: Setup, variant: str):
    """megatron-core GPTModel + its DDP (main_grad), same dims; fused AdamW on main_grad.

    variant: "none" (megatron eager), "local" (megatron-core's own per-layer graphs),
    "tgraph_layer" (tgraph per-layer graphs on megatron's TransformerLayers) or
    "tgraph_full" (forward_backward_func + optimizer step in one tgraph.FullIterationGraph).
    """
    tm, model = megatron_model(s, variant)
    params = list(model.parameters())
    opt = make_optimizer(params, s.device)

    def train_step(batch):
        loss = tm.forward_backward(model, [batch])
        tm.optimizer_step(opt, params)  # on megatron DDP's fp32 main_grad buffers
        return loss.detach()

    capture = None
    note = "megatron-core GPTModel (local spec) + megatron DDP, own init: parity n/a"
    try:
        if variant == "tgraph_full":
            graph = tgraph.FullIterationGraph(train_step, warmup_steps=s.warmup - 1)
            times, loss, capture = drive_whole_step(s, graph)
            return times, loss, capture, note
        if variant.startswith("tgraph_layer"):  # _hooks: gradients through DDP's hooks
            tm.enable_layer_graphs(model, main_grad_fusion=variant == "tgraph_layer")
        train_step(s.batch(0))  # recorded / warmup iteration
        synchronize(s.device)
        t0 = time.perf_counter()
        if variant.startswith("tgraph_layer"):
            note += f"; {tgraph.create_graphs()}"
        elif variant == "local":
            from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

            _CudagraphGlobalRecord.create_cudagraphs()
        synchronize(s.device)
        capture = time.perf_counter() - t0 if variant != "none" else None
        times, loss = drive(s, lambda x, y: train_step((x, y)), start=1)
        return times, loss, capture, note
    finally:
        if variant.startswith("tgraph_layer"):
            tgraph.reset()
            tgraph.disable(model)
        if variant == "local":
            with contextlib.suppress(Exception):
                from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

                delete_cuda_graphs()


def mode_megatron_optimizer(s: Setup, variant: str):
    """The megatron-core harness: GPTModel + megatron DDP + megatron's OWN optimizer,
    ``get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [ddp])`` (clip_grad 1.0).

    variant: "none" (megatron eager, ``opt.step()`` with its host syncs), "local" (megatron-core's
    own per-layer graphs, same optimizer), "tgraph_layer_opt" (tgraph per-layer graphs plus
    tgraph.integrations.megatron.MegatronOptimizerGraph), "tgraph_full" (forward_backward and
    graph_safe_step in one FullIterationGraph(skip_nonfinite=True)).
    """
    tm, model = megatron_model(s, variant)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    capturable = variant == "none_capturable"  # megatron eager, capturable AdamW (see below)
    mopt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=LR, optimizer_cuda_graph=capturable), [model]
    )
    note = "megatron-core GPTModel + DDP + get_megatron_optimizer(adam, lr=1e-3, clip_grad=1.0)"
    if capturable:
        note += ", optimizer_cuda_graph=True (the inner AdamW the tgraph modes step)"
    capture = None
    try:
        if variant == "tgraph_full":
            tm.make_graph_safe(mopt)

            def full_step(batch):
                loss = tm.forward_backward(model, [batch])
                tm.graph_safe_step(mopt)
                return loss.detach()

            graph = tgraph.FullIterationGraph(
                full_step, warmup_steps=s.warmup - 1, skip_nonfinite=True
            )
            times, loss, capture = drive_whole_step(s, graph)
            return times, loss, capture, note + f"; skipped {graph.skipped_steps}"
        opt_graph = None
        if variant == "tgraph_layer_opt":
            tm.enable_layer_graphs(model)
            opt_graph = tm.MegatronOptimizerGraph(mopt, skip_nonfinite=True)

        def train_step(x, y):
            mopt.zero_grad()
            loss = tm.forward_backward(model, [(x, y)])  # zero_grad_buffer, fwd/bwd, grad sync
            if opt_graph is None:
                mopt.step()
            else:
                opt_graph.step(loss)
            return loss.detach()

        train_step(*s.batch(0))  # recorded / warmup iteration
        synchronize(s.device)
        t0 = time.perf_counter()
        if variant == "tgraph_layer_opt":
            note += f"; {tgraph.create_graphs()}"
        elif variant == "local":
            from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

            _CudagraphGlobalRecord.create_cudagraphs()
        train_step(*s.batch(1))  # the optimizer graph's capture
        synchronize(s.device)
        capture = time.perf_counter() - t0 if not variant.startswith("none") else None
        times, loss = drive(s, train_step, start=2)
        return times, loss, capture, note
    finally:
        if variant == "tgraph_layer_opt":
            tgraph.reset()
            tgraph.disable(model)
        if variant == "local":
            with contextlib.suppress(Exception):
                from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

                delete_cuda_graphs()
