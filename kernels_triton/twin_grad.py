"""The twin linears' and norms' backward kernels (Triton): the twin of `kernels_pallas.twin_grad`
(its docstring and `contract.grad` state the contract; same signatures, same bits), plain torch
references (`*_native`) beside them."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels_pallas.contract.grad import INV_SQRT_2PI, GradBlocks
from kernels_pallas.contract.linear import LINEAR_ACTS
from kernels_pallas.contract.norm import TWIN_NORM_WARPS, NormBlocks, check_twin_norm, twin_norm_unroll
from kernels_pallas.contract.numerics import SQRT1_2, twin_lanes
from kernels_triton import twin_math as tm
from kernels_triton import twin_norm
from kernels_triton.twin_math import interpreting

_INV_SQRT_2PI = tl.constexpr(INV_SQRT_2PI)
_SQRT1_2 = tl.constexpr(SQRT1_2)


def check_epilogue_grad(dy, pre, scale, act):
    """(M, N_out, parts) of an epilogue_grad call, checked (the Pallas twin's check)."""
    if act not in LINEAR_ACTS:
        raise ValueError(f"epilogue_grad(act): must be one of {LINEAR_ACTS}, got {act!r}")
    if dy.dim() != 2:
        raise ValueError(f"epilogue_grad(dy): expected [M, N_out], got shape {tuple(dy.shape)}")
    M, N_out = dy.shape
    parts = 2 if act == "silu_gate" else 1
    if pre is None and (act is not None or scale is not None):
        raise ValueError(f"epilogue_grad(pre): act={act!r} or a scale needs the projection before the epilogue")
    if pre is not None and (tuple(pre.shape) != (M, parts * N_out) or pre.dtype != dy.dtype):
        raise ValueError(f"epilogue_grad(pre): expected {dy.dtype} [{M}, {parts * N_out}], got {pre.dtype} "
                         f"{tuple(pre.shape)}")
    if scale is not None and (scale.dim() != 2 or scale.shape[1] != N_out):
        raise ValueError(f"epilogue_grad(scale): expected [L, {N_out}], got shape {tuple(scale.shape)}")
    return M, N_out, parts


@triton.jit
def _epilogue_kernel(layer_ptr, dy_ptr, pre_ptr, scale_ptr, dpre_ptr, ts_ptr, M, N_OUT: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr, HAS_SCALE: tl.constexpr,
                     INTERPRETED: tl.constexpr):
    """Program (i, j): rows i*BM .., columns j*BN .. of dy (the gate: of each half of pre and dpre)."""
    layer = tl.load(layer_ptr).to(tl.int64)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = (m < M)[:, None] & (n < N_OUT)[None, :]
    offs = m[:, None] * N_OUT + n[None, :]
    dtype = dpre_ptr.dtype.element_ty
    g = tl.load(dy_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    s = g
    if HAS_SCALE:
        s = tl.load(scale_ptr + layer * N_OUT + n, mask=n < N_OUT, other=0.0).to(tl.float32)[None, :]
    if ACT == "silu_gate":
        pa = m[:, None] * (2 * N_OUT) + n[None, :]
        a = tl.load(pre_ptr + pa, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(pre_ptr + pa + N_OUT, mask=ok, other=0.0).to(tl.float32)
        d = 1.0 + tm.exp(-a)
        sig = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
        sa = tm.to_dtype(tl.math.div_rn(a, d), dtype, INTERPRETED).to(tl.float32)
        if HAS_SCALE:
            tl.store(ts_ptr + offs, g * tm.to_dtype(sa * b, dtype, INTERPRETED).to(tl.float32), mask=ok)
            g = s * g
        da = (g * b) * (sig * (1.0 + a * (1.0 - sig)))
        tl.store(dpre_ptr + pa, tm.to_dtype(da, dtype, INTERPRETED), mask=ok)
        tl.store(dpre_ptr + pa + N_OUT, tm.to_dtype(g * sa, dtype, INTERPRETED), mask=ok)
    else:
        p = tl.load(pre_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        if HAS_SCALE:
            y0 = p
            if ACT == "gelu":
                y0 = tm.to_dtype(tm.gelu(p), dtype, INTERPRETED).to(tl.float32)
            tl.store(ts_ptr + offs, g * y0, mask=ok)
            g = s * g
        if ACT == "gelu":
            cdf = 0.5 * (1.0 + tm.erf(p * _SQRT1_2))
            pdf = tm.exp((p * p) * -0.5) * _INV_SQRT_2PI
            g = g * (cdf + p * pdf)
        tl.store(dpre_ptr + offs, tm.to_dtype(g, dtype, INTERPRETED), mask=ok)


def epilogue_grad(dy: torch.Tensor, pre: torch.Tensor | None, scale: torch.Tensor | None = None, layer=None, *,
                  act: str | None = None):
    """The twin linear's epilogue derivative: the Pallas twin's signature and bits; (dpre, ts or None)."""
    M, N_out, _ = check_epilogue_grad(dy, pre, scale, act)
    if pre is None:
        return dy, None
    dy, pre = dy.contiguous(), pre.contiguous()
    interpreted = interpreting(_epilogue_kernel)
    blocks = GradBlocks.for_shapes(M, N_out, interpreted)
    dpre = torch.empty_like(pre)
    ts = torch.empty((M, N_out), dtype=torch.float32, device=dy.device) if scale is not None else None
    layer = 0 if layer is None or scale is None else layer  # read with the scale only
    _epilogue_kernel[(triton.cdiv(M, blocks.block_m), N_out // blocks.block_n)](
        tm.layer_tensor(layer, 1 if scale is None else scale.shape[0], dy.device, "epilogue_grad"), dy, pre,
        dy if scale is None else scale.contiguous(), dpre, dpre if ts is None else ts, M, N_OUT=N_out,
        BM=blocks.block_m, BN=blocks.block_n, ACT=act or "", HAS_SCALE=scale is not None, INTERPRETED=interpreted,
        num_warps=4, enable_fp_fusion=False)
    return dpre, ts


def epilogue_grad_native(dy, pre, scale=None, layer=None, *, act=None, **_):
    """The plain torch reference of `epilogue_grad`: the same signature and bits, without Triton."""
    _, N_out, _ = check_epilogue_grad(dy, pre, scale, act)
    if pre is None:
        return dy, None
    dtype, f32 = dy.dtype, torch.float32
    g, p = dy.to(f32), pre.to(f32)
    s = None if scale is None else scale[0 if layer is None else int(layer)].to(f32)[None, :]
    ts = None
    if act == "silu_gate":
        a, b = p[:, :N_out], p[:, N_out:]
        d = 1.0 + tm.exp_native(-a)
        sig = 1.0 / d
        sa = (a / d).to(dtype).to(f32)
        if s is not None:
            ts = g * (sa * b).to(dtype).to(f32)
            g = s * g
        da = (g * b) * (sig * (1.0 + a * (1.0 - sig)))
        return torch.cat([da.to(dtype), (g * sa).to(dtype)], dim=1), ts
    if s is not None:
        ts = g * (tm.gelu_native(p).to(dtype).to(f32) if act == "gelu" else p)
        g = s * g
    if act == "gelu":
        cdf = 0.5 * (1.0 + tm.erf_native(p * SQRT1_2))
        pdf = tm.exp_native((p * p) * -0.5) * INV_SQRT_2PI
        g = g * (cdf + p * pdf)
    return g.to(dtype), ts


# --------------------------------------------------------------------------------------- the norm
@triton.jit
def _norm_kernel(layer_ptr, x_ptr, dy_ptr, w_ptr, dx_ptr, tw_ptr, M, eps, INV_D: tl.constexpr, D: tl.constexpr,
                 BM: tl.constexpr, BK: tl.constexpr, RMS: tl.constexpr, UNROLL: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """Rows i*BM ..: the forward's statistics, the row sums of the derivative over the BK blocks in
    order, then each block's dx and tw (`contract.grad`)."""
    layer = tl.load(layer_ptr).to(tl.int64)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = m < M
    mean, r = twin_norm.row_stats(x_ptr, m, m_ok, eps, INV_D, D, BM, BK, RMS, UNROLL)
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


def check_norm_grad(x, dy, weight, bias, kind):
    """(M, D) of a norm_grad call, checked (the Pallas twin's check)."""
    M, D = check_twin_norm(x, weight, bias, kind)
    if tuple(dy.shape) != (M, D) or dy.dtype != x.dtype:
        raise ValueError(f"norm_grad(dy): expected {x.dtype} [{M}, {D}], got {dy.dtype} {tuple(dy.shape)}")
    return M, D


def norm_grad(x: torch.Tensor, dy: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, layer=None,
              *, kind: str = "rms", eps: float, block_m: int | None = None):
    """The twin norm's derivative: the Pallas twin's signature and bits; (dx, tw float32)."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    M, D = check_norm_grad(x, dy, weight, bias, kind)
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
    _, D = check_norm_grad(x, dy, weight, bias, kind)
    BK, inv_d = twin_lanes(D), 1.0 / D
    xf, dyf = x.float(), dy.float()
    g = dyf * weight[int(layer)].float()[None, :]
    stats = twin_norm.row_stats_native(xf, D, kind, eps)
    if kind == "rms":
        (r,) = stats
        c = (tm.lanes_sum_native(g * xf, BK) * inv_d) * ((r * r) * r)
        return (g * r - xf * c).to(x.dtype), dyf * (xf * r)
    mean, r = stats
    xhat = (xf - mean) * r
    mg = tm.lanes_sum_native(g, BK) * inv_d
    mgx = tm.lanes_sum_native(g * xhat, BK) * inv_d
    return (r * ((g - mg) - xhat * mgx)).to(x.dtype), dyf * xhat


# -------------------------------------------------------------------------------- the batch sum
@triton.jit
def _batch_sum_kernel(t_ptr, o_ptr, M, N: tl.constexpr, BN: tl.constexpr, INTERPRETED: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros([BN], tl.float32)
    for m in range(M):
        acc = acc + tl.load(t_ptr + m * N + n).to(tl.float32)
    tl.store(o_ptr + n, tm.to_dtype(acc, o_ptr.dtype.element_ty, INTERPRETED))


def check_batch_sum(t):
    """(M, N) of a batch_sum call, checked."""
    if t.dim() != 2 or t.shape[0] < 1:
        raise ValueError(f"batch_sum(t): expected [M >= 1, N], got shape {tuple(t.shape)}")
    return tuple(t.shape)


def batch_sum(t: torch.Tensor, dtype) -> torch.Tensor:
    """Each column's sum of t [M, N] over the rows in increasing order (the Pallas twin's bits)."""
    M, N = check_batch_sum(t)
    t = t.contiguous()
    out = torch.empty((N,), dtype=dtype, device=t.device)
    interpreted = interpreting(_batch_sum_kernel)
    BN = GradBlocks.for_shapes(M, N, interpreted).block_n
    _batch_sum_kernel[(N // BN,)](t, out, M, N=N, BN=BN, INTERPRETED=interpreted, num_warps=4,
                                  enable_fp_fusion=False)
    return out


def batch_sum_native(t, dtype, **_):
    """The plain torch reference of `batch_sum`: the same signature and bits, without Triton."""
    check_batch_sum(t)
    acc = torch.zeros(t.shape[1:], dtype=torch.float32, device=t.device)
    for m in range(t.shape[0]):
        acc = acc + t[m].float()
    return acc.to(dtype)


__all__ = ["batch_sum", "batch_sum_native", "epilogue_grad", "epilogue_grad_native", "norm_grad", "norm_grad_native"]
