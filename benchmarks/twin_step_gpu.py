"""The twin step on the GPU at the real sizes: bits (JAX twin vs torch twin), batch invariance,
accuracy against float32, speed. One process:

    python -m benchmarks.twin_step_gpu --out $OUT/twin_step_gpu.json

1. bits: temporal (7B sizes) and Mimi, bf16, B=4, random weights shared through DLPack, 300 steps
   with random activity and recycling (reset_slot, the reset_slot + bump_slot_start sacrifice
   tick, bump_slot_start, reset_rows), offsets started 24 steps short of capacity so the ring
   wraps before the recycling resets every row; every
   step compares out, text logits, both rings and the offsets on the device (torch.equal).
2. batch invariance: a row stepped alone (B=1) and among others (B=4, 16) has the same bits.
3. accuracy: 120 steps of B=4 against a float32 torch reference run of the same weights and
   inputs: mean normwise error of out, greedy-token agreement, for the twin step, the default JAX
   step (kernels="auto") and the torch reference path, all bf16.
4. speed: synchronized and pipelined ms/step of the JAX twin step (and the default JAX step), the
   torch twin step eager and under a CUDA graph, kernel launches per step and the kernels that
   take the most GPU time (torch.profiler, which sees JAX's kernels too). With 'mosaic' in --only,
   also the JAX twin step on the Mosaic GPU twins (made under `kernels_pallas.backend.use("mosaic_gpu")`),
   side by side in the same process, and whether its first step has the bits of the step on the
   Triton-backend twins. (The variable set for the whole run puts every part on the Mosaic twins:
   the bits part then holds them to the torch twin step.)
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_impl
from benchmarks.timing import host_ms, kernel_profile, run_meta, time_step, torch_graph
from jax_impl.config import PRESETS
from jax_impl.parity import bits
from kernels_pallas import backend
from kernels_pallas.contract import linear as contract
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.dlpack import to_jax, to_torch

RESULTS: dict = {}
DEVICE, SIZE = "cuda", ""  # --small: the small presets on the CPU (a smoke run of this script)
SCAN_UNROLL = None  # --scan-unroll: the twin scan's unroll factor (None: make_step's default)


def record(key, value, out):
    RESULTS[key] = value
    print(key, json.dumps(value)[:1500], flush=True)
    with open(out, "w") as f:
        json.dump(RESULTS, f, indent=1)


def build(kind, B, kernels="twin", dtype=torch.bfloat16, seed=0, config=None):
    config = config or PRESETS[kind + SIZE]
    cls = TemporalStreaming if kind == "temporal" else MimiTransformer
    module = cls.from_config(config, dtype=dtype, device=DEVICE, kernels=kernels)
    module.init_weights(generator=torch.Generator(device=DEVICE).manual_seed(seed))
    module.streaming_init(B)
    return module


def jax_side(module, kernels="twin", layer_loop="scan"):
    config = module.config
    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    B = module.state.batch_size
    state = jax_impl.init_state(config, B, jnp.bfloat16 if module.dtype == torch.bfloat16 else jnp.float32)
    state = jax.device_put(state, jax.devices()[0])
    step = jax_impl.make_step(config, kernels=kernels, layer_loop=layer_loop, rope_freqs=module.rope_freqs(),
                              scan_unroll=SCAN_UNROLL)
    return params, state, step


def profile(fn):
    """`timing.kernel_profile(fn)` on the GPU; (None, None) on the CPU (--small), where there are no CUDA kernels."""
    return kernel_profile(fn) if DEVICE == "cuda" else (None, None)


def synchronize():
    """Wait for the GPU (the CPU's torch ops return done)."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def outs(o):
    return o if isinstance(o, tuple) else (o,)


def bits_run(kind, steps, out, B=4, start_near=24):
    t0 = time.perf_counter()
    module = build(kind, B)
    params, state, step = jax_side(module)
    print(f"bits_{kind}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    C = module.config.capacity
    start = max(0, C - start_near)
    module.state.offset.fill_(start)
    module.state.start_offset.fill_(0)
    state = state._replace(offset=jnp.full((B,), start, state.offset.dtype),
                           start_offset=jnp.zeros((B,), state.offset.dtype))
    T = 1 if kind == "temporal" else 2
    rng = np.random.default_rng(0)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    equal = {n: 0 for n in ("out", "text_logits", "k", "v", "offset", "start_offset")}
    first_diff = {}
    max_offset = 0
    recycles = {"reset_slot": 0, "sacrifice_tick": 0, "bump_slot_start": 0, "reset_rows": 0}
    for i in range(steps):
        u, b = rng.random(), int(rng.integers(B))
        if u < 0.05:
            module.reset_slot(b)
            state = jax_impl.jit_reset_slot(state, np.int32(b))
            recycles["reset_slot"] += 1
            if u < 0.025:
                module.bump_slot_start(b)
                state = jax_impl.jit_bump_slot_start(state, np.int32(b))
                recycles["sacrifice_tick"] += 1
        elif u < 0.08:
            module.bump_slot_start(b)
            state = jax_impl.jit_bump_slot_start(state, np.int32(b))
            recycles["bump_slot_start"] += 1
        elif u < 0.10:
            mask = rng.random(B) < 0.5
            module.reset_rows(torch.from_numpy(mask).to(DEVICE))
            state = jax_impl.jit_reset_rows(state, jnp.asarray(mask))
            recycles["reset_rows"] += 1
        x = torch.randn(B, T, module.config.dim, generator=gen, device=DEVICE).to(torch.bfloat16)
        active = torch.from_numpy(rng.random(B) < 0.8).to(DEVICE)
        t_out = outs(module.step(x, active))
        max_offset = max(max_offset, int(module.state.offset.max()))
        j_out, state = step(params, state, to_jax(x, copy=None), to_jax(active, copy=None))
        j_out = outs(j_out)
        if i in (0, 1) or i % 50 == 49:
            print(f"bits_{kind}: step {i + 1} at {time.perf_counter() - t0:.1f} s", flush=True)
        names = ["out", "text_logits"][: len(t_out)]
        pairs = dict(zip(names, zip(t_out, j_out)))
        pairs.update(k=(module.state.k, state.k), v=(module.state.v, state.v),
                     offset=(module.state.offset, state.offset), start_offset=(module.state.start_offset,
                                                                              state.start_offset))
        for name, (a, bj) in pairs.items():
            view = to_torch(bj)
            ok = torch.equal(a.to(view.dtype) if name in ("offset", "start_offset") else a, view)
            del view  # let the next step donate the buffer
            equal[name] += ok
            if not ok and name not in first_diff:
                first_diff[name] = i
    wrapped = max_offset > C
    record(f"bits_{kind}", {"steps": steps, "B": B, "max_offset": max_offset, "equal_steps": equal, "first_diff": first_diff,
                            "recycles": recycles, "ring_wrapped": wrapped, "start_offset_near_capacity": start},
           out)
    del module, params, state


def invariance(kind, out):
    res = {}
    T = 1 if kind == "temporal" else 2
    dim = PRESETS[kind + SIZE].dim
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    x16 = torch.randn(16, T, dim, generator=gen, device=DEVICE).to(torch.bfloat16)
    rows = {}
    for B in (1, 4, 16):
        module = build(kind, B)
        params, state, step = jax_side(module)
        x = x16[:B].contiguous()
        t_rows, j_rows = [], []
        for _ in range(3):
            t_out = outs(module.step(x))
            j_out, state = step(params, state, to_jax(x, copy=None), None)
            t_rows.append([o[0].clone() for o in t_out])
            j_rows.append([to_torch(o)[0].clone() for o in outs(j_out)])
        rows[B] = (t_rows, j_rows)
        del module, params, state
        torch.cuda.empty_cache()
    for B in (4, 16):
        res[f"torch_B1_vs_B{B}"] = all(torch.equal(a, b) for s1, sB in zip(rows[1][0], rows[B][0])
                                       for a, b in zip(s1, sB))
        res[f"jax_B1_vs_B{B}"] = all(torch.equal(a, b) for s1, sB in zip(rows[1][1], rows[B][1])
                                     for a, b in zip(s1, sB))
    res["jax_vs_torch_B1"] = all(torch.equal(a, b) for s1, sB in zip(rows[1][0], rows[1][1]) for a, b in zip(s1, sB))
    record(f"batch_invariance_{kind}", res, out)


def accuracy(out, steps=120, B=4):
    kind = "temporal"
    twin = build(kind, B)
    ref32 = build(kind, B, kernels="reference", dtype=torch.float32)
    ref16 = build(kind, B, kernels="reference")
    with torch.no_grad():
        for name, w in twin.weights().items():
            getattr(ref32, name).copy_(w.float())
            getattr(ref16, name).copy_(w)
    params, s_twin, step_twin = jax_side(twin)
    _, s_auto, step_auto = jax_side(twin, kernels="auto", layer_loop="python")
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    errs = {"twin": [], "jax_auto": [], "torch_reference": []}
    agree = {k: 0 for k in errs}
    for _ in range(steps):
        x = torch.randn(B, 1, twin.config.dim, generator=gen, device=DEVICE)
        o32, l32 = ref32.step(x)
        xb = x.to(torch.bfloat16)
        outs_ = {"torch_reference": ref16.step(xb)}
        outs_["twin"] = twin.step(xb)
        (jo, jl), s_auto = step_auto(params, s_auto, to_jax(xb, copy=None), None)
        outs_["jax_auto"] = (to_torch(jo).clone(), to_torch(jl).clone())
        _, s_twin = step_twin(params, s_twin, to_jax(xb, copy=None), None)
        for name, (o, lg) in outs_.items():
            errs[name].append(float((o.float() - o32).norm() / o32.norm()))
            agree[name] += int((lg.float().argmax(-1) == l32.argmax(-1)).sum())
    total = steps * B
    record("accuracy_vs_float32", {k: {"mean_normwise_err_out": statistics.mean(v), "argmax_agreement":
                                       agree[k] / total} for k, v in errs.items()} | {"steps": steps, "B": B}, out)
    del twin, ref32, ref16, params, s_twin, s_auto
    torch.cuda.empty_cache()


def jax_speed(module, x, rec, with_auto, with_loop, with_mosaic=False):
    """The JAX twin step's (and, with_auto, the default JAX step's; with_loop, the twin layers in
    a Python loop; with_mosaic, the twin step on the Mosaic GPU twins) times into rec."""
    B = x.shape[0]
    params, state, step = jax_side(module)
    state = state._replace(offset=jnp.full((B,), module.config.capacity, state.offset.dtype))
    xj = to_jax(x)
    t0 = time.perf_counter()
    jax.block_until_ready(step(params, state, xj, None)[0])
    rec["jax_twin_first_call_s"] = time.perf_counter() - t0
    state = jax_side(module)[1]._replace(offset=jnp.full((B,), module.config.capacity, jnp.int32))
    rec["jax_twin_sync_ms"], rec["jax_twin_pipelined_ms"], state = time_step(step, params, state, xj, None, 40)
    rec["jax_twin_kernels"], rec["jax_twin_top_kernels"] = profile(
        lambda: jax.block_until_ready(step(params, state, xj, None)[0]))
    if with_auto:
        _, s2, auto = jax_side(module, kernels="auto", layer_loop="python")
        s2 = s2._replace(offset=jnp.full((B,), module.config.capacity, jnp.int32))
        rec["jax_auto_sync_ms"], rec["jax_auto_pipelined_ms"], _ = time_step(auto, params, s2, xj, None, 40)
    if with_mosaic:
        mosaic_speed(module, params, xj, step, rec)
    if with_loop:  # the twin layers in a Python loop (static layer indexes): what the scan's loop costs
        del state
        _, s3, looped = jax_side(module, layer_loop="python")
        s3 = s3._replace(offset=jnp.full((B,), module.config.capacity, jnp.int32))
        t0 = time.perf_counter()
        _, s3 = jax.block_until_ready(looped(params, s3, xj, None))  # the state is donated: keep the new one
        rec["jax_twin_python_loop_first_call_s"] = time.perf_counter() - t0
        rec["jax_twin_python_loop_sync_ms"], rec["jax_twin_python_loop_pipelined_ms"], s3 = time_step(
            looped, params, s3, xj, None, 40)
        rec["jax_twin_python_loop_kernels"], _ = profile(
            lambda: jax.block_until_ready(looped(params, s3, xj, None)[0]))


def mosaic_speed(module, params, xj, step, rec):
    """The JAX twin step traced on the Mosaic GPU twins (`kernels_pallas.backend`): its times and
    kernels into rec, and whether one step from a full ring has the bits of `step`'s (the Triton-backend
    twins') from the same state."""
    B = xj.shape[0]

    def full_ring():
        return jax_side(module)[1]._replace(offset=jnp.full((B,), module.config.capacity, jnp.int32))

    with backend.use("mosaic_gpu"):
        mosaic = jax_side(module)[2]  # made, and so traced, on the Mosaic twins
    t0 = time.perf_counter()
    got, state = jax.block_until_ready(mosaic(params, full_ring(), xj, None))
    rec["jax_mosaic_first_call_s"] = time.perf_counter() - t0
    want = step(params, full_ring(), xj, None)[0]
    rec["jax_mosaic_identical"] = all(np.array_equal(bits(a), bits(b))  # bits: a NaN equals its own bits
                                      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
    rec["jax_mosaic_sync_ms"], rec["jax_mosaic_pipelined_ms"], state = time_step(mosaic, params, state, xj, None, 40)
    rec["jax_mosaic_kernels"], rec["jax_mosaic_top_kernels"] = profile(
        lambda: jax.block_until_ready(mosaic(params, state, xj, None)[0]))


def speed(kind, B, out, with_auto=False, with_jax=True, with_loop=False, with_mosaic=False):
    module = build(kind, B)
    module.state.offset.fill_(module.config.capacity)  # full ring
    T = 1 if kind == "temporal" else 2
    x = torch.randn(B, T, module.config.dim, device=DEVICE).to(torch.bfloat16)
    rec = {"stack": kind, "B": B, "T": T}
    if with_jax:
        jax_speed(module, x, rec, with_auto, with_loop, with_mosaic)

    def torch_step():
        module.step(x)
    def torch_step_sync():
        torch_step()
        synchronize()

    for _ in range(3):
        torch_step_sync()
    rec["torch_twin_eager_sync_ms"] = host_ms(torch_step_sync, 20)
    rec["torch_twin_kernels"], rec["torch_twin_top_kernels"] = profile(torch_step)
    if DEVICE == "cuda":  # CUDA graphs: none on the CPU (--small)
        try:
            replay = torch_graph(torch_step)

            def replay_sync():
                replay()
                torch.cuda.synchronize()

            rec["torch_twin_graph_sync_ms"] = host_ms(replay_sync, 30)
        except Exception as err:  # noqa: BLE001 (recorded: a capture failure is a result)
            rec["torch_twin_graph_error"] = f"{type(err).__name__}: {err}"[:500]
    record(f"speed_{kind}_B{B}", rec, out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="twin_step_gpu.json")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", default="bits,invariance,accuracy,speed",
                        help="parts to run; with speed, 'auto' adds the default JAX step, 'loop' the twin step as a "
                             "Python loop, 'mosaic' the twin step on the Mosaic GPU twins, 'torch-only' leaves JAX out")
    parser.add_argument("--small", action="store_true", help="small presets on the CPU (smoke run)")
    parser.add_argument("--stacks", default="mimi,temporal", help="which stacks (comma-separated)")
    parser.add_argument("--batches", default="4", help="batch sizes of the speed part (comma-separated)")
    parser.add_argument("--bits-batch", type=int, default=4, help="the batch size of the bit run")
    parser.add_argument("--scan-unroll", type=int, default=1, help="the scan's unroll factor (make_step's default: 1)")
    parser.add_argument("--mma-fused-norm-blocks", type=int, default=None,
                        help="contract.TWIN_MMA_FUSED_NORM_MAX_BLOCKS for this run (0: the MMA form never fuses its norm)")
    args = parser.parse_args()
    global DEVICE, SIZE, SCAN_UNROLL
    SCAN_UNROLL = args.scan_unroll
    if args.mma_fused_norm_blocks is not None:  # read by contract.twin_mma_fuse_norm at each call, both sides
        contract.TWIN_MMA_FUSED_NORM_MAX_BLOCKS = args.mma_fused_norm_blocks
    jax.config.update("jax_compilation_cache_dir", "/tmp/jax_cache")  # the same step twice compiles once
    if args.small:
        DEVICE, SIZE = "cpu", "-small"
    RESULTS["meta"] = run_meta(device=None if DEVICE == "cuda" else "cpu", dtype="bfloat16", scan_unroll=SCAN_UNROLL,
                                 mma_fused_norm_max_blocks=contract.TWIN_MMA_FUSED_NORM_MAX_BLOCKS)
    jobs = []
    only = args.only.split(",")
    stacks = args.stacks.split(",")
    if "bits" in only:
        jobs += [functools.partial(bits_run, kind, args.steps, args.out, B=args.bits_batch) for kind in stacks]
    if "invariance" in only:
        jobs += [functools.partial(invariance, kind, args.out) for kind in stacks]
    if "speed" in only:
        jobs += [functools.partial(speed, kind, int(B), args.out, with_auto="auto" in only,
                                   with_jax="torch-only" not in only, with_loop="loop" in only,
                                   with_mosaic="mosaic" in only) for kind in stacks
                 for B in args.batches.split(",")]
    if "accuracy" in only:
        jobs += [lambda: accuracy(args.out)]
    for job in jobs:
        try:
            job()
        except Exception as err:  # noqa: BLE001 (recorded, and the next part still runs)
            record(f"error_{len(RESULTS)}", {"error": f"{type(err).__name__}: {err}"[:1000],
                                             "traceback": traceback.format_exc()[-2500:]}, args.out)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
