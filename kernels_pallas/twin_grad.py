"""The twin linears' backward kernels (Pallas): the epilogue's derivative and the sum over the batch
rows (the norms' derivatives, the split norm's included, are in `twin_norm`, beside their forwards);
Triton twin in `kernels_triton.twin_grad`, plain references (`*_native`)
beside each kernel. Their contract, and how `twin_linear.linear` and `twin_norm.norm` differentiate
with them: `contract.grad`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import backend
from kernels_pallas import twin_math as tm
from kernels_pallas.contract.grad import INV_SQRT_2PI, GradBlocks
from kernels_pallas.contract.linear import LINEAR_ACTS
from kernels_pallas.contract.numerics import SQRT1_2, check_twin_dtype

F32 = tm.F32


def dense(cotangent):
    """A cotangent of a `custom_vjp` with symbolic zeros as an array: a `SymbolicZero` (an output
    nothing downstream used) as zeros of its shape and dtype, what the backward kernels read."""
    if isinstance(cotangent, SymbolicZero):
        return jnp.zeros(cotangent.shape, cotangent.dtype)
    return cotangent


def first_order(name: str):
    """Decorates a twin's `jax.custom_vjp` backward bwd(static, residuals, cotangents) (its nondiff
    argument first, the cotangents arrays: no `SymbolicZero`): the twin kernels have no derivative of
    their own, so differentiating the backward (a second derivative) raises NotImplementedError naming
    the twin rather than JAX's linearization error from inside a pallas_call. The first derivative is
    bwd's, unchanged (the torch twins: `kernels_triton.twin_grad.first_order`)."""

    def wrap(bwd):
        @functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
        def checked(static, residuals, cotangents):
            return bwd(static, residuals, cotangents)

        @checked.defjvp
        def _refuse(static, primals, tangents):
            raise NotImplementedError(f"{name}: the twin kernels have no second derivative; use "
                                      "kernels=\"reference\" (the *_native functions)")

        return checked

    return wrap


def stacked(w: jax.Array, g: jax.Array, layer) -> jax.Array:
    """The cotangent of a stacked weight w [L, ...] read at `layer`: g (one layer's, [...]) in its row
    of an [L, ...] of zeros (`contract.grad`)."""
    return lax.dynamic_update_index_in_dim(jnp.zeros_like(w), g.astype(w.dtype), layer, 0)


def epilogue_grad_math(g, p, s, act, dtype, gpu):
    """The epilogue's derivative (`contract.grad`, step 2) on float32 tiles: g = dy [BM, n]; p = the
    projection before the epilogue, [BM, n] or (a, b) for "silu_gate", None where act and s are
    None; s: the layer scale [1, n] or None. Returns (dpre: a tuple of one or two (the gate's
    halves) [BM, n] in dtype, ts float32 [BM, n] or None)."""
    ts = None
    if act == "silu_gate":
        a, b = p
        d = F32(1.0) + tm.exp(-a, gpu)
        sig = tm.div(F32(1.0), d, gpu)
        sa = tm.to_dtype(tm.div(a, d, gpu), dtype).astype(F32)  # to_dtype(silu(a)), the forward's
        if s is not None:
            ts = tm.mul(g, tm.to_dtype(tm.mul(sa, b, gpu), dtype).astype(F32), gpu)
            g = tm.mul(s, g, gpu)
        da = tm.mul(tm.mul(g, b, gpu), tm.mul(sig, F32(1.0) + tm.mul(a, F32(1.0) - sig, gpu), gpu), gpu)
        return (tm.to_dtype(da, dtype), tm.to_dtype(tm.mul(g, sa, gpu), dtype)), ts
    if s is not None:
        y0 = tm.to_dtype(tm.gelu(p, gpu), dtype).astype(F32) if act == "gelu" else p
        ts = tm.mul(g, y0, gpu)
        g = tm.mul(s, g, gpu)
    if act == "gelu":
        cdf = tm.mul(F32(0.5), F32(1.0) + tm.erf(tm.mul(p, F32(SQRT1_2), gpu), gpu), gpu)
        pdf = tm.mul(tm.exp(tm.mul(tm.mul(p, p, gpu), F32(-0.5), gpu), gpu), F32(INV_SQRT_2PI), gpu)
        g = tm.mul(g, cdf + tm.mul(p, pdf, gpu), gpu)
    return (tm.to_dtype(g, dtype),), ts


