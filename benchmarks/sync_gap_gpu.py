"""Where a synchronized step's time goes beyond the pipelined one (issue 11), in one device call.

    TF_CPP_VMODULE=command_buffer_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 \
        python benchmarks/sync_gap_gpu.py --out $OUT/sync_gap.json 2> $OUT/xla.log

For each case (the twin JAX step, bf16, random weights, full ring; one `lax.scan` over the layers,
rolled or, for the "_unrolled" cases, unrolled over Mimi's 8 layers), one process measures:
- sync_ms / pipelined_ms (`host_timing.time_step`, no profiler);
- a timeline of --steps synchronized steps under torch.profiler (CUPTI sees JAX's kernels too, on the
  clock of the host's ranges): per step, medians of
  - call_ms: the jitted call's return (the host's dispatch, the command buffers' updates included);
  - to_first_kernel_ms: from the call's start to its first kernel's start;
  - gpu_span_ms: first kernel's start to last kernel's end, and gpu_idle_ms the idle time inside it;
  - wake_ms: the last kernel's end to the host's wait returning;
  - between_ms: the wait's return to the next call's start (the loop's own Python);
- the same steps launched back to back: the GPU's span and idle time per step;
- synchronized again with each step's outputs dropped, deleted or held over the next call, and with
  the wait a poll of `jax.Array.is_ready` instead of `jax.block_until_ready` (sync_spin_wait_ms).
With the XLA log of the command below (VLOG 3 of the command-buffer thunk), the lines "Updated command
buffer in N us" say whether and how long each execution brought its CUDA graphs up to date.
Never part of the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import torch
from cuda_timing import run_meta
from host_timing import host_ms, time_step
from scale_bench import full_state
from torch.profiler import ProfilerActivity, profile, record_function

import jax_impl
from jax_impl.config import PRESETS
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.dlpack import to_jax

CASES = {  # name -> (stack, T, B, scan_unroll)
    "temporal_B1": ("temporal", 1, 1, 1),
    "temporal_B4": ("temporal", 1, 4, 1),
    "mimi_T2_B4": ("mimi", 2, 4, 1),
    "mimi_T2_B4_unrolled": ("mimi", 2, 4, 8),
    "mimi_T10_B4": ("mimi", 10, 4, 1),
    "mimi_T10_B4_unrolled": ("mimi", 10, 4, 8),
}


def _kernels(prof) -> list[tuple[float, float]]:
    """(start, end) in us of every CUDA kernel and copy the profiler saw, in start order."""
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("sync_")]
    return sorted(spans)


def _busy(spans) -> float:
    """us covered by the union of the spans."""
    total, end = 0.0, float("-inf")
    for s, e in spans:
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def _spin_until_ready(tree) -> None:
    """Wait for every array of tree by polling `jax.Array.is_ready` (the thread never sleeps)."""
    leaves = jax.tree.leaves(tree)
    while not all(a.is_ready() for a in leaves):
        pass


def sync_ms(step, params, state, x, active, steps: int, outputs: str, spin: bool = False):
    """(median ms of synchronized steps, state); outputs: what becomes of each step's outputs,
    "dropped" (at the step's end, as `host_timing.time_step`), "deleted" (`jax.Array.delete`) or
    "held" until the next step has been called (a caller that uses them meanwhile); spin: wait by
    polling instead of `jax.block_until_ready`."""
    holder = {"state": state, "out": None}
    wait = _spin_until_ready if spin else jax.block_until_ready

    def one():
        out, holder["state"] = step(params, holder["state"], x, active)
        wait((out, holder["state"]))
        if outputs == "deleted":  # freed now, before the next call allocates
            for a in jax.tree.leaves(out):
                a.delete()
        holder["out"] = out if outputs == "held" else None

    for _ in range(3):
        one()
    return host_ms(one, steps), holder["state"]


def timeline(step, params, state, x, active, steps: int):
    """Per-step host ranges and GPU spans of synchronized steps, then pipelined ones (medians, ms)."""
    holder = {"state": state}
    for _ in range(3):
        out, holder["state"] = step(params, holder["state"], x, active)
        jax.block_until_ready((out, holder["state"]))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with record_function("sync_call"):
                out, holder["state"] = step(params, holder["state"], x, active)
            with record_function("sync_wait"):
                jax.block_until_ready((out, holder["state"]))
    cpu = torch.autograd.DeviceType.CPU  # (the profiler also puts each range on the GPU's timeline)
    ranges = {name: sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                           if e.name == name and e.device_type == cpu) for name in ("sync_call", "sync_wait")}
    kernels = _kernels(prof)
    rows = []
    for i, ((c0, c1), (_, w1)) in enumerate(zip(ranges["sync_call"], ranges["sync_wait"])):
        mine = [k for k in kernels if c0 <= k[0] < w1]
        if not mine:
            continue
        g0, g1 = mine[0][0], max(e for _, e in mine)
        nxt = ranges["sync_call"][i + 1][0] if i + 1 < len(ranges["sync_call"]) else None
        rows.append({"call": c1 - c0, "to_first_kernel": g0 - c0, "gpu_span": g1 - g0,
                     "gpu_idle": (g1 - g0) - _busy(mine), "wake": w1 - g1, "kernels": len(mine),
                     "between": None if nxt is None else nxt - w1, "period": None if nxt is None else nxt - c0})
    sync = {k + ("" if k == "kernels" else "_ms"):
            statistics.median(r[k] for r in rows if r[k] is not None) / (1 if k == "kernels" else 1e3)
            for k in rows[0]}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            _, holder["state"] = step(params, holder["state"], x, active)
        jax.block_until_ready(holder["state"])
    kernels = _kernels(prof)
    span = max(e for _, e in kernels) - kernels[0][0]
    piped = {"gpu_span_ms": span / steps / 1e3, "gpu_idle_ms": (span - _busy(kernels)) / steps / 1e3}
    return sync, piped, holder["state"]


def twin_case(modules: dict, kind: str, T: int, B: int, layers: int | None = None, scan_unroll: int = 1):
    """(config, params, x, active, step) of the twin JAX step (bf16, the rolled scan unless scan_unroll)
    on a torch module's random weights (DLPack), the preset's layers or `layers`. modules caches the
    module by (kind, layers), one at a time on the card."""
    config = PRESETS[kind] if layers is None else dataclasses.replace(PRESETS[kind], num_layers=layers)
    if (kind, layers) not in modules:
        cls = TemporalStreaming if kind == "temporal" else MimiTransformer
        modules.clear()
        modules[kind, layers] = cls.from_config(config, dtype=torch.bfloat16, device="cuda")
        modules[kind, layers].init_weights(generator=torch.Generator(device="cuda").manual_seed(0))
        torch.cuda.empty_cache()
    module = modules[kind, layers]
    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    x = to_jax(torch.randn(B, T, config.dim, device="cuda", dtype=torch.bfloat16))
    active = to_jax(torch.ones(B, dtype=torch.bool, device="cuda"))
    step = jax_impl.make_step(config, layer_loop="scan", scan_unroll=scan_unroll, kernels="twin",
                              rope_freqs=module.rope_freqs())
    return config, params, x, active, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    result = run_meta(allocator=os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR"), cases={})
    modules = {}
    for name in args.cases.split(","):
        kind, T, B, unroll = CASES[name]
        config, params, x, active, step = twin_case(modules, kind, T, B, scan_unroll=unroll)
        print(f"=== case {name}", file=sys.stderr, flush=True)  # marks the XLA log
        sync, pipelined_ms, state = time_step(step, params, full_state(config, B), x, active, args.steps)
        print(f"=== timeline {name}", file=sys.stderr, flush=True)
        timed, piped, state = timeline(step, params, state, x, active, args.steps)
        result["cases"][name] = {"sync_ms": sync, "pipelined_ms": pipelined_ms, "sync_timeline": timed,
                                 "pipelined_timeline": piped}
        for outputs in ("dropped", "deleted", "held"):
            print(f"=== {outputs} {name}", file=sys.stderr, flush=True)
            result["cases"][name][f"sync_outputs_{outputs}_ms"], state = sync_ms(step, params, state, x, active,
                                                                                args.steps, outputs)
        print(f"=== spin {name}", file=sys.stderr, flush=True)
        result["cases"][name]["sync_spin_wait_ms"], state = sync_ms(step, params, state, x, active, args.steps,
                                                                    "dropped", spin=True)
        print(name, json.dumps(result["cases"][name]), flush=True)
        del state
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
