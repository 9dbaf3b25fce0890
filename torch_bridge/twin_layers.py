"""The layers of both stacks on the Triton twin kernels (`kernels="twin"`): the same kernels, in the
same order, as `jax_impl.model`'s twin layers on the Pallas twins, so the two paths give the same
bits, on the GPU and on the CPU, whatever the batch (see `kernels_pallas.twin_math`).

Same signatures as `layers.temporal_layer` / `layers.mimi_layer`: x [B, T, dim]; w: this layer's
weights (views into the stacked buffers: no copy); ring_k, ring_v [B, H, C, D] (views of the
stacked ring, written in place); tables: `ring.StepTables` with the twin RoPE tables. Per layer:

    temporal: rms norm + qkv + rotate + ring write -> attention -> out-proj + residual
              -> rms norm + gated in-proj (silu) -> out-proj + residual
    mimi:     layer norm + qkv + rotate + ring write -> attention -> out-proj * scale1 + residual
              -> layer norm + linear1 (gelu) -> linear2 * scale2 + residual

(a "+" joins what one twin call does, `kernels_pallas.twin_linear`: each norm is passed to the
projection after it, which fuses it (the lane form, up to 4 rows a program) or runs the norm kernel
first (the MMA form: the GPU's for 16-bit weights); the qkv projection, rotation and ring write are
one kernel in the MMA form, a linear then `rope_write` in the lane form; the same bits either way.)

Where `contract.linear.twin_split_norm` says (Helium on the GPU), the temporal layer's RMSNorms run split
(`contract.norm.TwinSplit`), as the JAX layer runs them: the out-projection makes the second norm's u and
ss, the down-projection the next layer's first (from w["following_norm1_alpha"], which the stack
adds), and the layer hands (x, u, ss) to the next; the first layer splits its x itself.
"""

from __future__ import annotations

import torch

from kernels_pallas.contract.attention import twin_sems_size
from kernels_pallas.contract.linear import stack_one_layer, twin_split_norm
from kernels_pallas.contract.norm import TwinNorm, TwinRms, TwinSplit
from kernels_triton import twin_attention, twin_linear, twin_norm, twin_rope
from kernels_triton.twin_math import interpreting

from .ring import StepTables


def _attention(x2, norm: TwinNorm | None, w, ring_k, ring_v, tables: StepTables, B: int, T: int, context: int,
               rms: TwinRms | None = None):
    """norm (or rms: x2 is the split norm's u), qkv + rotate + write, attention: x2 [B*T, dim] ->
    attention output [B*T, dim]."""
    dim = x2.shape[1]
    w_in, _, norm, layer = stack_one_layer(w["in_proj"], None, norm, None)  # one-layer stacks, as the rings
    q, _, _ = twin_linear.linear_rope_write(x2, w_in, layer, tables.cos[:, 0].contiguous(),
                                            tables.sin[:, 0].contiguous(), ring_k[None], ring_v[None],
                                            tables.write_index, tables.write_mask, norm=norm, rms=rms)
    a, _ = twin_attention.attention(q, ring_k[None], ring_v[None], 0, tables.positions, tables.q_pos,
                                    context=context, sems=tables.sems)
    return a.view(B * T, dim)


def split_norms(dim: int, dtype) -> bool:
    """Whether the twin temporal layers run their norms split here (`contract.linear.twin_split_norm`)."""
    return twin_split_norm(dim, dtype, compiled=not interpreting(twin_linear._mma_kernel))


def temporal_layer(x, w: dict, num_heads: int, eps: float, ring_k, ring_v, tables, active, *, context: int):
    """Helium layer on the twins (module docstring); `active` is carried by `tables.write_mask`, the
    head count by the rings' shape. x: [B, T, dim], or (x, u, ss) from the layer before where the
    norms run split (then so is the result)."""
    del num_heads, active
    x, *split = x if isinstance(x, tuple) else (x,)
    B, T, dim = x.shape
    x2 = x.reshape(B * T, dim)
    if not split and split_norms(dim, x.dtype):  # the first layer
        split = twin_norm.split(x2, w["norm1_alpha"])
    if split:
        u, ss = split
        a = _attention(u, None, w, ring_k, ring_v, tables, B, T, context, rms=TwinRms(ss, eps))
        x2, u, ss = twin_linear.linear(a, w["out_proj"], residual=x2, split=TwinSplit(w["norm2_alpha"]))
        g = twin_linear.linear(u, w["linear_in"], act="silu_gate", rms=TwinRms(ss, eps))
        x2, u, ss = twin_linear.linear(g, w["linear_out"], residual=x2,
                                       split=TwinSplit(w["following_norm1_alpha"]))
        return x2.view(B, T, dim), u, ss
    a = _attention(x2, TwinNorm("rms", w["norm1_alpha"], None, eps), w, ring_k, ring_v, tables, B, T, context)
    x2 = twin_linear.linear(a, w["out_proj"], residual=x2)
    u = twin_linear.linear(x2, w["linear_in"], act="silu_gate", norm=TwinNorm("rms", w["norm2_alpha"], None, eps))
    return twin_linear.linear(u, w["linear_out"], residual=x2).view(B, T, dim)


def mimi_layer(x, w: dict, num_heads: int, eps: float, ring_k, ring_v, tables, active, *, context: int):
    """Mimi layer on the twins (module docstring)."""
    del num_heads, active
    B, T, dim = x.shape
    x2 = x.reshape(B * T, dim)
    a = _attention(x2, TwinNorm("layer", w["norm1_weight"], w["norm1_bias"], eps), w, ring_k, ring_v, tables, B, T,
                   context)
    x2 = twin_linear.linear(a, w["out_proj"], scale=w["scale1"], residual=x2)
    f = twin_linear.linear(x2, w["linear1"], act="gelu", norm=TwinNorm("layer", w["norm2_weight"], w["norm2_bias"], eps))
    return twin_linear.linear(f, w["linear2"], scale=w["scale2"], residual=x2).view(B, T, dim)


TWIN_LAYERS = {"temporal_layer": temporal_layer, "mimi_layer": mimi_layer}  # reference layer name -> twin


def temporal_head(x, out_norm_alpha, text_linear, eps: float):
    """(out [B, T, dim], text_logits [B, 1, T, text_card]) on the twins; x: the last layer's result."""
    x = x[0] if isinstance(x, tuple) else x  # the split norms' (x, u, ss)
    B, T, dim = x.shape
    out = twin_norm.norm(x.reshape(B * T, dim), out_norm_alpha, kind="rms", eps=eps)
    return out.view(B, T, dim), twin_linear.linear(out, text_linear).view(B, 1, T, -1)


def twin_tables(tables: StepTables, offset: torch.Tensor, T: int, freqs: torch.Tensor, num_heads: int) -> StepTables:
    """`tables` as the twin kernels read them, made once a step: the twin cos, sin [B, 1, T, D/2]
    for positions offset[b] + t, the index tables the kernels take in int32, their index type
    (converted by each layer's kernels, they had cost four small copy kernels a layer on the GPU),
    and the kernels' counters (`sems`, all 0)."""
    cos, sin = twin_rope.tables(offset.to(torch.int32), T, freqs)
    index = {name: getattr(tables, name).to(torch.int32) for name in ("write_index", "positions", "q_pos", "write_mask")}
    sems = torch.zeros(twin_sems_size(offset.shape[0], num_heads, T), dtype=torch.int32, device=offset.device)
    return tables._replace(cos=cos[:, None], sin=sin[:, None], sems=sems, **index)
