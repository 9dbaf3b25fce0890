"""MRoPE (multimodal rotary position embedding) as a Triton kernel, with a plain torch reference.

Qwen2-VL / Qwen2.5-VL / Qwen3-VL rotate every query and key head with a cos/sin row assembled
from three position streams (temporal, height, width).  Frequency ``i`` of the rotary half takes
its cos/sin from stream ``sel(i)``:

* chunked (``mrope_interleaved=False``, Qwen2-VL/2.5-VL): ``0`` for ``i < t``, ``1`` for
  ``t <= i < t + h``, ``2`` after;
* interleaved (``mrope_interleaved=True``, Qwen3-VL): ``1`` where ``i % 3 == 1 and i < 3 * h``,
  ``2`` where ``i % 3 == 2 and i < 3 * w``, else ``0``.

A one-stream table (``cos``/``sin`` of shape ``[num_tokens, rotary_dim // 2]``, or 1-D
``positions``) is plain RoPE.

Numerics (shared with ``kernels_pallas.rotary_mrope``, which returns the same bits): inputs and cos/sin
are upcast to float32, each of the four products is rounded to float32 on its own (no fused
multiply-add), then ``x1' = x1*cos - x2*sin`` and ``x2' = x2*cos + x1*sin`` are rounded once and
cast back to the input dtype (round to nearest even).  That is what eager torch computes, so the
kernel is bit-identical to :func:`mrope_native`.  The kernel is compiled with
``enable_fp_fusion=False`` so that the GPU compiler cannot contract a product into an FMA.

Layout is the serving-engine one: ``q [num_tokens, num_q_heads * head_size]`` (rows may be
strided, e.g. a slice of a fused qkv projection; the last dimension must be contiguous) and
``k [num_tokens, num_kv_heads * head_size]``.  The in-place forms refuse rows that overlap (e.g.
``expand``) and q/k sharing memory: programs are unordered, so such layouts would come out wrong.  The grid is one program per block of
``block_tokens`` tokens: it loads the block's cos/sin rows once, then rotates every q head and
every k head in ``[block_tokens, block_heads, rotary_dim // 2]`` tile pairs (k's tile holds at
most its own head count).  At Qwen2.5-VL shapes that is one token per program and one tile of 32
(28 live) q heads: whole rows stream at copy bandwidth.  q/k offsets are 32-bit when they fit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels_pallas.contract.mrope import (
    check_cache_shapes,
    check_dtype,
    check_flags,
    check_geometry,
    check_launch_args,
    check_position_range,
    check_positions_dtype,
    check_sections,
    check_tables,
    default_blocks,
    pick_num_warps,
)
from kernels_pallas.contract.numerics import INT32_MAX, next_pow2
from kernels_triton import twin_grad
from kernels_triton import twin_math as tm
from kernels_triton.twin_math import check_device, interpreting

__all__ = [
    "mrope",
    "mrope_",
    "mrope_from_cache",
    "mrope_from_cache_",
    "mrope_from_cache_native",
    "mrope_native",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OFFSETS_32_LIMIT = INT32_MAX + 1  # q/k element offsets below this are computed in 32 bits


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _stream_of_frequency(
    i,
    NUM_STREAMS: tl.constexpr,
    SECTION_T: tl.constexpr,
    SECTION_H: tl.constexpr,
    SECTION_W: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Position stream (0 = t, 1 = h, 2 = w) that frequency ``i`` reads."""
    if NUM_STREAMS == 1:
        sel = tl.zeros_like(i)
    elif INTERLEAVED:
        sel = tl.where(
            (i % 3 == 1) & (i < 3 * SECTION_H),
            1,
            tl.where((i % 3 == 2) & (i < 3 * SECTION_W), 2, 0),
        )
    else:
        sel = (i >= SECTION_T).to(tl.int32) + (i >= SECTION_T + SECTION_H).to(tl.int32)
    return sel


