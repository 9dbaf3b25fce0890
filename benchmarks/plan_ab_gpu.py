"""The twin step under two plans (the MMA linears', the kernels' speed constants), in one process:
one copy rate, one host.

    git show <rev>:kernels_pallas/contract/linear.py > candidate_linear.py   # the plan to try
    python benchmarks/plan_ab_gpu.py --candidate candidate_linear.py --out $OUT/plan_ab.json
    python benchmarks/plan_ab_gpu.py --set TWIN_ATTENTION_SPLITS_FIRST=True --out $OUT/order_ab.json
    python benchmarks/plan_ab_gpu.py --xla xla_gpu_enable_pdl=false --out $OUT/xla_pdl_ab.json
    python benchmarks/plan_ab_gpu.py --unroll 2 --out $OUT/unroll_ab.json
    python benchmarks/plan_ab_gpu.py --candidate kernels_pallas/contract/linear.py --small --out /tmp/ab.json  # CPU smoke

A: this checkout as it is; B: the candidate file's `MmaBlocks` and `twin_mma_stages` (loaded as
a module) put into both twins (`kernels_pallas.twin_linear`, `kernels_triton.twin_linear`), and each
`--set` constant of `kernels_pallas.contract` (read by both twins at call time), while B's step traces;
each `--xla` option is B's XLA compiler option (`jax.jit(compiler_options=)`), and `--unroll` B's
layer loop's unroll factor (`make_step(scan_unroll=)`).
Two steps timed in two processes differ by each process's copy rate and host (the
seventeenth session's old and new plans: 2% apart in copy rate, 0.1-0.2 ms in a jitted call's cost),
so here both steps are compiled in one process and timed in `--rounds` alternating rounds
(`host_timing.time_step` each: synchronized and pipelined), medians over the rounds; the state (every
slot visible, `scale_bench.full_state`) goes from step to step, so one ring lives at B=64. Each
step's kernels by name from torch.profiler. The plans change the speed only; the bits are for the GPU
tests and `twin_step_gpu.py --only bits` to check. A timing question only; never part of the tests.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import statistics

import jax
import torch
from cuda_timing import copy_bandwidth, run_meta
from host_timing import time_step
from scale_bench import DEVICE, GPU, full_state, profile_step, release, stack_cases, torch_stack
from twin_tune_gpu import contract_module

import jax_impl
from kernels_pallas import twin_linear as pli
from kernels_triton import twin_linear as tli
from torch_bridge.dlpack import to_jax

PLAN = ("MmaBlocks", "twin_mma_stages")


def patches(candidate: str | None, sets: list[str]) -> list[tuple]:
    """B's (module, name, value)s: the candidate file's plan in both twins, then each NAME=VALUE
    (a Python literal) as a constant of `kernels_pallas.contract`."""
    out = []
    if candidate is not None:
        spec = importlib.util.spec_from_file_location("candidate_plan", candidate)
        plan = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plan)
        out += [(mod, name, getattr(plan, name)) for mod in (pli, tli) for name in PLAN]
    for item in sets:
        name, _, value = item.partition("=")
        try:
            module = contract_module(name)
        except KeyError as e:
            raise SystemExit(f"--set: {e.args[0]}") from None
        out.append((module, name, ast.literal_eval(value)))
    return out


def xla_options(items: list[str]) -> dict:
    """NAME=VALUE items as `jax.jit` compiler options: true / false as bools, else Python literals,
    else strings."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if value.lower() in ("true", "false"):
            out[name] = value.lower() == "true"
        else:
            try:
                out[name] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                out[name] = value
    return out


