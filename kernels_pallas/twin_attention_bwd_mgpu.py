"""The twin attention's backward on Pallas's Mosaic GPU backend; its Triton-backend twin is
`twin_attention.attention_bwd`, its Triton twin `kernels_triton.twin_attention`'s.

Contract: `twin_attention`'s derivative, unchanged (that module's docstring), written with the same
function (`twin_attention._bwd_block`): the lane form, two kernels.

- `_q_kernel`, a program a query: passes A, B and C over the blocks of BC slots in order.
- `_kv_kernel`, a program a block of BC slots of (b, h): the queries in order.

A block is a tile of 64 rows in the wgmma layout, a slot a row and a head dim a column (a block of
fewer slots, the depformer's 16, fills the first rows: the rest are masked, and every sum over the
slots adds -0.0 for them, which leaves any sum as it is). Sums over D (the scores, dp) and over the
slots (L, G, dq) cross threads: `twin_norm_mgpu.lanes_tree` along one axis or the other. The slots are
read from global memory in registers; the layer's k and v, and the positions, are padded to whole
tiles first (a copy, by XLA; the padded slots are invisible). Head dims of a multiple of 64.

Interpreted (CPU), in Mosaic GPU's interpreter (jax >= 0.11): the same operations in the same order,
so the bits are the reference's (`twin_attention.attention_bwd_native`) on any input.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import twin_math as tm
from kernels_pallas.contract.attention import AttentionBlocks, check_twin_attention
from kernels_pallas.contract.linear import check_mosaic_interpreter
from kernels_pallas.twin_attention import _bwd_block, _plus_zero, _safe, _visible, attention_bwd_native
from kernels_pallas.twin_linear_mgpu import smem_tiles
from kernels_pallas.twin_norm_mgpu import lanes_tree

__all__ = ["attention_bwd", "attention_bwd_native"]

R = 64  # a tile's rows: the slots of a block (its BC, up to 64)
WGMMA = plgpu.Layout.WGMMA
ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)  # a vector along a [64, n] array's rows / columns
NEG_INF = float("-inf")


def attention_bwd(d_out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                  q_pos: jax.Array, *, context: int, interpret: bool | None = None):
    """`twin_attention.attention_bwd` (the same arguments, results and bits): (dq [B, H, T, D] in q's
    dtype, dk, dv [B, H, C, D] in the ring's dtype); D a multiple of 64."""
    B, H, T, D, C = check_twin_attention(q, k[None], v[None], positions, q_pos)
    if tuple(d_out.shape) != (B, T, H, D) or d_out.dtype != q.dtype:
        raise ValueError(f"attention_bwd(d_out): expected [{B}, {T}, {H}, {D}] in {q.dtype}, "
                         f"got {d_out.dtype}{list(d_out.shape)}")
    if D % 64:
        raise ValueError(f"attention_bwd(q): the Mosaic GPU kernels take head dims of a multiple of 64, got {D}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    check_mosaic_interpreter("attention_bwd", interpret, jax.__version_info__)
    BC = AttentionBlocks.for_shapes(C).block_slots
    blocks = -(-C // BC)
    Cp = blocks * R  # BC < 64 only for one block (a ring of at most 32 slots): its tile's first BC rows
    slots = [jnp.pad(r.reshape(B * H, C, D), ((0, 0), (0, Cp - C), (0, 0))) for r in (k, v)]
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, Cp - C)), constant_values=-1)
    statics = {"H": H, "T": T, "C": C, "BC": BC, "blocks": blocks, "context": context, "scale": 1.0 / math.sqrt(D),
               "gpu": False if interpret else tm.Mosaic(WGMMA, vector=ROWS)}
    run = plgpu.InterpretGPUParams() if interpret else None
    ints = (pos, q_pos.astype(jnp.int32))
    stat = jax.ShapeDtypeStruct((B * H * T,), tm.F32)
    dq, *stats = plgpu.kernel(
        functools.partial(_q_kernel, **statics),
        out_type=(jax.ShapeDtypeStruct((B * H * T, D), q.dtype), stat, stat, stat), grid=(B * H * T,),
        grid_names=("q",), interpret=run, kernel_name="twin_attention_bwd_q_mgpu",
    )(q.reshape(B * H * T, D), *slots, *ints, d_out)
    padded = jax.ShapeDtypeStruct((B * H, Cp, D), k.dtype)
    dk, dv = plgpu.kernel(
        functools.partial(_kv_kernel, **statics), out_type=(padded, padded), grid=(B * H * blocks,),
        grid_names=("block",), interpret=run, kernel_name="twin_attention_bwd_kv_mgpu",
    )(q.reshape(B * H * T, D), *slots, *ints, d_out, *stats)
    return dq.reshape(B, H, T, D), dk[:, :C].reshape(B, H, C, D), dv[:, :C].reshape(B, H, C, D)


