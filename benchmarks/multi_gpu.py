"""Two GPUs through jax.sharding: the sessions step and the tensor-parallel step, timed.

    python -m benchmarks.multi_gpu [--out benchmarks/results/multi_gpu.json] [--steps 30]   # 2 GPUs
    python -m benchmarks.multi_gpu --small [--out /tmp/multi_gpu_small.json]               # CPU smoke run

Temporal stack at the real sizes (7B: dim 4096, 32 layers, context 3000), bf16, T=1, random
weights (jax_impl.init_params), every ring full (offsets at capacity: each step attends to the
whole 3000-frame context). Writes a JSON list of records

    {mode, B, T, sync_ms, pipelined_ms, one_gpu_sync_ms, one_gpu_B64_sync_ms, floor_ms, device, date, ...}

- mode "sessions": B=128 split over the two GPUs (`make_sharded_step`: 64 rows, a 100 GB ring
  and the replicated 14.5 GB of weights per GPU). Target: sync_ms <= 1.15 x one_gpu_B64_sync_ms,
  the one-GPU step of B=64 (the same per-GPU work). one_gpu_sync_ms is null: B=128 does not fit
  on one GPU (a 201 GB ring).
- mode "tensor_parallel": B=4, `make_tensor_parallel_step` (half the heads, FFN and ring per
  GPU, two all-reduces per layer). Target: sync_ms <= 0.6 x one_gpu_sync_ms (the one-GPU B=4
  step), and each all-reduce (the step's 64, [4, 1, 4096] bf16 = 32 KB each) <= 10 us:
  allreduce_us is measured on a chain of 64 such all-reduces in one program, less the same
  chain without them, over 64; allreduce_count / allreduce_bytes are read off the compiled step.

sync_ms: median of steps each waited for (`block_until_ready`), dispatch included; pipelined_ms:
steps dispatched back to back, the mean. floor_ms: the bytes one GPU must read per step (its
weights and its ring) over the copy bandwidth (benchmarks/timing.copy_bandwidth; --small:
a jitted copy on the CPU, meaningless but filled). All steps use layer_loop="python" and
kernels="auto" (the Pallas kernels where they apply: B=4; at B=64 the ring exceeds int32 indexing
and XLA's attention runs, on one GPU and sharded alike). NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
--small: the small preset, float32, B=8 / B=4 (the one-GPU reference at B/2), two forced CPU
devices; checks the code runs, times nothing of interest. Never run by the tests.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

SMALL = "--small" in sys.argv[1:]
if SMALL:  # two CPU devices; must be set before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # grow on demand: the B=64 ring is ~75% of a card
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (shared hosts)

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_impl as jx
from benchmarks.timing import host_ms, time_step
from jax_impl import sharding as sh
from jax_impl.snapshot import ring_shape

TARGETS = {"sessions": 1.15, "tensor_parallel": 0.6, "allreduce_us": 10.0}


def copy_bandwidth(small: bool) -> float:
    """Bytes read + written per second by a device copy (GPU: timing's 1 GiB copy)."""
    if not small:
        from benchmarks.timing import copy_bandwidth as cuda_copy_bandwidth

        return cuda_copy_bandwidth()
    a = jnp.zeros(1 << 24, jnp.uint8)
    f = jax.jit(lambda a: a ^ jnp.uint8(1))
    jax.block_until_ready(f(a))
    return 2 * a.nbytes / (1e-3 * host_ms(lambda: jax.block_until_ready(f(a)), 10))


def full_state(config, B: int, dtype, sharding=None) -> jx.StreamState:
    """A state whose rings are full (offsets at capacity) of a fixed pattern, built in place on its
    devices (one fused loop per ring, no host copy, no float32 temporary)."""
    shape = ring_shape(config, B)

    def make():
        c, d = (lax.broadcasted_iota(jnp.int32, shape, i) for i in (3, 4))
        ring = (((c * 7 + d * 13) % 17 - 8).astype(jnp.float32) * 0.125).astype(dtype)
        offset = jnp.full((B,), config.capacity, jx.state.index_dtype())
        return jx.StreamState(k=ring, v=ring + jnp.asarray(0.0625, dtype), offset=offset,
                              start_offset=jnp.zeros_like(offset))

    return jax.jit(make, out_shardings=sharding)()



def per_device_bytes(*trees) -> int:
    """Bytes one device (the first) holds of these arrays."""
    dev = jax.devices()[0]
    return sum(s.data.nbytes for tree in trees for a in jax.tree.leaves(tree)
               for s in a.addressable_shards if s.device == dev)


def allreduce_us(mesh, shape, dtype, count: int, repeats: int) -> float:
    """us per all-reduce of `shape` over the mesh: a chain of `count` psums in one program, less the
    same chain without the psums, over `count` (check_vma off: the psum is the bare all-reduce)."""
    axis = mesh.axis_names[0]
    n = mesh.shape[axis]

    def chain(reduce):
        def body(a):
            for _ in range(count):
                a = (lax.psum(a, axis) if reduce else a * jnp.asarray(2.0, a.dtype)) * jnp.asarray(1 / n, a.dtype)
            return a
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis), out_specs=P(axis), check_vma=False))

    a = jax.device_put(jnp.ones((n * shape[0], *shape[1:]), dtype), NamedSharding(mesh, P(axis)))
    ms = {}
    for reduce in (True, False):
        f = chain(reduce)
        jax.block_until_ready(f(a))
        ms[reduce] = host_ms(lambda f=f: jax.block_until_ready(f(a)), repeats)
    return 1e3 * max(ms[True] - ms[False], 0.0) / count


