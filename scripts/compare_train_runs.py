"""Compare runs of recipes/train_gpt.py: one loss plot and one Markdown table.

    python scripts/compare_train_runs.py runs/h200_none runs/h200_layer runs/h200_full \\
        --plot docs/benchmarks/train_modes.png --table docs/benchmarks/train_modes.md

Reads each run's ``summary.json`` and ``metrics.jsonl``. The table gives the median ms per step
(steady state: log intervals without recording, capture, validation or checkpoints), tokens/s,
capture time, peak memory, the final validation loss, and how far each run's loss curve is from
the first run's (same seed and data: graph modes should agree to float rounding).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load_run(run: Path) -> tuple[dict, list[dict]]:
    """A run's summary and metric rows.

    Raises:
        FileNotFoundError: the run has no summary.json (unfinished) or no metrics.jsonl.
    """
    if not (run / "summary.json").is_file():
        raise FileNotFoundError(f"{run}/summary.json is missing: did the run finish?")
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return summary, rows


def curve(rows: list[dict], kind: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if r["kind"] == kind}


def table(runs: list[tuple[Path, dict, list[dict]]]) -> str:
    """Markdown table of the runs (the first run is the reference for the curve difference)."""
    ref_train = curve(runs[0][2], "train")
    lines = [
        "| run | graph | device | steps | ms/step (median) | tokens/s | capture s | peak MiB "
        "| final val loss | max abs train-loss diff vs first |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for path, s, rows in runs:
        mine = curve(rows, "train")
        common = sorted(ref_train.keys() & mine.keys())
        diff = max((abs(ref_train[k] - mine[k]) for k in common), default=float("nan"))
        lines.append(
            f"| {path.name} | {s['graph']} | {s['device']} x{s['world_size']} | {s['steps']} "
            f"| {s['median_ms_per_step']:.2f} | {s['tokens_per_s']:,.0f} | {s['capture_s']:.2f} "
            f"| {s['peak_mem_mb']:.0f} | {s['final_val_loss']:.4f} | {diff:.2e} |"
        )
    return "\n".join(lines)


def plot(runs: list[tuple[Path, dict, list[dict]]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (path, s, rows), style in zip(runs, ("-", "--", ":", "-.") * 4):
        label = f"{s['graph']} ({path.name}, {s['median_ms_per_step']:.1f} ms/step)"
        train = curve(rows, "train")
        (line,) = ax.plot(list(train), list(train.values()), style, label=f"train, {label}")
        val = curve(rows, "val")
        ax.plot(list(val), list(val.values()), "o", color=line.get_color(), markersize=5,
                label=f"val, {s['graph']}")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(f"toy GPT on stdlib bytes, {runs[0][1]['device']}: graph modes")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories (--out of train_gpt.py)")
    p.add_argument("--plot", type=Path, default=Path("train_modes.png"), help="PNG to write")
    p.add_argument("--table", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    runs = [(r, *load_run(r)) for r in args.runs]
    text = table(runs)
    print(text)
    if args.table:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(text + "\n")
    plot(runs, args.plot)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
