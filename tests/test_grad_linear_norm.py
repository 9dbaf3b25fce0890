"""Twin gradients of the twin linears and norms (`kernels_pallas.contract.grad`): `jax.vjp` through
the Pallas twins (interpreted, under `jax.jit`) and torch autograd through the Triton twins
(TRITON_INTERPRET=1) give the same bits for every input's and weight's gradient; each backward kernel
has the bits of its references on both sides; both gradients are close to the gradient of the plain
reference (`*_native`, differentiated by each framework's own autodiff), within a measured bound.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from jax_impl.parity import bits
from kernels_pallas import twin_grad as pg
from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_math as pm
from kernels_pallas import twin_norm as pn
from kernels_pallas.contract.norm import TwinNorm, TwinRms, TwinSplit
from kernels_triton import twin_grad as tg
from kernels_triton import twin_linear as tli
from kernels_triton import twin_norm as tn

DTYPES = {"float32": (jnp.float32, torch.float32), "bfloat16": (jnp.bfloat16, torch.bfloat16)}
# max |grad - grad of the reference| / max |grad of the reference| per gradient, over the cases below:
# measured float32 <= 4.5e-7 (the references' autodiff sums in other orders), bfloat16 <= 7.5e-3 (their
# autodiff rounds its intermediates to bfloat16 where the twins keep float32)
NATIVE_BOUND = {"float32": 2e-6, "bfloat16": 3e-2}


@pytest.fixture(autouse=True)
def _one_torch_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def to_torch(a) -> torch.Tensor:
    """A JAX or numpy array as a torch tensor with the same bits (bfloat16 included)."""
    a = np.array(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def assert_same_bits(a, b, what):
    a, b = bits(a), bits(b.detach() if isinstance(b, torch.Tensor) else b)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{what}: {bad.size} of {a.size} elements differ, first at {bad[:5]}"


def normwise(a, ref) -> float:
    a, ref = (np.asarray(t.detach().float() if isinstance(t, torch.Tensor) else jnp.asarray(t, jnp.float32))
              for t in (a, ref))
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def arrays(rng, dtype, **shapes):
    return {k: jnp.asarray(rng.standard_normal(s) * scale + shift, dtype) for k, (s, scale, shift) in shapes.items()}


# ------------------------------------------------------------------------------ the backward kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", [None, "gelu", "silu_gate"])
@pytest.mark.parametrize("with_scale", [False, True])
def test_epilogue_grad_same_bits_in_pallas_triton_and_references(dtype, act, with_scale):
    jdt, _ = DTYPES[dtype]
    M, N = 5, 32
    a = arrays(np.random.default_rng(1), jdt, dy=((M, N), 1, 0), pre=((M, (2 if act == "silu_gate" else 1) * N), 3, 0),
               scale=((3, N), 1, 0))
    pre = a["pre"] if act or with_scale else None
    scale = a["scale"] if with_scale else None
    ref = pg.epilogue_grad_native(a["dy"], pre, scale, 1, act=act)
    outs = [pg.epilogue_grad(a["dy"], pre, scale, jnp.int32(1), act=act)]
    t = [None if v is None else to_torch(v) for v in (a["dy"], pre, scale)]
    outs += [f(*t, 1, act=act) for f in (tg.epilogue_grad, tg.epilogue_grad_native)]
    for out in outs:
        for r, o, what in zip(ref, out, ("dpre", "ts")):
            assert (r is None) == (o is None), what
            if r is not None:
                assert_same_bits(r, o, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_grad_same_bits_in_pallas_triton_and_references(dtype, kind):
    jdt, _ = DTYPES[dtype]
    M, D = 5, 256  # two blocks of 128 lanes
    a = arrays(np.random.default_rng(2), jdt, x=((M, D), 2, 0.5), dy=((M, D), 1, 0), w=((2, D), 0.3, 1),
               b=((2, D), 0.3, 0))
    b = a["b"] if kind == "layer" else None
    ref = pn.norm_grad_native(a["x"], a["dy"], a["w"], b, 1, kind=kind, eps=1e-5)
    outs = [pn.norm_grad(a["x"], a["dy"], a["w"], b, jnp.int32(1), kind=kind, eps=1e-5)]
    t = [None if v is None else to_torch(v) for v in (a["x"], a["dy"], a["w"], b)]
    outs += [f(*t, 1, kind=kind, eps=1e-5) for f in (tn.norm_grad, tn.norm_grad_native)]
    for out in outs:
        for r, o, what in zip(ref, out, ("dx", "tw")):
            assert_same_bits(r, o, what)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_sum_adds_the_rows_in_increasing_order_on_both_sides(dtype):
    jdt, tdt = DTYPES[dtype]
    t = np.random.default_rng(3).standard_normal((7, 48)).astype(np.float32)
    t[:, 0] = [1e8, 1.0, -1e8, 1.0, 0.0, 0.0, 0.0]  # in order: (1e8 + 1 - 1e8) + 1 = 1, other orders 2 or 0
    out = pg.batch_sum(jnp.asarray(t), jdt)
    assert float(out[0]) == 1.0
    assert_same_bits(out, pg.batch_sum_native(jnp.asarray(t), jdt), "native")
    for f in (tg.batch_sum, tg.batch_sum_native):
        assert_same_bits(out, f(torch.from_numpy(t), tdt), f.__name__)


@pytest.mark.parametrize("side", ["pallas", "triton"])
def test_the_backward_kernels_refuse_a_dtype_they_would_narrow_alike_on_both_sides(side):
    """The backward kernels compute in float32: a float64 argument (or requested batch_sum dtype) would
    come back narrowed, an integer one cast; both are refused naming the argument, as the forwards do."""
    put, grad, norm, (f32, f64) = {"pallas": (np.asarray, pg, pn, (jnp.float32, jnp.float64)),  # jnp.asarray narrows
                                   "triton": (torch.from_numpy, tg, tn, (torch.float32, torch.float64))}[side]
    M, N = 2, 64
    ss, alpha = put(np.ones((M, N // 64), np.float32)), put(np.ones((1, N), np.float32))
    for dtype in ("float64", "int32"):
        bad = put(np.ones((M, N), dtype))
        calls = (("epilogue_grad(dy)", grad.epilogue_grad, (bad, None), {}),
                 ("batch_sum(t)", grad.batch_sum, (bad, f32), {}),
                 ("split_grad(y)", norm.split_grad, (bad, bad, ss, alpha, 0), {}),
                 ("split_rms_grad(u)", norm.split_rms_grad, (bad, bad, ss), {"eps": 1e-5}))
        for arg, fn, args, kw in calls:
            with pytest.raises(TypeError, match=rf"^{re.escape(arg)}: expected one of float32, bfloat16, float16, "
                                                rf"got {dtype}$"):
                fn(*args, **kw)
    for fn in (grad.batch_sum, grad.batch_sum_native):
        with pytest.raises(TypeError, match=r"^batch_sum\(dtype\): expected one of .*, got float64$"):
            fn(put(np.ones((M, N), np.float32)), f64)


def test_a_second_derivative_is_refused_not_silently_zero():
    """The twin kernels have no derivative of their own: torch's backward with create_graph=True (which
    would hand back a first derivative whose derivative is silently zero) and JAX's derivative of the
    backward (a linearization error from inside a pallas_call) raise NotImplementedError naming the twin."""
    rng = np.random.default_rng(15)
    x = rng.standard_normal((2, 128)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal((1, 128))).astype(np.float32)
    wl = (0.1 * rng.standard_normal((1, 32, 128))).astype(np.float32)
    torch_twins = {"norm": lambda x: tn.norm(x, torch.from_numpy(w), None, 0, kind="rms", eps=1e-5),
                   "split": lambda x: tn.split(x, torch.from_numpy(w), 0)[0],
                   "linear": lambda x: tli.linear(x, torch.from_numpy(wl), 0, act="gelu")}
    for who, f in torch_twins.items():
        tx = torch.from_numpy(x).requires_grad_()
        with pytest.raises(NotImplementedError, match=rf"^{who}: the twin kernels have no second derivative"):
            torch.autograd.grad((f(tx) ** 2).sum(), tx, create_graph=True)
    jax_twins = {"norm": lambda x: pn.norm(x, w, None, 0, kind="rms", eps=1e-5), "split": lambda x: pn.split(x, w, 0)[0],
                 "linear": lambda x: pli.linear(x, wl, 0, act="gelu")}
    for who, f in jax_twins.items():
        def first(x, f=f):
            return jax.grad(lambda x: jnp.sum(f(x) ** 2))(x)

        assert np.abs(np.asarray(first(x))).max() > 0  # the first derivative stands
        with pytest.raises(NotImplementedError, match=rf"^{who}: the twin kernels have no second derivative"):
            jax.grad(lambda x, first=first: jnp.sum(first(x) ** 2))(x)


# ------------------------------------------------------------------ the differentiable kernels
LINEAR_CASES = [  # act, the fused norm's kind, a layer scale, a residual
    (None, None, False, False),
    (None, "rms", False, True),
    ("silu_gate", "rms", False, False),
    ("gelu", "layer", True, True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("act", "kind", "with_scale", "with_res"), LINEAR_CASES)
def test_linear_twin_gradients_same_bits_jax_vs_torch_and_close_to_the_reference(dtype, act, kind, with_scale,
                                                                                 with_res):
    jdt, _ = DTYPES[dtype]
    M, K, N, L, layer = 6, 64, 32, 3, 1
    N_out = N // 2 if act == "silu_gate" else N
    a = arrays(np.random.default_rng(4), jdt, x=((M, K), 1, 0), w=((L, N, K), 0.125, 0), scale=((L, N_out), 1, 0),
               residual=((M, N_out), 1, 0), nw=((L, K), 0.25, 1), nb=((L, K), 0.25, 0))
    names = ["x", "w", *(["scale"] if with_scale else []), *(["residual"] if with_res else []),
             *(["nw"] if kind else []), *(["nb"] if kind == "layer" else [])]
    cot = jnp.asarray(np.random.default_rng(5).standard_normal((M, N_out)), jdt)

    def call(fn, args, layer_arg):
        norm = TwinNorm(kind, args["nw"], args.get("nb"), 1e-5) if kind else None
        return fn(args["x"], args["w"], layer_arg, act=act, scale=args.get("scale"), residual=args.get("residual"),
                  norm=norm)

    def jax_grads(fn, layer_arg):
        def f(*vals):
            return call(fn, dict(zip(names, vals)), layer_arg)
        _, vjp = jax.vjp(f, *(a[n] for n in names))
        return vjp(cot)

    pallas = jax.jit(lambda lay: jax_grads(pli.linear, lay))(jnp.int32(layer))
    tt = {n: to_torch(a[n]).requires_grad_() for n in names}
    call(tli.linear, tt, layer).backward(to_torch(cot))
    ref_jax = jax.jit(lambda: jax_grads(pli.linear_native, layer))()
    tt_ref = {n: to_torch(a[n]).requires_grad_() for n in names}
    call(tli.linear_native, tt_ref, layer).backward(to_torch(cot))
    for n, g, r in zip(names, pallas, ref_jax):
        assert_same_bits(g, tt[n].grad, n)
        assert normwise(g, r) <= NATIVE_BOUND[dtype], (n, normwise(g, r))
        assert normwise(tt[n].grad, tt_ref[n].grad) <= NATIVE_BOUND[dtype], (n, normwise(tt[n].grad, tt_ref[n].grad))
    assert not np.any(np.asarray(jnp.asarray(pallas[1], jnp.float32))[np.arange(L) != layer]), "w's other layers"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("stacked", [True, False])
def test_norm_twin_gradients_same_bits_jax_vs_torch_and_close_to_the_reference(dtype, kind, stacked):
    jdt, _ = DTYPES[dtype]
    M, D, L = 5, 128, 2
    a = arrays(np.random.default_rng(6), jdt, x=((M, D), 2, 0.5), w=((L, D), 0.3, 1), b=((L, D), 0.3, 0),
               cot=((M, D), 1, 0))
    if not stacked:
        a["w"], a["b"] = a["w"][1], a["b"][1]
    names = ["x", "w", *(["b"] if kind == "layer" else [])]
    layer = 1 if stacked else None

    def jax_grads(fn, layer_arg):
        _, vjp = jax.vjp(lambda *v: fn(*v, *([None] if kind == "rms" else []), layer_arg, kind=kind, eps=1e-5),
                         *(a[n] for n in names))
        return vjp(a["cot"])

    pallas = jax.jit(lambda lay: jax_grads(pn.norm, lay))(jnp.int32(1) if stacked else None)
    ref = jax.jit(lambda: jax_grads(pn.norm_native, layer))()
    for fn, dest in ((tn.norm, "triton"), (tn.norm_native, "ref")):
        tt = {n: to_torch(a[n]).requires_grad_() for n in names}
        fn(tt["x"], tt["w"], tt.get("b"), layer, kind=kind, eps=1e-5).backward(to_torch(a["cot"]))
        for n, g, r in zip(names, pallas, ref):
            if dest == "triton":
                assert_same_bits(g, tt[n].grad, n)
            else:
                assert normwise(tt[n].grad, r) <= NATIVE_BOUND[dtype], (n, normwise(tt[n].grad, r))
            assert normwise(g, r) <= NATIVE_BOUND[dtype], (n, normwise(g, r))


def test_grad_under_jit_through_a_layer_loop_reads_the_stacked_weights_in_place():
    """jax.grad of a loss through a fori_loop over layers (the twin step's loop: a traced layer index)
    matches the reference's gradient, and torch's autograd of the same loop gives the same bits."""
    L, M, K = 2, 4, 64
    a = arrays(np.random.default_rng(7), jnp.float32, x=((M, K), 1, 0), w=((L, 2 * K, K), 0.1, 0),
               w2=((L, K, K), 0.1, 0), nw=((L, K), 0.2, 1))

    def layers(lin, nrm, x, w, w2, nw, loop):
        def body(layer, x):
            h = lin(x, w, layer, act="silu_gate", norm=TwinNorm("rms", nw, None, 1e-5))
            return lin(h, w2, layer, residual=x)
        x = loop(body, x)
        return nrm(x, nw, None, L - 1, kind="rms", eps=1e-5)

    def jax_loss(lin, nrm, loop):
        return lambda x, w, w2, nw: jnp.sum(layers(lin, nrm, x, w, w2, nw, loop) ** 2)

    def fori(body, x):
        return jax.lax.fori_loop(0, L, body, x)

    def unrolled(body, x):
        for layer in range(L):
            x = body(layer, x)
        return x

    twin = jax.jit(jax.grad(jax_loss(pli.linear, pn.norm, fori), argnums=(0, 1, 2, 3)))(a["x"], a["w"], a["w2"],
                                                                                          a["nw"])
    ref = jax.jit(jax.grad(jax_loss(pli.linear_native, pn.norm_native, unrolled), argnums=(0, 1, 2, 3)))(
        a["x"], a["w"], a["w2"], a["nw"])
    tt = [to_torch(a[n]).requires_grad_() for n in ("x", "w", "w2", "nw")]
    (layers(tli.linear, tn.norm, *tt, unrolled) ** 2).sum().backward()
    for n, g, r, t in zip(("x", "w", "w2", "nw"), twin, ref, tt):
        assert np.all(np.isfinite(np.asarray(g))), n
        assert normwise(g, r) <= NATIVE_BOUND["float32"], (n, normwise(g, r))
        assert_same_bits(g, t.grad, n)


# ------------------------------------------------------------------------------ the split RMSNorm
# the split norm's gradients against the reference's RMSNorm-then-linear (bfloat16; the consumer scales its
# float32 sums by r where the reference rounds the normalized rows first): measured <= 1.04e-2
SPLIT_BOUND = 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_norm_backward_kernels_same_bits_in_pallas_triton_and_references(dtype):
    jdt, _ = DTYPES[dtype]
    M, N = 5, 128  # two groups of TWIN_SPLIT_GROUP columns
    a = arrays(np.random.default_rng(8), jdt, y=((M, N), 2, 0), du=((M, N), 1, 0), dy=((M, N), 1, 0),
               alpha=((2, N), 0.3, 1))
    dss = jnp.asarray(np.random.default_rng(9).standard_normal((M, N // 64)), jnp.float32)
    ss = jnp.asarray(np.random.default_rng(10).random((M, N // 64)) * 64 + 1, jnp.float32)
    T = (lambda v: None if v is None else to_torch(v))
    for dy in (None, a["dy"]):
        ref = pn.split_grad_native(a["y"], a["du"], dss, a["alpha"], 1, dy=dy)
        outs = [pn.split_grad(a["y"], a["du"], dss, a["alpha"], jnp.int32(1), dy=dy)]
        outs += [f(T(a["y"]), T(a["du"]), T(dss), T(a["alpha"]), 1, dy=T(dy)) for f in (tn.split_grad,
                                                                                        tn.split_grad_native)]
        for out in outs:
            for r, o, what in zip(ref, out, ("dx", "ta")):
                assert_same_bits(r, o, what)
    ref = pn.split_rms_grad_native(a["y"], a["du"], ss, eps=1e-5)
    outs = [jax.jit(lambda *v: pn.split_rms_grad(*v, eps=1e-5))(a["y"], a["du"], ss)]
    outs += [f(T(a["y"]), T(a["du"]), T(ss), eps=1e-5) for f in (tn.split_rms_grad, tn.split_rms_grad_native)]
    for out in outs:
        for r, o, what in zip(ref, out, ("xn", "du", "dss")):
            assert_same_bits(r, o, what)


def test_split_norm_backward_recomputes_the_forwards_intermediates():
    """What the consumer's backward recomputes has the forward's bits (`contract.grad`), on both sides:
    the projection before its epilogue (`linear(rms=)` without the epilogue: the gate on it gives the
    forward's output), and r (`split_rms_grad`'s operand to_dtype(r * u) is the consumer's output for
    w = I: each sum one exact product, scaled by the forward's r)."""
    M, K, L = 5, 128, 2
    rng = np.random.default_rng(11)
    bf = jnp.bfloat16
    y, w = jnp.asarray(rng.standard_normal((M, K)) * 2, bf), jnp.asarray(rng.standard_normal((L, 2 * K, K)) * 0.1, bf)
    alpha = jnp.asarray(1 + 0.25 * rng.standard_normal((L, K)), bf)
    sides = {"pallas": (pli, pn, jnp.asarray, jnp.eye(K, dtype=bf)),
             "triton": (tli, tn, to_torch, torch.eye(K, dtype=torch.bfloat16))}
    for side, (lin, nrm, put, eye) in sides.items():
        u, ss = nrm.split(put(y), put(alpha), 1)
        rms = TwinRms(ss, 1e-5)
        gate = lin.linear(u, put(w), 1, act="silu_gate", rms=rms, form="mma")
        pre = np.asarray(lin.linear(u, put(w), 1, rms=rms, form="mma").float() if side == "triton" else
                         lin.linear(u, put(w), 1, rms=rms, form="mma").astype(jnp.float32))
        a, b = jnp.asarray(pre[:, :K]), jnp.asarray(pre[:, K:])
        assert_same_bits(gate, pm.to_dtype(pm.to_dtype(pm.silu(a, False), bf).astype(jnp.float32) * b, bf),
                         f"{side}: the gate on the recomputed projection")
        xn = nrm.split_rms_grad(u, u, ss, eps=1e-5)[0]
        assert_same_bits(lin.linear(u, eye, rms=rms, form="mma"), xn, f"{side}: r * u")
        assert not np.array_equal(bits(xn if side == "pallas" else xn.detach()), bits(u)), side


def test_split_norm_twin_gradients_same_bits_jax_vs_torch_and_close_to_the_reference():
    """The split RMSNorm as the temporal layer runs it on the GPU (interpreted here, bfloat16: the MMA
    form): a producer (a projection with a residual and `split=`) and a consumer (the gate with `rms=`);
    x, w, the residual, alpha and the consumer's w get the same bits in JAX and torch, close to the
    gradients of the reference's RMSNorm (norm=) in the consumer (`SPLIT_BOUND`)."""
    M, N, K, L = 5, 128, 64, 2
    a = arrays(np.random.default_rng(12), jnp.bfloat16, x=((M, K), 1, 0), w=((L, N, K), 0.1, 0),
               r=((M, N), 1, 0), alpha=((L, N), 0.25, 1), w2=((L, 2 * K, N), 0.1, 0), cg=((M, K), 1, 0),
               cy=((M, N), 1, 0))
    names = ("x", "w", "r", "alpha", "w2")

    def layer(lin, args, norm_ref=False):
        x, w, r, alpha, w2 = args
        if norm_ref:
            y = lin(x, w, 0, residual=r)
            return lin(y, w2, 1, act="silu_gate", norm=TwinNorm("rms", alpha, None, 1e-5)), y
        y, u, ss = lin(x, w, 0, residual=r, split=TwinSplit(alpha, 1), form="mma")
        return lin(u, w2, 1, act="silu_gate", rms=TwinRms(ss, 1e-5), form="mma"), y

    got = jax.jit(lambda *v: jax.vjp(lambda *v: layer(pli.linear, v), *v)[1]((a["cg"], a["cy"])))(
        *(a[n] for n in names))
    ref = jax.jit(lambda *v: jax.vjp(lambda *v: layer(pli.linear_native, v, True), *v)[1]((a["cg"], a["cy"])))(
        *(a[n] for n in names))
    tt = [to_torch(a[n]).requires_grad_() for n in names]
    torch.autograd.backward(layer(tli.linear, tt), (to_torch(a["cg"]), to_torch(a["cy"])))
    for n, g, r, t in zip(names, got, ref, tt):
        assert_same_bits(g, t.grad, n)
        assert normwise(g, r) <= SPLIT_BOUND, (n, normwise(g, r))
    assert not np.asarray(got[3], np.float32)[0].any() and np.asarray(got[3], np.float32)[1].any()  # alpha's row 1



@pytest.mark.parametrize("dtype", DTYPES)
def test_split_alone_twin_gradients_same_bits_jax_vs_torch_and_close_to_the_reference(dtype):
    """`split` (the first layer's split norm, of x itself) differentiated in x and alpha through u and ss."""
    jdt, _ = DTYPES[dtype]
    M, N = 5, 128
    a = arrays(np.random.default_rng(13), jdt, x=((M, N), 1, 0), alpha=((2, N), 0.25, 1), cu=((M, N), 1, 0))
    css = jnp.asarray(np.random.default_rng(14).standard_normal((M, N // 64)), jnp.float32)
    got = jax.jit(lambda x, al: jax.vjp(lambda x, al: pn.split(x, al, 1), x, al)[1]((a["cu"], css)))(a["x"],
                                                                                                   a["alpha"])
    ref = jax.jit(lambda x, al: jax.vjp(lambda x, al: pn.split_native(x, al, 1), x, al)[1]((a["cu"], css)))(
        a["x"], a["alpha"])
    tt = [to_torch(a[n]).requires_grad_() for n in ("x", "alpha")]
    torch.autograd.backward(tn.split(*tt, 1), (to_torch(a["cu"]), to_torch(css)))
    for n, g, r, t in zip(("x", "alpha"), got, ref, tt):
        assert_same_bits(g, t.grad, n)
        assert normwise(g, r) <= NATIVE_BOUND[dtype], (n, normwise(g, r))
