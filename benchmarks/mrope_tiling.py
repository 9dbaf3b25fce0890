"""Which MRoPE tiling and code shape reach the copy ceiling on the GPU, in Triton and in Pallas?

    python3 benchmarks/mrope_tiling.py --out $OUT [--only pallas --tag no_cmd_buffer]

Same computation, same bits (checked for every form) as the packages' kernels, at Qwen2.5-VL-7B
shapes (28/4 heads, head 128, sections [16, 24, 24], bf16, NeoX, chunked):

* ``head-major``: the packages' kernels as they are, grid ``(head blocks of q then k, token
  blocks)``; each program loads its token block's cos/sin again (8 programs per token block).
* ``token-major``: defined here, grid ``(token blocks,)``; each program loads the cos/sin rows of
  its tokens once and rotates every q head block, then every k head block.  Knobs: block sizes,
  warps, 32-bit offsets, the bf16 rounding by ``cvt.rn`` or by integer ops, an ``evict_first``
  hint on the q/k loads.

Times: GPU kernel duration from CUPTI (torch.profiler sees JAX's kernels too), median over 20
calls; and wall time per call of the form users run: a CUDA graph of 20 in-place calls (Triton),
one jit of 20 chained donated calls (Pallas).  Calls rotate over enough q/k sets to total 200 MB,
so the 50 MB L2 does not hold the data between calls (``hot`` forms reuse one set).  One chained
Pallas call is also profiled as a timeline (kernel starts and gaps) to see where its wall time
beyond the kernels goes.  The copy ceiling is measured in the same run, after the GPU has warmed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import torch
import triton
import triton.language as tl
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from torch.profiler import ProfilerActivity, profile

import kernels_pallas.rotary_mrope as pm
import kernels_triton.rotary_mrope as tm

HQ, HK, HS, RD, SECTIONS = 28, 4, 128, 128, (16, 24, 24)
HALF = RD // 2
ROTATE_BYTES = 200e6
# The same constants as Triton globals (a @triton.jit function reads only constexpr globals).
T_HQ, T_HK, T_HS, T_HALF = (tl.constexpr(v) for v in (HQ, HK, HS, HALF))
T_ST, T_SH, T_SW = (tl.constexpr(v) for v in SECTIONS)


# ------------------------------------------------------------------ token-major variants


@triton.jit
def _tile_triton(x_ptr, stride_x, tok, t_mask, h0, cos, sin, NUM_HEADS: tl.constexpr,
                 BLOCK_H: tl.constexpr, OFFS64: tl.constexpr, CVT_ROUND: tl.constexpr,
                 EVICT: tl.constexpr):
    h = h0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, T_HALF)
    row = tok.to(tl.int64) * stride_x if OFFS64 else tok * stride_x
    mask = t_mask[:, None, None] & (h < NUM_HEADS)[None, :, None]
    p1 = x_ptr + row[:, None, None] + (h * T_HS)[None, :, None] + i[None, None, :]
    p2 = p1 + T_HALF
    policy: tl.constexpr = "evict_first" if EVICT else ""
    x1 = tl.load(p1, mask=mask, other=0.0, eviction_policy=policy).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0, eviction_policy=policy).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if CVT_ROUND:
        tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(p2, o2.to(x_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(p1, tm._round_to(o1, x_ptr.dtype.element_ty), mask=mask)
        tl.store(p2, tm._round_to(o2, x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_major_triton(q_ptr, k_ptr, cos_ptr, sin_ptr, num_tokens, stride_q, stride_k,
                        BLOCK_T: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                        OFFS64: tl.constexpr, CVT_ROUND: tl.constexpr, EVICT: tl.constexpr):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < num_tokens
    i = tl.arange(0, T_HALF)
    sel = tm._stream_of_frequency(i, 3, T_ST, T_SH, T_SW, False)
    offs = (sel[None, :] * num_tokens + tok[:, None]) * T_HALF + i[None, :]
    cs_mask = t_mask[:, None] & (i < T_HALF)[None, :]
    cos = tl.load(cos_ptr + offs, mask=cs_mask, other=0.0)[:, None, :]
    sin = tl.load(sin_ptr + offs, mask=cs_mask, other=0.0)[:, None, :]
    for h0 in tl.static_range(0, T_HQ, BLOCK_HQ):
        _tile_triton(q_ptr, stride_q, tok, t_mask, h0, cos, sin, T_HQ, BLOCK_HQ, OFFS64, CVT_ROUND, EVICT)
    for h0 in tl.static_range(0, T_HK, BLOCK_HK):
        _tile_triton(k_ptr, stride_k, tok, t_mask, h0, cos, sin, T_HK, BLOCK_HK, OFFS64, CVT_ROUND, EVICT)


def triton_token_major(q, k, cos, sin, bt, bh, nw, offs64=True, cvt=False, evict=False):
    n = q.shape[0]
    _token_major_triton[(triton.cdiv(n, bt),)](
        q, k, cos, sin, n, q.stride(0), k.stride(0), BLOCK_T=bt, BLOCK_HQ=bh, BLOCK_HK=min(bh, HK),
        OFFS64=offs64, CVT_ROUND=cvt, EVICT=evict, num_warps=nw, enable_fp_fusion=False)
    return q, k


def _tile_pallas(x_in, x_out, tok, t_mask, h0, cos, sin, *, num_heads, block_h, evict):
    h = h0 + jnp.arange(block_h, dtype=jnp.int32)
    i = jnp.arange(HALF, dtype=jnp.int32)
    off1 = (tok[:, None, None] * num_heads + h[None, :, None]) * HS + i[None, None, :]
    off2 = off1 + HALF
    mask = jnp.broadcast_to(t_mask[:, None, None] & (h < num_heads)[None, :, None], off1.shape)
    policy = "evict_first" if evict else None
    x1 = pltriton.load(x_in.at[off1], mask=mask, other=0, eviction_policy=policy).astype(jnp.float32)
    x2 = pltriton.load(x_in.at[off2], mask=mask, other=0, eviction_policy=policy).astype(jnp.float32)
    o1, o2 = pm._rotate(x1, x2, cos, sin, compiled_gpu=True)
    pltriton.store(x_out.at[off1], o1.astype(x_out.dtype), mask=mask)
    pltriton.store(x_out.at[off2], o2.astype(x_out.dtype), mask=mask)


def _token_major_pallas(q_in, k_in, cos_ref, sin_ref, q_out, k_out, *, num_tokens, bt, bh, evict):
    tok = pl.program_id(0) * bt + jnp.arange(bt, dtype=jnp.int32)
    t_mask = tok < num_tokens
    i = jnp.arange(HALF, dtype=jnp.int32)
    sel = pm._stream_of_frequency(i, 3, SECTIONS, False)
    offs = (sel[None, :] * num_tokens + tok[:, None]) * HALF + i[None, :]
    mask = jnp.broadcast_to(t_mask[:, None], offs.shape)
    cos = pltriton.load(cos_ref.at[offs], mask=mask, other=0)[:, None, :]
    sin = pltriton.load(sin_ref.at[offs], mask=mask, other=0)[:, None, :]
    tile = functools.partial(_tile_pallas, tok=tok, t_mask=t_mask, cos=cos, sin=sin, evict=evict)
    for h0 in range(0, HQ, bh):
        tile(q_in, q_out, h0=h0, num_heads=HQ, block_h=bh)
    for h0 in range(0, HK, min(bh, HK)):
        tile(k_in, k_out, h0=h0, num_heads=HK, block_h=min(bh, HK))


def pallas_token_major(q, k, cos, sin, bt, bh, nw, evict=False):
    n = q.shape[0]
    kernel = functools.partial(_token_major_pallas, num_tokens=n, bt=bt, bh=bh, evict=evict)
    qo, ko = pl.pallas_call(
        kernel, grid=(pl.cdiv(n, bt),),
        out_shape=(jax.ShapeDtypeStruct((q.size,), q.dtype), jax.ShapeDtypeStruct((k.size,), k.dtype)),
        input_output_aliases={0: 0, 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=nw, num_stages=1),
        name="mrope_token_major",
    )(q.reshape(-1), k.reshape(-1), cos.reshape(-1), sin.reshape(-1))
    return qo.reshape(q.shape), ko.reshape(k.shape)


# ------------------------------------------------------------------------------ timing

NOT_KERNEL = re.compile("memcpy|memset|copy", re.IGNORECASE)


def cupti_kernels(run):
    """[(name, start µs, duration µs)] of the GPU kernels run() launches (copies listed too)."""
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(((e.name, e.time_range.start, e.device_time_total) for e in evs), key=lambda r: r[1])


def kernel_median(events):
    d = [dur for name, _, dur in events if not NOT_KERNEL.search(name)]
    return (statistics.median(d) if d else float("nan")), len(d)


def graph_us(fn, iters=20, reps=15):
    """Median µs per fn(j) call, j = 0..iters-1, replaying a CUDA graph of the iters calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for j in range(3):
            fn(j)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for j in range(iters):
            fn(j)
    g.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(out)


