"""Parameters of a stack: from the Moshi checkpoint layout, from the torch stacks' buffers, and back.

The Flax variables of a stack are `{"params": {"layers": {name: [L, ...]}, name: [...]}}`
with the names of `jax_impl.config.weight_specs` (per-layer buffers under "layers",
`out_norm_alpha` and `text_linear` of the temporal stack at the top). Arrays may be numpy
arrays, jax arrays, or anything with `__dlpack__` / `__array__` (torch CPU tensors included:
torch is never imported here); they are copied, so later in-place changes on the source side
do not leak into JAX.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.config import StackConfig, check_checkpoint, checkpoint_keys, weight_specs

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float64))


class ParamsError(ValueError):
    """A parameter tree does not fit a stack; the message lists every problem at once."""


def copy_to_jax(x) -> jax.Array:
    """A jax copy of an array-like (jax, numpy, or any object with __dlpack__ / __array__)."""
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray):
        return jnp.array(x)
    if hasattr(x, "__dlpack__"):
        try:
            return jnp.array(jnp.from_dlpack(x), copy=True)
        except (BufferError, TypeError, ValueError, RuntimeError):  # non-contiguous, other device, ...
            return jnp.array(np.asarray(x))
    return jnp.array(np.asarray(x))


def _dtype_of(x):
    dt = getattr(x, "dtype", None)
    try:
        return jnp.dtype(dt)
    except TypeError:  # a torch dtype: go through a jax copy
        return copy_to_jax(x).dtype


def _widening_ok(src, dst) -> bool:
    return src == dst or (jnp.finfo(src).bits < jnp.finfo(dst).bits and jnp.finfo(dst).nmant >= jnp.finfo(src).nmant)


def _cast(name: str, x: jax.Array, dtype) -> jax.Array:
    if dtype is None or x.dtype == dtype:
        return x
    if not _widening_ok(x.dtype, dtype):
        raise TypeError(f"{name} has dtype {x.dtype}; casting it to {dtype} would narrow it and is refused: "
                        f"pass dtype={x.dtype}")
    return x.astype(dtype)


def expected_shapes(config: StackConfig) -> dict[str, tuple[int, ...]]:
    """Stacked buffer name -> stacked shape."""
    return {s.name: s.stacked_shape(config.num_layers) for s in weight_specs(config)}


def nest_params(config: StackConfig, flat: Mapping[str, Any]) -> dict:
    """Flax variables from a flat dict name -> stacked array (the arrays are used as they are)."""
    layers = {s.name: flat[s.name] for s in weight_specs(config) if s.per_layer}
    top = {s.name: flat[s.name] for s in weight_specs(config) if not s.per_layer}
    return {"params": {"layers": layers, **top}}


def stacked_weights(config: StackConfig, variables) -> dict[str, jax.Array]:
    """The flat dict name -> stacked array of a variables tree (the torch `weights()` layout)."""
    p = variables["params"]
    return {s.name: (p["layers"][s.name] if s.per_layer else p[s.name]) for s in weight_specs(config)}


def check_params(config: StackConfig, variables, dtype=None, argname: str = "params") -> None:
    """Raise ParamsError listing every missing, unexpected, mis-shaped or mis-typed leaf."""
    problems = []
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise ParamsError(f"{argname}: expected a Flax variables dict {{'params': {{...}}}} "
                          f"(see jax_impl.params_from_stacked), got {type(variables).__name__}")
    p = variables["params"]
    layers = p.get("layers", {}) if isinstance(p, Mapping) else {}
    specs = weight_specs(config)
    want = {("layers", s.name) if s.per_layer else (s.name,): s.stacked_shape(config.num_layers) for s in specs}
    have = {("layers", k): v for k, v in layers.items()}
    have.update({(k,): v for k, v in p.items() if k != "layers"})
    for path in want:
        if path not in have:
            problems.append(f"missing: {'/'.join(path)}")
    for path, v in have.items():
        if path not in want:
            problems.append(f"unexpected: {'/'.join(path)}")
            continue
        shape = tuple(getattr(v, "shape", ()))
        if shape != want[path]:
            problems.append(f"wrong shape: {'/'.join(path)}: expected {list(want[path])}, got {list(shape)}")
        elif dtype is not None and jnp.dtype(getattr(v, "dtype", None)) != jnp.dtype(dtype):
            problems.append(f"wrong dtype: {'/'.join(path)}: expected {jnp.dtype(dtype)}, got {v.dtype}")
    if problems:
        head = f"{argname} do not fit {type(config).__name__}(dim={config.dim}, num_layers={config.num_layers}):"
        raise ParamsError("\n".join([head, *("  " + q for q in problems)]))


def params_from_stacked(config: StackConfig, weights: Mapping[str, Any], dtype=None) -> dict:
    """Variables from stacked buffers by name (e.g. `{k: v for k, v in torch_stack.weights().items()}`).

    Every missing / unexpected / mis-shaped name is reported in one ParamsError. dtype: None
    keeps the source dtype; otherwise widening is exact and allowed, narrowing is refused.
    """
    want = expected_shapes(config)
    problems = [f"missing: {k}" for k in want if k not in weights]
    problems += [f"unexpected: {k}" for k in weights if k not in want]
    problems += [f"wrong shape: {k}: expected {list(want[k])}, got {list(weights[k].shape)}"
                 for k in want if k in weights and tuple(weights[k].shape) != want[k]]
    if problems:
        head = (f"stacked weights do not fit {type(config).__name__}(dim={config.dim}, "
                f"num_layers={config.num_layers}):")
        raise ParamsError("\n".join([head, *("  " + q for q in problems)]))
    dtype = None if dtype is None else jnp.dtype(dtype)
    return nest_params(config, {k: _cast(k, copy_to_jax(weights[k]), dtype) for k in want})


def params_from_checkpoint(config: StackConfig, state_dict: Mapping[str, Any], prefix: str | None = None,
                           dtype=None) -> dict:
    """Variables from a Moshi-layout state dict (checkpoint keys, per-layer tensors).

    Keys are checked with `jax_impl.config.check_checkpoint` first: one CheckpointError
    lists every missing, unexpected or mis-shaped key. dtype as in `params_from_stacked`.
    """
    check_checkpoint({k: tuple(v.shape) for k, v in state_dict.items()}, config, prefix)
    keys = checkpoint_keys(config, prefix)
    dtype = None if dtype is None else jnp.dtype(dtype)
    per_layer: dict[str, list] = {}
    flat: dict[str, jax.Array] = {}
    for key, (spec, layer) in keys.items():
        arr = _cast(key, copy_to_jax(state_dict[key]), dtype).reshape(spec.shape)
        if layer is None:
            flat[spec.name] = arr
        else:
            per_layer.setdefault(spec.name, [None] * config.num_layers)[layer] = arr
    dtypes = {a.dtype for a in flat.values()} | {a.dtype for v in per_layer.values() for a in v}
    if len(dtypes) > 1:
        raise TypeError(f"state_dict mixes dtypes {sorted(map(str, dtypes))}: pass dtype= to pick one")
    flat.update({name: jnp.stack(arrs) for name, arrs in per_layer.items()})
    return nest_params(config, flat)


def load_safetensors(config: StackConfig, path: str | os.PathLike, prefix: str | None = None, dtype=None) -> dict:
    """Variables from a Moshi/PersonaPlex safetensors file (only this stack's keys are read)."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="numpy") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (a safe_open handle)
        check_checkpoint(shapes, config, prefix)
        tensors = {k: f.get_tensor(k) for k in checkpoint_keys(config, prefix)}
    return params_from_checkpoint(config, tensors, prefix, dtype)


def export_checkpoint(config: StackConfig, variables, prefix: str | None = None) -> dict[str, np.ndarray]:
    """The weights in the Moshi checkpoint layout, as numpy arrays (bf16 via ml_dtypes)."""
    flat = stacked_weights(config, variables)
    return {key: np.asarray(flat[spec.name] if layer is None else flat[spec.name][layer]).reshape(spec.ckpt_shape)
            for key, (spec, layer) in checkpoint_keys(config, prefix).items()}


def save_safetensors(config: StackConfig, variables, path: str | os.PathLike, prefix: str | None = None) -> None:
    from safetensors.numpy import save_file

    save_file(export_checkpoint(config, variables, prefix), os.fspath(path))
