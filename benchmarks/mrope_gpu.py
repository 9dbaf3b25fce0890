"""MRoPE on one GPU: Pallas vs Triton bit identity, then timings at Qwen2.5-VL-7B shapes.

    python -m benchmarks.mrope_gpu --out $OUT

(a) Bit identity on the feature matrix (NeoX/GPT-J x chunked/interleaved/text x full/partial
    rotary x float32/bfloat16 (+ float16 spot checks) x a few token counts): Pallas ``mrope`` and
    ``mrope_from_cache`` (jitted) against Triton's, and each against its framework's reference.
    Mismatches are reported as element counts and max ULP.  Then the cotangents of
    ``sum(w * mrope(...))`` in four cases: Pallas against Triton, torch's autograd and JAX's
    autodiff of the references (dq/dk are the kernel run with -sin; dcos/dsin sum over heads).
(b) Timings for 1024 / 8192 / 32768 tokens (28 q heads, 4 kv heads, head 128, rotary 128, sections
    [16, 24, 24], bf16, NeoX, chunked), default tiles: torch-native, Triton in place (table and
    fused gather), the gather + kernel path, Pallas donated (table and fused gather).  Every form
    gets its GPU kernel time from CUPTI (torch.profiler also sees JAX's kernels; median of 20
    calls), and the time per call of the form a user runs: torch as CUDA-graph replays of 20
    calls (CUDA events), JAX as one jit of 20 and of 100 chained donated calls (perf_counter +
    block_until_ready; the difference gives the marginal wall time per call).  Calls rotate over
    as many q/k sets as make 200 MB, so the 50 MB L2 does not serve them.  Bandwidth = bytes read
    + written / time, against the copy ceiling measured at the start of the run.

Writes ``mrope_gpu.json`` under ``--out`` and prints a markdown table last.  Without a GPU it runs
a small correctness smoke test in interpret mode (needs TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np
import torch
import triton
from torch.profiler import ProfilerActivity, profile

import kernels_pallas as kp
import kernels_triton as kt
from benchmarks.timing import copy_bandwidth, graph_per_call_ms
from jax_impl import parity

ENGINE_KERNEL_US = {1024: 10.2, 8192: 39.8, 32768: 139.0}  # serving engine's Triton MRoPE kernel
ENGINE_NATIVE_US = {1024: 156.0, 8192: 313.0, 32768: 1103.0}  # its torch-native path

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
TORCH_DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
JAX_DT = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ------------------------------------------------------------------------------------- bits


def compare(a, b):
    """(elements that differ, max ULP distance) of two arrays of one dtype (torch on any device, or jax)."""
    a, b = (parity.as_numpy(x.detach().cpu() if isinstance(x, torch.Tensor) else x) for x in (a, b))
    if a.shape != b.shape:
        return -1, -1
    d = parity.ulp_distance(a, b)
    return int(np.count_nonzero(d)), int(d.max()) if d.size else 0


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
    base = res["triton"]
    for name, val in res.items():
        cmp = [compare(base[i], val[i]) for i in range(2)]
        out[name] = {"diff": cmp[0][0] + cmp[1][0], "max_ulp": max(cmp[0][1], cmp[1][1])}
    # Each kernel vs its own framework's reference.
    c = [compare(res["pallas"][i], res["jnp_native"][i]) for i in range(2)]
    out["pallas_vs_jnp_native"] = {"diff": c[0][0] + c[1][0], "max_ulp": max(c[0][1], c[1][1])}
    return out


def check_gradients(n, dtype, layout, neox):
    """Cotangents of sum(w * mrope(...)) through Pallas, Triton and both references on one device:
    per input, elements whose bits differ from Pallas's and the max abs difference."""
    hq, hk, hs, rd = 28, 4, 128, 128
    streams = 1 if layout == "text" else 3
    sections = None if layout == "text" else [16, 24, 24]
    q, k, cos, sin, _, _ = make_inputs(n + 5, n, hq, hk, hs, rd, dtype, streams)
    g = torch.Generator().manual_seed(n)
    wq, wk = (torch.randn(x.shape, generator=g).to(DEV) for x in (q, k))
    args = (sections, hs, rd, layout == "interleaved", neox)

    def torch_grads(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, cos, sin)]
        oq, ok = fn(*leaves, *args)
        ((oq.float() * wq).sum() + (ok.float() * wk).sum()).backward()
        return [t.grad for t in leaves]

    def jax_grads(fn):
        def loss(*xs):
            oq, ok = fn(*xs, *args)
            return (oq.astype(jnp.float32) * jax_from_torch(wq)).sum() + (ok.astype(jnp.float32) * jax_from_torch(wk)).sum()
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*map(jax_from_torch, (q, k, cos, sin)))

    grads = {"pallas": jax_grads(kp.mrope), "jnp_native": jax_grads(kp.mrope_native),
             "triton": torch_grads(kt.mrope), "torch_native": torch_grads(kt.mrope_native)}
    out = {}
    for name in ("triton", "torch_native", "jnp_native"):
        out[name] = {}
        for i, what in enumerate(("dq", "dk", "dcos", "dsin")):
            a, b = grads["pallas"][i], grads[name][i]
            diff, ulp = compare(a, b)
            a = np.asarray(a.astype(jnp.float32))
            b = np.asarray(b.astype(jnp.float32)) if name == "jnp_native" else b.float().cpu().numpy()
            out[name][what] = {"diff": diff, "max_ulp": ulp, "max_abs": float(np.abs(a - b).max()),
                               "max_value": float(np.abs(a).max())}
    return out


