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

import os
from collections.abc import Callable
from types import MappingProxyType

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import backend

from . import state as st
from .config import StackConfig
from .kernel_choice import JAX_KERNELS
from .lora import check_lora, split_lora
from .model import check_capture, check_flag, check_rope_freqs, check_stack_options, stack_module
from .ops import pick_kernels
from .snapshot import check_bump, check_restore_batch, check_snapshot_layout, exact_float_cast, ring_shape
from .state import StreamState
from .stream_io import read_stream, state_from_snapshot, state_snapshot, write_stream
from .weights import check_params


def check_step_inputs(config: StackConfig, params, state: StreamState, x, active) -> jax.Array | None:
    """Validate (params, state, x, active) of a step; returns active (None: every row, which the stack
    knows when it is traced: the twin step then reads no active operand at all).

    x may have another dtype than the state when the cast is exact (bf16/f16 x into a float32
    stack: the step casts it); a cast that would round x is refused, as on the torch side.
    """
    c = config
    if not isinstance(state, StreamState):
        raise TypeError(f"step(state): expected a jax_impl.StreamState, got {type(state).__name__}")
    dtype = state.k.dtype
    B = state.offset.shape[0]
    ring = ring_shape(c, B)
    if tuple(state.k.shape) != ring or tuple(state.v.shape) != ring or state.v.dtype != dtype:
        raise ValueError(f"step(state): rings must be {dtype}{list(ring)} for this config, got "
                         f"k {state.k.dtype}{list(state.k.shape)}, v {state.v.dtype}{list(state.v.shape)}")
    for name in ("offset", "start_offset"):
        a = getattr(state, name)
        if tuple(a.shape) != (B,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"step(state): {name} must be an integer array of shape [{B}], "
                             f"got {a.dtype}{list(a.shape)}")
    check_params(c, params, dtype=dtype, argname="step(params)", adapters=True)
    st.check_array("step(x)", x)
    shape = tuple(x.shape)
    if len(shape) != 3 or shape[0] != B or shape[2] != c.dim:
        raise ValueError(f"step(x): x must have shape [B={B}, T, dim={c.dim}], got {list(shape)}")
    if not 1 <= shape[1] <= c.capacity:
        raise ValueError(f"step(x): T = x.shape[1] must be in 1..capacity={c.capacity}, got {shape[1]}")
    check_x_dtype(x, dtype)
    return None if active is None else st.check_row_flags("step", "active", active, B)


def check_x_dtype(x, dtype) -> None:
    """TypeError unless x's dtype is `dtype` (the state's) or casts to it exactly (bf16/f16 x into a
    float32 stack), the torch side's rule. A jitted step also runs it on the host before the call
    (`HostCheckedStep`): jit narrows a numpy float64 x to float32 (x64 off) before tracing, where
    the step's own check would see float32."""
    x_dtype = jnp.dtype(getattr(x, "dtype", None))
    if x_dtype != dtype and not exact_float_cast(x_dtype.name, jnp.dtype(dtype).name):
        raise TypeError(f"step(x): x has dtype {x_dtype}; the stack's state holds {dtype}. Only an exact "
                        f"cast of x is applied (a widening: bfloat16/float16 x into a float32 stack); "
                        f"{x_dtype} -> {dtype} would round x, so it is refused: pass "
                        f"x.astype(jnp.{jnp.dtype(dtype).name}) if that rounding is what you want")


def check_host_args(state, x, active=None) -> None:
    """A step's x and active on the host, before a jitted call: JAX or numpy arrays (jit would fail
    to read a torch tensor with an error of its own), x's dtype (`check_x_dtype`: jit would narrow
    a numpy float64 x to float32, `HostCheckedStep`) and active's (`check_row_flags` on the argument
    as given: jit would take a list, and narrow an int64 mask to int32 before the step's own check).
    A state the step cannot take passes, for the step's own checks to name."""
    st.check_array("step(x)", x)
    if active is not None and isinstance(state, StreamState):
        st.check_row_flags("step", "active", active, state.batch_size)
    elif active is not None:
        st.check_array("step(active)", active)
    dtype = getattr(getattr(state, "k", None), "dtype", None)
    if dtype is not None:
        check_x_dtype(x, dtype)


