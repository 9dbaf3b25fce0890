"""Twin kernels on the GPU: Pallas vs Triton bits, batch invariance, and kernel times at the real sizes.

    python -m benchmarks.twin_gpu --out $OUT/twin_gpu.json

For each twin kernel (linear with its epilogues, norms, RoPE tables, rotate-and-write, ring
attention) at the temporal / Mimi sizes in bf16: whether the Pallas kernel (jitted JAX) and the
Triton kernel (torch) return the same bits on the same inputs, whether a row computed alone
(B=1) has the bits it has among others (B=4, 16), and the median time of each (CUDA events
around 20 calls after warm-up; the JAX side blocks on the result). With jax >= 0.11, the records of the
linears, the norms, the qkv kernel, the ring write and the attention also hold their Mosaic GPU kernels'
(`kernels_pallas.twin_linear_mgpu`, `twin_norm_mgpu`, `twin_rope_mgpu`, `twin_attention_mgpu`): whether
their bits are Triton's, and their time. Never part of the tests.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.timing import cuda_time, run_meta
from jax_impl.parity import bits
from jax_impl.tables import rope_freqs
from kernels_pallas import twin_attention as pa
from kernels_pallas import twin_attention_mgpu as pam
from kernels_pallas import twin_entry as pe
from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_linear_mgpu as plm
from kernels_pallas import twin_norm as pn
from kernels_pallas import twin_norm_mgpu as pnm
from kernels_pallas import twin_rope as pr
from kernels_pallas import twin_rope_mgpu as prm
from kernels_pallas.contract.linear import MOSAIC_MIN_JAX
from kernels_triton import twin_attention as ta
from kernels_triton import twin_linear as tli
from kernels_triton import twin_norm as tn
from kernels_triton import twin_rope as tr
from torch_bridge.dlpack import to_jax


def t_time(fn, n=20):
    """Median CUDA-event ms of fn() after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return cuda_time(fn, n)


def j_time(fn, n=20):
    for _ in range(3):
        jax.block_until_ready(fn())
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def same(a, b) -> bool:
    ta_, tb = (x.detach().cpu() if isinstance(x, torch.Tensor) else np.asarray(x) for x in (a, b))
    return bool(np.array_equal(bits(ta_), bits(tb)))


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def case_linear(rec, M, N, K, act=None, scale=False, res=False, L=2):
    x, w = randn(M, K), randn(L, N, K, scale=0.02, seed=1)
    n_out = N // 2 if act == "silu_gate" else N
    s = randn(L, n_out, seed=2) if scale else None
    r = randn(M, n_out, seed=3) if res else None
    jx, jw, js, jr = (None if t is None else to_jax(t) for t in (x, w, s, r))
    f = jax.jit(lambda x, w, s, r, l: pli.linear(x, w, l, act=act, scale=s, residual=r))
    yj = f(jx, jw, js, jr, jnp.int32(L - 1))
    yt = tli.linear(x, w, L - 1, act=act, scale=s, residual=r)
    inv = True
    if M > 1:
        y1 = tli.linear(x[1:2].contiguous(), w, L - 1, act=act, scale=s,
                        residual=None if r is None else r[1:2].contiguous())
        inv = same(y1[0], yt[1])
    ref = (x.float() @ w[L - 1].float().T)
    err = float((yt.float() - ref[:, :n_out]).abs().max()) if act is None and not res and not scale else None
    rec.update(identical=same(yj, yt), batch_invariant=inv, max_abs_vs_f32=err,
               pallas_ms=j_time(lambda: f(jx, jw, js, jr, jnp.int32(L - 1))),
               triton_ms=t_time(lambda: tli.linear(x, w, L - 1, act=act, scale=s, residual=r)),
               bytes=w[0].numel() * 2)
    mosaic(rec, lambda x, w, s, r, l: plm.linear(x, w, l, act=act, scale=s, residual=r),
           (jx, jw, js, jr, jnp.int32(L - 1)), yt)


