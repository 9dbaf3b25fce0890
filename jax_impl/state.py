"""Streaming state of a stack as a pytree, and the pure functions that recycle it.

State of a stack with L layers, B rows (sessions), H heads, C = capacity slots, D head dim:

    k, v:          [L, B, H, C, D] in the stack's dtype: one ring per layer, stacked.
    offset:        [B] positions written so far by each row.
    start_offset:  [B] first position still visible to each row (slot recycling).

Same meaning as `torch_bridge.TorchStreamState`; the ring convention is in
`torch_bridge/tables.py` (and `jax_impl/tables.py`).

Integer width. Offsets are int32 unless jax's x64 mode is on, then int64 (`index_dtype()`).
In int32 a row overflows once a step would take offset + T past 2**31 - 1 = 2_147_483_647
positions: at 12.5 Hz frames (temporal, T=1) that is ~5.4 years of continuous streaming, for
Mimi at 25 Hz (T=2 per 12.5 Hz step) ~2.7 years. The pure `step` does not look at values (that
would need a device->host sync or recompiles); the `Streamer` wrapper keeps a host-side upper
bound of every row's offset and refuses a step that could overflow, before launching it (a
Python integer comparison, no sync, no recompilation) -- see `check_headroom`. `bump_slot_start`
takes a row's start_offset one further, past its offset too: the same bound applies (a bump that
would take start_offset past 2**31 - 1 wraps in the pure function, is refused by the `Streamer`
and the torch stacks, `snapshot.check_bump`; `check_headroom(state, 1)` covers it). RoPE angles are
computed in float32 from `offset` exactly as the torch path does, so positions past 2**24
(~15.5 days at 12.5 Hz) are no longer exact in the angle; that is shared with torch and Moshi.

Every function here is pure and jit-able; the row `b` or the `mask` may be traced, so
recycling never recompiles. A concrete `b` out of range raises; a traced one that is out of
range matches no row and is a no-op (jit cannot raise on values).

Session isolation. `reset_slot` and `reset_rows` zero the recycled rows' rings, and a step
drops the writes of positions below `start_offset` (`StepTables.write_mask`), so a slot a row
cannot see holds zeros or what the row's current session wrote, never an older session's
values: a NaN or Inf fed by a previous session cannot reach the new one through a masked slot
(a masked weight of 0 times NaN is NaN, in torch's SDPA as in any matmul). On finite data
none of this changes a bit of any output (a masked slot contributes an exact 0 either way).
Cost: one pass over the row's ring per `reset_slot` (over the whole ring per `reset_rows`, a
select); nothing per step.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_impl.config import MimiConfig, StackConfig, TemporalConfig, check_batch_size
from jax_impl.snapshot import check_ring_size, ring_shape, row_index


class StreamState(NamedTuple):
    """k, v [L, B, H, C, D]; offset, start_offset [B] (index_dtype())."""

    k: jax.Array
    v: jax.Array
    offset: jax.Array
    start_offset: jax.Array

    @property
    def batch_size(self) -> int:
        return self.offset.shape[0]


def index_dtype():
    """int64 when jax x64 mode is enabled, int32 otherwise."""
    return jax.dtypes.canonicalize_dtype(jnp.int64)


def index_max(dtype=None) -> int:
    """Largest offset representable in the index dtype."""
    return int(np.iinfo(np.dtype(dtype or index_dtype())).max)


def check_stack_config(op: str, config) -> StackConfig:
    """config itself after checking it is a stack's config (`TemporalConfig` or `MimiConfig`); TypeError
    naming `op` (a `FrameConfig` or `CodecConfig` holds stacks: pass its `temporal` / `transformer`)."""
    if not isinstance(config, (TemporalConfig, MimiConfig)):
        raise TypeError(f"{op}(config): config must be a TemporalConfig or a MimiConfig (a stack's config), got "
                        f"{type(config).__name__}")
    return config


def check_state_dtype(op: str, dtype):
    """dtype as a jnp.dtype after checking it: a float dtype, float64 only with jax_enable_x64 (without
    it JAX would make float32 arrays, a silent narrowing); TypeError naming `op`."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{op}(dtype): must be a floating dtype, got {dtype}")
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise TypeError(f"{op}(dtype): float64 needs jax_enable_x64 (without it JAX makes float32 arrays)")
    return dtype


