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
    carry_geometry,
    check_conv1d,
    check_conv_transpose1d,
    check_elu,
    check_nearest,
    check_signal,
    check_stream,
    check_taps,
    nearest_plan,
    next_pow2,
    taps_plan,
)
from kernels_pallas.contract.numerics import EXP_POLY, LN2_HI, LN2_LO, LOG2E, twin_lanes
from kernels_triton import twin_linear
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting


@triton.jit
def _elu_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    x = tl.load(x_ptr + i, mask=ok, other=0.0).to(tl.float32)
    y = tl.where(x > 0.0, x, tm.exp(x) - 1.0)
    tl.store(o_ptr + i, tm.to_dtype(y, o_ptr.dtype.element_ty, INTERPRETED), mask=ok)


def elu(x: torch.Tensor) -> torch.Tensor:
    """The contract's ELU of every element of x (any shape, float); x's shape and dtype."""
    check_elu(x)
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
    check_elu(x)
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


@triton.jit
def _source(x_ptr, carry_ptr, b, i, pos, pad_first, C: tl.constexpr, L: tl.constexpr, W: tl.constexpr,
            ROW: tl.constexpr, OFF: tl.constexpr, ELU: tl.constexpr, REPLICATE: tl.constexpr,
            INTERPRETED: tl.constexpr):
    """[carry, act(x)] of batch row b at channel i, position pos (`kernels_pallas.twin_conv._taps_kernel`)."""
    value = _x_at(x_ptr, b, i, pos - W, C, L, ELU, INTERPRETED)
    if W > 0:
        old = tl.load(carry_ptr + b * ROW + OFF + i * W + tl.minimum(tl.maximum(pos, 0), W - 1))
        if REPLICATE:
            old = tl.where(pad_first, _x_at(x_ptr, b, i, pos * 0, C, L, ELU, INTERPRETED), old)
        value = tl.where(pos < W, old, value)
    return value


@triton.jit
def _x_at(x_ptr, b, i, p, C: tl.constexpr, L: tl.constexpr, ELU: tl.constexpr, INTERPRETED: tl.constexpr):
    v = tl.load(x_ptr + (b * C + i) * L + tl.minimum(tl.maximum(p, 0), L - 1))
    if ELU:
        f = v.to(tl.float32)
        v = tm.to_dtype(tl.where(f > 0.0, f, tm.exp(f) - 1.0), x_ptr.dtype.element_ty, INTERPRETED)
    return v


@triton.jit
def _taps_kernel(x_ptr, carry_ptr, flags_ptr, cols_ptr, carry_out_ptr, C: tl.constexpr, L: tl.constexpr,
                 W: tl.constexpr, ROW: tl.constexpr, OFF: tl.constexpr, K: tl.constexpr, STRIDE: tl.constexpr,
                 DILATION: tl.constexpr, T: tl.constexpr, RT: tl.constexpr, CH: tl.constexpr, BC: tl.constexpr,
                 NW: tl.constexpr, ELU: tl.constexpr, REPLICATE: tl.constexpr, INTERPRETED: tl.constexpr):
    """The twin of `kernels_pallas.twin_conv._taps_kernel` (its docstring); the new carry goes to
    carry_out (a copy of the carry array: the torch codec's state is committed by its caller)."""
    b = tl.program_id(0)
    tile = tl.program_id(1)
    block = tl.program_id(2)
    active = True
    pad_first = False
    if W > 0:
        active = tl.load(flags_ptr + 2 * b) != 0
        if REPLICATE:
            pad_first = (tl.load(flags_ptr + 2 * b + 1) != 0) & active
    t = tile * RT + tl.arange(0, RT)[:, None]
    c = block * (CH * K) + tl.arange(0, BC)[None, :]
    ok = (t < T) & (c < tl.minimum((block + 1) * (CH * K), C * K))
    cc = tl.minimum(c, C * K - 1)
    i = cc // K
    j = c % K
    value = _source(x_ptr, carry_ptr, b, i, tl.minimum(t, T - 1) * STRIDE + j * DILATION, pad_first, C, L, W,
                    ROW, OFF, ELU, REPLICATE, INTERPRETED)
    tl.store(cols_ptr + (b * T + t) * (C * K) + c, value, mask=ok)
    if W > 0:  # noqa: SIM102 (W is a constexpr: compiled out, not a run-time test)
        if tile == 0:  # names of their own: a branch may not give the taps' names another shape
            e = block * (CH * W) + tl.arange(0, NW)
            kept = (e < (block + 1) * (CH * W)) & (e < C * W)
            channel = tl.minimum(e, C * W - 1) // W
            w = e % W
            old = tl.load(carry_ptr + b * ROW + OFF + channel * W + w)
            new = tl.where(active, _source(x_ptr, carry_ptr, b, channel, L + w, pad_first, C, L, W, ROW, OFF, ELU,
                                           REPLICATE, INTERPRETED), old)
            tl.store(carry_out_ptr + b * ROW + OFF + e, new, mask=kept)


