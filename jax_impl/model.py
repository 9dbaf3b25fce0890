"""The two stacks as Flax modules: one declaration of the parameters, one layer driver.

    params = {"params": {"layers": {name: [L, ...]}, "out_norm_alpha": [dim], "text_linear": [V, dim]}}

Every parameter is declared once, from `checkpoint.weight_specs`, stacked `[L, ...]` under
"layers" (the torch buffer names and layout; the top-level `out_norm_alpha`, `text_linear`
exist for the temporal stack only). A layer is a pure function of its weight slices,
`carry = (x [B, T, dim], ring_k, ring_v)` with the whole stacked rings, the layer index and
the step's `StepTables`; `run_layers` applies the L layers either as one `lax.scan` over the
stacked weights (`layer_loop="scan"`, the layer index traced) or as a Python loop with static
indexes (`layer_loop="python"`). The tables are computed once per step, before the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import twin_attention, twin_entry, twin_linear, twin_norm
from kernels_pallas.contract.linear import twin_split_norm
from kernels_pallas.contract.norm import TwinNorm, TwinRms, TwinSplit

from .checkpoint import weight_specs
from .config import MimiConfig, StackConfig, TemporalConfig
from .ops import layer_norm, linear, ring_attention, rms_norm_f32
from .state import StreamState
from .tables import StepTables, rope_freqs, step_tables, visible_mask

LAYER_LOOPS = ("scan", "python")


# ------------------------------------------------------------------------------- layers
def temporal_layer(c: TemporalConfig, w: dict, carry, layer, tables: StepTables, active,
                   exact_rope: bool = True, kernels: str = "xla"):
    """Helium layer: carry (x [B, T, dim], ring_k, ring_v) -> next carry. w: this layer's slices."""
    x, ring_k, ring_v = carry
    h = rms_norm_f32(x, w["norm1_alpha"], c.norm_eps)
    a, ring_k, ring_v = ring_attention(h, w["in_proj"], w["out_proj"], c.num_heads, ring_k, ring_v,
                                       layer, tables, active, exact_rope, kernels, c.context)
    x = x + a
    h = rms_norm_f32(x, w["norm2_alpha"], c.norm_eps)
    B, T, _ = h.shape
    gate_in = linear(h, w["linear_in"]).reshape(B, T, 2, -1)
    x = x + linear(jax.nn.silu(gate_in[..., 0, :]) * gate_in[..., 1, :], w["linear_out"])
    return x, ring_k, ring_v


def mimi_layer(c: MimiConfig, w: dict, carry, layer, tables: StepTables, active,
               exact_rope: bool = True, kernels: str = "xla"):
    """Mimi layer: LayerNorm, attention with layer scale, GELU MLP with layer scale."""
    x, ring_k, ring_v = carry
    h = layer_norm(x, w["norm1_weight"], w["norm1_bias"], c.norm_eps)
    a, ring_k, ring_v = ring_attention(h, w["in_proj"], w["out_proj"], c.num_heads, ring_k, ring_v,
                                       layer, tables, active, exact_rope, kernels, c.context)
    x = x + w["scale1"] * a
    h = layer_norm(x, w["norm2_weight"], w["norm2_bias"], c.norm_eps)
    x = x + w["scale2"] * linear(jax.nn.gelu(linear(h, w["linear1"]), approximate=False), w["linear2"])
    return x, ring_k, ring_v


