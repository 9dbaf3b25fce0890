"""The token sampler, torch side: the same tokens as `jax_impl.sampling` for the same seeds.

The algorithm and its constants: `jax_impl.sampling_config`. uint32 arithmetic is done in int64
(every product kept below 2**63 by multiplying 16-bit halves), every float operation is one
torch op (correctly rounded, never fused).
"""

from __future__ import annotations

import torch

from jax_impl.sampling_config import (
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

MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32) (int64): each partial product below 2**49."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of x in [0, 2**32) (int64 holding uint32 values)."""
    x = x ^ (x >> HASH_SHIFTS[0])
    x = _mul32(x, HASH_MUL[0])
    x = x ^ (x >> HASH_SHIFTS[1])
    x = _mul32(x, HASH_MUL[1])
    return x ^ (x >> HASH_SHIFTS[2])


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive normal float32 x, from correctly rounded operations only."""
    bits = x.view(torch.int32)
    e = (bits >> 23) - 127
    m = ((bits & 0x7FFFFF) | 0x3F800000).view(torch.float32)
    big = m > SQRT2
    m = torch.where(big, m * 0.5, m)
    e = (e + big.to(torch.int32)).to(torch.float32)
    s = (m - 1.0) / (m + 1.0)
    z = s * s
    r = torch.full_like(z, LOG_POLY[0])
    for c in LOG_POLY[1:]:
        r = r * z + c
    return (e * LN2_LO + (s * 2.0) * r) + e * LN2_HI


def gumbel(seeds: torch.Tensor, counter, vocab: int) -> torch.Tensor:
    """The Gumbel noise [B, vocab] float32 of rows with seeds [B] at `counter` (int or [B])."""
    key = hash32(hash32(seeds.long() & MASK32) ^ (torch.as_tensor(counter, device=seeds.device).long() & MASK32))
    bits = hash32(key[:, None] ^ torch.arange(vocab, device=seeds.device))
    u = ((bits >> UNIFORM_SHIFT) * 2 + 1).to(torch.float32) * UNIFORM_SCALE
    return -log(-log(u))


def flush(x: torch.Tensor, below: float = FLUSH_BELOW) -> torch.Tensor:
    """x (float32, any shape) with every value of magnitude below `below` as +0: the sampler's explicit
    flush of subnormals (`sampling_config.FLUSH_BELOW`), the JAX side's."""
    return torch.where(x.abs() < below, 0.0, x)


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """bool [B, V]: the k largest logits of each row, ties broken by the lower index."""
    threshold = torch.topk(logits, k, dim=-1).values[:, k - 1:]
    greater = logits > threshold
    equal = logits == threshold
    rank = torch.cumsum(equal.long(), dim=-1) - 1  # among the ties, by index
    return greater | (equal & (rank < k - greater.sum(dim=-1, keepdim=True)))


def is_integer_tensor(x) -> bool:
    """Whether x is a torch tensor of an integer dtype (bool excluded)."""
    return isinstance(x, torch.Tensor) and not (x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool)


def check_randomness(seeds, counter, B: int, device, sampled: bool):
    """(seeds, counter) after checking them: `sampling_config.check_counter`, and where `sampled`
    (a temperature > 0) `check_seeds`; their tensors on `device`. An int counter comes back mod
    2**32, a tensor as int64 (so that `counter * steps + step` cannot wrap in a narrow dtype)."""
    counter = check_counter(counter, B, is_integer_tensor)
    if sampled:
        check_seeds(seeds, B, is_integer_tensor)
    for name, x in (("seeds", seeds if sampled else None), ("counter", counter)):
        if isinstance(x, torch.Tensor) and x.device != torch.device(device):
            raise ValueError(f"{name} is on {x.device}; expected {torch.device(device)}")
    return seeds, counter.long() if isinstance(counter, torch.Tensor) else counter


def sample(logits: torch.Tensor, seeds: torch.Tensor | None = None, counter=0, *, temperature: float = 0.0,
           top_k: int = 0) -> torch.Tensor:
    """Tokens [B] int64 from logits [B, V] float32; seeds [B] int (each row's stream, taken mod 2**32),
    counter: int or [B] int (e.g. the frame and step). temperature 0: greedy (seeds not read). Subnormals are
    flushed (`sampling_config.FLUSH_BELOW`)."""
    if not isinstance(logits, torch.Tensor) or logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"logits must be a float32 torch tensor [B, V], got "
                         f"{getattr(logits, 'dtype', type(logits).__name__)} {list(getattr(logits, 'shape', []))}")
    B, V = logits.shape
    check_sampling(temperature, top_k, V)
    logits = flush(logits)
    if temperature == 0:
        return logits.argmax(dim=-1)
    seeds, counter = check_randomness(seeds, counter, B, logits.device, True)
    noise = flush(flush(torch.tensor(temperature, dtype=torch.float32)) * gumbel(seeds, counter, V), FLUSH_PRODUCT_BELOW)
    scores = flush(logits + noise)
    if top_k:
        scores = torch.where(top_k_mask(logits, top_k), scores, float("-inf"))
    return scores.argmax(dim=-1)
