"""recipes/train_gpt.py: config, graph modes, exact kill-and-resume, bad checkpoints, torchrun."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from gpt_training.optim import lr_at
from safetensors.torch import load_file

import tgraph
from tgraph.toy.corpus import BatchSampler

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_gpt.py"
GRAPHS = ["none", "layer", "model", "full"]


def _load_recipe():
    spec = importlib.util.spec_from_file_location("train_gpt", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # dataclasses and inspect look classes up by module name
    spec.loader.exec_module(module)
    return module


tg = _load_recipe()

# A model and run small enough for a few seconds on 2 CPU cores; the learning rate is high so
# that 8 steps move the parameters far from their initial values (a missed update shows).
TINY = dict(batch_size=4, block_size=32, n_layer=2, n_head=2, n_embd=32, steps=8,
            warmup_steps=2, lr=1e-2, min_lr=1e-3, eval_every=4, eval_batches=2, ckpt_every=4,
            log_every=2, progress=False)  # fmt: skip


@pytest.fixture
def run_cfg(tmp_path, backend, device):
    """Build TrainConfigs for the backend under test; restore global determinism afterwards."""
    was = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()

    def make(name: str, **overrides) -> tg.TrainConfig:
        kw = dict(TINY, out=str(tmp_path / name), device=device.type, backend=backend)
        # On a GPU, deterministic kernels (embedding backward without atomics) make two runs
        # comparable bit for bit; the CPU kernels used here are deterministic already.
        kw["deterministic"] = device.type == "cuda"
        kw.update(overrides)
        return tg.TrainConfig(**kw)

    yield make
    torch.use_deterministic_algorithms(was, warn_only=was_warn_only)


def _final_params(cfg) -> dict[str, torch.Tensor]:
    return load_file(str(Path(cfg.out) / "checkpoints" / "latest" / "model.safetensors"))


def _tolerance(device: torch.device) -> dict:
    # CPU (emulated graphs): the same kernels run in the same order on the same thread count,
    # so runs agree bit for bit. CUDA: deterministic kernels should agree bit for bit too, but
    # AdamW's normalized update can turn a last-bit difference of a near-zero gradient into a
    # step of up to lr, so leave room for a few such elements.
    return dict(rtol=0, atol=0) if device.type == "cpu" else dict(rtol=1e-4, atol=1e-4)


def _assert_same_params(a: dict, b: dict, device: torch.device) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], **_tolerance(device), msg=lambda m, k=k: f"{k}: {m}")


class _Killed(BaseException):
    """Stands for SIGKILL: nothing in the recipe catches it."""


def _kill_at_step(monkeypatch, step: int) -> None:
    """Make the recipe die while drawing the batch of (1-based) step ``step``."""
    calls = {"n": 0}
    real = BatchSampler.next

    def next_or_die(self):
        calls["n"] += 1
        if calls["n"] == step:
            raise _Killed
        return real(self)

    monkeypatch.setattr(BatchSampler, "next", next_or_die)


# -- config -----------------------------------------------------------------------------------


def test_cli_is_generated_from_the_dataclass():
    cfg = tg.parse_config(["--batch-size", "8", "--graph", "full", "--no-progress", "--lr=3e-3"])
    assert (cfg.batch_size, cfg.graph, cfg.progress, cfg.lr) == (8, "full", False, 3e-3)
    assert tg.parse_config(["--batch_size", "2"]).batch_size == 2
    docs = tg._field_docs(tg.TrainConfig)
    assert set(docs) == set(tg.TrainConfig.__dataclass_fields__)  # one docstring per field
    with pytest.raises(SystemExit):
        tg.parse_config(["--graph", "fulll"])


@pytest.mark.parametrize(
    "overrides, field",
    [({"graph": "all"}, "graph"), ({"n_head": 3}, "n_head"), ({"steps": 0}, "steps"),
     ({"val_fraction": 1.0}, "val_fraction"), ({"min_lr": 1.0}, "min_lr"),
     ({"device": "tpu"}, "device")],
)  # fmt: skip
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=f"TrainConfig.{field}="):
        tg.TrainConfig(**overrides)


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = tg.TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)


# -- graph modes agree; kill and resume is exact ----------------------------------------------


@pytest.mark.parametrize("graph", GRAPHS)
def test_graph_modes_train_the_same_parameters(graph, run_cfg, device):
    eager = run_cfg("eager", graph="none")
    tg.train(eager)
    cfg = run_cfg(graph, graph=graph)
    with warnings.catch_warnings():
        # Validation in eval mode / no_grad replays graphs recorded for it: no eager fallback.
        warnings.simplefilter("error", tgraph.GraphFallbackWarning)
        summary = tg.train(cfg)
    _assert_same_params(_final_params(cfg), _final_params(eager), device)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().split("\n")
            if line]  # fmt: skip
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8]
    assert {"loss", "lr", "ms_per_step", "tokens_per_s", "peak_mem_mb", "graph",
            "capture_s"} <= train_rows[-1].keys()  # fmt: skip
    assert [r["step"] for r in rows if r["kind"] == "val"] == [4, 8]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert (summary["capture_s"] > 0) == (graph != "none")
    if graph in ("layer", "model"):  # replays, not eager calls: each counts a fallback
        assert summary["eager_calls"] == 0
    assert (Path(cfg.out) / "loss.png").stat().st_size > 0
    saved = json.loads((Path(cfg.out) / "config.json").read_text())
    assert saved["train"]["graph"] == graph and saved["resolved"]["corpus"]["bytes"]["train"] > 0


def test_validation_without_recorded_eval_forward_falls_back(run_cfg, monkeypatch):
    """Planted bug: skip the recorded validation forward; validation then misses every graph."""
    from gpt_training import trainer  # recipes/gpt_training: on sys.path (tests/conftest.py)

    real = trainer.evaluate
    monkeypatch.setattr(
        trainer, "evaluate", lambda m, b, *rest: 0.0 if len(b) == 1 else real(m, b, *rest)
    )
    with pytest.warns(tgraph.GraphFallbackWarning, match="training changed from True to False"):
        tg.train(run_cfg("layer", graph="layer"))


@pytest.mark.parametrize("graph", GRAPHS)
def test_killed_and_resumed_run_ends_with_the_same_parameters(graph, run_cfg, device, monkeypatch):
    full = run_cfg("uninterrupted", graph=graph)
    tg.train(full)
    killed = run_cfg("killed", graph=graph)
    _kill_at_step(monkeypatch, 7)  # after the checkpoint of step 4, before the one of step 8
    with pytest.raises(_Killed):
        tg.train(killed)
    monkeypatch.undo()
    ckpts = Path(killed.out) / "checkpoints"
    assert os.readlink(ckpts / "latest") == "step_000004"
    summary = tg.train(run_cfg("killed", graph=graph, resume="latest"))
    assert summary["resumed_at"] == 4
    _assert_same_params(_final_params(killed), _final_params(full), device)
    # The metrics file continues the killed run's, without duplicate steps.
    rows = [json.loads(x) for x in (ckpts.parent / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["kind"] == "train"]
    assert steps == [2, 4, 6, 8]


@pytest.mark.parametrize("forget", ["data", "optimizer"])
def test_resume_check_fails_when_state_is_not_restored(forget, run_cfg, device, monkeypatch):
    """Planted bugs: a resume that forgets the data generator or the optimizer state diverges."""
    full = run_cfg("uninterrupted", graph="none")
    tg.train(full)
    if forget == "data":
        monkeypatch.setattr(BatchSampler, "load_state_dict", lambda self, state: None)
    else:
        monkeypatch.setattr(torch.optim.AdamW, "load_state_dict", lambda self, state: None)
    resumed = run_cfg("resumed", graph="none", resume=str(Path(full.out) / "checkpoints" /
                                                          "step_000004"))  # fmt: skip
    tg.train(resumed)
    with pytest.raises(AssertionError):
        _assert_same_params(_final_params(resumed), _final_params(full), device)


# -- bad checkpoints ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("good")
    kw = dict(TINY, out=str(out), device="cpu", graph="none")
    tg.train(tg.TrainConfig(**kw))
    return kw, out / "checkpoints" / "step_000004"


def _record_trainer_sha256(ckpt: Path, digest) -> None:
    """Edit the trainer.pt checksum in config.json (None: remove it, as in older checkpoints)."""
    path = ckpt / "config.json"
    data = json.loads(path.read_text())
    data["extra"].pop("trainer_sha256")
    if digest is not None:
        data["extra"]["trainer_sha256"] = digest.hexdigest()
    path.write_text(json.dumps(data))


def _damage_tensor_bytes(path: Path, n: int = 4096) -> None:
    """Overwrite ``n`` bytes in the middle of a safetensors file's tensor data (header intact)."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    start = header + (len(data) - header) // 2
    data[start : start + n] = b"\xff" * min(n, len(data) - start)
    path.write_bytes(bytes(data))


