"""The codec's twin kernels (`kernels_pallas.twin_conv`, `kernels_triton.twin_conv`): launch
constants and argument checks, framework-free (standard library only)."""

from __future__ import annotations

from kernels_pallas.contract.numerics import (
    check_nonempty,
    check_twin_dtype,
    largest_pow2_divisor,
    positive_int,
)

ELU_BLOCK = 1024  # elements of an ELU program, compiled (interpreted: one program for the whole array)
NEAREST_BLOCK = 64  # codebook entries a nearest program scores at once (speed only)
NEAREST_SPLIT = 128  # codebook entries a nearest program searches (`nearest_plan`; speed only)
TAPS_BLOCK = 4096  # elements of the tap matrix a taps program writes at once (speed only)
TAPS_COLS = 512  # the most tap columns a taps program writes (`taps_plan`; speed only)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def check_signal(who: str, x, frames: bool = False) -> tuple[int, int, int]:
    """(B, in, L) of `who`'s x [B, in, L] (a transposed convolution's [B, in, T]: `frames`) of a twin
    dtype (`numerics.check_twin_dtype`) with at least one batch row, channel and sample
    (`numerics.check_nonempty`): a carry's samples do not stand in for x's, the kernels index x's
    last sample."""
    check_twin_dtype(who, "x", x)
    if len(x.shape) != 3:
        raise ValueError(f"{who}(x): expected [B, in, {'T' if frames else 'L'}], got shape {tuple(x.shape)}")
    check_nonempty(who, "x", x.shape, ("batch row (B)", "channel (in)", "frame (T)" if frames else "sample (L)"))
    return tuple(x.shape)


def check_elu(x) -> None:
    """An ELU's x (any shape): a twin dtype (`numerics.check_twin_dtype`), at least one element."""
    check_twin_dtype("elu", "x", x)
    check_nonempty("elu", "x", x.shape, ("element",) * len(x.shape))


def check_taps(kernel_size, stride, dilation, length: int) -> int:
    """T, the rows of a taps call over `length` samples (the carry's and x's), after checking
    kernel_size, stride and dilation (positive ints) and that one window fits in them."""
    for name, v in (("kernel_size", kernel_size), ("stride", stride), ("dilation", dilation)):
        if not positive_int(v):
            raise ValueError(f"taps({name}): expected a positive int, got {v!r}")
    span = (kernel_size - 1) * dilation + 1
    if span > length:
        raise ValueError(f"taps(kernel_size): a window of {span} samples (kernel_size {kernel_size}, dilation "
                         f"{dilation}) is longer than the {length} given (the carry's and x's)")
    return (length - span) // stride + 1


