"""The per-step RoPE tables and the rotate-and-write of q/k/v into the stacked ring, as Pallas
kernels; Triton twins in `kernels_triton.twin_rope`, plain references `*_native` beside them.

Contract (beside `twin_math`'s):

    tables:  angle[b, t, i] = (float32(offset[b]) + t) * freqs[i];  (sin, cos) = twin_math.sincos(angle)
             (made by the step's entry kernel, `twin_entry`, with the rest of the step's tables)
    rotate:  GPT-J pairs (r, i) = (x[2j], x[2j+1]) of q and k, in float32:
             r' = to_dtype(r*cos - i*sin),  i' = to_dtype(r*sin + i*cos)   (each product rounded);
             with cos = sin = None, no rotation: q and k as projected (a stack without a positional
             embedding, the depformer's)
    write:   ring_k[layer, b, h, write_index[b, t]] = k'[b, h, t], ring_v[...] = v[b, h, t] where
             write_mask[b, t] (`StepTables.write_mask`: the row is active and the position not
             recycled away); nothing else of the ring is touched (rings aliased to the outputs, so
             under donation the write is in place). A row's written tokens write distinct slots
             (`contract.rope.check_write_slots`: refused where the slots are on the host; traced
             ones are the caller's to keep distinct, as the step's tables do)

Everything is elementwise per (b, t): batch-invariant by construction.

Derivative (`rope_write` is a `jax.custom_vjp`; the backward is the Pallas kernel `rope_write_bwd`,
reference `rope_write_bwd_native`, Triton twin `kernels_triton.twin_rope.rope_write_bwd`):

    dq, dk:  the rotation by -theta of the cotangent, `rotate(dr, di, cos, -sin)`: each product
             rounded, one rounding to qkv's dtype (a rotation's transpose is its inverse);
             cos = sin = None (no rotation): the cotangent as it is
    dk, dv:  read from the ring cotangent at [layer, b, h, write_index[b, t]] where write_mask[b, t],
             else 0; dv unrounded (a copy)
    rings:   the ring cotangent with the written slots set to 0 (they were overwritten), in place
             (aliased); every other slot passes through

Nothing is summed: the bits are fixed by the rotation's roundings alone. cos, sin get no cotangent
(tables of the integer positions: `twin_entry.entry` refuses to differentiate its frequencies,
and `rope_write` refuses a perturbed table with NotImplementedError); layer, write_index and
write_mask are integers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import backend, twin_grad
from kernels_pallas import twin_math as tm
from kernels_pallas.contract.numerics import next_pow2
from kernels_pallas.contract.rope import check_rope_tables, check_twin_rope


def angle_sincos(pos, freqs, gpu: bool):
    """(cos, sin) float32 [..., D/2] of the contract's angles pos[..., None] * freqs (one rounded
    product each); pos: float32 positions [...], freqs: float32 [D/2]. The step's entry kernel
    (`twin_entry`) computes its rows' tables with it, `tables_native` all rows'."""
    sin, cos = tm.sincos(tm.mul(pos[..., None], freqs, gpu), gpu)
    return cos, sin


def _tables_kernel(offset_ref, freqs_ref, cos_ref, sin_ref, *, gpu):
    """Program b: the tables [TP, D/2] of row b (TP: T rounded up to a power of two)."""
    b = pl.program_id(0)
    TP = cos_ref.shape[1]
    pos = pltriton.load(offset_ref.at[b + jnp.arange(1, dtype=jnp.int32)]).astype(tm.F32)  # [1]
    cos, sin = angle_sincos(pos + jnp.arange(TP, dtype=jnp.int32).astype(tm.F32), freqs_ref[...], gpu)
    cos_ref[0], sin_ref[0] = cos, sin


def tables(offset: jax.Array, T: int, freqs: jax.Array, *, interpret: bool | None = None):
    """(cos, sin) float32 [B, T, D/2] for positions offset[b] + t (the contract's tables), one program a
    row. The JAX twin step makes them in its entry kernel (`twin_entry`) with the rest of its tables;
    this is the tables alone, the twin of `kernels_triton.twin_rope.tables`. On Mosaic GPU where
    `kernels_pallas.backend` says so and D/2 is a multiple of 8 (`twin_rope_mgpu.tables`)."""
    B, half = check_rope_tables(offset, T, freqs)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if backend.on_mosaic() and half % 8 == 0:
        from kernels_pallas import twin_rope_mgpu

        return twin_rope_mgpu.tables(offset, T, freqs, interpret=interpret)
    Tp = next_pow2(T)
    out = jax.ShapeDtypeStruct((B, Tp, half), tm.F32)
    cos, sin = pl.pallas_call(
        functools.partial(_tables_kernel, gpu=not interpret),
        out_shape=(out, out),
        grid=(B,),
        in_specs=[pl.BlockSpec(offset.shape, lambda b: (0,)), pl.BlockSpec((half,), lambda b: (0,))],
        out_specs=(pl.BlockSpec((1, Tp, half), lambda b: (b, 0, 0)),) * 2,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),  # Triton, not whatever the default backend is
        name="twin_rope_tables",
    )(offset, freqs.astype(tm.F32))
    return cos[:, :T], sin[:, :T]


def tables_native(offset, T: int, freqs):
    """(cos, sin) float32 [B, T, D/2] for positions offset[b] + t: the plain jax.numpy reference of
    `tables` (and of the tables `twin_entry.entry` makes)."""
    return angle_sincos(offset.astype(tm.F32)[:, None] + jnp.arange(T, dtype=tm.F32), freqs.astype(tm.F32), False)


def rotate(r, i, cos, sin, dtype, gpu):
    """The contract's rotation of pairs (r, i) (float32) -> (r', i') in dtype."""
    mul = functools.partial(tm.mul, gpu=gpu)
    return (tm.to_dtype(mul(r, cos) - mul(i, sin), dtype), tm.to_dtype(mul(r, sin) + mul(i, cos), dtype))


def _write_kernel(layer_ref, qkv_ref, *refs, B, T, H, C, D, rope, gpu):
    """Program (b*T + t, h): one head of one query. refs: cos and sin (rope: rotate q and k), the
    slots, the write mask, the rings in, q and the rings out (aliased to the rings in). Flat offsets
    (1-D refs) except into the rings, [L*B*H, C, D] indexed per dimension: past 2**32 bytes the
    lowering computes those addresses in 64 bits (a flat int32 offset overflows once L*B*H*C*D >
    2**31: the temporal ring at B >= 6)."""
    refs = list(refs)
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    slot_ref, wmask_ref, _, _, q_ref, k_ref, v_ref = refs  # the rings in: aliased to k_ref, v_ref
    bt, h = pl.program_id(0), pl.program_id(1)
    b, t = bt // T, bt % T
    half = D // 2
    j2 = 2 * jnp.arange(half, dtype=jnp.int32)

    def pairs(part):  # even and odd elements of q (0), k (1) or v (2) of this head, float32 [half]
        base = (bt * 3 + part) * H * D + h * D + j2
        return (pltriton.load(qkv_ref.at[base]).astype(tm.F32), pltriton.load(qkv_ref.at[base + 1]).astype(tm.F32))

    dtype = q_ref.dtype
    cs = bt * half + jnp.arange(half, dtype=jnp.int32)
    cos, sin = (pltriton.load(cos_ref.at[cs]), pltriton.load(sin_ref.at[cs])) if rope else (None, None)

    def turn(pair):  # q or k: rotated (rope), else as projected
        return rotate(*pair, cos, sin, dtype, gpu) if rope else tuple(tm.to_dtype(x, dtype) for x in pair)

    q0, q1 = turn(pairs(0))
    q_out = ((b * H + h) * T + t) * D + j2                                     # q [B, H, T, D]
    pltriton.store(q_ref.at[q_out], q0)
    pltriton.store(q_ref.at[q_out + 1], q1)

    @pl.when(wmask_ref[bt] != 0)
    def _():
        k0, k1 = turn(pairs(1))
        v0, v1 = (tm.to_dtype(x, dtype) for x in pairs(2))
        row, slot = (layer_ref[0] * B + b) * H + h, slot_ref[bt]
        for ref, (e, o) in ((k_ref, (k0, k1)), (v_ref, (v0, v1))):           # ring [L*B*H, C, D]
            pltriton.store(ref.at[row, slot, j2], e)
            pltriton.store(ref.at[row, slot, j2 + 1], o)


def rope_write(qkv: jax.Array, cos: jax.Array | None, sin: jax.Array | None, ring_k: jax.Array, ring_v: jax.Array,
               layer, write_index: jax.Array, write_mask: jax.Array, *, interpret: bool | None = None):
    """Rotate q, k and write k, v into layer `layer` of the rings; returns (q, ring_k, ring_v).

    qkv: [B, T, 3, H, D] (the in-projection's output, Moshi's `b t (p h d)` split); cos, sin:
    float32 [B, T, D/2], or both None (no rotation: q as projected, k and v written as they are);
    ring_k, ring_v: [L, B, H, C, D] in qkv's dtype (aliased to the outputs);
    layer: int or int32 scalar (may be traced); write_index: int [B, T]; write_mask: bool [B, T]
    (or int32, nonzero where written: the kernel reads int32).
    q comes back as [B, H, T, D]. Differentiable in qkv and the rings (module docstring).
    """
    check_twin_rope(qkv, cos, sin, ring_k, ring_v, write_index, write_mask, tm.host_values(write_index),
                    tm.host_values(write_mask))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _differentiable(interpret, qkv, cos, sin, ring_k, ring_v, tm.layer_index("rope_write", layer, ring_k.shape[0]),
                           write_index, write_mask)


def _forward(interpret: bool, qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask):
    """The forward kernel (`rope_write`, its arguments checked); on Mosaic GPU where `kernels_pallas.backend`
    says so (`twin_rope_mgpu.rope_write`)."""
    if backend.on_mosaic():
        from kernels_pallas import twin_rope_mgpu

        return twin_rope_mgpu.rope_write(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask,
                                         interpret=interpret)
    B, T, H, D, (_L, C) = check_twin_rope(qkv, cos, sin, ring_k, ring_v, write_index, write_mask)
    rope = cos is not None
    kernel = functools.partial(_write_kernel, B=B, T=T, H=H, C=C, D=D, rope=rope, gpu=not interpret)
    rows = (ring_k.shape[0] * B * H, C, D)  # the rings as [L*B*H, C, D] (see _write_kernel)
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), qkv.reshape(-1), *((cos.reshape(-1), sin.reshape(-1))
                                                                            if rope else ()),
                write_index.astype(jnp.int32).reshape(-1), write_mask.astype(jnp.int32).reshape(-1),
                ring_k.reshape(rows), ring_v.reshape(rows)]
    ring_at = len(operands) - 2
    q, k, v = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B * H * T * D,), qkv.dtype),
                   jax.ShapeDtypeStruct(rows, ring_k.dtype), jax.ShapeDtypeStruct(rows, ring_v.dtype)),
        grid=(B * T, H),
        input_output_aliases={ring_at: 1, ring_at + 1: 2},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),  # Triton, not whatever the default backend is
        name="twin_rope_write",
    )(*operands)
    return q.reshape(B, H, T, D), k.reshape(ring_k.shape), v.reshape(ring_v.shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _differentiable(interpret, qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask):
    return _forward(interpret, qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask)


def _differentiable_fwd(interpret, qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask):
    """symbolic_zeros: each primal comes with `.perturbed` (refuse a differentiated table)."""
    if any(t is not None and t.perturbed for t in (cos, sin)):
        raise NotImplementedError("rope_write(cos, sin): the RoPE tables have no derivative here (functions of "
                                  "integer positions); differentiate qkv and the rings only")
    args = [None if a is None else a.value for a in (qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask)]
    return _differentiable(interpret, *args), (args[1], args[2], args[5], args[6], args[7])


def _differentiable_bwd(interpret, residuals, cotangents):
    return _bwd(interpret, residuals, tuple(map(twin_grad.dense, cotangents)))


@twin_grad.first_order("rope_write")
def _bwd(interpret, residuals, cotangents):
    """`_differentiable_bwd` on (dq, d_ring_k, d_ring_v) as arrays."""
    cos, sin, layer, write_index, write_mask = residuals
    dq, d_ring_k, d_ring_v = cotangents
    d_qkv, d_ring_k, d_ring_v = rope_write_bwd(dq, cos, sin, d_ring_k, d_ring_v, layer, write_index, write_mask,
                                               interpret=interpret)
    return d_qkv, None, None, d_ring_k, d_ring_v, None, None, None


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd, symbolic_zeros=True)


