"""The twin kernels on Pallas's Mosaic GPU backend: the linear's MMA form and the qkv projection with its
RoPE and ring-write epilogue (`kernels_pallas.twin_linear_mgpu`), the linear's lane form
(`twin_linear_lanes_mgpu`), the norm and the split RMSNorm (`twin_norm_mgpu`), the attention's MMA form
(`twin_attention_mgpu`), the RoPE tables and the step's entry (`twin_rope_mgpu`), the codec's ELU, taps
and nearest entry (`twin_conv_mgpu`); the backend's choice (`kernels_pallas.backend`).

Interpreted (CPU, Mosaic GPU's interpreter: jax >= 0.11):
- the linear: with integer-valued operands every partial sum over K is exact, so the order of the
  block products does not matter and the kernel's bits must be the plain reference's
  (`twin_linear.linear_native`): the epilogues, the layer index (traced under jit), the rows past M,
  the padded row counts and the scale and residual tiles are held bit for bit; so are the qkv
  kernel's q and rings (the rotation's products rounded as the reference's), written in place under
  donation and left untouched without it;
- the norm, the split RMSNorm's producer, the RoPE tables, the lane form and the codec's kernels: their
  arithmetic runs in the contract's order whatever the operands, so their bits are the references'
  (`twin_norm.norm_native`, `split_native`, `twin_rope.tables_native`, `twin_entry.entry_native`,
  `twin_linear.linear_native` of form "lanes", `twin_conv.*_native`) on any input;
- the split RMSNorm's halves inside the linears: the bits of the Triton-backend MMA form, interpreted
  (integer-valued operands: y, u, ss and the consumer's scaled sums);
- the attention: the bits of the Triton-backend MMA form, interpreted, where the products' sums are
  exact (integer-valued q and k, one visible slot a block), within float32 rounding elsewhere; masked
  slots holding NaN and Inf reach no output, a query that sees nothing gets +0.
Lowered for CUDA (CPU, jax >= 0.11): every kernel at each stack's shapes, through Pallas's lowering to
Mosaic GPU and its checks of layouts and TMA copies. Compiled for a compile-only H200 where jax's CUDA
plugin is installed (`tests.cuda_target`; any machine): every kernel at 1 and 64 rows, and the stacks'
twin and default steps and the whole speech frame at their real sizes with
PERSONAPLEX_PALLAS_BACKEND=mosaic_gpu, none of their kernels left on the Triton backend.
Compiled (GPU): the bits of the same kernels on Pallas's Triton backend and of their torch twins, on
random and hostile operands at the stacks' sizes, and a row alone has the bits it has among the others.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_impl as jx
from jax_impl.config import PRESETS
from jax_impl.parity import bits
from jax_impl.tables import rope_freqs
from kernels_pallas import backend
from kernels_pallas import twin_attention as pa
from kernels_pallas import twin_attention_bwd_mgpu as pabm
from kernels_pallas import twin_attention_mgpu as pam
from kernels_pallas import twin_conv_mgpu as tcm
from kernels_pallas import twin_grad_mgpu as pgm
from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_linear_lanes_mgpu as pll
from kernels_pallas import twin_linear_mgpu as plm
from kernels_pallas import twin_norm as pn
from kernels_pallas import twin_norm_mgpu as pnm
from kernels_pallas import twin_rope_mgpu as prm
from kernels_pallas.contract.linear import MOSAIC_MIN_JAX
from kernels_pallas.contract.norm import TwinNorm, TwinRms, TwinSplit
from kernels_pallas.twin_entry import entry_native
from tests import cuda_target

NEW_ENOUGH = jax.__version_info__[:2] >= MOSAIC_MIN_JAX
FLOOR = ".".join(map(str, MOSAIC_MIN_JAX))
interpreted = pytest.mark.skipif(
    not NEW_ENOUGH, reason=f"Mosaic GPU's interpreter before jax {FLOOR} cannot read a transposed wgmma operand "
                           f"(this is jax {jax.__version__}): these run on jax >= {FLOOR} (CPU) and on the GPU")
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu",
                            reason="GPU only: the tensor cores' bits against the Triton twins (CPU: the interpreted tests)")


def assert_same(a, b, what):
    a, b = bits(a), bits(b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{what}: {bad.size} of {a.size} elements differ, first at {bad[:5]}"


def integer_case(M, N, K, L, act, scale, res, kind, seed=0):
    """Operands whose products and partial sums are exact in float32 (|x|, |w| <= 4: |sum| <= 16 K)."""
    rng = np.random.default_rng(seed)
    n_out = N // 2 if act == "silu_gate" else N
    b16 = jnp.bfloat16
    x = jnp.asarray(rng.integers(-4, 5, (M, K)), b16)
    w = jnp.asarray(rng.integers(-4, 5, (L, N, K)), b16)
    s = jnp.asarray(rng.standard_normal((L, n_out)) * 0.1, b16) if scale else None
    r = jnp.asarray(rng.standard_normal((M, n_out)), b16) if res else None
    # the norm's output is not integer-valued: the norm tests use a weight of zeros and a bias of integers
    norm = None if kind is None else TwinNorm(kind, jnp.zeros((L, K), b16), jnp.asarray(rng.integers(-4, 5, (L, K)), b16),
                                              1e-5)
    return x, w, s, r, norm


CASES = [  # (M, N, K, L, act, scale, res, norm kind)
    (1, 128, 256, 2, None, False, False, None),
    (4, 256, 128, 3, "gelu", True, True, None),      # Mimi's MLP epilogue, two column blocks
    (72, 128, 192, 2, "silu_gate", False, True, None),  # two row blocks, the second past M; the gate's two tiles
    (12, 128, 128, 1, None, True, False, "layer"),    # 12 rows: padded to 16 (TMA's row tiling); the norm first
    (5, 32, 32, 1, None, True, True, None),           # narrow tiles (the codec's): K and columns blocks of 32
    (70, 48, 48, 2, "gelu", False, True, None),       # K 48: blocks of 16; 48 columns: 3 programs of 16
    (3, 96, 80, 1, "silu_gate", True, False, None),   # the gate's halves of 48 columns; K 80: 5 blocks of 16
]


@interpreted
@pytest.mark.parametrize("M,N,K,L,act,scale,res,kind", CASES)
def test_interpreted_bits_are_the_reference_on_exact_sums(M, N, K, L, act, scale, res, kind):
    x, w, s, r, norm = integer_case(M, N, K, L, act, scale, res, kind)
    layer = jnp.int32(L - 1)
    ref = pli.linear_native(x, w, L - 1, act=act, scale=s, residual=r, norm=norm)
    y = jax.jit(lambda x, w, layer, s, r: plm.linear(x, w, layer, act=act, scale=s, residual=r, norm=norm,
                                                      interpret=True))(x, w, layer, s, r)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert_same(y, ref, f"M={M} act={act}")
    row = M - 1  # a row alone: the bits it has among the others
    alone = plm.linear(x[row:], w, L - 1, act=act, scale=s, residual=None if r is None else r[row:], norm=norm,
                       block_n=128 if (N // (1 + (act == "silu_gate"))) % 128 == 0 else None, interpret=True)
    assert_same(alone[0], y[row], f"row {row} alone")


@interpreted
def test_interpreted_plain_weight_and_other_layers():
    """w [N, K] (layer=None) is a one-layer stack; each layer of a stack is its own weights."""
    x, w, s, _, _ = integer_case(8, 128, 128, 3, None, True, False, None, seed=1)
    for layer in range(3):
        y = plm.linear(x, w[layer], scale=s[layer], interpret=True)
        assert_same(y, pli.linear_native(x, w, layer, scale=s), f"layer {layer}")


@interpreted
@pytest.mark.parametrize("M,D,kind,dtype", [(1, 4096, "rms", "bfloat16"), (5, 1024, "rms", "bfloat16"),
                                            (3, 512, "layer", "bfloat16"), (2, 256, "layer", "float32")])
def test_interpreted_norm_bits_are_the_reference(M, D, kind, dtype):
    """Random rows (some far from zero mean, one of zeros): the reference's bits, the layer index
    traced; a row alone as among the others."""
    rng = np.random.default_rng(M + D)
    x = rng.standard_normal((M, D)) * 3 + np.arange(M)[:, None] * 50
    x[M // 2] = 0.0
    x = jnp.asarray(x, dtype)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal((3, D)), dtype)
    b = jnp.asarray(rng.standard_normal((3, D)), dtype) if kind == "layer" else None
    y = jax.jit(lambda x, w, b, layer: pnm.norm(x, w, b, layer, kind=kind, eps=1e-5, interpret=True))(
        x, w, b, jnp.int32(2))
    assert_same(y, pn.norm_native(x, w, b, 2, kind=kind, eps=1e-5), f"{kind} norm M={M} D={D}")
    alone = pnm.norm(x[M - 1:], w[2], None if b is None else b[2], kind=kind, eps=1e-5, interpret=True)
    assert_same(alone[0], y[M - 1], "a row alone")


def test_norm_refuses_d_it_cannot_spread_over_a_warpgroup():
    with pytest.raises(ValueError, match="multiple of 128"):
        pnm.norm(jnp.zeros((2, 96), jnp.bfloat16), jnp.ones((96,), jnp.bfloat16), eps=1e-5, interpret=True)


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"x": jnp.zeros((4, 128), jnp.float32), "w": jnp.zeros((64, 128), jnp.float32)}, TypeError, "bfloat16"),
    ({"w": jnp.zeros((64, 24), jnp.bfloat16), "x": jnp.zeros((4, 24), jnp.bfloat16)}, ValueError, "factor of at least 16"),
    ({"block_n": 48}, ValueError, "block_n"),
    ({"stages": 1}, ValueError, "stages"),
    ({"w": jnp.zeros((64, 64), jnp.bfloat16)}, ValueError, r"linear\(w\)"),
])
def test_bad_arguments_are_named(kwargs, exc, match):
    args = {"x": jnp.zeros((4, 128), jnp.bfloat16), "w": jnp.zeros((64, 128), jnp.bfloat16), **kwargs}
    with pytest.raises(exc, match=match):
        plm.linear(args.pop("x"), args.pop("w"), interpret=True, **args)


@pytest.mark.skipif(NEW_ENOUGH, reason="checks the refusal of an interpreter too old (this jax is new enough)")
def test_old_interpreter_is_refused_with_the_version():
    with pytest.raises(RuntimeError, match=f"jax >= {FLOOR}"):
        plm.linear(jnp.zeros((4, 128), jnp.bfloat16), jnp.zeros((64, 128), jnp.bfloat16), interpret=True)


def hostile(rng, shape):
    """Values over 2^+-40, exact cancellations in random order, overflow and NaN/inf rows (bfloat16)."""
    v = rng.standard_normal(shape) * np.exp2(rng.integers(-40, 41, shape))
    flat = v.reshape(-1, shape[-1])
    half = shape[-1] // 2
    perm = rng.permutation(shape[-1])
    flat[1::7, perm[half:]] = -flat[1::7, perm[:half]]   # rows that cancel exactly
    flat[2::11] *= 2.0**100                               # products past float32's range
    flat[3::13, 5] = np.nan
    flat[4::17, 9] = np.inf
    return jnp.asarray(flat.reshape(shape), jnp.bfloat16)


@on_gpu
@pytest.mark.parametrize("M,N,K,act,scale,res,kind", [
    (1, 4096, 4096, None, False, True, None), (4, 3 * 4096, 4096, None, False, False, None),
    (16, 2 * 11264, 4096, "silu_gate", False, False, None), (64, 4096, 11264, None, False, True, None),
    (2, 2048, 512, "gelu", True, True, "layer"), (128, 512, 2048, None, True, True, None),
    (12, 1024, 1024, None, False, True, None), (64, 2 * 2816, 1024, "silu_gate", False, False, "rms"),
])
@pytest.mark.parametrize("inputs", ["random", "hostile"])
def test_gpu_bits_are_the_triton_twins(M, N, K, act, scale, res, kind, inputs):
    """The Mosaic kernel, the Pallas Triton-backend MMA form and the torch twin: the same bits, at
    both column tiles and two pipeline depths, a row alone as among the others (the temporal,
    depformer and Mimi projections' shapes)."""
    import torch

    from kernels_triton import twin_linear as tli
    from torch_bridge.dlpack import to_torch

    rng = np.random.default_rng(M + N + K)
    n_out = N // 2 if act == "silu_gate" else N
    b16 = jnp.bfloat16
    x = hostile(rng, (M, K)) if inputs == "hostile" else jnp.asarray(rng.standard_normal((M, K)), b16)
    w = jnp.asarray(rng.standard_normal((2, N, K)) * 0.05, b16)
    s = jnp.asarray(rng.standard_normal((2, n_out)), b16) if scale else None
    r = jnp.asarray(rng.standard_normal((M, n_out)), b16) if res else None
    norm = None if kind is None else TwinNorm(kind, jnp.asarray(1 + 0.1 * rng.standard_normal((2, K)), b16),
                                              jnp.asarray(rng.standard_normal((2, K)), b16) if kind == "layer" else None,
                                              1e-5)
    y = plm.linear(x, w, 1, act=act, scale=s, residual=r, norm=norm)
    y_wide = plm.linear(x, w, 1, act=act, scale=s, residual=r, norm=norm, block_n=128, stages=2)
    y_p = pli.linear(x, w, 1, act=act, scale=s, residual=r, norm=norm, form="mma")
    C = (lambda a: None if a is None else to_torch(a))
    tnorm = None if norm is None else TwinNorm(kind, C(norm.weight), C(norm.bias), norm.eps)
    y_t = tli.linear(C(x), C(w), 1, act=act, scale=C(s), residual=C(r), norm=tnorm)
    torch.cuda.synchronize()
    for other, what in ((y_wide, "BN 128, 2 stages"), (y_p, "Pallas Triton backend"), (y_t.cpu(), "torch twin")):
        assert_same(y, other, f"{inputs} M={M} N={N} K={K}: {what}")
    for row in (0, M - 1):
        alone = plm.linear(x[row:row + 1], w, 1, act=act, scale=s, residual=None if r is None else r[row:row + 1],
                           norm=norm)
        assert_same(alone[0], y[row], f"{inputs} row {row} alone")


def qkv_case(B, T, H, D, C, L, K, seed=0, integers=True):
    """x [B*T, K], w [L, 3HD, K] (integer-valued: exact sums), RoPE tables of real positions, rings,
    write slots (consecutive per row) and a mask with unwritten rows (bf16)."""
    rng = np.random.default_rng(seed)
    b16 = jnp.bfloat16
    if integers:
        x, w = (jnp.asarray(rng.integers(-3, 4, s), b16) for s in ((B * T, K), (L, 3 * H * D, K)))
    else:
        x, w = jnp.asarray(rng.standard_normal((B * T, K)), b16), jnp.asarray(rng.standard_normal((L, 3 * H * D, K)) * 0.05, b16)
    ring_k, ring_v = (jnp.asarray(rng.standard_normal((L, B, H, C, D)), b16) for _ in range(2))
    offset = rng.integers(0, 5000, B)
    angle = (offset[:, None, None] + np.arange(T)[None, :, None]) * rope_freqs(D, 10000.0)[None, None, :]
    cos, sin = jnp.asarray(np.cos(angle), jnp.float32), jnp.asarray(np.sin(angle), jnp.float32)
    write_index = jnp.asarray((offset[:, None] + np.arange(T)) % C, jnp.int32)
    write_mask = jnp.asarray(rng.random((B, T)) < 0.7).at[0, 0].set(True)
    return x, w, cos, sin, ring_k, ring_v, write_index, write_mask


@interpreted
@pytest.mark.parametrize("B,T,H,D,K,rope,kind", [(2, 1, 2, 128, 128, True, None), (3, 2, 2, 64, 128, True, "layer"),
                                                 (1, 1, 1, 128, 64, False, None), (40, 2, 1, 64, 64, True, None)])
def test_interpreted_qkv_bits_are_the_reference(B, T, H, D, K, rope, kind):
    """q and both rings: the reference's bits (integer operands, the rotation's roundings), the rings
    written in place when donated, the caller's untouched when not; 80 rows: two row blocks."""
    C, L = 5, 2
    x, w, cos, sin, ring_k, ring_v, wi, wm = qkv_case(B, T, H, D, C, L, K, seed=B)
    if not rope:
        cos = sin = None
    norm = None if kind is None else TwinNorm(kind, jnp.zeros((L, K), jnp.bfloat16), jnp.ones((L, K), jnp.bfloat16), 1e-5)
    ref = pli.linear_rope_write_native(x, w, L - 1, cos, sin, ring_k, ring_v, wi, wm, norm=norm)
    kept = [np.asarray(r).copy() for r in (ring_k, ring_v)]

    def call(x, w, layer, cos, sin, rk, rv, wi, wm):
        return plm.linear_rope_write(x, w, layer, cos, sin, rk, rv, wi, wm, norm=norm, interpret=True)

    out = jax.jit(call)(x, w, jnp.int32(L - 1), cos, sin, ring_k, ring_v, wi, wm)
    for name, a, b in zip(("q", "ring_k", "ring_v"), out, ref):
        assert_same(a, b, f"{name} B={B} T={T}")
    for r, k in zip((ring_k, ring_v), kept):
        assert_same(r, k, "the caller's ring without donation")
    donated = jax.jit(call, donate_argnums=(5, 6))(x, w, jnp.int32(L - 1), cos, sin, jnp.array(ring_k),
                                                   jnp.array(ring_v), wi, wm)
    for name, a, b in zip(("q", "ring_k", "ring_v"), donated, ref):
        assert_same(a, b, f"{name}, donated")


@interpreted
@pytest.mark.parametrize("M,D", [(3, 256), (12, 512), (72, 128)])
def test_interpreted_split_bits_are_the_reference(M, D):
    """The split RMSNorm's producer on its own (a step's first norm): u and ss, the reference's bits on
    random rows, 12 rows padded to 16 and 72 rows in two blocks."""
    rng = np.random.default_rng(M)
    x = jnp.asarray(rng.standard_normal((M, D)) * 3, jnp.bfloat16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal((2, D)), jnp.bfloat16)
    u, ss = jax.jit(lambda x, w, layer: pnm.split(x, w, layer, interpret=True))(x, w, jnp.int32(1))
    ref_u, ref_ss = pn.split_native(x, w, 1)
    assert_same(u, ref_u, "u")
    assert_same(ss, ref_ss, "ss")


def split_case(M, K, seed):
    """A consumer's ss (`pn.split_native` of random rows), as the producer before it would hand it."""
    rng = np.random.default_rng(seed)
    return TwinRms(pn.split_native(jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16), jnp.ones((K,), jnp.bfloat16))[1],
                   1e-5)


