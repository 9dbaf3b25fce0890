"""The twin attention's contract: its plan (`AttentionBlocks`, a function of the ring's slots alone),
its form, its launch constants, the counters its combine counts on, and its argument checks.

Standard library only.
"""

from __future__ import annotations

import dataclasses

from kernels_pallas.contract.numerics import (
    check_launch,
    check_nonempty,
    check_twin_dtype,
    choose_form,
    next_pow2,
    positive_int,
    sixteen_bit,
)

# the Triton attention's launch where the caller gives none (`twin_attention_launch`; speed only): the fastest
# of benchmarks/twin_tune_gpu.py on an H200
TWIN_TRITON_ATTENTION_STAGES = 1  # software-pipeline depth of its loop over a split's blocks (3: -6% at B=1, +2% at B=4)
TWIN_TRITON_ATTENTION_WARPS = 2
TWIN_PALLAS_ATTENTION_WARPS = 2  # warps of the Pallas attention's programs where the caller gives none (RESULTS.md)
# ... and where a step has at most TWIN_PALLAS_ATTENTION_FEW_QUERIES queries (B*H*T: the temporal step to B=4),
# a latency-bound grid: 4 warps took 19.9-20.2 against 20.2-21.3 us a layer at B=1 and 60.4-60.8 against
# 61.3-62.6 at B=4, in repeated ncu sweeps; 2 warps 820 against 871 at B=64 (RESULTS.md)
TWIN_PALLAS_ATTENTION_FEW_WARPS = 4
TWIN_PALLAS_ATTENTION_FEW_QUERIES = 128
# ... and one warp a program past that for heads of at most TWIN_PALLAS_ATTENTION_SMALL_HEAD dims over more than
# one block of slots (Mimi's 64 over 250): at B=16 and 64, 6.9 and 19.6 us a layer against 8.3 and 22.9 with 2
# (H200, RESULTS.md); not the depformer's 16 slots: its frame took 3.6-3.8 ms at B=16 with 1, 3.0 with 2
TWIN_PALLAS_ATTENTION_SMALL_HEAD = 64
TWIN_PALLAS_ATTENTION_SMALL_HEAD_WARPS = 1
TWIN_PALLAS_ATTENTION_STAGES = 3  # ... and the software-pipeline depth of its loop over a split's blocks
TWIN_ATTENTION_BC = 64       # slots per block of the twin attention (at most)
TWIN_ATTENTION_CHUNK = 256   # slots per split (at most)
TWIN_ATTENTION_MIN_SPLITS = 4  # a ring of a few blocks is still cut into up to this many splits
# the launch order (speed only, both twins): a query's splits one after another, so the combines spread
# over the launch (at B=16 on an H200, the step's attention 6584 against 6790 us; RESULTS.md)
TWIN_ATTENTION_SPLITS_FIRST = True


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """The plan of the twin attention over a ring of C slots: a function of C alone (its bits).

    block_slots: BC, slots a block; chunk: slots a split (a multiple of BC); splits: S, the splits
    that cover the ring (each reduced on its own, then combined in order).
    """

    block_slots: int
    chunk: int
    splits: int

    @classmethod
    def for_shapes(cls, C: int) -> AttentionBlocks:
        """Splits of at most TWIN_ATTENTION_CHUNK slots, and at least TWIN_ATTENTION_MIN_SPLITS of them
        where the ring has that many blocks: Mimi's 250 slots had run as one split of 4 blocks one
        after the other, a program's latency (8.9 us a layer on an H200); Helium's 3000 are 12 splits
        of 256 either way."""
        BC = min(TWIN_ATTENTION_BC, next_pow2(C))
        blocks = -(-C // BC)
        chunk = min(TWIN_ATTENTION_CHUNK, -(-blocks // TWIN_ATTENTION_MIN_SPLITS) * BC)
        return cls(BC, chunk, -(-C // chunk))


def twin_attention_form(D: int, BC: int, dtype, compiled: bool, form: str | None = None) -> str:
    """Which form of the twin attention runs (`twin_attention`'s docstring): `form` if given
    (checked), else "mma" where it can (compiled for the GPU, 16-bit q and ring, D and the block's
    BC slots multiples of 16), else "lanes". A function of the shapes, the dtype and the backend,
    never of B: both twins pick the same form, and a row's bits do not depend on the batch."""
    fits = sixteen_bit(dtype) and D % 16 == 0 and BC % 16 == 0
    return choose_form("attention", form, fits, compiled, f"bfloat16/float16 q and ring, a head dim and a block of "
                      f"slots that are multiples of 16; got {dtype}, D={D}, BC={BC}")


def twin_attention_launch(num_warps: int | None, num_stages: int | None, pallas: bool, queries: int, D: int,
                          C: int) -> tuple[int, int]:
    """(num_warps, num_stages) of a twin attention call of `queries` queries (B*H*T) of head dim D over
    C slots: the caller's (checked), or where None (both twins' default) the fastest of its backend on
    an H200 (speed only), read at call time. The Pallas twin: TWIN_PALLAS_ATTENTION_FEW_WARPS for a
    latency-bound step of at most TWIN_PALLAS_ATTENTION_FEW_QUERIES queries, else
    TWIN_PALLAS_ATTENTION_SMALL_HEAD_WARPS for small heads over more than one block of slots, else
    TWIN_PALLAS_ATTENTION_WARPS; TWIN_PALLAS_ATTENTION_STAGES. The Triton twin:
    TWIN_TRITON_ATTENTION_WARPS and TWIN_TRITON_ATTENTION_STAGES."""
    if num_warps is None and pallas:
        num_warps = (TWIN_PALLAS_ATTENTION_FEW_WARPS if queries <= TWIN_PALLAS_ATTENTION_FEW_QUERIES else
                     TWIN_PALLAS_ATTENTION_SMALL_HEAD_WARPS if D <= TWIN_PALLAS_ATTENTION_SMALL_HEAD
                     and C > TWIN_ATTENTION_BC else TWIN_PALLAS_ATTENTION_WARPS)
    elif num_warps is None:
        num_warps = TWIN_TRITON_ATTENTION_WARPS
    if num_stages is None:
        num_stages = TWIN_PALLAS_ATTENTION_STAGES if pallas else TWIN_TRITON_ATTENTION_STAGES
    check_launch("attention", num_warps, num_stages)
    return num_warps, num_stages


def twin_sems_size(B: int, H: int, T: int) -> int:
    """Counters a step's twin kernels count on (`twin_attention.attention(sems=)`): one a query."""
    return B * H * T


def check_twin_sems(sems, n: int, where: str, make):
    """sems as given, checked (1-D int32, at least n counters), or make(n) (zeros) where None."""
    if sems is None:
        return make(n)
    if len(sems.shape) != 1 or sems.shape[0] < n or str(sems.dtype) not in ("int32", "torch.int32"):
        raise ValueError(f"{where}(sems): expected int32 [n >= {n}] counters, all 0, got "
                         f"{sems.dtype}{list(sems.shape)}")
    return sems


def check_twin_attention(q, ring_k, ring_v, positions, q_pos, context=None):
    """(B, H, T, D, C) of a twin attention call, after checking every shape, and `context` where given
    (the visible window's length in positions: an int >= 1)."""
    if context is not None and not positive_int(context):
        raise ValueError(f"attention(context): expected an int >= 1, got {context!r}")
    check_twin_dtype("attention", "q", q)
    if len(q.shape) != 4:
        raise ValueError(f"attention(q): expected [B, H, T, D], got shape {tuple(q.shape)}")
    check_nonempty("attention", "q", q.shape, ("batch row (B)", "head (H)", "query (T)", "feature (D)"))
    B, H, T, D = q.shape
    if D & (D - 1):
        raise ValueError(f"attention(q): the head dim must be a power of two, got {D}")
    for name, r in (("ring_k", ring_k), ("ring_v", ring_v)):
        if len(r.shape) != 5 or (r.shape[1], r.shape[2], r.shape[4]) != (B, H, D) or str(r.dtype) != str(q.dtype):
            raise ValueError(f"attention({name}): expected [L, {B}, {H}, C, {D}] in {q.dtype}, "
                             f"got {r.dtype}{list(r.shape)}")
        check_nonempty("attention", name, r.shape, ("layer (L)", "batch row (B)", "head (H)", "slot (C)"))
    C = ring_k.shape[3]
    if tuple(positions.shape) != (B, C) or tuple(q_pos.shape) != (B, T):
        raise ValueError(f"attention: positions must be [{B}, {C}] and q_pos [{B}, {T}], got "
                         f"{tuple(positions.shape)} and {tuple(q_pos.shape)}")
    return B, H, T, D, C
