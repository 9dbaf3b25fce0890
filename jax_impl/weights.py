"""Parameters of a stack: from the Moshi checkpoint layout, from the torch stacks' buffers, and back.

The Flax variables of a stack are `{"params": {"layers": {name: [L, ...]}, name: [...]}}`
with the names of `jax_impl.checkpoint.weight_specs` (per-layer buffers under "layers",
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

from jax_impl.checkpoint import (
    LOADABLE_DTYPES,
    CheckpointError,
    check_checkpoint,
    check_fit,
    checkpoint_keys,
    read_safetensors,
    read_safetensors_shapes,
    weight_dtype_problem,
    weight_specs,
    write_safetensors,
)
from jax_impl.config import StackConfig, describe


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


def dtype_name(x) -> str | None:
    """The dtype name of an array-like, read without converting it ("float32", "bfloat16",
    "float64", "int32"; torch tensors too), or None when it has no dtype."""
    dt = getattr(x, "dtype", None)
    if dt is None:
        return None
    try:
        return np.dtype(dt).name
    except TypeError:  # a torch dtype
        return str(dt).removeprefix("torch.")


def _shape(x) -> tuple[int, ...] | None:
    shape = getattr(x, "shape", None)
    return None if shape is None else tuple(shape)


def _target_dtype(dtype) -> str | None:
    if dtype is None:
        return None
    name = jnp.dtype(dtype).name
    if name not in LOADABLE_DTYPES:
        raise ValueError(f"dtype: expected None or one of {', '.join(LOADABLE_DTYPES)}, got {name}")
    return name


def _source_problems(arrays: Mapping[str, Any], want: str | None) -> dict[str, str]:
    """Key -> the problem line of each source array that cannot load (checked on the source,
    before any conversion: a float64 numpy array would become float32 in JAX without x64)."""
    problems = {}
    for key, x in arrays.items():
        name = dtype_name(x)
        if name is None or _shape(x) is None:
            line = f"not an array: {key}: {type(x).__name__}"
        elif getattr(x, "is_meta", False):
            line = f"no data: {key}: a meta tensor"
        else:
            line = weight_dtype_problem(key, name, want)
        if line:
            problems[key] = line
    return problems


def _convert(what: str, arrays: Mapping[str, Any], want: str | None) -> dict[str, jax.Array]:
    """Exact JAX copies of arrays already checked by `_source_problems`, widened to `want`.

    One `CheckpointError` (head: `what`) lists every array that cannot be copied, comes to JAX
    in another dtype, or (want None) differs in dtype from the others.
    """
    out, lines = {}, []
    for key, x in arrays.items():
        try:
            a = copy_to_jax(x)
        except (BufferError, TypeError, ValueError, RuntimeError, NotImplementedError) as err:
            lines.append(f"unreadable: {key}: {type(err).__name__}: {err}")
            continue
        if a.dtype.name != dtype_name(x):
            lines.append(f"not exact: {key}: {dtype_name(x)} came to JAX as {a.dtype.name}")
        out[key] = a if want is None else a.astype(want)
    dtypes = sorted({a.dtype.name for a in out.values()})
    if want is None and len(dtypes) > 1:
        lines.append(f"mixed dtypes: {', '.join(dtypes)}: pass dtype= to pick one")
    if lines:
        raise CheckpointError("\n".join([f"{what}:", *("  " + line for line in lines)]))
    return out


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


def check_params(config: StackConfig, variables, dtype=None, argname: str = "params", *,
                 adapters: bool = False) -> None:
    """Raise `CheckpointError` listing every missing, unexpected, mis-shaped or mis-typed leaf.

    variables: `{"params": {"layers": {name: [L, ...]}, name: [...]}}`; leaves are named
    `layers/in_proj`, `text_linear`, ... in the message. dtype: every leaf's dtype, or None.
    adapters: whether LoRA adapters may ride beside them under "lora" (`lora.with_lora`: where a step
    runs them); any other top-level key is refused, as adapters under a misspelt key would be dropped.
    """
    p = variables.get("params") if isinstance(variables, Mapping) else None
    layers = p.get("layers", {}) if isinstance(p, Mapping) else None
    if not isinstance(layers, Mapping):
        raise CheckpointError(f"{argname}: expected a Flax variables dict "
                              f"{{'params': {{'layers': {{...}}, ...}}}} (see jax_impl.params_from_stacked), "
                              f"got {type(variables).__name__}")
    allowed = ("params", "lora") if adapters else ("params",)
    extra = [k for k in variables if k not in allowed]
    if extra:
        raise CheckpointError(f"{argname}: unexpected top-level keys {extra}; expected {list(allowed)}"
                              + ("" if adapters else " (LoRA adapters run in the step, not here)"))
    want = {("layers/" if s.per_layer else "") + s.name: s.stacked_shape(config.num_layers)
            for s in weight_specs(config)}
    have = {f"layers/{k}": v for k, v in layers.items()}
    have.update({k: v for k, v in p.items() if k != "layers"})
    lines = []
    if dtype is not None:
        lines = [f"wrong dtype: {k}: expected {jnp.dtype(dtype)}, got {dtype_name(v)}"
                 for k, v in have.items()
                 if k in want and _shape(v) == want[k] and dtype_name(v) != jnp.dtype(dtype).name]
    shapes = {k: _shape(v) for k, v in have.items()}
    check_fit(f"{argname} do not fit {describe(config)}", want, shapes, lines)


def params_from_stacked(config: StackConfig, weights: Mapping[str, Any], dtype=None, *,
                        source: str = "stacked weights") -> dict:
    """Variables from stacked buffers by name (e.g. `{k: v for k, v in torch_stack.weights().items()}`).

    weights: name -> stacked array [L, ...] (numpy, jax, torch CPU tensors, ...), float32,
    bfloat16 or float16. dtype: None keeps the source dtype (all alike); otherwise float32,
    bfloat16 or float16, reached by exact widening only. Every missing / unexpected /
    mis-shaped name, every float64, integer, bool or non-array value and every narrowing is
    reported in one `CheckpointError` headed by `source`; dtypes are checked on the source
    arrays, before any copy.
    """
    want = _target_dtype(dtype)
    shapes = expected_shapes(config)
    problems = _source_problems(weights, want)
    check_fit(f"{source} do not fit {describe(config)}", shapes, {k: _shape(v) for k, v in weights.items()},
              [line for k, line in problems.items() if k in shapes])
    arrays = _convert(f"{source}: cannot copy to JAX", {k: weights[k] for k in shapes}, want)
    return nest_params(config, arrays)


def params_from_checkpoint(config: StackConfig, state_dict: Mapping[str, Any], prefix: str | None = None,
                           dtype=None, *, source: str = "state_dict") -> dict:
    """Variables from a Moshi-layout state dict (checkpoint keys, per-layer tensors).

    Keys may be the released files' names or those of a `state_dict()` of moshi's own modules
    (`WeightSpec.aliases`). Keys, shapes and dtypes are checked first, as in
    `params_from_stacked`: one `CheckpointError` headed by `source` lists every missing,
    unexpected, duplicated, mis-shaped or mis-typed key. dtype as in `params_from_stacked`.
    """
    want = _target_dtype(dtype)
    keys = check_checkpoint({k: _shape(v) for k, v in state_dict.items()}, config, prefix, source=source,
                            problems=_source_problems(state_dict, want))
    arrays = _convert(f"{source}: cannot copy to JAX", {k: state_dict[k] for k in keys}, want)
    per_layer: dict[str, list] = {}
    flat: dict[str, jax.Array] = {}
    for key, (spec, layer) in keys.items():
        arr = arrays[key].reshape(spec.shape)
        if layer is None:
            flat[spec.name] = arr
        else:
            per_layer.setdefault(spec.name, [None] * config.num_layers)[layer] = arr
    flat.update({name: jnp.stack(arrs) for name, arrs in per_layer.items()})
    return nest_params(config, flat)


def load_safetensors(config: StackConfig, path: str | os.PathLike, prefix: str | None = None, dtype=None) -> dict:
    """Variables from a Moshi/PersonaPlex safetensors file (only this stack's keys are read).

    Errors (a file that is not safetensors, keys, shapes, dtypes) are `CheckpointError`s
    naming the path; a float64 file is refused, as in `params_from_checkpoint`.
    """
    source = os.fspath(path)
    keys = check_checkpoint(read_safetensors_shapes(path), config, prefix, source=source)
    return params_from_checkpoint(config, read_safetensors(path, keys, "numpy"), prefix, dtype, source=source)


def export_checkpoint(config: StackConfig, variables, prefix: str | None = None) -> dict[str, np.ndarray]:
    """The weights in the Moshi checkpoint layout, as numpy arrays (bf16 via ml_dtypes). variables
    are checked first (`check_params`: every leaf's shape, one loadable dtype): a transposed or
    extra-layer leaf would otherwise be reshaped or cut into the file."""
    leaves = jax.tree.leaves(variables)
    dtype = dtype_name(leaves[0]) if leaves else None
    if dtype not in LOADABLE_DTYPES:
        raise CheckpointError(f"variables: the weights must be one of {', '.join(LOADABLE_DTYPES)} (the files "
                              f"both paths load), got {dtype}")
    check_params(config, variables, dtype=dtype, argname="variables")
    flat = stacked_weights(config, variables)
    return {key: np.asarray(flat[spec.name] if layer is None else flat[spec.name][layer]).reshape(spec.ckpt_shape)
            for key, (spec, layer) in checkpoint_keys(config, prefix).items()}


def save_safetensors(config: StackConfig, variables, path: str | os.PathLike, prefix: str | None = None) -> None:
    """Write `variables` as a safetensors file in the released checkpoints' layout (`export_checkpoint`:
    their keys and shapes, the parameters' dtype), so one file serves both paths: `load_safetensors`
    here and the torch stacks' read it back exactly. prefix: a Mimi stack's `encoder_transformer` / ..."""
    write_safetensors(path, export_checkpoint(config, variables, prefix), "numpy")
