"""The twin RMSNorm / LayerNorm on Pallas's Mosaic GPU backend; its Triton-backend twin is
`twin_norm.norm`, its Triton twin `kernels_triton.twin_norm`, its plain reference `norm_native`.

Contract: `twin_norm`'s, unchanged, and written with the same functions (`twin_norm.row_stats`,
`twin_norm.normalize`): per row, the sums over D run in BK = `twin_lanes(D)` lanes, each adding
its D / BK blocks in order from +0, then the lanes' halving tree.

A program is one row and one warpgroup: thread l holds lane l of every block (a strided layout
of BK = 128 floats; the row and the weights arrive by TMA, [D / BK, BK] in shared memory). The
tree crosses threads, so it runs through shared memory (`_tree`): each level adds s[l + h] to
s[l] for the first h lanes, every thread adding one pair of a 128-wide window (the lanes past h
add values no later level reads), a warpgroup barrier between reads and writes. Every lane ends
with the row's sum, so the statistics are [BK] vectors of one value, and each block of the row
is normalized by its own threads.

Interpreted (CPU), the kernel runs in Mosaic GPU's interpreter (jax >= 0.11): the same sums in
the same order, so its bits are the reference's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import twin_math as tm
from kernels_pallas.contract.linear import (
    MOSAIC_ROWS,
    MOSAIC_TREE_LANES,
    check_mosaic_interpreter,
    mosaic_padded_rows,
)
from kernels_pallas.contract.norm import TWIN_SPLIT_GROUP, check_norm_grad, check_twin_norm
from kernels_pallas.contract.numerics import twin_lanes
from kernels_pallas.elementwise_mgpu import LANES, lane_setup
from kernels_pallas.twin_norm import (
    _bias_operand,
    _rms_r,
    _stacked,
    check_split_grad,
    check_split_rms_grad,
    norm_grad_native,
    norm_grad_rows,
    norm_native,
    normalize,
    row_stats,
    split_grad_math,
    split_grad_native,
    split_native,
    split_rms_grad_native,
    split_rms_grad_rows,
)

# the plain references: the Triton-backend module's
__all__ = ["norm", "norm_grad", "norm_grad_native", "norm_native", "split", "split_grad", "split_grad_native",
           "split_native", "split_rms_grad", "split_rms_grad_native"]



def norm(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, layer=None, *, kind: str = "rms",
         eps: float, interpret: bool | None = None) -> jax.Array:
    """`twin_norm.norm`'s norm of each row of x [M, D] (module docstring): weight, bias [L, D] at
    `layer` (int or traced int32 scalar), or [D] with layer=None; bias only for kind="layer"; D a
    multiple of 128. Returns x's shape and dtype. interpret: None runs compiled on a GPU backend,
    interpreted elsewhere (jax >= 0.11)."""
    weight, bias, layer = _stacked(weight, bias, layer)
    M, D = check_twin_norm(x, weight, bias, kind)
    if twin_lanes(D) != LANES:
        raise ValueError(f"norm(x): the Mosaic GPU norm needs D a multiple of {LANES} (a lane a thread), "
                         f"got D={D}")
    interpret, lanes, gpu = lane_setup("norm", interpret)
    nkb = D // LANES
    kernel = functools.partial(_kernel, D=D, kind=kind, eps=eps, lanes=lanes, gpu=gpu)
    call = plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((M, nkb, LANES), x.dtype), grid=(M,),
                        grid_names=("row",), interpret=plgpu.InterpretGPUParams() if interpret else None,
                        kernel_name=f"twin_{kind}_norm_mgpu")
    blocks = (lambda a: a.reshape(*a.shape[:-1], nkb, LANES))  # [.., D] -> [.., D / BK, BK]: the same buffer
    y = call(jnp.asarray(layer, jnp.int32).reshape(1), blocks(x), blocks(weight), blocks(_bias_operand(weight, bias)))
    return y.reshape(M, D)


def _kernel(layer_gmem, x_gmem, w_gmem, b_gmem, o_gmem, *, D, kind, eps, lanes, gpu):
    """Program r: row r of x [M, D / BK, BK] normalized into o (module docstring)."""
    tm.overlap_launches(gpu)
    r = lax.axis_index("row")
    layer = layer_gmem[0]
    nkb = D // LANES
    dtype = o_gmem.dtype

    def scoped(x_smem, w_smem, b_smem, o_smem, tree_smem, bars):
        sources = ((x_gmem.at[r], x_smem), (w_gmem.at[layer], w_smem)) + (
            ((b_gmem.at[layer], b_smem),) if kind == "layer" else ())
        for i, (src, dst) in enumerate(sources):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        for i in range(len(sources)):
            plgpu.barrier_wait(bars.at[i])

        def block(ref, kb):
            return plgpu.load(ref.at[kb], layout=lanes).astype(tm.F32)

        stats = row_stats(functools.partial(block, x_smem), D, LANES, kind, eps, gpu, unroll=nkb,
                          tree=functools.partial(_tree, tree_smem, lanes))
        for kb in range(nkb):
            b = block(b_smem, kb) if kind == "layer" else None
            y = normalize(block(x_smem, kb), block(w_smem, kb), b, stats, kind, gpu)
            o_smem[kb] = tm.to_dtype(y, dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[r])
        plgpu.wait_smem_to_gmem(0)

    row = plgpu.SMEM((nkb, LANES), dtype)
    weights = plgpu.SMEM((nkb, LANES), w_gmem.dtype)
    pl.run_scoped(scoped, row, weights, plgpu.SMEM((nkb, LANES), b_gmem.dtype), row,
                  plgpu.SMEM((2 * LANES,), tm.F32), plgpu.Barrier(num_arrivals=1, num_barriers=3))


def norm_grad(x: jax.Array, dy: jax.Array, weight: jax.Array, bias: jax.Array | None = None, layer=None, *,
              kind: str = "rms", eps: float, interpret: bool | None = None):
    """`twin_norm.norm_grad` (`contract.grad`; the same arguments, results and bits): x, dy [M, D] in one
    dtype, D a multiple of 128; weight [L, D] at `layer` (the bias is not read). Returns (dx [M, D] in x's
    dtype, tw float32 [M, D]). A program is a row, as the forward's (`twin_norm.norm_grad_rows` with its
    sums' tree through shared memory)."""
    if layer is None:
        weight, bias, layer = weight[None], None if bias is None else bias[None], 0
    M, D = check_norm_grad(x, dy, weight, bias, kind, eps)
    if twin_lanes(D) != LANES:
        raise ValueError(f"norm_grad(x): the Mosaic GPU kernel needs D a multiple of {LANES}, got D={D}")
    interpret, lanes, gpu = lane_setup("norm_grad", interpret)
    nkb = D // LANES
    call = plgpu.kernel(
        functools.partial(_grad_kernel, D=D, kind=kind, eps=eps, lanes=lanes, gpu=gpu),
        out_type=(jax.ShapeDtypeStruct((M, nkb, LANES), x.dtype), jax.ShapeDtypeStruct((M, nkb, LANES), tm.F32)),
        grid=(M,), grid_names=("row",), interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=f"twin_{kind}_norm_grad_mgpu")
    blocks = (lambda a: a.reshape(*a.shape[:-1], nkb, LANES))
    dx, tw = call(jnp.asarray(layer, jnp.int32).reshape(1), blocks(x), blocks(dy), blocks(weight))
    return dx.reshape(M, D), tw.reshape(M, D)


