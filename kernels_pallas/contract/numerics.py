"""The twin kernels' numerics contract, and what both twins' arithmetic reads of it.

`kernels_pallas.twin_*` and `kernels_triton.twin_*` compute the same bits, on the GPU and on the
CPU, with the operations of `kernels_pallas.twin_math` and `kernels_triton.twin_math`:

* Values are upcast to float32 on load (exact); every result is rounded once, to nearest even,
  where the contract names it (`to_dtype`).
* A product is rounded on its own, never fused with the add that follows (`mul`): compiled for
  the GPU it is one ``mul.rn.f32`` (inline PTX on the Pallas side; the Triton twins launch with
  ``enable_fp_fusion=False``); interpreted (CPU), ``where(isnan(p), nan, p)`` stands between the
  product and the add, which XLA cannot contract through, and Triton's interpreter never fuses.
* One exception, the linear kernels' products of two 16-bit values (`mac`): such a product is
  exact in float32 (8 + 8 or 11 + 11 significant bits), so rounding it first or fusing it into
  the add gives the same bits, and the GPU kernels fuse (``fma.rn.f32``; Triton's ``tl.fma``):
  half the instructions. The CPU paths round first. The one caveat: a product that leaves
  float32's normal range (under 2**-126, an activation times a weight below ~1e-38, or past
  3e38) is not exact, and there a GPU result may differ from a CPU one. The two GPU twins
  always agree with each other: both compile through Triton, which keeps subnormals (products
  near that range gave the same bits on an H200). The two CPU twins agree but where a value is
  subnormal (magnitude under 2**-126, in or out of an operation): XLA's CPU backend flushes it
  to zero, the Triton interpreter keeps it.
* Division and square root are correctly rounded (``div.rn`` / ``sqrt.rn``; IEEE on the CPU).
* A sum over an axis is `tree_sum`: the halves ``x[..., :n/2] + x[..., n/2:]``, halved again
  until one element is left. The order is a fixed function of the axis length, so it does not
  depend on the batch size, the tile layout or the backend; a sum over K runs `twin_lanes(K)`
  lanes, each adding its K / lanes blocks in order, then the lanes' tree.
* Transcendentals are polynomials written with the operations above (`exp`, `sincos`, `erf`),
  with the constants below, not the backend's: the same formula on both sides gives the same bits.

Standard library only.
"""

from __future__ import annotations

import math
import numbers

INT32_MAX = 2**31 - 1  # flat element offsets computed in int32 must stay at or below this

# exp (Cephes expf): n = round(x log2 e), r = x - n ln 2 in two parts, a degree-7 polynomial
LOG2E = 1.44269504088896341
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so that n * LN2_HI is exact
EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
            5.0000001201e-1)
# sincos: k = round(x 2/pi), r = x - k pi/2 in three parts, Cephes polynomials
TWO_OVER_PI = 0.636619772367581343
PIO2 = (1.5703125, 4.837512969970703125e-4, 7.54978995489188216e-8)  # pi/2 in three parts
SIN_POLY = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
COS_POLY = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)
# erf: x P(x^2) / Q(x^2) on x clamped to [-4, 4] (XLA's float32 rational approximation)
ERF_ALPHA = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
             -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
ERF_BETA = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
            -1.42647390514189e-02)
SQRT1_2 = 0.707106781186547524

TWIN_MAX_BK = 128  # lanes of a sum over K (the reduction order depends on this and K alone)
TWIN_INTERPRET_MAX_BM = 64  # rows a program of the interpreted (CPU) linears and norms: fewer, larger programs

# The twin linears' and attention's two forms (their modules' docstrings): "lanes" (CUDA cores, every
# backend) and "mma" (tensor cores: compiled for the GPU, 16-bit operands)
TWIN_FORMS = ("lanes", "mma")
TWIN_MMA_ROWS = 16  # rows of the MMA forms' operand: the attention's query, repeated; the linears' fewest x rows a program
SIXTEEN_BIT = ("bfloat16", "float16", "torch.bfloat16", "torch.float16")  # dtypes of the MMA forms, as str(dtype)


