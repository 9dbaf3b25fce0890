"""Batch scaling of the streaming steps with a full ring, in one process.

    python -m benchmarks.scale_bench --out $OUT               # scale_bench.json + scale_bench.png
    python -m benchmarks.scale_bench --small --out /tmp/scale  # CPU smoke run (small presets)

For each stack and batch size (temporal T=1 at --batches, default 1,4,16,64; Mimi T=2 and T=10 at
--mimi-batches, default 4,16,64), bf16, random weights shared by torch and JAX (DLPack), every
ring slot random and visible (offsets at capacity), one record

    {stack, T, B, scan, sync_ms, pipelined_ms, floor_ms, kernels, attention_TBps, dropin_ms,
     torch_graph_ms, compile_s, device, date}

for the JAX step (`kernels="auto"`, or `--kernels twin`) with the Python layer loop (scan: false)
and with one `lax.scan` over the layers (scan: true) (`--loops`):
- sync_ms: median of synchronized steps (outputs and state ready before the next step, waited for by
  `jax_impl.until_ready`); sync_block_until_ready_ms: the same waited for by `jax.block_until_ready`
  (PjRt's ready futures); pipelined_ms: the same steps launched back to back
  (`timing.time_step`);
- floor_ms: (weight bytes + ring bytes) / the copy bandwidth measured in the same run;
- call_floor_sync_ms / call_floor_pipelined_ms: a jitted call with the step's arguments (state
  donated) that only bumps the offsets, timed the same way: the synchronized cost before any kernel work;
- kernels: CUDA kernels per step (torch.profiler), top_kernels: the 8 costliest by name [name, us, calls];
  compile_s: the first call;
- attention_TBps: the Pallas ring attention alone over every layer (one jit, calls back to back), k and v bytes per
  second (None where the ring is past its int32 offsets); with --kernels twin, the twin attention;
- dropin_ms: the torch-facing drop-in (`from_torch`) on the same weights, kernels and layer loop
  (`dropin_loop`: scan when timed), synchronized on torch's current stream (its outputs' order);
  dropin_device_sync_ms: the same waited for by `torch.cuda.synchronize`, which also waits for JAX's
  own streams (PjRt's host callback queued behind each step);
- torch_graph_ms: the torch path under a CUDA graph, where its own ring fits beside JAX's
  (null otherwise, with the reason in `torch_graph_note`).
Then `sessions_in_80ms`: the largest B whose temporal step plus two Mimi T=2 steps (encoder and
decoder: one 80 ms frame is two 25 Hz Mimi frames), synchronized, fit in 80 ms. Never part of
the tests. On the CPU (--small) the GPU-only fields are null.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card
# B=64 holds 100 GB of ring beside torch's 13 GB of weights. JAX's default (BFC) allocator grows
# by regions it tries at 64, 57.6 and 51.84 GiB for a 46.9 GiB ring, never less: beside torch the
# second ring found no region (measured). cudaMallocAsync asks for what is needed.
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
if "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:  # the deprecated name; both set is an error
    os.environ.setdefault("XLA_CLIENT_MEM_FRACTION", "0.95")

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_impl
from benchmarks.timing import (
    copy_bandwidth,
    cuda_time,
    host_ms,
    interleaved_medians_us,
    kernel_profile,
    time_step,
    torch_graph,
)
from jax_impl.config import PRESETS
from jax_impl.snapshot import ring_shape
from kernels_pallas import twin_attention
from kernels_pallas.ring_attention import fits_int32, ring_attention
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.dlpack import to_jax
from torch_bridge.jax_steppers import from_torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"


RANDOM_RING_MAX_BYTES = 16 * 2**30  # larger rings are filled with a constant: random bits need a temporary as large


def full_state(config, B: int, key: int = 1):
    """A JAX state with every slot visible (offsets at capacity), random up to RANDOM_RING_MAX_BYTES
    (the values do not change the kernels' work), else constant. Each ring is made once where it
    lives: no zero ring first and no second ring, ever (at B=64 one is 50 GB)."""
    shape = ring_shape(config, B)
    offset = jnp.full((B,), config.capacity, jax_impl.state.index_dtype())
    if 2 * 2 * np.prod(shape) <= RANDOM_RING_MAX_BYTES:
        k1, k2 = jax.random.split(jax.random.key(key))
        k, v = jax.random.normal(k1, shape, jnp.bfloat16), jax.random.normal(k2, shape, jnp.bfloat16)
    else:
        k, v = jnp.full(shape, 0.5, jnp.bfloat16), jnp.full(shape, -0.25, jnp.bfloat16)
    return jax_impl.StreamState(k=k, v=v, offset=offset, start_offset=jnp.zeros_like(offset))


def attention_tbps(config, state, kernels: str) -> float | None:
    """k + v bytes of every layer over the ring attention's time, all layers in one jit, ten calls back
    to back, so the host's latency is not counted (GPU only).
    kernels="twin": the twin attention; else the Pallas ring attention (None where the ring is too
    large for its int32 offsets)."""
    if not GPU or (kernels != "twin" and not fits_int32(state.k.shape)):
        return None
    L, B, H, C, D = state.k.shape
    q = jax.random.normal(jax.random.key(5), (B, H, 1, D), jnp.bfloat16)
    positions = jnp.broadcast_to(jnp.arange(C, dtype=jnp.int32), (B, C))
    q_pos = jnp.full((B, 1), C, jnp.int32)
    attend = (functools.partial(twin_attention.attention, context=config.context) if kernels == "twin" else
              functools.partial(ring_attention, context=config.context))
    f = jax.jit(lambda q, k, v: [attend(q, k, v, layer, positions, q_pos) for layer in range(L)])
    jax.block_until_ready(f(q, state.k, state.v))

    n = 10

    def calls():  # back to back, one wait: the kernels' time, not the host's latency around one call
        jax.block_until_ready([f(q, state.k, state.v) for _ in range(n)])

    ms = host_ms(calls, 5) / n
    return 2 * L * B * H * C * D * 2 / (ms * 1e-3) / 1e12


def profile_step(step, params, state, x, active) -> tuple[int | None, list | None, object]:
    """(kernels, top_kernels, state) of one donated step (`timing.kernel_profile`, the 8 costliest
    by name; None, None on the CPU): the state goes in and the step's new state comes back."""
    if not GPU:
        return None, None, state
    holder = {"state": state}

    def one():
        out, holder["state"] = step(params, holder["state"], x, active)
        jax.block_until_ready((out, holder["state"]))

    launches, top = kernel_profile(one, top=8)
    return launches, top, holder["state"]


def stack_cases(batches: str, mimi_batches: str) -> list[tuple[str, int, int]]:
    """(stack, T, B): Mimi at T=2 and T=10 for each of `mimi_batches`, then temporal (T=1) for each of
    `batches` (comma-separated; empty: none)."""
    cases = [("mimi", T, int(B)) for B in filter(None, mimi_batches.split(",")) for T in (2, 10)]
    return cases + [("temporal", 1, int(B)) for B in filter(None, batches.split(","))]


def torch_stack(kind: str, small: bool):
    """The torch module of stack `kind` ("temporal" or "mimi"; small: its small preset), bf16, weights
    drawn from seed 0: the weight buffers both the torch path and (through DLPack) JAX's read."""
    cls = TemporalStreaming if kind == "temporal" else MimiTransformer
    module = cls.from_config(PRESETS[kind + ("-small" if small else "")], dtype=torch.bfloat16, device=DEVICE)
    module.init_weights(generator=torch.Generator(device=DEVICE).manual_seed(0))
    return module


def release():
    """Hand back what Python no longer holds and torch's allocator caches (between stacks and cases:
    at B=64 the ring needs 100 GB)."""
    gc.collect()
    if GPU:
        torch.cuda.empty_cache()


def free_bytes() -> int | None:
    return torch.cuda.mem_get_info()[0] if GPU else None


def bench(kind: str, T: int, B: int, module, steps: int, bandwidth: float | None, kernels: str = "auto",
          loops=("python", "scan"), with_torch: bool = True) -> list[dict]:
    config = module.config
    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    weight_bytes = sum(int(w.nbytes) for w in module.weights().values())
    x = torch.randn(B, T, config.dim, device=DEVICE, dtype=torch.bfloat16)
    xj, aj = to_jax(x), to_jax(torch.ones(B, dtype=torch.bool, device=DEVICE))
    state = full_state(config, B)
    ring_bytes = int(state.k.nbytes + state.v.nbytes)
    common = {"stack": kind, "T": T, "B": B, "device": torch.cuda.get_device_name() if GPU else "cpu",
              "date": datetime.date.today().isoformat(),
              "floor_ms": None if bandwidth is None else 1e3 * (weight_bytes + ring_bytes) / bandwidth,
              "kernels_mode": kernels}
    # a jitted call with the step's arguments (state donated) that does next to nothing: what a
    # synchronized step costs before any kernel work (JAX's dispatch and the wait for the result)
    noop = jax.jit(lambda params, state, x, active: (x, state._replace(offset=state.offset + 1)), donate_argnums=(1,))
    common["call_floor_sync_ms"], common["call_floor_pipelined_ms"], state = time_step(noop, params, state, xj, aj,
                                                                                      steps)
    records = []
    for scan in (loop == "scan" for loop in loops):
        step = jax_impl.make_step(config, layer_loop="scan" if scan else "python", kernels=kernels,
                                  rope_freqs=module.rope_freqs())
        t0 = time.perf_counter()
        out, state = step(params, state, xj, aj)
        jax.block_until_ready((out, state))
        compile_s = time.perf_counter() - t0
        sync, pipelined, state = time_step(step, params, state, xj, aj, steps)
        sync_futures, _, state = time_step(step, params, state, xj, aj, steps, wait=jax.block_until_ready)
        launches, top, state = profile_step(step, params, state, xj, aj)
        records.append(dict(common, scan=scan, sync_ms=sync, sync_block_until_ready_ms=sync_futures,
                            pipelined_ms=pipelined, compile_s=compile_s,
                            kernels=launches, top_kernels=top))
        print(kind, T, B, "scan" if scan else "python", records[-1], flush=True)
    try:  # after the steps: a probe that fails (B=64 ran out of memory in it once) loses no step record
        tbps, note = attention_tbps(config, state, kernels), None
    except Exception as err:  # noqa: BLE001 (recorded)
        tbps, note = None, f"{type(err).__name__}: {err}"[:300]
    for r in records:
        r.update(attention_TBps=tbps, attention_note=note)
    del state               # the ring: at B=64 the drop-in's ring then found no room while anything
    gc.collect()            # held it (out of memory, and the allocator crashed)

    dropin_loop = "scan" if "scan" in loops else "python"  # the drop-in runs the same step as the records
    dropin_ms, dropin_device_sync_ms = time_dropin(module, B, x, steps, kernels, dropin_loop) if with_torch else (None, None)
    gc.collect()

    # the torch path under a CUDA graph, where its ring fits
    graph_ms, note = None, None
    if not with_torch:
        note = "not run (--no-torch)"
    elif not GPU:
        note = "no CUDA device"
    elif free_bytes() < 1.1 * ring_bytes:
        note = f"the torch ring ({ring_bytes / 2**30:.1f} GiB) does not fit in the free memory"
    else:
        module.streaming_init(B)
        module.state.k.normal_()
        module.state.v.normal_()
        module.state.offset.fill_(config.capacity)
        graph_ms = cuda_time(torch_graph(lambda: module.step(x)), steps)
        module.streaming_end()
        torch.cuda.empty_cache()
    for r in records:
        r.update(dropin_ms=dropin_ms, dropin_device_sync_ms=dropin_device_sync_ms, dropin_loop=dropin_loop, torch_graph_ms=graph_ms, torch_graph_note=note)
    return records


def time_dropin(module, B: int, x, steps: int, kernels: str, layer_loop: str) -> tuple[float, float | None]:
    """ms of the torch-facing drop-in's synchronized step on `module`'s weight buffers, its own full ring:
    (waited for on torch's current stream, where its outputs are ordered; waited for by
    `torch.cuda.synchronize`, which also waits for JAX's streams: PjRt's host callback behind each step,
    None on the CPU), interleaved step by step."""
    dropin = from_torch(module, layer_loop=layer_loop, kernels=kernels)
    dropin.streaming_init(B)
    dropin._streamer.state = None  # its zero rings go before the full ones come (50 GB each at B=64)
    dropin._streamer.state = full_state(module.config, B)
    waits = {"stream": lambda: torch.cuda.current_stream().synchronize(), "device": torch.cuda.synchronize}
    calls = {name: (lambda wait=wait: (dropin.step(x), wait() if GPU else None)) for name, wait in waits.items()}
    us = interleaved_medians_us(calls, steps, warmup=3)
    dropin.streaming_end()
    return us["stream"] / 1e3, us["device"] / 1e3 if GPU else None


def sessions_in_80ms(records: list[dict]) -> dict:
    """The largest B whose temporal step + two Mimi T=2 steps (synchronized, best loop) fit in 80 ms."""
    best = {}
    for r in records:
        key = (r["stack"], r["T"], r["B"])
        best[key] = min(best.get(key, float("inf")), r["sync_ms"])
    fits = {}
    for (stack, T, B), ms in best.items():
        if stack == "temporal" and ("mimi", 2, B) in best:
            fits[B] = ms + 2 * best[("mimi", 2, B)]
    ok = [B for B, ms in fits.items() if ms <= 80.0]
    return {"frame_ms_by_B": fits, "largest_B": max(ok) if ok else None}


def chart(records: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    temporal = sorted((r for r in records if r["stack"] == "temporal"), key=lambda r: r["B"])
    if not temporal:  # nothing to plot (every temporal case failed, or none was asked for)
        return
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for scan, style in ((False, "-"), (True, "--")):
        rs = [r for r in temporal if r["scan"] == scan]
        if not rs:  # a loop not run (--loops): no empty line in the legend
            continue
        label = "scan" if scan else "Python loop"
        ax.plot([r["B"] for r in rs], [r["sync_ms"] for r in rs], "o" + style, color="C0", label=f"JAX sync ({label})")
        ax.plot([r["B"] for r in rs], [r["pipelined_ms"] for r in rs], "s" + style, color="C2",
                label=f"JAX pipelined ({label})")
    rs = list({r["B"]: r for r in temporal}.values())  # one record per B (the floor and torch lines)
    for key, label, color in (("floor_ms", "floor (bytes / copy rate)", "gray"),
                              ("torch_graph_ms", "torch, CUDA graph", "C1")):
        pts = [(r["B"], r[key]) for r in rs if r[key] is not None]
        if pts:
            ax.plot(*zip(*pts), "^:", color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())  # 4, 10, 30: not 4 x 10^0
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("sessions B (full 3000-frame ring)" if temporal and temporal[0]["device"] != "cpu" else "B")
    ax.set_ylabel("ms per temporal step")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for scale_bench.json and scale_bench.png")
    parser.add_argument("--batches", default="1,4,16,64", help="temporal batch sizes")
    parser.add_argument("--mimi-batches", default="4,16,64", help="Mimi batch sizes (T=2 and T=10; empty: none)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per measurement (median)")
    parser.add_argument("--small", action="store_true", help="small presets on the CPU (a smoke run)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "twin"), help="the JAX step's kernels")
    parser.add_argument("--loops", default="python,scan", help="layer loops to time (python, scan)")
    parser.add_argument("--no-torch", action="store_true", help="no drop-in or torch timings (rings too large)")
    args = parser.parse_args()
    if not GPU and not args.small:
        raise SystemExit("scale_bench.py: no CUDA device; pass --small for the CPU smoke run")
    os.makedirs(args.out, exist_ok=True)
    bandwidth = copy_bandwidth() if GPU else None
    records, errors = [], {}
    modules = {}
    for kind, T, B in stack_cases(args.batches, args.mimi_batches):
        if kind not in modules:
            modules = {kind: torch_stack(kind, args.small)}
            release()  # the previous stack's weights and the init's temporaries
        try:
            records += bench(kind, T, B, modules[kind], args.steps, bandwidth, args.kernels, args.loops.split(","),
                             not args.no_torch)
        except Exception as err:  # noqa: BLE001 (recorded: a case that fails, e.g. out of memory, is a result)
            errors[f"{kind}_T{T}_B{B}"] = f"{type(err).__name__}: {err}"[:1000]
            print("error", kind, T, B, errors[f"{kind}_T{T}_B{B}"], flush=True)
        if GPU:
            torch.cuda.empty_cache()
        result = {"copy_TBps": None if bandwidth is None else bandwidth / 1e12, "records": records,
                  "sessions_in_80ms": sessions_in_80ms(records), "errors": errors,
                  "jax": jax.__version__, "torch": torch.__version__}
        with open(os.path.join(args.out, "scale_bench.json"), "w") as f:
            json.dump(result, f, indent=1, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
    chart(records, os.path.join(args.out, "scale_bench.png"))
    print(json.dumps(result["sessions_in_80ms"]), flush=True)


if __name__ == "__main__":
    main()
