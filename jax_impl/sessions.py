"""Sessions split over devices (data parallel, for throughput).

The batch of sessions is split over the mesh axis "sessions": with n devices each holds B/n rows
of the rings and offsets; the weights are replicated on every device.

    mesh = session_mesh()                                  # all devices, axis "sessions"
    params, state = shard_sessions(params, state, mesh)    # weights P(), k/v P(None, "sessions"), offsets P("sessions")
    step = make_sharded_step(config, mesh)                 # jitted shard_map of step_fn, state donated
    (out, logits), state = step(params, state, x, active)  # x [B, T, dim], active [B]: split by row
    state = sharded_reset_slot(state, 2)                   # also bump_slot_start, reset_rows, reset_streaming

A step is `step_fn` run by every device on its own B/n rows (`shard_map`), so there is no
communication at all (the tests check the compiled program holds no collective), and each row
gets the bits the one-device step gives it at batch B/n. With kernels="twin" (batch-invariant:
a row's bits do not depend on the batch size) that is the one-device step's at batch B, bit for
bit; with the others XLA may pick another dot for the smaller batch (at one row a device a
matrix-vector dot, which sums in another order: about 2e-7 apart in float32).
Left to XLA's sharding propagation instead, the plain `make_step` also keeps the sharding,
but gathers the ring writes' indices and values across devices in every layer, and the plain
`reset_slot` (a dynamic slice on the sharded batch axis) gathers the whole ring: hence the
shard_map forms here. The recycle ops address a global row b; each device shifts it to its
own rows (b - i * B/n) and the others see a row out of their range, which is a no-op by
`state.reset_slot`'s contract. `ShardedStreamer` is `jax_impl.Streamer` on a sharded state
(step, recycle ops, snapshot / restore / files, `convert`); `torch_bridge.sharding.shard_dropin`
puts a drop-in's stream on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import backend

from . import state as st
from .config import StackConfig
from .placement import SESSIONS, PlacedStep, axis_size, check_divisible, check_placed, session_mesh
from .snapshot import check_restore_batch, check_snapshot_layout
from .state import StreamState
from .step import KEEP, Streamer, check_step_inputs, step_fn
from .stream_io import state_from_snapshot, state_snapshot


def check_sessions(where: str, batch_size: int, mesh: Mesh, axis: str) -> int:
    """The size n of `axis`; ValueError naming `where` unless batch_size splits over its n devices."""
    n = axis_size(mesh, axis, where.split("(")[0])
    check_divisible(where, "batch_size B", batch_size, n, axis,
                    f"pad the batch to a multiple of {n} with idle rows (active=False)")
    return n



# ------------------------------------------------------------------------------ sessions layout
def session_specs(axis: str = SESSIONS) -> StreamState:
    """The `PartitionSpec`s of a session-sharded state: k, v [L, B, H, C, D] split on B; offsets [B]."""
    return StreamState(k=P(None, axis), v=P(None, axis), offset=P(axis), start_offset=P(axis))


def session_shardings(mesh: Mesh, axis: str = SESSIONS) -> StreamState:
    """`session_specs` as `NamedSharding`s on `mesh`."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), session_specs(axis))


def shard_sessions(params, state: StreamState, mesh: Mesh, axis: str = SESSIONS):
    """(params, state) placed for the sessions layout: params replicated (`P()` on every device),
    rings and offsets split by row. B must be divisible by the axis' size (ValueError).

    `jax.device_put`: arrays laid out otherwise are copied (the ones passed in stay valid), arrays
    already laid out so are returned as they are (then a donated step consumes both names).
    """
    if not isinstance(state, StreamState):
        raise TypeError(f"shard_sessions(state): expected a jax_impl.StreamState, got {type(state).__name__}")
    st.check_live("shard_sessions(state)", state)
    check_sessions("shard_sessions(state)", state.batch_size, mesh, axis)
    return jax.device_put(params, NamedSharding(mesh, P())), jax.device_put(state, session_shardings(mesh, axis))


def session_layout(state: StreamState, where: str = "state") -> tuple[Mesh, str]:
    """(mesh, axis) of a session-sharded state (from `state.k.sharding`); ValueError if it is not one."""
    if not isinstance(state, StreamState):
        raise TypeError(f"{where}: expected a jax_impl.StreamState, got {type(state).__name__}")
    st.check_live(where, state)
    sharding = getattr(state.k, "sharding", None)
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    if len(spec) < 2 or spec[0] is not None or not isinstance(spec[1], str):
        raise ValueError(f"{where}: the state is not sharded by session (k is laid out as {sharding}); "
                         f"place it with jax_impl.sharding.shard_sessions(params, state, mesh)")
    mesh, axis = sharding.mesh, spec[1]
    check_placed(where, state, session_shardings(mesh, axis),
                  "place it with jax_impl.sharding.shard_sessions(params, state, mesh)")
    return mesh, axis



