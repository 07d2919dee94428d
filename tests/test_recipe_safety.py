"""recipes/train_gpt.py never loses a trained model.

Re-running into an existing --out, a non-finite loss, Ctrl-C, continuing a finished run: each
test plants a situation a user met and fails on a recipe that loses the model or trains on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from gpt_training.checkpointing import resolve_resume
from gpt_training.optim import lr_at
from safetensors.torch import load_file

from tgraph.toy.corpus import BatchSampler
from tgraph.toy.gpt import GPT

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_gpt.py"


def _load_recipe():
    loaded = sys.modules.get("train_gpt")
    if loaded is not None and getattr(loaded, "__file__", None) == str(RECIPE):
        return loaded  # tests/test_train_recipe.py loaded it already: share the classes
    spec = importlib.util.spec_from_file_location("train_gpt", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # dataclasses and inspect look classes up by module name
    spec.loader.exec_module(module)
    return module


tg = _load_recipe()

# Seconds on 2 CPU cores: eager (the graph modes are covered by tests/test_train_recipe.py).
TINY = dict(batch_size=4, block_size=32, n_layer=2, n_head=2, n_embd=32, steps=8,
            warmup_steps=2, lr=1e-2, min_lr=1e-3, eval_every=4, eval_batches=2, ckpt_every=4,
            log_every=2, progress=False, device="cpu", graph="none")  # fmt: skip
CLI_TINY = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]


def cfg(out: Path, **overrides) -> tg.TrainConfig:
    return tg.TrainConfig(**{**TINY, "out": str(out), **overrides})


def ckpts(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


def latest(out: Path) -> str:
    return os.readlink(out / "checkpoints" / "latest")


def params(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:  # CPU kernels, same order, same thread count: bit for bit
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, str(RECIPE), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 8-step run: checkpoints at steps 4 and 8."""
    out = tmp_path_factory.mktemp("finished") / "run"
    tg.train(cfg(out))
    return out


def copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


# -- 1. re-running into an existing --out -------------------------------------------------------


def test_rerun_into_an_existing_out_is_refused(finished, tmp_path):
    """Before: the new run's step_000004 was pruned in favour of the old run's step_000008."""
    out = copy_run(finished, tmp_path / "run")
    before = params(out / "checkpoints" / "step_000008")
    with pytest.raises(tg.RunDirectoryError, match="already holds a run") as err:
        tg.train(cfg(out, steps=4))
    for hint in ("--resume latest", "--steps N", "empty or new --out", "--overwrite"):
        assert hint in str(err.value)
    assert ckpts(out) == ["step_000004", "step_000008"] and latest(out) == "step_000008"
    assert_same(params(out / "checkpoints" / "step_000008"), before)  # untouched


def test_overwrite_starts_a_fresh_run(finished, tmp_path):
    out = copy_run(finished, tmp_path / "run")
    tg.train(cfg(out, steps=4, overwrite=True))
    assert ckpts(out) == ["step_000004"] and latest(out) == "step_000004"
    assert json.loads((out / "summary.json").read_text())["steps"] == 4
    with pytest.raises(tg.RunDirectoryError, match="--overwrite would delete"):
        tg.train(cfg(out, steps=8, overwrite=True, resume="latest"))


def test_cli_refusal_is_one_line_with_exit_code_2(finished, tmp_path):
    out = copy_run(finished, tmp_path / "run")
    proc = run_cli(*CLI_TINY, f"--out={out}", "--no-progress")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


class _Killed(BaseException):
    """Stands for SIGKILL: nothing in the recipe catches it."""


def test_resume_from_an_earlier_checkpoint_keeps_its_own_latest(tmp_path, monkeypatch):
    """Before: pruning kept the old run's higher steps and deleted the step just written, and
    --resume latest then picked the old run's highest step."""
    out = tmp_path / "run"
    tg.train(cfg(out, ckpt_every=2, keep_checkpoints=3))
    assert ckpts(out) == ["step_000004", "step_000006", "step_000008"]
    uninterrupted = params(out / "checkpoints" / "step_000008")
    real_next = BatchSampler.next
    calls = {"n": 0}

    def next_or_die(self):
        calls["n"] += 1
        if calls["n"] == 2:  # drawing step 6's batch, after step 5's checkpoint
            raise _Killed
        return real_next(self)

    monkeypatch.setattr(BatchSampler, "next", next_or_die)
    from_4 = str(out / "checkpoints" / "step_000004")
    with pytest.raises(_Killed):
        tg.train(cfg(out, resume=from_4, ckpt_every=1, keep_checkpoints=2))
    monkeypatch.undo()
    assert "step_000005" in ckpts(out) and latest(out) == "step_000005"
    assert resolve_resume(cfg(out, resume="latest")).name == "step_000005"
    summary = tg.train(cfg(out, resume="latest"))
    assert summary["resumed_at"] == 5
    assert_same(params(out / "checkpoints" / "latest"), uninterrupted)


