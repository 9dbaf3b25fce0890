"""A/B timings of the twin linear on the GPU, side by side in one process: the fused norm
(`linear(norm=TwinNorm(...))`) against the norm kernel then the linear, on both sides, and the
Pallas linear's prefetch depths; optionally an older Pallas linear module (--old FILE, a copy of
`kernels_pallas/twin_linear.py` from another commit) at the same shapes.

    python benchmarks/twin_ab_gpu.py --out $OUT/twin_ab.json [--old benchmarks/ab_old_twin_linear.py]

Every variant's bits are checked against the Pallas default's (they must be equal). Never part
of the tests.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json

import jax
import torch
from cuda_timing import graph_per_call_ms
from twin_tune_gpu import jax_ms, randn, same

from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_norm as pn
from kernels_pallas.common import TwinNorm
from kernels_triton import twin_linear as tli
from kernels_triton import twin_norm as tn
from torch_bridge.dlpack import to_jax

L = 8  # stacked layers: larger than the L2, each call reads its layer from HBM
SHAPES = {  # name: (N, K, act, residual, norm) at the temporal sizes
    "qkv": (12288, 4096, None, False, True),
    "gate": (22528, 4096, "silu_gate", False, True),
    "out": (4096, 4096, None, True, False),
    "down": (4096, 11264, None, True, False),
}


def load_module(path):
    spec = importlib.util.spec_from_file_location("old_twin_linear", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case(M, name, old, prefetches):
    N, K, act, has_res, has_norm = SHAPES[name]
    n_out = N // 2 if act == "silu_gate" else N
    x, w = randn(M, K), randn(L, N, K, scale=0.02, seed=1)
    r = randn(M, n_out, seed=3) if has_res else None
    nw = randn(L, K, seed=4)
    jx, jw, jr, jnw = to_jax(x), to_jax(w), None if r is None else to_jax(r), to_jax(nw)
    rec = {"M": M, "N": N, "K": K, "act": act, "weight_bytes": N * K * 2}

    def pallas(label, one):  # one(x, w, r, nw, layer) -> y
        f1 = jax.jit(lambda *a: one(*a, L - 1))
        fn = jax.jit(lambda *a: [one(*a, i % L) for i in range(2 * L)])
        y = f1(jx, jw, jr, jnw)
        rec[label] = jax_ms(fn, (jx, jw, jr, jnw), 2 * L)
        return y

    def triton(label, one):
        y = one(L - 1)
        rec[label] = graph_per_call_ms(one, 2 * L)
        return y

    eps = 1e-5
    if has_norm:
        ref = pallas("pallas_fused_ms", lambda x, w, r, nw, i: pli.linear(x, w, i, act=act, norm=TwinNorm("rms", nw, None, eps)))
        ys = [pallas("pallas_separate_ms", lambda x, w, r, nw, i: pli.linear(pn.norm(x, nw, None, i, kind="rms", eps=eps),
                                                                                w, i, act=act))]
        ys.append(triton("triton_fused_ms", lambda i: tli.linear(x, w, i % L, act=act, norm=TwinNorm("rms", nw, None, eps))))
        ys.append(triton("triton_separate_ms", lambda i: tli.linear(tn.norm(x, nw, None, i % L, kind="rms", eps=eps),
                                                                    w, i % L, act=act)))
        for p in prefetches:
            ys.append(pallas(f"pallas_fused_prefetch{p}_ms", lambda x, w, r, nw, i, p=p: pli.linear(
                x, w, i, act=act, norm=TwinNorm("rms", nw, None, eps), prefetch=p)))
    else:
        ref = pallas("pallas_ms", lambda x, w, r, nw, i: pli.linear(x, w, i, act=act, residual=r))
        ys = [triton("triton_ms", lambda i: tli.linear(x, w, i % L, act=act, residual=r))]
        for p in prefetches:
            ys.append(pallas(f"pallas_prefetch{p}_ms", lambda x, w, r, nw, i, p=p: pli.linear(
                x, w, i, act=act, residual=r, prefetch=p)))
        if old is not None:
            ys.append(pallas("pallas_old_ms", lambda x, w, r, nw, i: old.linear(x, w, i, act=act, residual=r)))
    rec["bits_equal"] = all(same(ref, y) for y in ys)
    rec["TBps"] = {k: rec["weight_bytes"] / (v * 1e-3) / 1e12 for k, v in rec.items() if k.endswith("_ms")}
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="twin_ab.json")
    parser.add_argument("--old", default=None, help="an older kernels_pallas/twin_linear.py to time beside")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--prefetch", default="2,3", help="Pallas prefetch depths besides the default")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="which of " + ",".join(SHAPES))
    args = parser.parse_args()
    old = load_module(args.old) if args.old else None
    prefetches = [int(p) for p in args.prefetch.split(",") if p]
    results = {"meta": {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                        "jax": jax.__version__, "torch": torch.__version__, "layers": L}}
    for M in (int(b) for b in args.batches.split(",")):
        for name in args.shapes.split(","):
            key = f"{name}_m{M}"
            try:
                results[key] = case(M, name, old, prefetches)
            except Exception as e:  # noqa: BLE001 (recorded: a failing case is a result, the next one runs)
                results[key] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            print(key, json.dumps(results[key]), flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
