"""MRoPE: Pallas (interpret) vs Triton (interpret) bit identity, each vs its reference, errors.

Run on CPU as ``TRITON_INTERPRET=1 python -m pytest tests/test_mrope*.py``.  Bits are compared as
unsigned integers through numpy, so ``-0.0 != 0.0`` and any rounding difference fails.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton on CPU needs TRITON_INTERPRET=1", allow_module_level=True)

from hypothesis import given, settings
from hypothesis import strategies as st

import kernels_pallas as kp
import kernels_triton as kt
from jax_impl import parity
from kernels_pallas import rotary_mrope as kp_mod
from kernels_triton import rotary_mrope as kt_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------------------------ helpers


def to_torch(a: np.ndarray) -> torch.Tensor:
    """numpy (incl. ml_dtypes bfloat16) -> torch with identical bits."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16).to(DEVICE)
    return torch.from_numpy(a.copy()).to(DEVICE)


def bits_torch(t: torch.Tensor) -> np.ndarray:
    return parity.bits(t.detach().cpu().contiguous())


bits_jax = parity.bits


def assert_same_bits(a: np.ndarray, b: np.ndarray, what: str):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    bad = np.flatnonzero(a.ravel() != b.ravel())
    assert bad.size == 0, f"{what}: {bad.size} of {a.size} elements differ, first at {bad[:5]}"


def make_case(seed, num_tokens, hq, hk, head_size, rotary_dim, dtype, streams, table_dtype="float32",
              max_position=97):
    rng = np.random.default_rng(seed)
    half = rotary_dim // 2
    q = rng.standard_normal((num_tokens, hq * head_size), np.float32).astype(NP_DTYPES[dtype])
    k = rng.standard_normal((num_tokens, hk * head_size), np.float32).astype(NP_DTYPES[dtype])
    inv = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float64) * 2 / rotary_dim))
    ang = np.arange(max_position)[:, None] * inv[None, :]
    cache = np.concatenate([np.cos(ang), np.sin(ang)], -1).astype(np.float32)
    shape = (3, num_tokens) if streams == 3 else (num_tokens,)
    pos = rng.integers(0, max_position, shape).astype(np.int32)
    rows = cache[pos]
    cos = rows[..., :half].astype(NP_DTYPES[table_dtype])
    sin = rows[..., half:].astype(NP_DTYPES[table_dtype])
    return q, k, cos, sin, pos, cache


def run_all(case, sections, head_size, rotary_dim, interleaved, neox, **blocks):
    """Runs all six forms; returns {name: (q_bits, k_bits)}."""
    q, k, cos, sin, pos, cache = case
    args = (sections, head_size, rotary_dim, interleaved, neox)
    out = {}
    jq, jk = jnp.asarray(q), jnp.asarray(k)
    r = kp.mrope(jq, jk, jnp.asarray(cos), jnp.asarray(sin), *args, **blocks)
    out["pallas"] = tuple(map(bits_jax, r))
    r = kp.mrope_from_cache(jnp.asarray(pos), jq, jk, jnp.asarray(cache), *args, **blocks)
    out["pallas_cache"] = tuple(map(bits_jax, r))
    ref = jax.jit(functools.partial(kp.mrope_native, mrope_section=sections, head_size=head_size,
                                    rotary_dim=rotary_dim, mrope_interleaved=interleaved,
                                    is_neox_style=neox))
    out["jnp_ref"] = tuple(map(bits_jax, ref(jq, jk, jnp.asarray(cos), jnp.asarray(sin))))
    tq, tk = to_torch(q), to_torch(k)
    r = kt.mrope(tq, tk, to_torch(cos), to_torch(sin), *args, **blocks)
    out["triton"] = tuple(map(bits_torch, r))
    r = kt.mrope_from_cache(to_torch(pos).long(), tq, tk, to_torch(cache), *args, **blocks)
    out["triton_cache"] = tuple(map(bits_torch, r))
    out["torch_ref"] = tuple(map(bits_torch, kt.mrope_native(tq, tk, to_torch(cos), to_torch(sin), *args)))
    # Inputs untouched by the out-of-place forms.
    assert_same_bits(bits_torch(tq), bits_jax(q), "triton mrope modified its input")
    return out


def check_all_equal(out, table_dtype="float32"):
    names = ["pallas", "jnp_ref", "triton", "torch_ref"]
    if table_dtype == "float32":  # the cache is float32: same rows as a float32 table
        names += ["pallas_cache", "triton_cache"]
    else:
        assert_same_bits(out["pallas_cache"][0], out["triton_cache"][0], "q pallas_cache vs triton_cache")
        assert_same_bits(out["pallas_cache"][1], out["triton_cache"][1], "k pallas_cache vs triton_cache")
    for name in names[1:]:
        assert_same_bits(out[names[0]][0], out[name][0], f"q {names[0]} vs {name}")
        assert_same_bits(out[names[0]][1], out[name][1], f"k {names[0]} vs {name}")


# --------------------------------------------------------------------- curated feature matrix

QWEN25 = {"hq": 28, "hk": 4, "head_size": 16, "rotary_dim": 16}  # Qwen2.5-VL-7B head counts, small heads
ODD = {"hq": 5, "hk": 3, "head_size": 24, "rotary_dim": 24}
PARTIAL = {"hq": 3, "hk": 1, "head_size": 40, "rotary_dim": 24}  # rotary half 12: not a power of two