def positive_int(v) -> bool:
    """Whether v is an int >= 1 (a bool is not an int here): the sizes, strides and counts the kernels take."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def check_nonempty(who: str, name: str, shape, counts) -> None:
    """Refuse, naming `who`'s `name`, an array with a dimension of size 0; counts: what each dimension
    counts ("row (M)", ...), in the shape's order. The twin kernels' rule: every size is at least 1.
    An empty grid is no launch on one backend and a raw error on the other, and an empty batch of a
    linear would only move the refusal into its backward (the weights' gradient sums over K = M)."""
    for size, what in zip(shape, counts):
        if size < 1:
            raise ValueError(f"{who}({name}): expected at least one {what}, got shape {tuple(shape)}")


def check_launch(who: str, num_warps, num_stages=None) -> None:
    """Refuse, naming `who`'s argument, a launch setting that would reach a compiler unchecked (refused
    there in its own words, or read as another: Pallas took a num_stages of 0 as its default), before
    anything runs, alike on both twins: num_warps a power of two in 1..32 (the warps of a program),
    num_stages None (the kernel's default) or an int >= 1 (a pipeline depth). Speed only: neither
    changes the bits."""
    if not positive_int(num_warps) or num_warps > 32 or num_warps & (num_warps - 1):
        raise ValueError(f"{who}: num_warps must be a power of two in 1..32, got {num_warps!r}")
    if num_stages is not None and not positive_int(num_stages):
        raise ValueError(f"{who}: num_stages must be None or an int >= 1, got {num_stages!r}")


TWIN_FLOAT_DTYPES = ("float32", "bfloat16", "float16")  # what the twins compute on, either framework


def check_twin_dtype(who: str, name: str, x) -> None:
    """TypeError naming `who`'s `name` unless x is an array or tensor of a dtype the twins compute on:
    a float64 array would come back float32 from the Pallas side (JAX narrows it), float64 from the
    Triton side."""
    dtype = str(getattr(x, "dtype", "")).removeprefix("torch.")
    if dtype not in TWIN_FLOAT_DTYPES:
        raise TypeError(f"{who}({name}): expected one of {', '.join(TWIN_FLOAT_DTYPES)}, got "
                        f"{dtype or type(x).__name__}")


def sixteen_bit(dtype) -> bool:
    """Whether `dtype` (an array's or tensor's `.dtype`, either framework's) is one the MMA forms take.
    A scalar type such as `jnp.bfloat16` is refused rather than read as another dtype: its str is the
    class's, which would quietly choose the lanes form."""
    if isinstance(dtype, type):
        raise TypeError(f"dtype: expected a dtype (an array's or tensor's .dtype), got the scalar type {dtype}")
    return str(dtype) in SIXTEEN_BIT


def next_pow2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def twin_lanes(K: int) -> int:
    """BK, the lanes of every twin sum over an axis of length K: a function of K alone."""
    return largest_pow2_divisor(K, TWIN_MAX_BK)


def choose_form(who: str, form: str | None, fits: bool, compiled: bool, needs: str) -> str:
    """`form` if given (one of TWIN_FORMS; "mma" only where it fits), else "mma" where it fits
    and runs compiled, else "lanes"; a bad form is refused naming who's argument."""
    if form not in (None, *TWIN_FORMS):
        raise ValueError(f"{who}(form): must be one of {TWIN_FORMS} or None, got {form!r}")
    if form == "mma" and not fits:
        raise ValueError(f"{who}(form='mma'): needs {needs}")
    if form is not None:
        return form
    return "mma" if compiled and fits else "lanes"


def check_index(who: str, name: str, index, high: int, values=None, scalar: bool = False) -> None:
    """Refuse, naming `who`'s `name`, an index argument that is not integers (a bool is not one) or
    whose values lie outside [0, high). `values`: what the caller could read of an array without
    waiting on a device (numpy values of a host array; None for one that is traced or on a GPU: not
    read, and the kernels use it unchecked, so it must be in range, as the step's tables make it).
    A Python or numpy int is read here. `high` 0 is refused: there is nothing to index. scalar: one
    index (an array of one element), as a layer is."""
    dtype = str(getattr(index, "dtype", "")).removeprefix("torch.")
    if isinstance(index, bool) or dtype == "bool":
        raise TypeError(f"{who}({name}): expected integers, got {index!r}")
    if isinstance(index, numbers.Integral):
        values = int(index)
    elif not dtype.startswith(("int", "uint")):
        raise TypeError(f"{who}({name}): expected integers, got {dtype or type(index).__name__}")
    elif scalar and math.prod(index.shape) != 1:
        raise TypeError(f"{who}({name}): expected one index, got an array of shape {list(index.shape)}")
    if high < 1:
        raise ValueError(f"{who}({name}): nothing to index (a size of {high})")
    if values is None or not getattr(values, "size", 1):
        return
    low, top = (values, values) if isinstance(values, int) else (int(values.min()), int(values.max()))
    if low < 0 or top >= high:
        raise ValueError(f"{who}({name}): expected values in [0, {high}), got {low if low < 0 else top}")
