"""Per-stack streaming state and the operations on it (torch side).

State of a stack with L layers, B rows (sessions), H heads, C = capacity slots, D head dim:
    k, v:          [L, B, H, C, D] (the module's dtype): one ring per layer, stacked.
    offset:        int64 [B]  positions written so far by each row.
    start_offset:  int64 [B]  first position still visible to each row (slot recycling).
All layers advance together, so the offsets belong to the stack, not to a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StreamState:
    k: torch.Tensor
    v: torch.Tensor
    offset: torch.Tensor
    start_offset: torch.Tensor

    @classmethod
    def zeros(cls, num_layers, batch_size, num_heads, capacity, head_dim, dtype, device) -> StreamState:
        ring = (num_layers, batch_size, num_heads, capacity, head_dim)
        return cls(
            k=torch.zeros(ring, dtype=dtype, device=device),
            v=torch.zeros(ring, dtype=dtype, device=device),
            offset=torch.zeros(batch_size, dtype=torch.long, device=device),
            start_offset=torch.zeros(batch_size, dtype=torch.long, device=device),
        )

    @property
    def batch_size(self) -> int:
        return self.offset.shape[0]

    def reset(self) -> None:
        """Every row back to a fresh stream; rings zeroed."""
        for t in (self.k, self.v, self.offset, self.start_offset):
            t.zero_()

    def reset_slot(self, b: int) -> None:
        """Row b forgets everything it wrote; its positions keep counting."""
        self.start_offset[b] = self.offset[b]

    def bump_slot_start(self, b: int) -> None:
        """Row b forgets its oldest visible position."""
        self.start_offset[b] += 1

    def reset_rows(self, mask: torch.Tensor) -> None:
        """Rows where mask is True start a fresh stream (offset and start_offset to 0)."""
        zero = torch.zeros_like(self.offset)
        self.offset.copy_(torch.where(mask, zero, self.offset))
        self.start_offset.copy_(torch.where(mask, zero, self.start_offset))