def taps(x: torch.Tensor, *, kernel_size: int, stride: int = 1, dilation: int = 1, elu: bool = False,
         carry: torch.Tensor | None = None, carry_slot: tuple[int, int] | None = None,
         active: torch.Tensor | None = None, first: torch.Tensor | None = None, replicate: bool = False):
    """The tap matrix of a convolution over [carry, act(x)], one kernel: the Pallas twin's
    signature and bits; with carry returns (X, the new carry array), a new tensor (the carry is not
    written; a packed state is copied whole, its other carries as they were)."""
    B, C, L = check_signal("taps", x)
    check_stream("taps", x, carry, active, first, replicate, carry_slot)
    W, ROW, OFF = carry_geometry(x, carry, carry_slot)
    T = check_taps(kernel_size, stride, dilation, W + L)
    RT, CH, BC = taps_plan(T, C, kernel_size, W, stride)
    cols = torch.empty(B * T, C * kernel_size, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    if W:
        active = torch.ones(B, dtype=torch.bool, device=x.device) if active is None else active
        first = torch.zeros(B, dtype=torch.bool, device=x.device) if first is None else first
        flags = torch.stack([active, first], dim=1).to(torch.int32).reshape(-1)
        carry = carry.contiguous()
        new = torch.empty_like(carry) if carry_slot is None else carry.clone()
    else:
        flags = carry = new = x  # unread
    grid = (B, triton.cdiv(T, RT), triton.cdiv(C, CH))
    _taps_kernel[grid](x, carry, flags, cols, new, C=C, L=L, W=W, ROW=ROW, OFF=OFF, K=kernel_size, STRIDE=stride,
                       DILATION=dilation, T=T, RT=RT, CH=CH, BC=BC, NW=next_pow2(CH * W), ELU=elu, REPLICATE=replicate,
                       INTERPRETED=interpreting(_taps_kernel), num_warps=4, enable_fp_fusion=False)
    return (cols, new) if W else cols


def taps_native(x: torch.Tensor, *, kernel_size: int, stride: int = 1, dilation: int = 1, elu: bool = False,
                carry: torch.Tensor | None = None, carry_slot: tuple[int, int] | None = None,
                active: torch.Tensor | None = None, first: torch.Tensor | None = None, replicate: bool = False, **_):
    """The plain torch reference of `taps`: the same signature and bits."""
    B, C, _ = check_signal("taps", x)
    check_stream("taps", x, carry, active, first, replicate, carry_slot)
    if carry_slot is not None:  # the convolution's carry out of the packed state, and into a copy of it after
        (offset, width), packed = carry_slot, carry.clone()
        X, new = taps_native(x, kernel_size=kernel_size, stride=stride, dilation=dilation, elu=elu,
                             carry=packed[:, offset:offset + C * width].reshape(B, C, width), active=active,
                             first=first, replicate=replicate)
        packed[:, offset:offset + C * width] = new.reshape(B, C * width)
        return X, packed
    x = elu_native(x) if elu else x
    new = None
    if carry is not None:
        rows = (torch.ones(B, dtype=torch.bool, device=x.device) if active is None else active).view(-1, 1, 1)
        old = carry
        if replicate:
            carry = torch.where(first.view(-1, 1, 1) & rows, x[..., :1], carry)
        x = torch.cat([carry, x], dim=-1)
        new = torch.where(rows, x[..., x.shape[-1] - old.shape[-1]:], old)
    T = (x.shape[-1] - (kernel_size - 1) * dilation - 1) // stride + 1
    at = (torch.arange(T, device=x.device)[:, None] * stride
          + torch.arange(kernel_size, device=x.device)[None, :] * dilation)                 # [T, k]
    X = x[:, :, at].permute(0, 2, 1, 3).reshape(B * T, C * kernel_size)
    return X if new is None else (X, new)


def _conv1d(x, w, bias, residual, stride, dilation, elu, carry, slot, active, first, replicate, linear, make_taps):
    width = check_stream("conv1d", x, carry, active, first, replicate, slot)
    B, cin, _, cout, k, T = check_conv1d(x, w, bias, residual, stride, dilation, width)
    if k == 1 and stride == 1 and not elu and carry is None:  # the columns as they are: no taps kernel
        cols, new = x.transpose(1, 2).reshape(B * T, cin), None
    else:
        out = make_taps(x, kernel_size=k, stride=stride, dilation=dilation, elu=elu, carry=carry, carry_slot=slot,
                        active=active, first=first, replicate=replicate)
        cols, new = out if carry is not None else (out, None)
    y = linear(cols.contiguous(), w.reshape(cout, cin * k).contiguous()).reshape(B, T, cout).transpose(1, 2)
    if bias is not None:
        y = y + bias[:, None]
    y = y if residual is None else y + residual
    return y if carry is None else (y, new)


def conv1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, stride: int = 1,
           dilation: int = 1, residual: torch.Tensor | None = None, elu: bool = False,
           carry: torch.Tensor | None = None, carry_slot: tuple[int, int] | None = None,
           active: torch.Tensor | None = None, first: torch.Tensor | None = None, replicate: bool = False):
    """The contract's convolution, unpadded: the signature and bits of the Pallas twin (its
    docstring), the new carry a new tensor (the carry is not written)."""
    return _conv1d(x, w, bias, residual, stride, dilation, elu, carry, carry_slot, active, first, replicate,
                   twin_linear.linear, taps)