def test_checkpoint_killed_mid_write_leaves_the_previous_one_to_resume(finished, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    """The step-8 checkpoint dies after trainer.pt, inside the model save: no step_000008
    appears, latest still names step_000004, and resuming it gives the uninterrupted weights."""
    from tgraph.toy import checkpoint

    out = tmp_path / "run"
    real_save = checkpoint.save

    def save_or_die(model, directory, **kw):
        if directory.name.endswith("step_000008"):
            (directory / "model.safetensors").write_bytes(b"half")
            raise _Killed
        return real_save(model, directory, **kw)

    monkeypatch.setattr(checkpoint, "save", save_or_die)
    with pytest.raises(_Killed):
        tg.train(cfg(out))
    monkeypatch.undo()
    assert ckpts(out) == ["step_000004"] and latest(out) == "step_000004"
    assert tg.train(cfg(out, resume="latest"))["resumed_at"] == 4
    assert_same(params(out / "checkpoints" / "latest"), params(finished / "checkpoints" / "latest"))


def test_pruning_keeps_the_newest_checkpoints(tmp_path):
    out = tmp_path / "run"
    tg.train(cfg(out, ckpt_every=2, keep_checkpoints=1))
    assert ckpts(out) == ["step_000008"] and latest(out) == "step_000008"
    with pytest.raises(tg.RunDirectoryError, match="nothing to do"):  # the kept one resumes
        tg.train(cfg(out, resume="latest"))


# -- 2. non-finite losses and damaged checkpoints -----------------------------------------------


def plant_nan_loss(monkeypatch, at_calls: set[int]) -> None:
    """Make the training forward of the given (1-based) calls return a nan loss."""
    real = GPT.forward
    calls = {"n": 0}

    def forward(self, idx, targets=None):
        logits, loss = real(self, idx, targets)
        if self.training:
            calls["n"] += 1
            if calls["n"] in at_calls:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)


def test_nonfinite_loss_stops_before_a_checkpoint_between_log_steps(tmp_path, monkeypatch):
    """Before: the run went on and wrote all-nan checkpoints. Step 4 is a checkpoint step but
    not a log step (every 5), so the check before the checkpoint catches it."""
    out = tmp_path / "run"
    plant_nan_loss(monkeypatch, {4})
    with pytest.raises(tg.NonFiniteLossError, match=r"step 4: .* not finite .* no checkpoint"):
        tg.train(cfg(out, log_every=5, eval_every=0))
    assert ckpts(out) == []


def test_huge_learning_rate_stops_with_a_clear_message(tmp_path):
    """--lr 1000 --grad-clip 0 must not train to nan without a word."""
    out = tmp_path / "run"
    with pytest.raises(tg.NonFiniteLossError, match="Lower --lr, keep --grad-clip above 0"):
        tg.train(cfg(out, lr=1000.0, grad_clip=0.0, steps=40, ckpt_every=2, eval_every=0))
    for name in ckpts(out):  # every checkpoint written before the stop is finite
        assert all(torch.isfinite(t).all() for t in params(out / "checkpoints" / name).values())


def test_skip_mode_skips_nonfinite_steps(tmp_path, monkeypatch):
    out = tmp_path / "run"
    plant_nan_loss(monkeypatch, {3})
    summary = tg.train(cfg(out, on_nonfinite="skip"))
    assert summary["skipped_steps"] == 1 and math.isfinite(summary["final_train_loss"])
    assert all(torch.isfinite(t).all() for t in params(out / "checkpoints" / "latest").values())
    with pytest.raises(ValueError, match=r"on_nonfinite=.*skip needs --graph none, layer or model"):
        cfg(out, on_nonfinite="skip", graph="full")


