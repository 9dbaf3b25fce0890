"""The twin kernels' float32 arithmetic, Pallas side: every operation with one fixed rounding.

The numerics contract these operations implement is `kernels_pallas.contract.numerics` (its
docstring states it; its constants are the polynomials' coefficients); `kernels_triton.twin_math` is
this module's Triton twin, operation for operation (keep the two in step). Compiled for the GPU, a
rounding is one PTX instruction written inline (``mul.rn.f32``, ``fma.rn.f32``, ``div.rn.f32``,
``sqrt.rn.f32``); interpreted (CPU), ``where(isnan(p), nan, p)`` hides a product from XLA's FMA
contraction and an optimization barrier keeps a division a division.

Each function takes `gpu` (static): True when the kernel is compiled for the GPU, False when
it runs interpreted or as plain jax.numpy (the references call these functions too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
)

F32 = jnp.float32


def _asm(op: str, gpu_args, nargs: int):
    args = jnp.broadcast_arrays(*gpu_args)
    operands = ", ".join(f"${i + 1}" for i in range(nargs))
    [y] = pltriton.elementwise_inline_asm(f"{op} $0, {operands};", args=args,
                                          constraints="=f," + ",".join(["f"] * nargs), pack=1,
                                          result_shape_dtypes=[jax.ShapeDtypeStruct(args[0].shape, F32)])
    return y


def _opaque(y):
    """y, behind a select XLA cannot see through: no FMA contraction of a product into the add
    that follows, no rewrite of 1 / sqrt(v) into an approximate rsqrt (NaN payloads not kept)."""
    return jnp.where(jnp.isnan(y), F32(jnp.nan), y)


def mul(a, b, gpu: bool):
    """a * b in float32, rounded on its own (never contracted into an FMA)."""
    return _asm("mul.rn.f32", (a, b), 2) if gpu else _opaque(a * b)


def mma_add(acc, d, gpu: bool):
    """acc + d, where d is a matrix product on the tensor cores (the attention's MMA form):
    compiled, an ``add.rn.f32`` that Triton's dot-add combine cannot see, so each product starts
    from a zero accumulator and is added on its own on both twins, whatever the Triton version."""
    return _asm("add.rn.f32", (acc, d), 2) if gpu else acc + d


def mac(acc, a, b, fused: bool, gpu: bool):
    """acc + a * b; fused (a and b upcast from 16-bit values; module docstring): one FMA on the GPU."""
    if fused and gpu:
        return _asm("fma.rn.f32", (a, b, acc), 3)
    return acc + mul(a, b, gpu)


def div(a, b, gpu: bool):
    """a / b, correctly rounded. Interpreted, the divisor is broadcast behind an optimization
    barrier: XLA rewrites a division by a broadcast scalar into a product with its reciprocal."""
    if gpu:
        return _asm("div.rn.f32", (a, b), 2)
    a, b = jnp.broadcast_arrays(a, b)
    return _opaque(a / lax.optimization_barrier(b))


def sqrt(a, gpu: bool):
    """sqrt(a), correctly rounded."""
    return _asm("sqrt.rn.f32", (a,), 1) if gpu else _opaque(jnp.sqrt(a))


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
    n = jnp.floor(mul(x, F32(LOG2E), gpu) + F32(0.5))
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
    k = jnp.floor(mul(x, F32(TWO_OVER_PI), gpu) + F32(0.5))
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
