"""The twin step's entry as one Pallas kernel: every per-step table, the kernels' zeroed counters and
the layer loop's first carry in one launch; plain reference `entry_native` beside it.

Each of these was a launch of its own on an H200 (an XLA fusion or two for the integer tables, the
RoPE tables kernel, a memset of the counters, a copy of x into the loop's carry, a copy of the
offsets before the fusion that overwrote them): 5 to 8 launches, of the 197 (Helium) and 50 (Mimi)
a whole step launches with this kernel (benchmarks/RESULTS.md, "launch_map_gpu"). The torch twin step
builds the same tables with torch operations and `kernels_triton.twin_rope.tables` (its launches cost
nothing under a CUDA graph).

Program b (one per row) writes, for that row:

    cos, sin [T, D/2]    twin_rope's contract: angle = (float32(offset) + t) * freqs, `twin_math.sincos`
    q_pos, write_index, write_mask, end_offset [T] / [1], positions [C]
                         `row_tables` on the row's tiles: the expressions of the jax.numpy
                         tables (`jax_impl.tables`), integers, exact
    sems [H*T] = 0       the counters of the step's attention kernels (`twin_attention.attention(sems=)`)
    x [T, dim]           a copy of the step's input: the layer loop's carry starts in a buffer a kernel
                         wrote (XLA copies a caller's x into the loop otherwise)

end_offset is written over offset (aliased: in place when the state is donated). Nothing here is
summed or rounded across rows: batch-invariant by construction.

Derivative (`entry` is a `jax.custom_vjp`): x's cotangent is the copy's, unchanged (no kernel);
the tables are functions of the integer offsets and of freqs, which is not differentiated (a
perturbed freqs raises NotImplementedError), and cos, sin come back behind `lax.stop_gradient`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import backend, twin_grad, twin_rope
from kernels_pallas.contract.attention import twin_sems_size
from kernels_pallas.contract.numerics import check_nonempty, next_pow2, positive_int
from kernels_pallas.contract.rope import RING_CONVENTIONS

TILE = 1024  # elements of positions and of x a program handles at a time (a loop over tiles)


class Entry(NamedTuple):
    """What `entry` returns. Integer tables in offset's dtype, write_mask int32 (the kernels read it so)."""

    end_offset: jax.Array   # [B]        offset + T * active
    cos: jax.Array          # f32 [B, T, D/2]
    sin: jax.Array          # f32 [B, T, D/2]
    q_pos: jax.Array        # [B, T]     offset + t
    write_index: jax.Array  # [B, T]     q_pos % C
    write_mask: jax.Array   # int32 [B, T]  1: query t writes its k, v (active, q_pos >= start_offset)
    positions: jax.Array    # [B, C]     the position each slot holds after the write, or -1
    sems: jax.Array         # int32 [B * H * T] zeros
    x: jax.Array            # [B, T, dim] a copy of x


def row_tables(offset, start_offset, active, t, slots, *, T: int, capacity: int, convention: str):
    """The integer tables of rows offset, start_offset int [R], active [R] (bool, or int 0/1) at
    query indexes t [Tq] and ring slots [S] (`jax_impl.tables.build_step_tables`: arange(T), arange(C);
    the entry kernel here: one row's padded power-of-two tiles, so both compute these with the same
    expressions). Returns (q_pos [R, Tq], write_index [R, Tq], write_mask bool
    [R, Tq], end_offset [R], positions [R, S]: the position each slot holds after this step's
    write, or -1), in offset's dtype."""
    if convention not in RING_CONVENTIONS:
        raise ValueError(f"ring_convention must be one of {RING_CONVENTIONS}, got {convention!r}")
    idx = offset.dtype
    on = active.astype(idx)
    q_pos = offset[:, None] + t.astype(idx)[None, :]
    write_mask = (on[:, None] != 0) & (q_pos >= start_offset[:, None])
    end_offset = offset + T * on
    ref = (end_offset if convention == "personaplex" else offset + (T - 1))[:, None]
    slots = slots.astype(idx)[None, :]
    delta = slots - ref % capacity
    # `delta <= 0`, not `< 0`: see torch_bridge/tables.py (slot `end` belongs to this lap).
    pos = jnp.where(delta <= 0, ref + delta, ref + delta - capacity)
    invisible = (slots >= end_offset[:, None]) | (pos < start_offset[:, None])
    positions = jnp.where(invisible, jnp.asarray(-1, idx), pos)
    return q_pos, q_pos % capacity, write_mask, end_offset, positions


