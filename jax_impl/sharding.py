"""Steps over several devices through JAX's own SPMD machinery (`Mesh`, `NamedSharding`, `shard_map`).

Two layouts, one mesh axis each:

Sessions (data parallel, for throughput). The batch of sessions is split over the mesh axis
"sessions": with n devices each holds B/n rows of the rings and offsets; the weights are
replicated on every device.

    mesh = session_mesh()                                  # all devices, axis "sessions"
    params, state = shard_sessions(params, state, mesh)    # weights P(), k/v P(None, "sessions"), offsets P("sessions")
    step = make_sharded_step(config, mesh)                 # jitted shard_map of step_fn, state donated
    (out, logits), state = step(params, state, x, active)  # x [B, T, dim], active [B]: split by row
    state = sharded_reset_slot(state, 2)                   # also bump_slot_start, reset_rows, reset_streaming

A step is `step_fn` run by every device on its own B/n rows (`shard_map`), so there is no
communication at all (the tests check the compiled program holds no collective) and every row
gets the bits it gets on one device: a row's arithmetic does not depend on the other rows.
Left to XLA's sharding propagation instead, the plain `make_step` also keeps the sharding,
but gathers the ring writes' indices and values across devices in every layer, and the plain
`reset_slot` (a dynamic slice on the sharded batch axis) gathers the whole ring: hence the
shard_map forms here. The recycle ops address a global row b; each device shifts it to its
own rows (b - i * B/n) and the others see a row out of their range, which is a no-op by
`state.reset_slot`'s contract. `ShardedStreamer` is `jax_impl.Streamer` on a sharded state
(step, recycle ops, snapshot / restore / files, `convert`); `torch_bridge.sharding.shard_dropin`
puts a drop-in's stream on it.

Tensor parallel (for one conversation's latency, temporal stack). Over the mesh axis "model"
each of n devices holds H/n heads (their in_proj rows for q, k and v, the matching out_proj
columns and its H/n heads of the ring) and hidden/n of the FFN (linear_in rows of both gate
halves, linear_out columns); norms, the text head and the offsets are replicated.

    mesh = session_mesh(axis="model")
    tp_params, tp_state = shard_tensor_parallel(config, params, state, mesh)
    step = make_tensor_parallel_step(config, mesh)
    (out, logits), tp_state = step(tp_params, tp_state, x, active)   # out, logits replicated

Per layer two all-reduces (`lax.psum`) and nothing else: after the attention out-projection
and after the FFN out-projection, each of [B, T, dim] partial sums in the activations' dtype
(B=4, dim 4096, bf16: 32 KB). The bits differ from the one-device step: each device sums
dim/n (resp. hidden/n) products of the out-projections, and the all-reduce adds the n partial
sums, another order of the same float additions; everything else (norms, q/k/v, RoPE, the
attention of each head) is computed from the same values as on one device, but XLA's dots of
another width (3H/n heads of in_proj rows) may block their sums otherwise too. Normwise max rel
per step (max|a - b| / max|b|) to the one-device step, two CPU devices, small preset, 40 steps,
3 seeds: float32 <= 3.8e-7 (rings; outputs <= 2.5e-7), bfloat16 <= 6e-3 (one bf16 ulp at the
largest entry). `TP_MAX_REL` states the bounds (the tests assert the float32 one); on a mesh of
one device the step is bit-identical to `make_step`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import state as st
from .checkpoint import check_fit
from .config import StackConfig, TemporalConfig, describe
from .model import run_layers
from .ops import acc_dtype, attend, linear, pick_kernels, rms_norm_f32
from .snapshot import check_snapshot_layout
from .state import StreamState
from .step import KEEP, Streamer, check_host_x, check_step_inputs, step_fn
from .stream_io import state_from_snapshot, state_snapshot
from .tables import StepTables, step_tables
from .weights import check_params

SESSIONS = "sessions"
MODEL = "model"
# The tensor-parallel step's bound to the one-device step: normwise max rel per step of every output
# and ring (measured, module docstring: float32 3.8e-7, bfloat16 6e-3; bf16 at the cross-check's level).
TP_MAX_REL = {"float32": 2e-6, "bfloat16": 5e-2}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


# ------------------------------------------------------------------------------ meshes
def session_mesh(devices: Sequence[jax.Device] | None = None, axis: str = SESSIONS) -> Mesh:
    """A one-axis mesh over `devices` (default: all of `jax.devices()`), the axis named `axis`.

    The same mesh serves the tensor-parallel step with axis="model".
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("session_mesh(devices): no devices given")
    if not all(isinstance(d, jax.Device) for d in devices):
        raise TypeError(f"session_mesh(devices): expected jax devices, got {[type(d).__name__ for d in devices]}")
    if len(set(devices)) != len(devices):
        raise ValueError(f"session_mesh(devices): a device is listed twice: {devices}")
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"session_mesh(axis): the axis name must be a non-empty str, got {axis!r}")
    return Mesh(np.array(devices), (axis,))