# ------------------------------------------------------------------------------- twin layers
# kernels="twin": every float operation in a twin kernel (kernels_pallas.twin_*), in the order of
# torch_bridge/twin_layers.py on the Triton twins. The kernels read the stacked weights `w`
# [L, ...] and the rings in place at `layer` (an int, or traced under lax.scan). The carry is
# (x, ring_k, ring_v, sems[, u, ss]): sems, the int32 counters of the kernels that finish in their
# last program (`twin_attention.attention(sems=)`), made once a step and handed on all 0; u, ss: the
# Helium layer's first norm, split (`contract.norm.TwinSplit`, where `contract.linear.twin_split_norm` says), made
# by the layer before (the first layer's by `twin_norm.split`, before the loop).
def _twin_attention(c: StackConfig, x2, norm: TwinNorm | None, w: dict, layer, ring_k, ring_v, sems,
                    tables: StepTables, B: int, T: int, rms: TwinRms | None = None):
    """norm (or rms: x2 is the split norm's u), qkv + rotate + ring write, attention:
    x2 [B*T, dim] -> ([B*T, dim], ring_k, ring_v, sems)."""
    q, ring_k, ring_v = twin_linear.linear_rope_write(x2, w["in_proj"], layer, tables.cos[:, 0], tables.sin[:, 0],
                                                      ring_k, ring_v, tables.write_index, tables.write_mask, norm=norm,
                                                      rms=rms)
    a, sems = twin_attention.attention(q, ring_k, ring_v, layer, tables.positions, tables.q_pos, context=c.context,
                                       sems=sems)
    return a.reshape(B * T, c.dim), ring_k, ring_v, sems


def twin_temporal_layer(c: TemporalConfig, w: dict, carry, layer, tables: StepTables, active,
                        exact_rope: bool = True, kernels: str = "twin"):
    """Helium layer on the Pallas twins; w: the stacked weights (read at `layer` in place). Each
    RMSNorm is passed to the projection after it (`TwinNorm`: fused, or its kernel first), or, with
    u and ss in the carry, split: made in the epilogues of the out- and down-projections (this
    layer's second norm, the next layer's first) and finished by the projections after them."""
    del active, exact_rope, kernels  # the writes follow tables.write_mask; the twins are always exact
    x, ring_k, ring_v, sems, *split = carry
    B, T, dim = x.shape
    x2 = x.reshape(B * T, dim)
    if split:
        u, ss = split
        a, ring_k, ring_v, sems = _twin_attention(c, u, None, w, layer, ring_k, ring_v, sems, tables, B, T,
                                                  rms=TwinRms(ss, c.norm_eps))
        x2, u, ss = twin_linear.linear(a, w["out_proj"], layer, residual=x2, split=TwinSplit(w["norm2_alpha"]))
        g = twin_linear.linear(u, w["linear_in"], layer, act="silu_gate", rms=TwinRms(ss, c.norm_eps))
        x2, u, ss = twin_linear.linear(g, w["linear_out"], layer, residual=x2,
                                       split=TwinSplit(w["norm1_alpha"], offset=1))  # the next layer's
        return x2.reshape(B, T, dim), ring_k, ring_v, sems, u, ss
    a, ring_k, ring_v, sems = _twin_attention(c, x2, TwinNorm("rms", w["norm1_alpha"], None, c.norm_eps), w, layer,
                                              ring_k, ring_v, sems, tables, B, T)
    x2 = twin_linear.linear(a, w["out_proj"], layer, residual=x2)
    u = twin_linear.linear(x2, w["linear_in"], layer, act="silu_gate",
                           norm=TwinNorm("rms", w["norm2_alpha"], None, c.norm_eps))
    x2 = twin_linear.linear(u, w["linear_out"], layer, residual=x2)
    return x2.reshape(B, T, dim), ring_k, ring_v, sems


def twin_mimi_layer(c: MimiConfig, w: dict, carry, layer, tables: StepTables, active,
                    exact_rope: bool = True, kernels: str = "twin"):
    """Mimi layer on the Pallas twins; w: the stacked weights (read at `layer` in place). Each
    LayerNorm is passed to the projection after it (`TwinNorm`: fused, or its kernel first)."""
    del active, exact_rope, kernels
    x, ring_k, ring_v, sems = carry
    B, T, dim = x.shape
    x2 = x.reshape(B * T, dim)
    norm1 = TwinNorm("layer", w["norm1_weight"], w["norm1_bias"], c.norm_eps)
    a, ring_k, ring_v, sems = _twin_attention(c, x2, norm1, w, layer, ring_k, ring_v, sems, tables, B, T)
    x2 = twin_linear.linear(a, w["out_proj"], layer, scale=w["scale1"], residual=x2)
    f = twin_linear.linear(x2, w["linear1"], layer, act="gelu",
                           norm=TwinNorm("layer", w["norm2_weight"], w["norm2_bias"], c.norm_eps))
    x2 = twin_linear.linear(f, w["linear2"], layer, scale=w["scale2"], residual=x2)
    return x2.reshape(B, T, dim), ring_k, ring_v, sems


