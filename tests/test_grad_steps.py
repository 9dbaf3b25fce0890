"""Derivatives through whole streamed steps: the "pallas" kernels' VJPs against their references,
`jax.grad` through the step on the "pallas" and "twin" kernels against the reference step, and the
twin gradients of the whole step: `jax.grad` through the JAX twin step and torch autograd through
the torch twin stack give the same bits for every weight's and input's gradient."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl as jx
from jax_impl.config import PRESETS
from jax_impl.weights import nest_params, stacked_weights
from kernels_pallas.ring_attention import ring_attention, ring_attention_native
from torch_bridge import MimiTransformer, TemporalStreaming


def _ring_case(dtype, T):
    """A ring whose slot 3 of row 0 holds NaN and is seen by no query (positions -1)."""
    L, B, H, C, D = 2, 2, 3, 37, 16
    rng = np.random.default_rng(T)
    q, rk, rv = (rng.standard_normal(shape, np.float32) for shape in ((B, H, T, D), (L, B, H, C, D), (L, B, H, C, D)))
    rk[1, 0, :, 3] = rv[1, 0, :, 3] = np.nan
    slots = np.arange(C)
    positions = np.array([np.where(slots == 3, -1, slots + 5), np.where(slots % 4 == 0, -1, slots)], np.int32)
    q_pos = np.array([np.arange(T) + 40, np.arange(T) + C - T], np.int32)
    return (*(jnp.asarray(a.astype(dtype)) for a in (q, rk, rv)), jnp.asarray(positions), jnp.asarray(q_pos))


@pytest.mark.parametrize("dtype,bound,T", [(jnp.float32, 1e-6, 2), (jnp.bfloat16, 2e-2, 1)])
def test_ring_attention_vjp_is_the_references(dtype, bound, T):
    """The Pallas ring attention's VJP (the reference's, on the layer's slots) under jit: close to the
    reference's own gradient, the rings' cotangent on layer 1 only, no NaN from a slot nobody sees."""
    q, rk, rv, positions, q_pos = _ring_case(dtype, T)
    w = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape, np.float32))

    def loss(fn, q, k, v):
        return jnp.sum(fn(q, k, v, jnp.int32(1), positions, q_pos, context=24).astype(jnp.float32) * w)

    got = jax.jit(jax.grad(partial(loss, partial(ring_attention, block_c=16, splits=2)), argnums=(0, 1, 2)))(q, rk, rv)
    clean = [jnp.nan_to_num(r) for r in (rk, rv)]  # the reference's own gradient would carry the NaN
    want = jax.jit(jax.grad(partial(loss, ring_attention_native), argnums=(0, 1, 2)))(q, *clean)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and not jnp.isnan(g).any()
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
        assert err <= bound, err
    assert not got[1][0].any() and not got[2][0].any() and got[1][1].any()


@pytest.mark.parametrize("preset", ["temporal-small", "mimi-small"])
def test_grad_through_streamed_pallas_step_is_the_reference_steps(preset):
    """jax.grad of a loss over 5 streamed steps (ring written at one step, read at the next; one row
    idle at a time) through step_fn(kernels="pallas") (RoPE: MRoPE's VJP; attention: the ring
    attention's), jitted: the gradients of the parameters and the inputs within 2e-5 of
    kernels="reference"'s (float32; the kernels' sums run in another order than XLA's)."""
    cfg = PRESETS[preset]
    params = jx.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    xs, wts = (jnp.asarray(rng.standard_normal((5, 2, 2, cfg.dim), np.float32)) for _ in range(2))
    actives = jnp.asarray(np.arange(2)[None, :] != np.arange(5)[:, None] % 3)

    def grads(kernels):
        step = jx.step_fn(cfg, kernels=kernels)

        def loss(params, xs):
            def one(state, inputs):
                x, active, wt = inputs
                out, state = step(params, state, x, active)
                out = out[0] if isinstance(out, tuple) else out
                return state, jnp.sum(jnp.tanh(out) * wt)

            return jnp.sum(jax.lax.scan(one, jx.init_state(cfg, 2), (xs, actives, wts))[1])

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, xs)

    got, want = grads("pallas"), grads("reference")
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert jnp.isfinite(g).all()
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=2e-5)
    assert any(float(jnp.abs(g).max()) > 1e-3 for g in jax.tree.leaves(got))


@pytest.mark.parametrize("preset", ["temporal-small", "mimi-small"])
def test_twin_step_gradients_are_the_same_bits_in_jax_and_torch(preset):
    """Twin gradients of a whole stack: a loss over 2 streamed steps (the ring written at step 0
    is read at step 1; row 1 idle at step 1) through `step_fn(kernels="twin")` under `jax.grad`
    (jitted) and through the torch twin stack under autograd (its weight buffers requiring grad):
    every weight's gradient and x's are the same bits (float32), and within 2e-5 of the gradient
    through `step_fn(kernels="reference")` (the twins' sums run in their own fixed order; the layer
    loop is a scan, so the twins' VJPs run under scan as in a streamed scan). The loss is linear in
    the outputs (and the text logits), so its cotangents are the fixed weights themselves in both
    frameworks."""
    cfg = PRESETS[preset]
    cls = TemporalStreaming if preset.startswith("temporal") else MimiTransformer
    torch.set_num_threads(1)
    module = cls.from_config(cfg, kernels="twin")
    module.init_weights(generator=torch.Generator().manual_seed(0))
    S, B = 2, 2
    rng = np.random.default_rng(1)
    xs, wx = (rng.standard_normal((S, B, 1, cfg.dim)).astype(np.float32) for _ in range(2))
    wl = rng.standard_normal((S, B, 1, 1, getattr(cfg, "text_card", 1))).astype(np.float32)
    actives = np.array([[True, True], [True, False]])

    def weigh(out, s, lib):  # the loss term of step s
        if isinstance(out, tuple):
            return (out[0] * lib(wx[s])).sum() + (out[1] * lib(wl[s])).sum()
        return (out * lib(wx[s])).sum()

    params = nest_params(cfg, {k: jnp.asarray(v.numpy()) for k, v in module.weights().items()})

    def grads(kernels):
        step = jx.step_fn(cfg, kernels=kernels, rope_freqs=module.rope_freqs())

        def loss(params, xs):
            state, total = jx.init_state(cfg, B), 0.0
            for s in range(S):
                out, state = step(params, state, xs[s], jnp.asarray(actives[s]))
                total = total + weigh(out, s, jnp.asarray)
            return total

        return jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(xs))

    twin, reference = grads("twin"), grads("reference")
    for g, r in zip(jax.tree.leaves(twin), jax.tree.leaves(reference)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=2e-5)
    grads, gx = stacked_weights(cfg, twin[0]), twin[1]

    for w in module.weights().values():
        w.requires_grad_(True)
    module.streaming_init(B)
    xt = torch.tensor(xs, requires_grad=True)
    sum(weigh(module.step(xt[s], torch.tensor(actives[s])), s, torch.tensor) for s in range(S)).backward()
    for name, w in module.weights().items():
        assert w.grad is not None and w.grad.abs().max() > 0, name
        assert np.array_equal(np.asarray(grads[name]), w.grad.numpy()), name
    assert np.array_equal(np.asarray(gx), xt.grad.numpy())
