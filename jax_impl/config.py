"""Framework-neutral configuration of the two streaming stacks.

Imported by both `torch_bridge` and `jax_impl`; it imports neither torch nor jax.

- `TemporalConfig`: the Helium temporal backbone (7B defaults), T=1 per step.
- `MimiConfig`: the Mimi codec transformer, T=2 (encoder) or T=10 per step.
- `PRESETS`: the real sizes and the small ones of the CPU tests; `with_options`: a validated copy.

The Moshi checkpoint layout of these stacks and its IO are `jax_impl.checkpoint`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

from kernels_pallas.contract.numerics import INT32_MAX
from kernels_pallas.contract.rope import RING_CONVENTIONS

FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_TINY = 2.0**-149             # the smallest positive float32 (a subnormal)


def real_number(value) -> bool:
    """Whether value is a real number, Python's or numpy's (`numbers.Real`), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite_real(value) -> bool:
    """Whether value is a real number (`real_number`) that a float holds finite: NaN, the infinities and
    an int past float's range (10**400, which `math.isfinite` cannot even convert) are not."""
    try:
        return real_number(value) and math.isfinite(value)
    except OverflowError:
        return False


def positive_float32(value) -> bool:
    """Whether value is a real number (`real_number`) > 0 that float32 holds without becoming 0 or inf:
    the eps of the float32 norms and the sampler's temperature are computed in float32. Compared, not
    converted: an int past float64's range (10**400) is simply too large, and NaN compares false."""
    return real_number(value) and FLOAT32_TINY <= value <= FLOAT32_MAX


def check_batch_size(op: str, batch_size) -> int:
    """batch_size as an int after checking it: a Python or numpy integer (`numbers.Integral`, not a bool)
    >= 1, the rule of every state maker on both sides; ValueError naming `op`."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"{op}(batch_size): batch_size must be a positive int (a Python or numpy integer, not a "
                         f"bool), got {batch_size!r}")
    return int(batch_size)


def check_positive_ints(config, names: Sequence[str]) -> None:
    """Each field of a config (named by its class) a Python int in 1..INT32_MAX: the kernels index with
    int32, and a size past it is no model's (JAX would end the process making a ring of it)."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= INT32_MAX:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int of at most {INT32_MAX}, "
                             f"got {value!r}")


def _check_common(config) -> None:
    check_positive_ints(config, ("dim", "num_layers", "num_heads", "context"))
    if config.dim % config.num_heads:
        raise ValueError(f"dim ({config.dim}) must be divisible by num_heads ({config.num_heads})")
    if config.head_dim % 2:
        raise ValueError(f"head_dim = dim // num_heads must be even for RoPE, got {config.head_dim}")
    if config.ring_convention not in RING_CONVENTIONS:
        raise ValueError(f"ring_convention must be one of {RING_CONVENTIONS}, got {config.ring_convention!r}")
    if not (finite_real(config.max_period) and config.max_period > 1):
        raise ValueError(f"max_period must be a finite number > 1 (RoPE's longest wavelength), got "
                         f"{config.max_period!r}")
    if not positive_float32(config.norm_eps):
        raise ValueError(f"norm_eps must be a float > 0 that float32 holds (the norms compute in float32), got "
                         f"{config.norm_eps!r}")


class _StackGeometry:
    """What both stacks derive from their fields; `_positive` names their own positive ints."""

    _positive: tuple[str, ...] = ()

    def __post_init__(self):
        _check_common(self)
        check_positive_ints(self, self._positive)

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


def describe(config: StackConfig) -> str:
    """`TemporalConfig(dim=64, num_layers=2)`: the config as the error messages name it."""
    return f"{type(config).__name__}(dim={config.dim}, num_layers={config.num_layers})"
