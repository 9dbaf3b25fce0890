"""One layer of each stack as a pure function, and the one layer driver `run_layers`.

A layer maps `carry = (x [B, T, dim], ring_k, ring_v)` (the whole stacked rings [L, B, H, C, D])
to the next carry, given that layer's weight slices `w`, the layer index and the step's
`StepTables`. `temporal_layer` and `mimi_layer` are the reference recipe (Moshi's
`StreamingTransformerLayer`, op for op as `torch_bridge/layers.py`), their attention on
jax.numpy or the Pallas RoPE / ring-attention kernels (`kernels`, `ops.attend`); the
tensor-parallel step runs the same `temporal_layer` on one device's shard of the weights, its
all-reduce injected into the out-projections (`out_linear`). kernels="twin" runs the twin layer
programs (`twin_layers`, shared with the torch step) on the Pallas twins instead.
`run_layers` applies the L layers as one `lax.scan` over the stacked weights
(`layer_loop="scan"`, the layer index traced) or as a Python loop with static indexes
(`layer_loop="python"`), each layer rematerialized in the backward pass if asked (`remat_layers`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import twin_attention, twin_entry, twin_linear, twin_norm

from . import twin_layers
from .config import MimiConfig, StackConfig, TemporalConfig
from .lora import layer_linears
from .ops import layer_norm, linear, ring_attention, rms_norm_f32
from .state import StreamState
from .tables import StepTables, visible_mask

LAYER_LOOPS = ("scan", "python")
# What a rematerialized layer keeps for its backward pass: the attention's reads of its ring slice
# ([B, H, C, D] each). Recomputing them would need the whole stacked ring, which jax.checkpoint
# would then keep at every layer (L copies of it).
REMAT_POLICY = jax.checkpoint_policies.save_only_these_names("ring_k", "ring_v")
# The Pallas twins, as the twin layer programs call them (the torch step hands in the Triton twins); each
# runs on Pallas's Triton backend or, where PERSONAPLEX_PALLAS_BACKEND says so, its Mosaic GPU twin
# (`kernels_pallas.backend`).
PALLAS_TWINS = twin_layers.TwinKernels(twin_linear.linear, twin_linear.linear_rope_write, twin_attention.attention,
                                       twin_norm.norm, twin_norm.split)


def temporal_layer(c: TemporalConfig, w: dict, carry, layer, tables: StepTables, active,
                   exact_rope: bool = True, kernels: str = "reference", out_linear: Callable = linear):
    """Helium layer: carry (x [B, T, dim], ring_k, ring_v) -> next carry. w: this layer's slices.

    out_linear(a, w) -> a @ w.T: the attention's and the FFN's out-projections (the
    tensor-parallel step's partial products, all-reduced); in_proj and linear_in may come
    [3, H, D, dim] / [2, hidden, dim] (its shards: the same rows, reshaped). w["lora"], where
    present: this layer's slice of a `lora.LoRA`, applied to the in-projection's q and v rows and
    the FFN's linears (`lora.layer_linears`; one device's layer only)."""
    del active  # the writes follow tables.write_mask
    in_linear = ffn_in = linear
    ffn_out = out_linear
    if "lora" in w:
        if out_linear is not linear:
            raise ValueError("lora: adapters run on the one-device step, not on sharded out-projections")
        in_linear, ffn_in, ffn_out = layer_linears(w["lora"])
    x, ring_k, ring_v = carry
    h = rms_norm_f32(x, w["norm1_alpha"], c.norm_eps)
    a, ring_k, ring_v = ring_attention(h, w["in_proj"], w["out_proj"], c.head_dim, ring_k, ring_v, layer, tables,
                                       exact_rope, kernels, c.context, out_linear, in_linear)
    x = x + a
    h = rms_norm_f32(x, w["norm2_alpha"], c.norm_eps)
    B, T, dim = h.shape
    gate_in = ffn_in(h, w["linear_in"].reshape(-1, dim)).reshape(B, T, 2, -1)
    x = x + ffn_out(jax.nn.silu(gate_in[..., 0, :]) * gate_in[..., 1, :], w["linear_out"])
    return x, ring_k, ring_v


def mimi_layer(c: MimiConfig, w: dict, carry, layer, tables: StepTables, active,
               exact_rope: bool = True, kernels: str = "reference", out_linear: Callable = linear):
    """Mimi layer: LayerNorm, attention with layer scale, GELU MLP with layer scale."""
    del active
    x, ring_k, ring_v = carry
    h = layer_norm(x, w["norm1_weight"], w["norm1_bias"], c.norm_eps)
    a, ring_k, ring_v = ring_attention(h, w["in_proj"], w["out_proj"], c.head_dim, ring_k, ring_v, layer, tables,
                                       exact_rope, kernels, c.context, out_linear)
    x = x + w["scale1"] * a
    h = layer_norm(x, w["norm2_weight"], w["norm2_bias"], c.norm_eps)
    x = x + w["scale2"] * out_linear(jax.nn.gelu(linear(h, w["linear1"]), approximate=False), w["linear2"])
    return x, ring_k, ring_v


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


def twin_first_carry(c: StackConfig, stacked: dict, x, ring_k, ring_v, sems) -> tuple:
    """The twin layer loop's first carry on this backend (`twin_layers.first_carry`)."""
    return twin_layers.first_carry(PALLAS_TWINS, c, stacked, x, ring_k, ring_v, sems,
                                   compiled=jax.default_backend() == "gpu")


