"""The whole speech frame, JAX side: user PCM in, model PCM out, one jitted step over one state pytree.

    state = init_speech_frame_state(cfg, batch_size=4)
    step = make_speech_frame_step(cfg)                       # jitted, state donated
    out, state = step(params, state, pcm, active)            # pcm [B, 1, frame_size] -> out.pcm, same shape
    state = jit_speech_reset_slot(state, 2)                  # row 2: a fresh session

A frame (`speech_frame_config`): codec encode (`codec.encode_fn`) -> the user's codes -> the LM
frame (`frame.frame_fn`: temporal stack + depformer; the codes enter where moshi's `LMGen.step`
takes its input tokens, or as the depformer's replaced tail on PersonaPlex's layout) -> the
model's codes -> codec decode (`codec.decode_fn`) -> PCM. params: `SpeechFrameParams` (the codec's
`CodecParams` and the LM frame's checked dict; `torch_bridge.SpeechFrame.jax_params()` gives views of
the torch twin's buffers).

Before the first tokens: the LM frame returns no tokens while a row's frame offset is at most
`max_delay` (its delays: moshi's `LMGen.step` returns None then). As moshi's serving loop
(`moshi/run_inference.py`: `mimi.decode` only when the LM returns tokens), the decoder does not run
on those frames: it neither moves its state nor sees a code, and the frame's PCM is zeros
(`out.ready` False). The reply thus starts `max_delay` frames late (80 ms a frame), as moshi's.

Rows: an inactive row (`active` False) is inert: its whole state is unchanged, its PCM zeros, its
codes zeros and tokens -2. Rows never mix: a NaN or Inf in one row's PCM reaches no other row (every
operation is per row); it stays in that row's carries and rings until `speech_reset_slot` clears
the row, after which nothing of the old session is left (the codec's carries and rings zeroed,
the LM's ring, token cache and offsets back to a fresh row's: positions from 0).

kernels: "reference" (XLA) or "twin" (the Pallas twins: the bits of `torch_bridge.SpeechFrame(kernels="twin")`
for the PCM, every code and every state tensor; pass its `rope_freqs()`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kernels_pallas import backend

from . import codec as jcodec
from . import frame as jframe
from . import state as st
from .codec import CodecParams, CodecState
from .frame import FrameState
from .frame_config import check_frame_kernels
from .sampling import is_integer_array
from .sampling_config import check_sampling, check_seeds
from .speech_frame_config import SpeechFrameConfig, SpeechFrameOutput

I32 = jnp.int32


class SpeechFrameParams(NamedTuple):
    """codec: the codec's `CodecParams`; lm: the LM frame's parameters (`frame.check_frame_params`)."""

    codec: CodecParams
    lm: Any


class SpeechFrameState(NamedTuple):
    """codec: the codec's carries, first-frame flags and its two transformers' rings; lm: the LM
    frame's temporal rings, token cache and frame offsets."""

    codec: CodecState
    lm: FrameState

    @property
    def batch_size(self) -> int:
        return self.lm.batch_size


def init_speech_frame_state(cfg: SpeechFrameConfig, batch_size: int, dtype=jnp.float32, *,
                            device=None) -> SpeechFrameState:
    """A fresh state of `batch_size` rows on `device` (default: JAX's first device), committed there."""
    if not isinstance(cfg, SpeechFrameConfig):
        raise TypeError(f"cfg must be a SpeechFrameConfig, got {type(cfg).__name__}")
    batch_size = st.check_batch_size("init_speech_frame_state", batch_size)
    device = device or jax.devices()[0]
    return SpeechFrameState(jcodec.init_codec_state(cfg.codec, batch_size, dtype, device=device),
                            jframe.init_frame_state(cfg.lm, batch_size, dtype, device=device))


