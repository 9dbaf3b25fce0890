"""What the host does around a synchronized step (issue 11's sync gap), from JAX's own profiler.

    python benchmarks/host_trace_gpu.py --out $OUT/host_trace.json

`sync_gap_gpu.py` (torch.profiler, CUPTI) found ~0.3 ms between a synchronized temporal step's call
and its first kernel and ~0.35 ms between its last kernel and the wait's return, against ~0.2 and
~0.14 ms for Mimi; it could not say what fills them. `jax.profiler` also records XLA's and PjRt's
own host annotations (TraceMe) on every thread, on the clock of the GPU's activity. For each case
(the twin JAX step, bf16, random weights, full ring, the rolled `lax.scan`), --steps synchronized
steps are traced, each a "sync_call" then a "sync_wait" annotation, and per step this writes:
- pre_ms: the call's start to the first GPU activity; post_ms: the last GPU activity's end to the
  wait's return; gpu_ms: between them;
- the host events inside the pre and post gaps, clipped to them: per (thread, name), the median
  count and time over the steps (the largest first);
- the whole event list of the median step (host and GPU, start and duration in us from its call),
  for reading by eye.
A case with fewer layers (`_L8`) says whether the gaps grow with the layer loop. Never part of the tests.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the card
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import torch
from cuda_timing import run_meta
from host_timing import time_step
from scale_bench import full_state
from sync_gap_gpu import twin_case

CASES = {  # name -> (stack, T, B, layers or None for the preset's)
    "temporal_B1": ("temporal", 1, 1, None),
    "temporal_B1_L8": ("temporal", 1, 1, 8),
    "temporal_B4": ("temporal", 1, 4, None),
    "mimi_T2_B4": ("mimi", 2, 4, None),
}


def traced_steps(step, params, state, x, active, steps: int):
    """(trace events, state): `steps` synchronized steps under jax.profiler (Python tracer off)."""
    holder = {"state": state}
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 2
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True, profiler_options=options)
        for _ in range(steps):
            with jax.profiler.TraceAnnotation("sync_call"):
                out, holder["state"] = step(params, holder["state"], x, active)
            with jax.profiler.TraceAnnotation("sync_wait"):
                jax.block_until_ready((out, holder["state"]))
            del out
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            trace = json.load(f)
    return (trace["traceEvents"] if isinstance(trace, dict) else trace), holder["state"]


def analyse(events: list[dict]) -> dict:
    """The per-step gaps and the host events inside them (the module docstring)."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e.get("ph") == "X"]
    gpu = sorted((e for e in spans if "GPU" in procs.get(e["pid"], "") or "gpu" in procs.get(e["pid"], "")),
                 key=lambda e: e["ts"])
    host = [e for e in spans if e not in gpu]
    calls = sorted(e["ts"] for e in host if e["name"] == "sync_call")
    waits = sorted((e["ts"], e["ts"] + e["dur"]) for e in host if e["name"] == "sync_wait")

    def where(e):
        return f"{procs.get(e['pid'], e['pid'])}/{threads.get((e['pid'], e.get('tid')), e.get('tid'))}"

    rows = []
    for c0, (_, w1) in zip(calls, waits):
        mine = [e for e in gpu if c0 <= e["ts"] < w1]
        if not mine:
            continue
        g0, g1 = mine[0]["ts"], max(e["ts"] + e["dur"] for e in mine)
        gaps = {}
        for gap, (a, b) in (("pre", (c0, g0)), ("post", (g1, w1))):
            inside = {}
            for e in host:
                cut = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
                if cut > 0 and e["name"] not in ("sync_call", "sync_wait"):
                    key = f"{where(e)} :: {e['name']}"
                    n, t = inside.get(key, (0, 0.0))
                    inside[key] = (n + 1, t + cut)
            gaps[gap] = inside
        listing = [(round(e["ts"] - c0, 1), round(e["dur"], 1), where(e), e["name"])
                   for e in sorted(host + mine, key=lambda e: e["ts"]) if c0 <= e["ts"] < w1 and e["dur"] >= 1.0]
        rows.append({"pre": g0 - c0, "gpu": g1 - g0, "post": w1 - g1, "gaps": gaps, "listing": listing,
                     "gpu_events": len(mine)})
    summary = {k + "_ms": statistics.median(r[k] for r in rows) / 1e3 for k in ("pre", "gpu", "post")}
    summary["gpu_events"] = statistics.median(r["gpu_events"] for r in rows)
    for gap in ("pre", "post"):
        keys = {k for r in rows for k in r["gaps"][gap]}
        table = {k: (statistics.median(r["gaps"][gap].get(k, (0, 0))[0] for r in rows),
                     round(statistics.median(r["gaps"][gap].get(k, (0, 0.0))[1] for r in rows), 1)) for k in keys}
        table = {k: v for k, v in table.items() if v[1] > 0}
        summary[f"{gap}_host_events"] = dict(sorted(table.items(), key=lambda kv: -kv[1][1])[:40])
    median_step = sorted(rows, key=lambda r: r["pre"] + r["post"])[len(rows) // 2]
    summary["median_step_listing"] = median_step["listing"][:400]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON to write")
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    result = run_meta(xla_flags=os.environ.get("XLA_FLAGS"), cases={})
    modules = {}
    for name in args.cases.split(","):
        kind, T, B, layers = CASES[name]
        config, params, x, active, step = twin_case(modules, kind, T, B, layers)
        sync, pipelined, state = time_step(step, params, full_state(config, B), x, active, 30)
        events, state = traced_steps(step, params, state, x, active, args.steps)
        result["cases"][name] = {"sync_ms": sync, "pipelined_ms": pipelined, "layers": config.num_layers,
                                 **analyse(events)}
        short = {k: v for k, v in result["cases"][name].items() if k.endswith("ms")}
        print(name, json.dumps(short), flush=True)
        del state, params
        torch.cuda.empty_cache()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
