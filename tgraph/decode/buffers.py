"""Static decode-step inputs: token ids, positions, KV slots and lengths at fixed addresses.

A decode-step graph reads its inputs from the memory it was captured with, so every input lives
in :class:`DecodeBuffers` (mini-sglang's ``GraphCaptureBuffer`` pattern):

* :meth:`DecodeBuffers.set_batch` hands out views of the first ``B`` rows; a graph for bucket
  ``B`` is captured on those views.
* :meth:`DecodeBuffers.copy_from` refreshes **every** row before a replay: the live rows get the
  batch's values and all other rows the dummy values (token 0, position 0, length 1, the dummy
  KV slot). A padded row therefore never replays a finished request's stale position or slot.

The four inputs are rows of one ``(4, max_rows)`` int64 tensor, so a refresh is one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD_TOKEN = 0
PAD_POSITION = 0
PAD_LENGTH = 1  # a padded row attends to the one key it wrote: no all-masked softmax


@dataclass(frozen=True)
class StepInputs:
    """Inputs of one decode step for ``B`` rows (all int64, shape (B,), on the model's device).

    Row ``i`` decodes token ``tokens[i]`` at ``positions[i]`` of KV slot ``slots[i]`` and attends
    to keys ``0..lengths[i]-1`` of that slot (``lengths = positions + 1``).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


def pack_rows(
    tokens: Sequence[int],
    positions: Sequence[int],
    slots: Sequence[int],
    *,
    width: int,
    dummy_slot: int,
) -> torch.Tensor:
    """Host tensor (4, width) int64: the live rows first, then dummy rows up to ``width``.

    Args:
        tokens: token id of each live row.
        positions: position of each live row's token.
        slots: KV slot of each live row.
        width: total number of rows (a bucket size, or the buffers' full width).
        dummy_slot: slot the padded rows write to.

    Returns:
        A CPU tensor with rows tokens, positions, slots, lengths.
    """
    pad = width - len(tokens)
    assert pad >= 0, f"{len(tokens)} rows do not fit in width {width}"
    return torch.tensor(
        [
            [*tokens, *[PAD_TOKEN] * pad],
            [*positions, *[PAD_POSITION] * pad],
            [*slots, *[dummy_slot] * pad],
            [*(p + 1 for p in positions), *[PAD_LENGTH] * pad],
        ],
        dtype=torch.int64,
    )


def host_staged(packed: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``packed`` (host) ready for a ``non_blocking`` copy to ``device``: pinned for CUDA, so the
    host does not wait for the running step (torch's host allocator keeps the pinned block until
    the copy ends)."""
    return packed.pin_memory() if device.type == "cuda" else packed


def as_step_inputs(packed: torch.Tensor) -> StepInputs:
    """Views of a (4, B) packed tensor as :class:`StepInputs` (no copy)."""
    return StepInputs(packed[0], packed[1], packed[2], packed[3])


class DecodeBuffers:
    """The static inputs of every decode-step graph.

    Args:
        max_rows: the largest bucket size.
        dummy_slot: the KV cache's dummy slot (padded rows write there).
        device: the model's device.

    Ownership: the views returned by :meth:`set_batch` alias this object's memory and are
    overwritten by the next :meth:`copy_from`.
    """

    def __init__(self, max_rows: int, dummy_slot: int, device: torch.device | str) -> None:
        self.max_rows = max_rows
        self.dummy_slot = dummy_slot
        self.data = torch.zeros(4, max_rows, dtype=torch.int64, device=device)
        self.reset()

    @property
    def tokens(self) -> torch.Tensor:
        return self.data[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.data[1]

    @property
    def slots(self) -> torch.Tensor:
        return self.data[2]

    @property
    def lengths(self) -> torch.Tensor:
        return self.data[3]

    def set_batch(self, rows: int) -> StepInputs:
        """Views of the first ``rows`` rows: what a graph for bucket ``rows`` is captured on."""
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows must be in [1, {self.max_rows}], got {rows}")
        return as_step_inputs(self.data[:, :rows])

    def reset(self) -> None:
        """Set every row to the dummy values (used before warmup and capture)."""
        self.copy_from([], [], [])

    def copy_from(
        self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int]
    ) -> None:
        """Refresh all ``max_rows`` rows before a replay: live rows first, dummy rows after.

        Args:
            tokens: token id of each live row.
            positions: position of each live row's token.
            slots: KV slot of each live row.

        Raises:
            ValueError: more live rows than the buffers hold.
        """
        if len(tokens) > self.max_rows:
            raise ValueError(f"{len(tokens)} rows do not fit in {self.max_rows} static rows")
        packed = pack_rows(
            tokens, positions, slots, width=self.max_rows, dummy_slot=self.dummy_slot
        )
        self.data.copy_(host_staged(packed, self.data.device), non_blocking=True)
