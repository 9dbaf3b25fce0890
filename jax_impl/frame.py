"""The whole language-model frame, JAX side: one jitted step, all state one pytree.

    params = check_frame_params(cfg, {"temporal": variables, "depformer": dep_params, "text_emb": ..., "emb": ...})
    state = init_frame_state(cfg, batch_size=4)
    step = make_frame_step(cfg)                               # jitted, state donated
    out, state = step(params, state, user_tokens, active)     # FrameOutput (jax arrays), the new state
    state = jit_reset_slot(state, 2)                          # recycle a row, no recompile

What a frame computes, the token ids, the early exit and the sampling counters: the torch
reference (`torch_bridge.frame`, bit-exact with moshi's `LMGen.step`) and
`jax_impl.frame_config`; this is the same frame, operation for operation: embeddings of the
cached tokens (with the delays) -> the temporal step (`step_fn`) -> text sampling -> the
depformer (`depformer_frame`, its first dep_q_exit steps) -> the cache.

`kernels` picks who computes the floats, as for the stacks:

- "reference": jax.numpy / XLA; the floats differ from the torch reference frame's by the matmuls'
  summation order (XLA's, not oneDNN's), the tokens agree.
- "twin": the temporal step and the depformer on the Pallas twins (`step_fn(kernels="twin")`,
  `depformer_frame(kernels="twin")`; the text head is the twin step's), the embeddings' sum
  written out in a fixed order (`frame_input`): the torch `LMFrame(kernels="twin")`'s bits for
  every output and state tensor, whatever the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import backend

from . import state as st
from .depformer import check_depformer_params, depformer_frame
from .frame_config import (
    TEXT_COUNTER_BASE,
    UNGENERATED_TOKEN,
    FrameConfig,
    FrameOutput,
    check_frame_kernels,
    embedding_shapes,
)
from .sampling import is_integer_array, sample
from .sampling_config import check_sampling, check_seeds
from .state import StreamState
from .step import step_fn
from .weights import check_params

F32, I32, U32 = jnp.float32, jnp.int32, jnp.uint32


class FrameState(NamedTuple):
    """temporal: the temporal stack's rings and offsets; token_cache int32 [B, 1 + n_q, cache_len]
    (moshi's `_LMGenState.cache`); frame_offset [B] (frames since each row's session began)."""

    temporal: StreamState
    token_cache: jax.Array
    frame_offset: jax.Array

    @property
    def batch_size(self) -> int:
        return self.frame_offset.shape[0]


def init_frame_state(cfg: FrameConfig, batch_size: int, dtype=jnp.float32, *, device=None) -> FrameState:
    """A fresh state on `device` (default: JAX's first device): rings zeroed, caches 'not generated'
    (-2), offsets 0. Committed to the device, as the step's outputs are: the second step does not
    compile again."""
    if not isinstance(cfg, FrameConfig):
        raise TypeError(f"init_frame_state(cfg): cfg must be a FrameConfig, got {type(cfg).__name__}")
    batch_size = st.check_batch_size("init_frame_state", batch_size)
    device = device or jax.devices()[0]
    temporal = st.init_state(cfg.temporal, batch_size, dtype, device=device)
    cache = jnp.full((batch_size, cfg.num_codebooks, cfg.cache_len), UNGENERATED_TOKEN, I32, device=device)
    return FrameState(temporal, cache, jnp.zeros((batch_size,), temporal.offset.dtype, device=device))


def frame_offsets(state: FrameState) -> dict[str, jax.Array]:
    """The state's offset arrays [B] a step advances, by name: temporal.offset, frame_offset (1 a frame each)."""
    return {"temporal.offset": state.temporal.offset, "frame_offset": state.frame_offset}


def check_frame_params(cfg: FrameConfig, params: Mapping) -> dict:
    """The frame's parameters after checking them: {"temporal": the temporal stack's Flax variables,
    "depformer": the depformer's buffers, "text_emb", "emb": the input tables}, one float dtype."""
    want = {"temporal", "depformer", *embedding_shapes(cfg)}
    if not isinstance(params, Mapping) or set(params) != want:
        raise ValueError(f"params: expected the keys {sorted(want)}, got "
                         f"{sorted(params) if isinstance(params, Mapping) else type(params).__name__}")
    dep = check_depformer_params(cfg.depformer, params["depformer"])
    dtype = dep["in_proj"].dtype
    check_params(cfg.temporal, params["temporal"], dtype=dtype, argname="params['temporal']", adapters=True)
    out = {"temporal": params["temporal"], "depformer": dep}
    for name, shape in embedding_shapes(cfg).items():
        out[name] = jnp.asarray(params[name])
        if out[name].shape != shape or out[name].dtype != dtype:
            raise ValueError(f"params[{name!r}] must be {jnp.dtype(dtype).name}{list(shape)} (the depformer's dtype), "
                             f"got {out[name].dtype}{list(out[name].shape)}")
    return out


def embed(table, ids):
    """moshi's `ScaledEmbedding`: ids [B] -> [B, dim]; id -1 gives the zero vector."""
    y = jnp.take(table, jnp.clip(ids, 0, table.shape[0] - 1), axis=0)
    return jnp.where((ids == -1)[:, None], jnp.zeros((), y.dtype), y)


def frame_input(params, tokens_in, kernels: str):
    """The temporal stack's input [B, 1, dim] in the tables' dtype from tokens_in int [B, 1 + n_q]
    (text first): the audio tables' embeddings, then the text table's, added left to right (moshi's
    order). "reference" adds in the tables' dtype (moshi's roundings); "twin" adds the float32
    upcasts and rounds once (`torch_bridge.frame.frame_input`: the same adds, in the same order; XLA
    does not reassociate them). In float32 the two are the same bits."""
    dtype = params["text_emb"].dtype
    acc = F32 if kernels == "twin" else dtype
    x = embed(params["emb"][0], tokens_in[:, 1]).astype(acc)
    for k in range(1, params["emb"].shape[0]):
        x = x + embed(params["emb"][k], tokens_in[:, 1 + k]).astype(acc)
    return (x + embed(params["text_emb"], tokens_in[:, 0]).astype(acc)).astype(dtype)[:, None]


def frame_fn(cfg: FrameConfig, *, kernels: str = "reference", dep_q_exit: int | None = None,
             temperature: float = 0.0, top_k: int = 0, text_temperature: float = 0.0, text_top_k: int = 0,
             rope_freqs: tuple[float, ...] | None = None):
    """The pure frame `(params, state, user_tokens, active, replace_audio, seeds) -> (FrameOutput, state)`.

    user_tokens int [B, n_q - dep_q]; active bool [B] or None (every row); replace_audio int
    [B, dep_q - dep_q_exit] (or None when dep_q_exit is dep_q); seeds int [B] or None (greedy). kernels: "reference" or "twin"
    (module docstring). The params' names, shapes and dtypes are checked when traced
    (`check_frame_params`: once a compile, nothing at run time); the other arguments by `make_frame_step`.
    """
    if not isinstance(cfg, FrameConfig):
        raise TypeError(f"frame_fn(cfg): cfg must be a FrameConfig, got {type(cfg).__name__}")
    check_frame_kernels(cfg, kernels, "frame_fn(kernels)")
    D, K, CT = cfg.dep_q, cfg.num_codebooks, cfg.cache_len
    n = D if dep_q_exit is None else dep_q_exit
    delays = np.asarray(cfg.delays, np.int32)
    initial = np.asarray(cfg.initial_tokens, np.int32)
    temporal_step = step_fn(cfg.temporal, rope_freqs=rope_freqs, kernels=kernels)

    def fn(params, state: FrameState, user_tokens, active, replace_audio, seeds):
        params = check_frame_params(cfg, params)
        cache, offset = state.token_cache, state.frame_offset
        active = jnp.ones(offset.shape, bool) if active is None else active
        rows = jnp.arange(offset.shape[0])[:, None]
        run = active[:, None]
        if cfg.user_codebooks:  # the caller's codebooks, written delay frames ahead
            cbs, pos = np.arange(D + 1, K)[None], (offset[:, None] + delays[D + 1:]) % CT
            cache = cache.at[rows, cbs, pos].set(jnp.where(run, user_tokens.astype(I32), cache[rows, cbs, pos]))
        is_init = (offset[:, None] <= delays) | ~run
        tokens_in = jnp.where(is_init, initial, cache[rows, np.arange(K)[None], (offset % CT)[:, None]])
        x = frame_input(params, tokens_in, kernels)
        (out, text_logits), temporal = temporal_step(params["temporal"], state.temporal, x, active)
        text_logits = text_logits[:, 0, 0].astype(F32)
        text = sample(text_logits, seeds, offset.astype(U32) + U32(TEXT_COUNTER_BASE), temperature=text_temperature,
                      top_k=text_top_k)
        codes, audio_logits = depformer_frame(cfg.depformer, params["depformer"], text, out, seeds=seeds,
                                              counter=offset, temperature=temperature, top_k=top_k,
                                              kernels=kernels, steps=n)
        audio = codes if n == D else jnp.concatenate([codes, replace_audio.astype(I32)], axis=1)

        offset = jnp.where(active, offset + 1, offset)
        cbs, pos = np.arange(1 + D)[None], (offset % CT)[:, None]
        new = jnp.concatenate([text[:, None], audio], axis=1)
        cache = cache.at[rows, cbs, pos].set(jnp.where(run, new, cache[rows, cbs, pos]))
        tokens = cache[rows, cbs, (offset[:, None] - cfg.max_delay + delays[:1 + D]) % CT]
        not_ready = ((offset <= cfg.max_delay) | ~active)[:, None]
        outputs = FrameOutput(tokens=jnp.where(not_ready, UNGENERATED_TOKEN, tokens),
                              text=jnp.where(active, text, UNGENERATED_TOKEN),
                              audio=jnp.where(run, audio, UNGENERATED_TOKEN),
                              text_logits=text_logits, audio_logits=audio_logits, transformer_out=out)
        return outputs, FrameState(temporal, cache, offset)

    return fn


def _int_array(name: str, x, shape: tuple[int, ...], high: int) -> np.ndarray:
    """x on the host after checking its dtype, shape and token ids (0..high or -1)."""
    st.check_array(name, x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got {x.dtype}")
    if tuple(jnp.shape(x)) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(jnp.shape(x))}")
    host = np.asarray(x)
    bad = (host < -1) | (host > high)
    if bad.any():
        raise ValueError(f"{name} must hold token ids in 0..{high} or -1 (the zero token), got {host[bad][0]}")
    return host


def make_frame_step(cfg: FrameConfig, *, kernels: str = "reference", dep_q_exit: int | None = None,
                    temperature: float = 0.0, top_k: int = 0, text_temperature: float = 0.0, text_top_k: int = 0,
                    rope_freqs: tuple[float, ...] | None = None, donate: bool = True):
    """A jitted frame: step(params, state, user_tokens=None, active=None, replace_audio=None, seeds=None)
    -> (FrameOutput, new_state); the state is donated (keep only the returned one).

    kernels: "reference" or "twin" (module docstring; the twin frame's bits are the torch
    `LMFrame(kernels="twin")`'s).

    dep_q_exit (static): the depformer's steps (1..dep_q; None: dep_q); the caller then gives
    replace_audio [B, dep_q - dep_q_exit]. temperature/top_k (audio), text_temperature/text_top_k:
    the sampler's (static; 0: greedy), seeds int [B] then. rope_freqs: the torch stack's RoPE table
    (`TemporalStreaming.rope_freqs()`), shared bit for bit. Every argument is checked on the host
    before the call (shapes, dtypes, token ids), so a refused call leaves the state valid. So is the
    offsets' room (`state.OffsetBounds`: no device read a step): a step that would take a row's offset past
    the index dtype (int32: 2**31 - 1 positions, ~5.4 years of frames) raises OverflowError; the row
    then needs `jit_reset_rows` (`jit_reset_slot` keeps its positions counting).
    """
    if not isinstance(cfg, FrameConfig):
        raise TypeError(f"cfg must be a FrameConfig, got {type(cfg).__name__}")
    check_frame_kernels(cfg, kernels, "make_frame_step(kernels)")
    D = cfg.dep_q
    if dep_q_exit is not None and (not isinstance(dep_q_exit, int) or isinstance(dep_q_exit, bool)
                                   or not 1 <= dep_q_exit <= D):
        raise ValueError(f"dep_q_exit must be an int in 1..{D} (None: {D}), got {dep_q_exit!r}")
    n = D if dep_q_exit is None else dep_q_exit
    check_sampling(text_temperature, text_top_k, cfg.text_card)
    check_sampling(temperature, top_k, cfg.card)
    fn = frame_fn(cfg, kernels=kernels, dep_q_exit=n, temperature=temperature, top_k=top_k, text_temperature=text_temperature,
                  text_top_k=text_top_k, rope_freqs=rope_freqs)
    jitted = jax.jit(backend.traced_on(fn), donate_argnums=(1,) if donate else ())

    def step(params, state: FrameState, user_tokens=None, active=None, replace_audio=None, seeds=None):
        if not isinstance(state, FrameState):
            raise TypeError(f"state must be a jax_impl.frame.FrameState, got {type(state).__name__}")
        st.check_live("step(state)", state)
        B = state.batch_size
        if tuple(state.token_cache.shape) != (B, cfg.num_codebooks, cfg.cache_len):
            raise ValueError(f"state.token_cache must have shape {[B, cfg.num_codebooks, cfg.cache_len]}, got "
                             f"{list(state.token_cache.shape)}")
        if user_tokens is None and not cfg.user_codebooks:
            user_tokens = np.zeros((B, 0), np.int32)
        _int_array("user_tokens", user_tokens, (B, cfg.user_codebooks), cfg.card)
        if active is not None:
            st.check_row_flags("step", "active", active, B)
        if (replace_audio is None) != (n == D):
            raise ValueError(f"replace_audio must be given exactly when dep_q_exit < dep_q ({D}): dep_q_exit {n}, "
                             f"replace_audio {'None' if replace_audio is None else 'given'}")
        if replace_audio is not None:
            _int_array("replace_audio", replace_audio, (B, D - n), cfg.card)
        if temperature or text_temperature:
            check_seeds(seeds, B, is_integer_array)
        else:
            seeds = None
        # the arguments as given (numpy or JAX): jit places host arrays itself
        return st.OFFSET_BOUNDS.step("step(state)", "jit_reset_rows", frame_offsets, lambda name: 1, state,
                                     lambda s: jitted(params, s, user_tokens, active, replace_audio, seeds))

    return step


# ----------------------------------------------------------------------------- recycling
def reset_slot(state: FrameState, b) -> FrameState:
    """Row b starts a new session: the temporal `reset_slot` (ring zeroed, positions keep counting),
    its frame offset back to 0, its token cache 'not generated'."""
    row = jnp.arange(state.batch_size) == b
    return FrameState(st.reset_slot(state.temporal, b), jnp.where(row[:, None, None], UNGENERATED_TOKEN,
                                                                   state.token_cache),
                      jnp.where(row, 0, state.frame_offset))


def bump_slot_start(state: FrameState, b) -> FrameState:
    """The temporal `bump_slot_start(b)` (after `reset_slot(b)`: the sacrifice tick)."""
    return state._replace(temporal=st.bump_slot_start(state.temporal, b))


def reset_rows(state: FrameState, mask) -> FrameState:
    """Rows where mask [B] is True start a fresh stream, positions from 0 (moshi's `reset_streaming(mask)`)."""
    return FrameState(st.reset_rows(state.temporal, mask),
                      jnp.where(mask[:, None, None], UNGENERATED_TOKEN, state.token_cache),
                      jnp.where(mask, 0, state.frame_offset))


_jitted = {op.__name__: jax.jit(op, donate_argnums=(0,)) for op in (reset_slot, bump_slot_start, reset_rows)}


def _recycle(op: str, state, arg):
    """Check on the host (the state stays valid on a refusal), then run the jitted op, state donated."""
    if not isinstance(state, FrameState):
        raise TypeError(f"{op}(state): expected a jax_impl.frame.FrameState, got {type(state).__name__}")
    st.check_live(f"{op}(state)", state)
    if op == "reset_rows":
        st.check_row_flags(op, "mask", arg, state.batch_size)
    else:
        st.check_row(op, state.temporal, arg)
    return _jitted[op](state, jnp.asarray(arg))


def jit_reset_slot(state: FrameState, b) -> FrameState:
    """`reset_slot` jitted once for every row (b traced), state donated; a concrete b checked first."""
    return _recycle("reset_slot", state, b)


def jit_bump_slot_start(state: FrameState, b) -> FrameState:
    """`bump_slot_start` jitted once for every row, state donated; a concrete b checked first."""
    return _recycle("bump_slot_start", state, b)


def jit_reset_rows(state: FrameState, mask) -> FrameState:
    """`reset_rows` jitted, state donated; mask (bool [B]) checked first."""
    return _recycle("reset_rows", state, mask)