def axis_size(mesh: Mesh, axis: str, where: str) -> int:
    """Devices along `axis` of `mesh`; ValueError naming `where` if the mesh has no such axis."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{where}(mesh): expected a jax.sharding.Mesh (session_mesh()), got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"{where}(axis): the mesh has axes {list(mesh.axis_names)}, not {axis!r}")
    return int(mesh.shape[axis])


def check_divisible(where: str, name: str, size: int, n: int, axis: str, fix: str) -> None:
    """ValueError naming `where` and `name` unless `size` splits evenly over the n devices of `axis`."""
    if size % n:
        raise ValueError(f"{where}: {name} = {size} must be divisible by the {n} devices of mesh axis {axis!r} "
                         f"(each device holds {name}/{n}); {fix}")


def check_sessions(where: str, batch_size: int, mesh: Mesh, axis: str) -> int:
    n = axis_size(mesh, axis, where.split("(")[0])
    check_divisible(where, "batch_size B", batch_size, n, axis,
                    f"pad the batch to a multiple of {n} with idle rows (active=False)")
    return n


def collectives(compiled_text: str) -> dict[str, int]:
    """Collective op -> count in a compiled program's HLO text (`jitted.lower(...).compile().as_text()`)."""
    counts = {}
    for op in COLLECTIVES:
        n = len(re.findall(rf"\s{op}(?:-start)?\(", compiled_text))
        if n:
            counts[op] = n
    return counts


