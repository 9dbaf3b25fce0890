"""The twin linear's lane form on Pallas's Mosaic GPU backend; its Triton-backend twin is
`twin_linear`'s lane form, its Triton twin `kernels_triton.twin_linear`.

Contract: `twin_linear`'s lane form, unchanged: lane l of output (m, n) adds its products
x[m, kb*BK + l] * w[n, kb*BK + l] over the K blocks in order from +0 (`twin_math.mac`), BK =
`twin_lanes(K)`; then the lanes' halving tree, then the epilogue (`twin_linear._epilogue`). It is the
form of float32 operands and of the shapes the tensor cores do not take (K with no power-of-two factor
of 16, N_out not a multiple of 16: the codec's first and last convolutions).

A program is one row of x and 64 columns of the output, everything read from global memory in
registers (no TMA: the lane form's K may give rows that TMA cannot address, 7 bf16 values):
- BK >= 8: the columns' weight blocks [64, BK] in the wgmma layout, a column a row and a lane a
  column, times the row's block broadcast to every row; the lanes' tree crosses threads
  (`twin_norm_mgpu.lanes_tree`).
- BK < 8 (1, 2 or 4 lanes): a vector of the 64 columns a lane, adding the products of x[m, k] (a
  scalar) and column k of w^T; the lanes' tree adds those vectors.
The 64 columns' sums are then one vector, its epilogue elementwise, stored as a row segment. Weights of
fewer than a multiple of 64 rows are padded (a copy, by XLA) and the output sliced.

Interpreted (CPU), in Mosaic GPU's interpreter (jax >= 0.11): the same operations in the same order, so
the bits are the reference's (`twin_linear.linear_native`, form "lanes") on any input.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import twin_math as tm
from kernels_pallas.contract.linear import check_mosaic_interpreter, check_twin_linear, stack_one_layer
from kernels_pallas.contract.numerics import twin_lanes
from kernels_pallas.twin_linear import _epilogue, linear_native
from kernels_pallas.twin_norm_mgpu import lanes_tree

__all__ = ["linear", "linear_native"]  # the plain reference: the Triton-backend module's

COLUMNS = 64  # output columns a program: the wgmma layout's rows
WGMMA = plgpu.Layout.WGMMA
ROWS, COLS = WGMMA.reduce(1), WGMMA.reduce(0)  # a vector along a [64, n] array's rows / columns


def linear(x: jax.Array, w: jax.Array, layer=None, *, act: str | None = None, scale: jax.Array | None = None,
           residual: jax.Array | None = None, interpret: bool | None = None) -> jax.Array:
    """y = epilogue(x @ w[layer].T) in `twin_linear.linear`'s lane form (module docstring): x [M, K]
    (float32, bfloat16, float16); w [L, N, K] at `layer` (may be traced) or [N, K] (layer=None), in x's
    dtype; scale [L, N_out] or [N_out]; residual [M, N_out]. Returns [M, N_out] in x's dtype."""
    w, scale, _, layer = stack_one_layer(w, scale, None, layer)
    M, K, _, N_out = check_twin_linear(x, w, act, scale, residual, None)
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    check_mosaic_interpreter("linear", interpret, jax.__version_info__)
    halves = 2 if act == "silu_gate" else 1
    Np = -(-N_out // COLUMNS) * COLUMNS
    if Np != N_out:  # each half padded to whole programs of columns (the pad's columns are sliced off)
        w = jnp.pad(w.reshape(w.shape[0], halves, N_out, K), ((0, 0), (0, 0), (0, Np - N_out), (0, 0)))
        w = w.reshape(w.shape[0], halves * Np, K)
        scale = None if scale is None else jnp.pad(scale, ((0, 0), (0, Np - N_out)))
        residual = None if residual is None else jnp.pad(residual, ((0, 0), (0, Np - N_out)))
    BK = twin_lanes(K)
    weights = w if BK >= 8 else jnp.swapaxes(w, 1, 2)  # BK < 8: w^T [L, K, N], a column k a row
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), x, weights]
    operands += [t for t in (scale, residual) if t is not None]
    kernel = functools.partial(_kernel, K=K, BK=BK, Np=Np, act=act, has_scale=scale is not None,
                               has_res=residual is not None, fused=x.dtype in (jnp.bfloat16, jnp.float16),
                               gpu=False if interpret else tm.Mosaic(ROWS),
                               gpu_tile=False if interpret else tm.Mosaic(WGMMA))
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((M, Np), x.dtype), grid=(M, Np // COLUMNS),
                        grid_names=("m", "n"), interpret=plgpu.InterpretGPUParams() if interpret else None,
                        kernel_name="twin_linear_lanes_mgpu")
    y = call(*operands)
    return y if Np == N_out else y[:, :N_out]


