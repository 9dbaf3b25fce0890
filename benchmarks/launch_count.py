"""Kernels a jitted function launches, counted where no GPU is needed: in its jaxpr (every
`pallas_call` is one Triton kernel on the GPU; the other operations are XLA's, which fuses them
into fewer kernels), and in a compiled module's HLO text (on the GPU: custom calls and fusions).

    python -m benchmarks.launch_count                      # the depformer frame at real sizes, traced
    python -m benchmarks.launch_count --preset moshi-small --kernels twin,reference --scan
    python -m benchmarks.launch_count --stack codec --names   # the Mimi codec's encode and decode steps

On the CPU the twins run interpreted: the linears take the lane form, whose qkv projection and
cache write are two kernels where the GPU's MMA form runs one, and whose norm is fused into the
linear (the MMA form runs the norm kernel first over K > 512), so the GPU's count differs by those
(torch.profiler counts the GPU's: `frame_bench`'s kernels_per_inner_step).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

# jaxpr primitives XLA runs as no kernel of their own (a view of the same bytes)
VIEWS = frozenset({"reshape", "squeeze", "expand_dims"})


def _sub_jaxprs(eqn):
    """(jaxpr, multiplicity) of the jaxprs an equation runs: a scan's body `length` times, a
    while loop's body once (its trip count is unknown here), a cond's costliest branch once."""
    p = eqn.params
    if eqn.primitive.name == "scan":
        return [(p["jaxpr"].jaxpr, p["length"])]
    if eqn.primitive.name == "cond":
        return [(max((b.jaxpr for b in p["branches"]), key=lambda j: len(j.eqns)), 1)]
    subs = []
    for v in p.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(j, jcore.ClosedJaxpr):
                subs.append((j.jaxpr, 1))
            elif isinstance(j, jcore.Jaxpr):
                subs.append((j, 1))
    return subs


def jaxpr_counts(jaxpr, times: int = 1, counts: collections.Counter | None = None) -> collections.Counter:
    """Counter of kernel-level operations of a jaxpr, loops multiplied out: "pallas_call:NAME" per
    Pallas kernel (its `name`), "xla:PRIMITIVE" per other operation (views left out), and "loops"
    for each while/scan left as a loop."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "pallas_call":
            info = eqn.params.get("name_and_src_info")
            counts[f"pallas_call:{getattr(info, 'name', None) or eqn.params.get('name', '?')}"] += times
            continue
        subs = _sub_jaxprs(eqn)
        if name in ("scan", "while"):
            counts["loops"] += times
        if subs:
            for sub, n in subs:
                jaxpr_counts(sub, times * n, counts)
        elif name not in VIEWS:
            counts[f"xla:{name}"] += times
    return counts


def summarize(counts: collections.Counter, per: int = 1) -> dict:
    """{pallas_calls, xla_ops, loops, per_name} divided by `per` (e.g. dep_q: per inner step)."""
    pallas = sum(n for k, n in counts.items() if k.startswith("pallas_call:"))
    xla = sum(n for k, n in counts.items() if k.startswith("xla:"))
    return {"pallas_calls": pallas / per, "xla_ops": xla / per, "loops": counts["loops"],
            "per_name": {k: v / per for k, v in sorted(counts.items()) if k != "loops"}}


HLO_KERNEL_OPS = ("fusion", "custom-call", "copy", "gather", "scatter", "sort", "reduce", "dynamic-update-slice",
                  "dynamic-slice", "concatenate", "while", "conditional")


def hlo_counts(hlo_text: str) -> collections.Counter:
    """Counter of the instructions of a compiled module (`jax.jit(f).lower(...).compile().as_text()`)
    that launch work on the GPU: the opcodes HLO_KERNEL_OPS, outside fused computations (a fusion's
    body is its one kernel); a while body's are counted once."""
    counts: collections.Counter = collections.Counter()
    fused = False
    for line in hlo_text.splitlines():
        if not line.startswith(" "):  # a computation's header: "%fused_... {" or "ENTRY ... {"
            fused = line.lstrip("%").startswith(("fused_", "wrapped_")) or " fused_" in line.split("{")[0]
            continue
        if fused:
            continue
        m = re.search(r"= \S+ ([a-z\-]+)\(", line)
        if m and m.group(1) in HLO_KERNEL_OPS:
            counts[m.group(1)] += 1
    return counts


