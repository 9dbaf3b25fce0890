"""Twin gradients of the attention and RoPE kernels: the JAX VJP of each Pallas twin (interpreted)
and the torch autograd of its Triton twin (TRITON_INTERPRET=1) give the same bits, and both are
close to the gradient of the kernel's plain reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl.ops import masked_attention
from jax_impl.tables import rope_freqs
from kernels_pallas import twin_attention as pa
from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_rope as pr
from kernels_pallas.contract.norm import TwinNorm, TwinRms
from kernels_triton import twin_attention as ta
from kernels_triton import twin_linear as tli
from kernels_triton import twin_rope as tr
from tests.test_twin import NP, assert_same, attention_case, to_torch


def _rope_case(dtype, B=2, T=3, H=2, D=8, L=2, C=5, seed=0):
    """qkv, the tables, rings, write_index / write_mask (one query not written), and cotangents
    of (q, ring_k, ring_v), as numpy arrays of `dtype` (float32 tables)."""
    rng = np.random.default_rng(seed)
    dt = NP[dtype]
    qkv = rng.standard_normal((B, T, 3, H, D)).astype(dt)
    offset = np.array([3, 7], np.int32)[:B]
    angle = (offset[:, None, None] + np.arange(T)[None, :, None]) * rope_freqs(D, 10000.0)[None, None, :]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    rk, rv = (rng.standard_normal((L, B, H, C, D)).astype(dt) for _ in range(2))
    wi = ((offset[:, None] + np.arange(T)) % C).astype(np.int32)
    wm = np.ones((B, T), np.int32)
    wm[0, 2] = 0
    cts = (rng.standard_normal((B, H, T, D)).astype(dt),
           *(rng.standard_normal((L, B, H, C, D)).astype(dt) for _ in range(2)))
    return qkv, cos, sin, rk, rv, wi, wm, cts


@pytest.mark.parametrize("dtype,rope", [("float32", True), ("bfloat16", True), ("bfloat16", False)])
def test_rope_write_twin_gradients_same_bits(dtype, rope):
    """rope_write's VJP (the Pallas backward kernel) == torch autograd through the Triton twin ==
    both backward references, bit for bit (nothing is summed: each element is one rotation's
    roundings); XLA's derivative of rope_write_native (which may fuse a product into its add) within
    one rounding of the dtype. Without rotation (cos = sin = None) the cotangents pass as they are."""
    qkv, cos, sin, rk, rv, wi, wm, cts = _rope_case(dtype)
    if not rope:
        cos = sin = None

    def J(a):
        return None if a is None else jnp.asarray(a)

    def T(a):
        return None if a is None else to_torch(a)

    def vjp(fn):
        _, back = jax.vjp(lambda a, k, v: fn(a, J(cos), J(sin), k, v, jnp.int32(1), J(wi), J(wm)), J(qkv), J(rk), J(rv))
        return back(tuple(J(c) for c in cts))

    got = jax.jit(lambda: vjp(pr.rope_write))()
    xla = jax.jit(lambda: vjp(pr.rope_write_native))()
    ref = pr.rope_write_bwd_native(*(J(a) for a in (cts[0], cos, sin, cts[1], cts[2])), 1, J(wi), J(wm))

    leaves = [to_torch(a).clone().requires_grad_() for a in (qkv, rk, rv)]
    q, ring_k, ring_v = tr.rope_write(leaves[0], T(cos), T(sin), leaves[1].clone(), leaves[2].clone(),
                                      1, to_torch(wi), to_torch(wm))
    torch.autograd.backward((q, ring_k, ring_v), tuple(to_torch(c) for c in cts))
    tref = tr.rope_write_bwd_native(to_torch(cts[0]), T(cos), T(sin), to_torch(cts[1]).clone(),
                                    to_torch(cts[2]).clone(), 1, to_torch(wi), to_torch(wm))
    for i, what in enumerate(("d_qkv", "d_ring_k", "d_ring_v")):
        assert_same(got[i], ref[i], leaves[i].grad, tref[i], what=what)
        a, b = (np.asarray(x, np.float32) for x in (got[i], xla[i]))
        np.testing.assert_allclose(a, b, rtol=2.0**-7 if dtype == "bfloat16" else 2.0**-22, atol=1e-7)
    assert not np.asarray(got[1], np.float32)[1, 0, :, 3].any() and np.asarray(got[1], np.float32)[0].any()


def test_rope_write_refuses_a_differentiated_table():
    qkv, cos, sin, rk, rv, wi, wm, _ = _rope_case("float32")
    J = jnp.asarray
    with pytest.raises(NotImplementedError, match=r"rope_write\(cos, sin\)"):
        jax.grad(lambda c: jnp.sum(pr.rope_write(J(qkv), c, J(sin), J(rk), J(rv), 1, J(wi), J(wm))[0]))(J(cos))
    with pytest.raises(NotImplementedError, match=r"rope_write\(cos, sin\)"):
        tr.rope_write(to_torch(qkv), to_torch(cos).requires_grad_(), to_torch(sin), to_torch(rk), to_torch(rv), 1,
                      to_torch(wi), to_torch(wm))


def test_rope_write_refuses_one_slot_written_twice_in_a_row():
    """Two written tokens of one batch row at one slot (write_mask says which are written): which write
    lands is not fixed, and the backwards would credit different ones; refused on both sides wherever
    the slots are on the host, the rings untouched. A token not written may share a written one's slot."""
    qkv, cos, sin, rk, rv, wi, wm, cts = _rope_case("float32")  # B=2, T=3, C=5; token 2 of row 0 not written
    dup, shared = wi.copy(), wi.copy()
    dup[1, 2] = dup[1, 0]
    shared[0, 2] = shared[0, 0]
    x = np.random.default_rng(6).standard_normal((2 * 3, 16)).astype(np.float32)
    w = np.random.default_rng(7).standard_normal((2, 3 * 2 * 8, 16)).astype(np.float32)
    sides = {"pallas": (pr, pli, jnp.asarray), "triton": (tr, tli, to_torch)}
    for side, (rope, lin, put) in sides.items():
        rings = [put(rk), put(rv)]
        for fn in (rope.rope_write, rope.rope_write_native):
            with pytest.raises(ValueError, match=r"^rope_write\(write_index\): expected distinct slots among a batch "
                                                 r"row's written tokens \(write_mask\), got slot 2 twice in row 1$"):
                fn(put(qkv), put(cos), put(sin), *rings, 1, put(dup), put(wm))
            fn(put(qkv), put(cos), put(sin), put(rk), put(rv), 1, put(shared), put(wm))
        with pytest.raises(ValueError, match=r"^rope_write\(write_index\): expected distinct slots"):
            rope.rope_write_bwd(put(cts[0]), put(cos), put(sin), put(cts[1]), put(cts[2]), 1, put(dup), put(wm))
        for fn in (lin.linear_rope_write, lin.linear_rope_write_native):
            with pytest.raises(ValueError, match=r"^linear_rope_write\(write_index\): expected distinct slots"):
                fn(put(x), put(w), 1, put(cos), put(sin), *rings, put(dup), put(wm))
        for ring, before in zip(rings, (rk, rv)):
            assert_same(np.asarray(ring), before, what=f"{side}: the rings")


