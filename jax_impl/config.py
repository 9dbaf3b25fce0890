"""Framework-neutral configuration of the two streaming stacks.

Imported by both `torch_bridge` and `jax_impl`; it imports neither torch nor jax.

- `TemporalConfig`: the Helium temporal backbone (7B defaults), T=1 per step.
- `MimiConfig`: the Mimi codec transformer, T=2 (encoder) or T=10 per step.
- `weight_specs(config)`: the stacked weight buffers and their Moshi checkpoint keys.
- `check_checkpoint(shapes, config, prefix)`: one error listing every missing, unexpected
  or mis-shaped key.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

RING_CONVENTIONS = ("personaplex", "moshi")
MIMI_PREFIXES = ("encoder_transformer", "decoder_transformer")


def _check_positive(config, names: Sequence[str]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_common(config) -> None:
    _check_positive(config, ("dim", "num_layers", "num_heads", "context"))
    if config.dim % config.num_heads:
        raise ValueError(f"dim ({config.dim}) must be divisible by num_heads ({config.num_heads})")
    if config.head_dim % 2:
        raise ValueError(f"head_dim = dim // num_heads must be even for RoPE, got {config.head_dim}")
    if config.ring_convention not in RING_CONVENTIONS:
        raise ValueError(f"ring_convention must be one of {RING_CONVENTIONS}, got {config.ring_convention!r}")
    if not config.max_period > 1.0:
        raise ValueError(f"max_period must be > 1, got {config.max_period!r}")


class _StackGeometry:
    """What both stacks derive from their fields; `_positive` names their own positive ints."""

    _positive: tuple[str, ...] = ()

    def __post_init__(self):
        _check_common(self)
        _check_positive(self, self._positive)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def capacity(self) -> int:
        """Ring slots per row: capacity = context."""
        return self.context


@dataclass(frozen=True)
class TemporalConfig(_StackGeometry):
    """Helium temporal transformer: RMSNorm (f32, eps 1e-8), RoPE attention, SiLU gating."""

    _positive = ("hidden", "text_card")

    dim: int = 4096
    num_layers: int = 32
    num_heads: int = 32
    hidden: int = 11264
    context: int = 3000
    text_card: int = 32000
    max_period: float = 10000.0
    ring_convention: str = "personaplex"
    norm_eps: float = 1e-8


@dataclass(frozen=True)
class MimiConfig(_StackGeometry):
    """Mimi codec transformer: LayerNorm (eps 1e-5), RoPE attention, GELU MLP, layer scales."""

    _positive = ("ffn",)

    num_layers: int = 8
    dim: int = 512
    num_heads: int = 8
    context: int = 250
    ffn: int = 2048
    max_period: float = 10000.0
    ring_convention: str = "personaplex"
    norm_eps: float = 1e-5


StackConfig = TemporalConfig | MimiConfig

# Small presets: the embedded default of the main job and the CPU test sizes.
PRESETS: dict[str, StackConfig] = {
    "temporal": TemporalConfig(),
    "mimi": MimiConfig(),
    "temporal-small": TemporalConfig(dim=64, num_layers=2, num_heads=4, hidden=176, context=24, text_card=96),
    "mimi-small": MimiConfig(num_layers=2, dim=32, num_heads=4, context=10, ffn=64),
}


def with_options(config: StackConfig, **changes) -> StackConfig:
    """A copy of `config` with some fields replaced (validated again)."""
    return dataclasses.replace(config, **changes)


@dataclass(frozen=True)
class WeightSpec:
    """One stacked weight buffer.

    name:      buffer name on both sides (`in_proj`, `norm1_alpha`, ...).
    key:       checkpoint key below the stack prefix; `{i}` is the layer index.
    shape:     shape of one layer's slice (or of the whole tensor when not per layer).
    ckpt_shape: the shape the checkpoint stores for one layer (alphas are `[1, 1, dim]`).
    per_layer: True when the buffer is stacked `[num_layers, *shape]`.
    """

    name: str
    key: str
    shape: tuple[int, ...]
    ckpt_shape: tuple[int, ...]
    per_layer: bool = True

    def stacked_shape(self, num_layers: int) -> tuple[int, ...]:
        return (num_layers, *self.shape) if self.per_layer else self.shape


def weight_specs(config: StackConfig) -> list[WeightSpec]:
    """The weight buffers of a stack, in a fixed order, with their Moshi checkpoint keys."""
    d = config.dim
    layer = "transformer.layers.{i}."
    specs = [
        WeightSpec("in_proj", layer + "self_attn.in_proj_weight", (3 * d, d), (3 * d, d)),
        WeightSpec("out_proj", layer + "self_attn.out_proj.weight", (d, d), (d, d)),
    ]
    if isinstance(config, TemporalConfig):
        h = config.hidden
        specs += [
            WeightSpec("linear_in", layer + "gating.linear_in.weight", (2 * h, d), (2 * h, d)),
            WeightSpec("linear_out", layer + "gating.linear_out.weight", (d, h), (d, h)),
            WeightSpec("norm1_alpha", layer + "norm1.alpha", (d,), (1, 1, d)),
            WeightSpec("norm2_alpha", layer + "norm2.alpha", (d,), (1, 1, d)),
            WeightSpec("out_norm_alpha", "out_norm.alpha", (d,), (1, 1, d), per_layer=False),
            WeightSpec("text_linear", "text_linear.weight", (config.text_card, d),
                       (config.text_card, d), per_layer=False),
        ]
    else:
        f = config.ffn
        specs += [
            WeightSpec("linear1", layer + "linear1.weight", (f, d), (f, d)),
            WeightSpec("linear2", layer + "linear2.weight", (d, f), (d, f)),
            WeightSpec("norm1_weight", layer + "norm1.weight", (d,), (d,)),
            WeightSpec("norm1_bias", layer + "norm1.bias", (d,), (d,)),
            WeightSpec("norm2_weight", layer + "norm2.weight", (d,), (d,)),
            WeightSpec("norm2_bias", layer + "norm2.bias", (d,), (d,)),
            WeightSpec("scale1", layer + "layer_scale_1.scale", (d,), (d,)),
            WeightSpec("scale2", layer + "layer_scale_2.scale", (d,), (d,)),
        ]
    return specs


def checkpoint_prefix(config: StackConfig, prefix: str | None) -> str:
    """The key prefix of a stack in a checkpoint: '' for temporal, 'encoder_transformer.' ..."""
    if isinstance(config, TemporalConfig):
        if prefix:
            raise ValueError(f"prefix: the temporal stack takes no prefix, got {prefix!r}")
        return ""
    if prefix not in MIMI_PREFIXES:
        raise ValueError(f"prefix must be one of {MIMI_PREFIXES} for a Mimi stack, got {prefix!r}")
    return prefix + "."


def checkpoint_keys(config: StackConfig, prefix: str | None = None) -> dict[str, tuple[WeightSpec, int | None]]:
    """Every checkpoint key of a stack -> (its spec, its layer index or None)."""
    base = checkpoint_prefix(config, prefix)
    keys: dict[str, tuple[WeightSpec, int | None]] = {}
    for spec in weight_specs(config):
        if spec.per_layer:
            for i in range(config.num_layers):
                keys[base + spec.key.format(i=i)] = (spec, i)
        else:
            keys[base + spec.key] = (spec, None)
    return keys


class CheckpointError(KeyError):
    """A checkpoint does not fit a stack; the message lists every problem at once."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def check_checkpoint(shapes: Mapping[str, Sequence[int]], config: StackConfig, prefix: str | None = None) -> None:
    """Raise `CheckpointError` listing every missing, unexpected or mis-shaped key.

    shapes: checkpoint key -> tensor shape. Keys outside the stack's prefix are ignored
    for a Mimi stack (a full Mimi checkpoint holds both transformers and the convolutions);
    for the temporal stack, keys under `transformer.`, `out_norm.` and `text_linear.` count.
    """
    expected = checkpoint_keys(config, prefix)
    base = checkpoint_prefix(config, prefix)
    own = ("transformer.", "out_norm.", "text_linear.") if not base else (base,)
    missing = [k for k in expected if k not in shapes]
    unexpected = [k for k in shapes if k.startswith(own) and k not in expected]
    misshaped = [
        f"{k}: expected {list(spec.ckpt_shape)}, got {list(shapes[k])}"
        for k, (spec, _) in expected.items()
        if k in shapes and tuple(shapes[k]) != spec.ckpt_shape
    ]
    if missing or unexpected or misshaped:
        lines = [(f"checkpoint does not fit {type(config).__name__}(dim={config.dim}, "
                  f"num_layers={config.num_layers}) with prefix {base or '(none)'!r}:")]
        lines += [f"  missing: {k}" for k in missing]
        lines += [f"  unexpected: {k}" for k in unexpected]
        lines += [f"  wrong shape: {m}" for m in misshaped]
        raise CheckpointError("\n".join(lines))