def _kernel(layer_gmem, x_gmem, w_gmem, *refs, K, BK, Np, act, has_scale, has_res, fused, gpu, gpu_tile):
    """Program (m, j): y[m, j*64 .. j*64 + 64] (module docstring)."""
    tm.overlap_launches(gpu)
    refs = list(refs)
    scale_gmem = refs.pop(0) if has_scale else None
    res_gmem = refs.pop(0) if has_res else None
    (o_gmem,) = refs
    m, j = lax.axis_index("m"), lax.axis_index("n")
    layer = layer_gmem[0]
    cols = pl.ds(j * COLUMNS, COLUMNS)
    starts = (j * COLUMNS, j * COLUMNS + Np) if act == "silu_gate" else (j * COLUMNS,)

    def scoped(scratch, out_smem):
        if BK >= 8:
            sums = [_tile_sums(x_gmem, w_gmem, layer, m, s, K, BK, fused, gpu_tile, scratch) for s in starts]
        else:
            sums = [_vector_sums(x_gmem, w_gmem, layer, m, s, K, BK, fused, gpu) for s in starts]
        scale = plgpu.load(scale_gmem.at[layer, cols], layout=ROWS, optimized=False) if has_scale else None
        residual = plgpu.load(res_gmem.at[m, cols], layout=ROWS, optimized=False) if has_res else None
        out_smem[...] = _epilogue(sums if act == "silu_gate" else sums[0], o_gmem.dtype, act, scale, residual, gpu)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_gmem.at[m, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((COLUMNS, 16), tm.F32), plgpu.SMEM((COLUMNS,), o_gmem.dtype))


def _tile_sums(x_gmem, w_gmem, layer, m, start, K, BK, fused, gpu, scratch):
    """The sums [64] of columns start.. of row m, BK >= 8 lanes: the blocks [64 columns, BK lanes] of
    x[m] * w in order from +0, then the lanes' tree."""
    acc = jnp.zeros((COLUMNS, BK), tm.F32)
    for kb in range(K // BK):
        xb = plgpu.load(x_gmem.at[m, pl.ds(kb * BK, BK)], layout=COLS, optimized=False).astype(tm.F32)
        wb = plgpu.load(w_gmem.at[layer, pl.ds(start, COLUMNS), pl.ds(kb * BK, BK)], layout=WGMMA,
                        optimized=False).astype(tm.F32)
        acc = tm.mac(acc, jnp.broadcast_to(xb[None, :], (COLUMNS, BK)), wb, fused, gpu)
    return jnp.max(lanes_tree(acc, scratch), axis=1)  # the lanes equal: max is exact


def _vector_sums(x_gmem, w_gmem, layer, m, start, K, BK, fused, gpu):
    """The sums [64] of columns start.. of row m, BK < 8 lanes: lane l a vector of the columns, adding
    x[m, k] * w^T[k] for k = kb*BK + l in order from +0; then the lanes' tree over the vectors."""
    lanes = [jnp.zeros((COLUMNS,), tm.F32) for _ in range(BK)]
    for k in range(K):
        xk = jnp.broadcast_to(x_gmem[m, k].astype(tm.F32), (COLUMNS,))
        wk = plgpu.load(w_gmem.at[layer, k, pl.ds(start, COLUMNS)], layout=ROWS, optimized=False).astype(tm.F32)
        lanes[k % BK] = tm.mac(lanes[k % BK], xk, wk, fused, gpu)
    while len(lanes) > 1:
        half = len(lanes) // 2
        lanes = [a + b for a, b in zip(lanes[:half], lanes[half:])]
    return lanes[0]
