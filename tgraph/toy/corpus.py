"""A byte-level corpus that needs no download: the Python standard library's own sources.

Every Python installation ships a few megabytes of well-formed, varied text: the ``.py`` files of
its standard library. :func:`load_split` turns them into one byte stream per split:

* **Files.** Every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, found at run time, in
  sorted relative-path order; ``site-packages``/``dist-packages`` (third-party code) and
  ``__pycache__`` are never included; test directories (``test``, ``tests``, ``idle_test``) are
  left out unless ``include_tests=True`` (they are half of the bytes and full of odd data).
* **Split by file, deterministically.** A file goes to validation when the first 8 bytes of the
  SHA-256 of its relative path, read as a fraction of 2**64, are below ``val_fraction``. The split
  depends only on the path, never on the machine, the order of the walk or a random seed, and no
  file contributes to both splits.
* **Stream.** Each file contributes a header line ``# file: <relative path>\\n``, its raw bytes
  and a newline. The header gives generation a handy prompt (``# file: json/``).
* **Sharding.** Rank ``r`` of ``W`` owns the contiguous bytes ``[r*L//W, (r+1)*L//W)`` of a split's
  stream of length ``L`` and reads from disk only the files that overlap them (sizes come from
  ``os.stat``), so no rank holds another rank's data and nothing is cached between runs.

The size depends on the Python version; ``python -m tgraph.toy.corpus`` prints it. CPython 3.11.7,
no tests, ``val_fraction=0.05``: train 692 files, 10.91 MB; validation 42 files, 1.23 MB.

Batches: :class:`BatchSampler` draws ``(x, y)`` windows at offsets from its own seeded
``torch.Generator``; its state is part of a checkpoint, so a resumed run sees the same batches.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Directories never walked: third-party code and bytecode caches."""
TEST_DIRS = frozenset({"test", "tests", "idle_test"})
"""Test directories, skipped unless ``include_tests=True``."""
SPLITS = ("train", "val")


@dataclass(frozen=True)
class SourceFile:
    """One ``.py`` file of the corpus."""

    rel: str
    """Path relative to the stdlib root, with ``/`` separators (the split key)."""
    size: int
    """Size in bytes on disk."""

    @property
    def header(self) -> bytes:
        return f"# file: {self.rel}\n".encode()

    @property
    def stream_len(self) -> int:
        """Bytes this file contributes to its split's stream (header, contents, newline)."""
        return len(self.header) + self.size + 1


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(
    root: str | Path | None = None, *, include_tests: bool = False
) -> list[SourceFile]:
    """Every ``.py`` file of the corpus under ``root``, sorted by relative path.

    Args:
        root: directory to walk; default :func:`stdlib_root`.
        include_tests: also walk ``test``/``tests``/``idle_test`` directories.

    Returns:
        The files, sorted by their ``/``-separated relative path.

    Raises:
        FileNotFoundError: ``root`` does not exist or holds no ``.py`` file.
    """
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(
            f"corpus root {root} is not a directory; expected the standard library directory "
            "(sysconfig.get_paths()['stdlib'])"
        )
    skip = SKIP_DIRS if include_tests else SKIP_DIRS | TEST_DIRS
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                if path.is_file():  # skips dangling symlinks
                    files.append(SourceFile(path.relative_to(root).as_posix(), path.stat().st_size))
    if not files:
        raise FileNotFoundError(f"no .py files under {root}; is this a Python installation?")
    return sorted(files, key=lambda f: f.rel)


def split_of(rel: str, val_fraction: float) -> str:
    """``"val"`` or ``"train"`` for the file at relative path ``rel`` (deterministic).

    Args:
        rel: ``/``-separated path relative to the corpus root.
        val_fraction: expected share of files in validation, in ``[0, 1)``.
    """
    h = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big")
    return "val" if h < val_fraction * 2**64 else "train"


def split_files(files: list[SourceFile], split: str, val_fraction: float) -> list[SourceFile]:
    """The files of ``split`` (``"train"`` or ``"val"``), in the order given."""
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    return [f for f in files if split_of(f.rel, val_fraction) == split]


