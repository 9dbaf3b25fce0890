"""The codec's twin operations, JAX side: ELU, the convolutions and the quantizer's nearest entry;
the Triton twin in `kernels_triton.twin_conv` (the same signatures and bits), plain references
(`*_native`) beside each.

Contract (beside `twin_math`'s):

    elu(x) = x if x > 0 else exp(x) - 1, with `twin_math.exp`; rounded to x's dtype. (Not expm1:
        the contract's exp is the one both sides have.)
    conv1d (groups 1): the taps gathered, X[b * T + t, i * k + j] = x[b, i, t * stride + j * dilation]
        (exact data movement), then `twin_linear.linear(X, w.reshape(out, in * k))` (its sum
        contract: lanes over the K = in * k blocks, then the halving tree), then + bias, then +
        residual, each one rounding in x's dtype.
    conv_transpose1d: z[b, t, o, j] = sum_i x[b, i, t] w[i, o, j]: groups 1, the linear of x's
        columns with w as [out * k, in]; channel-wise (groups = in = out), one product
        x[b, c, t] * w[c, 0, j]. Then the overlap-add: tap j of frame t lands on sample
        t * stride + j; the taps, zero-padded to n * stride (n = ceil(k / stride)), cut in n blocks
        of `stride`, block h shifted by h frames, added in order h = 0, 1, ... (from block 0, not
        from +0); then + bias. Output [B, out, (T - 1) * stride + k].
    nearest(x [M, D], entries [N, D]) -> int32 [M]: per row the entry of least squared distance
        S((x - e) * (x - e)) (the linear's sum contract over D: lanes BK = `twin_lanes(D)` over the
        D / BK blocks in order from +0, then `tree_sum`); a NaN distance counts as +inf; the first
        entry among equal distances (a row of NaN: entry 0).

Every row is computed on its own: the bits do not depend on the batch. The adds between the
kernels (bias, residual, overlap-add) are single float32 operations, the same bits in XLA and
torch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import twin_linear
from kernels_pallas import twin_math as tm
from kernels_pallas.contract.conv import (
    ELU_BLOCK,
    NEAREST_BLOCK,
    check_conv1d,
    check_conv_transpose1d,
    check_nearest,
)
from kernels_pallas.contract.numerics import largest_pow2_divisor, twin_lanes


def _elu_f32(x, gpu: bool):
    return jnp.where(x > tm.F32(0.0), x, tm.exp(x, gpu) - tm.F32(1.0))


def _elu_kernel(x_ref, o_ref, *, gpu):
    o_ref[...] = tm.to_dtype(_elu_f32(x_ref[...].astype(tm.F32), gpu), o_ref.dtype)


def _check_float(who: str, name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}({name}): expected a float array, got {x.dtype}")


def elu(x: jax.Array, *, interpret: bool | None = None) -> jax.Array:
    """The contract's ELU of every element of x (any shape, float); x's shape and dtype."""
    _check_float("elu", "x", x)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    flat = x.reshape(-1)
    n = flat.shape[0]
    padded = -(-n // ELU_BLOCK) * ELU_BLOCK
    block = padded if interpret else ELU_BLOCK
    out = pl.pallas_call(
        functools.partial(_elu_kernel, gpu=not interpret),
        out_shape=jax.ShapeDtypeStruct((padded,), x.dtype),
        grid=(padded // block,),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="twin_elu",
    )(jnp.pad(flat, (0, padded - n)))
    return out[:n].reshape(x.shape)


def elu_native(x, **_):
    """The plain jax.numpy reference of `elu`: the same signature and bits."""
    _check_float("elu", "x", x)
    return tm.to_dtype(_elu_f32(x.astype(tm.F32), False), x.dtype)


def _conv1d(x, w, bias, residual, stride, dilation, linear):
    B, cin, _, cout, k, T = check_conv1d(x, w, bias, residual, stride, dilation)
    taps = jnp.arange(T)[:, None] * stride + jnp.arange(k)[None, :] * dilation       # [T, k]
    cols = x[:, :, taps].transpose(0, 2, 1, 3).reshape(B * T, cin * k)               # [B*T, in*k]
    y = linear(cols, w.reshape(cout, cin * k)).reshape(B, T, cout).transpose(0, 2, 1)
    if bias is not None:
        y = y + bias[:, None]
    return y if residual is None else y + residual


def conv1d(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, stride: int = 1, dilation: int = 1,
           residual: jax.Array | None = None, interpret: bool | None = None) -> jax.Array:
    """The contract's convolution, unpadded: x [B, in, L], w [out, in, k], bias [out] -> [B, out, T],
    T = (L - (k - 1) * dilation - 1) // stride + 1; residual [B, out, T] added last."""
    return _conv1d(x, w, bias, residual, stride, dilation, functools.partial(twin_linear.linear, interpret=interpret))


def conv1d_native(x, w, bias=None, *, stride=1, dilation=1, residual=None, **_):
    """The plain jax.numpy reference of `conv1d`: the same signature and bits."""
    return _conv1d(x, w, bias, residual, stride, dilation, functools.partial(twin_linear.linear_native, form="lanes"))


