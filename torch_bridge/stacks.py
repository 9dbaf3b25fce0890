"""The two streaming stacks of the PyTorch path: `TemporalStreaming` (Helium) and `MimiTransformer`.

Weights are stored stacked per kind (`in_proj [L, 3*dim, dim]`, `norm1_alpha [L, dim]`, ...),
one buffer per kind, so the JAX side can view these very buffers through DLPack.
Each `step()` builds the RoPE tables, write indexes, positions and mask once (`StepTables`)
and every layer uses them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn

from jax_impl.config import (
    MimiConfig,
    StackConfig,
    TemporalConfig,
    check_checkpoint,
    checkpoint_keys,
    weight_specs,
)

from .layers import mimi_layer, rms_norm_f32, temporal_layer
from .ring import StepTables, build_step_tables
from .rope import rope_freqs
from .streaming import StreamState

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Loading a checkpoint may widen (exactly), never narrow.
_LOSSLESS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}


def check_safetensors(path: str | os.PathLike, config: StackConfig, prefix: str | None = None) -> None:
    """Check a safetensors file's keys and shapes against a stack (reads the header only)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (a safe_open handle)
    except SafetensorError as err:
        raise ValueError(f"{os.fspath(path)} is not a readable safetensors file: {err}") from None
    check_checkpoint(shapes, config, prefix)