@interpreted
@pytest.mark.parametrize("M,N,K,act,res,split,rms", [(4, 128, 512, None, True, True, False),
                                                     (12, 256, 512, "silu_gate", False, False, True),
                                                     (72, 128, 1024, None, True, True, True)])
def test_interpreted_split_halves_in_the_linear(M, N, K, act, res, split, rms):
    """The producer's half in the epilogue (y, u, ss) and the consumer's before it: the bits of the
    Triton-backend MMA form, interpreted, on integer-valued operands; alpha read at layer + offset."""
    x, w, _, r, _ = integer_case(M, N, K, 2, act, False, res, None, seed=M)
    n_out = N // 2 if act == "silu_gate" else N
    rng = np.random.default_rng(M)
    tsplit = TwinSplit(jnp.asarray(1 + 0.1 * rng.standard_normal((2, n_out)), jnp.bfloat16), offset=1) if split else None
    trms = split_case(M, K, M) if rms else None
    y = plm.linear(x, w, 0, act=act, residual=r, split=tsplit, rms=trms, interpret=True)
    ref = pli.linear(x, w, 0, act=act, residual=r, split=tsplit, rms=trms, form="mma", interpret=True)
    for name, a, b in zip(("y", "u", "ss"), *((y, ref) if split else ((y,), (ref,)))):
        assert_same(a, b, f"{name} M={M}")


