"""The torch stacks' weights in and out: random init, Moshi-layout state dicts and safetensors files.

`StackWeights` is a mixin of `model.StreamingStack` (it reads `self.config`, `self.dtype` and the
stacked weight buffers); the JAX side's counterpart is `jax_impl/weights.py`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch

from jax_impl.checkpoint import (
    CheckpointError,
    WeightSpec,
    check_checkpoint,
    checkpoint_keys,
    read_safetensors,
    read_safetensors_shapes,
    weight_dtype_problem,
    weight_specs,
    write_safetensors,
)
from jax_impl.config import StackConfig


def check_safetensors(path: str | os.PathLike, config: StackConfig,
                      prefix: str | None = None) -> dict[str, tuple[WeightSpec, int | None]]:
    """Check a safetensors file's keys and shapes against a stack (reads the header only).

    Returns file key -> (spec, layer) (`check_checkpoint`); raises `CheckpointError` naming the path.
    """
    return check_checkpoint(read_safetensors_shapes(path), config, prefix, source=os.fspath(path))


def _dtype_name(dtype) -> str:
    """A torch or numpy dtype by its name ("float32", "bfloat16", ...), as `weight_dtype_problem` reads it."""
    return dtype.name if isinstance(dtype, np.dtype) else str(dtype).removeprefix("torch.")


def source_problem(key: str, value, want: torch.dtype) -> str | None:
    """The problem line of one state-dict value that cannot be copied into a buffer of dtype `want`
    (None where it can): not a tensor, a meta or non-dense tensor, a dtype that would narrow."""
    if not isinstance(value, (torch.Tensor, np.ndarray)):
        return f"not a tensor: {key}: {type(value).__name__} (expected a torch.Tensor or a numpy.ndarray)"
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            return f"no data: {key}: a meta tensor"
        if value.layout != torch.strided:
            return f"not dense: {key}: layout {value.layout}"
    return weight_dtype_problem(key, _dtype_name(value.dtype), _dtype_name(want))


def as_tensor(value) -> torch.Tensor:
    """A torch tensor of a checked state-dict value: itself, or an exact copy of a numpy array
    (numpy's ml_dtypes bfloat16 goes through its bits)."""
    if isinstance(value, torch.Tensor):
        return value
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(np.array(value).view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(value))


class ExactLoads:
    """`nn.Module.load_state_dict` held to `load_weights`' rules for this module's own buffers: torch
    would cast a float64 value into a float32 buffer (a narrowing) and, with assign=True, replace a
    buffer by a value of another dtype, shape or device. Refused (`CheckpointError` naming each key)
    before this module's buffers are written (a mixin before `nn.Module`)."""

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args, **kwargs):
        assign = local_metadata.get("assign_to_params_buffers", False)
        lines = []
        for name, buf in self._buffers.items():
            key = prefix + name
            if buf is None or name in self._non_persistent_buffers_set or key not in state_dict:
                continue
            value = state_dict[key]
            line = source_problem(key, value, buf.dtype)
            if line is None and assign and isinstance(value, torch.Tensor) \
                    and (value.dtype, value.shape, value.device) != (buf.dtype, buf.shape, buf.device):
                line = (f"not assignable: {key}: {value.dtype} {list(value.shape)} on {value.device}; the buffer is "
                        f"{buf.dtype} {list(buf.shape)} on {buf.device} (assign=True would keep the value's)")
            if line:
                lines.append(line)
        if lines:
            head = f"load_state_dict: {type(self).__name__} refused its tensors (none of them written):"
            raise CheckpointError("\n".join([head, *("  " + line for line in lines)]), problems=lines)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args, **kwargs)


class StackWeights:
    """The weight methods of a torch stack (mixed into `model.StreamingStack`)."""

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, layer_scale: float = 0.01, generator=None) -> None:
        """Matrices ~ N(0, std); norm scales at 1, norm biases at 0, layer scales at `layer_scale`."""
        for spec in weight_specs(self.config):
            w = getattr(self, spec.name)
            if len(spec.shape) == 2:
                w.copy_(torch.randn(w.shape, generator=generator, device=w.device) * std)
            elif spec.name.endswith("bias"):
                w.zero_()
            elif spec.name.startswith("scale"):
                w.fill_(layer_scale)
            else:
                w.fill_(1.0)

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor | np.ndarray], prefix: str | None = None, *,
                     source: str = "state_dict") -> None:
        """Copy a Moshi-layout state dict into the stacked buffers (in place, same storage).

        Keys: the released files' names or a moshi module's `state_dict()` names (`in_projs.0.weight`,
        `WeightSpec.aliases`). Values: torch tensors or numpy arrays (copied exactly), float32,
        bfloat16 or float16, widened exactly to the stack's dtype (bf16/f16 -> f32), never narrowed.
        All or nothing: keys, shapes, dtypes and devices are checked first, and the sources
        converted (widened, reshaped) into new tensors, before any buffer is written; every
        problem is listed in one `CheckpointError` headed by `source`, and the stack is left as it
        was. The buffers keep their storage (the JAX steppers' DLPack views of them stay valid).
        """
        if not isinstance(state_dict, Mapping):
            raise CheckpointError(f"{source}: expected a mapping key -> tensor, "
                                  f"got {type(state_dict).__name__}")
        problems = {k: line for k, v in state_dict.items() if (line := source_problem(k, v, self.dtype))}
        shapes = {k: (tuple(v.shape) if isinstance(v, (torch.Tensor, np.ndarray)) else None)
                  for k, v in state_dict.items()}
        keys = check_checkpoint(shapes, self.config, prefix, source=source, problems=problems)
        staged = []
        for key, (spec, layer) in keys.items():
            try:
                src = as_tensor(state_dict[key]).to(dtype=self.dtype).reshape(spec.shape)
            except (RuntimeError, TypeError, ValueError) as err:
                raise CheckpointError(f"{source}: {key} cannot be read: {err}") from None
            dst = getattr(self, spec.name)
            staged.append((dst if layer is None else dst[layer], src))
        for dst, src in staged:  # same shapes and dtypes, checked: the only step that writes
            dst.copy_(src)

    def export_weights(self, prefix: str | None = None) -> dict[str, torch.Tensor]:
        """The weights in the Moshi checkpoint layout (contiguous copies)."""
        return {
            key: (getattr(self, spec.name) if layer is None else getattr(self, spec.name)[layer])
            .reshape(spec.ckpt_shape).contiguous().clone()
            for key, (spec, layer) in checkpoint_keys(self.config, prefix).items()
        }

    def load_safetensors(self, path: str | os.PathLike, prefix: str | None = None) -> None:
        """Load a Moshi/PersonaPlex safetensors checkpoint (only this stack's keys are read).

        As `load_weights` (all or nothing); every error is a `CheckpointError` naming the path.
        """
        keys = check_safetensors(path, self.config, prefix)
        tensors = read_safetensors(path, keys, "pt", device="cpu")
        self.load_weights(tensors, prefix, source=os.fspath(path))

    def save_safetensors(self, path: str | os.PathLike, prefix: str | None = None) -> None:
        """Write the weights as a safetensors file in the released checkpoints' layout (`export_weights`:
        their keys and shapes, this stack's dtype), so one file serves both paths: `load_safetensors`
        and the JAX loaders read it back exactly. prefix: a Mimi stack's `encoder_transformer` / ..."""
        write_safetensors(path, self.export_weights(prefix), "pt")