def _entry_kernel(*refs, T, C, HT, X, convention, all_active, gpu):
    """refs: offset, start_offset, active (unless all_active), freqs, x, then the outputs (`Entry`'s order)."""
    if all_active:
        offset_ref, start_ref, freqs_ref, x_ref, *outs = refs
    else:
        offset_ref, start_ref, active_ref, freqs_ref, x_ref, *outs = refs
    end_ref, cos_ref, sin_ref, qpos_ref, slot_ref, wmask_ref, pos_ref, sems_ref, xout_ref = outs
    b = pl.program_id(0)
    one = jnp.arange(1, dtype=jnp.int32)
    offset, start = pltriton.load(offset_ref.at[b + one]), pltriton.load(start_ref.at[b + one])   # [1]
    active = jnp.ones((1,), jnp.bool_) if all_active else pltriton.load(active_ref.at[b + one])
    # Every tile is a power of two; the lanes past the end repeat the last element (its index, so its
    # value), so no store is masked: a duplicate writes the same value to the same place, on the GPU
    # as interpreted (where a masked store would write the old value back through a duplicate index).
    t = jnp.minimum(jnp.arange(next_pow2(T), dtype=jnp.int32), T - 1)
    rows = functools.partial(row_tables, offset, start, active, T=T, capacity=C, convention=convention)
    q_pos, write_index, write_mask, end_offset, _ = rows(t, t)  # (slots t: positions come by tiles below)
    at_t = b * T + t
    pltriton.store(qpos_ref.at[at_t], q_pos[0])
    pltriton.store(slot_ref.at[at_t], write_index[0])
    pltriton.store(wmask_ref.at[at_t], write_mask[0].astype(jnp.int32))
    pltriton.store(end_ref.at[b + one], end_offset)

    cos, sin = twin_rope.angle_sincos(offset.astype(jnp.float32) + t.astype(jnp.float32), freqs_ref[...], gpu)
    half = cos.shape[1]
    at_ti = at_t[:, None] * half + jnp.arange(half, dtype=jnp.int32)[None, :]        # [Tp, half]
    pltriton.store(cos_ref.at[at_ti], cos)
    pltriton.store(sin_ref.at[at_ti], sin)

    def tiles(n: int, body):  # body(i) over 0..n-1 in tiles of at most TILE (the last one's end repeated)
        size = min(TILE, next_pow2(n))

        def step(j, carry):
            body(jnp.minimum(j * size + jnp.arange(size, dtype=jnp.int32), n - 1))
            return carry

        lax.fori_loop(0, -(-n // size), step, 0)

    tiles(C, lambda c: pltriton.store(pos_ref.at[b * C + c], rows(t, c)[4][0]))
    tiles(HT, lambda i: pltriton.store(sems_ref.at[b * HT + i], jnp.zeros(i.shape, jnp.int32)))
    tiles(X, lambda i: pltriton.store(xout_ref.at[b * X + i], pltriton.load(x_ref.at[b * X + i])))


def _check(offset, start_offset, active, x, freqs, capacity, num_heads):
    for name, v in (("capacity", capacity), ("num_heads", num_heads)):
        if not positive_int(v):
            raise ValueError(f"entry({name}): expected a positive int, got {v!r}")
    B = offset.shape[0] if len(offset.shape) == 1 else -1
    for name, a in (("offset", offset), ("start_offset", start_offset)):
        if tuple(a.shape) != (B,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"entry({name}): expected an integer [B] array, got {a.dtype}{list(a.shape)}")
    if start_offset.dtype != offset.dtype:
        raise ValueError(f"entry(start_offset): expected offset's dtype {offset.dtype}, got {start_offset.dtype}")
    if active is not None and (tuple(active.shape) != (B,) or active.dtype != jnp.bool_):
        raise ValueError(f"entry(active): expected bool [{B}], got {active.dtype}{list(active.shape)}")
    if len(x.shape) != 3 or x.shape[0] != B:
        raise ValueError(f"entry(x): expected [{B}, T, dim], got {list(x.shape)}")
    check_nonempty("entry", "x", x.shape, ("batch row (B)", "query (T)", "feature (dim)"))
    half = freqs.shape[0] if len(freqs.shape) == 1 else 0
    if half < 1 or half & (half - 1):
        raise ValueError(f"entry(freqs): expected [D/2] with D/2 a power of two, got {list(freqs.shape)}")
    return B, x.shape[1], half


def entry(offset: jax.Array, start_offset: jax.Array, active: jax.Array | None, x: jax.Array, freqs: jax.Array, *,
          capacity: int, convention: str, num_heads: int, interpret: bool | None = None) -> Entry:
    """The step's tables, counters and carry (`Entry`) in one launch.

    offset, start_offset: int [B] (one dtype); active: bool [B], or None: every row (known when the
    step is traced, so not an operand: a [B] array of ones made in the step is a launch on a GPU);
    x: [B, T, dim]; freqs: float32 [D/2];
    capacity: the ring's slots C; convention: the ring convention (`contract.rope.RING_CONVENTIONS`);
    num_heads: H (the counters are `contract.attention.twin_sems_size(B, H, T)`).
    """
    _check(offset, start_offset, active, x, freqs, capacity, num_heads)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    out = _differentiable((capacity, convention, num_heads, interpret), offset, start_offset, active, x, freqs)
    return out._replace(cos=lax.stop_gradient(out.cos), sin=lax.stop_gradient(out.sin))


def _forward(statics, offset, start_offset, active, x, freqs) -> Entry:
    """The kernel (`entry`, its arguments checked); statics: (capacity, convention, num_heads, interpret)."""
    capacity, convention, num_heads, interpret = statics
    B, T, half = _check(offset, start_offset, active, x, freqs, capacity, num_heads)
    if backend.on_mosaic() and half % 8 == 0:  # the same bits: the RoPE tables by a Mosaic GPU kernel, the rest by XLA
        from kernels_pallas import twin_rope_mgpu

        return twin_rope_mgpu.entry(offset, start_offset, active, x, freqs, capacity=capacity, convention=convention,
                                    num_heads=num_heads, interpret=interpret)
    idx = offset.dtype
    HT, X = num_heads * T, T * x.shape[2]
    kernel = functools.partial(_entry_kernel, T=T, C=capacity, HT=HT, X=X, convention=convention,
                               all_active=active is None, gpu=not interpret)
    operands = (offset, start_offset) + (() if active is None else (active,))
    shape = jax.ShapeDtypeStruct
    outs = pl.pallas_call(
        kernel,
        out_shape=(shape((B,), idx), shape((B * T * half,), jnp.float32), shape((B * T * half,), jnp.float32),
                   shape((B * T,), idx), shape((B * T,), idx), shape((B * T,), jnp.int32),
                   shape((B * capacity,), idx), shape((twin_sems_size(B, num_heads, T),), jnp.int32),
                   shape((B * X,), x.dtype)),
        grid=(B,), input_output_aliases={0: 0}, interpret=interpret, name="twin_entry",
        compiler_params=pltriton.CompilerParams(),  # Triton, not whatever the default backend is
    )(*operands, freqs.astype(jnp.float32), x.reshape(-1))
    end, cos, sin, q_pos, slot, wmask, pos, sems, x_out = outs
    return Entry(end, cos.reshape(B, T, half), sin.reshape(B, T, half), q_pos.reshape(B, T), slot.reshape(B, T),
                 wmask.reshape(B, T), pos.reshape(B, capacity), sems, x_out.reshape(x.shape))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(statics, offset, start_offset, active, x, freqs) -> Entry:
    return _forward(statics, offset, start_offset, active, x, freqs)


def _differentiable_fwd(statics, offset, start_offset, active, x, freqs):
    """symbolic_zeros: each primal comes with `.perturbed` (refuse a differentiated freqs)."""
    if freqs.perturbed:
        raise NotImplementedError("entry(freqs): the RoPE frequencies have no derivative here; "
                                  "differentiate x only")
    values = [None if a is None else a.value for a in (offset, start_offset, active, x, freqs)]
    return _forward(statics, *values), None


def _differentiable_bwd(statics, _residuals, cotangents: Entry):
    return None, None, None, twin_grad.dense(cotangents.x), None


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd, symbolic_zeros=True)


def entry_native(offset, start_offset, active, x, freqs, *, capacity: int, convention: str, num_heads: int,
                 **_) -> Entry:
    """The plain jax.numpy reference of `entry` (same signature and bits)."""
    B, T, _half = _check(offset, start_offset, active, x, freqs, capacity, num_heads)
    idx = offset.dtype
    active = jnp.ones((B,), bool) if active is None else active
    q_pos, write_index, write_mask, end_offset, positions = row_tables(
        offset, start_offset, active, jnp.arange(T, dtype=idx), jnp.arange(capacity, dtype=idx), T=T,
        capacity=capacity, convention=convention)
    cos, sin = twin_rope.tables_native(offset, T, freqs)
    return Entry(end_offset, cos, sin, q_pos, write_index, write_mask.astype(jnp.int32), positions,
                 jnp.zeros((twin_sems_size(B, num_heads, T),), jnp.int32), x)


__all__ = ["Entry", "entry", "entry_native"]
