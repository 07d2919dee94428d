"""recipes/generate.py: run directories, one-line errors with exit code 2, readable output."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tgraph.toy import checkpoint
from tgraph.toy.gpt import GPT, GPTConfig

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "generate.py"
spec = importlib.util.spec_from_file_location("generate_recipe", RECIPE)
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)

BLOCK = 64  # the model's positions


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A training run's layout: <run>/checkpoints/step_000002 and step_000004, latest -> 4."""
    run = tmp_path_factory.mktemp("gen") / "run"
    for step, seed in ((2, 1), (4, 0)):
        torch.manual_seed(seed)
        model = GPT(GPTConfig(block_size=BLOCK, n_layer=1, n_head=2, n_embd=16))
        checkpoint.save(model, run / "checkpoints" / f"step_{step:06d}", extra={"step": step})
    (run / "checkpoints" / "latest").symlink_to("step_000004")
    return run


def generate(*args: str) -> list[str]:
    return gen.main([*args, "--max-new-tokens", "5", "--no-graphs"])


def test_run_directory_means_its_latest_checkpoint(run_dir, capsys):
    """Before: --ckpt runs/gpt (the --help example) failed with a traceback."""
    expected = generate("--ckpt", str(run_dir / "checkpoints" / "step_000004"), "--prompt", "ab")
    assert generate("--ckpt", str(run_dir), "--prompt", "ab") == expected
    assert generate("--ckpt", str(run_dir / "checkpoints"), "--prompt", "ab") == expected
    assert "step_000004 (step 4)" in capsys.readouterr().out
    other = generate("--ckpt", str(run_dir / "checkpoints" / "step_000002"), "--prompt", "ab")
    assert other != expected  # a different checkpoint really is another model


