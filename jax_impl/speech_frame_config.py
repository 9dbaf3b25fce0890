"""Framework-neutral configuration of the whole speech frame: the Mimi codec around the LM frame.

One speech frame (80 ms at 24 kHz in the real sizes):

    user PCM [B, 1, frame_size] -> codec encode -> the user's codes [B, num_codebooks]
    -> the LM frame (temporal stack + depformer) -> the model's codes [B, num_codebooks]
    -> codec decode -> model PCM [B, 1, frame_size]

How the user's codes enter the LM frame depends on the LM's layout (`SpeechFrameConfig.user_path`):

- "user_tokens" (Moshi: n_q = 2 * dep_q): the LM's caller-given codebooks dep_q+1..n_q, exactly
  where moshi's `LMGen.step` takes its input tokens (written `delay` frames ahead).
- "replace_audio" (PersonaPlex: dep_q = n_q, the depformer also predicts the user's codebooks):
  the depformer stops after the model's codebooks (`dep_q_exit = num_codebooks`) and the user's
  codes replace the rest (`LMFrame`'s `replace_audio`, moshi's `depformer_replace_tokens`).

The model's codes are the LM frame's undelayed audio tokens 1..num_codebooks (moshi's serving loop
decodes `tokens[:, 1:]`).

Imported by both `torch_bridge` and `jax_impl`; it imports neither torch nor jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .codec_config import CODEC_PRESETS, CodecConfig, with_codec_options
from .config import MimiConfig, TemporalConfig
from .depformer_config import DepformerConfig
from .frame_config import FRAME_PRESETS, FrameConfig

USER_PATHS = ("user_tokens", "replace_audio")


@dataclass(frozen=True)
class SpeechFrameConfig:
    """codec: the Mimi codec; lm: the LM frame. Checked consistent: the codec's codes are the LM's
    audio tokens (codebook_size = the LM's card) and its num_codebooks are both the user's and the
    model's audio codebooks of the LM (module docstring: the two layouts)."""

    codec: CodecConfig
    lm: FrameConfig

    def __post_init__(self):
        if not isinstance(self.codec, CodecConfig):
            raise TypeError(f"SpeechFrameConfig.codec must be a CodecConfig, got {type(self.codec).__name__}")
        if not isinstance(self.lm, FrameConfig):
            raise TypeError(f"SpeechFrameConfig.lm must be a FrameConfig, got {type(self.lm).__name__}")
        n, lm = self.codec.num_codebooks, self.lm
        if self.codec.codebook_size != lm.card:
            raise ValueError(f"SpeechFrameConfig: codec.codebook_size ({self.codec.codebook_size}) must be the LM's "
                             f"audio card ({lm.card}): the codec's codes are the LM's audio tokens")
        if not ((lm.user_codebooks == n and lm.dep_q == n) or (lm.user_codebooks == 0 and lm.dep_q == 2 * n)):
            raise ValueError(f"SpeechFrameConfig: the codec's {n} codebooks must be the LM's user and model "
                             f"codebooks: n_q - dep_q = dep_q = {n} (Moshi's layout) or n_q = dep_q = {2 * n} "
                             f"(PersonaPlex's); the LM has n_q {lm.n_q}, dep_q {lm.dep_q}")

    @property
    def num_codebooks(self) -> int:
        """Codes a frame of each speaker: the codec's."""
        return self.codec.num_codebooks

    @property
    def frame_size(self) -> int:
        """PCM samples a frame (1,920 at 24 kHz)."""
        return self.codec.frame_size

    @property
    def user_path(self) -> str:
        """"user_tokens" (Moshi's layout) or "replace_audio" (PersonaPlex's): module docstring."""
        return "user_tokens" if self.lm.user_codebooks else "replace_audio"

    @property
    def dep_q_exit(self) -> int | None:
        """The depformer's steps a frame: all (None) on the "user_tokens" path, the model's codebooks
        on the "replace_audio" path."""
        return None if self.user_path == "user_tokens" else self.num_codebooks

    @property
    def max_delay(self) -> int:
        """Frames before the LM returns tokens: the model's first PCM comes out of frame max_delay
        (0-based), zeros before (moshi's serving loop decodes only when `LMGen.step` returns tokens)."""
        return self.lm.max_delay


class SpeechFrameOutput(NamedTuple):
    """What a speech frame step returns (jax arrays or torch tensors; the same fields on both sides).

    pcm [B, 1, frame_size] (the frame's dtype): the model's speech, zeros where not `ready`.
    user_codes int [B, num_codebooks]: the encoder's codes of the input (zeros for inactive rows).
    tokens int [B, 1 + dep_q]: the LM frame's undelayed tokens (text first; -2 while the delays
    have not passed, and for inactive rows). ready bool [B]: the frame decoded model codes."""

    pcm: Any
    user_codes: Any
    tokens: Any
    ready: Any


def _small_lm(layout: str, convention: str, codebooks: int, card: int, *, dim: int, heads: int, hidden: int,
              context: int, dep_dim: int, dep_heads: int, dep_hidden: int, layers: int) -> FrameConfig:
    """A small LM frame for `codebooks` codes a speaker; delays up to 2 (the cache cycles)."""
    dep_q = codebooks if layout == "user_tokens" else 2 * codebooks
    half = (0, *((1, 2) * codebooks)[:codebooks - 1])
    temporal = TemporalConfig(dim=dim, num_layers=layers, num_heads=heads, hidden=hidden, context=context,
                              text_card=50, ring_convention=convention)
    depformer = DepformerConfig(dim=dep_dim, num_layers=layers, num_heads=dep_heads, hidden=dep_hidden, dep_q=dep_q,
                                weight_sets=codebooks, card=card, text_card=50, temporal_dim=dim)
    return FrameConfig(temporal, depformer, n_q=2 * codebooks, delays=(0, *half, *half))


# 32-sample frames at 400 Hz, one layer everywhere: the twin kernels' test size (they run interpreted
# on the CPU).
_TINY_CODEC = with_codec_options(CODEC_PRESETS["mimi-tiny"], ratios=(4, 2),
                                 transformer=MimiConfig(num_layers=1, dim=16, num_heads=2, context=6, ffn=32,
                                                        ring_convention="moshi"))
_SMALL_CODEC = CODEC_PRESETS["mimi-small"]  # the real 1,920-sample geometry, narrow
_SMALL = {"dim": 48, "heads": 3, "hidden": 132, "context": 12, "dep_dim": 64, "dep_heads": 4, "dep_hidden": 176,
          "layers": 2}
_TINY = {"dim": 32, "heads": 2, "hidden": 64, "context": 6, "dep_dim": 32, "dep_heads": 2, "dep_hidden": 64,
         "layers": 1}

SPEECH_PRESETS: dict[str, SpeechFrameConfig] = {
    "moshi": SpeechFrameConfig(CODEC_PRESETS["mimi"], FRAME_PRESETS["moshi"]),
    "personaplex": SpeechFrameConfig(CODEC_PRESETS["mimi"], FRAME_PRESETS["personaplex"]),
    "moshi-small": SpeechFrameConfig(_SMALL_CODEC, _small_lm("user_tokens", "moshi", _SMALL_CODEC.num_codebooks,
                                                             _SMALL_CODEC.codebook_size, **_SMALL)),
    "personaplex-small": SpeechFrameConfig(_SMALL_CODEC, _small_lm("replace_audio", "personaplex",
                                                                   _SMALL_CODEC.num_codebooks,
                                                                   _SMALL_CODEC.codebook_size, **_SMALL)),
    "moshi-tiny": SpeechFrameConfig(_TINY_CODEC, _small_lm("user_tokens", "moshi", _TINY_CODEC.num_codebooks,
                                                           _TINY_CODEC.codebook_size, **_TINY)),
    "personaplex-tiny": SpeechFrameConfig(_TINY_CODEC, _small_lm("replace_audio", "personaplex",
                                                                 _TINY_CODEC.num_codebooks,
                                                                 _TINY_CODEC.codebook_size, **_TINY)),
}


def describe(cfg: SpeechFrameConfig) -> str:
    c, t = cfg.codec, cfg.lm.temporal
    return (f"speech frame: codec {c.sample_rate} Hz, {c.frame_size}-sample frames, {c.num_codebooks} codebooks of "
            f"{c.codebook_size}; LM temporal dim {t.dim} x {t.num_layers} layers, context {t.context}, "
            f"n_q {cfg.lm.n_q}, dep_q {cfg.lm.dep_q}, max delay {cfg.max_delay}; user codes via {cfg.user_path}")
