"""The two streaming stacks of the PyTorch path: `TemporalStreaming` (Helium) and `MimiTransformer`.

Weights in and out: `weights.StackWeights`; snapshots and stream files: `stream_io.StackStreamIO`
(mixins of `StreamingStack`).

Weights are stored stacked per kind (`in_proj [L, 3*dim, dim]`, `norm1_alpha [L, dim]`, ...),
one buffer per kind, so the JAX side can view these very buffers through DLPack.
Each `step()` builds the RoPE tables, write indexes, positions and mask once (`TorchStepTables`)
and every layer uses them: the reference layers (`layers.py`, bit-exact with moshi) or, with
kernels="twin", the twin layer programs (`jax_impl.twin_layers`) on the Triton twins.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from jax_impl import twin_layers
from jax_impl.checkpoint import WIDENINGS, weight_specs
from jax_impl.config import MimiConfig, StackConfig, TemporalConfig, check_batch_size
from jax_impl.kernel_choice import TORCH_KERNELS, check_head_dim, check_kernels
from jax_impl.snapshot import check_bump, check_ring_size, dtype_name, exact_float_cast, row_index
from kernels_pallas.contract.attention import twin_sems_size

from .layers import check_triton_device, mimi_layer, rms_norm_f32, temporal_layer, triton_twins
from .state import TorchStreamState
from .stream_io import StackStreamIO
from .tables import TorchStepTables, build_step_tables, rope_freqs, twin_tables
from .weights import ExactLoads, StackWeights

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The exact widenings (jax_impl.checkpoint.WIDENINGS: bf16/f16 -> f32) as torch dtype pairs.
_LOSSLESS = {(getattr(torch, a), getattr(torch, b)) for a, b in WIDENINGS}


class StreamingStack(StackWeights, StackStreamIO, ExactLoads, nn.Module):
    """Shared machinery: stacked weights, streaming state, validation, checkpoint I/O.

    Threads: a small stack on the CPU (the `-small` presets) steps fastest on one torch thread,
    `torch.set_num_threads(1)`: its step is less work than handing it to a thread per core, and
    beside JAX (whose XLA pool holds the same cores once it has run) the threads wait on each
    other (the torch reference step of temporal-small: 11.5 ms on the default threads, 1.5 ms on
    one, in a user's script). The stack does not set it: it is the whole process's setting.
    """

    def __init__(self, config: StackConfig, dtype, device, layer_fn: Callable, kernels: str = "reference"):
        """layer_fn: the reference layer (`layers.temporal_layer` / `mimi_layer`); kernels: "reference"
        or "twin" (`jax_impl.kernel_choice`: the Triton twins, the bits of the JAX step's "twin")."""
        super().__init__()
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        check_kernels(f"{type(self).__name__}(kernels)", kernels, TORCH_KERNELS)
        check_head_dim(f"{type(self).__name__}(kernels)", config, kernels)
        if kernels == "twin":
            check_triton_device(device, f"{type(self).__name__}(kernels='twin')")
        self.config = config
        self.kernels = kernels
        self._reference_layer = layer_fn
        # (triton's kernels, compiled): imported on first use, as triton is
        self._twins = triton_twins() if kernels == "twin" else None
        self._layer_fn: Callable = self._run_layer  # carry, layer, tables, active -> carry (hooks wrap it)
        self._state: TorchStreamState | None = None
        # (offset_bound, start_bound): host ints bounding the offsets, as jax_impl.Streamer's guard keeps
        # them (`jax_impl.snapshot.check_bump`), so bump_slot_start refuses a wrap without reading the device
        self._bounds = (0, 0)
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

    def _layer_weights(self, layer: int) -> dict[str, torch.Tensor]:
        return {s.name: getattr(self, s.name)[layer] for s in weight_specs(self.config) if s.per_layer}

    # ----------------------------------------------------------------------------- streaming
    @property
    def state(self) -> TorchStreamState | None:
        """The streaming state (None before `streaming_init`)."""
        return self._state

    def _check_batch_size(self, batch_size, op: str | None = None) -> int:
        """batch_size as an int (`check_batch_size`) whose ring is under 2**62 bytes (`check_ring_size`),
        checked before a stream held is released; op: the caller named in a refusal (default
        `<class>.streaming_init`)."""
        op = op or f"{type(self).__name__}.streaming_init"
        batch_size = check_batch_size(op, batch_size)
        check_ring_size(op, self.config, batch_size, self.dtype)
        return batch_size

    def streaming_init(self, batch_size: int) -> None:
        """Allocate a fresh state for `batch_size` rows (zeros, offsets at 0): a Python or numpy integer >= 1.
        A refused batch size (ValueError) leaves the stream held as it was."""
        batch_size = self._check_batch_size(batch_size)
        c = self.config
        self._state = None  # the old rings go before the new ones are allocated (one ring at a time)
        self._state = TorchStreamState.zeros(c.num_layers, batch_size, c.num_heads, c.capacity, c.head_dim,
                                       self.dtype, self.device)
        self._bounds = (0, 0)

    def _require_state(self, op: str):
        if self._state is None:
            raise RuntimeError(f"{op}() called before streaming_init(batch_size)")
        return self._state

    def _check_row(self, op: str, b) -> int:
        return row_index(op, b, self._require_state(op).batch_size)

    def _check_row_mask(self, name: str, mask, state: TorchStreamState) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"{name} must be a torch.bool tensor, got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != (state.batch_size,):
            raise ValueError(f"{name} must have shape [{state.batch_size}], got {list(mask.shape)}")
        if mask.device != self.device:
            raise ValueError(f"{name} is on {mask.device}; the stack is on {self.device}")
        return mask

    def _state_op(self, op: str, *args) -> None:
        """Run a validated state operation (`TorchStreamState.<op>`), keeping the offsets' host bounds:
        a bump that would take start_offset past int64's maximum is refused (OverflowError, nothing
        changed; `check_bump` reads the offsets only where the bounds come near it). The JAX steppers
        override this (their `jax_impl.Streamer` keeps its own guard).

        (Not `_apply`: that name is `nn.Module`'s conversion hook, see `_apply` below.)
        """
        s = self._state
        if op == "bump_slot_start":
            self._bounds = check_bump(op, args[0], self._bounds, lambda: (s.offset.tolist(), s.start_offset.tolist()),
                                      "int64")
        getattr(s, op)(*args)
        if op == "reset":
            self._bounds = (0, 0)

    def reset_streaming(self) -> None:
        """Every row back to a fresh stream; rings zeroed."""
        self._require_state("reset_streaming")
        self._state_op("reset")

    def reset_slot(self, b: int) -> None:
        """Row b forgets all it has written (start_offset[b] = offset[b]); positions keep counting.

        Its ring rows are zeroed, so nothing of the old session stays in a masked slot
        (session isolation, see `state.py`).
        """
        self._state_op("reset_slot", self._check_row("reset_slot", b))

    def bump_slot_start(self, b: int) -> None:
        """Row b forgets its oldest visible position: start_offset[b] += 1, always.

        Right after `reset_slot(b)` (start_offset == offset) it takes start_offset past offset:
        the row's next write is hidden (the "sacrifice tick" that masks the one spurious frame
        following a recycle, as PersonaPlex's stepper does) and that step's queries see nothing
        (zero attention output, as SDPA returns). A bump that would take start_offset past the
        offsets' largest value is refused (OverflowError naming the row, nothing changed), as
        `jax_impl.Streamer` refuses it.
        """
        self._state_op("bump_slot_start", self._check_row("bump_slot_start", b))

    def reset_rows(self, mask: torch.Tensor) -> None:
        """Rows where mask [B] is True start a fresh stream (offset and start_offset to 0, their
        rings zeroed: session isolation)."""
        state = self._require_state("reset_rows")
        self._state_op("reset_rows", self._check_row_mask("reset_rows(mask)", mask, state))

    def streaming_end(self) -> None:
        """Drop the streaming state (back to before `streaming_init`; a no-op when not streaming).

        E.g. to narrow a streaming stack (`.half()`), which is refused while a stream lives.
        """
        self._state = None

    def _is_streaming(self) -> bool:
        return self._state is not None

    # ----------------------------------------------------------------------------- conversions
    def _conversion_target(self, fn) -> torch.Tensor:
        """Check what `nn.Module`'s conversion `fn` would make of this stack, before anything changes.

        `fn` is applied to two empty probes on the stack's device, one of its dtype and one int64
        (the offsets). Refused: a device the stack's Triton twins cannot run on (the CPU without
        TRITON_INTERPRET=1: `layers.check_triton_device`); a float result outside FLOAT_DTYPES
        (`.double()`: the stacks compute in float32 at most); while streaming, an int64 result that is not int64
        (`.type(torch.half)` would turn the offsets into floats) and a cast that would round the
        ring (f32 -> bf16/f16, bf16 <-> f16). Returns the float probe: the target dtype and device.
        """
        probe = fn(torch.empty(0, dtype=self.dtype, device=self.device))
        index = fn(torch.empty(0, dtype=torch.long, device=self.device))
        name = type(self).__name__
        if self._twins is not None:  # the Triton twins step it: a device Triton can run on
            check_triton_device(probe.device, f"{name}(kernels='twin')")
        if probe.dtype not in FLOAT_DTYPES:
            raise TypeError(f"converting this {name} to {probe.dtype} is refused: a stack holds one of "
                            f"{FLOAT_DTYPES} (there is no float64 stack); nothing was changed")
        if self._is_streaming() and index.dtype != torch.long:
            raise TypeError(f"this conversion would turn the streaming {name}'s int64 offsets into "
                            f"{index.dtype}: refused, nothing was changed; convert the floating tensors only "
                            f"(.to(dtype), .float(), .half(), .bfloat16())")
        if self._is_streaming() and probe.dtype != self.dtype and (self.dtype, probe.dtype) not in _LOSSLESS:
            raise RuntimeError(f"converting a streaming {name} from {self.dtype} to {probe.dtype} is refused: "
                               f"its ring holds the stream's {self.dtype} keys and values, which "
                               f"{probe.dtype} would round; nothing was changed. Convert before "
                               f"streaming_init(), or call streaming_end() (drops the stream) first")
        return probe

    def _apply(self, fn, recurse=True):
        """`nn.Module`'s conversion hook, behind `.to()`, `.cuda()`, `.cpu()`, `.float()`, `.half()`,
        `.bfloat16()`, `.double()`, `.share_memory()`, ...

        Converts the weight buffers as `nn.Module` does and, while streaming, the state with
        them: k, v [L, B, H, C, D] to the new dtype and device (an exact widening only, e.g. a
        bf16 stack `.float()`), offset and start_offset (int64 [B]) to the new device. Checked
        first (`_conversion_target`): on a refusal nothing changes. Before streaming every
        FLOAT_DTYPES cast is allowed: it converts the weights, as you asked.
        """
        self._conversion_target(fn)
        s = self._state
        state = None if s is None else TorchStreamState(*(fn(t) for t in (s.k, s.v, s.offset, s.start_offset)))
        super()._apply(fn, recurse)
        self._state = state
        return self

    # ----------------------------------------------------------------------------- step
    def _check_step_inputs(self, x, active) -> tuple[TorchStreamState, torch.Tensor | None]:
        """(state, active) after checking step's arguments; active stays None when not given."""
        state = self._require_state("step")
        c = self.config
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"step(x): x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[0] != state.batch_size or x.shape[2] != c.dim:
            raise ValueError(f"step(x): x must have shape [B={state.batch_size}, T, dim={c.dim}], "
                             f"got {list(x.shape)}")
        if not 1 <= x.shape[1] <= c.capacity:
            raise ValueError(f"step(x): T = x.shape[1] must be in 1..capacity={c.capacity}, got {x.shape[1]}")
        if x.dtype != self.dtype and not exact_float_cast(dtype_name(x), dtype_name(self.dtype)):
            raise TypeError(f"step(x): x has dtype {x.dtype}; the stack holds {self.dtype}. Only an exact "
                            f"cast of x is applied (a widening: bfloat16/float16 x into a float32 stack); "
                            f"{x.dtype} -> {self.dtype} would round x, so it is refused: pass "
                            f"x.to({self.dtype}) if that rounding is what you want")
        if x.device != self.device:
            raise ValueError(f"step(x): x is on {x.device}; the stack is on {self.device}")
        return state, None if active is None else self._check_row_mask("step(active)", active, state)

    def rope_freqs(self) -> tuple[float, ...]:
        """This stack's RoPE frequency table, computed on its device (the JAX path can share it)."""
        return tuple(rope_freqs(self.config.head_dim, self.config.max_period, self.device).tolist())

    def step_tables(self, offset, start_offset, active, T: int) -> TorchStepTables:
        """The step's tables, made once and read by every layer (the twin kernels' form for "twin")."""
        c = self.config
        tables = build_step_tables(offset, start_offset, active, T, capacity=c.capacity, context=c.context,
                                   head_dim=c.head_dim, max_period=c.max_period, convention=c.ring_convention)
        if self.kernels == "twin":
            tables = twin_tables(tables, offset, T, rope_freqs(c.head_dim, c.max_period, offset.device))
        return tables

    def _first_carry(self, x: torch.Tensor, state: TorchStreamState) -> tuple:
        """The layer loop's first carry: (x, k, v), the stacked rings; for "twin" also the kernels'
        counters (all 0) and, where the norms run split, the first layer's (`twin_layers.first_carry`)."""
        if self.kernels != "twin":
            return x, state.k, state.v
        B, T, _ = x.shape
        sems = torch.zeros(twin_sems_size(B, self.config.num_heads, T), dtype=torch.int32, device=x.device)
        kernels, compiled = self._twins
        return twin_layers.first_carry(kernels, self.config, self.weights(), x, state.k, state.v, sems,
                                       compiled=compiled)

    def _run_layer(self, carry: tuple, layer: int, tables: TorchStepTables, active: torch.Tensor) -> tuple:
        """One layer: carry -> next carry; the reference layer, or the twin layer program."""
        if self.kernels == "twin":
            program = twin_layers.layer_program(self.config)
            return program(self._twins[0], self.config, self.weights(), carry, layer, tables)
        return self._reference_layer(self.config, self._layer_weights(layer), carry, layer, tables, active)

    def step(self, x: torch.Tensor, active: torch.Tensor | None = None):
        """One streaming step: x [B, T, dim], active bool [B] (default: all rows).

        The tables are built once and every layer uses them. Inactive rows leave the state as is.
        Differentiable: where autograd records (x or a weight buffer requiring grad) the reference
        ops and the twin kernels' autograd Functions record, the rings carrying the graph from step
        to step; the twin gradients are the JAX twin step's bits (`kernels_pallas.contract.grad`).
        Otherwise nothing is recorded, as under `torch.no_grad`.
        """
        state, active = self._check_step_inputs(x, active)
        if active is None:
            active = torch.ones(state.batch_size, dtype=torch.bool, device=self.device)
        x = x.to(self.dtype)  # an exact widening (checked), or x itself
        if self.kernels == "twin":
            x = x.contiguous()  # the twin kernels read dense rows: a strided x is copied (the same bits)
        c = self.config
        tables = self.step_tables(state.offset, state.start_offset, active, x.shape[1])
        carry = self._first_carry(x, state)
        for layer in range(c.num_layers):
            carry = self._layer_fn(carry, layer, tables, active)
        state.offset.copy_(tables.end_offset)
        self._bounds = (self._bounds[0] + x.shape[1], self._bounds[1])
        return self._head(carry[0])

    def _head(self, x: torch.Tensor):
        return x


class TemporalStreaming(StreamingStack):
    """Helium temporal transformer, stepping T frames (T=1 in PersonaPlex) per call.

    On the CPU beside JAX, step a small config on one torch thread (`torch.set_num_threads(1)`:
    `StreamingStack` says why)."""

    def __init__(self, dim: int = 4096, num_layers: int = 32, num_heads: int = 32, hidden: int = 11264,
                 context: int = 3000, text_card: int = 32000, max_period: float = 10000.0,
                 ring_convention: str = "personaplex", dtype: torch.dtype = torch.float32, device=None,
                 norm_eps: float = TemporalConfig.norm_eps, kernels: str = "reference"):
        config = TemporalConfig(dim=dim, num_layers=num_layers, num_heads=num_heads, hidden=hidden,
                                context=context, text_card=text_card, max_period=max_period,
                                ring_convention=ring_convention, norm_eps=norm_eps)
        super().__init__(config, dtype, device, temporal_layer, kernels)

    @classmethod
    def from_config(cls, config: TemporalConfig, **kwargs) -> TemporalStreaming:
        if not isinstance(config, TemporalConfig):
            raise TypeError(f"{cls.__name__}.from_config(config): config must be a TemporalConfig, got "
                            f"{type(config).__name__}")
        return cls(dim=config.dim, num_layers=config.num_layers, num_heads=config.num_heads,
                   hidden=config.hidden, context=config.context, text_card=config.text_card,
                   max_period=config.max_period, ring_convention=config.ring_convention,
                   norm_eps=config.norm_eps, **kwargs)

    def step(self, frame_embedding: torch.Tensor, active: torch.Tensor | None = None):
        """frame_embedding [B, T, dim], active bool [B] ->
        (out [B, T, dim], text_logits [B, 1, T, text_card])."""
        return super().step(frame_embedding, active)

    def _head(self, x: torch.Tensor):
        if self.kernels == "twin":
            return twin_layers.temporal_head(self._twins[0], self.config, self.weights(), x)
        out = rms_norm_f32(x, self.out_norm_alpha, self.config.norm_eps)
        return out, torch.nn.functional.linear(out, self.text_linear)[:, None]


class MimiTransformer(StreamingStack):
    """Mimi codec transformer (encoder or decoder), stepping T frames per call.

    On the CPU beside JAX, step a small config on one torch thread (`torch.set_num_threads(1)`:
    `StreamingStack` says why)."""

    def __init__(self, num_layers: int = 8, dim: int = 512, num_heads: int = 8, context: int = 250,
                 ffn: int = 2048, max_period: float = 10000.0, ring_convention: str = "personaplex",
                 dtype: torch.dtype = torch.float32, device=None, norm_eps: float = MimiConfig.norm_eps,
                 kernels: str = "reference"):
        config = MimiConfig(num_layers=num_layers, dim=dim, num_heads=num_heads, context=context, ffn=ffn,
                            max_period=max_period, ring_convention=ring_convention, norm_eps=norm_eps)
        super().__init__(config, dtype, device, mimi_layer, kernels)

    @classmethod
    def from_config(cls, config: MimiConfig, **kwargs) -> MimiTransformer:
        if not isinstance(config, MimiConfig):
            raise TypeError(f"{cls.__name__}.from_config(config): config must be a MimiConfig, got "
                            f"{type(config).__name__}")
        return cls(num_layers=config.num_layers, dim=config.dim, num_heads=config.num_heads,
                   context=config.context, ffn=config.ffn, max_period=config.max_period,
                   ring_convention=config.ring_convention, norm_eps=config.norm_eps, **kwargs)