def speech_frame_fn(cfg: SpeechFrameConfig, *, kernels: str = "reference", codec_rope_freqs=None, lm_rope_freqs=None,
                    temperature: float = 0.0, top_k: int = 0, text_temperature: float = 0.0, text_top_k: int = 0):
    """The pure frame `(params, state, pcm, active, seeds) -> (SpeechFrameOutput, state)` (module
    docstring). Arguments are not checked here (`make_speech_frame_step` checks them)."""
    encode = jcodec.encode_fn(cfg.codec, kernels=kernels, rope_freqs=codec_rope_freqs)
    decode = jcodec.decode_fn(cfg.codec, kernels=kernels, rope_freqs=codec_rope_freqs)
    lm = jframe.frame_fn(cfg.lm, kernels=kernels, dep_q_exit=cfg.dep_q_exit, temperature=temperature,
                         top_k=top_k, text_temperature=text_temperature, text_top_k=text_top_k,
                         rope_freqs=lm_rope_freqs)
    n = cfg.num_codebooks

    def fn(params: SpeechFrameParams, state: SpeechFrameState, pcm, active, seeds):
        codes, codec_state = encode(params.codec, state.codec, pcm, active)
        if cfg.user_path == "user_tokens":
            out, lm_state = lm(params.lm, state.lm, codes, active, None, seeds)
        else:
            out, lm_state = lm(params.lm, state.lm, jnp.zeros((codes.shape[0], 0), I32), active, codes, seeds)
        model_codes = out.tokens[:, 1:1 + n]
        ready = model_codes[:, 0] >= 0  # -2 until the row's delays pass, and for an inactive row
        pcm_out, codec_state = decode(params.codec, codec_state, jnp.where(ready[:, None], model_codes, 0), ready)
        return SpeechFrameOutput(pcm_out, codes, out.tokens, ready), SpeechFrameState(codec_state, lm_state)

    return fn


def make_speech_frame_step(cfg: SpeechFrameConfig, *, kernels: str = "reference", codec_rope_freqs=None,
                           lm_rope_freqs=None, temperature: float = 0.0, top_k: int = 0,
                           text_temperature: float = 0.0, text_top_k: int = 0, donate: bool = True):
    """A jitted speech frame: step(params, state, pcm, active=None, seeds=None) -> (SpeechFrameOutput,
    new state); the state is donated (keep only the returned one).

    pcm [B, 1, frame_size] float (the state's dtype, or one that widens to it exactly); active bool
    [B] (default: every row); seeds int [B] when a temperature is > 0 (the sampler's, as the LM
    frame's). kernels: "reference" or "twin"; codec_rope_freqs / lm_rope_freqs: the torch twin's
    RoPE tables (`SpeechFrame.rope_freqs()`) for the twin bits. Every argument is checked on the
    host before the call (naming it: TypeError for a type or dtype, ValueError for a shape or value),
    so a refused call leaves the state valid. So is the offsets' room (`state.OffsetBounds`: no device
    read a step): a step that would take an offset past the index dtype (int32: 2**31 - 1 positions,
    ~2.7 years of frames for the codec's transformers) raises OverflowError; `jit_speech_reset_slot`
    the row first.
    """
    if not isinstance(cfg, SpeechFrameConfig):
        raise TypeError(f"cfg must be a SpeechFrameConfig, got {type(cfg).__name__}")
    check_frame_kernels(cfg, kernels, "make_speech_frame_step(kernels)")  # the codec's transformer too
    check_sampling(text_temperature, text_top_k, cfg.lm.text_card)
    check_sampling(temperature, top_k, cfg.lm.card)
    sampled = bool(temperature or text_temperature)
    fn = speech_frame_fn(cfg, kernels=kernels, codec_rope_freqs=codec_rope_freqs, lm_rope_freqs=lm_rope_freqs,
                         temperature=temperature, top_k=top_k, text_temperature=text_temperature,
                         text_top_k=text_top_k)
    jitted = jax.jit(backend.traced_on(fn), donate_argnums=(1,) if donate else ())

    def step(params: SpeechFrameParams, state: SpeechFrameState, pcm, active=None, seeds=None):
        if not isinstance(state, SpeechFrameState):
            raise TypeError(f"state must be a jax_impl.speech_frame.SpeechFrameState, got {type(state).__name__}")
        st.check_live("step(state)", state)
        B = state.batch_size
        where = state.lm.frame_offset.sharding
        jcodec.check_pcm("step", pcm, B, cfg.frame_size, state.codec.encoder_transformer.k.dtype)
        active = np.ones(B, bool) if active is None else st.check_row_flags("step", "active", active, B)
        if sampled:
            check_seeds(seeds, B, is_integer_array)
            seeds = jax.device_put(seeds, where)
        else:
            seeds = None
        T = cfg.codec.downsample_stride  # the codec's transformers' positions a frame; the LM's: 1
        return st.OFFSET_BOUNDS.step(
            "step(state)", "jit_speech_reset_slot", speech_offsets, lambda name: T if name.startswith("codec.") else 1,
            state, lambda s: jitted(params, s, jax.device_put(pcm, where), jax.device_put(active, where), seeds))

    return step


