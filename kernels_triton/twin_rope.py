"""The per-step RoPE tables and the rotate-and-write into the stacked ring as Triton kernels: the
twins of `kernels_pallas.twin_rope` (its docstring states the contract and its derivative; same
signatures, same bits). `rope_write` is a `torch.autograd.Function` where autograd records (its
backward the kernel `rope_write_bwd`: the Pallas backward's bits)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_pallas.contract.numerics import check_index, next_pow2
from kernels_pallas.contract.rope import check_rope_tables, check_twin_rope
from kernels_triton import twin_grad
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting


@triton.jit
def _tables_kernel(offset_ptr, freqs_ptr, cos_ptr, sin_ptr, TP: tl.constexpr, HALF: tl.constexpr):
    b = tl.program_id(0)
    t = tl.arange(0, TP)
    i = tl.arange(0, HALF)
    pos = tl.load(offset_ptr + b).to(tl.float32) + t.to(tl.float32)
    angle = pos[:, None] * tl.load(freqs_ptr + i)[None, :]
    sin, cos = tm.sincos(angle)
    offs = (b * TP + t[:, None]) * HALF + i[None, :]
    tl.store(cos_ptr + offs, cos)
    tl.store(sin_ptr + offs, sin)


def tables(offset: torch.Tensor, T: int, freqs: torch.Tensor):
    """(cos, sin) float32 [B, T, D/2] for positions offset[b] + t (the Pallas twin's bits)."""
    B, half = check_rope_tables(offset, T, freqs)
    offset = offset.contiguous()
    Tp = next_pow2(T)
    cos = torch.empty((B, Tp, half), dtype=torch.float32, device=offset.device)
    sin = torch.empty_like(cos)
    _tables_kernel[(B,)](offset, freqs.float().contiguous(), cos, sin, TP=Tp, HALF=half, enable_fp_fusion=False)
    return cos[:, :T].contiguous(), sin[:, :T].contiguous()


@triton.jit
def rotate(r, i, cos, sin, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """The contract's rotation of pairs (r, i) (float32) -> (r', i') in dtype (`twin_linear` calls it too)."""
    return (tm.to_dtype(r * cos - i * sin, dtype, INTERPRETED), tm.to_dtype(r * sin + i * cos, dtype, INTERPRETED))


@triton.jit
def _turn(qkv_ptr, base, cos_ptr, sin_ptr, bt, HALF: tl.constexpr, dtype: tl.constexpr, ROPE: tl.constexpr,
          INTERPRETED: tl.constexpr):
    """The pairs (even, odd) of q or k at qkv_ptr + base [.., HALF]: rotated by row bt's tables (ROPE),
    else as projected (to_dtype of the dtype's own values: exact)."""
    r = tl.load(qkv_ptr + base).to(tl.float32)
    i = tl.load(qkv_ptr + base + 1).to(tl.float32)
    return _rotate_row(r, i, cos_ptr, sin_ptr, bt, HALF, dtype, ROPE, False, INTERPRETED)


@triton.jit
def _rotate_row(r, i, cos_ptr, sin_ptr, bt, HALF: tl.constexpr, dtype: tl.constexpr, ROPE: tl.constexpr,
                BACK: tl.constexpr, INTERPRETED: tl.constexpr):
    """Pairs (r, i) (float32) rotated by row bt's tables, by theta or (BACK) by -theta, in dtype;
    without ROPE as they are (to_dtype)."""
    if ROPE:
        cos = tl.load(cos_ptr + bt * HALF + tl.arange(0, HALF))[None, :]
        sin = tl.load(sin_ptr + bt * HALF + tl.arange(0, HALF))[None, :]
        if BACK:
            sin = -sin
        return rotate(r, i, cos, sin, dtype, INTERPRETED)
    return tm.to_dtype(r, dtype, INTERPRETED), tm.to_dtype(i, dtype, INTERPRETED)


@triton.jit
def _write_kernel(layer_ptr, qkv_ptr, cos_ptr, sin_ptr, slot_ptr, wmask_ptr, q_ptr, k_ptr, v_ptr,
                  B: tl.constexpr, T: tl.constexpr, H: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                  HB: tl.constexpr, ROPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (b*T + t, hb): heads hb*HB .. of query (b, t) (HB = 1 compiled; interpreted, all
    heads at once, which only saves the interpreter's per-program overhead). ROPE: rotate q and k
    (else cos_ptr and sin_ptr are unread, q and k as projected)."""
    bt = tl.program_id(0)
    h = (tl.program_id(1) * HB + tl.arange(0, HB))[:, None]                   # [HB, 1]
    b = bt // T
    t = bt % T
    HALF: tl.constexpr = D // 2
    j2 = 2 * tl.arange(0, HALF)[None, :]                                      # [1, HALF]
    dtype = q_ptr.dtype.element_ty
    base = bt * 3 * H * D + h * D + j2
    q0, q1 = _turn(qkv_ptr, base, cos_ptr, sin_ptr, bt, HALF, dtype, ROPE, INTERPRETED)
    q_out = ((b * H + h) * T + t) * D + j2
    tl.store(q_ptr + q_out, q0)
    tl.store(q_ptr + q_out + 1, q1)
    if tl.load(wmask_ptr + bt) != 0:
        kb = base + H * D
        k0, k1 = _turn(qkv_ptr, kb, cos_ptr, sin_ptr, bt, HALF, dtype, ROPE, INTERPRETED)
        vb = base + 2 * H * D
        slot = tl.load(slot_ptr + bt).to(tl.int64)
        layer = tl.load(layer_ptr).to(tl.int64)
        ring = (((layer * B + b) * H + h) * C + slot) * D + j2
        tl.store(k_ptr + ring, k0)
        tl.store(k_ptr + ring + 1, k1)
        tl.store(v_ptr + ring, tl.load(qkv_ptr + vb))
        tl.store(v_ptr + ring + 1, tl.load(qkv_ptr + vb + 1))


def rope_write(qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, ring_k: torch.Tensor,
               ring_v: torch.Tensor, layer, write_index: torch.Tensor, write_mask: torch.Tensor):
    """Rotate q, k and write k, v into layer `layer` of the rings in place; returns (q, ring_k, ring_v).
    cos = sin = None: no rotation (the Pallas twin's).

    Differentiable in qkv and the rings where autograd records (`_RopeWrite`); cos and sin are
    refused (NotImplementedError) if they require grad."""
    args = (qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (qkv, cos, sin, ring_k, ring_v)):
        return _RopeWrite.apply(*args)
    return _forward(*args)


def _forward(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask):
    """The forward kernel: `rope_write` without autograd."""
    B, T, H, D, (L, C) = check_twin_rope(qkv, cos, sin, ring_k, ring_v, write_index, write_mask,
                                         tm.host_values(write_index), tm.host_values(write_mask))
    for name, t in (("qkv", qkv), ("ring_k", ring_k), ("ring_v", ring_v), ("cos", cos), ("sin", sin)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"rope_write({name}): must be contiguous, got strides {t.stride()}")
    q = torch.empty((B, H, T, D), dtype=qkv.dtype, device=qkv.device)
    HB = H if interpreting(_write_kernel) and not H & (H - 1) else 1
    _write_kernel[(B * T, H // HB)](
        tm.layer_tensor(layer, L, qkv.device, "rope_write"), qkv, qkv if cos is None else cos,
        qkv if sin is None else sin, write_index.to(torch.int32).contiguous(), write_mask.to(torch.int32).contiguous(),
        q, ring_k, ring_v, B=B, T=T, H=H, C=C, D=D, HB=HB, ROPE=cos is not None,
        INTERPRETED=interpreting(_write_kernel), enable_fp_fusion=False)
    return q, ring_k, ring_v

class _RopeWrite(torch.autograd.Function):
    """`rope_write` for autograd: the rings are written in place (marked dirty); the backward is
    `rope_write_bwd` on copies of the rings' cotangents (autograd's own are not overwritten)."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask):
        if any(t is not None and t.requires_grad for t in (cos, sin)):
            raise NotImplementedError("rope_write(cos, sin): the RoPE tables have no derivative here (functions "
                                      "of integer positions); differentiate qkv and the rings only")
        out = _forward(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask)
        ctx.mark_dirty(ring_k, ring_v)
        ctx.save_for_backward(cos, sin, write_index, write_mask)
        ctx.layer = layer
        return out

    @staticmethod
    @twin_grad.first_order("rope_write")
    def backward(ctx, dq, d_ring_k, d_ring_v):
        cos, sin, write_index, write_mask = ctx.saved_tensors
        d_qkv, d_ring_k, d_ring_v = rope_write_bwd(dq.contiguous(), cos, sin, d_ring_k.clone(memory_format=torch.contiguous_format),
                                                   d_ring_v.clone(memory_format=torch.contiguous_format), ctx.layer,
                                                   write_index, write_mask)
        return d_qkv, None, None, d_ring_k, d_ring_v, None, None, None


@triton.jit
def _bwd_kernel(layer_ptr, dq_ptr, cos_ptr, sin_ptr, slot_ptr, wmask_ptr, dqkv_ptr, dk_ptr, dv_ptr,
                B: tl.constexpr, T: tl.constexpr, H: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                HB: tl.constexpr, ROPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (b*T + t, hb): the Pallas twin's `_bwd_kernel` for heads hb*HB .. (HB as `_write_kernel`'s;
    ROPE: rotate by -theta, else cos_ptr and sin_ptr are unread and the cotangents pass as they are)."""
    bt = tl.program_id(0)
    h = (tl.program_id(1) * HB + tl.arange(0, HB))[:, None]                   # [HB, 1]
    b = bt // T
    t = bt % T
    HALF: tl.constexpr = D // 2
    j2 = 2 * tl.arange(0, HALF)[None, :]                                      # [1, HALF]
    dtype = dqkv_ptr.dtype.element_ty
    q_at = ((b * H + h) * T + t) * D + j2
    base = bt * 3 * H * D + h * D + j2                                        # d_qkv [B, T, 3, H, D]
    q0, q1 = _rotate_row(tl.load(dq_ptr + q_at).to(tl.float32), tl.load(dq_ptr + q_at + 1).to(tl.float32), cos_ptr,
                         sin_ptr, bt, HALF, dtype, ROPE, True, INTERPRETED)
    tl.store(dqkv_ptr + base, q0)
    tl.store(dqkv_ptr + base + 1, q1)
    written = tl.load(wmask_ptr + bt) != 0
    slot = tl.load(slot_ptr + bt).to(tl.int64)
    layer = tl.load(layer_ptr).to(tl.int64)
    ring = (((layer * B + b) * H + h) * C + slot) * D + j2
    k0, k1 = _rotate_row(tl.load(dk_ptr + ring).to(tl.float32), tl.load(dk_ptr + ring + 1).to(tl.float32), cos_ptr,
                         sin_ptr, bt, HALF, dtype, ROPE, True, INTERPRETED)
    tl.store(dqkv_ptr + base + H * D, tl.where(written, k0, 0.0).to(dtype))
    tl.store(dqkv_ptr + base + H * D + 1, tl.where(written, k1, 0.0).to(dtype))
    tl.store(dqkv_ptr + base + 2 * H * D, tl.where(written, tl.load(dv_ptr + ring), 0.0).to(dtype))
    tl.store(dqkv_ptr + base + 2 * H * D + 1, tl.where(written, tl.load(dv_ptr + ring + 1), 0.0).to(dtype))
    if written:
        tl.store(dk_ptr + ring, tl.zeros_like(k0).to(dk_ptr.dtype.element_ty))
        tl.store(dk_ptr + ring + 1, tl.zeros_like(k0).to(dk_ptr.dtype.element_ty))
        tl.store(dv_ptr + ring, tl.zeros_like(k0).to(dv_ptr.dtype.element_ty))
        tl.store(dv_ptr + ring + 1, tl.zeros_like(k0).to(dv_ptr.dtype.element_ty))


def rope_write_bwd(dq: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, d_ring_k: torch.Tensor,
                   d_ring_v: torch.Tensor, layer, write_index: torch.Tensor, write_mask: torch.Tensor):
    """The Pallas twin's `rope_write_bwd` (same signature and bits): returns (d_qkv [B, T, 3, H, D],
    d_ring_k, d_ring_v), the rings' cotangents updated in place (the written slots set to 0)."""
    B, H, T, D = dq.shape
    _, _, _, _, (L, C) = check_twin_rope(torch.empty((B, T, 3, H, D), dtype=dq.dtype, device="meta"), cos, sin,
                                         d_ring_k, d_ring_v, write_index, write_mask, tm.host_values(write_index),
                                         tm.host_values(write_mask))
    for name, t in (("dq", dq), ("d_ring_k", d_ring_k), ("d_ring_v", d_ring_v), ("cos", cos), ("sin", sin)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"rope_write_bwd({name}): must be contiguous, got strides {t.stride()}")
    d_qkv = torch.empty((B, T, 3, H, D), dtype=dq.dtype, device=dq.device)
    HB = H if interpreting(_bwd_kernel) and not H & (H - 1) else 1
    _bwd_kernel[(B * T, H // HB)](
        tm.layer_tensor(layer, L, dq.device, "rope_write_bwd"), dq, dq if cos is None else cos,
        dq if sin is None else sin, write_index.to(torch.int32).contiguous(), write_mask.to(torch.int32).contiguous(),
        d_qkv, d_ring_k, d_ring_v, B=B, T=T, H=H, C=C, D=D, HB=HB, ROPE=cos is not None,
        INTERPRETED=interpreting(_bwd_kernel), enable_fp_fusion=False)
    return d_qkv, d_ring_k, d_ring_v

# ------------------------------------------------------------------------------- the plain references
def tables_native(offset, T: int, freqs):
    """(cos, sin) float32 [B, T, D/2] for positions offset[b] + t: the plain torch reference of `tables`."""
    pos = offset.float()[:, None] + torch.arange(T, dtype=torch.float32, device=offset.device)  # [B, T]
    sin, cos = tm.sincos_native(pos[..., None] * freqs.float())
    return cos, sin


def rope_write_native(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask, **_):
    """The plain torch reference of `rope_write`: the same signature and bits (the rings written in
    place where write_mask says; returns (q [B, H, T, D], ring_k, ring_v)), without Triton."""
    B, T, H, D, (L, _) = check_twin_rope(qkv, cos, sin, ring_k, ring_v, write_index, write_mask,
                                         tm.host_values(write_index), tm.host_values(write_mask))
    check_index("rope_write", "layer", layer, L, tm.host_values(layer), scalar=True)
    x = qkv.float().reshape(B, T, 3, H, D // 2, 2)

    def rotate(p):  # the contract's rotation of q (p=0) or k (p=1), [B, H, T, D] in qkv's dtype
        if cos is None:  # no rotation: as projected
            return qkv[:, :, p].transpose(1, 2)
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        r, i = x[:, :, p, :, :, 0], x[:, :, p, :, :, 1]
        pairs = torch.stack(((r * c - i * s).to(qkv.dtype), (r * s + i * c).to(qkv.dtype)), -1)
        return pairs.reshape(B, T, H, D).transpose(1, 2)

    q, k, v = rotate(0), rotate(1), qkv[:, :, 2].transpose(1, 2)
    layer = int(layer) if isinstance(layer, torch.Tensor) else layer
    b, t = torch.nonzero(write_mask.bool(), as_tuple=True)
    slots = write_index[b, t].long()
    ring_k[layer, b, :, slots] = k[b, :, t]
    ring_v[layer, b, :, slots] = v[b, :, t]
    return q.contiguous(), ring_k, ring_v


def rope_write_bwd_native(dq, cos, sin, d_ring_k, d_ring_v, layer, write_index, write_mask, **_):
    """The plain torch reference of `rope_write_bwd` (same signature and bits; the rings' cotangents
    updated in place)."""
    B, H, T, D = dq.shape

    def back(x):  # [B, T, H, D] -> the rotation by -theta (or none), in dq's dtype
        if cos is None:
            return x.to(dq.dtype)
        c, ns = cos[:, :, None, :], -sin[:, :, None, :]                          # [B, T, 1, D/2]
        x = x.float().reshape(B, T, H, D // 2, 2)
        r, i = x[..., 0], x[..., 1]
        return torch.stack(((r * c - i * ns).to(dq.dtype), (r * ns + i * c).to(dq.dtype)), -1).reshape(B, T, H, D)

    layer = int(layer) if isinstance(layer, torch.Tensor) else layer
    slot = write_index.long()
    bi = torch.arange(B, device=dq.device)[:, None]
    written = write_mask.bool()[:, :, None, None]
    dk = torch.where(written, back(d_ring_k[layer][bi, :, slot]), 0.0).to(dq.dtype)  # [B, T, H, D]
    dv = torch.where(written, d_ring_v[layer][bi, :, slot], 0.0).to(dq.dtype)
    d_qkv = torch.stack((back(dq.transpose(1, 2)), dk, dv), dim=2)
    b, t = torch.nonzero(write_mask.bool(), as_tuple=True)
    d_ring_k[layer, b, :, slot[b, t]] = 0
    d_ring_v[layer, b, :, slot[b, t]] = 0
    return d_qkv, d_ring_k, d_ring_v


__all__ = ["rope_write", "rope_write_bwd", "rope_write_bwd_native", "rope_write_native", "tables", "tables_native"]