class _StreamingStack(nn.Module):
    """Shared machinery: stacked weights, streaming state, validation, checkpoint I/O."""

    def __init__(self, config: StackConfig, dtype, device, layer_fn: Callable):
        super().__init__()
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        self.config = config
        self._layer_fn = layer_fn
        self._state: StreamState | None = None
        for spec in weight_specs(config):
            shape = spec.stacked_shape(config.num_layers)
            self.register_buffer(spec.name, torch.empty(shape, dtype=dtype, device=device))
        self.init_weights()

    # ----------------------------------------------------------------------------- weights
    @property
    def dtype(self) -> torch.dtype:
        return self.in_proj.dtype

    @property
    def device(self) -> torch.device:
        return self.in_proj.device

    def weights(self) -> dict[str, torch.Tensor]:
        """The stacked weight buffers by name (the tensors themselves, not copies)."""
        return {spec.name: getattr(self, spec.name) for spec in weight_specs(self.config)}

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

    def _layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        return {s.name: getattr(self, s.name)[layer] for s in weight_specs(self.config) if s.per_layer}

    @torch.no_grad()
    def load_weights(self, state_dict: dict[str, torch.Tensor], prefix: str | None = None) -> None:
        """Copy a Moshi-layout state dict into the stacked buffers (in place, same storage).

        Missing, unexpected (under the stack's prefix) or mis-shaped keys raise one
        `CheckpointError` listing all of them; nothing is copied then. A dtype is widened
        exactly (bf16/f16 -> f32); a narrowing cast is refused.
        """
        check_checkpoint({k: tuple(v.shape) for k, v in state_dict.items()}, self.config, prefix)
        keys = checkpoint_keys(self.config, prefix)
        for key in keys:
            src = state_dict[key]
            if src.dtype != self.dtype and (src.dtype, self.dtype) not in _LOSSLESS:
                raise TypeError(f"state_dict[{key!r}] has dtype {src.dtype}; this stack holds {self.dtype} "
                                f"and a narrowing cast is refused: build the stack with dtype={src.dtype}")
        for key, (spec, layer) in keys.items():
            dst = getattr(self, spec.name)
            dst = dst if layer is None else dst[layer]
            dst.copy_(state_dict[key].reshape(spec.shape))

    def export_weights(self, prefix: str | None = None) -> dict[str, torch.Tensor]:
        """The weights in the Moshi checkpoint layout (contiguous copies)."""
        return {
            key: (getattr(self, spec.name) if layer is None else getattr(self, spec.name)[layer])
            .reshape(spec.ckpt_shape).contiguous().clone()
            for key, (spec, layer) in checkpoint_keys(self.config, prefix).items()
        }

    def load_safetensors(self, path: str | os.PathLike, prefix: str | None = None) -> None:
        """Load a Moshi/PersonaPlex safetensors checkpoint (only this stack's keys are read)."""
        from safetensors import safe_open

        check_safetensors(path, self.config, prefix)
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in checkpoint_keys(self.config, prefix)}
        self.load_weights(tensors, prefix)

    def save_safetensors(self, path: str | os.PathLike, prefix: str | None = None) -> None:
        from safetensors.torch import save_file

        save_file(self.export_weights(prefix), os.fspath(path))

    # ----------------------------------------------------------------------------- streaming
    @property
    def state(self) -> StreamState | None:
        """The streaming state (None before `streaming_init`)."""
        return self._state

    def streaming_init(self, batch_size: int) -> None:
        """Allocate a fresh state for `batch_size` rows (zeros, offsets at 0)."""
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        c = self.config
        self._state = StreamState.zeros(c.num_layers, batch_size, c.num_heads, c.capacity, c.head_dim,
                                       self.dtype, self.device)

    def _require_state(self, op: str):
        if self._state is None:
            raise RuntimeError(f"{op}() called before streaming_init(batch_size)")
        return self._state

    def _check_row(self, op: str, b) -> int:
        state = self._require_state(op)
        if not isinstance(b, int) or isinstance(b, bool):
            raise TypeError(f"{op}(b): b must be an int row index, got {type(b).__name__}")
        if not 0 <= b < state.batch_size:
            raise IndexError(f"{op}(b): b={b} is out of range for batch_size {state.batch_size}")
        return b

    def _check_row_mask(self, name: str, mask, state: StreamState) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{name} must be a torch.bool tensor, got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != (state.batch_size,):
            raise ValueError(f"{name} must have shape [{state.batch_size}], got {list(mask.shape)}")
        if mask.device != self.device:
            raise ValueError(f"{name} is on {mask.device}; the stack is on {self.device}")
        return mask

    def _apply(self, op: str, *args) -> None:
        """Run a validated state operation (`StreamState.<op>`); the JAX steppers override this."""
        getattr(self._state, op)(*args)

    def reset_streaming(self) -> None:
        """Every row back to a fresh stream; rings zeroed."""
        self._require_state("reset_streaming")
        self._apply("reset")

    def reset_slot(self, b: int) -> None:
        """Row b forgets all it has written (start_offset[b] = offset[b]); positions keep counting."""
        self._apply("reset_slot", self._check_row("reset_slot", b))

    def bump_slot_start(self, b: int) -> None:
        """Row b forgets its oldest visible position (start_offset[b] += 1, at most offset[b])."""
        self._check_row("bump_slot_start", b)
        start, offset = int(self.state.start_offset[b]), int(self.state.offset[b])
        if start >= offset:
            raise ValueError(f"bump_slot_start(b): row {b} has nothing left to forget "
                             f"(start_offset == offset == {offset})")
        self._apply("bump_slot_start", b)

    def reset_rows(self, mask: torch.Tensor) -> None:
        """Rows where mask [B] is True start a fresh stream (offset and start_offset to 0)."""
        state = self._require_state("reset_rows")
        self._apply("reset_rows", self._check_row_mask("reset_rows(mask)", mask, state))

    # ----------------------------------------------------------------------------- step
    def _check_step_inputs(self, x, active) -> tuple[StreamState, torch.Tensor]:
        state = self._require_state("step")
        c = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"step(x): x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[0] != state.batch_size or x.shape[2] != c.dim:
            raise ValueError(f"step(x): x must have shape [B={state.batch_size}, T, dim={c.dim}], "
                             f"got {list(x.shape)}")
        if not 1 <= x.shape[1] <= c.capacity:
            raise ValueError(f"step(x): T = x.shape[1] must be in 1..capacity={c.capacity}, got {x.shape[1]}")
        if x.dtype != self.dtype:
            raise TypeError(f"step(x): x has dtype {x.dtype}; the stack holds {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"step(x): x is on {x.device}; the stack is on {self.device}")
        if active is None:
            active = torch.ones(state.batch_size, dtype=torch.bool, device=self.device)
        return state, self._check_row_mask("step(active)", active, state)

    def rope_freqs(self) -> tuple[float, ...]:
        """This stack's RoPE frequency table, computed on its device (the JAX path can share it)."""
        return tuple(rope_freqs(self.config.head_dim, self.config.max_period, self.device).tolist())

    def step_tables(self, offset, start_offset, active, T: int) -> StepTables:
        c = self.config
        return build_step_tables(offset, start_offset, active, T, capacity=c.capacity, context=c.context,
                                 head_dim=c.head_dim, max_period=c.max_period, convention=c.ring_convention)

    @torch.no_grad()
    def step(self, x: torch.Tensor, active: torch.Tensor | None = None):
        """One streaming step: x [B, T, dim], active bool [B] (default: all rows).

        The tables are built once and every layer uses them. Inactive rows leave the state as is.
        """
        state, active = self._check_step_inputs(x, active)
        c = self.config
        tables = self.step_tables(state.offset, state.start_offset, active, x.shape[1])
        for layer in range(c.num_layers):
            x = self._layer_fn(x, self._layer_weights(layer), c.num_heads, c.norm_eps,
                               state.k[layer], state.v[layer], tables, active)
        state.offset.copy_(tables.end_offset)
        return self._head(x)

    def _head(self, x: torch.Tensor):
        return x


class TemporalStreaming(_StreamingStack):
    """Helium temporal transformer, stepping T frames (T=1 in PersonaPlex) per call."""

    def __init__(self, dim: int = 4096, num_layers: int = 32, num_heads: int = 32, hidden: int = 11264,
                 context: int = 3000, text_card: int = 32000, max_period: float = 10000.0,
                 ring_convention: str = "personaplex", dtype: torch.dtype = torch.float32, device=None):
        config = TemporalConfig(dim=dim, num_layers=num_layers, num_heads=num_heads, hidden=hidden,
                                context=context, text_card=text_card, max_period=max_period,
                                ring_convention=ring_convention)
        super().__init__(config, dtype, device, temporal_layer)

    @classmethod
    def from_config(cls, config: TemporalConfig, **kwargs) -> TemporalStreaming:
        return cls(dim=config.dim, num_layers=config.num_layers, num_heads=config.num_heads,
                   hidden=config.hidden, context=config.context, text_card=config.text_card,
                   max_period=config.max_period, ring_convention=config.ring_convention, **kwargs)

    def step(self, frame_embedding: torch.Tensor, active: torch.Tensor | None = None):
        """frame_embedding [B, T, dim], active bool [B] ->
        (out [B, T, dim], text_logits [B, 1, T, text_card])."""
        return super().step(frame_embedding, active)

    def _head(self, x: torch.Tensor):
        out = rms_norm_f32(x, self.out_norm_alpha, self.config.norm_eps)
        return out, torch.nn.functional.linear(out, self.text_linear)[:, None]


class MimiTransformer(_StreamingStack):
    """Mimi codec transformer (encoder or decoder), stepping T frames per call."""

    def __init__(self, num_layers: int = 8, dim: int = 512, num_heads: int = 8, context: int = 250,
                 ffn: int = 2048, max_period: float = 10000.0, ring_convention: str = "personaplex",
                 dtype: torch.dtype = torch.float32, device=None):
        config = MimiConfig(num_layers=num_layers, dim=dim, num_heads=num_heads, context=context, ffn=ffn,
                            max_period=max_period, ring_convention=ring_convention)
        super().__init__(config, dtype, device, mimi_layer)

    @classmethod
    def from_config(cls, config: MimiConfig, **kwargs) -> MimiTransformer:
        return cls(num_layers=config.num_layers, dim=config.dim, num_heads=config.num_heads,
                   context=config.context, ffn=config.ffn, max_period=config.max_period,
                   ring_convention=config.ring_convention, **kwargs)