def _grad_kernel(layer_gmem, x_gmem, dy_gmem, w_gmem, dx_gmem, tw_gmem, *, D, kind, eps, lanes, gpu):
    """Program r: the derivative of row r (x, dy [M, D / BK, BK]) into dx and tw."""
    tm.overlap_launches(gpu)
    r = lax.axis_index("row")
    nkb = D // LANES

    def scoped(x_smem, dy_smem, w_smem, dx_smem, tw_smem, tree_smem, bars):
        for i, (src, dst) in enumerate(((x_gmem.at[r], x_smem), (dy_gmem.at[r], dy_smem),
                                        (w_gmem.at[layer_gmem[0]], w_smem))):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        for i in range(3):
            plgpu.barrier_wait(bars.at[i])

        def block(ref, kb):
            return plgpu.load(ref.at[kb], layout=lanes).astype(tm.F32)

        dx, tw = norm_grad_rows(functools.partial(block, x_smem), functools.partial(block, dy_smem),
                                functools.partial(block, w_smem), D, LANES, kind, eps, gpu, unroll=nkb,
                                tree=functools.partial(_tree, tree_smem, lanes))
        for kb in range(nkb):
            dx_smem[kb] = tm.to_dtype(dx(kb), dx_gmem.dtype)
            tw_smem[kb] = tw(kb)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dx_smem, dx_gmem.at[r])
        plgpu.copy_smem_to_gmem(tw_smem, tw_gmem.at[r])
        plgpu.wait_smem_to_gmem(0)

    row = plgpu.SMEM((nkb, LANES), x_gmem.dtype)
    pl.run_scoped(scoped, row, row, plgpu.SMEM((nkb, LANES), w_gmem.dtype), row, plgpu.SMEM((nkb, LANES), tm.F32),
                  plgpu.SMEM((2 * LANES,), tm.F32), plgpu.Barrier(num_arrivals=1, num_barriers=3))


