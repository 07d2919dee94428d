"""A preallocated KV cache at fixed addresses, one slot per running request.

Layout: ``k`` and ``v`` are each one tensor of shape
``(n_layer, max_batch_size, n_head, max_seq_len, head_dim)``, allocated once. A request owns one
slot from prefill until it finishes; its key/value for position ``p`` live at
``[layer, slot, :, p]``. Because the tensors never move, a graph captured once keeps reading and
writing the right memory at every replay.

Slots are rows. The engine keeps the ``n`` running requests in slots ``0..n-1``, in batch order
(a request that leaves is replaced by the last one, whose keys and values :meth:`move` copies
once). So a step of ``B`` rows attends to ``k[layer, :B]`` as it is, a view (:meth:`read`),
instead of gathering every row's whole slot at every step and layer (``index_select`` of
``B * n_head * max_seq_len * head_dim`` elements, the largest per-step cost the engine had over
a hand-written loop at batch 64). Padding rows ``n..B-1`` use their own slots, which are free.
"""

from __future__ import annotations

import torch


class KVCache:
    """Static key/value memory for ``max_batch_size`` concurrent requests, one slot each.

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
        self.num_slots = max_batch_size
        self.max_seq_len = max_seq_len
        shape = (n_layer, self.num_slots, n_head, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Key index 0..max_seq_len-1, built once so a decode step makes its attention mask with
        # one comparison instead of creating a tensor inside the captured region.
        self.key_positions = torch.arange(max_seq_len, device=device)  # (S,)

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the cached keys and values."""
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        """Bytes held by keys and values together."""
        return 2 * self.k.numel() * self.k.element_size()

    def write_prefill(
        self, layer: int, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store a prompt's keys and values at positions ``0..T-1`` of ``slot``. Graph-safe.

        Args:
            layer: layer index.
            slot: (1,) int64, the request's slot (a device tensor: one graph serves every slot).
            k: keys, shape (n_head, T, head_dim); padding positions may be written too (a
                decode step masks keys at or past its length, and overwrites them as it goes).
            v: values, same shape.
        """
        T = k.shape[1]
        self.k[layer, :, :, :T].index_copy_(0, slot, k[None])
        self.v[layer, :, :, :T].index_copy_(0, slot, v[None])

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

    def read(self, layer: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``0..rows-1`` (row ``i`` is slot ``i``): views, no copy.

        Args:
            layer: layer index.
            rows: B, the rows of the step.

        Returns:
            keys and values, each (B, n_head, max_seq_len, head_dim); positions past a row's
            length hold stale data and must be masked by the caller.
        """
        return self.k[layer, :rows], self.v[layer, :rows]

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s keys and values into slot ``dst`` (keeps slots == rows)."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
