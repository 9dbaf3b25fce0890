"""Twin gradients compiled on a GPU (skipped on a machine without CUDA): every backward kernel, the
Pallas one compiled for the GPU against its Triton twin, bit for bit in float32 and bfloat16; the
differentiable twin calls (the linear's lane and MMA forms, the split RMSNorm, the one-kernel qkv
projection) under `jax.vjp` and torch autograd, bit for bit; the whole twin step's gradients, JAX vs
torch, bit for bit (float32, and bfloat16 on the MMA forms, the split norm included); and `jax.grad`
through `step_fn(kernels="pallas")` and `"auto"` against `"reference"`. Small shapes: each test
compiles a few kernels and runs in seconds. The CPU counterparts (interpreted) are
`test_grad_linear_norm.py`, `test_grad_attention_rope.py` and `test_grad_steps.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl as jx
from jax_impl.config import PRESETS, TemporalConfig, with_options
from jax_impl.weights import nest_params, stacked_weights
from kernels_pallas import twin_attention as pa
from kernels_pallas import twin_grad as pg
from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_norm as pn
from kernels_pallas import twin_rope as pr
from kernels_pallas.contract.linear import twin_split_norm
from kernels_pallas.contract.norm import TwinNorm, TwinRms, TwinSplit
from kernels_triton import twin_attention as ta
from kernels_triton import twin_grad as tg
from kernels_triton import twin_linear as tli
from kernels_triton import twin_norm as tn
from kernels_triton import twin_rope as tr
from tests.test_twin import NP, assert_same, to_torch
from torch_bridge import MimiTransformer, TemporalStreaming

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu",
                                reason="needs a CUDA GPU: the compiled twins' gradients (CPU-only machine)")

DTYPES = {"float32": (jnp.float32, torch.float32), "bfloat16": (jnp.bfloat16, torch.bfloat16)}
# jax.grad through the "pallas" / "auto" step against the "reference" step, float32 at the highest matmul
# precision: max |difference| (the CPU's measured bound is 2e-5; the kernels' sums run in their own order)
STEP_BOUND = 1e-4


def rand(rng, shape, dtype, scale=1.0, shift=0.0):
    """A numpy array of `dtype` ("float32" or "bfloat16"), the same bits on both sides."""
    return (rng.standard_normal(shape) * scale + shift).astype(NP[dtype])


def J(a):
    return None if a is None else jnp.asarray(a)


def C(a):
    return None if a is None else to_torch(np.ascontiguousarray(a)).cuda()


def same(p, t, what):
    """A JAX array (or None) and a torch CUDA tensor (or None): the same bits."""
    assert (p is None) == (t is None), what
    if p is not None:
        assert_same(np.asarray(p), t.detach().cpu(), what=what)


# ------------------------------------------------------------------------------ the backward kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_backward_kernels_gpu_twins_same_bits(dtype):
    """epilogue_grad (each act, with and without a layer scale) and batch_sum, compiled."""
    rng = np.random.default_rng(1)
    M, N = 5, 64
    dy, scale = rand(rng, (M, N), dtype), rand(rng, (3, N), dtype)
    for act in (None, "gelu", "silu_gate"):
        pre = rand(rng, (M, (2 if act == "silu_gate" else 1) * N), dtype, 3.0)
        for s in (None, scale):
            p = pg.epilogue_grad(J(dy), J(pre), J(s), jnp.int32(1), act=act)
            t = tg.epilogue_grad(C(dy), C(pre), C(s), 1, act=act)
            for a, b, what in zip(p, t, ("dpre", "ts")):
                same(a, b, f"{act} {s is not None} {what}")
    rows = rng.standard_normal((7, 96)).astype(np.float32)
    same(pg.batch_sum(J(rows), DTYPES[dtype][0]), tg.batch_sum(C(rows), DTYPES[dtype][1]), "batch_sum")


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_backward_kernels_gpu_twins_same_bits(dtype):
    """norm_grad (rms, layer) and the split norm's halves (split_grad, split_rms_grad), compiled."""
    rng = np.random.default_rng(2)
    M, D = 5, 256
    x, dy, w, b = rand(rng, (M, D), dtype, 2, 0.5), rand(rng, (M, D), dtype), rand(rng, (2, D), dtype, 0.3, 1), \
        rand(rng, (2, D), dtype, 0.3)
    for kind, bias in (("rms", None), ("layer", b)):
        p = pn.norm_grad(J(x), J(dy), J(w), J(bias), jnp.int32(1), kind=kind, eps=1e-5)
        t = tn.norm_grad(C(x), C(dy), C(w), C(bias), 1, kind=kind, eps=1e-5)
        for a, c, what in zip(p, t, ("dx", "tw")):
            same(a, c, f"{kind} {what}")
    dss = rng.standard_normal((M, D // 64)).astype(np.float32)
    ss = (rng.random((M, D // 64)) * 64 + 1).astype(np.float32)
    for d in (None, dy):
        p = pn.split_grad(J(x), J(dy), J(dss), J(w), jnp.int32(1), dy=J(d))
        t = tn.split_grad(C(x), C(dy), C(dss), C(w), 1, dy=C(d))
        for a, c, what in zip(p, t, ("dx", "ta")):
            same(a, c, f"split_grad {what}")
    p = pn.split_rms_grad(J(x), J(dy), J(ss), eps=1e-5)
    t = tn.split_rms_grad(C(x), C(dy), C(ss), eps=1e-5)
    for a, c, what in zip(p, t, ("xn", "du", "dss")):
        same(a, c, f"split_rms_grad {what}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_attention_backward_kernels_gpu_twins_same_bits(dtype):
    """rope_write_bwd (with and without rotation) and attention_bwd, compiled."""
    rng = np.random.default_rng(3)
    B, T, H, D, L, C_ = 2, 2, 2, 16, 2, 6
    dq = rand(rng, (B, H, T, D), dtype)
    drk, drv = rand(rng, (L, B, H, C_, D), dtype), rand(rng, (L, B, H, C_, D), dtype)
    angle = rng.random((B, T, D // 2)) * 50
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    wi = np.array([[1, 2], [4, 5]], np.int32)
    wm = np.array([[1, 1], [0, 1]], np.int32)
    for c, s in ((cos, sin), (None, None)):
        p = pr.rope_write_bwd(J(dq), J(c), J(s), J(drk), J(drv), jnp.int32(1), J(wi), J(wm))
        t = tr.rope_write_bwd(C(dq), C(c), C(s), C(drk), C(drv), 1, C(wi), C(wm))
        for a, b, what in zip(p, t, ("d_qkv", "d_ring_k", "d_ring_v")):
            same(a, b, f"rope_write_bwd {c is not None} {what}")
    q, k, v = rand(rng, (B, H, T, D), dtype), rand(rng, (B, H, C_, D), dtype), rand(rng, (B, H, C_, D), dtype)
    d_out = rand(rng, (B, T, H, D), dtype)
    positions = np.array([np.arange(C_) + 2, np.where(np.arange(C_) % 3 == 0, -1, np.arange(C_))], np.int32)
    q_pos = np.array([[C_ + 1, C_ + 2], [C_ - 2, C_ - 1]], np.int32)
    p = pa.attention_bwd(J(d_out), J(q), J(k), J(v), J(positions), J(q_pos), context=C_)
    t = ta.attention_bwd(C(d_out), C(q), C(k), C(v), C(positions), C(q_pos), context=C_)
    for a, b, what in zip(p, t, ("dq", "dk", "dv")):
        same(a, b, f"attention_bwd {what}")


# ---------------------------------------------------------------------- the differentiable calls
def _vjp_both(jax_fn, torch_fn, args, cotangents):
    """(jax.vjp's cotangents of args, the torch leaves after autograd) of one call on both sides."""
    got = jax.jit(lambda *a: jax.vjp(jax_fn, *a)[1](tuple(J(c) for c in cotangents)))(*(J(a) for a in args))
    leaves = [C(a).requires_grad_() for a in args]
    torch.autograd.backward(torch_fn(*leaves), tuple(C(c) for c in cotangents))
    return got, leaves


@pytest.mark.parametrize("dtype,kind,act", [("float32", "layer", "gelu"), ("bfloat16", "rms", "silu_gate"),
                                            ("bfloat16", "layer", "gelu"), ("bfloat16", None, None)])
def test_linear_gradients_gpu_same_bits_jax_vs_torch(dtype, kind, act):
    """The linear (float32: the lane form; bfloat16: the MMA form, its norm fused at K=256) with a
    norm, an activation, a scale and a residual: every gradient the same bits."""
    rng = np.random.default_rng(4)
    M, K, N, L = 6, 256, 64, 2
    n_out = N // 2 if act == "silu_gate" else N
    args = [rand(rng, (M, K), dtype), rand(rng, (L, N, K), dtype, 0.1), rand(rng, (L, n_out), dtype),
            rand(rng, (M, n_out), dtype), rand(rng, (L, K), dtype, 0.2, 1), rand(rng, (L, K), dtype, 0.2)]
    if kind is None:
        args = args[:4]

    def call(lin):
        def f(x, w, s, r, *nrm):
            norm = None if kind is None else TwinNorm(kind, nrm[0], nrm[1] if kind == "layer" else None, 1e-5)
            return (lin.linear(x, w, 1, act=act, scale=s, residual=r, norm=norm),)
        return f

    got, leaves = _vjp_both(call(pli), call(tli), args, (rand(rng, (M, n_out), dtype),))
    names = ("x", "w", "scale", "residual", "norm.weight", "norm.bias")
    for name, g, t in zip(names, got, leaves):
        if name == "norm.bias" and kind == "rms":
            continue
        same(g, t.grad, name)


def test_split_norm_gradients_gpu_same_bits_jax_vs_torch():
    """The split RMSNorm as the Helium layer runs it (bfloat16, the MMA form): `split`, a producer
    (residual, split=) and consumers (the gate with rms=, and the one-kernel qkv with rms=)."""
    rng = np.random.default_rng(5)
    M, K, L, H, D, C_ = 4, 256, 2, 2, 64, 6
    b16 = "bfloat16"
    args = [rand(rng, (M, K), b16), rand(rng, (L, K), b16, 0.25, 1), rand(rng, (L, K, K), b16, 0.05),
            rand(rng, (M, K), b16), rand(rng, (L, 4 * K, K), b16, 0.05), rand(rng, (L, 3 * H * D, K), b16, 0.05),
            rand(rng, (L, M, H, C_, D), b16), rand(rng, (L, M, H, C_, D), b16)]
    angle = rng.random((M, 1, D // 2)) * 50
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    wi, wm = (np.arange(M, dtype=np.int32)[:, None] % C_), np.ones((M, 1), np.int32)

    def call(lin, nrm, put):
        def f(x, alpha, w, r, w_in, w_qkv, rk, rv):
            u0, ss0 = nrm.split(x, alpha, 0)
            y, u, ss = lin.linear(u0, w, 0, residual=r, rms=TwinRms(ss0, 1e-5), split=TwinSplit(alpha, 1))
            g = lin.linear(u, w_in, 1, act="silu_gate", rms=TwinRms(ss, 1e-5))
            q, rk, rv = lin.linear_rope_write(u, w_qkv, 1, put(cos), put(sin), rk, rv, put(wi), put(wm),
                                              rms=TwinRms(ss, 1e-5))
            return y, g, q, rk, rv
        return f

    def torch_call(*a):
        return call(tli, tn, C)(*a[:6], a[6].clone(), a[7].clone())

    cts = (rand(rng, (M, K), b16), rand(rng, (M, 2 * K), b16), rand(rng, (M, H, 1, D), b16),
           rand(rng, (L, M, H, C_, D), b16), rand(rng, (L, M, H, C_, D), b16))
    got, leaves = _vjp_both(call(pli, pn, J), torch_call, args, cts)
    for name, g, t in zip(("x", "alpha", "w", "residual", "w_in", "w_qkv", "ring_k", "ring_v"), got, leaves):
        same(g, t.grad, name)
        assert np.asarray(g, np.float32).any(), name


# ------------------------------------------------------------------------------ the whole step
def _twin_step_gradients(cfg, dtype, device="cuda"):
    """The twin gradients of a whole stack on the GPU (`test_grad_steps`' CPU test, on CUDA): a loss
    linear in the outputs over 3 streamed steps (a row idle at step 1), its weights exact in dtype, so
    the cotangents are the same values on both sides (device: torch's); returns ({name: (jax, torch)}, (jax x, torch x))."""
    jdt, tdt = DTYPES[dtype]
    cls = TemporalStreaming if isinstance(cfg, TemporalConfig) else MimiTransformer
    module = cls.from_config(cfg, kernels="twin", dtype=tdt, device=device)
    module.init_weights(generator=torch.Generator(device=device).manual_seed(0))
    S, B = 3, 2
    rng = np.random.default_rng(1)
    xs, wx = (rng.standard_normal((S, B, 1, cfg.dim)).astype(NP[dtype]) for _ in range(2))
    wl = rng.standard_normal((S, B, 1, 1, getattr(cfg, "text_card", 1))).astype(NP[dtype])
    actives = np.array([[True, True], [True, False], [True, True]])

    def weigh(out, s, put):
        if isinstance(out, tuple):
            return (out[0] * put(wx[s])).sum() + (out[1] * put(wl[s])).sum()
        return (out * put(wx[s])).sum()

    params = nest_params(cfg, {k: jnp.asarray(v.detach().float().cpu().numpy()).astype(jdt)
                               for k, v in module.weights().items()})
    step = jx.step_fn(cfg, kernels="twin", rope_freqs=module.rope_freqs())

    def loss(params, xs):
        state, total = jx.init_state(cfg, B, dtype=jdt), 0.0
        for s in range(S):
            out, state = step(params, state, xs[s], jnp.asarray(actives[s]))
            total = total + weigh(out, s, jnp.asarray)
        return total.astype(jnp.float32)

    grads, gx = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(xs))
    grads = stacked_weights(cfg, grads)
    for w in module.weights().values():
        w.requires_grad_(True)
    module.streaming_init(B)
    def put(a):
        return to_torch(np.ascontiguousarray(a)).to(device)

    xt = put(xs).requires_grad_()
    sum(weigh(module.step(xt[s], torch.tensor(actives[s], device=device)), s, put) for s in range(S)).backward()
    return {n: (grads[n], w.grad) for n, w in module.weights().items()}, (gx, xt.grad)


SPLIT_TEMPORAL = with_options(PRESETS["temporal-small"], dim=4096, num_heads=32, hidden=1024)  # its norms split (Helium's dim)


@pytest.mark.parametrize("preset,dtype", [("temporal-small", "float32"), ("temporal-small", "bfloat16"),
                                          ("mimi-small", "float32"), ("mimi-small", "bfloat16"),
                                          ("temporal-split", "bfloat16")])
def test_twin_step_gradients_gpu_same_bits_jax_vs_torch(preset, dtype):
    """jax.grad through the JAX twin step and torch autograd through the torch twin stack, compiled:
    every weight's gradient and x's the same bits (bfloat16: the MMA forms, the one-kernel qkv; at
    dim 4096 the Helium norms run split, `twin_split_norm`)."""
    cfg = SPLIT_TEMPORAL if preset == "temporal-split" else PRESETS[preset]
    if preset == "temporal-split":
        assert twin_split_norm(cfg.dim, jnp.dtype(jnp.bfloat16), compiled=True)
    grads, (gx, tx) = _twin_step_gradients(cfg, dtype)
    for name, (g, t) in grads.items():
        assert t is not None and t.abs().max() > 0, name
        same(g, t, name)
    same(gx, tx, "x")


@pytest.mark.parametrize("preset", ["temporal-small", "mimi-small"])
def test_grad_through_pallas_and_auto_steps_gpu_is_the_reference_steps(preset):
    """jax.grad over 3 streamed steps (a row idle at step 1) through step_fn(kernels="pallas") and
    "auto" (the Pallas kernels on a GPU), float32 at the highest matmul precision, within STEP_BOUND of
    kernels="reference"'s gradient."""
    cfg = PRESETS[preset]
    params = jx.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    xs, wts = (jnp.asarray(rng.standard_normal((3, 2, 2, cfg.dim), np.float32)) for _ in range(2))
    actives = jnp.asarray([[True, True], [True, False], [True, True]])

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

    with jax.default_matmul_precision("highest"):
        want = grads("reference")
        for kernels in ("pallas", "auto"):
            got = grads(kernels)
            for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                assert jnp.isfinite(g).all(), kernels
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=0, atol=STEP_BOUND, err_msg=kernels)
    assert any(float(jnp.abs(g).max()) > 1e-3 for g in jax.tree.leaves(want))

