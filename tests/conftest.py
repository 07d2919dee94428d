"""Shared test set-up: backends, the `cuda`, `megatron` and `te` markers, clean tgraph state."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import tgraph

# The recipes import their modules from beside them (recipes/gpt_training/, hf_serving.py), as
# Python finds them when it runs a recipe file; tests that load a recipe by path need the same.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

HAS_CUDA = torch.cuda.is_available()
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None
HAS_TE = HAS_CUDA and importlib.util.find_spec("transformer_engine") is not None


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_megatron = pytest.mark.skip(reason="needs megatron-core (pip install 'tgraph[megatron]')")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_cuda)
        if "megatron" in item.keywords and not HAS_MEGATRON:
            item.add_marker(skip_megatron)
        if "te" in item.keywords and not HAS_TE:
            item.add_marker(pytest.mark.skip(reason="needs TransformerEngine and a CUDA GPU"))


@pytest.fixture(params=["emulated", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request) -> str:
    """Every graph test runs on the emulated backend (CPU) and on real CUDA graphs."""
    return request.param


@pytest.fixture
def replays(monkeypatch) -> list[int]:
    """Counts graph replays on either backend (a test that claims replays proves them)."""
    from tgraph.backend import CudaGraph
    from tgraph.emulated import EmulatedGraph

    count = [0]
    for cls in (EmulatedGraph, CudaGraph):
        original = cls.replay

        def counted(self, *args, _original=original, **kwargs):
            count[0] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "replay", counted)
    return count


@pytest.fixture
def device(backend) -> torch.device:
    return torch.device("cuda" if backend == "cuda" else "cpu")


@pytest.fixture(autouse=True, scope="session")
def _one_cpu_thread():
    """CI has 2 cores and some tests run 2 processes: intra-op threads would oversubscribe."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True, scope="module")
def _close_process_group():
    """The megatron tests open a one-rank NCCL group (and megatron's parallel state); both are
    closed after each test module, so no later module runs with torch.distributed initialized
    (direct_grads refuses it) and torch's exit handler does not warn."""
    yield
    import sys

    import torch.distributed as dist

    parallel_state = getattr(sys.modules.get("megatron.core"), "parallel_state", None)
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _clean_tgraph_state():
    """No graph, record, enabled module or registered generator leaks from one test into the
    next (a model a test left enabled would be reported by a later create_graphs() as a
    module not called in its recorded iteration)."""
    tgraph.reset()
    yield
    tgraph.reset()
    for m in list(tgraph.layers.manager._manager.modules):
        tgraph.disable(m)
    for g in tgraph.rng.extra_generators():
        tgraph.unregister_generator(g)


@pytest.fixture(params=[True, False], ids=["swap", "older_torch"])
def swaps(request, monkeypatch):
    """PyTorch >= 2.13 (storage memory can be swapped) and older (a copy per backward, into a
    landing buffer)."""
    from tgraph.layers import grads

    if request.param and not grads.swaps_storage():
        pytest.skip("this PyTorch cannot swap storage memory (UntypedStorage._swap_data_ptr_)")
    if not request.param:  # as on PyTorch < 2.13, which has no storage swap
        monkeypatch.setattr(torch.UntypedStorage, "_swap_data_ptr_", None, raising=False)
    return request.param


@pytest.fixture
def no_verifier():
    """The shadow verifier off: a planted-bug test that shows what a bug does to the replays
    themselves (with the verifier on, it would catch the bug and run eagerly)."""
    import tgraph

    with tgraph.verification(first=0, every=0):
        yield
