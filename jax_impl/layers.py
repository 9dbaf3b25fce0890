"""The layers of both stacks as Flax (linen) modules, and the stacks that scan over them.

Op for op the same as `torch_bridge/layers.py` (Moshi's `StreamingTransformerLayer`).
A layer module maps a carry `(x, ring_k, ring_v)` to the next one, where ring_k, ring_v are
the whole stacked rings [L, B, H, C, D] of the stack: the layer scatters only its T new slots
into them (`ring_write`), and reads its own ring for attention. With the rings carried
through one `lax.scan` and the state donated under `jax.jit`, XLA updates them in place.

The stack modules (`TemporalStack`, `MimiStack`) compute the `StepTables` once per step,
before the scan, and every layer uses them. Parameter names are the torch buffer names of
`personaplex_config.weight_specs`: per-layer weights live stacked [L, ...] under
`params["layers"]`, the others (`out_norm_alpha`, `text_linear`) at the top.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas import mrope
from kernels_pallas.ring_attention import MIN_QUERIES, fits_int32
from kernels_pallas.ring_attention import ring_attention as pallas_ring_attention
from personaplex_config import MimiConfig, TemporalConfig, weight_specs

from .ring import StepTables, apply_rope, step_tables
from .state import StreamState


def _acc_dtype(dtype):
    """Accumulation / norm dtype: float32 for bf16/f16/f32, float64 stays float64."""
    return jnp.promote_types(dtype, jnp.float32)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w.T (F.linear), accumulated in at least float32, returned in x's dtype."""
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=_acc_dtype(x.dtype))
    return y.astype(x.dtype)


def rms_norm_f32(x: jax.Array, alpha: jax.Array, eps: float) -> jax.Array:
    """Moshi's rms_norm_f32: var = eps + mean(x^2) in float32, y = x * (alpha * rsqrt(var))."""
    acc = _acc_dtype(x.dtype)
    xf = x.astype(acc)
    var = eps + jnp.mean(xf**2, axis=-1, keepdims=True)
    return (xf * (alpha.astype(acc) * lax.rsqrt(var))).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """F.layer_norm over the last dim (biased variance), computed in float32."""
    acc = _acc_dtype(x.dtype)
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xc = xf - mean
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    y = xc * lax.rsqrt(var + eps) * weight.astype(acc) + bias.astype(acc)
    return y.astype(x.dtype)


