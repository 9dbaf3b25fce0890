"""The operations of one layer, on one layer's weights and the stacked rings.

    x, h:        [B, T, dim]        activations (the stack's dtype)
    q, k, v:     [B, H, T, D]       after the fused in-projection, q/k rotated
    ring_k/v:    [L, B, H, C, D]    the stacked rings; an op reads or writes layer `layer` in place

Op for op the same as `torch_bridge/layers.py` (Moshi's `StreamingTransformerLayer`); each op
says where its rounding differs from torch and why. `kernels` (the vocabulary of
`kernel_choice`) picks how the attention runs: "reference" (jax.numpy, any backend) or "pallas"
(the Pallas RoPE and ring-attention kernels, which read the layer's slots in place from a layer
index that may be traced). "twin" runs the whole layer on the twin kernels instead
(`twin_layers`), not through these ops.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from kernels_pallas import mrope
from kernels_pallas.ring_attention import MIN_QUERIES, fits_int32
from kernels_pallas.ring_attention import ring_attention as pallas_ring_attention

from .kernel_choice import JAX_KERNELS, check_kernels
from .tables import StepTables


def acc_dtype(dtype):
    """Accumulation / norm dtype: float32 for bf16/f16/f32, float64 stays float64."""
    return jnp.promote_types(dtype, jnp.float32)


def linear(x: jax.Array, w: jax.Array, dtype=None) -> jax.Array:
    """x @ w.T (F.linear), accumulated in at least float32, returned in `dtype` (None: x's)."""
    y = lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=acc_dtype(x.dtype))
    return y.astype(x.dtype if dtype is None else dtype)


def rms_norm_f32(x: jax.Array, alpha: jax.Array, eps: float) -> jax.Array:
    """Moshi's rms_norm_f32: var = eps + mean(x^2) in float32, y = x * (alpha * rsqrt(var))."""
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    var = eps + jnp.mean(xf**2, axis=-1, keepdims=True)
    return (xf * (alpha.astype(acc) * lax.rsqrt(var))).astype(x.dtype)


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """F.layer_norm over the last dim (biased variance), computed in float32."""
    acc = acc_dtype(x.dtype)
    xf = x.astype(acc)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    xc = xf - mean
    var = jnp.mean(xc * xc, axis=-1, keepdims=True)
    y = xc * lax.rsqrt(var + eps) * weight.astype(acc) + bias.astype(acc)
    return y.astype(x.dtype)


def ring_write(ring: jax.Array, layer, write_index: jax.Array, new: jax.Array, write_mask: jax.Array) -> jax.Array:
    """ring[layer, b, :, write_index[b, t]] = new[b, :, t] where write_mask[b, t]; the rest untouched.

    ring [L, B, H, C, D], write_index [B, T], new [B, H, T, D], write_mask bool [B, T]
    (`StepTables.write_mask`: active rows, positions not recycled away). Only B*H*T vectors
    are scattered; a masked-out write is sent to the out-of-range slot C + t, dropped.
    """
    _, B, H, C, _ = ring.shape
    T = new.shape[2]
    slot = jnp.where(write_mask, write_index, C + jnp.arange(T, dtype=write_index.dtype))
    b = jnp.arange(B)[:, None, None]
    h = jnp.arange(H)[None, :, None]
    return ring.at[layer, b, h, slot[:, None, :]].set(new.astype(ring.dtype), mode="drop",
                                                       unique_indices=True)


