"""How the host waits for a step decides the synchronized step's time (issue 11), in one device call.

    python benchmarks/sync_wait_gpu.py --out $OUT/sync_wait.json

`host_trace_gpu.py` found the synchronized step's extra time after its last kernel, with no host work
in it: the thread sits in `jax.block_until_ready` 0.5-0.8 ms after the GPU is done. PjRt fulfils a
buffer's ready future through a host callback queued behind the step (thread hops), so that is the
wait's own latency. Per case (the twin JAX step, bf16, random weights, full ring, the rolled scan),
synchronized ms a step for each wait, interleaved rounds, medians:
- jax: `jax.block_until_ready((out, state))`, as every earlier figure;
- is_ready: polling `jax.Array.is_ready` (the same future);
- cuda_event: `jax_impl.until_ready(spin=False)` (the output's DLPack export makes a private CUDA
  stream wait for the step on the GPU, then the host synchronizes that stream);
- torch: the same through torch (`torch.from_dlpack(out)` on torch's current stream, then its
  `synchronize`), what a drop-in's caller does;
- cuda_poll: `jax_impl.until_ready` (the default: the same, polling `cuStreamQuery`);
and the pipelined ms of the same step for reference. Never part of the tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import torch
from cuda_timing import run_meta
from host_timing import time_step
from scale_bench import full_state
from sync_gap_gpu import twin_case

from jax_impl.wait import until_ready

CASES = {  # name -> (stack, T, B)
    "mimi_T2_B4": ("mimi", 2, 4),
    "mimi_T10_B4": ("mimi", 10, 4),
    "temporal_B1": ("temporal", 1, 1),
    "temporal_B4": ("temporal", 1, 4),
}


def _poll(tree) -> None:
    leaves = jax.tree.leaves(tree)
    while not all(a.is_ready() for a in leaves):
        pass


def _torch_wait(tree) -> None:
    out = jax.tree.leaves(tree)[0]  # one output: all of a step's outputs are ready together
    t = torch.from_dlpack(out)
    torch.cuda.current_stream().synchronize()
    del t


WAITS = {"jax": jax.block_until_ready, "is_ready": _poll, "cuda_event": functools.partial(until_ready, spin=False),
         "cuda_poll": until_ready, "torch": _torch_wait}


def compare(step, params, state, x, active, steps: int, rounds: int = 5):
    """({wait: median ms}, state): `rounds` interleaved rounds of `steps` synchronized steps per wait."""
    holder = {"state": state}
    times = {w: [] for w in WAITS}
    for _ in range(rounds):
        for name, wait_fn in WAITS.items():
            for i in range(steps + 2):
                t0 = time.perf_counter()
                out, holder["state"] = step(params, holder["state"], x, active)
                wait_fn(out)  # the state is ready with the outputs: one execution, one event
                if i >= 2:
                    times[name].append(1e3 * (time.perf_counter() - t0))
                del out
    return {w: statistics.median(t) for w, t in times.items()}, holder["state"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    result = run_meta(cases={})
    modules = {}
    for name in args.cases.split(","):
        kind, T, B = CASES[name]
        config, params, x, active, step = twin_case(modules, kind, T, B)
        sync, pipelined, state = time_step(step, params, full_state(config, B), x, active, 30)
        waits, state = compare(step, params, state, x, active, args.steps)
        result["cases"][name] = {"pipelined_ms": pipelined, "time_step_sync_ms": sync,
                                 **{f"sync_{w}_ms": v for w, v in waits.items()}}
        print(name, json.dumps(result["cases"][name]), flush=True)
        del state, params
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
