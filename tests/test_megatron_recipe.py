"""The megatron-core recipe: it fails clearly where it cannot run (no GPU, an --out holding a
run), parses its flags, and (GPU + megatron-core) trains with megatron's own optimizer in every
graph mode."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_megatron_gpt.py"


def _load_recipe():
    spec = importlib.util.spec_from_file_location("train_megatron_gpt", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess:
    root = str(RECIPE.parents[1])  # tgraph importable without an (editable) install
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    )
    return subprocess.run(
        [sys.executable, str(RECIPE), *args], capture_output=True, text=True, timeout=300, env=env
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_without_a_gpu_the_recipe_says_so(tmp_path):
    r = _run("--steps", "2", "--out", str(tmp_path / "run"))
    assert r.returncode != 0
    assert "needs a CUDA GPU" in r.stderr


def test_every_flag_has_help_text():
    parser = _load_recipe().build_parser()
    assert [a.option_strings for a in parser._actions if not a.help] == []


def test_bad_flags_are_rejected():
    r = _run("--steps", "1")
    assert r.returncode == 2 and "--steps must be >= 2" in r.stderr
    r = _run("--lr", "1e-3", "--min-lr", "1e-2")
    assert r.returncode == 2 and "--min-lr must be in" in r.stderr
    r = _run("--graph", "opt")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_an_out_holding_a_run_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 5.5}\n')
    r = _run("--steps", "2", "--out", str(out))
    assert r.returncode == 2 and "already holds a run" in r.stderr and "--overwrite" in r.stderr
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "loss": 5.5}\n'  # untouched


# -- GPU + megatron-core: the four graph modes, 8 steps at a tiny size --------------------------

TINY = ["--steps", "8", "--num-layers", "2", "--hidden-size", "64", "--num-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "4", "--micro-batches", "2", "--lr", "1e-2",
        "--min-lr", "1e-3", "--warmup-steps", "2", "--log-every", "1"]  # fmt: skip
RUNS = {  # name: extra flags
    "none": ["--graph", "none"],
    "layer": ["--graph", "layer"],
    "layer+opt": ["--graph", "layer+opt"],
    "full": ["--graph", "full"],
    # megatron eager with the capturable AdamW that layer+opt and full step
    "none_capturable": ["--graph", "none", "--optimizer-cuda-graph"],
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (summary, metrics rows), every run in this process (as the recipe's main)."""
    recipe = _load_recipe()
    root = tmp_path_factory.mktemp("megatron_recipe")
    done = {}
    for name, flags in RUNS.items():
        out = root / name.replace("+", "_")
        summary = recipe.main([*TINY, *flags, "--out", str(out)])
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
        done[name] = (summary, rows)
    return done


@pytest.mark.cuda
@pytest.mark.megatron
def test_every_mode_trains_with_megatrons_optimizer(trained):
    for name, (summary, rows) in trained.items():
        assert summary["optimizer"] == "megatron get_megatron_optimizer adam", name
        assert summary["graph"] == RUNS[name][1]
        assert summary["skipped_steps"] == 0, name
        assert summary["skip_nonfinite"] == (name in ("layer+opt", "full"))
        assert [r["step"] for r in rows] == list(range(8)), name
        assert all(math.isfinite(r["loss"]) for r in rows), (name, rows)
        assert all(r["skipped_steps"] == 0 for r in rows), name
        assert all(math.isfinite(r["grad_norm"]) for r in rows), name
        assert rows[-1]["loss"] == summary["final_loss"], name


@pytest.mark.cuda
@pytest.mark.megatron
def test_modes_agree_on_losses_and_follow_megatrons_schedule(trained):
    ref, ref_rows = trained["none"]
    for name in ("layer", "layer+opt", "full", "none_capturable"):
        summary, rows = trained[name]
        # the first loss is computed before any update: the same model, batch and kernels
        torch.testing.assert_close(summary["first_loss"], ref["first_loss"], rtol=1e-6, atol=0)
        # the first step's gradient norm: megatron's (eager) against tgraph's device-side one
        torch.testing.assert_close(
            rows[0]["grad_norm"], ref_rows[0]["grad_norm"], rtol=1e-4, atol=0
        )
        # megatron's OptimizerParamScheduler drives every mode: the same rate at every step
        torch.testing.assert_close(
            [r["lr"] for r in rows], [r["lr"] for r in ref_rows], rtol=1e-6, atol=1e-9
        )
    # warmup 2 steps from 0 to 1e-2, cosine to 1e-3 over 8 steps: step 7's rate
    want = 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * (7 - 2) / (8 - 2)))
    assert ref["final_lr"] == pytest.approx(want, rel=1e-6)
    assert trained["full"][0]["final_lr"] == pytest.approx(want, rel=1e-6)
    # per-layer graphs with megatron's eager step: eager's numbers up to rounding
    final = {name: s["final_loss"] for name, (s, _) in trained.items()}
    assert final["layer"] == pytest.approx(final["none"], rel=2e-3)
    # both graph-stepped modes run the capturable AdamW: close to each other, and to megatron's
    # eager step with that AdamW (a learning rate frozen at capture would break this)
    assert final["layer+opt"] == pytest.approx(final["full"], rel=2e-3)
    assert final["layer+opt"] == pytest.approx(final["none_capturable"], rel=2e-3)
    assert final["full"] == pytest.approx(final["none_capturable"], rel=2e-3)
