"""Where a jitted step keeps a second ring: XLA's memory analysis of the compiled step, no run.

    python benchmarks/step_memory_gpu.py --batches 4,64 --out $OUT/step_memory.json
    python benchmarks/step_memory_gpu.py --batches 64 --run 64 --out $OUT/step_memory.json  # and run it (three steps)
    python benchmarks/step_memory_gpu.py --small --batches 2 --run 2 --weights-from jax --out /tmp/step_memory.json  # CPU

For each batch size and mode, the step (`jax_impl.make_step`, state donated) is lowered and
compiled from abstract shapes (nothing is allocated, so B=64's 100 GB of ring need not exist) and
the record holds XLA's `memory_analysis()` (argument, output, alias and temp bytes) next to one
ring's bytes, and every instruction of the optimized HLO whose result has the ring's shape, by
opcode (a `copy` there is a second ring). The optimized HLO of each case is written beside the
JSON (gzip). With --run, the step then runs three times on real buffers (the rings filled in place): is
the donated ring updated in place, and what does the device hold? Never part of the tests.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gzip
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax
import jax.numpy as jnp

import jax_impl
from jax_impl.config import PRESETS


def analyse(config, B, kernels, layer_loop, out_dir):
    S = jax.ShapeDtypeStruct
    dt = jnp.bfloat16
    params = jax.eval_shape(lambda: jax_impl.init_params(config, jax.random.key(0), dt))
    state = jax.eval_shape(lambda: jax_impl.init_state(config, B, dt))
    step = jax_impl.make_step(config, kernels=kernels, layer_loop=layer_loop)
    compiled = step.lower(params, state, S((B, 1 if config.dim > 1024 else 2, config.dim), dt), None).compile()
    ma = compiled.memory_analysis()
    fields = {k: getattr(ma, k, None) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "alias_size_in_bytes", "temp_size_in_bytes",
                                                 "generated_code_size_in_bytes")}
    text = compiled.as_text()
    ring = "bf16[" + ",".join(str(d) for d in state.k.shape) + "]"
    ops = collections.Counter()
    copies = []
    for line in text.splitlines():
        if ring in line.split("=", 1)[-1][:200] and "=" in line:
            m = re.search(r"\b([a-z][a-z0-9\-]*)\(", line.split("=", 1)[1])  # dtypes precede "[", opcodes "("
            op = m.group(1) if m else "?"
            ops[op] += 1
            if op in ("copy", "copy-start", "fusion") and len(copies) < 20:
                copies.append(line.strip()[:300])
    name = f"step_hlo_B{B}_{kernels}_{layer_loop}.txt.gz"
    with gzip.open(os.path.join(out_dir, name), "wt") as f:
        f.write(text)
    return {"B": B, "kernels": kernels, "layer_loop": layer_loop, "ring_bytes_each": int(state.k.size * 2),
            **fields, "ring_shaped_ops": dict(ops), "ring_shaped_copies_or_fusions": copies, "hlo": name}


def run_steps(config, B, kernels, layer_loop, weights_from):
    """Run the step three times on real buffers: does the donated ring come back in place (same address),
    and what does the device hold before and after (or when it fails)? weights_from: "jax" (init
    here) or "torch" (a torch module's buffers, input, mask and RoPE frequencies through DLPack, as
    scale_bench.py runs it)."""
    from scale_bench import full_state

    def in_use():
        stats = jax.devices()[0].memory_stats() or {}
        return {k: stats.get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}

    dt = jnp.bfloat16
    rec = {"B": B, "kernels": kernels, "layer_loop": layer_loop, "weights_from": weights_from}
    if weights_from == "torch":
        import torch

        from torch_bridge import TemporalStreaming
        from torch_bridge.dlpack import to_jax
        module = TemporalStreaming.from_config(config, dtype=torch.bfloat16, device="cuda")
        module.init_weights(generator=torch.Generator(device="cuda").manual_seed(0))
        params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
        rec["torch_allocated"] = torch.cuda.memory_allocated()
        rec["torch_reserved"] = torch.cuda.memory_reserved()
        x = to_jax(torch.randn(B, 1, config.dim, device="cuda", dtype=torch.bfloat16))
        active = to_jax(torch.ones(B, dtype=torch.bool, device="cuda"))
        rope_freqs = module.rope_freqs()
    else:
        params = jax_impl.init_params(config, jax.random.key(0), dt)
        x, active, rope_freqs = jnp.zeros((B, 1, config.dim), dt), jnp.ones((B,), bool), None
    state = full_state(config, B)
    jax.block_until_ready(state)
    rec["before"] = in_use()
    k_ptr, v_ptr = state.k.unsafe_buffer_pointer(), state.v.unsafe_buffer_pointer()
    step = jax_impl.make_step(config, kernels=kernels, layer_loop=layer_loop, rope_freqs=rope_freqs)
    rec["steps"] = []
    try:  # three steps, as a timing loop runs them: each takes the last one's (donated) state
        for _ in range(3):
            state = step(params, state, x, active)[1]
            jax.block_until_ready(state)
            rec["steps"].append({"k_in_place": state.k.unsafe_buffer_pointer() == k_ptr,
                                 "v_in_place": state.v.unsafe_buffer_pointer() == v_ptr, **in_use()})
    except Exception as e:  # noqa: BLE001 (recorded: the failure and the memory then are the result)
        rec.update(error=f"{type(e).__name__}: {str(e)[:400]}", at_error=in_use())
    return rec


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="step_memory.json")
    parser.add_argument("--batches", default="4,64")
    parser.add_argument("--modes", default="twin:scan,auto:python")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--run", default="", help="also run the step (three steps) at these B (real buffers), e.g. 16,64")
    parser.add_argument("--weights-from", default="jax,torch", help="where --run's weights come from")
    args = parser.parse_args()
    config = PRESETS["temporal-small" if args.small else "temporal"]
    out_dir = os.path.dirname(os.path.abspath(args.out))
    results = {"meta": {"device": str(jax.devices()[0]), "date": datetime.date.today().isoformat(),
                        "jax": jax.__version__}, "records": []}
    for B in (int(b) for b in args.batches.split(",")):
        for mode in args.modes.split(","):
            kernels, loop = mode.split(":")
            try:
                rec = analyse(config, B, kernels, loop, out_dir)
            except Exception as e:  # noqa: BLE001 (recorded: a compile that fails is a result)
                rec = {"B": B, "kernels": kernels, "layer_loop": loop, "error": f"{type(e).__name__}: {str(e)[:600]}"}
            results["records"].append(rec)
            print(json.dumps(rec)[:1500], flush=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    for B in (int(b) for b in args.run.split(",") if b):
        for source in args.weights_from.split(","):
            for mode in args.modes.split(","):
                rec = run_steps(config, B, *mode.split(":"), source)
                results.setdefault("runs", []).append(rec)
                print(json.dumps(rec)[:1500], flush=True)
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
