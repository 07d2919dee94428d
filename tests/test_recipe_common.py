"""Both training recipes, train_gpt.py and train_hf.py, get the same protections from the shared
trainer (``recipes/gpt_training``): each test runs against both, through the recipe's ``main``.

A damaged checkpoint is refused in one line and nothing is overwritten; ``--resume latest``
without ``--steps`` continues to the run's own total, bit for bit; bad ``--out`` values are refused
in one line before anything runs; a non-finite loss stops before a checkpoint; Ctrl-C writes a
checkpoint; the run directory gets metrics, summary and plot; torchrun runs two processes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpt_training import trainer  # recipes/ is on sys.path: tests/conftest.py
from killed_runs import Killed, killed_after_checkpoint
from safetensors.torch import load_file

from tgraph.toy import corpus
from tgraph.toy.corpus import BatchSampler

pytest.importorskip("transformers", reason="needs transformers (pip install 'tgraph[dev]')")

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TINY = ["--n-layer=2", "--n-embd=32", "--n-head=2", "--block-size=16", "--batch-size=2",
        "--warmup-steps=1", "--lr=1e-2", "--min-lr=1e-3", "--log-every=2", "--ckpt-every=2",
        "--eval-every=2", "--eval-batches=2", "--device=cpu", "--graph=none", "--no-progress"]  # fmt: skip


def _load(name: str):
    path = RECIPES / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded  # another test file loaded it already: share its classes
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and inspect look classes up by module name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=["train_gpt", "train_hf"])
def recipe(request, monkeypatch):
    """The recipe module; both train on a small random byte stream (seconds, not the corpus)."""
    data = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(trainer, "load_split", lambda *a, **k: data.to(torch.uint8))
    return _load(request.param)


def spec_of(recipe):
    return getattr(recipe, "HF_SPEC", None) or recipe.GPT_SPEC


def main(recipe, *argv: str) -> int:
    """The recipe's exit code for ``argv`` (after the tiny flags), run in this process."""
    try:
        recipe.main([*TINY, *argv])
    except SystemExit as e:
        return e.code
    return 0


