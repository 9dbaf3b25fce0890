"""The twin kernels' float32 arithmetic, Triton side: the same operations as `kernels_pallas.twin_math`.

The contract is `kernels_pallas.contract.numerics` (framework-free: its constants are read here
without importing jax); this module is the Pallas one's Triton twin, operation for operation (keep the
two in step). Products are plain ``a * b``: every twin kernel launches with
``enable_fp_fusion=False``, which makes each product a ``mul.rn.f32`` of its own (the Pallas
twin writes that instruction); the interpreter (numpy) never fuses. The linear kernels' 16-bit
products go through ``tl.fma`` (exact products: the same bits; see the Pallas module). Division
and square root are ``div_rn`` / ``sqrt_rn``. `INTERPRETED` (constexpr) is True under ``TRITON_INTERPRET=1``, where
the float32 -> bfloat16 cast truncates, so `to_dtype` rounds with integer operations there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels_pallas.contract.numerics import (
    COS_POLY,
    ERF_ALPHA,
    ERF_BETA,
    EXP_POLY,
    LN2_HI,
    LN2_LO,
    LOG2E,
    PIO2,
    SIN_POLY,
    SQRT1_2,
    TWO_OVER_PI,
    check_index,
)

_LOG2E = tl.constexpr(LOG2E)
_LN2_HI, _LN2_LO = tl.constexpr(LN2_HI), tl.constexpr(LN2_LO)
_E0, _E1, _E2, _E3, _E4, _E5 = (tl.constexpr(c) for c in EXP_POLY)
_TWO_OVER_PI = tl.constexpr(TWO_OVER_PI)
_P0, _P1, _P2 = (tl.constexpr(c) for c in PIO2)
_S0, _S1, _S2 = (tl.constexpr(c) for c in SIN_POLY)
_C0, _C1, _C2 = (tl.constexpr(c) for c in COS_POLY)
_A0, _A1, _A2, _A3, _A4, _A5, _A6 = (tl.constexpr(c) for c in ERF_ALPHA)
_B0, _B1, _B2, _B3, _B4 = (tl.constexpr(c) for c in ERF_BETA)
_SQRT1_2 = tl.constexpr(SQRT1_2)


def interpreting(kernel) -> bool:
    """Whether ``triton.jit`` built `kernel` for Triton's interpreter.

    Read off the kernel object, not the environment: TRITON_INTERPRET counts only when the kernel
    is decorated (at import), so the object is what a launch will actually run.
    """
    return isinstance(kernel, InterpretedFunction)


def check_device(device, who: str) -> None:
    """RuntimeError unless the Triton kernels can run on `device` (a torch device or its name; None:
    torch's default device); `who` starts the message (what is on that device).

    On the CPU Triton runs only under its interpreter, which is chosen when triton is imported
    (``TRITON_INTERPRET=1``); compiled, a CPU launch fails deep in Triton with "0 active drivers".
    Every torch entry point of the Triton kernels checks here where it learns its device (a twin
    stack's construction and conversions, an MRoPE call), before anything is allocated or launched.
    """
    if torch.empty(0, device=device).device.type == "cpu" and not interpreting(mma):
        raise RuntimeError(f"{who} is on the CPU and Triton is not interpreting; set TRITON_INTERPRET=1 "
                           "before importing triton to run the kernels on the CPU, or use a CUDA device")


def host_values(x):
    """x's values where reading them waits on no device (a CPU tensor), else None (on a GPU): what
    `contract.numerics.check_index` may read."""
    return x.detach().numpy() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else None


_LAYER_TENSORS: dict = {}


def layer_tensor(layer, L: int, device, who: str) -> torch.Tensor:
    """The layer index as a 1-element int32 device tensor, after `contract.numerics.check_index` (an int or
    a CPU tensor is range-checked here; a GPU tensor's value is not read: in range by its caller).

    An int's tensor is made once per (device, layer) and kept: no host-to-device copy per call,
    so the twin layers can be captured in a CUDA graph.
    """
    if type(layer) is int and 0 <= layer < L:  # the launches' hot path: an in-range int's tensor, made once
        cached = _LAYER_TENSORS.get((torch.device(device), layer))
        if cached is not None:
            return cached
    if torch.device(device).type == "meta":
        raise ValueError(f"{who}: meta tensors hold no data for the kernels to read")
    if isinstance(layer, torch.Tensor):  # its values are read where that waits on no device (the CPU)
        check_index(who, "layer", layer, L, host_values(layer), scalar=True)
        return layer.reshape(1).to(device=device, dtype=torch.int32)
    check_index(who, "layer", layer, L)  # a Python or numpy int; anything else refused by type
    layer = int(layer)
    key = (torch.device(device), layer)
    if key not in _LAYER_TENSORS:
        _LAYER_TENSORS[key] = torch.tensor([layer], dtype=torch.int32, device=device)
    return _LAYER_TENSORS[key]


@triton.jit
def mma(a, b, INTERPRETED: tl.constexpr):
    """a @ b in float32 on the tensor cores (16-bit a and b: the MMA forms). Interpreted, on float32
    copies (exact products): the interpreter's bfloat16 dot multiplies the raw bits (Triton 3.9's)."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def mma_add(acc, d, INTERPRETED: tl.constexpr):
    """acc + d after an `mma` (the Pallas twin's `mma_add`, the attention's): compiled, an
    ``add.rn.f32`` the dot-add combine cannot fold into the product's accumulator."""
    if INTERPRETED:
        return acc + d
    else:
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [acc, d], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def to_dtype(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 -> ``dtype``, round to nearest even.

    Compiled, the cast is ``cvt.rn``. The interpreter's own float32 -> bfloat16 cast truncates,
    so there bfloat16 is rounded with integer ops, which give the GPU's bits (NaN becomes a
    quiet NaN; NaN payloads are not part of the contract).
    """
    if INTERPRETED and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(x != x, 0x7FC00000, bits)  # noqa: PLR0124
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def tree_sum(x, R: tl.constexpr, N: tl.constexpr, IN_LOOP: tl.constexpr = False):
    """Sum of x [R, N] over its last axis (N a power of two, at most 1024) in the fixed halving
    order of `kernels_pallas.twin_math.tree_sum`: x[:, :n/2] + x[:, n/2:], halved again; returns [R].

    Two forms of each level, the same additions (so the same bits), for two places:
    - IN_LOOP=False, a tree that runs once, after a loop (the linear and norm kernels): each level
      splits the pair (`tl.split(tl.permute(...))`), which Triton 3.6 keeps in registers;
    - IN_LOOP=True, a tree inside a loop (the attention kernel): each level sums an axis of length 2
      (`tl.sum` over [R, 2, n/2]: one commutative addition per element). The split form inside a
      loop made Triton 3.6 duplicate every level's code (the attention took 240 s to compile and
      spilled 23 KB a thread); this form goes through shared memory at every level, which made a
      linear 2x slower where the tree runs once.
    The levels are unrolled here (`static_range`), not a helper per level: the interpreter
    re-patches the language on every nested jit call.
    """
    tl.static_assert(N <= 1024, "tree_sum: at most 1024 lanes")
    for level in tl.static_range(10):  # level halves 1024 -> 512 ... 2 -> 1 (those N has)
        if (1024 >> level) <= N:
            if IN_LOOP:
                x = tl.sum(tl.reshape(x, [R, 2, 512 >> level]), axis=1)
            else:
                a, b = tl.split(tl.permute(tl.reshape(x, [R, 2, 512 >> level]), (0, 2, 1)))
                x = a + b
    return tl.reshape(x, [R])


@triton.jit
def _pow2(n):
    return ((n.to(tl.int32) + 127) * (1 << 23)).to(tl.float32, bitcast=True)


@triton.jit
def exp(x):
    """e**x, the formula of `kernels_pallas.twin_math.exp`."""
    n = tl.floor(x * _LOG2E + 0.5)
    n = tl.minimum(tl.maximum(n, -126.0), 127.0)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    r2 = r * r
    p = ((((_E0 * r + _E1) * r + _E2) * r + _E3) * r + _E4) * r + _E5
    y = (p * r2 + r + 1.0) * _pow2(n)
    y = tl.where(x < -87.3, 0.0, y)
    y = tl.where(x > 88.7, float("inf"), y)
    return tl.where(x != x, x, y)  # noqa: PLR0124


@triton.jit
def sincos(x):
    """(sin x, cos x), the formula of `kernels_pallas.twin_math.sincos`."""
    k = tl.floor(x * _TWO_OVER_PI + 0.5)
    r = ((x - k * _P0) - k * _P1) - k * _P2
    z = r * r
    s = ((_S0 * z + _S1) * z + _S2) * z * r + r
    c = (((_C0 * z + _C1) * z + _C2) * z * z - 0.5 * z) + 1.0
    q = k.to(tl.int32) & 3
    sin = tl.where(q == 0, s, tl.where(q == 1, c, tl.where(q == 2, -s, -c)))
    cos = tl.where(q == 0, c, tl.where(q == 1, -s, tl.where(q == 2, -c, s)))
    return sin, cos


@triton.jit
def erf(x):
    """erf(x), the formula of `kernels_pallas.twin_math.erf`."""
    x = tl.minimum(tl.maximum(x, -4.0), 4.0)
    x2 = x * x
    p = (((((_A0 * x2 + _A1) * x2 + _A2) * x2 + _A3) * x2 + _A4) * x2 + _A5) * x2 + _A6
    q = (((_B0 * x2 + _B1) * x2 + _B2) * x2 + _B3) * x2 + _B4
    return tl.math.div_rn(x * p, q)


@triton.jit
def silu(x):
    return tl.math.div_rn(x, 1.0 + exp(-x))


@triton.jit
def gelu(x):
    return (x * 0.5) * (1.0 + erf(x * _SQRT1_2))


# ------------------------------------------------------------------ the plain torch operations
# The contract's operations as plain torch (CPU or GPU tensors), for the references (`*_native`) beside
# the Triton kernels: each torch operation is one IEEE operation rounded on its own (torch never
# contracts a product into a later add), float32 throughout; a Python constant is rounded to float32
# where it meets a float32 tensor, as the kernels' constants are.
def tree_sum_native(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis (a power of two long) in the contract's halving order; keeps the axis."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"tree_sum: the axis length must be a power of two, got {n}")
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def lanes_sum_native(x: torch.Tensor, lanes: int) -> torch.Tensor:
    """The contract's sum of x [..., K] over its last axis in `lanes` lanes: each lane adds its K / lanes
    blocks in order from +0, then the lanes' tree; keeps the axis."""
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // lanes, lanes)
    acc = torch.zeros_like(blocks[..., 0, :])
    for kb in range(blocks.shape[-2]):
        acc = acc + blocks[..., kb, :]
    return tree_sum_native(acc)


def _horner_native(x, coefs):
    y = torch.full_like(x, coefs[0])
    for c in coefs[1:]:
        y = y * x + c
    return y


def exp_native(x: torch.Tensor) -> torch.Tensor:
    """e**x, the formula of `exp` (the contract's Cephes expf)."""
    n = torch.clamp(torch.floor(x * LOG2E + 0.5), -126.0, 127.0)
    r = (x - n * LN2_HI) - n * LN2_LO
    p = _horner_native(r, EXP_POLY) * (r * r) + r + 1.0
    y = p * ((n.to(torch.int32) + 127) * (1 << 23)).view(torch.float32)
    y = torch.where(x < -87.3, 0.0, y)
    y = torch.where(x > 88.7, float("inf"), y)
    return torch.where(torch.isnan(x), x, y)


def sincos_native(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x), the formula of `sincos`."""
    k = torch.floor(x * TWO_OVER_PI + 0.5)
    r = ((x - k * PIO2[0]) - k * PIO2[1]) - k * PIO2[2]
    z = r * r
    s = (_horner_native(z, SIN_POLY) * z) * r + r
    c = ((_horner_native(z, COS_POLY) * z) * z - 0.5 * z) + 1.0
    q = k.to(torch.int32) & 3
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


def erf_native(x: torch.Tensor) -> torch.Tensor:
    """erf(x), the formula of `erf`."""
    x = torch.clamp(x, -4.0, 4.0)
    x2 = x * x
    return (x * _horner_native(x2, ERF_ALPHA)) / _horner_native(x2, ERF_BETA)


def silu_native(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + exp_native(-x))


def gelu_native(x: torch.Tensor) -> torch.Tensor:
    return (x * 0.5) * (1.0 + erf_native(x * SQRT1_2))