def split_grad(y: jax.Array, du: jax.Array, dss: jax.Array, weight: jax.Array, layer=None, *,
               dy: jax.Array | None = None, interpret: bool | None = None):
    """`twin_norm.split_grad` (the split norm producer's derivative; the same arguments, results and bits):
    N a multiple of 128. A program is a row and 128 columns (two groups), a lane a thread."""
    if layer is None:
        weight, layer = weight[None], 0
    M, N = check_split_grad(y, du, dss, weight, dy)
    if N % LANES:
        raise ValueError(f"split_grad(y): the Mosaic GPU kernel needs N a multiple of {LANES}, got N={N}")
    interpret, lanes, gpu = lane_setup("split_grad", interpret)
    call = plgpu.kernel(
        functools.partial(_split_grad_kernel, has_dy=dy is not None, lanes=lanes,
                          gpu=gpu),
        out_type=(jax.ShapeDtypeStruct((M, N), y.dtype), jax.ShapeDtypeStruct((M, N), tm.F32)), grid=(M, N // LANES),
        grid_names=("m", "n"), interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="twin_rms_split_grad_mgpu")
    return call(jnp.asarray(layer, jnp.int32).reshape(1), y, du, dss, weight, *([] if dy is None else [dy]))


def _split_grad_kernel(layer_gmem, y_gmem, du_gmem, dss_gmem, w_gmem, *refs, has_dy, lanes, gpu):
    """Program (m, j): row m, columns j*128.. (the groups 2j and 2j + 1)."""
    tm.overlap_launches(gpu)
    dy_gmem, dx_gmem, ta_gmem = refs if has_dy else (None, *refs)
    m, j = lax.axis_index("m"), lax.axis_index("n")
    cols = pl.ds(j * LANES, LANES)

    def load(ref, *at):
        return plgpu.load(ref.at[at], layout=lanes).astype(tm.F32)

    def scoped(dx_smem, ta_smem):
        first = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (LANES,), 0), lanes) < TWIN_SPLIT_GROUP
        groups = LANES // TWIN_SPLIT_GROUP
        dss = jnp.where(first, dss_gmem[m, groups * j], dss_gmem[m, groups * j + 1])
        dx, ta = split_grad_math(load(y_gmem, m, cols), load(du_gmem, m, cols), dss,
                                 load(w_gmem, layer_gmem[0], cols), None if dy_gmem is None else load(dy_gmem, m, cols),
                                 gpu)
        dx_smem[...] = tm.to_dtype(dx, dx_gmem.dtype)
        ta_smem[...] = ta
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dx_smem, dx_gmem.at[m, cols])
        plgpu.copy_smem_to_gmem(ta_smem, ta_gmem.at[m, cols])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scoped, plgpu.SMEM((LANES,), dx_gmem.dtype), plgpu.SMEM((LANES,), tm.F32))


