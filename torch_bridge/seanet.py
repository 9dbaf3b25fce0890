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
    """The float operations of a plan: conv_step(spec, weight, bias, carry, x, active, first, residual)
    -> (y, carry), one streaming convolution or transposed one (`conv_step`). `REFERENCE_OPS`:
    torch's (moshi's bits); `twin_ops()`: the twin kernels' (`kernels_triton.twin_conv`, the JAX
    codec's kernels="twin" bits)."""

    conv_step: Callable


def _transposed_carry(y: torch.Tensor, carry: torch.Tensor, bias: torch.Tensor | None, active: torch.Tensor):
    """A transposed convolution's output with its overlap-add carry: the carry added to y's head;
    (y without its tail, the tail less the bias where active)."""
    width = carry.shape[-1]
    if not width:
        return y, carry
    y[..., :width] += carry
    tail = y[..., -width:]
    if bias is not None:
        tail -= bias[:, None]  # the next frame's head has its own bias
    return y[..., :-width], torch.where(active.view(-1, 1, 1), tail, carry)


def _reference_conv_step(spec: ConvSpec, weight, bias, carry, x, active, first, residual):
    x = F.elu(x, 1.0) if spec.elu else x
    if spec.transposed:
        return _transposed_carry(F.conv_transpose1d(x, weight, bias, spec.stride, groups=spec.groups), carry, bias,
                                 active)
    rows = active.view(-1, 1, 1)
    width = carry.shape[-1]
    if width:
        if spec.replicate:
            carry = torch.where(first.view(-1, 1, 1) & rows, x[..., :1], carry)
        x = torch.cat([carry, x], dim=-1)
        carry = torch.where(rows, x[..., -width:], carry)
    y = F.conv1d(x, weight, bias, spec.stride, 0, spec.dilation, spec.groups)
    return (y if residual is None else residual + y), carry


REFERENCE_OPS = ConvOps(_reference_conv_step)


def twin_ops() -> ConvOps:
    """The twin kernels' ops (imports triton on first use): the ELU, the carry and the taps in one
    kernel (`twin_conv.taps`), then the linear (`jax_impl.codec`'s twin step, kernel for kernel)."""
    from kernels_triton import twin_conv

    def step(spec: ConvSpec, weight, bias, carry, x, active, first, residual):
        if spec.transposed:
            y = twin_conv.conv_transpose1d(x, weight, bias, stride=spec.stride, groups=spec.groups, elu=spec.elu)
            return _transposed_carry(y, carry, bias, active)
        options = {"stride": spec.stride, "dilation": spec.dilation, "residual": residual, "elu": spec.elu}
        if not carry.shape[-1]:
            return twin_conv.conv1d(x, weight, bias, **options), carry
        return twin_conv.conv1d(x, weight, bias, carry=carry, active=active, first=first, replicate=spec.replicate,
                                **options)

    return ConvOps(step)


def conv_carries(plan: Sequence[PlanItem], batch_size: int, dtype, device) -> list[torch.Tensor]:
    """The fresh carries of a plan: zeros [B, carry_channels, carry] per convolution (width 0: none)."""
    return [torch.zeros(batch_size, c.carry_channels, c.carry, dtype=dtype, device=device)
            for c in plan_convs(plan)]


def conv_step(spec: ConvSpec, weight: torch.Tensor, bias: torch.Tensor | None, carry: torch.Tensor,
              x: torch.Tensor, active: torch.Tensor, first: torch.Tensor, ops: ConvOps = REFERENCE_OPS,
              residual: torch.Tensor | None = None):
    """One streaming convolution: (y, new carry). x [B, in, T] with T a multiple of the stride; the
    ELU on x first where `spec.elu`, `residual` added last."""
    return ops.conv_step(spec, weight, bias, carry, x, active, first, residual)


def run_plan(plan: Sequence[PlanItem], weights: Mapping[str, torch.Tensor], carries: Sequence[torch.Tensor],
             x: torch.Tensor, active: torch.Tensor, first: torch.Tensor,
             ops: ConvOps = REFERENCE_OPS) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run a plan's convolutions on one frame: (y, new carries). weights: checkpoint key -> tensor
    (`codec_config.walk_plan`, the walk the JAX codec runs too)."""

    def conv(spec: ConvSpec, h: torch.Tensor, carry: torch.Tensor, residual):
        return conv_step(spec, weights[spec.key + ".weight"], weights.get(spec.key + ".bias"), carry, h, active, first,
                         ops, residual)

    return walk_plan(plan, x, carries, conv)