def conv1d_native(x, w, bias=None, *, stride=1, dilation=1, residual=None, elu=False, carry=None, carry_slot=None,
                  active=None, first=None, replicate=False, **_):
    """The plain torch reference of `conv1d`: the same signature and bits."""
    return _conv1d(x, w, bias, residual, stride, dilation, elu, carry, carry_slot, active, first, replicate,
                   twin_linear.linear_native, taps_native)


def _conv_transpose1d(x, w, bias, stride, groups, elu, linear, make_taps):
    B, cin, T, cout, k = check_conv_transpose1d(x, w, bias, stride, groups)
    if groups == 1 or elu:
        rows = make_taps(x, kernel_size=1, elu=elu)                                         # [B*T, in]
    if groups == 1:
        z = linear(rows.contiguous(), w.permute(1, 2, 0).reshape(cout * k, cin).contiguous()).reshape(B, T, cout, k)
    else:
        x = rows.reshape(B, T, cin) if elu else x.transpose(1, 2)
        z = x[..., None] * w[:, 0][None, None]                                             # [B, T, C, k]
    n = -(-k // stride)
    z = torch.nn.functional.pad(z, (0, n * stride - k)).reshape(B, T, cout, n, stride)
    y = None
    for h in range(n):
        block = torch.nn.functional.pad(z[:, :, :, h], (0, 0, 0, 0, h, n - 1 - h))      # [B, T+n-1, out, stride]
        y = block if y is None else y + block
    y = y.permute(0, 2, 1, 3).reshape(B, cout, (T + n - 1) * stride)[..., :(T - 1) * stride + k]
    return y if bias is None else y + bias[:, None]


def conv_transpose1d(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, stride: int = 1,
                     groups: int = 1, elu: bool = False) -> torch.Tensor:
    """The contract's transposed convolution, unpadded: the signature and bits of the Pallas twin."""
    return _conv_transpose1d(x, w, bias, stride, groups, elu, twin_linear.linear, taps)


def conv_transpose1d_native(x, w, bias=None, *, stride=1, groups=1, elu=False, **_):
    """The plain torch reference of `conv_transpose1d`: the same signature and bits."""
    return _conv_transpose1d(x, w, bias, stride, groups, elu, twin_linear.linear_native, taps_native)


@triton.jit
def _nearest_kernel(x_ptr, e_ptr, best_ptr, arg_ptr, N: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                    SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (m, s): the first least entry of row m among entries s * SPLIT.. (`nearest_plan`)."""
    m, s = tl.program_id(0), tl.program_id(1)
    best = tl.full([], float("inf"), tl.float32)
    arg = s * SPLIT
    for nb in range(SPLIT // BN):
        rows = s * SPLIT + nb * BN + tl.arange(0, BN)
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
    tl.store(best_ptr + m * S + s, best)
    tl.store(arg_ptr + m * S + s, arg)


def nearest(x: torch.Tensor, entries: torch.Tensor, *, split: int | None = None) -> torch.Tensor:
    """The contract's nearest entry of each row: x [M, D], entries [N, D] -> int32 [M]. split: the
    entries a program searches (`contract.conv.nearest_plan`; speed only)."""
    M, N, D = check_nearest(x, entries)
    split, BN = nearest_plan(N, split)
    S = N // split
    best = torch.empty(M, S, dtype=torch.float32, device=x.device)
    arg = torch.empty(M, S, dtype=torch.int32, device=x.device)
    _nearest_kernel[(M, S)](x.contiguous(), entries.contiguous(), best, arg, N=N, D=D, S=S, SPLIT=split, BN=BN,
                            BK=twin_lanes(D), num_warps=4, enable_fp_fusion=False)
    return _first_least(best, arg, N)


def _first_least(best: torch.Tensor, arg: torch.Tensor, N: int) -> torch.Tensor:
    """The first entry among the least of [M, S] distances `best` at entries `arg` (the programs' or
    every entry's; broadcast to best): exact, any split."""
    least = best.min(dim=1, keepdim=True).values
    return torch.where(best == least, arg, N).min(dim=1).values


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
    return _first_least(dist, torch.arange(N, dtype=torch.int32, device=x.device), N)


__all__ = ["conv1d", "conv1d_native", "conv_transpose1d", "conv_transpose1d_native", "elu", "elu_native", "nearest",
           "nearest_native", "taps", "taps_native"]
