"""The twin kernels' argument rules (`kernels_pallas.contract`), each refused alike on both twins (the
Pallas twin interpreted, the Triton twin under TRITON_INTERPRET=1) before anything runs:

- every array has at least one element along each axis (`numerics.check_nonempty`); the MRoPE
  kernels alone take zero tokens, as they are, after the same checks as any other call;
- num_warps is a power of two in 1..32 and num_stages None or an int >= 1 (`numerics.check_launch`);
- a norm's eps is a finite float >= 0, and an RMSNorm takes no bias (`contract.norm`);
- the twins take one signature with one default each: no keyword one twin has and the other lacks
  or ignores (the Pallas linear's prefetch depth is a constant of its backend), and the attention's
  launch defaults (None on both) resolve in the contract to what each backend compiled before.
"""

from __future__ import annotations

import importlib
import inspect
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from kernels_pallas import rotary_mrope as pm
from kernels_pallas import twin_attention as pa
from kernels_pallas import twin_conv as pc
from kernels_pallas import twin_entry as pe
from kernels_pallas import twin_linear as pli
from kernels_pallas import twin_norm as pn
from kernels_pallas import twin_rope as pr
from kernels_pallas.contract import attention as ca
from kernels_pallas.contract import linear as cl
from kernels_pallas.contract.norm import TwinNorm, TwinRms
from kernels_triton import rotary_mrope as tm
from kernels_triton import twin_attention as ta
from kernels_triton import twin_conv as tc
from kernels_triton import twin_linear as tli
from kernels_triton import twin_norm as tn
from kernels_triton import twin_rope as tr


def _torch(a, bf16=False):
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(torch.bfloat16) if bf16 else t


SIDES = {  # each twin's modules, and numpy -> its arrays (float32, or bfloat16 where asked)
    "pallas": SimpleNamespace(linear=pli, norm=pn, attention=pa, rope=pr, conv=pc, mrope=pm,
                              arr=lambda a, bf16=False: jnp.asarray(a, jnp.bfloat16 if bf16 else None)),
    "triton": SimpleNamespace(linear=tli, norm=tn, attention=ta, rope=tr, conv=tc, mrope=tm, arr=_torch),
}


def ones(*shape):
    return np.ones(shape, np.float32)


def zeros_int(*shape):
    return np.zeros(shape, np.int32)


def attention(s, B, H, T, D, C, L=1, **kw):
    ring = s.arr(ones(L, B, H, C, D))
    return s.attention.attention(s.arr(ones(B, H, T, D)), ring, ring, 0, s.arr(zeros_int(B, C)),
                                 s.arr(zeros_int(B, T)), context=4, **kw)


def rope_write(s, B, T, H, D, C, L=1):
    ring = s.arr(ones(L, B, H, C, D))
    return s.rope.rope_write(s.arr(ones(B, T, 3, H, D)), None, None, ring, ring, 0, s.arr(zeros_int(B, T)),
                             s.arr(np.ones((B, T), bool)))


def qkv(s, B, T, H=1, D=8, C=4, K=16, **kw):
    ring = s.arr(ones(1, B, H, C, D))
    return s.linear.linear_rope_write(s.arr(ones(B * T, K)), s.arr(ones(1, 3 * H * D, K)), 0, None, None, ring, ring,
                                      s.arr(zeros_int(B, T)), s.arr(np.ones((B, T), bool)), **kw)