@interpreted
@pytest.mark.parametrize("B,T,H,D,K", [(2, 1, 2, 128, 512), (3, 2, 2, 64, 1024)])
def test_interpreted_qkv_with_the_split_norm(B, T, H, D, K):
    """linear_rope_write's consumer half (Helium's qkv): the Triton-backend MMA form's bits, interpreted."""
    x, w, cos, sin, ring_k, ring_v, wi, wm = qkv_case(B, T, H, D, 5, 2, K, seed=B)
    rms = split_case(B * T, K, B)
    ref = pli.linear_rope_write(x, w, 1, cos, sin, ring_k, ring_v, wi, wm, rms=rms, form="mma", interpret=True)
    out = plm.linear_rope_write(x, w, 1, cos, sin, ring_k, ring_v, wi, wm, rms=rms, interpret=True)
    for name, a, b in zip(("q", "ring_k", "ring_v"), out, ref):
        assert_same(a, b, name)


def attention_case(B, H, T, D, C, seed=0, sparse=False, integers=True):
    """(q, ring_k, ring_v, positions, q_pos): slot 3 masked and holding NaN (v) and Inf (k); row 0 sees
    nothing; sparse: one visible slot in each block of 64."""
    rng = np.random.default_rng(seed)
    b16 = jnp.bfloat16
    q = rng.integers(-2, 3, (B, H, T, D)) if integers else rng.standard_normal((B, H, T, D))
    ring_k = rng.integers(-2, 3, (2, B, H, C, D)).astype(np.float32) if integers else rng.standard_normal((2, B, H, C, D))
    ring_v = rng.standard_normal((2, B, H, C, D))
    ring_k[:, :, :, 3], ring_v[:, :, :, 3] = np.inf, np.nan
    q_pos = np.full((B, T), C, np.int32) + np.arange(T, dtype=np.int32)
    positions = rng.integers(0, C, (B, C)).astype(np.int32)
    if sparse:
        positions[:] = -1
        positions[:, 5::64] = C - 1 - np.arange(len(range(5, C, 64)))
    positions[:, 3] = -1
    positions[0] = -1
    return (jnp.asarray(q, b16), jnp.asarray(ring_k, b16), jnp.asarray(ring_v, b16), jnp.asarray(positions),
            jnp.asarray(q_pos))


@interpreted
@pytest.mark.parametrize("B,H,T,D,C,sparse", [(3, 2, 1, 128, 296, True), (2, 2, 2, 64, 16, True),
                                              (2, 2, 2, 64, 250, True), (3, 2, 1, 128, 296, False),
                                              (2, 1, 2, 64, 136, False), (2, 2, 2, 64, 250, False)])
def test_interpreted_attention_is_the_triton_backends(B, H, T, D, C, sparse):
    """296 slots: 2 splits of 256 (the combine over 2 partials, the second split's last blocks past the
    ring); 16: the depformer's ring of one block, read as 64 lanes (48 of them past the ring); 250:
    Mimi's ring, not a multiple of 8 slots, its blocks staged through the registers (4 splits, the last
    block 6 slots past the ring)."""
    q, ring_k, ring_v, positions, q_pos = attention_case(B, H, T, D, C, seed=C + D, sparse=sparse)
    out = jax.jit(lambda *a: pam.attention(*a, context=C, interpret=True))(q, ring_k, ring_v, jnp.int32(1),
                                                                          positions, q_pos)
    ref = pa.attention(q, ring_k, ring_v, 1, positions, q_pos, context=C, interpret=True, form="mma")
    o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(o).all() and not o[0].any() and not np.signbit(o[0]).any()
    if sparse:
        assert_same(out, ref, f"attention C={C}")
    else:
        assert np.max(np.abs(o - r)) <= 2.0**-7 * np.max(np.abs(r))


@interpreted
@pytest.mark.parametrize("B,T,D", [(3, 1, 128), (2, 2, 64), (1, 10, 64)])
def test_interpreted_rope_tables_and_entry_are_the_references(B, T, D):
    """Positions up to 10**5 (the RoPE angles' range): the tables' bits, and the step's entry (the same
    integer tables as `entry_native`, its counters 0)."""
    rng = np.random.default_rng(B * T)
    offset = jnp.asarray(rng.integers(0, 100_000, B), jnp.int32)
    freqs = jnp.asarray(rope_freqs(D, 10000.0), jnp.float32)
    cos, sin = jax.jit(lambda o, f: prm.tables(o, T, f, interpret=True))(offset, freqs)
    ref_cos, ref_sin = prm.tables_native(offset, T, freqs)
    assert_same(cos, ref_cos, "cos")
    assert_same(sin, ref_sin, "sin")
    x = jnp.asarray(rng.standard_normal((B, T, 32)), jnp.bfloat16)
    start, active = offset - 3, jnp.asarray(rng.random(B) < 0.7)
    kw = {"capacity": 24, "convention": "personaplex", "num_heads": 4}
    for got, want in zip(prm.entry(offset, start, active, x, freqs, interpret=True, **kw),
                         entry_native(offset, start, active, x, freqs, **kw)):
        assert_same(got, want, "entry")


def test_norm_signature_is_the_twin_norms():
    import inspect

    kernel = list(inspect.signature(pnm.norm).parameters)
    assert kernel == ["x", "weight", "bias", "layer", "kind", "eps", "interpret"]
    assert kernel[:6] == list(inspect.signature(pn.norm).parameters)[:6]
    assert pnm.norm_native is pn.norm_native


def test_signature_is_the_twin_linears_with_its_own_tiles():
    """x, w, layer and the epilogue's arguments are `twin_linear.linear`'s, in its order; only the speed
    parameters differ (Mosaic's tiles and pipeline depth); the plain reference is the same function."""
    import inspect

    def names(fn):
        return [p for p in inspect.signature(fn).parameters]

    semantic = ["x", "w", "layer", "act", "scale", "residual", "norm", "split", "rms"]
    assert names(plm.linear)[:9] == semantic == names(pli.linear)[:9]
    assert set(names(plm.linear)[9:]) == {"block_n", "stages", "interpret"}
    assert names(pnm.split) == names(pn.split) and pnm.split_native is pn.split_native
    assert plm.linear_native is pli.linear_native
    qkv = list(inspect.signature(plm.linear_rope_write).parameters)
    twin = list(inspect.signature(pli.linear_rope_write).parameters)
    assert qkv[:12] == twin[:12] and plm.linear_rope_write_native is pli.linear_rope_write_native


@on_gpu
@pytest.mark.parametrize("M,D,kind", [(1, 4096, "rms"), (4, 4096, "rms"), (64, 4096, "rms"), (16, 1024, "rms"),
                                      (2, 512, "layer"), (128, 512, "layer")])
@pytest.mark.parametrize("inputs", ["random", "hostile"])
def test_gpu_norm_bits_are_the_triton_twins(M, D, kind, inputs):
    """The Mosaic norm, the Pallas Triton-backend norm and the torch twin: the same bits (the temporal,
    depformer and Mimi norms' sizes), a row alone as among the others."""
    import torch

    from kernels_triton import twin_norm as tn
    from torch_bridge.dlpack import to_torch

    rng = np.random.default_rng(M + D)
    b16 = jnp.bfloat16
    x = hostile(rng, (M, D)) if inputs == "hostile" else jnp.asarray(rng.standard_normal((M, D)) * 3, b16)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal((2, D)), b16)
    b = jnp.asarray(rng.standard_normal((2, D)), b16) if kind == "layer" else None
    y = pnm.norm(x, w, b, 1, kind=kind, eps=1e-5)
    y_p = pn.norm(x, w, b, 1, kind=kind, eps=1e-5)
    y_t = tn.norm(to_torch(x), to_torch(w), None if b is None else to_torch(b), 1, kind=kind, eps=1e-5)
    torch.cuda.synchronize()
    assert_same(y, y_p, f"{inputs} {kind} M={M}: Pallas Triton backend")
    assert_same(y, y_t.cpu(), f"{inputs} {kind} M={M}: torch twin")
    alone = pnm.norm(x[M - 1:], w, b, 1, kind=kind, eps=1e-5)
    assert_same(alone[0], y[M - 1], f"{inputs} row alone")