def init_state(config: StackConfig, batch_size: int, dtype=jnp.float32, *, device=None) -> StreamState:
    """A fresh state: zero rings, offsets at 0.

    device: where it lives (default: JAX's default device, committed there as a step's state is), a
    `jax.Device`, a `jax.sharding.Sharding` or a StreamState of Shardings (e.g.
    `sharding.session_shardings(mesh)`, split by row). Each array
    is made in place there, never made on the default device and copied: at B=64 a ring is 50 GB,
    which the default device may not have room for next to its own.
    """
    check_stack_config("init_state", config)
    batch_size = check_batch_size("init_state", batch_size)
    dtype = check_state_dtype("init_state", dtype)
    check_ring_size("init_state", config, batch_size, dtype)
    ring = ring_shape(config, batch_size)
    idx = index_dtype()

    def make():
        return StreamState(k=jnp.zeros(ring, dtype), v=jnp.zeros(ring, dtype),
                           offset=jnp.zeros((batch_size,), idx), start_offset=jnp.zeros((batch_size,), idx))

    if device is None:
        return _committed(make())
    if isinstance(device, jax.Device):
        device = jax.sharding.SingleDeviceSharding(device)
    elif not isinstance(device, (jax.sharding.Sharding, StreamState)):
        raise TypeError(f"init_state(device): expected a jax.Device, a Sharding or a StreamState of Shardings, "
                        f"got {type(device).__name__}")
    shardings = device if isinstance(device, StreamState) else StreamState(*[device] * 4)
    for name, shape, sharding in zip(StreamState._fields, (ring, ring, (batch_size,), (batch_size,)), shardings,
                                     strict=True):
        try:
            sharding.shard_shape(shape)
        except ValueError as err:  # e.g. batch_size not divisible by the devices it is split over
            raise ValueError(f"init_state(device): state.{name} {list(shape)} (batch_size {batch_size}) does not "
                             f"split as its sharding says: {err}") from None
    return jax.jit(make, out_shardings=device)()


def _committed(state: StreamState) -> StreamState:
    """`state` committed to the device its arrays are on (JAX's default: `jax.default_device` or the
    first device), in place: no copy. A jitted step returns its state committed whenever an input
    is (DLPack-shared params are), and jit keys its cache on whether each argument is committed: an
    uncommitted fresh state would make the second call compile the step again. Traced: as it is."""
    if isinstance(state.k, jax.core.Tracer):
        return state
    return jax.device_put(state, jax.tree.map(lambda a: a.sharding, state))


def check_live(where: str, state) -> None:
    """Refuse (ValueError headed by `where`) a state of which a jitted call took an array by donation:
    it is deleted, and only the state that call returned may be used. Traced leaves pass."""
    for leaf in jax.tree.leaves(state):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
            raise ValueError(f"{where}: the state was donated to an earlier call (its arrays are deleted); "
                             f"use the state that call returned")


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def row_mask(op: str, state: StreamState, b):
    """The [B] bool mask of row b, after validating b (a concrete b: `row_index`'s rule, TypeError /
    IndexError naming `op`; a traced one a scalar integer)."""
    B = state.offset.shape[0]
    if _is_concrete(b):
        b = row_index(op, b, B)  # a Python int: a torch tensor b compares with no jax array
    else:
        if b.shape != () or not jnp.issubdtype(b.dtype, jnp.integer):
            raise TypeError(f"{op}(b): b must be a scalar integer, got {b.dtype}{list(b.shape)}")
    return jnp.arange(B) == b


def check_array(where: str, x) -> None:
    """TypeError naming `where` unless x is a JAX array (traced or not) or a numpy array: the JAX steps
    take no torch tensor (`torch_bridge.to_jax` shares one without a copy; the drop-ins take torch's)."""
    if not isinstance(x, (jax.Array, np.ndarray)):
        kind = f"{type(x).__module__}.{type(x).__name__}"
        hint = " (torch_bridge.to_jax shares a tensor with JAX)" if kind == "torch.Tensor" else ""
        raise TypeError(f"{where}: expected a JAX or numpy array, got {kind}{hint}")


def check_row_flags(op: str, name: str, flags, batch: int):
    """flags itself after checking it is a bool array [batch], a flag a row (an `active` mask, a
    `reset_rows` mask): TypeError for another dtype, ValueError for another shape, naming `op(name)`.
    Shapes and dtypes only: also for traced flags."""
    if not hasattr(flags, "dtype"):
        raise TypeError(f"{op}({name}): {name} must be a bool array, got {type(flags).__name__}")
    check_array(f"{op}({name})", flags)
    if jnp.dtype(flags.dtype) != jnp.bool_:
        raise TypeError(f"{op}({name}): {name} must be a bool array, got {flags.dtype}")
    if tuple(jnp.shape(flags)) != (batch,):
        raise ValueError(f"{op}({name}): {name} must have shape [{batch}], got {list(jnp.shape(flags))}")
    return flags


