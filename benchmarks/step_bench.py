"""GPU step benchmark: the JAX step against the torch path, side by side, at the real sizes.

    python -m benchmarks.step_bench --out DIR [--stacks temporal,mimi2,mimi10] [--steps N]

For each stack (temporal 7B T=1; Mimi T=2 and T=10), bf16, B=4, random weights (normal std
0.02, norms 1, layer scales 0.01), ring at steady state (offsets at capacity, every slot
random and attended), one process measures:
- jax_ms: the jitted JAX step, state donated (median of synchronized steps after warm-up),
  with the Pallas kernels (RoPE + ring attention) and, for reference, with XLA's;
- torch_eager_ms / torch_graph_ms: the torch path eager and captured in a CUDA graph, tables
  built once per step and (the older structure) in every layer;
- kernels per step of each (CUPTI through torch.profiler, which also sees JAX's kernels);
- dropin_ms: the torch-facing JAX stepper (DLPack in and out) on the same weight buffers;
- floor_ms: bytes the step must read (weights + ring) over the measured copy bandwidth, and
  the bytes XLA's cost analysis says the compiled step accesses;
- the Pallas RoPE against the jax.numpy RoPE on this card (bit-identical or not), and the
  Pallas ring attention's distance to its reference.
Writes step_bench.json, step_bench.md and step_bench.png to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_impl
from benchmarks.timing import copy_bandwidth, cuda_time, host_ms, kernel_profile, time_step, torch_graph
from jax_impl.config import PRESETS
from jax_impl.ops import apply_rope, rope_pallas
from kernels_pallas.ring_attention import ring_attention, ring_attention_native
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.dlpack import to_jax
from torch_bridge.jax_steppers import from_torch

B = 4
CASES = {"temporal": ("temporal", 1), "mimi2": ("mimi", 2), "mimi10": ("mimi", 10)}


def bytes_accessed(jitted, *args) -> float | None:
    try:
        cost = jitted.lower(*args).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost.get("bytes accessed", float("nan")))
    except (RuntimeError, ValueError, KeyError, TypeError) as err:  # cost analysis is best effort
        print("cost analysis failed:", err)
        return None


def bench_case(name: str, steps: int, bandwidth: float) -> dict:
    kind, T = CASES[name]
    config = PRESETS[kind]
    cls = TemporalStreaming if kind == "temporal" else MimiTransformer
    module = cls.from_config(config, dtype=torch.bfloat16, device="cuda")
    module.init_weights(generator=torch.Generator(device="cuda").manual_seed(0))
    module.streaming_init(B)
    module.state.k.normal_()
    module.state.v.normal_()
    module.state.offset.fill_(config.capacity)
    x = torch.randn(B, T, config.dim, device="cuda", dtype=torch.bfloat16)
    active = torch.ones(B, dtype=torch.bool, device="cuda")
    rec = {"stack": kind, "T": T, "B": B, "dtype": "bfloat16", "device": torch.cuda.get_device_name(),
           "date": datetime.date.today().isoformat()}

    # --- torch path: eager and CUDA graph
    def torch_step():
        module.step(x, active)
    rec["torch_eager_ms"] = cuda_time(torch_step, max(5, steps // 2))
    rec["torch_kernels"] = kernel_profile(torch_step)[0]
    rec["torch_graph_ms"] = cuda_time(torch_graph(torch_step), steps)
    print(name, "torch eager", rec["torch_eager_ms"], "graph", rec["torch_graph_ms"], "kernels",
          rec["torch_kernels"], flush=True)

    # --- JAX step on the same weight buffers (DLPack views), its own full ring
    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    weight_bytes = sum(int(w.nbytes) for w in module.weights().values())
    xj, aj = to_jax(x), to_jax(active)
    freqs = module.rope_freqs()

    def fresh_state():
        s = jax_impl.init_state(config, B, jnp.bfloat16)
        k1, k2 = jax.random.split(jax.random.key(1))
        return s._replace(k=jax.random.normal(k1, s.k.shape, jnp.bfloat16),
                          v=jax.random.normal(k2, s.v.shape, jnp.bfloat16),
                          offset=jnp.full_like(s.offset, config.capacity))

    state = fresh_state()
    ring_bytes = int(state.k.nbytes + state.v.nbytes)
    rec["floor_bytes"] = weight_bytes + ring_bytes
    rec["floor_ms"] = 1e3 * rec["floor_bytes"] / bandwidth
    for kernels in ("auto", "reference"):  # auto: the Pallas kernels on a GPU (and the drop-in's choice)
        step = jax_impl.make_step(config, layer_loop="python", kernels=kernels, rope_freqs=freqs)
        if kernels == "auto":
            rec["xla_bytes_accessed"] = bytes_accessed(step, params, state, xj, aj)
        ms, pipelined, state = time_step(step, params, state, xj, aj, steps)
        holder = {"state": state}

        def jax_step(step=step, holder=holder):
            out, holder["state"] = step(params, holder["state"], xj, aj)
            jax.block_until_ready((out, holder["state"]))

        key = "jax" if kernels == "auto" else "jax_xla_kernels"
        rec[f"{key}_ms"], rec[f"{key}_pipelined_ms"] = ms, pipelined
        rec[f"{key}_kernels"] = kernel_profile(jax_step)[0]
        state = holder["state"]
        print(name, key, ms, "pipelined", pipelined, "kernels", rec[f"{key}_kernels"], flush=True)

    # --- the torch-facing drop-in on the same buffers
    del state
    dropin = from_torch(module)
    dropin.streaming_init(B)
    dropin._streamer.state = fresh_state()

    def dropin_step():
        dropin.step(x, active)
        torch.cuda.synchronize()

    for _ in range(3):
        dropin_step()
    rec["dropin_ms"] = host_ms(dropin_step, steps)
    rec["dropin_overhead"] = rec["dropin_ms"] / rec["jax_ms"] - 1
    dropin.streaming_init(1)  # frees its full-size ring
    print(name, "dropin", rec["dropin_ms"], flush=True)

    # --- kernels against their references on this card
    H, D = config.num_heads, config.head_dim
    qk = jax.random.normal(jax.random.key(3), (2, B, T, H, D), jnp.float32)
    cos, sin = (t(jax.random.uniform(jax.random.key(4), (B, 1, T, D // 2)) * 7.0) for t in (jnp.cos, jnp.sin))
    identical = {}
    for dt in (jnp.float32, jnp.bfloat16):
        q, k = qk[0].astype(dt), qk[1].astype(dt)
        pq, pk = jax.jit(rope_pallas)(q, k, cos, sin)
        rq = jax.jit(lambda a: apply_rope(a.transpose(0, 2, 1, 3), cos, sin))(q)
        rk = jax.jit(lambda a: apply_rope(a.transpose(0, 2, 1, 3), cos, sin))(k)
        identical[jnp.dtype(dt).name] = bool(jnp.array_equal(pq, rq) and jnp.array_equal(pk, rk))
    rec["pallas_rope_bit_identical"] = identical
    st = fresh_state()
    q = jax.random.normal(jax.random.key(5), (B, H, T, D), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(config.capacity, dtype=jnp.int32), (B, config.capacity))
    q_pos = jnp.full((B, T), config.capacity, jnp.int32) + jnp.arange(T, dtype=jnp.int32)
    got = ring_attention(q, st.k, st.v, 3, positions, q_pos, context=config.context)
    want = ring_attention_native(q, st.k, st.v, 3, positions, q_pos, context=config.context)
    rec["pallas_attention_max_abs"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
    print(name, "rope identical", identical, "attention max abs", rec["pallas_attention_max_abs"], flush=True)
    return rec


def markdown(records: list[dict], bandwidth: float) -> str:
    header = ("| stack | T | JAX ms | JAX (XLA attn) ms | torch eager | torch graph "
              "| floor ms | JAX/floor | JAX kernels | torch kernels | drop-in ms (+%) |")
    lines = [(f"Card: {records[0]['device']}, copy bandwidth {bandwidth / 1e12:.2f} TB/s (read+write), "
              f"bf16, B={B}, full ring, {records[0]['date']}."), "", header,
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['stack']} | {r['T']} | {r['jax_ms']:.3f} | {r['jax_xla_kernels_ms']:.3f} | "
            f"{r['torch_eager_ms']:.3f} | {r['torch_graph_ms']:.3f} | "
            f"{r['floor_ms']:.3f} | {r['jax_ms'] / r['floor_ms']:.2f} | "
            f"{r['jax_kernels']} | {r['torch_kernels']} | "
            f"{r['dropin_ms']:.3f} ({100 * r['dropin_overhead']:+.1f}%) |")
    return "\n".join(lines)


def chart(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("jax_ms", "JAX (Pallas)"), ("jax_xla_kernels_ms", "JAX (XLA attn)"), ("torch_graph_ms", "torch graph"),
            ("torch_eager_ms", "torch eager"), ("floor_ms", "floor")]
    fig, axes = plt.subplots(1, len(records), figsize=(4.5 * len(records), 4))
    for ax, r in zip(np.atleast_1d(axes), records):
        ax.bar([lbl for _, lbl in keys], [r[k] for k, _ in keys], color=["C0", "C9", "C1", "C3", "gray"])
        ax.set_title(f"{r['stack']} T={r['T']}")
        ax.set_ylabel("ms/step")
        ax.set_yscale("log")
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--stacks", default="mimi2,mimi10,temporal")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print("jax", jax.__version__, jax.devices(), "torch", torch.__version__, flush=True)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    records = []
    for name in args.stacks.split(","):
        records.append(bench_case(name, args.steps, bandwidth))
        torch.cuda.empty_cache()
        with open(os.path.join(args.out, "step_bench.json"), "w") as f:
            json.dump({"copy_bandwidth": bandwidth, "records": records}, f, indent=1)
    table = markdown(records, bandwidth)
    print(table)
    with open(os.path.join(args.out, "step_bench.md"), "w") as f:
        f.write(table + "\n")
    chart(records, os.path.join(args.out, "step_bench.png"))


if __name__ == "__main__":
    main()