class HostCheckedStep:
    """A jitted step (`jitted`) whose x is checked on the host first (`check_host_args`): a numpy
    float64 x would reach the step as float32, narrowed by jit. `lower(...)` lowers the jitted
    function on the same arguments."""

    def __init__(self, jitted: Callable):
        self.jitted = jitted

    def __call__(self, params, state, x, active=None):
        st.check_live("step(state)", state)
        check_host_args(state, x, active)
        return self.jitted(params, state, x, active)

    def lower(self, params, state, x, active=None):
        st.check_live("step(state)", state)
        check_host_args(state, x, active)
        return self.jitted.lower(params, state, x, active)


def step_fn(config: StackConfig, *, layer_loop: str = "scan", scan_unroll: int = 1, exact_rope: bool = True,
            rope_freqs: tuple[float, ...] | None = None, kernels: str = "auto",
            capture: tuple[str, ...] = (), remat_layers: bool = False) -> Callable:
    """The pure step `(params, state, x, active=None) -> (outputs, new_state)` (not jitted).

    outputs: (out [B, T, dim], text_logits [B, 1, T, text_card]) for the temporal stack, out [B, T, dim]
    for Mimi. state: k, v [L, B, H, C, D] (the batch on axis 1), offset, start_offset [B] (axis 0).
    layer_loop: "scan" (one `lax.scan` over the stacked layers) or "python" (a Python loop,
    static layer indexes: longer to compile, what the GPU runs fastest today). The two give the same
    bits in float32, and on kernels="twin" in any dtype; in bfloat16 on "reference" and "pallas" they
    may differ by XLA's excess precision (some bf16 intermediates kept in float32, differently in
    the inlined layers and in the scan body).
    scan_unroll: `lax.scan`'s unroll factor when layer_loop="scan" (`model.stack_module` says why 1).
    rope_freqs: a [D/2] RoPE frequency table (a tuple of floats; a list or 1-D float array is taken
    as one, `model.check_rope_freqs`) instead of `tables.rope_freqs`; the torch bridge passes the
    torch path's own table so both share its exact bits.
    kernels (`kernel_choice`: the one vocabulary of the torch stacks, the drop-ins and these steps):
    "auto" (the default: "pallas" on a GPU where its kernels apply, else "reference"), "reference"
    (jax.numpy through XLA), "pallas" (the Pallas RoPE and ring-attention kernels in the reference
    layer) or "twin" (every float operation on the Pallas twins: the bits of the torch stack's
    kernels="twin").
    exact_rope: keep the reference RoPE's products unfused (bit-identical to torch's); False fuses
    them, on "reference" ("auto" then resolves to it), refused on "pallas" and "twin" (exact always).
    capture: Flax collections the stack sows into (`model.CAPTURED`: ("intermediates",), the
    `StepTables` the layers used); when given, the step returns (outputs, new_state, captured).
    remat_layers: each layer under `jax.checkpoint` (its activations recomputed in a backward pass;
    `layers.REMAT_POLICY` says what it keeps); refused on "twin".
    Every option is checked here (`model.check_stack_options`): TypeError / ValueError naming it.
    params may carry LoRA adapters of the temporal stack under "lora" (`lora.with_lora`), applied
    on kernels "reference" and "pallas".
    """
    st.check_stack_config("step_fn", config)
    options = check_stack_options("step_fn", config, layer_loop=layer_loop, scan_unroll=scan_unroll,
                                  exact_rope=exact_rope, rope_freqs=rope_freqs, kernels=kernels,
                                  remat_layers=remat_layers, accepted=JAX_KERNELS)
    capture = check_capture("step_fn(capture)", capture)

    def step(params, state, x, active=None):
        active = check_step_inputs(config, params, state, x, active)
        x = jnp.asarray(x).astype(state.k.dtype)  # an exact widening (checked), or x itself
        impl = pick_kernels(kernels, config, state.batch_size, x.shape[1], options["exact_rope"])
        module = stack_module(config, state.k.dtype, **{**options, "kernels": impl})
        variables, lora = split_lora(params)
        if not capture:
            return module.apply(variables, state, x, active, lora)
        (outputs, new_state), captured = module.apply(variables, state, x, active, lora, mutable=list(capture))
        return outputs, new_state, captured

    return step