def bench(args) -> list[dict]:
    small = args.small
    config = jx.PRESETS["temporal-small" if small else "temporal"]
    dtype = jnp.float32 if small else jnp.bfloat16
    B_sessions, B_tp = (8, 4) if small else (128, 4)
    devices = jax.devices()[:2]
    kind = devices[0].device_kind
    date = datetime.date.today().isoformat()
    device = f"{len(devices)} x {kind}"
    options = {"layer_loop": "python", "kernels": "auto"}
    bandwidth = copy_bandwidth(small)
    print(f"jax {jax.__version__}, {device}, copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)

    # weights: computed replicated on both devices (no device-to-device copy of 14.5 GB)
    session = sh.session_mesh(devices)
    params = jax.jit(jx.init_params, static_argnums=(0, 2), out_shardings=NamedSharding(session, P()))(
        config, jax.random.key(0), dtype)
    one = jax.tree.map(lambda a: a.addressable_shards[0].data, params)  # device 0's copy, as a one-device array
    records = []

    # ---- tensor parallel, B=4, against the one-GPU B=4 step
    x4 = jax.device_put(jax.random.normal(jax.random.key(1), (B_tp, 1, config.dim), dtype), devices[0])
    active4 = jax.device_put(jnp.ones((B_tp,), bool), devices[0])
    state = full_state(config, B_tp, dtype, jax.sharding.SingleDeviceSharding(devices[0]))
    one_ms, one_pipe, state = time_step(jx.make_step(config, **options), one, state, x4, active4, args.steps)
    print(f"one GPU B={B_tp}: {one_ms:.3f} ms sync, {one_pipe:.3f} pipelined", flush=True)
    del state
    model = sh.session_mesh(devices, axis=sh.MODEL)
    tp_step = sh.make_tensor_parallel_step(config, model, **options)
    tp_shardings = jax.tree.map(lambda s: NamedSharding(model, s), sh.tensor_parallel_specs()[1])
    tp, tp_state = sh.shard_tensor_parallel(config, one, full_state(config, B_tp, dtype, tp_shardings), model)
    x4, active4 = jax.device_put((x4, active4), NamedSharding(model, P()))  # placed once, not per step
    compiled = tp_step.lower(tp, tp_state, x4, active4).compile().as_text()
    counts = sh.collectives(compiled)
    reduce_bytes = B_tp * config.dim * jnp.dtype(dtype).itemsize
    sync, pipe, tp_state = time_step(tp_step, tp, tp_state, x4, active4, args.steps)
    ar_us = allreduce_us(model, (B_tp, 1, config.dim), dtype, 2 * config.num_layers, args.steps)
    rec = {"mode": "tensor_parallel", "B": B_tp, "T": 1, "sync_ms": sync, "pipelined_ms": pipe,
           "one_gpu_sync_ms": one_ms, "one_gpu_B64_sync_ms": None,
           "floor_ms": 1e3 * per_device_bytes(tp, tp_state) / bandwidth, "device": device, "date": date,
           "one_gpu_pipelined_ms": one_pipe, "ratio": sync / one_ms, "target_ratio": TARGETS["tensor_parallel"],
           "allreduce_us": ar_us, "target_allreduce_us": TARGETS["allreduce_us"],
           "allreduce_count": counts.get("all-reduce", 0), "other_collectives": {k: v for k, v in counts.items()
                                                                              if k != "all-reduce"},
           "allreduce_bytes": reduce_bytes, "dtype": jnp.dtype(dtype).name}
    rec["meets_target"] = rec["ratio"] <= TARGETS["tensor_parallel"] and ar_us <= TARGETS["allreduce_us"]
    print(json.dumps(rec), flush=True)
    records.append(rec)
    del tp, tp_state

    # ---- sessions, B=128 over two GPUs, against the one-GPU B=64 step (the same work per GPU)
    half = B_sessions // 2
    x = jax.random.normal(jax.random.key(2), (B_sessions, 1, config.dim), dtype)
    active = jnp.ones((B_sessions,), bool)
    state = full_state(config, half, dtype, jax.sharding.SingleDeviceSharding(devices[0]))
    x_half, active_half = jax.device_put((x[:half], active[:half]), devices[0])
    b64_ms, b64_pipe, state = time_step(jx.make_step(config, **options), one, state, x_half, active_half, args.steps)
    print(f"one GPU B={half}: {b64_ms:.3f} ms sync, {b64_pipe:.3f} pipelined", flush=True)
    del state
    state = full_state(config, B_sessions, dtype, sh.session_shardings(session))
    step = sh.make_sharded_step(config, session, **options)
    x, active = jax.device_put((x, active), NamedSharding(session, P(sh.SESSIONS)))  # placed once, not per step
    counts = sh.collectives(step.lower(params, state, x, active).compile().as_text())
    sync, pipe, state = time_step(step, params, state, x, active, args.steps)
    rec = {"mode": "sessions", "B": B_sessions, "T": 1, "sync_ms": sync, "pipelined_ms": pipe,
           "one_gpu_sync_ms": None, "one_gpu_B64_sync_ms": b64_ms, "one_gpu_reference_B": half, "floor_ms": 1e3 * per_device_bytes(params, state) / bandwidth,
           "device": device, "date": date, "one_gpu_B64_pipelined_ms": b64_pipe, "ratio": sync / b64_ms,
           "target_ratio": TARGETS["sessions"], "collectives": counts, "dtype": jnp.dtype(dtype).name,
           "note": f"one_gpu_sync_ms null: B={B_sessions} does not fit on one GPU" if not small else "small preset"}
    rec["meets_target"] = rec["ratio"] <= TARGETS["sessions"] and not counts
    print(json.dumps(rec), flush=True)
    records.append(rec)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="CPU smoke run: small preset, two forced CPU devices")
    parser.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/multi_gpu.json; "
                                                    "--small: /tmp/multi_gpu_small.json)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per measurement (30; --small: 5)")
    args = parser.parse_args()
    args.steps = args.steps or (5 if args.small else 30)
    out = args.out or ("/tmp/multi_gpu_small.json" if args.small else
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "multi_gpu.json"))
    if len(jax.devices()) < 2 or (not args.small and jax.default_backend() != "gpu"):
        sys.exit(f"multi_gpu.py needs 2 GPUs (or --small for the CPU smoke run); JAX sees {jax.devices()}")
    records = bench(args)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(records, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
