"""Batch-invariant RMSNorm and LayerNorm as a Triton kernel: the twin of `kernels_pallas.twin_norm`
(its docstring states the contract; same signature, same bits)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

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
from kernels_triton import twin_grad
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting


@triton.jit
def _term(x_ptr, m, m_ok, mean, k0, D: tl.constexpr, BK: tl.constexpr, SQUARE: tl.constexpr, CENTER: tl.constexpr):
    """Block k0 of rows m: x, x*x or (x - mean)^2, float32 [BM, BK]."""
    k = tl.arange(0, BK)
    v = tl.load(x_ptr + m[:, None] * D + k0 + k[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
    if CENTER:
        v = v - mean[:, None]
    if SQUARE:
        v = v * v
    return v


@triton.jit
def _row_sum(x_ptr, m, m_ok, mean, D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SQUARE: tl.constexpr,
             CENTER: tl.constexpr, UNROLL: tl.constexpr):
    """S(.) of the contract over rows m: of x, x*x, or (x - mean)^2; returns [BM]. UNROLL blocks
    per loop iteration, written out (`contract.norm.twin_norm_unroll`; the same additions either way)."""
    acc = tl.zeros([BM, BK], tl.float32)
    for k0 in tl.range(0, D, BK * UNROLL):
        for j in tl.static_range(UNROLL):  # their loads go out together
            acc = acc + _term(x_ptr, m, m_ok, mean, k0 + j * BK, D, BK, SQUARE, CENTER)
    return tm.tree_sum(acc, BM, BK)


@triton.jit
def row_stats(x_ptr, m, m_ok, eps, INV_D: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
              RMS: tl.constexpr, UNROLL: tl.constexpr):
    """(mean, r) [BM] of the contract for rows m of x [M, D] (mean 0 for RMS); twin_linear's fused
    norm calls this too."""
    zero = tl.zeros([BM], tl.float32)
    if RMS:
        return zero, _rms_r(_row_sum(x_ptr, m, m_ok, zero, D, BM, BK, True, False, UNROLL), eps, INV_D)
    mean = _row_sum(x_ptr, m, m_ok, zero, D, BM, BK, False, False, UNROLL) * INV_D
    var = _row_sum(x_ptr, m, m_ok, mean, D, BM, BK, True, True, UNROLL) * INV_D + eps
    return mean, tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.math.sqrt_rn(var))


@triton.jit
def _rms_r(ss, eps, INV_D: tl.constexpr):
    """The RMSNorm's r = 1 / sqrt(eps + ss * inv_D) from the rows' sums of squares ss [BM]."""
    var = eps + ss * INV_D
    return tl.math.div_rn(tl.full(var.shape, 1.0, tl.float32), tl.math.sqrt_rn(var))


@triton.jit
def normalize(x, w_ptr, b_ptr, cols, mean, r, RMS: tl.constexpr):
    """The contract's normalized rows x [BM, n] float32 at columns cols [n] of the weights
    (w_ptr, b_ptr: this layer's [D]); mean, r: `row_stats`."""
    w = tl.load(w_ptr + cols).to(tl.float32)[None, :]
    if RMS:
        y = x * (w * r[:, None])
    else:
        b = tl.load(b_ptr + cols).to(tl.float32)[None, :]
        y = ((x - mean[:, None]) * r[:, None]) * w + b
    return y


@triton.jit
def _kernel(layer_ptr, x_ptr, w_ptr, b_ptr, o_ptr, M, eps, INV_D: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
            BM: tl.constexpr, BK: tl.constexpr, RMS: tl.constexpr, UNROLL: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rows i*BM ..: the statistics over the BK blocks, then the whole rows (DP = D rounded up to a
    power of two, masked) normalized in one piece and stored once: block by block, each load after
    a store waited for it (the pointers may alias), one block at a time. Elementwise: the same bits."""
    layer = tl.load(layer_ptr).to(tl.int64)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < M
    mean, r = row_stats(x_ptr, m, m_ok, eps, INV_D, D, BM, BK, RMS, UNROLL)
    cols = tl.arange(0, DP)
    ok = m_ok[:, None] & (cols < D)[None, :]
    offs = m[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    y = normalize(x, w_ptr + layer * D, b_ptr + layer * D, tl.minimum(cols, D - 1), mean, r, RMS)  # in the ref
    tl.store(o_ptr + offs, tm.to_dtype(y, o_ptr.dtype.element_ty, INTERPRETED), mask=ok)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, layer=None, *,
         kind: str = "rms", eps: float, block_m: int | None = None, num_warps: int = TWIN_NORM_WARPS) -> torch.Tensor:
    """The contract's norm of each row of x [M, D] (the Pallas twin's signature and bits).

    Differentiable (a `torch.autograd.Function`: `norm_grad` and `twin_grad.batch_sum`, the Pallas
    twin's backward) in x, weight and bias; without gradients the kernel runs directly."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    check_twin_norm(x, weight, bias, kind)
    check_eps("norm(eps)", eps)
    check_launch("norm", num_warps)
    if not twin_grad.needs_grad(x, weight, bias):
        return _norm(x, weight, bias, layer, kind=kind, eps=eps, block_m=block_m, num_warps=num_warps)
    return _Norm.apply(x, weight, bias, tm.layer_tensor(layer, weight.shape[0], x.device, "norm"),
                       (kind, eps, block_m, num_warps))


class _Norm(torch.autograd.Function):
    """`norm` with the backward of `contract.grad` (the Pallas twin's `_norm_bwd`)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer_t, opts):
        ctx.save_for_backward(x, weight, bias, layer_t)
        ctx.opts = opts
        kind, eps, block_m, num_warps = opts
        return _norm(x, weight, bias, layer_t, kind=kind, eps=eps, block_m=block_m, num_warps=num_warps)

    @staticmethod
    @twin_grad.first_order("norm")
    def backward(ctx, dy):
        x, weight, bias, layer_t = ctx.saved_tensors
        kind, eps, block_m, _ = ctx.opts
        dy = dy.contiguous()
        dx, tw = norm_grad(x, dy, weight, bias, layer_t, kind=kind, eps=eps, block_m=block_m)
        dw = twin_grad.stacked(weight, twin_grad.batch_sum(tw, weight.dtype), layer_t)
        db = None if bias is None else twin_grad.stacked(bias, twin_grad.batch_sum(dy, bias.dtype), layer_t)
        return dx, dw, db, None, None


def _norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, layer, *, kind: str, eps: float,
          block_m: int | None, num_warps: int) -> torch.Tensor:
    """`norm`'s kernel, not differentiated."""
    M, D = check_twin_norm(x, weight, bias, kind)
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"norm({name}): must be contiguous, got strides {t.stride()}")
    blocks = NormBlocks.for_shapes(M, D, block_m, interpreting(_kernel))
    BM, BK = blocks.block_m, blocks.block_k
    out = torch.empty_like(x)
    _kernel[(triton.cdiv(M, BM),)](
        tm.layer_tensor(layer, weight.shape[0], x.device, "norm"), x, weight, weight if bias is None else bias, out, M,
        eps, INV_D=float(np.float32(1.0 / D)), D=D, DP=triton.next_power_of_2(D), BM=BM, BK=BK, RMS=kind == "rms",
        UNROLL=twin_norm_unroll(D // BK, BM), INTERPRETED=interpreting(_kernel), num_warps=num_warps,
        enable_fp_fusion=False)
    return out


# ------------------------------------------------------------------------------- the split RMSNorm
# (`contract.norm.TwinSplit`; the Pallas twin's `split_r`, `split_store` and `split`, the same bits)
_SPLIT_GROUP = tl.constexpr(TWIN_SPLIT_GROUP)


@triton.jit
def split_r(ss_ptr, m, m_ok, eps, INV_K: tl.constexpr, K: tl.constexpr, R: tl.constexpr):
    """r [R] of the split norm from the partial sums ss [M, K/G] of rows m."""
    G: tl.constexpr = K // _SPLIT_GROUP
    ss = tl.load(ss_ptr + m[:, None] * G + tl.arange(0, G)[None, :], mask=m_ok[:, None], other=0.0)
    return _rms_r(tm.tree_sum(ss, R, G), eps, INV_K)


@triton.jit
def split_store(y, alpha_ptr, n0, m, m_ok, u_ptr, ss_ptr, N: tl.constexpr, R: tl.constexpr, BN: tl.constexpr,
                INTERPRETED: tl.constexpr):
    """The producer's half for the output tile y [R, BN] at columns n0.. of rows m (BN = G); alpha_ptr:
    the layer's alpha [N]; u [M, N], ss [M, N/G]."""
    yf = y.to(tl.float32)
    n = n0 + tl.arange(0, BN)
    alpha = tl.load(alpha_ptr + n).to(tl.float32)
    ok = m_ok[:, None] & (n < N)[None, :]
    tl.store(u_ptr + m[:, None] * N + n[None, :], tm.to_dtype(yf * alpha[None, :], u_ptr.dtype.element_ty, INTERPRETED),
             mask=ok)
    tl.store(ss_ptr + m * (N // BN) + n0 // BN, tm.tree_sum(yf * yf, R, BN), mask=m_ok)


@triton.jit
def _split_kernel(layer_ptr, x_ptr, w_ptr, u_ptr, ss_ptr, M, D: tl.constexpr, R: tl.constexpr, G: tl.constexpr,
                  INTERPRETED: tl.constexpr):
    layer = tl.load(layer_ptr).to(tl.int64)
    m = tl.program_id(0) * R + tl.arange(0, R)
    n0 = tl.program_id(1) * G
    m_ok = m < M
    x = tl.load(x_ptr + m[:, None] * D + n0 + tl.arange(0, G)[None, :], mask=m_ok[:, None], other=0.0)
    split_store(x, w_ptr + layer * D, n0, m, m_ok, u_ptr, ss_ptr, D, R, G, INTERPRETED)


def split(x: torch.Tensor, weight: torch.Tensor, layer=None):
    """The producer's half of the split RMSNorm of x [M, D] itself: (u, ss), the Pallas twin's signature and bits.

    Differentiable (a `torch.autograd.Function`: `split_grad` and `twin_grad.batch_sum`, the Pallas
    twin's backward) in x and weight; without gradients the kernel runs directly."""
    if layer is None:
        weight, layer = weight[None], 0
    _, D = check_twin_norm(x, weight, None, "rms")
    if D % TWIN_SPLIT_GROUP:
        raise ValueError(f"split(x): D={D} must be a multiple of {TWIN_SPLIT_GROUP}")
    for name, t in (("x", x), ("weight", weight)):
        if not t.is_contiguous():
            raise ValueError(f"split({name}): must be contiguous, got strides {t.stride()}")
    layer_t = tm.layer_tensor(layer, weight.shape[0], x.device, "split")
    if twin_grad.needs_grad(x, weight):
        return _Split.apply(x, weight, layer_t)
    return _split(x, weight, layer_t)


class _Split(torch.autograd.Function):
    """`split` with the backward of `contract.grad` (the Pallas twin's `_split_bwd`)."""

    @staticmethod
    def forward(ctx, x, weight, layer_t):
        ctx.save_for_backward(x, weight, layer_t)
        return _split(x, weight, layer_t)

    @staticmethod
    @twin_grad.first_order("split")
    def backward(ctx, du, dss):
        x, weight, layer_t = ctx.saved_tensors
        dx, ta = split_grad(x, du.contiguous(), dss.contiguous(), weight, layer_t)
        return dx, twin_grad.stacked(weight, twin_grad.batch_sum(ta, weight.dtype), layer_t), None


def _split(x, weight, layer_t):
    """`split`'s kernel (its arguments checked), not differentiated."""
    M, D = x.shape
    u = torch.empty_like(x)
    ss = torch.empty((M, D // TWIN_SPLIT_GROUP), dtype=torch.float32, device=x.device)
    _split_kernel[(triton.cdiv(M, TWIN_MMA_ROWS), D // TWIN_SPLIT_GROUP)](
        layer_t, x, weight, u, ss, M, D=D, R=TWIN_MMA_ROWS,
        G=TWIN_SPLIT_GROUP, INTERPRETED=interpreting(_split_kernel), num_warps=TWIN_NORM_WARPS, enable_fp_fusion=False)
    return u, ss

# ------------------------------------------------------------------------------- the plain references
def _layer_index(layer) -> int:
    return int(layer) if isinstance(layer, torch.Tensor) else layer


def row_stats_native(xf: torch.Tensor, D: int, kind: str, eps: float) -> tuple[torch.Tensor, ...]:
    """The contract's row statistics of xf float32 [M, D] in plain torch: (r,) for rms, (mean, r) for
    layer, each [M, 1] (the kernels' `row_stats`)."""
    BK, inv_d = twin_lanes(D), 1.0 / D
    if kind == "rms":
        return (1.0 / _sqrt_rn(eps + tm.lanes_sum_native(xf * xf, BK) * inv_d),)
    mean = tm.lanes_sum_native(xf, BK) * inv_d
    c = xf - mean
    var = tm.lanes_sum_native(c * c, BK) * inv_d
    return mean, 1.0 / _sqrt_rn(var + eps)


def _sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """The correctly rounded float32 square root (the kernels' ``sqrt_rn``): torch's float32 CPU sqrt
    is not (sqrt(1.0467745065689087) came out 1 ulp off); the float64 root of a float32, rounded to
    float32, is."""
    return torch.sqrt(v.double()).float()


def norm_native(x, weight, bias=None, layer=None, *, kind: str = "rms", eps: float, **_):
    """The plain torch reference of `norm`: the same signature and bits, without Triton."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    _, D = check_twin_norm(x, weight, bias, kind)
    check_eps("norm(eps)", eps)
    xf = x.float()
    stats = row_stats_native(xf, D, kind, eps)
    w = weight[_layer_index(layer)].float()[None, :]
    if kind == "rms":
        return (xf * (w * stats[0])).to(x.dtype)
    mean, r = stats
    return (((xf - mean) * r) * w + bias[_layer_index(layer)].float()[None, :]).to(x.dtype)


def split_native(x, weight, layer=None, **_):
    """The plain torch reference of `split`: (u, ss), the same signature and bits, without Triton."""
    if layer is None:
        weight, layer = weight[None], 0
    M, D = check_twin_norm(x, weight, None, "rms")
    if D % TWIN_SPLIT_GROUP:
        raise ValueError(f"split(x): D={D} must be a multiple of {TWIN_SPLIT_GROUP}")
    xf = x.float()
    alpha = weight[_layer_index(layer)].float()[None, :]
    ss = tm.tree_sum_native((xf * xf).reshape(M, D // TWIN_SPLIT_GROUP, TWIN_SPLIT_GROUP))[..., 0]
    return (xf * alpha).to(x.dtype), ss


# ------------------------------------------------------------------------ the norm's derivative
# (`contract.grad`; its weights' sums over the batch: `twin_grad.batch_sum`)
@triton.jit
def _norm_kernel(layer_ptr, x_ptr, dy_ptr, w_ptr, dx_ptr, tw_ptr, M, eps, INV_D: tl.constexpr, D: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr, RMS: tl.constexpr, UNROLL: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """Rows i*BM ..: the forward's statistics, the row sums of the derivative over the BK blocks in
    order, then each block's dx and tw (`contract.grad`)."""
    layer = tl.load(layer_ptr).to(tl.int64)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < M
    mean, r = row_stats(x_ptr, m, m_ok, eps, INV_D, D, BM, BK, RMS, UNROLL)
    mean, r = mean[:, None], r[:, None]
    k = tl.arange(0, BK)
    w_row = w_ptr + layer * D
    acc_g = tl.zeros([BM, BK], tl.float32)
    acc_gx = tl.zeros([BM, BK], tl.float32)
    for k0 in range(0, D, BK):
        offs = m[:, None] * D + k0 + k[None, :]
        x = tl.load(x_ptr + offs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        g = tl.load(dy_ptr + offs, mask=m_ok[:, None], other=0.0).to(tl.float32) * \
            tl.load(w_row + k0 + k).to(tl.float32)[None, :]
        if RMS:
            acc_gx = acc_gx + g * x
        else:
            acc_g = acc_g + g
            acc_gx = acc_gx + g * ((x - mean) * r)
    mgx = (tm.tree_sum(acc_gx, BM, BK) * INV_D)[:, None]
    mg = (tm.tree_sum(acc_g, BM, BK) * INV_D)[:, None]
    c = mgx * ((r * r) * r)
    for k0 in range(0, D, BK):
        offs = m[:, None] * D + k0 + k[None, :]
        x = tl.load(x_ptr + offs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        g = dy * tl.load(w_row + k0 + k).to(tl.float32)[None, :]
        if RMS:
            dx = g * r - x * c
            tw = dy * (x * r)
        else:
            xhat = (x - mean) * r
            dx = r * ((g - mg) - xhat * mgx)
            tw = dy * xhat
        tl.store(dx_ptr + offs, tm.to_dtype(dx, dx_ptr.dtype.element_ty, INTERPRETED), mask=m_ok[:, None])
        tl.store(tw_ptr + offs, tw, mask=m_ok[:, None])


def norm_grad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, layer=None,
              *, kind: str = "rms", eps: float, block_m: int | None = None):
    """The twin norm's derivative: the Pallas twin's signature and bits; (dx, tw float32)."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    M, D = check_norm_grad(x, dy, weight, bias, kind, eps)
    x, dy, weight = x.contiguous(), dy.contiguous(), weight.contiguous()
    interpreted = interpreting(_norm_kernel)
    blocks = NormBlocks.for_shapes(M, D, block_m, interpreted)
    BM, BK = blocks.block_m, blocks.block_k
    dx = torch.empty_like(x)
    tw = torch.empty((M, D), dtype=torch.float32, device=x.device)
    _norm_kernel[(triton.cdiv(M, BM),)](
        tm.layer_tensor(layer, weight.shape[0], x.device, "norm_grad"), x, dy, weight, dx, tw, M, eps,
        INV_D=float(np.float32(1.0 / D)), D=D, BM=BM, BK=BK, RMS=kind == "rms", UNROLL=twin_norm_unroll(D // BK, BM),
        INTERPRETED=interpreted, num_warps=TWIN_NORM_WARPS, enable_fp_fusion=False)
    return dx, tw


def norm_grad_native(x, dy, weight, bias=None, layer=None, *, kind: str = "rms", eps: float, **_):
    """The plain torch reference of `norm_grad`: the same signature and bits, without Triton."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    _, D = check_norm_grad(x, dy, weight, bias, kind, eps)
    BK, inv_d = twin_lanes(D), 1.0 / D
    xf, dyf = x.float(), dy.float()
    g = dyf * weight[int(layer)].float()[None, :]
    stats = row_stats_native(xf, D, kind, eps)
    if kind == "rms":
        (r,) = stats
        c = (tm.lanes_sum_native(g * xf, BK) * inv_d) * ((r * r) * r)
        return (g * r - xf * c).to(x.dtype), dyf * (xf * r)
    mean, r = stats
    xhat = (xf - mean) * r
    mg = tm.lanes_sum_native(g, BK) * inv_d
    mgx = tm.lanes_sum_native(g * xhat, BK) * inv_d
    return (r * ((g - mg) - xhat * mgx)).to(x.dtype), dyf * xhat


# ------------------------------------------------------------------ the split RMSNorm's derivative
# (`contract.grad`; the Pallas twin's `split_grad` and `split_rms_grad`, the same bits)
@triton.jit
def _split_grad_kernel(row_ptr, y_ptr, du_ptr, dss_ptr, alpha_ptr, dy_ptr, dx_ptr, ta_ptr, M, N: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, HAS_DY: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (i, j): rows i*BM .., columns j*BN .. of y (each column's dss: its group's)."""
    row = tl.load(row_ptr).to(tl.int64)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (m < M)[:, None] & (n < N)[None, :]
    offs = m[:, None] * N + n[None, :]
    y = tl.load(y_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    du = tl.load(du_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    dss = tl.load(dss_ptr + m[:, None] * (N // _SPLIT_GROUP) + (n // _SPLIT_GROUP)[None, :], mask=ok, other=0.0)
    alpha = tl.load(alpha_ptr + row * N + n).to(tl.float32)[None, :]
    dx = du * alpha + (y + y) * dss
    if HAS_DY:
        dx = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32) + dx
    tl.store(dx_ptr + offs, tm.to_dtype(dx, dx_ptr.dtype.element_ty, INTERPRETED), mask=ok)
    tl.store(ta_ptr + offs, du * y, mask=ok)


def check_split_grad(y, du, dss, weight, dy):
    """(M, N) of a split_grad call, checked (the Pallas twin's check)."""
    check_twin_dtype("split_grad", "y", y)
    if y.dim() != 2 or y.shape[1] % TWIN_SPLIT_GROUP:
        raise ValueError(f"split_grad(y): expected [M, N] with N a multiple of {TWIN_SPLIT_GROUP}, got shape "
                         f"{tuple(y.shape)}")
    M, N = y.shape
    for name, t in (("du", du), ("dy", dy)):
        if t is not None and (tuple(t.shape) != (M, N) or t.dtype != y.dtype):
            raise ValueError(f"split_grad({name}): expected {y.dtype} [{M}, {N}], got {t.dtype} {tuple(t.shape)}")
    if tuple(dss.shape) != (M, N // TWIN_SPLIT_GROUP) or dss.dtype != torch.float32:
        raise ValueError(f"split_grad(dss): expected float32 [{M}, {N // TWIN_SPLIT_GROUP}], got {dss.dtype} "
                         f"{tuple(dss.shape)}")
    check_norm_params("rms", weight, None, N, "split_grad({})")
    return M, N


def split_grad(y: torch.Tensor, du: torch.Tensor, dss: torch.Tensor, weight: torch.Tensor, layer=None, *,
               dy: torch.Tensor | None = None):
    """The split norm's producer-half derivative: the Pallas twin's signature and bits; (dx, ta float32)."""
    if layer is None:
        weight, layer = weight[None], 0
    M, N = check_split_grad(y, du, dss, weight, dy)
    y, du, dss, weight = y.contiguous(), du.contiguous(), dss.contiguous(), weight.contiguous()
    interpreted = interpreting(_split_grad_kernel)
    blocks = GradBlocks.for_shapes(M, N, interpreted)
    dx = torch.empty_like(y)
    ta = torch.empty((M, N), dtype=torch.float32, device=y.device)
    _split_grad_kernel[(triton.cdiv(M, blocks.block_m), N // blocks.block_n)](
        tm.layer_tensor(layer, weight.shape[0], y.device, "split_grad"), y, du, dss, weight,
        y if dy is None else dy.contiguous(), dx, ta, M, N=N, BM=blocks.block_m, BN=blocks.block_n,
        HAS_DY=dy is not None, INTERPRETED=interpreted, num_warps=4, enable_fp_fusion=False)
    return dx, ta


def split_grad_native(y, du, dss, weight, layer=None, *, dy=None, **_):
    """The plain torch reference of `split_grad`: the same signature and bits, without Triton."""
    if layer is None:
        weight, layer = weight[None], 0
    check_split_grad(y, du, dss, weight, dy)
    yf, duf = y.float(), du.float()
    dx = duf * weight[_layer_index(layer)].float()[None, :] + (yf + yf) * dss.repeat_interleave(TWIN_SPLIT_GROUP, 1)
    if dy is not None:
        dx = dy.float() + dx
    return dx.to(y.dtype), duf * yf


@triton.jit
def _split_rms_grad_kernel(u_ptr, dxn_ptr, ss_ptr, xn_ptr, du_ptr, dss_ptr, M, eps, INV_K: tl.constexpr,
                           K: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Rows i*BM ..: r from the rows' partial sums (the forward's `split_r`), the row sums of dxn * u over
    the BK blocks in order, then ss's cotangent and each block's xn and du (`contract.grad`)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < M
    r = split_r(ss_ptr, m, m_ok, eps, INV_K, K, BM)
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, BK], tl.float32)
    for k0 in range(0, K, BK):
        offs = m[:, None] * K + k0 + k[None, :]
        acc = acc + tl.load(dxn_ptr + offs, mask=m_ok[:, None], other=0.0).to(tl.float32) * \
            tl.load(u_ptr + offs, mask=m_ok[:, None], other=0.0).to(tl.float32)
    c = (tm.tree_sum(acc, BM, BK) * INV_K) * ((r * r) * r)
    G: tl.constexpr = K // _SPLIT_GROUP
    g = tl.arange(0, G)
    tl.store(dss_ptr + m[:, None] * G + g[None, :], tl.broadcast_to((c * -0.5)[:, None], [BM, G]),
             mask=m_ok[:, None])
    dtype = xn_ptr.dtype.element_ty
    for k0 in range(0, K, BK):
        offs = m[:, None] * K + k0 + k[None, :]
        u = tl.load(u_ptr + offs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        dxn = tl.load(dxn_ptr + offs, mask=m_ok[:, None], other=0.0).to(tl.float32)
        tl.store(xn_ptr + offs, tm.to_dtype(u * r[:, None], dtype, INTERPRETED), mask=m_ok[:, None])
        tl.store(du_ptr + offs, tm.to_dtype(dxn * r[:, None], dtype, INTERPRETED), mask=m_ok[:, None])


def check_split_rms_grad(u, dxn, ss):
    """(M, K) of a split_rms_grad call, checked (the Pallas twin's check)."""
    check_twin_dtype("split_rms_grad", "u", u)
    if u.dim() != 2:
        raise ValueError(f"split_rms_grad(u): expected [M, K], got shape {tuple(u.shape)}")
    M, K = u.shape
    if tuple(dxn.shape) != (M, K) or dxn.dtype != u.dtype:
        raise ValueError(f"split_rms_grad(dxn): expected {u.dtype} [{M}, {K}], got {dxn.dtype} {tuple(dxn.shape)}")
    G = K // TWIN_SPLIT_GROUP
    if K % TWIN_SPLIT_GROUP or G & (G - 1) or tuple(ss.shape) != (M, G) or ss.dtype != torch.float32:
        raise ValueError(f"split_rms_grad(ss): expected float32 [M={M}, K/{TWIN_SPLIT_GROUP}] with a power-of-two "
                         f"count of groups, got {ss.dtype} {tuple(ss.shape)} (K={K})")
    return M, K


def split_rms_grad(u: torch.Tensor, dxn: torch.Tensor, ss: torch.Tensor, *, eps: float, block_m: int | None = None):
    """The split norm's consumer-half derivative: the Pallas twin's signature and bits; (xn, du, dss)."""
    M, K = check_split_rms_grad(u, dxn, ss)
    u, dxn, ss = u.contiguous(), dxn.contiguous(), ss.contiguous()
    interpreted = interpreting(_split_rms_grad_kernel)
    blocks = NormBlocks.for_shapes(M, K, block_m, interpreted)
    xn, du = torch.empty_like(u), torch.empty_like(u)
    dss = torch.empty_like(ss)
    _split_rms_grad_kernel[(triton.cdiv(M, blocks.block_m),)](
        u, dxn, ss, xn, du, dss, M, eps, INV_K=float(np.float32(1.0 / K)), K=K, BM=blocks.block_m,
        BK=blocks.block_k, INTERPRETED=interpreted, num_warps=TWIN_NORM_WARPS, enable_fp_fusion=False)
    return xn, du, dss


def split_rms_grad_native(u, dxn, ss, *, eps: float, **_):
    """The plain torch reference of `split_rms_grad`: the same signature and bits, without Triton."""
    _, K = check_split_rms_grad(u, dxn, ss)
    uf, dxnf = u.float(), dxn.float()
    r = 1.0 / _sqrt_rn(eps + tm.tree_sum_native(ss) * (1.0 / K))
    c = (tm.lanes_sum_native(dxnf * uf, twin_lanes(K)) * (1.0 / K)) * ((r * r) * r)
    return (uf * r).to(u.dtype), (dxnf * r).to(u.dtype), (c * -0.5).expand(ss.shape).contiguous()


__all__ = ["norm", "norm_grad", "norm_grad_native", "norm_native", "split", "split_grad", "split_grad_native",
           "split_native", "split_rms_grad", "split_rms_grad_native"]