def _separate_product(p: jax.Array) -> jax.Array:
    """p, rounded on its own: XLA's CPU (and GPU) backends let LLVM contract `a*b - c*d` into a
    fused multiply-add, which eager torch does not do. `optimization_barrier`, `reduce_precision`
    and a bitcast round trip are all simplified away before code generation; a select on
    `isnan(p)` (keeps NaN as NaN) is not, and LLVM does not contract an fmul through a select.
    """
    return jnp.where(jnp.isnan(p), jnp.asarray(jnp.nan, p.dtype), p)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, *, exact: bool = True) -> jax.Array:
    """Rotate GPT-J pairs (2i, 2i+1) of x [B, H, T, D] in float32; returns x's dtype.

    out_r = r*cos - i*sin, out_i = r*sin + i*cos. With exact=True each product is rounded
    on its own (no FMA contraction), which makes the result bit-identical to the torch path
    given the same tables; exact=False lets the compiler fuse (faster, <= 1 ulp apart).
    """
    B, H, T, D = x.shape
    # float32 for f32/bf16/f16 as torch's `.float()`; float64 inputs stay float64 (gradient checks).
    pairs = x.reshape(B, H, T, D // 2, 2).astype(jnp.promote_types(x.dtype, jnp.float32))
    xr, xi = pairs[..., 0], pairs[..., 1]
    products = (xr * cos, xi * sin, xr * sin, xi * cos)
    if exact:
        products = tuple(_separate_product(p) for p in products)
    rc, is_, rs, ic = products
    out = jnp.stack([(rc - is_).astype(x.dtype), (rs + ic).astype(x.dtype)], axis=-1)
    return out.reshape(x.shape)


def masked_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D) | mask) v, as torch's CPU SDPA computes it; +0 where nothing is visible.

    q [B, H, T, D], k, v [B, H, C, D], mask bool [B, 1, T, C] -> [B, H, T, D] in q's dtype.
    Scores, max and sum in float32 (float64 for float64 inputs); the weights are cast to v's
    dtype for the second product and the sum divides at the end, as the fused CPU kernel does.
    A query that sees no slot (after `reset_slot` + `bump_slot_start`, or a row that never
    wrote) gets exactly +0, as torch's SDPA returns for an all-False mask row: selected, not
    computed, so whatever the masked slots hold (even NaN) and the sign of 0 * v cannot show.
    """
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("bhtd,bhcd->bhtc", q, k, preferred_element_type=acc) * jnp.asarray(scale, acc)
    s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(s - m)  # exactly 0 where masked
    l = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhtc,bhcd->bhtd", p.astype(v.dtype), v, preferred_element_type=acc)
    seen = l != 0  # 0: nothing visible; NaN (a visible NaN) propagates, as in torch's SDPA
    return jnp.where(seen, out / jnp.where(seen, l, 1.0), 0.0).astype(q.dtype)


def rope_pallas(q: jax.Array, k: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE of q, k [B, T, H, D] with the Pallas kernel (GPT-J pairs, text-only MRoPE).

    cos, sin: float32 [B, 1, T, D/2]. Returns q, k as [B, H, T, D], bit-identical to
    `apply_rope(exact=True)`: both round each product on its own, in float32.
    """
    B, T, H, D = q.shape
    cos, sin = cos.reshape(B * T, D // 2), sin.reshape(B * T, D // 2)
    q, k = mrope(q.reshape(B * T, H * D), k.reshape(B * T, H * D), cos, sin, None, D, D, is_neox_style=False)
    return (q.reshape(B, T, H, D).transpose(0, 2, 1, 3), k.reshape(B, T, H, D).transpose(0, 2, 1, 3))


def attend(qkv, ring_k, ring_v, layer, tables: StepTables, exact_rope: bool = True, kernels: str = "reference",
           context: int | None = None):
    """RoPE, ring write and attention of the projected qkv [B, T, 3, H, D] -> ([B, T, H*D], ring_k, ring_v).

    kernels="reference": jax.numpy RoPE and attention over `ring[layer]`; "pallas": the Pallas RoPE
    kernel and the Pallas ring attention, which reads the layer's slots in place (GPU). Both
    scatter only the T new slots into the ring (in place under donation); the writes follow
    `tables.write_mask` (the step's active rows, positions below start_offset dropped). Writing
    them inside the attention kernel instead (aliased rings) was measured slower on the H200.
    H may be a shard of the heads (the tensor-parallel step's own). The reference attention's reads
    of the layer's ring are named "ring_k" / "ring_v" (`checkpoint_name`: what a rematerialized
    layer keeps, `layers.REMAT_POLICY`).
    """
    B, T, _, H, D = qkv.shape
    v = qkv[:, :, 2].transpose(0, 2, 1, 3)
    if kernels == "pallas":
        q, k = rope_pallas(qkv[:, :, 0], qkv[:, :, 1], tables.cos, tables.sin)
    else:
        q = apply_rope(qkv[:, :, 0].transpose(0, 2, 1, 3), tables.cos, tables.sin, exact=exact_rope)
        k = apply_rope(qkv[:, :, 1].transpose(0, 2, 1, 3), tables.cos, tables.sin, exact=exact_rope)
    ring_k = ring_write(ring_k, layer, tables.write_index, k, tables.write_mask)
    ring_v = ring_write(ring_v, layer, tables.write_index, v, tables.write_mask)
    if kernels == "pallas":
        out = pallas_ring_attention(q.astype(ring_k.dtype), ring_k, ring_v, layer, tables.positions, tables.q_pos,
                                    context=context)
    else:
        keys, values = checkpoint_name(ring_k[layer], "ring_k"), checkpoint_name(ring_v[layer], "ring_v")
        out = masked_attention(q.astype(ring_k.dtype), keys, values, tables.mask)
    return out.transpose(0, 2, 1, 3).reshape(B, T, H * D).astype(qkv.dtype), ring_k, ring_v


def ring_attention(h, in_proj, out_proj, head_dim: int, ring_k, ring_v, layer, tables: StepTables,
                   exact_rope: bool = True, kernels: str = "reference", context: int | None = None,
                   out_linear=linear, in_linear=linear):
    """Fused-projection self-attention over the ring (`attend` between the two projections);
    returns (out [B, T, dim], ring_k, ring_v). in_proj: [3*H*D, dim], or any shape of those rows
    ([3, H, D, dim]: a shard of the heads); in_linear(h, w), out_linear(a, w): the projections
    h @ w.T (w [3*H*D, dim]) and a @ w.T."""
    B, T, dim = h.shape
    qkv = in_linear(h, in_proj.reshape(-1, dim)).reshape(B, T, 3, -1, head_dim)
    out, ring_k, ring_v = attend(qkv, ring_k, ring_v, layer, tables, exact_rope, kernels, context)
    return out_linear(out, out_proj), ring_k, ring_v


def pick_kernels(kernels: str, config, batch_size: int, T: int, exact_rope: bool = True) -> str:
    """Resolve kernels="auto": "pallas" on a GPU where the Pallas kernels apply (power-of-two
    head dim, T <= MIN_QUERIES, int32 offsets into the ring, exact_rope: the Pallas RoPE has no
    fused form), else "reference"."""
    if check_kernels("kernels", kernels, JAX_KERNELS) != "auto":
        return kernels
    D = config.head_dim
    fits = fits_int32((config.num_layers, batch_size, config.num_heads, config.capacity, D))
    ok = jax.default_backend() == "gpu" and fits and not D & (D - 1) and T <= MIN_QUERIES and exact_rope
    return "pallas" if ok else "reference"
