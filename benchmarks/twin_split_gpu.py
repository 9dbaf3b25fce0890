"""Would the twin MMA linears reach XLA's gemm speed at the step's shapes with more programs?

    python benchmarks/twin_split_gpu.py --out $OUT/twin_split.json [--batches 4,16]

For each temporal projection (qkv, gate, out, down) at M rows: the GPU time of one call (torch.profiler,
device time, median over L stacked layers read from HBM) of
  - XLA's own gemm (`x @ w[layer].T`, the `kernels="auto"` path's fusion);
  - the twin MMA kernel, Pallas and Triton, at block_n 32 / 64, block_m (rows a program: 16 / 32 / 64)
    and "split" P = 1 / 2 / 4: the kernel on weights [L, P*N, K/P] (the bytes and programs of a split-K
    over P parts, without the combine).
A timing question only: the split shapes' outputs are not the projection's. Never part of the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import torch
from cuda_timing import run_meta
from torch.profiler import ProfilerActivity, profile

from kernels_pallas import twin_linear as pli
from kernels_triton import twin_linear as tli
from torch_bridge.dlpack import to_jax

L = 8
SHAPES = {"qkv": (12288, 4096, None, False), "gate": (22528, 4096, "silu_gate", False),
          "out": (4096, 4096, None, True), "down": (4096, 11264, None, True)}


def device_us(run, calls: int) -> float:
    """GPU time per call (us) of run(), which makes `calls` calls: all kernels' device time / calls,
    median of 5 profiled runs after 2 warm-ups."""
    for _ in range(2):
        run()
    torch.cuda.synchronize()
    totals = []
    for _ in range(5):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        totals.append(sum(e.device_time_total for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA) / calls)
    return statistics.median(totals)


def case(M, name, bns, splits, rows):
    N, K, act, has_res = SHAPES[name]
    rec = {"M": M, "N": N, "K": K, "weight_bytes": N * K * 2}
    x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
    w = (torch.randn(L, N, K, device="cuda") * 0.02).to(torch.bfloat16)
    jx, jw = to_jax(x), to_jax(w)
    xla = jax.jit(lambda x, w: [x @ w[i].T for i in range(L)])
    rec["xla_us"] = device_us(lambda: jax.block_until_ready(xla(jx, jw)), L)
    for P in splits:
        n_out = (N * P) // 2 if act == "silu_gate" else N * P
        wp = (torch.randn(L, N * P, K // P, device="cuda") * 0.02).to(torch.bfloat16)
        xp = x[:, : K // P].contiguous()
        r = torch.randn(M, n_out, device="cuda").to(torch.bfloat16) if has_res else None
        jxp, jwp, jr = to_jax(xp), to_jax(wp), None if r is None else to_jax(r)
        for bn, R in ((bn, R) for bn in bns for R in rows):
            key = f"P{P}_bn{bn}_r{R}"
            try:
                fp = jax.jit(lambda x, w, r, bn=bn, R=R: [pli.linear(x, w, i, act=act, residual=r, block_n=bn,
                                                                     block_m=R) for i in range(L)])
                args = (jxp, jwp, jr)
                rec[f"pallas_{key}_us"] = device_us(lambda fp=fp, args=args: jax.block_until_ready(fp(*args)), L)
                rec[f"triton_{key}_us"] = device_us(
                    lambda bn=bn, R=R, xp=xp, wp=wp, r=r: [tli.linear(xp, wp, i, act=act, residual=r, block_n=bn,
                                                                      block_m=R) for i in range(L)], L)
            except Exception as e:  # noqa: BLE001 (a failing variant is a result, the next one runs)
                rec[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    rec["TBps"] = {k: rec["weight_bytes"] / (v * 1e-6) / 1e12 for k, v in rec.items() if k.endswith("_us")}
    return rec


def run_cases(results: dict, batches: str, shapes: str, case, out: str) -> None:
    """results[f"{name}_m{M}"] = case(M, name) for each M of `batches` and projection name of `shapes`
    (comma-separated), each printed, and the JSON written to `out` after each: a sweep cut short
    keeps what it timed."""
    for M in (int(b) for b in batches.split(",")):
        for name in shapes.split(","):
            results[f"{name}_m{M}"] = rec = case(M, name)
            print(f"{name}_m{M}", json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in rec.items()
                                               if not k.endswith(("_error", "TBps"))}), flush=True)
            with open(out, "w") as f:
                json.dump(results, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="twin_split.json")
    parser.add_argument("--batches", default="4,16")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--bn", default="32,64")
    parser.add_argument("--splits", default="1,2,4")
    parser.add_argument("--rows", default="16", help="the MMA form's rows a program (block_m)")
    args = parser.parse_args()
    bns, splits, rows = ([int(v) for v in a.split(",")] for a in (args.bn, args.splits, args.rows))
    run_cases({"meta": run_meta(layers=L)}, args.batches, args.shapes, lambda M, name: case(M, name, bns, splits, rows),
              args.out)


if __name__ == "__main__":
    main()
