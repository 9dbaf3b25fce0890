"""The twin attention's plan (slots per block BC, slots per split `chunk`) against the ring's copy rate,
at the temporal sizes (32 heads, head 128, 3000 slots, bf16), B = 1, 4, 16: which plan reads the
ring fastest in the JAX step's kernel (Pallas), and whether the Triton twin still gives its bits.

    python benchmarks/attention_plan_gpu.py --out $OUT/attention_plan.json

`--forms lanes,mma` times the attention's forms (`contract.twin_attention_form`: the lane form's trees,
or the tensor cores' products; other bits, each checked against its Triton twin at B=4).
The plan is part of the numerics contract (`contract.AttentionBlocks`, read by both packages at
call time): another plan gives other bits, the same on both sides. Per plan, warps and B: ms per
layer of the Pallas kernel (one jit of --calls calls over L stacked layers, larger than the L2, host
timed, median of 10), the ring bytes per second and their share of the copy rate measured in the
same run, and for each plan at B=4 whether Pallas == Triton bit for bit. Never part of the tests.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import torch
from cuda_timing import copy_bandwidth, run_meta
from twin_tune_gpu import attention_case, jax_ms, same, with_contract

from kernels_pallas import twin_attention as pa
from kernels_pallas.contract import attention as contract
from kernels_triton import twin_attention as ta
from torch_bridge.dlpack import to_jax

PLANS = ((64, 256), (64, 128), (32, 128), (64, 64), (32, 64), (128, 256))
H, D, C, T = 32, 128, 3000, 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="attention_plan.json")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--warps", default="2,4")
    parser.add_argument("--plans", default=",".join(f"{bc}x{ch}" for bc, ch in PLANS), help="BCxchunk, ...")
    parser.add_argument("--forms", default="mma", help="the attention's forms, lanes and/or mma")
    parser.add_argument("--layers", type=int, default=8, help="stacked layers (more than fit in the L2)")
    parser.add_argument("--calls", type=int, default=64,
                        help="kernel calls a timed jit, the host's dispatch spread over them (with 8, the same "
                             "kernel measured up to 1.5x apart between runs: RESULTS, twelfth session)")
    args = parser.parse_args()
    L = args.layers
    plans = [tuple(int(v) for v in p_.split("x")) for p_ in args.plans.split(",")]
    ceiling = copy_bandwidth()
    default = (contract.TWIN_ATTENTION_BC, contract.TWIN_ATTENTION_CHUNK)
    res = {"meta": run_meta(copy_TBps=ceiling / 1e12, default_plan=default, H=H, D=D, C=C, layers=L,
                            calls=args.calls), "rows": []}
    for B in (int(b) for b in args.batches.split(",")):
        q, ring_k, ring_v, positions, q_pos = attention_case(B, H, T, D, C, L)
        jargs = tuple(to_jax(t) for t in (q, ring_k, ring_v, positions, q_pos))
        layer_bytes = 2 * B * H * C * D * 2
        for (bc, chunk), form in ((p_, f_) for p_ in plans for f_ in args.forms.split(",")):
            with_contract(TWIN_ATTENTION_BC=bc, TWIN_ATTENTION_CHUNK=chunk)
            for wp in (int(w) for w in args.warps.split(",")):
                row = {"B": B, "bc": bc, "chunk": chunk, "splits": contract.AttentionBlocks.for_shapes(C).splits, "warps": wp,
                       "form": form}
                try:
                    def layers(q, k, v, p, qp, wp=wp, B=B, form=form):  # as in the step: one set of counters, carried
                        sems, outs = jnp.zeros((contract.twin_sems_size(B, H, T),), jnp.int32), []
                        for i in range(args.calls):
                            o, sems = pa.attention(q, k, v, i % L, p, qp, context=C, sems=sems, num_warps=wp,
                                                   form=form)
                            outs.append(o)
                        return outs

                    fn = jax.jit(layers)
                    ms = jax_ms(fn, jargs, args.calls)
                    row.update(us_per_layer=1e3 * ms, TBps=layer_bytes / (ms * 1e-3) / 1e12,
                               of_copy=layer_bytes / (ms * 1e-3) / ceiling)
                    if B == 4 and wp == 2:
                        yj = jax.jit(lambda q, k, v, p, qp, form=form: pa.attention(
                            q, k, v, L - 1, p, qp, context=C, num_warps=2, form=form))(*jargs)
                        row["pallas_equals_triton"] = same(yj, ta.attention(q, ring_k, ring_v, L - 1, positions,
                                                                            q_pos, context=C, form=form))
                except Exception as e:  # noqa: BLE001 (recorded: a plan that fails, the sweep goes on)
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:
                    json.dump(res, f, indent=1)
        del q, ring_k, ring_v, jargs
        torch.cuda.empty_cache()
    with_contract(TWIN_ATTENTION_BC=default[0], TWIN_ATTENTION_CHUNK=default[1])


if __name__ == "__main__":
    main()