def test_a_second_derivative_through_attention_or_rope_write_is_refused():
    """The twin kernels have no derivative of their own: torch's backward with create_graph=True (whose
    first derivative would differentiate to zero) and JAX's derivative of rope_write's and attention's
    backward raise NotImplementedError naming the twin."""
    qkv, cos, sin, rk, rv, wi, wm, _ = _rope_case("float32")
    q, ak, av, positions, q_pos = attention_case(2, 2, 2, 8, 10, "float32")
    tq = to_torch(q).requires_grad_()
    with pytest.raises(NotImplementedError, match=r"^attention: the twin kernels have no second derivative"):
        out = ta.attention(tq, to_torch(ak), to_torch(av), 1, torch.from_numpy(positions), torch.from_numpy(q_pos),
                           context=10)
        torch.autograd.grad((out ** 2).sum(), tq, create_graph=True)
    tqkv = to_torch(qkv).requires_grad_()
    with pytest.raises(NotImplementedError, match=r"^rope_write: the twin kernels have no second derivative"):
        out = tr.rope_write(tqkv, to_torch(cos), to_torch(sin), to_torch(rk), to_torch(rv), 1, to_torch(wi),
                            to_torch(wm))[0]
        torch.autograd.grad((out ** 2).sum(), tqkv, create_graph=True)
    J = jnp.asarray

    def first(a):
        return jax.grad(lambda a: jnp.sum(pr.rope_write(a, J(cos), J(sin), J(rk), J(rv), 1, J(wi), J(wm))[0] ** 2))(a)

    def first_attention(a):
        return jax.grad(lambda a: jnp.sum(pa.attention(a, J(ak), J(av), jnp.int32(1), J(positions), J(q_pos),
                                                       context=10) ** 2))(a)

    for who, f, a in (("rope_write", first, J(qkv)), ("attention", first_attention, J(q))):
        assert np.abs(np.asarray(f(a))).max() > 0  # the first derivative stands
        with pytest.raises(NotImplementedError, match=rf"^{who}: the twin kernels have no second derivative"):
            jax.grad(lambda a, f=f: jnp.sum(f(a) ** 2))(a)


