"""The twin attention's MMA form on Pallas's Mosaic GPU backend; its Triton-backend twin is
`twin_attention.attention`, its Triton twin `kernels_triton.twin_attention`.

Contract: `twin_attention`'s MMA form, unchanged (that module's docstring): per block of BC slots,
s = dot(k, q)^T * scale on the tensor cores, the online softmax with a sum per lane, acc = acc * a +
dot(p_hi, v') + dot(p_lo, v') (each product from zero, each add rounded on its own); per split, the
lanes' tree; then the combine of the S splits in order. Two launches: the splits write their partials
(`_split_kernel`), a second kernel combines them (`_combine_kernel`; the Triton-backend kernel combines
in the query's last split program, counted on `sems`: the same arithmetic in the same order).

A split program holds one query. Hopper's wgmma multiplies at least 64 rows of its A operand, so the
block's 64 slots are A and the query is B, repeated in 16 columns (wgmma's N): s^T = k q^T [64 slots,
16], its columns equal (the Triton kernel's 16 rows of the query, transposed). The slots' probabilities
then go to shared memory as a row, repeated in 16 rows, and the product with v runs as v^T p^T ([D, 16],
v^T the A operand, transposed in shared memory, D/64 products of 64 rows). A block is always 64 slots:
a ring of fewer (the depformer's 16, one block) is read past its end as zeros by TMA, lanes that add 0
to the tree (the same bits as its 16 lanes: l >= 0). The lanes' tree crosses threads: through shared
memory, a rotated window of the rows (`twin_norm_mgpu.lanes_tree` along axis 0).

The ring's blocks reach the tensor cores' tiles in one of two ways. TMA writes a 16-bit tile of 8
rows, swizzled, straight into wgmma's shared-memory layout, but only from rows that start at a
multiple of 8 of a tensor of a multiple of 8 rows: rings of a multiple of 8 slots (the temporal
stack's 3000, the depformer's 16) are read so, as rows [L*B*H*C, D]. Other rings (Mimi's 250) are
read as [L*B*H, C, 1, D], a slot to a 2-D slab that TMA takes at any offset, and copied through the
registers into the tiled buffers (`staged`): one more pass over shared memory for k (v passes through
the registers either way, to be masked).

Interpreted (CPU), in Mosaic GPU's interpreter (jax >= 0.11): numpy's products in place of the tensor
cores', so the bits are the contract's where the products' sums are exact.
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
from kernels_pallas.contract.attention import (
    AttentionBlocks,
    check_twin_attention,
    check_twin_sems,
    twin_sems_size,
)
from kernels_pallas.contract.linear import check_mosaic_interpreter, mosaic_padded_rows
from kernels_pallas.contract.numerics import TWIN_MMA_ROWS, sixteen_bit
from kernels_pallas.twin_attention import attention_native
from kernels_pallas.twin_linear_mgpu import smem_tiles
from kernels_pallas.twin_norm_mgpu import lanes_tree

__all__ = ["attention", "attention_native"]  # the plain reference: the Triton-backend module's

BC = 64  # slots a block: wgmma's M, the A operand of the scores
POSITION_ALIGN = 4  # int32 positions a row is padded to a multiple of: 16 bytes (below)
NEG_INF = float("-inf")
WGMMA = plgpu.Layout.WGMMA
ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)  # a vector along a [64, n] array's rows / columns


def attention(q: jax.Array, ring_k: jax.Array, ring_v: jax.Array, layer, positions: jax.Array,
              q_pos: jax.Array, *, context: int, sems: jax.Array | None = None, interpret: bool | None = None):
    """`twin_attention.attention` in the MMA form (module docstring): q [B, H, T, D] (16-bit, D a multiple of
    64); ring_k, ring_v [L, B, H, C, D] in q's dtype at `layer` (may be traced);
    positions int [B, C] (-1: invisible); q_pos int [B, T]. Returns [B, T, H, D] in q's dtype, and sems
    if given (as given: this backend combines in a kernel of its own and counts nothing)."""
    B, H, T, D, C = check_twin_attention(q, ring_k, ring_v, positions, q_pos)
    given = sems is not None
    sems = check_twin_sems(sems, twin_sems_size(B, H, T), "attention", lambda n: jnp.zeros((n,), jnp.int32))
    if not sixteen_bit(q.dtype) or D % 64:
        raise ValueError(f"attention(q): the Mosaic GPU attention (the MMA form) takes bfloat16/float16 and a head "
                         f"dim that is a multiple of 64, got {q.dtype} and D={D}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    check_mosaic_interpreter("attention", interpret, jax.__version_info__)
    plan = AttentionBlocks.for_shapes(C)
    chunk, S = max(plan.chunk, BC), plan.splits
    Sp = mosaic_padded_rows(S)  # the partials' rows, as TMA reads them (the rows past S unread)
    gpu = False if interpret else tm.Mosaic(WGMMA)
    run = plgpu.InterpretGPUParams() if interpret else None
    queries = B * H * T
    staged = C % 8 != 0  # (module docstring)
    # each row's positions padded with -1 (unread: the slots past C are masked) to whole 16 bytes: a block's
    # positions are one contiguous copy, which Mosaic GPU makes a bulk copy, and a bulk copy's global
    # address must be a multiple of 16 bytes (Mimi's 250 slots would start row b at b * 1000 bytes)
    Cp = -(-C // POSITION_ALIGN) * POSITION_ALIGN
    split = plgpu.kernel(
        functools.partial(_split_kernel, B=B, H=H, T=T, C=C, Cp=Cp, D=D, context=context, chunk=chunk,
                          scale=1.0 / math.sqrt(D), staged=staged, gpu=gpu),
        out_type=(jax.ShapeDtypeStruct((queries, Sp, D), tm.F32), jax.ShapeDtypeStruct((queries, S), tm.F32),
                  jax.ShapeDtypeStruct((queries, S), tm.F32)),
        grid=(queries, S), grid_names=("q", "s"), interpret=run, kernel_name="twin_attention_mgpu")
    # the rings as rows of slots [L*B*H*C, D] (staged: [L*B*H, C, 1, D]) and the positions flat [B*Cp] (a block
    # read past a ring row's end reads the next row's slots: masked, as past the ring's end)
    rows = (lambda r: r.reshape(-1, C, 1, D)) if staged else (lambda r: r.reshape(-1, D))
    acc, m, l = split(jnp.asarray(layer, jnp.int32).reshape(1), q.reshape(queries, D), rows(ring_k), rows(ring_v),
                      jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, Cp - C)), constant_values=-1).reshape(-1),
                      q_pos.astype(jnp.int32).reshape(-1))
    combine = plgpu.kernel(
        functools.partial(_combine_kernel, H=H, T=T, S=S, gpu=False if interpret else tm.Mosaic(COLS)),
        out_type=jax.ShapeDtypeStruct((B * T * H, D), q.dtype), grid=(queries,), grid_names=("q",), interpret=run,
        kernel_name="twin_attention_combine_mgpu")
    out = combine(acc, m, l).reshape(B, T, H, D)
    return (out, sems) if given else out


def _split_kernel(layer_gmem, q_gmem, k_gmem, v_gmem, pos_gmem, qpos_gmem, acc_out, m_out, l_out, *, B, H, T, C,
                  Cp, D, context, chunk, scale, staged, gpu):
    """Program (query, split): the split's blocks in order, then its partials (acc [D], m, l)."""
    tm.overlap_launches(gpu)
    bht, split = lax.axis_index("q"), lax.axis_index("s")
    b, t = bht // (H * T), bht % T
    q_pos = qpos_gmem[b * T + t]
    ring_row = layer_gmem[0] * B * H + bht // T
    dtype = q_gmem.dtype
    halves = D // 64  # the products with v: 64 rows of v^T each
    tiles = smem_tiles(dtype)

    def scoped(q_smem, k_buf, v_buf, p_smem, pos_buf, vec_smem, scratch, out_smem, bars, *tiled):
        q = plgpu.load(q_gmem.at[bht], layout=COLS, optimized=False)
        q_smem[...] = jnp.broadcast_to(q[None, :], (BC, D))  # the query in every row: B is its first 16
        plgpu.commit_smem()

        def product(a_ref, b_ref, rows):  # a_ref @ b_ref from a zero accumulator: [rows, 16] float32
            def run(acc):
                plgpu.wgmma(acc, a_ref, b_ref)
                plgpu.wgmma_wait(0)
                return acc[...]
            return pl.run_scoped(run, plgpu.ACC((rows, TWIN_MMA_ROWS), tm.F32))

        m = jnp.float32(NEG_INF)
        l = jnp.zeros((BC, TWIN_MMA_ROWS), tm.F32)
        acc = [jnp.zeros((64, TWIN_MMA_ROWS), tm.F32) for _ in range(halves)]
        blocks = chunk // BC

        def fetch(blk):  # block blk's slots into buffer blk % 2 (TMA; past the ring's end: zeros, masked below)
            c0, buf = split * chunk + blk * BC, blk % 2
            if staged:
                block = (lambda ring: ring.at[ring_row, pl.ds(c0, BC)])  # [BC, 1, D]
            else:  # C % 8 == 0: the block starts at a multiple of 8 rows, as TMA's tiles do
                block = (lambda ring: ring.at[pl.ds(pl.multiple_of(ring_row * C + c0, 8), BC)])
            for k, (src, dst) in enumerate(((block(k_gmem), k_buf.at[buf]), (block(v_gmem), v_buf.at[buf]),
                                            (pos_gmem.at[pl.ds(b * Cp + c0, BC)], pos_buf.at[buf]))):
                plgpu.copy_gmem_to_smem(src, dst, bars.at[3 * buf + k])

        fetch(0)
        for blk in range(blocks):
            if blk + 1 < blocks:  # the next block's loads go out before this block's arithmetic
                fetch(blk + 1)
            c0, buf = split * chunk + blk * BC, blk % 2
            pos_smem = pos_buf.at[buf]
            for k in range(3):
                plgpu.barrier_wait(bars.at[3 * buf + k])
            if staged:  # the block into the tiled buffers, through the registers (v below)
                k_smem, v_smem = tiled
                k_smem[...] = plgpu.load(k_buf.at[buf, :, 0, :], layout=WGMMA, optimized=False)
                plgpu.commit_smem()  # the threads' stores seen by the tensor cores' reads (another proxy)
                v = plgpu.load(v_buf.at[buf, :, 0, :], layout=WGMMA, optimized=False)
            else:
                k_smem, v_smem = k_buf.at[buf], v_buf.at[buf]
                v = plgpu.load(v_smem, layout=WGMMA, optimized=False)
            pos = plgpu.load(pos_smem, layout=ROWS, optimized=False)
            slot = c0 + lax.broadcasted_iota(jnp.int32, (BC,), 0)
            delta = q_pos - pos
            visible = (slot < C) & (pos >= 0) & (delta >= 0) & (delta < context)  # [BC]
            seen = jnp.broadcast_to(visible[:, None], (BC, TWIN_MMA_ROWS))
            s = product(k_smem, q_smem.at[pl.ds(0, TWIN_MMA_ROWS)].T, BC)  # s^T [BC, 16], its columns equal
            s = jnp.where(seen, tm.mul(s, tm.F32(scale), gpu), tm.F32(NEG_INF))
            m_new = jnp.maximum(m, _max_all(s))
            m0 = jnp.where(m_new == NEG_INF, tm.F32(0.0), m_new)
            a = tm.exp(jnp.broadcast_to(m - m0, s.shape), gpu)
            p = jnp.where(seen, tm.exp(s - m0, gpu), tm.F32(0.0))
            l = tm.mul(l, a, gpu) + p
            m = m_new
            # v' = v where visible, else 0: back into shared memory before the products read it
            v_smem[...] = jnp.where(jnp.broadcast_to(visible[:, None], v.shape), v, jnp.zeros((), dtype))
            # p as a row (its columns equal: max is exact), repeated in every row of the B operand
            vec_smem[...] = jnp.max(p, axis=1)
            plgpu.commit_smem()
            row = plgpu.load(vec_smem, layout=COLS, optimized=False)
            p_row = jnp.broadcast_to(row[None, :], (BC, BC))
            p_hi = tm.to_dtype(p_row, dtype)
            p_lo = tm.to_dtype(p_row - p_hi.astype(tm.F32), dtype)
            for i, part in enumerate((p_hi, p_lo)):  # acc = (acc * a + v'^T p_hi^T) + v'^T p_lo^T
                p_smem[...] = part
                plgpu.commit_smem()
                for h in range(halves):
                    d = product(v_smem.at[:, pl.ds(h * 64, 64)].T, p_smem.at[pl.ds(0, TWIN_MMA_ROWS)].T, 64)
                    acc[h] = tm.mma_add(tm.mul(acc[h], a, gpu) if i == 0 else acc[h], d, gpu)
                plgpu.commit_smem()  # the products have read p (and this buffer) before either is written again
        l = lanes_tree(l, scratch, axis=0)  # the lanes' tree over the 64 slots (rows): every element the split's l
        for h in range(halves):  # acc's columns are equal: max is exact
            out_smem[pl.ds(h * 64, 64)] = jnp.max(acc[h], axis=1)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, acc_out.at[bht, split])
        m_out[bht, split] = m
        l_out[bht, split] = _max_all(l)
        plgpu.wait_smem_to_gmem(0)

    # k, v and the positions twice: a block's loads fly while the block before it is computed (staged: as TMA
    # reads them, and the tiled k and v once)
    block = plgpu.SMEM((BC, D), dtype, transforms=tiles)
    ring_bufs = plgpu.SMEM((2, BC, 1, D), dtype) if staged else plgpu.SMEM((2, BC, D), dtype, transforms=tiles)
    pl.run_scoped(scoped, block, ring_bufs, ring_bufs, plgpu.SMEM((BC, BC), dtype, transforms=tiles),
                  plgpu.SMEM((2, BC), jnp.int32), plgpu.SMEM((BC,), tm.F32), plgpu.SMEM((2 * BC, TWIN_MMA_ROWS), tm.F32),
                  plgpu.SMEM((D,), tm.F32), plgpu.Barrier(num_arrivals=1, num_barriers=6), *((block, block) if staged else ()))


