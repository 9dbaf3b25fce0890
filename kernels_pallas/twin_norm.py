"""Batch-invariant RMSNorm (Helium) and LayerNorm (Mimi) as a Pallas kernel; Triton twin in
`kernels_triton.twin_norm`, plain reference `norm_native` beside it.

Contract (beside `twin_math`'s), per row x [D] in float32, with sums S(.) over D taken as
`twin_linear` takes them (BK = `contract.numerics.twin_lanes(D)` lanes, sequential over the D / BK blocks,
then `tree_sum`):

    rms:   var = eps + S(x * x) * inv_D;           y = to_dtype(x * (weight * (1 / sqrt(var))))
    layer: mean = S(x) * inv_D;  c = x - mean;  var = S(c * c) * inv_D
           y = to_dtype((c * (1 / sqrt(var + eps))) * weight + bias)

with inv_D = float32(1 / D) computed on the host (a product: compilers rewrite a division by a
constant into one, differently on each backend).

Each row on its own: its bits do not depend on the batch. The weights are read in place from
the stacked [L, D] buffers at a layer index that may be traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import twin_grad
from kernels_pallas import twin_math as tm
from kernels_pallas.contract.norm import (
    TWIN_NORM_WARPS,
    TWIN_SPLIT_GROUP,
    NormBlocks,
    check_twin_norm,
    twin_norm_unroll,
)
from kernels_pallas.contract.numerics import TWIN_MMA_ROWS, twin_lanes


def row_sum(load, D, BK, unroll):
    """S(.) of the contract: lanes over the D / BK blocks in order from +0, then the tree;
    load(kb) -> [BM, BK] (kb may be traced); returns [BM, 1].

    unroll: blocks written out per loop iteration (`contract.norm.twin_norm_unroll`); their loads are
    independent and go out together, where a loop of one block waits for each in turn (22 us a
    norm of one row on an H200).
    """
    nkb = D // BK
    acc = jnp.zeros_like(load(0))  # (its shape; the load itself is dead code)

    def blocks(i, acc):
        for j in range(unroll):
            acc = acc + load(i * unroll + j)
        return acc

    acc = blocks(0, acc) if unroll == nkb else lax.fori_loop(0, nkb // unroll, blocks, acc)
    return tm.tree_sum(acc)


def _rms_r(ss, D, eps, gpu):
    """The RMSNorm's r = 1 / sqrt(eps + ss * inv_D) from a row's sum of squares ss (the contract's)."""
    var = tm.F32(eps) + tm.mul(ss, tm.F32(1.0 / D), gpu)
    return tm.div(tm.F32(1.0), tm.sqrt(var, gpu), gpu)


def normalize(xf, w, b, stats, kind, gpu):
    """The contract's normalized rows: xf [BM, n] float32, w, b [1, n], stats of `row_stats` ([BM, 1] each)."""
    if kind == "rms":
        (r,) = stats
        return tm.mul(xf, tm.mul(w, r, gpu), gpu)
    mean, r = stats
    return tm.mul(tm.mul(xf - mean, r, gpu), w, gpu) + b


def row_stats(load_x, D, BK, kind, eps, gpu, unroll=None):
    """The contract's per-row statistics, (r,) for rms or (mean, r) for layer, each [BM, 1];
    load_x(kb) -> float32 [BM, BK], block kb of the rows (kb is traced when unroll < D / BK;
    twin_linear's fused norm calls this too); unroll: see `row_sum` (None: all blocks)."""
    unroll = D // BK if unroll is None else unroll
    f32 = tm.F32
    inv_d = f32(1.0 / D)
    if kind == "rms":
        return (_rms_r(row_sum(lambda kb: tm.mul(load_x(kb), load_x(kb), gpu), D, BK, unroll), D, eps, gpu),)
    mean = tm.mul(row_sum(load_x, D, BK, unroll), inv_d, gpu)

    def centered_sq(kb):
        c = load_x(kb) - mean
        return tm.mul(c, c, gpu)

    var = tm.mul(row_sum(centered_sq, D, BK, unroll), inv_d, gpu)
    return mean, tm.div(f32(1.0), tm.sqrt(var + f32(eps), gpu), gpu)


def _kernel(layer_ref, x_ref, w_ref, b_ref, o_ref, *, D, BK, kind, eps, gpu):
    layer = layer_ref[0]

    def load_x(kb):
        return x_ref[:, pl.ds(kb * BK, BK)].astype(tm.F32)  # [BM, BK]

    stats = row_stats(load_x, D, BK, kind, eps, gpu, twin_norm_unroll(D // BK, x_ref.shape[0]))

    ys = []  # written out; every block computed before the first store: a load after a store waits
    for kb in range(D // BK):  # for it (the refs may alias), and the blocks then went one at a time
        cols = pl.ds(kb * BK, BK)
        w = w_ref[layer, cols].astype(tm.F32)[None, :]
        b = b_ref[layer, cols].astype(tm.F32)[None, :]
        ys.append(tm.to_dtype(normalize(load_x(kb), w, b, stats, kind, gpu), o_ref.dtype))
    for kb, y in enumerate(ys):
        o_ref[:, pl.ds(kb * BK, BK)] = y


def norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, layer=None, *, kind: str = "rms",
         eps: float, block_m: int | None = None, num_warps: int = TWIN_NORM_WARPS, interpret: bool | None = None) -> jax.Array:
    """The contract's norm of each row of x [M, D]; weight, bias [L, D] at `layer` (int or traced
    int32 scalar), or [D] with layer=None; bias only for kind="layer". Returns x's shape and dtype.

    Differentiable (`jax.custom_vjp`: `norm_grad` and `twin_grad.batch_sum`, `contract.grad`)
    in x, weight and bias; the layer index has no cotangent."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    check_twin_norm(x, weight, bias, kind)
    return _norm_vjp(x, weight, bias, jnp.asarray(layer, jnp.int32), (kind, eps, block_m, num_warps, interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm_vjp(x, weight, bias, layer, opts):
    kind, eps, block_m, num_warps, interpret = opts
    return _norm(x, weight, bias, layer, kind=kind, eps=eps, block_m=block_m, num_warps=num_warps, interpret=interpret)


def _norm_fwd(x, weight, bias, layer, opts):
    return _norm_vjp(x, weight, bias, layer, opts), (x, weight, bias, layer)


def _norm_bwd(opts, saved, dy):
    x, weight, bias, layer = saved
    kind, eps, block_m, _, interpret = opts
    dx, tw = norm_grad(x, dy, weight, bias, layer, kind=kind, eps=eps, block_m=block_m, interpret=interpret)
    dw = twin_grad.stacked(weight, twin_grad.batch_sum(tw, weight.dtype, interpret=interpret), layer)
    db = None if bias is None else twin_grad.stacked(bias, twin_grad.batch_sum(dy, bias.dtype, interpret=interpret),
                                                     layer)
    return dx, dw, db, None


_norm_vjp.defvjp(_norm_fwd, _norm_bwd)


def _norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None, layer, *, kind: str, eps: float,
          block_m: int | None, num_warps: int, interpret: bool | None) -> jax.Array:
    """`norm`'s kernel, not differentiated."""
    weight, bias, layer = _stacked(weight, bias, layer, kind)
    M, D = check_twin_norm(x, weight, bias, kind)
    BK = twin_lanes(D)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    BM = NormBlocks.for_shapes(M, D, block_m, interpret).block_m
    Mp = -(-M // BM) * BM
    rows = pl.BlockSpec((BM, D), lambda i: (i, 0))
    whole = pl.BlockSpec(weight.shape, lambda i: (0, 0))
    out = pl.pallas_call(
        functools.partial(_kernel, D=D, BK=BK, kind=kind, eps=eps, gpu=not interpret),
        out_shape=jax.ShapeDtypeStruct((Mp, D), x.dtype),
        grid=(Mp // BM,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), rows, whole, whole],
        out_specs=rows,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        name=f"twin_{kind}_norm",
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(x, ((0, Mp - M), (0, 0))), weight, bias)
    return out[:M]


# ------------------------------------------------------------------------------- the split RMSNorm
# (`contract.norm.TwinSplit`): the producer's and the consumer's halves, which the MMA linears run in their
# epilogue and before it, and `split`, the producer's half on its own (a step's first norm).
def split_r(ss_ref, rows, ok, K, eps, gpu):
    """r [R, 1] of the split norm (`contract.norm.TwinSplit`) from the partial sums ss [M, K/G] of the
    rows [R, 1]."""
    G = K // TWIN_SPLIT_GROUP
    ss = pltriton.load(ss_ref.at[rows, jnp.arange(G, dtype=jnp.int32)[None, :]],
                       mask=jnp.broadcast_to(ok, (rows.shape[0], G)), other=jnp.zeros((), tm.F32))
    return _rms_r(tm.tree_sum(ss), K, eps, gpu)


def split_store(y, alpha_ref, split_layer, n0, m, ok, u_ref, ss_ref, gpu):
    """The producer's half of the split norm (`contract.norm.TwinSplit`) for its output tile y [R, BN] at
    columns n0.. (BN = TWIN_SPLIT_GROUP: one partial sum a program and row)."""
    yf = y.astype(tm.F32)
    BN = y.shape[1]
    alpha = alpha_ref[split_layer, pl.ds(n0, BN)].astype(tm.F32)[None, :]
    cols = n0 + jnp.arange(BN, dtype=jnp.int32)[None, :]
    pltriton.store(u_ref.at[m[:, None], cols], tm.to_dtype(tm.mul(yf, alpha, gpu), u_ref.dtype),
                   mask=jnp.broadcast_to(ok, y.shape))
    group = jnp.full((1, 1), n0 // TWIN_SPLIT_GROUP, jnp.int32)
    pltriton.store(ss_ref.at[m[:, None], group], tm.tree_sum(tm.mul(yf, yf, gpu)), mask=ok)


def _split_kernel(layer_ref, x_ref, w_ref, u_ref, ss_ref, *, M, gpu):
    n0 = pl.program_id(1) * TWIN_SPLIT_GROUP
    m = pl.program_id(0) * TWIN_MMA_ROWS + jnp.arange(TWIN_MMA_ROWS, dtype=jnp.int32)
    ok = (m < M)[:, None]
    cols = n0 + jnp.arange(TWIN_SPLIT_GROUP, dtype=jnp.int32)[None, :]
    x = pltriton.load(x_ref.at[jnp.minimum(m, M - 1)[:, None], cols],
                      mask=jnp.broadcast_to(ok, (TWIN_MMA_ROWS, TWIN_SPLIT_GROUP)), other=jnp.zeros((), x_ref.dtype))
    split_store(x, w_ref, layer_ref[0], n0, m, ok, u_ref, ss_ref, gpu)


def split(x: jax.Array, weight: jax.Array, layer=None, *, interpret: bool | None = None):
    """The producer's half of the split RMSNorm (`contract.norm.TwinSplit`) of x [M, D] itself: (u [M, D] in
    x's dtype, ss float32 [M, D / TWIN_SPLIT_GROUP]); weight: alpha [L, D] at `layer` (int or
    traced), or [D] with layer=None. The bits of a linear's `split=` epilogue on output rows x."""
    weight, _, layer = _stacked(weight, None, layer, "rms")
    M, D = check_twin_norm(x, weight, None, "rms")
    if D % TWIN_SPLIT_GROUP:
        raise ValueError(f"split(x): D={D} must be a multiple of {TWIN_SPLIT_GROUP}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    outs = (jax.ShapeDtypeStruct((M, D), x.dtype), jax.ShapeDtypeStruct((M, D // TWIN_SPLIT_GROUP), jnp.float32))
    whole = [pl.BlockSpec(a.shape, lambda i, j: (0,) * 2) for a in (x, weight, *outs)]  # 2-D, read in place
    kernel = pl.pallas_call(
        functools.partial(_split_kernel, M=M, gpu=not interpret),
        out_shape=outs,
        grid=(-(-M // TWIN_MMA_ROWS), D // TWIN_SPLIT_GROUP),
        in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), *whole[:2]],
        out_specs=tuple(whole[2:]),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=TWIN_NORM_WARPS, num_stages=1),
        name="twin_rms_split",
    )
    return twin_grad.undifferentiated(kernel, "split", "the split RMSNorm")(layer, x, weight)


def split_native(x, weight, layer=None, **_):
    """The plain jax.numpy reference of `split`: the same signature and bits, without Pallas."""
    weight, _, layer = _stacked(weight, None, layer, "rms")
    M, D = check_twin_norm(x, weight, None, "rms")
    xf = x.astype(tm.F32)
    alpha = lax.dynamic_index_in_dim(weight, layer, keepdims=False).astype(tm.F32)[None, :]
    ss = tm.tree_sum(tm.mul(xf, xf, False).reshape(M, D // TWIN_SPLIT_GROUP, TWIN_SPLIT_GROUP))[..., 0]
    return tm.to_dtype(tm.mul(xf, alpha, False), x.dtype), ss


def _stacked(weight, bias, layer, kind):
    """[D] weights (layer=None) as a one-layer stack; RMSNorm gets a zero bias it never reads."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    if kind == "rms" and bias is None:
        bias = weight  # unread: the rms kernel adds no bias
    return weight, bias, layer


def norm_native(x, weight, bias=None, layer=None, *, kind: str = "rms", eps: float, **_):
    """The plain jax.numpy reference: the same signature and bits, without Pallas."""
    weight, bias, layer = _stacked(weight, bias, layer, kind)
    M, D = check_twin_norm(x, weight, bias, kind)
    BK = twin_lanes(D)
    xf = x.astype(tm.F32)
    blocks = xf.reshape(M, D // BK, BK)
    stats = row_stats(lambda kb: lax.dynamic_index_in_dim(blocks, kb, axis=1, keepdims=False), D, BK, kind, eps,
                   False)
    w = lax.dynamic_index_in_dim(weight, layer, keepdims=False).astype(tm.F32)[None, :]
    b = lax.dynamic_index_in_dim(bias, layer, keepdims=False).astype(tm.F32)[None, :]
    return tm.to_dtype(normalize(xf, w, b, stats, kind, False), x.dtype)


# ------------------------------------------------------------------------ the norm's derivative
# (`contract.grad`; its weights' sums over the batch: `twin_grad.batch_sum`)
def norm_grad_rows(load_x, load_dy, load_w, D, BK, kind, eps, gpu, unroll=None):
    """The norm's derivative (`contract.grad`) of rows given block loaders (kb -> float32 [BM, BK];
    load_w: the weight's block [1, BK]): (dx(kb), tw(kb)), functions of the block, float32."""
    unroll = D // BK if unroll is None else unroll
    inv_d = tm.F32(1.0 / D)
    stats = row_stats(load_x, D, BK, kind, eps, gpu, unroll)

    def g(kb):
        return tm.mul(load_dy(kb), load_w(kb), gpu)

    if kind == "rms":
        (r,) = stats
        s = row_sum(lambda kb: tm.mul(g(kb), load_x(kb), gpu), D, BK, unroll)
        c = tm.mul(tm.mul(s, inv_d, gpu), tm.mul(tm.mul(r, r, gpu), r, gpu), gpu)
        return (lambda kb: tm.mul(g(kb), r, gpu) - tm.mul(load_x(kb), c, gpu),
                lambda kb: tm.mul(load_dy(kb), tm.mul(load_x(kb), r, gpu), gpu))
    mean, r = stats

    def xhat(kb):
        return tm.mul(load_x(kb) - mean, r, gpu)

    mg = tm.mul(row_sum(g, D, BK, unroll), inv_d, gpu)
    mgx = tm.mul(row_sum(lambda kb: tm.mul(g(kb), xhat(kb), gpu), D, BK, unroll), inv_d, gpu)
    return (lambda kb: tm.mul(r, (g(kb) - mg) - tm.mul(xhat(kb), mgx, gpu), gpu),
            lambda kb: tm.mul(load_dy(kb), xhat(kb), gpu))


def _norm_kernel(layer_ref, x_ref, dy_ref, w_ref, dx_ref, tw_ref, *, D, BK, kind, eps, gpu):
    layer = layer_ref[0]

    def loader(ref):
        return lambda kb: ref[:, pl.ds(kb * BK, BK)].astype(tm.F32)  # [BM, BK]

    dx, tw = norm_grad_rows(loader(x_ref), loader(dy_ref), lambda kb: w_ref[layer, pl.ds(kb * BK, BK)].astype(tm.F32)[None, :],
                            D, BK, kind, eps, gpu, twin_norm_unroll(D // BK, x_ref.shape[0]))
    outs = [(tm.to_dtype(dx(kb), dx_ref.dtype), tw(kb)) for kb in range(D // BK)]  # every block before a store
    for kb, (a, b) in enumerate(outs):
        dx_ref[:, pl.ds(kb * BK, BK)] = a
        tw_ref[:, pl.ds(kb * BK, BK)] = b


def check_norm_grad(x, dy, weight, bias, kind):
    """(M, D) of a norm_grad call, checked: x, dy [M, D] of one dtype, the norm's weights."""
    M, D = check_twin_norm(x, weight, bias, kind)
    if tuple(dy.shape) != (M, D) or str(dy.dtype) != str(x.dtype):
        raise ValueError(f"norm_grad(dy): expected {x.dtype} [{M}, {D}], got {dy.dtype} {tuple(dy.shape)}")
    return M, D


def norm_grad(x: jax.Array, dy: jax.Array, weight: jax.Array, bias: jax.Array | None = None, layer=None, *,
              kind: str = "rms", eps: float, block_m: int | None = None, interpret: bool | None = None):
    """The twin norm's derivative (`contract.grad`): x, dy [M, D] in one dtype; weight, bias [L, D] at
    `layer` (int or traced), or [D] with layer=None (the bias is not read: the derivative does not
    depend on it). Returns (dx [M, D] in x's dtype, tw float32 [M, D]: the weight's per-row terms,
    for `batch_sum`)."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    M, D = check_norm_grad(x, dy, weight, bias, kind)
    BK = twin_lanes(D)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    BM = NormBlocks.for_shapes(M, D, block_m, interpret).block_m
    Mp = -(-M // BM) * BM
    pad = ((0, Mp - M), (0, 0))
    rows = pl.BlockSpec((BM, D), lambda i: (i, 0))
    dx, tw = pl.pallas_call(
        functools.partial(_norm_kernel, D=D, BK=BK, kind=kind, eps=eps, gpu=not interpret),
        out_shape=(jax.ShapeDtypeStruct((Mp, D), x.dtype), jax.ShapeDtypeStruct((Mp, D), tm.F32)),
        grid=(Mp // BM,),
        in_specs=[pl.BlockSpec((1,), lambda i: (0,)), rows, rows, pl.BlockSpec(weight.shape, lambda i: (0, 0))],
        out_specs=(rows, rows),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=TWIN_NORM_WARPS, num_stages=2),
        name=f"twin_{kind}_norm_grad",
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(x, pad), jnp.pad(dy, pad), weight)
    return dx[:M], tw[:M]


def norm_grad_native(x, dy, weight, bias=None, layer=None, *, kind: str = "rms", eps: float, **_):
    """The plain jax.numpy reference of `norm_grad`: the same signature and bits, without Pallas."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    M, D = check_norm_grad(x, dy, weight, bias, kind)
    BK = twin_lanes(D)
    w = lax.dynamic_index_in_dim(weight, layer, keepdims=False).astype(tm.F32).reshape(D // BK, BK)

    def loader(a):
        blocks = a.astype(tm.F32).reshape(M, D // BK, BK)
        return lambda kb: lax.dynamic_index_in_dim(blocks, kb, axis=1, keepdims=False)

    dx, tw = norm_grad_rows(loader(x), loader(dy), lambda kb: lax.dynamic_index_in_dim(w, kb, keepdims=True),
                            D, BK, kind, eps, False)
    nkb = D // BK
    return (tm.to_dtype(jnp.concatenate([dx(kb) for kb in range(nkb)], axis=1), x.dtype),
            jnp.concatenate([tw(kb) for kb in range(nkb)], axis=1))

__all__ = ["norm", "norm_grad", "norm_grad_native", "norm_native", "split", "split_native"]
