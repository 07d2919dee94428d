"""recipes/train_hf.py: the four graph modes agree, checkpoints load with from_pretrained, resume.

The recipe runs on the shared trainer (``gpt_training``); the protections it shares with
recipes/train_gpt.py are tested against both in tests/test_recipe_common.py.

In-process runs train on a small random byte stream (the corpus takes seconds to read); one
command-line run trains on the real corpus. Tolerance: bitwise on the emulated backend (the same
kernels, fused AdamW in every mode); 1e-4 relative on CUDA, where graphs may pick other cuBLAS
algorithms (tests/test_hf_integration.py explains the bound).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install 'tgraph[dev]')")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_hf.py"
TINY = ["--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "16",
        "--batch-size", "2", "--warmup-steps", "1", "--lr", "1e-2", "--log-every", "2",
        "--ckpt-every", "2", "--eval-every", "2", "--eval-batches", "2", "--no-progress"]  # fmt: skip


def _load_recipe():
    spec = importlib.util.spec_from_file_location("train_hf", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_hf"] = module
    spec.loader.exec_module(module)
    return module


th = _load_recipe()
from gpt_training import trainer  # noqa: E402  (recipes/ is on sys.path: tests/conftest.py)
from gpt_training.spec import saved_form  # noqa: E402
from gpt_training.step import FULL_WARMUP  # noqa: E402


@pytest.fixture
def run(tmp_path, backend, device, monkeypatch):
    """``run(name, *flags) -> the latest checkpoint's parameters`` (from_pretrained)."""
    data = torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(trainer, "load_split", lambda *a, **k: data.to(torch.uint8))

    def go(name: str, *flags: str) -> dict[str, torch.Tensor]:
        out = tmp_path / name
        argv = [*TINY, "--out", str(out), "--device", device.type, "--backend", backend, *flags]
        assert th.main(argv) == 0
        latest = out / "checkpoints" / "latest"
        model = AutoModelForCausalLM.from_pretrained(latest)
        assert set(load_file(latest / "model.safetensors")) <= set(saved_form(model))
        return {k: v.clone() for k, v in model.state_dict().items()}

    return go


def tol(backend: str) -> dict:
    return dict(rtol=0, atol=0) if backend == "emulated" else dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_graph_modes_train_as_eager_and_save_loadable_checkpoints(run, backend, arch, tmp_path):
    """Every mode ends at eager's parameters; the graphed units replay past the checkpoints
    (``save_pretrained`` every 2 steps writes records into the config, which the whole model's
    unit compares at every call): no call of a graphed unit ran eagerly."""
    eager = run("none", "--arch", arch, "--steps", "4", "--graph", "none")
    for mode in ("layer", "layer+opt", "model", "full"):
        got = run(mode, "--arch", arch, "--steps", "4", "--graph", mode)
        torch.testing.assert_close(got, eager, **tol(backend), msg=lambda m, g=mode: f"{g}: {m}")
        summary = json.loads((tmp_path / mode / "summary.json").read_text())
        assert summary.get("eager_calls", 0) == 0, mode


@pytest.mark.parametrize("mode", ["layer", "model"])
def test_compile_with_graphs_trains_as_eager(run, backend, mode, replays, tmp_path):
    """``--compile`` with the per-layer and the whole-model graphs of a transformers model:
    dynamo compiles (the flag reaches ``graph_layers``), every later call replays, and the
    parameters end within AdamW's amplification of float32 reordering (up to one step of lr
    on an element whose gradient is near zero) of the uncompiled eager run's."""
    from torch._dynamo.utils import counters

    eager = run("none", "--arch", "llama", "--steps", "4", "--graph", "none")
    torch._dynamo.reset()
    counters.clear()
    try:
        got = run(mode, "--arch", "llama", "--steps", "4", "--graph", mode, "--compile")
        assert counters["frames"]["ok"] > 0
    finally:
        torch._dynamo.reset()
    summary = json.loads((tmp_path / mode / "summary.json").read_text())
    assert replays[0] > 0 and summary["eager_calls"] == 0
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-2)


