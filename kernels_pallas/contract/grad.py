"""The twin gradients' contract: the backward passes of the twin linears and norms (the split
RMSNorm's included), and the plan of their kernels (`GradBlocks`). Both packages' `twin_grad` kernels and the derivative rules of
`twin_linear.linear` and `twin_norm.norm` (JAX `custom_vjp`, torch `autograd.Function`) follow it,
so `jax.grad` through the Pallas twins and torch autograd through the Triton twins give the same
bits. Every operation is the forward contract's (`numerics`): float32, each product rounded on its
own, sums over an axis in the lanes-then-tree order; roundings to a 16-bit dtype are treated as the
identity by the derivative (straight through).

The linear, y = epilogue(norm(x) @ w[layer].T) (`twin_linear`), given dy [M, N_out] in x's dtype:

1. The forward's x and weights are kept; norm(x) (the norm kernel: the fused norm's bits) and,
   where the epilogue needs it (an activation or a layer scale), the projection before the
   epilogue, pre = to_dtype(norm(x) @ w[layer].T) [M, N] (the twin linear with no epilogue: the
   bits the fused epilogue starts from), are computed again in the backward.
2. The epilogue's derivative, elementwise (`twin_grad.epilogue_grad`), g = dy in float32:
       residual:  d_residual = dy (as it is)
       scale s:   ts = g * y0 (float32 [M, N_out], y0 the epilogue's value before the scale);  g = s * g
       gelu:      g = g * (Phi(p) + p * phi(p)),  p = pre, Phi(p) = 0.5 * (1 + erf(p * SQRT1_2)),
                  phi(p) = exp((p * p) * -0.5) * INV_SQRT_2PI
       silu_gate: a, b = pre's halves; e = exp(-a), d = 1 + e, sig = 1 / d:
                  da = (g * b) * (sig * (1 + a * (1 - sig))),  db = g * to_dtype(a / d)
   dpre = to_dtype(g) [M, N] (both halves for the gate).
3. d_scale = `batch_sum`(ts), the layer's row; d_norm(x) = linear(dpre, w[layer]^T) and
   d_w[layer] = linear(dpre^T, norm(x)^T): the twin linear itself on transposed operands (a
   transpose is exact), in its form of those shapes (`contract.linear.twin_linear_form`). The sum of
   d_w over the M rows is therefore the contract's sum over K with K = M: twin_lanes(M) lanes, each
   over its blocks of rows in increasing order, then the tree; a fixed function of M.
4. With a fused norm, its derivative (below) of d_norm(x).

The norm of a row x [D] (`twin_norm`; its derivative `twin_norm.norm_grad`), given dy [D], g = dy * w (float32; S: the contract's sum
over D; r, mean: the forward's statistics, computed again):
       rms:   c = (S(g * x) * inv_D) * ((r * r) * r);  dx = to_dtype(g * r - x * c);  tw = dy * (x * r)
       layer: xhat = (x - mean) * r;  mg = S(g) * inv_D;  mgx = S(g * xhat) * inv_D
              dx = to_dtype(r * ((g - mg) - xhat * mgx));  tw = dy * xhat
   d_weight = batch_sum(tw), d_bias = batch_sum(dy) (layer), in the weights' dtype.

`batch_sum` of t [M, N] (float32 or 16-bit): each column's float32 sum over the rows from +0 in
increasing row order, rounded once to the weights' dtype: on both sides the same additions in the
same order. A stacked weight's cotangent is that layer's row or matrix in an [L, ...] of zeros: one
[L, ...] buffer a call, which a layer loop's transpose (JAX) or autograd (torch) adds into the
weights' accumulated cotangent. Chosen for correctness: the custom_vjp / autograd.Function of one
call cannot write into the loop's accumulator; doing so needs a rule for the whole layer loop.

The split RMSNorm (`contract.norm.TwinSplit`): its derivative is the RMSNorm's, split as its forward
is, in two kernels of `twin_norm` (each output's cotangent exact up to the roundings, so either half
composes with anything that uses u or ss):

5. The consumer (`linear(u, w, rms=TwinRms(ss, eps))`, `linear_rope_write(rms=)`): pre, where the
   epilogue needs it, is the consumer itself without the epilogue (its sums scaled by r, rounded: the
   bits the fused epilogue starts from); dxn = linear(dpre, w[layer]^T), the cotangent of the scaled
   operand r * u; then `split_rms_grad`, per row, with r = 1 / sqrt(eps + tree_sum(ss) * inv_K) (the
   forward's r, from the same ss in the same order; not `norm_grad` on the producer's y: its S(y * y)
   adds BK = twin_lanes(K) lanes over the blocks, ss groups of TWIN_SPLIT_GROUP columns then the groups'
   tree, another order, another r):
       xn = to_dtype(u * r)  (the operand for d_w = linear(dpre^T, xn^T));  du = to_dtype(dxn * r)
       c = (S(dxn * u) * inv_K) * ((r * r) * r);  dss[g] = c * -0.5 for every group g
6. The producer (`linear(..., split=TwinSplit(alpha, offset))`, `norm.split`), given the cotangents
   dy, du, dss of (y, u, ss) and its output y (kept from the forward): `split_grad`, elementwise,
       dy' = to_dtype(dy + (du * a + (y + y) * dss[g]))  (a = alpha's row, g the column's group)
       ta = du * y (float32; d_alpha = batch_sum(ta), alpha's row min(layer + offset, L' - 1))
   then steps 2-4 with dy'. Composed, 5 and 6 give the RMSNorm's dx = g * r - x * c of y (g = dxn * a).

`linear_rope_write`'s one-kernel form differentiates as the two calls it fuses: `twin_rope.rope_write_bwd`,
then steps 1-5 (no epilogue: no pre). Integer arguments (the layer index) have no cotangent.

First derivatives only: the backward kernels have no derivative of their own. A torch backward with
create_graph=True (the way to a second derivative, which would otherwise come out zero) raises
NotImplementedError naming the twin (`kernels_triton.twin_grad.first_order`); differentiating a JAX
backward fails, with NotImplementedError naming the twin where its custom_vjp's backward is wrapped
in `twin_grad.first_order`. The references (`*_native`) differentiate twice. The backward kernels
take the forwards' dtypes (`numerics.check_twin_dtype`: a float64 would be narrowed, an integer cast).

Standard library only.
"""

from __future__ import annotations

import dataclasses

from kernels_pallas.contract import numerics
from kernels_pallas.contract.numerics import largest_pow2_divisor, next_pow2

INV_SQRT_2PI = 0.398942280401432678  # 1 / sqrt(2 pi), the normal density's constant (gelu's derivative)
GRAD_MAX_BN = 1024  # columns a program of the elementwise backward kernels (speed only)
GRAD_MAX_BM = 8     # rows a program of the elementwise backward kernels, compiled (speed only)


@dataclasses.dataclass(frozen=True)
class GradBlocks:
    """The tiles of the elementwise backward kernels and `batch_sum` (speed only: every element is
    computed on its own, and batch_sum's order is over the rows whatever the tiles)."""

    block_m: int
    block_n: int

    @classmethod
    def for_shapes(cls, M: int, N: int, interpreted: bool) -> GradBlocks:
        """The plan over an [M, N] array: a power of two dividing N columns, BM rows (interpreted: as
        many as the forward's interpreted programs hold, fewer programs)."""
        max_bm = numerics.TWIN_INTERPRET_MAX_BM if interpreted else GRAD_MAX_BM
        return cls(min(max_bm, next_pow2(M)), largest_pow2_divisor(N, GRAD_MAX_BN))

