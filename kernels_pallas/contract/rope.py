"""The twin rotate-and-write's contract (`twin_rope`): the ring conventions and the argument checks.

Standard library only.
"""

from __future__ import annotations

RING_CONVENTIONS = ("personaplex", "moshi")  # where a ring's slots' positions count from (jax_impl/tables.py)


def check_twin_rope(qkv, cos, sin, ring_k, ring_v, write_index, write_mask):
    """(B, T, H, D, (L, C)) of a twin rope_write call, after checking every shape; cos and sin may
    both be None (no rotation)."""
    if len(qkv.shape) != 5 or qkv.shape[2] != 3:
        raise ValueError(f"rope_write(qkv): expected [B, T, 3, H, D], got shape {tuple(qkv.shape)}")
    B, T, _, H, D = qkv.shape
    if (cos is None) != (sin is None):
        raise ValueError("rope_write: cos and sin go together: pass both (rotate q and k) or neither (no rotation)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t is not None and tuple(t.shape) != (B, T, D // 2):
            raise ValueError(f"rope_write({name}): expected [{B}, {T}, {D // 2}], got {tuple(t.shape)}")
    for name, r in (("ring_k", ring_k), ("ring_v", ring_v)):
        if len(r.shape) != 5 or (r.shape[1], r.shape[2], r.shape[4]) != (B, H, D) or str(r.dtype) != str(qkv.dtype):
            raise ValueError(f"rope_write({name}): expected [L, {B}, {H}, C, {D}] in {qkv.dtype}, "
                             f"got {r.dtype}{list(r.shape)}")
    if tuple(write_index.shape) != (B, T) or tuple(write_mask.shape) != (B, T):
        raise ValueError(f"rope_write: write_index and write_mask must be [{B}, {T}], got "
                         f"{tuple(write_index.shape)} and {tuple(write_mask.shape)}")
    return B, T, H, D, (ring_k.shape[0], ring_k.shape[3])


