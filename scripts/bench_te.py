"""TransformerEngine layers: eager, TE's own graphs and tgraph's, side by side in one process.

    python scripts/bench_te.py --layers 16 --hidden 1024 --seq 512 --batch 2 --out docs/benchmarks

A stack of ``te.TransformerLayer`` (fused attention, causal; bf16 parameters), trained with
AdamW (``capturable=True``, which every mode can step) under ``te.autocast`` with the chosen
recipe (``--fp8 none|delayed|current``). Modes, each from the same initial weights:

* ``eager``: TE's modules as they are;
* ``te_graphs``: ``te.make_graphed_callables`` per layer (its FP8 handling on), as TE's users run
  it, with the optimizer step eager;
* ``tgraph_layer``: tgraph per-layer graphs (``tgraph.enable``; the first step records);
* ``tgraph_layer_opt``: per-layer graphs plus ``tgraph.OptimizerGraph`` for the AdamW step;
* ``tgraph_full``: ``tgraph.FullIterationGraph`` around forward, backward and the step.

Each mode reports the median ms per step (CUDA events), its peak memory above the model's
weights (capture included) and the losses, compared bit for bit with eager's.
"""

from __future__ import annotations

import argparse
import copy
import sys
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

MODES = ("eager", "te_graphs", "tgraph_layer", "tgraph_layer_opt", "tgraph_full")


class Layer(tgraph.GraphableModule):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        import transformer_engine.pytorch as te

        self.layer = te.TransformerLayer(
            a.hidden,
            4 * a.hidden,
            a.hidden // 64,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            self_attn_mask_type="causal",
            params_dtype=torch.bfloat16,
        )

    def forward(self, x):
        return self.layer(x)


def recipe_of(name: str):
    from transformer_engine.common import recipe

    return {
        "none": None,
        "delayed": recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16),
        "current": recipe.Float8CurrentScaling(),
    }[name]


def run_mode(mode: str, base: torch.nn.ModuleList, a: argparse.Namespace) -> dict:
    import transformer_engine.pytorch as te

    dev = torch.device("cuda")
    since = fresh_memory(dev)
    layers = copy.deepcopy(base)
    recipe = recipe_of(a.fp8)
    fp8 = recipe is not None
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-4, capturable=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xs = [
        torch.randn(a.seq, a.batch, a.hidden, device=dev, dtype=torch.bfloat16, generator=gen)
        for _ in range(4)
    ]
    calls = list(layers)
    if mode == "te_graphs":
        samples = tuple((torch.randn_like(xs[0]).requires_grad_(),) for _ in layers)
        graphed = te.make_graphed_callables(tuple(layers), samples, enabled=fp8, recipe=recipe)
        calls = list(graphed)
    if mode.startswith("tgraph_layer"):
        tgraph.enable(layers, strict=True)
    opt_graph = tgraph.OptimizerGraph(opt) if mode == "tgraph_layer_opt" else None

    def forward_backward(x):
        with te.autocast(enabled=fp8, recipe=recipe):
            y = x
            for c in calls:
                y = c(y)
        loss = y.float().pow(2).mean()
        loss.backward()
        return loss

    def train_step(x):
        loss = forward_backward(x)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    full = tgraph.FullIterationGraph(train_step) if mode == "tgraph_full" else None
    timer, losses = StepTimer(dev), []
    total = a.warmup + a.steps
    for i in range(total):
        x = xs[i % len(xs)]
        if i >= a.warmup:
            timer.start()
        if full is not None:
            loss = full(x)
        elif opt_graph is not None:
            loss = forward_backward(x).detach()
            opt_graph.step()
        else:
            loss = train_step(x)
        if i >= a.warmup:
            timer.stop()
        losses.append(loss.clone())
        if mode.startswith("tgraph_layer") and i == 0:
            tgraph.create_graphs()
    times = timer.times_ms()
    peak = peak_memory_mib(dev, since)
    tgraph.reset()
    return {"mode": mode, **summarize(times), "peak_mib": peak, "losses": torch.stack(losses)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16, help="te.TransformerLayer count")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size (heads of 64)")
    p.add_argument("--seq", type=int, default=512, help="sequence length")
    p.add_argument("--batch", type=int, default=2, help="micro-batch size")
    p.add_argument("--fp8", default="none", choices=["none", "delayed", "current"])
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (capture included)")
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    p.add_argument("--out", default=None, help="folder for bench_te_<fp8>.json/.md")
    a = p.parse_args()
    torch.manual_seed(0)
    base = torch.nn.ModuleList(Layer(a) for _ in range(a.layers)).cuda()
    results = []
    for mode in a.modes.split(","):
        try:
            results.append(run_mode(mode, base, a))
        except Exception as exc:  # a mode that cannot run is reported, never a number
            results.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"})
        r = results[-1]
        print(mode, {k: v for k, v in r.items() if k != "losses"}, flush=True)
    eager = next((r for r in results if r["mode"] == "eager" and "losses" in r), None)
    rows = []
    for r in results:
        if "losses" in r and eager is not None:  # eager's own losses are popped last
            diff = (r["losses"] - eager["losses"]).abs().max().item()
            r["max_loss_diff_vs_eager"] = diff
            r["ratio_vs_eager"] = r["ms_median"] / eager["ms_median"]
        te_ms = next((x.get("ms_median") for x in results if x["mode"] == "te_graphs"), None)
        if te_ms and r.get("ms_median"):
            r["ratio_vs_te_graphs"] = r["ms_median"] / te_ms
        rows.append(
            [
                r["mode"],
                r.get("ms_median"),
                r.get("ratio_vs_eager"),
                r.get("ratio_vs_te_graphs"),
                r.get("peak_mib"),
                r.get("max_loss_diff_vs_eager", r.get("error")),
            ]
        )
    for r in results:
        r.pop("losses", None)
    env = environment(torch.device("cuda"))
    import transformer_engine

    env["transformer_engine"] = transformer_engine.__version__
    table = markdown_table(
        ["mode", "ms/step", "x eager", "x TE graphs", "peak MiB", "max |loss - eager|"], rows
    )
    md = f"{environment_markdown(env)}, TE {env['transformer_engine']}\n\n" + table
    print(md)
    if a.out:
        name = f"bench_te_{a.fp8}"
        write_outputs(a.out, name, {"env": env, "args": vars(a), "results": results}, md)


if __name__ == "__main__":
    main()
