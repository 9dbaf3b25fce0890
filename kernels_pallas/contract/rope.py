"""The twin rotate-and-write's contract (`twin_rope`): the ring conventions and the argument checks.

Standard library only.
"""

from __future__ import annotations

from kernels_pallas.contract.numerics import check_index, check_nonempty, check_twin_dtype, positive_int

RING_CONVENTIONS = ("personaplex", "moshi")  # where a ring's slots' positions count from (jax_impl/tables.py)


def check_rope_tables(offset, T, freqs) -> tuple[int, int]:
    """(B, D/2) of a twin `tables` call, after checking offset int [B] (B >= 1), T an int >= 1 and freqs
    [D/2] with D/2 a power of two (every size at least 1: `numerics.check_nonempty`)."""
    if len(offset.shape) != 1 or not str(offset.dtype).removeprefix("torch.").startswith(("int", "uint")):
        raise ValueError(f"tables(offset): expected an int array [B], got {offset.dtype} {list(offset.shape)}")
    check_nonempty("tables", "offset", offset.shape, ("batch row (B)",))
    if not positive_int(T):
        raise ValueError(f"tables(T): expected an int >= 1, got {T!r}")
    half = freqs.shape[0] if len(freqs.shape) == 1 else 0
    if half < 1 or half & (half - 1):
        raise ValueError(f"tables(freqs): expected [D/2] with D/2 a power of two, got shape {list(freqs.shape)}")
    return offset.shape[0], half


def check_write_slots(who: str, slots, written) -> None:
    """Refuse, naming `who`'s write_index, two written tokens of one batch row at one slot (ValueError):
    which of the writes lands is not fixed (the programs run in parallel), and the backwards would
    credit different ones. slots, written: the values of write_index and write_mask [B, T] where the
    caller reads them without waiting on a device (`numerics.check_index`), else None: not read, so
    distinct slots are then the caller's to keep, as slots inside the ring are (the step's tables,
    (offset + t) % C for T <= C queries, keep both)."""
    if slots is None or written is None:
        return
    for b, (row, row_written) in enumerate(zip(slots.tolist(), written.tolist())):
        seen = set()
        for slot in (s for s, w in zip(row, row_written) if w):
            if slot in seen:
                raise ValueError(f"{who}(write_index): expected distinct slots among a batch row's written tokens "
                                 f"(write_mask), got slot {slot} twice in row {b}")
            seen.add(slot)


def check_twin_rope(qkv, cos, sin, ring_k, ring_v, write_index, write_mask, slots=None, written=None,
                    who: str = "rope_write"):
    """(B, T, H, D, (L, C)) of a twin rope_write call, after checking every shape; cos and sin may
    both be None (no rotation). slots, written: the values of write_index and write_mask where the
    caller reads them without waiting on a device (`numerics.check_index`): a slot outside the ring
    would be written anyway, and one slot written twice in a row is refused (`check_write_slots`,
    naming `who`: the op the caller runs)."""
    check_twin_dtype("rope_write", "qkv", qkv)
    if len(qkv.shape) != 5 or qkv.shape[2] != 3:
        raise ValueError(f"rope_write(qkv): expected [B, T, 3, H, D], got shape {tuple(qkv.shape)}")
    check_nonempty("rope_write", "qkv", qkv.shape, ("batch row (B)", "query (T)", "part", "head (H)", "feature (D)"))
    B, T, _, H, D = qkv.shape
    if D < 2 or D & (D - 1):
        raise ValueError(f"rope_write(qkv): the head dim D must be a power of two >= 2 (pairs), got {D}")
    if (cos is None) != (sin is None):
        raise ValueError("rope_write: cos and sin go together: pass both (rotate q and k) or neither (no rotation)")
    for name, t in (("cos", cos), ("sin", sin)):
        if t is not None and tuple(t.shape) != (B, T, D // 2):
            raise ValueError(f"rope_write({name}): expected [{B}, {T}, {D // 2}], got {tuple(t.shape)}")
    for name, r in (("ring_k", ring_k), ("ring_v", ring_v)):
        if len(r.shape) != 5 or (r.shape[1], r.shape[2], r.shape[4]) != (B, H, D) or str(r.dtype) != str(qkv.dtype):
            raise ValueError(f"rope_write({name}): expected [L, {B}, {H}, C, {D}] in {qkv.dtype}, "
                             f"got {r.dtype}{list(r.shape)}")
        check_nonempty("rope_write", name, r.shape, ("layer (L)", "batch row (B)", "head (H)", "slot (C)"))
    if tuple(write_index.shape) != (B, T) or tuple(write_mask.shape) != (B, T):
        raise ValueError(f"rope_write: write_index and write_mask must be [{B}, {T}], got "
                         f"{tuple(write_index.shape)} and {tuple(write_mask.shape)}")
    check_index("rope_write", "write_index", write_index, ring_k.shape[3], slots)
    check_write_slots(who, slots, written)
    return B, T, H, D, (ring_k.shape[0], ring_k.shape[3])


