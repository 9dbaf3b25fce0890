"""One layer of each stack, as plain functions of (config, that layer's weights, carry, layer, tables).

carry = (x [B, T, dim], ring_k, ring_v): the stacked rings [L, B, H, C, D], written in place at
`layer` and handed on; tables: `tables.TorchStepTables`. The order of operations follows
Moshi's `StreamingTransformerLayer` op for op (the reference path, bit-exact with moshi), as
`jax_impl.layers` does in JAX. kernels="twin" runs the twin layer programs instead
(`jax_impl.twin_layers`, shared with the JAX step) on the Triton twins (`triton_twins`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jax_impl.config import MimiConfig, TemporalConfig
from jax_impl.twin_layers import TwinKernels

from .tables import TorchStepTables


def rms_norm_f32(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """Moshi's `rms_norm_f32`: in float32, var = eps + mean(x^2), y = x * (alpha * rsqrt(var))."""
    x_dtype = x.dtype
    x = x.float()
    var = eps + torch.mean(x**2, dim=2, keepdim=True)
    return (x * (alpha.to(var) * torch.rsqrt(var))).to(x_dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of x [B, H, T, D] in float32; returns x's dtype and shape.

    cos, sin: float32 [B, 1, T, D // 2]. out_r = r*cos - i*sin, out_i = r*sin + i*cos, each
    product rounded on its own (eager torch: no fused multiply-add).
    """
    D = x.shape[-1]
    pairs = x.view(*x.shape[:-1], D // 2, 2)
    xr, xi = pairs[..., 0].float(), pairs[..., 1].float()
    out_r = xr * cos - xi * sin
    out_i = xr * sin + xi * cos
    return torch.stack([out_r.to(x.dtype), out_i.to(x.dtype)], dim=-1).view(x.shape)


def ring_write(ring: torch.Tensor, write_index: torch.Tensor, new: torch.Tensor, write_mask: torch.Tensor) -> None:
    """In place: ring[b, :, write_index[b, t]] = new[b, :, t] where write_mask[b, t].

    ring [B, H, C, D], write_index int64 [B, T], new [B, H, T, D], write_mask bool [B, T]
    (`TorchStepTables.write_mask`: active rows, positions not recycled away). A masked-out write
    puts back what its slot already holds, so the op has a fixed shape (CUDA-graph friendly)
    and leaves that slot unchanged.
    """
    B, H, T, D = new.shape
    index = write_index.view(B, 1, T, 1).expand(B, H, T, D)
    kept = torch.where(write_mask.view(B, 1, T, 1), new, ring.gather(2, index))
    ring.scatter_(2, index, kept)


def ring_attention(h: torch.Tensor, in_proj: torch.Tensor, out_proj: torch.Tensor, num_heads: int,
                   ring_k: torch.Tensor, ring_v: torch.Tensor, tables: TorchStepTables) -> torch.Tensor:
    """Fused-projection self-attention over one layer's ring [B, H, C, D]; writes this step's k, v into it.

    h [B, T, dim] -> [B, T, dim]. in_proj [3*dim, dim] splits as `b t (p h d) -> p b h t d`.
    A query that sees no slot (an inactive row that never wrote, or the tick after
    reset_slot + bump_slot_start) gets 0, as SDPA returns for an all-False mask row.
    The writes follow `tables.write_mask` (the step's active rows, positions not recycled away).
    """
    B, T, dim = h.shape
    q, k, v = F.linear(h, in_proj).view(B, T, 3, num_heads, dim // num_heads).permute(2, 0, 3, 1, 4)
    q = apply_rope(q, tables.cos, tables.sin)
    k = apply_rope(k, tables.cos, tables.sin)
    ring_write(ring_k, tables.write_index, k, tables.write_mask)
    ring_write(ring_v, tables.write_index, v, tables.write_mask)
    out = F.scaled_dot_product_attention(q, ring_k, ring_v, tables.mask)  # [B, H, T, D]
    return F.linear(out.transpose(1, 2).reshape(B, T, dim), out_proj)


def temporal_layer(c: TemporalConfig, w: dict, carry, layer: int, tables: TorchStepTables, active):
    """Helium layer. w: this layer's in_proj, out_proj, linear_in, linear_out, norm1/2_alpha;
    active bool [B] is carried by `tables.write_mask`."""
    del active
    x, ring_k, ring_v = carry
    h = rms_norm_f32(x, w["norm1_alpha"], c.norm_eps)
    x = x + ring_attention(h, w["in_proj"], w["out_proj"], c.num_heads, ring_k[layer], ring_v[layer], tables)
    h = rms_norm_f32(x, w["norm2_alpha"], c.norm_eps)
    B, T, _ = h.shape
    gate_in = F.linear(h, w["linear_in"]).view(B, T, 2, -1)  # chunk(2) along the last dim
    return x + F.linear(F.silu(gate_in[..., 0, :]) * gate_in[..., 1, :], w["linear_out"]), ring_k, ring_v


def mimi_layer(c: MimiConfig, w: dict, carry, layer: int, tables: TorchStepTables, active):
    """Mimi layer. w: in_proj, out_proj, linear1, linear2, norm1/2_weight/bias, scale1/2."""
    del active
    x, ring_k, ring_v = carry
    dim = (x.shape[-1],)
    h = F.layer_norm(x, dim, w["norm1_weight"], w["norm1_bias"], c.norm_eps)
    x = x + w["scale1"] * ring_attention(h, w["in_proj"], w["out_proj"], c.num_heads, ring_k[layer], ring_v[layer],
                                         tables)
    h = F.layer_norm(x, dim, w["norm2_weight"], w["norm2_bias"], c.norm_eps)
    return x + w["scale2"] * F.linear(F.gelu(F.linear(h, w["linear1"])), w["linear2"]), ring_k, ring_v


def triton_twins() -> tuple[TwinKernels, bool]:
    """(the Triton twins as the twin layer programs call them, whether they run compiled, not
    interpreted). Imports triton: called only for kernels="twin"."""
    from kernels_triton import twin_attention, twin_linear, twin_math, twin_norm

    kernels = TwinKernels(twin_linear.linear, twin_linear.linear_rope_write, twin_attention.attention,
                          twin_norm.norm, twin_norm.split)
    return kernels, not twin_math.interpreting(twin_math.mma)


def check_triton_device(device, who: str) -> None:
    """RuntimeError naming TRITON_INTERPRET=1 where the Triton twins cannot run on `device` (the CPU
    with Triton compiling: `kernels_triton.twin_math.check_device`); every torch twin module calls it
    where its device is decided (construction, conversions). Imports triton: kernels="twin" only."""
    from kernels_triton.twin_math import check_device

    check_device(device, who)