# A covering subset of geometry x dtype x layout x neox: every pair of values of two axes runs once (the
# nine cases of a three-level orthogonal array, neox's two values on its third level's place), at token
# counts from 1 to 19 (several token blocks, partial ones).
CASES = [
    # (id, geometry, num_tokens, dtype, layout, neox)
    ("qwen25-f32-chunked-neox", QWEN25, 7, "float32", "chunked", True),
    ("qwen25-bf16-interleaved-gptj", QWEN25, 5, "bfloat16", "interleaved", False),
    ("qwen25-f16-text-neox", QWEN25, 3, "float16", "text", True),
    ("odd-f32-interleaved-neox", ODD, 1, "float32", "interleaved", True),
    ("odd-bf16-text-neox", ODD, 9, "bfloat16", "text", True),
    ("odd-f16-chunked-gptj", ODD, 11, "float16", "chunked", False),
    ("partial-f32-text-gptj", PARTIAL, 13, "float32", "text", False),
    ("partial-bf16-chunked-neox", PARTIAL, 17, "bfloat16", "chunked", True),
    ("partial-f16-interleaved-neox", PARTIAL, 19, "float16", "interleaved", True),
]


def sections_for(rotary_dim, layout):
    half = rotary_dim // 2
    if layout == "text":
        return None
    t = half // 4 or 1
    h = (half - t) // 2
    return [t, h, half - t - h]


