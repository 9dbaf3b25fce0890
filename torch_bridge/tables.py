"""The per-step tables of the torch path: RoPE, the ring's write slots, slot positions and mask.

Every layer of a stack writes the same slots and sees the same positions, so all of it is
built once per step (`build_step_tables`; the twin kernels' form: `twin_tables`) and passed to
every layer. The RoPE tables follow `moshi/modules/rope.py` op for op, so they are
bit-identical to its own.

Ring convention. A row has written positions 0 .. E-1 (E = offset + T * active after the
write); position p lives in slot p % C. Slot c is labelled with the position it holds:

    end   = ref % C          delta = c - end  (in -(C-1) .. C-1)
    pos   = ref + delta       if delta <= 0   (slots at or before `end` hold this lap)
          = ref + delta - C   otherwise       (slots after `end` hold the previous lap)

with ref = E for "personaplex" and ref = offset + T - 1 (the last position written, Moshi's
`last_offset`) for "moshi". The `delta <= 0` is deliberate, not an off-by-one: with
ref = E the slot `end` is the *next* write slot, still holding position E - C, yet it is
labelled E; no query (positions < E) can see a position >= E, so "personaplex" sees a window
of C - 1 slots once the ring has wrapped, while "moshi" labels that slot E - C and sees C.
Both then set pos = -1 where c >= E (never written) or pos < start_offset[b] (recycled).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from jax_impl.config import RING_CONVENTIONS


class TorchStepTables(NamedTuple):
    """Everything one step shares across layers (the torch counterpart of `jax_impl.StepTables`).

    cos, sin:    float32 [B, 1, T, D/2]  RoPE tables for positions offset[b] + t.
    write_index: int64 [B, T]            slot written by query t: (offset[b] + t) % C.
    positions:   int64 [B, C]            position held by each slot, -1 if invisible.
    mask:        bool [B, 1, T, C]       query t of row b may attend to slot c.
    end_offset:  int64 [B]               offset after the step: offset + T * active.
    q_pos:       int64 [B, T]            the queries' positions offset[b] + t.
    write_mask:  bool [B, T]             query t writes its k, v: row active and q_pos >= start_offset.
                                         A position already recycled away (the tick after
                                         reset_slot + bump_slot_start) is not written, so a slot a
                                         row cannot see never holds a recycled session's values
                                         (see `state.py`, session isolation).

    The twin kernels' form (`twin_tables`): cos, sin from the twin RoPE kernel, the index
    tables int32 (write_mask included).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    write_index: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    end_offset: torch.Tensor
    q_pos: torch.Tensor
    write_mask: torch.Tensor


def rope_freqs(head_dim: int, max_period: float, device=None) -> torch.Tensor:
    """float32 [head_dim // 2]: freq_i = exp(i * (-ln(max_period) * 2 / head_dim)), torch's expf."""
    ds = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    return torch.exp(ds * (-math.log(max_period) * 2 / head_dim))


def rope_tables(offset: torch.Tensor, T: int, head_dim: int, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables for positions `offset[b] + t`.

    offset: int64 [B]. Returns two float32 tensors [B, 1, T, head_dim // 2],
    angle = freq_i * (offset[b] + t) with `rope_freqs`.
    """
    B = offset.shape[0]
    freqs = rope_freqs(head_dim, max_period, offset.device)
    ts = offset.float().view(-1, 1) + torch.arange(T, device=offset.device, dtype=torch.float32)
    angles = freqs * ts.view(B, 1, T, 1)
    return torch.cos(angles), torch.sin(angles)


def ring_positions(offset, start_offset, active, T: int, capacity: int, convention: str) -> torch.Tensor:
    """int64 [B, C]: the position each slot holds after this step's write, or -1."""
    if convention not in RING_CONVENTIONS:
        raise ValueError(f"ring_convention must be one of {RING_CONVENTIONS}, got {convention!r}")
    end_offset = offset + T * active.long()
    ref = (end_offset if convention == "personaplex" else offset + T - 1).view(-1, 1)
    slots = torch.arange(capacity, device=offset.device, dtype=torch.long)
    delta = slots - ref % capacity
    # `delta <= 0`, not `< 0`: see the module docstring (slot `end` belongs to this lap).
    pos = torch.where(delta <= 0, ref + delta, ref + delta - capacity)
    invisible = (slots >= end_offset.view(-1, 1)) | (pos < start_offset.view(-1, 1))
    return torch.where(invisible, torch.full_like(pos, -1), pos)


def build_step_tables(offset, start_offset, active, T: int, *, capacity: int, context: int,
                      head_dim: int, max_period: float, convention: str) -> TorchStepTables:
    """All per-step tables from the stack's offsets; offset, start_offset int64 [B], active bool [B]."""
    cos, sin = rope_tables(offset, T, head_dim, max_period)
    q_pos = offset.view(-1, 1) + torch.arange(T, device=offset.device, dtype=torch.long)  # [B, T]
    write_index = q_pos % capacity
    positions = ring_positions(offset, start_offset, active, T, capacity, convention)
    delta = q_pos.view(-1, T, 1) - positions.view(-1, 1, capacity)  # [B, T, C]
    mask = (positions.view(-1, 1, capacity) >= 0) & (delta >= 0) & (delta < context)
    write_mask = active.view(-1, 1) & (q_pos >= start_offset.view(-1, 1))
    return TorchStepTables(cos, sin, write_index, positions, mask[:, None], offset + T * active.long(), q_pos,
                           write_mask)


def twin_tables(tables: TorchStepTables, offset: torch.Tensor, T: int, freqs: torch.Tensor) -> TorchStepTables:
    """`tables` as the twin kernels read them, made once a step: the twin cos, sin [B, 1, T, D/2]
    for positions offset[b] + t (`kernels_triton.twin_rope.tables`, imported here: the reference
    path never imports triton) and the index tables in the kernels' int32 (converted by each
    layer's kernels, they had cost four small copy kernels a layer on the GPU)."""
    from kernels_triton import twin_rope

    cos, sin = twin_rope.tables(offset.to(torch.int32), T, freqs)
    index = {name: getattr(tables, name).to(torch.int32) for name in ("write_index", "positions", "q_pos", "write_mask")}
    return tables._replace(cos=cos[:, None], sin=sin[:, None], **index)