def split_rms_grad(u: jax.Array, dxn: jax.Array, ss: jax.Array, *, eps: float, interpret: bool | None = None):
    """`twin_norm.split_rms_grad` (the split norm consumer's derivative; the same arguments, results and
    bits): K a multiple of 128, at most 128 groups. A program is a row, as the norm's; ss's groups arrive
    as lanes, the lanes past them -0.0 (x + -0.0 is x: the tree over 128 lanes gives the groups' tree)."""
    M, K = check_split_rms_grad(u, dxn, ss)
    G = K // TWIN_SPLIT_GROUP
    if K % LANES or G > LANES:
        raise ValueError(f"split_rms_grad(u): the Mosaic GPU kernel needs K a multiple of {LANES} of at most "
                         f"{LANES} groups, got K={K}")
    interpret, lanes, gpu = lane_setup("split_rms_grad", interpret)
    nkb = K // LANES
    call = plgpu.kernel(
        functools.partial(_split_rms_grad_kernel, K=K, eps=eps, lanes=lanes, gpu=gpu),
        out_type=(jax.ShapeDtypeStruct((M, nkb, LANES), u.dtype), jax.ShapeDtypeStruct((M, nkb, LANES), u.dtype),
                  jax.ShapeDtypeStruct((M, LANES), tm.F32)),
        grid=(M,), grid_names=("row",), interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name="twin_rms_split_rms_grad_mgpu")
    groups = jnp.pad(ss, ((0, 0), (0, LANES - G)), constant_values=-0.0)
    xn, du, dss = call(u.reshape(M, nkb, LANES), dxn.reshape(M, nkb, LANES), groups)
    return xn.reshape(M, K), du.reshape(M, K), dss[:, :G]


def _split_rms_grad_kernel(u_gmem, dxn_gmem, ss_gmem, xn_gmem, du_gmem, dss_gmem, *, K, eps, lanes, gpu):
    """Program r: row r's derivative (u, dxn [M, K / 128, 128]; ss's groups as 128 lanes)."""
    tm.overlap_launches(gpu)
    r = lax.axis_index("row")
    nkb = K // LANES

    def scoped(u_smem, dxn_smem, xn_smem, du_smem, dss_smem, tree_smem, bars):
        for i, (src, dst) in enumerate(((u_gmem.at[r], u_smem), (dxn_gmem.at[r], dxn_smem))):
            plgpu.copy_gmem_to_smem(src, dst, bars.at[i])
        ss = plgpu.load(ss_gmem.at[r], layout=lanes)
        for i in range(2):
            plgpu.barrier_wait(bars.at[i])

        def block(ref, kb):
            return plgpu.load(ref.at[kb], layout=lanes).astype(tm.F32)

        xn, du, dss = split_rms_grad_rows(functools.partial(block, u_smem), functools.partial(block, dxn_smem), ss,
                                          K, LANES, eps, gpu, unroll=nkb, tree=functools.partial(_tree, tree_smem, lanes))
        for kb in range(nkb):
            xn_smem[kb] = tm.to_dtype(xn(kb), xn_gmem.dtype)
            du_smem[kb] = tm.to_dtype(du(kb), du_gmem.dtype)
        dss_smem[...] = dss
        plgpu.commit_smem()
        for src, dst in ((xn_smem, xn_gmem.at[r]), (du_smem, du_gmem.at[r]), (dss_smem, dss_gmem.at[r])):
            plgpu.copy_smem_to_gmem(src, dst)
        plgpu.wait_smem_to_gmem(0)

    row = plgpu.SMEM((nkb, LANES), u_gmem.dtype)
    pl.run_scoped(scoped, row, row, row, row, plgpu.SMEM((LANES,), tm.F32), plgpu.SMEM((2 * LANES,), tm.F32),
                  plgpu.Barrier(num_arrivals=1, num_barriers=2))