def check_mask(op: str, state: StreamState, mask):
    return jnp.asarray(check_row_flags(op, "mask", mask, state.offset.shape[0]))


def _clear_row(ring: jax.Array, b, ok) -> jax.Array:
    """ring [L, B, H, C, D] with row b zeroed where ok (a bool scalar), else unchanged.

    One in-place dynamic-update-slice of the row under donation (the `jit_*` ops): reads and
    writes L*H*C*D elements, no temporary (the select fuses into the update).
    """
    L, B, H, C, D = ring.shape
    z = jnp.zeros((), jnp.int32)
    start = (z, jnp.clip(jnp.asarray(b), 0, B - 1).astype(jnp.int32), z, z, z)
    row = lax.dynamic_slice(ring, start, (L, 1, H, C, D))
    return lax.dynamic_update_slice(ring, jnp.where(ok, jnp.zeros((), ring.dtype), row), start)


def reset_slot(state: StreamState, b) -> StreamState:
    """Row b forgets all it has written (start_offset[b] = offset[b]); positions keep counting.

    Its ring rows are zeroed (session isolation, see the module docstring); a traced b out of
    range matches no row: a no-op.
    """
    row = row_mask("reset_slot", state, b)
    ok = row.any()
    return state._replace(k=_clear_row(state.k, b, ok), v=_clear_row(state.v, b, ok),
                          start_offset=jnp.where(row, state.offset, state.start_offset))


def check_row(op: str, state: StreamState, b) -> int:
    """A concrete row index b of `state` as an int, validated (`row_index`: TypeError / IndexError naming `op`)."""
    return row_index(op, b, state.offset.shape[0])


def bump_slot_start(state: StreamState, b) -> StreamState:
    """Row b forgets its oldest visible position: start_offset[b] += 1, always.

    Nothing saturates it: called right after `reset_slot(b)` (start_offset == offset) it
    takes start_offset past offset, which hides the row's next write (the "sacrifice tick"
    that masks the one spurious frame following a recycle, as PersonaPlex's stepper does).
    A query that sees no slot gets a zero attention output, as torch's SDPA returns.

    Like the pure step, it does not look at values: a start_offset at the index dtype's maximum
    wraps. The caller checks the headroom, as for a step: `check_headroom(state, 1)` (one sync), or
    a host bound as the `Streamer` keeps (`snapshot.check_bump`), which refuses such a bump.
    """
    row = row_mask("bump_slot_start", state, b)
    return state._replace(start_offset=jnp.where(row, state.start_offset + 1, state.start_offset))


def reset_rows(state: StreamState, mask) -> StreamState:
    """Rows where mask [B] is True start a fresh stream (offset and start_offset to 0).

    Their ring rows are zeroed (session isolation, see the module docstring).
    """
    mask = check_mask("reset_rows", state, mask)
    rows = mask[None, :, None, None, None]  # a select over the rings: in place under donation, no temporary
    zero = jnp.zeros_like(state.offset)
    return state._replace(k=jnp.where(rows, jnp.zeros((), state.k.dtype), state.k),
                          v=jnp.where(rows, jnp.zeros((), state.v.dtype), state.v),
                          offset=jnp.where(mask, zero, state.offset),
                          start_offset=jnp.where(mask, zero, state.start_offset))


def reset_streaming(state: StreamState) -> StreamState:
    """Every row back to a fresh stream; rings zeroed."""
    return jax.tree_util.tree_map(jnp.zeros_like, state)


