"""Which kernels a twin step launches outside its layer loop, from XLA's optimized HLO (GPU).

Compiles the jitted twin step on abstract arguments (no ring is allocated, so any B works) and
writes, per case, the optimized HLO and a summary: the entry computation's launching instructions
(fusions, custom calls, copies, the while loop) and those of the loop body.

    python -m benchmarks.launch_map_gpu --out $OUT/launch_map
"""

from __future__ import annotations

import argparse
import json
import os
import re

import jax
import jax.numpy as jnp

import jax_impl
from jax_impl.config import PRESETS

# instructions that run as a kernel or a copy (the rest are tuples, bitcasts, parameters, ...)
LAUNCHING = re.compile(r"^\s*(?:ROOT )?(\S+) = \S+ (fusion|custom-call|copy|copy-start|while|conditional|"
                       r"dynamic-update-slice|scatter|gather|reduce|broadcast|convert|add|select|iota)\(")


def computations(hlo: str) -> dict[str, list[str]]:
    """name -> its instruction lines, for every computation of the module's text."""
    comps, name = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(ENTRY )?%?(\S+) ", line)
        if line and not line.startswith(" ") and m and line.rstrip().endswith("{"):
            name = ("ENTRY " if m.group(1) else "") + m.group(2)
            comps[name] = []
        elif name and line.startswith(" "):
            comps[name].append(line)
    return comps


def launches(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        m = LAUNCHING.match(line)
        if m:
            kind = m.group(2)
            extra = re.search(r'custom_call_target="([^"]+)"', line) or re.search(r"calls=(\S+)", line)
            name = re.search(r'"name":"([^"]+)"', line)
            out.append(f"{m.group(1)} {kind} {extra.group(1) if extra else ''} {name.group(1) if name else ''}".strip())
    return out


def case(kind: str, B: int, T: int, out_dir: str) -> dict:
    config = PRESETS[kind]
    dtype = jnp.bfloat16
    params = jax.eval_shape(lambda k: jax_impl.init_params(config, k, dtype), jax.random.key(0))
    state = jax.eval_shape(lambda: jax_impl.init_state(config, B, dtype))
    x = jax.ShapeDtypeStruct((B, T, config.dim), dtype)
    active = jax.ShapeDtypeStruct((B,), jnp.bool_)
    step = jax_impl.make_step(config, kernels="twin")
    hlo = step.lower(params, state, x, active).compile().as_text()
    tag = f"{kind}_B{B}_T{T}"
    with open(os.path.join(out_dir, tag + ".hlo.txt"), "w") as f:
        f.write(hlo)
    comps = computations(hlo)
    entry = next(n for n in comps if n.startswith("ENTRY"))
    summary = {"entry": launches(comps[entry])}
    for n, lines in comps.items():
        if "body" in n.lower() or "cond" in n.lower():
            summary[n] = launches(lines)
    print(tag, json.dumps(summary, indent=1), flush=True)
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    result = {"device": str(jax.devices()[0]), "jax": jax.__version__}
    for kind, B, T in (("temporal", 1, 1), ("temporal", 4, 1), ("mimi", 4, 2), ("mimi", 4, 10)):
        result[f"{kind}_B{B}_T{T}"] = case(kind, B, T, args.out)
    with open(os.path.join(args.out, "launch_map.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
