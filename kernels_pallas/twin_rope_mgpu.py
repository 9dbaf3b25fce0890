"""The twin RoPE tables and ring write on Pallas's Mosaic GPU backend; their Triton-backend twins are
`twin_rope.tables`, `rope_write` and `rope_write_bwd`, their Triton twins `kernels_triton.twin_rope`'s.

Contract: `twin_rope`'s, unchanged: angle[b, t, i] = (float32(offset[b]) + t) * freqs[i], (sin, cos) =
`twin_math.sincos(angle)`, every rounding one PTX instruction (`twin_math.Mosaic`). A program is one
(b, t): its D/2 angles a vector in the wgmma layout's column order (any order would do: nothing is
summed), written out by TMA.

`entry` is the JAX twin step's entry (`twin_entry.entry`'s signature and bits) for the Mosaic GPU
twins: these tables, and the integer tables as the jax.numpy expressions of `twin_entry.row_tables`
(exact, whatever compiles them), the counters zeroed.

`rope_write` and `rope_write_bwd` (the lane form's ring write and its derivative; the MMA form writes
its rings in the qkv kernel): the rotation `twin_rope.rotate` by one elementwise kernel
(`elementwise_mgpu`), the GPT-J pairs' split, the transposes and the ring's slots by XLA: data
movement, exact (`twin_rope.rotate_and_write`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import twin_math as tm
from kernels_pallas import twin_rope
from kernels_pallas.contract.linear import check_mosaic_interpreter
from kernels_pallas.elementwise_mgpu import elementwise
from kernels_pallas.twin_entry import Entry, entry_native
from kernels_pallas.twin_rope import angle_sincos, rope_write_bwd_native, rope_write_native, tables_native

# the plain references: the Triton-backend modules'
__all__ = ["entry", "entry_native", "rope_write", "rope_write_bwd", "rope_write_bwd_native", "rope_write_native",
           "tables", "tables_native"]

COLS = plgpu.Layout.WGMMA.reduce(0)


def tables(offset: jax.Array, T: int, freqs: jax.Array, *, interpret: bool | None = None):
    """(cos, sin) float32 [B, T, D/2] for positions offset[b] + t (`twin_rope.tables`); D/2 a multiple of 8."""
    B, half = offset.shape[0], freqs.shape[0]
    if half % 8:
        raise ValueError(f"tables(freqs): the Mosaic GPU tables need D/2 a multiple of 8, got {half}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    check_mosaic_interpreter("tables", interpret, jax.__version_info__)
    out = jax.ShapeDtypeStruct((B, T, half), tm.F32)
    call = plgpu.kernel(functools.partial(_tables_kernel, gpu=False if interpret else tm.Mosaic(COLS)),
                        out_type=(out, out), grid=(B, T), grid_names=("b", "t"),
                        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name="twin_rope_tables_mgpu")
    return call(offset, freqs.astype(tm.F32))


def _tables_kernel(offset_gmem, freqs_gmem, cos_gmem, sin_gmem, *, gpu):
    """Program (b, t): the row of angles (offset[b] + t) * freqs, its cos and sin."""
    tm.overlap_launches(gpu)
    b, t = lax.axis_index("b"), lax.axis_index("t")

    def scoped(cos_smem, sin_smem):
        pos = offset_gmem[b].astype(tm.F32) + t.astype(tm.F32)
        freqs = plgpu.load(freqs_gmem, layout=COLS, optimized=False)
        cos, sin = angle_sincos(pos, freqs, gpu)
        cos_smem[...] = cos
        sin_smem[...] = sin
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(cos_smem, cos_gmem.at[b, t])
        plgpu.copy_smem_to_gmem(sin_smem, sin_gmem.at[b, t])
        plgpu.wait_smem_to_gmem(0)

    row = plgpu.SMEM(freqs_gmem.shape, tm.F32)
    pl.run_scoped(scoped, row, row)


def entry(offset: jax.Array, start_offset: jax.Array, active: jax.Array | None, x: jax.Array, freqs: jax.Array, *,
          capacity: int, convention: str, num_heads: int, interpret: bool | None = None) -> Entry:
    """`twin_entry.entry` (the step's tables, counters and carry) with the RoPE tables of `tables`: the same
    bits. The integer tables are `entry_native`'s expressions (XLA's fusions, not one launch); x is
    returned as it is (no copy)."""
    native = entry_native(offset, start_offset, active, x, freqs, capacity=capacity, convention=convention,
                          num_heads=num_heads)
    cos, sin = tables(offset, x.shape[1], freqs, interpret=interpret)
    return native._replace(cos=lax.stop_gradient(cos), sin=lax.stop_gradient(sin))


def _turn(interpret: bool):
    """The contract's rotation (`twin_rope.rotate`) as the elementwise kernel, for `rotate_and_write`."""
    def turn(r, i, cos, sin, dtype):
        r, i, cos, sin = jnp.broadcast_arrays(r, i, cos, sin)
        return elementwise(lambda gpu, *v: twin_rope.rotate(*v, dtype, gpu), r, i, cos, sin, out_dtypes=(dtype, dtype),
                           name="twin_rope_rotate_mgpu", interpret=interpret)
    return turn


def rope_write(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask, *, interpret: bool | None = None):
    """`twin_rope.rope_write`'s forward (the same arguments, results and bits; not differentiated): the
    rotation by the elementwise kernel, the pairs' split, the transposes and the ring write by XLA
    (exact data movement; the rings updated in place under donation)."""
    return twin_rope.rotate_and_write(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask, _turn(interpret))


def rope_write_bwd(dq, cos, sin, d_ring_k, d_ring_v, layer, write_index, write_mask, *, interpret: bool | None = None):
    """`twin_rope.rope_write_bwd` (the same arguments, results and bits), as `rope_write` is made."""
    return twin_rope.rotate_and_write_bwd(dq, cos, sin, d_ring_k, d_ring_v, layer, write_index, write_mask,
                                          _turn(interpret))