def speech_offsets(state: SpeechFrameState) -> dict[str, jax.Array]:
    """The offset arrays [B] a step advances, by name (`speech_state_arrays`'): the codec's transformers'
    (`codec.codec_offsets`, `downsample_stride` positions a frame each), the LM frame's
    (`frame.frame_offsets`, 1 a frame each)."""
    return ({f"codec.{k}": v for k, v in jcodec.codec_offsets(state.codec).items()}
            | {f"lm.{k}": v for k, v in jframe.frame_offsets(state.lm).items()})


# ----------------------------------------------------------------------------- recycling
def speech_reset_slot(state: SpeechFrameState, b) -> SpeechFrameState:
    """Row b starts a fresh session: the codec's `codec_reset_slot` (carries zeroed, first-frame flag
    set, its transformers' rows reset with zeroed rings) and the LM frame's `reset_rows` (ring
    zeroed, positions, frame offset and token cache as a fresh row's). The row's state is then a
    fresh state's row, bit for bit."""
    row = st.row_mask("reset_slot", state.lm.temporal, b)
    return SpeechFrameState(jcodec.codec_reset_slot(state.codec, b), jframe.reset_rows(state.lm, row))


_jit_reset_slot = jax.jit(speech_reset_slot, donate_argnums=(0,))


def jit_speech_reset_slot(state: SpeechFrameState, b) -> SpeechFrameState:
    """`speech_reset_slot` jitted once for every row (b traced), state donated; a concrete b is
    checked on the host first (IndexError / TypeError, state untouched)."""
    if not isinstance(state, SpeechFrameState):
        raise TypeError(f"reset_slot(state): expected a SpeechFrameState, got {type(state).__name__}")
    st.check_live("reset_slot(state)", state)
    if not isinstance(b, jax.core.Tracer):
        st.check_row("reset_slot", state.lm.temporal, b)
    return _jit_reset_slot(state, b)


def speech_state_arrays(state: SpeechFrameState) -> dict[str, jax.Array]:
    """Every array of the state by name (`torch_bridge.SpeechFrame.state_arrays` names the torch
    twin's the same way): codec.encoder, codec.decoder (each side's row-packed carries), codec.first,
    codec.{encoder,decoder}_transformer.{k,v,offset,start_offset}, lm.token_cache, lm.frame_offset,
    lm.temporal.{k,v,offset,start_offset}. k and v hold the batch on axis 1, the others on axis 0."""
    c, lm = state.codec, state.lm
    out = {"codec.encoder": c.encoder, "codec.decoder": c.decoder, "codec.first": c.first}
    for name, ring in (("codec.encoder_transformer", c.encoder_transformer),
                       ("codec.decoder_transformer", c.decoder_transformer), ("lm.temporal", lm.temporal)):
        out |= {f"{name}.{k}": getattr(ring, k) for k in ("k", "v", "offset", "start_offset")}
    out["lm.token_cache"] = lm.token_cache
    out["lm.frame_offset"] = lm.frame_offset
    return out
