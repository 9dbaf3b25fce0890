"""What the torch-facing drop-in adds to the bare JAX step, on the host.

    python -m benchmarks.dropin_overhead                 # small presets, the CPU (host cost alone)
    python -m benchmarks.dropin_overhead --real          # real sizes (on a GPU)

For each stack, B=4: the drop-in (`from_torch`) stepped with active=None and with a mask, and the
bare jitted JAX step on the same weights, interleaved call by call (the same machine state for
all three); medians of synchronized steps, in us: the drop-in waited for on torch's current stream
(where its outputs are ordered: `overhead_*`) and, with active=None, by `torch.cuda.synchronize`
(`*_device_sync`: it also waits for JAX's own streams, where PjRt queues a host callback behind
each step); that stream polled (`*_spin`, as `until_ready` polls); the same under a side stream
(`dropin_side_*`: torch's default stream is CUDA's legacy NULL stream); the bare step by
`jax_impl.until_ready`, polling and not (`bare_jax_no_spin_us`). Then the drop-in's parts on their own, also
interleaved: its input checks, the DLPack import of x and its parts, its Streamer's step
(synchronized), the DLPack export of the outputs (already computed, then the stream's wait).
Never part of the tests.
"""

from __future__ import annotations

import argparse

import jax
import torch

import jax_impl
from benchmarks.timing import interleaved_medians_us
from jax_impl.config import PRESETS
from jax_impl.wait import until_ready
from torch_bridge import MimiTransformer, TemporalStreaming
from torch_bridge.dlpack import _import, _order_for_jax, jax_device_for, to_jax, to_torch
from torch_bridge.jax_steppers import from_torch


def measure(kind: str, real: bool, steps: int, B: int = 4, kernels: str = "auto", layer_loop: str = "python") -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cls, T = (TemporalStreaming, 1) if kind == "temporal" else (MimiTransformer, 2)
    config = PRESETS[kind if real else f"{kind}-small"]
    dtype = torch.bfloat16 if real else torch.float32
    module = cls.from_config(config, dtype=dtype, device=device)
    module.init_weights(generator=torch.Generator(device=device).manual_seed(0))
    dropin = from_torch(module, layer_loop=layer_loop, kernels=kernels)
    dropin.streaming_init(B)
    x = torch.randn(B, T, config.dim, device=device).to(dtype)
    active = torch.ones(B, dtype=torch.bool, device=device)
    params = jax_impl.weights.nest_params(config, {k: to_jax(w) for k, w in module.weights().items()})
    step = jax_impl.make_step(config, layer_loop=layer_loop, rope_freqs=module.rope_freqs(), kernels=kernels)
    holder = {"state": jax.device_put(jax_impl.init_state(config, B, params["params"]["layers"]["in_proj"].dtype),
                                      params["params"]["layers"]["in_proj"].devices().pop())}
    xj = to_jax(x)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def stream_sync():  # the drop-in's outputs are ordered on torch's current stream
        if device == "cuda":
            torch.cuda.current_stream().synchronize()

    def spin():  # torch's current stream polled (as until_ready polls its own)
        if device == "cuda":
            stream = torch.cuda.current_stream()
            while not stream.query():
                pass

    side = torch.cuda.Stream() if device == "cuda" else None

    def on_side(wait):  # the drop-in under a side stream (torch's default stream is the legacy NULL stream)
        if side is None:
            return dropin.step(x)
        with torch.cuda.stream(side):
            dropin.step(x)
            wait()

    def bare(spin=True):
        out, holder["state"] = step(params, holder["state"], xj, None)
        until_ready((out, holder["state"]), spin=spin)

    calls = {"dropin_active_none_us": lambda: (dropin.step(x), sync()),
             "dropin_active_none_stream_sync_us": lambda: (dropin.step(x), stream_sync()),
             "dropin_active_none_stream_spin_us": lambda: (dropin.step(x), spin()),
             "dropin_side_stream_sync_us": lambda: on_side(stream_sync),
             "dropin_side_stream_spin_us": lambda: on_side(spin),
             "dropin_active_mask_us": lambda: (dropin.step(x, active), stream_sync()),
             "bare_jax_us": bare,
             "bare_jax_no_spin_us": lambda: bare(spin=False)}
    rec = interleaved_medians_us(calls, steps, warmup=20)
    rec["overhead_active_none"] = rec["dropin_active_none_stream_sync_us"] / rec["bare_jax_us"] - 1
    rec["overhead_active_none_device_sync"] = rec["dropin_active_none_us"] / rec["bare_jax_us"] - 1
    ready = until_ready(dropin._streamer.step(xj))

    def streamer_step():
        until_ready(dropin._streamer.step(xj))

    jax_device = jax_device_for(x)
    parts = {"part_check_inputs_us": lambda: dropin._check_step_inputs(x, None),
             "part_to_jax_x_us": lambda: to_jax(x, copy=None),
             # to_jax's own parts: the device lookup, the stream order, the import (order included), the address check
             "part_to_jax_device_us": lambda: jax_device_for(x),
             "part_to_jax_order_us": lambda: _order_for_jax(x, jax_device) if x.is_cuda else None,
             "part_to_jax_import_us": lambda: _import(x, jax_device),
             "part_unsafe_buffer_pointer_us": lambda: xj.unsafe_buffer_pointer(),
             "part_streamer_step_us": streamer_step,
             "part_to_torch_outputs_us": lambda: (jax.tree_util.tree_map(to_torch, ready), stream_sync())}
    return rec | interleaved_medians_us(parts, steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--real", action="store_true", help="the real sizes (bf16), not the small presets")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--kernels", default="auto", help="the JAX step's kernels (both sides of the comparison)")
    parser.add_argument("--layer-loop", default="python", help="the JAX step's layer loop: python or scan")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for kind in ("mimi", "temporal"):
        rec = measure(kind, args.real, args.steps, kernels=args.kernels, layer_loop=args.layer_loop)
        print(kind, {k: round(v, 3) if k.startswith("overhead") else round(v) for k, v in rec.items()}, flush=True)


if __name__ == "__main__":
    main()
