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

from . import twin_layers
from .checkpoint import weight_specs
from .config import StackConfig, TemporalConfig
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
        self.sow("intermediates", "tables", tables)  # what every layer used (step_fn(capture=...))
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


def check_loop_options(layer_loop, scan_unroll=1) -> None:
    """ValueError naming the option unless layer_loop is one of LAYER_LOOPS and scan_unroll a positive
    int: checked where a step or stepper is made, not at its first step."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    if not isinstance(scan_unroll, int) or isinstance(scan_unroll, bool) or scan_unroll < 1:
        raise ValueError(f"scan_unroll must be a positive int, got {scan_unroll!r}")


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
    brought up to date each time (~180 us), the rolled loop's small ones in ~11 us."""
    check_loop_options(layer_loop, scan_unroll)
    check_stack_config("stack_module", config)
    cls = TemporalStack if isinstance(config, TemporalConfig) else MimiStack
    return cls(config, param_dtype=jnp.dtype(param_dtype), layer_loop=layer_loop, scan_unroll=scan_unroll,
               exact_rope=exact_rope, rope_freqs=rope_freqs, kernels=kernels, remat_layers=remat_layers)


def init_params(config: StackConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random variables as the torch path's init_weights (matrices N(0, 0.02), norms 1, ...). config: a
    stack's (`TemporalConfig` or `MimiConfig`; TypeError otherwise)."""
    check_stack_config("init_params", config)
    state = init_state(config, 1, dtype)
    x = jnp.zeros((1, 1, config.dim), dtype)
    return jax.jit(stack_module(config, dtype).init)(key, state, x, jnp.ones((1,), bool))
