"""The twin attention's kernels at the temporal sizes, timed by Nsight Compute: the kernel's own GPU
time, free of the host's dispatch (host-timed sweeps of this kernel moved up to 1.5x between calls:
RESULTS.md, twelfth session), and where a latency-bound attention (B = 1, 4) spends it.

    ncu --clock-control none -k regex:"attention|_split_kernel" --metrics gpu__time_duration.sum --csv \
        python benchmarks/attention_ncu_gpu.py --batches 1,4 --manifest $OUT/m.json > $OUT/ncu.csv
    python benchmarks/attention_ncu_gpu.py --summarize $OUT/ncu.csv --manifest $OUT/m.json --out $OUT/a.json

The first command launches the Pallas kernel (the JAX step's) --calls times for each batch size,
plan, warp count and pipeline depth, then the Triton twin (the torch step's) for each of its own,
and writes the launches' order to the manifest; ncu times each launch (cold L2: ncu flushes the caches before
each, as a ring larger than the L2 is read in the step). It also checks the Pallas and Triton
outputs bit for bit at each batch size and plan, and measures the copy rate. The second pairs ncu's rows
with the manifest: the median us a layer of each case and its ring bytes against the copy rate.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics

H, D, C, T = 32, 128, 3000, 1


def launch(args):
    import jax
    import torch
    from cuda_timing import copy_bandwidth, run_meta
    from twin_tune_gpu import attention_case, same, with_contract

    from kernels_pallas import twin_attention as pa
    from kernels_pallas.contract import attention as contract
    from kernels_triton import twin_attention as ta
    from torch_bridge.dlpack import to_jax

    order, equal, copy_TBps = [], {}, copy_bandwidth() / 1e12
    ints = lambda text: [int(v) for v in text.split(",")]
    orders = args.orders or ("splits" if contract.TWIN_ATTENTION_SPLITS_FIRST else "queries")
    for B in ints(args.batches):
        q, ring_k, ring_v, positions, q_pos = attention_case(B, H, T, D, C, args.layers)
        jargs = tuple(to_jax(t) for t in (q, ring_k, ring_v, positions, q_pos))
        for plan, launch_order in ((p, o) for p in args.plans.split(",") for o in orders.split(",")):
            bc, chunk = (int(v) for v in plan.split("x"))
            # both twins read these at call time
            with_contract(TWIN_ATTENTION_BC=bc, TWIN_ATTENTION_CHUNK=chunk,
                          TWIN_ATTENTION_SPLITS_FIRST=launch_order == "splits")
            for warps in ints(args.warps):
                for stages in ints(args.stages):
                    fn = jax.jit(lambda q, k, v, p, qp, w=warps, s=stages:
                                 pa.attention(q, k, v, 1, p, qp, context=C, num_warps=w, num_stages=s))
                    for _ in range(args.calls):
                        out = jax.block_until_ready(fn(*jargs))
                    order += [{"twin": "pallas", "B": B, "plan": plan, "order": launch_order, "warps": warps,
                               "stages": stages}] * args.calls
            for warps in ints(args.triton_warps):
                for stages in ints(args.triton_stages):
                    for _ in range(args.calls):
                        ref = ta.attention(q, ring_k, ring_v, 1, positions, q_pos, context=C, num_warps=warps,
                                           num_stages=stages)
                    torch.cuda.synchronize()
                    order += [{"twin": "triton", "B": B, "plan": plan, "order": launch_order, "warps": warps,
                               "stages": stages}] * args.calls
            key = f"B={B} {plan} {launch_order} first"
            equal[key] = same(out, ref)  # the last Pallas case against the last Triton one
            print(f"{key}: Pallas == Triton bit for bit: {equal[key]}", flush=True)
            with open(args.manifest, "w") as f:  # after each plan: a sweep cut short keeps what it timed
                json.dump(run_meta(layers=args.layers, copy_TBps=copy_TBps, launches=order, pallas_equals_triton=equal), f, indent=1)


def summarize(args):
    with open(args.manifest) as f:
        manifest = json.load(f)
    with open(args.summarize) as f:
        rows = [r for r in csv.DictReader(line for line in f if line.startswith('"'))
                if r.get("Metric Name") == "gpu__time_duration.sum"]
    if len(rows) < len(manifest["launches"]):  # more rows: launches of a plan the manifest did not get to
        raise SystemExit(f"--summarize: {len(rows)} timed launches, the manifest has {len(manifest['launches'])}")
    cases: dict = {}
    for launch_, row in zip(manifest["launches"], rows):
        ns = float(row["Metric Value"].replace(",", "")) * {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}[row["Metric Unit"]]
        cases.setdefault(json.dumps(launch_, sort_keys=True), []).append(ns / 1e3)
    out = []
    for key, us in cases.items():
        case = json.loads(key)
        med = statistics.median(us)
        case.update(us=med, us_all=us, TBps=2 * case["B"] * H * C * D * 2 / (med * 1e-6) / 1e12)
        case["share_of_copy"] = case["TBps"] / manifest["copy_TBps"]
        out.append(case)
        print(f"{key}: {med:.1f} us ({case['TBps']:.2f} TB/s, {case['share_of_copy']:.0%})")
    manifest["cases"] = out
    manifest.pop("launches")
    with open(args.out, "w") as f:
        json.dump(manifest, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--warps", default="4")
    parser.add_argument("--stages", default="2")
    parser.add_argument("--plans", default="64x256", help="BCxchunk, ... (the contract's plan: other bits, both twins)")
    parser.add_argument("--orders", default=None, help="queries,splits: the launch orders to time (speed only, "
                        "contract.TWIN_ATTENTION_SPLITS_FIRST; default: the step's)")
    parser.add_argument("--triton-warps", default="2")
    parser.add_argument("--triton-stages", default="1")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=5, help="launches of each case")
    parser.add_argument("--manifest", default="attention_ncu_manifest.json")
    parser.add_argument("--summarize", default=None, help="ncu's CSV (--csv --metrics gpu__time_duration.sum)")
    parser.add_argument("--out", default="attention_ncu.json")
    args = parser.parse_args()
    summarize(args) if args.summarize else launch(args)


if __name__ == "__main__":
    main()
