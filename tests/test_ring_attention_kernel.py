"""The Pallas ring attention (interpret mode on the CPU) against its jax.numpy reference."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_impl as jx
from jax_impl.config import PRESETS
from kernels_pallas.ring_attention import MIN_QUERIES, ring_attention, ring_attention_native


# Each query count and split count once, each dtype (its bound) at least once: the other three pairs of
# the full product re-tested the same kernel at another size (a compile each).
@pytest.mark.parametrize("dtype,bound,T,splits", [(jnp.float32, 1e-6, 1, 1), (jnp.bfloat16, 1e-2, 2, 3),
                                                  (jnp.float32, 1e-6, 10, 2)])
def test_kernel_matches_reference(dtype, bound, T, splits):
    L, B, H, C, D = 2, 2, 3, 37, 16
    rng = np.random.default_rng(T)  # numpy inputs, each side one jitted call: no per-op compiles
    q, rk, rv = (jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
                 for shape in ((B, H, T, D), (L, B, H, C, D), (L, B, H, C, D)))
    slots = np.arange(C)
    positions = jnp.array([slots + 5, np.where(slots % 4 == 0, -1, slots)], jnp.int32)
    q_pos = jnp.array([np.arange(T) + 40, np.arange(T) + C - T], jnp.int32)
    got = jax.jit(partial(ring_attention, context=24, block_c=16, splits=splits))(
        q, rk, rv, jnp.int32(1), positions, q_pos)
    want = jax.jit(partial(ring_attention_native, context=24))(q, rk, rv, jnp.int32(1), positions, q_pos)
    assert got.shape == want.shape == (B, H, T, D) and got.dtype == dtype
    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    assert err <= bound, err


def test_query_that_sees_nothing_gets_zero():
    L, B, H, C, D = 1, 1, 1, 8, 16
    q = jnp.ones((B, H, 1, D))
    ring = jnp.ones((L, B, H, C, D))
    out = ring_attention(q, ring, ring, 0, jnp.full((B, C), -1, jnp.int32), jnp.zeros((B, 1), jnp.int32),
                         context=8, block_c=8)
    assert not out.any()


def test_bad_shapes_are_refused():
    ring = jnp.zeros((1, 1, 1, 8, 12))
    with pytest.raises(ValueError, match="powers of two"):
        ring_attention(jnp.zeros((1, 1, 1, 12)), ring, ring, 0, jnp.zeros((1, 8), jnp.int32),
                       jnp.zeros((1, 1), jnp.int32), context=8)
    ring = jnp.zeros((1, 1, 1, 8, 16))
    with pytest.raises(ValueError, match=f"at most {MIN_QUERIES}"):
        ring_attention(jnp.zeros((1, 1, MIN_QUERIES + 1, 16)), ring, ring, 0, jnp.zeros((1, 8), jnp.int32),
                       jnp.zeros((1, MIN_QUERIES + 1), jnp.int32), context=8)
    # a layer past the stack would read another layer's slots (the kernel) or clamp (its reference)
    for layer in (1, -1, jnp.int32(1)):
        with pytest.raises(ValueError, match=r"ring_attention\(layer\): expected values in \[0, 1\)"):
            ring_attention(jnp.zeros((1, 1, 1, 16)), ring, ring, layer, jnp.zeros((1, 8), jnp.int32),
                           jnp.zeros((1, 1), jnp.int32), context=8)


def test_stack_with_pallas_kernels_matches_xla_kernels():
    """The whole Mimi step with kernels="pallas" (interpreted) against kernels="reference"."""
    cfg = PRESETS["mimi-small"]
    params = jx.init_params(cfg, jax.random.key(0))
    xs = np.random.default_rng(0).standard_normal((14, 3, 2, cfg.dim), np.float32)
    results = {}
    for kernels in ("reference", "pallas"):
        state = jx.init_state(cfg, 3)
        step = jx.make_step(cfg, kernels=kernels, layer_loop="python")
        for t, x in enumerate(xs):  # crosses a ring wrap (capacity 10, T=2)
            out, state = step(params, state, x, np.arange(3) != t % 3)
        results[kernels] = (out, state)
    for a, b in zip(jax.tree.leaves(results["reference"]), jax.tree.leaves(results["pallas"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)



def test_mosaic_backend_runs_the_reference_where_the_mosaic_kernel_does_not_take_the_call(monkeypatch):
    """PERSONAPLEX_PALLAS_BACKEND=mosaic_gpu: float32 (and heads not a multiple of 64) go to
    `ring_attention_native` (XLA), its bits; the 16-bit stacks' heads run the twin attention's Mosaic
    kernel (`tests/test_twin_mgpu.py`)."""
    from kernels_pallas import backend

    L, B, H, C, D, T = 2, 2, 3, 37, 16, 2
    rng = np.random.default_rng(5)
    q, rk, rv = (jnp.asarray(rng.standard_normal(shape, np.float32))
                 for shape in ((B, H, T, D), (L, B, H, C, D), (L, B, H, C, D)))
    positions = jnp.asarray(np.stack([np.arange(C), np.where(np.arange(C) % 3, np.arange(C), -1)]), jnp.int32)
    q_pos = jnp.asarray([[40, 41], [C - 2, C - 1]], jnp.int32)
    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    got = jax.jit(partial(ring_attention, context=24))(q, rk, rv, jnp.int32(1), positions, q_pos)
    want = jax.jit(partial(ring_attention_native, context=24))(q, rk, rv, jnp.int32(1), positions, q_pos)
    assert np.array_equal(np.asarray(got), np.asarray(want))
    grad = jax.grad(lambda q: jnp.sum(ring_attention(q, rk, rv, 1, positions, q_pos, context=24)))(q)
    assert np.isfinite(np.asarray(grad)).all()
