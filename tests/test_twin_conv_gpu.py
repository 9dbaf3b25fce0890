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
from tests.test_grad_gpu import C, rand
from tests.test_twin_conv import host, same
from torch_bridge.codec import MimiCodec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or jax.default_backend() != "gpu",
                                reason="needs a CUDA GPU: the compiled codec twins (CPU-only machine)")

ROWS = 3
BF16 = "bfloat16"
ACTIVE, FIRST = np.array([True, False, True]), np.array([True, True, False])


def codec_convolutions() -> list[tuple[str, dict]]:
    """(kind, arguments) of each distinct convolution the real codec's twin encode and decode call:
    the shapes, whether bias and residual are given, the carry's width and the static arguments, traced
    without running (`jax.eval_shape`) with the twin module's convolutions spied on."""
    cfg = CODEC_PRESETS["mimi"]
    seen: dict = {}

    def spy(kind, fn):
        def call(x, w, bias=None, **kw):
            carry, residual, slot = kw.get("carry"), kw.get("residual"), kw.get("carry_slot")
            static = tuple(sorted((k, v) for k, v in kw.items()
                                  if k not in ("carry", "carry_slot", "active", "first", "residual")))
            width = None if carry is None else slot[1] if slot else carry.shape[-1]  # the codec's: row-packed
            seen.setdefault((kind, tuple(x.shape), tuple(w.shape), bias is not None,
                             None if residual is None else tuple(residual.shape), width, static), None)
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


def test_every_codec_convolution_pallas_equals_triton():
    """Each convolution of the real codec's encode and decode, on random bf16 inputs with a NaN in one
    row: the Pallas twin compiled for the GPU and the Triton twin give the same bits, output and
    new carry; the other rows do not see the NaN."""
    convolutions = codec_convolutions()
    kinds = {kind for kind, _ in convolutions}
    assert kinds == {"conv1d", "conv_transpose1d"} and len(convolutions) >= 20, (kinds, len(convolutions))
    rng = np.random.default_rng(0)
    for kind, a in convolutions:
        x = rand(rng, a["x"], BF16, 2.0)
        x[1, 0, -1] = np.nan
        w = rand(rng, a["w"], BF16, 0.3)
        bias = rand(rng, (a["w"][0] if kind == "conv1d" else a["w"][1] * a.get("groups", 1),), BF16) if a["bias"] else None
        what = f"{kind} x{a['x']} w{a['w']} {a}"
        if kind == "conv_transpose1d":
            static = {k: a[k] for k in ("stride", "groups", "elu") if k in a}
            got = jax.jit(lambda x, w, b, static=static: pallas.conv_transpose1d(x, w, b, **static))(
                jnp.asarray(x), jnp.asarray(w), None if bias is None else jnp.asarray(bias))
            want = triton_twin.conv_transpose1d(C(x), C(w), C(bias), **static)
            assert same(got, want.cpu()), what
            continue
        static = {k: a[k] for k in ("stride", "dilation", "elu", "replicate") if k in a}
        residual = None if a["residual"] is None else rand(rng, a["residual"], BF16)
        streamed = {}
        if a["width"] is not None:
            carry = rand(rng, a["x"][:2] + (a["width"],), BF16)
            streamed = {"carry": carry, "active": ACTIVE, "first": FIRST}
        got = jax.jit(lambda x, w, b, r, s, static=static: pallas.conv1d(x, w, b, residual=r, **s, **static))(
            jnp.asarray(x), jnp.asarray(w), None if bias is None else jnp.asarray(bias),
            None if residual is None else jnp.asarray(residual), {k: jnp.asarray(v) for k, v in streamed.items()})
        want = triton_twin.conv1d(C(x), C(w), C(bias), residual=C(residual),
                                  **{k: C(v) for k, v in streamed.items()}, **static)
        got, want = (got, want) if streamed else ((got,), (want,))
        for g, t, part in zip(got, want, ("y", "new carry"), strict=False):
            assert same(g, t.cpu()), f"{what}: {part}"
        assert not np.isnan(host(want[0].cpu())[[0, 2]]).any(), f"{what}: the NaN reached another row"


def test_nearest_over_a_real_codebook_pallas_equals_triton():
    """A Mimi codebook (2,048 entries of 256, searched by several programs a row): a row equal to entry 5,
    whose copy sits at entry 2,000 (another program's: the first wins); a NaN row (entry 0); a row whose
    distances overflow to inf (entry 0); the rest random, where the search agrees with torch.cdist."""
    rng = np.random.default_rng(1)
    entries = rand(rng, (2048, 256), BF16)
    entries[2000] = entries[5]
    x = rand(rng, (64, 256), BF16)
    x[0], x[1, 7], x[2] = entries[5], np.nan, np.float32(3e38)
    got = jax.jit(pallas.nearest)(jnp.asarray(x), jnp.asarray(entries))
    want = triton_twin.nearest(C(x), C(entries))
    assert np.array_equal(np.asarray(got), want.cpu().numpy())
    assert want[0] == 5 and want[1] == 0 and want[2] == 0
    dist = torch.cdist(C(x)[3:].float(), C(entries).float())
    assert torch.equal(want[3:].long(), dist.argmin(dim=1))
