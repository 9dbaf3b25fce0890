"""The twin kernels: every Pallas twin (interpreted), its Triton twin (TRITON_INTERPRET=1) and its
jax.numpy reference return the same bits; rows do not depend on the batch; the twin step of both
stacks is bit-identical torch vs JAX for every tensor at every step (the cross-check), across
ring wraps and recycling, float32 and bfloat16, both conventions.

The GPU counterpart (compiled kernels, real sizes) is `benchmarks/twin_gpu.py` and
`benchmarks/twin_step_gpu.py`; its results are in `benchmarks/RESULTS.md`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from jax.experimental import pallas as pl

import jax_impl as jx
from jax_impl.config import with_options
from jax_impl.parity import bits
from jax_impl.tables import rope_freqs
from kernels_pallas import twin_attention as pa
from kernels_pallas import twin_entry as pe
from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_math as pm
from kernels_pallas import twin_norm as pn
from kernels_pallas import twin_rope as pr
from kernels_pallas.contract import attention as ca
from kernels_pallas.contract import linear as cl
from kernels_pallas.contract import norm as cn
from kernels_pallas.contract.norm import TwinNorm, TwinRms, TwinSplit
from kernels_triton import twin_attention as ta
from kernels_triton import twin_linear as tli
from kernels_triton import twin_math as ttm
from kernels_triton import twin_norm as tn
from kernels_triton import twin_rope as tr
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.crosscheck import crosscheck
from torch_bridge.dlpack import to_jax
from torch_bridge.tables import build_step_tables as build_torch_tables

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def to_torch(a: np.ndarray) -> torch.Tensor:
    """numpy (ml_dtypes bfloat16 included) -> torch with the same bits (a writable copy: a JAX array's
    numpy view is read-only)."""
    a = np.array(a, order="C")
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def assert_same(*arrays, what=""):
    first = bits(arrays[0] if not isinstance(arrays[0], torch.Tensor) else arrays[0].detach())
    for i, a in enumerate(arrays[1:], 1):
        other = bits(a.detach() if isinstance(a, torch.Tensor) else a)
        assert first.shape == other.shape, (what, first.shape, other.shape)
        bad = np.flatnonzero(first.ravel() != other.ravel())
        assert bad.size == 0, f"{what}: array {i}: {bad.size} of {first.size} elements differ, first at {bad[:5]}"


# ---------------------------------------------------------------------------------------- math
@triton.jit
def _math_kernel(x_ptr, o_ptr, N: tl.constexpr, FN: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    if FN == 0:
        y = ttm.exp(x)
    elif FN == 1:
        y, _ = ttm.sincos(x)
    elif FN == 2:
        _, y = ttm.sincos(x)
    elif FN == 3:
        y = ttm.erf(x)
    elif FN == 4:
        y = ttm.silu(x)
    else:
        y = ttm.gelu(x)
    tl.store(o_ptr + i, y)


def _jax_math(x, fn):
    return [lambda: pm.exp(x, False), lambda: pm.sincos(x, False)[0], lambda: pm.sincos(x, False)[1],
            lambda: pm.erf(x, False), lambda: pm.silu(x, False), lambda: pm.gelu(x, False)][fn]()


MATH = [  # (fn, input range, float64 reference, bound on |twin - ref| / max(|ref|, floor), floor)
    (0, (-87.0, 88.0), np.exp, 3e-7, 1e-30),
    (1, (0.0, 3000.0), np.sin, 5e-7, 1.0),       # RoPE angles: absolute error of a few ulp of 1
    (2, (0.0, 3000.0), np.cos, 5e-7, 1.0),
    (3, (-5.0, 5.0), np.vectorize(math.erf), 7e-7, 1.0),
    (4, (-30.0, 30.0), lambda x: x / (1 + np.exp(-x)), 3e-7, 1.0),
    (5, (-8.0, 8.0), lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))), 1.5e-6, 1.0),
]


@pytest.mark.parametrize("fn,lohi,ref,bound,floor", MATH, ids=["exp", "sin", "cos", "erf", "silu", "gelu"])
def test_transcendentals_same_bits_in_pallas_triton_and_jnp(fn, lohi, ref, bound, floor):
    x = np.random.default_rng(fn).uniform(*lohi, 2048).astype(np.float32)
    if fn == 0:
        x[:4] = [-np.inf, np.inf, -100.0, 0.0]
    out_t = torch.empty(x.size)
    _math_kernel[(1,)](torch.from_numpy(x), out_t, N=x.size, FN=fn)

    def kernel(x_ref, o_ref):
        o_ref[...] = _jax_math(x_ref[...], fn)

    out_p = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32), interpret=True)(x)
    out_j = jax.jit(lambda a: _jax_math(a, fn))(x)
    assert_same(out_t, out_p, out_j, what=f"fn {fn}")
    want = ref(x.astype(np.float64))
    got = out_t.numpy().astype(np.float64)
    finite = np.isfinite(want)
    err = np.abs(got[finite] - want[finite]) / np.maximum(np.abs(want[finite]), floor)
    assert err.max() <= bound, (fn, err.max())
    if fn == 0:
        assert got[:4].tolist() == [0.0, np.inf, 0.0, 1.0]


@triton.jit
def _tree_kernel(x_ptr, o_ptr, R: tl.constexpr, N: tl.constexpr, LOOP: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, R)[:, None] * N + tl.arange(0, N)[None, :])
    tl.store(o_ptr + tl.arange(0, R), ttm.tree_sum(x, R, N, LOOP))


def test_tree_sum_order_is_the_halving_order():
    """Pallas's tree_sum and both forms of Triton's (split pair, axis sum) add in the halving order."""
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 1e4
    want = x.copy()
    while want.shape[-1] > 1:
        h = want.shape[-1] // 2
        want = want[:, :h] + want[:, h:]
    assert not np.array_equal(want[:, 0], x.sum(-1))  # the order shows in the bits of this input
    assert_same(np.asarray(jax.jit(pm.tree_sum)(x)), want)
    for loop in (False, True):
        out = torch.empty(4)
        _tree_kernel[(1,)](torch.from_numpy(x), out, R=4, N=64, LOOP=loop)
        assert_same(out, want[:, 0], what=f"triton loop={loop}")
    with pytest.raises(ValueError, match="power of two"):
        pm.tree_sum(jnp.ones((2, 6)))


# ------------------------------------------------------------------------------------- kernels
def _triton_module_text(fn, *shapes, monkeypatch, capsys) -> str:
    """The Triton modules (text) of the Pallas kernels `fn` launches, lowered for CUDA on this
    CPU-only machine (nothing is allocated or run: pallas_call(debug=True) prints them)."""
    import functools

    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
    capsys.readouterr()
    jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    return capsys.readouterr().out


@pytest.mark.parametrize("B,wide", [(16, True), (1, False)])
def test_ring_kernels_address_a_large_ring_in_64_bits(B, wide, monkeypatch, capsys):
    """The temporal ring at B=16 has L*B*H*C*D = 6.3e9 elements: flat int32 offsets would wrap
    (and read and write other memory); the attention and the ring write must address it in 64
    bits. At B=1 (0.4e9 elements) 32 bits do (the check can fail)."""
    L, H, T, C, D = 32, 32, 1, 3000, 128
    S = jax.ShapeDtypeStruct
    ring, pos, qp = S((L, B, H, C, D), jnp.bfloat16), S((B, C), jnp.int32), S((B, T), jnp.int32)
    attn = _triton_module_text(
        lambda q, k, p, t: pa.attention(q, k, k, jnp.int32(31), p, t, context=C, interpret=False),
        S((B, H, T, D), jnp.bfloat16), ring, pos, qp, monkeypatch=monkeypatch, capsys=capsys)
    rope = _triton_module_text(
        lambda qkv, c, k, i, m: pr.rope_write(qkv, c, c, k, k, jnp.int32(31), i, m, interpret=False),
        S((B, T, 3, H, D), jnp.bfloat16), S((B, T, D // 2), jnp.float32), ring, qp, S((B, T), jnp.bool_),
        monkeypatch=monkeypatch, capsys=capsys)
    fused = _triton_module_text(  # the MMA form's qkv projection with the ring write in its epilogue
        lambda x, w, c, k, i, m: pli.linear_rope_write(x, w, jnp.int32(31), c, c, k, k, i, m, interpret=False),
        S((B * T, 4096), jnp.bfloat16), S((L, 3 * H * D, 4096), jnp.bfloat16), S((B, T, D // 2), jnp.float32), ring,
        qp, S((B, T), jnp.bool_), monkeypatch=monkeypatch, capsys=capsys)
    assert "module @twin_attention" in attn and "module @twin_rope_write" in rope
    assert "module @twin_qkv_rope_write" in fused and "tt.dot" in fused
    assert ("x128xi64>" in attn) == wide   # the [BC, D] offsets of the k and v loads
    assert ("i64" in rope) == wide
    assert ("16x64xi64>" in fused) == wide  # the [rows, BN] offsets of its ring stores


LINEAR = [  # M, N, K, L, act, scale, residual, dtype
    (4, 64, 176, 2, None, False, False, "float32"),
    (3, 64, 64, 2, None, False, True, "bfloat16"),
    (5, 96, 64, 2, "silu_gate", False, False, "float32"),
    (4, 64, 128, 2, "silu_gate", True, True, "bfloat16"),  # the Triton gate kernel's scale and residual
    (2, 32, 128, 1, "gelu", True, True, "bfloat16"),
    (17, 96, 48, 2, None, True, True, "float32"),
]


@pytest.mark.parametrize("M,N,K,L,act,scale,res,dtype", LINEAR)
def test_linear_twins_same_bits_and_batch_invariant(M, N, K, L, act, scale, res, dtype):
    rng = np.random.default_rng(M * N + K)
    n_out = N // 2 if act == "silu_gate" else N
    x = rng.standard_normal((M, K)).astype(NP[dtype])
    w = (rng.standard_normal((L, N, K)) * 0.1).astype(NP[dtype])
    s = rng.standard_normal((L, n_out)).astype(NP[dtype]) if scale else None
    r = rng.standard_normal((M, n_out)).astype(NP[dtype]) if res else None
    T = (lambda a: None if a is None else to_torch(a))
    kw = {"act": act}
    y_p = jax.jit(lambda x, w, s, r, i: pli.linear(x, w, i, scale=s, residual=r, **kw))(x, w, s, r, jnp.int32(L - 1))
    y_n = jax.jit(lambda x, w, s, r, i: pli.linear_native(x, w, i, scale=s, residual=r, **kw))(x, w, s, r,
                                                                                              jnp.int32(L - 1))
    y_t = tli.linear(T(x), T(w), L - 1, scale=T(s), residual=T(r), **kw)
    y_tn = tli.linear_native(T(x), T(w), L - 1, scale=T(s), residual=T(r), **kw)
    assert_same(y_p, y_n, y_t, y_tn, what="linear")
    # other tiles and pipeline depths: the speed changes, never the bits
    y_p2 = pli.linear(x, w, L - 1, scale=s, residual=r, block_n=16, **kw)
    y_t2 = tli.linear(T(x), T(w), L - 1, scale=T(s), residual=T(r), block_n=16, num_stages=1, **kw)
    assert_same(y_p, y_p2, y_t2, what="linear, other tiles")
    for row in (0, M - 1):  # alone, the row has the bits it has among the others
        alone = tli.linear(T(x[row:row + 1]), T(w), L - 1, scale=T(s), residual=None if r is None else T(r[row:row + 1]),
                           **kw)
        assert_same(alone[0], y_t[row], what=f"row {row} alone")
    if act is None and not scale and not res:
        want = x.astype(np.float64) @ w[L - 1].astype(np.float64).T
        assert np.abs(np.asarray(y_p, np.float64) - want).max() <= 1e-5 * np.abs(want).max()


def test_linear_refuses_bad_arguments():
    x, w = jnp.ones((2, 8)), jnp.ones((1, 4, 8))
    with pytest.raises(ValueError, match=r"linear\(act\)"):
        pli.linear(x, w, 0, act="relu")
    with pytest.raises(ValueError, match=r"linear\(w\)"):
        pli.linear(x, jnp.ones((1, 4, 6)), 0)
    with pytest.raises(TypeError, match=r"linear\(w\): dtype"):
        pli.linear(x, w.astype(jnp.bfloat16), 0)
    with pytest.raises(ValueError, match=r"linear\(layer\)"):
        tli.linear(torch.ones(2, 8), torch.ones(1, 4, 8), 3)


def test_indexes_outside_their_arrays_are_refused_alike_on_both_sides():
    """A layer, or a ring slot, that the caller holds on the host is checked against its array on
    both sides (a kernel would read another layer's weights, or write outside the ring); a bool or
    float index and a layer of several elements are refused by type; other argument slips too."""
    x, w = np.ones((2, 16), np.float32), np.ones((2, 8, 16), np.float32)
    calls = {"pallas": lambda layer, **kw: pli.linear(jnp.asarray(x), jnp.asarray(w), layer, **kw),
             "pallas native": lambda layer, **kw: pli.linear_native(jnp.asarray(x), jnp.asarray(w), layer, **kw),
             "triton": lambda layer, **kw: tli.linear(to_torch(x), to_torch(w), layer, **kw),
             "triton native": lambda layer, **kw: tli.linear_native(to_torch(x), to_torch(w), layer, **kw)}
    for side, call in calls.items():
        host = jnp.int32 if side.startswith("pallas") else (lambda v: torch.tensor(v))
        for layer, error, message in ((2, ValueError, r"expected values in \[0, 2\), got 2"),
                                      (-1, ValueError, r".*got -1"), (np.int64(5), ValueError, r".*got 5"),
                                      (host(2), ValueError, r".*got 2"), (True, TypeError, "expected integers"),
                                      (host([0, 1]), TypeError, "expected one index")):
            with pytest.raises(error, match=rf"linear(_native)?\(layer\): {message}"):
                call(layer)
        if "native" in side:
            with pytest.raises(ValueError, match=r"linear_native\(split, rms\): the split RMSNorm's halves"):
                call(0, rms=TwinRms(np.ones(2, np.float32), 1e-5))
    with pytest.raises(ValueError, match="meta tensors hold no data"):
        tli.linear(torch.ones(2, 16, device="meta"), torch.ones(2, 8, 16, device="meta"), 0)
    x64, w64 = x.astype(np.float64), w.astype(np.float64)  # JAX would narrow it to float32, Triton keep it
    for call in (lambda: pli.linear(x64, w64, 0), lambda: tli.linear(to_torch(x64), to_torch(w64), 0),
                 lambda: pn.norm(x64, w64[:, 0], None, 0, kind="rms", eps=1e-5),
                 lambda: tn.norm(to_torch(x64), to_torch(w64[:, 0]), None, 0, kind="rms", eps=1e-5)):
        with pytest.raises(TypeError, match=r"(linear\(x\)|norm\(x\)): expected one of float32, bfloat16, float16, "
                                            r"got float64"):
            call()
    B, T, H, D, C = 2, 1, 2, 8, 4
    qkv, ring = np.ones((B, T, 3, H, D), np.float32), np.zeros((1, B, H, C, D), np.float32)
    mask = np.ones((B, T), bool)
    for slots, message in ((np.array([[4], [0]]), r"write_index\): expected values in \[0, 4\), got 4"),
                           (np.array([[0], [-1]]), r"write_index\): expected values in \[0, 4\), got -1")):
        with pytest.raises(ValueError, match=message):
            pr.rope_write(jnp.asarray(qkv), None, None, jnp.asarray(ring), jnp.asarray(ring), 0, jnp.asarray(slots),
                          jnp.asarray(mask))
        with pytest.raises(ValueError, match=message):  # before: written outside the ring
            tr.rope_write(to_torch(qkv), None, None, to_torch(ring), to_torch(ring.copy()), 0, torch.tensor(slots),
                          torch.tensor(mask))
    with pytest.raises(ValueError, match=r"rope_write\(qkv\): the head dim D must be a power of two"):
        tr.rope_write(to_torch(qkv[..., :6]), None, None, to_torch(ring[..., :6]), to_torch(ring[..., :6].copy()), 0,
                      torch.zeros(B, T, dtype=torch.long), torch.tensor(mask))
    freqs = np.ones(4, np.float32)
    for offset, T_, table in ((np.zeros((2, 2), np.int32), 1, freqs), (np.zeros(2, np.int32), 1, freqs[None]),
                              (np.zeros(2, np.int32), -1, freqs)):
        for tables, arr in ((pr.tables, jnp.asarray), (tr.tables, to_torch)):
            with pytest.raises(ValueError, match=r"tables\((offset|T|freqs)\)"):
                tables(arr(offset), T_, arr(table))
    strided = torch.tensor([3, 99, 5, 99], dtype=torch.int32)[::2]  # read as its values, not its storage
    for got, want in zip(tr.tables(strided, 2, to_torch(freqs)), tr.tables(strided.contiguous(), 2, to_torch(freqs)),
                         strict=True):
        assert torch.equal(got, want)
    from kernels_pallas import twin_conv as pc
    from kernels_triton import twin_conv as tc

    signal = np.ones((1, 2, 6), np.float32)
    for kw, message in (({"kernel_size": 0}, r"taps\(kernel_size\): expected a positive int, got 0"),
                        ({"kernel_size": 4, "dilation": 2}, r"a window of 7 samples .* longer than the 6 given"),
                        ({"kernel_size": 2.0}, r"taps\(kernel_size\): expected a positive int, got 2.0")):
        for taps, arr in ((pc.taps, jnp.asarray), (tc.taps, to_torch)):
            with pytest.raises(ValueError, match=message):
                taps(arr(signal), **kw)
    with pytest.raises(ValueError, match=r"entry\(capacity\): expected a positive int, got 0"):
        pe.entry(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), None, jnp.zeros((2, 1, 8)), jnp.ones(4),
                 capacity=0, convention="moshi", num_heads=2)
    norm_w = to_torch(np.ones((16, 2), np.float32)).t()
    with pytest.raises(ValueError, match=r"norm\(weight\): must be contiguous"):
        tn.norm(to_torch(x), norm_w, None, 0, kind="rms", eps=1e-5)


@pytest.mark.parametrize("kind,act,dtype,M", [("rms", None, "bfloat16", 3), ("rms", "silu_gate", "float32", 5),
                                              ("layer", "gelu", "bfloat16", 4), ("layer", None, "float32", 7)])
def test_linear_with_fused_norm_has_the_bits_of_norm_then_linear(kind, act, dtype, M, monkeypatch):
    """norm=TwinNorm(...): the bits of twin_norm.norm followed by linear, on both sides, whatever
    the tiles and the prefetch depth, and batch-invariant; in one kernel up to the fused-norm row
    limit (lowered here to the GPU's 4 rows a program: M <= 4 fused), else the norm kernel first."""
    monkeypatch.setattr(cl, "TWIN_INTERPRET_FUSED_NORM_MAX_BM", cl.TWIN_FUSED_NORM_MAX_BM)
    N, K, L, eps = 64, 192, 2, 1e-5  # K: three blocks of 64 lanes
    rng = np.random.default_rng(K + len(kind))
    x = (rng.standard_normal((M, K)) * 3).astype(NP[dtype])
    w = (rng.standard_normal((L, N, K)) * 0.1).astype(NP[dtype])
    nw = rng.standard_normal((L, K)).astype(NP[dtype])
    nb = rng.standard_normal((L, K)).astype(NP[dtype]) if kind == "layer" else None
    T = (lambda a: None if a is None else to_torch(a))
    i = jnp.int32(L - 1)
    two_kernels = jax.jit(lambda x, w, nw, nb, i: pli.linear(pn.norm(x, nw, nb, i, kind=kind, eps=eps), w, i,
                                                             act=act))(x, w, nw, nb, i)
    fused = jax.jit(lambda x, w, nw, nb, i: pli.linear(x, w, i, act=act, norm=TwinNorm(kind, nw, nb, eps)))
    y_p = fused(x, w, nw, nb, i)
    launches = str(jax.make_jaxpr(fused)(x, w, nw, nb, i)).count("pallas_call[")
    assert launches == (1 if M <= cl.TWIN_FUSED_NORM_MAX_BM else 2), launches
    y_n = jax.jit(lambda x, w, nw, nb: pli.linear_native(x, w, L - 1, act=act, norm=TwinNorm(kind, nw, nb, eps)))(
        x, w, nw, nb)
    monkeypatch.setattr(cl, "TWIN_PALLAS_PREFETCH", 2)  # the Pallas lane form's depth, a constant of its backend
    y_p2 = jax.jit(lambda x, w, nw, nb: pli.linear(x, w, L - 1, act=act, norm=TwinNorm(kind, nw, nb, eps),
                                                   block_n=16))(x, w, nw, nb)
    tnorm = TwinNorm(kind, T(nw), T(nb), eps)
    y_t = tli.linear(T(x), T(w), L - 1, act=act, norm=tnorm)
    y_t2 = tli.linear(tn.norm(T(x), T(nw), T(nb), L - 1, kind=kind, eps=eps), T(w), L - 1, act=act)
    assert_same(two_kernels, y_p, y_n, y_p2, y_t, y_t2, what=f"fused {kind} norm")
    alone = tli.linear(T(x[M - 1:]), T(w), L - 1, act=act, norm=tnorm)
    assert_same(alone[0], y_t[M - 1], what="the last row alone")
    # a plain [N, K] weight with [K] norm weights (layer=None), as the torch layers call it
    flat = tli.linear(T(x), T(w[L - 1]), act=act, norm=TwinNorm(kind, T(nw[L - 1]), T(None if nb is None else nb[L - 1]),
                                                                 eps))
    assert_same(flat, y_t, what="layer=None")


def test_linear_refuses_a_bad_fused_norm():
    x, w = jnp.ones((2, 8)), jnp.ones((2, 4, 8))
    with pytest.raises(ValueError, match=r"linear\(norm\.weight\): expected \[2, D=8\]"):
        pli.linear(x, w, 0, norm=TwinNorm("rms", jnp.ones((2, 6)), None, 1e-5))
    with pytest.raises(ValueError, match=r"linear\(norm\.weight\)"):
        tli.linear(torch.ones(2, 8), torch.ones(2, 4, 8), 0, norm=TwinNorm("rms", torch.ones(1, 8), None, 1e-5))
    with pytest.raises(ValueError, match=r"linear\(norm\.kind\)"):
        pli.linear(x, w, 0, norm=TwinNorm("batch", jnp.ones((2, 8)), None, 1e-5))
    with pytest.raises(ValueError, match=r"linear\(norm\.bias\): kind='layer' needs a bias"):
        pli.linear(x, w, 0, norm=TwinNorm("layer", jnp.ones((2, 8)), None, 1e-5))
    with pytest.raises(TypeError, match=r"linear\(norm\): expected a TwinNorm"):
        pli.linear(x, w, 0, norm=("rms", jnp.ones((2, 8)), None, 1e-5))


MMA = [  # (M, N, K, L, act, scale, res, norm kind): the MMA form, interpreted
    (1, 32, 64, 2, "silu_gate", False, True, "rms"),
    (17, 32, 128, 1, "gelu", True, True, "layer"),  # two row blocks of TWIN_MMA_ROWS, two K blocks
]


def _mma_case(M, N, K, L, act, scale, res, kind):
    rng = np.random.default_rng(M + N + K)
    n_out = N // 2 if act == "silu_gate" else N
    b16 = NP["bfloat16"]
    x = rng.standard_normal((M, K)).astype(b16)
    w = (rng.standard_normal((L, N, K)) * 0.1).astype(b16)
    s = rng.standard_normal((L, n_out)).astype(b16) if scale else None
    r = rng.standard_normal((M, n_out)).astype(b16) if res else None
    norm = None if kind is None else TwinNorm(kind, (1 + 0.1 * rng.standard_normal((L, K))).astype(b16),
                                              rng.standard_normal((L, K)).astype(b16) if kind == "layer" else None, 1e-5)
    return x, w, s, r, norm


@pytest.mark.parametrize("M,N,K,L,act,scale,res,kind", MMA)
def test_linear_mma_form_interpreted_agrees_with_the_lane_form(M, N, K, L, act, scale, res, kind):
    """form="mma" (what runs compiled on the GPU for 16-bit operands, `cl.twin_linear_form`),
    interpreted: its sums run in another order than the lane form's (interpreted: XLA's and
    numpy's matrix products; compiled: the tensor cores', which the GPU test holds the twins to
    bit for bit), so both twins are held to the lane form's reference within bf16 rounding (two
    roundings for the gate); the epilogues, the norm (its kernel first) and the row blocks past M
    are the same code as compiled; a row alone has the bits it has among the others."""
    x, w, s, r, norm = _mma_case(M, N, K, L, act, scale, res, kind)
    T = (lambda a: None if a is None else to_torch(a))
    ref = np.asarray(jax.jit(lambda x, w, s, r: pli.linear_native(x, w, L - 1, act=act, scale=s, residual=r,
                                                                   norm=norm))(x, w, s, r), np.float32)
    mma = jax.jit(lambda x, w, s, r: pli.linear(x, w, L - 1, act=act, scale=s, residual=r, norm=norm, form="mma"))
    y_p = mma(x, w, s, r)
    tnorm = None if norm is None else TwinNorm(kind, T(norm.weight), T(norm.bias), norm.eps)
    y_t = tli.linear(T(x), T(w), L - 1, act=act, scale=T(s), residual=T(r), norm=tnorm, form="mma")
    bound = (2 ** -6 if act == "silu_gate" else 2 ** -7) * np.abs(ref) + 1e-3 * np.abs(ref).max()
    for name, y in (("pallas", np.asarray(y_p, np.float32)), ("triton", y_t.float().numpy())):
        assert y.shape == ref.shape
        assert (np.abs(y - ref) <= bound).all(), (name, np.abs(y - ref).max())
    row = M - 1  # in the last row block: alone, it has the bits it has among the others
    alone = mma(x[row:], w, s, None if r is None else r[row:])
    assert_same(alone[0], y_p[row], what=f"pallas mma row {row} alone")
    alone = tli.linear(T(x[row:]), T(w), L - 1, act=act, scale=T(s), residual=None if r is None else T(r[row:]),
                       norm=tnorm, form="mma")
    assert_same(alone[0], y_t[row], what=f"triton mma row {row} alone")


def test_mma_rows_a_program_never_change_the_bits():
    """The MMA linears' rows a program (`block_m` 16, 32 or 64, `cl.twin_mma_rows`: speed only),
    interpreted: the same bits at each, on both twins, for a projection with a residual and the split
    norm's consumer half at 40 rows (the last block partial), and for the fused qkv kernel at 18 rows;
    the policy takes the most rows M fills while the grid keeps TWIN_MMA_MIN_PROGRAMS programs, the
    gate half the columns at 16 rows, and the pipeline depth that keeps the grid in one wave
    (`cl.twin_mma_stages`); a bad block_m is refused, naming the argument. (Compiled, the GPU
    test holds the tensor cores to the same.)"""
    M, N, K, L = 40, 64, 128, 2
    x, w, _, r, _ = _mma_case(M, N, K, L, None, False, True, None)
    rms = TwinRms(np.abs(np.random.default_rng(1).standard_normal((M, K // cn.TWIN_SPLIT_GROUP))).astype(np.float32),
                  1e-5)
    trms = TwinRms(to_torch(rms.ss), rms.eps)
    mma = jax.jit(lambda x, w, r, ss, R: pli.linear(x, w, L - 1, residual=r, rms=TwinRms(ss, 1e-5), form="mma",
                                                    block_m=R), static_argnums=4)
    ys = [mma(x, w, r, rms.ss, R) for R in (16, 32, 64)]
    ys += [tli.linear(to_torch(x), to_torch(w), L - 1, residual=to_torch(r), rms=trms, form="mma", block_m=R)
           for R in (16, 64)]
    assert_same(*ys, what="rows a program 16 / 32 / 64, both twins")
    B, T, H, D, C = 9, 2, 2, 16, 8
    x, w, cos, sin, ring_k, ring_v, wi, wm, norm = _qkv_case(B, T, H, D, C, L, K)
    fused = jax.jit(lambda *a, R: pli.linear_rope_write(*a[:2], L - 1, *a[2:], norm=norm, form="mma", block_m=R),
                    static_argnames="R")
    for name, a, b in zip(("q", "ring_k", "ring_v"), *(fused(x, w, cos, sin, ring_k, ring_v, wi, wm, R=R)
                                                        for R in (16, 32))):
        assert_same(a, b, what=f"fused {name}, 16 and 32 rows a program")
    # the policy: the most rows M fills, as long as the grid keeps TWIN_MMA_MIN_PROGRAMS (64) programs
    rows = cl.twin_mma_rows
    assert [rows(M, 192, 4096) for M in (1, 16, 17, 32, 33, 64, 640)] == [16, 16, 32, 32, 64, 64, 64]
    assert [rows(M, 24, 4096) for M in (16, 64, 128, 640)] == [16, 16, 32, 64]  # few column blocks: more row blocks
    assert rows(64, 8, 4096) == 16
    # a short K (at most 4 blocks: Mimi's 512) keeps 256 programs
    assert [rows(M, 32, 512) for M in (32, 128, 256, 1024)] == [16, 16, 32, 64]
    # the columns: BN 64, halved for the gate (two weight tiles) at more than 16 rows; a given block_n kept
    def plan(*args, **kwargs):  # (BN, BK, R)
        blocks = cl.MmaBlocks.for_shapes(*args, **kwargs)
        return blocks.block_n, blocks.block_k, blocks.rows

    assert [plan(M, 11264, 4096, 2)[::2] for M in (1, 16, 17, 64)] == [(64, 16), (64, 16), (32, 32), (32, 64)]
    assert [plan(M, 12288, 4096)[::2] for M in (1, 64)] == [(64, 16), (64, 64)]
    assert plan(1, 11264, 4096, 2, block_n=64)[0] == 64 and plan(1, 48, 512, 2)[0] == 16
    assert plan(1, 4096, 4096, split=True)[0] == cn.TWIN_SPLIT_GROUP
    # the depth: the default (4; 8 under one column block an SM, capped by the shared memory) unless the
    # grid then overflows what the SMs hold at once: then the deepest (>= 3) that fits it in one wave,
    # else the deepest (>= 3) at which each SM holds 2 programs, else the default
    stages = cl.twin_mma_stages
    assert [stages(11264, 32, 128, 2, rows=16, M=M) for M in (1, 16)] == [3, 3]    # gate: 352 programs, 3 an SM
    assert [stages(12288, 64, 128, rows=R, M=M) for R, M in ((16, 1), (64, 64))] == [4, 3]  # qkv: 192 programs
    assert stages(11264, 32, 128, 2, rows=64, M=64) == 3     # gate: 352 programs of 64 rows, 2 an SM
    assert stages(11264, 64, 128, 2, rows=64, M=64) == 4     # 176 of BN 64: one an SM even at 3 stages
    assert [stages(4096, 64, 128, rows=R, M=M) for R, M in ((16, 1), (64, 64))] == [8, 6]  # out: 64 programs
    assert stages(512, 64, 128, rows=64, M=64 * 132) == 3  # 1056 programs (8 capped to 6 by the memory)
    with pytest.raises(ValueError, match=r"linear\(block_m\): the MMA form runs 16, 32 or 64 rows"):
        pli.linear(jnp.ones((2, 32), jnp.bfloat16), jnp.ones((1, 32, 32), jnp.bfloat16), 0, form="mma", block_m=8)
    with pytest.raises(ValueError, match=r"linear_rope_write\(block_m\)"):
        tli.linear_rope_write(*(to_torch(a) for a in (x, w)), L - 1, *(to_torch(a) for a in (cos, sin, ring_k, ring_v,
                              wi, wm)), form="mma", block_m=48)


def test_linear_form_is_chosen_by_shape_dtype_and_backend_never_by_batch(monkeypatch, capsys):
    """Compiled, 16-bit operands with K and N_out multiples of 16 take the MMA form (the lowered
    module holds a tt.dot), float32 the lane form (none), at M=1 and M=16 alike; form="mma" where
    it cannot run is refused, naming the argument."""
    b16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)  # as the kernels pass them: x.dtype
    assert cl.twin_linear_form(4096, 4096, b16, compiled=True) == "mma"
    assert cl.twin_linear_form(4096, 4096, torch.float16, compiled=True) == "mma"
    assert cl.twin_linear_form(4096, 4096, b16, compiled=False) == "lanes"
    assert cl.twin_linear_form(4096, 4096, f32, compiled=True) == "lanes"
    assert cl.twin_linear_form(4096, 4104, b16, compiled=True) == "lanes"  # K: 8 lanes
    with pytest.raises(TypeError, match=r"dtype: expected a dtype .* scalar type"):
        cl.twin_linear_form(4096, 4096, jnp.bfloat16, compiled=True)  # a class's str names no dtype
    S = jax.ShapeDtypeStruct
    for M in (1, 16):
        for dtype, dot in ((jnp.bfloat16, True), (jnp.float32, False)):
            text = _triton_module_text(lambda x, w: pli.linear(x, w, 1, interpret=False), S((M, 256), dtype),
                                       S((2, 128, 256), dtype), monkeypatch=monkeypatch, capsys=capsys)
            assert ("tt.dot" in text) == dot, (M, dtype)
    with pytest.raises(ValueError, match=r"linear\(form='mma'\): needs bfloat16/float16"):
        pli.linear(jnp.ones((2, 32)), jnp.ones((1, 32, 32)), 0, form="mma")
    with pytest.raises(ValueError, match=r"linear\(form\): must be one of"):
        tli.linear(torch.ones(2, 32), torch.ones(1, 32, 32), 0, form="tensor")
    with pytest.raises(ValueError, match=r"linear_native\(form\)"):
        pli.linear_native(jnp.ones((2, 32)), jnp.ones((1, 32, 32)), 0, form="mma")


def _qkv_case(B, T, H, D, C, L, K, seed=0):
    """x [B*T, K], w [L, 3HD, K], cos/sin, rings, write slots and a mask with unwritten rows (bf16)."""
    rng = np.random.default_rng(seed)
    b16 = NP["bfloat16"]
    x = rng.standard_normal((B * T, K)).astype(b16)
    w = (rng.standard_normal((L, 3 * H * D, K)) * 0.1).astype(b16)
    ring_k, ring_v = (rng.standard_normal((L, B, H, C, D)).astype(b16) for _ in range(2))
    offset = rng.integers(0, 5000, B).astype(np.int32)
    angle = (offset[:, None, None] + np.arange(T)[None, :, None]) * rope_freqs(D, 10000.0)[None, None, :]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    write_index = ((offset[:, None] + np.arange(T)) % C).astype(np.int32)
    write_mask = rng.random((B, T)) < 0.7
    norm = TwinNorm("rms", (1 + 0.1 * rng.standard_normal((L, K))).astype(b16), None, 1e-5)
    return x, w, cos, sin, ring_k, ring_v, write_index, write_mask, norm


def test_qkv_rope_write_lane_form_and_references_same_bits():
    """linear_rope_write's lane form (the CPU's: linear then rope_write) on both sides, and the plain
    references beside it, with a fused norm and unwritten rows."""
    B, T, H, D, C, L, K = 3, 2, 2, 16, 8, 2, 64
    x, w, cos, sin, ring_k, ring_v, wi, wm, norm = _qkv_case(B, T, H, D, C, L, K)
    p = jax.jit(lambda *a: pli.linear_rope_write(*a[:2], L - 1, *a[2:], norm=norm))(x, w, cos, sin, ring_k, ring_v,
                                                                                    wi, wm)
    n = jax.jit(lambda *a: pli.linear_rope_write_native(*a[:2], L - 1, *a[2:], norm=norm))(x, w, cos, sin, ring_k,
                                                                                           ring_v, wi, wm)
    T_ = to_torch
    tnorm = TwinNorm("rms", T_(norm.weight), None, norm.eps)
    outs = []
    for fn in (tli.linear_rope_write, tli.linear_rope_write_native):
        tk, tv = T_(ring_k).clone(), T_(ring_v).clone()
        outs.append(fn(T_(x), T_(w), L - 1, T_(cos), T_(sin), tk, tv, T_(wi), T_(wm), norm=tnorm))
    for i, name in enumerate(("q", "ring_k", "ring_v")):
        assert_same(p[i], n[i], outs[0][i], outs[1][i], what=name)
    assert not np.array_equal(np.asarray(p[1]), ring_k), "the ring was written"


def test_qkv_rope_write_mma_form_has_the_bits_of_linear_then_rope_write():
    """linear_rope_write, the MMA form's one kernel (qkv projection, RoPE rotation and ring write in
    its epilogue), interpreted: the bits of linear(form="mma") then rope_write on each side, and the
    two sides agree; rows past the 16 of a block, T=2, unwritten rows (mask), recycled slots."""
    B, T, H, D, C, L, K = 9, 2, 2, 16, 8, 2, 64  # 18 rows: two row blocks
    x, w, cos, sin, ring_k, ring_v, wi, wm, norm = _qkv_case(B, T, H, D, C, L, K)
    fused = jax.jit(lambda *a: pli.linear_rope_write(*a[:2], L - 1, *a[2:], norm=norm, form="mma"))
    q, k, v = fused(x, w, cos, sin, ring_k, ring_v, wi, wm)
    qkv = jax.jit(lambda x, w: pli.linear(x, w, L - 1, norm=norm, form="mma"))(x, w).reshape(B, T, 3, H, D)
    q2, k2, v2 = jax.jit(lambda *a: pr.rope_write(*a[:5], L - 1, *a[5:]))(qkv, cos, sin, ring_k, ring_v, wi, wm)
    for name, a, b in (("q", q, q2), ("ring_k", k, k2), ("ring_v", v, v2)):
        assert_same(a, b, what=f"pallas fused {name}")
    assert not np.array_equal(np.asarray(k), ring_k), "the ring was written"
    T_ = to_torch
    tnorm = TwinNorm("rms", T_(norm.weight), None, norm.eps)
    tk, tv = T_(ring_k).clone(), T_(ring_v).clone()
    tq, _, _ = tli.linear_rope_write(T_(x), T_(w), L - 1, T_(cos), T_(sin), tk, tv, T_(wi), T_(wm), norm=tnorm,
                                     form="mma")
    tk2, tv2 = T_(ring_k).clone(), T_(ring_v).clone()
    tqkv = tli.linear(T_(x), T_(w), L - 1, norm=tnorm, form="mma").view(B, T, 3, H, D)
    tq2, _, _ = tr.rope_write(tqkv, T_(cos), T_(sin), tk2, tv2, L - 1, T_(wi), T_(wm))
    for name, a, b in (("q", tq, tq2), ("ring_k", tk, tk2), ("ring_v", tv, tv2)):
        assert_same(a, b, what=f"triton fused {name}")
    with pytest.raises(ValueError, match=r"linear_rope_write\(block_n\)"):
        pli.linear_rope_write(x, w, 0, cos, sin, ring_k, ring_v, wi, wm, form="mma", block_n=32)  # > D


@pytest.mark.parametrize("form", ["lanes", "mma"])
def test_qkv_write_without_rotation_into_another_ring_layer(form):
    """linear_rope_write and rope_write with cos = sin = None (no positional embedding, the
    depformer's cache write): q is the projection's q part, k and v its parts written at the slots
    where the mask is set, into the rings' layer `ring_layer` (here not the weights'), the rest of
    the rings untouched; Pallas, Triton and the plain references (the lane form's) give the same
    bits, with a fused norm; a lone cos is refused."""
    B, T, H, D, C, L, K = 9, 2, 2, 16, 8, 2, 64  # 18 rows: two row blocks of the MMA form
    x, w, _, _, ring_k, ring_v, wi, wm, norm = _qkv_case(B, T, H, D, C, L, K, seed=3)
    call = jax.jit(lambda *a: pli.linear_rope_write(*a[:2], L - 1, None, None, *a[2:], norm=norm, ring_layer=0,
                                                    form=form))
    q, k, v = call(x, w, ring_k, ring_v, wi, wm)
    qkv = np.array(jax.jit(lambda x, w: pli.linear(x, w, L - 1, norm=norm, form=form))(x, w)).reshape(B, T, 3, H, D)
    assert_same(q, qkv[:, :, 0].transpose(0, 2, 1, 3), what="q as projected")
    want_k, want_v = ring_k.copy(), ring_v.copy()
    for b, t in zip(*np.nonzero(wm)):
        want_k[0, b, :, wi[b, t]], want_v[0, b, :, wi[b, t]] = qkv[b, t, 1], qkv[b, t, 2]
    assert_same(k, want_k, what="ring_k")
    assert_same(v, want_v, what="ring_v")
    T_ = to_torch
    tnorm = TwinNorm("rms", T_(norm.weight), None, norm.eps)
    natives = [] if form == "mma" else [pli.linear_rope_write_native, tli.linear_rope_write_native]
    for fn in (tli.linear_rope_write, *natives):
        if fn.__module__.startswith("kernels_pallas"):  # jitted, as a step runs it (not an XLA program an op)
            out = jax.jit(lambda *a, fn=fn: fn(*a[:2], L - 1, None, None, *a[2:], norm=norm, ring_layer=0,
                                               form=form))(x, w, ring_k, ring_v, wi, wm)
        else:
            out = fn(T_(x), T_(w), L - 1, None, None, T_(ring_k).clone(), T_(ring_v).clone(), T_(wi), T_(wm),
                     norm=tnorm, ring_layer=0, form=form)
        for name, a, b in zip(("q", "ring_k", "ring_v"), out, (q, k, v)):
            assert_same(a, b, what=f"{fn.__module__}.{fn.__name__} {name}")
    # rope_write alone, no rotation: the same q and writes on every side
    for fn in (pr.rope_write, pr.rope_write_native):
        out = jax.jit(lambda qkv, rk, rv, wi, wm, fn=fn: fn(qkv, None, None, rk, rv, 0, wi, wm))(qkv, ring_k, ring_v,
                                                                                                wi, wm)
        for name, got, want in zip(("q", "ring_k", "ring_v"), out, (q, k, v)):
            assert_same(got, want, what=f"{fn.__module__}.{fn.__name__} {name}")
    for fn in (tr.rope_write, tr.rope_write_native):
        out = fn(T_(qkv), None, None, T_(ring_k).clone(), T_(ring_v).clone(), 0, T_(wi), T_(wm))
        for name, got, want in zip(("q", "ring_k", "ring_v"), out, (q, k, v)):
            assert_same(got, want, what=f"{fn.__module__}.{fn.__name__} {name}")
    with pytest.raises(ValueError, match="cos and sin go together"):
        pli.linear_rope_write(x, w, 0, jnp.zeros((B, T, D // 2), jnp.float32), None, ring_k, ring_v, wi, wm)


@pytest.mark.parametrize("K,kind,act,fuses", [(128, "layer", "gelu", True), (64, "rms", "silu_gate", True),
                                              (128, "rms", None, False)])
def test_mma_form_fuses_its_norm_over_few_blocks_with_the_bits_of_the_norm_kernel_first(K, kind, act, fuses,
                                                                                       monkeypatch):
    """The MMA form fuses the norm where K has at most TWIN_MMA_FUSED_NORM_MAX_BLOCKS blocks
    (Mimi's 512: one launch fewer a norm), else runs the norm kernel first (Helium's 4096; here
    the bound lowered to 0). Either way, interpreted, `linear(norm=)` and `linear_rope_write(norm=)`
    have the bits of the norm kernel then the unnormalized call, on each side; 17 rows (two row blocks)."""
    assert [cl.twin_mma_fuse_norm(k) for k in (64, 512, 640, 4096)] == [True, True, False, False]
    if not fuses:
        monkeypatch.setattr(cl, "TWIN_MMA_FUSED_NORM_MAX_BLOCKS", 0)
    assert cl.twin_mma_fuse_norm(K) == fuses
    M, N, L = 17, 32, 2
    x, w, s, r, norm = _mma_case(M, N, K, L, act, act == "gelu", True, kind)
    h = pn.norm(x, norm.weight, norm.bias, L - 1, kind=kind, eps=norm.eps)
    call = (lambda x, n: pli.linear(x, w, L - 1, act=act, scale=s, residual=r, norm=n, form="mma"))
    n_calls = str(jax.make_jaxpr(lambda x: call(x, norm))(x)).count("pallas_call")
    assert n_calls == (1 if fuses else 2)
    assert_same(jax.jit(lambda x: call(x, norm))(x), jax.jit(lambda h: call(h, None))(h), what="pallas fused norm")
    T_ = (lambda a: None if a is None else to_torch(np.array(a)))
    tnorm = TwinNorm(kind, T_(norm.weight), T_(norm.bias), norm.eps)
    norms = []  # the Triton side's norm kernel calls
    monkeypatch.setattr(tn, "norm", lambda *a, _f=tn.norm, **k: norms.append(1) or _f(*a, **k))
    y_t = tli.linear(T_(x), T_(w), L - 1, act=act, scale=T_(s), residual=T_(r), norm=tnorm, form="mma")
    assert len(norms) == (0 if fuses else 1)
    assert_same(y_t, tli.linear(T_(h), T_(w), L - 1, act=act, scale=T_(s), residual=T_(r), form="mma"),
                what="triton fused norm")
    if kind != "rms":
        return
    B, T, H, D, C = 9, 2, 2, 16, 8  # the qkv kernel: its norm fused or first as the linear's
    x, w, cos, sin, ring_k, ring_v, wi, wm, norm = _qkv_case(B, T, H, D, C, L, K)
    h = pn.norm(x, norm.weight, None, L - 1, kind="rms", eps=norm.eps)
    qkv = (lambda x, n: pli.linear_rope_write(x, w, L - 1, cos, sin, ring_k, ring_v, wi, wm, norm=n, form="mma"))
    for name, a, b in zip(("q", "ring_k", "ring_v"), jax.jit(lambda x: qkv(x, norm))(x),
                          jax.jit(lambda h: qkv(h, None))(h)):
        assert_same(a, b, what=f"pallas qkv fused norm {name}")
    tq = [tli.linear_rope_write(T_(xx), T_(w), L - 1, T_(cos), T_(sin), T_(ring_k).clone(), T_(ring_v).clone(),
                                T_(wi), T_(wm), norm=nn, form="mma")
          for xx, nn in ((x, TwinNorm("rms", T_(norm.weight), None, norm.eps)), (h, None))]
    for name, a, b in zip(("q", "ring_k", "ring_v"), *tq):
        assert_same(a, b, what=f"triton qkv fused norm {name}")


# ------------------------------------------------------------------------------ the split RMSNorm
def _split_case(M, N, K, L, seed=0):
    """bf16 a [M, K], w [L, N, K], residual [M, N], alpha [L, N] (not 1: a wrong row would show)."""
    rng = np.random.default_rng(seed)
    bf = ml_dtypes.bfloat16
    return (rng.standard_normal((M, K)).astype(bf), (0.1 * rng.standard_normal((L, N, K))).astype(bf),
            rng.standard_normal((M, N)).astype(bf), (1 + 0.25 * rng.standard_normal((L, N))).astype(bf))


@pytest.mark.parametrize("layer,offset", [(0, 0), (0, 1), (1, 1)])  # (1, 1): the last layer reads its own row
def test_split_norm_producer_has_the_bits_of_linear_then_split(layer, offset):
    """linear(split=TwinSplit(alpha, offset)) returns the plain linear's y, and the u and ss of
    `split` on y at alpha's row min(layer + offset, L - 1), on both sides, as `split_native`."""
    M, N, K, L = 5, 128, 64, 2
    a, w, r, alpha = _split_case(M, N, K, L)
    row = min(layer + offset, L - 1)
    T_ = to_torch
    y, u, ss = jax.jit(lambda a, w, r, al: pli.linear(a, w, layer, residual=r, split=TwinSplit(al, offset),
                                                      form="mma"))(a, w, r, alpha)
    ty, tu, tss = tli.linear(T_(a), T_(w), layer, residual=T_(r), split=TwinSplit(T_(alpha), offset), form="mma")
    assert_same(y, jax.jit(lambda a, w, r: pli.linear(a, w, layer, residual=r, form="mma"))(a, w, r), what="pallas y")
    assert_same(ty, tli.linear(T_(a), T_(w), layer, residual=T_(r), form="mma"), what="triton y")
    u_ref, ss_ref = jax.jit(lambda y, al: pn.split_native(y, al, row))(y, alpha)
    splits = (jax.jit(lambda y, al: pn.split(y, al, row))(y, alpha), tn.split(ty, T_(alpha), row),
              tn.split_native(ty, T_(alpha), row))
    for i, name in enumerate(("u", "ss")):
        got = (u if i == 0 else ss, tu if i == 0 else tss, *(split[i] for split in splits))
        assert_same(u_ref if name == "u" else ss_ref, *got, what=f"split {name}")
    assert ss.dtype == jnp.float32 and ss.shape == (M, N // cn.TWIN_SPLIT_GROUP)


@pytest.mark.parametrize("act", [None, "silu_gate"])
def test_split_norm_consumer_scales_its_sums_by_r(act):
    """With rms=TwinRms(ss, eps), x = u: the float32 sums scaled by r = 1 / sqrt(eps + S / K) before
    the epilogue. With power-of-two r (exact scalings) the rows are r times the plain linear's
    (act=None) or the plain one's where r = 1; with the split of real rows, the result is the
    float64 RMSNorm-then-linear's within bf16 rounding; both sides give the same bits."""
    M, N, K, L = 5, 128, 128, 2
    a, w, _, alpha = _split_case(M, N, K, L, seed=1)
    G = K // cn.TWIN_SPLIT_GROUP
    r = np.array([1, 2, 4, 1, 2], np.float32)
    ss = np.repeat((K / G / r ** 2)[:, None], G, axis=1).astype(np.float32)  # var = 1 / r^2 with eps = 0
    J, T_ = jnp.asarray, to_torch
    out = pli.linear(J(a), J(w), 1, act=act, rms=TwinRms(J(ss), 0.0), form="mma")
    tout = tli.linear(T_(a), T_(w), 1, act=act, rms=TwinRms(T_(ss), 0.0), form="mma")
    plain = np.asarray(pli.linear(J(a), J(w), 1, act=act, form="mma")).astype(np.float32)
    want = plain * r[:, None] if act is None else plain[r == 1]
    got = np.asarray(out).astype(np.float32)
    np.testing.assert_array_equal(got if act is None else got[r == 1], want)
    assert act is None or not np.array_equal(got[r != 1], plain[r != 1])
    assert_same(out, tout, what="consumer, pallas vs triton")
    # the split of real rows: close to RMSNorm(x) @ w.T in float64
    eps = 1e-5
    x = a[:, :K].astype(np.float64)
    aw = alpha[0, :K].astype(np.float32).astype(ml_dtypes.bfloat16)
    u, ss2 = pn.split(J(a[:, :K]), J(aw))
    y = np.asarray(pli.linear(u, J(w), 1, rms=TwinRms(ss2, eps), form="mma")).astype(np.float64)
    normed = x / np.sqrt(eps + (x * x).mean(1, keepdims=True)) * aw.astype(np.float64)
    ref = normed @ w[1].astype(np.float64).T
    assert np.abs(y - ref).max() / np.abs(ref).max() < 2e-2
    assert_same(y, tli.linear(to_torch(np.asarray(u)), T_(w), 1, rms=TwinRms(to_torch(np.asarray(ss2)), eps),
                              form="mma").double(), what="consumer of a real split")


def test_split_norm_qkv_consumer_with_r_one_is_the_plain_projection():
    """linear_rope_write(rms=) with r = 1 exactly gives the plain kernel's q and ring writes."""
    B, T, H, D, C, L, K = 2, 1, 2, 16, 6, 2, 128
    x, w, cos, sin, ring_k, ring_v, wi, wm, _ = _qkv_case(B, T, H, D, C, L, K)
    G = K // cn.TWIN_SPLIT_GROUP
    ss = np.full((B * T, G), K / G, np.float32)
    J = jnp.asarray
    args = (J(cos), J(sin), J(ring_k), J(ring_v), J(wi), J(wm))
    plain = pli.linear_rope_write(J(x), J(w), 1, *args, form="mma")
    split = pli.linear_rope_write(J(x), J(w), 1, *args, rms=TwinRms(J(ss), 0.0), form="mma")
    targs = [to_torch(np.asarray(t)) for t in (cos, sin, ring_k, ring_v, wi, wm)]
    tsplit = tli.linear_rope_write(to_torch(x), to_torch(w), 1, *targs, rms=TwinRms(to_torch(ss), 0.0), form="mma")
    for name, a, b, t in zip(("q", "ring_k", "ring_v"), plain, split, tsplit):
        assert_same(a, b, what=f"qkv rms {name}")
        assert_same(a, t, what=f"qkv rms {name}, triton") if name != "q" else None


def test_split_norm_refusals_name_the_argument():
    M, N, K, L = 3, 128, 128, 2
    a, w, _, alpha = _split_case(M, N, K, L)
    J = jnp.asarray
    ss = J(np.zeros((M, K // cn.TWIN_SPLIT_GROUP), np.float32))
    with pytest.raises(ValueError, match=r"linear\(split, rms\): the split RMSNorm runs in the MMA form only"):
        pli.linear(J(a), J(w), 0, rms=TwinRms(ss, 1e-5), form="lanes")
    with pytest.raises(ValueError, match=r"linear\(rms.ss\)"):
        tli.linear(to_torch(a), to_torch(w), 0, rms=TwinRms(torch.zeros(M, 3), 1e-5), form="mma")
    with pytest.raises(ValueError, match=r"linear\(rms\): x is already"):
        pli.linear(J(a), J(w), 0, rms=TwinRms(ss, 1e-5), norm=TwinNorm("rms", J(alpha), None, 1e-5), form="mma")
    with pytest.raises(ValueError, match=r"linear\(split.offset\)"):
        pli.linear(J(a), J(w), 0, split=TwinSplit(J(alpha), -1), form="mma")
    with pytest.raises(ValueError, match=r"linear\(split.weight\)"):
        tli.linear(to_torch(a), to_torch(w), 0, split=TwinSplit(torch.ones(L, 64)), form="mma")
    with pytest.raises(ValueError, match=r"linear\(block_n\): with split"):
        pli.linear(J(a), J(w), 0, split=TwinSplit(J(alpha)), block_n=32, form="mma")
    with pytest.raises(TypeError, match=r"linear\(split\): expected a TwinSplit"):
        pli.linear(J(a), J(w), 0, split=(J(alpha), 0), form="mma")


def test_split_norm_is_chosen_for_helium_on_the_gpu_only():
    """Both stacks split where the projections run in the MMA form without fusing their norm."""
    assert cl.twin_split_norm(4096, "bfloat16", compiled=True)
    assert not cl.twin_split_norm(4096, "bfloat16", compiled=False)  # the lane form, interpreted
    assert not cl.twin_split_norm(4096, "float32", compiled=True)
    assert not cl.twin_split_norm(512, "bfloat16", compiled=True)   # Mimi's: fused into the MMA form
    assert not cl.twin_split_norm(64 * 3 * 16, "bfloat16", compiled=True)  # a group count not a power of two


mma_on_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or jax.default_backend() != "gpu",
    reason="GPU only: the MMA form's bits are the tensor cores' (CPU: the interpreted tests above)")


@mma_on_gpu
@pytest.mark.parametrize("M,N,K,L,act,scale,res,kind", MMA + [(16, 256, 512, 2, "silu_gate", False, True, "rms"),
                                                              (64, 512, 1024, 2, None, False, True, None),
                                                              (64, 8192, 256, 2, "silu_gate", False, False, None)])
def test_linear_mma_form_gpu_twins_same_bits_and_batch_invariant(M, N, K, L, act, scale, res, kind):
    """Compiled on the GPU: the Pallas and Triton MMA forms give the same bits, at other tiles and
    16, 32 or 64 rows a program (the MMA's n) too, and a row alone has the bits it has among the others
    (the last case: the gate at 64 rows and 32 columns a program, and alone at 16 rows and 64 columns:
    `MmaBlocks`)."""
    x, w, s, r, norm = _mma_case(M, N, K, L, act, scale, res, kind)
    C = (lambda a: None if a is None else to_torch(a).cuda())
    tnorm = None if norm is None else TwinNorm(kind, C(norm.weight), C(norm.bias), norm.eps)
    y_p = pli.linear(jnp.asarray(x), jnp.asarray(w), L - 1, act=act, scale=s, residual=r, norm=norm)
    y_t = tli.linear(C(x), C(w), L - 1, act=act, scale=C(s), residual=C(r), norm=tnorm)
    y_t2 = tli.linear(C(x), C(w), L - 1, act=act, scale=C(s), residual=C(r), norm=tnorm, block_n=16, num_stages=2)
    y_p64 = pli.linear(jnp.asarray(x), jnp.asarray(w), L - 1, act=act, scale=s, residual=r, norm=norm, block_m=64)
    y_t32 = tli.linear(C(x), C(w), L - 1, act=act, scale=C(s), residual=C(r), norm=tnorm, block_m=32)
    assert_same(np.asarray(y_p), y_t.cpu(), y_t2.cpu(), np.asarray(y_p64), y_t32.cpu(), what="mma form, GPU")
    for row in (0, M - 1):
        alone = tli.linear(C(x[row:row + 1]), C(w), L - 1, act=act, scale=C(s),
                           residual=None if r is None else C(r[row:row + 1]), norm=tnorm)
        assert_same(alone[0].cpu(), y_t[row].cpu(), what=f"row {row} alone, GPU")


@mma_on_gpu
@pytest.mark.parametrize("B,T,H,D,R", [(3, 1, 4, 128, None), (5, 2, 8, 64, None), (20, 2, 4, 128, 64)])
def test_qkv_rope_write_gpu_twins_same_bits(B, T, H, D, R):
    """Compiled on the GPU: the fused qkv + RoPE + ring write kernel has the bits of linear then
    rope_write, and the Pallas and Triton kernels agree (the Pallas one at R rows a program, if given)."""
    C, L, K = 12, 2, 256
    x, w, cos, sin, ring_k, ring_v, wi, wm, norm = _qkv_case(B, T, H, D, C, L, K, seed=B)
    q, k, v = pli.linear_rope_write(*(jnp.asarray(a) for a in (x, w)), L - 1, *(jnp.asarray(a) for a in
                                    (cos, sin, ring_k, ring_v, wi, wm)), norm=norm, block_m=R)
    qkv = pli.linear(jnp.asarray(x), jnp.asarray(w), L - 1, norm=norm).reshape(B, T, 3, H, D)
    q2, k2, v2 = pr.rope_write(qkv, *(jnp.asarray(a) for a in (cos, sin, ring_k, ring_v)), L - 1, jnp.asarray(wi),
                               jnp.asarray(wm))
    C_ = (lambda a: to_torch(a).cuda())
    tk, tv = C_(ring_k), C_(ring_v)
    tq, _, _ = tli.linear_rope_write(C_(x), C_(w), L - 1, C_(cos), C_(sin), tk, tv, C_(wi), C_(wm),
                                     norm=TwinNorm("rms", C_(norm.weight), None, norm.eps))
    for name, a, b, t in (("q", q, q2, tq), ("ring_k", k, k2, tk), ("ring_v", v, v2, tv)):
        assert_same(np.asarray(a), np.asarray(b), t.cpu(), what=f"fused {name}, GPU")


@mma_on_gpu
def test_split_norm_gpu_twins_same_bits_and_batch_invariant():
    """Compiled on the GPU: producer and consumer of the split norm, the same bits on both sides and
    for a row alone."""
    M, N, K, L = 6, 256, 256, 2
    a, w, r, alpha = _split_case(M, N, K, L, seed=3)
    J, C = jnp.asarray, (lambda t: to_torch(t).cuda())
    y, u, ss = pli.linear(J(a[:, :K]), J(w), 0, residual=J(r), split=TwinSplit(J(alpha), 1))
    ty, tu, tss = tli.linear(C(a[:, :K]), C(w), 0, residual=C(r), split=TwinSplit(C(alpha), 1))
    for name, p, t in (("y", y, ty), ("u", u, tu), ("ss", ss, tss)):
        assert_same(np.asarray(p), t.cpu(), what=f"producer {name}, GPU")
    g = pli.linear(u, J(w), 1, act="silu_gate", rms=TwinRms(ss, 1e-5))
    tg = tli.linear(tu, C(w), 1, act="silu_gate", rms=TwinRms(tss, 1e-5))
    alone = tli.linear(tu[2:3].contiguous(), C(w), 1, act="silu_gate", rms=TwinRms(tss[2:3].contiguous(), 1e-5))
    assert_same(np.asarray(g), tg.cpu(), what="consumer, GPU")
    assert_same(alone[0].cpu(), tg[2].cpu(), what="consumer row alone, GPU")


@pytest.mark.parametrize("kind,M,D,dtype", [("rms", 3, 64, "float32"), ("rms", 3, 176, "bfloat16"),
                                             ("layer", 5, 48, "float32"), ("layer", 4, 32, "bfloat16")])
def test_norm_twins_same_bits(kind, M, D, dtype):
    rng = np.random.default_rng(D)
    x = (rng.standard_normal((M, D)) * 3).astype(NP[dtype])
    w, b = (rng.standard_normal((2, D)).astype(NP[dtype]) for _ in range(2))
    b = b if kind == "layer" else None
    eps = 1e-5
    y_p = jax.jit(lambda x, w, b: pn.norm(x, w, b, jnp.int32(1), kind=kind, eps=eps))(x, w, b)
    y_n = jax.jit(lambda x, w, b: pn.norm_native(x, w, b, jnp.int32(1), kind=kind, eps=eps))(x, w, b)
    y_t = tn.norm(to_torch(x), to_torch(w), None if b is None else to_torch(b), 1, kind=kind, eps=eps)
    y_tn = tn.norm_native(to_torch(x), to_torch(w), None if b is None else to_torch(b), 1, kind=kind, eps=eps)
    assert_same(y_p, y_n, y_t, y_tn, what=kind)
    # one row a program, the compiled default: the tiles change the speed, never the bits
    y_p1 = pn.norm(x, w, b, 1, kind=kind, eps=eps, block_m=1)
    y_t1 = tn.norm(to_torch(x), to_torch(w), None if b is None else to_torch(b), 1, kind=kind, eps=eps, block_m=1)
    assert_same(y_p, y_p1, y_t1, what=f"{kind} block_m=1")
    xf = x.astype(np.float64)
    if kind == "rms":
        want = xf / np.sqrt(eps + (xf**2).mean(-1, keepdims=True)) * w[1].astype(np.float64)
    else:
        c = xf - xf.mean(-1, keepdims=True)
        want = c / np.sqrt((c**2).mean(-1, keepdims=True) + eps) * w[1].astype(np.float64) + b[1].astype(np.float64)
    tol = 2e-6 if dtype == "float32" else 2e-2
    assert np.abs(np.asarray(y_p, np.float64) - want).max() <= tol * np.abs(want).max()


ENTRY_CASES = [(3, 1, 4, 16, 24, "float32", "personaplex"), (2, 10, 3, 8, 12, "bfloat16", "moshi"),
               (3, 2, 2, 8, 1100, "bfloat16", "personaplex")]
# Interpreted (a few seconds a case), the first and the third in one: float32 at T=1 on a ring of several
# tiles; each dtype, convention, T and tiling still runs.
CPU_ENTRY_CASES = [(3, 1, 4, 16, 1100, "float32", "personaplex"), ENTRY_CASES[1]]


def _check_entry(B, T, H, D, C, dtype, convention, device):
    """The step's entry kernel: its RoPE tables have the Triton tables' bits (and the reference's),
    its integer tables the torch path's and jax.numpy's values; counters 0, x copied. Rows: one
    fresh, one past a ring wrap with a recycled start, one inactive. C = 1100: several tiles.
    Returns (inputs, Pallas (cos, sin), Triton (cos, sin)); the Triton twin runs on `device`."""
    rng = np.random.default_rng(T)
    offset = np.array([0, 5 * C + 7, 3 * C + 1][:B], np.int32)
    start = np.array([0, 5 * C + 3, C][:B], np.int32)
    active = np.array([True, True, False][:B])
    x = rng.standard_normal((B, T, 6)).astype(NP[dtype])
    freqs = rope_freqs(D, 10000.0)
    kw = {"capacity": C, "convention": convention, "num_heads": H}
    e = jax.jit(lambda *a: pe.entry(*a, **kw))(offset, start, active, x, freqs)
    e_n = jax.jit(lambda *a: pe.entry_native(*a, **kw))(offset, start, active, x, freqs)
    for name, a, n in zip(pe.Entry._fields, e, e_n):
        assert_same(a, n, what=name)
    every_row = jax.jit(lambda *a: pe.entry(a[0], a[1], None, *a[2:], **kw))(offset, start, x, freqs)
    all_true = jax.jit(lambda *a: pe.entry(*a, **kw))(offset, start, np.ones(B, bool), x, freqs)
    for name, a, n in zip(pe.Entry._fields, every_row, all_true):
        assert_same(a, n, what=f"{name}, active None")  # None: every row, as all True
    t = (lambda a: torch.from_numpy(a).to(device))
    c_t, s_t = tr.tables(t(offset), T, t(freqs))
    c_tn, s_tn = tr.tables_native(t(offset), T, t(freqs))
    c_p, s_p = jax.jit(pr.tables, static_argnums=1)(offset, T, freqs)
    c_n, s_n = jax.jit(pr.tables_native, static_argnums=1)(offset, T, freqs)
    assert_same(e.cos, c_t.cpu(), c_tn.cpu(), c_p, c_n, what="cos")
    assert_same(e.sin, s_t.cpu(), s_tn.cpu(), s_p, s_n, what="sin")
    want = build_torch_tables(*map(t, (offset, start, active)), T, capacity=C, context=C,
                              head_dim=D, max_period=10000.0, convention=convention)
    for name in ("q_pos", "write_index", "positions", "end_offset", "write_mask"):  # torch's: int64, bool
        assert_same(getattr(e, name), getattr(want, name).to(torch.int32).cpu(), what=name)
    pos = np.asarray(e.positions)  # row 1: past a wrap, recycled below its start; row 2: a full wrapped ring
    assert pos[1].max() >= 5 * C and ((pos[1] == -1) | (pos[1] >= start[1])).all()
    if B == 3:
        assert (pos[1] == -1).any() and (pos[2] >= 0).all()
    assert not np.asarray(e.sems).any() and e.sems.shape == (ca.twin_sems_size(B, H, T),)
    assert_same(e.x, x, what="x")
    # the contract's float32 angle (one rounded product), then cos in float64: a few ulp of 1
    angle = (offset[:, None, None].astype(np.float32) + np.arange(T, dtype=np.float32)[None, :, None]) * freqs
    assert np.abs(np.asarray(e.cos) - np.cos(angle.astype(np.float64))).max() < 5e-7
    return (offset, rng), (e.cos, e.sin), (c_t, s_t)


@pytest.mark.parametrize("B,T,H,D,C,dtype,convention", CPU_ENTRY_CASES)
def test_entry_tables_and_rope_write_twins_same_bits(B, T, H, D, C, dtype, convention):
    (offset, rng), (c_p, s_p), (c_t, s_t) = _check_entry(B, T, H, D, C, dtype, convention, "cpu")
    qkv = rng.standard_normal((B, T, 3, H, D)).astype(NP[dtype])
    ring_k, ring_v = (rng.standard_normal((2, B, H, C, D)).astype(NP[dtype]) for _ in range(2))
    slots = ((offset[:, None] + np.arange(T)) % C).astype(np.int32)
    written = (np.arange(B)[:, None] != 1) & (np.arange(T)[None] % 2 == 0)  # row 1 and odd t: not written
    out_p = jax.jit(pr.rope_write)(qkv, c_p, s_p, ring_k, ring_v, jnp.int32(1), slots, written)
    out_n = jax.jit(pr.rope_write_native)(qkv, c_p, s_p, ring_k, ring_v, jnp.int32(1), slots, written)
    rk, rv = to_torch(ring_k).clone(), to_torch(ring_v).clone()
    out_t = tr.rope_write(to_torch(qkv), c_t, s_t, rk, rv, 1, torch.from_numpy(slots), torch.from_numpy(written))
    rk, rv = to_torch(ring_k).clone(), to_torch(ring_v).clone()
    out_tn = tr.rope_write_native(to_torch(qkv), c_t, s_t, rk, rv, 1, torch.from_numpy(slots),
                                  torch.from_numpy(written))
    for a, b_, c, d in zip(out_p, out_n, out_t, out_tn):
        assert_same(a, b_, c, d, what="rope_write")
    assert_same(np.asarray(out_p[1])[0], ring_k[0], what="layer 0 untouched")
    for b in range(B):
        for t in range(T):
            if not written[b, t]:
                assert_same(np.asarray(out_p[2])[1, b, :, slots[b, t]], ring_v[1, b, :, slots[b, t]], what="kept")


@pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu",
                    reason="GPU only: the compiled entry kernel (CPU: the interpreted test above)")
@pytest.mark.parametrize("B,T,H,D,C,dtype,convention", ENTRY_CASES)
def test_entry_gpu_tables_same_bits(B, T, H, D, C, dtype, convention):
    _check_entry(B, T, H, D, C, dtype, convention, "cuda")


def attention_case(B, H, T, D, C, dtype):
    """(q, ring_k, ring_v, positions, q_pos) as numpy: a masked slot 3 holding NaN (v) and Inf (k),
    which must reach no output; row 0 sees nothing; the other rows' slots in a shuffled order."""
    rng = np.random.default_rng(C + D)
    q = rng.standard_normal((B, H, T, D)).astype(NP[dtype])
    ring_k, ring_v = (rng.standard_normal((2, B, H, C, D)).astype(NP[dtype]) for _ in range(2))
    ring_v[:, :, :, 3] = np.nan
    ring_k[:, :, :, 3] = np.inf
    positions = rng.integers(0, C, (B, C)).astype(np.int32)
    positions[:, 3] = -1
    positions[0] = -1
    q_pos = (np.full((B, T), C, np.int32) + np.arange(T)).astype(np.int32)
    return q, ring_k, ring_v, positions, q_pos


def _attention_distance(out, q, ring_k, ring_v, positions, q_pos, layer=1):
    """Max abs distance of out [B, T, H, D] from float64 attention; asserts row 0 is exactly +0."""
    out = np.asarray(out, np.float32)
    assert np.isfinite(out).all() and not out[0].any() and not np.signbit(out[0]).any()
    C, D = ring_k.shape[-2:]
    visible = (positions[:, None, :] >= 0) & (q_pos[:, :, None] - positions[:, None, :] >= 0) & (
        q_pos[:, :, None] - positions[:, None, :] < C)
    s = np.einsum("bhtd,bhcd->bhtc", q.astype(np.float64), ring_k[layer].astype(np.float64)) / math.sqrt(D)
    s = np.where(visible[:, None], s, -np.inf)
    m = np.max(s, -1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    vv = np.nan_to_num(ring_v[layer].astype(np.float64))
    want = np.einsum("bhtc,bhcd->bhtd", p, vv) / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.abs(out.transpose(0, 2, 1, 3) - want).max()


@pytest.mark.parametrize("B,H,T,D,C,dtype", [(3, 4, 1, 16, 24, "float32"), (2, 4, 2, 8, 10, "bfloat16"),
                                              (2, 2, 1, 16, 300, "float32")])
def test_attention_twins_same_bits_and_zero_for_a_row_that_sees_nothing(B, H, T, D, C, dtype, monkeypatch):
    q, ring_k, ring_v, positions, q_pos = case = attention_case(B, H, T, D, C, dtype)
    args = (q, ring_k, ring_v, jnp.int32(1), positions, q_pos)
    o_p = jax.jit(lambda *a: pa.attention(*a, context=C))(*args)
    o_n = jax.jit(lambda *a: pa.attention_native(*a, context=C))(*args)
    o_t = ta.attention(to_torch(q), to_torch(ring_k), to_torch(ring_v), 1, torch.from_numpy(positions),
                       torch.from_numpy(q_pos), context=C)
    o_tn = ta.attention_native(to_torch(q), to_torch(ring_k), to_torch(ring_v), 1, torch.from_numpy(positions),
                               torch.from_numpy(q_pos), context=C)
    assert_same(o_p, o_n, o_t, o_tn, what="attention")
    o_t2 = ta.attention(to_torch(q), to_torch(ring_k), to_torch(ring_v), 1, torch.from_numpy(positions),
                        torch.from_numpy(q_pos), context=C, num_warps=4, num_stages=2)
    assert_same(o_t, o_t2, what="attention, other launch")
    if ca.AttentionBlocks.for_shapes(C).splits > 1:  # the order of the splits' programs: one split has none
        # the other launch order (speed only): the same bits, whichever split program combines
        monkeypatch.setattr(ca, "TWIN_ATTENTION_SPLITS_FIRST", not ca.TWIN_ATTENTION_SPLITS_FIRST)
        o_p3 = jax.jit(lambda *a: pa.attention(*a, context=C))(*args)
        o_t3 = ta.attention(to_torch(q), to_torch(ring_k), to_torch(ring_v), 1, torch.from_numpy(positions),
                            torch.from_numpy(q_pos), context=C)
        assert_same(o_p, o_p3, o_t3, what="attention, the other launch order")
        monkeypatch.undo()
    # one counter buffer for many calls (the step's): the same bits, the counters left all 0
    sems_p, sems_t = jnp.zeros((B * H * T + 3,), jnp.int32), torch.zeros(B * H * T + 3, dtype=torch.int32)
    with_sems = jax.jit(lambda *a: pa.attention(*a[:-1], context=C, sems=a[-1]))
    for _ in range(2):
        o_ps, sems_p = with_sems(*args, sems_p)
        o_ts, sems_t = ta.attention(to_torch(q), to_torch(ring_k), to_torch(ring_v), 1, torch.from_numpy(positions),
                                    torch.from_numpy(q_pos), context=C, sems=sems_t)
        assert_same(o_p, o_ps, o_ts, what="attention with the step's counters")
        assert not np.asarray(sems_p).any() and not sems_t.any()
    for bad in (jnp.zeros((B * H * T - 1,), jnp.int32), jnp.zeros((B * H * T,), jnp.float32)):
        with pytest.raises(ValueError, match=r"attention\(sems\): expected int32"):
            pa.attention(*args, context=C, sems=bad)
    assert _attention_distance(o_p, *case) <= (1e-6 if dtype == "float32" else 1e-2)


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning",
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype,form", [("float32", "lanes"), ("bfloat16", "mma")])
def test_attention_propagates_a_visible_nan_and_only_it(dtype, form):
    """A NaN in a visible slot (k of row 1, head 0) makes exactly the queries that see it NaN, in
    both twins (each form, interpreted), the twins' jax.numpy reference and the JAX paths' other
    attentions (`_other_attentions`); the masked slot's NaN and Inf reach no twin output, and a row
    that sees nothing is still +0."""
    B, H, T, D, C = 3, 2, 2, 16, 24
    q, ring_k, ring_v, positions, q_pos = attention_case(B, H, T, D, C, dtype)
    positions[1, 5] = C - 2  # visible to both queries of row 1 (q_pos C, C + 1)
    ring_k[1, 1, 0, 5] = np.nan
    want = np.zeros((B, T, H, D), bool)
    want[1, :, 0] = True
    args = (q, ring_k, ring_v, jnp.int32(1), positions, q_pos)
    outs = {"pallas": jax.jit(lambda *a: pa.attention(*a, context=C, form=form))(*args),
            "triton": ta.attention(to_torch(q), to_torch(ring_k), to_torch(ring_v), 1, torch.from_numpy(positions),
                                   torch.from_numpy(q_pos), context=C, form=form).float().numpy()}
    if form == "lanes":
        outs["native"] = jax.jit(lambda *a: pa.attention_native(*a, context=C))(*args)
        assert_same(outs["pallas"], outs["native"], outs["triton"], what="attention with a visible NaN")
        outs.update(_other_attentions(q, ring_k, ring_v, positions, q_pos, C))
    for name, o in outs.items():
        o = np.asarray(o, np.float32)
        np.testing.assert_array_equal(np.isnan(o), want, err_msg=name)
        assert not o[0].any() and np.isfinite(o[~want]).all(), name


def _other_attentions(q, ring_k, ring_v, positions, q_pos, C):
    """The JAX paths' other attentions of layer 1 (the ring kernel, its reference, the XLA one) as
    [B, T, H, D]. They multiply a masked slot's v by an exact 0, as torch's SDPA does, so the
    masked slot's NaN is zeroed here first (what `reset_slot` does to a recycled slot)."""
    from jax_impl.ops import masked_attention
    from kernels_pallas.ring_attention import ring_attention, ring_attention_native

    ring_v = np.where(positions[None, :, None, :, None] < 0, 0, ring_v).astype(ring_v.dtype)
    k, v = jnp.asarray(ring_k[1]), jnp.asarray(ring_v[1])
    mask = (positions[:, None, None] >= 0) & (q_pos[:, None, :, None] - positions[:, None, None] >= 0) & (
        q_pos[:, None, :, None] - positions[:, None, None] < C)
    args = (q, ring_k, ring_v, jnp.int32(1), positions, q_pos)
    return {"ring": jax.jit(lambda *a: ring_attention(*a, context=C, block_c=8))(*args).transpose(0, 2, 1, 3),
            "ring_native": jax.jit(lambda *a: ring_attention_native(*a, context=C))(*args).transpose(0, 2, 1, 3),
            "xla": jax.jit(masked_attention)(q, k, v, mask).transpose(0, 2, 1, 3)}


# the masked slot's Inf in k makes NaN scores there (masked after), which the interpreter's numpy warns about
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning",
                            "ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("B,H,T,D,C", [(2, 2, 2, 16, 24), (2, 2, 1, 32, 300)])
def test_attention_mma_form_interpreted_agrees_with_float64(B, H, T, D, C):
    """form="mma" (what runs compiled on the GPU for 16-bit operands, `ca.twin_attention_form`),
    interpreted: its sums are XLA's and numpy's matrix products here (the tensor cores' compiled,
    which the GPU test holds the twins to bit for bit), so both twins are held to float64 within
    bf16 rounding; the masking, the online softmax, the split combine and p's two 16-bit parts are
    the code that runs compiled."""
    q, ring_k, ring_v, positions, q_pos = case = attention_case(B, H, T, D, C, "bfloat16")
    o_p = jax.jit(lambda *a: pa.attention(*a, context=C, form="mma"))(q, ring_k, ring_v, jnp.int32(1), positions,
                                                                      q_pos)
    o_t = ta.attention(to_torch(q), to_torch(ring_k), to_torch(ring_v), 1, torch.from_numpy(positions),
                       torch.from_numpy(q_pos), context=C, form="mma")
    for name, o in (("pallas", o_p), ("triton", o_t.float().numpy())):
        assert _attention_distance(o, *case) <= 1e-2, name


def test_attention_form_is_chosen_by_shape_dtype_and_backend_never_by_batch(monkeypatch, capsys):
    """Compiled, 16-bit q and ring with D and the block multiples of 16 take the MMA form (the
    lowered module holds a tt.dot), float32 the lane form (none), at B=1 and B=16 alike; form="mma"
    where it cannot run is refused, naming the argument."""
    b16, f32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
    assert ca.twin_attention_form(128, 64, b16, compiled=True) == "mma"
    assert ca.twin_attention_form(64, 64, torch.bfloat16, compiled=True) == "mma"
    assert ca.twin_attention_form(128, 64, b16, compiled=False) == "lanes"
    assert ca.twin_attention_form(128, 64, f32, compiled=True) == "lanes"
    assert ca.twin_attention_form(8, 16, b16, compiled=True) == "lanes"  # D: 8
    S = jax.ShapeDtypeStruct
    C, D, H = 300, 64, 2
    for B in (1, 16):
        for dtype, dot in ((jnp.bfloat16, True), (jnp.float32, False)):
            text = _triton_module_text(lambda q, k, p, t: pa.attention(q, k, k, 1, p, t, context=C, interpret=False),
                                       S((B, H, 1, D), dtype), S((2, B, H, C, D), dtype), S((B, C), jnp.int32),
                                       S((B, 1), jnp.int32), monkeypatch=monkeypatch, capsys=capsys)
            assert ("tt.dot" in text) == dot, (B, dtype)
    q, ring_k, _, positions, q_pos = attention_case(1, 1, 1, 8, 16, "bfloat16")
    with pytest.raises(ValueError, match=r"attention\(form='mma'\): needs bfloat16/float16"):
        pa.attention(q, ring_k, ring_k, 0, positions, q_pos, context=16, form="mma")
    with pytest.raises(ValueError, match=r"attention\(form\): must be one of"):
        ta.attention(to_torch(q), to_torch(ring_k), to_torch(ring_k), 0, torch.from_numpy(positions),
                     torch.from_numpy(q_pos), context=16, form="tensor")


@mma_on_gpu
@pytest.mark.parametrize("B,H,T,D,C", [(4, 32, 1, 128, 3000), (4, 8, 2, 64, 250), (2, 8, 10, 64, 250)])
def test_attention_mma_form_gpu_twins_same_bits_and_batch_invariant(B, H, T, D, C):
    """Compiled on the GPU at the stacks' sizes (temporal; Mimi at T=2 and 10): the Pallas and
    Triton MMA forms give the same bits, another launch of the Triton twin too, a row alone has the
    bits it has among the others, and the output is within bf16 rounding of float64."""
    q, ring_k, ring_v, positions, q_pos = case = attention_case(B, H, T, D, C, "bfloat16")
    assert ca.twin_attention_form(D, ca.AttentionBlocks.for_shapes(C).block_slots, jnp.dtype(jnp.bfloat16), True) == "mma"
    G = (lambda a: to_torch(a).cuda())
    o_p = jax.jit(lambda *a: pa.attention(*a, context=C))(*(jnp.asarray(a) for a in (q, ring_k, ring_v)), 1,
                                                          jnp.asarray(positions), jnp.asarray(q_pos))
    o_t = ta.attention(G(q), G(ring_k), G(ring_v), 1, G(positions), G(q_pos), context=C)
    o_t2 = ta.attention(G(q), G(ring_k), G(ring_v), 1, G(positions), G(q_pos), context=C, num_warps=4, num_stages=2)
    assert_same(np.asarray(o_p), o_t.cpu(), o_t2.cpu(), what="attention mma form, GPU")
    with pytest.MonkeyPatch.context() as patch:  # the other launch order (speed only): the same bits
        patch.setattr(ca, "TWIN_ATTENTION_SPLITS_FIRST", not ca.TWIN_ATTENTION_SPLITS_FIRST)
        o_p3 = jax.jit(lambda *a: pa.attention(*a, context=C))(*(jnp.asarray(a) for a in (q, ring_k, ring_v)), 1,
                                                               jnp.asarray(positions), jnp.asarray(q_pos))
        o_t3 = ta.attention(G(q), G(ring_k), G(ring_v), 1, G(positions), G(q_pos), context=C)
    assert_same(np.asarray(o_p), np.asarray(o_p3), o_t3.cpu(), what="attention mma form, other launch order, GPU")
    for b in (1, B - 1):
        one = slice(b, b + 1)
        alone = ta.attention(G(q[one]), G(ring_k[:, one]), G(ring_v[:, one]), 1, G(positions[one]), G(q_pos[one]),
                             context=C)
        assert_same(alone[0].cpu(), o_t[b].cpu(), what=f"row {b} alone, GPU")
    assert _attention_distance(o_t.float().cpu().numpy(), *case) <= 1e-2


# ---------------------------------------------------------------------------------- the step
SMALL = {"temporal": with_options(jx.PRESETS["temporal-small"], context=4, num_heads=2),  # wraps within the run
         "mimi": with_options(jx.PRESETS["mimi-small"], context=5, num_heads=2)}  # T=2: a write straddles the end
# (steps, seed) of each stack's run: the shortest schedules (recycle_rate 10) in which a plain reset_slot, the
# sacrifice tick (reset_slot then bump_slot_start), a plain bump_slot_start and reset_rows all occur and a row
# wraps its ring; the test checks that they do.
SCHEDULE = {"temporal": (5, 3), "mimi": (4, 114)}
# A covering subset of stack x dtype x convention: every pair of values of two axes runs once (the
# four cases of a two-level orthogonal array). "mimi-encoder" and "mimi-decoder" differ only in the
# checkpoint prefix (none here): one computation, so each runs one of Mimi's two cases.
TWIN_STEP_CASES = [("temporal", "float32", "personaplex"), ("temporal", "bfloat16", "moshi"),
                   ("mimi-encoder", "float32", "moshi"), ("mimi-decoder", "bfloat16", "personaplex")]


@pytest.mark.parametrize("stack,dtype,convention", TWIN_STEP_CASES)
def test_twin_step_bit_identical_torch_vs_jax(stack, dtype, convention, monkeypatch):
    """The cross-check with kernels="twin": every tensor identical at every step, across wraps and
    recycling (recycle_rate 10: reset_slot, the sacrifice tick, bump_slot_start and reset_rows all
    occur in a few steps, and a row writes past its ring's end: checked)."""
    kind = "temporal" if stack == "temporal" else "mimi"
    cfg, (steps, seed) = SMALL[kind], SCHEDULE[kind]
    ops, wrapped = [[]], []

    def counted(name):
        op = getattr(jx, f"jit_{name}")

        def call(state, arg):
            ops[-1].append(name)
            return op(state, arg)

        return call

    for name in ("reset_slot", "bump_slot_start", "reset_rows"):
        monkeypatch.setattr(jx, f"jit_{name}", counted(name))
    cls = TemporalStreaming if kind == "temporal" else MimiTransformer
    tables = cls.step_tables

    def recording(self, offset, start_offset, active, T):  # once a torch step, after its recycle op
        wrapped.append(bool(((offset + T > cfg.context) & active).any()))
        ops.append([])
        return tables(self, offset, start_offset, active, T)

    monkeypatch.setattr(cls, "step_tables", recording)
    report = crosscheck(stack, steps=steps, batch=2, dtype=dtype, convention=convention, config=cfg,
                        kernels="twin", recycle_rate=10, seed=seed, layer_loop="scan")
    assert max(report.tensors["end_offset"].per_step_ulp) == 0
    assert report.holds("identical"), report.summary()
    assert max(report.tensors["offset"].per_step_ulp) == 0
    assert report.kernels == "twin" and "verdict" in report.summary()
    assert len(wrapped) == steps and any(wrapped), "a row must wrap its ring"
    seen = {tuple(step_ops) for step_ops in ops[:-1]}
    assert {("reset_slot",), ("reset_slot", "bump_slot_start"), ("bump_slot_start",), ("reset_rows",)} <= seen, ops


@pytest.mark.parametrize("stack", ["temporal", "mimi"])
def test_twin_step_is_batch_invariant_on_both_sides(stack):
    """Row 0 stepped alone (B=1) and with 15 others (B=16) (one step: the ring write and the attention
    over it): the same bits, on the torch twin path and on the JAX twin path (and torch == JAX). The
    interpreted linears and norms run one row a program at B=1 and all the rows in one at B=16 (32 for
    Mimi's T=2): a batch size between them would test the same property again (each costs a compile)."""
    cfg = with_options(jx.PRESETS[f"{stack}-small"], num_heads=2)  # two heads: the interpreter's cost is per program
    T = 1 if stack == "temporal" else 2
    cls = TemporalStreaming if stack == "temporal" else MimiTransformer
    x = torch.randn(1, 16, T, cfg.dim, generator=torch.Generator().manual_seed(0))  # one step: writes, then attends
    rows = {}
    for B in (1, 16):
        module = cls.from_config(cfg, kernels="twin")
        module.init_weights(generator=torch.Generator().manual_seed(1))
        module.streaming_init(B)
        params = jx.weights.nest_params(cfg, {k: to_jax(w) for k, w in module.weights().items()})
        state = jx.init_state(cfg, B)
        step = jx.make_step(cfg, kernels="twin", rope_freqs=module.rope_freqs())
        got = []
        for xs in x[:, :B]:
            t_out = module.step(xs.contiguous())
            j_out, state = step(params, state, to_jax(xs.contiguous()), None)
            t_out, j_out = (o if isinstance(o, tuple) else (o,) for o in (t_out, j_out))
            got.append([bits(o[0].numpy()) for o in t_out] + [bits(np.asarray(o)[0]) for o in j_out])
        rows[B] = got
    for step_rows, alone in zip(rows[16], rows[1]):
        for a, b in zip(step_rows, alone):
            np.testing.assert_array_equal(a, b, err_msg="B=16")
    for step_rows in rows[1]:
        half = len(step_rows) // 2
        for a, b in zip(step_rows[:half], step_rows[half:]):
            np.testing.assert_array_equal(a, b, err_msg="torch vs JAX")


def test_twin_scan_and_python_layer_loops_give_the_same_bits():
    """The layer loop changes no bit: the scan rolled (the default, unroll 1), unrolled over both
    layers, and the Python loop; nor does active=None (no active operand) against every row active
    (given to the Python loop: one compile for both, whose effects could hide each other only by
    cancelling bit for bit); an unroll factor that is not a positive int is refused."""
    cfg = jx.PRESETS["temporal-small"]
    params = jx.init_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 1, cfg.dim))
    outs = []
    for loop, unroll, active in (("scan", 1, None), ("scan", cfg.num_layers, None), ("python", 1, jnp.ones((2,), bool))):
        (out, logits), state = jax.jit(jx.step_fn(cfg, kernels="twin", layer_loop=loop, scan_unroll=unroll))(
            params, jx.init_state(cfg, 2), x, active)
        outs.append((out, logits, state.k, state.offset))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert_same(a, b)
    with pytest.raises(ValueError, match=r"scan_unroll must be a positive int, got None"):
        jx.step_fn(cfg, kernels="twin", scan_unroll=None)(params, jx.init_state(cfg, 2), x, None)


def test_dropin_with_twin_kernels_gives_the_torch_twin_bits():
    """`JaxTemporalStreaming(kernels="twin")` (stepped by the Pallas twins) and the torch stack built with
    kernels="twin" (the Triton twins) on the same weight buffers: the same bits, torch tensors out."""
    from torch_bridge import JaxMimiTransformer

    cfg = jx.PRESETS["mimi-small"]
    torch_twin = MimiTransformer.from_config(cfg, kernels="twin")
    torch_twin.init_weights(generator=torch.Generator().manual_seed(3))
    dropin = JaxMimiTransformer.from_config(cfg, kernels="twin")
    for name, w in torch_twin.weights().items():
        getattr(dropin, name).copy_(w)
    torch_twin.streaming_init(2)
    dropin.streaming_init(2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x = torch.randn(2, 2, cfg.dim, generator=gen)
        a, b = torch_twin.step(x), dropin.step(x)
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    with pytest.raises(ValueError, match="kernels must be one of"):
        JaxMimiTransformer.from_config(cfg, kernels="fast")


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
@pytest.mark.parametrize("convention,window", [("personaplex", 4), ("moshi", 6)])
def test_twin_step_propagates_a_nan_as_the_reference_step(convention, window):
    """A NaN frame (row 0 of 2) reaches the outputs of the twin steps (torch and the JAX drop-in,
    bit-identical, NaNs included) exactly where it reaches the reference step's, for as long as the
    frame or what it made is visible (`window` steps after it: context 4, 2 layers), and no further
    (a masked slot never enters the twin arithmetic; under "personaplex" the reference's SDPA
    still multiplies the labelled-E slot by 0 for two more steps); after a recycle of the row the
    outputs are finite again. The other row stays finite throughout."""
    from torch_bridge import JaxTemporalStreaming

    cfg = jx.with_options(jx.PRESETS["temporal-small"], num_heads=2, context=4, ring_convention=convention)
    ref = TemporalStreaming.from_config(cfg)
    ref.init_weights(generator=torch.Generator().manual_seed(5))
    twin = TemporalStreaming.from_config(cfg, kernels="twin")
    dropin = JaxTemporalStreaming.from_config(cfg, kernels="twin")
    for m in (twin, dropin):
        m.load_weights(ref.export_weights())
    stacks = (ref, twin, dropin)
    for m in stacks:
        m.streaming_init(2)
    gen = torch.Generator().manual_seed(6)
    nan_frame = torch.randn(2, 1, cfg.dim, generator=gen)
    nan_frame[0] = float("nan")

    def step(x):
        (o_ref, _), (o_twin, l_twin), (o_dropin, l_dropin) = (m.step(x) for m in stacks)
        assert_same(o_twin, o_dropin, what="out, torch twin vs JAX twin")
        assert_same(l_twin, l_dropin, what="text logits, torch twin vs JAX twin")
        return o_ref.isnan(), o_twin.isnan()

    step(nan_frame)
    for i in range(1, window + 3):
        nan_ref, nan_twin = step(torch.randn(2, 1, cfg.dim, generator=gen))
        if i <= window:
            assert nan_twin[0].all() and torch.equal(nan_twin, nan_ref), f"step {i} after the NaN frame"
        else:
            assert not nan_twin.any(), f"step {i} after the NaN frame: past the window"
    step(nan_frame)
    assert torch.equal(*step(torch.randn(2, 1, cfg.dim, generator=gen)))  # visible again
    for m in stacks:
        m.reset_slot(0)
        m.bump_slot_start(0)
    for _ in range(2):
        nan_ref, nan_twin = step(torch.randn(2, 1, cfg.dim, generator=gen))
        assert not nan_ref.any() and not nan_twin.any(), "after the recycle"


def test_twin_step_takes_a_strided_x_with_the_bits_of_a_contiguous_one():
    """A non-contiguous x (padded rows, every other column of a wider tensor) steps the torch
    twin stacks as its contiguous copy does, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    for stack, cls in (("temporal-small", TemporalStreaming), ("mimi-small", MimiTransformer)):
        cfg = jx.PRESETS[stack]
        a, b = (cls.from_config(cfg, kernels="twin") for _ in range(2))
        for m in (a, b):
            m.init_weights(generator=torch.Generator().manual_seed(8))
            m.streaming_init(2)
        T = 1 if stack.startswith("temporal") else 2
        for strided in (torch.randn(2, T, cfg.dim + 3, generator=gen)[..., :cfg.dim],
                        torch.randn(2, T, 2 * cfg.dim, generator=gen)[..., ::2]):
            assert not strided.is_contiguous()
            for x, y in zip(jax.tree.leaves(a.step(strided)), jax.tree.leaves(b.step(strided.contiguous()))):
                assert torch.equal(x, y), stack


def test_jax_twin_step_on_dlpack_params_compiles_once():
    """Params shared with a torch stack through DLPack are committed to their device, so the step
    returns its state committed; a fresh `init_state` is committed too, so the second call has the
    first one's signature and runs the executable compiled by the first (jit's cache: one entry)."""
    from torch_bridge.jax_steppers import from_torch

    cfg = jx.PRESETS["temporal-small"]
    module = TemporalStreaming.from_config(cfg, kernels="twin")
    params = from_torch(module, kernels="twin").jax_params()  # to_jax views of the torch weights
    assert all(a.committed for a in jax.tree.leaves(params))
    step = jx.make_step(cfg, kernels="twin", rope_freqs=module.rope_freqs())
    state = jx.init_state(cfg, 2)
    x = jnp.ones((2, 1, cfg.dim))
    _, state = step(params, state, x)
    compiled = step.jitted._cache_size()
    for _ in range(2):
        _, state = step(params, state, x)
        assert step.jitted._cache_size() == compiled, "the step compiled again"


def test_torch_twins_on_the_cpu_without_the_interpreter_are_refused_when_made():
    """Every torch module stepped by the Triton twins, made (or converted) on the CPU with Triton
    compiling (no TRITON_INTERPRET), is refused there with a message naming the variable, not at its
    first step with Triton's "0 active drivers"; the JAX-stepped drop-ins and the reference path are not."""
    code = textwrap.dedent("""
        import jax_impl as jx
        from jax_impl.codec_config import CODEC_PRESETS
        from jax_impl.depformer_config import DEPFORMER_PRESETS
        from jax_impl.frame_config import FRAME_PRESETS
        from torch_bridge import Depformer, JaxTemporalStreaming, MimiCodec, MimiTransformer, TemporalStreaming
        from torch_bridge.frame import LMFrame
        from torch_bridge.jax_depformer import JaxDepformer

        dep, temporal = DEPFORMER_PRESETS["personaplex-small"], jx.PRESETS["temporal-small"]
        on_meta = {"TemporalStreaming": TemporalStreaming.from_config(temporal, kernels="twin", device="meta"),
                   "Depformer": Depformer.from_config(dep, kernels="twin", device="meta")}
        cases = [("TemporalStreaming", lambda: TemporalStreaming.from_config(temporal, kernels="twin")),
                 ("MimiTransformer", lambda: MimiTransformer.from_config(jx.PRESETS["mimi-small"], kernels="twin")),
                 ("Depformer", lambda: Depformer.from_config(dep, kernels="twin")),
                 ("LMFrame", lambda: LMFrame.from_config(FRAME_PRESETS["personaplex-small"], kernels="twin")),
                 ("MimiCodec", lambda: MimiCodec.from_config(CODEC_PRESETS["mimi-tiny"], kernels="twin")),
                 *((name, lambda m=m: m.to_empty(device="cpu")) for name, m in on_meta.items()),
                 ("JaxTemporalStreaming", lambda: JaxTemporalStreaming.from_config(temporal, kernels="twin")),
                 ("JaxDepformer", lambda: JaxDepformer.from_config(dep, kernels="twin")),
                 ("TemporalStreaming", lambda: TemporalStreaming.from_config(temporal))]
        for name, make in cases:
            try:
                make()
                print(name, "| made")
            except RuntimeError as e:
                print(name, "|", e)
        print(*(m.device for m in on_meta.values()))
    """)
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], env={**env, "PYTHONPATH": str(root)}, cwd=root,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    refused = ["TemporalStreaming", "MimiTransformer", "Depformer", "LMFrame", "MimiCodec", "TemporalStreaming",
               "Depformer"]
    assert len(lines) == len(refused) + 4, r.stdout
    for line, name in zip(lines, refused):
        assert line.startswith(f"{name} | {name}(kernels='twin') is on the CPU and Triton is not interpreting; "
                               "set TRITON_INTERPRET=1 before importing triton"), line
    assert lines[len(refused):] == ["JaxTemporalStreaming | made", "JaxDepformer | made", "TemporalStreaming | made",
                                    "meta meta"], r.stdout  # a refused conversion changes nothing