def check_headroom(state_or_bound, T: int, dtype=None) -> None:
    """Raise OverflowError if a step of T positions could take an offset past the index dtype, or
    T `bump_slot_start`s a start_offset (the pure functions leave this check to their caller).

    state_or_bound: a `StreamState` (its offsets and start_offsets are read on the host: one
    device sync, fine for an occasional check; dtype defaults to its offsets' dtype; a donated
    state is refused, `check_live`), or a host-side int upper bound of every row's offset (what
    the `Streamer` keeps: no sync). T: positions of the next step, or bumps (an int >= 0).
    dtype: the offsets' dtype (default `index_dtype()`).
    """
    if isinstance(state_or_bound, StreamState):
        check_live("check_headroom(state_or_bound)", state_or_bound)
        dtype = state_or_bound.offset.dtype if dtype is None else dtype
        offsets = np.concatenate([np.asarray(state_or_bound.offset), np.asarray(state_or_bound.start_offset)])
        offset_bound = int(offsets.max()) if offsets.size else 0
    elif isinstance(state_or_bound, (int, np.integer)) and not isinstance(state_or_bound, bool):
        offset_bound = int(state_or_bound)
    else:
        raise TypeError(f"check_headroom(state_or_bound): expected a jax_impl.StreamState or an int upper "
                        f"bound of the offsets, got {type(state_or_bound).__name__}")
    if not isinstance(T, (int, np.integer)) or isinstance(T, bool) or T < 0:
        raise ValueError(f"check_headroom(T): T must be an int >= 0 (positions of the next step), got {T!r}")
    limit = index_max(dtype)
    if offset_bound + T > limit:
        raise OverflowError(
            f"step: offsets could reach {offset_bound + T} > {limit}, the largest "
            f"{np.dtype(dtype or index_dtype()).name} position; reset_rows() the long-running rows "
            f"(or enable jax x64 for int64 offsets) before stepping further")


class OffsetBounds:
    """Host-side upper bounds of the offset arrays [B] the jitted steps returned (the LM frame's, the
    codec's, the speech frame's), so that a step refuses, before anything runs or is donated, one that
    would take an offset past its dtype's largest value (`index_max`: int32's 2**31 - 1 unless
    jax's x64 mode is on; a wrapped offset would go on silently at -2**31) without reading the device
    each step, as `step.Streamer`'s `offset_bound` does for a stack.

    A returned array's bound is its input's plus the positions the step advances it (whatever
    `active` says). Cost: a dict lookup an array a step; an array no step returned (a fresh state, a
    recycled one, one made by hand) is read on the host once, one device sync, and so is one whose
    bound says it could overflow (its rows left inactive stayed below the bound). Traced offsets
    (the step called inside the caller's own jit) are not checked. Entries go with their arrays
    (weak references): nothing is kept alive."""

    def __init__(self):
        self._known: dict[int, tuple[weakref.ref, int]] = {}

    def _forget(self, key: int, ref: weakref.ref) -> None:
        if self._known.get(key, (None,))[0] is ref:
            del self._known[key]

    def step(self, where: str, recycle: str, offsets_of: Callable[[Any], Mapping[str, jax.Array]],
             advance: Callable[[str], int], state, run: Callable[[Any], tuple[Any, Any]]) -> tuple[Any, Any]:
        """run(state) -> (out, new state), a jitted step, after checking that it cannot take an offset past
        its dtype: offsets_of(state) are the state's offset arrays by name (int [B]), each advanced
        advance(name) positions a step. OverflowError headed by `where`, naming the array, the row and
        `recycle` (what puts a row's positions back to 0), before anything runs; the new state's offsets
        are then noted with their bounds. Traced offsets (a step inside the caller's own jit) pass."""
        offsets = offsets_of(state)
        bounds = None if any(isinstance(a, jax.core.Tracer) for a in offsets.values()) else \
            {name: self._bound(where, recycle, name, a, advance(name)) for name, a in offsets.items()}
        out, state = run(state)
        if bounds is not None:
            for name, a in offsets_of(state).items():
                key = id(a)
                self._known[key] = (weakref.ref(a, functools.partial(self._forget, key)), bounds[name])
        return out, state

    def _bound(self, where: str, recycle: str, name: str, a: jax.Array, T: int) -> int:
        """The bound of offsets `a` after a step advancing it T positions (`step`'s refusal where it passes
        the dtype's largest value)."""
        entry, limit = self._known.get(id(a)), index_max(a.dtype)
        bound = entry[1] if entry is not None and entry[0]() is a else None
        if bound is None or bound + T > limit:
            host = np.asarray(a)
            bound = int(host.max())
            if bound + T > limit:
                raise OverflowError(
                    f"{where}: {name}[{int(host.argmax())}] is {bound}: {T} more position(s) would pass "
                    f"{limit}, the largest {np.dtype(a.dtype).name} offset; recycle the row first ({recycle}: "
                    f"its positions back to 0), or enable jax x64 for int64 offsets")
        return bound + T


OFFSET_BOUNDS = OffsetBounds()  # one table for every step: a speech frame's state holds a codec's and a frame's