def depformer_counts(preset: str, kernels: str, B: int = 1, unroll: bool | None = True) -> dict:
    """The depformer frame's counts per inner step (jaxpr, traced on abstract inputs: any size);
    unroll: `depformer_frame`'s (True: the GPU's twin frame)."""
    from jax_impl.depformer import depformer_frame
    from jax_impl.depformer_config import DEPFORMER_PRESETS, buffer_shapes

    cfg = DEPFORMER_PRESETS[preset]
    params = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16) for k, s in buffer_shapes(cfg).items()}
    text = jax.ShapeDtypeStruct((B,), jnp.int32)
    out = jax.ShapeDtypeStruct((B, 1, cfg.temporal_dim), jnp.bfloat16)
    frame = functools.partial(depformer_frame, cfg, kernels=kernels, unroll=unroll)
    jaxpr = jax.make_jaxpr(frame)(params, text, out).jaxpr
    return {"preset": preset, "kernels": kernels, "B": B, "dep_q": cfg.dep_q, "unroll": unroll,
            "backend": jax.default_backend(),
            **summarize(jaxpr_counts(jaxpr), per=cfg.dep_q)}


def as_gpu(fn, *args):
    """fn traced to its jaxpr as on the GPU: the kernels choose their compiled forms (the MMA linears,
    the fused qkv projection) where `jax.default_backend()` says "gpu". Tracing only: nothing runs."""
    real = jax.default_backend
    jax.default_backend = lambda: "gpu"
    try:
        return jax.make_jaxpr(fn)(*args).jaxpr
    finally:
        jax.default_backend = real


def codec_counts(preset: str, kernels: str, B: int = 1, gpu: bool = True) -> list[dict]:
    """The codec's encode and decode steps' counts (jaxpr, abstract bfloat16 inputs: any size); gpu:
    traced as on the GPU (`as_gpu`), else as here."""
    from jax_impl import codec
    from jax_impl.codec_config import CODEC_PRESETS, codec_weight_shapes
    from jax_impl.model import init_params

    cfg = CODEC_PRESETS[preset]
    dtype = jnp.bfloat16
    c, shapes = cfg, codec_weight_shapes(cfg)

    def abstract(tree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, dtype), tree)

    stack = jax.eval_shape(lambda key: init_params(cfg.transformer, key, dtype), jax.random.PRNGKey(0))
    params = codec.CodecParams(
        {k: jax.ShapeDtypeStruct(v, dtype) for k, v in shapes.items() if not k.startswith("quantizer.")},
        jax.ShapeDtypeStruct((c.num_codebooks, c.codebook_size, c.codebook_dim), dtype),
        jax.ShapeDtypeStruct((2, c.codebook_dim, c.dimension, 1), dtype),
        jax.ShapeDtypeStruct((2, c.dimension, c.codebook_dim, 1), dtype), abstract(stack), abstract(stack))
    state = jax.eval_shape(lambda: codec.init_codec_state(cfg, B, dtype))
    active = jax.ShapeDtypeStruct((B,), jnp.bool_)
    steps = (("encode", codec.encode_fn(cfg, kernels=kernels), jax.ShapeDtypeStruct((B, 1, cfg.frame_size), dtype)),
             ("decode", codec.decode_fn(cfg, kernels=kernels), jax.ShapeDtypeStruct((B, cfg.num_codebooks), jnp.int32)))
    records = []
    for name, fn, x in steps:
        jaxpr = as_gpu(fn, params, state, x, active) if gpu else jax.make_jaxpr(fn)(params, state, x, active).jaxpr
        records.append({"stack": "codec", "step": name, "preset": preset, "kernels": kernels, "B": B,
                        "traced_as": "gpu" if gpu else jax.default_backend(), **summarize(jaxpr_counts(jaxpr))})
    return records


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="depformer", choices=("depformer", "codec"))
    parser.add_argument("--preset", default=None,
                        help="a DEPFORMER_PRESETS name (default personaplex) or, with --stack codec, a CODEC_PRESETS "
                             "name (default mimi)")
    parser.add_argument("--kernels", default="twin", help="comma-separated: twin, reference")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--names", action="store_true", help="print the count of each kernel and operation")
    parser.add_argument("--scan", action="store_true", help="the inner steps as a lax.scan (the CPU's default)")
    args = parser.parse_args(argv)
    for kind in args.kernels.split(","):
        if args.stack == "codec":
            records = codec_counts(args.preset or "mimi", kind, args.batch)
        else:
            records = [depformer_counts(args.preset or "personaplex", kind, args.batch, unroll=not args.scan)]
        for record in records:
            if not args.names:
                record.pop("per_name")
            print(json.dumps(record))


if __name__ == "__main__":
    main()