def _check_placed(where: str, tree, want, fix: str) -> None:
    """ValueError unless every array of `tree` is laid out as `want` (a sharding or a tree of them).

    A step does not reshard its big arguments silently (the weights, the ring: a copy of
    gigabytes per step, or a gather); they must come laid out already.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    try:
        wants = [want] * len(leaves) if isinstance(want, NamedSharding) else treedef.flatten_up_to(want)
    except (ValueError, TypeError):
        return  # another structure: the step's own checks name what is wrong
    for path_leaf, w in zip(jax.tree_util.tree_leaves_with_path(tree), wants, strict=True):
        path, leaf = path_leaf
        sharding = getattr(leaf, "sharding", None)
        if isinstance(leaf, jax.core.Tracer):
            continue
        if sharding is None or not sharding.is_equivalent_to(w, np.ndim(leaf)):
            name = where[where.find("(") + 1:where.rfind(")")] + jax.tree_util.keystr(path)
            raise ValueError(f"{where}: {name} is laid out as {sharding}, "
                             f"expected {w}; {fix}")


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
    check_sessions("shard_sessions(state)", state.batch_size, mesh, axis)
    return jax.device_put(params, NamedSharding(mesh, P())), jax.device_put(state, session_shardings(mesh, axis))


def session_layout(state: StreamState, where: str = "state") -> tuple[Mesh, str]:
    """(mesh, axis) of a session-sharded state (from `state.k.sharding`); ValueError if it is not one."""
    if not isinstance(state, StreamState):
        raise TypeError(f"{where}: expected a jax_impl.StreamState, got {type(state).__name__}")
    sharding = getattr(state.k, "sharding", None)
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    if len(spec) < 2 or spec[0] is not None or not isinstance(spec[1], str):
        raise ValueError(f"{where}: the state is not sharded by session (k is laid out as {sharding}); "
                         f"place it with jax_impl.sharding.shard_sessions(params, state, mesh)")
    mesh, axis = sharding.mesh, spec[1]
    _check_placed(where, state, session_shardings(mesh, axis),
                  "place it with jax_impl.sharding.shard_sessions(params, state, mesh)")
    return mesh, axis


class PlacedStep:
    """A jitted SPMD step: places the per-step inputs (x, active: a few KB) where the step wants
    them and refuses (ValueError) weights or a state laid out otherwise, then calls the jitted
    function. `lower(...)` lowers it on the same arguments (to read the compiled program)."""

    def __init__(self, jitted: Callable, mesh: Mesh, axis: str, param_sharding, state_sharding: StreamState,
                 row_sharding: NamedSharding, fix: str):
        self.jitted, self.mesh, self.axis = jitted, mesh, axis
        self._param_sharding, self._state_sharding, self._row, self._fix = (param_sharding, state_sharding,
                                                                            row_sharding, fix)

    def _args(self, params, state, x, active):
        if not isinstance(state, StreamState):
            raise TypeError(f"step(state): expected a jax_impl.StreamState, got {type(state).__name__}")
        _check_placed("step(params)", params, self._param_sharding, self._fix)
        _check_placed("step(state)", state, self._state_sharding, self._fix)
        B = state.batch_size
        if active is None:
            active = np.ones((B,), bool)
        if np.shape(x)[:1] != (B,) or np.shape(active) != (B,):  # let the step's own checks name them
            return params, state, x, active
        check_host_x(state, x)  # before device_put, which would narrow a numpy float64 x
        return params, state, jax.device_put(x, self._row), jax.device_put(active, self._row)

    def __call__(self, params, state, x, active=None):
        return self.jitted(*self._args(params, state, x, active))

    def lower(self, params, state, x, active=None):
        return self.jitted.lower(*self._args(params, state, x, active))


@functools.cache
def make_sharded_step(config: StackConfig, mesh: Mesh, axis: str = SESSIONS, *, donate: bool = True,
                      **step_kwargs) -> PlacedStep:
    """The sessions step: `step_fn(config, **step_kwargs)` run by each device of `axis` on its B/n
    rows (`shard_map`), jitted with the state donated (rings updated in place, per device).

    step(params, state, x, active=None) -> (outputs, state): params from `shard_sessions`
    (replicated), state session-sharded, x [B, T, dim] and active [B] anything (placed by row).
    outputs (temporal: (out [B, T, dim], text_logits [B, 1, T, V]); mimi: out) come split by row,
    the state keeps its layout. Each row's bits equal those of the one-device `make_step` with the
    same options. Inputs are checked at trace time as `make_step`'s (global shapes), and B must be
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
        return jax.shard_map(local, mesh=mesh, in_specs=(P(), specs, row, row), out_specs=(row, specs))(
            params, state, x, active)

    shardings, rows = session_shardings(mesh, axis), NamedSharding(mesh, row)
    jitted = jax.jit(step, out_shardings=(rows, shardings), donate_argnums=(1,) if donate else ())
    return PlacedStep(jitted, mesh, axis, NamedSharding(mesh, P()), shardings, rows,
                      "place params and state with jax_impl.sharding.shard_sessions(params, state, mesh)")


# ------------------------------------------------------------------------------ sessions recycle ops
@functools.cache
def _session_ops(mesh: Mesh, axis: str) -> dict[str, Callable]:
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
    return _session_ops(mesh, axis)["reset_slot"](state, _row_arg("reset_slot", state, b))


def sharded_bump_slot_start(state: StreamState, b) -> StreamState:
    """`bump_slot_start` of global row b on a session-sharded state; as `sharded_reset_slot`."""
    mesh, axis = session_layout(state, "bump_slot_start(state)")
    return _session_ops(mesh, axis)["bump_slot_start"](state, _row_arg("bump_slot_start", state, b))


def sharded_reset_rows(state: StreamState, mask) -> StreamState:
    """`reset_rows(mask)` on a session-sharded state; mask bool [B] (split by row), state donated."""
    mesh, axis = session_layout(state, "reset_rows(state)")
    st._check_mask("reset_rows", state, mask)
    return _session_ops(mesh, axis)["reset_rows"](state, jax.device_put(mask, NamedSharding(mesh, P(axis))))


