"""The twin linears' backward kernels (Triton): the twin of `kernels_pallas.twin_grad`
(its docstring and `contract.grad` state the contract; same signatures, same bits), plain torch
references (`*_native`) beside them."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels_pallas.contract.grad import INV_SQRT_2PI, GradBlocks
from kernels_pallas.contract.linear import LINEAR_ACTS
from kernels_pallas.contract.numerics import SQRT1_2, check_twin_dtype
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting

_INV_SQRT_2PI = tl.constexpr(INV_SQRT_2PI)
_SQRT1_2 = tl.constexpr(SQRT1_2)


def needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these tensors (None: absent): the twins' public functions
    run their kernels directly otherwise (no autograd node: inference, CUDA graphs)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def first_order(name: str):
    """Decorates a twin's `autograd.Function.backward`: the twin kernels record no graph, so a backward
    with create_graph=True (the way to a second derivative) is refused (NotImplementedError) rather
    than handing back a first derivative whose own derivative would silently be zero."""

    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *cotangents):
            if torch.is_grad_enabled():
                raise NotImplementedError(f"{name}: the twin kernels have no second derivative (a backward with "
                                          "create_graph=True); use kernels=\"reference\" (the *_native functions)")
            return backward(ctx, *cotangents)

        return checked

    return wrap


def stacked(w: torch.Tensor, g: torch.Tensor, layer_t: torch.Tensor) -> torch.Tensor:
    """The cotangent of a stacked weight w [L, ...] read at layer_t (an int32 tensor [1]): g (one
    layer's, [...]) in its row of an [L, ...] of zeros (`contract.grad`)."""
    return torch.zeros_like(w).index_copy_(0, layer_t.reshape(1).long(), g.to(w.dtype)[None])


def check_epilogue_grad(dy, pre, scale, act):
    """(M, N_out, parts) of an epilogue_grad call, checked (the Pallas twin's check)."""
    if act not in LINEAR_ACTS:
        raise ValueError(f"epilogue_grad(act): must be one of {LINEAR_ACTS}, got {act!r}")
    check_twin_dtype("epilogue_grad", "dy", dy)
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


# -------------------------------------------------------------------------------- the batch sum
@triton.jit
def _batch_sum_kernel(t_ptr, o_ptr, M, N: tl.constexpr, BN: tl.constexpr, INTERPRETED: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    acc = tl.zeros([BN], tl.float32)
    for m in range(M):
        acc = acc + tl.load(t_ptr + m * N + n).to(tl.float32)
    tl.store(o_ptr + n, tm.to_dtype(acc, o_ptr.dtype.element_ty, INTERPRETED))


def check_batch_sum(t, dtype):
    """(M, N) of a batch_sum call, checked (the Pallas twin's check)."""
    check_twin_dtype("batch_sum", "t", t)
    check_twin_dtype("batch_sum", "dtype", torch.empty(0, dtype=dtype, device="meta"))
    if t.dim() != 2 or t.shape[0] < 1:
        raise ValueError(f"batch_sum(t): expected [M >= 1, N], got shape {tuple(t.shape)}")
    return tuple(t.shape)


def batch_sum(t: torch.Tensor, dtype) -> torch.Tensor:
    """Each column's sum of t [M, N] over the rows in increasing order (the Pallas twin's bits)."""
    M, N = check_batch_sum(t, dtype)
    t = t.contiguous()
    out = torch.empty((N,), dtype=dtype, device=t.device)
    interpreted = interpreting(_batch_sum_kernel)
    BN = GradBlocks.for_shapes(M, N, interpreted).block_n
    _batch_sum_kernel[(N // BN,)](t, out, M, N=N, BN=BN, INTERPRETED=interpreted, num_warps=4,
                                  enable_fp_fusion=False)
    return out


def batch_sum_native(t, dtype, **_):
    """The plain torch reference of `batch_sum`: the same signature and bits, without Triton."""
    check_batch_sum(t, dtype)
    acc = torch.zeros(t.shape[1:], dtype=torch.float32, device=t.device)
    for m in range(t.shape[0]):
        acc = acc + t[m].float()
    return acc.to(dtype)


__all__ = ["batch_sum", "batch_sum_native", "epilogue_grad", "epilogue_grad_native"]