def _conv_transpose1d(x, w, bias, stride, groups, linear):
    B, cin, T, cout, k = check_conv_transpose1d(x, w, bias, stride, groups)
    if groups == 1:
        rows = x.transpose(0, 2, 1).reshape(B * T, cin)
        z = linear(rows, w.transpose(1, 2, 0).reshape(cout * k, cin)).reshape(B, T, cout, k)
    else:
        z = x.transpose(0, 2, 1)[..., None] * w[:, 0][None, None]                       # [B, T, C, k]
    n = -(-k // stride)
    z = jnp.pad(z, ((0, 0), (0, 0), (0, 0), (0, n * stride - k))).reshape(B, T, cout, n, stride)
    y = None
    for h in range(n):
        block = jnp.pad(z[:, :, :, h], ((0, 0), (h, n - 1 - h), (0, 0), (0, 0)))     # [B, T+n-1, out, stride]
        y = block if y is None else y + block
    y = y.transpose(0, 2, 1, 3).reshape(B, cout, (T + n - 1) * stride)[..., :(T - 1) * stride + k]
    return y if bias is None else y + bias[:, None]


def conv_transpose1d(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, stride: int = 1, groups: int = 1,
                     interpret: bool | None = None) -> jax.Array:
    """The contract's transposed convolution, unpadded: x [B, in, T], w [in, out / groups, k] (groups 1
    or channel-wise), bias [out] -> [B, out, (T - 1) * stride + k]."""
    return _conv_transpose1d(x, w, bias, stride, groups, functools.partial(twin_linear.linear, interpret=interpret))


def conv_transpose1d_native(x, w, bias=None, *, stride=1, groups=1, **_):
    """The plain jax.numpy reference of `conv_transpose1d`: the same signature and bits."""
    return _conv_transpose1d(x, w, bias, stride, groups, functools.partial(twin_linear.linear_native, form="lanes"))


def _distances(x_blocks, e_block, gpu):
    """S((x - e)^2) of the contract for BN entries: x_blocks, the row's D / BK blocks [1, BK] float32;
    e_block(kb) -> the entries' block kb [BN, BK] float32. Returns [BN], NaN as +inf."""
    acc = None
    for kb, xb in enumerate(x_blocks):
        d = xb - e_block(kb)
        p = tm.mul(d, d, gpu)
        acc = jnp.zeros_like(p) + p if acc is None else acc + p
    dist = tm.tree_sum(acc)[:, 0]
    return jnp.where(jnp.isnan(dist), tm.F32(jnp.inf), dist)


def _first_min(dist, first, N):
    """(the least of dist [BN], the first index where it is), indexes from `first`."""
    best = jnp.min(dist)
    index = jnp.min(jnp.where(dist == best, first + jnp.arange(dist.shape[0], dtype=jnp.int32), N))
    return best, index


def _nearest_kernel(x_ref, e_ref, o_ref, *, N, D, BN, BK, gpu):
    x_blocks = [x_ref[:, pl.ds(kb * BK, BK)].astype(tm.F32) for kb in range(D // BK)]   # [1, BK] each

    def block(nb, carry):
        best, arg = carry
        dist = _distances(x_blocks, lambda kb: e_ref[pl.ds(nb * BN, BN), pl.ds(kb * BK, BK)].astype(tm.F32), gpu)
        m, i = _first_min(dist, nb * BN, N)
        take = m < best  # strict: an equal distance in a later block keeps the earlier entry
        return jnp.where(take, m, best), jnp.where(take, i, arg)

    _, arg = lax.fori_loop(0, N // BN, block, (tm.F32(jnp.inf), jnp.int32(0)))
    o_ref[...] = jnp.full(o_ref.shape, arg, jnp.int32)


def nearest(x: jax.Array, entries: jax.Array, *, interpret: bool | None = None) -> jax.Array:
    """The contract's nearest entry of each row: x [M, D], entries [N, D] -> int32 [M]."""
    M, N, D = check_nearest(x, entries)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    BK, BN = twin_lanes(D), largest_pow2_divisor(N, NEAREST_BLOCK)
    out = pl.pallas_call(
        functools.partial(_nearest_kernel, N=N, D=D, BN=BN, BK=BK, gpu=not interpret),
        out_shape=jax.ShapeDtypeStruct((M, 1), jnp.int32),
        grid=(M,),
        in_specs=[pl.BlockSpec((1, D), lambda m: (m, 0)), pl.BlockSpec((N, D), lambda m: (0, 0))],
        out_specs=pl.BlockSpec((1, 1), lambda m: (m, 0)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="twin_nearest",
    )(x, entries)
    return out[:, 0]


def nearest_native(x, entries, **_):
    """The plain jax.numpy reference of `nearest`: the same signature and bits."""
    _, N, D = check_nearest(x, entries)
    BK = twin_lanes(D)
    xf, ef = x.astype(tm.F32), entries.astype(tm.F32)
    dist = jax.vmap(lambda row: _distances([row[None, kb * BK:(kb + 1) * BK] for kb in range(D // BK)],
                                           lambda kb: ef[:, kb * BK:(kb + 1) * BK], False))(xf)   # [M, N]
    best = jnp.min(dist, axis=1, keepdims=True)
    return jnp.min(jnp.where(dist == best, jnp.arange(N, dtype=jnp.int32)[None, :], N), axis=1)
