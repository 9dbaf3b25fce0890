"""A compile-only CUDA device for an H200, so a machine without a GPU compiles what the GPU would run.

With jax's CUDA plugin installed (`pip install "jax[cuda13]"`: the plugin and its PJRT wheel) and
CUDA's `ptxas` on the PATH, jax compiles for a device it is told about instead of one it finds: XLA's
GPU passes, Mosaic GPU's passes to PTX and ptxas for sm_90a all run, as `jax.jit(f).lower().compile()`
runs them on the GPU. Nothing is launched. Where the plugin cannot load its GPU libraries (no cuDNN on a
CPU machine), `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`, set before jax first looks for devices, lets it load.

The device is described by XLA's `GpuTargetConfigProto` (text format), from NVIDIA's H200 figures: 132
SMs, compute capability 9.0, 228 KiB of shared memory a multiprocessor (227 KiB a block, opted in), 50
MiB of L2, 141 GB of HBM3e at 4.8 TB/s.
"""

from __future__ import annotations

import functools

H200 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 4800000000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 141000000000
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 patch: 0 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H200"
"""


@functools.cache
def h200() -> tuple[object, str]:
    """(a compile-only H200's sharding, "") where jax can compile for it, else (None, why not)."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    try:
        topology = topologies.get_topology_desc(platform="cuda", topology_name="1x1x1", topology="1x1x1",
                                                target_config=H200)
    except Exception as e:  # noqa: BLE001 - any failure to make the device is the reason to skip
        return None, (f"no compile-only CUDA device ({type(e).__name__}: {str(e)[:160]}): needs jax's CUDA plugin "
                      f"(jax[cuda13]), with JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 on a machine without cuDNN; this is "
                      f"jax {jax.__version__}")
    return SingleDeviceSharding(topology.devices[0]), ""


def compile_for_h200(f, *specs):
    """jax.jit(f) compiled for the compile-only H200 on arguments of these (shape, dtype) or
    ShapeDtypeStruct pytrees; returns the compiled executable's HLO text."""
    import jax

    sharding, why = h200()
    if sharding is None:
        raise RuntimeError(why)

    def place(a):
        shape, dtype = (a.shape, a.dtype) if hasattr(a, "shape") else a
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def spec(a):  # an array's spec, or a (shape, dtype) pair (not a pytree node that is a pair)
        return hasattr(a, "shape") or (type(a) is tuple and len(a) == 2 and type(a[0]) is tuple
                                       and all(isinstance(d, int) for d in a[0]))

    args = [jax.tree.map(place, s, is_leaf=spec) for s in specs]
    return jax.jit(f).trace(*args).lower().compile().as_text()
