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

from kernels_pallas import backend, twin_grad
from kernels_pallas import twin_math as tm
from kernels_pallas.contract.grad import GradBlocks
from kernels_pallas.contract.norm import (
    TWIN_NORM_WARPS,
    TWIN_SPLIT_GROUP,
    NormBlocks,
    check_eps,
    check_norm_grad,
    check_norm_params,
    check_twin_norm,
    twin_norm_unroll,
)
from kernels_pallas.contract.numerics import TWIN_MMA_ROWS, check_launch, check_twin_dtype, twin_lanes


def row_sum(load, D, BK, unroll, tree=tm.tree_sum):
    """S(.) of the contract: lanes over the D / BK blocks in order from +0, then the tree;
    load(kb) -> [BM, BK] (kb may be traced); returns [BM, 1].

    unroll: blocks written out per loop iteration (`contract.norm.twin_norm_unroll`); their loads are
    independent and go out together, where a loop of one block waits for each in turn (22 us a
    norm of one row on an H200). tree: `tm.tree_sum`, or a kernel's own way to the same sums (the
    Mosaic GPU norm's through shared memory, its lanes spread over threads).
    """
    nkb = D // BK
    acc = jnp.zeros_like(load(0))  # (its shape; the load itself is dead code)

    def blocks(i, acc):
        for j in range(unroll):
            acc = acc + load(i * unroll + j)
        return acc

    acc = blocks(0, acc) if unroll == nkb else lax.fori_loop(0, nkb // unroll, blocks, acc)
    return tree(acc)


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


def row_stats(load_x, D, BK, kind, eps, gpu, unroll=None, tree=tm.tree_sum):
    """The contract's per-row statistics, (r,) for rms or (mean, r) for layer, each [BM, 1];
    load_x(kb) -> float32 [BM, BK], block kb of the rows (kb is traced when unroll < D / BK;
    twin_linear's fused norm calls this too); unroll, tree: see `row_sum` (None: all blocks)."""
    unroll = D // BK if unroll is None else unroll
    f32 = tm.F32
    inv_d = f32(1.0 / D)
    if kind == "rms":
        return (_rms_r(row_sum(lambda kb: tm.mul(load_x(kb), load_x(kb), gpu), D, BK, unroll, tree), D, eps, gpu),)
    mean = tm.mul(row_sum(load_x, D, BK, unroll, tree), inv_d, gpu)

    def centered_sq(kb):
        c = load_x(kb) - mean
        return tm.mul(c, c, gpu)

    var = tm.mul(row_sum(centered_sq, D, BK, unroll, tree), inv_d, gpu)
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
    int32 scalar), or [D] with layer=None; bias only for kind="layer" (refused for "rms"); eps: a float
    >= 0; num_warps: a power of two in 1..32 (speed only). Returns x's shape and dtype.

    Differentiable (`jax.custom_vjp`: `norm_grad` and `twin_grad.batch_sum`, `contract.grad`)
    in x, weight and bias; the layer index has no cotangent."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    check_twin_norm(x, weight, bias, kind)
    check_eps("norm(eps)", eps)
    check_launch("norm", num_warps)
    return _norm_vjp(x, weight, bias, tm.layer_index("norm", layer, weight.shape[0]), (kind, eps, block_m, num_warps, interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _norm_vjp(x, weight, bias, layer, opts):
    kind, eps, block_m, num_warps, interpret = opts
    return _norm(x, weight, bias, layer, kind=kind, eps=eps, block_m=block_m, num_warps=num_warps, interpret=interpret)


def _norm_fwd(x, weight, bias, layer, opts):
    return _norm_vjp(x, weight, bias, layer, opts), (x, weight, bias, layer)


@twin_grad.first_order("norm")
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
    """`norm`'s kernel, not differentiated; its Mosaic GPU twin's where that runs (`kernels_pallas.backend`:
    rows of a multiple of 128 features, spread over a warpgroup)."""
    weight, bias, layer = _stacked(weight, bias, layer)
    M, D = check_twin_norm(x, weight, bias, kind)
    BK = twin_lanes(D)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if backend.on_mosaic() and D % 128 == 0:
        from kernels_pallas import twin_norm_mgpu

        return twin_norm_mgpu.norm(x, weight, bias, layer, kind=kind, eps=eps, interpret=interpret)
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
    )(jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(x, ((0, Mp - M), (0, 0))), weight, _bias_operand(weight, bias))
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
    traced), or [D] with layer=None. The bits of a linear's `split=` epilogue on output rows x.

    Differentiable (`jax.custom_vjp`: `split_grad` and `twin_grad.batch_sum`, `contract.grad`) in x
    and weight; the layer index has no cotangent."""
    weight, _, layer = _stacked(weight, None, layer)
    _, D = check_twin_norm(x, weight, None, "rms")
    if D % TWIN_SPLIT_GROUP:
        raise ValueError(f"split(x): D={D} must be a multiple of {TWIN_SPLIT_GROUP}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _split_vjp(interpret, x, weight, tm.layer_index("split", layer, weight.shape[0]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _split_vjp(interpret, x, weight, layer):
    return _split(x, weight, layer, interpret)


def _split_fwd(interpret, x, weight, layer):
    return _split_vjp(interpret, x, weight, layer), (x, weight, layer)


@twin_grad.first_order("split")
def _split_bwd(interpret, saved, cotangents):
    x, weight, layer = saved
    du, dss = cotangents
    dx, ta = split_grad(x, du, dss, weight, layer, interpret=interpret)
    return dx, twin_grad.stacked(weight, twin_grad.batch_sum(ta, weight.dtype, interpret=interpret), layer), None


_split_vjp.defvjp(_split_fwd, _split_bwd)


def _split(x, weight, layer, interpret: bool):
    """`split`'s kernel (its arguments checked), not differentiated; its Mosaic GPU twin's where
    `kernels_pallas.backend` says so."""
    if backend.on_mosaic():
        from kernels_pallas import twin_norm_mgpu

        return twin_norm_mgpu.split(x, weight, layer, interpret=interpret)
    M, D = x.shape
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
    return kernel(layer, x, weight)


def split_native(x, weight, layer=None, **_):
    """The plain jax.numpy reference of `split`: the same signature and bits, without Pallas."""
    weight, _, layer = _stacked(weight, None, layer)
    M, D = check_twin_norm(x, weight, None, "rms")
    xf = x.astype(tm.F32)
    alpha = lax.dynamic_index_in_dim(weight, layer, keepdims=False).astype(tm.F32)[None, :]
    ss = tm.tree_sum(tm.mul(xf, xf, False).reshape(M, D // TWIN_SPLIT_GROUP, TWIN_SPLIT_GROUP))[..., 0]
    return tm.to_dtype(tm.mul(xf, alpha, False), x.dtype), ss


def _stacked(weight, bias, layer):
    """[D] weights (layer=None) as a one-layer stack."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    return weight, bias, layer