def make_step(config: StackConfig, *, layer_loop: str = "scan", scan_unroll: int = 1, exact_rope: bool = True,
              donate: bool = True, rope_freqs: tuple[float, ...] | None = None, kernels: str = "auto",
              capture: tuple[str, ...] = ()) -> HostCheckedStep:
    """`jax.jit(step_fn(config, ...))` with the state donated (rings updated in place), x's dtype
    checked on the host first (`HostCheckedStep`; `.jitted` is the jax.jit function).

    The arguments are `step_fn`'s: kernels "auto" (the default), "reference", "pallas" or "twin";
    donate a bool.

    Cached per arguments (checked and normalized first: a list rope_freqs keys as its tuple), so every
    caller shares one compiled function per shape and dtype.
    After a donated call the state passed in is invalid: keep only the returned one.
    """
    st.check_stack_config("make_step", config)
    options = check_stack_options("make_step", config, layer_loop=layer_loop, scan_unroll=scan_unroll,
                                  exact_rope=exact_rope, rope_freqs=rope_freqs, kernels=kernels,
                                  remat_layers=False, accepted=JAX_KERNELS)
    return _make_step(config, donate=check_flag("make_step(donate)", donate),
                      capture=check_capture("make_step(capture)", capture), **options)


@backend.per_backend
def _make_step(config: StackConfig, *, donate: bool, **options) -> HostCheckedStep:
    """`make_step` of checked, hashable options: the cached part."""
    fn = step_fn(config, **options)
    return HostCheckedStep(jax.jit(backend.traced_on(fn), donate_argnums=(1,) if donate else ()))


# Recycling, jitted once each (b / mask traced), state donated so the rings are not copied.
_jit_reset_slot = jax.jit(st.reset_slot, donate_argnums=(0,))
_jit_bump_slot_start = jax.jit(st.bump_slot_start, donate_argnums=(0,))
_jit_reset_rows = jax.jit(st.reset_rows, donate_argnums=(0,))
_jit_reset_streaming = jax.jit(st.reset_streaming, donate_argnums=(0,))


def _check_recycle_args(op: str, state, mask=None) -> None:
    """Host-side checks of a jitted recycle op's arguments, before the donated call (b: `_row_arg`).

    Inside `jax.jit` a Python int b is traced, so the op itself could not refuse an out-of-range
    row (it would match no row: a silent no-op), and a refusal raised while tracing comes after
    the caller chose to donate. Checked here, a refused call raises (TypeError / IndexError /
    ValueError naming `op` and the argument) with the caller's state untouched and still valid.
    A b or mask that is itself traced (the op called inside the caller's own jit) passes
    unchanged: there a traced b out of range stays a documented no-op.
    """
    if not isinstance(state, StreamState):
        raise TypeError(f"{op}(state): expected a jax_impl.StreamState, got {type(state).__name__}")
    st.check_live(f"{op}(state)", state)
    if mask is not None:
        st.check_mask(op, state, mask)  # dtype and shape: static, also for a traced mask


def _row_arg(op: str, state: StreamState, b):
    """The b to pass a jitted recycle op: a concrete b checked (`snapshot.row_index`, after the state's
    own checks) and passed as a numpy int32 (a torch tensor is no jit argument, a jax scalar is read
    once); a traced b as it is."""
    _check_recycle_args(op, state)
    return np.int32(st.check_row(op, state, b)) if st._is_concrete(b) else b


def jit_reset_slot(state: StreamState, b) -> StreamState:
    """`reset_slot` jitted once for every row (b traced), state donated: keep only the result.

    b: a row index (`snapshot.row_index`'s rule: a Python or numpy integer, a 0-d integer array or
    tensor) or a traced integer scalar; a concrete b is checked on the host first (refused:
    IndexError / TypeError, state untouched).
    """
    return _jit_reset_slot(state, _row_arg("reset_slot", state, b))


