"""megatron-core GPTModel (TransformerEngine layer spec): eager, megatron's own CUDA graphs and
tgraph's, side by side in one process.

    python scripts/bench_megatron_te.py --fp8 none --out docs/benchmarks
    python scripts/bench_megatron_te.py --fp8 delayed --out docs/benchmarks

GPTModel built with ``get_gpt_layer_with_transformer_engine_spec()``, bf16 parameters
(``Float16Module``) in megatron DDP (fp32 ``main_grad``), megatron's own optimizer
(``get_megatron_optimizer``, adam, ``optimizer_cuda_graph=True`` in every mode: the capturable
FusedAdam tgraph's optimizer graphs need, so losses differ by the graphs only) and its own
schedule (``tgraph.integrations.megatron.forward_backward``); ``--fp8 delayed`` sets megatron's
FP8 fields (hybrid, delayed scaling). Every mode builds its model afresh from the same seed (the
same initial weights) and trains on the same batches. Modes:

* ``eager``: megatron as it is;
* ``tgraph_layer``: tgraph per-layer graphs (``enable_layer_graphs``, strict: a fallback is an
  error), megatron's eager optimizer step;
* ``tgraph_layer_opt``: per-layer graphs plus ``MegatronOptimizerGraph``;
* ``tgraph_full``: ``tgraph.FullIterationGraph`` around forward_backward and ``graph_safe_step``;
* ``mcore_te_graphs``: ``cuda_graph_impl="transformer_engine"``: ``TECudaGraphHelper``'s
  ``create_cudagraphs()`` after ``cuda_graph_warmup_steps`` eager steps, as megatron's
  training loop does;
* ``mcore_local_graphs``: ``cuda_graph_impl="local"``: megatron's ``CudaGraphManager`` records
  the first step and its schedule creates the graphs at that step's end.

Per mode: median ms per step over the steps after ``--warmup`` (CUDA events), peak MiB since
the mode started (model, optimizer state and capture included), max |loss - eager loss| over
the steps both ran. A mode that fails records its error; a mode over ``--mode-seconds`` stops
early (``truncated``).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (  # noqa: E402
    StepTimer,
    environment,
    environment_markdown,
    fresh_memory,
    markdown_table,
    peak_memory_mib,
    summarize,
    write_outputs,
)

import tgraph  # noqa: E402

MODES = (
    "eager",
    "tgraph_layer",
    "tgraph_layer_opt",
    "tgraph_full",
    "mcore_te_graphs",
    "mcore_local_graphs",
)
IMPL = {"mcore_te_graphs": "transformer_engine", "mcore_local_graphs": "local"}


def batches(a: argparse.Namespace) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    return [
        [tuple(torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).cuda() for _ in range(2))]
        for _ in range(a.steps)
    ]


def build(mode: str, a: argparse.Namespace):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from tgraph.integrations import megatron as tm

    model = tm.build_gpt(
        num_layers=a.layers,
        hidden_size=a.hidden,
        num_attention_heads=a.hidden // 64,
        vocab_size=a.vocab,
        seq_length=a.seq,
        spec="te",
        bf16=True,
        fp8=None if a.fp8 == "none" else a.fp8,
        cuda_graph_impl=IMPL.get(mode, "none"),
    )
    cfg = OptimizerConfig(
        optimizer="adam",
        lr=a.lr,
        bf16=True,
        params_dtype=torch.bfloat16,
        clip_grad=1.0,
        optimizer_cuda_graph=True,
    )
    return model, get_megatron_optimizer(cfg, [model])


def cleanup(mode: str, state: dict) -> None:
    """Undo what a mode left in process-wide state, also after a failure."""
    from megatron.core.transformer import cuda_graphs

    if mode.startswith("tgraph"):
        tgraph.reset()
        if state.get("model") is not None and mode != "tgraph_full":
            with contextlib.suppress(Exception):
                tgraph.disable(state["model"])
    if mode == "mcore_te_graphs":
        helper = state.get("helper")
        if helper is not None and helper.graphs_created():
            with contextlib.suppress(Exception):
                helper.delete_cuda_graphs()
        cuda_graphs._set_capture_end()
    if mode == "mcore_local_graphs":
        with contextlib.suppress(Exception):
            cuda_graphs.delete_cuda_graphs()
        cuda_graphs._set_capture_end()
    torch.cuda.set_stream(torch.cuda.default_stream())  # CudaGraphManager moves it to a side one


def run_mode(mode: str, a: argparse.Namespace, data: list) -> dict:
    from tgraph.integrations import megatron as tm

    dev = torch.device("cuda")
    state: dict = {}
    out: dict = {"mode": mode}
    since = fresh_memory(dev)
    try:
        model, mopt = build(mode, a)
        state["model"] = model
        torch.cuda.synchronize()  # the local mode's manager switched streams while building

        def fwd_bwd(mb):
            return tm.forward_backward(model, mb, attention_mask=False)

        def eager_step(mb):
            mopt.zero_grad()
            loss = fwd_bwd(mb)
            mopt.step()
            return loss.detach()

        step = eager_step
        if mode in ("tgraph_layer", "tgraph_layer_opt"):
            tm.enable_layer_graphs(model, strict=True)
        if mode == "tgraph_layer_opt":
            opt_graph = tm.MegatronOptimizerGraph(mopt)

            def step(mb):
                mopt.zero_grad()
                loss = fwd_bwd(mb)
                opt_graph.step(loss)
                return loss.detach()

        if mode == "tgraph_full":
            tm.make_graph_safe(mopt)

            def full_step(mb):
                loss = fwd_bwd(mb)
                tm.graph_safe_step(mopt)
                return loss.detach()

            graph = tgraph.FullIterationGraph(full_step, warmup_steps=3)

            def step(mb):
                mopt.zero_grad()
                return graph(mb)

        if mode == "mcore_te_graphs":
            from tgraph.integrations.megatron_te import te_graph_helper

            state["helper"] = te_graph_helper(
                model, seq_length=a.seq, micro_batch_size=a.batch, optimizers=[mopt]
            )
        from megatron.core.utils import get_model_config

        capture_at = get_model_config(model).cuda_graph_warmup_steps  # as megatron's loop
        timer, losses, t0 = StepTimer(dev), [], time.perf_counter()
        for i, mb in enumerate(data):
            if time.perf_counter() - t0 > a.mode_seconds:
                out["truncated"] = f"stopped after {i} steps (> {a.mode_seconds} s)"
                break
            if mode == "mcore_te_graphs" and i == capture_at:
                c0 = time.perf_counter()
                state["helper"].create_cudagraphs()
                out["capture_s"] = time.perf_counter() - c0
            if i >= a.warmup:
                timer.start()
            losses.append(step(mb).float().clone())
            if i >= a.warmup:
                timer.stop()
            if mode in ("tgraph_layer", "tgraph_layer_opt") and i == 0:
                c0 = time.perf_counter()
                out["capture_report"] = str(tgraph.create_graphs())
                out["capture_s"] = time.perf_counter() - c0
        out.update(summarize(timer.times_ms()))
        out["peak_mib"] = peak_memory_mib(dev, since)
        out["losses"] = torch.stack(losses).cpu()
        if mode == "tgraph_full":
            out["skipped_steps"] = graph.skipped_steps
    except Exception as exc:  # one failing mode is recorded, never a number
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=12)
    finally:
        with contextlib.suppress(Exception):
            cleanup(mode, state)
        state.clear()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512, help="hidden size (heads of 64)")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="micro-batch size (one micro-batch)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--fp8", default="none", choices=["none", "delayed"])
    p.add_argument("--steps", type=int, default=20, help="steps per mode (all compared)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps (capture in them)")
    p.add_argument("--mode-seconds", type=float, default=60.0, help="per-mode time bound")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    p.add_argument("--port", type=int, default=29531, help="MASTER_PORT of the 1-rank group")
    p.add_argument("--out", default=None, help="folder for bench_megatron_te_<fp8>.json/.md")
    a = p.parse_args()
    if a.warmup >= a.steps:
        p.error("--warmup must be below --steps")
    from tgraph.integrations import megatron as tm

    tm.init_single_gpu(port=a.port)
    data = batches(a)
    results = []
    for mode in a.modes.split(","):
        r = run_mode(mode, a, data)
        results.append(r)
        brief = {k: v for k, v in r.items() if k not in ("losses", "traceback")}
        print(mode, brief, flush=True)
        if "traceback" in r:
            print(r["traceback"], flush=True)
    eager = next((r for r in results if r["mode"] == "eager" and "losses" in r), None)
    rows = []
    for r in results:
        if "losses" in r and eager is not None:
            n = min(len(r["losses"]), len(eager["losses"]))
            diff = (r["losses"][:n] - eager["losses"][:n]).abs().max().item()
            r["max_loss_diff_vs_eager"] = diff
            r["loss_bitwise_equal"] = bool(torch.equal(r["losses"][:n], eager["losses"][:n]))
            if r.get("ms_median") and eager.get("ms_median"):
                r["ratio_vs_eager"] = r["ms_median"] / eager["ms_median"]
        rows.append(
            [
                r["mode"],
                r.get("ms_median"),
                r.get("ratio_vs_eager"),
                r.get("peak_mib"),
                r.get("capture_s"),
                r.get("max_loss_diff_vs_eager", r.get("error")),
            ]
        )
    for r in results:
        if "losses" in r:
            r["losses"] = r["losses"].tolist()
    env = environment(torch.device("cuda"))
    import megatron.core
    import transformer_engine

    env["transformer_engine"] = transformer_engine.__version__
    env["megatron_core"] = getattr(megatron.core, "__version__", None)
    table = markdown_table(
        ["mode", "ms/step", "x eager", "peak MiB", "capture s", "max |loss - eager|"], rows
    )
    md = (
        f"{environment_markdown(env)}, TE {env['transformer_engine']}, megatron-core "
        f"{env['megatron_core']}\n\nGPTModel (TE spec) {a.layers} layers, hidden {a.hidden}, "
        f"seq {a.seq}, batch {a.batch}, vocab {a.vocab}, bf16, fp8 {a.fp8}; "
        f"{a.steps} steps, median over the last {a.steps - a.warmup}\n\n" + table
    )
    print(md)
    if a.out:
        payload = {"env": env, "args": vars(a), "results": results}
        write_outputs(a.out, f"bench_megatron_te_{a.fp8}", payload, md)


if __name__ == "__main__":
    main()