def masks_under_every_capture() -> bool:
    """Whether transformers builds the causal mask under any capture, even with a cache and no
    padding mask to read (5.17 does; transformers issue 48925)."""
    from transformers.masking_utils import _ignore_causal_mask_sdpa

    from tgraph.emulated import emulated_capture

    with emulated_capture():
        return not _ignore_causal_mask_sdpa(None, 16, 16, 0, 0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_full_graph_replays_train_as_eager(run, backend, arch, replays):
    """``--graph full`` past its capture, with grouped-query attention (llama: 4 heads, 2 of
    them key/value heads). Transformers' mask code without a cache takes another branch under a
    capture (an explicit mask, k/v heads repeated in Python): the step asks for the cache there
    (``HFSpec.whole_step_loss``), so its graph computes eager's bits. A transformers that masks
    under every capture leaves the grouped k/v gradients 1e-7 off: compared within rounding."""
    flags = ("--arch", arch, "--n-head", "4", "--steps", "6")
    eager = run("none", *flags, "--graph", "none")
    full = run("full", *flags, "--graph", "full")
    # calls 1-3 warm up, call 4 captures (on CUDA its step is the first replay), 5-6 replay
    assert replays[0] == 6 - FULL_WARMUP - (backend == "emulated")
    if backend == "emulated" and not (arch == "llama" and masks_under_every_capture()):
        assert [k for k in eager if not torch.equal(full[k], eager[k])] == []  # bit for bit
    else:
        torch.testing.assert_close(full, eager, rtol=1e-4, atol=1e-5)


class Killed(Exception):
    pass


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_a_killed_run_resumes_bit_for_bit(run, backend, arch, monkeypatch, tmp_path):
    """Killed right after its step-2 checkpoint, the run continues from it as if never stopped:
    the same weights and AdamW state. An MoE model (transformers 5 holds its experts fused,
    ``save_pretrained`` writes them one by one) resumes too: before, its own checkpoint was
    refused (the file's names are not the model's). CPU runs are bit for bit with one thread
    (tests/conftest.py); MoE's gradients are not with several (README)."""
    flags = ("--arch", arch, "--steps", "4")
    straight = run("straight", *flags)
    save = trainer.save_checkpoint

    def save_then_die(*args, **kwargs):
        save(*args, **kwargs)
        raise Killed

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        run("killed", *flags)
    monkeypatch.setattr(trainer, "save_checkpoint", save)
    resumed = run("killed", *flags, "--resume", "latest")
    torch.testing.assert_close(resumed, straight, **tol(backend))
    states = [
        torch.load(tmp_path / n / "checkpoints/latest/trainer.pt", weights_only=True)["optimizer"]
        for n in ("killed", "straight")
    ]
    torch.testing.assert_close(states[0], states[1], **tol(backend))


def test_a_fresh_run_into_an_out_with_checkpoints_is_refused(run, capsys):
    run("taken", "--steps", "2", "--graph", "none")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run("taken", "--steps", "2", "--graph", "none")
    assert exit_info.value.code == 2 and "--resume latest" in capsys.readouterr().err


def test_command_line_run_on_the_corpus(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, str(RECIPE), "--arch", "qwen2", *TINY, "--steps", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "summary.json").is_file() and (out / "metrics.jsonl").is_file()
    model = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "latest")
    assert type(model).__name__ == "Qwen2ForCausalLM"


