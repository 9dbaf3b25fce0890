"""Distances between two arrays for parity checks (numpy-based; used by tests and the cross-check tool).

`ulp_distance(a, b)` works on the raw bits: floats are mapped to integers ordered like the
reals (sign-magnitude -> two's complement, +0 == -0), so the distance is the number of
representable values between a and b. Supports float16, bfloat16 (ml_dtypes), float32,
float64. Inputs may be numpy, jax, or torch arrays (torch bfloat16 included, via DLPack).
"""

from __future__ import annotations

import numpy as np

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
FLOATS = ("float16", "bfloat16", "float32", "float64")  # the dtypes ulp_distance orders
NAN_DISTANCE = np.iinfo(np.uint64).max


def as_numpy(x) -> np.ndarray:
    """A numpy array of x without changing its dtype (bf16 stays ml_dtypes.bfloat16); a torch tensor
    that requires grad is read detached."""
    if isinstance(x, np.ndarray):
        return x
    if callable(getattr(x, "detach", None)):
        x = x.detach()
    try:
        return np.asarray(x)
    except (TypeError, RuntimeError):  # e.g. a torch bfloat16 tensor: go through DLPack
        from .weights import copy_to_jax

        return np.asarray(copy_to_jax(x))


def _float_dtype_check(a: np.ndarray, b: np.ndarray) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance: dtypes differ ({a.dtype} vs {b.dtype}); compare like with like")
    if str(a.dtype) not in FLOATS:
        raise TypeError(f"ulp_distance: expected one of {FLOATS}, got {a.dtype}")
    if a.shape != b.shape:
        raise ValueError(f"ulp_distance: shapes differ ({a.shape} vs {b.shape})")


def bits(x) -> np.ndarray:
    """The raw bits of an array as unsigned integers of its width: equal bits <=> equal arrays."""
    a = np.ascontiguousarray(as_numpy(x))
    if a.dtype.itemsize not in _UINT or a.dtype.kind not in "biufV":
        raise TypeError(f"bits: expected an array of 1-, 2-, 4- or 8-byte bools or numbers, got {a.dtype}")
    return a.view(_UINT[a.dtype.itemsize])


def ulp_distance(a, b) -> np.ndarray:
    """Elementwise distance in units in the last place, uint64 (NaN vs non-NaN: NAN_DISTANCE)."""
    a, b = as_numpy(a), as_numpy(b)
    _float_dtype_check(a, b)
    size = a.dtype.itemsize
    sign = np.uint64(1) << np.uint64(8 * size - 1)
    ua, ub = bits(a).astype(np.uint64), bits(b).astype(np.uint64)
    ma, mb = ua & ~sign, ub & ~sign
    sa, sb = (ua & sign) != 0, (ub & sign) != 0
    same = sa == sb
    dist = np.where(same, np.where(ma > mb, ma - mb, mb - ma), ma + mb)
    af, bf = a.astype(np.float64), b.astype(np.float64)
    na, nb = np.isnan(af), np.isnan(bf)
    dist = np.where(na & nb, np.uint64(0), dist)
    return np.where(na ^ nb, np.uint64(NAN_DISTANCE), dist).astype(np.uint64)


def max_ulp(a, b) -> int:
    d = ulp_distance(a, b)
    return int(d.max()) if d.size else 0
