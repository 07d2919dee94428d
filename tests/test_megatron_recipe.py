"""The megatron-core recipe fails clearly where it cannot run (no GPU), and parses its flags."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "train_megatron_gpt.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_without_a_gpu_the_recipe_says_so():
    r = subprocess.run(
        [sys.executable, str(RECIPE), "--steps", "2"], capture_output=True, text=True
    )
    assert r.returncode != 0
    assert "needs a CUDA GPU" in r.stderr


def test_bad_flags_are_rejected():
    r = subprocess.run(
        [sys.executable, str(RECIPE), "--steps", "1"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "--steps must be >= 2" in r.stderr
