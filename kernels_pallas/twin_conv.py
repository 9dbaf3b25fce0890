"""The codec's twin operations, JAX side: ELU, the convolutions and the quantizer's nearest entry;
the Triton twin in `kernels_triton.twin_conv` (the same signatures and bits), plain references
(`*_native`) beside each.

Contract (beside `twin_math`'s):

    elu(x) = x if x > 0 else exp(x) - 1, with `twin_math.exp`; rounded to x's dtype. (Not expm1:
        the contract's exp is the one both sides have.)
    conv1d (groups 1): the taps gathered, X[b * T + t, i * k + j] = x[b, i, t * stride + j * dilation]
        (exact data movement), then `twin_linear.linear(X, w.reshape(out, in * k))` (its sum
        contract: lanes over the K = in * k blocks, then the halving tree), then + bias, then +
        residual, each one rounding in x's dtype.
    conv_transpose1d: z[b, t, o, j] = sum_i x[b, i, t] w[i, o, j]: groups 1, the linear of x's
        columns with w as [out * k, in]; channel-wise (groups = in = out), one product
        x[b, c, t] * w[c, 0, j]. Then the overlap-add: tap j of frame t lands on sample
        t * stride + j; the taps, zero-padded to n * stride (n = ceil(k / stride)), cut in n blocks
        of `stride`, block h shifted by h frames, added in order h = 0, 1, ... (from block 0, not
        from +0); then + bias. Output [B, out, (T - 1) * stride + k].
    nearest(x [M, D], entries [N, D]) -> int32 [M]: per row the entry of least squared distance
        S((x - e) * (x - e)) (the linear's sum contract over D: lanes BK = `twin_lanes(D)` over the
        D / BK blocks in order from +0, then `tree_sum`); a NaN distance counts as +inf; the first
        entry among equal distances (a row of NaN: entry 0).

Every row is computed on its own: the bits do not depend on the batch. The adds between the
kernels (bias, residual, overlap-add) are single float32 operations, the same bits in XLA and
torch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kernels_pallas import backend, twin_linear
from kernels_pallas import twin_math as tm
from kernels_pallas.contract.conv import (
    ELU_BLOCK,
    carry_geometry,
    check_conv1d,
    check_conv_transpose1d,
    check_elu,
    check_nearest,
    check_signal,
    check_stream,
    check_taps,
    nearest_plan,
    next_pow2,
    taps_plan,
)
from kernels_pallas.contract.numerics import twin_lanes


def _elu_f32(x, gpu: bool):
    return jnp.where(x > tm.F32(0.0), x, tm.exp(x, gpu) - tm.F32(1.0))


def _elu_kernel(x_ref, o_ref, *, gpu):
    o_ref[...] = tm.to_dtype(_elu_f32(x_ref[...].astype(tm.F32), gpu), o_ref.dtype)


def _check_float(who: str, name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{who}({name}): expected a float array, got {x.dtype}")


def elu(x: jax.Array, *, interpret: bool | None = None) -> jax.Array:
    """The contract's ELU of every element of x (any shape, float); x's shape and dtype. On Mosaic GPU
    where `kernels_pallas.backend` says so (`twin_conv_mgpu.elu`)."""
    check_elu(x)
    if backend.on_mosaic():
        from kernels_pallas import twin_conv_mgpu

        return twin_conv_mgpu.elu(x, interpret=interpret)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    flat = x.reshape(-1)
    n = flat.shape[0]
    padded = -(-n // ELU_BLOCK) * ELU_BLOCK
    block = padded if interpret else ELU_BLOCK
    out = pl.pallas_call(
        functools.partial(_elu_kernel, gpu=not interpret),
        out_shape=jax.ShapeDtypeStruct((padded,), x.dtype),
        grid=(padded // block,),
        in_specs=[pl.BlockSpec((block,), lambda i: (i,))],
        out_specs=pl.BlockSpec((block,), lambda i: (i,)),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="twin_elu",
    )(jnp.pad(flat, (0, padded - n)))
    return out[:n].reshape(x.shape)


def elu_native(x, **_):
    """The plain jax.numpy reference of `elu`: the same signature and bits."""
    check_elu(x)
    return tm.to_dtype(_elu_f32(x.astype(tm.F32), False), x.dtype)


def _activation(x, elu: bool, gpu: bool):
    """x as the convolution reads it: the contract's ELU rounded to x's dtype (elu), else x."""
    return tm.to_dtype(_elu_f32(x.astype(tm.F32), gpu), x.dtype) if elu else x


def _taps_kernel(*refs, C, L, W, ROW, OFF, k, stride, dilation, T, RT, CH, BC, elu, replicate, gpu):
    """Program (b, tile, block): rows tile * RT.. of batch row b's tap matrix, the columns of channels
    block * CH.. (every tap of each; `taps_plan`).

    The source is [carry, act(x)] (W + L samples a channel; act: the ELU where asked), the carry's
    samples replaced by the row's first act(x) sample where `replicate` and the row is first and
    active. Loads are clamped in bounds (a value read past the source is never selected); stores
    past the matrix are masked (their index made out of bounds: interpreted, a masked store writes
    back what it read). Program (b, 0, block) holds every row that reads its channels' carry
    (`taps_plan`), the only program that reads it, and then writes their new carry in place: its last
    W source samples where the row is active. The carry of batch row b, channel i, sample w is element
    b * ROW + OFF + i * W + w of the carry array (a [B, C, W] carry: ROW = C * W, OFF = 0; a row-packed
    state: its row length and this convolution's offset)."""
    if W:
        flags_ref, x_ref, carry_ref, cols_ref, carry_out_ref = refs
    else:
        x_ref, cols_ref = refs
    b, tile, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    one = jnp.arange(1, dtype=jnp.int32)
    if W:
        active = pltriton.load(flags_ref.at[2 * b + one]) != 0                              # [1]
        pad_first = (pltriton.load(flags_ref.at[2 * b + 1 + one]) != 0) & active if replicate else None

    def x_at(i, p):
        return _activation(pltriton.load(x_ref.at[(b * C + i) * L + jnp.clip(p, 0, L - 1)]), elu, gpu)

    def source(i, pos):  # [carry, act(x)] at channel i, position pos (int32 arrays of one shape)
        value = x_at(i, pos - W)
        if not W:
            return value
        old = pltriton.load(carry_ref.at[b * ROW + OFF + i * W + jnp.clip(pos, 0, W - 1)])
        if replicate:
            old = jnp.where(pad_first, x_at(i, jnp.zeros_like(pos)), old)
        return jnp.where(pos < W, old, value)

    columns = C * k
    t = tile * RT + jnp.arange(RT, dtype=jnp.int32)[:, None]                                 # [RT, 1]
    c = block * (CH * k) + jnp.arange(BC, dtype=jnp.int32)[None, :]                          # [1, BC]
    ok = (t < T) & (c < jnp.minimum((block + 1) * (CH * k), columns))
    i, j = jnp.minimum(c, columns - 1) // k, c % k
    value = source(i, jnp.minimum(t, T - 1) * stride + j * dilation)
    at = jnp.where(ok, (b * T + t) * columns + c, cols_ref.shape[0])
    pltriton.store(cols_ref.at[at], value, mask=ok)
    if not W:
        return

    @pl.when(tile == 0)
    def _carry():
        e = block * (CH * W) + jnp.arange(next_pow2(CH * W), dtype=jnp.int32)
        ok = (e < (block + 1) * (CH * W)) & (e < C * W)
        i, w = jnp.minimum(e, C * W - 1) // W, e % W
        old = pltriton.load(carry_ref.at[b * ROW + OFF + i * W + w])
        new = jnp.where(active, source(i, L + w), old)
        if gpu:  # every thread's reads of the old carry (above and the taps') before any write
            pltriton.debug_barrier()
        pltriton.store(carry_out_ref.at[jnp.where(ok, b * ROW + OFF + e, carry_out_ref.shape[0])], new, mask=ok)


def taps(x: jax.Array, *, kernel_size: int, stride: int = 1, dilation: int = 1, elu: bool = False,
         carry: jax.Array | None = None, carry_slot: tuple[int, int] | None = None, active: jax.Array | None = None,
         first: jax.Array | None = None, replicate: bool = False, interpret: bool | None = None):
    """The tap matrix of a convolution over [carry, act(x)], one kernel: X [B * T, in * k],
    X[b * T + t, i * k + j] = src[b, i, t * stride + j * dilation] (module docstring), act the
    contract's ELU where `elu`. Without carry returns X; with carry [B, in, W] (W > 0), or a
    row-packed state [B, N] holding it at `carry_slot` = (offset, W) (`contract.conv.check_stream`),
    returns (X, the new carry array), the carry updated in place (`input_output_aliases`: pass an
    array you no longer need; the rest of a packed state is left as it is). active, first: bool [B]
    (None: every row active, none first). Where `kernels_pallas.backend` says Mosaic GPU: its ELU kernel, then
    XLA's gather (`twin_conv_mgpu.taps`, the same bits)."""
    B, C, L = check_signal("taps", x)
    check_stream("taps", x, carry, active, first, replicate, carry_slot)
    if backend.on_mosaic():
        from kernels_pallas import twin_conv_mgpu

        return twin_conv_mgpu.taps(x, kernel_size=kernel_size, stride=stride, dilation=dilation, elu=elu, carry=carry,
                                   carry_slot=carry_slot, active=active, first=first, replicate=replicate,
                                   interpret=interpret)
    W, ROW, OFF = carry_geometry(x, carry, carry_slot)
    T = check_taps(kernel_size, stride, dilation, W + L)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    RT, CH, BC = taps_plan(T, C, kernel_size, W, stride)
    kernel = functools.partial(_taps_kernel, C=C, L=L, W=W, ROW=ROW, OFF=OFF, k=kernel_size, stride=stride,
                               dilation=dilation, T=T, RT=RT, CH=CH, BC=BC, elu=elu, replicate=replicate,
                               gpu=not interpret)
    cols = jax.ShapeDtypeStruct((B * T * C * kernel_size,), x.dtype)
    operands, out_shape, aliases = [x.reshape(-1)], (cols,), {}
    if W:
        active = jnp.ones(B, bool) if active is None else active
        first = jnp.zeros(B, bool) if first is None else first
        flags = jnp.stack([active, first], axis=1).astype(jnp.int32).reshape(-1)          # [2B]: active, first
        operands = [flags, operands[0], carry.reshape(-1)]
        out_shape, aliases = (cols, jax.ShapeDtypeStruct((B * ROW,), x.dtype)), {2: 1}
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(B, -(-T // RT), -(-C // CH)),
        in_specs=[_whole(a) for a in operands],
        out_specs=tuple(_whole(o) for o in out_shape),
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="twin_conv_taps",
    )(*operands)
    X = outs[0].reshape(B * T, C * kernel_size)
    return (X, outs[1].reshape(carry.shape)) if W else X


def _whole(a):
    """A BlockSpec giving the kernel the whole (flat) array, indexed in place inside."""
    return pl.BlockSpec(a.shape, lambda *_: (0,) * len(a.shape))


def taps_native(x, *, kernel_size, stride=1, dilation=1, elu=False, carry=None, carry_slot=None, active=None,
                first=None, replicate=False, **_):
    """The plain jax.numpy reference of `taps`: the same signature and bits (no carry written in place)."""
    B, C, _ = check_signal("taps", x)
    check_stream("taps", x, carry, active, first, replicate, carry_slot)
    if carry_slot is not None:  # the convolution's carry out of the packed state, and back into it after
        (offset, width), packed = carry_slot, carry
        X, new = taps_native(x, kernel_size=kernel_size, stride=stride, dilation=dilation, elu=elu,
                             carry=packed[:, offset:offset + C * width].reshape(B, C, width), active=active,
                             first=first, replicate=replicate)
        return X, packed.at[:, offset:offset + C * width].set(new.reshape(B, C * width))
    x = elu_native(x) if elu else x
    new = None
    if carry is not None:
        rows = (jnp.ones(B, bool) if active is None else active)[:, None, None]
        old = carry
        if replicate:
            carry = jnp.where((jnp.zeros(B, bool) if first is None else first)[:, None, None] & rows, x[..., :1],
                              carry)
        x = jnp.concatenate([carry, x], axis=-1)
        new = jnp.where(rows, x[..., x.shape[-1] - old.shape[-1]:], old)
    T = (x.shape[-1] - (kernel_size - 1) * dilation - 1) // stride + 1
    at = jnp.arange(T)[:, None] * stride + jnp.arange(kernel_size)[None, :] * dilation       # [T, k]
    X = x[:, :, at].transpose(0, 2, 1, 3).reshape(B * T, C * kernel_size)
    return X if new is None else (X, new)


def _conv1d(x, w, bias, residual, stride, dilation, elu, carry, slot, active, first, replicate, linear, make_taps):
    width = check_stream("conv1d", x, carry, active, first, replicate, slot)
    B, cin, _, cout, k, T = check_conv1d(x, w, bias, residual, stride, dilation, width)
    if k == 1 and stride == 1 and not elu and carry is None:  # the columns as they are: no taps kernel
        cols, new = x.transpose(0, 2, 1).reshape(B * T, cin), None
    else:
        out = make_taps(x, kernel_size=k, stride=stride, dilation=dilation, elu=elu, carry=carry, carry_slot=slot,
                        active=active, first=first, replicate=replicate)
        cols, new = out if carry is not None else (out, None)
    y = linear(cols, w.reshape(cout, cin * k)).reshape(B, T, cout).transpose(0, 2, 1)
    if bias is not None:
        y = y + bias[:, None]
    y = y if residual is None else y + residual
    return y if carry is None else (y, new)


def conv1d(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, stride: int = 1, dilation: int = 1,
           residual: jax.Array | None = None, elu: bool = False, carry: jax.Array | None = None,
           carry_slot: tuple[int, int] | None = None, active: jax.Array | None = None, first: jax.Array | None = None,
           replicate: bool = False, interpret: bool | None = None):
    """The contract's convolution, unpadded: x [B, in, L], w [out, in, k], bias [out] -> [B, out, T],
    T = (W + L - (k - 1) * dilation - 1) // stride + 1; residual [B, out, T] added last.

    elu: the contract's ELU on x first (in the taps kernel). carry [B, in, W] (a streamed left
    context, holding values past the ELU): the convolution runs over [carry, act(x)] and returns
    (y, new carry): the last W samples for the rows of `active` (bool [B], None: all), the old carry
    for the others; written in place (donate it). carry_slot: (offset, W), the carry held in a
    row-packed state [B, N] (`taps`), which is returned whole. replicate: rows that are `first` and active take
    their first sample as their carry first (the downsample's replicate padding). Two kernels: the
    taps (`taps`) and the linear."""
    return _conv1d(x, w, bias, residual, stride, dilation, elu, carry, carry_slot, active, first, replicate,
                   functools.partial(twin_linear.linear, interpret=interpret),
                   functools.partial(taps, interpret=interpret))


def conv1d_native(x, w, bias=None, *, stride=1, dilation=1, residual=None, elu=False, carry=None, carry_slot=None,
                  active=None, first=None, replicate=False, **_):
    """The plain jax.numpy reference of `conv1d`: the same signature and bits."""
    return _conv1d(x, w, bias, residual, stride, dilation, elu, carry, carry_slot, active, first, replicate,
                   functools.partial(twin_linear.linear_native, form="lanes"), taps_native)


def _conv_transpose1d(x, w, bias, stride, groups, elu, linear, make_taps):
    B, cin, T, cout, k = check_conv_transpose1d(x, w, bias, stride, groups)
    if groups == 1 or elu:
        rows = make_taps(x, kernel_size=1, elu=elu)                                          # [B*T, in]
    if groups == 1:
        z = linear(rows, w.transpose(1, 2, 0).reshape(cout * k, cin)).reshape(B, T, cout, k)
    else:
        x = rows.reshape(B, T, cin) if elu else x.transpose(0, 2, 1)
        # [B, T, C, k], each product rounded on its own (no FMA with the adds after it)
        z = tm.mul(x[..., None], w[:, 0][None, None], False).astype(x.dtype)
    n = -(-k // stride)
    z = jnp.pad(z, ((0, 0), (0, 0), (0, 0), (0, n * stride - k))).reshape(B, T, cout, n, stride)
    y = None
    for h in range(n):
        block = jnp.pad(z[:, :, :, h], ((0, 0), (h, n - 1 - h), (0, 0), (0, 0)))     # [B, T+n-1, out, stride]
        y = block if y is None else y + block
    y = y.transpose(0, 2, 1, 3).reshape(B, cout, (T + n - 1) * stride)[..., :(T - 1) * stride + k]
    return y if bias is None else y + bias[:, None]


def conv_transpose1d(x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, stride: int = 1, groups: int = 1,
                     elu: bool = False, interpret: bool | None = None) -> jax.Array:
    """The contract's transposed convolution, unpadded: x [B, in, T], w [in, out / groups, k] (groups 1
    or channel-wise), bias [out] -> [B, out, (T - 1) * stride + k]. elu: the contract's ELU on x
    first, in the kernel that lays x's columns out as the linear's rows (`taps`, kernel 1)."""
    return _conv_transpose1d(x, w, bias, stride, groups, elu, functools.partial(twin_linear.linear, interpret=interpret),
                             functools.partial(taps, interpret=interpret))


def conv_transpose1d_native(x, w, bias=None, *, stride=1, groups=1, elu=False, **_):
    """The plain jax.numpy reference of `conv_transpose1d`: the same signature and bits."""
    return _conv_transpose1d(x, w, bias, stride, groups, elu,
                             functools.partial(twin_linear.linear_native, form="lanes"), taps_native)


def _distances(x_blocks, e_block, gpu):
    """S((x - e)^2) of the contract for BN entries: x_blocks, the row's D / BK blocks [1, BK] float32;
    e_block(kb) -> the entries' block kb [BN, BK] float32. Returns [BN], NaN as +inf."""
    acc = None
    for kb, xb in enumerate(x_blocks):
        d = xb - e_block(kb)
        p = tm.mul(d, d, gpu)
        acc = jnp.zeros_like(p) + p if acc is None else acc + p
    dist = tm.tree_sum(acc)[:, 0]
    return jnp.where(jnp.isnan(dist), tm.F32(jnp.inf), dist)


def _first_min(dist, first, N):
    """(the least of dist [BN], the first index where it is), indexes from `first`."""
    best = jnp.min(dist)
    index = jnp.min(jnp.where(dist == best, first + jnp.arange(dist.shape[0], dtype=jnp.int32), N))
    return best, index


def _nearest_kernel(x_ref, e_ref, best_ref, arg_ref, *, N, D, split, BN, BK, gpu):
    """Program (m, s): the first least entry of row m among entries s * split.. (`nearest_plan`)."""
    x_blocks = [x_ref[:, pl.ds(kb * BK, BK)].astype(tm.F32) for kb in range(D // BK)]   # [1, BK] each
    start = pl.program_id(1) * split

    def block(nb, carry):
        best, arg = carry
        dist = _distances(x_blocks, lambda kb: e_ref[pl.ds(nb * BN, BN), pl.ds(kb * BK, BK)].astype(tm.F32), gpu)
        m, i = _first_min(dist, start + nb * BN, N)
        take = m < best  # strict: an equal distance in a later block keeps the earlier entry
        return jnp.where(take, m, best), jnp.where(take, i, arg)

    best, arg = lax.fori_loop(0, split // BN, block, (tm.F32(jnp.inf), start))
    best_ref[...] = jnp.full(best_ref.shape, best, tm.F32)
    arg_ref[...] = jnp.full(arg_ref.shape, arg, jnp.int32)


def nearest(x: jax.Array, entries: jax.Array, *, split: int | None = None, interpret: bool | None = None) -> jax.Array:
    """The contract's nearest entry of each row: x [M, D], entries [N, D] -> int32 [M]. split: the
    entries a program searches (`contract.conv.nearest_plan`; speed only). On Mosaic GPU where
    `kernels_pallas.backend` says so and `twin_conv_mgpu.mosaic_takes_nearest`."""
    M, N, D = check_nearest(x, entries)
    split, BN = nearest_plan(N, split)
    if backend.on_mosaic():
        from kernels_pallas import twin_conv_mgpu

        if twin_conv_mgpu.mosaic_takes_nearest(N, D, split):
            return twin_conv_mgpu.nearest(x, entries, split=split, interpret=interpret)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    S = N // split
    best, arg = pl.pallas_call(
        functools.partial(_nearest_kernel, N=N, D=D, split=split, BN=BN, BK=twin_lanes(D), gpu=not interpret),
        out_shape=(jax.ShapeDtypeStruct((M, S), tm.F32), jax.ShapeDtypeStruct((M, S), jnp.int32)),
        grid=(M, S),
        in_specs=[pl.BlockSpec((1, D), lambda m, s: (m, 0)), pl.BlockSpec((split, D), lambda m, s: (s, 0))],
        out_specs=(pl.BlockSpec((1, 1), lambda m, s: (m, s)), pl.BlockSpec((1, 1), lambda m, s: (m, s))),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        name="twin_nearest",
    )(x, entries)
    return _first_least(best, arg, N)


def _first_least(best, arg, N):
    """The first entry among the least of [M, S] distances `best` at entries `arg` (the programs' or
    every entry's; broadcast to best): exact, any split."""
    least = jnp.min(best, axis=1, keepdims=True)
    return jnp.min(jnp.where(best == least, arg, N), axis=1)


def nearest_native(x, entries, **_):
    """The plain jax.numpy reference of `nearest`: the same signature and bits."""
    _, N, D = check_nearest(x, entries)
    BK = twin_lanes(D)
    xf, ef = x.astype(tm.F32), entries.astype(tm.F32)
    dist = jax.vmap(lambda row: _distances([row[None, kb * BK:(kb + 1) * BK] for kb in range(D // BK)],
                                           lambda kb: ef[:, kb * BK:(kb + 1) * BK], False))(xf)   # [M, N]
    return _first_least(dist, jnp.arange(N, dtype=jnp.int32)[None, :], N)