TWIN_LAYERS = {temporal_layer: twin_temporal_layer, mimi_layer: twin_mimi_layer}


def twin_entry_tables(c: StackConfig, state: StreamState, x, active, freqs):
    """The twin step's entry (`kernels_pallas.twin_entry`, one launch): (tables, write_mask, x, sems).

    tables: the step's `StepTables` (write_mask bool and the mask, from the kernel's tables: both
    computed only where read, e.g. captured); write_mask: the int32 the layers' kernels read in its
    place; x: a copy of x (the layer loop's first carry); sems: the zeroed counters."""
    e = twin_entry.entry(state.offset, state.start_offset, active, x, jnp.asarray(freqs, jnp.float32),
                         capacity=c.capacity, convention=c.ring_convention, num_heads=c.num_heads)
    tables = StepTables(e.cos[:, None], e.sin[:, None], e.write_index, e.positions,
                        visible_mask(e.q_pos, e.positions, c.context), e.end_offset, e.q_pos, e.write_mask != 0)
    return tables, e.write_mask, e.x, e.sems


def run_layers(layer_fn: Callable, c: StackConfig, stacked: dict, carry, tables: StepTables, active, *,
               layer_loop: str = "scan", scan_unroll: int = 1, exact_rope: bool = True, kernels: str = "xla"):
    """Apply the L layers to carry; stacked: name -> [L, ...] weights.

    "scan": one `lax.scan` over (layer index, weight slices), compiled once whatever L;
    "python": a loop with constant layer indexes, so XLA slices weights and rings statically.
    kernels="twin": the twin layer, which reads the stacked weights in place at the (traced)
    layer index, so the scan carries no weight slices (as `lax.fori_loop`, itself a scan, whose
    counter is that index); carry (x, ring_k, ring_v, sems) and tables as `twin_entry_tables`
    makes them.
    """
    if kernels == "twin":
        twin_fn = TWIN_LAYERS[layer_fn]
        B, T = carry[0].shape[:2]
        if layer_fn is temporal_layer and twin_split_norm(c.dim, carry[0].dtype, jax.default_backend() == "gpu"):
            carry = (*carry, *twin_norm.split(carry[0].reshape(B * T, c.dim), stacked["norm1_alpha"], 0))
        if layer_loop == "python":
            for layer in range(c.num_layers):
                carry = twin_fn(c, stacked, carry, layer, tables, active)
            return carry[:3]
        # the loop's own counter is the layer index (scanning over an arange copies each index
        # out of it: a 4-byte copy a layer on the GPU)
        return lax.fori_loop(0, c.num_layers, lambda layer, cr: twin_fn(c, stacked, cr, layer, tables, active),
                             carry, unroll=scan_unroll)[:3]
    if layer_loop == "python":
        for layer in range(c.num_layers):
            w = {name: a[layer] for name, a in stacked.items()}
            carry = layer_fn(c, w, carry, layer, tables, active, exact_rope, kernels)
        return carry

    def body(carry, xs):
        layer, w = xs
        return layer_fn(c, w, carry, layer, tables, active, exact_rope, kernels), None

    carry, _ = lax.scan(body, carry, (jnp.arange(c.num_layers), stacked), unroll=scan_unroll)
    return carry


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
    kernels: str = "xla"             # "xla", "pallas" (see ops.ring_attention) or "twin" (twin layers)

    def _layers(self, layer_fn, state: StreamState, x, active):
        c = self.config
        if self.kernels == "twin":
            freqs = rope_freqs(c.head_dim, c.max_period) if self.rope_freqs is None else self.rope_freqs
            tables, write_mask, x, sems = twin_entry_tables(c, state, x, active, freqs)
            carry, layer_tables = (x, state.k, state.v, sems), tables._replace(write_mask=write_mask)
        else:
            active = jnp.ones((x.shape[0],), bool) if active is None else active
            tables = step_tables(c, state.offset, state.start_offset, active, x.shape[1], self.rope_freqs)
            carry, layer_tables = (x, state.k, state.v), tables
        self.sow("intermediates", "tables", tables)  # what every layer used (step_fn(capture=...))
        stacked = _LayerWeights(c, self.param_dtype, name="layers")()
        x, k, v = run_layers(layer_fn, c, stacked, carry, layer_tables, active,
                             layer_loop=self.layer_loop, scan_unroll=self.scan_unroll,
                             exact_rope=self.exact_rope, kernels=self.kernels)
        return x, state._replace(k=k, v=v, offset=tables.end_offset)

    def _top(self, name: str) -> jax.Array:
        spec = next(s for s in weight_specs(self.config) if s.name == name)
        return self.param(name, _init_for(name), spec.shape, self.param_dtype)


