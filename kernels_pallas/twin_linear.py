"""Batch-invariant linear layer (x @ w[layer].T) as a Pallas kernel, with epilogues; Triton twin in
`kernels_triton.twin_linear`, plain reference `linear_native` beside it.

Contract (beside `twin_math`'s). Each output row is computed on its own, so its bits depend
neither on the batch nor on the tiles of M and N. The float32 accumulator of an output element
is one of two forms (`contract.linear.twin_linear_form`, a function of N, K, the dtype and the backend,
never of M; both twins pick the same):

* "lanes" (CUDA cores; every backend, the only form interpreted on the CPU): lane l holds the
  sequential float32 sum, over the K blocks in order, of its products x[m, kb*BK + l] *
  w[n, kb*BK + l] (`twin_math.mac`: each rounded, or fused where that gives the same bits);
  the BK lanes are then added by `tree_sum`. BK depends on K alone (`contract.linear.LinearBlocks`).
* "mma" (tensor cores; compiled for the GPU with 16-bit x and w): `acc += dot(w_block, x_block^T)`
  over the K blocks of BK = `twin_lanes(K)` in order, each block a float32-accumulating matrix
  product on the tensor cores in the hardware's own order, with 16, 32 or 64 rows of x a
  program (the MMA's n dimension, `contract.linear.twin_mma_rows`: speed only). There is no plain reference
  for these bits: on the H200 the Pallas and Triton kernels give the same bits at every tile and
  row count tried, with mma.sync and wgmma alike (benchmarks/RESULTS.md, "twin_tune_gpu"), and
  the GPU tests hold them to each other. They differ from the lane form's bits (another order),
  within float32 rounding.
  Each block's product accumulates into acc on the tensor cores (Triton's dot-add combine folds
  the add, on both twins with the H200's compilers). Starting each product from zero and adding
  it apart (`twin_math.mma_add`, as the attention does) took the choice from the compilers but
  cost 2-4% of the temporal step (RESULTS.md, "twin_tune_gpu"), so the linears keep the fold.

With `norm=TwinNorm(...)` the kernel multiplies the normalized rows instead of x: each program
computes its rows' statistics (`twin_norm.row_stats`, a pass over x) and normalizes each x block
as it loads it, rounded to x's dtype: the bits of `twin_norm.norm` then `linear`, one launch
instead of two. Where that does not pay (the lane form's programs of many rows,
`contract.linear.twin_fuse_norm`; the MMA form over many K blocks, `contract.linear.twin_mma_fuse_norm`), `linear`
runs the norm kernel first: the same bits. Then, in order (each step
rounded to x's dtype, as the reference rounds):

    y = to_dtype(acc)
    act="silu_gate" (N even): the kernel computes columns n and n + N/2 together and returns
        to_dtype(to_dtype(silu(y[:, :N/2])) * y[:, N/2:])               (Helium's gating)
    act="gelu":     y = to_dtype(gelu(y))                               (Mimi's MLP)
    scale [N]:      y = to_dtype(scale * y)                             (Mimi's layer scale)
    residual [M, N]: y = to_dtype(residual + y)

The weights are read in place from the stacked `w [L, N, K]` at a layer index that may be
traced (no per-layer copy under `lax.scan`); `layer=None` takes a plain `[N, K]`.

`linear_rope_write` is the attention's qkv projection with `twin_rope.rope_write`'s contract in
its epilogue (rotate q and k, write k and v into the ring; without cos and sin, no rotation: the
depformer's K/V cache write): one kernel in the MMA form, a linear then `rope_write` in the lane
form; the same bits as the two calls either way.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import backend, twin_grad, twin_norm, twin_rope
from kernels_pallas import twin_math as tm
from kernels_pallas.contract.linear import (
    LinearBlocks,
    MmaBlocks,
    check_native_linear,
    check_twin_linear,
    check_twin_qkv,
    mosaic_takes_linear,
    stack_one_layer,
    twin_fuse_norm,
    twin_linear_form,
    twin_mma_fuse_norm,
    twin_mma_rows,
    twin_mma_stages,
    twin_pallas_prefetch,
    twin_qkv_plan,
)
from kernels_pallas.contract.norm import (
    TWIN_SPLIT_GROUP,
    TwinNorm,
    TwinRms,
    TwinSplit,
    check_rms,
    check_twin_split,
    split_one_layer,
    twin_norm_unroll,
)
from kernels_pallas.contract.numerics import check_launch, twin_lanes


def add_residual(y, residual):
    """The epilogue's residual add: y and residual (in the output's dtype) summed in float32, rounded
    once to y's dtype. Exact work XLA does not reorder, so it gives the kernel's bits outside it too."""
    return tm.to_dtype(residual.astype(tm.F32) + y.astype(tm.F32), y.dtype)


def _epilogue(acc, dtype, act, scale, residual, gpu):
    """acc: float32 [..., N'] (silu_gate: a pair (a, b)) -> the output in dtype (module docstring)."""
    f32 = tm.F32
    if act == "silu_gate":
        a, b = (tm.to_dtype(t, dtype).astype(f32) for t in acc)
        y = tm.to_dtype(tm.mul(tm.to_dtype(tm.silu(a, gpu), dtype).astype(f32), b, gpu), dtype)
    else:
        y = tm.to_dtype(acc, dtype)
        if act == "gelu":
            y = tm.to_dtype(tm.gelu(y.astype(f32), gpu), dtype)
    if scale is not None:
        y = tm.to_dtype(tm.mul(scale.astype(f32), y.astype(f32), gpu), dtype)
    if residual is not None:
        y = add_residual(y, residual)
    return y


def _kernel(layer_ref, x_ref, w_ref, *refs, K, BN, BK, N_out, act, norm, eps, has_scale, has_res, fused,
            prefetch, gpu):
    """Program (i, j): rows block i, columns j*BN.. of the output (x_ref: [BM, K] rows block).

    The loop carries the weight tiles of the next `prefetch` blocks (`contract.linear.twin_pallas_prefetch`),
    each loaded `prefetch` iterations before it is used (a prefetch into registers): the kernel waits on
    memory latency, and this keeps loads in flight while it computes (the Triton twin pipelines its loop
    instead).
    """
    refs = list(refs)
    nw_ref, nb_ref = (refs.pop(0), refs.pop(0)) if norm else (None, None)
    scale_ref = refs.pop(0) if has_scale else None
    res_ref = refs.pop(0) if has_res else None
    (o_ref,) = refs
    layer = layer_ref[0]
    n0 = pl.program_id(1) * BN
    nkb = K // BK
    starts = (n0, n0 + N_out) if act == "silu_gate" else (n0,)

    def tiles(kb):  # the weight tiles [BN, BK] of block kb (the last block again past the end)
        cols = pl.ds(jnp.minimum(kb, nkb - 1) * BK, BK)
        return tuple(w_ref[layer, pl.ds(s, BN), cols] for s in starts)

    def load_x(kb):  # block kb of the rows, float32 [BM, BK]
        return x_ref[:, pl.ds(kb * BK, BK)].astype(tm.F32)

    unroll = twin_norm_unroll(nkb, x_ref.shape[0])
    stats = twin_norm.row_stats(load_x, K, BK, norm, eps, gpu, unroll) if norm else None

    def body(kb, carry):
        accs, ahead = carry
        wbs, ahead = ahead[0], (*ahead[1:], tiles(kb + prefetch))                 # the prefetch goes out first
        xb = load_x(kb)
        if norm:  # the fused norm: this block of norm(x), rounded as twin_norm.norm rounds it
            cols = pl.ds(kb * BK, BK)
            w_n, b_n = (r[layer, cols].astype(tm.F32)[None, :] for r in (nw_ref, nb_ref))
            xb = tm.to_dtype(twin_norm.normalize(xb, w_n, b_n, stats, norm, gpu), x_ref.dtype).astype(tm.F32)
        xb = xb[:, None, :]                                                       # [BM, 1, BK]
        accs = tuple(tm.mac(a, xb, wb.astype(tm.F32)[None, :, :], fused, gpu) for a, wb in zip(accs, wbs))
        return accs, ahead

    zeros = jnp.zeros((x_ref.shape[0], BN, BK), tm.F32)
    init = ((zeros,) * len(starts), tuple(tiles(i) for i in range(prefetch)))
    accs, _ = lax.fori_loop(0, nkb, body, init)
    sums = tuple(tm.tree_sum(a)[..., 0] for a in accs)
    scale = scale_ref[layer, pl.ds(n0, BN)][None, :] if has_scale else None
    residual = res_ref[...] if has_res else None
    o_ref[...] = _epilogue(sums if act == "silu_gate" else sums[0], o_ref.dtype, act, scale, residual, gpu)


def _mma_kernel(layer_ref, x_ref, w_ref, *refs, M, K, R, BN, BK, N_out, act, norm, eps, has_scale, has_res, rms,
                split, gpu):
    """Program (i, j): columns j*BN.. of rows i*R.. (R: `contract.linear.twin_mma_rows`), the MMA form: acc [BN, R]
    += w_block [BN, BK] @ x_block^T over the K blocks in order (module docstring); norm: the fused
    norm's kind (`_mma_accumulate`), its weight and bias refs first in refs; rms (the split norm's
    eps, or None): the rows' ss ref next, the sums scaled by `twin_norm.split_r`; split (the split
    norm's offset, or None): its alpha ref after the residual's, and the outputs u and ss after o
    (`twin_norm.split_store`).

    x_ref [M, K], the residual and o_ref [M, N_out] are whole and unpadded: the rows past M are
    read as 0 (a masked load) and masked out of the store (no pad or slice kernels around the call)."""
    refs = list(refs)
    fused = (norm, eps, refs.pop(0), refs.pop(0)) if norm else None
    ss_ref = refs.pop(0) if rms is not None else None
    scale_ref = refs.pop(0) if has_scale else None
    res_ref = refs.pop(0) if has_res else None
    alpha_ref = refs.pop(0) if split is not None else None
    o_ref, *split_out = refs
    layer = layer_ref[0]
    n0 = pl.program_id(1) * BN
    m = pl.program_id(0) * R + jnp.arange(R, dtype=jnp.int32)
    starts = (n0, n0 + N_out) if act == "silu_gate" else (n0,)
    accs, ok, rows = _mma_accumulate(layer_ref, x_ref, w_ref, m, M, K, BN, BK, starts, fused, gpu)
    sums = tuple(a.T for a in accs)                                               # [R, BN]
    if rms is not None:
        r = twin_norm.split_r(ss_ref, rows, ok, K, rms, gpu)
        sums = tuple(tm.mul(a, r, gpu) for a in sums)
    cols = n0 + jnp.arange(BN, dtype=jnp.int32)[None, :]
    scale = scale_ref[layer, pl.ds(n0, BN)][None, :] if has_scale else None
    residual = pltriton.load(res_ref.at[rows, cols]) if has_res else None
    y = _epilogue(sums if act == "silu_gate" else sums[0], o_ref.dtype, act, scale, residual, gpu)
    # stored at m itself: masked rows must not alias row M - 1 (interpreted, a masked store writes back
    # what it read, and duplicate indices would race)
    pltriton.store(o_ref.at[m[:, None], cols], y, mask=jnp.broadcast_to(ok, y.shape))
    if split is not None:
        split_layer = jnp.minimum(layer + split, alpha_ref.shape[0] - 1)
        twin_norm.split_store(y, alpha_ref, split_layer, n0, m, ok, *split_out, gpu)


def linear(x: jax.Array, w: jax.Array, layer=None, *, act: str | None = None, scale: jax.Array | None = None,
           residual: jax.Array | None = None, norm: TwinNorm | None = None, split: TwinSplit | None = None,
           rms: TwinRms | None = None, block_m: int | None = None, block_n: int | None = None, num_warps: int = 4,
           num_stages: int | None = None, form: str | None = None, interpret: bool | None = None):
    """y = epilogue(norm(x) @ w[layer].T), batch-invariant (module docstring).

    x: [M, K] float32/bfloat16/float16; w: [L, N, K] (layer: int or int32 scalar, may be
    traced) or [N, K] (layer=None), in x's dtype; scale: [L, N_out] or [N_out] (indexed like w);
    residual: [M, N_out]; norm: a `TwinNorm` to fuse (None: x as it is). N_out = N/2 for
    act="silu_gate", else N. Returns [M, N_out] in x's dtype.
    form: "lanes" or "mma" (None: `contract.linear.twin_linear_form`'s choice; the two give other bits).
    block_m, block_n: output tile (the MMA form's block_m: 16, 32 or 64 rows, None:
    `contract.linear.twin_mma_rows`); num_stages: the pipeline depth (None: the MMA form's
    `contract.linear.twin_mma_stages`, the lane form's 2); num_warps: a power of two in 1..32. These change
    the speed, never the bits (the lane form's prefetch depth, too: `contract.linear.twin_pallas_prefetch`).
    split, rms (MMA form only): the split RMSNorm (`contract.norm.TwinSplit`); with split the call returns
    (y, u [M, N_out], ss float32 [M, N_out/G]); with rms, x is the split norm's u.

    Differentiable (`jax.custom_vjp`, the backward of `contract.grad` on the twin kernels) in x, w,
    scale, residual, the norm's weights and the split norm's (split.weight, rms.ss; with split, in
    all three outputs); the layer index has no cotangent.
    """
    check_launch("linear", num_warps, num_stages)
    w, scale, norm, layer = stack_one_layer(w, scale, norm, layer)
    split = split_one_layer(split)
    check_twin_linear(x, w, act, scale, residual, norm)
    check_rms(rms)
    opts = _LinearOpts(act, None if norm is None else norm.kind, None if norm is None else norm.eps,
                       residual is not None, None if split is None else split.offset,
                       None if rms is None else rms.eps, block_m, block_n, num_warps, num_stages, form, interpret)
    return _linear_vjp(x, w, tm.layer_index("linear", layer, w.shape[0]), scale, residual, *_norm_arrays(norm),
                       None if split is None else split.weight, None if rms is None else rms.ss, opts)


class _LinearOpts(NamedTuple):
    """A `linear` call's static arguments (hashable: `custom_vjp`'s nondiff argument); split_offset,
    rms_eps: the split norm's halves (`TwinSplit.offset`, `TwinRms.eps`), None without them."""

    act: str | None
    norm_kind: str | None
    norm_eps: float | None
    has_residual: bool
    split_offset: int | None
    rms_eps: float | None
    block_m: int | None
    block_n: int | None
    num_warps: int
    num_stages: int | None
    form: str | None
    interpret: bool | None

    def kwargs(self, scale, residual, nw, nb, alpha, ss) -> dict:
        """`_linear`'s keyword arguments with these arrays."""
        norm = None if self.norm_kind is None else TwinNorm(self.norm_kind, nw, nb, self.norm_eps)
        return {"act": self.act, "scale": scale, "residual": residual, "norm": norm,
                "split": None if self.split_offset is None else TwinSplit(alpha, self.split_offset),
                "rms": None if self.rms_eps is None else TwinRms(ss, self.rms_eps), "block_m": self.block_m,
                "block_n": self.block_n, "num_warps": self.num_warps, "num_stages": self.num_stages,
                "form": self.form, "interpret": self.interpret}


def _norm_arrays(norm: TwinNorm | None) -> tuple:
    return (None, None) if norm is None else (norm.weight, norm.bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _linear_vjp(x, w, layer, scale, residual, nw, nb, alpha, ss, opts: _LinearOpts):
    return _linear(x, w, layer, **opts.kwargs(scale, residual, nw, nb, alpha, ss))


def _linear_fwd(x, w, layer, scale, residual, nw, nb, alpha, ss, opts: _LinearOpts):
    out = _linear_vjp(x, w, layer, scale, residual, nw, nb, alpha, ss, opts)
    y = out[0] if opts.split_offset is not None else None  # the rows the split norm's derivative needs
    return out, (x, w, layer, scale, nw, nb, alpha, ss, y)


@twin_grad.first_order("linear")
def _linear_bwd(opts: _LinearOpts, saved, cotangent):
    """The linear's backward (`contract.grad`, steps 1-4, and the split norm's halves) on the twin kernels."""
    x, w, layer, scale, nw, nb, alpha, ss, y = saved
    interpret = opts.interpret
    dy, d_alpha = cotangent, None
    if opts.split_offset is not None:  # the producer's half: u's and ss's cotangents into y's
        dy, du, dss = cotangent
        row = jnp.minimum(layer + opts.split_offset, alpha.shape[0] - 1)
        dy, ta = twin_norm.split_grad(y, du, dss, alpha, row, dy=dy, interpret=interpret)
        d_alpha = twin_grad.stacked(alpha, twin_grad.batch_sum(ta, alpha.dtype, interpret=interpret), row)
    norm = None if opts.norm_kind is None else TwinNorm(opts.norm_kind, nw, nb, opts.norm_eps)
    rms = None if opts.rms_eps is None else TwinRms(ss, opts.rms_eps)
    xn = _norm_first(x, norm, layer, interpret)
    pre = None
    if opts.act is not None or scale is not None:  # the projection the epilogue started from, again
        pre = _linear(xn, w, layer, rms=rms, form=opts.form, interpret=interpret)
    dpre, ts = twin_grad.epilogue_grad(dy, pre, scale, layer, act=opts.act, interpret=interpret)
    wl = lax.dynamic_index_in_dim(w, layer, keepdims=False)                          # [N, K]
    dxn = _linear(dpre, wl.T, interpret=interpret)                                  # [M, K]
    dx, dnw, dnb, dss_in = dxn, None, None, None
    if rms is not None:  # the consumer's half: the scaled operand r * u, and u's and ss's cotangents
        xn, dx, dss_in = twin_norm.split_rms_grad(x, dxn, ss, eps=rms.eps, interpret=interpret)
    dw = twin_grad.stacked(w, _linear(dpre.T, xn.T, interpret=interpret), layer)     # [N, K] at layer
    dscale = None if scale is None else twin_grad.stacked(scale, twin_grad.batch_sum(ts, scale.dtype,
                                                                                     interpret=interpret), layer)
    if norm is not None:
        dx, tw = twin_norm.norm_grad(x, dxn, nw, nb, layer, kind=norm.kind, eps=norm.eps, interpret=interpret)
        dnw = twin_grad.stacked(nw, twin_grad.batch_sum(tw, nw.dtype, interpret=interpret), layer)
        if nb is not None:
            dnb = twin_grad.stacked(nb, twin_grad.batch_sum(dxn, nb.dtype, interpret=interpret), layer)
    return dx, dw, None, dscale, dy if opts.has_residual else None, dnw, dnb, d_alpha, dss_in


_linear_vjp.defvjp(_linear_fwd, _linear_bwd)


def _linear(x: jax.Array, w: jax.Array, layer=None, *, act: str | None = None, scale: jax.Array | None = None,
            residual: jax.Array | None = None, norm: TwinNorm | None = None, split: TwinSplit | None = None,
            rms: TwinRms | None = None, block_m: int | None = None, block_n: int | None = None, num_warps: int = 4,
            num_stages: int | None = None, form: str | None = None, interpret: bool | None = None):
    """`linear`'s kernels, not differentiated (the backward's own products call this)."""
    w, scale, norm, layer = stack_one_layer(w, scale, norm, layer)
    split = split_one_layer(split)
    M, K, _, N_out = check_twin_linear(x, w, act, scale, residual, norm)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if form != "lanes" and backend.on_mosaic() and mosaic_takes_linear(x.dtype, K, N_out, norm=norm is not None,
                                                                       rms=rms is not None, split=split is not None):
        from kernels_pallas import twin_linear_mgpu  # its MMA form on Mosaic GPU (`kernels_pallas.backend`)

        return twin_linear_mgpu.linear(x, w, layer, act=act, scale=scale, residual=residual, norm=norm, split=split,
                                       rms=rms, interpret=interpret)
    chosen = twin_linear_form(N_out, K, x.dtype, compiled=not interpret, form=form)
    check_twin_split(split, rms, norm, M, K, N_out, chosen)
    if chosen == "lanes" and backend.on_mosaic() and (norm is None or K % 128 == 0):
        # the lane form on Mosaic GPU, the norm's kernel first (`kernels_pallas.backend`)
        from kernels_pallas import twin_linear_lanes_mgpu

        return twin_linear_lanes_mgpu.linear(_norm_first(x, norm, layer, interpret), w, layer, act=act, scale=scale,
                                             residual=residual, interpret=interpret)
    if chosen == "mma":
        return _linear_mma(x, w, layer, M, K, N_out, act, scale, residual, norm, split, rms, block_m, block_n,
                           num_warps, num_stages, interpret)
    blocks = LinearBlocks.for_shapes(M, N_out, K, block_m, block_n, interpreted=interpret)
    BM, BN, BK = blocks.block_m, blocks.block_n, blocks.block_k
    if norm is not None and not twin_fuse_norm(BM, interpret):  # the norm kernel first: the same bits
        x = _norm_first(x, norm, layer, interpret)
        norm = None
    Mp = -(-M // BM) * BM
    pad = ((0, Mp - M), (0, 0))
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(x, pad), w]
    if norm is not None:
        operands += [norm.weight, norm.weight if norm.bias is None else norm.bias]  # rms: the bias is unread
    if scale is not None:
        operands.append(scale)
    in_specs = [_whole(operands[0]), pl.BlockSpec((BM, K), lambda i, j: (i, 0))] + [_whole(a) for a in operands[2:]]
    tile = pl.BlockSpec((BM, BN), lambda i, j: (i, j))
    if residual is not None:
        operands.append(jnp.pad(residual, pad))
        in_specs.append(tile)
    kernel = functools.partial(_kernel, K=K, BN=BN, BK=BK, N_out=N_out, act=act,
                               norm=None if norm is None else norm.kind, eps=None if norm is None else norm.eps,
                               has_scale=scale is not None, has_res=residual is not None,
                               fused=x.dtype in (jnp.bfloat16, jnp.float16), prefetch=twin_pallas_prefetch(K, BK),
                               gpu=not interpret)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((Mp, N_out), x.dtype),
        grid=(Mp // BM, N_out // BN),
        in_specs=in_specs,
        out_specs=tile,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages or 2),
        name="twin_linear",
    )(*operands)
    return out[:M]


def _norm_first(x, norm: TwinNorm | None, layer, interpret: bool):
    """x normalized by the norm kernel (the bits of the fused norm), or x itself where norm is None."""
    if norm is None:
        return x
    return twin_norm.norm(x, norm.weight, norm.bias, layer, kind=norm.kind, eps=norm.eps, interpret=interpret)


def _linear_mma(x, w, layer, M, K, N_out, act, scale, residual, norm, split, rms, block_m, block_n, num_warps,
                num_stages, interpret):
    """The MMA form (`_mma_kernel`): the norm fused over a few K blocks, else its kernel first
    (`contract.linear.twin_mma_fuse_norm`: the same bits); split, rms: the split norm's halves."""
    blocks = MmaBlocks.for_shapes(M, N_out, K, 1 + (act == "silu_gate"), split is not None, block_m, block_n)
    BN, BK, R = blocks.block_n, blocks.block_k, blocks.rows
    norm, (x, *norm_refs) = _mma_norm(x, norm, layer, K, interpret)
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), x, w, *norm_refs]
    operands += [t for t in (None if rms is None else rms.ss, scale, residual) if t is not None]
    outs = [jax.ShapeDtypeStruct((M, N_out), x.dtype)]
    if split is not None:
        operands.append(split.weight)
        outs += [jax.ShapeDtypeStruct((M, N_out), x.dtype),
                 jax.ShapeDtypeStruct((M, N_out // TWIN_SPLIT_GROUP), jnp.float32)]
    # the row blocks first in the grid (the fastest-varying program index, launched one after the other):
    # the row blocks of one column block run together and read its weights once from memory, then from
    # the L2 (columns first, each row block had re-read all the weights: 4x the bytes at B=64)
    out = pl.pallas_call(
        functools.partial(_mma_kernel, M=M, K=K, R=R, BN=BN, BK=BK, N_out=N_out, act=act,
                          norm=None if norm is None else norm.kind, eps=None if norm is None else norm.eps,
                          has_scale=scale is not None, has_res=residual is not None,
                          rms=None if rms is None else rms.eps, split=None if split is None else split.offset,
                          gpu=not interpret),
        out_shape=tuple(outs),
        grid=(-(-M // R), N_out // BN),
        in_specs=[_whole(a) for a in operands],
        out_specs=tuple(_whole(o) for o in outs),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps,
            num_stages=num_stages or twin_mma_stages(N_out, BN, BK, 1 + (act == "silu_gate"), rows=R, M=M)),
        name="twin_linear_mma",
    )(*operands)
    return out if split is not None else out[0]


def _mma_norm(x, norm: TwinNorm | None, layer, K: int, interpret: bool):
    """(the norm the MMA kernel fuses or None, [x or norm(x), then its weight and bias if fused])."""
    if norm is None or not twin_mma_fuse_norm(K):
        return None, [_norm_first(x, norm, layer, interpret)]
    return norm, [x, norm.weight, norm.weight if norm.bias is None else norm.bias]  # rms: the bias is unread


def _mma_accumulate(layer_ref, x_ref, w_ref, m, M, K, BN, BK, starts, norm=None, gpu=True):
    """The MMA form's loop of one program of rows m [R]: (acc [BN, R] per start column, ok [R, 1],
    rows [R, 1]); rows past M are read as 0 (masked). norm: None, or (kind, eps, weight ref, bias
    ref) of the fused norm: the rows' statistics first (`twin_norm.row_stats`), then each x block normalized
    and rounded to x's dtype before its product: the bits of `twin_norm.norm`, then this loop."""
    layer = layer_ref[0]
    ok = (m < M)[:, None]
    rows = jnp.minimum(m, M - 1)[:, None]
    lanes = jnp.arange(BK, dtype=jnp.int32)[None, :]
    # a masked load, not a select after it: the select kept the x tile out of the pipelined loop's
    # asynchronous copies (M=4 on an H200: 31 against 25 us for the qkv projection, Triton's masked load)
    mask, zero = jnp.broadcast_to(ok, (m.shape[0], BK)), jnp.zeros((), x_ref.dtype)

    def load_x(kb):  # [R, BK]
        return pltriton.load(x_ref.at[rows, kb * BK + lanes], mask=mask, other=zero)

    if norm is not None:
        kind, eps, nw_ref, nb_ref = norm
        # every block's load at once (a few: `contract.linear.twin_mma_fuse_norm`), one round trip a pass over x
        stats = twin_norm.row_stats(lambda kb: load_x(kb).astype(tm.F32), K, BK, kind, eps, gpu)

    def body(kb, accs):
        xb = load_x(kb)
        if norm is not None:
            w_n, b_n = (r[layer, pl.ds(kb * BK, BK)].astype(tm.F32)[None, :] for r in (nw_ref, nb_ref))
            xb = tm.to_dtype(twin_norm.normalize(xb.astype(tm.F32), w_n, b_n, stats, kind, gpu), x_ref.dtype)
        return tuple(a + lax.dot_general(w_ref[layer, pl.ds(s, BN), pl.ds(kb * BK, BK)], xb, (((1,), (1,)), ((), ())),
                                         preferred_element_type=tm.F32) for a, s in zip(accs, starts))

    zeros = jnp.zeros((BN, m.shape[0]), tm.F32)
    return lax.fori_loop(0, K // BK, body, (zeros,) * len(starts)), ok, rows


def _qkv_kernel(layer_ref, x_ref, w_ref, *refs, M, K, R, BN, BK, B, T, H, C, D, norm, eps, rms, rope, gpu):
    """Program (i, j): columns j*BN.. of rows i*R.. of qkv = x @ w[layer].T (the MMA form), then
    `twin_rope.rope_write`'s epilogue on them: a program's columns lie in one head of q, k or v
    (BN | D) and hold whole GPT-J pairs. layer_ref: the weights' layer, then the rings'. q is
    rotated into q_ref [B*H*T, D]; k rotated and v as it
    is go into the rings [L*B*H, C, D] at the write slots where the write mask is set (rope False:
    no rotation). Row m is (b, t) = (m // T, m % T). Stores use the unclamped rows (masked rows
    never alias valid ones). refs: the fused norm's weight and bias (norm: its kind,
    `_mma_accumulate`), then cos and sin (rope), the slots, the write mask, the rings in, q and the
    rings out (aliased to the rings in); rms: the split norm's eps (its ss ref before cos), or None."""
    refs = list(refs)
    fused = (norm, eps, refs.pop(0), refs.pop(0)) if norm else None
    ss_ref = refs.pop(0) if rms is not None else None
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    slot_ref, wmask_ref, _, _, q_ref, k_ref, v_ref = refs
    n0 = pl.program_id(1) * BN
    m = pl.program_id(0) * R + jnp.arange(R, dtype=jnp.int32)
    (acc,), ok, rows = _mma_accumulate(layer_ref, x_ref, w_ref, m, M, K, BN, BK, (n0,), fused, gpu)
    dtype = q_ref.dtype
    acc = acc.T if rms is None else tm.mul(acc.T, twin_norm.split_r(ss_ref, rows, ok, K, rms, gpu), gpu)
    y = tm.to_dtype(acc, dtype)                                       # [R, BN]: what `linear` returns
    part, h, d0 = n0 // (H * D), (n0 // D) % H, n0 % D
    out = y
    if rope:
        freq = d0 // 2 + jnp.arange(BN // 2, dtype=jnp.int32)[None, :]
        cos, sin = (pltriton.load(ref.at[rows, freq]) for ref in (cos_ref, sin_ref))     # [R, BN/2]
        r, i = (a[..., 0] for a in jnp.split(y.astype(tm.F32).reshape(R, BN // 2, 2), 2, axis=-1))
        rotated = jnp.stack(twin_rope.rotate(r, i, cos, sin, dtype, gpu), axis=-1).reshape(R, BN)
        out = jnp.where(part < 2, rotated, y)                         # v is not rotated
    cols = d0 + jnp.arange(BN, dtype=jnp.int32)[None, :]
    b, t = (m // T)[:, None], (m % T)[:, None]
    full = (R, BN)
    pltriton.store(q_ref.at[(b * H + h) * T + t, cols], out, mask=jnp.broadcast_to(ok & (part == 0), full))
    written = ok & (pltriton.load(wmask_ref.at[rows]) != 0)
    ring_row, slot = (layer_ref[1] * B + b) * H + h, pltriton.load(slot_ref.at[rows])  # the rings' layer
    for ref, p in ((k_ref, 1), (v_ref, 2)):
        pltriton.store(ref.at[ring_row, slot, cols], out, mask=jnp.broadcast_to(written & (part == p), full))


def linear_rope_write(x: jax.Array, w: jax.Array, layer, cos: jax.Array | None, sin: jax.Array | None,
                      ring_k: jax.Array, ring_v: jax.Array, write_index: jax.Array, write_mask: jax.Array, *,
                      norm: TwinNorm | None = None, rms: TwinRms | None = None, ring_layer=None,
                      block_m: int | None = None, block_n: int | None = None, num_warps: int = 4,
                      num_stages: int | None = None, form: str | None = None, interpret: bool | None = None):
    """The qkv projection with the RoPE rotation and the ring write in its epilogue: the bits of
    `linear(x, w, layer, norm=norm)` reshaped to [B, T, 3, H, D], then `twin_rope.rope_write`.

    x: [B*T, K]; w: [L, 3*H*D, K] (layer may be traced); cos, sin: float32 [B, T, D/2], or both
    None (no rotation: q as projected, k and v written as they are, `twin_rope.rope_write`); ring_k,
    ring_v: [L, B, H, C, D] in x's dtype (aliased to the outputs); write_index, write_mask: [B, T].
    rms: the split RMSNorm's (`contract.norm.TwinSplit`; x is its u; the MMA form only).
    ring_layer: the rings' layer index where it is not the weights' `layer` (None: `layer`; a stack
    whose weights come in sets per layer, the depformer's: w[layer * sets + set], ring[layer]).
    Returns (q [B, H, T, D], ring_k, ring_v). The MMA form runs it as one kernel after the norm's
    (`contract.linear.twin_qkv_plan`); the lane form as `linear` then `rope_write`, the same bits as ever.
    block_m, block_n, num_warps, num_stages: speed only, as in `linear`.
    Differentiable in x, w, the norm's weights, rms.ss and the rings (the one kernel: a `jax.custom_vjp`,
    rope_write's backward then the linear's, `contract.grad`); cos and sin are refused, as `rope_write` does.
    """
    B, T, H, D, M, K, N = check_twin_qkv(x, w, norm, cos, sin, ring_k, ring_v, write_index, write_mask,
                                         tm.host_values(write_index), tm.host_values(write_mask))
    check_launch("linear_rope_write", num_warps, num_stages)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    mosaic = form != "lanes" and backend.on_mosaic() and mosaic_takes_linear(
        x.dtype, K, N, norm=norm is not None, rms=rms is not None, head_dim=D)
    chosen, BN = ("mma", None) if mosaic else twin_qkv_plan(N, K, D, x.dtype, not interpret, form, block_n)
    check_twin_split(None, rms, norm, M, K, N, chosen, "linear_rope_write")
    if chosen == "lanes":
        qkv = linear(x, w, layer, norm=norm, block_m=block_m, block_n=block_n, num_warps=num_warps,
                     num_stages=num_stages, form="lanes", interpret=interpret).reshape(B, T, 3, H, D)
        return twin_rope.rope_write(qkv, cos, sin, ring_k, ring_v, layer if ring_layer is None else ring_layer,
                                    write_index, write_mask, interpret=interpret)
    layers = jnp.stack([tm.layer_index("linear_rope_write", layer, w.shape[0]),
                        tm.layer_index("linear_rope_write", layer if ring_layer is None else ring_layer, ring_k.shape[0])])
    lin = _LinearOpts(None, None if norm is None else norm.kind, None if norm is None else norm.eps, False, None,
                      None if rms is None else rms.eps, block_m, block_n, num_warps, num_stages, "mma", interpret)
    return _qkv_vjp(_QkvOpts(lin, block_m, BN, num_warps, num_stages, interpret, mosaic), x, w, layers,
                    *_norm_arrays(norm), None if rms is None else rms.ss, cos, sin, ring_k, ring_v, write_index,
                    write_mask)


def _qkv_kernel_call(x, w, layers, norm, rms, cos, sin, ring_k, ring_v, write_index, write_mask, block_m, BN,
                     num_warps, num_stages, interpret, mosaic=False):
    """`linear_rope_write`'s one kernel (`_qkv_kernel`; its arguments checked, the plan's BN given), not
    differentiated: (q [B*H*T, D], ring_k, ring_v [L*B*H, C, D]). mosaic: its Mosaic GPU twin's instead
    (`kernels_pallas.backend`)."""
    (B, T), H, D = write_index.shape, ring_k.shape[2], ring_k.shape[4]
    if mosaic:
        from kernels_pallas import twin_linear_mgpu

        q, ring_k, ring_v = twin_linear_mgpu.linear_rope_write(x, w, layers[0], cos, sin, ring_k, ring_v, write_index,
                                                               write_mask, norm=norm, rms=rms, ring_layer=layers[1],
                                                               interpret=interpret)
        return q.reshape(B * H * T, D), ring_k.reshape(-1, *ring_k.shape[3:]), ring_v.reshape(-1, *ring_v.shape[3:])
    M, K, N = x.shape[0], x.shape[1], w.shape[1]
    BK, R = twin_lanes(K), twin_mma_rows(M, N // BN, K, block_m, "linear_rope_write")
    norm, (x, *norm_refs) = _mma_norm(x, norm, layers[0], K, interpret)
    norm_refs += [] if rms is None else [rms.ss]
    L, C = ring_k.shape[0], ring_k.shape[3]
    rows = (L * B * H, C, D)  # the rings as [L*B*H, C, D], indexed per dimension (64-bit addresses when large)
    rope = cos is not None
    tables = (cos.reshape(M, D // 2), sin.reshape(M, D // 2)) if rope else ()
    operands = [layers, x, w, *norm_refs, *tables,
                write_index.astype(jnp.int32).reshape(M), write_mask.astype(jnp.int32).reshape(M),
                ring_k.reshape(rows), ring_v.reshape(rows)]
    ring_at = len(operands) - 2
    q_flat = jax.ShapeDtypeStruct((B * H * T, D), x.dtype)
    qkv_kernel = pl.pallas_call(
        functools.partial(_qkv_kernel, M=M, K=K, R=R, BN=BN, BK=BK, B=B, T=T, H=H, C=C, D=D,
                          norm=None if norm is None else norm.kind, eps=None if norm is None else norm.eps,
                          rms=None if rms is None else rms.eps, rope=rope, gpu=not interpret),
        out_shape=(q_flat, jax.ShapeDtypeStruct(rows, ring_k.dtype), jax.ShapeDtypeStruct(rows, ring_v.dtype)),
        grid=(-(-M // R), N // BN),  # row blocks first, as in `linear`
        in_specs=[_whole(a) for a in operands],
        out_specs=(_whole(q_flat), _whole(operands[ring_at]), _whole(operands[ring_at + 1])),
        input_output_aliases={ring_at: 1, ring_at + 1: 2},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps,
                                                num_stages=num_stages or twin_mma_stages(N, BN, BK, rows=R, M=M)),
        name="twin_qkv_rope_write",
    )
    return qkv_kernel(*operands)


class _QkvOpts(NamedTuple):
    """`linear_rope_write`'s static arguments of its one-kernel form (`custom_vjp`'s nondiff argument):
    the kernel's (`_qkv_kernel_call`) and the linear's (its backward's)."""

    linear: _LinearOpts
    block_m: int | None
    block_n: int | None
    num_warps: int
    num_stages: int | None
    interpret: bool
    mosaic: bool  # the kernel on Mosaic GPU (`kernels_pallas.backend`)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qkv_vjp(opts: _QkvOpts, x, w, layers, nw, nb, ss, cos, sin, ring_k, ring_v, write_index, write_mask):
    norm = None if opts.linear.norm_kind is None else TwinNorm(opts.linear.norm_kind, nw, nb, opts.linear.norm_eps)
    rms = None if opts.linear.rms_eps is None else TwinRms(ss, opts.linear.rms_eps)
    B, T = write_index.shape
    L, H, C, D = ring_k.shape[0], ring_k.shape[2], ring_k.shape[3], ring_k.shape[4]
    q, k, v = _qkv_kernel_call(x, w, layers, norm, rms, cos, sin, ring_k, ring_v, write_index, write_mask,
                               opts.block_m, opts.block_n, opts.num_warps, opts.num_stages, opts.interpret, opts.mosaic)
    return q.reshape(B, H, T, D), k.reshape(L, B, H, C, D), v.reshape(L, B, H, C, D)


def _qkv_fwd(opts: _QkvOpts, x, w, layers, nw, nb, ss, cos, sin, ring_k, ring_v, write_index, write_mask):
    """symbolic_zeros: each primal comes with `.perturbed` (refuse a differentiated table, as `rope_write`)."""
    if any(t is not None and t.perturbed for t in (cos, sin)):
        raise NotImplementedError("linear_rope_write(cos, sin): the RoPE tables have no derivative here (functions "
                                  "of integer positions); differentiate x, w, the norm's weights and the rings only")
    args = [None if a is None else a.value
            for a in (x, w, layers, nw, nb, ss, cos, sin, ring_k, ring_v, write_index, write_mask)]
    x, w, layers, nw, nb, ss, cos, sin, _, _, write_index, write_mask = args
    return _qkv_vjp(opts, *args), (x, w, layers, nw, nb, ss, cos, sin, write_index, write_mask)


def _qkv_bwd(opts: _QkvOpts, saved, cotangents):
    """`_qkv_arrays_bwd` on (dq, d_ring_k, d_ring_v) as arrays."""
    return _qkv_arrays_bwd(opts, saved, tuple(map(twin_grad.dense, cotangents)))


@twin_grad.first_order("linear_rope_write")
def _qkv_arrays_bwd(opts: _QkvOpts, saved, cotangents):
    """rope_write's backward (`twin_rope.rope_write_bwd`), then the linear's (`_linear_bwd`)."""
    x, w, layers, nw, nb, ss, cos, sin, write_index, write_mask = saved
    dq, d_ring_k, d_ring_v = cotangents
    d_qkv, d_ring_k, d_ring_v = twin_rope.rope_write_bwd(dq, cos, sin, d_ring_k, d_ring_v, layers[1], write_index,
                                                         write_mask, interpret=opts.interpret)
    dx, dw, _, _, _, dnw, dnb, _, dss = _linear_bwd(opts.linear, (x, w, layers[0], None, nw, nb, None, ss, None),
                                                    d_qkv.reshape(x.shape[0], w.shape[1]))
    return dx, dw, None, dnw, dnb, dss, None, None, d_ring_k, d_ring_v, None, None


_qkv_vjp.defvjp(_qkv_fwd, _qkv_bwd, symbolic_zeros=True)


def _whole(a):
    """A BlockSpec giving the kernel the whole array (indexed in place inside)."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)


def linear_native(x, w, layer=None, *, act=None, scale=None, residual=None, norm=None, split=None, rms=None,
                  form=None, **_):
    """The plain jax.numpy reference of the lane form: the same signature and bits, without Pallas
    (the MMA form's bits are the tensor cores': no plain reference has them)."""
    check_native_linear(form, split, rms)
    w, scale, norm, layer = stack_one_layer(w, scale, norm, layer)
    M, K, N, N_out = check_twin_linear(x, w, act, scale, residual, norm)
    layer = tm.layer_index("linear_native", layer, w.shape[0])
    if norm is not None:
        x = twin_norm.norm_native(x, norm.weight, norm.bias, layer, kind=norm.kind, eps=norm.eps)
    BK = twin_lanes(K)
    wl = lax.dynamic_index_in_dim(w, layer, keepdims=False).astype(tm.F32)  # [N, K]
    p = tm.mul(x.astype(tm.F32)[:, None, :], wl[None], False)                # [M, N, K]
    lanes = p.reshape(M, N, K // BK, BK)
    acc = jnp.zeros((M, N, BK), tm.F32)  # from +0, as the kernels start (0 + -0 is +0)
    for kb in range(K // BK):
        acc = acc + lanes[:, :, kb]
    acc = tm.tree_sum(acc)[..., 0]
    if act == "silu_gate":
        acc = (acc[:, :N_out], acc[:, N_out:])
    s = None if scale is None else lax.dynamic_index_in_dim(scale, layer, keepdims=False)[None, :]
    return _epilogue(acc, x.dtype, act, s, residual, False)


def linear_rope_write_native(x, w, layer, cos, sin, ring_k, ring_v, write_index, write_mask, *, norm=None,
                             ring_layer=None, form=None, **_):
    """The plain jax.numpy reference of `linear_rope_write`'s lane form: `linear_native` then
    `twin_rope.rope_write_native`, the same signature and bits (the MMA form's bits are the tensor cores')."""
    B, T, H, D, *_ = check_twin_qkv(x, w, norm, cos, sin, ring_k, ring_v, write_index, write_mask,
                                    tm.host_values(write_index), tm.host_values(write_mask))
    qkv = linear_native(x, w, layer, norm=norm, form=form).reshape(B, T, 3, H, D)
    return twin_rope.rope_write_native(qkv, cos, sin, ring_k, ring_v, layer if ring_layer is None else ring_layer,
                                       write_index, write_mask)


__all__ = ["linear", "linear_native", "linear_rope_write", "linear_rope_write_native"]