def taps_plan(T: int, channels: int, k: int, width: int, stride: int) -> tuple[int, int, int]:
    """(rows, channels, cols) of a taps program's tile over the tap matrix [T, channels * k] of one batch
    row: RT rows, CH whole channels (CH * k columns: every tap of a channel in one program), written
    as a block of BC >= CH * k columns.

    Powers of two (Triton's blocks) but CH. The first row tile holds every row that reads the carry
    (t * stride < width), and a channel's carry is read and written only by the programs of that
    channel: the first-tile program of a channel block can write their new carry in place after its
    own reads. The channel blocks are programs of their own, not a loop in one program: as a loop, the
    one or two programs of Mimi's innermost convolutions at B=1 (2,048-3,584 columns, 1-16 rows) took
    up to 48 us on an H200 (RESULTS.md)."""
    columns = channels * k
    CH = channels if columns <= TAPS_COLS else max(1, TAPS_COLS // k)
    BC = next_pow2(CH * k)
    carry_rows = next_pow2(-(-width // stride))
    return min(next_pow2(T), max(carry_rows, TAPS_BLOCK // BC)), CH, BC


def check_conv1d(x, w, bias, residual, stride: int, dilation: int,
                 width: int = 0) -> tuple[int, int, int, int, int, int]:
    """(B, in, L, out, k, T) of a twin conv1d call, after checking shapes, dtypes and the geometry;
    L counts the carry's `width` samples before x's."""
    for name, v in (("stride", stride), ("dilation", dilation)):
        if not positive_int(v):
            raise ValueError(f"conv1d({name}): expected a positive int, got {v!r}")
    B, cin, L = check_signal("conv1d", x)
    L += width
    if len(w.shape) != 3 or w.shape[1] != cin:
        raise ValueError(f"conv1d(w): expected [out, in={cin}, k] (groups 1), got shape {tuple(w.shape)}")
    check_nonempty("conv1d", "w", w.shape, ("output channel (out)", "channel (in)", "tap (k)"))
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
    for name, v in (("bias", bias), ("residual", residual)):
        if v is not None and str(v.dtype) != str(x.dtype):
            raise TypeError(f"conv1d({name}): dtype {v.dtype} differs from x's {x.dtype}")
    return B, cin, L, cout, k, T


def check_stream(who: str, x, carry, active, first, replicate: bool, slot=None) -> int:
    """The carry's width W after checking a streamed call's carry, active and first (bool [B]). The
    carry: [B, in, W], or with `slot` = (offset, W) a row-packed state [B, N] holding it as [in, W] at
    columns offset .. offset + in * W of each row (`carry_slot` of the twin convolutions)."""
    B, cin = x.shape[0], x.shape[1]
    if carry is None:
        if active is not None or first is not None or replicate or slot is not None:
            raise ValueError(f"{who}(carry): active, first, replicate and carry_slot stream a carry; got no carry")
        return 0
    if slot is None:
        if len(carry.shape) != 3 or tuple(carry.shape[:2]) != (B, cin) or carry.shape[2] <= 0:
            raise ValueError(f"{who}(carry): expected [B={B}, in={cin}, W > 0], got shape {tuple(carry.shape)}")
        width = carry.shape[2]
    else:
        if (not isinstance(slot, tuple) or len(slot) != 2
                or any(isinstance(v, bool) or not isinstance(v, int) for v in slot) or slot[0] < 0 or slot[1] <= 0):
            raise ValueError(f"{who}(carry_slot): expected (offset >= 0, width > 0) ints, got {slot!r}")
        offset, width = slot
        if len(carry.shape) != 2 or carry.shape[0] != B or carry.shape[1] < offset + cin * width:
            raise ValueError(f"{who}(carry): with carry_slot={slot} expected a row-packed [B={B}, N >= "
                             f"{offset + cin * width}], got shape {tuple(carry.shape)}")
    if str(carry.dtype) != str(x.dtype):
        raise TypeError(f"{who}(carry): dtype {carry.dtype} differs from x's {x.dtype}")
    for name, v in (("active", active), ("first", first)):
        if v is not None and (tuple(v.shape) != (B,) or "bool" not in str(v.dtype)):
            raise ValueError(f"{who}({name}): expected bool [{B}], got {v.dtype} {tuple(v.shape)}")
    if replicate and first is None:
        raise ValueError(f"{who}(first): replicate pads a row's first frame: first is required")
    return width


def carry_geometry(x, carry, slot) -> tuple[int, int, int]:
    """(W, row, offset) of a checked carry: its width, the elements of a batch row of the carry array
    and where the convolution's [in, W] starts in that row (0 for a [B, in, W] carry)."""
    if carry is None:
        return 0, 0, 0
    if slot is None:
        return carry.shape[2], x.shape[1] * carry.shape[2], 0
    return slot[1], carry.shape[1], slot[0]


def check_conv_transpose1d(x, w, bias, stride: int, groups: int) -> tuple[int, int, int, int, int]:
    """(B, in, T, out, k) of a twin conv_transpose1d call, after checking shapes, dtypes and groups."""
    if not positive_int(stride):
        raise ValueError(f"conv_transpose1d(stride): expected a positive int, got {stride!r}")
    B, cin, T = check_signal("conv_transpose1d", x, frames=True)
    if len(w.shape) != 3 or w.shape[0] != cin:
        raise ValueError(f"conv_transpose1d(w): expected [in={cin}, out / groups, k], got shape {tuple(w.shape)}")
    check_nonempty("conv_transpose1d", "w", w.shape, ("channel (in)", "output channel (out / groups)", "tap (k)"))
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
    if bias is not None and str(bias.dtype) != str(x.dtype):
        raise TypeError(f"conv_transpose1d(bias): dtype {bias.dtype} differs from x's {x.dtype}")
    return B, cin, T, cout, w.shape[2]


def nearest_plan(N: int, split: int | None = None) -> tuple[int, int]:
    """(split, BN) of a nearest call over N entries: each row's entries searched by N / split programs
    (`split`: the caller's, a divisor of N; None: the largest power of two up to NEAREST_SPLIT dividing
    N), each scoring BN entries at once.

    Speed only: each program keeps the first of its least distances and the row's code is the first of
    the least of those, which is the first least entry of the whole row whatever the split (a minimum
    is exact). One program a row searched the 2,048 entries of a Mimi codebook in 39 us on an H200 at
    any batch, 8 books a frame; 16 programs of 128 entries take 3.4 us at one row, 12.4 at 64 (256
    entries: 5.3 and 16.9; 64: 2.2 and 13.5; RESULTS.md)."""
    if split is None:
        split = largest_pow2_divisor(N, NEAREST_SPLIT)
    if not positive_int(split) or N % split:
        raise ValueError(f"nearest(split): expected a positive divisor of the {N} entries, got {split!r}")
    return split, largest_pow2_divisor(split, NEAREST_BLOCK)


def check_nearest(x, entries) -> tuple[int, int, int]:
    """(M, N, D) of a twin nearest call, after checking shapes and dtypes."""
    check_twin_dtype("nearest", "x", x)
    if len(x.shape) != 2:
        raise ValueError(f"nearest(x): expected [M, D], got shape {tuple(x.shape)}")
    check_nonempty("nearest", "x", x.shape, ("row (M)", "feature (D)"))
    if len(entries.shape) != 2 or entries.shape[1] != x.shape[1] or entries.shape[0] == 0:
        raise ValueError(f"nearest(entries): expected [N >= 1, D={x.shape[1]}], got shape {tuple(entries.shape)}")
    if str(entries.dtype) != str(x.dtype):
        raise TypeError(f"nearest(entries): dtype {entries.dtype} differs from x's {x.dtype}")
    return x.shape[0], entries.shape[0], x.shape[1]
