"""The twin kernels' float32 arithmetic, Pallas side: every operation with one fixed rounding.

The numerics contract these operations implement is `kernels_pallas.contract.numerics` (its
docstring states it; its constants are the polynomials' coefficients); `kernels_triton.twin_math` is
this module's Triton twin, operation for operation (keep the two in step). Compiled for the GPU, a
rounding is one PTX instruction written inline (``mul.rn.f32``, ``fma.rn.f32``, ``div.rn.f32``,
``sqrt.rn.f32``); interpreted (CPU), ``where(isnan(p), nan, p)`` hides a product from XLA's FMA
contraction and an optimization barrier keeps a division a division.

Each function takes `gpu` (static): True when the kernel is compiled for the GPU by Pallas's Triton
backend, a `Mosaic` when compiled by its Mosaic GPU backend, False when it runs interpreted or as
plain jax.numpy (the references call these functions too). Mosaic GPU emits its float arithmetic
with LLVM's ``contract`` flag (free to fuse a product into the add that follows), so there too
every rounding the contract names is one inline PTX instruction (`_asm_mosaic`), and so is
``floor`` (``cvt.rmi.f32.f32``), which Mosaic GPU does not lower.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as pltriton

from kernels_pallas.contract.numerics import (
    COS_POLY,
    ERF_ALPHA,
    ERF_BETA,
    EXP_POLY,
    LN2_HI,
    LN2_LO,
    LOG2E,
    PIO2,
    SIN_POLY,
    SQRT1_2,
    TWO_OVER_PI,
    check_index,
)

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Mosaic:
    """`gpu` of a kernel compiled by Pallas's Mosaic GPU backend: `layout` is the register layout
    (a `plgpu.Layout`) of the arrays the kernel hands these functions (inline PTX needs it stated);
    `vector`, where the kernel also hands them 1-D arrays in another (a wgmma tile's rows), theirs."""

    layout: Any
    vector: Any = None


def overlap_launches(gpu) -> None:
    """At a Mosaic GPU kernel's start (compiled; interpreted, nothing): wait for the kernel before it
    (``griddepcontrol.wait``: its writes visible) and let the next one launch
    (``griddepcontrol.launch_dependents``). The module then says it uses programmatic dependent launch,
    and where XLA launches it so (``--xla_gpu_enable_pdl``), the next kernel's launch and whatever it does
    before its own wait overlap this one's work; elsewhere both instructions do nothing."""
    if isinstance(gpu, Mosaic):
        from jax.experimental.pallas import mosaic_gpu as plgpu

        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()


def _asm(op: str, gpu_args, gpu):
    """One float32 PTX instruction `op` ("mul.rn.f32", ...) on the broadcast `gpu_args`, element by element."""
    args = jnp.broadcast_arrays(*gpu_args)
    if isinstance(gpu, Mosaic):
        return _asm_mosaic(op, args, gpu.vector if gpu.vector is not None and args[0].ndim == 1 else gpu.layout)
    operands = ", ".join(f"${i + 1}" for i in range(len(args)))
    [y] = pltriton.elementwise_inline_asm(f"{op} $0, {operands};", args=args,
                                          constraints="=f," + ",".join(["f"] * len(args)), pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, F32)])
    return y


