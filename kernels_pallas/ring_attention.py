"""Decode attention over a stacked ring KV cache, read in place, as a Pallas kernel.

The streaming stacks keep every layer's ring in one buffer `ring [L, B, H, C, D]`. Slicing a
layer's ring out of it inside a jitted step (`ring[layer]`, a dynamic slice when the layer
index is traced) makes XLA copy `B*H*C*D` elements per layer; this kernel instead takes the
whole buffer and the layer index, and reads the layer's slots where they are.

Split-K ("flash decoding"): program (b*H + h, s) scans slots `s*chunk .. (s+1)*chunk` in blocks
of `block_c`, with an online softmax, and writes its partial `(acc, max, sum)`; `combine`
merges the `splits` partials. Slot c is visible to query t of row b iff

    positions[b, c] >= 0  and  0 <= q_pos[b, t] - positions[b, c] < context

(the streaming stacks' mask); a query that sees no slot gets exactly +0 (as torch's SDPA
returns for an all-False mask row; `combine` selects it, so what masked slots hold cannot
show): a row whose start_offset is past its offset (`reset_slot` + `bump_slot_start`) or
that never wrote has positions all -1 and works as any other.
Queries are padded to `MIN_QUERIES` rows so both products run on tensor cores.

`ring_attention_native` is the plain jax.numpy reference with the same signature.
Differentiable (`jax.custom_vjp`): the backward is the `jax.vjp` of `ring_attention_native` on the
layer's slots (XLA, not a Pallas kernel), with the slots no query of a row sees zeroed first, so
what they hold (NaN included) reaches no gradient; the rings' cotangent is nonzero on layer
`layer` only (the cost of the reference path's `ring[layer]`). layer, positions and q_pos are
integers: no cotangent.
Offsets are int32: `L*B*H*C*D` must stay below 2**31 (`fits_int32` says whether it does).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import backend
from kernels_pallas.contract.numerics import INT32_MAX, sixteen_bit
from kernels_pallas.twin_math import layer_index

MIN_QUERIES = 16  # tensor-core tiles need at least 16 rows
TARGET_PROGRAMS = 2048  # default splits: about this many programs in all (best measured for the 7B ring)


def fits_int32(ring_shape) -> bool:
    """Whether flat int32 offsets address every element of a ring of this shape."""
    return math.prod(ring_shape) <= INT32_MAX


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _kernel(layer_ref, q_ref, k_ref, v_ref, pos_ref, qpos_ref, acc_ref, m_ref, l_ref, *,
            B, H, T, C, D, Tp, context, chunk, block_c, splits, scale, compiled_gpu):
    bh = pl.program_id(0)
    split = pl.program_id(1)
    # float32 rings: full-precision products (Triton would otherwise use TF32 tensor cores)
    precision = lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 else None
    b = bh // H
    t = jnp.arange(Tp, dtype=jnp.int32)
    d = jnp.arange(D, dtype=jnp.int32)
    t_ok = t < T

    def offsets(offs, mask):  # interpreted, masked lanes must still index inside the ref
        return offs if compiled_gpu else jnp.where(mask, offs, 0)

    q_mask = t_ok[:, None]
    q = pltriton.load(q_ref.at[offsets((bh * T + t[:, None]) * D + d[None, :], q_mask)], mask=q_mask, other=0)
    q = (q.astype(jnp.float32) * scale).astype(k_ref.dtype)  # [Tp, D]
    q_pos = pltriton.load(qpos_ref.at[offsets(b * T + t, t_ok)], mask=t_ok, other=0)  # [Tp]
    layer = layer_ref[0]
    ring_row = (layer * B * H + bh) * C  # first slot of this (layer, b, h)
    start = split * chunk
    stop = jnp.minimum(start + chunk, C)

    def body(i, carry):
        m, l, acc = carry
        c = start + i * block_c + jnp.arange(block_c, dtype=jnp.int32)
        c_ok = c < stop
        pos = pltriton.load(pos_ref.at[offsets(b * C + c, c_ok)], mask=c_ok, other=-1)
        kv_mask = c_ok[:, None]
        kv_offs = offsets((ring_row + c[:, None]) * D + d[None, :], kv_mask)
        k = pltriton.load(k_ref.at[kv_offs], mask=kv_mask, other=0)  # [block_c, D]
        v = pltriton.load(v_ref.at[kv_offs], mask=kv_mask, other=0)
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32, precision=precision)  # [Tp, block_c]
        delta = q_pos[:, None] - pos[None, :]
        visible = c_ok[None, :] & (pos[None, :] >= 0) & (delta >= 0) & (delta < context)
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)  # 0 while nothing was visible (m == -inf)
        p = jnp.where(visible, jnp.exp(s - m_safe[:, None]), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32,
                                             precision=precision)
        return m_new, l, acc

    init = (jnp.full((Tp,), -jnp.inf, jnp.float32), jnp.zeros((Tp,), jnp.float32),
            jnp.zeros((Tp, D), jnp.float32))
    m, l, acc = lax.fori_loop(0, chunk // block_c, body, init)
    part = bh * splits + split
    pltriton.store(acc_ref.at[(part * Tp + t[:, None]) * D + d[None, :]], acc)
    pltriton.store(m_ref.at[part * Tp + t], m)
    pltriton.store(l_ref.at[part * Tp + t], l)


def ring_attention(q: jax.Array, ring_k: jax.Array, ring_v: jax.Array, layer, positions: jax.Array,
                   q_pos: jax.Array, *, context: int, block_c: int = 128, splits: int | None = None,
                   num_warps: int = 4, interpret: bool | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(D) | visible) v over layer `layer` of a stacked ring.

    q: [B, H, T, D] (the ring's dtype, or float32); ring_k, ring_v: [L, B, H, C, D];
    layer: int or int32 scalar (may be traced); positions: int [B, C] (-1: invisible);
    q_pos: int [B, T] the queries' positions. Returns [B, H, T, D] in q's dtype.
    D must be a power of two, T <= MIN_QUERIES, and `fits_int32(ring_k.shape)`.
    block_c: slots per inner block (a power of two); splits: programs per (b, h) along the
    ring (None: about TARGET_PROGRAMS programs in all).
    """
    _, B, H, _C, D = ring_k.shape
    T = q.shape[2]
    if ring_v.shape != ring_k.shape or q.shape != (B, H, T, D):
        raise ValueError(f"ring_attention: q {q.shape} and rings {ring_k.shape}, {ring_v.shape} do not fit")
    if D & (D - 1) or block_c & (block_c - 1) or T > MIN_QUERIES:
        raise ValueError(f"ring_attention: head dim ({D}) and block_c ({block_c}) must be powers of two "
                         f"and T ({T}) at most {MIN_QUERIES}")
    if not fits_int32(ring_k.shape):
        raise ValueError(f"ring_attention: ring {ring_k.shape} has more than 2**31 elements; "
                         "use the XLA attention path")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    options = _Options(context, block_c, splits, num_warps, interpret, ring_k.shape[0])
    layer = layer_index("ring_attention", layer, ring_k.shape[0])  # out of range: another layer's, or no, memory
    return _differentiable(options, q, ring_k, ring_v, layer, positions, q_pos)