def ckpts(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def files(out: Path) -> dict[str, bytes]:
    """Every file under ``out/checkpoints`` and its bytes (and where ``latest`` points)."""
    root = out / "checkpoints"
    got = {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    return {**got, "latest ->": os.readlink(root / "latest").encode()}


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


@pytest.fixture
def finished(recipe, tmp_path) -> Path:
    """A finished 4-step run of the recipe: checkpoints at steps 2 and 4."""
    out = tmp_path / "run"
    assert main(recipe, f"--out={out}", "--steps=4") == 0
    assert ckpts(out) == ["step_000002", "step_000004"]
    return out


def test_run_directory_has_metrics_summary_plot(finished):
    for name in ("config.json", "metrics.jsonl", "summary.json", "loss.png"):
        assert (finished / name).is_file(), name
    rows = [json.loads(ln) for ln in (finished / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"train", "val"} and rows[-1]["step"] == 4
    assert json.loads((finished / "summary.json").read_text())["steps"] == 4
    manifest = (
        "checkpoint.json"
        if (finished / "checkpoints/latest/checkpoint.json").exists()
        else "config.json"
    )
    recorded = json.loads((finished / "checkpoints" / "latest" / manifest).read_text())
    assert recorded["sha256"] and recorded["extra"]["trainer_sha256"]


def test_damaged_weights_are_refused_in_one_line_and_nothing_is_overwritten(
    recipe, finished, capsys
):
    path = finished / "checkpoints" / "step_000004" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF  # two flipped bytes in the last tensor's data
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    before = files(finished)
    capsys.readouterr()
    code = main(recipe, f"--out={finished}", "--resume=latest", "--steps=8")
    err = one_line_error(capsys)
    assert code == 1 and err.startswith("error: cannot resume from "), err
    assert "model.safetensors is corrupt" in err and "--resume " in err and "step_000002" in err
    assert files(finished) == before  # nothing written, pruned or re-pointed


def test_damaged_trainer_state_is_refused(recipe, finished, capsys):
    path = finished / "checkpoints" / "step_000004" / "trainer.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    before = files(finished)
    capsys.readouterr()
    assert main(recipe, f"--out={finished}", "--resume=latest", "--steps=8") == 1
    assert "trainer.pt differs from the one recorded" in one_line_error(capsys)
    assert files(finished) == before


def test_resume_latest_without_steps_continues_to_the_runs_total_bit_for_bit(
    recipe, tmp_path, monkeypatch
):
    straight = tmp_path / "straight"
    assert main(recipe, f"--out={straight}", "--steps=6") == 0
    killed = tmp_path / "killed"
    with killed_after_checkpoint(monkeypatch, "step_000004"), pytest.raises(Killed):
        main(recipe, f"--out={killed}", "--steps=6")
    assert main(recipe, f"--out={killed}", "--resume=latest") == 0  # no --steps: the run's 6
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["resumed_at"] == 4
    assert ckpts(killed)[-1] == "step_000006"
    got, want = weights(killed / "checkpoints" / "latest"), weights(straight / "checkpoints/latest")
    assert got.keys() == want.keys()
    for k in got:  # CPU kernels, same order, same thread count: bit for bit
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


@pytest.mark.parametrize("out", ["", ".", "./", "runs/.."])
def test_out_that_names_no_run_directory_is_refused(recipe, out, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a recipe that took it would write here, not into the checkout
    assert main(recipe, f"--out={out}", "--steps=2") == 2
    assert "out=" in one_line_error(capsys)


@pytest.mark.parametrize("flag", ["--beta1=1.0", "--beta2=-0.1", "--beta2=nan"])
def test_adam_betas_out_of_range_are_one_line_before_anything_is_written(
    recipe, flag, tmp_path, capsys
):
    """Before: a traceback from torch.optim.AdamW, and an empty run directory left behind."""
    out = tmp_path / "run"
    assert main(recipe, f"--out={out}", flag) == 2
    name = flag[2:7]
    assert f"{name}=" in one_line_error(capsys) and not out.exists()


@pytest.mark.parametrize(
    "flag", ["--grad-clip=nan", "--grad-clip=inf", "--weight-decay=nan", "--weight-decay=-1"]
)
def test_clip_and_decay_out_of_range_are_one_line_before_anything_is_written(
    recipe, flag, tmp_path, capsys
):
    """Before: NaN passed the `< 0` checks; clipping went silently off (--graph layer+opt
    raised a 34-line traceback from the optimizer graph), a NaN decay stopped at step 2
    advising a lower --lr."""
    out = tmp_path / "run"
    assert main(recipe, f"--out={out}", flag) == 2
    name = flag[2:].split("=")[0].replace("-", "_")
    assert f"{name}=" in one_line_error(capsys) and not out.exists()


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--seed=99999999999999999999", "seed=99999999999999999999 is invalid: use an integer"),
        ("--val-fraction=0.999999", "the 'train' split is empty with val_fraction=0.999999"),
        ("--val-fraction=1e-9", "the 'val' split is empty with val_fraction=1e-09"),
        ("--block-size=100000000", "cannot hold a window of block_size=100000000"),
    ],
    ids=["seed", "no-train-files", "no-val-files", "block-size"],
)
def test_data_the_corpus_cannot_give_is_one_line_before_anything_is_written(
    recipe, flag, message, tmp_path, monkeypatch, capsys
):
    """Before: tracebacks from torch.manual_seed and from the corpus, after --out was created
    (and, for the toy GPT, a 100M-position embedding built)."""
    monkeypatch.setattr(trainer, "load_split", corpus.load_split)  # the real split, by file
    out = tmp_path / "run"
    assert main(recipe, f"--out={out}", flag) == 2
    assert message in one_line_error(capsys) and not out.exists()


def test_help_words_every_graph_mode(recipe, capsys):
    """Before: train_hf's --help said none, layer or full, and left layer+opt out."""
    with pytest.raises(SystemExit):
        recipe.parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    graph_help = text[text.rindex("--graph {") :].split("(default:")[0]  # the option, not usage
    modes = recipe.parse_config([]).graph_modes
    assert ("layer+opt" in modes) == (recipe.__name__ == "train_hf")
    for mode in modes:
        assert f'"{mode}" (' in graph_help, graph_help


def tree(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` and its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def test_fresh_run_into_a_directory_of_run_files_without_checkpoints_is_refused(
    recipe, tmp_path, capsys
):
    """Before: a fresh run silently replaced the user's config.json, summary.json, metrics.jsonl
    and loss.png (no checkpoint there, so nothing was refused)."""
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("config.json", "summary.json", "metrics.jsonl", "loss.png"):
        (out / name).write_text(f"the user's {name}\n")
    before = tree(out)
    assert main(recipe, f"--out={out}", "--steps=2") == 2
    err = one_line_error(capsys)
    assert f"{out} already holds a run's files" in err and "empty or new --out" in err, err
    assert tree(out) == before
    assert main(recipe, f"--out={out}", "--steps=2", "--overwrite") == 0  # asked for: replaced
    assert ckpts(out) == ["step_000002"]
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_a_model_directory_given_as_out_is_never_written(recipe, finished, tmp_path, capsys):
    """A checkpoint directory (transformers' save_pretrained output for train_hf) as --out:
    refused, with or without --overwrite, and it still loads afterwards."""
    model_dir = shutil.copytree(finished / "checkpoints" / "step_000004", tmp_path / "model")
    before = tree(model_dir)
    capsys.readouterr()
    for extra in ([], ["--overwrite"]):
        assert main(recipe, f"--out={model_dir}", "--steps=2", *extra) == 2
        err = one_line_error(capsys)
        assert f"--out {model_dir} is not empty and holds files this recipe did not write" in err
        assert "model.safetensors" in err and "empty or new --out" in err, err
    assert tree(model_dir) == before
    model = spec_of(recipe).build(recipe.parse_config([*TINY]), torch.device("cpu"))
    spec_of(recipe).load_weights(model, model_dir)  # verified against its manifest: intact


def test_out_holding_another_run_is_refused(recipe, finished, tmp_path, capsys):
    before = files(finished)
    capsys.readouterr()
    assert main(recipe, f"--out={finished}", "--steps=2") == 2
    err = one_line_error(capsys)
    assert "already holds a run" in err and "--resume latest" in err and "--overwrite" in err
    assert files(finished) == before
    a_file = tmp_path / "a_file"
    a_file.write_text("not a run\n")
    assert main(recipe, f"--out={a_file}") == 2
    assert "is a file, not a directory" in one_line_error(capsys)
    other = shutil.copytree(finished, tmp_path / "other", symlinks=True)
    resume = str(other / "checkpoints" / "step_000002")
    assert main(recipe, f"--out={finished}", f"--resume={resume}", "--steps=8") == 2
    assert "is not a checkpoint of the run" in one_line_error(capsys)


def test_nonfinite_loss_stops_before_a_checkpoint(recipe, tmp_path, monkeypatch, capsys):
    spec, calls = spec_of(recipe), [0]
    real = spec.loss

    def loss(net, x, y):  # nan at the third training step, between the checkpoints of 2 and 4
        value = real(net, x, y)
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] == 3:
                return value * float("nan")
        return value

    monkeypatch.setattr(spec, "loss", loss)
    out = tmp_path / "run"
    assert main(recipe, f"--out={out}", "--steps=4") == 1
    assert "not finite" in one_line_error(capsys)
    assert ckpts(out) == ["step_000002"]


def test_ctrl_c_writes_a_checkpoint_and_stops(recipe, tmp_path, monkeypatch, capsys):
    """The hint it prints is a command line that continues the run: before, it left out the
    model flags, so following it failed for any size but the default."""
    real, calls = BatchSampler.next, [0]

    def next_with_ctrl_c(self):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGINT)  # during step 3: it finishes, then stops
        return real(self)

    monkeypatch.setattr(BatchSampler, "next", next_with_ctrl_c)
    out = tmp_path / "run"
    assert main(recipe, f"--out={out}", "--steps=8") == 130
    assert ckpts(out) == ["step_000002", "step_000003"]
    assert os.readlink(out / "checkpoints" / "latest") == "step_000003"
    hint = shlex.split(one_line_error(capsys).split("Continue with ")[1])
    assert "--n-layer" in hint and "--n-embd" in hint and "--block-size" in hint, hint
    ran, told = recipe.parse_config([*TINY, f"--out={out}"]), recipe.parse_config(hint)
    must_match = ran.run_only_fields() ^ {f.name for f in dataclasses.fields(ran)}
    assert {k: getattr(told, k) for k in must_match} == {k: getattr(ran, k) for k in must_match}
    monkeypatch.setattr(BatchSampler, "next", real)
    assert recipe.main(hint) in (None, 0)  # followed as printed: the run continues to its end
    assert ckpts(out)[-1] == "step_000008"


def test_hf_checkpoint_loads_with_from_pretrained(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    data = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(trainer, "load_split", lambda *a, **k: data.to(torch.uint8))
    th = _load("train_hf")
    out = tmp_path / "run"
    assert main(th, f"--out={out}", "--steps=2", "--arch=gpt2", "--graph=layer") == 0
    ckpt = out / "checkpoints" / "step_000002"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert type(model).__name__ == "GPT2LMHeadModel"
    saved = weights(ckpt)
    for k, v in model.state_dict().items():  # lm_head is tied to wte: save_pretrained drops it
        torch.testing.assert_close(v, saved.get(k, saved["transformer.wte.weight"]), rtol=0, atol=0)
    manifest = json.loads((ckpt / "checkpoint.json").read_text())
    assert set(manifest["sha256"]["model.safetensors"]) == set(saved)


def _torchrun(name: str, out: Path, graph: str = "none") -> dict[str, torch.Tensor]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(RECIPES / f"{name}.py"), *TINY, "--steps=4", f"--out={out}", f"--graph={graph}"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    if graph in ("layer", "layer+opt"):  # every graphed call after the capture replayed
        assert summary["eager_calls"] == 0
    else:
        assert "eager_calls" not in summary
    assert ckpts(out) == ["step_000002", "step_000004"]
    return weights(out / "checkpoints" / "latest")


@pytest.mark.parametrize("name", ["train_gpt", "train_hf"])
def test_torchrun_two_processes(name, tmp_path):
    _torchrun(name, tmp_path / "run")


def test_torchrun_hf_graph_modes_match_eager(tmp_path):
    """DDP (layer+opt, every layer call replayed: no eager call) and the full graph's own
    all-reduce: the eager run's weights, bitwise."""
    eager = _torchrun("train_hf", tmp_path / "none")
    for graph in ("layer+opt", "full"):
        got = _torchrun("train_hf", tmp_path / graph.replace("+", "_"), graph)
        for k in eager:
            torch.testing.assert_close(got[k], eager[k], rtol=0, atol=0, msg=f"{graph} {k}")


def test_a_resumed_optimizer_gets_its_group_tensors_back():
    """The megatron recipe's resume with TransformerEngine's capturable FusedAdam (failed on the
    H200 before): its lr, a device tensor saved as a float, is filled back into the tensor this
    run built; its step count, loaded on the host, moves to the parameters' device."""
    from gpt_training.megatron_step import restore_group_tensors

    p = torch.nn.Parameter(torch.zeros(2, device="meta"))
    lr = torch.tensor(0.5)
    built = [{"params": [p], "lr": lr}]
    loaded = [{"params": [p], "lr": 0.25, "step": torch.tensor(3.0)}]
    restore_group_tensors(built, loaded)
    assert loaded[0]["lr"] is lr and lr.item() == 0.25  # the same tensor (graphs hold it)
    assert loaded[0]["step"].device.type == "meta"
    plain = [{"params": [p], "lr": 0.25}]
    restore_group_tensors([{"params": [p], "lr": 0.5}], plain)
    assert plain[0]["lr"] == 0.25  # a float lr stays a float


class _Float16OptimizerStandIn:
    """megatron's Float16OptimizerWithFloat16Params' state-dict shape: the torch optimizer's under
    ``"optimizer"``, its fp32 masters beside it (the megatron recipe's --bf16 failed on it)."""

    def __init__(self, opt):
        self.opt = opt

    @property
    def param_groups(self):
        return self.opt.param_groups

    def state_dict(self):
        return {"optimizer": self.opt.state_dict(), "fp32_from_fp16_params": [[torch.ones(2)]]}

    def load_state_dict(self, state):
        assert set(state) == {"optimizer", "fp32_from_fp16_params"}
        self.opt.load_state_dict(state["optimizer"])


class _Schedule:
    def state_dict(self):
        return {"num_steps": 3}

    def load_state_dict(self, state):
        assert state == {"num_steps": 3}


@pytest.mark.parametrize("wrapped", [False, True], ids=["fp32_optimizer", "float16_optimizer"])
def test_megatron_optimizer_state_round_trips_in_both_shapes(wrapped):
    from gpt_training.megatron_step import MegatronOptim

    def build(lr):
        p = torch.nn.Parameter(torch.ones(2))
        inner = torch.optim.AdamW([p], lr=torch.tensor(lr), capturable=False)
        p.grad = torch.ones(2)
        inner.step()
        mo = MegatronOptim.__new__(MegatronOptim)  # without megatron: its parts stood in for
        mo.mopt = _Float16OptimizerStandIn(inner) if wrapped else inner
        mo.sched, mo.capturable = _Schedule(), False
        return mo, inner

    src, _ = build(0.25)
    state = src.state_dict()
    groups = (state["megatron"]["optimizer"] if wrapped else state["megatron"])["param_groups"]
    assert groups[0]["lr"] == 0.25 and isinstance(groups[0]["lr"], float)
    dst, inner = build(0.5)
    lr = inner.param_groups[0]["lr"]
    dst.load_state_dict(state)
    assert inner.param_groups[0]["lr"] is lr and lr.item() == 0.25
