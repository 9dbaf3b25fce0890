"""Elementwise twin operations as one Pallas Mosaic GPU kernel: the arrays flattened, a program 8 rows
of 128 elements (1,024), a lane a thread; every operand in by TMA, every result out by TMA. The codec's
ELU (`twin_conv_mgpu.elu`) and the RoPE rotation of the lane form's ring write
(`twin_rope_mgpu.rope_write`) run on it: their arithmetic is the contract's, element by element, each
rounding one PTX instruction (`twin_math.Mosaic`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import twin_math as tm
from kernels_pallas.contract.linear import check_mosaic_interpreter

LANES = 128  # a warpgroup's threads: an element (a lane) each a row
ROWS = 8  # rows a program (1,024 elements: the Triton programs' ELU block)


def lane_setup(who: str, interpret: bool | None):
    """(interpret, the lanes' layout, gpu) of a kernel of 128 lanes a row, a lane a thread: interpret
    resolved (None: compiled on a GPU backend; interpreted needs jax >= 0.11), the strided layout of
    [128] float32 rows, and `twin_math`'s gpu (`Mosaic` of that layout; False interpreted)."""
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    check_mosaic_interpreter(who, interpret, jax.__version_info__)
    lanes = plgpu.Layout.WG_STRIDED((LANES,), vec_size=1)
    return interpret, lanes, False if interpret else tm.Mosaic(lanes)


def elementwise(fn: Callable, *xs: jax.Array, out_dtypes: Sequence, name: str, interpret: bool | None = None):
    """fn(gpu, *values) -> results, on every element of the arrays xs (one shape, any dtypes): values
    float32 [128] (a row of each operand, upcast), results one array [128] a dtype of `out_dtypes`,
    already in it. Returns the results, each of xs' shape."""
    shape = xs[0].shape
    if any(x.shape != shape for x in xs):
        raise ValueError(f"elementwise({name}): the operands must have one shape, got {[x.shape for x in xs]}")
    interpret, lanes, gpu = lane_setup(name, interpret)
    n = max(1, xs[0].size)
    blocks = -(-n // (ROWS * LANES))
    flat = [jnp.pad(x.reshape(-1), (0, blocks * ROWS * LANES - x.size)).reshape(blocks, ROWS, LANES) for x in xs]
    call = plgpu.kernel(
        functools.partial(_kernel, fn=fn, operands=len(xs), lanes=lanes, gpu=gpu),
        out_type=tuple(jax.ShapeDtypeStruct((blocks, ROWS, LANES), d) for d in out_dtypes), grid=(blocks,),
        grid_names=("block",), interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name=name)
    return tuple(y.reshape(-1)[:xs[0].size].reshape(shape) for y in call(*flat))


def _kernel(*refs, fn, operands, lanes, gpu):
    """Program i: block i [ROWS, 128] of every operand, a lane a thread."""
    tm.overlap_launches(gpu)
    ins, outs = refs[:operands], refs[operands:]
    i = lax.axis_index("block")

    def scoped(*scratch):
        in_smem, out_smem, bars = scratch[:operands], scratch[operands:-1], scratch[-1]
        for k, (src, dst) in enumerate(zip(ins, in_smem)):
            plgpu.copy_gmem_to_smem(src.at[i], dst, bars.at[k])
        for k in range(operands):
            plgpu.barrier_wait(bars.at[k])
        for r in range(ROWS):
            results = fn(gpu, *(plgpu.load(s.at[r], layout=lanes).astype(tm.F32) for s in in_smem))
            for dst, y in zip(out_smem, results):
                dst[r] = y
        plgpu.commit_smem()
        for src, dst in zip(out_smem, outs):
            plgpu.copy_smem_to_gmem(src, dst.at[i])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, *(plgpu.SMEM((ROWS, LANES), r.dtype) for r in (*ins, *outs)),
                  plgpu.Barrier(num_arrivals=1, num_barriers=operands))