def test_skip_mode_skips_nonfinite_steps_of_the_whole_model_graph(tmp_path, monkeypatch):
    """--graph model keeps the optimizer step eager, so it can skip (the refusal of skip with
    --graph full or layer+opt used to name none and layer alone): a nan loss, made from the
    graph's loss outside it, skips its step and the graphed model replays on."""
    real, calls = tg.GPT_SPEC.loss, []

    def loss(net, x, y):
        out = real(net, x, y)
        calls.append(net.training)
        return out * float("nan") if net.training and calls.count(True) == 3 else out

    monkeypatch.setattr(tg.GPT_SPEC, "loss", loss)
    out = tmp_path / "run"
    summary = tg.train(cfg(out, on_nonfinite="skip", graph="model"))
    assert summary["skipped_steps"] == 1 and math.isfinite(summary["final_train_loss"])
    assert summary["eager_calls"] == 0
    assert all(torch.isfinite(t).all() for t in params(out / "checkpoints" / "latest").values())


def test_damaged_checkpoint_is_refused_and_names_an_earlier_one(finished, tmp_path):
    """4 KiB of step_000008's tensor bytes overwritten, then resumed."""
    out = copy_run(finished, tmp_path / "run")
    path = out / "checkpoints" / "step_000008" / "model.safetensors"
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 100 : header + 100 + 4096] = b"\x00" * 4096
    path.write_bytes(bytes(data))
    match = (
        r"model.safetensors is corrupt.*Resume from an earlier checkpoint: --resume .*step_000004"
    )
    with pytest.raises(tg.CheckpointError, match=match):
        tg.train(cfg(out, resume="latest", steps=12))


@pytest.mark.parametrize("config", ["deleted", "broken", "no_sha256", "null_sha256"])
def test_resume_refuses_weights_it_cannot_verify(finished, tmp_path, capsys, config):
    """config.json deleted, cut to '{"broken', or without its tensors' sha256 (the entry
    removed or null; trainer.pt's digest intact), and two bytes of the weights flipped: the
    resume used to train on them and write a checkpoint with fresh checksums of the damage."""
    out = copy_run(finished, tmp_path / "run")
    ckpt = out / "checkpoints" / "step_000008"
    if config == "deleted":
        (ckpt / "config.json").unlink()
    elif config == "broken":
        (ckpt / "config.json").write_text('{"broken')
    else:
        body = json.loads((ckpt / "config.json").read_text())
        if config == "no_sha256":
            del body["sha256"]
        else:
            body["sha256"] = None
        (ckpt / "config.json").write_text(json.dumps(body))
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-6] ^= 0xFF
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    code, err = _main_error(capsys, f"--out={out}", "--resume=latest", "--steps=12")
    assert code == 1 and err.startswith("error: cannot resume from "), err
    assert "config.json" in err and "--resume " in err  # the file and the fix
    if config.endswith("sha256"):
        assert "records no sha256 checksums" in err, err
    assert ckpts(out) == ["step_000004", "step_000008"] and latest(out) == "step_000008"
    assert weights.read_bytes() == bytes(data)  # nothing laundered


def test_bad_resume_into_an_out_holding_a_run_names_the_resume(finished, tmp_path):
    out = copy_run(finished, tmp_path / "run")
    with pytest.raises(tg.CheckpointError, match="no checkpoint at .*nowhere"):
        tg.train(cfg(out, resume=str(tmp_path / "nowhere")))
    other = copy_run(finished, tmp_path / "other")
    elsewhere = str(other / "checkpoints" / "step_000004")
    with pytest.raises(tg.RunDirectoryError, match="--resume .* is not a checkpoint of the run"):
        tg.train(cfg(out, resume=elsewhere, steps=12))
    assert ckpts(out) == ["step_000004", "step_000008"]


# -- 3. continuing a finished run ---------------------------------------------------------------


def test_finished_run_continues_with_more_steps_at_min_lr(finished, tmp_path):
    """Before: --steps was locked ("steps=8 in the checkpoint but 12 now")."""
    out = copy_run(finished, tmp_path / "run")
    summary = tg.train(cfg(out, resume="latest", steps=12))
    assert summary["resumed_at"] == 8 and summary["steps"] == 12
    assert summary["lr_decay_steps"] == 8  # the first start's horizon
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if r["kind"] == "train"}
    assert lrs[10] == lrs[12] == pytest.approx(TINY["min_lr"])
    assert latest(out) == "step_000012"
    # Continued again: the horizon is still the first start's.
    assert tg.train(cfg(out, resume="latest", steps=14))["lr_decay_steps"] == 8
    with pytest.raises(tg.RunDirectoryError, match="nothing to do. Pass --steps larger than 14"):
        tg.train(cfg(out, resume="latest", steps=14))