def _dense_attention(q, k, v, positions, q_pos, context):
    """The reference layer's attention (`ops.masked_attention`, XLA) on one layer's slots: [B, T, H, D]."""
    delta = q_pos[:, :, None] - positions[:, None, :]
    mask = ((positions[:, None, :] >= 0) & (delta >= 0) & (delta < context))[:, None]
    return masked_attention(q, k, v, mask).transpose(0, 2, 1, 3)


# C=10: one block; C=130: three blocks, the last one padded, three splits in the forward
@pytest.mark.parametrize("B,H,T,D,C,dtype", [(2, 2, 2, 8, 10, "float32"), (2, 1, 1, 16, 130, "bfloat16")])
def test_attention_twin_gradients_same_bits(B, H, T, D, C, dtype):
    """attention's VJP (the Pallas backward kernels) == torch autograd through the Triton twin ==
    both attention_bwd_native (jax.numpy and torch), bit for bit: dq, and the rings' gradient (layer 1 only). The masked slot 3
    (NaN v, Inf k) reaches no gradient; row 0 sees nothing and gets none. Against XLA's derivative
    of the reference layer's attention in float32 (on the slots, the masked one zeroed): within 1e-6
    (float32: measured 1.8e-7) and 2**-8 (bfloat16 q and ring: one rounding of gradients below 1;
    measured 3.6e-4). The blocks, the padded last block and the splits are dtype-independent code:
    the ring of several runs in bfloat16, the 16-bit loads' case."""
    q, rk, rv, positions, q_pos = attention_case(B, H, T, D, C, dtype)
    ct = np.asarray(jnp.asarray(np.random.default_rng(5).standard_normal((B, T, H, D)), jnp.float32).astype(q.dtype))
    J = jnp.asarray
    _, back = jax.vjp(lambda a, k, v: pa.attention(a, k, v, jnp.int32(1), J(positions), J(q_pos), context=C),
                      J(q), J(rk), J(rv))
    got = jax.jit(back)(J(ct))
    ref = jax.jit(lambda: pa.attention_bwd_native(J(ct), J(q), J(rk[1]), J(rv[1]), J(positions), J(q_pos),
                                                  context=C))()
    leaves = [to_torch(a).clone().requires_grad_() for a in (q, rk, rv)]
    out = ta.attention(*leaves, 1, torch.from_numpy(positions), torch.from_numpy(q_pos), context=C)
    out.backward(to_torch(ct))
    tref = ta.attention_bwd_native(to_torch(ct), *(to_torch(a) for a in (q, rk[1], rv[1])),
                                   torch.from_numpy(positions), torch.from_numpy(q_pos), context=C)
    assert_same(got[0], ref[0], leaves[0].grad, tref[0], what="dq")
    for i, what in ((1, "d_ring_k"), (2, "d_ring_v")):
        assert_same(got[i], leaves[i].grad, what=what)
        assert_same(got[i][1], ref[i], tref[i], what=what)
        g = np.asarray(got[i], np.float32)
        assert not g[0].any() and not g[1, :, :, 3].any() and not g[1, 0].any() and np.isfinite(g).all()
    f32 = [J(np.nan_to_num(a, posinf=0.0).astype(np.float32)) for a in (q, rk[1], rv[1])]
    f32 = [f32[0], *(a.at[:, :, 3].set(0.0) for a in f32[1:])]
    _, xla_back = jax.vjp(lambda a, k, v: _dense_attention(a, k, v, J(positions), J(q_pos), C), *f32)
    want = xla_back(J(ct.astype(np.float32)))
    bound = 1e-6 if dtype == "float32" else 2.0**-8
    for g, w in zip((got[0], got[1][1], got[2][1]), want):
        assert float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) <= bound