def _bwd_kernel(layer_ref, dq_ref, *refs, B, T, H, C, D, rope, gpu):
    """Program (b*T + t, h): the cotangent of one head of one query (the forward's `_write_kernel`
    transposed). refs: cos and sin (rope), the slots, the write mask, dk_in, dv_in (aliased to dk_ref,
    dv_ref: read, the written slot zeroed), d_qkv, dk_ref, dv_ref."""
    refs = list(refs)
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    slot_ref, wmask_ref, dk_in, dv_in, dqkv_ref, dk_ref, dv_ref = refs
    bt, h = pl.program_id(0), pl.program_id(1)
    b, t = bt // T, bt % T
    half = D // 2
    j2 = 2 * jnp.arange(half, dtype=jnp.int32)
    cs = bt * half + jnp.arange(half, dtype=jnp.int32)
    dtype = dqkv_ref.dtype
    if rope:
        cos, nsin = pltriton.load(cos_ref.at[cs]), -pltriton.load(sin_ref.at[cs])

    def back(r, i):  # the rotation by -theta (rope), else the cotangent as it is, in d_qkv's dtype
        return rotate(r, i, cos, nsin, dtype, gpu) if rope else (tm.to_dtype(r, dtype), tm.to_dtype(i, dtype))

    def store(part, pair):  # into d_qkv [B, T, 3, H, D]
        base = (bt * 3 + part) * H * D + h * D + j2
        pltriton.store(dqkv_ref.at[base], pair[0])
        pltriton.store(dqkv_ref.at[base + 1], pair[1])

    q_at = ((b * H + h) * T + t) * D + j2                                       # dq [B, H, T, D]
    store(0, back(pltriton.load(dq_ref.at[q_at]).astype(tm.F32), pltriton.load(dq_ref.at[q_at + 1]).astype(tm.F32)))
    written = wmask_ref[bt] != 0
    row, slot = (layer_ref[0] * B + b) * H + h, slot_ref[bt]                   # rings [L*B*H, C, D]

    def pair(ref):
        return pltriton.load(ref.at[row, slot, j2]), pltriton.load(ref.at[row, slot, j2 + 1])

    dk = back(*(x.astype(tm.F32) for x in pair(dk_in)))
    zero = jnp.zeros((half,), dtype)
    store(1, tuple(jnp.where(written, x, zero) for x in dk))
    store(2, tuple(jnp.where(written, x.astype(dtype), zero) for x in pair(dv_in)))

    @pl.when(written)
    def _():
        for ref in (dk_ref, dv_ref):
            pltriton.store(ref.at[row, slot, j2], jnp.zeros((half,), ref.dtype))
            pltriton.store(ref.at[row, slot, j2 + 1], jnp.zeros((half,), ref.dtype))