def ring_write(ring: jax.Array, layer, write_index: jax.Array, new: jax.Array, active: jax.Array) -> jax.Array:
    """ring[layer, b, :, write_index[b, t]] = new[b, :, t] for active rows; the rest untouched.

    ring [L, B, H, C, D], write_index [B, T], new [B, H, T, D], active bool [B]. Only B*H*T
    vectors are scattered; an inactive row is sent to out-of-range slots C + t, dropped.
    """
    _, B, H, C, _ = ring.shape
    T = new.shape[2]
    slot = jnp.where(active[:, None], write_index, C + jnp.arange(T, dtype=write_index.dtype))
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    return ring.at[layer, b, h, slot[:, None, :]].set(new.astype(ring.dtype), mode="drop",
                                                       unique_indices=True)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D) | mask) v, as torch's CPU SDPA computes it; 0 where nothing is visible.

    q [B, H, T, D], k, v [B, H, C, D], mask bool [B, 1, T, C] -> [B, H, T, D] in q's dtype.
    Scores, max and sum in float32 (float64 for float64 inputs); the weights are cast to v's
    dtype for the second product and the sum divides at the end, as the fused CPU kernel does.
    """
    acc = _acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bhtd,bhcd->bhtc", q, k, preferred_element_type=acc) * jnp.asarray(scale, acc)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(s - m)  # exactly 0 where masked
    l = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhtc,bhcd->bhtd", p.astype(v.dtype), v, preferred_element_type=acc)
    return (out / jnp.where(l > 0, l, 1.0)).astype(q.dtype)


def rope_pallas(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE of q, k [B, T, H, D] with the Pallas kernel (GPT-J pairs, text-only MRoPE).

    cos, sin: float32 [B, 1, T, D/2]. Returns q, k as [B, H, T, D], bit-identical to
    `apply_rope(exact=True)`: both round each product on its own, in float32.
    """
    B, T, H, D = q.shape
    cos, sin = cos.reshape(B * T, D // 2), sin.reshape(B * T, D // 2)
    q, k = mrope(q.reshape(B * T, H * D), k.reshape(B * T, H * D), cos, sin, None, D, D, is_neox_style=False)
    return (q.reshape(B, T, H, D).transpose(0, 2, 1, 3), k.reshape(B, T, H, D).transpose(0, 2, 1, 3))


def ring_attention(h, in_proj, out_proj, num_heads: int, ring_k, ring_v, layer, tables: StepTables,
                   active, exact_rope: bool = True, kernels: str = "xla", context: int | None = None):
    """Fused-projection self-attention over the ring; returns (out [B, T, dim], ring_k, ring_v).

    kernels="xla": jax.numpy RoPE and attention over `ring[layer]`; "pallas": the Pallas RoPE
    kernel and the Pallas ring attention, which reads the layer's slots in place (GPU). Both
    scatter only the T new slots into the ring (in place under donation). Writing them inside
    the attention kernel instead (aliased rings) was measured slower on the H200.
    """
    B, T, dim = h.shape
    qkv = linear(h, in_proj).reshape(B, T, 3, num_heads, dim // num_heads)
    v = qkv[:, :, 2].transpose(0, 2, 1, 3)
    if kernels == "pallas":
        q, k = rope_pallas(qkv[:, :, 0], qkv[:, :, 1], tables.cos, tables.sin)
    else:
        q = apply_rope(qkv[:, :, 0].transpose(0, 2, 1, 3), tables.cos, tables.sin, exact=exact_rope)
        k = apply_rope(qkv[:, :, 1].transpose(0, 2, 1, 3), tables.cos, tables.sin, exact=exact_rope)
    ring_k = ring_write(ring_k, layer, tables.write_index, k, active)
    ring_v = ring_write(ring_v, layer, tables.write_index, v, active)
    if kernels == "pallas":
        out = pallas_ring_attention(q.astype(ring_k.dtype), ring_k, ring_v, layer, tables.positions, tables.q_pos,
                                    context=context)
    else:
        out = masked_attention(q.astype(ring_k.dtype), ring_k[layer], ring_v[layer], tables.mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, T, dim).astype(h.dtype)
    return linear(out, out_proj), ring_k, ring_v


def pick_kernels(kernels: str, config, batch_size: int, T: int, unroll) -> str:
    """Resolve kernels="auto": "pallas" on a GPU where the Pallas kernels apply (layers
    unrolled, so the ring attention gets a constant layer number), else "xla"."""
    if kernels not in ("auto", "xla", "pallas"):
        raise ValueError(f"kernels must be 'auto', 'xla' or 'pallas', got {kernels!r}")
    if kernels != "auto":
        return kernels
    D = config.head_dim
    fits = fits_int32((config.num_layers, batch_size, config.num_heads, config.capacity, D))
    ok = jax.default_backend() == "gpu" and fits and not D & (D - 1) and T <= MIN_QUERIES and unroll is True
    return "pallas" if ok else "xla"


# ------------------------------------------------------------------------------- initializers
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


class _LayerBase(nn.Module):
    config: Any
    param_dtype: Any = jnp.float32
    exact_rope: bool = True
    kernels: str = "xla"

    def weights(self) -> dict[str, jax.Array]:
        return {s.name: self.param(s.name, _init_for(s.name), s.shape, self.param_dtype)
                for s in weight_specs(self.config) if s.per_layer}


def temporal_layer(c: TemporalConfig, w: dict, carry, layer, tables: StepTables, active,
                   exact_rope: bool = True, kernels: str = "xla"):
    """Helium layer as a pure function: carry (x [B, T, dim], ring_k, ring_v) -> next carry."""
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
    """Mimi layer as a pure function: LayerNorm, attention with layer scale, GELU MLP with layer scale."""
    x, ring_k, ring_v = carry
    h = layer_norm(x, w["norm1_weight"], w["norm1_bias"], c.norm_eps)
    a, ring_k, ring_v = ring_attention(h, w["in_proj"], w["out_proj"], c.num_heads, ring_k, ring_v,
                                       layer, tables, active, exact_rope, kernels, c.context)
    x = x + w["scale1"] * a
    h = layer_norm(x, w["norm2_weight"], w["norm2_bias"], c.norm_eps)
    x = x + w["scale2"] * linear(jax.nn.gelu(linear(h, w["linear1"]), approximate=False), w["linear2"])
    return x, ring_k, ring_v


class TemporalLayer(_LayerBase):
    """Helium layer: carry (x, ring_k, ring_v), layer index, tables, active -> (carry, None)."""

    @nn.compact
    def __call__(self, carry, layer, tables: StepTables, active):
        return temporal_layer(self.config, self.weights(), carry, layer, tables, active, self.exact_rope,
                              self.kernels), None


class MimiLayer(_LayerBase):
    """Mimi layer (see `mimi_layer`) as a Flax module."""

    @nn.compact
    def __call__(self, carry, layer, tables: StepTables, active):
        return mimi_layer(self.config, self.weights(), carry, layer, tables, active, self.exact_rope,
                          self.kernels), None


class StackedWeights(nn.Module):
    """The per-layer weights stacked [L, ...] under "layers", as `nn.scan` lays them out."""

    config: Any
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> dict[str, jax.Array]:
        L = self.config.num_layers
        return {s.name: self.param(s.name, _init_for(s.name), (L, *s.shape), self.param_dtype)
                for s in weight_specs(self.config) if s.per_layer}


def _scan_layers(layer_cls, module: nn.Module, state: StreamState, x, tables: StepTables, active):
    """Apply every layer: one `nn.scan`, or (unroll=True) a Python loop with static layer indexes.

    The unrolled loop slices the stacked weights and indexes the rings with constants, so XLA
    reads both in place and the Pallas ring attention gets a plain layer number.
    """
    c = module.config
    carry = (x, state.k, state.v)
    if module.unroll is True:
        fn = temporal_layer if layer_cls is TemporalLayer else mimi_layer
        stacked = StackedWeights(c, module.param_dtype, name="layers")()
        for layer in range(c.num_layers):
            w = {name: a[layer] for name, a in stacked.items()}
            carry = fn(c, w, carry, layer, tables, active, module.exact_rope, module.kernels)
    else:
        scanned = nn.scan(layer_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=(0, nn.broadcast, nn.broadcast), length=c.num_layers, unroll=module.unroll)
        layers = scanned(c, module.param_dtype, module.exact_rope, module.kernels, name="layers")
        carry, _ = layers(carry, jnp.arange(c.num_layers), tables, active)
    x, k, v = carry
    return x, state._replace(k=k, v=v, offset=tables.end_offset)


class _StackBase(nn.Module):
    config: Any
    param_dtype: Any = jnp.float32
    unroll: int | bool = 1       # lax.scan unroll over layers (True: a Python loop, static indexes)
    exact_rope: bool = True      # keep RoPE products unfused (bit-identical to torch's rope)
    rope_freqs: tuple | None = None  # RoPE frequency table override (default: ring.rope_freqs)
    kernels: str = "xla"         # "xla" or "pallas" (RoPE and ring attention; see ring_attention)


class TemporalStack(_StackBase):
    """Helium temporal stack: (state, x [B, T, dim], active [B]) ->
    ((out [B, T, dim], text_logits [B, 1, T, text_card]), new_state)."""

    @nn.compact
    def __call__(self, state: StreamState, x, active):
        c = self.config
        assert isinstance(c, TemporalConfig)
        tables = step_tables(c, state.offset, state.start_offset, active, x.shape[1], self.rope_freqs)
        x, state = _scan_layers(TemporalLayer, self, state, x, tables, active)
        alpha = self.param("out_norm_alpha", nn.initializers.ones, (c.dim,), self.param_dtype)
        text_linear = self.param("text_linear", _normal(), (c.text_card, c.dim), self.param_dtype)
        out = rms_norm_f32(x, alpha, c.norm_eps)
        return (out, linear(out, text_linear)[:, None]), state


class MimiStack(_StackBase):
    """Mimi codec transformer: (state, x [B, T, dim], active [B]) -> (out [B, T, dim], new_state)."""

    @nn.compact
    def __call__(self, state: StreamState, x, active):
        c = self.config
        assert isinstance(c, MimiConfig)
        tables = step_tables(c, state.offset, state.start_offset, active, x.shape[1], self.rope_freqs)
        return _scan_layers(MimiLayer, self, state, x, tables, active)


def stack_module(config, param_dtype=jnp.float32, unroll: int | bool = 1, exact_rope: bool = True,
                 rope_freqs: tuple | None = None, kernels: str = "xla") -> nn.Module:
    cls = TemporalStack if isinstance(config, TemporalConfig) else MimiStack
    return cls(config, param_dtype=jnp.dtype(param_dtype), unroll=unroll, exact_rope=exact_rope,
               rope_freqs=rope_freqs, kernels=kernels)
