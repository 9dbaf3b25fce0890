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
    check_mosaic_linear,
    check_twin_linear,
    check_twin_qkv,
    stack_one_layer,
)
from kernels_pallas.contract.norm import TwinNorm
from kernels_pallas.twin_linear import _epilogue, linear_native, linear_rope_write_native

__all__ = ["linear", "linear_native", "linear_rope_write", "linear_rope_write_native"]  # the plain reference is the Triton-backend module's

_SWIZZLE = 128  # bytes: a 64-element row of 16-bit values, the widest swizzle wgmma reads


def linear(x: jax.Array, w: jax.Array, layer=None, *, act: str | None = None, scale: jax.Array | None = None,
           residual: jax.Array | None = None, norm: TwinNorm | None = None, block_n: int | None = None,
           stages: int = MOSAIC_STAGES, interpret: bool | None = None) -> jax.Array:
    """y = epilogue(norm(x) @ w[layer].T) in `twin_linear.linear`'s MMA form (module docstring).

    x: [M, K] bfloat16/float16; w: [L, N, K] (layer: int or int32 scalar, may be traced) or [N, K]
    (layer=None), in x's dtype; scale: [L, N_out] or [N_out]; residual: [M, N_out]; norm: a
    `TwinNorm`, run by its own kernel first (`twin_norm_mgpu.norm`: the bits of the fused norm; K
    a multiple of 128). N_out = N/2 for act="silu_gate", else N; K a multiple of `MOSAIC_BK`.
    Returns [M, N_out] in x's dtype.
    block_n: output columns a program (64 or 128, dividing N_out; None: 64); stages: the depth of
    the pipeline over K (>= 2). These change the speed, never the bits.
    interpret: None runs compiled on a GPU backend, interpreted elsewhere (jax >= 0.11).
    """
    w, scale, norm, layer = stack_one_layer(w, scale, norm, layer)
    M, K, _, N_out = check_twin_linear(x, w, act, scale, residual, norm)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    BN = check_mosaic_linear(x.dtype, K, N_out, block_n, stages, interpret, jax.__version_info__)
    if norm is not None:
        x = twin_norm_mgpu.norm(x, norm.weight, norm.bias, layer, kind=norm.kind, eps=norm.eps,
                                interpret=interpret)
    Mp = M if M <= 8 else -(-M // 8) * 8  # TMA tiles rows by 8 (module docstring)
    pad = ((0, Mp - M), (0, 0))
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(x, pad), w]
    operands += [t for t in (scale, None if residual is None else jnp.pad(residual, pad)) if t is not None]
    kernel = functools.partial(_kernel, K=K, BN=BN, N_out=N_out, act=act, has_scale=scale is not None,
                               has_res=residual is not None, stages=stages,
                               gpu=False if interpret else tm.Mosaic(plgpu.Layout.WGMMA))
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((Mp, N_out), x.dtype),
                        grid=(-(-Mp // MOSAIC_ROWS), N_out // BN), grid_names=("m", "n"),
                        interpret=plgpu.InterpretGPUParams() if interpret else None,
                        kernel_name="twin_linear_mgpu")
    y = call(*operands)
    return y if Mp == M else y[:M]


def _kernel(layer_gmem, x_gmem, w_gmem, *refs, K, BN, N_out, act, has_scale, has_res, stages, gpu):
    """Program (i, j): rows i*64.., columns j*BN.. (refs: scale, residual where given, then the output).

    silu_gate computes columns n and n + N_out together, one accumulator each. The residual tile
    is loaded (TMA) while the loop over K runs; the output tile leaves through shared memory (TMA)."""
    refs = list(refs)
    scale_gmem = refs.pop(0) if has_scale else None
    res_gmem = refs.pop(0) if has_res else None
    (o_gmem,) = refs
    dtype = o_gmem.dtype
    i, j = lax.axis_index("m"), lax.axis_index("n")
    layer = layer_gmem[0]
    rows, cols = pl.ds(i * MOSAIC_ROWS, MOSAIC_ROWS), pl.ds(j * BN, BN)
    col_blocks = (j, j + N_out // BN) if act == "silu_gate" else (j,)
    tiles = (plgpu.TilingTransform((8, _SWIZZLE // jnp.dtype(dtype).itemsize)),
             plgpu.SwizzleTransform(_SWIZZLE))

    def with_smem(o_smem, r_smem, r_bar):
        if has_res:
            plgpu.copy_gmem_to_smem(res_gmem.at[rows, cols], r_smem, r_bar)

        def with_accs(*accs):
            def step(_, x_smem, *w_smems):
                for acc, w_smem in zip(accs, w_smems):
                    plgpu.wgmma(acc, x_smem, w_smem.T)
                plgpu.wgmma_wait(len(accs))  # the step before is done: its buffers may be refilled

            w_specs = [plgpu.BlockSpec((None, BN, MOSAIC_BK), functools.partial(lambda c, k: (layer, c, k), c),
                                       transforms=tiles, delay_release=1)
                       for c in col_blocks]
            plgpu.emit_pipeline(
                step, grid=(K // MOSAIC_BK,), max_concurrent_steps=stages,
                in_specs=[plgpu.BlockSpec((MOSAIC_ROWS, MOSAIC_BK), lambda k: (i, k), transforms=tiles,
                                          delay_release=1), *w_specs],
            )(x_gmem, *[w_gmem] * len(col_blocks))
            plgpu.wgmma_wait(0)
            sums = tuple(a[...] for a in accs)
            scale = None
            if has_scale:
                s = plgpu.load(scale_gmem.at[layer, cols], layout=plgpu.Layout.WGMMA.reduce(0),
                               optimized=False)
                scale = jnp.broadcast_to(s[None, :], (MOSAIC_ROWS, BN))
            residual = None
            if has_res:
                plgpu.barrier_wait(r_bar)
                residual = r_smem[...]
            o_smem[...] = _epilogue(sums if act == "silu_gate" else sums[0], dtype, act, scale, residual, gpu)

        # registers (the accumulators) are scoped apart from shared memory
        pl.run_scoped(with_accs, *[plgpu.ACC((MOSAIC_ROWS, BN), jnp.float32)] * len(col_blocks))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
        plgpu.wait_smem_to_gmem(0)

    tile = plgpu.SMEM((MOSAIC_ROWS, BN), dtype, transforms=tiles)
    pl.run_scoped(with_smem, tile, tile, plgpu.Barrier(num_arrivals=1))


def linear_rope_write(x: jax.Array, w: jax.Array, layer, cos: jax.Array | None, sin: jax.Array | None,
                      ring_k: jax.Array, ring_v: jax.Array, write_index: jax.Array, write_mask: jax.Array, *,
                      norm: TwinNorm | None = None, ring_layer=None, block_n: int | None = None,
                      stages: int = MOSAIC_STAGES, interpret: bool | None = None):
    """`twin_linear.linear_rope_write` in the MMA form (module docstring): the bits of
    `linear(x, w, layer, norm=norm)` reshaped to [B, T, 3, H, D], then `twin_rope.rope_write`.

    x: [B*T, K] (16-bit); w: [L, 3*H*D, K] (layer may be traced); cos, sin: float32 [B, T, D/2], or
    both None (no rotation); ring_k, ring_v: [L, B, H, C, D] in x's dtype; write_index, write_mask:
    [B, T]; ring_layer: the rings' layer where it is not `layer`. Returns (q [B, H, T, D], ring_k,
    ring_v): the rings updated in place (mutable refs aliased to the kernel's outputs; donate them
    to the jitted step, as the step donates its state). The split RMSNorm's consumer (`rms`) is not
    on this backend yet.

    A program's columns are BN/2 GPT-J pairs of one head of q, k or v: its two accumulators hold
    the pairs' first and second columns (the weight rows 2j and 2j+1, loaded by TMA from w viewed
    as [L, N/2, 2, K]), so the rotation is elementwise; each rotated pair is packed back into one
    32-bit word, and every row of the tile is stored (TMA) to its own place: q's row (b*H + h)*T + t,
    or the ring slot write_index[b, t] where write_mask[b, t].
    """
    B, T, H, D, M, K, N = check_twin_qkv(x, w, norm, cos, sin, ring_k, ring_v, write_index, write_mask)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    BN = check_mosaic_linear(x.dtype, K, N, block_n, stages, interpret, jax.__version_info__)
    if D % BN:
        raise ValueError(f"linear_rope_write(block_n): a program's columns lie in one head: BN={BN} must divide "
                         f"the head dim {D}")
    if norm is not None:
        x = twin_norm_mgpu.norm(x, norm.weight, norm.bias, layer, kind=norm.kind, eps=norm.eps,
                                interpret=interpret)
    Mp = M if M <= 8 else -(-M // 8) * 8  # TMA tiles rows by 8 (module docstring)
    L, C = ring_k.shape[0], ring_k.shape[3]
    rope = cos is not None

    def words(a, *lead):  # a 16-bit array [..., D'] as 32-bit words [*lead, D'/2]: the pairs packed
        return lax.bitcast_convert_type(a.reshape(*lead, a.shape[-1] // 2, 2), jnp.uint32)

    layers = jnp.stack([jnp.asarray(i, jnp.int32) for i in (layer, layer if ring_layer is None else ring_layer)])
    tables = [jnp.pad(t.reshape(M, D // 2), ((0, Mp - M), (0, 0))) for t in (cos, sin)] if rope else []
    rings = [jax.new_ref(words(r, L * B * H, C)) for r in (ring_k, ring_v)]
    kernel = functools.partial(_qkv_kernel, M=M, K=K, BN=BN, T=T, H=H, B=B, D=D, rope=rope, stages=stages,
                               gpu=False if interpret else tm.Mosaic(plgpu.Layout.WGMMA))
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((B * H * T, D // 2), jnp.uint32),
                        grid=(-(-Mp // MOSAIC_ROWS), N // BN), grid_names=("m", "n"),
                        interpret=plgpu.InterpretGPUParams() if interpret else None,
                        kernel_name="twin_qkv_rope_write_mgpu")
    q = call(layers, jnp.pad(x, ((0, Mp - M), (0, 0))), w.reshape(w.shape[0], N // 2, 2, K), *tables,
             write_index.astype(jnp.int32).reshape(M), write_mask.astype(jnp.int32).reshape(M), *rings)

    def values(a, shape):  # 32-bit words back to x's dtype
        return lax.bitcast_convert_type(a, x.dtype).reshape(shape)

    return (values(q, (B, H, T, D)), values(rings[0][...], ring_k.shape), values(rings[1][...], ring_v.shape))


def _qkv_kernel(layers_gmem, x_gmem, w_gmem, *refs, M, K, BN, T, H, B, D, rope, stages, gpu):
    """Program (i, j): rows i*64.., the pairs j*BN/2.. of qkv (`linear_rope_write`). refs: cos and sin
    [M', D/2] (rope), the slots and the write mask [M], the rings [L*B*H, C, D/2] as 32-bit words (mutable,
    written in place), then q [B*H*T, D/2] in words."""
    refs = list(refs)
    cos_gmem, sin_gmem = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    slot_gmem, wmask_gmem, ring_k, ring_v, q_gmem = refs
    dtype = x_gmem.dtype
    i, j = lax.axis_index("m"), lax.axis_index("n")
    layer, ring_layer = layers_gmem[0], layers_gmem[1]
    n0, P = j * BN, BN // 2
    part, h, d0 = n0 // (H * D), (n0 // D) % H, n0 % D
    rows = pl.ds(i * MOSAIC_ROWS, MOSAIC_ROWS)
    tiles = (plgpu.TilingTransform((8, _SWIZZLE // jnp.dtype(dtype).itemsize)),
             plgpu.SwizzleTransform(_SWIZZLE))

    def with_smem(o_smem, cos_smem, sin_smem, bars):
        if rope:
            for k, (src, dst) in enumerate(((cos_gmem, cos_smem), (sin_gmem, sin_smem))):
                plgpu.copy_gmem_to_smem(src.at[rows, pl.ds(pl.multiple_of(d0 // 2, P), P)], dst, bars.at[k])

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
            r, im = (tm.to_dtype(a[...], dtype) for a in (acc_r, acc_i))  # the bits of `linear`
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

    table = plgpu.SMEM((MOSAIC_ROWS, P), tm.F32, transforms=(plgpu.TilingTransform((8, _SWIZZLE // 4)),
                                                             plgpu.SwizzleTransform(_SWIZZLE)))
    # the packed tile as [rows, 1, P]: each row a 2-D slab, which TMA stores alone
    pl.run_scoped(with_smem, plgpu.SMEM((MOSAIC_ROWS, 1, P), jnp.uint32), table, table,
                  plgpu.Barrier(num_arrivals=1, num_barriers=2))


def _store_when(cond, src, dst):
    """The TMA store src (shared memory) -> dst (global) where cond holds."""
    @pl.when(cond)
    def _():
        plgpu.copy_smem_to_gmem(src, dst)
