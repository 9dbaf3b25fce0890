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
"""

from __future__ import annotations

import math

HASH_MUL = (0x7FEB352D, 0x846CA68B)   # the multipliers of lowbias32 (shifts 16, 15, 16)
HASH_SHIFTS = (16, 15, 16)
UNIFORM_SHIFT = 9                      # 23 bits kept: 2 * m + 1 < 2**24 is exact in float32
UNIFORM_SCALE = 2.0**-24
SQRT2 = 1.41421356                     # log's argument is reduced to [sqrt(2)/2, sqrt(2)]
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so that e * LN2_HI is exact
# log(m) = 2 s (1 + z/3 + z^2/5 + ...), s = (m - 1) / (m + 1), z = s^2 <= 0.0295: Horner's rule,
# highest power first.
LOG_POLY = (1 / 13, 1 / 11, 1 / 9, 1 / 7, 1 / 5, 1 / 3, 1.0)


def check_sampling(temperature, top_k, vocab: int) -> None:
    """Raise ValueError naming the argument unless 0 <= temperature (finite) and 0 <= top_k <= vocab
    (0: the whole vocabulary)."""
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
            or not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite float >= 0 (0: greedy), got {temperature!r}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= vocab:
        raise ValueError(f"top_k must be an int in 0..{vocab} (0: the whole vocabulary), got {top_k!r}")
