"""Twin gradients of the attention and RoPE kernels: the JAX VJP of each Pallas twin (interpreted)
and the torch autograd of its Triton twin (TRITON_INTERPRET=1) give the same bits, and both are
close to the gradient of the kernel's plain reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl.tables import rope_freqs
from kernels_pallas import twin_rope as pr
from kernels_triton import twin_rope as tr
from tests.test_twin import NP, assert_same, to_torch


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_write_twin_gradients_same_bits(dtype):
    """rope_write's VJP (the Pallas backward kernel) == torch autograd through the Triton twin ==
    both backward references, bit for bit (nothing is summed: each element is one rotation's
    roundings); XLA's derivative of rope_write_native (which may fuse a product into its add) within
    one rounding of the dtype."""
    qkv, cos, sin, rk, rv, wi, wm, cts = _rope_case(dtype)
    J = jnp.asarray

    def vjp(fn):
        _, back = jax.vjp(lambda a, k, v: fn(a, J(cos), J(sin), k, v, jnp.int32(1), J(wi), J(wm)), J(qkv), J(rk), J(rv))
        return back(tuple(J(c) for c in cts))

    got = jax.jit(lambda: vjp(pr.rope_write))()
    xla = jax.jit(lambda: vjp(pr.rope_write_native))()
    ref = pr.rope_write_bwd_native(*(J(a) for a in (cts[0], cos, sin, cts[1], cts[2])), 1, J(wi), J(wm))

    leaves = [to_torch(a).clone().requires_grad_() for a in (qkv, rk, rv)]
    q, ring_k, ring_v = tr.rope_write(leaves[0], to_torch(cos), to_torch(sin), leaves[1].clone(), leaves[2].clone(),
                                      1, to_torch(wi), to_torch(wm))
    torch.autograd.backward((q, ring_k, ring_v), tuple(to_torch(c) for c in cts))
    tref = tr.rope_write_bwd_native(to_torch(cts[0]), to_torch(cos), to_torch(sin), to_torch(cts[1]).clone(),
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