def _copy(ckpt: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(ckpt, dst / "ckpt"))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing", "no checkpoint at"),
        ("no_trainer", "incomplete: trainer.pt is missing"),
        ("truncated_trainer", "damaged: the sha256 of .*trainer.pt differs"),
        ("truncated_unchecked_trainer", "records no sha256 of trainer.pt, so it cannot be"),
        ("no_config", "has no config.json.*its checksums cannot be verified"),
        ("broken_config", "config.json is not valid JSON.*its checksums cannot be verified"),
        ("damaged_model_bytes", "cannot resume from .*model.safetensors is corrupt"),
        ("truncated_model", "cannot resume from .*safetensors"),
        ("no_model", "has no model.safetensors"),
        ("other_model", "n_layer=2 in the checkpoint but 3 now"),
        ("other_world", "world size 2 in the checkpoint but 1 now"),
        ("latest_empty", "no checkpoint under"),
    ],
)
def test_bad_checkpoints_give_clear_errors(damage, message, good_run, tmp_path):
    kw, ckpt = good_run
    kw = dict(kw, out=str(tmp_path / "out"))
    ckpt = _copy(ckpt, tmp_path)
    resume = str(ckpt)
    if damage == "missing":
        resume = str(tmp_path / "nowhere")
    elif damage == "no_trainer":
        (ckpt / "trainer.pt").unlink()
    elif damage in ("truncated_trainer", "truncated_unchecked_trainer"):
        data = (ckpt / "trainer.pt").read_bytes()
        (ckpt / "trainer.pt").write_bytes(data[: len(data) // 2])
        if damage == "truncated_unchecked_trainer":  # written before checksums existed
            _record_trainer_sha256(ckpt, None)
    elif damage == "no_config":
        (ckpt / "config.json").unlink()
    elif damage == "broken_config":
        (ckpt / "config.json").write_text('{"broken')
    elif damage == "damaged_model_bytes":
        _damage_tensor_bytes(ckpt / "model.safetensors")
    elif damage == "truncated_model":
        data = (ckpt / "model.safetensors").read_bytes()
        (ckpt / "model.safetensors").write_bytes(data[:100])
    elif damage == "no_model":
        (ckpt / "model.safetensors").unlink()
    elif damage == "other_model":
        kw["n_layer"] = 3
    elif damage == "other_world":
        state = torch.load(ckpt / "trainer.pt", weights_only=True)
        state["world_size"] = 2
        state["rng"] = state["rng"] * 2
        torch.save(state, ckpt / "trainer.pt")
        _record_trainer_sha256(ckpt, hashlib.sha256((ckpt / "trainer.pt").read_bytes()))
    elif damage == "latest_empty":
        resume = "latest"
    with pytest.raises(tg.CheckpointError, match=message):
        tg.train(tg.TrainConfig(**kw, resume=resume))


def test_cli_reports_a_bad_checkpoint_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(RECIPE), "--out", str(tmp_path), "--resume", "latest", "--device",
         "cpu", "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "error: --resume latest: no checkpoint under" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_step_the_full_graph_cannot_capture_is_one_line(tmp_path, monkeypatch, capsys):
    """tgraph's refusal to capture (CaptureError: here a loss read on the host, .item(), inside
    the full step) ends the run with one line and exit code 2, not a traceback."""
    real = tg.GPT_SPEC.loss

    def loss_read_on_the_host(net, x, y):
        out = real(net, x, y)
        _ = out.item()
        return out

    monkeypatch.setattr(tg.GPT_SPEC, "loss", loss_read_on_the_host)
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]
    with pytest.raises(SystemExit) as exit_info:
        tg.main([*argv, "--no-progress", "--device=cpu", "--graph=full", f"--out={tmp_path}"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("error: --graph full cannot capture this step: ") and ".item()" in err


# -- two processes under torchrun (gloo) --------------------------------------------------------


@pytest.fixture(scope="module")
def torchrun_eager(tmp_path_factory) -> Path:
    return _torchrun("none", tmp_path_factory.mktemp("torchrun_none"))


def _torchrun(graph: str, out: Path) -> Path:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(RECIPE), *args, "--steps=6", "--no-progress", "--device=cpu", f"--graph={graph}",
           f"--out={out}"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # --standalone rendezvous on a port the OS picks (localhost:0): no fixed port to collide on.
    # The timeout is generous for a loaded 2-core CI machine (a run takes ~10 s when idle).
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun --graph {graph} timed out after {e.timeout}s:\n{_tail(e)}")
    report = f"torchrun --graph {graph} exited {proc.returncode}:\n{_tail(proc)}"
    assert proc.returncode == 0, report
    # Each worker's shutdown is the recipe's own (barrier, destroy, exit without teardown): a
    # worker aborting at interpreter exit made this test flaky.
    assert "terminate called" not in proc.stderr, report
    return out


def _tail(proc) -> str:
    def text(x) -> str:
        return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")

    return (
        f"--- stdout ---\n{text(proc.stdout)[-3000:]}\n--- stderr ---\n{text(proc.stderr)[-6000:]}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("graph", GRAPHS)
def test_torchrun_two_processes_each_graph_mode(graph, torchrun_eager, tmp_path):
    out = torchrun_eager if graph == "none" else _torchrun(graph, tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["graph"] == graph
    assert summary["tokens_per_step"] == 2 * TINY["batch_size"] * TINY["block_size"]
    state = torch.load(out / "checkpoints" / "latest" / "trainer.pt", weights_only=True)
    assert len(state["rng"]) == 2  # each rank's generators, for an exact resume
    assert not torch.equal(state["rng"][0]["data"], state["rng"][1]["data"])
    # Per-layer graphs under DDP and the full-iteration graph's own all-reduce train the same
    # parameters as eager DDP. Tolerance: DDP divides gradients before gloo sums them, the full
    # graph after, so the last bits differ and AdamW's normalized step may amplify them.
    a = load_file(str(out / "checkpoints" / "latest" / "model.safetensors"))
    b = load_file(str(torchrun_eager / "checkpoints" / "latest" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_compare_script_tables_and_plots_runs(good_run, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "compare_train_runs", RECIPE.parents[1] / "scripts" / "compare_train_runs.py"
    )
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    run = Path(good_run[0]["out"])
    compare.main([str(run), str(run), "--plot", str(tmp_path / "p.png"),
                  "--table", str(tmp_path / "t.md")])  # fmt: skip
    table = (tmp_path / "t.md").read_text()
    assert table.count("| none |") == 2 and "0.00e+00" in table
    assert (tmp_path / "p.png").stat().st_size > 0


@pytest.mark.parametrize("graph", GRAPHS)
def test_compile_trains_as_eager_in_every_graph_mode(graph, run_cfg, device):
    """``--compile``: the step's forward runs inductor's code (dynamo compiles frames: the
    flag is not dropped on its way), per-layer and model graphs still replay (no eager call),
    and the run ends where the uncompiled eager run ends, up to float32 reordering: the losses
    logged within 1e-4, the parameters within AdamW's amplification of rounding (a near-zero
    gradient's last bit can move an element by up to a step of lr)."""
    from torch._dynamo.utils import counters

    eager = run_cfg("eager", graph="none")
    tg.train(eager)
    torch._dynamo.reset()
    counters.clear()
    cfg = run_cfg(graph, graph=graph, compile=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tgraph.GraphFallbackWarning)
            summary = tg.train(cfg)
        assert counters["frames"]["ok"] > 0
    finally:
        torch._dynamo.reset()
    if graph in ("layer", "model"):
        assert summary["eager_calls"] == 0

    def losses(c):
        rows = map(json.loads, (Path(c.out) / "metrics.jsonl").read_text().splitlines())
        return torch.tensor([r["loss"] for r in rows if r["kind"] == "train"])

    torch.testing.assert_close(losses(cfg), losses(eager), rtol=1e-4, atol=1e-4)
    got, want = _final_params(cfg), _final_params(eager)
    assert got.keys() == want.keys()
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=cfg.lr, msg=k)
