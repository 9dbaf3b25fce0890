"""A/B timings of the twin linear's two forms on the GPU, side by side in one process: the MMA
form (tensor cores) at each block_n x pipeline depth, against the lane form at its defaults, on
both sides, and the twin norm kernel.

    python benchmarks/twin_ab_gpu.py --out $OUT/twin_ab.json [--batches 1,4,16] [--stages 4,6,8] [--bn 32,64]

Bits: every MMA variant must equal the Pallas MMA default (tiles and depths never change them),
and the Triton lane form the Pallas lane form. Never part of the tests.
"""

from __future__ import annotations

import argparse
import json

import jax
from cuda_timing import graph_per_call_ms, run_meta
from twin_tune_gpu import jax_ms, randn, same

from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_norm as pn
from kernels_triton import twin_linear as tli
from kernels_triton import twin_norm as tn
from torch_bridge.dlpack import to_jax

L = 8  # stacked layers: larger than the L2, each call reads its layer from HBM
SHAPES = {  # name: (N, K, act, residual) at the temporal sizes
    "qkv": (12288, 4096, None, False),
    "gate": (22528, 4096, "silu_gate", False),
    "out": (4096, 4096, None, True),
    "down": (4096, 11264, None, True),
}


def case(M, name, bns, stages):
    N, K, act, has_res = SHAPES[name]
    n_out = N // 2 if act == "silu_gate" else N
    x, w = randn(M, K), randn(L, N, K, scale=0.02, seed=1)
    r = randn(M, n_out, seed=3) if has_res else None
    jx, jw, jr = to_jax(x), to_jax(w), None if r is None else to_jax(r)
    rec = {"M": M, "N": N, "K": K, "act": act, "weight_bytes": N * K * 2}

    def pallas(label, **kw):
        f1 = jax.jit(lambda x, w, r: pli.linear(x, w, L - 1, act=act, residual=r, **kw))
        fn = jax.jit(lambda x, w, r: [pli.linear(x, w, i % L, act=act, residual=r, **kw) for i in range(2 * L)])
        y = f1(jx, jw, jr)
        rec[label] = jax_ms(fn, (jx, jw, jr), 2 * L)
        return y

    def triton(label, **kw):
        y = tli.linear(x, w, L - 1, act=act, residual=r, **kw)
        rec[label] = graph_per_call_ms(lambda i: tli.linear(x, w, i % L, act=act, residual=r, **kw), 2 * L)
        return y

    ref = pallas("pallas_mma_default_ms")
    mma = [triton("triton_mma_default_ms")]
    for bn in bns:
        for st in stages:
            mma.append(pallas(f"pallas_mma_bn{bn}_s{st}_ms", block_n=bn, num_stages=st))
            mma.append(triton(f"triton_mma_bn{bn}_s{st}_ms", block_n=bn, num_stages=st))
    lanes = pallas("pallas_lanes_ms", form="lanes")
    rec["mma_bits_equal"] = all(same(ref, y) for y in mma)
    rec["lanes_bits_equal"] = same(lanes, triton("triton_lanes_ms", form="lanes"))
    rec["TBps"] = {k: rec["weight_bytes"] / (v * 1e-3) / 1e12 for k, v in rec.items() if k.endswith("_ms")}
    return rec


def norm_case(M, D=4096):
    x, nw = randn(M, D), randn(L, D, seed=4)
    jx, jnw = to_jax(x), to_jax(nw)
    fn = jax.jit(lambda x, nw: [pn.norm(x, nw, None, i % L, kind="rms", eps=1e-5) for i in range(2 * L)])
    rec = {"M": M, "D": D, "pallas_ms": jax_ms(fn, (jx, jnw), 2 * L),
           "triton_ms": graph_per_call_ms(lambda i: tn.norm(x, nw, None, i % L, kind="rms", eps=1e-5), 2 * L)}
    rec["bits_equal"] = same(fn(jx, jnw)[L - 1], tn.norm(x, nw, None, L - 1, kind="rms", eps=1e-5))
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="twin_ab.json")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="which of " + ",".join(SHAPES))
    parser.add_argument("--bn", default="32,64", help="MMA block_n values")
    parser.add_argument("--stages", default="4,8", help="MMA pipeline depths")
    args = parser.parse_args()
    bns, stages = ([int(v) for v in a.split(",") if v] for a in (args.bn, args.stages))
    results = {"meta": run_meta(layers=L)}
    for M in (int(b) for b in args.batches.split(",")):
        cases = [(f"{name}_m{M}", lambda M=M, name=name: case(M, name, bns, stages)) for name in args.shapes.split(",")]
        for key, run in [*cases, (f"rms_norm_m{M}", lambda M=M: norm_case(M))]:
            try:
                results[key] = run()
            except Exception as e:  # noqa: BLE001 (recorded: a failing case is a result, the next one runs)
                results[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(key, json.dumps(results[key]), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
