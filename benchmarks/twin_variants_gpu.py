"""A/B of the JAX twin step's variants in one process, timed round-robin (H200, full ring, bf16):

    python benchmarks/twin_variants_gpu.py --stacks mimi,temporal --batches 4 --out $OUT/variants.json

A variant is a set of `kernels_pallas.contract.linear` constants (speed-only choices: which launches are
fused) and the scan's unroll. Each variant's step is traced and compiled with its constants set
(the kernels read them at trace time), then the constants go back; the steps then run round-robin,
`--rounds` times `--steps` synchronized and pipelined steps each (`host_timing.time_step`), so
the card's drift between rounds hits every variant alike. Each starts on `scale_bench.full_state`'s
full ring (random values up to its size bound, the same for every variant). Recorded: the median
over rounds of each time, every round's times, the kernels a step and the top kernels
(torch.profiler), and whether every variant's outputs have the same bits as the first's (they
should: speed only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import jax
import numpy as np
import torch
from cuda_timing import kernel_profile
from host_timing import time_step
from scale_bench import full_state
from twin_step_gpu import build

import jax_impl
from kernels_pallas.contract import linear as contract
from torch_bridge.dlpack import to_jax

VARIANTS = {  # name -> ({contract constant: value}, scan_unroll; None: all the layers)
    "fused_unrolled": ({"TWIN_MMA_FUSED_NORM_MAX_BLOCKS": contract.TWIN_MMA_FUSED_NORM_MAX_BLOCKS}, None),
    "fused_rolled": ({"TWIN_MMA_FUSED_NORM_MAX_BLOCKS": contract.TWIN_MMA_FUSED_NORM_MAX_BLOCKS}, 1),
    "unfused_unrolled": ({"TWIN_MMA_FUSED_NORM_MAX_BLOCKS": 0}, None),
    "unfused_rolled": ({"TWIN_MMA_FUSED_NORM_MAX_BLOCKS": 0}, 1),
}


def compiled(module, constants: dict, scan_unroll, params, state, x):
    """The variant's jitted step (state donated), traced and run once with its constants set; returns
    (step, its outputs, the state after that call)."""
    saved = {k: getattr(contract, k) for k in constants}
    for k, v in constants.items():
        setattr(contract, k, v)
    try:
        fn = jax_impl.step_fn(module.config, kernels="twin", scan_unroll=scan_unroll or module.config.num_layers,
                              rope_freqs=module.rope_freqs())
        step = jax.jit(fn, donate_argnums=(1,))
        out, state = jax.block_until_ready(step(params, state, x, None))
    finally:
        for k, v in saved.items():
            setattr(contract, k, v)
    return step, out, state


def run(kind: str, B: int, names: list[str], rounds: int, steps: int) -> dict:
    module = build(kind, B)
    config = module.config
    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    T = 1 if kind == "temporal" else 2
    x = to_jax(torch.randn(B, T, config.dim, device="cuda").to(torch.bfloat16))

    steps_, states, first = {}, {}, None
    rec = {"stack": kind, "B": B, "T": T, "variants": {}}
    for name in names:
        constants, unroll = VARIANTS[name]
        step, out, states[name] = compiled(module, constants, unroll, params, full_state(config, B), x)
        steps_[name] = step
        flat = [np.asarray(a) for a in jax.tree.leaves(out)]
        if first is None:
            first = flat
        same = all(a.tobytes() == b.tobytes() for a, b in zip(flat, first))
        n, top = kernel_profile(lambda s=step, st=states[name]: jax.block_until_ready(s(params, st, x, None)[0]))
        rec["variants"][name] = {"constants": constants, "scan_unroll": unroll, "kernels": n, "top_kernels": top,
                                 "same_bits_as_first_on_a_full_ring": bool(same), "sync_ms": [], "pipelined_ms": []}
        states[name] = full_state(config, B)  # the profiled call donated the state: start again
    for _ in range(rounds):
        for name in names:
            sync, piped, states[name] = time_step(steps_[name], params, states[name], x, None, steps)
            rec["variants"][name]["sync_ms"].append(sync)
            rec["variants"][name]["pipelined_ms"].append(piped)
    for v in rec["variants"].values():
        v["sync_median_ms"] = statistics.median(v["sync_ms"])
        v["pipelined_median_ms"] = statistics.median(v["pipelined_ms"])
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stacks", default="mimi", help="comma-separated: mimi, temporal")
    parser.add_argument("--batches", default="4", help="comma-separated batch sizes")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="twin_variants_gpu.json")
    args = parser.parse_args()
    results = {"meta": {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
                        "jax": jax.__version__, "torch": torch.__version__, "rounds": args.rounds,
                        "steps": args.steps}}
    for kind in args.stacks.split(","):
        for B in args.batches.split(","):
            rec = run(kind, int(B), args.variants.split(","), args.rounds, args.steps)
            torch.cuda.empty_cache()
            results[f"{kind}_B{B}"] = rec
            for name, v in rec["variants"].items():
                print(kind, B, name, v["kernels"], round(v["sync_median_ms"], 4), round(v["pipelined_median_ms"], 4),
                      v["same_bits_as_first_on_a_full_ring"], flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