def sharded_reset_streaming(state: StreamState) -> StreamState:
    """Every row of a session-sharded state back to a fresh stream; state donated."""
    mesh, axis = session_layout(state, "reset_streaming(state)")
    return _session_ops(mesh, axis)["reset_streaming"](state)


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

    def restore(self, snapshot) -> None:
        """As `Streamer.restore`, the restored state placed by row on this mesh; a snapshot whose
        batch size does not split over the mesh is refused (ValueError), nothing changed."""
        layout = check_snapshot_layout(self.config, snapshot, "restore(snapshot)")
        check_sessions("restore(snapshot)", layout.batch_size, self.mesh, self.axis)
        state = state_from_snapshot(self.config, snapshot, self.state.k.dtype,  # made split by row
                                    session_shardings(self.mesh, self.axis))
        self.state, self.offset_bound = state, int(np.max(np.asarray(state.offset)))

    def convert(self, params, *, device=None, rope_freqs=KEEP) -> None:
        """As `Streamer.convert` (dtype widening, new params / rope table); the stream stays on this
        mesh, placed by row, and `device` (if given) becomes the `output_device`."""
        dtype, options = self._convert_plan(params, rope_freqs)
        out_device = self.output_device if device is None else device
        k, v = self.state.k.astype(dtype), self.state.v.astype(dtype)  # elementwise: keeps the layout
        self.params, self._step_options = params, options
        self.state = self.state._replace(k=k, v=v)
        self._adopt(self.mesh, self.axis, out_device)


# ------------------------------------------------------------------------------ tensor parallel
def tensor_parallel_specs(axis: str = MODEL) -> tuple[dict, StreamState]:
    """(param specs, state specs) of the tensor-parallel layout (see `tensor_parallel_params`)."""
    split = P(None, None, axis)
    layers = {"in_proj": split, "out_proj": split, "linear_in": split, "linear_out": split,
              "norm1_alpha": P(), "norm2_alpha": P()}
    params = {"layers": layers, "out_norm_alpha": P(), "text_linear": P()}
    return params, StreamState(k=P(None, None, axis), v=P(None, None, axis), offset=P(), start_offset=P())


def tensor_parallel_shapes(config: TemporalConfig) -> dict[str, tuple[int, ...]]:
    """The tensor-parallel parameter layout: name -> global shape (in_proj and linear_in reshaped
    so that a device's rows are one block along the split axis: free reshapes of the same weights)."""
    c = config
    L, d = c.num_layers, c.dim
    return {"layers/in_proj": (L, 3, c.num_heads, c.head_dim, d), "layers/out_proj": (L, d, d),
            "layers/linear_in": (L, 2, c.hidden, d), "layers/linear_out": (L, d, c.hidden),
            "layers/norm1_alpha": (L, d), "layers/norm2_alpha": (L, d),
            "out_norm_alpha": (d,), "text_linear": (c.text_card, d)}


def _check_tensor_parallel(where: str, config, mesh: Mesh, axis: str) -> int:
    if not isinstance(config, TemporalConfig):
        raise TypeError(f"{where}(config): the tensor-parallel step is the temporal stack's; got "
                        f"{type(config).__name__} (split Mimi sessions with make_sharded_step)")
    n = axis_size(mesh, axis, where)
    fix = "use a mesh whose size divides both"
    check_divisible(f"{where}(config)", "num_heads", config.num_heads, n, axis, fix)
    check_divisible(f"{where}(config)", "hidden", config.hidden, n, axis, fix)
    return n


