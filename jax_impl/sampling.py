"""The token sampler, JAX side: the same tokens as `torch_bridge.sampling` for the same seeds.

The algorithm and its constants: `jax_impl.sampling_config`. uint32 arithmetic is native (it
wraps); every product of the float path is rounded on its own (`twin_math.mul`: XLA cannot fuse
it into an FMA), so the float operations are the torch side's, one rounding each.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels_pallas.twin_math import mul

from .sampling_config import (
    FLUSH_BELOW,
    FLUSH_PRODUCT_BELOW,
    HASH_MUL,
    HASH_SHIFTS,
    LN2_HI,
    LN2_LO,
    LOG_POLY,
    SQRT2,
    UNIFORM_SCALE,
    UNIFORM_SHIFT,
    check_counter,
    check_sampling,
    check_seeds,
)

F32, U32 = jnp.float32, jnp.uint32


def _mul(a, b):
    return mul(a, jnp.asarray(b, F32), gpu=False)


def hash32(x):
    """lowbias32 of uint32 x."""
    x = x ^ (x >> HASH_SHIFTS[0])
    x = x * U32(HASH_MUL[0])
    x = x ^ (x >> HASH_SHIFTS[1])
    x = x * U32(HASH_MUL[1])
    return x ^ (x >> HASH_SHIFTS[2])


def log(x):
    """Natural log of positive normal float32 x, from correctly rounded operations only."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    e = (bits >> 23) - 127
    m = lax.bitcast_convert_type((bits & 0x7FFFFF) | 0x3F800000, F32)
    big = m > SQRT2
    m = jnp.where(big, _mul(m, 0.5), m)
    e = (e + big.astype(jnp.int32)).astype(F32)
    s = (m - F32(1.0)) / (m + F32(1.0))
    z = _mul(s, s)
    r = jnp.full_like(z, LOG_POLY[0])
    for c in LOG_POLY[1:]:
        r = _mul(r, z) + F32(c)
    return (_mul(e, LN2_LO) + _mul(_mul(s, 2.0), r)) + _mul(e, LN2_HI)


def gumbel(seeds, counter, vocab: int):
    """The Gumbel noise [B, vocab] float32 of rows with seeds [B] (uint32 or int32) at `counter`."""
    if isinstance(counter, int):
        counter = counter % 2**32  # a python int past int32: its uint32 value
    key = hash32(hash32(jnp.asarray(seeds).astype(U32)) ^ jnp.asarray(counter, dtype=U32))
    bits = hash32(key[:, None] ^ jnp.arange(vocab, dtype=U32))
    u = _mul(((bits >> UNIFORM_SHIFT) * U32(2) + U32(1)).astype(F32), UNIFORM_SCALE)
    return -log(-log(u))


def flush(x, below: float = FLUSH_BELOW):
    """x (float32, any shape) with every value of magnitude below `below` as +0: the sampler's explicit
    flush of subnormals (`sampling_config.FLUSH_BELOW`), whatever the backend does with them."""
    return jnp.where(jnp.abs(x) < F32(below), F32(0.0), x)


def top_k_mask(logits, k: int):
    """bool [B, V]: the k largest logits of each row, ties broken by the lower index."""
    threshold = lax.top_k(logits, k)[0][:, k - 1:]
    greater = logits > threshold
    equal = logits == threshold
    rank = jnp.cumsum(equal.astype(jnp.int32), axis=-1) - 1
    return greater | (equal & (rank < k - greater.sum(axis=-1, keepdims=True)))


def is_integer_array(x) -> bool:
    """Whether x is an array (JAX or numpy) of an integer dtype (bool excluded)."""
    return isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.integer)


def sample(logits, seeds=None, counter=0, *, temperature: float = 0.0, top_k: int = 0):
    """Tokens [B] int32 from logits [B, V] float32; seeds [B] uint32/int32, counter: int or integer [] / [B]
    (`check_counter`, as the torch side's). temperature, top_k: static (python numbers); temperature 0:
    greedy (seeds and counter not read). Subnormals are flushed (`sampling_config.FLUSH_BELOW`)."""
    if logits.dtype != F32 or logits.ndim != 2:
        raise ValueError(f"logits must be float32 [B, V], got {logits.dtype} {list(logits.shape)}")
    B, V = logits.shape
    check_sampling(temperature, top_k, V)
    logits = flush(logits)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    counter = check_counter(counter, B, is_integer_array)
    check_seeds(seeds, B, is_integer_array)
    noise = flush(_mul(gumbel(seeds, counter, V), flush(jnp.asarray(temperature, F32))), FLUSH_PRODUCT_BELOW)
    scores = flush(logits + noise)
    if top_k:
        scores = jnp.where(top_k_mask(logits, top_k), scores, -jnp.inf)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)
