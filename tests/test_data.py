"""The stdlib byte corpus: deterministic split by file, exact sharding, seeded batches."""

from __future__ import annotations

import random

import pytest
import torch

from tgraph.toy import corpus as data


@pytest.fixture(scope="module")
def sources() -> list[data.SourceFile]:
    return data.list_sources()


def test_corpus_excludes_third_party_and_tests(sources):
    rels = [f.rel for f in sources]
    assert rels == sorted(rels)
    parts = {p for r in rels for p in r.split("/")[:-1]}
    assert not parts & (data.SKIP_DIRS | data.TEST_DIRS)
    assert "os.py" in rels and "json/decoder.py" in rels
    with_tests = data.list_sources(include_tests=True)
    assert len(with_tests) > len(sources)


def test_split_is_by_file_deterministic_and_disjoint(sources):
    train = data.split_files(sources, "train", 0.05)
    val = data.split_files(sources, "val", 0.05)
    assert {f.rel for f in train}.isdisjoint(f.rel for f in val)
    assert len(train) + len(val) == len(sources)
    assert 0.01 < len(val) / len(sources) < 0.15  # a hash, not an exact quota
    # The split of a file depends on its path only: not on the order or the set of files.
    shuffled = list(sources)
    random.Random(0).shuffle(shuffled)
    assert {f.rel for f in data.split_files(shuffled[:100], "val", 0.05)} == {
        f.rel for f in val if f in shuffled[:100]
    }
    # Pinned values: a change of the hash would silently move files between splits.
    assert [data.split_of(p, 0.05) for p in ("os.py", "json/decoder.py")] == ["train", "train"]
    assert data.split_of("abc.py", 0.05) == data.split_of("abc.py", 0.05)


def test_split_val_fraction_moves_files_only_one_way(sources):
    small = {f.rel for f in data.split_files(sources, "val", 0.05)}
    large = {f.rel for f in data.split_files(sources, "val", 0.2)}
    assert small <= large  # growing the validation share never moves a file back to train


def test_loaded_split_is_identical_on_reload():
    a = data.load_split("val")
    b = data.load_split("val")
    assert a.dtype == torch.uint8 and a.dim() == 1
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert bytes(a[:8].tolist()) == b"# file: "
    stats = data.corpus_stats()
    assert stats.bytes["val"] == a.numel()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_rank_shards_tile_the_stream(world_size):
    full = data.load_split("val")
    shards = [data.load_split("val", rank=r, world_size=world_size) for r in range(world_size)]
    assert max(s.numel() for s in shards) - min(s.numel() for s in shards) <= 1
    torch.testing.assert_close(torch.cat(shards), full, rtol=0, atol=0)


def test_sampler_is_seeded_and_resumable():
    shard = data.load_split("val")
    a = data.BatchSampler(shard, batch_size=4, block_size=16, seed=7)
    b = data.BatchSampler(shard, batch_size=4, block_size=16, seed=7)
    x, y = a.next()
    assert x.shape == (4, 16) and x.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1], rtol=0, atol=0)  # y is x shifted by one
    b.next()
    state = a.state_dict()
    after = a.next()
    b.load_state_dict(state)
    for t, u in zip(after, b.next()):
        torch.testing.assert_close(t, u, rtol=0, atol=0)
    c = data.BatchSampler(shard, batch_size=4, block_size=16, seed=8)
    assert not torch.equal(c.next()[0], x)


def test_fixed_batches_and_errors():
    shard = data.load_split("val")
    batches = data.fixed_batches(shard, batch_size=2, block_size=8, num_batches=3)
    assert len(batches) == 3 and batches[0][0].shape == (2, 8)
    with pytest.raises(ValueError, match="block_size"):
        data.BatchSampler(shard[:5], batch_size=1, block_size=8, seed=0)
    with pytest.raises(ValueError, match="rank"):
        data.load_split("train", rank=2, world_size=2)
    with pytest.raises(ValueError, match="split"):
        data.split_files([], "dev", 0.05)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        data.list_sources("/nonexistent/stdlib")