class _Options(NamedTuple):
    """ring_attention's static options (hashable: custom_vjp's non-differentiable argument)."""

    context: int
    block_c: int
    splits: int | None
    num_warps: int
    interpret: bool
    layers: int  # L, the stacked rings' layers (the shape of their cotangent)


def _forward(o: _Options, q, ring_k, ring_v, layer, positions, q_pos):
    """The kernel (`ring_attention`, its arguments checked). With PERSONAPLEX_PALLAS_BACKEND=mosaic_gpu
    (`kernels_pallas.backend`): the twin attention's Mosaic GPU kernel where it takes the call (q in the
    rings' 16-bit dtype, a head dim of a multiple of 64; the twin contract's numerics, not this kernel's),
    else `ring_attention_native` (XLA)."""
    _, B, H, C, D = ring_k.shape
    if backend.on_mosaic():
        if sixteen_bit(ring_k.dtype) and q.dtype == ring_k.dtype and D % 64 == 0:
            from kernels_pallas import twin_attention_mgpu

            out = twin_attention_mgpu.attention(q, ring_k, ring_v, layer, positions, q_pos, context=o.context,
                                                interpret=o.interpret)
            return out.transpose(0, 2, 1, 3)
        return ring_attention_native(q, ring_k, ring_v, layer, positions, q_pos, context=o.context)
    T = q.shape[2]
    block_c, splits, interpret = o.block_c, o.splits, o.interpret
    if splits is None:
        splits = max(1, min(_ceil_div(C, block_c), _ceil_div(TARGET_PROGRAMS, B * H)))
    chunk = _ceil_div(_ceil_div(C, splits), block_c) * block_c  # slots per split, a multiple of block_c
    splits = _ceil_div(C, chunk)
    Tp = MIN_QUERIES
    kernel = functools.partial(_kernel, B=B, H=H, T=T, C=C, D=D, Tp=Tp, context=o.context, chunk=chunk,
                               block_c=block_c, splits=splits, scale=1.0 / math.sqrt(D),
                               compiled_gpu=not interpret)
    parts = B * H * splits
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((parts * Tp * D,), jnp.float32),
                   jax.ShapeDtypeStruct((parts * Tp,), jnp.float32),
                   jax.ShapeDtypeStruct((parts * Tp,), jnp.float32)),
        grid=(B * H, splits),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=o.num_warps, num_stages=2),
        name="ring_attention",
    )(jnp.asarray(layer, jnp.int32).reshape(1), q.reshape(-1), ring_k.reshape(-1), ring_v.reshape(-1),
      positions.astype(jnp.int32).reshape(-1), q_pos.astype(jnp.int32).reshape(-1))
    return combine(acc.reshape(B, H, splits, Tp, D), m.reshape(B, H, splits, Tp),
                   l.reshape(B, H, splits, Tp))[:, :, :T].astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(o: _Options, q, ring_k, ring_v, layer, positions, q_pos):
    return _forward(o, q, ring_k, ring_v, layer, positions, q_pos)