def case_norm(rec, M, D, kind):
    x, w, b = randn(M, D, scale=3.0), randn(2, D, seed=1), randn(2, D, seed=2)
    bb = b if kind == "layer" else None
    jb = None if bb is None else to_jax(bb)
    f = jax.jit(lambda x, w, b: pn.norm(x, w, b, jnp.int32(1), kind=kind, eps=1e-5))
    yj = f(to_jax(x), to_jax(w), jb)
    yt = tn.norm(x, w, bb, 1, kind=kind, eps=1e-5)
    rec.update(identical=same(yj, yt), pallas_ms=j_time(lambda: f(to_jax(x), to_jax(w), jb)),
               triton_ms=t_time(lambda: tn.norm(x, w, bb, 1, kind=kind, eps=1e-5)))
    mosaic(rec, lambda x, w, b: pnm.norm(x, w, b, jnp.int32(1), kind=kind, eps=1e-5), (to_jax(x), to_jax(w), jb), yt)


def mosaic(rec, fn, args, expected):
    """With jax >= 0.11: the Mosaic GPU kernel `fn` on args, whether its bits are `expected`'s, its time."""
    if jax.__version_info__[:2] < MOSAIC_MIN_JAX:
        return
    try:
        g = jax.jit(fn)
        got = g(*args)
        pairs = zip(got, expected, strict=True) if isinstance(expected, tuple) else [(got, expected)]
        rec.update(mosaic_identical=all(same(a, b) for a, b in pairs), mosaic_ms=j_time(lambda: g(*args)))
    except Exception as err:  # noqa: BLE001 (recorded beside the Triton results)
        rec["mosaic_error"] = f"{type(err).__name__}: {err}"[:2000]