@backend.per_backend
def make_sharded_step(config: StackConfig, mesh: Mesh, axis: str = SESSIONS, *, donate: bool = True,
                      **step_kwargs) -> PlacedStep:
    """The sessions step: `step_fn(config, **step_kwargs)` run by each device of `axis` on its B/n
    rows (`shard_map`), jitted with the state donated (rings updated in place, per device).

    step(params, state, x, active=None) -> (outputs, state): params from `shard_sessions`
    (replicated), state session-sharded, x [B, T, dim] and active [B] anything (placed by row).
    outputs (temporal: (out [B, T, dim], text_logits [B, 1, T, V]); mimi: out) come split by row,
    the state keeps its layout. Each row's bits equal those of the one-device `make_step` with the
    same options at batch B/n (each device's); with kernels="twin" (batch-invariant), at batch B
    too. Inputs are checked at trace time as `make_step`'s (global shapes), and B must be
    divisible by the axis' size. step_kwargs: `step_fn`'s options (`capture` is not supported).
    Cached per arguments, as `make_step`.
    """
    axis_size(mesh, axis, "make_sharded_step")
    if step_kwargs.get("capture"):
        raise ValueError("make_sharded_step(capture): not supported on a sharded step; use step_fn(config, "
                         "capture=...) on one device")
    local = step_fn(config, **step_kwargs)
    specs, row = session_specs(axis), P(axis)

    def step(params, state, x, active):
        check_step_inputs(config, params, state, x, active)  # global shapes, at trace time
        check_sessions("step(state)", state.batch_size, mesh, axis)
        # check_vma off: the Pallas calls declare their outputs without a varying-axes type, which
        # the check refuses; the body has no collective, so there is nothing for it to check
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, row, row), out_specs=(row, specs),
                             check_vma=False)(params, state, x, active)

    shardings, rows = session_shardings(mesh, axis), NamedSharding(mesh, row)
    jitted = jax.jit(backend.traced_on(step), out_shardings=(rows, shardings), donate_argnums=(1,) if donate else ())
    return PlacedStep(jitted, mesh, axis, NamedSharding(mesh, P()), shardings, rows,
                      "place params and state with jax_impl.sharding.shard_sessions(params, state, mesh)")


# ------------------------------------------------------------------------------ sessions recycle ops
@functools.cache
def session_ops(mesh: Mesh, axis: str) -> dict[str, Callable]:
    """The recycle ops on a session-sharded state, each a jitted shard_map (state donated): every
    device applies `state.*` to its own rows; a global row b becomes b - i * B/n on device i."""
    specs = session_specs(axis)

    def local_row(state, b):
        return b - lax.axis_index(axis).astype(jnp.int32) * jnp.int32(state.batch_size)

    def sharded(fn, extra):
        body = jax.shard_map(fn, mesh=mesh, in_specs=(specs, *extra), out_specs=specs)
        return jax.jit(body, donate_argnums=(0,))

    return {
        "reset_slot": sharded(lambda s, b: st.reset_slot(s, local_row(s, b)), (P(),)),
        "bump_slot_start": sharded(lambda s, b: st.bump_slot_start(s, local_row(s, b)), (P(),)),
        "reset_rows": sharded(st.reset_rows, (P(axis),)),
        "reset_streaming": sharded(st.reset_streaming, ()),
    }


def _row_arg(op: str, state: StreamState, b):
    b = st.check_row(op, state, b)  # an in-range integer, checked on the host: refused before donating
    return np.int32(b)


def sharded_reset_slot(state: StreamState, b) -> StreamState:
    """`reset_slot` of global row b on a session-sharded state (jitted once, b traced, state donated:
    keep only the result). b: a host integer (checked before the call: out of range / not an integer:
    IndexError / TypeError, state untouched); inside your own jit, shard_map `state.reset_slot` yourself."""
    mesh, axis = session_layout(state, "reset_slot(state)")
    return session_ops(mesh, axis)["reset_slot"](state, _row_arg("reset_slot", state, b))


def sharded_bump_slot_start(state: StreamState, b) -> StreamState:
    """`bump_slot_start` of global row b on a session-sharded state; as `sharded_reset_slot`."""
    mesh, axis = session_layout(state, "bump_slot_start(state)")
    return session_ops(mesh, axis)["bump_slot_start"](state, _row_arg("bump_slot_start", state, b))


def sharded_reset_rows(state: StreamState, mask) -> StreamState:
    """`reset_rows(mask)` on a session-sharded state; mask bool [B] (split by row), state donated."""
    mesh, axis = session_layout(state, "reset_rows(state)")
    st.check_mask("reset_rows", state, mask)
    return session_ops(mesh, axis)["reset_rows"](state, jax.device_put(mask, NamedSharding(mesh, P(axis))))


def sharded_reset_streaming(state: StreamState) -> StreamState:
    """Every row of a session-sharded state back to a fresh stream; state donated."""
    mesh, axis = session_layout(state, "reset_streaming(state)")
    return session_ops(mesh, axis)["reset_streaming"](state)


