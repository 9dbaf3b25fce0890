"""The codec's twin operations (`kernels_pallas.twin_conv`, `kernels_triton.twin_conv`): Pallas and
Triton give the same bits as each other and as their plain references, in float32 and bfloat16 at
odd sizes, whatever the batch; bad arguments are refused naming them."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

from kernels_pallas import twin_conv as pallas
from kernels_pallas.contract.conv import TAPS_COLS, taps_plan
from kernels_triton import twin_conv as triton_twin
from torch_bridge.dlpack import to_jax

DTYPES = (torch.float32, torch.bfloat16)


def host(a) -> np.ndarray:
    """A torch tensor or a JAX array on the host (bfloat16 as float32: exact)."""
    if isinstance(a, torch.Tensor):
        return (a.float() if a.dtype == torch.bfloat16 else a).numpy()
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype.name == "bfloat16" else a


def same(*values) -> bool:
    """Bit for bit (floats: their bits; a NaN matches a NaN: payloads are not part of the contract)."""
    first = host(values[0])
    for v in values[1:]:
        v = host(v)
        if first.dtype != v.dtype or first.shape != v.shape:
            return False
        if first.dtype.kind == "f":
            nan = np.isnan(first)
            if not (np.array_equal(nan, np.isnan(v)) and np.array_equal(first[~nan].view(np.uint32),
                                                                        v[~nan].view(np.uint32))):
                return False
        elif not np.array_equal(first, v):
            return False
    return True


def jitted(fn, **static):
    """fn jitted with its keyword arguments bound (one compile, not one per eager operation)."""
    return jax.jit(functools.partial(fn, **static))


def randn(*shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def cast(a, name: str):
    """a in dtype `name`, in its framework: a JAX array as a numpy array (JAX would narrow float64)."""
    if isinstance(a, torch.Tensor):
        return a.to(getattr(torch, name))
    return np.asarray(a).astype(jax.numpy.dtype(name))


@pytest.mark.parametrize("dtype", DTYPES)
def test_elu(dtype):
    x = randn(3, 5, 37, dtype=dtype, seed=1, scale=4.0)
    x[0, 0, :3] = torch.tensor([float("nan"), -100.0, 0.0])
    got = triton_twin.elu(x)
    assert same(got, jitted(pallas.elu)(to_jax(x)), jitted(pallas.elu_native)(to_jax(x)), triton_twin.elu_native(x))
    assert got.dtype == dtype and got.shape == x.shape and torch.isnan(got[0, 0, 0]) and got[0, 0, 1] == -1
    torch.testing.assert_close(got.float(), torch.nn.functional.elu(x.float()).to(dtype).float(),
                               rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize(("dtype", "stride", "dilation", "k"), [(torch.float32, 5, 1, 10), (torch.bfloat16, 1, 3, 3),
                                                                (torch.float32, 1, 1, 1)])
def test_conv1d(dtype, stride, dilation, k):
    x, w = randn(3, 5, 29, dtype=dtype, seed=2), randn(6, 5, k, dtype=dtype, seed=3, scale=0.3)
    bias = randn(6, dtype=dtype, seed=4)
    T = (29 - (k - 1) * dilation - 1) // stride + 1
    residual = randn(3, 6, T, dtype=dtype, seed=5)
    args = {"stride": stride, "dilation": dilation}
    got = triton_twin.conv1d(x, w, bias, residual=residual, **args)
    jx, jw, jb, jr = map(to_jax, (x, w, bias, residual))
    assert same(got, jitted(pallas.conv1d, **args)(jx, jw, jb, residual=jr),
                jitted(pallas.conv1d_native, **args)(jx, jw, jb, residual=jr))
    want = torch.nn.functional.conv1d(x.float(), w.float(), bias.float(), stride, 0, dilation) + residual.float()
    torch.testing.assert_close(got.float(), want, rtol=1e-5 if dtype == torch.float32 else 5e-2,
                               atol=1e-5 if dtype == torch.float32 else 5e-2)
    # batch invariance: a row alone has the bits it has among the others
    assert same(triton_twin.conv1d(x[1:2], w, bias, residual=residual[1:2], **args), got[1:2])
    assert same(jitted(pallas.conv1d, **args)(jx[1:2], jw, jb, residual=jr[1:2]), got[1:2])


@pytest.mark.parametrize(("dtype", "stride", "dilation", "k", "L", "replicate", "cin"), [
    (torch.float32, 1, 1, 7, 2, False, 75),    # the frame shorter than the carry (the decoder's first conv)
    (torch.bfloat16, 1, 2, 3, 11, False, 5),   # dilated, a residual block's
    (torch.bfloat16, 4, 1, 8, 12, False, 5),   # strided (a SEANet stage's)
    (torch.float32, 2, 1, 4, 2, True, 130),    # the downsample's replicate padding
])
def test_streamed_conv1d(dtype, stride, dilation, k, L, replicate, cin):
    """The ELU, the carry and the residual fused (`taps`): Pallas == Triton == both references == the
    unfused form (the ELU, the concatenation, the carry's update and the convolution one by one).
    cin * k over `TAPS_COLS` columns: the taps and the carry run in blocks of whole channels."""
    width = (k - 1) * dilation + 1 - stride
    x, w = randn(3, cin, L, dtype=dtype, seed=11, scale=2.0), randn(6, cin, k, dtype=dtype, seed=12, scale=0.3)
    bias, carry = randn(6, dtype=dtype, seed=13), randn(3, cin, width, dtype=dtype, seed=14)
    active, first = torch.tensor([True, False, True]), torch.tensor([True, True, False])
    T = (width + L - (k - 1) * dilation - 1) // stride + 1
    assert (taps_plan(T, cin, k, width, stride)[1] < cin) == (cin * k > TAPS_COLS)
    residual = randn(3, 6, T, dtype=dtype, seed=15)
    args = {"stride": stride, "dilation": dilation, "elu": not replicate, "replicate": replicate}
    y, new = triton_twin.conv1d(x, w, bias, residual=residual, carry=carry, active=active, first=first, **args)
    j = list(map(to_jax, (x, w, bias, residual, carry, active, first)))
    for fn in (pallas.conv1d, pallas.conv1d_native):
        got = jitted(fn, **args)(j[0], j[1], j[2], residual=j[3], carry=j[4] + 0, active=j[5], first=j[6])
        assert same(got[0], y) and same(got[1], new)
    assert all(map(same, triton_twin.conv1d_native(x, w, bias, residual=residual, carry=carry, active=active,
                                                   first=first, **args), (y, new)))
    h = triton_twin.elu(x) if args["elu"] else x
    start = torch.where((first & active).view(-1, 1, 1), h[..., :1], carry) if replicate else carry
    full = torch.cat([start, h], dim=-1)
    assert same(y, triton_twin.conv1d(full, w, bias, residual=residual, stride=stride, dilation=dilation))
    assert same(new, torch.where(active.view(-1, 1, 1), full[..., -width:], carry))
    # batch invariance: a row alone has the bits it has among the others
    alone = triton_twin.conv1d(x[2:], w, bias, residual=residual[2:], carry=carry[2:], active=active[2:],
                               first=first[2:], **args)
    assert same(alone[0], y[2:]) and same(alone[1], new[2:])
    # the carry held in a row-packed state at an offset (`carry_slot`): the same bits, the rest untouched
    n, slot = cin * width, (4, width)
    packed = randn(3, n + 9, dtype=dtype, seed=16)
    packed[:, 4:4 + n] = carry.reshape(3, n)
    want = packed.clone()
    want[:, 4:4 + n] = new.reshape(3, n)
    for fn in (triton_twin.conv1d, triton_twin.conv1d_native):
        got = fn(x, w, bias, residual=residual, carry=packed, carry_slot=slot, active=active, first=first, **args)
        assert same(got[0], y) and same(got[1], want)
    for fn in (pallas.conv1d, pallas.conv1d_native):
        got = jitted(fn, carry_slot=slot, **args)(j[0], j[1], j[2], residual=j[3], carry=to_jax(packed), active=j[5],
                                                 first=j[6])
        assert same(got[0], y) and same(got[1], want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_transpose1d_elu(dtype):
    """The ELU fused into the kernel laying x's columns out: the bits of the ELU kernel first."""
    x, bias = randn(2, 5, 3, dtype=dtype, seed=16, scale=2.0), randn(7, dtype=dtype, seed=18)
    for w, groups in ((randn(5, 7, 8, dtype=dtype, seed=17, scale=0.3), 1), (randn(5, 1, 4, dtype=dtype, seed=19), 5)):
        b = bias if groups == 1 else bias[:5]
        got = triton_twin.conv_transpose1d(x, w, b, stride=4, groups=groups, elu=True)
        assert same(got, triton_twin.conv_transpose1d(triton_twin.elu(x), w, b, stride=4, groups=groups))
        jx, jw, jb = map(to_jax, (x, w, b))
        for fn in (pallas.conv_transpose1d, pallas.conv_transpose1d_native):
            assert same(got, jitted(fn, stride=4, groups=groups, elu=True)(jx, jw, jb))


@pytest.mark.parametrize(("dtype", "stride", "k", "groups"), [(torch.float32, 3, 7, 1), (torch.bfloat16, 4, 8, 1),
                                                              (torch.float32, 2, 4, 5), (torch.bfloat16, 5, 3, 1)])
def test_conv_transpose1d(dtype, stride, k, groups):
    x = randn(3, 5, 9, dtype=dtype, seed=6)
    w = randn(5, 1 if groups > 1 else 7, k, dtype=dtype, seed=7, scale=0.3)
    bias = randn(5 if groups > 1 else 7, dtype=dtype, seed=8)
    got = triton_twin.conv_transpose1d(x, w, bias, stride=stride, groups=groups)
    jx, jw, jb = map(to_jax, (x, w, bias))
    args = {"stride": stride, "groups": groups}
    assert same(got, jitted(pallas.conv_transpose1d, **args)(jx, jw, jb),
                jitted(pallas.conv_transpose1d_native, **args)(jx, jw, jb))
    want = torch.nn.functional.conv_transpose1d(x.float(), w.float(), bias.float(), stride, groups=groups)
    torch.testing.assert_close(got.float(), want, rtol=1e-5 if dtype == torch.float32 else 5e-2,
                               atol=1e-5 if dtype == torch.float32 else 5e-2)
    assert same(triton_twin.conv_transpose1d(x[2:], w, bias, stride=stride, groups=groups), got[2:])


@pytest.mark.parametrize(("dtype", "N", "D", "split"), [(torch.float32, 64, 24, 16), (torch.bfloat16, 13, 8, None)])
def test_nearest(dtype, N, D, split):
    """The first least entry of each row, the same on both sides and in both references, whatever the
    entries a program searches: the tie below spans two programs (split 16 of 64; 13 entries: 13
    programs of one by default), and one program for the whole row gives the same codes."""
    x, entries = randn(6, D, dtype=dtype, seed=9), randn(N, D, dtype=dtype, seed=10)
    entries[N - 1] = entries[1]  # a tie: the first entry wins
    x[2] = entries[1]
    x[3, 0] = float("nan")  # a NaN row: entry 0
    got = triton_twin.nearest(x, entries, split=split)
    jx, je = to_jax(x), to_jax(entries)
    assert got.dtype == torch.int32
    assert same(got, jitted(pallas.nearest, split=split)(jx, je), jitted(pallas.nearest_native)(jx, je),
                triton_twin.nearest_native(x, entries), triton_twin.nearest(x, entries, split=N),
                jitted(pallas.nearest, split=N)(jx, je))
    assert got[2] == 1 and got[3] == 0
    dist = torch.cdist(x.float()[[0, 1, 4, 5]], entries.float())
    assert torch.equal(got[[0, 1, 4, 5]].long(), dist.argmin(dim=1))
    assert same(triton_twin.nearest(x[4:5], entries), got[4:5]) and same(jitted(pallas.nearest)(jx[4:5], je), got[4:5])


@pytest.mark.parametrize(("call", "error", "message"), [
    (lambda m, x: m.conv1d(x, x[:, :3]), ValueError, r"conv1d\(w\): expected \[out, in=5, k\]"),
    (lambda m, x: m.conv1d(x, x[:, :, :2], stride=0), ValueError, r"conv1d\(stride\)"),
    (lambda m, x: m.conv1d(x[0], x), ValueError, r"conv1d\(x\): expected \[B, in, L\]"),
    (lambda m, x: m.conv_transpose1d(x, x[:, :1], groups=2), ValueError, r"conv_transpose1d\(groups\)"),
    (lambda m, x: m.nearest(x[0], x[0, :0]), ValueError, r"nearest\(entries\)"),
    (lambda m, x: m.nearest(x[0], x[0], split=2), ValueError, r"nearest\(split\): expected a positive divisor of the 5"),
    (lambda m, x: m.conv1d(x, x, carry=x[:, :2]), ValueError, r"conv1d\(carry\): expected \[B=5, in=5, W > 0\]"),
    (lambda m, x: m.conv1d(x, x[..., :3], carry=x[..., :0]), ValueError,
     r"conv1d\(carry\): expected \[B=5, in=5, W > 0\], got shape \(5, 5, 0\)"),
    (lambda m, x: m.taps(x, kernel_size=3, carry=x[..., :0]), ValueError, r"taps\(carry\): expected \[B=5, in=5, W > 0\]"),
    (lambda m, x: m.taps_native(x, kernel_size=3, carry=x[..., :0]), ValueError, r"taps\(carry\): expected \[B=5"),
    (lambda m, x: m.conv1d(x[..., :0], x[..., :3], carry=x), ValueError,
     r"conv1d\(x\): expected at least one sample \(L\), got shape \(5, 5, 0\)"),
    (lambda m, x: m.taps(x[..., :0], kernel_size=3, carry=x), ValueError, r"taps\(x\): expected at least one sample"),
    (lambda m, x: m.conv1d(x, x[..., :3], cast(x[0, 0], "float64")), TypeError,
     r"conv1d\(bias\): dtype \S*float64 differs from x's \S*float32"),
    (lambda m, x: m.conv1d(cast(x, "bfloat16"), cast(x[..., :3], "bfloat16"), x[0, 0]), TypeError,
     r"conv1d\(bias\): dtype \S*float32 differs from x's \S*bfloat16"),
    (lambda m, x: m.conv1d(x, x[..., :3], residual=cast(x[..., :3], "float64")), TypeError,
     r"conv1d\(residual\): dtype \S*float64 differs from x's \S*float32"),
    (lambda m, x: m.conv_transpose1d(x, x[:, :1], cast(x[0, 0], "float64"), groups=5), TypeError,
     r"conv_transpose1d\(bias\): dtype \S*float64 differs from x's \S*float32"),
    (lambda m, x: m.conv_transpose1d(cast(x, "float64"), cast(x[:, :1], "float64"), groups=5), TypeError,
     r"conv_transpose1d\(x\): expected one of float32, bfloat16, float16, got float64"),
    (lambda m, x: m.conv_transpose1d(cast(x, "int32"), cast(x[:, :1], "int32"), groups=5), TypeError,
     r"conv_transpose1d\(x\): expected one of .*, got int32"),
    (lambda m, x: m.conv_transpose1d(cast(x, "float64"), cast(x, "float64")), TypeError,
     r"conv_transpose1d\(x\): expected one of .*, got float64"),
    (lambda m, x: m.elu(cast(x, "float64")), TypeError, r"elu\(x\): expected one of .*, got float64"),
    (lambda m, x: m.elu_native(cast(x, "int32")), TypeError, r"elu\(x\): expected one of .*, got int32"),
    (lambda m, x: m.taps(cast(x, "float64"), kernel_size=3, elu=True), TypeError,
     r"taps\(x\): expected one of .*, got float64"),
    (lambda m, x: m.conv1d(x, x, active=x[:, 0, 0] > 0), ValueError, r"conv1d\(carry\): active, first"),
    (lambda m, x: m.conv1d(x, x, carry=x, replicate=True), ValueError, r"conv1d\(first\)"),
    (lambda m, x: m.conv1d(x, x, carry=x[:, :, 0], carry_slot=(3, 1)), ValueError,
     r"conv1d\(carry\): with carry_slot=\(3, 1\) expected a row-packed \[B=5, N >= 8\]"),
    (lambda m, x: m.conv1d(x, x, carry=x[:, :, 0], carry_slot=(0, 0)), ValueError, r"conv1d\(carry_slot\): expected"),
    (lambda m, x: m.conv1d(x, x, carry_slot=(0, 1)), ValueError,
     r"conv1d\(carry\): active, first, replicate and carry_slot"),
])
def test_bad_arguments_name_them(call, error, message):
    x = randn(5, 5, 5, dtype=torch.float32, seed=0)
    for module, arg in ((triton_twin, x), (pallas, to_jax(x))):
        with pytest.raises(error, match=message):
            call(module, arg)


# Run in a process of its own without TRITON_INTERPRET, where the kernels are Triton's JIT functions.
_COMPILE_FOR_H200 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels_pallas.contract.conv import ELU_BLOCK, nearest_plan, next_pow2, taps_plan
from kernels_pallas.contract.numerics import twin_lanes
from kernels_triton import twin_conv

def compile_for_h200(fn, types, constants):
    names = fn.arg_names
    signature = {n: types.get(n, "constexpr") for n in names}
    constexprs = {(names.index(k),): v for k, v in constants.items()}
    triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "enable_fp_fusion": False})