@on_gpu
@pytest.mark.parametrize("B,T,H,D,K", [(1, 1, 32, 128, 4096), (4, 1, 32, 128, 4096), (64, 1, 32, 128, 4096),
                                       (4, 2, 8, 64, 512), (64, 10, 8, 64, 512), (16, 1, 16, 64, 1024)])
def test_gpu_qkv_bits_are_the_triton_twins(B, T, H, D, K):
    """The Mosaic qkv kernel, the Pallas Triton-backend one and the torch twin: q and both rings with the
    same bits (the temporal, Mimi and depformer projections), the rings written in place."""
    import torch

    from kernels_triton import twin_linear as tli
    from torch_bridge.dlpack import to_torch

    C, L = 12, 2
    x, w, cos, sin, ring_k, ring_v, wi, wm = qkv_case(B, T, H, D, C, L, K, seed=B, integers=False)
    norm = TwinNorm("rms", jnp.asarray(1 + 0.1 * np.random.default_rng(0).standard_normal((L, K)), jnp.bfloat16),
                    None, 1e-5)
    tk, tv = (to_torch(jnp.array(r)) for r in (ring_k, ring_v))
    tn = TwinNorm("rms", to_torch(norm.weight), None, norm.eps)
    tq, _, _ = tli.linear_rope_write(to_torch(x), to_torch(w), L - 1, to_torch(cos), to_torch(sin), tk, tv,
                                     to_torch(wi), to_torch(wm), norm=tn)
    torch.cuda.synchronize()
    expected = (tq.cpu(), tk.cpu(), tv.cpu())
    p = pli.linear_rope_write(x, w, L - 1, cos, sin, jnp.array(ring_k), jnp.array(ring_v), wi, wm, norm=norm, form="mma")
    m = jax.jit(lambda *a: plm.linear_rope_write(*a, norm=norm), donate_argnums=(5, 6))(
        x, w, jnp.int32(L - 1), cos, sin, jnp.array(ring_k), jnp.array(ring_v), wi, wm)
    for name, a, b, t in zip(("q", "ring_k", "ring_v"), m, p, expected):
        assert_same(a, b, f"{name} B={B}: Pallas Triton backend")
        assert_same(a, t, f"{name} B={B}: torch twin")


@on_gpu
@pytest.mark.parametrize("M", [1, 4, 16, 64])
@pytest.mark.parametrize("inputs", ["random", "hostile"])
def test_gpu_split_norm_bits_are_the_triton_twins(M, inputs):
    """Helium's split RMSNorm (K = 4096): the producer alone (`split`), in the out projection's epilogue
    (y, u, ss), the consumer in the gate (rms) and in the qkv kernel: the bits of the Pallas Triton-backend
    kernels and of the torch twins."""
    import torch

    from kernels_triton import twin_linear as tli
    from kernels_triton import twin_norm as tn
    from torch_bridge.dlpack import to_torch

    K, L = 4096, 2
    rng = np.random.default_rng(M)
    b16 = jnp.bfloat16
    x = hostile(rng, (M, K)) if inputs == "hostile" else jnp.asarray(rng.standard_normal((M, K)), b16)
    alpha = jnp.asarray(1 + 0.1 * rng.standard_normal((L, K)), b16)
    w_out = jnp.asarray(rng.standard_normal((L, K, K)) * 0.02, b16)
    w_gate = jnp.asarray(rng.standard_normal((L, 2 * 1024, K)) * 0.02, b16)
    u, ss = pnm.split(x, alpha, 0)
    for a, b, what in zip((u, ss), pn.split(x, alpha, 0), ("u", "ss")):
        assert_same(a, b, f"split {what}")
    tu, tss = tn.split(to_torch(x), to_torch(alpha), 0)
    torch.cuda.synchronize()
    assert_same(u, tu.cpu(), "split u, torch")
    assert_same(ss, tss.cpu(), "split ss, torch")
    split = TwinSplit(alpha, offset=1)
    produced = plm.linear(u, w_out, 0, residual=x, split=split, rms=TwinRms(ss, 1e-5))
    expected = pli.linear(u, w_out, 0, residual=x, split=split, rms=TwinRms(ss, 1e-5), form="mma")
    t_out = tli.linear(tu, to_torch(w_out), 0, residual=to_torch(x), split=TwinSplit(to_torch(alpha), 1),
                       rms=TwinRms(tss, 1e-5))
    torch.cuda.synchronize()
    for name, a, b, t in zip(("y", "u", "ss"), produced, expected, t_out):
        assert_same(a, b, f"out projection {name}")
        assert_same(a, t.cpu(), f"out projection {name}, torch")
    g = plm.linear(produced[1], w_gate, 0, act="silu_gate", rms=TwinRms(produced[2], 1e-5))
    assert_same(g, pli.linear(produced[1], w_gate, 0, act="silu_gate", rms=TwinRms(produced[2], 1e-5), form="mma"),
                "gate (consumer)")
    _, _, cos, sin, ring_k, ring_v, wi, wm = qkv_case(M, 1, 32, 128, 12, L, K, seed=M, integers=False)
    w_qkv = jnp.asarray(rng.standard_normal((L, 3 * K, K)) * 0.02, b16)
    qkv = [f(u, w_qkv, 1, cos, sin, jnp.array(ring_k), jnp.array(ring_v), wi, wm, rms=TwinRms(ss, 1e-5), **kw)
           for f, kw in ((plm.linear_rope_write, {}), (pli.linear_rope_write, {"form": "mma"}))]
    for name, a, b in zip(("q", "ring_k", "ring_v"), *qkv):
        assert_same(a, b, f"qkv {name} (consumer)")


def test_the_backend_is_read_from_the_environment(monkeypatch):
    """PERSONAPLEX_PALLAS_BACKEND: unset or "triton", "mosaic_gpu", anything else an error naming it."""
    monkeypatch.delenv(backend.VARIABLE, raising=False)
    assert backend.gpu_backend() == "triton" and not backend.on_mosaic()
    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    assert backend.on_mosaic()
    monkeypatch.setenv(backend.VARIABLE, "cuda")
    with pytest.raises(ValueError, match="PERSONAPLEX_PALLAS_BACKEND"):
        backend.gpu_backend()


def test_a_jitted_step_keeps_the_backend_chosen_when_it_was_made(monkeypatch):
    """`backend.use` chooses over the variable. A factory's step (`per_backend`, `traced_on`) is traced on
    the backend chosen when it was made, whenever it is first called; `make_step` keeps one per backend."""
    monkeypatch.delenv(backend.VARIABLE, raising=False)
    seen = []

    @backend.per_backend
    def factory(n):
        def add(x):
            seen.append(backend.gpu_backend())
            return x + n
        return jax.jit(backend.traced_on(add))

    on_triton = factory(1)
    with backend.use("mosaic_gpu"):
        on_mosaic = factory(1)
        assert factory(1) is on_mosaic and on_mosaic is not on_triton
        on_triton(jnp.ones(2))  # first called here, traced on the backend it was made with
    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    assert factory(1) is on_mosaic
    on_mosaic(jnp.ones(2))
    assert seen == ["triton", "mosaic_gpu"]
    step = jx.make_step(PRESETS["mimi-small"], kernels="twin")
    assert jx.make_step(PRESETS["mimi-small"], kernels="twin") is step
    with backend.use("triton"):
        assert jx.make_step(PRESETS["mimi-small"], kernels="twin") is not step
    with pytest.raises(ValueError, match=r"use\(name\)"), backend.use("cuda"):
        pass


