"""Bar charts of the benchmark JSONs: training ms/step per mode per config, decode tokens/s.

    python scripts/plot_bench.py bench_out/bench_train.json bench_out/bench_decode.json --out bench_out

Writes ``bench_train.png`` (one panel per config/dtype, ms/step per mode, lower is better),
``bench_train_memory.png`` (the same panels: peak MiB with capture, and steady MiB, per mode; GPU
runs only) and ``bench_decode.png`` (tokens/s per mode, grouped by batch size and the mixed workload).
Modes that were skipped or failed are left out of the bars.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on CI or the GPU machine
import matplotlib.pyplot as plt  # noqa: E402


def _title(meta: dict) -> str:
    env = meta.get("env", {})
    return f"{env.get('gpu') or 'CPU'}, torch {env.get('torch')}, {env.get('date', '')[:10]}"


def _label_bars(ax, bars, vals: list[float], fmt: str, fontsize: int) -> None:
    """Each bar's value above it."""
    for bar, v in zip(bars, vals):
        ax.annotate(
            format(v, fmt),
            (bar.get_x() + bar.get_width() / 2, v),
            ha="center",
            va="bottom",
            fontsize=fontsize,
        )


def plot_train(payload: dict, out: Path) -> Path:
    rows = [r for r in payload["results"] if r["status"] == "ok" and r.get("ms_median")]
    cells = list(dict.fromkeys((r["config"], r["dtype"]) for r in payload["results"]))
    fig, axes = plt.subplots(
        1, max(len(cells), 1), figsize=(5 * max(len(cells), 1), 4.5), squeeze=False
    )
    for ax, (cfg, dt) in zip(axes[0], cells):
        sel = [r for r in rows if (r["config"], r["dtype"]) == (cfg, dt)]
        names = [r["mode"] for r in sel]
        vals = [r["ms_median"] for r in sel]
        _label_bars(ax, ax.bar(range(len(sel)), vals, color="tab:blue"), vals, ".2f", 8)
        ax.set_xticks(range(len(sel)), names, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("ms per training step (median, lower is better)")
        ax.set_title(f"{cfg} {dt}")
    fig.suptitle("Training step: " + _title(payload["meta"]))
    fig.tight_layout()
    path = out / "bench_train.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_train_memory(payload: dict, out: Path) -> Path | None:
    """Peak (capture included) and steady-state MiB per mode, one panel per config/dtype."""
    rows = [r for r in payload["results"] if r["status"] == "ok" and r.get("peak_mem_mib")]
    if not rows:
        return None  # CPU runs measure no memory
    cells = list(dict.fromkeys((r["config"], r["dtype"]) for r in rows))
    fig, axes = plt.subplots(1, len(cells), figsize=(5 * len(cells), 4.5), squeeze=False)
    for ax, (cfg, dt) in zip(axes[0], cells):
        sel = [r for r in rows if (r["config"], r["dtype"]) == (cfg, dt)]
        xs = range(len(sel))
        for shift, key, label, color in (
            (-0.2, "peak_mem_mib", "peak, capture included", "tab:red"),
            (0.2, "steady_peak_mib", "steady state", "tab:green"),
        ):
            vals = [r.get(key) or 0.0 for r in sel]
            bars = ax.bar([x + shift for x in xs], vals, 0.4, label=label, color=color)
            _label_bars(ax, bars, vals, ".0f", 7)
        ax.set_xticks(list(xs), [r["mode"] for r in sel], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("MiB above the mode's start (lower is better)")
        ax.set_title(f"{cfg} {dt}")
        top = max(max(r.get("peak_mem_mib") or 0.0, r.get("steady_peak_mib") or 0.0) for r in sel)
        ax.set_ylim(0, top * 1.3)  # headroom for the legend
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle("Training memory: " + _title(payload["meta"]))
    fig.tight_layout()
    path = out / "bench_train_memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_decode(payload: dict, out: Path) -> Path:
    rows = [r for r in payload["results"] if r["status"] == "ok" and r.get("tokens_per_s")]
    workloads = list(dict.fromkeys(r["workload"] for r in payload["results"]))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(workloads)), 4.5))
    width = 0.8 / max(len(modes), 1)
    for k, mode in enumerate(modes):
        xs, vals = [], []
        for i, wl in enumerate(workloads):
            r = next((r for r in rows if r["workload"] == wl and r["mode"] == mode), None)
            if r is not None:
                xs.append(i + k * width)
                vals.append(r["tokens_per_s"])
        ax.bar(xs, vals, width, label=mode)
    ax.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(workloads))], workloads)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (log scale, higher is better)")
    ax.legend(fontsize=8)
    ax.set_title("Decode: " + _title(payload["meta"]))
    fig.tight_layout()
    path = out / "bench_decode.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jsons", nargs="+", help="bench_train.json and/or bench_decode.json")
    p.add_argument("--out", default=None, help="folder for the PNGs (default: next to the JSON)")
    a = p.parse_args(argv)
    for name in a.jsons:
        payload = json.loads(Path(name).read_text())
        out = Path(a.out) if a.out else Path(name).parent
        out.mkdir(parents=True, exist_ok=True)
        kind = "decode" if any("workload" in r for r in payload.get("results", [])) else "train"
        if kind == "decode":
            print(f"wrote {plot_decode(payload, out)}")
            continue
        print(f"wrote {plot_train(payload, out)}")
        memory = plot_train_memory(payload, out)
        if memory is not None:
            print(f"wrote {memory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