def check_epilogue_grad(dy, pre, scale, act):
    """(M, N_out, parts) of an epilogue_grad call (parts: 2 for the gate's halves, else 1), checked: dy
    (and pre, of its dtype) of a dtype the twins compute on (`numerics.check_twin_dtype`)."""
    if act not in LINEAR_ACTS:
        raise ValueError(f"epilogue_grad(act): must be one of {LINEAR_ACTS}, got {act!r}")
    check_twin_dtype("epilogue_grad", "dy", dy)
    if len(dy.shape) != 2:
        raise ValueError(f"epilogue_grad(dy): expected [M, N_out], got shape {tuple(dy.shape)}")
    M, N_out = dy.shape
    parts = 2 if act == "silu_gate" else 1
    if pre is None and (act is not None or scale is not None):
        raise ValueError(f"epilogue_grad(pre): act={act!r} or a scale needs the projection before the epilogue")
    if pre is not None and (tuple(pre.shape) != (M, parts * N_out) or str(pre.dtype) != str(dy.dtype)):
        raise ValueError(f"epilogue_grad(pre): expected {dy.dtype} [{M}, {parts * N_out}], got {pre.dtype} "
                         f"{tuple(pre.shape)}")
    if scale is not None and (len(scale.shape) != 2 or scale.shape[1] != N_out):
        raise ValueError(f"epilogue_grad(scale): expected [L, {N_out}], got shape {tuple(scale.shape)}")
    return M, N_out, parts


def _epilogue_kernel(layer_ref, dy_ref, *refs, act, has_pre, has_scale, gpu):
    """Program (i, j): rows block i, columns j*BN.. of dy; pre and dpre as [BM, parts, BN] blocks."""
    refs = list(refs)
    pre_ref = refs.pop(0) if has_pre else None
    scale_ref = refs.pop(0) if has_scale else None
    dpre_ref, *ts_ref = refs
    BN = dy_ref.shape[1]
    p = None
    if has_pre:
        halves = tuple(pre_ref[:, i, :].astype(F32) for i in range(pre_ref.shape[1]))
        p = halves if act == "silu_gate" else halves[0]
    s = scale_ref[layer_ref[0], pl.ds(pl.program_id(1) * BN, BN)].astype(F32)[None, :] if has_scale else None
    dpre, ts = epilogue_grad_math(dy_ref[...].astype(F32), p, s, act, dpre_ref.dtype, gpu)
    for i, d in enumerate(dpre):
        dpre_ref[:, i, :] = d
    if has_scale:
        ts_ref[0][...] = ts