def test_gradients_flow_through_the_ring_over_streamed_steps_same_bits():
    """Two streamed steps of rope_write then attention on layer 1 of a 2-layer ring (the k, v written
    at step 0 are read at step 1): jax.grad on the Pallas twins == torch autograd on the Triton twins
    (the rings written in place), bit for bit, for every step's qkv and the initial rings; the step-0
    k and v get gradient from step 1's read."""
    B, T, H, D, L, C = 2, 2, 2, 8, 2, 6
    rng = np.random.default_rng(3)
    qkvs = rng.standard_normal((2, B, T, 3, H, D)).astype(np.float32)
    rings = rng.standard_normal((2, L, B, H, C, D)).astype(np.float32)
    wts = rng.standard_normal((2, B, T, H, D)).astype(np.float32)
    steps = []
    for s, offset in enumerate((np.array([0, 3]), np.array([2, 5]))):
        q_pos = (offset[:, None] + np.arange(T)).astype(np.int32)
        end = offset + T
        slots = np.arange(C)
        held = np.where(slots[None, :] <= (end[:, None] - 1) % C, slots[None, :], slots[None, :] - C)
        held = held + (end[:, None] - 1) // C * C
        positions = np.where((held >= 0) & (held < end[:, None]), held, -1).astype(np.int32)
        angle = q_pos[:, :, None] * rope_freqs(D, 10000.0)[None, None, :]
        steps.append((np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32), q_pos % C,
                      np.ones((B, T), np.int32), positions, q_pos, wts[s]))

    def run(rope_write, attention, total, qkvs, rk, rv, arr):
        for s, (cos, sin, wi, wm, positions, q_pos, w) in enumerate(steps):
            q, rk, rv = rope_write(qkvs[s], arr(cos), arr(sin), rk, rv, 1, arr(wi), arr(wm))
            out = attention(q, rk, rv, 1, arr(positions), arr(q_pos), context=C)
            total = total + (out * arr(w)).sum()
        return total

    J = jnp.asarray
    got = jax.jit(jax.grad(lambda *a: run(pr.rope_write, pa.attention, 0.0, *a, J), argnums=(0, 1, 2)))(
        J(qkvs), J(rings[0]), J(rings[1]))
    leaves = [torch.from_numpy(a).requires_grad_() for a in (qkvs, rings[0], rings[1])]
    run(tr.rope_write, ta.attention, 0.0, leaves[0].unbind(0), leaves[1].clone(), leaves[2].clone(),
        torch.from_numpy).backward()
    for g, t, what in zip(got, leaves, ("d_qkv", "d_ring_k", "d_ring_v")):
        assert_same(g, t.grad, what=what)
    assert np.asarray(got[0])[0, :, :, 1:].any()  # step 0's k, v: read again at step 1


def test_entry_passes_x_cotangent_and_refuses_a_differentiated_freqs():
    """The twin step's entry kernel: x's copy carries x's cotangent unchanged; the tables stop
    gradients (rope_write then sees constants); a perturbed freqs is refused."""
    from kernels_pallas import twin_entry as pe

    freqs, offset, start = jnp.asarray(rope_freqs(8, 10000.0)), jnp.array([0, 3], jnp.int32), jnp.zeros(2, jnp.int32)

    def entry(x, fr, active=None):
        return pe.entry(offset, start, active, x, fr, capacity=6, convention="personaplex", num_heads=2)

    w = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 4)), jnp.float32)
    g = jax.jit(jax.grad(lambda x: jnp.sum(entry(x, freqs).x * w) + jnp.sum(entry(x, freqs).cos)))(jnp.ones((2, 1, 4)))
    assert_same(g, w, what="dx")
    with pytest.raises(NotImplementedError, match=r"entry\(freqs\)"):
        jax.grad(lambda fr: jnp.sum(entry(jnp.ones((2, 1, 4)), fr, jnp.array([True, False])).cos))(freqs)


