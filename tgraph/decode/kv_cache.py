"""A preallocated KV cache at fixed addresses, one slot per running request plus a dummy slot.

Layout: ``k`` and ``v`` are each one tensor of shape
``(n_layer, num_slots, n_head, max_seq_len, head_dim)``, allocated once. A request owns one slot
from prefill until it finishes; its key/value for position ``p`` live at ``[layer, slot, :, p]``.
Because the tensors never move, a decode-step graph captured once keeps reading and writing the
right memory at every replay.

The last slot (``dummy_slot = num_slots - 1``) belongs to no request: the padded rows of a
batch-size bucket write there, so they can never touch a live request's keys and values.
"""

from __future__ import annotations

import torch


class KVCache:
    """Static key/value memory for ``max_batch_size`` concurrent requests (+ 1 dummy slot).

    Args:
        n_layer: number of attention layers.
        max_batch_size: number of requests that can hold a slot at once.
        n_head: attention heads per layer.
        max_seq_len: longest sequence (prompt + generated tokens) a slot can hold.
        head_dim: width of one head.
        dtype: dtype of the cached keys and values (the model's dtype).
        device: where the cache lives (the model's device).
    """

    def __init__(
        self,
        *,
        n_layer: int,
        max_batch_size: int,
        n_head: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_slots = max_batch_size + 1
        self.dummy_slot = max_batch_size
        """Slot that padded rows write to; never given to a request."""
        self.max_seq_len = max_seq_len
        shape = (n_layer, self.num_slots, n_head, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Key index 0..max_seq_len-1, built once so a decode step makes its attention mask with
        # one comparison instead of creating a tensor inside the captured region.
        self.key_positions = torch.arange(max_seq_len, device=device)  # (S,)

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values together."""
        return 2 * self.k.numel() * self.k.element_size()

    def write_prefill(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt's keys and values at positions ``0..T-1`` of ``slot``.

        Args:
            layer: layer index.
            slot: the request's slot.
            k: keys, shape (n_head, T, head_dim).
            v: values, same shape.
        """
        T = k.shape[1]
        self.k[layer, slot, :, :T] = k
        self.v[layer, slot, :, :T] = v

    def write_step(
        self,
        layer: int,
        slots: torch.Tensor,
        positions: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store one new token's key and value per row at ``[slots[i], :, positions[i]]``.

        An ``index_put_`` with device index tensors: no host sync, no data-dependent shape, so it
        is safe inside a captured graph.

        Args:
            layer: layer index.
            slots: (B,) int64 slot of each row.
            positions: (B,) int64 position of each row's new token.
            k: (B, n_head, head_dim) keys of the new tokens.
            v: (B, n_head, head_dim) values of the new tokens.
        """
        # Advanced indices around a slice: the indexed view is (B, n_head, head_dim).
        self.k[layer][slots, :, positions] = k
        self.v[layer][slots, :, positions] = v

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather the whole key/value rows of ``slots``.

        Args:
            layer: layer index.
            slots: (B,) int64 slot of each row.

        Returns:
            keys and values, each (B, n_head, max_seq_len, head_dim); positions past a row's
            length hold stale data and must be masked by the caller.
        """
        return self.k[layer].index_select(0, slots), self.v[layer].index_select(0, slots)