@triton.jit
def _rotate_tile(
    x_ptr,
    stride_x,
    tok,
    t_mask,
    head0,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROT_HALF_P2: tl.constexpr,
    IS_NEOX: tl.constexpr,
    BLOCK_H: tl.constexpr,
    OFFSETS_64: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Rotate heads ``head0 .. head0 + BLOCK_H`` of the token block in place."""
    h = head0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, ROT_HALF_P2)
    if IS_NEOX:  # element i pairs with i + rotary_dim / 2
        first = i
        second = i + ROT_HALF
    else:  # GPT-J: element 2i pairs with 2i + 1
        first = 2 * i
        second = 2 * i + 1
    row = tok.to(tl.int64) * stride_x if OFFSETS_64 else tok * stride_x
    base = row[:, None, None] + (h * HEAD_SIZE)[None, :, None]
    mask = t_mask[:, None, None] & (h < NUM_HEADS)[None, :, None] & (i < ROT_HALF)[None, None, :]
    ptr1 = x_ptr + base + first[None, None, :]
    ptr2 = x_ptr + base + second[None, None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    # Four separately rounded products (fp fusion is off), then one rounding per output.
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    tl.store(ptr1, tm.to_dtype(o1, x_ptr.dtype.element_ty, INTERPRETED), mask=mask)
    tl.store(ptr2, tm.to_dtype(o2, x_ptr.dtype.element_ty, INTERPRETED), mask=mask)


@triton.jit
def _mrope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,  # [NUM_STREAMS, num_tokens, ROT_HALF] table, or the cache when FROM_CACHE
    sin_ptr,
    pos_ptr,  # [NUM_STREAMS, num_tokens] positions when FROM_CACHE
    num_tokens,
    stride_q,
    stride_k,
    max_position,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROT_HALF_P2: tl.constexpr,
    NUM_STREAMS: tl.constexpr,
    SECTION_T: tl.constexpr,
    SECTION_H: tl.constexpr,
    SECTION_W: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    IS_NEOX: tl.constexpr,
    FROM_CACHE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    OFFSETS_64: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tok < num_tokens
    i = tl.arange(0, ROT_HALF_P2)
    sel = _stream_of_frequency(i, NUM_STREAMS, SECTION_T, SECTION_H, SECTION_W, INTERLEAVED)
    cs_mask = t_mask[:, None] & (i < ROT_HALF)[None, :]
    if FROM_CACHE:
        # Gather cache rows: cos half then sin half of row positions[sel(i), token].
        pos_t = tl.load(pos_ptr + tok, mask=t_mask, other=0)
        pos = tl.broadcast_to(pos_t[:, None], (BLOCK_T, ROT_HALF_P2))
        if NUM_STREAMS == 3:
            pos_h = tl.load(pos_ptr + num_tokens + tok, mask=t_mask, other=0)
            pos_w = tl.load(pos_ptr + 2 * num_tokens + tok, mask=t_mask, other=0)
            pos = tl.where(sel[None, :] == 1, pos_h[:, None], pos)
            pos = tl.where(sel[None, :] == 2, pos_w[:, None], pos)
        # Out-of-range positions are never read: they give NaN rows (the wrappers raise first).
        cs_mask = cs_mask & (pos >= 0) & (pos < max_position)
        row = pos.to(tl.int64) * (2 * ROT_HALF)
        cos = tl.load(cos_ptr + row + i[None, :], mask=cs_mask, other=float("nan"))
        sin = tl.load(sin_ptr + row + ROT_HALF + i[None, :], mask=cs_mask, other=float("nan"))
    else:
        offs = (sel[None, :] * num_tokens + tok[:, None]).to(tl.int64) * ROT_HALF + i[None, :]
        cos = tl.load(cos_ptr + offs, mask=cs_mask, other=0.0)
        sin = tl.load(sin_ptr + offs, mask=cs_mask, other=0.0)
    # The token block's cos/sin rows are loaded once and serve every head of q and k.
    cos = cos.to(tl.float32)[:, None, :]
    sin = sin.to(tl.float32)[:, None, :]
    for head0 in tl.static_range(0, NUM_Q_HEADS, BLOCK_H):
        _rotate_tile(q_ptr, stride_q, tok, t_mask, head0, cos, sin, NUM_Q_HEADS, HEAD_SIZE, ROT_HALF,
                     ROT_HALF_P2, IS_NEOX, BLOCK_H, OFFSETS_64, INTERPRETED)
    for head0 in tl.static_range(0, NUM_KV_HEADS, BLOCK_HK):
        _rotate_tile(k_ptr, stride_k, tok, t_mask, head0, cos, sin, NUM_KV_HEADS, HEAD_SIZE, ROT_HALF,
                     ROT_HALF_P2, IS_NEOX, BLOCK_HK, OFFSETS_64, INTERPRETED)


def _launch(q, k, cos, sin, pos, num_streams, sections, max_position, head_size, rotary_dim,
            mrope_interleaved, is_neox_style, from_cache, block_tokens, block_heads, num_warps):
    num_tokens = q.shape[0]
    hq, hk = q.shape[1] // head_size, k.shape[1] // head_size
    bt, bh = default_blocks(num_tokens, hq, hk, rotary_dim)
    bt = bt if block_tokens is None else block_tokens
    bh = bh if block_heads is None else block_heads
    num_blocks = triton.cdiv(num_tokens, bt)
    num_warps = pick_num_warps(num_warps, bt, bh, rotary_dim)
    # 32-bit q/k offsets when every element's fits (masked lanes are never dereferenced).
    last = max((num_tokens - 1) * x.stride(0) + x.shape[1] for x in (q, k))
    _mrope_kernel[(num_blocks,)](
        q, k, cos, sin, pos, num_tokens, q.stride(0), k.stride(0), max_position,
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hk, HEAD_SIZE=head_size, ROT_HALF=rotary_dim // 2,
        ROT_HALF_P2=next_pow2(rotary_dim // 2), NUM_STREAMS=num_streams,
        SECTION_T=sections[0], SECTION_H=sections[1], SECTION_W=sections[2],
        INTERLEAVED=mrope_interleaved, IS_NEOX=is_neox_style, FROM_CACHE=from_cache,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_HK=min(bh, next_pow2(hk)), OFFSETS_64=last >= OFFSETS_32_LIMIT,
        INTERPRETED=interpreting(_mrope_kernel), num_warps=num_warps,
        enable_fp_fusion=False,
    )


def _check_qk(q, k, head_size, rotary_dim, fn):
    """Checks ``q``/``k`` for the in-place form ``fn`` (its name goes into the messages).

    Everything here is host arithmetic on shapes, strides and addresses (no device sync), and it
    all runs before anything is launched or copied, so a refused call changes nothing.
    """
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004
    num_tokens, hq, hk = check_geometry(tuple(q.shape), tuple(k.shape), head_size, rotary_dim)
    check_dtype("q", q.dtype, SUPPORTED_DTYPES)
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype must equal q dtype {q.dtype}, got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k must be on q's device {q.device}, got {k.device}")
    check_device(q.device, f"kernels_triton.{fn}: q")
    for name, t in (("q", q), ("k", k)):
        if t.numel() and t.stride(1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    _check_no_overlap(q, k, fn)
    return num_tokens, hq, hk


def _check_no_overlap(q, k, fn):
    """Refuses q/k layouts in which two logical elements share memory.

    Every program loads a tile, rotates it and stores it with no ordering between programs (nor
    between a program's q and k tiles), so an element reachable through two indices is rotated
    twice, or with another token's angles, or loses a store: wrong values, silently.  That happens
    when a tensor's rows overlap (token stride below the row length; stride 0 from ``expand``) or
    when q and k share memory.  Disjoint column slices of one fused qkv buffer share a storage but
    no element, and pass.  Needs ``stride(1) == 1`` (checked first).
    """
    n = q.shape[0]
    for name, t in (("q", q), ("k", k)):
        if n > 1 and t.shape[1] and t.stride(0) < t.shape[1]:
            how = ", stride 0 repeats one row, e.g. from expand" if t.stride(0) == 0 else ""
            raise ValueError(f"{fn}({name}): rows overlap in memory (stride {t.stride(0)} along the token "
                             f"dimension, rows of {t.shape[1]} elements{how}); pass a tensor whose rows do not "
                             f"overlap, e.g. {name}.contiguous()")
    if not (q.numel() and k.numel()):
        return
    # Byte addresses, so that views of two storages over the same memory are caught too.
    size = q.element_size()
    a, b = q.data_ptr(), k.data_ptr()
    len_q, len_k = q.shape[1] * size, k.shape[1] * size
    s_q, s_k = q.stride(0) * size, k.stride(0) * size
    if a + (n - 1) * s_q + len_q <= b or b + (n - 1) * s_k + len_k <= a:
        return  # the extents are disjoint
    if n > 1 and s_q == s_k:
        # q row i is [a + i*s, a + i*s + len_q), k row j is [b + j*s, b + j*s + len_k): they meet iff
        # m = i - j (|m| < n) has d - len_q < m*s < d + len_k, with d = b - a.
        d = b - a
        m = max((d - len_q) // s_q + 1, -(n - 1))
        if m > n - 1 or m * s_q >= d + len_k:
            return
        what = "q and k share memory"
    elif n == 1:
        what = "q and k share memory"
    else:  # an exact test would walk the rows; no layout in use needs it
        what = (f"q and k have intersecting extents with different token strides ({q.stride(0)} and "
                f"{k.stride(0)}), so they may share memory")
    raise ValueError(f"{fn}(q, k): {what}; in-place rotation needs separate buffers (disjoint column "
                     "slices of one fused qkv buffer are fine), e.g. pass k.clone()")


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def mrope_(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
    *,
    block_tokens: int | None = None,
    block_heads: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates ``q`` and ``k`` in place with MRoPE; returns ``(q, k)``.

    Args:
      q: ``[num_tokens, num_q_heads * head_size]``, float32/bfloat16/float16; rows may be strided
        but must not overlap (ValueError otherwise).  On the CPU only under TRITON_INTERPRET=1.
      k: ``[num_tokens, num_kv_heads * head_size]``, same dtype and device as ``q``, sharing no
        memory with it (disjoint column slices of one fused qkv buffer are fine).
      cos, sin: ``[3, num_tokens, rotary_dim // 2]`` (t/h/w streams) or ``[num_tokens,
        rotary_dim // 2]`` (text only, plain RoPE); float32/bfloat16/float16 (upcast to float32).
      mrope_section: ``[t, h, w]`` with ``t + h + w == rotary_dim // 2``; may be None for a
        one-stream table.
      head_size: elements per head; ``rotary_dim <= head_size``, the tail passes through.
      rotary_dim: rotated elements per head (even).
      mrope_interleaved: Qwen3-VL interleaved sections instead of chunked ones.
      is_neox_style: NeoX halves (``j`` with ``j + rotary_dim / 2``) or GPT-J pairs (``2j, 2j+1``).
      block_tokens, block_heads: tile sizes (powers of two); None picks :func:`default_blocks`.
      num_warps: warps per program; None gives one warp per 512 elements of the q half-tile.
    """
    num_tokens, _, _ = _check_qk(q, k, head_size, rotary_dim, "mrope_")
    check_launch_args("mrope", block_tokens, block_heads, num_warps)
    _refuse_grad(q=q, k=k, cos=cos, sin=sin)
    check_flags(mrope_interleaved, is_neox_style)
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")  # noqa: TRY004 (the Pallas twin's)
        check_dtype(name, t.dtype, SUPPORTED_DTYPES)
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    num_streams, sections = check_tables(cos, sin, num_tokens, rotary_dim, mrope_section)
    if num_tokens == 0:
        return q, k
    cos, sin = cos.contiguous(), sin.contiguous()
    _launch(q, k, cos, sin, cos, num_streams, sections, 0, head_size, rotary_dim,
            mrope_interleaved, is_neox_style, False, block_tokens, block_heads, num_warps)
    return q, k


def mrope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
    **block_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place :func:`mrope_`: returns rotated copies ``(q, k)`` (same shapes and dtype).

    Differentiable in ``q``, ``k``, ``cos`` and ``sin`` (the backward of ``q``/``k`` is the same
    kernel with ``-sin``).
    """
    args = (mrope_section, head_size, rotary_dim, mrope_interleaved, is_neox_style)
    if _wants_grad(q, k, cos, sin):
        return _Rotate.apply(q, k, cos, sin, False, args, block_kwargs)
    q_out, k_out = _fresh(q), _fresh(k)
    return mrope_(q_out, k_out, cos, sin, *args, **block_kwargs)


def _check_cache_args(positions, cos_sin_cache, num_tokens, rotary_dim, device):
    if not isinstance(positions, torch.Tensor):
        raise ValueError(f"positions must be a torch.Tensor, got {type(positions).__name__}")  # noqa: TRY004
    if not isinstance(cos_sin_cache, torch.Tensor):
        raise ValueError(f"cos_sin_cache must be a torch.Tensor, got {type(cos_sin_cache).__name__}")  # noqa: TRY004
    check_positions_dtype(str(positions.dtype).removeprefix("torch."))
    check_cache_shapes(tuple(positions.shape), tuple(cos_sin_cache.shape), num_tokens, rotary_dim)
    check_dtype("cos_sin_cache", cos_sin_cache.dtype, (torch.float32,))
    for name, t in (("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        if t.device != device:
            raise ValueError(f"{name} must be on q's device {device}, got {t.device}")


def _check_positions_range(positions, max_position):
    if positions.numel():
        check_position_range(int(positions.min()), int(positions.max()), max_position)


def mrope_from_cache_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
    *,
    check_positions: bool = True,
    block_tokens: int | None = None,
    block_heads: int | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused gather + :func:`mrope_`: rotates ``q``/``k`` in place with rows of ``cos_sin_cache``.

    Args:
      positions: ``[3, num_tokens]`` (t/h/w) or ``[num_tokens]`` (text only), int32/int64.
      cos_sin_cache: ``[max_position, rotary_dim]`` float32, cos half then sin half per row.
      check_positions: raise ValueError when a position lies outside ``[0, max_position)``.
        This costs a reduction and a device-to-host sync; with False an out-of-range position is
        still never read, its token's rotated output is NaN instead.
      Others as in :func:`mrope_`. The ``[3, num_tokens, rotary_dim // 2]`` tables are never
      materialised: each program gathers its rows from the cache.
    """
    num_tokens, _, _ = _check_qk(q, k, head_size, rotary_dim, "mrope_from_cache_")
    check_launch_args("mrope_from_cache", block_tokens, block_heads, num_warps)
    _refuse_grad(q=q, k=k, cos_sin_cache=cos_sin_cache)
    check_flags(mrope_interleaved, is_neox_style)
    _check_cache_args(positions, cos_sin_cache, num_tokens, rotary_dim, q.device)
    num_streams = 3 if positions.ndim == 2 else 1
    sections = check_sections(mrope_section, rotary_dim, num_streams)
    if check_positions:
        _check_positions_range(positions, cos_sin_cache.shape[0])
    if num_tokens == 0:
        return q, k
    positions, cache = positions.contiguous(), cos_sin_cache.contiguous()
    _launch(q, k, cache, cache, positions, num_streams, sections, cache.shape[0], head_size,
            rotary_dim, mrope_interleaved, is_neox_style, True, block_tokens, block_heads, num_warps)
    return q, k


def mrope_from_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place :func:`mrope_from_cache_`: returns rotated copies ``(q, k)``.

    Differentiable in ``q``, ``k`` and ``cos_sin_cache``.
    """
    args = (mrope_section, head_size, rotary_dim, mrope_interleaved, is_neox_style)
    if _wants_grad(q, k, cos_sin_cache):
        return _Rotate.apply(q, k, positions, cos_sin_cache, True, args, kwargs)
    q_out, k_out = _fresh(q), _fresh(k)
    return mrope_from_cache_(positions, q_out, k_out, cos_sin_cache, *args, **kwargs)


# --------------------------------------------------------------------------------------------
# Differentiation: the transpose of a rotation by theta is the rotation by -theta
# --------------------------------------------------------------------------------------------


def _fresh(x):
    """A contiguous copy for the out-of-place forms to rotate in place (non-tensors pass through to
    the checks).  Contiguous rather than ``clone()``'s preserved layout, so that every input layout
    works: a transposed q (last dimension not contiguous) or rows overlapping through ``expand``
    would otherwise be refused by the in-place form, and q and k aliasing one buffer are
    separated."""
    return x.clone(memory_format=torch.contiguous_format) if isinstance(x, torch.Tensor) else x


def _wants_grad(*tensors):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def _refuse_grad(**tensors):
    """The in-place forms work outside autograd: refuse inputs that autograd would track."""
    if torch.is_grad_enabled():
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                raise ValueError(f"{name} requires grad, but the in-place form rotates outside autograd; "
                                 "call the out-of-place form (mrope / mrope_from_cache) to differentiate")


def _angle_cotangents(q, k, dq_out, dk_out, head_size, rotary_dim, is_neox_style):
    """d loss / d cos and d sin per token and frequency, float32 ``[num_tokens, rotary_dim // 2]``.

    From ``o1 = x1*cos - x2*sin``, ``o2 = x2*cos + x1*sin``, summed over every q and k head.
    """
    half = rotary_dim // 2

    def pairs(x):
        x = x.reshape(x.shape[0], -1, head_size)[..., :rotary_dim].float()
        return (x[..., :half], x[..., half:]) if is_neox_style else (x[..., 0::2], x[..., 1::2])

    d_cos = d_sin = 0
    for x, g in ((q, dq_out), (k, dk_out)):
        (x1, x2), (g1, g2) = pairs(x), pairs(g)
        d_cos = d_cos + (g1 * x1 + g2 * x2).sum(1)
        d_sin = d_sin + (g2 * x1 - g1 * x2).sum(1)
    return d_cos, d_sin


class _Rotate(torch.autograd.Function):
    """Out-of-place MRoPE with a backward; ``(a, b)`` are ``(cos, sin)`` or ``(positions, cache)``."""

    @staticmethod
    def forward(ctx, q, k, a, b, from_cache, args, kwargs):
        ctx.save_for_backward(q, k, a, b)
        ctx.from_cache, ctx.args = from_cache, args
        ctx.blocks = {key: v for key, v in kwargs.items() if key != "check_positions"}
        if from_cache:
            return mrope_from_cache_(a, _fresh(q), _fresh(k), b, *args, **kwargs)
        return mrope_(_fresh(q), _fresh(k), a, b, *args, **kwargs)

    @staticmethod
    @twin_grad.first_order("mrope")
    def backward(ctx, dq_out, dk_out):
        q, k, a, b = ctx.saved_tensors
        mrope_section, head_size, rotary_dim, interleaved, is_neox_style = ctx.args
        half = rotary_dim // 2
        if ctx.from_cache:  # rotate back with the gathered rows, through the table form
            pos, max_position = a.long(), b.shape[0]
            read = (pos >= 0) & (pos < max_position)  # the rest (check_positions=False) read nothing: NaN rows
            # ...whose cotangents rotate back with the Pallas twin's row (JAX's gather: a negative position
            # counts from the end, then clamped into the cache) and reach no row of it
            rows = b[torch.where(pos < 0, pos + max_position, pos).clamp(0, max_position - 1)]
            cos, sin = rows[..., :half], rows[..., half:]
        else:
            cos, sin = a, b
        dq, dk = mrope_(dq_out.clone(memory_format=torch.contiguous_format),
                        dk_out.clone(memory_format=torch.contiguous_format), cos, -sin, *ctx.args,
                        **ctx.blocks)
        if not (ctx.needs_input_grad[2] or ctx.needs_input_grad[3]):
            return dq, dk, None, None, None, None, None
        d_cos, d_sin = _angle_cotangents(q, k, dq_out, dk_out, head_size, rotary_dim, is_neox_style)
        sel = _stream_index(mrope_section, rotary_dim, interleaved, q.device) if cos.ndim == 3 else None
        if not ctx.from_cache:
            if sel is not None:  # each frequency's cotangent goes to the stream it read
                d_cos, d_sin = (torch.stack([torch.where(sel == s, d, 0) for s in range(3)]) for d in (d_cos, d_sin))
            return dq, dk, d_cos.to(a.dtype), d_sin.to(b.dtype), None, None, None
        d_rows = torch.cat([d_cos, d_sin], -1)  # [num_tokens, rotary_dim]
        d_cache = torch.zeros(b.shape, dtype=torch.float32, device=b.device)
        if sel is None:
            d_cache.index_add_(0, pos[read], d_rows[read])
        else:
            sel = torch.cat([sel, sel])  # the cos half and the sin half of a row
            for s in range(3):
                d_cache.index_add_(0, pos[s][read[s]], torch.where(sel == s, d_rows, 0)[read[s]])
        return dq, dk, None, d_cache, None, None, None


# --------------------------------------------------------------------------------------------
# Plain torch reference (vLLM's forward_native beside the fast path)
# --------------------------------------------------------------------------------------------


def _stream_index(mrope_section, rotary_dim, mrope_interleaved, device):
    """`contract.mrope.stream_index` as a tensor built on the device (no host-to-device copy, so
    the reference can be CUDA-graph captured)."""
    t, h, w = mrope_section
    i = torch.arange(rotary_dim // 2, device=device)
    if mrope_interleaved:
        return torch.where((i % 3 == 1) & (i < 3 * h), 1, torch.where((i % 3 == 2) & (i < 3 * w), 2, 0))
    return (i >= t).long() + (i >= t + h).long()


def _assemble(table, mrope_section, rotary_dim, mrope_interleaved):
    if table.ndim == 2:
        return table
    sel = _stream_index(mrope_section, rotary_dim, mrope_interleaved, table.device)
    return torch.gather(table, 0, sel.view(1, 1, -1).expand(1, table.shape[1], -1))[0]


def _rotate_native(x, cos, sin, head_size, rotary_dim, is_neox_style):
    n = x.shape[0]
    xh = x.view(n, x.shape[1] // head_size, head_size)
    rot = xh[..., :rotary_dim].float()
    if is_neox_style:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    o = torch.cat((o1, o2), -1) if is_neox_style else torch.stack((o1, o2), -1).flatten(-2)
    return torch.cat((o.to(x.dtype), xh[..., rotary_dim:]), -1).reshape(x.shape)


def mrope_native(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch reference of :func:`mrope` (same arguments, returns new ``(q, k)``)."""
    num_tokens, _, _ = check_geometry(tuple(q.shape), tuple(k.shape), head_size, rotary_dim)
    check_flags(mrope_interleaved, is_neox_style)
    _, sections = check_tables(cos, sin, num_tokens, rotary_dim, mrope_section)
    c = _assemble(cos, sections, rotary_dim, mrope_interleaved).float()
    s = _assemble(sin, sections, rotary_dim, mrope_interleaved).float()
    return (_rotate_native(q, c, s, head_size, rotary_dim, is_neox_style),
            _rotate_native(k, c, s, head_size, rotary_dim, is_neox_style))


def mrope_from_cache_native(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch reference of :func:`mrope_from_cache`: ``cos_sin_cache[positions]``, split, rotate."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return mrope_native(q, k, cos, sin, mrope_section, head_size, rotary_dim,
                        mrope_interleaved, is_neox_style)
