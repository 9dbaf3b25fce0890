"""Framework-neutral configuration of the Mimi codec, and its layer plan.

Imported by both `torch_bridge` and `jax_impl`; it imports neither torch nor jax.

- `CodecConfig`: the Mimi codec as Moshi and PersonaPlex ship it (moshi 0.2.13's
  `loaders._seanet_kwargs`, `_quantizer_kwargs`, `_transformer_kwargs`), 8 codebooks used.
- `CODEC_PRESETS`: that config and two small ones for tests.
- `encoder_plan(cfg)` / `decoder_plan(cfg)`: the SEANet convolutions in order, each a `ConvSpec`
  named by its key in a moshi `MimiModel.state_dict()` (the released `tokenizer-*.safetensors` names),
  the residual blocks as `Residual` pairs. Both sides walk these plans: one declaration of the layers.
- `codec_weight_shapes(cfg)`: every checkpoint key the codec reads (transformers excepted) -> shape.

One frame: `frame_size` PCM samples (1,920 = 80 ms at 24 kHz) -> SEANet encoder (hop `hop_length`,
`downsample_stride` latent frames at the encoder rate, 25 Hz) -> encoder transformer (T = that many
frames a step) -> the learnt stride-2 downsample -> one latent frame (12.5 Hz) -> split residual
vector quantizer -> `num_codebooks` codes; and back: codes -> summed codebook entries -> the
channel-wise transposed upsample -> decoder transformer -> SEANet decoder -> `frame_size` samples.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from .config import MimiConfig, check_positive_ints, finite_real

# EuclideanCodebook's clamp of the cluster usage: entry = embedding_sum / max(cluster_usage, eps).
CODEBOOK_EPS = 1e-5


@dataclass(frozen=True)
class ConvSpec:
    """One streaming convolution of the codec (moshi's `StreamingConv1d` / `StreamingConvTranspose1d`).

    key: the checkpoint prefix of its `.weight` / `.bias`. elu: an ELU runs on its input first.
    transposed: a transposed convolution (weight [in, out / groups, kernel]), else a convolution
    (weight [out, in / groups, kernel]). replicate: the first frame pads with its first sample
    (the downsample's `pad_mode="replicate"`), else with zeros.
    """

    key: str
    in_channels: int
    out_channels: int
    kernel_size: int
    stride: int = 1
    dilation: int = 1
    groups: int = 1
    bias: bool = True
    transposed: bool = False
    replicate: bool = False
    elu: bool = False

    @property
    def weight_shape(self) -> tuple[int, int, int]:
        if self.transposed:
            return (self.in_channels, self.out_channels // self.groups, self.kernel_size)
        return (self.out_channels, self.in_channels // self.groups, self.kernel_size)

    @property
    def carry(self) -> int:
        """Samples of streaming state per channel: a convolution keeps the last
        (kernel - 1) * dilation + 1 - stride input samples (its left context, `in_channels` rows), a
        transposed one the kernel - stride output samples that overlap the next frame (`out_channels`)."""
        if self.transposed:
            return self.kernel_size - self.stride
        return (self.kernel_size - 1) * self.dilation + 1 - self.stride

    @property
    def carry_channels(self) -> int:
        return self.out_channels if self.transposed else self.in_channels


@dataclass(frozen=True)
class Residual:
    """A SEANet residual block: x + convs[-1](... convs[0](x)), each conv with an ELU before it."""

    convs: tuple[ConvSpec, ...]


PlanItem = ConvSpec | Residual


@dataclass(frozen=True)
class CodecConfig:
    """The Mimi codec. Defaults: Mimi as Moshi and PersonaPlex ship it (24 kHz, 12.5 Hz, 8 of 32 codebooks).

    SEANet: `n_filters` channels after the first convolution (kernel `kernel_size`), doubled by each
    strided stage (strides `ratios` reversed in the encoder, kernel 2 * ratio), `n_residual_layers`
    residual blocks per stage (kernel `residual_kernel_size` with dilation `dilation_base**j`, then
    kernel 1; `compress` halves their width), a last convolution of kernel `last_kernel_size` to
    `dimension` (decoder: to 1 channel). transformer: the encoder's and decoder's `MimiConfig` (the
    ring convention "moshi": moshi's `RingKVCache`, as Mimi runs in both products). Quantizer:
    `semantic_codebooks` + acoustic codebooks of `codebook_size` entries of `codebook_dim`, of which a
    checkpoint holds `total_codebooks` and a frame uses the first `num_codebooks`.
    """

    sample_rate: int = 24000
    frame_rate: float = 12.5
    dimension: int = 512
    n_filters: int = 64
    ratios: tuple[int, ...] = (8, 6, 5, 4)
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    n_residual_layers: int = 1
    dilation_base: int = 2
    compress: int = 2
    transformer: MimiConfig = field(default_factory=lambda: MimiConfig(ring_convention="moshi"))
    codebook_size: int = 2048
    codebook_dim: int = 256
    num_codebooks: int = 8
    total_codebooks: int = 32
    semantic_codebooks: int = 1

    def __post_init__(self):
        check_positive_ints(self, ("sample_rate", "dimension", "n_filters", "kernel_size", "last_kernel_size",
                                    "residual_kernel_size", "n_residual_layers", "dilation_base", "compress",
                                    "codebook_size", "codebook_dim", "num_codebooks", "total_codebooks",
                                    "semantic_codebooks"))
        rate = self.frame_rate
        if not (finite_real(rate) and rate > 0):
            raise ValueError(f"CodecConfig.frame_rate must be a finite number > 0, got {rate!r}")
        if (not isinstance(self.ratios, tuple) or not self.ratios
                or any(not isinstance(r, int) or isinstance(r, bool) or r <= 0 for r in self.ratios)):
            raise ValueError(f"CodecConfig.ratios must be a non-empty tuple of positive ints, got {self.ratios!r}")
        if not isinstance(self.transformer, MimiConfig):
            raise TypeError(f"CodecConfig.transformer must be a MimiConfig, got {type(self.transformer).__name__}")
        if self.transformer.dim != self.dimension:
            raise ValueError(f"CodecConfig.transformer.dim ({self.transformer.dim}) must equal "
                             f"CodecConfig.dimension ({self.dimension})")
        if self.n_filters % self.compress:
            raise ValueError(f"CodecConfig.n_filters ({self.n_filters}) must be divisible by "
                             f"CodecConfig.compress ({self.compress})")
        frame_size = self.sample_rate / rate
        if frame_size != int(frame_size) or frame_size % self.hop_length:
            raise ValueError(f"CodecConfig.sample_rate / frame_rate ({frame_size!r}) must be a whole multiple of "
                             f"the SEANet hop, the product of CodecConfig.ratios ({self.hop_length})")
        if self.transformer.context < self.downsample_stride:
            raise ValueError(f"CodecConfig.transformer.context ({self.transformer.context}) must hold one step's "
                             f"{self.downsample_stride} frames")
        if self.total_codebooks <= self.semantic_codebooks:
            raise ValueError(f"CodecConfig.total_codebooks ({self.total_codebooks}) must exceed "
                             f"CodecConfig.semantic_codebooks ({self.semantic_codebooks})")
        if not self.semantic_codebooks <= self.num_codebooks <= self.total_codebooks:
            raise ValueError(f"CodecConfig.num_codebooks must be in semantic_codebooks..total_codebooks "
                             f"({self.semantic_codebooks}..{self.total_codebooks}), got {self.num_codebooks}")

    @property
    def hop_length(self) -> int:
        """PCM samples per latent frame at the encoder's rate (the product of the ratios: 960)."""
        return math.prod(self.ratios)

    @property
    def frame_size(self) -> int:
        """PCM samples per codec frame (1,920)."""
        return round(self.sample_rate / self.frame_rate)

    @property
    def downsample_stride(self) -> int:
        """Encoder-rate frames per codec frame (2): the transformers' T per step."""
        return self.frame_size // self.hop_length

    @property
    def acoustic_codebooks(self) -> int:
        """The acoustic codebooks a frame uses (num_codebooks - semantic_codebooks)."""
        return self.num_codebooks - self.semantic_codebooks


def with_codec_options(config: CodecConfig, **changes) -> CodecConfig:
    """A copy of `config` with some fields replaced (validated again)."""
    return dataclasses.replace(config, **changes)


def encoder_plan(cfg: CodecConfig) -> tuple[PlanItem, ...]:
    """The SEANet encoder, then the learnt downsample (`downsample.conv.conv.conv`), in order.

    `index` follows moshi's `nn.Sequential`, where each ELU is a module of its own (no weights).
    """
    plan: list[PlanItem] = [ConvSpec("encoder.model.0.conv.conv", 1, cfg.n_filters, cfg.kernel_size)]
    index, channels = 1, cfg.n_filters
    for ratio in reversed(cfg.ratios):
        for j in range(cfg.n_residual_layers):
            plan.append(_residual(cfg, f"encoder.model.{index}", channels, j))
            index += 1
        plan.append(ConvSpec(f"encoder.model.{index + 1}.conv.conv", channels, 2 * channels, 2 * ratio,
                             stride=ratio, elu=True))
        index, channels = index + 2, 2 * channels
    plan.append(ConvSpec(f"encoder.model.{index + 1}.conv.conv", channels, cfg.dimension, cfg.last_kernel_size,
                         elu=True))
    stride = cfg.downsample_stride
    plan.append(ConvSpec("downsample.conv.conv.conv", cfg.dimension, cfg.dimension, 2 * stride, stride=stride,
                         bias=False, replicate=True))
    return tuple(plan)


def decoder_plan(cfg: CodecConfig) -> tuple[PlanItem, ...]:
    """The channel-wise transposed upsample (`upsample.convtr.convtr.convtr`), then the SEANet decoder.

    The upsample is grouped per channel and has no bias (moshi's `upsample_channel_wise_bug=True`).
    """
    stride = cfg.downsample_stride
    channels = cfg.n_filters * 2 ** len(cfg.ratios)
    plan: list[PlanItem] = [
        ConvSpec("upsample.convtr.convtr.convtr", cfg.dimension, cfg.dimension, 2 * stride, stride=stride,
                 groups=cfg.dimension, bias=False, transposed=True),
        ConvSpec("decoder.model.0.conv.conv", cfg.dimension, channels, cfg.kernel_size),
    ]
    index = 1
    for ratio in cfg.ratios:
        plan.append(ConvSpec(f"decoder.model.{index + 1}.convtr.convtr", channels, channels // 2, 2 * ratio,
                             stride=ratio, transposed=True, elu=True))
        index, channels = index + 2, channels // 2
        for j in range(cfg.n_residual_layers):
            plan.append(_residual(cfg, f"decoder.model.{index}", channels, j))
            index += 1
    plan.append(ConvSpec(f"decoder.model.{index + 1}.conv.conv", channels, 1, cfg.last_kernel_size, elu=True))
    return tuple(plan)


def _residual(cfg: CodecConfig, key: str, channels: int, j: int) -> Residual:
    hidden = channels // cfg.compress
    return Residual((
        ConvSpec(f"{key}.block.1.conv.conv", channels, hidden, cfg.residual_kernel_size,
                 dilation=cfg.dilation_base ** j, elu=True),
        ConvSpec(f"{key}.block.3.conv.conv", hidden, channels, 1, elu=True),
    ))


def plan_convs(plan: tuple[PlanItem, ...]) -> tuple[ConvSpec, ...]:
    """The convolutions of a plan, residual blocks flattened, in order."""
    return tuple(c for item in plan for c in (item.convs if isinstance(item, Residual) else (item,)))


def carry_slots(plan: tuple[PlanItem, ...]) -> tuple[tuple[tuple[int, int] | None, ...], int]:
    """Where each convolution of `plan_convs(plan)` keeps its carry in a row of a row-packed state
    [B, N]: (offset, width) of its [carry_channels, width] block (None: a convolution without one, of
    kernel 1), the blocks one after the other in the plan's order; and N, a row's length."""
    slots, at = [], 0
    for c in plan_convs(plan):
        slots.append((at, c.carry) if c.carry else None)
        at += c.carry_channels * c.carry
    return tuple(slots), at


def walk_plan(plan, x, carries, conv):
    """A plan's convolutions on one frame, the one walk both frameworks run: `conv(spec, h, carry,
    residual) -> (y, carry)` is one convolution with its streaming carry, the ELU on h first where
    `spec.elu` asks for it and `residual` (or None) added to its output last: a `Residual`'s last
    convolution adds the block's input (its branch added to its input, as one step of the
    convolution, where a kernel can fuse it). x: [B, C, L]; carries: one per convolution, in the
    plan's order. Returns (y, new carries)."""
    carries = list(carries)
    index = 0

    def step(spec: ConvSpec, h, residual=None):
        nonlocal index
        h, carries[index] = conv(spec, h, carries[index], residual)
        index += 1
        return h

    for item in plan:
        if isinstance(item, Residual):
            h = x
            for n, spec in enumerate(item.convs):
                h = step(spec, h, x if n == len(item.convs) - 1 else None)
            x = h
        else:
            x = step(item, x)
    return x, carries


def quantizer_keys(cfg: CodecConfig) -> tuple[tuple[str, int, int], ...]:
    """(checkpoint prefix, first codebook, codebooks) of the two residual quantizers."""
    return (("quantizer.rvq_first", 0, cfg.semantic_codebooks),
            ("quantizer.rvq_rest", cfg.semantic_codebooks, cfg.total_codebooks - cfg.semantic_codebooks))


def codec_weight_shapes(cfg: CodecConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key of the codec outside its two transformers -> shape (moshi's names).

    All `total_codebooks` codebooks are keys of a checkpoint (a frame uses the first `num_codebooks`).
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for conv in plan_convs(encoder_plan(cfg)) + plan_convs(decoder_plan(cfg)):
        shapes[conv.key + ".weight"] = conv.weight_shape
        if conv.bias:
            shapes[conv.key + ".bias"] = (conv.out_channels,)
    d, k = cfg.dimension, cfg.codebook_dim
    for prefix, _, count in quantizer_keys(cfg):
        shapes[f"{prefix}.input_proj.weight"] = (k, d, 1)
        shapes[f"{prefix}.output_proj.weight"] = (d, k, 1)
        for i in range(count):
            book = f"{prefix}.vq.layers.{i}._codebook."
            shapes[book + "_initialized"] = (1,)
            shapes[book + "cluster_usage"] = (cfg.codebook_size,)
            shapes[book + "embedding_sum"] = (cfg.codebook_size, k)
    return shapes


CODEC_PRESETS: dict[str, CodecConfig] = {
    "mimi": CodecConfig(),
    # The real SEANet geometry (1,920-sample frames, the same strides and kernels), narrow.
    "mimi-small": CodecConfig(n_filters=4, dimension=32, codebook_size=64, codebook_dim=16, num_codebooks=4,
                              total_codebooks=6,
                              transformer=MimiConfig(num_layers=2, dim=32, num_heads=4, context=10, ffn=64,
                                                     ring_convention="moshi")),
    # 32-sample frames (ratios 4, 2, 2 at 400 Hz): the fast test size.
    "mimi-tiny": CodecConfig(sample_rate=400, ratios=(4, 2, 2), n_filters=4, dimension=16, codebook_size=32,
                             codebook_dim=8, num_codebooks=3, total_codebooks=4,
                             transformer=MimiConfig(num_layers=2, dim=16, num_heads=2, context=6, ffn=32,
                                                    ring_convention="moshi")),
}
