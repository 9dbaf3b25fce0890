"""Which plan for the twin attention's MMA form, and what the step gains with it, in one device call.

    python benchmarks/attention_plan_step_gpu.py --out $OUT

1. `attention_plan_gpu.py --forms mma` over the plans x warps x batches given (us a layer).
2. The pick: the (plan, warps) whose time, relative to the contract's plan at its warps for each B
   (`contract.TWIN_ATTENTION_BC`, `TWIN_ATTENTION_CHUNK`, `twin_attention._warps`), summed over
   the batches, is least. The plan is part of the numerics contract, so a new plan needs the step's
   bits checked again: hence
3. with the pick set (both packages read those constants at call time): `twin_step_gpu.py --only
   bits` (JAX twin vs torch twin, 300 steps, both stacks) and `scale_bench.py --kernels twin`.

Writes plans.json, pick.json, bits.json and sb/ under --out. Never part of the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from kernels_pallas import twin_attention
from kernels_pallas.contract import attention as contract

TEMPORAL_HEADS = 32  # the sweep's queries a batch row (T=1)

HERE = os.path.dirname(os.path.abspath(__file__))
# a benchmark run with the pick's contract constants set (read at call time by both packages)
RUN_WITH = ("import runpy, sys; from kernels_pallas.contract import attention as contract; "
            "(contract.TWIN_ATTENTION_BC, contract.TWIN_ATTENTION_CHUNK, contract.TWIN_PALLAS_ATTENTION_WARPS), "
            "contract.TWIN_PALLAS_ATTENTION_FEW_WARPS = {pick}, {pick}[2]; "
            "sys.argv = {argv}; runpy.run_path({path!r}, run_name='__main__')")


def run(argv: list[str], budget_s: float) -> None:
    print("$", " ".join(argv), flush=True)
    try:
        subprocess.run(argv, check=False, timeout=budget_s)
    except subprocess.TimeoutExpired:
        print(f"(cut at {budget_s:.0f} s)", flush=True)


def pick(rows: list[dict], batches: list[int]) -> dict:
    """The (bc, chunk, warps) of least summed time relative to the contract's, over the batches."""
    plan = (contract.TWIN_ATTENTION_BC, contract.TWIN_ATTENTION_CHUNK)
    default = {B: (*plan, twin_attention._warps(B * TEMPORAL_HEADS)) for B in batches}  # the contract's warps at B
    us = {(r["bc"], r["chunk"], r["warps"], r["B"]): r["us_per_layer"] for r in rows if "us_per_layer" in r}
    base = {B: us[(*default[B], B)] for B in batches if (*default[B], B) in us}  # the batches the sweep reached
    batches = list(base)
    score = {cfg: sum(us[(*cfg, B)] / base[B] for B in batches)
             for cfg in ({k[:3] for k in us} if batches else ()) if all((*cfg, B) in us for B in batches)}
    best = min(score, key=score.get, default=(*plan, contract.TWIN_PALLAS_ATTENTION_WARPS))
    return {"pick": list(best), "default": {B: list(d) for B, d in default.items()}, "batches": batches,
            "relative_sum": {str(k): v for k, v in score.items()}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--plans", default="64x256,64x128,64x64,128x256,128x512")
    parser.add_argument("--warps", default="2,4")
    parser.add_argument("--batches", default="1,4,64")
    parser.add_argument("--budget", type=float, default=560, help="seconds for the whole run")
    args = parser.parse_args()
    t0 = time.monotonic()
    left = lambda: args.budget - (time.monotonic() - t0)
    plans_json = os.path.join(args.out, "plans.json")
    run([sys.executable, os.path.join(HERE, "attention_plan_gpu.py"), "--forms", "mma", "--plans", args.plans,
         "--warps", args.warps, "--batches", args.batches, "--layers", "4", "--out", plans_json], 0.45 * left())
    with open(plans_json) as f:
        result = pick(json.load(f)["rows"], [int(b) for b in args.batches.split(",")])
    with open(os.path.join(args.out, "pick.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("pick", json.dumps(result), flush=True)
    given = tuple(result["pick"])
    os.makedirs(os.path.join(args.out, "sb"), exist_ok=True)
    for script, argv, share in (
            ("twin_step_gpu.py", ["--only", "bits", "--steps", "300", "--out", os.path.join(args.out, "bits.json")], 0.3),
            ("scale_bench.py", ["--out", os.path.join(args.out, "sb"), "--kernels", "twin", "--loops", "scan",
                                "--batches", "4,64,1,16", "--mimi-batches", "4"], 1.0)):
        path = os.path.join(HERE, script)
        run([sys.executable, "-c", RUN_WITH.format(pick=given, argv=[path, *argv], path=path)], share * left())


if __name__ == "__main__":
    main()
