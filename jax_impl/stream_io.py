"""Stream snapshots on the JAX side: a `StreamState` to a snapshot dict and back, and to a file.

The format (keys, metadata, validation, dtype rule) is `jax_impl.snapshot`'s, shared with the
torch stacks: a snapshot taken on either side restores on the other.

    snap = state_snapshot(config, state)              # copies: a later donated step cannot delete them
    state = state_from_snapshot(config, snap)         # validated, fresh copies
    write_stream(config, state, "s.safetensors"); snap = read_stream("s.safetensors")
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from .config import StackConfig
from .snapshot import (
    ARRAY_KEYS,
    check_ring_cast,
    check_snapshot_layout,
    check_snapshot_values,
    read_stream_file,
    snapshot_metadata,
    write_stream_file,
)
from .state import StreamState, check_live, index_dtype, index_max


def _check_state(where: str, state) -> StreamState:
    """state after checking it is a `StreamState` (TypeError) whose arrays no call took by donation
    (`check_live`: ValueError), both naming `where`."""
    if not isinstance(state, StreamState):
        raise TypeError(f"{where}: expected a jax_impl.StreamState, got {type(state).__name__}")
    check_live(where, state)
    return state


def state_snapshot(config: StackConfig, state: StreamState) -> dict:
    """A snapshot of `state`: {"k", "v": [L, B, H, C, D] (the state's dtype), "offset",
    "start_offset": [B] (index dtype), "metadata": dict[str, str]}, the arrays as fresh jax copies.

    Copies because the jitted step donates the state: the arrays it was given are deleted.
    """
    state = _check_state("state_snapshot(state)", state)
    arrays = {key: jnp.array(getattr(state, key), copy=True) for key in ARRAY_KEYS}
    return {**arrays, "metadata": snapshot_metadata(config, jnp.dtype(state.k.dtype).name, state.batch_size)}


def _detached(x):
    """x, or its values where it is a torch tensor recording autograd (a snapshot taken after a
    differentiable torch step): neither numpy nor DLPack reads such a tensor; torch's own restore
    takes it, so this side does too. Duck-typed: no torch import."""
    if isinstance(x, (jax.Array, np.ndarray)) or not callable(getattr(x, "detach", None)):
        return x
    return x.detach()


def _host_ints(where: str, key: str, x) -> np.ndarray:
    try:
        return np.asarray(_detached(x))
    except (TypeError, ValueError, RuntimeError) as err:
        raise TypeError(f"{where}: snapshot[{key!r}] ({type(x).__name__}) cannot be read on the host: {err}; "
                        f"pass a jax or numpy array") from None


def _ring_array(where: str, key: str, x) -> jax.Array | np.ndarray:
    if isinstance(x, (jax.Array, np.ndarray)):
        return x
    try:
        return jnp.from_dlpack(_detached(x))  # e.g. a torch tensor, read in place (copied below)
    except (TypeError, ValueError, RuntimeError, BufferError, AttributeError) as err:
        raise TypeError(f"{where}: snapshot[{key!r}] ({type(x).__name__}) cannot be read as a jax array: "
                        f"{err}; pass a jax or numpy array") from None


def state_from_snapshot(config: StackConfig, snapshot, dtype=None, device=None,
                        where: str = "restore(snapshot)") -> StreamState:
    """A `StreamState` of fresh arrays from a snapshot (jax / numpy arrays, or torch CPU tensors,
    also ones recording autograd: their values).

    dtype: the rings' dtype wanted (None: the snapshot's); the snapshot's k, v are cast to it
    only when that is exact (bf16/f16 -> f32, ...), else TypeError. Offsets are read on the host
    (B integers), checked (0 <= start_offset <= offset <= the index dtype's maximum: int32
    unless jax x64 is on) and converted to `index_dtype()`, exactly. device: where the arrays
    go (None: JAX's default), as `init_state`'s: a Device, a Sharding or a StreamState of them;
    each array is copied straight there (from the host, or from the device it is on), never
    through the default device. Raises (naming the key) before building anything.
    """
    layout = check_snapshot_layout(config, snapshot, where)
    dtype = jnp.dtype(layout.dtype if dtype is None else dtype)
    check_ring_cast(layout.dtype, dtype.name, where)
    if dtype.itemsize == 8 and not jax.config.jax_enable_x64:
        raise TypeError(f"{where}: rings of {dtype.name} (snapshot['k']) need jax_enable_x64: without it JAX "
                        f"would make them float32, a rounding")
    offsets = {key: _host_ints(where, key, snapshot[key]) for key in ("offset", "start_offset")}
    check_snapshot_values([int(o) for o in offsets["offset"]], [int(o) for o in offsets["start_offset"]],
                          index_max(), where)
    ring = {key: _ring_array(where, key, snapshot[key]) for key in ("k", "v")}

    def place(key):
        return getattr(device, key) if isinstance(device, StreamState) else device

    return StreamState(**{key: _fresh(a, dtype, place(key)) for key, a in ring.items()},
                       **{key: jax.device_put(a.astype(index_dtype()), place(key)) for key, a in offsets.items()})


def _fresh(a, dtype, device) -> jax.Array:
    """A new jax array with `a`'s values in `dtype` on `device` (None: where `a` is, or JAX's
    default for a host array): moved straight there, then copied and cast there (`device_put`
    may hand back `a`'s own buffer, which a donated step would later delete)."""
    return jnp.array(jax.device_put(a, device), dtype=dtype, copy=True)


def write_stream(config: StackConfig, state: StreamState, path: str | os.PathLike) -> None:
    """Write a snapshot of `state` to a safetensors file (arrays as tensors, metadata in the header);
    ValueError naming `path` where it cannot be written."""
    state = _check_state("write_stream(state)", state)
    meta = snapshot_metadata(config, jnp.dtype(state.k.dtype).name, state.batch_size)
    write_stream_file(path, {key: np.asarray(getattr(state, key)) for key in ARRAY_KEYS}, meta, "numpy")


def read_stream(path: str | os.PathLike) -> dict:
    """The snapshot dict in a file `save_stream` / `write_stream` wrote (numpy arrays, bf16 via ml_dtypes)."""
    return read_stream_file(path, "numpy")


__all__ = ["read_stream", "state_from_snapshot", "state_snapshot", "write_stream"]
