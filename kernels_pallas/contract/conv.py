"""The codec's twin kernels (`kernels_pallas.twin_conv`, `kernels_triton.twin_conv`): launch
constants and argument checks, framework-free (standard library only)."""

from __future__ import annotations

ELU_BLOCK = 1024  # elements of an ELU program, compiled (interpreted: one program for the whole array)
NEAREST_BLOCK = 64  # codebook entries a nearest program scores at once (speed only)
TAPS_BLOCK = 4096  # elements of the tap matrix a taps program writes at once (speed only)
TAPS_COLS = 512  # the most tap columns a taps program writes at once (speed only)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def taps_plan(T: int, columns: int, width: int, stride: int) -> tuple[int, int]:
    """(rows, cols) of a taps program's tile over the tap matrix [T, columns] of one batch row.

    Powers of two (Triton's blocks). The first tile holds every row that reads the carry (t * stride
    < width): its program is the only one reading the carry, so it can write the new carry in place
    after its reads."""
    cols = min(next_pow2(columns), TAPS_COLS)
    carry_rows = next_pow2(-(-width // stride))
    return min(next_pow2(T), max(carry_rows, TAPS_BLOCK // cols)), cols


def check_conv1d(x, w, bias, residual, stride: int, dilation: int,
                 width: int = 0) -> tuple[int, int, int, int, int, int]:
    """(B, in, L, out, k, T) of a twin conv1d call, after checking shapes, dtypes and the geometry;
    L counts the carry's `width` samples before x's."""
    for name, v in (("stride", stride), ("dilation", dilation)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"conv1d({name}): expected a positive int, got {v!r}")
    if len(x.shape) != 3:
        raise ValueError(f"conv1d(x): expected [B, in, L], got shape {tuple(x.shape)}")
    B, cin, L = x.shape
    L += width
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


def check_stream(who: str, x, carry, active, first, replicate: bool) -> int:
    """The carry's width W after checking a streamed call's carry [B, in, W], active and first (bool [B])."""
    B, cin = x.shape[0], x.shape[1]
    if carry is None:
        if active is not None or first is not None or replicate:
            raise ValueError(f"{who}(carry): active, first and replicate stream a carry; got no carry")
        return 0
    if len(carry.shape) != 3 or tuple(carry.shape[:2]) != (B, cin):
        raise ValueError(f"{who}(carry): expected [B={B}, in={cin}, W], got shape {tuple(carry.shape)}")
    if str(carry.dtype) != str(x.dtype):
        raise TypeError(f"{who}(carry): dtype {carry.dtype} differs from x's {x.dtype}")
    for name, v in (("active", active), ("first", first)):
        if v is not None and (tuple(v.shape) != (B,) or "bool" not in str(v.dtype)):
            raise ValueError(f"{who}({name}): expected bool [{B}], got {v.dtype} {tuple(v.shape)}")
    if replicate and first is None:
        raise ValueError(f"{who}(first): replicate pads a row's first frame: first is required")
    return carry.shape[2]


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
