"""The benchmark scripts stay alive: their ``--smoke`` modes run on CPU (emulated graphs), write
the expected JSON, agree on losses / tokens, and their parity checks catch planted graph bugs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
ENV_KEYS = {"date", "gpu", "driver", "torch", "cuda"}
NUMBERS = ("ms_median", "final_loss", "tokens_per_s")
# A hang guard, not a speed bound: on 2 CPU cores the train smoke took 50 s and the decode smoke
# 32 s with other work on the cores, and a few times that on a busier machine (a fixed 120 s
# failed there). A script that hangs is still stopped.
HANG_GUARD_S = 1800


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=ROOT,
    )


@pytest.fixture(scope="module")
def smoke_out(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    for script in ("bench_train.py", "bench_decode.py"):
        proc = _run(script, "--smoke", "--out", str(out))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _check_rows(payload: dict) -> list[dict]:
    assert ENV_KEYS <= set(payload["meta"]["env"])
    rows = payload["results"]
    assert rows
    for r in rows:
        assert r["status"] in ("ok", "skipped", "error")
        if r["status"] != "ok":  # a mode that did not run reports a reason, never a number
            assert r["reason"]
            assert all(r.get(k) is None for k in NUMBERS)
    return [r for r in rows if r["status"] == "ok"]


def test_train_smoke_json_and_loss_parity(smoke_out: Path) -> None:
    payload = json.loads((smoke_out / "bench_train.json").read_text())
    ok = _check_rows(payload)
    # the toy GPT and a Hugging Face Llama (decoder layers graphed through their keyword call)
    for config in ("smoke", "llama_smoke"):
        assert {"eager", "tgraph_layer"} <= {r["mode"] for r in ok if r["config"] == config}
    for r in ok:
        for key in ("ms_median", "ms_p10", "ms_p90", "final_loss", "ratio_eager", "parity"):
            assert r[key] is not None, key
        assert r["parity"] == "ok"
    eager = {r["config"]: r for r in ok if r["mode"] == "eager"}
    for r in ok:
        # The emulated backend replays the very same CPU kernels on the same values, so every
        # graph mode's final loss equals eager's up to float32 rounding of a reordered sum.
        want = eager[r["config"]]["final_loss"]
        torch.testing.assert_close(r["final_loss"], want, rtol=1e-5, atol=0.0)
    md = (smoke_out / "bench_train.md").read_text()
    assert "| eager |" in md and "parity" in md


def test_decode_smoke_json_and_token_parity(smoke_out: Path) -> None:
    payload = json.loads((smoke_out / "bench_decode.json").read_text())
    ok = _check_rows(payload)
    modes = {(r["workload"], r["mode"]) for r in ok}
    assert {("batch 1", "hand_eager"), ("batch 1", "hand_graph")} <= modes
    assert ("mixed", "hand_continuous_graph") in modes
    for r in ok:
        assert r["tokens_per_s"] and r["tokens_per_s"] > 0
        # hf is another model, sampled tokens are not greedy, TTFT rows decode one token
        if (
            r["mode"] != "hf_generate"
            and not r["mode"].startswith("ttft")
            and "sampled" not in r["mode"]
        ):
            assert r["token_agreement"] == 1.0, r
    assert ("batch 1", "engine_graphs_sampled") in modes
    assert {"ttft_prefill_graphs", "ttft_prefill_eager"} <= {r["mode"] for r in ok}
    assert all(r["ttft_ms"] > 0 for r in ok if r["mode"].startswith("ttft"))
    assert payload["ratios"]["batch 1/engine_graphs"]["x_hand_graph"] > 0
    assert any(k.startswith("batch 1: engine_graphs <=") for k in payload["goals"])
    assert any(r.get("engine_stats", {}).get("graph_bytes") for r in ok)
    mixed = [r for r in ok if r["workload"] == "mixed"]
    assert all(r["padding_waste"] is not None and 0 <= r["padding_waste"] < 1 for r in mixed)


def test_plot_bench_writes_pngs(smoke_out: Path) -> None:
    proc = _run(
        "plot_bench.py",
        str(smoke_out / "bench_train.json"),
        str(smoke_out / "bench_decode.json"),
        "--out",
        str(smoke_out),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("bench_train.png", "bench_decode.png"):
        png = (smoke_out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    assert not (smoke_out / "bench_train_memory.png").exists()  # a CPU run measures no memory


def test_plot_bench_draws_memory_of_a_gpu_run(tmp_path: Path) -> None:
    gpu_json = ROOT / "docs/benchmarks/2026-12-01_h200_session4_train_memory.json"
    proc = _run("plot_bench.py", str(gpu_json), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    png = (tmp_path / "bench_train_memory.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


@pytest.fixture
def scripts_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))


@pytest.mark.usefixtures("no_verifier")  # the parity column alone: the verifier would catch it
def test_train_parity_column_catches_stale_input_bug(
    scripts_on_path, monkeypatch, tmp_path: Path
) -> None:
    """Planted bug: replays skip copying new inputs into the static buffers (stale batch)."""
    import bench_train

    import tgraph.layers.replay

    monkeypatch.setattr(tgraph.layers.replay, "copy_inputs", lambda cap, tensors: True)
    rc = bench_train.main(["--smoke", "--out", str(tmp_path), "--modes", "eager,tgraph_layer"])
    payload = json.loads((tmp_path / "bench_train.json").read_text())
    layer = next(r for r in payload["results"] if r["mode"] == "tgraph_layer")
    assert layer["parity"] == "MISMATCH"
    assert rc == 1


@pytest.mark.parametrize("bug", ["no_replay", "none"])
def test_decode_token_agreement_catches_stale_output_bug(
    scripts_on_path, monkeypatch, tmp_path: Path, bug: str
) -> None:
    """Planted bug: the hand graph returns its static logits without replaying (stale output)."""
    import bench_decode
    import bench_decode_hand

    if bug == "no_replay":
        monkeypatch.setattr(
            bench_decode_hand.HandStep,
            "__call__",
            lambda self: self.kv.step() if self.graph is None else self.logits,
        )
    args = ["--smoke", "--out", str(tmp_path), "--modes", "hand_eager,hand_graph", "--no-mixed"]
    rc = bench_decode.main(args)
    payload = json.loads((tmp_path / "bench_decode.json").read_text())
    agreement = [r["token_agreement"] for r in payload["results"] if r["mode"] == "hand_graph"]
    if bug == "none":
        assert rc == 0 and agreement == [1.0, 1.0]
    else:
        assert rc == 1 and min(agreement) < 1.0


def test_profile_host_writes_per_call_figures(tmp_path: Path) -> None:
    """The host profile times graphed calls of the toy and of a Hugging Face Llama."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "profile_host.py"), "--layers", "2", "--steps", "3"]
        + ["--reps", "1", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    payload = json.loads((tmp_path / "profile_host.json").read_text())
    for model in ("toy", "llama"):
        calls = payload["models"][model]["per_call"]
        # HF Llama: its final norm is a member of the layers' stack (as graph_layers makes it)
        assert calls["calls_per_step"] == (3 if model == "llama" else 2)
        assert calls["per_call_us"] > 0 and calls["call_key_us"] > 0
        # the members are one merged stack: only the head's call computes its call key, the
        # others are answered from their learned shapes (tgraph/layers/shortcut.py)
        assert payload["models"][model]["parts"]["call_key"]["calls_per_step"] == 1
    assert "position_embeddings" in payload["models"]["llama"]["per_call"]["kwargs"]  # HF's call
