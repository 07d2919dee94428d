"""Checkpoint IO: round trips (eager <-> graphed), atomic writes, clear errors."""

from __future__ import annotations

import json
import os

import pytest
import torch

import tgraph
from tgraph.toy import checkpoint
from tgraph.toy.checkpoint import CheckpointError
from tgraph.toy.gpt import GPT, GPTConfig

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG, **overrides}))


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:  # a copy through a file: bitwise equal, hence zero tolerance
        torch.testing.assert_close(sa[k].cpu(), sb[k].cpu(), atol=0, rtol=0)


def test_round_trip(tmp_path):
    model = tiny_gpt()
    checkpoint.save(model, tmp_path, extra={"step": 7, "note": "x"})
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no temp files
    loaded = checkpoint.load(tmp_path)
    assert loaded.config == model.config and not loaded.training
    assert_same_weights(model, loaded)
    cfg, extra = checkpoint.read_config(tmp_path)
    assert cfg == model.config and extra == {"step": 7, "note": "x"}
    idx = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(loaded(idx)[0], model.eval()(idx)[0], atol=0, rtol=0)


def test_keeps_dtype_and_unwraps_wrappers(tmp_path):
    model = tiny_gpt().to(torch.bfloat16)

    class Wrapper(torch.nn.Module):  # DDP-style: the model under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    checkpoint.save(Wrapper(model), tmp_path)
    loaded = checkpoint.load(tmp_path)
    assert loaded.wte.weight.dtype == torch.bfloat16
    assert_same_weights(model, loaded)
    assert checkpoint.load(tmp_path, dtype=torch.float32).wte.weight.dtype == torch.float32


def test_graphed_model_checkpoint_moves_to_eager_and_back(backend, device, tmp_path):
    """Per-layer graphs on (recorded, captured, replayed): same keys and weights both ways."""
    graphed = tiny_gpt(seed=1).to(device)
    tgraph.enable(graphed, backend=backend, strict=True)  # a call after capture replays
    idx = torch.randint(0, 64, (2, 8), device=device)
    for _ in range(2):  # record, then replay
        graphed(idx, idx)[1].backward()
        if _ == 0:
            tgraph.create_graphs()
    checkpoint.save(graphed, tmp_path / "from_graphed")
    eager = checkpoint.load(tmp_path / "from_graphed", device=device)
    assert_same_weights(graphed, eager)

    other = tiny_gpt(seed=2).to(device)
    checkpoint.save(other, tmp_path / "from_eager")
    checkpoint.load_into(graphed, tmp_path / "from_eager")
    assert_same_weights(other, graphed)
    # the graphs read the loaded weights (replayed: strict mode)
    torch.testing.assert_close(graphed(idx, idx)[1], other(idx, idx)[1], rtol=1e-6, atol=1e-6)


def test_atomic_writer_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "state.bin"
    checkpoint.atomic_write_bytes(target, b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with checkpoint.atomic_writer(target) as f:
            f.write(b"new, half written")
            raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["state.bin"]  # the temp file is gone
    with checkpoint.atomic_writer(tmp_path / "notes.txt", "w") as f:
        f.write("text")
    assert (tmp_path / "notes.txt").read_text() == "text"


def test_missing_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        checkpoint.load(tmp_path / "nope")
    checkpoint.save(tiny_gpt(), tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        checkpoint.load(tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_weights(tmp_path, damage):
    checkpoint.save(tiny_gpt(), tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\x00not safetensors" if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        checkpoint.load(tmp_path)


def test_corrupt_config(tmp_path):
    checkpoint.save(tiny_gpt(), tmp_path)
    (tmp_path / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        checkpoint.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"format": "tgraph-gpt", "model": {"x": 1}}))
    with pytest.raises(CheckpointError, match=r"unknown GPTConfig fields \['x'\]"):
        checkpoint.load(tmp_path)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"n_layer": 3}, r"missing keys \['h\.2\."),
        ({"n_layer": 1}, r"unexpected keys \['h\.1\."),
        ({"vocab_size": 65}, r"shape mismatch \['lm_head.weight: checkpoint \(64, 16\)"),
    ],
)
def test_config_mismatch(tmp_path, change, match):
    checkpoint.save(tiny_gpt(), tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["model"].update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load_into(tiny_gpt(**change), tmp_path)


def test_save_rejects_bad_input(tmp_path):
    with pytest.raises(TypeError, match="expects a tgraph GPT"):
        checkpoint.save(torch.nn.Linear(2, 2), tmp_path)
    with pytest.raises(TypeError, match="JSON-serializable"):
        checkpoint.save(tiny_gpt(), tmp_path, extra={"t": torch.zeros(1)})


def test_torn_save_is_detected(tmp_path):
    """New weights under an old config (a save killed between the two renames): clear error."""
    from tgraph.toy import checkpoint
    from tgraph.toy.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))
    checkpoint.save(model, tmp_path / "a", extra={"step": 100})
    checkpoint.save(model, tmp_path / "b", extra={"step": 200})
    (tmp_path / "b" / "config.json").replace(tmp_path / "a" / "config.json")  # torn pair
    with pytest.raises(checkpoint.CheckpointError, match="different saves"):
        checkpoint.load(tmp_path / "a")