def _bias_operand(weight, bias):
    """The bias a norm kernel takes: RMSNorm's none (refused by the checks) becomes the weight, unread."""
    return weight if bias is None else bias


def norm_native(x, weight, bias=None, layer=None, *, kind: str = "rms", eps: float, **_):
    """The plain jax.numpy reference: the same signature and bits, without Pallas."""
    weight, bias, layer = _stacked(weight, bias, layer)
    M, D = check_twin_norm(x, weight, bias, kind)
    check_eps("norm(eps)", eps)
    BK = twin_lanes(D)
    xf = x.astype(tm.F32)
    blocks = xf.reshape(M, D // BK, BK)
    stats = row_stats(lambda kb: lax.dynamic_index_in_dim(blocks, kb, axis=1, keepdims=False), D, BK, kind, eps,
                   False)
    w = lax.dynamic_index_in_dim(weight, layer, keepdims=False).astype(tm.F32)[None, :]
    b = lax.dynamic_index_in_dim(_bias_operand(weight, bias), layer, keepdims=False).astype(tm.F32)[None, :]
    return tm.to_dtype(normalize(xf, w, b, stats, kind, False), x.dtype)


# ------------------------------------------------------------------------ the norm's derivative
# (`contract.grad`; its weights' sums over the batch: `twin_grad.batch_sum`)
def norm_grad_rows(load_x, load_dy, load_w, D, BK, kind, eps, gpu, unroll=None, tree=tm.tree_sum):
    """The norm's derivative (`contract.grad`) of rows given block loaders (kb -> float32 [BM, BK];
    load_w: the weight's block [1, BK]): (dx(kb), tw(kb)), functions of the block, float32. tree: as
    `row_sum`'s."""
    unroll = D // BK if unroll is None else unroll
    inv_d = tm.F32(1.0 / D)
    stats = row_stats(load_x, D, BK, kind, eps, gpu, unroll, tree)

    def g(kb):
        return tm.mul(load_dy(kb), load_w(kb), gpu)

    if kind == "rms":
        (r,) = stats
        s = row_sum(lambda kb: tm.mul(g(kb), load_x(kb), gpu), D, BK, unroll, tree)
        c = tm.mul(tm.mul(s, inv_d, gpu), tm.mul(tm.mul(r, r, gpu), r, gpu), gpu)
        return (lambda kb: tm.mul(g(kb), r, gpu) - tm.mul(load_x(kb), c, gpu),
                lambda kb: tm.mul(load_dy(kb), tm.mul(load_x(kb), r, gpu), gpu))
    mean, r = stats

    def xhat(kb):
        return tm.mul(load_x(kb) - mean, r, gpu)

    mg = tm.mul(row_sum(g, D, BK, unroll, tree), inv_d, gpu)
    mgx = tm.mul(row_sum(lambda kb: tm.mul(g(kb), xhat(kb), gpu), D, BK, unroll, tree), inv_d, gpu)
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


def norm_grad(x: jax.Array, dy: jax.Array, weight: jax.Array, bias: jax.Array | None = None, layer=None, *,
              kind: str = "rms", eps: float, block_m: int | None = None, interpret: bool | None = None):
    """The twin norm's derivative (`contract.grad`): x, dy [M, D] in one dtype; weight, bias [L, D] at
    `layer` (int or traced), or [D] with layer=None (the bias is not read: the derivative does not
    depend on it). Returns (dx [M, D] in x's dtype, tw float32 [M, D]: the weight's per-row terms,
    for `batch_sum`). On Mosaic GPU where `kernels_pallas.backend` says so and D is a multiple of 128
    (`twin_norm_mgpu.norm_grad`)."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    M, D = check_norm_grad(x, dy, weight, bias, kind, eps)
    BK = twin_lanes(D)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if backend.on_mosaic() and D % 128 == 0:
        from kernels_pallas import twin_norm_mgpu

        return twin_norm_mgpu.norm_grad(x, dy, weight, bias, layer, kind=kind, eps=eps, interpret=interpret)
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
    M, D = check_norm_grad(x, dy, weight, bias, kind, eps)
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


# ------------------------------------------------------------------ the split RMSNorm's derivative
# (`contract.grad`): the producer's half (`split_grad`: the cotangents of u and ss into y's, and alpha's
# per-row terms) and the consumer's (`split_rms_grad`: the cotangent of the scaled operand r * u into
# u's and ss's, and the operand itself for the weights' gradient)
def split_grad_math(y, du, dss, alpha, dy, gpu):
    """`contract.grad`'s producer half on float32 tiles: y, du, dy (or None) [BM, n]; dss [BM, 1] or
    [BM, n] (the group's); alpha [1, n]. Returns (dx float32, ta float32), both [BM, n]."""
    dx = tm.mul(du, alpha, gpu) + tm.mul(y + y, dss, gpu)
    return (dx if dy is None else dy + dx), tm.mul(du, y, gpu)


def _split_grad_kernel(row_ref, y_ref, du_ref, dss_ref, alpha_ref, *refs, has_dy, gpu):
    """Program (i, j): rows block i, columns j*BN.. of y, one group of TWIN_SPLIT_GROUP columns at a time
    (its dss a column of the dss block)."""
    dy_ref, dx_ref, ta_ref = refs if has_dy else (None, *refs)
    G, BN = TWIN_SPLIT_GROUP, y_ref.shape[1]
    n0 = pl.program_id(1) * BN
    for j in range(BN // G):
        cols = pl.ds(j * G, G)
        alpha = alpha_ref[row_ref[0], pl.ds(n0 + j * G, G)].astype(tm.F32)[None, :]
        dx, ta = split_grad_math(y_ref[:, cols].astype(tm.F32), du_ref[:, cols].astype(tm.F32),
                                 dss_ref[:, pl.ds(j, 1)], alpha, None if dy_ref is None else
                                 dy_ref[:, cols].astype(tm.F32), gpu)
        dx_ref[:, cols] = tm.to_dtype(dx, dx_ref.dtype)
        ta_ref[:, cols] = ta


def check_split_grad(y, du, dss, weight, dy):
    """(M, N) of a split_grad call, checked: y, du (and dy) [M, N] of one dtype, one the twins compute on
    (`numerics.check_twin_dtype`), dss float32 [M, N / G], weight [L, N]."""
    check_twin_dtype("split_grad", "y", y)
    if len(y.shape) != 2 or y.shape[1] % TWIN_SPLIT_GROUP:
        raise ValueError(f"split_grad(y): expected [M, N] with N a multiple of {TWIN_SPLIT_GROUP}, got shape "
                         f"{tuple(y.shape)}")
    M, N = y.shape
    for name, t in (("du", du), ("dy", dy)):
        if t is not None and (tuple(t.shape) != (M, N) or str(t.dtype) != str(y.dtype)):
            raise ValueError(f"split_grad({name}): expected {y.dtype} [{M}, {N}], got {t.dtype} {tuple(t.shape)}")
    if tuple(dss.shape) != (M, N // TWIN_SPLIT_GROUP) or "float32" not in str(dss.dtype):
        raise ValueError(f"split_grad(dss): expected float32 [{M}, {N // TWIN_SPLIT_GROUP}], got {dss.dtype} "
                         f"{tuple(dss.shape)}")
    check_norm_params("rms", weight, None, N, "split_grad({})")
    return M, N


def split_grad(y: jax.Array, du: jax.Array, dss: jax.Array, weight: jax.Array, layer=None, *,
               dy: jax.Array | None = None, interpret: bool | None = None):
    """The derivative of the split norm's producer half (`contract.grad`): y [M, N] the rows it split
    (a linear's output, or `split`'s x); du [M, N] (y's dtype) and dss float32 [M, N / TWIN_SPLIT_GROUP]:
    the cotangents of u and ss; weight: alpha [L, N] at `layer` (int or traced), or [N] with layer=None;
    dy: y's own cotangent [M, N] or None. Returns (dx [M, N] in y's dtype: y's whole cotangent,
    ta float32 [M, N]: alpha's per-row terms, for `twin_grad.batch_sum`). On Mosaic GPU where
    `kernels_pallas.backend` says so and N is a multiple of 128 (`twin_norm_mgpu.split_grad`)."""
    if layer is None:
        weight, layer = weight[None], 0
    M, N = check_split_grad(y, du, dss, weight, dy)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if backend.on_mosaic() and N % 128 == 0:
        from kernels_pallas import twin_norm_mgpu

        return twin_norm_mgpu.split_grad(y, du, dss, weight, layer, dy=dy, interpret=interpret)
    blocks = GradBlocks.for_shapes(M, N, interpret)
    BM, BN, G = blocks.block_m, blocks.block_n, TWIN_SPLIT_GROUP
    Mp = -(-M // BM) * BM
    pad = ((0, Mp - M), (0, 0))
    tile = pl.BlockSpec((BM, BN), lambda i, j: (i, j))
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(y, pad), jnp.pad(du, pad), jnp.pad(dss, pad), weight]
    in_specs = [pl.BlockSpec((1,), lambda i, j: (0,)), tile, tile, pl.BlockSpec((BM, BN // G), lambda i, j: (i, j)),
                pl.BlockSpec(weight.shape, lambda i, j: (0, 0))]
    if dy is not None:
        operands.append(jnp.pad(dy, pad))
        in_specs.append(tile)
    dx, ta = pl.pallas_call(
        functools.partial(_split_grad_kernel, has_dy=dy is not None, gpu=not interpret),
        out_shape=(jax.ShapeDtypeStruct((Mp, N), y.dtype), jax.ShapeDtypeStruct((Mp, N), tm.F32)),
        grid=(Mp // BM, N // BN),
        in_specs=in_specs,
        out_specs=(tile, tile),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="twin_rms_split_grad",
    )(*operands)
    return dx[:M], ta[:M]


def split_grad_native(y, du, dss, weight, layer=None, *, dy=None, **_):
    """The plain jax.numpy reference of `split_grad`: the same signature and bits, without Pallas."""
    if layer is None:
        weight, layer = weight[None], 0
    check_split_grad(y, du, dss, weight, dy)
    alpha = lax.dynamic_index_in_dim(weight, layer, keepdims=False).astype(tm.F32)[None, :]
    dss = jnp.repeat(dss, TWIN_SPLIT_GROUP, axis=1)
    dx, ta = split_grad_math(y.astype(tm.F32), du.astype(tm.F32), dss, alpha,
                             None if dy is None else dy.astype(tm.F32), False)
    return tm.to_dtype(dx, y.dtype), ta


def split_rms_grad_rows(load_u, load_dxn, ss, K, BK, eps, gpu, unroll=None, tree=tm.tree_sum):
    """`contract.grad`'s consumer half of rows given block loaders (kb -> float32 [BM, BK]) and their
    partial sums ss float32 [BM, K / TWIN_SPLIT_GROUP]: (xn(kb), du(kb), dss [BM, 1]), float32. tree: as
    `row_sum`'s, for the sums over the blocks' lanes and over ss's groups (ss as it takes them)."""
    unroll = K // BK if unroll is None else unroll
    r = _rms_r(tree(ss), K, eps, gpu)                                          # the forward's (`split_r`)
    s = row_sum(lambda kb: tm.mul(load_dxn(kb), load_u(kb), gpu), K, BK, unroll, tree)
    c = tm.mul(tm.mul(s, tm.F32(1.0 / K), gpu), tm.mul(tm.mul(r, r, gpu), r, gpu), gpu)
    return (lambda kb: tm.mul(load_u(kb), r, gpu), lambda kb: tm.mul(load_dxn(kb), r, gpu),
            tm.mul(c, tm.F32(-0.5), gpu))


def _split_rms_grad_kernel(u_ref, dxn_ref, ss_ref, xn_ref, du_ref, dss_ref, *, K, BK, eps, gpu):
    def loader(ref):
        return lambda kb: ref[:, pl.ds(kb * BK, BK)].astype(tm.F32)  # [BM, BK]

    xn, du, dss = split_rms_grad_rows(loader(u_ref), loader(dxn_ref), ss_ref[...], K, BK, eps, gpu,
                                      twin_norm_unroll(K // BK, u_ref.shape[0]))
    outs = [(tm.to_dtype(xn(kb), xn_ref.dtype), tm.to_dtype(du(kb), du_ref.dtype)) for kb in range(K // BK)]
    dss_ref[...] = jnp.broadcast_to(dss, dss_ref.shape)
    for kb, (a, b) in enumerate(outs):  # every block before a store
        xn_ref[:, pl.ds(kb * BK, BK)] = a
        du_ref[:, pl.ds(kb * BK, BK)] = b


def check_split_rms_grad(u, dxn, ss):
    """(M, K) of a split_rms_grad call, checked: u, dxn [M, K] of one dtype, one the twins compute on
    (`numerics.check_twin_dtype`), ss float32 [M, K / G] with a power-of-two count of groups."""
    check_twin_dtype("split_rms_grad", "u", u)
    if len(u.shape) != 2:
        raise ValueError(f"split_rms_grad(u): expected [M, K], got shape {tuple(u.shape)}")
    M, K = u.shape
    if tuple(dxn.shape) != (M, K) or str(dxn.dtype) != str(u.dtype):
        raise ValueError(f"split_rms_grad(dxn): expected {u.dtype} [{M}, {K}], got {dxn.dtype} {tuple(dxn.shape)}")
    G = K // TWIN_SPLIT_GROUP
    if K % TWIN_SPLIT_GROUP or G & (G - 1) or tuple(ss.shape) != (M, G) or "float32" not in str(ss.dtype):
        raise ValueError(f"split_rms_grad(ss): expected float32 [M={M}, K/{TWIN_SPLIT_GROUP}] with a power-of-two "
                         f"count of groups, got {ss.dtype} {tuple(ss.shape)} (K={K})")
    return M, K


def split_rms_grad(u: jax.Array, dxn: jax.Array, ss: jax.Array, *, eps: float, block_m: int | None = None,
                   interpret: bool | None = None):
    """The derivative of the split norm's consumer half (`contract.grad`): u [M, K], the consumer's x;
    dxn [M, K] in u's dtype: the cotangent of its scaled operand r * u; ss float32 [M, K / G] and eps:
    its `TwinRms`. Returns (xn [M, K]: to_dtype(r * u), the operand for the weights' gradient; du [M, K]:
    u's cotangent, both in u's dtype; dss float32 [M, K / G]: ss's cotangent). On Mosaic GPU where
    `kernels_pallas.backend` says so and K is a multiple of 128 (`twin_norm_mgpu.split_rms_grad`)."""
    M, K = check_split_rms_grad(u, dxn, ss)
    BK = twin_lanes(K)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if backend.on_mosaic() and K % 128 == 0 and K // TWIN_SPLIT_GROUP <= 128:
        from kernels_pallas import twin_norm_mgpu

        return twin_norm_mgpu.split_rms_grad(u, dxn, ss, eps=eps, interpret=interpret)
    BM = NormBlocks.for_shapes(M, K, block_m, interpret).block_m
    Mp = -(-M // BM) * BM
    pad = ((0, Mp - M), (0, 0))
    rows = pl.BlockSpec((BM, K), lambda i: (i, 0))
    groups = pl.BlockSpec((BM, ss.shape[1]), lambda i: (i, 0))
    xn, du, dss = pl.pallas_call(
        functools.partial(_split_rms_grad_kernel, K=K, BK=BK, eps=eps, gpu=not interpret),
        out_shape=(jax.ShapeDtypeStruct((Mp, K), u.dtype), jax.ShapeDtypeStruct((Mp, K), u.dtype),
                   jax.ShapeDtypeStruct((Mp, ss.shape[1]), tm.F32)),
        grid=(Mp // BM,),
        in_specs=[rows, rows, groups],
        out_specs=(rows, rows, groups),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=TWIN_NORM_WARPS, num_stages=2),
        name="twin_rms_split_rms_grad",
    )(jnp.pad(u, pad), jnp.pad(dxn, pad), jnp.pad(ss, pad, constant_values=1.0))  # padded rows: r finite
    return xn[:M], du[:M], dss[:M]


def split_rms_grad_native(u, dxn, ss, *, eps: float, **_):
    """The plain jax.numpy reference of `split_rms_grad`: the same signature and bits, without Pallas."""
    M, K = check_split_rms_grad(u, dxn, ss)
    BK = twin_lanes(K)

    def loader(a):
        blocks = a.astype(tm.F32).reshape(M, K // BK, BK)
        return lambda kb: lax.dynamic_index_in_dim(blocks, kb, axis=1, keepdims=False)

    xn, du, dss = split_rms_grad_rows(loader(u), loader(dxn), ss, K, BK, eps, False)
    nkb = K // BK
    return (tm.to_dtype(jnp.concatenate([xn(kb) for kb in range(nkb)], axis=1), u.dtype),
            tm.to_dtype(jnp.concatenate([du(kb) for kb in range(nkb)], axis=1), u.dtype),
            jnp.broadcast_to(dss, ss.shape))


__all__ = ["norm", "norm_grad", "norm_grad_native", "norm_native", "split", "split_grad", "split_grad_native",
           "split_native", "split_rms_grad", "split_rms_grad_native"]
