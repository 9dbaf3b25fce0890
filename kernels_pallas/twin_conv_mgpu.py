"""The codec's twin operations on Pallas's Mosaic GPU backend; their Triton-backend twins are
`twin_conv.elu`, `taps` and `nearest`, their Triton twins `kernels_triton.twin_conv`.

Contract: `twin_conv`'s, unchanged.

- `elu`: `twin_conv`'s ELU of each element (`elementwise_mgpu`: 1,024 elements a program, a lane a
  thread), its exp `twin_math.exp` with each rounding an inline PTX instruction.
- `taps`: the tap matrix is data movement, which XLA's gather does exactly: the ELU (where asked) by
  `elu`, then `taps_native`'s gather and carry update. Not one kernel as on the Triton backend:
  Mosaic GPU reads global memory by TMA boxes and whole arrays, not by per-lane addresses.
- `nearest`: a program is one row of x and `split` entries, 64 at a time (TMA, the next block's load
  going out before the current one is scored). The block's distances run in the wgmma layout, an
  entry a row and a lane a column: the D / BK blocks of (x - e)^2 added in order from +0, the
  products each one `mul.rn.f32`, then the lanes' halving tree (`twin_norm_mgpu.lanes_tree`). NaN
  distances count as +inf; the first least entry of each program, then of the row (XLA, exact).
  It takes entries of a multiple of 128 dims (BK = 128 lanes) in blocks of 64.

Interpreted (CPU), in Mosaic GPU's interpreter (jax >= 0.11): the same operations in the same order,
so the bits are the references' (`twin_conv.elu_native`, `taps_native`, `nearest_native`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import twin_math as tm
from kernels_pallas.contract.conv import check_nearest, nearest_plan
from kernels_pallas.contract.linear import check_mosaic_interpreter
from kernels_pallas.contract.numerics import twin_lanes
from kernels_pallas.elementwise_mgpu import elementwise
from kernels_pallas.twin_conv import (
    _check_float,
    _elu_f32,
    _first_least,
    elu_native,
    nearest_native,
    taps_native,
)
from kernels_pallas.twin_linear_mgpu import smem_tiles
from kernels_pallas.twin_norm_mgpu import lanes_tree

__all__ = ["elu", "elu_native", "mosaic_takes_nearest", "nearest", "nearest_native", "taps", "taps_native"]

LANES = 128  # a distance block's lanes (nearest)
BE = 64  # entries a nearest block scores at once: wgmma's rows
WGMMA = plgpu.Layout.WGMMA
COLS = WGMMA.reduce(0)  # a vector along a [64, n] array's columns


def elu(x: jax.Array, *, interpret: bool | None = None) -> jax.Array:
    """`twin_conv.elu`: the contract's ELU of every element of x (any shape, float); x's shape and dtype."""
    _check_float("elu", "x", x)
    return _elu(x, interpret)


def _elu(x, interpret: bool | None):
    """`elu`'s kernel (its arguments checked): `elementwise_mgpu.elementwise`."""
    (y,) = elementwise(lambda gpu, v: (tm.to_dtype(_elu_f32(v, gpu), x.dtype),), x, out_dtypes=(x.dtype,),
                       name="twin_elu_mgpu", interpret=interpret)
    return y


def taps(x: jax.Array, *, kernel_size: int, stride: int = 1, dilation: int = 1, elu: bool = False,
         carry: jax.Array | None = None, carry_slot: tuple[int, int] | None = None, active: jax.Array | None = None,
         first: jax.Array | None = None, replicate: bool = False, interpret: bool | None = None):
    """`twin_conv.taps` (the same arguments and bits): the ELU by this module's kernel where asked, the
    gather and the carry by XLA (module docstring); the carry is returned updated (in place under
    donation, as XLA updates a donated buffer)."""
    if elu:
        _check_float("taps", "x", x)
    source = _elu(x, interpret) if elu else x
    return taps_native(source, kernel_size=kernel_size, stride=stride, dilation=dilation, carry=carry,
                       carry_slot=carry_slot, active=active, first=first, replicate=replicate)


