"""LoRA adapters of the temporal stack's reference layer: y = x W^T + scale * (x A^T) B^T.

    lora = jx.init_lora(cfg, jax.random.key(1), rank=16)      # A random, B = 0: the stack unchanged
    step = jx.step_fn(cfg, kernels="reference")
    (out, logits), state = step(jx.with_lora(params, lora), state, x)
    grads = jax.grad(loss)(lora, params, ...)                  # differentiate the adapters only

The adapters ride in the step's params under "lora" (`with_lora`), beside the frozen Flax
variables, and the layer applies each where present (`layers.temporal_layer`); without them the
step is the plain one, bit for bit. Targets (`LORA_TARGETS`), each stacked over the L layers:

    "q", "v":       the fused in-projection's q rows and v rows   a [L, r, dim]     b [L, H*D, r]
    "linear_in":    the FFN's gate/up projection                  a [L, r, dim]     b [L, 2*hidden, r]
    "linear_out":   the FFN's down projection                     a [L, r, hidden]  b [L, dim, r]

As moshi's `LoRALinear` (which moshi-finetune trains): A as `nn.Linear`'s default init (kaiming
uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B zero, `scale` its `lora_scaling` (2 by
default). The adapters are float32 (moshi-finetune keeps float32 master copies for its optimizer
and runs bf16 copies); the frozen weights keep their dtype: an adapted linear accumulates the
frozen product and the adapter's in float32 and rounds once, to the activations' dtype. `scale`
is static metadata of the `LoRA` pytree, so `jax.grad` and optax see only the a and b arrays.
Runs on kernels "reference" and "pallas" (the linears are XLA's either way); the twin kernels
and the Mimi stack refuse adapters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .config import StackConfig, TemporalConfig, finite_real
from .ops import acc_dtype, linear

LORA_TARGETS = ("q", "v", "linear_in", "linear_out")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["adapters"], meta_fields=["scale"])
@dataclasses.dataclass(frozen=True)
class LoRA:
    """adapters: target -> {"a": [L, r, in], "b": [L, out, r]} (float32); scale: the static factor."""

    adapters: dict
    scale: float


def target_shapes(config: TemporalConfig) -> dict[str, tuple[int, int]]:
    """Target -> (in, out) features of the rows it adapts."""
    c = config
    return {"q": (c.dim, c.dim), "v": (c.dim, c.dim), "linear_in": (c.dim, 2 * c.hidden),
            "linear_out": (c.hidden, c.dim)}


def init_lora(config: TemporalConfig, key: jax.Array, rank: int, *, scale: float = 2.0,
              targets: tuple[str, ...] = LORA_TARGETS, dtype=jnp.float32) -> LoRA:
    """Fresh adapters: A ~ U(-1/sqrt(in), 1/sqrt(in)) (moshi's `LoRALinear` init), B = 0, in `dtype`."""
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"init_lora(rank): must be a positive int, got {rank!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"init_lora(scale): expected a real number, got {type(scale).__name__} {scale!r}")
    if not finite_real(scale):
        raise ValueError(f"init_lora(scale): expected a finite number, got {scale!r}")
    dtype = check_adapter_dtype("init_lora(dtype)", dtype)
    check_targets("init_lora(targets)", targets)
    check_temporal("init_lora(config)", config)
    shapes = target_shapes(config)
    adapters = {}
    for name, k in zip(targets, jax.random.split(key, len(targets)), strict=True):
        fan_in, fan_out = shapes[name]
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(k, (config.num_layers, rank, fan_in), jnp.float32, -bound, bound)
        adapters[name] = {"a": a.astype(dtype), "b": jnp.zeros((config.num_layers, fan_out, rank), dtype)}
    return check_lora(config, LoRA(adapters, float(scale)))


def check_adapter_dtype(where: str, dtype) -> jnp.dtype:
    """dtype as a jnp.dtype if adapters may hold it: a float dtype JAX keeps (float64 only with
    jax_enable_x64; without it JAX would make float32 arrays); TypeError naming `where`."""
    dtype = jnp.dtype(dtype)
    if dtype.name not in ("float16", "bfloat16", "float32", "float64"):
        raise TypeError(f"{where}: expected float16, bfloat16, float32 or float64, got {dtype}")
    if dtype.name == "float64" and not jax.config.jax_enable_x64:
        raise TypeError(f"{where}: float64 needs jax_enable_x64 (without it JAX would make float32 arrays)")
    return dtype


def check_targets(where: str, targets) -> None:
    if isinstance(targets, str):
        raise TypeError(f"{where}: expected a sequence of target names, got the string {targets!r}")
    bad = [t for t in targets if t not in LORA_TARGETS]
    if bad or not targets or len(set(targets)) != len(targets):
        raise ValueError(f"{where}: expected distinct targets among {list(LORA_TARGETS)}, got {list(targets)}")


def check_temporal(where: str, config) -> None:
    """TypeError naming `where` unless config is a temporal stack's (the adapters' only stack)."""
    if not isinstance(config, TemporalConfig):
        raise TypeError(f"{where}: adapters apply to the temporal stack only, got a {type(config).__name__}")


def check_lora(config: StackConfig, lora, kernels: str = "reference") -> LoRA:
    """`lora` itself if it fits `config` (a temporal stack) on `kernels`; else TypeError / ValueError
    naming what is wrong (the stack, a target, a shape, a dtype). Checked on shapes and dtypes only (traceable)."""
    if not isinstance(lora, LoRA):
        raise TypeError(f"lora: expected a jax_impl.LoRA (init_lora), got {type(lora).__name__}")
    check_temporal("lora", config)
    if kernels == "twin":
        raise ValueError("lora: adapters run on kernels 'reference' or 'pallas', not 'twin'")
    if not (isinstance(lora.scale, float) and math.isfinite(lora.scale)):
        raise ValueError(f"lora.scale: expected a finite float, got {lora.scale!r}")
    if not isinstance(lora.adapters, Mapping):
        raise TypeError(f"lora.adapters: expected a dict target -> {{'a', 'b'}}, got {type(lora.adapters).__name__}")
    check_targets("lora.adapters", tuple(lora.adapters))
    L = config.num_layers
    for name, ad in lora.adapters.items():
        fan_in, fan_out = target_shapes(config)[name]
        if not isinstance(ad, Mapping) or set(ad) != {"a", "b"}:
            raise ValueError(f"lora.adapters[{name!r}]: expected a dict with the keys 'a' and 'b', got "
                             f"{sorted(ad) if isinstance(ad, Mapping) else type(ad).__name__}")
        a, b = ad["a"], ad["b"]
        r = a.shape[1] if getattr(a, "ndim", 0) == 3 else None
        want = {"a": (L, r, fan_in), "b": (L, fan_out, r)}
        for key, arr in (("a", a), ("b", b)):
            shape = tuple(getattr(arr, "shape", ()))
            if r is None or shape != want[key] or not hasattr(arr, "dtype"):
                raise ValueError(f"lora.adapters[{name!r}][{key!r}]: expected a float array of shape "
                                 f"[L={L}, {'r, in=' + str(fan_in) if key == 'a' else f'out={fan_out}, r'}] "
                                 f"(a and b of one rank r), got {getattr(arr, 'dtype', type(arr).__name__)}"
                                 f"{list(shape)}")
            check_adapter_dtype(f"lora.adapters[{name!r}][{key!r}]", arr.dtype)
    return lora


def with_lora(params: Mapping, lora: LoRA) -> dict:
    """A step's params with adapters: the Flax variables plus "lora" (neither is copied)."""
    return {**params, "lora": lora}


def split_lora(params: Mapping) -> tuple[Mapping, LoRA | None]:
    """(the Flax variables, the adapters or None) of a step's params."""
    if not isinstance(params, Mapping) or "lora" not in params:
        return params, None
    return {k: v for k, v in params.items() if k != "lora"}, params["lora"]


def adapted_linear(x: jax.Array, w: jax.Array, blocks, scale: float) -> jax.Array:
    """x @ w.T plus scale * (x a^T) b^T on row blocks of the output; in x's dtype.

    x [..., in], w [out, in] (frozen); blocks: ((first_row, {"a": [r, in], "b": [rows, r]}), ...).
    The frozen product and each adapter's are accumulated in float32 (float64 for float64 x) and
    the sum is rounded once."""
    acc = acc_dtype(x.dtype)
    y = linear(x, w, dtype=acc)
    xf = x.astype(acc)
    for row, ad in blocks:
        wide = [jnp.dtype(v.dtype) for v in ad.values() if jnp.promote_types(v.dtype, acc) != acc]
        if wide:  # float64 adapters on float32 activations: the sum would narrow them
            raise TypeError(f"lora: adapters of {wide[0]} on {x.dtype} activations would be rounded to {acc}; "
                            f"give the adapters a dtype that widens to {acc} exactly")
        d = linear(linear(xf, ad["a"].astype(acc)), ad["b"].astype(acc))
        y = y.at[..., row:row + d.shape[-1]].add(jnp.asarray(scale, acc) * d)
    return y.astype(x.dtype)


def layer_linears(lora: LoRA) -> tuple[Callable, Callable, Callable]:
    """(in_proj, linear_in, linear_out) linears `(x, w) -> x @ w.T + adapters` of one layer, from
    its slice of the adapters (a [r, in], b [rows, r]); a target without an adapter is plain."""
    ad, s = lora.adapters, lora.scale

    def blocks(*placed):
        return tuple((row, ad[name]) for row, name in placed if name in ad)

    def in_proj(x, w):  # w [3*H*D, dim]: q rows first, v rows last
        return adapted_linear(x, w, blocks((0, "q"), (2 * (w.shape[0] // 3), "v")), s)

    return (in_proj, lambda x, w: adapted_linear(x, w, blocks((0, "linear_in")), s),
            lambda x, w: adapted_linear(x, w, blocks((0, "linear_out")), s))
