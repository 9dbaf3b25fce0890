"""The two stacks as Flax modules: one declaration of the parameters.

    params = {"params": {"layers": {name: [L, ...]}, "out_norm_alpha": [dim], "text_linear": [V, dim]}}

Every parameter is declared once, from `checkpoint.weight_specs`, stacked `[L, ...]` under
"layers" (the torch buffer names and layout; the top-level `out_norm_alpha`, `text_linear`
exist for the temporal stack only). A stack computes the step's tables once, runs its layers
(`layers.run_layers`: the reference layers, or the twin layer programs for kernels="twin") and,
for the temporal stack, the output norm and text head.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from . import twin_layers
from .checkpoint import weight_specs
from .config import StackConfig, TemporalConfig, finite_real, real_number
from .kernel_choice import STACK_KERNELS, check_head_dim, check_kernels
from .layers import (
    LAYER_LOOPS,
    PALLAS_TWINS,
    mimi_layer,
    run_layers,
    temporal_layer,
    twin_entry_tables,
    twin_first_carry,
)
from .lora import LoRA, check_lora
from .ops import linear, rms_norm_f32
from .state import StreamState, check_stack_config, init_state
from .tables import rope_freqs, step_tables


# ------------------------------------------------------------------------------- parameters
def _normal(std: float = 0.02):
    def init(key, shape, dtype):
        return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)
    return init


def _init_for(name: str, layer_scale: float = 0.01):
    """The torch path's `init_weights`: matrices N(0, 0.02), norms 1, biases 0, layer scales 0.01."""
    if name in ("in_proj", "out_proj", "linear_in", "linear_out", "linear1", "linear2", "text_linear"):
        return _normal()
    if name.endswith("bias"):
        return nn.initializers.zeros
    if name.startswith("scale"):
        return nn.initializers.constant(layer_scale)
    return nn.initializers.ones


class _LayerWeights(nn.Module):
    """The per-layer weights, stacked [L, ...]: the one declaration (scope "layers")."""

    config: Any
    param_dtype: Any

    @nn.compact
    def __call__(self) -> dict[str, jax.Array]:
        return {s.name: self.param(s.name, _init_for(s.name), s.stacked_shape(self.config.num_layers),
                                   self.param_dtype)
                for s in weight_specs(self.config) if s.per_layer}


# ------------------------------------------------------------------------------- stacks
class _StackBase(nn.Module):
    config: Any
    param_dtype: Any = jnp.float32
    layer_loop: str = "scan"         # "scan" (one lax.scan over layers) or "python" (static indexes)
    scan_unroll: int = 1             # lax.scan's unroll factor (layer_loop="scan")
    exact_rope: bool = True          # keep RoPE products unfused (bit-identical to torch's rope)
    rope_freqs: tuple | None = None  # RoPE frequency table override (default: tables.rope_freqs)
    kernels: str = "reference"       # "reference", "pallas" (see ops.attend) or "twin" (twin_layers)
    remat_layers: bool = False       # each layer under jax.checkpoint (layers.run_layers)

    def __post_init__(self):
        """The options checked where the module is made (`check_stack_options`), not at its first apply."""
        check_stack_options(type(self).__name__, self.config, layer_loop=self.layer_loop,
                            scan_unroll=self.scan_unroll, exact_rope=self.exact_rope, rope_freqs=self.rope_freqs,
                            kernels=self.kernels, remat_layers=self.remat_layers)
        super().__post_init__()

    def _layers(self, layer_fn, state: StreamState, x, active, lora: LoRA | None):
        c = self.config
        stacked = _LayerWeights(c, self.param_dtype, name="layers")()
        if lora is not None:
            stacked = {**stacked, "lora": check_lora(c, lora, self.kernels)}
        if self.kernels == "twin":
            freqs = rope_freqs(c.head_dim, c.max_period) if self.rope_freqs is None else self.rope_freqs
            tables, write_mask, x, sems = twin_entry_tables(c, state, x, active, freqs)
            carry = twin_first_carry(c, stacked, x, state.k, state.v, sems)
            layer_tables = tables._replace(write_mask=write_mask)
        else:
            active = jnp.ones((x.shape[0],), bool) if active is None else active
            tables = step_tables(c, state.offset, state.start_offset, active, x.shape[1], self.rope_freqs)
            carry, layer_tables = (x, state.k, state.v), tables
        self.sow(CAPTURED[0], "tables", tables)  # what every layer used (step_fn(capture=...))
        x, k, v = run_layers(layer_fn, c, stacked, carry, layer_tables, active,
                             layer_loop=self.layer_loop, scan_unroll=self.scan_unroll,
                             exact_rope=self.exact_rope, kernels=self.kernels, remat_layers=self.remat_layers)
        return x, state._replace(k=k, v=v, offset=tables.end_offset)

    def _top(self, name: str) -> jax.Array:
        spec = next(s for s in weight_specs(self.config) if s.name == name)
        return self.param(name, _init_for(name), spec.shape, self.param_dtype)


