"""The codec's twin operations, torch side: the twin of `kernels_pallas.twin_conv` (its docstring
states the contract; the same signatures and bits). ELU and the quantizer's nearest entry are
Triton kernels, the convolutions run `kernels_triton.twin_linear.linear` on their gathered taps;
plain torch references `elu_native` and `nearest_native` beside them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_pallas.contract.conv import (
    ELU_BLOCK,
    NEAREST_BLOCK,
    check_conv1d,
    check_conv_transpose1d,
    check_nearest,
)
from kernels_pallas.contract.numerics import EXP_POLY, LN2_HI, LN2_LO, LOG2E, largest_pow2_divisor, twin_lanes
from kernels_triton import twin_linear
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting


def _check_float(who: str, name: str, x: torch.Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{who}({name}): expected a float tensor, got {x.dtype}")


@triton.jit
def _elu_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
    y = tl.where(x > 0.0, x, tm.exp(x) - 1.0)
    tl.store(o_ptr + i, tm.to_dtype(y, o_ptr.dtype.element_ty, INTERPRETED), mask=ok)


def elu(x: torch.Tensor) -> torch.Tensor:
    """The contract's ELU of every element of x (any shape, float); x's shape and dtype."""
    _check_float("elu", "x", x)
    flat = x.contiguous().reshape(-1)
    out = torch.empty_like(flat)
    n = flat.numel()
    interpreted = interpreting(_elu_kernel)
    block = max(ELU_BLOCK, triton.next_power_of_2(n)) if interpreted else ELU_BLOCK  # interpreted: one program
    _elu_kernel[(triton.cdiv(n, block),)](flat, out, n, BLOCK=block, INTERPRETED=interpreted, num_warps=4,
                                          enable_fp_fusion=False)
    return out.reshape(x.shape)


def elu_native(x: torch.Tensor, **_) -> torch.Tensor:
    """The plain torch reference of `elu`: the same signature and bits (torch ops, one rounding each)."""
    _check_float("elu", "x", x)
    xf = x.float()
    return torch.where(xf > 0, xf, exp_native(xf) - 1.0).to(x.dtype)


def exp_native(x: torch.Tensor) -> torch.Tensor:
    """`kernels_pallas.twin_math.exp` in torch ops (float32), for the plain references."""
    n = torch.floor(x * LOG2E + 0.5).clamp(-126.0, 127.0)
    r = (x - n * LN2_HI) - n * LN2_LO
    r2 = r * r
    p = torch.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    pow2 = ((n.to(torch.int32) + 127) * (1 << 23)).view(torch.float32)
    y = (p * r2 + r + 1.0) * pow2
    y = torch.where(x < -87.3, 0.0, y)
    y = torch.where(x > 88.7, float("inf"), y)
    return torch.where(torch.isnan(x), x, y)


def conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, stride: int = 1,
           dilation: int = 1, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The contract's convolution, unpadded: x [B, in, L], w [out, in, k], bias [out] -> [B, out, T];
    residual [B, out, T] added last. The signature and bits of the Pallas twin."""
    B, cin, _, cout, k, T = check_conv1d(x, w, bias, residual, stride, dilation)
    taps = (torch.arange(T, device=x.device)[:, None] * stride
            + torch.arange(k, device=x.device)[None, :] * dilation)                    # [T, k]
    cols = x[:, :, taps].permute(0, 2, 1, 3).reshape(B * T, cin * k).contiguous()
    y = twin_linear.linear(cols, w.reshape(cout, cin * k).contiguous()).reshape(B, T, cout).transpose(1, 2)
    if bias is not None:
        y = y + bias[:, None]
    return y if residual is None else y + residual


