"""The twin linears' contract: tile plans, launch constants and argument checks.

`kernels_pallas.twin_linear` and `kernels_triton.twin_linear` run one of two forms (`twin_linear_form`,
a function of N, K, the dtype and the backend): the lane form (`LinearBlocks`) and the MMA form
(`MmaBlocks`, `twin_mma_stages`). Of a plan, only the lanes of the sum over K (`numerics.twin_lanes`)
fix bits; every other tile size is speed only. The defaults are the fastest of
`benchmarks/twin_tune_gpu.py` on an H200 (RESULTS.md).
Standard library only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from kernels_pallas.contract import numerics
from kernels_pallas.contract.norm import (
    TWIN_SPLIT_GROUP,
    TwinNorm,
    check_eps,
    check_norm_params,
)
from kernels_pallas.contract.numerics import (
    TWIN_MMA_ROWS,
    check_nonempty,
    check_twin_dtype,
    choose_form,
    largest_pow2_divisor,
    next_pow2,
    sixteen_bit,
    twin_lanes,
)
from kernels_pallas.contract.rope import check_twin_rope

TWIN_MAX_BN = 8    # output columns per program of the lane form (speed only; compiled)
TWIN_MAX_BM = 8    # output rows per program of the lane form (speed only; compiled) ...
TWIN_LANE_PRODUCTS = 8192  # ... or more, up to this many products a step of its loop over K (BM * BN * BK) ...
TWIN_LANE_MAX_BM = 128     # ... and this many rows (`LinearBlocks.for_shapes`)
TWIN_INTERPRET_MAX_BN = 256  # interpreted (CPU), fewer, larger programs: each costs Python overhead
TWIN_TRITON_LINEAR_STAGES = 4  # the Triton lane form's software-pipeline depth over K (twin_tune_gpu's fastest)
TWIN_PALLAS_PREFETCH = 1  # weight blocks the Pallas lane form loads ahead of their use (twin_pallas_prefetch)
TWIN_FUSED_NORM_MAX_BM = 4  # a linear's norm runs fused only up to this many rows a program (twin_fuse_norm)
TWIN_INTERPRET_FUSED_NORM_MAX_BM = 64  # ... interpreted (every interpreted tile, TWIN_INTERPRET_MAX_BM)
TWIN_MMA_FUSED_NORM_MAX_BLOCKS = 4  # the MMA form fuses its norm only up to this many K blocks (twin_mma_fuse_norm)
TWIN_MMA_MAX_ROWS = 64  # x rows a program of the MMA linears (`twin_mma_rows`: 16, 32 or 64; speed only, the same bits)
TWIN_MMA_MIN_PROGRAMS = 64  # ... while the grid keeps this many programs (Mimi's grids of 8-32 column blocks) ...
TWIN_MMA_SHORT_K_BLOCKS = 4  # ... or, where K is at most this many blocks of its lanes (Mimi's 512, in 4) ...
TWIN_MMA_SHORT_K_MIN_PROGRAMS = 256  # ... this many (`twin_mma_rows`)
TWIN_MMA_MAX_BN = 64  # output columns per program of the MMA form (speed only)
TWIN_MMA_STAGES = 4   # software-pipeline depth of the MMA form's loop over K (speed only, both sides) ...
TWIN_MMA_FEW_PROGRAMS_STAGES = 8  # ... where the grid has fewer column blocks than the H200 has SMs
TWIN_MMA_SMEM_BYTES = 200 * 1024  # shared memory the MMA form's pipeline may fill (an H200 block gets 227 KB)
# The MMA form on Pallas's Mosaic GPU backend (`kernels_pallas.twin_linear_mgpu`; speed only, the same bits)
MOSAIC_ROWS = 64    # x rows a program: wgmma's M, the A operand (TMA reads rows past M as zeros)
MOSAIC_BK = 64      # K elements a pipeline step: one 128-byte swizzled row of 16-bit values (fewer: 16 or 32
                    # where K has no factor of 64, the MMA form's K of a power-of-two factor of 16 or 32)
MOSAIC_BN = 64      # output columns a program (64 or 128; 16 or 32 where N_out has no factor of 64)
MOSAIC_MIN_TILE = 16  # the narrowest K block and column block: wgmma's k for 16-bit operands, a 32-byte swizzle
MOSAIC_STAGES = 4   # pipeline depth over K (each step's buffers are refilled one step late: >= 2)
MOSAIC_TREE_LANES = 8  # a row sum's last lanes in registers: the wgmma layout's narrowest tile (twin_norm_mgpu)
MOSAIC_MIN_JAX = (0, 11)  # Mosaic GPU's interpreter before 0.11 cannot read a transposed wgmma operand
H200_SMS = 132
H200_SM_SHARED_BYTES = 228 * 1024  # shared memory an H200 SM holds for all its resident programs ...
H200_BLOCK_RESERVED_BYTES = 1024   # ... of which the system takes this much a program


def twin_linear_form(N_out: int, K: int, dtype, compiled: bool, form: str | None = None) -> str:
    """Which form of the twin linear runs: `form` if given (checked), else "mma" where it can
    (compiled for the GPU, 16-bit x and w, K and N_out multiples of 16), else "lanes".

    A function of the shapes, the dtype and the backend alone, never of M: both twins pick the
    same form, and a row's bits do not depend on the batch.
    """
    fits = sixteen_bit(dtype) and twin_lanes(K) >= 16 and N_out % 16 == 0
    return choose_form("linear", form, fits, compiled,
                      f"bfloat16/float16 x and w, K and N_out multiples of 16; got {dtype}, K={K}, N_out={N_out}")


def twin_mma_rows(M: int, column_blocks: int, K: int, block_m: int | None = None, who: str = "linear") -> int:
    """x rows a program of the MMA linears over K (the MMA's n dimension; speed only): `block_m` if
    given (checked: 16, 32 or 64), else the most, up to TWIN_MMA_MAX_ROWS, that M fills (more than
    half) while the grid keeps TWIN_MMA_MIN_PROGRAMS programs, or TWIN_MMA_SHORT_K_MIN_PROGRAMS where
    K is at most TWIN_MMA_SHORT_K_BLOCKS blocks.

    A program of 64 rows loads each weight tile once for all of them and issues a quarter of the
    MMAs: at M=64 on an H200 the temporal projections take 0.6-0.7x the time of 16-row programs, the
    out projection's 64 programs included (RESULTS.md). Over a short K a program has little to load
    and its fixed part (a fused norm's statistics, the epilogue) is most of it: Mimi's linear1 (K =
    512, N = 2048, the layer norm fused, gelu) at M = 128 took 7.3 us in 256 programs of 16 rows
    against 12.3 in 64 of 64 (RESULTS.md). Each output element's
    sum over a K block is the MMA's own whatever its n: the H200 gives the same bits at 16, 32 and
    64 rows (as at mma.sync and wgmma alike), which the GPU tests hold the two twins to."""
    if block_m is not None:
        if block_m not in (16, 32, TWIN_MMA_MAX_ROWS):
            raise ValueError(f"{who}(block_m): the MMA form runs 16, 32 or {TWIN_MMA_MAX_ROWS} rows a program, "
                             f"got {block_m!r}")
        return block_m
    short = K // twin_lanes(K) <= TWIN_MMA_SHORT_K_BLOCKS
    programs = TWIN_MMA_SHORT_K_MIN_PROGRAMS if short else TWIN_MMA_MIN_PROGRAMS
    R = TWIN_MMA_MAX_ROWS
    while R > TWIN_MMA_ROWS and (M <= R // 2 or -(-M // R) * column_blocks < programs):
        R //= 2
    return R


@dataclasses.dataclass(frozen=True)
class MmaBlocks:
    """The tiles of an MMA linear, both twins' (speed only: every plan gives the same bits).

    block_n: BN, output columns a program (a power of two >= 16 dividing N_out); block_k: BK =
    `twin_lanes(K)` (the norm's blocks too); rows: R, x rows a program (`twin_mma_rows`).
    """

    block_n: int
    block_k: int
    rows: int

    @classmethod
    def for_shapes(cls, M: int, N_out: int, K: int, weight_tiles: int = 1, split: bool = False,
                   block_m: int | None = None, block_n: int | None = None) -> MmaBlocks:
        """The plan of an MMA linear over x [M, K] into N_out columns; block_m, block_n: the caller's.

        With the split norm's consumer half (`split`), BN is TWIN_SPLIT_GROUP (a given block_n must be
        it). Else the largest power of two up to TWIN_MMA_MAX_BN dividing N_out, halved for the gate
        (`weight_tiles` 2: each program loads a tile of each half) where its programs run more than
        TWIN_MMA_ROWS rows: its weight rows a program then match the other projections'. On an H200, at
        the pipeline depth `twin_mma_stages` gives each, the gate took 55.7 us a layer at BN 32 against
        63.1-71.8 at BN 64 at 64 rows a program (M = 64), and 48.6-49.2 against 47.7-48.2 at 16 (M = 1,
        16); in the step at 16 rows, 1540 us against 1570 (B=1) and 1540 against 1559 (B=16) a step
        (RESULTS.md). R: `twin_mma_rows`, of the columns before any halving."""
        if split and block_n is None:
            block_n = TWIN_SPLIT_GROUP
        BN = largest_pow2_divisor(N_out, TWIN_MMA_MAX_BN) if block_n is None else block_n
        if BN < 16 or BN & (BN - 1) or N_out % BN:
            raise ValueError(f"linear(block_n): the MMA form needs a power of two >= 16 dividing N_out={N_out}, "
                             f"got {BN}")
        if split and BN != TWIN_SPLIT_GROUP:
            raise ValueError(f"linear(block_n): with split the MMA form runs {TWIN_SPLIT_GROUP} columns a program, "
                             f"got {BN}")
        R = twin_mma_rows(M, N_out // BN, K, block_m)
        if block_n is None and BN // weight_tiles >= 16 and R > TWIN_MMA_ROWS:
            BN //= weight_tiles  # still a power of two dividing N_out; R stays (more column blocks)
        return cls(BN, twin_lanes(K), R)


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
    program waits on each load). On an H200, at the temporal step's calls (RESULTS.md), 3 stages rather than 4: the gate at M = 1 from 50.3 to 49.0 us (352 programs: 3 an SM
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


def twin_pallas_prefetch(K: int, BK: int) -> int:
    """Weight blocks the Pallas lane form loads ahead of their use: TWIN_PALLAS_PREFETCH (read at call
    time: a benchmark sets it), at most the K / BK blocks there are. Speed only. A constant of that
    backend, not an argument: its lowering has no pipelined loop (the Triton twin's `num_stages`), and
    the twins take one signature, with no keyword one of them would ignore."""
    return min(TWIN_PALLAS_PREFETCH, K // BK)


def twin_fuse_norm(BM: int, interpreted: bool = False) -> bool:
    """Whether the lane form of a linear given `norm=` runs it fused in its own kernel (else the norm
    kernel first; the bits are the same; the MMA form never fuses it: it stalled that form's
    pipeline, RESULTS.md). Fused, every program computes its rows' statistics
    again: on an H200 that pays at one row a program, is even at 4 and costs 30-77% of the
    projection at 8 (an A/B in RESULTS.md). Interpreted (CPU), the cost is per
    program: fused up to TWIN_INTERPRET_FUSED_NORM_MAX_BM rows (a test lowers it to run the other path)."""
    return BM <= (TWIN_INTERPRET_FUSED_NORM_MAX_BM if interpreted else TWIN_FUSED_NORM_MAX_BM)


def twin_mma_fuse_norm(K: int) -> bool:
    """Whether the MMA form of a linear given `norm=` runs it fused (each program computes its rows'
    statistics, then normalizes each x block before its product; else the norm kernel first: the
    same bits). A function of K alone. Over K = 4096 (Helium) the normalization in the loop stalled
    the pipelined loads: 42 against 26 us for the qkv projection at B=16 on an H200 (RESULTS.md). Over a few blocks (Mimi's K = 512: 4) it saves the norm's launch (16 a Mimi
    step) for ~1.8 us more a projection than the two kernels take (RESULTS.md)."""
    return K // twin_lanes(K) <= TWIN_MMA_FUSED_NORM_MAX_BLOCKS


@dataclasses.dataclass(frozen=True)
class LinearBlocks:
    """The tiles of the lane form of a twin linear: block_k (BK) from K alone (bits), block_m (BM)
    and block_n (BN) for speed."""

    block_m: int
    block_n: int
    block_k: int

    @classmethod
    def for_shapes(cls, M: int, N: int, K: int, block_m: int | None = None, block_n: int | None = None,
                   interpreted: bool = False, masked_n: bool = False) -> LinearBlocks:
        """The plan of a lane-form linear over x [M, K] into N columns; block_m, block_n: the caller's.

        The defaults are the fastest tiles of `benchmarks/twin_tune_gpu.py` on an H200 (RESULTS.md):
        BM up to TWIN_MAX_BM rows, more where a program's step over K would be small (BN * BK under
        TWIN_LANE_PRODUCTS / TWIN_MAX_BM): the codec's first convolution (K = 7: one lane, 8 columns a
        program) took 75 us at B=64 in programs of 8 rows, 21.5 in programs of 128 (RESULTS.md).
        masked_n: the kernel masks columns past N, so block_n need not divide N (Triton's).
        """
        def checked(name, v, total):
            if v <= 0 or v & (v - 1) or (total is not None and total % v):
                raise ValueError(f"twin linear: {name} must be a power of two dividing {total or 'any M'}, got {v}")
            return v

        max_bn, max_bm = (TWIN_INTERPRET_MAX_BN, numerics.TWIN_INTERPRET_MAX_BM) if interpreted else (TWIN_MAX_BN, TWIN_MAX_BM)
        BN = checked("block_n", largest_pow2_divisor(N, max_bn) if block_n is None else block_n, None if masked_n else N)
        BK = twin_lanes(K)
        if not interpreted:  # few columns and lanes (the codec's first and last convolutions): more rows
            max_bm = max(max_bm, min(TWIN_LANE_MAX_BM, TWIN_LANE_PRODUCTS // (BN * BK)))
        BM = checked("block_m", min(max_bm, next_pow2(M)) if block_m is None else block_m, None)
        return cls(BM, BN, BK)


def twin_split_norm(K: int, dtype, compiled: bool) -> bool:
    """Whether a twin stack runs its RMSNorms split (`TwinSplit`) rather than as a norm kernel
    first: where the projections run in the MMA form and would not fuse the norm themselves
    (`twin_mma_fuse_norm`), K a multiple of TWIN_SPLIT_GROUP with a power-of-two count of groups.
    A function of the shapes, dtype and backend: both stacks take the same path."""
    groups = K // TWIN_SPLIT_GROUP
    return (twin_linear_form(K, K, dtype, compiled) == "mma" and not twin_mma_fuse_norm(K)
            and K % TWIN_SPLIT_GROUP == 0 and groups & (groups - 1) == 0)


def mosaic_padded_rows(M: int) -> int:
    """The rows a Mosaic GPU kernel's TMA copies see of an [M, ...] operand: M itself up to 8, else M
    rounded up to a multiple of 8 (TMA tiles the rows by 8; the caller pads and slices where this is not M)."""
    return M if M <= 8 else -(-M // 8) * 8


def mosaic_tiles(K: int, N_out: int) -> tuple[int, int]:
    """(BK, BN): the K block and the output columns a program of the Mosaic GPU linear, by default: 64
    each, or the largest power of two down to MOSAIC_MIN_TILE that K's lanes (`twin_lanes`) and N_out
    hold (the MMA form's shapes: its bits do not depend on the tiles)."""
    return (min(MOSAIC_BK, twin_lanes(K)),
            next(b for b in (MOSAIC_BN, 32, MOSAIC_MIN_TILE, 1) if N_out % b == 0))


def check_mosaic_linear(dtype, K: int, N_out: int, block_n: int | None, stages: int, interpret: bool,
                        jax_version: tuple, split: bool = False, rms: bool = False) -> tuple[int, int]:
    """(BK, BN) of a Mosaic GPU linear (`twin_linear_mgpu.linear`), after checking what its kernel takes;
    split, rms: whether the split RMSNorm's producer or consumer half runs in it."""
    if not sixteen_bit(dtype):
        raise TypeError(f"linear(x): the Mosaic GPU linear (the MMA form) takes bfloat16/float16, got {dtype}")
    BK, BN = mosaic_tiles(K, N_out)
    if BK < MOSAIC_MIN_TILE:
        raise ValueError(f"linear(x): the Mosaic GPU linear needs K with a power-of-two factor of at least "
                         f"{MOSAIC_MIN_TILE} (the MMA form's), got K={K}")
    BN = BN if block_n is None else block_n
    if BN not in (16, 32, 64, 128) or N_out % BN:
        raise ValueError(f"linear(block_n): the Mosaic GPU linear runs 16, 32, 64 or 128 columns a program, "
                         f"dividing N_out={N_out}; got {BN!r}")
    if split and BN != TWIN_SPLIT_GROUP:
        raise ValueError(f"linear(block_n): with split the Mosaic GPU linear runs {TWIN_SPLIT_GROUP} columns a "
                         f"program, got {BN}")
    if rms and K // TWIN_SPLIT_GROUP < MOSAIC_TREE_LANES:
        raise ValueError(f"linear(rms): the Mosaic GPU linear sums at least {MOSAIC_TREE_LANES} groups of "
                         f"{TWIN_SPLIT_GROUP} (K >= {MOSAIC_TREE_LANES * TWIN_SPLIT_GROUP}), got K={K}")
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2:
        raise ValueError(f"linear(stages): expected an int >= 2, got {stages!r}")
    check_mosaic_interpreter("linear", interpret, jax_version)
    return BK, BN


def mosaic_takes_linear(dtype, K: int, N_out: int, *, norm: bool = False, rms: bool = False, split: bool = False,
                        head_dim: int | None = None) -> bool:
    """Whether the Mosaic GPU linears (`twin_linear_mgpu`) run a call at their default tiles: the MMA
    form's shapes (16-bit operands, K with a power-of-two factor of at least 16, N_out a multiple of 16);
    with a norm run first, K a multiple of 128 (the norm's lanes); with the split norm's producer half,
    N_out a multiple of 64 (its groups), with its consumer half at least 8 groups; the qkv kernel, K and
    a head dim of multiples of 64. The Mosaic twins run the Triton-backend kernel where not."""
    return (sixteen_bit(dtype) and twin_lanes(K) >= MOSAIC_MIN_TILE and N_out % MOSAIC_MIN_TILE == 0
            and (not norm or K % 128 == 0) and (not rms or K // TWIN_SPLIT_GROUP >= MOSAIC_TREE_LANES)
            and (not split or N_out % TWIN_SPLIT_GROUP == 0)
            and (head_dim is None or (head_dim % MOSAIC_BN == 0 and K % MOSAIC_BK == 0)))


def check_mosaic_interpreter(who: str, interpret: bool, jax_version: tuple) -> None:
    """Refuse to interpret a Mosaic GPU kernel (`who`) with a jax older than MOSAIC_MIN_JAX."""
    if interpret and tuple(jax_version[:2]) < MOSAIC_MIN_JAX:
        raise RuntimeError(f"{who}(interpret=True): Mosaic GPU's interpreter needs jax >= "
                           f"{'.'.join(map(str, MOSAIC_MIN_JAX))} (0.10's cannot read a transposed wgmma operand); "
                           f"this is jax {'.'.join(map(str, jax_version))}")


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


def check_native_linear(form, split, rms) -> None:
    """What the linears' plain references refuse: they compute the lane form, without the split
    RMSNorm's halves (`split`, `rms`: the MMA form's, whose bits are the tensor cores')."""
    if form not in (None, "lanes"):
        raise ValueError(f"linear_native(form): the reference computes the lane form only, got {form!r}")
    if split is not None or rms is not None:
        raise ValueError("linear_native(split, rms): the split RMSNorm's halves run in the MMA form only, which "
                         "has no plain reference")


def check_twin_linear(x, w, act, scale, residual, norm=None):
    """(M, K, N, N_out) of a twin linear call, after checking shapes, dtypes, act and the fused norm."""
    if act not in LINEAR_ACTS:
        raise ValueError(f"linear(act): must be one of {LINEAR_ACTS}, got {act!r}")
    check_twin_dtype("linear", "x", x)
    if len(x.shape) != 2:
        raise ValueError(f"linear(x): expected [M, K], got shape {tuple(x.shape)}")
    if len(w.shape) != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"linear(w): expected [L, N, K={x.shape[1]}], got shape {tuple(w.shape)}")
    if str(w.dtype) != str(x.dtype):
        raise TypeError(f"linear(w): dtype {w.dtype} differs from x's {x.dtype}")
    check_nonempty("linear", "x", x.shape, ("row (M)", "column (K)"))
    check_nonempty("linear", "w", w.shape, ("layer (L)", "row (N)"))
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
        check_norm_params(norm.kind, norm.weight, norm.bias, K, "linear(norm.{})", layers=w.shape[0])
        check_eps("linear(norm.eps)", norm.eps)
    return M, K, N, N_out


class Shaped(NamedTuple):
    """The shape and dtype of an array a check needs but the call never makes."""

    shape: tuple
    dtype: Any


def check_twin_qkv(x, w, norm, cos, sin, ring_k, ring_v, write_index, write_mask, slots=None, written=None):
    """(B, T, H, D, M, K, N) of a `linear_rope_write` call, after checking every shape: the
    linear's, rope_write's (slots, written: `check_twin_rope`'s), and that x is [B*T, K] and w
    [L, 3*H*D, K]."""
    if len(ring_k.shape) != 5 or len(write_index.shape) != 2:
        raise ValueError(f"linear_rope_write: ring_k must be [L, B, H, C, D] and write_index [B, T], got "
                         f"{tuple(ring_k.shape)} and {tuple(write_index.shape)}")
    (B, T), H, D = write_index.shape, ring_k.shape[2], ring_k.shape[4]
    M, K, N, _ = check_twin_linear(x, w, None, None, None, norm)
    check_twin_rope(Shaped((B, T, 3, H, D), x.dtype), cos, sin, ring_k, ring_v, write_index, write_mask, slots,
                    written, who="linear_rope_write")
    if (M, N) != (B * T, 3 * H * D):
        raise ValueError(f"linear_rope_write: x must be [B*T={B * T}, K] and w [L, 3*H*D={3 * H * D}, K], got x "
                         f"{tuple(x.shape)} and w {tuple(w.shape)}")
    return B, T, H, D, M, K, N


