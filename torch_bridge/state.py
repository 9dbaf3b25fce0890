"""Per-stack streaming state and the operations on it (torch side).

State of a stack with L layers, B rows (sessions), H heads, C = capacity slots, D head dim:
    k, v:          [L, B, H, C, D] (the module's dtype): one ring per layer, stacked.
    offset:        int64 [B]  positions written so far by each row.
    start_offset:  int64 [B]  first position still visible to each row (slot recycling).
All layers advance together, so the offsets belong to the stack, not to a layer.

Session isolation: `reset_slot` and `reset_rows` zero the recycled rows' rings, and a step does
not write positions below start_offset (`tables.TorchStepTables.write_mask`), so a slot a row cannot see
holds zeros or its current session's values. Masked slots are multiplied by an exact 0 in SDPA,
and 0 * NaN = NaN: without this an old session's NaN / Inf would reach the new session's outputs.
On finite data no output changes by a bit (0 * finite = 0 whatever the slot held); the cost is
a write of the row's ring per `reset_slot` (a pass over the whole ring per `reset_rows`), none per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TorchStreamState:
    """The torch stacks' streaming state (the torch counterpart of the `jax_impl.StreamState` pytree)."""

    k: torch.Tensor
    v: torch.Tensor
    offset: torch.Tensor
    start_offset: torch.Tensor

    @classmethod
    def zeros(cls, num_layers, batch_size, num_heads, capacity, head_dim, dtype, device) -> TorchStreamState:
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
        """Row b forgets everything it wrote (its ring rows zeroed); its positions keep counting."""
        self.k[:, b].zero_()
        self.v[:, b].zero_()
        self.start_offset[b] = self.offset[b]

    def bump_slot_start(self, b: int) -> None:
        """Row b forgets its oldest visible position: start_offset[b] += 1, past offset[b] too."""
        self.start_offset[b] += 1

    def reset_rows(self, mask: torch.Tensor) -> None:
        """Rows where mask is True start a fresh stream (offset and start_offset to 0, rings zeroed).

        `masked_fill_` over the whole ring: no device sync (as `nonzero` would need), fixed shape.
        """
        rows = mask.view(1, -1, 1, 1, 1)
        self.k.masked_fill_(rows, 0)
        self.v.masked_fill_(rows, 0)
        zero = torch.zeros_like(self.offset)
        self.offset.copy_(torch.where(mask, zero, self.offset))
        self.start_offset.copy_(torch.where(mask, zero, self.start_offset))