def test_lr_schedule_holds_min_lr_after_its_horizon():
    c = tg.TrainConfig(steps=200, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert lr_at(99, c, decay_steps=100) == pytest.approx(0.1, abs=1e-3)
    assert lr_at(150, c, decay_steps=100) == lr_at(199, c, decay_steps=100) == 0.1
    assert lr_at(150, c) > 0.1  # without a horizon: the cosine of --steps


# -- 4. Ctrl-C ------------------------------------------------------------------------------------


def test_ctrl_c_writes_a_checkpoint_and_resume_is_exact(finished, tmp_path, monkeypatch):
    """Before: KeyboardInterrupt with a 43-line traceback and no checkpoint of the last step."""
    out = tmp_path / "run"
    real_next = BatchSampler.next
    calls = {"n": 0}

    def next_with_ctrl_c(self):
        calls["n"] += 1
        if calls["n"] == 3:
            signal.raise_signal(signal.SIGINT)  # during step 3: it finishes, then stops
        return real_next(self)

    monkeypatch.setattr(BatchSampler, "next", next_with_ctrl_c)
    hint = (
        r"after step 3: saved .*step_000003\. Continue with --out .* --resume latest --steps 8 "
        r"--block-size 32 --n-layer 2 --n-head 2 --n-embd 32 --batch-size 4 --lr 0\.01 "
        r"--min-lr 0\.001 --warmup-steps 2$"
    )
    with pytest.raises(tg.TrainingInterrupted, match=hint) as err:
        tg.train(cfg(out))
    monkeypatch.undo()
    assert err.value.checkpoint.name == "step_000003" and latest(out) == "step_000003"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handler restored
    summary = tg.train(cfg(out, resume="latest", steps=None))  # --steps unset: the run's 8
    assert summary["resumed_at"] == 3 and summary["steps"] == 8
    assert_same(params(out / "checkpoints" / "latest"), params(finished / "checkpoints" / "latest"))


def test_unset_steps_keeps_the_checkpoints_total(finished, tmp_path):
    """Before: --resume latest without --steps meant 2000 steps, whatever the run's total."""
    assert tg.parse_config(["--resume", "latest"]).steps is None
    out = copy_run(finished, tmp_path / "run")
    with pytest.raises(tg.RunDirectoryError, match="at step 8 and --steps is 8: nothing to do"):
        tg.train(cfg(out, resume="latest", steps=None))
    assert tg.TrainConfig(steps=None).with_steps(None).steps == 2000  # a fresh run's default
    assert tg.TrainConfig(steps=None).with_steps(300).steps == 300
    assert tg.TrainConfig(steps=12).with_steps(300).steps == 12  # given: kept


def test_ctrl_c_on_the_command_line_exits_cleanly(tmp_path):
    out = tmp_path / "run"
    args = [*CLI_TINY, "--steps=100000", "--log-every=1", "--ckpt-every=0", "--eval-every=0"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, str(RECIPE), *args, f"--out={out}", "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").stat().st_size:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == tg.EXIT_INTERRUPTED, stderr[-2000:]
    assert "Traceback" not in stderr
    assert "interrupted (Ctrl-C) after step" in stderr
    assert "--resume latest --steps 100000" in stderr
    assert latest(out).startswith("step_")


# -- the main job, run twice ------------------------------------------------------------------------


def test_quickstart_twice_keeps_the_first_run(tmp_path):
    """quickstart, then quickstart --steps 50: the second run must not delete the first run's
    checkpoints (and exit 1 in generate); it is refused before training."""
    script = RECIPE.parents[1] / "scripts" / "quickstart.sh"
    out = tmp_path / "run"
    flags = ["--batch-size=2", "--block-size=128", "--n-layer=1", "--n-head=2", "--n-embd=16",
             "--steps=4", "--warmup-steps=1", "--eval-every=0", "--eval-batches=1",
             "--ckpt-every=0", "--log-every=2", "--graph=none", "--device=cpu", "--no-progress"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def quickstart(*extra: str) -> subprocess.CompletedProcess:
        cmd = ["bash", str(script), *flags, "--out", str(out), *extra]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)

    first = quickstart()
    assert first.returncode == 0, first.stderr[-3000:]
    assert "----- sample 3 of 3" in first.stdout and "checkpoints/latest -> step_000004" in (
        first.stderr
    )
    second = quickstart("--steps=2")
    assert second.returncode == 2 and "already holds a run" in second.stderr
    assert "Traceback" not in second.stderr and "sample" not in second.stdout
    assert ckpts(out) == ["step_000004"] and latest(out) == "step_000004"


# -- one-line errors ------------------------------------------------------------------------------


def _main_error(capsys, *argv: str) -> tuple[int, str]:
    """Run the recipe's main in this process; its exit code and stderr."""
    with pytest.raises(SystemExit) as exit_info:
        tg.main([*CLI_TINY, "--no-progress", *argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return exit_info.value.code, err


def test_bad_out_is_one_line(tmp_path, capsys):
    """Before: FileExistsError, NotADirectoryError and PermissionError tracebacks."""
    a_file = tmp_path / "a_file"
    a_file.write_text("not a run\n")
    code, err = _main_error(capsys, f"--out={a_file}")
    assert code == 2 and "is a file, not a directory" in err
    code, err = _main_error(capsys, f"--out={a_file / 'sub'}")
    assert code == 2 and "cannot be used as a run directory (Not a directory" in err
    assert a_file.read_text() == "not a run\n"


def test_read_only_out_is_one_line(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes anyway: its write probe fails as a user's would

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(locked / "run"))

        monkeypatch.setattr(tempfile, "mkstemp", refuse)
    try:
        code, err = _main_error(capsys, f"--out={locked / 'run'}")
    finally:
        locked.chmod(0o755)
    assert code == 2 and "Permission denied" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("flag", ["--device=cuda", "--backend=cuda"])
def test_no_gpu_is_one_line_before_anything_is_written(tmp_path, capsys, flag):
    out = tmp_path / "run"
    code, err = _main_error(capsys, f"--out={out}", flag)
    assert code == 2 and ("no GPU is visible" in err or "none is visible" in err)
    assert not out.exists()


def test_bad_lr_names_lr(capsys):
    with pytest.raises(SystemExit):
        tg.parse_config(["--lr", "-1"])
    assert "TrainConfig.lr=-1.0 is invalid: use a positive learning rate" in capsys.readouterr().err


def test_quickstart_help_stops_after_the_help(tmp_path):
    script = RECIPE.parents[1] / "scripts" / "quickstart.sh"
    proc = subprocess.run(
        ["bash", str(script), "--out", str(tmp_path / "run"), "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0 and "usage: train_gpt.py" in proc.stdout, proc.stderr[-2000:]
    assert "sample" not in proc.stdout and not (tmp_path / "run").exists()


@pytest.mark.parametrize("digests", ["current", "bytes only (an older save)"])
def test_an_hf_weight_whose_dtype_was_edited_is_refused(tmp_path, digests):
    """train_hf's checkpoints: a safetensors header edited from F32 to I32 (the same bytes)
    is refused, by the digest (dtype and shape covered) or, for an older manifest whose
    digests cover bytes alone, by the dtype check (before, the weight loaded cast to ~1e9)."""
    from gpt_training import spec
    from gpt_training.checkpointing import CheckpointError
    from safetensors.torch import save_file

    from tgraph.toy import checkpoint

    model = torch.nn.Linear(4, 4)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    spec.write_manifest(tmp_path, {})
    if digests != "current":
        path = tmp_path / spec.MANIFEST_NAME
        body = json.loads(path.read_text())
        body["sha256"]["model.safetensors"] = {
            k: checkpoint._bytes_sha256(v) for k, v in state.items()
        }
        path.write_text(json.dumps(body))
    spec.load_verified_into(torch.nn.Linear(4, 4), tmp_path)  # intact: loads
    save_file(
        {**state, "weight": state["weight"].view(torch.int32)}, str(tmp_path / "model.safetensors")
    )
    match = "corrupt" if digests == "current" else r"dtype mismatches \['weight'\]"
    with pytest.raises(CheckpointError, match=match):
        spec.load_verified_into(torch.nn.Linear(4, 4), tmp_path)