class TemporalStack(_StackBase):
    """Helium temporal stack: (state, x [B, T, dim], active [B] or None: every row) ->
    ((out [B, T, dim], text_logits [B, 1, T, text_card]), new_state)."""

    @nn.compact
    def __call__(self, state: StreamState, x, active):
        x, state = self._layers(temporal_layer, state, x, active)
        alpha, text_linear = self._top("out_norm_alpha"), self._top("text_linear")
        if self.kernels == "twin":
            B, T, dim = x.shape
            out = twin_norm.norm(x.reshape(B * T, dim), alpha, kind="rms", eps=self.config.norm_eps)
            return (out.reshape(B, T, dim), twin_linear.linear(out, text_linear).reshape(B, 1, T, -1)), state
        out = rms_norm_f32(x, alpha, self.config.norm_eps)
        return (out, linear(out, text_linear)[:, None]), state


class MimiStack(_StackBase):
    """Mimi codec transformer: (state, x [B, T, dim], active [B] or None: every row) -> (out [B, T, dim], new_state)."""

    @nn.compact
    def __call__(self, state: StreamState, x, active):
        return self._layers(mimi_layer, state, x, active)


def stack_module(config: StackConfig, param_dtype=jnp.float32, *, layer_loop: str = "scan",
                 scan_unroll: int = 1, exact_rope: bool = True, rope_freqs: tuple | None = None,
                 kernels: str = "xla") -> nn.Module:
    """The Flax module of a stack (`TemporalStack` or `MimiStack`); options as on `_StackBase`.

    scan_unroll: 1 by default, also for the twin kernels, whose loop counter is a launch a layer:
    Mimi's 8 layers unrolled launched 46 kernels a step against 56 rolled (without the entry kernel,
    with which the rolled step launches 50, the counter's 8 included), but synchronized its step was
    0.78 ms against 0.44 rolled on an H200 for a caller that holds each step's output while it
    calls the next (benchmarks/RESULTS.md, "scale_bench"): XLA puts temporaries into the output's allocation,
    whose address then changes at every call, and the unrolled step's one CUDA graph of 46 nodes is
    brought up to date each time (~180 us), the rolled loop's small ones in ~11 us."""
    if layer_loop not in LAYER_LOOPS:
        raise ValueError(f"layer_loop must be one of {LAYER_LOOPS}, got {layer_loop!r}")
    if not isinstance(scan_unroll, int) or isinstance(scan_unroll, bool) or scan_unroll < 1:
        raise ValueError(f"scan_unroll must be a positive int, got {scan_unroll!r}")
    cls = TemporalStack if isinstance(config, TemporalConfig) else MimiStack
    return cls(config, param_dtype=jnp.dtype(param_dtype), layer_loop=layer_loop, scan_unroll=scan_unroll,
               exact_rope=exact_rope, rope_freqs=rope_freqs, kernels=kernels)


def init_params(config: StackConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random variables as the torch path's init_weights (matrices N(0, 0.02), norms 1, ...)."""
    from .state import init_state

    state = init_state(config, 1, dtype)
    x = jnp.zeros((1, 1, config.dim), dtype)
    return jax.jit(stack_module(config, dtype).init)(key, state, x, jnp.ones((1,), bool))
