"""Training-step benchmark: eager vs. the CUDA-graph peers vs. tgraph, side by side, one process.

Every mode trains a deep copy of ONE toy GPT (same initial weights) on the same fixed batches for
the same number of steps; the first ``--warmup`` steps (capture, compilation) are not timed.
The final losses must agree: the benchmark doubles as a parity check (column ``parity``).

    python scripts/bench_train.py --configs tiny --dtypes fp32 --steps 100 --out bench_out
    python scripts/bench_train.py --smoke --out /tmp/smoke     # seconds, CPU, emulated graphs
    python scripts/bench_train.py --hf                         # HF Llama cells, JSON to $OUT

The hand-written baselines (eager, graphed_callables, compile, floor) are in bench_baselines.py, the
megatron-core modes in bench_megatron_modes.py, the shared set-up (configs, the model, batches and
optimizer of a cell, the timed loop) in bench_train_setup.py; this file holds the tgraph modes,
the table of modes and the command line.

Modes: eager, graphed_callables (``torch.cuda.make_graphed_callables`` on every block), compile
(``torch.compile(mode="reduce-overhead")`` on the model, optimizer eager), floor (one hand-written
``torch.cuda.CUDAGraph`` of forward+backward+AdamW, PyTorch's "whole network capture" recipe),
tgraph_layer (per-layer graphs), tgraph_full (``tgraph.FullIterationGraph``), megatron_none /
megatron_local (megatron-core GPTModel of the same dims, when importable); compile_default
(``torch.compile`` default mode, inductor without its CUDA graphs), tgraph_layer_compiled /
tgraph_layer_opt_compiled (``tgraph.enable(model, compile=True)``: per-layer graphs over
inductor-compiled layers), tgraph_full_compiled (``FullIterationGraph`` around a step of
``torch.compile(model)``), tgraph_model_compiled (the model as one graphed unit over its
compiled code).

The ``llama_*`` configs train a Hugging Face ``LlamaForCausalLM`` of those dims instead of the
toy (random init, SDPA attention; scripts/bench_llama.py); ``--hf`` runs the three Llama cells
(12 layers d256 T128 fp32 at batch 1 and 8, 16 layers d1024 T256 bf16 autocast at batch 4).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_baselines import (  # noqa: E402
    mode_compile,
    mode_eager,
    mode_eager_ckpt,
    mode_floor,
    mode_graphed_callables,
)
from bench_common import (  # noqa: E402
    Skip,
    environment,
    environment_markdown,
    fresh_memory,
    markdown_table,
    peak_memory_mib,
    summarize,
    synchronize,
    write_outputs,
)
from bench_llama import LLAMA_DTYPES, LlamaLM  # noqa: E402
from bench_megatron_modes import mode_megatron, mode_megatron_optimizer  # noqa: E402
from bench_train_setup import (  # noqa: E402
    CONFIGS,
    VOCAB,
    Setup,
    checkpoint_blocks,
    drive,
    drive_whole_step,
    eager_step,
    make_setup,
    optimizer_description,
)

import tgraph  # noqa: E402
from tgraph.toy.gpt import GPT, graph_whole  # noqa: E402

MODES = [
    "eager",
    "graphed_callables",
    "compile",
    "floor",
    "tgraph_layer",
    "tgraph_full",
    "megatron_none",
    "megatron_local",
    "megatron_tgraph_layer",
    "megatron_tgraph_layer_hooks",
    "megatron_tgraph_full",
    "tgraph_layer_opt",
    "tgraph_layer_opt_noskip",
    "tgraph_full_skip",
    "megatron_opt_none",
    "megatron_opt_none_capturable",
    "megatron_opt_local",
    "megatron_opt_tgraph_layer_opt",
    "megatron_opt_tgraph_full",
    "eager_ckpt",
    "tgraph_layer_ckpt",
    "compile_default",
    "tgraph_layer_compiled",
    "tgraph_layer_opt_compiled",
    "tgraph_full_compiled",
    "tgraph_layer_direct",
    "tgraph_layer_opt_noskip_direct",
    "tgraph_layer_opt_compiled_direct",
    "tgraph_layer_autograd",
    "tgraph_layer_opt_noskip_autograd",
    "tgraph_model",
    "tgraph_model_opt_noskip",
    "tgraph_layer_norm_eager",
    "tgraph_layer_head",
    "tgraph_layer_opt_noskip_head",
    "tgraph_model_compiled",
]
CPU_MODES = [
    "eager",
    "tgraph_layer",
    "tgraph_full",
    "tgraph_layer_opt",
    "tgraph_full_skip",
    "tgraph_layer_direct",
    "tgraph_layer_opt_noskip_direct",
    "tgraph_layer_autograd",
    "tgraph_model",
    "tgraph_model_opt_noskip",
]
# --hf: the Llama cells of bench_llama.LLAMA_DTYPES, these modes, few steps (an H200 in < 5 min)
HF_MODES = [
    "eager",
    "graphed_callables",
    "tgraph_layer",
    "tgraph_layer_opt_noskip",
    "tgraph_layer_opt",
    "tgraph_full",
    "compile",
    "compile_default",
    "tgraph_layer_compiled",
    "tgraph_layer_opt_compiled",
    "tgraph_full_compiled",
]
HF_STEPS, HF_WARMUP = 10, 2  # 12 steps trained: the final loss is the parity check
# Final-loss agreement. The graph modes run the same kernels as eager, so they agree to ~1e-6;
# torch.compile fuses kernels (other reduction orders) and Adam's normalised update amplifies
# those last-bit differences over the steps, so allow 2e-3 relative in fp32. bf16 autocast
# rounds every matmul to 8 mantissa bits: 3e-2.
PARITY_RTOL = {"fp32": 2e-3, "bf16": 3e-2}


# ------------------------------------------------------------------------------------ modes
# Each returns (per-step ms, final loss tensor, capture seconds or None, note).


def _whole(model):
    """The model as one graphed unit, embeddings to loss: the toy GPT by
    ``tgraph.toy.gpt.graph_whole``, the HF Llama wrapper (HF's forward and the loss) the same
    way (``graph_layers(model, whole=True)`` does it for a transformers model)."""
    if isinstance(model, GPT):
        return graph_whole(model)
    model.__class__ = tgraph.GraphableModule.of(type(model))
    return model


def _head_members(model):
    """The toy's ``ln_f`` and ``lm_head`` as members of the blocks' merged stack
    (``graphed_alone=False``, as ``graph_layers`` makes HF's final norm): the A/B of making
    that the toy's default."""
    if not isinstance(model, GPT):
        raise ValueError("the _head modes take the toy GPT (--configs tiny, ...)")
    for m in (model.ln_f, model.lm_head):
        m.__class__ = tgraph.GraphableModule.of(type(m), graphed_alone=False)
    return model


def _norm_eager(model):
    """HF Llama with its final norm eager (not a member of the layers' stack, as before
    graph_layers made it one): the A/B of that merge in one process."""
    if not isinstance(model, LlamaLM):
        raise ValueError("the _norm_eager modes take the HF Llama (--configs llama_b1, ...)")
    norm = model.hf.model.norm
    norm.__class__ = type(norm).__dict__["_tgraph_hf_base"]
    return model


_UNITS = {"layers": lambda m: m, "whole": _whole, "head": _head_members, "norm_eager": _norm_eager}


def mode_tgraph_layer(s: Setup, ckpt=False, compile=False, direct=None, units="layers"):  # noqa: A002
    """``compile``: enable(compile=True); capture_s then includes the recorded iteration,
    where inductor compiles the layers. ``direct``: enable(direct_grads=...). ``units``: what
    is graphed (:data:`_UNITS`): the blocks (HF Llama's final norm a member, as graph_layers
    makes it), the model as one unit (:func:`_whole`), the toy's ln_f and lm_head as members
    too (:func:`_head_members`), or HF Llama's final norm eager (:func:`_norm_eager`)."""
    model, opt = s.fresh()
    _UNITS[units](model)
    if ckpt:
        checkpoint_blocks(model)
    tgraph.enable(model, backend=s.backend, compile=compile, direct_grads=direct)
    try:
        synchronize(s.device)
        t_record = time.perf_counter()
        eager_step(model, opt, *s.batch(0), s)  # recorded iteration (a real training step)
        # As README's loop: the recorded step's gradients are dropped before creating the graphs
        # (the next step would drop them anyway); alive, they add their size to its peak.
        opt.zero_grad(set_to_none=True)
        synchronize(s.device)
        t0 = time.perf_counter()
        # Capture under the same autocast state as the recorded calls: the call signature does
        # not include autocast, so capturing outside it would graph fp32 blocks.
        with s.autocast():
            report = tgraph.create_graphs()
        synchronize(s.device)
        capture = time.perf_counter() - (t_record if compile else t0)
        times, loss = drive(s, lambda x, y: eager_step(model, opt, x, y, s), start=1)
        return times, loss, capture, str(report)
    finally:
        tgraph.reset()
        tgraph.disable(model)


def mode_tgraph_full(s: Setup, skip: bool = False, compiled: bool = False):
    """``skip``: FullIterationGraph(skip_nonfinite=True), the cost of the device flag.
    ``compiled``: the step runs ``torch.compile(model)`` (inductor, default mode); capture_s
    then covers the warmup steps too, where dynamo and inductor compile."""
    FullIterationGraph = tgraph.FullIterationGraph
    model, opt = s.fresh()
    run = torch.compile(model) if compiled else model

    def train_step(batch):
        x, y = batch
        return eager_step(run, opt, x, y, s).detach()

    # warmup_steps eager calls, then the call that captures (and runs) the step.
    step_graph = FullIterationGraph(
        train_step, warmup_steps=s.warmup - 1, backend=s.backend, skip_nonfinite=skip
    )
    times, loss, capture = drive_whole_step(s, step_graph, with_warmup=compiled)
    note = "capture_s = the capturing call (capture + its step)"
    if compiled:
        note = "torch.compile(model) inside the step; capture_s = warmup (compile) + capture"
    return times, loss, capture, note + ("; skip_nonfinite=True" if skip else "")


def mode_tgraph_layer_opt(s: Setup, skip=True, compile=False, direct=None, units="layers"):  # noqa: A002
    """Per-layer graphs for forward/backward plus tgraph.OptimizerGraph for the AdamW step;
    ``skip``: non-finite steps skipped on the device (the default); ``compile``:
    enable(compile=True), capture_s then includes the recorded (compiling) iteration;
    ``direct``: enable(direct_grads=...); ``units``: as :func:`mode_tgraph_layer`'s."""
    model, opt = s.fresh()
    _UNITS[units](model)
    graph = tgraph.OptimizerGraph(opt, skip_nonfinite=skip, backend=s.backend)

    def step(x, y):
        with s.autocast():
            _, loss = model(x, y)
        loss.backward()
        graph.step(loss)  # zeroes .grad in place (the graph owns the gradient buffers)
        return loss

    tgraph.enable(model, backend=s.backend, compile=compile, direct_grads=direct)
    try:
        synchronize(s.device)
        t_record = time.perf_counter()
        step(*s.batch(0))  # recorded iteration (eager optimizer step: warmup)
        synchronize(s.device)
        t0 = t_record if compile else time.perf_counter()
        with s.autocast():
            report = tgraph.create_graphs()
        step(*s.batch(1))  # the optimizer graph's capture (warmup_steps=1)
        synchronize(s.device)
        capture = time.perf_counter() - t0
        times, loss = drive(s, step, start=2)
        note = f"{report}; optimizer graph captured={graph.captured}, skip_nonfinite={skip}"
        return times, loss, capture, note
    finally:
        tgraph.reset()
        tgraph.disable(model)


MODE_FUNCS: dict[str, Callable] = {
    "eager": mode_eager,
    "graphed_callables": mode_graphed_callables,
    "compile": mode_compile,
    "floor": mode_floor,
    "tgraph_layer": mode_tgraph_layer,
    "tgraph_full": mode_tgraph_full,
    "megatron_none": lambda s: mode_megatron(s, "none"),
    "megatron_local": lambda s: mode_megatron(s, "local"),
    "megatron_tgraph_layer": lambda s: mode_megatron(s, "tgraph_layer"),
    "megatron_tgraph_layer_hooks": lambda s: mode_megatron(s, "tgraph_layer_hooks"),
    "megatron_tgraph_full": lambda s: mode_megatron(s, "tgraph_full"),
    "tgraph_layer_opt": mode_tgraph_layer_opt,
    "tgraph_layer_opt_noskip": lambda s: mode_tgraph_layer_opt(s, skip=False),
    "tgraph_full_skip": lambda s: mode_tgraph_full(s, skip=True),
    "megatron_opt_none": lambda s: mode_megatron_optimizer(s, "none"),
    "megatron_opt_none_capturable": lambda s: mode_megatron_optimizer(s, "none_capturable"),
    "megatron_opt_local": lambda s: mode_megatron_optimizer(s, "local"),
    "megatron_opt_tgraph_layer_opt": lambda s: mode_megatron_optimizer(s, "tgraph_layer_opt"),
    "megatron_opt_tgraph_full": lambda s: mode_megatron_optimizer(s, "tgraph_full"),
    "eager_ckpt": mode_eager_ckpt,
    "tgraph_layer_ckpt": lambda s: mode_tgraph_layer(s, ckpt=True),
    "compile_default": lambda s: mode_compile(s, mode="default"),
    "tgraph_layer_compiled": lambda s: mode_tgraph_layer(s, compile=True),
    "tgraph_layer_opt_compiled": lambda s: mode_tgraph_layer_opt(s, compile=True),
    "tgraph_full_compiled": lambda s: mode_tgraph_full(s, compiled=True),
    # enable(direct_grads=True): the node writes .grad, no AccumulateGrad per parameter (the
    # default does the same in one process); False: autograd's path, the default until 2026-12-07
    "tgraph_layer_autograd": lambda s: mode_tgraph_layer(s, direct=False),
    "tgraph_layer_opt_noskip_autograd": lambda s: mode_tgraph_layer_opt(
        s, skip=False, direct=False
    ),
    "tgraph_layer_direct": lambda s: mode_tgraph_layer(s, direct=True),
    "tgraph_layer_opt_noskip_direct": lambda s: mode_tgraph_layer_opt(s, skip=False, direct=True),
    "tgraph_layer_opt_compiled_direct": lambda s: mode_tgraph_layer_opt(
        s, compile=True, direct=True
    ),
    # the toy GPT as one graphed unit (tgraph.toy.gpt.graph_whole)
    "tgraph_model": lambda s: mode_tgraph_layer(s, units="whole"),
    "tgraph_layer_norm_eager": lambda s: mode_tgraph_layer(s, units="norm_eager"),
    "tgraph_layer_head": lambda s: mode_tgraph_layer(s, units="head"),
    "tgraph_layer_opt_noskip_head": lambda s: mode_tgraph_layer_opt(s, skip=False, units="head"),
    "tgraph_model_opt_noskip": lambda s: mode_tgraph_layer_opt(s, skip=False, units="whole"),
    # the model as one unit over its compiled code (enable(compile=True)): inductor fuses the
    # embedding, head and loss too, which per-layer graphs over compiled layers run eagerly
    "tgraph_model_compiled": lambda s: mode_tgraph_layer(s, compile=True, units="whole"),
}


def run_mode(mode: str, s: Setup) -> dict:
    row: dict = {"config": s.name, "dtype": s.dtype, "mode": mode, "status": "ok", "reason": ""}
    base = fresh_memory(s.device)
    s.setup_peak, s.trace = 0, {}
    try:
        times, loss, capture, note = MODE_FUNCS[mode](s)
        synchronize(s.device)
        row.update(summarize(times))
        steady = peak_memory_mib(s.device, since=base)
        row.update(
            capture_s=capture,
            final_loss=float(loss.detach().float()),
            note=note,
            # above the memory allocated when the mode started (model copies included)
            peak_mem_mib=None if steady is None else max(steady, (s.setup_peak - base) / 2**20),
            steady_peak_mib=steady,
            baseline_mib=base / 2**20,
            steps_trained=s.total,
        )
        if s.trace:
            row["gpu_timeline"] = s.trace
    except Skip as exc:
        row.update(status="skipped", reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - one failing mode must not hide the others
        row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:400]}")
    torch._dynamo.reset()  # compiled modes: no cache (or recompile limit) shared with the next
    if row["status"] != "ok":
        print(f"  {mode}: {row['status']}: {row['reason']}", flush=True)
    else:
        print(f"  {mode}: {row['ms_median']:.3f} ms/step, loss {row['final_loss']:.6f}", flush=True)
    fresh_memory(s.device)
    return row


def add_comparisons(rows: list[dict], dtype: str) -> None:
    """Ratios to the floor and to eager, and the parity verdict against eager's final loss."""
    ok = {r["mode"]: r for r in rows if r["status"] == "ok"}
    floor = ok.get("floor", {}).get("ms_median")
    eager = ok.get("eager", {}).get("ms_median")
    ref_row = ok.get("eager") or next(iter(ok.values()), None)
    tol = PARITY_RTOL[dtype]
    for r in rows:
        r["ratio_floor"] = r["ms_median"] / floor if floor and r.get("ms_median") else None
        r["ratio_eager"] = r["ms_median"] / eager if eager and r.get("ms_median") else None
        if r["status"] != "ok":
            r["parity"] = None
        else:
            # megatron modes have their own init: they are checked against megatron eager (its
            # own optimizer: against megatron_opt_none)
            base = ok.get("megatron_none") if r["mode"].startswith("megatron") else ref_row
            if r["mode"].startswith("megatron_opt"):
                # The tgraph modes step megatron's AdamW with capturable=True (make_graph_safe):
                # its bias correction is fp32 on the device instead of double on the host, which
                # this short memorising run can amplify; megatron eager with the same inner
                # optimizer (optimizer_cuda_graph=True) is their like-for-like reference.
                base = ok.get("megatron_opt_none")
                if "tgraph" in r["mode"] and "megatron_opt_none_capturable" in ok:
                    base = ok["megatron_opt_none_capturable"]
            if not base:
                r["parity"] = "n/a"
                continue
            r["loss_rel_diff"] = abs(r["final_loss"] - base["final_loss"]) / max(
                1.0, abs(base["final_loss"])
            )
            r["parity"] = "ok" if r["loss_rel_diff"] <= tol else "MISMATCH"


def markdown(payload: dict) -> str:
    meta = payload["meta"]
    parts = [
        "# Training-step benchmark",
        "",
        environment_markdown(meta["env"]),
        "",
        f"Optimizer: {meta['optimizer']}. Precision: {meta['precision']}. "
        f"{meta['steps']} timed steps after {meta['warmup']} untimed warmup steps; "
        f"{meta['timing']}. Parity: final loss vs eager, rtol {meta['parity_rtol']}. "
        "Memory: peak allocated above what was allocated when the mode started (peak MiB: "
        "whole mode incl. warmup and capture; steady MiB: timed steps only).",
    ]
    headers = [
        "mode",
        "ms/step (median)",
        "p10",
        "p90",
        "x floor",
        "x eager",
        "peak MiB",
        "steady MiB",
        "capture s",
        "final loss",
        "parity",
        "status",
    ]
    cells = list(dict.fromkeys((r["config"], r["dtype"]) for r in payload["results"]))
    for cfg, dt in cells:
        rows = [r for r in payload["results"] if (r["config"], r["dtype"]) == (cfg, dt)]
        d = CONFIGS[cfg]
        parts += [
            "",
            f"## {cfg} ({d['n_layer']} layers, d={d['n_embd']}, {d['n_head']} heads, "
            f"seq {d['seq']}, batch {d['batch']}, vocab {VOCAB}), {dt}",
            "",
        ]
        table = [
            [
                r["mode"],
                r.get("ms_median"),
                r.get("ms_p10"),
                r.get("ms_p90"),
                r.get("ratio_floor"),
                r.get("ratio_eager"),
                r.get("peak_mem_mib"),
                r.get("steady_peak_mib"),
                r.get("capture_s"),
                None if r.get("final_loss") is None else f"{r['final_loss']:.6f}",
                r.get("parity"),
                r["status"] if r["status"] == "ok" else f"{r['status']}: {r['reason']}",
            ]
            for r in rows
        ]
        parts.append(markdown_table(headers, table))
    traced = [r for r in payload["results"] if r.get("gpu_timeline")]
    if traced:
        parts += [
            "",
            "## GPU timeline (torch.profiler over extra steps after the timed ones, per step)",
            "",
            markdown_table(
                [
                    "config",
                    "dtype",
                    "mode",
                    "kernel ms",
                    "busy ms",
                    "window ms",
                    "idle %",
                    "idle in gaps >= 10 us, %",
                    "kernels",
                ],
                [
                    [
                        r["config"],
                        r["dtype"],
                        r["mode"],
                        *(
                            r["gpu_timeline"].get(k)
                            for k in (
                                "kernel_ms",
                                "busy_ms",
                                "window_ms",
                                "idle_pct",
                                "idle_long_pct",
                                "kernels",
                            )
                        ),
                    ]
                    for r in traced
                ],
            ),
        ]
    mism = [r for r in payload["results"] if r.get("parity") == "MISMATCH"]
    if mism:
        parts += [
            "",
            "**PARITY MISMATCH**: "
            + ", ".join(f"{r['config']}/{r['dtype']}/{r['mode']}" for r in mism),
        ]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default="tiny", help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--dtypes", default="fp32", help="comma list of fp32,bf16")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
    p.add_argument("--steps", type=int, default=100, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per mode (>= 2)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--backend", default="auto", help="tgraph backend: auto, cuda, emulated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--trace",
        type=int,
        default=0,
        metavar="N",
        help="CUDA: after each mode's timed steps, N more under torch.profiler; reports the "
        "GPU's kernel time, busy time and idle share per step (bench_common.gpu_timeline)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="default: $OUT")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, emulated graphs, tiny dims, 3 steps: keeps the script alive in CI",
    )
    p.add_argument(
        "--hf",
        action="store_true",
        help=f"the Hugging Face Llama cells {LLAMA_DTYPES}, modes {HF_MODES} (unless --modes), "
        f"{HF_STEPS} timed steps after {HF_WARMUP} warmup steps",
    )
    a = p.parse_args(argv)
    cells = None
    if a.hf:
        cells = list(LLAMA_DTYPES.items())
        a.steps, a.warmup = HF_STEPS, HF_WARMUP
        if a.modes == ",".join(MODES):
            a.modes = ",".join(HF_MODES)
    if a.smoke:
        cells = [("smoke", "fp32"), ("llama_smoke", "fp32")] if cells is None else cells
        a.steps, a.warmup = 3, 3
        a.device, a.backend = "cpu", "emulated"
        a.modes = ",".join(m for m in a.modes.split(",") if m in CPU_MODES)
    if cells is not None:
        a.configs = ",".join(dict.fromkeys(c for c, _ in cells))
        a.dtypes = ",".join(dict.fromkeys(d for _, d in cells))
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    configs, dtypes, modes = a.configs.split(","), a.dtypes.split(","), a.modes.split(",")
    if cells is None:
        cells = [(c, d) for c in configs for d in dtypes]
    for name, allowed, given in (
        ("config", CONFIGS, configs),
        ("dtype", PARITY_RTOL, dtypes),
        ("mode", MODES, modes),
    ):
        bad = [g for g in given if g not in allowed]
        if bad:
            p.error(f"unknown {name} {bad}; expected some of {list(allowed)}")
    if a.warmup < 2:
        p.error("--warmup must be >= 2 (the floor needs an eager AdamW step before capture)")
    env = environment(device)
    print(
        f"bench_train: {env['gpu'] or 'cpu'}, torch {env['torch']}, cuda {env['cuda']}", flush=True
    )
    results: list[dict] = []
    for cfg, dt in cells:
        print(f"[{cfg} {dt}]", flush=True)
        s = make_setup(cfg, dt, device, a.backend, a.steps, a.warmup, a.seed)
        s.trace_steps = a.trace
        rows: list[dict] = []
        for m in modes:
            rows.append(run_mode(m, s))
            add_comparisons(rows, dt)
            # written after every mode: a run killed by a time limit keeps what it measured
            partial = _payload(a, device, env, results + rows)
            write_outputs(a.out, "bench_train", partial, markdown(partial))
        results += rows
    payload = _payload(a, device, env, results)
    md = markdown(payload)
    js, mdp = write_outputs(a.out, "bench_train", payload, md)
    print(md)
    print(f"wrote {js} and {mdp}")
    return 1 if any(r.get("parity") == "MISMATCH" for r in results) else 0


def _payload(a: argparse.Namespace, device: torch.device, env: dict, results: list[dict]) -> dict:
    return {
        "meta": {
            "env": env,
            "optimizer": optimizer_description(device),
            "precision": "fp32 weights; bf16 = torch.autocast(bfloat16, cache_enabled=False) "
            "over fp32 master weights",
            "steps": a.steps,
            "warmup": a.warmup,
            "timing": (
                "CUDA events around each step, no per-step sync"
                if device.type == "cuda"
                else "perf_counter around each step"
            ),
            "parity_rtol": PARITY_RTOL,
            "backend": a.backend,
            "smoke": a.smoke,
            "vocab": VOCAB,
        },
        "results": results,
    }


if __name__ == "__main__":
    sys.exit(main())