def _asm_mosaic(op: str, args, layout):
    """`_asm` in a Mosaic GPU kernel: `plgpu.inline_mgpu` over the registers of float32 arrays in `layout`."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    args = [plgpu.layout_cast(a.astype(F32), layout) for a in args]

    @plgpu.inline_mgpu(arg_types=(layout,) * len(args),
                       return_type=plgpu.ShapeDtypeStruct(args[0].shape, F32, layout))
    def apply(_, first, *rest):
        return first._pointwise(functools.partial(_ptx_each, op), *rest)

    return apply(*args)


def _ptx_each(op: str, *regs):
    """`op` on float32 registers (scalars or vectors: element by element), as inline PTX."""
    from jax._src.lib.mlir import ir
    from jax._src.lib.mlir.dialects import llvm, vector

    f32 = ir.F32Type.get()
    if regs[0].type == f32:
        operands = ", ".join(f"${i}" for i in range(len(regs) + 1))
        return llvm.inline_asm(f32, list(regs), f"{op} {operands};", "=f" + ",f" * len(regs))
    out = llvm.mlir_undef(regs[0].type)
    for i in range(ir.VectorType(regs[0].type).shape[0]):
        pos = ir.DenseI64ArrayAttr.get([i])
        elems = [vector.extract(r, dynamic_position=[], static_position=pos) for r in regs]
        out = vector.insert(_ptx_each(op, *elems), out, dynamic_position=[], static_position=pos)
    return out


def _opaque(y):
    """y, behind a select XLA cannot see through: no FMA contraction of a product into the add
    that follows, no rewrite of 1 / sqrt(v) into an approximate rsqrt (NaN payloads not kept)."""
    return jnp.where(jnp.isnan(y), F32(jnp.nan), y)


def mul(a, b, gpu: bool):
    """a * b in float32, rounded on its own (never contracted into an FMA)."""
    return _asm("mul.rn.f32", (a, b), gpu) if gpu else _opaque(a * b)


def mma_add(acc, d, gpu: bool):
    """acc + d, where d is a matrix product on the tensor cores (the attention's MMA form):
    compiled, an ``add.rn.f32`` that Triton's dot-add combine cannot see, so each product starts
    from a zero accumulator and is added on its own on both twins, whatever the Triton version."""
    return _asm("add.rn.f32", (acc, d), gpu) if gpu else acc + d


def mac(acc, a, b, fused: bool, gpu: bool):
    """acc + a * b; fused (a and b upcast from 16-bit values; module docstring): one FMA on the GPU."""
    if fused and gpu:
        return _asm("fma.rn.f32", (a, b, acc), gpu)
    return acc + mul(a, b, gpu)


def div(a, b, gpu: bool):
    """a / b, correctly rounded. Interpreted, the divisor is broadcast behind an optimization
    barrier: XLA rewrites a division by a broadcast scalar into a product with its reciprocal."""
    if gpu:
        return _asm("div.rn.f32", (a, b), gpu)
    a, b = jnp.broadcast_arrays(a, b)
    return _opaque(a / lax.optimization_barrier(b))


def sqrt(a, gpu: bool):
    """sqrt(a), correctly rounded."""
    return _asm("sqrt.rn.f32", (a,), gpu) if gpu else _opaque(jnp.sqrt(a))


def floor(x, gpu):
    """floor(x) (exact): jnp.floor, or ``cvt.rmi.f32.f32`` in a Mosaic GPU kernel (which has no floor)."""
    return _asm("cvt.rmi.f32.f32", (x,), gpu) if isinstance(gpu, Mosaic) else jnp.floor(x)


def tree_sum(x):
    """Sum over the last axis (a power of two long) in the fixed halving order; keeps the axis (size 1)."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"tree_sum: the axis length must be a power of two, got {n}")
    while x.shape[-1] > 1:
        a, b = jnp.split(x, 2, axis=-1)
        x = a + b
    return x


def to_dtype(x, dtype):
    """float32 -> dtype, round to nearest even (XLA's and Triton's compiled cast)."""
    return x.astype(dtype)


def _horner(x, coefs, gpu: bool):
    y = jnp.full_like(x, coefs[0])
    for c in coefs[1:]:
        y = mul(y, x, gpu) + F32(c)
    return y


def _pow2(n):
    """2**n as float32 for integer-valued float32 n in [-126, 127] (built from the exponent bits)."""
    return lax.bitcast_convert_type((n.astype(jnp.int32) + 127) * (1 << 23), F32)


def exp(x, gpu: bool):
    """e**x (Cephes expf: n = round(x log2 e), r = x - n ln 2 in two parts, degree-7 polynomial).

    Within 2 ulp of the true value; 0 below -87.3 (no subnormal results), inf above 88.7.
    """
    n = floor(mul(x, F32(LOG2E), gpu) + F32(0.5), gpu)
    n = jnp.clip(n, -126.0, 127.0)
    r = (x - mul(n, F32(LN2_HI), gpu)) - mul(n, F32(LN2_LO), gpu)
    r2 = mul(r, r, gpu)
    p = mul(_horner(r, EXP_POLY, gpu), r2, gpu) + r + F32(1.0)
    y = mul(p, _pow2(n), gpu)
    y = jnp.where(x < F32(-87.3), F32(0.0), y)
    y = jnp.where(x > F32(88.7), F32(jnp.inf), y)
    return jnp.where(jnp.isnan(x), x, y)


def sincos(x, gpu: bool):
    """(sin x, cos x): k = round(x 2/pi), r = x - k pi/2 in three parts, Cephes polynomials.

    Accurate to a few ulp for |x| up to about 1e5 (RoPE angles: frequency * position).
    """
    k = floor(mul(x, F32(TWO_OVER_PI), gpu) + F32(0.5), gpu)
    r = ((x - mul(k, F32(PIO2[0]), gpu)) - mul(k, F32(PIO2[1]), gpu)) - mul(k, F32(PIO2[2]), gpu)
    z = mul(r, r, gpu)
    s = mul(mul(_horner(z, SIN_POLY, gpu), z, gpu), r, gpu) + r
    c = (mul(mul(_horner(z, COS_POLY, gpu), z, gpu), z, gpu) - mul(F32(0.5), z, gpu)) + F32(1.0)
    q = k.astype(jnp.int32) & 3
    sin = jnp.where(q == 0, s, jnp.where(q == 1, c, jnp.where(q == 2, -s, -c)))
    cos = jnp.where(q == 0, c, jnp.where(q == 1, -s, jnp.where(q == 2, -c, s)))
    return sin, cos


def erf(x, gpu: bool):
    """erf(x): x P(x^2) / Q(x^2) on x clamped to [-4, 4] (XLA's float32 rational approximation)."""
    x = jnp.clip(x, -4.0, 4.0)
    x2 = mul(x, x, gpu)
    return div(mul(x, _horner(x2, ERF_ALPHA, gpu), gpu), _horner(x2, ERF_BETA, gpu), gpu)


def silu(x, gpu: bool):
    """x * sigmoid(x) as x / (1 + e**-x)."""
    return div(x, F32(1.0) + exp(-x, gpu), gpu)


def gelu(x, gpu: bool):
    """The exact (erf) GELU: (x / 2) (1 + erf(x / sqrt 2))."""
    return mul(mul(x, F32(0.5), gpu), F32(1.0) + erf(mul(x, F32(SQRT1_2), gpu), gpu), gpu)


def host_values(x):
    """x's values where reading them waits on no device (numpy; a concrete JAX array on the CPU), else
    None (traced, or on a GPU): what `contract.numerics.check_index` may read."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) \
            and all(d.platform == "cpu" for d in x.devices()):
        return np.asarray(x)
    return None


def layer_index(who: str, layer, L: int) -> jax.Array:
    """The layer index of a twin's stacked weights [L, ...] as an int32 scalar, after `check_index` (an
    index outside [0, L) would read another layer's weights, or memory of none)."""
    check_index(who, "layer", layer, L, host_values(layer), scalar=True)
    return jnp.asarray(layer, jnp.int32).reshape(())
