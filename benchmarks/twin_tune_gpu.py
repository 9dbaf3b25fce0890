"""Tile sweep of the twin linear's lane form (float32's and the CPU's; the MMA form's plan is
`kernels_pallas.contract.linear.MmaBlocks`) and of the twin attention on the GPU: which tiles reach the copy ceiling.

    python -m benchmarks.twin_tune_gpu --out $OUT/twin_tune.json
    TRITON_INTERPRET=1 python -m benchmarks.twin_tune_gpu --small --out /tmp/twin_tune.json  # CPU smoke

The tiles (block_m, block_n, num_warps) change the speed of a twin kernel, never its
bits; the lanes of a sum (numerics.TWIN_MAX_BK) and the attention plan (TWIN_ATTENTION_BC /
_CHUNK) are part of the numerics contract: they change the bits, the same way on both sides.
This script varies both (the contract constants by patching `kernels_pallas.contract`, which both
packages read at call time) and reports, per shape and configuration:

- ms per call of the Triton kernel, from a CUDA graph of 2 x L launches over L stacked layers
  (the weights, 8 layers, are larger than the L2: each launch reads its layer from HBM), and the
  weight (ring) bytes per second against the measured copy bandwidth;
- whether the bits equal those of the first configuration with the same contract constants
  (they must: tiles never change bits);
- for every stage-1 tile and the default, the Pallas kernel's ms per call (2 x L calls in one
  jit) and whether its bits equal Triton's.

Stage 1 sweeps block_n x num_warps (x block_m for M=16) at the contract's lanes, for Triton and
for Pallas (their best tiles may differ); with --lanes, stage 2 times half and twice the lanes
at Triton's best tile. Never part of the tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import jax
import numpy as np
import torch

from benchmarks.timing import copy_bandwidth, graph_per_call_ms, run_meta
from jax_impl.parity import bits
from kernels_pallas import twin_attention as pa
from kernels_pallas import twin_linear as pli
from kernels_pallas.contract import attention, linear, norm, numerics
from kernels_pallas.contract.norm import TwinNorm
from kernels_triton import twin_attention as ta
from kernels_triton import twin_linear as tli
from torch_bridge.dlpack import to_jax

RESULTS: dict = {}
GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"

# name: (M, N, K, act, residual, fused rms norm) at the temporal sizes (dim 4096, 32 heads, FFN 11264)
SHAPES = {
    "qkv_m4": (4, 12288, 4096, None, False, False),
    "qkv_norm_m4": (4, 12288, 4096, None, False, True),
    "out_m4": (4, 4096, 4096, None, True, False),
    "gate_norm_m4": (4, 22528, 4096, "silu_gate", False, True),
    "down_m4": (4, 4096, 11264, None, True, False),
    "qkv_norm_m1": (1, 12288, 4096, None, False, True),
    "qkv_norm_m16": (16, 12288, 4096, None, False, True),
}
SMALL_SHAPES = {"qkv_norm_m4": (4, 96, 64, None, False, True), "gate_m4": (4, 64, 64, "silu_gate", False, False)}


def record(key, value, out):
    RESULTS[key] = value
    print(key, json.dumps(value)[:2000], flush=True)
    with open(out, "w") as f:
        json.dump(RESULTS, f, indent=1)


def graph_ms(launch, calls: int) -> float:
    """ms per launch(i): `timing.graph_per_call_ms` on the GPU; a host timer when interpreted."""
    if GPU:
        return graph_per_call_ms(launch, calls)
    t0 = time.perf_counter()
    for i in range(calls):
        launch(i)
    return 1e3 * (time.perf_counter() - t0) / calls


def jax_ms(fn, args, calls: int, reps: int = 10) -> float:
    """ms per kernel call of a jitted fn making `calls` calls (host dispatch of one jit amortized)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - t0) / calls)
    return statistics.median(times)


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEVICE) * scale).to(torch.bfloat16)


def attention_case(B, H, T, D, C, L):
    """(q [B, H, T, D], ring_k, ring_v [L, B, H, C, D], positions [B, C], q_pos [B, T]) of random bf16:
    a full ring, every slot written in order, each query at the last position (sees them all)."""
    q = randn(B, H, T, D)
    ring_k, ring_v = randn(L, B, H, C, D, seed=1), randn(L, B, H, C, D, seed=2)
    positions = torch.arange(C, device=DEVICE, dtype=torch.int32)[None].expand(B, C).contiguous()
    return q, ring_k, ring_v, positions, torch.full((B, T), C - 1, device=DEVICE, dtype=torch.int32)