class TemporalStack(_StackBase):
    """Helium temporal stack: (state, x [B, T, dim], active [B] or None: every row, lora: `lora.LoRA`
    adapters or None) -> ((out [B, T, dim], text_logits [B, 1, T, text_card]), new_state)."""

    @nn.compact
    def __call__(self, state: StreamState, x, active, lora: LoRA | None = None):
        x, state = self._layers(temporal_layer, state, x, active, lora)
        alpha, text_linear = self._top("out_norm_alpha"), self._top("text_linear")
        if self.kernels == "twin":
            head = {"out_norm_alpha": alpha, "text_linear": text_linear}
            return twin_layers.temporal_head(PALLAS_TWINS, self.config, head, x), state
        out = rms_norm_f32(x, alpha, self.config.norm_eps)
        return (out, linear(out, text_linear)[:, None]), state


class MimiStack(_StackBase):
    """Mimi codec transformer: (state, x [B, T, dim], active [B] or None: every row) -> (out [B, T, dim], new_state).
    lora: refused (`lora.check_lora`: adapters are the temporal stack's)."""

    @nn.compact
    def __call__(self, state: StreamState, x, active, lora: LoRA | None = None):
        return self._layers(mimi_layer, state, x, active, lora)


# The Flax collections a stack sows into: what `step_fn(capture=...)` may ask for.
CAPTURED = ("intermediates",)


def check_loop_options(layer_loop, scan_unroll=1) -> None:
    """ValueError naming the option unless layer_loop is one of LAYER_LOOPS and scan_unroll a positive
    int: checked where a step or stepper is made, not at its first step."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    if not isinstance(scan_unroll, int) or isinstance(scan_unroll, bool) or scan_unroll < 1:
        raise ValueError(f"scan_unroll must be a positive int, got {scan_unroll!r}")


def check_flag(where: str, value) -> bool:
    """value as a bool (a Python or numpy bool); else TypeError naming `where`: a string such as
    "False" would act as True."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: expected a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_capture(where: str, capture) -> tuple[str, ...]:
    """capture (a tuple or list of collection names, each one of `CAPTURED`) as a tuple; else
    TypeError / ValueError naming `where`: a string or a misspelt name would capture nothing."""
    if not isinstance(capture, (tuple, list)) or not all(isinstance(name, str) for name in capture):
        raise TypeError(f"{where}: expected a tuple of collection names (e.g. {CAPTURED}), got "
                        f"{type(capture).__name__} {capture!r}")
    unknown = [name for name in capture if name not in CAPTURED]
    if unknown:
        raise ValueError(f"{where}: a stack sows only into {list(CAPTURED)}, got {unknown}")
    return tuple(capture)


def check_rope_freqs(where: str, rope_freqs, head_dim: int) -> tuple[float, ...] | None:
    """None, or rope_freqs as a tuple of head_dim // 2 Python floats (hashable: what the step caches
    key on). rope_freqs: a tuple or list of finite real numbers, or a 1-D float numpy / JAX array, each
    entry converted exactly (a float64 holds every narrower float). Else TypeError / ValueError naming
    `where`: a table of another length would broadcast against the [B, 1, T, D/2] tables or fail at
    the first step."""
    if rope_freqs is None:
        return None
    n = head_dim // 2
    if hasattr(rope_freqs, "shape") and hasattr(rope_freqs, "dtype"):  # a numpy or JAX array
        table = np.asarray(rope_freqs)
        if table.ndim != 1 or not jnp.issubdtype(table.dtype, jnp.floating):
            raise TypeError(f"{where}: expected a [head_dim/2 = {n}] float table, got {table.dtype}"
                            f"{list(table.shape)}")
        values = table.astype(np.float64).tolist()
    elif isinstance(rope_freqs, (tuple, list)):
        values = list(rope_freqs)
    else:
        raise TypeError(f"{where}: expected None or a [head_dim/2 = {n}] table (a tuple of floats), got "
                        f"{type(rope_freqs).__name__}")
    if len(values) != n:
        raise ValueError(f"{where}: expected head_dim/2 = {n} frequencies, got {len(values)}")
    for i, value in enumerate(values):
        if not real_number(value):
            raise TypeError(f"{where}: entry {i} must be a real number, got {type(value).__name__} {value!r}")
        if not finite_real(value) or float(value) != value:
            raise ValueError(f"{where}: entry {i} must be a finite number a float holds exactly, got {value!r}")
    return tuple(float(value) for value in values)


