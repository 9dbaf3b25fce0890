"""Batch-invariant decode attention over the stacked ring as Triton kernels: the twins of
`kernels_pallas.twin_attention` (its docstring states the contract; same signature, same bits)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels_pallas.common import check_twin_attention, twin_attention_plan
from kernels_triton import twin_math as tm
from kernels_triton.twin_linear import _layer_tensor
from kernels_triton.twin_math import interpreting


@triton.jit
def _safe(m):
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _split_kernel(layer_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, qpos_ptr, acc_ptr, m_ptr, l_ptr, scale,
                  B: tl.constexpr, H: tl.constexpr, T: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                  CONTEXT: tl.constexpr, CHUNK: tl.constexpr, BC: tl.constexpr, S: tl.constexpr):
    bht = tl.program_id(0)
    split = tl.program_id(1)
    b = bht // (H * T)
    t = bht % T
    d = tl.arange(0, D)
    q = tl.load(q_ptr + bht * D + d).to(tl.float32)
    q_pos = tl.load(qpos_ptr + b * T + t)
    layer = tl.load(layer_ptr).to(tl.int64)
    row = (layer * B * H + bht // T) * C
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for i in range(0, CHUNK // BC):
        c = split * CHUNK + i * BC + tl.arange(0, BC)
        ok = c < C
        pos = tl.load(pos_ptr + b * C + c, mask=ok, other=-1)
        delta = q_pos - pos
        visible = ok & (pos >= 0) & (delta >= 0) & (delta < CONTEXT)
        offs = (row + c[:, None]) * D + d[None, :]
        k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
        s = tm.tree_sum(q[None, :] * k, BC, D) * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m0 = _safe(m_new)
        a = tm.exp(m - m0)
        p = tl.where(visible, tm.exp(s - m0), 0.0)
        l = l * a + tm.tree_sum(tl.reshape(p, [1, BC]), 1, BC)
        pv = p[:, None] * tl.where(visible[:, None], v, 0.0)
        acc = acc * a + tm.tree_sum(tl.trans(pv), D, BC)
        m = m_new
    part = bht * S + split
    tl.store(acc_ptr + part * D + d, acc)
    tl.store(m_ptr + part + tl.arange(0, 1), m)
    tl.store(l_ptr + part + tl.arange(0, 1), l)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, o_ptr, H: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
                    S: tl.constexpr, SP: tl.constexpr, INTERPRETED: tl.constexpr):
    bht = tl.program_id(0)
    b = bht // (H * T)
    h = (bht // T) % H
    t = bht % T
    d = tl.arange(0, D)
    sp = tl.arange(0, SP)
    m0 = _safe(tl.max(tl.load(m_ptr + bht * S + sp, mask=sp < S, other=float("-inf")), axis=0))
    L = tl.zeros([1], tl.float32)
    O = tl.zeros([D], tl.float32)
    for s in range(0, S):
        w = tm.exp(tl.load(m_ptr + bht * S + s + tl.arange(0, 1)) - m0)
        L = L + tl.load(l_ptr + bht * S + s + tl.arange(0, 1)) * w
        O = O + tl.load(acc_ptr + (bht * S + s) * D + d) * w
    out = tl.where(L > 0, tl.math.div_rn(O, tl.where(L > 0, L, 1.0)), 0.0)
    tl.store(o_ptr + ((b * T + t) * H + h) * D + d, tm.to_dtype(out, o_ptr.dtype.element_ty, INTERPRETED))


def attention(q: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, layer, positions: torch.Tensor,
              q_pos: torch.Tensor, *, context: int, num_warps: int = 4) -> torch.Tensor:
    """The Pallas twin's signature and bits; returns [B, T, H, D] in q's dtype."""
    B, H, T, D, C = check_twin_attention(q, ring_k, ring_v, positions, q_pos)
    for name, t in (("q", q), ("ring_k", ring_k), ("ring_v", ring_v)):
        if not t.is_contiguous():
            raise ValueError(f"attention({name}): must be contiguous, got strides {t.stride()}")
    BC, chunk, S = twin_attention_plan(C)
    parts = B * H * T * S
    dev = q.device
    acc = torch.empty(parts * D, dtype=torch.float32, device=dev)
    m = torch.empty(parts, dtype=torch.float32, device=dev)
    l = torch.empty(parts, dtype=torch.float32, device=dev)
    _split_kernel[(B * H * T, S)](
        _layer_tensor(layer, ring_k.shape[0], dev), q, ring_k, ring_v, positions.to(torch.int32).contiguous(),
        q_pos.to(torch.int32).contiguous(), acc, m, l, float(torch.tensor(1.0 / math.sqrt(D), dtype=torch.float32)),
        B=B, H=H, T=T, C=C, D=D, CONTEXT=context, CHUNK=chunk, BC=BC, S=S, num_warps=num_warps,
        enable_fp_fusion=False)
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=dev)
    _combine_kernel[(B * H * T,)](acc, m, l, out, H=H, T=T, D=D, S=S, SP=triton.next_power_of_2(S),
                                  INTERPRETED=interpreting(_combine_kernel), num_warps=num_warps,
                                  enable_fp_fusion=False)
    return out