def run_gradients():
    rows = []
    for n, dtype, layout, neox in ((37, "float32", "chunked", True), (1000, "bfloat16", "chunked", True),
                                   (37, "bfloat16", "interleaved", False), (1000, "float32", "text", False)):
        try:
            r = check_gradients(n, dtype, layout, neox)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            r = {"error": repr(e)[:300]}
        rows.append({"num_tokens": n, "dtype": dtype, "layout": layout, "style": "neox" if neox else "gptj",
                     "result": r})
        print(f"[grad] n={n:5d} {dtype:9s} {layout:11s} {'neox' if neox else 'gptj'}: " + " ".join(
            f"{name}:" + ",".join(f"{w}={v['diff']}/{v['max_abs']:.1e}" for w, v in d.items())
            for name, d in r.items() if isinstance(d, dict)), flush=True)
    return rows


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

NOT_KERNEL = re.compile("memcpy|memset|copy", re.IGNORECASE)
ROTATE_BYTES = 200e6  # q/k sets per size: calls rotate over them so the 50 MB L2 cannot hold them


def kernel_us(run):
    """(median GPU µs, count) of the kernels run() launches (CUPTI; copies and memsets left out)."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    d = [e.device_time_total for e in prof.events()
         if e.device_type == torch.autograd.DeviceType.CUDA and not NOT_KERNEL.search(e.name)]
    return (statistics.median(d) if d else float("nan")), len(d)


def graph_us(fn, iters=20, reps=15):
    """Median µs per fn(j) call, j = 0..iters-1, replaying a CUDA graph of the iters calls."""
    return 1e3 * graph_per_call_ms(fn, iters, reps)


def events_us(fn, iters=20, reps=15):
    """Median µs per fn(j) call with CUDA events around plain launches (no graph)."""
    for j in range(3):
        fn(j)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for j in range(iters):
            fn(j)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


def jax_chain(step, num_sets, iters):
    """One jit of `iters` calls of step(q, k, *consts) -> (q, k), call j on set j % num_sets, donated."""

    @functools.partial(jax.jit, donate_argnums=(0,))
    def chain(sets, consts):
        sets = list(sets)
        for j in range(iters):
            sets[j % num_sets] = step(*sets[j % num_sets], *consts)
        return tuple(sets)

    return chain


def jax_wall_us(chain, sets, consts, iters, reps=15):
    """Median wall µs per call of a chain (block_until_ready + perf_counter); returns the sets too."""
    sets = chain(sets, consts)
    jax.block_until_ready(sets)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        sets = chain(sets, consts)
        jax.block_until_ready(sets)
        times.append((time.perf_counter() - t) * 1e6 / iters)
    return statistics.median(times), sets


def time_size(n, ceiling):
    hq, hk, hs, rd = 28, 4, 128, 128
    sections = [16, 24, 24]
    max_position = 128000
    g = torch.Generator().manual_seed(n)
    qk_bytes = 2 * n * (hq + hk) * hs * 2  # bf16 read + written
    num_sets = max(1, round(ROTATE_BYTES / qk_bytes))
    qs = [torch.randn(n, hq * hs, generator=g).to(torch.bfloat16).to(DEV) for _ in range(num_sets)]
    ks = [torch.randn(n, hk * hs, generator=g).to(torch.bfloat16).to(DEV) for _ in range(num_sets)]
    inv = 1.0 / (1000000.0 ** (torch.arange(rd // 2, dtype=torch.float64) * 2 / rd))
    ang = torch.arange(max_position, dtype=torch.float64)[:, None] * inv[None, :]
    cache = torch.cat([ang.cos(), ang.sin()], -1).float().to(DEV)
    pos = torch.stack([torch.arange(n), torch.randint(0, 64, (n,), generator=g),
                       torch.randint(0, 64, (n,), generator=g)]).to(DEV)
    cos, sin = cache[pos].chunk(2, -1)
    cos, sin = cos.contiguous(), sin.contiguous()
    table_bytes = 2 * n * (rd // 2) * 4  # one float32 cos and sin value per token and frequency
    byts = {"table": qk_bytes + table_bytes, "cache": qk_bytes + table_bytes + pos.numel() * pos.element_size()}
    args = (sections, hs, rd, False, True)
    row = {"num_tokens": n, "q_k_sets": num_sets, "bytes_table": byts["table"], "bytes_cache": byts["cache"]}

    def record(name, kind, **times):
        row[name] = {}
        for key, us in times.items():
            row[name][key] = us
            if key.endswith("_us") and not math.isnan(us):
                row[name][key[:-3] + "_of_copy"] = byts[kind] / (us * 1e-6) / (ceiling * 1e12)
        print(f"[time] n={n:6d} {name:28s} " + " ".join(f"{k}={v:.2f}" for k, v in row[name].items()), flush=True)

    def attempt(name, kind, fn):
        try:
            record(name, kind, **fn())
        except Exception as e:  # noqa: BLE001  keep what was measured
            traceback.print_exc()
            row[name] = {"error": repr(e)[:300]}

    def torch_form(fn):
        """Kernel time (CUPTI) and CUDA-graph time per call, rotating over the q/k sets."""
        k_us, _ = kernel_us(lambda: [fn(qs[j % num_sets], ks[j % num_sets]) for j in range(20)])
        return {"kernel_us": k_us, "graph_us": graph_us(lambda j: fn(qs[j % num_sets], ks[j % num_sets]))}

    attempt("torch_native", "table", lambda: {"graph_us": graph_us(
        lambda j: kt.mrope_native(qs[j % num_sets], ks[j % num_sets], cos, sin, *args))})
    attempt("triton_inplace", "table", lambda: torch_form(lambda q, k: kt.mrope_(q, k, cos, sin, *args)))
    attempt("triton_inplace_no_graph", "table", lambda: {"events_us": events_us(
        lambda j: kt.mrope_(qs[j % num_sets], ks[j % num_sets], cos, sin, *args))})
    attempt("triton_fused_gather", "cache", lambda: torch_form(
        lambda q, k: kt.mrope_from_cache_(pos, q, k, cache, *args, check_positions=False)))
    attempt("gather_only", "cache", lambda: {"graph_us": graph_us(lambda j: cache[pos])})

    def gather_then_kernel(q, k):
        c, s = cache[pos].chunk(2, -1)
        kt.mrope_(q, k, c, s, *args)  # .contiguous() inside copies the two halves

    attempt("gather+triton_kernel", "cache", lambda: {"graph_us": graph_us(
        lambda j: gather_then_kernel(qs[j % num_sets], ks[j % num_sets]))})

    kw = {"mrope_section": sections, "head_size": hs, "rotary_dim": rd}
    jconsts = {"table": (jax_from_torch(cos), jax_from_torch(sin)),
               "cache": (jax_from_torch(pos.int()), jax_from_torch(cache))}
    steps = {"table": lambda q, k, c, s: kp.mrope(q, k, c, s, **kw),
             "cache": lambda q, k, p, c: kp.mrope_from_cache(p, q, k, c, **kw)}

    def jax_form(kind):
        """Kernel time (CUPTI), wall per call in a jit of 20 chained donated calls, and the marginal
        wall per call (a jit of 100 against one of 20: what one more call costs inside a program)."""
        sets = tuple((jax_from_torch(q), jax_from_torch(k)) for q, k in zip(qs, ks))
        chain20, chain100 = (jax_chain(steps[kind], num_sets, it) for it in (20, 100))
        state = {"sets": sets}

        def run():
            state["sets"] = chain20(state["sets"], jconsts[kind])
            jax.block_until_ready(state["sets"])

        k_us, _ = kernel_us(run)
        w20, sets = jax_wall_us(chain20, state["sets"], jconsts[kind], 20)
        w100, _ = jax_wall_us(chain100, sets, jconsts[kind], 100)
        return {"kernel_us": k_us, "chain20_wall_us": w20, "marginal_wall_us": (100 * w100 - 20 * w20) / 80}

    attempt("pallas_donated", "table", lambda: jax_form("table"))
    attempt("pallas_fused_gather", "cache", lambda: jax_form("cache"))
    per_call = jax.jit(steps["table"], donate_argnums=(0, 1))

    def pallas_per_call():
        state = [jax_from_torch(qs[0]), jax_from_torch(ks[0])]
        state = list(per_call(*state, *jconsts["table"]))
        jax.block_until_ready(state)
        times = []
        for _ in range(9):
            t = time.perf_counter()
            for _ in range(50):
                state = list(per_call(*state, *jconsts["table"]))
            jax.block_until_ready(state)
            times.append((time.perf_counter() - t) * 1e6 / 50)
        return {"dispatch_wall_us": statistics.median(times)}

    attempt("pallas_donated_per_call", "table", pallas_per_call)
    if "graph_us" in row.get("gather_only", {}):
        row["engine_whole_path_us(est)"] = ENGINE_KERNEL_US.get(n, float("nan")) + row["gather_only"]["graph_us"]
    return row


def run_timing(sizes):
    ceiling = copy_bandwidth() / 1e12
    print(f"[time] copy ceiling {ceiling:.2f} TB/s", flush=True)
    results = []
    for n in sizes:
        results.append(time_size(n, ceiling))
        torch.cuda.empty_cache()
    return ceiling, results


TABLE_ROWS = [
    ("torch_native", "graph_us", "torch-native reference (`mrope_native`), CUDA graph"),
    ("triton_inplace", "kernel_us", "**Triton `mrope_`**, kernel"),
    ("triton_inplace", "graph_us", "Triton `mrope_`, CUDA graph of 20 calls"),
    ("triton_inplace_no_graph", "events_us", "Triton `mrope_`, Python launches"),
    ("triton_fused_gather", "kernel_us", "**Triton fused gather `mrope_from_cache_`**, kernel"),
    ("triton_fused_gather", "graph_us", "Triton fused gather, CUDA graph"),
    ("gather_only", "graph_us", "gather `cache[positions]` alone"),
    ("gather+triton_kernel", "graph_us", "gather + chunk + Triton kernel (unfused), CUDA graph"),
    ("pallas_donated", "kernel_us", "**Pallas `mrope`** (donated), kernel"),
    ("pallas_donated", "marginal_wall_us", "Pallas `mrope`, marginal wall per call in a jit"),
    ("pallas_donated", "chain20_wall_us", "Pallas `mrope`, jit of 20 calls, wall / 20"),
    ("pallas_donated_per_call", "dispatch_wall_us", "Pallas `mrope`, one jitted call per step"),
    ("pallas_fused_gather", "kernel_us", "**Pallas fused gather `mrope_from_cache`**, kernel"),
    ("pallas_fused_gather", "marginal_wall_us", "Pallas fused gather, marginal wall per call"),
]


def table(ceiling, results):
    sizes = [r["num_tokens"] for r in results]
    lines = [f"| form (µs; % of the {ceiling:.2f} TB/s copy ceiling) | " + " | ".join(f"{n} tokens" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for name, key, label in TABLE_ROWS:
        cells = []
        for r in results:
            v = r.get(name, {})
            pct = v.get(key[:-3] + "_of_copy")
            cells.append(f"{v[key]:.1f}" + (f" ({100 * pct:.0f}%)" if pct else "") if key in v
                         else v.get("error", "-")[:40])
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| target: engine Triton kernel | " + " | ".join(f"{ENGINE_KERNEL_US.get(n, '-')}" for n in sizes) + " |")
    lines.append("| target: engine gather + kernel (est.) | " + " | ".join(
        f"{r.get('engine_whole_path_us(est)', float('nan')):.1f}" for r in results) + " |")
    lines.append("| target: engine torch-native | " + " | ".join(f"{ENGINE_NATIVE_US.get(n, '-')}" for n in sizes) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--quick", action="store_true", help="small correctness shapes only")
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
        if GPU:
            report["gradients"] = run_gradients()
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    if GPU:
        report["copy_ceiling_TBps"], report["timing"] = run_timing([int(s) for s in a.sizes.split(",")])
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        md = table(report["copy_ceiling_TBps"], report["timing"])
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
