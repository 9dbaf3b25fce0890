"""What would the temporal step's small projections gain with their weights already in the L2?

    python benchmarks/l2_resident_gpu.py --out $OUT/l2_resident.json [--batches 1,4]

At B <= 4 the attention uses half the copy rate (RESULTS.md, sixteenth session), and the out
projection's 33.5 MB of weights would fit in the H200's L2 beside it: a prefetch there would turn
the out projection's read into an L2 read. Before building that, this measures the bound: the
Pallas MMA linear's GPU time a call (`twin_split_gpu.device_us`: torch.profiler, device time) over
8 stacked layers in turn (each read from HBM, as in the step) against the same layer again and
again (its weights stay in the L2 after the first call), and a copy of the same bytes from each.
A timing question only. Never part of the tests.
"""

from __future__ import annotations

import argparse

import jax
import torch
from cuda_timing import run_meta
from twin_split_gpu import SHAPES, L, device_us, run_cases

from kernels_pallas import twin_linear as pli
from torch_bridge.dlpack import to_jax


def case(M: int, name: str) -> dict:
    N, K, act, has_res = SHAPES[name]
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    w = (torch.randn(L, N, K, device="cuda") * 0.02).to(torch.bfloat16)
    n_out = N // 2 if act == "silu_gate" else N
    r = torch.randn(M, n_out, device="cuda").to(torch.bfloat16) if has_res else None
    jx, jw, jr = to_jax(x), to_jax(w), None if r is None else to_jax(r)
    rec = {"M": M, "weight_MB": N * K * 2 / 1e6}
    for label, layers in (("hbm", range(L)), ("l2", [0] * L)):
        # traced layer indices: L calls of one layer would otherwise be one call to XLA (CSE)
        f = jax.jit(lambda x, w, r, ls: [pli.linear(x, w, ls[i], act=act, residual=r) for i in range(L)])
        ls = jax.numpy.asarray(list(layers), jax.numpy.int32)
        rec[f"linear_{label}_us"] = device_us(lambda f=f, ls=ls: jax.block_until_ready(f(jx, jw, jr, ls)), L)
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="l2_resident.json")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--shapes", default="out")
    args = parser.parse_args()
    meta = run_meta(layers=L, l2_MB=torch.cuda.get_device_properties(0).L2_cache_size / 1e6)
    run_cases({"meta": meta}, args.batches, args.shapes, case, args.out)


if __name__ == "__main__":
    main()