def jit_bump_slot_start(state: StreamState, b) -> StreamState:
    """`bump_slot_start` (start_offset[b] += 1, never saturated) jitted, state donated; b as in
    `jit_reset_slot`. As the jitted step, it reads no values: a start_offset at the index dtype's
    maximum would wrap, so the caller checks the headroom first (`check_headroom(state, 1)`; the
    `Streamer` keeps a host bound and refuses such a bump)."""
    return _jit_bump_slot_start(state, _row_arg("bump_slot_start", state, b))


def jit_reset_streaming(state: StreamState) -> StreamState:
    """`reset_streaming` (every row a fresh stream) jitted, state donated; the state checked first."""
    _check_recycle_args("reset_streaming", state)
    return _jit_reset_streaming(state)


def jit_reset_rows(state: StreamState, mask) -> StreamState:
    """`reset_rows` jitted, state donated. mask: bool [B] (a numpy or jax array), checked first
    (refused: TypeError / ValueError naming mask, state untouched)."""
    _check_recycle_args("reset_rows", state, mask=mask)
    return _jit_reset_rows(state, mask)


KEEP = object()  # Streamer.convert: keep the step's rope_freqs


def _check_one_device(where: str, device) -> None:
    """ValueError naming `where` for a placement (`init_state`'s device: a Device, a Sharding, a StreamState
    of Shardings) spanning several devices: `Streamer`'s step and recycle ops leave a split state to
    XLA, which gathers it across the devices (the whole ring in every `reset_slot`); the sessions step
    runs each device on its own rows. Anything else passes, for `init_state` to name."""
    shardings = device if isinstance(device, StreamState) else [device]
    devices = set()
    for sharding in shardings:
        if isinstance(sharding, jax.sharding.Sharding):
            devices |= sharding.device_set
    if len(devices) > 1:
        raise ValueError(f"{where}: the state would span {len(devices)} devices; a Streamer steps a state on one "
                         f"device (its step and recycle ops would gather a split one whole across them): use "
                         f"jax_impl.sharding.ShardedStreamer(config, params, batch_size, mesh=...) for a stream "
                         f"split by row")


def _check_adapters(config: StackConfig, params, kernels: str) -> None:
    """The LoRA adapters params may carry under "lora" checked for `config` on `kernels`
    (`lora.check_lora`: the twin kernels and the Mimi stack refuse them) where a stepper takes
    them, rather than when its step is first traced."""
    _, lora = split_lora(params)
    if lora is not None:
        check_lora(config, lora, kernels)


def _check_params_device(where: str, params, state: StreamState) -> None:
    """ValueError naming `where` for a params leaf committed to a device other than the state's
    (one device): jit would refuse the pair only at the first step ("incompatible devices").
    Uncommitted leaves pass: jit moves them to the state's device."""
    device = next(iter(state.k.devices()))
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if isinstance(leaf, jax.Array) and leaf.committed and leaf.devices() != {device}:
            raise ValueError(f"{where}: params{jax.tree_util.keystr(path)} is committed to "
                             f"{sorted(map(str, leaf.devices()))}, the state to {device}: put the params there "
                             f"(jax.device_put(params, device)) or make the state where they are")


