"""Tensor parallel (for one conversation's latency, temporal stack).

Over the mesh axis "model" each of n devices holds H/n heads (their in_proj rows for q, k and v,
the matching out_proj columns and its H/n heads of the ring) and hidden/n of the FFN (linear_in
rows of both gate halves, linear_out columns); norms, the text head and the offsets are replicated.

    mesh = session_mesh(axis="model")
    tp_params, tp_state = shard_tensor_parallel(config, params, state, mesh)
    step = make_tensor_parallel_step(config, mesh)
    (out, logits), tp_state = step(tp_params, tp_state, x, active)   # out, logits replicated

A device runs the one-device layer (`layers.temporal_layer`) on its shard, its out-projections
all-reduced: per layer two `lax.psum`s and nothing else, after the attention out-projection and
after the FFN out-projection, each of [B, T, dim] partial sums in the activations' dtype (B=4,
dim 4096, bf16: 32 KB). The bits differ from the one-device step: each device sums dim/n (resp.
hidden/n) products of the out-projections, and the all-reduce adds the n partial sums, another
order of the same float additions; everything else (norms, q/k/v, RoPE, the attention of each
head) is computed from the same values as on one device, but XLA's dots of another width (3H/n
heads of in_proj rows) may block their sums otherwise too. Normwise max rel per step
(max|a - b| / max|b|) to the one-device step, two CPU devices, small preset, 40 steps, 3 seeds:
float32 <= 3.8e-7 (rings; outputs <= 2.5e-7), bfloat16 <= 6e-3 (one bf16 ulp at the largest
entry). `TP_MAX_REL` states the bounds (the tests assert the float32 one); on a mesh of one
device the step is bit-identical to `make_step`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kernels_pallas import backend

from .checkpoint import CheckpointError, check_fit
from .config import TemporalConfig, describe
from .layers import run_layers, temporal_layer
from .model import check_flag, check_stack_options
from .ops import linear, pick_kernels, rms_norm_f32
from .placement import MODEL, PlacedStep, axis_size, check_divisible
from .snapshot import exact_float_cast
from .state import StreamState
from .step import check_step_inputs
from .tables import step_tables
from .weights import check_params

# The tensor-parallel step's bound to the one-device step: normwise max rel per step of every output
# and ring (measured, module docstring: float32 3.8e-7, bfloat16 6e-3; bf16 at the cross-check's level).
TP_MAX_REL = {"float32": 2e-6, "bfloat16": 5e-2}
TP_KERNELS = ("auto", "reference", "pallas")  # `kernel_choice`'s, less "twin" (not split over devices)


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
    known = list(tensor_parallel_specs()[0])
    extra = [k for k in tp if k not in known]
    if extra:
        raise CheckpointError(f"{where}: unexpected top-level keys {extra}; expected {known} (LoRA adapters are "
                              f"not supported by the tensor-parallel step)")
    have = {f"layers/{k}": tuple(v.shape) for k, v in tp["layers"].items()}
    have.update({k: tuple(v.shape) for k, v in tp.items() if k != "layers"})
    check_fit(f"{where} do not fit the tensor-parallel layout of {describe(config)}",
              tensor_parallel_shapes(config), have)


def _all_reduced(axis: str, reduce_dtype) -> Callable:
    """The out-projection of one device's shard: the partial product a @ w.T over its columns
    (accumulated in float32, rounded to `reduce_dtype`, None: a's dtype), summed over `axis`
    (`lax.psum`), in a's dtype: `temporal_layer`'s `out_linear` here."""

    def out_linear(a, w):
        return lax.psum(linear(a, w, reduce_dtype or a.dtype), axis).astype(a.dtype)

    return out_linear


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
    one-device bits). Options as `make_step`'s, checked as its are (`model.check_stack_options`);
    kernels "twin" is not split (ValueError). num_heads and hidden must be divisible by the axis' size.
    """
    where = "make_tensor_parallel_step"
    _check_tensor_parallel(where, config, mesh, axis)
    if kernels == "twin":
        raise ValueError(f"{where}(kernels): 'twin' is not split over devices; use one of {list(TP_KERNELS)}")
    options = check_stack_options(where, config, layer_loop=layer_loop, scan_unroll=scan_unroll,
                                  exact_rope=exact_rope, rope_freqs=rope_freqs, kernels=kernels,
                                  remat_layers=False, accepted=TP_KERNELS)
    if reduce_dtype is not None:
        try:
            reduce_dtype = jnp.dtype(reduce_dtype)
        except TypeError:
            raise TypeError(f"make_tensor_parallel_step(reduce_dtype): expected None or a float dtype, got "
                            f"{reduce_dtype!r}") from None
        if not jnp.issubdtype(reduce_dtype, jnp.floating):
            raise TypeError(f"make_tensor_parallel_step(reduce_dtype): expected None or a float dtype, got "
                            f"{reduce_dtype}")
        if reduce_dtype.itemsize == 8 and not jax.config.jax_enable_x64:
            raise TypeError(f"make_tensor_parallel_step(reduce_dtype): {reduce_dtype} needs jax_enable_x64: without "
                            f"it JAX would make the partial sums float32, a rounding")
    del options["remat_layers"]  # False: the tensor-parallel step has no backward option
    return _make_tensor_parallel_step(config, mesh, axis, reduce_dtype=reduce_dtype,
                                      donate=check_flag(f"{where}(donate)", donate), **options)


@backend.per_backend
def _make_tensor_parallel_step(config: TemporalConfig, mesh: Mesh, axis: str, *, layer_loop: str, scan_unroll: int,
                               exact_rope: bool, rope_freqs: tuple[float, ...] | None, kernels: str, reduce_dtype,
                               donate: bool) -> PlacedStep:
    """`make_tensor_parallel_step` of checked, hashable options: the cached part."""
    p_specs, s_specs = tensor_parallel_specs(axis)
    out_linear = _all_reduced(axis, reduce_dtype)
    layer_fn = functools.partial(temporal_layer, out_linear=out_linear)  # the one-device layer, its sums all-reduced
    c = config

    def local(tp, state, x, active):
        x = x.astype(state.k.dtype)
        T = x.shape[1]
        impl = pick_kernels(kernels, c, state.batch_size, T, exact_rope)
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
        if reduce_dtype is not None and not exact_float_cast(jnp.dtype(state.k.dtype).name, reduce_dtype.name):
            raise TypeError(f"make_tensor_parallel_step(reduce_dtype): {reduce_dtype} would round the partial sums "
                            f"of this {jnp.dtype(state.k.dtype).name} stack; use None or a wider float dtype")
        # check_vma off: the Pallas calls declare their outputs without a varying-axes type, which the
        # check refuses; the replicated outputs (P()) come from the psums, whose sums every device holds
        return jax.shard_map(local, mesh=mesh, in_specs=(p_specs, s_specs, P(), P()),
                             out_specs=(P(), s_specs), check_vma=False)(tp, state, x, active)

    named = functools.partial(jax.tree.map, lambda s: NamedSharding(mesh, s))
    state_sh, rep = named(s_specs), NamedSharding(mesh, P())
    jitted = jax.jit(backend.traced_on(step), out_shardings=(rep, state_sh), donate_argnums=(1,) if donate else ())
    return PlacedStep(jitted, mesh, axis, named(p_specs), state_sh, rep,
                      "place params and state with jax_impl.sharding.shard_tensor_parallel(config, params, "
                      "state, mesh)")


__all__ = ["TP_KERNELS", "TP_MAX_REL", "make_tensor_parallel_step", "shard_tensor_parallel",
           "tensor_parallel_params", "tensor_parallel_shapes", "tensor_parallel_specs"]