def conv_transpose1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, stride: int = 1,
                     groups: int = 1) -> torch.Tensor:
    """The contract's transposed convolution, unpadded: x [B, in, T], w [in, out / groups, k] (groups 1
    or channel-wise), bias [out] -> [B, out, (T - 1) * stride + k]. The bits of the Pallas twin."""
    B, cin, T, cout, k = check_conv_transpose1d(x, w, bias, stride, groups)
    if groups == 1:
        rows = x.transpose(1, 2).reshape(B * T, cin).contiguous()
        z = twin_linear.linear(rows, w.permute(1, 2, 0).reshape(cout * k, cin).contiguous()).reshape(B, T, cout, k)
    else:
        z = x.transpose(1, 2)[..., None] * w[:, 0][None, None]                           # [B, T, C, k]
    n = -(-k // stride)
    z = torch.nn.functional.pad(z, (0, n * stride - k)).reshape(B, T, cout, n, stride)
    y = None
    for h in range(n):
        block = torch.nn.functional.pad(z[:, :, :, h], (0, 0, 0, 0, h, n - 1 - h))      # [B, T+n-1, out, stride]
        y = block if y is None else y + block
    y = y.permute(0, 2, 1, 3).reshape(B, cout, (T + n - 1) * stride)[..., :(T - 1) * stride + k]
    return y if bias is None else y + bias[:, None]


@triton.jit
def _nearest_kernel(x_ptr, e_ptr, o_ptr, N: tl.constexpr, D: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    m = tl.program_id(0)
    best = tl.full([], float("inf"), tl.float32)
    arg = tl.full([], 0, tl.int32)
    for nb in range(N // BN):
        rows = nb * BN + tl.arange(0, BN)
        acc = tl.zeros([BN, BK], tl.float32)
        for kb in tl.static_range(D // BK):
            cols = kb * BK + tl.arange(0, BK)
            xb = tl.load(x_ptr + m * D + cols).to(tl.float32)
            d = xb[None, :] - tl.load(e_ptr + rows[:, None] * D + cols[None, :]).to(tl.float32)
            acc = acc + d * d
        dist = tm.tree_sum(acc, BN, BK, True)
        dist = tl.where(dist != dist, float("inf"), dist)  # noqa: PLR0124
        least = tl.min(dist, 0)
        index = tl.min(tl.where(dist == least, rows, N), 0)
        take = least < best  # strict: an equal distance in a later block keeps the earlier entry
        best = tl.where(take, least, best)
        arg = tl.where(take, index, arg)
    tl.store(o_ptr + m, arg)


def nearest(x: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """The contract's nearest entry of each row: x [M, D], entries [N, D] -> int32 [M]."""
    M, N, D = check_nearest(x, entries)
    out = torch.empty(M, dtype=torch.int32, device=x.device)
    if M:
        _nearest_kernel[(M,)](x.contiguous(), entries.contiguous(), out, N=N, D=D,
                              BN=largest_pow2_divisor(N, NEAREST_BLOCK), BK=twin_lanes(D), num_warps=4,
                              enable_fp_fusion=False)
    return out


def nearest_native(x: torch.Tensor, entries: torch.Tensor, **_) -> torch.Tensor:
    """The plain torch reference of `nearest`: the same signature and bits."""
    M, N, D = check_nearest(x, entries)
    BK = twin_lanes(D)
    d = x.float()[:, None, :] - entries.float()[None]                                    # [M, N, D]
    p = (d * d).reshape(M, N, D // BK, BK)
    acc = torch.zeros(M, N, BK, dtype=torch.float32, device=x.device)
    for kb in range(D // BK):
        acc = acc + p[:, :, kb]
    while acc.shape[-1] > 1:
        half = acc.shape[-1] // 2
        acc = acc[..., :half] + acc[..., half:]
    dist = acc[..., 0].nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    best = dist.min(dim=1, keepdim=True).values
    return torch.where(dist == best, torch.arange(N, dtype=torch.int32, device=x.device), N).min(dim=1).values


__all__ = ["conv1d", "conv_transpose1d", "elu", "elu_native", "nearest", "nearest_native"]
