"""MRoPE on one GPU: Pallas vs Triton bit identity, then timings at Qwen2.5-VL-7B shapes.

    python3 benchmarks/mrope_gpu.py --out $OUT

(a) Bit identity on the feature matrix (NeoX/GPT-J x chunked/interleaved/text x full/partial
    rotary x float32/bfloat16 (+ float16 spot checks) x a few token counts): Pallas ``mrope`` and
    ``mrope_from_cache`` (jitted) against Triton's, and each against its framework's reference.
    Mismatches are reported as element counts and max ULP.
(b) Timings for 1024 / 8192 / 32768 tokens (28 q heads, 4 kv heads, head 128, rotary 128, sections
    [16, 24, 24], bf16, NeoX, chunked): torch-native, Triton in place (table and fused gather),
    the gather + kernel path, Pallas donated (table and fused gather), jnp-native.  torch forms are
    timed as CUDA-graph replays (CUDA events, median), JAX forms as a jitted ``fori_loop`` of the
    kernel with donated carries (block_until_ready + perf_counter, median), so Python launch
    overhead is out of both.  Bandwidth = bytes read + written / time, against the 4.26 TB/s copy
    ceiling measured on this card.

Writes ``mrope_gpu.json`` under ``--out`` and prints a markdown table last.  Without a GPU it runs
a small correctness smoke test in interpret mode (needs TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np
import torch
import triton

import kernels_pallas as kp
import kernels_triton as kt

COPY_CEILING = 4.26e12  # bytes/s, device-to-device copy (read + written) measured on an H200 here
ENGINE_KERNEL_US = {1024: 10.2, 8192: 39.8, 32768: 139.0}  # serving engine's Triton MRoPE kernel
ENGINE_NATIVE_US = {1024: 156.0, 8192: 313.0, 32768: 1103.0}  # its torch-native path

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JAX_DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ------------------------------------------------------------------------------------- bits


def bits_t(t):
    t = t.detach().contiguous().cpu()
    w = t.element_size()
    return t.view({2: torch.int16, 4: torch.int32}[w]).numpy().astype(np.int64) & ((1 << (8 * w)) - 1), w


def bits_j(x):
    a = np.asarray(x)
    w = a.dtype.itemsize
    return a.view({2: np.uint16, 4: np.uint32}[w]).astype(np.int64), w


def compare(a, b):
    """(elements that differ, max ULP distance) of two bit arrays of one width."""
    (x, w), (y, _) = a, b
    if x.shape != y.shape:
        return -1, -1
    sign = 1 << (8 * w - 1)

    def ordered(v):
        return np.where(v & sign, -(v & (sign - 1)), v)

    diff = np.abs(ordered(x) - ordered(y))
    return int((x != y).sum()), int(diff.max()) if diff.size else 0


def jax_from_torch(t, dtype=None):
    if t.dtype == torch.bfloat16:
        a = t.detach().cpu().view(torch.int16).numpy().view(jnp.bfloat16)
    else:
        a = t.detach().cpu().numpy()
    return jnp.asarray(a)


# ------------------------------------------------------------------------------ correctness


def make_inputs(seed, n, hq, hk, hs, rd, dtype, streams, max_position=4096):
    g = torch.Generator().manual_seed(seed)
    half = rd // 2
    q = torch.randn(n, hq * hs, generator=g).to(TORCH_DT[dtype]).to(DEV)
    k = torch.randn(n, hk * hs, generator=g).to(TORCH_DT[dtype]).to(DEV)
    inv = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) * 2 / rd))
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1).float().to(DEV)
    shape = (3, n) if streams == 3 else (n,)
    pos = torch.randint(0, max_position, shape, generator=g).to(DEV)
    cos, sin = cache[pos].chunk(2, -1)
    return q, k, cos.contiguous(), sin.contiguous(), pos, cache


def check_case(n, geom, dtype, layout, neox):
    hq, hk, hs, rd = geom
    streams = 1 if layout == "text" else 3
    half = rd // 2
    sections = None if layout == "text" else [half // 4, (half - half // 4) // 2,
                                             half - half // 4 - (half - half // 4) // 2]
    inter = layout == "interleaved"
    q, k, cos, sin, pos, cache = make_inputs(n * 31 + hq, n, hq, hk, hs, rd, dtype, streams)
    args = (sections, hs, rd, inter, neox)
    res = {}
    res["triton"] = kt.mrope(q, k, cos, sin, *args)
    res["triton_cache"] = kt.mrope_from_cache(pos, q, k, cache, *args)
    res["torch_native"] = kt.mrope_native(q, k, cos, sin, *args)
    jq, jk, jc, js = map(jax_from_torch, (q, k, cos, sin))
    jpos, jcache = jax_from_torch(pos.int()), jax_from_torch(cache)
    kw = {"mrope_section": sections, "head_size": hs, "rotary_dim": rd, "mrope_interleaved": inter, "is_neox_style": neox}
    res["pallas"] = jax.jit(functools.partial(kp.mrope, **kw))(jq, jk, jc, js)
    res["pallas_cache"] = jax.jit(functools.partial(kp.mrope_from_cache, **kw))(jpos, jq, jk, jcache)
    res["jnp_native"] = jax.jit(functools.partial(kp.mrope_native, **kw))(jq, jk, jc, js)
    out = {}
    base = [bits_t(x) for x in res["triton"]]
    for name, val in res.items():
        conv = bits_t if name.startswith(("triton", "torch")) else bits_j
        cmp = [compare(base[i], conv(val[i])) for i in range(2)]
        out[name] = {"diff": cmp[0][0] + cmp[1][0], "max_ulp": max(cmp[0][1], cmp[1][1])}
    # Each kernel vs its own framework's reference.
    pj = [bits_j(x) for x in res["pallas"]]
    nj = [bits_j(x) for x in res["jnp_native"]]
    c = [compare(pj[i], nj[i]) for i in range(2)]
    out["pallas_vs_jnp_native"] = {"diff": c[0][0] + c[1][0], "max_ulp": max(c[0][1], c[1][1])}
    return out


def run_correctness(quick, max_cases=None):
    geoms = {"qwen25": (28, 4, 128, 128), "partial": (5, 3, 80, 48)}
    sizes = [1, 37, 1000] if GPU else [1, 5]
    if quick or not GPU:
        geoms = {"qwen25": (28, 4, 16, 16), "partial": (5, 3, 40, 24)}
    cases = []
    idx = 0
    for gname, geom in geoms.items():
        for dtype in ("float32", "bfloat16", "float16"):
            for layout in ("chunked", "interleaved", "text"):
                for neox in (True, False):
                    if dtype == "float16" and (layout, neox) not in (("chunked", True), ("interleaved", False)):
                        continue
                    n = sizes[idx % len(sizes)]
                    idx += 1
                    cases.append((gname, geom, n, dtype, layout, neox))
    if max_cases and max_cases < len(cases):
        keep = sorted(np.random.default_rng(0).permutation(len(cases))[:max_cases])
        cases = [cases[i] for i in keep]
    rows = []
    t0 = time.time()
    for gname, geom, n, dtype, layout, neox in cases:
        try:
            r = check_case(n, geom, dtype, layout, neox)
        except Exception as e:  # keep going: one failure must not hide the rest  # noqa: BLE001
            traceback.print_exc()
            r = {"error": repr(e)[:300]}
        rows.append({"geometry": gname, "num_tokens": n, "dtype": dtype, "layout": layout,
                         "style": "neox" if neox else "gptj", "result": r})
        flag = "OK" if "error" not in r and all(v["diff"] == 0 for v in r.values()) else "DIFF"
        print(f"[bits] {gname:8s} n={n:5d} {dtype:9s} {layout:11s} {'neox' if neox else 'gptj'}: {flag} "
              + " ".join(f"{k}={v['diff']}/{v['max_ulp']}" for k, v in r.items() if isinstance(v, dict)),
              flush=True)
    print(f"[bits] {len(cases)} cases in {time.time() - t0:.1f}s", flush=True)
    return rows


# ----------------------------------------------------------------------------------- timing


def time_torch_graph(fn, iters=20, reps=15):
    """Median microseconds per fn() call, replaying a CUDA graph of `iters` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