def _tree(s_smem, lanes, acc):
    """`tm.tree_sum` of the lanes acc [BK] (one a thread), through s_smem [2 BK] (module docstring);
    returns [BK], every lane the sum."""
    zeros = plgpu.layout_cast(jnp.zeros((LANES,), tm.F32), lanes)
    s_smem[pl.ds(LANES, LANES)] = zeros  # what the first level's window reads past the lanes
    s_smem[pl.ds(0, LANES)] = acc
    plgpu.commit_smem()
    h = LANES // 2
    while h >= 1:
        a = plgpu.load(s_smem.at[pl.ds(0, LANES)], layout=lanes)
        b = plgpu.load(s_smem.at[pl.ds(h, LANES)], layout=lanes)
        plgpu.commit_smem()  # every thread has read before any writes
        s_smem[pl.ds(0, LANES)] = a + b
        plgpu.commit_smem()
        h //= 2
    return plgpu.layout_cast(jnp.broadcast_to(s_smem[0], (LANES,)), lanes)


# ------------------------------------------------------------------------------- the split RMSNorm
# (`contract.norm.TwinSplit`) on Mosaic GPU: its row sums over the wgmma accumulator's layout, where a
# row's columns are spread over four threads.
WGMMA = plgpu.Layout.WGMMA


def lanes_tree(values, scratch, axis: int = 1):
    """`tm.tree_sum` of values [64, W] (float32, the wgmma layout) along `axis`, in every lane.

    axis 1 (each row's W = 8 * 2**k columns; returns [64, 8]): the levels above 8 columns add column
    halves in registers (each thread holds both halves' columns); axis 0 (each column's 64 rows; returns
    [64, W]): the wgmma layout holds rows 64 at a time, so no level stays in registers. The levels that
    cross threads go through scratch, the values twice along `axis` ([64, 16] or [128, W] float32): the
    window at offset h reads lane (c + h) mod n, so every lane adds its partner, the one below it or
    above it (a + b and b + a: the same bits), and ends with the tree's sum."""
    while axis == 1 and values.shape[1] > MOSAIC_TREE_LANES:
        h = values.shape[1] // 2
        values = values[:, :h] + values[:, h:]
    h = values.shape[axis] // 2
    while h:
        scratch[...] = jnp.concatenate([values, values], axis=axis)
        plgpu.commit_smem()
        window = scratch.at[:, pl.ds(h, values.shape[1])] if axis == 1 else scratch.at[pl.ds(h, values.shape[0])]
        partner = plgpu.load(window, layout=WGMMA, optimized=False)
        plgpu.commit_smem()  # every thread has read before the next level writes
        values = values + partner
        h //= 2
    return values


def split_halves(yf, alpha, dtype, gpu, scratch):
    """The producer's half of the split RMSNorm of the rows yf [64, G] (float32, the wgmma layout; G =
    TWIN_SPLIT_GROUP columns): (u = to_dtype(yf * alpha) [64, G], ss [64, 8], every lane its row's
    partial sum of squares). alpha: its row of the weight, broadcast to [64, G]."""
    return tm.to_dtype(tm.mul(yf, alpha, gpu), dtype), lanes_tree(tm.mul(yf, yf, gpu), scratch)


def store_column(ss, column, ss_gmem, m0, group, M):
    """ss [64, 8] (the lanes equal) into ss_gmem[m0 + r, group] for the rows m0 + r < M, through
    column [64, 8] float32 (shared memory): a 4-byte column is no TMA box, so each row is a scalar
    store."""
    column[...] = ss
    plgpu.commit_smem()

    @pl.loop(0, column.shape[0])
    def _(r):
        @pl.when(m0 + r < M)
        def _():
            ss_gmem[m0 + r, group] = column[r, 0]