EMPTY = [  # (id, call on a side, the refusal)
    ("linear M=0", lambda s: s.linear.linear(s.arr(ones(0, 16)), s.arr(ones(8, 16))),
     r"linear\(x\): expected at least one row \(M\), got shape \(0, 16\)"),
    ("linear K=0", lambda s: s.linear.linear(s.arr(ones(3, 0)), s.arr(ones(8, 0))),
     r"linear\(x\): expected at least one column \(K\)"),
    ("linear N=0", lambda s: s.linear.linear(s.arr(ones(3, 16)), s.arr(ones(0, 16))),
     r"linear\(w\): expected at least one row \(N\), got shape \(1, 0, 16\)"),
    ("linear L=0", lambda s: s.linear.linear(s.arr(ones(3, 16)), s.arr(ones(0, 8, 16)), 0),
     r"linear\(w\): expected at least one layer \(L\)"),
    ("linear_rope_write B=0", lambda s: qkv(s, 0, 1), r"linear\(x\): expected at least one row \(M\)"),
    ("norm M=0", lambda s: s.norm.norm(s.arr(ones(0, 16)), s.arr(ones(16)), eps=1e-5),
     r"norm\(x\): expected at least one row \(M\)"),
    ("norm D=0", lambda s: s.norm.norm(s.arr(ones(3, 0)), s.arr(ones(0)), eps=1e-5),
     r"norm\(x\): expected at least one feature \(D\)"),
    ("norm_grad M=0", lambda s: s.norm.norm_grad(s.arr(ones(0, 16)), s.arr(ones(0, 16)), s.arr(ones(16)), eps=1e-5),
     r"norm\(x\): expected at least one row \(M\)"),
    ("attention B=0", lambda s: attention(s, 0, 2, 1, 8, 4), r"attention\(q\): expected at least one batch row \(B\)"),
    ("attention H=0", lambda s: attention(s, 1, 0, 1, 8, 4), r"attention\(q\): expected at least one head \(H\)"),
    ("attention T=0", lambda s: attention(s, 1, 2, 0, 8, 4), r"attention\(q\): expected at least one query \(T\)"),
    ("attention D=0", lambda s: attention(s, 1, 2, 1, 0, 4), r"attention\(q\): expected at least one feature \(D\)"),
    ("attention C=0", lambda s: attention(s, 1, 2, 1, 8, 0), r"attention\(ring_k\): expected at least one slot \(C\)"),
    ("attention L=0", lambda s: attention(s, 1, 2, 1, 8, 4, L=0),
     r"attention\(ring_k\): expected at least one layer \(L\)"),
    ("tables B=0", lambda s: s.rope.tables(s.arr(zeros_int(0)), 3, s.arr(ones(4))),
     r"tables\(offset\): expected at least one batch row \(B\)"),
    ("tables T=0", lambda s: s.rope.tables(s.arr(zeros_int(2)), 0, s.arr(ones(4))),
     r"tables\(T\): expected an int >= 1, got 0"),
    ("rope_write B=0", lambda s: rope_write(s, 0, 1, 2, 8, 4), r"rope_write\(qkv\): expected at least one batch row"),
    ("rope_write T=0", lambda s: rope_write(s, 1, 0, 2, 8, 4), r"rope_write\(qkv\): expected at least one query \(T\)"),
    ("rope_write H=0", lambda s: rope_write(s, 1, 1, 0, 8, 4), r"rope_write\(qkv\): expected at least one head \(H\)"),
    ("rope_write C=0", lambda s: rope_write(s, 1, 1, 2, 8, 0), r"rope_write\(ring_k\): expected at least one slot"),
    ("taps B=0", lambda s: s.conv.taps(s.arr(ones(0, 2, 8)), kernel_size=1),
     r"taps\(x\): expected at least one batch row \(B\)"),
    ("taps in=0", lambda s: s.conv.taps(s.arr(ones(1, 0, 8)), kernel_size=1),
     r"taps\(x\): expected at least one channel \(in\)"),
    ("conv1d out=0", lambda s: s.conv.conv1d(s.arr(ones(1, 2, 8)), s.arr(ones(0, 2, 1))),
     r"conv1d\(w\): expected at least one output channel \(out\)"),
    ("conv1d k=0", lambda s: s.conv.conv1d(s.arr(ones(1, 2, 8)), s.arr(ones(3, 2, 0))),
     r"conv1d\(w\): expected at least one tap \(k\)"),
    ("conv_transpose1d T=0", lambda s: s.conv.conv_transpose1d(s.arr(ones(1, 2, 0)), s.arr(ones(2, 3, 2)), stride=2),
     r"conv_transpose1d\(x\): expected at least one frame \(T\)"),
    ("nearest M=0", lambda s: s.conv.nearest(s.arr(ones(0, 8)), s.arr(ones(4, 8))),
     r"nearest\(x\): expected at least one row \(M\)"),
    ("nearest D=0", lambda s: s.conv.nearest(s.arr(ones(3, 0)), s.arr(ones(4, 0))),
     r"nearest\(x\): expected at least one feature \(D\)"),
    ("elu", lambda s: s.conv.elu(s.arr(ones(0, 3))), r"elu\(x\): expected at least one element, got shape \(0, 3\)"),
]


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize(("call", "message"), [c[1:] for c in EMPTY], ids=[c[0] for c in EMPTY])
def test_an_empty_array_is_refused_alike_on_both_twins(call, message, side):
    with pytest.raises(ValueError, match=message):
        call(SIDES[side])


