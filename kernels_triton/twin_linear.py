"""Batch-invariant linear layer (x @ w[layer].T) as a Triton kernel, with epilogues: the twin of
`kernels_pallas.twin_linear` (its docstring states the contract; same signature, same bits).

The plain reference is `kernels_pallas.twin_linear.linear_native` (jax.numpy): the tests hold
both kernels to it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_pallas.common import TWIN_INTERPRET_MAX_BN, check_twin_linear, twin_blocks
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting

ACTS = (None, "silu_gate", "gelu")
_ACT_CODE = {None: 0, "silu_gate": 1, "gelu": 2}


@triton.jit
def _mac(acc, x_ptr, row, M, k, wb, K: tl.constexpr, FUSED: tl.constexpr):
    """acc [BN, BK] + x[row, k] * wb: the contract's product-then-add (FUSED: one fma, the same
    bits for 16-bit operands, whose product is exact in float32; see `kernels_pallas.twin_math`).

    k [BN, BK] (every row the same): x is loaded in the tile's own layout (an L1 hit per row)
    rather than as a vector that would need a shuffle through shared memory.
    """
    xr = tl.load(x_ptr + row * K + k, mask=(k * 0 + row) < M, other=0.0).to(tl.float32)
    if FUSED:
        return tl.fma(xr, wb, acc)
    else:
        return acc + xr * wb


@triton.jit
def _lanes(x_ptr, w_ptr, m0, M, n, n_ok, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
           BK: tl.constexpr, FUSED: tl.constexpr, UNROLL: tl.constexpr):
    """Rows m0 .. m0+BM of the contract's sums for columns n: lane sums over the K blocks in order,
    then the tree over the BK lanes. Returns four [BN] float32 rows (those past BM are zero).

    One [BN, BK] accumulator per row, in the layout the weight tile is loaded in: the tile is
    loaded and converted once and used by every row, with no register shuffles.
    """
    k = tl.arange(0, BK)[None, :]
    kk = k + n[:, None] * 0                                                    # [BN, BK]
    a0 = tl.zeros([BN, BK], tl.float32)
    a1 = tl.zeros([BN, BK], tl.float32)
    a2 = tl.zeros([BN, BK], tl.float32)
    a3 = tl.zeros([BN, BK], tl.float32)
    for k0 in tl.range(0, K, BK, loop_unroll_factor=UNROLL):
        wb = tl.load(w_ptr + n[:, None] * K + k0 + k, mask=n_ok[:, None], other=0.0).to(tl.float32)
        a0 = _mac(a0, x_ptr, m0, M, k0 + kk, wb, K, FUSED)
        if BM > 1:
            a1 = _mac(a1, x_ptr, m0 + 1, M, k0 + kk, wb, K, FUSED)
        if BM > 2:
            a2 = _mac(a2, x_ptr, m0 + 2, M, k0 + kk, wb, K, FUSED)
            a3 = _mac(a3, x_ptr, m0 + 3, M, k0 + kk, wb, K, FUSED)
    s0 = tm.tree_sum(a0, BN, BK)
    s1 = tl.zeros([BN], tl.float32)
    s2 = tl.zeros([BN], tl.float32)
    s3 = tl.zeros([BN], tl.float32)
    if BM > 1:
        s1 = tm.tree_sum(a1, BN, BK)
    if BM > 2:
        s2 = tm.tree_sum(a2, BN, BK)
        s3 = tm.tree_sum(a3, BN, BK)
    return s0, s1, s2, s3


@triton.jit
def _finish(a, b, row, M, n, n_ok, layer, scale_ptr, res_ptr, o_ptr, N_OUT: tl.constexpr, ACT: tl.constexpr,
            HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr, INTERPRETED: tl.constexpr):
    """The epilogue of one output row (a: its sums [BN]; b: the gate half's, for ACT=1) and its store."""
    dtype = o_ptr.dtype.element_ty
    if ACT == 1:  # silu_gate: columns n and n + N/2
        a = tm.to_dtype(a, dtype, INTERPRETED).to(tl.float32)
        b = tm.to_dtype(b, dtype, INTERPRETED).to(tl.float32)
        y = tm.to_dtype(tm.to_dtype(tm.silu(a), dtype, INTERPRETED).to(tl.float32) * b, dtype, INTERPRETED)
    else:
        y = tm.to_dtype(a, dtype, INTERPRETED)
        if ACT == 2:
            y = tm.to_dtype(tm.gelu(y.to(tl.float32)), dtype, INTERPRETED)
    if HAS_SCALE:
        s = tl.load(scale_ptr + layer * N_OUT + n, mask=n_ok, other=0.0).to(tl.float32)
        y = tm.to_dtype(s * y.to(tl.float32), dtype, INTERPRETED)
    ok = n_ok & ((n * 0 + row) < M)
    if HAS_RES:
        r = tl.load(res_ptr + row * N_OUT + n, mask=ok, other=0.0).to(tl.float32)
        y = tm.to_dtype(r + y.to(tl.float32), dtype, INTERPRETED)
    tl.store(o_ptr + row * N_OUT + n, y, mask=ok)


@triton.jit
def _kernel(layer_ptr, x_ptr, w_ptr, scale_ptr, res_ptr, o_ptr, M,
            N: tl.constexpr, K: tl.constexpr, N_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, ACT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr,
            FUSED: tl.constexpr, UNROLL: tl.constexpr, INTERPRETED: tl.constexpr):
    """Program (i, j): rows i*BM .. and columns j*BN .. of the output."""
    layer = tl.load(layer_ptr).to(tl.int64)
    m0 = tl.program_id(0) * BM
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_ok = n < N_OUT
    w_layer = w_ptr + layer * N * K
    a0, a1, a2, a3 = _lanes(x_ptr, w_layer, m0, M, n, n_ok, K, BM, BN, BK, FUSED, UNROLL)
    b0, b1, b2, b3 = a0, a1, a2, a3
    if ACT == 1:
        b0, b1, b2, b3 = _lanes(x_ptr, w_layer, m0, M, n + N_OUT, n_ok, K, BM, BN, BK, FUSED, UNROLL)
    _finish(a0, b0, m0, M, n, n_ok, layer, scale_ptr, res_ptr, o_ptr, N_OUT, ACT, HAS_SCALE, HAS_RES, INTERPRETED)
    if BM > 1:
        _finish(a1, b1, m0 + 1, M, n, n_ok, layer, scale_ptr, res_ptr, o_ptr, N_OUT, ACT, HAS_SCALE, HAS_RES,
                INTERPRETED)
    if BM > 2:
        _finish(a2, b2, m0 + 2, M, n, n_ok, layer, scale_ptr, res_ptr, o_ptr, N_OUT, ACT, HAS_SCALE, HAS_RES,
                INTERPRETED)
        _finish(a3, b3, m0 + 3, M, n, n_ok, layer, scale_ptr, res_ptr, o_ptr, N_OUT, ACT, HAS_SCALE, HAS_RES,
                INTERPRETED)


def _stacked(w, scale, layer):
    if layer is not None:
        return w, scale, layer
    if w.dim() != 2:
        raise ValueError(f"linear(w): with layer=None w must be [N, K], got shape {tuple(w.shape)}")
    return w[None], None if scale is None else scale[None], 0


_LAYER_TENSORS: dict = {}


def _layer_tensor(layer, L: int, device) -> torch.Tensor:
    """The layer index as a 1-element int32 device tensor (an int is range-checked here).

    An int's tensor is made once per (device, layer) and kept: no host-to-device copy per call,
    so the twin layers can be captured in a CUDA graph.
    """
    if isinstance(layer, torch.Tensor):
        return layer.reshape(1).to(device=device, dtype=torch.int32)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(f"linear(layer): expected an int in [0, {L}) or an int tensor, got {layer!r}")
    key = (torch.device(device), layer)
    if key not in _LAYER_TENSORS:
        _LAYER_TENSORS[key] = torch.tensor([layer], dtype=torch.int32, device=device)
    return _LAYER_TENSORS[key]


def linear(x: torch.Tensor, w: torch.Tensor, layer=None, *, act: str | None = None,
           scale: torch.Tensor | None = None, residual: torch.Tensor | None = None,
           block_m: int | None = None, block_n: int | None = None, num_warps: int = 4,
           num_stages: int = 2, unroll: int = 1) -> torch.Tensor:
    """y = epilogue(x @ w[layer].T), batch-invariant; the signature and bits of the Pallas twin.

    x: [M, K]; w: [L, N, K] with layer an int or int tensor, or [N, K] with layer=None.
    """
    w, scale, layer = _stacked(w, scale, layer)
    M, K, N, N_out = check_twin_linear(x, w, act, ACTS, scale, residual)
    interpreted = interpreting(_kernel)
    if interpreted and block_n is None:  # one program per row block: the interpreter's cost is per program
        block_n = min(triton.next_power_of_2(N_out), TWIN_INTERPRET_MAX_BN)
    BM, BN, BK = twin_blocks(M, N_out, K, block_m, block_n, interpreted=interpreted, masked_n=interpreted)
    for name, t in (("x", x), ("w", w), ("scale", scale), ("residual", residual)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"linear({name}): must be contiguous, got strides {t.stride()}")
    out = torch.empty((M, N_out), dtype=x.dtype, device=x.device)
    dummy = out  # never read when the flag is off
    _kernel[(triton.cdiv(M, BM), triton.cdiv(N_out, BN))](
        _layer_tensor(layer, w.shape[0], x.device), x, w, dummy if scale is None else scale,
        dummy if residual is None else residual, out, M, N=N, K=K, N_OUT=N_out, BM=BM, BN=BN, BK=BK,
        ACT=_ACT_CODE[act], HAS_SCALE=scale is not None, HAS_RES=residual is not None,
        FUSED=x.dtype in (torch.bfloat16, torch.float16), UNROLL=unroll, INTERPRETED=interpreted,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    return out
