"""The MRoPE kernels' contract (`rotary_mrope` on both sides): argument checks and the tile plan.

Sizes: a call of zero tokens returns q and k as they are, launching nothing (vLLM's API: a batch may
hold no tokens), after the same checks as any other call (`check_launch_args` included); every other
size (heads, head_size, rotary_dim, the cache's rows) is at least 1.

Standard library only: arrays are asked for `shape`, `ndim` and `dtype`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels_pallas.contract.numerics import check_launch, next_pow2, positive_int


def check_geometry(q_shape, k_shape, head_size, rotary_dim):
    for name, v in (("head_size", head_size), ("rotary_dim", rotary_dim)):
        if not positive_int(v):
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


def check_launch_args(who, block_tokens, block_heads, num_warps):
    """The caller's tile sizes (positive powers of two) and warps (`numerics.check_launch`), each None for
    the plan's: checked as a call starts, so that a call of zero tokens, which launches nothing, refuses
    them as any other call does."""
    for name, v in (("block_tokens", block_tokens), ("block_heads", block_heads)):
        if v is not None and (not positive_int(v) or v & (v - 1)):
            raise ValueError(f"{name} must be a positive power of two, got {v!r}")
    if num_warps is not None:
        check_launch(who, num_warps)


def pick_num_warps(num_warps, block_tokens, block_heads, rotary_dim):
    """num_warps as the caller gave it (`check_launch_args`), or None: `default_num_warps`."""
    return default_num_warps(block_tokens, block_heads, rotary_dim) if num_warps is None else num_warps


POSITION_DTYPES = ("int32", "int64")  # int64 positions are checked to fit int32 before the kernel reads them


def check_positions_dtype(name: str) -> None:
    """ValueError unless the positions' dtype (by name: "int32", "int16", "bool", ...) is one of POSITION_DTYPES."""
    if name not in POSITION_DTYPES:
        raise ValueError(f"positions dtype must be int32 or int64, got {name}")


def stream_index(rotary_dim: int, mrope_section: Sequence[int], mrope_interleaved: bool) -> list[int]:
    """Stream (0 = t, 1 = h, 2 = w) of each of the ``rotary_dim // 2`` frequencies."""
    t, h, w = mrope_section
    half = rotary_dim // 2
    if mrope_interleaved:
        return [1 if (i % 3 == 1 and i < 3 * h) else 2 if (i % 3 == 2 and i < 3 * w) else 0
                for i in range(half)]
    return [0 if i < t else 1 if i < t + h else 2 for i in range(half)]