def tensor_parallel_params(config: TemporalConfig, params, mesh: Mesh, axis: str = MODEL) -> dict:
    """Flax variables -> the tensor-parallel parameters, placed on `mesh`:

        {"layers": {"in_proj": [L, 3, H, D, dim] split on H, "out_proj": [L, dim, dim] split on
        its columns (the heads' outputs), "linear_in": [L, 2, hidden, dim] split on hidden,
        "linear_out": [L, dim, hidden] split on hidden, "norm1_alpha" / "norm2_alpha": [L, dim]
        replicated}, "out_norm_alpha": [dim], "text_linear": [V, dim] replicated}

    Not Flax variables (no "params" key, other shapes): the plain step refuses them.
    """
    _check_tensor_parallel("tensor_parallel_params", config, mesh, axis)
    check_params(config, params, argname="tensor_parallel_params(params)")
    p, c = params["params"], config
    L, d = c.num_layers, c.dim
    w = p["layers"]
    tree = {"layers": {"in_proj": w["in_proj"].reshape(L, 3, c.num_heads, c.head_dim, d),
                       "out_proj": w["out_proj"], "linear_in": w["linear_in"].reshape(L, 2, c.hidden, d),
                       "linear_out": w["linear_out"], "norm1_alpha": w["norm1_alpha"],
                       "norm2_alpha": w["norm2_alpha"]},
            "out_norm_alpha": p["out_norm_alpha"], "text_linear": p["text_linear"]}
    specs, _ = tensor_parallel_specs(axis)
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def shard_tensor_parallel(config: TemporalConfig, params, state: StreamState, mesh: Mesh, axis: str = MODEL):
    """(tensor-parallel params, state placed: k, v [L, B, H, C, D] split on H, offsets replicated)."""
    if not isinstance(state, StreamState):
        raise TypeError(f"shard_tensor_parallel(state): expected a jax_impl.StreamState, "
                        f"got {type(state).__name__}")
    tp = tensor_parallel_params(config, params, mesh, axis)
    _, specs = tensor_parallel_specs(axis)
    return tp, jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


def _flax_view(config: TemporalConfig, tp: dict) -> dict:
    """The tensor-parallel params reshaped back to Flax variables (traced reshapes, for the checks)."""
    c, w = config, tp["layers"]
    L, d = c.num_layers, c.dim
    layers = {**w, "in_proj": w["in_proj"].reshape(L, 3 * d, d), "linear_in": w["linear_in"].reshape(L, -1, d)}
    return {"params": {"layers": layers, "out_norm_alpha": tp["out_norm_alpha"], "text_linear": tp["text_linear"]}}


def _check_tp_params(config: TemporalConfig, tp) -> None:
    where = "step(params)"
    if not isinstance(tp, dict) or not isinstance(tp.get("layers"), dict) or "params" in tp:
        raise TypeError(f"{where}: expected the tensor-parallel parameters of "
                        f"jax_impl.sharding.shard_tensor_parallel (not Flax variables), got {type(tp).__name__}")
    have = {f"layers/{k}": tuple(v.shape) for k, v in tp["layers"].items()}
    have.update({k: tuple(v.shape) for k, v in tp.items() if k != "layers"})
    check_fit(f"{where} do not fit the tensor-parallel layout of {describe(config)}",
              tensor_parallel_shapes(config), have)


def _tp_attention(c: TemporalConfig, h, w, ring_k, ring_v, layer, tables: StepTables, exact_rope: bool,
                  kernels: str, reduce: Callable):
    """This device's heads: qkv from its in_proj rows, RoPE, ring write / attention on its ring heads,
    the partial out-projection over its columns, all-reduced. h [B, T, dim] -> [B, T, dim]."""
    B, T, dim = h.shape
    _, Hl, D, _ = w["in_proj"].shape
    qkv = linear(h, w["in_proj"].reshape(3 * Hl * D, dim)).reshape(B, T, 3, Hl, D)
    out, ring_k, ring_v = attend(qkv, ring_k, ring_v, layer, tables, exact_rope, kernels, c.context)
    return reduce(out, w["out_proj"]), ring_k, ring_v


def _tp_layer(axis: str, reduce_dtype):
    """The temporal layer on one device's shard (`model.temporal_layer`, split as the module says)."""

    def reduce(a, w):  # the partial product a @ w.T over this device's columns, then the all-reduce
        acc = lax.dot_general(a, w, (((a.ndim - 1,), (1,)), ((), ())), preferred_element_type=acc_dtype(a.dtype))
        return lax.psum(acc.astype(reduce_dtype or a.dtype), axis).astype(a.dtype)

    def layer_fn(c, w, carry, layer, tables, active, exact_rope, kernels):
        del active  # the writes follow tables.write_mask
        x, ring_k, ring_v = carry
        h = rms_norm_f32(x, w["norm1_alpha"], c.norm_eps)
        a, ring_k, ring_v = _tp_attention(c, h, w, ring_k, ring_v, layer, tables, exact_rope, kernels, reduce)
        x = x + a
        h = rms_norm_f32(x, w["norm2_alpha"], c.norm_eps)
        B, T, dim = h.shape
        _, hl, _ = w["linear_in"].shape
        gate_in = linear(h, w["linear_in"].reshape(2 * hl, dim)).reshape(B, T, 2, hl)
        x = x + reduce(jax.nn.silu(gate_in[..., 0, :]) * gate_in[..., 1, :], w["linear_out"])
        return x, ring_k, ring_v

    return layer_fn