def case_rope(rec, B, T, H, D, C, L):
    offset = torch.randint(0, 10**5, (B,), device="cuda", dtype=torch.int32)
    freqs = torch.from_numpy(rope_freqs(D, 10000.0)).cuda()
    x = randn(B, T, 8)
    entry = jax.jit(lambda o, f, x: pe.entry(o, jnp.zeros_like(o), jnp.ones(o.shape, bool), x, f, capacity=C,
                                             convention="personaplex", num_heads=H))
    e = entry(to_jax(offset), to_jax(freqs), to_jax(x))
    cj, sj = e.cos, e.sin
    ct, st = tr.tables(offset, T, freqs)
    qkv = randn(B, T, 3, H, D)
    rk, rv = randn(L, B, H, C, D, seed=4), randn(L, B, H, C, D, seed=5)
    wi = ((offset[:, None].long() + torch.arange(T, device="cuda")) % C).int()
    act = torch.tensor([True, False] * (B // 2) + [True] * (B % 2), device="cuda")[:, None].expand(B, T).contiguous()
    f = jax.jit(pr.rope_write)
    out_j = f(to_jax(qkv), cj, sj, to_jax(rk.clone()), to_jax(rv.clone()), jnp.int32(L - 1), to_jax(wi), to_jax(act))
    out_t = tr.rope_write(qkv, ct, st, rk, rv, L - 1, wi, act)
    rec.update(tables_identical=same(cj, ct) and same(sj, st),
               identical=all(same(a, b) for a, b in zip(out_j, out_t)),
               triton_ms=t_time(lambda: tr.rope_write(qkv, ct, st, rk, rv, L - 1, wi, act)))
    tail = (jnp.int32(L - 1), to_jax(wi), to_jax(act))
    mosaic(rec, lambda x, c, s, k, v, *t: prm.rope_write(x, c, s, k, v, *t), (to_jax(qkv), cj, sj, to_jax(rk.clone()),
           to_jax(rv.clone()), *tail), out_t)


def case_qkv(rec, B, T, H, D, K, C, L=2):
    """The qkv projection with its RoPE and ring-write epilogue (the MMA form): the Pallas kernel and
    the Triton kernel, the same bits for q and both rings, and the Mosaic GPU kernel's."""
    offset = torch.randint(0, 10**5, (B,), device="cuda", dtype=torch.int32)
    angle = (offset[:, None, None] + torch.arange(T, device="cuda")[None, :, None]) * torch.from_numpy(
        rope_freqs(D, 10000.0)).cuda()
    cos, sin = torch.cos(angle).float(), torch.sin(angle).float()
    x, w = randn(B * T, K), randn(L, 3 * H * D, K, scale=0.02, seed=1)
    rk, rv = randn(L, B, H, C, D, seed=4), randn(L, B, H, C, D, seed=5)
    wi = ((offset[:, None].long() + torch.arange(T, device="cuda")) % C).int()
    wm = torch.ones(B, T, dtype=torch.bool, device="cuda")
    args_j = [to_jax(t) for t in (x, w)] + [jnp.int32(L - 1)] + [to_jax(t) for t in (cos, sin)]
    tail_j = [to_jax(wi), to_jax(wm)]
    f = jax.jit(lambda x, w, l, c, s, k, v, i, m: pli.linear_rope_write(x, w, l, c, s, k, v, i, m), donate_argnums=(5, 6))
    out_j = f(*args_j, to_jax(rk.clone()), to_jax(rv.clone()), *tail_j)
    tk, tv = rk.clone(), rv.clone()
    tq, _, _ = tli.linear_rope_write(x, w, L - 1, cos, sin, tk, tv, wi, wm)
    rec.update(identical=all(same(a, b) for a, b in zip(out_j, (tq, tk, tv))),
               triton_ms=t_time(lambda: tli.linear_rope_write(x, w, L - 1, cos, sin, tk, tv, wi, wm)),
               bytes=w[0].numel() * 2)
    rec["pallas_ms"] = j_time(stepped(f, args_j, (to_jax(rk.clone()), to_jax(rv.clone())), tail_j))
    if jax.__version_info__[:2] < MOSAIC_MIN_JAX:
        return
    try:
        g = jax.jit(lambda x, w, l, c, s, k, v, i, m: plm.linear_rope_write(x, w, l, c, s, k, v, i, m),
                    donate_argnums=(5, 6))
        out_m = g(*args_j, to_jax(rk.clone()), to_jax(rv.clone()), *tail_j)
        rec["mosaic_identical"] = all(same(a, b) for a, b in zip(out_m, (tq, tk, tv)))
        rec["mosaic_ms"] = j_time(stepped(g, args_j, (to_jax(rk.clone()), to_jax(rv.clone())), tail_j))
    except Exception as err:  # noqa: BLE001 (recorded beside the Triton results)
        rec["mosaic_error"] = f"{type(err).__name__}: {err}"[:2000]


def stepped(fn, args, rings, tail):
    """A call of fn(*args, *rings, *tail) -> (q, *rings) that donates the rings and keeps the new ones
    for the next call, as a step carries its state; returns q."""
    state = list(rings)

    def call():
        q, *state[:] = fn(*args, *state, *tail)
        return q

    return call


def case_attention(rec, B, H, T, D, C, L):
    q = randn(B, H, T, D)
    rk, rv = randn(L, B, H, C, D, seed=1), randn(L, B, H, C, D, seed=2)
    pos = torch.arange(C, device="cuda", dtype=torch.int32).repeat(B, 1)
    pos[0, : C // 3] = -1
    qpos = torch.full((B, T), C, device="cuda", dtype=torch.int32) + torch.arange(T, device="cuda", dtype=torch.int32)
    args_j = [to_jax(t) for t in (q, rk, rv)] + [jnp.int32(L - 1), to_jax(pos), to_jax(qpos)]
    f = jax.jit(lambda *a: pa.attention(*a, context=C))
    oj = f(*args_j)
    ot = ta.attention(q, rk, rv, L - 1, pos, qpos, context=C)
    s = (q.float() @ rk[L - 1].float().transpose(-1, -2)) / math.sqrt(D)
    vis = (pos[:, None, None, :] >= 0) & (qpos[:, None, :, None] - pos[:, None, None, :] < C)
    ref = torch.softmax(s.masked_fill(~vis, float("-inf")), -1) @ rv[L - 1].float()
    inv = None if B == 1 else same(ta.attention(q[1:2].contiguous(), rk[:, 1:2].contiguous(), rv[:, 1:2].contiguous(),
                                                 L - 1, pos[1:2].contiguous(), qpos[1:2].contiguous(), context=C)[0], ot[1])
    rec.update(identical=same(oj, ot), batch_invariant=inv,
               max_abs_vs_f32=float((ot.float().transpose(1, 2) - ref).abs().max()),
               pallas_ms=j_time(lambda: f(*args_j)),
               triton_ms=t_time(lambda: ta.attention(q, rk, rv, L - 1, pos, qpos, context=C)),
               bytes=2 * B * H * C * D * 2)
    mosaic(rec, lambda *a: pam.attention(*a, context=C), args_j, ot)


CASES = [
    ("linear qkv 4x4096->12288", case_linear, {"M": 4, "N": 12288, "K": 4096}),
    ("linear out_proj+res 4x4096", case_linear, {"M": 4, "N": 4096, "K": 4096, "res": True}),
    ("linear gate 4x4096->2x11264", case_linear, {"M": 4, "N": 22528, "K": 4096, "act": "silu_gate"}),
    ("linear out 4x11264->4096+res", case_linear, {"M": 4, "N": 4096, "K": 11264, "res": True}),
    ("linear qkv B=16", case_linear, {"M": 16, "N": 12288, "K": 4096}),
    ("linear qkv B=1", case_linear, {"M": 1, "N": 12288, "K": 4096}),
    ("linear out 64x11264->4096+res", case_linear, {"M": 64, "N": 4096, "K": 11264, "res": True}),
    ("linear text 4x4096->32000", case_linear, {"M": 4, "N": 32000, "K": 4096, "L": 1}),
    ("linear mimi gelu 8x512->2048", case_linear, {"M": 8, "N": 2048, "K": 512, "act": "gelu"}),
    ("linear mimi scale+res 8x2048->512", case_linear, {"M": 8, "N": 512, "K": 2048, "scale": True, "res": True}),
    ("rms norm 4x4096", case_norm, {"M": 4, "D": 4096, "kind": "rms"}),
    ("layer norm 8x512", case_norm, {"M": 8, "D": 512, "kind": "layer"}),
    ("qkv+rope+write temporal B=1", case_qkv, {"B": 1, "T": 1, "H": 32, "D": 128, "K": 4096, "C": 3000}),
    ("qkv+rope+write temporal B=64", case_qkv, {"B": 64, "T": 1, "H": 32, "D": 128, "K": 4096, "C": 3000}),
    ("qkv+rope+write mimi T=2 B=4", case_qkv, {"B": 4, "T": 2, "H": 8, "D": 64, "K": 512, "C": 250}),
    ("rope temporal", case_rope, {"B": 4, "T": 1, "H": 32, "D": 128, "C": 3000, "L": 2}),
    ("rope mimi T=10", case_rope, {"B": 4, "T": 10, "H": 8, "D": 64, "C": 250, "L": 2}),
    ("attention temporal B=4", case_attention, {"B": 4, "H": 32, "T": 1, "D": 128, "C": 3000, "L": 2}),
    ("attention depformer B=1", case_attention, {"B": 1, "H": 16, "T": 1, "D": 64, "C": 16, "L": 2}),
    ("attention temporal B=64", case_attention, {"B": 64, "H": 32, "T": 1, "D": 128, "C": 3000, "L": 2}),
    ("attention mimi T=2", case_attention, {"B": 4, "H": 8, "T": 2, "D": 64, "C": 250, "L": 2}),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="twin_gpu.json")
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = parser.parse_args()
    records = []
    for name, fn, kw in CASES:
        if args.only and args.only not in name:
            continue
        rec = {"case": name, **{k: v for k, v in kw.items()}}
        try:
            fn(rec, **kw)
        except Exception as err:  # noqa: BLE001 (a kernel that does not compile is a result: record it, go on)
            rec["error"] = f"{type(err).__name__}: {err}"[:2000]
            rec["traceback"] = traceback.format_exc()[-3000:]
        print(json.dumps({k: v for k, v in rec.items() if k != "traceback"}), flush=True)
        records.append(rec)
    meta = run_meta()
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
