"""Batch-invariant linear layer (x @ w[layer].T) as a Triton kernel, with epilogues: the twin of
`kernels_pallas.twin_linear` (its docstring states the contract; same signature, same bits).

The plain reference is `kernels_pallas.twin_linear.linear_native` (jax.numpy): the tests hold
both kernels to it bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels_pallas.common import (
    TWIN_INTERPRET_MAX_BN,
    TWIN_TRITON_LINEAR_STAGES,
    check_twin_linear,
    twin_blocks,
)
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import interpreting

ACTS = (None, "silu_gate", "gelu")
_ACT_CODE = {None: 0, "silu_gate": 1, "gelu": 2}


@triton.jit
def _acc(x_ptr, w_ptr, m, m_ok, n, n_ok, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         BK: tl.constexpr, FUSED: tl.constexpr, STAGES: tl.constexpr, LOOP_TREE: tl.constexpr):
    """Lane sums over the K blocks, in order, then the tree over the BK lanes: [BM, BN] float32.

    FUSED (16-bit x and w): each product-then-add is one FMA, the same bits (twin_math). The
    loop is software-pipelined (`tl.range(num_stages=STAGES)`: asynchronous copies of the next
    STAGES - 1 blocks into shared memory): the kernel waits on memory latency, and this keeps
    loads in flight without holding them in registers. (A prefetch into registers, the Pallas
    twin's way, made every shape 1.5-3x slower with Triton 3.6 on an H200: RESULTS.md.)
    LOOP_TREE: the lanes' tree in `loop_tree_sum`'s form (the same bits), for the gated kernel,
    whose two trees in `tree_sum`'s form take 207 registers with Triton 3.6 (72 this way).
    """
    k = tl.arange(0, BK)
    acc = tl.zeros([BM, BN, BK], tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        xb = tl.load(x_ptr + m[:, None] * K + k0 + k[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        wb = tl.load(w_ptr + n[:, None] * K + k0 + k[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        if FUSED:
            acc = tl.fma(xb[:, None, :], wb[None, :, :], acc)
        else:
            acc = acc + xb[:, None, :] * wb[None, :, :]
    acc = tl.reshape(acc, [BM * BN, BK])
    if LOOP_TREE:
        return tl.reshape(tm.loop_tree_sum(acc, BM * BN, BK), [BM, BN])
    else:
        return tl.reshape(tm.tree_sum(acc, BM * BN, BK), [BM, BN])


@triton.jit
def _kernel(layer_ptr, x_ptr, w_ptr, scale_ptr, res_ptr, o_ptr, M,
            N: tl.constexpr, K: tl.constexpr, N_OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, ACT: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_RES: tl.constexpr,
            FUSED: tl.constexpr, STAGES: tl.constexpr, INTERPRETED: tl.constexpr):
    layer = tl.load(layer_ptr).to(tl.int64)
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_ok = m < M
    n_ok = n < N_OUT
    w_layer = w_ptr + layer * N * K
    dtype = o_ptr.dtype.element_ty
    if ACT == 1:  # silu_gate: columns n and n + N/2
        a = tm.to_dtype(_acc(x_ptr, w_layer, m, m_ok, n, n_ok, K, BM, BN, BK, FUSED, STAGES, ACT == 1), dtype, INTERPRETED).to(tl.float32)
        b = tm.to_dtype(_acc(x_ptr, w_layer, m, m_ok, n + N_OUT, n_ok, K, BM, BN, BK, FUSED, STAGES, ACT == 1), dtype,
                        INTERPRETED).to(tl.float32)
        y = tm.to_dtype(tm.to_dtype(tm.silu(a), dtype, INTERPRETED).to(tl.float32) * b, dtype, INTERPRETED)
    else:
        y = tm.to_dtype(_acc(x_ptr, w_layer, m, m_ok, n, n_ok, K, BM, BN, BK, FUSED, STAGES, ACT == 1), dtype, INTERPRETED)
        if ACT == 2:
            y = tm.to_dtype(tm.gelu(y.to(tl.float32)), dtype, INTERPRETED)
    if HAS_SCALE:
        s = tl.load(scale_ptr + layer * N_OUT + n, mask=n_ok, other=0.0).to(tl.float32)
        y = tm.to_dtype(s[None, :] * y.to(tl.float32), dtype, INTERPRETED)
    offs = m[:, None] * N_OUT + n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        r = tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        y = tm.to_dtype(r + y.to(tl.float32), dtype, INTERPRETED)
    tl.store(o_ptr + offs, y, mask=ok)


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
           num_stages: int = TWIN_TRITON_LINEAR_STAGES) -> torch.Tensor:
    """y = epilogue(x @ w[layer].T), batch-invariant; the signature and bits of the Pallas twin.

    x: [M, K]; w: [L, N, K] with layer an int or int tensor, or [N, K] with layer=None.
    block_m, block_n, num_warps, num_stages (of the pipelined loop over K): speed only, never the bits.
    """
    w, scale, layer = _stacked(w, scale, layer)
    M, K, N, N_out = check_twin_linear(x, w, act, ACTS, scale, residual)
    interpreted = interpreting(_kernel)
    if interpreted and block_n is None:  # one program per row block: the interpreter's cost is per program
        block_n = min(triton.next_power_of_2(N_out), TWIN_INTERPRET_MAX_BN)
    BM, BN, BK = twin_blocks(M, N_out, K, block_m, block_n, interpreted=interpreted, masked_n=interpreted,
                             gated=act == "silu_gate")
    for name, t in (("x", x), ("w", w), ("scale", scale), ("residual", residual)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"linear({name}): must be contiguous, got strides {t.stride()}")
    out = torch.empty((M, N_out), dtype=x.dtype, device=x.device)
    dummy = out  # never read when the flag is off
    _kernel[(triton.cdiv(M, BM), triton.cdiv(N_out, BN))](
        _layer_tensor(layer, w.shape[0], x.device), x, w, dummy if scale is None else scale,
        dummy if residual is None else residual, out, M, N=N, K=K, N_OUT=N_out, BM=BM, BN=BN, BK=BK,
        ACT=_ACT_CODE[act], HAS_SCALE=scale is not None, HAS_RES=residual is not None,
        FUSED=x.dtype in (torch.bfloat16, torch.float16), STAGES=num_stages, INTERPRETED=interpreted, num_warps=num_warps, enable_fp_fusion=False)
    return out
