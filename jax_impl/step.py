"""The step of each stack as a pure function, its jitted form, and a small stateful wrapper.

    step = make_step(config)                     # jitted, state donated, compiled once per shape/dtype
    (out, logits), state = step(params, state, x, active)      # temporal
    out, state = step(params, state, x, active)                 # mimi

`step_fn(config)` is the same function un-jitted (for jax.grad, vmap, your own jit).
Inputs are validated when the function is traced (shapes and dtypes are static), so a bad
input raises a clear error naming the argument before anything is computed; being
functional, the caller's state is never touched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from . import state as st
from .config import StackConfig
from .model import stack_module
from .ops import pick_kernels
from .state import StreamState
from .weights import check_params


def check_step_inputs(config: StackConfig, params, state: StreamState, x, active) -> jax.Array:
    """Validate (params, state, x, active) of a step; returns active (all True when None)."""
    c = config
    if not isinstance(state, StreamState):
        raise TypeError(f"step(state): expected a jax_impl.StreamState, got {type(state).__name__}")
    dtype = state.k.dtype
    B = state.offset.shape[0]
    ring = st.state_shapes(c, B)
    if tuple(state.k.shape) != ring or tuple(state.v.shape) != ring or state.v.dtype != dtype:
        raise ValueError(f"step(state): rings must be {dtype}{list(ring)} for this config, got "
                         f"k {state.k.dtype}{list(state.k.shape)}, v {state.v.dtype}{list(state.v.shape)}")
    for name in ("offset", "start_offset"):
        a = getattr(state, name)
        if tuple(a.shape) != (B,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"step(state): {name} must be an integer array of shape [{B}], "
                             f"got {a.dtype}{list(a.shape)}")
    check_params(c, params, dtype=dtype, argname="step(params)")
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) != 3 or shape[0] != B or shape[2] != c.dim:
        raise ValueError(f"step(x): x must have shape [B={B}, T, dim={c.dim}], got {list(shape)}")
    if not 1 <= shape[1] <= c.capacity:
        raise ValueError(f"step(x): T = x.shape[1] must be in 1..capacity={c.capacity}, got {shape[1]}")
    if jnp.dtype(getattr(x, "dtype", None)) != dtype:
        raise TypeError(f"step(x): x has dtype {x.dtype}; the stack's state holds {dtype}")
    if active is None:
        return jnp.ones((B,), bool)
    a_dtype = getattr(active, "dtype", None)
    if a_dtype is None or jnp.dtype(a_dtype) != jnp.bool_:
        raise TypeError(f"step(active): active must be a bool array, got {a_dtype or type(active).__name__}")
    if tuple(active.shape) != (B,):
        raise ValueError(f"step(active): active must have shape [{B}], got {list(active.shape)}")
    return active


def step_fn(config: StackConfig, *, layer_loop: str = "scan", scan_unroll: int = 1, exact_rope: bool = True,
            rope_freqs: tuple[float, ...] | None = None, kernels: str = "auto",
            capture: tuple[str, ...] = ()) -> Callable:
    """The pure step `(params, state, x, active=None) -> (outputs, new_state)` (not jitted).

    outputs: (out, text_logits) for the temporal stack, out for Mimi.
    layer_loop: "scan" (one `lax.scan` over the stacked layers) or "python" (a Python loop,
    static layer indexes: longer to compile, what the GPU runs fastest today).
    scan_unroll: `lax.scan`'s unroll factor when layer_loop="scan".
    rope_freqs: a [D/2] RoPE frequency table (tuple of floats) instead of `tables.rope_freqs`;
    the torch bridge passes the torch path's own table so both share its exact bits.
    kernels: "xla", "pallas" (Pallas RoPE + ring attention) or "auto" (Pallas on a GPU).
    capture: Flax collections the stack sows into (e.g. ("intermediates",): the `StepTables`
    the layers used); when given, the step returns (outputs, new_state, captured).
    """

    def step(params, state, x, active=None):
        active = check_step_inputs(config, params, state, x, active)
        impl = pick_kernels(kernels, config, state.batch_size, x.shape[1])
        module = stack_module(config, state.k.dtype, layer_loop=layer_loop, scan_unroll=scan_unroll,
                              exact_rope=exact_rope, rope_freqs=rope_freqs, kernels=impl)
        if not capture:
            return module.apply(params, state, x, active)
        (outputs, new_state), captured = module.apply(params, state, x, active, mutable=list(capture))
        return outputs, new_state, captured

    return step


@functools.cache
def make_step(config: StackConfig, *, layer_loop: str = "scan", scan_unroll: int = 1, exact_rope: bool = True,
              donate: bool = True, rope_freqs: tuple[float, ...] | None = None, kernels: str = "auto",
              capture: tuple[str, ...] = ()) -> Callable:
    """`jax.jit(step_fn(config, ...))` with the state donated (rings updated in place).

    Cached per arguments, so every caller shares one compiled function per shape and dtype.
    After a donated call the state passed in is invalid: keep only the returned one.
    """
    fn = step_fn(config, layer_loop=layer_loop, scan_unroll=scan_unroll, exact_rope=exact_rope,
                 rope_freqs=rope_freqs, kernels=kernels, capture=capture)
    return jax.jit(fn, donate_argnums=(1,) if donate else ())


# Recycling, jitted once each (b / mask traced), state donated so the rings are not copied.
jit_reset_slot = jax.jit(st.reset_slot, donate_argnums=(0,))
jit_bump_slot_start = jax.jit(st.bump_slot_start, donate_argnums=(0,))
jit_reset_rows = jax.jit(st.reset_rows, donate_argnums=(0,))
jit_reset_streaming = jax.jit(st.reset_streaming, donate_argnums=(0,))


class Streamer:
    """Stateful convenience around the pure functions: params + state + host-side overflow guard.

    The guard: `offset_bound` is a Python int, an upper bound of every row's offset
    (+T per step whatever `active` says, back to 0 when every row is reset). A step that could
    take it past the index dtype's maximum raises OverflowError before launching anything:
    no device sync, no extra work or recompilation in the jitted step.
    """

    def __init__(self, config: StackConfig, params, batch_size: int, dtype=jnp.float32, *,
                 layer_loop: str = "scan", exact_rope: bool = True, rope_freqs: tuple[float, ...] | None = None,
                 device=None):
        self.config = config
        check_params(config, params, dtype=jnp.dtype(dtype))
        self.params = params
        state = st.init_state(config, batch_size, dtype)
        self.state = state if device is None else jax.device_put(state, device)
        self.offset_bound = 0
        self._step = make_step(config, layer_loop=layer_loop, exact_rope=exact_rope, rope_freqs=rope_freqs)

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    def step(self, x, active=None):
        T = int(np.shape(x)[1]) if np.ndim(x) == 3 else 0
        st.check_headroom(self.offset_bound, T, self.state.offset.dtype)
        if active is not None:
            active = jnp.asarray(active)
        outputs, self.state = self._step(self.params, self.state, x, active)
        self.offset_bound += T
        return outputs

    def reset_slot(self, b: int) -> None:
        b = st.check_row("reset_slot", self.state, b)
        self.state = jit_reset_slot(self.state, jnp.asarray(b, jnp.int32))

    def bump_slot_start(self, b: int) -> None:
        b = st.check_row("bump_slot_start", self.state, b)
        st.check_can_bump(self.state, b)  # host read: a rare op
        self.state = jit_bump_slot_start(self.state, jnp.asarray(b, jnp.int32))

    def reset_rows(self, mask) -> None:
        mask_np = np.asarray(mask)
        self.state = jit_reset_rows(self.state, jnp.asarray(mask))
        if mask_np.dtype == bool and mask_np.all():
            self.offset_bound = 0

    def reset_streaming(self) -> None:
        self.state = jit_reset_streaming(self.state)
        self.offset_bound = 0


__all__ = ["Streamer", "check_step_inputs", "make_step", "step_fn"]