@pytest.mark.parametrize("geom,num_tokens,dtype,layout,neox", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bit_identity_matrix(geom, num_tokens, dtype, layout, neox):
    streams = 1 if layout == "text" else 3
    case = make_case(num_tokens * 7 + len(dtype), num_tokens, geom["hq"], geom["hk"], geom["head_size"],
                     geom["rotary_dim"], dtype, streams)
    out = run_all(case, sections_for(geom["rotary_dim"], layout), geom["head_size"], geom["rotary_dim"],
                  layout == "interleaved", neox)
    check_all_equal(out)
    # The rotation did something (not a pass-through) and the tail passed through.
    q = case[0]
    assert not np.array_equal(out["pallas"][0], bits_jax(q)) or num_tokens == 0
    hs, rd = geom["head_size"], geom["rotary_dim"]
    tail_in = bits_jax(q).reshape(num_tokens, -1, hs)[..., rd:]
    assert_same_bits(out["pallas"][0].reshape(num_tokens, -1, hs)[..., rd:], tail_in, "tail")


@pytest.mark.parametrize("table_dtype", ["bfloat16", "float16"])
def test_low_precision_tables(table_dtype):
    case = make_case(3, 6, 5, 3, 24, 24, "bfloat16", 3, table_dtype=table_dtype)
    out = run_all(case, [3, 4, 5], 24, 24, False, True)
    check_all_equal(out, table_dtype)


# tiles past the tokens (11: 32 a block) and past the heads (5 q + 3 k: 8 a block), partial on either
# axis: a tile of one token and one head has the same bits with no masking (its programs: many)
@pytest.mark.parametrize("block_tokens,block_heads", [(2, 8), (32, 2)])
def test_block_sizes_do_not_change_bits(block_tokens, block_heads):
    case = make_case(5, 11, 5, 3, 16, 16, "bfloat16", 3)
    out = run_all(case, [2, 3, 3], 16, 16, True, False, block_tokens=block_tokens,
                  block_heads=block_heads)
    check_all_equal(out)


def test_64_bit_offsets_give_the_same_bits(monkeypatch):
    """The 64-bit offset path (q/k past 2**31 elements) computes what the 32-bit one does."""
    case = make_case(8, 9, 5, 3, 24, 16, "bfloat16", 3)
    args = ([2, 3, 3], 24, 16, False, True)
    q, k, cos, sin = (to_torch(x) for x in case[:4])
    small = kt.mrope(q, k, cos, sin, *args)
    monkeypatch.setattr(kt_mod, "OFFSETS_32_LIMIT", 0)
    large = kt.mrope(q, k, cos, sin, *args)
    for a, b in zip(small, large):
        assert_same_bits(bits_torch(a), bits_torch(b), "64-bit vs 32-bit offsets")


@pytest.mark.parametrize("streams", [1, 3])
def test_zero_tokens(streams):
    case = make_case(0, 0, 3, 1, 16, 16, "bfloat16", streams)
    out = run_all(case, None if streams == 1 else [2, 3, 3], 16, 16, False, True)
    check_all_equal(out)
    assert out["pallas"][0].shape == (0, 48)


def test_many_tokens():
    """num_tokens past 100k (tiny heads, large token blocks keep the interpreters quick)."""
    n = 100_003
    case = make_case(11, n, 1, 1, 8, 8, "bfloat16", 3, max_position=4096)
    blocks = {"block_tokens": 8192, "block_heads": 1}
    q, k, cos, sin, pos, cache = case
    a = kp.mrope_from_cache(jnp.asarray(pos), jnp.asarray(q), jnp.asarray(k), jnp.asarray(cache),
                            [1, 2, 1], 8, 8, **blocks)
    b = kt.mrope_from_cache(to_torch(pos), to_torch(q), to_torch(k), to_torch(cache), [1, 2, 1], 8, 8,
                            **blocks)
    r = kt.mrope_native(to_torch(q), to_torch(k), to_torch(cos), to_torch(sin), [1, 2, 1], 8, 8)
    for x, y, z in zip(a, b, r):
        assert_same_bits(bits_jax(x), bits_torch(y), "pallas vs triton")
        assert_same_bits(bits_torch(y), bits_torch(z), "triton vs torch_ref")


def test_default_tile_plan():
    # one tile plan (kernels_pallas.contract.mrope.default_blocks) serves both packages
    assert kp_mod.default_blocks is kt_mod.default_blocks
    fn = kp_mod.default_blocks
    assert fn(1024, 28, 4, 128) == (1, 32)  # Qwen2.5-VL-7B: one token and all its heads per program
    assert fn(100_000, 5, 3, 24) == (16, 8)  # small heads: 16 tokens fill the tile
    assert fn(1024, 5, 3, 24) == (4, 8)  # ... unless that leaves fewer than 256 programs
    assert fn(8, 8, 8, 64) == (1, 8)  # a streaming step's 8 tokens: one program per token
    assert fn(1024, 64, 8, 128) == (1, 32)  # more heads than a tile holds: the program loops


# -------------------------------------------------------------------------------- hypothesis


@st.composite
def mrope_problems(draw):
    hq = draw(st.integers(1, 6))
    hk = draw(st.integers(1, 3))
    half = draw(st.integers(1, 10))
    rotary_dim = 2 * half
    head_size = rotary_dim + 2 * draw(st.integers(0, 3))
    layout = draw(st.sampled_from(["chunked", "interleaved", "text"]))
    if layout == "text":
        sections = None
    else:
        t = draw(st.integers(0, half))
        h = draw(st.integers(0, half - t))
        sections = [t, h, half - t - h]
    return {
        "num_tokens": draw(st.sampled_from([0, 1, 2, 3, 5, 9, 17, 31])), "hq": hq, "hk": hk,
        "head_size": head_size, "rotary_dim": rotary_dim, "sections": sections, "layout": layout,
        "neox": draw(st.booleans()), "dtype": draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        "seed": draw(st.integers(0, 2**16)),
    }


@settings(max_examples=4, deadline=None, derandomize=True)
@given(mrope_problems())
def test_bit_identity_hypothesis(p):
    streams = 1 if p["layout"] == "text" else 3
    case = make_case(p["seed"], p["num_tokens"], p["hq"], p["hk"], p["head_size"], p["rotary_dim"],
                     p["dtype"], streams)
    out = run_all(case, p["sections"], p["head_size"], p["rotary_dim"], p["layout"] == "interleaved",
                  p["neox"])
    check_all_equal(out)


# ----------------------------------------------------------------------- in place / donation


def test_triton_in_place_on_strided_view():
    """mrope_ rotates a q/k slice of a fused qkv buffer in place, leaving v and the tail alone."""
    q, k, cos, sin, pos, cache = make_case(2, 9, 4, 2, 24, 16, "bfloat16", 3)
    v = np.ones_like(k)
    qkv = to_torch(np.concatenate([q, k, v], 1))
    before = bits_torch(qkv)
    tq, tk = qkv[:, : q.shape[1]], qkv[:, q.shape[1]: q.shape[1] + k.shape[1]]
    assert tq.stride(0) == qkv.shape[1]
    expect = kt.mrope_native(to_torch(q), to_torch(k), to_torch(cos), to_torch(sin), [2, 3, 3], 24, 16)
    rq, _rk = kt.mrope_from_cache_(to_torch(pos), tq, tk, to_torch(cache), [2, 3, 3], 24, 16)
    assert rq.data_ptr() == qkv.data_ptr()
    assert_same_bits(bits_torch(tq), bits_torch(expect[0]), "q in place")
    assert_same_bits(bits_torch(tk), bits_torch(expect[1]), "k in place")
    assert_same_bits(bits_torch(qkv)[:, q.shape[1] + k.shape[1]:], before[:, q.shape[1] + k.shape[1]:], "v")


# Layouts the in-place kernel cannot rotate: its programs are unordered, so an element reachable
# through two indices comes out wrong.  They are refused up front, with nothing written.

IN_PLACE_FORMS = ["mrope_", "mrope_from_cache_"]


def _small_case():
    """4 tokens, q 2 heads, k 1 head of 16, rotary_dim 8, sections [1, 2, 1]."""
    return make_case(3, 4, 2, 1, 16, 8, "float32", 3)


def _rotate_in_place(form, q, k, case):
    _, _, cos, sin, pos, cache = case
    if form == "mrope_":
        return kt.mrope_(q, k, to_torch(cos), to_torch(sin), [1, 2, 1], 16, 8)
    return kt.mrope_from_cache_(to_torch(pos), q, k, to_torch(cache), [1, 2, 1], 16, 8)


def _expected(q, k, case):
    _, _, cos, sin, _, _ = case
    return kt.mrope_native(q.contiguous(), k.contiguous(), to_torch(cos), to_torch(sin), [1, 2, 1], 16, 8)


# (id, q, k) as views of one [6, 48] buffer, and whether they share an element.
QK_LAYOUTS = [
    ("k is q", lambda b: b[:4, :32], lambda b: b[:4, :32], True),
    ("k is q's second head", lambda b: b[:4, :32], lambda b: b[:4, 16:32], True),
    ("k straddles q's end", lambda b: b[:4, :32], lambda b: b[:4, 24:40], True),
    ("k one row down in q", lambda b: b[:4, :32], lambda b: b[1:5, 16:32], True),  # rows 1..3 meet
    ("k flat over q's rows", lambda b: b[:4, :32], lambda b: b.view(-1)[100:164].view(4, 16), True),
    ("fused qkv", lambda b: b[:4, :32], lambda b: b[:4, 32:48], False),
    ("k one row up beside q", lambda b: b[1:5, :32], lambda b: b[:4, 32:48], False),  # extents interleave
    ("k rows below q", lambda b: b[:4, :32], lambda b: b[4:, :32].reshape(-1)[:64].view(4, 16), False),
]


@pytest.mark.parametrize("form", IN_PLACE_FORMS)
@pytest.mark.parametrize("make_q,make_k,shared", [c[1:] for c in QK_LAYOUTS], ids=[c[0] for c in QK_LAYOUTS])
def test_in_place_refuses_q_and_k_sharing_memory(form, make_q, make_k, shared):
    """q and k views of one buffer: refused iff they share an element, which the arithmetic on
    addresses and strides tells apart from disjoint slices (a fused qkv buffer)."""
    case = _small_case()
    buf = to_torch(np.random.default_rng(0).standard_normal((6, 48), np.float32))
    q, k = make_q(buf), make_k(buf)
    before = bits_torch(buf)
    if shared:
        with pytest.raises(ValueError, match=rf"{form}\(q, k\): q and k .*share memory.*separate buffers"):
            _rotate_in_place(form, q, k, case)
        assert_same_bits(bits_torch(buf), before, "buffer changed by a refused call")
    else:
        want = _expected(q, k, case)
        _rotate_in_place(form, q, k, case)
        assert_same_bits(bits_torch(q), bits_torch(want[0]), "q")
        assert_same_bits(bits_torch(k), bits_torch(want[1]), "k")


ROW_LAYOUTS = {
    "expand": lambda base: base[:1].expand(4, -1),  # token stride 0: one row four times
    "as_strided": lambda base: base.as_strided(base.shape, (base.shape[1] // 2, 1)),  # rows half overlap
}


@pytest.mark.parametrize("form", IN_PLACE_FORMS)
@pytest.mark.parametrize("name", ["q", "k"])
@pytest.mark.parametrize("layout", sorted(ROW_LAYOUTS))
def test_in_place_refuses_overlapping_rows(form, name, layout):
    """Rows that overlap in memory (two tokens' elements at one address) are refused, naming the
    argument and the stride, before anything is written."""
    case = _small_case()
    t = {"q": to_torch(case[0]), "k": to_torch(case[1])}
    base = t[name]
    t[name] = ROW_LAYOUTS[layout](base)
    before = {n: bits_torch(x) for n, x in (("base", base), ("q", t["q"]), ("k", t["k"]))}
    stride = "stride 0" if layout == "expand" else f"stride {base.shape[1] // 2}"
    with pytest.raises(ValueError, match=rf"{form}\({name}\): rows overlap in memory \({stride}.*"
                                         rf"{name}\.contiguous\(\)"):
        _rotate_in_place(form, t["q"], t["k"], case)
    after = {n: bits_torch(x) for n, x in (("base", base), ("q", t["q"]), ("k", t["k"]))}
    for n, bits in before.items():
        assert_same_bits(after[n], bits, f"{n} changed by a refused call")


def test_cpu_without_interpreter_says_to_set_triton_interpret():
    """CPU tensors with Triton compiling (no TRITON_INTERPRET): a clear error naming the variable,
    not Triton's "0 active drivers" from inside the launch; the inputs are left alone."""
    code = textwrap.dedent("""
        import torch
        import kernels_triton as kt
        q, k, cos = torch.ones(2, 32), torch.ones(2, 16), torch.zeros(2, 4)
        pos, cache = torch.zeros(2, dtype=torch.long), torch.zeros(4, 8)
        for fn, args in ((kt.mrope_, (q, k, cos, cos)), (kt.mrope_from_cache_, (pos, q, k, cache)),
                         (kt.mrope, (q, k, cos, cos))):
            try:
                fn(*args, None, 16, 8)
                print("no error")
            except RuntimeError as e:
                print(e)
        print(bool((q == 1).all() and (k == 1).all()))
    """)
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4, r.stdout
    for line, fn in zip(lines, ["mrope_", "mrope_from_cache_", "mrope_"]):
        assert line.startswith(f"kernels_triton.{fn}: q is on the CPU and Triton is not interpreting"), line
        assert "set TRITON_INTERPRET=1 before importing triton" in line, line
    assert lines[3] == "True", "inputs changed by a refused call"


@pytest.mark.parametrize("layout", ["expand", "as_strided", "transposed", "k is q"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_out_of_place_takes_any_layout(layout, grad):
    """The out-of-place forms rotate copies of their own, so the layouts the in-place forms refuse
    (and a last dimension that is not contiguous) work there, inputs untouched."""
    case = _small_case()
    src = to_torch(case[0]).requires_grad_(grad)
    k = to_torch(case[1])
    if layout == "transposed":
        q = src.t().contiguous().t()  # strides (1, 4)
    elif layout == "k is q":
        q = k = src
    else:
        q = ROW_LAYOUTS[layout](src)
    before = (bits_torch(q), bits_torch(k))
    want = _expected(q.detach(), k, case)
    _, _, cos, sin, pos, cache = case
    for got in (kt.mrope(q, k, to_torch(cos), to_torch(sin), [1, 2, 1], 16, 8),
                kt.mrope_from_cache(to_torch(pos), q, k, to_torch(cache), [1, 2, 1], 16, 8)):
        assert_same_bits(bits_torch(got[0]), bits_torch(want[0]), "q")
        assert_same_bits(bits_torch(got[1]), bits_torch(want[1]), "k")
        if grad:
            (got[0].sum() + got[1].sum()).backward()
            assert src.grad is not None and src.grad.shape == src.shape
            src.grad = None
    assert_same_bits(bits_torch(q), before[0], "q changed")
    assert_same_bits(bits_torch(k), before[1], "k changed")


def test_pallas_donated_jit():
    q, k, cos, sin, pos, cache = make_case(4, 6, 5, 3, 24, 16, "float32", 3)
    fn = jax.jit(functools.partial(kp.mrope_from_cache, mrope_section=[2, 3, 3], head_size=24,
                                   rotary_dim=16), donate_argnums=(1, 2))
    expect = kp.mrope_native(jnp.asarray(q), jnp.asarray(k), jnp.asarray(cos), jnp.asarray(sin),
                             [2, 3, 3], 24, 16)
    got = fn(jnp.asarray(pos), jnp.asarray(q), jnp.asarray(k), jnp.asarray(cache))
    for g, e in zip(got, expect):
        assert_same_bits(bits_jax(g), bits_jax(e), "donated")


def test_out_of_range_positions_under_jit_give_nan_not_garbage():
    """Traced positions cannot be checked on the host: the kernels mask the row to NaN."""
    q, k, _cos, _sin, pos, cache = make_case(6, 4, 2, 1, 8, 8, "float32", 3, max_position=16)
    pos = pos.copy()
    pos[1, 2] = 16  # token 2, stream h: one past the end
    fn = jax.jit(functools.partial(kp.mrope_from_cache, mrope_section=[1, 2, 1], head_size=8, rotary_dim=8))
    jq, _ = fn(jnp.asarray(pos), jnp.asarray(q), jnp.asarray(k), jnp.asarray(cache))
    tq, _ = kt.mrope_from_cache(to_torch(pos), to_torch(q), to_torch(k), to_torch(cache), [1, 2, 1], 8, 8,
                                check_positions=False)
    for x in (np.asarray(jq), tq.cpu().numpy()):
        bad = np.isnan(x).reshape(4, 2, 8)
        assert bad[2].any() and not bad[[0, 1, 3]].any()


@pytest.mark.parametrize("streams", [1, 3])
def test_out_of_range_positions_without_the_check_reach_no_cache_row_in_the_backward(streams):
    """check_positions=False: an out-of-range position reads no cache row (its frequencies NaN), so the
    torch backward gathers none for it either (it raised IndexError) and credits the cache nothing;
    q's and k's cotangents are the Pallas twin's (jit: the positions traced), bit for bit, and the
    cache's is the Pallas twin's (which credits no row to those tokens either) up to the order of the sums."""
    q, k, _cos, _sin, pos, cache = make_case(6, 4, 2, 1, 8, 8, "float32", streams, max_position=16)
    pos = np.minimum(pos, 14)  # row 15: read by no valid position
    bad = (2, 3) if streams == 1 else ((1, 2), (2, 3))  # whole tokens; or token 2's h and token 3's w stream
    pos[bad[0]], pos[bad[1]] = 16, -1  # past the end (JAX's gather clamps it to 15), before the start (wraps)
    kw = {"mrope_section": None if streams == 1 else [1, 2, 1], "head_size": 8, "rotary_dim": 8}
    rng = np.random.default_rng(1)
    weights = [rng.standard_normal(x.shape, np.float32) for x in (q, k)]
    for nan_rows in ("weighted", "zero"):
        if nan_rows == "zero":
            for w in weights:
                w[2:] = 0
        tq, tk, tc = _loss_grads_torch(functools.partial(kt.mrope_from_cache, check_positions=False, **kw),
                                       (to_torch(pos),), map(to_torch, (q, k, cache)), [to_torch(w) for w in weights])
        jq, jk, jc = _loss_grads_jax(functools.partial(kp.mrope_from_cache, **kw),
                                     [jnp.asarray(x) for x in (pos, q, k, cache)], [jnp.asarray(w) for w in weights],
                                     (1, 2, 3))
        assert_same_bits(bits_jax(jq), bits_torch(tq), f"dq, {nan_rows}")
        assert_same_bits(bits_jax(jk), bits_torch(tk), f"dk, {nan_rows}")
        tc = tc.cpu().numpy()
        assert not tc[15].any() and np.isfinite(tc).all() and np.abs(tc).max() > 0.1
        np.testing.assert_allclose(np.asarray(jc), tc, rtol=1e-5, atol=1e-5)  # neither credits row 15 (-1's wrap)


# ------------------------------------------------------------------------- JAX transformations


TRANSFORM_KW = {"mrope_section": (2, 3, 3), "head_size": 24, "rotary_dim": 16, "mrope_interleaved": True}


class TestPallasUnderTransformations(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_same_bits_with_and_without_jit(self):
        q, k, cos, sin, pos, cache = make_case(12, 9, 5, 3, 24, 16, "bfloat16", 3)
        expect = kt.mrope(*map(to_torch, (q, k, cos, sin)), **TRANSFORM_KW)
        for fn, args in ((kp.mrope, (q, k, cos, sin)), (kp.mrope_from_cache, (pos, q, k, cache))):
            out = self.variant(functools.partial(fn, **TRANSFORM_KW))(*map(jnp.asarray, args))
            chex.assert_trees_all_equal_shapes_and_dtypes(out, (jnp.asarray(q), jnp.asarray(k)))
            for got, want in zip(out, expect):
                assert_same_bits(bits_jax(got), bits_torch(want), f"{fn.__name__} vs triton")

    def test_vmap_over_sequences_equals_one_call_each(self):
        cases = [make_case(20 + b, 6, 5, 3, 24, 16, "float32", 3) for b in range(3)]
        stacked = [jnp.stack([jnp.asarray(c[i]) for c in cases]) for i in range(4)]
        out = jax.jit(jax.vmap(functools.partial(kp.mrope, **TRANSFORM_KW)))(*stacked)
        for b, case in enumerate(cases):
            one = kp.mrope(*map(jnp.asarray, case[:4]), **TRANSFORM_KW)
            for got, want in zip(out, one):
                assert_same_bits(bits_jax(got[b]), bits_jax(want), f"vmap row {b}")


# -------------------------------------------------------------------------------- gradients

# Each layout, neox value and dtype at least once: the index maps' combinations with the dtypes are the
# forward matrix's (CASES, every pair); the backward is the same kernel with -sin.
GRAD_CASES = [("chunked", True, "float32"), ("interleaved", False, "bfloat16"), ("text", True, "bfloat16")]


def _loss_grads_jax(fn, primals, weights, argnums):
    def loss(*args):
        q, k = fn(*args)
        return (q.astype(jnp.float32) * weights[0]).sum() + (k.astype(jnp.float32) * weights[1]).sum()

    return jax.jit(jax.grad(loss, argnums=argnums))(*primals)


def _loss_grads_torch(fn, fixed, primals, weights):
    leaves = [t.clone().requires_grad_() for t in primals]
    q, k = fn(*fixed, *leaves)
    ((q.float() * weights[0]).sum() + (k.float() * weights[1]).sum()).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("layout,neox,dtype", GRAD_CASES)
def test_gradients_match_autodiff_of_the_references(layout, neox, dtype):
    """q/k cotangents are the kernel run with -sin: bit-identical to autodiff of the references.
    cos/sin/cache cotangents sum over heads in another order: equal to float32 rounding."""
    streams = 1 if layout == "text" else 3
    q, k, cos, sin, pos, cache = make_case(9, 7, 5, 3, 24, 16, dtype, streams, max_position=11)
    rng = np.random.default_rng(1)
    weights = [rng.standard_normal(x.shape, np.float32) for x in (q, k)]
    sec = sections_for(16, layout)
    kw = {"mrope_section": sec, "head_size": 24, "rotary_dim": 16, "mrope_interleaved": layout == "interleaved",
          "is_neox_style": neox}
    jw = [jnp.asarray(w) for w in weights]
    tw = [to_torch(w) for w in weights]
    table = [jnp.asarray(x) for x in (q, k, cos, sin)]
    grads = {
        "pallas": _loss_grads_jax(functools.partial(kp.mrope, **kw), table, jw, (0, 1, 2, 3)),
        "jnp_ref": _loss_grads_jax(functools.partial(kp.mrope_native, **kw), table, jw, (0, 1, 2, 3)),
        "triton": _loss_grads_torch(functools.partial(kt.mrope, **kw), (), map(to_torch, (q, k, cos, sin)), tw),
        "torch_ref": _loss_grads_torch(functools.partial(kt.mrope_native, **kw), (), map(to_torch, (q, k, cos, sin)),
                                       tw),
    }
    cached = [jnp.asarray(pos), jnp.asarray(q), jnp.asarray(k), jnp.asarray(cache)]
    grads_cache = {
        "pallas": _loss_grads_jax(functools.partial(kp.mrope_from_cache, **kw), cached, jw, (1, 2, 3)),
        "jnp_ref": _loss_grads_jax(functools.partial(kp.mrope_from_cache_native, **kw), cached, jw, (1, 2, 3)),
        "triton": _loss_grads_torch(functools.partial(kt.mrope_from_cache, **kw), (to_torch(pos).long(),),
                                    map(to_torch, (q, k, cache)), tw),
        "torch_ref": _loss_grads_torch(functools.partial(kt.mrope_from_cache_native, **kw),
                                       (to_torch(pos).long(),), map(to_torch, (q, k, cache)), tw),
    }
    for form in (grads, grads_cache):
        as_bits = {n: [bits_jax(g) if n in ("pallas", "jnp_ref") else bits_torch(g) for g in gs]
                   for n, gs in form.items()}
        for i, what in enumerate(("dq", "dk")):
            for name in ("triton", "torch_ref"):
                assert_same_bits(as_bits["pallas"][i], as_bits[name][i], f"{what} pallas vs {name}")
            if dtype == "float32":  # XLA contracts the jitted reference's backward into FMAs
                np.testing.assert_allclose(np.asarray(form["pallas"][i]), np.asarray(form["jnp_ref"][i]),
                                           rtol=1e-6, atol=1e-6, err_msg=f"{what} pallas vs jnp_ref")
            else:  # ... which the rounding to bfloat16 hides here
                assert_same_bits(as_bits["pallas"][i], as_bits["jnp_ref"][i], f"{what} pallas vs jnp_ref")
        for name in ("jnp_ref", "triton", "torch_ref"):
            for i in range(2, len(form[name])):
                ref = np.asarray(form[name][i].float().cpu() if name in ("triton", "torch_ref") else form[name][i],
                                 np.float32)
                np.testing.assert_allclose(np.asarray(form["pallas"][i], np.float32), ref, rtol=1e-5, atol=1e-5)
                assert np.abs(ref).max() > 0.1  # the tables do get a gradient


def test_in_place_forms_refuse_autograd():
    q, k, cos, sin, pos, cache = make_case(2, 4, 2, 1, 16, 8, "float32", 3)
    tq, tk = to_torch(q).requires_grad_(), to_torch(k)
    with pytest.raises(ValueError, match="q requires grad"):
        kt.mrope_(tq, tk, to_torch(cos), to_torch(sin), [1, 2, 1], 16, 8)
    with pytest.raises(ValueError, match="cos_sin_cache requires grad"):
        kt.mrope_from_cache_(to_torch(pos), to_torch(k).new_zeros(4, 32), tk, to_torch(cache).requires_grad_(),
                             [1, 2, 1], 16, 8)
    with torch.no_grad():  # outside autograd the in-place form is fine
        kt.mrope_(tq, tk, to_torch(cos), to_torch(sin), [1, 2, 1], 16, 8)


def test_a_second_derivative_is_refused_not_silently_zero():
    """The out-of-place forms' backward runs the kernel, which records no graph: a backward with
    create_graph=True raises NotImplementedError rather than a gradient whose own derivative is zero."""
    q, k, cos, sin, pos, cache = make_case(2, 4, 2, 1, 16, 8, "float32", 3)
    tq = to_torch(q).requires_grad_()
    for call in (lambda: kt.mrope(tq, to_torch(k), to_torch(cos), to_torch(sin), [1, 2, 1], 16, 8),
                 lambda: kt.mrope_from_cache(to_torch(pos), tq, to_torch(k), to_torch(cache), [1, 2, 1], 16, 8)):
        out = call()[0]
        with pytest.raises(NotImplementedError, match=r"^mrope: the twin kernels have no second derivative"):
            torch.autograd.grad((out ** 2).sum(), tq, create_graph=True)


# ----------------------------------------------------------------------------------- errors


def _good():
    q, k, cos, sin, pos, cache = make_case(1, 4, 2, 1, 16, 8, "float32", 3)
    return {"q": q, "k": k, "cos": cos, "sin": sin, "pos": pos, "cache": cache, "sec": [1, 2, 1], "hs": 16, "rd": 8}


def _bad(**over):
    g = _good()
    g.update(over)
    return g


ERROR_CASES = [
    ("odd rotary", _bad(rd=7), "rotary_dim"),
    ("rotary > head", _bad(rd=32, cos=np.zeros((3, 4, 16), np.float32), sin=np.zeros((3, 4, 16), np.float32),
                           cache=np.zeros((97, 32), np.float32), sec=[4, 6, 6]), "rotary_dim"),
    ("head_size 0", _bad(hs=0), "head_size"),
    ("sections sum", _bad(sec=[1, 1, 1]), "mrope_section"),
    ("sections len", _bad(sec=[2, 2]), "mrope_section"),
    ("sections negative", _bad(sec=[-1, 3, 2]), "mrope_section"),
    ("sections missing", _bad(sec=None), "mrope_section"),
    ("q not multiple", _bad(q=np.zeros((4, 30), np.float32)), "q.shape[1]"),
    ("q 3-D", _bad(q=np.zeros((4, 2, 16), np.float32)), "q must be 2-D"),
    ("token mismatch", _bad(k=np.zeros((5, 16), np.float32)), "num_tokens"),
    ("q int", _bad(q=np.zeros((4, 32), np.int32), k=np.zeros((4, 16), np.int32)), "q dtype"),
    ("q float64", _bad(q=np.zeros((4, 32), np.float64), k=np.zeros((4, 16), np.float64)), "q dtype"),
    ("k dtype", _bad(k=np.zeros((4, 16), np.float16)), "k dtype"),
    ("cos shape", _bad(cos=np.zeros((3, 4, 5), np.float32)), "cos must have shape"),
    ("cos 2 streams", _bad(cos=np.zeros((2, 4, 4), np.float32), sin=np.zeros((2, 4, 4), np.float32)),
     "cos must have shape"),
    ("sin vs cos", _bad(sin=np.zeros((4, 4), np.float32)), "same shape"),
    ("cos dtype", _bad(cos=np.zeros((3, 4, 4), np.int32)), "cos dtype"),
]

CACHE_ERROR_CASES = [
    ("position too large", _bad(pos=np.full((3, 4), 97, np.int32)), "positions must lie"),
    ("position negative", _bad(pos=np.full((3, 4), -1, np.int32)), "positions must lie"),
    ("position past int32", _bad(pos=np.full((3, 4), 2**32 + 5, np.int64)), "positions must lie"),
    ("positions float", _bad(pos=np.zeros((3, 4), np.float32)), "positions dtype"),
    ("positions int16", _bad(pos=np.zeros((3, 4), np.int16)), "positions dtype must be int32 or int64, got int16"),
    ("positions uint32", _bad(pos=np.zeros((3, 4), np.uint32)), "positions dtype must be int32 or int64, got uint32"),
    ("positions shape", _bad(pos=np.zeros((2, 4), np.int32)), "positions must have shape"),
    ("positions tokens", _bad(pos=np.zeros((3, 5), np.int32)), "positions must have shape"),
    ("cache shape", _bad(cache=np.zeros((97, 6), np.float32)), "cos_sin_cache must have shape"),
    ("cache dtype", _bad(cache=np.zeros((97, 8), np.float16)), "cos_sin_cache dtype"),
    ("sections sum", _bad(sec=[4, 0, 1]), "mrope_section"),
    ("odd rotary", _bad(rd=7), "rotary_dim"),
]


def _call_pallas(g, cache_form, **kw):
    # numpy in, so that float64 reaches the check (jnp.asarray would make it float32).
    if cache_form:
        return kp.mrope_from_cache(g["pos"], g["q"], g["k"], g["cache"], g["sec"], g["hs"], g["rd"], **kw)
    return kp.mrope(g["q"], g["k"], g["cos"], g["sin"], g["sec"], g["hs"], g["rd"], **kw)


def _call_triton(g, cache_form, **kw):
    t = {name: torch.from_numpy(np.asarray(g[name])) for name in ("q", "k", "cos", "sin", "pos", "cache")}
    if cache_form:
        return kt.mrope_from_cache(t["pos"], t["q"], t["k"], t["cache"], g["sec"], g["hs"], g["rd"], **kw)
    return kt.mrope(t["q"], t["k"], t["cos"], t["sin"], g["sec"], g["hs"], g["rd"], **kw)


@pytest.mark.parametrize("impl", [_call_pallas, _call_triton], ids=["pallas", "triton"])
@pytest.mark.parametrize("g,match", [c[1:] for c in ERROR_CASES], ids=[c[0] for c in ERROR_CASES])
def test_errors(impl, g, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        impl(g, cache_form=False)


@pytest.mark.parametrize("impl", [_call_pallas, _call_triton], ids=["pallas", "triton"])
@pytest.mark.parametrize("g,match", [c[1:] for c in CACHE_ERROR_CASES], ids=[c[0] for c in CACHE_ERROR_CASES])
def test_cache_errors(impl, g, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        impl(g, cache_form=True)


@pytest.mark.parametrize("impl", [_call_pallas, _call_triton], ids=["pallas", "triton"])
@pytest.mark.parametrize("kw,match", [
    ({"block_tokens": 3}, "block_tokens"),
    ({"block_heads": 0}, "block_heads"),
    ({"num_warps": 3}, "num_warps must be a power of two in 1..32, got 3"),
    ({"num_warps": True}, "num_warps must be a power of two in 1..32, got True"),
])
def test_block_size_errors(impl, kw, match):
    with pytest.raises(ValueError, match=match):
        impl(_good(), cache_form=False, **kw)


def test_tables_that_are_not_arrays_are_named():
    g = _good()
    t = {name: torch.from_numpy(g[name]) for name in ("q", "k", "sin")}
    with pytest.raises(ValueError, match="cos must be a torch.Tensor, got list"):
        kt.mrope(t["q"], t["k"], g["cos"].tolist(), t["sin"], g["sec"], g["hs"], g["rd"])
    with pytest.raises(ValueError, match="cos must be a jax array, got list"):
        kp.mrope(g["q"], g["k"], g["cos"].tolist(), g["sin"], g["sec"], g["hs"], g["rd"])


@pytest.mark.parametrize("flag", ["mrope_interleaved", "is_neox_style"])
def test_flag_errors(flag):
    g = _good()
    with pytest.raises(ValueError, match=flag):
        kp.mrope(jnp.asarray(g["q"]), jnp.asarray(g["k"]), jnp.asarray(g["cos"]), jnp.asarray(g["sin"]),
                 g["sec"], 16, 8, **{flag: 1})
    t = [torch.from_numpy(g[n]) for n in ("q", "k", "cos", "sin")]
    with pytest.raises(ValueError, match=flag):
        kt.mrope(*t, g["sec"], 16, 8, **{flag: "yes"})


@pytest.mark.parametrize("streams,neox", [(3, True), (1, False)])
def test_mosaic_backend_rotates_with_the_kernels_bits(streams, neox, monkeypatch):
    """PERSONAPLEX_PALLAS_BACKEND=mosaic_gpu (no MRoPE kernel there yet: XLA's fusion of the reference):
    both forms give the Triton-backend kernel's bits, and a traced position past the cache still makes
    its token's rotated elements NaN."""
    from kernels_pallas import backend

    sections = [2, 3, 3] if streams == 3 else None
    q, k, cos, sin, pos, cache = make_case(21, 7, 3, 2, 24, 16, "bfloat16", streams)
    args = (sections, 24, 16, False, neox)
    calls = (lambda p: kp.mrope(jnp.asarray(q), jnp.asarray(k), jnp.asarray(cos), jnp.asarray(sin), *args),
             lambda p: jax.jit(lambda p: kp.mrope_from_cache(p, jnp.asarray(q), jnp.asarray(k), jnp.asarray(cache),
                                                             *args))(p))
    bad = pos.copy()
    bad[..., 4] = cache.shape[0]
    monkeypatch.delenv(backend.VARIABLE, raising=False)
    want = [f(jnp.asarray(p)) for f in calls for p in (pos, bad)]
    monkeypatch.setenv(backend.VARIABLE, "mosaic_gpu")
    got = [f(jnp.asarray(p)) for f in calls for p in (pos, bad)]
    for i, (g, w) in enumerate(zip(got, want)):
        for a, b in zip(g, w):
            assert_same_bits(bits_jax(a), bits_jax(b), f"call {i}")
    nan = np.isnan(np.asarray(got[3][0], np.float32)).reshape(7, 3, 24)
    assert nan[4, :, :16].all() and not nan[4, :, 16:].any() and not np.delete(nan, 4, axis=0).any()
