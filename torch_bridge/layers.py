"""One layer of each stack, as plain functions of (x, that layer's weights, its ring, tables).

Shapes: x [B, T, dim]; ring_k, ring_v [B, H, C, D]; tables: `ring.StepTables`.
The order of operations follows Moshi's `StreamingTransformerLayer` op for op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .ring import StepTables, ring_write
from .rope import apply_rope


def rms_norm_f32(x: torch.Tensor, alpha: torch.Tensor, eps: float) -> torch.Tensor:
    """Moshi's `rms_norm_f32`: in float32, var = eps + mean(x^2), y = x * (alpha * rsqrt(var))."""
    x_dtype = x.dtype
    x = x.float()
    var = eps + torch.mean(x**2, dim=2, keepdim=True)
    return (x * (alpha.to(var) * torch.rsqrt(var))).to(x_dtype)


def ring_attention(h: torch.Tensor, in_proj: torch.Tensor, out_proj: torch.Tensor, num_heads: int,
                   ring_k: torch.Tensor, ring_v: torch.Tensor, tables: StepTables,
                   active: torch.Tensor) -> torch.Tensor:
    """Fused-projection self-attention over the ring; writes this step's k, v into it.

    h [B, T, dim] -> [B, T, dim]. in_proj [3*dim, dim] splits as `b t (p h d) -> p b h t d`.
    A query that sees no slot (an inactive row that never wrote, or the tick after
    reset_slot + bump_slot_start) gets 0, as SDPA returns for an all-False mask row.
    active bool [B]: the step's active rows; the writes follow `tables.write_mask`, which holds it.
    """
    B, T, dim = h.shape
    q, k, v = F.linear(h, in_proj).view(B, T, 3, num_heads, dim // num_heads).permute(2, 0, 3, 1, 4)
    q = apply_rope(q, tables.cos, tables.sin)
    k = apply_rope(k, tables.cos, tables.sin)
    ring_write(ring_k, tables.write_index, k, tables.write_mask)
    ring_write(ring_v, tables.write_index, v, tables.write_mask)
    out = F.scaled_dot_product_attention(q, ring_k, ring_v, tables.mask)  # [B, H, T, D]
    return F.linear(out.transpose(1, 2).reshape(B, T, dim), out_proj)


def temporal_layer(x, w: dict, num_heads: int, eps: float, ring_k, ring_v, tables, active):
    """Helium layer. w: this layer's in_proj, out_proj, linear_in, linear_out, norm1/2_alpha."""
    h = rms_norm_f32(x, w["norm1_alpha"], eps)
    x = x + ring_attention(h, w["in_proj"], w["out_proj"], num_heads, ring_k, ring_v, tables, active)
    h = rms_norm_f32(x, w["norm2_alpha"], eps)
    B, T, _ = h.shape
    gate_in = F.linear(h, w["linear_in"]).view(B, T, 2, -1)  # chunk(2) along the last dim
    return x + F.linear(F.silu(gate_in[..., 0, :]) * gate_in[..., 1, :], w["linear_out"])


def mimi_layer(x, w: dict, num_heads: int, eps: float, ring_k, ring_v, tables, active):
    """Mimi layer. w: in_proj, out_proj, linear1, linear2, norm1/2_weight/bias, scale1/2."""
    dim = (x.shape[-1],)
    h = F.layer_norm(x, dim, w["norm1_weight"], w["norm1_bias"], eps)
    x = x + w["scale1"] * ring_attention(h, w["in_proj"], w["out_proj"], num_heads, ring_k, ring_v, tables, active)
    h = F.layer_norm(x, dim, w["norm2_weight"], w["norm2_bias"], eps)
    return x + w["scale2"] * F.linear(F.gelu(F.linear(h, w["linear1"])), w["linear2"])