def _one_line_exit_2(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        th.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_config_with_fewer_positions_than_block_size_is_one_line(tmp_path, capsys):
    """Before: an IndexError traceback from the position embedding, at the first step."""
    config = tmp_path / "gpt2.json"
    hf = th.build_config(th.HFTrainConfig(arch="gpt2", n_layer=1, n_embd=32, n_head=2))
    hf.n_positions = 8
    config.write_text(hf.to_json_string())
    out = tmp_path / "run"
    err = _one_line_exit_2(capsys, [*TINY, "--config", str(config), "--out", str(out)])
    assert "max_position_embeddings 8 < --block-size 16; pass --block-size 8 or less" in err
    assert not out.exists()


@pytest.mark.parametrize("name", ["my_config.json", "configs/llama", "./llama", "a/b/c"])
def test_a_missing_config_file_is_not_looked_up_on_the_hub(tmp_path, capsys, monkeypatch, name):
    """Before: a mistyped path went to the Hub (offline: 44 s of retries, then a traceback)."""
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("looked up on the Hub")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    err = _one_line_exit_2(capsys, [*TINY, "--config", name, "--out", str(tmp_path / "run")])
    assert f"config={name!r} is invalid: no such file" in err
    assert not (tmp_path / "run").exists()
    assert not th._names_a_local_path("Qwen/Qwen2-0.5B")  # a Hub id stays one


def test_a_config_file_edited_since_the_checkpoint_is_refused(
    run, backend, device, capsys, tmp_path
):
    """Before: the resume rebuilt the model from the file as it reads now (its shapes still fit
    the weights) and trained on with another activation, exit 0. Now one line (exit 2) names the
    differing keys, and the run's files stay as they were."""
    config = tmp_path / "llama.json"
    th.build_config(th.HFTrainConfig(arch="llama", n_layer=2, n_embd=32, n_head=2)).to_json_file(
        config
    )
    flags = ("--config", str(config), "--graph", "none")
    run("edited", *flags, "--steps", "2")
    run("unedited", *flags, "--steps", "2")
    run("unedited", *flags, "--steps", "4", "--resume", "latest")  # an unedited file resumes
    before = {p: p.read_bytes() for p in (tmp_path / "edited").rglob("*") if p.is_file()}
    edited = json.loads(config.read_text())
    edited["hidden_act"] = "relu"  # same shapes: the step-2 weights would load
    config.write_text(json.dumps(edited))
    capsys.readouterr()
    argv = [*TINY, *flags, "--steps", "4", "--resume", "latest", "--out", str(tmp_path / "edited"),
            "--device", device.type, "--backend", backend]  # fmt: skip
    err = _one_line_exit_2(capsys, argv)
    assert "hidden_act='silu' in the checkpoint but 'relu' now" in err, err
    assert "Restore the config" in err and "another --out" in err, err
    after = {p: p.read_bytes() for p in (tmp_path / "edited").rglob("*") if p.is_file()}
    assert after == before  # nothing written: no step-4 checkpoint, metrics and config as they were


def test_moe_weights_load_through_transformers_and_must_save_back_the_same(tmp_path, monkeypatch):
    """``save_pretrained`` writes an MoE layer's experts one by one (mixtral: renamed too); the
    model holds them fused. ``load_verified_into`` converts the verified tensors with
    transformers' loading, then requires the model to save back exactly those tensors: a
    conversion that does not invert ``save_pretrained``'s is refused, never trained on."""
    from gpt_training.spec import load_verified_into, write_manifest

    from tgraph.toy.checkpoint import CheckpointError

    cfg = th.HFTrainConfig(arch="mixtral", n_layer=1, n_embd=32, n_head=2)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = th.HF_SPEC.build(cfg, cpu)
    model.save_pretrained(tmp_path)
    write_manifest(tmp_path, {}, files=("config.json",))
    assert not set(load_file(tmp_path / "model.safetensors")) <= set(model.state_dict())
    fresh = th.HF_SPEC.build(cfg, cpu)  # other random weights
    load_verified_into(fresh, tmp_path)
    torch.testing.assert_close(fresh.state_dict(), model.state_dict(), rtol=0, atol=0)

    real = type(model).from_pretrained

    def one_expert_off(*args, **kwargs):
        twin = real(*args, **kwargs)
        twin.model.layers[0].mlp.experts.down_proj.data[1] += 1
        return twin

    monkeypatch.setattr(type(model), "from_pretrained", one_expert_off)
    with pytest.raises(
        CheckpointError, match=r"does not give back the saved tensors \[.*experts\.1"
    ):
        load_verified_into(th.HF_SPEC.build(cfg, cpu), tmp_path)


def test_a_damaged_or_missing_checkpoint_config_is_one_line(run, backend, device, tmp_path, capsys):
    """Before: a traceback from transformers (config.json was neither in the manifest nor read
    with a guard). Its sha256 is in checkpoint.json now; damaged or missing, or unreadable in an
    older checkpoint that records no sha256 of it: one line (exit code 1) naming the file and
    the earlier checkpoint, and nothing written."""
    run("r", "--graph", "none", "--steps", "4")
    out = tmp_path / "r"
    ckpt = out / "checkpoints" / "step_000004"
    config, intact = ckpt / "config.json", (ckpt / "config.json").read_bytes()
    argv = [*TINY, "--graph", "none", "--steps", "6", "--resume", "latest", "--out", str(out),
            "--device", device.type, "--backend", backend]  # fmt: skip

    def refused(why: str) -> None:
        before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            th.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 1 and err.count("\n") == 1 and "Traceback" not in err, err
        assert why in err and "--resume " in err and "step_000002" in err, err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before

    config.write_bytes(intact[:100])
    refused("config.json is corrupt")
    config.unlink()
    refused("config.json is missing")
    manifest = ckpt / "checkpoint.json"
    body = json.loads(manifest.read_text())
    del body["files"]  # an older save's manifest
    manifest.write_text(json.dumps(body))
    config.write_bytes(intact[:100])
    refused("config.json' is not a valid JSON file")
    config.write_bytes(intact)
    run("r", "--graph", "none", "--steps", "6", "--resume", "latest")  # intact again: resumes


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--n-embd", "36", "--n-head", "4"], "RoPE requires an even rotary dimension"),
        (["--config", "t5"], "is a 't5' config, which no causal LM"),
        (["--arch", "mixtral", "--experts", "bogus"], "invalid choice: 'bogus'"),
        (["--arch", "mixtral", "--experts", "eager"], "--experts eager runs transformers' loop"),
        (["--experts", "eager", "--graph", "full"], "--experts eager"),
    ],
    ids=["odd-rope-head", "t5", "bogus-experts", "eager-experts-layer", "eager-experts-full"],
)
def test_models_that_cannot_be_built_or_graphed_are_one_line(tmp_path, capsys, flags, message):
    """Before: tracebacks from transformers (the config's validation, AutoModelForCausalLM of
    a t5 config, an unknown experts implementation) and from graph_layers (eager experts),
    each after --out was created. Now one line, exit code 2, nothing written."""
    if flags[:2] == ["--config", "t5"]:
        config = tmp_path / "t5.json"
        config.write_text(json.dumps({"model_type": "t5", "vocab_size": 256, "d_model": 32}))
        flags = ["--config", str(config)]
    if flags[-2:] == ["--graph", "full"]:
        flags = ["--arch", "qwen3_moe", *flags]
    out = tmp_path / "run"
    err = _one_line_exit_2(capsys, [*TINY, *flags, "--out", str(out)])
    assert message in err, err
    assert not out.exists()


def test_graph_layers_refusing_the_model_is_a_model_error():
    """graph_layers' own refusal (ValueError) reaches the command line as a ModelError (one
    line, exit code 2): experts on the eager loop, met past the config check."""
    cfg = th.HFTrainConfig(arch="mixtral", n_layer=1, n_embd=32, n_head=2, experts="eager")
    model = th.HF_SPEC.build(cfg, torch.device("cpu"))
    with pytest.raises(th.ModelError, match=r"--graph model cannot graph this model: .*eager"):
        th.HF_SPEC.enable_model_graph(model, "emulated")
