"""Framework-neutral parts of the twin kernels: argument checks, limits and tile plans.

Shared by the Pallas kernels (`kernels_pallas`, JAX) and their Triton twins (`kernels_triton`,
torch); it imports neither framework, so each package stays free of the other's. Arrays are
only asked for `shape`, `ndim` and `dtype`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

INT32_MAX = 2**31 - 1  # flat element offsets computed in int32 must stay at or below this


def check_geometry(q_shape, k_shape, head_size, rotary_dim):
    for name, v in (("head_size", head_size), ("rotary_dim", rotary_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    if rotary_dim > head_size:
        raise ValueError(f"rotary_dim must be <= head_size ({head_size}), got {rotary_dim}")
    for name, shape in (("q", q_shape), ("k", k_shape)):
        if len(shape) != 2:
            raise ValueError(
                f"{name} must be 2-D [num_tokens, num_heads * head_size], got shape {tuple(shape)}"
            )
        if shape[1] == 0 or shape[1] % head_size:
            raise ValueError(
                f"{name}.shape[1] must be a positive multiple of head_size={head_size}, "
                f"got shape {tuple(shape)}"
            )
    if q_shape[0] != k_shape[0]:
        raise ValueError(
            f"q and k must have the same num_tokens, got q {tuple(q_shape)} and k {tuple(k_shape)}"
        )
    return q_shape[0], q_shape[1] // head_size, k_shape[1] // head_size


def check_sections(mrope_section, rotary_dim, num_streams):
    """Returns (t, h, w) section sizes; a one-stream table uses (rotary_dim // 2, 0, 0)."""
    half = rotary_dim // 2
    if mrope_section is None:
        if num_streams == 3:
            raise ValueError("mrope_section is required for 3-stream cos/sin or positions")
        return (half, 0, 0)
    try:
        sections = tuple(mrope_section)
    except TypeError:
        raise ValueError(f"mrope_section must be a sequence [t, h, w], got {mrope_section!r}") from None
    if len(sections) != 3 or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sections
    ):
        raise ValueError(f"mrope_section must be 3 non-negative ints [t, h, w], got {mrope_section!r}")
    if sum(sections) != half:
        raise ValueError(
            f"mrope_section must sum to rotary_dim // 2 = {half}, got {list(sections)} "
            f"(sum {sum(sections)})"
        )
    return sections if num_streams == 3 else (half, 0, 0)


def check_flags(mrope_interleaved, is_neox_style):
    for name, v in (("mrope_interleaved", mrope_interleaved), ("is_neox_style", is_neox_style)):
        if not isinstance(v, bool):
            raise ValueError(f"{name} must be a bool, got {v!r}")  # noqa: TRY004


def check_table(name, t, num_tokens, rotary_dim):
    half = rotary_dim // 2
    if t.ndim not in (2, 3) or t.shape[-2:] != (num_tokens, half) or (t.ndim == 3 and t.shape[0] != 3):
        raise ValueError(
            f"{name} must have shape [3, num_tokens, rotary_dim // 2] = [3, {num_tokens}, {half}] or "
            f"[num_tokens, rotary_dim // 2] = [{num_tokens}, {half}], got {tuple(t.shape)}"
        )


def check_tables(cos, sin, num_tokens, rotary_dim, mrope_section):
    """cos and sin of one shape, 3-stream or 1-stream; returns (num_streams, (t, h, w) sections)."""
    for name, t in (("cos", cos), ("sin", sin)):
        check_table(name, t, num_tokens, rotary_dim)
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"cos and sin must have the same shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    num_streams = 3 if cos.ndim == 3 else 1
    return num_streams, check_sections(mrope_section, rotary_dim, num_streams)


def check_cache_shapes(positions_shape, cache_shape, num_tokens, rotary_dim):
    """positions ``[3, num_tokens]`` or ``[num_tokens]``; cos_sin_cache ``[max_position, rotary_dim]``."""
    if len(positions_shape) not in (1, 2) or positions_shape[-1] != num_tokens or (
        len(positions_shape) == 2 and positions_shape[0] != 3
    ):
        raise ValueError(
            f"positions must have shape [3, num_tokens] = [3, {num_tokens}] or [num_tokens] = "
            f"[{num_tokens}], got {tuple(positions_shape)}"
        )
    if len(cache_shape) != 2 or cache_shape[1] != rotary_dim or cache_shape[0] == 0:
        raise ValueError(
            f"cos_sin_cache must have shape [max_position, rotary_dim] = [max_position, {rotary_dim}], "
            f"got {tuple(cache_shape)}"
        )


def check_position_range(lowest, highest, max_position):
    """The smallest and largest position must lie in the cache's ``[0, max_position)``."""
    if lowest < 0 or highest >= max_position:
        raise ValueError(
            f"positions must lie in [0, max_position = {max_position}) of cos_sin_cache, "
            f"got values in [{lowest}, {highest}]"
        )


def check_dtype(name, dtype, allowed):
    if dtype not in allowed:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in allowed]}, got {dtype}")


def next_pow2(n):
    return 1 << max(int(n) - 1, 0).bit_length()


TILE_ELEMENTS = 2048  # elements of one half-tile: 16 per thread at 4 warps (best on an H200)
MIN_PROGRAMS = 256  # token blocks shrink until a short input still gets this many programs


def _pow2_floor(n):
    return 1 << (max(int(n), 1).bit_length() - 1)