def _tile(k_gmem, v_gmem, pos_gmem, row, b, j, q_pos, BC, C, context):
    """Block j's tile of (b, h) = row: k, v [64, D] float32, and which slots a query at q_pos sees [64]."""
    at = pl.ds(j * R, R)
    k = plgpu.load(k_gmem.at[row, at], layout=WGMMA, optimized=False).astype(tm.F32)
    v = plgpu.load(v_gmem.at[row, at], layout=WGMMA, optimized=False).astype(tm.F32)
    r = lax.broadcasted_iota(jnp.int32, (R,), 0)
    ok = (r < BC) & (j * BC + r < C)
    pos = plgpu.load(pos_gmem.at[b, at], layout=ROWS, optimized=False)
    return k, v, _visible(pos, q_pos, ok, context)


def _vector(ref):
    """A [D] row of q or dO, float32, in the wgmma layout's column order."""
    return plgpu.load(ref, layout=COLS, optimized=False).astype(tm.F32)


def _in_block(x, BC):
    """x [64, n] with the rows past the block's BC slots -0.0: the sums over the slots add nothing for them."""
    if BC == R:
        return x
    inside = lax.broadcasted_iota(jnp.int32, (R,), 0) < BC
    return jnp.where(jnp.broadcast_to(inside[:, None], x.shape), x, tm.F32(-0.0))


def _q_kernel(q_gmem, k_gmem, v_gmem, pos_gmem, qpos_gmem, do_gmem, dq_gmem, m_gmem, l_gmem, delta_gmem, *,
              H, T, C, BC, blocks, context, scale, gpu):
    """Program bht = (b*H + h)*T + t: passes A, B, C (`twin_attention`'s docstring)."""
    tm.overlap_launches(gpu)
    bht = lax.axis_index("q")
    b, h, t, row = bht // (H * T), (bht // T) % H, bht % T, bht // T
    q_pos = qpos_gmem[b, t]
    D = q_gmem.shape[1]

    def scoped(wide, narrow, column, out_smem):
        q, dO = _vector(q_gmem.at[bht]), _vector(do_gmem.at[b, t, h])
        tree = (lambda x: jnp.max(lanes_tree(x, narrow), axis=1))  # each row's sum over D (lanes equal)

        def slots_sum(x):  # the sum over the block's slots of [64] -> a scalar
            y = lanes_tree(_in_block(jnp.broadcast_to(x[:, None], (R, 8)), BC), column, axis=0)
            return jnp.max(jnp.max(y, axis=1))

        def block(j, stats):
            return _bwd_block(q, dO, *_tile(k_gmem, v_gmem, pos_gmem, row, b, j, q_pos, BC, C, context), stats,
                              scale, gpu, tree)

        m0 = _safe(lax.fori_loop(0, blocks, lambda j, m: jnp.maximum(m, jnp.max(block(j, None)[0])),
                                 tm.F32(NEG_INF)))

        def pass_b(j, carry):
            l, g = carry
            _, p, dp, _, _ = block(j, (m0, None, None))
            return l + p, g + tm.mul(p, dp, gpu)

        zeros = jnp.zeros((R,), tm.F32)
        l, g = lax.fori_loop(0, blocks, pass_b, (zeros, zeros))
        L = slots_sum(l)
        l0 = jnp.where(L == 0, tm.F32(1.0), L)
        # delta = G / L0: one rounded division (as a vector: inline PTX takes no scalar)
        delta = jnp.max(tm.div(jnp.broadcast_to(slots_sum(g), (R,)), jnp.broadcast_to(l0, (R,)), gpu))

        def pass_c(j, dq):
            k, v, visible = _tile(k_gmem, v_gmem, pos_gmem, row, b, j, q_pos, BC, C, context)
            ds = _bwd_block(q, dO, k, v, visible, (m0, l0, delta), scale, gpu, tree)[4]
            terms = tm.mul(jnp.broadcast_to(ds[:, None], (R, D)),
                           jnp.where(jnp.broadcast_to(visible[:, None], (R, D)), k, tm.F32(0.0)), gpu)
            return dq + jnp.max(lanes_tree(_in_block(terms, BC), wide, axis=0), axis=0)  # the rows equal

        dq = lax.fori_loop(0, blocks, pass_c, jnp.zeros((D,), tm.F32))
        out_smem[...] = tm.to_dtype(_plus_zero(dq), dq_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, dq_gmem.at[bht])
        for ref, x in ((m_gmem, m0), (l_gmem, l0), (delta_gmem, delta)):
            ref[bht] = x
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((2 * R, D), tm.F32), plgpu.SMEM((R, 16), tm.F32), plgpu.SMEM((2 * R, 8), tm.F32),
                  plgpu.SMEM((D,), dq_gmem.dtype))