def _max_all(x):
    """The max of a [64, n] array (exact in any order), its rows' maxima first: Mosaic GPU lowers a
    reduction over one axis at a time."""
    return jnp.max(jnp.max(x, axis=1))


def _combine_kernel(acc_gmem, m_gmem, l_gmem, o_gmem, *, H, T, S, gpu):
    """Program query: the contract's combine of its S partials, in order (`twin_attention._combine`)."""
    tm.overlap_launches(gpu)
    bht = lax.axis_index("q")
    b, h, t = bht // (H * T), (bht // T) % H, bht % T
    D = acc_gmem.shape[2]

    def scoped(acc_smem, o_smem, bar):
        plgpu.copy_gmem_to_smem(acc_gmem.at[bht], acc_smem, bar)
        m0 = m_gmem[bht, 0]
        for s in range(1, S):
            m0 = jnp.maximum(m0, m_gmem[bht, s])
        m0 = jnp.where(m0 == NEG_INF, tm.F32(0.0), m0)
        plgpu.barrier_wait(bar)
        L, O = jnp.zeros((D,), tm.F32), jnp.zeros((D,), tm.F32)
        for s in range(S):
            w = tm.exp(jnp.broadcast_to(m_gmem[bht, s] - m0, (D,)), gpu)
            L = L + tm.mul(jnp.broadcast_to(l_gmem[bht, s], (D,)), w, gpu)
            O = O + tm.mul(plgpu.load(acc_smem.at[s], layout=COLS, optimized=False), w, gpu)
        seen = L != 0  # L == 0: no slot visible; a NaN L is seen, and propagates
        out = jnp.where(seen, tm.div(O, jnp.where(seen, L, tm.F32(1.0)), gpu), tm.F32(0.0))
        o_smem[...] = tm.to_dtype(out, o_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[(b * T + t) * H + h])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM(acc_gmem.shape[1:], tm.F32), plgpu.SMEM((D,), o_gmem.dtype),
                  plgpu.Barrier(num_arrivals=1))