def epilogue_grad(dy: jax.Array, pre: jax.Array | None, scale: jax.Array | None = None, layer=None, *,
                  act: str | None = None, interpret: bool | None = None):
    """The twin linear's epilogue derivative (`contract.grad`, step 2).

    dy: [M, N_out] in the linear's dtype; pre: the projection before the epilogue [M, N] in that dtype
    (N = 2 N_out for act="silu_gate"), None where act and scale are None; scale: [L, N_out] at `layer`
    (int or traced int32 scalar), or None. Returns (dpre [M, N] in dy's dtype, ts float32 [M, N_out]
    or None: the layer scale's per-row terms, for `batch_sum`). With neither act nor scale, (dy, None).
    On Mosaic GPU where `kernels_pallas.backend` says so and `twin_grad_mgpu` takes the columns.
    """
    M, N_out, parts = check_epilogue_grad(dy, pre, scale, act)
    if pre is None:
        return dy, None
    if backend.on_mosaic():
        from kernels_pallas import twin_grad_mgpu

        if twin_grad_mgpu.mosaic_takes_columns(N_out):
            return twin_grad_mgpu.epilogue_grad(dy, pre, scale, layer, act=act, interpret=interpret)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    blocks = GradBlocks.for_shapes(M, N_out, interpret)
    BM, BN = blocks.block_m, blocks.block_n
    Mp = -(-M // BM) * BM
    pad = ((0, Mp - M), (0, 0))
    tile = pl.BlockSpec((BM, BN), lambda i, j: (i, j))
    split_tile = pl.BlockSpec((BM, parts, BN), lambda i, j: (i, 0, j))
    operands = [jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1), jnp.pad(dy, pad),
                jnp.pad(pre, pad).reshape(Mp, parts, N_out)]
    in_specs = [pl.BlockSpec((1,), lambda i, j: (0,)), tile, split_tile]
    if scale is not None:
        operands.append(scale)
        in_specs.append(pl.BlockSpec(scale.shape, lambda i, j: (0, 0)))
    outs = [jax.ShapeDtypeStruct((Mp, parts, N_out), dy.dtype)]
    out_specs = [split_tile]
    if scale is not None:
        outs.append(jax.ShapeDtypeStruct((Mp, N_out), F32))
        out_specs.append(tile)
    res = pl.pallas_call(
        functools.partial(_epilogue_kernel, act=act, has_pre=True, has_scale=scale is not None, gpu=not interpret),
        out_shape=tuple(outs),
        grid=(Mp // BM, N_out // BN),
        in_specs=in_specs,
        out_specs=tuple(out_specs),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="twin_epilogue_grad",
    )(*operands)
    dpre = res[0][:M].reshape(M, parts * N_out)
    return dpre, res[1][:M] if scale is not None else None


def epilogue_grad_native(dy, pre, scale=None, layer=None, *, act=None, **_):
    """The plain jax.numpy reference of `epilogue_grad`: the same signature and bits, without Pallas."""
    _, N_out, _ = check_epilogue_grad(dy, pre, scale, act)
    if pre is None:
        return dy, None
    pf = pre.astype(F32)
    p = (pf[:, :N_out], pf[:, N_out:]) if act == "silu_gate" else pf
    s = None
    if scale is not None:
        s = lax.dynamic_index_in_dim(scale, 0 if layer is None else layer, keepdims=False).astype(F32)[None, :]
    dpre, ts = epilogue_grad_math(dy.astype(F32), p, s, act, dy.dtype, False)
    return jnp.concatenate(dpre, axis=1), ts


# -------------------------------------------------------------------------------- the batch sum
def _batch_sum_kernel(t_ref, o_ref, *, M, BN):
    cols = pl.ds(pl.program_id(0) * BN, BN)
    acc = lax.fori_loop(0, M, lambda m, acc: acc + t_ref[pl.ds(m, 1), cols].astype(F32), jnp.zeros((1, BN), F32))
    o_ref[...] = tm.to_dtype(acc, o_ref.dtype)


def check_batch_sum(t, dtype):
    """(M, N) of a batch_sum call, checked: t and the requested dtype of dtypes the twins
    compute on (`numerics.check_twin_dtype`: a float64 sum would be narrowed to float32)."""
    check_twin_dtype("batch_sum", "t", t)
    check_twin_dtype("batch_sum", "dtype", jax.ShapeDtypeStruct((), dtype))
    if len(t.shape) != 2 or t.shape[0] < 1:
        raise ValueError(f"batch_sum(t): expected [M >= 1, N], got shape {tuple(t.shape)}")
    return tuple(t.shape)


def batch_sum(t: jax.Array, dtype, *, interpret: bool | None = None) -> jax.Array:
    """Each column's sum of t [M, N] (float32 or 16-bit) over the rows: float32 from +0, rows in
    increasing order, rounded once to dtype. Returns [N] in dtype. On Mosaic GPU where
    `kernels_pallas.backend` says so and `twin_grad_mgpu` takes the columns."""
    M, N = check_batch_sum(t, dtype)
    if backend.on_mosaic():
        from kernels_pallas import twin_grad_mgpu

        if twin_grad_mgpu.mosaic_takes_columns(N):
            return twin_grad_mgpu.batch_sum(t, dtype, interpret=interpret)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    BN = GradBlocks.for_shapes(M, N, interpret).block_n
    out = pl.pallas_call(
        functools.partial(_batch_sum_kernel, M=M, BN=BN),
        out_shape=jax.ShapeDtypeStruct((1, N), dtype),
        grid=(N // BN,),
        in_specs=[pl.BlockSpec(t.shape, lambda j: (0, 0))],
        out_specs=pl.BlockSpec((1, BN), lambda j: (0, j)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="twin_batch_sum",
    )(t)
    return out[0]


def batch_sum_native(t, dtype, **_):
    """The plain jax.numpy reference of `batch_sum`: the same signature and bits, without Pallas."""
    check_batch_sum(t, dtype)
    acc = lax.fori_loop(0, t.shape[0], lambda m, acc: acc + t[m].astype(F32), jnp.zeros(t.shape[1:], F32))
    return tm.to_dtype(acc, dtype)


__all__ = ["batch_sum", "batch_sum_native", "epilogue_grad", "epilogue_grad_native"]