def load_split(
    split: str,
    *,
    val_fraction: float = 0.05,
    rank: int = 0,
    world_size: int = 1,
    include_tests: bool = False,
    root: str | Path | None = None,
) -> torch.Tensor:
    """Rank ``rank``'s shard of one split's byte stream, read from disk (no cache).

    Args:
        split: ``"train"`` or ``"val"``.
        val_fraction: share of files held out for validation (see :func:`split_of`).
        rank: this process's rank; it gets the ``rank``-th of ``world_size`` contiguous shards.
        world_size: number of shards.
        include_tests: include the standard library's test directories.
        root: corpus directory; default :func:`stdlib_root`.

    Returns:
        A 1-D ``uint8`` tensor of ``L // world_size`` or ``L // world_size + 1`` bytes.

    Raises:
        ValueError: bad ``split``/``rank``/``world_size``/``val_fraction``, or an empty split.
        FileNotFoundError: no corpus at ``root``.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    root = Path(root) if root is not None else stdlib_root()
    files = split_files(list_sources(root, include_tests=include_tests), split, val_fraction)
    if not files:
        raise ValueError(
            f"the {split!r} split is empty with val_fraction={val_fraction}: files are split "
            f"whole, and none falls in it; choose a "
            f"{'smaller' if split == 'train' else 'larger'} val_fraction (e.g. 0.05)"
        )
    ends = []  # ends[i]: stream offset just past file i
    total = 0
    for f in files:
        total += f.stream_len
        ends.append(total)
    lo, hi = rank * total // world_size, (rank + 1) * total // world_size
    out = bytearray()
    first = bisect.bisect_right(ends, lo)  # first file whose bytes reach past lo
    start = ends[first - 1] if first else 0
    for i in range(first, len(files)):
        if start >= hi:
            break
        f = files[i]
        piece = f.header + (root / f.rel).read_bytes() + b"\n"
        if len(piece) != f.stream_len:
            raise RuntimeError(f"{root / f.rel} changed size while the corpus was read; retry")
        out += piece[max(lo - start, 0) : hi - start]
        start = ends[i]
    return torch.frombuffer(out, dtype=torch.uint8) if out else torch.empty(0, dtype=torch.uint8)


@dataclass(frozen=True)
class CorpusStats:
    """Size of the corpus (for the README and the run's config)."""

    root: str
    files: dict[str, int]
    bytes: dict[str, int]

    def __str__(self) -> str:
        parts = [f"{s}: {self.files[s]} files, {self.bytes[s] / 1e6:.2f} MB" for s in SPLITS]
        return f"stdlib corpus at {self.root} ({'; '.join(parts)})"


def corpus_stats(
    *, val_fraction: float = 0.05, include_tests: bool = False, root: str | Path | None = None
) -> CorpusStats:
    """Number of files and stream bytes per split, without reading any file."""
    root = Path(root) if root is not None else stdlib_root()
    files = list_sources(root, include_tests=include_tests)
    n, b = {}, {}
    for s in SPLITS:
        chosen = split_files(files, s, val_fraction)
        n[s], b[s] = len(chosen), sum(f.stream_len for f in chosen)
    return CorpusStats(str(root), n, b)


class BatchSampler:
    """Random ``(x, y)`` windows of a byte stream, from a seeded generator of its own.

    Args:
        data: 1-D ``uint8`` tensor (a shard from :func:`load_split`).
        batch_size: windows per batch.
        block_size: tokens per window; ``y`` is ``x`` shifted by one byte.
        seed: seed of the sampler's generator (give each rank its own).

    Raises:
        ValueError: the shard is shorter than one window plus one byte.
    """

    def __init__(self, data: torch.Tensor, batch_size: int, block_size: int, seed: int) -> None:
        if data.dim() != 1 or data.numel() <= block_size + 1:
            raise ValueError(
                f"a shard of {data.numel()} bytes cannot hold a window of block_size={block_size} "
                "plus one target byte; use a smaller block_size or fewer ranks"
            )
        self.data = data
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)
        self._span = torch.arange(block_size + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch: ``x``, ``y`` both ``(batch_size, block_size)`` int64 on the CPU."""
        n = self.data.numel() - self.block_size - 1
        starts = torch.randint(0, n + 1, (self.batch_size,), generator=self.generator)
        chunk = self.data[starts[:, None] + self._span].long()  # (B, T + 1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"])


def fixed_batches(
    data: torch.Tensor, batch_size: int, block_size: int, num_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` evenly spaced batches covering ``data`` (validation: no randomness).

    Returns:
        A list of ``(x, y)`` pairs, each ``(batch_size, block_size)`` int64. Windows overlap when
        the shard is shorter than ``num_batches * batch_size`` windows.

    Raises:
        ValueError: the shard is shorter than one window plus one byte.
    """
    if data.numel() <= block_size + 1:
        raise ValueError(
            f"a shard of {data.numel()} bytes cannot hold a window of block_size={block_size}; "
            "use a smaller block_size, fewer ranks or a larger val_fraction"
        )
    count = batch_size * num_batches
    starts = torch.linspace(0, data.numel() - block_size - 1, count).long()
    chunk = data[starts[:, None] + torch.arange(block_size + 1)].long()  # (count, T + 1)
    x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
    return list(zip(x.split(batch_size), y.split(batch_size)))


if __name__ == "__main__":
    print(corpus_stats())
