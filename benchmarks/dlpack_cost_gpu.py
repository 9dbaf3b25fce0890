"""What one DLPack crossing costs on the GPU, part by part (the drop-ins cross twice a step):

    python benchmarks/dlpack_cost_gpu.py --out $OUT/dlpack_cost_gpu.json

torch -> JAX: `torch_bridge.dlpack.to_jax`, `jnp.from_dlpack` as it stands and as `to_jax` called it
before the sixteenth session (the stream order set up by `to_jax`, then `jnp.from_dlpack`); JAX ->
torch: `torch.from_dlpack` (`to_torch`) of a ready array. Then the steps inside them: JAX asking its
device for the stream external writers are waited on, torch's current stream (public and raw),
`to_jax`'s stream order, torch's `__dlpack__` with and without a stream to synchronize, JAX's import
of the capsule, JAX's `__dlpack__` with torch's stream and without, torch's import of a capsule.
Medians of --n calls on an idle GPU, in us, a [4, 2, 512] bf16 tensor (Mimi's step input).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import torch
from cuda_timing import run_meta
from host_timing import host_ms
from jax._src.lib import _jax  # the capsule import jax.dlpack.from_dlpack calls (private: diagnosis only)

from torch_bridge.dlpack import _order_for_jax, jax_device_for, to_jax


class _Ordered:
    """The pre-sixteenth-session `to_jax` handoff: stream order set up, torch's handshake skipped."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, *, stream=None, **kwargs):
        return self.tensor.__dlpack__(stream=-1, **kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def median_us(fn, n):
    for _ in range(10):  # warm-up
        fn()
    return 1e3 * host_ms(fn, n)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--out", default="dlpack_cost_gpu.json")
    args = parser.parse_args()
    x = torch.randn(4, 2, 512, device="cuda").to(torch.bfloat16)
    dev = jax.devices()[0]
    a = jnp.asarray(x.cpu().float().numpy()).astype(jnp.bfloat16)
    jax.block_until_ready(a)
    torch.cuda.synchronize()
    ext = dev.get_stream_for_external_ready_events()
    torch_stream = torch.cuda.current_stream().cuda_stream
    parts = {
        "to_jax": lambda: to_jax(x),
        "to_jax_before_s16": lambda: (_order_for_jax(x, dev), jnp.from_dlpack(_Ordered(x))),
        "to_jax_device_lookup": lambda: jax_device_for(x),
        "to_jax_order": lambda: _order_for_jax(x, dev),
        "torch_current_stream": lambda: torch.cuda.current_stream(x.device).cuda_stream,
        "torch_current_raw_stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "torch_to_jax_from_dlpack": lambda: jnp.from_dlpack(x),
        "jax_get_stream_for_external_ready_events": dev.get_stream_for_external_ready_events,
        "torch_dlpack_with_stream": lambda: x.__dlpack__(stream=ext),
        "torch_dlpack_no_sync": lambda: x.__dlpack__(stream=-1),
        "jax_import_capsule_with_stream": lambda: _jax.dlpack_managed_tensor_to_buffer(
            x.__dlpack__(stream=-1), dev, ext, None, 2),
        "jax_import_capsule_no_stream": lambda: _jax.dlpack_managed_tensor_to_buffer(
            x.__dlpack__(stream=-1), dev, None, None, 2),
        "jax_to_torch_from_dlpack": lambda: torch.from_dlpack(a),
        "jax_dlpack_with_torch_stream": lambda: a.__dlpack__(stream=torch_stream),
        "jax_dlpack_no_stream": lambda: a.__dlpack__(stream=None),
        "jax_export_capsule_with_torch_stream": lambda: _jax.buffer_to_dlpack_managed_tensor(a, stream=torch_stream),
        "torch_import_capsule": lambda: torch.utils.dlpack.from_dlpack(a.__dlpack__(stream=torch_stream)),
    }
    rec = {"meta": run_meta(n=args.n)}
    for name, fn in parts.items():
        try:
            rec[name + "_us"] = median_us(fn, args.n)
        except Exception as err:  # noqa: BLE001 (a part that does not run is a result)
            rec[name + "_error"] = f"{type(err).__name__}: {err}"[:300]
        print(name, rec.get(name + "_us", rec.get(name + "_error")), flush=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
