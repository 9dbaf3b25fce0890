"""A JAX-backed drop-in's stream split by session over several devices.

    model = JaxTemporalStreaming(...); model.streaming_init(batch_size=8)
    shard_dropin(model, session_mesh())          # the JAX state now split by row over the mesh
    shard_dropin(model, session_mesh(), batch_size=128)  # or a fresh stream, made split (no streaming_init)
    out, logits = model.step(x, active)          # torch tensors in, torch tensors out, on the module's device
    model.reset_slot(5); snap = model.snapshot(); model.restore(snap)

The drop-in's `jax_impl.Streamer` is replaced by a `jax_impl.sharding.ShardedStreamer` going on
with the same stream: the step is `make_sharded_step` (each device steps its B/n rows, no
communication; every row bit-identical to the one-device drop-in with kernels="twin", which is
batch-invariant; with the others, to the one-device drop-in at batch B/n), the recycle ops the sharded
ones, and the outputs and snapshots are gathered on the module's JAX device (a torch tensor
lives on one device), which is one copy of the outputs per step (B*T*(dim + V) values).

What changes against the one-device drop-in: the weights are replicated copies on the mesh,
taken now (an in-place edit of a buffer is no longer seen by the step until `shard_dropin` is
called again); `model.state` (zero-copy torch views of the JAX state) is not available, since
no single buffer holds the state (use `snapshot()`); `streaming_init` starts an unsharded stream
again. A stream too large for one device starts split: `shard_dropin(model, mesh, batch_size=B)`
makes each device's rows on that device (`jax_impl.init_state(device=...)`), never the whole state
on the module's device first.
"""

from __future__ import annotations

from jax_impl.sharding import SESSIONS, ShardedStreamer, check_sessions, session_mesh

from .dlpack import jax_device_for
from .jax_steppers import JaxBacked


def shard_dropin(module: JaxBacked, mesh=None, axis: str = SESSIONS, *, batch_size: int | None = None) -> JaxBacked:
    """Split `module`'s stream (a streaming `JaxTemporalStreaming` / `JaxMimiTransformer`) by row
    over `axis` of `mesh` (default: `session_mesh()`, every JAX device); returns `module`.
    batch_size: instead, start a fresh stream of that many rows, made split by row (the module
    need not be streaming; a stream it had is dropped once the new one is accepted).

    Raises TypeError for another module, RuntimeError before `streaming_init` (without batch_size),
    ValueError when the batch size is not a positive int, does not split over the mesh or makes a ring
    larger than any device holds (nothing changed).
    """
    if not isinstance(module, JaxBacked):
        raise TypeError(f"shard_dropin(module): expected a JAX-backed drop-in (JaxTemporalStreaming, "
                        f"JaxMimiTransformer, from_torch(...)), got {type(module).__name__}")
    device = jax_device_for(next(iter(module.weights().values())))
    mesh = session_mesh(axis=axis) if mesh is None else mesh
    if batch_size is not None:
        module._check_batch_size(batch_size, "shard_dropin")
        check_sessions("shard_dropin(batch_size)", batch_size, mesh, axis)
        params = module.jax_params()
        module._streamer = None  # the old stream goes before the new one is made
        module._streamer = module._new_streamer(batch_size, ShardedStreamer, params, mesh=mesh, axis=axis,
                                                output_device=device)
        return module
    streamer = module._streamer
    if streamer is None:
        raise RuntimeError("shard_dropin(module): call module.streaming_init(batch_size) first, or pass batch_size")
    module._streamer = ShardedStreamer.from_streamer(streamer, mesh, axis, output_device=device)
    return module


__all__ = ["shard_dropin"]
