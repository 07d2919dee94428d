"""A recipe run killed right after it wrote a given checkpoint (resume tests of the recipes)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gpt_training import trainer  # recipes/ is on sys.path: tests/conftest.py


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the recipe catches it."""


@contextmanager
def killed_after_checkpoint(monkeypatch, name: str = "step_000004") -> Iterator[None]:
    """Inside, the trainer raises :class:`Killed` right after writing checkpoint ``name``."""
    save = trainer.save_checkpoint

    def save_then_die(*args, **kwargs):
        path = save(*args, **kwargs)
        if path.name == name:
            raise Killed
        return path

    monkeypatch.setattr(trainer, "save_checkpoint", save_then_die)
    try:
        yield
    finally:
        monkeypatch.setattr(trainer, "save_checkpoint", save)
