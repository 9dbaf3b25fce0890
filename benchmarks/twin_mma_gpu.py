"""Can the twin linears use tensor cores? Pallas `dot` vs Triton `tl.dot`, bits and speed, one call.

    python benchmarks/twin_mma_gpu.py --out $OUT/twin_mma.json
    TRITON_INTERPRET=1 python benchmarks/twin_mma_gpu.py --small --out /tmp/twin_mma.json  # CPU smoke

The question (issue 10's trap list: "check tensor-core bits early on the card"): a GEMV kernel
written the same way in Pallas (lowered by XLA's bundled Triton) and in Triton 3.6 (torch's), each
program accumulating `acc[BN, 16] += w[layer, n-block, k-block] @ x[16 rows, k-block]^T` over the
K blocks in order (float32 accumulators, bf16 operands: the MMA's own summation), do both give the
same float32 bits? For each tile (BN, BK, warps, stages) and shape it records the bits of Pallas
vs Triton (Triton with `acc += dot` and with the accumulator passed into `dot`), whether a row's
bits depend on the other rows (row 0 alone vs among 15 others), the max relative error against a
float64 product, the PTX instruction Triton chose (wgmma / mma.sync), and us per call of each
next to today's CUDA-core twin linears (`kernels_pallas.twin_linear` / `kernels_triton.twin_linear`).
Never part of the tests.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp
import numpy as np
import torch
import triton
import triton.language as tl
from cuda_timing import run_meta
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from twin_tune_gpu import RESULTS, graph_ms, jax_ms, record, same

from kernels_pallas import twin_linear as pli
from kernels_triton import twin_linear as tli
from kernels_triton.twin_math import layer_tensor
from torch_bridge.dlpack import to_jax

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BMX = 16  # x rows per program: the MMA's n dimension (rows padded to it)


def _pallas_kernel(layer_ref, x_ref, w_ref, o_ref, *, K, BN, BK):
    layer = layer_ref[0]
    n0 = pl.program_id(0) * BN

    def body(kb, acc):
        w = w_ref[layer, pl.ds(n0, BN), pl.ds(kb * BK, BK)]                      # [BN, BK]
        x = x_ref[:, pl.ds(kb * BK, BK)]                                         # [BMX, BK]
        return acc + lax.dot_general(w, x, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, K // BK, body, jnp.zeros((BN, BMX), jnp.float32))
    o_ref[...] = acc.T


def pallas_mma(x, w, layer, *, BN, BK, warps, stages, interpret=False):
    """float32 [Mp, N] = x [Mp, K] @ w[layer].T (Mp a multiple of BMX), accumulators as returned."""
    Mp, K = x.shape
    N = w.shape[1]
    whole = pl.BlockSpec(w.shape, lambda j, i: (0, 0, 0))
    return pl.pallas_call(
        functools.partial(_pallas_kernel, K=K, BN=BN, BK=BK),
        out_shape=jax.ShapeDtypeStruct((Mp, N), jnp.float32),
        grid=(N // BN, Mp // BMX),
        in_specs=[pl.BlockSpec((1,), lambda j, i: (0,)), pl.BlockSpec((BMX, K), lambda j, i: (i, 0)), whole],
        out_specs=pl.BlockSpec((BMX, BN), lambda j, i: (i, j)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        name="twin_mma_probe",
    )(jnp.asarray(layer, jnp.int32).reshape(1), x, w)


@triton.jit
def _triton_kernel(layer_ptr, x_ptr, w_ptr, o_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   BM: tl.constexpr, STAGES: tl.constexpr, ACC_IN_DOT: tl.constexpr):
    layer = tl.load(layer_ptr).to(tl.int64)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    k = tl.arange(0, BK)
    wp = w_ptr + layer * N * K + n[:, None].to(tl.int64) * K + k[None, :]
    xp = x_ptr + m[:, None] * K + k[None, :]
    acc = tl.zeros((BN, BM), tl.float32)
    for kb in tl.range(0, K // BK, num_stages=STAGES):
        w = tl.load(wp + kb * BK)
        x = tl.load(xp + kb * BK)
        if ACC_IN_DOT:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc += tl.dot(w, tl.trans(x))
    tl.store(o_ptr + m[None, :] * N + n[:, None], acc)


def triton_mma(x, w, layer, *, BN, BK, warps, stages, acc_in_dot):
    Mp, K = x.shape
    N = w.shape[1]
    out = torch.empty(Mp, N, device=x.device, dtype=torch.float32)
    lt = layer_tensor(layer, w.shape[0], x.device, "triton_mma")  # cached: no host copy under graph capture
    kern = _triton_kernel[(N // BN, Mp // BMX)](lt, x, w, out, N, K=K, BN=BN, BK=BK, BM=BMX, STAGES=stages,
                                               ACC_IN_DOT=acc_in_dot, num_warps=warps)
    return out, kern


def instruction(kern) -> str | None:
    ptx = getattr(kern, "asm", {}).get("ptx") if kern is not None else None
    if not ptx:
        return None
    return ",".join(name for name in ("wgmma", "mma.sync", "fma.rn.f32") if name in ptx)


def probe(name, M, N, K, tiles, out, L):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    w = (torch.randn(L, N, K, generator=g, device=DEVICE) * 0.02).to(torch.bfloat16)
    x16 = torch.zeros(BMX, K, device=DEVICE, dtype=torch.bfloat16)
    x16[:M] = torch.randn(M, K, generator=g, device=DEVICE).to(torch.bfloat16)
    alone = torch.zeros_like(x16)
    alone[0] = x16[0]
    others = x16.clone()
    others[1:] = torch.randn(BMX - 1, K, generator=g, device=DEVICE).to(torch.bfloat16)  # row 0 kept
    exact = (x16[:M].double() @ w[L - 1].double().T)
    jw, jx, jalone, jothers = (to_jax(t) for t in (w, x16, alone, others))
    rows = []
    for BN, BK, warps, stages in tiles:
        cfg = {"BN": BN, "BK": BK, "warps": warps, "stages": stages}
        pm = functools.partial(pallas_mma, BN=BN, BK=BK, warps=warps, stages=stages, interpret=not GPU)
        tm = functools.partial(triton_mma, BN=BN, BK=BK, warps=warps, stages=stages)
        try:
            f1 = jax.jit(pm)
            yp = f1(jx, jw, L - 1)
            yt, kern = tm(x16, w, L - 1, acc_in_dot=False)
            yt2, kern2 = tm(x16, w, L - 1, acc_in_dot=True)
            ypa, ypo = f1(jalone, jw, L - 1), f1(jothers, jw, L - 1)
            yta, yto = (tm(t, w, L - 1, acc_in_dot=False)[0] for t in (alone, others))
            ytp = torch.tensor(np.asarray(yp), device=DEVICE)
            err = float(((ytp[:M].double() - exact).abs().max() / exact.abs().max()).item())
            row = {**cfg, "pallas_eq_triton": same(yp, yt), "pallas_eq_triton_acc_in_dot": same(yp, yt2),
                   "triton_eq_triton_acc_in_dot": same(yt, yt2),
                   "pallas_row0_invariant": same(np.asarray(ypa)[0], np.asarray(ypo)[0]),
                   "triton_row0_invariant": same(yta[0], yto[0]),
                   "max_rel_err_vs_f64": err, "triton_ptx": instruction(kern), "triton_ptx_acc_in_dot": instruction(kern2)}
            fn = jax.jit(lambda x, w, pm=pm: [pm(x, w, i % L) for i in range(2 * L)])
            row["pallas_us"] = 1e3 * jax_ms(fn, (jx, jw), 2 * L)
            for key, acc_in_dot in (("triton_us", False), ("triton_acc_in_dot_us", True)):
                row[key] = 1e3 * graph_ms(lambda i, tm=tm, a=acc_in_dot: tm(x16, w, i % L, acc_in_dot=a), 2 * L)
        except Exception as e:  # noqa: BLE001 (recorded: a tile a compiler refuses; the sweep goes on)
            row = {**cfg, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        rows.append(row)
        print(name, row, flush=True)
    # today's CUDA-core twins at their default tiles, same data (M rows)
    base = {}
    xm, jxm = x16[:M].contiguous(), to_jax(x16[:M].contiguous())
    fb = jax.jit(lambda x, w: [pli.linear(x, w, i % L) for i in range(2 * L)])
    base["pallas_cuda_core_us"] = 1e3 * jax_ms(fb, (jxm, jw), 2 * L)
    base["triton_cuda_core_us"] = 1e3 * graph_ms(lambda i: tli.linear(xm, w, i % L), 2 * L)
    record(name, {"M": M, "N": N, "K": K, "layers": L, "weight_bytes": N * K * 2, "tiles": rows, **base}, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="twin_mma.json")
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    RESULTS["meta"] = run_meta(triton=triton.__version__)
    if args.small:
        probe("small", 3, 64, 256, [(32, 64, 4, 2), (16, 128, 4, 3)], args.out, L=2)
        return
    tiles = [(16, 128, 4, 4), (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3),
             (64, 128, 4, 6), (32, 256, 4, 3)]
    for name, (M, N, K) in {"qkv_m4": (4, 12288, 4096), "down_m4": (4, 4096, 11264),
                            "qkv_m16": (16, 12288, 4096)}.items():
        probe(name, M, N, K, tiles, args.out, L=8)


if __name__ == "__main__":
    main()