def default_blocks(num_tokens, num_q_heads, num_kv_heads, rotary_dim):
    """(block_tokens, block_heads) used when the caller names none.

    One program rotates ``block_tokens`` tokens, every head of q then every head of k, in
    ``[block_tokens, block_heads, rotary_dim // 2]`` tiles (k's tile has at most its own head
    count, rounded up to a power of two). ``block_heads`` covers all heads of q and k when a tile
    of one token holds them (28/4 heads of 64 frequencies: 32); ``block_tokens`` then fills the
    tile to about ``TILE_ELEMENTS``, but no further than leaves ``MIN_PROGRAMS`` programs (or one
    per token) for short inputs.
    """
    half_p2 = next_pow2(rotary_dim // 2)
    block_heads = min(next_pow2(max(num_q_heads, num_kv_heads)), max(1, TILE_ELEMENTS // half_p2))
    block_tokens = max(1, TILE_ELEMENTS // (block_heads * half_p2))
    block_tokens = min(block_tokens, _pow2_floor(num_tokens // MIN_PROGRAMS))
    return block_tokens, block_heads


def default_num_warps(block_tokens, block_heads, rotary_dim):
    """One warp per 512 elements of the q half-tile (16 per thread), 1 to 8."""
    return max(1, min(8, block_tokens * block_heads * next_pow2(rotary_dim // 2) // 512))


def check_blocks(block_tokens, block_heads, num_tokens):
    """Validates caller-given tile sizes; returns the number of token blocks (the grid)."""
    for name, v in (("block_tokens", block_tokens), ("block_heads", block_heads)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v & (v - 1):
            raise ValueError(f"{name} must be a positive power of two, got {v!r}")
    return -(-num_tokens // block_tokens)


def stream_index(rotary_dim: int, mrope_section: Sequence[int], mrope_interleaved: bool) -> list[int]:
    """Stream (0 = t, 1 = h, 2 = w) of each of the ``rotary_dim // 2`` frequencies."""
    t, h, w = mrope_section
    half = rotary_dim // 2
    if mrope_interleaved:
        return [1 if (i % 3 == 1 and i < 3 * h) else 2 if (i % 3 == 2 and i < 3 * w) else 0
                for i in range(half)]
    return [0 if i < t else 1 if i < t + h else 2 for i in range(half)]


# --------------------------------------------------------------------------------------------
# Twin kernels (kernels_pallas.twin_*, kernels_triton.twin_*): shared tiles and checks
# --------------------------------------------------------------------------------------------
TWIN_MAX_BK = 128  # lanes of a sum over K (the reduction order depends on this and K alone)
TWIN_MAX_BN = 8    # output columns per program (speed only; compiled)
TWIN_MAX_BM = 8    # output rows per program (speed only; compiled)
TWIN_INTERPRET_MAX_BN = 256  # interpreted (CPU), fewer, larger programs: each costs Python overhead
TWIN_INTERPRET_MAX_BM = 64
# the Triton twins' launch (speed only): the fastest of benchmarks/twin_tune_gpu.py on an H200
TWIN_TRITON_LINEAR_STAGES = 4     # software-pipeline depth of the linear's loop over K
TWIN_TRITON_ATTENTION_STAGES = 1  # ... of the attention's loop over a split's blocks (3: -6% at B=1, +2% at B=4)
TWIN_TRITON_ATTENTION_WARPS = 2
TWIN_PALLAS_ATTENTION_WARPS = 2  # warps of the Pallas attention's programs (the JAX twin step's; RESULTS, 13th session)
# ... and where a step has at most TWIN_PALLAS_ATTENTION_FEW_QUERIES queries (B*H*T: the temporal step to B=4),
# a latency-bound grid: 4 warps took 19.9-20.2 against 20.2-21.3 us a layer at B=1 and 60.4-60.8 against
# 61.3-62.6 at B=4, in three sessions' ncu sweeps; 2 warps 820 against 871 at B=64 (RESULTS, 13th-16th sessions)
TWIN_PALLAS_ATTENTION_FEW_WARPS = 4
TWIN_PALLAS_ATTENTION_FEW_QUERIES = 128
TWIN_PALLAS_ATTENTION_STAGES = 3  # ... and the software-pipeline depth of its loop over a split's blocks
TWIN_NORM_WARPS = 2  # warps of a norm program (compiled: one row each, see twin_norm_rows)
TWIN_PALLAS_PREFETCH = 1  # weight blocks the Pallas linear loads ahead of their use (speed only)
TWIN_NORM_ROWS_IN_FLIGHT = 32  # block-rows a norm's statistics loop loads at once (twin_norm_unroll)
TWIN_FUSED_NORM_MAX_BM = 4  # a linear's norm runs fused only up to this many rows a program (twin_fuse_norm)
TWIN_INTERPRET_FUSED_NORM_MAX_BM = 64  # ... interpreted (every interpreted tile, TWIN_INTERPRET_MAX_BM)
TWIN_MMA_FUSED_NORM_MAX_BLOCKS = 4  # the MMA form fuses its norm only up to this many K blocks (twin_mma_fuse_norm)


def largest_pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap that divides n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def twin_lanes(K: int) -> int:
    """BK, the lanes of every twin sum over an axis of length K: a function of K alone."""
    return largest_pow2_divisor(K, TWIN_MAX_BK)


def twin_norm_rows(M: int, block_m: int | None = None, interpreted: bool = False) -> int:
    """BM, the rows per program of the twin norm kernels (speed only).

    Compiled, one row a program: its D / BK block loads go out together and need no shuffles
    between rows (4 rows a program took 22 us a norm on an H200). Interpreted, as many rows as
    fit in one program: the interpreter's cost is per program.
    """
    if block_m is not None:
        if block_m <= 0 or block_m & (block_m - 1):
            raise ValueError(f"norm(block_m): must be a power of two, got {block_m}")
        return block_m
    return min(TWIN_INTERPRET_MAX_BM, next_pow2(M)) if interpreted else 1


def twin_norm_unroll(num_blocks: int, BM: int) -> int:
    """Blocks of BK lanes a norm's statistics loop loads per iteration, for programs of BM rows
    (speed only: the additions are the same, in the same order). One row a program: all of them
    (the loads go out together). More rows: fewer, so a program holds ~TWIN_NORM_ROWS_IN_FLIGHT
    block-rows at once, not all (32 blocks x 8 rows would spill)."""
    return largest_pow2_divisor(num_blocks, max(1, TWIN_NORM_ROWS_IN_FLIGHT // BM)) if BM > 1 else num_blocks


# The twin linears' and attention's two forms (their modules' docstrings): "lanes" (CUDA cores, every
# backend) and "mma" (tensor cores: compiled for the GPU, 16-bit operands)
TWIN_FORMS = ("lanes", "mma")
TWIN_MMA_ROWS = 16    # rows of the MMA forms' operand: the attention's query, repeated; the linears' fewest x rows a program
TWIN_MMA_MAX_ROWS = 64  # x rows a program of the MMA linears (`twin_mma_rows`: 16, 32 or 64; speed only, the same bits)
TWIN_MMA_MIN_PROGRAMS = 64  # ... while the grid keeps this many programs (Mimi's grids of 8-32 column blocks)
TWIN_MMA_MAX_BN = 64  # output columns per program of the MMA form (speed only)
TWIN_MMA_STAGES = 4   # software-pipeline depth of the MMA form's loop over K (speed only, both sides) ...
TWIN_MMA_FEW_PROGRAMS_STAGES = 8  # ... where the grid has fewer column blocks than the H200 has SMs
TWIN_MMA_SMEM_BYTES = 200 * 1024  # shared memory the MMA form's pipeline may fill (an H200 block gets 227 KB)
H200_SMS = 132
H200_SM_SHARED_BYTES = 228 * 1024  # shared memory an H200 SM holds for all its resident programs ...
H200_BLOCK_RESERVED_BYTES = 1024   # ... of which the system takes this much a program
_SIXTEEN_BIT = ("bfloat16", "float16", "torch.bfloat16", "torch.float16")


def twin_linear_form(N_out: int, K: int, dtype, compiled: bool, form: str | None = None) -> str:
    """Which form of the twin linear runs: `form` if given (checked), else "mma" where it can
    (compiled for the GPU, 16-bit x and w, K and N_out multiples of 16), else "lanes".

    A function of the shapes, the dtype and the backend alone, never of M: both twins pick the
    same form, and a row's bits do not depend on the batch.
    """
    fits = str(dtype) in _SIXTEEN_BIT and twin_lanes(K) >= 16 and N_out % 16 == 0
    return _twin_form("linear", form, fits, compiled,
                      f"bfloat16/float16 x and w, K and N_out multiples of 16; got {dtype}, K={K}, N_out={N_out}")


def _twin_form(who: str, form: str | None, fits: bool, compiled: bool, needs: str) -> str:
    """`form` if given (one of TWIN_FORMS; "mma" only where it fits), else "mma" where it fits
    and runs compiled, else "lanes"; a bad form is refused naming who's argument."""
    if form not in (None, *TWIN_FORMS):
        raise ValueError(f"{who}(form): must be one of {TWIN_FORMS} or None, got {form!r}")
    if form == "mma" and not fits:
        raise ValueError(f"{who}(form='mma'): needs {needs}")
    if form is not None:
        return form
    return "mma" if compiled and fits else "lanes"


def twin_mma_blocks(N_out: int, K: int, block_n: int | None = None) -> tuple[int, int]:
    """(BN, BK) of the MMA form: BK = `twin_lanes(K)` (the norm's blocks too), BN for speed."""
    BN = largest_pow2_divisor(N_out, TWIN_MMA_MAX_BN) if block_n is None else block_n
    if BN < 16 or BN & (BN - 1) or N_out % BN:
        raise ValueError(f"linear(block_n): the MMA form needs a power of two >= 16 dividing N_out={N_out}, got {BN}")
    return BN, twin_lanes(K)


def twin_mma_rows(M: int, column_blocks: int, block_m: int | None = None, who: str = "linear") -> int:
    """x rows a program of the MMA linears (the MMA's n dimension; speed only): `block_m` if given
    (checked: 16, 32 or 64), else the most, up to TWIN_MMA_MAX_ROWS, that M fills (more than half)
    while the grid keeps TWIN_MMA_MIN_PROGRAMS programs.

    A program of 64 rows loads each weight tile once for all of them and issues a quarter of the
    MMAs: at M=64 on an H200 the temporal projections take 0.6-0.7x the time of 16-row programs, the
    out projection's 64 programs included (RESULTS.md, fourteenth session). Each output element's
    sum over a K block is the MMA's own whatever its n: the H200 gives the same bits at 16, 32 and
    64 rows (as at mma.sync and wgmma alike), which the GPU tests hold the two twins to."""
    if block_m is not None:
        if block_m not in (16, 32, TWIN_MMA_MAX_ROWS):
            raise ValueError(f"{who}(block_m): the MMA form runs 16, 32 or {TWIN_MMA_MAX_ROWS} rows a program, "
                             f"got {block_m!r}")
        return block_m
    R = TWIN_MMA_MAX_ROWS
    while R > TWIN_MMA_ROWS and (M <= R // 2 or -(-M // R) * column_blocks < TWIN_MMA_MIN_PROGRAMS):
        R //= 2
    return R


def twin_mma_plan(M: int, N_out: int, K: int, weight_tiles: int = 1, split: bool = False, block_m: int | None = None,
                  block_n: int | None = None) -> tuple[int, int, int]:
    """(BN, BK, R) of an MMA linear, both twins' (speed only: every plan gives the same bits).

    With the split norm's consumer half (`split`), BN is TWIN_SPLIT_GROUP (a given block_n must be
    it). Else `twin_mma_blocks`' BN, halved for the gate (`weight_tiles` 2: each program loads a
    tile of each half) where its programs run more than TWIN_MMA_ROWS rows: its weight rows a
    program then match the other projections'. On an H200, at the pipeline depth `twin_mma_stages`
    gives each, the gate took 55.7 us a layer at BN 32 against 63.1-71.8 at BN 64 at 64 rows a
    program (M = 64), and 48.6-49.2 against 47.7-48.2 at 16 (M = 1, 16; RESULTS.md, seventeenth
    session); in the step at 16 rows, 1540 us against 1570 (B=1) and 1540 against 1559 (B=16) a
    step (nineteenth session). R: `twin_mma_rows`, of the columns before any halving."""
    if split:
        BN, BK = twin_mma_blocks(N_out, K, TWIN_SPLIT_GROUP if block_n is None else block_n)
        if BN != TWIN_SPLIT_GROUP:
            raise ValueError(f"linear(block_n): with split the MMA form runs {TWIN_SPLIT_GROUP} columns a program, "
                             f"got {BN}")
        return BN, BK, twin_mma_rows(M, N_out // BN, block_m)
    BN, BK = twin_mma_blocks(N_out, K, block_n)
    R = twin_mma_rows(M, N_out // BN, block_m)
    if block_n is None and BN // weight_tiles >= 16 and R > TWIN_MMA_ROWS:
        BN //= weight_tiles  # still a power of two dividing N_out; R stays (more column blocks)
    return BN, BK, R


def twin_qkv_plan(N: int, K: int, D: int, dtype, compiled: bool, form: str | None = None,
                  block_n: int | None = None) -> tuple[str, int | None]:
    """(form, BN) of the qkv projection with the RoPE and ring-write epilogue (`linear_rope_write`):
    `twin_linear_form`'s form, the MMA form only where a program's columns hold whole GPT-J pairs
    of one head (BN a power of two >= 16 dividing the head dim D); BN is None for the lane form."""
    chosen = twin_linear_form(N, K, dtype, compiled, form)
    if chosen == "lanes":
        return chosen, None
    BN = largest_pow2_divisor(D, TWIN_MMA_MAX_BN) if block_n is None else block_n
    if BN >= 16 and not BN & (BN - 1) and D % BN == 0:
        return chosen, BN
    if form == "mma" or block_n is not None:
        raise ValueError(f"linear_rope_write(block_n): the MMA form needs a power of two >= 16 dividing the head "
                         f"dim {D}, got {BN}")
    return "lanes", None


def twin_mma_stages(N_out: int, BN: int, BK: int, weight_tiles: int = 1, itemsize: int = 2,
                    rows: int = TWIN_MMA_ROWS, M: int = 1) -> int:
    """The MMA form's pipeline depth (speed only): deeper where few programs (N_out / BN column
    blocks, under one per SM) must keep the copy rate's bytes in flight by themselves, and no
    deeper than TWIN_MMA_SMEM_BYTES holds (each stage: `weight_tiles` [BN, BK] tiles, two for the
    gate, and the [rows, BK] x tile).

    Then, where the grid (the M rows of x in row blocks of `rows`, by N_out / BN) holds more programs
    than the SMs do at that depth, shallower, but no shallower than 3: the deepest at which all are
    resident at once, else the deepest at which each SM holds 2 (a program's stages are its shared
    memory; a grid one program over what the SMs hold runs a second, mostly idle wave, and at 2 stages a
    program waits on each load). On an H200, at the temporal step's calls (RESULTS.md, seventeenth
    session), 3 stages rather than 4: the gate at M = 1 from 50.3 to 49.0 us (352 programs: 3 an SM
    rather than 2), the qkv projection at M = 64 from 43 to 35 us (192 programs: 2 an SM rather than 1),
    the gate at M = 64 (352 programs of BN 32) 55.7 us against 76.7 at 4 stages (1 an SM) and 69.5 at 2
    (all resident)."""
    depth = TWIN_MMA_STAGES if N_out // BN >= H200_SMS else TWIN_MMA_FEW_PROGRAMS_STAGES
    stage = (weight_tiles * BN + rows) * BK * itemsize
    depth = max(1, min(depth, TWIN_MMA_SMEM_BYTES // stage))
    programs = -(-M // rows) * (N_out // BN)

    def resident(d):  # programs the SMs hold at once at depth d
        return H200_SMS * (H200_SM_SHARED_BYTES // (d * stage + H200_BLOCK_RESERVED_BYTES))

    if programs <= resident(depth):
        return depth
    shallower = range(depth - 1, 2, -1)
    return next((d for d in shallower if programs <= resident(d)),
                next((d for d in shallower if resident(d) >= 2 * H200_SMS), depth))


def twin_fuse_norm(BM: int, interpreted: bool = False) -> bool:
    """Whether the lane form of a linear given `norm=` runs it fused in its own kernel (else the norm
    kernel first; the bits are the same; the MMA form never fuses it: it stalled that form's
    pipeline, RESULTS.md's fifth session). Fused, every program computes its rows' statistics
    again: on an H200 that pays at one row a program, is even at 4 and costs 30-77% of the
    projection at 8 (the fourth session's A/B, RESULTS.md). Interpreted (CPU), the cost is per
    program: fused up to TWIN_INTERPRET_FUSED_NORM_MAX_BM rows (a test lowers it to run the other path)."""
    return BM <= (TWIN_INTERPRET_FUSED_NORM_MAX_BM if interpreted else TWIN_FUSED_NORM_MAX_BM)


def twin_mma_fuse_norm(K: int) -> bool:
    """Whether the MMA form of a linear given `norm=` runs it fused (each program computes its rows'
    statistics, then normalizes each x block before its product; else the norm kernel first: the
    same bits). A function of K alone. Over K = 4096 (Helium) the normalization in the loop stalled
    the pipelined loads: 42 against 26 us for the qkv projection at B=16 on an H200 (RESULTS.md,
    fifth session). Over a few blocks (Mimi's K = 512: 4) it saves the norm's launch (16 a Mimi
    step) for ~1.8 us more a projection than the two kernels take (RESULTS.md, eighth session)."""
    return K // twin_lanes(K) <= TWIN_MMA_FUSED_NORM_MAX_BLOCKS


def twin_blocks(M: int, N: int, K: int, block_m: int | None = None, block_n: int | None = None,
                interpreted: bool = False, masked_n: bool = False):
    """(BM, BN, BK) of the twin linear kernel: BK from K alone (bits), BM, BN for speed.

    The defaults are the fastest tiles of `benchmarks/twin_tune_gpu.py` on an H200 (RESULTS.md).

    masked_n: the kernel masks columns past N, so block_n need not divide N (Triton's).
    """
    BK = twin_lanes(K)
    max_bn, max_bm = (TWIN_INTERPRET_MAX_BN, TWIN_INTERPRET_MAX_BM) if interpreted else (TWIN_MAX_BN, TWIN_MAX_BM)
    BM = min(max_bm, next_pow2(M)) if block_m is None else block_m
    BN = largest_pow2_divisor(N, max_bn) if block_n is None else block_n
    for name, v, total in (("block_m", BM, None), ("block_n", BN, None if masked_n else N)):
        if v <= 0 or v & (v - 1) or (total is not None and total % v):
            raise ValueError(f"twin linear: {name} must be a power of two dividing {total or 'any M'}, got {v}")
    return BM, BN, BK


class TwinNorm(NamedTuple):
    """A twin norm fused into the linear that follows it: `linear(x, w, layer, norm=TwinNorm(...))`
    multiplies norm(x) (the twin norm's contract, rounded to x's dtype), with the bits of
    `twin_norm.norm` followed by `linear`, in one kernel instead of two.

    kind: "rms" or "layer"; weight, bias: [L, K] (bias only for "layer"), read at the linear's
    layer like its w, or [K] with layer=None; eps: the norm's epsilon.
    """

    kind: str
    weight: Any
    bias: Any
    eps: float


NORM_KINDS = ("rms", "layer")

TWIN_SPLIT_GROUP = 64  # columns a partial sum of squares of the split RMSNorm covers (contract, TwinSplit)


class TwinSplit(NamedTuple):
    """The split RMSNorm, made in the epilogue of the linear before it (`linear(..., split=)`).

    RMSNorm(x) @ w.T = r * (u @ w.T) up to roundings, with u = to_dtype(x * alpha) and r = 1 / sqrt(eps
    + S / D), S the row's sum of squares. The producing linear also returns, for its output rows y:

        u  [M, N_out]      = to_dtype(y * alpha)                        (twin_math.mul, rounded)
        ss [M, N_out / G]  = tree_sum over each G = TWIN_SPLIT_GROUP columns of y * y, in float32

    and the consuming linear, given `rms=TwinRms(ss, eps)` and x = u, scales its float32
    accumulator by r = 1 / sqrt(eps + tree_sum(ss) * inv_K) before its epilogue. No row statistics
    pass and no normalized copy of x: no norm kernel between the two projections, and nothing done to
    the consumer's x tiles inside its pipelined loop (the fifth session's stall, RESULTS.md).

    weight: alpha [L', N_out], read at row min(layer + offset, L' - 1) where layer is the linear's
    own (offset 1: the down-projection makes the next layer's norm; the last layer then makes its
    own, unread), computed in the kernel (an index computed in the layer loop cost a copy of the
    loop's counter a layer on an H200); or [N_out], read as is.
    """

    weight: Any
    offset: int = 0


class TwinRms(NamedTuple):
    """The consumer's half of a split RMSNorm (`TwinSplit`): ss [M, K / TWIN_SPLIT_GROUP] float32 of
    the rows whose u is the linear's x, and the norm's eps."""

    ss: Any
    eps: float


def twin_split_norm(K: int, dtype, compiled: bool) -> bool:
    """Whether a twin stack runs its RMSNorms split (`TwinSplit`) rather than as a norm kernel
    first: where the projections run in the MMA form and would not fuse the norm themselves
    (`twin_mma_fuse_norm`), K a multiple of TWIN_SPLIT_GROUP with a power-of-two count of groups.
    A function of the shapes, dtype and backend: both stacks take the same path."""
    groups = K // TWIN_SPLIT_GROUP
    return (twin_linear_form(K, K, dtype, compiled) == "mma" and not twin_mma_fuse_norm(K)
            and K % TWIN_SPLIT_GROUP == 0 and groups & (groups - 1) == 0)


def check_twin_split(split, rms, norm, M, K, N_out, form, where="linear"):
    """split (a TwinSplit) and rms (a TwinRms): their types, shapes, and the MMA form they need."""
    if split is None and rms is None:
        return
    if form != "mma":
        raise ValueError(f"{where}(split, rms): the split RMSNorm runs in the MMA form only, got form {form!r}")
    if rms is not None:
        if not isinstance(rms, TwinRms):
            raise TypeError(f"{where}(rms): expected a TwinRms or None, got {type(rms).__name__}")
        if norm is not None:
            raise ValueError(f"{where}(rms): x is already the split norm's u; pass norm=None with rms")
        G = K // TWIN_SPLIT_GROUP
        if K % TWIN_SPLIT_GROUP or G & (G - 1) or tuple(rms.ss.shape) != (M, G) or "float32" not in str(rms.ss.dtype):
            raise ValueError(f"{where}(rms.ss): expected float32 [M={M}, K/{TWIN_SPLIT_GROUP}] with a power-of-two "
                             f"count of groups, got {rms.ss.dtype} {tuple(rms.ss.shape)} (K={K})")
    if split is not None:
        if N_out % TWIN_SPLIT_GROUP:
            raise ValueError(f"{where}(split): N_out={N_out} must be a multiple of {TWIN_SPLIT_GROUP}")
        shape = tuple(split.weight.shape)
        if len(shape) != 2 or shape[1] != N_out:
            raise ValueError(f"{where}(split.weight): expected [L, N_out={N_out}] or [N_out], got shape {shape}")
        if isinstance(split.offset, bool) or not isinstance(split.offset, int) or split.offset < 0:
            raise ValueError(f"{where}(split.offset): expected an int >= 0, got {split.offset!r}")


def split_one_layer(split):
    """A TwinSplit with an [N_out] weight as a one-layer stack (then always its row 0)."""
    if split is not None and not isinstance(split, TwinSplit):
        raise TypeError(f"linear(split): expected a TwinSplit or None, got {type(split).__name__}")
    if split is None or len(split.weight.shape) != 1:
        return split
    return TwinSplit(split.weight[None], 0)


def stack_one_layer(w, scale, norm, layer):
    """A twin linear's operands as stacks: a plain [N, K] weight (layer=None) becomes a one-layer
    stack at layer 0, its scale [N] and norm weights [K] with it; returns (w, scale, norm, layer)."""
    if layer is not None:
        return w, scale, norm, layer
    if getattr(w, "ndim", 0) != 2:
        raise ValueError(f"linear(w): with layer=None w must be [N, K], got shape {tuple(getattr(w, 'shape', ()))}")
    if norm is not None:
        norm = norm._replace(weight=norm.weight[None], bias=None if norm.bias is None else norm.bias[None])
    return w[None], None if scale is None else scale[None], norm, 0


LINEAR_ACTS = (None, "silu_gate", "gelu")  # the twin linears' activations


def check_twin_linear(x, w, act, scale, residual, norm=None):
    """(M, K, N, N_out) of a twin linear call, after checking shapes, dtypes, act and the fused norm."""
    if act not in LINEAR_ACTS:
        raise ValueError(f"linear(act): must be one of {LINEAR_ACTS}, got {act!r}")
    if len(x.shape) != 2:
        raise ValueError(f"linear(x): expected [M, K], got shape {tuple(x.shape)}")
    if len(w.shape) != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"linear(w): expected [L, N, K={x.shape[1]}], got shape {tuple(w.shape)}")
    if str(w.dtype) != str(x.dtype):
        raise TypeError(f"linear(w): dtype {w.dtype} differs from x's {x.dtype}")
    M, K = x.shape
    N = w.shape[1]
    if act == "silu_gate" and N % 2:
        raise ValueError(f"linear(act='silu_gate'): w's N must be even, got {N}")
    N_out = N // 2 if act == "silu_gate" else N
    if scale is not None and tuple(scale.shape) != (w.shape[0], N_out):
        raise ValueError(f"linear(scale): expected [{w.shape[0]}, {N_out}], got shape {tuple(scale.shape)}")
    if residual is not None and tuple(residual.shape) != (M, N_out):
        raise ValueError(f"linear(residual): expected [{M}, {N_out}], got shape {tuple(residual.shape)}")
    if norm is not None:
        if not isinstance(norm, TwinNorm):
            raise TypeError(f"linear(norm): expected a TwinNorm or None, got {type(norm).__name__}")
        _check_norm_params(norm.kind, norm.weight, norm.bias, K, "linear(norm.{})", layers=w.shape[0])
    return M, K, N, N_out


def _check_norm_params(kind, weight, bias, D, where, layers=None):
    """kind, and weight / bias [L, D] (L = layers when given); where: "norm({})"-like names."""
    if kind not in NORM_KINDS:
        raise ValueError(f"{where.format('kind')}: must be one of {NORM_KINDS}, got {kind!r}")
    L = "L" if layers is None else layers
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (len(t.shape) != 2 or t.shape[1] != D or (layers is not None and t.shape[0] != layers)):
            raise ValueError(f"{where.format(name)}: expected [{L}, D={D}], got shape {tuple(t.shape)}")
    if kind == "layer" and bias is None:
        raise ValueError(f"{where.format('bias')}: kind='layer' needs a bias")


def check_twin_norm(x, weight, bias, kind):
    """(M, D) of a twin norm call, after checking shapes and dtypes."""
    if len(x.shape) != 2:
        raise ValueError(f"norm(x): expected [M, D], got shape {tuple(x.shape)}")
    M, D = x.shape
    _check_norm_params(kind, weight, bias, D, "norm({})")
    return M, D


class _Shaped(NamedTuple):
    """The shape and dtype of an array a check needs but the call never makes."""

    shape: tuple
    dtype: Any


def check_twin_qkv(x, w, norm, cos, sin, ring_k, ring_v, write_index, write_mask):
    """(B, T, H, D, M, K, N) of a `linear_rope_write` call, after checking every shape: the
    linear's, rope_write's, and that x is [B*T, K] and w [L, 3*H*D, K]."""
    if len(ring_k.shape) != 5 or len(write_index.shape) != 2:
        raise ValueError(f"linear_rope_write: ring_k must be [L, B, H, C, D] and write_index [B, T], got "
                         f"{tuple(ring_k.shape)} and {tuple(write_index.shape)}")
    (B, T), H, D = write_index.shape, ring_k.shape[2], ring_k.shape[4]
    M, K, N, _ = check_twin_linear(x, w, None, None, None, norm)
    check_twin_rope(_Shaped((B, T, 3, H, D), x.dtype), cos, sin, ring_k, ring_v, write_index, write_mask)
    if (M, N) != (B * T, 3 * H * D):
        raise ValueError(f"linear_rope_write: x must be [B*T={B * T}, K] and w [L, 3*H*D={3 * H * D}, K], got x "
                         f"{tuple(x.shape)} and w {tuple(w.shape)}")
    return B, T, H, D, M, K, N


def check_twin_rope(qkv, cos, sin, ring_k, ring_v, write_index, write_mask):
    """(B, T, H, D, (L, C)) of a twin rope_write call, after checking every shape."""
    if len(qkv.shape) != 5 or qkv.shape[2] != 3:
        raise ValueError(f"rope_write(qkv): expected [B, T, 3, H, D], got shape {tuple(qkv.shape)}")
    B, T, _, H, D = qkv.shape
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (B, T, D // 2):
            raise ValueError(f"rope_write({name}): expected [{B}, {T}, {D // 2}], got {tuple(t.shape)}")
    for name, r in (("ring_k", ring_k), ("ring_v", ring_v)):
        if len(r.shape) != 5 or (r.shape[1], r.shape[2], r.shape[4]) != (B, H, D) or str(r.dtype) != str(qkv.dtype):
            raise ValueError(f"rope_write({name}): expected [L, {B}, {H}, C, {D}] in {qkv.dtype}, "
                             f"got {r.dtype}{list(r.shape)}")
    if tuple(write_index.shape) != (B, T) or tuple(write_mask.shape) != (B, T):
        raise ValueError(f"rope_write: write_index and write_mask must be [{B}, {T}], got "
                         f"{tuple(write_index.shape)} and {tuple(write_mask.shape)}")
    return B, T, H, D, (ring_k.shape[0], ring_k.shape[3])


TWIN_ATTENTION_BC = 64       # slots per block of the twin attention (at most)
TWIN_ATTENTION_CHUNK = 256   # slots per split (at most)
TWIN_ATTENTION_MIN_SPLITS = 4  # a ring of a few blocks is still cut into up to this many splits
# the launch order (speed only, both twins): a query's splits one after another, so the combines spread
# over the launch (at B=16 on an H200, the step's attention 6584 against 6790 us; RESULTS.md, eighteenth session)
TWIN_ATTENTION_SPLITS_FIRST = True


def twin_attention_plan(C: int) -> tuple[int, int, int]:
    """(BC, chunk, S) of the twin attention over C ring slots: a function of C alone (bits).

    Splits of at most TWIN_ATTENTION_CHUNK slots, and at least TWIN_ATTENTION_MIN_SPLITS of them
    where the ring has that many blocks: Mimi's 250 slots had run as one split of 4 blocks one
    after the other, a program's latency (8.9 us a layer on an H200); Helium's 3000 are 12 splits
    of 256 either way."""
    BC = min(TWIN_ATTENTION_BC, next_pow2(C))
    blocks = -(-C // BC)
    chunk = min(TWIN_ATTENTION_CHUNK, -(-blocks // TWIN_ATTENTION_MIN_SPLITS) * BC)
    return BC, chunk, -(-C // chunk)


def twin_attention_form(D: int, BC: int, dtype, compiled: bool, form: str | None = None) -> str:
    """Which form of the twin attention runs (`twin_attention`'s docstring): `form` if given
    (checked), else "mma" where it can (compiled for the GPU, 16-bit q and ring, D and the block's
    BC slots multiples of 16), else "lanes". A function of the shapes, the dtype and the backend,
    never of B: both twins pick the same form, and a row's bits do not depend on the batch."""
    fits = str(dtype) in _SIXTEEN_BIT and D % 16 == 0 and BC % 16 == 0
    return _twin_form("attention", form, fits, compiled, f"bfloat16/float16 q and ring, a head dim and a block of "
                      f"slots that are multiples of 16; got {dtype}, D={D}, BC={BC}")


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


def check_twin_attention(q, ring_k, ring_v, positions, q_pos):
    """(B, H, T, D, C) of a twin attention call, after checking every shape."""
    if len(q.shape) != 4:
        raise ValueError(f"attention(q): expected [B, H, T, D], got shape {tuple(q.shape)}")
    B, H, T, D = q.shape
    if D & (D - 1):
        raise ValueError(f"attention(q): the head dim must be a power of two, got {D}")
    for name, r in (("ring_k", ring_k), ("ring_v", ring_v)):
        if len(r.shape) != 5 or (r.shape[1], r.shape[2], r.shape[4]) != (B, H, D) or str(r.dtype) != str(q.dtype):
            raise ValueError(f"attention({name}): expected [L, {B}, {H}, C, {D}] in {q.dtype}, "
                             f"got {r.dtype}{list(r.shape)}")
    C = ring_k.shape[3]
    if tuple(positions.shape) != (B, C) or tuple(q_pos.shape) != (B, T):
        raise ValueError(f"attention: positions must be [{B}, {C}] and q_pos [{B}, {T}], got "
                         f"{tuple(positions.shape)} and {tuple(q_pos.shape)}")
    return B, H, T, D, C


# ------------------------------------------------------------------------------- the codec's twins
# (`kernels_pallas.twin_conv`, `kernels_triton.twin_conv`)
ELU_BLOCK = 1024  # elements of an ELU program, compiled (interpreted: one program for the whole array)
NEAREST_BLOCK = 64  # codebook entries a nearest program scores at once (speed only)


def check_conv1d(x, w, bias, residual, stride: int, dilation: int) -> tuple[int, int, int, int, int, int]:
    """(B, in, L, out, k, T) of a twin conv1d call, after checking shapes, dtypes and the geometry."""
    for name, v in (("stride", stride), ("dilation", dilation)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"conv1d({name}): expected a positive int, got {v!r}")
    if len(x.shape) != 3:
        raise ValueError(f"conv1d(x): expected [B, in, L], got shape {tuple(x.shape)}")
    B, cin, L = x.shape
    if len(w.shape) != 3 or w.shape[1] != cin:
        raise ValueError(f"conv1d(w): expected [out, in={cin}, k] (groups 1), got shape {tuple(w.shape)}")
    if str(w.dtype) != str(x.dtype):
        raise TypeError(f"conv1d(w): dtype {w.dtype} differs from x's {x.dtype}")
    cout, _, k = w.shape
    span = (k - 1) * dilation + 1
    if L < span:
        raise ValueError(f"conv1d(x): {L} samples are fewer than the kernel's span {span}")
    T = (L - span) // stride + 1
    if bias is not None and tuple(bias.shape) != (cout,):
        raise ValueError(f"conv1d(bias): expected [{cout}], got shape {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != (B, cout, T):
        raise ValueError(f"conv1d(residual): expected [{B}, {cout}, {T}], got shape {tuple(residual.shape)}")
    return B, cin, L, cout, k, T


def check_conv_transpose1d(x, w, bias, stride: int, groups: int) -> tuple[int, int, int, int, int]:
    """(B, in, T, out, k) of a twin conv_transpose1d call, after checking shapes, dtypes and groups."""
    if isinstance(stride, bool) or not isinstance(stride, int) or stride <= 0:
        raise ValueError(f"conv_transpose1d(stride): expected a positive int, got {stride!r}")
    if len(x.shape) != 3:
        raise ValueError(f"conv_transpose1d(x): expected [B, in, T], got shape {tuple(x.shape)}")
    B, cin, T = x.shape
    if len(w.shape) != 3 or w.shape[0] != cin:
        raise ValueError(f"conv_transpose1d(w): expected [in={cin}, out / groups, k], got shape {tuple(w.shape)}")
    if str(w.dtype) != str(x.dtype):
        raise TypeError(f"conv_transpose1d(w): dtype {w.dtype} differs from x's {x.dtype}")
    if groups == 1:
        cout = w.shape[1]
    elif groups == cin and w.shape[1] == 1:
        cout = cin
    else:
        raise ValueError(f"conv_transpose1d(groups): 1 or channel-wise (groups = in = out = {cin}, w [{cin}, 1, k]), "
                         f"got groups={groups!r} with w {tuple(w.shape)}")
    if bias is not None and tuple(bias.shape) != (cout,):
        raise ValueError(f"conv_transpose1d(bias): expected [{cout}], got shape {tuple(bias.shape)}")
    return B, cin, T, cout, w.shape[2]


def check_nearest(x, entries) -> tuple[int, int, int]:
    """(M, N, D) of a twin nearest call, after checking shapes and dtypes."""
    if len(x.shape) != 2:
        raise ValueError(f"nearest(x): expected [M, D], got shape {tuple(x.shape)}")
    if len(entries.shape) != 2 or entries.shape[1] != x.shape[1] or entries.shape[0] == 0:
        raise ValueError(f"nearest(entries): expected [N >= 1, D={x.shape[1]}], got shape {tuple(entries.shape)}")
    if str(entries.dtype) != str(x.dtype):
        raise TypeError(f"nearest(entries): dtype {entries.dtype} differs from x's {x.dtype}")
    return x.shape[0], entries.shape[0], x.shape[1]