def jax_chain(step, num_sets, iters=20):
    """jit of `iters` donated calls, call j rotating set j % num_sets."""

    @functools.partial(jax.jit, donate_argnums=(0,))
    def chain(sets, cos, sin):
        sets = list(sets)
        for j in range(iters):
            s = j % num_sets
            sets[s] = step(*sets[s], cos, sin)
        return tuple(sets)

    return chain


def jax_wall_us(chain, sets, cos, sin, iters=20, reps=15):
    sets = chain(sets, cos, sin)
    jax.block_until_ready(sets)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        sets = chain(sets, cos, sin)
        jax.block_until_ready(sets)
        out.append((time.perf_counter() - t) * 1e6 / iters)
    return statistics.median(out), sets


def to_jax(t):
    return jax.dlpack.from_dlpack(t.contiguous())


def copy_ceiling():
    """TB/s read + written by a 1 GiB device-to-device copy, CUDA events around each (median of 20).

    Not a graph replay: a memcpy node in a CUDA graph runs on a copy engine at about 2.8 TB/s.
    """
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return 2 * src.numel() / statistics.median(times[3:]) / 1e12


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sizes", default="1024,8192,32768")
    ap.add_argument("--only", choices=("all", "pallas"), default="all")
    ap.add_argument("--tag", default="default")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "jax": jax.__version__, "torch": torch.__version__,
              "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": []}
    path = os.path.join(a.out, f"mrope_tiling_{a.tag}.json")
    for _ in range(3):  # let the clocks ramp before the first number
        report["copy_TBps_start"] = copy_ceiling()
    print(f"copy ceiling {report['copy_TBps_start']:.2f} TB/s", flush=True)

    tm_configs = [(1, 32, 4), (1, 32, 2), (2, 32, 4), (1, 16, 2), (2, 16, 4), (4, 8, 4)]
    args = (list(SECTIONS), HS, RD, False, True)
    for n in [int(s) for s in a.sizes.split(",")]:
        g = torch.Generator().manual_seed(n)
        byts = 2 * 2 * n * (HQ + HK) * HS + 2 * 4 * n * HALF
        num_sets = max(1, round(ROTATE_BYTES / byts))
        qs = [torch.randn(n, HQ * HS, generator=g).to(torch.bfloat16).cuda() for _ in range(num_sets)]
        ks = [torch.randn(n, HK * HS, generator=g).to(torch.bfloat16).cuda() for _ in range(num_sets)]
        pos = torch.randint(0, 4096, (3, n), generator=g)
        ang = pos[..., None].double() / (10000.0 ** (torch.arange(HALF, dtype=torch.float64) * 2 / RD))
        cos, sin = ang.cos().float().cuda(), ang.sin().float().cuda()
        ref_q, ref_k = tm.mrope_native(qs[0], ks[0], cos, sin, *args)
        row = {"num_tokens": n, "bytes": byts, "sets": num_sets, "forms": []}
        report["rows"].append(row)

        def record(name, kernel_us, count, wall_us, same, row=row, byts=byts, n=n):
            r = {"form": name, "kernel_us": kernel_us, "kernels": count, "wall_us": wall_us,
                 "kernel_TBps": byts / (kernel_us * 1e-6) / 1e12, "wall_TBps": byts / (wall_us * 1e-6) / 1e12,
                 "bit_identical": same}
            row["forms"].append(r)
            print(f"n={n:6d} {name:50s} kernel {kernel_us:8.2f} us ({r['kernel_TBps']:.2f} TB/s) "
                  f"wall {wall_us:8.2f} us ({r['wall_TBps']:.2f})  same={same}", flush=True)

        def triton_form(name, fn, hot=False):
            oq, ok = fn(qs[0].clone(), ks[0].clone())
            same = bool(torch.equal(oq, ref_q) and torch.equal(ok, ref_k))
            m = 1 if hot else num_sets
            us, cnt = kernel_median(cupti_kernels(lambda: [fn(qs[j % m], ks[j % m]) for j in range(20)]))
            record(name, us, cnt, graph_us(lambda j: fn(qs[j % m], ks[j % m])), same)

        def pallas_form(name, step, hot=False, timeline=False):
            jc, js = to_jax(cos), to_jax(sin)
            oq, ok = jax.jit(step)(to_jax(qs[0].clone()), to_jax(ks[0].clone()), jc, js)
            same = bool(torch.equal(torch.from_dlpack(oq), ref_q) and torch.equal(torch.from_dlpack(ok), ref_k))
            m = 1 if hot else num_sets
            chain = jax_chain(step, m)
            state = {"sets": tuple((to_jax(qs[j].clone()), to_jax(ks[j].clone())) for j in range(m))}

            def run():
                state["sets"] = chain(state["sets"], jc, js)
                jax.block_until_ready(state["sets"])

            events = cupti_kernels(run)
            us, cnt = kernel_median(events)
            wall, state["sets"] = jax_wall_us(chain, state["sets"], jc, js)
            record(name, us, cnt, wall, same)
            if timeline:  # marginal wall time per call: 100 chained calls against 20
                wall100, state["sets"] = jax_wall_us(jax_chain(step, m, 100), state["sets"], jc, js, 100)
                row["forms"][-1]["wall_marginal_us"] = (100 * wall100 - 20 * wall) / 80
                print(f"    marginal wall per call (100 vs 20 chained): "
                      f"{row['forms'][-1]['wall_marginal_us']:.2f} us", flush=True)
            if timeline:
                t0 = events[0][1]
                row.setdefault("timelines", {})[name] = [(nm[:60], st - t0, d) for nm, st, d in events]

        def guarded(fn, *fargs, **kw):
            try:
                fn(*fargs, **kw)
            except Exception as e:  # noqa: BLE001  keep what was measured
                print(f"FAILED {fargs[0]}: {e!r}"[:400], flush=True)
                row.setdefault("errors", []).append(f"{fargs[0]}: {e!r}"[:400])

        if a.only == "all":
            guarded(triton_form, "triton head-major (package) hot", lambda x, y: tm.mrope_(x, y, cos, sin, *args),
                    hot=True)
            guarded(triton_form, "triton head-major (package)", lambda x, y: tm.mrope_(x, y, cos, sin, *args))
        guarded(pallas_form, "pallas head-major (package) hot", lambda x, y, c, s: pm.mrope(x, y, c, s, *args),
                hot=True)
        guarded(pallas_form, "pallas head-major (package)", lambda x, y, c, s: pm.mrope(x, y, c, s, *args),
                timeline=True)
        for bt, bh, nw in tm_configs:
            cfg = f"bt={bt} bh={bh} nw={nw}"
            if a.only == "all":
                for offs64, cvt in ((True, False), (False, True)):
                    guarded(triton_form, f"triton token-major {cfg} offs{64 if offs64 else 32} "
                            f"{'cvt' if cvt else 'intround'}",
                            lambda x, y, bt=bt, bh=bh, nw=nw, o=offs64, c=cvt: triton_token_major(
                                x, y, cos, sin, bt, bh, nw, offs64=o, cvt=c))
            guarded(pallas_form, f"pallas token-major {cfg}",
                    lambda x, y, c, s, bt=bt, bh=bh, nw=nw: pallas_token_major(x, y, c, s, bt, bh, nw),
                    timeline=(bt, bh, nw) == (1, 32, 4))
        if a.only == "all":
            guarded(triton_form, "triton token-major bt=1 bh=32 nw=4 offs32 cvt evict_first",
                    lambda x, y: triton_token_major(x, y, cos, sin, 1, 32, 4, offs64=False, cvt=True, evict=True))
        guarded(pallas_form, "pallas token-major bt=1 bh=32 nw=4 evict_first",
                lambda x, y, c, s: pallas_token_major(x, y, c, s, 1, 32, 4, evict=True))
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        del qs, ks
        torch.cuda.empty_cache()
    report["copy_TBps_end"] = copy_ceiling()
    print(f"copy ceiling at the end {report['copy_TBps_end']:.2f} TB/s", flush=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    for row in report["rows"]:
        for name, tl_ in row.get("timelines", {}).items():
            starts = [st for nm, st, _ in tl_ if not NOT_KERNEL.search(nm)]
            ends = [st + d for nm, st, d in tl_ if not NOT_KERNEL.search(nm)]
            gaps = [b - e for e, b in zip(ends, starts[1:], strict=False)]
            others = sorted({nm for nm, _, _ in tl_ if NOT_KERNEL.search(nm)})
            print(f"timeline n={row['num_tokens']} {name}: {len(starts)} kernels, span "
                  f"{(ends[-1] - starts[0]) if starts else 0:.1f} us, median gap "
                  f"{statistics.median(gaps) if gaps else 0:.2f} us, other events {others}")


if __name__ == "__main__":
    main()
