"""Steps over several devices through JAX's own SPMD machinery (`Mesh`, `NamedSharding`, `shard_map`).

Two layouts, one mesh axis each, in two modules; this one is their public namespace:

- `sessions`: the batch of sessions split by row over the axis "sessions" (data parallel, for
  throughput): no communication at all, every row bit-identical to the one-device step with the
  twin kernels (batch-invariant); with the others, to the one-device step at batch B/n.
- `tensor_parallel`: one conversation's heads and FFN split over the axis "model" (for latency,
  temporal stack): two all-reduces a layer, within `TP_MAX_REL` of the one-device step.

What they share (meshes, the placement checks, `PlacedStep`, `collectives`) is in `placement`.

    from jax_impl import sharding as sh
    mesh = sh.session_mesh()                                  # every device, axis "sessions"
    params, state = sh.shard_sessions(params, state, mesh)
    step = sh.make_sharded_step(cfg, mesh)
    tp, tp_state = sh.shard_tensor_parallel(cfg, params, state, sh.session_mesh(axis="model"))
"""

from __future__ import annotations

from .placement import (
    COLLECTIVES,
    MODEL,
    SESSIONS,
    PlacedStep,
    axis_size,
    check_divisible,
    check_placed,
    collectives,
    session_mesh,
)
from .sessions import (
    ShardedStreamer,
    check_sessions,
    make_sharded_step,
    session_layout,
    session_shardings,
    session_specs,
    shard_sessions,
    sharded_bump_slot_start,
    sharded_reset_rows,
    sharded_reset_slot,
    sharded_reset_streaming,
)
from .tensor_parallel import (
    TP_KERNELS,
    TP_MAX_REL,
    make_tensor_parallel_step,
    shard_tensor_parallel,
    tensor_parallel_params,
    tensor_parallel_shapes,
    tensor_parallel_specs,
)

__all__ = ["COLLECTIVES", "MODEL", "SESSIONS", "TP_KERNELS", "TP_MAX_REL", "PlacedStep", "ShardedStreamer",
           "axis_size", "check_divisible", "check_placed", "check_sessions", "collectives", "make_sharded_step",
           "make_tensor_parallel_step", "session_layout", "session_mesh", "session_shardings", "session_specs",
           "shard_sessions", "shard_tensor_parallel", "sharded_bump_slot_start", "sharded_reset_rows",
           "sharded_reset_slot", "sharded_reset_streaming", "tensor_parallel_params", "tensor_parallel_shapes",
           "tensor_parallel_specs"]
