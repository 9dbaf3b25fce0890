"""The codec's twin kernels compiled on a GPU (skipped on a machine without CUDA): Pallas compiled for
the GPU against its Triton twin, bit for bit, at every convolution the Mimi codec (as Moshi and
PersonaPlex ship it) makes in its encode and decode (found by tracing them): the taps with their carry
(rows inactive and first), the linear on them in its MMA form, bias and residual; the transposed
convolutions; the nearest-entry search over a real codebook (2,048 entries of 256) with a tie across
the programs that search a row, a NaN row and an overflowing row. The CPU counterparts (interpreted):
`test_twin_conv.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl import codec as jax_codec
from jax_impl.codec_config import CODEC_PRESETS
from kernels_pallas import twin_conv as pallas
from kernels_triton import twin_conv as triton_twin
from tests.test_twin import NP, to_torch
from torch_bridge.codec import MimiCodec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu",
                                reason="needs a CUDA GPU: the compiled codec twins (CPU-only machine)")

ROWS = 3
ACTIVE, FIRST = np.array([True, False, True]), np.array([True, True, False])


def bits(a) -> np.ndarray:
    """The bit patterns of a JAX array or torch tensor, every NaN as one pattern (payloads are not
    part of the contract)."""
    a = a.detach().cpu() if isinstance(a, torch.Tensor) else a
    a = np.asarray(a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a, np.float32)
    return np.where(np.isnan(a), np.float32(np.nan), a).view(np.uint32)


def assert_same(p, t, what: str) -> None:
    P, T = bits(p), bits(t)
    assert P.shape == T.shape, (what, P.shape, T.shape)
    bad = np.flatnonzero(P.ravel() != T.ravel())
    assert bad.size == 0, f"{what}: {bad.size} of {P.size} elements differ, first at {bad[:5]}"


def codec_convolutions() -> list[tuple[str, dict]]:
    """(kind, arguments) of each distinct convolution the real codec's twin encode and decode call:
    the shapes, whether bias and residual are given, the carry's width and the static arguments, traced
    without running (`jax.eval_shape`) with the twin module's convolutions spied on."""
    cfg = CODEC_PRESETS["mimi"]
    seen: dict = {}

    def spy(kind, fn):
        def call(x, w, bias=None, **kw):
            carry, residual = kw.get("carry"), kw.get("residual")
            static = tuple(sorted((k, v) for k, v in kw.items() if k not in ("carry", "active", "first", "residual")))
            seen.setdefault((kind, tuple(x.shape), tuple(w.shape), bias is not None,
                             None if residual is None else tuple(residual.shape),
                             None if carry is None else carry.shape[-1], static), None)
            return fn(x, w, bias, **kw)
        return call

    codec = MimiCodec.from_config(cfg, dtype=torch.bfloat16, device="cuda")
    encode = jax_codec.encode_fn(cfg, kernels="twin", rope_freqs=codec.rope_freqs())
    decode = jax_codec.decode_fn(cfg, kernels="twin", rope_freqs=codec.rope_freqs())
    state = jax_codec.init_codec_state(cfg, ROWS, jnp.bfloat16)
    pcm = jax.ShapeDtypeStruct((ROWS, 1, cfg.frame_size), jnp.bfloat16)
    active = jax.ShapeDtypeStruct((ROWS,), jnp.bool_)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pallas, "conv1d", spy("conv1d", pallas.conv1d))
        mp.setattr(pallas, "conv_transpose1d", spy("conv_transpose1d", pallas.conv_transpose1d))
        codes, state = jax.eval_shape(encode, codec.jax_params(), state, pcm, active)
        jax.eval_shape(decode, codec.jax_params(), state, codes, active)
    return [(kind, {"x": x, "w": w, "bias": b, "residual": r, "width": width, **dict(static)})
            for kind, x, w, b, r, width, static in seen]


