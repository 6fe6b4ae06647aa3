"""The paged KV cache tensors (the data-plane half; accounting lives in
``specserve.kv_blocks``), and moving K/V between slots (a draft tree's accepted path)."""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    """K and V for every layer as flat slots: slot = block_id * block_size + offset.

    Shape (layers, 2, (num_blocks + 1) * block_size, kv_heads, head_dim); a
    layer's K and V are contiguous views, so writes are one index_copy_ per step.
    The extra block is never handed out: ``trash_slot`` lies in it, and padding
    tokens of fixed-shape (graph-captured) steps write their K/V there.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.trash_slot = num_blocks * block_size
        self.data = torch.zeros(
            num_layers, 2, (num_blocks + 1) * block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )

        self._layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    def layer(self, i: int) -> tuple[Tensor, Tensor]:
        return self._layers[i]

    def move(self, src: Tensor, dst: Tensor, num_layers: int | None = None) -> None:
        """Copy the K and V of slots ``src`` to slots ``dst`` ((n,) int64 on the cache's
        device) in the first ``num_layers`` layers (None: all): one gather and one index
        copy on the device.  Every source is read before any destination is written, so
        the two may overlap.  A draft tree's accepted path moves this way from its nodes'
        slots to the positions that follow its root."""
        data = self.data if num_layers is None else self.data[:num_layers]
        data.index_copy_(2, dst, data.index_select(2, src))

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
