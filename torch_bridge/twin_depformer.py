"""The depformer's float operations on the Triton twin kernels (`Depformer(kernels="twin")`): the same
kernels, in the same order, as `jax_impl.depformer`'s twin path on the Pallas twins, so the torch and
JAX depformers give the same bits (codes and logits), whatever the batch (`kernels_pallas.twin_math`).

Per layer (x [B, dim]; "+" joins what one twin call does): RMSNorm + qkv projection + K/V write
into the frame's cache (`linear_rope_write` without rotation) -> attention over the cache ->
out-projection + residual -> RMSNorm + gated in-projection (silu) -> down-projection + residual
(a norm passed to its linear runs fused where the linear's form fuses it, else its kernel first: the
same bits). The cache [L, B, H, dep_q, head_dim] is the twin attention's ring: slot
c holds position c and the step's query sits at position `step`, so slots 0..step are visible
(causal over the inner steps, no positional embedding). A step's weight set s of layer i is read in
place at index `i * weight_sets + s` of the per-set buffers viewed as `[L * weight_sets, N, K]`.
Imported on first use: `import torch_bridge` does not import triton.
"""

from __future__ import annotations

import torch

from jax_impl.depformer_config import DepformerConfig
from kernels_pallas.contract.norm import TwinNorm
from kernels_triton import twin_attention, twin_linear


def per_set(w: torch.Tensor, cfg: DepformerConfig) -> torch.Tensor:
    """A per-set buffer [L, weight_sets, N, K] as the twin linears' stack [L * weight_sets, N, K] (a view)."""
    return w.view(cfg.num_layers * cfg.weight_sets, *w.shape[2:])


def step_input(depformer_in: torch.Tensor, s: int, x_in: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
    """depformer_in[s](x_in) + token_emb (the residual epilogue): x_in [B, temporal_dim], token_emb [B, dim]
    -> [B, dim]."""
    return twin_linear.linear(x_in, depformer_in, s, residual=token_emb)


def frame_tables(cfg: DepformerConfig, w: dict, B: int, device) -> dict:
    """What every layer of a frame reads besides the weights, made once a frame: the RMSNorms'
    alphas repeated per weight set ([L * weight_sets, dim], indexed as the linears' weights: the
    linears' `norm=`), the write slots / query positions of each step (`slots[k]`: [B, 1] int32,
    all k), the write mask (all set) and the cache's positions ([B, dep_q]: slot c holds position c)."""
    ws, i32 = cfg.weight_sets, torch.int32
    norms = [TwinNorm("rms", w[name].repeat_interleave(ws, 0), None, cfg.norm_eps)
             for name in ("norm1_alpha", "norm2_alpha")]
    steps = torch.arange(cfg.dep_q, dtype=i32, device=device)
    return {"norms": norms, "slots": steps[:, None, None].expand(cfg.dep_q, B, 1).contiguous(),
            "written": torch.ones((B, 1), dtype=i32, device=device),
            "positions": steps.expand(B, cfg.dep_q).contiguous()}


def layer(cfg: DepformerConfig, w: dict, tables: dict, x: torch.Tensor, i: int, s: int, step: int,
          cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
    """Layer i at inner step `step` with weight set s: x [B, dim] -> [B, dim]; the qkv projection's
    kernel writes the cache's slot `step` of layer i. tables: `frame_tables`."""
    B = x.shape[0]
    at = i * cfg.weight_sets + s
    norm1, norm2 = tables["norms"]
    slot = tables["slots"][step]
    q, _, _ = twin_linear.linear_rope_write(x, per_set(w["in_proj"], cfg), at, None, None, cache_k, cache_v, slot,
                                            tables["written"], norm=norm1, ring_layer=i)
    att = twin_attention.attention(q, cache_k, cache_v, i, tables["positions"], slot, context=cfg.dep_q)
    x = twin_linear.linear(att.view(B, cfg.dim), per_set(w["out_proj"], cfg), at, residual=x)
    gated = twin_linear.linear(x, per_set(w["linear_in"], cfg), at, act="silu_gate", norm=norm2)
    return twin_linear.linear(gated, per_set(w["linear_out"], cfg), at, residual=x)


def head(linears: torch.Tensor, s: int, x: torch.Tensor) -> torch.Tensor:
    """The step's logits linears[s](x) in x's dtype: x [B, dim] -> [B, card]."""
    return twin_linear.linear(x, linears, s)