def _damage_tensor_bytes(path, n: int = 4096) -> None:
    """Overwrite ``n`` bytes in the middle of a safetensors file's tensor data (header intact)."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    start = header + (len(data) - header) // 2
    data[start : start + n] = b"\xff" * min(n, len(data) - start)
    path.write_bytes(bytes(data))


def test_damaged_tensor_bytes_are_detected(tmp_path):
    """4 KiB of damaged tensor data must not load silently (they decode to NUL bytes)."""
    checkpoint.save(tiny_gpt(), tmp_path)
    assert set(json.loads((tmp_path / "config.json").read_text())["sha256"]) == set(
        tiny_gpt().state_dict()
    )
    checkpoint.load(tmp_path)  # intact: verifies
    _damage_tensor_bytes(tmp_path / "model.safetensors")
    match = (
        r"model\.safetensors is corrupt: the data of \d+ tensor\(s\) \(h\..+\) no longer matches"
    )
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        checkpoint.load_into(tiny_gpt(), tmp_path)


def _retype(path, name: str, dtype: torch.dtype) -> None:
    """Rewrite ``path`` with tensor ``name``'s bytes read as ``dtype`` of the same size (a
    safetensors header edited from F32 to I32: the same bytes, another meaning)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iter
    tensors[name] = tensors[name].view(dtype)
    save_file(tensors, str(path), metadata=meta)


def test_a_tensor_whose_dtype_was_edited_is_refused(tmp_path):
    """The digest covers dtype and shape: the same bytes read as int32 do not load (before,
    load_state_dict cast them to float, weights of about 1e9, and training went on)."""
    checkpoint.save(tiny_gpt(), tmp_path)
    _retype(tmp_path / "model.safetensors", "h.0.mlp.c_fc.weight", torch.int32)
    with pytest.raises(CheckpointError, match=r"corrupt: the data of 1 tensor\(s\) \(h\.0\.mlp"):
        checkpoint.load(tmp_path)
    with pytest.raises(CheckpointError, match="corrupt"):
        checkpoint.load_into(tiny_gpt(), tmp_path)


def test_an_older_checkpoints_byte_digests_still_verify(tmp_path):
    """A checkpoint saved when digests covered the bytes alone loads, its bytes verified; an
    integer tensor where the model has a float one is refused all the same."""
    model = tiny_gpt()
    checkpoint.save(model, tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    state = {k: v for k, v in model.state_dict().items()}
    data["sha256"] = {k: checkpoint._bytes_sha256(state[k]) for k in data["sha256"]}
    path.write_text(json.dumps(data))
    assert_same_weights(model, checkpoint.load(tmp_path))
    _retype(tmp_path / "model.safetensors", "h.0.mlp.c_fc.weight", torch.int32)
    with pytest.raises(CheckpointError, match=r"dtype mismatch \['h\.0\.mlp\.c_fc\.weight"):
        checkpoint.load_into(tiny_gpt(), tmp_path)


@pytest.mark.parametrize("entry", ["removed", "null"])
def test_checkpoint_without_checksums_still_loads(tmp_path, entry):
    """Checkpoints written before checksums existed load unverified, unless checksums are
    required (a null entry records none either)."""
    model = tiny_gpt()
    checkpoint.save(model, tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    if entry == "removed":
        del data["sha256"]
    else:
        data["sha256"] = None
    path.write_text(json.dumps(data))
    assert_same_weights(model, checkpoint.load(tmp_path))
    with pytest.raises(CheckpointError, match="records no sha256 checksums"):
        checkpoint.load_into(tiny_gpt(), tmp_path, require_checksums=True)
    with pytest.raises(CheckpointError, match="records no sha256 checksums"):
        checkpoint.load(tmp_path, require_checksums=True)


def test_weights_without_a_readable_config_are_refused(tmp_path):
    """The config holds the checksums: without it the weights cannot be verified."""
    checkpoint.save(tiny_gpt(), tmp_path)
    (tmp_path / "config.json").write_text('{"broken')
    with pytest.raises(CheckpointError, match="not valid JSON.*checksums of .* cannot be verified"):
        checkpoint.load_state_dict(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        checkpoint.load_into(tiny_gpt(), tmp_path)


def test_save_killed_before_its_config_never_pairs_new_weights_with_old_metadata(
    tmp_path, monkeypatch
):
    """A second save into the same directory dies after the weights, before config.json: the
    directory then refuses to load (or loads the old pair), never new weights as the old save."""
    checkpoint.save(tiny_gpt(seed=0), tmp_path, extra={"step": 100})
    real = checkpoint.atomic_writer

    def dies_at_the_config(path, mode="wb"):
        if os.path.basename(path) == "config.json":
            raise KeyboardInterrupt  # the process is stopped here
        return real(path, mode)

    monkeypatch.setattr(checkpoint, "atomic_writer", dies_at_the_config)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tiny_gpt(seed=1), tmp_path, extra={"step": 200})
    monkeypatch.undo()
    assert checkpoint.read_config(tmp_path)[1] == {"step": 100}  # the old config survived whole
    with pytest.raises(CheckpointError, match="different saves"):
        checkpoint.load(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]  # no temp files