def check_stack_options(where: str, config: StackConfig, *, layer_loop, scan_unroll, exact_rope, rope_freqs,
                        kernels, remat_layers, accepted: tuple[str, ...] = STACK_KERNELS) -> dict:
    """The stack options (`_StackBase`'s fields; kernels one of `accepted`) normalized: the bools as
    bool, rope_freqs a tuple of floats or None (`check_rope_freqs`). Checked where a stack, step or
    stepper is made, before any cache keys on them; TypeError / ValueError naming `where` and the
    option. Refused too: what the kernels would ignore, exact_rope=False on "pallas" or "twin"
    (their RoPE rounds each product: exact always) and remat_layers=True on "twin" (its layer program
    is not rematerialized)."""
    check_kernels(f"{where}(kernels)", kernels, accepted)
    check_head_dim(f"{where}(kernels)", config, kernels)
    check_loop_options(layer_loop, scan_unroll)
    exact_rope = check_flag(f"{where}(exact_rope)", exact_rope)
    remat_layers = check_flag(f"{where}(remat_layers)", remat_layers)
    if not exact_rope and kernels in ("pallas", "twin"):
        raise ValueError(f"{where}(exact_rope, kernels): exact_rope=False fuses the reference RoPE's products; "
                         f"kernels={kernels!r} runs its own RoPE, exact always: pass exact_rope=True, or "
                         f"kernels='reference'")
    if remat_layers and kernels == "twin":
        raise ValueError(f"{where}(remat_layers, kernels): remat_layers=True rematerializes the reference layers; "
                         f"kernels='twin' runs the twin layer program, which it does not: pass "
                         f"remat_layers=False, or kernels 'reference' or 'pallas'")
    return {"layer_loop": layer_loop, "scan_unroll": scan_unroll, "exact_rope": exact_rope,
            "rope_freqs": check_rope_freqs(f"{where}(rope_freqs)", rope_freqs, config.head_dim),
            "kernels": kernels, "remat_layers": remat_layers}


def stack_module(config: StackConfig, param_dtype=jnp.float32, *, layer_loop: str = "scan",
                 scan_unroll: int = 1, exact_rope: bool = True, rope_freqs: tuple | None = None,
                 kernels: str = "reference", remat_layers: bool = False) -> nn.Module:
    """The Flax module of a stack (`TemporalStack` or `MimiStack`); options as on `_StackBase`.

    scan_unroll: 1 by default, also for the twin kernels, whose loop counter is a launch a layer:
    Mimi's 8 layers unrolled launched 46 kernels a step against 56 (before the entry kernel: 50 rolled
    now, the counter's 8 included), but synchronized its step was
    0.78 ms against 0.44 rolled on an H200 for a caller that holds each step's output while it
    calls the next (RESULTS.md, "Waiting for a step"): XLA puts temporaries into the output's allocation,
    whose address then changes at every call, and the unrolled step's one CUDA graph of 46 nodes is
    brought up to date each time (~180 us), the rolled loop's small ones in ~11 us.
    kernels: one of `STACK_KERNELS` ("auto" is resolved by the step, `ops.pick_kernels`); the options
    are checked here (`check_stack_options`)."""
    check_stack_config("stack_module", config)
    options = check_stack_options("stack_module", config, layer_loop=layer_loop, scan_unroll=scan_unroll,
                                  exact_rope=exact_rope, rope_freqs=rope_freqs, kernels=kernels,
                                  remat_layers=remat_layers)
    cls = TemporalStack if isinstance(config, TemporalConfig) else MimiStack
    return cls(config, param_dtype=jnp.dtype(param_dtype), **options)


def init_params(config: StackConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random variables as the torch path's init_weights (matrices N(0, 0.02), norms 1, ...). config: a
    stack's (`TemporalConfig` or `MimiConfig`; TypeError otherwise)."""
    check_stack_config("init_params", config)
    state = init_state(config, 1, dtype)
    x = jnp.zeros((1, 1, config.dim), dtype)
    return jax.jit(stack_module(config, dtype).init)(key, state, x, jnp.ones((1,), bool))