def compiled_steps(config, rope_freqs, changes, xla, unroll, params, state, x, active):
    """(step A, step B, state): both traced and run once, B under `changes` (`patches`), the XLA
    compiler options `xla` and the layer loop unrolled `unroll` times."""
    steps = []
    for change, options, n in (((), {}, 1), (changes, xla, unroll)):
        saved = [(mod, name, getattr(mod, name)) for mod, name, _ in change]
        for mod, name, value in change:
            setattr(mod, name, value)
        try:
            # make_step's body, uncached: the cached one would hand B the jit A traced
            fn = jax_impl.step_fn(config, layer_loop="scan", scan_unroll=n, kernels="twin", rope_freqs=rope_freqs)
            step = jax.jit(fn, donate_argnums=(1,), compiler_options=options or None)
            out, state = step(params, state, x, active)
            jax.block_until_ready((out, state))
        finally:
            for mod, name, f in saved:
                setattr(mod, name, f)
        steps.append(step)
    return steps[0], steps[1], state


def case(kind: str, T: int, B: int, module, changes, xla: dict, unroll: int, rounds: int, steps: int) -> dict:
    config = module.config
    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    x = to_jax(torch.randn(B, T, config.dim, device=DEVICE, dtype=torch.bfloat16))
    active = to_jax(torch.ones(B, dtype=torch.bool, device=DEVICE))
    a, b, state = compiled_steps(config, module.rope_freqs(), changes, xla, unroll, params, full_state(config, B),
                                 x, active)
    times: dict = {f"{s}_{k}": [] for s in "ab" for k in ("sync_ms", "pipelined_ms")}
    for _ in range(rounds):
        for name, step in (("a", a), ("b", b)):
            sync, pipelined, state = time_step(step, params, state, x, active, steps)
            times[f"{name}_sync_ms"].append(sync)
            times[f"{name}_pipelined_ms"].append(pipelined)
    rec = {"stack": kind, "T": T, "B": B, **{k: statistics.median(v) for k, v in times.items()}, "rounds": times}
    for name, step in (("a", a), ("b", b)):
        rec[f"{name}_kernels"], rec[f"{name}_top_kernels"], state = profile_step(step, params, state, x, active)
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidate", help="a Python file defining MmaBlocks and twin_mma_stages")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="B's value of a kernels_pallas.contract constant (repeatable)")
    parser.add_argument("--xla", action="append", default=[], metavar="NAME=VALUE",
                        help="B's XLA compiler option, e.g. xla_gpu_enable_pdl=false (repeatable)")
    parser.add_argument("--unroll", type=int, default=1, help="B's layer loop unroll factor")
    parser.add_argument("--out", default="plan_ab.json")
    parser.add_argument("--batches", default="1,16,64", help="temporal batch sizes")
    parser.add_argument("--mimi-batches", default="64", help="Mimi batch sizes (T=2 and T=10; empty: none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="steps a round and step (time_step's median)")
    parser.add_argument("--small", action="store_true", help="small presets on the CPU (a smoke run)")
    args = parser.parse_args()
    if not GPU and not args.small:
        raise SystemExit("plan_ab_gpu.py: no CUDA device; pass --small for the CPU smoke run")
    if args.candidate is None and not args.set and not args.xla and args.unroll == 1:
        raise SystemExit("plan_ab_gpu.py: give B a --candidate, a --set, an --xla option or an --unroll")
    changes, xla = patches(args.candidate, args.set), xla_options(args.xla)
    copy_TBps = copy_bandwidth() / 1e12 if GPU else None
    meta = run_meta(candidate=args.candidate, set=args.set, xla=xla, unroll=args.unroll, copy_TBps=copy_TBps)
    results = {"meta": meta, "records": []}
    module, built = None, None
    for kind, T, B in stack_cases(args.batches, args.mimi_batches):
        if built != kind:
            module, built = None, kind  # one stack's weights at a time
            module = torch_stack(kind, args.small)
        release()  # the init's temporaries, the last case's ring: at B=64 the ring needs 100 GB
        results["records"].append(rec := case(kind, T, B, module, changes, xla, args.unroll, args.rounds, args.steps))
        print(json.dumps({k: v for k, v in rec.items() if k != "rounds"}), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
