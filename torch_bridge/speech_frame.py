"""The whole speech frame, PyTorch: `MimiCodec` + `LMFrame`, the torch twin of `jax_impl.speech_frame`.

    frame = SpeechFrame.from_config(SPEECH_PRESETS["moshi-small"])
    frame.load_weights(lm_state_dict, codec_state_dict)    # or init_weights(...)
    frame.streaming_init(batch_size=4)
    out = frame.step(pcm, active)                            # SpeechFrameOutput: pcm, user_codes, tokens, ready
    frame.reset_slot(2)                                      # row 2: a fresh session

A frame: `codec.encode_frame` -> the user's codes -> `LMFrame.step` (as user tokens on Moshi's
layout, as the depformer's replaced tail on PersonaPlex's: `jax_impl.speech_frame_config`) -> the
model's codes (the undelayed tokens 1..num_codebooks) -> `codec.decode_frame` -> PCM. As moshi's
serving loop (`moshi/run_inference.py`), the decoder runs only on frames whose tokens the LM
returned: until a row's delays pass its PCM is zeros and its decoder state does not move.

kernels="reference": moshi's bits (the codec is bit-exact with its streaming `MimiModel`, the LM
frame with `LMGen.step`): a `MimiModel` + `LMGen` loop run the same way gives the same codes and PCM.
kernels="twin": the Triton twins, the bits of `jax_impl.speech_frame.make_speech_frame_step(kernels="twin")`
for the PCM, every code and every state tensor (`state_arrays`), whatever the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from jax_impl.config import check_batch_size
from jax_impl.frame_config import check_frame_kernels
from jax_impl.speech_frame_config import SpeechFrameConfig, SpeechFrameOutput

from .codec import MimiCodec
from .frame import LMFrame, check_offset_room, jax_frame_params


class SpeechFrame(nn.Module):
    """The Mimi codec (`codec`) around the LM frame (`lm`), one frame a `step`."""

    def __init__(self, config: SpeechFrameConfig, dtype=torch.float32, device=None, kernels: str = "reference"):
        super().__init__()
        if not isinstance(config, SpeechFrameConfig):
            raise TypeError(f"config must be a SpeechFrameConfig, got {type(config).__name__}")
        self.config, self.kernels = config, check_frame_kernels(config, kernels, "SpeechFrame(kernels)")
        self.codec = MimiCodec.from_config(config.codec, dtype=dtype, device=device, kernels=kernels)
        self.lm = LMFrame.from_config(config.lm, dtype=dtype, device=device, kernels=kernels)

    @classmethod
    def from_config(cls, config: SpeechFrameConfig, *, dtype=torch.float32, device=None, kernels: str = "reference"):
        return cls(config, dtype=dtype, device=device, kernels=kernels)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm.dtype

    @property
    def device(self) -> torch.device:
        return self.lm.device

    # ----------------------------------------------------------------------------- weights
    def init_weights(self, *, lm_std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random weights: the codec's `init_weights`, the LM frame's N(0, lm_std)."""
        self.codec.init_weights(generator=generator)
        self.lm.init_weights(std=lm_std, generator=generator)

    def load_weights(self, lm_state_dict: Mapping, codec_state_dict: Mapping, *, lm_source: str = "lm state_dict",
                     codec_source: str = "codec state_dict") -> None:
        """The LM's (a released `model.safetensors`'s or a moshi `LMModel.state_dict()`'s names) and the
        codec's (`tokenizer-*.safetensors`, a moshi `MimiModel.state_dict()`) weights. Each part checks
        every key, shape and dtype before writing (`CheckpointError` listing every problem);
        the codec's is loaded first and put back as it was if the LM's is refused: all or nothing."""
        before = {k: v.clone() for k, v in self.codec.state_dict().items()}
        self.codec.load_weights(codec_state_dict, source=codec_source)
        try:
            self.lm.load_weights(lm_state_dict, source=lm_source)
        except BaseException:
            self.codec.load_state_dict(before)
            raise

    def rope_freqs(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(the codec transformers' RoPE table, the temporal stack's): the JAX twin step's
        `codec_rope_freqs`, `lm_rope_freqs`."""
        return self.codec.rope_freqs(), self.lm.temporal.rope_freqs()

    def jax_params(self):
        """The JAX frame's `SpeechFrameParams` as DLPack views of this frame's buffers (no copy)."""
        from jax_impl.speech_frame import SpeechFrameParams

        return SpeechFrameParams(self.codec.jax_params(), jax_frame_params(self.lm))

    # ----------------------------------------------------------------------------- streaming
    def streaming_init(self, batch_size: int) -> None:
        """A fresh stream of `batch_size` rows (the codec's and the LM frame's): a Python or numpy integer >= 1."""
        batch_size = check_batch_size("SpeechFrame.streaming_init", batch_size)
        self.codec.streaming_init(batch_size)
        self.lm.streaming_init(batch_size)

    @property
    def batch_size(self) -> int:
        return self.lm.batch_size

    def reset_slot(self, b: int) -> None:
        """Row b starts a fresh session: the codec's `reset_slot` and the LM frame's `reset_rows` (its
        ring zeroed, positions, frame offset and token cache a fresh row's): nothing of the old
        session is left in any part of the state."""
        b = self.lm.check_row("reset_slot", b)
        self.codec.reset_slot(b)
        self.lm.reset_rows(torch.arange(self.batch_size, device=self.device) == b)

    def offsets(self) -> dict[str, torch.Tensor]:
        """The offsets (int64 [B]) a step advances, by name, as `jax_impl.speech_frame.speech_offsets` names
        the JAX state's: the codec's (`MimiCodec.offsets`, `downsample_stride` positions a frame each) and
        the LM frame's (`LMFrame.offsets`, 1 a frame each), prefixed codec. and lm."""
        return ({f"codec.{k}": v for k, v in self.codec.offsets().items()}
                | {f"lm.{k}": v for k, v in self.lm.offsets().items()})

    def state_arrays(self) -> dict[str, torch.Tensor]:
        """Every state tensor by name, as `jax_impl.speech_frame.speech_state_arrays` names the JAX
        state's: the tensors themselves, but for each side's carries, concatenated into one [B, N]
        tensor laid out as the JAX state's row-packed carries (`codec_config.carry_slots`)."""
        s = self.codec.state
        out = {f"codec.{side}": torch.cat([x.flatten(1) for x in carries], 1)
               for side, carries in (("encoder", s.encoder), ("decoder", s.decoder))}
        out["codec.first"] = s.first
        for name, ring in (("codec.encoder_transformer", self.codec.encoder_transformer.state),
                           ("codec.decoder_transformer", self.codec.decoder_transformer.state),
                           ("lm.temporal", self.lm.temporal.state)):
            out |= {f"{name}.{k}": getattr(ring, k) for k in ("k", "v", "offset", "start_offset")}
        out["lm.token_cache"] = self.lm.token_cache
        out["lm.frame_offset"] = self.lm.frame_offset
        return out

    # ----------------------------------------------------------------------------- one frame
    @torch.no_grad()
    def step(self, pcm: torch.Tensor, active: torch.Tensor | None = None, *, seeds=None, temperature: float = 0.0,
             top_k: int = 0, text_temperature: float = 0.0, text_top_k: int = 0) -> SpeechFrameOutput:
        """One frame for every row: pcm [B, 1, frame_size] (the frame's dtype, or one that widens to it
        exactly) -> `SpeechFrameOutput`. active bool [B] (default: every row; an inactive row is inert).
        seeds, temperature, top_k, text_temperature, text_top_k: the LM frame's sampling.
        Checked before anything moves, naming the argument: TypeError for a type or dtype, ValueError for a
        shape, device or value, and OverflowError for a frame that would take an offset past the JAX steps'
        index dtype (`frame.check_offset_room`): `reset_slot` the row first."""
        c = self.config
        self.codec.check_pcm("step", pcm)
        active = self.codec.check_active("step", active, self.codec.state)
        sampling = {"seeds": seeds, "temperature": temperature, "top_k": top_k, "text_temperature": text_temperature,
                    "text_top_k": text_top_k}
        self.lm.check_sampling_args(**sampling)  # before the encoder's state moves
        offsets = self.offsets()
        advance = {name: c.codec.downsample_stride if name.startswith("codec.") else 1 for name in offsets}
        check_offset_room("step", "reset_slot", offsets, advance)
        codes = self.codec.encode_frame(pcm, active)
        if c.user_path == "user_tokens":
            out = self.lm.step(codes, active, **sampling)
        else:
            out = self.lm.step(None, active, replace_audio=codes, dep_q_exit=c.dep_q_exit, **sampling)
        model_codes = out.tokens[:, 1:1 + c.num_codebooks]
        ready = model_codes[:, 0] >= 0
        pcm_out = self.codec.decode_frame(torch.where(ready[:, None], model_codes, 0), ready)
        return SpeechFrameOutput(pcm_out, codes, out.tokens, ready)


__all__ = ["SpeechFrame"]