def rand(rng, shape, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(NP["bfloat16"])


def test_every_codec_convolution_pallas_equals_triton():
    """Each convolution of the real codec's encode and decode, on random bf16 inputs with a NaN in one
    row: the Pallas twin compiled for the GPU and the Triton twin give the same bits, output and
    new carry; the other rows do not see the NaN."""
    convolutions = codec_convolutions()
    kinds = {kind for kind, _ in convolutions}
    assert kinds == {"conv1d", "conv_transpose1d"} and len(convolutions) >= 20, (kinds, len(convolutions))
    rng = np.random.default_rng(0)
    for kind, a in convolutions:
        x = rand(rng, a["x"], 2.0)
        x[1, 0, -1] = np.nan
        w = rand(rng, a["w"], 0.3)
        bias = rand(rng, (a["w"][0] if kind == "conv1d" else a["w"][1] * a.get("groups", 1),)) if a["bias"] else None
        what = f"{kind} x{a['x']} w{a['w']} {a}"
        if kind == "conv_transpose1d":
            static = {k: a[k] for k in ("stride", "groups", "elu") if k in a}
            got = jax.jit(lambda x, w, b, static=static: pallas.conv_transpose1d(x, w, b, **static))(
                jnp.asarray(x), jnp.asarray(w), None if bias is None else jnp.asarray(bias))
            want = triton_twin.conv_transpose1d(C(x), C(w), C(bias), **static)
            assert_same(got, want, what)
            continue
        static = {k: a[k] for k in ("stride", "dilation", "elu", "replicate") if k in a}
        residual = None if a["residual"] is None else rand(rng, a["residual"])
        streamed = {}
        if a["width"] is not None:
            carry = rand(rng, a["x"][:2] + (a["width"],))
            streamed = {"carry": carry, "active": ACTIVE, "first": FIRST}
        got = jax.jit(lambda x, w, b, r, s, static=static: pallas.conv1d(x, w, b, residual=r, **s, **static))(
            jnp.asarray(x), jnp.asarray(w), None if bias is None else jnp.asarray(bias),
            None if residual is None else jnp.asarray(residual), {k: jnp.asarray(v) for k, v in streamed.items()})
        want = triton_twin.conv1d(C(x), C(w), C(bias), residual=C(residual),
                                  **{k: C(v) for k, v in streamed.items()}, **static)
        got, want = (got, want) if streamed else ((got,), (want,))
        for g, t, part in zip(got, want, ("y", "new carry"), strict=False):
            assert_same(g, t, f"{what}: {part}")
        y = bits(want[0])
        assert not np.isnan(y[[0, 2]].view(np.float32)).any(), f"{what}: the NaN reached another row"


def C(a):
    """numpy (bf16 or bool) -> a torch CUDA tensor with the same bits; None stays None."""
    if a is None:
        return None
    return (torch.from_numpy(a) if a.dtype == np.bool_ else to_torch(a)).cuda()


def test_nearest_over_a_real_codebook_pallas_equals_triton():
    """A Mimi codebook (2,048 entries of 256, searched by several programs a row): a row equal to entry 5,
    whose copy sits at entry 2,000 (another program's: the first wins); a NaN row (entry 0); a row whose
    distances overflow to inf (entry 0); the rest random, where the search agrees with torch.cdist."""
    rng = np.random.default_rng(1)
    entries = rand(rng, (2048, 256))
    entries[2000] = entries[5]
    x = rand(rng, (64, 256))
    x[0], x[1, 7], x[2] = entries[5], np.nan, np.float32(3e38)
    got = jax.jit(pallas.nearest)(jnp.asarray(x), jnp.asarray(entries))
    want = triton_twin.nearest(C(x), C(entries))
    assert np.array_equal(np.asarray(got), want.cpu().numpy())
    assert want[0] == 5 and want[1] == 0 and want[2] == 0
    dist = torch.cdist(C(x)[3:].float(), C(entries).float())
    assert torch.equal(want[3:].long(), dist.argmin(dim=1))