def split_scale(ss_smem, K, eps, gpu, scratch):
    """The consumer's half: r [64, 8] (the lanes equal) of the rows whose partial sums ss_smem [64, K / G]
    holds (float32, shared memory, the rows past M zeros): 1 / sqrt(eps + tree_sum(ss) / K)."""
    ss = plgpu.load(ss_smem, layout=WGMMA, optimized=False)
    return _rms_r(lanes_tree(ss, scratch), K, eps, gpu)


def split(x: jax.Array, weight: jax.Array, layer=None, *, interpret: bool | None = None):
    """`twin_norm.split` (the producer's half of the split RMSNorm of x [M, D] itself): (u [M, D] in x's
    dtype, ss float32 [M, D / TWIN_SPLIT_GROUP]); weight: alpha [L, D] at `layer` (int or traced), or [D]
    with layer=None. A program is 64 rows of one group of columns (`split_halves`, `store_column`)."""
    weight, _, layer = _stacked(weight, None, layer)
    M, D = check_twin_norm(x, weight, None, "rms")
    groups = D // TWIN_SPLIT_GROUP
    if D % TWIN_SPLIT_GROUP:
        raise ValueError(f"split(x): D={D} must be a multiple of {TWIN_SPLIT_GROUP}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    check_mosaic_interpreter("split", interpret, jax.__version_info__)
    kernel = functools.partial(_split_kernel, M=M, gpu=False if interpret else tm.Mosaic(WGMMA))
    Mp = mosaic_padded_rows(M)
    call = plgpu.kernel(kernel, out_type=(jax.ShapeDtypeStruct((Mp, D), x.dtype),
                                          jax.ShapeDtypeStruct((M, groups), tm.F32)),
                        grid=(-(-Mp // MOSAIC_ROWS), groups), grid_names=("m", "g"),
                        interpret=plgpu.InterpretGPUParams() if interpret else None, kernel_name="twin_rms_split_mgpu")
    u, ss = call(jnp.asarray(layer, jnp.int32).reshape(1), jnp.pad(x, ((0, Mp - M), (0, 0))), weight)
    return (u if Mp == M else u[:M]), ss


def _split_kernel(layer_gmem, x_gmem, w_gmem, u_gmem, ss_gmem, *, M, gpu):
    """Program (i, g): rows i*64.., the columns of group g (`split`)."""
    tm.overlap_launches(gpu)
    i, g = lax.axis_index("m"), lax.axis_index("g")
    rows, cols = pl.ds(i * MOSAIC_ROWS, MOSAIC_ROWS), pl.ds(g * TWIN_SPLIT_GROUP, TWIN_SPLIT_GROUP)
    dtype = x_gmem.dtype

    def scoped(x_smem, u_smem, scratch, column, bar):
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem, bar)  # the rows past M: zeros
        alpha = plgpu.load(w_gmem.at[layer_gmem[0], cols], layout=WGMMA.reduce(0), optimized=False)
        plgpu.barrier_wait(bar)
        yf = plgpu.load(x_smem, layout=WGMMA, optimized=False).astype(tm.F32)
        u, ss = split_halves(yf, jnp.broadcast_to(alpha.astype(tm.F32)[None, :], yf.shape), dtype, gpu, scratch)
        u_smem[...] = u
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(u_smem, u_gmem.at[rows, cols])
        store_column(ss, column, ss_gmem, i * MOSAIC_ROWS, g, M)
        plgpu.wait_smem_to_gmem(0)

    tile = plgpu.SMEM((MOSAIC_ROWS, TWIN_SPLIT_GROUP), dtype)
    pl.run_scoped(scoped, tile, tile, plgpu.SMEM((MOSAIC_ROWS, 2 * MOSAIC_TREE_LANES), tm.F32),
                  plgpu.SMEM((MOSAIC_ROWS, MOSAIC_TREE_LANES), tm.F32), plgpu.Barrier(num_arrivals=1))