@pytest.mark.parametrize("native", [False, True])
def test_the_entry_refuses_an_empty_array(native):
    """The JAX step's entry kernel (the torch step builds its tables with torch operations) and its reference."""
    entry = pe.entry_native if native else pe.entry

    def call(B=2, T=1, dim=8, half=4):
        return entry(jnp.zeros(B, jnp.int32), jnp.zeros(B, jnp.int32), None, jnp.ones((B, T, dim)), jnp.ones(half),
                     capacity=4, convention="moshi", num_heads=2)

    for kw, message in (({"B": 0}, r"entry\(x\): expected at least one batch row \(B\)"),
                        ({"T": 0}, r"entry\(x\): expected at least one query \(T\)"),
                        ({"dim": 0}, r"entry\(x\): expected at least one feature \(dim\)"),
                        ({"half": 0}, r"entry\(freqs\): expected \[D/2\] with D/2 a power of two, got \[0\]")):
        with pytest.raises(ValueError, match=message):
            call(**kw)


@pytest.mark.parametrize("side", SIDES)
def test_mrope_takes_zero_tokens_after_the_same_checks(side):
    """Zero tokens: q and k back as they are (nothing launched), but the launch arguments are refused as
    with any other count of tokens."""
    s = SIDES[side]
    table, positions, cache = s.arr(ones(3, 0, 4)), s.arr(zeros_int(3, 0)), s.arr(ones(5, 8))
    calls = {"mrope": lambda **kw: s.mrope.mrope(s.arr(ones(0, 32)), s.arr(ones(0, 16)), table, table, [2, 1, 1], 16,
                                                 8, **kw),
             "mrope_from_cache": lambda **kw: s.mrope.mrope_from_cache(positions, s.arr(ones(0, 32)), s.arr(ones(0, 16)),
                                                                       cache, [2, 1, 1], 16, 8, **kw)}
    for who, call in calls.items():
        q, k = call()
        assert tuple(q.shape) == (0, 32) and tuple(k.shape) == (0, 16)
        for kw, message in (({"num_warps": 3}, rf"{who}: num_warps must be a power of two in 1\.\.32, got 3"),
                            ({"block_tokens": 3}, "block_tokens must be a positive power of two, got 3"),
                            ({"block_heads": 0}, "block_heads must be a positive power of two, got 0")):
            with pytest.raises(ValueError, match=message):
                call(**kw)


LAUNCHES = {  # who: (whether it takes num_stages, a good call that takes the launch keywords)
    "linear": (True, lambda s, **kw: s.linear.linear(s.arr(ones(3, 16)), s.arr(ones(8, 16)), **kw)),
    "linear_rope_write": (True, lambda s, **kw: qkv(s, 1, 1, **kw)),
    "norm": (False, lambda s, **kw: s.norm.norm(s.arr(ones(3, 16)), s.arr(ones(16)), eps=1e-5, **kw)),
    "attention": (True, lambda s, **kw: attention(s, 1, 2, 1, 8, 4, **kw)),
}


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("who", LAUNCHES)
def test_num_warps_and_num_stages_are_refused_alike_on_both_twins(who, side):
    stages, call = LAUNCHES[who]
    s = SIDES[side]
    bad_warps = [0, -4, 3, 64, 2.0, True] + ([] if who == "attention" else [None])  # attention: None, its default
    for v in bad_warps:
        with pytest.raises(ValueError, match=rf"{who}: num_warps must be a power of two in 1\.\.32, got {v!r}"):
            call(s, num_warps=v)
    for v in [0, -1, 1.5, True] if stages else []:
        with pytest.raises(ValueError, match=rf"{who}: num_stages must be None or an int >= 1, got {v!r}"):
            call(s, num_stages=v)


def test_the_twins_take_one_signature_with_one_default():
    """Each public function of a twin module: the same parameters, kinds and defaults on both sides
    (`interpret`, Pallas's own, aside): the linear has no `prefetch` (a constant of the Pallas backend,
    `contract.linear.twin_pallas_prefetch`), the attention's launch defaults are None on both."""
    for name in ("twin_attention", "twin_conv", "twin_grad", "twin_linear", "twin_norm", "twin_rope"):
        pallas, triton = (importlib.import_module(f"{package}.{name}") for package in ("kernels_pallas", "kernels_triton"))
        for fn in triton.__all__:
            params = [[(p.name, p.kind, p.default) for p in inspect.signature(getattr(side, fn)).parameters.values()
                       if p.name != "interpret"] for side in (pallas, triton)]
            assert params[0] == params[1], f"{name}.{fn}"
            assert "prefetch" not in [p[0] for p in params[0]], f"{name}.{fn}"
    for side in (pa, ta):
        launch = inspect.signature(side.attention).parameters
        assert launch["num_warps"].default is None and launch["num_stages"].default is None, side.__name__


