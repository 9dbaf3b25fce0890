"""The twin layer programs, written once for both paths (`kernels="twin"`).

The JAX step runs them on the Pallas twins (`kernels_pallas.twin_*`), the torch step on the
Triton twins (`kernels_triton.twin_*`): the same kernel calls in the same order, so the two
steps give the same bits whatever the batch (the contract: `kernels_pallas.contract.numerics`). This
module imports neither framework; each side hands in

    k:       `TwinKernels`, its kernel functions (the two packages' functions share names,
             signatures and bits);
    w:       the weights by name, stacked [L, ...] (the stacks' buffer names and layout), read
             by the kernels in place at `layer` (an int, or traced under `lax.fori_loop`);
    carry:   (x [B, T, dim], ring_k, ring_v [L, B, H, C, D], sems[, u, ss]): sems, the int32
             counters of the kernels that finish in their last program (`attention(sems=)`),
             all 0 between kernels; u, ss: the Helium layer's first RMSNorm, split
             (`contract.norm.TwinSplit`, where `contract.linear.twin_split_norm` says: the MMA form on the GPU),
             made by the layer before (`first_carry` makes the first layer's);
    tables:  the step's tables as the kernels read them: cos, sin float32 [B, 1, T, D/2],
             write_index, write_mask, q_pos [B, T] and positions [B, C] (int32).

Per layer ("+" joins what one twin call does):

    temporal: rms norm + qkv + rotate + ring write -> attention -> out-proj + residual
              -> rms norm + gated in-proj (silu) -> out-proj + residual
    mimi:     layer norm + qkv + rotate + ring write -> attention -> out-proj * scale1 + residual
              -> layer norm + linear1 (gelu) -> linear2 * scale2 + residual

Each norm is passed to the projection after it (`TwinNorm`: fused, or its kernel first: the same
bits); the qkv projection, rotation and ring write are one call (`linear_rope_write`). With the
norms split, the out- and down-projections make the next norms' u and ss in their epilogues (this
layer's second norm, the next layer's first) and the projections after them finish them. Results
come back as values (JAX) or are also written in place (torch: the rings); both sides use the
returned carry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from kernels_pallas.contract.linear import twin_split_norm
from kernels_pallas.contract.norm import TwinNorm, TwinRms, TwinSplit

from .config import MimiConfig, StackConfig, TemporalConfig


class TwinKernels(NamedTuple):
    """One side's twin kernels (`kernels_pallas` or `kernels_triton`, the modules `twin_linear`,
    `twin_attention`, `twin_norm`): the functions the layer programs call."""

    linear: Callable
    linear_rope_write: Callable
    attention: Callable
    norm: Callable
    split: Callable


def _attention(k: TwinKernels, c: StackConfig, w: Mapping[str, Any], x2, layer, ring_k, ring_v, sems, tables,
               norm: TwinNorm | None = None, rms: TwinRms | None = None):
    """norm (or rms: x2 is the split norm's u), qkv + rotate + ring write, attention:
    x2 [B*T, dim] -> ([B*T, dim], ring_k, ring_v, sems)."""
    q, ring_k, ring_v = k.linear_rope_write(x2, w["in_proj"], layer, tables.cos[:, 0], tables.sin[:, 0], ring_k,
                                            ring_v, tables.write_index, tables.write_mask, norm=norm, rms=rms)
    a, sems = k.attention(q, ring_k, ring_v, layer, tables.positions, tables.q_pos, context=c.context, sems=sems)
    return a.reshape(x2.shape[0], c.dim), ring_k, ring_v, sems


def first_carry(k: TwinKernels, c: StackConfig, w: Mapping[str, Any], x, ring_k, ring_v, sems, *,
                compiled: bool) -> tuple:
    """The layer loop's first carry: (x, ring_k, ring_v, sems), and the first layer's split norm
    (u, ss) where the Helium norms run split (`twin_split_norm` of dim, x's dtype and whether the
    kernels run `compiled`, not interpreted)."""
    carry = (x, ring_k, ring_v, sems)
    if isinstance(c, TemporalConfig) and twin_split_norm(c.dim, x.dtype, compiled):
        B, T, dim = x.shape
        carry = (*carry, *k.split(x.reshape(B * T, dim), w["norm1_alpha"], 0))
    return carry


def temporal_layer(k: TwinKernels, c: TemporalConfig, w: Mapping[str, Any], carry: tuple, layer, tables) -> tuple:
    """The Helium layer on the twins: carry -> next carry (module docstring)."""
    x, ring_k, ring_v, sems, *split = carry
    B, T, dim = x.shape
    x2 = x.reshape(B * T, dim)
    if split:
        u, ss = split
        a, ring_k, ring_v, sems = _attention(k, c, w, u, layer, ring_k, ring_v, sems, tables,
                                             rms=TwinRms(ss, c.norm_eps))
        x2, u, ss = k.linear(a, w["out_proj"], layer, residual=x2, split=TwinSplit(w["norm2_alpha"]))
        g = k.linear(u, w["linear_in"], layer, act="silu_gate", rms=TwinRms(ss, c.norm_eps))
        x2, u, ss = k.linear(g, w["linear_out"], layer, residual=x2,
                             split=TwinSplit(w["norm1_alpha"], offset=1))  # the next layer's
        return x2.reshape(B, T, dim), ring_k, ring_v, sems, u, ss
    norm1 = TwinNorm("rms", w["norm1_alpha"], None, c.norm_eps)
    a, ring_k, ring_v, sems = _attention(k, c, w, x2, layer, ring_k, ring_v, sems, tables, norm=norm1)
    x2 = k.linear(a, w["out_proj"], layer, residual=x2)
    g = k.linear(x2, w["linear_in"], layer, act="silu_gate", norm=TwinNorm("rms", w["norm2_alpha"], None, c.norm_eps))
    x2 = k.linear(g, w["linear_out"], layer, residual=x2)
    return x2.reshape(B, T, dim), ring_k, ring_v, sems


def mimi_layer(k: TwinKernels, c: MimiConfig, w: Mapping[str, Any], carry: tuple, layer, tables) -> tuple:
    """The Mimi layer on the twins: carry -> next carry (module docstring)."""
    x, ring_k, ring_v, sems = carry
    B, T, dim = x.shape
    x2 = x.reshape(B * T, dim)
    norm1 = TwinNorm("layer", w["norm1_weight"], w["norm1_bias"], c.norm_eps)
    a, ring_k, ring_v, sems = _attention(k, c, w, x2, layer, ring_k, ring_v, sems, tables, norm=norm1)
    x2 = k.linear(a, w["out_proj"], layer, scale=w["scale1"], residual=x2)
    f = k.linear(x2, w["linear1"], layer, act="gelu",
                 norm=TwinNorm("layer", w["norm2_weight"], w["norm2_bias"], c.norm_eps))
    x2 = k.linear(f, w["linear2"], layer, scale=w["scale2"], residual=x2)
    return x2.reshape(B, T, dim), ring_k, ring_v, sems


def layer_program(c: StackConfig) -> Callable:
    """The twin layer program of a stack's config: `temporal_layer` or `mimi_layer`."""
    return temporal_layer if isinstance(c, TemporalConfig) else mimi_layer


def temporal_head(k: TwinKernels, c: TemporalConfig, w: Mapping[str, Any], x) -> tuple:
    """(out [B, T, dim], text_logits [B, 1, T, text_card]) of the last layer's x [B, T, dim], on the
    twins: the output RMSNorm (w["out_norm_alpha"] [dim]) and the text head (w["text_linear"] [V, dim])."""
    B, T, dim = x.shape
    out = k.norm(x.reshape(B * T, dim), w["out_norm_alpha"], kind="rms", eps=c.norm_eps)
    return out.reshape(B, T, dim), k.linear(out, w["text_linear"]).reshape(B, 1, T, -1)