def test_each_twin_runs_its_mosaic_twin_where_it_takes_the_call(monkeypatch):
    """With the variable set, each twin kernel's call (under its custom_vjp) is its Mosaic twin's, on any
    jax: the Mosaic kernels replaced by recorders here."""
    called = []

    def recorder(name, out):
        def record(*args, **kwargs):
            called.append(name)
            return out(*args)
        return record

    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    monkeypatch.setattr(plm, "linear", recorder("linear", lambda x, w, *_: jnp.zeros((x.shape[0], w.shape[1]), x.dtype)))
    monkeypatch.setattr(pnm, "norm", recorder("norm", lambda x, *_: x))
    monkeypatch.setattr(pnm, "split", recorder("split", lambda x, *_: (x, jnp.zeros((x.shape[0], x.shape[1] // 64)))))
    monkeypatch.setattr(pam, "attention", recorder("attention", lambda q, *a: (jnp.swapaxes(q, 1, 2), a[-1])))
    b16 = jnp.bfloat16
    pli.linear(jnp.ones((2, 128), b16), jnp.ones((64, 128), b16))
    pn.norm(jnp.ones((2, 128), b16), jnp.ones((128,), b16), eps=1e-5)
    pn.split(jnp.ones((2, 128), b16), jnp.ones((128,), b16))
    q, ring_k, ring_v, positions, q_pos = attention_case(1, 2, 1, 64, 16)
    pa.attention(q, ring_k, ring_v, 1, positions, q_pos, context=16)
    assert called == ["linear", "norm", "split", "attention"]


def test_the_triton_backend_runs_where_mosaic_does_not_take_the_call(monkeypatch):
    """A linear after a norm of 96 features (the lane form, its norm fused), a norm of 96 features, a
    head of 16 dims: with the variable set, the Triton-backend kernels' bits, on any jax."""
    rng = np.random.default_rng(0)
    x, w = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32), jnp.asarray(rng.standard_normal((32, 96)), jnp.float32)
    norm = TwinNorm("rms", jnp.ones((96,), jnp.float32), None, 1e-5)
    xn, wn = jnp.asarray(rng.standard_normal((2, 96)), jnp.bfloat16), jnp.ones((96,), jnp.bfloat16)
    q, ring_k, ring_v, positions, q_pos = attention_case(1, 2, 1, 16, 10)
    calls = (lambda: pli.linear(x, w, act="gelu", norm=norm), lambda: pn.norm(xn, wn, eps=1e-5),
             lambda: pa.attention(q, ring_k, ring_v, 1, positions, q_pos, context=10))
    monkeypatch.delenv(backend.VARIABLE, raising=False)
    want = [f() for f in calls]
    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    for name, f, w_ in zip(("linear after a norm of 96", "norm of 96", "head of 16"), calls, want):
        assert_same(f(), w_, name)


@interpreted
def test_interpreted_mosaic_twins_have_the_twin_gradient(monkeypatch):
    """jax.grad through the linear (a norm first, the gated epilogue) on the Mosaic kernels: the backward
    of the Triton-backend twin (`contract.grad`), its products on the Mosaic kernels too. Integer-valued
    operands and a weight of zeros in the norm: every sum exact, so the gradients' bits are the
    Triton-backend twin's (its MMA form)."""
    rng = np.random.default_rng(3)
    b16 = jnp.bfloat16
    x = jnp.asarray(rng.integers(-2, 3, (4, 128)), b16)
    w = jnp.asarray(rng.integers(-2, 3, (1, 256, 128)), b16)
    norm_b = jnp.asarray(rng.integers(-2, 3, (1, 128)), b16)

    def loss(x, w, b):
        y = pli.linear(x, w, 0, norm=TwinNorm("layer", jnp.zeros((1, 128), b16), b, 1e-5), form="mma",
                       interpret=True)
        return jnp.sum(y.astype(jnp.float32))

    grads = {}
    for name in ("triton", "mosaic_gpu"):
        monkeypatch.setenv(backend.VARIABLE, name)
        grads[name] = jax.grad(loss, argnums=(0, 1, 2))(x, w, norm_b)
    for what, a, b in zip(("dx", "dw", "dbias"), grads["triton"], grads["mosaic_gpu"]):
        assert_same(b, a, what)


@pytest.mark.parametrize("dtype,K,N_out,kw,takes", [
    ("bfloat16", 4096, 4096, {}, True), ("float16", 512, 2048, {"norm": True}, True),
    ("float32", 4096, 4096, {}, False),                       # the lane form's dtype
    ("bfloat16", 96, 128, {}, True), ("bfloat16", 128, 96, {}, True),  # narrow tiles: K blocks of 32, 32 columns
    ("bfloat16", 7, 64, {}, False), ("bfloat16", 192, 8, {}, False),  # the lane form's shapes
    ("bfloat16", 512, 96, {"split": True}, False),            # the split norm's groups: 64 columns
    ("bfloat16", 96, 3 * 128, {"head_dim": 128}, False),      # the qkv kernel: K blocks of 64
    ("bfloat16", 64, 128, {"norm": True}, False),             # the norm's lanes: K a multiple of 128
    ("bfloat16", 256, 128, {"rms": True}, False),             # 4 groups: fewer than a row tree's 8 lanes
    ("bfloat16", 4096, 3 * 4096, {"rms": True, "head_dim": 128}, True),
    ("bfloat16", 512, 3 * 256, {"head_dim": 32}, False),
])
def test_which_calls_the_mosaic_linears_take(dtype, K, N_out, kw, takes):
    from kernels_pallas.contract.linear import mosaic_takes_linear

    assert mosaic_takes_linear(jnp.dtype(dtype), K, N_out, **kw) is takes


@interpreted
def test_interpreted_twin_steps_on_the_mosaic_kernels(monkeypatch):
    """The JAX twin step of each stack on the Mosaic GPU kernels, interpreted, four steps: within one
    bf16 rounding of the step on the Triton-backend twins (which run the CPU's lane form; the Mosaic
    kernels their MMA form, another order of the sums)."""
    from jax_impl.config import MimiConfig, TemporalConfig

    for cfg, T in ((MimiConfig(num_layers=2, dim=128, num_heads=2, context=10, ffn=256), 2),
                   (TemporalConfig(dim=512, num_layers=2, num_heads=4, hidden=256, context=24, text_card=128), 1)):
        params = jx.init_params(cfg, jax.random.key(0), dtype=jnp.bfloat16)
        outs = {}
        for name in ("triton", "mosaic_gpu"):
            monkeypatch.setenv(backend.VARIABLE, name)
            step, state, ys = jax.jit(jx.step_fn(cfg, kernels="twin")), jx.init_state(cfg, 3, jnp.bfloat16), []
            for t in range(4):
                y, state = step(params, state, jax.random.normal(jax.random.key(t + 1), (3, T, cfg.dim), jnp.bfloat16))
                ys.append(np.asarray(jax.tree.leaves(y)[0], np.float32))
            outs[name] = ys
        for t, (a, b) in enumerate(zip(outs["triton"], outs["mosaic_gpu"])):
            assert np.max(np.abs(a - b)) <= 2.0**-6 * np.max(np.abs(a)), (type(cfg).__name__, t)


@interpreted
@pytest.mark.parametrize("M,N,K,L,act,scale,res,dtype", [
    (5, 64, 7, 1, None, False, False, "bfloat16"),     # the codec's first convolution: one lane over 7 products
    (3, 1, 192, 1, None, False, True, "bfloat16"),     # its last: one column (padded to a program of 64)
    (4, 128, 256, 2, "gelu", True, True, "float32"),   # 128 lanes, two K blocks, the layer traced
    (3, 80, 48, 1, "silu_gate", True, False, "float32"),  # 16 lanes; the gate's halves of 40 columns, padded
    (2, 64, 6, 1, None, False, False, "float32"),      # 2 lanes
    (2, 64, 12, 1, None, True, True, "float16"),       # 4 lanes
])
def test_interpreted_lane_form_is_the_reference(M, N, K, L, act, scale, res, dtype):
    """The Mosaic lane form adds its products in the contract's order whatever the operands: the
    reference's bits (`linear_native`, form "lanes") on random inputs."""
    rng = np.random.default_rng(M * K + N)
    n_out = N // 2 if act == "silu_gate" else N
    x, w = jnp.asarray(rng.standard_normal((M, K)), dtype), jnp.asarray(rng.standard_normal((L, N, K)) * 0.3, dtype)
    s = jnp.asarray(rng.standard_normal((L, n_out)), dtype) if scale else None
    r = jnp.asarray(rng.standard_normal((M, n_out)), dtype) if res else None
    got = jax.jit(lambda x, w, s, r, layer: pll.linear(x, w, layer, act=act, scale=s, residual=r, interpret=True))(
        x, w, s, r, jnp.int32(L - 1))
    assert_same(got, pli.linear_native(x, w, L - 1, act=act, scale=s, residual=r, form="lanes"), "lane form")


@interpreted
@pytest.mark.parametrize("act,scale,dtype", [(None, True, "bfloat16"), ("gelu", True, "float32"),
                                             ("silu_gate", True, "bfloat16"), ("silu_gate", False, "float16")])
def test_interpreted_backward_kernels_are_the_references(act, scale, dtype):
    """The epilogue's derivative (pre holding NaN, infinities and values past exp's range), the batch sum,
    the norm's derivative and the split norm's halves': the references' bits (`twin_grad.*_native`,
    `twin_norm.*_grad_native`) on any input."""
    from kernels_pallas import twin_grad as tg

    rng = np.random.default_rng(13)
    parts = 2 if act == "silu_gate" else 1
    dy = jnp.asarray(rng.standard_normal((3, 256)) * 3, dtype)
    pre = jnp.asarray(rng.standard_normal((3, parts * 256)) * 4, dtype)
    pre = pre.at[0, :4].set(jnp.asarray([np.nan, np.inf, -np.inf, -90.0], dtype))
    s = jnp.asarray(rng.standard_normal((2, 256)), dtype) if scale else None
    (dpre, ts), (want, want_ts) = (pgm.epilogue_grad(dy, pre, s, 1, act=act, interpret=True),
                                   tg.epilogue_grad_native(dy, pre, s, 1, act=act))
    assert_same(dpre, want, "dpre")
    if scale:
        assert_same(ts, want_ts, "ts")
        assert_same(pgm.batch_sum(ts, dtype, interpret=True), tg.batch_sum_native(ts, dtype), "batch_sum")
    kind = "layer" if act == "gelu" else "rms"  # Mimi's norm beside its MLP, Helium's beside its gate
    x, w = dy.astype(jnp.float32) * 2 + 1, jnp.asarray(rng.standard_normal((2, 256)), dtype)
    b = jnp.asarray(rng.standard_normal((2, 256)), dtype) if kind == "layer" else None
    for got, want, what in zip(pnm.norm_grad(x.astype(dtype), dy, w, b, 1, kind=kind, eps=1e-5, interpret=True),
                               pn.norm_grad_native(x.astype(dtype), dy, w, b, 1, kind=kind, eps=1e-5), ("dx", "tw")):
        assert_same(got, want, f"{kind} norm's {what}")
    dss = jnp.asarray(rng.standard_normal((3, 4)), jnp.float32)
    for got, want, what in zip(pnm.split_grad(x.astype(dtype), dy, dss, w, 1, dy=dy, interpret=True),
                               pn.split_grad_native(x.astype(dtype), dy, dss, w, 1, dy=dy), ("dx", "ta")):
        assert_same(got, want, f"split norm producer's {what}")
    ss = jnp.asarray(rng.random((3, 4)) * 5, jnp.float32)
    for got, want, what in zip(pnm.split_rms_grad(x.astype(dtype), dy, ss, eps=1e-8, interpret=True),
                               pn.split_rms_grad_native(x.astype(dtype), dy, ss, eps=1e-8), ("xn", "du", "dss")):
        assert_same(got, want, f"split norm consumer's {what}")


@interpreted
@pytest.mark.parametrize("B,H,T,D,C,dtype", [(2, 2, 2, 64, 16, "bfloat16"), (1, 2, 2, 64, 130, "float32"),
                                             (2, 1, 1, 128, 70, "bfloat16")])
def test_interpreted_attention_derivative_is_the_reference(B, H, T, D, C, dtype):
    """The attention's backward (the lane form): the reference's bits (`attention_bwd_native`) on random
    inputs, with masked slots holding NaN and Inf, a row that sees nothing (no gradient), a ring of one
    block of 16 slots (its tile's other rows padding), a block past the ring's end."""
    rng = np.random.default_rng(C)
    q = jnp.asarray(rng.standard_normal((B, H, T, D)), dtype)
    k, v = (rng.standard_normal((B, H, C, D)) for _ in range(2))
    k[:, :, 3], v[:, :, 3] = np.inf, np.nan
    k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
    positions = rng.integers(0, C, (B, C)).astype(np.int32)
    positions[:, 3] = -1
    positions[0] = -1
    q_pos = jnp.asarray(np.full((B, T), C, np.int32) + np.arange(T, dtype=np.int32))
    d_out = jnp.asarray(rng.standard_normal((B, T, H, D)), dtype)
    args = (d_out, q, k, v, jnp.asarray(positions), q_pos)
    got = jax.jit(lambda *a: pabm.attention_bwd(*a, context=C, interpret=True))(*args)
    for g, w, what in zip(got, pa.attention_bwd_native(*args, context=C), ("dq", "dk", "dv")):
        assert_same(g, w, what)
    assert not np.asarray(got[0], np.float32)[0].any()


@interpreted
@pytest.mark.parametrize("dtype,rope", [("bfloat16", True), ("float32", True), ("float32", False)])
def test_interpreted_rope_write_and_its_derivative_are_the_references(dtype, rope):
    """The lane form's ring write and its backward (the rotation by the elementwise kernel, the slots by
    XLA): the references' bits, a masked write leaving its slot, the written slots' cotangents zeroed."""
    from kernels_pallas import twin_rope as pr

    rng = np.random.default_rng(17)
    B, T, H, D, L, C = 2, 3, 2, 16, 2, 7
    qkv = jnp.asarray(rng.standard_normal((B, T, 3, H, D)), dtype)
    cos, sin = ((jnp.asarray(rng.standard_normal((B, T, D // 2)), jnp.float32) for _ in range(2)) if rope
                else (None, None))
    ring_k, ring_v = (jnp.asarray(rng.standard_normal((L, B, H, C, D)), dtype) for _ in range(2))
    at, written = jnp.asarray(rng.integers(0, C, (B, T)), jnp.int32), jnp.asarray([[True, False, True], [True] * 3])
    args = (cos, sin, ring_k, ring_v, 1, at, written)
    for got, want in zip(prm.rope_write(qkv, *args, interpret=True), pr.rope_write_native(qkv, *args)):
        assert_same(got, want, "rope_write")
    dq = jnp.asarray(rng.standard_normal((B, H, T, D)), dtype)
    for got, want in zip(prm.rope_write_bwd(dq, *args, interpret=True), pr.rope_write_bwd_native(dq, *args)):
        assert_same(got, want, "rope_write_bwd")


@interpreted
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_interpreted_codec_kernels_are_the_references(dtype):
    """The ELU (NaN, infinities, values past exp's range), the taps with the ELU, a carry, replicate
    padding and an inactive row, and the nearest entry (an exact match, a tie: the first entry, a row of
    NaN: entry 0): the references' bits on any input (the same operations in the same order)."""
    from kernels_pallas import twin_conv as tc

    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 5, 301)) * 20
    x[0, 0, :4] = [np.nan, np.inf, -np.inf, -100.0]
    x = jnp.asarray(x, dtype)
    assert_same(tcm.elu(x, interpret=True), tc.elu_native(x), "elu")
    carry = jnp.asarray(rng.standard_normal((2, 5, 6)), dtype)
    kw = {"kernel_size": 3, "stride": 2, "dilation": 2, "elu": True, "carry": carry,
          "active": jnp.array([True, False]), "first": jnp.array([True, True]), "replicate": True}
    for got, want in zip(tcm.taps(x[:2], interpret=True, **kw), tc.taps_native(x[:2], **kw)):
        assert_same(got, want, "taps")
    entries = jnp.asarray(rng.standard_normal((256, 256)), dtype)
    entries = entries.at[201].set(entries[200])
    rows = np.asarray(rng.standard_normal((5, 256)), np.float32)
    rows[1], rows[2], rows[3] = np.asarray(entries[77], np.float32), np.nan, np.asarray(entries[200], np.float32)
    rows = jnp.asarray(rows, dtype)
    got = tcm.nearest(rows, entries, split=128, interpret=True)
    assert_same(got, tc.nearest_native(rows, entries), "nearest")
    assert list(np.asarray(got)[1:4]) == [77, 0, 200]


@interpreted
def test_interpreted_ring_attention_on_the_mosaic_backend():
    """kernels="pallas"'s ring attention with PERSONAPLEX_PALLAS_BACKEND=mosaic_gpu and a 16-bit ring of
    64-dim heads: the twin attention's Mosaic kernel, within bf16 rounding of `ring_attention_native`, in
    the ring attention's layout; masked NaN slots reach nothing, a query that sees nothing gets 0."""
    from kernels_pallas import ring_attention as ra

    q, ring_k, ring_v, positions, q_pos = attention_case(2, 2, 2, 64, 250, seed=7, integers=False)
    q = jnp.swapaxes(q, 1, 2).reshape(2, 2, 2, 64)  # any [B, H, T, D]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(backend.VARIABLE, "mosaic_gpu")
        got = np.asarray(jax.jit(lambda *a: ra.ring_attention(*a, context=250))(q, ring_k, ring_v, jnp.int32(1),
                                                                             positions, q_pos), np.float32)
    clean = [r.at[:, :, :, 3].set(0) for r in (ring_k, ring_v)]  # the reference multiplies masked slots by 0
    want = np.asarray(ra.ring_attention_native(q, *clean, 1, positions, q_pos, context=250), np.float32)
    assert got.shape == want.shape == (2, 2, 2, 64) and np.isfinite(got).all() and not got[0].any()
    assert np.max(np.abs(got - want)) <= 2.0**-7 * np.max(np.abs(want))


# (dim, heads, head dim, ring slots, T, FFN: its activation and hidden): the shapes each stack's step calls
STACKS = {"temporal": (4096, 32, 128, 3000, 1, "silu_gate", 11264), "depformer": (1024, 16, 64, 16, 1, "silu_gate", 2816),
          "mimi": (512, 8, 64, 250, 2, "gelu", 2048)}


def stack_kernel_calls(stack, B):
    """(name, f, argument specs) of every Mosaic kernel call of a stack's step at B rows, compiled forms:
    the norms, the linears with each epilogue and either half of the split norm, the qkv kernel with and
    without its rotation, the attention, the RoPE tables."""
    dim, H, D, C, T, act, hidden = STACKS[stack]
    L, b16, i32, f32 = 2, jnp.bfloat16, jnp.int32, jnp.float32
    M, N = B * T, 2 * hidden if act == "silu_gate" else hidden
    n = TwinNorm("rms", None, None, 1e-8)
    ring, rows, w_in, ss = ((L, B, H, C, D), b16), ((M, dim), b16), ((L, 3 * H * D, dim), b16), ((M, dim // 64), f32)
    at = ((B, T), i32)
    return [
        ("norm", lambda x, w: pnm.norm(x, w, None, 1, eps=1e-8, interpret=False), rows, ((L, dim), b16)),
        ("split", lambda x, w: pnm.split(x, w, 1, interpret=False), rows, ((L, dim), b16)),
        (f"linear {act} after a norm",
         lambda x, w, nw: plm.linear(x, w, 1, act=act, norm=n._replace(weight=nw), interpret=False),
         rows, ((L, N, dim), b16), ((L, dim), b16)),
        ("linear scale residual", lambda x, w, s, r: plm.linear(x, w, 1, scale=s, residual=r, interpret=False),
         ((M, hidden), b16), ((L, dim, hidden), b16), ((L, dim), b16), rows),
        ("linear split", lambda x, w, a: plm.linear(x, w, 1, split=TwinSplit(a, 1), interpret=False),
         ((M, hidden), b16), ((L, dim, hidden), b16), ((L, dim), b16)),
        (f"linear {act} rms", lambda x, w, s: plm.linear(x, w, 1, act=act, rms=TwinRms(s, 1e-8), interpret=False),
         rows, ((L, N, dim), b16), ss),
        ("qkv rope", lambda x, w, c, s, k, v, i, m: plm.linear_rope_write(x, w, 1, c, s, k, v, i, m, interpret=False),
         rows, w_in, ((B, T, D // 2), f32), ((B, T, D // 2), f32), ring, ring, at, at),
        ("qkv rms", lambda x, w, s, k, v, i, m: plm.linear_rope_write(x, w, 1, None, None, k, v, i, m,
                                                                     rms=TwinRms(s, 1e-8), interpret=False),
         rows, w_in, ss, ring, ring, at, at),
        ("attention", lambda q, k, v, p, qp: pam.attention(q, k, v, 1, p, qp, context=C, interpret=False),
         ((B, H, T, D), b16), ring, ring, ((B, C), i32), at),
        ("tables", lambda o, f: prm.tables(o, T, f, interpret=False), ((B,), i32), ((D // 2,), f32)),
        (f"epilogue's derivative ({act})", lambda dy, p, s: pgm.epilogue_grad(dy, p, s, 1, act=act, interpret=False),
         ((M, hidden), b16), ((M, N), b16), ((L, hidden), b16)),
        ("batch sum", lambda t: pgm.batch_sum(t, b16, interpret=False), ((M, dim), f32)),
        ("norm's derivative", lambda x, dy, w: pnm.norm_grad(x, dy, w, None, 1, eps=1e-8, interpret=False), rows, rows,
         ((L, dim), b16)),
        ("split norm producer's derivative", lambda y, du, dss, w: pnm.split_grad(y, du, dss, w, 1, dy=du,
                                                                                 interpret=False),
         rows, rows, ((M, dim // 64), f32), ((L, dim), b16)),
        ("split norm consumer's derivative", lambda u, dxn, s: pnm.split_rms_grad(u, dxn, s, eps=1e-8, interpret=False),
         rows, rows, ss),
        ("linear, lane form (float32)", lambda x, w: pll.linear(x, w, act=act, interpret=False), ((M, dim), f32),
         ((N, dim), f32)),
        ("rope write, lane form (float32)", lambda x, c, s, k, v, i, m: prm.rope_write(x, c, s, k, v, 1, i, m,
                                                                                       interpret=False),
         ((B, T, 3, H, D), f32), ((B, T, D // 2), f32), ((B, T, D // 2), f32), ((L, B, H, C, D), f32),
         ((L, B, H, C, D), f32), at, at),
        ("attention's derivative", lambda do, q, k, v, p, qp: pabm.attention_bwd(do, q, k, v, p, qp, context=C,
                                                                                interpret=False),
         ((B, T, H, D), b16), ((B, H, T, D), b16), ((B, H, C, D), b16), ((B, H, C, D), b16), ((B, C), i32), at),
        ("rope write's derivative", lambda dq, c, s, k, v, i, m: prm.rope_write_bwd(dq, c, s, k, v, 1, i, m,
                                                                                    interpret=False),
         ((B, H, T, D), b16), ((B, T, D // 2), f32), ((B, T, D // 2), f32), ring, ring, at, at),
    ] + ([] if stack != "mimi" else [  # the codec's, around Mimi's transformers
        ("elu", lambda x: tcm.elu(x, interpret=False), ((B, 64, 1920), b16)),
        ("linear of 32 columns", lambda x, w: plm.linear(x, w, interpret=False), ((B * 1920, 192), b16), ((32, 192), b16)),
        ("linear over K 32", lambda x, w: plm.linear(x, w, interpret=False), ((B * 1920, 32), b16), ((64, 32), b16)),
        ("lane form over K 7", lambda x, w: pll.linear(x, w, interpret=False), ((B * 1920, 7), b16), ((64, 7), b16)),
        ("lane form to 1 column", lambda x, w: pll.linear(x, w, interpret=False), ((B * 1920, 192), b16), ((1, 192), b16)),
        ("nearest", lambda x, e: tcm.nearest(x, e, interpret=False), ((B, 256), b16), ((2048, 256), b16)),
    ])


@interpreted
@pytest.mark.parametrize("stack", sorted(STACKS))
def test_kernels_lower_for_cuda_at_the_stacks_shapes(stack):
    """Without a GPU, jax lowers each Mosaic kernel for CUDA as it does on one: Pallas's lowering to
    Mosaic GPU, its layout and transform inference, the TMA copies' checks (a tiled copy from a tensor
    whose rows are not a multiple of 8, as Mimi's 250-slot ring, fails here)."""
    for name, f, *specs in stack_kernel_calls(stack, 2):
        args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in specs]
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text, f"{stack}: {name} lowered without a Mosaic GPU kernel"


H200, NO_H200 = cuda_target.h200() if NEW_ENOUGH else (None, f"Mosaic GPU's kernels need jax >= {FLOOR}")
h200 = pytest.mark.skipif(H200 is None, reason=NO_H200)


@h200
@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("B", [1, 64])
def test_kernels_compile_for_the_h200(stack, B):
    """Compiled for a compile-only H200 (`tests.cuda_target`): Mosaic GPU's passes to PTX and ptxas for
    sm_90a, on any machine with jax's CUDA plugin. Nothing runs: the bits are the GPU tests'."""
    for name, f, *specs in stack_kernel_calls(stack, B):
        assert "mosaic_gpu" in cuda_target.compile_for_h200(f, *specs), f"{stack} B={B}: {name}"


@h200
@pytest.mark.parametrize("stack,kernels", [("temporal", "twin"), ("mimi", "twin"), ("depformer", "twin"),
                                           ("temporal", "pallas"), ("mimi", "pallas")])
def test_steps_compile_for_the_h200_on_mosaic_gpu_alone(stack, kernels, monkeypatch):
    """The whole step of each stack at its real size (the 7B temporal stack, Mimi, the depformer's frame of
    16 inner steps) on the twins, and the stacks' default GPU step (kernels="pallas"), with
    PERSONAPLEX_PALLAS_BACKEND=mosaic_gpu, compiled for the compile-only H200: no Pallas Triton lowering
    left (it needs a GPU present, and fails here)."""
    from jax_impl.depformer import depformer_frame
    from jax_impl.depformer_config import DepformerConfig, buffer_shapes

    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels' compiled forms, as on the GPU
    b16 = jnp.bfloat16
    if stack == "depformer":
        cfg = DepformerConfig()
        params = {k: (tuple(v), b16) for k, v in buffer_shapes(cfg).items()}
        text = cuda_target.compile_for_h200(lambda p, t, o: depformer_frame(cfg, p, t, o, kernels="twin"), params,
                                            ((1,), jnp.int32), ((1, 1, cfg.temporal_dim), b16))
    else:
        cfg, T = PRESETS[stack], 2 if stack == "mimi" else 1
        params = jax.eval_shape(lambda: jx.init_params(cfg, jax.random.key(0), dtype=b16))
        state = jax.eval_shape(lambda: jx.init_state(cfg, 1, b16))
        text = cuda_target.compile_for_h200(jx.step_fn(cfg, kernels=kernels), params, state, ((1, T, cfg.dim), b16))
    assert "mosaic_gpu" in text


@h200
def test_twin_step_gradient_compiles_for_the_h200_on_mosaic_gpu_alone(monkeypatch):
    """jax.grad through Mimi's twin step at its real size (bf16, B=1) with PERSONAPLEX_PALLAS_BACKEND=
    mosaic_gpu, compiled for the compile-only H200: the backward's kernels (the linears' and norms'
    derivatives, the attention's, the ring write's) with no Pallas Triton lowering left."""

    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg, b16 = PRESETS["mimi"], jnp.bfloat16
    step = jx.step_fn(cfg, kernels="twin")

    def loss(params, state, x):
        return jnp.sum(jax.tree.leaves(step(params, state, x)[0])[0].astype(jnp.float32))

    params = jax.eval_shape(lambda: jx.init_params(cfg, jax.random.key(0), dtype=b16))
    state = jax.eval_shape(lambda: jx.init_state(cfg, 1, b16))
    assert "mosaic_gpu" in cuda_target.compile_for_h200(jax.grad(loss), params, state, ((1, 2, cfg.dim), b16))


@h200
def test_speech_frame_compiles_for_the_h200_on_mosaic_gpu_alone(monkeypatch):
    """PersonaPlex's whole speech frame at its real size (bf16, B=1: the Mimi codec's twin encode, the LM
    frame of the 7B temporal stack, the depformer's 16 inner steps, the embeddings and the sampler, the
    codec's decode), PERSONAPLEX_PALLAS_BACKEND=mosaic_gpu, compiled for the compile-only H200: no Pallas
    Triton lowering left."""
    from jax_impl import codec
    from jax_impl.codec_config import decoder_plan, encoder_plan, plan_convs
    from jax_impl.depformer_config import buffer_shapes
    from jax_impl.frame_config import embedding_shapes
    from jax_impl.speech_frame import SpeechFrameParams, init_speech_frame_state, speech_frame_fn
    from jax_impl.speech_frame_config import SPEECH_PRESETS

    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg, b16 = SPEECH_PRESETS["personaplex"], jnp.bfloat16
    c = cfg.codec
    convs = {}
    for conv in plan_convs(encoder_plan(c)) + plan_convs(decoder_plan(c)):
        convs[conv.key + ".weight"] = (tuple(conv.weight_shape), b16)
        if conv.bias:
            convs[conv.key + ".bias"] = ((conv.out_channels,), b16)
    stack = jax.eval_shape(lambda: jx.init_params(c.transformer, jax.random.key(0), dtype=b16))
    d, k = c.dimension, c.codebook_dim
    codec_params = codec.CodecParams(convs, ((c.num_codebooks, c.codebook_size, k), b16), ((2, k, d, 1), b16),
                                     ((2, d, k, 1), b16), stack, stack)
    lm = {"temporal": jax.eval_shape(lambda: jx.init_params(cfg.lm.temporal, jax.random.key(0), dtype=b16)),
          "depformer": {name: (tuple(shape), b16) for name, shape in buffer_shapes(cfg.lm.depformer).items()},
          **{name: (tuple(shape), b16) for name, shape in embedding_shapes(cfg.lm).items()}}
    state = jax.eval_shape(lambda: init_speech_frame_state(cfg, 1, b16))
    text = cuda_target.compile_for_h200(speech_frame_fn(cfg, kernels="twin"), SpeechFrameParams(codec_params, lm),
                                        state, ((1, 1, cfg.frame_size), b16), ((1,), jnp.bool_), None)
    assert "mosaic_gpu" in text


@on_gpu
@pytest.mark.parametrize("B,H,T,D,C", [(1, 32, 1, 128, 3000), (4, 32, 1, 128, 3000), (64, 32, 1, 128, 3000),
                                       (1, 16, 1, 64, 16), (16, 16, 1, 64, 16), (1, 8, 2, 64, 250),
                                       (64, 8, 10, 64, 250)])
def test_gpu_attention_bits_are_the_triton_twins(B, H, T, D, C):
    """The Mosaic attention, the Pallas Triton-backend one and the torch twin: the same bits (the temporal
    ring, the depformer's and Mimi's), a row alone as among the others."""
    import torch

    from kernels_triton import twin_attention as ta
    from torch_bridge.dlpack import to_torch

    q, ring_k, ring_v, positions, q_pos = attention_case(B, H, T, D, C, seed=B, integers=False)
    out = pam.attention(q, ring_k, ring_v, 1, positions, q_pos, context=C)
    assert_same(out, pa.attention(q, ring_k, ring_v, 1, positions, q_pos, context=C), f"B={B} C={C}: Pallas Triton")
    t = ta.attention(*(to_torch(a) for a in (q, ring_k, ring_v)), 1, to_torch(positions), to_torch(q_pos), context=C)
    torch.cuda.synchronize()
    assert_same(out, t.cpu(), f"B={B} C={C}: torch twin")
    b = B - 1
    alone = pam.attention(q[b:], ring_k[:, b:], ring_v[:, b:], 1, positions[b:], q_pos[b:], context=C)
    assert_same(alone[0], out[b], "a row alone")


@on_gpu
@pytest.mark.parametrize("B,T,D", [(1, 1, 128), (64, 1, 128), (16, 10, 64)])
def test_gpu_rope_tables_are_the_triton_twins(B, T, D):
    """The Mosaic tables, the Pallas Triton-backend ones and the torch twin's: the same bits."""
    import torch

    from kernels_pallas import twin_rope as pr
    from kernels_triton import twin_rope as tr
    from torch_bridge.dlpack import to_torch

    offset = jnp.asarray(np.random.default_rng(B).integers(0, 100_000, B), jnp.int32)
    freqs = jnp.asarray(rope_freqs(D, 10000.0), jnp.float32)
    got = prm.tables(offset, T, freqs)
    for a, b, t, name in zip(got, pr.tables(offset, T, freqs), tr.tables(to_torch(offset), T, to_torch(freqs)),
                             ("cos", "sin")):
        torch.cuda.synchronize()
        assert_same(a, b, f"{name}: Pallas Triton backend")
        assert_same(a, t.cpu(), f"{name}: torch twin")


@interpreted
def test_interpreted_depformer_frame_on_the_mosaic_kernels(monkeypatch):
    """The JAX depformer's twin frame (Moshi's 8 inner steps, 8 weight sets) on the Mosaic GPU kernels,
    interpreted: its logits within a bf16 rounding of the frame on the Triton-backend twins."""
    from jax_impl.depformer import depformer_frame
    from jax_impl.depformer_config import DepformerConfig, buffer_shapes

    cfg = DepformerConfig(dim=128, num_layers=2, num_heads=2, hidden=128, dep_q=8, weight_sets=8, card=64,
                          text_card=64, temporal_dim=128)
    rng = np.random.default_rng(0)
    params = {k: jnp.asarray(rng.standard_normal(s) * (0.05 if len(s) > 1 else 1.0) + ("alpha" in k), jnp.bfloat16)
              for k, s in buffer_shapes(cfg).items()}
    text = jnp.asarray(rng.integers(0, cfg.text_card, 3), jnp.int32)
    out = jnp.asarray(rng.standard_normal((3, 1, cfg.temporal_dim)), jnp.bfloat16)
    logits = {}
    for name in ("triton", "mosaic_gpu"):
        monkeypatch.setenv(backend.VARIABLE, name)
        frame = jax.jit(lambda p, t, o: depformer_frame(cfg, p, t, o, kernels="twin", unroll=False))
        logits[name] = np.asarray(frame(params, text, out)[1])
    a, b = logits["triton"], logits["mosaic_gpu"]
    assert np.max(np.abs(a - b)) <= 2.0**-6 * np.max(np.abs(a))


def _gpu_cases():
    """(name, call) of the twins whose Mosaic kernels came with the lane form, the codec and the backward:
    call(rng) runs the public twin once (its backend read from the environment)."""
    from kernels_pallas import twin_conv as pc
    from kernels_pallas import twin_grad as pg
    from kernels_pallas import twin_rope as pr

    b16, f32 = jnp.bfloat16, jnp.float32

    def arrays(rng, *specs):
        return [jnp.asarray(rng.standard_normal(shape) * scale, dtype) for shape, dtype, scale in specs]

    def attention_grad(B, H, T, D, C):
        def call(rng):
            q, k, v, do = arrays(rng, ((B, H, T, D), b16, 1), ((B, H, C, D), b16, 1), ((B, H, C, D), b16, 1),
                                 ((B, T, H, D), b16, 1))
            positions = jnp.asarray(rng.integers(-1, C, (B, C)), jnp.int32)
            return pa.attention_bwd(do, q, k, v, positions, jnp.full((B, T), C, jnp.int32), context=C)
        return call

    return [
        ("lane form, float32 7B", lambda rng: pli.linear(*arrays(rng, ((4, 4096), f32, 1), ((4096, 4096), f32, 0.02)))),
        ("lane form, K 7", lambda rng: pli.linear(*arrays(rng, ((1920, 7), b16, 1), ((64, 7), b16, 0.3)))),
        ("lane form, one column", lambda rng: pli.linear(*arrays(rng, ((1920, 192), b16, 1), ((1, 192), b16, 0.1)))),
        ("narrow tiles, K 32", lambda rng: pli.linear(*arrays(rng, ((1920, 32), b16, 1), ((64, 32), b16, 0.2)))),
        ("elu", lambda rng: pc.elu(*arrays(rng, ((4, 64, 1920), b16, 4)))),
        ("nearest", lambda rng: pc.nearest(*arrays(rng, ((64, 256), b16, 1), ((2048, 256), b16, 1)))),
        ("epilogue's derivative", lambda rng: pg.epilogue_grad(
            *arrays(rng, ((64, 11264), b16, 1), ((64, 2 * 11264), b16, 3)), act="silu_gate")),
        ("batch sum", lambda rng: pg.batch_sum(*arrays(rng, ((64, 4096), f32, 1)), b16)),
        ("norm's derivative", lambda rng: pn.norm_grad(*arrays(rng, ((16, 4096), b16, 2), ((16, 4096), b16, 1),
                                                                ((4096,), b16, 1)), eps=1e-8)),
        ("split norm's derivatives", lambda rng: (
            pn.split_grad(*arrays(rng, ((16, 4096), b16, 1), ((16, 4096), b16, 1), ((16, 64), f32, 1),
                                  ((4096,), b16, 1))),
            pn.split_rms_grad(*arrays(rng, ((16, 4096), b16, 1), ((16, 4096), b16, 1)),
                              jnp.asarray(rng.random((16, 64)) * 50, f32), eps=1e-8))),
        ("attention's derivative, temporal", attention_grad(4, 32, 1, 128, 3000)),
        ("attention's derivative, Mimi", attention_grad(4, 8, 2, 64, 250)),
        ("attention's derivative, depformer", attention_grad(16, 16, 1, 64, 16)),
        ("rope write, lane form", lambda rng: pr.rope_write(
            *arrays(rng, ((4, 1, 3, 32, 128), f32, 1), ((4, 1, 64), f32, 1), ((4, 1, 64), f32, 1),
                    ((2, 4, 32, 3000, 128), f32, 1), ((2, 4, 32, 3000, 128), f32, 1)),
            1, jnp.asarray(rng.integers(0, 3000, (4, 1)), jnp.int32), jnp.ones((4, 1), bool))),
    ]


@on_gpu
@pytest.mark.parametrize("case", range(14))
def test_gpu_each_twin_has_its_bits_on_either_backend(case, monkeypatch):
    """Each twin run by its Mosaic GPU kernel and by its Triton-backend kernel from the same operands:
    the same bits (the lane form, the codec's kernels, the backward's kernels, at the stacks' sizes)."""
    name, call = _gpu_cases()[case]
    outs = {}
    for backend_name in ("triton", "mosaic_gpu"):
        monkeypatch.setenv(backend.VARIABLE, backend_name)
        outs[backend_name] = jax.tree.leaves(call(np.random.default_rng(case)))
    for a, b in zip(outs["triton"], outs["mosaic_gpu"], strict=True):
        assert_same(b, a, name)