def rope_write_bwd(dq: jax.Array, cos: jax.Array | None, sin: jax.Array | None, d_ring_k: jax.Array, d_ring_v: jax.Array, layer,
                   write_index: jax.Array, write_mask: jax.Array, *, interpret: bool | None = None):
    """The backward of `rope_write` (module docstring): (d_qkv [B, T, 3, H, D], d_ring_k, d_ring_v).

    dq: [B, H, T, D] (q's cotangent, the qkv dtype); d_ring_k, d_ring_v: [L, B, H, C, D] (the rings'
    cotangents after the write, aliased to the ones returned: the written slots come back 0);
    the rest as `rope_write`'s. On Mosaic GPU where `kernels_pallas.backend` says so
    (`twin_rope_mgpu.rope_write_bwd`).
    """
    B, H, T, D = dq.shape
    check_twin_rope(jax.ShapeDtypeStruct((B, T, 3, H, D), dq.dtype), cos, sin, d_ring_k, d_ring_v, write_index,
                    write_mask, tm.host_values(write_index), tm.host_values(write_mask))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if backend.on_mosaic():
        from kernels_pallas import twin_rope_mgpu

        return twin_rope_mgpu.rope_write_bwd(dq, cos, sin, d_ring_k, d_ring_v, layer, write_index, write_mask,
                                             interpret=interpret)
    C = d_ring_k.shape[3]
    rows = (d_ring_k.shape[0] * B * H, C, D)
    rope = cos is not None
    operands = [jnp.asarray(layer, jnp.int32).reshape(1), dq.reshape(-1),
                *((cos.reshape(-1), sin.reshape(-1)) if rope else ()),
                write_index.astype(jnp.int32).reshape(-1), write_mask.astype(jnp.int32).reshape(-1),
                d_ring_k.reshape(rows), d_ring_v.reshape(rows)]
    ring_at = len(operands) - 2
    d_qkv, dk, dv = pl.pallas_call(
        functools.partial(_bwd_kernel, B=B, T=T, H=H, C=C, D=D, rope=rope, gpu=not interpret),
        out_shape=(jax.ShapeDtypeStruct((B * T * 3 * H * D,), dq.dtype),
                   jax.ShapeDtypeStruct(rows, d_ring_k.dtype), jax.ShapeDtypeStruct(rows, d_ring_v.dtype)),
        grid=(B * T, H),
        input_output_aliases={ring_at: 1, ring_at + 1: 2},
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(),
        name="twin_rope_write_bwd",
    )(*operands)
    return d_qkv.reshape(B, T, 3, H, D), dk.reshape(d_ring_k.shape), dv.reshape(d_ring_v.shape)