def time_torch_events(fn, iters=20, reps=15):
    """Median microseconds per call with CUDA events around plain launches (no graph)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


def time_jax_loop(step, carry, consts, iters=20, reps=15):
    """Median microseconds per step: one jit of `iters` chained (unrolled) steps, carry donated.

    Unrolled rather than a fori_loop: XLA's while loop adds a per-iteration predicate round trip
    that is larger than the kernel at 1024 tokens.
    """

    @functools.partial(jax.jit, donate_argnums=(0,))
    def loop(carry, consts):
        for _ in range(iters):
            carry = step(carry, consts)
        return carry

    carry = loop(carry, consts)
    jax.block_until_ready(carry)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        carry = loop(carry, consts)
        jax.block_until_ready(carry)
        times.append((time.perf_counter() - t) * 1e6 / iters)
    return statistics.median(times)


def time_jax_calls(fn, carry, consts, iters=50, reps=9):
    """Median microseconds per call of a donated jitted fn (Python dispatch included)."""
    carry = fn(*carry, *consts)
    jax.block_until_ready(carry)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            carry = fn(*carry, *consts)
        jax.block_until_ready(carry)
        times.append((time.perf_counter() - t) * 1e6 / iters)
    return statistics.median(times)


def time_size(n, sweep):
    hq, hk, hs, rd = 28, 4, 128, 128
    sections = [16, 24, 24]
    max_position = 128000
    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, hq * hs, generator=g).to(torch.bfloat16).to(DEV)
    k = torch.randn(n, hk * hs, generator=g).to(torch.bfloat16).to(DEV)
    inv = 1.0 / (1000000.0 ** (torch.arange(rd // 2, dtype=torch.float64) * 2 / rd))
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1).float().to(DEV)
    pos = torch.stack([torch.arange(n), torch.randint(0, 64, (n,), generator=g),
                       torch.randint(0, 64, (n,), generator=g)]).to(DEV)
    cos, sin = cache[pos].chunk(2, -1)
    cos, sin = cos.contiguous(), sin.contiguous()
    qk_bytes = 2 * (q.numel() + k.numel()) * 2  # bf16 read + written
    table_bytes = 2 * n * (rd // 2) * 4  # one float32 cos and sin value per token and frequency
    pos_bytes = pos.numel() * pos.element_size()
    byts = {"table": qk_bytes + table_bytes, "cache": qk_bytes + table_bytes + pos_bytes}
    args = (sections, hs, rd, False, True)
    row = {"num_tokens": n, "bytes_table": byts["table"], "bytes_cache": byts["cache"]}

    def record(name, us, kind):
        row[name] = {"us": us, "TBps": byts[kind] / (us * 1e-6) / 1e12,
                     "of_copy_ceiling": byts[kind] / (us * 1e-6) / COPY_CEILING}
        print(f"[time] n={n:6d} {name:32s} {us:9.2f} us  {row[name]['TBps']:.2f} TB/s", flush=True)

    def attempt(name, kind, fn):
        try:
            record(name, fn(), kind)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            row[name] = {"error": repr(e)[:300]}

    # Block-size sweep for the Triton kernel (the Pallas kernel then takes the winner).
    best = {"table": (None, None, None), "cache": (None, None, None)}
    if sweep:
        for form in ("table", "cache"):
            cands = []
            for bt, bh, nw in [(bt, bh, nw) for bt in (2, 4, 8, 16) for bh in (4, 8) for nw in (2, 4, 8)
                               if bt * bh <= 64]:
                kw = {"block_tokens": bt, "block_heads": bh, "num_warps": nw}
                try:
                    if form == "table":
                        us = time_torch_graph(lambda kw=kw: kt.mrope_(q, k, cos, sin, *args, **kw),
                                              iters=10, reps=5)
                    else:
                        us = time_torch_graph(lambda kw=kw: kt.mrope_from_cache_(
                            pos, q, k, cache, *args, check_positions=False, **kw), iters=10, reps=5)
                    cands.append((us, bt, bh, nw))
                except Exception as e:  # noqa: BLE001
                        print(f"[sweep] {form} bt={bt} bh={bh} nw={nw} failed: {e!r}"[:300], flush=True)
            if cands:
                us, bt, bh, nw = min(cands)
                best[form] = (bt, bh, nw)
                row[f"sweep_{form}"] = [{"us": u, "block_tokens": b, "block_heads": h, "num_warps": w}
                                        for u, b, h, w in cands]
                print(f"[sweep] n={n} {form}: best block_tokens={bt} block_heads={bh} num_warps={nw} "
                      f"({us:.2f} us)", flush=True)
    row["best_blocks"] = {f: {"block_tokens": b[0], "block_heads": b[1], "num_warps": b[2]} for f, b in best.items()}
    bkw = {f: {"block_tokens": b[0], "block_heads": b[1], "num_warps": b[2]} for f, b in best.items()}

    attempt("torch_native", "table", lambda: time_torch_graph(lambda: kt.mrope_native(q, k, cos, sin, *args)))
    attempt("torch_native_gather", "cache",
            lambda: time_torch_graph(lambda: kt.mrope_from_cache_native(pos, q, k, cache, *args)))
    attempt("triton_inplace_default", "table",
            lambda: time_torch_graph(lambda: kt.mrope_(q, k, cos, sin, *args)))
    attempt("triton_inplace", "table",
            lambda: time_torch_graph(lambda: kt.mrope_(q, k, cos, sin, *args, **bkw["table"])))
    attempt("triton_inplace_no_graph", "table",
            lambda: time_torch_events(lambda: kt.mrope_(q, k, cos, sin, *args, **bkw["table"])))
    attempt("triton_fused_gather", "cache", lambda: time_torch_graph(
        lambda: kt.mrope_from_cache_(pos, q, k, cache, *args, check_positions=False, **bkw["cache"])))
    attempt("gather_only(cache[positions])", "cache", lambda: time_torch_graph(lambda: cache[pos]))

    def gather_then_kernel():
        c, s = cache[pos].chunk(2, -1)
        kt.mrope_(q, k, c, s, *args, **bkw["table"])  # .contiguous() copies the two halves

    attempt("gather+triton_kernel", "cache", lambda: time_torch_graph(gather_then_kernel))

    jq, jk = jax_from_torch(q), jax_from_torch(k)
    jc, js = jax_from_torch(cos), jax_from_torch(sin)
    jpos, jcache = jax_from_torch(pos.int()), jax_from_torch(cache)
    kw = {"mrope_section": sections, "head_size": hs, "rotary_dim": rd}
    for form, blocks in (("default", {}), ("tuned", bkw["table"])):
        p_table = functools.partial(kp.mrope, **kw, **blocks)
        attempt(f"pallas_donated_{form}", "table", lambda p=p_table: time_jax_loop(
            lambda c, x: p(c[0], c[1], x[0], x[1]), (jnp.copy(jq), jnp.copy(jk)), (jc, js)))
    p_cache = functools.partial(kp.mrope_from_cache, **kw, **bkw["cache"])
    attempt("pallas_fused_gather", "cache", lambda: time_jax_loop(
        lambda c, x: p_cache(x[0], c[0], c[1], x[1]), (jnp.copy(jq), jnp.copy(jk)), (jpos, jcache)))
    p_calls = jax.jit(functools.partial(kp.mrope, **kw, **bkw["table"]), donate_argnums=(0, 1))
    attempt("pallas_donated_per_call", "table",
            lambda: time_jax_calls(p_calls, (jnp.copy(jq), jnp.copy(jk)), (jc, js)))
    nat = functools.partial(kp.mrope_native, **kw)
    attempt("jnp_native", "table", lambda: time_jax_loop(
        lambda c, x: nat(c[0], c[1], x[0], x[1]), (jnp.copy(jq), jnp.copy(jk)), (jc, js)))
    nat_c = functools.partial(kp.mrope_from_cache_native, **kw)
    attempt("jnp_native_gather", "cache", lambda: time_jax_loop(
        lambda c, x: nat_c(x[0], c[0], c[1], x[1]), (jnp.copy(jq), jnp.copy(jk)), (jpos, jcache)))
    if "gather_only(cache[positions])" in row and "us" in row["gather_only(cache[positions])"]:
        row["engine_whole_path_us(est)"] = ENGINE_KERNEL_US.get(n, float("nan")) + row[
            "gather_only(cache[positions])"]["us"]
    return row


def run_timing(sizes, sweep):
    results = []
    for n in sizes:
        results.append(time_size(n, sweep))
        torch.cuda.empty_cache()
    return results


def table(results):
    names = ["torch_native", "torch_native_gather", "jnp_native", "jnp_native_gather",
             "triton_inplace_default", "triton_inplace", "triton_inplace_no_graph", "pallas_donated_default",
             "pallas_donated_tuned", "pallas_donated_per_call", "gather_only(cache[positions])",
             "gather+triton_kernel", "triton_fused_gather", "pallas_fused_gather"]
    sizes = [r["num_tokens"] for r in results]
    lines = ["| form | " + " | ".join(f"{n} tokens: µs (TB/s, % of 4.26)" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for name in names:
        cells = []
        for r in results:
            v = r.get(name, {})
            cells.append(f"{v['us']:.1f} ({v['TBps']:.2f}, {100 * v['of_copy_ceiling']:.0f}%)" if "us" in v
                         else v.get("error", "-")[:40])
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| engine Triton kernel (target) | " + " | ".join(f"{ENGINE_KERNEL_US.get(n, '-')}" for n in sizes) + " |")
    lines.append("| engine gather + kernel (est.) | " + " | ".join(
        f"{r.get('engine_whole_path_us(est)', float('nan')):.1f}" for r in results) + " |")
    lines.append("| engine torch-native (target) | " + " | ".join(f"{ENGINE_NATIVE_US.get(n, '-')}" for n in sizes) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--quick", action="store_true", help="small correctness shapes only")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--skip-bits", action="store_true")
    ap.add_argument("--max-bits-cases", type=int, default=None)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    env = {"python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__,
               "triton": triton.__version__, "jax_backend": jax.default_backend(),
               "device": torch.cuda.get_device_name() if GPU else "cpu",
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=False).stdout.strip()
    except Exception as e:  # noqa: BLE001
        env["nvidia_smi"] = repr(e)
    print(json.dumps(env), flush=True)
    report = {"env": env}
    path = os.path.join(a.out, "mrope_gpu.json")
    if not a.skip_bits:
        report["bit_identity"] = run_correctness(a.quick, a.max_bits_cases)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    if GPU:
        report["timing"] = run_timing([int(s) for s in a.sizes.split(",")], not a.no_sweep)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        md = table(report["timing"])
        with open(os.path.join(a.out, "mrope_gpu.md"), "w") as f:
            f.write(md + "\n")
    bits = report.get("bit_identity", [])
    bad = [b for b in bits if "error" in b["result"] or any(
        v["diff"] for k, v in b["result"].items() if k in ("pallas", "pallas_cache", "triton_cache"))]
    print(f"\nbit identity Pallas vs Triton: {len(bits) - len(bad)}/{len(bits)} cases identical")
    refs = {name: (sum(b["result"].get(name, {}).get("diff", 0) > 0 for b in bits),
                   max([b["result"].get(name, {}).get("max_ulp", 0) for b in bits] or [0]))
            for name in ("torch_native", "jnp_native", "pallas_vs_jnp_native")}
    print("references (cases differing, max ULP):", refs)
    if GPU:
        print()
        print(md)


if __name__ == "__main__":
    main()