@pytest.mark.parametrize("norm_form", ["norm", "rms"])
def test_qkv_rope_write_one_kernel_gradients_are_rope_write_then_linear(norm_form):
    """linear_rope_write's one-kernel MMA form (interpreted, bfloat16), with its norm (norm=) or the split
    norm's consumer half (rms=): the gradients of x, w, the norm's weight or ss, and the rings are the
    bits of the two calls it fuses (linear(form="mma") then rope_write) differentiated, and torch's
    autograd through the Triton kernel gives the same bits; a differentiated table is refused."""
    B, T, H, D, C, L, K = 2, 3, 2, 16, 5, 2, 128
    _, cos, sin, ring_k, ring_v, wi, wm, _ = _rope_case("bfloat16", B, T, H, D, L, C, seed=4)  # a row not written
    rng = np.random.default_rng(5)
    x = rng.standard_normal((B * T, K)).astype(NP["bfloat16"])
    w = (rng.standard_normal((L, 3 * H * D, K)) * 0.1).astype(NP["bfloat16"])
    nw = (1 + 0.1 * rng.standard_normal((L, K))).astype(NP["bfloat16"])
    cts = tuple(rng.standard_normal(s).astype(NP["bfloat16"]) for s in ((B, H, T, D), ring_k.shape, ring_v.shape))
    ss = (rng.random((B * T, K // 64)) * K / 2 + 1).astype(np.float32)
    names = ("x", "w", "nw" if norm_form == "norm" else "ss", "ring_k", "ring_v")
    J = jnp.asarray

    def kw(n):
        return {"norm": TwinNorm("rms", n, None, 1e-5)} if norm_form == "norm" else {"rms": TwinRms(n, 1e-5)}

    def fused(x, w, n, rk, rv):
        return pli.linear_rope_write(x, w, L - 1, J(cos), J(sin), rk, rv, J(wi), J(wm), form="mma", **kw(n))

    def two(x, w, n, rk, rv):
        qkv = pli.linear(x, w, L - 1, form="mma", **kw(n)).reshape(B, T, 3, H, D)
        return pr.rope_write(qkv, J(cos), J(sin), rk, rv, L - 1, J(wi), J(wm))

    args = [J(a) for a in (x, w, nw if norm_form == "norm" else ss, ring_k, ring_v)]
    got, want = (jax.jit(lambda *a, f=f: jax.vjp(f, *a)[1](tuple(J(c) for c in cts)))(*args) for f in (fused, two))
    tt = [to_torch(np.array(a)).requires_grad_() for a in args]
    out = tli.linear_rope_write(tt[0], tt[1], L - 1, to_torch(cos), to_torch(sin), tt[3].clone(), tt[4].clone(),
                                to_torch(wi), to_torch(wm), form="mma", **kw(tt[2]))
    torch.autograd.backward(out, tuple(to_torch(c) for c in cts))
    for n, g, r, t in zip(names, got, want, tt):
        assert_same(g, r, t.grad, what=n)
    assert np.asarray(got[0], np.float32).any() and np.asarray(got[2], np.float32).any()
    with pytest.raises(NotImplementedError, match=r"linear_rope_write\(cos, sin\)"):
        jax.grad(lambda c: pli.linear_rope_write(*args[:2], L - 1, c, J(sin), *args[3:], J(wi), J(wm), form="mma",
                                                 **kw(args[2]))[0].astype(jnp.float32).sum())(J(cos))
    with pytest.raises(NotImplementedError, match=r"linear_rope_write\(cos, sin\)"):
        tli.linear_rope_write(to_torch(x), to_torch(w), L - 1, to_torch(cos).requires_grad_(), to_torch(sin),
                              to_torch(ring_k), to_torch(ring_v), to_torch(wi), to_torch(wm), form="mma",
                              **kw(to_torch(np.array(args[2]))))