def rope_write_native(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask, **_):
    """The plain jax.numpy reference of `rope_write` (same signature and bits)."""
    return rotate_and_write(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask,
                            functools.partial(rotate, gpu=False))


def rotate_and_write(qkv, cos, sin, ring_k, ring_v, layer, write_index, write_mask, turn):
    """`rope_write_native` with the rotation `turn(r, i, cos, sin, dtype)` (`rotate`'s arguments; r, i
    float32 of one shape, cos, sin broadcasting to it), the rest XLA's data movement: the Mosaic GPU
    backend's rope write (`twin_rope_mgpu`) passes its elementwise kernel."""
    B, T, H, D, (L, C) = check_twin_rope(qkv, cos, sin, ring_k, ring_v, write_index, write_mask,
                                         tm.host_values(write_index), tm.host_values(write_mask))
    layer = tm.layer_index("rope_write", layer, L)
    if cos is None:  # no rotation: q and k as projected
        q, k = (qkv[:, :, p].transpose(0, 2, 1, 3) for p in (0, 1))                # [B, H, T, D]
    else:
        x = qkv.astype(tm.F32).reshape(B, T, 3, H, D // 2, 2)
        c, s = cos[:, :, None, :], sin[:, :, None, :]
        rot = [jnp.stack(turn(x[:, :, p, :, :, 0], x[:, :, p, :, :, 1], c, s, qkv.dtype), -1) for p in (0, 1)]
        q, k = (r.reshape(B, T, H, D).transpose(0, 2, 1, 3) for r in rot)         # [B, H, T, D]
    v = qkv[:, :, 2].transpose(0, 2, 1, 3)
    slot = jnp.where(write_mask, write_index, C + jnp.arange(T))                  # not written: dropped
    bi, hi = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    ring_k = ring_k.at[layer, bi, hi, slot[:, None, :]].set(k, mode="drop")
    ring_v = ring_v.at[layer, bi, hi, slot[:, None, :]].set(v, mode="drop")
    return q, ring_k, ring_v


def rope_write_bwd_native(dq, cos, sin, d_ring_k, d_ring_v, layer, write_index, write_mask, **_):
    """The plain jax.numpy reference of `rope_write_bwd` (same signature and bits)."""
    return rotate_and_write_bwd(dq, cos, sin, d_ring_k, d_ring_v, layer, write_index, write_mask,
                                functools.partial(rotate, gpu=False))


def rotate_and_write_bwd(dq, cos, sin, d_ring_k, d_ring_v, layer, write_index, write_mask, turn):
    """`rope_write_bwd_native` with the rotation `turn` (`rotate_and_write`'s)."""
    B, H, T, D = dq.shape
    C = d_ring_k.shape[3]

    def back(x):  # [B, H, T, D] -> the rotation by -theta (or none), [B, T, H, D] in dq's dtype
        if cos is None:
            return x.astype(dq.dtype).transpose(0, 2, 1, 3)
        c, ns = cos[:, None], -sin[:, None]                                      # [B, 1, T, D/2]
        x = x.astype(tm.F32).reshape(B, H, T, D // 2, 2)
        return jnp.stack(turn(x[..., 0], x[..., 1], c, ns, dq.dtype), -1).reshape(B, H, T, D).transpose(0, 2, 1, 3)

    bi, hi = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    slot = write_index.astype(jnp.int32)[:, None, :]
    at = (layer, bi, hi, slot)
    written = write_mask.astype(bool)[:, :, None, None]                          # [B, T, 1, 1]
    dk, dv = (jnp.where(written, x, jnp.zeros((), dq.dtype)) for x in (back(d_ring_k[at]), d_ring_v[at].transpose(0, 2, 1, 3)))
    drop = jnp.where(write_mask.astype(bool), write_index, C + jnp.arange(T))[:, None, :]
    zero = (layer, bi, hi, drop)
    return (jnp.stack([back(dq), dk, dv], axis=2), d_ring_k.at[zero].set(0, mode="drop"),
            d_ring_v.at[zero].set(0, mode="drop"))


__all__ = ["rope_write", "rope_write_bwd", "rope_write_bwd_native", "rope_write_native", "tables", "tables_native"]