def _kv_kernel(q_gmem, k_gmem, v_gmem, pos_gmem, qpos_gmem, do_gmem, m_gmem, l_gmem, delta_gmem, dk_gmem, dv_gmem, *,
               H, T, C, BC, blocks, context, scale, gpu):
    """Program (b*H + h)*blocks + j: block j of (b, h), the queries t in order; dk, dv out as whole tiles."""
    tm.overlap_launches(gpu)
    row, j = lax.axis_index("block") // blocks, lax.axis_index("block") % blocks
    b, h = row // H, row % H
    D = q_gmem.shape[1]

    def scoped(narrow, dk_smem, dv_smem):
        tree = (lambda x: jnp.max(lanes_tree(x, narrow), axis=1))

        def query(t, carry):
            dk, dv = carry
            bht = row * T + t
            k, v, visible = _tile(k_gmem, v_gmem, pos_gmem, row, b, j, qpos_gmem[b, t], BC, C, context)
            q, dO = _vector(q_gmem.at[bht]), _vector(do_gmem.at[b, t, h])
            stats = (m_gmem[bht], l_gmem[bht], delta_gmem[bht])
            _, _, _, P, ds = _bwd_block(q, dO, k, v, visible, stats, scale, gpu, tree)

            def outer(a, x):  # a [64] times x [D]: [64, D]
                return tm.mul(jnp.broadcast_to(a[:, None], (R, D)), jnp.broadcast_to(x[None, :], (R, D)), gpu)

            return dk + outer(ds, q), dv + outer(P, dO)

        zeros = jnp.zeros((R, D), tm.F32)
        dk, dv = lax.fori_loop(0, T, query, (zeros, zeros))
        dk_smem[...] = tm.to_dtype(_plus_zero(dk), dk_gmem.dtype)
        dv_smem[...] = tm.to_dtype(_plus_zero(dv), dv_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dk_smem, dk_gmem.at[row, pl.ds(j * R, R)])
        plgpu.copy_smem_to_gmem(dv_smem, dv_gmem.at[row, pl.ds(j * R, R)])
        plgpu.wait_smem_to_gmem(0)

    tile = plgpu.SMEM((R, D), dk_gmem.dtype, transforms=smem_tiles(dk_gmem.dtype))
    pl.run_scoped(scoped, plgpu.SMEM((R, 16), tm.F32), tile, tile)