compiled = 0
for C, L, W, k, stride, elu, replicate in {GEOMETRIES}:
    T = (W + L - k) // stride + 1
    RT, CH, BC = taps_plan(T, C, k, W, stride)
    compile_for_h200(twin_conv._taps_kernel,
                     dict(x_ptr="*bf16", carry_ptr="*bf16", flags_ptr="*i32", cols_ptr="*bf16", carry_out_ptr="*bf16"),
                     dict(C=C, L=L, W=W, ROW=C * W + 7, OFF=7 if W else 0, K=k, STRIDE=stride, DILATION=1, T=T,
                          RT=RT, CH=CH, BC=BC, NW=next_pow2(CH * W), ELU=elu, REPLICATE=replicate, INTERPRETED=False))
    compiled += 1
compile_for_h200(twin_conv._elu_kernel, dict(x_ptr="*bf16", o_ptr="*bf16", n="i32"),
                 dict(BLOCK=ELU_BLOCK, INTERPRETED=False))
split, BN = nearest_plan(2048)
compile_for_h200(twin_conv._nearest_kernel, dict(x_ptr="*bf16", e_ptr="*bf16", best_ptr="*fp32", arg_ptr="*i32"),
                 dict(N=2048, D=256, S=2048 // split, SPLIT=split, BN=BN, BK=twin_lanes(256)))
print("compiled", compiled + 2)
"""


def test_codec_triton_kernels_compile_for_an_h200():
    """The interpreter runs a Triton kernel as Python and misses what only the compiler refuses (a name
    given another shape inside a branch once kept the taps kernel from compiling for the GPU): each of
    the codec's Triton kernels, every code path of the taps (no carry, a carry, one longer than the
    frame in channel blocks, replicate padding, with and without the ELU) at the real codec's plans,
    compiles for an H200 (sm_90, Triton's own ptxas; no GPU needed)."""
    geometries = [(1, 1920, 6, 7, 1, False, False), (64, 1920, 2, 3, 1, True, False), (32, 1920, 0, 1, 1, True, False),
                  (512, 2, 6, 7, 1, False, False), (512, 2, 2, 4, 2, False, True)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_FOR_H200.replace("{GEOMETRIES}", repr(geometries))],
                         check=False, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["compiled", str(len(geometries) + 2)]
