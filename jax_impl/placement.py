"""What the multi-device steps share: meshes, placement checks, the placed step, collective counts.

`sessions` (rows split over devices) and `tensor_parallel` (one conversation's heads split) build
on it; `sharding` is the public namespace of all three.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from .state import StreamState, check_live
from .step import check_host_args

SESSIONS = "sessions"  # the mesh axis of the sessions layout
MODEL = "model"        # the mesh axis of the tensor-parallel layout
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



def collectives(compiled_text: str) -> dict[str, int]:
    """Collective op -> count in a compiled program's HLO text (`jitted.lower(...).compile().as_text()`)."""
    counts = {}
    for op in COLLECTIVES:
        n = len(re.findall(rf"\s{op}(?:-start)?\(", compiled_text))
        if n:
            counts[op] = n
    return counts


def _device_ids(sharding) -> list:
    """The ids of `sharding`'s devices, in its mesh's order where it has one (a `NamedSharding`'s
    repr names the mesh's axes, not its devices)."""
    mesh = getattr(sharding, "mesh", None)
    if isinstance(mesh, Mesh):
        return mesh.device_ids.tolist()
    return sorted(d.id for d in sharding.device_set)


def check_placed(where: str, tree, want, fix: str) -> None:
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
            got, expected = str(sharding), str(w)
            if got == expected:  # the same layout on other devices, or in another order
                got, expected = f"{got} on devices {_device_ids(sharding)}", f"{expected} on devices {_device_ids(w)}"
            raise ValueError(f"{where}: {name} is laid out as {got}, expected {expected}; {fix}")


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
        check_live("step(state)", state)
        check_placed("step(params)", params, self._param_sharding, self._fix)
        check_placed("step(state)", state, self._state_sharding, self._fix)
        B = state.batch_size
        if active is None:
            active = np.ones((B,), bool)
        if not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in (x, active)) \
                or np.shape(x)[:1] != (B,) or np.shape(active) != (B,):  # let the step's own checks name them
            return params, state, x, active
        check_host_args(state, x, active)  # before device_put, which would narrow a numpy float64 x
        return params, state, jax.device_put(x, self._row), jax.device_put(active, self._row)

    def __call__(self, params, state, x, active=None):
        return self.jitted(*self._args(params, state, x, active))

    def lower(self, params, state, x, active=None):
        return self.jitted.lower(*self._args(params, state, x, active))



__all__ = ["COLLECTIVES", "MODEL", "SESSIONS", "PlacedStep", "axis_size", "check_divisible", "check_placed",
           "collectives", "session_mesh"]
