"""The twin linears' backward kernels on Pallas's Mosaic GPU backend; their Triton-backend twins are
`twin_grad.epilogue_grad` and `batch_sum`, their Triton twins `kernels_triton.twin_grad`.

Contract: `contract.grad`, unchanged (steps 2 and 3), written with the same function
(`twin_grad.epilogue_grad_math`).

A program is one row of dy and 128 of its columns, a lane a thread, read from global memory in
registers and written back through shared memory (TMA). `batch_sum`: a program is 128 columns, adding
the rows one after another from +0. Both take N_out a multiple of 128 (the stacks' widths); the
Triton-backend kernels run the others.

Interpreted (CPU), in Mosaic GPU's interpreter (jax >= 0.11): the same operations in the same order,
so the bits are the references' (`twin_grad.epilogue_grad_native`, `batch_sum_native`) on any input.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import twin_math as tm
from kernels_pallas.elementwise_mgpu import LANES, lane_setup
from kernels_pallas.twin_grad import (
    batch_sum_native,
    check_batch_sum,
    check_epilogue_grad,
    epilogue_grad_math,
    epilogue_grad_native,
)

__all__ = ["batch_sum", "batch_sum_native", "epilogue_grad", "epilogue_grad_native", "mosaic_takes_columns"]

F32 = tm.F32


def mosaic_takes_columns(N: int) -> bool:
    """Whether these kernels take an array of N columns: whole programs of 128 lanes."""
    return N % LANES == 0


def _prepare(who: str, N: int, interpret: bool | None):
    if not mosaic_takes_columns(N):
        raise ValueError(f"{who}: the Mosaic GPU kernel takes a multiple of {LANES} columns, got {N}")
    return lane_setup(who, interpret)


def epilogue_grad(dy: jax.Array, pre: jax.Array | None, scale: jax.Array | None = None, layer=None, *,
                  act: str | None = None, interpret: bool | None = None):
    """`twin_grad.epilogue_grad` (the same arguments, results and bits): dy [M, N_out]; pre [M, N] (N = 2
    N_out for act="silu_gate") or None; scale [L, N_out] at `layer` or None. Returns (dpre [M, N] in dy's
    dtype, ts float32 [M, N_out] or None)."""
    M, N_out, parts = check_epilogue_grad(dy, pre, scale, act)
    if pre is None:
        return dy, None
    interpret, lanes, gpu = _prepare("epilogue_grad", N_out, interpret)
    outs = [jax.ShapeDtypeStruct((M, parts * N_out), dy.dtype)]
    if scale is not None:
        outs.append(jax.ShapeDtypeStruct((M, N_out), F32))
    operands = [jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), dy, pre]
    operands += [] if scale is None else [scale]
    call = plgpu.kernel(
        functools.partial(_epilogue_kernel, N_out=N_out, parts=parts, act=act, has_scale=scale is not None,
                          lanes=lanes, gpu=gpu),
        out_type=tuple(outs), grid=(M, N_out // LANES), grid_names=("m", "n"),
        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name="twin_epilogue_grad_mgpu")
    res = call(*operands)
    return res[0], res[1] if scale is not None else None


def _epilogue_kernel(layer_gmem, dy_gmem, pre_gmem, *refs, N_out, parts, act, has_scale, lanes, gpu):
    """Program (m, j): row m, columns j*128.. of dy (and of each of pre's halves)."""
    tm.overlap_launches(gpu)
    refs = list(refs)
    scale_gmem = refs.pop(0) if has_scale else None
    dpre_gmem, *ts_gmem = refs
    m, j = lax.axis_index("m"), lax.axis_index("n")

    def load(ref, *at):
        return plgpu.load(ref.at[at], layout=lanes).astype(F32)

    def scoped(out_smem, ts_smem):
        halves = tuple(load(pre_gmem, m, pl.ds(h * N_out + j * LANES, LANES)) for h in range(parts))
        s = load(scale_gmem, layer_gmem[0], pl.ds(j * LANES, LANES)) if has_scale else None
        dpre, ts = epilogue_grad_math(load(dy_gmem, m, pl.ds(j * LANES, LANES)),
                                      halves if act == "silu_gate" else halves[0], s, act, dpre_gmem.dtype, gpu)
        for h, d in enumerate(dpre):
            out_smem[h] = d
        if has_scale:
            ts_smem[...] = ts
        plgpu.commit_smem()
        for h in range(parts):
            plgpu.copy_smem_to_gmem(out_smem.at[h], dpre_gmem.at[m, pl.ds(h * N_out + j * LANES, LANES)])
        if has_scale:
            plgpu.copy_smem_to_gmem(ts_smem, ts_gmem[0].at[m, pl.ds(j * LANES, LANES)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((parts, LANES), dpre_gmem.dtype), plgpu.SMEM((LANES,), F32))


def batch_sum(t: jax.Array, dtype, *, interpret: bool | None = None) -> jax.Array:
    """`twin_grad.batch_sum`: each column's float32 sum of t [M, N] over the rows, from +0 in increasing
    row order, rounded once to dtype. Returns [N] in dtype."""
    M, N = check_batch_sum(t, dtype)
    interpret, lanes, gpu = _prepare("batch_sum", N, interpret)
    call = plgpu.kernel(functools.partial(_batch_sum_kernel, M=M, lanes=lanes, gpu=gpu),
                        out_type=jax.ShapeDtypeStruct((N,), dtype), grid=(N // LANES,), grid_names=("n",),
                        interpret=plgpu.InterpretGPUParams() if interpret else None,
                        kernel_name="twin_batch_sum_mgpu")
    return call(t)


def _batch_sum_kernel(t_gmem, o_gmem, *, M, lanes, gpu):
    """Program j: columns j*128.., the rows added in order from +0."""
    tm.overlap_launches(gpu)
    cols = pl.ds(lax.axis_index("n") * LANES, LANES)

    def row(m, acc):
        return acc + plgpu.load(t_gmem.at[m, cols], layout=lanes).astype(F32)

    def scoped(out_smem):
        zeros = plgpu.layout_cast(jnp.zeros((LANES,), F32), lanes)
        out_smem[...] = tm.to_dtype(lax.fori_loop(0, M, row, zeros), o_gmem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem, o_gmem.at[cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((LANES,), o_gmem.dtype))
