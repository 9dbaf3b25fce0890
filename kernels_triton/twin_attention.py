"""Batch-invariant decode attention over the stacked ring as Triton kernels: the twins of
`kernels_pallas.twin_attention` (its docstring states the contract and its derivative; same
signature, same bits). `attention` is a `torch.autograd.Function` where autograd records; its
backward (`attention_bwd`) has the Pallas backward's bits."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels_pallas.contract import attention as contract
from kernels_pallas.contract.attention import (
    AttentionBlocks,
    check_twin_attention,
    check_twin_sems,
    twin_attention_form,
    twin_attention_launch,
    twin_sems_size,
)
from kernels_pallas.contract.numerics import TWIN_MMA_ROWS, check_index
from kernels_triton import twin_grad
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting


@triton.jit
def _split_kernel(layer_ptr, q_ptr, k_ptr, v_ptr, pos_ptr, qpos_ptr, acc_ptr, m_ptr, l_ptr, o_ptr, sem_ptr, scale,
                  B: tl.constexpr, H: tl.constexpr, T: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
                  CONTEXT: tl.constexpr, CHUNK: tl.constexpr, BC: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                  HB: tl.constexpr, STAGES: tl.constexpr, MMA: tl.constexpr, R: tl.constexpr,
                  SPLITS_FIRST: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (group, split), group = b*(H/HB)*T + hb*T + t: heads hb*HB .. of query (b, t), one
    split; the output into o, combined by this program (one split, S == 1) or by the last of the S
    programs to finish (the partials through acc, m, l; sem_ptr + group: its counter, as in the
    Pallas twin). The 1-D grid's launch order as the Pallas twin's (`SPLITS_FIRST`, its `_program`).

    The loop over the split's blocks is software-pipelined (STAGES, as in `twin_linear`).

    Each head's arithmetic is the contract's whatever HB: HB heads per program only saves the
    interpreter's per-program overhead (HB = 1 compiled, and in the MMA form). MMA: the MMA form
    (R rows of its operands), else the lane form.
    """
    G: tl.constexpr = B * (H // HB) * T
    if SPLITS_FIRST:
        group, split = tl.program_id(0) // S, tl.program_id(0) % S
    else:
        group, split = tl.program_id(0) % G, tl.program_id(0) // G
    b = group // ((H // HB) * T)
    t = group % T
    h = ((group // T) % (H // HB)) * HB + tl.arange(0, HB)                     # [HB]
    bht = (b * H + h) * T + t                                                 # [HB]
    d = tl.arange(0, D)
    q = tl.load(q_ptr + bht[:, None] * D + d[None, :])                          # [HB, D]
    q_pos = tl.load(qpos_ptr + b * T + t)
    layer = tl.load(layer_ptr).to(tl.int64)
    row = (layer * B * H + b * H + h) * C                                     # [HB]
    m = tl.full([HB], float("-inf"), tl.float32)
    l = tl.zeros([HB, BC], tl.float32)                                        # a sum per lane
    if MMA:  # HB == 1: the query in each of the R rows of the MMA's operand; acc's R rows stay equal
        q16 = tl.broadcast_to(q, [R, D])
        acc = tl.zeros([R, D], tl.float32)
    else:
        q = q.to(tl.float32)
        acc = tl.zeros([HB, D], tl.float32)
    for i in tl.range(0, CHUNK // BC, num_stages=STAGES):
        c = split * CHUNK + i * BC + tl.arange(0, BC)
        ok = c < C
        pos = tl.load(pos_ptr + b * C + c, mask=ok, other=-1)
        delta = q_pos - pos
        visible = (ok & (pos >= 0) & (delta >= 0) & (delta < CONTEXT))[None, :]  # [1, BC]
        if MMA:
            offs = (row[:, None] + c[:, None]) * D + d[None, :]                   # [BC, D]
            k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=tl.trans(visible), other=0.0)           # v' as it loads
            s = tl.max(tm.mma(k, tl.trans(q16), INTERPRETED), axis=1)[None, :] * scale  # [1, BC]: R equal columns
        else:
            offs = (row[:, None, None] + c[None, :, None]) * D + d[None, None, :]  # [HB, BC, D]
            k = tl.load(k_ptr + offs, mask=ok[None, :, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=ok[None, :, None], other=0.0).to(tl.float32)
            s = tl.reshape(tm.tree_sum(tl.reshape(q[:, None, :] * k, [HB * BC, D]), HB * BC, D, True), [HB, BC])
            s = s * scale
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m0 = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tm.exp(m - m0)
        p = tl.where(visible, tm.exp(s - m0[:, None]), 0.0)                   # [HB, BC]
        l = l * a[:, None] + p
        if MMA:
            p_hi = tm.to_dtype(p, v.dtype, INTERPRETED)
            p_lo = tm.to_dtype(p - p_hi.to(tl.float32), v.dtype, INTERPRETED)
            acc = tm.mma_add(acc * a[:, None], tm.mma(tl.broadcast_to(p_hi, [R, BC]), v, INTERPRETED), INTERPRETED)
            acc = tm.mma_add(acc, tm.mma(tl.broadcast_to(p_lo, [R, BC]), v, INTERPRETED), INTERPRETED)
        else:
            pv = p[:, :, None] * tl.where(visible[:, :, None], v, 0.0)             # [HB, BC, D]
            pv = tl.reshape(tl.permute(pv, (0, 2, 1)), [HB * D, BC])
            acc = acc * a[:, None] + tl.reshape(tm.tree_sum(pv, HB * D, BC, True), [HB, D])
        m = m_new
    l = tm.tree_sum(l, HB, BC)  # the lanes' sums, once a split: [HB]
    if MMA:
        acc = tl.max(acc, axis=0)[None, :]  # its rows are equal: exact
    if S == 1:  # one split: the combine of the contract, here (one launch)
        w = tm.exp(m - tl.where(m == float("-inf"), 0.0, m))
        L = tl.zeros([HB], tl.float32) + l * w
        O = tl.zeros([HB, D], tl.float32) + acc * w[:, None]
        _store_out(o_ptr, L, O, b, t, h, d, H, T, INTERPRETED)
    else:
        part = bht * S + split                                                # [HB]
        tl.store(acc_ptr + part[:, None] * D + d[None, :], acc)
        tl.store(m_ptr + part, m)
        tl.store(l_ptr + part, l)
        tl.debug_barrier()  # every thread's stores before the counter's release (one thread counts)
        if tl.atomic_add(sem_ptr + group, 1, sem="acq_rel", scope="gpu") == S - 1:  # the others' partials visible
            _combine(acc_ptr, m_ptr, l_ptr, o_ptr, b, t, h, bht, d, H, T, S, SP, INTERPRETED)
            tl.store(sem_ptr + group, 0)


@triton.jit
def _store_out(o_ptr, L, O, b, t, h, d, H: tl.constexpr, T: tl.constexpr, INTERPRETED: tl.constexpr):
    """out = O / L (0 where L == 0, NaN where L is NaN) of heads h [HB] of query (b, t), into o [B, T, H, D]."""
    seen = L != 0  # L == 0: no slot visible; a NaN L (a NaN score or value) is seen, and propagates
    out = tl.where(seen[:, None], tl.math.div_rn(O, tl.where(seen, L, 1.0)[:, None]), 0.0)
    tl.store(o_ptr + ((b * T + t) * H + h[:, None]) * d.shape[0] + d[None, :],
             tm.to_dtype(out, o_ptr.dtype.element_ty, INTERPRETED))


@triton.jit
def _combine(acc_ptr, m_ptr, l_ptr, o_ptr, b, t, h, bht, d, H: tl.constexpr, T: tl.constexpr, S: tl.constexpr,
             SP: tl.constexpr, INTERPRETED: tl.constexpr):
    """The contract's combine of the S partials of heads h [HB] (bht [HB]) of query (b, t), in order."""
    HB: tl.constexpr = h.shape[0]
    D: tl.constexpr = d.shape[0]
    sp = tl.arange(0, SP)
    ms = tl.load(m_ptr + bht[:, None] * S + sp[None, :], mask=(sp < S)[None, :], other=float("-inf"))
    m0 = tl.max(ms, axis=1)
    m0 = tl.where(m0 == float("-inf"), 0.0, m0)
    L = tl.zeros([HB], tl.float32)
    O = tl.zeros([HB, D], tl.float32)
    for s in range(S):
        w = tm.exp(tl.load(m_ptr + bht * S + s) - m0)
        L = L + tl.load(l_ptr + bht * S + s) * w
        O = O + tl.load(acc_ptr + (bht[:, None] * S + s) * D + d[None, :]) * w[:, None]
    _store_out(o_ptr, L, O, b, t, h, d, H, T, INTERPRETED)


def attention(q: torch.Tensor, ring_k: torch.Tensor, ring_v: torch.Tensor, layer, positions: torch.Tensor,
              q_pos: torch.Tensor, *, context: int, sems: torch.Tensor | None = None,
              num_warps: int | None = None, num_stages: int | None = None, form: str | None = None):
    """The Pallas twin's signature and bits; returns [B, T, H, D] in q's dtype, and sems if given
    (its counters counted on in place and left all 0). form: as the Pallas twin's (None:
    `contract.attention.twin_attention_form`, compiled being not interpreted); num_warps, num_stages:
    None, this backend's (`contract.attention.twin_attention_launch`). Differentiable in q and the
    rings where autograd records (`_Attention`)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, ring_k, ring_v)):
        return _Attention.apply(q, ring_k, ring_v, layer, positions, q_pos, context, sems, num_warps, num_stages,
                                form)
    return _forward(q, ring_k, ring_v, layer, positions, q_pos, context=context, sems=sems, num_warps=num_warps,
                    num_stages=num_stages, form=form)


def _forward(q, ring_k, ring_v, layer, positions, q_pos, *, context, sems, num_warps, num_stages, form):
    """The forward kernel: `attention` without autograd."""
    B, H, T, D, C = check_twin_attention(q, ring_k, ring_v, positions, q_pos, context)
    num_warps, num_stages = twin_attention_launch(num_warps, num_stages, False, B * H * T, D, C)
    given = sems is not None
    sems = check_twin_sems(sems, twin_sems_size(B, H, T), "attention", lambda n: torch.zeros(n, dtype=torch.int32, device=q.device))
    if sems.device != q.device or not sems.is_contiguous():
        raise ValueError(f"attention(sems): expected a contiguous tensor on {q.device}, got one on {sems.device} "
                         f"(contiguous: {sems.is_contiguous()})")
    for name, t in (("q", q), ("ring_k", ring_k), ("ring_v", ring_v)):
        if not t.is_contiguous():
            raise ValueError(f"attention({name}): must be contiguous, got strides {t.stride()}")
    plan = AttentionBlocks.for_shapes(C)
    BC, chunk, S = plan.block_slots, plan.chunk, plan.splits
    parts = B * H * T * S
    dev = q.device
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=dev)
    one = S == 1  # no partials: the split kernel writes out
    acc = out if one else torch.empty(parts * D, dtype=torch.float32, device=dev)
    m = out if one else torch.empty(parts, dtype=torch.float32, device=dev)
    l = out if one else torch.empty(parts, dtype=torch.float32, device=dev)
    interpreted = interpreting(_split_kernel)
    mma = twin_attention_form(D, BC, q.dtype, compiled=not interpreted, form=form) == "mma"
    HB = H if interpreted and not mma and not H & (H - 1) else 1  # interpreted: all heads of a query per program
    _split_kernel[(B * (H // HB) * T * S,)](
        tm.layer_tensor(layer, ring_k.shape[0], dev, "attention"), q, ring_k, ring_v,
        positions.to(torch.int32).contiguous(), q_pos.to(torch.int32).contiguous(), acc, m, l, out, sems,
        float(torch.tensor(1.0 / math.sqrt(D), dtype=torch.float32)), B=B, H=H, T=T, C=C, D=D, CONTEXT=context,
        CHUNK=chunk, BC=BC, S=S, SP=triton.next_power_of_2(S), HB=HB, STAGES=num_stages, MMA=mma,
        R=TWIN_MMA_ROWS, SPLITS_FIRST=contract.TWIN_ATTENTION_SPLITS_FIRST, INTERPRETED=interpreted,
        num_warps=num_warps, enable_fp_fusion=False)
    return (out, sems) if given else out

class _Attention(torch.autograd.Function):
    """`attention` for autograd. Saves the layer's slots (a copy: the stacked rings are written in
    place by later layers and steps); the rings' gradient is nonzero on that layer only."""

    @staticmethod
    def forward(ctx, q, ring_k, ring_v, layer, positions, q_pos, context, sems, num_warps, num_stages, form):
        res = _forward(q, ring_k, ring_v, layer, positions, q_pos, context=context, sems=sems, num_warps=num_warps,
                       num_stages=num_stages, form=form)
        at = tm.layer_tensor(layer, ring_k.shape[0], q.device, "attention").long()
        k, v = (r.index_select(0, at)[0] for r in (ring_k, ring_v))
        ctx.save_for_backward(q, k, v, positions, q_pos, at)
        ctx.context, ctx.layers = context, ring_k.shape[0]
        if sems is not None:
            ctx.mark_non_differentiable(res[1])
        return res

    @staticmethod
    @twin_grad.first_order("attention")
    def backward(ctx, d_out, *_):
        q, k, v, positions, q_pos, at = ctx.saved_tensors
        dq, dk, dv = attention_bwd(d_out.contiguous(), q, k, v, positions, q_pos, context=ctx.context)

        def ring(d):  # the layer's gradient placed in the stacked rings' shape
            return torch.zeros((ctx.layers, *d.shape), dtype=d.dtype, device=d.device).index_copy_(0, at, d[None])

        return dq, ring(dk), ring(dv), None, None, None, None, None, None, None, None


@triton.jit
def _bwd_block(q, dO, k, v, visible, m0, l0, delta, scale, STATS: tl.constexpr, BC: tl.constexpr, D: tl.constexpr):
    """The Pallas twin's `_bwd_block`: q, dO [D], k, v [BC, D] float32, visible [BC]; STATS: 0 (s only),
    1 (and p, dp from m0), 2 (and P, ds from m0, l0, delta). Returns (s, p, dp, P, ds), [BC] each."""
    s = tl.where(visible, tm.tree_sum(q[None, :] * k, BC, D, True) * scale, float("-inf"))
    p = s
    dp = s
    P = s
    ds = s
    if STATS >= 1:
        p = tl.where(visible, tm.exp(s - m0), 0.0)
        dp = tm.tree_sum(dO[None, :] * tl.where(visible[:, None], v, 0.0), BC, D, True)
    if STATS >= 2:
        P = tl.math.div_rn(p, l0)
        ds = tl.where(visible, (P * (dp - delta)) * scale, 0.0)
    return s, p, dp, P, ds


@triton.jit
def _bwd_q_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, qpos_ptr, do_ptr, dq_ptr, m_ptr, l_ptr, delta_ptr, scale,
                  H: tl.constexpr, T: tl.constexpr, C: tl.constexpr, D: tl.constexpr, CONTEXT: tl.constexpr,
                  BC: tl.constexpr, BLOCKS: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program bht = (b*H + h)*T + t: the Pallas twin's `_bwd_q_kernel` (passes A, B, C)."""
    bht = tl.program_id(0)
    b = bht // (H * T)
    h = (bht // T) % H
    t = bht % T
    d = tl.arange(0, D)
    q_pos = tl.load(qpos_ptr + b * T + t)
    q = tl.load(q_ptr + bht * D + d).to(tl.float32)
    dO = tl.load(do_ptr + ((b * T + t) * H + h) * D + d).to(tl.float32)
    row = (bht // T).to(tl.int64) * C
    m = tl.max(tl.full([BC], float("-inf"), tl.float32), axis=0)  # scalars: m, l0, delta
    for i in range(BLOCKS):  # pass A
        c = i * BC + tl.arange(0, BC)
        ok = c < C
        pos = tl.load(pos_ptr + b * C + c, mask=ok, other=-1)
        visible = ok & (pos >= 0) & (q_pos - pos >= 0) & (q_pos - pos < CONTEXT)
        k = tl.load(k_ptr + (row + c[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        s, _, _, _, _ = _bwd_block(q, dO, k, k, visible, 0.0, 1.0, 0.0, scale, 0, BC, D)
        m = tl.maximum(m, tl.max(s, axis=0))
    m0 = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([BC], tl.float32)
    g = tl.zeros([BC], tl.float32)
    for i in range(BLOCKS):  # pass B
        c = i * BC + tl.arange(0, BC)
        ok = c < C
        pos = tl.load(pos_ptr + b * C + c, mask=ok, other=-1)
        visible = ok & (pos >= 0) & (q_pos - pos >= 0) & (q_pos - pos < CONTEXT)
        k = tl.load(k_ptr + (row + c[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (row + c[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        _, p, dp, _, _ = _bwd_block(q, dO, k, v, visible, m0, 1.0, 0.0, scale, 1, BC, D)
        l = l + p
        g = g + p * dp
    L = tl.sum(tm.tree_sum(l[None, :], 1, BC), axis=0)  # [1] -> a scalar (one element: exact)
    l0 = tl.where(L == 0, 1.0, L)
    delta = tl.math.div_rn(tl.sum(tm.tree_sum(g[None, :], 1, BC), axis=0), l0)
    dq = tl.zeros([D], tl.float32)
    for i in range(BLOCKS):  # pass C
        c = i * BC + tl.arange(0, BC)
        ok = c < C
        pos = tl.load(pos_ptr + b * C + c, mask=ok, other=-1)
        visible = ok & (pos >= 0) & (q_pos - pos >= 0) & (q_pos - pos < CONTEXT)
        k = tl.load(k_ptr + (row + c[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + (row + c[:, None]) * D + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        _, _, _, _, ds = _bwd_block(q, dO, k, v, visible, m0, l0, delta, scale, 2, BC, D)
        dq = dq + tm.tree_sum(tl.trans(ds[:, None] * tl.where(visible[:, None], k, 0.0)), D, BC, True)
    tl.store(dq_ptr + bht * D + d, tm.to_dtype(tl.where(dq == 0, 0.0, dq), dq_ptr.dtype.element_ty, INTERPRETED))
    tl.store(m_ptr + bht, m0)
    tl.store(l_ptr + bht, l0)
    tl.store(delta_ptr + bht, delta)


@triton.jit
def _bwd_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, qpos_ptr, do_ptr, m_ptr, l_ptr, delta_ptr, dk_ptr, dv_ptr, scale,
                   H: tl.constexpr, T: tl.constexpr, C: tl.constexpr, D: tl.constexpr, CONTEXT: tl.constexpr,
                   BC: tl.constexpr, BLOCKS: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (b*H + h)*BLOCKS + j: the Pallas twin's `_bwd_kv_kernel` (the queries in order)."""
    row = tl.program_id(0) // BLOCKS
    j = tl.program_id(0) % BLOCKS
    b = row // H
    h = row % H
    d = tl.arange(0, D)
    c = j * BC + tl.arange(0, BC)
    ok = c < C
    pos = tl.load(pos_ptr + b * C + c, mask=ok, other=-1)
    offs = (row.to(tl.int64) * C + c[:, None]) * D + d[None, :]
    k = tl.load(k_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    dk = tl.zeros([BC, D], tl.float32)
    dv = tl.zeros([BC, D], tl.float32)
    for t in range(T):
        bht = row * T + t
        q = tl.load(q_ptr + bht * D + d).to(tl.float32)
        dO = tl.load(do_ptr + ((b * T + t) * H + h) * D + d).to(tl.float32)
        q_pos = tl.load(qpos_ptr + b * T + t)
        visible = ok & (pos >= 0) & (q_pos - pos >= 0) & (q_pos - pos < CONTEXT)
        _, _, _, P, ds = _bwd_block(q, dO, k, v, visible, tl.load(m_ptr + bht), tl.load(l_ptr + bht),
                                    tl.load(delta_ptr + bht), scale, 2, BC, D)
        dk = dk + ds[:, None] * q[None, :]
        dv = dv + P[:, None] * dO[None, :]
    tl.store(dk_ptr + offs, tm.to_dtype(tl.where(dk == 0, 0.0, dk), dk_ptr.dtype.element_ty, INTERPRETED), mask=ok[:, None])
    tl.store(dv_ptr + offs, tm.to_dtype(tl.where(dv == 0, 0.0, dv), dv_ptr.dtype.element_ty, INTERPRETED), mask=ok[:, None])


def attention_bwd(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  q_pos: torch.Tensor, *, context: int):
    """The Pallas twin's `attention_bwd` (same signature and bits): (dq [B, H, T, D], dk, dv [B, H, C, D])."""
    B, H, T, D, C = check_twin_attention(q, k[None], v[None], positions, q_pos)
    if tuple(d_out.shape) != (B, T, H, D) or d_out.dtype != q.dtype:
        raise ValueError(f"attention_bwd(d_out): expected [{B}, {T}, {H}, {D}] in {q.dtype}, "
                         f"got {d_out.dtype}{list(d_out.shape)}")
    for name, t in (("d_out", d_out), ("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            raise ValueError(f"attention_bwd({name}): must be contiguous, got strides {t.stride()}")
    BC = AttentionBlocks.for_shapes(C).block_slots
    blocks = -(-C // BC)
    dev = q.device
    dq = torch.empty_like(q)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    m, l, delta = (torch.empty(B * H * T, dtype=torch.float32, device=dev) for _ in range(3))
    ints = (positions.to(torch.int32).contiguous(), q_pos.to(torch.int32).contiguous())
    scale = float(torch.tensor(1.0 / math.sqrt(D), dtype=torch.float32))
    statics = {"H": H, "T": T, "C": C, "D": D, "CONTEXT": context, "BC": BC, "BLOCKS": blocks,
               "INTERPRETED": interpreting(_bwd_q_kernel), "enable_fp_fusion": False}
    _bwd_q_kernel[(B * H * T,)](q, k, v, *ints, d_out, dq, m, l, delta, scale, **statics)
    _bwd_kv_kernel[(B * H * blocks,)](q, k, v, *ints, d_out, m, l, delta, dk, dv, scale, **statics)
    return dq, dk, dv

# ------------------------------------------------------------------------------- the plain reference
def attention_native(q, ring_k, ring_v, layer, positions, q_pos, *, context: int, **_):
    """The plain torch reference of `attention`'s lane form (same signature and bits; the MMA form's
    bits are the tensor cores'): every query at once, split by split and block by block in the
    contract's order (`kernels_pallas.twin_attention`'s docstring)."""
    B, H, T, D, C = check_twin_attention(q, ring_k, ring_v, positions, q_pos, context)
    check_index("attention_native", "layer", layer, ring_k.shape[0], tm.host_values(layer), scalar=True)
    plan = AttentionBlocks.for_shapes(C)
    BC, chunk, S = plan.block_slots, plan.chunk, plan.splits
    f32, pad = torch.float32, S * chunk - C
    layer = int(layer) if isinstance(layer, torch.Tensor) else layer
    k, v = (torch.nn.functional.pad(r[layer].to(f32), (0, 0, 0, pad)) for r in (ring_k, ring_v))  # [B, H, S*chunk, D]
    pos = torch.nn.functional.pad(positions.long(), (0, pad), value=-1)                            # [B, S*chunk]
    delta = q_pos.long()[:, :, None] - pos[:, None, :]                                            # [B, T, S*chunk]
    visible = ((pos[:, None, :] >= 0) & (delta >= 0) & (delta < context))[:, None]               # [B, 1, T, S*chunk]
    qf, scale = q.to(f32)[:, :, :, None, :], 1.0 / math.sqrt(D)                                   # [B, H, T, 1, D]
    parts = []
    for s in range(S):
        m = torch.full((B, H, T, 1), -math.inf, dtype=f32, device=q.device)
        l, acc = torch.zeros((B, H, T, BC), dtype=f32, device=q.device), torch.zeros_like(qf[..., 0, :])
        for i in range(chunk // BC):
            c = slice(s * chunk + i * BC, s * chunk + (i + 1) * BC)
            vis = visible[..., c]
            scores = tm.tree_sum_native(qf * k[:, :, None, c])[..., 0] * scale                    # [B, H, T, BC]
            scores = torch.where(vis, scores, -math.inf)
            m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
            m0 = torch.where(m_new == -math.inf, 0.0, m_new)
            a = tm.exp_native(m - m0)
            p = torch.where(vis, tm.exp_native(scores - m0), 0.0)
            l = l * a + p
            pv = p[..., None] * torch.where(vis[..., None], v[:, :, None, c], 0.0)                # [B, H, T, BC, D]
            acc = acc * a + tm.tree_sum_native(pv.transpose(-1, -2))[..., 0]
            m = m_new
        parts.append((m, tm.tree_sum_native(l), acc))
    m0 = parts[0][0]
    for m, _, _ in parts[1:]:
        m0 = torch.maximum(m0, m)
    m0 = torch.where(m0 == -math.inf, 0.0, m0)
    L, O = torch.zeros_like(m0), torch.zeros_like(parts[0][2])
    for m, l, acc in parts:
        w = tm.exp_native(m - m0)
        L = L + l * w
        O = O + acc * w
    out = torch.where(L > 0, O / torch.where(L > 0, L, 1.0), 0.0)
    return out.to(q.dtype).transpose(1, 2).contiguous()                                          # [B, T, H, D]


def attention_bwd_native(d_out, q, k, v, positions, q_pos, *, context: int, **_):
    """The plain torch reference of `attention_bwd` (the Pallas twin's `attention_bwd_native`, same
    signature and bits): every query at once, the three passes block by block, dk and dv summed
    over the queries in order."""
    B, H, T, D, C = check_twin_attention(q, k[None], v[None], positions, q_pos)
    BC = AttentionBlocks.for_shapes(C).block_slots
    blocks = -(-C // BC)
    f32, pad = torch.float32, blocks * BC - C
    kf, vf = (torch.nn.functional.pad(r.to(f32), (0, 0, 0, pad)) for r in (k, v))            # [B, H, N, D]
    pos = torch.nn.functional.pad(positions.long(), (0, pad), value=-1)                        # [B, N]
    delta_pos = q_pos.long()[:, :, None] - pos[:, None, :]                                    # [B, T, N]
    visible = ((pos[:, None, :] >= 0) & (delta_pos >= 0) & (delta_pos < context))[:, None]   # [B, 1, T, N]
    scale = 1.0 / math.sqrt(D)
    qf, dO = q.to(f32), d_out.to(f32).transpose(1, 2)                                         # [B, H, T, D]

    def block(i, stats):  # scores s, p, dp, P, ds of block i: [B, H, T, BC] (the Pallas `_bwd_block`)
        c = slice(i * BC, (i + 1) * BC)
        vis = visible[..., c]
        s = torch.where(vis, tm.tree_sum_native(qf[:, :, :, None, :] * kf[:, :, None, c])[..., 0] * scale, -math.inf)
        if stats is None:
            return s, None, None, None, None
        m0, l0, delta = stats
        p = torch.where(vis, tm.exp_native(s - m0), 0.0)
        dp = tm.tree_sum_native(dO[:, :, :, None, :] * torch.where(vis[..., None], vf[:, :, None, c], 0.0))[..., 0]
        if l0 is None:
            return s, p, dp, None, None
        P = p / l0
        return s, p, dp, P, torch.where(vis, P * (dp - delta) * scale, 0.0)

    m = torch.full((B, H, T, 1), -math.inf, dtype=f32, device=q.device)
    for i in range(blocks):                                                    # pass A: the maximum
        m = torch.maximum(m, block(i, None)[0].amax(-1, keepdim=True))
    m0 = torch.where(m == -math.inf, 0.0, m)
    l = g = torch.zeros((B, H, T, BC), dtype=f32, device=q.device)
    for i in range(blocks):                                                    # pass B: the sums
        _, p, dp, _, _ = block(i, (m0, None, None))
        l, g = l + p, g + p * dp
    L = tm.tree_sum_native(l)
    l0 = torch.where(L == 0, 1.0, L)
    stats = (m0, l0, tm.tree_sum_native(g) / l0)
    dq, Ps, dss = torch.zeros_like(qf), [], []
    for i in range(blocks):                                                    # pass C: P, ds and dq
        c = slice(i * BC, (i + 1) * BC)
        _, _, _, P, ds = block(i, stats)
        kept = torch.where(visible[..., c, None], kf[:, :, None, c], 0.0)                     # [B, H, T, BC, D]
        dq = dq + tm.tree_sum_native((ds[..., None] * kept).transpose(-1, -2))[..., 0]
        Ps.append(P), dss.append(ds)
    P, ds = torch.cat(Ps, -1), torch.cat(dss, -1)                                             # [B, H, T, N]
    dk = dv = torch.zeros((B, H, blocks * BC, D), dtype=f32, device=q.device)
    for t in range(T):                                                         # the queries in order
        dk = dk + ds[:, :, t, :, None] * qf[:, :, t, None, :]
        dv = dv + P[:, :, t, :, None] * dO[:, :, t, None, :]
    return tuple(torch.where(x == 0, 0.0, x).to(r.dtype) for x, r in ((dq, q), (dk[:, :, :C], k), (dv[:, :, :C], v)))


__all__ = ["attention", "attention_bwd", "attention_bwd_native", "attention_native"]