def mosaic_takes_nearest(N: int, D: int, split: int) -> bool:
    """Whether `nearest` runs a call: D a multiple of 128 (BK = 128 lanes), the programs' entries a
    multiple of 64 (wgmma's rows)."""
    return D % LANES == 0 and N % BE == 0 and split % BE == 0


def nearest(x: jax.Array, entries: jax.Array, *, split: int | None = None, interpret: bool | None = None) -> jax.Array:
    """`twin_conv.nearest`: the contract's nearest entry of each row, x [M, D], entries [N, D] -> int32 [M]
    (module docstring). split: the entries a program searches (`contract.conv.nearest_plan`)."""
    M, N, D = check_nearest(x, entries)
    split, _ = nearest_plan(N, split)
    if not mosaic_takes_nearest(N, D, split):
        raise ValueError(f"nearest(entries): the Mosaic GPU kernel takes D a multiple of {LANES} and programs of a "
                         f"multiple of {BE} entries, got D={D}, N={N}, split={split}")
    interpret = jax.default_backend() != "gpu" if interpret is None else interpret
    check_mosaic_interpreter("nearest", interpret, jax.__version_info__)
    S = N // split
    call = plgpu.kernel(
        functools.partial(_nearest_kernel, N=N, D=D, split=split, gpu=False if interpret else tm.Mosaic(WGMMA)),
        out_type=(jax.ShapeDtypeStruct((M, S), tm.F32), jax.ShapeDtypeStruct((M, S), jnp.int32)),
        grid=(M, S), grid_names=("m", "s"), interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="twin_nearest_mgpu")
    best, arg = call(x, entries)
    return _first_least(best, arg, N)


def _nearest_kernel(x_gmem, e_gmem, best_gmem, arg_gmem, *, N, D, split, gpu):
    """Program (m, s): the first least entry of row m among entries s * split.. (module docstring)."""
    tm.overlap_launches(gpu)
    m, s = lax.axis_index("m"), lax.axis_index("s")
    BK = twin_lanes(D)
    blocks = split // BE
    x_blocks = [jnp.broadcast_to(plgpu.load(x_gmem.at[m, pl.ds(kb * BK, BK)], layout=COLS,
                                            optimized=False).astype(tm.F32)[None, :], (BE, BK))
                for kb in range(D // BK)]

    def scoped(e_buf, scratch, bars):
        def fetch(blk):  # block blk's entries into buffer blk % 2
            first = pl.multiple_of(s * split + blk * BE, BE)
            plgpu.copy_gmem_to_smem(e_gmem.at[pl.ds(first, BE)], e_buf.at[blk % 2], bars.at[blk % 2])

        best, arg = tm.F32(jnp.inf), s * split
        fetch(0)
        for blk in range(blocks):
            if blk + 1 < blocks:  # the next block's load goes out before this block is scored
                fetch(blk + 1)
            plgpu.barrier_wait(bars.at[blk % 2])
            acc = None
            for kb, xb in enumerate(x_blocks):  # the blocks of (x - e)^2 in order, from +0
                e = plgpu.load(e_buf.at[blk % 2, :, pl.ds(kb * BK, BK)], layout=WGMMA, optimized=False)
                d = xb - e.astype(tm.F32)
                p = tm.mul(d, d, gpu)
                acc = jnp.zeros_like(p) + p if acc is None else acc + p
            plgpu.commit_smem()  # every thread has read the buffer before it is refilled
            dist = jnp.max(lanes_tree(acc, scratch), axis=1)  # [BE]: the lanes equal, max is exact
            dist = jnp.where(jnp.isnan(dist), tm.F32(jnp.inf), dist)
            least = jnp.min(dist)
            index = s * split + blk * BE + lax.broadcasted_iota(jnp.int32, (BE,), 0)
            at = jnp.min(jnp.where(dist == least, index, N))
            take = least < best  # strict: an equal distance in a later block keeps the earlier entry
            best, arg = jnp.where(take, least, best), jnp.where(take, at, arg)
        best_gmem[m, s] = best
        arg_gmem[m, s] = arg

    pl.run_scoped(scoped, plgpu.SMEM((2, BE, D), e_gmem.dtype, transforms=smem_tiles(e_gmem.dtype)),
                  plgpu.SMEM((BE, 16), tm.F32), plgpu.Barrier(num_arrivals=1, num_barriers=2))
