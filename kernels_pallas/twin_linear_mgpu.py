"""The twin linear's MMA form on Pallas's Mosaic GPU backend (Hopper: TMA loads, wgmma); its Triton-
backend twin is `twin_linear`'s MMA form, its Triton twin `kernels_triton.twin_linear`.

Contract: `twin_linear`'s MMA form, unchanged (that module's docstring, `contract.linear`). A
program computes the output tile y[64 rows, BN columns]: acc [64, BN] float32 += x_block [64, BK]
@ w_block [BN, BK]^T over the K blocks in increasing order, each block one chain of wgmma
instructions accumulating into acc (the hardware's own order within a block; the H200 gives the
bits of Triton's `tl.dot` at every tile, row count and pipeline depth tried: benchmarks/RESULTS.md,
"twin_tune_gpu"). Then the epilogue of `twin_linear._epilogue` (act, scale, residual), its
roundings one PTX instruction each (`twin_math.Mosaic`).

x is wgmma's A operand, 64 rows a program whatever M: TMA reads the rows past M as zeros and
clips them from the store, so no pad or slice kernel runs around the call (but where M is over 8
and not a multiple of 8, which TMA's row tiling cannot describe: x and the residual are padded to
a multiple of 8 rows, the output sliced). Each weight tile [BN, BK] is the B operand, transposed
in shared memory (w [L, N, K] is read in place at a layer index that may be traced).

Interpreted (CPU), the kernel runs in Mosaic GPU's interpreter, which jax 0.11 brings (0.10's
cannot read a transposed operand): its block products are numpy's float32 matrix products, not
the tensor cores', so its bits are the contract's only where every partial sum is exact.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import twin_math as tm
from kernels_pallas import twin_norm_mgpu, twin_rope
from kernels_pallas.contract.linear import (
    MOSAIC_BK,
    MOSAIC_ROWS,
    MOSAIC_STAGES,
    MOSAIC_TREE_LANES,
    check_mosaic_linear,
    check_twin_linear,
    check_twin_qkv,
    mosaic_padded_rows,
    stack_one_layer,
)
from kernels_pallas.contract.norm import (
    TWIN_SPLIT_GROUP,
    TwinNorm,
    TwinRms,
    TwinSplit,
    check_twin_split,
    split_one_layer,
)
from kernels_pallas.twin_linear import _epilogue, linear_native, linear_rope_write_native

__all__ = ["linear", "linear_native", "linear_rope_write", "linear_rope_write_native"]  # the plain reference is the Triton-backend module's

_SWIZZLE = 128  # bytes: a 64-element row of 16-bit values, the widest swizzle wgmma reads


def smem_tiles(dtype, cols: int | None = None) -> tuple:
    """The shared-memory transforms of a wgmma operand tile (and of what the kernels load in its layout):
    8-row tiles of one swizzled row each, 128 bytes, or a tile of `cols` columns' bytes where fewer
    (32 or 64: a narrow tile's swizzle)."""
    swizzle = _SWIZZLE if cols is None else min(_SWIZZLE, cols * jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def linear(x: jax.Array, w: jax.Array, layer=None, *, act: str | None = None, scale: jax.Array | None = None,
           residual: jax.Array | None = None, norm: TwinNorm | None = None, split: TwinSplit | None = None,
           rms: TwinRms | None = None, block_n: int | None = None, stages: int = MOSAIC_STAGES,
           interpret: bool | None = None):
    """y = epilogue(norm(x) @ w[layer].T) in `twin_linear.linear`'s MMA form (module docstring).

    x: [M, K] bfloat16/float16; w: [L, N, K] (layer: int or int32 scalar, may be traced) or [N, K]
    (layer=None), in x's dtype; scale: [L, N_out] or [N_out]; residual: [M, N_out]; norm: a
    `TwinNorm`, run by its own kernel first (`twin_norm_mgpu.norm`: the bits of the fused norm; K
    a multiple of 128). N_out = N/2 for act="silu_gate", else N; the MMA form's shapes: K with a
    power-of-two factor of at least 16, N_out a multiple of 16 (`contract.linear.mosaic_tiles`).
    Returns [M, N_out] in x's dtype.
    split, rms: the split RMSNorm's halves (`contract.norm.TwinSplit`, as `twin_linear.linear`'s; on this
    backend `twin_norm_mgpu.split_halves` and `split_scale`): with split the call returns (y, u [M, N_out],
    ss float32 [M, N_out / 64]) and runs 64 columns a program; with rms, x is the split norm's u (K / 64 >= 8
    groups).
    block_n: output columns a program (16 to 128, dividing N_out; None: `mosaic_tiles`'); stages: the depth of
    the pipeline over K (>= 2). These change the speed, never the bits.
    interpret: None runs compiled on a GPU backend, interpreted elsewhere (jax >= 0.11).
    """
    w, scale, norm, layer = stack_one_layer(w, scale, norm, layer)
    split = split_one_layer(split)
    M, K, _, N_out = check_twin_linear(x, w, act, scale, residual, norm)
    if rms is not None and not isinstance(rms, TwinRms):
        raise TypeError(f"linear(rms): expected a TwinRms or None, got {type(rms).__name__}")
    check_twin_split(split, rms, norm, M, K, N_out, "mma")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    BK, BN = check_mosaic_linear(x.dtype, K, N_out, block_n, stages, interpret, jax.__version_info__,
                                 split=split is not None, rms=rms is not None)
    if norm is not None:
        x = twin_norm_mgpu.norm(x, norm.weight, norm.bias, layer, kind=norm.kind, eps=norm.eps,
                                interpret=interpret)
    Mp = mosaic_padded_rows(M)
    pad = ((0, Mp - M), (0, 0))
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(x, pad), w]
    operands += [t for t in (None if rms is None else jnp.pad(rms.ss, pad), scale,
                             None if residual is None else jnp.pad(residual, pad),
                             None if split is None else split.weight) if t is not None]
    outs = [jax.ShapeDtypeStruct((Mp, N_out), x.dtype)]
    if split is not None:
        outs += [jax.ShapeDtypeStruct((Mp, N_out), x.dtype), jax.ShapeDtypeStruct((M, N_out // BN), jnp.float32)]
    kernel = functools.partial(_kernel, M=M, K=K, BK=BK, BN=BN, N_out=N_out, act=act, has_scale=scale is not None,
                               has_res=residual is not None, rms=None if rms is None else rms.eps,
                               split=None if split is None else split.offset, stages=stages,
                               gpu=False if interpret else tm.Mosaic(plgpu.Layout.WGMMA))
    call = plgpu.kernel(kernel, out_type=tuple(outs), grid=(-(-Mp // MOSAIC_ROWS), N_out // BN),
                        grid_names=("m", "n"), interpret=plgpu.InterpretGPUParams() if interpret else None,
                        kernel_name="twin_linear_mgpu")
    y, *halves = call(*operands)
    y, halves = (y, halves) if Mp == M else (y[:M], [h[:M] for h in halves])
    return (y, *halves) if split is not None else y


def _kernel(layer_gmem, x_gmem, w_gmem, *refs, M, K, BK, BN, N_out, act, has_scale, has_res, rms, split, stages,
            gpu):
    """Program (i, j): rows i*64.., columns j*BN.. (refs: the split norm's ss (rms), scale, residual and
    alpha (split) where given, then the output, and u and ss (split)).

    silu_gate computes columns n and n + N_out together, one accumulator each. The residual and ss tiles
    are loaded (TMA) while the loop over K runs; the output tiles leave through shared memory (TMA), ss
    (split) a scalar store a row (`twin_norm_mgpu.store_column`)."""
    tm.overlap_launches(gpu)
    refs = list(refs)
    ss_gmem = refs.pop(0) if rms is not None else None
    scale_gmem = refs.pop(0) if has_scale else None
    res_gmem = refs.pop(0) if has_res else None
    alpha_gmem = refs.pop(0) if split is not None else None
    o_gmem, *split_out = refs
    dtype = o_gmem.dtype
    i, j = lax.axis_index("m"), lax.axis_index("n")
    layer = layer_gmem[0]
    rows, cols = pl.ds(i * MOSAIC_ROWS, MOSAIC_ROWS), pl.ds(j * BN, BN)
    col_blocks = (j, j + N_out // BN) if act == "silu_gate" else (j,)
    tiles, out_tiles = smem_tiles(dtype, BK), smem_tiles(dtype, BN)
    wgmma = plgpu.Layout.WGMMA

    def with_smem(o_smem, r_smem, u_smem, ss_smem, scratch, column, bars):
        if has_res:
            plgpu.copy_gmem_to_smem(res_gmem.at[rows, cols], r_smem, bars.at[0])
        if rms is not None:
            plgpu.copy_gmem_to_smem(ss_gmem.at[rows], ss_smem, bars.at[1])

        def with_accs(*accs):
            def step(_, x_smem, *w_smems):
                for acc, w_smem in zip(accs, w_smems):
                    plgpu.wgmma(acc, x_smem, w_smem.T)
                plgpu.wgmma_wait(len(accs))  # the step before is done: its buffers may be refilled

            w_specs = [plgpu.BlockSpec((None, BN, BK), functools.partial(lambda c, k: (layer, c, k), c),
                                       transforms=tiles, delay_release=1)
                       for c in col_blocks]
            plgpu.emit_pipeline(
                step, grid=(K // BK,), max_concurrent_steps=stages,
                in_specs=[plgpu.BlockSpec((MOSAIC_ROWS, BK), lambda k: (i, k), transforms=tiles,
                                          delay_release=1), *w_specs],
            )(x_gmem, *[w_gmem] * len(col_blocks))
            plgpu.wgmma_wait(0)
            sums = tuple(a[...] for a in accs)
            if rms is not None:  # the consumer's half: the sums scaled by the rows' r
                plgpu.barrier_wait(bars.at[1])
                r = twin_norm_mgpu.split_scale(ss_smem, K, rms, gpu, scratch)
                r = jnp.concatenate([r] * (BN // r.shape[1]), axis=1)
                sums = tuple(tm.mul(a, r, gpu) for a in sums)
            scale = None
            if has_scale:
                s = plgpu.load(scale_gmem.at[layer, cols], layout=wgmma.reduce(0), optimized=False)
                scale = jnp.broadcast_to(s[None, :], (MOSAIC_ROWS, BN))
            residual = None
            if has_res:
                plgpu.barrier_wait(bars.at[0])
                residual = r_smem[...]
            y = _epilogue(sums if act == "silu_gate" else sums[0], dtype, act, scale, residual, gpu)
            o_smem[...] = y
            if split is not None:  # the producer's half: u and the rows' partial sums of squares
                split_layer = jnp.minimum(layer + split, alpha_gmem.shape[0] - 1)
                alpha = plgpu.load(alpha_gmem.at[split_layer, cols], layout=wgmma.reduce(0), optimized=False)
                yf = y.astype(tm.F32)
                u, ss = twin_norm_mgpu.split_halves(yf, jnp.broadcast_to(alpha.astype(tm.F32)[None, :], yf.shape),
                                                    dtype, gpu, scratch)
                u_smem[...] = u
                twin_norm_mgpu.store_column(ss, column, split_out[1], i * MOSAIC_ROWS, j, M)

        # registers (the accumulators) are scoped apart from shared memory
        pl.run_scoped(with_accs, *[plgpu.ACC((MOSAIC_ROWS, BN), jnp.float32)] * len(col_blocks))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
        if split is not None:
            plgpu.copy_smem_to_gmem(u_smem, split_out[0].at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    tile = plgpu.SMEM((MOSAIC_ROWS, BN), dtype, transforms=out_tiles)
    groups = K // TWIN_SPLIT_GROUP if rms is not None else MOSAIC_TREE_LANES
    pl.run_scoped(with_smem, tile, tile, tile, plgpu.SMEM((MOSAIC_ROWS, groups), jnp.float32),
                  plgpu.SMEM((MOSAIC_ROWS, 2 * MOSAIC_TREE_LANES), jnp.float32),
                  plgpu.SMEM((MOSAIC_ROWS, MOSAIC_TREE_LANES), jnp.float32), plgpu.Barrier(num_arrivals=1, num_barriers=2))


def linear_rope_write(x: jax.Array, w: jax.Array, layer, cos: jax.Array | None, sin: jax.Array | None,
                      ring_k: jax.Array, ring_v: jax.Array, write_index: jax.Array, write_mask: jax.Array, *,
                      norm: TwinNorm | None = None, rms: TwinRms | None = None, ring_layer=None,
                      block_n: int | None = None, stages: int = MOSAIC_STAGES, interpret: bool | None = None):
    """`twin_linear.linear_rope_write` in the MMA form (module docstring): the bits of
    `linear(x, w, layer, norm=norm)` reshaped to [B, T, 3, H, D], then `twin_rope.rope_write`.

    x: [B*T, K] (16-bit); w: [L, 3*H*D, K] (layer may be traced); cos, sin: float32 [B, T, D/2], or
    both None (no rotation); ring_k, ring_v: [L, B, H, C, D] in x's dtype; write_index, write_mask:
    [B, T]; ring_layer: the rings' layer where it is not `layer`. Returns (q [B, H, T, D], ring_k,
    ring_v): the rings updated in place (mutable refs aliased to the kernel's outputs; donate them
    to the jitted step, as the step donates its state). rms: the split RMSNorm's consumer half (x is
    its u; `linear`'s).

    A program's columns are BN/2 GPT-J pairs of one head of q, k or v: its two accumulators hold
    the pairs' first and second columns (the weight rows 2j and 2j+1, loaded by TMA from w viewed
    as [L, N/2, 2, K]), so the rotation is elementwise; each rotated pair is packed back into one
    32-bit word, and every row of the tile is stored (TMA) to its own place: q's row (b*H + h)*T + t,
    or the ring slot write_index[b, t] where write_mask[b, t].
    """
    B, T, H, D, M, K, N = check_twin_qkv(x, w, norm, cos, sin, ring_k, ring_v, write_index, write_mask,
                                         tm.host_values(write_index), tm.host_values(write_mask))
    if rms is not None and not isinstance(rms, TwinRms):
        raise TypeError(f"linear_rope_write(rms): expected a TwinRms or None, got {type(rms).__name__}")
    check_twin_split(None, rms, norm, M, K, N, "mma", "linear_rope_write")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    BK, BN = check_mosaic_linear(x.dtype, K, N, block_n, stages, interpret, jax.__version_info__, rms=rms is not None)
    if BK != MOSAIC_BK or BN not in (64, 128):
        raise ValueError(f"linear_rope_write(x): the Mosaic GPU qkv kernel runs K blocks of {MOSAIC_BK} and 64 or 128 "
                         f"columns a program: K={K} and block_n={block_n!r} give {BK} and {BN}")
    if D % BN:
        raise ValueError(f"linear_rope_write(block_n): a program's columns lie in one head: BN={BN} must divide "
                         f"the head dim {D}")
    if norm is not None:
        x = twin_norm_mgpu.norm(x, norm.weight, norm.bias, layer, kind=norm.kind, eps=norm.eps,
                                interpret=interpret)
    Mp = mosaic_padded_rows(M)
    L, C = ring_k.shape[0], ring_k.shape[3]
    rope = cos is not None

    def words(a, *lead):  # a 16-bit array [..., D'] as 32-bit words [*lead, D'/2]: the pairs packed
        return lax.bitcast_convert_type(a.reshape(*lead, a.shape[-1] // 2, 2), jnp.uint32)

    layers = jnp.stack([jnp.asarray(i, jnp.int32) for i in (layer, layer if ring_layer is None else ring_layer)])
    tables = [jnp.pad(t.reshape(M, D // 2), ((0, Mp - M), (0, 0))) for t in (cos, sin)] if rope else []
    rings = [jax.new_ref(words(r, L * B * H, C)) for r in (ring_k, ring_v)]
    kernel = functools.partial(_qkv_kernel, M=M, K=K, BN=BN, T=T, H=H, B=B, D=D, rope=rope,
                               rms=None if rms is None else rms.eps, stages=stages,
                               gpu=False if interpret else tm.Mosaic(plgpu.Layout.WGMMA))
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((B * H * T, D // 2), jnp.uint32),
                        grid=(-(-Mp // MOSAIC_ROWS), N // BN), grid_names=("m", "n"),
                        interpret=plgpu.InterpretGPUParams() if interpret else None,
                        kernel_name="twin_qkv_rope_write_mgpu")
    ss = [] if rms is None else [jnp.pad(rms.ss, ((0, Mp - M), (0, 0)))]
    q = call(layers, jnp.pad(x, ((0, Mp - M), (0, 0))), w.reshape(w.shape[0], N // 2, 2, K), *ss, *tables,
             write_index.astype(jnp.int32).reshape(M), write_mask.astype(jnp.int32).reshape(M), *rings)

    def values(a, shape):  # 32-bit words back to x's dtype
        return lax.bitcast_convert_type(a, x.dtype).reshape(shape)

    return (values(q, (B, H, T, D)), values(rings[0][...], ring_k.shape), values(rings[1][...], ring_v.shape))


def _qkv_kernel(layers_gmem, x_gmem, w_gmem, *refs, M, K, BN, T, H, B, D, rope, rms, stages, gpu):
    """Program (i, j): rows i*64.., the pairs j*BN/2.. of qkv (`linear_rope_write`). refs: the split norm's
    ss (rms), cos and sin [M', D/2] (rope), the slots and the write mask [M], the rings [L*B*H, C, D/2] as 32-bit words (mutable,
    written in place), then q [B*H*T, D/2] in words."""
    tm.overlap_launches(gpu)
    refs = list(refs)
    ss_gmem = refs.pop(0) if rms is not None else None
    cos_gmem, sin_gmem = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    slot_gmem, wmask_gmem, ring_k, ring_v, q_gmem = refs
    dtype = x_gmem.dtype
    i, j = lax.axis_index("m"), lax.axis_index("n")
    layer, ring_layer = layers_gmem[0], layers_gmem[1]
    n0, P = j * BN, BN // 2
    part, h, d0 = n0 // (H * D), (n0 // D) % H, n0 % D
    rows = pl.ds(i * MOSAIC_ROWS, MOSAIC_ROWS)
    tiles = smem_tiles(dtype)

    def with_smem(o_smem, cos_smem, sin_smem, ss_smem, scratch, bars):
        if rope:
            for k, (src, dst) in enumerate(((cos_gmem, cos_smem), (sin_gmem, sin_smem))):
                plgpu.copy_gmem_to_smem(src.at[rows, pl.ds(pl.multiple_of(d0 // 2, P), P)], dst, bars.at[k])
        if rms is not None:
            plgpu.copy_gmem_to_smem(ss_gmem.at[rows], ss_smem, bars.at[2])

        def with_accs(acc_r, acc_i):
            def step(_, x_smem, w_first, w_second):
                plgpu.wgmma(acc_r, x_smem, w_first.T)
                plgpu.wgmma(acc_i, x_smem, w_second.T)
                plgpu.wgmma_wait(2)  # the step before is done: its buffers may be refilled

            def w_spec(pair):  # the rows 2p + pair of w's pairs j*P..
                return plgpu.BlockSpec((None, P, None, MOSAIC_BK), lambda k: (layer, j, pair, k), transforms=tiles,
                                       delay_release=1)

            plgpu.emit_pipeline(
                step, grid=(K // MOSAIC_BK,), max_concurrent_steps=stages,
                in_specs=[plgpu.BlockSpec((MOSAIC_ROWS, MOSAIC_BK), lambda k: (i, k), transforms=tiles,
                                          delay_release=1), w_spec(0), w_spec(1)],
            )(x_gmem, w_gmem, w_gmem)
            plgpu.wgmma_wait(0)
            sums = (acc_r[...], acc_i[...])
            if rms is not None:  # the split norm's consumer half: the sums scaled by the rows' r
                plgpu.barrier_wait(bars.at[2])
                scaled = twin_norm_mgpu.split_scale(ss_smem, K, rms, gpu, scratch)
                scaled = jnp.concatenate([scaled] * (P // scaled.shape[1]), axis=1)
                sums = tuple(tm.mul(a, scaled, gpu) for a in sums)
            r, im = (tm.to_dtype(a, dtype) for a in sums)  # the bits of `linear`
            if rope:
                for k in range(2):
                    plgpu.barrier_wait(bars.at[k])
                load = functools.partial(plgpu.load, layout=plgpu.Layout.WGMMA)
                rr, ri = twin_rope.rotate(r.astype(tm.F32), im.astype(tm.F32), load(cos_smem), load(sin_smem),
                                          dtype, gpu)
                rotated = jnp.broadcast_to(part < 2, r.shape)  # v is not rotated
                r, im = jnp.where(rotated, rr, r), jnp.where(rotated, ri, im)
            bits = (lambda a: lax.bitcast_convert_type(a, jnp.uint16).astype(jnp.uint32))
            o_smem[:, 0, :] = bits(r) | (bits(im) << 16)  # the pair (2p, 2p + 1) in one word, little-endian

        pl.run_scoped(with_accs, *[plgpu.ACC((MOSAIC_ROWS, P), jnp.float32)] * 2)
        plgpu.commit_smem()

        @pl.loop(0, MOSAIC_ROWS)
        def _(row):  # each row of the tile to its own place; the rows past M nowhere
            m = i * MOSAIC_ROWS + row
            mc = jnp.minimum(m, M - 1)  # the index loads stay inside the arrays
            b, t = mc // T, mc % T
            cols = pl.ds(d0 // 2, P)
            written = (m < M) & (wmask_gmem[mc] != 0)
            ring_row, slot = (ring_layer * B + b) * H + h, slot_gmem[mc]
            for cond, dst in (((m < M) & (part == 0), q_gmem.at[pl.ds((b * H + h) * T + t, 1), cols]),
                              (written & (part == 1), ring_k.at[ring_row, pl.ds(slot, 1), cols]),
                              (written & (part == 2), ring_v.at[ring_row, pl.ds(slot, 1), cols])):
                _store_when(cond, o_smem.at[row], dst)

        plgpu.wait_smem_to_gmem(0)

    table = plgpu.SMEM((MOSAIC_ROWS, P), tm.F32, transforms=smem_tiles(tm.F32))
    # the packed tile as [rows, 1, P]: each row a 2-D slab, which TMA stores alone
    groups = K // TWIN_SPLIT_GROUP if rms is not None else MOSAIC_TREE_LANES
    pl.run_scoped(with_smem, plgpu.SMEM((MOSAIC_ROWS, 1, P), jnp.uint32), table, table,
                  plgpu.SMEM((MOSAIC_ROWS, groups), jnp.float32), plgpu.SMEM((MOSAIC_ROWS, 2 * MOSAIC_TREE_LANES), jnp.float32),
                  plgpu.Barrier(num_arrivals=1, num_barriers=3))


def _store_when(cond, src, dst):
    """The TMA store src (shared memory) -> dst (global) where cond holds."""
    @pl.when(cond)
    def _():
        plgpu.copy_smem_to_gmem(src, dst)
