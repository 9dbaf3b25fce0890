"""The codec's streaming convolutions and SEANet, torch reference, op for op as moshi's `modules/conv.py`.

Functions of explicit state: each returns its new carries and leaves its arguments unwritten, so a
caller commits a whole frame's state at once (or nothing, on an error). Shapes: x [B, C, T];
`active` bool [B]: an inactive row's carry stays as it was (its output is computed and meaningless,
as moshi's `exec_mask` does). A plan is `jax_impl.codec_config.encoder_plan` / `decoder_plan`.

Carries (one per convolution, in `plan_convs` order; a kernel-1 convolution has none):
- convolution: its last `carry` input samples [B, in, carry] (moshi's `previous`); the frame
  is [carry, x] and the convolution runs unpadded. The downsample (`replicate`) fills its carry
  with the row's first sample on the row's first active frame (`first` bool [B], moshi's `first`).
- transposed convolution: the `carry` output samples [B, out, carry] that overlap the next frame
  (moshi's `partial`), kept without the bias: the next frame's output adds them to its own head,
  whose bias is already in it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from jax_impl.codec_config import ConvSpec, PlanItem, plan_convs, walk_plan


class ConvOps(NamedTuple):
    """The float operations of a plan: elu(x); conv(spec, x, weight, bias) for a convolution or a
    transposed one (unpadded, bias added). `REFERENCE_OPS`: torch's (moshi's bits); `twin_ops()`:
    the twin kernels' (`kernels_triton.twin_conv`, the JAX codec's kernels="twin" bits)."""

    elu: Callable
    conv: Callable


def _reference_conv(spec: ConvSpec, x, weight, bias):
    if spec.transposed:
        return F.conv_transpose1d(x, weight, bias, spec.stride, groups=spec.groups)
    return F.conv1d(x, weight, bias, spec.stride, 0, spec.dilation, spec.groups)


REFERENCE_OPS = ConvOps(lambda x: F.elu(x, 1.0), _reference_conv)


def twin_ops() -> ConvOps:
    """The twin kernels' ops (imports triton on first use)."""
    from kernels_triton import twin_conv

    def conv(spec: ConvSpec, x, weight, bias):
        if spec.transposed:
            return twin_conv.conv_transpose1d(x, weight, bias, stride=spec.stride, groups=spec.groups)
        return twin_conv.conv1d(x, weight, bias, stride=spec.stride, dilation=spec.dilation)

    return ConvOps(twin_conv.elu, conv)


def conv_carries(plan: Sequence[PlanItem], batch_size: int, dtype, device) -> list[torch.Tensor]:
    """The fresh carries of a plan: zeros [B, carry_channels, carry] per convolution (width 0: none)."""
    return [torch.zeros(batch_size, c.carry_channels, c.carry, dtype=dtype, device=device)
            for c in plan_convs(plan)]


def conv_step(spec: ConvSpec, weight: torch.Tensor, bias: torch.Tensor | None, carry: torch.Tensor,
              x: torch.Tensor, active: torch.Tensor, first: torch.Tensor, ops: ConvOps = REFERENCE_OPS):
    """One streaming convolution: (y, new carry). x [B, in, T] with T a multiple of the stride."""
    rows = active.view(-1, 1, 1)
    if spec.transposed:
        y = ops.conv(spec, x, weight, bias)
        width = carry.shape[-1]
        if not width:
            return y, carry
        y[..., :width] += carry
        tail = y[..., -width:]
        if bias is not None:
            tail -= bias[:, None]  # the next frame's head has its own bias
        return y[..., :-width], torch.where(rows, tail, carry)
    if carry.shape[-1]:
        if spec.replicate:
            carry = torch.where(first.view(-1, 1, 1) & rows, x[..., :1], carry)
        x = torch.cat([carry, x], dim=-1)
    y = ops.conv(spec, x, weight, bias)
    if not carry.shape[-1]:
        return y, carry
    return y, torch.where(rows, x[..., -carry.shape[-1]:], carry)


def run_plan(plan: Sequence[PlanItem], weights: Mapping[str, torch.Tensor], carries: Sequence[torch.Tensor],
             x: torch.Tensor, active: torch.Tensor, first: torch.Tensor,
             ops: ConvOps = REFERENCE_OPS) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run a plan's convolutions on one frame: (y, new carries). weights: checkpoint key -> tensor
    (`codec_config.walk_plan`, the walk the JAX codec runs too)."""

    def conv(spec: ConvSpec, h: torch.Tensor, carry: torch.Tensor):
        return conv_step(spec, weights[spec.key + ".weight"], weights.get(spec.key + ".bias"), carry, h, active, first,
                         ops)

    return walk_plan(plan, x, carries, conv, ops.elu)