def run_layers(layer_fn: Callable, c: StackConfig, stacked: dict, carry, tables: StepTables, active, *,
               layer_loop: str = "scan", scan_unroll: int = 1, exact_rope: bool = True,
               kernels: str = "reference", remat_layers: bool = False):
    """Apply the L layers to carry; stacked: name -> [L, ...] weights (any pytree of them, e.g.
    a `lora.LoRA` under "lora"). Returns (x, ring_k, ring_v).

    "scan": one `lax.scan` over (layer index, weight slices), compiled once whatever L;
    "python": a loop with constant layer indexes, so XLA slices weights and rings statically.
    remat_layers: each reference layer under `jax.checkpoint` (`REMAT_POLICY`): its backward pass
    recomputes the layer's activations from its input instead of keeping them.
    kernels="twin": the twin layer program of c (`twin_layers`, on the Pallas twins), which reads
    the stacked weights in place at the (traced) layer index, so the loop carries no weight
    slices (`lax.fori_loop`, whose counter is that index); carry as `twin_first_carry` makes it,
    tables as `twin_entry_tables` (write_mask int32).
    """
    if kernels == "twin":
        program = twin_layers.layer_program(c)

        def twin_fn(layer, cr):
            return program(PALLAS_TWINS, c, stacked, cr, layer, tables)

        if layer_loop == "python":
            for layer in range(c.num_layers):
                carry = twin_fn(layer, carry)
            return carry[:3]
        # the loop's own counter is the layer index (scanning over an arange copies each index
        # out of it: a 4-byte copy a layer on the GPU)
        return lax.fori_loop(0, c.num_layers, twin_fn, carry, unroll=scan_unroll)[:3]
    def apply(w, carry, layer):
        return layer_fn(c, w, carry, layer, tables, active, exact_rope, kernels)

    if remat_layers:
        apply = jax.checkpoint(apply, policy=REMAT_POLICY, static_argnums=(2,) if layer_loop == "python" else ())
    if layer_loop == "python":
        for layer in range(c.num_layers):
            carry = apply(jax.tree.map(lambda a, i=layer: a[i], stacked), carry, layer)
        return carry

    def body(carry, xs):
        layer, w = xs
        return apply(w, carry, layer), None

    carry, _ = lax.scan(body, carry, (jnp.arange(c.num_layers), stacked), unroll=scan_unroll)
    return carry