def _expect_usage_error(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gen.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err  # one line
    assert message in err, err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-batch-size", "0"], "--max-batch-size must be 1 or more, got 0"),
        (["--max-seq-len", "0"], "--max-seq-len must be 1 or more, got 0"),
        (["--max-seq-len", "-3"], "--max-seq-len must be 1 or more, got -3"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be 1 or more, got 0"),
        (["--top-k", "0"], "--top-k must be 1 or more, got 0"),
        (["--temperature", "-1"], "--temperature must be 0 (greedy) or more, got -1.0"),
        (["--temperature", "nan"], "--temperature must be 0 (greedy) or more, got nan"),
        (["--eos-token-id", "-1"], "--eos-token-id must be a byte value 0-255"),
        (["--eos-token-id", "256"], "--eos-token-id must be below the vocabulary size 256"),
        (["--max-seq-len", "65"], "--max-seq-len 65 exceeds the model's 64 positions"),
        (["--max-new-tokens", "60"], "--prompt 1 is 5 bytes; with --max-new-tokens 60 it needs 65"),
        (["--prompt", ""], "--prompt 2 is empty"),
        (["--max-new-tokens", "x"], "argument --max-new-tokens: invalid int value: 'x'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)  # fmt: skip
def test_invalid_arguments_are_refused_in_one_line(run_dir, capsys, extra, message):
    """Before: 0 sizes were replaced by defaults; -1 temperature and a long prompt raised
    tracebacks."""
    _expect_usage_error(capsys, ["--ckpt", str(run_dir), "--prompt", "hello", *extra], message)


def test_missing_checkpoint_is_a_usage_error(tmp_path, capsys):
    _expect_usage_error(
        capsys, ["--ckpt", str(tmp_path / "nowhere"), "--prompt", "a"], "does not exist"
    )
    _expect_usage_error(capsys, ["--ckpt", str(tmp_path), "--prompt", "a"], "holds no checkpoint")


def test_corrupt_checkpoint_is_one_line_exit_1(run_dir, tmp_path, capsys):
    import shutil

    ckpt = Path(shutil.copytree(run_dir / "checkpoints" / "step_000004", tmp_path / "c"))
    (ckpt / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(SystemExit) as exit_info:
        gen.main(["--ckpt", str(ckpt), "--prompt", "a"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1


def test_samples_are_separated_and_cpu_memory_noise_is_dropped(run_dir, capsys, caplog):
    caplog.set_level(logging.INFO)
    gen.main(["--ckpt", str(run_dir), "--prompt", "ab", "--prompt", "cd", "--max-new-tokens", "3",
              "--device", "cpu"])  # fmt: skip
    out = capsys.readouterr().out
    assert "----- sample 1 of 2 " in out and "----- sample 2 of 2 " in out
    assert "n/a" not in caplog.text and "decode graphs: captured" in caplog.text
    assert not logging.getLogger("tgraph.decode.graph_runner").filters  # removed afterwards


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory) -> Path:
    """runs/quickstart after the README's commands: the quickstart's 128 positions, pruned
    checkpoints (step_003000 and step_002750 left) and checkpoints/latest."""
    run = tmp_path_factory.mktemp("quickstart") / "run"
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=128, n_layer=1, n_head=2, n_embd=16))
    for step in (2750, 3000):
        checkpoint.save(model, run / "checkpoints" / f"step_{step:06d}", extra={"step": step})
    (run / "checkpoints" / "latest").symlink_to("step_003000")
    return run


def test_help_examples_run_verbatim(quickstart_run, capsys):
    """Every example of --help, one per line, runs as written on the quickstart's run."""
    with pytest.raises(SystemExit):
        gen.parse_args(["--help"])
    help_text = capsys.readouterr().out
    examples = [ln for ln in help_text.splitlines() if "recipes/generate.py --ckpt" in ln]
    assert len(examples) == 3 and all(ln.count("--ckpt") == 1 for ln in examples)
    for example in examples:
        argv = shlex.split(example.split("#")[0].replace("runs/quickstart", str(quickstart_run)))
        assert argv[:2] == ["python", "recipes/generate.py"]
        completions = gen.main(argv[2:])
        assert len(completions) == argv.count("--prompt")


def test_top_p(run_dir, capsys):
    args = ["--ckpt", str(run_dir), "--prompt", "ab", "--temperature", "1", "--seed", "3"]
    assert generate(*args, "--top-p", "1") == generate(*args)
    nucleus = generate(*args, "--top-p", "1e-9")  # keeps the likeliest byte only: greedy
    assert "temperature 1.0, top-p 1e-09" in capsys.readouterr().out
    assert nucleus == generate("--ckpt", str(run_dir), "--prompt", "ab")
    for bad in ("0", "1.5", "nan"):
        _expect_usage_error(
            capsys, ["--ckpt", str(run_dir), "--prompt", "a", "--top-p", bad], "--top-p must be in"
        )


def test_too_long_prompt_is_told_what_fits(run_dir, capsys):
    long = "x" * BLOCK
    _expect_usage_error(
        capsys,
        ["--ckpt", str(run_dir), "--prompt", long, "--max-new-tokens", "4"],
        f"shorten it to at most {BLOCK - 4} bytes",
    )
    _expect_usage_error(
        capsys,
        ["--ckpt", str(run_dir), "--prompt", "hello", "--max-new-tokens", "62"],
        f"shorten it to at most 2 bytes or lower --max-new-tokens to at most {BLOCK - 5}",
    )


def test_ckpt_naming_a_file_says_so(run_dir, capsys):
    weights = run_dir / "checkpoints" / "step_000004" / "model.safetensors"
    _expect_usage_error(
        capsys,
        ["--ckpt", str(weights), "--prompt", "a"],
        "is a file; pass the checkpoint directory",
    )


def test_command_line_error_exit_code(run_dir):
    proc = subprocess.run(
        [sys.executable, str(RECIPE), "--ckpt", str(run_dir), "--prompt", "a", "--temperature",
         "-1"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith(
        "--temperature must be 0 (greedy) or more, got -1.0 (see --help)"
    )


def _flip_weight_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-6] ^= 0xFF  # two bytes of the last tensor's data: the file still loads
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def _expect_refusal(capsys, ckpt: Path, *messages: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gen.main(["--ckpt", str(ckpt), "--prompt", "ab", "--max-new-tokens", "2", "--no-graphs"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.startswith("error: cannot serve "), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for message in messages:
        assert message in err, err


@pytest.fixture
def hf_checkpoint(tmp_path) -> Path:
    """A checkpoint as recipes/train_hf.py writes it: save_pretrained, the manifest of its
    tensors' and config.json's sha256 (gpt_training.spec.write_manifest) and trainer.pt."""
    transformers = pytest.importorskip("transformers")
    from gpt_training.spec import write_manifest

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    transformers.LlamaForCausalLM(config).save_pretrained(ckpt)
    (ckpt / "trainer.pt").write_bytes(b"the optimizer state")
    write_manifest(ckpt, {"step": 2}, files=("config.json",))
    return ckpt


def test_train_hf_checkpoint_is_served_only_when_its_weights_verify(hf_checkpoint, capsys):
    """Before: generate served damaged weights, or weights without a manifest, and exited 0;
    a resume refuses both. So is a config.json edited since (the same shapes, another
    activation: it used to be served)."""
    served = generate("--ckpt", str(hf_checkpoint), "--prompt", "ab")
    assert len(served) == 1 and "(LlamaForCausalLM)" in capsys.readouterr().out
    weights = hf_checkpoint / "model.safetensors"
    intact = weights.read_bytes()
    _flip_weight_bytes(weights)
    _expect_refusal(capsys, hf_checkpoint, "model.safetensors is corrupt", "checkpoint.json")
    weights.write_bytes(intact)
    config = hf_checkpoint / "config.json"
    intact = config.read_text()
    config.write_text(json.dumps({**json.loads(intact), "hidden_act": "relu"}))
    _expect_refusal(capsys, hf_checkpoint, "config.json is corrupt", "checkpoint.json")
    config.write_text(intact)
    (hf_checkpoint / "checkpoint.json").unlink()
    _expect_refusal(capsys, hf_checkpoint, "has no checkpoint.json", "cannot be verified")
    (hf_checkpoint / "trainer.pt").unlink()  # a save_pretrained directory of another origin
    assert generate("--ckpt", str(hf_checkpoint), "--prompt", "ab") == served


def test_toy_recipe_checkpoint_without_checksums_is_refused(run_dir, tmp_path, capsys):
    """A train_gpt.py checkpoint (trainer.pt beside the weights) is verified as its resume is:
    without its tensors' sha256 its damaged weights are refused."""
    import shutil

    ckpt = Path(shutil.copytree(run_dir / "checkpoints" / "step_000004", tmp_path / "c"))
    config = json.loads((ckpt / "config.json").read_text())
    del config["sha256"]
    (ckpt / "config.json").write_text(json.dumps(config))
    _flip_weight_bytes(ckpt / "model.safetensors")
    (ckpt / "trainer.pt").write_bytes(b"the optimizer state")
    with pytest.raises(SystemExit) as exit_info:
        generate("--ckpt", str(ckpt), "--prompt", "ab")
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "records no sha256 checksums" in err, err
