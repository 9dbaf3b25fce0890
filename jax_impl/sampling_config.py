"""The token sampler both frameworks implement (`jax_impl.sampling`, `torch_bridge.sampling`): its
constants and argument checks. Framework-neutral (standard library only).

Randomness is an explicit input: a row's draw over a vocabulary of V tokens is a function of
(seed, counter, token index), from a counter-based generator of integer operations
(`hash32`, the "lowbias32" integer hash), so both sides draw the same bits:

    bits[j] = hash32(hash32(hash32(seed) ^ counter) ^ j)          (uint32 arithmetic)
    u[j]    = (2 * (bits[j] >> 9) + 1) * 2**-24                    (exact in float32, in (0, 1))
    g[j]    = -log(-log(u[j]))                                     (Gumbel noise)
    token   = argmax over the top-k logits of (logits + temperature * g)

which draws from softmax(logits / temperature) restricted to the top k (Gumbel-max). `log` is a
polynomial written with correctly rounded float32 operations, each product rounded on its own
(`LOG_POLY`), not the backends' own log (which differ in the last bits). The top k are the k
largest logits, ties broken by the lower index (`top_k = 1` is greedy, exactly); ties of the
scores go to the lower index too (both sides' argmax). `temperature = 0` is greedy: the first
largest logit.

Subnormal float32 (magnitude below 2**-126) are flushed to +0 by both samplers themselves, wherever
one can be read or made, since backends differ there (XLA on the CPU reads and writes them as zeros,
torch keeps them): the temperature and the logits as given, the scaled noise temperature * g and the
scores (`FLUSH_BELOW`, `FLUSH_PRODUCT_BELOW`). A subnormal temperature is therefore greedy.
"""

from __future__ import annotations

from .config import positive_float32, real_number

HASH_MUL = (0x7FEB352D, 0x846CA68B)   # the multipliers of lowbias32 (shifts 16, 15, 16)
HASH_SHIFTS = (16, 15, 16)
UNIFORM_SHIFT = 9                      # 23 bits kept: 2 * m + 1 < 2**24 is exact in float32
UNIFORM_SCALE = 2.0**-24
SQRT2 = 1.41421356                     # log's argument is reduced to [sqrt(2)/2, sqrt(2)]
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so that e * LN2_HI is exact
# log(m) = 2 s (1 + z/3 + z^2/5 + ...), s = (m - 1) / (m + 1), z = s^2 <= 0.0295: Horner's rule,
# highest power first.
LOG_POLY = (1 / 13, 1 / 11, 1 / 9, 1 / 7, 1 / 5, 1 / 3, 1.0)
# The flush: x becomes +0 where |x| < the bound (NaN and inf kept; every zero +0, so ties of zeros go to the
# lower index on both sides). FLUSH_BELOW, the smallest normal float32: the temperature and the logits as
# given and the scores (logits + noise: a sum of two float32, exact when it is below 2**-126).
# FLUSH_PRODUCT_BELOW, one float32 further, for the rounded product temperature * g: an exact product just
# below 2**-126 rounds up to 2**-126 where subnormals are kept and to 0 where results are flushed.
FLUSH_BELOW = 2.0**-126
FLUSH_PRODUCT_BELOW = 2.0**-126 * (1 + 2.0**-23)


def check_sampling(temperature, top_k, vocab: int) -> None:
    """Raise ValueError naming the argument unless temperature is 0 (greedy) or a number float32 holds
    (`config.positive_float32`: the sampler scales the noise by it in float32), and 0 <= top_k <= vocab
    (0: the whole vocabulary)."""
    if not (real_number(temperature) and temperature == 0 or positive_float32(temperature)):
        raise ValueError(f"temperature must be 0 (greedy) or a float > 0 that float32 holds (the sampler's), got "
                         f"{temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be an int in 0..{vocab} (0: the whole vocabulary), got {top_k!r}")


def array_described(x) -> str:
    """x's dtype and shape for an error message ("int32 [4]"), or its type's name where x is no array."""
    dtype = getattr(x, "dtype", None)
    return f"{dtype} {list(x.shape)}" if dtype is not None and hasattr(x, "shape") else type(x).__name__


def check_seeds(seeds, B: int, is_integer) -> None:
    """Raise ValueError naming `seeds` unless it is an array [B] of an integer dtype (each row's
    stream, taken mod 2**32): sampling's randomness is an explicit input. is_integer(x): whether x
    is an array of an integer dtype, bool excluded, in the caller's framework."""
    if not is_integer(seeds) or tuple(seeds.shape) != (B,):
        raise ValueError(f"seeds must be an integer array [{B}] when a temperature is > 0 (the randomness is an "
                         f"explicit input), got {array_described(seeds)}")


def check_counter(counter, B: int, is_integer):
    """The draw counter as given after checking it: an int (not a bool; taken mod 2**32 as the
    seeds are, so any int fits) or an integer array of shape [] or [B] (`is_integer`: as
    `check_seeds`'s). Raises TypeError / ValueError naming `counter`."""
    if isinstance(counter, int) and not isinstance(counter, bool):
        return counter % 2**32
    if not is_integer(counter):
        raise TypeError(f"counter must be an int or an integer array, got {array_described(counter)}")
    if tuple(counter.shape) not in ((), (B,)):
        raise ValueError(f"counter must have shape [] or [{B}], got {list(counter.shape)}")
    return counter