class ShardedStreamer(Streamer):
    """`jax_impl.Streamer` on a session-sharded state: the same methods and overflow guard, the
    step `make_sharded_step`, the recycle ops the `sharded_*` ones.

    mesh / axis: the sessions mesh (default: `session_mesh()`); B must be divisible by its size.
    output_device: None (outputs and snapshots stay split by row, jax arrays over the mesh) or a
    device: outputs and snapshot arrays are gathered there (one array on one device: what a torch
    view through DLPack needs; `torch_bridge.sharding.shard_dropin` passes the module's device).
    The params are replicated copies on the mesh (`shard_sessions`).
    """

    _ops = MappingProxyType({"reset_slot": sharded_reset_slot, "bump_slot_start": sharded_bump_slot_start,
                             "reset_rows": sharded_reset_rows, "reset_streaming": sharded_reset_streaming})

    def __init__(self, config: StackConfig, params, batch_size: int, dtype=jnp.float32, *, mesh: Mesh | None = None,
                 axis: str = SESSIONS, output_device=None, layer_loop: str = "scan", exact_rope: bool = True,
                 rope_freqs: tuple[float, ...] | None = None, kernels: str = "auto"):
        mesh = session_mesh(axis=axis) if mesh is None else mesh
        check_sessions("ShardedStreamer(batch_size)", batch_size, mesh, axis)
        super().__init__(config, params, batch_size, dtype, layer_loop=layer_loop, exact_rope=exact_rope,
                         rope_freqs=rope_freqs, device=session_shardings(mesh, axis),  # made split by row
                         kernels=kernels)
        self._adopt(mesh, axis, output_device)

    @classmethod
    def from_streamer(cls, streamer: Streamer, mesh: Mesh | None = None, axis: str = SESSIONS,
                      output_device=None) -> ShardedStreamer:
        """A `ShardedStreamer` going on with `streamer`'s stream (its state placed by row, its
        options and overflow bound kept). `streamer` is left as it was; use only the result."""
        if not isinstance(streamer, Streamer):
            raise TypeError(f"from_streamer(streamer): expected a jax_impl.Streamer, got {type(streamer).__name__}")
        mesh = session_mesh(axis=axis) if mesh is None else mesh
        check_sessions("from_streamer(streamer)", streamer.batch_size, mesh, axis)
        new = cls.__new__(cls)
        new.__dict__.update(streamer.__dict__)
        new._adopt(mesh, axis, output_device)
        return new

    def _adopt(self, mesh: Mesh, axis: str, output_device) -> None:
        self.params, self.state = shard_sessions(self.params, self.state, mesh, axis)
        self.mesh, self.axis, self.output_device = mesh, axis, output_device
        self._step = make_sharded_step(self.config, mesh, axis, **self._step_options)

    def _out(self, tree):
        return tree if self.output_device is None else jax.device_put(tree, self.output_device)

    def step(self, x, active=None):
        return self._out(super().step(x, active))

    def snapshot(self) -> dict:
        """As `Streamer.snapshot` (copies); split by row, or gathered on `output_device` if set."""
        snap = state_snapshot(self.config, self.state)
        return {k: v if k == "metadata" else self._out(v) for k, v in snap.items()}

    def _restore(self, snapshot, resize: bool, where: str) -> None:
        """`Streamer.restore` and `load_stream` (another batch size only with `resize=True`), the restored
        state placed by row on this mesh; a snapshot whose batch size does not split over the mesh is
        refused (ValueError), nothing changed."""
        layout = check_snapshot_layout(self.config, snapshot, where)
        check_sessions(where, layout.batch_size, self.mesh, self.axis)
        check_restore_batch(layout.batch_size, self.batch_size, resize, where)
        state = state_from_snapshot(self.config, snapshot, self.state.k.dtype,  # made split by row
                                    session_shardings(self.mesh, self.axis), where)
        self._take_restored(state)

    def convert(self, params, *, device=None, rope_freqs=KEEP) -> None:
        """As `Streamer.convert` (dtype widening, new params / rope table); the stream stays on this
        mesh, placed by row, and `device` (if given) becomes the `output_device`."""
        dtype, options = self._convert_plan(params, rope_freqs)
        out_device = self.output_device if device is None else device
        k, v = self.state.k.astype(dtype), self.state.v.astype(dtype)  # elementwise: keeps the layout
        self.params, self._step_options = params, options
        self.state = self.state._replace(k=k, v=v)
        self._adopt(self.mesh, self.axis, out_device)



__all__ = ["ShardedStreamer", "check_sessions", "make_sharded_step", "session_layout", "session_ops", "session_shardings",
           "session_specs", "shard_sessions", "sharded_bump_slot_start", "sharded_reset_rows", "sharded_reset_slot",
           "sharded_reset_streaming"]
