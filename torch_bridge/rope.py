"""Rotary embedding, GPT-J (interleaved) pairs, as Moshi's `apply_rope(interleave=True)`.

The tables are built once per step (`rope_tables`) and applied in every layer (`apply_rope`).
The arithmetic follows `moshi/modules/rope.py` op for op, so results are bit-identical to it.
"""

from __future__ import annotations

import math

import torch


def rope_freqs(head_dim: int, max_period: float, device=None) -> torch.Tensor:
    """float32 [head_dim // 2]: freq_i = exp(i * (-ln(max_period) * 2 / head_dim)), torch's expf."""
    ds = torch.arange(head_dim // 2, device=device, dtype=torch.float32)
    return torch.exp(ds * (-math.log(max_period) * 2 / head_dim))


def rope_tables(offset: torch.Tensor, T: int, head_dim: int, max_period: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables for positions `offset[b] + t`.

    offset: int64 [B]. Returns two float32 tensors [B, 1, T, head_dim // 2],
    angle = freq_i * (offset[b] + t) with `rope_freqs`.
    """
    B = offset.shape[0]
    freqs = rope_freqs(head_dim, max_period, offset.device)
    ts = offset.float().view(-1, 1) + torch.arange(T, device=offset.device, dtype=torch.float32)
    angles = freqs * ts.view(B, 1, T, 1)
    return torch.cos(angles), torch.sin(angles)


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
