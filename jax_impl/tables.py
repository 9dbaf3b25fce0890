"""Per-step tables shared by every layer: RoPE cos/sin, ring write slots, positions, mask.

Same convention and names as `torch_bridge/tables.py` (its module docstring is the spec):
a row has written positions 0 .. E-1 (E = offset + T * active after the write), position p
lives in slot p % C, and slot c is labelled

    end = ref % C, delta = c - end,   pos = ref + delta if delta <= 0 else ref + delta - C

with ref = E ("personaplex") or offset + T - 1 ("moshi"); pos = -1 where c >= E (never
written) or pos < start_offset (recycled). Integer tables use the offsets' dtype
(int32, or int64 under jax x64); their values equal the torch path's exactly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.config import StackConfig
from kernels_pallas.twin_entry import row_tables


class StepTables(NamedTuple):
    """Everything one step shares across layers (see torch_bridge.TorchStepTables).

    cos, sin:    float32 [B, 1, T, D/2]
    write_index: int [B, T]      slot written by query t: (offset[b] + t) % C
    positions:   int [B, C]      position held by each slot after the write, -1 if invisible
    mask:        bool [B, 1, T, C]
    end_offset:  int [B]         offset + T * active
    q_pos:       int [B, T]      the queries' positions offset[b] + t
    write_mask:  bool [B, T]     query t writes its k, v: the row is active and q_pos >= start_offset
                                 (a position already recycled away, the tick after reset_slot +
                                 bump_slot_start, is not written: session isolation, see state.py)
    """

    cos: jax.Array
    sin: jax.Array
    write_index: jax.Array
    positions: jax.Array
    mask: jax.Array
    end_offset: jax.Array
    q_pos: jax.Array
    write_mask: jax.Array


def rope_freqs(head_dim: int, max_period: float) -> np.ndarray:
    """float32 [D/2]: exp(i * (-ln(max_period) * 2 / D)), the factor rounded to float32 first.

    The argument is formed in float32 as torch does (bit-identical); the exp is taken on the
    host in float64 and rounded once, so the table is the same on every backend. torch's
    vectorized expf (Sleef, <= 1 ulp) differs from it in a few entries by 1 ulp (D=128: 2 of 64).
    """
    ds = np.arange(head_dim // 2, dtype=np.float32)
    arg = ds * np.float32(-math.log(max_period) * 2 / head_dim)
    return np.exp(arg.astype(np.float64)).astype(np.float32)


def rope_tables(offset: jax.Array, T: int, head_dim: int, max_period: float,
                freqs: tuple[float, ...] | None = None) -> tuple[jax.Array, jax.Array]:
    """cos, sin float32 [B, 1, T, D/2] for positions offset[b] + t (angle = freq * (f32(offset) + t)).

    freqs: the [D/2] frequency table to use instead of `rope_freqs` (e.g. the torch path's,
    computed by torch's expf, to share its exact table).
    """
    freqs = rope_freqs(head_dim, max_period) if freqs is None else np.asarray(freqs, np.float32)
    ts = offset.astype(jnp.float32)[:, None] + jnp.arange(T, dtype=jnp.float32)  # [B, T]
    angles = freqs * ts[:, None, :, None]
    return jnp.cos(angles), jnp.sin(angles)


def visible_mask(q_pos, positions, context: int) -> jax.Array:
    """bool [B, 1, T, C]: slot c is visible to query t (the stacks' attention mask)."""
    delta = q_pos[:, :, None] - positions[:, None, :]  # [B, T, C]
    return ((positions[:, None, :] >= 0) & (delta >= 0) & (delta < context))[:, None]


def build_step_tables(offset, start_offset, active, T: int, *, capacity: int, context: int,
                      head_dim: int, max_period: float, convention: str,
                      freqs: tuple[float, ...] | None = None) -> StepTables:
    """All per-step tables; offset, start_offset int [B], active bool [B]."""
    idx = offset.dtype
    cos, sin = rope_tables(offset, T, head_dim, max_period, freqs)
    q_pos, write_index, write_mask, end_offset, positions = row_tables(
        offset, start_offset, active, jnp.arange(T, dtype=idx), jnp.arange(capacity, dtype=idx), T=T,
        capacity=capacity, convention=convention)
    return StepTables(cos, sin, write_index, positions, visible_mask(q_pos, positions, context), end_offset, q_pos,
                      write_mask)


def step_tables(config: StackConfig, offset, start_offset, active, T: int,
                freqs: tuple[float, ...] | None = None) -> StepTables:
    """The tables of one step of a stack, computed once and used by every layer."""
    c = config
    return build_step_tables(offset, start_offset, active, T, capacity=c.capacity, context=c.context,
                             head_dim=c.head_dim, max_period=c.max_period, convention=c.ring_convention,
                             freqs=freqs)
