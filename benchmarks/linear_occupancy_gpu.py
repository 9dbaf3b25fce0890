"""Do the twin MMA linears lose time to how many programs an SM holds?

    python benchmarks/linear_occupancy_gpu.py --out $OUT/linear_occupancy.json [--batches 1,16,64]

Each temporal projection as the twin step calls it (qkv: `linear_rope_write` with the split norm's
rms; gate: `act="silu_gate"` with rms; out and down: `split=` with the residual), at M rows, over 8
stacked layers read in turn from HBM. For each pipeline depth (num_stages) and warp count the GPU
time of one call (`twin_split_gpu.device_us`), Pallas and Triton. The depth sets each program's
shared memory ((weight tiles * BN + rows) * BK * 2 bytes a stage), so how many programs an SM holds
at once (an H200 SM has 228 KB), so whether the grid runs in one wave. Speed only: every depth and
warp count gives the same bits. A timing question only; never part of the tests.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import torch
from cuda_timing import run_meta
from twin_split_gpu import SHAPES, L, device_us, run_cases

from kernels_pallas import twin_linear as pli
from kernels_pallas.contract import linear, norm
from kernels_triton import twin_linear as tli
from torch_bridge.dlpack import to_jax

H, D, C = 32, 128, 16  # the temporal heads; a short ring: the ring write's cost does not depend on C
SM_SHARED_BYTES = 228 * 1024
TWINS = ["pallas", "triton"]  # timed (--pallas-only: the JAX step's alone)


def inputs(M: int, name: str) -> dict:
    """The torch operands of one projection's step call (the JAX ones are their DLPack views)."""
    N, K, act, _ = SHAPES[name]
    n_out = N // 2 if act == "silu_gate" else N
    dev = "cuda"
    t = {"x": torch.randn(M, K, device=dev).to(torch.bfloat16),
         "w": (torch.randn(L, N, K, device=dev) * 0.02).to(torch.bfloat16)}
    if name in ("qkv", "gate"):  # the consumer of a split norm: per-group sums of squares of x
        t["ss"] = torch.rand(M, K // norm.TWIN_SPLIT_GROUP, device=dev) * 64
    else:  # the producer: the residual and the next norm's alpha
        t["r"] = torch.randn(M, n_out, device=dev).to(torch.bfloat16)
        t["alpha"] = torch.rand(L, n_out, device=dev).to(torch.bfloat16)
    if name == "qkv":
        t["cos"], t["sin"] = (torch.rand(M, 1, D // 2, device=dev) for _ in range(2))
        t["widx"] = torch.arange(M, device=dev, dtype=torch.int32).remainder(C).view(M, 1)
        t["wmask"] = torch.ones(M, 1, device=dev, dtype=torch.int32)
    return t


def calls(mod, name: str, a: dict, kw: dict, rings=None):
    """L calls of projection `name` of twin module `mod` (pli or tli) on operands a, with the speed
    arguments kw; the qkv projection's threads the rings (k, v) through its calls and returns them
    after its outputs."""
    eps = 1e-8
    if name == "qkv":
        qs = []
        for i in range(L):
            q, *rings = mod.linear_rope_write(a["x"], a["w"], i, a["cos"], a["sin"], *rings, a["widx"], a["wmask"],
                                              rms=norm.TwinRms(a["ss"], eps), **kw)
            qs.append(q)
        return qs, rings
    if name == "gate":
        return [mod.linear(a["x"], a["w"], i, act="silu_gate", rms=norm.TwinRms(a["ss"], eps), **kw)
                for i in range(L)]
    offset = int(name == "down")
    return [mod.linear(a["x"], a["w"], i, residual=a["r"], split=norm.TwinSplit(a["alpha"], offset), **kw)[0]
            for i in range(L)]


def plan(M: int, name: str, block_n: int | None = None, block_m: int | None = None) -> dict:
    """The step's plan of this call (block_n, block_m: given, as the kernels take them): (BN, BK,
    rows), the programs, the default depth and a stage's shared memory."""
    N, K, act, _ = SHAPES[name]
    tiles = 1 + (act == "silu_gate")
    n_out = N // tiles
    if name == "qkv":
        BN, BK = linear.twin_qkv_plan(N, K, D, "bfloat16", compiled=True, block_n=block_n)[1], linear.twin_lanes(K)
        R = linear.twin_mma_rows(M, N // BN, block_m)
    else:
        blocks = linear.MmaBlocks.for_shapes(M, n_out, K, tiles, name in ("out", "down"), block_m, block_n)
        BN, BK, R = blocks.block_n, blocks.block_k, blocks.rows
    return {"BN": BN, "BK": BK, "rows": R, "programs": -(-M // R) * (n_out // BN),
            "default_stages": linear.twin_mma_stages(n_out, BN, BK, tiles, rows=R, M=M),
            "stage_bytes": (tiles * BN + R) * BK * 2}


def case(M: int, name: str, stages: list, warps: list, bns: list, rows: list) -> dict:
    t = inputs(M, name)
    j = {k: to_jax(v) for k, v in t.items()}
    # the qkv projection's rings, donated to the Pallas calls (not donated, XLA would copy them
    # for the kernel's in-place write, a copy a call): held here from call to call
    rings = [torch.zeros(L, M, H, C, D, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    held = {"rings": [to_jax(r) for r in rings]}

    def pallas(f):
        out, held["rings"] = f(j, held["rings"])
        jax.block_until_ready((out, held["rings"]))

    rec = {"M": M, **plan(M, name)}
    for bn, R, s, w in itertools.product(bns, rows, stages, warps):
        p = plan(M, name, bn, R)
        if s * p["stage_bytes"] > SM_SHARED_BYTES:
            continue
        key = f"s{s}_w{w}" + ("" if bn is None else f"_bn{bn}") + ("" if R is None else f"_r{R}")
        kw = {"num_stages": s, "num_warps": w, "block_n": bn, "block_m": R}
        try:
            f = jax.jit(lambda a, r, kw=kw: calls(pli, name, a, kw, r)
                        if name == "qkv" else (calls(pli, name, a, kw), r), donate_argnums=1)
            rec[f"pallas_{key}_us"] = device_us(lambda f=f: pallas(f), L)
            if "triton" in TWINS:
                rec[f"triton_{key}_us"] = device_us(lambda kw=kw: calls(tli, name, t, kw, rings), L)
        except Exception as e:  # noqa: BLE001 (a failing variant is a result, the next one runs)
            rec[f"{key}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="linear_occupancy.json")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--stages", default="2,3,4,6,8")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--bn", default="", help="block_n values (empty: the step's)")
    parser.add_argument("--rows", default="", help="block_m values (empty: the step's)")
    parser.add_argument("--pallas-only", action="store_true", help="no Triton twin timings")
    args = parser.parse_args()
    stages, warps = ([int(v) for v in a.split(",")] for a in (args.stages, args.warps))
    bns, rows = ([int(v) for v in a.split(",")] if a else [None] for a in (args.bn, args.rows))
    if args.pallas_only:
        TWINS.remove("triton")
    run_cases({"meta": run_meta(layers=L)}, args.batches, args.shapes,
              lambda M, name: case(M, name, stages, warps, bns, rows), args.out)


if __name__ == "__main__":
    main()
