"""Where the JAX step's time goes on the GPU: GPU time per kernel kind, and the ring attention alone.

    python3 benchmarks/step_profile.py --out DIR [--stacks temporal,mimi2]

For each stack: one profiled step (torch.profiler/CUPTI sees JAX's kernels), kernels grouped
by name with their summed GPU time, the CUDA runtime calls the host made (launches vs graph
launches), and a sweep of the Pallas ring attention's `splits` / `block_c` / `num_warps` at the
stack's shape with its achieved bandwidth. Writes step_profile.json to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
import torch
from scale_bench import full_state
from torch.profiler import ProfilerActivity, profile

import jax_impl
from jax_impl.config import PRESETS
from kernels_pallas.ring_attention import ring_attention

B = 4
CASES = {"temporal": ("temporal", 1), "mimi2": ("mimi", 2), "mimi10": ("mimi", 10)}


def profile_step(config, T, kernels):
    params = jax_impl.init_params(config, jax.random.key(0), jnp.bfloat16)
    state = full_state(config, B)
    x = jax.random.normal(jax.random.key(2), (B, T, config.dim), jnp.bfloat16)
    active = jnp.ones((B,), bool)
    step = jax_impl.make_step(config, layer_loop="python", kernels=kernels)
    for _ in range(3):
        out, state = step(params, state, x, active)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(20):
        out, state = step(params, state, x, active)
    jax.block_until_ready(state)
    pipelined = 1e3 * (time.perf_counter() - t0) / 20
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        out, state = step(params, state, x, active)
        jax.block_until_ready((out, state))
    gpu = collections.defaultdict(lambda: [0, 0.0])
    runtime = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name if len(e.name) < 90 else e.name[:90]
            gpu[name][0] += 1
            gpu[name][1] += e.device_time_total / 1e3  # ms
        elif e.name.startswith("cu"):
            runtime[e.name] += 1
    rows = sorted(([n, c, t] for n, (c, t) in gpu.items()), key=lambda r: -r[2])
    return {"pipelined_ms": pipelined, "gpu_ms_total": sum(r[2] for r in rows),
            "kernels": sum(r[1] for r in rows), "by_kernel": rows, "runtime_calls": dict(runtime)}


def sweep_attention(config, T):
    st = full_state(config, B)
    q = jax.random.normal(jax.random.key(5), (B, config.num_heads, T, config.head_dim), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(config.capacity, dtype=jnp.int32), (B, config.capacity))
    q_pos = jnp.full((B, T), config.capacity, jnp.int32) + jnp.arange(T, dtype=jnp.int32)
    layer_bytes = 2 * st.k.nbytes // config.num_layers
    results = []
    for splits in (1, 2, 4, 8, 16, 32):
        for block_c in (64, 128):
            for num_warps in (4, 8):
                if splits * block_c > 2 * config.capacity + block_c:
                    continue
                fn = jax.jit(lambda q, k, v, s=splits, b=block_c, w=num_warps: ring_attention(
                    q, k, v, 3, positions, q_pos, context=config.context, splits=s, block_c=b, num_warps=w))
                try:
                    fn(q, st.k, st.v).block_until_ready()
                except Exception as err:  # noqa: BLE001 - a config the compiler rejects is skipped
                    results.append({"splits": splits, "block_c": block_c, "num_warps": num_warps,
                                    "error": str(err)[:200]})
                    continue
                t0 = time.perf_counter()
                for _ in range(50):
                    out = fn(q, st.k, st.v)
                out.block_until_ready()
                us = 1e6 * (time.perf_counter() - t0) / 50
                results.append({"splits": splits, "block_c": block_c, "num_warps": num_warps, "us": us,
                                "TB_s": layer_bytes / (us * 1e-6) / 1e12})
    return sorted(results, key=lambda r: r.get("us", 1e9))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stacks", default="temporal,mimi2")
    args = parser.parse_args()
    report = {"xla_flags": os.environ.get("XLA_FLAGS", "")}
    for name in args.stacks.split(","):
        kind, T = CASES[name]
        config = PRESETS[kind]
        report[name] = {k: profile_step(config, T, k) for k in ("auto", "reference")}
        report[name]["attention_sweep"] = sweep_attention(config, T)
        for k in ("auto", "reference"):
            r = report[name][k]
            print(f"{name} kernels={k}: pipelined {r['pipelined_ms']:.3f} ms, GPU busy {r['gpu_ms_total']:.3f} ms, "
                  f"{r['kernels']} kernels, runtime {r['runtime_calls']}")
            for n, c, t in r["by_kernel"][:14]:
                print(f"   {t:8.3f} ms {c:5d}x  {n}")
        print(name, "attention sweep (best 6):", report[name]["attention_sweep"][:6], flush=True)
        with open(os.path.join(args.out, "step_profile.json"), "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