def same(a, b) -> bool:
    a, b = (x.detach().cpu() if isinstance(x, torch.Tensor) else np.asarray(x) for x in (a, b))
    return bool(np.array_equal(bits(a), bits(b)))


def with_contract(**constants):
    """Set contract constants of kernels_pallas.contract (both packages read them at call time)."""
    for k, v in constants.items():
        setattr(contract_module(k), k, v)


def contract_module(name: str):
    """The module of kernels_pallas.contract that declares the constant `name` (the one to set)."""
    for module in (numerics, norm, attention, linear):
        if hasattr(module, name):
            return module
    raise KeyError(f"kernels_pallas.contract has no constant {name!r}")


LANES_STAGE = False  # --lanes: also time half and twice the contract's lanes
STAGES = (None,)     # --stages: the Triton loops' pipeline depths to sweep (None: the default)
PALLAS = True        # --no-pallas-sweep: time the Pallas linear at its default tile only
TRITON = True        # --no-triton-sweep: time the Triton linear at its default tile only
PREFETCH = (linear.TWIN_PALLAS_PREFETCH,)  # --prefetch: the Pallas linear's prefetch depths to sweep
DEFAULTS = {k: getattr(contract_module(k), k)
            for k in ("TWIN_MAX_BK", "TWIN_ATTENTION_BC", "TWIN_ATTENTION_CHUNK", "TWIN_PALLAS_PREFETCH")}