@functools.cache
def make_tensor_parallel_step(config: TemporalConfig, mesh: Mesh, axis: str = MODEL, *, layer_loop: str = "scan",
                              scan_unroll: int = 1, exact_rope: bool = True,
                              rope_freqs: tuple[float, ...] | None = None, kernels: str = "auto",
                              reduce_dtype=None, donate: bool = True) -> PlacedStep:
    """The tensor-parallel temporal step over `axis` of `mesh` (jitted shard_map, state donated).

    step(tp_params, tp_state, x, active=None) -> ((out [B, T, dim], text_logits [B, 1, T, V]),
    tp_state): tp_params, tp_state from `shard_tensor_parallel`; x, active replicated (placed
    for you); the outputs replicated. Two `lax.psum`s per layer (after the attention
    out-projection and after the FFN), of [B, T, dim] in `reduce_dtype` (None: the activations'
    dtype; jnp.float32 sums bf16 partial products in float32, twice the bytes, closer to the
    one-device bits). Options as `make_step`'s; kernels "twin" is not split (ValueError).
    num_heads and hidden must be divisible by the axis' size.
    """
    _check_tensor_parallel("make_tensor_parallel_step", config, mesh, axis)
    if kernels == "twin":
        raise ValueError("make_tensor_parallel_step(kernels): 'twin' is not split over devices; use 'auto', "
                         "'xla' or 'pallas'")
    p_specs, s_specs = tensor_parallel_specs(axis)
    layer_fn = _tp_layer(axis, None if reduce_dtype is None else jnp.dtype(reduce_dtype))
    c = config

    def local(tp, state, x, active):
        x = x.astype(state.k.dtype)
        T = x.shape[1]
        impl = pick_kernels(kernels, c, state.batch_size, T)
        tables = step_tables(c, state.offset, state.start_offset, active, T, rope_freqs)
        x, k, v = run_layers(layer_fn, c, tp["layers"], (x, state.k, state.v), tables, active,
                             layer_loop=layer_loop, scan_unroll=scan_unroll, exact_rope=exact_rope, kernels=impl)
        out = rms_norm_f32(x, tp["out_norm_alpha"], c.norm_eps)
        return (out, linear(out, tp["text_linear"])[:, None]), state._replace(k=k, v=v, offset=tables.end_offset)

    def step(tp, state, x, active):
        _check_tp_params(c, tp)
        if not isinstance(state, StreamState):
            raise TypeError(f"step(state): expected a jax_impl.StreamState, got {type(state).__name__}")
        check_step_inputs(c, _flax_view(c, tp), state, x, active)  # global shapes and dtypes, at trace time
        return jax.shard_map(local, mesh=mesh, in_specs=(p_specs, s_specs, P(), P()),
                             out_specs=(P(), s_specs))(tp, state, x, active)

    named = functools.partial(jax.tree.map, lambda s: NamedSharding(mesh, s))
    state_sh, rep = named(s_specs), NamedSharding(mesh, P())
    jitted = jax.jit(step, out_shardings=(rep, state_sh), donate_argnums=(1,) if donate else ())
    return PlacedStep(jitted, mesh, axis, named(p_specs), state_sh, rep,
                      "place params and state with jax_impl.sharding.shard_tensor_parallel(config, params, "
                      "state, mesh)")


__all__ = ["COLLECTIVES", "MODEL", "SESSIONS", "TP_MAX_REL", "PlacedStep", "ShardedStreamer", "axis_size",
           "collectives", "make_sharded_step", "make_tensor_parallel_step", "session_layout", "session_mesh",
           "session_shardings", "session_specs", "shard_sessions", "shard_tensor_parallel",
           "sharded_bump_slot_start", "sharded_reset_rows", "sharded_reset_slot", "sharded_reset_streaming",
           "tensor_parallel_params", "tensor_parallel_shapes", "tensor_parallel_specs"]
