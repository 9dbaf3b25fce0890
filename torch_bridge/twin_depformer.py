"""The depformer's float operations on the Triton twin kernels (`Depformer(kernels="twin")`): the same
kernels, in the same order, as `jax_impl.depformer`'s twin path on the Pallas twins, so the torch and
JAX depformers give the same bits (codes and logits), whatever the batch (`kernels_pallas.twin_math`).

Per layer (x [B, dim]): RMSNorm -> qkv projection -> K/V write into the frame's cache (a copy) ->
attention over the cache -> out-projection + residual -> RMSNorm -> gated in-projection (silu) ->
down-projection + residual. The cache [L, B, H, dep_q, head_dim] is the twin attention's ring: slot
c holds position c and the step's query sits at position `step`, so slots 0..step are visible
(causal over the inner steps, no positional embedding). A step's weight set s of layer i is read in
place at index `i * weight_sets + s` of the per-set buffers viewed as `[L * weight_sets, N, K]`.
Imported on first use: `import torch_bridge` does not import triton.
"""

from __future__ import annotations

import torch

from jax_impl.depformer_config import DepformerConfig
from kernels_triton import twin_attention, twin_linear, twin_norm


def per_set(w: torch.Tensor, cfg: DepformerConfig) -> torch.Tensor:
    """A per-set buffer [L, weight_sets, N, K] as the twin linears' stack [L * weight_sets, N, K] (a view)."""
    return w.view(cfg.num_layers * cfg.weight_sets, *w.shape[2:])


def step_input(depformer_in: torch.Tensor, s: int, x_in: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
    """depformer_in[s](x_in) + token_emb (the residual epilogue): x_in [B, temporal_dim], token_emb [B, dim]
    -> [B, dim]."""
    return twin_linear.linear(x_in, depformer_in, s, residual=token_emb)


def layer(cfg: DepformerConfig, w: dict, x: torch.Tensor, i: int, s: int, step: int, cache_k: torch.Tensor,
          cache_v: torch.Tensor) -> torch.Tensor:
    """Layer i at inner step `step` with weight set s: x [B, dim] -> [B, dim]; writes the cache's slot `step`."""
    B = x.shape[0]
    H, D, eps = cfg.num_heads, cfg.head_dim, cfg.norm_eps
    at = i * cfg.weight_sets + s
    h = twin_norm.norm(x, w["norm1_alpha"], None, i, kind="rms", eps=eps)
    qkv = twin_linear.linear(h, per_set(w["in_proj"], cfg), at).view(B, 3, H, D)
    cache_k[i, :, :, step] = qkv[:, 1]
    cache_v[i, :, :, step] = qkv[:, 2]
    positions = torch.arange(cfg.dep_q, dtype=torch.int32, device=x.device).expand(B, cfg.dep_q)
    q_pos = torch.full((B, 1), step, dtype=torch.int32, device=x.device)
    att = twin_attention.attention(qkv[:, 0, :, None].contiguous(), cache_k, cache_v, i, positions, q_pos,
                                   context=cfg.dep_q)
    x = twin_linear.linear(att.view(B, cfg.dim), per_set(w["out_proj"], cfg), at, residual=x)
    h = twin_norm.norm(x, w["norm2_alpha"], None, i, kind="rms", eps=eps)
    gated = twin_linear.linear(h, per_set(w["linear_in"], cfg), at, act="silu_gate")
    return twin_linear.linear(gated, per_set(w["linear_out"], cfg), at, residual=x)


def head(linears: torch.Tensor, s: int, x: torch.Tensor) -> torch.Tensor:
    """The step's logits linears[s](x) in x's dtype: x [B, dim] -> [B, card]."""
    return twin_linear.linear(x, linears, s)
