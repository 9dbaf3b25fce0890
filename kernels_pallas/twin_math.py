"""The twin kernels' float32 arithmetic, Pallas side: every operation with one fixed rounding.

The numerics contract of the twin kernels (`kernels_pallas.twin_*` and `kernels_triton.twin_*`
compute the same bits, on the GPU and on the CPU):

* Values are upcast to float32 on load (exact); every result is rounded once, to nearest even,
  where the contract names it (`to_dtype`).
* A product is rounded on its own, never fused with the add that follows (`mul`): compiled for
  the GPU it is one ``mul.rn.f32`` (inline PTX); interpreted (CPU), ``where(isnan(p), nan, p)``
  stands between the product and the add, which XLA cannot contract through. The Triton twin
  launches with ``enable_fp_fusion=False``.
* One exception, the linear kernels' products of two 16-bit values (`mac`): such a product is
  exact in float32 (8 + 8 or 11 + 11 significant bits), so rounding it first or fusing it into
  the add gives the same bits, and the GPU kernels fuse (``fma.rn.f32``; Triton's ``tl.fma``):
  half the instructions. The CPU paths round first. The one caveat: a product that leaves
  float32's normal range (under 2**-126, an activation times a weight below ~1e-38, or past
  3e38) is not exact, and there a GPU result may differ from a CPU one. The two GPU twins
  always agree with each other, as do the two CPU twins.
* Division and square root are correctly rounded (``div.rn`` / ``sqrt.rn``; IEEE on the CPU).
* A sum over an axis is `tree_sum`: the halves ``x[..., :n/2] + x[..., n/2:]``, halved again
  until one element is left. The order is a fixed function of the axis length, so it does not
  depend on the batch size, the tile layout or the backend.
* Transcendentals are polynomials written here with the operations above (`exp`, `sincos`,
  `erf`), not the backend's: the same formula on both sides gives the same bits.

Each function takes `gpu` (static): True when the kernel is compiled for the GPU, False when
it runs interpreted or as plain jax.numpy (the references call these functions too).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
LOG2E = 1.44269504088896341
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so that n * LN2_HI is exact
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
            5.0000001201e-1)
TWO_OVER_PI = 0.636619772367581343
PIO2 = (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)  # pi/2 in three parts
SIN_POLY = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
COS_POLY = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)
ERF_ALPHA = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
             -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_BETA = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)
SQRT1_2 = 0.707106781186547524


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
