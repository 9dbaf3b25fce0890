"""MRoPE (multimodal rotary position embedding) as a Pallas kernel, with a plain jax.numpy reference.

Same operation, signature and bits as ``kernels_triton.rotary_mrope`` (see that module for the section
rules).  Frequency ``i`` of the rotary half takes its cos/sin from stream ``sel(i)``: chunked
(Qwen2-VL/2.5-VL) ``0`` for ``i < t``, ``1`` for ``t <= i < t + h``, ``2`` after; interleaved
(Qwen3-VL) ``1`` where ``i % 3 == 1 and i < 3h``, ``2`` where ``i % 3 == 2 and i < 3w``, else ``0``.
A one-stream table / 1-D ``positions`` is plain RoPE.

Numerics: upcast to float32, four products each rounded to float32 (no fused multiply-add), one
rounding for each of ``x1*cos - x2*sin`` and ``x2*cos + x1*sin``, round to nearest even into the
input dtype.  XLA contracts ``a*b - c*d`` into an FMA on CPU and LLVM may do the same inside the
Triton backend on GPU, so the products are made opaque to contraction:

* compiled for the GPU: each product is one ``mul.rn.f32`` (inline PTX; ``.rn`` also stops ptxas
  from fusing it);
* interpreted (CPU, CI) and in :func:`mrope_native`: ``where(isnan(p), nan, p)`` sits between the
  product and the add; XLA cannot see through the select.  NaN payloads are not preserved.

The kernel takes ``q``/``k`` flattened to 1-D and aliases them to its outputs
(``input_output_aliases``), so under ``jax.jit(..., donate_argnums=...)`` it rotates in place
and the partial-rotary tail is never touched.  The grid and tiles are the Triton kernel's: one
program per block of ``block_tokens`` tokens loads the block's cos/sin rows once and rotates
every q head, then every k head, in ``[block_tokens, block_heads, rotary_dim // 2]`` tile pairs,
with gathers/scatters (``pallas.triton.load/store`` with index arrays and masks), which lets any
head count (28/4, 5/3, ...) use power-of-two tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import backend
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
    stream_index,
)
from kernels_pallas.contract.numerics import INT32_MAX, next_pow2

__all__ = ["default_blocks", "mrope", "mrope_from_cache", "mrope_from_cache_native", "mrope_native"]

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


def _stream_of_frequency(i, num_streams, sections, interleaved):
    """Position stream (0 = t, 1 = h, 2 = w) that frequency ``i`` reads."""
    t, h, w = sections
    if num_streams == 1:
        return jnp.zeros_like(i)
    if interleaved:
        return jnp.where((i % 3 == 1) & (i < 3 * h), 1, jnp.where((i % 3 == 2) & (i < 3 * w), 2, 0))
    return (i >= t).astype(jnp.int32) + (i >= t + h).astype(jnp.int32)


def _rounded_product(a, b, compiled_gpu):
    """``a * b`` rounded to float32, never contracted into an FMA with a following add."""
    if compiled_gpu:
        a, b = jnp.broadcast_arrays(a, b)
        [p] = pltriton.elementwise_inline_asm(
            "mul.rn.f32 $0, $1, $2;",
            args=[a, b],
            constraints="=f,f,f",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
        )
        return p
    p = a * b
    return jnp.where(jnp.isnan(p), jnp.float32(jnp.nan), p)


def _rotate(x1, x2, cos, sin, compiled_gpu):
    mul = functools.partial(_rounded_product, compiled_gpu=compiled_gpu)
    return mul(x1, cos) - mul(x2, sin), mul(x2, cos) + mul(x1, sin)


def _masked_offsets(offs, mask, size, compiled_gpu):
    """Offsets for a masked gather/scatter.

    Interpreted, masked lanes are sent one past the end, so the interpreter's scatter drops them
    instead of racing with a live lane that aliases the same element (head or frequency padding).
    Compiled, masked lanes are never dereferenced, and a select here would hide the offsets'
    contiguity from Triton and turn 16-byte vector accesses into 2-byte ones.
    """
    return offs if compiled_gpu else jnp.where(mask, offs, size)


def _rotate_tile(x_in, x_out, tok, t_mask, head0, cos, sin, *, num_heads, head_size, half, half_p2,
                 is_neox, block_h, compiled_gpu):
    """Rotate heads ``head0 .. head0 + block_h`` of the token block (flat refs, in place)."""
    h = head0 + jnp.arange(block_h, dtype=jnp.int32)
    i = jnp.arange(half_p2, dtype=jnp.int32)
    first, second = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
    base = (tok[:, None, None] * num_heads + h[None, :, None]) * head_size
    mask = t_mask[:, None, None] & (h < num_heads)[None, :, None] & (i < half)[None, None, :]
    off1 = _masked_offsets(base + first[None, None, :], mask, x_in.shape[0], compiled_gpu)
    off2 = _masked_offsets(base + second[None, None, :], mask, x_in.shape[0], compiled_gpu)
    x1 = pltriton.load(x_in.at[off1], mask=mask, other=0).astype(jnp.float32)
    x2 = pltriton.load(x_in.at[off2], mask=mask, other=0).astype(jnp.float32)
    o1, o2 = _rotate(x1, x2, cos, sin, compiled_gpu)
    pltriton.store(x_out.at[off1], o1.astype(x_out.dtype), mask=mask)
    pltriton.store(x_out.at[off2], o2.astype(x_out.dtype), mask=mask)


def _mrope_kernel(q_in, k_in, cos_ref, sin_ref, q_out, k_out, *, num_tokens, num_q_heads,
                  num_kv_heads, head_size, half, num_streams, sections, interleaved, is_neox,
                  from_cache, max_position, block_t, block_h, compiled_gpu):
    # When from_cache: cos_ref holds positions [num_streams * num_tokens], sin_ref the cache.
    half_p2 = next_pow2(half)
    tok = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    t_mask = tok < num_tokens
    i = jnp.arange(half_p2, dtype=jnp.int32)
    sel = _stream_of_frequency(i, num_streams, sections, interleaved)
    cs_mask = t_mask[:, None] & (i < half)[None, :]
    if from_cache:
        pos_ref, cache_ref = cos_ref, sin_ref
        n_pos = pos_ref.shape[0]

        def stream(s):
            idx = _masked_offsets(s * num_tokens + tok, t_mask, n_pos, compiled_gpu)
            return pltriton.load(pos_ref.at[idx], mask=t_mask, other=0)[:, None]

        pos = jnp.broadcast_to(stream(0), (block_t, half_p2))
        if num_streams == 3:
            pos = jnp.where(sel[None, :] == 1, stream(1), pos)
            pos = jnp.where(sel[None, :] == 2, stream(2), pos)
        # Out-of-range positions are never read: they give NaN rows (the wrappers raise first
        # whenever positions are concrete).
        cs_mask = cs_mask & (pos >= 0) & (pos < max_position)  # in the positions' own dtype
        row = pos.astype(jnp.int32) * (2 * half) + i[None, :]
        n_cache = cache_ref.shape[0]
        cos = pltriton.load(cache_ref.at[_masked_offsets(row, cs_mask, n_cache, compiled_gpu)],
                            mask=cs_mask, other=jnp.nan)
        sin = pltriton.load(cache_ref.at[_masked_offsets(row + half, cs_mask, n_cache, compiled_gpu)],
                            mask=cs_mask, other=jnp.nan)
    else:
        offs = (sel[None, :] * num_tokens + tok[:, None]) * half + i[None, :]
        offs = _masked_offsets(offs, cs_mask, cos_ref.shape[0], compiled_gpu)
        cos = pltriton.load(cos_ref.at[offs], mask=cs_mask, other=0)
        sin = pltriton.load(sin_ref.at[offs], mask=cs_mask, other=0)
    # The token block's cos/sin rows are loaded once and serve every head of q and k.
    cos = cos.astype(jnp.float32)[:, None, :]
    sin = sin.astype(jnp.float32)[:, None, :]

    tile = functools.partial(_rotate_tile, tok=tok, t_mask=t_mask, cos=cos, sin=sin,
                             head_size=head_size, half=half, half_p2=half_p2, is_neox=is_neox,
                             compiled_gpu=compiled_gpu)
    for head0 in range(0, num_q_heads, block_h):
        tile(q_in, q_out, head0=head0, num_heads=num_q_heads, block_h=block_h)
    block_hk = min(block_h, next_pow2(num_kv_heads))
    for head0 in range(0, num_kv_heads, block_hk):
        tile(k_in, k_out, head0=head0, num_heads=num_kv_heads, block_h=block_hk)


def _require_array(name, x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be a jax array, got {type(x).__name__}")


def _check_qk(q, k, head_size, rotary_dim):
    _require_array("q", q)
    _require_array("k", k)
    dims = check_geometry(tuple(q.shape), tuple(k.shape), head_size, rotary_dim)
    # Check the caller's dtypes before jnp.asarray, which would turn float64 into float32.
    check_dtype("q", jnp.dtype(q.dtype), SUPPORTED_DTYPES)
    if jnp.dtype(k.dtype) != jnp.dtype(q.dtype):
        raise ValueError(f"k dtype must equal q dtype {q.dtype}, got {k.dtype}")
    q, k = jnp.asarray(q), jnp.asarray(k)
    for name, x in (("q", q), ("k", k)):
        if x.size > INT32_MAX:
            raise ValueError(f"{name} must have fewer than 2**31 elements (int32 offsets), got {x.size}")
    return q, k, dims


def _use_interpret(interpret):
    if interpret is None:
        return jax.default_backend() != "gpu"
    return bool(interpret)


class _Plan(NamedTuple):
    """Static arguments of one launch (hashable: the non-differentiable part of the custom VJP)."""

    from_cache: bool
    num_streams: int
    sections: tuple[int, int, int]
    max_position: int
    head_size: int
    rotary_dim: int
    mrope_interleaved: bool
    is_neox_style: bool
    interpret: bool | None
    block_tokens: int | None
    block_heads: int | None
    num_warps: int | None


def _call(q, k, a, b, plan: _Plan):
    """One kernel launch on flat views; (a, b) are (cos, sin) tables or (positions, cache). With
    PERSONAPLEX_PALLAS_BACKEND=mosaic_gpu (`kernels_pallas.backend`), which has no MRoPE kernel of its
    own yet: XLA's fusion of the reference, which gave the kernels' bits on an H200 (RESULTS.md,
    `mrope_gpu`); positions outside the cache make their rotated elements NaN, as the kernel does."""
    if backend.on_mosaic():
        half = plan.rotary_dim // 2
        if plan.from_cache:
            inside = (a >= 0) & (a < plan.max_position)
            rows = jnp.where(inside[..., None], b[jnp.clip(a, 0, plan.max_position - 1)], jnp.nan)
            a, b = rows[..., :half], rows[..., half:]
        cos, sin = (_assemble(t, plan.sections, plan.rotary_dim, plan.mrope_interleaved).astype(jnp.float32)
                    for t in (a, b))
        return tuple(_rotate_native(x, cos, sin, plan.head_size, plan.rotary_dim, plan.is_neox_style) for x in (q, k))
    num_tokens, head_size, rotary_dim = q.shape[0], plan.head_size, plan.rotary_dim
    hq, hk = q.shape[1] // head_size, k.shape[1] // head_size
    bt, bh = default_blocks(num_tokens, hq, hk, rotary_dim)
    bt = bt if plan.block_tokens is None else plan.block_tokens
    bh = bh if plan.block_heads is None else plan.block_heads
    num_blocks = -(-num_tokens // bt)
    num_warps = pick_num_warps(plan.num_warps, bt, bh, rotary_dim)
    interpret = _use_interpret(plan.interpret)
    kernel = functools.partial(
        _mrope_kernel, num_tokens=num_tokens, num_q_heads=hq, num_kv_heads=hk, head_size=head_size,
        half=rotary_dim // 2, num_streams=plan.num_streams, sections=plan.sections,
        interleaved=plan.mrope_interleaved, is_neox=plan.is_neox_style, from_cache=plan.from_cache,
        max_position=plan.max_position, block_t=bt, block_h=bh, compiled_gpu=not interpret)
    q_flat, k_flat = q.reshape(-1), k.reshape(-1)
    q_out, k_out = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(q_flat.shape, q.dtype), jax.ShapeDtypeStruct(k_flat.shape, k.dtype)),
        grid=(num_blocks,),
        input_output_aliases={0: 0, 1: 1},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="mrope_from_cache" if plan.from_cache else "mrope",
    )(q_flat, k_flat, a.reshape(-1), b.reshape(-1))
    return q_out.reshape(q.shape), k_out.reshape(k.shape)


# --------------------------------------------------------------------------------------------
# Differentiation: the transpose of a rotation by theta is the rotation by -theta
# --------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _rotate_qk(q, k, a, b, plan):
    """:func:`_call` with a VJP (a Pallas call with aliased outputs has no JVP of its own)."""
    return _call(q, k, a, b, plan)


def _rotate_qk_fwd(q, k, a, b, plan):
    return _call(q, k, a, b, plan), (q, k, a, b)


def _angle_cotangents(q, k, dq_out, dk_out, plan):
    """d loss / d cos and d sin per token and frequency, float32 ``[num_tokens, rotary_dim // 2]``.

    From ``o1 = x1*cos - x2*sin``, ``o2 = x2*cos + x1*sin``, summed over every q and k head.
    """
    half = plan.rotary_dim // 2

    def pairs(x):
        x = x.reshape(x.shape[0], -1, plan.head_size)[..., : plan.rotary_dim].astype(jnp.float32)
        return (x[..., :half], x[..., half:]) if plan.is_neox_style else (x[..., 0::2], x[..., 1::2])

    d_cos = d_sin = jnp.zeros((q.shape[0], half), jnp.float32)
    for x, g in ((q, dq_out), (k, dk_out)):
        (x1, x2), (g1, g2) = pairs(x), pairs(g)
        d_cos = d_cos + (g1 * x1 + g2 * x2).sum(1)
        d_sin = d_sin + (g2 * x1 - g1 * x2).sum(1)
    return d_cos, d_sin


def _rotate_qk_bwd(plan, residuals, cotangents):
    q, k, a, b = residuals
    dq_out, dk_out = cotangents
    half = plan.rotary_dim // 2
    if plan.from_cache:  # rotate back with the gathered rows, through the table form
        rows = b[a]
        cos, sin, table_plan = rows[..., :half], rows[..., half:], plan._replace(from_cache=False)
    else:
        cos, sin, table_plan = a, b, plan
    dq, dk = _call(dq_out, dk_out, cos, -sin, table_plan)
    d_cos, d_sin = _angle_cotangents(q, k, dq_out, dk_out, plan)
    sel = jnp.asarray(stream_index(plan.rotary_dim, plan.sections, plan.mrope_interleaved))
    if not plan.from_cache:
        if plan.num_streams == 3:  # each frequency's cotangent goes to the stream it read
            d_cos, d_sin = (jnp.stack([jnp.where(sel == s, d, 0) for s in range(3)]) for d in (d_cos, d_sin))
        return dq, dk, d_cos.astype(a.dtype), d_sin.astype(b.dtype)
    d_rows = jnp.concatenate([d_cos, d_sin], -1)  # [num_tokens, rotary_dim]
    d_cache = jnp.zeros(b.shape, jnp.float32)
    P = b.shape[0]

    def read(i):  # a position outside the cache read no row (check_positions=False): it credits none
        return jnp.where((i >= 0) & (i < P), i, P)  # P: dropped (a negative index would wrap)

    if plan.num_streams == 1:
        return dq, dk, None, d_cache.at[read(a)].add(d_rows, mode="drop")
    sel = jnp.concatenate([sel, sel])  # the cos half and the sin half of a row
    for s in range(3):
        d_cache = d_cache.at[read(a[s])].add(jnp.where(sel == s, d_rows, 0), mode="drop")
    return dq, dk, None, d_cache


_rotate_qk.defvjp(_rotate_qk_fwd, _rotate_qk_bwd)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def mrope(
    q: jax.Array,
    k: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
    *,
    interpret: bool | None = None,
    block_tokens: int | None = None,
    block_heads: int | None = None,
    num_warps: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """MRoPE-rotated ``(q, k)``; in place when the caller donates ``q`` and ``k``.

    Differentiable in ``q``, ``k``, ``cos`` and ``sin``: the VJP of ``q``/``k`` is this kernel
    with ``-sin``.

    Args:
      q: ``[num_tokens, num_q_heads * head_size]``, float32/bfloat16/float16.
      k: ``[num_tokens, num_kv_heads * head_size]``, same dtype.
      cos, sin: ``[3, num_tokens, rotary_dim // 2]`` (t/h/w streams) or ``[num_tokens,
        rotary_dim // 2]`` (text only, plain RoPE); float32/bfloat16/float16 (upcast to float32).
      mrope_section: ``[t, h, w]`` with ``t + h + w == rotary_dim // 2``; may be None for a
        one-stream table.
      head_size: elements per head; ``rotary_dim <= head_size``, the tail passes through.
      rotary_dim: rotated elements per head (even).
      mrope_interleaved: Qwen3-VL interleaved sections instead of chunked ones.
      is_neox_style: NeoX halves (``j`` with ``j + rotary_dim / 2``) or GPT-J pairs (``2j, 2j+1``).
      interpret: run the kernel in the Pallas interpreter; None picks it on non-GPU backends.
      block_tokens, block_heads: tile sizes (powers of two); None picks :func:`default_blocks`.
      num_warps: warps per program on the GPU; None gives one warp per 512 elements of the q
        half-tile.

    Returns:
      ``(q, k)`` with the shapes and dtype of the inputs.
    """
    q, k, (num_tokens, _, _) = _check_qk(q, k, head_size, rotary_dim)
    check_launch_args("mrope", block_tokens, block_heads, num_warps)
    check_flags(mrope_interleaved, is_neox_style)
    for name, t in (("cos", cos), ("sin", sin)):
        _require_array(name, t)
        check_dtype(name, jnp.dtype(t.dtype), SUPPORTED_DTYPES)
    num_streams, sections = check_tables(cos, sin, num_tokens, rotary_dim, mrope_section)
    cos, sin = jnp.asarray(cos), jnp.asarray(sin)
    if num_tokens == 0:
        return q, k
    plan = _Plan(False, num_streams, sections, 0, head_size, rotary_dim, mrope_interleaved,
                 is_neox_style, interpret, block_tokens, block_heads, num_warps)
    return _rotate_qk(q, k, cos, sin, plan)


def _check_positions_range(positions, max_position):
    """Raises ValueError for positions outside the cache when they are concrete.

    Under ``jax.jit`` positions are tracers and cannot be inspected here; the kernel then masks
    the out-of-range rows (never reading outside the cache) and their tokens come out NaN.
    """
    try:
        host = np.asarray(positions)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if host.size:
        check_position_range(host.min(), host.max(), max_position)


def mrope_from_cache(
    positions: jax.Array,
    q: jax.Array,
    k: jax.Array,
    cos_sin_cache: jax.Array,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
    *,
    interpret: bool | None = None,
    block_tokens: int | None = None,
    block_heads: int | None = None,
    num_warps: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Fused gather + :func:`mrope`: rotates with rows ``cos_sin_cache[positions]``.

    Differentiable in ``q``, ``k`` and ``cos_sin_cache``.

    Args:
      positions: ``[3, num_tokens]`` (t/h/w) or ``[num_tokens]`` (text only), int32 (int64 with
        x64). Positions outside ``[0, max_position)`` raise ValueError when they are concrete
        (eager call); under ``jax.jit`` they cannot be checked on the host, so the kernel masks
        them: no out-of-bounds read, and the affected tokens' rotated elements are NaN.
      cos_sin_cache: ``[max_position, rotary_dim]`` float32, cos half then sin half per row.
      Others as in :func:`mrope`. The ``[3, num_tokens, rotary_dim // 2]`` tables are never
      materialised: each program gathers its rows from the cache.
    """
    q, k, (num_tokens, _, _) = _check_qk(q, k, head_size, rotary_dim)
    check_launch_args("mrope_from_cache", block_tokens, block_heads, num_warps)
    check_flags(mrope_interleaved, is_neox_style)
    _require_array("positions", positions)
    _require_array("cos_sin_cache", cos_sin_cache)
    check_positions_dtype(jnp.dtype(positions.dtype).name)
    check_cache_shapes(tuple(positions.shape), tuple(cos_sin_cache.shape), num_tokens, rotary_dim)
    check_dtype("cos_sin_cache", jnp.dtype(cos_sin_cache.dtype), (jnp.dtype(jnp.float32),))
    if cos_sin_cache.size > INT32_MAX:
        raise ValueError(f"cos_sin_cache must have fewer than 2**31 elements, got {cos_sin_cache.size}")
    num_streams = 3 if len(positions.shape) == 2 else 1
    sections = check_sections(mrope_section, rotary_dim, num_streams)
    # The caller's values: jnp.asarray turns int64 into int32 without x64, which would wrap 2**32 + p to p.
    _check_positions_range(positions, cos_sin_cache.shape[0])
    positions, cache = jnp.asarray(positions), jnp.asarray(cos_sin_cache)
    if num_tokens == 0:
        return q, k
    plan = _Plan(True, num_streams, sections, cache.shape[0], head_size, rotary_dim,
                 mrope_interleaved, is_neox_style, interpret, block_tokens, block_heads, num_warps)
    return _rotate_qk(q, k, positions, cache, plan)


# --------------------------------------------------------------------------------------------
# Plain jax.numpy reference (vLLM's forward_native beside the fast path)
# --------------------------------------------------------------------------------------------


def _assemble(table, sections, rotary_dim, mrope_interleaved):
    if table.ndim == 2:
        return table
    sel = jnp.asarray(stream_index(rotary_dim, sections, mrope_interleaved))
    return table[sel[None, :], jnp.arange(table.shape[1])[:, None], jnp.arange(rotary_dim // 2)[None, :]]


def _rotate_native(x, cos, sin, head_size, rotary_dim, is_neox_style):
    n = x.shape[0]
    xh = x.reshape(n, x.shape[1] // head_size, head_size)
    rot = xh[..., :rotary_dim].astype(jnp.float32)
    if is_neox_style:
        x1, x2 = rot[..., : rotary_dim // 2], rot[..., rotary_dim // 2:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1, o2 = _rotate(x1, x2, cos[:, None, :], sin[:, None, :], compiled_gpu=False)
    o = jnp.concatenate((o1, o2), -1) if is_neox_style else jnp.stack((o1, o2), -1).reshape(rot.shape)
    return jnp.concatenate((o.astype(x.dtype), xh[..., rotary_dim:]), -1).reshape(x.shape)


def mrope_native(
    q: jax.Array,
    k: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Plain jax.numpy reference of :func:`mrope` (same arguments and result)."""
    num_tokens, _, _ = check_geometry(tuple(q.shape), tuple(k.shape), head_size, rotary_dim)
    check_flags(mrope_interleaved, is_neox_style)
    _, sections = check_tables(cos, sin, num_tokens, rotary_dim, mrope_section)
    c = _assemble(cos, sections, rotary_dim, mrope_interleaved).astype(jnp.float32)
    s = _assemble(sin, sections, rotary_dim, mrope_interleaved).astype(jnp.float32)
    return (_rotate_native(q, c, s, head_size, rotary_dim, is_neox_style),
            _rotate_native(k, c, s, head_size, rotary_dim, is_neox_style))


def mrope_from_cache_native(
    positions: jax.Array,
    q: jax.Array,
    k: jax.Array,
    cos_sin_cache: jax.Array,
    mrope_section: Sequence[int] | None,
    head_size: int,
    rotary_dim: int,
    mrope_interleaved: bool = False,
    is_neox_style: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Plain reference of :func:`mrope_from_cache`: ``cos_sin_cache[positions]``, split, rotate."""
    rows = cos_sin_cache[positions]
    cos, sin = rows[..., : rotary_dim // 2], rows[..., rotary_dim // 2:]
    return mrope_native(q, k, cos, sin, mrope_section, head_size, rotary_dim,
                        mrope_interleaved, is_neox_style)
