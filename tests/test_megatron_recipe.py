"""The megatron-core recipe on the shared trainer: it fails clearly where it cannot run (no GPU,
bad flags), parses its flags, and (GPU + megatron-core) trains with megatron's own optimizer in
every graph mode, checkpoints, resumes bit for bit and refuses a damaged checkpoint."""

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
from killed_runs import Killed, killed_after_checkpoint
from safetensors.torch import load_file

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_megatron_gpt.py"


def _load_recipe():
    loaded = sys.modules.get("train_megatron_gpt")
    if loaded is not None and getattr(loaded, "__file__", None) == str(RECIPE):
        return loaded
    spec = importlib.util.spec_from_file_location("train_megatron_gpt", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_megatron_gpt"] = module  # dataclasses look classes up by module name
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


def _refused(*args: str) -> str:
    """The recipe run with ``args`` exits 2 before anything runs; its one-line error."""
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    return _one_line(r)


def _one_line(r: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    return r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_without_a_gpu_the_recipe_says_so(tmp_path):
    out = tmp_path / "run"
    assert "needs a CUDA GPU" in _refused("--steps", "2", "--out", str(out))
    assert not out.exists()  # refused before anything is created
    assert "needs a CUDA GPU" in _refused("--device", "cpu", "--out", str(out))


def test_without_megatron_core_the_recipe_says_so(monkeypatch):
    recipe = _load_recipe()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    why = recipe.MegatronTrainConfig().unavailable()
    assert why.startswith("megatron-core training needs megatron-core") and "pip install" in why


def test_every_flag_has_help_text():
    from gpt_training import cli

    recipe = _load_recipe()
    docs = cli._field_docs(recipe.MegatronTrainConfig)
    fields = [f.name for f in __import__("dataclasses").fields(recipe.MegatronTrainConfig)]
    assert [f for f in fields if not docs.get(f)] == []
    r = _run("--help")
    assert r.returncode == 0
    for flag in ("--num-layers", "--hidden-size", "--num-heads", "--seq-length", "--clip-grad",
                 "--micro-batches", "--optimizer-cuda-graph", "--resume", "--overwrite"):  # fmt: skip
        assert flag in r.stdout, flag


def test_bad_flags_are_rejected():
    assert "--steps must be a positive integer" in _refused("--steps", "0")
    assert "min_lr" in _refused("--lr", "1e-3", "--min-lr", "1e-2")
    assert "invalid choice" in _refused("--graph", "opt")
    assert "must divide batch_size=8" in _refused("--batch-size", "8", "--micro-batches", "3")
    assert "on_nonfinite" in _refused("--graph", "full", "--on-nonfinite", "skip")


def test_megatron_style_flags_set_the_shared_fields(monkeypatch):
    from gpt_training import cli

    recipe = _load_recipe()
    monkeypatch.setattr(cli, "_check_hardware", lambda cfg, parser: None)  # no GPU needed here
    argv = ["--num-layers", "3", "--hidden-size", "64", "--num-heads", "2", "--seq-length", "32",
            "--clip-grad", "0.5"]  # fmt: skip
    c = recipe.parse_config(argv)
    assert (c.n_layer, c.n_embd, c.n_head, c.block_size, c.grad_clip) == (3, 64, 2, 32, 0.5)
    assert c.graph == "layer" and c.beta2 == 0.999 and c.out == "runs/megatron_gpt"
    assert recipe.MegatronTrainConfig.default_steps == 200


def test_precision_flags_name_megatron_lms_and_refuse_what_cannot_be_built(monkeypatch):
    """--transformer-impl, --bf16, --fp8-format/--fp8-recipe as Megatron-LM spells them; FP8
    without TE's spec or without bf16 is refused in one line (exit 2), before anything runs."""
    from gpt_training import cli

    from tgraph.integrations.megatron import wants_attention_mask
    from tgraph.integrations.megatron_te import precision_kwargs

    assert "FP8 needs --transformer-impl transformer_engine" in _refused("--fp8-format", "hybrid")
    assert "add --bf16" in _refused(
        "--transformer-impl", "transformer_engine", "--fp8-format", "hybrid"
    )
    assert "invalid choice" in _refused("--fp8-format", "mxfp8")
    recipe = _load_recipe()
    monkeypatch.setattr(cli, "_check_hardware", lambda cfg, parser: None)  # no GPU needed here
    c = recipe.parse_config(["--transformer-impl", "transformer_engine", "--bf16",
                             "--fp8-format", "e4m3", "--fp8-amax-history-len", "4"])  # fmt: skip
    assert c.te_spec and c.bf16 and c.fp8 == "delayed" and c.fp8_amax_history_len == 4
    assert recipe.parse_config([]).fp8 is None
    fields = precision_kwargs(bf16=True, fp8=c.fp8, fp8_format=c.fp8_format, amax_history_len=4)
    assert (fields["fp8"], fields["fp8_recipe"], fields["params_dtype"]) == (
        "e4m3",
        "delayed",
        torch.bfloat16,
    )
    assert "fp8" not in precision_kwargs(bf16=True, fp8=None, fp8_format="none")

    class TEDotProductAttention(torch.nn.Module):  # TE's spec attends causally, without a mask
        pass

    assert wants_attention_mask(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert not wants_attention_mask(torch.nn.Sequential(TEDotProductAttention()))


# -- GPU + megatron-core: the four graph modes, 8 steps at a tiny size --------------------------

TINY = ["--steps=8", "--num-layers=2", "--hidden-size=64", "--num-heads=4", "--seq-length=32",
        "--batch-size=8", "--micro-batches=2", "--lr=1e-2", "--min-lr=1e-3", "--warmup-steps=2",
        "--log-every=1", "--eval-every=4", "--eval-batches=2", "--ckpt-every=4",
        "--no-progress"]  # fmt: skip
RUNS = {  # name: extra flags
    "none": ["--graph=none"],
    "layer": ["--graph=layer"],
    "layer+opt": ["--graph=layer+opt"],
    "full": ["--graph=full"],
    # megatron eager with the capturable AdamW that layer+opt and full step
    "none_capturable": ["--graph=none", "--optimizer-cuda-graph"],
}


def _main(*argv: str) -> int:
    """The recipe's exit code, run in this process (megatron's process group of one is reused)."""
    try:
        _load_recipe().main([*TINY, *argv])
    except SystemExit as e:
        return e.code
    return 0


def _rows(out: Path, kind: str = "train") -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_file(str(ckpt / "model.safetensors"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, tuple[dict, list[dict]]]:
    """name -> (summary, train metrics rows), every run in this process (the recipe's main)."""
    root = tmp_path_factory.mktemp("megatron_recipe")
    done = {}
    for name, flags in RUNS.items():
        out = root / name.replace("+", "_")
        assert _main(*flags, f"--out={out}") == 0, name
        done[name] = (json.loads((out / "summary.json").read_text()), _rows(out))
    return done


@pytest.mark.cuda
@pytest.mark.megatron
def test_every_mode_trains_with_megatrons_optimizer(trained):
    for name, (summary, rows) in trained.items():
        assert summary["optimizer"] == "megatron get_megatron_optimizer adam", name
        assert summary["graph"] == RUNS[name][0].split("=")[1]
        assert summary["capturable_adam"] == (name not in ("none", "layer")), name
        assert summary["skipped_steps"] == 0 and summary["steps"] == 8, name
        assert [r["step"] for r in rows] == list(range(1, 9)), name
        assert all(math.isfinite(r["loss"]) for r in rows), (name, rows)
        assert all(r["skipped_steps"] == 0 for r in rows), name
        assert all(r["optimizer"] == summary["optimizer"] for r in rows), name
        assert all(math.isfinite(r["grad_norm"]) for r in rows), name
        assert rows[-1]["loss"] == summary["final_train_loss"], name
        assert math.isfinite(summary["final_val_loss"]), name
        if name.startswith("layer"):  # every layer call replayed, validation's forward too
            assert summary["eager_calls"] == 0, name  # (megatron's no_grad outputs: test_segments)


@pytest.mark.cuda
@pytest.mark.megatron
def test_modes_agree_on_losses_and_follow_megatrons_schedule(trained):
    _, ref_rows = trained["none"]
    for name in ("layer", "layer+opt", "full", "none_capturable"):
        _, rows = trained[name]
        # the first loss is computed before any update: the same model, batch and kernels
        torch.testing.assert_close(rows[0]["loss"], ref_rows[0]["loss"], rtol=1e-6, atol=0)
        # the first step's gradient norm: megatron's (eager) against tgraph's device-side one
        torch.testing.assert_close(
            rows[0]["grad_norm"], ref_rows[0]["grad_norm"], rtol=1e-4, atol=0
        )
        # megatron's OptimizerParamScheduler drives every mode: the same rate at every step
        torch.testing.assert_close(
            [r["lr"] for r in rows], [r["lr"] for r in ref_rows], rtol=1e-6, atol=1e-9
        )
    # warmup from 0 over 2 steps: steps 1, 2, 3 (1-based) run at 0, 5e-3 and 1e-2
    assert [r["lr"] for r in ref_rows[:3]] == pytest.approx([0.0, 5e-3, 1e-2], rel=1e-6)
    # then cosine to 1e-3 over 8 steps: the last step's (0-based 7) rate
    want = 1e-3 + 0.5 * (1e-2 - 1e-3) * (1 + math.cos(math.pi * (7 - 2) / (8 - 2)))
    assert ref_rows[-1]["lr"] == pytest.approx(want, rel=1e-6)
    assert trained["full"][1][-1]["lr"] == pytest.approx(want, rel=1e-6)
    # per-layer graphs with megatron's eager step: eager's numbers up to rounding
    final = {name: s["final_train_loss"] for name, (s, _) in trained.items()}
    assert final["layer"] == pytest.approx(final["none"], rel=2e-3)
    # both graph-stepped modes run the capturable AdamW: close to each other, and to megatron's
    # eager step with that AdamW (a learning rate frozen at capture would break this)
    assert final["layer+opt"] == pytest.approx(final["full"], rel=2e-3)
    assert final["layer+opt"] == pytest.approx(final["none_capturable"], rel=2e-3)
    assert final["full"] == pytest.approx(final["none_capturable"], rel=2e-3)


@pytest.mark.cuda
@pytest.mark.megatron
@pytest.mark.parametrize("graph", ["none", "layer", "layer+opt", "full"])
def test_resume_continues_bit_for_bit(graph, tmp_path, monkeypatch):
    """Killed after step 4's checkpoint, resumed: step 8's weights and optimizer state are
    those of the run that went straight through (megatron's optimizer state, its scheduler, the
    sampler and RNG states all come back)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert _main(f"--graph={graph}", f"--out={straight}") == 0
    with killed_after_checkpoint(monkeypatch, "step_000004"), pytest.raises(Killed):
        _main(f"--graph={graph}", f"--out={killed}")
    assert _main(f"--graph={graph}", f"--out={killed}", "--resume=latest") == 0
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_at"] == 4 and summary["steps"] == 8
    got, want = _weights(killed / "checkpoints/latest"), _weights(straight / "checkpoints/latest")
    assert got.keys() == want.keys() and got
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0, msg=k)
    assert [r["lr"] for r in _rows(killed)[-4:]] == [r["lr"] for r in _rows(straight)[-4:]]
    a = torch.load(killed / "checkpoints/latest/trainer.pt", weights_only=True)
    b = torch.load(straight / "checkpoints/latest/trainer.pt", weights_only=True)
    assert a["optimizer"]["scheduler"] == b["optimizer"]["scheduler"]
    assert a["optimizer"]["scheduler"]["num_steps"] == 8
    for p, st in b["optimizer"]["megatron"]["state"].items():
        for k, v in st.items():
            torch.testing.assert_close(a["optimizer"]["megatron"]["state"][p][k], v, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.megatron
def test_damaged_checkpoint_is_refused_and_out_rules_hold(tmp_path, capsys):
    out = tmp_path / "run"
    assert _main("--graph=layer", f"--out={out}") == 0
    ckpt = out / "checkpoints" / "step_000008"
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    assert set(manifest["sha256"]["model.safetensors"]) == set(_weights(ckpt))
    assert manifest["extra"]["trainer_sha256"]
    for name in ("config.json", "metrics.jsonl", "summary.json", "loss.png"):
        assert (out / name).is_file(), name
    capsys.readouterr()
    assert _main("--graph=layer", f"--out={out}") == 2  # a fresh run into it: refused
    assert "already holds a run" in capsys.readouterr().err
    path = ckpt / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF
    path.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert _main("--graph=layer", f"--out={out}", "--resume=latest", "--steps=12") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors is corrupt" in err, err
    assert "step_000004" in err  # the earlier checkpoint to resume from
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# -- GPU + megatron-core + TransformerEngine: --transformer-impl, --bf16, --fp8-format --------

# heads of 64 (TE's fused attention); every GEMM dimension a multiple of 16 (FP8)
TE_FLAGS = ["--transformer-impl=transformer_engine", "--bf16", "--hidden-size=128",
            "--num-heads=2", "--seq-length=64"]  # fmt: skip


@pytest.mark.cuda
@pytest.mark.megatron
@pytest.mark.te
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8_hybrid"])
def test_transformer_engine_spec_trains_agrees_and_resumes(fp8, tmp_path, monkeypatch, capsys):
    """megatron's GPTModel with TE's layer spec, bf16 parameters with megatron's bf16 optimizer,
    FP8 delayed scaling: eager and per-layer graphs plus the optimizer graph start from the same
    loss and train alike; a layer+opt run killed after step 4 and resumed ends with the weights
    of the run that went straight through: bitwise in bf16; in FP8 (found on the H200) the
    resumed run's first step is an eager recorded step where the straight run replays, and TE's
    FP8 GEMMs inside a capture may take another cuBLAS algorithm, so there its losses agree within
    that tolerance, while an eager FP8 run killed and resumed is bitwise: the checkpoint holds
    every state FP8 needs (TE's delayed-scaling metadata in ``_extra_state``, compared as the
    weights it produces: its pickled bytes differ between identical runs)."""
    flags = [*TE_FLAGS, *(["--fp8-format=hybrid"] if fp8 else [])]
    runs = {}
    for graph in ("none", "layer+opt"):
        out = tmp_path / graph.replace("+", "_")
        assert _main(*flags, f"--graph={graph}", f"--out={out}") == 0, graph
        runs[graph] = (json.loads((out / "summary.json").read_text()), _rows(out), out)
    (s_none, r_none, _), (s_opt, r_opt, straight) = runs["none"], runs["layer+opt"]
    assert s_opt["skipped_steps"] == 0
    assert s_opt["eager_calls"] == 0  # every TE layer call after the capture replayed
    cfg = json.loads((straight / "config.json").read_text())
    assert cfg["resolved"]["transformer_engine"]  # TE's version
    train = cfg["train"]
    assert (train["transformer_impl"], train["bf16"]) == ("transformer_engine", True)
    assert train["fp8_format"] == ("hybrid" if fp8 else "none")
    # the same model and first batch: eager's first loss (bf16 forward: a GEMM algorithm chosen
    # inside a capture may move it by a bf16 ulp)
    torch.testing.assert_close(r_opt[0]["loss"], r_none[0]["loss"], rtol=1e-2, atol=0)
    # the capturable AdamW and megatron's eager step part by rounding only; bf16 (and FP8)
    # forwards carry that, so the final losses agree to about 1% (a frozen learning rate or a
    # stale FP8 scale moves them by the size of the training's own change)
    assert s_opt["final_train_loss"] == pytest.approx(s_none["final_train_loss"], rel=2e-2)
    assert r_none[-1]["loss"] < r_none[0]["loss"] and r_opt[-1]["loss"] < r_opt[0]["loss"]

    def killed_and_resumed(graph: str) -> tuple[dict[str, torch.Tensor], list[dict]]:
        killed = tmp_path / f"killed_{graph.replace('+', '_')}"
        with killed_after_checkpoint(monkeypatch, "step_000004"), pytest.raises(Killed):
            _main(*flags, f"--graph={graph}", f"--out={killed}")
        if fp8:  # TE pickles delayed scaling's metadata and unpickles it only when told to
            monkeypatch.delenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", raising=False)
            assert _main(*flags, f"--graph={graph}", f"--out={killed}", "--resume=latest") == 1
            assert "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1" in capsys.readouterr().err
            monkeypatch.setenv("NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE", "1")
        assert _main(*flags, f"--graph={graph}", f"--out={killed}", "--resume=latest") == 0
        return _weights(killed / "checkpoints/latest"), _rows(killed)

    def weights(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in w.items() if not k.endswith("_extra_state")}

    (got, rows), want = killed_and_resumed("layer+opt"), _weights(straight / "checkpoints/latest")
    assert got.keys() == want.keys() and got
    extra = [k for k in got if k.endswith("_extra_state")]
    assert not fp8 or any(got[k].numel() for k in extra), "no FP8 metadata was saved"
    if not fp8:
        for k, v in got.items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    else:  # the capture's tolerance: the resumed steps' losses within 1e-3 of the straight
        # run's (a stale FP8 scale or a lost amax history moves them by the training's own
        # change). The weights are not compared: AdamW's normalised steps turn the ulp-sized
        # gradient differences of near-zero biases into steps of the learning rate's size
        assert [r["step"] for r in rows] == [r["step"] for r in r_opt]
        for a, b in zip(rows[4:], r_opt[4:], strict=True):
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-3), (a, b)
        # eager: the checkpoint alone makes a resumed FP8 run bitwise
        (eager, _), want = (
            killed_and_resumed("none"),
            _weights(runs["none"][2] / "checkpoints/latest"),
        )
        for k, v in weights(eager).items():
            torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
