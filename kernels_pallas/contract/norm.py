"""The twin norms' contract: the norm kinds, the fused (`TwinNorm`) and split (`TwinSplit`, `TwinRms`)
norms a linear takes, the norm kernels' plan (`NormBlocks`) and the argument checks.

Standard library only.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

from kernels_pallas.contract import numerics
from kernels_pallas.contract.numerics import (
    check_nonempty,
    check_twin_dtype,
    largest_pow2_divisor,
    next_pow2,
    twin_lanes,
)

NORM_KINDS = ("rms", "layer")
TWIN_NORM_WARPS = 2  # warps of a norm program (compiled: one row each, see NormBlocks)
TWIN_NORM_ROWS_IN_FLIGHT = 32  # block-rows a norm's statistics loop loads at once (twin_norm_unroll)


@dataclasses.dataclass(frozen=True)
class NormBlocks:
    """The tiles of a twin norm kernel: block_m (BM) rows a program, speed only; block_k (BK) =
    `twin_lanes(D)` lanes of the row sums (bits)."""

    block_m: int
    block_k: int

    @classmethod
    def for_shapes(cls, M: int, D: int, block_m: int | None = None, interpreted: bool = False) -> NormBlocks:
        """The plan of a norm of x [M, D]; block_m: the caller's (a power of two), or None.

        Compiled, one row a program: its D / BK block loads go out together and need no shuffles
        between rows (4 rows a program took 22 us a norm on an H200). Interpreted, as many rows as
        fit in one program: the interpreter's cost is per program.
        """
        if block_m is not None and (block_m <= 0 or block_m & (block_m - 1)):
            raise ValueError(f"norm(block_m): must be a power of two, got {block_m}")
        if block_m is None:
            block_m = min(numerics.TWIN_INTERPRET_MAX_BM, next_pow2(M)) if interpreted else 1
        return cls(block_m, twin_lanes(D))


def twin_norm_unroll(num_blocks: int, BM: int) -> int:
    """Blocks of BK lanes a norm's statistics loop loads per iteration, for programs of BM rows
    (speed only: the additions are the same, in the same order). One row a program: all of them
    (the loads go out together). More rows: fewer, so a program holds ~TWIN_NORM_ROWS_IN_FLIGHT
    block-rows at once, not all (32 blocks x 8 rows would spill)."""
    return largest_pow2_divisor(num_blocks, max(1, TWIN_NORM_ROWS_IN_FLIGHT // BM)) if BM > 1 else num_blocks


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
    the consumer's x tiles inside its pipelined loop (a stall, RESULTS.md).

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


def check_rms(rms, where="linear"):
    """rms: None or a TwinRms with a good eps (`check_eps`), checked before a linear's options are built
    from it: there an eps of None had read as no split norm at all (the sums left unscaled)."""
    if rms is None:
        return
    if not isinstance(rms, TwinRms):
        raise TypeError(f"{where}(rms): expected a TwinRms or None, got {type(rms).__name__}")
    check_eps(f"{where}(rms.eps)", rms.eps)


def check_twin_split(split, rms, norm, M, K, N_out, form, where="linear"):
    """split (a TwinSplit) and rms (a TwinRms): their types, shapes, and the MMA form they need."""
    if split is None and rms is None:
        return
    if form != "mma":
        raise ValueError(f"{where}(split, rms): the split RMSNorm runs in the MMA form only, got form {form!r}")
    if rms is not None:
        check_rms(rms, where)
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


def check_norm_params(kind, weight, bias, D, where, layers=None):
    """kind, and weight / bias [L, D] (L = layers when given); where: "norm({})"-like names."""
    if kind not in NORM_KINDS:
        raise ValueError(f"{where.format('kind')}: must be one of {NORM_KINDS}, got {kind!r}")
    L = "L" if layers is None else layers
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (len(t.shape) != 2 or t.shape[1] != D or (layers is not None and t.shape[0] != layers)):
            raise ValueError(f"{where.format(name)}: expected [{L}, D={D}], got shape {tuple(t.shape)}")
    if kind == "layer" and bias is None:
        raise ValueError(f"{where.format('bias')}: kind='layer' needs a bias")
    if kind == "rms" and bias is not None:  # the kernels would not read it: refused, not ignored
        raise ValueError(f"{where.format('bias')}: kind='rms' adds no bias, got one (pass None)")


def check_eps(where: str, eps) -> None:
    """Refuse a norm's epsilon that is not a finite real number >= 0 (a bool is not one); where: its
    name, "norm(eps)"-like. None reached the kernels as a raw error, another on each side."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{where}: expected a finite float >= 0, got {eps!r}")


def check_twin_norm(x, weight, bias, kind):
    """(M, D) of a twin norm call, after checking shapes and dtypes."""
    check_twin_dtype("norm", "x", x)
    if len(x.shape) != 2:
        raise ValueError(f"norm(x): expected [M, D], got shape {tuple(x.shape)}")
    check_nonempty("norm", "x", x.shape, ("row (M)", "feature (D)"))
    M, D = x.shape
    check_norm_params(kind, weight, bias, D, "norm({})")
    return M, D


def check_norm_grad(x, dy, weight, bias, kind, eps):
    """(M, D) of a norm_grad call, checked: x, dy [M, D] of one dtype, the norm's weights and eps."""
    M, D = check_twin_norm(x, weight, bias, kind)
    check_eps("norm_grad(eps)", eps)
    if tuple(dy.shape) != (M, D) or str(dy.dtype) != str(x.dtype):
        raise ValueError(f"norm_grad(dy): expected {x.dtype} [{M}, {D}], got {dy.dtype} {tuple(dy.shape)}")
    return M, D
