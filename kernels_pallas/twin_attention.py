"""Batch-invariant decode attention over the stacked ring as Pallas kernels (split-K, then a fixed-order
combine); Triton twins in `kernels_triton.twin_attention`, plain reference `attention_native` beside it.

Contract (beside `twin_math`'s), for each query (b, h, t), in float32. Slot c is visible iff
`positions[b, c] >= 0 and 0 <= q_pos[b, t] - positions[b, c] < context` (the stacks' mask). The
C slots are cut into S splits of `chunk` slots and each split into blocks of BC slots
(`contract.attention.AttentionBlocks.for_shapes(C)`: a function of C alone). A split scans its blocks in order:

    s   = tree_sum(q * k) * scale        (-inf where not visible)       [BC]
    m'  = max(m, max(s));  m0 = m' where finite, else 0
    a   = exp(m - m0);  p = exp(s - m0) where visible, else 0
    l   = l * a + p     (l [BC]: a sum per lane, not per block)
    acc = acc * a + tree_sum_c(p * v')                     (v' = 0 where not visible)

starting from m = -inf, l = 0, acc = 0; after the split's last block, l = tree_sum(l). (A sum per
lane costs a multiply-add a slot; a block's sum was a tree of six layout changes in every block,
the costliest part of a latency-bound block.) That is the "lanes" form (CUDA cores; every backend, the
only form interpreted on the CPU). The "mma" form (`contract.attention.twin_attention_form`: compiled for the GPU,
16-bit q and ring) computes the two sums on the tensor cores, as the linears' MMA form does, with
everything else as above:

    s   = dot(k, q)^T * scale                  (float32 accumulation, the hardware's order)
    acc = acc * a + dot(p_hi, v') + dot(p_lo, v')      (p_hi = to_dtype(p), p_lo = to_dtype(p - p_hi))

each dot from a zero accumulator, each add rounded on its own (`twin_math.mma_add`).

Its bits have no plain reference; the GPU tests hold the Pallas and Triton twins to each other. The combine then takes the S partials in order:
M = max_s m_s, w_s = exp(m_s - M0), L = sum_s l_s * w_s, O = sum_s acc_s * w_s (sequential sums),
and out = to_dtype(O / L), or 0 when L == 0 (a query that sees no slot: what torch's SDPA gives).
A NaN L (a visible slot's score or value NaN) takes O / L, NaN: as on the reference path, a NaN
that a query sees reaches its output. The combine runs in the same launch: with one split
(S == 1: rings of one block) in the split's program; with several, in the query's last split
program to finish (`sems`: an int32 counter per query, counted up by each split program after
its partials are stored, with acquire-release order, and set back to 0 by the last one), which
loads the S partials in order: the same bits whichever program is last. Masked slots never enter the arithmetic (k, v of a recycled or never-written slot may
hold anything, NaN included). The ring is read in place at a layer index that may be traced.

Derivative (`attention` is a `jax.custom_vjp`; Triton twin: an autograd.Function, the same bits).
The backward runs the lane form whichever form the forward ran, on the layer's slots (a [B, H, C, D]
slice kept from the forward), in two Pallas kernels, references `attention_bwd_native`:

  `_bwd_q_kernel`, a program a query (b, h, t), three passes over the ring's blocks of BC slots in order
  (`AttentionBlocks.for_shapes(C).block_slots`), s and the visibility as the forward's:
    A:  M = max of s over the visible slots (exact in any order);  M0 = M where finite, else 0
    B:  p = exp(s - M0) (0 where not visible);  dp = tree_sum(dO * v')  (v' = 0 where not visible)
        l += p,  g += p * dp  (per lane);  L = tree_sum(l), G = tree_sum(g);  L0 = L, or 1 where L == 0
        delta = G / L0
    C:  P = p / L0;  ds = (P * (dp - delta)) * scale (0 where not visible);
        dq = dq + tree_sum_c(ds * k')  (k' = 0 where not visible)
  dq = to_dtype(dq); the statistics (M0, L0, delta) go to the second kernel.
  `_bwd_kv_kernel`, a program a block of BC slots of (b, h): for t = 0 .. T-1 in order, P and ds of
  the block as above from the statistics, dk += ds * q_t, dv += P * dO_t (float32); one rounding each
  to the ring's dtype at the end. A zero gradient is stored +0 (the sign of a zero is not part of
  the contract: XLA may fold a `0 + x`).

dO is the output's cotangent in q's dtype, upcast (the forward's final rounding passes it on
unchanged). Every sum has a fixed order, so the two twins' gradients have the same bits. A query that
sees nothing has P = 0: no gradient; a slot no query sees gets 0 and never enters the arithmetic
(NaN there stays out); a NaN a query sees reaches its gradients. The rings' cotangent is nonzero on
layer `layer` only; layer, positions and q_pos are integers (no cotangent); sems are counters.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import backend, twin_grad
from kernels_pallas import twin_math as tm
from kernels_pallas.contract import attention as contract
from kernels_pallas.contract.attention import (
    AttentionBlocks,
    check_twin_attention,
    check_twin_sems,
    twin_attention_form,
    twin_attention_launch,
    twin_sems_size,
)
from kernels_pallas.contract.numerics import TWIN_MMA_ROWS, sixteen_bit

NEG_INF = float("-inf")


def _safe(m):
    return jnp.where(m == NEG_INF, tm.F32(0.0), m)


def _block(q, k, v, visible, carry, scale, gpu):
    """The lane form's block of BC slots: q [D], k, v [BC, D], all float32; visible [BC]; carry
    (m [1], l [BC], acc [D]). m is a 1-element array, not a scalar: the GPU lowering takes no 0-d
    inline assembly."""
    m, l, acc = carry
    s = tm.mul(tm.tree_sum(tm.mul(q[None, :], k, gpu))[:, 0], tm.F32(scale), gpu)
    m_new, a, p, l = _softmax_step(s, visible, m, l, gpu)
    pv = tm.mul(p[:, None], jnp.where(visible[:, None], v, tm.F32(0.0)), gpu)          # [BC, D]
    return m_new, l, tm.mul(acc, a, gpu) + tm.tree_sum(pv.T)[:, 0]


def _block_mma(q16, k, v, visible, carry, scale, gpu):
    """The MMA form's block: q16 [R, D] (the query in each of the R = TWIN_MMA_ROWS rows), k [BC, D]
    and v [BC, D] (0 where not visible: a masked load) in the ring's 16-bit dtype; carry (m [1],
    l [BC], acc [R, D], its rows equal). The scores are the tensor cores' products of k and q16, its R
    equal columns folded by max (exact); p multiplies v as two 16-bit parts, p_hi = p rounded and
    p_lo = p - p_hi rounded (the error of p's ~16 kept bits under the output's own rounding)."""
    m, l, acc = carry
    s = jnp.max(lax.dot_general(k, q16, (((1,), (1,)), ((), ())), preferred_element_type=tm.F32), axis=1)  # [BC]
    m_new, a, p, l = _softmax_step(tm.mul(s, tm.F32(scale), gpu), visible, m, l, gpu)
    p_hi = tm.to_dtype(p, v.dtype)
    p_lo = tm.to_dtype(p - p_hi.astype(tm.F32), v.dtype)

    def rows(x):  # [BC] -> [R, BC]
        return jnp.broadcast_to(x[None, :], (TWIN_MMA_ROWS, x.shape[0]))

    acc = tm.mma_add(tm.mul(acc, a, gpu), jnp.dot(rows(p_hi), v, preferred_element_type=tm.F32), gpu)
    return m_new, l, tm.mma_add(acc, jnp.dot(rows(p_lo), v, preferred_element_type=tm.F32), gpu)


def _softmax_step(s, visible, m, l, gpu):
    """The online softmax's update shared by both forms: scores s [BC] (scaled) -> (m', a, p, l'),
    l and l' [BC] (a sum per lane)."""
    s = jnp.where(visible, s, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(s, keepdims=True))
    m0 = _safe(m_new)
    a = tm.exp(m - m0, gpu)
    p = jnp.where(visible, tm.exp(s - m0, gpu), tm.F32(0.0))
    return m_new, a, p, tm.mul(l, a, gpu) + p


