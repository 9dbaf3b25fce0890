"""Batch-invariant linear layer (x @ w[layer].T) as a Triton kernel, with epilogues: the twin of
`kernels_pallas.twin_linear` (its docstring states the contract; same signature, same bits).

The plain reference is `kernels_pallas.twin_linear.linear_native` (jax.numpy): the tests hold
both kernels to it bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels_pallas.contract.linear import (
    TWIN_INTERPRET_MAX_BN,
    TWIN_TRITON_LINEAR_STAGES,
    LinearBlocks,
    MmaBlocks,
    check_native_linear,
    check_twin_linear,
    check_twin_qkv,
    stack_one_layer,
    twin_fuse_norm,
    twin_linear_form,
    twin_mma_fuse_norm,
    twin_mma_rows,
    twin_mma_stages,
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
from kernels_pallas.contract.numerics import check_index, check_launch, twin_lanes
from kernels_triton import twin_grad, twin_norm, twin_rope
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting

_GATE_BN = 256  # columns per program of the gate kernel


@triton.jit
def _acc(x_ptr, w_ptr, nw_ptr, nb_ptr, eps, m, m_ok, n, n_ok, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         BK: tl.constexpr, NORM: tl.constexpr, INV_K: tl.constexpr, NORM_UNROLL: tl.constexpr, FUSED: tl.constexpr,
         STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    """Lane sums over the K blocks, in order, then the tree over the BK lanes: [BM, BN] float32.

    NORM ("rms", "layer" or ""): the rows' statistics first (`twin_norm.row_stats`), then each x
    block normalized and rounded to x's dtype as it is loaded (the fused norm, module docstring of
    the Pallas twin). FUSED (16-bit x and w): each product-then-add is one FMA, the same bits
    (twin_math). The loop is software-pipelined (`tl.range(num_stages=STAGES)`: asynchronous
    copies of the next STAGES - 1 blocks into shared memory): the kernel waits on memory latency,
    and this keeps loads in flight without holding them in registers (the Pallas twin, whose
    lowering has no such option, carries prefetched tiles through its loop instead).
    """
    k = tl.arange(0, BK)
    if NORM != "":
        mean, r = twin_norm.row_stats(x_ptr, m, m_ok, eps, INV_K, K, BM, BK, NORM == "rms", NORM_UNROLL)
    acc = tl.zeros([BM, BN, BK], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        xb = tl.load(x_ptr + m[:, None] * K + k0 + k[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        if NORM != "":
            xb = tm.to_dtype(twin_norm.normalize(xb, nw_ptr, nb_ptr, k0 + k, mean, r, NORM == "rms"),
                             x_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
        wb = tl.load(w_ptr + n[:, None] * K + k0 + k[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        if FUSED:
            acc = tl.fma(xb[:, None, :], wb[None, :, :], acc)
        else:
            acc = acc + xb[:, None, :] * wb[None, :, :]
    return tl.reshape(tm.tree_sum(tl.reshape(acc, [BM * BN, BK]), BM * BN, BK), [BM, BN])


@triton.jit
def _finish(y, layer, m, m_ok, n, n_ok, scale_ptr, res_ptr, o_ptr, N_OUT: tl.constexpr, HAS_SCALE: tl.constexpr,
            HAS_RES: tl.constexpr, INTERPRETED: tl.constexpr):
    """The epilogue's layer scale and residual add, then the store of y [BM, BN] (in o's dtype); returns y."""
    dtype = o_ptr.dtype.element_ty
    if HAS_SCALE:
        s = tl.load(scale_ptr + layer * N_OUT + n, mask=n_ok, other=0.0).to(tl.float32)
        y = tm.to_dtype(s[None, :] * y.to(tl.float32), dtype, INTERPRETED)
    offs = m[:, None] * N_OUT + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        r = tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = tm.to_dtype(r + y.to(tl.float32), dtype, INTERPRETED)
    tl.store(o_ptr + offs, y, mask=ok)
    return y


@triton.jit
def _kernel(layer_ptr, x_ptr, w_ptr, nw_ptr, nb_ptr, scale_ptr, res_ptr, o_ptr, M, eps,
            N: tl.constexpr, K: tl.constexpr, N_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, NORM: tl.constexpr, INV_K: tl.constexpr, NORM_UNROLL: tl.constexpr, GELU: tl.constexpr,
            HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr, FUSED: tl.constexpr, STAGES: tl.constexpr,
            INTERPRETED: tl.constexpr):
    """Program (i, j): rows i*BM .. and columns j*BN .. of the output (no act, or GELU)."""
    layer = tl.load(layer_ptr).to(tl.int64)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok = m < M
    n_ok = n < N_OUT
    dtype = o_ptr.dtype.element_ty
    acc = _acc(x_ptr, w_ptr + layer * N * K, nw_ptr + layer * K, nb_ptr + layer * K, eps, m, m_ok, n, n_ok, K, BM,
               BN, BK, NORM, INV_K, NORM_UNROLL, FUSED, STAGES, INTERPRETED)
    y = tm.to_dtype(acc, dtype, INTERPRETED)
    if GELU:
        y = tm.to_dtype(tm.gelu(y.to(tl.float32)), dtype, INTERPRETED)
    _finish(y, layer, m, m_ok, n, n_ok, scale_ptr, res_ptr, o_ptr, N_OUT, HAS_SCALE, HAS_RES, INTERPRETED)


@triton.jit
def _gate_kernel(layer_ptr, ab_ptr, scale_ptr, res_ptr, o_ptr, M, N_OUT: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr, INTERPRETED: tl.constexpr):
    """The silu gate of the contract on ab [M, 2 * N_OUT], the projection already rounded to the
    dtype (columns n and n + N_OUT), then scale and residual: to_dtype(to_dtype(silu(a)) * b)."""
    layer = tl.load(layer_ptr).to(tl.int64)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok = m < M
    n_ok = n < N_OUT
    ok = m_ok[:, None] & n_ok[None, :]
    offs = m[:, None] * (2 * N_OUT) + n[None, :]
    a = tl.load(ab_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(ab_ptr + offs + N_OUT, mask=ok, other=0.0).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    y = tm.to_dtype(tm.to_dtype(tm.silu(a), dtype, INTERPRETED).to(tl.float32) * b, dtype, INTERPRETED)
    _finish(y, layer, m, m_ok, n, n_ok, scale_ptr, res_ptr, o_ptr, N_OUT, HAS_SCALE, HAS_RES, INTERPRETED)


@triton.jit
def _mma_accumulate(x_ptr, w_ptr, nw_ptr, nb_ptr, eps, m, m_ok, n, N_OUT, K: tl.constexpr, R: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, INV_K: tl.constexpr,
                    NORM_UNROLL: tl.constexpr, GATE: tl.constexpr, STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    """The MMA form's loop of one program (the Pallas twin's `_mma_accumulate`): acc [BN, R] +=
    w[n, block] @ x[m, block]^T over the K blocks in order (w_ptr: the layer's [N, K]); with GATE,
    acc_b the same for columns n + N_OUT (else zeros). Rows past M (not m_ok) read as 0. NORM
    ("rms", "layer" or ""): the fused norm (nw_ptr, nb_ptr: the layer's [K]), the rows' statistics
    first, then each x block normalized and rounded to x's dtype before its product."""
    k = tl.arange(0, BK)
    acc = tl.zeros([BN, R], tl.float32)
    acc_b = tl.zeros([BN, R], tl.float32)
    if NORM != "":
        mean, r = twin_norm.row_stats(x_ptr, m, m_ok, eps, INV_K, K, R, BK, NORM == "rms", NORM_UNROLL)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        xb = tl.load(x_ptr + m[:, None] * K + k0 + k[None, :], mask=m_ok[:, None], other=0.0)
        if NORM != "":
            xb = tm.to_dtype(twin_norm.normalize(xb.to(tl.float32), nw_ptr, nb_ptr, k0 + k, mean, r, NORM == "rms"),
                             x_ptr.dtype.element_ty, INTERPRETED)
        acc += tm.mma(tl.load(w_ptr + n[:, None] * K + k0 + k[None, :]), tl.trans(xb), INTERPRETED)
        if GATE:
            acc_b += tm.mma(tl.load(w_ptr + (n[:, None] + N_OUT) * K + k0 + k[None, :]), tl.trans(xb),
                            INTERPRETED)
    return acc, acc_b


@triton.jit
def _mma_kernel(layer_ptr, x_ptr, w_ptr, nw_ptr, nb_ptr, ss_ptr, scale_ptr, res_ptr, alpha_ptr, o_ptr,
                u_ptr, ss_out_ptr, M, eps, rms_eps, N: tl.constexpr, K: tl.constexpr, N_OUT: tl.constexpr,
                R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, INV_K: tl.constexpr,
                NORM_UNROLL: tl.constexpr, ACT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr,
                RMS: tl.constexpr, RMS_INV_K: tl.constexpr, SPLIT: tl.constexpr, SPLIT_OFFSET: tl.constexpr,
                SPLIT_L: tl.constexpr, STAGES: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """Program (i, j): columns j*BN .. of rows i*R .. (R: `contract.linear.twin_mma_rows`), the MMA form of the
    contract: acc [BN, R] += w_block @ x_block^T over the K blocks in order; ACT "", "gelu" or
    "silu_gate" (columns n and n + N_OUT in two accumulators, the gate in the epilogue); NORM: the
    fused norm (`_mma_accumulate`); RMS, SPLIT: the split norm's halves (`contract.norm.TwinSplit`)."""
    layer = tl.load(layer_ptr).to(tl.int64)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    m = tl.program_id(0) * R + tl.arange(0, R)
    m_ok = m < M
    n_ok = n < N_OUT
    acc, acc_b = _mma_accumulate(x_ptr, w_ptr + layer * N * K, nw_ptr + layer * K, nb_ptr + layer * K, eps, m, m_ok,
                                 n, N_OUT, K, R, BN, BK, NORM, INV_K, NORM_UNROLL, ACT == "silu_gate", STAGES,
                                 INTERPRETED)
    dtype = o_ptr.dtype.element_ty
    acc = tl.trans(acc)                                                                    # [R, BN]
    acc_b = tl.trans(acc_b)
    if RMS:
        r = twin_norm.split_r(ss_ptr, m, m_ok, rms_eps, RMS_INV_K, K, R)
        acc = acc * r[:, None]
        acc_b = acc_b * r[:, None]
    y = tm.to_dtype(acc, dtype, INTERPRETED)
    if ACT == "silu_gate":
        b = tm.to_dtype(acc_b, dtype, INTERPRETED).to(tl.float32)
        y = tm.to_dtype(tm.to_dtype(tm.silu(y.to(tl.float32)), dtype, INTERPRETED).to(tl.float32) * b, dtype,
                        INTERPRETED)
    if ACT == "gelu":
        y = tm.to_dtype(tm.gelu(y.to(tl.float32)), dtype, INTERPRETED)
    y = _finish(y, layer, m, m_ok, n, n_ok, scale_ptr, res_ptr, o_ptr, N_OUT, HAS_SCALE, HAS_RES, INTERPRETED)
    if SPLIT:
        split_layer = tl.minimum(layer + SPLIT_OFFSET, SPLIT_L - 1)
        twin_norm.split_store(y, alpha_ptr + split_layer * N_OUT, tl.program_id(1) * BN, m, m_ok, u_ptr, ss_out_ptr,
                              N_OUT, R, BN, INTERPRETED)


def linear(x: torch.Tensor, w: torch.Tensor, layer=None, *, act: str | None = None,
           scale: torch.Tensor | None = None, residual: torch.Tensor | None = None, norm: TwinNorm | None = None,
           split: TwinSplit | None = None, rms: TwinRms | None = None, block_m: int | None = None,
           block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None, form: str | None = None):
    """y = epilogue(norm(x) @ w[layer].T), batch-invariant; the signature and bits of the Pallas twin.

    x: [M, K]; w: [L, N, K] with layer an int or int tensor, or [N, K] with layer=None; norm: a
    `TwinNorm` to fuse, or None; form: "lanes", "mma" or None (`contract.linear.twin_linear_form`).
    block_m (the MMA form's: 16, 32 or 64 rows, `contract.linear.twin_mma_rows`), block_n, num_warps (a
    power of two in 1..32), num_stages (of the pipelined loop over K; None: the form's default): speed
    only, never the bits.
    split, rms: the split RMSNorm (the Pallas twin's).

    Differentiable (a `torch.autograd.Function`: the Pallas twin's backward, `contract.grad`, on the
    Triton twins, the same bits) in x, w, scale, residual, the norm's weights and the split norm's
    (split.weight, rms.ss). Without gradients, the kernels run directly.
    """
    check_launch("linear", num_warps, num_stages)
    w, scale, norm, layer = stack_one_layer(w, scale, norm, layer)
    split = split_one_layer(split)
    nw, nb = (None, None) if norm is None else (norm.weight, norm.bias)
    kwargs = {"act": act, "scale": scale, "residual": residual, "norm": norm, "split": split, "rms": rms,
              "block_m": block_m, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages, "form": form}
    check_rms(rms)
    alpha, ss = None if split is None else split.weight, None if rms is None else rms.ss
    if not twin_grad.needs_grad(x, w, scale, residual, nw, nb, alpha, ss):
        return _linear(x, w, layer, **kwargs)
    check_twin_linear(x, w, act, scale, residual, norm)
    return _Linear.apply(x, w, tm.layer_tensor(layer, w.shape[0], x.device, "linear"), scale, residual, nw, nb, alpha,
                         ss, kwargs)


class _Linear(torch.autograd.Function):
    """`linear` with the backward of `contract.grad` (the Pallas twin's `_linear_bwd`, call for call)."""

    @staticmethod
    def forward(ctx, x, w, layer_t, scale, residual, nw, nb, alpha, ss, kwargs):
        out = _linear(x, w, layer_t, **kwargs)
        y = out[0] if alpha is not None else None  # the rows the split norm's derivative needs
        ctx.save_for_backward(x, w, layer_t, scale, nw, nb, alpha, ss, y)
        ctx.act, ctx.norm, ctx.form = kwargs["act"], kwargs["norm"], kwargs["form"]
        ctx.has_residual = residual is not None
        ctx.split_offset = None if alpha is None else kwargs["split"].offset
        ctx.rms_eps = None if ss is None else kwargs["rms"].eps
        return out

    @staticmethod
    @twin_grad.first_order("linear")
    def backward(ctx, *cotangents):
        x, w, layer_t, scale, nw, nb, alpha, ss, y = ctx.saved_tensors
        norm = None if ctx.norm is None else ctx.norm._replace(weight=nw, bias=nb)
        rms = None if ss is None else TwinRms(ss, ctx.rms_eps)
        dx, dw, dscale, dres, dnw, dnb, d_alpha, dss = _linear_backward(
            x, w, layer_t, scale, norm, rms, alpha, ctx.split_offset, y, cotangents, ctx.act, ctx.form,
            ctx.has_residual)
        return dx, dw, None, dscale, dres, dnw, dnb, d_alpha, dss, None


def _linear_backward(x, w, layer_t, scale, norm, rms, alpha, split_offset, y, cotangents, act, form, has_residual):
    """The linear's backward (`contract.grad`, steps 1-4, and the split norm's halves): the Pallas twin's
    `_linear_bwd`, call for call. cotangents: (dy,), or (dy, du, dss) with the split (alpha at
    split_offset, y the forward's rows). Returns the cotangents of (x, w, scale, residual, the norm's
    weight and bias, alpha, rms.ss), None where absent."""
    dy, d_alpha = cotangents[0].contiguous(), None
    if split_offset is not None:  # the producer's half: u's and ss's cotangents into y's
        row = torch.clamp(layer_t + split_offset, max=alpha.shape[0] - 1).to(torch.int32)
        dy, ta = twin_norm.split_grad(y, cotangents[1].contiguous(), cotangents[2].contiguous(), alpha, row, dy=dy)
        d_alpha = twin_grad.stacked(alpha, twin_grad.batch_sum(ta, alpha.dtype), row)
    xn = _norm_first(x, norm, layer_t)
    pre = None
    if act is not None or scale is not None:  # the projection the epilogue started from, again
        pre = _linear(xn, w, layer_t, rms=rms, form=form)
    dpre, ts = twin_grad.epilogue_grad(dy, pre, scale, layer_t, act=act)
    wl = w.index_select(0, layer_t.long())[0]                                        # [N, K]
    dxn = _linear(dpre, wl.t().contiguous())                                          # [M, K]
    dx, dnw, dnb, dss = dxn, None, None, None
    if rms is not None:  # the consumer's half: the scaled operand r * u, and u's and ss's cotangents
        xn, dx, dss = twin_norm.split_rms_grad(x, dxn, rms.ss, eps=rms.eps)
    dw = twin_grad.stacked(w, _linear(dpre.t().contiguous(), xn.t().contiguous()), layer_t)  # [N, K] at layer
    dscale = None if scale is None else twin_grad.stacked(scale, twin_grad.batch_sum(ts, scale.dtype), layer_t)
    if norm is not None:
        dx, tw = twin_norm.norm_grad(x, dxn, norm.weight, norm.bias, layer_t, kind=norm.kind, eps=norm.eps)
        dnw = twin_grad.stacked(norm.weight, twin_grad.batch_sum(tw, norm.weight.dtype), layer_t)
        if norm.bias is not None:
            dnb = twin_grad.stacked(norm.bias, twin_grad.batch_sum(dxn, norm.bias.dtype), layer_t)
    return dx, dw, dscale, dy if has_residual else None, dnw, dnb, d_alpha, dss


def _linear(x: torch.Tensor, w: torch.Tensor, layer=None, *, act: str | None = None,
            scale: torch.Tensor | None = None, residual: torch.Tensor | None = None, norm: TwinNorm | None = None,
            split: TwinSplit | None = None, rms: TwinRms | None = None, block_m: int | None = None,
            block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None, form: str | None = None):
    """`linear`'s kernels, not differentiated (the backward's own products call this)."""
    w, scale, norm, layer = stack_one_layer(w, scale, norm, layer)
    split = split_one_layer(split)
    M, K, N, N_out = check_twin_linear(x, w, act, scale, residual, norm)
    nw, nb = (None, None) if norm is None else (norm.weight, norm.bias)
    for name, t in (("x", x), ("w", w), ("scale", scale), ("residual", residual), ("norm.weight", nw),
                    ("norm.bias", nb), ("rms.ss", None if rms is None else rms.ss),
                    ("split.weight", None if split is None else split.weight)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"linear({name}): must be contiguous, got strides {t.stride()}")
    interpreted = interpreting(_kernel)
    gated = act == "silu_gate"
    layer_t = tm.layer_tensor(layer, w.shape[0], x.device, "linear")
    chosen = twin_linear_form(N_out, K, x.dtype, compiled=not interpreted, form=form)
    check_twin_split(split, rms, norm, M, K, N_out, chosen)
    if chosen == "mma":
        return _linear_mma(x, w, layer_t, M, K, N, N_out, act, scale, residual, norm, split, rms, block_m, block_n,
                           num_warps, num_stages, interpreted)
    if interpreted and block_n is None:  # one program per row block: the interpreter's cost is per program
        block_n = min(triton.next_power_of_2(N), TWIN_INTERPRET_MAX_BN)
    blocks = LinearBlocks.for_shapes(M, N, K, block_m, block_n, interpreted=interpreted, masked_n=interpreted)
    BM, BN, BK = blocks.block_m, blocks.block_n, blocks.block_k
    if norm is not None and not twin_fuse_norm(BM, interpreted):  # the norm kernel first: the same bits
        x = _norm_first(x, norm, layer_t)
        norm = nw = nb = None
    out = torch.empty((M, N_out), dtype=x.dtype, device=x.device)
    # silu_gate: the whole projection [M, N] first (each half rounded, as the contract rounds a and
    # b), then the gate: a fused gated kernel holds both halves' lanes and trees at once (207
    # registers with Triton 3.6, 200 us a layer on an H200, against ~60 for the two kernels)
    proj = torch.empty((M, N), dtype=x.dtype, device=x.device) if gated else out
    dummy = out  # never read when the flag is off
    _kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN))](
        layer_t, x, w, dummy if nw is None else nw, dummy if nb is None else nb,
        dummy if scale is None or gated else scale, dummy if residual is None or gated else residual,
        proj, M, 0.0 if norm is None else norm.eps, N=N, K=K, N_OUT=N, BM=BM, BN=BN, BK=BK,
        NORM="" if norm is None else norm.kind, INV_K=float(np.float32(1.0 / K)),
        NORM_UNROLL=twin_norm_unroll(K // BK, BM), GELU=act == "gelu",
        HAS_SCALE=scale is not None and not gated, HAS_RES=residual is not None and not gated,
        FUSED=x.dtype in (torch.bfloat16, torch.float16),
        STAGES=TWIN_TRITON_LINEAR_STAGES if num_stages is None else num_stages, INTERPRETED=interpreted,
        num_warps=num_warps, enable_fp_fusion=False)
    if gated:
        GB = min(_GATE_BN, triton.next_power_of_2(N_out))
        _gate_kernel[(triton.cdiv(M, BM), triton.cdiv(N_out, GB))](
            layer_t, proj, dummy if scale is None else scale, dummy if residual is None else residual, out, M,
            N_OUT=N_out, BM=BM, BN=GB, HAS_SCALE=scale is not None, HAS_RES=residual is not None,
            INTERPRETED=interpreted, num_warps=num_warps, enable_fp_fusion=False)
    return out


def _norm_first(x, norm: TwinNorm | None, layer_t):
    """x normalized by the norm kernel (the bits of the fused norm), or x itself where norm is None."""
    return x if norm is None else twin_norm.norm(x, norm.weight, norm.bias, layer_t, kind=norm.kind, eps=norm.eps)


def _linear_mma(x, w, layer_t, M, K, N, N_out, act, scale, residual, norm, split, rms, block_m, block_n, num_warps,
                num_stages, interpreted):
    """The MMA form (`_mma_kernel`): one launch with the gate, the norm fused or its kernel first (as
    the Pallas twin, `contract.linear.twin_mma_fuse_norm`); split, rms: the split norm's halves."""
    blocks = MmaBlocks.for_shapes(M, N_out, K, 1 + (act == "silu_gate"), split is not None, block_m, block_n)
    BN, BK, R = blocks.block_n, blocks.block_k, blocks.rows
    x, (nw, nb, eps), norm_consts = _mma_norm(x, norm, layer_t, K)
    out = torch.empty((M, N_out), dtype=x.dtype, device=x.device)
    u, ss_out = out, out  # unread where split is None (as the other absent operands)
    if split is not None:
        u = torch.empty_like(out)
        ss_out = torch.empty((M, N_out // TWIN_SPLIT_GROUP), dtype=torch.float32, device=x.device)
    # row blocks first (the fastest-varying program index): the Pallas twin's order, its weights once from memory
    _mma_kernel[(triton.cdiv(M, R), N_out // BN)](
        layer_t, x, w, nw, nb, out if rms is None else rms.ss, out if scale is None else scale,
        out if residual is None else residual, out if split is None else split.weight, out, u, ss_out,
        M, eps, 0.0 if rms is None else rms.eps, N=N, K=K, N_OUT=N_out, R=R, BN=BN, BK=BK,
        **norm_consts, ACT=act or "", HAS_SCALE=scale is not None, HAS_RES=residual is not None,
        RMS=rms is not None, RMS_INV_K=float(np.float32(1.0 / K)), SPLIT=split is not None,
        SPLIT_OFFSET=0 if split is None else split.offset, SPLIT_L=1 if split is None else split.weight.shape[0],
        STAGES=num_stages or twin_mma_stages(N_out, BN, BK, 1 + (act == "silu_gate"), rows=R, M=M),
        INTERPRETED=interpreted, num_warps=num_warps, enable_fp_fusion=False)
    return out if split is None else (out, u, ss_out)


def _mma_norm(x, norm: TwinNorm | None, layer_t, K: int):
    """(x or norm(x), (weight, bias, eps), the NORM constants) for an MMA kernel: the norm fused where
    `contract.linear.twin_mma_fuse_norm` says, else its kernel first (and the norm arguments unread)."""
    if norm is None or not twin_mma_fuse_norm(K):
        x = _norm_first(x, norm, layer_t)
        return x, (x, x, 0.0), {"NORM": "", "INV_K": 1.0, "NORM_UNROLL": 1}
    consts = {"NORM": norm.kind, "INV_K": float(np.float32(1.0 / K)),
              "NORM_UNROLL": K // twin_lanes(K)}  # every block's load at once (a few), as the Pallas twin
    return x, (norm.weight, norm.weight if norm.bias is None else norm.bias, norm.eps), consts  # rms: bias unread


@triton.jit
def _qkv_kernel(layer_ptr, ring_layer_ptr, x_ptr, w_ptr, nw_ptr, nb_ptr, ss_ptr, cos_ptr, sin_ptr, slot_ptr, wmask_ptr, q_ptr, k_ptr,
                v_ptr, M, eps, rms_eps, RMS: tl.constexpr, RMS_INV_K: tl.constexpr, K: tl.constexpr, B: tl.constexpr,
                T: tl.constexpr, H: tl.constexpr, C: tl.constexpr,
                D: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr,
                INV_K: tl.constexpr, NORM_UNROLL: tl.constexpr, ROPE: tl.constexpr, STAGES: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """Program (i, j): the MMA form's columns j*BN .. of rows i*R .. of qkv, then rope_write's
    epilogue (the Pallas twin `_qkv_kernel`: a program's columns lie in one head, whole GPT-J pairs;
    ROPE: rotate q and k, else cos_ptr and sin_ptr are unread; ring_layer_ptr: the rings' layer)."""
    layer = tl.load(layer_ptr).to(tl.int64)
    n0 = tl.program_id(1) * BN
    n = n0 + tl.arange(0, BN)
    m = tl.program_id(0) * R + tl.arange(0, R)
    m_ok = m < M
    acc, _ = _mma_accumulate(x_ptr, w_ptr + layer * (3 * H * D) * K, nw_ptr + layer * K, nb_ptr + layer * K, eps, m,
                             m_ok, n, 0, K, R, BN, BK, NORM, INV_K, NORM_UNROLL, False, STAGES, INTERPRETED)
    dtype = q_ptr.dtype.element_ty
    acc = tl.trans(acc)                                                                    # [R, BN]
    if RMS:
        acc = acc * twin_norm.split_r(ss_ptr, m, m_ok, rms_eps, RMS_INV_K, K, R)[:, None]
    y = tm.to_dtype(acc, dtype, INTERPRETED)
    part = n0 // (H * D)
    h = (n0 // D) % H
    d0 = n0 % D
    HALF: tl.constexpr = BN // 2
    out = y
    if ROPE:
        cs = m[:, None] * (D // 2) + d0 // 2 + tl.arange(0, HALF)[None, :]
        cos = tl.load(cos_ptr + cs, mask=m_ok[:, None], other=0.0)
        sin = tl.load(sin_ptr + cs, mask=m_ok[:, None], other=0.0)
        r, i = tl.split(tl.reshape(y.to(tl.float32), [R, HALF, 2]))
        r2, i2 = twin_rope.rotate(r, i, cos, sin, dtype, INTERPRETED)
        if part < 2:  # v is not rotated
            out = tl.reshape(tl.join(r2, i2), [R, BN])
    cols = d0 + tl.arange(0, BN)[None, :]
    b = (m // T)[:, None]
    t = (m % T)[:, None]
    ok = tl.broadcast_to(m_ok[:, None], [R, BN])
    if part == 0:
        tl.store(q_ptr + ((b * H + h) * T + t) * D + cols, out, mask=ok)
    else:
        written = ok & (tl.load(wmask_ptr + m, mask=m_ok, other=0) != 0)[:, None]
        slot = tl.load(slot_ptr + m, mask=m_ok, other=0).to(tl.int64)[:, None]
        ring_layer = tl.load(ring_layer_ptr).to(tl.int64)
        ring = (((ring_layer * B + b) * H + h) * C + slot) * D + cols
        if part == 1:
            tl.store(k_ptr + ring, out, mask=written)
        else:
            tl.store(v_ptr + ring, out, mask=written)


def linear_rope_write(x: torch.Tensor, w: torch.Tensor, layer, cos: torch.Tensor | None, sin: torch.Tensor | None,
                      ring_k: torch.Tensor, ring_v: torch.Tensor, write_index: torch.Tensor, write_mask: torch.Tensor, *,
                      norm: TwinNorm | None = None, rms: TwinRms | None = None, ring_layer=None,
                      block_m: int | None = None, block_n: int | None = None, num_warps: int = 4,
                      num_stages: int | None = None, form: str | None = None):
    """The qkv projection with the RoPE rotation and the ring write in its epilogue (the Pallas
    twin's signature and bits): `linear` then `twin_rope.rope_write`, one kernel in the MMA form;
    cos = sin = None: no rotation; ring_layer: the rings' layer where not `layer`. Returns (q [B, H, T, D], ring_k, ring_v), the rings written in place.
    Differentiable as the Pallas twin (the one kernel: `_QkvRopeWrite`); without gradients, the kernels run directly."""
    B, T, H, D, M, K, N = check_twin_qkv(x, w, norm, cos, sin, ring_k, ring_v, write_index, write_mask,
                                         tm.host_values(write_index), tm.host_values(write_mask))
    check_launch("linear_rope_write", num_warps, num_stages)
    interpreted = interpreting(_qkv_kernel)
    chosen, BN = twin_qkv_plan(N, K, D, x.dtype, not interpreted, form, block_n)
    check_twin_split(None, rms, norm, M, K, N, chosen, "linear_rope_write")
    if chosen == "lanes":
        qkv = linear(x, w, layer, norm=norm, block_m=block_m, block_n=block_n, num_warps=num_warps,
                     num_stages=num_stages, form="lanes").view(B, T, 3, H, D)
        return twin_rope.rope_write(qkv, cos, sin, ring_k, ring_v, layer if ring_layer is None else ring_layer,
                                    write_index, write_mask)
    for name, t in (("x", x), ("w", w), ("cos", cos), ("sin", sin), ("ring_k", ring_k), ("ring_v", ring_v),
                    ("rms.ss", x if rms is None else rms.ss)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"linear_rope_write({name}): must be contiguous, got strides {t.stride()}")
    layer_t = tm.layer_tensor(layer, w.shape[0], x.device, "linear_rope_write")
    ring_t = layer_t if ring_layer is None else tm.layer_tensor(ring_layer, ring_k.shape[0], x.device,
                                                                "linear_rope_write(ring_layer)")
    nw, nb = (None, None) if norm is None else (norm.weight, norm.bias)
    ss = None if rms is None else rms.ss
    args = (x, w, layer_t, ring_t, nw, nb, ss, cos, sin, ring_k, ring_v, write_index, write_mask)
    kwargs = {"norm": norm, "rms": rms, "BN": BN, "block_m": block_m, "num_warps": num_warps, "num_stages": num_stages}
    if twin_grad.needs_grad(x, w, nw, nb, ss, cos, sin, ring_k, ring_v):
        return _QkvRopeWrite.apply(*args, kwargs)
    return _qkv_rope_write(*args, **kwargs)


class _QkvRopeWrite(torch.autograd.Function):
    """`linear_rope_write`'s one kernel for autograd: the rings written in place (marked dirty); the
    backward is `twin_rope.rope_write_bwd` on copies of the rings' cotangents, then the linear's
    (`_linear_backward`), as the Pallas twin's."""

    @staticmethod
    def forward(ctx, x, w, layer_t, ring_t, nw, nb, ss, cos, sin, ring_k, ring_v, write_index, write_mask, kwargs):
        if any(t is not None and t.requires_grad for t in (cos, sin)):
            raise NotImplementedError("linear_rope_write(cos, sin): the RoPE tables have no derivative here "
                                      "(functions of integer positions); differentiate x, w, the norm's weights and "
                                      "the rings only")
        out = _qkv_rope_write(x, w, layer_t, ring_t, nw, nb, ss, cos, sin, ring_k, ring_v, write_index, write_mask,
                              **kwargs)
        ctx.mark_dirty(ring_k, ring_v)
        ctx.save_for_backward(x, w, layer_t, ring_t, nw, nb, ss, cos, sin, write_index, write_mask)
        ctx.norm, ctx.rms_eps = kwargs["norm"], None if ss is None else kwargs["rms"].eps
        return out

    @staticmethod
    @twin_grad.first_order("linear_rope_write")
    def backward(ctx, dq, d_ring_k, d_ring_v):
        x, w, layer_t, ring_t, nw, nb, ss, cos, sin, write_index, write_mask = ctx.saved_tensors
        d_qkv, d_ring_k, d_ring_v = twin_rope.rope_write_bwd(
            dq.contiguous(), cos, sin, d_ring_k.clone(memory_format=torch.contiguous_format),
            d_ring_v.clone(memory_format=torch.contiguous_format), ring_t, write_index, write_mask)
        norm = None if ctx.norm is None else ctx.norm._replace(weight=nw, bias=nb)
        rms = None if ss is None else TwinRms(ss, ctx.rms_eps)
        dx, dw, _, _, dnw, dnb, _, dss = _linear_backward(x, w, layer_t, None, norm, rms, None, None, None,
                                                          (d_qkv.view(x.shape[0], w.shape[1]),), None, "mma", False)
        return dx, dw, None, None, dnw, dnb, dss, None, None, d_ring_k, d_ring_v, None, None, None


def _qkv_rope_write(x, w, layer_t, ring_t, nw, nb, ss, cos, sin, ring_k, ring_v, write_index, write_mask, *, norm,
                    rms, BN, block_m, num_warps, num_stages):
    """`linear_rope_write`'s one kernel (`_qkv_kernel`; its arguments checked, the plan's BN given), not
    differentiated: (q [B, H, T, D], ring_k, ring_v), the rings written in place."""
    (B, T), H, D = write_index.shape, ring_k.shape[2], ring_k.shape[4]
    M, K, N = x.shape[0], x.shape[1], w.shape[1]
    BK, R = twin_lanes(K), twin_mma_rows(M, N // BN, K, block_m, "linear_rope_write")
    x, (nw, nb, eps), norm_consts = _mma_norm(x, norm, layer_t, K)
    q = torch.empty((B, H, T, D), dtype=x.dtype, device=x.device)
    _qkv_kernel[(triton.cdiv(M, R), N // BN)](
        layer_t, ring_t, x, w, nw, nb, x if rms is None else rms.ss, x if cos is None else cos, x if sin is None else sin,
        write_index.to(torch.int32).contiguous(),
        write_mask.to(torch.int32).contiguous(), q, ring_k, ring_v, M, eps, 0.0 if rms is None else rms.eps,
        RMS=rms is not None, RMS_INV_K=float(np.float32(1.0 / K)), K=K, B=B, T=T, H=H,
        C=ring_k.shape[3], D=D, R=R, BN=BN, BK=BK, **norm_consts, ROPE=cos is not None,
        STAGES=num_stages or twin_mma_stages(N, BN, BK, rows=R, M=M), INTERPRETED=interpreting(_qkv_kernel), num_warps=num_warps,
        enable_fp_fusion=False)
    return q, ring_k, ring_v

# ------------------------------------------------------------------------------- the plain references
def linear_native(x, w, layer=None, *, act=None, scale=None, residual=None, norm=None, split=None, rms=None,
                  form=None, **_):
    """The plain torch reference of the lane form: the same signature and bits, without Triton (the
    MMA form's bits are the tensor cores': no plain reference has them)."""
    check_native_linear(form, split, rms)
    w, scale, norm, layer = stack_one_layer(w, scale, norm, layer)
    _, K, _, N_out = check_twin_linear(x, w, act, scale, residual, norm)
    check_index("linear_native", "layer", layer, w.shape[0], tm.host_values(layer), scalar=True)
    layer = int(layer) if isinstance(layer, torch.Tensor) else layer
    if norm is not None:
        x = twin_norm.norm_native(x, norm.weight, norm.bias, layer, kind=norm.kind, eps=norm.eps)
    dtype, f32 = x.dtype, torch.float32
    acc = tm.lanes_sum_native(x.to(f32)[:, None, :] * w[layer].to(f32)[None], twin_lanes(K))[..., 0]  # [M, N]
    if act == "silu_gate":
        a, b = acc[:, :N_out].to(dtype).to(f32), acc[:, N_out:].to(dtype).to(f32)
        y = (tm.silu_native(a).to(dtype).to(f32) * b).to(dtype)
    else:
        y = acc.to(dtype)
        if act == "gelu":
            y = tm.gelu_native(y.to(f32)).to(dtype)
    if scale is not None:
        y = (scale[layer].to(f32)[None, :] * y.to(f32)).to(dtype)
    if residual is not None:
        y = (residual.to(f32) + y.to(f32)).to(dtype)
    return y


def linear_rope_write_native(x, w, layer, cos, sin, ring_k, ring_v, write_index, write_mask, *, norm=None,
                             ring_layer=None, form=None, **_):
    """The plain torch reference of `linear_rope_write`'s lane form: `linear_native` then
    `twin_rope.rope_write_native` (the rings written in place), the same signature and bits."""
    B, T, H, D, *_ = check_twin_qkv(x, w, norm, cos, sin, ring_k, ring_v, write_index, write_mask,
                                    tm.host_values(write_index), tm.host_values(write_mask))
    qkv = linear_native(x, w, layer, norm=norm, form=form).reshape(B, T, 3, H, D)
    return twin_rope.rope_write_native(qkv, cos, sin, ring_k, ring_v, layer if ring_layer is None else ring_layer,
                                       write_index, write_mask)


__all__ = ["linear", "linear_native", "linear_rope_write", "linear_rope_write_native"]