def _differentiable_fwd(o: _Options, q, ring_k, ring_v, layer, positions, q_pos):
    """The kernel's output, and the residuals: the layer's slots (a slice, not the stacked rings:
    under a scan over layers the residuals are stacked per layer), the integer tables."""
    k, v = (lax.dynamic_index_in_dim(r, layer, keepdims=False) for r in (ring_k, ring_v))
    return _forward(o, q, ring_k, ring_v, layer, positions, q_pos), (q, k, v, layer, positions, q_pos)


def _differentiable_bwd(o: _Options, residuals, d_out):
    q, k, v, layer, positions, q_pos = residuals
    delta = q_pos[:, :, None] - positions[:, None, :]
    seen = jnp.any((positions[:, None, :] >= 0) & (delta >= 0) & (delta < o.context), axis=1)  # [B, C]
    k, v = (jnp.where(seen[:, None, :, None], r, jnp.zeros((), r.dtype)) for r in (k, v))
    _, vjp = jax.vjp(lambda q, k, v: ring_attention_native(q, k[None], v[None], 0, positions, q_pos,
                                                           context=o.context), q, k, v)
    dq, dk, dv = vjp(d_out)

    def ring(d):  # the layer's cotangent placed in the stacked rings' shape
        return lax.dynamic_update_index_in_dim(jnp.zeros((o.layers, *d.shape), d.dtype), d, layer, 0)

    return dq, ring(dk), ring(dv), None, None, None


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def combine(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
    """Merge split partials: acc [..., S, T, D], m, l [..., S, T] -> [..., T, D] (0 if nothing seen)."""
    m_all = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp(m - jnp.where(m_all == -jnp.inf, 0.0, m_all))  # 0 for splits that saw nothing
    total = jnp.sum(l * w, axis=-2)
    out = jnp.sum(acc * w[..., None], axis=-3)
    seen = (total != 0)[..., None]  # 0: nothing visible; a NaN total (a visible NaN) propagates
    return jnp.where(seen, out / jnp.where(seen, total[..., None], 1.0), 0.0)


def ring_attention_native(q, ring_k, ring_v, layer, positions, q_pos, *, context: int, **_):
    """The plain jax.numpy reference: same signature and semantics as `ring_attention`."""
    D = q.shape[-1]
    k, v = ring_k[layer], ring_v[layer]  # [B, H, C, D]
    exact = lax.Precision.HIGHEST  # no TF32 for float32 on the GPU
    s = jnp.einsum("bhtd,bhcd->bhtc", q, k, preferred_element_type=jnp.float32, precision=exact) / math.sqrt(D)
    delta = q_pos[:, None, :, None] - positions[:, None, None, :]
    visible = (positions[:, None, None, :] >= 0) & (delta >= 0) & (delta < context)
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhtc,bhcd->bhtd", p, v.astype(jnp.float32), precision=exact)
    seen = total != 0
    return jnp.where(seen, out / jnp.where(seen, total, 1.0), 0.0).astype(q.dtype)