class Streamer:
    """Stateful convenience around the pure functions: params + state + host-side overflow guard.

    The guard: `offset_bound` is a Python int, an upper bound of every row's offset
    (+T per step whatever `active` says, back to 0 when every row is reset). A step that could
    take it past the index dtype's maximum reads the offsets once (rows reset since may have
    lowered them) and raises OverflowError before launching anything if it still could:
    otherwise no device sync, no extra work or recompilation in the jitted step. `bump_slot_start`
    is guarded the same way (`snapshot.check_bump`), with `start_bound`: every row's start_offset is
    at most max(offset_bound, start_bound).

    device: where the state is made (`init_state`'s: a Device, or a Sharding or a StreamState of
    them on one device; default: JAX's default device), in place, never copied there from the
    default device. A state split over several devices is `sharding.ShardedStreamer`'s: this
    step and these recycle ops would gather it whole (ValueError).
    """

    def __init__(self, config: StackConfig, params, batch_size: int, dtype=jnp.float32, *,
                 layer_loop: str = "scan", exact_rope: bool = True, rope_freqs: tuple[float, ...] | None = None,
                 device=None, kernels: str = "auto"):
        self.config = st.check_stack_config("Streamer", config)
        options = check_stack_options("Streamer", config, layer_loop=layer_loop, scan_unroll=1, exact_rope=exact_rope,
                                      rope_freqs=rope_freqs, kernels=kernels, remat_layers=False,
                                      accepted=JAX_KERNELS)
        batch_size = st.check_batch_size("Streamer", batch_size)
        check_params(config, params, dtype=jnp.dtype(dtype), argname="Streamer(params)", adapters=True)
        _check_adapters(config, params, kernels)
        plain = self._ops is Streamer._ops  # a subclass with recycle ops of its own layout places its state
        if plain:
            _check_one_device("Streamer(device)", device)
        state = st.init_state(config, batch_size, dtype, device=device)  # made where it lives
        if plain:
            _check_params_device("Streamer(params, device)", params, state)
        self.params, self.state = params, state
        self.offset_bound = self.start_bound = 0
        if kernels == "auto" and next(iter(self.state.k.devices())).platform != "gpu":
            kernels = "reference"  # the state is on the CPU (even on a GPU host): no compiled Pallas there
        self._step_options = {"layer_loop": layer_loop, "exact_rope": options["exact_rope"],
                              "rope_freqs": options["rope_freqs"], "kernels": kernels}
        self._step = make_step(config, **self._step_options)

    @property
    def batch_size(self) -> int:
        return self.state.batch_size

    def step(self, x, active=None):
        T = int(np.shape(x)[1]) if np.ndim(x) == 3 else 0
        try:
            st.check_headroom(self.offset_bound, T, self.state.offset.dtype)
        except OverflowError:  # the bound outlives rows reset since (reset_rows of some): read the offsets once
            self.offset_bound = int(np.max(np.asarray(self.state.offset)))
            st.check_headroom(self.offset_bound, T, self.state.offset.dtype)
        outputs, self.state = self._step(self.params, self.state, x, active)  # x, active checked as given
        self.offset_bound += T
        return outputs

    # The recycle ops on this streamer's state (a subclass on another layout swaps the table).
    _ops = MappingProxyType({"reset_slot": jit_reset_slot, "bump_slot_start": jit_bump_slot_start,
                             "reset_rows": jit_reset_rows, "reset_streaming": jit_reset_streaming})

    def reset_slot(self, b: int) -> None:
        b = st.check_row("reset_slot", self.state, b)
        self.state = self._ops["reset_slot"](self.state, np.int32(b))  # a host scalar: no device read

    def bump_slot_start(self, b: int) -> None:
        """start_offset[b] += 1 (`state.bump_slot_start`); OverflowError naming the row, nothing
        changed, where that would pass the index dtype's maximum (`snapshot.check_bump`: no device read
        unless the host bounds come near it)."""
        b = st.check_row("bump_slot_start", self.state, b)
        st.check_live("bump_slot_start(state)", self.state)
        bounds = check_bump("bump_slot_start", b, (self.offset_bound, self.start_bound), self._read_offsets,
                            self.state.start_offset.dtype.name)
        self.state = self._ops["bump_slot_start"](self.state, np.int32(b))
        self.offset_bound, self.start_bound = bounds

    def _read_offsets(self) -> tuple[list[int], list[int]]:
        """(offsets, start_offsets) of the state as ints: one host read."""
        return np.asarray(self.state.offset).tolist(), np.asarray(self.state.start_offset).tolist()

    def reset_rows(self, mask) -> None:
        self.state = self._ops["reset_rows"](self.state, mask)  # mask checked as given
        if np.asarray(mask).all():
            self.offset_bound = self.start_bound = 0

    def reset_streaming(self) -> None:
        self.state = self._ops["reset_streaming"](self.state)
        self.offset_bound = self.start_bound = 0

    # ------------------------------------------------------------------ snapshots, conversion
    def snapshot(self) -> dict:
        """The stream so far as a snapshot dict of jax copies (`jax_impl.snapshot` format):
        {"k", "v": [L, B, H, C, D], "offset", "start_offset": [B], "metadata": dict[str, str]}."""
        return state_snapshot(self.config, self.state)

    def restore(self, snapshot, resize: bool = False) -> None:
        """Continue the stream of `snapshot` (from any side: `snapshot()`, a torch stack's, a file).

        Replaces the state with validated copies on this state's device: a snapshot of this
        Streamer's batch size, or of any with `resize=True` (its batch size then replaces this
        one); rings widen exactly to this Streamer's dtype, a narrowing is refused; on a refusal
        nothing changes. `offset_bound` and `start_bound` become the restored offsets' and
        start_offsets' maxima (one host read), so the overflow guard holds for the restored stream too.
        """
        self._restore(snapshot, resize, "restore(snapshot)")

    def _restore(self, snapshot, resize: bool, where: str) -> None:
        """`restore`, its errors headed by `where`."""
        layout = check_snapshot_layout(self.config, snapshot, where)
        check_restore_batch(layout.batch_size, self.batch_size, resize, where)
        device = next(iter(self.state.k.devices()))
        self._take_restored(state_from_snapshot(self.config, snapshot, self.state.k.dtype, device, where))

    def _take_restored(self, state: StreamState) -> None:
        """Go on with `state` (a restored stream): the guard's bounds become its offsets' and
        start_offsets' maxima (one host read)."""
        self.state = state
        offsets, starts = self._read_offsets()
        self.offset_bound, self.start_bound = max(offsets), max(starts)

    def save_stream(self, path) -> None:
        """Write the stream to a safetensors file (`restore`s on either side through `load_stream`)."""
        write_stream(self.config, self.state, path)

    def load_stream(self, path, resize: bool = False) -> None:
        """`restore` the stream a `save_stream` (of either side) wrote to `path` (`resize`: restore's)."""
        self._restore(read_stream(path), resize, f"load_stream({os.fspath(path)})")

    def _convert_plan(self, params, rope_freqs):
        """(dtype, step options) of `convert(params, rope_freqs=...)`, after its checks (nothing changed)."""
        check_params(self.config, params, argname="convert(params)")
        dtype = jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype)
        check_params(self.config, params, dtype=dtype, argname="convert(params)")
        src = jnp.dtype(self.state.k.dtype)
        if not exact_float_cast(src.name, dtype.name):
            raise TypeError(f"convert(params): the params hold {dtype}, the ring {src}; casting the ring to "
                            f"{dtype} would round the stream's history (refused, nothing changed): start a "
                            f"new stream in {dtype}")
        options = dict(self._step_options)
        if rope_freqs is not KEEP:
            options["rope_freqs"] = check_rope_freqs("convert(rope_freqs)", rope_freqs, self.config.head_dim)
        return dtype, options

    def convert(self, params, *, device=None, rope_freqs=KEEP) -> None:
        """Go on with `params` of another dtype and/or on another device (the drop-ins' `.to()`).

        params: this config's variables, all of one dtype. The state moves to `device` (None: the
        params' device; a Device, or a Sharding on one device: as `Streamer(device)`) and its rings
        are cast to the params' dtype, an exact widening only (bf16/f16 -> f32): a cast that would
        round the ring raises TypeError. Offsets and the guard's bounds are kept. rope_freqs: a new
        table for the step (default: keep the one in use). Checked first: on a refusal nothing changes.
        """
        _check_one_device("convert(device)", device)
        dtype, options = self._convert_plan(params, rope_freqs)
        step = make_step(self.config, **options)
        leaf = jax.tree_util.tree_leaves(params)[0]
        state = jax.device_put(self.state, device if device is not None else next(iter(leaf.devices())))
        _check_params_device("convert(params, device)", params, state)
        state = state._replace(k=state.k.astype(dtype), v=state.v.astype(dtype))
        self.params, self.state, self._step_options, self._step = params, state, options, step


__all__ = ["HostCheckedStep", "Streamer", "check_host_args", "check_step_inputs", "check_x_dtype", "make_step",
           "step_fn"]