def test_the_attention_launch_defaults_are_each_backends_own(monkeypatch):
    """None (both twins' default) resolves in the contract to what each backend compiled before: the Pallas
    twin's warps by the step's shape, 3 stages; the Triton twin's 2 warps, 1 stage. What each launches."""
    launch = ca.twin_attention_launch
    assert launch(None, None, True, 128, 128, 3000) == (ca.TWIN_PALLAS_ATTENTION_FEW_WARPS, 3) == (4, 3)
    assert launch(None, None, True, 129, 64, 250) == (ca.TWIN_PALLAS_ATTENTION_SMALL_HEAD_WARPS, 3) == (1, 3)
    assert launch(None, None, True, 129, 64, 64) == launch(None, None, True, 129, 128, 3000) == (2, 3)
    assert launch(None, None, False, 128, 128, 3000) == (ca.TWIN_TRITON_ATTENTION_WARPS, 1) == (2, 1)
    assert launch(8, 2, True, 1, 8, 4) == launch(8, 2, False, 1, 8, 4) == (8, 2)
    q, ring = jnp.ones((1, 2, 1, 8)), jnp.ones((1, 1, 2, 300, 8))
    jaxpr = str(jax.make_jaxpr(lambda q, r: pa.attention(q, r, r, 0, jnp.zeros((1, 300), jnp.int32),
                                                         jnp.zeros((1, 1), jnp.int32), context=4))(q, ring))
    assert "num_warps=4" in jaxpr and "num_stages=3" in jaxpr
    seen = []
    run = ta._split_kernel.run
    monkeypatch.setattr(ta._split_kernel, "run",
                        lambda *a, **kw: seen.append((kw["num_warps"], kw["STAGES"])) or run(*a, **kw))
    attention(SIDES["triton"], 1, 2, 1, 8, 300)
    assert seen == [(2, 1)]


def test_the_pallas_prefetch_depth_is_read_from_the_contract_at_call_time(monkeypatch):
    """Speed only: the bits at every depth are the lane form's (a depth past the K blocks is clamped)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((3, 192)).astype(np.float32), rng.standard_normal((1, 64, 192)).astype(np.float32)
    want = np.asarray(pli.linear_native(x, w, 0))
    for depth in (1, 2, 5):
        monkeypatch.setattr(cl, "TWIN_PALLAS_PREFETCH", depth)
        assert cl.twin_pallas_prefetch(192, 64) == min(depth, 3)
        assert np.array_equal(np.asarray(pli.linear(x, w, 0, block_n=16)), want), depth


EPS = [None, -1.0, float("nan"), float("inf"), True, "1e-5"]


@pytest.mark.parametrize("side", SIDES)
def test_a_norm_refuses_a_bad_eps_and_an_rms_bias_alike_on_both_twins(side):
    """eps=None reached the kernels as a raw error (another on each side), an RMSNorm's bias was read by
    neither and dropped without a word: both refused, naming the argument, in the norm, its reference, its
    derivative, and the norms a linear fuses or splits."""
    s = SIDES[side]
    x, w = s.arr(ones(3, 64)), s.arr(ones(64))
    for norm in (s.norm.norm, s.norm.norm_native):
        for eps in EPS:
            with pytest.raises(ValueError, match=r"norm\(eps\): expected a finite float >= 0, got "):
                norm(x, w, w, kind="layer", eps=eps)
        with pytest.raises(ValueError, match=r"norm\(bias\): kind='rms' adds no bias, got one \(pass None\)"):
            norm(x, w, w, kind="rms", eps=1e-5)
    for grad in (s.norm.norm_grad, s.norm.norm_grad_native):
        with pytest.raises(ValueError, match=r"norm_grad\(eps\): expected a finite float >= 0, got None"):
            grad(x, x, w, eps=None)
    lw = s.arr(ones(1, 8, 64))
    with pytest.raises(ValueError, match=r"linear\(norm\.bias\): kind='rms' adds no bias"):
        s.linear.linear(x, lw, 0, norm=TwinNorm("rms", s.arr(ones(1, 64)), s.arr(ones(1, 64)), 1e-5))
    with pytest.raises(ValueError, match=r"linear\(norm\.eps\): expected a finite float >= 0, got None"):
        s.linear.linear(x, lw, 0, norm=TwinNorm("layer", s.arr(ones(1, 64)), s.arr(ones(1, 64)), None))
    u, wu = s.arr(ones(16, 128), bf16=True), s.arr(ones(1, 64, 128), bf16=True)
    with pytest.raises(ValueError, match=r"linear\(rms\.eps\): expected a finite float >= 0, got None"):
        s.linear.linear(u, wu, 0, rms=TwinRms(s.arr(ones(16, 2)), None), form="mma")