def _split_kernel(layer_ref, q_ref, k_ref, v_ref, pos_ref, qpos_ref, *refs,
                  B, H, T, C, D, context, chunk, BC, S, scale, gpu, mma, splits_first):
    """One program a split: split `split` of query bht = b*H*T + h*T + t (`_program`: from the 1-D
    grid's index, in the launch order splits_first sets). refs: the output (one split, S == 1:
    combined here), or the counters in, then the partials (acc, m, l), the output and the counters
    out (aliased to the counters in): the last split program to finish combines. mma: the MMA form
    (`_block_mma`), else the lane form (`_block`)."""
    bht, split = _program(pl.program_id(0), B * H * T, S, splits_first)
    b, t = bht // (H * T), bht % T
    d = jnp.arange(D, dtype=jnp.int32)
    q_pos = qpos_ref[b * T + t]
    row = layer_ref[0] * B * H + bht // T                                        # (layer, b, h) of the ring
    q = pltriton.load(q_ref.at[bht * D + d])                                     # q [B, H, T, D]
    # the MMA form's operand: the query in each of its rows, in q's dtype; the lane form's: float32 [D]
    q = jnp.broadcast_to(q[None, :], (TWIN_MMA_ROWS, D)) if mma else q.astype(tm.F32)

    def body(i, carry):
        c = split * chunk + i * BC + jnp.arange(BC, dtype=jnp.int32)
        ok = c < C
        cc = jnp.where(ok, c, 0)  # masked lanes still index inside the ref (interpreted)
        if gpu:  # c, not cc: the compiler sees the slots contiguous and loads them as vectors
            pos = pltriton.load(pos_ref.at[b * C + c], mask=ok, other=-1)
        else:
            pos = jnp.where(ok, pltriton.load(pos_ref.at[b * C + cc]), -1)
        delta = q_pos - pos
        visible = ok & (pos >= 0) & (delta >= 0) & (delta < context)
        # the rings as [L*B*H, C, D], indexed per dimension, not by a flat offset: past 2**32 bytes
        # the lowering computes the addresses in 64 bits (a flat int32 offset overflows once
        # L*B*H*C*D > 2**31: the temporal ring at B >= 6); every index an array: a gather, also interpreted
        at = (row, cc[:, None], d[None, :])
        k = pltriton.load(k_ref.at[at])                                          # [BC, D]
        if mma:  # v masked as it loads (a select after the load would keep it out of the pipelined copies)
            v = pltriton.load(v_ref.at[at], mask=jnp.broadcast_to(visible[:, None], (BC, D)),
                              other=jnp.zeros((), v_ref.dtype))
            return _block_mma(q, k, v, visible, carry, scale, gpu)
        return _block(q, k.astype(tm.F32), pltriton.load(v_ref.at[at]).astype(tm.F32), visible,
                      carry, scale, gpu)

    init = (jnp.full((1,), NEG_INF, tm.F32), jnp.zeros((BC,), tm.F32),
            jnp.zeros((TWIN_MMA_ROWS, D) if mma else (D,), tm.F32))
    m, l, acc = lax.fori_loop(0, chunk // BC, body, init)
    l = tm.tree_sum(l[None, :])[0]  # the lanes' sums, once a split: [1]
    if mma:
        acc = jnp.max(acc, axis=0)  # its rows are equal: exact
    if S == 1:
        (o_ref,) = refs
        _store_out(o_ref, _combine(lambda s: (m, l, acc), 1, o_ref.dtype, gpu), bht, H, T, D)
        return
    _, acc_ref, m_ref, l_ref, o_ref, sem_ref = refs
    one = jnp.arange(1, dtype=jnp.int32)

    def at(s):
        return bht * S + s

    pltriton.store(acc_ref.at[at(split) * D + d], acc)
    pltriton.store(m_ref.at[at(split) + one], m)
    pltriton.store(l_ref.at[at(split) + one], l)
    if gpu:  # every thread's stores before the counter's release (one thread counts)
        pltriton.debug_barrier()

    # acquire-release: to the last program to count, the others' partials are visible
    @pl.when(pltriton.atomic_add(sem_ref, bht, jnp.int32(1)) == S - 1)
    def _last():
        def load(s):
            return (pltriton.load(m_ref.at[at(s) + one]), pltriton.load(l_ref.at[at(s) + one]),
                    pltriton.load(acc_ref.at[at(s) * D + d]))

        _store_out(o_ref, _combine(load, S, o_ref.dtype, gpu), bht, H, T, D)
        pltriton.store(sem_ref.at[bht + one], jnp.zeros((1,), jnp.int32))


def _program(pid, queries: int, S: int, splits_first: bool):
    """(query, split) of program pid of the 1-D grid of queries * S programs, CUDA's launch order.
    splits_first (`contract.attention.TWIN_ATTENTION_SPLITS_FIRST`; speed only): a query's S splits start one
    after the other, so its combine (its last split's) runs while other queries' splits stream;
    else split s of every query starts before split s + 1 of any, and every combine waits for the
    grid's last wave."""
    return (pid // S, pid % S) if splits_first else (pid % queries, pid // queries)


def _combine(load, S: int, dtype, gpu):
    """The contract's combine of S partials, sequential over s; load(s) -> (m [1], l [1], acc [D]).

    Partials are loaded one at a time (the GPU lowering takes power-of-two arrays only, S is not).
    """
    m0 = load(0)[0]
    for s in range(1, S):
        m0 = jnp.maximum(m0, load(s)[0])
    m0 = _safe(m0)
    L, O = jnp.zeros((1,), tm.F32), jnp.zeros_like(load(0)[2])
    for s in range(S):
        m, l, acc = load(s)
        w = tm.exp(m - m0, gpu)
        L = L + tm.mul(l, w, gpu)
        O = O + tm.mul(acc, w, gpu)
    seen = L != 0  # L == 0: no slot visible; a NaN L (a NaN score or value) is seen, and propagates
    out = jnp.where(seen, tm.div(O, jnp.where(seen, L, tm.F32(1.0)), gpu), tm.F32(0.0))
    return tm.to_dtype(out, dtype)


def _store_out(o_ref, out, bht, H, T, D):
    """Query bht = (b*H + h)*T + t's output [D] into o_ref, flat [B, T, H, D]."""
    b, h, t = bht // (H * T), (bht // T) % H, bht % T
    pltriton.store(o_ref.at[((b * T + t) * H + h) * D + jnp.arange(D, dtype=jnp.int32)], out)


def attention(q: jax.Array, ring_k: jax.Array, ring_v: jax.Array, layer, positions: jax.Array,
              q_pos: jax.Array, *, context: int, sems: jax.Array | None = None, num_warps: int | None = None,
              num_stages: int | None = None, interpret: bool | None = None, form: str | None = None):
    """softmax(q k^T / sqrt(D) | visible) v over layer `layer` of the stacked ring (the contract).

    q: [B, H, T, D]; ring_k, ring_v: [L, B, H, C, D] in q's dtype; layer: int or int32 scalar
    (may be traced); positions: int [B, C] (-1: invisible); q_pos: int [B, T].
    sems: int32 [n >= B*H*T], all 0 (`contract.attention.twin_sems_size`): the counters the combine counts on,
    returned all 0 again, so one buffer serves every call of a step (carry it through the layer
    loop: a buffer made inside each call costs a kernel a call). None: made here.
    form: "lanes" or "mma" (None: `contract.attention.twin_attention_form`'s choice; the two give other bits).
    num_warps, num_stages: speed only (None, both twins' default: this backend's, read at call time,
    `contract.attention.twin_attention_launch`).
    Returns [B, T, H, D] in q's dtype (the layout the out-projection reads), and sems if given.
    """
    B, H, T, D, C = check_twin_attention(q, ring_k, ring_v, positions, q_pos, context)
    num_warps, num_stages = twin_attention_launch(num_warps, num_stages, True, B * H * T, D, C)
    given = sems is not None
    sems = check_twin_sems(sems, twin_sems_size(B, H, T), "attention", lambda n: jnp.zeros((n,), jnp.int32))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    options = _Options(context, num_warps, num_stages, interpret, form, ring_k.shape[0])
    out, sems = _differentiable(options, q, ring_k, ring_v, tm.layer_index("attention", layer, ring_k.shape[0]), positions,
                                q_pos, sems)
    return (out, sems) if given else out


class _Options(NamedTuple):
    """attention's static options (custom_vjp's non-differentiable argument)."""

    context: int
    num_warps: int
    num_stages: int
    interpret: bool
    form: str | None
    layers: int  # L, the stacked rings' layers (the shape of their cotangent)


def _forward(o: _Options, q, ring_k, ring_v, layer, positions, q_pos, sems):
    """The forward kernel: (out [B, T, H, D], sems); its Mosaic GPU twin's where that runs
    (`kernels_pallas.backend`: 16-bit, a head dim of a multiple of 64, the MMA form)."""
    B, H, T, D, C = check_twin_attention(q, ring_k, ring_v, positions, q_pos)
    if o.form != "lanes" and backend.on_mosaic() and sixteen_bit(q.dtype) and D % 64 == 0:
        from kernels_pallas import twin_attention_mgpu

        return twin_attention_mgpu.attention(q, ring_k, ring_v, layer, positions, q_pos, context=o.context, sems=sems,
                                             interpret=o.interpret)
    plan = AttentionBlocks.for_shapes(C)
    BC, chunk, S = plan.block_slots, plan.chunk, plan.splits
    gpu = not o.interpret
    mma = twin_attention_form(D, BC, q.dtype, compiled=gpu, form=o.form) == "mma"
    kernel = functools.partial(_split_kernel, B=B, H=H, T=T, C=C, D=D, context=o.context, chunk=chunk, BC=BC,
                               S=S, scale=1.0 / math.sqrt(D), gpu=gpu, mma=mma,
                               splits_first=contract.TWIN_ATTENTION_SPLITS_FIRST)
    parts = B * H * T * S
    out_flat = jax.ShapeDtypeStruct((B * T * H * D,), q.dtype)
    operands = [layer.reshape(1), q.reshape(-1), ring_k.reshape(-1, C, D),
                ring_v.reshape(-1, C, D), positions.astype(jnp.int32).reshape(-1), q_pos.astype(jnp.int32).reshape(-1)]
    if S == 1:  # combined in the split's program: no partials, no counters
        out_shape, aliases = (out_flat,), {}
    else:
        operands.append(sems)
        out_shape = (jax.ShapeDtypeStruct((parts * D,), tm.F32), jax.ShapeDtypeStruct((parts,), tm.F32),
                     jax.ShapeDtypeStruct((parts,), tm.F32), out_flat, jax.ShapeDtypeStruct(sems.shape, sems.dtype))
        aliases = {len(operands) - 1: 4}
    outs = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(parts,), input_output_aliases=aliases, interpret=o.interpret,
        compiler_params=pltriton.CompilerParams(num_warps=o.num_warps, num_stages=o.num_stages),
        name="twin_attention",
    )(*operands)
    out = outs[0 if S == 1 else 3].reshape(B, T, H, D)
    return out, (sems if S == 1 else outs[4])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(o: _Options, q, ring_k, ring_v, layer, positions, q_pos, sems):
    return _forward(o, q, ring_k, ring_v, layer, positions, q_pos, sems)


def _differentiable_fwd(o: _Options, q, ring_k, ring_v, layer, positions, q_pos, sems):
    """The output, and the residuals: the layer's slots (a slice: under a scan over layers the
    residuals are stacked per layer, the stacked rings would be L times over), the integer tables."""
    k, v = (lax.dynamic_index_in_dim(r, layer, keepdims=False) for r in (ring_k, ring_v))
    return _differentiable(o, q, ring_k, ring_v, layer, positions, q_pos, sems), (q, k, v, layer, positions, q_pos)


def _differentiable_bwd(o: _Options, residuals, cotangents):
    """`_bwd` on the output's cotangent as an array (the counters' have none)."""
    return _bwd(o, residuals, twin_grad.dense(cotangents[0]))


@twin_grad.first_order("attention")
def _bwd(o: _Options, residuals, d_out):
    q, k, v, layer, positions, q_pos = residuals
    dq, dk, dv = attention_bwd(d_out, q, k, v, positions, q_pos, context=o.context, interpret=o.interpret)

    def ring(d):  # the layer's cotangent placed in the stacked rings' shape
        return lax.dynamic_update_index_in_dim(jnp.zeros((o.layers, *d.shape), d.dtype), d, layer, 0)

    return dq, ring(dk), ring(dv), None, None, None, None


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


def _rows_tree(x):
    """`tm.tree_sum` of each row of x [BC, D]: [BC]."""
    return tm.tree_sum(x)[:, 0]


def _bwd_block(q, dO, k, v, visible, stats, scale, gpu, tree=_rows_tree):
    """A block of BC slots of one query in the backward: q, dO [D], k, v [BC, D] float32, visible [BC];
    stats (M0, L0, delta), each [1] (None before pass C: P and ds not yet defined); tree: the sums over D
    (`_rows_tree`, or a kernel's own way to the same sums). Returns (s [BC] scaled, with -inf where not
    visible; p, dp [BC]; P, ds [BC] or None)."""
    s = jnp.where(visible, tm.mul(tree(tm.mul(q[None, :], k, gpu)), tm.F32(scale), gpu), NEG_INF)
    if stats is None:
        return s, None, None, None, None
    m0, l0, delta = stats
    p = jnp.where(visible, tm.exp(s - m0, gpu), tm.F32(0.0))
    dp = tree(tm.mul(dO[None, :], jnp.where(visible[:, None], v, tm.F32(0.0)), gpu))
    if l0 is None:
        return s, p, dp, None, None
    P = tm.div(p, l0, gpu)
    ds = jnp.where(visible, tm.mul(tm.mul(P, dp - delta, gpu), tm.F32(scale), gpu), tm.F32(0.0))
    return s, p, dp, P, ds


def _plus_zero(x):
    """x with every zero +0: a zero gradient's sign is not part of the contract (XLA may fold a
    `0 + x` that IEEE would make +0), so the backward stores +0."""
    return jnp.where(x == 0, tm.F32(0.0), x)


def _visible(pos, q_pos, ok, context):
    delta = q_pos - pos
    return ok & (pos >= 0) & (delta >= 0) & (delta < context)


def _bwd_q_kernel(q_ref, k_ref, v_ref, pos_ref, qpos_ref, do_ref, dq_ref, m_ref, l_ref, delta_ref, *,
                  H, T, C, D, context, BC, blocks, scale, gpu):
    """Program bht = (b*H + h)*T + t: passes A, B, C of the module docstring; k, v: the layer's [B*H, C, D]."""
    bht = pl.program_id(0)
    b, h, t = bht // (H * T), (bht // T) % H, bht % T
    d = jnp.arange(D, dtype=jnp.int32)
    one = jnp.arange(1, dtype=jnp.int32)
    q_pos = qpos_ref[b * T + t]
    q = pltriton.load(q_ref.at[bht * D + d]).astype(tm.F32)
    dO = pltriton.load(do_ref.at[((b * T + t) * H + h) * D + d]).astype(tm.F32)     # dO [B, T, H, D]

    def load(i):
        c = i * BC + jnp.arange(BC, dtype=jnp.int32)
        ok = c < C
        cc = jnp.where(ok, c, 0)
        visible = _visible(jnp.where(ok, pltriton.load(pos_ref.at[b * C + cc]), -1), q_pos, ok, context)
        at = (bht // T, cc[:, None], d[None, :])
        return pltriton.load(k_ref.at[at]).astype(tm.F32), pltriton.load(v_ref.at[at]).astype(tm.F32), visible

    def pass_a(i, m):
        s = _bwd_block(q, dO, *load(i), None, scale, gpu)[0]
        return jnp.maximum(m, jnp.max(s, keepdims=True))

    m0 = _safe(lax.fori_loop(0, blocks, pass_a, jnp.full((1,), NEG_INF, tm.F32)))

    def pass_b(i, carry):
        l, g = carry
        _, p, dp, _, _ = _bwd_block(q, dO, *load(i), (m0, None, None), scale, gpu)
        return l + p, g + tm.mul(p, dp, gpu)

    l, g = lax.fori_loop(0, blocks, pass_b, (jnp.zeros((BC,), tm.F32), jnp.zeros((BC,), tm.F32)))
    L = tm.tree_sum(l[None, :])[0]
    l0 = jnp.where(L == 0, tm.F32(1.0), L)
    delta = tm.div(tm.tree_sum(g[None, :])[0], l0, gpu)

    def pass_c(i, dq):
        k, v, visible = load(i)
        ds = _bwd_block(q, dO, k, v, visible, (m0, l0, delta), scale, gpu)[4]
        return dq + tm.tree_sum(tm.mul(ds[:, None], jnp.where(visible[:, None], k, tm.F32(0.0)), gpu).T)[:, 0]

    dq = lax.fori_loop(0, blocks, pass_c, jnp.zeros((D,), tm.F32))
    pltriton.store(dq_ref.at[bht * D + d], tm.to_dtype(_plus_zero(dq), dq_ref.dtype))
    for ref, x in ((m_ref, m0), (l_ref, l0), (delta_ref, delta)):
        pltriton.store(ref.at[bht + one], x)


def _bwd_kv_kernel(q_ref, k_ref, v_ref, pos_ref, qpos_ref, do_ref, m_ref, l_ref, delta_ref, dk_ref, dv_ref, *,
                   H, T, C, D, context, BC, blocks, scale, gpu):
    """Program (b*H + h)*blocks + j: slots j*BC .. of (b, h), the queries t in order; dk, dv out as
    [B*H, blocks*BC, D] (the slots past C are cut off by the caller: no masked store)."""
    row, j = pl.program_id(0) // blocks, pl.program_id(0) % blocks
    b, h = row // H, row % H
    d = jnp.arange(D, dtype=jnp.int32)
    one = jnp.arange(1, dtype=jnp.int32)
    c = j * BC + jnp.arange(BC, dtype=jnp.int32)
    ok = c < C
    cc = jnp.where(ok, c, 0)
    pos = jnp.where(ok, pltriton.load(pos_ref.at[b * C + cc]), -1)
    at = (row, cc[:, None], d[None, :])
    k, v = pltriton.load(k_ref.at[at]).astype(tm.F32), pltriton.load(v_ref.at[at]).astype(tm.F32)

    def query(t, carry):
        dk, dv = carry
        bht = row * T + t
        q = pltriton.load(q_ref.at[bht * D + d]).astype(tm.F32)
        dO = pltriton.load(do_ref.at[((b * T + t) * H + h) * D + d]).astype(tm.F32)
        stats = tuple(pltriton.load(ref.at[bht + one]) for ref in (m_ref, l_ref, delta_ref))
        visible = _visible(pos, qpos_ref[b * T + t], ok, context)
        _, _, _, P, ds = _bwd_block(q, dO, k, v, visible, stats, scale, gpu)
        return dk + tm.mul(ds[:, None], q[None, :], gpu), dv + tm.mul(P[:, None], dO[None, :], gpu)

    dk, dv = lax.fori_loop(0, T, query, (jnp.zeros((BC, D), tm.F32), jnp.zeros((BC, D), tm.F32)))
    out = (row, j * BC + jnp.arange(BC, dtype=jnp.int32)[:, None], d[None, :])
    pltriton.store(dk_ref.at[out], tm.to_dtype(_plus_zero(dk), dk_ref.dtype))
    pltriton.store(dv_ref.at[out], tm.to_dtype(_plus_zero(dv), dv_ref.dtype))


def attention_bwd(d_out: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                  q_pos: jax.Array, *, context: int, interpret: bool | None = None):
    """The backward of `attention` over one layer's slots (module docstring): (dq [B, H, T, D] in q's
    dtype, dk, dv [B, H, C, D] in the ring's dtype).

    d_out: [B, T, H, D] in q's dtype (the output's cotangent); q: [B, H, T, D]; k, v: [B, H, C, D]
    (the layer's slots); positions: int [B, C]; q_pos: int [B, T]. On Mosaic GPU where
    `kernels_pallas.backend` says so and the head dim is a multiple of 64 (`twin_attention_bwd_mgpu`).
    """
    B, H, T, D, C = check_twin_attention(q, k[None], v[None], positions, q_pos)
    if tuple(d_out.shape) != (B, T, H, D) or d_out.dtype != q.dtype:
        raise ValueError(f"attention_bwd(d_out): expected [{B}, {T}, {H}, {D}] in {q.dtype}, "
                         f"got {d_out.dtype}{list(d_out.shape)}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if backend.on_mosaic() and D % 64 == 0:
        from kernels_pallas import twin_attention_bwd_mgpu

        return twin_attention_bwd_mgpu.attention_bwd(d_out, q, k, v, positions, q_pos, context=context,
                                                     interpret=interpret)
    BC = AttentionBlocks.for_shapes(C).block_slots
    blocks = -(-C // BC)
    statics = {"H": H, "T": T, "C": C, "D": D, "context": context, "BC": BC, "blocks": blocks,
               "scale": 1.0 / math.sqrt(D), "gpu": not interpret}
    ints = (positions.astype(jnp.int32).reshape(-1), q_pos.astype(jnp.int32).reshape(-1))
    slots = (q.reshape(-1), k.reshape(-1, C, D), v.reshape(-1, C, D))
    stat = jax.ShapeDtypeStruct((B * H * T,), tm.F32)
    dq, *stats = pl.pallas_call(
        functools.partial(_bwd_q_kernel, **statics),
        out_shape=(jax.ShapeDtypeStruct((B * H * T * D,), q.dtype), stat, stat, stat),
        grid=(B * H * T,), interpret=interpret, compiler_params=pltriton.CompilerParams(),
        name="twin_attention_bwd_q",
    )(*slots, *ints, d_out.reshape(-1))
    padded = jax.ShapeDtypeStruct((B * H, blocks * BC, D), k.dtype)
    dk, dv = pl.pallas_call(
        functools.partial(_bwd_kv_kernel, **statics),
        out_shape=(padded, padded), grid=(B * H * blocks,), interpret=interpret,
        compiler_params=pltriton.CompilerParams(), name="twin_attention_bwd_kv",
    )(*slots, *ints, d_out.reshape(-1), *stats)
    return dq.reshape(B, H, T, D), dk[:, :C].reshape(B, H, C, D), dv[:, :C].reshape(B, H, C, D)


def attention_native(q, ring_k, ring_v, layer, positions, q_pos, *, context: int, **_):
    """The plain jax.numpy reference of `attention`'s lane form (same signature and bits; the MMA
    form's bits are the tensor cores', held to the Triton twin's on the GPU)."""
    _B, _H, _T, D, C = check_twin_attention(q, ring_k, ring_v, positions, q_pos, context)
    layer = tm.layer_index("attention_native", layer, ring_k.shape[0])
    plan = AttentionBlocks.for_shapes(C)
    BC, chunk, S = plan.block_slots, plan.chunk, plan.splits
    pad = S * chunk - C
    k = jnp.pad(lax.dynamic_index_in_dim(ring_k, layer, keepdims=False).astype(tm.F32),
                ((0, 0), (0, 0), (0, pad), (0, 0)))
    v = jnp.pad(lax.dynamic_index_in_dim(ring_v, layer, keepdims=False).astype(tm.F32),
                ((0, 0), (0, 0), (0, pad), (0, 0)))
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    scale = 1.0 / math.sqrt(D)

    def one(qv, kv, vv, posv, qp):  # one query: qv [D], kv, vv [S*chunk, D], posv [S*chunk]
        delta = qp - posv
        visible = (posv >= 0) & (delta >= 0) & (delta < context)
        ms, ls, accs = [], [], []
        for s in range(S):
            carry = (jnp.full((1,), NEG_INF, tm.F32), jnp.zeros((BC,), tm.F32), jnp.zeros((D,), tm.F32))
            for i in range(chunk // BC):
                c = slice(s * chunk + i * BC, s * chunk + (i + 1) * BC)
                carry = _block(qv, kv[c], vv[c], visible[c], carry, scale, False)
            ms.append(carry[0]), ls.append(tm.tree_sum(carry[1][None, :])[0]), accs.append(carry[2])
        return _combine(lambda s: (ms[s], ls[s], accs[s]), S, q.dtype, False)

    per_t = jax.vmap(one, in_axes=(0, None, None, None, 0))                      # over t
    per_h = jax.vmap(per_t, in_axes=(0, 0, 0, None, None))                      # over h
    per_b = jax.vmap(per_h, in_axes=(0, 0, 0, 0, 0))                            # over b
    return per_b(q.astype(tm.F32), k, v, pos, q_pos.astype(jnp.int32)).transpose(0, 2, 1, 3)


def attention_bwd_native(d_out, q, k, v, positions, q_pos, *, context: int, **_):
    """The plain jax.numpy reference of `attention_bwd` (same signature and bits)."""
    B, H, T, D, C = check_twin_attention(q, k[None], v[None], positions, q_pos)
    BC = AttentionBlocks.for_shapes(C).block_slots
    blocks = -(-C // BC)
    pad = blocks * BC - C
    kf, vf = (jnp.pad(r.astype(tm.F32), ((0, 0), (0, 0), (0, pad), (0, 0))) for r in (k, v))
    pos = jnp.pad(positions.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    scale = 1.0 / math.sqrt(D)
    qf, dO = q.astype(tm.F32), d_out.astype(tm.F32).transpose(0, 2, 1, 3)          # [B, H, T, D]

    def query(qv, dov, kv, vv, posv, qp):  # one query: its dq [D], and its P, ds [blocks, BC]
        visible = _visible(posv, qp, jnp.ones_like(posv, bool), context).reshape(blocks, BC)
        ks, vs = kv.reshape(blocks, BC, D), vv.reshape(blocks, BC, D)
        m = jnp.full((1,), NEG_INF, tm.F32)
        for i in range(blocks):
            m = jnp.maximum(m, jnp.max(_bwd_block(qv, dov, ks[i], vs[i], visible[i], None, scale, False)[0],
                                       keepdims=True))
        m0 = _safe(m)
        l = g = jnp.zeros((BC,), tm.F32)
        for i in range(blocks):
            _, p, dp, _, _ = _bwd_block(qv, dov, ks[i], vs[i], visible[i], (m0, None, None), scale, False)
            l, g = l + p, g + tm.mul(p, dp, False)
        L = tm.tree_sum(l[None, :])[0]
        l0 = jnp.where(L == 0, tm.F32(1.0), L)
        stats = (m0, l0, tm.div(tm.tree_sum(g[None, :])[0], l0, False))
        dq, Ps, dss = jnp.zeros((D,), tm.F32), [], []
        for i in range(blocks):
            _, _, _, P, ds = _bwd_block(qv, dov, ks[i], vs[i], visible[i], stats, scale, False)
            dq = dq + tm.tree_sum(tm.mul(ds[:, None], jnp.where(visible[i][:, None], ks[i], tm.F32(0.0)), False).T)[:, 0]
            Ps.append(P), dss.append(ds)
        return dq, jnp.concatenate(Ps), jnp.concatenate(dss)

    per_t = jax.vmap(query, in_axes=(0, 0, None, None, None, 0))
    per_h = jax.vmap(per_t, in_axes=(0, 0, 0, 0, None, None))
    dq, P, ds = jax.vmap(per_h)(qf, dO, kf, vf, pos, q_pos.astype(jnp.int32))      # P, ds [B, H, T, blocks*BC]
    dk = dv = jnp.zeros((B, H, blocks * BC, D), tm.F32)
    for t in range(T):  # the queries in order
        dk = dk + tm.mul(ds[:, :, t, :, None], qf[:, :, t, None, :], False)
        dv = dv + tm.mul(P[:, :, t, :, None], dO[:, :, t, None, :], False)
    return tuple(tm.to_dtype(_plus_zero(x), r.dtype) for x, r in ((dq, q), (dk[:, :, :C], k), (dv[:, :, :C], v)))


__all__ = ["attention", "attention_bwd", "attention_bwd_native", "attention_native"]