def tune_linear(name, shape, out, ceiling, small):
    M, N, K, act, has_res, has_norm = shape
    L = 1 if name.startswith("head") else (2 if small else 8)
    n_out = N // 2 if act == "silu_gate" else N
    x, w = randn(M, K), randn(L, N, K, scale=0.02, seed=1)
    r = randn(M, n_out, seed=3) if has_res else None
    nw = randn(L, K, seed=4) if has_norm else None
    tnorm = TwinNorm("rms", nw, None, 1e-5) if has_norm else None
    wbytes = N * K * 2
    refs: dict = {}  # lanes -> first output
    rows = []

    def run(cfg):
        with_contract(TWIN_MAX_BK=cfg["lanes"])
        kw = {"act": act, "residual": r, "norm": tnorm, "block_m": cfg["bm"], "block_n": cfg["bn"], "form": "lanes",
              "num_warps": cfg["warps"], "num_stages": cfg.get("stages") or linear.TWIN_TRITON_LINEAR_STAGES}
        try:
            y = tli.linear(x, w, L - 1, **kw)
            ms = graph_ms(lambda i: tli.linear(x, w, i % L, **kw), 2 * L)
        except Exception as e:  # noqa: BLE001 (recorded: a tile the compiler refuses, the sweep goes on)
            rows.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            return None
        ref = refs.setdefault(cfg["lanes"], y)
        row = {**cfg, "ms": ms, "TBps": wbytes / (ms * 1e-3) / 1e12, "of_copy": wbytes / (ms * 1e-3) / ceiling,
               "bits_as_first_same_lanes": same(y, ref)}
        rows.append(row)
        print(name, row, flush=True)
        return row

    def regs(c):  # float32 accumulator elements per thread
        return c["bm"] * c["bn"] * c["lanes"] * (2 if act == "silu_gate" else 1) / (32 * c["warps"])

    lanes0 = DEFAULTS["TWIN_MAX_BK"]
    bms = [M] if M <= 4 else [4, 8]
    stage1 = [{"bm": bm, "bn": bn, "warps": wp, "lanes": lanes0} for bm in bms for bn in (4, 8, 16) for wp in (4, 8)]
    stage1 = [c for c in stage1 if regs(c) <= 128][: 2 if small else None]
    triton_cfgs = [{**c, "stages": st} for c in stage1 if c["warps"] == 4 or len(STAGES) == 1 for st in STAGES]
    if not TRITON:  # --no-triton-sweep: the default tile only
        triton_cfgs = [{"bm": None, "bn": None, "warps": 4, "lanes": lanes0}]
    done = [r_ for r_ in (run(c) for c in triton_cfgs) if r_]
    if LANES_STAGE:  # half and twice the lanes at the best tile (a contract change: other bits)
        best = min(done, key=lambda r_: r_["ms"])
        stage2 = [{**{k: best[k] for k in ("bm", "bn", "warps")}, "lanes": lanes} for lanes in (lanes0 // 2, 2 * lanes0)]
        done += [r_ for r_ in (run(c) for c in stage2 if regs(c) <= 256) if r_]
    best = min(done, key=lambda r_: r_["ms"])

    # the Pallas twin at every stage-1 tile and at the default tile, its bits against Triton's
    pallas = []
    jx, jw, jr = to_jax(x), to_jax(w), None if r is None else to_jax(r)
    jnorm = None if tnorm is None else tnorm._replace(weight=to_jax(nw))
    tiles = [{"config": "default", "bm": None, "bn": None, "warps": 4, "lanes": lanes0}] + stage1 * PALLAS
    for cfg in [{**c, "prefetch": p_} for c in tiles for p_ in PREFETCH]:
        with_contract(TWIN_MAX_BK=cfg["lanes"], TWIN_PALLAS_PREFETCH=cfg["prefetch"])
        kw = {"act": act, "block_m": cfg["bm"], "block_n": cfg["bn"], "num_warps": cfg["warps"], "form": "lanes"}
        pkw = {**kw, "norm": jnorm}
        try:
            f1 = jax.jit(lambda x, w, r, pkw=pkw: pli.linear(x, w, L - 1, residual=r, **pkw))
            fn = jax.jit(lambda x, w, r, pkw=pkw: [pli.linear(x, w, i % L, residual=r, **pkw) for i in range(2 * L)])
            yj = f1(jx, jw, jr)
            yt = tli.linear(x, w, L - 1, residual=r, norm=tnorm, **kw)
            ms = jax_ms(fn, (jx, jw, jr), 2 * L)
            pallas.append({**cfg, "ms": ms, "TBps": wbytes / (ms * 1e-3) / 1e12, "pallas_equals_triton": same(yj, yt)})
        except Exception as e:  # noqa: BLE001 (recorded: a Pallas config that fails, the sweep goes on)
            pallas.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print(name, "pallas", pallas[-1], flush=True)
    pallas_best = min((p_ for p_ in pallas if "ms" in p_), key=lambda p_: p_["ms"], default=None)
    with_contract(**DEFAULTS)
    record(f"linear_{name}", {"M": M, "N": N, "K": K, "act": act, "residual": has_res, "norm": has_norm, "layers": L,
                              "weight_bytes": wbytes, "triton": rows, "best": best, "pallas": pallas,
                              "pallas_best": pallas_best}, out)


def tune_attention(out, ceiling, small):
    B, H, T, D, C, L = (2, 2, 1, 16, 40, 2) if small else (4, 32, 1, 128, 3000, 4)
    q, ring_k, ring_v, positions, q_pos = attention_case(B, H, T, D, C, L)
    rbytes = 2 * B * H * C * D * 2
    rows, refs = [], {}
    plans = [(64, 256), (32, 256), (64, 512)]
    warps = (2, 4, 8)
    stages = [st for st in STAGES if st is not None] or [attention.TWIN_TRITON_ATTENTION_STAGES]
    if small:
        plans, warps = plans[:2], warps[:1]
    for bc, chunk in plans:
        with_contract(TWIN_ATTENTION_BC=bc, TWIN_ATTENTION_CHUNK=chunk)
        for wp, st in ((wp, st) for wp in warps for st in stages):
            cfg = {"bc": bc, "chunk": chunk, "warps": wp, "stages": st}
            try:
                y = ta.attention(q, ring_k, ring_v, L - 1, positions, q_pos, context=C, num_warps=wp, num_stages=st)
                ms = graph_ms(lambda i, wp=wp, st=st: ta.attention(q, ring_k, ring_v, i % L, positions, q_pos,
                                                                   context=C, num_warps=wp, num_stages=st), 2 * L)
            except Exception as e:  # noqa: BLE001 (recorded: a plan the compiler refuses, the sweep goes on)
                rows.append({**cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            ref = refs.setdefault((bc, chunk), y)
            rows.append({**cfg, "ms": ms, "TBps": rbytes / (ms * 1e-3) / 1e12, "of_copy": rbytes / (ms * 1e-3) / ceiling,
                         "bits_as_first_same_plan": same(y, ref)})
            print("attention", rows[-1], flush=True)
    ok = [r_ for r_ in rows if "ms" in r_]
    best = min(ok, key=lambda r_: r_["ms"])
    pallas = []
    for label, cfg in (("best", best), ("default", {"bc": DEFAULTS["TWIN_ATTENTION_BC"],
                                                    "chunk": DEFAULTS["TWIN_ATTENTION_CHUNK"],
                                                    "warps": attention.twin_attention_launch(None, None, True, B * H * T, D, C)[0]})):
        with_contract(TWIN_ATTENTION_BC=cfg["bc"], TWIN_ATTENTION_CHUNK=cfg["chunk"])
        jq, jk, jv, jp, jqp = (to_jax(t) for t in (q, ring_k, ring_v, positions, q_pos))
        try:
            f1 = jax.jit(lambda q, k, v, p, qp, cfg=cfg: pa.attention(q, k, v, L - 1, p, qp, context=C,
                                                                      num_warps=cfg["warps"]))
            fn = jax.jit(lambda q, k, v, p, qp, cfg=cfg: [pa.attention(q, k, v, i % L, p, qp, context=C,
                                                                       num_warps=cfg["warps"])
                                                          for i in range(2 * L)])
            yj = f1(jq, jk, jv, jp, jqp)
            yt = ta.attention(q, ring_k, ring_v, L - 1, positions, q_pos, context=C, num_warps=cfg["warps"],
                              num_stages=cfg.get("stages") or attention.TWIN_TRITON_ATTENTION_STAGES)
            ms = jax_ms(fn, (jq, jk, jv, jp, jqp), 2 * L)
            pallas.append({"config": label, "bc": cfg["bc"], "chunk": cfg["chunk"], "warps": cfg["warps"], "ms": ms,
                           "TBps": rbytes / (ms * 1e-3) / 1e12, "pallas_equals_triton": same(yj, yt)})
        except Exception as e:  # noqa: BLE001 (recorded: a Pallas plan that fails, the sweep goes on)
            pallas.append({"config": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        print("attention pallas", pallas[-1], flush=True)
    with_contract(**DEFAULTS)
    record("attention", {"B": B, "H": H, "T": T, "D": D, "C": C, "layers": L, "ring_bytes": rbytes,
                         "triton": rows, "best": best, "pallas": pallas}, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="twin_tune.json")
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--small", action="store_true", help="tiny shapes, interpreted (CPU smoke run)")
    parser.add_argument("--lanes", action="store_true", help="also half and twice the lanes (other bits)")
    parser.add_argument("--stages", default="", help="Triton pipeline depths to sweep, e.g. 1,3,4 (with 4 warps)")
    parser.add_argument("--no-pallas-sweep", action="store_true", help="the Pallas linear at its default tile only")
    parser.add_argument("--no-triton-sweep", action="store_true", help="the Triton linear at its default tile only")
    parser.add_argument("--prefetch", default="", help="Pallas linear prefetch depths to sweep, e.g. 1,2,3")
    args = parser.parse_args()
    global LANES_STAGE, STAGES, PALLAS, TRITON, PREFETCH
    TRITON = not args.no_triton_sweep
    PREFETCH = tuple(int(v) for v in args.prefetch.split(",")) if args.prefetch else PREFETCH
    if min(PREFETCH) < 1:  # the contract constant is not checked where the kernel reads it
        parser.error(f"--prefetch: depths of at least 1, got {args.prefetch}")
    LANES_STAGE = args.lanes
    STAGES = tuple(int(v) for v in args.stages.split(",")) if args.stages else (None,)
    PALLAS = not args.no_pallas_sweep
    if not GPU and not args.small:
        raise SystemExit("twin_tune_gpu.py: no CUDA device; pass --small (with TRITON_INTERPRET=1) on a CPU")
    ceiling = copy_bandwidth() if GPU else 1.0
    record("meta", run_meta(copy_TBps=ceiling / 1e12), args.out)
    cases = {f"linear_{k}": (lambda k=k, s=s: tune_linear(k, s, args.out, ceiling, args.small))
             for k, s in (SMALL_SHAPES if args.small else SHAPES).items()}
    cases["attention"] = lambda: tune_attention(args.out, ceiling, args.small)
    for name, fn in cases.items():
        if args.only and args.only not in name:
            continue
        try:
            fn()
        except Exception:  # noqa: BLE001 (recorded: a failing case is a result, the next one still runs)
            record(f"error_{name}", traceback.format_exc()[-3000:], args.out)
        with_contract(**DEFAULTS)


if __name__ == "__main__":
    main()
